"""Per-layer gradient scaling, inserted as autograd-aware rescale points in the forward graph.

The backward of the graph is linear in the incoming gradient, so every gradient carries a scale:
the loss scale where it enters, then whatever the rescale points on its way multiplied in.
This pass

1. finds the scaler's state (``autoscale::attach``; without a ``GradScaler`` nothing is done);
2. places a *scale point* on the low-precision output of every backward GEMM's layer (an
   allow-list op: its gradient is the GEMM's incoming gradient G_y, so both G_x = G_y·W and
   dW = G_yᵀ·X come out scaled) and on the float32 side of every cast out of low precision (its
   backward is a gradient cast *into* float16, which must be scaled before it rounds);
3. walks the graph from the outputs back to the inputs computing the scale each gradient
   carries; where gradients with different scales meet (a residual merge, a tied weight) it
   aligns them to the largest (``rescale`` with ``out_rows`` = the union). A float16 gradient
   scaled up can overflow, so its alignment is a measured point like the others; a float32 one
   cannot, and is aligned by a multiply alone (``measured=False``), unless it is the first
   measurement of a float16 gradient (``_UNMEASURED``);
4. puts an *unscale point* on every parameter, so its gradient leaves the graph carrying exactly
   the loss scale (the scaler divides that out, as torch.amp's does);
5. for a step that does not measure (``attach``'s ``measuring``: ``ScalingConfig.measure_every``),
   makes every scale point a multiply alone and every unscale point an inf/nan check alone
   (``_State.lighten``): the graph that runs between measured steps.

Scales are absolute (see ``autoscale.ops``): a scale point makes the gradient carry its layer's
scale, whatever it arrived with. Layers are module paths; each maps to a row of the state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.fx import Graph, GraphModule, Node

from autoscale.ops import rescale
from autoscale.protocol import LAYOUT_SEP, LOSS_ROW, SCALE_RANGE, gradient_max, headroom

from ..analysis.analyze_underflow import MOMENTS_KEY
from ..graph_utils import (
    PROVENANCE_KEY,
    attach_of,
    cast_of,
    dtype_name,
    float_dtype,
    input_path,
    layer_of,
    new_node,
    op_name,
    provenance,
    redirect_uses,
    requires_grad_map,
    sparse_gradient,
    tensor_val,
)
from ..manager import PassResult
from ..op_tables import Category, category_of

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["ScalePoint", "insert_grad_scaling", "scale_points"]

PASS = "insert_grad_scaling"
Rows = frozenset[int]


def insert_grad_scaling(gm: GraphModule, cfg: Config) -> PassResult:
    """Insert scale, alignment and unscale points (see the module docstring)."""
    if cfg.scaling.mode != "adaptive":
        return PassResult(gm, modified=False)
    graph = gm.graph
    found = attach_of(graph)
    if found is None:  # no GradScaler state in this graph: nothing to scale with
        return PassResult(gm, modified=False, counts={"scale_points": 0})
    attach, (scales, stats, _, layout, moments, *_, measuring), prefix = found
    gm.meta["autoscale_scales_input"] = list(graph.find_nodes(op="placeholder")).index(scales)
    if cfg.dtype == torch.bfloat16 and not cfg.float8:
        # bfloat16 has float32's exponent range: a gradient float32 keeps does not underflow in it
        # (it loses mantissa bits, which no scale gives back). The scaler learns it from here.
        gm.meta["autoscale_scaling_needed"] = False
        graph.erase_node(attach)
        return PassResult(gm, modified=True, counts={"scale_points": 0})
    gm.meta["autoscale_scaling_needed"] = True
    gm.meta["autoscale_gradient_max"] = gradient_max(cfg.float8)
    layers = str(layout).split(LAYOUT_SEP)
    state = _State(graph, scales, stats, layers, prefix=prefix, moments=bool(moments), cfg=cfg)
    state.requires = requires_grad_map(graph)
    points = scale_points(graph, cfg, state.requires)
    if cfg.scaling.placement == "predicted":
        points = [p for p in points if p.underflow is None or p.underflow > cfg.scaling.gamma]  # (unknown: placed)
    gm.meta["autoscale_initial_scales"] = _initial_scales(
        points, state, headroom(cfg.scaling.margin, gradient_max(cfg.float8)))
    graph.erase_node(attach)
    for point in points:
        state.scale_point(point)
    aligned = state.carry()
    unscaled = state.unscale_parameters()
    # the inputs whose gradients leave through an unscale point, checked for inf/nan on the way
    gm.meta["autoscale_checked_inputs"] = unscaled
    lightened = 0 if measuring else state.lighten()
    return PassResult(gm, modified=True, counts={
        "scale_points": len(points), "aligned": aligned, "unscaled": len(unscaled), "unmeasured": lightened})


@dataclass(frozen=True)
class ScalePoint:
    """Where a scale point goes, why, and what the analysis predicts for the gradients it governs
    (at scale 1): the worst underflow rate, and the largest magnitude (each None when the analysis
    does not know one of them: an unknown is never stood in for by a number a reader would take
    for a prediction). ``layer`` is the node whose module gives the point its row (``node`` unless
    merged)."""

    node: Node
    reason: str
    underflow: float | None
    amax: float | None
    layer: Node


def _initial_scales(points: list[ScalePoint], state: _State, headroom: float) -> dict[int, float]:
    """Per row, the headroom rule applied to the predicted magnitudes: the scales to start from,
    within the scaler's range (a deep chain can predict gradients too small for any float32 scale)."""
    amax: dict[int, float] = {}
    for p in points:
        if p.amax is not None and p.amax > 0:
            row = state.row(p.layer)
            amax[row] = max(amax.get(row, 0.0), p.amax)
    low, high = (math.log2(s) for s in SCALE_RANGE)
    return {row: 2.0 ** min(max(math.floor(math.log2(headroom) - math.log2(a)), low), high)
            for row, a in amax.items()}


