"""reduce_at_source: a full max over a rearranged value reads the value's source, with the same result.

On traced ATen graphs of ``amax(abs(cast(rearranged(x))))`` for random shapes, permutations,
expansions and values (inf and nan among them); on graphs it must leave alone; and end to end, a
compiled language model's statistics, peaks and gradients with and without the pass.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

import autoscale
from autoscale.measure import largest
from autoscale.passes import PIPELINE, PassSpec, reduce_at_source, run_stage
from autoscale.passes.graph_utils import cast_of, op_name
from autoscale.passes.op_tables import REARRANGING, UNARY_ELEMENTWISE
from autoscale.protocol import FORMS
from tests.models import transformer_case

AMAX = torch.ops.aten.amax.default

DEFAULT = FORMS["default"]


def _reduce(gm: GraphModule) -> dict[str, int]:
    (result,) = run_stage(gm, autoscale.Config(verify=True), "joint", [PassSpec(reduce_at_source, "joint")])
    return dict(result.counts)


def _under_max(gm: GraphModule) -> list[str]:
    """The ops between the (one) full max and the first op that is neither a rearrangement nor unary."""
    (amax,) = gm.graph.find_nodes(op="call_function", target=AMAX)
    names, node = [], amax.args[0]
    while isinstance(node, Node) and (op_name(node) in REARRANGING | UNARY_ELEMENTWISE | {"mul"} or cast_of(node)):
        names.append("cast" if cast_of(node) else op_name(node))
        node = node.args[0]
    return names


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


shapes = st.lists(st.integers(1, 4), min_size=2, max_size=4)
values = st.floats(-7e4, 7e4, width=32) | st.sampled_from([math.inf, -math.inf, math.nan, 0.0])


@settings(max_examples=40, deadline=None)
@given(shape=shapes, data=st.data(), expand=st.integers(1, 3), clone=st.booleans())
def test_the_max_of_a_rearranged_value_is_read_from_its_source(shape: list[int], data: st.DataObject, expand: int,
                                                               clone: bool) -> None:
    """``amax(abs(float(flatten(expand(permute(stack(a, b)))))))``, as a rescale point reads the
    gradient of a fused QKV projection, becomes ``amax(abs(float(stack(a, b))))``, with the same
    value: every rearrangement goes, the cast and ``abs`` stay."""
    order = data.draw(st.permutations(range(len(shape) + 1)))
    n = math.prod(shape)
    a, b = (torch.tensor(data.draw(st.lists(values, min_size=n, max_size=n))).view(shape).half() for _ in range(2))

    def point(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        g = torch.stack([a, b]).permute(*order).unsqueeze(0).expand(expand, *([-1] * (len(shape) + 1)))
        g = g.clone() if clone else g
        return g.reshape(expand, -1).float().abs().amax()

    gm = make_fx(point, tracing_mode="fake")(a, b)
    expected = point(a, b)
    assert _reduce(gm) == {"reductions": 1}
    assert _under_max(gm) == ["abs", "cast"]
    assert _same(gm(a, b), expected)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, data=st.data(), exponent=st.integers(-30, 30))
def test_a_peak_handed_to_the_fold_is_read_from_its_source_too(shape: list[int], data: st.DataObject,
                                                               exponent: int) -> None:
    """``largest(abs(float(permute(stack(a, b)))) * reciprocal(s))``, the form in which a point hands
    the fold its peak (a one-element vector, at unit scale), reads ``stack(a, b)`` in its own order
    too: the multiply by the unit scale's reciprocal is elementwise, and the max stays a vector."""
    order = data.draw(st.permutations(range(len(shape) + 1)))
    n = math.prod(shape)
    a, b = (torch.tensor(data.draw(st.lists(values, min_size=n, max_size=n))).view(shape).half() for _ in range(2))
    s = torch.tensor(2.0**exponent)

    def point(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return largest(torch.stack([a, b]).permute(*order).float().abs() * s.reciprocal(), DEFAULT)

    gm = make_fx(point, tracing_mode="fake")(a, b, s)
    expected = point(a, b, s)
    assert _reduce(gm) == {"reductions": 1}
    assert _under_max(gm) == ["unsqueeze", "mul", "abs", "cast"]
    result = gm(a, b, s)
    assert result.shape == (1,) and _same(result, expected)


def test_what_it_must_leave_alone() -> None:
    """A max with nothing rearranged under it; one over views alone (it reads in order already,
    and shares its loop with the view's other readers); one over some dimensions only; and one
    over a transposed bitcast (``view`` to another dtype changes the values: the source is the
    bitcast, with nothing reordered under the max); and a one-element max over a transposed value
    multiplied by a number that is no reciprocal (a leaving point's output, ``g * factor``, which
    Inductor writes over ``g`` while the max reads the output: read under the multiply, ``g`` would
    have two readers)."""
    x = torch.randn(4, 6)
    for fn in (lambda x: x.abs().amax(), lambda x: x.view(2, 12).unsqueeze(0).abs().amax(),
               lambda x: x.t().abs().amax(dim=1), lambda x: x.view(torch.int32).float().abs().amax(),
               lambda x: x.t().contiguous().view(torch.int32).float().abs().amax(),
               lambda x: largest((x.t() * x.abs().amax()).abs(), DEFAULT)):
        gm = make_fx(fn, tracing_mode="fake")(x)
        assert _reduce(gm) == {"reductions": 0}
        assert _same(gm(x), fn(x))


def test_a_compiled_model_measures_the_same_with_and_without_the_pass() -> None:
    """End to end (eager executor): the language model's fused QKV projections and merged heads are
    rearranged values under the points' and checks' maxima; one backward's statistics, the forward's
    peaks and the gradients are identical with and without the pass, which moved some."""
    results = []
    for pipeline in (PIPELINE, tuple(p for p in PIPELINE if p.fn is not reduce_at_source)):
        model, (idx, targets), _ = transformer_case()
        scaler = autoscale.GradScaler(model)
        backend = autoscale.Backend(autoscale.Config(executor="eager", verify=True), pipeline=pipeline)
        torch.compile(model, backend=backend)(idx, targets).backward()
        state = scaler._state
        assert state is not None
        moved = [r.counts["reductions"] for record in backend.records for r in record.passes
                 if r.name == "reduce_at_source"]
        results.append((state.stats.clone(), state.peaks.clone(), [p.grad.clone() for p in model.parameters()], moved))
    (stats, peaks, grads, moved), (stats0, peaks0, grads0, moved0) = results
    assert _same(stats, stats0) and _same(peaks, peaks0)
    assert all(_same(a, b) for a, b in zip(grads, grads0, strict=True))
    assert moved0 == [] and len(moved) == 1 and moved[0] >= 2
