"""Forward overflow: float32, torch.amp and autoscale side by side on models whose forward leaves
float16's range.

    python -m benchmarks.forward_overflow [--seeds N] [--quick]     # writes docs/results/forward_overflow.md

Methods (each seed: the same initial weights and batches for all three):
  float32    eager float32;
  torch.amp  eager, torch.autocast("cpu", float16) + torch.amp.GradScaler (its defaults);
  autoscale  torch.compile(backend="autoscale") + autoscale.GradScaler, defaults (Inductor).
On this CPU torch.autocast computes its float16 ops natively (slow, but these models are small);
autoscale emulates float16 (float16 storage and rounding, float32 GEMM arithmetic): both overflow
where a float16 GPU would.

Cases (``benchmarks/overflow_models.py``):
  (a) ``T5``: a T5 v1.1-style encoder-decoder (3+3 layers, d_model 64, d_ff 256, gated GELU,
      no dropout) whose feed-forward outputs reach ~7e4 in float32 from the first step; AdamW
      lr 1e-3, 30 steps on one batch. The prediction path: the analysis sees it at compile time.
  (b) ``Drifting``: a regressor whose output layer grows while it learns large targets and
      passes 65504 after ~95 steps; Adam lr 1e-2, 200 steps on one batch. The run-time path: by
      default autoscale promotes the layer once its output passes half of 65504, before it
      overflows; (b, late) is the same with ``OverflowConfig(threshold=1.0)``, which waits for the
      overflow itself, as when a value jumps past 65504 in one step.
  (c) ``LogOfZero``: log(relu(.)) of a layer with dead units: non-finite in float32 too.

Columns: non-finite losses and skipped steps (of the run's steps), recompiles (autoscale's, after the
first compile), the final loss and its gap to float32's relative to the initial loss, and the ops
autoscale computes in float32 because of forward overflow (predicted at compile time or promoted at
run time). For (c), what each method did.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch import nn

import autoscale
from benchmarks import machine_line, write_report
from benchmarks.overflow_models import T5, Drifting, LogOfZero, drifting_batch, t5_batch

__all__ = ["CASES", "Case", "RunResult", "run"]

log = logging.getLogger("benchmarks.forward_overflow")

METHODS = ("float32", "torch.amp", "autoscale")


@dataclass(frozen=True)
class Case:
    """A model, its batch and how to train it: ``make(seed)`` returns the model and its inputs
    (the model returns the loss)."""

    name: str
    title: str
    make: Callable[[int], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    steps: int
    config: autoscale.Config = field(default_factory=autoscale.Config)  # autoscale's


def _t5(seed: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return T5(ff_gain=28.0), t5_batch(seed)


def _drifting(seed: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return Drifting(), drifting_batch(seed)


def _log_of_zero(seed: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    return LogOfZero(), (torch.randn(32, 16, generator=g), torch.randn(32, generator=g))


CASES: dict[str, Case] = {
    "a": Case("a", "(a) T5 v1.1-style, feed-forward outputs above 65504 from the first step", _t5,
              lambda p: torch.optim.AdamW(p, lr=1e-3), 30),
    "b": Case("b", "(b) regressor whose output layer grows past 65504 during training", _drifting,
              lambda p: torch.optim.Adam(p, lr=1e-2), 200),
    "B": Case("B", "(b, late) the same regressor, autoscale repairing only what has overflowed "
                   "(OverflowConfig(threshold=1.0): no early promotion)", _drifting,
              lambda p: torch.optim.Adam(p, lr=1e-2), 200,
              autoscale.Config(overflow=autoscale.OverflowConfig(threshold=1.0))),
    "c": Case("c", "(c) log of a ReLU with dead units: non-finite in float32 too", _log_of_zero,
              lambda p: torch.optim.Adam(p, lr=1e-3), 10),
}


@dataclass
class RunResult:
    case: str
    method: str
    seed: int
    losses: list[float] = field(default_factory=list)
    skipped: int = 0
    recompiles: int = 0
    promoted: list[str] = field(default_factory=list)  # "key (step N)"
    predicted: list[str] = field(default_factory=list)  # layers with an op kept in float32 at compile time
    stopped: str = ""  # the error that ended the run, if any
    final_scale: float = math.nan  # torch.amp's loss scale at the end
    seconds: float = 0.0

    @property
    def nonfinite(self) -> int:
        return sum(not math.isfinite(x) for x in self.losses)


def _adam_steps(opt: torch.optim.Optimizer) -> int:
    """How many updates Adam(W) has made: its step counter advances only when it steps, so this
    counts torch.amp's skips without its private API (its scale stops falling once it reaches 0)."""
    state = opt.state.get(opt.param_groups[0]["params"][0], {})
    return int(state["step"]) if "step" in state else 0


