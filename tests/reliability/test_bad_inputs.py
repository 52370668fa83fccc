"""Bad and unusual inputs (issue 8): for each, a correct result, a safe float32 fallback that is
reported, or a clear error; never a silently wrong result. docs/reliability.md has the table.

Most tests use the eager executor (seconds); the ones where Inductor's code generation matters
(a custom op's fallback kernel, symbolic batch sizes) use the default executor.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from autoscale import Config, GradScaler, OverflowConfig, QuantConfig, ScalingConfig
from autoscale.passes.graph_utils import PROVENANCE_KEY, cast_of, op_name
from tests.helpers import Comparison, assert_matches_fp32, capture, rewrite, step, step_vs_fp32, twin
from tests.models import MLP, conv_case, mlp_case
from tests.tolerances import SQNR_MIN_DB, SQNR_MIN_DB_SAME_GRAPH, sqnr

EAGER = Config(executor="eager")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """autoscale's warnings about the model: not the one about the installed torch (torch 2.11's
    Inductor folding float16 round trips, ``autoscale.backend``), which every compile logs there."""
    return [r for r in caplog.records if r.name == "autoscale" and r.levelno == logging.WARNING
            and not r.getMessage().startswith("this torch's Inductor folds")]


def _pass_counts(backend: autoscale.Backend, name: str) -> list[dict[str, int]]:
    """The counts of pass ``name`` in every graph the backend compiled."""
    return [dict(p.counts) for r in backend.records for p in r.passes if p.name == name]


def _scaled_step(model: nn.Module, compiled: Callable[..., Any], scaler: GradScaler, opt: torch.optim.Optimizer,
                 *inputs: Any, target: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
    """One step of the torch.amp-style loop; returns the loss and whether the step was skipped."""
    opt.zero_grad(set_to_none=True)
    out = compiled(*inputs)
    loss = out if target is None else F.cross_entropy(out, target)
    scaler.scale(loss).backward()
    before = scaler.skipped_steps
    scaler.step(opt)
    scaler.update()
    return loss.detach(), scaler.skipped_steps > before


def _unscaled_grads_match_fp32(model: nn.Module, reference: nn.Module, compiled: Callable[..., Any],
                               scaler: GradScaler, opt: torch.optim.Optimizer, backend: autoscale.Backend,
                               inputs: tuple[Any, ...], target: torch.Tensor) -> None:
    """A scaled forward and backward, unscaled by the scaler, against eager float32 (no step)."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(compiled(*inputs), target)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ref_loss, ref_grads = step(reference, None, inputs, target)
    assert_matches_fp32(Comparison(backend, loss.detach(), grads, ref_loss, ref_grads))
    scaler.update()  # (ends the step: the scaler is ready for the next one)


# --------------------------------------------------------------------------- unknown custom op


