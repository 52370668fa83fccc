"""Alignment for a graph diff: pair each node before the pipeline with the node after, and build the diff.

The forward graphs pair by node name (the passes keep names); the backward graphs, which
AOTAutograd traces afresh, pair as a sequence diff on op and shape, with the gradients of nodes a
pass inserted marked inserted by construction (via autograd's sequence numbers). Each pair becomes
a :class:`~autoscale.diff.model.NodeEntry` with its status, provenance and rescale numbers; the
ops kept in float32 for forward overflow are read off the rewritten forward graphs as
:class:`~autoscale.diff.model.OverflowDecision`s; and :func:`assemble` sums the captured graphs
into one :class:`~autoscale.diff.model.GraphDiff`.
"""

from __future__ import annotations

import difflib
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from autoscale.config import Config
from autoscale.diff.capture import CapturedGraph, display_names, input_paths, node_lines
from autoscale.diff.layers import layer_rows, worst_underflow
from autoscale.diff.model import (
    DiffSummary,
    FoldedCast,
    GraphDiff,
    GraphSection,
    Kind,
    NodeEntry,
    OverflowDecision,
    OverflowSource,
    PassCount,
    Provenance,
    ScaleInfo,
    ScaleKind,
    Status,
)
from autoscale.inspect import Island
from autoscale.ops import rescale, watch
from autoscale.overflow import OVERFLOW_REASON
from autoscale.passes.analysis.analyze_underflow import MOMENTS_KEY
from autoscale.passes.dynamo.predict_overflow import FORWARD_KEY, PROMOTED_REASON
from autoscale.passes.graph_utils import PROVENANCE_KEY, cast_of, dtype_name, layer_of, op_name, target_name, tensor_val
from autoscale.report import LayerSummary

__all__ = ["assemble"]

_REASONS_ERASED = {
    "fold_casts": "folded: a cast to the dtype it already has, a cancelling pair, or a duplicate",
    "remove_inplace": "in-place op replaced by its out-of-place form",
    "insert_grad_scaling": "the scaler's state marker: read (the layer of each row) and removed",
}


def _dtype(node: Node) -> str | None:
    val = tensor_val(node)
    return dtype_name(val.dtype) if isinstance(val, torch.Tensor) else None


def _shape(node: Node) -> tuple[int, ...] | None:
    val = tensor_val(node)
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(int(s) if isinstance(s, int) else -1 for s in val.shape)


def _op(node: Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    return target_name(node) or str(node.target)


def _provenance(node: Node, derived_from: str | None = None, source: Node | None = None) -> Provenance | None:
    """The node's own provenance, or (a backward node) that of the forward node it derives from."""
    prov = node.meta.get(PROVENANCE_KEY)
    if prov is None and source is not None:
        prov = source.meta.get(PROVENANCE_KEY)
        if prov is not None:
            return Provenance(prov["pass"], prov.get("layer", ""), f"backward of {derived_from}: {prov['reason']}",
                              bool(prov.get("created")), prov.get("precision"), derived_from)
    if prov is None:
        return None
    # (its own: ``derived_from`` names a forward node only when the provenance is that node's)
    return Provenance(prov["pass"], prov.get("layer", ""), prov["reason"], bool(prov.get("created")),
                      prov.get("precision"))


Pair = tuple[Node | None, Node | None]


def _align(before: list[Node], after: list[Node], key: Callable[[Node], Any], forced: set[Node]) -> list[Pair]:
    """Pair the nodes of two graphs, in an order that follows both.

    ``forced`` after-nodes are inserted by construction (they derive from nodes a pass created)
    and take no part in the matching. The rest are matched as a sequence diff on ``key``; inside a
    block that differs, nodes of the same op (``relu_`` and ``relu``) are paired as changed.
    """
    rest = [n for n in after if n not in forced]
    pairs: list[Pair] = []
    matcher = difflib.SequenceMatcher(None, [key(n) for n in before], [key(n) for n in rest], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(before[i1:i2], rest[j1:j2], strict=True))
        elif tag == "delete":
            pairs.extend((b, None) for b in before[i1:i2])
        elif tag == "insert":
            pairs.extend((None, a) for a in rest[j1:j2])
        else:
            pairs.extend(_align_block(before[i1:i2], rest[j1:j2]))
    # splice the forced nodes in at their place in the after graph
    order = {n: i for i, n in enumerate(after)}
    pending = sorted(forced, key=order.__getitem__)
    merged: list[Pair] = []
    k = 0
    for b, a in pairs:
        if a is not None:
            while k < len(pending) and order[pending[k]] < order[a]:
                merged.append((None, pending[k]))
                k += 1
        merged.append((b, a))
    merged.extend((None, n) for n in pending[k:])
    return merged


def _align_block(before: list[Node], after: list[Node]) -> list[Pair]:
    ops = difflib.SequenceMatcher(None, [op_name(n) or n.op for n in before], [op_name(n) or n.op for n in after],
                                  autojunk=False)
    pairs: list[Pair] = []
    for tag, i1, i2, j1, j2 in ops.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(before[i1:i2], after[j1:j2], strict=True))
        else:
            pairs.extend((b, None) for b in before[i1:i2])
            pairs.extend((None, a) for a in after[j1:j2])
    return pairs


