"""Write out each measured rescale point's backward, which the trace took as one op.

AOTAutograd traces a compiled backward op by op, each through functionalization, the proxy tracer
and fake tensors. A measured point's backward (``autoscale.measure.measured_point``) is about 20
ops (two scale reads, the scaling, its check, one reduction, the record), so traced so the points
were a third to a half of a model's joint trace: a 2-layer Llama's 73 points, about 1,500 of the
2,300 ops its joint trace recorded. The trace takes each one as a single op instead,
``autoscale::point``, and this pass writes the ops out, so that the passes after it and the
executor see what the trace would have recorded.

A point's ops depend on the gradient's metadata, the point's flags and its rows, and on its rows
only through their order, their equality and which is the loss row (``LOSS_ROW``): the code reads
the scales of a set of rows in order (``set_scale``), compares rows, and writes each measurement to
a cell ``row * NUM_STATS + column`` (``record``). So the ops are traced once per *signature* (the
gradient's shape, strides, dtype and device, the flags, and the rows numbered 1, 2, ... in order,
the loss row kept), with the decompositions the trace applied, and each point of that signature
gets a copy with its own rows put back, into ``set_scale``'s rows and ``record``'s cells, the only
arguments that hold rows. Repeated layers share their points' signatures. A trace costs what the
fake tensors' ops cost: of static shapes it is recorded by a dispatch mode in a fake mode of its own
(``_Recorder``); of symbolic shapes, by ``make_fx`` in the graph's fake mode, whose symbols they are.
Written out so, the points cost a compile about half of what AOTAutograd's trace of their ops did
(docs/results/compile_time_models.md).

Only a measured point that does not launch the fused kernel is one op in the trace
(``autoscale.ops``): the kernel is a ``triton_op``, which AOTAutograd's functionalization writes out
as its Triton kernel for Inductor.

A point is left as the op (which computes the same, eagerly) where its written-out output would not
be laid out as the op's output was traced (``empty_like`` of the gradient): the nodes after it were
traced with that layout.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import map_arg
from torch.utils._python_dispatch import TorchDispatchMode, autograd_would_have_decomposed
from torch.utils._pytree import tree_map_only

from autoscale.measure import measured_point
from autoscale.ops import point, set_scale
from autoscale.protocol import FORMS, LOSS_ROW, NUM_STATS

from ..graph_utils import provenance
from ..manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["expand_points"]

PASS = "expand_points"
_RECORD = torch.ops.autoscale.record.default
_INHERITED = ("partitioner_tag", "seq_nr", "autograd_backward", "fwd_nn_module_stack", "fwd_source_fn_stack",
              "stack_trace")
"""What each written-out node keeps of the point's meta: what the trace gives every op of a backward."""
_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
_NOT_DECOMPOSED = (torch.ops.aten.size.default, torch.ops.aten.stride.default, torch.ops.aten.storage_offset.default)


def expand_points(gm: GraphModule, cfg: Config) -> PassResult:
    """Replace every ``autoscale::point`` node by the ops it computes (see the module docstring)."""
    graph = gm.graph
    points = graph.find_nodes(op="call_function", target=point)
    if not points:
        return PassResult(gm, modified=False, counts={"points": 0})
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
    assert fake_mode is not None  # (a joint graph's placeholders are fake)
    traced: dict[Any, GraphModule] = {}
    static_mode = FakeTensorMode()  # (static shapes are traced in a mode of their own: ``_trace``)
    written = 0
    # (the partitioner runs the joint stage in the graph's fake mode; a backward is traced without grad)
    with unset_fake_temporarily(), torch.no_grad():
        for node in points:
            written += _expand(graph, node, traced, static_mode, fake_mode)
    kept = len(points) - written
    return PassResult(gm, modified=written > 0, counts={"points": written, "signatures": len(traced), "kept": kept})


