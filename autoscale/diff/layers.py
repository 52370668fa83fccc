"""The per-layer map of a graph diff: one :class:`~autoscale.diff.model.LayerRow` per module path.

A user's first questions about an FP16 run are per layer, not per node: which layers run in
float16 and which stay float32 and why, where gradients would underflow and activations overflow,
and what autoscale did about it (a scale point and its seeded scale). The rows gather that from
what capture and alignment already know: the precision pass's decisions on the rewritten forward
graph, the rescale points, the forward-overflow decisions, and the analysis' per-layer numbers
(measured ones beside them when the diff measured).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import torch
from torch.fx import Node

from autoscale.diff.capture import CapturedGraph
from autoscale.diff.model import LayerRow, OverflowDecision, ScaleInfo
from autoscale.passes.graph_utils import PROVENANCE_KEY, layer_of, module_entry, tensor_val
from autoscale.report import LayerSummary

__all__ = ["layer_rows", "worst_underflow"]

_OPS = ("call_function", "call_method", "call_module")


def layer_rows(graphs: Iterable[CapturedGraph], infos: Iterable[ScaleInfo], overflow: Iterable[OverflowDecision],
               low_dtype: str, run: Mapping[str, LayerSummary] | None = None) -> tuple[LayerRow, ...]:
    """The map's rows, in the order the layers first compute in the forward (graph by graph);
    a layer that computes nothing but owns a parameter (predicted for it) comes after.
    ``low_dtype``: the diff's float16 or bfloat16. ``run``: a telemetry log's per-layer summary, by
    the scaler's layer names (module paths)."""
    scale_points: dict[str, list[ScaleInfo]] = {}
    for info in infos:
        if info.kind == "scale" and info.row is not None:
            scale_points.setdefault(info.layer, []).append(info)
    overflowing = {o.layer for o in overflow}
    rows: dict[str, LayerRow] = {}
    for g in graphs:
        ops = _layer_ops(g.after.graph.nodes)
        predicted = g.dynamo.predicted
        measured = g.dynamo.measured or {}
        for layer in [*ops, *(k for k in predicted if k not in ops)]:
            if layer in rows:
                continue
            mine = ops.get(layer, [])
            dtypes = Counter(_painted(n) for n in mine)
            reasons = Counter(str((n.meta.get(PROVENANCE_KEY) or {}).get("reason", "")) for n in mine
                              if _painted(n) == "float32")
            points = scale_points.get(layer, [])
            rows[layer] = LayerRow(
                layer=layer, module=_module_class(mine), graph=g.index, low_dtype=low_dtype,
                low_ops=dtypes[low_dtype], float32_ops=dtypes["float32"],
                reason=reasons.most_common(1)[0][0] if reasons else "",
                overflow=layer in overflowing, weights=layer in g.dynamo.weighted,
                scale_rows=tuple(sorted({p.row for p in points if p.row is not None})),
                scale=max((p.scale for p in points), default=None), predicted=predicted.get(layer),
                measured=measured.get(layer), run=(run or {}).get(layer))
    return tuple(rows.values())


def worst_underflow(rows: Iterable[LayerRow]) -> tuple[float | None, str | None, int]:
    """The largest predicted weight-gradient underflow share and its layer, and how many layers
    with weights have no prediction of it (the summary's headline)."""
    worst: tuple[float, str] | None = None
    unknown = 0
    for r in rows:
        share = r.predicted.weight_underflow if r.predicted is not None else None
        if share is None:
            unknown += r.weights
        elif worst is None or share > worst[0]:
            worst = (share, r.layer)
    return (worst[0], worst[1], unknown) if worst else (None, None, unknown)


def _layer_ops(nodes: Iterable[Node]) -> Mapping[str, list[Node]]:
    """The model's own forward ops (not those a pass inserted) with a floating result, by layer."""
    ops: dict[str, list[Node]] = {}
    for n in nodes:
        if n.op not in _OPS or (n.meta.get(PROVENANCE_KEY) or {}).get("created"):
            continue
        val = tensor_val(n)
        if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
            ops.setdefault(layer_of(n), []).append(n)
    return ops


def _painted(n: Node) -> str | None:
    """The dtype the precision pass gave an op (the low dtype or float32), None if it decided nothing."""
    precision = (n.meta.get(PROVENANCE_KEY) or {}).get("precision")
    return str(precision) if precision else None


def _module_class(nodes: list[Node]) -> str:
    """The class name of the innermost module of the layer's ops (Dynamo's ``nn_module_stack``)."""
    for n in nodes:
        if n.meta.get("nn_module_stack") and (entry := module_entry(n)) is not None:
            _, cls = entry
            return cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
    return ""