def _same(b: Node, a: Node, paired: Mapping[Node, Node]) -> bool:
    """Whether the after node computes the same thing as the before node: same op, dtype and shape,
    and arguments that are the same (paired) nodes and constants."""
    if b.op != a.op or b.target != a.target or _dtype(b) != _dtype(a) or _shape(b) != _shape(a):
        return False
    if b.op == "placeholder":
        return True

    def mapped(n: Node) -> Any:
        return paired.get(n, ("new", n.name))

    try:
        return bool(map_arg((b.args, b.kwargs), lambda n: n) == map_arg((a.args, a.kwargs), mapped))
    except RuntimeError:  # a tensor constant's ambiguous ==
        return False


def _seq_sources(joint: GraphModule) -> dict[int, str]:
    """Autograd sequence number -> the Dynamo node whose forward op created that autograd node.

    AOTAutograd tags every joint node with ``seq_nr``: a backward node has the number of the
    autograd node it runs, a forward node the number current when it was traced (an op that
    creates no autograd node shares the previous op's number, so the first forward node with a
    number is its creator). Forward nodes also record in ``from_node`` the Dynamo node they were
    traced from.
    """
    forward = _forward_nodes(joint)
    sources: dict[int, str] = {}
    for n in joint.graph.nodes:
        seq = n.meta.get("seq_nr")
        if n not in forward or seq is None or seq in sources:
            continue
        origin = n.meta.get("from_node") or []
        first = origin[0] if origin else None
        # a NodeSource; older torch recorded (name, target) pairs
        name = first[0] if isinstance(first, tuple) else getattr(first, "name", None)
        if isinstance(name, str):
            sources[seq] = name
    return sources


def _forward_nodes(joint: GraphModule) -> set[Node]:
    """The forward half of a joint graph: tagged ``is_forward`` by AOTAutograd, or (a torch that
    does not tag) every non-input node that does not depend on a tangent."""
    nodes = list(joint.graph.nodes)
    if any("partitioner_tag" in n.meta for n in nodes):
        return {n for n in nodes if n.meta.get("partitioner_tag") == "is_forward"}
    backward: set[Node] = set()
    for n in nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    return {n for n in nodes if n not in backward and n.op not in ("placeholder", "output")}


def _autograd_backward_node(n: Node) -> bool:
    """Whether a backward-graph node is one autograd's backward made (and so carries a meaningful
    ``seq_nr``): tagged ``is_backward`` by AOTAutograd; not the write-back of an input mutation at
    the end of the graph (tagged "must_be_in_backward"). Where torch does not tag: any computing
    node but a ``copy_`` into an input."""
    tag = n.meta.get("partitioner_tag")
    if tag is not None:
        return bool(tag == "is_backward")
    if n.op not in ("call_function", "get_attr"):
        return False
    first = n.args[0] if n.args else None
    return not (target_name(n) == "copy_" and isinstance(first, Node) and first.op == "placeholder")


