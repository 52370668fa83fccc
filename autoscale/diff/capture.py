"""Capture for a graph diff: the model's graphs before and after autoscale's pipeline, forward and backward.

:func:`capture_graphs` compiles a private deep copy of the model with a Dynamo backend that, for
each graph it is handed, keeps a copy of the graph as captured, runs the pipeline exactly as
the backend does (``autoscale.rewrite.rewrite_graph``), and runs AOTAutograd on both
graphs (the joint-stage passes on the rewritten one) to get the backward graphs. Each pass is
wrapped only to observe what it erased: a folded cast leaves no trace in the graph afterwards.
The user's model is never touched, and the backend hands Dynamo the unrewritten graph to run.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.fx import GraphModule, Node

from autoscale.config import Config
from autoscale.inspect import PrecisionReport, format_graph
from autoscale.layer_numbers import LayerNumbers, layer_parts, measure_layers, predict_layers
from autoscale.passes import PIPELINE, PassRecord, PassSpec, run_stage
from autoscale.passes.dynamo.insert_grad_scaling import ScalePoint, insert_grad_scaling, scale_points
from autoscale.passes.graph_utils import (
    PROVENANCE_KEY,
    attach_of,
    cast_of,
    copy_graph_module,
    input_path,
)
from autoscale.protocol import LAYOUT_SEP
from autoscale.rewrite import reach_state, rewrite_graph
from autoscale.runtime import (
    _PEAKS,
    _SCALES,
    _STATE_ATTR,
    _STATS,
    ScaleState,
    install_state,
    recoded_forward,
    unwrap,
)

__all__ = ["CapturedGraph", "capture_graphs", "display_names", "input_paths", "node_lines"]


def capture_graphs(model: nn.Module, example_inputs: Sequence[Any], cfg: Config, *,
                   measure: bool = False) -> list[CapturedGraph]:
    """What the pipeline saw and did for each of ``model``'s graphs (one per graph break), captured
    from a private copy of ``model`` that runs one forward (Dynamo has to execute a frame to
    capture it). ``measure``: also run each graph once in float32 to measure what the analysis
    predicts, layer by layer."""
    subject = _private_copy(model, cfg)
    capture = _Capture(cfg, measure=measure)
    with torch.enable_grad():
        torch.compile(subject, backend=capture)(*example_inputs)
    if not capture.graphs:
        raise RuntimeError("Dynamo handed no graph to autoscale.diff: the model's forward was not compiled "
                           "(a cached graph, or a recompile limit reached); call torch._dynamo.reset() and retry")
    return capture.graphs


def _fresh_forward(module: nn.Module) -> None:
    """Give ``module`` (the private copy) a forward with a code object of its own
    (``recoded_forward``: each diff uses a new backend, and must not fill the shared code object's
    Dynamo cache). A forward that is not Python code is left as it is."""
    try:
        vars(module)["forward"] = recoded_forward(module)
    except TypeError:
        pass


def _private_copy(model: nn.Module, cfg: Config) -> nn.Module:
    """A deep copy of the user's module to capture. Installed scaler state is left out of the copy
    and installed afresh when the config scales adaptively: the scale points need the scaler's
    state to be placed, and the capture must not touch the user's. The fresh state keeps the
    original's forward-overflow promotions, so the diff shows the graph the user's model computes
    now."""
    root = unwrap(model)
    state = getattr(root, _STATE_ATTR, None)
    memo: dict[int, Any] = {id(state): None} if state is not None else {}
    clone = copy.deepcopy(root, memo)
    moments = cfg.scaling.rule == "paper"
    if isinstance(state, ScaleState):
        moments |= state.moments
        vars(clone).pop(_STATE_ATTR, None)
        vars(clone).pop("forward", None)
        for name in (_SCALES, _STATS, _PEAKS):
            clone._buffers.pop(name, None)
    if cfg.scaling.mode == "adaptive":
        fresh = install_state(clone, moments=moments)
        # (no other model's graph can serve the copy, whose forward has a code object of its own:
        # it needs no instance name, and without one the diff reads the same from run to run)
        fresh.instance = ""
        if isinstance(state, ScaleState):  # the ops the user's scaler promoted after forward overflows
            fresh.forward.load_state_dict(state.forward.state_dict())
    _fresh_forward(clone)
    return clone


@dataclass
class _Erased:
    name: str
    text: str
    pass_name: str
    created_by: str | None
    cast: bool
    side: Literal["forward", "backward"] | None


@dataclass
class _Observer:
    """Wraps each pass of the pipeline to record, without changing what it does, the nodes it
    erased (a folded cast leaves no trace in the graph afterwards) and, before
    ``insert_grad_scaling`` (right after the analysis, on the graph it annotated), the scale point
    candidates, the state's row layout and the per-layer predictions; with ``inputs``, also the
    per-layer numbers one float32 step of that graph measures."""

    inputs: Sequence[Any] | None = None
    erased: list[_Erased] = field(default_factory=list)
    candidates: list[ScalePoint] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    predicted: dict[str, LayerNumbers] = field(default_factory=dict)
    measured: dict[str, LayerNumbers] | None = None
    weighted: frozenset[str] = frozenset()

    def pipeline(self, pipeline: Sequence[PassSpec]) -> tuple[PassSpec, ...]:
        return tuple(PassSpec(self._observed(spec.fn), spec.stage) for spec in pipeline)

    def _observed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # keeps the name: PassRecord.name stays the pass's
        def observed(gm: GraphModule, cfg: Config) -> Any:
            lines = node_lines(gm, display_names(gm, input_paths(gm)))
            casts = {n for n in lines if cast_of(n) is not None}  # (an erased node has lost its args)
            if fn is insert_grad_scaling:
                self._before_scaling(gm, cfg)
            result = fn(gm, cfg)
            alive = set(gm.graph.nodes)
            for node, text in lines.items():
                if node not in alive:
                    prov = node.meta.get(PROVENANCE_KEY) or {}
                    tag = node.meta.get("partitioner_tag")
                    side: Literal["forward", "backward"] | None = (
                        "forward" if tag == "is_forward" else "backward" if tag == "is_backward" else None)
                    self.erased.append(_Erased(node.name, text, fn.__name__,
                                               prov.get("pass") if prov.get("created") else None,
                                               node in casts, side))
            return result

        return observed

    def _before_scaling(self, gm: GraphModule, cfg: Config) -> None:
        found = attach_of(gm.graph)
        if found is not None:
            self.layers = found[1].layout.split(LAYOUT_SEP)
        self.candidates = scale_points(gm.graph, cfg)
        self.predicted = predict_layers(gm)
        self.weighted = frozenset(layer for layer, parts in layer_parts(gm).items() if parts.weights)
        if self.inputs is not None:
            self.measured = measure_layers(gm, self.inputs)


@dataclass
class _Autograd:
    """AOTAutograd's joint graph (after the joint stage, if any) and its two partitions."""

    joint: GraphModule
    forward: GraphModule
    backward: GraphModule


