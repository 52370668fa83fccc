"""The fused scale kernel: one read of a gradient, the rescaled low-precision copy, its statistics.

For a gradient ``g`` that arrived carrying the scale ``carried`` and leaves carrying ``scale``
(``factor`` = scale/carried: powers of two, so exact), one pass computes

    out = g·factor in g's dtype, with values it made non-finite set to 0
    fstats = [max |g|/carried, Σ g/carried, Σ (g/carried)²]        over g's finite values
    counts = [arrived non-finite, elements, zeros in g, made non-finite, underflowed]

where *underflowed* counts elements that were non-zero and finite in g and became exactly zero in
``out`` (a scale below 1, or a narrower output dtype, pushed them under the smallest subnormal);
it hands back ``out`` and the statistics as one float64 tensor laid out as
``autoscale.kernels.reference.STATS`` names (``pack``).

``autoscale.kernels.reference.scale_grad_reference`` is the pure-torch version and the test oracle. The Triton
kernel must match it exactly for ``out`` and ``counts`` and to float32 rounding for the sums (it
adds per-block partial sums atomically, in another order). ``autoscale::scale_grad`` (a
``torch.library.triton_op``) launches the kernel on CUDA through ``wrap_triton``, so Dynamo,
AOTAutograd and Inductor see the kernel itself, not an opaque call.

What a point costs a launch-bound step is its launches (docs/results/step_profile_cuda.md), so the
op makes two: the zeroing of its one statistics tensor, and the kernel, which reads both scales
itself (a factor computed outside was a launch of its own at every point).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from autoscale.kernels.reference import STATS, pack, scale_grad_reference

__all__ = ["BLOCK", "LAUNCH", "Launch", "scale_grad", "scale_grad_reference", "scale_grad_triton"]


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the kernel is launched: elements per block, warps per program, programs per SM.

    The kernel is persistent (each program strides over many blocks). ``benchmarks.kernel_bandwidth
    --sweep`` times the choices; on an H200 (docs/results/kernels.md) 1024 elements on 8 warps, 4
    programs per SM, was the fastest at 2^24 and 2^28 elements: 1657 and 2250 GB/s, against 1492
    and 1940 with 4 warps (two runs alike), with the kernel of before its loop was shortened
    (``benchmarks.kernel_sass``): 37.2 and 38.9 instructions per element then, 24.5 and 22.8 now.
    """

    block: int = 1024
    num_warps: int = 8
    programs_per_sm: int = 4

    def __post_init__(self) -> None:
        for name in ("block", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"Launch.{name} must be a power of two, got {value}")
        if self.programs_per_sm < 1:
            raise ValueError(f"Launch.programs_per_sm must be at least 1, got {self.programs_per_sm}")


LAUNCH = Launch()
BLOCK = LAUNCH.block