def _expand(graph: Graph, node: Node, traced: dict[Any, GraphModule], static_mode: FakeTensorMode,
            fake_mode: FakeTensorMode) -> bool:
    """Write the point ``node`` out (``_replace``), with the ops traced for its signature."""
    grad, scales, stats, *sets = node.args[:6]
    flags, decompositions = node.args[6:11], node.args[11]
    assert isinstance(grad, Node) and isinstance(scales, Node) and isinstance(stats, Node)
    numbered, rows = _numbered(cast("list[list[int]]", sets))
    key = (*(_layout(n.meta["val"]) for n in (grad, scales, stats)), numbered, tuple(flags), decompositions)
    if key not in traced:
        traced[key] = _trace([n.meta["val"] for n in (grad, scales, stats)], numbered, flags,
                             _decompositions(cast(str, decompositions)), static_mode)
    return _replace(graph, node, traced[key], rows, fake_mode)


def _decompositions(name: str) -> dict[Any, Any] | None:
    """The decompositions the trace applied (``autoscale.ops.DECOMPOSITIONS``): Inductor's, or none."""
    if name == "none":
        return None
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _layout(val: Any) -> tuple[Any, ...]:
    """What a point's traced ops depend on of a value: shape, strides, dtype, device (symbolic sizes by
    their expressions, compared without guarding on them)."""
    return (tuple(map(str, val.shape)), tuple(map(str, val.stride())), val.dtype, val.device)


def _numbered(sets: Sequence[Sequence[int]]) -> tuple[tuple[tuple[int, ...], ...], dict[int, int]]:
    """``sets`` of rows with every row but the loss row numbered 1, 2, ... in order, and the map from
    those numbers back to the rows."""
    rows = sorted({r for rs in sets for r in rs} - {LOSS_ROW})
    number = {r: i for i, r in enumerate(rows, start=1)} | {LOSS_ROW: LOSS_ROW}
    return tuple(tuple(number[r] for r in rs) for rs in sets), {n: r for r, n in number.items()}


