"""``remove_inplace``: in-place ops on private intermediates become out-of-place."""

from __future__ import annotations

import torch
from torch import nn

import autoscale
from autoscale.passes import PassSpec, remove_inplace, run_stage
from autoscale.passes.graph_utils import is_inplace, op_name
from tests.helpers import capture


def test_inplace_given_positionally_is_seen_and_removed() -> None:
    """``nn.ReLU6(inplace=True)`` traces to ``F.hardtanh(x, 0.0, 6.0, True)``: in place with no
    ``inplace=`` keyword. It is recognised as in-place, and made out-of-place on a private value."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU6(inplace=True), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    (gm, example), = capture(model, x)
    (clamp,) = [n for n in gm.graph.nodes if op_name(n) == "hardtanh"]
    assert is_inplace(clamp) and clamp.args[1:] == (0.0, 6.0, True)
    (record,) = run_stage(gm, autoscale.Config(verify=True), "dynamo", [PassSpec(remove_inplace, "dynamo")])
    assert record.counts == {"rewritten": 1}
    (clamp,) = [n for n in gm.graph.nodes if op_name(n) == "hardtanh"]
    assert not is_inplace(clamp) and clamp.args[1:] == (0.0, 6.0, False)
    (out,) = gm(*example)
    assert torch.equal(out, model(x))
