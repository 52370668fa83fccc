"""Per-layer numbers of an analyzed Dynamo graph: what the underflow analysis predicts, and what one
float32 step measures, as the same quantities.

Why per layer: scales, reports and the graph diff speak of layers (module paths), while the
analysis (``autoscale/passes/analysis/analyze_underflow.py``) predicts per node. And why both sides: a prediction
nothing checks drifts. :func:`predict_layers` reads the analysis' moments off the nodes;
:func:`measure_layers` runs the graph once in float32 and computes the same numbers from the real
tensors, node for node, layer for layer. ``benchmarks/prediction.py`` compares the two on the test
models and the model zoo (docs/results/prediction.md).

The quantities (``LayerNumbers``), all at loss scale 1:

* the **underflow share** of a gradient: the entries that are nonzero in float32 and become 0 when
  cast to float16 (magnitude at most 2^-25, half the smallest subnormal: round to nearest even
  sends everything above it to 2^-24 or beyond), over **all** its entries, zeros in float32
  included (they are counted, and never flushed). The prediction is the analysis' Gaussian rate
  ``erf(2^-25 / (√2·σ))`` (``predicted_underflow``), which has no exact zeros, so both are shares of
  the same denominator. Where a layer has several such tensors (a weight and a bias), the share is
  of all their entries together: the rates weighted by element count.
* the **largest magnitude** of a gradient or of a forward value, to set against float16's 65504.

A layer's *weight* gradient is that of the parameters the layer's module owns (by Dynamo's source
of the parameter: a tied weight belongs to the module that holds it, ``parameter_path``). Its
*incoming* gradient is the one arriving at its outputs: the values its own nodes compute that a
node of another layer, or the graph's output, reads (a child module counts as another layer:
layers are ``layer_of``'s innermost module paths). Its *forward* values are every floating tensor
its own nodes compute (parameters and inputs are not computed: they are not counted), less their
mask fills: entries that are infinite or of magnitude at least 2^100 (``MASK_MAGNITUDE``: -inf,
float32's finfo.min in an attention mask), which float16 turns into -inf as intended and softmax
into exact zeros. They are no overflow, and the analysis keeps them apart from a value's moments.

Predictions are None where the analysis did not know (a node of the layer without moments), never
a stand-in value: a None is the honest answer, and a number would be compared as if it were one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autoscale.passes.analysis.analyze_underflow import MOMENTS_KEY
from autoscale.passes.analysis.constants import MASK_MAGNITUDE
from autoscale.passes.analysis.moments import Moments, predicted_underflow
from autoscale.passes.analysis.nodes import element_count
from autoscale.passes.analysis.seeding import reference_step
from autoscale.passes.graph_utils import layer_of, parameter_path, requires_grad_map, tensor_val

__all__ = ["LayerNumbers", "LayerParts", "flushed_share", "layer_parts", "measure_layers", "predict_layers"]


@dataclass(frozen=True)
class LayerNumbers:
    """One layer's numbers (see the module docstring for the definitions); None: the layer has
    no such tensor (no parameters, no gradient), or the prediction does not know it."""

    layer: str
    """The module path (``transformer.h.0.attn.c_attn``); "" is the model's top level."""
    weight_underflow: float | None
    """The share of the layer's weight-gradient entries (all its parameters' together) that
    float16 flushes to zero at scale 1."""
    weight_grad_max: float | None
    """The largest |weight gradient|."""
    grad_underflow: float | None
    """The same share for the gradient arriving at the layer's outputs."""
    grad_max: float | None
    """The largest |gradient| arriving at the layer's outputs."""
    forward_max: float | None
    """The largest |x| of any floating value the layer computes in the forward (against 65504)."""


@dataclass(frozen=True)
class LayerParts:
    """Which nodes of a graph make up one layer's numbers (``layer_parts``)."""

    weights: tuple[Node, ...]
    outputs: tuple[Node, ...]
    values: tuple[Node, ...]


def layer_parts(gm: GraphModule) -> dict[str, LayerParts]:
    """Per layer, its parameters that take a gradient, its outputs that carry one, and the
    floating tensors it computes. One function for both sides, so that a prediction and a
    measurement are always of the same nodes."""
    requires = requires_grad_map(gm.graph)
    weights: dict[str, list[Node]] = {}
    outputs: dict[str, list[Node]] = {}
    values: dict[str, list[Node]] = {}
    for n in gm.graph.nodes:
        val = tensor_val(n)
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point or element_count(n) == 0:
            continue  # (an empty tensor, an empty KV cache, has no entry to count)
        if n.op == "placeholder":
            path = parameter_path(n)
            if path is not None and requires[n]:
                weights.setdefault(path.rpartition(".")[0], []).append(n)
            continue
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        layer = layer_of(n)
        values.setdefault(layer, []).append(n)
        if requires[n] and any(u.op == "output" or layer_of(u) != layer for u in n.users):
            outputs.setdefault(layer, []).append(n)
    return {layer: LayerParts(tuple(weights.get(layer, ())), tuple(outputs.get(layer, ())),
                              tuple(values.get(layer, ())))
            for layer in sorted({*weights, *outputs, *values})}


