"""Graph-diff inspection (``autoscale.diff``): golden text, counts against the passes' own records,
the forward-overflow decisions (predicted, promoted, following) and checks, the JSON schema, and
the HTML page rendered by headless Chromium."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from autoscale import Config, ScalingConfig
from autoscale.diff import GraphDiff, OverflowDecision, diff, schema
from autoscale.inspect import precision_report
from autoscale.overflow import Promotion
from autoscale.passes import PIPELINE, PassRecord, run_stage
from autoscale.passes.analysis.seeding import seed_inputs
from autoscale.passes.dynamo.predict_overflow import PROMOTED_REASON
from autoscale.passes.graph_utils import dtype_name
from autoscale.protocol import FP16_MAX
from autoscale.runtime import install_state
from tests.helpers import capture
from tests.models import MLP, mlp_case

GOLDEN = Path(__file__).parent / "golden"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NATIVE_ALL = Config(compute="native", scaling=ScalingConfig(placement="all"))
"""Scale points everywhere (the tiny models predict no underflow, so "predicted" places none)."""


class TinyNet(nn.Module):
    """Linear-ReLU-Linear with the model's own ``float()`` and the loss inside: the diff shows
    painting, a folded cast, a float32 island and scale points."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))).float(), y)


def tiny_case() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return TinyNet(), (torch.randn(16, 4), torch.randint(0, 3, (16,)))


