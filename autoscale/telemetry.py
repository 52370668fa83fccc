"""Writing the scaler's telemetry: one JSON line per ``GradScaler.update()``.

``GradScaler(model, telemetry=PATH)`` appends a record per update (``append_record``); the format
is the one ``autoscale.report`` reads (its module docstring shows a record): the step, whether it
was skipped, the loss scale, per layer its scale, zero rate, overflow count and ops kept in float32
(``float32_ops``, only where there are any), and ``forward``, only on steps where the forward's
overflow checks found something (``ForwardSites.events``). The log is opened in append mode, so
one file can hold several runs; the report tells them apart by their step numbers restarting.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

__all__ = ["LayerRecord", "append_record"]


class LayerRecord(Protocol):
    """What a record holds of one layer (``autoscale.scaler.LayerReport`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def scale(self) -> float: ...
    @property
    def zero_rate(self) -> float: ...
    @property
    def overflows(self) -> int: ...
    @property
    def float32_ops(self) -> tuple[str, ...]: ...


def append_record(path: Path, *, step: int, skipped: bool, loss_scale: float, layers: Iterable[LayerRecord],
                  forward: Mapping[str, Any] | None = None) -> None:
    """Append one update's record to the log at ``path`` (see the module docstring); ``forward``
    is left out when empty."""
    record: dict[str, Any] = {
        "step": step, "skipped": skipped, "loss_scale": loss_scale,
        "layers": {r.name: {"scale": r.scale, "zero_rate": r.zero_rate, "overflows": r.overflows,
                            **({"float32_ops": list(r.float32_ops)} if r.float32_ops else {})}
                   for r in layers}}
    if forward:
        record["forward"] = forward
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
