"""What the analysis reads off a node besides moments: its sizes, symbolic ones at their hints, and
whether its value is its input's (a layout op or a cast)."""

from __future__ import annotations

import math
from typing import Any

import sympy
import torch
from torch.fx import Node

from ..graph_utils import cast_of, op_name, tensor_val
from ..op_tables import PASS_THROUGH

__all__ = ["element_count", "hint", "numel", "passes_through", "shape_of"]


def hint(size: Any) -> float:
    """A size as a number; symbolic sizes are sympy expressions evaluated with their hints."""
    if isinstance(size, torch.SymInt):
        if size.node.hint is not None:
            return float(size.node.hint)
        env = size.node.shape_env
        values = getattr(env, "backed_var_to_val", None) or env.var_to_val
        expr: sympy.Expr = size.node.expr
        return float(expr.subs(values))
    return float(size)


def element_count(n: Node) -> float:
    """How many elements ``n``'s tensor has (symbolic sizes at their hints; 1 for a non-tensor)."""
    return numel(n)


def numel(n: Any) -> float:
    """``element_count`` of a node, or of anything else: 1."""
    val = tensor_val(n) if isinstance(n, Node) else None
    if not isinstance(val, torch.Tensor):
        return 1.0
    return math.prod(hint(s) for s in val.shape)


def shape_of(n: Any) -> tuple[float, ...]:
    """A node's tensor's sizes (symbolic ones at their hints); () for a non-tensor."""
    val = tensor_val(n) if isinstance(n, Node) else None
    return tuple(hint(s) for s in val.shape) if isinstance(val, torch.Tensor) else ()


def passes_through(n: Node) -> bool:
    """Whether ``n``'s value has its input's moments: a layout op, a copy, a cast (``PASS_THROUGH``)."""
    return (op_name(n) or "") in PASS_THROUGH or cast_of(n) is not None
