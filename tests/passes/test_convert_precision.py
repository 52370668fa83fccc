"""The precision pass: golden graph, painting rules, casts, unknown ops, in-place ops."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from autoscale.inspect import format_graph, precision_report
from autoscale.passes.graph_utils import PROVENANCE_KEY, cast_of, dtype_name, is_inplace, op_name
from tests.helpers import assert_matches_fp32, rewrite, step_vs_fp32
from tests.models import MLP, mlp_case
from tests.tolerances import SQNR_MIN_DB, sqnr

GOLDEN = Path(__file__).parent.parent / "golden"


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("AUTOSCALE_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with AUTOSCALE_UPDATE_GOLDEN=1 if intended"


def test_golden_mlp_after_precision_pass() -> None:
    model, (x,), _ = mlp_case()
    gm = rewrite(model, x)
    _golden("mlp_precision.txt", format_graph(gm))


def test_golden_mlp_emulated() -> None:
    model, (x,), _ = mlp_case()
    gm = rewrite(model, x, config=autoscale.Config(compute="emulate"))
    _golden("mlp_emulated.txt", format_graph(gm))


def _precision(gm: torch.fx.GraphModule, name: str) -> str:
    (node,) = [n for n in gm.graph.nodes if op_name(n) == name]
    return node.meta[PROVENANCE_KEY]["precision"]


def _casts(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if cast_of(n) is not None]


def test_one_cast_per_producer_shared_by_consumers() -> None:
    lin1, lin2, lin3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return lin2(x) + lin3(x) + lin1(x)  # x feeds three GEMMs

    gm = rewrite(f, torch.randn(2, 4))
    x_casts = [n for n in _casts(gm) if n.args[0].op == "placeholder" and n.args[0].name == "l_x_"]
    assert len(x_casts) == 1
    assert len(x_casts[0].users) == 3


def test_deny_propagates_forward_to_deny_consumers() -> None:
    """exp -> mul -> log: the mul between two deny ops stays float32 (TF's rule 2)."""
    lin = nn.Linear(4, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        return torch.log(torch.exp(h) * 2).sum()

    gm = rewrite(f, torch.randn(2, 4))
    assert _precision(gm, "linear") == "float16"
    assert _precision(gm, "mul") == "float32"
    reason = next(n for n in gm.graph.nodes if op_name(n) == "mul").meta[PROVENANCE_KEY]["reason"]
    assert reason.startswith("downstream of float32 op")


def test_infer_between_allow_is_low_and_after_last_allow_is_fp32() -> None:
    lin1, lin2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin2(F.gelu(lin1(x))))

    gm = rewrite(f, torch.randn(2, 4))
    assert _precision(gm, "gelu") == "float16"   # between two GEMMs: no cast ping-pong
    assert _precision(gm, "tanh") == "float32"   # after the last GEMM, not between


def test_outputs_keep_their_dtype_and_params_stay_fp32() -> None:
    model, (x,), _ = mlp_case()
    gm = rewrite(model, x)
    (out,) = gm.graph.find_nodes(op="output")
    assert out.args[0][0].meta["val"].dtype == torch.float32
    for p in gm.graph.find_nodes(op="placeholder"):
        assert p.meta["val"].dtype == torch.float32


@torch.library.custom_op("autoscale_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _mystery_backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    return grad * 2


mystery.register_autograd(_mystery_backward)


class _WithUnknownOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(mystery(self.a(x)))


def test_unknown_custom_op_stays_fp32_is_reported_and_trains() -> None:
    torch.manual_seed(0)
    model, x, y = _WithUnknownOp(), torch.randn(8, 16), torch.randint(0, 5, (8,))
    gm = rewrite(model, x)
    assert _precision(gm, "mystery") == "float32"
    report = precision_report(gm, dtype="float16", compute="native")
    assert report.unknown_ops == ("mystery",)
    assert "unknown ops (kept in float32): mystery" in str(report)
    assert any(i.op == "mystery" and i.reason.startswith("unknown op") for i in report.islands)

    c = step_vs_fp32(model, (x,), y)
    assert c.backend.reports[0].unknown_ops == ("mystery",)
    assert_matches_fp32(c)


class _MakesTensors(nn.Module):
    """What every Hugging Face language model does: a causal mask and positions made in the
    forward, with ``torch.tensor``, ``zeros``, ``full`` and ``arange``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1) + torch.zeros(n, n)
        positions = torch.arange(n, dtype=x.dtype)[:, None] * torch.tensor(0.01)
        h = self.a(x + positions)
        return self.b(torch.softmax(h @ h.transpose(0, 1) + mask, dim=-1) @ h)


def test_tensor_creation_is_classified_not_reported_as_unknown() -> None:
    """Creation ops make no precision decision: they keep the dtype the model gives them, and the
    user is not told they are "not in the precision tables" (issue 18: every transformers model
    warned about ``tensor``, and T5 about ``zeros``)."""
    torch.manual_seed(0)
    model, x = _MakesTensors(), torch.randn(8, 16)
    gm = rewrite(model, x)
    report = precision_report(gm, dtype="float16", compute="native")
    assert report.unknown_ops == ()
    created = [i for i in report.islands if i.op in ("full", "zeros", "arange", "tensor")]
    assert created and all(i.reason == "creates a tensor in the model's dtype" for i in created)
    assert not any(i.op == "linear" for i in report.islands)  # the layers still compute in float16


@pytest.mark.parametrize("sparse", [False, True])
def test_an_embedding_with_a_sparse_gradient_stays_float32_and_its_output_is_cast(sparse: bool) -> None:
    """Autograd cannot pass a sparse gradient back through a cast (``ToCopyBackward`` refuses the
    layout): an embedding with ``sparse=True`` keeps its float32 weight, and the cast moves to its
    output; a dense one follows the linear after it into float16 (a clear op)."""
    emb, lin = nn.Embedding(16, 8, sparse=sparse), nn.Linear(8, 4)
    gm = rewrite(lambda i: lin(emb(i)), torch.tensor([[1, 2], [3, 4]]))
    assert _precision(gm, "linear") == "float16"
    assert _precision(gm, "embedding") == ("float32" if sparse else "float16")
    reason = next(n for n in gm.graph.nodes if op_name(n) == "embedding").meta[PROVENANCE_KEY]["reason"]
    assert reason.startswith("sparse gradient") is sparse


def test_a_tensor_attribute_is_a_view_not_metadata() -> None:
    """``x.T`` reaches the graph as ``getattr(x, "T")``, an op the tables list as metadata (never
    cast): it returns a tensor, and follows its input's precision like any view (it was left
    recorded as float32 while it computed in float16, and the invariant check refused the pass)."""
    lin = nn.Linear(16, 16)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        return (h @ h.T).sum()

    gm = rewrite(f, torch.randn(8, 16))
    assert _precision(gm, "matmul") == "float16"


def test_user_override_classifies_unknown_op() -> None:
    torch.manual_seed(0)
    gm = rewrite(_WithUnknownOp(), torch.randn(8, 16), config=autoscale.Config(compute="native",
                                                                             infer=("mystery",)))
    assert _precision(gm, "mystery") == "float16"


def test_override_can_deny_an_allow_op() -> None:
    model, (x,), _ = mlp_case()
    gm = rewrite(model, x, config=autoscale.Config(compute="native", deny=("linear",)))
    report = precision_report(gm, dtype="float16", compute="native")
    assert report.converted == 0 and report.casts == 0


class _InPlace(nn.Module):
    """relu_ and += on intermediates (made functional), and += on a view (left alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))
        skip = h
        h = self.b(h)
        h += skip
        v = h.view(-1)
        v.mul_(0.5)            # mutates h through a view
        return self.c(h)


