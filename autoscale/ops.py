"""autoscale's graph ops: every ``autoscale::`` custom op, each with its fake implementation, and the
gradient rescale point.

Each op's eager implementation is its reference: the function of ``autoscale.measure`` it runs is
what the compiled kernels must compute, and what the tests compare them with. The ops:

* ``attach(scales, stats, peaks, layout, ...)``: a marker at the top of a scaled model's forward
  that lifts the scaler's state tensors into Dynamo's graph (``autoscale.protocol``); the backend
  removes it.
* ``attach_quant(bits, ranges, layout, training)``: the same for ``autoscale.FakeQuant``'s state
  (``autoscale/passes/dynamo/insert_fake_quant.py``).
* ``point(grad, scales, stats, ...)``: a measured rescale point's backward as one op, as a compiled
  backward's trace takes it; the joint-stage pass ``autoscale/passes/joint/expand_points.py`` writes it out.
* ``record(stats, values, cells, modes, ...)``: a point's (or a check's) measurements folded into
  their cells (``autoscale.measure.fold``), which ``autoscale/passes/joint/batch_records.py`` gathers
  into one fold per graph.
* ``set_scale(scales, rows)``: the largest scale of a set of rows, as a traced point reads it
  (``autoscale/passes/joint/batch_row_reads.py``).
* ``partials(x, parts)``: a value's elements as ``[parts, -1]`` for a partial reduction, laid out
  by ``autoscale/passes/joint/lay_out_partials.py`` (``Form.lay_out``).
* ``scale_grad(grad, scale, carried)``: the fused Triton point kernel, a ``triton_op`` defined
  beside its kernel (``autoscale.kernels.scale_grad``, imported on first use, so that
  ``import autoscale`` stays triton-free), with its reference in ``autoscale.kernels.reference``.

``rescale(x, scales, stats, out_rows, in_rows, record_rows, unscale, moments, fused, measured, form)``
is the identity in the forward. In the backward it multiplies the arriving gradient by

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
nothing else. ``form`` names the ``autoscale.protocol.Form`` its work is laid out in.

Statistics are normalized by the scale the gradient arrived with, so the update rule sees
magnitudes at unit scale and needs no knowledge of the graph.

``watch(x, peaks, slot, form)`` is the forward's overflow check: it folds ``max |x|`` into one slot
of the scaler's ``peaks`` (``autoscale/passes/dynamo/insert_overflow_checks.py``).

``emulated(op, dtype, *args, **kwargs)`` is a low-precision op computed in float32: what
``Config(compute="emulate")`` turns every low-precision GEMM into (``autoscale/passes/dynamo/emulate_compute.py``).
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
from typing import Any, NamedTuple

import torch

from autoscale.measure import (
    fold,
    in_memory_order,
    largest,
    max_scale,
    measured_point,
    point_backward,
    rescaled,
    traced,
)
from autoscale.protocol import FORMS, MAX

__all__ = ["Attached", "attach", "attach_quant", "emulated", "identity_output", "partials", "point", "record",
           "rescale", "resolve", "set_scale", "trace_decompositions", "watch"]

_LIBRARY = torch.library.Library("autoscale", "FRAGMENT")


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


@torch.library.custom_op("autoscale::attach_quant", mutates_args=("ranges",))
def attach_quant(bits: torch.Tensor, ranges: torch.Tensor, layout: str, training: bool) -> None:
    """Does nothing. ``FakeQuant`` calls it at the top of the model's forward so that Dynamo
    lifts the quantization state into the graph as inputs; ``insert_fake_quant`` reads ``layout``
    (the module of each row) and ``training`` from it and removes it."""


@attach_quant.register_fake
def _(bits: torch.Tensor, ranges: torch.Tensor, layout: str, training: bool) -> None:
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


@torch.library.custom_op("autoscale::record", mutates_args=())
def record(stats: torch.Tensor, values: list[torch.Tensor], cells: list[int], modes: list[int],
           scales: list[torch.Tensor | None], bounds: list[float]) -> torch.Tensor:
    """``fold(stats, values, cells, modes, scales, bounds)`` as one op: a point's (or a check's)
    measurements, which ``autoscale/passes/joint/batch_records.py`` gathers with the graph's other
    records into one fold."""
    return fold(stats, values, cells, modes, scales, bounds)


@record.register_fake
def _(stats: torch.Tensor, values: list[torch.Tensor], cells: list[int], modes: list[int],
      scales: list[torch.Tensor | None], bounds: list[float]) -> torch.Tensor:
    return torch.empty_like(stats)


def _set_scale(scales: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The largest scale of ``rows`` (``max_scale``) in a 0-dim tensor of its own: what a point reads
    when traced (``torch.ops.autoscale.set_scale``), one op per read, so that the joint-stage pass
    ``autoscale/passes/joint/batch_row_reads.py`` finds a graph's reads and computes each distinct set once, as a
    reduction of its own that the points' kernels receive as an argument (why: that module). Left
    ungathered (a joint stage without the pass), each read runs as an op and computes the same.
    Defined through ``torch.library.Library`` rather than ``custom_op``, whose Python wrapper
    doubled the cost of a small call."""
    return max_scale(scales, tuple(rows)).clone()


