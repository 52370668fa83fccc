"""Predict which forward values float16 cannot hold, before the precision pass paints the graph.

Loss scaling moves gradients only. A forward value above 65504 (a T5 v1.1 gated-GELU feed-forward,
a residual stream that grew, attention logits) becomes inf in float16 and the loss goes NaN, every
step (docs/design.md#forward-overflow). This analysis propagates the magnitudes of every value from the real example
inputs and parameters (``analyze_underflow.forward_moments``: the same rules the gradient analysis
uses) and marks, in ``node.meta[FORWARD_KEY]`` with the reason:

* every op whose predicted max |x| exceeds ``Config.overflow.threshold`` x 65504 (with
  ``Config.overflow.predict``);
* every op the ``GradScaler`` promoted at run time after it overflowed (``attach``'s ``promoted``
  keys: Dynamo guards on them, so a new promotion recompiles the graph and lands here).

``convert_precision`` keeps the marked ops in float32, and whatever would read their values in
float16. Every node also gets its stable key (``graph_utils.node_keys``) in ``node.meta[KEY]``, by
which run-time flags and promotions name it. Only float16 has this problem: bfloat16 has
float32's range, and nothing is marked for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule

from autoscale.overflow import OVERFLOW_REASON
from autoscale.protocol import FP16_MAX, PROMOTED_SEP

from ..analysis.analyze_underflow import forward_moments
from ..analysis.moments import clear_caches
from ..graph_utils import KEY, attach_of, node_keys, tensor_val
from ..manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["FORWARD_KEY", "PEAKS_INPUT_KEY", "PROMOTED_REASON", "predict_overflow"]

FORWARD_KEY = "autoscale_forward_overflow"
# gm.meta: the index of the placeholder of the scaler's peaks buffer, for ``insert_overflow_checks``
# (which runs last, after ``insert_grad_scaling`` has removed the ``attach`` marker that names it);
# absent for a step that measures nothing, which watches nothing
PEAKS_INPUT_KEY = "autoscale_peaks_input"
PROMOTED_REASON = f"{OVERFLOW_REASON} seen at run time: promoted by GradScaler"


def predict_overflow(gm: GraphModule, cfg: Config) -> PassResult:
    """Key every node and mark the values float16 cannot hold (see the module docstring)."""
    graph = gm.graph
    found = attach_of(graph)
    prefix = found[2] if found else ""
    promoted = set(found[1].promoted.split(PROMOTED_SEP)) - {""} if found else set()
    keys = node_keys(graph, prefix)
    for n, key in keys.items():
        n.meta[KEY] = key
    if found is not None and found[1].measuring:  # (``ScalingConfig.measure_every``)
        gm.meta[PEAKS_INPUT_KEY] = list(graph.find_nodes(op="placeholder")).index(found[1].peaks)
    if cfg.dtype != torch.float16:
        return PassResult(gm, modified=False, counts={"predicted": 0, "promoted": 0})
    limit = cfg.overflow.threshold * FP16_MAX
    values = forward_moments(gm) if cfg.overflow.predict else {}
    clear_caches()
    predicted = learnt = 0
    for n, key in keys.items():
        val = tensor_val(n)
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue
        moments = values.get(n)
        if key in promoted:
            n.meta[FORWARD_KEY] = PROMOTED_REASON
            learnt += 1
        elif moments is not None and moments.amax > limit:
            n.meta[FORWARD_KEY] = (f"{OVERFLOW_REASON} predicted: max |x| {moments.amax:.3g} > "
                                   f"{cfg.overflow.threshold:g} x float16's 65504")
            predicted += 1
    return PassResult(gm, modified=False, counts={"predicted": predicted, "promoted": learnt})
