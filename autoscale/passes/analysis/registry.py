"""The rule registry: an op's forward rule (the moments of its value from its inputs') and its
backward rule (the moments of its inputs' gradients from its output's), keyed by op name.

A rule module registers each rule with a decorator right above it, the forward and backward rules
of an op side by side::

    @forward("linear")
    def _linear(n: Node, v: Values) -> Moments | None: ...

    @backward("linear")
    def _linear_backward(n: Node, g: Moments, v: Values) -> dict[Node, Moments | None]: ...

An op without a forward rule has an unknown value; one without a backward rule passes unknown
gradients to its inputs (``unknown_gradients``): never a crash. The tables are filled when the
rule modules are imported (``analysis/__init__.py`` imports them all) and read-only after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TypeVar

from torch.fx import Node

from ..graph_utils import cast_of, op_name
from .moments import Moments

__all__ = ["BACKWARD", "CAST", "FORWARD", "BackwardRule", "ForwardRule", "Values", "backward", "backward_rule",
           "forward", "forward_rule", "unknown_gradients"]

Values = dict[Node, Moments | None]
"""The moments of the nodes' values, as the rules read them (None: unknown)."""
ForwardRule = Callable[[Node, Values], Moments | None]
BackwardRule = Callable[[Node, Moments, Values], dict[Node, Moments | None]]

# The key a cast is looked up by, whatever its op's name (``graph_utils.cast_of``: ``x.to(dtype)``,
# ``x.half()``, ``convert_element_type``...).
CAST = "<cast>"

_FORWARD: dict[str, ForwardRule] = {}
_BACKWARD: dict[str, BackwardRule] = {}
FORWARD: Mapping[str, ForwardRule] = MappingProxyType(_FORWARD)
BACKWARD: Mapping[str, BackwardRule] = MappingProxyType(_BACKWARD)

_F = TypeVar("_F", bound=ForwardRule)
_B = TypeVar("_B", bound=BackwardRule)


def forward(*ops: str) -> Callable[[_F], _F]:
    """Register the decorated function as the forward rule of ``ops``."""
    def register(rule: _F) -> _F:
        _refuse_twice(_FORWARD, ops)
        _FORWARD.update(dict.fromkeys(ops, rule))
        return rule

    return register


def backward(*ops: str) -> Callable[[_B], _B]:
    """Register the decorated function as the backward rule of ``ops``."""
    def register(rule: _B) -> _B:
        _refuse_twice(_BACKWARD, ops)
        _BACKWARD.update(dict.fromkeys(ops, rule))
        return rule

    return register


def _refuse_twice(table: Mapping[str, object], ops: tuple[str, ...]) -> None:
    """Two rules for one op: which one ran would depend on the order the modules are imported in."""
    for op in ops:
        if op in table:
            raise ValueError(f"{op!r} has a rule already: {table[op]!r}")


def forward_rule(n: Node) -> ForwardRule | None:
    """The forward rule of ``n``'s op (a cast's: ``CAST``'s), or None."""
    return _FORWARD.get(CAST if cast_of(n) is not None else op_name(n) or "")


def backward_rule(n: Node) -> BackwardRule | None:
    """The backward rule of ``n``'s op (a cast's: ``CAST``'s), or None."""
    return _BACKWARD.get(CAST if cast_of(n) is not None else op_name(n) or "")


def unknown_gradients(n: Node, v: Values) -> dict[Node, Moments | None]:
    """What an op without a (applicable) backward rule passes back: its inputs' gradients are unknown."""
    return {a: None for a in n.all_input_nodes if v.get(a) is not None or a.op == "placeholder"}
