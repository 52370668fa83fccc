"""The ``torch.compile`` backend: Dynamo graph -> passes -> AOTAutograd -> joint passes -> executor.

``torch.compile(model, backend="autoscale")`` finds :func:`autoscale_backend` through the
``torch_dynamo_backends`` entry point; ``autoscale.backend(config)`` builds a configured
:class:`Backend` whose ``records`` keep what each compile did. Every graph Dynamo hands over
(one per graph break) is rewritten by ``autoscale.rewrite`` and compiled by the executor, which
runs the joint stage.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import GraphModule
from torch.nn.parallel import DistributedDataParallel

from autoscale.config import Config
from autoscale.inspect import PrecisionReport
from autoscale.passes import PIPELINE, PassSpec, run_stage
from autoscale.passes.graph_utils import dtype_name
from autoscale.rewrite import ROOTED_AT, CompileRecord, RootedAt, reach_state, rewrite_graph, state_of_graph

__all__ = ["Backend", "CompileRecord", "autoscale_backend", "backend", "reach_state", "rewrite_graph"]

log = logging.getLogger("autoscale")


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
        if cfg.executor == "inductor" and (state := state_of_graph(gm, example_inputs)) is not None:
            state.inductor_graphs += 1  # (the scaler compiles its update too: docs/results/overhead.md)
        if (rooted := gm.meta.get(ROOTED_AT)) is not None:
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


def _per_instance(compiled: Callable[..., Any], rooted: RootedAt, bound: int,
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


