"""A rescale point's backward: scale the gradient, measure it, and record the measurement.

The statistics tensor has one row per layer and the columns ``STAT`` names. A point computes its
scaled output and a few scalars (the largest finite magnitude at unit scale, whether a value
arrived non-finite, whether the scaling made one), and hands them to :func:`record` with the
cells they go to: ``stats`` comes back with each value folded into its cell, by max or by sum.

Why one op per point: each point's update of ``stats`` written as tensor ops (a select, a few
``where``, a ``select_scatter`` per row) made the statistics the bulk of the compiled backward —
a chain through one tensor that Inductor rewrote in full at every point: 3,000 of the 4,000 nodes
of a 1+1-layer T5's backward, and 23 s of its 80 s compile on this CPU. As one functional op per
point, the joint-stage pass ``passes/batch_records.py`` folds a whole graph's records at once,
into one small gather at the end of the backward; run eagerly (``autoscale.convert``, the tests),
``record`` folds one point's values itself.

``scale_and_measure`` computes the point's output and measurements: the fused Triton kernel on
CUDA, plain torch that Inductor fuses into the kernel next to it elsewhere.
``autoscale.kernels.reference.scale_grad_reference`` is the oracle of both.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["ANY_NONFINITE", "MAX", "NUM_STATS", "STAT", "SUM", "Measured", "fold", "point_backward", "record",
           "scale_and_measure"]

# Columns of the stats tensor (one row per layer). ``nonfinite`` is a flag (1 when a gradient the
# row's scale produced was inf/nan), ``amax`` the largest finite magnitude at unit scale; ``sum``,
# ``sumsq`` and ``count`` are recorded for the "paper" rule only, ``zeros`` and ``numel`` of
# parameter gradients (their zero rate, reported per layer).
STAT = {"nonfinite": 0, "amax": 1, "sum": 2, "sumsq": 3, "count": 4, "zeros": 5, "numel": 6}
NUM_STATS = len(STAT)
MAX, SUM = 0, 1
"""How a recorded value combines with its cell: ``STAT`` columns other than these two are sums."""
_COMBINE = {"nonfinite": MAX, "amax": MAX}
ANY_NONFINITE = STAT["amax"]
"""The cell of row 0 (the loss scale's, which no rule moves and no point measures) that holds
whether any point saw a non-finite value: ``GradScaler.step`` reads this one value (flat index)."""


class Measured(NamedTuple):
    """What a rescale point measures of the gradient it rescales, as 0-dim float32 tensors: the
    largest finite magnitude at unit scale (``amax``), and, when asked for, Σ g and Σ g² at unit
    scale (``total``, ``squares``) and the count of exact zeros (``zeros``); and the flags, 1.0 or
    0.0: a value arrived non-finite (``arrived``), the rescale made a finite value non-finite
    (``made``; None on CPU for a leaving gradient, which is measured on its output: there an
    overflow the unscale made shows as ``arrived``)."""

    amax: torch.Tensor
    arrived: torch.Tensor
    made: torch.Tensor | None
    total: torch.Tensor | None = None
    squares: torch.Tensor | None = None
    zeros: torch.Tensor | None = None


def scale_and_measure(grad: torch.Tensor, factor: torch.Tensor, carried: torch.Tensor, *, leaving: bool = False,
                      moments: bool = False, zeros: bool = False) -> tuple[torch.Tensor, Measured]:
    """The point's output, ``grad·factor`` in grad's dtype, and its ``Measured``.

    On CUDA, the fused Triton kernel (imported on first use: ``import autoscale`` stays
    triton-free). Elsewhere, plain torch that Inductor fuses into the kernel of the backward op
    next to it, computing only what is asked for.

    Written so that Inductor computes ``out`` in place, over the gradient's own buffer: Inductor
    does so only when the node writing ``out`` is the last to read that buffer. On CPU, writing a
    cold buffer instead cost more than the rest of the point (a transformer block's GELU backward
    kernel took 1.0 ms against 0.34 ms unscaled; in place, 0.5 ms). So either ``out`` reads the
    largest magnitude, which makes the reduction its ancestor (a second, cache-warm pass), or, for
    a gradient ``leaving`` the graph (a parameter's, unscaled), the statistics are measured on
    ``out`` itself in one pass. Nothing below a leaving gradient reads it, so it is handed back
    unguarded, inf and nan kept, as torch.amp leaves them (CUDA's kernel zeroes them either way);
    ``arrived`` then flags any non-finite value in it (the unscale itself makes one only where
    grad's dtype cannot hold g·factor: never for the float32 gradient of float16 values). Other
    gradients come back with the values that are not finite after scaling set to 0, so that the
    rest of the backward does not see them: the point that made or met them blames them.
    """
    if grad.device.type == "cuda":
        import autoscale.kernels.scale_grad  # noqa: F401  (registers autoscale::scale_grad)

        out, fstats, counts = torch.ops.autoscale.scale_grad(grad, factor, carried)
        flags = (counts > 0).float()
        return out, Measured(fstats[0], flags[0], flags[3], fstats[1], fstats[2], counts[2].float())
    g = grad.float()
    scaled = g * factor.float()
    if leaving:
        out = scaled.to(grad.dtype)
        measured, unit_scale = out.float(), factor.float() * carried.float()  # out at unit scale: out / scale
    else:
        measured, unit_scale = g, carried.float()
    # (Finiteness as |x| < inf: false for inf and nan alike, two ops where isfinite traces to four,
    # and it reuses the |x| the maximum needs. Every traced op costs compile time.)
    magnitude = measured.abs()
    finite = magnitude < math.inf
    if g.numel():
        peak = torch.where(finite, magnitude, 0.0).amax()
        arrived = torch.where(finite, 0.0, 1.0).amax()
    else:
        peak = arrived = torch.zeros((), device=g.device)
    made = None
    if not leaving:
        bound = _overflow_threshold(grad.dtype)
        # a finite value overflows under ``factor`` iff the largest one does
        made = torch.where(peak * factor.float() < bound, 0.0, 1.0)
        # (``peak * 0``: reading the maximum makes the reduction an ancestor of ``out``, which
        # Inductor then writes in place; see above)
        out = torch.where(scaled.abs() < bound, scaled, peak * 0.0).to(grad.dtype)
    unit = torch.where(finite, measured, 0.0) / unit_scale if moments else None
    return out, Measured(
        amax=peak / unit_scale,
        arrived=arrived,
        made=made,
        total=unit.sum() if unit is not None else None,
        squares=(unit * unit).sum() if unit is not None else None,
        zeros=(measured == 0).sum(dtype=torch.int32).float() if zeros else None,
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


def _max_of(scales: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    if not rows:
        return torch.ones((), dtype=scales.dtype, device=scales.device)
    if len(rows) == 1:  # (the usual case: one select, where an index and a reduction trace to four ops)
        return scales[rows[0]]
    return scales[list(rows)].amax()


def point_backward(grad: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: tuple[int, ...],
                   in_rows: tuple[int, ...], record_rows: tuple[int, ...], unscale: bool, moments: bool
                   ) -> torch.Tensor:
    """The backward of ``autoscale.ops.rescale``: the gradient it hands on; ``stats`` gets the
    point's measurements (``record``).

    The gradient arrives carrying the scale of ``in_rows`` and leaves carrying that of
    ``out_rows``. Rows in ``record_rows`` get its largest magnitude (a bias's unscale point
    records none: its weight's point does); an unscale point's rows also get its zeros and
    element count, and with ``moments`` every recorded row gets Σ g, Σ g² and the count.
    Non-finite values are blamed on the scale that produced them: those that arrived non-finite
    were made under ``in_rows``; those this point made, by ``out_rows``. An unscale point's
    output leaves the graph: whatever is non-finite in it is blamed on the layer's scale (on CPU
    it is measured after the unscale; CUDA's kernel reports apart what the unscale made, which
    only a float16 parameter's gradient can hold). So a gradient leaving through an unscale point
    is checked, and ``GradScaler.step`` skips the step.
    """
    carried = _max_of(scales, in_rows)
    factor = _max_of(scales, out_rows) / carried
    out, m = scale_and_measure(grad, factor, carried, leaving=unscale, moments=moments, zeros=unscale)
    values: list[torch.Tensor] = []
    cells: list[int] = []
    modes: list[int] = []

    def put(row: int, column: str, value: torch.Tensor) -> None:
        values.append(value)
        cells.append(row * NUM_STATS + STAT[column])
        modes.append(_COMBINE.get(column, SUM))

    bad = m.arrived if m.made is None else torch.maximum(m.arrived, m.made)  # anything non-finite here
    if unscale:  # (what the unscale made is the layer's too)
        blamed = {row: bad for row in in_rows}
    else:
        assert m.made is not None
        blamed = {row: m.arrived for row in in_rows}
        blamed.update({row: bad if row in blamed else m.made for row in out_rows})
    for row, flag in blamed.items():
        put(row, "nonfinite", flag)
    if blamed:  # (and the step's one overflow flag: ``ANY_NONFINITE``, row 0's amax cell)
        put(0, "amax", bad)
    if record_rows:
        # (numel as a SymInt, not float(): that would specialize a dynamic batch size to its first value)
        elements = (torch.full((), grad.numel(), dtype=torch.float32, device=grad.device)
                    if moments or unscale else None)
        for row in record_rows:
            if row != 0:  # (row 0's amax cell is ``ANY_NONFINITE``)
                put(row, "amax", m.amax)
            if moments:
                assert m.total is not None and m.squares is not None
                put(row, "sum", m.total)
                put(row, "sumsq", m.squares)
                put(row, "count", elements)  # type: ignore[arg-type]
            if unscale:
                assert m.zeros is not None
                put(row, "zeros", m.zeros)
                put(row, "numel", elements)  # type: ignore[arg-type]
    if values:
        stats.copy_(record(stats, values, cells, modes))
    return out


def fold(stats: torch.Tensor, values: Sequence[torch.Tensor], cells: Sequence[int], modes: Sequence[int]
         ) -> torch.Tensor:
    """``stats`` with ``values[j]`` folded into the flat cell ``cells[j]``: by max when
    ``modes[j] == MAX``, by sum when ``SUM``. The meaning of ``record``; every recorded value is
    non-negative where it is combined by max (so a cell nothing reaches keeps its value)."""
    flat = stats.reshape(-1).clone()
    if not values:
        return flat.view_as(stats)
    v = torch.stack([x.reshape(()).to(flat.dtype) for x in values])
    index = torch.tensor(list(cells), device=flat.device)
    summed = torch.tensor([m == SUM for m in modes], device=flat.device)
    flat.scatter_reduce_(0, index[~summed], v[~summed], "amax")
    flat.index_add_(0, index[summed], v[summed])
    return flat.view_as(stats)


@torch.library.custom_op("autoscale::record", mutates_args=())
def record(stats: torch.Tensor, values: list[torch.Tensor], cells: list[int], modes: list[int]) -> torch.Tensor:
    """``fold(stats, values, cells, modes)`` as one op: a point's measurements, which
    ``passes/batch_records.py`` gathers with the graph's other points into one fold."""
    return fold(stats, values, cells, modes)


@record.register_fake
def _(stats: torch.Tensor, values: list[torch.Tensor], cells: list[int], modes: list[int]) -> torch.Tensor:
    return torch.empty_like(stats)
