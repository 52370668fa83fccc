"""fold_casts: exact (bit-for-bit) on random cast chains, and leaves no cancelling pair."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx import Graph, GraphModule

import autoscale
from autoscale.passes import PassRecord, PassSpec, fold_casts, run_stage
from autoscale.passes.graph_utils import cast_of
from tests.passes.test_properties import _check_casts_do_not_cancel

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
F16, F32, F64 = torch.float16, torch.float32, torch.float64


def _chains(chains: list[list[torch.dtype]], *, from_input: bool = False) -> GraphModule:
    """-x -> cast -> cast -> ... for each chain (x itself with ``from_input``); every link of every
    chain is an output."""
    graph = Graph()
    x = graph.placeholder("x")
    start = x if from_input else graph.call_method("neg", (x,))
    outs = []
    for chain in chains:
        node = start
        for dtype in chain:
            node = graph.call_method("to", (node,), {"dtype": dtype})
            outs.append(node)
    graph.output(tuple(outs))
    return GraphModule(torch.nn.Module(), graph)


def _fold(gm: GraphModule, x: torch.Tensor) -> PassRecord:
    gm.graph.find_nodes(op="placeholder")[0].meta["val"] = torch._subclasses.FakeTensorMode().from_tensor(x)
    (record,) = run_stage(gm, autoscale.Config(), "dynamo", [PassSpec(fold_casts, "dynamo")])
    return record


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal (-0.0 included), except that any NaN equals any NaN: a widening and
    narrowing round trip may change a NaN's payload, as hardware does."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(as_int)[~nan], b.view(as_int)[~nan])


values = st.lists(
    st.one_of(st.floats(width=32), st.sampled_from([65504.0, 65520.0, 2.0**-24, 2.0**-25, 1 + 2.0**-11, 3e38, -0.0])),
    min_size=1, max_size=16,
)
chains = st.lists(st.lists(st.sampled_from(DTYPES), min_size=1, max_size=5), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(chains=chains, xs=values, start=st.sampled_from(DTYPES), from_input=st.booleans())
def test_fold_is_exact_and_complete(chains: list[list[torch.dtype]], xs: list[float], start: torch.dtype,
                                    from_input: bool) -> None:
    x = torch.tensor(xs, dtype=torch.float32).to(start)
    gm = _chains(chains, from_input=from_input)
    expected = gm(x)
    _fold(gm, x)
    for e, g in zip(expected, gm(x), strict=True):
        assert e.dtype == g.dtype
        assert _same_bits(e, g)
    _check_casts_do_not_cancel(gm)


def test_fold_counts() -> None:
    # f16 -> f32 -> f16 cancels; f16 -> f32 -> f64 becomes f16 -> f64; the two x -> f32 merge.
    record = _fold(_chains([[F32, F16], [F32, F64]]), torch.ones(3, dtype=F16))
    assert (record.counts["cancelled"], record.counts["shortened"], record.counts["merged"]) == (1, 1, 1)


def test_rounding_round_trip_is_kept() -> None:
    gm = _chains([[F16, F32]])  # f32 -> f16 -> f32 rounds: not a no-op
    record = _fold(gm, torch.ones(3))
    assert not record.modified
    assert sum(cast_of(n) is not None for n in gm.graph.nodes) == 2


def test_output_never_becomes_the_input() -> None:
    """x.float().half() is a new tensor; folding it to x would let a caller mutate its input."""
    gm = _chains([[F32, F16]], from_input=True)
    record = _fold(gm, torch.ones(3, dtype=F16))
    assert "cancelled" not in record.counts
