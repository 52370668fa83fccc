"""Fold all the statistics a graph's rescale points record into one update of the statistics tensor.

Each rescale point's backward records its measurements with one ``autoscale::record`` op
(``autoscale.measure``), and writes the result back into the statistics tensor, a graph input.
In AOTAutograd's joint graph that is a chain through the tensor — ``record``, ``copy``, ``record``,
``copy``, ... — ending in the ``copy_`` into the input. This pass replaces each such chain by one
fold at its end: the points' values concatenated, each read against the scale its point's output
leaves with (``autoscale.measure.reading``: a peak at unit scale, or the mark of an overflow the
point's scaling made), gathered per cell with a constant index plan and mask, each gathered value
taken as its record's mode says (``autoscale.measure.MODES``: the flags a point's one number
marks), reduced (max or sum, as each cell combines: both at once), and joined with the tensor in
one elementwise pass. Values handed as partial results (a GPU's points hand them so:
``autoscale.protocol.Form``) are reduced to one first, the same way. On a GPU that is three
kernels (docs/results/kernel_counts.md). The result is the same as folding point by point: every
point's values are computed before the end of the chain, each cell is combined one way (its
column's; a chain that mixes them is left alone), and max is associative and commutative, as is a
sum of counts (integers, exact in float32 below 2^24). Σ g and Σ g² (the "paper" rule's moments)
are summed in another order, so they may differ in the last bit.

Why: folded point by point, each update was a few ops over the whole tensor, which Inductor
rewrote in full at every point; the statistics became most of a backward's nodes and compile time
(docs/results/compile_time_models.md). Batched, they are ~20 nodes per graph.

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

from autoscale.measure import MODES, reading, taken
from autoscale.ops import set_scale
from autoscale.protocol import LOSS_ROW

from ..graph_utils import new_constant, new_fake_call, provenance
from ..manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["batch_records"]

PASS = "batch_records"
_RECORD = torch.ops.autoscale.record.default
_COPY = torch.ops.aten.copy.default
_COPY_ = torch.ops.aten.copy_.default
aten = torch.ops.aten
_WIDE = 32
"""A cell of more values than this (of one mode, combined by max) is reduced over the vector with a
mask, not gathered (``_Builder.fold``)."""


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
    """One recorded value and how ``reading`` reads it (``autoscale.ops.record``'s arguments)."""

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
        points' scales are sets of; one masked gather of each cell's values, each taken as its
        record's mode says (``MODES``), reduced both ways (``both``); then the new statistics
        in one elementwise pass, each cell joined with its reduction the way its column combines.
        The numbers a graph says a value always is (``_constant``: an element count) are taken and
        combined per cell here, not gathered."""
        device, shape = stats.meta["val"].device, list(stats.meta["val"].shape)
        known = {r: k for r in readings if (k := _constant(r.value)) is not None}
        summed = {r for r, m in zip(readings, modes, strict=True) if MODES[m][0] == "sum"}
        unique = list(dict.fromkeys(r for r in readings if r not in known))
        position = {r: j for j, r in enumerate(unique)}
        by_cell: dict[int, list[tuple[int, int]]] = defaultdict(list)  # (cell: its values' positions and modes)
        fixed: dict[int, list[float]] = defaultdict(list)
        combine: dict[int, str] = {}
        for r, cell, m in zip(readings, cells, modes, strict=True):
            combine[cell] = MODES[m][0]
            if r in known:
                fixed[cell].append(float(taken(m, torch.tensor(known[r]))))
            else:
                by_cell[cell].append((position[r], m))
        every = range(math.prod(shape))
        maxed = self.constant([combine.get(c) == "max" for c in every], device)
        # (the constants' part of each cell: -inf where none is combined by max, 0 where none is summed)
        most = self.constant([max(fixed[c], default=-math.inf) for c in every], device, dtype=torch.float32)
        total = self.constant([sum(fixed[c]) for c in every], device, dtype=torch.float32)
        if unique:
            vector = self.read(unique, scales, device, summed)
            # (a cell of many values of one mode combined by max, as ``ANY_NONFINITE`` takes every
            # point's, is a masked maximum over what that mode takes of the vector instead:
            # gathered, its row would be the widest by far, and every other row padded to it)
            wide = {c: entries[0][1] for c, entries in by_cell.items()
                    if len(entries) > _WIDE and combine[c] == "max" and len({m for _, m in entries}) == 1}
            rows = [[] if c in wide else by_cell.get(c, []) for c in every]
            gathered_most, gathered_total = self.both(vector, rows, device)
            most = self.call(aten.maximum.default, (gathered_most, most))
            total = self.call(aten.add.Tensor, (gathered_total, total))
            for m in sorted(set(wide.values())):
                cells_m = [c for c in every if wide.get(c) == m]
                members = [{j for j, _ in by_cell[c]} for c in cells_m]
                mask = [[j in js for j in range(len(unique))] for js in members]
                chosen = self.call(aten.where.ScalarOther, (self.constant(mask, device), MODES[m][1](self.op, vector),
                                                            -math.inf))
                largest = self.call(aten.amax.default, (chosen, [1]))
                slot = {c: k for k, c in enumerate(cells_m)}
                index = self.constant([slot.get(c, 0) for c in every], device)
                spread = self.call(aten.index.Tensor, (largest, [index]))
                most = self.call(aten.where.self, (self.constant([c in slot for c in every], device),
                                                   self.call(aten.maximum.default, (most, spread)), most))
        # (each cell of the statistics joined with its values, the way its column combines; a cell
        # no value reaches gets a sum's 0 added)
        flat = self.call(aten.view.default, (stats, [-1]))
        out = self.call(aten.where.self, (maxed, self.call(aten.maximum.default, (flat, most)),
                                          self.call(aten.add.Tensor, (flat, total))))
        return self.call(aten.view.default, (out, shape))

    def both(self, values: Node, rows: Sequence[Sequence[tuple[int, int | None]]], device: torch.device
             ) -> tuple[Node, Node]:
        """``values`` gathered into one row per list of ``rows`` (entries: a position in ``values``
        and a mode; a constant index, padded to the longest row and masked), each element taken as
        its entry's mode says (``MODES``; None: as it is), and each row's largest and sum (-inf and 0
        for an empty row). Each reduction gathers what the modes combined its way take of
        ``values``, a gather per mode, each read once, and Inductor computes the gathers and both
        reductions in one kernel (one launch on a GPU, where each way apart was a launch of its
        own). Taken of the whole vector and concatenated first, the modes were a piece each, a
        tensor the graph's wrapper made at every call (5 or 6 of every backward's,
        ``benchmarks.kernel_counts``); one gather read by both reductions and by every mode was a
        buffer of its own. Padded with an element of ``values`` instead of masked, the padding was a
        piece of its own, a copy."""
        widest = max(1, *(len(row) for row in rows))
        plan = [[j for j, _ in row] + [0] * (widest - len(row)) for row in rows]
        mask = self.constant([[j < len(row) for j in range(widest)] for row in rows], device)
        index = self.constant(plan, device)
        modes = [[m for _, m in row] + [None] * (widest - len(row)) for row in rows]

        def gathered(vector: Node) -> Node:
            return self.call(aten.index.Tensor, (vector, [index]))

        def combined(way: str) -> Node:
            """The gathered values as the modes combined ``way`` take them: each mode's where its
            entries are (the rest, read by the other reduction or masked, as the first mode's)."""
            used = sorted({m for row in modes for m in row if m is not None and MODES[m][0] == way})
            if not used:
                return gathered(values)
            picked = gathered(MODES[used[0]][1](self.op, values))
            for m in used[1:]:
                where_m = self.constant([[mode == m for mode in row] for row in modes], device)
                picked = self.call(aten.where.self, (where_m, gathered(MODES[m][1](self.op, values)), picked))
            return picked

        most = self.call(aten.amax.default, (self.call(aten.where.ScalarOther, (mask, combined("max"), -math.inf)),
                                             [1]))
        total = self.call(aten.sum.dim_IntList, (self.call(aten.where.ScalarOther, (mask, combined("sum"), 0.0)), [1]))
        return most, total

    def read(self, readings: Sequence[_Reading], scales: Node | None, device: torch.device,
             summed: set[_Reading]) -> Node:
        """Each reading's value (``reading``), as one vector. Their scales from ``scales``
        directly, each set's largest for all readings at once (``largest``), not from the points'
        reads of the sets: those would be a piece each of another concatenation, where the
        readings' rows are one constant mask. Values handed as partial results
        (``autoscale.protocol.Form.parts``) are first reduced to one (``whole``), by sum for those
        in ``summed``, else by max: their elements side by side, gathered per value (``both``)."""
        if any(_numel(r.value) > 1 for r in readings):
            pieces = [r.value if len(r.value.meta["val"].shape) == 1 else self.call(aten.view.default, (r.value, [-1]))
                      for r in readings]
            ends = list(itertools.accumulate(_numel(r.value) for r in readings))
            spans = [range(end - _numel(r.value), end) for r, end in zip(readings, ends, strict=True)]
            most, total = self.both(self.call(aten.cat.default, (pieces,)),
                                    [[(j, None) for j in span] for span in spans], device)
            vector = self.call(aten.where.self, (self.constant([r in summed for r in readings], device), total, most))
        else:
            # (a one-element vector, as points and checks hand their peaks over, is a piece as it
            # is: Inductor then writes the reduction into its slot; a view of a value, it copies there)
            pieces = [r.value if tuple(r.value.meta["val"].shape) == (1,)
                      else self.call(aten.view.default, (r.value, [1])) for r in readings]
            vector = self.call(aten.cat.default, (pieces,))
        if all(r.scale is None and r.bound == math.inf for r in readings):  # (read as they are)
            return vector
        return reading(self.op, vector, self.largest(scales, [_rows(r.scale) for r in readings], device),
                       self.constant([r.bound for r in readings], device, dtype=torch.float32))

    def largest(self, scales: Node | None, sets: Sequence[tuple[int, ...]], device: torch.device) -> Node:
        """Per set of rows, the largest of its scales (1 for none: the loss row's, ``LOSS_ROW``), as
        ``autoscale.ops.set_scale`` reads one: a masked maximum."""
        if scales is None:  # (every set is none)
            return self.constant([1.0] * len(sets), device, dtype=torch.float32)
        rows = scales.meta["val"].shape[0]
        mask = [[r in (s or (LOSS_ROW,)) for r in range(rows)] for s in sets]
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
