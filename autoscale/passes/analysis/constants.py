"""What the analysis knows exactly at compile time, rather than by moments: values the graph
builds from constants, shapes and small buffers alone (causal masks, position indices and buckets,
rotary tables: ``folded``), and where a value holds mask fills (-inf, finfo.min: ``mask_pattern``),
which its moments leave out, so that a softmax or an attention knows each row's live keys
(``row_counts``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx
import torch.utils._pytree
from torch.fx import Node

from ..graph_utils import op_name, tensor_val
from ..op_tables import FOLDABLE
from .moments import Moments
from .nodes import hint, numel, passes_through, shape_of

__all__ = ["CONCRETE_KEY", "CONCRETE_LIMIT", "MASK_KEY", "MASK_MAGNITUDE", "either", "folded", "is_mask_value",
           "known_bool", "live_moments", "mask_pattern", "pattern_of", "row_counts"]


CONCRETE_LIMIT = 1 << 20  # the most elements a value computed at compile time may have
# Per-pipeline caches on the nodes (the pass drops them at its end): a value computed at compile time
# (``folded``), and the positions of a value that hold a mask fill (``mask_pattern``).
CONCRETE_KEY, MASK_KEY = "autoscale_concrete", "autoscale_mask"


# A fill of at least this magnitude (or infinite) is a mask: -inf, float32's finfo.min (what Hugging
# Face fills attention masks with). Softmax turns it into an exact 0, float16 turns it into -inf as
# intended; it is no magnitude of the data. The moments of a value are of its other entries, and
# where a value holds mask fills is tracked beside them (``MASK_KEY``) for the softmax after it.
MASK_MAGNITUDE = 2.0**100


def folded(n: Node) -> Any:
    """``n``'s value computed now, when its op is in ``FOLDABLE`` and every input is known at
    compile time (an earlier such value, a seeded buffer, a symbolic size at its hint); else None."""
    if n.op not in ("call_function", "call_method") or (op_name(n) or "") not in FOLDABLE:
        return None
    if isinstance(tensor_val(n), torch.Tensor) and numel(n) > CONCRETE_LIMIT:
        return None
    env: dict[Node, Any] = {}
    for a in n.all_input_nodes:
        known = a.meta.get(CONCRETE_KEY)
        if known is None:
            val = tensor_val(a)
            if not isinstance(val, torch.SymInt | int) or isinstance(val, bool):
                return None
            known = int(hint(val))
        env[a] = known

    def plain(x: Any) -> Any:
        return int(hint(x)) if isinstance(x, torch.SymInt) else x

    args = torch.utils._pytree.tree_map(plain, torch.fx.node.map_arg(n.args, env.__getitem__))
    kwargs = torch.utils._pytree.tree_map(plain, torch.fx.node.map_arg(n.kwargs, env.__getitem__))
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
            if n.op == "call_method":
                result = getattr(args[0], str(n.target))(*args[1:], **kwargs)
            else:
                result = n.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # (an argument this cannot stand in for: leave the node to the rules)
        return None
    leaves = torch.utils._pytree.tree_leaves(result)
    if not all(isinstance(x, torch.Tensor | int | float | bool) for x in leaves):
        return None
    return result


def live_moments(t: torch.Tensor) -> Moments:
    """The moments of a known tensor's entries other than mask fills."""
    if t.dtype.is_floating_point:
        t = t[t.isfinite() & (t.abs() < MASK_MAGNITUDE)]
    return Moments.of(t)


def is_mask_value(x: Any) -> bool:
    """Whether ``x`` (a number, or a node known at compile time) is a mask fill (``MASK_MAGNITUDE``)."""
    if isinstance(x, Node):
        x = x.meta.get(CONCRETE_KEY)
        if isinstance(x, torch.Tensor) and x.numel() == 1 and x.dtype.is_floating_point:
            x = float(x)
    return isinstance(x, float | int) and not isinstance(x, bool) and (math.isinf(x) or abs(x) >= MASK_MAGNITUDE)


def known_bool(x: Any) -> torch.Tensor | None:
    """``x``'s value if it is a boolean tensor known at compile time."""
    c = x.meta.get(CONCRETE_KEY) if isinstance(x, Node) else None
    return c if isinstance(c, torch.Tensor) and c.dtype == torch.bool else None


