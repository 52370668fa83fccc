"""Take a full max over a value's source, not over a rearranged copy of it.

A rescale point measures the largest magnitude of the gradient it scales, ``amax(abs(g))`` over
every element, and so does each forward overflow check of the value it watches. Often that value
is its source rearranged: the gradient of an attention block's fused QKV projection is
``view(clone(permute(view(cat(dq, dk, dv)))))``. Inductor loops a reduction in the order of the
value it reduces, so it read the source through the permutation, one scalar at a time with
integer divisions in every index. On the quick transformer block of ``benchmarks.overhead``,
reading the source instead halved that point's kernel.

A max over every element depends neither on their order nor on repeats, and elementwise ops
commute with any rearrangement. So ``amax(u(r(x)))`` is exactly ``amax(u(x))``, nan included (a
nan anywhere makes either nan), where ``r`` is a chain of rearrangements (``op_tables.REARRANGING``:
views, permutes, clones, expands) and ``u`` one of casts (``graph_utils.cast_of``, in either IR),
unary elementwise ops (``UNARY_ELEMENTWISE``: ``abs``) and the multiply by a scale's reciprocal
that brings a point's magnitudes to unit scale, in any interleaving. The pass gives each such
reduction ``u(x)`` and all of ``x``'s dimensions, and Inductor reads ``x`` in its own order. A max
handed to the fold as a one-element vector (``autoscale.measure.largest``: every dimension of an
``unsqueeze(·, 0)`` but the first) stays one, over ``unsqueeze(u(x), 0)``.

Only where the chain changes the elements' order (``op_tables.REORDERING``: a permute or a
transpose). Through views alone the reduction already reads in order, and it shares its loop with
the op that reads the same view: moved to the source, it took a loop of its own, a second pass over
the value (slower than the shared loop). Runs on the joint graph, where the points' backward and
the checks are ATen ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node

from ..graph_utils import PROVENANCE_KEY, cast_of, new_fake_call, op_name, provenance, tensor_val
from ..manager import PassResult
from ..op_tables import REARRANGING, REORDERING, UNARY_ELEMENTWISE

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["reduce_at_source"]

PASS = "reduce_at_source"
_AMAX = torch.ops.aten.amax.default


def reduce_at_source(gm: GraphModule, cfg: Config) -> PassResult:
    """Point every full ``amax`` over a rearranged value at the value's source (module docstring)."""
    graph = gm.graph
    amaxes = [n for n in graph.find_nodes(op="call_function", target=_AMAX) if _reduces_all(n)]
    if not amaxes:
        return PassResult(gm, modified=False, counts={"reductions": 0})
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
    if fake_mode is None:  # (no fake values to type the copies with: leave the graph as it is)
        return PassResult(gm, modified=False, counts={"reductions": 0})
    moved = 0
    for amax in amaxes:
        source, unary = _source_of(amax.args[0])
        if source is None:
            continue
        old = amax.args[0]
        value = source
        with graph.inserting_before(amax):
            for op in unary:  # (source first)
                value = _copy_onto(graph, op, value, fake_mode)
            if _dim(amax) == 1:  # (``largest``'s form: over all but a leading unit dimension)
                value = _unsqueezed(graph, value, fake_mode)
                amax.args = (value, list(range(1, _dim(value))), False)
            else:
                amax.args = (value, [], False)
        _erase_unused(graph, old)
        moved += 1
    return PassResult(gm, modified=moved > 0, counts={"reductions": moved})


def _reduces_all(amax: Node) -> bool:
    """Whether ``amax`` reduces every element of its input to one value: to a 0-dim one, or to
    the one-element vector of ``autoscale.measure.largest`` (every dimension but a leading unit one
    of an ``unsqueeze``)."""
    val, x = tensor_val(amax), amax.args[0]
    if not isinstance(val, torch.Tensor) or not isinstance(x, Node):
        return False
    if val.dim() == 0:
        return True
    dims = amax.args[1]
    return (tuple(val.shape) == (1,) and op_name(x) == "unsqueeze" and isinstance(dims, (list, tuple))
            and all(isinstance(d, int) for d in dims)
            and sorted(d % _dim(x) for d in dims if isinstance(d, int)) == list(range(1, _dim(x))))


def _dim(node: Node) -> int:
    """The number of dimensions of ``node``'s value (a tensor)."""
    val = tensor_val(node)
    assert isinstance(val, torch.Tensor)
    return val.dim()


def _source_of(value: Node) -> tuple[Node | None, list[Node]]:
    """The source under the chain of rearrangements and unary elementwise ops that makes
    ``value`` (None unless the chain changes the elements' order), and the chain's unary ops,
    source first."""
    unary: list[Node] = []
    reordered = False
    node: Any = value
    while isinstance(node, Node) and node.op == "call_function" and node.args and isinstance(node.args[0], Node):
        name = op_name(node)
        if cast_of(node) is not None or (name in UNARY_ELEMENTWISE and len(node.args) == 1) or _to_unit_scale(node):
            unary.append(node)
        elif name in REARRANGING and _same_dtype(node, node.args[0]):
            reordered |= name in REORDERING
        else:
            break
        node = node.args[0]
    return (node if reordered else None), unary[::-1]


def _to_unit_scale(node: Node) -> bool:
    """Whether ``node`` multiplies its first input by the reciprocal of one number: a point's
    magnitudes brought to unit scale (``autoscale.measure.scale_and_measure``). Elementwise, so it
    commutes with every rearrangement as a unary op does. Not any multiply by a number: a
    leaving point's reduction reads its output, ``g * factor``, which Inductor writes over ``g``
    only while it is ``g``'s last reader; moved under that multiply, the reduction would read ``g``
    too, and the output would take a buffer of its own."""
    if op_name(node) != "mul" or len(node.args) != 2 or node.kwargs:
        return False
    factor = node.args[1]
    return (isinstance(factor, Node) and factor.target is torch.ops.aten.reciprocal.default
            and isinstance(val := tensor_val(factor), torch.Tensor) and val.dim() == 0)


def _same_dtype(node: Node, source: Node) -> bool:
    out, inp = tensor_val(node), tensor_val(source)
    return isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.dtype == inp.dtype


def _copy_onto(graph: Graph, op: Node, value: Node, fake_mode: Any) -> Node:
    """``op`` applied to ``value`` instead of its own input, at the insert point."""
    node = new_fake_call(graph, fake_mode, op.target, (value, *op.args[1:]), dict(op.kwargs))
    return _made_like(op, node, "a full max read from the source of a rearranged value, in its own order")


def _unsqueezed(graph: Graph, value: Node, fake_mode: Any) -> Node:
    """``value`` with a leading unit dimension, at the insert point."""
    node = new_fake_call(graph, fake_mode, torch.ops.aten.unsqueeze.default, (value, 0))
    return _made_like(value, node, "the source under a unit dimension, for a max handed to the fold as a vector")


def _made_like(like: Node, node: Node, why: str) -> Node:
    """``node`` with ``like``'s metadata but for its value, and this pass's provenance: the
    autograd sequence number and module stack among it, by which the graph diff and AOTAutograd
    attribute ``node`` to the rescale point or check ``like`` belongs to."""
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta", PROVENANCE_KEY)})
    provenance(node, PASS, why, created=True)
    return node


def _erase_unused(graph: Graph, node: Any) -> None:
    """Erase ``node`` and the chain under it as far as nothing else reads them."""
    while isinstance(node, Node) and not node.users and node.op == "call_function":
        below = node.args[0] if node.args else None
        graph.erase_node(node)
        node = below