def scale_points(graph: Graph, cfg: Config, requires: dict[Node, bool] | None = None) -> list[ScalePoint]:
    """Candidate scale points, with the analysis' predictions (rate 1 where it has none).

    The low-precision output of an allow-list op: it governs the op's incoming gradient and the
    gradients of its inputs (G_x, dW). And a
    cast out of low precision inserted by the precision pass: it governs the gradient its
    backward rounds into low precision. Where such a cast is the only reader of an allow-list op's
    output (a convolution feeding float32 batch norm), the two would scale the same gradient one
    after the other: they are one point, on the cast (before the rounding), with the op's row.
    """
    low = cfg.dtype
    requires = requires if requires is not None else requires_grad_map(graph)
    points: list[ScalePoint] = []
    gemm_points: dict[Node, tuple[int, list[Node], str]] = {}  # target -> (index, governed, op name)
    for n in graph.nodes:
        if not requires[n] or n.op not in ("call_function", "call_method"):
            continue
        if category_of(op_name(n) or "", cfg.op_overrides) is Category.ALLOW:
            if float_dtype(n) != low:
                continue
            governed = [n, *(a for a in n.all_input_nodes if requires.get(a))]
            gemm_points[n] = (len(points), governed, n.name)
            points.append(_point(n, f"gradient into the backward GEMMs of {n.name}", governed))
        elif n.meta.get(PROVENANCE_KEY, {}).get("pass") == "convert_precision":
            cast = cast_of(n)
            if cast is None or float_dtype(cast[0]) != low or cast[1] != torch.float32:
                continue
            source = cast[0]
            if source in gemm_points and len(source.users) == 1:
                index, governed, name = gemm_points.pop(source)
                points[index] = _point(n, f"gradient into the backward GEMMs of {name}, scaled before it is "
                                          f"cast into {dtype_name(low)} for {n.name}", [n, *governed], layer=source)
            else:
                points.append(_point(n, f"gradient cast into {dtype_name(low)} for {n.name}", [n]))
    return points


def _point(node: Node, reason: str, governed: list[Node], layer: Node | None = None) -> ScalePoint:
    grads = [n.meta.get(MOMENTS_KEY, {}).get("grad") for n in governed]
    rates = [n.meta.get("autoscale_underflow") for n in governed]
    known = [g.amax for g in grads if g is not None]
    return ScalePoint(node, reason, None if None in rates else max(r for r in rates if r is not None),
                      max(known) if len(known) == len(grads) else None, layer if layer is not None else node)


