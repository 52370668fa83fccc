"""Training telemetry -> tables and plots: what ``autoscale report LOG`` shows.

``autoscale.GradScaler(model, telemetry=LOG)`` appends one JSON line per ``update()``::

    {"step": 7, "skipped": true, "loss_scale": 1.0,
     "layers": {"fc1": {"scale": 8192.0, "zero_rate": 0.0, "overflows": 1}, ...},
     "forward": {"promoted": [{"key": "fc2:linear#0", "step": 7, "observed": "inf", "reason": "overflowed"}],
                 "overflowed": ["fc2:linear#0"], "float32_nonfinite": []}}

(``overflows`` counts, per layer, the updates so far at which that layer's gradients overflowed;
``forward``, only on steps where the forward's overflow checks found something, says which ops
were promoted to float32, which float16 values overflowed and which float32 values were
non-finite: see docs/forward_overflow.md.) This module
reads such a log (:func:`load_telemetry`), reduces it to per-layer numbers (:func:`summarize`,
:func:`format_summary`) and draws it (:func:`render`). Loading and summarising are separate from
drawing so that the numbers can be used (and tested) without matplotlib, which is imported only
by :func:`render`.

The scaler opens the log in append mode, so one file can hold several training runs; step
numbers restart at each. The report covers the last run and says where it starts, rather than
mixing the cumulative overflow counters of different runs.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "PLOTS",
    "ForwardEvent",
    "LayerSample",
    "LayerSummary",
    "Step",
    "Summary",
    "Telemetry",
    "TelemetryError",
    "default_output_dir",
    "format_summary",
    "load_telemetry",
    "render",
    "summarize",
]

log = logging.getLogger("autoscale")

#: The files :func:`render` writes, by what they show.
PLOTS = {"scales": "scales.png", "zero_rates": "zero_rates.png", "skipped": "skipped.png"}

_LAYER_KEYS = ("scale", "zero_rate", "overflows")
_FORWARD_KINDS = ("promoted", "overflowed", "float32_nonfinite")
_HOW_TO_WRITE = "autoscale.GradScaler(model, telemetry=PATH) writes one line per scaler.update()"


class TelemetryError(ValueError):
    """The log is not (or not entirely) the scaler's telemetry; the message names the line."""


@dataclass(frozen=True)
class LayerSample:
    """One layer at one step, as the scaler wrote it."""

    scale: float
    zero_rate: float
    overflows: int


@dataclass(frozen=True)
class ForwardEvent:
    """What the forward's overflow checks found at one step: an op ``promoted`` to float32 (with
    the max |x| it had and why), a float16 value that ``overflowed``, or a value non-finite in
    float32 (``float32_nonfinite``: a model or data problem)."""

    step: int
    kind: str
    key: str
    detail: str = ""


@dataclass(frozen=True)
class Step:
    """One line of the log: the state after one ``update()``."""

    step: int
    skipped: bool
    loss_scale: float
    layers: dict[str, LayerSample]
    line: int  # 1-based line number in the file, for messages
    forward: tuple[ForwardEvent, ...] = ()


@dataclass(frozen=True)
class Telemetry:
    """The last training run of a telemetry log (see the module docstring)."""

    path: Path
    steps: tuple[Step, ...]
    run_starts: tuple[int, ...] = ()  # line numbers at which each run in the file starts
    incomplete_line: int | None = None  # a last line cut off mid-write, left out

    @property
    def layer_names(self) -> list[str]:
        """Every layer that appears in the run, in order of first appearance (a graph compiled
        later, e.g. after a graph break or a recompile, adds its layers part-way through)."""
        names: dict[str, None] = {}
        for s in self.steps:
            names.update(dict.fromkeys(s.layers))
        return list(names)


@dataclass(frozen=True)
class LayerSummary:
    """One layer over the run. ``mean_zero_rate`` averages only the steps that were not skipped:
    a skipped step's gradients held inf/nan, so its zero count says nothing about underflow."""

    name: str
    final_scale: float
    min_scale: float
    max_scale: float
    mean_zero_rate: float
    max_zero_rate: float
    overflows: int


@dataclass(frozen=True)
class Summary:
    """The run in numbers: what ``autoscale report`` prints."""

    path: Path
    steps: int
    first_step: int
    last_step: int
    skipped_steps: tuple[int, ...]
    loss_scale: tuple[float, float, float]  # final, min, max
    layers: tuple[LayerSummary, ...]
    runs: int = 1
    run_start_line: int = 1
    notes: tuple[str, ...] = field(default=())
    forward: tuple[ForwardEvent, ...] = ()


