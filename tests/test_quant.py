"""Fake quantization, float8 and bfloat16: the quantizers' properties, the pass, and training with
the scaler (issue 7)."""

from __future__ import annotations

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoscale
from autoscale import quant, schedules
from autoscale.protocol import E4M3_MAX, E5M2_MAX
from tests.helpers import step
from tests.models import mlp_case

EAGER = autoscale.Config(executor="eager", verify=True)
floats = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(floats, min_size=2, max_size=64), bits=st.integers(2, 8))
def test_quantizer_idempotent_and_within_half_a_step(values: list[float], bits: int) -> None:
    x = torch.tensor(values)
    lo, hi, b = x.min(), x.max(), torch.tensor(float(bits))
    q = quant.affine_quantize(x, lo, hi, b)
    assert torch.equal(quant.affine_quantize(q, lo, hi, b), q)  # a grid point stays put
    span = float(torch.clamp(hi, min=0) - torch.clamp(lo, max=0))
    half = span / (2**bits - 1) / 2
    assert float((q - x).abs().max()) <= half * (1 + 1e-5) + 1e-6
    assert len(torch.unique(q)) <= 2**bits
    if float(lo) <= 0 <= float(hi):
        assert float(quant.affine_quantize(torch.zeros(1), lo, hi, b)) == 0.0  # zero is exact


def test_straight_through_gradients() -> None:
    w = torch.randn(6, 5, requires_grad=True)
    x = torch.randn(3, 5, requires_grad=True)
    ranges = torch.zeros(2, 3)
    upstream = torch.randn(6, 5)
    quant.fake_quant_weight(w, torch.tensor(3.0)).backward(upstream)
    assert torch.equal(w.grad, upstream)
    out = quant.fake_quant_activation(x, ranges, 1, torch.tensor(3.0), 0.9, True)
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, torch.ones_like(x))
    assert ranges[1, 2] == 1 and ranges[1, 0] == x.min() and ranges[1, 1] == x.max()  # first batch: its range
    assert len(torch.unique(quant.fake_quant_weight(w, torch.tensor(2.0))[0])) <= 4  # per channel: 2 bits


def test_activation_range_is_a_running_average_frozen_in_eval() -> None:
    ranges = torch.tensor([[-1.0, 1.0, 1.0]])
    bits = torch.tensor(8.0)
    quant.fake_quant_activation(torch.tensor([-3.0, 5.0]), ranges, 0, bits, 0.9, True)
    assert torch.allclose(ranges[0], torch.tensor([-1.2, 1.4, 1.0]))
    quant.fake_quant_activation(torch.tensor([-30.0, 50.0]), ranges, 0, bits, 0.9, False)
    assert torch.allclose(ranges[0], torch.tensor([-1.2, 1.4, 1.0]))  # eval: unchanged, and clamps to it


def test_gradient_quantization_is_unbiased_stochastic_rounding() -> None:
    torch.manual_seed(0)
    y = torch.zeros(4, requires_grad=True)
    g = torch.tensor([0.1, 0.37, -0.52, 1.0])
    samples = []
    for _ in range(2000):
        y.grad = None
        quant.quant_grad(y, 2).backward(g)
        samples.append(y.grad.clone())
    stacked = torch.stack(samples)
    grid = torch.unique(stacked)
    assert len(grid) <= 4  # 2 bits
    assert torch.allclose(stacked.mean(0), g, atol=0.02)  # E[Q(g)] = g


