"""autoscale.integrations.huggingface: transformers.Trainer and accelerate loops through the autoscale backend.

A two-layer GPT-2 at width 32 (random init) on random tokens, on CPU, with the eager executor (compile
time); each autoscale run compiles once (about 8 s on 2 cores). The float32 baselines are uncompiled.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import autoscale  # noqa: E402
from autoscale.integrations.huggingface import AutoscaleAccelerator, AutoscaleTrainer, _HostDecidedGradScaler  # noqa: E402

CONFIG = autoscale.Config(executor="eager")
SAMPLES, SEQ, BATCH = 32, 16, 4


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Every test compiles new models of the same class: start each from an empty Dynamo cache, so
    that none runs into the recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # unset, the loss lookup logs a warning in the forward: a graph break
    return model


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Four random sequences, repeated: something the model can learn in a few steps."""

    def __init__(self) -> None:
        self.ids = torch.randint(1, 128, (4, SEQ), generator=torch.Generator().manual_seed(1)).repeat(SAMPLES // 4, 1)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: Path, **changes: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(output_dir=str(out), use_cpu=True, report_to=[], per_device_train_batch_size=BATCH,
                                    max_steps=8, learning_rate=1e-2, lr_scheduler_type="linear", seed=0,
                                    save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    return TrainingArguments(**{**settings, **changes})


def _trainer(out: Path, *, autoscale_on: bool = True, cls: type[Trainer] | None = None,
             config: autoscale.Config = CONFIG, callbacks: list[TrainerCallback] | None = None,
             **changes: Any) -> Trainer:
    kwargs: dict[str, Any] = dict(model=_model(), args=_args(out, **changes), train_dataset=_Tokens(),
                                  callbacks=callbacks)
    if not autoscale_on:
        return (cls or Trainer)(**kwargs)
    return (cls or AutoscaleTrainer)(autoscale_config=config, **kwargs)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _losses(trainer: Trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _scale_loss_at(step: int, factor: float) -> type[AutoscaleTrainer]:
    """An AutoscaleTrainer whose loss is multiplied by ``factor`` at optimizer step ``step`` (0-based):
    a huge factor overflows the float16 gradients inside the compiled backward, as a spike would."""

    class Spiking(AutoscaleTrainer):
        def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            return loss * factor if self.state.global_step == step else loss

    return Spiking


# ------------------------------------------------------------------------------------------ Trainer


def test_trainer_trains_through_the_backend_close_to_float32(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "a")
    trainer.train()
    reference = _trainer(tmp_path / "f", autoscale_on=False)
    reference.train()

    accelerator = trainer.accelerator
    assert isinstance(accelerator, AutoscaleAccelerator) and accelerator.autoscale_backend.records
    assert isinstance(accelerator.scaler, autoscale.GradScaler) and accelerator.scaler.layers()
    assert accelerator.scaler.skipped_steps == 0
    losses = _losses(trainer)
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1
    assert losses == pytest.approx(_losses(reference), abs=2e-2)
    # Adam normalises each entry's step, so an entry whose float32 gradient is rounding noise (the
    # attention's key bias: exactly 0 in exact arithmetic) moves by up to the learning rate either way:
    # compare the updates as wholes, and per tensor only the weight matrices (measured: 4.7% of the
    # update overall, 4.5% at most for a matrix; the c_attn biases differ by 100%, as noise does)
    start, got, want = _weights(_model()), _weights(trainer.model), _weights(reference.model)
    moved = {k: torch.linalg.vector_norm(want[k] - start[k]) for k in want}
    error = {k: torch.linalg.vector_norm(got[k] - want[k]) for k in want}
    assert math.hypot(*error.values()) < 0.05 * math.hypot(*moved.values())
    matrices = [k for k in want if want[k].dim() > 1]
    assert all(error[k] < 0.1 * moved[k] for k in matrices), {k: float(error[k] / moved[k]) for k in matrices}


def test_evaluation_and_prediction_run_the_uncompiled_model(tmp_path: Path) -> None:
    """eval_strategy, evaluate() and predict() evaluate ``trainer.model``: the float32 module, not the
    compiled one (no graph is compiled for them), and training goes on through the backend."""
    trainer = AutoscaleTrainer(model=_model(), args=_args(tmp_path, eval_strategy="steps", eval_steps=4, max_steps=8),
                               train_dataset=_Tokens(), eval_dataset=_Tokens(), autoscale_config=CONFIG)
    trainer.train()
    evaluated = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evaluated) == 2 and all(math.isfinite(v) for v in evaluated) and evaluated[1] < evaluated[0]
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evaluated[1])
    assert math.isfinite(trainer.predict(_Tokens()).metrics["test_loss"])
    assert len(trainer.accelerator.autoscale_backend.records) == 1  # the training graph only