# ------------------------------------------------------------------------------- loading


def load_telemetry(path: str | Path) -> Telemetry:
    """Read and check a telemetry log; return its last run.

    Raises ``FileNotFoundError`` when there is no file and :class:`TelemetryError` when it is
    empty or a line is not a telemetry record (naming the line and what is wrong with it). Blank
    lines are ignored, and so is a last line that does not parse and has no newline: the scaler
    writes each record with its newline in one call, so that is a write cut off by the end of the
    process (a crash, a kill), which should not stop the report of everything before it.
    """
    path = Path(path)
    with path.open(encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    steps: list[Step] = []
    incomplete = None
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            steps.append(_parse_line(path, number, text))
        except TelemetryError:
            if number < len(lines) or text.endswith("\n") or not steps:
                raise
            incomplete = number
            log.info("%s:%d: the last line is incomplete (the run ended while writing it); left out", path, number)
    if not steps:
        raise TelemetryError(f"{path} is empty: no telemetry was written to it ({_HOW_TO_WRITE})")
    starts = [steps[0].line] + [b.line for a, b in zip(steps, steps[1:], strict=False) if b.step <= a.step]
    last = next(i for i, s in enumerate(steps) if s.line == starts[-1])
    log.debug("read %d telemetry records from %s (%d runs)", len(steps), path, len(starts))
    return Telemetry(path, tuple(steps[last:]), tuple(starts), incomplete)


def _parse_line(path: Path, number: int, text: str) -> Step:
    def bad(why: str) -> TelemetryError:
        return TelemetryError(f"{path}:{number}: not the scaler's telemetry: {why} ({_HOW_TO_WRITE})")

    try:
        record: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"line {number} is not JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise bad(f"line {number} is a JSON {type(record).__name__}, not an object")
    missing = [k for k in ("step", "skipped", "loss_scale", "layers") if k not in record]
    if missing:
        raise bad(f"line {number} has no {', '.join(repr(k) for k in missing)}")
    step, skipped, loss_scale, layers = record["step"], record["skipped"], record["loss_scale"], record["layers"]
    if not _is_int(step):
        raise bad(f"line {number}: 'step' is {step!r}, not an integer")
    if not isinstance(skipped, bool):
        raise bad(f"line {number}: 'skipped' is {skipped!r}, not true/false")
    if not _is_number(loss_scale):
        raise bad(f"line {number}: 'loss_scale' is {loss_scale!r}, not a number")
    if not isinstance(layers, dict):
        raise bad(f"line {number}: 'layers' is not an object")
    samples: dict[str, LayerSample] = {}
    for name, values in layers.items():
        if not isinstance(values, dict) or any(k not in values for k in _LAYER_KEYS):
            raise bad(f"line {number}: layer {name!r} needs 'scale', 'zero_rate' and 'overflows'")
        if not all(_is_number(values[k]) for k in _LAYER_KEYS) or not _is_int(values["overflows"]):
            raise bad(f"line {number}: layer {name!r} has a value that is not a number")
        samples[name] = LayerSample(float(values["scale"]), float(values["zero_rate"]), int(values["overflows"]))
    forward = record.get("forward", {})
    if not isinstance(forward, dict) or not all(isinstance(forward.get(k, []), list) for k in _FORWARD_KINDS):
        raise bad(f"line {number}: 'forward' must be an object of lists ({', '.join(_FORWARD_KINDS)})")
    events = []
    for kind in _FORWARD_KINDS:
        for item in forward.get(kind, []):
            if kind == "promoted":
                if not isinstance(item, dict) or "key" not in item:
                    raise bad(f"line {number}: a 'forward' promotion needs a 'key'")
                observed = item.get("observed", "")
                seen = f"max |x| {observed:.3g}" if _is_number(observed) else str(observed)
                events.append(ForwardEvent(int(step), kind, str(item["key"]), f"{seen}, {item.get('reason', '')}"))
            else:
                events.append(ForwardEvent(int(step), kind, str(item)))
    return Step(int(step), skipped, float(loss_scale), samples, number, tuple(events))


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, float) and x.is_integer())


# ----------------------------------------------------------------------------- summarising


