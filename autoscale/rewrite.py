"""Rewrite one Dynamo graph and attach the scaler's state to it: the core that both doors (the
backend, ``autoscale.convert``) and the graph diff share.

``rewrite_graph`` runs the Dynamo stage of the pipeline on a graph with its real example inputs:
the analysis is seeded from (or calibrated on) them, the passes run, and the scaler's state gets
the predicted first scales and learns that a graph serves it (``register_graph``). A graph after a
graph break, which does not announce the state itself, is given it first (``reach_state``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.fx import Graph, GraphModule, Node

from autoscale.config import Config
from autoscale.inspect import PrecisionReport, precision_report
from autoscale.ops import rescale, watch
from autoscale.passes import PIPELINE, PassRecord, PassSpec, run_stage
from autoscale.passes.analysis.seeding import calibrate, seed_inputs
from autoscale.passes.dynamo.insert_overflow_checks import SITES_KEY
from autoscale.passes.graph_utils import DYNAMO_ROOT, PREFIX_KEY, dtype_name, input_path, is_attach, provenance
from autoscale.runtime import ScaleState, owner_of, state_of

__all__ = ["ROOTED_AT", "CompileRecord", "RootedAt", "device_of", "reach_state", "register_graph", "rewrite_graph",
           "state_of_graph"]

log = logging.getLogger("autoscale")


@dataclass
class CompileRecord:
    """What one compile of one graph did: the resolved config, the precision report and the
    passes of both stages (the joint stage's arrive when AOTAutograd builds the backward)."""

    config: Config
    report: PrecisionReport
    passes: list[PassRecord] = field(default_factory=list)
    low_precision_parameters: tuple[str, ...] = ()
    """Trainable parameters that arrive in float16/bfloat16 (``model.half()``): computed with as
    given, with no float32 master copy."""
    cached: bool = False
    """AOTAutograd's cache served the compiled forward and backward (a warm start): the joint
    stage did not run, so ``passes`` holds the Dynamo stage's records only."""


def rewrite_graph(gm: GraphModule, example_inputs: Sequence[Any], config: Config,
                  pipeline: Sequence[PassSpec] = PIPELINE, *, attach: bool = True) -> CompileRecord:
    """Run the Dynamo stage of ``pipeline`` on ``gm`` in place, with the real ``example_inputs``.

    One function for the backend, ``autoscale.convert`` and the diff, so that all rewrite a graph
    exactly alike: the analysis is seeded from (or calibrated on) the real inputs, the passes run, the
    scaler's state gets the predicted first scales and learns that a graph serves it
    (``register_graph``). Without ``attach`` (the diff, which only reads the rewritten graph) the
    state is left as it was. The record's joint-stage passes are left to the executor.
    """
    cfg = config.resolved(device_of(example_inputs))
    seed_inputs(gm, example_inputs)
    if cfg.scaling.calibrate:
        calibrate(gm, example_inputs)
    passes = run_stage(gm, cfg, "dynamo", pipeline)
    if attach:
        _seed_scales(gm, example_inputs)
        register_graph(gm, example_inputs, cfg.overflow.threshold)
    report = precision_report(gm, dtype=dtype_name(cfg.dtype), compute=cfg.compute)
    record = CompileRecord(cfg, report, passes, _low_precision_parameters(gm, example_inputs))
    if record.low_precision_parameters:
        log.warning("parameters %s are already in low precision (model.half()?): autoscale computes with them as "
                    "given, but there is no float32 master copy, so the optimizer's updates are rounded to their "
                    "precision and small ones are lost. Keep the model in float32: autoscale casts the "
                    "parameters inside the graph", ", ".join(map(repr, record.low_precision_parameters)))
    return record


def reach_state(gm: GraphModule, example_inputs: Sequence[Any]
                 ) -> tuple[GraphModule, list[torch.Tensor]] | None:
    """Give a graph the GradScaler state that the model's forward announces (``attach``) when the
    announcement is in another graph: the graphs after a graph break.

    The graph's parameters name the state (``owner_of``). A copy of the graph gets two more
    placeholders, for the state's scales and for a statistics tensor of the graph's own
    (``ScaleState.stats_for_graph``), and an ``attach`` on them, so the passes scale it like any
    other graph; the compiled copy is then called with the two tensors bound (``_bind_last``).
    A copy, because Dynamo reads its graph's placeholders again after the backend returns.
    Returns the copy and the tensors, or None when the graph has its ``attach`` or no parameter
    of a model with a state.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if any(is_attach(n) for n in gm.graph.nodes):
        return None
    for node, x in zip(placeholders, example_inputs, strict=False):
        state = owner_of(x) if isinstance(x, torch.nn.Parameter) and x.requires_grad else None
        name = state.name_of(x) if state is not None else None
        path = input_path(node)
        if state is not None and name is not None and path is not None:
            break
    else:
        return None
    # the path of the scaler's model in this graph: where its parameter ``name`` sits
    prefix = path.removesuffix(name).rstrip(".") if path.endswith(name) else ""
    # or the other way round: the graph is one submodule's forward (FSDP2's fully_shard'ed blocks)
    inner = name.removesuffix(path).rstrip(".") if name != path and name.endswith("." + path) else ""
    rooted = None
    if inner:
        fsdp2 = _fsdp2_managed(state.root.get_submodule(inner))
        rooted = RootedAt(placeholders.index(node), weakref.ref(x), inner, fsdp2)
    bound = [state.scales, state.stats_for_graph(), state.peaks]
    fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
    graph = Graph()
    copies: dict[Node, Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for p in placeholders:  # AOTAutograd reads Dynamo's sources off the placeholders
        copies[p]._dynamo_source = getattr(p, "_dynamo_source", None)
    placeholders = [copies[p] for p in placeholders]
    added: list[Node] = []
    for name in ("autoscale_scales", "autoscale_graph_stats", "autoscale_peaks"):
        with graph.inserting_after(added[-1] if added else placeholders[-1] if placeholders else None):
            added.append(graph.placeholder(name))
    for p, tensor in zip(added, bound, strict=True):
        p.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True) if fake_mode is not None else tensor
        p._dynamo_source = None  # (AOTAutograd asks; user code has none)
    with graph.inserting_after(added[-1]):
        attach = graph.call_function(torch.ops.autoscale.attach.default, (
            *added, state.layout, state.moments, state.forward.promoted_key, state.instance))
    attach.meta[PREFIX_KEY] = prefix
    for node in (*added, attach):
        provenance(node, "reach_state", "the GradScaler's state, for a graph after a graph break", created=True)
    if inner:
        _root_at(graph, inner, type(state.root.get_submodule(inner)))
    copy = GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if rooted is not None:
        copy.meta[ROOTED_AT] = rooted
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    return copy, bound


ROOTED_AT = "autoscale_rooted_at"


@dataclass(frozen=True)
class RootedAt:
    """A graph that is the forward of the submodule at ``path`` of the scaler's model, told by its
    parameter input ``index`` (``param``)."""

    index: int
    param: weakref.ref[torch.Tensor]
    path: str
    fsdp2: bool  # the submodule is FSDP2-managed (``fully_shard``)


def _fsdp2_managed(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a torch built without distributed)
        return False
    return isinstance(module, FSDPModule)


def _root_at(graph: Graph, path: str, module_type: type) -> None:
    """Place the graph of one submodule's forward (Dynamo's paths start at that submodule) at
    ``path`` in the scaler's model: every op gets the submodule as its outermost module, so that
    the passes find each op's layer (its row of scales and statistics) and key by the model's paths.
    New stacks: the original graph's nodes share their meta with this copy's."""
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module", "get_attr"):
            continue
        entries = list((node.meta.get("nn_module_stack") or {}).items())
        # the submodule's entry is reached from the root its graph's entries are (``module_entry``
        # passes over entries reached from elsewhere): ``L['fn']`` for ``torch.compile(submodule)``
        found = DYNAMO_ROOT.match(str(entries[0][1][0])) if entries else None
        root = found.group(0) if found else "L['self']"
        stack = {"autoscale_root": (f"{root}.{path}", module_type)}
        for key, (where, *rest) in entries:
            stack[key] = (DYNAMO_ROOT.sub(lambda m: f"{m.group(0)}.{path}", str(where), count=1), *rest)
        node.meta["nn_module_stack"] = stack


def _low_precision_parameters(gm: GraphModule, example_inputs: Sequence[Any]) -> tuple[str, ...]:
    """The names of the trainable float16/bfloat16 parameters among the graph's inputs, when the
    graph is compiled for training (grad mode on)."""
    if not torch.is_grad_enabled():
        return ()
    names = []
    for node, x in zip(gm.graph.find_nodes(op="placeholder"), example_inputs, strict=False):
        if isinstance(x, torch.nn.Parameter) and x.requires_grad and x.dtype in (torch.float16, torch.bfloat16):
            names.append(input_path(node) or node.name)
    return tuple(names)


def _seed_scales(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Start the layers' scales from the analysis' prediction, so the first step is already
    scaled. Only rows no graph has seeded yet are set (``ScaleState.seeded``): a recompile never
    undoes what the scaler has learnt, nor a compile after ``GradScaler.load_state_dict`` what it
    loaded (a learnt scale may well be 1).

    Without a version bump: after a graph break the graphs compile one after another within a
    step, and an earlier graph has saved the scales for its backward. (Its backward reads only
    its own rows' values, and reads them when it runs, so a row seeded now is consistent.)"""
    initial = gm.meta.get("autoscale_initial_scales")
    if not initial:
        return
    scales = example_inputs[gm.meta["autoscale_scales_input"]]
    state = state_of(scales)
    seeded = state.seeded if state is not None else set()
    with torch.no_grad(), _unsafe_preserve_version_counter(scales):
        for row, value in initial.items():
            if row not in seeded:
                scales[row] = value
                seeded.add(row)