def test_inplace_ops_numerics_match_fp32() -> None:
    torch.manual_seed(0)
    c = step_vs_fp32(_InPlace(), (torch.randn(4, 8),), torch.randint(0, 4, (4,)))
    assert_matches_fp32(c)
    counts = {r.name: r.counts for r in c.backend.records[0].passes}
    assert counts["remove_inplace"]["rewritten"] == 2  # relu_ and h += skip, on fresh GEMM outputs


def test_mutation_through_a_view_keeps_its_alias_group_in_place() -> None:
    torch.manual_seed(0)
    gm = rewrite(_InPlace(), torch.randn(4, 8))
    (mutation,) = [n for n in gm.graph.nodes if is_inplace(n)]
    view = mutation.args[0]
    base = view.args[0]
    assert op_name(view) == "view" and op_name(base) == "add"
    for node in (mutation, view, base):
        assert node.meta[PROVENANCE_KEY]["reason"] == "aliases a tensor mutated in place"
    # the reader after the mutation gets its own cast, placed after the mutation
    (reader_cast,) = [u for u in base.users if cast_of(u) is not None]
    order = list(gm.graph.nodes)
    assert order.index(reader_cast) > order.index(mutation)


def test_inplace_on_graph_input_is_left_alone_and_correct() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = lin(x)
        x.add_(1)  # mutates the caller's tensor: must still happen, in float32
        return y + lin(x)

    x = torch.randn(2, 4)
    gm = rewrite(f, x.clone())
    (mutation,) = [n for n in gm.graph.nodes if is_inplace(n)]
    assert mutation.args[0].op == "placeholder"  # not redirected to a cast copy
    assert mutation.meta[PROVENANCE_KEY]["precision"] == "float32"

    a, b = x.clone(), x.clone()
    expected = f(a)
    got = torch.compile(f, backend=autoscale.backend(autoscale.Config(executor="eager", verify=True)))(b)
    assert torch.equal(a, b)  # the caller's tensor was mutated exactly as in eager
    assert sqnr(expected, got) >= SQNR_MIN_DB[(torch.float16, "output")]


