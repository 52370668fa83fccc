"""The ranks a ``GradScaler`` decides with under torch.distributed (DistributedDataParallel, FSDP).

DDP all-reduces parameter gradients, but a compiled backward checks and measures its gradients
before they reach DDP's hooks: an overflow on one rank would otherwise skip the step there alone
and leave the ranks' weights apart, and each rank's scales would follow its own batches.
:class:`Ranks` reduces what decides a skip and the scales over the scaler's process group:

* every step (``Ranks.agree``), by MAX: the inf/nan flags, the layers' largest gradients, the
  negated scales (so every rank takes the smallest) and the forward's peaks (so every rank
  promotes the same ops);
* every update that is due (``Ranks.sum_stats``), by SUM: the additive statistics (Σg, Σg²,
  counts) each rank accumulated since the last.

Without torch.distributed (or in a group of one) both do nothing. Every rank must call the
scaler's ``step``/``update`` alike, as with any collective.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autoscale.protocol import STAT

if TYPE_CHECKING:
    from autoscale.runtime import ScaleState

__all__ = ["Ranks"]

_ADDITIVE = [i for name, i in STAT.items() if name not in ("nonfinite", "amax")]  # the columns summed over ranks


class Ranks:
    """The ranks of ``group`` (default: the default group), and whether this step's flags are
    already reduced over them (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._agreed = False  # this step's flags are already reduced across ranks

    def size(self) -> int:
        """How many ranks decide together (1 without torch.distributed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    def changed(self) -> None:
        """This step's flags may have changed since they were reduced (a new step, more local
        checks): the next ``agree`` reduces them again."""
        self._agreed = False

    def agree(self, found_inf: torch.Tensor, state: ScaleState | None) -> None:
        """Make every rank decide alike: one all-reduce (MAX) of ``found_inf`` (0-dim) and, with a
        ``state``, of its rows' inf/nan flags and largest gradients, its negated scales and its
        forward's peaks, each written back in place. Once per step (until ``changed``): MAX is
        idempotent, so reducing again after more local checks (a second optimizer's ``unscale_``)
        is harmless, and only then needed."""
        if self._agreed or self.size() == 1:
            return
        parts = [found_inf.view(1)]
        if state is not None:
            stats, peaks = state.stats, state.peaks
            # (nan as inf: MAX may drop nan)
            parts += [stats[:, STAT["nonfinite"]], stats[:, STAT["amax"]], -state.scales,
                      torch.nan_to_num(peaks, nan=math.inf, posinf=math.inf)]
        packed = torch.cat(parts)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.group)
        found_inf.copy_(packed[0])
        if state is not None:
            rows = len(state.layers)
            flags, amax, neg_scales = packed[1:1 + 3 * rows].view(3, rows)
            stats[:, STAT["nonfinite"]] = flags
            stats[:, STAT["amax"]] = amax
            state.scales.copy_(-neg_scales)
            peaks.copy_(packed[1 + 3 * rows:])
        self._agreed = True

    def sum_stats(self, stats: torch.Tensor) -> None:
        """Sum the additive statistics of ``stats`` (rows x ``STAT``) over the ranks, in place,
        before an update reads them: one all-reduce every ``update_every`` steps, of what each rank
        accumulated since."""
        if self.size() == 1:
            return
        summed = stats[:, _ADDITIVE].contiguous()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
        stats[:, _ADDITIVE] = summed
