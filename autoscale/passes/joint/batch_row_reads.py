"""Compute each set of rows' scale once per graph, as a small reduction that repeated layers share.

A point's factor is the largest scale of the rows its gradient leaves with over the largest of those
it arrived with (``autoscale.measure._scale_of``). Traced, a point reads each of its two sets of rows
with ``autoscale::set_scale``. This pass replaces the reads of each distinct set by one reduction
over the whole scales vector with the set's rows chosen by a mask, a constant of the graph:
``amax(where(mask, scales, 0))`` (scales are positive; a set of no row is the loss row's, whose
scale is 1).

Why a reduction, with its rows in a tensor: Inductor writes a reduction to a buffer of its own, so
every point's kernel receives its two scales as arguments, whatever their rows, and the points of
repeated layers compile to one kernel. The mask being an argument too, and every set's reduction as
long as the scales vector, the sets' reductions are one source, which Inductor fuses side by side
(up to 16 in a C++ loop nest) into kernels that repeated layers also share. What did not work, on a
3+3-layer T5:

* a row index in the point's kernel (``scales[row]``): kernels that differed in one number, one per
  layer;
* each row a buffer of its own and their largest taken in the point's kernel: a merge on a residual
  stream takes the union of every later layer's rows, so points at each depth took another number
  of arguments and Inductor grouped them otherwise;
* a reduction over the rows written as constants (``cat(scales[r:r+1], ...)``), of each set's own
  length: the reductions of different sets were different sources;
* one extern op computing every set and copying each into a buffer (``set_scales``): few kernels,
  but its Python call was a large part of what the points added to the quick transformer block's
  backward;
* a gather of each set's rows by an index tensor, padded to the widest set: few kernels, but
  Inductor writes a vectorized gather as a loop of scalar loads with a bounds check and a
  wraparound per element, which lengthened the C++ compiles
  (counts and costs: docs/results/compile_time_models.md, overhead_quick.md).

The loss row (``autoscale.protocol.LOSS_ROW``) is read like any other: its scale is 1 by the state's
invariant, which makes a set's largest scale clamped at 1, as ``_max_of`` computes it eagerly.

Why after the trace: a point cannot know the graph's other sets, and AOTAutograd's
common-subexpression pass merges reads of one set across points only as one op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from autoscale.ops import set_scale
from autoscale.protocol import LOSS_ROW

from ..graph_utils import new_constant, new_fake_call, provenance
from ..manager import PassResult

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autoscale.config import Config

__all__ = ["batch_row_reads"]

PASS = "batch_row_reads"
aten = torch.ops.aten


def batch_row_reads(gm: GraphModule, cfg: Config) -> PassResult:
    """Replace the reads of each distinct set of rows by one reduction over its scales."""
    graph = gm.graph
    reads = graph.find_nodes(op="call_function", target=set_scale)  # (in graph order)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
    if not reads or fake_mode is None:  # (no fake values to type the new nodes with: leave the reads)
        return PassResult(gm, modified=False, counts={"reads": 0, "sets": 0})
    by_source: dict[Node, list[Node]] = {}
    for read in reads:
        by_source.setdefault(_source(read), []).append(read)
    build = _Builder(gm, fake_mode)
    sets = 0
    for source, its_reads in by_source.items():
        largest: dict[tuple[int, ...], Node] = {}
        with graph.inserting_before(its_reads[0]):  # (the partitioner moves each before its first read)
            for rows in sorted({_rows(read) for read in its_reads}):
                why = f"the largest scale of rows {list(rows)}"
                chosen = build.mask(rows or (LOSS_ROW,), source, why)
                scales = build.call(why, aten.where.ScalarOther, chosen, source, 0.0)
                largest[rows] = build.call(why, aten.amax.default, scales, [0, 1])
        for read in its_reads:
            read.replace_all_uses_with(largest[_rows(read)])
            graph.erase_node(read)
        sets += len(largest)
    return PassResult(gm, modified=True, counts={"reads": len(reads), "sets": sets})


class _Builder:
    """Creates the reductions' nodes at the graph's insert point, with their fake values."""

    def __init__(self, gm: GraphModule, fake_mode: FakeTensorMode) -> None:
        self.gm, self.fake_mode, self.made = gm, fake_mode, 0

    def call(self, why: str, target: Any, *args: Any) -> Node:
        node = new_fake_call(self.gm.graph, self.fake_mode, target, args)
        provenance(node, PASS, why, created=True)
        return node

    def mask(self, rows: tuple[int, ...], scales: Node, why: str) -> Node:
        """Which of ``scales``' rows are ``rows``, as a constant of the graph on ``scales``' device,
        read as traced code reads one. One row of a matrix: Inductor writes a 1-D constant of up to
        8 elements into the kernel's source, which would make each set's kernel its own."""
        value = scales.meta["val"]

        def make() -> torch.Tensor:
            mask = torch.zeros((1, value.shape[0]), dtype=torch.bool, device=value.device)
            mask[0, list(rows)] = True
            return mask

        attr = new_constant(self.gm, self.fake_mode, f"_autoscale_rows_{self.made}", make)
        self.made += 1
        provenance(attr, PASS, f"{why}: which rows", created=True)
        return self.call(why, aten.lift_fresh_copy.default, attr)


def _source(read: Node) -> Node:
    """The scales tensor a ``set_scale`` reads."""
    source = read.args[0]
    assert isinstance(source, Node)
    return source


def _rows(read: Node) -> tuple[int, ...]:
    """The rows a ``set_scale`` reads (``autoscale.measure._scale_of`` traces them sorted, each once)."""
    rows = read.args[1]
    assert isinstance(rows, (list, tuple))
    return tuple(rows)
