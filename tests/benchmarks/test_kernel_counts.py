"""The kernel counter (``benchmarks.kernel_counts``) reads each compiled graph's launches without a GPU."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import benchmarks.kernel_counts as kernel_counts
from benchmarks.kernel_counts import (
    A_DEFAULT,
    A_FEWER,
    A_IN_PARTS,
    GRAPHS,
    METHODS,
    B,
    Counts,
    count,
    count_step,
    launches,
    report,
)
from benchmarks.overflow_models import _Attention


def test_launches_are_read_from_a_graphs_call() -> None:
    source = ("def other():\n    triton_poi_0.run(a)\n    buf9 = empty_strided_cuda((8, ), (1, ), torch.float32)\n"
              "def call(args):\n    buf0 = empty_strided_cuda((8, ), (1, ), torch.float32)\n"
              "    triton_poi_fused_0.run(buf0, 8)\n    buf1 = reinterpret_tensor(buf0, (4, ), (1, ), 4)  # alias\n"
              "    extern_kernels.mm(a, reinterpret_tensor(b, (4, 2), (1, 4), 0), out=c)\n"
              "    triton_red_fused_1.run(buf1, 4, 64)\n")
    counts = launches(source)
    assert (counts.triton, counts.extern, counts.tensors) == (2, 1, 3)


def test_each_method_compiles_its_graphs_and_the_fewer_launches_form_launches_fewer_kernels() -> None:
    results = count("MLP", "quick")
    assert tuple(results) == METHODS
    assert set(results[A_FEWER]) == set(GRAPHS) and set(results[B]) == {"forward", "backward"}
    # the quick MLP's five linear layers: five GEMMs forward, nine backward (no input gradient first)
    assert all((r["forward"].extern, r["backward"].extern) == (5, 9) for r in results.values())

    def launched(label: str) -> int:
        return sum(results[label][g].triton for g in ("forward", "backward"))

    assert launched(B) < launched(A_FEWER) < launched(A_DEFAULT)
    assert all(r["backward"].tensors > 0 for r in results.values())
    assert "| MLP | (b)" in report({"MLP": results}, size="quick")


def test_a_cnn_is_laid_out_as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With oneDNN, Inductor lays every CPU convolution out channels-last; a GPU's heuristics keep
    32 channels in NCHW. The count must see a GPU's layout: the first convolution's output (not the
    graph's, which keeps eager's strides), as the generated code asserts it, is NCHW-contiguous."""
    sources: list[str] = []

    def read(source: str) -> Counts:
        sources.append(source)
        return launches(source)

    monkeypatch.setattr(kernel_counts, "launches", read)
    with kernel_counts.triton_codegen_on_cpu([]):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 8, 1))
        torch.compile(model)(torch.randn(4, 3, 8, 8))
    nchw, channels_last = "(4, 32, 8, 8), (2048, 64, 8, 1)", "(4, 32, 8, 8), (2048, 1, 256, 32)"
    assert len(sources) == 1 and nchw in sources[0] and channels_last not in sources[0]


def test_a_wide_cnns_partial_results_are_read_in_its_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU lays the wide CNN out channels-last. Its points' and checks' partial results read so
    (``autoscale/passes/joint/lay_out_partials.py``) join the kernels that write their values: fewer launches than
    read in the traced NCHW order, as before the pass."""
    laid_out = count("wide CNN", "quick", (A_FEWER,))[A_FEWER]
    lay_out = importlib.import_module("autoscale.passes.joint.lay_out_partials")
    monkeypatch.setattr(lay_out, "_inductor_lays_out_channels_last", lambda gm: False)
    traced_order = count("wide CNN", "quick", (A_FEWER,))[A_FEWER]
    for graph in ("forward", "backward"):
        assert laid_out[graph].triton < traced_order[graph].triton, graph


class _T5Attention(nn.Module):
    """One of T5's attention layers alone (``benchmarks.overflow_models``: Q, K and V projections
    of their own, a relative-position bias) and a classifier: the fast form of T5 1+1's count."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = _Attention(64, 4, relative_bias=True, causal=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.attention.bias(x.shape[1], x.shape[1], x.device)
        return self.head(self.attention(x, x, bias).mean(1))


def _counted_with_and_without_copies(monkeypatch: pytest.MonkeyPatch, counted: Callable[[], dict[str, Counts]]
                                     ) -> tuple[dict[str, Counts], dict[str, Counts]]:
    from_copies = counted()
    lay_out = importlib.import_module("autoscale.passes.joint.lay_out_partials")
    monkeypatch.setattr(lay_out, "_copy_read_after_its_gemm", lambda node: None)
    return from_copies, counted()


@pytest.mark.parametrize("model", [
    "T5 attention",
    pytest.param("T5 1+1", marks=pytest.mark.slow),
])
def test_a_t5s_checks_of_its_projections_join_the_kernels_that_copy_them(monkeypatch: pytest.MonkeyPatch,
                                                                        model: str) -> None:
    """T5's Q, K and V projections are GEMM outputs (no kernel of Inductor's writes them); their
    checks read the heads' copies that the next GEMMs read, in the kernels that write the copies:
    fewer forward launches than reading the projections. On one attention layer of T5's in the
    default suite; on T5 1+1 (a minute on 2 cores) in the slow one."""
    def counted() -> dict[str, Counts]:
        if model == "T5 1+1":
            return count("T5 1+1", "quick", (A_FEWER,))[A_FEWER]
        torch.manual_seed(0)
        return count_step(_T5Attention(), torch.randn(4, 8, 64), torch.randint(0, 10, (4,)), (A_FEWER,))[A_FEWER]

    from_copies, from_outputs = _counted_with_and_without_copies(monkeypatch, counted)
    assert from_copies["forward"].triton < from_outputs["forward"].triton
    assert from_copies["backward"].triton == from_outputs["backward"].triton


def test_partial_results_by_rows_join_the_kernels_that_read_a_value_by_rows() -> None:
    """A transformer block's values reduced row by row (``autoscale.protocol.Form.rows``) are read
    at the indices its norms, its softmax and its points' scaled writes read them, whose kernels
    Inductor then computes them in: fewer launches, forward and backward, than split into flat parts."""
    by_rows = count("transformer block", "quick", (A_FEWER,))[A_FEWER]
    in_parts = count("transformer block", "quick", (A_IN_PARTS,))[A_IN_PARTS]
    for graph in ("forward", "backward"):
        assert by_rows[graph].triton < in_parts[graph].triton, graph
