"""Train, stop, save, resume in a new process: the script ``test_resume.py`` runs.

    python -m tests.reliability.resume run STEPS OUT            # STEPS steps from scratch
    python -m tests.reliability.resume stop STEPS CHECKPOINT    # STEPS steps, then save everything
    python -m tests.reliability.resume resume STEPS CHECKPOINT OUT

``CHECKPOINT`` and ``OUT`` receive the model, optimizer and scaler state and the step count.
Every batch is drawn from a generator seeded with its step number, so a resumed run sees the
batches the uninterrupted one saw.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import autoscale

BATCH, WIDTH = 32, 24


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 48), nn.ReLU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 6))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    return x, (x[:, :6] * 3).argmax(1)


def main(argv: list[str]) -> None:
    mode, steps, path = argv[0], int(argv[1]), Path(argv[2])
    model = _model()
    scaler = autoscale.GradScaler(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = 0
    if mode == "resume":
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start = state["step"]
    run = torch.compile(model, backend=autoscale.backend(autoscale.Config(executor="eager")))
    for step in range(start, start + steps):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(run(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
             "step": start + steps}
    torch.save(state, path if mode == "stop" else Path(argv[-1]))


if __name__ == "__main__":
    main(sys.argv[1:])
