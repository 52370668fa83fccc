"""The precision pass: paint every op low precision or float32, then insert the casts.

Painting follows TensorFlow's auto-mixed-precision algorithm (docs/design.md#precision), over the tables in
``op_tables``:

1. *allow* ops (GEMMs, convolutions) are low precision;
2. *deny* ops (and unknown and explicit-cast ops) are float32, and so is every infer/clear op on a
   forward path from one of them to a deny or infer op: the downstream effects of a sensitive op
   (``exp(x) * y``) stay float32 too;
3. the remaining infer/clear ops that lie *between* low-precision ops (downstream of one and
   upstream of another) become low precision, so that no value bounces float16 → float32 → float16;
4. the remaining clear ops connected to low-precision ops through clear ops become low precision
   (data movement is exact, and moving half the bytes is cheaper).

Values ``predict_overflow`` marked as beyond float16's range (predicted, or promoted at run time)
are float32 sources like deny ops, and so is every op that would read one in low precision.

Then one cast is inserted per producer and dtype, shared by all consumers that need it. Parameters
stay float32 (master weights) and are cast inside the graph, so autograd returns float32 gradients.
Graph outputs keep their dtypes. Values mutated in place (which ``remove_inplace`` could not make
functional) keep their dtype with everything aliasing them, and are cast right before each reader,
since a shared cast could be read after the mutation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.fx import Graph, GraphModule, Node

from autoscale.overflow import OVERFLOW_REASON

from ..graph_utils import (
    dtype_name,
    float_dtype,
    insert_cast,
    mutated_aliases,
    op_name,
    provenance,
    retyped,
    sparse_gradient,
    tensor_val,
)
from ..manager import PassResult
from ..op_tables import CREATION, Category, category_of, deny_reason
from .predict_overflow import FORWARD_KEY

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["convert_precision"]

PASS = "convert_precision"
_CALLS = ("call_function", "call_method", "call_module")
_FP32 = torch.float32


@dataclass(frozen=True)
class _Paint:
    """The decision for one op: compute in low precision or not, and why."""

    low: bool
    category: Category
    reason: str


def convert_precision(gm: GraphModule, cfg: Config) -> PassResult:
    """Paint the graph and insert casts (see the module docstring)."""
    graph = gm.graph
    pinned = mutated_aliases(graph)
    paint = _paint_in_range(graph, cfg, pinned)
    for node, decision in paint.items():
        dtype = cfg.dtype if decision.low else _orig_dtype(node)
        provenance(node, PASS, decision.reason, category=decision.category.value,
                   precision=dtype_name(dtype))
    casts = _insert_casts(graph, paint, pinned, cfg.dtype)
    for node, decision in paint.items():  # their inputs arrive in low precision now: so do they
        if decision.low:
            node.meta["val"] = retyped(tensor_val(node), cfg.dtype)
    low = sum(d.low for d in paint.values())
    return PassResult(gm, modified=casts > 0, counts={"ops": len(paint), "low": low, "casts": casts})


# ----------------------------------------------------------------------------------- painting


def _paint_in_range(graph: Graph, cfg: Config, pinned: set[Node]) -> dict[Node, _Paint]:
    """Paint, keeping in float32 the values ``predict_overflow`` marked as beyond float16's range
    and every op that would read one of them in low precision (a cast into float16 would make it
    inf). Keeping a reader in float32 can make its neighbours float32 in turn, so this repaints
    until no low-precision op reads a marked value; the forced set only grows, so it ends."""
    big = {n for n in graph.nodes if FORWARD_KEY in n.meta}
    forced = {n: "sparse gradient: autograd cannot pass it back through a cast"
              for n in graph.nodes if sparse_gradient(n)}
    paint = _paint(graph, cfg, pinned, forced)
    while True:
        # a marked value float32 keeps anyway (a norm's statistics) keeps its own reason
        wanted = {n: str(n.meta[FORWARD_KEY]) for n in big if n in paint and paint[n].low}
        wanted.update({n: f"{OVERFLOW_REASON}: reads {a.name}, which float16 cannot hold"
                       for n, d in paint.items() if d.low and n not in big for a in n.all_input_nodes if a in big})
        if wanted.keys() <= forced.keys():
            return paint
        forced.update(wanted)
        paint = _paint(graph, cfg, pinned, forced)


def _paint(graph: Graph, cfg: Config, pinned: set[Node], forced: dict[Node, str]) -> dict[Node, _Paint]:
    nodes = list(graph.nodes)
    low_name = dtype_name(cfg.dtype)
    category = {n: _category(n, cfg) for n in nodes if n.op in _CALLS and _floating(n)}
    paintable = {n for n in category if n not in pinned and n not in forced and _orig_dtype(n) == _FP32}
    allow = {n for n in paintable if category[n] is Category.ALLOW}
    deny_src = {n for n in paintable if category[n] in (Category.DENY, Category.UNKNOWN, Category.FIXED)}
    deny_src |= forced.keys() & category.keys()
    flow = {n for n in paintable if category[n] in (Category.INFER, Category.CLEAR)}

    # 2. float32 spreads forward from deny ops through infer/clear ops that lead to deny/infer ops.
    origin: dict[Node, Node] = {}
    for n in nodes:
        if n in flow:
            src = next((p for p in n.all_input_nodes if p in deny_src or p in origin), None)
            if src is not None:
                origin[n] = origin.get(src, src)
    leads_on: set[Node] = set()
    for n in reversed(nodes):
        if n in flow and (category[n] is Category.INFER
                          or any(u in deny_src or u in leads_on for u in n.users)):
            leads_on.add(n)
    free = flow - (origin.keys() & leads_on)

    # 3. infer/clear ops between low-precision ops.
    below: set[Node] = set()
    for n in nodes:
        if n in free and any(p in allow or p in below for p in n.all_input_nodes):
            below.add(n)
    above: set[Node] = set()
    for n in reversed(nodes):
        if n in free and any(u in allow or u in above for u in n.users):
            above.add(n)
    between = below & above

    # 4. clear ops connected to low-precision ops through clear ops.
    connected: set[Node] = set()
    queue = deque(allow | between)
    while queue:
        for m in (*(n := queue.popleft()).all_input_nodes, *n.users):
            if m in free and category[m] is Category.CLEAR and m not in between and m not in connected:
                connected.add(m)
                queue.append(m)

    paint: dict[Node, _Paint] = {}
    for n, c in category.items():  # topological order: a getitem sees its producer's decision
        producer = n.args[0] if op_name(n) == "getitem" and n.args else None
        if isinstance(producer, Node) and producer in paint and not isinstance(tensor_val(producer), torch.Tensor):
            same = paint[producer].low
            paint[n] = _Paint(same, c, f"element of a {low_name if same else 'float32'} result")
        elif n in allow:
            paint[n] = _Paint(True, c, f"allow list: fast and safe in {low_name}")
        elif n in between:
            paint[n] = _Paint(True, c, f"between {low_name} ops")
        elif n in connected:
            paint[n] = _Paint(True, c, f"data movement next to {low_name} ops")
        elif n in forced:
            paint[n] = _Paint(False, c, forced[n])
        else:
            paint[n] = _Paint(False, c, _keep_reason(n, c, pinned, origin, low_name))
    return paint


def _category(n: Node, cfg: Config) -> Category:
    if n.op == "call_module":  # only when Dynamo does not inline modules: opaque to the tables
        return Category.UNKNOWN
    category = category_of(op_name(n) or "", cfg.op_overrides)
    if category is Category.META and isinstance(tensor_val(n), torch.Tensor):
        return Category.CLEAR  # a tensor attribute (x.T, x.mT): a view of x, not metadata
    if category is Category.FIXED and op_name(n) == "to" and not _names_dtype(n):
        return Category.CLEAR  # x.to(device) moves data; only a dtype in the call fixes a precision
    return category


def _names_dtype(n: Node) -> bool:
    """Whether a ``to`` call names its dtype, directly or as another tensor's."""
    return any(isinstance(a, torch.dtype | Node) for a in (*n.args[1:], *n.kwargs.values()))