class _Norms(TrainerCallback):
    """The gradients' norm as the optimizer will see them (after clipping)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                              **kwargs: Any) -> None:
        assert model is not None
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))


def test_trainer_clips_unscaled_gradients(tmp_path: Path) -> None:
    """In "dynamic" mode the gradients carry a loss scale of 2**16 until unscaled: the logged pre-clip norm
    must be float32's, and the optimizer must see at most max_grad_norm."""
    dynamic = autoscale.Config(executor="eager", scaling=autoscale.ScalingConfig(mode="dynamic"))
    seen = _Norms()
    trainer = _trainer(tmp_path / "a", config=dynamic, callbacks=[seen], max_grad_norm=0.5, max_steps=3)
    trainer.train()
    reference = _trainer(tmp_path / "f", autoscale_on=False, max_grad_norm=0.5, max_steps=3)
    reference.train()

    assert trainer.accelerator.scaler.get_scale() == 2.0**16
    pre_clip = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    want = [e["grad_norm"] for e in reference.state.log_history if "grad_norm" in e]
    assert pre_clip == pytest.approx(want, rel=1e-2) and min(want) > 0.5  # (so clipping was active)
    assert seen.norms == pytest.approx([0.5] * 3, rel=1e-3)


class _Snapshots(TrainerCallback):
    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.lrs: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                    lr_scheduler: Any = None, **kwargs: Any) -> None:
        assert model is not None
        self.weights.append(_weights(model))
        self.lrs.append(lr_scheduler.get_last_lr()[0])


def test_trainer_skips_an_overflowing_step_and_holds_the_lr_schedule(tmp_path: Path) -> None:
    """The Trainer's default optimizer (fused AdamW) takes the scaler's host-decided path: the step
    with overflowing gradients leaves the weights alone and does not advance the LR scheduler."""
    snaps = _Snapshots()
    trainer = _trainer(tmp_path / "a", cls=_scale_loss_at(2, 1e30), callbacks=[snaps], max_steps=5)
    assert trainer.args.optim == "adamw_torch_fused"
    trainer.train()

    assert trainer.accelerator.scaler.skipped_steps == 1
    for name, before in snaps.weights[1].items():  # after step index 1 vs after the skipped step 2
        assert torch.equal(snaps.weights[2][name], before), name
    assert not torch.equal(snaps.weights[3]["lm_head.weight"], snaps.weights[2]["lm_head.weight"])
    assert snaps.lrs[2] == snaps.lrs[1] and snaps.lrs[3] < snaps.lrs[2]
    assert trainer.lr_scheduler.last_epoch == 4  # 5 optimizer steps, one skipped
    assert all(math.isfinite(float(v.abs().max())) for v in snaps.weights[-1].values())


def test_trainer_resumes_the_scaler_and_weights_from_a_checkpoint(tmp_path: Path) -> None:
    """An uninterrupted run that saves at step 3, and a run resumed from that checkpoint, end alike."""
    full = _trainer(tmp_path, max_steps=6, gradient_accumulation_steps=2, save_strategy="steps", save_steps=3)
    full.train()
    checkpoint = tmp_path / "checkpoint-3"
    assert (checkpoint / "scaler.pt").is_file()
    saved = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert saved["steps"] == 3

    resumed = _trainer(tmp_path / "resumed", max_steps=6, gradient_accumulation_steps=2)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    want, got = full.accelerator.scaler.state_dict(), resumed.accelerator.scaler.state_dict()
    assert got["steps"] == want["steps"] == 6
    for key in ("scales", "stats", "last_stats", "overflows", "skips", "scale"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    for name, value in _weights(full.model).items():
        torch.testing.assert_close(_weights(resumed.model)[name], value, rtol=1e-6, atol=1e-7, msg=name)


class _Labelled(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random sequences of three classes, each told by its first token."""

    def __init__(self) -> None:
        self.ids = torch.randint(3, 128, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
        self.labels = torch.arange(SAMPLES) % 3
        self.ids[:, 0] = self.labels

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))


def _weighted_loss_trainer(base: type[Trainer], *, call: str = "model") -> type[Trainer]:
    """transformers' docs' custom loss ("Customizing the Trainer"), as written there, on ``base``;
    ``call="self.model"`` calls the Trainer's unwrapped model instead of the ``model`` argument."""

    class CustomTrainer(base):  # type: ignore[valid-type,misc]
        def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            labels = inputs.pop("labels")
            # forward pass
            outputs = (model if call == "model" else self.model)(**inputs)
            logits = outputs.get("logits")
            # compute custom loss for 3 labels with different weights
            reduction = "sum" if num_items_in_batch is not None else "mean"
            loss_fct = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0], device=model.device),
                                           reduction=reduction)
            loss = loss_fct(logits.view(-1, self.model.config.num_labels), labels.view(-1))
            if num_items_in_batch is not None:
                loss = loss / num_items_in_batch
            return (loss, outputs) if return_outputs else loss

    return CustomTrainer


