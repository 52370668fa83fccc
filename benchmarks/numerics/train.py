"""One training run: a task, a method, a seed. Returns everything the report needs, as plain data.

Measured along the way:

* **underflow per layer** (docs/design.md#measures), at ``MEASUREMENTS`` evenly spaced steps: an float32
  eager *shadow* of the model gets the same weights and the same batch; for every weight matrix
  (every parameter of two or more dimensions), the fraction of the entries whose float32 gradient
  is non-zero that the method's gradient has at exactly zero. The method's gradients are taken
  after unscaling, before the optimizer step; a step whose gradients hold inf/nan is not measured
  (it is skipped, or, unscaled float16, it breaks the run);
* **test accuracy and loss** at ``EVALUATIONS`` points, on the held-out set, with the float32
  master weights in eager float32 (evaluation is not what the methods differ in);
* **skipped steps**, and the **scale** after every step (the loss scale; for adaptive, each
  layer's);
* **wall time** of the training loop (compile included), without the measurements.

Every method trains with Adam (``eps`` divided by the task's loss divisor, see ``tasks``) and a
cosine learning-rate decay to 0 over the run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
from torch import nn

import autoscale

from .methods import Method
from .tasks import Task

__all__ = ["MEASUREMENTS", "RunResult", "run", "underflow_rates"]

MEASUREMENTS, EVALUATIONS = 10, 10


@dataclass
class RunResult:
    """One run, as JSON-friendly data."""

    task: str
    method: str
    seed: int
    steps: int
    accuracy: float  # final test accuracy, %
    test_loss: float  # final test loss (cross-entropy per example or per character, not divided)
    curve: list[tuple[int, float, float]]  # (step, test accuracy %, test loss)
    layers: list[str]  # the measured weight matrices, in model order
    underflow: list[tuple[int, list[float]]]  # (step, per-layer rate; nan where float32 has no signal)
    lost_signal: list[tuple[int, list[float]]]  # (step, per-layer share of the float32 gradient's L1 norm lost)
    skipped: list[int]  # steps (1-based) whose optimizer step was skipped
    nonfinite: int  # steps whose gradients held inf/nan (the skipped ones, or, unscaled, the applied ones)
    scales: list[float] = field(default_factory=list)  # loss scale after each step (nan for fp32 / fp16)
    layer_scales: dict[str, list[float]] = field(default_factory=dict)  # adaptive: each layer's, per step
    seconds: float = 0.0


class _Loss(nn.Module):
    """The model and the task's loss as one module, so the loss is in the compiled graph (the
    analysis then sees the whole backward, the loss' divisor included)."""

    def __init__(self, model: nn.Module, task: Task) -> None:
        super().__init__()
        self.model, self.task = model, task

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.task.loss(self.model(x), y)


def underflow_rates(grads: list[torch.Tensor | None], reference: list[torch.Tensor | None]
                    ) -> tuple[list[float], list[float]]:
    """Per tensor: of the entries whose reference (float32) gradient is non-zero, the fraction that
    are exactly zero in ``grads`` (the underflow rate), and those entries' share of the reference's
    L1 norm (the lost magnitude); nan where the reference has no non-zero entry."""
    rates, lost = [], []
    for g, r in zip(grads, reference, strict=True):
        if g is None or r is None or not bool((r != 0).any()):
            rates.append(math.nan)
            lost.append(math.nan)
            continue
        signal = r != 0
        gone = (g == 0) & signal
        rates.append(float(gone.sum() / signal.sum()))
        lost.append(float(r.abs()[gone].double().sum() / r.abs().double().sum()))
    return rates, lost


@torch.no_grad()
def _evaluate(model: nn.Module, task: Task, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    was = model.training
    model.eval()
    correct = total = 0
    loss = 0.0
    for i in range(0, len(x), 256):
        logits = model(x[i:i + 256])
        target = y[i:i + 256]
        loss += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                       reduction="sum"))
        correct += int((logits.argmax(-1) == target).sum())
        total += target.numel()
    model.train(was)
    return 100.0 * correct / total, loss / total