@pytest.fixture(scope="module")
def tiny() -> GraphDiff:
    torch._dynamo.reset()
    model, inputs = tiny_case()
    return diff(model, inputs, config=NATIVE_ALL)


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("AUTOSCALE_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with AUTOSCALE_UPDATE_GOLDEN=1 if intended"


# ------------------------------------------------------------------------------------ text


@pytest.mark.skipif(not torch.__version__.startswith("2.13"),
                    reason=f"the golden backward is AOTAutograd's ATen graph from torch 2.13, not {torch.__version__}")
def test_golden_text(tiny: GraphDiff) -> None:
    _golden("diff_tiny.txt", tiny.to_text())


def test_text_marks_every_change(tiny: GraphDiff) -> None:
    text = tiny.to_text()
    plus = [line for line in text.splitlines() if line.startswith("+ ")]
    minus = [line for line in text.splitlines() if line.startswith("- ")]
    fwd = tiny.forward
    # forward: one "+" per inserted or changed node, one "-" per removed or changed node
    fwd_plus = fwd.count("inserted") + fwd.count("changed")
    bwd = tiny.backward.entries
    bwd_groups = len({e.scale_op for e in bwd if e.scale_op})
    stats_runs = sum(1 for i, e in enumerate(bwd) if e.kind == "stats" and (i == 0 or bwd[i - 1].kind != "stats"))
    assert stats_runs == 1  # (the statistics fold: one line)
    bwd_plus = (sum(1 for e in bwd if e.scale_op is None and e.kind != "stats" and e.status in ("inserted", "changed"))
                + bwd_groups + stats_runs)
    assert len(plus) == fwd_plus + bwd_plus
    assert len(minus) == sum(s.count("removed") + s.count("changed") for s in (tiny.forward, tiny.backward))
    assert "\x1b[" not in text
    assert "\x1b[32m+ " in tiny.to_text(color=True)


def test_backward_only(tiny: GraphDiff) -> None:
    text = tiny.to_text(backward_only=True)
    assert "--- backward" in text and "--- forward" not in text
    assert str(tiny.summary) in text
    doc = tiny.to_json(backward_only=True)
    assert "forward" not in doc and doc["backward"]["entries"]
    sections = {n[0] for g in _payload(tiny.to_html(backward_only=True))["groups"] for n in g["nodes"]}
    assert sections == {"backward"}


def test_expanded_scale_ops_list_every_node(tiny: GraphDiff) -> None:
    lines = tiny.to_text(backward_only=True, expand_scale_ops=True).splitlines()
    members = sum(1 for e in tiny.backward.entries if e.scale_op is not None)
    assert members == sum(s.backward_nodes for s in tiny.scale_ops)
    named = {e.name for e in tiny.backward.entries if e.scale_op is not None}
    assert sum(1 for line in lines if line.startswith("+ ") and line[2:].split(":")[0] in named) == members


# ------------------------------------------------------------------------------------ counts


def _records(model: nn.Module, inputs: tuple[torch.Tensor, ...], config: Config) -> tuple[list[PassRecord], str]:
    """The Dynamo stage run independently of the diff, as the backend runs it; returns its records
    and the precision report's text."""
    model = copy.deepcopy(model)
    install_state(model)
    cfg = config.resolved(torch.device("cpu"))
    (gm, example), = capture(model, *inputs)
    seed_inputs(gm, example)
    records = run_stage(gm, cfg, "dynamo", PIPELINE)
    return records, str(precision_report(gm, dtype=dtype_name(cfg.dtype), compute=cfg.compute))


def _by_name(records: list[PassRecord]) -> dict[str, dict[str, int]]:
    return {r.name: dict(r.counts) for r in records}


@pytest.mark.parametrize("case", ["tiny", "mlp_emulated"])
def test_summary_counts_equal_pass_records(case: str) -> None:
    if case == "tiny":
        model, inputs = tiny_case()
        config = NATIVE_ALL
    else:
        model, inputs, _ = mlp_case()
        config = Config(compute="emulate", scaling=ScalingConfig(placement="all"))
    records, report = _records(model, inputs, config)
    passes = _by_name(records)
    torch._dynamo.reset()
    d = diff(model, inputs, config=config)
    s = d.summary

    # the diff ran the same passes, with the same results
    assert [(p.name, dict(p.counts)) for p in s.passes if p.stage == "dynamo"] == \
        [(r.name, dict(r.counts)) for r in records]
    joint = [p for p in s.passes if p.stage == "joint"]
    assert [p.name for p in joint] == [spec.name for spec in PIPELINE if spec.stage == "joint"]
    assert report.startswith(f"converted {s.converted} of {s.total} nodes to float16 using {s.casts} casts")

    # rescale points: what insert_grad_scaling counted, and what the sections show
    scaling = passes["insert_grad_scaling"]
    assert s.scale_points == scaling["scale_points"] > 0
    assert s.unscale_points == scaling["unscaled"]
    assert s.align_points == scaling["aligned"]
    assert d.forward.count("inserted", "scale") == s.scale_points
    assert d.forward.count("inserted", "unscale") == s.unscale_points
    assert Counter(i.kind for i in d.scale_ops) == Counter(
        {"scale": s.scale_points, "unscale": s.unscale_points, "align": s.align_points}) - Counter()
    groups = {e.scale_op for e in d.backward.entries if e.scale_op is not None}
    assert groups == {i.node for i in d.scale_ops}  # every rescale point has a backward

    # casts: inserted by convert_precision (and fold_casts' shortened recasts), minus those folded
    folded = passes["fold_casts"].get("erased", 0)
    assert len(d.forward.folded) == folded
    assert s.casts_folded == folded + sum(p.counts.get("erased", 0) for p in joint)
    created_folded = sum(1 for f in d.forward.folded if f.created_by in ("convert_precision", "fold_casts"))
    assert s.casts == (passes["convert_precision"]["casts"] + passes["fold_casts"].get("shortened", 0)
                       - created_folded)
    assert d.forward.count("inserted", "cast") == s.casts
    # emulated compute: the ops emulate_compute rewrote, shown changed (their arguments differ)
    assert s.emulated_ops == passes.get("emulate_compute", {}).get("emulated", 0)
    assert d.forward.count("changed", "emulated") == s.emulated_ops
    assert (s.emulated_ops > 0) == (s.compute == "emulate")
    # the model's own casts that were folded show as removed nodes
    own = {f.name for f in d.forward.folded if f.created_by is None}
    assert own <= {e.name for e in d.forward.entries if e.status == "removed"}
    # forward overflow checks: what insert_overflow_checks inserted (none predicted for these models)
    assert s.watched == passes["insert_overflow_checks"]["sites"] == d.forward.count("inserted", "check") > 0
    assert s.float32_for_overflow == passes["predict_overflow"]["predicted"] == len(d.overflow) == 0


def test_tiny_diff_contents(tiny: GraphDiff) -> None:
    fwd = {e.name: e for e in tiny.forward.entries}
    linear = fwd["linear"]
    assert (linear.status, linear.dtype_before, linear.dtype_after) == ("changed", "float32", "float16")
    assert linear.provenance is not None and linear.provenance.pass_name == "convert_precision"
    assert fwd["attach"].status == "removed"
    assert fwd["float_1"].status == "removed" and fwd["float_1"].provenance is not None
    assert fwd["float_1"].provenance.pass_name == "fold_casts"
    assert [i.op for i in tiny.summary.islands] == ["cross_entropy"]
    points = [i for i in tiny.scale_ops if i.kind == "scale"]
    assert {i.layer for i in points} == {"fc1", "fc2"}
    for i in points:
        assert i.row is not None and i.underflow is not None and 0 <= i.underflow <= 1
        assert i.scale > 1 and math.frexp(i.scale)[0] == 0.5  # a power of two
        assert fwd[i.node].scale == i
    # backward: the gradient casts derive from the forward casts that made them
    casts = [e for e in tiny.backward.entries if e.status == "inserted" and e.kind == "cast"]
    assert len(casts) == tiny.summary.backward_casts > 0
    for e in casts:
        assert e.provenance is not None and e.provenance.derived_from in fwd
        assert fwd[e.provenance.derived_from].provenance is not None


def test_user_model_untouched() -> None:
    model, inputs = tiny_case()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    d = diff(model, inputs, config=NATIVE_ALL)
    assert d.summary.scale_points > 0
    assert "forward" not in vars(model) and not list(model.buffers())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_model_with_scaler_state() -> None:
    model, inputs = tiny_case()
    autoscale.GradScaler(model)
    forward = model.forward
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    d = diff(model, inputs, config=NATIVE_ALL)
    assert d.summary.scale_points == 2
    assert model.forward is forward
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def test_graphs_after_a_graph_break_are_scaled_as_the_backend_scales_them() -> None:
    """The diff shows what the backend does: the graph after the break gets the scaler's state
    (three inputs with provenance: scales, statistics, forward peaks) and scale points of its own."""
    d = diff(_Broken(), (torch.randn(8, 16),), config=NATIVE_ALL)
    assert d.summary.graphs == 3  # the announcement's graph, and one on each side of the break
    points = [e.scale for e in d.forward.entries if e.scale is not None and e.scale.kind == "scale"]
    assert {p.layer for p in points} >= {"a", "b"}
    assert {p.graph for p in points} == {1, 2}
    added = [e for e in d.forward.entries if e.status == "inserted" and e.name.startswith("autoscale_")]
    assert len(added) == 6  # scales, statistics and forward peaks, in each graph
    assert all(e.provenance is not None and e.provenance.pass_name == "reach_state" for e in added)


# ------------------------------------------------------------------------------------ forward overflow


def hot_case() -> tuple[MLP, tuple[torch.Tensor, ...]]:
    """``tests.models``' MLP with ``fc2``'s weights 1e5 times larger (its output and the GELU after it
    reach ~8.6e4, beyond float16's 65504) and ``fc3``'s 1e4 times smaller (its output is small
    again, but it reads the GELU's)."""
    model, inputs, _ = mlp_case()
    assert isinstance(model, MLP)
    with torch.no_grad():
        model.fc2.weight.mul_(1e5)
        model.fc3.weight.mul_(1e-4)
    return model, inputs


@pytest.fixture(scope="module")
def hot() -> GraphDiff:
    model, inputs = hot_case()
    return diff(model, inputs)


def _measured(model: MLP, x: torch.Tensor) -> dict[str, float]:
    """The float32 max |x| of the values the MLP's forward graph names ``linear_1``, ``gelu`` and ``linear_2``."""
    with torch.no_grad():
        fc2 = model.fc2(F.relu(model.fc1(x)))
        gelu = F.gelu(fc2)
        return {name: float(v.abs().max()) for name, v in
                (("linear_1", fc2), ("gelu", gelu), ("linear_2", model.fc3(gelu)))}


def test_forward_overflow_predicted(hot: GraphDiff) -> None:
    """A layer whose output float16 cannot hold: it and the GELU after it are predicted, fc3 (which
    reads the GELU) follows them into float32; each with the analysis' max |x|, within 2x of the
    real one."""
    assert [(o.layer, o.op, o.node, o.source) for o in hot.overflow] == [
        ("fc2", "linear", "linear_1", "predicted"), ("", "gelu", "gelu", "predicted"),
        ("fc3", "linear", "linear_2", "follows")]
    model, (x,) = hot_case()
    measured = _measured(model, x)
    assert measured["linear_1"] > FP16_MAX  # the premise: float16 would make it inf
    fwd = {e.name: e for e in hot.forward.entries}
    for o in hot.overflow:
        assert o.graph == 0 and o.predicted_max is not None
        assert measured[o.node] / 2 <= o.predicted_max <= 2 * measured[o.node], (o, measured[o.node])
        entry = fwd[o.node]
        assert (entry.dtype_after, entry.layer) == ("float32", o.layer)
        assert entry.provenance is not None and entry.provenance.reason == o.reason
    assert hot.overflow[0].reason.startswith("forward overflow predicted: max |x|")
    assert hot.overflow[2].reason == "forward overflow: reads gelu, which float16 cannot hold"
    s = hot.summary
    assert s.float32_for_overflow == 3
    predict = [p for p in s.passes if p.name == "predict_overflow"]
    assert [p.counts["predicted"] for p in predict] == [2]
    # the rest of the model is still converted: fc1 and the ReLU
    assert (fwd["linear"].dtype_after, fwd["relu"].dtype_after) == ("float16", "float16")


def test_forward_overflow_in_text_json_and_html(hot: GraphDiff) -> None:
    lines = hot.to_text().splitlines()
    head = lines[:lines.index("--- forward before: Dynamo graph, as captured")]
    at = head.index("  forward overflow: 3 ops kept in float32 (2 predicted, 0 promoted at run time, 1 follows them); "
                    f"{hot.summary.watched} values watched at run time")
    assert head[at + 1:at + 4] == [
        f"    fc2 linear (node linear_1): {hot.overflow[0].reason.removeprefix('forward overflow ')}",
        f"    (model) gelu (node gelu): {hot.overflow[1].reason.removeprefix('forward overflow ')}",
        "    fc3 linear (node linear_2): reads gelu, which float16 cannot hold; predicted max |x| "
        f"{hot.overflow[2].predicted_max:.3g} vs float16's 65504"]

    jsonschema = pytest.importorskip("jsonschema")
    for doc in (hot.to_json(), hot.to_json(backward_only=True)):
        doc = json.loads(json.dumps(doc))
        jsonschema.Draft202012Validator(schema()).validate(doc)
        assert doc["overflow"]["watched"] == doc["summary"]["watched"] == hot.summary.watched > 0
        assert [OverflowDecision(**o) for o in doc["overflow"]["float32"]] == list(hot.overflow)
        assert doc["summary"]["float32_for_overflow"] == 3
    bad = json.loads(json.dumps(hot.to_json()))
    bad["overflow"]["float32"][0]["source"] = "guessed"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema()).validate(bad)

    page = _Classes()
    page.feed(hot.to_html())
    assert page.count("overflow", "numbers", "overflow") == 1
    assert (page.count("overflow", "predicted"), page.count("overflow", "follows")) == (2, 1)
    links = [a.get("href") for sec, tag, _, a in page.elements if sec == "overflow" and tag == "a"]
    rows = {r.layer: i for i, r in enumerate(hot.layers)}
    assert links == [f"#layer-{rows['fc2']}", f"#layer-{rows['']}", f"#layer-{rows['fc3']}"]  # their map rows
    ids = {a.get("id") for _, _, _, a in page.elements}
    assert all(href[1:] in ids for href in links if href)
    section = hot.to_html().split('<section id="overflow"')[1].split("</section>")[0]
    assert ">fc2</a></td>" in section and ">fc3</a></td>" in section and ">(model)</a></td>" in section


