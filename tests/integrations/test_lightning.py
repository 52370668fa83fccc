"""autoscale.integrations.lightning: real Trainer.fit and Fabric loops on a small MLP (eager executor)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autoscale  # noqa: E402
from autoscale.integrations.lightning import AutoscaleFabricPrecision, AutoscalePrecision  # noqa: E402

EAGER = autoscale.Config(executor="eager")
DYNAMIC = autoscale.Config(executor="eager", scaling=autoscale.ScalingConfig(mode="dynamic"))
BATCHES = 8  # per epoch


class MLP(L.LightningModule):
    """Two layers of width 32; SGD; records every training loss and every step's gradients."""

    def __init__(self, *, skip_batch: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.losses: list[float] = []
        self.skip_batch = skip_batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.losses.append(float(loss.detach()))
        return None if batch_idx == self.skip_batch else loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES * 8, 16, generator=g)
    y = (x[:, :4].argmax(1))  # learnable
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class _Steps(Callback):
    """Counts optimizer steps that really ran (a step pre-hook: after unscaling and clipping) and
    records the gradients the optimizer saw, and the ones ``on_before_optimizer_step`` saw."""

    def __init__(self) -> None:
        self.ran = 0
        self.seen: list[list[torch.Tensor]] = []
        self.before: list[list[torch.Tensor]] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def pre(opt: torch.optim.Optimizer, *_: Any) -> None:
            self.ran += 1  # (float32's Precision runs the closure inside step(), after this hook: no gradients yet)
            self.seen.append([p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None])

        for opt in trainer.optimizers:
            opt.register_step_pre_hook(pre)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.before.append([p.grad.clone() for p in pl_module.parameters() if p.grad is not None])


def _fit(model: L.LightningModule, plugin: Any = None, *, ckpt_path: str | None = None,
         callbacks: list[Callback] | None = None, **kwargs: Any) -> L.Trainer:
    kwargs.setdefault("max_steps", 12)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(kwargs.pop("checkpointing", False)),
                        plugins=[plugin] if plugin is not None else None, callbacks=callbacks,
                        num_sanity_val_steps=0, limit_val_batches=kwargs.pop("limit_val_batches", 0), **kwargs)
    trainer.fit(model, train_dataloaders=_data(), val_dataloaders=_data(), ckpt_path=ckpt_path)
    return trainer


def _relative_update_error(model: nn.Module, reference: nn.Module, initial: nn.Module) -> float:
    """|Δw - Δw_fp32| / |Δw_fp32| over all parameters: how far float16 training moved from float32's."""
    num = den = 0.0
    for p, r, p0 in zip(model.parameters(), reference.parameters(), initial.parameters(), strict=True):
        num += float(((p - r) ** 2).sum())
        den += float(((r - p0) ** 2).sum())
    return (num / den) ** 0.5


def test_trainer_trains_through_autoscale_like_float32() -> None:
    """The plugin compiles forward with the autoscale backend (graphs compiled, layers scaled),
    no autocast, trains, and lands where float32 does within float16's rounding."""
    model, reference = MLP(), MLP()
    initial = copy.deepcopy(model)
    plugin = AutoscalePrecision(config=EAGER)
    trainer = _fit(model, plugin, limit_val_batches=1, val_check_interval=6)  # no-grad graphs too
    _fit(reference)
    assert trainer.precision == "16-mixed"
    assert trainer.global_step == 12
    assert plugin.backend.records, "no graph went through the autoscale backend"
    assert plugin.backend.reports[-1].converted > 0  # nodes really run in float16
    assert plugin.scaler.scaling_needed
    layers = {r.name: r for r in plugin.scaler.layers()}
    assert {"l1", "l2"} <= set(layers) and all(r.scale > 1 for r in layers.values())
    assert plugin.scaler.skipped_steps == 0
    assert model.losses[-1] < 0.8 * model.losses[0]
    assert len(model.losses) == len(reference.losses) == 12
    assert _relative_update_error(model, reference, initial) < 2e-2
    assert all(abs(a - b) < 1e-2 for a, b in zip(model.losses, reference.losses, strict=True))


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_sees_unscaled_gradients(algorithm: str) -> None:
    """Dynamic mode (a loss scale of 2^16, so a missed unscale would be obvious): the gradients
    ``on_before_optimizer_step`` sees are float32's, and the optimizer sees them clipped."""
    clip = 0.05
    model, steps, ref_steps = MLP(), _Steps(), _Steps()
    plugin = AutoscalePrecision(config=DYNAMIC)
    _fit(model, plugin, callbacks=[steps], max_steps=4, gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    _fit(MLP(), callbacks=[ref_steps], max_steps=4, gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    assert plugin.scaler.get_scale() == 2.0**16 and steps.ran == 4
    for before, seen, ref_before in zip(steps.before, steps.seen, ref_steps.before, strict=True):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before]))
        ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_before]))
        assert abs(float(norm) / float(ref_norm) - 1) < 2e-2  # unscaled: float32's gradients
        assert norm > clip  # clipping has work to do
        if algorithm == "norm":
            clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in seen]))
            assert clipped <= clip * (1 + 1e-5)
        else:
            assert max(float(g.abs().max()) for g in seen) <= torch.tensor(clip).item()  # (clip in float32)
            assert max(float(g.abs().max()) for g in before) > clip


