"""The ``torch.compile`` backend: Dynamo graph -> passes -> AOTAutograd -> joint passes -> executor.

``torch.compile(model, backend="autoscale")`` finds :func:`autoscale_backend` through the
``torch_dynamo_backends`` entry point; ``autoscale.backend(config)`` builds a configured
:class:`Backend` whose ``records`` keep what each compile did. Every graph Dynamo hands over
(one per graph break) goes through the same pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule

from autoscale.config import Config
from autoscale.inspect import PrecisionReport, precision_report
from autoscale.passes import PIPELINE, PassRecord, PassSpec, run_stage
from autoscale.passes.analyze_underflow import calibrate, seed_inputs
from autoscale.passes.graph_utils import dtype_name
from autoscale.runtime import state_of

__all__ = ["Backend", "CompileRecord", "JointStage", "autoscale_backend", "backend", "rewrite_graph"]

log = logging.getLogger("autoscale")


@dataclass
class CompileRecord:
    """What one compile of one graph did: the resolved config, the precision report and the
    passes of both stages (the joint stage's arrive when AOTAutograd builds the backward)."""

    config: Config
    report: PrecisionReport
    passes: list[PassRecord] = field(default_factory=list)


@dataclass(frozen=True)
class JointStage:
    """The joint stage of the pipeline, bound to one compile, as the executors receive it.

    ``run`` rewrites AOTAutograd's joint graph in place; ``passes`` and ``key`` (the config and
    pass names) identify what it does, for Inductor's caches.
    """

    run: Callable[[GraphModule], None]
    passes: tuple[Callable[..., Any], ...]
    key: str


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
        from autoscale.executors import EXECUTORS, inductor_keeps_roundings  # Inductor: only when compiling

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
        return EXECUTORS[cfg.executor](gm, example_inputs, JointStage(run_joint, joint_passes, key))


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
    _register(gm, example_inputs)
    report = precision_report(gm, dtype=dtype_name(cfg.dtype), compute=cfg.compute)
    return CompileRecord(cfg, report, passes)


def backend(config: Config | None = None) -> Backend:
    """A backend for ``torch.compile`` that uses ``config`` (default: ``Config()``)."""
    return Backend(config)


def autoscale_backend(gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The backend registered as ``"autoscale"`` (entry point ``torch_dynamo_backends``)."""
    return Backend()(gm, example_inputs)


def _seed_scales(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Start the layers' scales from the analysis' prediction, so the first step is already
    scaled. Only rows still at their initial 1.0 are set: a recompile never undoes what the
    scaler has learnt."""
    initial = gm.meta.get("autoscale_initial_scales")
    if not initial:
        return
    scales = example_inputs[gm.meta["autoscale_scales_input"]]
    with torch.no_grad():
        for row, value in initial.items():
            if float(scales[row]) == 1.0:
                scales[row] = value


def _register(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Tell the scaler's state that a graph serves it, and which inputs' gradients that graph checks
    for inf/nan, so that ``GradScaler.step`` does not make another pass over them."""
    index = gm.meta.get("autoscale_scales_input")
    state = state_of(example_inputs[index]) if index is not None else None
    if state is None:
        return
    state.graphs += 1
    if gm.meta.get("autoscale_scaling_needed", True):
        state.scaled_graphs += 1
        state.gradient_max = min(state.gradient_max, gm.meta.get("autoscale_gradient_max", state.gradient_max))
    for i in gm.meta.get("autoscale_checked_inputs", []):
        if isinstance(example_inputs[i], torch.Tensor):  # (a loaded converted module has no user inputs yet)
            state.checked[example_inputs[i]] = True


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")
