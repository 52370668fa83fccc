"""The ``torch.compile`` backend: Dynamo graph -> passes -> AOTAutograd -> joint passes -> executor.

``torch.compile(model, backend="autoscale")`` finds :func:`autoscale_backend` through the
``torch_dynamo_backends`` entry point; ``autoscale.backend(config)`` builds a configured
:class:`Backend` whose ``records`` keep what each compile did. Every graph Dynamo hands over
(one per graph break) goes through the same pipeline.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.fx import Graph, GraphModule, Node
from torch.nn.parallel import DistributedDataParallel

from autoscale.config import Config
from autoscale.inspect import PrecisionReport, precision_report
from autoscale.ops import rescale, watch
from autoscale.passes import PIPELINE, PassRecord, PassSpec, run_stage
from autoscale.passes.analyze_underflow import calibrate, seed_inputs
from autoscale.passes.graph_utils import DYNAMO_ROOT, PREFIX_KEY, dtype_name, input_path, is_attach, provenance
from autoscale.passes.insert_overflow_checks import SITES_KEY
from autoscale.runtime import ScaleState, owner_of, state_of

__all__ = ["Backend", "CompileRecord", "autoscale_backend", "backend", "reach_state", "rewrite_graph"]

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


class Backend:
    """A configured autoscale backend; pass it to ``torch.compile(model, backend=...)``.

    It is a plain callable ``(gm, example_inputs) -> compiled``; it keeps one
    :class:`CompileRecord` per graph it compiled in ``records``.
    """

    def __init__(self, config: Config | None = None, *, pipeline: Sequence[PassSpec] = PIPELINE) -> None:
        if config is not None and not isinstance(config, Config):
            raise ValueError(f"backend config must be an autoscale.Config, got {type(config).__name__}")
        self.config = config or Config()
        self.pipeline = tuple(pipeline)
        self.records: list[CompileRecord] = []

    @property
    def reports(self) -> list[PrecisionReport]:
        """The precision report of every graph compiled so far."""
        return [r.report for r in self.records]

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self._compile(gm, example_inputs)

    def _compile(self, gm: GraphModule, example_inputs: Sequence[Any],
                 static_in: FakeTensorMode | None = None) -> Callable[..., Any]:
        """Compile Dynamo's graph ``gm``; with a fake mode ``static_in``, the executor traces the
        inputs but the parameters as fake tensors of static shapes in that mode (``_recompile``)."""
        from autoscale.executors import EXECUTORS, JointStage, inductor_keeps_roundings  # Inductor: only when compiling

        _refuse_ddp_split(example_inputs)
        dynamo_graph = gm
        if self.config.scaling.mode == "adaptive" and (reached := reach_state(gm, example_inputs)):
            gm, bound = reached
        else:
            bound = []
        example_inputs = [*example_inputs, *bound]
        record = rewrite_graph(gm, example_inputs, self.config, self.pipeline)
        cfg, report = record.config, record.report
        self.records.append(record)
        log.info("graph %d: %s", len(self.records) - 1, report)
        if cfg.executor == "inductor" and cfg.compute == "emulate" and not inductor_keeps_roundings():
            log.warning("this torch's Inductor folds float32 -> %s -> float32 round trips, so "
                        "emulated GEMMs read unrounded float32 inputs; use torch>=2.13 or "
                        "Config(executor='eager') for exact emulation", dtype_name(cfg.dtype))
        if report.unknown_ops:
            log.warning("ops not in the precision tables were kept in float32: %s "
                        "(classify them with Config.allow/deny/infer/clear)", ", ".join(report.unknown_ops))

        def run_joint(joint: GraphModule) -> None:
            record.passes.extend(run_stage(joint, cfg, "joint", self.pipeline))

        joint_passes = tuple(spec.fn for spec in self.pipeline if spec.stage == "joint")
        key = f"{cfg!r} {[fn.__name__ for fn in joint_passes]}"
        hits = _aot_cache_hits()
        traced = example_inputs if static_in is None else [
            static_in.from_tensor(x, static_shapes=True)
            if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) else x for x in example_inputs]
        compiled = EXECUTORS[cfg.executor](gm, traced, JointStage(run_joint, joint_passes, key))
        record.cached = _aot_cache_hits() > hits
        if cfg.executor == "inductor" and (state := _state_of_graph(gm, example_inputs)) is not None:
            state.inductor_graphs += 1  # (the scaler compiles its update too: docs/results/overhead.md)
        if (rooted := gm.meta.get(_ROOTED_AT)) is not None:
            compiled = _per_instance(compiled, rooted, len(bound), functools.partial(self._recompile, dynamo_graph))
        return _bind_last(compiled, bound) if bound else compiled

    def _recompile(self, gm: GraphModule, args: list[Any]) -> Callable[..., Any]:
        """``gm``, the graph Dynamo compiled, compiled again for ``args`` (another module of the
        class it was compiled for: ``_per_instance``), in the fake mode Dynamo traced it in and
        at the shapes of ``args``: fakes of other shapes or modes fail in the passes and AOTAutograd."""
        fake_mode = detect_fake_mode([n.meta.get("example_value", n.meta.get("val"))
                                      for n in gm.graph.find_nodes(op="placeholder")])
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            return self._compile(gm, args, static_in=fake_mode)


def _aot_cache_hits() -> int:
    """How many graphs AOTAutograd's cache has served in this process."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["autograd_cache_hit"])


