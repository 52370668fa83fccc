"""Fold all the statistics a graph's rescale points record into one update of the statistics tensor.

Each rescale point's backward records its measurements with one ``autoscale::record`` op
(``autoscale.measure``), and writes the result back into the statistics tensor, a graph input.
In AOTAutograd's joint graph that is a chain through the tensor — ``record``, ``copy``, ``record``,
``copy``, ... — ending in the ``copy_`` into the input. This pass replaces each such chain by one
fold at its end: the points' values concatenated, each read against the scale its point's output
leaves with (``autoscale.measure.reading``: a peak at unit scale, or the mark of an overflow the
point's scaling made), what each cell's mode takes of them computed for the whole vector at once
(``autoscale.measure.MODES``: the flags a point's one number marks),
gathered per cell with a constant index plan, reduced (max or sum, as each cell combines) and
written into their cells with one ``index_put`` per kind. The result is the same as folding point
by point: every point's values are computed before the end of the chain, each cell is combined
one way (its column's; a chain that mixes them is left alone), and max is associative and
commutative, as is a sum of counts (integers, exact in float32 below 2^24). Σ g and Σ g² (the
"paper" rule's moments) are summed in another order, so they may differ in the last bit.

Why: folded point by point, each update was a few ops over the whole tensor, which Inductor
rewrote in full at every point; on a 1+1-layer T5 the statistics were 3,000 of its backward's
4,000 nodes and about 23 s of an 80 s compile. Batched, they are ~20 nodes per graph.

A chain this pass does not recognize (an intermediate value read elsewhere, a scale that is not a
set of rows' scale) is left as it is: ``record`` then runs as an op of its own, and computes the
same. The pass runs before ``batch_row_reads``: a point's scale is still its ``set_scale`` read,
whose rows say which scales to read.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from autoscale.measure import LOSS_ROW, MODES, reading, set_scale

from .graph_utils import new_constant, new_fake_call, provenance
from .manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["batch_records"]

PASS = "batch_records"
_RECORD = torch.ops.autoscale.record.default
_COPY = torch.ops.aten.copy.default
_COPY_ = torch.ops.aten.copy_.default
aten = torch.ops.aten
_COMBINES = {"max": (aten.amax.default, aten.maximum.default), "sum": (aten.sum.dim_IntList, aten.add.Tensor)}
"""Per way a cell combines (``MODES``): the reduction over a cell's values, and how it joins the cell."""


def batch_records(gm: GraphModule, cfg: Config) -> PassResult:
    """Replace every chain of ``record`` ops into an input by one fold (see the module docstring)."""
    graph = gm.graph
    if not graph.find_nodes(op="call_function", target=_RECORD):
        return PassResult(gm, modified=False, counts={"records": 0})
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
    batched = chains = 0
    for end in list(graph.find_nodes(op="call_function", target=_COPY_)):
        stats = end.args[0]
        if not isinstance(stats, Node) or stats.op != "placeholder":
            continue
        found = _chain(end.args[1], stats)
        if found is None:
            continue
        records, dead = found
        # (value, scale, bound): what ``reading`` reads, per recorded value
        readings = [_Reading(*parts) for r in records
                    for parts in zip(*(_seq(a) for a in (r.args[1], r.args[4], r.args[5])), strict=True)]
        cells = [int(c) for r in records for c in _seq(r.args[2])]
        modes = [int(m) for r in records for m in _seq(r.args[3])]
        if len({(c, MODES[m][0]) for c, m in zip(cells, modes, strict=True)}) != len(set(cells)):
            continue  # (a cell combined both ways: the order would matter; points never record so)
        readable, scales = _scales_read(readings)
        if not readable:
            continue  # (a scale that is not a set of rows' scale: points never record so)
        with graph.inserting_before(end):
            build = _Builder(gm, fake_mode, f"_autoscale_records_{chains}")
            folded = build.fold(stats, scales, readings, cells, modes)
        end.update_arg(1, folded)
        for node in reversed(dead):  # users before their inputs
            graph.erase_node(node)
        batched += len(records)
        chains += 1
    return PassResult(gm, modified=chains > 0, counts={"records": batched, "folds": chains})


def _seq(arg: Any) -> Sequence[Any]:
    """A ``record`` argument that is a list (values, cells, modes)."""
    assert isinstance(arg, (list, tuple))
    return arg


