"""What a training step is made of, per phase: host time, device kernels, the costliest host ops.

    python -m benchmarks.step_profile [--device cuda] [--quick] [--steps N] [-o FILE]
                                      # writes docs/results/step_profile[_cuda].md

For each model of ``benchmarks.overhead`` and its methods (a) autoscale, on CUDA (a'') autoscale
with the scale points in the fused Triton kernel, and (b) the baseline (compiled float16 with
torch.amp.GradScaler), after compiling and warming up: ``--steps`` steps,
each phase (forward with the loss and ``scale()``, backward, ``step()``, ``update()``) under its own
``torch.profiler`` session, so that every event belongs to the phase it ran in. Reported per phase:
the median wall time (the profiler's own cost included, alike for both), the device kernels launched
per step (on CUDA; a launch costs the host a few microseconds, so on small models their number is
the step time), and the host ops with the most self time. Where ``benchmarks.overhead`` says how
much slower a step is, this says of what.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch.profiler import DeviceType, ProfilerActivity, profile

from benchmarks import publish, step_parser
from benchmarks.overhead import A_FUSED, MODELS, PHASES, A, B, _Method, _methods

TOP = 6
T = TypeVar("T")


class _PhaseProfile:
    """One method's phases: wall times, kernels per step, host self time by op (summed)."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {p: [] for p in PHASES}
        self.kernels: dict[str, list[int]] = {p: [] for p in PHASES}
        self.host: dict[str, collections.Counter[str]] = {p: collections.Counter() for p in PHASES}


def _profiled(result: _PhaseProfile, phase: str, fn: Callable[[], T], device: str) -> T:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        result.wall[phase].append(time.perf_counter() - start)
    events = prof.events()
    result.kernels[phase].append(sum(1 for e in events if e.device_type == DeviceType.CUDA
                                     and not e.name.startswith(("Memcpy", "Memset"))))
    for e in events:
        if e.device_type == DeviceType.CPU:
            result.host[phase][e.name] += e.self_cpu_time_total
    return out


def _profile_steps(method: _Method, x: torch.Tensor, y: torch.Tensor, steps: int, device: str) -> _PhaseProfile:
    result = _PhaseProfile()
    for _ in range(steps):
        method.opt.zero_grad(set_to_none=True)
        loss = _profiled(result, "forward", lambda: method.scaler.scale(F.cross_entropy(method.run(x), y)), device)
        _profiled(result, "backward", loss.backward, device)
        _profiled(result, "step", lambda: method.scaler.step(method.opt), device)
        _profiled(result, "update", method.scaler.update, device)
    return result


def measure(name: str, *, quick: bool, steps: int, device: str) -> dict[str, _PhaseProfile]:
    torch.manual_seed(0)
    model, x, y = MODELS[name]("quick" if quick else "full")
    x, y = x.to(device), y.to(device)
    methods = _methods(model, device)
    results = {}
    for label in [label for label in (A, A_FUSED, B) if label in methods]:  # ((a'') on CUDA only)
        for _ in range(3):  # compile and warm up
            methods[label].step(x, y, device=device)
        results[label] = _profile_steps(methods[label], x, y, steps, device)
    return results


def report(results: dict[str, dict[str, _PhaseProfile]], *, quick: bool, steps: int, device: str) -> str:
    lines = ["| model | method | phase | wall (median) | kernels per step "
             "| host ops with the most self time (µs per step) |", "|---|---|---|---|---|---|"]
    for name, methods in results.items():
        for label, r in methods.items():
            for phase in PHASES:
                top = ", ".join(f"`{op}` {us / steps:.0f}" for op, us in r.host[phase].most_common(TOP))
                kernels = statistics.median(r.kernels[phase]) if device == "cuda" else "—"
                wall = statistics.median(r.wall[phase]) * 1e3
                lines.append(f"| {name} | {label.split(' ')[0]} | {phase} | {wall:.2f} ms | {kernels} | {top} |")
    machine = torch.cuda.get_device_name() if device == "cuda" else f"{torch.get_num_threads()} threads"
    return (f"# Step profile{' (--quick)' if quick else ''}\n\n{__doc__}\nMachine: {machine}, torch "
            f"{torch.__version__}, {'--quick' if quick else 'full'} models, {steps} profiled steps per method.\n\n"
            + "\n".join(lines) + "\n")


def main() -> None:
    parser = step_parser(__doc__, "step_profile", "the small models")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per method (default 5)")
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    args = parser.parse_args()
    results = {name: measure(name, quick=args.quick, steps=args.steps, device=args.device) for name in args.models}
    publish(report(results, quick=args.quick, steps=args.steps, device=args.device), "step_profile", args)


if __name__ == "__main__":
    main()
