"""Lightning precision plugins: ``Trainer(precision="16-mixed")`` with autoscale instead of torch.amp.

``precision="16-mixed"`` runs the forward under ``torch.autocast`` and scales the loss with
``torch.amp.GradScaler``. These plugins replace both: an :class:`autoscale.GradScaler` takes
torch.amp's place, and the model is compiled in place with the autoscale backend (the compiled
graphs do their own float16 casts, so there is no autocast)::

    trainer = L.Trainer(plugins=[AutoscalePrecision()])                   # instead of precision="16-mixed"
    fabric = L.Fabric(plugins=[AutoscaleFabricPrecision()])

What is compiled: the LightningModule's ``forward`` (``self(x)``) and, each on its own, every
submodule that holds parameters (``self.encoder(z)``; the children of an ``nn.ModuleList`` or
``nn.ModuleDict``), so that a ``training_step`` that calls its submodules, as Lightning's docs write
them, trains in float16 with or without a ``forward``. A submodule ``forward`` calls is part of
``forward``'s graph. ``training_step`` itself runs eagerly: it holds the loss, ``self.log``, manual
optimization and other host-side code that would break the graph or that Dynamo should not trace
(``opt.step()``); what it computes between the modules' calls runs in float32. The modules stay
themselves (``state_dict`` keys, attributes): each has its compiled call set, as
``nn.Module.compile`` does (``autoscale.runtime.compile_in_place``).

The scaler is created on the unwrapped module after the model has moved to its device (in adaptive
mode it puts per-layer scale buffers on the model, and its own tensors live on the device of the
model's parameters) and before the first forward, which is when Dynamo compiles and the backend
finds those buffers.

Skipped steps are not logged: read ``plugin.scaler.skipped_steps`` (a host sync) when you want them,
e.g. in a callback's ``on_train_batch_end``; ``plugin.scaler.layers()`` reports the per-layer scales.
See docs/integrations/lightning.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.compile import to_uncompiled
from torch import Tensor, nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.optim import LBFGS, Optimizer

from autoscale.backend import Backend, autoscale_backend
from autoscale.config import Config
from autoscale.runtime import compile_in_place, unwrap
from autoscale.scaler import GradScaler

if TYPE_CHECKING:  # (a private name of Lightning's, for the type only)
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR

__all__ = ["AutoscaleFabricPrecision", "AutoscalePrecision"]

log = logging.getLogger("autoscale")

_ATTACHED = "_autoscale_lightning"  # the module's (backend, scaler), so a second Trainer on it reuses them


@dataclass(frozen=True)
class _Attached:
    backend: Backend
    scaler: GradScaler


class _AutoscaleMixin:
    """What the Trainer's and Fabric's plugins share: the backend, the scaler, compiling the
    module's forward, telling apart what a user already compiled, and the scaler's checkpoint state.

    The two plugins differ only in the hooks Lightning calls (``optimizer_step``'s signature and
    where the model is known to be on its device), so the logic lives here.
    """

    precision: _PRECISION_INPUT_STR  # (Lightning's attribute: what trainer.precision reports)

    def __init__(self, *, config: Config | None = None, backend: Backend | None = None,
                 telemetry: str | Path | None = None) -> None:
        super().__init__()
        self._setup_autoscale(config, backend, telemetry)
        self.precision = self._precision_flag()

    def _setup_autoscale(self, config: Config | None, backend: Backend | None, telemetry: str | Path | None) -> None:
        if config is not None and not isinstance(config, Config):
            raise ValueError(f"{type(self).__name__}(config=...) must be an autoscale.Config, got "
                             f"{type(config).__name__}; e.g. config=autoscale.Config(executor='eager')")
        if backend is not None and not isinstance(backend, Backend):
            raise ValueError(f"{type(self).__name__}(backend=...) must be an autoscale.Backend "
                             f"(autoscale.backend(...)), got {type(backend).__name__}")
        if config is not None and backend is not None and backend.config != config:
            raise ValueError(f"{type(self).__name__} got both config= and backend= with different configs; "
                             "pass one of them (the backend carries its config)")
        self._backend = backend if backend is not None else Backend(config)
        # whether the user chose the config: then a model compiled with another autoscale config is a conflict
        self._explicit = config is not None or backend is not None
        self._telemetry = telemetry
        self._scaler: GradScaler | None = None
        self._module: nn.Module | None = None
        self._pending: dict[str, Any] | None = None  # a state_dict loaded before the scaler exists (Fabric)
        self._unscaled: set[int] = set()  # optimizers unscaled since the last update (clipping, then step)
        self._verified = False

    def _precision_flag(self) -> Literal["16-mixed", "bf16-mixed"]:
        """What ``trainer.precision`` reports: Lightning's name for float32 weights with low-precision compute."""
        return "bf16-mixed" if self._backend.config.dtype == torch.bfloat16 else "16-mixed"

    # ------------------------------------------------------------------------------ public

    @property
    def backend(self) -> Backend:
        """The autoscale backend the forward is compiled with; ``backend.reports`` has what each graph became."""
        return self._backend

    @property
    def scaler(self) -> GradScaler:
        """The :class:`autoscale.GradScaler` (``skipped_steps``, ``layers()``, ``promotions()``).

        It exists once the model is set up: from ``Trainer.fit``'s setup on, and in Fabric from the
        first forward of the module ``fabric.setup`` returned (it must follow the move to the device)."""
        if self._scaler is None:
            raise RuntimeError(f"{type(self).__name__}.scaler is created when the model is set up: by trainer.fit/"
                               "validate/test/predict, or at the first forward of the module fabric.setup returned")
        return self._scaler

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (per-layer scales and statistics, skip count), saved in Lightning checkpoints."""
        if self._scaler is None:
            return dict(self._pending or {})
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler; before the scaler exists (Fabric, before the first forward) the state
        waits and is loaded when it is created."""
        if not state_dict:
            return
        if self._scaler is None:
            self._pending = dict(state_dict)
        else:
            self._scaler.load_state_dict(state_dict)

    # ------------------------------------------------------------------------- internals

    def _prepare(self, module: nn.Module) -> nn.Module:
        """The plain module to compile, from what the user handed over.

        A module already compiled with an autoscale backend is uncompiled and its backend adopted
        (its forward is recompiled alone; Lightning's ``trainer.fit(torch.compile(model))`` also
        compiles ``training_step``, whose logging would break the graph). One compiled with
        another backend cannot work: its forward would run in float32 with no scale points.
        """
        if isinstance(getattr(module, _ATTACHED, None), _Attached):
            return module  # compiled by an earlier plugin (a second Trainer on the same model): _attach adopts it
        if isinstance(getattr(module, "_compiled_call_impl", None), _SetUpAtFirstCall):
            return module  # set up by a Fabric plugin that has not run it yet: this plugin sets it up again
        if getattr(module, "_compiled_call_impl", None) is not None:
            raise ValueError(f"{type(self).__name__}: the module was compiled with module.compile(), whose backend the "
                             "plugin cannot read; pass the uncompiled module (the plugin compiles its forward with "
                             "backend='autoscale'), or configure it with the plugin's config=/backend=")
        if isinstance(module, OptimizedModule):
            self._adopt(_backend_of(module.dynamo_ctx))  # (not Lightning's _compile_kwargs: a deep copy)
            log.info("%s: compiling the forward of the module inside torch.compile's wrapper", type(self).__name__)
            return unwrap(module)
        if isinstance(module, LightningModule) and module._compiler_ctx is not None:
            self._adopt(_backend_of(module._compiler_ctx.get("dynamo_ctx")))
            log.info("%s: trainer.fit got a torch.compile'd LightningModule; compiling its forward alone "
                     "(training_step runs eagerly around it)", type(self).__name__)
            return to_uncompiled(module)
        return module

    def _adopt(self, compiled: object) -> None:
        """Take over the backend a user compiled with, or refuse it with the fix."""
        if compiled is autoscale_backend or compiled == "autoscale":
            return  # the default backend: the plugin's own is the same (or what the user configured)
        if isinstance(compiled, Backend):
            if self._explicit and compiled.config != self._backend.config:
                raise ValueError(f"{type(self).__name__}: the model was compiled with an autoscale backend whose "
                                 "config differs from the plugin's; configure it in one place (the plugin's "
                                 "config=, or compile with the backend and give the plugin none)")
            self._backend = compiled
            return
        raise ValueError(f"{type(self).__name__} compiles the model's forward with backend='autoscale', but the model "
                         f"was compiled with backend {_backend_name(compiled)!r}, which would run it without "
                         "autoscale's float16 rewrite and scale points; pass the uncompiled model (or one compiled "
                         "with backend='autoscale')")

    def _attach(self, model: nn.Module) -> None:
        """Create the scaler on the unwrapped module and compile it, its forward and its ``_units``
        (once per module).

        The order matters: ``GradScaler`` makes the forward announce its scale buffers (a marker
        op), and the compiled forward must contain that announcement, so compiling comes second."""
        module = unwrap(model)
        if self._scaler is not None:
            if module is not self._module:
                raise ValueError(f"{type(self).__name__} serves one model (autoscale.GradScaler keeps per-layer state "
                                 "on it); use one Trainer/Fabric plugin per model")
            return
        attached = getattr(module, _ATTACHED, None)
        if isinstance(attached, _Attached):  # set up by an earlier plugin (a second Trainer on the same model)
            if self._explicit and attached.backend.config != self._backend.config:
                raise ValueError(f"{type(self).__name__}: this model was already compiled by an autoscale plugin with "
                                 "a different config; create a fresh model or use the same config")
            self._backend, self._scaler = attached.backend, attached.scaler
        else:
            units = self._units(module)
            self._scaler = GradScaler(module, self._backend.config, telemetry=self._telemetry)
            # nn.Module.compile: ``self(x)`` runs the compiled call, and the module stays the LightningModule
            module.compile(backend=self._backend)
            for unit in units:
                compile_in_place(unit, self._backend)
            object.__setattr__(module, _ATTACHED, _Attached(self._backend, self._scaler))  # not a submodule
        self._module = module
        if self._pending is not None:
            self._scaler.load_state_dict(self._pending)
            self._pending = None

    def _units(self, module: nn.Module) -> list[nn.Module]:
        """The submodules compiled each on its own, as ``training_step`` may call any of them: the
        children that hold parameters, and in place of a container without a forward of its own
        (``nn.ModuleList``, ``nn.ModuleDict``), its children. One the user compiled with the autoscale
        backend is left as it is; one compiled otherwise is refused, naming it."""
        units: list[nn.Module] = []
        pending = list(module.named_children())
        while pending:
            name, child = pending.pop(0)
            if next(child.parameters(), None) is None:
                continue
            if isinstance(child, OptimizedModule):
                self._adopt(_backend_of(child.dynamo_ctx))
            elif child._compiled_call_impl is not None and not isinstance(child._compiled_call_impl, _SetUpAtFirstCall):
                raise ValueError(f"{type(self).__name__}: the submodule {name!r} was compiled with module.compile(), "
                                 "whose backend the plugin cannot read; leave it uncompiled (the plugin compiles each "
                                 "submodule with the autoscale backend)")
            elif type(child).forward is nn.Module.forward:  # (a container: training_step calls its children)
                pending[:0] = [(f"{name}.{n}", c) for n, c in child.named_children()]
            else:
                units.append(child)
        return units

    def _check_compiled(self) -> None:
        """Refuse, at the first backward, a loss that no compiled graph computed: training would
        silently run in float32 (a loss from parameters the LightningModule holds itself, or from a
        submodule's method other than ``forward``)."""
        if self._verified:
            return
        _ = self.scaler  # (raises when the model was never set up)
        state = getattr(self._module, "_autoscale_state", None)
        graphs = getattr(state, "graphs", 0)
        if not (graphs or self._backend.records):
            raise RuntimeError(f"{type(self).__name__}: the loss was computed without any of the model's modules "
                               "running through autoscale, so nothing runs in float16 or is scaled. The plugin "
                               "compiles the model's forward and each submodule that holds parameters: compute the "
                               "loss by calling them (self(x), self.encoder(x)), not from parameters the model holds "
                               "itself (move those into a submodule) or from methods other than forward")
        self._verified = True

    def _unscale(self, optimizer: Any) -> None:
        """Unscale ``optimizer``'s gradients once per step, whoever asks first (clipping or the step).

        ``LightningModule.clip_gradients`` hands over the ``LightningOptimizer`` that
        ``self.optimizers()`` returned, while the step gets the optimizer inside it: both are the
        same optimizer, which must not be unscaled twice."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def _step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``scaler.step`` (skipped on inf/nan, returns None then) and ``scaler.update``."""
        if isinstance(optimizer, LBFGS):
            raise ValueError(f"{type(self).__name__}: LBFGS calls its closure several times per step, which loss "
                             "scaling cannot follow (as with precision='16-mixed'); use another optimizer")
        self._unscale(optimizer)  # (also for fused optimizers: autoscale.GradScaler then hands them no scale)
        try:
            return self.scaler.step(optimizer, **kwargs)
        finally:
            self.scaler.update()
            self._unscaled.clear()


