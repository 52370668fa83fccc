"""Predict, before anything runs, the magnitude of every value and gradient in the graph.

Each floating-point node gets ``Moments`` (mean, mean square, max |x|) for its value, from the
real inputs and parameters, propagated forward with per-op rules; then ``Moments`` for its
gradient, propagated backward from the outputs the loss is taken from (``loss_outputs``: a scalar
output — the loss — gets gradient 1; without one, a tensor output the graph does not read itself
is assumed to feed a mean-reduced cross-entropy over its last dimension). From the
gradient's spread σ the predicted float16 underflow rate is ``erf(2⁻²⁵ / (√2·σ))`` (zero-mean
Gaussian model; 2⁻²⁵ is the largest magnitude float16 rounds to zero), and the overflow risk is
whether the predicted max exceeds 65504 / 2^margin.

The rules, and what they share, are in ``autoscale/passes/analysis/`` (its ``__init__`` says how
to add an op); this module runs them over the graph. Rules are a registry keyed by op name; an op
without a rule makes its value (or gradient) unknown, never a crash. What the graph builds from
constants, shapes and small buffers alone (causal masks, position indices and buckets, rotary
tables) is computed exactly at compile time (``analysis.constants``); where a value holds mask
fills (-inf, finfo.min) is tracked beside its moments, which are of its other entries, so that a
softmax or an attention knows each row's live keys. Reduction lengths are sympy expressions
(symbolic under dynamic shapes), evaluated with the shape environment's hints. Results go to
``node.meta``:
``autoscale_moments`` = {"value": Moments | None, "grad": Moments | None, "reached": bool} (a
gradient is None where unknown, and where none arrives: "reached" tells them apart), and, where the
gradient is known, ``autoscale_underflow`` (rate) and ``autoscale_overflow`` (bool).
Predictions assume float16, the dtype gradient scaling exists for.

Seeds (``analysis.seeding``): ``seed_inputs`` records the moments of the real example tensors on
the placeholders (the backend does it; the pass itself sees only fake tensors); ``calibrate``
records every node's moments measured in one float32 step, which the pass then uses instead of its
predictions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.fx import GraphModule, Node

from autoscale.protocol import gradient_max, headroom

from ..graph_utils import tensor_val
from ..manager import PassResult
from .attention import ATTENTION_KEY
from .constants import CONCRETE_KEY, MASK_KEY, folded, live_moments, mask_pattern
from .losses import loss_outputs, output_gradient
from .moments import Moments, average_of, clear_caches, predicted_underflow, sum_of
from .nodes import numel, passes_through
from .registry import backward_rule, forward_rule, unknown_gradients
from .seeding import CALIBRATION_KEY, SEED_KEY, TRAINABLE_KEY

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["MOMENTS_KEY", "UPDATE_SIZE", "VALUE_KEY", "analyze_underflow", "forward_moments"]

PASS = "analyze_underflow"
MOMENTS_KEY = "autoscale_moments"
VALUE_KEY = "autoscale_value"
# The per-pipeline caches, dropped at the end of the pass: the forward's moments (``VALUE_KEY``),
# the values computed at compile time and the mask patterns (``analysis.constants``), and the
# softmax and attention row statistics (``analysis.attention``).
_CACHE_KEYS = (VALUE_KEY, CONCRETE_KEY, MASK_KEY, ATTENTION_KEY)
# The size one optimizer step gives a parameter (Adam's default learning rate, 1e-3).
UPDATE_SIZE = 1e-3


def analyze_underflow(gm: GraphModule, cfg: Config) -> PassResult:
    """Annotate every node with predicted value and gradient moments (see the module docstring)."""
    try:
        return _analyze(gm, cfg)
    finally:
        clear_caches()
        for n in gm.graph.nodes:  # (the cache serves one pipeline run: a later one may see other inputs)
            for key in _CACHE_KEYS:
                n.meta.pop(key, None)


def forward_moments(gm: GraphModule) -> dict[Node, Moments | None]:
    """The predicted (or calibrated) moments of every node's value, propagated from the inputs.

    Cached on the nodes (``VALUE_KEY``): ``predict_overflow`` computes them before the precision
    pass and this pass reuses them, computing only the nodes added in between (casts, which keep
    their source's moments). The moments are of the values as float32 computes them: a cast
    changes none."""
    value: dict[Node, Moments | None] = {}
    for n in gm.graph.nodes:
        if VALUE_KEY in n.meta:
            value[n] = n.meta[VALUE_KEY]
            continue
        concrete = n.meta.get(CONCRETE_KEY) if n.op == "placeholder" else folded(n)
        if concrete is not None:
            n.meta[CONCRETE_KEY] = concrete
        pattern = mask_pattern(n)
        if pattern is not None:
            n.meta[MASK_KEY] = pattern
        if _empty(n):
            value[n] = None
        elif measured := n.meta.get(CALIBRATION_KEY, {}).get("value"):
            value[n] = measured
        elif isinstance(concrete, torch.Tensor):
            value[n] = live_moments(concrete)
        else:
            value[n] = n.meta.get(SEED_KEY) if n.op == "placeholder" else _unless_empty(_forward, n, value)
        n.meta[VALUE_KEY] = value[n]
    return value


def _analyze(gm: GraphModule, cfg: Config) -> PassResult:
    nodes = list(gm.graph.nodes)
    value = forward_moments(gm)
    grad: dict[Node, list[Moments | None]] = {}
    for arg in loss_outputs(gm):
        grad.setdefault(arg, []).append(None if _empty(arg) else output_gradient(arg, value))
    known = 0
    limit = headroom(cfg.scaling.margin, gradient_max(cfg.float8))
    updated = _updated(gm, value)
    unknown: set[Node] = set()  # nodes a gradient reaches through an unknown one
    for n in reversed(nodes):
        parts = grad.get(n, [])
        # a tuple's elements are disjoint pieces (unbind, chunk): their gradients do not add up
        g = average_of(parts) if isinstance(tensor_val(n), tuple | list) else sum_of(parts)
        g = None if _empty(n) else n.meta.get(CALIBRATION_KEY, {}).get("grad") or g
        # "reached": whether any gradient arrives at all (a None gradient is then unknown; without one,
        # nothing flows back to the node: a returned by-product, a value the loss does not read)
        reached = bool(parts) or n in unknown
        n.meta[MOMENTS_KEY] = {"value": value.get(n), "grad": g, "reached": reached}
        if g is None:
            if reached and n.op in ("call_function", "call_method"):
                unknown.update(n.all_input_nodes)
            continue
        known += 1
        n.meta["autoscale_underflow"] = predicted_underflow(g)
        n.meta["autoscale_overflow"] = g.amax > limit
        if n.op in ("call_function", "call_method"):
            for arg, ga in (_unless_empty(_backward, n, g, updated) or {}).items():
                grad.setdefault(arg, []).append(ga)
    return PassResult(gm, modified=False, counts={"nodes": len(nodes), "gradients_known": known})


def _updated(gm: GraphModule, value: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """The moments the backward rules see: a trainable parameter smaller than ``UPDATE_SIZE`` (and
    its casts and views) at that size, everything else as predicted.

    ConvNeXt's and CaiT's layer scales start at 1e-6, a zero-initialized gate at 0: neither stays so
    after the first update, and the gradients they multiply grow with them. Predicted at 1e-6, the
    gradients behind a ConvNeXt layer scale got scales 2^34 high, and the first Adam step, which
    moved the layer scale to ~1e-3, made them overflow. The forward's values (what overflow
    prediction reads) keep the parameter's real size."""
    floored = dict(value)
    for n in gm.graph.nodes:
        source = n
        while source.op != "placeholder" and passes_through(source):
            if not source.args or not isinstance(source.args[0], Node):
                break
            source = source.args[0]
        m = value.get(n)
        if source.meta.get(TRAINABLE_KEY) and m is not None and m.ms < UPDATE_SIZE**2:
            floored[n] = Moments(m.mean, UPDATE_SIZE**2, max(m.amax, UPDATE_SIZE))
    return floored


def _forward(n: Node, value: dict[Node, Moments | None]) -> Moments | None:
    if n.op not in ("call_function", "call_method"):
        return None
    rule = forward_rule(n)
    return rule(n, value) if rule is not None else None


def _backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    rule = backward_rule(n)
    return rule(n, g, v) if rule is not None else unknown_gradients(n, v)  # (no rule: unknown)


def _empty(n: Node) -> bool:
    """Whether ``n`` is a tensor without elements (a batch of 0): there is nothing to predict."""
    return isinstance(tensor_val(n), torch.Tensor) and numel(n) == 0


_R = TypeVar("_R")


def _unless_empty(rule: Callable[..., _R], *args: Any) -> _R | None:
    """``rule(*args)``, or None (unknown) where a zero extent (an empty tensor among the rule's
    inputs: a sum over no elements, a concatenation with an empty piece) makes it divide by zero."""
    try:
        return rule(*args)
    except ZeroDivisionError:
        return None