def test_forward_overflow_promoted_by_the_scaler(tiny: GraphDiff) -> None:
    """An op the user's GradScaler promoted after a run-time overflow is float32 in the diff, with
    the scaler's reason; the ReLU that reads it follows. Without the promotion (``tiny``) both are
    float16 and nothing is listed."""
    model, inputs = tiny_case()
    scaler = autoscale.GradScaler(model)
    assert scaler._state is not None
    scaler._state.forward.promote([Promotion("fc1:linear#0", 3, math.inf, "overflowed")])
    d = diff(model, inputs, config=NATIVE_ALL)
    assert [(o.layer, o.node, o.source, o.reason) for o in d.overflow] == [
        ("fc1", "linear", "promoted", PROMOTED_REASON),
        ("", "relu", "follows", "forward overflow: reads linear, which float16 cannot hold")]
    fwd = {e.name: e for e in d.forward.entries}
    assert (fwd["linear"].dtype_after, fwd["relu"].dtype_after) == ("float32", "float32")
    assert "1 promoted at run time" in d.to_text()
    assert "    fc1 linear (node linear): seen at run time: promoted by GradScaler" in d.to_text()
    assert list(scaler._state.forward.promoted) == ["fc1:linear#0"]  # the user's state as it was
    before = {e.name: e for e in tiny.forward.entries}
    assert (before["linear"].dtype_after, before["relu"].dtype_after) == ("float16", "float16")
    assert tiny.overflow == () and tiny.summary.float32_for_overflow == 0


