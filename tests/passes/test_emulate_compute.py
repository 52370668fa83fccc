"""Emulated compute stores and rounds exactly as native low precision does."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autoscale
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
