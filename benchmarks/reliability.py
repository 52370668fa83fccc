"""Fault injection: inf and nan injected into random layers' gradients and activations while a small
model trains with autoscale's adaptive GradScaler, and what happened on every injected step.

    python -m benchmarks.reliability [--steps N] [--seeds N]     # writes docs/results/reliability.md

The model is a 4-layer MLP on a fixed synthetic classification task, compiled with
``backend="autoscale"`` (eager executor) and trained with Adam. Between every Linear and its
activation sits an injector: at a random ~5% of the steps, one random injector writes inf or nan
into one element of its layer's output (forward) or of the gradient arriving there (backward).
For every injected step the harness checks, against a snapshot taken before it:

* the step was skipped (the injection was **detected**);
* every weight and every optimizer state tensor is bit-identical to before (**not corrupted**);
* only the layers that overflowed had their scale backed off (×0.5 exactly; ×2^-margin when the
  layer overflowed at the step before too, ``adaptive_backoff``); every other layer's
  scale is bit-identical.

A step without injection that is skipped counts as a false alarm. At the end, the injected run is
compared with its twin: the same seed and batches, no injection, and the steps the injected run
skipped left out. If a skipped step costs nothing but its update, the two end alike.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import autoscale
from autoscale.protocol import SCALE_RANGE
from autoscale.update import adaptive_backoff
from benchmarks import write_report

__all__ = ["KINDS", "Report", "run"]

KINDS = ("grad-inf", "grad-nan", "act-inf", "act-nan")  # injector modes 1..4 (0: none)
WIDTH, LAYERS, SAMPLES, BATCH = 16, 4, 512, 32


class _Inject(torch.autograd.Function):
    """Identity, unless ``mode`` says to put inf/nan into the first element of the value (forward,
    modes 3 and 4) or of the arriving gradient (backward, modes 1 and 2)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mode: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mode)
        return _poison(x, mode, 3)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (mode,) = ctx.saved_tensors
        return _poison(grad, mode, 1), None


def _poison(t: torch.Tensor, mode: torch.Tensor, inf_mode: int) -> torch.Tensor:
    first = torch.arange(t.numel(), device=t.device).view_as(t) == 0
    t = torch.where(first & (mode == inf_mode), torch.full_like(t, math.inf), t)
    return torch.where(first & (mode == inf_mode + 1), torch.full_like(t, math.nan), t)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.register_buffer("modes", torch.zeros(LAYERS, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = _Inject.apply(layer(x), self.modes[i])
            if i < LAYERS - 1:
                x = F.relu(x)
        return x


@dataclass
class Report:
    steps: int
    injected: int = 0
    detected: int = 0
    skipped: int = 0
    false_alarms: int = 0
    weights_corrupted: int = 0
    optimizer_corrupted: int = 0
    scales_wrong: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    final_loss: float = math.nan
    clean_loss: float = math.nan
    max_weight_difference: float = math.nan


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(SAMPLES, WIDTH, generator=gen)
    teacher = torch.randn(WIDTH, WIDTH, generator=gen)
    return x, (x @ teacher).argmax(1)


def _train(seed: int, steps: int, inject_rate: float, report: Report | None,
           skip: frozenset[int] = frozenset()) -> tuple[float, nn.Module]:
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = Net()
    scaler = autoscale.GradScaler(model)
    run = torch.compile(model, backend=autoscale.backend(autoscale.Config(executor="eager")))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = _data(seed)
    rng = random.Random(seed)
    flagged_last: set[str] = set()  # the layers that overflowed at the step before
    for step in range(steps):
        if step in skip:
            continue
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % SAMPLES
        kind = None
        if report is not None and step >= 1 and rng.random() < inject_rate:
            layer, kind = rng.randrange(LAYERS), rng.choice(KINDS)
            model.modes[layer] = KINDS.index(kind) + 1
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt_state = copy.deepcopy(opt.state_dict()["state"])
            before = {r.name: (r.scale, r.overflows) for r in scaler.layers()}
        skips = scaler.skipped_steps
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(run(x[idx]), y[idx])).backward()
        scaler.step(opt)
        scaler.update()
        model.modes.zero_()
        skipped = scaler.skipped_steps > skips
        if report is None:
            continue
        report.skipped += skipped
        if skipped:
            report.skipped_steps.append(step)
        if kind is None:
            report.false_alarms += skipped
            flagged_last = set()
            continue
        report.injected += 1
        report.detected += skipped
        report.by_kind[kind] = report.by_kind.get(kind, 0) + 1
        report.weights_corrupted += any(not torch.equal(p, weights[n]) for n, p in model.named_parameters())
        after = opt.state_dict()["state"]
        report.optimizer_corrupted += any(not torch.equal(after[k][f], v) for k, s in opt_state.items()
                                          for f, v in s.items())
        flagged = set()
        for r in scaler.layers():
            scale, overflows = before.get(r.name, (r.scale, r.overflows))
            # halved, or backed off 2^-margin when it overflowed at the step before too
            again = r.name in flagged_last
            factor = adaptive_backoff(scaler.config) if again else scaler.config.backoff_factor
            expected = max(scale * factor, SCALE_RANGE[0]) if r.overflows > overflows else scale
            report.scales_wrong += r.scale != expected
            if r.overflows > overflows:
                flagged.add(r.name)
        flagged_last = flagged
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y)), model


def run(steps: int = 1000, seed: int = 0, inject_rate: float = 0.05) -> Report:
    """One injected run and its clean twin: the same seed and batches, no injection, and the steps
    the injected run skipped left out. If skipping loses nothing, the two end alike."""
    report = Report(steps)
    report.final_loss, injected = _train(seed, steps, inject_rate, report)
    report.clean_loss, clean = _train(seed, steps, 0.0, None, frozenset(report.skipped_steps))
    report.max_weight_difference = max(float((a - b).detach().abs().max())
                                       for a, b in zip(injected.parameters(), clean.parameters(), strict=True))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    reports = [run(args.steps, seed) for seed in range(args.seeds)]
    lines = ["| seed | steps | injected (grad inf / grad nan / act inf / act nan) | detected | skipped "
             "| false alarms | weights corrupted | optimizer state corrupted | scales wrong | final loss | twin's "
             "| max weight difference |",
             "|---" * 12 + "|"]
    for seed, r in enumerate(reports):
        kinds = " / ".join(str(r.by_kind.get(k, 0)) for k in KINDS)
        lines.append(f"| {seed} | {r.steps} | {r.injected} ({kinds}) | {r.detected} | {r.skipped} | {r.false_alarms} "
                     f"| {r.weights_corrupted} | {r.optimizer_corrupted} | {r.scales_wrong} | {r.final_loss:.5f} "
                     f"| {r.clean_loss:.5f} | {r.max_weight_difference:.1e} |")
    table = "\n".join(lines)
    print(table)
    path = Path(__file__).resolve().parent.parent / "docs" / "results" / "reliability.md"
    write_report(path, f"# Reliability: fault injection\n\n{__doc__}\n{table}\n")


if __name__ == "__main__":
    main()
