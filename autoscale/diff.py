"""Graph-diff inspection: what autoscale's pipeline changed in a model's forward and backward graphs.

``diff(model, example_inputs)`` captures the model with Dynamo as the backend would, keeps a copy
of the graph before the passes, runs the same pipeline, then runs AOTAutograd on both graphs (the
joint-stage passes on the rewritten one) to get the backward graphs. The result, a
:class:`GraphDiff`, pairs every node before with the node after and says what happened to it
(unchanged, changed, inserted, removed), which pass did it and why (``node.meta["autoscale"]``),
its dtype before and after, and for the gradient rescale points their layer, row, predicted
float16 underflow rate and the initial scale the analysis chose. It renders as a unified diff
(``to_text``), as JSON that validates against ``autoscale/diff_schema.json`` (``to_json``) and as
one self-contained HTML page (``to_html``). docs/diff.md describes every field.

The diff never touches the user's model: it works on a deep copy (with the scaler's state
installed on the copy when the configuration scales gradients adaptively), and the pipeline's
passes run exactly as in ``autoscale.backend`` (seeding, calibration, ``run_stage``), each wrapped
only to observe which nodes it erased.
"""

from __future__ import annotations

import copy
import difflib
import functools
import html
import json
import math
import types
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from autoscale.backend import reach_state
from autoscale.config import Config
from autoscale.inspect import Island, PrecisionReport, format_graph, precision_report
from autoscale.ops import rescale
from autoscale.passes import PIPELINE, PassRecord, PassSpec, run_stage
from autoscale.passes.analyze_underflow import calibrate, seed_inputs
from autoscale.passes.graph_utils import PROVENANCE_KEY, cast_of, dtype_name, layer_of, op_name, target_name, tensor_val
from autoscale.passes.insert_grad_scaling import ScalePoint, insert_grad_scaling, is_attach, scale_points
from autoscale.runtime import _SCALES, _STATE_ATTR, _STATS, LAYOUT_SEP, ScaleState, install_state, unwrap

__all__ = [
    "SCHEMA_VERSION",
    "DiffSummary",
    "FoldedCast",
    "GraphDiff",
    "GraphSection",
    "NodeEntry",
    "PassCount",
    "Provenance",
    "ScaleInfo",
    "diff",
    "schema",
]

SCHEMA_VERSION = 2
"""Version of the JSON document ``GraphDiff.to_json`` returns; bumped on any incompatible change."""

Status = Literal["unchanged", "changed", "inserted", "removed"]
Kind = Literal["input", "output", "op", "emulated", "cast", "scale", "unscale", "align", "scale_op"]
ScaleKind = Literal["scale", "unscale", "align"]

_REASONS_ERASED = {
    "fold_casts": "folded: a cast to the dtype it already has, a cancelling pair, or a duplicate",
    "remove_inplace": "in-place op replaced by its out-of-place form",
    "insert_grad_scaling": "the scaler's state marker: read (the layer of each row) and removed",
}


# --------------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class Provenance:
    """Which pass made or decided a node, for which layer, and why (``node.meta["autoscale"]``).

    ``created``: the pass inserted the node. ``precision``: the dtype the precision pass painted an
    existing op. ``derived_from``: for a backward node, the forward (Dynamo) node whose gradient it
    computes, when that node carries the provenance.
    """

    pass_name: str
    layer: str
    reason: str
    created: bool = False
    precision: str | None = None
    derived_from: str | None = None


@dataclass(frozen=True)
class ScaleInfo:
    """One gradient rescale point (``autoscale.ops.rescale``) and what the analysis predicts for it.

    ``kind``: "scale" (a scale point: the gradient leaves it carrying its layer's scale), "unscale"
    (a parameter's gradient brought back to the loss scale) or "align" (branches with different
    scales aligned where they merge). ``row``: the row of the scaler's state it sets (the only one of
    ``out_rows``). ``underflow``: the predicted float16 underflow rate of the gradients it governs
    at scale 1 (the worst one; 1.0 where the analysis could not predict one). ``amax``: their
    predicted largest magnitude. ``scale``/``arriving_scale``: the initial scales (the first step's)
    of ``out_rows``/``in_rows``, so the gradient is multiplied by ``scale / arriving_scale``.
    ``backward_nodes``: how many ATen nodes its backward became.
    """

    node: str
    graph: int
    kind: ScaleKind
    layer: str
    row: int | None
    out_rows: tuple[int, ...]
    in_rows: tuple[int, ...]
    record_rows: tuple[int, ...]
    underflow: float | None
    amax: float | None
    scale: float
    arriving_scale: float
    reason: str
    backward_nodes: int = 0


@dataclass(frozen=True)
class NodeEntry:
    """One node of the diff: a node before paired with the node after (either may be absent).

    ``before``/``after`` are the nodes' lines as ``autoscale.inspect.format_graph`` prints them.
    ``underflow`` is the analysis' predicted float16 underflow rate of the node's gradient at
    scale 1 (forward nodes). ``scale`` is set on forward rescale nodes; ``scale_op`` names the
    forward rescale node a backward node belongs to.
    """

    graph: int
    name: str
    before_name: str | None
    status: Status
    kind: Kind
    op: str
    before: str | None
    after: str | None
    dtype_before: str | None
    dtype_after: str | None
    layer: str
    provenance: Provenance | None
    underflow: float | None = None
    scale: ScaleInfo | None = None
    scale_op: str | None = None


@dataclass(frozen=True)
class FoldedCast:
    """A cast ``fold_casts`` erased. ``created_by`` is the pass that had inserted it (None: the
    model's own cast, which then also shows as a removed node). ``side`` is the half of the joint
    graph it was in (joint stage only)."""

    graph: int
    name: str
    text: str
    stage: Literal["dynamo", "joint"]
    created_by: str | None
    side: Literal["forward", "backward"] | None = None


@dataclass(frozen=True)
class GraphSection:
    """The forward (Dynamo graph, before and after the dynamo stage) or the backward (AOTAutograd's
    backward graph of the unrewritten and of the rewritten forward) part of a diff."""

    name: Literal["forward", "backward"]
    entries: tuple[NodeEntry, ...]
    folded: tuple[FoldedCast, ...] = ()
    islands: tuple[Island, ...] = ()

    def count(self, status: Status, kind: Kind | None = None) -> int:
        """Entries with ``status`` (and ``kind``, if given)."""
        return sum(1 for e in self.entries if e.status == status and (kind is None or e.kind == kind))

    def graphs(self) -> list[int]:
        """The graph indices present in this section, in order."""
        return sorted({e.graph for e in self.entries})


