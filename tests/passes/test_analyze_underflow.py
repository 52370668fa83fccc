"""The underflow analysis: predictions against a measured float32 step at initialisation."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from autoscale.passes import PassSpec, analyze_underflow, remove_inplace, run_stage
from autoscale.passes.analysis.analyze_underflow import MOMENTS_KEY, UPDATE_SIZE, forward_moments
from autoscale.passes.analysis.losses import loss_outputs
from autoscale.passes.analysis.moments import Moments, predicted_underflow
from autoscale.passes.analysis.seeding import calibrate, reference_step, seed_inputs
from autoscale.passes.graph_utils import op_name
from tests.helpers import capture
from tests.models import conv_case, mlp_case, mobilenet_case, transformer_case

CASES = {"mlp": mlp_case, "convnet": conv_case, "transformer": transformer_case}
PARAMETRIC_GEMMS = ("linear", "conv2d")


def _analyzed(case: Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor | None]]
              ) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    model, inputs, targets = case()

    def loss(*args: torch.Tensor) -> torch.Tensor:
        out = model(*args)
        return out if targets is None else F.cross_entropy(out, targets)

    (gm, example), = capture(loss, *inputs)
    seed_inputs(gm, example)
    # (as the pipeline does: an in-place op's result is its input's tensor, whose .grad would be measured twice)
    run_stage(gm, autoscale.Config(compute="native"), "dynamo",
              [PassSpec(remove_inplace, "dynamo"), PassSpec(analyze_underflow, "dynamo")])
    return gm, example


def _measure(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> dict[torch.fx.Node, torch.Tensor]:
    """Every node's float32 value, with ``.grad`` filled by one backward of the scalar output."""
    values: dict[torch.fx.Node, torch.Tensor] = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            result = super().run_node(n)
            if isinstance(result, torch.Tensor):
                if result.requires_grad and n.op != "placeholder":
                    result.retain_grad()
                values[n] = result
            return result

    (Record(gm).run(*inputs)[0]).backward()
    return values


def _ratio(predicted: Moments, measured: torch.Tensor) -> float:
    return predicted.std / float(measured.detach().double().std())


@pytest.mark.parametrize("case", list(CASES))
def test_predicted_std_within_factor_two_at_init(case: str) -> None:
    """Forward: every Linear/Conv output. Backward: every gradient a scale point governs — the
    GEMM's incoming gradient, its input's gradient and its weight's gradient."""
    gm, inputs = _analyzed(CASES[case])
    measured = _measure(gm, inputs)
    checked = []
    for gemm in (n for n in gm.graph.nodes if op_name(n) in PARAMETRIC_GEMMS):
        x, weight = gemm.args[0], gemm.args[1]
        checked.append((f"{gemm.name} value", _ratio(gemm.meta[MOMENTS_KEY]["value"], measured[gemm])))
        for node, tensor in ((gemm, measured[gemm].grad), (x, measured[x].grad), (weight, measured[weight].grad)):
            if tensor is not None and tensor.numel() > 1:
                checked.append((f"{node.name} grad", _ratio(node.meta[MOMENTS_KEY]["grad"], tensor)))
    assert len(checked) >= 8
    outside = [(name, round(r, 2)) for name, r in checked if not 0.5 <= r <= 2.0]
    assert not outside, outside


