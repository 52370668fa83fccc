"""The rescale point's computation in plain torch: the oracle of the fused kernel and of the CPU path.

Kept apart from the Triton kernel so that the oracle imports neither triton nor the rest of
autoscale (``autoscale.measure`` reaches the kernel lazily, and the kernel reaches this module).
"""

from __future__ import annotations

import torch

__all__ = ["COUNTS", "STATS", "pack", "scale_grad_reference"]

COUNTS = ("arrived_nonfinite", "elements", "zeros", "made_nonfinite", "underflowed")
STATS = ("amax", "total", "squares", *COUNTS)
"""What the fused op hands back in one float64 tensor (``pack``): one allocation, zeroed by one
launch, where a float32 and an int64 tensor took two. float64 holds every count exactly (to 2^53)."""


def scale_grad_reference(grad: torch.Tensor, factor: torch.Tensor, carried: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One gradient through a rescale point, in plain torch: ``(out, fstats, counts)``.

    ``out`` is ``grad·factor`` in grad's dtype with the values this made non-finite set to 0;
    ``fstats`` = [max |g|/carried, Σ g/carried, Σ (g/carried)²] over grad's finite values;
    ``counts`` (int64) as named by ``COUNTS``: arrived non-finite, elements, zeros in grad, made
    non-finite, and underflowed (finite non-zero values that ``out`` rounds to zero). The oracle of
    the Triton kernel (``autoscale.kernels.scale_grad``) and of ``autoscale.measure.scale_and_measure``.
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


def pack(fstats: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``scale_grad_reference``'s statistics as the fused op returns them: one float64 tensor laid
    out as ``STATS`` names."""
    return torch.cat([fstats.double(), counts.double()])
