"""torch.amp.GradScaler's semantics, checked on torch.amp and on autoscale's GradScaler alike.

Each test follows one of PyTorch's own ``test_grad_scaling_*`` tests (test/test_torch.py) on CPU
and runs three ways:

* ``torch.amp``: ``torch.amp.GradScaler`` with an eager model under ``torch.autocast`` (float16);
* ``dynamic``: autoscale's GradScaler in dynamic mode (one loss scale), the model compiled with
  ``backend=autoscale``;
* ``adaptive``: the same in adaptive mode (per-layer scales, the default).

As in PyTorch's tests, a scaled run is compared with an unscaled run of the same model at the
same precision (torch.amp: autocast without a scaler; autoscale: the same backend with
``ScalingConfig(mode="none")``) that skips the same steps by hand. Overflows are injected into a
gradient *inside* the backward (``_InjectInf``), where each of the three sees them. Where
adaptive mode legitimately differs, the test says so in an xfail with the reason.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from autoscale import ScalingConfig

KINDS = ("torch.amp", "dynamic", "adaptive")
INIT_SCALE = 128.0  # as PyTorch's tests
ITERS, SKIP_ITER = 4, 2
ADAPTIVE_HAS_NO_LOSS_SCALE = pytest.mark.xfail(
    reason="adaptive mode keeps one scale per layer (GradScaler.layers()), not a loss scale: get_scale() stays 1; "
           "the per-layer growth and back-off are tested in tests/test_scaler.py", strict=True)


class _Inject(torch.autograd.Function):
    """Identity whose backward returns ``bad`` (inf or nan) everywhere unless it is 0: an overflow
    inside the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(bad)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (bad,) = ctx.saved_tensors
        return torch.where(bad != 0, bad.to(grad.dtype).expand_as(grad), grad), None


class _Model(nn.Module):
    """PyTorch's scaling-test model (two Linear(8, 8)), with an injectable inf between them."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("inject", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(_Inject.apply(self.l0(x), self.inject))


class _Two(nn.Module):
    """Two models behind one forward (PyTorch's test_grad_scaling_multiple), one optimizer each."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Model(), _Model()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class _Sparse(nn.Module):
    """An embedding with sparse gradients (PyTorch's test_grad_scaling_unscale_sparse, in a model)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.l1 = nn.Embedding(16, 8, sparse=True), nn.Linear(8, 8)
        self.register_buffer("inject", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(_Inject.apply(self.emb(x), self.inject))


@dataclass
class Rig:
    """One way to train ``model``: its forward, its scaler, and whether the scaler is enabled."""

    kind: str
    model: nn.Module
    forward: Callable[..., Any]
    scaler: Any
    scaled: bool
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)

    def __call__(self, *args: Any) -> Any:
        if self.kind == "torch.amp":
            with torch.autocast("cpu", dtype=torch.float16):
                return self.forward(*args)
        return self.forward(*args)

    def inject(self, bad: float) -> None:
        """Make the next backwards inf or nan (``bad``), or not (0)."""
        for m in self.model.modules():
            if hasattr(m, "inject"):
                m.inject.fill_(bad)


def rig(kind: str, model: nn.Module, *, scaled: bool = True, **scaler_options: Any) -> Rig:
    """``model`` set up for ``kind``; ``scaled=False`` gives the unscaled reference at the same precision."""
    options = {"init_scale": INIT_SCALE, "growth_interval": 1, **scaler_options}
    if kind == "torch.amp":
        return Rig(kind, model, model, torch.amp.GradScaler("cpu", enabled=scaled, **options), scaled)
    mode = kind if scaled else "none"
    config = autoscale.Config(executor="eager", scaling=ScalingConfig(mode=mode, **options))
    scaler = autoscale.GradScaler(model, config)  # before the first forward (adaptive: it installs state)
    return Rig(kind, model, torch.compile(model, backend=autoscale.backend(config)), scaler, scaled)


def pair(kind: str, make: Callable[[], nn.Module], **scaler_options: Any) -> tuple[Rig, Rig]:
    """A scaled rig and its unscaled reference, from the same initial weights."""
    torch.manual_seed(0)
    model = make()
    return rig(kind, model, **scaler_options), rig(kind, copy.deepcopy(model), scaled=False)


def data(n: int = ITERS, *, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(n)]


def assert_close(a: nn.Module, b: nn.Module, *, atol: float = 1e-3) -> None:
    """PyTorch's tests compare the scaled and unscaled runs at atol 1e-3; float16 keeps that."""
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-3, msg=name)


