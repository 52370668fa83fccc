"""autoscale's graph ops: the ``autoscale::`` custom ops and the gradient rescale point.

``rescale(x, scales, stats, out_rows, in_rows, record_rows, weight_grad)`` is the identity in
the forward. In the backward it multiplies the arriving gradient by

    factor = max(scales[out_rows]) / max(scales[in_rows])        (an empty set means 1)

— the scales are powers of two, so this is exact unless it overflows — and, when
``record_rows`` is not empty, adds the gradient's statistics to those rows of ``stats``. Every
scale in ``scales`` is an *absolute* target: the total scale a gradient carries after that
layer's scale point (row 0 is the loss scale). A scale point is ``out_rows=(r,)`` with
``in_rows`` the scale the gradient arrives with; aligning branches at a merge is
``out_rows=`` their union; unscaling a parameter's gradient back to the loss scale is
``out_rows=(0,)``.

Statistics are normalized by the scale the gradient arrived with, so the update rule sees
magnitudes at unit scale and needs no knowledge of the graph. ``scale_grad_reference`` is the
one-pass computation in plain torch: the CPU path and the oracle for the fused Triton kernel
used on CUDA.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["COUNTS", "FP16_MAX", "NUM_STATS", "STAT", "attach", "headroom", "rescale", "scale_grad_reference"]

FP16_MAX = 65504.0


def headroom(margin: int) -> float:
    """The largest gradient magnitude a scale may aim for: float16's max, ``2**margin`` below."""
    return FP16_MAX / 2.0**margin

# Columns of the stats tensor (one row per layer).
STAT = {"nonfinite": 0, "amax": 1, "sum": 2, "sumsq": 3, "count": 4, "zeros": 5, "numel": 6}
NUM_STATS = len(STAT)


@torch.library.custom_op("autoscale::attach", mutates_args=("stats",))
def attach(scales: torch.Tensor, stats: torch.Tensor, layout: str) -> None:
    """Does nothing. ``GradScaler`` calls it at the top of the model's forward so that Dynamo lifts
    the state tensors into the graph as inputs; the backend finds it, reads ``layout`` (the layer
    of each row) and removes it."""


@attach.register_fake
def _(scales: torch.Tensor, stats: torch.Tensor, layout: str) -> None:
    return None


@torch.library.custom_op("autoscale::accumulate_stats_", mutates_args=("stats",))
def accumulate_stats_(stats: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """Fold ``values[i]`` (laid out by ``STAT``) into ``stats[rows[i]]``: max for amax, sum otherwise.
    ``rows`` are distinct."""
    index, max_column = _indices(tuple(rows), stats.device)
    stats.index_add_(0, index, values.index_fill(1, max_column, 0.0))
    stats[index, STAT["amax"]] = torch.maximum(stats[index, STAT["amax"]], values[:, STAT["amax"]])


@functools.cache
def _indices(rows: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors for ``accumulate_stats_``, made once per call site and device: building them
    every step would copy host to device (and on CUDA, wait) every step."""
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor([STAT["amax"]], dtype=torch.long, device=device))


@accumulate_stats_.register_fake
def _(stats: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    return None


COUNTS = ("arrived_nonfinite", "elements", "zeros", "made_nonfinite", "underflowed")


def scale_grad_reference(grad: torch.Tensor, factor: torch.Tensor, carried: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One gradient through a rescale point, in plain torch: ``(out, fstats, counts)``.

    ``out`` is ``grad·factor`` in grad's dtype with the values this made non-finite set to 0;
    ``fstats`` = [max |g|/carried, Σ g/carried, Σ (g/carried)²] over grad's finite values;
    ``counts`` (int64) as named by ``COUNTS``: arrived non-finite, elements, zeros in grad, made
    non-finite, and underflowed (finite non-zero values that ``out`` rounds to zero). The CPU path,
    which Inductor fuses with its neighbours, and the oracle of the Triton kernel
    (``autoscale.kernels.scale_grad``).
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


def _scale_grad(grad: torch.Tensor, factor: torch.Tensor, carried: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused Triton op on CUDA (imported on first use: ``import autoscale`` stays triton-free),
    the reference elsewhere."""
    if grad.device.type == "cuda":
        import autoscale.kernels.scale_grad  # noqa: F401  (registers autoscale::scale_grad)

        out, fstats, counts = torch.ops.autoscale.scale_grad(grad, factor, carried)
        return out, fstats, counts
    return scale_grad_reference(grad, factor, carried)


def _max_of(scales: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    if not rows:
        return torch.ones((), dtype=scales.dtype, device=scales.device)
    return scales[list(rows)].amax()


class _Rescale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor,
                out_rows: tuple[int, ...], in_rows: tuple[int, ...], record_rows: tuple[int, ...],
                weight_grad: bool) -> torch.Tensor:
        ctx.save_for_backward(scales)
        ctx.stats = stats  # held, not saved: the backward writes it in place
        ctx.rows = out_rows, in_rows, record_rows, weight_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (scales,) = ctx.saved_tensors
        out_rows, in_rows, record_rows, weight_grad = ctx.rows
        carried = _max_of(scales, in_rows)
        out, fstats, counts = _scale_grad(grad, _max_of(scales, out_rows) / carried, carried)
        # One statistics update per point. Rows in ``record_rows`` get the gradient's statistics.
        # Non-finite values are blamed on the scale that produced them: those that arrived
        # non-finite were made under ``in_rows``; those this point made, by ``out_rows`` (``out``
        # has them zeroed, so the rest of the backward does not blame every layer below; the step
        # is skipped anyway).
        zero = torch.zeros((), device=grad.device)
        elements = counts[1].float()
        recorded = torch.stack([zero, fstats[0], fstats[1], fstats[2], elements,
                                counts[2].float() if weight_grad else zero, elements if weight_grad else zero])
        nonfinite = torch.zeros(NUM_STATS, device=grad.device)
        nonfinite[STAT["nonfinite"]] = 1.0
        if record_rows:  # a point that records nothing blames nothing either (a bias's unscale)
            rows = sorted(set(record_rows) | set(in_rows) | set(out_rows))
            values = [(recorded if row in record_rows else torch.zeros_like(recorded))
                      + nonfinite * ((counts[0] if row in in_rows else zero) + (counts[3] if row in out_rows else zero))
                      for row in rows]
            torch.ops.autoscale.accumulate_stats_(ctx.stats, rows, torch.stack(values))
        return out, None, None, None, None, None, None


def rescale(x: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: tuple[int, ...],
            in_rows: tuple[int, ...], record_rows: tuple[int, ...] = (), weight_grad: bool = False) -> torch.Tensor:
    """Identity forward; backward rescales the gradient and records its statistics (see the module)."""
    out: torch.Tensor = _Rescale.apply(x, scales, stats, out_rows, in_rows, record_rows, weight_grad)
    return out
