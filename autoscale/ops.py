"""autoscale's graph ops: the ``autoscale::`` custom ops and the gradient rescale point.

``rescale(x, scales, stats, out_rows, in_rows, record_rows, unscale, moments, fused, measured)`` is the
identity in the forward. In the backward it multiplies the arriving gradient by

    factor = max(scales[out_rows]) / max(scales[in_rows])        (an empty set means 1)

— the scales are powers of two, so this is exact unless it overflows — and, when
``record_rows`` is not empty, records the gradient's statistics in those rows of ``stats``
(``autoscale.measure``: what a point measures, and how it is recorded). Every
scale in ``scales`` is an *absolute* target: the total scale a gradient carries after that
layer's scale point (row 0 is the loss scale). A scale point is ``out_rows=(r,)`` with
``in_rows`` the scale the gradient arrives with; aligning branches at a merge is
``out_rows=`` their union; unscaling a parameter's gradient back to the loss scale is
``out_rows=(0,)`` with ``unscale`` set (that gradient leaves the graph, and its zeros are counted).
A point that is not ``measured`` only multiplies: no statistics, no inf/nan check, no guard
(``insert_grad_scaling``: the alignment of a float32 gradient, which a scale cannot overflow, where
it is not the first measurement of a float16 one; every point of a step that measures nothing,
``ScalingConfig.measure_every``). An unscale point that is not measured still checks its output
for inf/nan, for the step's skip alone: it blames no layer (the loss row takes the flag) and records
nothing else.

Statistics are normalized by the scale the gradient arrived with, so the update rule sees
magnitudes at unit scale and needs no knowledge of the graph.

``point(grad, scales, stats, ...)`` is a measured point's backward as one op, as a compiled
backward's trace takes it; the joint-stage pass ``autoscale/passes/expand_points.py`` writes it out.

``watch(x, peaks, slot)`` is the forward's overflow check: it folds ``max |x|`` into one slot of
the scaler's ``peaks`` (``autoscale/passes/insert_overflow_checks.py``).

``emulated(op, dtype, *args, **kwargs)`` is a low-precision op computed in float32: what
``Config(compute="emulate")`` turns every low-precision GEMM into (``autoscale/passes/emulate_compute.py``).
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
from typing import Any, NamedTuple

import torch

from autoscale.measure import MAX, NUM_STATS, STAT, largest, measured_point, point_backward, record, rescaled, traced

__all__ = [
    "E4M3_MAX", "E5M2_MAX", "FP16_MAX", "LAYOUT_SEP", "NUM_STATS", "PROMOTED_SEP", "SCALE_RANGE", "STAT", "Attached",
    "attach", "emulated", "gradient_max", "headroom", "identity_output", "point", "rescale", "resolve",
    "trace_decompositions", "watch",
]

FP16_MAX = 65504.0


SCALE_RANGE = (2.0**-24, 2.0**40)
"""The per-layer scales' range: far beyond what float16 needs (a gradient scaled by 2^40 would
have been ~1e-12 at unit scale, below every float16 value), and well inside float32's, so a scale,
its reciprocal and a product of two stay finite."""


E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: float8's forward format
E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)  # 57344: float8's backward format


def headroom(margin: int, fmax: float = FP16_MAX) -> float:
    """The largest gradient magnitude a scale may aim for: the gradient format's max (float16's,
    or E5M2's under ``Config.float8``), ``2**margin`` below."""
    return fmax / 2.0**margin


def gradient_max(float8: bool) -> float:
    """The largest finite value of the format gradients are rounded to."""
    return E5M2_MAX if float8 else FP16_MAX



@torch.library.custom_op("autoscale::attach", mutates_args=("stats", "peaks"))
def attach(scales: torch.Tensor, stats: torch.Tensor, peaks: torch.Tensor, layout: str, moments: bool,
           promoted: str, instance: str = "", measuring: bool = True) -> None:
    """Does nothing. ``GradScaler`` calls it at the top of the model's forward so that Dynamo lifts
    the state tensors into the graph as inputs; the backend finds it, reads ``layout`` (the layer
    of each row), ``moments`` (whether the scaler's rule needs Σ g and Σ g²) and ``promoted`` (the
    forward-overflow sites learnt at run time, ``PROMOTED_SEP``-separated) and removes it. Dynamo
    guards on the strings, so a new promotion recompiles the graph: that is how a repair lands.
    ``instance`` names the state (``ScaleState.instance``) for the same reason: a copy of the model
    (``copy.deepcopy``) has a state of its own, and without it Dynamo's guards let the copy run the
    graph compiled for the original, which the copy's scaler knows nothing of. ``measuring``: whether
    this step's backward measures its gradients (``ScalingConfig.measure_every``); a step that does
    not runs a graph compiled without the measurements, so Dynamo keeps one of each."""


