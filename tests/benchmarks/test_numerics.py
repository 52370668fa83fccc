"""The numerics benchmark's machinery: its measure, its summary, and the effect it exists to show,
on short runs of the stress MLP (the full benchmark is ``make bench-numerics``)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.numerics import report
from benchmarks.numerics.methods import METHODS
from benchmarks.numerics.tasks import STRESS_DIVISOR, TASKS
from benchmarks.numerics.train import RunResult, run, underflow_rates


def test_underflow_rate_counts_only_entries_float32_has() -> None:
    reference = [torch.tensor([1.0, 2.0, 0.0, 3.0]), torch.zeros(3), None]
    grads = [torch.tensor([0.0, 2.0, 0.0, 0.0]), torch.zeros(3), torch.ones(2)]
    rates, lost = underflow_rates(grads, reference)  # type: ignore[arg-type]
    assert rates[0] == pytest.approx(2 / 3) and lost[0] == pytest.approx(4 / 6)
    assert math.isnan(rates[1]) and math.isnan(rates[2])  # no signal in float32 / no reference


def _result(method: str, seed: int, accuracy: float, rates: list[float], skipped: list[int]) -> RunResult:
    return RunResult("mlp", method, seed, 100, accuracy, 0.5, [(100, accuracy, 0.5)], ["a", "b"],
                     [(1, rates), (50, rates)], [(1, [0.0, 0.0])], skipped, len(skipped))


def test_summary_and_final_line() -> None:
    runs = [_result("fp32", 0, 90.0, [0.0, 0.0], []), _result("fp32", 1, 92.0, [0.0, 0.0], []),
            _result("adaptive", 0, 89.0, [1e-4, math.nan], [3]), _result("adaptive", 1, 91.5, [3e-4, 0.0], [12])]
    summary = report.summarize(runs)
    row = summary[("mlp", "adaptive")]
    assert row.layer_underflow[0] == pytest.approx(2e-4) and row.layer_underflow[1] == 0.0
    assert row.max_underflow == pytest.approx(2e-4) and row.worst_underflow == pytest.approx(3e-4)
    assert (row.skipped, row.skipped_late) == (1.0, 1)  # step 3 is in the warm-up, step 12 is not
    assert report.final_line(summary) == ("numerics: adaptive max layer underflow 2.0e-04, accuracy gap to fp32 "
                                          "0.75 pts, skipped 1")
    text = report.markdown(summary, seeds=2, quick=False, machine="test", minutes=1.0,
                           notes="## What the numbers say\n")
    assert "| **autoscale \"adaptive\" (default)** | 90.25 ± 1.77 |" in text
    assert "**not met**: 1 skipped steps after step 10" in text and text.rstrip().endswith("What the numbers say")


def test_stress_mlp_float16_loses_the_first_layers_and_adaptive_keeps_them() -> None:
    """The benchmark's premise on a short run: with the loss 2^12 times smaller, unscaled float16
    zeroes all of the first layer's weight gradient at first, and most of it over the run; adaptive
    per-layer scaling keeps every layer
    within gamma, with the same default config, and skips no step."""
    assert STRESS_DIVISOR == 2.0**12
    task = TASKS["mlp-stress"]
    fp16 = run(task, METHODS["fp16"], seed=0, quick=True)
    adaptive = run(task, METHODS["adaptive"], seed=0, quick=True)
    first = [rates[0] for _, rates in fp16.underflow]
    assert first[0] == 1.0 and sum(first) / len(first) > 0.5, first
    worst = max(r for _, rates in adaptive.underflow for r in rates if not math.isnan(r))
    assert worst <= 1e-3
    assert adaptive.skipped == [] and adaptive.nonfinite == 0
    assert len(adaptive.curve) == 10 and adaptive.accuracy > 50.0