def _set_scale_fake(scales: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return torch.empty((), dtype=scales.dtype, device=scales.device)


_LIBRARY.define("set_scale(Tensor scales, int[] rows) -> Tensor")
_LIBRARY.impl("set_scale", _set_scale, "CompositeExplicitAutograd")
torch.library.register_fake("autoscale::set_scale", _set_scale_fake, lib=_LIBRARY)

set_scale = torch.ops.autoscale.set_scale.default


def _partials(x: torch.Tensor, parts: int) -> torch.Tensor:
    """``x``'s elements in memory order as ``[parts, -1]``: what a partial reduction reads
    (``autoscale.measure.largest``), as one op. Traced into a compiled graph,
    ``autoscale/passes/joint/lay_out_partials.py`` replaces it by a view of ``x`` in the order Inductor
    will lay ``x`` out in, which it decides after the trace (a GPU's convolutions channels-last, by
    its heuristics): its partial results are then read in memory order, coalesced, and in the
    kernel that writes ``x``. Any order gives the same reduction over
    all of them. (Run as an op, it copies.)"""
    return in_memory_order(x).reshape(parts, -1).clone()


def _partials_fake(x: torch.Tensor, parts: int) -> torch.Tensor:
    return x.new_empty((parts, x.numel() // parts))


_LIBRARY.define("partials(Tensor x, int parts) -> Tensor")
_LIBRARY.impl("partials", _partials, "CompositeExplicitAutograd")
torch.library.register_fake("autoscale::partials", _partials_fake, lib=_LIBRARY)

partials = torch.ops.autoscale.partials.default


def _point(grad: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: list[int], in_rows: list[int],
           record_rows: list[int], unscale: bool, moments: bool, fused: bool, blame: bool, form: str,
           decompositions: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``measured_point`` as one op (``torch.ops.autoscale.point``), ``stats`` as it was where the
    point records nothing: how a compiled backward's trace takes a measured point, whose ops
    the joint-stage pass ``autoscale/passes/joint/expand_points.py`` writes out afterwards (why: that
    module), with the ``decompositions`` the trace applies (``DECOMPOSITIONS``). Left as it is (a
    joint stage without the pass), it runs as an op and computes the same."""
    out, recorded = measured_point(grad, scales, stats, out_rows, in_rows, record_rows, unscale, moments, fused,
                                   blame=blame, form=FORMS[form])
    return out, stats.clone() if recorded is None else recorded


def _point_fake(grad: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: list[int],
                in_rows: list[int], record_rows: list[int], unscale: bool, moments: bool, fused: bool, blame: bool,
                form: str, decompositions: str) -> tuple[torch.Tensor, torch.Tensor]:
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


_LIBRARY.define("point(Tensor grad, Tensor scales, Tensor stats, int[] out_rows, int[] in_rows, int[] record_rows, "
                "bool unscale, bool moments, bool fused, bool blame, str form, str decompositions) -> (Tensor, Tensor)")
_LIBRARY.impl("point", _point, "CompositeExplicitAutograd")
torch.library.register_fake("autoscale::point", _point_fake, lib=_LIBRARY)

point = torch.ops.autoscale.point.default


class _Rescale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor,
                out_rows: tuple[int, ...], in_rows: tuple[int, ...], record_rows: tuple[int, ...],
                unscale: bool, moments: bool, fused: bool, measured: bool, form: str) -> torch.Tensor:
        ctx.save_for_backward(scales)
        ctx.stats = stats  # held, not saved: the backward writes it in place
        ctx.rows = out_rows, in_rows, record_rows, unscale, moments, fused
        ctx.measured, ctx.form = measured, form
        return identity_output(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (scales,) = ctx.saved_tensors
        out_rows, in_rows, _, unscale, _, fused = ctx.rows
        if not ctx.measured and not unscale:
            return rescaled(grad, scales, out_rows, in_rows), *_NO_GRADS
        if traced(grad) and not fused and (decompositions := trace_decompositions()) is not None:
            # (one op in the trace: ``autoscale/passes/joint/expand_points.py``; the fused kernel's launch is
            # a ``triton_op``, which only the trace's functionalization writes out as its kernel)
            out, recorded = point(grad, scales, ctx.stats, *map(list, ctx.rows[:3]), *ctx.rows[3:], ctx.measured,
                                  ctx.form, decompositions)
            ctx.stats.copy_(recorded)
            return out, *_NO_GRADS
        return (point_backward(grad, scales, ctx.stats, *ctx.rows, blame=ctx.measured, form=FORMS[ctx.form]),
                *_NO_GRADS)


_NO_GRADS = (None,) * 10  # for rescale's arguments after x


def rescale(x: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: tuple[int, ...],
            in_rows: tuple[int, ...], record_rows: tuple[int, ...] = (), unscale: bool = False,
            moments: bool = False, fused: bool = False, measured: bool = True, form: str = "default") -> torch.Tensor:
    """Identity forward; backward rescales the gradient and records its statistics (see the module).
    ``fused``: on CUDA, the backward runs the fused Triton kernel (``ScalingConfig.point_kernel="fused"``).
    ``measured=False``: the backward only rescales, or, unscaling, only checks for inf/nan
    (``record_rows`` must then be empty). ``form``: the ``autoscale.protocol.FORMS`` entry its
    backward's work is laid out in."""
    if not measured and record_rows:
        raise ValueError(f"a rescale point that is not measured records nothing: got record_rows={record_rows}")
    out: torch.Tensor = _Rescale.apply(x, scales, stats, out_rows, in_rows, record_rows, unscale, moments, fused,
                                       measured, form)
    return out


def watch(x: torch.Tensor, peaks: torch.Tensor, slot: int, form: str = "default") -> None:
    """Fold ``max |x|`` into ``peaks[slot]``: a forward overflow check, inserted after a float16 value.

    NaN propagates through ``amax`` and the fold's max, so one reduction tells all three things the
    scaler asks: non-finite (inf or nan), near float16's max, and the measured peak. The reduction
    is fused by Inductor into the kernel that produces ``x``; the slot is written through
    ``autoscale.ops.record``, which ``autoscale/passes/joint/batch_records.py`` folds with the graph's other
    checks into one update of ``peaks`` at the end of the forward.

    The maximum is a one-element vector (``autoscale.measure.largest``): Inductor writes it straight
    into its slot of the fold's vector, with no buffer of its own and no copy.

    In float32 from the start (``abs`` and ``max`` are exact in both): Inductor, emulating float16
    casts, rounds each float16 op's result back to float16, and ``abs().amax()`` on the float16
    value cost two conversions more per element in the kernel of every watched value.
    """
    if x.numel() == 0:
        return
    peak = largest(x.detach().float().abs(), FORMS[form])
    peaks.copy_(record(peaks, [peak], [slot], [MAX], [None], [math.inf]))


def identity_output(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the output of an identity ``autograd.Function``'s forward (a rescale point, a
    gradient quantizer): a view of it run eagerly, an ``_unsafe_view`` when traced.

    Traced, a view would be a graph output aliasing an intermediate wherever the point is the
    graph's last op (the scale point on a model's final GEMM), and AOTAutograd regenerates such an
    output at every call, in Python (``aten._unsafe_view`` in its runtime wrapper, with alias
    checks around it), a per-step host cost the size of a small forward's kernels. It is what
    AOTAutograd would return anyway, computed in the graph instead, where Inductor makes it a
    reinterpretation of the buffer. Eagerly, a view keeps the input's version counter, so an
    in-place change of the output that a saved tensor shares is still caught by autograd."""
    return torch.ops.aten._unsafe_view(x, x.shape) if traced(x) else x.view_as(x)


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
