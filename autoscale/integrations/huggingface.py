"""autoscale in Hugging Face ``accelerate`` loops and ``transformers.Trainer``.

Both frameworks do FP16 with torch.amp: ``Accelerator(mixed_precision="fp16")`` (and
``TrainingArguments(fp16=True)``, which builds that Accelerator) runs the forward under
``torch.autocast`` and drives a ``torch.amp.GradScaler`` from ``accelerator.backward``,
``accelerator.clip_grad_norm_`` and the prepared optimizer's ``step``. autoscale replaces both halves:
the model is compiled with the autoscale backend (the graph does its own float16 casts, so there must
be no autocast) and an ``autoscale.GradScaler`` takes torch.amp's place. accelerate already drives
whatever object sits in ``accelerator.scaler`` with torch.amp's interface, which autoscale's scaler
has, so the integration is an ``Accelerator`` subclass that

* refuses ``mixed_precision`` other than "no" and accelerate's own ``torch.compile`` (both would
  double up with autoscale's);
* in ``prepare_model``, makes the GradScaler for the model (before DDP wraps it and before its first
  forward, as adaptive scaling needs) and compiles the prepared model with the autoscale backend;
* unscales gradients in ``unscale_gradients`` (which ``clip_grad_norm_`` calls): accelerate does that
  only under its own fp16, so clipping would otherwise see scaled gradients in autoscale's "dynamic"
  and "static" modes (adaptive mode's gradients leave the backward unscaled already).

Everything else — ``backward``, skipping the optimizer and the LR scheduler on overflow,
``save_state``/``load_state`` of ``scaler.pt`` — is accelerate's code, unchanged. ``AutoscaleTrainer``
gives ``transformers.Trainer`` the same Accelerator. Workarounds of library internals are marked
"Workaround" below; each has a test in tests/integrations/test_huggingface.py that fails when the
library's behaviour it works around changes.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, DynamoBackend
from torch import nn
from transformers import Trainer, TrainingArguments

import autoscale
from autoscale.config import Config
from autoscale.runtime import unwrap
from autoscale.scaler import GradScaler

__all__ = ["AutoscaleAccelerator", "AutoscaleTrainer"]

log = logging.getLogger("autoscale")

_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA)


class _HostDecidedGradScaler(GradScaler):
    """An ``autoscale.GradScaler`` that decides on the host whether a step is skipped, for every optimizer.

    Workaround (accelerate ``AcceleratedOptimizer.step``): accelerate learns that a step was skipped
    only from the optimizer's ``step`` not being called (``step_was_skipped``, which gates
    ``AcceleratedScheduler.step`` and ``Trainer``'s ``lr_scheduler.step()``). A fused optimizer
    (``_step_supports_amp_scaling``, e.g. ``AdamW(fused=True)``, the Trainer's default ``optim``) is
    called on every step with the overflow flag as a tensor and skips on the device, so accelerate
    would count every step as taken and advance the LR schedule over skipped ones (with torch.amp's
    GradScaler too). Here the fused protocol is hidden for the duration of ``step``: the scaler takes
    its other path, one host sync (which the scheduler's decision needs anyway) and no call on
    overflow. The fused optimizer then runs as a plain fused optimizer on unscaled gradients.
    Guarded by ``test_accelerate_counts_a_fused_skip_as_a_step_without_the_workaround``.
    """

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            return super().step(optimizer, *args, **kwargs)
        own = "_step_supports_amp_scaling" in vars(optimizer)
        opt: Any = optimizer
        opt._step_supports_amp_scaling = False
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            if own:
                opt._step_supports_amp_scaling = True
            else:
                del opt._step_supports_amp_scaling


class AutoscaleAccelerator(Accelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` that trains with autoscale instead of torch.amp.

    Use it where ``Accelerator(mixed_precision="fp16")`` was, with ``mixed_precision`` left out:
    ``prepare`` compiles the model with ``autoscale.backend(config)`` and puts an
    ``autoscale.GradScaler`` in ``accelerator.scaler``; the loop (``accelerator.backward``,
    ``clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``, ``save_state``/``load_state``) is
    unchanged. One model is trained per accelerator (the scaler's state lives on it); prepare it before
    or together with its optimizer, whose wrapper takes the scaler. ``autoscale_backend.records`` keeps
    what each compile did.
    """

    autoscale_config: Config
    autoscale_backend: autoscale.Backend
    scaler: GradScaler | None

    def __init__(self, *args: Any, config: Config | None = None, **kwargs: Any) -> None:
        _refuse_mixed_precision(kwargs.get("mixed_precision"), "Accelerator(mixed_precision=...)",
                                "leave mixed_precision out (or pass 'no')")
        if kwargs.get("dynamo_backend") not in (None, "no", "NO", DynamoBackend.NO) or kwargs.get("dynamo_plugin"):
            raise ValueError("AutoscaleAccelerator compiles the model itself, with backend=autoscale.backend(config): "
                             "leave dynamo_backend and dynamo_plugin out")
        super().__init__(*args, **kwargs)
        self._adopt_autoscale(config)

    def _adopt_autoscale(self, config: Config | None) -> None:
        """Check what ``__init__`` cannot see in its arguments (accelerate's config file and environment
        variables, a Trainer's settings) and set up autoscale's part. Also run on a Trainer's Accelerator."""
        _refuse_mixed_precision(self.mixed_precision, "accelerate's mixed_precision (config file or "
                                "ACCELERATE_MIXED_PRECISION)", "set it to 'no'")
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise ValueError("accelerate is configured to torch.compile the model (dynamo_backend="
                             f"{self.state.dynamo_plugin.backend.value.lower()!r}, from its config file or "
                             "ACCELERATE_DYNAMO_BACKEND); autoscale compiles it itself: set the dynamo backend to 'no'")
        if self.distributed_type in _UNSUPPORTED:
            raise ValueError(f"autoscale's accelerate integration does not support {self.distributed_type.value}: "
                             "it supports one device and DistributedDataParallel (MULTI_GPU and the like)")
        if config is not None and not isinstance(config, Config):
            raise ValueError(f"config must be an autoscale.Config, got {type(config).__name__}")
        self.autoscale_config = config or Config()
        self.autoscale_backend = autoscale.backend(self.autoscale_config)
        self.scaler = None
        self._autoscale_model: nn.Module | None = None
        self._autoscale_verified = False

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """accelerate's ``prepare_model`` (device placement, DDP), with the GradScaler made first and
        the result compiled with the autoscale backend. ``evaluation_mode`` models (inference only) are
        prepared by accelerate alone: the backend compiles training graphs."""
        if evaluation_mode:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        root = unwrap(model)
        if self._autoscale_model is None:
            # Made before DDP wraps the model (the scaler's buffers must be on DDP's ignore list when it
            # is built) and on the device the model will train on (the scaler's own tensors live there).
            if self.device_placement if device_placement is None else device_placement:
                model.to(self.device)
            self.scaler = _HostDecidedGradScaler(root, self.autoscale_config)
            self._autoscale_model = root
        elif root is not self._autoscale_model:
            raise ValueError("AutoscaleAccelerator trains one model (its GradScaler's state lives on it); "
                             "prepare other models with evaluation_mode=True or use one accelerator per model")
        prepared: nn.Module = super().prepare_model(model, device_placement=device_placement)
        if isinstance(prepared, torch._dynamo.eval_frame.OptimizedModule):
            return prepared  # prepared before, or compiled by the user
        compiled = cast(nn.Module, torch.compile(prepared, backend=self.autoscale_backend))
        # as accelerate marks what it returns, so that preparing it again returns it as is
        object.__setattr__(compiled, "_is_accelerate_prepared", True)
        return compiled

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """accelerate's ``prepare_optimizer``, once the scaler exists: the wrapper takes it when built."""
        if self.scaler is None and not getattr(optimizer, "_is_accelerate_prepared", False):
            raise RuntimeError("AutoscaleAccelerator: prepare the model before its optimizer (accelerator.prepare("
                               "model, optimizer), in that order): the optimizer's wrapper takes the GradScaler, "
                               "which is made for the model")
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """accelerate's ``backward``; at the first one, refuse a loss that no autoscale graph computed
        (training would silently run in float32, unscaled)."""
        if self._autoscale_model is not None and not self._autoscale_verified:
            state = getattr(self._autoscale_model, "_autoscale_state", None)
            if not (getattr(state, "graphs", 0) or self.autoscale_backend.records):
                raise RuntimeError("AutoscaleAccelerator: the loss was computed without the model running through "
                                   "autoscale, so nothing runs in float16 or is scaled: call the model that "
                                   "accelerator.prepare returned (in a Trainer's compute_loss, the `model` argument, "
                                   "not self.model)")
            self._autoscale_verified = True
        super().backward(loss, **kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None) -> None:
        """Unscale the gradients (and look for inf/nan) before clipping, whatever the scaler's mode.

        accelerate unscales only under its own fp16 (``native_amp``), so its ``clip_grad_norm_`` would
        clip scaled gradients in the "dynamic" and "static" modes. Calling ``unscale_`` twice in a step
        raises, as torch.amp's does."""
        if self.scaler is None:
            return
        chosen = self._optimizers if optimizer is None else optimizer
        for opt in chosen if isinstance(chosen, (list, tuple)) else [chosen]:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            self.scaler.unscale_(opt)


class AutoscaleTrainer(Trainer):
    """``transformers.Trainer`` that trains with autoscale: ``AutoscaleTrainer(model, args, ...,
    autoscale_config=autoscale.Config(...))`` where ``Trainer(model, TrainingArguments(fp16=True), ...)`` was.

    ``fp16``/``bf16`` must be off (they would add torch.autocast and a torch.amp GradScaler to
    autoscale's own casts and scaler: the dtype is ``Config.dtype``), and so must ``torch_compile``
    (the model is compiled with the autoscale backend; accelerate's TorchDynamoPlugin accepts only its
    own list of backends, and Inductor's modes are not autoscale options). Clipping
    (``max_grad_norm``) sees unscaled gradients, gradient accumulation works as in the Trainer (one
    scaler step per optimizer step), skipped steps do not advance the LR scheduler, and checkpoints
    save the scaler (``scaler.pt``) and ``train(resume_from_checkpoint=...)`` restores it. The
    GradScaler is ``trainer.accelerator.scaler`` once ``train`` has begun.
    """

    def __init__(self, *args: Any, autoscale_config: Config | None = None, **kwargs: Any) -> None:
        if autoscale_config is not None and not isinstance(autoscale_config, Config):
            raise ValueError(f"autoscale_config must be an autoscale.Config, got {type(autoscale_config).__name__}")
        self.autoscale_config = autoscale_config or Config()
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's Accelerator, made an ``AutoscaleAccelerator``.

        Workaround (transformers ``Trainer.create_accelerator_and_postprocess``): the Trainer builds a
        plain ``accelerate.Accelerator`` from its arguments inline, with no hook for the class, and
        rebuilding it would copy that method. The instance is given ``AutoscaleAccelerator``'s class
        (which adds methods and attributes, no layout) and its autoscale set-up. Guarded by
        ``test_trainer_builds_a_plain_accelerator``: if the Trainer builds another class, this raises.
        """
        _check_training_arguments(self.args)
        super().create_accelerator_and_postprocess()
        if type(self.accelerator) is not Accelerator:
            raise TypeError(f"AutoscaleTrainer expects the Trainer to build an accelerate.Accelerator, got "
                            f"{type(self.accelerator).__name__}; this transformers version is not supported")
        self.accelerator.__class__ = AutoscaleAccelerator
        self.accelerator._adopt_autoscale(self.autoscale_config)


def _check_training_arguments(args: TrainingArguments) -> None:
    """Refuse the TrainingArguments that would double up with autoscale, naming the fix."""
    _refuse_mixed_precision(args.mixed_precision, "TrainingArguments(fp16=True/bf16=True)",
                            "pass fp16=False and bf16=False (the precision is AutoscaleTrainer(autoscale_config="
                            "autoscale.Config(dtype=...)), float16 by default)")
    if args.fp16_full_eval or args.bf16_full_eval:
        raise ValueError("AutoscaleTrainer: fp16_full_eval/bf16_full_eval cast the model's float32 master weights "
                         "to half precision in place; pass fp16_full_eval=False and bf16_full_eval=False")
    if args.torch_compile:
        raise ValueError("AutoscaleTrainer compiles the model itself with the autoscale backend: pass torch_compile="
                         "False and leave torch_compile_backend and torch_compile_mode unset (choose the executor "
                         "with autoscale_config=autoscale.Config(executor=...))")
    if args.deepspeed or args.fsdp:
        raise ValueError("AutoscaleTrainer does not support DeepSpeed or FSDP (they bring their own mixed precision); "
                         "it supports one device and DistributedDataParallel")


def _refuse_mixed_precision(value: Any, where: str, fix: str) -> None:
    if value not in (None, "no") and str(value).lower() != "no":
        raise ValueError(f"{where} is {str(value)!r}: autoscale's compiled graph does the float16/bfloat16 casts "
                         "and autoscale.GradScaler replaces torch.amp's, so torch.autocast and torch.amp.GradScaler "
                         f"would double up with them; {fix}")
