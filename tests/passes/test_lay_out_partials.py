"""lay_out_partials: a GPU's partial results of a value are read in the order Inductor lays the value
out, channels-last where its heuristics lay the graph's convolutions out so, with the same maximum.

Traced graphs of a convolution whose output a check reduces in the form laid out for a GPU
(``fewer_launches``); the launches this saves are counted in tests/benchmarks/test_kernel_counts.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

import autoscale
from autoscale.measure import largest, whole
from autoscale.ops import partials
from autoscale.passes import PassSpec, lay_out_partials, run_stage
from autoscale.protocol import FORMS

CLONE = torch.ops.aten.clone.default
GPU = FORMS["fewer_launches"]


def _traced(channels: int) -> tuple[GraphModule, tuple[torch.Tensor, ...]]:
    """A convolution and the partial maxima of its output's magnitudes, traced in that form."""
    inputs = torch.randn(4, 8, 16, 16), torch.randn(channels, 8, 3, 3)

    def check(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return largest(F.conv2d(x, w, padding=1).abs(), GPU)

    gm = make_fx(check, tracing_mode="fake")(*inputs)
    assert len(gm.graph.find_nodes(op="call_function", target=partials)) == 1
    return gm, inputs


def _lay_out(gm: GraphModule, config: autoscale.Config) -> dict[str, int]:
    (result,) = run_stage(gm, config, "joint", [PassSpec(lay_out_partials, "joint")])
    return dict(result.counts)


@pytest.mark.parametrize(("channels", "onednn", "executor", "across"), [
    (128, False, "inductor", True),  # a GPU's rule: wide convolutions, channels-last
    (32, False, "inductor", False),  # a GPU's rule: at most 64 channels, NCHW
    (32, True, "inductor", True),  # a CPU's rule with oneDNN: every convolution channels-last
    (128, False, "eager", False),  # no Inductor: the traced layout
])
def test_partials_follow_inductors_layout(channels: int, onednn: bool, executor: str, across: bool) -> None:
    gm, inputs = _traced(channels)
    with torch.backends.mkldnn.flags(enabled=onednn):
        counts = _lay_out(gm, autoscale.Config(executor=executor, verify=True))  # type: ignore[arg-type]
    assert counts == {"partials": 1, "channels_last": int(across), "copies": 0}
    assert not gm.graph.find_nodes(op="call_function", target=partials)
    clones = gm.graph.find_nodes(op="call_function", target=CLONE)
    assert [c.kwargs.get("memory_format") for c in clones] == ([torch.channels_last] if across else [])
    # (the same maximum, from other parts)
    out = gm(*inputs)
    conv = F.conv2d(*inputs, padding=1).abs()
    assert 1 < len(out) <= GPU.parts and whole(out, "max").equal(conv.max())
    expected = conv.permute(0, 2, 3, 1) if across else conv
    assert out.equal(expected.reshape(len(out), -1).amax(1))


def test_partials_op_takes_the_elements_in_memory_order() -> None:
    """Run as an op (a graph the pass did not see), ``partials`` copies in the value's own order."""
    x = torch.randn(2, 3, 4, 4)
    last = x.contiguous(memory_format=torch.channels_last)
    assert partials(x, 4).equal(x.reshape(4, -1))
    assert partials(last, 4).equal(x.permute(0, 2, 3, 1).reshape(4, -1))
    with FakeTensorMode() as fake_mode:
        assert partials(fake_mode.from_tensor(x), 4).shape == (4, 24)


@pytest.mark.parametrize(("permutation", "copies"), [
    ((0, 2, 1, 3), 1),  # heads split off a GEMM's output, copied for the next GEMM: read from the copy
    ((0, 1, 2, 3), 0),  # no copy (the GEMM reads a view): the value itself
])
def test_a_gemms_output_is_read_from_the_copy_inductor_writes(permutation: tuple[int, ...], copies: int) -> None:
    """Checked, a GEMM's output whose next GEMM reads a copy of it is read from that copy, after that
    GEMM (so that Inductor has written the copy), with the same maximum: the copy holds every
    element once."""
    inputs = torch.randn(128, 64), torch.randn(64, 64)

    def attention_scores(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = (x @ w).view(8, 16, 4, 16)
        peak = largest(q.abs(), GPU)  # (traced before the next GEMM, as a check is)
        heads = q.permute(*permutation)
        if copies:
            heads = heads.contiguous()
        return heads @ heads.transpose(-1, -2), peak

    gm = make_fx(attention_scores, tracing_mode="fake")(*inputs)
    counts = _lay_out(gm, autoscale.Config(verify=True))
    assert counts == {"partials": 1, "channels_last": 0, "copies": copies}
    (amax,) = [n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.amax.default)]
    bmm = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.bmm.default)[0]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert (order[amax] > order[bmm]) == bool(copies)
    scores, peaks = gm(*inputs)
    assert whole(peaks, "max").equal((inputs[0] @ inputs[1]).abs().max())
