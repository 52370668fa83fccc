"""How a diff words its numbers and notes, shared by the summary line, the text diff and the HTML page.

One place for these keeps the three saying the same thing in the same way: a rate as ``6.7e-06``,
a power-of-two scale as ``2^k``, a rescale point's one-line note, a forward-overflow decision's
one-line note and the summary's detail lines.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from autoscale.ops import FP16_MAX
from autoscale.overflow import OVERFLOW_REASON

if TYPE_CHECKING:
    from autoscale.diff.model import DiffSummary, GraphDiff, OverflowDecision, ScaleInfo

__all__ = ["overflow_line", "overflow_note", "rate_text", "scale_note", "scale_text", "summary_details"]


def rate_text(x: float) -> str:
    """A rate (an underflow fraction) in two significant digits: enough to compare, short in a line."""
    return f"{x:.1e}"


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
        lines.append("FP32 islands: " + "; ".join(
            f"{i.op}{f' x{len(i.nodes)}' if len(i.nodes) > 1 else ''} -> {i.reason}" for i in s.islands))
    if s.unknown_ops:
        lines.append("unknown ops (kept in float32): " + ", ".join(s.unknown_ops))
    return lines