def state_of_graph(gm: GraphModule, example_inputs: Sequence[Any]) -> ScaleState | None:
    """The scaler state whose scales the graph reads, if any."""
    index = gm.meta.get("autoscale_scales_input")
    return state_of(example_inputs[index]) if index is not None else None


def register_graph(gm: GraphModule, example_inputs: Sequence[Any], threshold: float) -> None:
    """Tell the scaler's state that a graph serves it, and which inputs' gradients that graph checks
    for inf/nan, so that ``GradScaler.step`` does not make another pass over them."""
    state = state_of_graph(gm, example_inputs)
    if state is None:
        return
    state.graphs += 1
    for point in gm.graph.find_nodes(op="call_function", target=rescale):
        state.measured_rows.update(point.args[5])  # (its record_rows: ``GradScaler.layers`` lists them)
    _register_sites(gm, state, threshold)
    if gm.meta.get("autoscale_scaling_needed", True):
        state.scaled_graphs += 1
        state.gradient_max = min(state.gradient_max, gm.meta.get("autoscale_gradient_max", state.gradient_max))
    for i in gm.meta.get("autoscale_checked_inputs", []):
        if isinstance(example_inputs[i], torch.Tensor):  # (a loaded converted module has no user inputs yet)
            state.checked.add(example_inputs[i])


