"""The seeds of the analysis: what the real example tensors say before it runs.

``seed_inputs(gm, example_inputs)`` records the moments of real example tensors on the
placeholders (the backend does it; the pass itself sees only fake tensors). ``calibrate(gm,
example_inputs)`` goes further: it runs the graph once in float32 on copies of the inputs
(``reference_step``) and records every node's measured value and gradient moments, which the pass
then uses instead of its predictions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree
from torch.fx import GraphModule, Node

from ..graph_utils import cast_of, source_name
from .constants import CONCRETE_KEY, CONCRETE_LIMIT
from .losses import loss_outputs, output_gradient_of_shape
from .moments import Moments

__all__ = ["CALIBRATION_KEY", "SEED_KEY", "TRAINABLE_KEY", "calibrate", "reference_step", "seed_inputs"]

SEED_KEY, CALIBRATION_KEY = "autoscale_seed", "autoscale_calibration"
TRAINABLE_KEY = "autoscale_trainable"  # a placeholder that is a trainable parameter


def seed_inputs(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Record the moments of the real example tensors on ``gm``'s placeholders, and which are
    trainable parameters (``TRAINABLE_KEY``: their size is floored in the backward,
    ``analyze_underflow._updated``).

    A small module buffer that takes no gradient (a rotary embedding's ``inv_freq``) is recorded
    itself (``CONCRETE_KEY``, a reference, not a copy): what the graph computes from it and from
    constants alone (cos and sin tables, masks) is then computed exactly at compile time."""
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs, strict=False):
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point and not value.is_meta:
            node.meta[SEED_KEY] = Moments.of(value)
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                node.meta[TRAINABLE_KEY] = True
            elif (not value.requires_grad and value.numel() <= CONCRETE_LIMIT and not _is_fake(value)
                  and "._buffers[" in source_name(node)):
                node.meta[CONCRETE_KEY] = value


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def calibrate(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Measure one float32 step of ``gm`` and record each node's value and gradient moments.

    The step is ``reference_step``'s: on copies of the inputs, so it changes nothing the caller
    owns (batch-norm statistics and other in-place updates land in the copies), with the
    gradients the analysis assumes arrive at the outputs (``output_gradient``; a tensor's as
    Gaussian noise).
    """
    for n, t in reference_step(gm, example_inputs).items():
        n.meta[CALIBRATION_KEY] = {"value": Moments.of(t), "grad": Moments.of(t.grad) if t.grad is not None else None}


def reference_step(gm: GraphModule, example_inputs: Sequence[Any],
                   output_grads: Sequence[torch.Tensor | None] | None = None) -> dict[Node, torch.Tensor]:
    """One float32 forward and backward of ``gm`` on copies of ``example_inputs``: every floating
    node's value, with ``.grad`` filled where a gradient reached it (None where none did).

    What the analysis predicts, measured: the inputs are copied (the step changes nothing the
    caller owns); a cast into a narrower floating dtype (``convert_precision``'s, or the model's
    own ``.half()``) is skipped, because the analysis' moments are of the values as float32
    computes them; and a node whose op returns its input itself (``contiguous`` of a contiguous
    tensor, ``.float()`` of a float32 one) gets a view of it, so that each node's ``.grad`` is the
    gradient of that node alone, as the analysis has it, not the sum over every node sharing the
    tensor. ``output_grads`` (one per tensor leaf of the graph's output, None for an output that
    gets no gradient) are the gradients arriving at the outputs; by default, what the analysis
    assumes (``_output_gradients``: a tensor's as Gaussian noise of the assumed spread).
    """
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
              for x in example_inputs]
    values: dict[Node, torch.Tensor] = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n: Node) -> Any:
            cast = cast_of(n)
            if cast is not None and cast[1].is_floating_point and cast[1].itemsize < 4:
                source = self.env[cast[0]]
                result = source.view_as(source) if _floating(source) else super().run_node(n)
            else:
                result = super().run_node(n)
                if n.op != "placeholder" and _floating(result) and any(
                        result is self.env.get(a) for a in n.all_input_nodes):
                    result = result.view_as(result)
            if _floating(result):
                if result.requires_grad and not result.is_leaf:
                    result.retain_grad()
                values[n] = result
            return result

    with torch.enable_grad():
        leaves = torch.utils._pytree.tree_leaves(_Record(gm).run(*inputs))
        outputs = [o if isinstance(o, torch.Tensor) else None for o in leaves]
        if output_grads is None:
            output_grads = _output_gradients(gm, outputs)
        if len(output_grads) != len(outputs):
            raise ValueError(f"{len(output_grads)} output gradients for {len(outputs)} graph outputs")
        pairs = [(o, g) for o, g in zip(outputs, output_grads, strict=True)
                 if o is not None and g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
    return values


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point


def _output_gradients(gm: GraphModule, outputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The gradients the analysis assumes arrive at the graph's outputs (``loss_outputs``,
    ``output_gradient``), as tensors: 1 for a scalar, Gaussian noise of the assumed spread for any
    other tensor, none for an output that is assumed to get none."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    nodes = torch.utils._pytree.tree_leaves(output.args[0])
    receiving = set(loss_outputs(gm))
    grads: list[torch.Tensor | None] = []
    for node, out in zip(nodes, outputs, strict=True):
        if out is None or not out.requires_grad or not out.dtype.is_floating_point or node not in receiving:
            grads.append(None)
        elif out.dim() == 0:
            grads.append(torch.ones_like(out))
        else:
            expected = output_gradient_of_shape(tuple(float(s) for s in out.shape))
            grads.append(torch.randn_like(out) * math.sqrt(expected.ms))
    return grads
