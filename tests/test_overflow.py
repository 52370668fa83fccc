"""Forward overflow (docs/design.md#forward-overflow, docs/forward_overflow.md): predicted at compile time, found at run
time by the forward's checks, repaired by promoting the node that overflowed, and what is non-finite
in float32 too named instead of skipped forever.

The run-time tests overflow one node on purpose: a bias raised in place after the compile (as
training grows parameters), so that the compile-time prediction, made from the parameters of its
time, did not see it coming. (A bias shifts a layer's outputs without growing its gradients: the
gradient scales are not what is under test.)
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx import Interpreter, Node

import autoscale
from autoscale import Config, GradScaler, NonFiniteForwardError, OverflowConfig, ScalingConfig
from autoscale.ops import watch
from autoscale.overflow import ForwardSites, Site, SiteKind, alarm, diagnose, outputs_nonfinite
from autoscale.passes import PIPELINE, run_stage
from autoscale.passes.analysis.analyze_underflow import forward_moments
from autoscale.passes.analysis.moments import clear_caches
from autoscale.passes.analysis.seeding import seed_inputs
from autoscale.passes.dynamo.insert_overflow_checks import SITES_KEY
from autoscale.passes.graph_utils import PROVENANCE_KEY, op_name
from autoscale.passes.op_tables import Category, category_of
from autoscale.protocol import FP16_MAX
from autoscale.report import format_summary, load_telemetry, summarize
from autoscale.runtime import install_state
from benchmarks.overflow_models import T5, LogOfZero, t5_batch
from tests.helpers import assert_identical, capture
from tests.models import MLP, conv_case, mlp_case, transformer_case

EAGER = Config(executor="eager")


def _loss(model: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _step(run: Callable[..., torch.Tensor], scaler: GradScaler, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> tuple[float, bool]:
    """One training step; returns the loss and whether the step was skipped."""
    skips = scaler.skipped_steps
    opt.zero_grad(set_to_none=True)
    loss = _loss(run, x, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return float(loss.detach()), scaler.skipped_steps > skips


def _float32_ops(record: autoscale.CompileRecord) -> set[str]:
    """The layers of the ops a compile kept in float32 for forward overflow."""
    return {isl.op for isl in record.report.islands if isl.reason.startswith("forward overflow")}


# --------------------------------------------------------------------------- prediction


def _t5_case() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return T5(layers=1, ff_gain=28.0), t5_batch(0)


@pytest.mark.parametrize("case", ["mlp", "conv", "transformer", "t5"])
def test_prediction_is_within_2x_of_the_measured_forward_max(case: str) -> None:
    """Every value a float16 op could compute (allow and infer ops) is predicted, from the real
    example inputs and parameters, within a factor 2 of its max |x| in a float32 run. T5 is the
    overflowing one (feed-forward outputs ~7e4); its attention scores hold a causal mask's fill
    value (finfo(float32).min), which is a sentinel, not a magnitude, and is left out."""
    model, inputs = _t5_case() if case == "t5" else {
        "mlp": mlp_case, "conv": conv_case, "transformer": transformer_case}[case]()[:2]
    (gm, example), = capture(model, *inputs)
    seed_inputs(gm, example)
    predicted = forward_moments(gm)
    clear_caches()
    measured: dict[Node, float] = {}

    class Measure(Interpreter):
        def run_node(self, n: Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
                measured[n] = float(out.detach().abs().max())
            return out

    Measure(gm).run(*example)
    ratios = {n.name: predicted[n].amax / measured[n] for n in measured  # type: ignore[union-attr]
              if n.op in ("call_function", "call_method") and measured[n] > 0
              and measured[n] < torch.finfo(torch.float32).max
              and category_of(op_name(n) or "") in (Category.ALLOW, Category.INFER)
              and predicted.get(n) is not None}
    candidates = [n for n in measured if category_of(op_name(n) or "") in (Category.ALLOW, Category.INFER)]
    assert len(ratios) >= len(candidates) - 2  # (at most the two masked score tensors of the T5 go)
    assert all(0.5 <= r <= 2.0 for r in ratios.values()), {k: round(r, 2) for k, r in ratios.items()
                                                           if not 0.5 <= r <= 2.0}
    if case == "t5":
        assert max(measured.values(), key=lambda m: m if m < 1e38 else 0) > FP16_MAX


def test_t5_feed_forward_is_predicted_and_training_never_goes_nan() -> None:
    """The issue's failure, on a 1+1-layer T5 v1.1-style model: its feed-forward outputs are above
    65504 from the first step. The analysis keeps each ``wo`` (and what reads it) in float32 at
    compile time: no non-finite loss, no skipped step, no recompile, and the loss falls as float32's."""
    model, inputs = _t5_case()
    reference = copy.deepcopy(model)
    scaler = GradScaler(model)
    backend = autoscale.backend(EAGER)
    run = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = run(*inputs)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = reference(*inputs)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(float(ref_loss.detach()))
    assert all(math.isfinite(x) for x in losses) and scaler.skipped_steps == 0 and len(backend.records) == 1
    counts = {p.name: p.counts for p in backend.records[0].passes}
    assert counts["predict_overflow"]["predicted"] > 0 and counts["predict_overflow"]["promoted"] == 0
    kept = {r.name: r.float32_ops for r in scaler.layers() if r.float32_ops}
    assert kept == {"encoder.0.ff.wo": ("linear#0: predicted",), "decoder.0.ff.wo": ("linear#0: predicted",)}
    assert losses == pytest.approx(ref_losses, rel=1e-2)