@attach.register_fake
def _(scales: torch.Tensor, stats: torch.Tensor, peaks: torch.Tensor, layout: str, moments: bool,
      promoted: str, instance: str = "", measuring: bool = True) -> None:
    return None


class Attached(NamedTuple):
    """``attach``'s arguments, by name (graph nodes for the tensors, constants for the rest)."""

    scales: Any
    stats: Any
    peaks: Any
    layout: str
    moments: bool
    promoted: str
    instance: str = ""
    measuring: bool = True


# The marker ops carry lists of names packed into one string (a custom op's schema has ``str``,
# not ``str[]``, and Dynamo guards on it): a layout's rows, the promoted forward-overflow sites.
LAYOUT_SEP = "\x1f"
PROMOTED_SEP = "\x1e"


def watch(x: torch.Tensor, peaks: torch.Tensor, slot: int) -> None:
    """Fold ``max |x|`` into ``peaks[slot]``: a forward overflow check, inserted after a float16 value.

    NaN propagates through ``amax`` and the fold's max, so one reduction tells all three things the
    scaler asks: non-finite (inf or nan), near float16's max, and the measured peak. The reduction
    is fused by Inductor into the kernel that produces ``x``; the slot is written through
    ``autoscale.measure.record``, which ``autoscale/passes/batch_records.py`` folds with the graph's other
    checks into one update of ``peaks`` at the end of the forward.

    The maximum is a one-element vector (``autoscale.measure.largest``): Inductor writes it straight
    into its slot of the fold's vector, with no buffer of its own and no copy.

    In float32 from the start (``abs`` and ``max`` are exact in both): Inductor, emulating float16
    casts, rounds each float16 op's result back to float16, and ``abs().amax()`` on the float16
    value cost two conversions more per element in the kernel of every watched value.
    """
    if x.numel() == 0:
        return
    peak = largest(x.detach().float().abs())
    peaks.copy_(record(peaks, [peak], [slot], [MAX], [None], [math.inf]))


def identity_output(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the output of an identity ``autograd.Function``'s forward (a rescale point, a
    gradient quantizer): a view of it run eagerly, an ``_unsafe_view`` when traced.

    Traced, a view would be a graph output aliasing an intermediate wherever the point is the
    graph's last op (the scale point on a model's final GEMM), and AOTAutograd regenerates such an
    output at every call, in Python (``aten._unsafe_view`` in its runtime wrapper, with alias
    checks around it): the quick transformer block of ``benchmarks.overhead`` took 31-69 µs longer
    in its 0.5 ms forward than without scale points (2 threads, two runs), 11-15 µs after. It is what
    AOTAutograd would return anyway, computed in the graph instead, where Inductor makes it a
    reinterpretation of the buffer. Eagerly, a view keeps the input's version counter, so an
    in-place change of the output that a saved tensor shares is still caught by autograd."""
    return torch.ops.aten._unsafe_view(x, x.shape) if traced(x) else x.view_as(x)


def _point(grad: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: list[int], in_rows: list[int],
           record_rows: list[int], unscale: bool, moments: bool, fused: bool, blame: bool, decompositions: str
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``measured_point`` as one op (``torch.ops.autoscale.point``), ``stats`` as it was where the
    point records nothing: how a compiled backward's trace takes a measured point, whose ~20 ops
    the joint-stage pass ``autoscale/passes/expand_points.py`` writes out afterwards (why: that
    module), with the ``decompositions`` the trace applies (``DECOMPOSITIONS``). Left as it is (a
    joint stage without the pass), it runs as an op and computes the same."""
    out, recorded = measured_point(grad, scales, stats, out_rows, in_rows, record_rows, unscale, moments, fused,
                                   blame=blame)
    return out, stats.clone() if recorded is None else recorded


