"""What Inductor makes of a scaled training step on CPU: one graph, and the scaling fused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_fw_bw_and_get_code

import autoscale
from tests.models import mlp_case


def test_scaled_training_step_has_no_graph_breaks_and_fuses_the_scaling() -> None:
    model, (x,), y = mlp_case()
    scaler = autoscale.GradScaler(model)
    backend = autoscale.backend(autoscale.Config(scaling=autoscale.ScalingConfig(placement="all")))
    compiled = torch.compile(model, backend=backend)
    counters.clear()
    _, (forward, backward) = run_fw_bw_and_get_code(lambda: scaler.scale(F.cross_entropy(compiled(x), y)))

    assert len(backend.records) == 1 and not counters["graph_break"]
    kernels = re.findall(r"(cpp_fused_\w+)\(", backward)
    # each rescale point's O(n) work — scale, cast, its one amax, zero count — shares a
    # kernel with the neighbouring backward op (GELU's and ReLU's backward here)
    assert any("amax" in k and "gelu_backward" in k for k in kernels), kernels
    assert any("amax" in k and "threshold_backward" in k for k in kernels), kernels
    # and the statistics are folded into the state inside a fused kernel, and the points' scales
    # computed in one, not by extern calls: no autoscale op is left
    assert not re.findall(r"torch\.ops\.autoscale\.([\w.]+)\(", backward)
    assert any("copy_" in k for k in kernels), kernels  # (the fold's write into ``stats``)
    assert "attach" not in forward  # the anchor op was removed by the pass


def _large_allocations(code: str) -> int:
    """Buffers of more than 64 elements the compiled graph's wrapper allocates."""
    shapes = re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", code)
    return sum(1 for shape in shapes if torch.Size(int(d) for d in shape.split(",") if d.strip()).numel() > 64)


def test_rescale_points_write_in_place() -> None:
    """The scaled backward allocates no more gradient-sized buffers than the same graph under
    torch.amp's GradScaler: each point writes its output over the gradient it read (on CPU, a
    fresh buffer cost more than the point's arithmetic; see ``autoscale.measure.scale_and_measure``)."""
    def backward_code(adaptive: bool) -> str:
        torch._dynamo.reset()
        model, (x,), y = mlp_case()
        scaler = autoscale.GradScaler(model) if adaptive else torch.amp.GradScaler("cpu")
        compiled = torch.compile(model, backend="autoscale")
        _, (_, backward) = run_fw_bw_and_get_code(lambda: scaler.scale(F.cross_entropy(compiled(x), y)))
        return backward

    scaled, plain = backward_code(adaptive=True), backward_code(adaptive=False)
    assert scaled.count("amax") > 0  # (the points are there)
    assert _large_allocations(scaled) <= _large_allocations(plain), (_large_allocations(scaled),
                                                                     _large_allocations(plain))


def test_a_scale_point_as_the_graphs_output_costs_its_forward_no_runtime_op() -> None:
    """The mlp's last op is the scale point on its head's GEMM. As a view, the graph's output
    aliased an intermediate, which AOTAutograd regenerated at every call with an eager
    ``_unsafe_view`` (``autoscale.ops.identity_output``); eagerly the point is still a view."""
    model, (x,), y = mlp_case()
    scaler = autoscale.GradScaler(model)
    compiled = torch.compile(model, backend="autoscale")
    scaler.scale(F.cross_entropy(compiled(x), y)).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        compiled(x)
    ops = {event.name for event in profile.events()}
    assert "aten::addmm" in ops  # (the profiler sees the compiled forward's extern kernels)
    assert "aten::_unsafe_view" not in ops, ops
    scales, stats = torch.ones(3), torch.zeros(3, autoscale.protocol.NUM_STATS)
    assert autoscale.ops.rescale(x.requires_grad_(), scales, stats, (1,), (0,))._is_view()


def test_identical_layers_share_their_point_kernels() -> None:
    """The rescale points of identical layers compile to one kernel, called once per layer, as
    Inductor compiles a repeated layer's kernels once without scaling: a point reads its scales
    from buffers of its own (``autoscale/passes/joint/batch_row_reads.py``), not at a row index that Inductor
    would write into each kernel's source (a 3+3-layer T5 compiled 116 C++ kernels so, against 40)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(16, 16), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 4))
    # three of the four GELU layers share one point kernel (before: four kernels, one call each)
    assert sorted(_gelu_point_kernel_calls(model).values()) == [1, 3]


class _Residual(torch.nn.Module):
    """``x + GELU(Linear(x))``: on a residual stream, the gradient of every later block merges in."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.linear(x))


