"""Fold casts that do nothing or cancel, and share duplicate casts.

Rules, each exact (the folded graph computes bit-for-bit the same values):

* a cast to the dtype its input already has is dropped;
* ``cast(cast(x, wide), d)`` where ``x -> wide`` is lossless widening (float16 -> float32, …) is
  ``cast(x, d)``, and just ``x`` when ``d`` is ``x``'s dtype: the pair cancels;
* two casts of the same value to the same dtype become one.

A narrowing cast followed by a widening one (float32 -> float16 -> float32) is a rounding and is
never folded. Runs on the Dynamo graph and on the joint ATen graph: casts are recognized in both
IRs (``graph_utils.cast_of``) and new casts are made in the IR of the cast they replace.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node

from .graph_utils import PROVENANCE_KEY, cast_of, float_dtype, mutated_aliases, provenance
from .manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["fold_casts", "is_lossless"]

PASS = "fold_casts"

_WIDER: dict[torch.dtype, frozenset[torch.dtype]] = {
    torch.float16: frozenset({torch.float32, torch.float64}),
    torch.bfloat16: frozenset({torch.float32, torch.float64}),
    torch.float32: frozenset({torch.float64}),
}


def is_lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every ``src`` value is exactly representable in ``dst``."""
    return src == dst or dst in _WIDER.get(src, frozenset())


def fold_casts(gm: GraphModule, cfg: Config) -> PassResult:
    """Fold no-op and cancelling casts, and merge duplicates (see the module docstring)."""
    graph = gm.graph
    counts: Counter[str] = Counter()
    seen: dict[tuple[Node, torch.dtype], Node] = {}
    mutated = mutated_aliases(graph)  # a cast of these is a snapshot: leave it where it is
    for node in list(graph.nodes):
        cast = cast_of(node)
        if cast is None or node in mutated or cast[0] in mutated:
            continue
        src, dtype = cast
        inner = cast_of(src)
        widened = inner is not None and _widens(inner[0], src)
        target = inner[0] if inner is not None and widened else src
        if float_dtype(target) == dtype:
            if not _exposes_input(node, target):
                node.replace_all_uses_with(target)
                counts["cancelled" if widened else "noop"] += 1
            continue
        if widened:
            node = _recast(graph, node, target)
            counts["shortened"] += 1
        if (target, dtype) in seen:
            node.replace_all_uses_with(seen[(target, dtype)])
            counts["merged"] += 1
        else:
            seen[(target, dtype)] = node
    erased = _erase_dead_casts(gm)
    return PassResult(gm, modified=erased > 0, counts={**counts, "erased": erased})


def _widens(x: Node, widened: Node) -> bool:
    src, dst = float_dtype(x), float_dtype(widened)
    return src is not None and dst is not None and is_lossless(src, dst)


def _recast(graph: torch.fx.Graph, cast: Node, origin: Node) -> Node:
    """``cast`` applied to ``origin`` directly, built in the IR of ``cast``; it takes over the users."""
    with graph.inserting_after(cast):
        direct = graph.create_node(cast.op, cast.target, (origin, *cast.args[1:]), dict(cast.kwargs))
    direct.meta.update({k: v for k, v in cast.meta.items() if k != PROVENANCE_KEY})
    provenance(direct, PASS, f"{cast.args[0]} widened {origin.name} losslessly: cast it directly",
               created=True)
    cast.replace_all_uses_with(direct)
    return direct


def _exposes_input(cast: Node, src: Node) -> bool:
    """Folding ``cast`` into ``src`` would make a graph output alias a graph input."""
    return src.op == "placeholder" and any(u.op == "output" for u in cast.users)


def _erase_dead_casts(gm: GraphModule) -> int:
    erased = 0
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and cast_of(node) is not None:
            gm.graph.erase_node(node)
            erased += 1
    return erased