def test_float8_casts_saturate_in_e4m3_and_overflow_to_inf_in_e5m2() -> None:
    x = torch.tensor([1000.0, -5000.0, 3.0])
    forward = quant._float8(x, torch.float8_e4m3fn, torch.ones(()), saturate=True)
    assert forward.tolist() == [E4M3_MAX, -E4M3_MAX, 3.0]  # no nan: E4M3 has no infinity
    assert not torch.isfinite(quant.float8_forward(torch.tensor([1.0, float("inf")]))).any()  # inf is not hidden
    y = torch.zeros(2, requires_grad=True)
    quant.float8_grad(y).backward(torch.tensor([1e6, 3.0]))
    assert torch.isinf(y.grad[0]) and y.grad[1] == 3.0  # E5M2 overflows to inf: the scaler sees it
    t = torch.tensor([0.0, 1e-30, 2.0**-3, 300.0, -1e-3])
    e4m3 = quant.float8_forward(t)
    # scale 2^floor(log2(448/300)) = 1: E4M3's 3 mantissa bits (half an ulp: 2^-4 relative) and its
    # smallest subnormal 2^-9 (half of it absolute) bound the error
    assert ((e4m3 - t).abs() <= t.abs() * 2.0**-4 + 2.0**-10).all() and e4m3[3] == 288.0


def _train(config: autoscale.Config, *, fq_bits: list[int] | None = None,
           scaler_config: autoscale.ScalingConfig | None = None) -> tuple[autoscale.Backend, list[float], nn.Module,
                                                                          autoscale.GradScaler]:
    torch._dynamo.reset()
    model, (x,), y = mlp_case()
    fake = autoscale.FakeQuant(model, bits=8) if fq_bits is not None else None
    scaler = autoscale.GradScaler(model, scaler_config)
    backend = autoscale.backend(config)
    run = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for i in range(len(fq_bits) if fq_bits else 3):
        if fake is not None and fq_bits:
            fake.set_bits(fq_bits[i])
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(run(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    return backend, losses, model, scaler


def test_changing_bits_over_20_steps_compiles_once() -> None:
    bits = [schedules.get("cosine-triangular", 3, 8, 20, 2)(t) for t in range(20)]
    assert len(set(bits)) >= 4
    backend, losses, _, scaler = _train(EAGER.replace(quant=autoscale.QuantConfig()), fq_bits=bits)
    assert len(backend.records) == 1
    counts = {r.name: dict(r.counts) for r in backend.records[0].passes}["insert_fake_quant"]
    assert counts == {"weights": 3, "activations": 3, "gradients": 3}
    assert losses[-1] < losses[0] and scaler.skipped_steps == 0


def test_bits_change_the_forward_and_high_bits_match_float16() -> None:
    model, (x,), y = mlp_case()
    reference = step(model, torch.compile(model, backend=autoscale.backend(EAGER)), (x,), y)[0]
    outs = {}
    for bits in (2, 16):
        torch._dynamo.reset()
        model2, _, _ = mlp_case()
        fake = autoscale.FakeQuant(model2, bits=bits)
        cfg = EAGER.replace(quant=autoscale.QuantConfig(grad_bits=None))
        outs[bits] = step(model2, torch.compile(model2, backend=autoscale.backend(cfg)), (x,), y)[0]
        assert fake.bits == bits
    assert abs(float(outs[16] - reference)) < 1e-3 < abs(float(outs[2] - reference))


def test_bfloat16_needs_no_scaling_and_the_scaler_stays_at_one() -> None:
    backend, losses, _, scaler = _train(EAGER.replace(dtype="bf16"))
    assert {r.name: dict(r.counts) for r in backend.records[0].passes}["insert_grad_scaling"] == {"scale_points": 0}
    assert not scaler.scaling_needed and scaler.get_scale() == 1.0
    assert scaler.layers() == [] and scaler.skipped_steps == 0 and losses[-1] < losses[0]


def test_float8_rounds_gemm_inputs_and_scales_gradients_to_e5m2_range() -> None:
    backend, losses, model, scaler = _train(EAGER.replace(dtype="float8"))
    counts = {r.name: dict(r.counts) for r in backend.records[0].passes}["insert_fake_quant"]
    assert counts == {"float8_inputs": 6, "float8_gradients": 3}
    assert scaler.scaling_needed and scaler._state is not None and scaler._state.gradient_max == E5M2_MAX
    assert losses[-1] < losses[0] and scaler.skipped_steps == 0
    assert max(r.scale for r in scaler.layers()) > 1.0  # gradients lifted towards E5M2's range