def _point_fake(grad: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: list[int],
                in_rows: list[int], record_rows: list[int], unscale: bool, moments: bool, fused: bool, blame: bool,
                decompositions: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(grad), torch.empty_like(stats)


DECOMPOSITIONS = ("none", "inductor")
"""The decompositions a trace may apply that a point op can name: none (AOTAutograd's own, the
eager executor's), or Inductor's (``select_decomp_table``)."""


def trace_decompositions() -> str | None:
    """Which of ``DECOMPOSITIONS`` the trace running now applies; None when it is another table, or
    this torch's tracer does not say (a point is then traced op by op, as before the point op)."""
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return None
    # (the mode's own on torch 2.13; a global of the tracer's in some earlier versions)
    table = getattr(mode, "decomposition_table", getattr(proxy_tensor, "CURRENT_DECOMPOSITION_TABLE", None))
    if table is None:
        return None
    if all(op is _SYM_NUMEL for op in table):  # (which ``make_fx`` adds to every table)
        return "none"
    inductor = sys.modules.get("torch._inductor.decomposition")
    return "inductor" if inductor is not None and _same_table(table, inductor.select_decomp_table()) else None


_SYM_NUMEL = torch.ops.aten.sym_numel.default


def _same_table(table: dict[Any, Any], other: dict[Any, Any]) -> bool:
    """Whether the two decomposition tables are one but for ``sym_numel`` (without copying them: this
    runs at every point of a trace)."""
    own = 0
    for op, fn in table.items():
        if op is not _SYM_NUMEL:
            if other.get(op) is not fn:
                return False
            own += 1
    return own == len(other) - (_SYM_NUMEL in other)


_LIBRARY = torch.library.Library("autoscale", "FRAGMENT")
_LIBRARY.define("point(Tensor grad, Tensor scales, Tensor stats, int[] out_rows, int[] in_rows, int[] record_rows, "
                "bool unscale, bool moments, bool fused, bool blame, str decompositions) -> (Tensor, Tensor)")
_LIBRARY.impl("point", _point, "CompositeExplicitAutograd")
torch.library.register_fake("autoscale::point", _point_fake, lib=_LIBRARY)

point = torch.ops.autoscale.point.default


class _Rescale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor,
                out_rows: tuple[int, ...], in_rows: tuple[int, ...], record_rows: tuple[int, ...],
                unscale: bool, moments: bool, fused: bool, measured: bool) -> torch.Tensor:
        ctx.save_for_backward(scales)
        ctx.stats = stats  # held, not saved: the backward writes it in place
        ctx.rows = out_rows, in_rows, record_rows, unscale, moments, fused
        ctx.measured = measured
        return identity_output(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (scales,) = ctx.saved_tensors
        out_rows, in_rows, _, unscale, _, fused = ctx.rows
        if not ctx.measured and not unscale:
            return rescaled(grad, scales, out_rows, in_rows), *_NO_GRADS
        if traced(grad) and not fused and (decompositions := trace_decompositions()) is not None:
            # (one op in the trace: ``autoscale/passes/expand_points.py``; the fused kernel's launch is
            # a ``triton_op``, which only the trace's functionalization writes out as its kernel)
            out, recorded = point(grad, scales, ctx.stats, *map(list, ctx.rows[:3]), *ctx.rows[3:], ctx.measured,
                                  decompositions)
            ctx.stats.copy_(recorded)
            return out, *_NO_GRADS
        return point_backward(grad, scales, ctx.stats, *ctx.rows, blame=ctx.measured), *_NO_GRADS


_NO_GRADS = (None,) * 9  # for rescale's arguments after x


def rescale(x: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: tuple[int, ...],
            in_rows: tuple[int, ...], record_rows: tuple[int, ...] = (), unscale: bool = False,
            moments: bool = False, fused: bool = False, measured: bool = True) -> torch.Tensor:
    """Identity forward; backward rescales the gradient and records its statistics (see the module).
    ``fused``: on CUDA, the backward runs the fused Triton kernel (``ScalingConfig.point_kernel="fused"``).
    ``measured=False``: the backward only rescales, or, unscaling, only checks for inf/nan
    (``record_rows`` must then be empty)."""
    if not measured and record_rows:
        raise ValueError(f"a rescale point that is not measured records nothing: got record_rows={record_rows}")
    out: torch.Tensor = _Rescale.apply(x, scales, stats, out_rows, in_rows, record_rows, unscale, moments, fused,
                                       measured)
    return out


def emulated(op: str, dtype: torch.dtype, /, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``op(*args, **kwargs)`` in float32 from its ``dtype`` inputs, rounded to ``dtype``.

    ``op`` is the op's importable name (``torch._C._nn.linear``, ``torch.Tensor.matmul``): FX
    generates Python source for its graphs, which can hold a name but not a function as an
    argument. A product of two float16 (or bfloat16) numbers is exact in float32 and GPU tensor
    cores accumulate in float32, so this computes what native low precision computes, up to
    summation order, at float32 GEMM speed. Autograd differentiates through the casts, so the
    backward GEMMs are emulated alike: each gradient leaving the op is rounded to ``dtype``, as a
    native GEMM's output is.
    """
    up = tuple(a.to(torch.float32) if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args)
    kw = {k: v.to(torch.float32) if isinstance(v, torch.Tensor) and v.dtype == dtype else v for k, v in kwargs.items()}
    out: torch.Tensor = resolve(op)(*up, **kw)
    return out.to(dtype)


@functools.cache
def resolve(name: str) -> Any:
    """The object an importable dotted ``name`` stands for: the longest importable prefix, then
    attributes (``torch.ops.aten.mm.default``). ``ImportError``/``AttributeError`` if none."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"cannot import {name}")
