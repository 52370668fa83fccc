"""The JSON rendering of a graph diff, and its schema.

``render_json`` turns a :class:`~autoscale.diff.model.GraphDiff` into plain dicts and lists that
validate against ``schema.json`` next to this module (package data, read by :func:`schema`), so
tools can read a diff without importing autoscale. ``SCHEMA_VERSION`` says which document it is.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import TYPE_CHECKING, Any

from autoscale.diff.model import (
    GraphDiff,
    GraphSection,
    LayerRow,
    NodeEntry,
    OverflowDecision,
    Provenance,
    ScaleInfo,
)

if TYPE_CHECKING:
    from autoscale.inspect import Island
    from autoscale.layer_numbers import LayerNumbers

__all__ = ["SCHEMA_VERSION", "render_json", "schema"]

SCHEMA_VERSION = 5
"""Version of the JSON document ``GraphDiff.to_json`` returns; bumped on any incompatible change."""


def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``GraphDiff.to_json``'s document."""
    text = resources.files("autoscale.diff").joinpath("schema.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def _json_provenance(p: Provenance | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {"pass": p.pass_name, "layer": p.layer, "reason": p.reason, "created": p.created,
            "precision": p.precision, "derived_from": p.derived_from}


def _json_scale(s: ScaleInfo) -> dict[str, Any]:
    return {"node": s.node, "graph": s.graph, "kind": s.kind, "layer": s.layer, "row": s.row,
            "out_rows": list(s.out_rows), "in_rows": list(s.in_rows), "record_rows": list(s.record_rows),
            "underflow": s.underflow, "amax": s.amax, "scale": s.scale, "arriving_scale": s.arriving_scale,
            "reason": s.reason, "backward_nodes": s.backward_nodes}


def _json_numbers(n: LayerNumbers | None) -> dict[str, Any] | None:
    if n is None:
        return None
    return {"weight_underflow": n.weight_underflow, "weight_grad_max": n.weight_grad_max,
            "grad_underflow": n.grad_underflow, "grad_max": n.grad_max, "forward_max": n.forward_max}


def _json_layer(r: LayerRow) -> dict[str, Any]:
    return {"layer": r.layer, "module": r.module, "graph": r.graph, "precision": r.precision,
            "low_dtype": r.low_dtype, "low_ops": r.low_ops, "float32_ops": r.float32_ops, "reason": r.reason,
            "overflow": r.overflow, "weights": r.weights, "scale_rows": list(r.scale_rows), "scale": r.scale,
            "predicted": _json_numbers(r.predicted), "measured": _json_numbers(r.measured),
            "run": None if r.run is None else {
                "final_scale": r.run.final_scale, "min_scale": r.run.min_scale, "max_scale": r.run.max_scale,
                "mean_zero_rate": None if math.isnan(r.run.mean_zero_rate) else r.run.mean_zero_rate,
                "max_zero_rate": None if math.isnan(r.run.max_zero_rate) else r.run.max_zero_rate,
                "overflows": r.run.overflows}}


def _json_overflow(o: OverflowDecision) -> dict[str, Any]:
    return {"graph": o.graph, "node": o.node, "layer": o.layer, "op": o.op, "source": o.source,
            "predicted_max": o.predicted_max, "reason": o.reason}


def _json_entry(e: NodeEntry) -> dict[str, Any]:
    return {"graph": e.graph, "name": e.name, "before_name": e.before_name, "status": e.status, "kind": e.kind,
            "op": e.op, "before": e.before, "after": e.after, "dtype_before": e.dtype_before,
            "dtype_after": e.dtype_after, "layer": e.layer, "provenance": _json_provenance(e.provenance),
            "underflow": e.underflow, "scale": e.scale.node if e.scale is not None else None,
            "scale_op": e.scale_op}


def _json_section(section: GraphSection) -> dict[str, Any]:
    return {
        "entries": [_json_entry(e) for e in section.entries],
        "counts": {k: section.count(k) for k in ("unchanged", "changed", "inserted", "removed")},
        "folded": [{"graph": f.graph, "name": f.name, "text": f.text, "stage": f.stage, "created_by": f.created_by,
                    "side": f.side} for f in section.folded],
    }


def _json_island(i: Island) -> dict[str, Any]:
    return {"op": i.op, "reason": i.reason, "nodes": list(i.nodes)}


def render_json(d: GraphDiff, *, backward_only: bool) -> dict[str, Any]:
    """``GraphDiff.to_json``'s document: the diff's fields under the schema's names, with scale
    points referred to by node name in the entries (their numbers are in ``scale_ops``) and the
    forward-overflow decisions under ``overflow`` (also with ``backward_only``: like the summary,
    they say what the model computes in float32, which the backward inherits)."""
    s = d.summary
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "summary": {
            "text": str(s), "dtype": s.dtype, "compute": s.compute, "graphs": s.graphs,
            "converted": s.converted, "total": s.total, "casts": s.casts, "emulated_ops": s.emulated_ops,
            "casts_folded": s.casts_folded, "backward_casts": s.backward_casts, "scale_points": s.scale_points,
            "unscale_points": s.unscale_points, "align_points": s.align_points, "watched": s.watched,
            "float32_for_overflow": s.float32_for_overflow,
            "max_underflow": s.max_underflow, "max_underflow_layer": s.max_underflow_layer,
            "underflow_unknown": s.underflow_unknown,
            "islands": [_json_island(i) for i in s.islands], "unknown_ops": list(s.unknown_ops),
            "passes": [{"graph": p.graph, "stage": p.stage, "name": p.name, "modified": p.modified,
                        "counts": dict(p.counts)} for p in s.passes],
        },
        "layers": [_json_layer(r) for r in d.layers],
        "scale_ops": [_json_scale(i) for i in d.scale_ops],
        "overflow": {"watched": s.watched, "float32": [_json_overflow(o) for o in d.overflow]},
        "backward": _json_section(d.backward),
    }
    if not backward_only:
        doc["forward"] = _json_section(d.forward)
    return doc
