"""The step profiler (``benchmarks.step_profile``) attributes each event to the phase it ran in."""

from __future__ import annotations

from benchmarks.overhead import PHASES, A, B
from benchmarks.step_profile import measure, report


def test_every_phase_is_profiled_apart_and_reported() -> None:
    results = measure("MLP", quick=True, steps=2, device="cpu")
    assert set(results) == {A, B}
    for r in results.values():
        assert all(len(r.wall[p]) == 2 and all(t > 0 for t in r.wall[p]) for p in PHASES)
    # the matrix products run in the forward and the backward, never in step() or update()
    a = results[A]
    assert a.host["forward"]["aten::addmm"] > 0 and a.host["backward"]["aten::mm"] > 0
    assert a.host["step"]["aten::mm"] == 0 and a.host["update"]["aten::addmm"] == 0
    # torch.amp unscales its gradients in step(); autoscale's points did that in the backward
    assert results[B].host["step"]["aten::_amp_foreach_non_finite_check_and_unscale_"] > 0
    assert a.host["step"]["aten::_amp_foreach_non_finite_check_and_unscale_"] == 0
    text = report({"MLP": results}, quick=True, steps=2, device="cpu")
    assert text.count("| MLP |") == 2 * len(PHASES)