def test_overflow_checks_are_check_entries_in_every_graph() -> None:
    """Every ``watch`` the pass inserted is an entry of kind "check", in every graph of a model with a
    graph break; the summary counts them as the pass does, summed over the graphs; decisions carry
    their graph."""
    torch.manual_seed(0)
    model = _Broken()
    with torch.no_grad():
        model.a.weight.mul_(1e5)  # a's output, and the ReLU's, beyond float16's range
        model.b.weight.mul_(1e-5)  # b's is not, but b reads the ReLU's (graph 2's input)
    d = diff(model, (torch.randn(8, 16),), config=NATIVE_ALL)
    checks = [e for e in d.forward.entries if e.kind == "check"]
    assert all(e.status == "inserted" and e.op == "watch" and e.dtype_after is None for e in checks)
    assert all(e.provenance is not None and e.provenance.pass_name == "insert_overflow_checks"
               and e.provenance.reason.startswith("overflow check of ") for e in checks)
    sites = [p.counts["sites"] for p in d.summary.passes if p.name == "insert_overflow_checks"]
    assert len(sites) == d.summary.graphs == 3
    assert d.summary.watched == len(checks) == sum(sites) > 0
    assert {e.graph for e in checks} == {1, 2}
    assert [(o.graph, o.layer, o.op, o.source) for o in d.overflow] == [
        (1, "a", "linear", "predicted"), (1, "", "relu", "predicted"), (2, "b", "linear", "follows")]
    assert "    b linear (node linear in graph 2): reads l_h_, which float16 cannot hold" in d.to_text()
    assert not any(e.kind == "check" for e in d.backward.entries)


