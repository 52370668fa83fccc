"""Step-time overhead of per-layer gradient scaling, measured side by side in one process.

    python -m benchmarks.overhead [--tiny | --quick | --large] [--runs N] [--device cuda] [-o FILE]
                                  # writes docs/results/overhead[_tiny|_quick|_large][_cuda].md
    python -m benchmarks.overhead --inductor combo_kernels=True -o FILE [...]
                                  # every method compiled with an Inductor option (repeatable)
    python -m benchmarks.overhead --measure-every M -o FILE [...]
                                  # (a) and (a') measure their gradients every M steps only
                                  # (ScalingConfig.measure_every); each round then times a whole
                                  # number of M-step periods, so that every timed window holds
                                  # its share of measured steps; (a1) is (a) measuring every step
    python -m benchmarks.overhead --measure-every 0 -o FILE [...]
                                  # the floor: (a) and (a') measure their first step only, and
                                  # every step timed runs the graph whose points only multiply and
                                  # check, without forward checks: what per-layer scaling's
                                  # structure costs a step, measuring nothing; (a1) as above
    python -m benchmarks.overhead --system-heap -o FILE [...]
                                  # glibc's heap as it is, returning freed memory to the system

Sizes: ``--quick`` (2-3 ms steps on the 2-core CPU), the default (full), and ``--large``, for a GPU
only. On a GPU the full models' steps are bound by the host's kernel launches: an H200 runs their
arithmetic in a fraction of the ~3 ms the host takes to launch it. ``--large`` gives each step
several times that in GEMMs and convolutions (on the order of 10 ms of an H200's float16 work), which
is the regime real training runs in. ``--tiny`` shrinks the same architectures until their
arithmetic is negligible (16 wide, a batch of 2): a step then takes what it costs besides its
arithmetic, the compiled wrappers' Python, the guards, the scaler's calls (on a GPU, the
launches), which is part of every step whatever the model's size, and which a ratio of small
steps mixes with their arithmetic. Its report gives step times in µs.

Every report also gives what each method adds a step over (b), in µs.

Methods, for each model (interleaved rounds, medians):
  (a) autoscale: torch.compile(backend="autoscale") + autoscale.GradScaler (per-layer scales,
      forward overflow checks: docs/design.md#forward-overflow)
  (a') the same without the forward overflow checks (``OverflowConfig(watch=False)``): what the
      checks cost is a/a'
  (a'') on CUDA only: (a) with the scale points in the fused Triton kernel
      (``ScalingConfig(point_kernel="fused")``) instead of Inductor's kernels
  (a1) with ``--measure-every M`` only, which gives (a) and (a') that option: (a) as it is by
      default, measuring every step, so that what the option buys is a/b against a1/b, timed side
      by side (such a run leaves out (a''), (c) and (d), to compile less)
  (b) the baseline: compiled float16 with torch.amp.GradScaler (one loss scale and its separate
      unscale-and-check pass over the gradients)
  (b') the same baseline again, a second copy of the model compiled alike: the A/A control,
      what a/b is to be read against (how far apart two copies of one method time)
  (c) torch.compile (Inductor), float32 (not with ``--large``)
  (d) eager, float32 (not with ``--large``)
On CUDA, (b) is torch.compile (Inductor) + torch.autocast(float16) + torch.amp.GradScaler, and (a)
runs native float16 GEMMs. On a CPU, (a) and (b) both run autoscale's emulated float16 (float16
storage and rounding, float32 GEMM arithmetic): torch.autocast's float16 would run native half
GEMMs, about 100x slower on this CPU, and would compare emulation with something else. So on CPU
(b) is the same autoscale graph with torch.amp.GradScaler, and the ratio a/b isolates what
per-layer scaling costs over torch.amp's GradScaler on the same mixed-precision graph.

Every step is the torch.amp loop (zero_grad, forward and loss under ``scale``, backward, ``step``,
``update``) with plain SGD. Each run makes a fresh copy of the model for every method, compiles
them, and measures every method in interleaved rounds (every method sees the same machine load),
reporting the median step; ``--runs`` repeats that, and the ratios are given per run and as their
median. Each method's turn starts with an untimed step (a training loop runs one model, warm).
Two orders are balanced, because each moved the A/A control by 1-3%, as much as a/b is from 1:
* Each round takes the methods in another order, from a design in which every method takes every
  position, and comes right after every other method, equally often (``balanced_orders``): a
  method's time depends on the method run just before it. Rotating one order from round to
  round, as this benchmark did until 2026-11-28, kept every method's predecessor: (b') came
  right after (b) in every round, and the A/A control read 0.976-0.993 in thirteen ``--quick``
  invocations out of thirteen (1.022 and 1.027 in two with the order reversed; 1.001 and 0.998 in
  two with every round shuffled at random).
* The copies are made and compiled in the order of the list above, and in the reverse order on
  every other run (so ``--runs`` is even by default): with the rounds balanced, the A/A control
  still read 1.011 and 1.009 in two invocations with the copies made once, in that order;
  alternating, 1.005 and 1.008 in two.
Every method compiles afresh, with Inductor's and AOTAutograd's caches off: a copy whose graph the
caches served, after another copy had compiled it in the same process, timed 2-3% faster (the A/A
control read 0.97 in every run; with the caches off, 0.99-1.00).
On a CPU the process's C heap keeps the memory the steps free (``benchmarks.heap``), as a caching
allocator does (PyTorch's on a GPU; jemalloc or tcmalloc on a CPU), so that no step faults its
buffers' pages in afresh. glibc's heap returns memory to the system by heuristics that follow the
process's history of allocations: in a probe timing two of these methods, the full CNN's steps
took 1,600-6,000 page faults each (about 2.2 ms of torch.amp's 17.6 ms), the methods hundreds to
thousands apart; in this benchmark's runs the compiled methods took none. Each method's page
faults a step are reported; ``--system-heap`` leaves glibc's heap as it is (as every run before
2026-11-28 did).
Also reported: the median time of each phase of a step (what a difference is made of; on a GPU,
timed in separate steps with a sync between phases, which the timed steps do not have), and the
host's reads of device values in a steady-state ``step()`` + ``update()`` (each is a sync on a GPU;
``benchmarks.host_reads``), with the timed plain SGD and with fused SGD (torch.amp's
``found_inf`` protocol).
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import gc
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from benchmarks import Autocast, Size, publish, size_of, step_parser
from benchmarks.heap import page_faults, retain_freed_memory
from benchmarks.host_reads import HostReads
from benchmarks.numerics.tasks import Block

PHASES = ("forward", "backward", "step", "update")
A, A_UNWATCHED, B = "(a) autoscale", "(a') autoscale, no forward checks", "(b) compiled fp16 + torch.amp.GradScaler"
A_FUSED = "(a'') autoscale, points in the fused Triton kernel"
A_EVERY = "(a1) autoscale, measuring every step"
B_AGAIN = "(b') the same, a second copy"
C, D = "(c) torch.compile fp32", "(d) eager fp32"
ORDER = (A, A_UNWATCHED, B, B_AGAIN, C, D, A_FUSED, A_EVERY)
"""The methods in the order of the docstring's list, which is the report's."""
HEAP_KEPT, HEAP_SYSTEM, HEAP_NOT_GLIBC = "kept", "system", "not glibc"
HEAPS = {HEAP_KEPT: "the C heap keeping what the steps free (`benchmarks.heap`)",
         HEAP_SYSTEM: "glibc's heap as it is (`--system-heap`)",
         HEAP_NOT_GLIBC: "the C heap as it is (not glibc's: `benchmarks.heap` could not keep it)"}
"""Which C heap the steps allocated from, as the report's machine line says it."""
RATIOS = ((A, "a/b"), (A_UNWATCHED, "a'/b"), (A_FUSED, "a''/b"), (A_EVERY, "a1/b"), (B_AGAIN, "b'/b"))
"""(method, column): the ratios of each method's step over (b)'s."""
FLOOR = 2**62
"""``ScalingConfig.measure_every`` for ``--measure-every 0``: no step after the first measures (but
one after a skipped step, which these steps do not have)."""


