"""How a diff words its numbers and notes, shared by the summary line, the text diff and the HTML page.

One place for these keeps the three saying the same thing in the same way: a rate as ``6.7e-06``,
a power-of-two scale as ``2^k``, a rescale point's one-line note, a forward-overflow decision's
one-line note and the summary's detail lines.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from autoscale.overflow import OVERFLOW_REASON
from autoscale.protocol import FP16_MAX

if TYPE_CHECKING:
    from autoscale.diff.model import DiffSummary, GraphDiff, LayerRow, OverflowDecision, ScaleInfo
    from autoscale.layer_numbers import LayerNumbers

__all__ = ["LAYER_COLUMNS", "RUN_COLUMNS", "layer_cells", "map_columns", "overflow_line", "overflow_note", "rate_text",
           "scale_note", "scale_text", "share_text", "summary_details"]


def rate_text(x: float) -> str:
    """A rate (an underflow fraction) in two significant digits: enough to compare, short in a line."""
    return f"{x:.1e}"


def share_text(x: float) -> str:
    """A share of a tensor's entries (an underflow share) as a percentage in two significant
    digits, ``3.1%``, ``0.00017%``, ``0%``, and below one in a million ``<0.0001%`` (the JSON has
    the exact figure)."""
    return "0%" if x == 0 else "<0.0001%" if x < 1e-6 else f"{100 * x:.2g}%"


def scale_text(x: float) -> str:
    """Powers of two as ``2^k`` (the scales are powers of two), anything else as a number."""
    if x > 0:
        k = math.log2(x)
        if k == int(k):
            return f"2^{int(k)}"
    return f"{x:g}"


def scale_note(s: ScaleInfo) -> str:
    """A rescale point in one line: what it is, its rows, its predicted underflow and its scale."""
    parts = [f"{s.kind} point"]
    if s.kind == "scale":
        parts.append(f"layer {s.layer or '(model)'}, row {s.row}")
    else:
        parts.append(f"rows {list(s.in_rows)} -> {list(s.out_rows)}")
    if s.underflow is not None:
        parts.append(f"predicted underflow {rate_text(s.underflow)}")
    parts.append(f"initial scale {scale_text(s.scale)}" if s.kind == "scale"
                 else f"factor {scale_text(s.scale / s.arriving_scale)}")
    return ", ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def overflow_line(d: GraphDiff) -> str | None:
    """The forward-overflow line: how many ops were kept in float32, by source, and how many values
    the compiled forward watches. None when there is neither (bfloat16, ``Config.overflow`` off, no
    ``GradScaler`` state to watch with): a line of zeros would only be noise."""
    s = d.summary
    parts = []
    if s.float32_for_overflow:
        by = Counter(o.source for o in d.overflow)
        leaders = by["predicted"] + by["promoted"]
        parts.append(f"{_count(s.float32_for_overflow, 'op')} kept in float32 ({by['predicted']} predicted, "
                     f"{by['promoted']} promoted at run time, {by['follows']} "
                     f"{'follows' if by['follows'] == 1 else 'follow'} {'it' if leaders == 1 else 'them'})")
    if s.watched:
        parts.append(f"{_count(s.watched, 'value')} watched at run time")
    return "forward overflow: " + "; ".join(parts) if parts else None


def overflow_note(o: OverflowDecision, *, graph: bool = False) -> str:
    """One decision in one line: where (module path, op, node; its graph with ``graph``), then why,
    in the pass's words without the "forward overflow" they all begin with, and the predicted
    max |x| next to float16's, unless the reason already says it (a predicted op's does)."""
    where = f"node {o.node}" + (f" in graph {o.graph}" if graph else "")
    why = o.reason.removeprefix(OVERFLOW_REASON).lstrip(" :")
    text = f"{o.layer or '(model)'} {o.op} ({where}): {why}"
    if o.predicted_max is not None and "max |x|" not in why:
        text += f"; predicted max |x| {o.predicted_max:.3g} vs float16's {FP16_MAX:g}"
    return text


def summary_details(s: DiffSummary, d: GraphDiff, *, decisions: bool = False) -> list[str]:
    """The lines under the summary: dtype and compute, rescale points and casts by kind, forward
    overflow (with ``decisions``, one indented line per op kept in float32 under it: the text has
    no other place for them, the HTML page has a table), the FP32 islands and the unknown ops."""
    emulated = f" ({_count(s.emulated_ops, 'op')} emulated)" if s.compute == "emulate" else ""
    lines = [f"dtype {s.dtype}, compute {s.compute}{emulated}, {s.graphs} graph{'s' if s.graphs != 1 else ''}; "
             f"rescale points: {s.scale_points} scale, {s.unscale_points} unscale, {s.align_points} align; "
             f"casts: {s.casts} precision, {s.backward_casts} in the backward, {s.casts_folded} folded"]
    if (overflow := overflow_line(d)) is not None:
        lines.append(overflow)
        if decisions:
            lines.extend("  " + overflow_note(o, graph=s.graphs > 1) for o in d.overflow)
    if s.islands:
        ops = sum(len(i.nodes) for i in s.islands)
        lines.append(f"float32 islands: {_count(ops, 'op')} kept in float32 for {_count(len(s.islands), 'reason')} "
                     "(the per-layer map says which layers and why)")
    if s.unknown_ops:
        lines.append("unknown ops (kept in float32): " + ", ".join(s.unknown_ops))
    return lines


LAYER_COLUMNS = {
    "layer": "the module path",
    "module": "the module's class",
    "precision": "the dtype of its forward ops (float16 or bfloat16, float32, or mixed L/F: L low-precision ops, "
                 "F float32 ones)",
    "scale": "its gradient scale point: the initial scale the analysis seeded, and its row",
    "dW flushed": "the share of its weight-gradient entries float16 flushes to zero without scaling",
    "dY flushed": "the same share for the gradient arriving at its outputs",
    "|dY| max": "the largest magnitude of that gradient, at scale 1",
    "fwd max": f"the largest magnitude its forward computes (float16 holds up to {FP16_MAX:g})",
    "why float32": "why its float32 ops are float32",
}
"""The per-layer map's columns and what each says (the text's legend, the HTML headers' titles)."""