def _is_rescale(n: Node) -> bool:
    return n.op == "call_function" and n.target is rescale


def _scale_infos(g: CapturedGraph) -> dict[Node, ScaleInfo]:
    """The rescale nodes of ``g``'s rewritten graph, with their predictions and initial scales."""
    initial: Mapping[int, float] = g.after.meta.get("autoscale_initial_scales") or {}
    points = {(p.node, p.reason): p for p in g.dynamo.candidates}
    layers = g.dynamo.layers

    def scale_of(rows: tuple[int, ...]) -> float:
        return max((float(initial.get(r, 1.0)) for r in rows), default=1.0)

    infos: dict[Node, ScaleInfo] = {}
    for n in g.after.graph.nodes:
        if not _is_rescale(n):
            continue
        x, _, _, out_rows, in_rows, record_rows, unscale = n.args[:7]
        assert isinstance(x, Node)
        prov = n.meta.get(PROVENANCE_KEY, {})
        point = points.get((x, prov.get("reason")))
        kind: ScaleKind = "scale" if point is not None else "unscale" if unscale else "align"
        row = out_rows[0] if len(out_rows) == 1 else None
        layer = layers[row] if point is not None and row is not None and row < len(layers) else prov.get("layer", "")
        infos[n] = ScaleInfo(
            node=n.name, graph=g.index, kind=kind, layer=layer, row=row, out_rows=tuple(out_rows),
            in_rows=tuple(in_rows), record_rows=tuple(record_rows),
            underflow=point.underflow if point is not None else x.meta.get("autoscale_underflow"),
            amax=point.amax if point is not None else None,
            scale=scale_of(tuple(out_rows)), arriving_scale=scale_of(tuple(in_rows)),
            reason=prov.get("reason", ""))
    return infos


def _forward_entries(g: CapturedGraph, infos: Mapping[Node, ScaleInfo]) -> list[NodeEntry]:
    before, after = list(g.before.graph.nodes), list(g.after.graph.nodes)
    pairs = _align(before, after, lambda n: n.name, set())
    paired = {b: a for b, a in pairs if b is not None and a is not None}
    back = {a: b for b, a in paired.items()}
    names_b, names_a = display_names(g.before, input_paths(g.before)), display_names(g.after, input_paths(g.after))
    lines_b, lines_a = node_lines(g.before, names_b), node_lines(g.after, names_a)
    erased_by = {e.name: e.pass_name for e in g.dynamo.erased}
    entries = []
    for b, a in pairs:
        if a is None:
            assert b is not None
            by = erased_by.get(b.name)
            prov = Provenance(by, layer_of(b), _REASONS_ERASED.get(by, f"erased by {by}")) if by else None
            name = names_b.get(b, b.name)
            entries.append(NodeEntry(g.index, name, name, "removed", _kind(b, None), _op(b), lines_b[b], None,
                                     _dtype(b), None, _layer(b, names_b), prov))
            continue
        status: Status = "inserted" if b is None else "unchanged" if _same(b, a, back) else "changed"
        info = infos.get(a)
        entries.append(NodeEntry(
            g.index, names_a.get(a, a.name), names_b.get(b, b.name) if b is not None else None, status,
            _kind(a, info), _op(a), lines_b[b] if b is not None else None, lines_a[a],
            _dtype(b) if b is not None else None, _dtype(a), _layer(a, names_a), _provenance(a),
            a.meta.get("autoscale_underflow"), info))
    return entries


def _layer(node: Node, names: Mapping[Node, str]) -> str:
    """A node's layer: for a parameter or buffer, the module that holds it (a tied weight's first
    use may be in another), else the module of the op (``layer_of``)."""
    path = names.get(node)
    return path.rpartition(".")[0] if path is not None else layer_of(node)