def mlp(size: Size) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    width, depth, batch = {"tiny": (16, 4, 2), "quick": (256, 4, 128), "full": (512, 6, 256),
                           "large": (4096, 8, 8192)}[size]
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)), torch.randn(batch, width), torch.randint(0, 10, (batch,))


def cnn(size: Size) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return conv_net(*{"tiny": (16, 4, 2), "quick": (16, 16, 32), "full": (32, 32, 64), "large": (128, 128, 128)}[size])


def conv_net(channels: int, side: int, batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Two 3x3 convolutions of ``channels`` with batch norms, pooled into a linear head, and a batch
    of ``side``-pixel images with their labels."""
    model = nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))
    return model, torch.randn(batch, 3, side, side), torch.randint(0, 10, (batch,))


class _Classifier(nn.Module):
    """A transformer block (the numerics LM's) with a mean-pooled linear head."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.block, self.head = Block(d, heads), nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).mean(1))


def transformer(size: Size) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    d, heads, seq, batch = {"tiny": (16, 2, 4, 2), "quick": (64, 4, 32, 8), "full": (128, 4, 64, 16),
                            "large": (2048, 16, 1024, 16)}[size]
    return _Classifier(d, heads), torch.randn(batch, seq, d), torch.randint(0, 10, (batch,))


MODELS: dict[str, Callable[[Size], tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {
    "MLP": mlp, "CNN": cnn, "transformer block": transformer}


class _NoScaler:
    """The float32 methods' stand-in for a scaler."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def step(self, opt: torch.optim.Optimizer) -> None:
        opt.step()

    def update(self) -> None:
        pass


class _Method:
    """One way to train the model: the callable, its scaler and its (plain SGD) optimizer."""

    def __init__(self, run: Callable[..., Any], scaler: Any, owner: nn.Module) -> None:
        self.run, self.owner = run, owner
        self.scaler = scaler if scaler is not None else autoscale.GradScaler(cast(nn.Module, run))
        self.opt = torch.optim.SGD(owner.parameters(), lr=1e-3)

    def step(self, x: torch.Tensor, y: torch.Tensor, phases: dict[str, list[float]] | None = None,
             device: str = "cpu") -> None:
        opt, scaler = self.opt, self.scaler
        sync = device if phases is not None else "cpu"  # (no sync between phases in a timed step)
        opt.zero_grad(set_to_none=True)
        t0 = _synced(sync)
        loss = scaler.scale(F.cross_entropy(self.run(x), y))
        t1 = _synced(sync)
        loss.backward()
        t2 = _synced(sync)
        scaler.step(opt)
        t3 = _synced(sync)
        scaler.update()
        t4 = _synced(sync)
        if phases is not None:
            for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                phases[name].append(seconds)

    def host_reads(self, x: torch.Tensor, y: torch.Tensor, *, fused: bool) -> int:
        """Host reads in a steady-state step() + update(), with plain or fused SGD (after 2 warm-up steps)."""
        saved = self.opt
        self.opt = torch.optim.SGD(self.owner.parameters(), lr=1e-3, fused=fused)
        try:
            for _ in range(2):
                self.step(x, y)
            opt, scaler = self.opt, self.scaler
            opt.zero_grad(set_to_none=True)
            scaler.scale(F.cross_entropy(self.run(x), y)).backward()
            with HostReads(exempt=scaler if isinstance(scaler, autoscale.GradScaler) else None) as reads:
                scaler.step(opt)
                scaler.update()
            return reads.count
        finally:
            self.opt = saved


def _synced(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _methods(model: nn.Module, device: str, *, references: bool = True, reverse: bool = False,
             measure_every: int = 1) -> dict[str, _Method]:
    """The methods timed on ``model`` (the module's docstring), each on a copy of its own, in the
    order the copies were made: the docstring's, or its reverse with ``reverse``. ``references``:
    with the float32 ones, (c) and (d), which are no part of a/b (``--large`` leaves them out: in
    float32 its steps take ten times as long). ``measure_every``: autoscale's
    ``ScalingConfig.measure_every`` for (a) and (a'), 0 for ``FLOOR``; other than 1, (a1) in place
    of (a''), (c) and (d)."""

    def autoscale_on(config: autoscale.Config | None) -> Callable[[nn.Module], _Method]:
        scaling = None
        if measure_every != 1:
            config = config or autoscale.Config()
            scaling = dataclasses.replace(config.scaling, measure_every=measure_every or FLOOR)
            config = dataclasses.replace(config, scaling=scaling)
        backend = "autoscale" if config is None else autoscale.backend(config)
        return lambda m: _Method(torch.compile(m, backend=backend),
                                 None if scaling is None else autoscale.GradScaler(m, scaling), m)

    def baseline(m: nn.Module) -> _Method:
        run = torch.compile(Autocast(m, device)) if device == "cuda" else torch.compile(m, backend="autoscale")
        return _Method(run, torch.amp.GradScaler(device), m)

    makers: dict[str, Callable[[nn.Module], _Method]] = {
        A: autoscale_on(None),
        A_UNWATCHED: autoscale_on(autoscale.Config(overflow=autoscale.OverflowConfig(watch=False))),
        B: baseline,
        B_AGAIN: baseline,
    }
    if measure_every != 1:
        makers[A_EVERY] = lambda m: _Method(torch.compile(m, backend="autoscale"), None, m)
    if references and measure_every == 1:
        makers |= {C: lambda m: _Method(torch.compile(m), _NoScaler(), m), D: lambda m: _Method(m, _NoScaler(), m)}
    if device == "cuda" and measure_every == 1:  # (the fused kernel runs on CUDA only)
        makers[A_FUSED] = autoscale_on(autoscale.Config(scaling=autoscale.ScalingConfig(point_kernel="fused")))
    order = list(makers)[::-1] if reverse else list(makers)
    return {label: makers[label](copy.deepcopy(model).to(device)) for label in order}


class Result:
    """One model's measurements: step medians per run, phase medians, host reads."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds  # interleaved rounds in each run
        self.steps: list[dict[str, float]] = []  # per run: method -> median step (s)
        self.phases: dict[str, dict[str, float]] = {}  # method -> phase -> median (s)
        self.faults: dict[str, list[float]] = defaultdict(list)  # method -> page faults a step, per timed window
        self.reads: dict[str, tuple[int, int]] = {}  # method -> (plain, fused)


def compile_methods(methods: Mapping[str, _Method], x: torch.Tensor, y: torch.Tensor, device: str,
                    inductor: Mapping[str, Any] | None = None) -> None:
    """Compile and warm up each method (three steps, in the order the copies were made) under the
    Inductor options ``inductor``, each afresh: a graph served from the caches runs faster (see the
    module's docstring)."""
    with (torch._inductor.config.patch({"fx_graph_cache": False, **(inductor or {})}),
          torch._functorch.config.patch(enable_autograd_cache=False)):
        for method in methods.values():
            for _ in range(3):
                method.step(x, y, device=device)


def measure(name: str, size: Size, runs: int, rounds: int, steps: int, device: str,
            inductor: Mapping[str, Any] | None = None, measure_every: int = 1) -> Result:
    """``name``'s step times, phases and host reads, in ``runs`` runs of at least ``rounds`` rounds
    (as many more as make whole ``balanced_orders`` designs), each run on fresh copies made in the
    reverse order every other run; ``inductor``: Inductor options every method compiles under
    (``--inductor``); ``measure_every``: autoscale's ``ScalingConfig.measure_every`` (0: ``FLOOR``)."""
    torch.manual_seed(0)
    model, x, y = MODELS[name](size)
    x, y = x.to(device), y.to(device)
    phases: dict[str, dict[str, list[float]]] = defaultdict(lambda: {p: [] for p in PHASES})
    methods: dict[str, _Method] = {}
    result = Result(rounds)
    for run in range(runs):
        methods.clear()  # (the last run's copies, freed before the next are made)
        gc.collect()
        torch._dynamo.reset()  # (and their graphs: Dynamo would count them against its recompile limit)
        methods.update(_methods(model, device, references=size != "large", reverse=run % 2 == 1,
                                measure_every=measure_every))
        compile_methods(methods, x, y, device, inductor)
        labels = sorted(methods, key=ORDER.index)
        orders = balanced_orders(len(labels))
        result.rounds = -(-rounds // len(orders)) * len(orders)  # (18 for the CPU's 6 methods)
        times: dict[str, list[float]] = {label: [] for label in labels}
        for i in range(result.rounds):  # interleaved: every method sees the same machine load
            for label in (labels[k] for k in orders[i % len(orders)]):
                method = methods[label]
                method.step(x, y, device=device)  # (untimed: the first step after another method's is cold)
                faults, start = page_faults(), _synced(device)
                for _ in range(steps):  # (on a GPU, timing each phase would sync: phases are timed apart)
                    method.step(x, y, phases[label] if device == "cpu" else None, device=device)
                times[label].append((_synced(device) - start) / steps)
                result.faults[label].append((page_faults() - faults) / steps)
        result.steps.append({label: statistics.median(t) for label, t in times.items()})
    if device != "cpu":
        for label, method in methods.items():
            for _ in range(result.rounds):
                method.step(x, y, phases[label], device=device)
    result.phases = {label: {p: statistics.median(v) for p, v in ph.items()} for label, ph in phases.items()}
    for label in (A, A_UNWATCHED, B):
        method = methods[label]
        result.reads[label] = (method.host_reads(x, y, fused=False), method.host_reads(x, y, fused=True))
    return result


def steps_per_round(measure_every: int) -> int:
    """How many steps each round times: at least 5, and a whole number of ``measure_every``-step
    periods, so that every timed window holds its share of measured steps (0, the floor: 5)."""
    return measure_every * -(-5 // measure_every) if measure_every else 5


def progress(name: str, result: Result) -> str:
    """One line of ``name``'s ratios over (b), per run: printed as each model is done."""
    labels = [(label, column) for label, column in RATIOS if label in result.steps[0]]
    return f"{name}: " + ", ".join(
        f"{column} " + " ".join(f"{run[label] / run[B]:.3f}" for run in result.steps) for label, column in labels)


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``range(n)`` for the rounds (a Williams design): over them, every index takes
    every position, and comes right after every other index, equally often (once each, in ``n``
    orders; for odd ``n``, twice, in ``2n``).

    Why: a method's time depends on the method run just before it. With (b') right after (b) in
    every round, the A/A control read 0.98-0.99; with (b) right after (b'), 1.02-1.03; with the
    rounds shuffled, 1.00. A rotation of one order keeps every method's predecessor, and with it
    that bias."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        if len(first) % 2:
            first, low = [*first, low], low + 1
        else:
            first, high = [*first, high], high - 1
    orders = [[(k + shift) % n for k in first] for shift in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 and n > 1 else orders


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def report(results: dict[str, Result], *, size: Size, runs: int, steps: int, device: str,
           inductor: Mapping[str, Any] | None = None, measure_every: int = 1, heap: str = HEAP_KEPT) -> str:
    """The report; ``heap`` says which C heap the steps allocated from (``HEAPS``)."""
    labels = list(next(iter(results.values())).steps[0])
    rounds = next(iter(results.values())).rounds
    ratios_of = [(label, column) for label, column in RATIOS if label in labels]

    def duration(seconds: float) -> str:  # (a tiny step is a few hundred µs)
        return f"{seconds * 1e6:.1f} µs" if size == "tiny" else f"{seconds * 1e3:.2f} ms"

    columns = " | ".join(column for _, column in ratios_of)
    lines = ["| model | " + " | ".join(labels) + f" | {columns} |", "|---" * (len(labels) + len(ratios_of) + 1) + "|"]
    # per ratio: per run, the models' ratios
    by_run = {column: [[r.steps[i][label] / r.steps[i][B] for r in results.values()] for i in range(runs)]
              for label, column in ratios_of}
    for name, r in results.items():
        median = {label: statistics.median(run[label] for run in r.steps) for label in labels}
        ratios = " | ".join(f"{statistics.median(run[label] / run[B] for run in r.steps):.3f}"
                            for label, _ in ratios_of)
        lines.append(f"| {name} | " + " | ".join(duration(median[k]) for k in labels) + f" | {ratios} |")
    overall = {column: [_geomean(models) for models in per_run] for column, per_run in by_run.items()}
    per_run = "\n".join(
        f"| {i + 1} | " + " | ".join(f"{ratio:.3f}" for ratio in by_run["a/b"][i])
        + " | " + " | ".join(f"{overall[column][i]:.3f}" for _, column in ratios_of) + " |" for i in range(runs))
    names = list(results)
    added = [label for label in labels if label != B]
    added_lines = ["| model | " + " | ".join(f"{label.split(' ')[0]} − (b)" for label in added) + " |",
                   "|---" * (len(added) + 1) + "|"]
    for name, r in results.items():
        added_lines.append(f"| {name} | " + " | ".join(
            f"{statistics.median(run[label] - run[B] for run in r.steps) * 1e6:+.1f} µs" for label in added) + " |")
    phase_lines = ["| model | method | " + " | ".join(PHASES) + " | sum |", "|---" * (len(PHASES) + 3) + "|"]
    for name, r in results.items():
        for label in [label for label in (A, A_UNWATCHED, A_FUSED, A_EVERY, B) if label in r.phases]:
            ph = r.phases[label]
            phase_lines.append(f"| {name} | {label.split(' ')[0]} | " + " | ".join(duration(ph[p]) for p in PHASES)
                               + f" | {duration(sum(ph.values()))} |")
    read_lines = ["| model | " + " | ".join(f"{label.split(' ')[0]} plain / fused" for label in (A, A_UNWATCHED, B))
                  + " |", "|---|---|---|---|"]
    for name, r in results.items():
        read_lines.append(f"| {name} | " + " | ".join(f"{p} / {f}" for p, f in (r.reads[label] for label in
                                                                                (A, A_UNWATCHED, B))) + " |")
    fault_lines = ["| model | " + " | ".join(label.split(" ")[0] for label in labels) + " |",
                   "|---" * (len(labels) + 1) + "|"]
    for name, r in results.items():
        fault_lines.append(f"| {name} | " + " | ".join(f"{statistics.median(r.faults[label]):.0f}" for label in labels)
                           + " |")
    machine = torch.cuda.get_device_name() if device == "cuda" else f"{torch.get_num_threads()} threads"
    machine += f", {HEAPS[heap]}"
    if inductor:
        machine += ", every method compiled with Inductor's " + ", ".join(f"{k}={v!r}" for k, v in inductor.items())
    if measure_every == 0:
        machine += (", (a) and (a') measuring their gradients at their first step only (`--measure-every 0`: every "
                    "step timed runs the graph whose points only multiply and check), (a1) every step")
    elif measure_every != 1:
        machine += (f", (a) and (a') measuring their gradients every {measure_every} steps (`measure_every`), "
                    "(a1) every step")
    a_b = statistics.median(overall["a/b"])
    summary = ", ".join(f"{column} {statistics.median(overall[column]):.3f}" for _, column in ratios_of[1:])
    option = "" if size == "full" else f"--{size}"
    return (f"# Step-time overhead{f' ({option})' if option else ''}\n\n{__doc__}\nMachine: {machine}, torch "
            f"{torch.__version__}, {option or 'full'} run; {runs} runs of {rounds} interleaved "
            f"rounds of {steps} steps; step times are the median over runs of each run's median.\n\n"
            + "\n".join(lines)
            + f"\n\nGeometric mean over the models, median of the runs: **a/b {a_b:.3f}**, "
            f"{summary} (b'/b: the A/A control).\n\nEvery run (a/b per model, then the geometric means):\n\n| run | "
            + " | ".join(names) + f" | {columns} |\n" + "|---" * (len(names) + len(ratios_of) + 1) + "|\n"
            + per_run + "\n\nWhat each method adds a step over (b) (the median over runs of each run's difference; "
            "on tiny models, what a step costs besides its arithmetic):\n\n" + "\n".join(added_lines)
            + "\n\nMedian time of each phase of a step (forward includes the loss and `scale()`):\n\n"
            + "\n".join(phase_lines)
            + "\n\nPage faults a step (the median over the timed windows: pages mapped afresh for the steps' "
            "buffers, see ``benchmarks.heap``):\n\n" + "\n".join(fault_lines)
            + "\n\nHost reads of device values in one steady-state `step()` + `update()` (a sync each on a GPU):\n\n"
            + "\n".join(read_lines) + "\n")


def main() -> None:
    parser = step_parser(__doc__, "overhead", "small models (1-3 ms steps; about 2 minutes)",
                         "models whose steps a GPU's arithmetic bounds, not the host's launches (GPU only)",
                         "the same models shrunk until their arithmetic is negligible: what a step costs "
                         "besides it (µs)")
    parser.add_argument("--runs", type=int, default=4,
                        help="measurement runs, each on fresh copies, made in the reverse order every other run "
                             "(default 4)")
    parser.add_argument("--measure-every", type=int, default=1, metavar="M",
                        help="autoscale's ScalingConfig.measure_every for (a) and (a'), 0 for their first step "
                             "only (the floor), and (a1): (a) measuring every step, in place of (a''), (c) and (d); "
                             "needs -o")
    parser.add_argument("--system-heap", action="store_true",
                        help="leave glibc's heap as it is, returning freed memory to the system (the steps' "
                             "buffers then fault their pages in afresh: benchmarks.heap); needs -o")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of torch._inductor.config that every method, the baseline's too, compiles "
                             "under (repeatable; e.g. combo_kernels=True); needs -o")
    args = parser.parse_args()
    size = size_of(args)
    if size == "large" and args.device == "cpu":
        parser.error("--large is sized for a GPU (a step would take minutes on a CPU); add --device cuda")
    inductor = dict(_inductor_option(parser, option) for option in args.inductor)
    if inductor and args.output is None:
        parser.error("--inductor changes what is measured: name its report with -o, not the default one")
    every = args.measure_every
    if every < 0 or (every != 1 and args.output is None):
        parser.error("--measure-every takes M >= 0, and M other than 1 changes what is measured: name its report "
                     "with -o")
    if args.system_heap and args.output is None:
        parser.error("--system-heap changes what is measured: name its report with -o")
    heap = HEAP_SYSTEM if args.system_heap else HEAP_KEPT if retain_freed_memory() else HEAP_NOT_GLIBC
    rounds, steps = 15, steps_per_round(every)
    results: dict[str, Result] = {}
    for name in MODELS:
        results[name] = measure(name, size, args.runs, rounds, steps, args.device, inductor, every)
        print(progress(name, results[name]), flush=True)  # (what a run cut short by a time limit keeps)
    publish(report(results, size=size, runs=args.runs, steps=steps, device=args.device,
                   inductor=inductor, measure_every=every, heap=heap),
            "overhead", args)


def _inductor_option(parser: argparse.ArgumentParser, option: str) -> tuple[str, Any]:
    """``--inductor KEY=VALUE``: the key, which torch._inductor.config must have, and the value as
    a Python literal (a bare word stays a string)."""
    key, sep, text = option.partition("=")
    if not sep or not hasattr(torch._inductor.config, key):
        parser.error(f"--inductor {option!r}: give KEY=VALUE with KEY an option of torch._inductor.config")
    try:
        return key, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return key, text


if __name__ == "__main__":
    main()