# A gradient's numbers: (entries, underflow share, max |g|); None: not known.
_Grad = tuple[float, float, float] | None


def _combine(parts: list[_Grad]) -> tuple[float | None, float | None]:
    """(share, max) of several gradients taken together; None and None when any is unknown or
    there are none."""
    if not parts or any(p is None for p in parts):
        return None, None
    known = [p for p in parts if p is not None]
    entries = sum(p[0] for p in known)
    share = sum(p[0] * p[1] for p in known) / entries if entries > 0 else 0.0
    return share, max(p[2] for p in known)


def _numbers(gm: GraphModule, grad_of: Callable[[Node], _Grad], value_max: Callable[[Node], float | None]
             ) -> dict[str, LayerNumbers]:
    numbers = {}
    for layer, parts in layer_parts(gm).items():
        weight_share, weight_max = _combine([grad_of(n) for n in parts.weights])
        share, grad_max = _combine([grad_of(n) for n in parts.outputs])
        maxima = [value_max(n) for n in parts.values]
        forward = None if not maxima or any(m is None for m in maxima) else max(m for m in maxima if m is not None)
        numbers[layer] = LayerNumbers(layer, weight_share, weight_max, share, grad_max, forward)
    return numbers


def predict_layers(gm: GraphModule) -> dict[str, LayerNumbers]:
    """Each layer's numbers as ``analyze_underflow`` predicted them, read off the moments it left on
    ``gm``'s nodes (``autoscale_moments``): run the analysis first. A number is None where any node
    it depends on has no prediction."""
    def moments(n: Node, key: str) -> Moments | None:
        m: Moments | None = n.meta.get(MOMENTS_KEY, {}).get(key)
        return m

    def grad_of(n: Node) -> _Grad:
        g = moments(n, "grad")
        if g is None:  # no gradient reaches the node (all zeros: nothing to flush), or unknown
            reached = n.meta.get(MOMENTS_KEY, {}).get("reached", True)
            return None if reached else (element_count(n), 0.0, 0.0)
        return element_count(n), predicted_underflow(g), g.amax

    def value_max(n: Node) -> float | None:
        v = moments(n, "value")
        return None if v is None else v.amax

    return _numbers(gm, grad_of, value_max)


def flushed_share(t: torch.Tensor) -> float:
    """The share of ``t``'s entries that are nonzero and become 0 when cast to float16, over all its
    entries (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0.0
    flushed = (t != 0) & (t.to(torch.float16) == 0)
    return float(flushed.sum()) / t.numel()


def measure_layers(gm: GraphModule, example_inputs: Sequence[Any],
                   output_grads: Sequence[torch.Tensor | None] | None = None) -> dict[str, LayerNumbers]:
    """Each layer's numbers measured on one float32 forward and backward of ``gm`` on copies of
    ``example_inputs`` (``analysis.seeding.reference_step``: the casts into float16 the precision
    pass inserted are skipped, so the graph as captured and as analyzed give the same gradients).
    Pass the graph as captured or as ``analyze_underflow`` left it: the rescale points
    ``insert_grad_scaling`` places afterwards would scale the gradients measured.

    ``output_grads`` are the gradients arriving at the graph's outputs, one per tensor leaf of its
    output (None: no gradient): pass the real ones (from the training step the graph is part of)
    to check the analysis' assumption about them as well. By default, what the analysis assumes:
    1 for a scalar (the loss), the gradient of a mean cross-entropy over the last dimension for a
    tensor (drawn at random). A node no gradient reaches has an all-zero gradient: share 0, max 0.
    """
    measured = reference_step(gm, example_inputs, output_grads)

    def grad_of(n: Node) -> _Grad:
        t = measured.get(n)
        if t is None:
            return None
        g = t.grad
        if g is None:
            return float(t.numel()), 0.0, 0.0
        return float(g.numel()), flushed_share(g), _amax(g)

    def value_max(n: Node) -> float | None:
        t = measured.get(n)
        if t is None:
            return None
        t = t.detach()
        return _amax(t[t.isfinite() & (t.abs() < MASK_MAGNITUDE)])

    return _numbers(gm, grad_of, value_max)


def _amax(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0