def summarize(telemetry: Telemetry) -> Summary:
    """Per-layer final/min/max scale, mean and max zero rate, overflow count; skipped steps."""
    steps = telemetry.steps
    layers = []
    for name in telemetry.layer_names:
        samples = [s.layers[name] for s in steps if name in s.layers]
        scales = [x.scale for x in samples]
        rates = [s.layers[name].zero_rate for s in steps if name in s.layers and not s.skipped]
        layers.append(LayerSummary(
            name, scales[-1], min(scales), max(scales),
            sum(rates) / len(rates) if rates else math.nan, max(rates) if rates else math.nan,
            max(x.overflows for x in samples)))  # the scaler's counter is cumulative
    loss_scales = [s.loss_scale for s in steps]
    notes = []
    runs = len(telemetry.run_starts)
    if runs > 1:
        notes.append(f"the log holds {runs} runs (step numbering restarts at lines "
                     f"{', '.join(str(n) for n in telemetry.run_starts[1:])}); this report covers the last one")
    if telemetry.incomplete_line is not None:
        notes.append(f"line {telemetry.incomplete_line}, the last, is incomplete (the run ended while writing it) "
                     "and is left out")
    if not layers:
        notes.append("no per-layer scales in this log: the scaler ran in a mode other than 'adaptive', "
                     "or no layer of the compiled model got a scale point")
    return Summary(
        path=telemetry.path, steps=len(steps), first_step=steps[0].step, last_step=steps[-1].step,
        skipped_steps=tuple(s.step for s in steps if s.skipped),
        loss_scale=(loss_scales[-1], min(loss_scales), max(loss_scales)), layers=tuple(layers),
        runs=runs, run_start_line=telemetry.run_starts[-1], notes=tuple(notes),
        forward=tuple(e for s in steps for e in s.forward))


def format_summary(summary: Summary) -> str:
    """The summary and the per-layer table as plain text (what the CLI prints)."""
    s = summary
    skipped = len(s.skipped_steps)
    share = f" ({100.0 * skipped / s.steps:.1f} %)" if skipped else ""
    lines = [f"telemetry: {s.path}",
             f"steps:         {s.steps} (" + (f"steps {s.first_step}-{s.last_step})" if s.steps > 1
                                                 else f"step {s.first_step})"),
             f"skipped steps: {skipped}{share}" + (f": {_ranges(s.skipped_steps)}" if skipped else "")]
    final, low, high = s.loss_scale
    if low == high == 1.0 and s.layers:
        lines.append("loss scale:    1 throughout (adaptive mode: each layer scales its own gradients)")
    elif low == high:
        lines.append(f"loss scale:    {_scale(final)} throughout")
    else:
        lines.append(f"loss scale:    {_scale(final)} at the end (min {_scale(low)}, max {_scale(high)})")
    lines += [f"note: {n}" for n in s.notes]
    if s.forward:
        what = {"promoted": "computed in float32 from the next step", "overflowed": "overflowed in float16",
                "float32_nonfinite": "non-finite in float32 (a model or data problem)"}
        lines += ["", "forward overflow:"]
        lines += [f"  step {e.step}: {e.key} {what[e.kind]}" + (f" ({e.detail})" if e.detail else "")
                  for e in s.forward]
    if s.layers:
        header = ("layer", "final scale", "min scale", "max scale", "mean zero rate", "max zero rate", "overflows")
        rows = [(x.name, _scale(x.final_scale), _scale(x.min_scale), _scale(x.max_scale), _rate(x.mean_zero_rate),
                 _rate(x.max_zero_rate), str(x.overflows)) for x in s.layers]
        lines += ["", *_table(header, rows),
                  "",
                  "zero rate: the fraction of a layer's weight-gradient entries that were exactly zero (float16 "
                  "underflow, plus structural zeros such as ReLU's); skipped steps are left out of it."]
    return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:  # the name left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths,
                                                                                                strict=True)))

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _scale(x: float) -> str:
    """Powers of two as ``2^k`` (the scaler's scales are), anything else with 4 digits."""
    if x > 0 and math.isfinite(x) and math.log2(x) == int(math.log2(x)):
        return f"2^{int(math.log2(x))}"
    return f"{x:.4g}"


def _rate(x: float) -> str:
    return "-" if math.isnan(x) else "0" if x == 0 else f"{x:.2e}"


def _ranges(steps: Iterable[int], limit: int = 20) -> str:
    """``3, 7-9, 14``: runs of consecutive steps as ranges, at most ``limit`` of them."""
    groups: list[list[int]] = []
    for n in steps:
        if groups and n == groups[-1][-1] + 1:
            groups[-1].append(n)
        else:
            groups.append([n])
    parts = [str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups]
    more = f", ... ({len(parts) - limit} more ranges)" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


# ------------------------------------------------------------------------------- drawing


