"""``autoscale.GradScaler``: torch.amp.GradScaler's interface over per-layer scales.

Modes (``ScalingConfig.mode``):

* ``adaptive`` — each layer's scale lives in the model's ``ScaleState``; the compiled backward
  multiplies gradients by them, records statistics, and hands back parameter gradients carrying
  only the loss scale (1 here). ``update()`` recomputes every layer's scale from the statistics
  (on the device, no host sync), and on overflow backs off only the layers that overflowed.
* ``dynamic`` — one loss scale with torch.amp.GradScaler's update, plus DeepSpeed's
  ``hysteresis`` (overflows tolerated before backing off) and a ``min_scale`` floor.
* ``static`` — a fixed loss scale; overflowing steps are skipped.
* ``none`` — no scaling and no skipping (like ``torch.amp.GradScaler(enabled=False)``).

A step is skipped — the optimizer is not called, so weights and optimizer state stay bit-identical
— when any gradient is inf/nan or the compiled backward flagged an overflow. ``step`` reads that
flag on the host once (as torch.amp's does: a plain optimizer's step can only be skipped from the
host) unless the optimizer supports torch.amp's fused protocol (``_step_supports_amp_scaling``:
fused Adam, AdamW, SGD, Adagrad): then ``grad_scale`` and ``found_inf`` are handed to it as tensors
and nothing syncs. ``update`` never syncs: the scales are updated on the device
(``autoscale.update``), and what the forward's overflow checks saw reaches the host through an
asynchronous copy (``autoscale.mirror``), read when it has arrived.

The scaler keeps torch.amp's interface and delegates: forward-overflow repair to
``autoscale.repair``, the reductions over ranks to ``autoscale.distributed``, the telemetry log to
``autoscale.telemetry``, and the update rules to ``autoscale.update``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from autoscale.checked_grads import CheckedGradients, hooked
from autoscale.config import Config, OverflowConfig, ScalingConfig
from autoscale.distributed import Ranks
from autoscale.mirror import HostMirror
from autoscale.overflow import Promotion
from autoscale.protocol import FORMS, LOSS_ROW, SCALE_RANGE, STAT, headroom
from autoscale.repair import ForwardRepair
from autoscale.runtime import IdentitySet, ScaleState, install_state, unwrap
from autoscale.telemetry import append_record
from autoscale.update import (
    CompiledUpdate,
    UpdateTensors,
    adaptive_backoff,
    adaptive_update,
    dynamic_update,
    paper_scales,
)

__all__ = ["GradScaler", "LayerReport"]

log = logging.getLogger("autoscale")

_Outputs = TypeVar("_Outputs", torch.Tensor, Iterable[torch.Tensor])
_MEASURED = [STAT[c] for c in ("nonfinite", "amax", "count", "numel")]  # a row with any of these was measured
# GradScaler's tensors that live on the model's device (``GradScaler._follow``)
_OWN_TENSORS = ("_loss_scale", "_growth_tracker", "_hysteresis", "_overflows", "_last_stats", "_found_inf", "_skips",
                "_last_skipped", "_snapshot", "_measured_stats")


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass(frozen=True)
class LayerReport:
    """One layer as ``GradScaler.layers()`` reports it.

    ``scale`` is the absolute scale its gradients carry after its scale point; ``zero_rate`` is the
    fraction of its weight-gradient entries that were exactly zero at the last update (underflows,
    plus any structural zeros); ``overflows`` counts the updates at which its gradients overflowed;
    ``float32_ops`` are its ops kept in float32 because of forward overflow (``linear#0: predicted``,
    ``linear#0: promoted at step 12``).
    """

    name: str
    scale: float
    zero_rate: float
    overflows: int
    float32_ops: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Bound:
    """A steady-state ``update()`` bound once (``GradScaler._update_bound``): the compiled update,
    the tensors it takes, and what tells when they may be stale besides the tensors themselves."""

    call: Callable[..., None]
    tensors: tuple[torch.Tensor, ...]  # ``UpdateTensors`` but the snapshot (the mirror hands out one per update)
    graphs: int  # ``ScaleState.graphs`` when bound: a new graph may bring forward sites, a gradient format
    snapshot_size: int | None  # the mirror's snapshot size; None when no forward site reads the snapshot


# Where the model's buffers are among ``_Bound.tensors``: ``model.to`` replaces them
_SCALES_AT, _STATS_AT, _PEAKS_AT = (UpdateTensors._fields.index(name) for name in ("scales", "stats", "peaks"))


class GradScaler:
    """Drop-in for ``torch.amp.GradScaler`` (see the module docstring). Create it before the
    model's first forward: in adaptive mode it registers its state on the model.

    Under torch.distributed (DistributedDataParallel) the ranks reduce what decides a skip and the
    scales — inf/nan flags, largest gradients and scales at every step, the additive statistics
    at every update — over ``process_group`` (default: the default group), so every rank skips
    the same steps and keeps the same scales (``autoscale.distributed``).
    """

    def __init__(self, model: nn.Module, config: Config | ScalingConfig | None = None, *,
                 telemetry: str | Path | None = None, process_group: dist.ProcessGroup | None = None) -> None:
        cfg = config.scaling if isinstance(config, Config) else (config or ScalingConfig())
        if not isinstance(cfg, ScalingConfig):
            raise ValueError(f"GradScaler config must be an autoscale.Config or ScalingConfig, got {type(config)}")
        self.config = cfg
        self.overflow_config = config.overflow if isinstance(config, Config) else OverflowConfig()
        self._model = unwrap(model)
        device = next((p.device for p in self._model.parameters()), torch.device("cpu"))
        self._state: ScaleState | None = (
            install_state(model, moments=cfg.rule == "paper") if cfg.mode == "adaptive" else None)
        # which gradients are still as a compiled backward checked them (not read again by step)
        self._grads = CheckedGradients(self._state.checked if self._state is not None else IdentitySet())
        init = 1.0 if cfg.mode in ("none", "adaptive") else cfg.init_scale  # adaptive: layers scale themselves
        self._loss_scale = torch.full((), float(init), device=device)  # 0-dim, like torch.amp's
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self._hysteresis = torch.full((), cfg.hysteresis, dtype=torch.int32, device=device)
        self._overflows = torch.zeros(len(self._state.layers) if self._state else 1, device=device)
        self._last_stats = torch.zeros_like(self._state.stats) if self._state else None
        self._found_inf = torch.zeros((), device=device)  # 0-dim, as fused optimizers expect
        self._skips = torch.zeros((), device=device)
        self._last_skipped = torch.zeros((), dtype=torch.bool, device=device)
        # the forward's peaks, whether they call for a look, and the overflow flag: copied to the host
        # at each update without waiting, read once the copy has arrived (``ForwardRepair``)
        capacity = self._state.forward.capacity if self._state is not None else 0
        self._snapshot = torch.zeros(capacity + 2, device=device) if self._state is not None else None
        self._repair = ForwardRepair(self._state.forward, self.overflow_config) if self._state is not None else None
        # (one Triton launch where the config's form asks for it: ``Form.fused_update``)
        fused = isinstance(config, Config) and FORMS[config.form].fused_update
        self._update_scales = CompiledUpdate(adaptive_update, fused=_fused_update if fused else None)
        self._bound: _Bound | None = None  # the steady state's update (``_update_bound``)
        self._constants: tuple[float, dict[str, float]] | None = None  # (gradient_max, update constants)
        self._stages: dict[int, _Stage] = {}
        self._steps = 0
        self._telemetry = Path(telemetry) if telemetry is not None else None
        self._ranks = Ranks(process_group)  # who decides the skips and the scales together
        self._decided: bool | None = None  # this step's overflow flag, when step() synced for it
        # Whether scale() multiplies: adaptive mode's loss scale stays 1 unless update(new_scale) sets one.
        self._multiplies = cfg.mode not in ("none", "adaptive")
        # the statistics of the last update after a step that measured (``layers()``), kept apart
        # when steps in between measure nothing (``measure_every``): their updates' hold none
        self._measured_stats: torch.Tensor | None = None
        self._remeasure = False  # step() saw a skipped step: measure the next one (``_measure_next``)
        self._measure_next()

    # ------------------------------------------------------------------ torch.amp interface

    def is_enabled(self) -> bool:
        return self.config.mode != "none"

    def scale(self, outputs: _Outputs) -> _Outputs:
        """``outputs`` (a tensor, or an iterable of them, as torch.amp takes) times the loss scale.

        In adaptive mode the loss scale is 1 (the layers scale themselves) and ``outputs`` come back
        as they are, with no multiply in the forward and none in the backward. There, a hook on
        each output starts the backward: it has ``CheckedGradients`` note which gradients the
        compiled backward is about to check, and it refuses a backward with ``create_graph=True``
        (a gradient penalty) in words: the compiled backward writes the layers' statistics, and
        AOTAutograd cannot differentiate a backward that mutates its inputs; its own error speaks
        of input mutations."""
        if isinstance(outputs, torch.Tensor):
            self._follow(self._state.stats.device if self._state is not None else outputs.device)
            if not self._multiplies:
                if self._state is not None and self._state.graphs and outputs.requires_grad:
                    outputs.register_hook(self._backward_starts)
                return outputs
            return outputs * self._loss_scale.to(outputs.dtype)
        if not isinstance(outputs, Iterable):
            raise ValueError(f"GradScaler.scale takes a tensor or an iterable of tensors, got {type(outputs).__name__}")
        scaled = (self.scale(o) for o in outputs)
        return type(outputs)(scaled) if isinstance(outputs, list | tuple) else scaled

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the loss scale and look for inf/nan (once per step)."""
        if not self.is_enabled():
            return
        stage = self._stages.get(id(optimizer), _Stage.READY)
        if stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._check_grads(optimizer, unscale=True)
        self._stages[id(optimizer)] = _Stage.UNSCALED

    def _backward_starts(self, grad: torch.Tensor) -> None:
        """The hook ``scale`` puts on an output in adaptive mode (see there)."""
        _refuse_double_backward(grad)
        self._grads.backward_starts()

    def _check_grads(self, optimizer: torch.optim.Optimizer, *, unscale: bool) -> None:
        """Note any inf/nan in the gradients, on the device, and divide them by the loss scale if
        ``unscale``. A gradient a compiled graph checked as it unscaled it (adaptive mode) is
        skipped while it is still what the graph checked (``CheckedGradients``): that check was
        fused into the backward, and this would be another pass over its memory. One that changed
        since, or one a gradient hook may have changed, is checked here."""
        checked = self._grads
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None or (checked.unchanged(p) and not hooked(p)):
                    continue
                if unscale and p.grad.dtype == torch.float16:
                    raise ValueError(
                        "Attempting to unscale float16 gradients: keep the parameters float32 (do not call "
                        "model.half()); the compiled graph casts them to float16 where that is safe.")
                grad = p.grad
                if grad.is_sparse:
                    # as torch.amp does: coalescing adds duplicate indices' values, which may overflow in
                    # float16, so the check reads the coalesced values
                    if grad.dtype == torch.float16:
                        p.grad = grad = grad.coalesce()
                    grad = grad._values()
                by_device.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), grads in by_device.items():
            found = torch.zeros((), device=device)
            inv_scale = self._loss_scale.double().reciprocal().float() if unscale else torch.ones(())
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
            self._found_inf += found.to(self._found_inf.device)
        self._ranks.changed()
        self._decided = None

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless this step overflowed; returns its result, or None if skipped."""
        if not self.is_enabled():
            return optimizer.step(*args, **kwargs)
        if kwargs.get("closure", args[0] if args else None) is not None:
            raise RuntimeError(
                "GradScaler.step does not take a closure (torch.amp's GradScaler refuses one too): the gradients "
                "the closure makes would be neither checked for inf/nan nor unscaled. Call the closure, then "
                "scaler.step(optimizer).")
        stage = self._stages.get(id(optimizer), _Stage.READY)
        if stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # torch.amp's fused protocol: the optimizer unscales and skips on device, no sync.
            opt: Any = optimizer
            if stage is _Stage.READY:  # look for inf/nan without unscaling: the optimizer unscales
                self._check_grads(optimizer, unscale=False)
            opt.grad_scale = None if stage is _Stage.UNSCALED else self._loss_scale
            opt.found_inf = self._overflowed()
            try:
                result = optimizer.step(*args, **kwargs)
            finally:
                del opt.grad_scale, opt.found_inf
            self._stages[id(optimizer)] = _Stage.STEPPED
            return result
        if stage is _Stage.READY:
            self.unscale_(optimizer)
        self._stages[id(optimizer)] = _Stage.STEPPED
        self._decided = self._overflow_value().item() > 0  # the one host sync, as in torch.amp
        if self._decided:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale(s) for the next step and reset the per-step state."""
        if not self.is_enabled():
            return
        if self.config.mode == "adaptive" and new_scale is None:
            if self._steps == 0:
                self._check_instrumented()
            snapshot = self._update_bound()
            if snapshot is None:
                self._collect()
                snapshot = self._update_adaptive()
            assert self._state is not None and self._last_stats is not None and self._repair is not None
            if self._mirrored:
                self._repair.watch(snapshot, step=self._steps + 1, watched=self._state.measuring,
                                    decided=bool(self._decided))
            if self.config.measure_every > 1 and self._state.measuring and (
                    (self._steps + 1) % self.config.update_every == 0):
                self._measured_stats = self._last_stats.clone()
            overflow: torch.Tensor | bool = self._last_skipped if self._decided is None else self._decided
            self._remeasure |= bool(self._decided)
        else:
            overflow = self._overflowed()
            self._skips += overflow
            if new_scale is not None:
                self._loss_scale.fill_(float(new_scale))
                self._multiplies = True
            elif self.config.mode == "dynamic":
                cfg = self.config
                dynamic_update(self._loss_scale, self._growth_tracker, self._hysteresis, overflow,
                               growth=cfg.growth_factor, backoff=cfg.backoff_factor, interval=cfg.growth_interval,
                               hysteresis_steps=cfg.hysteresis, min_scale=cfg.min_scale)
            self._found_inf.zero_()
            self._last_skipped.copy_(overflow > 0)
        self._steps += 1
        self._grads.clear()
        self._measure_next()
        if self._telemetry is not None:
            events = self._repair.take_events() if self._repair is not None else None
            append_record(self._telemetry, step=self._steps, skipped=bool(overflow), loss_scale=self.get_scale(),
                          layers=self.layers(), forward=events)
        self._stages.clear()
        self._ranks.changed()
        self._decided = None

    @property
    def scaling_needed(self) -> bool:
        """False when every graph compiled against this scaler computes in bfloat16 (nothing to
        scale: its exponent range is float32's); True otherwise, and before any graph is compiled."""
        if self._state is None or not self._state.graphs:
            return self.is_enabled()
        return self._state.scaled_graphs > 0

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped for inf/nan so far (reading it syncs with the device)."""
        return int(self._skips.item())

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """A 0-dim bool tensor on the model's device: whether the step that the last ``update()``
        closed was skipped. Reading it on the device costs no sync; ``bool()`` of it syncs."""
        return self._last_skipped

    @property
    def applied_steps(self) -> torch.Tensor:
        """A 0-dim int64 tensor on the model's device: how many steps the optimizer has taken so far
        (updates minus skipped steps). A learning-rate schedule computed from it stays in step with
        the optimizer without a sync (docs/gradscaler.md, "Skipped steps and learning-rate schedules")."""
        return (self._steps - self._skips).long()

    def get_scale(self) -> float:
        """The loss scale (a host sync); per-layer scales are in ``layers()``."""
        return float(self._loss_scale.item()) if self.is_enabled() else 1.0

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "mode": self.config.mode, "scale": self._loss_scale.clone(), "growth_tracker": self._growth_tracker.clone(),
            "hysteresis": self._hysteresis.clone(), "overflows": self._overflows.clone(), "steps": self._steps,
            "skips": self._skips.clone(),
        }
        if self._state is not None:
            state.update(layers=list(self._state.layers), scales=self._state.scales.clone(),
                         stats=self._state.stats.clone(), last_stats=self._last_stats.clone(),  # type: ignore[union-attr]
                         forward=self._state.forward.state_dict())
            if self._measured_stats is not None:  # (``measure_every``: what ``layers()`` reports)
                state["measured_stats"] = self._measured_stats.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode") != self.config.mode:
            raise ValueError(f"state_dict is for mode {state.get('mode')!r}, this GradScaler is {self.config.mode!r}")
        if self._state is not None:
            if list(state["layers"]) != list(self._state.layers):
                raise ValueError("state_dict's layers do not match this model's; load it into the same model")
            self._state.load(state["scales"], state["stats"])
            self._state.seeded.update(range(len(self._state.layers)))  # (a compile now must not re-seed them)
            self._last_stats.copy_(state["last_stats"])  # type: ignore[union-attr]
            measured = state.get("measured_stats")
            self._measured_stats = None if measured is None else measured.to(self._last_stats.device).clone()  # type: ignore[union-attr]
            # promotions apply at the next forward: Dynamo's guard on them recompiles the graph
            self._state.forward.load_state_dict(state.get("forward", {}))
        else:
            self._loss_scale.copy_(state["scale"])
        self._growth_tracker.copy_(state["growth_tracker"])
        self._hysteresis.copy_(state["hysteresis"])
        self._overflows.copy_(state["overflows"])
        self._skips.copy_(state["skips"])
        self._steps = int(state["steps"])
        self._measure_next()

    def _measure_next(self) -> None:
        """Tell the model's forward whether the coming step measures its gradients: the first, every
        ``measure_every``-th after it, and the next after a skipped step the host has seen (at once
        where ``step()`` read the flag, else when the snapshot arrives: ``ForwardRepair.take_skipped``),
        so that the scale that overflowed is found and backed off (a step that measures nothing
        blames no row: ``insert_grad_scaling``'s ``lighten``). The graph for each value is compiled
        at its first use."""
        seen = self._repair.take_skipped() if self._repair is not None else False
        if self._state is not None:
            self._state.measuring = self._remeasure or seen or self._steps % self.config.measure_every == 0
        self._remeasure = False

    # -------------------------------------------------------------------------- reporting

    def layers(self) -> list[LayerReport]:
        """Per layer that has gradient statistics: name, scale, weight-gradient zero rate, overflows."""
        if self._state is None:
            return []
        measured = self._measured_stats if self._measured_stats is not None else self._last_stats
        stats, scales, overflows = measured.cpu(), self._state.scales.cpu(), self._overflows.cpu()  # type: ignore[union-attr]
        forward = self._state.forward
        promoted: dict[str, list[str]] = {}
        for site in forward.float32_sites():
            learnt = forward.promoted.get(site.promotes)
            op = site.key.rpartition(":")[2]
            promoted.setdefault(site.layer, []).append(
                f"{op}: promoted at step {learnt.step}" if learnt else f"{op}: predicted")
        reports = []
        for row, name in enumerate(self._state.layers):
            has_stats = row in self._state.measured_rows or bool(stats[row, _MEASURED].any())
            if row == LOSS_ROW or not (has_stats or promoted.get(name)):
                continue
            numel = float(stats[row, STAT["numel"]])
            zero_rate = float(stats[row, STAT["zeros"]]) / numel if numel else 0.0
            reports.append(LayerReport(name or "(root)", float(scales[row]), zero_rate, int(overflows[row]),
                                       tuple(promoted.get(name, ()))))
        return reports

    def promotions(self) -> list[Promotion]:
        """The ops promoted to float32 after a forward overflow, in the order they were."""
        return self._repair.promotions() if self._repair is not None else []

    # --------------------------------------------------------------------------- internals

    def _follow(self, device: torch.device) -> None:
        """Move the scaler's own tensors to ``device``, the model's now: ``GradScaler(model)`` then
        ``model.cuda()`` moves the model's scale buffers but not these (torch.amp's scaler, made
        lazily at the first ``scale()``, has no such order)."""
        if self._found_inf.device == device:
            return
        self._bound = None
        for name in _OWN_TENSORS:
            if (tensor := getattr(self, name)) is not None:
                setattr(self, name, tensor.to(device))

    def _overflowed(self) -> torch.Tensor:
        """A 0-dim tensor on the device, 1.0 when this step saw inf/nan anywhere (on any rank), else
        0.0 (fused optimizers compare ``found_inf`` with 1)."""
        return (self._overflow_value() > 0).float()

    def _overflow_value(self) -> torch.Tensor:
        """A 0-dim tensor, positive when this step saw inf/nan anywhere (on any rank): ``found_inf``
        and the graphs' ``ANY_NONFINITE`` cell."""
        self._collect()
        if self._state is None:
            return self._found_inf
        return torch.maximum(self._found_inf, self._state.any_nonfinite)

    def _collect(self) -> None:
        """Bring this step's statistics together: from every graph (graph breaks), then from every
        rank (torch.distributed)."""
        if self._state is not None and self._state.graph_stats:
            self._state.gather()
        self._ranks.agree(self._found_inf, self._state)

    def _check_instrumented(self) -> None:
        """Warn, once, when no compiled graph serves this scaler: the model is not compiled by autoscale."""
        assert self._state is not None
        if not self._state.graphs:
            log.warning("GradScaler: no graph compiled by autoscale uses this model's scales, so no layer was scaled; "
                        "compile the model with torch.compile(model, backend='autoscale') and create the "
                        "GradScaler before its first forward (if Dynamo warned that it hit "
                        "torch._dynamo.config.recompile_limit, the model ran eagerly: raise the limit)")
        elif not self.scaling_needed:
            log.info("GradScaler: the model computes in bfloat16, whose exponent range is float32's: no gradient "
                     "scaling is needed, and every scale stays 1 (steps with inf/nan are still skipped)")

    def _update_adaptive(self) -> torch.Tensor:
        """``adaptive_update`` on this scaler's state, on the device: one compiled kernel when
        Inductor compiles the model's graphs, eager ops otherwise. Returns the snapshot it wrote."""
        assert self._state is not None and self._last_stats is not None and self._snapshot is not None
        assert self._repair is not None
        cfg, state, forward = self.config, self._state, self._state.forward
        due = (self._steps + 1) % cfg.update_every == 0
        if due:
            self._ranks.sum_stats(state.stats)
        bound = (paper_scales(state.stats, state.layers, dict(self._model.named_modules()), gamma=cfg.gamma)
                 if due and cfg.rule == "paper" else None)
        constants = self._update_constants()
        peaks = state.peaks
        forward.follow(peaks.device)
        # (without sites, and with every step measured, nothing reads the snapshot: it goes to a scratch tensor)
        snapshot = (self._repair.mirror.destination(len(self._snapshot), peaks.device) if self._mirrored
                    else self._snapshot)
        tensors = UpdateTensors(state.scales, state.stats, self._last_stats, self._overflows, self._skips,
                                self._found_inf, self._last_skipped, peaks, forward.alarm_low,
                                forward.alarm_high, forward.outputs, snapshot)
        variant = (due, bound is None, peaks.device, *constants.values())
        compiled = self._update_scales((*tensors, bound), variant=variant,
                                       compile=state.inductor_graphs > 0 and state.inductor_graphs == state.graphs,
                                       due=due, **constants)
        steady = cfg.update_every == 1 and bound is None and not state.graph_stats and self._ranks.size() == 1
        self._bound = None if compiled is None or not steady else _Bound(
            compiled, tuple(tensors[:-1]), state.graphs, len(self._snapshot) if self._mirrored else None)
        return snapshot

    @property
    def _mirrored(self) -> bool:
        """Whether the update's snapshot goes to the host: for the forward's sites, and for the skip
        flag alone when steps between measured ones measure nothing (``_measure_next``)."""
        return self._state is not None and (bool(self._state.forward.sites) or self.config.measure_every > 1)

    @property
    def _mirror(self) -> HostMirror | None:
        """Where the update's snapshots go to the host (``ForwardRepair.mirror``), None outside adaptive
        mode: ``benchmarks.host_reads`` exempts reads of its buffers, which never wait for the device."""
        return self._repair.mirror if self._repair is not None else None

    def _update_bound(self) -> torch.Tensor | None:
        """The steady state's update: the compiled update on the tensors the last full update bound,
        and the snapshot it wrote; None when they may be stale (then the full update runs, and binds
        again). After a backward, with the caches cold, the full update's Python around the compiled
        call costs more than the call itself (docs/results/overhead_quick.md).

        What the bound tensors come from changes only when the model's buffers are replaced
        (``model.to``: checked here), a graph is compiled (it may add forward sites or change the
        gradient format: checked here), the scaler's own tensors follow the model to another device
        (``_follow`` unbinds), or ranks join (checked here). The constants are compiled in: every
        step is due (``update_every=1``) and the rule has no per-step bound ("headroom")."""
        bound, state = self._bound, self._state
        if bound is None or state is None or bound.graphs != state.graphs or self._ranks.size() != 1:
            return None
        tensors = bound.tensors
        peaks = tensors[_PEAKS_AT]
        if not state.holds(tensors[_SCALES_AT], tensors[_STATS_AT], peaks):
            return None
        assert self._snapshot is not None and self._repair is not None
        snapshot = (self._snapshot if bound.snapshot_size is None
                    else self._repair.mirror.destination(bound.snapshot_size, peaks.device))
        bound.call(*tensors, snapshot)
        return snapshot

    def _update_constants(self) -> dict[str, float]:
        """``adaptive_update``'s constants, from the config and the graphs' gradient format."""
        assert self._state is not None
        gradient_max = self._state.gradient_max
        if self._constants is None or self._constants[0] != gradient_max:
            cfg = self.config
            high = SCALE_RANGE[1] if cfg.scale_upper_bound is None else min(SCALE_RANGE[1], cfg.scale_upper_bound)
            self._constants = (gradient_max, {
                "backoff": cfg.backoff_factor, "repeated_backoff": adaptive_backoff(cfg), "growth": cfg.growth_factor,
                "high": high, "headroom": headroom(cfg.margin, gradient_max)})
        return self._constants[1]


def _refuse_double_backward(grad: torch.Tensor) -> None:
    """A hook on a scaled output: grad mode is on in a backward only under ``create_graph=True``."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "autoscale: a backward with create_graph=True (a gradient penalty through torch.autograd.grad) reached "
            "a graph compiled by torch.compile, which cannot be differentiated twice (AOTAutograd has no double "
            "backward, with any backend). Compute the penalty on an uncompiled model, with torch.amp.")


def _fused_update(tensors: tuple[torch.Tensor | None, ...], **constants: Any) -> Callable[..., None] | None:
    """``autoscale.kernels.update.fused_update``, imported where the form asks for it: ``import
    autoscale`` stays free of triton."""
    from autoscale.kernels.update import fused_update

    return fused_update(tensors, **constants)
