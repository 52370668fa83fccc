"""rewrite_avg_pool: a global average pool written with ``ceil_mode=True`` becomes the mean it is,
so that Inductor differentiates it right (pytorch/pytorch#198119)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import autoscale
from autoscale.passes import PassSpec, rewrite_avg_pool, run_stage
from autoscale.passes.graph_utils import PROVENANCE_KEY, op_name
from tests.helpers import capture


def _pooled(pool: nn.Module, shape: tuple[int, ...], executor: str = "eager"
            ) -> tuple[torch.fx.GraphModule, dict[str, int]]:
    (gm, _), = capture(lambda x: pool(x).sum(), torch.randn(*shape))
    record = run_stage(gm, autoscale.Config(executor=executor, verify=True), "dynamo",  # type: ignore[arg-type]
                       [PassSpec(rewrite_avg_pool, "dynamo")])
    return gm, record[0].counts


def test_a_global_pool_with_ceil_mode_becomes_a_mean_with_eagers_values_and_gradients() -> None:
    """Hugging Face's EfficientNet pools its 2x2 map with ``AvgPool2d(320, ceil_mode=True)``. Under
    plain Inductor its gradient is 320²/4 = 25,600 times too small (the case, checked here); after
    the rewrite, autoscale's Inductor run gives eager's value and gradient."""
    pool = nn.AvgPool2d(320, ceil_mode=True)
    gm, counts = _pooled(pool, (2, 4, 2, 2))
    assert counts == {"rewritten": 1, "left": 0}
    mean, = (n for n in gm.graph.nodes if op_name(n) == "mean")
    assert mean.meta[PROVENANCE_KEY]["pass"] == "rewrite_avg_pool"
    assert not any(op_name(n) == "avg_pool2d" for n in gm.graph.nodes)

    x = torch.randn(2, 4, 2, 2, requires_grad=True)
    pool(x).sum().backward()
    eager = x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    torch.compile(pool, backend="inductor")(x).sum().backward()
    assert torch.allclose(x.grad * 25600, eager)  # Inductor's own: the bug this pass works around
    x.grad = None
    torch._dynamo.reset()
    model = nn.Sequential(nn.Conv2d(4, 4, 1), pool, nn.Flatten(), nn.Linear(4, 3))
    compiled = torch.compile(model, backend=autoscale.backend(autoscale.Config(compute="native")))
    reference = model(x).sum()
    reference.backward()
    expected = x.grad.clone()
    x.grad = None
    compiled(x).sum().backward()
    torch._dynamo.reset()
    assert torch.allclose(x.grad, expected, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("pool, shape", [
    (nn.AvgPool2d(2), (1, 2, 4, 4)),  # no ceil_mode
    (nn.AvgPool2d(3, stride=2, ceil_mode=True), (1, 2, 5, 5)),  # windows fit exactly
    (nn.AvgPool2d(4, ceil_mode=True, padding=1), (1, 2, 4, 4)),  # padded: not a plain mean
])
def test_other_pools_are_left_alone(pool: nn.Module, shape: tuple[int, ...]) -> None:
    gm, counts = _pooled(pool, shape)
    assert counts["rewritten"] == 0
    assert any(op_name(n) == "avg_pool2d" for n in gm.graph.nodes)


def test_an_overhanging_pool_it_cannot_rewrite_is_named_under_inductor(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="autoscale"):
        _, counts = _pooled(nn.AvgPool2d(2, ceil_mode=True), (1, 2, 5, 5), executor="inductor")
    assert counts == {"rewritten": 0, "left": 1}
    assert "pytorch/pytorch#198119" in caplog.text and "avg_pool2d" in caplog.text
