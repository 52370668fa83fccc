"""The backend end to end: numerics against eager float32, master weights, compile counts,
graph breaks, the named entry point and Inductor."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch._dynamo
import torch.nn as nn

import autoscale
from tests.helpers import assert_matches_fp32, keeps_roundings, step, step_vs_fp32, twin
from tests.models import conv_case, mlp_case, transformer_case
from tests.tolerances import SQNR_MIN_DB, SQNR_MIN_DB_SAME_GRAPH, sqnr

CASES = {"mlp": mlp_case, "convnet": conv_case, "transformer": transformer_case}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_numerics_against_eager_fp32(case: str, dtype: torch.dtype) -> None:
    model, inputs, targets = CASES[case]()
    c = step_vs_fp32(model, inputs, targets, autoscale.Config(executor="eager", verify=True, dtype=dtype))
    assert_matches_fp32(c, dtype)
    # ...and low precision really happened: the results are not float32's.
    assert not torch.equal(c.loss, c.ref_loss)
    assert not all(torch.equal(c.grads[n], c.ref_grads[n]) for n in c.ref_grads)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    (report,) = c.backend.reports
    assert report.converted > 0 and report.casts > 0


def test_convnet_buffers_follow_fp32() -> None:
    """Batch-norm statistics are deny-listed: running stats are updated in float32, like eager."""
    model, inputs, targets = conv_case()
    reference = twin(model)
    step(model, torch.compile(model, backend=autoscale.backend(autoscale.Config(executor="eager", verify=True))),
         inputs, targets)
    step(reference, None, inputs, targets)
    for (name, buf), ref in zip(model.named_buffers(), reference.buffers(), strict=True):
        assert buf.dtype == ref.dtype, name
        if buf.is_floating_point():
            assert sqnr(ref, buf) >= SQNR_MIN_DB[(torch.float16, "output")], name


def test_ten_training_steps_compile_once() -> None:
    model, inputs, targets = mlp_case()
    backend = autoscale.backend(autoscale.Config(executor="eager", verify=True))
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(10):
        loss, _ = step(model, compiled, inputs, targets)
        opt.step()
        losses.append(loss.item())
    assert len(backend.records) == 1
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def test_graph_break_every_subgraph_converted_and_trains() -> None:
    torch.manual_seed(0)
    c = step_vs_fp32(_Broken(), (torch.randn(8, 16),), torch.randint(0, 5, (8,)))
    assert len(c.backend.records) == 2
    assert all(r.report.converted >= 1 for r in c.backend.records)
    assert_matches_fp32(c)


class _TiedAfterBreak(nn.Module):
    """GPT-2's shape in small: the output layer (float16) shares the embedding's weight (float32: a
    layer norm reads it), and (as transformers' loss logging does) a graph break comes first."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.mid = nn.Embedding(32, 16), nn.LayerNorm(16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return self.head(torch.relu(self.mid(self.norm(self.embed(ids)))))


def test_tied_weights_after_a_graph_break_compile_and_train() -> None:
    """A tied weight's gradient merges from two uses and is aligned (and unscaled) on its way out.
    After a graph break the scaler's state joins the graph as its last inputs; the alignment was
    placed right after the weight's own input, before them, and the graph failed to lint
    ("used before it has been defined"): every transformers GPT-2 failed to compile."""
    torch.manual_seed(0)
    model, ids = _TiedAfterBreak(), torch.randint(0, 32, (4, 8))
    reference = copy.deepcopy(model)
    scaler = autoscale.GradScaler(model)
    compiled = torch.compile(model, backend=autoscale.backend(autoscale.Config(executor="eager")))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss = nn.functional.cross_entropy(compiled(ids).flatten(0, 1), ids.flatten())
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    nn.functional.cross_entropy(reference(ids).flatten(0, 1), ids.flatten()).backward()
    assert sqnr(reference.embed.weight.grad, model.embed.weight.grad) >= SQNR_MIN_DB[(torch.float16, "grad")]


def test_named_backend_is_discoverable() -> None:
    assert "autoscale" in torch._dynamo.list_backends()


@keeps_roundings
def test_named_backend_inductor_matches_eager_executor() -> None:
    """``backend="autoscale"`` (Inductor) runs the same numerics as the eager executor, and both
    differ from float32: Inductor keeps every float16 rounding (emulate_precision_casts)."""
    model, inputs, targets = mlp_case()
    eager_twin = twin(model)
    loss, grads = step(model, torch.compile(model, backend="autoscale"), inputs, targets)
    torch._dynamo.reset()
    eager_backend = autoscale.backend(autoscale.Config(executor="eager", verify=True))
    eager_loss, eager_grads = step(eager_twin, torch.compile(eager_twin, backend=eager_backend), inputs, targets)
    assert sqnr(eager_loss, loss) >= SQNR_MIN_DB_SAME_GRAPH
    for name, ref in eager_grads.items():
        assert grads[name].dtype == torch.float32
        assert sqnr(ref, grads[name]) >= SQNR_MIN_DB_SAME_GRAPH, name


@keeps_roundings
def test_inductor_keeps_fp16_rounding_inside_fused_kernels() -> None:
    """A float32 -> float16 -> float32 round trip inside one fused kernel must still round."""
    x = torch.full((4,), 1 + 2.0**-12)  # rounds to 1.0 in float16

    def f(t: torch.Tensor) -> torch.Tensor:
        return t.half().float() * 3

    out = torch.compile(f, backend="autoscale")(x)
    assert torch.equal(out, torch.full((4,), 3.0))


@pytest.mark.gpu
def test_native_fp16_on_cuda() -> None:
    model, inputs, targets = mlp_case()
    c = step_vs_fp32(model.cuda(), tuple(i.cuda() for i in inputs), targets.cuda(), autoscale.Config())
    assert c.backend.records[0].config.compute == "native"
    assert_matches_fp32(c)


def test_report_is_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    model, inputs, _ = mlp_case()
    with caplog.at_level(logging.INFO, logger="autoscale"):
        torch.compile(model, backend=autoscale.backend(autoscale.Config(executor="eager", verify=True)))(*inputs)
    (record,) = [r for r in caplog.records if r.name == "autoscale"]
    assert record.levelno == logging.INFO
    assert "converted 5 of 5 nodes to float16 using 8 casts" in record.getMessage()