_UNMEASURED = " (float32: a multiply alone, measured where it next meets a point)"
"""Why a float32 gradient's alignment is, as a rule, not a measured point. Aligned to the largest
scale of the merge, a gradient is scaled up, which can overflow float16 (hence the check, the guard
and the record of its magnitude that a float16 alignment carries), but not float32
(``_holds_any_scaled``). Its magnitude matters where it is rounded into float16 again, at the
backward of a cast out of float16, and every such cast this pipeline inserted has a scale point
on its float32 side: there it is measured, in the rows it then carries. A non-finite value that
reaches it, made upstream in float16, is found by the next point downstream, which blames the
rows of the merge (a superset of those it came with) and skips the step all the same. The
exception is a branch whose gradient is a float16 one no point has measured, widened (a GEMM
reading the float32 value through a cast): the alignment is its first measurement, which bounds
that GEMM's scale by its input gradient, and stays one (``_State._exposes_float16``). Measured,
each was a reduction and its synchronization in the backward, and three nodes for Inductor to
compile: 49 of the 232 points of a 3+3-layer T5 are not. Not with the "paper" rule, whose moments
(Σ g, Σ g²) every point records."""


_PASSING = frozenset({Category.INFER, Category.CLEAR})
"""Ops whose backward hands a gradient on with its magnitude (``_State._exposes_float16``), with
casts (which are ``Category.FIXED``)."""


def _measured(point: Node) -> bool:
    """Whether a rescale node is a measured point (``rescale``'s ``measured``)."""
    return bool(point.kwargs.get("measured", True))


def _holds_any_scaled(dtype: torch.dtype | None) -> bool:
    """Whether a gradient of ``dtype`` stays finite under any factor a rescale applies: float32 and
    wider. The factor is at most ``max(SCALE_RANGE) / min(SCALE_RANGE)`` = 2^64, so a float32
    gradient would have to exceed 2^64 (1.8e19) at the scale it arrives with to overflow."""
    wide = torch.finfo(torch.float32).max
    return dtype is not None and dtype.is_floating_point and torch.finfo(dtype).max >= wide