def test_a_trainer_subclass_with_its_own_compute_loss(tmp_path: Path) -> None:
    """The loss is computed outside the model, in float32 from the compiled model's logits: the run
    trains as float32's does."""
    kwargs: dict[str, Any] = dict(train_dataset=_Labelled(), args=_args(tmp_path, max_steps=8, learning_rate=3e-3))
    trainer = _weighted_loss_trainer(AutoscaleTrainer)(model=_classifier(), autoscale_config=CONFIG, **kwargs)
    trainer.train()
    reference = _weighted_loss_trainer(Trainer)(model=_classifier(), **kwargs)
    reference.train()
    assert trainer.accelerator.autoscale_backend.records and trainer.accelerator.scaler.skipped_steps == 0
    losses = _losses(trainer)
    assert losses[-1] < losses[0] and losses == pytest.approx(_losses(reference), abs=2e-2)
    start, got, want = _weights(_classifier()), _weights(trainer.model), _weights(reference.model)
    moved = math.hypot(*(float(torch.linalg.vector_norm(want[k] - start[k])) for k in want))
    error = math.hypot(*(float(torch.linalg.vector_norm(got[k] - want[k])) for k in want))
    assert error < 0.05 * moved


def test_a_loss_from_the_unwrapped_model_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """``self.model(...)`` in ``compute_loss`` is not the compiled model: nothing would run in float16."""
    trainer = _weighted_loss_trainer(AutoscaleTrainer, call="self.model")(
        model=_classifier(), autoscale_config=CONFIG, train_dataset=_Labelled(), args=_args(tmp_path, max_steps=1))
    with pytest.raises(RuntimeError, match=r"not self\.model"):
        trainer.train()


@pytest.mark.parametrize(("changes", "fix"), [
    ({"fp16": True}, "fp16=False"), ({"bf16": True}, "bf16=False"), ({"torch_compile": True}, "torch_compile=False"),
    ({"fp16_full_eval": True}, "fp16_full_eval=False"),
])
def test_trainer_refuses_settings_that_double_up(tmp_path: Path, changes: dict[str, Any], fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        _trainer(tmp_path, **changes)


def test_trainer_builds_a_plain_accelerator(tmp_path: Path) -> None:
    """Guards the class swap in AutoscaleTrainer.create_accelerator_and_postprocess: the Trainer must
    build exactly an accelerate.Accelerator (if it builds another class, the swap raises instead)."""
    assert type(_trainer(tmp_path, autoscale_on=False).accelerator) is Accelerator


# --------------------------------------------------------------------------------------- accelerate


def _overflowed_linear() -> tuple[nn.Linear, torch.optim.Optimizer]:
    layer = nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True)
    layer.weight.grad = torch.full_like(layer.weight, math.inf)
    layer.bias.grad = torch.zeros_like(layer.bias)
    return layer, opt


