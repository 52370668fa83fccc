"""autoscale.measure's forms: in the form laid out for a GPU's launch count
(``Config(form="fewer_launches")``) points and checks hand partial results, in the default form whole
ones, and either way a training step computes the same numbers, bit for bit."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import autoscale
from autoscale.measure import counted, largest, whole
from autoscale.protocol import FORMS, PART_SIZE, ROW_SIZE, STAT
from tests.tolerances import SQNR_MIN_DB_SAME_GRAPH, sqnr

GPU = FORMS["fewer_launches"]


def test_in_the_default_form_a_reduction_is_whole() -> None:
    x = torch.randn(64, PART_SIZE)
    assert largest(x.abs(), FORMS["default"]).shape == (1,) and counted(x > 0, FORMS["default"]).shape == ()


def test_a_gpus_reductions_are_partial_results_of_at_least_a_part_each() -> None:
    """Where a value's rows do not serve (``Form.rows``): as many as the form takes, halved until each
    reduces ``PART_SIZE`` elements or more and they divide the value; one per element for a value of
    no more elements than that; whole for one not dense in memory (its partial results would read
    it through a copy)."""
    x = torch.randn(4 * PART_SIZE).abs()
    peaks, counts = largest(x, GPU), counted(x > 1.0, GPU)
    assert peaks.shape == (4,) and counts.shape == (4,)
    assert whole(peaks, "max").equal(x.amax()) and whole(counts, "sum") == (x > 1.0).sum()
    assert largest(torch.randn(4 * GPU.rows, 256).abs(), GPU).shape == (GPU.parts,)
    # (the largest power of two that divides it into parts of PART_SIZE or more)
    assert largest(torch.randn(3 * PART_SIZE).abs(), GPU).shape == (2,)
    assert largest(torch.randn(PART_SIZE + 1).abs(), GPU).shape == (1,)
    short_rows = torch.randn(32, 32, 3, 3).abs()  # (a convolution's weight: rows of 3, fewer than ROW_SIZE)
    assert largest(short_rows, GPU).shape == (8,) and whole(largest(short_rows, GPU), "max").equal(short_rows.amax())
    small = torch.randn(10, 30).abs()  # (no more elements than parts: each its own, no reduction)
    assert largest(small, GPU).shape == (300,) and whole(largest(small, GPU), "max").equal(small.amax())
    assert counted(small > 1.0, GPU).shape == (300,)
    assert largest(torch.randn(64, 8 * PART_SIZE).abs()[:, ::2], GPU).shape == (1,)  # (not dense)
    assert largest(torch.full((4 * PART_SIZE,), float("nan")), GPU).isnan().all()


def test_a_gpus_reductions_follow_a_values_rows_in_memory() -> None:
    """A value of more elements than the form's ``parts`` and at most its ``rows`` rows of
    ``ROW_SIZE`` or more hands on one partial result per row, its rows being those of its
    innermost dimension in memory: the reduction reads it at the indices at which the kernels that
    read it by rows read it (``Form.rows``)."""
    x = torch.randn(64, 128).abs()
    assert largest(x, GPU).equal(x.amax(1)) and counted(x > 1.0, GPU).equal((x > 1.0).sum(1).float())
    assert largest(torch.randn(16, 64, 128).abs(), GPU).shape == (1024,)  # (a batch of sequences' rows)
    transposed = torch.randn(64, 4 * PART_SIZE).t().abs()  # (4,096 rows as indexed, 64 in memory)
    assert largest(transposed, GPU).equal(transposed.amax(0))
    channels_last = torch.randn(8, 16, 8, 8).abs().contiguous(memory_format=torch.channels_last)
    assert largest(channels_last, GPU).equal(channels_last.amax(1).flatten())  # (a row per pixel, its channels)
    # (rows of ROW_SIZE elements are reduced one by one; one element shorter, the value is split in parts)
    assert largest(torch.randn(64, 8, ROW_SIZE).abs(), GPU).shape == (512,)
    assert largest(torch.randn(64, 8, ROW_SIZE - 1).abs(), GPU).shape == (4,)
    many = torch.randn(2 * GPU.rows, 64).abs()  # (more rows than the form takes: parts)
    assert largest(many, GPU).shape == (128,) and whole(largest(many, GPU), "max").equal(many.amax())


class _Attention(nn.Module):
    """Q, K and V projections split into heads, each copied for the next GEMM (as T5's): a GPU's
    checks of the projections read the copies (``autoscale/passes/joint/lay_out_partials.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(8, 16, 4, 16).transpose(1, 2).contiguous()

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        mixed = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
        return self.out(mixed.transpose(1, 2).reshape(8, 16, 64)).mean(1)[:, :10]


def _trained(config: autoscale.Config, model_name: str = "mlp"
             ) -> tuple[list[torch.Tensor], torch.Tensor, list[autoscale.LayerReport]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    # (8,192-element weights and 4,096-element activations: 64 rows each, a partial result a row;
    # 64- and 10-element biases: handed as their elements)
    model: nn.Module = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 10))
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
    if model_name == "cnn":  # (laid out channels-last by Inductor on a CPU with oneDNN: so are its partial results)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                              nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(16, 10))
        x, y = torch.randn(8, 3, 16, 16), y[:8]
    elif model_name == "attention":
        model, x, y = _Attention(), torch.randn(8, 16, 64), y[:8]
    scaler, opt = autoscale.GradScaler(model, config), torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend=autoscale.backend(config))
    for _ in range(5):  # (the last measured, with measure_every=2 too)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(compiled(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler._last_stats is not None
    return [p.detach().clone() for p in model.parameters()], scaler._last_stats.clone(), scaler.layers()