def _register_sites(gm: GraphModule, state: ScaleState, threshold: float) -> None:
    """Give the graph's forward overflow checks the state's slots for their sites (by key, so a
    recompiled graph writes where the last one did); a check beyond the state's capacity goes.
    The graph's own list of sites goes too: its checks now write the state's slots, and the sites
    live in the state (a saved converted graph is loaded with its state's sites, already mapped)."""
    sites = gm.meta.pop(SITES_KEY, None)
    if not sites:
        return
    slots = [state.forward.register(site, threshold) for site in sites]
    for node in list(gm.graph.find_nodes(op="call_function", target=watch)):
        slot = slots[node.args[2]]
        if slot is None:
            gm.graph.erase_node(node)
        else:
            node.update_arg(2, slot)
    # (upstream sites were numbered per graph too)
    for site, slot in zip(sites, slots, strict=True):
        if slot is not None:
            upstream = tuple(s for u in site.upstream if (s := slots[u]) is not None)
            state.forward.sites[slot] = replace(site, upstream=upstream)
    if state.forward.unwatched:
        log.warning("%d forward values are not watched for overflow: the scaler's %d slots are taken",
                    state.forward.unwatched, state.forward.capacity)
    gm.recompile()


def device_of(example_inputs: Sequence[Any]) -> torch.device:
    """The device of the first tensor among ``example_inputs`` (the CPU without one)."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")
