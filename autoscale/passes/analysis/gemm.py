"""Rules for GEMMs and convolutions: ``linear``, ``matmul``/``mm``/``bmm``, ``addmm``,
``conv1d``/``2d``/``3d``. Forward: a sum of k independent products (``_gemm``); backward: the
input's gradient sums over the outputs it feeds, the weight's over the rows."""

from __future__ import annotations

from typing import Any

from torch.fx import Node

from ..graph_utils import op_name
from .moments import Moments, gradient, moments_of
from .nodes import numel, passes_through, shape_of
from .registry import backward, forward
from .taps import taps_per_input, taps_per_output

__all__: list[str] = []


def _gemm(x: Moments, w: Moments, k: float, n: float, bias: Moments | None = None) -> Moments:
    """y = Σ_k x·w over a reduction of length k (+ bias), independent factors."""
    mean = k * x.mean * w.mean + (bias.mean if bias else 0.0)
    var = k * (x.ms * w.ms - (x.mean * w.mean) ** 2) + (bias.std**2 if bias else 0.0)
    return Moments.gaussian(mean, var + mean**2, n)


def _gemm_backward(x: Node, w: Node, g: Moments, v: dict[Node, Moments | None], *, out_features: float,
                   rows: float, bias: Any = None) -> dict[Node, Moments | None]:
    xm, wm = v.get(x), v.get(w)
    grads: dict[Node, Moments | None] = {
        x: gradient(out_features * g.ms * wm.ms, x) if wm else None,
        w: gradient(rows * g.ms * xm.ms, w) if xm else None,
    }
    if isinstance(bias, Node):
        grads[bias] = gradient(rows * g.std**2 + (rows * g.mean) ** 2, bias)
    return grads


@forward("linear")
def _linear(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    x, w = moments_of(n.args[0], v), moments_of(n.args[1], v)
    bias = moments_of(n.args[2], v) if len(n.args) > 2 and n.args[2] is not None else None
    if x is None or w is None:
        return None
    return _gemm(x, w, shape_of(n.args[0])[-1], numel(n), bias)


@backward("linear")
def _linear_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    x, w = n.args[0], n.args[1]
    assert isinstance(x, Node) and isinstance(w, Node)
    out_features = shape_of(w)[0]
    return _gemm_backward(x, w, g, v, out_features=out_features, rows=numel(n) / out_features,
                          bias=n.args[2] if len(n.args) > 2 else None)


@forward("matmul", "mm", "bmm")
def _matmul(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    a, b = moments_of(n.args[0], v), moments_of(n.args[1], v)
    if a is None or b is None:
        return None
    out = _gemm(a, b, shape_of(n.args[0])[-1], numel(n))
    if _is_softmax(n.args[0]):
        # attention's probabilities @ values: each row a weighted average of b's rows, which can
        # reach b's max (a row that puts its weight on one key, as a causal mask's first row does)
        return Moments(out.mean, out.ms, max(out.amax, b.amax))
    return out


@backward("matmul", "mm", "bmm")
def _matmul_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    a, b = n.args[0], n.args[1]
    assert isinstance(a, Node) and isinstance(b, Node)
    am, bm = v.get(a), v.get(b)
    return {a: gradient(shape_of(b)[-1] * g.ms * bm.ms, a) if bm else None,
            b: gradient(shape_of(a)[-2] * g.ms * am.ms, b) if am and len(shape_of(a)) >= 2 else None}


def _is_softmax(x: Any) -> bool:
    """Whether ``x`` is a softmax's output (through casts and views): rows of weights summing to 1."""
    while isinstance(x, Node) and passes_through(x):
        x = x.args[0] if x.args else None
    return isinstance(x, Node) and op_name(x) == "softmax"


@forward("addmm")
def _addmm(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """``addmm(bias, a, b)`` = bias + a @ b (what Hugging Face's Conv1D, GPT-2's projections, is)."""
    bias, a, b = (moments_of(x, v) for x in n.args[:3])
    if a is None or b is None or (bias is None and isinstance(n.args[0], Node)):
        return None
    return _gemm(a, b, shape_of(n.args[1])[-1], numel(n), bias)


@backward("addmm")
def _addmm_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    bias, a, b = n.args[:3]
    if not isinstance(a, Node) or not isinstance(b, Node):
        return {}
    out_features = shape_of(b)[-1]
    grads = _gemm_backward(a, b, g, v, out_features=out_features, rows=shape_of(a)[-2])
    if isinstance(bias, Node):
        rows = numel(n) / max(numel(bias), 1.0)
        grads[bias] = gradient(rows * g.std**2 + (rows * g.mean) ** 2, bias)
    return grads


@forward("conv1d", "conv2d", "conv3d")
def _conv(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    x, w = moments_of(n.args[0], v), moments_of(n.args[1], v)
    bias = moments_of(n.args[2], v) if len(n.args) > 2 and isinstance(n.args[2], Node) else None
    if x is None or w is None:
        return None
    wshape = shape_of(n.args[1])
    k = wshape[1] * taps_per_output(n, n.args[0], [int(s) for s in wshape[2:]])  # type: ignore[arg-type]
    return _gemm(x, w, k, numel(n), bias)


@backward("conv1d", "conv2d", "conv3d")
def _conv_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    x, w = n.args[0], n.args[1]
    assert isinstance(x, Node) and isinstance(w, Node)
    wshape = shape_of(w)
    # How many outputs an input element feeds: its own group's out_channels / groups filters (a
    # depthwise convolution's one), each at the kernel positions that land on it (fewer with a
    # stride, and at a small feature map's padded border). The whole out_channels times the kernel
    # overstated the gradient's spread by up to groups x stride^d, compounded over every depthwise
    # layer of a MobileNet: its scales were seeded at the floor and its gradients underflowed.
    groups = n.kwargs.get("groups", n.args[6] if len(n.args) > 6 else 1)
    per_group = wshape[0] / (groups if isinstance(groups, int) else 1)
    fan_out = per_group * taps_per_input(n, x, [int(k) for k in wshape[2:]])
    rows = numel(n) / wshape[0]  # batch × output positions
    return _gemm_backward(x, w, g, v, out_features=fan_out, rows=rows,
                          bias=n.args[2] if len(n.args) > 2 else None)