def _kind(node: Node, info: ScaleInfo | None) -> Kind:
    if info is not None:
        return info.kind
    if (node.meta.get(PROVENANCE_KEY) or {}).get("pass") == "batch_records":
        return "stats"
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.op == "call_function" and node.target is watch:
        return "check"
    if cast_of(node) is not None:
        return "cast"
    return "emulated" if (node.meta.get(PROVENANCE_KEY) or {}).get("emulated") else "op"


def _backward_entries(g: CapturedGraph, infos: Mapping[Node, ScaleInfo]) -> tuple[list[NodeEntry], dict[str, int]]:
    """The backward entries, and how many ATen nodes each rescale point became."""
    if g.autograd_after is None:
        return [], {}
    after_gm = g.autograd_after.backward
    before_gm = g.autograd_before.backward if g.autograd_before is not None else None
    dynamo_nodes = {n.name: n for n in g.after.graph.nodes}
    rescale_names = {info.node for info in infos.values()}
    sources = _seq_sources(g.autograd_after.joint)

    def source(n: Node) -> str | None:
        seq = n.meta.get("seq_nr")
        return sources.get(seq) if seq is not None and _autograd_backward_node(n) else None

    forced: set[Node] = set()
    for n in after_gm.graph.nodes:
        src = source(n)
        if src is not None and (dynamo_nodes[src].meta.get(PROVENANCE_KEY) or {}).get("created"):
            forced.add(n)  # the gradient of a node a pass inserted: inserted too

    def key(n: Node) -> Any:
        return (_op(n), _shape(n))

    before = list(before_gm.graph.nodes) if before_gm is not None else []
    after = list(after_gm.graph.nodes)
    pairs = _align(before, after, key, forced)
    back = {a: b for b, a in pairs if b is not None and a is not None}
    names_b = display_names(before_gm, input_paths(g.before), primals=True) if before_gm is not None else {}
    names_a = display_names(after_gm, input_paths(g.after), primals=True)
    lines_b = node_lines(before_gm, names_b) if before_gm is not None else {}
    lines_a = node_lines(after_gm, names_a)
    sizes: dict[str, int] = defaultdict(int)
    entries = []
    for b, a in pairs:
        if a is None:
            assert b is not None
            name = names_b.get(b, b.name)
            entries.append(NodeEntry(g.index, name, name, "removed", _kind(b, None), _op(b), lines_b[b], None,
                                     _dtype(b), None, _layer(b, names_b), None))
            continue
        src = source(a)
        member = src if src in rescale_names else None
        if member is not None:
            sizes[member] += 1
        status: Status = "inserted" if b is None else "unchanged" if _same(b, a, back) else "changed"
        kind: Kind = "scale_op" if member is not None else _kind(a, None)
        entries.append(NodeEntry(
            g.index, names_a.get(a, a.name), names_b.get(b, b.name) if b is not None else None, status, kind,
            _op(a), lines_b[b] if b is not None else None, lines_a[a], _dtype(b) if b is not None else None,
            _dtype(a), _layer(a, names_a), _provenance(a, src, dynamo_nodes.get(src) if src is not None else None),
            scale_op=member))
    return entries, dict(sizes)


def _overflow(g: CapturedGraph) -> list[OverflowDecision]:
    """The ops of ``g``'s rewritten forward that ``convert_precision`` kept in float32 for forward
    overflow: painted float32 with a reason that begins with ``OVERFLOW_REASON``. An op that
    carries its own ``predict_overflow`` mark as the reason was predicted (or, with that pass's
    promoted reason, promoted at run time); any other such op reads one of them."""
    decisions = []
    for n in g.after.graph.nodes:
        prov = n.meta.get(PROVENANCE_KEY) or {}
        reason = str(prov.get("reason", ""))
        if prov.get("created") or prov.get("precision") != "float32" or not reason.startswith(OVERFLOW_REASON):
            continue
        source: OverflowSource = ("promoted" if reason == PROMOTED_REASON
                                  else "predicted" if reason == n.meta.get(FORWARD_KEY) else "follows")
        moments = (n.meta.get(MOMENTS_KEY) or {}).get("value")
        amax = float(moments.amax) if moments is not None else math.nan
        decisions.append(OverflowDecision(g.index, n.name, layer_of(n), op_name(n) or _op(n), source,
                                          amax if math.isfinite(amax) else None, reason))
    return decisions


