"""Rules for normalizations: ``layer_norm``, ``group_norm``, ``batch_norm``, ``rms_norm``. The
output's spread is the affine weight's (what is left of the input's after dividing by √(var + eps));
the backward multiplies by 1 / (var + eps)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from ..graph_utils import op_name
from ..op_tables import NORM_ARGUMENTS
from .moments import Moments, gradient, moments_of
from .nodes import numel, passes_through, shape_of
from .registry import backward, forward
from .taps import taps_per_output

__all__: list[str] = []


def _normalized_ms(n: Node, x: Moments, v: dict[Node, Moments | None]) -> tuple[float, float]:
    """The variance a normalization divides by and its ``eps``: what is left of the input's spread
    after it (``var / (var + eps)``, below 1 when the input's spread is near ``eps`` — BatchNorm
    after small-initialized convolutions) and the factor its backward multiplies by (``1 / (var +
    eps)``) both depend on the two together. RMS norm divides by the mean square, not the variance;
    batch norm in eval mode by its running variance."""
    name = op_name(n) or ""
    args = list(n.args) + [None] * 8
    eps = n.kwargs.get("eps", args[NORM_ARGUMENTS[name][2]])
    if not isinstance(eps, int | float):
        eps = 1e-5 if name != "rms_norm" else torch.finfo(torch.float32).eps
    var = x.ms if name == "rms_norm" else x.std**2
    if name == "batch_norm" and not n.kwargs.get("training", args[5]):
        running = n.kwargs.get("running_var", args[2])
        if isinstance(running, Node) and isinstance(rv := moments_of(running, v), Moments):
            var = rv.mean
    elif name == "batch_norm" and (within := _within_channel_var(n.args[0], v)) is not None:
        var = min(var, within)
    return max(var, 0.0), float(eps)


def _within_channel_var(x: Any, v: dict[Node, Moments | None]) -> float | None:
    """The variance of a convolution's output within a channel, where it is ``x`` (through casts
    and views): what a batch norm after it divides by. Each output channel's mean is its input's
    mean times the sum of the channel's weights (plus its bias): it differs from channel to
    channel, and the output's variance over all channels counts those differences, which a batch
    norm, normalizing each channel by its own statistics, does not see. After a ReLU or a max pool
    (inputs with a mean near their spread) they were half the variance: ResNet's and RegNet's
    batch norms' backward was predicted ~2x too weak each, compounding to 4-20x at the stem."""
    while isinstance(x, Node) and passes_through(x):
        x = x.args[0] if x.args else None
    if not isinstance(x, Node) or (op_name(x) or "") not in ("conv1d", "conv2d", "conv3d"):
        return None
    xm, wm = moments_of(x.args[0], v), moments_of(x.args[1], v)
    if xm is None or wm is None:
        return None
    wshape = shape_of(x.args[1])
    k = wshape[1] * taps_per_output(x, x.args[0], [int(s) for s in wshape[2:]])  # type: ignore[arg-type]
    return k * wm.ms * xm.std**2


@forward(*NORM_ARGUMENTS)
def _normalize(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """layer/batch/group/RMS norm: the input's spread divided by √(var + eps), then the affine
    weight and bias."""
    weight_at, bias_at, _ = NORM_ARGUMENTS[op_name(n) or ""]
    args = list(n.args) + [None] * 6
    x = moments_of(n.args[0], v)
    w = moments_of(n.kwargs.get("weight", args[weight_at]), v)
    b = moments_of(n.kwargs.get("bias", args[bias_at]), v)
    kept = 1.0
    if x is not None:
        var, eps = _normalized_ms(n, x, v)
        kept = var / (var + eps) if var + eps > 0 else 1.0
    w_ms = w.ms if w else 1.0
    mean = b.mean if b else 0.0
    return Moments.gaussian(mean, w_ms * kept + (b.ms if b else 0.0), numel(n))


@backward(*NORM_ARGUMENTS)
def _normalize_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    weight_at, bias_at, _ = NORM_ARGUMENTS[op_name(n) or ""]
    args = list(n.args) + [None] * 6
    x, w, b = args[0], n.kwargs.get("weight", args[weight_at]), n.kwargs.get("bias", args[bias_at])
    xm, wm = moments_of(x, v), moments_of(w, v)
    var, eps = _normalized_ms(n, xm, v) if xm else (1.0, 0.0)
    grads: dict[Node, Moments | None] = {}
    if isinstance(x, Node):
        grads[x] = gradient(g.ms * (wm.ms if wm else 1.0) / max(var + eps, 1e-12), x, like=g) if xm else None
    rows = numel(n) / max(numel(w), 1.0) if isinstance(w, Node) else 1.0
    if isinstance(w, Node):  # the normalized input's mean square: var / (var + eps)
        grads[w] = gradient(rows * g.ms * (var / (var + eps) if var + eps > 0 else 1.0), w)
    if isinstance(b, Node):
        grads[b] = gradient(rows * g.ms, b)
    return grads
