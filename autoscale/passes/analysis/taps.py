"""Where a convolution's kernel lands: the taps inside its input per output position (its
reduction length) and per input element (its input gradient's fan-out), on small, strided and
zero-padded feature maps alike; and ``F.pad``'s arguments, which tell a zero pad's border."""

from __future__ import annotations

import math
from typing import Any

from torch.fx import Node

from ..graph_utils import op_name
from .nodes import shape_of

__all__ = ["pad_args", "taps_per_input", "taps_per_output"]


def pad_args(n: Node) -> tuple[Any, Any, float]:
    """``F.pad``'s widths, mode and fill value (0 when not given, nan when not a number)."""
    def arg(at: int, name: str, default: Any) -> Any:
        return n.kwargs.get(name, n.args[at] if len(n.args) > at else default)

    fill = arg(3, "value", None)
    value = 0.0 if fill is None else float(fill) if isinstance(fill, int | float) else math.nan
    return arg(1, "pad", None), arg(2, "mode", "constant"), value


def taps_per_input(n: Node, x: Node, kernel: list[int]) -> float:
    """The kernel taps that land on an input element, on average over the input: per spatial
    dimension, the (output position, tap) pairs inside the input divided by its size. When the
    input is a zero ``pad`` (TF-style "same" padding written out, as Hugging Face's MobileNetV2
    does), over its interior only: the border's gradient is dropped by the pad's backward, and on a
    2x2 map padded to 4x4 the interior's elements get 1.8x the average's taps. The kernel's size
    when the convolution's arguments are not plain integers."""
    return _taps(n, x, kernel, per_output=False)


def taps_per_output(n: Node, x: Node, kernel: list[int]) -> float:
    """The kernel taps that land inside the input, on average over the output positions: the
    reduction length of a convolution per input channel. On a small feature map most of a padded
    3x3 kernel reads the zero padding (on a 2x2 map, 4 of its 9 taps are inside): counted as the
    whole kernel, the output's spread came out 1.5x too high on MobileNetV2's last blocks, its
    batch norms' backward divided by it, and the gradients of the first layers were predicted 300x
    too small."""
    return _taps(n, x, kernel, per_output=True)


def _taps(n: Node, x: Node, kernel: list[int], *, per_output: bool) -> float:
    def spatial(at: int, name: str, default: int) -> list[int] | None:
        value = n.kwargs.get(name, n.args[at] if len(n.args) > at else default)
        values = list(value) if isinstance(value, list | tuple) else [value] * len(kernel)
        ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        return ints if len(ints) == len(kernel) else None  # (not a string padding, not symbolic)

    stride, padding, dilation = spatial(3, "stride", 1), spatial(4, "padding", 0), spatial(5, "dilation", 1)
    sizes_in, sizes_out = shape_of(x)[-len(kernel):], shape_of(n)[-len(kernel):]
    if stride is None or padding is None or dilation is None or len(sizes_in) != len(kernel):
        return float(math.prod(kernel))
    # (per output, a zero pad's border is inside: the pad's moments are diluted by its zeros already)
    border = (None if per_output else _zero_border(x, len(kernel))) or [(0, 0)] * len(kernel)
    taps = 1.0
    for k, s, p, d, size_in, size_out, (lo, hi) in zip(kernel, stride, padding, dilation, sizes_in, sizes_out,
                                                       border, strict=True):
        inside = sum(lo <= o * s - p + t * d < size_in - hi for o in range(int(size_out)) for t in range(k))
        taps *= inside / max(size_out if per_output else size_in - lo - hi, 1.0)
    return taps


def _zero_border(x: Node, dims: int) -> list[tuple[int, int]] | None:
    """The (before, after) widths of a zero ``pad`` on the last ``dims`` dimensions of ``x``, in
    dimension order; None when ``x`` is not such a pad."""
    if op_name(x) != "pad" or not x.args:
        return None
    widths, mode, fill = pad_args(x)
    if mode != "constant" or fill != 0.0 or not isinstance(widths, list | tuple):
        return None
    if not all(isinstance(w, int) for w in widths) or len(widths) % 2:
        return None
    pairs = [(int(widths[i]), int(widths[i + 1])) for i in range(0, len(widths), 2)][::-1]  # last dim first
    pairs = [(0, 0)] * max(dims - len(pairs), 0) + pairs
    return pairs[-dims:]