class _State:
    """The scaler's state nodes in this graph, and the rescale nodes placed so far."""

    def __init__(self, graph: Graph, scales: Node, stats: Node, layers: list[str], prefix: str, moments: bool,
                 cfg: Config) -> None:
        self.graph, self.scales, self.stats, self.moments, self.cfg = graph, scales, stats, moments, cfg
        self.fused = cfg.scaling.point_kernel == "fused"
        # (the form's name where it is not the default: ``Config.form``)
        self.form = {} if cfg.form == "default" else {"form": cfg.form}
        self.exposes: dict[Node, bool] = {}  # ``_exposes_float16``'s answers (nothing below a node changes after)
        self.rows = {name: row for row, name in enumerate(layers)}
        self.prefix = prefix  # the path of the scaler's model in this graph ("" when compiled directly)
        self.sends: dict[Node, Rows] = {}  # rescale node -> the scale it sends to its input
        self.requires: dict[Node, bool] = {}
        # After a graph break the scaler's state joins the graph as its last inputs (reach_state):
        # a rescale of an input (a tied weight's alignment where its uses merge, an unscale) goes
        # after every input, not right after the input's own placeholder.
        self.last_input = list(graph.find_nodes(op="placeholder"))[-1]

    def row(self, node: Node) -> int:
        """The row of the innermost registered module containing ``node`` (the root's, at worst)."""
        path = layer_of(node)
        if self.prefix:
            path = "" if path == self.prefix else path.removeprefix(self.prefix + ".")
        while path not in self.rows and path:
            path = path.rpartition(".")[0]
        return self.rows.get(path, LOSS_ROW)

    def _rescale(self, x: Node, out_rows: Rows, in_rows: Rows, record: Rows, *, after: Node, like: Node,
                 reason: str, unscale: bool = False, measured: bool = True) -> Node:
        if after.op == "placeholder":
            after = self.last_input
        with self.graph.inserting_after(after):
            node = new_node(self.graph, "call_function", rescale, (
                x, self.scales, self.stats, tuple(sorted(out_rows)), tuple(sorted(in_rows)), tuple(sorted(record)),
                unscale, self.moments, self.fused), {**self.form, **({} if measured else {"measured": False})})
        for key in ("nn_module_stack", "stack_trace"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
        node.meta["val"] = tensor_val(x)
        self.requires[node] = self.requires.get(x, False)
        provenance(node, PASS, reason, created=True)
        self.sends[node] = out_rows
        return node

    def scale_point(self, p: ScalePoint) -> None:
        row = frozenset({self.row(p.layer)})
        point = self._rescale(p.node, row, frozenset(), row, after=p.node, like=p.layer, reason=p.reason)
        redirect_uses(p.node, point)

    def carry(self) -> int:
        """Compute the scale each gradient carries, outputs to inputs; align at merges. Fills in
        the scale every scale point receives."""
        self.carried: dict[Node, Rows] = {}
        aligned = 0
        for n in reversed(list(self.graph.nodes)):
            if n.op == "output" or not self.requires.get(n, False):
                continue
            arriving = {u: s for u in n.users if (s := self._sent_by(u)) is not None}
            if not arriving:
                continue
            target = frozenset().union(*arriving.values())
            tensor = isinstance(tensor_val(n), torch.Tensor)
            for user, rows in arriving.items():
                if rows == target:
                    continue
                # ``n`` has several outputs (split, unbind): its backward joins their gradients, so
                # they are aligned one by one, on the element (a rescale takes one tensor).
                element = not tensor and op_name(user) == "getitem"
                aligned_value = user if element else n
                measured = (self.moments or not _holds_any_scaled(float_dtype(aligned_value))
                            or self._exposes_float16(user))
                reason = f"align the gradient from {user.name} at a merge" + ("" if measured else _UNMEASURED)
                record = target | rows if measured else frozenset()
                align = self._rescale(aligned_value, target, rows, record, after=aligned_value, like=user,
                                      reason=reason, measured=measured)
                if element:
                    redirect_uses(user, align)
                    self.carried[user] = target
                else:
                    user.replace_input_with(n, align)
                aligned += 1
            self.carried[n] = target
            if n in self.sends and n.args[4] == ():  # a scale point: it receives `target`
                out_rows = frozenset(n.args[3])
                n.update_arg(4, tuple(sorted(target)))
                n.update_arg(5, tuple(sorted(target | out_rows)))
        return aligned

    def _exposes_float16(self, start: Node) -> bool:
        """Whether the gradient arriving from ``start`` may be a float16 gradient no measured point
        has seen, widened: then its float32 alignment is its first measurement, and stays one.

        Followed forward from ``start`` through what passes a gradient on with its magnitude
        (data movement, elementwise ops, casts, rescale points that are not measured), a float16
        node is seen when every reader of it is a measured point (a scale point on a GEMM's
        output, a float16 alignment), and exposes its gradient otherwise (a GEMM reading a float32
        value's cast: its input gradient, computed in float16, would be measured nowhere before the
        merge). A measured point ends the walk, and so does an op past which a gradient is no
        longer the float16 one (a normalization's backward, a float32 GEMM's): measured after it,
        it says nothing of the float16 value, which is what the next point downstream measures
        anyway. Decided in ``carry``'s order, outputs to inputs, so every alignment below a node
        is in place when the node is asked about, and its answer is kept."""
        stack: list[tuple[Node, list[Node] | None]] = [(start, None)]  # (node, its readers once expanded)
        while stack:
            v, expanded = stack.pop()
            if expanded is not None:
                self.exposes[v] = any(self.exposes[r] for r in expanded)
                continue
            if v in self.exposes:
                continue
            readers = self._passes_gradient_from(v)
            if isinstance(readers, bool):
                self.exposes[v] = readers
            else:
                stack.append((v, readers))
                stack.extend((r, None) for r in readers if r not in self.exposes)
        return self.exposes[start]

    def _passes_gradient_from(self, v: Node) -> bool | list[Node]:
        """``_exposes_float16`` at ``v``: its answer when ``v`` alone decides, else the readers of
        ``v`` whose gradients ``v``'s carries on."""
        if v.target is rescale:
            return False if _measured(v) else list(v.users)
        if v.op != "call_function" and v.op != "call_method":
            return False  # (the output: the loss's gradient comes in at the loss scale)
        if float_dtype(v) == self.cfg.dtype:
            return not all(u.target is rescale and _measured(u) for u in v.users)
        if cast_of(v) is None and category_of(op_name(v) or "", self.cfg.op_overrides) not in _PASSING:
            return False
        return list(v.users)

    def lighten(self) -> int:
        """Make this the graph of a step that measures nothing (``ScalingConfig.measure_every``): no
        point measures (``measured=False``): a scale or alignment point is a multiply alone, an
        unscale point an inf/nan check for the step's skip alone. Returns how many points changed.

        What such a step must still do: carry the same scales (the points multiply as before) and
        skip if a gradient went non-finite. Without the scale points' checks, a value they would
        have caught flows on, non-finite, into the parameters' gradients, which every unscale point
        checks (or it is multiplied by an exact zero on the way, a ReLU's mask, and changes no
        parameter's gradient, and no step). Which scale made it the step cannot tell: it reaches
        the gradients of the layers after the one that made it (in backward order), and not
        always that one's own (an overflow of its input's gradient). So no layer is blamed, and the
        scaler measures the next step (``GradScaler._measure_next``). What the step saves is the
        scale points' reductions and their second pass over each gradient:
        docs/results/overhead.md."""
        changed = 0
        for node in self.sends:
            if not _measured(node):
                continue
            node.update_arg(5, ())
            node.kwargs = {**node.kwargs, "measured": False}
            node.meta[PROVENANCE_KEY]["reason"] += (
                " (inf/nan check alone: a step that measures nothing)" if node.args[6]
                else " (a multiply alone: a step that measures nothing)")
            changed += 1
        return changed

    def _sent_by(self, user: Node) -> Rows | None:
        if user.op == "output":
            return frozenset({LOSS_ROW})
        if user in self.sends:
            return self.sends[user]
        return self.carried.get(user)

    def unscale_parameters(self) -> list[int]:
        """Each gradient-requiring input leaves carrying exactly the loss scale; returns the input
        positions of those that needed an unscale point (and were checked for inf/nan by it)."""
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        unscaled = []
        for index, p in enumerate(self.graph.find_nodes(op="placeholder")):
            if p not in self.carried:
                continue
            rows = self.carried[p]
            if any(sparse_gradient(u) for u in p.users):
                self._unscale_before_sparse(p)
                continue
            if rows == {LOSS_ROW}:
                # Already at the loss scale: unscaling would multiply by 1 and write a copy of the
                # gradient just to check it. GradScaler.step checks it instead, reading it once
                # (the point pays for itself only where it must multiply anyway).
                continue
            # A vector (a bias) records no statistics, only inf/nan: its gradient is a sum of G_y,
            # whose magnitudes the weight's point records.
            val = tensor_val(p)
            record = rows | {self.row(p)} if isinstance(val, torch.Tensor) and val.dim() > 1 else frozenset()
            # Placed right before the parameter's first use, not after the inputs: autograd runs
            # later-created nodes first, so the unscale then runs as soon as dW exists, while it is
            # still in cache (at the top of the graph, all unscales would run at the end of the
            # backward, in one kernel reading every dW back from memory).
            first_use = min(p.users, key=order.__getitem__)
            point = self._rescale(p, frozenset({LOSS_ROW}), rows, record, after=first_use.prev,
                                  like=p, reason=f"unscale the gradient of {input_path(p) or p.name}", unscale=True)
            redirect_uses(p, point)
            unscaled.append(index)
        return unscaled

    def _unscale_before_sparse(self, p: Node) -> None:
        """Unscale on the outputs of the ops that give ``p`` a sparse gradient (an embedding with
        ``sparse=True``), while the gradient is still dense: a rescale cannot take a sparse one.
        ``p`` then receives the loss scale as is; GradScaler checks its gradient for inf/nan."""
        if not all(sparse_gradient(u) for u in p.users):
            raise ValueError(
                f"{input_path(p) or p.name} gets a sparse gradient from one op and a dense one from another; "
                "autoscale cannot unscale that sum. Use sparse=False in its embedding, or untie the weight.")
        for u in list(p.users):
            rows = self.carried.get(u)
            if rows is None or rows == {LOSS_ROW}:
                continue
            record = rows | {self.row(p)} if len(u.args) > 1 and u.args[1] is p else frozenset()
            point = self._rescale(u, frozenset({LOSS_ROW}), rows, record, after=u, like=u,
                                  reason=f"unscale the gradient into {u.name}, whose weight's gradient is sparse",
                                  unscale=True)
            redirect_uses(u, point)
