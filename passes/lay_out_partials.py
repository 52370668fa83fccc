"""Lay a value's partial results out as Inductor will lay out the value.

On a GPU a point or a check hands the fold partial maxima (and counts) of its value: a reduction
over ``[parts, -1]``, the value's elements in memory order (``autoscale.measure._partial``), which
Inductor fuses into the kernel that writes the value and reads there in the order it writes. But
the memory order is Inductor's to decide, after the trace: by its heuristics
(``GraphLowering.decide_layout_opt``) a graph whose convolutions are wide (more than 64 channels,
as a ResNet's) is laid out channels-last, and its 4-D values and their gradients with it. Taken in
the traced order, NCHW, the partial reduction read such a value at a stride of its channels, which
on a GPU is uncoalesced, in a kernel of its own. A CNN of 128-channel convolutions launched 54
kernels a step so, 42 laid out as here (docs/results/kernel_counts.md); torch.amp's, 33.

Traced, ``_partial`` is one op, ``autoscale::partials``, which this pass replaces by a view of the
value: in channels-last order (NHWC) for a 4-D value where Inductor will lay the graph out
channels-last, in the traced memory order otherwise. The decision is Inductor's own function, run on
the joint graph (whose convolutions are the forward graph's, which Inductor decides for). Any order
gives the same reduction over all the parts. Where a graph is laid out channels-last, every 4-D
value is read so, also one Inductor keeps in NCHW for not touching a convolution (a hybrid model's
attention scores): read across its layout, as every 4-D value was before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from autoscale.measure import partials

from .graph_utils import new_fake_call, provenance
from .manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["lay_out_partials"]

PASS = "lay_out_partials"
aten = torch.ops.aten
_CHANNELS_LAST = (0, 2, 3, 1)  # (NCHW's dimensions in the order channels-last lays them out)


def lay_out_partials(gm: GraphModule, cfg: Config) -> PassResult:
    """Replace each ``autoscale::partials`` by a view of its value in the order Inductor will lay it out."""
    graph = gm.graph
    found = graph.find_nodes(op="call_function", target=partials)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
    if not found or fake_mode is None:  # (no fake values to type the views with: the op computes the same)
        return PassResult(gm, modified=False, counts={"partials": 0, "channels_last": 0})
    channels_last = cfg.executor == "inductor" and _inductor_lays_out_channels_last(gm)
    laid_out = 0
    for node in found:
        value, parts = node.args
        assert isinstance(value, Node) and isinstance(parts, int)
        val = value.meta["val"]
        across = channels_last and val.dim() == 4
        order = _CHANNELS_LAST if across else sorted(range(val.dim()), key=lambda d: -val.stride()[d])
        why = f"{parts} partial results of {value.name}, " + (
            "channels-last, as Inductor lays out this graph" if across else "in its memory order")
        with graph.inserting_before(node):
            dense = value
            if across:
                dense = new_fake_call(graph, fake_mode, aten.clone.default, (value,),
                                      {"memory_format": torch.channels_last})
                provenance(dense, PASS, why, created=True)
            if list(order) != list(range(val.dim())):
                dense = new_fake_call(graph, fake_mode, aten.permute.default, (dense, list(order)))
                provenance(dense, PASS, why, created=True)
            view = new_fake_call(graph, fake_mode, aten.view.default, (dense, [parts, -1]))
            provenance(view, PASS, why, created=True)
        node.replace_all_uses_with(view)
        graph.erase_node(node)
        laid_out += across
    return PassResult(gm, modified=True, counts={"partials": len(found), "channels_last": laid_out})


def _inductor_lays_out_channels_last(gm: GraphModule) -> bool:
    """Whether Inductor will lay this graph's convolutions out channels-last: its own decision
    (``GraphLowering.decide_layout_opt``), on the joint graph. The forward graph it decides for
    holds the same convolutions; its one rule on the graph's size (no channels-last for fewer than
    one convolution in 300 nodes) reads fewer nodes there, so a joint graph near that bound is
    taken as NCHW where Inductor may not: its partial results are then read as before. So is a
    graph the function cannot read (another torch's signature, a node without its fake value): the
    layout only decides how fast the partial results are read, never what they are."""
    from torch._inductor.graph import GraphLowering  # (Inductor: only when compiling)

    try:
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))
    except (AttributeError, KeyError, TypeError):
        return False
