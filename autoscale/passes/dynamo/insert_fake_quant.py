"""Quantize each GEMM's inputs and the gradient at its output: fake quantization (cyclic precision
training, ``Config.quant``) and simulated float8 (``Config.float8``).

For every allow-list op (GEMMs, convolutions, attention) computing in low precision:

* each input of two or more dimensions is quantized in the forward, straight-through in the
  backward: a weight (an input that reaches a gradient-requiring graph input through casts and
  unscale points) per output channel, an activation per tensor from a running range kept in the
  ``FakeQuant`` state (``autoscale.quant``); with float8, it is then rounded to E4M3 with its
  current per-tensor scale. Biases (vectors) are left alone, as in CPT and float8 recipes;
* the gradient arriving at its output is quantized at ``QuantConfig.grad_bits`` with stochastic
  rounding, or rounded to float8 E5M2.

The pass runs after ``insert_grad_scaling``, and puts the gradient quantizers between the op and
its readers, the layer's scale point among them: the backward then scales the gradient *before*
rounding it to the low format, which is what the scale is for. The forward quantizers go between
the op's inputs (already cast to low precision) and the op, so ``emulate_compute`` still sees an
op whose inputs are all low precision.

The forward bit-width and the activations' running ranges are runtime tensors registered on the
model by ``autoscale.FakeQuant`` (found through its ``autoscale::attach_quant`` marker, which the
pass removes): a schedule changes the bits every step without recompiling.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Graph, GraphModule, Node

from autoscale import quant

from ..graph_utils import (
    cast_of,
    float_dtype,
    layer_of,
    new_node,
    op_name,
    provenance,
    redirect_uses,
    requires_grad_map,
    tensor_val,
)
from ..manager import PassResult
from ..op_tables import Category, category_of

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["insert_fake_quant"]

PASS = "insert_fake_quant"
log = logging.getLogger("autoscale.passes")


def insert_fake_quant(gm: GraphModule, cfg: Config) -> PassResult:
    """Insert the quantizers (see the module docstring)."""
    graph = gm.graph
    attach = next((n for n in graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.autoscale.attach_quant, torch.ops.autoscale.attach_quant.default)), None)
    state: _State | None = None
    if attach is not None:
        if cfg.quant is not None:
            state = _State(*attach.args)
        else:
            log.warning("the model has an autoscale.FakeQuant but Config.quant is None: nothing is quantized; "
                        "compile with Config(quant=autoscale.QuantConfig())")
        graph.erase_node(attach)
    elif cfg.quant is not None:
        log.warning("Config.quant is set but the model has no autoscale.FakeQuant (create it before the first "
                    "forward): nothing is quantized in this graph")
    if state is None and not cfg.float8:
        return PassResult(gm, modified=attach is not None, counts={})
    assert cfg.quant is not None or state is None
    counts: Counter[str] = Counter()
    requires = requires_grad_map(graph)
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method") or float_dtype(node) != cfg.dtype:
            continue
        if category_of(op_name(node) or "", cfg.op_overrides) is not Category.ALLOW:
            continue
        slot = 0
        for a in dict.fromkeys(node.all_input_nodes):
            val = tensor_val(a)
            if float_dtype(a) is None or not isinstance(val, torch.Tensor) or val.dim() < 2:
                continue
            new = a
            source = _source(a)
            weight = source.op == "placeholder" and requires.get(source, False)
            if state is not None and cfg.quant is not None:
                if weight and cfg.quant.weights:
                    new = _insert(graph, node, quant.fake_quant_weight, (new, state.bits), new,
                                  "quantize the weight per output channel", counts, "weights")
                elif not weight and cfg.quant.activations:
                    row = state.row(node, slot)
                    slot += 1
                    new = _insert(graph, node, quant.fake_quant_activation,
                                  (new, state.ranges, row, state.bits, float(cfg.quant.momentum), state.training),
                                  new, f"quantize the activation (running range, row {row})", counts, "activations")
            if cfg.float8:
                new = _insert(graph, node, quant.float8_forward, (new,), new, "round to float8 E4M3 (current scaling)",
                              counts, "float8_inputs")
            if new is not a:
                node.replace_input_with(a, new)
        if not requires.get(node, False):
            continue
        if cfg.quant is not None and state is not None and cfg.quant.grad_bits is not None:
            _wrap_output(graph, node, quant.quant_grad, (cfg.quant.grad_bits,),
                         f"quantize the arriving gradient to {cfg.quant.grad_bits} bits (stochastic rounding)", counts,
                         "gradients")
        if cfg.float8:
            _wrap_output(graph, node, quant.float8_grad, (), "round the arriving (scaled) gradient to float8 E5M2",
                         counts, "float8_gradients")
    return PassResult(gm, modified=True, counts=dict(counts))


class _State:
    """The ``FakeQuant`` state nodes in this graph, and the rows of its ranges buffer."""

    def __init__(self, bits: Node, ranges: Node, layout: str, training: bool) -> None:
        self.bits, self.ranges, self.training = bits, ranges, bool(training)
        self.rows = quant.rows(str(layout))
        self.used: Counter[int] = Counter()

    def row(self, node: Node, slot: int) -> int:
        """The range row of the ``slot``-th activation quantizer of ``node``'s module (modules
        have ``quant.SLOTS`` rows; later quantizers of one module share the last)."""
        path = layer_of(node)
        while path not in self.rows and path:
            path = path.rpartition(".")[0]
        base = self.rows.get(path, 0)
        index = base + min(self.used[base], quant.SLOTS - 1)
        self.used[base] += 1
        return index


def _source(n: Node) -> Node:
    """What ``n`` is a cast or an unscale point of, followed back to its origin."""
    while True:
        cast = cast_of(n)
        if cast is not None:
            n = cast[0]
        elif op_name(n) == "rescale" and isinstance(n.args[0], Node):
            n = n.args[0]
        else:
            return n


def _insert(graph: Graph, before: Node, fn: Any, args: tuple[Any, ...], like: Node, reason: str,
            counts: Counter[str], key: str) -> Node:
    with graph.inserting_before(before):
        q = new_node(graph, "call_function", fn, args)
    _annotate(q, like, before, reason)
    counts[key] += 1
    return q


def _wrap_output(graph: Graph, node: Node, fn: Any, extra: tuple[Any, ...], reason: str, counts: Counter[str],
                 key: str) -> None:
    with graph.inserting_after(node):
        q = new_node(graph, "call_function", fn, (node, *extra))
    _annotate(q, node, node, reason)
    redirect_uses(node, q)
    counts[key] += 1


def _annotate(q: Node, value_of: Node, layer_of_node: Node, reason: str) -> None:
    q.meta["val"] = tensor_val(value_of)
    for key in ("nn_module_stack", "stack_trace"):
        if key in layer_of_node.meta:
            q.meta[key] = layer_of_node.meta[key]
    provenance(q, PASS, reason, created=True)