def _chain(value: Any, stats: Node) -> tuple[list[Node], list[Node]] | None:
    """The ``record`` nodes of the chain that ends in ``value`` and starts at ``stats``, first
    first, and the chain's nodes in graph order; None if ``value`` is not such a chain or one of
    its values is read outside it."""
    records: list[Node] = []
    dead: list[Node] = []
    end = next(iter(value.users)) if isinstance(value, Node) and len(value.users) == 1 else None
    while value is not stats:
        if not isinstance(value, Node):
            return None
        dead.append(value)
        if value.target is _COPY:  # copy(previous, new): the values of ``new``
            value = value.args[1]
        elif value.target is _RECORD:
            records.append(value)
            value = value.args[0]
        else:
            return None
    chain = {*dead, end}
    if not records or any(u not in chain for n in dead for u in n.users):
        return None
    records.reverse()
    dead.reverse()
    return records, dead


class _Reading(NamedTuple):
    """One recorded value and how ``reading`` reads it (``autoscale.measure.record``'s arguments)."""

    value: Node
    scale: Node | None
    bound: float


class _Builder:
    """Creates the fold's ATen nodes at the graph's insert point, with their fake values."""

    def __init__(self, gm: GraphModule, fake_mode: Any, prefix: str) -> None:
        self.gm, self.graph, self.fake_mode, self.prefix = gm, gm.graph, fake_mode, prefix
        self.constants = 0

    def fold(self, stats: Node, scales: Node | None, readings: Sequence[_Reading], cells: Sequence[int],
             modes: Sequence[int]) -> Node:
        """The points' values in one vector, read (``reading``) against the ``scales`` their
        points' scales are sets of, what each mode takes of it side by side (``MODES``), then per
        combine one gather, one reduction and one ``index_put``."""
        device = stats.meta["val"].device
        summed = {r for r, m in zip(readings, modes, strict=True) if MODES[m][0] == "sum"}
        partial = any(_numel(r.value) > 1 for r in readings)
        # (a point records one value in several cells; the computed values first and, with partial
        # results, those combined by max before those summed: ``read``)
        unique = sorted(dict.fromkeys(readings),
                        key=lambda r: (_constant(r.value) is not None, partial and r in summed))
        vector = self.read(unique, scales, device, summed)
        width = len(unique) + 1  # (and a 0, the padding's: every mode takes 0 of it)
        position = {r: j for j, r in enumerate(unique)}
        flat = self.call(aten.view.default, (stats, [-1]))
        for combine, (reduce, joined) in _COMBINES.items():
            used = sorted({m for m in modes if MODES[m][0] == combine})
            if not used:
                continue
            block = {m: b for b, m in enumerate(used)}
            taken = [MODES[m][1](self.op, vector) for m in used]
            taken_all = taken[0] if len(taken) == 1 else self.call(aten.cat.default, (taken,))
            by_cell: dict[int, list[int]] = defaultdict(list)
            for r, cell, m in zip(readings, cells, modes, strict=True):
                if m in block:
                    by_cell[cell].append(block[m] * width + position[r])
            targets = sorted(by_cell)
            most = max(len(js) for js in by_cell.values())
            plan = [by_cell[c] + [len(unique)] * (most - len(by_cell[c])) for c in targets]
            where = self.constant(targets, device)
            gathered = self.call(aten.index.Tensor, (taken_all, [self.constant(plan, device)]))
            reduced = self.call(reduce, (gathered, [1]))
            current = self.call(aten.index.Tensor, (flat, [where]))
            flat = self.call(aten.index_put.default, (flat, [where], self.call(joined, (current, reduced))))
        return self.call(aten.view.default, (flat, list(stats.meta["val"].shape)))

    def read(self, readings: Sequence[_Reading], scales: Node | None, device: torch.device,
             summed: set[_Reading]) -> Node:
        """Each reading's value (``reading``), and a 0 after them, as one vector. The values side by
        side: the computed ones, then (``readings`` orders them so) the numbers a graph says they
        always are (``_constant``: an element count). Their scales from ``scales`` directly, each
        set's largest for all readings at once (``largest``), not from the points' reads of the
        sets: those would be a piece each of another concatenation, where the readings' rows are
        one constant mask. Values handed as partial results (``autoscale.measure.Form.parts``) are
        reduced first, by max, or by sum for those in ``summed`` (``whole``)."""
        known = [_constant(r.value) for r in readings]
        computed = [r for r, k in zip(readings, known, strict=True) if k is None]
        constants = self.constant([*(k for k in known if k is not None), 0.0], device, dtype=torch.float32)
        if any(_numel(r.value) > 1 for r in computed):
            vector = self.call(aten.cat.default, ([*self.wholes(computed, summed, device), constants],))
        else:
            # (a one-element vector, as points and checks hand their peaks over, is a piece as it
            # is: Inductor then writes the reduction into its slot; a view of a value, it copies there)
            pieces = [r.value if tuple(r.value.meta["val"].shape) == (1,)
                      else self.call(aten.view.default, (r.value, [1])) for r in computed]
            vector = self.call(aten.cat.default, ([*pieces, constants],))
        if all(r.scale is None and r.bound == math.inf for r in readings):  # (read as they are)
            return vector
        return reading(self.op, vector, self.largest(scales, [_rows(r.scale) for r in readings], device),
                       self.constant([*(r.bound for r in readings), math.inf], device, dtype=torch.float32))

    def wholes(self, computed: Sequence[_Reading], summed: set[_Reading], device: torch.device) -> list[Node]:
        """The ``computed`` values, each reduced to one (``autoscale.measure.whole``), as one vector
        per way they combine, those by max first (``computed`` is so ordered): the values' elements
        side by side, then gathered per value by a constant plan, padded with an element that
        leaves its reduction unchanged (-inf for a max, 0 for a sum), and reduced."""
        flat = [r.value if len(r.value.meta["val"].shape) == 1 else self.call(aten.view.default, (r.value, [-1]))
                for r in computed]
        ends = list(itertools.accumulate(_numel(r.value) for r in computed))
        pad = ends[-1] if ends else 0
        elements = self.call(aten.cat.default, ([*flat, self.constant([-math.inf, 0.0], device, dtype=torch.float32)],))
        out = []
        for combine, (reduce, _) in _COMBINES.items():
            chosen = [j for j, r in enumerate(computed) if (r in summed) == (combine == "sum")]
            if not chosen:
                continue
            spans = [range(ends[j] - _numel(computed[j].value), ends[j]) for j in chosen]
            widest = max(len(span) for span in spans)
            filler = pad + (combine == "sum")
            plan = [[*span, *[filler] * (widest - len(span))] for span in spans]
            gathered = self.call(aten.index.Tensor, (elements, [self.constant(plan, device)]))
            out.append(self.call(reduce, (gathered, [1])))
        return out

    def largest(self, scales: Node | None, sets: Sequence[tuple[int, ...]], device: torch.device) -> Node:
        """Per set of rows, and for a last set of none, the largest of its scales (1 for none: the
        loss row's, ``LOSS_ROW``), as ``autoscale.measure.set_scale`` reads one: a masked maximum."""
        if scales is None:  # (every set is none)
            return self.constant([1.0] * (len(sets) + 1), device, dtype=torch.float32)
        rows = scales.meta["val"].shape[0]
        mask = [[r in (s or (LOSS_ROW,)) for r in range(rows)] for s in [*sets, ()]]
        chosen = self.call(aten.where.ScalarOther, (self.constant(mask, device), scales, 0.0))
        return self.call(aten.amax.default, (chosen, [1]))

    def op(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        """A ``Call`` (``autoscale.measure``) that adds the op to the graph."""
        return self.call(target, args, kwargs)

    def call(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Node:
        node = new_fake_call(self.graph, self.fake_mode, target, args, kwargs)
        provenance(node, PASS, "fold the statistics the graph's rescale points record", created=True)
        return node

    def constant(self, values: list[Any], device: torch.device, dtype: torch.dtype | None = None) -> Node:
        """``torch.tensor(values)`` as a constant of the graph, read as traced code reads one."""
        name = f"{self.prefix}_{self.constants}"
        self.constants += 1
        attr = new_constant(self.gm, self.fake_mode, name, lambda: torch.tensor(values, device=device, dtype=dtype))
        provenance(attr, PASS, "the fold's index plan", created=True)
        return self.call(aten.lift_fresh_copy.default, (attr,))


def _scales_read(readings: Sequence[_Reading]) -> tuple[bool, Node | None]:
    """Whether every scale of ``readings`` is a set of rows' largest scale (``_rows``), and the
    scales tensor they read (None if they read none: they are all 1)."""
    parts = {r.scale for r in readings if r.scale is not None and _constant(r.scale) != 1.0}
    sources = {p.args[0] for p in parts if p.target is set_scale}
    if len(sources) > 1 or any(p.target is not set_scale for p in parts):
        return False, None
    source = sources.pop() if sources else None
    return source is None or isinstance(source, Node), source if isinstance(source, Node) else None


def _rows(part: Node | None) -> tuple[int, ...]:
    """The rows whose largest scale ``part`` is (``_scales_read``): none (1) for None or a 1."""
    return () if part is None or part.target is not set_scale else tuple(_seq(part.args[1]))


def _numel(value: Node) -> int:
    """How many elements a recorded value has: 1, or a point's partial results (``Form.parts``)."""
    return math.prod(value.meta["val"].shape)


def _constant(value: Node) -> float | None:
    """The number a recorded value or scale always is, if the graph says so: a ``full`` of a
    constant (a parameter's element count; a count that depends on a dynamic size is a symbol, not
    a number), or a ``ones`` (the scale of a set of no row but the loss row's, ``measure._max_of``)."""
    if value.target is aten.full.default and isinstance(value.args[1], (int, float)):
        return float(value.args[1])
    if value.target is aten.ones.default:
        return 1.0
    return None
