"""Per-layer numbers: the analysis' predictions and one measured float32 step, as the same quantities."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule

import autoscale
from autoscale.layer_numbers import LayerNumbers, flushed_share, layer_parts, measure_layers, predict_layers
from autoscale.passes import PIPELINE, PassSpec, analyze_underflow, run_stage
from autoscale.passes.analysis.seeding import seed_inputs
from tests.helpers import capture


def _analyzed(fn: object, *inputs: torch.Tensor) -> tuple[GraphModule, list[torch.Tensor]]:
    (gm, example), = capture(fn, *inputs)  # type: ignore[arg-type]
    seed_inputs(gm, example)
    run_stage(gm, autoscale.Config(compute="native"), "dynamo", [PassSpec(analyze_underflow, "dynamo")])
    return gm, example


class _Scaled(nn.Module):
    """One Linear; the loss is its output times fixed noise ``r``, summed: the gradient arriving at
    the Linear's output is ``r`` itself, a Gaussian of known spread."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * r).sum()


def test_a_linear_layer_predicted_as_measured() -> None:
    """Where the analysis' Gaussian model holds (a Linear of Gaussian inputs, a Gaussian incoming
    gradient), predicted and measured are the same numbers: the underflow shares to sampling
    error, the maxima to what a Gaussian sample's max varies by. The incoming gradient's spread is
    2^-24, so that float16 flushes a share of it (erf(1/(2√2)) = 38%), and the weight gradient's
    sums over 256 rows lift it to a small share."""
    torch.manual_seed(0)
    model = _Scaled()
    x, r = torch.randn(256, 64), torch.randn(256, 32) * 2.0**-24
    gm, example = _analyzed(model, x, r)
    predicted, measured = predict_layers(gm), measure_layers(gm, example)
    p, m = predicted["fc"], measured["fc"]
    assert p.grad_underflow == pytest.approx(math.erf(0.5 / math.sqrt(2)), abs=0.01)
    assert p.grad_underflow == pytest.approx(m.grad_underflow, abs=0.02)
    assert m.grad_underflow > 0.3  # (the case: a large share flushed)
    assert p.weight_underflow == pytest.approx(m.weight_underflow, abs=0.02)
    assert p.grad_max == pytest.approx(m.grad_max, rel=0.25)
    assert p.weight_grad_max == pytest.approx(m.weight_grad_max, rel=0.35)
    assert p.forward_max == pytest.approx(m.forward_max, rel=0.25)
    assert set(predicted) == set(measured)


def test_numbers_the_analysis_does_not_know_are_none_never_a_stand_in() -> None:
    """An op without a rule makes what depends on it unknown: the first Linear's gradients come
    through it (None); the second Linear's incoming gradient does not, but its weight gradient
    needs its input, the op's value (None); the layer holding the op has no forward max. The
    measurement knows everything."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin1, self.lin2 = lin1, lin2

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin2(torch.special.bessel_j0(self.lin1(x))).sum()

    gm, example = _analyzed(Model(), torch.randn(4, 8))
    predicted, measured = predict_layers(gm), measure_layers(gm, example)
    assert predicted["lin1"].weight_underflow is None and predicted["lin1"].weight_grad_max is None
    assert predicted["lin1"].grad_underflow is None and predicted["lin1"].grad_max is None
    assert predicted["lin1"].forward_max is not None
    assert predicted[""].forward_max is None  # (the layer that computes bessel_j0)
    assert predicted["lin2"].weight_underflow is None and predicted["lin2"].forward_max is None
    assert predicted["lin2"].grad_underflow is not None and predicted["lin2"].grad_max is not None
    assert all(v is not None for m in measured.values() for v in (m.forward_max,))
    assert measured["lin1"].weight_underflow is not None


def test_a_parameter_belongs_to_the_module_that_holds_it() -> None:
    """A weight used outside its module (a tied head, ``F.linear(x, self.emb.weight)``) counts for
    the module that owns it, not the one that first reads it; a layer without parameters has no
    weight numbers."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.mix = nn.Linear(8, 8)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return F.linear(torch.relu(self.mix(self.emb(idx))), self.emb.weight).square().mean()

    torch.manual_seed(0)
    gm, example = _analyzed(Tied(), torch.randint(0, 16, (4, 5)))
    parts = layer_parts(gm)
    assert [len(parts["emb"].weights), len(parts["mix"].weights)] == [1, 2]
    assert not parts[""].weights  # (the root computes F.linear with emb's weight: not its own)
    predicted = predict_layers(gm)
    assert predicted[""].weight_underflow is None and predicted[""].weight_grad_max is None
    assert predicted["emb"].weight_grad_max is not None


def test_flushed_share_counts_nonzero_entries_float16_makes_zero_over_all_entries() -> None:
    """Zeros in float32 are in the denominator and never flushed; 2^-25 rounds to 0 (a tie, to
    even), anything above it to the smallest subnormal 2^-24."""
    t = torch.tensor([0.0, 0.0, 2.0**-26, -(2.0**-25), 2.0**-25 * 1.001, 2.0**-24, 1.0, 70000.0])
    assert flushed_share(t) == pytest.approx(2 / 8)
    assert flushed_share(torch.empty(0)) == 0.0


def test_mask_fills_are_no_forward_magnitude() -> None:
    """A causal mask's -inf (or float32's finfo.min) is meant to become -inf: neither side counts it
    in a layer's largest forward value, which is then the scores' own."""
    torch.manual_seed(0)

    def attend(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1)
        causal = torch.ones(8, 8, dtype=torch.bool).tril()
        masked = scores.masked_fill(~causal, float("-inf"))
        bias = torch.where(causal, 0.0, torch.finfo(torch.float32).min)
        return (torch.softmax(masked, -1) + torch.softmax(scores + bias, -1)).square().sum()

    gm, example = _analyzed(attend, torch.randn(2, 8, 4, requires_grad=True), torch.randn(2, 8, 4))
    p, m = predict_layers(gm)[""], measure_layers(gm, example)[""]
    assert m.forward_max is not None and math.isfinite(m.forward_max) and m.forward_max < 100
    assert p.forward_max == pytest.approx(m.forward_max, rel=0.5)


def test_measured_numbers_do_not_depend_on_the_precision_pass() -> None:
    """``measure_layers`` skips the casts into float16 the precision pass inserts: the graph as
    captured and as rewritten measure the same (float32) gradients. (Not the same forward max: in
    the rewritten graph the layer also holds the casts of its input and weight into float16.)"""
    torch.manual_seed(0)
    model = _Scaled()
    x, r = torch.randn(16, 64), torch.randn(16, 32)
    (plain, example), = capture(model, x, r)
    (rewritten, _), = capture(model, x, r)
    run_stage(rewritten, autoscale.Config(compute="native").resolved(torch.device("cpu")), "dynamo",
              PIPELINE[:4])  # up to convert_precision
    assert any(n.kwargs.get("dtype") == torch.float16 for n in rewritten.graph.nodes)
    a, b = measure_layers(plain, example)["fc"], measure_layers(rewritten, example)["fc"]
    for field in LayerNumbers.__dataclass_fields__:
        if field not in ("layer", "forward_max"):
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-6), field