def test_depthwise_strided_convolutions_and_relu6_pass_gradients_back_at_the_measured_rate() -> None:
    """The backward rules of MobileNetV2's ops, each on its own: how much a grouped (depthwise) or
    strided convolution and ReLU6 (``hardtanh(x, 0, 6)``) change a gradient's spread, predicted
    against one float32 backward. A depthwise convolution's input element feeds out_channels /
    groups filters (one), at the kernel taps that land on it (fewer with a stride or at a small
    map's padded border); ReLU6 passes the gradient where 0 < x < 6, not hardtanh's default
    (-1, 1). (Taking out_channels x kernel overstated each depthwise layer's gradient up to
    groups x stride^2-fold: the network's scales were seeded at the floor and its first layers'
    gradients underflowed to zero, issue 18.) Not asserted, measured here: two of the 1x1
    convolutions on the last blocks' 2x2 maps pass back 1.5-1.7x less than predicted (a batch
    norm over 32 values a channel correlates its gradients; at 32x32 images, 1x1 maps, up to 2.8x),
    and per-channel spreads are not modelled (a batch norm after a depthwise convolution passes
    back ~1.5x more)."""
    gm, inputs = _analyzed(mobilenet_case)
    measured = _measure(gm, inputs)
    factors = []
    for n in gm.graph.nodes:
        stride = n.args[3] if op_name(n) == "conv2d" else 1
        strided = op_name(n) == "conv2d" and (max(stride if isinstance(stride, tuple | list) else (stride,)) > 1
                                              or (len(n.args) > 6 and n.args[6] != 1))
        if not (strided or op_name(n) == "hardtanh") or measured[n].grad is None:
            continue
        x = n.args[0]
        if measured[x].grad is None:  # (the image)
            continue
        predicted = x.meta[MOMENTS_KEY]["grad"].std / n.meta[MOMENTS_KEY]["grad"].std
        actual = float(measured[x].grad.double().std() / measured[n].grad.double().std())
        groups = n.args[6] if op_name(n) == "conv2d" and len(n.args) > 6 else 1
        factors.append((n.name, groups, predicted / actual))
    assert len(factors) >= 20 and any(groups > 1 for _, groups, _ in factors)
    outside = [(name, groups, round(r, 2)) for name, groups, r in factors if not 1 / 1.5 <= r <= 1.5]
    assert not outside, outside