def test_chained_inplace_on_graph_input_keeps_every_mutation() -> None:
    """x.add_(1).relu_(): the relu_ acts on the caller's tensor too, so it must stay in place."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return lin(x.add_(-0.5).relu_())

    x = torch.randn(2, 4)
    a, b = x.clone(), x.clone()
    expected = f(a)
    got = torch.compile(f, backend=autoscale.backend(autoscale.Config(executor="eager", verify=True)))(b)
    assert torch.equal(a, b) and torch.equal(a, (x - 0.5).relu())
    assert sqnr(expected, got) >= SQNR_MIN_DB[(torch.float16, "output")]


def test_to_device_is_data_movement_but_to_dtype_is_kept() -> None:
    """``.to(device)`` between GEMMs is data movement; an explicit ``.float()`` keeps what follows
    it in float32, as the model asked."""
    lin1, lin2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return lin2(torch.tanh(lin1(x).to("cpu"))) + lin2(torch.sigmoid(lin1(x).float()))

    gm = rewrite(f, torch.randn(2, 4))
    assert _precision(gm, "tanh") == "float16"     # between two GEMMs, through .to("cpu")
    assert _precision(gm, "sigmoid") == "float32"  # downstream of the model's own .float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_report_counts(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    gm = rewrite(MLP(), torch.randn(4, 16), config=autoscale.Config(compute="native", dtype=dtype))
    report = precision_report(gm, dtype=dtype_name(dtype), compute="native")
    # fc1, relu, fc2, gelu, fc3 all low; casts: x, 6 parameters, and the logits back to float32.
    assert (report.converted, report.total, report.casts) == (5, 5, 8)
    assert str(report).startswith(f"converted 5 of 5 nodes to {report.dtype} using 8 casts")
