"""expand_points: a measured rescale point, traced as one op, written out as the ops it computes."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

import autoscale
from autoscale.measure import measured_point
from autoscale.ops import point, trace_decompositions
from autoscale.passes import PIPELINE, PassSpec, expand_points
from autoscale.protocol import FORMS, NUM_STATS
from tests.models import mlp_case

ROWS = 9


def _without_the_pass() -> tuple[PassSpec, ...]:
    return tuple(PassSpec(p.fn, p.stage, tuple(a for a in p.after if a != "expand_points"), p.last)
                 for p in PIPELINE if p.fn is not expand_points)


def _step(pipeline: tuple[PassSpec, ...], dynamic: bool) -> tuple[list[torch.Tensor], list[dict[str, int]]]:
    torch._dynamo.reset()
    model, (x,), y = mlp_case()
    scaler = autoscale.GradScaler(model)
    backend = autoscale.Backend(autoscale.Config(executor="eager", verify=True), pipeline=pipeline)
    scaler.scale(F.cross_entropy(torch.compile(model, backend=backend, dynamic=dynamic)(x), y)).backward()
    state = scaler._state
    assert state is not None
    counts = [dict(r.counts) for record in backend.records for r in record.passes if r.name == "expand_points"]
    return [state.stats.clone(), state.peaks.clone(), *(p.grad.clone() for p in model.parameters())], counts


def test_a_compiled_model_computes_the_same_with_and_without_the_pass() -> None:
    """An MLP's backward (eager executor, static and symbolic shapes): its statistics, peaks and
    gradients are identical bit for bit whether its points are written out or run as the op; every
    point is written out, and the points of its layers of one shape share their traced ops."""
    for dynamic in (False, True):
        written, counts = _step(PIPELINE, dynamic)
        as_ops, none = _step(_without_the_pass(), dynamic)
        assert none == []
        assert all(torch.equal(a, b) for a, b in zip(written, as_ops, strict=True)), dynamic
        (c,) = counts
        assert c["points"] > 0 and c["kept"] == 0 and c["signatures"] < c["points"], c


def _graph_with_two_points(vals: list[torch.Tensor], first: tuple[Any, ...], second: tuple[Any, ...]) -> GraphModule:
    """A graph of two points of one signature, the second reading the first's statistics."""
    graph = Graph()
    grad, scales, stats = (graph.placeholder(name) for name in ("grad", "scales", "stats"))
    for node, val in zip((grad, scales, stats), vals, strict=True):
        node.meta["val"] = val
    outs = []
    for rows in (first, second):
        p = graph.call_function(point, (grad, scales, stats, *rows))
        with vals[0].fake_mode:
            p.meta["val"] = point(*vals[:3], *rows)
        out, stats = (graph.call_function(operator.getitem, (p, i)) for i in (0, 1))
        out.meta["val"], stats.meta["val"] = p.meta["val"]
        outs.append(out)
    graph.output((*outs, stats))
    return GraphModule({}, graph)


def _ops(nodes: list[Node], inputs: dict[Node, str]) -> list[tuple[Any, ...]]:
    """Each node's target and arguments, a node read as its input's name or its index in ``nodes``."""
    index = {n: i for i, n in enumerate(nodes)}

    def arg(a: Any) -> Any:
        if isinstance(a, Node):
            return inputs.get(a, index.get(a))
        return [arg(x) for x in a] if isinstance(a, (list, tuple)) else a

    return [(n.target, arg(n.args), arg(dict(n.kwargs))) for n in nodes]


rows = st.lists(st.integers(0, ROWS - 1), max_size=3, unique=True).map(tuple)


@settings(max_examples=25, deadline=None)
@given(out_rows=rows.filter(bool), in_rows=rows, record_rows=rows, unscale=st.booleans(), moments=st.booleans(),
       blame=st.booleans(), shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float16, torch.float32]))
