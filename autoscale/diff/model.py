"""The data model of a graph diff: frozen dataclasses that say, node by node, what the pipeline changed.

These are what users of :func:`autoscale.diff.diff` get and read; ``autoscale.diff.align`` builds
them from the captured graphs. They hold plain values (no FX nodes or modules), so a diff outlives
the graphs it was made from. Rendering is the format modules' job: :class:`GraphDiff`'s ``to_*``
methods, the public way to render, hand the diff to them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from autoscale.diff.notes import share_text
from autoscale.inspect import Island
from autoscale.layer_numbers import LayerNumbers
from autoscale.report import LayerSummary

__all__ = [
    "DiffSummary",
    "FoldedCast",
    "GraphDiff",
    "GraphSection",
    "Kind",
    "LayerRow",
    "NodeEntry",
    "OverflowDecision",
    "OverflowSource",
    "PassCount",
    "Provenance",
    "ScaleInfo",
    "ScaleKind",
    "Status",
]

Status = Literal["unchanged", "changed", "inserted", "removed"]
Kind = Literal["input", "output", "op", "emulated", "cast", "scale", "unscale", "align", "scale_op", "check", "stats"]
ScaleKind = Literal["scale", "unscale", "align"]
OverflowSource = Literal["predicted", "promoted", "follows"]


@dataclass(frozen=True)
class Provenance:
    """Which pass made or decided a node, for which layer, and why (``node.meta["autoscale"]``).

    ``created``: the pass inserted the node. ``precision``: the dtype the precision pass painted an
    existing op. ``derived_from``: for a backward node, the forward (Dynamo) node whose gradient it
    computes, when that node carries the provenance.
    """

    pass_name: str
    layer: str
    reason: str
    created: bool = False
    precision: str | None = None
    derived_from: str | None = None


@dataclass(frozen=True)
class ScaleInfo:
    """One gradient rescale point (``autoscale.ops.rescale``) and what the analysis predicts for it.

    ``kind``: "scale" (a scale point: the gradient leaves it carrying its layer's scale), "unscale"
    (a parameter's gradient brought back to the loss scale) or "align" (branches with different
    scales aligned where they merge). ``row``: the row of the scaler's state it sets (the only one of
    ``out_rows``). ``underflow``: the predicted float16 underflow rate of the gradients it governs
    at scale 1 (the worst one; None where the analysis could not predict one). ``amax``: their
    predicted largest magnitude. ``scale``/``arriving_scale``: the initial scales (the first step's)
    of ``out_rows``/``in_rows``, so the gradient is multiplied by ``scale / arriving_scale``.
    ``backward_nodes``: how many ATen nodes its backward became.
    """

    node: str
    graph: int
    kind: ScaleKind
    layer: str
    row: int | None
    out_rows: tuple[int, ...]
    in_rows: tuple[int, ...]
    record_rows: tuple[int, ...]
    underflow: float | None
    amax: float | None
    scale: float
    arriving_scale: float
    reason: str
    backward_nodes: int = 0


@dataclass(frozen=True)
class NodeEntry:
    """One node of the diff: a node before paired with the node after (either may be absent).

    ``before``/``after`` are the nodes' lines as ``autoscale.inspect.format_graph`` prints them.
    ``underflow`` is the analysis' predicted float16 underflow rate of the node's gradient at
    scale 1 (forward nodes). ``scale`` is set on forward rescale nodes; ``scale_op`` names the
    forward rescale node a backward node belongs to. Kind "check" is a forward-overflow check
    (``autoscale.ops.watch``) and kind "stats" a node of the fold of the rescale points'
    statistics (``autoscale/passes/joint/batch_records.py``): they compute nothing the model reads, so the
    renderings mute them.
    """

    graph: int
    name: str
    before_name: str | None
    status: Status
    kind: Kind
    op: str
    before: str | None
    after: str | None
    dtype_before: str | None
    dtype_after: str | None
    layer: str
    provenance: Provenance | None
    underflow: float | None = None
    scale: ScaleInfo | None = None
    scale_op: str | None = None


@dataclass(frozen=True)
class OverflowDecision:
    """A forward op kept in float32 because float16 cannot hold a value (docs/design.md#forward-overflow).

    These are the decisions that make a model with large activations (a T5 feed-forward) train at
    all, so the diff lists them apart from the other float32 islands. ``source``: "predicted" (the
    analysis' max |x| exceeds ``Config.overflow.threshold`` x 65504), "promoted" (the
    ``GradScaler`` saw it overflow at run time and moved it to float32) or "follows" (it reads such
    a value, which a cast into float16 would make inf). ``node`` is the node's name in the
    rewritten forward graph, ``layer`` its module path ("" for the model's top level).
    ``predicted_max``: the analysis' predicted max |x| of its value (None where it predicted none,
    or nothing finite).
    ``reason``: the precision pass's reason, as recorded on the node.
    """

    graph: int
    node: str
    layer: str
    op: str
    source: OverflowSource
    predicted_max: float | None
    reason: str


@dataclass(frozen=True)
class FoldedCast:
    """A cast ``fold_casts`` erased. ``created_by`` is the pass that had inserted it (None: the
    model's own cast, which then also shows as a removed node). ``side`` is the half of the joint
    graph it was in (joint stage only)."""

    graph: int
    name: str
    text: str
    stage: Literal["dynamo", "joint"]
    created_by: str | None
    side: Literal["forward", "backward"] | None = None


@dataclass(frozen=True)
class LayerRow:
    """One layer (module path) of the per-layer map, the first thing every rendering shows: what
    autoscale decided for it and what it expects of its gradients and values.

    ``module``: the module's class name ("" when unknown). ``low_ops``/``float32_ops``: its
    forward ops by the dtype the precision pass gave them (``low_dtype``, the diff's float16 or
    bfloat16, or float32), ``reason`` why the float32 ones are
    float32 (the most frequent reason; "" when none is) and ``overflow`` whether one of them is kept
    in float32 for forward overflow. ``weights``: whether it owns parameters that take a
    gradient. ``scale_rows``: the rows of the scaler's state its scale
    points set (usually one) and ``scale`` the largest of their initial, seeded scales (None: no
    scale point). ``predicted``: the analysis' numbers at scale 1 (``autoscale.layer_numbers``);
    ``measured``: the same numbers measured on one float32 step, when the diff was asked to
    measure; ``run``: what a training run's ``GradScaler`` telemetry says of the layer (its scale
    over the run, the zero rate of its float16 weight gradient at that scale, its overflows), when
    the diff was given the log. ``graph``: the first graph the layer appears in.
    """

    layer: str
    module: str
    graph: int
    low_dtype: str
    low_ops: int
    float32_ops: int
    reason: str
    overflow: bool
    weights: bool
    scale_rows: tuple[int, ...]
    scale: float | None
    predicted: LayerNumbers | None
    measured: LayerNumbers | None = None
    run: LayerSummary | None = None

    @property
    def precision(self) -> str:
        """The low dtype (float16, bfloat16) or float32 when all its ops have it, "mixed" when both
        occur, "none" without float ops."""
        if self.low_ops and self.float32_ops:
            return "mixed"
        return self.low_dtype if self.low_ops else "float32" if self.float32_ops else "none"


@dataclass(frozen=True)
class GraphSection:
    """The forward (Dynamo graph, before and after the dynamo stage) or the backward (AOTAutograd's
    backward graph of the unrewritten and of the rewritten forward) part of a diff."""

    name: Literal["forward", "backward"]
    entries: tuple[NodeEntry, ...]
    folded: tuple[FoldedCast, ...] = ()
    islands: tuple[Island, ...] = ()

    def count(self, status: Status, kind: Kind | None = None) -> int:
        """Entries with ``status`` (and ``kind``, if given)."""
        return sum(1 for e in self.entries if e.status == status and (kind is None or e.kind == kind))

    def graphs(self) -> list[int]:
        """The graph indices present in this section, in order."""
        return sorted({e.graph for e in self.entries})


@dataclass(frozen=True)
class PassCount:
    """What one pass reported for one graph (``PassRecord`` without its timing)."""

    graph: int
    stage: Literal["dynamo", "joint"]
    name: str
    modified: bool
    counts: Mapping[str, int]


@dataclass(frozen=True)
class DiffSummary:
    """The headline numbers, summed over the model's graphs (one per graph break).

    ``converted``/``total``/``casts``/``islands``/``unknown_ops``: the precision report
    (``autoscale.inspect.precision_report``). ``emulated_ops``: ops computed in float32 from
    low-precision inputs (``compute="emulate"``).
    ``casts_folded``: casts ``fold_casts`` erased (both stages). ``backward_casts``: casts the
    backward graph gained outside the rescale points. ``scale_points``/``unscale_points``/
    ``align_points``: the rescale nodes ``insert_grad_scaling`` inserted. ``watched``: the
    forward-overflow checks ``insert_overflow_checks`` inserted (values watched at run time);
    ``float32_for_overflow``: ops kept in float32 for forward overflow (``GraphDiff.overflow``).
    ``max_underflow``: the largest predicted share of a layer's weight-gradient entries that
    float16 would flush to zero without scaling (at scale 1), over the layers with a prediction;
    ``max_underflow_layer`` that layer; ``underflow_unknown`` how many layers with weights the
    analysis could not predict it for.
    """

    dtype: str
    compute: str
    graphs: int
    converted: int
    total: int
    casts: int
    emulated_ops: int
    casts_folded: int
    backward_casts: int
    scale_points: int
    unscale_points: int
    align_points: int
    watched: int
    float32_for_overflow: int
    max_underflow: float | None
    max_underflow_layer: str | None
    underflow_unknown: int
    islands: tuple[Island, ...]
    unknown_ops: tuple[str, ...]
    passes: tuple[PassCount, ...]

    def __str__(self) -> str:
        text = (f"converted {self.converted} of {self.total} nodes to {self.dtype}, {self.casts} casts, "
                f"{self.scale_points} scale point{'' if self.scale_points == 1 else 's'}")
        if self.max_underflow is not None:
            text += (f"; unscaled, float16 would flush to zero up to {share_text(self.max_underflow)} of a weight "
                     f"gradient ({self.max_underflow_layer or '(model)'}, predicted)")
        if self.underflow_unknown:
            text += f"; not predicted for {self.underflow_unknown} layer{'s' if self.underflow_unknown > 1 else ''}"
        return text


@dataclass(frozen=True)
class GraphDiff:
    """What the pipeline changed, node by node, in the forward and the backward graphs.

    ``layers``: the per-layer map, in the order the layers first compute; ``scale_ops``: the
    gradient rescale points; ``overflow``: the ops kept in float32 for forward overflow, in graph
    order.
    """

    forward: GraphSection
    backward: GraphSection
    summary: DiffSummary
    scale_ops: tuple[ScaleInfo, ...] = field(default=())
    overflow: tuple[OverflowDecision, ...] = field(default=())
    layers: tuple[LayerRow, ...] = field(default=())

    def to_text(self, *, color: bool = False, backward_only: bool = False, expand_scale_ops: bool = False,
                summary_only: bool = False) -> str:
        """The summary and the per-layer map, then a unified diff of the readable graphs, with
        provenance annotations.

        ANSI colours only with ``color`` (the CLI passes ``sys.stdout.isatty()``). The ATen nodes
        of each rescale point's backward are one line unless ``expand_scale_ops``: a point is ~50
        nodes, which would drown the rest of the backward. ``summary_only``: the summary and the
        map alone, which fit a terminal where the node diff runs to thousands of lines.
        """
        from autoscale.diff.text_format import render_text  # (the renderers depend on the model, not back)

        return render_text(self, color=color, backward_only=backward_only, expand=expand_scale_ops,
                           summary_only=summary_only)

    def to_json(self, *, backward_only: bool = False) -> dict[str, Any]:
        """A JSON-ready dict that validates against ``autoscale/diff/schema.json`` (see :func:`schema`)."""
        from autoscale.diff.json_format import render_json

        return render_json(self, backward_only=backward_only)

    def to_html(self, *, backward_only: bool = False) -> str:
        """One self-contained HTML page (inline CSS and JS, no network): before and after side by
        side, inserted casts and rescale points highlighted, the numbers on hover and in tables."""
        from autoscale.diff.html_format import render_html

        return render_html(self, backward_only=backward_only)

    def __str__(self) -> str:
        return str(self.summary)