def run_case(r: Rig, step: Callable[[Rig, int, torch.Tensor, torch.Tensor], None], *, lr: float = 1.0,
             optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.SGD, skip_iter: int | None = SKIP_ITER,
             batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> list[bool]:
    """PyTorch's ``_run_scaling_case``: ``step`` trains one batch; at ``skip_iter`` an inf is injected
    into the backward. The unscaled reference skips that step by hand. Returns whether each step
    changed the weights."""
    if not r.optimizers:
        r.optimizers = [optimizer(r.model.parameters(), lr=lr)]
    changed = []
    for i, (x, y) in enumerate(batches or data()):
        before = [p.detach().clone() for p in r.model.parameters()]
        r.inject(float("inf") if r.scaled and i == skip_iter else 0.0)
        step(r, i, x, y)
        changed.append(any(not torch.equal(a, p) for a, p in zip(before, r.model.parameters(), strict=True)))
    return changed


def plain_step(r: Rig, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
    r.optimizers[0].zero_grad(set_to_none=True)
    backward_and_step(r, i, F.mse_loss(r(x).float(), y))


def backward_and_step(r: Rig, i: int, loss: torch.Tensor) -> None:
    """The scaled loop's backward, step and update; the unscaled reference skips ``SKIP_ITER`` by hand."""
    (opt,) = r.optimizers
    if r.scaled:
        r.scaler.scale(loss).backward()
        r.scaler.step(opt)
        r.scaler.update()
    else:
        loss.backward()
        if i != SKIP_ITER:
            opt.step()


def _weights(model: nn.Module) -> dict[str, list[float]]:
    return {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}


def skipped(r: Rig) -> int:
    """Skipped steps as each scaler can tell (torch.amp cannot: its scale history says)."""
    return r.scaler.skipped_steps if r.kind != "torch.amp" else -1


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# ------------------------------------------------------------------------------ the scale itself


def test_scale_takes_a_tensor_or_nested_iterables(kind: str) -> None:
    """test_grad_scaling_scale: tensors, lists, tuples and other iterables, each multiplied."""
    r, _ = pair(kind, _Model)
    out = r(torch.randn(2, 8)).float().sum()
    s = r.scaler.get_scale()
    assert torch.equal(r.scaler.scale(out), out * s)
    as_list = r.scaler.scale([out, out * 2])
    as_tuple = r.scaler.scale((out, (out * 3, out)))
    assert isinstance(as_list, list) and isinstance(as_tuple, tuple) and isinstance(as_tuple[1], tuple)
    assert torch.equal(as_list[1], out * 2 * s) and torch.equal(as_tuple[1][0], out * 3 * s)
    assert [float(t.detach()) for t in r.scaler.scale(iter([out, out]))] == [float(out.detach() * s)] * 2
    with pytest.raises((ValueError, AttributeError, TypeError)):
        r.scaler.scale(3.0)


@pytest.mark.parametrize("kind", ["torch.amp", "dynamic", pytest.param("adaptive", marks=ADAPTIVE_HAS_NO_LOSS_SCALE)])
def test_scale_grows_and_backs_off(kind: str) -> None:
    """test_grad_scaling_update_scale / _run_scaling_case: growth_interval=1 doubles the scale at
    every finite step, an overflow halves it: 128 · 2³ · 0.5 after four steps with one skipped."""
    r, _ = pair(kind, _Model)
    run_case(r, plain_step)
    assert r.scaler.get_scale() == INIT_SCALE * 2.0**3 * 0.5


# -------------------------------------------------------------------------- unscaling and skipping


def test_unscale_finds_inf_and_nan_and_skips_the_step(kind: str) -> None:
    """test_grad_scaling_unscale: unscale_ divides by the scale; an inf or a nan anywhere in the
    backward skips the step, leaving weights and optimizer state as they were."""
    for bad in (float("inf"), float("nan")):
        r, _ = pair(kind, _Model)
        opt = torch.optim.Adam(r.model.parameters(), lr=1e-2)
        x, y = data(1)[0]
        loss = F.mse_loss(r(x).float(), y)
        r.scaler.scale(loss).backward()
        r.scaler.unscale_(opt)
        reference = copy.deepcopy(r.model)
        reference.zero_grad()
        F.mse_loss(reference(x), y).backward()
        for p, q in zip(r.model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=2e-3, rtol=2e-2)  # float16 vs float32
        r.scaler.step(opt)
        r.scaler.update()
        opt.zero_grad()
        weights, state = _weights(r.model), copy.deepcopy(opt.state_dict())
        r.inject(bad)
        r.scaler.scale(F.mse_loss(r(x).float(), y)).backward()
        r.scaler.step(opt)
        r.scaler.update()
        assert _weights(r.model) == weights
        assert torch.equal(opt.state_dict()["state"][0]["step"], state["state"][0]["step"])
        if kind != "torch.amp":
            assert r.scaler.skipped_steps == 1
            assert bool(r.scaler.last_step_skipped)


def test_steps_skipped_by_an_overflow_match_the_unscaled_run(kind: str) -> None:
    """_run_scaling_case itself: four steps of SGD(lr=1) with an inf injected at the third; the
    scaled run skips exactly it and ends where the unscaled run that skipped it by hand does."""
    r, ref = pair(kind, _Model)
    assert run_case(r, plain_step) == [True, True, False, True]
    run_case(ref, plain_step)
    assert_close(r.model, ref.model)
    assert skipped(r) in (1, -1)


def test_unscale_twice_or_after_step_raises(kind: str) -> None:
    r, _ = pair(kind, _Model)
    opt = torch.optim.SGD(r.model.parameters(), lr=0.1)
    x, y = data(1)[0]
    r.scaler.scale(F.mse_loss(r(x).float(), y)).backward()
    r.scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        r.scaler.unscale_(opt)
    r.scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        r.scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        r.scaler.step(opt)
    r.scaler.update()
    r.scaler.scale(F.mse_loss(r(x).float(), y)).backward()
    r.scaler.unscale_(opt)  # a new step: allowed again


def test_a_gradient_made_inf_after_the_backward_skips_the_step(kind: str) -> None:
    """test_grad_scaling_unscale sets gradients by hand; _run_scaling_case fills one with inf after
    the backward. (Adaptive mode: the gradient is no longer the one the compiled backward checked,
    so step() checks it again.)"""
    r, _ = pair(kind, _Model)
    opt = torch.optim.SGD(r.model.parameters(), lr=0.1)
    x, y = data(1)[0]
    r.scaler.scale(F.mse_loss(r(x).float(), y)).backward()
    r.model.l1.weight.grad.fill_(float("inf"))
    weights = _weights(r.model)
    r.scaler.step(opt)
    r.scaler.update()
    assert _weights(r.model) == weights


@pytest.mark.parametrize("hook", ["post_accumulate", "tensor"])
def test_an_inf_written_by_a_gradient_hook_skips_the_step(kind: str, hook: str) -> None:
    """Gradient hooks run after the compiled backward has checked the gradient (a DDP-like
    compression, a user's clamp gone wrong): step() checks those gradients again."""
    r, _ = pair(kind, _Model)
    opt = torch.optim.SGD(r.model.parameters(), lr=0.1)
    weight = r.model.l1.weight
    if hook == "post_accumulate":
        def fill(p: torch.Tensor) -> None:
            p.grad.fill_(float("inf"))

        weight.register_post_accumulate_grad_hook(fill)
    else:
        weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    x, y = data(1)[0]
    r.scaler.scale(F.mse_loss(r(x).float(), y)).backward()
    weights = _weights(r.model)
    r.scaler.step(opt)
    r.scaler.update()
    assert _weights(r.model) == weights


def test_float16_gradients_are_refused(kind: str) -> None:
    """torch.amp refuses to unscale float16 gradients (float32 master weights are the contract)."""
    r, _ = pair(kind, _Model)
    half = nn.Parameter(torch.ones(4, dtype=torch.float16))
    half.grad = torch.ones_like(half)
    r.scaler.scale(torch.ones(()))  # (torch.amp makes its scale at the first scale())
    with pytest.raises(ValueError, match="(?i)unscale (fp16|float16) gradients"):
        r.scaler.unscale_(torch.optim.SGD([half], lr=0.1))


# ------------------------------------------------------------------------------- loop patterns


@pytest.mark.parametrize("separate_unscale", [True, False], ids=["after_unscale", "scaled"])
def test_clipping(kind: str, separate_unscale: bool) -> None:
    """test_grad_scaling_clipping_separate_unscale: clip_grad_norm_ after unscale_ clips the true
    gradients. test_grad_scaling_clipping: without unscale_, the scaled gradients are clipped at
    max_norm · get_scale() (in adaptive mode they leave the backward unscaled and get_scale() is 1:
    the same code is right). Either way the scaled run matches the unscaled run clipped alike."""
    max_norm = 0.2

    def step(r: Rig, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        (opt,) = r.optimizers
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(r(x).float(), y)
        if r.scaled:
            r.scaler.scale(loss).backward()
            if separate_unscale:
                r.scaler.unscale_(opt)
            clip = max_norm if separate_unscale else max_norm * r.scaler.get_scale()
            norm = torch.nn.utils.clip_grad_norm_(r.model.parameters(), clip, error_if_nonfinite=False)
            if separate_unscale and i != SKIP_ITER:
                assert float(norm) > max_norm  # (clipping does something)
                total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in r.model.parameters()]))
                assert float(total) <= max_norm * (1 + 1e-5)
            r.scaler.step(opt)
            r.scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(r.model.parameters(), max_norm)
            if i != SKIP_ITER:
                opt.step()

    r, ref = pair(kind, _Model)
    run_case(r, step)
    run_case(ref, step)
    assert_close(r.model, ref.model)