def test_a_point_written_out_from_another_points_ops_is_the_point_traced_for_its_own_rows(
        out_rows: tuple[int, ...], in_rows: tuple[int, ...], record_rows: tuple[int, ...], unscale: bool,
        moments: bool, blame: bool, shape: list[int], dtype: torch.dtype) -> None:
    """Points whose rows differ but keep their order and the loss row share their traced ops; the
    second point's copy, its rows put back into ``set_scale`` and ``record``, is what tracing the
    point's backward with its own rows gives."""
    with FakeTensorMode():
        vals = [torch.empty(shape, dtype=dtype), torch.empty(2 * ROWS), torch.empty(2 * ROWS, NUM_STATS)]
    others = {r: 2 * r + 1 for r in range(1, ROWS)} | {0: 0}  # (rows of the same order, the loss row kept)
    flags = (unscale, moments, False, blame, "default", "none")
    second = (list(out_rows), list(in_rows), list(record_rows), *flags)
    first = tuple(list(map(others.__getitem__, r)) for r in (out_rows, in_rows, record_rows)) + flags
    gm = _graph_with_two_points(vals, first, second)
    result = expand_points(gm, autoscale.Config(executor="eager"))
    assert dict(result.counts) == {"points": 2, "signatures": 1, "kept": 0}
    written = [n for n in gm.graph.nodes if n.op == "call_function"]
    copy = written[len(written) // 2:]
    first_record = [n for n in written[:len(written) // 2] if n.target is torch.ops.autoscale.record.default]
    names = {n: n.name for n in gm.graph.find_nodes(op="placeholder")} | {r: "stats" for r in first_record}

    def backward(g: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> Any:
        return measured_point(g, s, t, out_rows, in_rows, record_rows, unscale, moments, blame=blame,
                              form=FORMS["default"])

    with torch.no_grad():
        traced = make_fx(backward, tracing_mode="fake")(*vals)
    traced.graph.eliminate_dead_code()
    own = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is not torch.ops.aten.detach.default]
    for n in own:  # (the factory calls' detach, which the pass drops: see _trace)
        n.args = torch.fx.node.map_arg(n.args, lambda a: a.args[0] if a.target is torch.ops.aten.detach.default else a)
    inputs = dict(zip(traced.graph.find_nodes(op="placeholder"), ("grad", "scales", "stats"), strict=True))
    assert _ops(copy, names) == _ops(own, inputs)


def test_a_trace_names_the_decompositions_it_applies_or_none_it_cannot_write_out_alike() -> None:
    """A point is one op only in a trace whose decompositions the pass can apply too: AOTAutograd's
    own (the eager executor's) and Inductor's; in any other, it is traced op by op."""
    from torch._inductor.decomposition import select_decomp_table

    seen: list[str | None] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(trace_decompositions())
        return x + 1

    x = torch.ones(2)
    for table in (None, select_decomp_table(), {torch.ops.aten.mul.Tensor: torch.mul}):
        make_fx(f, decomposition_table=table)(x)
    assert seen == ["none", "inductor", None]


def test_a_point_whose_ops_would_lay_its_gradient_out_otherwise_is_left_as_the_op() -> None:
    """The nodes after a point were traced with the layout of its op's output; a point whose ops
    would write another layout is left as the op, which then computes what the point computes."""
    with FakeTensorMode():
        vals = [torch.empty(4, 6), torch.empty(2 * ROWS), torch.empty(2 * ROWS, NUM_STATS)]
    rows = ([2], [1], [2], False, False, False, True, "default", "none")
    gm = _graph_with_two_points(vals, rows, rows)
    first = next(iter(gm.graph.find_nodes(op="call_function", target=point)))
    with vals[0].fake_mode:
        first.meta["val"] = (torch.empty_strided((4, 6), (1, 4)), first.meta["val"][1])  # (column-major)
    result = expand_points(gm, autoscale.Config(executor="eager"))
    assert dict(result.counts) == {"points": 1, "signatures": 1, "kept": 1}
    assert gm.graph.find_nodes(op="call_function", target=point) == [first]
    gm.recompile()
    grad, scales, stats = torch.randn(4, 6), torch.full((2 * ROWS,), 4.0), torch.zeros(2 * ROWS, NUM_STATS)
    out, _, recorded = gm(grad, scales, stats)
    expected, once = measured_point(grad, scales, stats, *rows[:3], False, False, blame=True, form=FORMS["default"])
    assert once is not None
    again, twice = measured_point(grad, scales, once, *rows[:3], False, False, blame=True, form=FORMS["default"])
    assert out.equal(expected) and twice is not None and recorded.equal(twice)
