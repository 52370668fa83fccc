"""batch_row_reads: the sets' scales a graph's points read one by one become one ``set_scales`` call.

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
from autoscale.measure import set_scale, set_scales
from autoscale.passes import PassSpec, batch_row_reads, run_stage
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
def test_one_call_per_scales_tensor_reads_what_the_points_read(first: Sets, second: Sets) -> None:
    """Whatever sets repeat (the empty one and the loss row's included) and in whatever order: the
    same result, every read gone, one ``set_scales`` per scales tensor read and one of its outputs
    per distinct set."""
    gm = _traced(first, second)
    inputs = (torch.arange(1.0, ROWS + 1), torch.arange(ROWS + 1.0, 2 * ROWS + 1), torch.tensor([1.0, -2.0, 0.5]))
    expected = gm(*inputs)
    distinct = [sorted(set(sets)) for sets in (first, second) if sets]
    assert _batch(gm) == {"reads": len(first) + len(second), "calls": len(distinct), "sets": sum(map(len, distinct))}
    assert not gm.graph.find_nodes(op="call_function", target=set_scale)
    calls = gm.graph.find_nodes(op="call_function", target=set_scales)
    assert [len(call.users) for call in calls] == [len(sets) for sets in distinct]
    for call, sets in zip(calls, distinct, strict=True):
        _, rows, ends = call.args
        assert [tuple(rows[a:b]) for a, b in zip([0, *ends], ends, strict=False)] == sets
    assert gm(*inputs).equal(expected)


def test_a_compiled_model_computes_the_same_with_and_without_the_pass() -> None:
    """End to end (eager executor): one backward's statistics and gradients are identical whether
    the points read their sets one by one or from the pass's one call."""
    batched, alone = step_through_pipeline(batch_row_reads), step_through_pipeline(batch_row_reads, without=True)
    assert batched.stats.equal(alone.stats) and len(batched.grads) == len(alone.grads)
    assert all(a.equal(b) for a, b in zip(batched.grads, alone.grads, strict=True))
    assert alone.counts == [] and len(batched.counts) == 1
    assert batched.counts[0]["calls"] == 1 and batched.counts[0]["reads"] > 2