def default_output_dir(log_path: str | Path) -> Path:
    """Where the plots go without ``-o``: ``run.jsonl`` -> ``run_report/`` next to it."""
    p = Path(log_path)
    return p.with_name(p.stem + "_report")


def render(telemetry: Telemetry, out_dir: str | Path) -> list[Path]:
    """Write the three PNG plots of :data:`PLOTS` into ``out_dir`` (created if needed); return
    their paths.

    Drawn with matplotlib's Agg canvas directly, not pyplot, so it neither needs a display nor
    changes the backend of a program (a notebook) that already uses pyplot.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = telemetry.steps
    x = [s.step for s in steps]
    skipped = [s.step for s in steps if s.skipped]
    names = telemetry.layer_names
    colors = _colors(len(names))
    written = []

    def save(fig: Figure, key: str) -> None:
        FigureCanvasAgg(fig)
        for ax in fig.axes:  # steps are whole numbers
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        path = out / PLOTS[key]
        fig.savefig(path, dpi=110, bbox_inches="tight")
        written.append(path)
        log.debug("wrote %s", path)

    # Per-layer scales: powers of two, so a log2 axis shows each halving/doubling as one step.
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for name, color in zip(names, colors, strict=True):
        ax.plot(x, [s.layers[name].scale if name in s.layers else math.nan for s in steps],
                label=name, color=color, drawstyle="steps-post", linewidth=1.2)
    _mark_skipped(ax, skipped)
    ax.set(title=f"Per-layer gradient scales - {telemetry.path.name}", xlabel="step", ylabel="scale")
    if names:
        ax.set_yscale("log", base=2)
        _legend(ax, len(names))
    else:
        _empty(ax, "no per-layer scales in this log (scaler mode other than 'adaptive')")
    save(fig, "scales")

    # Zero (underflow) rates: the interesting range spans decades (1e-4 vs 1e-2), and 0 is common,
    # hence symlog. Skipped steps are gaps: their gradients were inf/nan.
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for name, color in zip(names, colors, strict=True):
        ax.plot(x, [s.layers[name].zero_rate if name in s.layers and not s.skipped else math.nan for s in steps],
                label=name, color=color, linewidth=1.2)
    _mark_skipped(ax, skipped)
    ax.set(title=f"Weight-gradient zero (underflow) rate per layer - {telemetry.path.name}", xlabel="step",
           ylabel="fraction of entries exactly 0")
    if names:
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_ylim(-3e-5, 1)  # a little below 0: a layer with no zeros stays visible above the axis
        _legend(ax, len(names))
    else:
        _empty(ax, "no per-layer statistics in this log (scaler mode other than 'adaptive')")
    save(fig, "zero_rates")

    # Skipped steps: the loss scale with the skipped steps marked, and their running count.
    fig = Figure(figsize=(8, 5))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    top.plot(x, [s.loss_scale for s in steps], color="tab:blue", drawstyle="steps-post", label="loss scale")
    if skipped:
        top.plot(skipped, [s.loss_scale for s in steps if s.skipped], "x", color="tab:red", markersize=7,
                 label="skipped step")
    top.set_yscale("log", base=2)
    top.set(title=f"Loss scale and skipped steps - {telemetry.path.name}", ylabel="loss scale")
    if names and all(s.loss_scale == 1.0 for s in steps):
        top.text(0.01, 0.04, "adaptive mode: the loss scale stays 1, each layer scales its own gradients",
                 transform=top.transAxes, fontsize="small", color="0.4")
    top.legend(loc="best", fontsize="small")
    count, running = [], 0
    for s in steps:
        running += s.skipped
        count.append(running)
    bottom.plot(x, count, color="tab:red", drawstyle="steps-post")
    bottom.set(xlabel="step", ylabel="skipped so far")
    bottom.set_ylim(bottom=0, top=max(1, running) * 1.1)
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    save(fig, "skipped")
    return written


def _colors(n: int) -> list[Any]:
    """Matplotlib's default cycle for a few layers; a colormap by depth for many, where the cycle
    would repeat and the order of layers is the more useful thing to see."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(i / (n - 1)) for i in range(n)]


def _mark_skipped(ax: Any, skipped: Sequence[int]) -> None:
    if skipped:
        ax.vlines(skipped, 0, 1, transform=ax.get_xaxis_transform(), colors="tab:red", alpha=0.25,
                  linewidth=1, label="skipped step")


def _legend(ax: Any, n: int) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", ncol=max(1, math.ceil(n / 25)),
              frameon=False)


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")