def test_gradient_accumulation() -> None:
    """accumulate_grad_batches=2: half as many optimizer steps and scaler updates as batches, and
    the same weights as float32 with accumulation."""
    model, reference, steps = MLP(), MLP(), _Steps()
    initial = copy.deepcopy(model)
    plugin = AutoscalePrecision(config=EAGER)
    trainer = _fit(model, plugin, callbacks=[steps], max_steps=4, accumulate_grad_batches=2)
    _fit(reference, max_steps=4, accumulate_grad_batches=2)
    assert trainer.global_step == 4 and steps.ran == 4 and len(model.losses) == 8
    assert plugin.scaler.state_dict()["steps"] == 4
    assert _relative_update_error(model, reference, initial) < 2e-2


def test_checkpoint_resume_is_bit_identical(tmp_path: Path) -> None:
    """ModelCheckpoint saves the scaler with the trainer; resuming with ckpt_path continues exactly
    as the uninterrupted run: the same weights and scaler state, bit for bit."""
    full = MLP()
    full_plugin = AutoscalePrecision(config=EAGER)
    _fit(full, full_plugin, max_steps=-1, max_epochs=2)

    first_plugin = AutoscalePrecision(config=EAGER)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _fit(MLP(), first_plugin, max_steps=-1, max_epochs=1, callbacks=[checkpoint], checkpointing=True)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert "AutoscalePrecision" in saved and saved["AutoscalePrecision"]["steps"] == BATCHES

    resumed, plugin = MLP(), AutoscalePrecision(config=EAGER)
    _fit(resumed, plugin, max_steps=-1, max_epochs=2, ckpt_path=str(tmp_path / "last.ckpt"))
    for p, q in zip(resumed.parameters(), full.parameters(), strict=True):
        assert torch.equal(p, q)
    got, want = plugin.scaler.state_dict(), full_plugin.scaler.state_dict()
    assert got.keys() == want.keys() and got["steps"] == 2 * BATCHES
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_skipped_backward_steps_nothing() -> None:
    """A training_step that returns None skips the backward: no step and no scaler update (as
    MixedPrecision); the other steps train."""
    model, steps = MLP(skip_batch=2), _Steps()
    plugin = AutoscalePrecision(config=EAGER)
    _fit(model, plugin, callbacks=[steps], max_steps=-1, max_epochs=1)
    assert steps.ran == BATCHES - 1
    assert plugin.scaler.state_dict()["steps"] == BATCHES - 1


