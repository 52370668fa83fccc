"""autoscale's graph ops: the ``autoscale::`` custom ops and the gradient rescale point.

``rescale(x, scales, stats, out_rows, in_rows, record_rows, unscale)`` is the identity in
the forward. In the backward it multiplies the arriving gradient by

    factor = max(scales[out_rows]) / max(scales[in_rows])        (an empty set means 1)

— the scales are powers of two, so this is exact unless it overflows — and, when
``record_rows`` is not empty, adds the gradient's statistics to those rows of ``stats``. Every
scale in ``scales`` is an *absolute* target: the total scale a gradient carries after that
layer's scale point (row 0 is the loss scale). A scale point is ``out_rows=(r,)`` with
``in_rows`` the scale the gradient arrives with; aligning branches at a merge is
``out_rows=`` their union; unscaling a parameter's gradient back to the loss scale is
``out_rows=(0,)`` with ``unscale`` set (that gradient leaves the graph, and its zeros are counted).

Statistics are normalized by the scale the gradient arrived with, so the update rule sees
magnitudes at unit scale and needs no knowledge of the graph. ``scale_and_measure`` is the
point's computation: the fused Triton kernel on CUDA, plain torch that Inductor fuses elsewhere.
``scale_grad_reference`` is the oracle both are tested against.

``watch(x, peaks, slot)`` is the forward's overflow check: it folds ``max |x|`` into one slot of
the scaler's ``peaks`` (``passes/insert_overflow_checks.py``).

``emulated(op, dtype, *args, **kwargs)`` is a low-precision op computed in float32: what
``Config(compute="emulate")`` turns every low-precision GEMM into (``passes/emulate_compute.py``).
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, NamedTuple

import torch

__all__ = [
    "COUNTS", "E4M3_MAX", "E5M2_MAX", "FP16_MAX", "NUM_STATS", "PROMOTED_SEP", "SCALE_RANGE", "STAT", "Attached",
    "Measured", "attach", "emulated", "gradient_max", "headroom", "rescale", "resolve", "scale_and_measure",
    "scale_grad_reference", "watch",
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

# Columns of the stats tensor (one row per layer).
STAT = {"nonfinite": 0, "amax": 1, "sum": 2, "sumsq": 3, "count": 4, "zeros": 5, "numel": 6}
NUM_STATS = len(STAT)


@torch.library.custom_op("autoscale::attach", mutates_args=("stats", "peaks"))
def attach(scales: torch.Tensor, stats: torch.Tensor, peaks: torch.Tensor, layout: str, moments: bool,
           promoted: str) -> None:
    """Does nothing. ``GradScaler`` calls it at the top of the model's forward so that Dynamo lifts
    the state tensors into the graph as inputs; the backend finds it, reads ``layout`` (the layer
    of each row), ``moments`` (whether the scaler's rule needs Σ g and Σ g²) and ``promoted`` (the
    forward-overflow sites learnt at run time, ``PROMOTED_SEP``-separated) and removes it. Dynamo
    guards on the strings, so a new promotion recompiles the graph: that is how a repair lands."""


@attach.register_fake
def _(scales: torch.Tensor, stats: torch.Tensor, peaks: torch.Tensor, layout: str, moments: bool,
      promoted: str) -> None:
    return None


class Attached(NamedTuple):
    """``attach``'s arguments, by name (graph nodes for the tensors, constants for the rest)."""

    scales: Any
    stats: Any
    peaks: Any
    layout: str
    moments: bool
    promoted: str


PROMOTED_SEP = "\x1e"


def watch(x: torch.Tensor, peaks: torch.Tensor, slot: int) -> None:
    """Fold ``max |x|`` into ``peaks[slot]``: a forward overflow check, inserted after a float16 value.

    NaN propagates through ``amax`` and ``maximum``, so one reduction tells all three things the
    scaler asks: non-finite (inf or nan), near float16's max, and the measured peak. Written as a
    plain in-place update of a graph input, so that Inductor fuses the reduction into the kernel
    that produces ``x`` and functionalization writes the slot back at the end of the forward.
    """
    if x.numel() == 0:
        return
    peak = x.detach().abs().amax().float()
    peaks[slot] = torch.maximum(peaks[slot], peak)


COUNTS = ("arrived_nonfinite", "elements", "zeros", "made_nonfinite", "underflowed")


