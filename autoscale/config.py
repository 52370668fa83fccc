"""Configuration: frozen dataclasses, validated on construction, passed explicitly.

Nothing here reads the environment or holds global state: a ``Config`` is a value. Invalid
values raise ``ValueError`` naming the field and what it accepts, so a typo fails at the call
site rather than deep inside a compile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from autoscale.protocol import FORMS

__all__ = ["Config", "OverflowConfig", "QuantConfig", "ScalingConfig", "recipe", "recipe_names"]

Compute = Literal["auto", "native", "emulate"]
Executor = Literal["inductor", "eager"]
ScalingMode = Literal["adaptive", "dynamic", "static", "none"]

_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_FLOAT8_NAMES = ("float8", "fp8")
_COMPUTES: tuple[str, ...] = ("auto", "native", "emulate")
_EXECUTORS: tuple[str, ...] = ("inductor", "eager")
_SCALING_MODES: tuple[str, ...] = ("adaptive", "dynamic", "static", "none")


def _choice(owner: str, name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"{owner}.{name}={value!r} is not valid; allowed values: {', '.join(map(repr, allowed))}"
        )


def _flag(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name}={value!r} is not valid; it must be a bool")


def _count(owner: str, name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}.{name}={value!r} is not valid; it must be an int >= {low}")


def _real(owner: str, name: str, value: object, ok: Callable[[float], bool], what: str) -> None:
    """``value`` must be a real number (not a bool, a string or nan) for which ``ok`` holds."""
    if (isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value)
            or not ok(float(value))):
        raise ValueError(f"{owner}.{name}={value!r} is not valid; it must be {what}")


@dataclass(frozen=True)
class ScalingConfig:
    """Gradient-scaling settings (docs/design.md#gradient-scaling).

    ``GradScaler`` reads the runtime settings (mode, rule, margin, update_every, measure_every, the
    caps and the dynamic-mode knobs); the backend reads the compile-time ones (``placement``, ``gamma``,
    ``calibrate``, ``point_kernel``, and ``margin`` for the initial scales) from ``Config.scaling``.

    mode:       "adaptive" (per-layer scales in the backward graph, the default), "dynamic" (one
                global loss scale with torch.amp.GradScaler semantics, plus ``hysteresis`` and
                ``min_scale``), "static" (a fixed loss scale ``init_scale``) or "none".
    rule:       adaptive only. "headroom" (default): each layer's scale is the largest power of two
                that keeps every float16 gradient it produces ``2**margin`` below 65504. "paper": the
                IJCAI 2020 rule, from the predicted underflow rate ``gamma`` of the layer's GEMM.
    placement:  adaptive only. "all" (the default: a scale point at every backward GEMM and
                gradient cast into float16; each layer's scale then follows its measured gradients)
                or "predicted" (only where the analysis predicts underflow above ``gamma`` at compile
                time: fewer points, but gradients shrink as the loss falls, by 10-100x on the
                numerics benchmark's MLP, and a layer without a point cannot follow them).
    calibrate:  compile-time. Run the captured graph once in float32 on copies of the example
                inputs and use the measured magnitudes instead of the analysis' predictions.
    point_kernel: compile-time, CUDA only. "inductor" (the default): each scale point's backward is
                plain torch that Inductor fuses into the kernels next to it, as on a CPU (always,
                there). "fused": the Triton kernel ``autoscale::scale_grad``, one pass over the
                gradient, but in a launch of its own plus one that zeroes its statistics. On an
                H200, Inductor's points were faster on the overhead benchmark's launch-bound steps
                (docs/results/overhead_cuda.md, its (a'')). The fused kernel is instruction-bound,
                well below a copy's bandwidth (docs/results/kernels.md), so its single pass saves
                little on large gradients.
    update_every: recompute the adaptive scales every F steps (statistics accumulate in between).
    measure_every: adaptive only, compiled models only. Measure the gradients at every M-th step
                only (the first, then every M, and the one after a skipped step): the steps between
                run a second graph, compiled at the first of them, whose points only multiply and
                check the parameters' gradients for inf/nan, as torch.amp does, and whose forward has
                no overflow check. An overflow there, in the forward or the backward, is skipped, and
                the next step measures to find the scale or the value that made it. The scales then
                follow the gradients every M steps. 1 measures every step; what M saves and costs is
                in docs/scaling.md ("Steps that measure nothing"). (A module from
                ``autoscale.convert`` measures every step.)
    scale_upper_bound: optional cap on any one scale.
    init_scale, growth_factor, backoff_factor, growth_interval: torch.amp.GradScaler's, for
                "dynamic" (``init_scale`` is also the "static" scale). In "adaptive" mode,
                ``growth_factor`` caps how much a layer's scale may rise per update (it falls at
                once), and ``backoff_factor`` is what an overflowing layer's scale is multiplied by
                (by at most ``2**-margin`` under the "headroom" rule when it overflowed at the
                previous update too: its gradients have grown more than ``2**margin``-fold).
    """

    mode: ScalingMode = "adaptive"
    rule: Literal["headroom", "paper"] = "headroom"
    placement: Literal["predicted", "all"] = "all"
    gamma: float = 1e-3
    margin: int = 6
    calibrate: bool = False
    point_kernel: Literal["inductor", "fused"] = "inductor"
    update_every: int = 1
    measure_every: int = 1
    scale_upper_bound: float | None = None
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        _choice("ScalingConfig", "mode", self.mode, _SCALING_MODES)
        _choice("ScalingConfig", "rule", self.rule, ("headroom", "paper"))
        _choice("ScalingConfig", "placement", self.placement, ("predicted", "all"))
        _choice("ScalingConfig", "point_kernel", self.point_kernel, ("inductor", "fused"))
        owner = "ScalingConfig"
        _real(owner, "gamma", self.gamma, lambda v: 0.0 < v < 1.0, "a number in (0, 1)")
        _flag(owner, "calibrate", self.calibrate)
        for name in ("margin", "update_every", "measure_every", "growth_interval", "hysteresis"):
            _count(owner, name, getattr(self, name), 0 if name == "margin" else 1)
        for name in ("init_scale", "min_scale"):
            _real(owner, name, getattr(self, name), lambda v: 0.0 < v < math.inf, "a finite number > 0")
        # (1: scales never rise; below 1 every update would shrink them)
        _real(owner, "growth_factor", self.growth_factor, lambda v: 1.0 <= v < math.inf, "a finite number >= 1")
        _real(owner, "backoff_factor", self.backoff_factor, lambda v: 0.0 < v < 1.0, "in (0, 1)")
        if self.scale_upper_bound is not None:
            _real(owner, "scale_upper_bound", self.scale_upper_bound, lambda v: v >= 1.0, "None or >= 1")


@dataclass(frozen=True)
class QuantConfig:
    """Fake quantization for cyclic precision training (docs/design.md#quantizers; runtime: ``autoscale.FakeQuant``).

    The forward bit-width is not here: it is runtime state (``FakeQuant.set_bits``/``step``), so a
    schedule changes it every step without recompiling. Compile-time choices:

    weights:     quantize each GEMM's weight per output channel (min/max of the weight).
    activations: quantize each GEMM's activation inputs per tensor (running min/max).
    grad_bits:   quantize the gradient arriving at each GEMM's output at this many bits, with
                 stochastic rounding (CPT's fixed backward precision); None leaves it alone.
    momentum:    of the activations' running min/max.
    """

    weights: bool = True
    activations: bool = True
    grad_bits: int | None = 8
    momentum: float = 0.9

    def __post_init__(self) -> None:
        for name in ("weights", "activations"):
            _flag("QuantConfig", name, getattr(self, name))
        bits = self.grad_bits
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16):
            raise ValueError(f"QuantConfig.grad_bits={bits!r} is not valid; it must be None or an int in [2, 16]")
        _real("QuantConfig", "momentum", self.momentum, lambda v: 0.0 <= v < 1.0, "in [0, 1)")


@dataclass(frozen=True)
class OverflowConfig:
    """Forward overflow: float16 values above 65504 (docs/design.md#forward-overflow, docs/forward_overflow.md).

    The backend reads the compile-time settings, ``GradScaler`` the run-time ones (from the
    ``Config`` it is given, or the defaults).

    predict:   compile time. Keep in float32 every op whose predicted forward max (from the real
               example inputs and parameters) exceeds ``threshold`` x 65504, with what must follow it.
    watch:     compile time. Give every float16 value that can overflow (GEMM and convolution
               outputs, elementwise results, casts into float16) a flag computed where it is
               produced and reduced on the device; needs ``GradScaler`` in adaptive mode.
    threshold: the fraction of float16's max above which a value counts as about to overflow: a
               prediction above it keeps the op in float32, a measured max above it promotes the op
               to float32 before it overflows (1.0: only once it has).
    max_recompiles: run time. How many times ``GradScaler`` may promote ops after forward
               overflows (one recompile each, all the sites found at one step together); past it,
               overflowing steps are skipped and reported.
    patience:  run time. Consecutive steps that are non-finite with nothing left to promote (a value
               non-finite in float32 too: log(0), a bad batch) before ``GradScaler.update`` raises
               ``NonFiniteForwardError``; each such step is skipped with a warning naming the node.
    """

    predict: bool = True
    watch: bool = True
    threshold: float = 0.5
    max_recompiles: int = 4
    patience: int = 3

    def __post_init__(self) -> None:
        owner = "OverflowConfig"
        _flag(owner, "predict", self.predict)
        _flag(owner, "watch", self.watch)
        _real(owner, "threshold", self.threshold, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
        _count(owner, "max_recompiles", self.max_recompiles, 0)
        _count(owner, "patience", self.patience, 1)


@dataclass(frozen=True)
class Config:
    """How autoscale rewrites a model.

    dtype:    the low-precision dtype, ``torch.float16`` (default) or ``torch.bfloat16``; the names
              "float16"/"fp16"/"half" and "bfloat16"/"bf16" are accepted and normalized.
    compute:  "native" runs low-precision GEMMs in that dtype; "emulate" stores and rounds every
              tensor exactly as native does but computes GEMMs in float32 from the low-precision
              inputs (CPUs without FP16 matrix units are ~100x slower natively); "auto" picks
              native on CUDA and emulate elsewhere.
    executor: "inductor" (default) or "eager" (AOTAutograd without a code generator, for debugging).
    allow, deny, infer, clear: extra op names for the precision tables (see
              ``autoscale.passes.op_tables``); an entry here overrides the built-in category.
    scaling:  gradient-scaling settings.
    overflow: forward-overflow settings (prediction, run-time flags, repair).
    quant:    fake quantization of GEMM inputs and gradients (cyclic precision training), or None.
    float8:   round every GEMM's inputs to float8 E4M3 (per-tensor current scaling) and the gradient
              arriving at its output to E5M2 (after its layer's scale point), simulated; storage
              between GEMMs stays ``dtype``. ``dtype="float8"`` (or "fp8") is shorthand for
              ``dtype=torch.float16, float8=True``.
    verify:   after every pass, re-propagate fake values through the whole graph and check that
              the values the passes recorded match (slow: for developing passes; the "debug"
              recipe and the test suite turn it on).
    form:     how the scale points', checks' and update's work is laid out for a device's
              kernels (``autoscale.protocol.FORMS``); every form computes the same numbers.
              "default": what every device takes. "fewer_launches": laid out for a GPU's launch
              count (points write their outputs in their producers' kernels and hand partial
              results by rows to the fold, laid out as Inductor lays out each value; the update is
              one Triton launch). Counted offline it launches fewer kernels
              (docs/results/kernel_counts.md), but it has never been timed on a GPU, so it is off
              until it is; on a CPU it is slower. "fewer_launches_in_parts": the same without
              the partial results by rows, which the kernel counts weigh it against.
    """

    dtype: torch.dtype = torch.float16
    compute: Compute = "auto"
    executor: Executor = "inductor"
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    infer: tuple[str, ...] = ()
    clear: tuple[str, ...] = ()
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    overflow: OverflowConfig = field(default_factory=OverflowConfig)
    quant: QuantConfig | None = None
    float8: bool = False
    verify: bool = False
    form: str = "default"

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str) and self.dtype in _FLOAT8_NAMES:
            object.__setattr__(self, "dtype", torch.float16)
            object.__setattr__(self, "float8", True)
        object.__setattr__(self, "dtype", _normalize_dtype(self.dtype))
        _flag("Config", "float8", self.float8)
        _flag("Config", "verify", self.verify)
        _choice("Config", "form", self.form, tuple(FORMS))
        if self.quant is not None and not isinstance(self.quant, QuantConfig):
            raise ValueError(f"Config.quant must be a QuantConfig or None, got {type(self.quant).__name__}")
        _choice("Config", "compute", self.compute, _COMPUTES)
        _choice("Config", "executor", self.executor, _EXECUTORS)
        seen: dict[str, str] = {}
        for category in ("allow", "deny", "infer", "clear"):
            ops = getattr(self, category)
            if isinstance(ops, str) or not isinstance(ops, tuple | list):
                raise ValueError(f"Config.{category} must be a tuple of op names, got {ops!r}")
            for op in ops:
                if not isinstance(op, str) or not op:
                    raise ValueError(f"Config.{category} must contain op names (non-empty str), got {op!r}")
                if not op.isidentifier():  # ("torch.mm", "aten::mm" would never match: ops go by bare name)
                    raise ValueError(f"Config.{category} contains {op!r}, which is not an op name: name ops as the "
                                     "precision report does, without namespace or overload ('mm', 'linear', 'my_op')")
                if op in seen:
                    raise ValueError(f"op {op!r} is listed in both Config.{seen[op]} and Config.{category}")
                seen[op] = category
            object.__setattr__(self, category, tuple(ops))
        if not isinstance(self.scaling, ScalingConfig):
            raise ValueError(f"Config.scaling must be a ScalingConfig, got {type(self.scaling).__name__}")
        if not isinstance(self.overflow, OverflowConfig):
            raise ValueError(f"Config.overflow must be an OverflowConfig, got {type(self.overflow).__name__}")

    @functools.cached_property
    def op_overrides(self) -> Mapping[str, str]:
        """Op name -> category for the user's table extensions (built once: passes ask per node)."""
        return {op: cat for cat in ("allow", "deny", "infer", "clear") for op in getattr(self, cat)}

    def resolved(self, device: torch.device) -> Config:
        """This config with ``compute="auto"`` made concrete for tensors on ``device``."""
        if self.compute != "auto":
            return self
        return dataclasses.replace(self, compute="native" if device.type == "cuda" else "emulate")

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def _normalize_dtype(value: object) -> torch.dtype:
    aliases = {"fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    if isinstance(value, str):
        value = _DTYPES.get(aliases.get(value, value), value)
    if value not in _DTYPES.values():
        raise ValueError(
            f"Config.dtype={value!r} is not valid; allowed values: torch.float16, torch.bfloat16 "
            "(or the strings 'float16', 'bfloat16'), or 'float8' (float16 storage, float8 GEMM inputs)"
        )
    assert isinstance(value, torch.dtype)
    return value


_RECIPES: dict[str, Config] = {
    "default": Config(),
    "debug": Config(executor="eager", verify=True),
    "bf16": Config(dtype=torch.bfloat16),
    "fp8": Config(dtype=torch.float16, float8=True),
}


def recipe_names() -> tuple[str, ...]:
    """Names accepted by :func:`recipe`."""
    return tuple(_RECIPES)


def recipe(name: str, **changes: Any) -> Config:
    """A named, ready-made Config ("default", "debug": eager executor and verified passes,
    "bf16", "fp8"), optionally changed."""
    if name not in _RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(map(repr, _RECIPES))}")
    return _RECIPES[name].replace(**changes) if changes else _RECIPES[name]
