"""autoscale.integrations.lightning on LightningModules as Lightning's docs write them.

``training_step`` calls the submodules (``self.encoder(x)``), often with no ``forward``, and logs
with ``self.log``. Each module trains with ``Trainer.fit`` (or a Fabric loop) under the plugin and
under float32 from the same weights: the first step's gradients match float32's within the
tolerance table's float16 floor, and the weights land where float32's do.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autoscale  # noqa: E402
from autoscale.integrations.lightning import AutoscaleFabricPrecision, AutoscalePrecision  # noqa: E402
from tests.tolerances import SQNR_MIN_DB, sqnr  # noqa: E402

CONFIGS = {"adaptive": autoscale.Config(executor="eager"),
           "dynamic": autoscale.Config(executor="eager", scaling=autoscale.ScalingConfig(mode="dynamic"))}
STEPS = 6


class LitAutoEncoder(L.LightningModule):
    """Lightning's README and "Lightning in 15 minutes" example, as written there (no forward)."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # training_step defines the train loop.
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = F.mse_loss(x_hat, x)
        # Logging to TensorBoard (if installed) by default
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _autoencoder() -> LitAutoEncoder:
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
    decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))
    return LitAutoEncoder(encoder, decoder)


class MultiHead(L.LightningModule):
    """A backbone, a ``nn.ModuleList`` of heads iterated in ``training_step``, a loss module, a
    ``forward`` that only validation uses, and ``self.log_dict``; SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU())
        self.heads = nn.ModuleList([nn.Linear(32, 4), nn.Linear(32, 4)])
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x)
        return torch.stack([head(h) for head in self.heads]).mean(0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.backbone(x)
        losses = {f"loss_{i}": self.criterion(head(h), y) for i, head in enumerate(self.heads)}
        self.log_dict(losses, prog_bar=True)
        return sum(losses.values())  # type: ignore[return-value]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.criterion(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _images() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.rand(STEPS * 8, 1, 28, 28, generator=g), torch.zeros(STEPS * 8)),
                      batch_size=8)


def _features() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 8, 16, generator=g)
    return DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=8)


class _FirstGrads(Callback):
    """The gradients the first optimizer step sees (unscaled by then), by parameter name."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self.grads:
            self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def _fit(model: L.LightningModule, data: DataLoader[Any], plugin: Any = None) -> tuple[L.Trainer, _FirstGrads]:
    grads = _FirstGrads()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        limit_val_batches=2, val_check_interval=STEPS // 2,
                        plugins=[plugin] if plugin is not None else None, callbacks=[grads])
    validates = type(model).validation_step is not L.LightningModule.validation_step
    trainer.fit(model, train_dataloaders=data, val_dataloaders=data if validates else None)
    return trainer, grads


def _check_like_float32(model: nn.Module, reference: nn.Module, initial: nn.Module,
                        grads: _FirstGrads, reference_grads: _FirstGrads) -> None:
    """The first step's gradients, all together and each, match float32's; the weights moved as
    float32's did, within float16's rounding."""
    assert grads.grads.keys() == reference_grads.grads.keys()
    ref, got = reference_grads.grads, grads.grads
    assert sqnr(torch.cat([g.flatten() for g in ref.values()]), torch.cat([g.flatten() for g in got.values()])) \
        >= SQNR_MIN_DB[torch.float16, "grads"]
    worst = min(ref, key=lambda n: sqnr(ref[n], got[n]))
    assert sqnr(ref[worst], got[worst]) >= SQNR_MIN_DB[torch.float16, "grad"], worst
    num = den = 0.0
    for p, r, p0 in zip(model.parameters(), reference.parameters(), initial.parameters(), strict=True):
        num += float(((p - r) ** 2).sum().detach())
        den += float(((r - p0) ** 2).sum().detach())
    assert (num / den) ** 0.5 < 2e-2


