"""The loss the gradients start from: which graph outputs it is taken from (``loss_outputs``),
the gradient it sends them (``output_gradient``: 1 for a scalar loss; for a tensor, a mean-reduced
cross-entropy's over its last dimension), and the rules of ``cross_entropy``."""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from ..graph_utils import tensor_val
from .moments import Moments
from .nodes import passes_through, shape_of
from .registry import backward, forward

__all__ = ["loss_outputs", "output_gradient", "output_gradient_of_shape"]


def loss_outputs(gm: GraphModule) -> list[Node]:
    """The graph outputs a gradient is assumed to arrive at.

    A scalar floating output is the loss: when there is one, only such outputs get a gradient
    (a model that returns its loss returns its logits, caches and hidden states beside it, for
    inspection). Otherwise the loss is computed after the graph (by the user, or by the graph after
    a graph break), from the outputs the graph does not read itself: a value it also reads is a
    by-product returned for later use, such as a KV cache (GPT-2 returns its keys and values, and
    a cross-entropy's gradient assumed on them was 50 times the real gradient of its keys). When
    every output is also read inside, all of them."""
    outputs = [a for out in gm.graph.find_nodes(op="output") for a in out.all_input_nodes]
    floating = [o for o in outputs if isinstance(val := tensor_val(o), torch.Tensor) and val.dtype.is_floating_point]
    losses = [o for o in floating if tensor_val(o).dim() == 0 and _requires_grad(o)]
    if losses:
        return losses
    final = [o for o in floating if not _read_inside(o)]
    return final or floating


def _read_inside(out: Node) -> bool:
    """Whether the value ``out`` returns is also read inside the graph: by a node other than the
    casts and views leading from it to ``out`` (the precision pass casts a returned value back to
    float32 for the output alone)."""
    chain = {out}
    node = out
    while passes_through(node):
        if not node.args or not isinstance(node.args[0], Node):
            break
        node = node.args[0]
        chain.add(node)
    return any(u not in chain and u.op != "output" for n in chain for u in n.users)


def _requires_grad(n: Node) -> bool:
    val = tensor_val(n)
    return isinstance(val, torch.Tensor) and bool(n.meta.get("requires_grad", val.requires_grad))


def output_gradient(out: Node, value: dict[Node, Moments | None]) -> Moments | None:
    """The gradient arriving at a graph output: 1 for a scalar loss; for a tensor, the gradient of
    a mean-reduced cross-entropy over its last dimension, (softmax - onehot) / batch."""
    return output_gradient_of_shape(shape_of(out))


def output_gradient_of_shape(shape: tuple[float, ...]) -> Moments:
    if not shape:
        return Moments(1.0, 1.0, 1.0)
    classes, batch = shape[-1], math.prod(shape) / shape[-1]
    ms = (1.0 - 1.0 / classes) / classes / batch**2
    return Moments(0.0, ms, 1.0 / batch)


@forward("cross_entropy")
def _cross_entropy(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    classes = shape_of(n.args[0])[-1] if shape_of(n.args[0]) else 2.0
    return Moments(math.log(classes), math.log(classes) ** 2, math.log(classes))


@backward("cross_entropy")
def _cross_entropy_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    logits = n.args[0]
    if not isinstance(logits, Node):
        return {}
    grad = output_gradient(logits, v)
    assert grad is not None
    return {logits: grad.scaled(g.mean if g.mean else 1.0)}