def test_no_forward_overflow_line_without_checks() -> None:
    """bfloat16 has float32's range: nothing is kept in float32 or watched, and the text says nothing."""
    model, inputs = hot_case()
    d = diff(model, inputs, config=Config(dtype=torch.bfloat16))
    assert d.overflow == () and d.summary.watched == 0
    assert not any(e.kind == "check" for e in d.forward.entries)
    assert "forward overflow" not in d.to_text()
    assert d.to_json()["overflow"] == {"watched": 0, "float32": []}


def test_repeated_diffs_do_not_hit_the_recompile_limit() -> None:
    model, inputs = tiny_case()
    config = Config(compute="native", scaling=ScalingConfig(mode="none"))  # cheapest: no scale points
    config_ = torch._dynamo.config
    limit = getattr(config_, "recompile_limit", None) or config_.cache_size_limit
    for _ in range(limit + 1):
        assert diff(model, inputs, config=config).summary.scale_points == 0


# ------------------------------------------------------------------------------- the layer map


def test_layer_map(tiny: GraphDiff) -> None:
    rows = {r.layer: r for r in tiny.layers}
    assert [r.layer for r in tiny.layers] == ["fc1", "", "fc2"]  # in the order they compute
    points = {i.layer: i for i in tiny.scale_ops if i.kind == "scale"}
    for name in ("fc1", "fc2"):
        r = rows[name]
        assert (r.module, r.precision, r.weights, r.float32_ops, r.reason) == ("Linear", "float16", True, 0, "")
        assert r.scale_rows == (points[name].row,) and r.scale == points[name].scale
        assert r.predicted is not None and r.predicted.weight_underflow is not None and r.measured is None
    top = rows[""]  # the model's own ops: the ReLU in float16, the loss in float32 by the deny list
    assert (top.precision, top.low_ops, top.float32_ops) == ("mixed", 1, 1)
    assert top.reason.startswith("deny list") and not top.weights
    assert top.scale is None and top.predicted is not None and top.predicted.grad_max == pytest.approx(1.0)
    worst = max(tiny.layers, key=lambda r: r.predicted.weight_underflow if r.predicted and
                r.predicted.weight_underflow is not None else -1)
    s = tiny.summary
    assert (s.max_underflow_layer, s.underflow_unknown) == (worst.layer, 0)
    assert f"({worst.layer}, predicted)" in str(s)


def test_layer_map_in_bfloat16() -> None:
    """The map names the diff's low dtype: bfloat16 layers are bfloat16, not "none"."""
    model, inputs = tiny_case()
    d = diff(model, inputs, config=Config(dtype=torch.bfloat16, compute="native"))
    rows = {r.layer: r for r in d.layers}
    assert (rows["fc1"].precision, rows["fc1"].low_dtype, rows["fc1"].low_ops) == ("bfloat16", "bfloat16", 1)
    assert rows[""].precision == "mixed"
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(schema()).validate(json.loads(json.dumps(d.to_json())))