@dataclass(frozen=True)
class PassCount:
    """What one pass reported for one graph (``PassRecord`` without its timing)."""

    graph: int
    stage: Literal["dynamo", "joint"]
    name: str
    modified: bool
    counts: Mapping[str, int]


@dataclass(frozen=True)
class DiffSummary:
    """The headline numbers, summed over the model's graphs (one per graph break).

    ``converted``/``total``/``casts``/``islands``/``unknown_ops``: the precision report
    (``autoscale.inspect.precision_report``). ``emulated_ops``: ops computed in float32 from
    low-precision inputs (``compute="emulate"``).
    ``casts_folded``: casts ``fold_casts`` erased (both stages). ``backward_casts``: casts the
    backward graph gained outside the rescale points. ``scale_points``/``unscale_points``/
    ``align_points``: the rescale nodes ``insert_grad_scaling`` inserted. ``max_underflow``: the
    worst predicted float16 underflow rate (at scale 1) among the gradients a scale point could
    govern (placed or not), ``max_underflow_node`` the node a point there would follow and
    ``max_underflow_layer`` its module.
    """

    dtype: str
    compute: str
    graphs: int
    converted: int
    total: int
    casts: int
    emulated_ops: int
    casts_folded: int
    backward_casts: int
    scale_points: int
    unscale_points: int
    align_points: int
    max_underflow: float | None
    max_underflow_node: str | None
    max_underflow_layer: str | None
    islands: tuple[Island, ...]
    unknown_ops: tuple[str, ...]
    passes: tuple[PassCount, ...]

    def __str__(self) -> str:
        text = (f"converted {self.converted} of {self.total} nodes to {self.dtype}, {self.casts} casts, "
                f"{self.scale_points} scale points")
        if self.max_underflow is not None:
            where = (f"in layer {self.max_underflow_layer}" if self.max_underflow_layer
                     else f"at node {self.max_underflow_node}")
            text += f" (predicted max underflow {_rate(self.max_underflow)} {where})"
        return text


@dataclass(frozen=True)
class GraphDiff:
    """What the pipeline changed, node by node, in the forward and the backward graphs."""

    forward: GraphSection
    backward: GraphSection
    summary: DiffSummary
    scale_ops: tuple[ScaleInfo, ...] = field(default=())

    def to_text(self, *, color: bool = False, backward_only: bool = False, expand_scale_ops: bool = False) -> str:
        """A unified diff of the readable graphs, with provenance annotations.

        ANSI colours only with ``color`` (the CLI passes ``sys.stdout.isatty()``). The ATen nodes
        of each rescale point's backward are one line unless ``expand_scale_ops``: a point is ~50
        nodes, which would drown the rest of the backward.
        """
        return _render_text(self, color=color, backward_only=backward_only, expand=expand_scale_ops)

    def to_json(self, *, backward_only: bool = False) -> dict[str, Any]:
        """A JSON-ready dict that validates against ``autoscale/diff_schema.json`` (see :func:`schema`)."""
        return _render_json(self, backward_only=backward_only)

    def to_html(self, *, backward_only: bool = False) -> str:
        """One self-contained HTML page (inline CSS and JS, no network): before and after side by
        side, inserted casts and rescale points highlighted, the numbers on hover and in tables."""
        return _render_html(self, backward_only=backward_only)

    def __str__(self) -> str:
        return str(self.summary)


def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``GraphDiff.to_json``'s document."""
    text = resources.files("autoscale").joinpath("diff_schema.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


# --------------------------------------------------------------------------------- capture


def diff(model: nn.Module, example_inputs: tuple[Any, ...], *, config: Config | None = None) -> GraphDiff:
    """Run autoscale's pipeline on ``model`` for ``example_inputs`` (a tuple of positional
    arguments) and return what it changed in the forward and backward graphs.

    The model is deep-copied first, so its parameters, buffers and any scaler state stay as they
    are; the copy runs one forward (Dynamo has to execute a frame to capture it).
    """
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"diff config must be an autoscale.Config, got {type(config).__name__}")
    if not isinstance(example_inputs, tuple | list):
        raise ValueError("example_inputs must be a tuple of the model's positional arguments, "
                         f"got {type(example_inputs).__name__} (write (x,) for one input)")
    cfg = (config or Config()).resolved(_device_of(example_inputs))
    subject = _private_copy(model, cfg)
    capture = _Capture(cfg)
    with torch.enable_grad():
        torch.compile(subject, backend=capture)(*example_inputs)
    if not capture.graphs:
        raise RuntimeError("Dynamo handed no graph to autoscale.diff: the model's forward was not compiled "
                           "(a cached graph, or a recompile limit reached); call torch._dynamo.reset() and retry")
    return _assemble(capture.graphs, cfg)


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _fresh_forward(module: nn.Module) -> None:
    """Give ``module`` (the private copy) a forward with a code object of its own.

    Dynamo keeps compiled graphs per code object. Through the shared one (the class's forward, or
    the scaler's forward wrapper, common to every model with a scaler), each diff (a new backend)
    would add an entry until the recompile limit stops compiling, and clearing that cache would
    drop the user's own compiled code too. A fresh code object starts with an empty cache and
    takes it along when it is freed. The function is otherwise the same, so Dynamo names the
    graph's modules exactly as the backend sees them.
    """
    forward = vars(module).get("forward")
    if isinstance(forward, types.FunctionType):  # the scaler's wrapper (an instance attribute)
        vars(module)["forward"] = _recoded(forward)
    elif isinstance(method := getattr(type(module), "forward", None), types.FunctionType):
        vars(module)["forward"] = types.MethodType(_recoded(method), module)


def _recoded(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a new (equal) code object."""
    recoded = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    recoded.__kwdefaults__ = fn.__kwdefaults__
    recoded.__qualname__ = fn.__qualname__
    recoded.__dict__.update(fn.__dict__)  # functools.wraps' __wrapped__ and the like
    return recoded


def _private_copy(model: nn.Module, cfg: Config) -> nn.Module:
    """A deep copy of the user's module to capture. Installed scaler state is left out of the copy
    (its forward wrapper is a closure over the original model) and installed afresh when the
    config scales adaptively: the scale points need the scaler's state to be placed."""
    root = unwrap(model)
    state = getattr(root, _STATE_ATTR, None)
    memo: dict[int, Any] = {id(state): None} if state is not None else {}
    clone = copy.deepcopy(root, memo)
    moments = cfg.scaling.rule == "paper"
    if isinstance(state, ScaleState):
        moments |= state.moments
        vars(clone).pop(_STATE_ATTR, None)
        vars(clone).pop("forward", None)
        for name in (_SCALES, _STATS):
            clone._buffers.pop(name, None)
    if cfg.scaling.mode == "adaptive":
        install_state(clone, moments=moments)
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
    ``insert_grad_scaling``, the scale point candidates and the state's row layout."""

    erased: list[_Erased] = field(default_factory=list)
    candidates: list[ScalePoint] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)

    def pipeline(self, pipeline: Sequence[PassSpec]) -> tuple[PassSpec, ...]:
        return tuple(PassSpec(self._observed(spec.fn), spec.stage) for spec in pipeline)

    def _observed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # keeps the name: PassRecord.name stays the pass's
        def observed(gm: GraphModule, cfg: Config) -> Any:
            lines = _lines(gm)
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
        attach = next((n for n in gm.graph.nodes if is_attach(n)), None)
        if attach is not None:
            self.layers = str(attach.args[2]).split(LAYOUT_SEP)
        self.candidates = scale_points(gm.graph, cfg)


