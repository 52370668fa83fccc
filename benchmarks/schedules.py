"""Cyclic precision schedules and formats beyond float16, on the digits MLP.

    python -m benchmarks.schedules [--quick] [--seeds N]     # writes docs/results/schedules.md and .png

1. **Precision range test** (CPT's): 20-step runs at a fixed forward precision of 2..8 bits;
   ``autoscale.schedules.suggest_q_min`` picks the lowest whose test accuracy is 40 points above
   chance. That is the schedules' ``q_min``; ``q_max`` is 8.
2. **Schedules**: static 8-, 4- and 2-bit forward precision, and every profile of
   ``autoscale.schedules`` over ``[q_min, 8]`` with 8 cycles, all with 8-bit gradients (stochastic
   rounding) and autoscale's default adaptive gradient scaling; final test accuracy (the model at
   8 bits for the cyclic schedules, as trained for the static ones) against the average cost
   proxy ``(b_f² + 2·b_f·b_g)/(3·32²)`` of the run, over ``--seeds`` seeds.
3. **Formats**: float32, float16 and float8 (E4M3 forward, E5M2 backward, simulated) on the digits
   MLP and CNN of ``benchmarks.numerics``, the same default gradient scaling.

Everything trains with Adam and a cosine learning-rate decay, as in ``benchmarks.numerics``, in
emulated low precision on this CPU with the eager executor.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import autoscale
from autoscale import schedules
from benchmarks import write_report
from benchmarks.numerics.tasks import TASKS, Task

ROOT = Path(__file__).resolve().parent.parent
Q_MAX, GRAD_BITS, CYCLES = 8, 8, 8
PROBE_STEPS = 20  # short: long enough to see whether training starts, too short to finish it
RISE = 40.0  # accuracy points above chance (10 %) at which training "works" in the precision range test


def _accuracy(model: nn.Module, run: nn.Module, task: Task) -> float:
    data = task.data()
    was = model.training
    model.eval()
    with torch.no_grad():
        logits = torch.cat([run(data.x_test[i:i + 256]) for i in range(0, len(data.x_test), 256)])
    model.train(was)
    return 100.0 * float((logits.argmax(-1) == data.y_test).float().mean())


def train(task: Task, seed: int, steps: int, *, config: autoscale.Config | None,
          bits: schedules.Schedule | int | None = None, eval_bits: int | None = None) -> float:
    """Train ``task`` for ``steps`` with ``config`` (eager float32 when None; quantized when
    ``bits`` is given: a fixed width or a schedule) and return the test accuracy, at ``eval_bits``
    when given."""
    torch._dynamo.reset()
    data = task.data()
    model = task.model(seed)
    fake = None
    if bits is not None:
        fake = autoscale.FakeQuant(model, schedule=bits if isinstance(bits, schedules.Schedule) else None,
                                   bits=bits if isinstance(bits, int) else Q_MAX)
    run: nn.Module = model
    scaler = None
    if config is not None:
        scaler = autoscale.GradScaler(model, config)
        run = torch.compile(model, backend=autoscale.backend(config))  # type: ignore[assignment]
    opt = torch.optim.Adam(model.parameters(), lr=task.lr)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    gen = torch.Generator().manual_seed(seed)
    epochs = steps * task.batch // len(data.x_train) + 2
    order = torch.cat([torch.randperm(len(data.x_train), generator=gen) for _ in range(epochs)])
    for t in range(steps):
        if fake is not None and fake.schedule is not None:
            fake.step(t)
        idx = order[t * task.batch:(t + 1) * task.batch]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(run(data.x_train[idx]), data.y_train[idx])
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        decay.step()
    if fake is not None and eval_bits is not None:
        fake.set_bits(eval_bits)
    return _accuracy(model, run, task)


def _mean_std(values: list[float]) -> str:
    return f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, short runs (a smoke test)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per method (default 3; 1 with --quick)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    seeds = args.seeds or (1 if args.quick else 3)
    task = TASKS["mlp"]
    steps = 80 if args.quick else task.steps
    quantized = autoscale.Config(executor="eager", quant=autoscale.QuantConfig(grad_bits=GRAD_BITS))
    start = time.perf_counter()

    probes: dict[int, float] = {}

    def probe(b: int) -> float:
        probes[b] = train(task, 0, PROBE_STEPS, config=quantized, bits=b)
        return probes[b]

    q_min = schedules.suggest_q_min(probe, range(2, Q_MAX + 1), baseline=10.0, rise=RISE)  # 10 classes
    print(f"precision range test: {probes} -> q_min {q_min}", flush=True)

    rows: list[tuple[str, float, list[float]]] = []
    for b in (Q_MAX, 4, 2):
        accs = [train(task, s, steps, config=quantized, bits=b) for s in range(seeds)]
        rows.append((f"static {b}-bit", schedules.cost_proxy(b, GRAD_BITS), accs))
        print(rows[-1], flush=True)
    for name in schedules.names():
        sched = schedules.get(name, q_min, Q_MAX, steps, CYCLES)
        accs = [train(task, s, steps, config=quantized, bits=sched, eval_bits=Q_MAX) for s in range(seeds)]
        rows.append((name, schedules.average_cost(sched, GRAD_BITS), accs))
        print(rows[-1], flush=True)

    formats: list[tuple[str, str, list[float]]] = []
    for task_name in ("mlp", "cnn"):
        t = TASKS[task_name]
        n = 60 if args.quick else t.steps
        for label, cfg in (("float32", None), ("float16", autoscale.Config(executor="eager")),
                           ("float8 (E4M3 / E5M2)", autoscale.Config(executor="eager", dtype="float8"))):
            formats.append((task_name, label, [train(t, s, n, config=cfg) for s in range(seeds)]))
            print(formats[-1], flush=True)

    minutes = (time.perf_counter() - start) / 60
    _write(args, seeds, steps, q_min, probes, rows, formats, minutes)


def _write(args: argparse.Namespace, seeds: int, steps: int, q_min: int, probes: dict[int, float],
           rows: list[tuple[str, float, list[float]]], formats: list[tuple[str, str, list[float]]],
           minutes: float) -> None:
    out = ROOT / "docs" / "results" / ("schedules_quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Cyclic precision schedules and formats beyond float16", "", (__doc__ or "").strip(), "",
        f"{'Quick run' if args.quick else 'Full run'}: {seeds} seed(s), {steps} steps per run, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, {minutes:.0f} minutes.", "",
        "## Precision range test", "",
        "| forward bits | " + " | ".join(str(b) for b in probes) + " |",
        "|---" * (len(probes) + 1) + "|",
        "| training accuracy % | " + " | ".join(f"{a:.1f}" for a in probes.values()) + " |", "",
        f"Suggested q_min: **{q_min}** (the first width whose accuracy exceeds chance, 10 %, by {RISE:.0f} points, "
        f"after {PROBE_STEPS} steps).", "",
        f"## Schedules (digits MLP, forward bits in [{q_min}, {Q_MAX}], {CYCLES} cycles, {GRAD_BITS}-bit gradients)",
        "", "| schedule | average cost proxy | test accuracy % |", "|---|---|---|",
    ]
    lines += [f"| {name} | {cost:.3f} | {_mean_std(accs)} |" for name, cost, accs in rows]
    lines += ["", "![accuracy against cost](schedules.png)", "", "## Formats", "",
              "| task | format | test accuracy % |", "|---|---|---|"]
    lines += [f"| {task} | {label} | {_mean_std(accs)} |" for task, label, accs in formats]
    path = out / "schedules.md"
    write_report(path, "\n".join(lines) + "\n")
    _plot(rows, out / "schedules.png")
    print(f"wrote {path}")


def _plot(rows: list[tuple[str, float, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, cost, accs in rows:
        mean = statistics.fmean(accs)
        err = statistics.stdev(accs) if len(accs) > 1 else 0.0
        marker = "s" if name.startswith("static") else "o"
        ax.errorbar(cost, mean, yerr=err, fmt=marker, capsize=3)
        ax.annotate(name, (cost, mean), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_xlabel("average cost proxy (float32 = 1)")
    ax.set_ylabel("test accuracy %")
    ax.set_title("Digits MLP: accuracy against training cost, mean ± std over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