def _module_analyzed(model: nn.Module, x: torch.Tensor
                     ) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, torch.Tensor]]:
    """``model``'s graph for the loss ``(model(x) * r).sum()`` (``r`` fixed Gaussian noise: an output
    gradient independent of the weights, as deep in a network), analyzed, and its float32 measurement."""
    def loss(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (model(x) * r).sum()

    r = torch.randn_like(model(x), requires_grad=False).detach()
    (gm, example), = capture(loss, x, r)
    seed_inputs(gm, example)
    run_stage(gm, autoscale.Config(compute="native"), "dynamo", [PassSpec(analyze_underflow, "dynamo")])
    return gm, _measure(gm, example)


def _backward_factor(n: torch.fx.Node, measured: dict[torch.fx.Node, torch.Tensor]) -> float:
    """How much ``n``'s backward changes the gradient's spread, predicted over measured."""
    x = n.args[0]
    assert isinstance(x, torch.fx.Node)
    predicted = x.meta[MOMENTS_KEY]["grad"].std / n.meta[MOMENTS_KEY]["grad"].std
    return predicted / float(measured[x].grad.double().std() / measured[n].grad.double().std())


def test_batch_norm_of_a_spread_near_eps_divides_by_variance_plus_eps() -> None:
    """A train-mode batch norm divides by sqrt(var + eps): when the input's variance is near eps —
    Hugging Face's MobileNetV2 initializes its convolutions at std 0.02 and gives its batch norms
    eps 1e-3 — its output is well below unit spread, and its backward multiplies by less than
    1/std. Predicting 1/std instead compounded over MobileNetV2's 52 batch norms: its first
    layers' gradients were predicted 1000x too small, their scales seeded 2^9 too high, and the
    first four steps overflowed (issue 18)."""
    conv, bn = nn.Conv2d(4, 16, 1, bias=False), nn.BatchNorm2d(16, eps=1e-3)
    nn.init.normal_(conv.weight, std=0.02)
    gm, measured = _module_analyzed(nn.Sequential(conv, bn, nn.Conv2d(16, 8, 1)), torch.randn(8, 4, 6, 6))
    norm, = (n for n in gm.graph.nodes if op_name(n) == "batch_norm")
    assert float(measured[norm].detach().double().std()) < 0.8  # the case: var comparable to eps
    assert 0.9 <= _ratio(norm.meta[MOMENTS_KEY]["value"], measured[norm]) <= 1.1
    assert 0.8 <= _backward_factor(norm, measured) <= 1.25


def test_zero_padding_dilutes_and_a_convolution_reads_its_interior() -> None:
    """TF-style "same" padding written out (``F.pad`` then a convolution without padding, as Hugging
    Face's MobileNetV2 does): the pad's zeros dilute the spread (on a 2x2 map padded to 4x4 they
    are 3/4 of it), and the gradient the pad passes back is its interior's, where every element
    gets more kernel taps than the border's. (Taken as an identity, the pad doubled the spread
    predicted after it, and the interior's gradient was predicted 1.3x too small, once per block.)"""
    depthwise = nn.Conv2d(16, 16, 3, groups=16, bias=False)
    model = nn.Sequential(nn.ZeroPad2d(1), depthwise)
    gm, measured = _module_analyzed(model, torch.randn(8, 16, 2, 2, requires_grad=True))
    pad, = (n for n in gm.graph.nodes if op_name(n) == "pad")
    conv, = (n for n in gm.graph.nodes if op_name(n) == "conv2d")
    assert 0.9 <= _ratio(pad.meta[MOMENTS_KEY]["value"], measured[pad]) <= 1.1
    x = pad.args[0]
    assert isinstance(x, torch.fx.Node)
    interior = x.meta[MOMENTS_KEY]["grad"].std / conv.meta[MOMENTS_KEY]["grad"].std
    actual = float(measured[x].grad.double().std() / measured[conv].grad.double().std())
    assert 0.8 <= interior / actual <= 1.25


def test_a_tiny_trainable_multiplier_counts_at_an_update_size_in_the_backward() -> None:
    """ConvNeXt's layer scale starts at 1e-6 and one Adam step makes it ~1e-3: the gradients behind
    it grow 1000-fold. Predicted at 1e-6, their scales were 2^34 and the second step overflowed. In
    the backward a trainable parameter counts at least ``UPDATE_SIZE``; its value, and the values
    computed from it (what forward-overflow prediction reads), keep their real size, and an input
    (not a parameter) is never floored."""
    gamma = nn.Parameter(torch.full((8,), 1e-6))
    x = torch.randn(4, 8, requires_grad=True)
    (gm, example), = capture(lambda x, g: (x * g).sum(), x, gamma)  # noqa: B023
    seed_inputs(gm, example)
    run_stage(gm, autoscale.Config(compute="native"), "dynamo", [PassSpec(analyze_underflow, "dynamo")])
    by_name = {n.name: n.meta[MOMENTS_KEY] for n in gm.graph.nodes if MOMENTS_KEY in n.meta}
    assert by_name["l_g_"]["value"] == Moments.of(gamma)
    mul, = (n for n in gm.graph.nodes if op_name(n) == "mul")
    assert mul.meta[MOMENTS_KEY]["value"].std == pytest.approx(1e-6, rel=0.5)
    assert by_name["l_x_"]["grad"].std == pytest.approx(UPDATE_SIZE, rel=1e-6)  # not 1e-6
    rows = x.shape[0]  # gamma's gradient sums x over the rows it is broadcast to
    assert by_name["l_g_"]["grad"].std == pytest.approx(math.sqrt(rows) * float(x.double().pow(2).mean().sqrt()))


def test_unknown_op_makes_predictions_unknown_not_an_error() -> None:
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def f(x: torch.Tensor) -> torch.Tensor:
        return lin2(torch.special.bessel_j0(lin1(x))).sum()

    (gm, example), = capture(f, torch.randn(4, 8))
    seed_inputs(gm, example)
    run_stage(gm, autoscale.Config(), "dynamo", [PassSpec(analyze_underflow, "dynamo")])
    by_op = {op_name(n): n.meta[MOMENTS_KEY] for n in gm.graph.nodes if n.op == "call_function"}
    assert by_op["special_bessel_j0"]["value"] is None
    assert by_op["linear"]["grad"] is not None  # lin2's input gradient is still known…
    first = next(n for n in gm.graph.nodes if op_name(n) == "linear")
    assert first.meta[MOMENTS_KEY]["grad"] is None  # …but not through the unknown op


def test_dynamic_shapes_give_the_same_predictions() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    def total(t: torch.Tensor) -> torch.Tensor:
        return model(t).sum()

    (static, example), = capture(total, x)
    seed_inputs(static, example)
    run_stage(static, autoscale.Config(), "dynamo", [PassSpec(analyze_underflow, "dynamo")])
    dynamic_x = x.clone()
    torch._dynamo.mark_dynamic(dynamic_x, 0)
    (gm, example), = capture(total, dynamic_x)
    assert any(isinstance(s, torch.SymInt) for p in gm.graph.find_nodes(op="placeholder")
               for s in getattr(p.meta.get("example_value"), "shape", ()))
    seed_inputs(gm, example)
    run_stage(gm, autoscale.Config(), "dynamo", [PassSpec(analyze_underflow, "dynamo")])

    def stds(g: torch.fx.GraphModule) -> list[float]:
        return [n.meta[MOMENTS_KEY]["grad"].std for n in g.graph.nodes if op_name(n) == "linear"]

    assert stds(gm) == pytest.approx(stds(static), rel=1e-6)


def test_moments_of_a_tensor() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(3, 4), torch.empty(0), torch.tensor(-2.5), torch.randn(7).half() * 100,
               torch.zeros(5), torch.randn(4, 3).t()]  # the last one not contiguous
    for t in tensors:
        x = t.double().flatten()
        want = (x.mean(), (x * x).mean(), x.abs().max()) if x.numel() else (0.0, 0.0, 0.0)
        assert Moments.of(t) == pytest.approx(tuple(float(v) for v in want), rel=1e-12, abs=0.0)


