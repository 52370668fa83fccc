"""Graph-diff inspection: what autoscale's pipeline changed in a model's forward and backward graphs.

``diff(model, example_inputs)`` captures the model with Dynamo as the backend would, keeps a copy
of the graph before the passes, runs the same pipeline, then runs AOTAutograd on both graphs (the
joint-stage passes on the rewritten one) to get the backward graphs. The result, a
:class:`GraphDiff`, pairs every node before with the node after and says what happened to it
(unchanged, changed, inserted, removed), which pass did it and why (``node.meta["autoscale"]``),
its dtype before and after, for the gradient rescale points their layer, row, predicted float16
underflow rate and the initial scale the analysis chose, and the ops kept in float32 for forward
overflow (predicted, promoted by the ``GradScaler`` at run time, or following one of those) with
the values the compiled forward watches. It renders as a unified diff
(``to_text``), as JSON that validates against ``autoscale/diff/schema.json`` (``to_json``) and as
one self-contained HTML page (``to_html``). docs/diff.md describes every field.

The diff never touches the user's model: it works on a deep copy (with the scaler's state
installed on the copy when the configuration scales gradients adaptively), and the pipeline's
passes run exactly as in ``autoscale.backend`` (seeding, calibration, ``run_stage``), each wrapped
only to observe which nodes it erased.

The package does one job a module: ``capture`` (the graphs before and after the pipeline),
``align`` (pairing their nodes into the diff), ``model`` (the diff's dataclasses, below), and the
renderings ``text_format``, ``json_format`` (with :func:`schema`) and ``html_format``; ``api`` holds
:func:`diff`. Only the names below are public.
"""

from __future__ import annotations

from autoscale.diff.api import diff
from autoscale.diff.json_format import SCHEMA_VERSION, schema
from autoscale.diff.model import (
    DiffSummary,
    FoldedCast,
    GraphDiff,
    GraphSection,
    NodeEntry,
    OverflowDecision,
    PassCount,
    Provenance,
    ScaleInfo,
)

__all__ = [
    "SCHEMA_VERSION",
    "DiffSummary",
    "FoldedCast",
    "GraphDiff",
    "GraphSection",
    "NodeEntry",
    "OverflowDecision",
    "PassCount",
    "Provenance",
    "ScaleInfo",
    "diff",
    "schema",
]
