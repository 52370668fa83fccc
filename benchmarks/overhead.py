"""Step-time overhead of per-layer gradient scaling, measured side by side in one process.

    python -m benchmarks.overhead [--quick] [--device cuda]     # writes docs/results/overhead[_cuda].md

Methods, for each model (interleaved rounds, medians):
  (a) autoscale: torch.compile(backend="autoscale") + autoscale.GradScaler (per-layer scales,
      forward overflow checks: DESIGN.md §3.1)
  (a') the same without the forward overflow checks (``OverflowConfig(watch=False)``): what the
      checks cost is a/a'
  (b) the baseline: compiled float16 with torch.amp.GradScaler (one loss scale and its separate
      unscale-and-check pass over the gradients)
  (c) torch.compile (Inductor), float32
  (d) eager, float32
On CUDA, (b) is torch.compile (Inductor) + torch.autocast(float16) + torch.amp.GradScaler, and (a)
runs native float16 GEMMs. On a CPU, (a) and (b) both run autoscale's emulated float16 (float16
storage and rounding, float32 GEMM arithmetic): torch.autocast's float16 would run native half
GEMMs, about 100x slower on this CPU, and would compare emulation with something else. So on CPU
(b) is the same autoscale graph with torch.amp.GradScaler, and the ratio a/b isolates what
per-layer scaling costs over torch.amp's GradScaler on the same mixed-precision graph.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from benchmarks import notes_of
from benchmarks.numerics.tasks import Block


def mlp(quick: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    width, depth, batch = (256, 4, 128) if quick else (512, 6, 256)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)), torch.randn(batch, width), torch.randint(0, 10, (batch,))


def cnn(quick: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    c, size, batch = (16, 16, 32) if quick else (32, 32, 64)
    model = nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
    return model, torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))


class _Classifier(nn.Module):
    """A transformer block (the numerics LM's) with a mean-pooled linear head."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.block, self.head = Block(d, heads), nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).mean(1))


def transformer(quick: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    d, seq, batch = (64, 32, 8) if quick else (128, 64, 16)
    return _Classifier(d, 4), torch.randn(batch, seq, d), torch.randint(0, 10, (batch,))


MODELS: dict[str, Callable[[bool], tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {
    "MLP": mlp, "CNN": cnn, "transformer block": transformer}


class _Autocast(nn.Module):
    """``model`` under torch.autocast(float16): the baseline's forward on CUDA."""

    def __init__(self, model: nn.Module, device: str) -> None:
        super().__init__()
        self.model, self.device = model, device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device, dtype=torch.float16):
            out: torch.Tensor = self.model(x)
        return out.float()


class _NoScaler:
    """The float32 methods' stand-in for a scaler."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def step(self, opt: torch.optim.Optimizer) -> None:
        opt.step()

    def update(self) -> None:
        pass


def _methods(model: nn.Module, device: str) -> dict[str, tuple[Callable[..., Any], Any, nn.Module]]:
    """name -> (callable model, scaler, module that owns the parameters)."""
    a, a0, b, c, d = (copy.deepcopy(model).to(device) for _ in range(5))
    baseline = torch.compile(_Autocast(b, device)) if device == "cuda" else torch.compile(b, backend="autoscale")
    unwatched = autoscale.Config(overflow=autoscale.OverflowConfig(watch=False))
    return {
        "(a) autoscale": (torch.compile(a, backend="autoscale"), None, a),  # scalers made below
        "(a') autoscale, no forward checks": (torch.compile(a0, backend=autoscale.backend(unwatched)), None, a0),
        "(b) compiled fp16 + torch.amp.GradScaler": (baseline, torch.amp.GradScaler(device), b),
        "(c) torch.compile fp32": (torch.compile(c), _NoScaler(), c),
        "(d) eager fp32": (d, _NoScaler(), d),
    }


def _step(run: Callable[..., Any], scaler: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    scaler.scale(F.cross_entropy(run(x), y)).backward()
    scaler.step(opt)
    scaler.update()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(name: str, quick: bool, rounds: int, steps: int, device: str) -> dict[str, float]:
    torch.manual_seed(0)
    model, x, y = MODELS[name](quick)
    x, y = x.to(device), y.to(device)
    methods = _methods(model, device)
    runs: dict[str, tuple[Callable[..., Any], Any, torch.optim.Optimizer]] = {}
    for label, (run, scaler, owner) in methods.items():
        scaler = scaler if scaler is not None else autoscale.GradScaler(run)
        opt = torch.optim.SGD(owner.parameters(), lr=1e-3)
        for _ in range(3):  # compile and warm up
            _step(run, scaler, opt, x, y)
        runs[label] = (run, scaler, opt)
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(rounds):  # interleaved: every method sees the same machine load
        for label, (run, scaler, opt) in runs.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                _step(run, scaler, opt, x, y)
            _sync(device)
            times[label].append((time.perf_counter() - start) / steps)
    return {label: statistics.median(t) for label, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small models (under 2 minutes)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    rounds, steps = 15, 5
    results = {name: measure(name, args.quick, rounds, steps, args.device) for name in MODELS}
    labels = list(next(iter(results.values())))
    lines = ["| model | " + " | ".join(labels) + " | ratio a/b | ratio a'/b |", "|---" * (len(labels) + 3) + "|"]
    ratios, unwatched = [], []
    for name, medians in results.items():
        ratio = medians[labels[0]] / medians[labels[2]]
        ratios.append(ratio)
        unwatched.append(medians[labels[1]] / medians[labels[2]])
        lines.append(f"| {name} | " + " | ".join(f"{medians[k] * 1e3:.2f} ms" for k in labels)
                     + f" | {ratio:.2f} | {unwatched[-1]:.2f} |")
    overall = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    overall_unwatched = math.exp(sum(math.log(r) for r in unwatched) / len(unwatched))
    machine = (torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads")
    text = (f"# Step-time overhead\n\n{__doc__}\nMachine: {machine}, torch {torch.__version__}, "
            f"{'--quick' if args.quick else 'full'} run; median step time over {rounds} interleaved rounds of "
            f"{steps} steps.\n\n" + "\n".join(lines) + f"\n\nGeometric mean of the ratios: a/b {overall:.2f}, "
            f"a'/b {overall_unwatched:.2f}.\n")
    name = "overhead.md" if args.device == "cpu" else f"overhead_{args.device}.md"
    path = Path(__file__).resolve().parent.parent / "docs" / "results" / name
    notes = notes_of(path)
    path.write_text(text + ("\n" + notes if notes else ""))
    print("\n".join(lines))
    print(f"overhead ratio (autoscale / inductor+autocast+GradScaler): {overall:.2f}")


if __name__ == "__main__":
    main()
