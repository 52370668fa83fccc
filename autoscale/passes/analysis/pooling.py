"""Rules for pools: ``max_pool1d``/``2d`` (the max of a window of Gaussian draws) and the average
pools ``avg_pool2d``/``adaptive_avg_pool2d`` (a mean over each window)."""

from __future__ import annotations

import functools

import torch
from torch.fx import Node

from ..graph_utils import op_name
from .moments import Moments, moments_of
from .nodes import numel
from .registry import backward, forward

__all__: list[str] = []


@forward("max_pool1d", "max_pool2d")
def _max_pool(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """The max of each window: the largest of ``window`` draws from the input's distribution
    (Gaussian of its moments, ``_max_of``). (Taken as the input itself, ResNet's stem max pool was
    predicted at 0.45 of its spread.)"""
    x = moments_of(n.args[0], v)
    kernel = n.kwargs.get("kernel_size", n.args[1] if len(n.args) > 1 else None)
    if x is None or kernel is None:
        return None
    dims = 2 if "2d" in (op_name(n) or "") else 1
    sizes = list(kernel) if isinstance(kernel, list | tuple) else [kernel] * dims
    window = 1
    for k in sizes:
        if not isinstance(k, int):
            return None
        window *= k
    mean, ms = _max_of(x.mean / x.std if x.std > 0 else 0.0, window)
    return Moments(mean * x.std if x.std > 0 else x.mean, ms * x.std**2 if x.std > 0 else x.mean**2, x.amax)


@backward("max_pool1d", "max_pool2d")
def _max_pool_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """Each window's gradient goes to its largest input: the input's gradient has the output's
    spread on one element per window (overlapping windows share some), zeros elsewhere."""
    x = n.args[0]
    if not isinstance(x, Node):
        return {}
    ratio = min(numel(n) / max(numel(x), 1.0), 1.0)
    return {x: Moments(g.mean * ratio, g.ms * ratio, g.amax)}


@functools.cache
def _max_of(shift: float, window: int, draws: int = 4096) -> tuple[float, float]:
    """Mean and mean square of the max of ``window`` draws of N(shift, 1), on a fixed sample."""
    g = torch.Generator().manual_seed(0)
    top = (torch.randn(draws, window, generator=g, dtype=torch.float64) + shift).amax(-1)
    return float(top.mean()), float(top.square().mean())


@forward("adaptive_avg_pool2d", "avg_pool2d")
def _pool_mean(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    x = moments_of(n.args[0], v)
    if x is None:
        return None
    window = numel(n.args[0]) / max(numel(n), 1.0)
    return Moments.gaussian(x.mean, x.mean**2 + x.std**2 / window, numel(n))


@backward("adaptive_avg_pool2d", "avg_pool2d")
def _pool_mean_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    x = n.args[0]
    window = numel(x) / max(numel(n), 1.0) if isinstance(x, Node) else 1.0
    return {x: g.scaled(1.0 / window)} if isinstance(x, Node) else {}