@torch.library.custom_op("autoscale_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, a: float) -> torch.Tensor:
    return torch.tanh(x) * a


@scaled_tanh.register_fake
def _(x: torch.Tensor, a: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_tanh_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.a = inputs[1]
    ctx.save_for_backward(output)


def _scaled_tanh_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    (y,) = ctx.saved_tensors
    return grad * ctx.a * (1 - (y / ctx.a) ** 2), None


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


class _WithCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(scaled_tanh(self.a(x), 2.0))


def test_unknown_custom_op_stays_fp32_is_reported_and_trains_under_inductor(
        caplog: pytest.LogCaptureFixture) -> None:
    """(The eager executor's version: tests/passes/test_convert_precision.py.) Under Inductor, with
    the GradScaler's scale points around it: float32, one warning, float32's numerics."""
    torch.manual_seed(0)
    model, x, y = _WithCustomOp(), torch.randn(8, 16), torch.randint(0, 5, (8,))
    reference = twin(model)
    scaler = GradScaler(model)
    backend = autoscale.backend(Config())
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="autoscale"):
        _unscaled_grads_match_fp32(model, reference, compiled, scaler, opt, backend, (x,), y)
    (record,) = backend.records
    assert record.report.unknown_ops == ("scaled_tanh",)
    (island,) = [i for i in record.report.islands if i.op == "scaled_tanh"]
    assert island.reason.startswith("unknown op")
    assert record.report.converted == 2  # both GEMMs still in float16
    assert len(_warnings(caplog)) == 1
    assert _pass_counts(backend, "insert_grad_scaling")[0]["scale_points"] >= 2


# ------------------------------------------------------------------------------- in-place ops


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 5)
        self.act = nn.ReLU(inplace=True)
        self.register_buffer("seen", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.relu_()
        h2 = self.b(h)
        h2.add_(h)  # on an activation another op saved
        h2.mul_(0.5)
        h2 = self.act(h2)
        self.seen.add_(h2.detach().mean(0))  # on a buffer
        h3 = h2 * 2
        h3 += 1.0
        h3.sub_(0.5)
        return self.c(h3)


def test_in_place_ops_on_activations_and_a_buffer() -> None:
    torch.manual_seed(0)
    model, x, y = _InPlace(), torch.randn(8, 16), torch.randint(0, 5, (8,))
    reference = twin(model)
    c = step_vs_fp32(model, (x,), y, EAGER)
    assert_matches_fp32(c)
    step(reference, None, (x,), y)  # (step_vs_fp32's twin is its own: this one's buffer is compared)
    assert model.seen.dtype == torch.float32
    assert sqnr(reference.seen, model.seen) >= SQNR_MIN_DB[(torch.float16, "output")]
    (counts,) = _pass_counts(c.backend, "remove_inplace")
    assert counts["rewritten"] >= 5  # relu_, add_, mul_, ReLU(inplace), +=, sub_ on intermediates
    assert c.backend.records[0].report.converted >= 3


# ----------------------------------------------------------------------------- dynamic shapes


def test_mark_dynamic_batch_compiles_once_and_is_right_at_every_size() -> None:
    """Inductor, symbolic batch size, per-layer scaling: one compile serves 8, 5 and 13 rows."""
    model, (x,), y = mlp_case()
    reference = twin(model)
    scaler = GradScaler(model)
    backend = autoscale.backend(Config())
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    torch._dynamo.mark_dynamic(x, 0)
    torch.manual_seed(1)
    for rows in (8, 5, 13):
        xb = x if rows == 8 else torch.randn(rows, 16)
        yb = y if rows == 8 else torch.randint(0, 5, (rows,))
        _unscaled_grads_match_fp32(model, reference, compiled, scaler, opt, backend, (xb,), yb)
    assert len(backend.records) == 1
    (counts,) = _pass_counts(backend, "insert_grad_scaling")
    assert counts["scale_points"] == 3


def test_new_batch_sizes_recompile_once_then_stay_dynamic() -> None:
    """Without mark_dynamic, Dynamo compiles the first size statically, the second dynamically
    (automatic dynamic shapes), and then only sizes 0 and 1, which it specializes."""
    model, (x,), y = mlp_case()
    reference = twin(model)
    scaler = GradScaler(model)
    backend = autoscale.backend(EAGER)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    compiles = []
    torch.manual_seed(1)
    for rows in (8, 5, 13, 32, 1):
        xb, yb = torch.randn(rows, 16), torch.randint(0, 5, (rows,))
        _unscaled_grads_match_fp32(model, reference, compiled, scaler, opt, backend, (xb,), yb)
        compiles.append(len(backend.records))
    assert compiles == [1, 2, 2, 2, 3]
    assert all(c["scale_points"] == 3 for c in _pass_counts(backend, "insert_grad_scaling"))


# ------------------------------------------------------------------------------- graph breaks


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        torch._dynamo.graph_break()
        h = F.gelu(self.b(h))
        if (h.abs().amax() > 1e30).item():  # .item(): a data-dependent graph break (on a bool: no float guard)
            h = h * 0
        return self.c(h * poison)


def test_graph_breaks_every_graph_is_scaled_and_the_scaler_works_across_them() -> None:
    """Every graph is rewritten and scaled: the graphs after a break get the scaler's state from
    their parameters (the forward announces it only in the first), each writing statistics of its
    own. Gradients match float32; an inf input to a later graph skips the step, leaves the weights
    alone and backs off no layer (its forward checks see the inf: not a gradient scale's doing). (Without a scaler:
    tests/test_backend.py::test_graph_break_every_subgraph_converted_and_trains.)"""
    torch.manual_seed(0)
    model, x, y = _Broken(), torch.randn(8, 16), torch.randint(0, 5, (8,))
    reference = twin(model)
    scaler = GradScaler(model)
    backend = autoscale.backend(EAGER)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one, inf = torch.tensor(1.0), torch.tensor(math.inf)
    _unscaled_grads_match_fp32(model, reference, compiled, scaler, opt, backend, (x, one), y)
    graphs = [r for r in backend.records if r.report.total]
    assert len(graphs) >= 2  # the break, and the .item()
    points = [c["scale_points"] for c in _pass_counts(backend, "insert_grad_scaling") if c["scale_points"]]
    assert len(points) == len(graphs)  # every graph with layers has scale points
    assert {r.name for r in scaler.layers() if r.scale > 1} >= {"a", "b", "c"}  # and each layer its scale
    compiles = len(backend.records)

    losses, skipped = [], []
    for poison in (one, one, inf, one, one):
        weights = copy.deepcopy(model.state_dict())
        scales = {r.name: r.scale for r in scaler.layers()}
        loss, skip = _scaled_step(model, compiled, scaler, opt, x, poison, target=y)
        losses.append(float(loss))
        skipped.append(skip)
        if skip:
            assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
            # the inf came from the forward (an input), not from a gradient scale: no layer backs off
            assert {r.name: r.scale for r in scaler.layers()} == scales
    assert skipped == [False, False, True, False, False]
    assert losses[-1] < losses[0]
    assert len(backend.records) == compiles  # the poisoned step did not recompile


# --------------------------------------------------------------------- integer and bool tensors


class _IntegerInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.out = nn.Embedding(20, 16), nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1]) * 3 // 3 + (idx % 3)  # integer arithmetic in the graph
        h = self.fc(self.emb(idx) + self.emb(pos.clamp(max=19)))
        h = h.masked_fill(~mask[..., None], 0.0)
        h = torch.where(((idx > 2) & mask)[..., None], h, h * 0.5)
        count = mask.sum(1, keepdim=True)  # int64
        return self.out(F.relu(h.sum(1) / count.clamp(min=1)))