def test_measured_numbers_are_those_of_a_float32_step() -> None:
    model, (x, y) = tiny_case()
    d = diff(model, (x, y), config=NATIVE_ALL, measure=True)
    rows = {r.layer: r for r in d.layers}
    assert all(r.measured is not None for r in d.layers)
    # the same step in eager float32
    hidden = model.fc1(x)
    hidden.retain_grad()
    F.cross_entropy(model.fc2(torch.relu(hidden)), y).backward()
    fc1 = rows["fc1"].measured
    assert fc1 is not None and fc1.weight_grad_max is not None and fc1.forward_max is not None
    expected = max(model.fc1.weight.grad.abs().max(), model.fc1.bias.grad.abs().max())  # type: ignore[union-attr]
    assert fc1.weight_grad_max == pytest.approx(float(expected), rel=1e-6)
    # (its values include the input's cast into float16, which the layer's GEMM reads)
    assert fc1.forward_max == pytest.approx(max(float(x.abs().max()), float(hidden.detach().abs().max())), rel=1e-6)
    assert fc1.grad_max == pytest.approx(float(hidden.grad.abs().max()), rel=1e-6)  # type: ignore[union-attr]
    text = d.to_text(summary_only=True)
    table = text.split("\nper-layer map")[1].splitlines()
    assert "predicted / measured" in table[0] and all(" / " in line for line in table[2:5])


def test_a_runs_telemetry_joins_the_map(tmp_path: Path) -> None:
    """The layers of a GradScaler's telemetry log, matched by module path: the scales the run ended
    with (those of ``scaler.layers()``), its zero rates and overflows; in every rendering."""
    torch._dynamo.reset()
    model, (x, y) = tiny_case()
    log = tmp_path / "run.jsonl"
    scaler = autoscale.GradScaler(model, telemetry=log)
    compiled = torch.compile(model, backend=autoscale.backend(Config(compute="native")))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(compiled(x, y)).backward()
        scaler.step(opt)
        scaler.update()
    final = {layer.name: layer.scale for layer in scaler.layers()}
    torch._dynamo.reset()
    d = diff(model, (x, y), config=NATIVE_ALL, telemetry=log)
    rows = {r.layer: r for r in d.layers}
    for name in ("fc1", "fc2"):
        run = rows[name].run
        assert run is not None and run.final_scale == final[name] and run.overflows == 0
        assert 0 <= run.mean_zero_rate <= 1
    assert rows[""].run is None  # (no scale row of its own)
    table = d.to_text(summary_only=True).split("\nper-layer map")[1].splitlines()
    assert "run scale" in table[1] and "run overflows" in table[1] and table[1].endswith("why float32")
    jsonschema = pytest.importorskip("jsonschema")
    doc = json.loads(json.dumps(d.to_json()))
    jsonschema.Draft202012Validator(schema()).validate(doc)
    ran = {r["layer"]: r["run"]["final_scale"] for r in doc["layers"] if r["run"]}
    assert ran == {n: final[n] for n in ("fc1", "fc2")}
    assert "<th title=" in d.to_html() and ">run scale</th>" in d.to_html()
    with pytest.raises(ValueError, match="line 1"):  # not a telemetry log: refused, saying where
        bad = tmp_path / "bad.jsonl"
        bad.write_text("not json\n")
        diff(model, (x, y), config=NATIVE_ALL, telemetry=bad)


def test_summary_only_text_fits_a_terminal(tiny: GraphDiff) -> None:
    text = tiny.to_text(summary_only=True)
    assert text.startswith(f"autoscale diff: {tiny.summary}") and "per-layer map" in text
    assert "--- forward" not in text and "@@" not in text
    table = text.split("\nper-layer map")[1].splitlines()
    assert table[1].split() == ["layer", "module", "precision", "scale", "dW", "flushed", "dY", "flushed", "|dY|",
                                "max", "fwd", "max", "why", "float32"]
    assert [line.split()[0] for line in table[2:5]] == ["fc1", "(model)", "fc2"]
    assert len(text.splitlines()) < 25


def test_names_are_module_paths_and_markers_are_not_shown_raw(tiny: GraphDiff) -> None:
    for rendered in (tiny.to_text(), json.dumps(tiny.to_json()), tiny.to_html()):
        assert "\x1f" not in rendered and "\\x1f" not in rendered and "\\u001f" not in rendered
        assert "l_root_modules_" not in rendered and "l_root_buffers_" not in rendered  # Dynamo's names
        assert "fc1.weight" in rendered
    fwd = {e.name: e for e in tiny.forward.entries}
    assert fwd["attach"].before is not None and "<4 names>" in fwd["attach"].before
    unscale = next(i for i in tiny.scale_ops if i.kind == "unscale")
    assert unscale.reason.startswith("unscale the gradient of fc")  # (a module path, not a node name)
    backward = "\n".join(e.after or "" for e in tiny.backward.entries)
    assert "input _autoscale_scales:" in backward  # AOTAutograd's primals named by what they are


