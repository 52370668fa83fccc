"""Ranks that cannot hang a test: the launch, process group and exit the 2-process scripts share.

A hang has three places to happen, and each has a bound here:

- **a collective that never completes** (a rank died or took another path): the process group's
  own ``timeout`` raises in the waiting rank, and ``faulthandler`` prints every rank's stack and
  exits at ``TIMEOUT_S`` in case something waits outside a collective;
- **the interpreter's finalization**, where gloo's worker threads and DDP's reducer are destroyed
  in an order nobody controls (pytorch/pytorch#179291: a rank aborted with "terminate called
  without an active exception", or hung for minutes after its work was done): a rank leaves with
  ``os._exit(0)`` once it has saved its results and torn the group down (``leave``);
- **the launcher**, which would wait forever on a rank that neither exits nor raises: ``spawn``
  joins with a deadline and kills the ranks past it, with a ``TimeoutError`` that says so.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
TIMEOUT_S = 240.0  # a whole run takes under a minute on 2 cores: this is a hang, not a slow run


def join_group(rank: int, out: Path) -> None:
    """Join the gloo group of ``WORLD`` ranks (rendezvous in ``out``), every wait bounded."""
    faulthandler.enable()
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S / 2))


def leave() -> None:
    """Exit a rank whose results are saved and whose group is destroyed, without the interpreter's
    finalization (see the module's docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker: Callable[..., None], args: tuple[Any, ...]) -> None:
    """Run ``worker(rank, *args)`` in ``WORLD`` processes; a rank's exception is raised here, and
    ranks still running ``TIMEOUT_S`` (and a margin) after the start are killed."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.spawn(worker, args=args, nprocs=WORLD, join=False)  # type: ignore[attr-defined]
    deadline = time.monotonic() + TIMEOUT_S + 30
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"ranks still running after {TIMEOUT_S + 30:.0f} s: killed")
