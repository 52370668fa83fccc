"""Fault injection over 1,000 steps (the harness and its figures: benchmarks/reliability.py)."""

from __future__ import annotations

import pytest

from benchmarks.reliability import KINDS, run


def test_every_injection_is_detected_and_nothing_is_corrupted() -> None:
    r = run(steps=1000, seed=0)
    assert r.injected >= 30 and set(r.by_kind) == set(KINDS)  # all four kinds, in gradients and activations
    assert r.detected == r.injected == r.skipped  # every injection skipped its step, nothing else was
    assert r.false_alarms == 0
    assert (r.weights_corrupted, r.optimizer_corrupted, r.scales_wrong) == (0, 0, 0)
    # training recovers: it ends where a run without injections that skips the same steps ends
    assert r.final_loss == pytest.approx(r.clean_loss, rel=1e-2)
    assert r.max_weight_difference < 1e-2