def test_integer_and_bool_tensors_are_never_cast() -> None:
    torch.manual_seed(0)
    model = _IntegerInputs()
    idx, mask, y = torch.randint(0, 20, (4, 6)), torch.rand(4, 6) > 0.3, torch.randint(0, 5, (4,))
    ((before, _),) = capture(model, idx, mask)
    dtypes = {n.name: n.meta["example_value"].dtype for n in before.graph.nodes
              if isinstance(n.meta.get("example_value"), torch.Tensor)}
    gm = rewrite(model, idx, mask)
    not_float = [n for n in gm.graph.nodes if n.name in dtypes and not dtypes[n.name].is_floating_point]
    assert len(not_float) >= 8  # idx, mask, pos and its arithmetic, ~mask, the comparisons, count
    for n in not_float:
        assert n.meta["val"].dtype == dtypes[n.name], n.name  # untouched
        assert "precision" not in n.meta.get(PROVENANCE_KEY, {}), n.name  # not painted
    casts = [n for n in gm.graph.nodes if cast_of(n) is not None]
    assert casts and all(cast_of(n)[0].meta["val"].dtype.is_floating_point for n in casts)  # type: ignore[index]
    assert any(op_name(n) == "embedding" for n in gm.graph.nodes)

    c = step_vs_fp32(model, (idx, mask), y, EAGER)
    assert_matches_fp32(c)


# -------------------------------------------------------------- buffers and frozen parameters