_EVERY_2, _PAPER = autoscale.ScalingConfig(measure_every=2), autoscale.ScalingConfig(rule="paper")


@pytest.mark.parametrize("config", [
    autoscale.Config(),
    autoscale.Config(executor="eager"),  # (the points and the fold run as ops, not compiled kernels)
    autoscale.Config(scaling=_EVERY_2, executor="eager"),
    autoscale.Config(scaling=_PAPER, executor="eager"),
    pytest.param(autoscale.Config(scaling=_EVERY_2), marks=pytest.mark.slow),
    pytest.param(autoscale.Config(scaling=_PAPER), marks=pytest.mark.slow),
], ids=["inductor", "eager", "measure_every-eager", "paper-eager", "measure_every", "paper"])
def test_a_gpus_form_trains_bit_for_bit_as_the_default(config: autoscale.Config) -> None:
    """Compiled here in the form laid out for a GPU (``form="fewer_launches"``: outputs written by
    their producers' kernels, reductions handed to the fold as partial results), a model trains to
    the same parameters, statistics and layer reports as in the default form, bit for bit: max and
    integer counts are exact in any order. Steps that measure nothing (``measure_every``) and the
    paper's rule (its moments) under the eager executor in the default suite, under Inductor too in
    the slow one."""
    cpu = _trained(config)
    gpu = _trained(config.replace(form="fewer_launches"))
    assert all(a.equal(b) for a, b in zip(cpu[0], gpu[0], strict=True))
    assert cpu[1].equal(gpu[1]) and cpu[2] == gpu[2]
    assert cpu[1][:, STAT["amax"]].gt(0).sum() >= 2  # (the layers measured something)


@pytest.mark.parametrize(("model_name", "executor"), [
    ("cnn", "inductor"),
    ("attention", "eager"),
    pytest.param("attention", "inductor", marks=pytest.mark.slow),
])
def test_a_gpus_form_trains_a_cnn_and_attention_as_the_default(model_name: str,
                                                               executor: Literal["inductor", "eager"]) -> None:
    """The same for a CNN whose values Inductor lays out channels-last (oneDNN's rule on a CPU), and
    with them that form's partial results, and for an attention whose checks of its Q, K and V
    read the copies the next GEMMs read (``autoscale/passes/joint/lay_out_partials.py``): statistics and layer
    reports bit for bit. The parameters only as one graph run by two executors: Inductor fuses and
    orders some reductions otherwise in the two forms (the CNN's batch norms' backward: the last bits
    of four of its eight parameters, with the partials in either layout). The attention under
    Inductor in the slow suite, under the eager executor in the default one."""
    # (the attention's GEMMs native, as on a GPU: emulated, a rounding kernel writes their outputs)
    config = autoscale.Config(compute="native" if model_name == "attention" else "emulate", executor=executor)
    cpu = _trained(config, model_name)
    gpu = _trained(config.replace(form="fewer_launches"), model_name)
    assert all(sqnr(a, b) >= SQNR_MIN_DB_SAME_GRAPH for a, b in zip(cpu[0], gpu[0], strict=True))
    assert cpu[1].equal(gpu[1]) and cpu[2] == gpu[2]
    assert cpu[1][:, STAT["amax"]].gt(0).sum() >= 3  # (the convolutions' or projections', the head's)