def test_underflow_rate_model() -> None:
    """The share float16 flushes to zero: |x| <= 2^-25 (round to nearest even sends (2^-25, 2^-24)
    up to the smallest subnormal, and the tie at 2^-25 down to 0), under a Gaussian of the spread."""
    assert predicted_underflow(Moments(0.0, 1.0, 3.0)) == pytest.approx(math.erf(2.0**-25 / math.sqrt(2)))
    assert predicted_underflow(Moments(0.0, (2.0**-25) ** 2, 1e-7)) == pytest.approx(math.erf(1 / math.sqrt(2)))
    assert predicted_underflow(Moments(0.0, 0.0, 0.0)) == 1.0  # (the limit: a spread too small to represent)
    flushed = torch.tensor([2.0**-25, 2.0**-25 * 1.0001, 2.0**-24 * 0.75]).half()
    assert flushed.tolist() == [0.0, 2.0**-24, 2.0**-24]
    torch.manual_seed(0)
    x = torch.randn(1 << 20, dtype=torch.float64) * 2.0**-22  # a measured share against the model
    measured = float(((x != 0) & (x.float().half() == 0)).double().mean())
    assert measured == pytest.approx(predicted_underflow(Moments(0.0, 2.0**-44, 1e-5)), rel=0.02)


def test_stress_model_predicts_underflow_in_the_first_layers() -> None:
    """At scale 1 the analysis predicts what the stress test measures: the deep end underflows."""
    from benchmarks.stress_underflow import stress_model

    model, x, y = stress_model()
    gm, _ = _analyzed(lambda: (model, (x,), y))
    rates = [n.meta["autoscale_underflow"] for n in gm.graph.nodes
             if n.op == "placeholder" and n.name.endswith("weight_")]
    assert rates[0] > 0.5 and rates[-1] < 1e-3


def test_analysis_runs_under_no_grad() -> None:
    """An evaluation graph (compiled under torch.no_grad) is analysed too: values, no gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    with torch.no_grad():
        (gm, example), = capture(model, torch.randn(4, 8))
        seed_inputs(gm, example)
        run_stage(gm, autoscale.Config(), "dynamo", [PassSpec(analyze_underflow, "dynamo")])
    gelu = next(n for n in gm.graph.nodes if op_name(n) == "gelu")
    assert gelu.meta[MOMENTS_KEY]["value"] is not None


def test_calibration_replaces_predictions_with_one_measured_fp32_step() -> None:
    """With calibration the moments are the measured ones, exactly, and the step touched nothing:
    the ConvNet's batch-norm running statistics are unchanged."""
    model, inputs, targets = conv_case()

    def loss(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), targets)

    (gm, example), = capture(loss, *inputs)  # (runs the forward once: running stats move here)
    running = model.bn.running_mean.clone()
    seed_inputs(gm, example)
    calibrate(gm, example)
    assert torch.equal(model.bn.running_mean, running)
    run_stage(gm, autoscale.Config(), "dynamo", [PassSpec(analyze_underflow, "dynamo")])
    measured = _measure(gm, [x.detach().clone().requires_grad_(x.requires_grad) for x in example])
    for gemm in (n for n in gm.graph.nodes if op_name(n) == "conv2d"):
        predicted = gemm.meta[MOMENTS_KEY]
        assert predicted["value"].std == pytest.approx(float(measured[gemm].double().std()), rel=1e-3)
        assert predicted["grad"].std == pytest.approx(float(measured[gemm].grad.double().std()), rel=1e-3)


