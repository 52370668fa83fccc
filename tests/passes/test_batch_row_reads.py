"""batch_row_reads: the rows' scales a graph's points read one by one become one ``row_scales`` call.

On graphs traced from ``autoscale::row_scale`` reads (random rows, repeats, two scales tensors),
and end to end, a compiled model's gradients and statistics with and without the pass.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

import autoscale
from autoscale.measure import row_scale, row_scales
from autoscale.passes import PassSpec, batch_row_reads, run_stage
from tests.helpers import step_through_pipeline

ROWS = 6


def _traced(first: list[int], second: list[int]) -> GraphModule:
    """Each read of ``first`` from one scales tensor and of ``second`` from another, times a
    gradient, summed: what points make of the scales they read."""
    def points(a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        out = grad * 0.0
        for scales, rows in ((a, first), (b, second)):
            for k, row in enumerate(rows):
                out = out + grad * (k + 1) * row_scale(scales, row)
        return out

    return make_fx(points, tracing_mode="fake")(torch.ones(ROWS), torch.ones(ROWS), torch.ones(3))


def _batch(gm: GraphModule) -> dict[str, int]:
    (result,) = run_stage(gm, autoscale.Config(verify=True), "joint", [PassSpec(batch_row_reads, "joint")])
    return dict(result.counts)


@settings(max_examples=40, deadline=None)
@given(first=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=8),
       second=st.lists(st.integers(0, ROWS - 1), max_size=8))
def test_one_call_per_scales_tensor_reads_what_the_points_read(first: list[int], second: list[int]) -> None:
    """Whatever rows repeat and in whatever order: the same result, every read gone, one
    ``row_scales`` per scales tensor read and one of its outputs per distinct row."""
    gm = _traced(first, second)
    inputs = (torch.arange(1.0, ROWS + 1), torch.arange(ROWS + 1.0, 2 * ROWS + 1), torch.tensor([1.0, -2.0, 0.5]))
    expected = gm(*inputs)
    assert _batch(gm) == {"reads": len(first) + len(second), "calls": 1 + bool(second)}
    assert not gm.graph.find_nodes(op="call_function", target=row_scale)
    calls = gm.graph.find_nodes(op="call_function", target=row_scales)
    read = [sorted({*rows}) for rows in (first, second) if rows]
    assert [sorted(u.args[1] for u in call.users) for call in calls] == read
    assert gm(*inputs).equal(expected)


def test_a_compiled_model_computes_the_same_with_and_without_the_pass() -> None:
    """End to end (eager executor): one backward's statistics and gradients are identical whether
    the points read their rows one by one or from the pass's one call."""
    batched, alone = step_through_pipeline(batch_row_reads), step_through_pipeline(batch_row_reads, without=True)
    assert batched.stats.equal(alone.stats) and len(batched.grads) == len(alone.grads)
    assert all(a.equal(b) for a, b in zip(batched.grads, alone.grads, strict=True))
    assert alone.counts == [] and len(batched.counts) == 1
    assert batched.counts[0]["calls"] == 1 and batched.counts[0]["reads"] > 2