@dataclass
class CapturedGraph:
    """Everything captured for one Dynamo graph: what ``autoscale.diff.align`` builds the diff from."""

    index: int
    before: GraphModule
    after: GraphModule
    records: list[PassRecord]
    report: PrecisionReport
    dynamo: _Observer
    joint: _Observer
    autograd_before: _Autograd | None
    autograd_after: _Autograd | None


class _Capture:
    """A Dynamo backend that runs the pipeline on each graph it is handed and keeps what it saw.
    It returns the unrewritten graph to run: the capture's forward computes what eager would."""

    def __init__(self, cfg: Config, *, measure: bool) -> None:
        self.cfg = cfg
        self.measure = measure
        self.graphs: list[CapturedGraph] = []

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        cfg = self.cfg
        before, before_inputs = copy_graph_module(gm), example_inputs
        if cfg.scaling.mode == "adaptive" and (reached := reach_state(gm, example_inputs)):
            gm, bound = reached  # (a graph after a graph break, scaled as the backend scales it)
            example_inputs = [*example_inputs, *bound]
        dynamo = _Observer(inputs=example_inputs if self.measure else None)
        rewritten = rewrite_graph(gm, example_inputs, cfg, dynamo.pipeline(PIPELINE), attach=False)
        records, report = rewritten.passes, rewritten.report
        joint = _Observer()
        joint_pipeline = joint.pipeline(PIPELINE)

        def joint_stage(g: GraphModule) -> None:
            records.extend(run_stage(g, cfg, "joint", joint_pipeline))

        # The backward graphs. (AOTAutograd traces a copy of the captured graph: ``before`` stays
        # the graph Dynamo runs and the record of the lines before.)
        autograd_before = _autograd(copy_graph_module(before), before_inputs, None)
        autograd_after = _autograd(gm, example_inputs, joint_stage)
        self.graphs.append(CapturedGraph(len(self.graphs), before, gm, records, report, dynamo, joint,
                                         autograd_before, autograd_after))
        return before.forward



def _autograd(gm: GraphModule, example_inputs: Sequence[Any],
              joint_stage: Callable[[GraphModule], None] | None) -> _Autograd | None:
    """Trace ``gm``'s joint graph as the eager executor does (AOTAutograd, the joint stage in the
    partitioner, min-cut partitioning) and keep the partitions. None when nothing needs a gradient
    (AOTAutograd then makes an inference graph and never partitions)."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    got: list[_Autograd] = []

    def partition(joint: GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[GraphModule, GraphModule]:
        if joint_stage is not None:
            joint_stage(joint)
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        got.append(_Autograd(joint, fw, bw))
        return fw, bw

    compiler = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition,
                            keep_inference_input_mutations=True)
    compiler(gm, list(example_inputs))
    return got[0] if got else None


def input_paths(gm: GraphModule) -> tuple[str | None, ...]:
    """The module path of each of a Dynamo graph's inputs that is a parameter or buffer
    (``input_path``; None for the others), in order."""
    return tuple(input_path(n) for n in gm.graph.find_nodes(op="placeholder"))


_PRIMALS = re.compile(r"primals_(\d+)")


def display_names(gm: GraphModule, paths: Sequence[str | None], *, primals: bool = False) -> dict[Node, str]:
    """The inputs of ``gm`` that are parameters or buffers, by module path (``h.0.ln_1.weight``):
    ``paths`` of ``gm``'s inputs in order, or with ``primals``, of the Dynamo graph an AOTAutograd
    graph traced (its ``primals_<i>`` are that graph's inputs in order)."""
    names: dict[Node, str] = {}
    for i, n in enumerate(gm.graph.find_nodes(op="placeholder")):
        if primals:
            i = int(m[1]) - 1 if (m := _PRIMALS.fullmatch(n.name)) else -1
        if 0 <= i < len(paths) and (path := paths[i]) is not None:
            names[n] = path
    return names


def node_lines(gm: GraphModule, names: Mapping[Node, str] | None = None, *,
               provenance: bool = True) -> dict[Node, str]:
    """Each node's line of ``format_graph`` (one line per node; reprs escape newlines), nodes
    named as ``names`` says (``display_names``)."""
    text = format_graph(gm, provenance=provenance, names=names)
    return dict(zip(gm.graph.nodes, text.split("\n"), strict=False))
