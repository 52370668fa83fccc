"""DistributedDataParallel on 2 CPU processes (gloo), with an overflow injected on one rank only:
the script ``test_distributed.py`` runs.

    python -m tests.reliability.distributed STEPS OUT [--compute native|emulated]

Each rank trains benchmarks.reliability's 4-layer MLP (compiled with ``backend="autoscale"``,
wrapped in DDP) on its own batches with autoscale's adaptive GradScaler. At the steps in
``INJECTED`` rank 1 alone writes inf or nan into one layer's activation gradient, and at
``FORWARD_OVERFLOW`` its batch is 1e5 times larger, so that its forward overflows float16 (the cast
of the input): both ranks must promote the same op. Each rank saves to ``OUT/rank{r}.pt``: its
weights, optimizer state, per-layer scales (and promotions) and the steps its scaler skipped.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import autoscale
from benchmarks.reliability import KINDS, LAYERS, WIDTH, Net
from tests.reliability.ranks import join_group, leave, spawn

BATCH = 32
# step -> (layer, mode): modes 1..4 are benchmarks.reliability.KINDS
INJECTED = {3: (1, 1), 7: (3, 2), 8: (0, 3), 12: (2, 4)}
assert all(0 <= layer < LAYERS and 1 <= mode <= len(KINDS) for layer, mode in INJECTED.values())
FORWARD_OVERFLOW = 5


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    return x, (x[:, :4] * 2).argmax(1)


def _worker(rank: int, steps: int, out: Path) -> None:
    join_group(rank, out)
    try:
        _train(rank, steps, out)
        # DDP's reducer holds the process group: free it while the group is alive, and let both
        # ranks finish before either tears the group down
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave()  # (a rank once hung in a destructor after its work was done: ranks.py)


def _train(rank: int, steps: int, out: Path) -> None:
    """The run, its results saved; DDP, the compiled model and the scaler die when it returns."""
    torch.manual_seed(0)
    net = Net()
    # broadcast_buffers=False: the injector's modes buffer is per rank (rank 1 injects alone)
    ddp = DistributedDataParallel(net, broadcast_buffers=False)
    scaler = autoscale.GradScaler(ddp)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    run = torch.compile(ddp, backend=autoscale.backend(autoscale.Config(executor="eager")))
    skipped = []
    for step in range(steps):
        x, y = _batch(rank, step)
        if rank == 1 and step == FORWARD_OVERFLOW:
            x = x * 1e5
        net.modes.zero_()
        if rank == 1 and step in INJECTED:
            layer, mode = INJECTED[step]
            net.modes[layer] = mode
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(run(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        if scaler.skipped_steps > len(skipped):
            skipped.append(step)
    torch.save({"weights": {k: v for k, v in net.state_dict().items() if k != "modes"},
                "optimizer": opt.state_dict(), "scaler": scaler.state_dict(), "skipped": skipped},
               out / f"rank{rank}.pt")


def main(argv: list[str]) -> None:
    steps, out = int(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    spawn(_worker, (steps, out))


if __name__ == "__main__":
    main(sys.argv[1:])
