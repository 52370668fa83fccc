"""DistributedDataParallel, 2 processes on gloo: an overflow on one rank skips the step on both,
and the ranks end with identical weights, optimizer state and per-layer scales."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import autoscale
from autoscale.protocol import STAT
from tests.helpers import assert_identical
from tests.reliability.distributed import FORWARD_OVERFLOW, INJECTED
from tests.reliability.ranks import WORLD

REPO = Path(__file__).resolve().parents[2]
STEPS = 16

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tests.reliability.distributed", str(STEPS), str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    # rank 1 alone injected (and overflowed its forward once); both ranks skipped exactly those steps
    assert rank0["skipped"] == rank1["skipped"] == sorted([*INJECTED, FORWARD_OVERFLOW])
    # and both promoted the same op, the cast of the input, at that step (counted from 1)
    (promoted,) = rank0["scaler"]["forward"]["promoted"]
    assert promoted["key"].startswith("input:") and promoted["step"] == FORWARD_OVERFLOW + 1
    assert_identical(rank0["weights"], rank1["weights"])
    assert all(torch.isfinite(w).all() for w in rank0["weights"].values())
    assert_identical(rank0["optimizer"], rank1["optimizer"])
    # scales, statistics (reduced across ranks), overflow and skip counts
    assert_identical(rank0["scaler"], rank1["scaler"])
    assert float(rank0["scaler"]["scales"].max()) > 1.0  # the layers were scaled
    # the additive statistics are sums over the ranks: each counted its own weight-gradient entries
    row = rank0["scaler"]["layers"].index("layers.0")
    numel = rank0["weights"]["layers.0.weight"].numel()
    assert float(rank0["scaler"]["last_stats"][row, STAT["numel"]]) == WORLD * numel


@pytest.mark.usefixtures("one_rank")
def test_ddp_bucket_split_graphs_are_refused_with_what_to_do() -> None:
    """DDPOptimizer's split pieces cannot all see the scaler's state: a clear error, not a
    silently unscaled model."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))
    ddp = DistributedDataParallel(net, bucket_cap_mb=1.0)  # ~1 MiB per weight: several buckets
    autoscale.GradScaler(ddp)
    run = torch.compile(ddp, backend=autoscale.backend(autoscale.Config(executor="eager")))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="optimize_ddp = False"):
        F.cross_entropy(run(torch.randn(4, 512)), torch.zeros(4, dtype=torch.long)).backward()


@pytest.mark.usefixtures("one_rank")
def test_ddp_does_not_broadcast_the_scalers_per_rank_state() -> None:
    """A GradScaler created before the DDP wrapper: DDP must not overwrite each rank's statistics
    with rank 0's at every forward (the scaler reduces them itself)."""
    net = nn.Linear(4, 4)
    autoscale.GradScaler(net)
    ddp = DistributedDataParallel(net)
    assert {"_autoscale_scales", "_autoscale_stats"} <= ddp.parameters_to_ignore
    assert not any(b.data_ptr() == net._autoscale_stats.data_ptr() for b in ddp.modules_buffers)
