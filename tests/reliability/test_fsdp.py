"""FSDP2 (``fully_shard``), 2 processes on gloo: an overflow on one rank skips the step on both, the
ranks keep identical per-layer scales and weights, which match one process training on both
ranks' batches, and a run resumed from a torch.distributed.checkpoint matches the uninterrupted
one. Compiling the whole model with one backend is refused (Dynamo shares one graph among the
blocks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F

import autoscale
from autoscale.protocol import STAT
from tests.helpers import assert_identical
from tests.reliability import fsdp

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _run(*args: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "tests.reliability.fsdp", *map(str, args)],
                         cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    where = Path(args[2])
    rank0, rank1 = (torch.load(where / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    return rank0, rank1


def test_fsdp2_adaptive_agrees_across_ranks_matches_one_process_and_resumes(tmp_path: Path) -> None:
    rank0, rank1 = _run("run", "adaptive", tmp_path / "run")
    # rank 1 alone injected; both ranks skipped exactly those steps, kept the same scales and weights
    assert rank0["skipped"] == rank1["skipped"] == sorted(fsdp.INJECTED)
    assert_identical(rank0["scaler"], rank1["scaler"])
    assert_identical(rank0["weights"], rank1["weights"])
    # every block's layer was scaled, each in its own row
    assert {f"blocks.{i}.fc" for i in range(fsdp.HIDDEN + 1)} <= rank0["scales"].keys()
    assert all(scale > 1.0 for scale in rank0["scales"].values())
    # the additive statistics are sums over the ranks' unsharded gradients
    row = rank0["scaler"]["layers"].index("blocks.0.fc")
    numel = rank0["weights"]["blocks.0.fc.weight"].numel()
    assert float(rank0["scaler"]["last_stats"][row, STAT["numel"]]) == fsdp.WORLD * numel

    torch._dynamo.reset()
    reference = fsdp.reference("adaptive")
    assert reference["skipped"] == rank0["skipped"]
    for name, weight in reference["weights"].items():
        # measured: 2.5e-5 at most (8.8e-5 relative), float16 rounding of the per-rank sums
        torch.testing.assert_close(rank0["weights"][name], weight, rtol=1e-3, atol=2e-4, msg=name)
    for name in (f"blocks.{i}.fc" for i in range(fsdp.HIDDEN + 1)):
        assert rank0["scales"][name] == reference["scales"][name]

    resumed0, resumed1 = _run("resume", "adaptive", tmp_path / "resumed", tmp_path / "run" / "checkpoint")
    for resumed in (resumed0, resumed1):
        assert resumed["skipped"] == rank0["skipped"]
        assert_identical(resumed["weights"], rank0["weights"])
        assert_identical(resumed["scaler"], rank0["scaler"])


def test_fsdp2_dynamic_skips_alike_on_every_rank(tmp_path: Path) -> None:
    """Without the scaler's all-reduce, rank 0 would not see rank 1's inf: the reduce-scatter
    puts it into one rank's shard only."""
    rank0, rank1 = _run("run", "dynamic", tmp_path)
    assert rank0["skipped"] == rank1["skipped"] == sorted(fsdp.INJECTED)
    assert_identical(rank0["scaler"], rank1["scaler"])
    assert_identical(rank0["weights"], rank1["weights"])


@pytest.mark.usefixtures("one_rank")
def test_one_backend_for_every_fully_sharded_block_is_refused_with_what_to_do() -> None:
    """Dynamo reuses the graph of one block for the next (it skips FSDP-managed modules' guards):
    that graph would scale the other block's gradients with the first one's rows."""
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = fsdp.Net()
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    autoscale.GradScaler(net)
    run = torch.compile(net, backend=autoscale.backend(autoscale.Config(executor="eager")))
    x, y = fsdp.batch(0, 0)
    with pytest.raises(RuntimeError, match="a backend of its own"):
        F.cross_entropy(run(x), y).backward()