def _batches(n: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """``steps`` index batches: epochs of a seeded permutation, full batches only (one shape)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    while len(out) < steps:
        order = torch.randperm(n, generator=gen)
        out += [order[i:i + batch] for i in range(0, n - batch + 1, batch)]
    return out[:steps]


def _scale_of(scaler: Any) -> float:
    return float(scaler.get_scale()) if scaler is not None else math.nan


def run(task: Task, method: Method, seed: int, *, quick: bool = False) -> RunResult:
    """Train ``task`` with ``method`` from ``seed`` (which fixes the initial weights and the batch
    order: every method of a seed starts from the same weights and sees the same batches)."""
    steps = task.quick_steps if quick else task.steps
    data = task.data()
    model = task.model(seed)
    shadow = task.model(seed)  # float32 eager twin for the underflow reference
    weights = [n for n, p in model.named_parameters() if p.dim() >= 2]
    opt = torch.optim.Adam(model.parameters(), lr=task.lr, eps=1e-8 / task.loss_divisor)
    # Decayed to 0 over the run, for every method alike: the final accuracy is then the end of a
    # converged run, not a snapshot of a curve that still oscillates by a few points.
    lr_decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)

    torch._dynamo.reset()
    loss_module = _Loss(model, task)
    scaler = method.scaler(loss_module)
    step_fn: nn.Module = loss_module
    if method.float16:
        step_fn = torch.compile(loss_module, backend=method.backend())  # type: ignore[assignment]

    measure_at = {max(1, round(steps * (i + 1) / MEASUREMENTS)) for i in range(MEASUREMENTS)} | {1}
    eval_at = {max(1, round(steps * (i + 1) / EVALUATIONS)) for i in range(EVALUATIONS)}
    result = RunResult(task.name, method.name, seed, steps, 0.0, 0.0, [], weights, [], [], [], 0)
    batches = _batches(len(data.x_train), task.batch, steps, seed)
    spent = 0.0
    for step, idx in enumerate(batches, start=1):
        x, y = data.x_train[idx], data.y_train[idx]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = step_fn(x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        spent += time.perf_counter() - start

        params = dict(model.named_parameters())
        grads = [params[n].grad for n in weights]
        finite = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        result.nonfinite += not finite
        if step in measure_at and finite:
            rates, lost = underflow_rates(grads, _shadow_grads(shadow, model, task, x, y, weights))
            result.underflow.append((step, rates))
            result.lost_signal.append((step, lost))

        start = time.perf_counter()
        before = _scale_of(scaler)
        skipped_before = scaler.skipped_steps if isinstance(scaler, autoscale.GradScaler) else 0
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        lr_decay.step()
        spent += time.perf_counter() - start
        if isinstance(scaler, autoscale.GradScaler):
            skipped = scaler.skipped_steps > skipped_before
            for layer in scaler.layers():
                result.layer_scales.setdefault(layer.name, []).append(layer.scale)
        else:  # torch.amp backs its scale off exactly on the steps it skips
            skipped = scaler is not None and _scale_of(scaler) < before
        if skipped:
            result.skipped.append(step)
        result.scales.append(_scale_of(scaler))
        if step in eval_at:
            acc, test_loss = _evaluate(model, task, data.x_test, data.y_test)
            result.curve.append((step, acc, test_loss))
    result.seconds = spent
    result.accuracy, result.test_loss = result.curve[-1][1], result.curve[-1][2]
    return result


def _shadow_grads(shadow: nn.Module, model: nn.Module, task: Task, x: torch.Tensor, y: torch.Tensor,
                  names: list[str]) -> list[torch.Tensor | None]:
    """The float32 eager gradients of this step's weights, on the same batch."""
    shadow.load_state_dict(model.state_dict())
    shadow.train(model.training)
    shadow.zero_grad(set_to_none=True)
    task.loss(shadow(x), y).backward()
    params = dict(shadow.named_parameters())
    return [params[n].grad for n in names]
