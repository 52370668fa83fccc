"""batch_row_reads: the sets' scales a graph's points read one by one become one reduction per set.

On graphs traced from ``autoscale::set_scale`` reads (random sets, repeats, two scales tensors),
and end to end, a compiled model's gradients and statistics with and without the pass.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

import autoscale
from autoscale.measure import point_backward
from autoscale.ops import set_scale
from autoscale.passes import PassSpec, batch_row_reads, run_stage
from autoscale.protocol import FORMS, LOSS_ROW
from tests.helpers import step_through_pipeline

ROWS = 6


Sets = list[tuple[int, ...]]


def _traced(first: Sets, second: Sets) -> GraphModule:
    """Each read of a set of ``first`` from one scales tensor and of ``second`` from another, times
    a gradient, summed: what points make of the scales they read."""
    def points(a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        out = grad * 0.0
        for scales, sets in ((a, first), (b, second)):
            for k, rows in enumerate(sets):
                out = out + grad * (k + 1) * set_scale(scales, list(rows))
        return out

    return make_fx(points, tracing_mode="fake")(torch.ones(ROWS), torch.ones(ROWS), torch.ones(3))


def _batch(gm: GraphModule) -> dict[str, int]:
    (result,) = run_stage(gm, autoscale.Config(verify=True), "joint", [PassSpec(batch_row_reads, "joint")])
    return dict(result.counts)


SETS = st.lists(st.sets(st.integers(0, ROWS - 1), max_size=4).map(lambda s: tuple(sorted(s))), max_size=8)


@settings(max_examples=40, deadline=None)
@given(first=SETS.filter(bool), second=SETS)
def test_one_reduction_per_distinct_set_reads_what_the_points_read(first: Sets, second: Sets) -> None:
    """Whatever sets repeat (the empty one and the loss row's included) and in whatever order: the
    same result (the loss row's scale being 1, as the state keeps it), every read gone, one ``amax``
    per distinct set, over the scales with the set's rows chosen by a constant mask (no row: the
    loss row's)."""
    gm = _traced(first, second)
    inputs = (torch.tensor([1.0, 2.0**15, 0.5, 2.0**-3, 8.0, 3.0]), torch.tensor([1.0, 4.0, 0.25, 2.0, 1.0, 16.0]),
              torch.tensor([1.0, -2.0, 0.5]))
    expected = gm(*inputs)
    distinct = [sorted(set(sets)) for sets in (first, second) if sets]
    assert _batch(gm) == {"reads": len(first) + len(second), "sets": sum(map(len, distinct))}
    assert not gm.graph.find_nodes(op="call_function", target=set_scale)
    reductions = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.amax.default)
    masks = [getattr(gm, r.args[0].args[0].args[0].target) for r in reductions]
    assert [mask.shape for mask in masks] == [(1, ROWS)] * len(masks)
    assert [tuple(mask[0].nonzero().flatten().tolist()) for mask in masks] == [
        rows or (LOSS_ROW,) for sets in distinct for rows in sets]
    assert gm(*inputs).equal(expected)


def test_a_point_traced_outside_dynamo_reads_its_sets_for_the_pass() -> None:
    """A point's backward traced with fake tensors while ``torch.compiler.is_compiling()`` is False
    (AOTAutograd traces a backward so on torch 2.11) reads each set with ``set_scale``, which the
    pass batches: on 2.11 such points read their scales with eager selects, which neither this pass
    nor ``batch_records`` recognized, and every point's measurements ran as ops of their own."""
    def backward(grad: torch.Tensor, scales: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        return point_backward(grad, scales, stats, out_rows=(2,), in_rows=(1, 3), record_rows=(2,), unscale=False,
                              moments=False, form=FORMS["default"])

    gm = make_fx(backward, tracing_mode="fake")(torch.ones(8), torch.ones(ROWS), torch.zeros(ROWS, 7))
    assert [n.args[1] for n in gm.graph.find_nodes(op="call_function", target=set_scale)] == [[2], [1, 3]]
    assert _batch(gm) == {"reads": 2, "sets": 2}


def test_a_compiled_model_computes_the_same_with_and_without_the_pass() -> None:
    """End to end (eager executor): one backward's statistics and gradients are identical whether
    the points read their sets one by one or from the pass's reductions."""
    batched, alone = step_through_pipeline(batch_row_reads), step_through_pipeline(batch_row_reads, without=True)
    assert batched.stats.equal(alone.stats) and len(batched.grads) == len(alone.grads)
    assert all(a.equal(b) for a, b in zip(batched.grads, alone.grads, strict=True))
    assert alone.counts == [] and len(batched.counts) == 1
    assert 1 <= batched.counts[0]["sets"] < batched.counts[0]["reads"]
