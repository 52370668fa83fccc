"""Per-layer weight-gradient underflow on the stress MLP: adaptive vs one global scale vs torch.amp.

    python -m benchmarks.stress_underflow        # writes docs/results/scaling.md

The stress model is 32 x (Linear(64, 64) + ReLU) + Linear(64, 10) with PyTorch's default init,
batch 32, cross-entropy, float16 emulated on CPU. Underflow of a layer = fraction of its weight-
gradient entries that are zero where the float32 eager gradient of the same step is not. The
learning rate is 0 so every step is the same step, and each method gets the same warm-up.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from benchmarks import write_report

DEPTH, WIDTH, BATCH = 32, 64, 32


def stress_model(seed: int = 0, device: str = "cpu") -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 10)).to(device)
    return model, torch.randn(BATCH, WIDTH, device=device), torch.randint(0, 10, (BATCH,), device=device)


def underflow_rates(model: nn.Module, reference: nn.Module) -> list[float]:
    rates = []
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if name.endswith("weight"):
            signal = q.grad != 0
            rates.append(float(((p.grad == 0) & signal).sum() / signal.sum().clamp_min(1)))
    return rates


def run(method: str, *, steps: int, seed: int = 0, device: str = "cpu") -> dict[str, object]:
    """``steps`` identical steps of one method ("adaptive", "torch.amp", "paper") on the stress
    model; returns the per-layer rates of the last step and the number of skipped steps."""
    model, x, y = stress_model(seed, device)
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    torch._dynamo.reset()
    scaler: Any = {
        "adaptive": lambda: autoscale.GradScaler(model),
        "paper": lambda: autoscale.GradScaler(model, autoscale.ScalingConfig(rule="paper")),
        "torch.amp": lambda: torch.amp.GradScaler(device),
    }[method]()
    executor = "eager" if device == "cpu" else "inductor"  # on a GPU: native float16, Inductor
    compiled = torch.compile(model, backend=autoscale.backend(autoscale.Config(executor=executor)))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scales = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(compiled(x), y)).backward()
        scaler.unscale_(opt)
        rates = underflow_rates(model, reference)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    skipped = scaler.skipped_steps if isinstance(scaler, autoscale.GradScaler) else sum(
        b < a for a, b in zip(scales, scales[1:], strict=False))  # torch.amp: every back-off is a skip
    return {"rates": rates, "skipped": skipped}


def best_global_scale() -> tuple[float, list[float]]:
    """The largest power-of-two loss scale whose step has no inf/nan, and its per-layer rates."""
    model, x, y = stress_model()
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    torch._dynamo.reset()
    scaler = autoscale.GradScaler(model, autoscale.ScalingConfig(mode="static"))
    compiled = torch.compile(model, backend=autoscale.backend(autoscale.Config(executor="eager")))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for exponent in range(40, -1, -1):
        scaler.update(new_scale=2.0**exponent)
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(compiled(x), y)).backward()
        scaler.unscale_(opt)
        if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            return 2.0**exponent, underflow_rates(model, reference)
        scaler.update()
    raise RuntimeError("no finite loss scale")


def table(rows: dict[str, list[float]]) -> str:
    lines = ["| method | max layer underflow | mean | layers above 1e-3 | first layer |", "|---|---|---|---|---|"]
    for name, rates in rows.items():
        lines.append(f"| {name} | {max(rates):.2e} | {sum(rates) / len(rates):.2e} | "
                     f"{sum(r > 1e-3 for r in rates)} of {len(rates)} | {rates[0]:.2e} |")
    return "\n".join(lines)


def measure(warmup: int = 24) -> dict[str, list[float]]:
    scale, best = best_global_scale()
    rows = {f"best global scale (2^{int(torch.log2(torch.tensor(scale)))})": best}
    for method, label in (("torch.amp", "torch.amp.GradScaler"), ("paper", 'autoscale adaptive, rule="paper"'),
                          ("adaptive", "autoscale adaptive (default)")):
        for steps in (1, warmup):
            result = run(method, steps=steps)
            rows[f"{label}, step {steps}, {result['skipped']} skipped"] = result["rates"]  # type: ignore[assignment]
    return rows


def main() -> None:
    rows = measure()
    text = table(rows)
    print(text)
    out = Path(__file__).resolve().parent.parent / "docs" / "results" / "scaling.md"
    write_report(out, "# Per-layer gradient scaling on the stress MLP\n\n" + (__doc__ or "") + "\n" + text + "\n")


if __name__ == "__main__":
    main()