@dataclass
class _Autograd:
    """AOTAutograd's joint graph (after the joint stage, if any) and its two partitions."""

    joint: GraphModule
    forward: GraphModule
    backward: GraphModule


@dataclass
class _Graph:
    """Everything captured for one Dynamo graph."""

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

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.graphs: list[_Graph] = []

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        cfg = self.cfg
        before, before_inputs = _copy(gm), example_inputs
        if cfg.scaling.mode == "adaptive" and (reached := reach_state(gm, example_inputs)):
            gm, bound = reached  # (a graph after a graph break, scaled as the backend scales it)
            example_inputs = [*example_inputs, *bound]
        seed_inputs(gm, example_inputs)
        if cfg.scaling.calibrate:
            calibrate(gm, example_inputs)
        dynamo = _Observer()
        records = run_stage(gm, cfg, "dynamo", dynamo.pipeline(PIPELINE))
        report = precision_report(gm, dtype=dtype_name(cfg.dtype), compute=cfg.compute)
        joint = _Observer()
        joint_pipeline = joint.pipeline(PIPELINE)

        def joint_stage(g: GraphModule) -> None:
            records.extend(run_stage(g, cfg, "joint", joint_pipeline))

        # The backward graphs. (AOTAutograd traces a copy of the captured graph: ``before`` stays
        # the graph Dynamo runs and the record of the lines before.)
        autograd_before = _autograd(_copy(before), before_inputs, None)
        autograd_after = _autograd(gm, example_inputs, joint_stage)
        self.graphs.append(_Graph(len(self.graphs), before, gm, records, report, dynamo, joint,
                                  autograd_before, autograd_after))
        return before.forward