def _trace(vals: list[Any], numbered: tuple[tuple[int, ...], ...], flags: Sequence[Any],
           decompositions: dict[Any, Any] | None, static_mode: FakeTensorMode) -> GraphModule:
    """The ops of a point of this signature (its rows ``numbered``), traced on fake values laid out
    as ``vals``. Of symbolic shapes, with ``make_fx`` in their fake mode. Of static shapes, by
    ``_Recorder`` in ``static_mode``, a fake mode without symbolic shapes, whose ops cost half of
    those of a graph's mode: the nodes written out then get values of their own (``_fresh``)."""
    unscale, moments, fused, blame, form = flags

    def backward(grad: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out_rows, in_rows, record_rows = numbered
        return measured_point(grad, scales, stats, out_rows, in_rows, record_rows, unscale, moments, fused,
                              blame=blame, form=FORMS[form])

    if any(isinstance(s, torch.SymInt) for v in vals for s in (*v.shape, *v.stride())):
        ops = make_fx(backward, tracing_mode="fake", decomposition_table=decompositions)(*vals)
    else:
        ops = GraphModule({}, Graph())
        recorder = _Recorder(ops.graph, decompositions or {})
        inputs = [recorder.placeholder(name, _fresh(v, static_mode))
                  for name, v in zip(("grad", "scales", "stats"), vals, strict=True)]
        with unset_fake_temporarily(), static_mode, recorder:
            out, recorded = backward(*inputs)
        ops.graph.output((recorder.node_of(out), None if recorded is None else recorder.node_of(recorded)))
    for alias in [n for n in ops.graph.nodes if n.target in _ALIASES]:
        # (a point computes no alias: these are the ``detach`` a factory call's result takes here, outside
        # AOTAutograd's trace, and Inductor's decomposition of it)
        alias.replace_all_uses_with(alias.args[0])
        ops.graph.erase_node(alias)
    ops.graph.eliminate_dead_code()  # (as AOTAutograd's trace is: a bias's unscale point counts no zeros)
    return ops


class _Recorder(TorchDispatchMode):
    """Records the ATen ops run under it, on fake tensors of static shapes, into ``graph``, with
    their values: ``make_fx`` without its proxies, which cost two thirds of its time. Decomposes
    as ``make_fx`` does: by ``decompositions``, then an op's own ``CompositeImplicitAutograd``
    decomposition."""

    def __init__(self, graph: Graph, decompositions: dict[Any, Any]) -> None:
        super().__init__()
        self.graph = graph
        self.decompositions = decompositions
        self.nodes: dict[int, Node] = {}
        self.held: list[torch.Tensor] = []  # (the ids in ``nodes`` stay theirs)

    def placeholder(self, name: str, val: torch.Tensor) -> torch.Tensor:
        node = self.graph.placeholder(name)
        node.meta["val"] = val
        self.nodes[id(val)] = node
        self.held.append(val)
        return val

    def node_of(self, t: torch.Tensor) -> Node:
        return self.nodes[id(t)]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:
            return func(*args, **kwargs)
        if func in self.decompositions:
            with self:
                r = self.decompositions[func](*args, **kwargs)
            if r is not NotImplemented:
                return r
        if func not in _NOT_DECOMPOSED and autograd_would_have_decomposed(func, (*args, *kwargs.values())):
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        out = func(*args, **kwargs)
        node_args, node_kwargs = tree_map_only(torch.Tensor, self.node_of, (args, kwargs))
        node = self.graph.create_node("call_function", func, node_args, node_kwargs,
                                      name=func.overloadpacket.__name__)  # (named as the trace names ops)
        node.meta["val"] = out
        if isinstance(out, torch.Tensor):
            self.nodes[id(out)] = node
            self.held.append(out)
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                item = self.graph.call_function(operator.getitem, (node, i))
                item.meta["val"] = o
                self.nodes[id(o)] = item
                self.held.append(o)
        return out


def _replace(graph: Graph, node: Node, ops: GraphModule, rows: dict[int, int], fake_mode: FakeTensorMode
             ) -> bool:
    """Write ``ops`` out in place of the point ``node``, with its ``rows``, each node with a fake value
    of its own in the graph's ``fake_mode``. False, and nothing changed, where the point is left as
    it is."""
    users = list(node.users)
    if not all(u.target is operator.getitem and isinstance(u.args[1], int) for u in users):
        return False
    (output,) = ops.graph.find_nodes(op="output")
    out, recorded = output.args[0]
    if _layout(out.meta["val"]) != _layout(node.meta["val"][0]):
        return False
    env: dict[Node, Any] = dict(zip(ops.graph.find_nodes(op="placeholder"), node.args[:3], strict=True))
    inherited = {k: node.meta[k] for k in _INHERITED if k in node.meta}
    with graph.inserting_before(node):
        for t in ops.graph.nodes:
            if t.op != "call_function":
                continue
            args = map_arg(t.args, env.__getitem__)
            if t.target is set_scale:
                args = (args[0], [rows[r] for r in args[1]])
            elif t.target is _RECORD:
                args = (args[0], args[1], [rows[c // NUM_STATS] * NUM_STATS + c % NUM_STATS for c in args[2]],
                        *args[3:])
            new = graph.create_node("call_function", t.target, args, map_arg(t.kwargs, env.__getitem__),
                                    name=t.name)
            new.meta.update(inherited)
            new.meta["val"] = _fresh(t.meta["val"], fake_mode)
            if isinstance(t.target, torch._ops.OpOverload):
                new.meta["original_aten"] = t.target
            provenance(new, PASS, "a measured rescale point's backward, written out")
            env[t] = new
    results = (env[out], env[recorded] if recorded is not None else cast(Node, node.args[2]))
    for user in users:
        user.replace_all_uses_with(results[cast(int, user.args[1])])
        graph.erase_node(user)
    graph.erase_node(node)
    return True


def _fresh(val: Any, fake_mode: FakeTensorMode) -> Any:
    """A fake tensor of its own laid out as ``val``, for a copy of a traced node (no two nodes share
    a value); other values (symbolic sizes) as they are."""
    if not isinstance(val, torch.Tensor):
        return val
    if any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride())):
        with fake_mode:
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    # (static: a meta tensor wrapped as the fake mode's, without a dispatch through the mode)
    meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    return FakeTensor(fake_mode, meta, val.device)
