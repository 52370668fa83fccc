"""The graph diff's entry point, :func:`diff`: check the arguments, capture the graphs, align them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from autoscale.config import Config
from autoscale.diff.align import assemble
from autoscale.diff.capture import capture_graphs
from autoscale.diff.model import GraphDiff
from autoscale.report import load_telemetry, summarize
from autoscale.rewrite import device_of

__all__ = ["diff"]


def diff(model: nn.Module, example_inputs: tuple[Any, ...], *, config: Config | None = None,
         measure: bool = False, telemetry: str | Path | None = None) -> GraphDiff:
    """Run autoscale's pipeline on ``model`` for ``example_inputs`` (a tuple of positional
    arguments) and return what it changed in the forward and backward graphs.

    The model is deep-copied first, so its parameters, buffers and any scaler state stay as they
    are; the copy runs one forward (Dynamo has to execute a frame to capture it). ``measure``: also
    run each graph once in float32 on the example inputs and put the measured per-layer numbers
    beside the analysis' predictions in the per-layer map (one more forward and backward).
    ``telemetry``: the JSON-lines log of ``GradScaler(model, telemetry=...)`` from a training run
    of this model; its last run's per-layer scales, weight-gradient zero rates and overflows join
    the map (``autoscale.report.summarize``). A log that is not the scaler's is refused
    (``autoscale.report.TelemetryError``) before anything is captured.
    """
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"diff config must be an autoscale.Config, got {type(config).__name__}")
    if not isinstance(example_inputs, tuple | list):
        raise ValueError("example_inputs must be a tuple of the model's positional arguments, "
                         f"got {type(example_inputs).__name__} (write (x,) for one input)")
    run = {layer.name: layer for layer in summarize(load_telemetry(telemetry)).layers} if telemetry else None
    cfg = (config or Config()).resolved(device_of(example_inputs))
    return assemble(capture_graphs(model, example_inputs, cfg, measure=measure), cfg, run)

