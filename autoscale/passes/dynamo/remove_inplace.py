"""Rewrite in-place ops on private intermediates as out-of-place ops.

Why: the precision pass inserts casts, and a cast is a copy taken at one point of the program. If
the tensor it copies is mutated in place afterwards (``nn.ReLU(inplace=True)``, ``x += y``), a
consumer reading the copy would see the value from before the mutation. An in-place op whose
target is an intermediate that nothing aliases (not a graph input, not a view, no view taken of
it) is exactly equivalent to the out-of-place op with later readers of the target reading the
op's result instead; this pass makes that rewrite, so the graph is functional where it matters.
In-place ops it cannot prove private are left alone; the precision pass keeps their whole alias
group in its original dtype.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import GraphModule, Node

from ..graph_utils import MAY_ALIAS, inplace_position, is_inplace, op_name, provenance
from ..manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["remove_inplace"]

PASS = "remove_inplace"

_OUT_OF_PLACE_OPERATORS: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ipow: operator.pow,
}

def remove_inplace(gm: GraphModule, cfg: Config) -> PassResult:
    """Make in-place ops on private intermediates out-of-place (see the module docstring)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    rewritten = 0
    for node in list(graph.nodes):
        target = _out_of_place(node)
        if target is None or not _is_private(node.args[0]):
            continue
        mutated = node.args[0]
        assert isinstance(mutated, Node)
        kwargs = {k: v for k, v in node.kwargs.items() if k != "inplace"}
        args = tuple(False if i == inplace_position(node.target) else a for i, a in enumerate(node.args))
        with graph.inserting_after(node):
            functional = graph.create_node(node.op, target, args, kwargs)
        functional.meta.update(node.meta)
        provenance(functional, PASS, f"{op_name(node)}_ on a private intermediate made out-of-place",
                   created=True)
        node.replace_all_uses_with(functional)
        order[functional] = order[node]
        for user in list(mutated.users):
            if user is not node and user is not functional and order[user] > order[node]:
                user.replace_input_with(mutated, functional)
        graph.erase_node(node)
        rewritten += 1
    return PassResult(gm, modified=rewritten > 0, counts={"rewritten": rewritten})


def _out_of_place(node: Node) -> Any:
    """The out-of-place twin of an in-place call node, or None."""
    if not is_inplace(node) or not node.args or not isinstance(node.args[0], Node):
        return None
    if node.kwargs.get("inplace") is True or inplace_position(node.target) is not None:
        return node.target
    if node.op == "call_method":
        return op_name(node)
    if node.target in _OUT_OF_PLACE_OPERATORS:
        return _OUT_OF_PLACE_OPERATORS[node.target]
    if node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload):
        return getattr(torch, op_name(node) or "", None)
    return None


def _is_private(node: Any) -> bool:
    """An intermediate that no other tensor aliases: safe to stop mutating."""
    return (
        isinstance(node, Node)
        and node.op in ("call_function", "call_method")
        and op_name(node) not in MAY_ALIAS
        and not is_inplace(node)  # the result of x.add_(1) *is* x
        and not any(op_name(u) in MAY_ALIAS for u in node.users)
    )