def test_batch_norm_buffers_stay_fp32_and_frozen_parameters_get_no_gradient_or_scale_point() -> None:
    model, (x,), y = conv_case()
    model.stem.weight.requires_grad_(False)  # frozen first layer: no gradient reaches it
    model.block.conv1.weight.requires_grad_(False)  # frozen middle layer: gradients pass through it
    reference = twin(model)
    scaler = GradScaler(model)
    backend = autoscale.backend(EAGER)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.01)

    _unscaled_grads_match_fp32(model, reference, compiled, scaler, opt, backend, (x,), y)  # (no step)
    assert model.stem.weight.grad is None and model.block.conv1.weight.grad is None
    (counts,) = _pass_counts(backend, "insert_grad_scaling")
    assert counts["scale_points"] == 3  # of the 4 convolutions and linears: none on the frozen stem,
    assert counts["unscaled"] == 9  # where no gradient flows; 11 - 2 frozen parameters to unscale
    layers = {r.name for r in scaler.layers()}
    assert "stem" not in layers and {"block.conv1", "block.conv2", "head"} <= layers

    for _ in range(3):
        _scaled_step(model, compiled, scaler, opt, x, target=y)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    assert scaler.skipped_steps == 0
    assert torch.equal(model.stem.weight, reference.stem.weight)  # frozen: bit-identical
    assert torch.equal(model.block.conv1.weight, reference.block.conv1.weight)
    ref_buffers = dict(reference.named_buffers())
    for name, buf in model.named_buffers():
        if name.startswith("_autoscale"):  # the scaler's state
            continue
        ref = ref_buffers[name]
        assert buf.dtype == ref.dtype, name
        if buf.is_floating_point():  # running mean and var: float32, as eager's
            assert sqnr(ref, buf) >= SQNR_MIN_DB[(torch.float16, "output")], name
        else:
            assert torch.equal(buf, ref), name  # num_batches_tracked
    assert len(backend.records) == 1


# ---------------------------------------------------------------------------- zero-size tensors


def test_a_batch_of_zero_rows_trains_nothing_and_skips_nothing() -> None:
    model, (x,), y = mlp_case()
    scaler = GradScaler(model)
    backend = autoscale.backend(EAGER)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def sum_loss(inputs: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(compiled(inputs), y[: len(inputs)], reduction="sum")

    first, _ = _scaled_step(model, sum_loss, scaler, opt, x)
    scales = model._autoscale_scales.clone()
    weights = copy.deepcopy(model.state_dict())
    loss, skipped = _scaled_step(model, sum_loss, scaler, opt, x[:0])
    assert float(loss) == 0.0 and not skipped
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # zero gradients
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert torch.isfinite(model._autoscale_stats).all() and torch.isfinite(model._autoscale_scales).all()
    assert torch.equal(model._autoscale_scales, scales)  # nothing measured: no scale moved
    assert all(math.isfinite(r.scale) and math.isfinite(r.zero_rate) for r in scaler.layers())
    loss, skipped = _scaled_step(model, sum_loss, scaler, opt, x)
    assert not skipped and float(loss) < float(first)  # and training goes on
    assert len(backend.records) == 2  # Dynamo specializes a size of 0


class _ZeroWidthConcat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        empty = h[:, :0] * 2  # a zero-width intermediate, with a gradient of zero width
        return self.b(torch.cat([empty, F.relu(h), x[:, :0]], dim=1))


def test_zero_width_tensors_inside_the_graph() -> None:
    torch.manual_seed(0)
    c = step_vs_fp32(_ZeroWidthConcat(), (torch.randn(8, 16),), torch.randint(0, 5, (8,)), EAGER)
    assert_matches_fp32(c)


# ------------------------------------------------------------------ model already in float16


def test_model_already_in_half_computes_as_given_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    """model.half(): float16 in, float16 compute, float16 gradients, as eager float16 computes;
    but there are no float32 master weights, which the warning says."""
    model, (x,), y = mlp_case()
    reference = twin(model)
    model.half()
    backend = autoscale.backend(EAGER)
    with caplog.at_level(logging.WARNING, logger="autoscale"):
        out = torch.compile(model, backend=backend)(x.half())
    loss = F.cross_entropy(out.float(), y)
    loss.backward()
    ref_loss, ref_grads = step(reference, None, (x,), y)
    assert out.dtype == torch.float16
    (record,) = backend.records
    assert record.low_precision_parameters == tuple(n for n, _ in model.named_parameters())
    assert len(_warnings(caplog)) == 1
    assert _pass_counts(backend, "convert_precision")[0]["casts"] == 0  # nothing to convert
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g.dtype == torch.float16 for g in grads.values())
    assert sqnr(ref_loss, loss) >= SQNR_MIN_DB[(torch.float16, "output")]
    for name, ref in ref_grads.items():
        assert sqnr(ref, grads[name].float()) >= SQNR_MIN_DB[(torch.float16, "grad")], name


