"""The scale updates, written as tensor functions that run on the device with no host sync.

``adaptive_update`` is the adaptive mode's whole ``GradScaler.update()``: it decides from the
device's own flags whether the step overflowed, backs off the layers that overflowed or moves
every measured layer to the rule's scale, counts the skip, clears the statistics, and snapshots
the forward's peaks (with whether they call for a look on the host) for an asynchronous copy. It
never asks the host what happened, so it is the same code whether ``step()`` synced for the
overflow flag (a plain optimizer) or not (a fused one).

Run eagerly it is ~25 small ops, each finding cold caches right after a backward.
:class:`CompiledUpdate` compiles it the first time a scaler whose model Inductor compiles updates:
with Inductor into one C++ kernel on a CPU, or, in the "fewer_launches" form, as one Triton launch
on a GPU (``autoscale.kernels.update``, which Inductor would make seven); eagerly otherwise (the
eager executor, ``autoscale.convert``), or if compiling fails.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from autoscale.config import ScalingConfig
from autoscale.overflow import alarm, outputs_nonfinite
from autoscale.protocol import FP16_MAX, LOSS_ROW, SCALE_RANGE, STAT

__all__ = ["CompiledUpdate", "UpdateTensors", "adaptive_backoff", "adaptive_update", "dynamic_update", "paper_scales",
           "pow2floor", "rule_scales"]

log = logging.getLogger("autoscale")

FP16_MIN_SUBNORMAL = 2.0**-24

_NONFINITE, _AMAX = STAT["nonfinite"], STAT["amax"]


class UpdateTensors(NamedTuple):
    """What ``adaptive_update`` reads and writes, all on the model's device.

    ``scales``, ``stats`` (rows x ``STAT``), ``last_stats`` (the statistics the last due update
    used), ``overflows`` (per row: updates at which it overflowed), ``skips`` (skipped steps),
    ``found_inf`` (inf/nan the scaler found outside the graphs), ``last_skipped`` (0-dim bool);
    the forward's ``peaks`` with ``ForwardSites``' per-slot ``alarm_low``/``alarm_high``/``outputs``;
    and ``snapshot`` (the peaks, then whether they call for a look, then the overflow flag),
    which the scaler copies to the host without waiting.
    """

    scales: torch.Tensor
    stats: torch.Tensor
    last_stats: torch.Tensor
    overflows: torch.Tensor
    skips: torch.Tensor
    found_inf: torch.Tensor
    last_skipped: torch.Tensor
    peaks: torch.Tensor
    alarm_low: torch.Tensor
    alarm_high: torch.Tensor
    outputs: torch.Tensor
    snapshot: torch.Tensor


def adaptive_update(*tensors: torch.Tensor | None, due: bool, backoff: float, repeated_backoff: float,
                    growth: float, high: float, headroom: float) -> None:
    """The adaptive mode's update, in place on ``tensors``: the ``UpdateTensors`` fields in order,
    then ``bound`` (the paper rule's per-row scales, or None). (Flat, for ``CompiledUpdate``.)

    The step overflowed if ``found_inf`` is set or any row's statistics saw inf/nan. Then each
    flagged row's scale is multiplied by ``backoff``, or by ``repeated_backoff``
    (``adaptive_backoff``) when it overflowed at the previous due update too, and the
    others keep theirs; no row backs off when a graph output was non-finite in the forward (the
    forward explains the step; it is skipped all the same). Otherwise, when ``due`` (every
    ``update_every`` steps), every measured row gets ``rule_scales``. The loss row keeps its scale.
    Statistics are cleared when used, and a flagged row's when not due.
    """
    t, bound = UpdateTensors(*tensors[:-1]), tensors[-1]  # type: ignore[arg-type]
    again = t.last_stats[:, _NONFINITE] > 0  # it overflowed at the last due update too
    if due:
        # (``+ 0.0``: compiled, a plain copy of ``stats`` is folded into ``stats`` itself, and
        # torch 2.13's Inductor wrote it back after clearing ``stats``: ``last_stats`` came out zero.
        # CompiledUpdate checks every compiled variant against this function at its first call.)
        t.last_stats.copy_(t.stats + 0.0)
    nonfinite = t.stats[:, _NONFINITE]
    overflow = torch.maximum(t.found_inf, nonfinite.amax()) > 0
    peaks = t.peaks
    forward_nonfinite = outputs_nonfinite(peaks, t.outputs)
    look = alarm(peaks, t.alarm_low, t.alarm_high)
    flagged = (nonfinite > 0) & ~forward_nonfinite
    t.skips.add_(overflow)
    t.overflows.add_(flagged)
    scales = t.scales
    new = torch.where(flagged, scales * torch.where(again, repeated_backoff, backoff), scales)
    if due:
        measured, rule = rule_scales(scales, t.stats, bound, growth=growth, headroom=headroom)
        new = torch.where(measured & ~overflow, rule, new)
        t.stats.zero_()
    else:
        t.stats.masked_fill_(flagged[:, None], 0.0)
    keep = torch.arange(len(scales), device=scales.device) == LOSS_ROW
    scales.copy_(torch.where(keep, scales, new.clamp(SCALE_RANGE[0], high)))
    t.found_inf.zero_()
    t.last_skipped.copy_(overflow)
    t.snapshot[:-2].copy_(peaks)
    t.snapshot[-2].copy_(look)
    t.snapshot[-1].copy_(overflow)
    peaks.zero_()


def rule_scales(scales: torch.Tensor, stats: torch.Tensor, bound: torch.Tensor | None, *, growth: float,
                headroom: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that have a measurement, and the scale the headroom rule gives each: the power of
    two that puts the row's largest gradient ``headroom`` high, capped by ``bound`` (the paper
    rule's per-row scales) when given, rising by at most ``growth`` per update and falling at once.
    The cap matters after a batch of unusually small gradients: followed to the letter, the rule
    raised every scale by the dip (2^5 seen on the numerics benchmark's stress MLP), and the next
    ordinary batch overflowed and was skipped."""
    amax = stats[:, _AMAX]
    target = headroom / amax.clamp_min(torch.finfo(torch.float32).tiny)
    if bound is not None:
        target = torch.minimum(target, bound).clamp_min(1.0)
    return amax > 0, torch.minimum(pow2floor(target), scales * growth)


def paper_scales(stats: torch.Tensor, layers: Sequence[str], modules: Mapping[str, nn.Module], *,
                 gamma: float) -> torch.Tensor:
    """The IJCAI 2020 rule per row of ``stats`` (the ``bound`` that ``rule_scales`` takes; ``layers``
    names the rows, ``modules`` the model's by name): s_uf from the predicted spread of the layer's
    GEMM output, so that a fraction ``gamma`` of it at most underflows float16, bounded by s_of (``k``
    products of the row's largest gradient and weight stay below float16's max); rows without a
    weight fall back to the headroom rule (inf here)."""
    gamma_factor = math.sqrt(2) * _erfinv(gamma)  # 1.2533e-3 for γ = 1e-3
    out = torch.full_like(stats[:, 0], math.inf)
    count = stats[:, STAT["count"]].clamp_min(1)
    mean_g = stats[:, STAT["sum"]] / count
    var_g = (stats[:, STAT["sumsq"]] / count - mean_g**2).clamp_min(0)
    for row, name in enumerate(layers):
        weight = getattr(modules.get(name), "weight", None)
        if row == LOSS_ROW or not isinstance(weight, torch.Tensor) or weight.dim() < 2:
            continue
        w = weight.detach().float()
        k = w.numel() / w.shape[1]
        sigma_o = torch.sqrt((var_g[row] + mean_g[row] ** 2) * (w.var() + w.mean() ** 2)) * math.sqrt(k / 2)
        s_uf = FP16_MIN_SUBNORMAL / (gamma_factor * sigma_o.clamp_min(1e-30))
        s_of = (FP16_MAX / k) / (stats[row, STAT["amax"]] * w.abs().amax()).clamp_min(1e-30)
        out[row] = torch.minimum(s_uf, s_of)
    return out


def _erfinv(x: float) -> float:
    return float(torch.special.erfinv(torch.tensor(x, dtype=torch.float64)))


def pow2floor(x: torch.Tensor) -> torch.Tensor:
    """The largest power of two not above ``x`` (positive), exactly: ``2**floor(log2 x)``, corrected
    by one step where ``log2``'s last-bit error put it on the wrong side (compiled and eager
    ``log2`` may differ there; powers of two multiply exactly)."""
    p = torch.exp2(torch.floor(torch.log2(x)))
    p = torch.where(p > x, p * 0.5, p)
    return torch.where(p * 2.0 <= x, p * 2.0, p)


def adaptive_backoff(cfg: ScalingConfig) -> float:
    """What a layer's scale is multiplied by in adaptive mode when it overflows at two updates in a
    row (a first overflow backs off by ``backoff_factor``, as a lone spike should cost no more than
    its skipped step). Under the "headroom" rule a layer's scale puts its largest gradient
    ``2**margin`` below the format's max, so a second overflow in a row means its gradients grew
    more than ``2**margin``-fold: halving again would skip ``margin`` steps more before the scale
    caught up. It backs off by ``2**-margin`` (or by ``backoff_factor``, if that is smaller). Seen
    on ConvNeXt, whose layer scales start at 1e-6: one Adam step makes them ~1e-3, the gradients
    inside every block grow 1000-fold, and halving skipped ten steps."""
    return min(cfg.backoff_factor, 2.0**-cfg.margin) if cfg.rule == "headroom" else cfg.backoff_factor


def dynamic_update(scale: torch.Tensor, growth_tracker: torch.Tensor, hysteresis: torch.Tensor,
                   overflow: torch.Tensor, *, growth: float, backoff: float, interval: int, hysteresis_steps: int,
                   min_scale: float) -> None:
    """torch.amp's rule (``_amp_update_scale_``) with DeepSpeed's hysteresis and a floor, in place.

    With ``hysteresis_steps == 1`` (the default) it is torch.amp's own fused op and a clamp; with
    more, an overflow backs off only once ``hysteresis`` overflows were tolerated."""
    if hysteresis_steps == 1:
        torch._amp_update_scale_(scale, growth_tracker, overflow, growth, backoff, interval)
        scale.clamp_(min=min_scale)
        return
    inf = overflow > 0
    hysteresis_left = hysteresis > 1
    back_off = inf & ~hysteresis_left
    hysteresis.copy_(torch.where(inf & hysteresis_left, hysteresis - 1, hysteresis))
    grown = growth_tracker + 1
    grow = ~inf & (grown >= interval)
    new = torch.where(back_off, torch.clamp(scale * backoff, min=min_scale), torch.where(grow, scale * growth, scale))
    scale.copy_(torch.where(torch.isfinite(new), new, scale))
    growth_tracker.copy_(torch.where(inf | grow, torch.zeros_like(grown), grown))
    hysteresis.copy_(torch.where(grow, torch.full_like(hysteresis, hysteresis_steps), hysteresis))


Fused = Callable[..., Callable[..., None] | None]
"""A fused update's builder: ``fused(tensors, **constants)``, with ``CompiledUpdate``'s arguments,
returns a function of the non-None tensors that computes ``fn`` on them, or None for a state it does
not take (``autoscale.kernels.update.fused_update``)."""


class CompiledUpdate:
    """``fn(*tensors, **constants)`` compiled on first use, or run eagerly when ``compile`` is False
    or compiling fails: by ``fused`` where one is given (``autoscale.protocol.Form.fused_update``: one
    launch on a GPU) and it takes the state, by Inductor otherwise (on a CPU, one C++ kernel; for a
    GPU, seven: docs/results/kernel_counts.md).

    ``fn`` updates its tensor arguments in place. It is traced with ``make_fx`` on fake tensors
    and compiled with Inductor's ``compile_fx``, once per ``variant`` (a key the caller gives for
    the constants and for what a tensor argument is: None or not, its device), and called
    directly: through ``torch.compile``, Dynamo's frame evaluation and guards on a dozen tensors
    would cost many times the kernel. What ``compile_fx`` returns is still four wrappers deep
    (Dynamo's disable, AOTAutograd's forward and runtime wrapper, the output code), and right after
    a backward, with the caches cold, those layers are a sizeable share of the call. The graph
    mutates its inputs and returns nothing, which an inference graph keeps in itself, so the output
    code that Inductor compiled (caught on its way out of ``compile_fx_inner``) is called directly,
    with the boxed calling convention (a list of the tensors), when there is exactly one; from its
    second call, the generated module's ``call`` inside it (``_boxed``). Its size and stride
    asserts, one per tensor, are a share of that call too: a variant is also keyed by its tensors'
    layouts, so it is compiled without them.

    The first call of each variant is checked, fused or compiled: ``fn`` runs eagerly on copies of
    the tensors, and the results must equal it bit for bit (nan where nan), or the eager results are
    kept and every later call runs eagerly, with a warning. (Seen while writing it: torch 2.13's
    Inductor copied a tensor as already cleared; ``adaptive_update`` is written around that, and
    the check stands for other versions and devices.)
    """

    def __init__(self, fn: Callable[..., None], *, fused: Fused | None = None) -> None:
        self._fn = fn
        self._fused = fused
        self._variants: dict[Any, Callable[..., Any]] = {}
        self._failed = False

    def __call__(self, tensors: Sequence[torch.Tensor | None], *, variant: Hashable, compile: bool,
                 **constants: Any) -> Callable[..., None] | None:
        """Run ``fn`` on ``tensors``; return what ran when it ran compiled and checked (a function of
        the call's non-None tensors, in order, ``fn``'s constants compiled in; a caller may call it
        again on the same tensors), or None when it ran eagerly."""
        with torch.no_grad():
            if compile and not self._failed:
                present = [t for t in tensors if t is not None]
                variant = (variant, *((t.shape, t.stride(), t.dtype) for t in present))
                compiled = self._variants.get(variant)
                if compiled is not None:
                    compiled(*present)
                    return compiled
                try:
                    return self._first_call(tensors, present, variant, constants)
                except Exception as e:  # noqa: BLE001  (a compile failure: the eager function computes the same)
                    self._fall_back(f"{type(e).__name__}: {e}")
            self._fn(*tensors, **constants)
            return None

    def _first_call(self, tensors: Sequence[torch.Tensor | None], present: list[torch.Tensor], variant: Hashable,
                    constants: dict[str, Any]) -> Callable[..., None] | None:
        compiled = self._fused(tuple(tensors), **constants) if self._fused is not None else None
        if compiled is None:
            compiled = self._inductor(tensors, present, constants)
        expected = [t.clone() for t in present]
        self._fn(*_refill(tensors, expected), **constants)
        compiled(*present)
        if all(_same(a, b) for a, b in zip(present, expected, strict=True)):
            self._variants[variant] = compiled
            return compiled
        for a, b in zip(present, expected, strict=True):
            a.copy_(b)
        self._fall_back("its results differ from the eager function's")
        return None

    def _inductor(self, tensors: Sequence[torch.Tensor | None], present: list[torch.Tensor],
                  constants: dict[str, Any]) -> Callable[..., None]:
        """``fn`` on ``tensors`` and ``constants``, compiled by Inductor."""
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # (Inductor: only when compiling)
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        def flat(*traced: torch.Tensor) -> None:
            self._fn(*_refill(tensors, traced), **constants)

        inner: list[Callable[[list[torch.Tensor]], Any]] = []

        def catch_inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
            code = compile_fx_inner(gm, example_inputs, **kwargs)
            inner.append(code)
            return code

        # Traced on fake tensors of a mode with a shape environment, as Dynamo's are: Inductor's
        # FX graph cache takes no graph without one, and a warm start would compile the update
        # again. Its shapes stay static. Not AOTAutograd's
        # cache: a graph it serves never reaches ``catch_inner``, and the update would be called
        # through the wrappers above.
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in present]
        with fake_mode:
            graph = make_fx(flat)(*fakes)
        # (no size asserts: a variant's tensors have the layouts it was compiled for, by its key)
        with (torch._inductor.config.patch(size_asserts=False),
              torch._functorch.config.patch(enable_autograd_cache=False)):
            wrapped: Callable[..., Any] = compile_fx(graph, fakes, inner_compile=catch_inner)  # type: ignore[assignment]
        return _boxed(inner[0]) if len(inner) == 1 else wrapped

    def _fall_back(self, why: str) -> None:
        self._failed = True
        log.warning("the compiled scale update is not used (%s); updating eagerly", why)


def _boxed(code: Callable[[list[torch.Tensor]], Any]) -> Callable[..., Any]:
    """``code`` (Inductor's output code, which takes its inputs as one list and clears it) called
    with the tensors as arguments. The first call goes through the output code's own ``__call__``,
    which closes its compile's bookkeeping (the autotune cache's bundle, the runtime metrics); later
    calls go straight to the generated module's ``call`` it wraps (``current_callable``), which
    skips that bookkeeping's checks, which every steady-state ``update()`` would pay
    (docs/results/overhead_tiny.md)."""
    run = code

    def call(*tensors: torch.Tensor) -> None:
        nonlocal run
        run(list(tensors))
        run = getattr(code, "current_callable", None) or code

    return call


def _refill(tensors: Sequence[torch.Tensor | None], present: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``tensors`` with its non-None entries replaced by ``present``, in order."""
    it = iter(present)
    return [None if t is None else next(it) for t in tensors]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