@triton.jit
def _scale_grad_kernel(g_ptr, out_ptr, stats_ptr, scale_ptr, carried_ptr, n, BLOCK_SIZE: tl.constexpr):
    # Persistent: each program strides over many blocks, accumulating in registers, and touches
    # the statistics once at the end (one atomic per statistic per program, not per block).
    # The kernel is bound by the instructions it issues per element, not by memory (an H100 and
    # an H200 ran it at the same rate: docs/results/kernels.md), so the loop does the least per
    # element: each count is one predicate, selected and added in float32 (exact: a lane counts
    # at most one per block it visits, far below 2^24; ``_programs`` makes sure); the counts the
    # reference defines as conjunctions are derived at the end from these four:
    #   made non-finite = not finite after scaling - arrived non-finite (scaling keeps inf and nan)
    #   underflowed     = zero after scaling - arrived non-finite - zero before
    # (``out`` is 0 exactly where g is non-finite, made non-finite, zero, or underflowed: the
    # reference's underflowed includes the made non-finite, whose ``out`` is 0 too). Masked lanes
    # load 0: they add to no statistic but the zeros, before and after, which cancel in
    # underflowed; program 0 takes the last block's padding off the zeros.
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    inv_carried = 1.0 / tl.load(carried_ptr).to(tl.float32)  # scales are powers of two: exact
    factor = tl.load(scale_ptr).to(tl.float32) * inv_carried
    amax = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    total = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    squares = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    arrived = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)  # counts, per lane (see above)
    zeros_in = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    unmade = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    zeros_out = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    for start in range(pid * BLOCK_SIZE, n, programs * BLOCK_SIZE):
        offsets = tl.multiple_of(start, BLOCK_SIZE) + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n
        raw = tl.load(g_ptr + offsets, mask=mask, other=0.0)
        g = raw.to(tl.float32)
        finite = tl.abs(g) < float("inf")  # (false for inf and nan)
        safe = tl.where(finite, g, 0.0) * inv_carried
        scaled = (g * factor).to(raw.dtype)
        made = tl.abs(scaled.to(tl.float32)) < float("inf")
        out = tl.where(made, scaled, 0.0).to(raw.dtype)
        tl.store(out_ptr + offsets, out, mask=mask)
        amax = tl.maximum(amax, tl.abs(safe))
        total += safe
        squares += safe * safe
        arrived += tl.where(finite, 0.0, 1.0)
        zeros_in += tl.where(g == 0, 1.0, 0.0)
        unmade += tl.where(made, 0.0, 1.0)
        zeros_out += tl.where(out == 0, 1.0, 0.0)
    # (the statistics in float64, laid out as ``STATS``; a program's counts are summed in int64 first)
    tl.atomic_max(stats_ptr + 0, tl.max(amax, axis=0).to(tl.float64))  # (non-negative: an ordered max)
    tl.atomic_add(stats_ptr + 1, tl.sum(total, axis=0).to(tl.float64))
    tl.atomic_add(stats_ptr + 2, tl.sum(squares, axis=0).to(tl.float64))
    a = tl.sum(arrived.to(tl.int64), axis=0)
    z = tl.sum(zeros_in.to(tl.int64), axis=0)
    padding = (BLOCK_SIZE - n % BLOCK_SIZE) % BLOCK_SIZE  # (the last block's masked lanes)
    tl.atomic_add(stats_ptr + 3, a.to(tl.float64))
    tl.atomic_add(stats_ptr + 4, tl.where(pid == 0, n, 0).to(tl.float64))  # (elements: n, added once)
    tl.atomic_add(stats_ptr + 5, (z - tl.where(pid == 0, padding, 0).to(tl.int64)).to(tl.float64))
    tl.atomic_add(stats_ptr + 6, (tl.sum(unmade.to(tl.int64), axis=0) - a).to(tl.float64))
    tl.atomic_add(stats_ptr + 7, (tl.sum(zeros_out.to(tl.int64), axis=0) - a - z).to(tl.float64))


def _programs(device: torch.device, blocks: int, per_sm: int) -> int:
    """Enough programs to fill the GPU a few times over; a handful elsewhere (the interpreter).
    At least one per 2^23 blocks: a lane's float32 counts stay exact (one per block visited)."""
    wanted = per_sm * _multiprocessors(device.index or 0) if device.type == "cuda" else 4
    return min(blocks, max(wanted, triton.cdiv(blocks, 2**23)))


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _launch(grad: torch.Tensor, scale: torch.Tensor, carried: torch.Tensor, kernel: object, launch: Launch
            ) -> tuple[torch.Tensor, torch.Tensor]:
    g = grad.contiguous()
    out = torch.empty_like(g)
    stats = torch.zeros(len(STATS), dtype=torch.float64, device=g.device)
    n = g.numel()
    if n:
        grid = (_programs(g.device, triton.cdiv(n, launch.block), launch.programs_per_sm),)
        kernel[grid](g, out, stats, scale, carried, n, BLOCK_SIZE=launch.block,  # type: ignore[index]
                     num_warps=launch.num_warps)
    return out.view_as(grad), stats


def scale_grad_triton(grad: torch.Tensor, scale: torch.Tensor, carried: torch.Tensor, *, launch: Launch = LAUNCH
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale_grad_reference(grad, scale/carried, carried)``, packed (``pack``), in one direct
    Triton launch (any device Triton runs on). ``scale`` and ``carried``: float32, one element each."""
    return _launch(grad, scale, carried, _scale_grad_kernel, launch)


@triton_op("autoscale::scale_grad", mutates_args=())
def scale_grad(grad: torch.Tensor, scale: torch.Tensor, carried: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op, ``(out, stats)``: the Triton kernel on CUDA, the reference elsewhere.
    ``scale`` and ``carried``: float32, one element each (a point's row scales)."""
    if grad.device.type == "cuda":
        return _launch(grad, scale, carried, wrap_triton(_scale_grad_kernel), LAUNCH)
    out, fstats, counts = scale_grad_reference(grad, scale / carried, carried)
    return out, pack(fstats, counts)
