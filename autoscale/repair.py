"""Acting on the forward's overflow checks from the host, without waiting for the device.

Each adaptive ``update()`` writes a snapshot on the device (``autoscale.update.adaptive_update``):
this step's forward peaks, whether they call for a look (a float16 value near 65504, a cast source
in range, nan) and the step's overflow flag. :class:`ForwardRepair` copies it to the host
asynchronously (``HostMirror``) and reads it once it has arrived: at once on a CPU, usually at the
next update on CUDA. The overflow flag tells the scaler that the step was skipped, where the host
did not know already (a fused optimizer's step). Where the flags say so, it repairs what the peaks
show (``ForwardSites.repair``: promoting ops to float32), and when a skipped step has something
promotion cannot fix it warns, then raises ``NonFiniteForwardError`` once that has happened
``OverflowConfig.patience`` steps in a row. The skip itself is always decided on the device, from
the gradients; only the diagnosis and the repair may come a step later (docs/forward_overflow.md).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from autoscale.config import OverflowConfig
from autoscale.mirror import HostMirror
from autoscale.overflow import ForwardSites, NonFiniteForwardError, Promotion

__all__ = ["ForwardRepair"]

log = logging.getLogger("autoscale")


class ForwardRepair:
    """The host side of one scaler's forward overflow checks (see the module docstring): the
    snapshots on their way to the host, the run of non-finite forwards that promotion cannot fix
    (``streak``), what the last repair found, for telemetry (``take_events``), and whether a
    snapshot said its step was skipped, for the scaler's ``measure_every`` (``take_skipped``)."""

    def __init__(self, sites: ForwardSites, config: OverflowConfig) -> None:
        self.sites = sites
        self.config = config
        self.mirror = HostMirror()
        # the step of each snapshot on its way to the host, and whether that step watched its forward
        self._pending: deque[tuple[int, bool]] = deque()
        self.streak = 0  # consecutive steps non-finite with nothing left to promote
        self._skipped = False  # a snapshot read since ``take_skipped`` said its step was skipped
        self._events: dict[str, Any] = {}  # the last repair's findings, until the telemetry takes them

    def watch(self, snapshot: torch.Tensor, *, step: int, watched: bool, decided: bool) -> None:
        """Hand ``snapshot`` (written into ``mirror.destination``) to the host, and act on the
        snapshots that have arrived (``read``). ``step`` counts from 1, as the telemetry does;
        ``watched`` says whether the step watched its forward (one that measures nothing watches
        nothing: ``ScalingConfig.measure_every``). When ``decided`` (``step()`` read the overflow
        flag on the host and the step was skipped), the snapshot is read now: a skipped step is no
        steady state, and the repair should not wait for another one."""
        if decided and snapshot.device.type != "cpu":
            host = snapshot.cpu()
            self.read(host, *host[-2:].tolist(), step=step, watched=watched)
            return
        self.mirror.post(snapshot)
        self._pending.append((step, watched))
        for host in self.mirror.poll():
            values = self.mirror.values(host)  # (its flags read with no torch op: ``HostMirror.values``)
            step, watched = self._pending.popleft()
            self.read(host, values[-2], values[-1], step=step, watched=watched)

    def read(self, host: torch.Tensor, alarm: float, skipped: float, *, step: int, watched: bool) -> None:
        """Act on the snapshot ``host`` if its flags (its last two values) say so. A step whose
        forward was not ``watched`` says nothing of the forward: a skip there only has the next step
        measure (``take_skipped``), which watches, and the run of non-finite forwards that
        ``OverflowConfig.patience`` counts neither grows nor ends."""
        self._skipped |= bool(skipped)
        if not watched:
            return
        if (alarm or skipped) and self.sites.sites:
            self._act(host[:-2], skipped=bool(skipped), step=step)
        else:
            self.streak = 0

    def take_skipped(self) -> bool:
        """Whether a snapshot read since the last call said its step was skipped (the scaler then
        measures the next step, so that the scale that overflowed is found and backed off)."""
        skipped, self._skipped = self._skipped, False
        return skipped

    def take_events(self) -> dict[str, Any]:
        """What the last repair found and did (``ForwardSites.events``), once; {} when nothing
        was found since they were last taken."""
        events, self._events = self._events, {}
        return events

    def promotions(self) -> list[Promotion]:
        """The ops promoted to float32 after a forward overflow, in the order they were."""
        return list(self.sites.promoted.values())

    def _act(self, peaks: torch.Tensor, *, skipped: bool, step: int) -> None:
        """Repair what the peaks show; when a skipped step has something promotion cannot fix,
        warn, and raise once that has happened ``OverflowConfig.patience`` steps in a row."""
        forward, cfg = self.sites, self.config
        repair = forward.repair(peaks, skipped=skipped, step=step, max_recompiles=cfg.max_recompiles)
        self._events = forward.events(repair)
        if repair.added:
            seen = forward.describe_slots(repair.found, repair.found.overflowed + repair.found.near)
            log.warning("forward overflow at step %d: %s; computing %s in float32 from the next step "
                        "(recompile %d of at most %d)", step, seen, ", ".join(p.key for p in repair.added),
                        forward.recompiles, cfg.max_recompiles)
        if not repair.stuck:
            self.streak = 0  # a good step, a gradient overflow (the scales' business), or repaired now
            return
        self.streak += 1
        message = (f"the forward is non-finite at step {step}: {repair.stuck}. "
                   f"The step was skipped ({self.streak} in a row)")
        if self.streak >= cfg.patience:
            raise NonFiniteForwardError(message + f"; stopping after OverflowConfig.patience={cfg.patience} such "
                                        "steps rather than skipping forever")
        log.warning("%s; GradScaler raises after %d in a row", message, cfg.patience)