def test_residual_blocks_at_every_depth_share_their_point_kernels() -> None:
    """On a residual stream the merges' scales are the largest of every later block's rows (sets
    that grow with depth), yet the blocks' points run the same kernels at every depth: a point
    reads its two scales as two buffers (``autoscale/passes/joint/batch_row_reads.py``), whatever the size of
    its sets. Read row by row, each depth's points took another number of row buffers and compiled
    to kernels of their own: here 9 kernels, none called more than twice (a 3+3-layer T5: 34
    backward kernels against 27)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_Residual(16) for _ in range(8)), torch.nn.Linear(16, 4))
    # (the first and last blocks differ: the stream starts and ends there; and a block's kernel that
    # also computes sets' scales, which AOTAutograd's partitioner places before their first read)
    calls = _gelu_point_kernel_calls(model)
    assert max(calls.values()) >= 4, calls


def _gelu_point_kernel_calls(model: torch.nn.Module) -> dict[str, int]:
    """How many times the compiled backward of one scaled training step of ``model`` (16 features
    in, 4 classes out) calls each kernel that holds a rescale point next to a GELU's backward."""
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    scaler = autoscale.GradScaler(model)
    compiled = torch.compile(model, backend="autoscale")
    _, (_, backward) = run_fw_bw_and_get_code(lambda: scaler.scale(F.cross_entropy(compiled(x), y)))
    calls = re.findall(r"\n\s+(cpp_fused_\w+)\(", backward)
    return {k: calls.count(k) for k in dict.fromkeys(calls) if "amax" in k and "gelu_backward" in k}


def test_each_checks_maximum_is_written_straight_into_the_folds_vector() -> None:
    """A check's (and a point's) maximum is a one-element vector (``autoscale.measure.largest``), so
    Inductor's reduction writes it into its slot of the fold's vector: the forward allocates no
    0-dim buffer per check, and the fold's kernel copies none into the vector."""
    model, (x,), y = mlp_case()
    scaler = autoscale.GradScaler(model)
    compiled = torch.compile(model, backend="autoscale")
    _, (forward, _) = run_fw_bw_and_get_code(lambda: scaler.scale(F.cross_entropy(compiled(x), y)))
    body = forward[forward.index("def call("):]
    slots = body.count("# alias")
    assert slots >= 2  # (the checks are there: a slot of the vector each)
    assert not re.findall(r"empty_strided_cpu\(\(\), \(\)", body), body


def _train_from_a_fresh_compile(steps: int) -> tuple[autoscale.CompileRecord, list[torch.Tensor]]:
    """A training run as a restarted job starts one: Dynamo's in-memory state gone, the on-disk
    caches kept. Returns its compile record and what it computed (losses, weights, scales)."""
    torch._dynamo.reset()
    model, (x,), y = mlp_case()
    scaler = autoscale.GradScaler(model)
    backend = autoscale.backend()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(compiled(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
    (record,) = backend.records
    return record, [*losses, *(p.detach().clone() for p in model.parameters()), scaler.state_dict()["scales"]]


def test_a_warm_start_is_served_by_aot_autograds_cache(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A second compile of the same model in a fresh Dynamo, with the caches a first one left
    (a restarted job), skips the joint trace, the joint stage and the partition, compiles nothing,
    and trains alike, bit for bit. AOTAutograd's cache used to refuse autoscale's graphs (a call of
    ``rescale``, a Python function, was in them), and both caches the scaler's update (traced
    without a shape environment)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with torch._functorch.config.patch(enable_autograd_cache=True), torch._inductor.config.patch(fx_graph_cache=True):
        counters.clear()
        cold, cold_results = _train_from_a_fresh_compile(steps=3)
        # (the model's graph; the scaler's compiled update is traced without Dynamo, and the cache
        # takes no graph without Dynamo's shape environment)
        assert counters["aot_autograd"]["autograd_cache_saved"] == 1, "AOTAutograd's cache refused the graph"
        compiled_cold = counters["inductor"]["fxgraph_cache_miss"]
        warm, warm_results = _train_from_a_fresh_compile(steps=3)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    # nothing compiled again, the scaler's update included (Inductor's FX graph cache serves it)
    assert counters["inductor"]["fxgraph_cache_miss"] == compiled_cold > 0
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert not cold.cached and warm.cached
    assert {p.stage for p in cold.passes} == {"dynamo", "joint"}
    assert {p.stage for p in warm.passes} == {"dynamo"}  # (the joint stage did not run: nothing to record)
    for a, b in zip(cold_results, warm_results, strict=True):
        assert torch.equal(a, b)
