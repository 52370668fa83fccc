"""Rules for elementwise ops: unary functions of a Gaussian input (integrated by ``expect``, the
slope for the backward too), integer powers and clamps with their own bounds, the binary
arithmetic ops, and powers of a positive, concentrated input (a norm's ``rsqrt``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..graph_utils import op_name
from ..op_tables import CLAMP_BOUNDS, POSITIVE_POWERS
from .moments import Moments, expect, gradient, moments_of
from .nodes import numel
from .registry import backward, forward, unknown_gradients

__all__: list[str] = []


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "elu": F.elu, "leaky_relu": F.leaky_relu, "relu6": F.relu6, "softplus": F.softplus,
    "mish": F.mish, "hardswish": F.hardswish, "abs": torch.abs, "neg": torch.neg, "square": torch.square,
    "sin": torch.sin, "cos": torch.cos, "erf": torch.erf, "exp": torch.exp,
}


@functools.cache
def _power(p: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """x ** p as a function (cached: ``expect`` caches by the function)."""
    return functools.partial(torch.pow, exponent=p)


@functools.cache
def _clamp(low: float | None, high: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """clamp to [low, high] as a function (cached: ``expect`` caches by the function)."""
    return functools.partial(torch.clamp, min=low, max=high)


def _elementwise(n: Node) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The function of a unary elementwise op of a Gaussian input (``expect`` integrates it):
    a table entry, ``pow`` with an integer exponent (``x.pow(2)`` in an RMS norm), or a clamp with
    its own bounds (``hardtanh``'s defaults are [-1, 1], ReLU6's [0, 6])."""
    name = op_name(n) or ""
    if name in _UNARY:
        return _UNARY[name]
    if name == "pow" and len(n.args) > 1 and isinstance(n.args[1], int | float) and float(n.args[1]).is_integer():
        return _power(float(n.args[1]))
    if name in CLAMP_BOUNDS:
        bounds = [n.kwargs.get(key, n.args[at] if len(n.args) > at else default)
                  for at, key, default in CLAMP_BOUNDS[name]]
        numbers = [float(b) if isinstance(b, int | float) and not isinstance(b, bool) else b for b in bounds]
        if all(b is None or isinstance(b, float) for b in numbers):
            return _clamp(*numbers)  # type: ignore[arg-type]
    return None


@forward(*_UNARY, "pow", *CLAMP_BOUNDS)
def _unary(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """E[f(X)] and E[f(X)²] of the op's function of a Gaussian input (``_elementwise``); unknown
    where the op's arguments give no such function (``pow`` with a tensor or fractional exponent)."""
    f = _elementwise(n)
    if f is not None and n.args:
        m = moments_of(n.args[0], v)
        if m is None:
            return None
        mean, ms, _ = expect(f, m)
        return Moments.gaussian(mean, ms, numel(n))
    return None


@backward(*_UNARY, "pow", *CLAMP_BOUNDS)
def _unary_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """The incoming gradient times the function's slope, E[f'(X)²] (``expect``)."""
    f = _elementwise(n)
    if f is not None and isinstance(n.args[0], Node) and v.get(n.args[0]) is not None:
        _, _, slope = expect(f, v[n.args[0]])
        return {n.args[0]: gradient(g.ms * slope, n.args[0], like=g)}
    return unknown_gradients(n, v)


@forward("add", "sub", "rsub", "mul", "div", "truediv")
def _binary(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    a, b = moments_of(n.args[0], v), moments_of(n.args[1], v) if len(n.args) > 1 else None
    if a is None or b is None:
        return None
    name = op_name(n)
    if name in ("add", "sub", "rsub"):
        sign = -1.0 if name == "sub" else 1.0
        mean = a.mean + sign * b.mean
        return Moments.gaussian(mean, a.std**2 + b.std**2 + mean**2, numel(n))
    if name == "mul":
        return _product(a, b, numel(n))
    if name in ("div", "truediv") and not isinstance(n.args[1], Node):
        return a.scaled(1.0 / float(n.args[1]))  # type: ignore[arg-type]
    return None


@backward("add", "sub", "rsub", "mul", "div", "truediv")
def _binary_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    name = op_name(n)
    grads: dict[Node, Moments | None] = {}
    for i, arg in enumerate(n.args[:2]):
        if not isinstance(arg, Node):
            continue
        other = n.args[1 - i]
        part: Moments | None
        if name in ("add", "sub", "rsub"):
            part = g
        elif name == "mul":
            om = moments_of(other, v)
            part = gradient(g.ms * om.ms, arg, like=g) if om else None
        elif name in ("div", "truediv") and i == 0 and not isinstance(other, Node):
            part = g.scaled(1.0 / float(other))  # type: ignore[arg-type]
        else:
            part = None
        broadcast = numel(n) / max(numel(arg), 1.0)
        if part is not None and broadcast > 1:  # summed over broadcast dimensions
            part = gradient(part.std**2 * broadcast + (part.mean * broadcast) ** 2, arg, part.mean * broadcast)
        grads[arg] = part
    return grads


def _product(a: Moments, b: Moments, n: float) -> Moments:
    """Moments of x·y for independent x and y, with the max of ``n`` such products.

    x·y = μx·μy + μx·(y-μy) + μy·(x-μx) + (x-μx)·(y-μy): the middle terms are Gaussian, but the
    product of two spreads has exponential tails (its max over n grows like ln n, not √(2 ln n)),
    so a gated feed-forward's gelu(a)·b peaks ~2.5x above a Gaussian of the same spread. The max
    adds the parts' maxima, and never exceeds the product of the factors' maxima."""
    gaussian = math.sqrt((a.mean * b.std) ** 2 + (b.mean * a.std) ** 2)
    log_n = math.log(max(n, 2.0))
    amax = abs(a.mean * b.mean) + gaussian * math.sqrt(2 * log_n) + a.std * b.std * log_n
    return Moments(a.mean * b.mean, a.ms * b.ms, min(amax, a.amax * b.amax))


@forward(*POSITIVE_POWERS)
def _positive_power(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """x ** p of a positive, concentrated x (a mean of squares plus eps in a norm): the delta
    method. Unknown when x may come near 0 (within three spreads), where x ** p has no bound."""
    x = moments_of(n.args[0], v)
    p = POSITIVE_POWERS[op_name(n) or ""]
    if x is None or x.mean <= 0 or x.mean - 3 * x.std <= 0:
        return None
    mean = x.mean**p
    var = (p * x.mean ** (p - 1) * x.std) ** 2
    return Moments(mean, mean**2 + var, max((x.mean - 3 * x.std) ** p, (x.mean + 3 * x.std) ** p))


@backward(*POSITIVE_POWERS)
def _positive_power_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """x ** p of a concentrated positive x (``_positive_power``): the slope at its mean."""
    x = n.args[0]
    xm = moments_of(x, v)
    if not isinstance(x, Node):
        return {}
    if xm is None or xm.mean <= 0:
        return {x: None}
    p = POSITIVE_POWERS[op_name(n) or ""]
    return {x: gradient(g.ms * (p * xm.mean ** (p - 1)) ** 2, x, like=g)}
