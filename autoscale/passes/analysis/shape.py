"""Rules for ops that move, gather, make or reduce values: layout ops, copies and casts
(``PASS_THROUGH``: the input's moments, and gradient, but for a part taken out of the input or
copies of it), ``pad``, ``cat``, ``embedding``, ``sum`` and ``mean``, and tensors filled with one
value."""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from ..graph_utils import op_name, tensor_val
from ..op_tables import PASS_THROUGH, REPEATING, SLICING
from .moments import Moments, all_known, gradient, moments_of
from .nodes import numel, shape_of
from .registry import CAST, backward, forward
from .taps import pad_args

__all__: list[str] = []


@forward(*PASS_THROUGH, CAST)
def _pass_through(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    src = n.args[0] if n.args else None
    return v.get(src) if isinstance(src, Node) else None


@backward(*PASS_THROUGH, CAST)
def _pass_through_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """The gradient as it arrives; a part taken out of a tensor (``SLICING``) passes it back to that
    part alone (zeros elsewhere: ViT's classifier reads the CLS token, 1 of 65 positions, and the
    gradient of the whole sequence was predicted 8x too large); a broadcast or repeat
    (``REPEATING``) sums the gradients of its copies."""
    name = op_name(n) or ""
    src = n.args[0] if n.args else None
    if not isinstance(src, Node):
        return {}
    if isinstance(tensor_val(src), torch.Tensor) and (name in SLICING or name in REPEATING):
        ratio = numel(n) / max(numel(src), 1.0)
        if (name in SLICING and ratio < 1) or (name in REPEATING and ratio > 1):
            return {src: gradient(g.std**2 * ratio + (g.mean * ratio) ** 2, src, g.mean * ratio)
                    if name in REPEATING else Moments(g.mean * ratio, g.ms * ratio, g.amax)}
    return {src: g}


@forward("zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full")
def _constant(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """A tensor filled with one value (``zeros``, ``ones``, ``full``, and their ``_like`` forms)."""
    name = op_name(n) or ""
    if "full" in name:
        at = 2 if name == "new_full" else 1  # (size, fill) / (input, fill) / (self, size, fill)
        fill = n.kwargs.get("fill_value", n.args[at] if len(n.args) > at else None)
        if not isinstance(fill, int | float) or isinstance(fill, bool):
            return None
        c = float(fill)
    else:
        c = 1.0 if "ones" in name else 0.0
    return Moments(c, c * c, abs(c))


@forward("pad")
def _pad(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """Constant padding: the added entries (``value``, 0 by default) dilute the mean and mean square
    by the share they take; on a small feature map a 1-pixel border is most of it (2x2 -> 4x4)."""
    x = moments_of(n.args[0], v)
    _, mode, fill = pad_args(n)
    if x is None or mode != "constant" or math.isnan(fill):
        return x
    kept = numel(n.args[0]) / max(numel(n), 1.0)
    return Moments(x.mean * kept + fill * (1 - kept), x.ms * kept + fill**2 * (1 - kept), max(x.amax, abs(fill)))


@backward("pad")
def _pad_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """The interior of the padded gradient, taken to have the whole's mean square (a convolution
    reading the pad predicts its interior's: ``taps_per_input``)."""
    return {n.args[0]: g} if isinstance(n.args[0], Node) else {}


@forward("cat", "concat")
def _cat(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    tensors = [a for a in n.args[0] if numel(a) > 0]  # type: ignore[union-attr]  # (an empty cache)
    moments = all_known([moments_of(a, v) for a in tensors])
    if moments is None:
        return None
    sizes = [numel(a) for a in tensors]
    total = sum(sizes)
    mean = sum(size * m.mean for size, m in zip(sizes, moments, strict=True)) / total
    ms = sum(size * m.ms for size, m in zip(sizes, moments, strict=True)) / total
    return Moments(mean, ms, max(m.amax for m in moments))


@backward("cat", "concat")
def _cat_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    return {a: g for a in n.args[0] if isinstance(a, Node) and numel(a) > 0}  # type: ignore[union-attr]


@forward("embedding")
def _embedding(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    return moments_of(n.args[1], v)


@backward("embedding")
def _embedding_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    weight = n.args[1]
    if not isinstance(weight, Node):
        return {}
    rows = shape_of(weight)[0]
    lookups = numel(n) / shape_of(weight)[-1]
    return {weight: gradient(g.ms * lookups / rows, weight)}  # scatter-added over the rows used


@forward("mean", "sum")
def _reduce(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    x = moments_of(n.args[0], v)
    if x is None:
        return None
    count = numel(n.args[0]) / max(numel(n), 1.0)
    mean = x.mean if op_name(n) == "mean" else x.mean * count
    spread = x.std**2 / count if op_name(n) == "mean" else x.std**2 * count
    return Moments.gaussian(mean, spread + mean**2, numel(n))


@backward("mean", "sum")
def _reduce_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    x = n.args[0]
    if not isinstance(x, Node):
        return {}
    count = numel(x) / max(numel(n), 1.0)
    return {x: g.scaled(1.0 / count) if op_name(n) == "mean" else g}
