"""Lay a value's partial results out as Inductor will lay out the value, in a kernel of Inductor's.

On a GPU a point or a check hands the fold partial maxima (and counts) of its value: a reduction
over ``[parts, -1]``, the value's elements in memory order (``autoscale.measure.largest``), which
Inductor fuses into the kernel that writes the value and reads there in the order it writes.

**The layout.** The memory order is Inductor's to decide, after the trace: by its heuristics
(``GraphLowering.decide_layout_opt``) a graph whose convolutions are wide (more than 64 channels,
as a ResNet's) is laid out channels-last, and its 4-D values and their gradients with it. Taken in
the traced order, NCHW, the partial reduction read such a value at a stride of its channels, which
on a GPU is uncoalesced, in a kernel of its own (the wide CNN of ``benchmarks.kernel_counts``:
docs/results/kernel_counts.md, "Why the layout"). Traced, ``_partial`` is one
op, ``autoscale::partials``, which this pass replaces by a view of the value: in channels-last order
(NHWC) for a 4-D value where Inductor will lay the graph out channels-last, in the traced memory
order otherwise. The decision is Inductor's own function, run on the joint graph (whose
convolutions are the forward graph's, which Inductor decides for). Where a graph is laid out
channels-last, every 4-D value is read so, also one Inductor keeps in NCHW for not touching a
convolution (a hybrid model's attention scores): read across its layout, as every 4-D value was
before.

**The kernel.** A value an extern kernel writes (a GEMM's output: cuBLAS, not Inductor) has no
kernel of Inductor's for its partial reduction to join, so the reduction was a launch of its own:
a check of each of an attention's Q, K and V projections. But where the next GEMM reads the value
through a copy that Inductor writes (heads split off: a ``clone`` of a permute), that copy holds
every element of the value once, so the same maximum and the same count of zeros. The partial
results are then read from the copy, in its memory order, and Inductor computes them in the kernel
that writes it (a probe: a GEMM's output split into heads and checked, 2 launches; its copy
checked, 1).

Either way, any grouping of the elements into parts gives the same reduction over all of them. The
number of parts is the trace's (the fold reads that many): a value whose parts were its rows in
the traced order (``autoscale.protocol.Form.rows``) and that Inductor lays out channels-last, or
that is read from a copy, is split into as many equal runs of its elements in the new order.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from autoscale.measure import is_dense, memory_order
from autoscale.ops import partials

from ..graph_utils import cast_of, new_fake_call, op_name, provenance
from ..manager import PassResult
from ..op_tables import ALIASES, EXTERN_GEMMS, REARRANGING, UNARY_ELEMENTWISE, VIEWS

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["lay_out_partials"]

PASS = "lay_out_partials"
aten = torch.ops.aten
_CHANNELS_LAST = (0, 2, 3, 1)  # (NCHW's dimensions in the order channels-last lays them out)
_VIEWS = VIEWS | {"_unsafe_view"}  # (what a GEMM's output is read through, to the GEMM)
_THROUGH = REARRANGING - {"clone"}  # (what a GEMM reads its operand through, from the copy)


def lay_out_partials(gm: GraphModule, cfg: Config) -> PassResult:
    """Replace each ``autoscale::partials`` by a view of its value in the order Inductor will lay it out."""
    graph = gm.graph
    found = graph.find_nodes(op="call_function", target=partials)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
    if not found or fake_mode is None:  # (no fake values to type the views with: the op computes the same)
        return PassResult(gm, modified=False, counts={"partials": 0, "channels_last": 0, "copies": 0})
    channels_last = cfg.executor == "inductor" and _inductor_lays_out_channels_last(gm)
    laid_out = 0
    copies = 0
    for node in found:
        value, parts = node.args
        assert isinstance(value, Node) and isinstance(parts, int)
        traced_input, at = value, node
        unary: list[Node] = []
        copied = _copy_read_after_its_gemm(node)
        if copied is not None:
            value, at, unary = copied
            copies += 1
        val = value.meta["val"]
        across = channels_last and val.dim() == 4 and copied is None
        order = _CHANNELS_LAST if across else memory_order(val)
        why = f"{parts} partial results of {value.name}, " + (
            "channels-last, as Inductor lays out this graph" if across
            else "in its memory order" if copied is None else "read from a copy Inductor writes")
        with graph.inserting_before(at):
            dense = value
            for op in unary:  # (the casts and ``abs`` the reduction took of the value, of its copy)
                dense = new_fake_call(graph, fake_mode, op.target, (dense, *op.args[1:]), dict(op.kwargs))
                provenance(dense, PASS, why, created=True)
            if across:
                dense = new_fake_call(graph, fake_mode, aten.clone.default, (dense,),
                                      {"memory_format": torch.channels_last})
                provenance(dense, PASS, why, created=True)
            if list(order) != list(range(val.dim())):
                dense = new_fake_call(graph, fake_mode, aten.permute.default, (dense, list(order)))
                provenance(dense, PASS, why, created=True)
            view = new_fake_call(graph, fake_mode, aten.view.default, (dense, [parts, -1]))
            provenance(view, PASS, why, created=True)
        if copied is not None:
            (reduction,) = node.users
            at.prepend(reduction)  # (after the copy's GEMM, which has Inductor write the copy first)
        node.replace_all_uses_with(view)
        graph.erase_node(node)
        laid_out += across
        if copied is not None:
            _erase_unused(traced_input)
    return PassResult(gm, modified=True, counts={"partials": len(found), "channels_last": laid_out, "copies": copies})


def _under(node: Node) -> tuple[Any, list[Node]]:
    """The value ``node`` (a ``partials``) reduces, under its casts and ``abs`` (and aliases), and those
    ops, the value's first."""
    unary: list[Node] = []
    value = node.args[0]
    while isinstance(value, Node) and value.op == "call_function" and (
            cast_of(value) is not None or op_name(value) in ALIASES or (
                op_name(value) in UNARY_ELEMENTWISE and len(value.args) == 1)):
        if op_name(value) not in ALIASES:
            unary.append(value)
        value = value.args[0]
    return value, unary[::-1]


