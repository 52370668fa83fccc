"""The training loops people write, under torch.amp and both autoscale modes alike.

Each pattern is a loop that works with torch.amp's GradScaler; it runs with each scaler
(``tests.test_scaler_semantics``'s rigs: torch.amp with autocast, autoscale dynamic and adaptive
with the model compiled) and is compared, as PyTorch's own scaling tests do, with the unscaled
run at the same precision that skips the same step by hand. At ``SKIP_ITER`` the pattern itself
makes a gradient non-finite between the backward and the step: every scaler must skip that step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from tests.test_scaler_semantics import (
    KINDS,
    SKIP_ITER,
    Rig,
    _Model,
    assert_close,
    backward_and_step,
    pair,
    plain_step,
    rig,
    run_case,
)

INF = float("inf")


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _edited_step(edit: Callable[[Rig, bool], None], *, set_to_none: bool = True
                 ) -> Callable[[Rig, int, torch.Tensor, torch.Tensor], None]:
    """A plain step with ``edit(rig, bad)`` between the backward and the step; ``bad`` at
    ``SKIP_ITER``, where the edit makes a gradient non-finite and the reference skips by hand."""
    def step(r: Rig, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        (opt,) = r.optimizers
        opt.zero_grad(set_to_none=set_to_none)
        loss = F.mse_loss(r(x).float(), y)
        bad = i == SKIP_ITER
        if not r.scaled:
            loss.backward()
            edit(r, False)
            if not bad:
                opt.step()
            return
        r.scaler.scale(loss).backward()
        edit(r, bad)
        r.scaler.step(opt)
        r.scaler.update()

    return step


def _check(kind: str, step: Callable[[Rig, int, torch.Tensor, torch.Tensor], None]) -> None:
    scaled, reference = pair(kind, _Model)
    changed = run_case(scaled, step, lr=0.1, skip_iter=None)
    run_case(reference, step, lr=0.1, skip_iter=None)
    assert changed == [i != SKIP_ITER for i in range(len(changed))], changed
    assert_close(scaled.model, reference.model)


def test_a_gradient_filled_by_hand(kind: str) -> None:
    def edit(r: Rig, bad: bool) -> None:
        if bad:
            r.model.l1.weight.grad.fill_(INF)  # type: ignore[union-attr]

    _check(kind, _edited_step(edit))


def test_a_gradient_assigned_from_elsewhere(kind: str) -> None:
    """Gradients computed elsewhere (another process, a teacher) assigned to ``.grad``."""
    def edit(r: Rig, bad: bool) -> None:
        weight = r.model.l0.weight
        assert weight.grad is not None
        weight.grad = torch.full_like(weight.grad, INF) if bad else weight.grad.clone()

    _check(kind, _edited_step(edit))


def test_gradients_averaged_in_place_as_a_manual_all_reduce_does(kind: str) -> None:
    """A manual all-reduce of one rank: every gradient summed with the others' and divided, in
    place; at ``SKIP_ITER`` another rank's gradient is inf."""
    def edit(r: Rig, bad: bool) -> None:
        for p in r.model.parameters():
            assert p.grad is not None
            p.grad.add_(torch.full_like(p.grad, INF) if bad and p is r.model.l0.bias else p.grad).div_(2)

    _check(kind, _edited_step(edit))


def test_gradients_compressed_to_float16_as_a_communication_hook_does(kind: str) -> None:
    """A DDP communication hook's compression (``fp16_compress_hook``): each gradient through
    float16 and back, in place; at ``SKIP_ITER`` a pre-divide too small for the bucket overflows."""
    def edit(r: Rig, bad: bool) -> None:
        factor = 2.0**20 if bad else 1.0
        for p in r.model.parameters():
            assert p.grad is not None
            p.grad.copy_((p.grad * factor).half().float() / factor)

    _check(kind, _edited_step(edit))


def test_zero_grad_without_set_to_none(kind: str) -> None:
    """``zero_grad(set_to_none=False)``: the backward accumulates into the zeroed gradients."""
    def edit(r: Rig, bad: bool) -> None:
        if bad:
            r.model.l1.bias.grad.fill_(INF)  # type: ignore[union-attr]

    _check(kind, _edited_step(edit, set_to_none=False))


def test_several_backwards_before_one_step_with_an_edit_between_them(kind: str) -> None:
    """Two micro-batches a step, a gradient made inf between their backward calls: the second
    accumulates into it, and the step must still be skipped."""
    def step(r: Rig, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        (opt,) = r.optimizers
        opt.zero_grad(set_to_none=True)
        bad = i == SKIP_ITER
        for half, micro in enumerate((slice(0, 4), slice(4, 8))):
            loss = F.mse_loss(r(x[micro]).float(), y[micro]) / 2
            (r.scaler.scale(loss) if r.scaled else loss).backward()
            if half == 0 and bad and r.scaled:
                r.model.l0.weight.grad.fill_(INF)  # type: ignore[union-attr]
        if r.scaled:
            r.scaler.step(opt)
            r.scaler.update()
        elif not bad:
            opt.step()

    _check(kind, step)


def test_an_edit_through_data_bypasses_the_version_counter(kind: str, request: pytest.FixtureRequest) -> None:
    """The one write not seen in adaptive mode (``autoscale.checked_grads``): through ``.data``,
    whose version counter is not the gradient's, the tensor looks untouched since the compiled
    backward checked it."""
    if kind == "adaptive":
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="a write through .data bypasses autograd's version counter: adaptive mode cannot "
                                "tell the gradient changed after the compiled backward checked it"))

    def edit(r: Rig, bad: bool) -> None:
        if bad:
            r.model.l1.weight.grad.data.fill_(INF)  # type: ignore[union-attr]

    _check(kind, _edited_step(edit))


