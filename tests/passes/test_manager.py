"""The pass manager checks the pipeline's invariants after every pass that changed the graph."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.fx import GraphModule

import autoscale
from autoscale.passes import PIPELINE, InvariantError, PassResult, PassSpec, check_order, run_stage
from autoscale.passes.graph_utils import provenance, retyped
from tests.helpers import capture
from tests.models import mlp_case


def _graph() -> GraphModule:
    model, (x,), _ = mlp_case()
    (gm, _), = capture(model, x)
    return gm


def _relu_after_first_linear(gm: GraphModule, *, record: bool, val: bool = True) -> PassResult:
    linear = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(linear):
        extra = gm.graph.call_function(torch.relu, (linear,))
    linear.replace_all_uses_with(extra, delete_user_cb=lambda u: u is not extra)
    if record:
        provenance(extra, "adds_relu", "test", created=True)
    if val:
        extra.meta["val"] = retyped(linear.meta["val"], torch.float16)  # wrong on purpose: relu keeps float32
    return PassResult(gm, modified=True)


def test_created_nodes_need_provenance() -> None:
    def adds_relu(gm: GraphModule, cfg: autoscale.Config) -> PassResult:
        return _relu_after_first_linear(gm, record=False)

    with pytest.raises(InvariantError, match="created nodes without provenance: relu"):
        run_stage(_graph(), autoscale.Config(), "dynamo", [PassSpec(adds_relu, "dynamo")])


def test_passes_record_fake_values_and_verify_checks_them() -> None:
    """Passes keep the fake values of what they create; ``Config.verify`` re-propagates the graph
    and refuses a value that is wrong (here, a float16 recorded for a float32 relu)."""
    def adds_relu(gm: GraphModule, cfg: autoscale.Config) -> PassResult:
        return _relu_after_first_linear(gm, record=True)

    gm = _graph()
    (record,) = run_stage(gm, autoscale.Config(), "dynamo", [PassSpec(adds_relu, "dynamo")])
    assert record.modified
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    assert relu.meta["val"].dtype == torch.float16  # trusted: no re-propagation without verify
    assert relu.meta["autoscale"] == {"pass": "adds_relu", "layer": "", "reason": "test", "created": True}
    wrong = r"adds_relu left wrong fake values: relu\w* recorded .*float16.*, is .*float32"
    with pytest.raises(InvariantError, match=wrong):
        run_stage(_graph(), autoscale.Config(verify=True), "dynamo", [PassSpec(adds_relu, "dynamo")])


def test_output_dtype_change_is_refused() -> None:
    def halves_output(gm: GraphModule, cfg: autoscale.Config) -> PassResult:
        (out,) = gm.graph.find_nodes(op="output")
        result = out.args[0][0]
        with gm.graph.inserting_before(out):
            half = gm.graph.call_method("half", (result,))
        provenance(half, "halves_output", "test", created=True)
        out.replace_input_with(result, half)
        return PassResult(gm, modified=True)

    with pytest.raises(InvariantError, match="changed the graph's outputs"):
        run_stage(_graph(), autoscale.Config(), "dynamo", [PassSpec(halves_output, "dynamo")])


def test_stage_filter_and_unmodified_pass_is_not_relinted() -> None:
    calls = []

    def looks(gm: GraphModule, cfg: autoscale.Config) -> PassResult:
        calls.append(gm)
        return PassResult(gm, modified=False)

    records = run_stage(_graph(), autoscale.Config(), "dynamo",
                        [PassSpec(looks, "dynamo"), PassSpec(looks, "joint")])
    assert len(calls) == 1 and [r.stage for r in records] == ["dynamo"]


def test_the_pipeline_keeps_the_order_its_passes_declare() -> None:
    """Every reordering of the pipeline that breaks a declared constraint is refused, naming it."""
    check_order(PIPELINE)
    dynamo = [spec for spec in PIPELINE if spec.stage == "dynamo"]
    joint = [spec for spec in PIPELINE if spec.stage == "joint"]
    assert any(spec.after for spec in dynamo) and any(spec.after for spec in joint)
    for stage in (dynamo, joint):
        for i in range(len(stage) - 1):
            swapped = [*stage[:i], stage[i + 1], stage[i], *stage[i + 2:]]
            constrained = stage[i].name in stage[i + 1].after or stage[i + 1].last
            if constrained:
                with pytest.raises(ValueError, match=f"{stage[i + 1].name!r}"):
                    check_order(swapped)
            else:
                check_order(swapped)
    with pytest.raises(ValueError, match="run last"):
        check_order([*dynamo[:-2], dynamo[-1], dynamo[-2]])
    with pytest.raises(ValueError, match="does not have"):
        check_order([spec for spec in dynamo if spec.name != "analyze_underflow"])


def test_the_readmes_pipeline_is_the_pipeline() -> None:
    """The diagram in README.md's "How it works" names the passes in the pipeline's order."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    diagram = readme.split("## How it works", 1)[1].split("```")[1]
    names = {spec.name for spec in PIPELINE}
    assert [w for w in re.findall(r"\w+", diagram) if w in names] == [spec.name for spec in PIPELINE]