def test_no_gradients_no_backward() -> None:
    model, inputs = tiny_case()
    model.requires_grad_(False)
    d = diff(model, inputs, config=NATIVE_ALL)
    assert d.backward.entries == () and d.summary.scale_points == 0
    assert "nothing in the model requires a gradient" in d.to_text()
    assert "forward" in d.to_json()


def test_bad_arguments() -> None:
    model, inputs = tiny_case()
    with pytest.raises(ValueError, match="tuple"):
        diff(model, inputs[0], config=NATIVE_ALL)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="autoscale.Config"):
        diff(model, inputs, config=ScalingConfig())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ JSON


def test_json_validates_against_schema(tiny: GraphDiff) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    spec = schema()
    jsonschema.Draft202012Validator.check_schema(spec)
    for doc in (tiny.to_json(), tiny.to_json(backward_only=True)):
        doc = json.loads(json.dumps(doc))  # plain JSON types only
        jsonschema.Draft202012Validator(spec).validate(doc)
    doc = tiny.to_json()
    assert doc["schema_version"] == 5
    assert doc["overflow"] == {"watched": tiny.summary.watched, "float32": []}
    assert doc["summary"]["scale_points"] == tiny.summary.scale_points
    assert doc["forward"]["counts"]["inserted"] == tiny.forward.count("inserted")
    bad = json.loads(json.dumps(doc))
    bad["forward"]["entries"][0]["status"] = "moved"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(spec).validate(bad)


# ------------------------------------------------------------------------------------ HTML


def _payload(page: str) -> dict[str, Any]:
    """The node data a page carries (its script builds a layer's rows from it)."""
    tag = '<script type="application/json" id="diff-data">'
    start = page.index(tag) + len(tag)
    data: dict[str, Any] = json.loads(page[start:page.index("</script>", start)])
    return data


def test_html_is_self_contained(tiny: GraphDiff) -> None:
    page = tiny.to_html()
    assert page.startswith("<!DOCTYPE html>")
    for remote in ("http://", "https://", "<link", "@import", "url("):
        assert remote not in page
    assert 'id="overflow"' not in page  # no section without decisions
    # every node travels once, in the group of its layer, and every group has a row in the map
    data = _payload(page)
    nodes = [n for g in data["groups"] for n in g["nodes"]]
    assert len(nodes) == len(tiny.forward.entries) + len(tiny.backward.entries)
    assert [g["layer"] for g in data["groups"]][:len(tiny.layers)] == [r.layer for r in tiny.layers]
    entries = [(sec.name, e.graph, e.name, e.status, e.kind) for sec in (tiny.forward, tiny.backward)
               for e in sec.entries]
    assert Counter(tuple(n[:5]) for n in nodes) == Counter(entries)
    assert page.count('<tbody class="layer') == len(data["groups"])
    assert sum(1 for n in nodes if n[0] == "forward" and n[4] == "scale") == tiny.summary.scale_points


def test_html_escapes_the_payload(tiny: GraphDiff) -> None:
    """A line holding "</script>" (a string argument can) cannot end the page's node data early."""
    first = tiny.forward.entries[0]
    odd = dataclasses.replace(tiny, forward=dataclasses.replace(
        tiny.forward, entries=(dataclasses.replace(first, after="x </script><b>y"), *tiny.forward.entries[1:])))
    page = odd.to_html()
    assert any(n[6] == "x </script><b>y" for g in _payload(page)["groups"] for n in g["nodes"])
    assert page.count("</script>") == 2  # the data's and the code's


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (`make test` installs Debian's chromium when apt works)")


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--no-first-run", "--disable-extensions", *args],
                          capture_output=True, text=True, timeout=180, check=False)