class _Towers(nn.Module):
    """Two modules of one class (two towers, an ensemble, a teacher and a student), each compiled
    on its own under one scaler: two ``_Model``s, or two ``nn.Sequential``s of one (``torch.nn``'s
    own classes, which ``torch.compile`` starts from a frame of its own)."""

    def __init__(self, sequential: bool) -> None:
        super().__init__()
        tower = (lambda: nn.Sequential(_Model(), nn.ReLU(), nn.Linear(8, 8))) if sequential else _Model
        self.a, self.b = tower(), tower()
        with torch.no_grad():
            next(self.b.parameters()).mul_(4)  # (towers of one class need not share a scale)


def _towers(kind: str, model: _Towers, *, scaled: bool = True) -> Rig:
    r = rig(kind, model, scaled=scaled)
    if kind == "torch.amp":
        r.forward = lambda x: model.a(x) + model.b(x)
    else:
        backend = autoscale.backend(autoscale.Config(executor="eager", scaling=r.scaler.config))
        a, b = torch.compile(model.a, backend=backend), torch.compile(model.b, backend=backend)
        r.forward = lambda x: a(x) + b(x)
    return r


@pytest.mark.parametrize("sequential", [False, True], ids=["model", "sequential"])
def test_two_modules_of_one_class_each_compiled(kind: str, sequential: bool) -> None:
    """Dynamo compiles the class's forward once and reuses the graph for the other instance: each
    instance gets a graph of its own (``backend._per_instance``), scaled in its own layers' rows."""
    torch.manual_seed(0)
    model = _Towers(sequential)
    scaled, reference = _towers(kind, model), _towers(kind, copy.deepcopy(model), scaled=False)
    changed = run_case(scaled, plain_step, lr=0.1)
    run_case(reference, plain_step, lr=0.1)
    assert changed == [i != SKIP_ITER for i in range(len(changed))], changed
    assert_close(scaled.model, reference.model)
    if kind == "adaptive":
        rows = {r.name for r in scaled.scaler.layers()}
        layers = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        assert layers <= rows, rows  # each tower's own layers, not one row per tower


def test_an_ema_copy_of_the_model(kind: str) -> None:
    """An exponential moving average of the weights (``copy.deepcopy`` of the model, updated after
    every step; in adaptive mode the copy carries a copy of the scaler's state, unused)."""
    emas: dict[int, nn.Module] = {}

    def step(r: Rig, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        ema = emas.setdefault(id(r), copy.deepcopy(r.model))
        _edited_step(lambda r, bad: None)(r, i, x, y)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), r.model.parameters(), strict=True):
                e.lerp_(p, 0.1)

    scaled, reference = pair(kind, _Model)
    run_case(scaled, step, lr=0.1)
    run_case(reference, step, lr=0.1)
    assert_close(scaled.model, reference.model)
    assert_close(emas[id(scaled)], emas[id(reference)])


def _frozen() -> nn.Module:
    model = _Model()
    model.l0.weight.requires_grad_(False)  # (fine-tuning: part of the model frozen)
    return model


def test_frozen_parameters(kind: str) -> None:
    scaled, reference = pair(kind, _frozen)
    frozen = scaled.model.l0.weight.detach().clone()
    run_case(scaled, plain_step, lr=0.1)
    run_case(reference, plain_step, lr=0.1)
    assert_close(scaled.model, reference.model)
    assert torch.equal(scaled.model.l0.weight, frozen)


class _Branches(_Model):
    """A layer used only at some steps (a mixture's expert not routed to, a head trained every
    other step): its parameters get no gradient then."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        out = super().forward(x)
        return self.extra(out) if use_extra else out


def test_parameters_without_a_gradient_at_some_steps(kind: str) -> None:
    def step(r: Rig, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        (opt,) = r.optimizers
        opt.zero_grad(set_to_none=True)
        backward_and_step(r, i, F.mse_loss(r(x, i % 2 == 0).float(), y))

    scaled, reference = pair(kind, _Branches)
    changed = run_case(scaled, step, lr=0.1)
    run_case(reference, step, lr=0.1)
    assert changed == [i != SKIP_ITER for i in range(len(changed))], changed
    assert_close(scaled.model, reference.model)


def test_a_gradient_hook_that_rescales_and_at_one_step_overflows(kind: str) -> None:
    """A tensor hook on a weight (a per-parameter clip or rescale), which at ``SKIP_ITER`` makes
    the gradient inf; it runs after the compiled backward checked the gradient."""
    at = {"step": 0}

    def hooked(r: Rig) -> Rig:
        r.model.l1.weight.register_hook(
            lambda g: torch.full_like(g, INF) if r.scaled and at["step"] == SKIP_ITER else g * 0.5)
        return r

    def step(r: Rig, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        at["step"] = i
        plain_step(r, i, x, y)

    scaled, reference = (hooked(r) for r in pair(kind, _Model))
    changed = run_case(scaled, step, lr=0.1, skip_iter=None)
    run_case(reference, step, lr=0.1, skip_iter=None)
    assert changed == [i != SKIP_ITER for i in range(len(changed))], changed
    assert_close(scaled.model, reference.model)