RUN_COLUMNS = {
    "run scale": "its scale in the telemetry's run: the last one, and the range it moved in",
    "run dW zeros": "the mean share of its float16 weight-gradient entries that were zero at that scale, over the "
                    "run's steps not skipped (underflow, and structural zeros such as ReLU's)",
    "run overflows": "the updates of the run at which its gradients overflowed",
}
"""The columns a telemetry log adds to the map (``diff(..., telemetry=LOG)``)."""


def map_columns(rows: Iterable[LayerRow]) -> dict[str, str]:
    """The map's columns for these rows: ``LAYER_COLUMNS``, with ``RUN_COLUMNS`` before the last
    (the reason, a sentence) when a row has telemetry."""
    columns = dict(LAYER_COLUMNS)
    if any(r.run is not None for r in rows):
        why = columns.pop("why float32")
        columns |= RUN_COLUMNS | {"why float32": why}
    return columns


def layer_cells(r: LayerRow) -> dict[str, str]:
    """A row of the per-layer map as text, one cell per ``LAYER_COLUMNS`` entry (and per
    ``RUN_COLUMNS`` entry when the row has telemetry): each predicted number followed by the
    measured one (``predicted / measured``) when the diff measured, "?" for a weight gradient the
    analysis could not predict, "-" for what the layer does not have."""
    p, m = r.predicted, r.measured

    def cell(get: str, fmt: Callable[[float], str], *, unknown: str = "-") -> str:
        pred = _number(p, get)
        text = fmt(pred) if pred is not None else unknown
        if m is not None:
            meas = _number(m, get)
            text += " / " + (fmt(meas) if meas is not None else "-")
        return text

    precision = r.precision if r.precision != "mixed" else f"mixed {r.low_ops}/{r.float32_ops}"
    scale = "-" if r.scale is None else f"{scale_text(r.scale)} (row {', '.join(map(str, r.scale_rows))})"
    fwd = cell("forward_max", _magnitude)
    run = {}
    if r.run is not None:
        low, high = scale_text(r.run.min_scale), scale_text(r.run.max_scale)
        run = {"run scale": scale_text(r.run.final_scale) + (f" ({low}..{high})" if low != high else ""),
               "run dW zeros": share_text(r.run.mean_zero_rate) if not math.isnan(r.run.mean_zero_rate) else "-",
               "run overflows": str(r.run.overflows)}
    return {
        **run,
        "layer": r.layer or "(model)", "module": r.module, "precision": precision,
        "scale": scale,
        "dW flushed": cell("weight_underflow", share_text, unknown="?" if r.weights else "-"),
        "dY flushed": cell("grad_underflow", share_text), "|dY| max": cell("grad_max", _magnitude),
        "fwd max": fwd, "why float32": r.reason,
    }


def _number(n: LayerNumbers | None, name: str) -> float | None:
    value = getattr(n, name) if n is not None else None
    return float(value) if value is not None else None


def _magnitude(x: float) -> str:
    """A magnitude in three significant digits, flagged ``!`` beyond float16's range."""
    return f"{x:.3g}" + (" !" if x > FP16_MAX else "")
