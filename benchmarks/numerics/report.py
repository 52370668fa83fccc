"""From runs to numbers, a markdown report and plots.

A layer's underflow in a run is the mean of its measured rates over the run (the measurement
points are spread evenly over training); across seeds, the mean of the runs'. "Max layer
underflow" is the largest of those over a model's layers; the worst single measurement is shown
too. Accuracy is the final test accuracy, mean ± sample standard deviation over seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .methods import METHODS
from .tasks import TASKS
from .train import RunResult

__all__ = ["Row", "Summary", "final_line", "markdown", "plot", "summarize"]

WARMUP = 10  # steps after which the adaptive target allows no skipped step


@dataclass(frozen=True)
class Row:
    """One (task, method) over its seeds."""

    task: str
    method: str
    seeds: int
    accuracy: float
    accuracy_std: float
    loss: float
    loss_std: float
    layer_underflow: tuple[float, ...]  # per layer, mean over the run and the seeds (nan: no signal)
    worst_underflow: float  # the largest single measurement
    lost_signal: float  # the worst layer's share of the gradient magnitude lost, mean over measurements
    skipped: float  # mean per run
    skipped_late: int  # total over the seeds, after WARMUP steps
    nonfinite: float  # mean per run
    seconds: float  # mean per run

    @property
    def max_underflow(self) -> float:
        known = [u for u in self.layer_underflow if not math.isnan(u)]
        return max(known) if known else math.nan


Summary = dict[tuple[str, str], Row]


def _nanmean(values: Sequence[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return statistics.fmean(known) if known else math.nan


def _std(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: Sequence[RunResult]) -> Summary:
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in runs:
        groups.setdefault((r.task, r.method), []).append(r)
    summary: Summary = {}
    for (task, method), rs in groups.items():
        layers = len(rs[0].layers)
        per_run = [[_nanmean([rates[i] for _, rates in r.underflow]) for i in range(layers)] for r in rs]
        measured = [x for r in rs for _, rates in r.underflow for x in rates if not math.isnan(x)]
        summary[(task, method)] = Row(
            task, method, len(rs),
            statistics.fmean(r.accuracy for r in rs), _std([r.accuracy for r in rs]),
            statistics.fmean(r.test_loss for r in rs), _std([r.test_loss for r in rs]),
            tuple(_nanmean([p[i] for p in per_run]) for i in range(layers)),
            max(measured, default=math.nan),
            _nanmean([max((x for x in lost), default=math.nan) for r in rs for _, lost in r.lost_signal]),
            statistics.fmean(len(r.skipped) for r in rs),
            sum(sum(s > WARMUP for s in r.skipped) for r in rs),
            statistics.fmean(r.nonfinite for r in rs),
            statistics.fmean(r.seconds for r in rs),
        )
    return summary


def _fmt_rate(x: float) -> str:
    return "—" if math.isnan(x) else "0" if x == 0 else f"{x:.1e}"


def _fp32_gap(summary: Summary, task: str, method: str) -> float | None:
    ref, row = summary.get((task, "fp32")), summary.get((task, method))
    return None if ref is None or row is None else ref.accuracy - row.accuracy


def final_line(summary: Summary) -> str:
    """The benchmark's last printed line: adaptive's worst layer, its largest accuracy gap to float32
    over the tasks (positive: below float32) and its skipped steps after the first WARMUP."""
    rows = [r for (_, m), r in summary.items() if m == "adaptive"]
    underflow = max((r.max_underflow for r in rows if not math.isnan(r.max_underflow)), default=math.nan)
    gaps = [g for r in rows if (g := _fp32_gap(summary, r.task, "adaptive")) is not None]
    gap = max(gaps, default=math.nan)
    skipped = sum(r.skipped_late for r in rows)
    return (f"numerics: adaptive max layer underflow {underflow:.1e}, accuracy gap to fp32 {gap:.2f} pts, "
            f"skipped {skipped}")


def _targets(summary: Summary, task: str) -> str:
    row, ref = summary.get((task, "adaptive")), summary.get((task, "fp32"))
    if row is None or ref is None:
        return ""
    gap = ref.accuracy - row.accuracy
    checks = [
        (row.max_underflow <= 1e-3, f"max layer underflow {_fmt_rate(row.max_underflow)} (≤ 1e-3)"),
        (gap <= ref.accuracy_std, f"accuracy {gap:+.2f} pts below float32, whose std is {ref.accuracy_std:.2f} "
                                  "(within one std)"),
        (row.skipped_late == 0, f"{row.skipped_late} skipped steps after step {WARMUP} (0)"),
    ]
    return "; ".join(f"{'met' if ok else '**not met**'}: {text}" for ok, text in checks)


def markdown(summary: Summary, *, seeds: int, quick: bool, machine: str, minutes: float, notes: str) -> str:
    lines = [
        "# Numerics: autoscale against the usual float16 recipes",
        "",
        "    python -m benchmarks.numerics [--quick]      # or: make bench-numerics",
        "",
        f"{'Quick smoke run' if quick else 'Full run'}: {seeds} seed{'s' if seeds != 1 else ''} per task and method, "
        f"{machine}, {minutes:.0f} minutes. Tasks, methods and measurements are described in "
        "`benchmarks/numerics/` (tasks.py says why the stress variants are built as they are).",
        "",
        "Columns: final test accuracy (mean ± std over seeds); test loss; **max layer underflow**: the",
        "worst layer's underflow rate (the share of a weight gradient's entries that float32 has non-zero",
        "and the method has at zero), averaged over 10 measurements spread over training and over the",
        "seeds; the worst single measurement; **lost magnitude**: the share of the gradient's L1 norm in",
        "those entries (worst layer, averaged); skipped steps per run; wall time per run (training",
        "loop with compile, emulated float16 on this CPU, eager executor).",
        "",
        "Plots: [per-layer underflow](numerics/underflow.png), [scale trajectories](numerics/scales.png),",
        "[test accuracy over training](numerics/accuracy.png).",
    ]
    for name, task in TASKS.items():
        if not any(t == name for t, _ in summary):
            continue
        lines += ["", f"## {name}: {task.title}", "",
                  "| method | accuracy % | test loss | max layer underflow | worst measured | lost magnitude | "
                  "skipped / run | time / run |",
                  "|---|---|---|---|---|---|---|---|"]
        for method in METHODS.values():
            r = summary.get((name, method.name))
            if r is None:
                continue
            label = f"**{method.label}**" if method.name == "adaptive" else method.label
            acc_std, loss_std = (f"{r.accuracy_std:.2f}", f"{r.loss_std:.3f}") if r.seeds > 1 else ("—", "—")
            lines.append(
                f"| {label} | {r.accuracy:.2f} ± {acc_std} | {r.loss:.3f} ± {loss_std} | "
                f"{_fmt_rate(r.max_underflow)} | {_fmt_rate(r.worst_underflow)} | {_fmt_rate(r.lost_signal)} | "
                f"{r.skipped:.1f}{f' ({r.nonfinite:.0f} inf/nan applied)' if r.nonfinite > r.skipped else ''} | "
                f"{r.seconds:.1f} s |")
        targets = _targets(summary, name)
        if targets:
            lines += ["", f"Adaptive targets: {targets}."]
    lines += ["", "```", final_line(summary), "```", ""]
    if notes:
        lines += [notes.rstrip(), ""]
    return "\n".join(lines)


def plot(summary: Summary, runs: Sequence[RunResult], out: Path) -> list[Path]:
    """Three PNGs in ``out``: per-layer underflow heatmaps, scale trajectories, accuracy curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    out.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in TASKS if any(k[0] == t for k in summary)]
    methods = [m for m in METHODS if any(k[1] == m for k in summary)]
    written = []

    cols = 3
    rows_ = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5.5 * cols + 2, 4.2 * rows_), squeeze=False, layout="constrained")
    image = None
    for index, (ax, task) in enumerate(zip(axes.flat, tasks, strict=False)):
        grid = [[summary[(task, m)].layer_underflow[i] if (task, m) in summary else math.nan
                 for i in range(len(next(r for k, r in summary.items() if k[0] == task).layer_underflow))]
                for m in methods]
        floor = 1e-6
        data = [[max(v, floor) if not math.isnan(v) else math.nan for v in row] for row in grid]
        image = ax.imshow(data, aspect="auto", cmap="magma_r", norm=LogNorm(vmin=floor, vmax=1.0))
        ax.set_title(task)
        ax.set_yticks(range(len(methods)), [METHODS[m].label for m in methods] if index % cols == 0 else [],
                      fontsize=8)
        ax.set_xlabel("layer (weight matrices, input to output)")
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes, label="underflow rate (≤ 1e-6 shown as 1e-6)", shrink=0.8)
    fig.suptitle("Per-layer weight-gradient underflow, mean over training and seeds")
    written.append(_save(fig, out / "underflow.png", tight=False))

    fig, axes = plt.subplots(rows_, cols, figsize=(6 * cols, 4 * rows_), squeeze=False)
    first_seed = min(r.seed for r in runs)
    for ax, task in zip(axes.flat, tasks, strict=False):
        for r in runs:
            if r.task != task or r.seed != first_seed:
                continue
            if r.method == "adaptive" and r.layer_scales:
                series = list(r.layer_scales.values())
                steps = range(1, len(series[0]) + 1)
                low = [min(s[i] for s in series) for i in range(len(series[0]))]
                high = [max(s[i] for s in series) for i in range(len(series[0]))]
                ax.fill_between(steps, low, high, alpha=0.3, step="post", label="adaptive: per-layer range")
            elif any(not math.isnan(s) for s in r.scales) and r.method not in ("fp32", "fp16"):
                ax.step(range(1, len(r.scales) + 1), r.scales, where="post", label=METHODS[r.method].label, lw=1)
        ax.set_yscale("log", base=2)
        ax.set_title(task)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"Scales over training (seed {first_seed}): loss scales, and adaptive's per-layer scales")
    written.append(_save(fig, out / "scales.png"))

    fig, axes = plt.subplots(rows_, cols, figsize=(6 * cols, 4 * rows_), squeeze=False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        for m in methods:
            group = [r for r in runs if r.task == task and r.method == m]
            if not group:
                continue
            steps = [s for s, _, _ in group[0].curve]
            mean = [statistics.fmean(r.curve[i][1] for r in group) for i in range(len(steps))]
            style = {"lw": 2.2, "color": "black"} if m == "adaptive" else {"lw": 1}
            ax.plot(steps, mean, label=METHODS[m].label, **style)
        ax.set_title(task)
        ax.set_xlabel("step")
        ax.set_ylabel("test accuracy %")
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Test accuracy over training, mean over seeds")
    written.append(_save(fig, out / "accuracy.png"))
    return written


def _save(fig: object, path: Path, *, tight: bool = True) -> Path:
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