def test_float32_model_does_not_warn_about_master_weights(caplog: pytest.LogCaptureFixture) -> None:
    model, (x,), _ = mlp_case()
    backend = autoscale.backend(EAGER)
    with caplog.at_level(logging.WARNING, logger="autoscale"):
        torch.compile(model, backend=backend)(x)
    assert backend.records[0].low_precision_parameters == () and not _warnings(caplog)


# --------------------------------------------------------------------- a loss that is already inf


class _PoisonedLoss(MLP):
    """The loss is in the graph; ``poison`` > 1 makes -log(sigmoid) of saturated logits log(0)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)
        return F.cross_entropy(out, y) - torch.log(torch.sigmoid(out * poison)).mean() * (poison > 1)


@pytest.mark.parametrize("mode", ["adaptive", "dynamic"])
def test_inf_loss_skips_the_step_and_training_continues(mode: str) -> None:
    torch.manual_seed(0)
    model, x, y = _PoisonedLoss(), torch.randn(8, 16), torch.randint(0, 5, (8,))
    scaler = GradScaler(model, ScalingConfig(mode=mode))
    backend = autoscale.backend(EAGER)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    clean, poisoned = torch.tensor(1.0), torch.tensor(1e4)
    first, _ = _scaled_step(model, compiled, scaler, opt, x, y, clean)

    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    scales = model._autoscale_scales.clone() if mode == "adaptive" else None
    loss_scale = scaler.get_scale()
    loss, skipped = _scaled_step(model, compiled, scaler, opt, x, y, poisoned)
    assert math.isinf(float(loss)) and skipped
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    after = opt.state_dict()
    assert after["state"].keys() == state["state"].keys()
    for i, s in state["state"].items():
        assert all(torch.equal(s[k], after["state"][i][k]) for k in s), i
    if mode == "adaptive":
        # The inf arose above every scale point, at the loss scale (1), and is blamed on no layer;
        # a layer backs off (x0.5) only where its scale made the gradient's finite part overflow.
        assert scales is not None
        rows = {name: row for row, name in enumerate(scaler._state.layers)}  # type: ignore[union-attr]
        for r in scaler.layers():
            old = float(scales[rows[r.name if r.name != "(root)" else ""]])
            assert r.scale == (old * 0.5 if r.overflows else old), r
        assert float(model._autoscale_scales[0]) == 1.0  # the loss row: adaptive mode's loss scale
    else:
        assert scaler.get_scale() == loss_scale * 0.5

    losses = [float(_scaled_step(model, compiled, scaler, opt, x, y, clean)[0]) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < float(first)
    assert scaler.skipped_steps == 1
    assert len(backend.records) == 1


# ------------------------------------------------------------------------ nested torch.compile


class _Outer(nn.Module):
    def __init__(self, inner_backend: Any) -> None:
        super().__init__()
        self.inner = MLP()
        self.inner_compiled = torch.compile(self.inner, backend=inner_backend)
        self.head = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.inner_compiled(x)))


def test_nested_compile_the_outer_backend_compiles_everything() -> None:
    """Dynamo inlines a compiled submodule into the outer graph: the inner backend is never
    called, whichever it is (so an inner autoscale inside an outer backend of another kind runs
    in float32; tests/reliability's doc table says so)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    inner = autoscale.backend(EAGER)
    c = step_vs_fp32(_Outer(inner), (x,), y, EAGER)
    assert_matches_fp32(c)
    assert not inner.records and len(c.backend.records) == 1
    report = c.backend.records[0].report
    assert report.converted == report.total == 7
    assert _pass_counts(c.backend, "emulate_compute")[0]["emulated"] == 4  # the inner's 3 GEMMs and the head

    torch._dynamo.reset()
    inner = autoscale.backend(EAGER)
    model = _Outer(inner)
    reference = twin(model)
    loss, _ = step(model, torch.compile(model, backend="aot_eager"), (x,), y)
    ref_loss, _ = step(reference, None, (x,), y)
    assert not inner.records
    assert sqnr(ref_loss, loss) >= SQNR_MIN_DB_SAME_GRAPH  # float32 to rounding order: autoscale never ran


def test_compiling_a_compiled_model_uses_the_outer_backend() -> None:
    model, (x,), y = mlp_case()
    reference = twin(model)
    inner, outer = autoscale.backend(EAGER), autoscale.backend(EAGER)
    loss, grads = step(model, torch.compile(torch.compile(model, backend=inner), backend=outer), (x,), y)
    ref_loss, ref_grads = step(reference, None, (x,), y)
    assert not inner.records and len(outer.records) == 1
    assert_matches_fp32(Comparison(outer, loss, grads, ref_loss, ref_grads))


def test_scaler_on_a_compiled_submodule_of_a_compiled_model_names_its_layers() -> None:
    """The GradScaler belongs to the inner model; its layers keep their own rows (and names)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    model = _Outer(autoscale.backend(EAGER))
    reference = twin(model)
    scaler = GradScaler(model.inner)
    backend = autoscale.backend(EAGER)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):
        _scaled_step(model, compiled, scaler, opt, x, target=y)
    assert {"fc1", "fc2", "fc3"} <= {r.name for r in scaler.layers()}
    assert all(r.scale > 1 for r in scaler.layers() if r.name.startswith("fc"))
    _unscaled_grads_match_fp32(model, reference, compiled, scaler, opt, backend, (x,), y)


# --------------------------------------------------------------------------- bad Config values

# Fields whose bad values tests/test_config.py already checks.
_IN_TEST_CONFIG = {("Config", f) for f in ("dtype", "float8", "quant", "compute", "executor", "allow", "deny",
                                           "scaling", "overflow", "form")} | {
    ("ScalingConfig", "mode"), ("ScalingConfig", "gamma"), ("ScalingConfig", "point_kernel")} | {
    ("QuantConfig", f) for f in ("grad_bits", "momentum", "weights")}

# One field, one bad value: "<Class>.<field>=<value!r> is not valid; " and then what is allowed.
_BAD_VALUES: list[tuple[type, str, Any, str]] = [
    (Config, "verify", "yes", "it must be a bool"),
    (ScalingConfig, "rule", "ieee", "allowed values: 'headroom', 'paper'"),
    (ScalingConfig, "placement", "everywhere", "allowed values: 'predicted', 'all'"),
    (ScalingConfig, "gamma", "0.1", "it must be a number in (0, 1)"),
    (ScalingConfig, "gamma", math.nan, "it must be a number in (0, 1)"),
    (ScalingConfig, "margin", -1, "it must be an int >= 0"),
    (ScalingConfig, "margin", True, "it must be an int >= 0"),
    (ScalingConfig, "calibrate", "yes", "it must be a bool"),
    (ScalingConfig, "update_every", 0, "it must be an int >= 1"),
    (ScalingConfig, "update_every", 2.0, "it must be an int >= 1"),
    (ScalingConfig, "measure_every", 0, "it must be an int >= 1"),
    (ScalingConfig, "growth_interval", 0, "it must be an int >= 1"),
    (ScalingConfig, "hysteresis", 0, "it must be an int >= 1"),
    (ScalingConfig, "init_scale", 0, "it must be a finite number > 0"),
    (ScalingConfig, "init_scale", "big", "it must be a finite number > 0"),
    (ScalingConfig, "init_scale", None, "it must be a finite number > 0"),
    (ScalingConfig, "init_scale", math.inf, "it must be a finite number > 0"),
    (ScalingConfig, "min_scale", -1.0, "it must be a finite number > 0"),
    (ScalingConfig, "growth_factor", 0.5, "it must be a finite number >= 1"),
    (ScalingConfig, "growth_factor", math.inf, "it must be a finite number >= 1"),
    (ScalingConfig, "backoff_factor", 1.0, "it must be in (0, 1)"),
    (ScalingConfig, "backoff_factor", "half", "it must be in (0, 1)"),
    (ScalingConfig, "scale_upper_bound", 0.5, "it must be None or >= 1"),
    (ScalingConfig, "scale_upper_bound", "x", "it must be None or >= 1"),
    (ScalingConfig, "scale_upper_bound", math.nan, "it must be None or >= 1"),
    (QuantConfig, "activations", "no", "it must be a bool"),
    (QuantConfig, "grad_bits", 32, "it must be None or an int in [2, 16]"),
    (QuantConfig, "momentum", "x", "it must be in [0, 1)"),
    (QuantConfig, "momentum", True, "it must be in [0, 1)"),
    (OverflowConfig, "predict", 1, "it must be a bool"),
    (OverflowConfig, "watch", "on", "it must be a bool"),
    (OverflowConfig, "threshold", 0.0, "it must be in (0, 1]"),
    (OverflowConfig, "threshold", 1.5, "it must be in (0, 1]"),
    (OverflowConfig, "max_recompiles", -1, "it must be an int >= 0"),
    (OverflowConfig, "patience", 0, "it must be an int >= 1"),
]

# The op-name lists: their own messages (still naming the field and what it takes).
_BAD_OPS: list[tuple[dict[str, Any], str]] = [
    ({"infer": ("linear",), "clear": ("linear",)}, r"'linear' is listed in both Config\.infer and Config\.clear"),
    ({"deny": ("torch.mm",)}, r"Config\.deny contains 'torch\.mm', which is not an op name: .*without namespace"),
    ({"clear": "view"}, r"Config\.clear must be a tuple of op names"),
    ({"infer": (None,)}, r"Config\.infer must contain op names"),
]


@pytest.mark.parametrize(("cls", "name", "value", "allowed"), _BAD_VALUES,
                         ids=[f"{c.__name__}.{n}={v!r}" for c, n, v, _ in _BAD_VALUES])
def test_bad_config_value_is_a_value_error_naming_field_and_allowed(cls: type, name: str, value: Any,
                                                                       allowed: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{cls.__name__}.{name}={value!r} is not valid; {allowed}")):
        cls(**{name: value})


@pytest.mark.parametrize(("kwargs", "message"), _BAD_OPS, ids=[str(k) for k, _ in _BAD_OPS])
def test_bad_op_lists(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**kwargs)


def test_every_config_field_has_a_bad_value_test() -> None:
    """Between this file and tests/test_config.py, every field of the four configs is tried with a
    bad value (bool and tuple fields included)."""
    tried = (_IN_TEST_CONFIG | {(cls.__name__, name) for cls, name, _, _ in _BAD_VALUES}
             | {("Config", f) for kwargs, _ in _BAD_OPS for f in kwargs})
    fields = {(cls.__name__, f.name) for cls in (Config, ScalingConfig, QuantConfig, OverflowConfig)
              for f in cls.__dataclass_fields__.values()}
    assert fields - tried == set()


def test_bad_config_fails_before_compiling_and_backend_options_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Config\.executor='tvm' is not valid"):
        autoscale.backend(Config(executor="tvm"))  # (raised by Config, before any compile)
    with pytest.raises(ValueError, match=r"GradScaler config must be an autoscale\.Config or ScalingConfig"):
        GradScaler(MLP(), {"mode": "dynamic"})  # type: ignore[arg-type]
    compiled = torch.compile(MLP(), backend="autoscale", options={"dtype": "bf16"})
    with pytest.raises(Exception, match=r"the 'autoscale' backend takes no options .*autoscale\.backend"):
        compiled(torch.randn(2, 16))