def run(case: Case, method: str, seed: int) -> RunResult:
    """Train ``case`` with ``method`` from ``seed``'s initial weights and batch."""
    torch._dynamo.reset()
    model, inputs = case.make(seed)
    result = RunResult(case.name, method, seed)
    opt = case.optimizer(model.parameters())
    start = time.perf_counter()
    if method == "float32":
        for _ in range(case.steps):
            opt.zero_grad(set_to_none=True)
            loss = model(*inputs)
            loss.backward()
            opt.step()
            result.losses.append(float(loss.detach()))
    elif method == "torch.amp":
        amp = torch.amp.GradScaler("cpu")
        for _ in range(case.steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(*inputs)
            amp.scale(loss).backward()
            amp.step(opt)
            amp.update()
            result.losses.append(float(loss.detach()))
        result.skipped = case.steps - _adam_steps(opt)
        result.final_scale = amp.get_scale()
    else:
        backend = autoscale.backend(case.config)
        scaler = autoscale.GradScaler(model, case.config)
        compiled = torch.compile(model, backend=backend)
        try:
            for _ in range(case.steps):
                opt.zero_grad(set_to_none=True)
                loss = compiled(*inputs)
                result.losses.append(float(loss.detach()))
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        except autoscale.NonFiniteForwardError as e:
            result.stopped = str(e)
        result.skipped = scaler.skipped_steps
        result.recompiles = len(backend.records) - 1
        result.promoted = [f"{p.key} (step {p.step})" for p in scaler.promotions()]
        result.predicted = sorted({r.name for r in scaler.layers()
                                   if any(op.endswith("predicted") for op in r.float32_ops)})
    result.seconds = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------------- report


def _gap(r: RunResult, ref: RunResult) -> float:
    """|final loss - float32's| relative to the initial loss (nan when either is not finite)."""
    if not r.losses or not math.isfinite(r.losses[-1]) or not math.isfinite(ref.losses[-1]):
        return math.nan
    return abs(r.losses[-1] - ref.losses[-1]) / abs(ref.losses[0])


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.4g}"


def markdown(results: list[RunResult], *, seeds: int, machine: str, minutes: float) -> str:
    lines = [f"Seeds: {seeds}. Machine: {machine}. Wall time: {minutes:.1f} min.", ""]
    for case in CASES.values():
        rows = [r for r in results if r.case == case.name]
        if not rows:
            continue
        steps = case.steps
        lines += [f"### {case.title}", "",
                  f"{steps} steps per run. Per method: mean over seeds (per-seed values in brackets).", "",
                  "| method | non-finite losses | skipped steps | recompiles | final loss | gap to float32 "
                  "(of initial loss) | stopped | seconds (compiles included) |",
                  "|---|---|---|---|---|---|---|---|"]
        ref = {r.seed: r for r in rows if r.method == "float32"}
        for method in METHODS:
            runs = [r for r in rows if r.method == method]
            if not runs:
                continue
            finals = [r.losses[-1] if r.losses else math.nan for r in runs]
            gaps = [_gap(r, ref[r.seed]) for r in runs]
            stopped = [f"step {len(r.losses)}" if r.stopped else "-" for r in runs]
            lines.append(
                f"| {method} | {_each([r.nonfinite for r in runs])} | {_each([r.skipped for r in runs])} | "
                f"{_each([r.recompiles for r in runs]) if method == 'autoscale' else '-'} | {_each(finals)} | "
                f"{_each(gaps)} | {', '.join(stopped)} | {_each([r.seconds for r in runs])} |")
        amp = [r for r in rows if r.method == "torch.amp"]
        if amp:
            lines.append(f"\ntorch.amp's loss scale at the end: {', '.join(f'{r.final_scale:.3g}' for r in amp)}")
        ours = [r for r in rows if r.method == "autoscale"]
        for r in ours:
            what = []
            if r.predicted:
                what.append("kept in float32 at compile time (predicted): " + ", ".join(r.predicted))
            if r.promoted:
                what.append("promoted at run time: " + ", ".join(r.promoted))
            if r.stopped:
                what.append(f"stopped: `{r.stopped}`")
            lines.append(f"\nautoscale, seed {r.seed}: " + ("; ".join(what) if what else "nothing kept in float32"))
        lines.append("")
    return "\n".join(lines)


def _each(values: list[float] | list[int]) -> str:
    finite = [float(v) for v in values if math.isfinite(float(v))]
    mean = statistics.fmean(finite) if len(finite) == len(values) else math.nan
    return f"{_fmt(mean)} [{', '.join(_fmt(float(v)) for v in values)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--cases", default="abBc", help="which cases to run (default: abBc)")
    parser.add_argument("-o", "--output", type=Path, default=Path("docs/results/forward_overflow.md"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    start = time.perf_counter()
    results = []
    for name in args.cases:
        for seed in range(args.seeds):
            for method in METHODS:
                r = run(CASES[name], method, seed)
                log.warning("case %s seed %d %s: losses %s ... %s, skipped %d, recompiles %d, %.0f s", name, seed,
                            method, _fmt(r.losses[0]) if r.losses else "-", _fmt(r.losses[-1]) if r.losses else "-",
                            r.skipped, r.recompiles, r.seconds)
                results.append(r)
    machine = machine_line()
    body = markdown(results, seeds=args.seeds, machine=machine, minutes=(time.perf_counter() - start) / 60)
    write_report(args.output, f"# Forward overflow: float32, torch.amp and autoscale\n\n{__doc__}\n{body}\n")
    print(body)


if __name__ == "__main__":
    main()