def _keep_reason(n: Node, c: Category, pinned: set[Node], origin: dict[Node, Node], low_name: str) -> str:
    if n in pinned:
        return "aliases a tensor mutated in place"
    if _orig_dtype(n) != _FP32:
        return f"computes in {dtype_name(_orig_dtype(n))} in the model"
    if c is Category.DENY:
        return f"deny list: {deny_reason(op_name(n) or '')}"
    if c is Category.UNKNOWN:
        return "unknown op: not in the precision tables (classify it with Config.allow/deny/infer/clear)"
    if c is Category.FIXED:
        if op_name(n) in CREATION:
            return "creates a tensor in the model's dtype"
        return "explicit dtype conversion in the model"
    if n in origin:
        return f"downstream of float32 op {origin[n].name}"
    return f"not between {low_name} ops"


def _floating_dtypes(n: Node) -> set[torch.dtype]:
    val = tensor_val(n)
    vals = val if isinstance(val, tuple | list) else (val,)
    return {v.dtype for v in vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}


def _floating(n: Node) -> bool:
    """Whether ``n`` produces floating-point data (a tensor, or a tuple holding one)."""
    return bool(_floating_dtypes(n))


def _orig_dtype(n: Node) -> torch.dtype | None:
    """The floating dtype the model computes ``n`` in (for a tuple, the one its elements share)."""
    dtypes = _floating_dtypes(n)
    return dtypes.pop() if len(dtypes) == 1 else None


# ------------------------------------------------------------------------------ cast insertion


def _insert_casts(graph: Graph, paint: dict[Node, _Paint], pinned: set[Node], low: torch.dtype) -> int:
    """Give every op (and the output) its inputs in the dtype it computes in; count the casts.

    A consumer computing in low precision wants its float32 inputs in ``low``; any other consumer
    wants each input in the dtype the model had, so regions kept in float32 compute exactly as the
    model wrote them and the outputs keep their dtypes.
    """
    orig = {n: float_dtype(n) for n in graph.nodes}
    shared: dict[tuple[Node, torch.dtype], Node] = {}
    count = 0
    for n in list(graph.nodes):
        if n.op not in (*_CALLS, "output") or category_of(op_name(n) or "") is Category.META:
            continue
        computes_low = n in paint and paint[n].low
        for a in dict.fromkeys(n.all_input_nodes):
            has = orig.get(a)
            if has is None:
                continue
            if a in paint and paint[a].low and has == _FP32:
                has = low
            wanted = low if computes_low and orig[a] == _FP32 else orig[a]
            if wanted == has:
                continue
            assert wanted is not None
            cast = shared.get((a, wanted))
            if cast is None:
                cast = insert_cast(graph, a, wanted, before=n)
                provenance(cast, PASS, f"{dtype_name(has)} -> {dtype_name(wanted)} for {n.name}", created=True)
                count += 1
                if a not in pinned:  # a tensor mutated in place is cast before each reader
                    shared[(a, wanted)] = cast
            n.replace_input_with(a, cast)
    return count