def test_accelerate_counts_a_fused_skip_as_a_step_without_the_workaround() -> None:
    """Guards _HostDecidedGradScaler: accelerate infers a skipped step from the optimizer's step not
    being called, which a fused optimizer always is (the library's behaviour; if this starts failing,
    accelerate learnt another way and the workaround can go). With the workaround the skip is seen."""
    Accelerator(cpu=True)  # (AcceleratedOptimizer reads accelerate's global state)
    cfg = autoscale.ScalingConfig(mode="dynamic")
    for scaler_class, seen in ((autoscale.GradScaler, False), (_HostDecidedGradScaler, True)):
        layer, opt = _overflowed_linear()
        before = layer.weight.detach().clone()
        wrapped = AcceleratedOptimizer(opt, scaler=scaler_class(layer, cfg))
        wrapped.step()
        assert wrapped.step_was_skipped is seen, scaler_class
        assert torch.equal(layer.weight, before) and opt._step_supports_amp_scaling  # the flag is put back


def test_accelerate_unscales_only_under_its_own_fp16() -> None:
    """Guards AutoscaleAccelerator.unscale_gradients: accelerate's own leaves a scaler's gradients
    scaled unless it runs torch.amp fp16 itself, so clip_grad_norm_ would clip scaled gradients."""
    accelerator = Accelerator(cpu=True)
    layer = nn.Linear(4, 4)
    opt = accelerator.prepare(torch.optim.SGD(layer.parameters(), lr=0.1))
    accelerator.scaler = autoscale.GradScaler(layer, autoscale.ScalingConfig(mode="static", init_scale=8.0))
    layer.weight.grad = torch.ones_like(layer.weight)
    accelerator.unscale_gradients(opt)
    assert torch.equal(layer.weight.grad, torch.ones_like(layer.weight))


def test_accelerate_refuses_its_own_mixed_precision_and_compile() -> None:
    with pytest.raises(ValueError, match="leave mixed_precision out"):
        AutoscaleAccelerator(mixed_precision="fp16", cpu=True)
    with pytest.raises(ValueError, match="dynamo_backend"):
        AutoscaleAccelerator(dynamo_backend="inductor", cpu=True)


def _accelerate_run(out: Path, *, steps: int, spike: int | None = None, save_at: int | None = None,
                    load: Path | None = None) -> dict[str, Any]:
    """A plain accelerate loop (2 micro-batches per step, clipping, fused AdamW, linear LR decay)."""
    accelerator = AutoscaleAccelerator(config=CONFIG, gradient_accumulation_steps=2, cpu=True)
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=BATCH)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    start = 0
    if load is not None:
        accelerator.load_state(str(load))
        start = save_at or 0
    norms, skipped, weights = [], [], []
    batches = list(loader)
    for step in range(start, steps):
        for micro in batches[2 * step:2 * step + 2]:
            with accelerator.accumulate(model):
                loss = model(**micro).loss
                accelerator.backward(loss * 1e30 if step == spike else loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
                opt.step()
                sched.step()
                opt.zero_grad()
        skipped.append(opt.step_was_skipped)
        weights.append(_weights(accelerator.unwrap_model(model)))
        if step + 1 == save_at and load is None:
            accelerator.save_state(str(out))
    return {"accelerator": accelerator, "norms": norms, "skipped": skipped, "weights": weights,
            "lr": sched.get_last_lr()[0]}


def test_accelerate_loop_skips_clips_and_round_trips_its_state(tmp_path: Path) -> None:
    full = _accelerate_run(tmp_path / "state", steps=4, spike=1, save_at=2)
    accelerator = full["accelerator"]
    assert accelerator.autoscale_backend.records and accelerator.scaler.layers()
    assert full["skipped"] == [False, True, False, False] and accelerator.scaler.skipped_steps == 1
    assert all(torch.equal(full["weights"][1][k], v) for k, v in full["weights"][0].items())
    assert full["lr"] == pytest.approx(3e-3 * (1.0 - 3 / 10))  # 3 of 4 steps taken
    assert all(0 < n < 100 for i, n in enumerate(full["norms"]) if i != 1)  # unscaled (and float32's order)

    resumed = _accelerate_run(tmp_path / "state", steps=4, save_at=2, load=tmp_path / "state")
    want, got = accelerator.scaler.state_dict(), resumed["accelerator"].scaler.state_dict()
    for key in ("scales", "stats", "last_stats", "overflows", "skips"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    assert got["steps"] == want["steps"] == 4 and resumed["lr"] == pytest.approx(full["lr"])
    for name, value in full["weights"][-1].items():
        torch.testing.assert_close(resumed["weights"][-1][name], value, rtol=1e-6, atol=1e-7, msg=name)