@pytest.mark.parametrize("case", [mlp_case, conv_case, transformer_case], ids=["mlp", "conv", "transformer"])
def test_models_without_overflow_are_unchanged(case: Callable[..., Any]) -> None:
    """The prediction changes nothing in a model that does not overflow, and the checks only read:
    with the default OverflowConfig the rewritten graph is, node for node (dtype, op, arguments,
    provenance), the graph without any forward-overflow work, plus the ``watch`` nodes."""
    model, inputs, _ = case()
    install_state(model)
    (gm, example), = capture(model, *inputs)
    graphs = []
    for overflow in (OverflowConfig(), OverflowConfig(predict=False, watch=False)):
        copy_ = copy.deepcopy(gm)
        seed_inputs(copy_, example)
        cfg = Config(overflow=overflow, verify=True).resolved(torch.device("cpu"))
        records = run_stage(copy_, cfg, "dynamo", PIPELINE)
        counts = {r.name: r.counts for r in records}
        graphs.append(([(n.name, str(n.target), str(n.args), n.meta.get("val").dtype  # type: ignore[union-attr]
                         if isinstance(n.meta.get("val"), torch.Tensor) else None,
                         n.meta.get(PROVENANCE_KEY, {}).get("reason"))
                        for n in copy_.graph.nodes if n.target is not watch], counts))
    (with_checks, counts), (without, _) = graphs
    assert counts["predict_overflow"] == {"predicted": 0, "promoted": 0}
    assert counts["insert_overflow_checks"]["sites"] > 0
    assert with_checks == without


