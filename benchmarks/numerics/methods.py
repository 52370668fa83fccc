"""The methods compared: float32, float16 with no scaling, fixed loss scales, torch.amp.GradScaler
(its defaults and a short growth interval), and autoscale's dynamic and adaptive modes (adaptive
also measuring its gradients every 16th step only: ``ScalingConfig.measure_every``).

Every float16 method runs the same autoscale-rewritten graph: float16 storage and rounding,
float32 master weights, float32 where the precision pass keeps it (losses, norms, softmax), and
on this CPU emulated GEMMs (float32 arithmetic on float16 inputs, rounded to float16), compiled
with the eager executor (AOTAutograd without Inductor: the same numerics, bit for bit, without
Inductor's compile time per run). The methods differ only in how gradients are scaled, which
is what the benchmark is about. torch.amp.GradScaler runs on that graph as it runs on a GPU
under torch.autocast: it scales the loss, unscales and checks the gradients, skips steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

import autoscale
from autoscale import ScalingConfig

__all__ = ["METHODS", "Method", "get"]

Kind = Literal["fp32", "autoscale", "torch.amp"]


@dataclass(frozen=True)
class Method:
    """One way to train. ``scaling``: the autoscale ScalingConfig (compile-time and scaler);
    ``growth_interval``: torch.amp.GradScaler's, for the ``torch.amp`` kind."""

    name: str
    label: str
    kind: Kind
    scaling: ScalingConfig | None = None
    growth_interval: int = 2000

    @property
    def float16(self) -> bool:
        return self.kind != "fp32"

    def backend(self) -> autoscale.Backend:
        """The compile backend of a float16 method (per-layer scale points only for adaptive)."""
        scaling = self.scaling if self.scaling is not None else ScalingConfig(mode="none")
        return autoscale.backend(autoscale.Config(executor="eager", scaling=scaling))

    def scaler(self, module: nn.Module) -> Any:
        """The method's gradient scaler for ``module`` (create it before the first forward), or
        None for plain ``backward()`` + ``step()``."""
        if self.kind == "torch.amp":
            return torch.amp.GradScaler("cpu", growth_interval=self.growth_interval)
        if self.kind == "autoscale" and self.scaling is not None and self.scaling.mode != "none":
            return autoscale.GradScaler(module, self.scaling)
        return None


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("fp32", "float32", "fp32"),
    Method("fp16", "float16, no scaling", "autoscale", ScalingConfig(mode="none")),
    *(Method(f"static-{s}", f"fixed loss scale {s}", "autoscale", ScalingConfig(mode="static", init_scale=float(s)))
      for s in (8, 128, 1024, 32768)),
    Method("amp", "torch.amp.GradScaler (defaults)", "torch.amp"),
    Method("amp-short", "torch.amp.GradScaler (growth_interval=50)", "torch.amp", growth_interval=50),
    Method("dynamic", 'autoscale "dynamic"', "autoscale", ScalingConfig(mode="dynamic")),
    Method("adaptive", 'autoscale "adaptive" (default)', "autoscale", ScalingConfig()),
    Method("adaptive-m16", 'autoscale "adaptive", measure_every=16', "autoscale", ScalingConfig(measure_every=16)),
)}
"""Every method by name, in the order the report lists them."""


def get(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; the methods are {', '.join(METHODS)}")
    return METHODS[name]
