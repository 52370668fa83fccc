"""The scaler's tensor protocol: what the compiled graphs and ``GradScaler`` share, by position.

A scaled model's graphs take three state tensors as inputs (``autoscale.ops.attach`` lifts them):

* ``scales``: one float32 scale per row. Row ``LOSS_ROW`` is the loss's, always 1; every other row
  is a layer's (the layer of each row is the graph's *layout*: layer names joined by
  ``LAYOUT_SEP``). A scale is an absolute target: the total scale a gradient carries after that
  layer's scale point.
* ``stats``: ``[rows, NUM_STATS]``, the backward's measurements, in the columns ``STAT`` names;
  each cell is written by max or by sum of what the points record (the record modes below).
* ``peaks``: one slot per forward overflow check, each the largest magnitude it watched.

``Form`` says how the points, checks and the update lay out their work for a device's kernels;
``Config.form`` names one of ``FORMS``, which the graph's ops carry by name.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

import torch

__all__ = [
    "ANY_NONFINITE", "ARRIVED", "BAD", "E4M3_MAX", "E5M2_MAX", "FORMS", "FP16_MAX", "LAYOUT_SEP", "LOSS_ROW", "MADE",
    "MAX", "NUM_STATS", "PART_SIZE", "PEAK", "PROMOTED_SEP", "ROW_SIZE", "SCALE_RANGE", "STAT", "SUM", "Form",
    "gradient_max", "headroom",
]

# ---- the statistics tensor

STAT = MappingProxyType({"nonfinite": 0, "amax": 1, "sum": 2, "sumsq": 3, "count": 4, "zeros": 5, "numel": 6})
"""Columns of the stats tensor (one row per layer). ``nonfinite`` is a flag (1 when a gradient the
row's scale produced was inf/nan), ``amax`` the largest magnitude at unit scale; ``sum``, ``sumsq``
and ``count`` are recorded for the "paper" rule only, ``zeros`` and ``numel`` of parameter
gradients (their zero rate, reported per layer)."""
NUM_STATS = len(STAT)
LOSS_ROW = 0
"""The row of the scale the loss's gradient starts with: 1, always (a layer's row is never row 0,
the update keeps it, and the scaler multiplies the loss outside the graphs). So eagerly a point does
not read it; a compiled graph's reduction over a set's rows reads it as the 1 it is
(``autoscale/passes/joint/batch_row_reads.py``)."""
ANY_NONFINITE = STAT["amax"]
"""The cell of row 0 (the loss scale's, which no rule moves and no point measures) that holds
whether any point saw a non-finite value: ``GradScaler.step`` reads this one value (flat index)."""

# What a cell takes of a recorded value (``autoscale.measure.MODES``). A point's value is its
# gradient's largest magnitude at unit scale, +inf or nan when a value arrived non-finite, and -1
# when the point's scaling made a finite value overflow. The modes read it as:
MAX = 0  # the value, combined by max (nan kept: the forward's peaks)
SUM = 1  # the value, summed (counts, moments)
PEAK = 2  # the largest magnitude: the value where it is one (>= 0 and finite), else 0; max
ARRIVED = 3  # 1 if a value arrived non-finite (the value is not below inf), else 0; max
MADE = 4  # 1 if the scaling made one (the value is negative), else 0; max
BAD = 5  # 1 if either, else 0; max

# The marker ops carry lists of names packed into one string (a custom op's schema has ``str``, not
# ``str[]``, and Dynamo guards on it): a layout's rows, the promoted forward-overflow sites.
LAYOUT_SEP = "\x1f"
PROMOTED_SEP = "\x1e"

# ---- the formats and the scales' range

FP16_MAX = 65504.0
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: float8's forward format
E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)  # 57344: float8's backward format

SCALE_RANGE = (2.0**-24, 2.0**40)
"""The per-layer scales' range: far beyond what float16 needs (a gradient scaled by 2^40 would
have been ~1e-12 at unit scale, below every float16 value), and well inside float32's, so a scale,
its reciprocal and a product of two stay finite."""


def headroom(margin: int, fmax: float = FP16_MAX) -> float:
    """The largest gradient magnitude a scale may aim for: the gradient format's max (float16's,
    or E5M2's under ``Config.float8``), ``2**margin`` below."""
    return fmax / 2.0**margin


def gradient_max(float8: bool) -> float:
    """The largest finite value of the format gradients are rounded to."""
    return E5M2_MAX if float8 else FP16_MAX


# ---- how a device's kernels take the work


class Form(NamedTuple):
    """How points, checks and the update lay out their work on one kind of device. Either way they
    compute the same numbers; what differs is how many passes over a gradient, and how many kernel
    launches, Inductor makes of them."""

    in_place: bool
    """A point's output depends on its peak (``autoscale.measure.scale_and_measure``), so that
    Inductor writes it over the gradient's own buffer, in a second, cache-warm pass after the
    peak's: on a CPU a cold buffer costs more than that pass (docs/results/overhead_quick.md). On a
    GPU the second pass is a launch of its own per point; without the dependency the producer's
    kernel writes the output."""
    parts: int
    """The most partial results a reduction over a whole value hands to the fold, which reduces them
    for every point at once (``autoscale/passes/joint/batch_records.py``); 1 is a full reduction. Inductor
    splits a GPU's full reduction of a large value into two launches, partial results then their
    reduction: handed as partial results, the first is fused into the value's producer and the
    second is the fold's. On a CPU a full reduction is one loop of the producer's kernel."""
    rows: int = 0
    """The most rows whose partial results a value's reduction hands on, one per row, where the value
    has more elements than ``parts``: its elements over its innermost dimension in memory, of at least
    ``ROW_SIZE`` of them. Inductor fuses two kernels that read one buffer only where both read it at
    the same indices (``Scheduler.score_fusion_memory``): reduced row by row, a value is read as the
    kernels reading it by rows (a layer norm's, a softmax's, a point's scaled write) read it, and
    Inductor computes the reduction in those kernels (``benchmarks.kernel_counts``)."""
    fused_update: bool = False
    """The scaler's update runs as one Triton launch (``autoscale.kernels.update``), where Inductor
    makes it seven kernels on a GPU. On a CPU Inductor makes it one C++ kernel (and Triton has no
    CPU backend)."""
    lay_out: bool = False
    """A traced reduction's partial results are marked (``autoscale.ops.partials``) for the joint
    stage's ``lay_out_partials``, which reads them in the order Inductor lays the value out
    (channels-last convolutions): otherwise they are read in the traced order."""


FORMS = MappingProxyType({
    "default": Form(in_place=True, parts=1),
    "fewer_launches": Form(in_place=False, parts=512, rows=1024, fused_update=True, lay_out=True),
    "fewer_launches_in_parts": Form(in_place=False, parts=512, fused_update=True, lay_out=True),
})
"""The forms by name (``Config.form``); a graph's points and checks carry theirs. "default" is the
form every device takes, the one timed on CPUs and GPUs alike. "fewer_launches" lays the work out
for a GPU's launch count: counted offline (``benchmarks.kernel_counts``), never yet timed on a GPU,
so no device takes it by default. "fewer_launches_in_parts" is the same without ``Form.rows``, which
the kernel counts weigh it against."""

PART_SIZE = 1024
"""The fewest elements a partial result reduces, but for a value of no more elements than its form's
``parts``, whose elements are handed on as they are, and for a row (``ROW_SIZE``)."""
ROW_SIZE = 16
"""The fewest elements of a row whose partial result a value's reduction hands on (``Form.rows``):
fewer, as a convolution weight's rows of 3, and the value is split into parts (``Form.parts``)."""

