"""The adaptive scale update in one Triton launch: ``autoscale.update.adaptive_update``, fused.

Inductor compiles ``adaptive_update`` into seven kernels on a GPU (docs/results/kernel_counts.md):
the update reads its state and then clears it (the statistics, the forward's peaks, the overflow
flag found outside the graphs), and a write after a read of the same buffer, over another range
than the reads', is a kernel of its own. On a launch-bound GPU step, its seven launches and the
compiled graph's wrapper made ``update()`` several times torch.amp's one ``_amp_update_scale_``
(docs/results/overhead_cuda.md, step_profile_cuda.md).

The update's tensors are small (one row per layer, one slot per forward check), so one program
holds all of them: it reads everything, waits at a barrier for every thread to have read, and
writes. ``autoscale.update.adaptive_update`` is the reference and the oracle: the kernel computes
the same, bit for bit, inf and nan included (``tests/kernels/test_update.py``), and
``CompiledUpdate`` checks the first call of every variant against it on the device itself.

Exactness: the rule's power of two is taken from the float's bits (``pow2floor``'s ``log2`` and
``exp2`` are approximations in Triton); its target is computed as torch computes ``headroom / x``,
a correctly rounded reciprocal (``div_rn``) times ``headroom``; and every max and min propagates
nan as torch's do (Triton's ``maximum`` drops a nan operand).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from autoscale.protocol import LOSS_ROW, NUM_STATS, SCALE_RANGE, STAT
from autoscale.update import UpdateTensors

__all__ = ["MAX_ROWS", "MAX_SLOTS", "fused_update"]

MAX_ROWS = 4096
"""The most rows (layers) the one-program kernel takes: its statistics, ``rows × NUM_STATS``
values, are one block (28,672 at this bound). A model with more runs Inductor's update."""
MAX_SLOTS = 16384
"""The most forward-check slots it takes, likewise."""


@triton.jit
def _nan_max(a, b):
    """``torch.maximum``: nan if either is."""
    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))


@triton.jit
def _nan_min(a, b):
    """``torch.minimum``: nan if either is."""
    return tl.where(a != a, a, tl.where(b != b, b, tl.minimum(a, b)))