# ------------------------------------------------------------------ attention, masks, outputs


def _step(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor
          ) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, torch.Tensor]]:
    """``fn``'s graph, analyzed, and one float32 step of it (``reference_step``)."""
    (gm, example), = capture(fn, *inputs)
    seed_inputs(gm, example)
    run_stage(gm, autoscale.Config(compute="native"), "dynamo",
              [PassSpec(remove_inplace, "dynamo"), PassSpec(analyze_underflow, "dynamo")])
    return gm, reference_step(gm, example)


def _rms_ratio(node: torch.fx.Node, measured: dict[torch.fx.Node, torch.Tensor], kind: str = "grad") -> float:
    """Predicted over measured root mean square of ``node``'s value or gradient."""
    t = measured[node] if kind == "value" else measured[node].grad
    assert t is not None
    return math.sqrt(node.meta[MOMENTS_KEY][kind].ms) / float(t.detach().double().square().mean().sqrt())


def _named(gm: torch.fx.GraphModule, *names: str) -> list[torch.fx.Node]:
    by_name = {n.name: n for n in gm.graph.nodes}
    return [by_name[name] for name in names]


def _qkv(seed: int = 0, length: int = 32, spread: float = 1.0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(4, 2, length, 16, generator=g) * spread for _ in range(3))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), torch.randn(4, 2, length, 16, generator=g)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_attention_predicted_per_row_of_live_keys(causal: bool, scale: float | None) -> None:
    """scaled_dot_product_attention, with and without ``is_causal``, at the default scale and at
    T5's 1 (peaked weights): the output, dQ, dK and dV within 1.25 of one float32 step. A causal
    row i averages over i + 1 keys (its first rows keep most of V's spread, and pass dQ nothing);
    dV sums the dO of the queries that attend to a key, weighted. (The rule this replaces took a
    causal row as half the keys, ignored ``scale`` and took dV as dO: dV's spread came out 2.2-3.6x
    too large, dQ's and dK's up to 2.9x, and at scale 1 the output's 0.6x.)"""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale) * r).sum()

    gm, measured = _step(attend, *_qkv(spread=0.5 if scale == 1.0 else 1.0))
    out, = (n for n in gm.graph.nodes if op_name(n) == "scaled_dot_product_attention")
    ratios = {"out value": _rms_ratio(out, measured, "value"), "out grad": _rms_ratio(out, measured)}
    for name, arg in zip("qkv", out.args[:3], strict=True):
        assert isinstance(arg, torch.fx.Node)
        ratios[f"d{name}"] = _rms_ratio(arg, measured)
    outside = {k: round(r, 2) for k, r in ratios.items() if not 0.8 <= r <= 1.25}
    assert not outside, outside