class AutoscalePrecision(_AutoscaleMixin, Precision):
    """The Trainer plugin: ``L.Trainer(plugins=[AutoscalePrecision()])`` instead of ``precision="16-mixed"``.

    Args:
        config: the backend's and the scaler's configuration (default ``autoscale.Config()``).
        backend: an ``autoscale.Backend`` to compile with (to keep its ``records``/``reports``);
            its config is used. Give ``config`` or ``backend``, not two different ones.
        telemetry: a JSON-lines path for the scaler's per-step telemetry.
    """

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Uncompile what the user compiled (or refuse it) before the strategy moves and wraps it."""
        return self._prepare(module)

    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
                ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Called once the model is on its device (and wrapped, e.g. in DDP): the scaler's tensors
        must be created on that device, before the first forward."""
        self._attach(model)
        return model, optimizers, lr_schedulers

    def forward_context(self) -> AbstractContextManager[None]:
        """No autocast: the compiled graph casts to float16 itself."""
        return nullcontext()

    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        self._check_compiled()
        return super().pre_backward(self.scaler.scale(tensor), module)

    def optimizer_step(self, optimizer: Any, model: LightningModule,  # type: ignore[override]
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        """As ``MixedPrecision.optimizer_step``: run the closure (forward, backward), unscale so that
        ``on_before_optimizer_step`` and clipping see true gradients, step unless inf/nan, update.
        A backward skipped in automatic optimization (``training_step`` returned None) steps nothing."""
        closure_result = closure()
        skipped_backward = closure_result is None and model.automatic_optimization
        if not skipped_backward:
            self._unscale(optimizer)
        self._after_closure(model, optimizer)
        if skipped_backward:
            return closure_result
        return self._step(optimizer, **kwargs)

    def clip_gradients(self, optimizer: Optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Clip unscaled gradients. In automatic optimization the step already unscaled them; in manual
        optimization ``self.clip_gradients`` comes before ``opt.step()``, so unscale here (dynamic and
        static modes; adaptive mode's gradients carry no loss scale)."""
        if clip_val > 0:
            self._unscale(optimizer)
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)


class AutoscaleFabricPrecision(_AutoscaleMixin, FabricPrecision):
    """The Fabric plugin: ``L.Fabric(plugins=[AutoscaleFabricPrecision()])``; same arguments as
    :class:`AutoscalePrecision`.

    Fabric has no hook between moving the model to its device and running it, so the scaler is
    created (and the model compiled) when it first runs: at the first forward of the module
    ``fabric.setup`` returned, or at the first call of any of the modules the plugin compiles
    (``model.training_step(...)`` on one device runs no forward of Fabric's). Save the plugin with
    the rest of the state to checkpoint the scaler: ``fabric.save(path, {"model": m, "optimizer": o,
    "scaler": plugin})``; ``fabric.load`` before the model first runs is fine (the state waits).
    """

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Remember the module (one per plugin) and set it up when it first runs; refuse what cannot
        work now."""
        module = self._prepare(module)
        root = unwrap(module)
        if self._module is not None and root is not self._module:
            raise ValueError(f"{type(self).__name__} serves one model (autoscale.GradScaler keeps per-layer state on "
                             "it); set up other models with another Fabric")
        self._module = root
        if not isinstance(getattr(root, _ATTACHED, None), _Attached):
            for unit in (root, *self._units(root)):
                unit._compiled_call_impl = _SetUpAtFirstCall(self._set_up, unit)
        return module

    def _set_up(self) -> None:
        if self._scaler is None and self._module is not None:
            self._attach(self._module)

    def forward_context(self) -> AbstractContextManager[None]:
        """No autocast; at the first forward (the model now on its device) create the scaler and compile."""
        self._set_up()
        return nullcontext()

    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self._check_compiled()
        self.scaler.scale(tensor).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Before ``fabric.clip_gradients``: clipping must see unscaled gradients."""
        self._unscale(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        return self._step(optimizer, **kwargs)


class _SetUpAtFirstCall:
    """A module's compiled call (``_compiled_call_impl``) until the Fabric plugin has set the model
    up: calling the module sets it up, which compiles it, and runs the compiled call. A copy of the
    module (``copy.deepcopy``) is left uncompiled, as the plugin does not serve it."""

    def __init__(self, set_up: Callable[[], None], unit: nn.Module) -> None:
        self._set_up, self._unit = set_up, unit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._set_up()
        if self._unit._compiled_call_impl is self:  # (not compiled by the set-up: run as it is)
            self._unit._compiled_call_impl = None
        return self._unit(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None


def _backend_of(dynamo_ctx: object) -> object:
    """The backend a ``torch.compile`` context compiles with: an ``autoscale.Backend``, the registered
    ``autoscale_backend``, or whatever torch wraps another backend in (for its name).

    torch keeps it behind private wrappers (``callback._torchdynamo_orig_backend`` ...
    ``compiler_fn``, torch 2.4 to 2.13); the walk is bounded and stops at the first autoscale object."""
    obj = getattr(dynamo_ctx, "callback", None)
    for _ in range(8):
        if isinstance(obj, Backend) or obj is autoscale_backend:
            return obj
        nxt = getattr(obj, "compiler_fn", None) or getattr(obj, "_torchdynamo_orig_backend", None)
        if nxt is None or nxt is obj:
            break
        obj = nxt
    return obj


def _backend_name(backend: object) -> str:
    if isinstance(backend, str):
        return backend
    name = getattr(backend, "compiler_name", None)
    if isinstance(name, str):
        return name
    kind = type(backend).__name__
    return "inductor" if "Inductor" in kind else getattr(backend, "__name__", kind)
