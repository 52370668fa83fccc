"""batch_records: a chain of ``record`` ops into one tensor becomes one fold, with the same result.

On graphs made by tracing calls of ``autoscale::record`` as a rescale point's backward makes them
(functionalized, the tensor written back with ``copy_``), on random cells, values and combine
modes; and end to end, a compiled model's statistics with and without the pass.
"""

from __future__ import annotations

import importlib
import math
import unittest.mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functionalize
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

import autoscale
from autoscale.measure import Measured, fold
from autoscale.ops import record, set_scale
from autoscale.passes import PassSpec, batch_records, run_stage
from autoscale.protocol import ARRIVED, BAD, MADE, MAX, NUM_STATS, PEAK, STAT, SUM
from tests.helpers import step_through_pipeline

batch_records_module = importlib.import_module("autoscale.passes.joint.batch_records")
RECORD = torch.ops.autoscale.record.default
ROWS = 5

MAXED = {STAT["nonfinite"], STAT["amax"]}


Read = tuple[tuple[int, ...], float]
"""How a recorded value is read (``reading``): the rows of its scale, its bound."""
Recorded = tuple[int, int, "float | tuple[float, ...]", "Read | None"]
"""One recorded value: (cell, mode, value or its partial results, how it is read, or None: as it is)."""
SCALES = torch.tensor([1.0, 2.0**15, 2.0**-3, 2.0**10, 2.0**-10])  # (row 0's is 1: the loss row's)


def _point(entries: list[tuple[int, float, int, Read | None]]) -> list[Recorded]:
    """Recorded values with each cell combined as its column is, as the points record them: a flag
    column by any of the modes that take a maximum of a point's number (a peak read against its
    scale and bound, or a value as it is, marks included: -1 for made, inf for arrived), a summed one
    by SUM, of counts (whole numbers, as is: their sum is exact in any order, as the pass claims)."""
    def count(v: float) -> float:
        return float(round(abs(v))) if v < math.inf else 1.0

    return [(c, mode, abs(v) if read else v, read) if c % NUM_STATS in MAXED else (c, SUM, count(v), None)
            for c, v, mode, read in entries]


row_sets = st.sets(st.integers(0, ROWS - 1), max_size=3).map(lambda rows: tuple(sorted(rows)))
readings = st.none() | st.tuples(row_sets, st.sampled_from([65520.0, math.inf]))
points = st.lists(st.lists(st.tuples(st.integers(0, ROWS * NUM_STATS - 1),
                                     st.floats(0, 1e6, width=32) | st.sampled_from([-1.0, math.inf, 3e38]),
                                     st.sampled_from([MAX, PEAK, ARRIVED, MADE, BAD]), readings),
                           min_size=1, max_size=6).map(_point), min_size=1, max_size=8)