@pytest.mark.parametrize("fill", ["masked_fill", "additive"])
def test_a_causal_mask_known_at_compile_time_shapes_the_softmax(fill: str) -> None:
    """Attention written out: ``scores.masked_fill(~tril, -inf)``, or ``scores + where(tril, 0,
    finfo.min)`` (Hugging Face's eager attention). The mask is built from constants, so the analysis
    computes it, and the softmax knows each row's live keys: its weights' mean square, the output
    and the gradients of q, k, v within 1.25 of one float32 step. The mask fill is no magnitude:
    the masked scores' predicted max is the scores' own."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        t = q.shape[-2]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if fill == "masked_fill":
            scores = scores.masked_fill(~causal, float("-inf"))
        else:
            scores = scores + torch.where(causal, 0.0, torch.finfo(torch.float32).min)
        return ((torch.softmax(scores, dim=-1) @ v) * r).sum()

    gm, measured = _step(attend, *_qkv())
    softmax, = (n for n in gm.graph.nodes if op_name(n) == "softmax")
    product = next(iter(softmax.users))
    masked = softmax.args[0]
    assert isinstance(masked, torch.fx.Node)
    ratios = {"weights": _rms_ratio(softmax, measured, "value"), "out": _rms_ratio(product, measured, "value"),
              "scores grad": _rms_ratio(masked, measured)}
    for name, node in zip("qkv", gm.graph.find_nodes(op="placeholder"), strict=False):
        ratios[f"d{name}"] = _rms_ratio(node, measured)
    outside = {k: round(r, 2) for k, r in ratios.items() if not 0.8 <= r <= 1.25}
    assert not outside, outside
    assert masked.meta[MOMENTS_KEY]["value"].amax < 100


def test_a_learned_position_bias_through_a_causal_mask_gets_its_gradient() -> None:
    """T5's decoder: the attention mask is a learned position bias with float32's finfo.min where
    the causal mask (built from constants) is False. The rows' live keys come from the mask's fill,
    the scores' spread adds the bias's; the bias's gradient is the scores' gradient, summed over the
    batch it is broadcast along. Within 1.25 of one float32 step (it had no rule: unknown)."""
    g = torch.Generator().manual_seed(1)
    bias = torch.nn.Parameter(torch.randn(1, 2, 32, 32, generator=g))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        causal = torch.ones(32, 32, dtype=torch.bool).tril()
        mask = torch.where(causal, bias, torch.finfo(torch.float32).min)
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0) * r).sum()

    q, k, v, r = _qkv(spread=0.3)
    gm, measured = _step(attend, q, k, v, r)
    where, = (n for n in gm.graph.nodes if op_name(n) == "where")
    out, = (n for n in gm.graph.nodes if op_name(n) == "scaled_dot_product_attention")
    ratios = {"out": _rms_ratio(out, measured, "value"), "mask grad": _rms_ratio(where, measured)}
    outside = {k: round(r, 2) for k, r in ratios.items() if not 0.8 <= r <= 1.25}
    assert not outside, outside


def test_a_returned_loss_is_what_the_gradient_comes_from() -> None:
    """A graph that returns its loss returns its logits beside it: only the loss gets a gradient
    (a cross-entropy gradient assumed on the logits doubled theirs). Without a loss, the outputs the
    graph also reads itself (a KV cache) get none: only the final ones (the logits) are assumed to
    feed a loss."""
    lin = nn.Linear(8, 8)
    x, y = torch.randn(4, 8), torch.randint(0, 8, (4,))

    def with_loss(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = lin(x)
        return F.cross_entropy(logits, y), logits

    def with_cache(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = lin(x)
        return lin(torch.relu(cache)), cache

    for fn, wanted in ((with_loss, "cross_entropy"), (with_cache, "linear")):
        (gm, example), = capture(fn, x)
        receiving = loss_outputs(gm)
        assert [op_name(n) for n in receiving] == [wanted]
        seed_inputs(gm, example)
        run_stage(gm, autoscale.Config(compute="native"), "dynamo", [PassSpec(analyze_underflow, "dynamo")])
        measured = reference_step(gm, example)
        first = next(n for n in gm.graph.nodes if op_name(n) == "linear")
        assert 0.7 <= _rms_ratio(first, measured) <= 1.4


def test_conv1d_as_addmm_and_a_selected_position() -> None:
    """GPT-2's projections are ``torch.addmm(bias, x, W)`` (it had no rule: everything after a
    GPT-2 projection was unknown); a classifier reading one position (``x[:, 0]``, the CLS token)
    passes back a gradient with zeros at every other position: its spread over the sequence is
    the position's over the length, while its max stays the position's."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(16, 48, generator=g) * 0.1, torch.randn(48, generator=g) * 0.1
    x = torch.randn(4, 32, 16, generator=g, requires_grad=True)
    r = torch.randn(4, 48, generator=g)

    def head(x: torch.Tensor) -> torch.Tensor:
        h = torch.addmm(b, x.view(-1, 16), w).view(4, 32, 48)
        return (h[:, 0] * r).sum()

    gm, measured = _step(head, x)
    addmm, = (n for n in gm.graph.nodes if op_name(n) == "addmm")
    assert 0.9 <= _rms_ratio(addmm, measured, "value") <= 1.1
    view = next(iter(addmm.users))
    assert 0.8 <= _rms_ratio(view, measured) <= 1.25
    x_node = gm.graph.find_nodes(op="placeholder")[0]
    assert 0.8 <= _rms_ratio(x_node, measured) <= 1.25
    peak = float(measured[view].grad.abs().max())  # type: ignore[union-attr]
    assert 0.5 <= view.meta[MOMENTS_KEY]["grad"].amax / peak <= 2.0


