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
magnitudes at unit scale and needs no knowledge of the graph. The pure-torch formulas here are
both the CPU path and the oracle for the fused kernels.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FP16_MAX", "NUM_STATS", "STAT", "attach", "gradient_stats", "headroom", "rescale"]

FP16_MAX = 65504.0


def headroom(margin: int) -> float:
    """The largest gradient magnitude a scale may aim for: float16's max, ``2**margin`` below."""
    return FP16_MAX / 2.0**margin

# Columns of the stats tensor (one row per layer).
STAT = {"nonfinite": 0, "amax": 1, "sum": 2, "sumsq": 3, "count": 4, "zeros": 5, "numel": 6}
NUM_STATS = len(STAT)
_MAX_COLUMNS = [STAT["amax"]]


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
    """Fold one gradient's statistics ``values`` into ``stats[rows]``: max for amax, sum otherwise."""
    for row in rows:
        merged = stats[row] + values
        merged[_MAX_COLUMNS] = torch.maximum(stats[row, _MAX_COLUMNS], values[_MAX_COLUMNS])
        stats[row] = merged


@accumulate_stats_.register_fake
def _(stats: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    return None


def gradient_stats(grad: torch.Tensor, carried: torch.Tensor, *, weight_grad: bool) -> torch.Tensor:
    """The statistics of one gradient's finite values, as a float32 vector laid out by ``STAT``.

    ``carried`` is the scale the gradient carries; magnitudes are divided by it. ``zeros`` and
    ``numel`` are counted for weight gradients only (the layer's underflow measure).
    """
    g = grad.detach().float()
    finite = torch.isfinite(g)
    safe = torch.where(finite, g, torch.zeros((), dtype=g.dtype, device=g.device)) / carried
    n = torch.tensor(float(g.numel()), device=g.device)
    zero = torch.zeros((), device=g.device)
    return torch.stack([
        zero,  # non-finite values are counted where they are blamed (see _Rescale.backward)
        safe.abs().amax() if g.numel() else zero,
        safe.sum(),
        (safe * safe).sum(),
        n,
        (g == 0).sum().float() if weight_grad else zero,
        n if weight_grad else zero,
    ])


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
        factor = _max_of(scales, out_rows) / carried
        out = (grad.float() * factor).to(grad.dtype)
        if record_rows:
            torch.ops.autoscale.accumulate_stats_(ctx.stats, list(record_rows),
                                                  gradient_stats(grad, carried, weight_grad=weight_grad))
        # Blame the scale that produced a non-finite value: one that arrived non-finite was made
        # under ``in_rows``; one this point made non-finite, by ``out_rows``. Then zero it, so that
        # the rest of the backward does not blame every layer below (the step is skipped anyway).
        arrived = torch.isfinite(grad)
        made = torch.isfinite(out)
        _blame(ctx.stats, in_rows, (~arrived).sum())
        _blame(ctx.stats, out_rows, (arrived & ~made).sum())
        out = torch.where(made, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out, None, None, None, None, None, None


def _blame(stats: torch.Tensor, rows: tuple[int, ...], count: torch.Tensor) -> None:
    if rows:
        values = torch.zeros(NUM_STATS, device=stats.device)
        values[STAT["nonfinite"]] = count.float()
        torch.ops.autoscale.accumulate_stats_(stats, list(rows), values)


def rescale(x: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor, out_rows: tuple[int, ...],
            in_rows: tuple[int, ...], record_rows: tuple[int, ...] = (), weight_grad: bool = False) -> torch.Tensor:
    """Identity forward; backward rescales the gradient and records its statistics (see the module)."""
    out: torch.Tensor = _Rescale.apply(x, scales, stats, out_rows, in_rows, record_rows, weight_grad)
    return out
