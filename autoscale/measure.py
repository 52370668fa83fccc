"""What a rescale point computes in the backward: the scaled gradient, and what it measured.

A point computes its scaled output and *one number* that says all a step needs of it
(``Measured.value``: the largest magnitude at unit scale, or a mark for a non-finite value that
arrived or that the scaling made), and hands it to the ``autoscale::record`` op with the cells of
the statistics tensor it goes to and what each cell takes of it (``MODES``; the layout:
``autoscale.protocol``). The point hands the number over half read: its gradient's largest
magnitude at unit scale, with the scale and bound that say whether its output overflowed
(``Measured``); the fold reads it (``reading``), for all of a graph's points at once.

Why one number: compiled, every recorded scalar is a buffer of its own, which the backward's
wrapper allocates or aliases in Python at every step, and whose ``omp single`` block in the point's
kernel ends with a barrier; the flags are derived from the number in the fold instead, over all
points at once, where they cost one vector op each. Why one op per record: written as tensor ops,
each point's update of the statistics was a chain through one tensor that Inductor rewrote in full
at every point, the bulk of a compiled backward (docs/results/compile_time.md); as one functional
op per point, the joint-stage pass ``autoscale/passes/joint/batch_records.py`` folds a whole graph's
records at once, into one small gather at the end of the backward. Run eagerly, ``record`` folds
one point's values itself (``fold``).

``scale_and_measure`` computes the point's output and measurements: plain torch that Inductor
fuses into the kernel next to it, or, on CUDA with ``ScalingConfig.point_kernel="fused"``, the
fused Triton kernel. ``autoscale.kernels.reference.scale_grad_reference`` is the oracle of both.
The ``autoscale::`` ops these functions implement are defined in ``autoscale.ops``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from autoscale.protocol import ARRIVED, BAD, LOSS_ROW, MADE, MAX, NUM_STATS, PART_SIZE, PEAK, ROW_SIZE, STAT, SUM, Form

__all__ = ["MODES", "Measured", "counted", "fold", "in_memory_order", "is_dense", "largest", "max_scale",
           "measured_point", "memory_order", "point_backward", "reading", "rescaled", "scale_and_measure", "taken",
           "traced", "whole"]

aten = torch.ops.aten

Call = Callable[..., Any]
"""How a mode's reading is computed: ``call(aten_op, *args, **kwargs)`` runs the op (``fold``) or
adds it to a graph (``autoscale/passes/joint/batch_records.py``), so that both read a value from one definition."""


def _partial(x: torch.Tensor, form: Form) -> torch.Tensor | None:
    """``x``'s elements in memory order as ``[parts, -1]``, for a reduction over all of them to hand
    on as partial results (``_parts``). None where that would be one part, and for a value whose
    size or layout is symbolic, or whose elements are not dense in memory (its partial results
    would read it through a copy; whole, ``autoscale/passes/joint/reduce_at_source.py`` has it read its source).
    A value laid out in another order (a channels-last gradient) is read in its own, which no
    reduction over all of it depends on. Traced, the order is the one Inductor will lay the value
    out in, which it decides after the trace: ``partials`` marks the reshape for
    ``autoscale/passes/joint/lay_out_partials.py`` (``Form.lay_out``)."""
    n = x.numel()
    if form.parts <= 1 or not isinstance(n, int) or any(not isinstance(d, int) for d in (*x.shape, *x.stride())):
        return None
    parts = _parts(x, form)
    if parts <= 1 or not is_dense(x):
        return None
    if form.lay_out and traced(x):  # (a marker the joint stage lays out as Inductor will lay the value out)
        return torch.ops.autoscale.partials.default(x, parts)
    return in_memory_order(x).reshape(parts, -1)


def _parts(x: torch.Tensor, form: Form) -> int:
    """How many partial results a reduction over ``x`` hands on in ``form``: a value of no more
    elements than ``form.parts``, one part each (no reduction at all: a bias's gradient, whose
    reduction, over the output of the batch's, was a kernel of its own); else one per row of the
    value, where it has at most ``form.rows`` of them (``Form.rows``); else ``form.parts``, halved
    until each part has at least ``PART_SIZE`` elements and they divide ``x``."""
    n = x.numel()
    if n <= form.parts:
        return n
    sizes = [x.shape[d] for d in memory_order(x) if x.shape[d] > 1]  # (a size-1 dimension's stride is any)
    row = sizes[-1] if sizes else 1
    if row >= ROW_SIZE and 1 < n // row <= form.rows:
        return n // row
    parts = form.parts
    while parts > 1 and (n % parts or n // parts < PART_SIZE):
        parts //= 2
    return parts


def memory_order(x: torch.Tensor) -> list[int]:
    """``x``'s dimensions in the order of its strides, the largest first."""
    return sorted(range(x.dim()), key=lambda d: -x.stride()[d])


def in_memory_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` permuted so that its dimensions run in the order of its strides, the largest first."""
    return x.permute(memory_order(x)) if x.dim() else x


def is_dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill its memory, in some order of its dimensions (permuted to
    ``memory_order``, it is contiguous), read from its sizes and strides: traced, no op."""
    expected = 1
    for d in reversed(memory_order(x)):
        if x.shape[d] != 1 and x.stride()[d] != expected:
            return False
        expected *= x.shape[d]
    return True


def whole(value: torch.Tensor, combine: str) -> torch.Tensor:
    """A value handed as partial results (``largest``, ``counted``) reduced to one, by ``combine``
    ("max" or "sum", its cells' way: ``MODES``); a value of one element as it is."""
    if value.numel() <= 1:
        return value
    return value.amax() if combine == "max" else value.sum()


def reading(call: Call, peak: Any, scale: Any, bound: Any) -> Any:
    """A point's value from what it measured (``Measured``): its ``peak`` at unit scale, or -1 where
    the peak is finite and ``peak · scale``, its peak at the scale of the point's output, is not
    below ``bound`` (the output overflowed, in float32 too: ``bound`` is then inf). Exact, the
    scales being powers of two: ``peak · scale`` is the largest magnitude the point wrote. Computed
    in the fold, for all of a graph's points at once, rather than as six 0-dim ops at each point,
    which every compile stage would pay for (docs/results/compile_time_models.md)."""
    fits = call(aten.bitwise_or.Tensor, call(aten.lt.Tensor, call(aten.mul.Tensor, peak, scale), bound),
                call(aten.logical_not.default, call(aten.lt.Scalar, peak, math.inf)))
    return call(aten.where.ScalarOther, fits, peak, -1.0)


def _peak_ok(call: Call, v: Any) -> Any:
    """Where ``v`` is a magnitude: 0 <= v < inf."""
    return call(aten.logical_and.default, call(aten.ge.Scalar, v, 0.0), call(aten.lt.Scalar, v, math.inf))


def _flag(call: Call, where: Any) -> Any:
    """1.0 where ``where`` holds, else 0.0."""
    return call(torch.ops.prims.convert_element_type.default, where, torch.float32)


MODES: dict[int, tuple[str, Callable[[Call, Any], Any]]] = {
    MAX: ("max", lambda call, v: v),
    SUM: ("sum", lambda call, v: v),
    PEAK: ("max", lambda call, v: call(aten.where.ScalarOther, _peak_ok(call, v), v, 0.0)),
    ARRIVED: ("max", lambda call, v: _flag(call, call(aten.logical_not.default, call(aten.lt.Scalar, v, math.inf)))),
    MADE: ("max", lambda call, v: _flag(call, call(aten.lt.Scalar, v, 0.0))),
    BAD: ("max", lambda call, v: _flag(call, call(aten.logical_not.default, _peak_ok(call, v)))),
}
"""Per mode: how its cell combines values ("max" or "sum"), and what it takes of a value."""


def _eager(op: Any, *args: Any, **kwargs: Any) -> Any:
    """A ``Call`` that runs the op."""
    return op(*args, **kwargs)


def taken(mode: int, values: torch.Tensor) -> torch.Tensor:
    """What cells of ``mode`` take of ``values`` (``MODES``), computed eagerly."""
    out: torch.Tensor = MODES[mode][1](_eager, values)
    return out


class Measured(NamedTuple):
    """What a rescale point measures of the gradient it rescales: float32 tensors of one element.

    ``peak``: the gradient's largest magnitude at unit scale, nan or inf when a value is not
    finite (a one-element vector on the CPU path: ``largest``). Where the point's output could
    overflow, ``scale`` is the scale it leaves with and ``bound`` the magnitude at which its dtype
    overflows (``_overflow_threshold``): then it did iff ``peak · scale ≥ bound``. ``value`` reads
    them as the point's one number (``reading``); the fold does so for all points at once.

    ``value``: the largest magnitude at unit scale; +inf or nan when a value arrived non-finite
    (which the point blames on the scale the gradient arrived with); -1 when the rescale made a
    finite value non-finite (blamed on the point's own scale). For a gradient ``leaving`` the
    graph, a non-finite value in the output, whatever made it, is +inf. A step with either is
    skipped, so its largest magnitude is not needed. And, when asked for, Σ g and Σ g² at unit
    scale (``total``, ``squares``) and the count of exact zeros (``zeros``)."""

    peak: torch.Tensor
    scale: torch.Tensor | None = None
    bound: float = math.inf
    total: torch.Tensor | None = None
    squares: torch.Tensor | None = None
    zeros: torch.Tensor | None = None

    @property
    def value(self) -> torch.Tensor:
        """The point's one number (``reading``), computed eagerly."""
        one = torch.ones((), device=self.peak.device)
        out: torch.Tensor = reading(_eager, whole(self.peak, "max"), one if self.scale is None else self.scale,
                                    torch.full_like(one, self.bound))
        return out

    @staticmethod
    def from_stats(stats: torch.Tensor, *, leaving: bool) -> Measured:
        """From the fused op's statistics (float64, laid out as ``autoscale.kernels.reference.STATS``):
        a value already read (no ``scale``, no ``bound``)."""
        amax, total, squares, arrived, _, zeros, made, _ = stats.float().unbind()
        made_mark = math.inf if leaving else -1.0
        value = torch.where(arrived > 0, math.inf, torch.where(made > 0, made_mark, amax))
        return Measured(value, total=total, squares=squares, zeros=zeros)


def scale_and_measure(grad: torch.Tensor, scale: torch.Tensor, carried: torch.Tensor, form: Form, *,
                      leaving: bool = False, moments: bool = False, zeros: bool = False, fused: bool = False
                      ) -> tuple[torch.Tensor, Measured]:
    """The point's output, ``grad·factor`` in grad's dtype with ``factor = scale / carried`` (the
    scale the gradient leaves with over the one it arrived with), and its ``Measured``.

    By default, plain torch that Inductor fuses into the kernel of the backward op next to it,
    computing only what is asked for: one reduction, ``max |g|``, which carries inf and nan
    through, and from which the fold reads the value. On CUDA with ``fused``, the fused Triton kernel
    (imported on first use: ``import autoscale`` stays triton-free): one pass, but a launch of its
    own and one that zeroes its statistics, which a launch-bound step pays for
    (docs/results/overhead_cuda.md).

    Written so that Inductor computes ``out`` in place, over the gradient's own buffer: Inductor
    does so only when the node writing ``out`` is the last to read that buffer. On CPU, writing a
    cold buffer instead cost more than the rest of the point (docs/results/overhead.md, "What the
    step took"). So either ``out`` reads the
    largest magnitude, which makes the reduction its ancestor (a second, cache-warm pass), or, for
    a gradient ``leaving`` the graph (a parameter's, unscaled), the statistics are measured on
    ``out`` itself in one pass. Nothing below a leaving gradient reads it, so it is handed back
    unguarded, inf and nan kept, as torch.amp leaves them (CUDA's kernel zeroes them either way);
    its value then marks any non-finite value in it (the unscale itself makes one only where
    grad's dtype cannot hold g·factor: never for the float32 gradient of float16 values). Other
    gradients come back with the values that are not finite after scaling set to 0, so that the
    rest of the backward does not see them: the point that made or met them blames them.
    """
    if fused and grad.device.type == "cuda":
        import autoscale.kernels.scale_grad  # noqa: F401  (registers autoscale::scale_grad)

        out, stats = torch.ops.autoscale.scale_grad(grad, scale, carried)
        return out, Measured.from_stats(stats, leaving=leaving)
    factor = scale / carried
    g = grad.float()
    scaled = g * factor.float()
    if leaving:
        out = scaled.to(grad.dtype)
        measured, unit_scale = out.float(), scale.float()  # out at unit scale: out / scale
    else:
        measured, unit_scale = g, carried.float()
    magnitude = measured.abs()
    # (amax carries them through: a nan anywhere makes the peak nan, an inf makes it inf). At unit
    # scale in the reduction itself, exactly (the scales are powers of two), so that the reduction
    # is the value the fold reads: Inductor writes it into its slot of the fold's vector
    # (``largest``). Divided after the reduction, the quotient was another 0-dim value, copied into
    # the vector; left to the fold, the raw peak was, by whichever kernel Inductor chose.
    peak = largest(magnitude * unit_scale.reciprocal(), form)
    bound = math.inf
    if not leaving:
        # a finite value overflows under ``factor`` iff the largest one does: the fold reads that
        # from the peak (``reading``), in float32 too
        bound = _overflow_threshold(grad.dtype)
        keep: torch.Tensor | float = 0.0
        if form.in_place:
            # (``keep``, always 0: reading the peak makes the reduction an ancestor of ``out``,
            # which Inductor then writes in place; see above and ``Form.in_place``)
            keep = torch.where(peak < 0.0, peak, 0.0).reshape(())
        out = torch.where(scaled.abs() < bound, scaled, keep).to(grad.dtype)
    at_unit = torch.where(magnitude < math.inf, measured, 0.0) / unit_scale if moments else None
    return out, Measured(
        peak, None if leaving else scale.float(), bound,
        total=at_unit.sum() if at_unit is not None else None,
        squares=(at_unit * at_unit).sum() if at_unit is not None else None,
        zeros=counted(measured == 0, form) if zeros else None,
    )


def largest(x: torch.Tensor, form: Form) -> torch.Tensor:
    """``max x`` over every element as a one-element vector (0 for an empty ``x``): how a point or a
    check hands its peak to the fold. Shaped like one piece of the fold's vector, the reduction is
    that piece: Inductor writes it straight into its slot of the vector. A 0-dim peak reached the
    vector through a view, which Inductor copies into a concatenation: a 0-dim buffer and a copy
    per value (in the quick MLP's forward, a serial block with a barrier per check in the fold's
    kernel) and, in the backward, reductions left in kernels of their own (docs/scaling.md). On a
    GPU, partial maxima instead, which the fold reduces (``Form.parts``)."""
    if not x.numel():
        return x.new_zeros(1)
    if x.dim() == 0:
        return x.reshape(1)
    if (parts := _partial(x, form)) is not None:  # (partial maxima, which the fold reduces: ``Form.parts``)
        return parts.amax(1)
    # (over a leading unit dimension, not a flattened view: the reduction then indexes ``x`` as
    # the op writing ``x`` does, and Inductor fuses the two as for a 0-dim max)
    return x.unsqueeze(0).amax(list(range(1, x.dim() + 1)))


def counted(where: torch.Tensor, form: Form) -> torch.Tensor:
    """How many elements of ``where`` hold, in float32 (exact below 2^24): one count, or partial
    counts that the fold sums (``Form.parts``)."""
    if (parts := _partial(where, form)) is not None:
        return parts.sum(1, dtype=torch.int32).float()
    return where.sum(dtype=torch.int32).float()


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


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is being traced into a compiled graph rather than computed: ``torch.compile``
    is tracing, or ``t`` is a fake tensor (also under functionalization). The second is what says
    so in AOTAutograd's trace of a backward on torch 2.11, where ``torch.compiler.is_compiling()``
    is False (torch 2.13 sets it there too): without it, on 2.11 every point read its scales with
    eager ops, which the joint-stage passes (``batch_records``, ``batch_row_reads``) do not
    recognize, so they left every backward's measurements point by point. (A plain tensor is real:
    ``is_fake`` costs a microsecond, at every point of every eager step.)"""
    return torch.compiler.is_compiling() or (type(t) is not torch.Tensor and is_fake(t))


def _scale_of(scales: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """The largest scale of ``rows`` (``max_scale``): traced for a compiled graph, ``set_scale`` of the
    rows in order, each once (so that equal sets are one read; see ``autoscale.ops.set_scale``); run eagerly
    (``autoscale.convert``), ``max_scale``'s selects, free where a copy would be paid at every point.
    A set of no row but the loss row's is 1, a constant, not a read: as one buffer, it was an
    argument of every unscale point's kernel, which Inductor's fusion search paired, one by one,
    as nodes reading one buffer (``max_scale``)."""
    if traced(scales) and any(row != LOSS_ROW for row in rows):
        return torch.ops.autoscale.set_scale.default(scales, sorted(set(rows)))
    return max_scale(scales, rows)


def max_scale(scales: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """The largest of the scales of ``rows`` (1 for none); the loss row's, 1 (``LOSS_ROW``), is not
    read: where it is one of them, the others' largest is clamped at 1. (Read, it would be a kernel
    argument of every point next to the loss or the residual stream, which Inductor's fusion search
    groups and pairs, one by one, as nodes reading one buffer.)"""
    read_rows = [row for row in rows if row != LOSS_ROW]
    if not read_rows:
        return torch.ones((), dtype=scales.dtype, device=scales.device)
    largest = functools.reduce(torch.maximum, (scales[row] for row in read_rows))
    return largest.clamp_min(1.0) if len(read_rows) < len(rows) else largest


def point_backward(grad: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: tuple[int, ...],
                   in_rows: tuple[int, ...], record_rows: tuple[int, ...], unscale: bool, moments: bool,
                   fused: bool = False, *, blame: bool = True, form: Form) -> torch.Tensor:
    """The backward of ``autoscale.ops.rescale``: the gradient it hands on; ``stats`` gets the
    point's measurements (``measured_point``, written in place)."""
    out, recorded = measured_point(grad, scales, stats, out_rows, in_rows, record_rows, unscale, moments, fused,
                                   blame=blame, form=form)
    if recorded is not None:
        stats.copy_(recorded)
    return out


def measured_point(grad: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: Sequence[int],
                   in_rows: Sequence[int], record_rows: Sequence[int], unscale: bool, moments: bool,
                   fused: bool = False, *, blame: bool = True, form: Form) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``point_backward`` as a function: the gradient it hands on, and ``stats`` with the point's
    measurements recorded (``record``), or None where it records nothing.

    The gradient arrives carrying the scale of ``in_rows`` and leaves carrying that of
    ``out_rows``. Rows in ``record_rows`` get its largest magnitude (a bias's unscale point
    records none: its weight's point does); an unscale point's rows also get its zeros and
    element count, and with ``moments`` every recorded row gets Σ g, Σ g² and the count.
    Non-finite values are blamed on the scale that produced them: those that arrived non-finite
    were made under ``in_rows``; those this point made, by ``out_rows``. An unscale point's
    output leaves the graph: whatever is non-finite in it is blamed on the layer's scale (on CPU
    it is measured after the unscale; CUDA's kernel reports apart what the unscale made, which
    only a float16 parameter's gradient can hold). So a gradient leaving through an unscale point
    is checked, and ``GradScaler.step`` skips the step. All of it is read from the point's one
    value (``MODES``). Without ``blame`` (an unscale point of a step that measures nothing:
    ``ScalingConfig.measure_every``), a non-finite value is blamed on the loss row, whose scale no
    update moves: the step is skipped and no layer backs off. Such a step cannot tell which scale
    made it (a value the unmeasured points let through reaches the gradients of the layers after
    the one that made it), so the scaler measures the next one.
    """
    out, m = scale_and_measure(grad, _scale_of(scales, out_rows), _scale_of(scales, in_rows), form, leaving=unscale,
                               moments=moments, zeros=unscale, fused=fused)
    values: list[torch.Tensor] = []
    cells: list[int] = []
    modes: list[int] = []
    out_scales: list[torch.Tensor | None] = []
    bounds: list[float] = []

    def put(row: int, column: str, value: torch.Tensor, mode: int) -> None:
        read = value is m.peak  # (the point's one number: read from its peak, in the fold)
        values.append(value)
        cells.append(row * NUM_STATS + STAT[column])
        modes.append(mode)
        out_scales.append(m.scale if read else None)
        bounds.append(m.bound if read else math.inf)

    # (an unscale point's rows are its in_rows only: what the unscale made, its value marks as arrived)
    # (unblamed, a non-finite value is the loss row's: the update counts the skip and keeps the scale)
    blamed = dict.fromkeys(in_rows if blame else (LOSS_ROW,), ARRIVED)
    if not unscale and blame:
        blamed.update({row: BAD if row in blamed else MADE for row in out_rows})
    for row, mode in blamed.items():
        put(row, "nonfinite", m.peak, mode)
    if blamed:  # (and the step's one overflow flag: ``ANY_NONFINITE``, row 0's amax cell)
        put(0, "amax", m.peak, BAD)
    if record_rows:
        # (numel as a SymInt, not float(): that would specialize a dynamic batch size to its first value)
        elements = (torch.full((), grad.numel(), dtype=torch.float32, device=grad.device)
                    if moments or unscale else None)
        for row in record_rows:
            if row != 0:  # (row 0's amax cell is ``ANY_NONFINITE``)
                put(row, "amax", m.peak, PEAK)
            if moments:
                assert m.total is not None and m.squares is not None
                put(row, "sum", m.total, SUM)
                put(row, "sumsq", m.squares, SUM)
                put(row, "count", elements, SUM)  # type: ignore[arg-type]
            if unscale:
                assert m.zeros is not None
                put(row, "zeros", m.zeros, SUM)
                put(row, "numel", elements, SUM)  # type: ignore[arg-type]
    return out, torch.ops.autoscale.record.default(stats, values, cells, modes, out_scales, bounds) if values else None


def rescaled(grad: torch.Tensor, scales: torch.Tensor, out_rows: tuple[int, ...], in_rows: tuple[int, ...]
             ) -> torch.Tensor:
    """The backward of a rescale point that is not measured: ``grad`` carrying the scale of
    ``in_rows`` made to carry that of ``out_rows``, and nothing else (``point_backward`` without the
    measurement). In float32 at least, a multiply Inductor fuses into the kernel next to it; exact,
    the scales being powers of two."""
    factor = _scale_of(scales, out_rows) / _scale_of(scales, in_rows)
    wide = torch.promote_types(grad.dtype, torch.float32)
    return (grad.to(wide) * factor.to(wide)).to(grad.dtype)


def fold(stats: torch.Tensor, values: Sequence[torch.Tensor], cells: Sequence[int], modes: Sequence[int],
         scales: Sequence[torch.Tensor | None] | None = None, bounds: Sequence[float] | None = None) -> torch.Tensor:
    """``stats`` with what ``modes[j]`` takes of value j folded into the flat cell ``cells[j]``, by
    the mode's combine (``MODES``). Value j is ``values[j]`` as ``reading`` reads it with
    ``scales[j]`` and ``bounds[j]`` (a None scale: 1; no bounds: inf, which reads a value as it
    is). The meaning of ``record``; everything a mode combines by max is non-negative (so a cell
    nothing reaches keeps its value)."""
    flat = stats.reshape(-1).clone()
    if not values:
        return flat.view_as(stats)
    one = torch.ones((), dtype=flat.dtype, device=flat.device)
    values = [whole(v, MODES[m][0]) for v, m in zip(values, modes, strict=True)]

    def stacked(xs: Sequence[torch.Tensor | None]) -> torch.Tensor:
        return torch.stack([(one if x is None else x.reshape(()).to(flat.dtype)) for x in xs])

    limits = torch.tensor(list(bounds or [math.inf] * len(values)), dtype=flat.dtype, device=flat.device)
    v = reading(_eager, stacked(values), stacked(scales or [None] * len(values)), limits)
    index = torch.tensor(list(cells), device=flat.device)
    for mode in sorted(set(modes)):
        chosen = torch.tensor([m == mode for m in modes], device=flat.device)
        if MODES[mode][0] == "sum":
            flat.index_add_(0, index[chosen], taken(mode, v[chosen]))
        else:
            flat.scatter_reduce_(0, index[chosen], taken(mode, v[chosen]), "amax")
    return flat.view_as(stats)