def test_batch_norm_divides_by_each_channels_own_variance() -> None:
    """A convolution of a ReLU's output (mean near its spread): each output channel's mean is the
    input's mean times that channel's weights' sum, which differs from channel to channel; a batch
    norm after it normalizes each channel by its own variance, without those differences. Its
    backward, predicted from the output's whole variance, came out ~2x too weak (compounding to
    4-20x at ResNet's stem); from the variance within a channel, within 1.25."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(), nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 8, 3, padding=1))
    gm, measured = _module_analyzed(model, torch.randn(8, 16, 6, 6) + 0.5)
    norm, = (n for n in gm.graph.nodes if op_name(n) == "batch_norm")
    assert 0.8 <= _backward_factor(norm, measured) <= 1.25


def test_convolution_on_a_small_map_reads_padding() -> None:
    """A padded 3x3 convolution on a 2x2 map: 4 of its 9 taps land inside on average. Its output's
    spread is of those taps (it was of all 9: 1.5x too high, MobileNetV2's last blocks)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 16, 3, padding=1, bias=False)
    gm, measured = _module_analyzed(nn.Sequential(conv), torch.randn(8, 16, 2, 2))
    node, = (n for n in gm.graph.nodes if op_name(n) == "conv2d")
    assert 0.9 <= _rms_ratio(node, measured, "value") <= 1.1


def test_max_pool_takes_the_largest_of_each_window() -> None:
    """ResNet's stem: a 3x3 max pool (stride 2) of a ReLU's output. The value is the largest of 9
    (it was taken as the input: 0.45 of its spread); the gradient goes to one input per window."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Conv2d(8, 8, 1))
    gm, measured = _module_analyzed(model, torch.randn(8, 8, 16, 16, requires_grad=True))
    pool, = (n for n in gm.graph.nodes if op_name(n) == "max_pool2d")
    assert 0.8 <= _rms_ratio(pool, measured, "value") <= 1.2
    relu = pool.args[0]
    assert isinstance(relu, torch.fx.Node)
    assert 0.7 <= _rms_ratio(relu, measured) <= 1.4


def test_values_known_at_compile_time_are_computed_and_random_ones_are_not() -> None:
    """A mask or index built from constants is computed at compile time (exact moments); a random
    op is not (the user's random stream is untouched), and a value computed from it stays a
    prediction."""
    def f(x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(8, dtype=torch.float32) / 4
        noise = torch.rand(8)
        return (x * steps + x * noise).sum()

    (gm, example), = capture(f, torch.randn(4, 8))
    seed_inputs(gm, example)
    state = torch.random.get_rng_state()
    values = forward_moments(gm)
    assert torch.equal(torch.random.get_rng_state(), state)
    by_op = {op_name(n): n for n in gm.graph.nodes}
    steps = by_op["truediv"]
    assert values[steps] == Moments.of(torch.arange(8, dtype=torch.float32) / 4)
    assert by_op["rand"].meta.get("autoscale_concrete") is None
    run_stage(gm, autoscale.Config(), "dynamo", [PassSpec(analyze_underflow, "dynamo")])
    assert all("autoscale_concrete" not in n.meta for n in gm.graph.nodes)  # (dropped after the pass)
