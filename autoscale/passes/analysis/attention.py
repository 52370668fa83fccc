"""Rules for softmax and attention, and for the masks before them: ``softmax``,
``scaled_dot_product_attention``, ``masked_fill``, ``where``. A softmax row's weights depend on how
many of its keys are live (not masked: ``constants.row_counts``); its statistics (``_Rows``) are
measured on a fixed sample of Gaussian logits and kept on the node for the backward rule."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch
from torch.fx import Node

from .constants import either, is_mask_value, known_bool, pattern_of, row_counts
from .moments import Moments, gradient, moments_of
from .nodes import numel, shape_of
from .registry import backward, forward

__all__ = ["ATTENTION_KEY"]

# A softmax's or an attention's row statistics (``_Rows``), from its forward rule for its backward
# rule: a per-pipeline cache on the node, like ``constants.CONCRETE_KEY``.
ATTENTION_KEY = "autoscale_attention"


class _Rows(NamedTuple):
    """Statistics of softmax rows, averaged over a value's rows: the sum of squared weights (what a
    weighted average keeps of its inputs' spread), ``Σw² − 2Σw³ + (Σw²)²`` (what softmax's backward
    keeps of an incoming gradient's spread, summed over the row: ``w ⊙ (g − Σ w·g)``), and the
    largest weight. Per group of rows with the same live length: (share of rows, Σw², max weight)."""

    squares: float
    backward: float
    top: float
    groups: tuple[tuple[float, float, float], ...]


def _attention_stats(std: float, counts: tuple[tuple[int, float], ...], length: int) -> _Rows:
    """``_Rows`` for softmax rows of Gaussian logits of spread ``std`` with the live lengths
    ``counts`` (``row_counts``) out of ``length``. A row with no live entry (every key masked)
    is taken as uniform, as a finfo.min fill makes it. At most 24 lengths are simulated: more
    (a causal mask has one per row) are grouped geometrically."""
    groups: dict[int, float] = {}
    for count, share in counts:
        groups[count] = groups.get(count, 0.0) + share
    if len(groups) > 24:
        binned: dict[int, list[float]] = {}
        for count, share in groups.items():
            bucket = int(round(math.log2(count) * 4)) if count > 0 else -1
            acc = binned.setdefault(bucket, [0.0, 0.0])
            acc[0] += share
            acc[1] += share * count
        groups = {}
        for share, weighted in binned.values():
            rep = int(round(weighted / share)) if share > 0 else 0
            groups[rep] = groups.get(rep, 0.0) + share
    squares = back = top = 0.0
    parts = []
    for count, share in sorted(groups.items()):
        s2, b, t = _row_stats(float(min(std, 50.0)), count) if count > 0 else _row_stats(0.0, length)
        squares += share * s2
        back += share * b
        top = max(top, t)
        parts.append((share, s2, t))
    return _Rows(squares, back, top, tuple(parts))


@functools.cache
def _row_stats(std: float, length: int) -> tuple[float, float, float]:
    """(Σw², Σw² − 2Σw³ + (Σw²)², max w) of softmax rows over ``length`` Gaussian logits of spread
    ``std``, averaged over a fixed sample of rows (the max: over them). Measured, not a closed form:
    e^{σ²}/L², which assumes the normalizer is its mean, is several times too high over few keys,
    where the largest terms dominate the normalizer (T5's unscaled attention logits)."""
    if length <= 1:
        return (1.0, 0.0, 1.0) if length == 1 else (0.0, 0.0, 0.0)
    sampled = min(length, 1 << 16)
    rows = max(16, min(256, (1 << 16) // sampled))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, sampled, generator=g, dtype=torch.float64) * std
    w = torch.softmax(logits, dim=-1) * (sampled / length)
    s2 = w.square().sum(-1) * (length / sampled)
    s3 = w.pow(3).sum(-1) * (length / sampled)
    return float(s2.mean()), float((s2 - 2 * s3 + s2.square()).mean()), float(w.max())


@forward("softmax")
def _softmax(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """Rows of weights summing to 1 over ``dim``, each row over its live entries only where the
    input holds mask fills (a causal mask's first row is one weight of 1). The row statistics
    (``_attention_stats``) are kept for the backward and for a product with the values after it."""
    x = moments_of(n.args[0], v)
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else -1)
    if x is None or not isinstance(dim, int):
        return None
    shape = shape_of(n.args[0])
    length = int(shape[dim])
    if length <= 0:
        raise ZeroDivisionError  # (an empty row: nothing to predict)
    rows = _attention_stats(x.std, row_counts(pattern_of(n.args[0]), shape, dim), length)
    n.meta[ATTENTION_KEY] = rows
    return Moments(1.0 / length, rows.squares / length, rows.top)


@backward("softmax")
def _softmax_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """y ⊙ (g - Σ y·g): the mean of g cancels, and a row keeps ``Σy² − 2Σy³ + (Σy²)²`` of g's
    spread (``_Rows.backward``: nothing of a row over one key, which E[y²] alone counted in full)."""
    y = v.get(n)
    x = n.args[0]
    if not isinstance(x, Node) or y is None:
        return {}
    rows = n.meta.get(ATTENTION_KEY)
    if not isinstance(rows, _Rows):
        return {x: gradient(g.std**2 * y.ms, x)}
    length = shape_of(x)[_softmax_dim(n)]
    return {x: gradient(g.std**2 * rows.backward / length, x, like=g)}


def _softmax_dim(n: Node) -> int:
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else -1)
    return dim if isinstance(dim, int) else -1


def _attention_args(n: Node) -> tuple[Any, bool, float]:
    """``scaled_dot_product_attention``'s mask argument, ``is_causal`` and scale (1/√d by default)."""
    def arg(at: int, name: str, default: Any) -> Any:
        return n.kwargs.get(name, n.args[at] if len(n.args) > at else default)

    scale = arg(6, "scale", None)
    d = shape_of(n.args[0])[-1]
    return arg(3, "attn_mask", None), bool(arg(5, "is_causal", False)), (
        float(scale) if isinstance(scale, int | float) else 1.0 / math.sqrt(d))


@forward("scaled_dot_product_attention")
def _sdpa(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """softmax(s·QKᵀ + mask)·V: each output row a weighted average of V's rows, which keeps
    ``Σw²`` of their spread (``_attention_stats``). The scores' spread across keys: s²·d·E[q²]·var(k)
    (k's mean adds the same to every key of a row, which softmax ignores), plus an additive float
    mask's (T5's position bias). The rows' live lengths: ``is_causal``'s lower triangle, a boolean
    mask known at compile time (True: attend), the mask fills of a float mask (``MASK_KEY``).
    (The rule this replaces took a causal row as half the keys and ignored ``scale`` and masks: a
    causal attention's rows average over 1..L keys, and its first rows keep most of V's spread.)"""
    q, k, val = (moments_of(a, v) for a in n.args[:3])
    if q is None or k is None or val is None:
        return None
    mask, causal, scale = _attention_args(n)
    shape_q, shape_k = shape_of(n.args[0]), shape_of(n.args[1])
    queries, keys, d = int(shape_q[-2]), int(shape_k[-2]), shape_q[-1]
    pattern = ~torch.ones(queries, keys, dtype=torch.bool).tril() if causal else None
    score_var = scale**2 * d * q.ms * k.std**2
    if isinstance(mask, Node):
        known = known_bool(mask)
        if known is not None:
            pattern = either(pattern, ~known)
        else:
            bias = v.get(mask)
            if bias is None:
                return None
            pattern = either(pattern, pattern_of(mask))
            score_var += bias.std**2
    scores = (*shape_q[:-1], float(keys))
    rows = _attention_stats(math.sqrt(score_var), row_counts(pattern, scores, -1), keys)
    n.meta[ATTENTION_KEY] = rows
    ms = val.mean**2 + val.std**2 * rows.squares
    # the largest output: per group of rows, a Gaussian max of its entries (a row over one key is a
    # row of V itself)
    amax = max((abs(val.mean) + val.std * math.sqrt(squares) * math.sqrt(2 * math.log(max(share * numel(n), 2.0)))
                for share, squares, _ in rows.groups), default=0.0)
    return Moments(val.mean, ms, min(amax, val.amax) if val.amax > 0 else amax)


@backward("scaled_dot_product_attention")
def _sdpa_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """The backward of softmax(s·QKᵀ + mask)·V, with P the weights, dO the incoming gradient and
    dP = dO·Vᵀ (d products; the part of V's mean shared by a row's keys cancels in softmax's
    backward, so var(dP) = d·E[dO²]·var(v)):

    * dV = Pᵀ·dO: a key's gradient sums the dO of the queries attending to it, weighted: per key,
      (L/S)·E[Σw²]·E[dO²] (L queries, S keys). (The rule this replaces took dV as dO: its spread
      2.2-3.6x too large over 32 keys, and dQ's and dK's up to 2.9x.)
    * dS = P ⊙ (dP − Σ P·dP): ``_Rows.backward``·var(dP) per row.
    * dQ = s·dS·K: s²·E[row Σ dS²]·var(k) (Σ_j dS = 0: k's mean cancels); dK = s·dSᵀ·Q, per key
      (L/S) of it with E[q²].
    * a float mask that takes a gradient (a learned position bias) gets dS, summed over the
      dimensions it is broadcast along.

    With grouped-query attention (``enable_gqa``) each key and value head serves G query heads:
    its gradients sum G of them."""
    q, k, val = n.args[:3]
    if not all(isinstance(a, Node) for a in (q, k, val)):
        return {}
    qm, km, vm = v.get(q), v.get(k), v.get(val)  # type: ignore[arg-type]
    mask, _, scale = _attention_args(n)
    inputs: list[Node] = [q, k, val] + ([mask] if isinstance(mask, Node) and known_bool(mask) is None else [])  # type: ignore[assignment]
    rows = n.meta.get(ATTENTION_KEY)
    if qm is None or km is None or vm is None or not isinstance(rows, _Rows):
        return dict.fromkeys(inputs)
    shape_q, shape_k, shape_v = shape_of(q), shape_of(k), shape_of(val)
    queries, keys = shape_q[-2], shape_k[-2]
    group = shape_q[-3] / shape_k[-3] if len(shape_q) >= 3 and len(shape_k) >= 3 else 1.0
    dp = shape_v[-1] * g.ms * vm.std**2
    row_ds = rows.backward * dp  # Σ_j dS_ij² per query row
    grads: dict[Node, Moments | None] = {
        val: gradient(g.ms * (queries / keys) * rows.squares * group, val),  # type: ignore[dict-item]
        q: gradient(scale**2 * row_ds * km.std**2, q),  # type: ignore[dict-item]
        k: gradient(scale**2 * (queries / keys) * row_ds * qm.ms * group, k),  # type: ignore[dict-item]
    }
    if len(inputs) > 3:
        scores = numel(q) / shape_q[-1] * keys
        broadcast = scores / max(numel(mask), 1.0)
        grads[mask] = gradient(row_ds / keys * broadcast, mask)
    return grads


@forward("masked_fill")
def _masked_fill(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """``x.masked_fill(mask, value)``: a mask fill (``MASK_MAGNITUDE``) leaves the moments of the
    entries kept (and ``MASK_KEY`` says where the fills are); another value mixes in at the share of
    the mask known at compile time, or, unknown, counts only in the max."""
    x, fill = moments_of(n.args[0], v), moments_of(n.args[2], v) if len(n.args) > 2 else None
    if x is None:
        return None
    if is_mask_value(n.args[2]) if len(n.args) > 2 else False:
        return x
    if fill is None:
        return None
    known = known_bool(n.args[1])
    if known is None:
        return Moments(x.mean, x.ms, max(x.amax, fill.amax))
    return _mixture(x, fill, 1.0 - float(known.double().mean()))


@backward("masked_fill")
def _masked_fill_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """The kept entries' gradient. Before a softmax, a mask fill's entries get softmax's zero
    gradient already (its moments average them in): passed on as it is. Another fill zeroes the
    gradient at the share of the mask known at compile time; the fill value, where it is a tensor,
    gets the rest, summed over its broadcast."""
    x = n.args[0]
    fill = n.args[2] if len(n.args) > 2 else None
    known = known_bool(n.args[1]) if len(n.args) > 1 else None
    share = float(known.double().mean()) if known is not None and not is_mask_value(fill) else 0.0
    grads: dict[Node, Moments | None] = {}
    if isinstance(x, Node):
        grads[x] = gradient(g.ms * (1.0 - share), x, like=g) if share > 0 else g
    if isinstance(fill, Node) and not is_mask_value(fill):
        grads[fill] = gradient(g.ms * share * numel(n) / max(numel(fill), 1.0), fill)
    return grads


def _mixture(a: Moments, b: Moments, share_a: float) -> Moments:
    """Entries from ``a`` at ``share_a`` of the positions, from ``b`` at the rest."""
    share_b = 1.0 - share_a
    amax = max(a.amax if share_a > 0 else 0.0, b.amax if share_b > 0 else 0.0)
    return Moments(share_a * a.mean + share_b * b.mean, share_a * a.ms + share_b * b.ms, amax)


@forward("where")
def _where(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """``where(cond, a, b)``: a mask fill on one side leaves the other side's moments (``MASK_KEY``
    says where the fills are); else a mixture at the share of ``cond`` known at compile time, or
    half and half."""
    if len(n.args) < 3:
        return None
    cond, a, b = n.args[:3]
    if is_mask_value(b):
        return moments_of(a, v)
    if is_mask_value(a):
        return moments_of(b, v)
    ma, mb = moments_of(a, v), moments_of(b, v)
    if ma is None or mb is None:
        return None
    known = known_bool(cond)
    return _mixture(ma, mb, float(known.double().mean()) if known is not None else 0.5)


@backward("where")
def _where_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """Each side gets the gradient where it was chosen (at the known share of ``cond``, or half),
    summed over the dimensions it is broadcast along."""
    if len(n.args) < 3:
        return {}
    cond, a, b = n.args[:3]
    known = known_bool(cond)
    share = float(known.double().mean()) if known is not None else 0.5
    grads: dict[Node, Moments | None] = {}
    for side, part in ((a, share), (b, 1.0 - share)):
        if isinstance(side, Node) and not is_mask_value(side):
            broadcast = numel(n) / max(numel(side), 1.0)
            grads[side] = gradient(g.ms * part * broadcast, side)
    return grads