def _set(scales: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """The largest scale of ``rows`` as a point reads it: 1 for none (the loss row's, a constant)."""
    return set_scale(scales, list(rows)) if rows else torch.full((), 1.0)


def _split(recorded: list[list[Recorded]], parts: list[int]) -> list[list[Recorded]]:
    """``recorded`` with the values handed as ``parts[j]`` partial results each (as a GPU's points
    hand them: ``autoscale.protocol.Form.parts``), whose whole is the value: maxima of which it is
    the largest, or counts that sum to it."""
    k = iter(parts)

    def pieces(v: float, mode: int, n: int) -> tuple[float, ...]:
        if mode == SUM:
            share = float(v // n)
            return (v - share * (n - 1), *[share] * (n - 1))
        return (v, *[min(v, 0.5)] * (n - 1))

    return [[(c, m, pieces(v, m, next(k)), read) for c, m, v, read in point]  # type: ignore[misc]
            for point in recorded]


def _values(recorded: list[list[Recorded]]) -> list[float]:
    """Every recorded value's elements, in order."""
    return [x for point in recorded for _, _, v, _ in point for x in (v if isinstance(v, tuple) else (v,))]


def _traced(recorded: list[list[Recorded]], *, reuse: bool = False) -> GraphModule:
    """The graph of ``stats.copy_(record(stats, ...))`` per point, functionalized as AOTAutograd
    does; with ``reuse``, an intermediate value is also read elsewhere (returned). Each point reads
    the set of rows of its scale itself, as the points do. A value given as a tuple is handed as
    that many partial results (``_split``)."""
    def points_backward(stats: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
        j, kept = 0, ()
        for i, point in enumerate(recorded):
            vals, out_scales = [], []
            for _, _, v, read in point:
                n = len(v) if isinstance(v, tuple) else 0
                # (a computed 0-dim value, as a point's measurement, or a vector of partial results)
                vals.append(values[j:j + n] * 1.0 if n else values[j] * 1.0)
                out_scales.append(_set(scales, read[0]) if read else None)
                j += max(n, 1)
            stats.copy_(record(stats, vals, [c for c, *_ in point], [m for _, m, *_ in point], out_scales,
                               [read[1] if read else math.inf for *_, read in point]))
            if reuse and i == 0:
                kept = (stats.clone(),)
        return kept

    stats = torch.zeros(ROWS, NUM_STATS)
    values = torch.zeros(max(1, len(_values(recorded))))
    return make_fx(functionalize(points_backward), tracing_mode="fake")(stats, values, SCALES)


def _run(gm: GraphModule, recorded: list[list[Recorded]], start: torch.Tensor) -> torch.Tensor:
    stats = start.clone()
    gm(stats, torch.tensor(_values(recorded) or [0.0]), SCALES)
    return stats


def _folded(recorded: list[list[Recorded]], start: torch.Tensor) -> torch.Tensor:
    """What folding the points one by one, eagerly, gives (``fold``, the meaning of ``record``)."""
    expected = start.clone()
    for point in recorded:
        reads = [read for *_, read in point]
        expected = fold(expected, [torch.tensor(v) for _, _, v, _ in point], [c for c, *_ in point],
                        [m for _, m, *_ in point], [_set(SCALES, r[0]) if r else None for r in reads],
                        [r[1] if r else math.inf for r in reads])
    return expected


def _batch(gm: GraphModule) -> dict[str, int]:
    (result,) = run_stage(gm, autoscale.Config(verify=True), "joint", [PassSpec(batch_records, "joint")])
    return dict(result.counts)


@settings(max_examples=60, deadline=None)
@given(recorded=points, start=st.lists(st.integers(0, 10**6).map(float), min_size=ROWS * NUM_STATS,
                                       max_size=ROWS * NUM_STATS))
def test_one_fold_computes_what_the_points_fold_one_by_one(recorded: list[list[Recorded]],
                                                           start: list[float]) -> None:
    """Folding all points' values at the end gives the point-by-point result exactly, whatever cells
    repeat and in whatever order the points record (maxima of values read against their scales and
    bounds, or as they are; counts, summed)."""
    initial = torch.tensor(start).view(ROWS, NUM_STATS)
    expected = _folded(recorded, initial)
    gm = _traced(recorded)
    assert _run(gm, recorded, initial).equal(expected)  # (the traced graph itself)
    counts = _batch(gm)
    assert counts == {"records": len(recorded), "folds": 1}
    assert not gm.graph.find_nodes(op="call_function", target=RECORD)
    assert _run(gm, recorded, initial).equal(expected)


@settings(max_examples=60, deadline=None)
@given(recorded=points, parts=st.lists(st.integers(1, 3), min_size=48, max_size=48))
def test_values_handed_as_partial_results_fold_as_their_whole(recorded: list[list[Recorded]],
                                                              parts: list[int]) -> None:
    """A GPU's points hand their maxima and counts as partial results (``Form.parts``): the fold
    reduces each value's first (max, or sum for a summed cell's), and gives what the values' wholes
    give, folded point by point; eagerly, ``record`` does the same."""
    split = _split(recorded, parts)
    initial = torch.arange(ROWS * NUM_STATS, dtype=torch.float32).view(ROWS, NUM_STATS)
    expected = _folded(recorded, initial)
    assert _folded(split, initial).equal(expected)  # (eagerly)
    gm = _traced(split)
    assert _batch(gm) == {"records": len(recorded), "folds": 1}
    assert _run(gm, split, initial).equal(expected)


@settings(max_examples=40, deadline=None)
@given(recorded=points)
def test_a_cell_of_many_values_folds_alike_by_a_masked_maximum(recorded: list[list[Recorded]]) -> None:
    """A cell of more than ``_WIDE`` values of one mode combined by max (``ANY_NONFINITE`` takes
    every point's) is reduced over the vector with a mask, not gathered: the same result (here
    every such cell of more than one value)."""
    initial = torch.arange(ROWS * NUM_STATS, dtype=torch.float32).view(ROWS, NUM_STATS)
    gm = _traced(recorded)
    with unittest.mock.patch.object(batch_records_module, "_WIDE", 1):
        _batch(gm)
    assert _run(gm, recorded, initial).equal(_folded(recorded, initial))


def test_a_value_is_read_against_its_scale_and_bound() -> None:
    """``reading``: a peak at unit scale, -1 where the point's output overflowed (the peak at the
    output's scale reached the bound, or float32's range), and a non-finite peak kept as it arrived."""
    def read(peak: float, scale: float, bound: float = 65520.0) -> float:
        return Measured(torch.tensor(peak), torch.tensor(scale), bound).value.item()
    assert read(2.0, 4.0) == 2.0 and read(30000.0, 2.0) == 30000.0
    assert read(40000.0, 2.0) == -1.0 and read(40000.0, 2.0, math.inf) == 40000.0
    assert read(1e37, 2.0**10, math.inf) == -1.0  # (a float32 gradient scaled past float32's range)
    assert read(math.inf, 2.0**-10) == math.inf and math.isnan(read(math.nan, 1.0))


def test_chains_it_cannot_batch_are_left_as_they_are() -> None:
    """A chain whose intermediate value is read elsewhere, and one that combines a cell both ways
    (where the order matters), keep their ``record`` ops, which compute the same by themselves."""
    recorded: list[list[Recorded]] = [[(1, MAX, 2.0, None)], [(1, MAX, 3.0, None)]]
    gm = _traced(recorded, reuse=True)
    assert _batch(gm) == {"records": 0, "folds": 0}
    assert len(gm.graph.find_nodes(op="call_function", target=RECORD)) == 2
    mixed: list[list[Recorded]] = [[(0, SUM, 1.0, None)], [(0, MAX, 1.0, ((2,), math.inf))]]
    gm = _traced(mixed)
    assert _batch(gm) == {"records": 0, "folds": 0}
    assert _run(gm, mixed, torch.zeros(ROWS, NUM_STATS))[0, 0] == 1.0


def test_a_compiled_model_records_the_same_statistics_with_and_without_the_pass() -> None:
    """End to end (eager executor): one backward's statistics and gradients are identical, and the
    pass reports one fold per chain: the backward's statistics and the forward's peaks."""
    batched, alone = step_through_pipeline(batch_records), step_through_pipeline(batch_records, without=True)
    assert batched.stats.equal(alone.stats) and batched.peaks.equal(alone.peaks)
    assert len(batched.grads) == len(alone.grads)
    assert all(a.equal(b) for a, b in zip(batched.grads, alone.grads, strict=True))
    assert alone.counts == [] and len(batched.counts) == 1
    assert batched.counts[0]["folds"] == 2 and batched.counts[0]["records"] > 2
