"""Properties of the pipeline's output over random models (hypothesis).

For every generated model, in the graphs handed on (the Dynamo-stage graph AOTAutograd
differentiates, and the joint forward+backward graph):
* every allow-table op computes in low precision and every deny-table op in float32;
* no cast is immediately undone by the next one;
* the outputs keep their dtypes, and the values stay close to float32.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx import GraphModule, Node

import autoscale
from autoscale import ops
from autoscale.passes import PIPELINE, PassResult, PassSpec, fold_casts
from autoscale.passes.fold_casts import is_lossless
from autoscale.passes.graph_utils import cast_of, float_dtype, op_name
from autoscale.passes.op_tables import Category, category_of
from tests.helpers import capture, rewrite
from tests.tolerances import sqnr

WIDTH = 8


def _attention(h: torch.Tensor) -> torch.Tensor:
    return torch.softmax(h @ h.transpose(-1, -2) / WIDTH, dim=-1) @ h


# name -> (needs a Linear?, function of (h, skip, linear))
OPS: dict[str, Callable[[torch.Tensor, torch.Tensor, nn.Module], torch.Tensor]] = {
    "linear": lambda h, s, lin: lin(h),
    "relu": lambda h, s, lin: F.relu(h),
    "relu_": lambda h, s, lin: lin(h).relu_(),
    "gelu": lambda h, s, lin: F.gelu(h),
    "tanh": lambda h, s, lin: torch.tanh(h),
    "sigmoid_mul": lambda h, s, lin: torch.sigmoid(h) * h,
    "softmax": lambda h, s, lin: torch.softmax(h, dim=-1),
    "layer_norm": lambda h, s, lin: F.layer_norm(h, (WIDTH,)),
    "logsumexp": lambda h, s, lin: h - torch.log(torch.exp(h).sum(-1, keepdim=True)),
    "residual": lambda h, s, lin: h + s,
    "iadd": lambda h, s, lin: _iadd(lin(h), s),
    "scale": lambda h, s, lin: h * 0.5,
    "mean_center": lambda h, s, lin: h - h.mean(-1, keepdim=True),
    "transpose": lambda h, s, lin: h.t().contiguous().t(),
    "cat_slice": lambda h, s, lin: torch.cat([h, s], dim=-1)[:, :WIDTH],
    "attention": lambda h, s, lin: _attention(h),
    "float_cast": lambda h, s, lin: h.float(),
    "matmul_weight": lambda h, s, lin: h @ lin.weight.t(),
}


def _iadd(h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    h += s
    return h


class RandomNet(nn.Module):
    def __init__(self, ops: list[str], save_at: int) -> None:
        super().__init__()
        self.ops, self.save_at = ops, save_at
        self.lins = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, skip = x, x
        for i, (op, lin) in enumerate(zip(self.ops, self.lins, strict=True)):
            h = OPS[op](h, skip, lin)
            if i == self.save_at:
                skip = h
        return h


nets = st.builds(
    lambda ops, save: (ops, save % len(ops)),
    st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=8),
    st.integers(min_value=0, max_value=7),
)


def _float_inputs(node: Node) -> list[Node]:
    return [a for a in node.all_input_nodes if float_dtype(a) is not None]


def _check_casts_do_not_cancel(gm: GraphModule) -> None:
    for node in gm.graph.nodes:
        outer = cast_of(node)
        inner = cast_of(outer[0]) if outer else None
        if outer is None or inner is None:
            continue
        origin = float_dtype(inner[0])
        # Kept on purpose: folding would make a graph output alias a graph input.
        exposes_input = inner[0].op == "placeholder" and any(u.op == "output" for u in node.users)
        if origin is not None and is_lossless(origin, inner[1]) and outer[1] == origin and not exposes_input:
            raise AssertionError(f"{node.name} undoes {outer[0].name}")


def _check_painting(gm: GraphModule, low: torch.dtype, *, emulated: bool) -> None:
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        category = category_of(op_name(node) or "")
        inputs = _float_inputs(node)
        if category is Category.ALLOW and float_dtype(node) is not None:
            assert float_dtype(node) == low and all(float_dtype(a) == low for a in inputs), node.name
            # emulated: float32 arithmetic on exact upcasts of the low values, result rounded
            assert (node.target is ops.emulated) == emulated, node.name
        elif category is Category.DENY:
            assert all(float_dtype(a) == torch.float32 for a in inputs), node.name
            assert float_dtype(node) in (torch.float32, None), node.name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(net=nets, compute=st.sampled_from(["native", "emulate"]), dtype=st.sampled_from(["float16", "bfloat16"]))
def test_random_graphs_dynamo_stage(net: tuple[list[str], int], compute: str, dtype: str) -> None:
    ops, save = net
    torch.manual_seed(0)
    model, x = RandomNet(ops, save), torch.randn(4, WIDTH)
    cfg = autoscale.Config(compute=compute, dtype=dtype, verify=True)
    gm = rewrite(model, x, config=cfg)

    _check_painting(gm, cfg.dtype, emulated=compute == "emulate")
    _check_casts_do_not_cancel(gm)

    expected = model(x.clone())
    (orig_gm, inputs), = capture(model, x.clone())
    got = gm(*inputs)[0]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # A loose floor: these are random stacks of up to 8 layers, some nearly cancelling.
    assert sqnr(expected, got) >= (25 if dtype == "float16" else 12), ops


def _record_joint(graphs: list[GraphModule]) -> PassSpec:
    def record_joint(gm: GraphModule, cfg: autoscale.Config) -> PassResult:
        graphs.append(gm)
        return PassResult(gm, modified=False)

    return PassSpec(record_joint, "joint")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(net=nets)
def test_random_graphs_joint_stage(net: tuple[list[str], int]) -> None:
    """Through AOTAutograd: in the joint graph (forward and backward) GEMMs read float16 and no
    cast undoes another."""
    ops, save = ["linear", *net[0]], net[1]  # a leading GEMM: every model has a backward
    torch.manual_seed(0)
    model, x = RandomNet(ops, save), torch.randn(4, WIDTH, requires_grad=True)
    joints: list[GraphModule] = []
    backend = autoscale.Backend(autoscale.Config(executor="eager", verify=True, compute="native"),
                                pipeline=(*PIPELINE, _record_joint(joints)))
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x).sum().backward()
    (joint,) = joints
    _check_casts_do_not_cancel(joint)
    gemms = [n for n in joint.graph.nodes if op_name(n) in ("mm", "addmm", "bmm")]
    assert gemms
    for node in gemms:
        assert all(float_dtype(a) == torch.float16 for a in _float_inputs(node)), node.name


@pytest.mark.parametrize("stage", ["dynamo", "joint"])
def test_fold_runs_in_both_stages(stage: str) -> None:
    assert any(spec.fn is fold_casts and spec.stage == stage for spec in PIPELINE)