def pattern_of(x: Any) -> torch.Tensor | None:
    """Where ``x`` (a node) holds mask fills, as ``mask_pattern`` found it; None: nowhere, or not known."""
    p = x.meta.get(MASK_KEY) if isinstance(x, Node) else None
    return p if isinstance(p, torch.Tensor) else None


def either(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The union of two mask patterns (None: no pattern; also where the two do not broadcast)."""
    if a is None or b is None:
        return a if b is None else b
    try:
        return torch.logical_or(a, b)
    except RuntimeError:  # (shapes that do not broadcast: not a mask this can follow)
        return None


def mask_pattern(n: Node) -> torch.Tensor | None:
    """Where ``n``'s value holds mask fills, as a boolean tensor broadcastable to it (None: nowhere,
    or not known). Set by a known value with such entries, by ``masked_fill`` or ``where`` with a
    mask fill and a known condition, carried through additions (an additive mask), scalings, casts
    and layout ops."""
    concrete = n.meta.get(CONCRETE_KEY)
    if isinstance(concrete, torch.Tensor):
        if not concrete.dtype.is_floating_point:
            return None
        fills = ~concrete.isfinite() | (concrete.abs() >= MASK_MAGNITUDE)
        return fills if bool(fills.any()) else None
    if n.op not in ("call_function", "call_method"):
        return None
    name, args = op_name(n) or "", list(n.args)
    if name == "masked_fill" and len(args) > 2 and is_mask_value(args[2]):
        return either(pattern_of(args[0]), known_bool(args[1]))
    if name == "where" and len(args) > 2:
        cond = known_bool(args[0])
        if cond is not None and is_mask_value(args[2]):
            return either(pattern_of(args[1]), ~cond)
        if cond is not None and is_mask_value(args[1]):
            return either(pattern_of(args[2]), cond)
        return None
    if name in ("add", "sub", "rsub"):
        return either(pattern_of(args[0]), pattern_of(args[1]) if len(args) > 1 else None)
    if name in ("mul", "div", "truediv") and len(args) > 1 and not isinstance(args[1], Node):
        return pattern_of(args[0])
    if passes_through(n) and args:
        return _carried(n, pattern_of(args[0]))
    return None


def _carried(n: Node, pattern: torch.Tensor | None) -> torch.Tensor | None:
    """A layout op's or a cast's input pattern, for its output: as it is when the shape is kept,
    else the op applied to the pattern (expanded to the input's shape when it is broadcast)."""
    src = n.args[0]
    if pattern is None or not isinstance(src, Node):
        return None
    if shape_of(n) == shape_of(src):
        return pattern
    if math.prod(shape_of(src)) > CONCRETE_LIMIT:
        return None
    env = {a: a.meta.get(CONCRETE_KEY) for a in n.all_input_nodes if a is not src}
    if any(v is None for v in env.values()):
        return None
    full = pattern.expand(tuple(int(s) for s in shape_of(src)))
    env[src] = full
    try:
        args = torch.fx.node.map_arg(n.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(n.kwargs, env.__getitem__)
        if n.op == "call_method":
            out = getattr(args[0], str(n.target))(*args[1:], **kwargs)
        else:
            out = n.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:
        return None
    return out if isinstance(out, torch.Tensor) and out.dtype == torch.bool else None


def row_counts(pattern: torch.Tensor | None, shape: tuple[float, ...], dim: int) -> tuple[tuple[int, float], ...]:
    """The rows along ``dim`` of a value of ``shape`` masked by ``pattern``: (live entries, share of
    the rows) pairs. Without a pattern, every row is whole."""
    length = int(shape[dim])
    if pattern is None or not shape:
        return ((length, 1.0),)
    p = pattern.reshape((1,) * (len(shape) - pattern.dim()) + tuple(pattern.shape))
    dim = dim % len(shape)
    live = (~p).sum(dim) if p.shape[dim] == length else torch.where(p.squeeze(dim), 0, length)
    counts, rows = torch.unique(live.flatten(), return_counts=True)
    total = float(rows.sum())
    return tuple((int(c), float(r) / total) for c, r in zip(counts.tolist(), rows.tolist(), strict=True))
