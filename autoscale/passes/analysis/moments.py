"""Moments (mean, mean square, max |x|) and the arithmetic of them the rules share: the float16
underflow rate of a gradient, sums and averages of contributions, expectations of a function of a
Gaussian (Gauss–Hermite quadrature), and the moments of a gradient spread over a node."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.fx import Node

from .nodes import numel

__all__ = ["FLUSH", "Moments", "all_known", "average_of", "clear_caches", "expect", "gradient", "moments_of",
           "predicted_underflow", "sum_of"]


# The largest magnitude float16 rounds to zero: 2^-25, half its smallest subnormal 2^-24 (round to
# nearest even sends (2^-25, 2^-24) up to 2^-24, and the tie 2^-25 down to 0). The rate below counts
# what is *flushed*, so it uses this, not the subnormal (which the paper's scale rule uses as u_min).
FLUSH = 2.0**-25


class Moments(NamedTuple):
    """Magnitude statistics of a tensor's elements: mean, mean square, max |x|. (A named tuple:
    the analysis makes two per node, and a tuple of floats is cheap to build and untracked by the
    cyclic garbage collector.)"""

    mean: float
    ms: float
    amax: float

    @property
    def std(self) -> float:
        return math.sqrt(max(self.ms - self.mean**2, 0.0))

    @staticmethod
    def of(t: torch.Tensor) -> Moments:
        if t.numel() == 0:
            return Moments(0.0, 0.0, 0.0)
        x = t.detach().double().flatten()
        total, squares, amax = torch.stack((x.sum(), x.dot(x), x.abs().max())).tolist()
        return Moments(total / x.numel(), squares / x.numel(), amax)

    @staticmethod
    def gaussian(mean: float, ms: float, n: float) -> Moments:
        """Moments with the max a Gaussian sample of ``n`` values would have."""
        std = math.sqrt(max(ms - mean**2, 0.0))
        return Moments(mean, ms, abs(mean) + std * math.sqrt(2 * math.log(max(n, 2.0))))

    def scaled(self, c: float) -> Moments:
        return Moments(self.mean * c, self.ms * c * c, self.amax * abs(c))


def predicted_underflow(grad: Moments) -> float:
    """Fraction of a zero-mean Gaussian with the gradient's spread that float16 rounds to zero:
    ``P(|x| <= 2^-25) = erf(2^-25 / (√2·σ))``, the share of all entries (a Gaussian has no exact
    zeros: the measured counterpart, ``autoscale.layer_numbers.flushed_share``, counts the
    entries nonzero in float32 and zero in float16 over all entries). A spread of 0 is the limit,
    1: a predicted 0 is a spread too small for float64 (a product of many tiny factors:
    EfficientNet's squeeze-and-excitation gradients are ~1e-36), far more often than an exactly
    zero gradient. (Counted below the smallest subnormal 2^-24 instead, every rate came out twice
    the flushed share, for rates well below 1.)"""
    sigma = math.sqrt(max(grad.ms, 0.0))
    return 1.0 if sigma == 0 else math.erf(FLUSH / (math.sqrt(2) * sigma))


def moments_of(arg: Any, value: dict[Node, Moments | None]) -> Moments | None:
    """The moments of an op's argument: a node's as ``value`` has them, a number's exactly; else None."""
    if isinstance(arg, Node):
        return value.get(arg)
    if isinstance(arg, int | float) and not isinstance(arg, bool):
        return Moments(float(arg), float(arg) ** 2, abs(float(arg)))
    return None


def all_known(parts: list[Moments | None]) -> list[Moments] | None:
    """``parts`` if there are some and every one is known, else None."""
    known = [p for p in parts if p is not None]
    return known if known and len(known) == len(parts) else None


def sum_of(parts: list[Moments | None]) -> Moments | None:
    """Moments of a sum of independent contributions (a gradient used in several places)."""
    known = all_known(parts)
    if known is None:
        return None
    mean = sum(p.mean for p in known)
    return Moments(mean, sum(p.std**2 for p in known) + mean**2, sum(p.amax for p in known))


def average_of(parts: list[Moments | None]) -> Moments | None:
    """Moments of disjoint pieces of equal size taken together (the elements of a tuple)."""
    known = all_known(parts)
    if known is None:
        return None
    k = len(known)
    return Moments(sum(p.mean for p in known) / k, sum(p.ms for p in known) / k, max(p.amax for p in known))


@functools.cache
def _hermite(points: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss–Hermite nodes and weights for E[f(Z)], Z ~ N(0, 1) (Golub–Welsch)."""
    k = torch.arange(1, points, dtype=torch.float64)
    jacobi = torch.diag(torch.sqrt(k), 1) + torch.diag(torch.sqrt(k), -1)
    nodes, vectors = torch.linalg.eigh(jacobi)
    return nodes, vectors[0] ** 2


@functools.cache
def expect(f: Callable[[torch.Tensor], torch.Tensor], m: Moments) -> tuple[float, float, float]:
    """E[f(X)], E[f(X)²] and E[f'(X)²] for X Gaussian with m's mean and spread.

    f' by central differences in float64 (step ~ eps^(1/3) relative: ~1e-10 relative error), in
    the same call as f: autograd cost 3x as much, and this runs for every elementwise op. Cached
    for the length of a pass (``analyze_underflow`` clears it): an op's backward rule asks for the
    expectation its forward rule computed.
    """
    z, w = _hermite()
    x = m.mean + m.std * z
    h = 6e-6 * (x.abs() + m.std) + 1e-300
    y, up, down = f(torch.stack([x, x + h, x - h])).unbind(0)
    dy = (up - down) / (2 * h)
    return float((w * y).sum()), float((w * y * y).sum()), float((w * dy * dy).sum())


def clear_caches() -> None:
    """Drop the expectations cached for one pass (``expect``)."""
    expect.cache_clear()


def gradient(ms: float, n: Any, mean: float = 0.0, like: Moments | None = None) -> Moments:
    """A gradient of mean square ``ms`` over ``n``'s elements, its max that of a Gaussian sample;
    or, for a map that keeps each element's gradient where it was (elementwise maps, a
    normalization, softmax: ``like`` is the incoming gradient), at least the incoming gradient's
    max scaled as its spread. A gradient with zeros in most places keeps its peaks so: a
    classifier that reads one position (ViT's and BERT's CLS token) sends back a gradient whose
    spread over the whole sequence is 1/65 of the position's, and its max, as a Gaussian of that
    spread, came out 30x too small. A product with a matrix (a GEMM's input gradient) mixes each
    row's elements: its max is a Gaussian's again."""
    m = Moments.gaussian(mean, ms, numel(n))
    if like is not None and like.ms > 0 and ms > 0:
        return Moments(m.mean, m.ms, max(m.amax, like.amax * math.sqrt(ms / like.ms)))
    return m