class _Attention(nn.Module):
    """An RMS norm written out (with its affine weight, as T5's and Llama's), rotary embeddings
    computed in float32 (as Llama's), attention written out, and the look-alikes that are not
    bounded: a value scaled by a parameter without a norm, a sum of two rotated values, softmax
    weights contracted over the dimension they do not sum to 1 along, attention with a dropout
    that can lift its output above the alarm of ``v``'s, and a normalized value scaled up, not down
    (T5's rescale before its tied head scales down)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.norm_weight, self.gain = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.q, self.k, self.v, self.o, self.down, self.up = (nn.Linear(d, d) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # mul#0, mul#1
        g = self.gain * x  # mul#2
        q, k, v = self.q(h), self.k(h), self.v(g)
        angle = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * torch.ones(x.shape[-1])
        q = q * angle.cos() + torch.cat((-q[..., 32:], q[..., :32]), -1) * angle.sin()  # neg#0, add#1
        w = F.softmax((q @ k.transpose(-1, -2)).float(), dim=-1).type_as(q)  # matmul#0
        fused = F.scaled_dot_product_attention(q, k, v) + F.scaled_dot_product_attention(q, k, v, dropout_p=0.6)
        out = self.o(w @ v + w.transpose(-1, -2) @ v + fused)  # matmul#1, matmul#2
        return out + self.down(h * 64**-0.5) + self.up(h * 4.0)  # mul#6, mul#7


def test_values_that_cannot_overflow_first_are_not_watched() -> None:
    """A normalized value cast into float16 (an RMS norm written out, its affine weight applied
    apart; scaled down by a constant), a float16 value's elements negated in float32 and cast back
    (RoPE's ``rotate_half``),
    and attention's weighted average of ``v`` (``softmax(s) @ v``, ``scaled_dot_product_attention``)
    cannot overflow while what they are computed from is finite, and that is watched: no check of
    their own. What merely looks like them is watched."""
    model = _Attention()
    install_state(model)
    (gm, example), = capture(model, torch.randn(2, 8, 64))
    seed_inputs(gm, example)
    run_stage(gm, Config(verify=True).resolved(torch.device("cpu")), "dynamo", PIPELINE)
    watched = {site.key for site in gm.meta[SITES_KEY]}
    assert not {":mul#1@float16", ":mul#6@float16", ":neg#0@float16", ":matmul#1",
                ":scaled_dot_product_attention#0"} & watched, watched
    looks_alike = {":mul#2@float16", ":mul#7@float16", ":add#1@float16", ":matmul#2", ":scaled_dot_product_attention#1"}
    assert looks_alike | {":matmul#0", "q:linear#0", "v:linear#0"} <= watched, watched


# ---------------------------------------------------------------------------- run time


def _mlp_run(config: Config = EAGER) -> tuple[MLP, torch.Tensor, torch.Tensor, GradScaler, autoscale.Backend,
                                               Callable[..., torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model, (x,), y = mlp_case()
    scaler = GradScaler(model, config)
    backend = autoscale.backend(config)
    run = torch.compile(model, backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, x, y, scaler, backend, run, opt  # type: ignore[return-value]


def test_an_overflow_injected_into_one_node_blames_that_node_only_and_is_repaired() -> None:
    """fc2's bias grows to 1e5 after the compile: its float16 output overflows at the next step, and
    everything downstream is non-finite too. The step is skipped with weights and optimizer state
    bit-identical and no gradient scale backed off; only fc2's linear is promoted, at once; the
    recompiled graph (whose prediction now sees the grown bias and keeps what follows fc2 in float32
    too) trains on without another skip."""
    model, x, y, scaler, backend, run, opt = _mlp_run()
    assert _step(run, scaler, opt, x, y)[1] is False
    with torch.no_grad():
        model.fc2.bias.add_(1e5)
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    scales = {r.name: r.scale for r in scaler.layers()}
    loss, skipped = _step(run, scaler, opt, x, y)
    assert skipped and not math.isfinite(loss)
    assert_identical(model.state_dict(), weights)
    assert_identical(opt.state_dict(), state)
    assert {r.name: r.scale for r in scaler.layers()} == scales  # the forward's doing, not a scale's
    assert [(p.key, p.step, p.reason) for p in scaler.promotions()] == [("fc2:linear#0", 2, "overflowed")]
    assert math.isinf(scaler.promotions()[0].observed)
    for _ in range(3):
        loss, skipped = _step(run, scaler, opt, x, y)
        assert math.isfinite(loss) and not skipped
    assert len(backend.records) == 2  # one recompile for the one overflow site
    assert "linear" in _float32_ops(backend.records[1])
    assert ("fc2", ("linear#0: promoted at step 2",)) in {(r.name, r.float32_ops) for r in scaler.layers()}


def test_a_step_that_measures_nothing_watches_nothing_and_the_next_finds_its_overflow() -> None:
    """``measure_every``: a step that measures nothing runs a forward with no check (its graph has
    no site). fc2's bias grows before such a step: the step is skipped, with nothing promoted and no
    scale moved; the next step measures and watches, is skipped too, and promotes fc2's linear,
    as the first step to see it does with every step measured; training goes on."""
    torch.manual_seed(0)
    model, (x,), y = mlp_case()
    scaler = GradScaler(model, ScalingConfig(measure_every=4))
    backend = autoscale.backend(EAGER)
    run = torch.compile(model, backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    assert [_step(run, scaler, opt, x, y)[1] for _ in range(2)] == [False, False]
    sites = [{r.name: r.counts for r in record.passes}["insert_overflow_checks"]["sites"] for record in backend.records]
    assert sites[0] > 0 and sites[1] == 0  # (the measured graph's, then the other's)
    assert scaler._state is not None and not scaler._state.measuring
    with torch.no_grad():
        model.fc2.bias.add_(1e5)
    scales = {r.name: r.scale for r in scaler.layers()}
    assert _step(run, scaler, opt, x, y)[1] is True
    assert not scaler.promotions() and {r.name: r.scale for r in scaler.layers()} == scales
    assert scaler._state.measuring
    assert _step(run, scaler, opt, x, y)[1] is True
    assert [(p.key, p.step, p.reason) for p in scaler.promotions()] == [("fc2:linear#0", 4, "overflowed")]
    assert {r.name: r.scale for r in scaler.layers()} == scales  # (the forward's doing, not a scale's)
    for _ in range(4):  # (a period: the recompiled graphs, both)
        loss, skipped = _step(run, scaler, opt, x, y)
        assert math.isfinite(loss) and not skipped


def test_a_value_near_float16s_max_is_promoted_before_it_overflows() -> None:
    """A float16 value above ``threshold`` x 65504 (default half) is promoted at the step it is seen,
    which was a good step: nothing is skipped."""
    model, x, y, scaler, backend, run, opt = _mlp_run()
    _step(run, scaler, opt, x, y)
    with torch.no_grad():  # every logit up by 4e4 (above half of 65504), the softmax unchanged
        model.fc3.bias.add_(4e4)
    assert _step(run, scaler, opt, x, y)[1] is False
    (promotion,) = scaler.promotions()
    assert (promotion.key, promotion.reason) == ("fc3:linear#0", "near float16's max")
    assert FP16_MAX / 2 < promotion.observed < FP16_MAX
    _step(run, scaler, opt, x, y)
    assert len(backend.records) == 2 and scaler.skipped_steps == 0


def test_an_output_that_widens_a_watched_value_is_not_watched_again() -> None:
    """The logits are fc3's float16 output cast to float32: one check, fc3's, marked as the graph's
    output (a second would read the same values again: a whole pass over an LM's logits). When fc3
    overflows, that one check says both things: the output is non-finite (the forward's doing, so no
    gradient scale backs off) and fc3 is where it began (promoted)."""
    model, x, y, scaler, backend, run, opt = _mlp_run()
    _step(run, scaler, opt, x, y)
    sites = {s.key: s for s in scaler._state.forward.sites}  # type: ignore[union-attr]
    assert [(key, s.kind) for key, s in sites.items() if s.output] == [("fc3:linear#0", "float16")]
    assert not [key for key in sites if key.endswith("@output")]
    scales = {r.name: r.scale for r in scaler.layers()}
    with torch.no_grad():
        model.fc3.bias.add_(1e5)
    assert _step(run, scaler, opt, x, y)[1] is True
    assert {r.name: r.scale for r in scaler.layers()} == scales
    assert [(p.key, p.reason) for p in scaler.promotions()] == [("fc3:linear#0", "overflowed")]


def _promoted_fc2(tmp_path: Path | None = None) -> tuple[MLP, torch.Tensor, torch.Tensor, GradScaler]:
    """The MLP after fc2 overflowed once and was promoted (with telemetry when ``tmp_path``)."""
    torch.manual_seed(0)
    model, (x,), y = mlp_case()
    scaler = GradScaler(model, EAGER, telemetry=tmp_path / "run.jsonl" if tmp_path else None)
    run = torch.compile(model, backend=autoscale.backend(EAGER))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _step(run, scaler, opt, x, y)  # (compiled from the parameters as they are)
    with torch.no_grad():
        model.fc2.bias.add_(1e5)
    _step(run, scaler, opt, x, y)
    with torch.no_grad():
        model.fc2.bias.sub_(1e5)
    _step(run, scaler, opt, x, y)
    assert [p.key for p in scaler.promotions()] == ["fc2:linear#0"]
    return model, x, y, scaler  # type: ignore[return-value]


def test_a_promotion_survives_a_state_dict_round_trip() -> None:
    """A resumed run does not relearn: a new model and scaler loaded from the state dict compile
    fc2 in float32 at their first compile, and their scaler reports the promotion's step."""
    model, x, y, scaler = _promoted_fc2()
    saved = scaler.state_dict()
    assert json.loads(json.dumps(saved["forward"])) == saved["forward"]  # plain data
    torch.manual_seed(1)
    fresh = MLP()
    fresh.load_state_dict(model.state_dict())
    resumed = GradScaler(fresh, EAGER)
    resumed.load_state_dict(saved)
    backend = autoscale.backend(EAGER)
    run = torch.compile(fresh, backend=backend)
    _step(run, resumed, torch.optim.SGD(fresh.parameters(), lr=0.0), x, y)
    assert len(backend.records) == 1 and "linear" in _float32_ops(backend.records[0])
    assert [(p.key, p.step) for p in resumed.promotions()] == [("fc2:linear#0", 2)]
    assert resumed.state_dict()["forward"] == saved["forward"]


def test_convert_applies_promotions_and_keeps_them_through_save_and_load(tmp_path: Path) -> None:
    """A converted module rewrites its graph when its scaler promotes (its recompile), and the saved
    file keeps both the promoted graph and the promotions: a loaded module computes fc2 in float32
    and its scaler knows why."""
    torch.manual_seed(0)
    model, (x,), y = mlp_case()
    converted = autoscale.convert(model, (x,))
    scaler = GradScaler(converted)
    opt = torch.optim.SGD(converted.parameters(), lr=0.0)
    with torch.no_grad():
        model.fc2.bias.add_(1e5)
    assert _step(converted, scaler, opt, x, y)[1]  # skipped, fc2 promoted
    with torch.no_grad():
        model.fc2.bias.sub_(1e5)
    assert not _step(converted, scaler, opt, x, y)[1]
    assert "linear" in _float32_ops(converted.record)
    path = tmp_path / "mlp.autoscale"
    autoscale.save(converted, path)
    loaded = autoscale.load(path)
    assert "linear" in _float32_ops(loaded.record)
    reasons = [n.meta[PROVENANCE_KEY]["reason"] for n in loaded.graph_module.graph.nodes
               if n.meta.get(PROVENANCE_KEY, {}).get("precision") == "float32"
               and n.meta[PROVENANCE_KEY]["reason"].startswith("forward overflow seen at run time")]
    assert len(reasons) == 1
    assert [p.key for p in GradScaler(loaded).promotions()] == ["fc2:linear#0"]
    assert torch.equal(loaded(x), converted(x))


def test_the_recompile_cap_holds() -> None:
    """With ``max_recompiles=1`` the second overflow site is not promoted: its steps are skipped
    with a warning, and after ``patience`` of them the scaler raises instead of skipping forever."""
    config = Config(executor="eager", overflow=OverflowConfig(max_recompiles=1, patience=2))
    model, x, y, scaler, backend, run, opt = _mlp_run(config)
    _step(run, scaler, opt, x, y)
    with torch.no_grad():
        model.fc3.bias.add_(1e5)
    assert _step(run, scaler, opt, x, y)[1]  # fc3 overflows: promoted (recompile 1 of 1)
    assert not _step(run, scaler, opt, x, y)[1]
    with torch.no_grad():
        model.fc1.bias.add_(1e5)
    assert _step(run, scaler, opt, x, y)[1]  # fc1 overflows: the cap is spent
    with pytest.raises(NonFiniteForwardError, match=r"fc1 \(linear, float16\): inf.*max_recompiles=1 spent"):
        _step(run, scaler, opt, x, y)
    assert len(backend.records) == 2
    assert [p.key for p in scaler.promotions()] == ["fc3:linear#0"]


@pytest.mark.parametrize("every", [1, 2], ids=["every step measured", "measure_every=2"])
def test_a_value_non_finite_in_float32_too_is_named_and_stops_the_run(every: int) -> None:
    """log(relu(.)) of a layer with dead units is -inf in float32: no promotion can help. Each such
    step is skipped (weights untouched) with a warning naming the op and the model's line, and the
    ``patience``-th raises NonFiniteForwardError. With ``measure_every``, alike: a skipped step has
    the next one measure, and watch."""
    torch.manual_seed(0)
    model = LogOfZero()
    x, y = torch.randn(32, 16), torch.randn(32)
    weights = copy.deepcopy(model.state_dict())
    scaler = GradScaler(model, ScalingConfig(measure_every=every))
    run = torch.compile(model, backend=autoscale.backend(EAGER))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        scaler.scale(run(x, y)).backward()
        scaler.step(opt)
        scaler.update()

    step()
    step()
    # (a skipped step that watched nothing, as a step that measures nothing reads on CUDA when the
    # host learns of the last skip a step late, neither ends the run nor adds to it)
    assert scaler._snapshot is not None and scaler._repair is not None
    snapshot = torch.zeros_like(scaler._snapshot)
    scaler._repair.read(snapshot, 0.0, 1.0, step=3, watched=False)
    assert scaler._repair.streak == 2
    where = r"\(log, float32 -> float16\): inf \[overflow_models\.py:\d+: h = torch\.log"
    with pytest.raises(NonFiniteForwardError, match=where + r".*promoting cannot help.*3 in a row"):
        step()
    assert scaler.skipped_steps == 3 and not scaler.promotions()
    assert_identical(model.state_dict(), weights)


def test_telemetry_and_report_show_the_promotion(tmp_path: Path) -> None:
    _promoted_fc2(tmp_path)
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and [r["skipped"] for r in records] == [False, True, False]
    assert records[1]["forward"]["promoted"] == [
        {"key": "fc2:linear#0", "step": 2, "observed": "inf", "reason": "overflowed"}]
    assert records[1]["forward"]["overflowed"] == ["fc2:linear#0"]
    assert "forward" not in records[0] and "forward" not in records[2]
    assert records[2]["layers"]["fc2"]["float32_ops"] == ["linear#0: promoted at step 2"]
    text = format_summary(summarize(load_telemetry(tmp_path / "run.jsonl")))
    assert "  step 2: fc2:linear#0 computed in float32 from the next step (inf, overflowed)" in text
    assert "  step 2: fc2:linear#0 overflowed in float16" in text


# ------------------------------------------------------------------ diagnosis, on its own


def _site(key: str, kind: SiteKind, upstream: tuple[int, ...] = (), output: bool = False) -> Site:
    return Site(key, key.split(":")[0], "op", kind, None, "test", upstream, output)


@pytest.mark.parametrize(("kinds", "peaks", "skipped", "expected"), [
    # a float16 chain: the first non-finite value is the origin, not what it feeds
    (["float16", "float16", "float16"], [1.0, math.inf, math.nan], True, ((1,), (), ())),
    # a mask's fill value cast to float16 on a good step: a sentinel, nobody is blamed
    (["cast", "float16"], [3.4e38, math.inf], False, ((), (), ())),
    # ... on a skipped step: the cast made it inf, the cast is blamed
    (["cast", "float16"], [7e4, math.inf], True, ((0,), (), ())),
    # a float32 value non-finite (log 0) and the cast of it: float32's problem
    (["float32", "cast", "float16"], [math.inf, math.inf, math.nan], True, ((), (), (0,))),
    # a float32 -inf that the step did not mind (log_softmax of a masked row): left alone
    (["float32"], [math.inf], False, ((), (), ())),
    # near: a float16 value and a cast source above half of 65504, not above 65504
    (["float16", "cast", "cast"], [4e4, 5e4, 7e4], False, ((), (0, 1), ())),
])
def test_diagnose(kinds: list[SiteKind], peaks: list[float], skipped: bool,
                  expected: tuple[tuple[int, ...], ...]) -> None:
    sites = [_site(f"s{i}:op#0", k, (i - 1,) if i else ()) for i, k in enumerate(kinds)]
    d = diagnose(sites, torch.tensor(peaks), 0.5, skipped=skipped)
    assert (d.overflowed, d.near, d.float32) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["float16", "cast", "float32"]), st.sets(st.integers(0, 15), max_size=3),
                          st.sampled_from([0.0, 1.0, 4e4, 7e4, math.inf, math.nan])), min_size=1, max_size=16),
       st.booleans())
