"""FSDP2 (``fully_shard``) on 2 CPU processes (gloo), with an overflow injected on one rank only:
the script ``test_fsdp.py`` runs.

    python -m tests.reliability.fsdp run MODE OUT        # STEPS steps; adaptive: a checkpoint at CUT
    python -m tests.reliability.fsdp resume MODE OUT CHECKPOINT   # from CHECKPOINT to STEPS

A 4-block model (3 hidden blocks and a head, each a ``Block``), every block ``fully_shard``-ed and
then the root, with autoscale's GradScaler (``MODE``: adaptive or dynamic) created after
``fully_shard`` and each block compiled in place with a backend of its own (the way that works:
docs/reliability.md). Each rank trains on its own batches; at the steps in ``INJECTED`` rank 1
alone writes inf into the first element of one block's output gradient. Each rank saves to
``OUT/rank{r}.pt`` the full (gathered) weights, the scaler's state and per-layer scales, and the
steps its scaler skipped. ``reference`` trains the same model in one process on both ranks'
batches together, for comparison.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import fully_shard

import autoscale
from autoscale.config import ScalingConfig
from tests.reliability.ranks import WORLD, join_group, leave, spawn

BATCH, WIDTH, CLASSES, HIDDEN = 16, 16, 4, 3
STEPS, CUT = 12, 6
INJECTED = {3: 1, 8: 3}  # step -> the block whose output gradient rank 1 alone poisons with inf


class _Inject(torch.autograd.Function):
    """Identity forward; in the backward, inf in the gradient's first element when ``mode`` is 1."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mode: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mode)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (mode,) = ctx.saved_tensors
        first = torch.arange(grad.numel(), device=grad.device).view_as(grad) == 0
        return torch.where(first & (mode == 1), torch.full_like(grad, float("inf")), grad), None


class Block(nn.Module):
    def __init__(self, out: int, relu: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, out)
        self.relu = relu
        self.register_buffer("inject", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return _Inject.apply(F.relu(y) if self.relu else y, self.inject)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([*(Block(WIDTH, True) for _ in range(HIDDEN)), Block(CLASSES, False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(mode: str, *, sharded: bool) -> tuple[Net, autoscale.GradScaler, torch.optim.Optimizer]:
    """The model (``fully_shard``-ed when ``sharded``), its scaler, its optimizer; each block
    compiled with a backend of its own."""
    torch.manual_seed(0)
    net = Net()
    if sharded:
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
    scaling = ScalingConfig(mode=mode)  # type: ignore[arg-type]
    scaler = autoscale.GradScaler(net, scaling)  # after fully_shard: it sees the sharded parameters
    config = autoscale.Config(executor="eager", scaling=scaling, clear=("autograd_function_apply",))
    for block in net.blocks:
        block.compile(backend=autoscale.backend(config))
    return net, scaler, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    return x, (x[:, :CLASSES] * 2).argmax(1)


def train(net: Net, scaler: autoscale.GradScaler, opt: torch.optim.Optimizer, steps: range, *, inject: bool,
          data: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
          at_step_end: Callable[[int, list[int]], None] | None = None) -> list[int]:
    """Train over ``steps`` on ``data(step)``, injecting at ``INJECTED`` if ``inject``; returns the
    steps the scaler skipped (``at_step_end`` gets the step and those so far)."""
    skipped: list[int] = []
    before = scaler.skipped_steps
    for step in steps:
        x, y = data(step)
        for i, block in enumerate(net.blocks):
            block.inject.fill_(int(inject and INJECTED.get(step) == i))  # type: ignore[operator]
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(net(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        if scaler.skipped_steps > before + len(skipped):
            skipped.append(step)
        if at_step_end is not None:
            at_step_end(step, skipped)
    return skipped


def scales(scaler: autoscale.GradScaler) -> dict[str, float]:
    return {layer.name: layer.scale for layer in scaler.layers()}


def reference(mode: str) -> dict[str, Any]:
    """The same model and steps in one process, without FSDP, on both ranks' batches together
    (the injected inf goes into the whole batch's gradient)."""
    net, scaler, opt = build(mode, sharded=False)

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [batch(r, step) for r in range(WORLD)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    skipped = train(net, scaler, opt, range(STEPS), inject=True, data=data)
    return {"weights": {k: v.detach().clone() for k, v in net.state_dict().items()}, "skipped": skipped,
            "scales": scales(scaler), "scaler": scaler.state_dict()}


def _worker(rank: int, phase: str, mode: str, out: Path, checkpoint: Path | None) -> None:
    join_group(rank, out)
    try:
        net, scaler, opt = build(mode, sharded=True)
        start, skipped_before = 0, []
        if phase == "resume":
            assert checkpoint is not None
            model_state, optim_state = get_state_dict(net, opt)
            dcp_load({"model": model_state, "optimizer": optim_state}, checkpoint_id=checkpoint)
            set_state_dict(net, opt, model_state_dict=model_state, optim_state_dict=optim_state)
            saved = torch.load(checkpoint / f"scaler{rank}.pt", weights_only=False)
            scaler.load_state_dict(saved["scaler"])
            start, skipped_before = saved["step"], saved["skipped"]

        def at_step_end(step: int, skipped: list[int]) -> None:
            if phase == "run" and mode == "adaptive" and step + 1 == CUT:
                model_state, optim_state = get_state_dict(net, opt)
                dcp_save({"model": model_state, "optimizer": optim_state}, checkpoint_id=out / "checkpoint")
                torch.save({"scaler": scaler.state_dict(), "step": step + 1, "skipped": list(skipped)},
                           out / "checkpoint" / f"scaler{rank}.pt")

        def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            return batch(rank, step)

        skipped = skipped_before + train(net, scaler, opt, range(start, STEPS), inject=rank == 1, data=data,
                                         at_step_end=at_step_end)
        weights = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
        torch.save({"weights": {k: v.detach().clone() for k, v in weights.items() if isinstance(v, torch.Tensor)},
                    "scaler": scaler.state_dict(), "scales": scales(scaler), "skipped": skipped},
                   out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    leave()


def main(argv: list[str]) -> None:
    phase, mode, out = argv[0], argv[1], Path(argv[2])
    checkpoint = Path(argv[3]) if phase == "resume" else None
    out.mkdir(parents=True, exist_ok=True)
    spawn(_worker, (phase, mode, out, checkpoint))


if __name__ == "__main__":
    main(sys.argv[1:])
