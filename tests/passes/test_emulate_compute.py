"""Emulated compute stores and rounds exactly as native low precision does."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from autoscale import ops
from autoscale.passes import emulate_compute
from tests.helpers import capture, rewrite
from tests.tolerances import SQNR_MIN_DB_SAME_GRAPH, sqnr


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emulated_linear_is_fp32_math_on_rounded_inputs_then_rounded(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    lin, x = nn.Linear(24, 12), torch.randn(6, 24)
    gm = rewrite(lin, x, config=autoscale.Config(compute="emulate", dtype=dtype))
    (_, inputs), = capture(lin, x)
    got = gm(*inputs)[0]
    w, b = lin.weight, lin.bias
    expected = torch.nn.functional.linear(x.to(dtype).float(), w.to(dtype).float(), b.to(dtype).float())
    assert torch.equal(got, expected.to(dtype).float())  # by definition, bit for bit


def test_emulated_matches_native_fp16_on_cpu() -> None:
    """Native CPU float16 GEMMs (slow, but fine at this size) agree with emulation up to
    summation order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 32)
    (_, inputs), = capture(model, x)
    native = rewrite(model, x, config=autoscale.Config(compute="native"))(*inputs)[0]
    emulated = rewrite(model, x, config=autoscale.Config(compute="emulate"))(*inputs)[0]
    assert sqnr(native, emulated) >= SQNR_MIN_DB_SAME_GRAPH
    assert not torch.equal(native, model(x))


def test_native_compute_leaves_the_graph_alone() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    gm = rewrite(lin, torch.randn(2, 4), config=autoscale.Config(compute="native"))
    assert not any(n.meta.get("autoscale", {}).get("pass") == "emulate_compute" for n in gm.graph.nodes)


class _Fork(nn.Module):
    """Two GEMMs reading the same input, and one reading it as a method call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) * self.b(x)).matmul(self.w)


def test_one_node_per_op_and_shared_upcasts_merged_in_the_joint_graph() -> None:
    """Each emulated op is one node; the upcast of the input both Linears read appears twice in the
    joint graph (once per call) and the joint fold_casts merges the copies; the backward rounds
    each GEMM's input gradient to float16 before they are summed, as native GEMMs would."""
    torch.manual_seed(0)
    model, x = _Fork(), torch.randn(6, 8, requires_grad=True)
    gm = rewrite(model, x, config=autoscale.Config(compute="emulate"))
    calls = [n for n in gm.graph.nodes if n.target is ops.emulated]
    assert [n.args[0] for n in calls] == ["torch._C._nn.linear", "torch._C._nn.linear", "torch.Tensor.matmul"]
    assert not any(n.meta.get("autoscale", {}).get("pass") == "emulate_compute" for n in gm.graph.nodes)

    backend = autoscale.backend(autoscale.Config(executor="eager", compute="emulate", verify=True))
    torch.compile(model, backend=backend)(x).sum().backward()
    joint = {r.name: r.counts for r in backend.records[0].passes if r.stage == "joint"}
    assert joint["fold_casts"]["merged"] >= 1

    half = {n: p.detach().half().float() for n, p in model.named_parameters()}
    xh = x.detach().half().float()
    ya = F.linear(xh, half["a.weight"], half["a.bias"]).half().float()
    yb = F.linear(xh, half["b.weight"], half["b.bias"]).half().float()
    g = torch.ones(6, 4) @ half["w"].t()  # d/d(ya*yb) of sum((ya*yb) @ w)
    ga, gb = (g.half() * yb.half()).float(), (g.half() * ya.half()).float()
    expected = (ga @ half["a.weight"]).half() + (gb @ half["b.weight"]).half()  # each rounded, summed in float16
    assert torch.equal(x.grad, expected.float())


def test_an_op_that_cannot_be_found_by_name_runs_natively(caplog: pytest.LogCaptureFixture) -> None:
    """Hand-built graph whose allow-listed op is a local function: left as it is, counted, warned."""
    def local_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.t()

    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    out = graph.call_function(local_gemm, (x, w))
    graph.output(out)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    for node, val in ((x, torch.zeros(2, 3)), (w, torch.zeros(4, 3)), (out, torch.zeros(2, 4))):
        node.meta["val"] = val.half()
    cfg = autoscale.Config(compute="emulate", allow=("local_gemm",))
    with caplog.at_level("WARNING", logger="autoscale.passes"):
        result = emulate_compute(gm, cfg)
    assert dict(result.counts) == {"emulated": 0, "native": 1} and not result.modified
    assert out.target is local_gemm
    assert "local_gemm cannot be found by name" in caplog.text