def test_compiled_models() -> None:
    """trainer.fit(torch.compile(model, backend=<autoscale Backend>)) adopts that backend (Lightning's
    from_compiled undone: forward recompiled alone); another backend is refused with the fix, and
    so is a config that contradicts the model's backend."""
    backend = autoscale.backend(EAGER)
    model = MLP()
    plugin = AutoscalePrecision()
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, plugins=[plugin])
    trainer.fit(torch.compile(model, backend=backend), train_dataloaders=_data())
    assert plugin.backend is backend and backend.records and model._compiler_ctx is None
    assert plugin.scaler.layers()

    for compiled, match in [(torch.compile(MLP(), backend="eager"), "backend 'eager'"),
                            (torch.compile(MLP(), backend=autoscale.backend(DYNAMIC)), "config differs")]:
        trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False,
                            plugins=[AutoscalePrecision(config=EAGER)])
        with pytest.raises(ValueError, match=match):
            trainer.fit(compiled, train_dataloaders=_data())


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="must be an autoscale.Config"):
        AutoscalePrecision(config={"executor": "eager"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be an autoscale.Backend"):
        AutoscaleFabricPrecision(backend="autoscale")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="different configs"):
        AutoscalePrecision(config=EAGER, backend=autoscale.backend(DYNAMIC))
    with pytest.raises(RuntimeError, match="created when the model is set up"):
        _ = AutoscalePrecision().scaler


def _fabric_loop(fabric: L.Fabric, model: nn.Module, steps: int, *, inject: int | None = None,
                 clip: float | None = None) -> tuple[list[float], list[bool]]:
    """A plain Fabric loop; at step ``inject`` a gradient hook writes an inf into l1.weight's gradient.
    Returns the losses and, per step, whether the weights stayed bit-identical."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    model, opt = fabric.setup(model, opt)
    losses, unchanged = [], []
    for i, (x, y) in enumerate(_data()):
        if i == steps:
            break
        handle = None
        if i == inject:
            def poison(p: torch.Tensor) -> None:
                with torch.no_grad():
                    p.grad[0, 0] = float("inf")  # type: ignore[index]
            handle = model.l1.weight.register_post_accumulate_grad_hook(poison)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        if clip is not None:
            fabric.clip_gradients(model, opt, max_norm=clip, error_if_nonfinite=False)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        unchanged.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)))
        losses.append(float(loss))
        if handle is not None:
            handle.remove()
    return losses, unchanged


def test_fabric_trains_clips_and_skips_an_injected_inf() -> None:
    """Fabric, dynamic mode: fabric.backward scales, fabric.clip_gradients unscales then clips,
    optimizer.step skips the step whose gradient holds an inf (weights bit-identical, skipped_steps 1)."""
    plugin = AutoscaleFabricPrecision(config=DYNAMIC)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    losses, unchanged = _fabric_loop(fabric, MLP(), 8, inject=3, clip=1.0)
    assert unchanged == [i == 3 for i in range(8)]
    assert plugin.scaler.skipped_steps == 1
    assert plugin.scaler.get_scale() == 2.0**15  # backed off once
    assert plugin.backend.records and losses[-1] < losses[0]


def test_fabric_adaptive_skips_an_overflowing_backward() -> None:
    """Fabric, adaptive mode: a float16 overflow inside the compiled backward (a loss multiplied by
    1e30) skips the step and backs off; a pre-compiled module (Fabric re-applies torch.compile around
    the set-up module) still runs through the plugin's backend: the inner compile wins."""
    plugin = AutoscaleFabricPrecision(config=EAGER)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup(torch.compile(MLP(), backend="eager"))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.2))
    unchanged = []
    for i, (x, y) in enumerate(_data()):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y) * (1e30 if i == 2 else 1.0)
        fabric.backward(loss)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        unchanged.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)))
    assert unchanged == [i == 2 for i in range(BATCHES)]
    assert plugin.scaler.skipped_steps == 1 and plugin.backend.records
    assert any(r.overflows for r in plugin.scaler.layers())


def test_fabric_adaptive_skips_an_inf_written_by_a_hook() -> None:
    """A gradient hook runs after the compiled backward's check: step() checks that gradient again."""
    plugin = AutoscaleFabricPrecision(config=EAGER)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    _, unchanged = _fabric_loop(fabric, MLP(), 3, inject=1)
    assert unchanged == [False, True, False] and plugin.scaler.skipped_steps == 1


class ManualMLP(MLP):
    """Manual optimization: manual_backward, clip_gradients before opt.step()."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        self.manual_backward(F.cross_entropy(self(x), y))
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()  # (the gradients the optimizer used: unscaled, then clipped)
        self.norms.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in self.parameters()]))))


def test_manual_optimization_clips_unscaled_gradients() -> None:
    """Manual optimization in dynamic mode: self.clip_gradients before opt.step() unscales first
    (torch.amp's MixedPrecision would clip gradients still carrying the 2^16 loss scale)."""
    model, plugin = ManualMLP(), AutoscalePrecision(config=DYNAMIC)
    _fit(model, plugin, max_steps=3)
    assert len(model.norms) == 3 and all(abs(n / 0.05 - 1) < 1e-3 for n in model.norms)  # (unclipped: ~1)
    assert plugin.scaler.state_dict()["steps"] == 3 and plugin.scaler.get_scale() == 2.0**16


def test_second_trainer_on_the_same_model_continues_its_scaler() -> None:
    """A second Trainer (and plugin) on a model the first one compiled reuses its compiled call and
    scaler (the per-layer state lives on the model) rather than refusing the compiled module."""
    model, first = MLP(), AutoscalePrecision(config=EAGER)
    _fit(model, first, max_steps=2)
    second = AutoscalePrecision()
    _fit(model, second, max_steps=2)
    assert second.scaler is first.scaler and second.backend is first.backend
    assert first.scaler.state_dict()["steps"] == 4


class _ScheduledMLP(MLP):
    """A step-interval StepLR held on skipped steps (docs/integrations/lightning.md); the loss
    overflows float16's backward at ``overflow_batch``."""

    def __init__(self, overflow_batch: int) -> None:
        super().__init__()
        self.overflow_batch = overflow_batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y) * (1e30 if batch_idx == self.overflow_batch else 1.0)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.2)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if not self.trainer.precision_plugin.scaler.last_step_skipped:  # type: ignore[attr-defined]
            scheduler.step()


def test_lr_scheduler_holds_on_a_skipped_step() -> None:
    plugin = AutoscalePrecision(config=EAGER)
    model = _ScheduledMLP(overflow_batch=2)
    trainer = _fit(model, plugin, max_steps=6)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert plugin.scaler.skipped_steps == 1
    assert scheduler.last_epoch == 5  # six steps, one skipped
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.2 * 0.5**5)