def _copy(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` with the same node names and shallow copies of their meta, so the passes'
    rewrites of the original (and of its nodes' meta entries) do not show through."""
    graph = Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return GraphModule(gm, graph)


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


def _is_rescale(n: Node) -> bool:
    return n.op == "call_function" and n.target is rescale


# --------------------------------------------------------------------------------- assembly


def _lines(gm: GraphModule, *, provenance: bool = True) -> dict[Node, str]:
    """Each node's line of ``format_graph`` (one line per node; reprs escape newlines)."""
    return dict(zip(gm.graph.nodes, format_graph(gm, provenance=provenance).split("\n"), strict=False))


def _dtype(node: Node) -> str | None:
    val = tensor_val(node)
    return dtype_name(val.dtype) if isinstance(val, torch.Tensor) else None


def _shape(node: Node) -> tuple[int, ...] | None:
    val = tensor_val(node)
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(int(s) if isinstance(s, int) else -1 for s in val.shape)


def _op(node: Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    return target_name(node) or str(node.target)


def _provenance(node: Node, derived_from: str | None = None, source: Node | None = None) -> Provenance | None:
    """The node's own provenance, or (a backward node) that of the forward node it derives from."""
    prov = node.meta.get(PROVENANCE_KEY)
    if prov is None and source is not None:
        prov = source.meta.get(PROVENANCE_KEY)
        if prov is not None:
            return Provenance(prov["pass"], prov.get("layer", ""), f"backward of {derived_from}: {prov['reason']}",
                              bool(prov.get("created")), prov.get("precision"), derived_from)
    if prov is None:
        return None
    return Provenance(prov["pass"], prov.get("layer", ""), prov["reason"], bool(prov.get("created")),
                      prov.get("precision"), derived_from)


Pair = tuple[Node | None, Node | None]


def _align(before: list[Node], after: list[Node], key: Callable[[Node], Any], forced: set[Node]) -> list[Pair]:
    """Pair the nodes of two graphs, in an order that follows both.

    ``forced`` after-nodes are inserted by construction (they derive from nodes a pass created)
    and take no part in the matching. The rest are matched as a sequence diff on ``key``; inside a
    block that differs, nodes of the same op (``relu_`` and ``relu``) are paired as changed.
    """
    rest = [n for n in after if n not in forced]
    pairs: list[Pair] = []
    matcher = difflib.SequenceMatcher(None, [key(n) for n in before], [key(n) for n in rest], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(before[i1:i2], rest[j1:j2], strict=True))
        elif tag == "delete":
            pairs.extend((b, None) for b in before[i1:i2])
        elif tag == "insert":
            pairs.extend((None, a) for a in rest[j1:j2])
        else:
            pairs.extend(_align_block(before[i1:i2], rest[j1:j2]))
    # splice the forced nodes in at their place in the after graph
    order = {n: i for i, n in enumerate(after)}
    pending = sorted(forced, key=order.__getitem__)
    merged: list[Pair] = []
    k = 0
    for b, a in pairs:
        if a is not None:
            while k < len(pending) and order[pending[k]] < order[a]:
                merged.append((None, pending[k]))
                k += 1
        merged.append((b, a))
    merged.extend((None, n) for n in pending[k:])
    return merged


def _align_block(before: list[Node], after: list[Node]) -> list[Pair]:
    ops = difflib.SequenceMatcher(None, [op_name(n) or n.op for n in before], [op_name(n) or n.op for n in after],
                                  autojunk=False)
    pairs: list[Pair] = []
    for tag, i1, i2, j1, j2 in ops.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(before[i1:i2], after[j1:j2], strict=True))
        else:
            pairs.extend((b, None) for b in before[i1:i2])
            pairs.extend((None, a) for a in after[j1:j2])
    return pairs


def _same(b: Node, a: Node, paired: Mapping[Node, Node]) -> bool:
    """Whether the after node computes the same thing as the before node: same op, dtype and shape,
    and arguments that are the same (paired) nodes and constants."""
    if b.op != a.op or b.target != a.target or _dtype(b) != _dtype(a) or _shape(b) != _shape(a):
        return False
    if b.op == "placeholder":
        return True

    def mapped(n: Node) -> Any:
        return paired.get(n, ("new", n.name))

    try:
        return bool(map_arg((b.args, b.kwargs), lambda n: n) == map_arg((a.args, a.kwargs), mapped))
    except RuntimeError:  # a tensor constant's ambiguous ==
        return False


def _seq_sources(joint: GraphModule) -> dict[int, str]:
    """Autograd sequence number -> the Dynamo node whose forward op created that autograd node.

    AOTAutograd tags every joint node with ``seq_nr``: a backward node has the number of the
    autograd node it runs, a forward node the number current when it was traced (an op that
    creates no autograd node shares the previous op's number, so the first forward node with a
    number is its creator). Forward nodes also record in ``from_node`` the Dynamo node they were
    traced from.
    """
    forward = _forward_nodes(joint)
    sources: dict[int, str] = {}
    for n in joint.graph.nodes:
        seq = n.meta.get("seq_nr")
        if n not in forward or seq is None or seq in sources:
            continue
        origin = n.meta.get("from_node") or []
        first = origin[0] if origin else None
        # a NodeSource; older torch recorded (name, target) pairs
        name = first[0] if isinstance(first, tuple) else getattr(first, "name", None)
        if isinstance(name, str):
            sources[seq] = name
    return sources


def _forward_nodes(joint: GraphModule) -> set[Node]:
    """The forward half of a joint graph: tagged ``is_forward`` by AOTAutograd, or (a torch that
    does not tag) every non-input node that does not depend on a tangent."""
    nodes = list(joint.graph.nodes)
    if any("partitioner_tag" in n.meta for n in nodes):
        return {n for n in nodes if n.meta.get("partitioner_tag") == "is_forward"}
    backward: set[Node] = set()
    for n in nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    return {n for n in nodes if n not in backward and n.op not in ("placeholder", "output")}


def _autograd_backward_node(n: Node) -> bool:
    """Whether a backward-graph node is one autograd's backward made (and so carries a meaningful
    ``seq_nr``): tagged ``is_backward`` by AOTAutograd; not the write-back of an input mutation at
    the end of the graph (tagged "must_be_in_backward"). Where torch does not tag: any computing
    node but a ``copy_`` into an input."""
    tag = n.meta.get("partitioner_tag")
    if tag is not None:
        return bool(tag == "is_backward")
    if n.op not in ("call_function", "get_attr"):
        return False
    first = n.args[0] if n.args else None
    return not (target_name(n) == "copy_" and isinstance(first, Node) and first.op == "placeholder")


def _scale_infos(g: _Graph) -> dict[Node, ScaleInfo]:
    """The rescale nodes of ``g``'s rewritten graph, with their predictions and initial scales."""
    initial: Mapping[int, float] = g.after.meta.get("autoscale_initial_scales") or {}
    points = {(p.node, p.reason): p for p in g.dynamo.candidates}
    layers = g.dynamo.layers

    def scale_of(rows: tuple[int, ...]) -> float:
        return max((float(initial.get(r, 1.0)) for r in rows), default=1.0)

    infos: dict[Node, ScaleInfo] = {}
    for n in g.after.graph.nodes:
        if not _is_rescale(n):
            continue
        x, _, _, out_rows, in_rows, record_rows, unscale = n.args[:7]
        assert isinstance(x, Node)
        prov = n.meta.get(PROVENANCE_KEY, {})
        point = points.get((x, prov.get("reason")))
        kind: ScaleKind = "scale" if point is not None else "unscale" if unscale else "align"
        row = out_rows[0] if len(out_rows) == 1 else None
        layer = layers[row] if point is not None and row is not None and row < len(layers) else prov.get("layer", "")
        infos[n] = ScaleInfo(
            node=n.name, graph=g.index, kind=kind, layer=layer, row=row, out_rows=tuple(out_rows),
            in_rows=tuple(in_rows), record_rows=tuple(record_rows),
            underflow=point.underflow if point is not None else x.meta.get("autoscale_underflow"),
            amax=point.amax if point is not None else None,
            scale=scale_of(tuple(out_rows)), arriving_scale=scale_of(tuple(in_rows)),
            reason=prov.get("reason", ""))
    return infos


def _forward_entries(g: _Graph, infos: Mapping[Node, ScaleInfo]) -> list[NodeEntry]:
    before, after = list(g.before.graph.nodes), list(g.after.graph.nodes)
    pairs = _align(before, after, lambda n: n.name, set())
    paired = {b: a for b, a in pairs if b is not None and a is not None}
    back = {a: b for b, a in paired.items()}
    lines_b, lines_a = _lines(g.before), _lines(g.after)
    erased_by = {e.name: e.pass_name for e in g.dynamo.erased}
    entries = []
    for b, a in pairs:
        if a is None:
            assert b is not None
            by = erased_by.get(b.name)
            prov = Provenance(by, layer_of(b), _REASONS_ERASED.get(by, f"erased by {by}")) if by else None
            entries.append(NodeEntry(g.index, b.name, b.name, "removed", _kind(b, None), _op(b), lines_b[b], None,
                                     _dtype(b), None, layer_of(b), prov))
            continue
        status: Status = "inserted" if b is None else "unchanged" if _same(b, a, back) else "changed"
        info = infos.get(a)
        entries.append(NodeEntry(
            g.index, a.name, b.name if b is not None else None, status, _kind(a, info), _op(a),
            lines_b[b] if b is not None else None, lines_a[a], _dtype(b) if b is not None else None, _dtype(a),
            layer_of(a), _provenance(a), a.meta.get("autoscale_underflow"), info))
    return entries


def _kind(node: Node, info: ScaleInfo | None) -> Kind:
    if info is not None:
        return info.kind
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if cast_of(node) is not None:
        return "cast"
    return "emulated" if (node.meta.get(PROVENANCE_KEY) or {}).get("emulated") else "op"


def _backward_entries(g: _Graph, infos: Mapping[Node, ScaleInfo]) -> tuple[list[NodeEntry], dict[str, int]]:
    """The backward entries, and how many ATen nodes each rescale point became."""
    if g.autograd_after is None:
        return [], {}
    after_gm = g.autograd_after.backward
    before_gm = g.autograd_before.backward if g.autograd_before is not None else None
    dynamo_nodes = {n.name: n for n in g.after.graph.nodes}
    rescale_names = {info.node for info in infos.values()}
    sources = _seq_sources(g.autograd_after.joint)

    def source(n: Node) -> str | None:
        seq = n.meta.get("seq_nr")
        return sources.get(seq) if seq is not None and _autograd_backward_node(n) else None

    forced: set[Node] = set()
    for n in after_gm.graph.nodes:
        src = source(n)
        if src is not None and (dynamo_nodes[src].meta.get(PROVENANCE_KEY) or {}).get("created"):
            forced.add(n)  # the gradient of a node a pass inserted: inserted too

    def key(n: Node) -> Any:
        return (_op(n), _shape(n))

    before = list(before_gm.graph.nodes) if before_gm is not None else []
    after = list(after_gm.graph.nodes)
    pairs = _align(before, after, key, forced)
    back = {a: b for b, a in pairs if b is not None and a is not None}
    lines_b = _lines(before_gm) if before_gm is not None else {}
    lines_a = _lines(after_gm)
    sizes: dict[str, int] = defaultdict(int)
    entries = []
    for b, a in pairs:
        if a is None:
            assert b is not None
            entries.append(NodeEntry(g.index, b.name, b.name, "removed", _kind(b, None), _op(b), lines_b[b], None,
                                     _dtype(b), None, layer_of(b), None))
            continue
        src = source(a)
        member = src if src in rescale_names else None
        if member is not None:
            sizes[member] += 1
        status: Status = "inserted" if b is None else "unchanged" if _same(b, a, back) else "changed"
        kind: Kind = "scale_op" if member is not None else _kind(a, None)
        entries.append(NodeEntry(
            g.index, a.name, b.name if b is not None else None, status, kind, _op(a),
            lines_b[b] if b is not None else None, lines_a[a], _dtype(b) if b is not None else None, _dtype(a),
            layer_of(a), _provenance(a, src, dynamo_nodes.get(src) if src is not None else None),
            scale_op=member))
    return entries, dict(sizes)


def _folded(g: _Graph) -> tuple[list[FoldedCast], list[FoldedCast]]:
    fwd = [FoldedCast(g.index, e.name, e.text, "dynamo", e.created_by)
           for e in g.dynamo.erased if e.pass_name == "fold_casts" and e.cast]
    bwd = [FoldedCast(g.index, e.name, e.text, "joint", e.created_by, e.side)
           for e in g.joint.erased if e.pass_name == "fold_casts" and e.cast]
    return fwd, bwd


def _assemble(graphs: list[_Graph], cfg: Config) -> GraphDiff:
    forward: list[NodeEntry] = []
    backward: list[NodeEntry] = []
    scale_ops: list[ScaleInfo] = []
    folded_f: list[FoldedCast] = []
    folded_b: list[FoldedCast] = []
    passes: list[PassCount] = []
    worst: tuple[float, str, str] | None = None
    for g in graphs:
        infos = _scale_infos(g)
        bwd, sizes = _backward_entries(g, infos)
        infos = {n: _with_size(i, sizes.get(i.node, 0)) for n, i in infos.items()}
        forward.extend(_forward_entries(g, infos))
        backward.extend(bwd)
        scale_ops.extend(infos.values())
        f, b = _folded(g)
        folded_f.extend(f)
        folded_b.extend(b)
        passes.extend(PassCount(g.index, r.stage, r.name, r.modified, dict(r.counts)) for r in g.records)
        for p in g.dynamo.candidates:
            if worst is None or p.underflow > worst[0]:
                worst = (p.underflow, p.node.name, layer_of(p.layer))
    reports = [g.report for g in graphs]
    islands = _merge_islands(i for r in reports for i in r.islands)
    summary = DiffSummary(
        dtype=dtype_name(cfg.dtype), compute=cfg.compute, graphs=len(graphs),
        converted=sum(r.converted for r in reports), total=sum(r.total for r in reports),
        casts=sum(r.casts for r in reports),
        emulated_ops=sum(1 for e in forward if e.kind == "emulated"),
        casts_folded=len(folded_f) + len(folded_b),
        backward_casts=sum(1 for e in backward if e.status == "inserted" and e.kind == "cast"),
        scale_points=sum(1 for s in scale_ops if s.kind == "scale"),
        unscale_points=sum(1 for s in scale_ops if s.kind == "unscale"),
        align_points=sum(1 for s in scale_ops if s.kind == "align"),
        max_underflow=worst[0] if worst else None, max_underflow_node=worst[1] if worst else None,
        max_underflow_layer=worst[2] if worst else None,
        islands=islands, unknown_ops=tuple(dict.fromkeys(op for r in reports for op in r.unknown_ops)),
        passes=tuple(passes))
    return GraphDiff(GraphSection("forward", tuple(forward), tuple(folded_f), islands),
                     GraphSection("backward", tuple(backward), tuple(folded_b)), summary, tuple(scale_ops))


def _with_size(info: ScaleInfo, size: int) -> ScaleInfo:
    return ScaleInfo(**{**info.__dict__, "backward_nodes": size})


def _merge_islands(islands: Iterable[Island]) -> tuple[Island, ...]:
    merged: dict[tuple[str, str], list[str]] = defaultdict(list)
    for i in islands:
        merged[(i.op, i.reason)].extend(i.nodes)
    return tuple(Island(op, reason, tuple(nodes)) for (op, reason), nodes in merged.items())


# --------------------------------------------------------------------------------- formatting helpers


def _rate(x: float) -> str:
    return f"{x:.1e}"


def _scale(x: float) -> str:
    """Powers of two as ``2^k`` (the scales are powers of two), anything else as a number."""
    if x > 0:
        k = math.log2(x)
        if k == int(k):
            return f"2^{int(k)}"
    return f"{x:g}"


def _scale_note(s: ScaleInfo) -> str:
    parts = [f"{s.kind} point"]
    if s.kind == "scale":
        parts.append(f"layer {s.layer or '(model)'}, row {s.row}")
    else:
        parts.append(f"rows {list(s.in_rows)} -> {list(s.out_rows)}")
    if s.underflow is not None:
        parts.append(f"predicted underflow {_rate(s.underflow)}")
    parts.append(f"initial scale {_scale(s.scale)}" if s.kind == "scale"
                 else f"factor {_scale(s.scale / s.arriving_scale)}")
    return ", ".join(parts)


def _entry_note(e: NodeEntry) -> str:
    """What a node's line does not say: a backward node's origin, or a rescale point's numbers."""
    if e.scale is not None:
        return "  {" + _scale_note(e.scale) + "}"
    p = e.provenance
    if p is not None and p.derived_from is not None:
        tag = "+" if p.created else p.precision or ""
        return f"  # [{p.pass_name}{' ' + tag if tag else ''}] {p.reason}"
    return ""


def _removed_note(e: NodeEntry) -> str:
    p = e.provenance
    return f"  # [{p.pass_name} -] {p.reason}" if p is not None else ""


def _title(e: NodeEntry) -> str:
    """The per-node numbers, one per line, for a tooltip."""
    lines = [f"{e.name}: {e.status} {e.kind}", f"op: {e.op}"]
    if e.layer:
        lines.append(f"layer: {e.layer}")
    if e.dtype_before is not None or e.dtype_after is not None:
        lines.append(f"dtype: {e.dtype_before or '-'} -> {e.dtype_after or '-'}")
    if e.underflow is not None:
        lines.append(f"predicted underflow (scale 1): {_rate(e.underflow)}")
    if e.scale is not None:
        lines.append(_scale_note(e.scale))
    if e.provenance is not None:
        lines.append(f"pass: {e.provenance.pass_name}")
        lines.append(f"reason: {e.provenance.reason}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- text


_ANSI = {"-": "\x1b[31m", "+": "\x1b[32m", "@": "\x1b[36m", "hdr": "\x1b[1m", "scale": "\x1b[35m",
         "dim": "\x1b[2m", "end": "\x1b[0m"}


def _render_text(d: GraphDiff, *, color: bool, backward_only: bool, expand: bool) -> str:
    def paint(style: str, text: str) -> str:
        return f"{_ANSI[style]}{text}{_ANSI['end']}" if color else text

    s = d.summary
    out = [paint("hdr", f"autoscale diff: {s}")]
    out.extend("  " + line for line in _summary_details(s, d))
    sections = [d.backward] if backward_only else [d.forward, d.backward]
    infos = {(i.graph, i.node): i for i in d.scale_ops}
    for section in sections:
        what = ("Dynamo graph, as captured", "after the dynamo stage") if section.name == "forward" else (
            "AOTAutograd backward of the captured graph", "AOTAutograd backward after both stages")
        out.append(paint("hdr", f"--- {section.name} before: {what[0]}"))
        out.append(paint("hdr", f"+++ {section.name} after: {what[1]}"))
        if not section.entries:
            out.append("  (no backward graph: nothing in the model requires a gradient)")
        for graph in section.graphs():
            entries = [e for e in section.entries if e.graph == graph]
            out.append(paint("@", _hunk_header(section.name, graph, entries)))
            shown: set[str] = set()
            for e in entries:
                if e.scale_op is not None and not expand:
                    if e.scale_op not in shown:
                        shown.add(e.scale_op)
                        info = infos[(graph, e.scale_op)]
                        out.append(paint("scale", f"+ [{e.scale_op} backward: {info.backward_nodes} ATen nodes] "
                                                  f"{_scale_note(info)}"))
                    continue
                out.extend(_text_lines(e, paint))
            for f in section.folded:  # (the model's own folded casts show as removed nodes)
                if f.graph == graph and f.created_by is not None:
                    out.append(paint("dim", f"# folded ({f.stage}{', ' + f.side if f.side else ''}, inserted by "
                                            f"{f.created_by}): {f.text}"))
    return "\n".join(out) + "\n"


def _text_lines(e: NodeEntry, paint: Callable[[str, str], str]) -> list[str]:
    if e.status == "unchanged":
        return [f"  {e.after}"]
    if e.status == "removed":
        return [paint("-", f"- {e.before}{_removed_note(e)}")]
    style = "scale" if e.kind in ("scale", "unscale", "align") or e.scale_op else "+"
    plus = paint(style, f"+ {e.after}{_entry_note(e)}")
    return [plus] if e.status == "inserted" else [paint("-", f"- {e.before}"), plus]


def _hunk_header(section: str, graph: int, entries: list[NodeEntry]) -> str:
    n_before = sum(1 for e in entries if e.before is not None)
    n_after = sum(1 for e in entries if e.after is not None)
    counts = {k: sum(1 for e in entries if e.status == k) for k in ("inserted", "removed", "changed")}
    return (f"@@ graph {graph} {section}: {n_before} -> {n_after} nodes, "
            + ", ".join(f"{v} {k}" for k, v in counts.items()) + " @@")


def _summary_details(s: DiffSummary, d: GraphDiff) -> list[str]:
    emulated = f" ({s.emulated_ops} ops emulated)" if s.compute == "emulate" else ""
    lines = [f"dtype {s.dtype}, compute {s.compute}{emulated}, {s.graphs} graph{'s' if s.graphs != 1 else ''}; "
             f"rescale points: {s.scale_points} scale, {s.unscale_points} unscale, {s.align_points} align; "
             f"casts: {s.casts} precision, {s.backward_casts} in the backward, {s.casts_folded} folded"]
    if s.islands:
        lines.append("FP32 islands: " + "; ".join(
            f"{i.op}{f' x{len(i.nodes)}' if len(i.nodes) > 1 else ''} -> {i.reason}" for i in s.islands))
    if s.unknown_ops:
        lines.append("unknown ops (kept in float32): " + ", ".join(s.unknown_ops))
    return lines


# --------------------------------------------------------------------------------- JSON


def _json_provenance(p: Provenance | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {"pass": p.pass_name, "layer": p.layer, "reason": p.reason, "created": p.created,
            "precision": p.precision, "derived_from": p.derived_from}


def _json_scale(s: ScaleInfo) -> dict[str, Any]:
    return {"node": s.node, "graph": s.graph, "kind": s.kind, "layer": s.layer, "row": s.row,
            "out_rows": list(s.out_rows), "in_rows": list(s.in_rows), "record_rows": list(s.record_rows),
            "underflow": s.underflow, "amax": s.amax, "scale": s.scale, "arriving_scale": s.arriving_scale,
            "reason": s.reason, "backward_nodes": s.backward_nodes}


def _json_entry(e: NodeEntry) -> dict[str, Any]:
    return {"graph": e.graph, "name": e.name, "before_name": e.before_name, "status": e.status, "kind": e.kind,
            "op": e.op, "before": e.before, "after": e.after, "dtype_before": e.dtype_before,
            "dtype_after": e.dtype_after, "layer": e.layer, "provenance": _json_provenance(e.provenance),
            "underflow": e.underflow, "scale": e.scale.node if e.scale is not None else None,
            "scale_op": e.scale_op}


def _json_section(section: GraphSection) -> dict[str, Any]:
    return {
        "entries": [_json_entry(e) for e in section.entries],
        "counts": {k: section.count(k) for k in ("unchanged", "changed", "inserted", "removed")},
        "folded": [{"graph": f.graph, "name": f.name, "text": f.text, "stage": f.stage, "created_by": f.created_by,
                    "side": f.side} for f in section.folded],
    }


def _json_island(i: Island) -> dict[str, Any]:
    return {"op": i.op, "reason": i.reason, "nodes": list(i.nodes)}


def _render_json(d: GraphDiff, *, backward_only: bool) -> dict[str, Any]:
    s = d.summary
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "summary": {
            "text": str(s), "dtype": s.dtype, "compute": s.compute, "graphs": s.graphs,
            "converted": s.converted, "total": s.total, "casts": s.casts, "emulated_ops": s.emulated_ops,
            "casts_folded": s.casts_folded, "backward_casts": s.backward_casts, "scale_points": s.scale_points,
            "unscale_points": s.unscale_points, "align_points": s.align_points,
            "max_underflow": s.max_underflow, "max_underflow_node": s.max_underflow_node,
            "max_underflow_layer": s.max_underflow_layer,
            "islands": [_json_island(i) for i in s.islands], "unknown_ops": list(s.unknown_ops),
            "passes": [{"graph": p.graph, "stage": p.stage, "name": p.name, "modified": p.modified,
                        "counts": dict(p.counts)} for p in s.passes],
        },
        "scale_ops": [_json_scale(i) for i in d.scale_ops],
        "backward": _json_section(d.backward),
    }
    if not backward_only:
        doc["forward"] = _json_section(d.forward)
    return doc


# --------------------------------------------------------------------------------- HTML

_CSS = """
:root { --ins: #e6ffec; --ins-b: #1a7f37; --del: #ffebe9; --del-b: #cf222e; --chg: #fff8c5;
        --cast: #ddf4ff; --cast-b: #0969da; --scale: #fbefff; --scale-b: #8250df; --emu: #f6f8fa; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; padding: 16px 24px; color: #1f2328; }
h1 { font-size: 20px; margin: 0 0 6px; } h2 { font-size: 17px; margin: 24px 0 8px; } h3 { font-size: 15px; }
.summary { font-size: 16px; font-weight: 600; margin: 4px 0; }
.details { color: #57606a; margin: 2px 0; }
.legend span { display: inline-block; padding: 1px 8px; margin: 2px 4px 2px 0; border-radius: 3px;
                border: 1px solid #d0d7de; }
table.graph { width: 100%; border-collapse: collapse; table-layout: fixed; }
table.graph th { text-align: left; background: #f6f8fa; padding: 4px 6px; border-bottom: 1px solid #d0d7de; }
table.graph td { font: 12px/1.35 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: pre-wrap;
                 word-break: break-all; vertical-align: top; padding: 1px 6px; border-left: 4px solid transparent; }
td.node.unchanged { color: #57606a; }
td.node.changed { background: var(--chg); border-left-color: #bf8700; }
td.node.removed { background: var(--del); border-left-color: var(--del-b); text-decoration: line-through; }
td.node.inserted { background: var(--ins); border-left-color: var(--ins-b); }
td.node.inserted.cast, .legend .cast { background: var(--cast); border-left-color: var(--cast-b); }
td.node.emulated, .legend .emulated { background: var(--emu); border-left-color: #8c959f; }
td.node.inserted.scale, .legend .scale, td.group.scale { background: var(--scale); border-left-color: var(--scale-b);
                                                        font-weight: 600; }
td.node.inserted.unscale, td.node.inserted.align, .legend .unscale, td.group.unscale, td.group.align {
  background: #f5f0ff; border-left-color: #b392f0; }
tr.group-head td.group { font-family: system-ui, sans-serif; }
.badge { display: inline-block; margin-left: 6px; padding: 0 6px; border-radius: 8px; background: var(--scale-b);
         color: #fff; font: 600 11px/1.6 system-ui, sans-serif; white-space: nowrap; }
.unscale .badge, .align .badge { background: #b392f0; }
td.node.inserted.scale_op { background: #fdf6ff; border-left-color: #c297ff; }
.legend .inserted { background: var(--ins); } .legend .removed { background: var(--del); }
.legend .changed { background: var(--chg); }
tbody.scale-op tr.member { display: none; }
tbody.scale-op:has(input:checked) tr.member { display: table-row; }
body:has(#only-changes:checked) tr.row.unchanged { display: none; }
tr.row.reads td { outline: 1px dashed #0969da; }
table.numbers { border-collapse: collapse; font-size: 12px; margin-top: 6px; }
table.numbers th, table.numbers td { border: 1px solid #d0d7de; padding: 2px 6px; text-align: left;
                                      vertical-align: top; }
table.numbers th { background: #f6f8fa; }
table.numbers td.num { text-align: right; font-variant-numeric: tabular-nums; }
ul { margin: 4px 0; }
"""

_JS = """
(function () {
  // Hovering a row outlines the rows of the nodes it reads (its arguments).
  var rows = document.querySelectorAll("tr.row[data-name]");
  var byName = {};
  rows.forEach(function (r) { byName[r.closest("section").id + ":" + r.dataset.name] = r; });
  rows.forEach(function (r) {
    var reads = (r.dataset.reads || "").split(" ").filter(Boolean);
    var sec = r.closest("section").id;
    r.addEventListener("mouseenter", function () {
      reads.forEach(function (n) { var t = byName[sec + ":" + n]; if (t) t.classList.add("reads"); });
    });
    r.addEventListener("mouseleave", function () {
      reads.forEach(function (n) { var t = byName[sec + ":" + n]; if (t) t.classList.remove("reads"); });
    });
  });
  document.documentElement.dataset.js = "ready";
})();
"""


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _render_html(d: GraphDiff, *, backward_only: bool) -> str:
    s = d.summary
    infos = {(i.graph, i.node): i for i in d.scale_ops}
    data = {"scale-points": s.scale_points, "unscale-points": s.unscale_points, "align-points": s.align_points,
            "casts": s.casts, "emulated-ops": s.emulated_ops, "backward-casts": s.backward_casts,
            "casts-folded": s.casts_folded, "converted": s.converted, "total": s.total}
    attrs = " ".join(f'data-{k}="{v}"' for k, v in data.items())
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>autoscale diff: {_esc(s)}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<header>",
        "<h1>autoscale diff</h1>",
        f'<p class="summary" id="summary" {attrs}>{_esc(s)}</p>',
    ]
    parts.extend(f'<p class="details">{_esc(line)}</p>' for line in _summary_details(s, d))
    parts.append('<p class="legend"><span class="inserted">inserted</span><span class="removed">removed</span>'
                 '<span class="changed">changed</span><span class="cast">precision cast</span>'
                 '<span class="emulated">emulated op</span><span class="scale">scale point</span>'
                 '<span class="unscale">unscale / align point</span> '
                 '<label><input type="checkbox" id="only-changes"> show only changes</label></p>')
    parts.append("</header>")
    sections = [d.backward] if backward_only else [d.forward, d.backward]
    for section in sections:
        parts.extend(_html_section(section, infos))
    parts.append(f"<script>{_JS}</script>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _cell(e: NodeEntry, side: Literal["before", "after"]) -> str:
    text = e.before if side == "before" else e.after
    if text is None:
        return '<td class="empty"></td>'
    status = e.status if side == "after" or e.status in ("removed", "changed") else "unchanged"
    classes = f"node {status} {e.kind}"
    badge = f'<span class="badge">{_esc(_scale_note(e.scale))}</span>' if side == "after" and e.scale else ""
    return f'<td class="{classes}" title="{_esc(_title(e))}">{_esc(text)}{badge}</td>'


def _reads(e: NodeEntry) -> str:
    """The names a node's line reads (for the hover outline): identifiers inside its call."""
    text = e.after or e.before or ""
    head, _, call = text.partition(" = ")
    call = call.split("  # ")[0]
    names = []
    for token in call.replace("(", " ").replace(")", " ").replace(",", " ").replace("[", " ").replace("]", " ").split():
        if token.isidentifier():
            names.append(token)
    return " ".join(dict.fromkeys(names))


def _html_section(section: GraphSection, infos: Mapping[tuple[int, str], ScaleInfo]) -> Iterator[str]:
    title = "Forward (Dynamo graph)" if section.name == "forward" else "Backward (AOTAutograd)"
    yield f'<section id="{section.name}" class="section">'
    yield f"<h2>{title}</h2>"
    counts = ", ".join(f"{section.count(k)} {k}" for k in ("inserted", "removed", "changed", "unchanged"))
    yield f'<p class="details">{_esc(counts)}</p>'
    if not section.entries:
        yield "<p>No backward graph: nothing in the model requires a gradient.</p></section>"
        return
    yield '<table class="graph"><colgroup><col style="width:50%"><col style="width:50%"></colgroup>'
    yield "<thead><tr><th>before</th><th>after</th></tr></thead>"
    members: dict[tuple[int, str], list[NodeEntry]] = defaultdict(list)
    for e in section.entries:
        if e.scale_op is not None:
            members[(e.graph, e.scale_op)].append(e)
    yield "<tbody>"
    for e in section.entries:
        if e.scale_op is None:
            yield _html_row(section.name, e)
            continue
        key = (e.graph, e.scale_op)
        if key not in members:
            continue
        # a rescale point's backward nodes: one group (at its first node), folded away until asked
        info = infos[key]
        yield "</tbody>"
        yield (f'<tbody class="scale-op {info.kind}" data-scale-op="{_esc(info.node)}">'
               f'<tr class="group-head"><td class="empty"></td>'
               f'<td class="group {info.kind}" title="{_esc(info.reason)}">'
               f"{_esc(info.node)} backward: {_esc(_scale_note(info))} "
               f'<label><input type="checkbox"> show its {info.backward_nodes} ATen nodes</label></td></tr>')
        for m in members.pop(key):
            yield _html_row(section.name, m)
        yield "</tbody><tbody>"
    yield "</tbody></table>"
    if section.folded:
        yield "<h3>Folded casts</h3><ul>"
        for f in section.folded:
            who = f"inserted by {f.created_by}" if f.created_by else "the model's own cast"
            yield f'<li class="folded">{_esc(f.text)} <em>({_esc(f.stage)}, {_esc(who)})</em></li>'
        yield "</ul>"
    if section.islands:
        yield "<h3>FP32 islands</h3><ul>"
        for i in section.islands:
            yield f"<li><code>{_esc(i.op)}</code> ({_esc(', '.join(i.nodes))}): {_esc(i.reason)}</li>"
        yield "</ul>"
    yield from _html_numbers(section, infos)
    yield "</section>"


def _html_row(section: str, e: NodeEntry) -> str:
    row_class = f"row {e.status}" + (" member" if e.scale_op is not None else "")
    return (f'<tr class="{row_class}" id="{section}-{e.graph}-{_esc(e.name)}" data-name="{_esc(e.name)}" '
            f'data-reads="{_esc(_reads(e))}">{_cell(e, "before")}{_cell(e, "after")}</tr>')


def _html_numbers(section: GraphSection, infos: Mapping[tuple[int, str], ScaleInfo]) -> Iterator[str]:
    """The per-node numbers as a table: every node that changed (scale ops as one row each), and
    every node with a predicted underflow rate."""
    yield "<h3>Per-node numbers</h3>"
    yield ('<table class="numbers"><thead><tr><th>node</th><th>status</th><th>kind</th><th>layer</th>'
           "<th>dtype before</th><th>dtype after</th><th>predicted underflow</th><th>scale</th>"
           "<th>pass</th><th>reason</th></tr></thead><tbody>")
    done: set[tuple[int, str]] = set()
    for e in section.entries:
        if e.scale_op is not None:
            if (e.graph, e.scale_op) in done:
                continue
            done.add((e.graph, e.scale_op))
            i = infos[(e.graph, e.scale_op)]
            yield (f'<tr class="group-row {i.kind}"><td>{_esc(i.node)} (backward, {i.backward_nodes} nodes)</td>'
                   f"<td>inserted</td><td>{i.kind}</td><td>{_esc(i.layer)}</td><td></td><td></td>"
                   f'<td class="num">{_rate(i.underflow) if i.underflow is not None else ""}</td>'
                   f'<td class="num">{_scale(i.scale)}</td><td>insert_grad_scaling</td><td>{_esc(i.reason)}</td></tr>')
            continue
        if e.status == "unchanged" and e.underflow is None:
            continue
        p = e.provenance
        scale = _scale(e.scale.scale) if e.scale is not None else ""
        yield (f'<tr class="{e.status} {e.kind}"><td><a href="#{section.name}-{e.graph}-{_esc(e.name)}">'
               f"{_esc(e.name)}</a></td><td>{e.status}</td><td>{e.kind}</td><td>{_esc(e.layer)}</td>"
               f"<td>{_esc(e.dtype_before or '')}</td><td>{_esc(e.dtype_after or '')}</td>"
               f'<td class="num">{_rate(e.underflow) if e.underflow is not None else ""}</td>'
               f'<td class="num">{scale}</td><td>{_esc(p.pass_name if p else "")}</td>'
               f"<td>{_esc(p.reason if p else '')}</td></tr>")
    yield "</tbody></table>"