@triton.jit
def _adaptive_update_kernel(scales_ptr, stats_ptr, last_ptr, overflows_ptr, skips_ptr, found_ptr, skipped_ptr,
                            peaks_ptr, low_ptr, high_ptr, outputs_ptr, snapshot_ptr, bound_ptr,
                            rows, slots, backoff, repeated_backoff, growth, highest, headroom, lowest, tiny,
                            DUE: tl.constexpr, BOUND: tl.constexpr, COLUMNS: tl.constexpr,
                            NONFINITE: tl.constexpr, AMAX: tl.constexpr, LOSS: tl.constexpr,
                            ROWS: tl.constexpr, CELLS: tl.constexpr, SLOTS: tl.constexpr):
    # ---- read everything (the writes below clear some of it) ----
    r = tl.arange(0, ROWS)
    in_r = r < rows
    scales = tl.load(scales_ptr + r, mask=in_r, other=1.0)
    nonfinite = tl.load(stats_ptr + r * COLUMNS + NONFINITE, mask=in_r, other=0.0)
    amax = tl.load(stats_ptr + r * COLUMNS + AMAX, mask=in_r, other=0.0)
    again = tl.load(last_ptr + r * COLUMNS + NONFINITE, mask=in_r, other=0.0) > 0
    overflows = tl.load(overflows_ptr + r, mask=in_r, other=0.0)
    c = tl.arange(0, CELLS)
    in_c = c < rows * COLUMNS
    cells = tl.load(stats_ptr + c, mask=in_c, other=0.0)
    cell_nonfinite = tl.load(stats_ptr + (c // COLUMNS) * COLUMNS + NONFINITE, mask=in_c, other=0.0)
    p = tl.arange(0, SLOTS)
    in_p = p < slots
    peaks = tl.load(peaks_ptr + p, mask=in_p, other=0.0)
    low = tl.load(low_ptr + p, mask=in_p, other=float("inf"))
    high = tl.load(high_ptr + p, mask=in_p, other=float("inf"))
    outputs = tl.load(outputs_ptr + p, mask=in_p, other=0) != 0
    found = tl.load(found_ptr)
    skips = tl.load(skips_ptr)
    if BOUND:
        bound = tl.load(bound_ptr + r, mask=in_r, other=1.0)

    # ---- the decision (``adaptive_update``, line for line) ----
    # overflow = maximum(found_inf, amax(nonfinite)) > 0, where a nan anywhere makes it false
    nan_flag = tl.max(tl.where(in_r & (nonfinite != nonfinite), 1, 0), axis=0) > 0
    largest = tl.max(tl.where(in_r, nonfinite, 0.0), axis=0)
    overflow = ((found > 0) | (largest > 0)) & (found == found) & (nan_flag == 0)
    forward_nonfinite = tl.max(tl.where(in_p & ~(peaks < float("inf")) & outputs, 1, 0), axis=0) > 0
    look = tl.max(tl.where(in_p & ~(peaks <= low) & ~(peaks > high), 1, 0), axis=0) > 0
    flagged = (nonfinite > 0) & (forward_nonfinite == 0)
    new = tl.where(flagged, scales * tl.where(again, repeated_backoff, backoff), scales)
    if DUE:
        # (``headroom / x`` in torch is ``x.reciprocal() * headroom``: two roundings, each exact here)
        target = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), _nan_max(amax, tiny)) * headroom
        if BOUND:
            target = _nan_max(_nan_min(target, bound), 1.0)
        # pow2floor, exactly: the exponent's bits (positive normal floats; inf stays inf, nan nan)
        power = (target.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        power = tl.where(target != target, target, power)
        rule = _nan_min(power, scales * growth)
        new = tl.where((amax > 0) & (overflow == 0), rule, new)
        cleared = c >= 0  # (every cell: a due update clears them all)
    else:
        cleared = (cell_nonfinite > 0) & (forward_nonfinite == 0)
    clamped = tl.where(new != new, new, tl.minimum(tl.maximum(new, lowest), highest))
    new_scales = tl.where(r == LOSS, scales, clamped)  # (the loss row keeps its scale)

    # ---- write, once every thread has read ----
    tl.debug_barrier()
    tl.store(scales_ptr + r, new_scales, mask=in_r)
    tl.store(overflows_ptr + r, overflows + tl.where(flagged, 1.0, 0.0), mask=in_r)
    if DUE:
        tl.store(last_ptr + c, cells + 0.0, mask=in_c)
    tl.store(stats_ptr + c, tl.where(cleared, 0.0, cells), mask=in_c)
    tl.store(skips_ptr, skips + tl.where(overflow, 1.0, 0.0))
    tl.store(found_ptr, 0.0)
    tl.store(skipped_ptr, overflow)
    tl.store(snapshot_ptr + p, peaks, mask=in_p)
    tl.store(snapshot_ptr + slots, tl.where(look, 1.0, 0.0))
    tl.store(snapshot_ptr + slots + 1, tl.where(overflow, 1.0, 0.0))
    tl.store(peaks_ptr + p, tl.zeros([SLOTS], tl.float32), mask=in_p)


def fused_update(tensors: tuple[torch.Tensor | None, ...], *, due: bool, backoff: float, repeated_backoff: float,
                 growth: float, high: float, headroom: float) -> Callable[..., None] | None:
    """``adaptive_update`` of ``tensors`` (its arguments: the ``UpdateTensors`` fields, then the bound
    or None) and these constants, as one launch: a function of the non-None tensors in order, which
    ``autoscale.update.CompiledUpdate`` calls in place of Inductor's code. None for a state the kernel
    does not take: more than ``MAX_ROWS`` rows or ``MAX_SLOTS`` slots, tensors not laid out as
    the scaler makes them (contiguous, float32 but for the bool flags), or on a device the kernel
    does not run on (``_runs_on``)."""
    t, bound = UpdateTensors(*tensors[:-1]), tensors[-1]  # type: ignore[arg-type]
    rows, slots = len(t.scales), len(t.peaks)
    if rows > MAX_ROWS or slots > MAX_SLOTS or not _as_made(t, bound) or not _runs_on(t.scales.device):
        return None
    constants = {"backoff": backoff, "repeated_backoff": repeated_backoff, "growth": growth, "highest": high,
                 "headroom": headroom, "lowest": SCALE_RANGE[0], "tiny": torch.finfo(torch.float32).tiny}
    shape = {"DUE": due, "BOUND": bound is not None, "COLUMNS": NUM_STATS, "NONFINITE": STAT["nonfinite"],
             "AMAX": STAT["amax"], "LOSS": LOSS_ROW, "ROWS": triton.next_power_of_2(rows),
             "CELLS": triton.next_power_of_2(rows * NUM_STATS), "SLOTS": triton.next_power_of_2(max(slots, 1))}

    warps = min(16, max(4, shape["CELLS"] // 2048))  # (at most 64 statistics a thread for the largest blocks)

    def launch(*present: torch.Tensor) -> None:
        args = present if bound is not None else (*present, present[0])  # (a bound unread: any pointer)
        _adaptive_update_kernel[(1,)](*args, rows, slots, **constants, **shape, num_warps=warps)

    return launch


def _runs_on(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``'s tensors: compiled (a ``JITFunction``), on a CUDA device's
    only; interpreted (``TRITON_INTERPRET=1``, the tests on a CPU), on any."""
    return device.type == "cuda" or not isinstance(_adaptive_update_kernel, JITFunction)


def _as_made(t: UpdateTensors, bound: torch.Tensor | None) -> bool:
    """Whether the state is laid out as ``GradScaler`` makes it, which the kernel's indexing assumes."""
    flags = ("last_skipped", "outputs")
    for name, x in (*zip(UpdateTensors._fields, t, strict=True), ("bound", bound)):
        if x is None:
            continue
        if not x.is_contiguous() or x.dtype != (torch.bool if name in flags else torch.float32):
            return False
    return (t.stats.shape == t.last_stats.shape == (len(t.scales), NUM_STATS)
            and t.snapshot.numel() == len(t.peaks) + 2
            and t.found_inf.numel() == t.skips.numel() == t.last_skipped.numel() == 1
            and len(t.alarm_low) == len(t.alarm_high) == len(t.outputs) == len(t.peaks)
            and (bound is None or bound.shape == t.scales.shape))