def _copy_read_after_its_gemm(node: Node) -> tuple[Node, Node, list[Node]] | None:
    """For ``node`` (a ``partials``) of a GEMM's output, under casts and ``abs``, whose next GEMM reads
    it through a copy that Inductor writes (rearrangements that keep every element, then a
    ``clone``): the copy, the node after that GEMM, before which its reduction is to read the copy,
    and the casts and ``abs`` to take of it (``_under``). Inductor lowers nodes in order; read
    before the GEMM, the copy would still be an unwritten expression, which the reduction computes
    again in a kernel of its own. None where that is not so, or where the reduction's result is read
    before that point (not a fold at the graph's end)."""
    value, unary = _under(node)
    if not isinstance(value, Node) or not _written_by_gemm(value) or len(node.users) != 1:
        return None
    copy = _copy_of(value)
    if copy is None:
        return None
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    gemm = _first_reader(copy, position)
    if gemm is None or gemm.next.op == "output":
        return None
    (reduction,) = node.users
    if any(position[user] <= position[gemm] for user in reduction.users):
        return None
    return copy, gemm.next, unary


def _first_reader(copy: Node, position: dict[Node, int]) -> Node | None:
    """The first node that reads ``copy`` other than through rearrangements (views, a transpose, an
    ``expand``, as a batched GEMM reads its operands): the GEMM it is made for, or None if that
    first reader is not a GEMM."""
    readers: list[Node] = []
    frontier = [copy]
    while frontier:
        for user in frontier.pop().users:
            (frontier if op_name(user) in _THROUGH else readers).append(user)
    if not readers:
        return None
    first = min(readers, key=position.__getitem__)
    return first if op_name(first) in EXTERN_GEMMS else None


def _erase_unused(node: Node) -> None:
    """``node`` and the chain of single-input ops under it that nothing reads any more: the casts and
    ``abs`` a check took of the value it now reads from a copy."""
    while not node.users and node.op == "call_function" and len(node.all_input_nodes) == 1:
        source = node.all_input_nodes[0]
        node.graph.erase_node(node)
        node = source


def _written_by_gemm(value: Node) -> bool:
    """Whether ``value`` is a GEMM's output, through views."""
    while value.op == "call_function" and op_name(value) in _VIEWS and isinstance(value.args[0], Node):
        value = value.args[0]
    return value.op == "call_function" and op_name(value) in EXTERN_GEMMS


def _copy_of(value: Node) -> Node | None:
    """The first ``clone`` of ``value`` that holds every element of it once (through rearrangements
    of as many elements: no broadcast, no slice), dense in memory; None if none."""
    numel = value.meta["val"].numel()
    frontier = [value]
    while frontier:
        for user in frontier.pop(0).users:
            val = user.meta.get("val")
            if (user.op != "call_function" or op_name(user) not in REARRANGING or len(user.all_input_nodes) != 1
                    or not isinstance(val, torch.Tensor) or val.numel() != numel):
                continue
            if op_name(user) == "clone":
                return user if is_dense(val) else None
            frontier.append(user)
    return None


def _inductor_lays_out_channels_last(gm: GraphModule) -> bool:
    """Whether Inductor will lay this graph's convolutions out channels-last: its own decision
    (``GraphLowering.decide_layout_opt``), on the joint graph. The forward graph it decides for
    holds the same convolutions; its one rule on the graph's size (no channels-last for fewer than
    one convolution in 300 nodes) reads fewer nodes there, so a joint graph near that bound is
    taken as NCHW where Inductor may not: its partial results are then read as before. So is a
    graph the function cannot read (another torch's signature, a node without its fake value), with
    a warning: the layout only decides how fast the partial results are read, never what they are.
    (``tests/passes/test_lay_out_partials.py`` checks the decision on the installed torch.)"""
    from torch._inductor.graph import GraphLowering  # (Inductor: only when compiling)

    try:
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))
    except (AttributeError, KeyError, TypeError) as e:
        warnings.warn(f"autoscale: Inductor's GraphLowering.decide_layout_opt failed on torch "
                      f"{torch.__version__} ({type(e).__name__}: {e}); the partial results of "
                      "Config(form='fewer_launches') are read in the traced order, which computes the same "
                      "and may launch more kernels", stacklevel=2)
        return False