def test_accumulation_over_micro_batches(kind: str) -> None:
    """test_grad_scaling_accumulation: two scaled backwards accumulate before one step."""
    def step(r: Rig, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        (opt,) = r.optimizers
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = F.mse_loss(r(xs).float(), ys) / 2
            (r.scaler.scale(loss) if r.scaled else loss).backward()
        if r.scaled:
            r.scaler.step(opt)
            r.scaler.update()
        elif i != SKIP_ITER:
            opt.step()

    r, ref = pair(kind, _Model)
    assert run_case(r, step) == [True, True, False, True]
    run_case(ref, step)
    assert_close(r.model, ref.model)


def test_multiple_losses_and_optimizers(kind: str) -> None:
    """test_grad_scaling_multiple: two losses from two models' outputs, one optimizer per model;
    an inf in one model's backward skips the step of both optimizers."""
    def step(r: Rig, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt0, opt1 = r.optimizers
        for opt in r.optimizers:
            opt.zero_grad(set_to_none=True)
        out0, out1 = (o.float() for o in r(x))
        loss0 = F.mse_loss(0.3 * out0 + 0.7 * out1, y)
        loss1 = F.mse_loss(0.6 * out0 - 0.4 * out1, y)
        if r.scaled:
            r.scaler.scale(loss0).backward(retain_graph=True)
            r.scaler.scale(loss1).backward()
            r.scaler.unscale_(opt0)  # one optimizer unscaled by hand, the other by step()
            r.scaler.step(opt0)
            r.scaler.step(opt1)
            r.scaler.update()
        else:
            (loss0 + loss1).backward()
            if i != SKIP_ITER:
                opt0.step()
                opt1.step()

    r, ref = pair(kind, _Two)
    for each in (r, ref):
        two: Any = each.model
        each.optimizers = [torch.optim.SGD(two.a.parameters(), lr=1.0), torch.optim.SGD(two.b.parameters(), lr=1.0)]
    assert run_case(r, step) == [True, True, False, True]
    run_case(ref, step)
    assert_close(r.model, ref.model)


@pytest.mark.parametrize("options", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_foreach_and_fused_optimizers(kind: str, optimizer: Callable[..., torch.optim.Optimizer],
                                      options: dict[str, bool]) -> None:
    """test_grad_scaling_autocast_foreach / _fused: fused optimizers unscale and skip on the device
    (torch.amp's protocol: grad_scale and found_inf); a skipped step leaves their state alone."""
    def make(params: Iterator[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        return optimizer(params, lr=lr * 1e-2, **options)

    r, ref = pair(kind, _Model)
    assert run_case(r, plain_step, optimizer=make) == [True, True, False, True]
    run_case(ref, plain_step, optimizer=make)
    assert_close(r.model, ref.model)
    (opt,) = r.optimizers
    if optimizer is not torch.optim.SGD:
        assert all(int(s["step"]) == ITERS - 1 for s in opt.state.values())


def test_sparse_gradients(kind: str) -> None:
    """test_grad_scaling_unscale_sparse, in a model: an embedding with sparse=True. Its gradient is
    unscaled and checked like any other (an inf in it skips the step); autoscale keeps the embedding
    in float32 (a sparse gradient cannot pass back through a cast) and casts its output."""
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 16, (8,), generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(ITERS)]
    r, ref = pair(kind, _Sparse)
    assert run_case(r, plain_step, batches=batches) == [True, True, False, True]
    assert r.model.emb.weight.grad.is_sparse
    run_case(ref, plain_step, batches=batches)
    assert_close(r.model, ref.model)


def test_gradient_penalty(kind: str) -> None:
    """test_grad_scaling_penalty: a penalty on the gradients' norm, through
    torch.autograd.grad(create_graph=True), then a second backward. torch.compile's AOTAutograd has
    no double backward (with any backend), so autoscale refuses, in words."""
    def step(r: Rig, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        (opt,) = r.optimizers
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(r(x).float(), y)
        params = list(r.model.parameters())
        if r.scaled:
            grads = torch.autograd.grad(r.scaler.scale(loss), params, create_graph=True)
            inv = 1.0 / r.scaler.get_scale()
            grads = tuple(g * inv for g in grads)
        else:
            grads = torch.autograd.grad(loss, params, create_graph=True)
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        backward_and_step(r, i, loss + penalty)

    r, ref = pair(kind, _Model)
    if kind != "torch.amp":
        with pytest.raises(RuntimeError, match="double backward"):
            run_case(r, step, lr=0.1)
        return
    assert run_case(r, step, lr=0.1) == [True, True, False, True]
    run_case(ref, step, lr=0.1)
    assert_close(r.model, ref.model)


def test_closures_are_refused(kind: str) -> None:
    """torch.amp.GradScaler.step refuses a closure: the gradients it makes would be neither checked
    nor unscaled."""
    r, _ = pair(kind, _Model)
    opt = torch.optim.SGD(r.model.parameters(), lr=0.1)
    x, y = data(1)[0]

    def closure() -> torch.Tensor:
        loss = F.mse_loss(r(x).float(), y)
        r.scaler.scale(loss).backward()
        return loss

    closure()
    with pytest.raises(RuntimeError, match="(?i)closure"):
        r.scaler.step(opt, closure=closure)


# ------------------------------------------------------------------------------------ state_dict


def test_state_dict_round_trip(kind: str) -> None:
    """test_grad_scaling_state_dict: a scaler loaded from another's state_dict continues exactly as
    the original does."""
    r, _ = pair(kind, _Model)
    batches = data(ITERS + 3)
    run_case(r, plain_step, batches=batches[:ITERS])
    twin = rig(kind, copy.deepcopy(r.model))
    twin.optimizers = [torch.optim.SGD(twin.model.parameters(), lr=1.0)]
    twin.scaler.load_state_dict(r.scaler.state_dict())
    assert twin.scaler.get_scale() == r.scaler.get_scale()
    for each in (r, twin):
        run_case(each, plain_step, batches=batches[ITERS:], skip_iter=1)
    for p, q in zip(r.model.parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(p, q)
    saved, loaded = r.scaler.state_dict(), twin.scaler.state_dict()
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        assert torch.equal(value, loaded[key]) if isinstance(value, torch.Tensor) else value == loaded[key], key