def _folded(g: CapturedGraph) -> tuple[list[FoldedCast], list[FoldedCast]]:
    fwd = [FoldedCast(g.index, e.name, e.text, "dynamo", e.created_by)
           for e in g.dynamo.erased if e.pass_name == "fold_casts" and e.cast]
    bwd = [FoldedCast(g.index, e.name, e.text, "joint", e.created_by, e.side)
           for e in g.joint.erased if e.pass_name == "fold_casts" and e.cast]
    return fwd, bwd


def assemble(graphs: list[CapturedGraph], cfg: Config, run: Mapping[str, LayerSummary] | None = None) -> GraphDiff:
    """The diff of every captured graph (one per graph break) as one: entries and folded casts in
    graph order, the rescale points with the size of their backward, the per-layer map (with a
    telemetry log's ``run`` summary, by layer), and the summary's totals."""
    forward: list[NodeEntry] = []
    backward: list[NodeEntry] = []
    scale_ops: list[ScaleInfo] = []
    overflow: list[OverflowDecision] = []
    folded_f: list[FoldedCast] = []
    folded_b: list[FoldedCast] = []
    passes: list[PassCount] = []
    for g in graphs:
        infos = _scale_infos(g)
        bwd, sizes = _backward_entries(g, infos)
        infos = {n: _with_size(i, sizes.get(i.node, 0)) for n, i in infos.items()}
        forward.extend(_forward_entries(g, infos))
        backward.extend(bwd)
        scale_ops.extend(infos.values())
        overflow.extend(_overflow(g))
        f, b = _folded(g)
        folded_f.extend(f)
        folded_b.extend(b)
        passes.extend(PassCount(g.index, r.stage, r.name, r.modified, dict(r.counts)) for r in g.records)
    layers = layer_rows(graphs, scale_ops, overflow, dtype_name(cfg.dtype), run)
    worst, worst_layer, unknown = worst_underflow(layers)
    reports = [g.report for g in graphs]
    islands = _merge_islands(i for r in reports for i in r.islands)
    summary = DiffSummary(
        dtype=dtype_name(cfg.dtype), compute=cfg.compute, graphs=len(graphs),
        converted=sum(r.converted for r in reports), total=sum(r.total for r in reports),
        casts=sum(r.casts for r in reports),
        emulated_ops=sum(1 for e in forward if e.kind == "emulated"),
        casts_folded=len(folded_f) + len(folded_b),
        backward_casts=sum(1 for e in backward if e.status == "inserted" and e.kind == "cast"),
        scale_points=sum(1 for s in scale_ops if s.kind == "scale"),
        unscale_points=sum(1 for s in scale_ops if s.kind == "unscale"),
        align_points=sum(1 for s in scale_ops if s.kind == "align"),
        watched=sum(1 for e in forward if e.kind == "check"),
        float32_for_overflow=len(overflow),
        max_underflow=worst, max_underflow_layer=worst_layer, underflow_unknown=unknown,
        islands=islands, unknown_ops=tuple(dict.fromkeys(op for r in reports for op in r.unknown_ops)),
        passes=tuple(passes))
    return GraphDiff(GraphSection("forward", tuple(forward), tuple(folded_f), islands),
                     GraphSection("backward", tuple(backward), tuple(folded_b)), summary, tuple(scale_ops),
                     tuple(overflow), layers)


def _with_size(info: ScaleInfo, size: int) -> ScaleInfo:
    return ScaleInfo(**{**info.__dict__, "backward_nodes": size})


def _merge_islands(islands: Iterable[Island]) -> tuple[Island, ...]:
    merged: dict[tuple[str, str], list[str]] = defaultdict(list)
    for i in islands:
        merged[(i.op, i.reason)].extend(i.nodes)
    return tuple(Island(op, reason, tuple(nodes)) for (op, reason), nodes in merged.items())
