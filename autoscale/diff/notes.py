"""How a diff words its numbers and notes, shared by the summary line, the text diff and the HTML page.

One place for these keeps the three saying the same thing in the same way: a rate as ``6.7e-06``,
a power-of-two scale as ``2^k``, a rescale point's one-line note and the summary's detail lines.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autoscale.diff.model import DiffSummary, GraphDiff, ScaleInfo

__all__ = ["rate_text", "scale_note", "scale_text", "summary_details"]


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


def summary_details(s: DiffSummary, d: GraphDiff) -> list[str]:
    """The lines under the summary: dtype and compute, rescale points and casts by kind, the FP32
    islands and the unknown ops."""
    emulated = f" ({s.emulated_ops} ops emulated)" if s.compute == "emulate" else ""
    lines = [f"dtype {s.dtype}, compute {s.compute}{emulated}, {s.graphs} graph{'s' if s.graphs != 1 else ''}; "
             f"rescale points: {s.scale_points} scale, {s.unscale_points} unscale, {s.align_points} align; "
             f"casts: {s.casts} precision, {s.backward_casts} in the backward, {s.casts_folded} folded"]
    if s.islands:
        lines.append("FP32 islands: " + "; ".join(
            f"{i.op}{f' x{len(i.nodes)}' if len(i.nodes) > 1 else ''} -> {i.reason}" for i in s.islands))
    if s.unknown_ops:
        lines.append("unknown ops (kept in float32): " + ", ".join(s.unknown_ops))
    return lines
