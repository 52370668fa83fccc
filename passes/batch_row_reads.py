"""Read the scales of all a graph's rescale points with one ``autoscale::row_scales`` call.

A compiled graph's points read their rows' scales from buffers of their own, one per row
(``autoscale.measure._row_scales``: a scale read at a row index became a constant in its kernel's
source, and identical layers compiled a kernel each). Traced, each point reads each of its rows
with ``autoscale::row_scale``, one small op. This pass gathers the reads after the trace: per
scales tensor one ``row_scales`` before the first read, and each read replaced by that call's
output for its row. The same values (copies of the same rows), and at run time one call.

Why not trace ``row_scales`` at each point and leave the rest to AOTAutograd's common-subexpression
pass: every call made a node and a fake tensor per row, all but the first call's dead, O(points ×
rows) in the trace. On a 3+3-layer T5 (232 points, 100 rows) that was about 10 s of its 90 s
first step.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from autoscale.measure import row_scale, row_scales

from .graph_utils import new_node, provenance
from .manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["batch_row_reads"]

PASS = "batch_row_reads"


def batch_row_reads(gm: GraphModule, cfg: Config) -> PassResult:
    """Replace every ``row_scale`` read by an output of one ``row_scales`` per scales tensor."""
    graph = gm.graph
    reads = graph.find_nodes(op="call_function", target=row_scale)  # (in graph order)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
    if not reads or fake_mode is None:  # (no fake values to type the outputs with: leave the reads)
        return PassResult(gm, modified=False, counts={"reads": 0, "calls": 0})
    by_source: dict[Node, list[Node]] = {}
    for read in reads:
        by_source.setdefault(_source(read), []).append(read)
    for source, its_reads in by_source.items():
        with graph.inserting_before(its_reads[0]):
            every = new_node(graph, "call_function", row_scales, (source,))
            with fake_mode:
                every.meta["val"] = row_scales(source.meta["val"])
            provenance(every, PASS, "every row's scale, for the graph's rescale points", created=True)
            rows: dict[int, Node] = {}
            for row in sorted({_row(read) for read in its_reads}):
                rows[row] = new_node(graph, "call_function", operator.getitem, (every, row))
                rows[row].meta["val"] = every.meta["val"][row]
                provenance(rows[row], PASS, f"row {row}'s scale", created=True)
        for read in its_reads:
            read.replace_all_uses_with(rows[_row(read)])
            graph.erase_node(read)
    return PassResult(gm, modified=True, counts={"reads": len(reads), "calls": len(by_source)})


def _source(read: Node) -> Node:
    """The scales tensor a ``row_scale`` reads."""
    source = read.args[0]
    assert isinstance(source, Node)
    return source


def _row(read: Node) -> int:
    """The row a ``row_scale`` reads."""
    row = read.args[1]
    assert isinstance(row, int)
    return row
