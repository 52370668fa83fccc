"""Train a small MLP on scikit-learn's bundled digits with ``backend="autoscale"``, next to float32.

    python examples/quickstart.py [--device cuda]

The compiled model runs its forward and backward in float16 where that is safe (GEMMs and the
activations between them) and in float32 where it is not (the loss), with float32 master
weights: the optimizer below is an ordinary float32 optimizer. ``autoscale.GradScaler`` takes
the place of ``torch.amp.GradScaler``: each layer's gradients get their own scale, with no loss
scale to tune. On a CPU, float16 GEMMs are emulated (float16 storage and rounding, float32
arithmetic); on a GPU they run natively.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import autoscale

BATCH, EPOCHS = 64, 8


def data(device: str) -> list[torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    splits = train_test_split(x, y, test_size=6 * BATCH, random_state=0)
    return [t.to(device) for t in splits]


def train(model: nn.Module, run: nn.Module, x: torch.Tensor, y: torch.Tensor,
          scaler: autoscale.GradScaler | None = None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(EPOCHS):
        order = torch.randperm(len(x), generator=gen).to(x.device)
        for i in range(0, len(x) - BATCH + 1, BATCH):  # full batches: one compiled shape
            idx = order[i:i + BATCH]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(run(x[idx]), y[idx])
            if scaler is None:
                loss.backward()
                opt.step()
            else:  # the torch.amp loop, unchanged
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()


@torch.no_grad()
def accuracy(run: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    correct = sum((run(x[i:i + BATCH]).argmax(1) == y[i:i + BATCH]).sum().item() for i in range(0, len(x), BATCH))
    return 100.0 * correct / len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (emulated float16) or cuda (native float16)")
    device = parser.parse_args().device
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    x_train, x_test, y_train, y_test = data(device)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    model = model.to(device)
    fp32 = copy.deepcopy(model)

    start = time.perf_counter()
    train(fp32, fp32, x_train, y_train)
    print(f"float32   : test accuracy {accuracy(fp32, x_test, y_test):.1f}%  ({time.perf_counter() - start:.1f} s)")

    backend = autoscale.backend()  # the same as backend="autoscale", but keeps its reports
    compiled = torch.compile(model, backend=backend)
    scaler = autoscale.GradScaler(compiled)  # instead of torch.amp.GradScaler()
    start = time.perf_counter()
    train(model, compiled, x_train, y_train, scaler)
    acc = accuracy(compiled, x_test, y_test)
    print(f"autoscale : test accuracy {acc:.1f}%  ({time.perf_counter() - start:.1f} s, compiles included), "
          f"{scaler.skipped_steps} steps skipped")
    print(f"parameters stay {next(model.parameters()).dtype}; training graph: {backend.reports[0]}")
    for layer in scaler.layers():
        print(f"  layer {layer.name:>6}: scale 2^{math.log2(layer.scale):g}, "
              f"weight-gradient zeros {layer.zero_rate:.1e}, overflows {layer.overflows}")


if __name__ == "__main__":
    main()