def scale_grad_reference(grad: torch.Tensor, factor: torch.Tensor, carried: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One gradient through a rescale point, in plain torch: ``(out, fstats, counts)``.

    ``out`` is ``grad·factor`` in grad's dtype with the values this made non-finite set to 0;
    ``fstats`` = [max |g|/carried, Σ g/carried, Σ (g/carried)²] over grad's finite values;
    ``counts`` (int64) as named by ``COUNTS``: arrived non-finite, elements, zeros in grad, made
    non-finite, and underflowed (finite non-zero values that ``out`` rounds to zero). The oracle of
    the Triton kernel (``autoscale.kernels.scale_grad``) and of ``scale_and_measure``.
    """
    g = grad.float()
    finite = torch.isfinite(g)
    safe = torch.where(finite, g, 0.0) / carried.float()
    scaled = (g * factor.float()).to(grad.dtype)
    made = torch.isfinite(scaled)
    out = torch.where(made, scaled, torch.zeros((), dtype=grad.dtype, device=grad.device))
    zero = torch.zeros((), device=g.device)
    fstats = torch.stack([safe.abs().amax() if g.numel() else zero, safe.sum(), (safe * safe).sum()]).float()
    counts = torch.stack([
        (~finite).sum(),
        torch.tensor(g.numel(), device=g.device),
        (g == 0).sum(),
        (finite & ~made).sum(),
        (finite & (g != 0) & (out == 0)).sum(),
    ]).to(torch.int64)
    return out, fstats, counts


class Measured(NamedTuple):
    """What a rescale point measures of the gradient it rescales, as 0-dim tensors: the statistics
    over its finite values at unit scale (``amax``, ``total``, ``squares``: max |g|, Σ g, Σ g²), whether
    any value arrived non-finite, whether the rescale made any finite value non-finite, and how
    many values are exactly zero."""

    amax: torch.Tensor
    total: torch.Tensor
    squares: torch.Tensor
    arrived: torch.Tensor
    made: torch.Tensor
    zeros: torch.Tensor


def scale_and_measure(grad: torch.Tensor, factor: torch.Tensor, carried: torch.Tensor, *, leaving: bool = False
                      ) -> tuple[torch.Tensor, Measured]:
    """The rescale point's backward: ``out`` as in ``scale_grad_reference`` and its ``Measured``.

    On CUDA, the fused Triton kernel (imported on first use: ``import autoscale`` stays
    triton-free). Elsewhere, plain torch that Inductor fuses into the kernel of the backward op
    next to it; it computes only what the point records, with fewer reductions than the oracle:
    the two non-finite flags come from the finite maximum (a finite value overflows under
    ``factor`` iff the largest one does) and one ``any``.

    Written so that Inductor computes ``out`` in place, over the gradient's own buffer: Inductor
    does so only when the node writing ``out`` is the last to read that buffer. On CPU, writing a
    cold buffer instead cost more than the rest of the point (a transformer block's GELU backward
    kernel took 1.0 ms against 0.34 ms unscaled; in place, 0.5 ms). So either ``out`` reads the
    flags, which makes the reductions its ancestors (and costs a second, cache-warm pass), or, for
    a gradient ``leaving`` the graph (a parameter's, unscaled), the statistics are measured on
    ``out`` itself in one pass. Nothing below a leaving gradient reads it, so it is handed back
    unguarded, inf and nan kept, as torch.amp leaves them (CUDA's kernel zeroes them either way);
    ``arrived`` then flags any non-finite value in it (the unscale itself makes one only where
    grad's dtype cannot hold g·factor: never for the float32 gradient of float16 values).
    """
    if grad.device.type == "cuda":
        import autoscale.kernels.scale_grad  # noqa: F401  (registers autoscale::scale_grad)

        out, fstats, counts = torch.ops.autoscale.scale_grad(grad, factor, carried)
        return out, Measured(fstats[0], fstats[1], fstats[2], counts[0] > 0, counts[3] > 0, counts[2].float())
    # (Finiteness as |x| < inf: false for inf and nan alike, and two ops where isfinite traces to
    # four; it reuses the |x| the maximum needs. Fewer ops per element and per point matter here:
    # the kernels these fuse into are compute-bound, and every traced op costs compile time.)
    g = grad.float()
    scaled = g * factor.float()
    if leaving:
        out = scaled.to(grad.dtype)
        measured, unit_scale = out.float(), factor.float() * carried.float()  # out at unit scale: out / scale
    else:
        measured, unit_scale = g, carried.float()
    magnitude = measured.abs()
    finite = magnitude < math.inf
    peak = torch.where(finite, magnitude, 0.0).amax() if g.numel() else torch.zeros((), device=g.device)
    unit = torch.where(finite, measured, 0.0) / unit_scale
    arrived = ~finite.all()
    if leaving:
        made = torch.zeros((), dtype=torch.bool, device=g.device)
    else:
        bound = _overflow_threshold(grad.dtype)
        made = ~(peak * factor.float() < bound)
        # Without a flag no value overflows (|g·factor| <= peak·factor < bound) and the test per
        # element changes nothing; with one, it zeroes what is non-finite, as the reference does.
        out = torch.where(~(arrived | made) | (scaled.abs() < bound), scaled, 0.0).to(grad.dtype)
    return out, Measured(
        amax=peak / unit_scale,
        total=unit.sum(),
        squares=(unit * unit).sum(),
        arrived=arrived,
        made=made,
        zeros=(measured == 0).sum(dtype=torch.int32).float(),
    )


@functools.cache
def _overflow_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to infinity in ``dtype`` (round to nearest even): its max
    plus half its last step, 65520 for float16; inf for 32 bits and wider (the comparison runs in
    float32, where only inf is beyond)."""
    info = torch.finfo(dtype)
    if info.bits >= 32:
        return math.inf
    step = 2.0 ** math.floor(math.log2(info.max)) * info.eps
    return float(info.max) + step / 2


def _accumulate(stats: torch.Tensor, entries: dict[tuple[int, str], torch.Tensor]) -> None:
    """Fold each ``entries[row, column]`` into ``stats[row, STAT[column]]``: max for amax, sum otherwise.

    One pointwise update per row, each column picked by a constant index, which Inductor fuses
    into the point's kernel. How this is written decides the compiled backward's buffers:
    * with ``torch.stack`` building the row, each scalar became a buffer of its own and an alias
      in the compiled graph's Python wrapper (861 lines of Python for a 7-layer MLP's backward,
      against 139 unscaled; 232 now);
    * as one update of the whole tensor, Inductor deferred every point's fold to one kernel at the
      end, so every point's scalars lived through the whole backward; small buffers pinned between
      large ones kept glibc trimming and regrowing the heap (~600 page faults, ~1 ms per step);
    * per row, each point's fold runs with its kernel and its scalars die there.
    (An opaque custom op here cost ~80 µs a call.)
    """
    column = torch.arange(NUM_STATS, device=stats.device)
    by_row: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for (row, name), value in entries.items():
        by_row.setdefault(row, []).append((name, value))
    for row, values in by_row.items():
        current = stats[row]
        added = torch.zeros((), device=stats.device)
        for name, value in values:
            if name != "amax":
                added = torch.where(column == STAT[name], value, added)
        new = current + added
        for name, value in values:
            if name == "amax":
                new = torch.where(column == STAT[name], torch.maximum(current, value), new)
        stats[row] = new


def _max_of(scales: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    if not rows:
        return torch.ones((), dtype=scales.dtype, device=scales.device)
    if len(rows) == 1:  # (the usual case: one select, where an index and a reduction trace to four ops)
        return scales[rows[0]]
    return scales[list(rows)].amax()


class _Rescale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor,
                out_rows: tuple[int, ...], in_rows: tuple[int, ...], record_rows: tuple[int, ...],
                unscale: bool, moments: bool) -> torch.Tensor:
        ctx.save_for_backward(scales)
        ctx.stats = stats  # held, not saved: the backward writes it in place
        ctx.rows = out_rows, in_rows, record_rows, unscale, moments
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (scales,) = ctx.saved_tensors
        out_rows, in_rows, record_rows, unscale, moments = ctx.rows
        carried = _max_of(scales, in_rows)
        factor = _max_of(scales, out_rows) / carried
        out, m = scale_and_measure(grad, factor, carried, leaving=unscale)
        # One statistics update per point. Rows in ``record_rows`` get the gradient's statistics
        # (a bias's unscale point records none: its weight's point does). Non-finite values are
        # blamed on the scale that produced them: those that arrived non-finite were made under
        # ``in_rows``; those this point made, by ``out_rows`` (``out`` has them zeroed, so the rest
        # of the backward does not blame every layer below; the step is skipped anyway). So a
        # gradient leaving through an unscale point is checked, and ``GradScaler.step`` skips it.
        # (numel as a SymInt, not float(): that would specialize a dynamic batch size to its first value)
        elements = torch.full((), grad.numel(), dtype=torch.float32, device=grad.device)
        recorded = {"amax": m.amax, "count": elements}
        if moments:  # (Σ g and Σ g² only for a rule that reads them)
            recorded.update(sum=m.total, sumsq=m.squares)
        if unscale:
            recorded.update(zeros=m.zeros, numel=elements)
        # An unscale point's output leaves the graph: whatever is non-finite in it is blamed on the
        # layer's scale (on CPU it is measured after the unscale; CUDA's kernel reports apart what
        # the unscale made, which only a float16 parameter's gradient can hold).
        arrived, made = (m.arrived | m.made).float() if unscale else m.arrived.float(), m.made.float()
        made_rows = () if unscale else out_rows
        entries: dict[tuple[int, str], torch.Tensor] = {}
        for row in sorted(set(record_rows) | set(in_rows) | set(made_rows)):
            flags = [flag for flag, blamed in ((arrived, row in in_rows), (made, row in made_rows)) if blamed]
            if flags:
                entries[row, "nonfinite"] = sum(flags[1:], flags[0])
            if row in record_rows:
                entries.update(((row, column), value) for column, value in recorded.items())
        _accumulate(ctx.stats, entries)
        return out, *_NO_GRADS


_NO_GRADS = (None,) * 7  # for rescale's arguments after x


def rescale(x: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: tuple[int, ...],
            in_rows: tuple[int, ...], record_rows: tuple[int, ...] = (), unscale: bool = False,
            moments: bool = False) -> torch.Tensor:
    """Identity forward; backward rescales the gradient and records its statistics (see the module)."""
    out: torch.Tensor = _Rescale.apply(x, scales, stats, out_rows, in_rows, record_rows, unscale, moments)
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