def test_diagnose_blames_origins_only(spec: list[tuple[SiteKind, set[int], float]], skipped: bool) -> None:
    """On any graph of sites: a blamed site (float16 overflow or float32 non-finite) is itself bad
    and none of the sites it is computed from is; a good step blames nothing computed in float32."""
    sites = [_site(f"s{i}:op#0", kind, tuple(sorted(u for u in ups if u < i))) for i, (kind, ups, _) in enumerate(spec)]
    peaks = [p for _, _, p in spec]
    d = diagnose(sites, torch.tensor(peaks), 0.5, skipped=skipped)
    bad = {i for i, s in enumerate(sites) if s.bad(peaks[i])}
    for i in (*d.overflowed, *d.float32):
        assert i in bad and not bad & set(sites[i].upstream)
    assert not set(d.overflowed) & set(d.float32)
    if not skipped:
        assert not d.float32 and all(sites[i].kind == "float16" for i in d.overflowed)
    assert all(math.isfinite(peaks[i]) for i in d.near)


def test_device_flags() -> None:
    """What the device computes each step, without a host sync: whether to look at the peaks, and
    whether a graph output was non-finite (then no gradient scale backs off)."""
    forward = ForwardSites(8)
    for site in (_site("a:op#0", "float16"), _site("b:op#0", "cast"), _site("c:op#0", "float32", output=True)):
        forward.register(site, 0.5)
    peaks = torch.zeros(8)

    def look() -> torch.Tensor:
        return alarm(peaks, forward.alarm_low, forward.alarm_high)

    assert not look() and not outputs_nonfinite(peaks, forward.outputs)
    for slot, value, expected in [(0, 4e4, True), (0, math.inf, True), (1, 4e4, True), (1, 3.4e38, False),
                                  (2, math.inf, False), (2, math.nan, True)]:
        peaks.zero_()
        peaks[slot] = value
        assert bool(look()) is expected, (slot, value)
    peaks.zero_()
    peaks[2] = math.inf
    assert outputs_nonfinite(peaks, forward.outputs)