def _png_pixels(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the decompressed (filtered) scanlines of a PNG, with the standard library."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


@needs_chromium
def test_html_screenshot(tiny: GraphDiff, tmp_path: Path) -> None:
    page = tmp_path / "diff.html"
    page.write_text(tiny.to_html())
    shot = tmp_path / "diff.png"
    result = _chromium(f"--screenshot={shot}", "--window-size=1400,900", page.as_uri())
    assert shot.exists(), result.stderr[-2000:]
    width, height, pixels = _png_pixels(shot)
    assert (width, height) == (1400, 900)
    # non-trivial: text and coloured rows, not a blank page (a blank one compresses to almost nothing)
    assert shot.stat().st_size > 20_000
    assert len(set(pixels)) > 64


class _Classes(HTMLParser):
    """Records, per element, its classes and the id of the <section> it is in (for a node's cell,
    the graph section it belongs to: ``data-section``)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str | None, str, set[str], dict[str, str | None]]] = []
        self.section: str | None = None
        self.root: dict[str, str | None] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "html":
            self.root = a
        if tag == "section":
            self.section = a.get("id")
        self.elements.append((a.get("data-section") or self.section, tag, set((a.get("class") or "").split()), a))

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self.section = None

    def count(self, section: str, *classes: str) -> int:
        return sum(1 for s, _, c, _ in self.elements if s == section and set(classes) <= c)


def _dom(page: Path, fragment: str = "") -> _Classes:
    result = _chromium("--dump-dom", page.as_uri() + fragment)
    assert result.returncode == 0 and "<section" in result.stdout, result.stderr[-2000:]
    dom = _Classes()
    dom.feed(result.stdout)
    assert dom.root.get("data-js") == "ready"  # the page's script ran without error
    return dom


@needs_chromium
def test_html_dom(tiny: GraphDiff, tmp_path: Path) -> None:
    page = tmp_path / "diff.html"
    page.write_text(tiny.to_html())
    s = tiny.summary
    closed = _dom(page)
    summary = next(a for _, _, _, a in closed.elements if a.get("id") == "summary")
    assert summary["data-scale-points"] == str(s.scale_points)
    assert summary["data-casts"] == str(s.casts)
    # the map first: one row per layer, the nodes folded away until a layer is opened
    assert closed.count("layers", "layer-row") == len(tiny.layers) == int(summary["data-layers"] or 0) > 0
    assert closed.count("forward", "node") == closed.count("backward", "node") == 0
    dom = _dom(page, "#all")  # every layer opened
    # forward: inserted casts and rescale points carry their highlight classes, as many as the summary says
    assert dom.count("forward", "node", "inserted", "scale") == s.scale_points > 0
    assert dom.count("forward", "node", "inserted", "unscale") == s.unscale_points
    assert dom.count("forward", "node", "inserted", "cast") == s.casts > 0
    assert dom.count("forward", "node", "inserted", "check") == s.watched > 0
    assert dom.count("forward", "node", "removed") == tiny.forward.count("removed")
    # backward: one highlighted group per rescale point, its ATen nodes inside
    assert dom.count("layers", "scale-op", "scale") == s.scale_points
    assert dom.count("layers", "scale-op", "unscale") == s.unscale_points
    assert dom.count("backward", "node", "inserted", "cast") == s.backward_casts > 0
    assert dom.count("backward", "node", "scale_op") == sum(i.backward_nodes for i in tiny.scale_ops)
    # a forward scale point shows its numbers in a badge
    assert sum(1 for _, tag, c, _ in dom.elements if tag == "span" and "badge" in c) == len(tiny.scale_ops)


# ------------------------------------------------------------------------------- a real model's size


@needs_chromium
@pytest.mark.parametrize("blocks", [2, pytest.param(12, marks=pytest.mark.slow)])
def test_the_page_of_a_12_layer_gpt2_stays_small_and_opens_fast(tmp_path: Path, blocks: int) -> None:
    """A GPT-2-size graph (12 blocks of Hugging Face's GPT-2, at a small width: the graph's size is
    the layers', not the width's): the page stays a few MiB (256 KiB a block) and the browser has
    it ready, and every layer's node rows built (``#all``), well within 2 s. Two blocks in the
    default suite."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=blocks, n_embd=32, n_head=2, vocab_size=128, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    d = diff(model, (torch.randint(1, 128, (2, 16)),))
    assert sum(1 for r in d.layers if r.module == "Conv1D") == blocks * 4
    page = tmp_path / "gpt2.html"
    page.write_text(d.to_html())
    assert page.stat().st_size < blocks * 2**18
    for fragment in ("", "#all"):
        dom = _dom(page, fragment)
        assert int(dom.root.get("data-ready-ms") or 1e9) < 2000
    assert dom.count("forward", "node") > 80 * blocks  # (#all: the rows are there)
    summary = d.to_text(summary_only=True)
    assert len(summary.splitlines()) < len(d.layers) + 20 and f"transformer.h.{blocks - 1}.mlp.c_proj" in summary


def test_the_model_imports_none_of_its_renderers() -> None:
    """The renderers depend on the data model, not the other way round: a new format is a new
    module, and the model's ``to_*`` methods hand the diff to the renderers only when called."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("autoscale.diff.model")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    top_level = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert not {m for m in top_level if m and m.endswith("_format")}, top_level