def rewrite_graph(gm: GraphModule, example_inputs: Sequence[Any], config: Config,
                  pipeline: Sequence[PassSpec] = PIPELINE) -> CompileRecord:
    """Run the Dynamo stage of ``pipeline`` on ``gm`` in place, with the real ``example_inputs``.

    One function for the backend and ``autoscale.convert`` so that both rewrite a graph exactly
    alike: the analysis is seeded from (or calibrated on) the real inputs, the passes run, the
    scaler's state gets the predicted first scales and learns that a graph serves it. The
    record's joint-stage passes are left to the executor.
    """
    cfg = config.resolved(_device_of(example_inputs))
    seed_inputs(gm, example_inputs)
    if cfg.scaling.calibrate:
        calibrate(gm, example_inputs)
    passes = run_stage(gm, cfg, "dynamo", pipeline)
    _seed_scales(gm, example_inputs)
    _register(gm, example_inputs, cfg.overflow.threshold)
    report = precision_report(gm, dtype=dtype_name(cfg.dtype), compute=cfg.compute)
    record = CompileRecord(cfg, report, passes, _low_precision_parameters(gm, example_inputs))
    if record.low_precision_parameters:
        log.warning("parameters %s are already in low precision (model.half()?): autoscale computes with them as "
                    "given, but there is no float32 master copy, so the optimizer's updates are rounded to their "
                    "precision and small ones are lost. Keep the model in float32: autoscale casts the "
                    "parameters inside the graph", ", ".join(map(repr, record.low_precision_parameters)))
    return record


def backend(config: Config | None = None) -> Backend:
    """A backend for ``torch.compile`` that uses ``config`` (default: ``Config()``)."""
    return Backend(config)


def autoscale_backend(gm: GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable[..., Any]:
    """The backend registered as ``"autoscale"`` (entry point ``torch_dynamo_backends``)."""
    if options:  # torch.compile(..., options={...}) hands them over as options=...
        raise ValueError(f"the 'autoscale' backend takes no options (got {', '.join(map(repr, options))}); "
                         "configure it with torch.compile(model, backend=autoscale.backend(autoscale.Config(...)))")
    return Backend()(gm, example_inputs)


def _refuse_ddp_split(example_inputs: Sequence[Any]) -> None:
    """Dynamo's DDPOptimizer splits a DistributedDataParallel model's graph at its gradient
    buckets and hands the pieces over with fake inputs; only the first piece would see the
    scaler's state, so the others could not be scaled. Refuse, saying what works instead (the
    user sees it as Dynamo's BackendCompilerFailed at the first call)."""
    if not any(isinstance(x, FakeTensor) for x in example_inputs):
        return
    if DistributedDataParallel._get_active_ddp_module() is not None:
        raise RuntimeError(
            "autoscale cannot compile the pieces DDPOptimizer splits a DistributedDataParallel graph "
            "into (the model's gradients fill more than one DDP bucket): set "
            "torch._dynamo.config.optimize_ddp = False, or give DistributedDataParallel a bucket_cap_mb "
            "above the model's parameter size")


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
        rooted = _RootedAt(placeholders.index(node), weakref.ref(x), inner, fsdp2)
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
        copy.meta[_ROOTED_AT] = rooted
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    return copy, bound


_ROOTED_AT = "autoscale_rooted_at"


@dataclass(frozen=True)
class _RootedAt:
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


def _per_instance(compiled: Callable[..., Any], rooted: _RootedAt, bound: int,
                  compile_for: Callable[[list[Any]], Callable[..., Any]]) -> Callable[..., Any]:
    """``compiled``, the graph of the submodule at ``rooted.path``, for that submodule; for another
    module of its class, the same Dynamo graph compiled for that module (``compile_for`` of
    Dynamo's arguments, those before the ``bound`` tensors ``_bind_last`` adds), each keeping its
    own layers' rows.

    Dynamo compiles a module class's forward once and reuses the graph for every instance that
    passes its guards, which do not tell instances apart (their parameters are inputs): two
    towers, an ensemble, a teacher and a student, each compiled. Run for another instance, the
    graph would scale and measure that module's gradients in ``rooted.path``'s rows. Refused for
    FSDP2-managed modules (``fully_shard``): give each block a backend of its own."""
    graphs: dict[int, tuple[weakref.ref[torch.Tensor], Callable[..., Any]]] = {}

    def run(*args: Any) -> Any:
        param = args[rooted.index]
        if param is rooted.param():
            return compiled(*args)
        known = graphs.get(id(param))
        if known is None or known[0]() is not param:
            if rooted.fsdp2:
                raise RuntimeError(
                    f"autoscale: the graph compiled for the submodule {rooted.path!r} is running for another "
                    "FSDP2-managed module of its class (Dynamo reuses a graph across FSDP2-managed modules, whose "
                    f"guards it skips), which would scale that module's gradients with {rooted.path!r}'s scales. "
                    "Compile each fully_shard-ed block with a backend of its own: "
                    "`for block in blocks: block.compile(backend=autoscale.backend(config))`, and not the whole "
                    "model")
            known = graphs[id(param)] = (weakref.ref(param), compile_for(list(args[:len(args) - bound])))
        return known[1](*args[:len(args) - bound])

    return run


def _bind_last(compiled: Callable[..., Any], bound: list[torch.Tensor]) -> Callable[..., Any]:
    """``compiled`` with ``bound`` passed after the arguments Dynamo passes."""
    def run(*args: Any) -> Any:
        return compiled(*args, *bound)

    return run


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


def _state_of_graph(gm: GraphModule, example_inputs: Sequence[Any]) -> ScaleState | None:
    """The scaler state whose scales the graph reads, if any."""
    index = gm.meta.get("autoscale_scales_input")
    return state_of(example_inputs[index]) if index is not None else None


def _register(gm: GraphModule, example_inputs: Sequence[Any], threshold: float) -> None:
    """Tell the scaler's state that a graph serves it, and which inputs' gradients that graph checks
    for inf/nan, so that ``GradScaler.step`` does not make another pass over them."""
    state = _state_of_graph(gm, example_inputs)
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


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")
