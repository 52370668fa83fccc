"""Read the scales of all a graph's rescale points with one ``autoscale::set_scales`` call.

A compiled graph's points read the two scales their factor is made of — the largest scale of the
rows the gradient leaves with, and of those it arrived with — from 0-dim buffers of their own
(``autoscale.measure._set_scales``: read in the points' kernels, the rows made kernels of repeated
layers differ). Traced, each point reads each of its two sets of rows with ``autoscale::set_scale``,
one small op. This pass gathers the reads after the trace: per scales tensor one ``set_scales``
before the first read, over the distinct sets read, and each read replaced by that call's output
for its set. The same values, and at run time one call.

Why not trace ``set_scales`` of every set at each point and leave the rest to AOTAutograd's
common-subexpression pass: every call would make a node and a fake tensor per set, all but the
first call's dead, O(points × sets) in the trace. Tracing every row at every point that way was
about 10 s of a 3+3-layer T5's 90 s first step (232 points, 100 rows).
"""

from __future__ import annotations

import itertools
import operator
from typing import TYPE_CHECKING

from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from autoscale.measure import set_scale, set_scales

from .graph_utils import new_node, provenance
from .manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["batch_row_reads"]

PASS = "batch_row_reads"


def batch_row_reads(gm: GraphModule, cfg: Config) -> PassResult:
    """Replace every ``set_scale`` read by an output of one ``set_scales`` per scales tensor."""
    graph = gm.graph
    reads = graph.find_nodes(op="call_function", target=set_scale)  # (in graph order)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
    if not reads or fake_mode is None:  # (no fake values to type the outputs with: leave the reads)
        return PassResult(gm, modified=False, counts={"reads": 0, "calls": 0, "sets": 0})
    by_source: dict[Node, list[Node]] = {}
    for read in reads:
        by_source.setdefault(_source(read), []).append(read)
    distinct = 0
    for source, its_reads in by_source.items():
        sets = sorted({_rows(read) for read in its_reads})
        distinct += len(sets)
        rows, ends = list(itertools.chain.from_iterable(sets)), list(itertools.accumulate(map(len, sets)))
        with graph.inserting_before(its_reads[0]):
            every = new_node(graph, "call_function", set_scales, (source, rows, ends))
            with fake_mode:
                every.meta["val"] = set_scales(source.meta["val"], rows, ends)
            provenance(every, PASS, "the largest scale of each set of rows the graph's rescale points read",
                       created=True)
            outputs: dict[tuple[int, ...], Node] = {}
            for k, chosen in enumerate(sets):
                outputs[chosen] = new_node(graph, "call_function", operator.getitem, (every, k))
                outputs[chosen].meta["val"] = every.meta["val"][k]
                provenance(outputs[chosen], PASS, f"the largest scale of rows {list(chosen)}", created=True)
        for read in its_reads:
            read.replace_all_uses_with(outputs[_rows(read)])
            graph.erase_node(read)
    return PassResult(gm, modified=True, counts={"reads": len(reads), "calls": len(by_source), "sets": distinct})


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