def _linear_layers(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("mode", CONFIGS)
def test_the_autoencoder_without_a_forward(mode: str) -> None:
    """Lightning's own example: ``training_step`` calls the encoder and the decoder and logs."""
    model = _autoencoder()
    initial, reference = copy.deepcopy(model), copy.deepcopy(model)
    plugin = AutoscalePrecision(config=CONFIGS[mode])
    trainer, grads = _fit(model, _images(), plugin)
    _, reference_grads = _fit(reference, _images())
    assert trainer.global_step == STEPS and plugin.scaler.skipped_steps == 0
    assert "train_loss" in trainer.callback_metrics  # self.log ran
    assert model.state_dict().keys() == initial.state_dict().keys()  # compiled in place
    assert len(plugin.backend.records) == 2  # the encoder's graph and the decoder's
    assert all(r.converted > 0 for r in plugin.backend.reports)  # each runs in float16
    if mode == "adaptive":
        assert _linear_layers(model) <= {r.name for r in plugin.scaler.layers()}
    _check_like_float32(model, reference, initial, grads, reference_grads)


def test_a_module_list_of_heads_a_loss_module_and_a_forward_for_validation() -> None:
    model = MultiHead()
    initial, reference = copy.deepcopy(model), copy.deepcopy(model)
    plugin = AutoscalePrecision(config=CONFIGS["adaptive"])
    trainer, grads = _fit(model, _features(), plugin)
    _, reference_grads = _fit(reference, _features())
    assert {"loss_0", "loss_1", "val_loss"} <= trainer.callback_metrics.keys()
    assert _linear_layers(model) <= {r.name for r in plugin.scaler.layers()}
    _check_like_float32(model, reference, initial, grads, reference_grads)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # (the float32 reference has no Trainer)
@pytest.mark.parametrize("mode", CONFIGS)
def test_fabric_runs_training_step_of_the_module_it_set_up(mode: str) -> None:
    """Fabric's loop over a LightningModule: ``model.training_step(batch, i)`` on one device runs
    no forward of Fabric's; the modules it calls set the plugin up. An inf written into a gradient
    after the backward skips that step."""
    model, reference = _autoencoder(), _autoencoder()
    plugin = AutoscaleFabricPrecision(config=CONFIGS[mode])
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    wrapped, opt = fabric.setup(model, model.configure_optimizers())
    ref_opt = reference.configure_optimizers()
    for i, batch in enumerate(_images()):
        opt.zero_grad()
        fabric.backward(wrapped.training_step(batch, i))
        if i == 2:
            model.decoder[2].bias.grad[0] = float("inf")  # type: ignore[index]
        opt.step()
        if i != 2:
            ref_opt.zero_grad()
            reference.training_step(batch, i).backward()
            ref_opt.step()
    assert plugin.scaler.skipped_steps == 1 and len(plugin.backend.records) == 2
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.isfinite(p).all()
        assert float((p - r).detach().norm() / r.detach().norm()) < 1e-2


class _OwnParameter(L.LightningModule):
    """A loss computed from a parameter the LightningModule holds itself: nothing to compile."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(x @ self.weight, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_loss_from_no_compiled_module_is_refused_naming_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"move those into a submodule"):
        _fit(_OwnParameter(), _features(), AutoscalePrecision(config=CONFIGS["adaptive"]))


def test_submodules_the_user_compiled() -> None:
    """A submodule compiled with an autoscale backend is adopted as it is; one compiled with another
    backend, or with ``module.compile`` (whose backend cannot be read), is refused, naming it."""
    backend = autoscale.backend(CONFIGS["adaptive"])
    model = _autoencoder()
    model.encoder = torch.compile(model.encoder, backend=backend)  # type: ignore[assignment]
    plugin = AutoscalePrecision()
    trainer, _ = _fit(model, _images(), plugin)
    assert plugin.backend is backend and len(backend.records) == 2 and trainer.global_step == STEPS

    model = _autoencoder()
    model.encoder = torch.compile(model.encoder, backend="eager")  # type: ignore[assignment]
    with pytest.raises(ValueError, match="backend 'eager'"):
        _fit(model, _images(), AutoscalePrecision(config=CONFIGS["adaptive"]))
    model = _autoencoder()
    model.decoder.compile()
    with pytest.raises(ValueError, match="the submodule 'decoder' was compiled with module.compile()"):
        _fit(model, _images(), AutoscalePrecision(config=CONFIGS["adaptive"]))
