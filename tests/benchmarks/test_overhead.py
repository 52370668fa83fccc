"""The overhead benchmark (``benchmarks.overhead``): ``--large`` is what it says, the rounds' orders are
balanced, the options are refused or reported."""

from __future__ import annotations

import sys
from collections import Counter
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import autoscale
import benchmarks.overhead as overhead
from benchmarks import results_path
from benchmarks.overhead import MODELS, main


def _step_flops(name: str, size: str) -> int:
    """A training step's arithmetic (forward and backward), counted on meta tensors: nothing is
    allocated or computed."""
    with torch.device("meta"):
        model, x, y = MODELS[name](size)  # type: ignore[arg-type]
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(x), y).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", list(MODELS))
def test_large_models_give_a_gpu_arithmetic_to_wait_on(name: str) -> None:
    """On a GPU the full models' steps are bound by the host's launches: a few GFLOP, which an
    H200 does in microseconds. A large model's step is ~1 TFLOP or more, several milliseconds of
    an H200's float16 work (~700 TFLOP/s at best), and hundreds of times the full model's."""
    full, large = _step_flops(name, "full"), _step_flops(name, "large")
    assert full < 1e10
    assert large > 1.5e12 and large > 300 * full


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_models_arithmetic_is_negligible(name: str) -> None:
    """``--tiny`` measures what a step costs besides its arithmetic: the same architecture with at
    most half a percent of the quick model's arithmetic (a quick step is 1-2 ms) and under a
    million operations (a few µs of this CPU)."""
    tiny = _step_flops(name, "tiny")
    assert 200 * tiny < _step_flops(name, "quick") and tiny < 1e6


def test_a_tiny_run_reports_microseconds_and_what_each_method_adds() -> None:
    """Tiny steps are a few hundred µs: the report gives them in µs, and, for every size, what each
    method adds a step over (b), the median over runs of each run's difference."""
    result = overhead.Result(rounds=1)
    a, a_, b, b_ = overhead.A, overhead.A_UNWATCHED, overhead.B, overhead.B_AGAIN
    result.steps = [{a: 330e-6, a_: 320e-6, b: 300e-6, b_: 301e-6}, {a: 340e-6, a_: 322e-6, b: 310e-6, b_: 309e-6}]
    result.phases = {label: dict.fromkeys(overhead.PHASES, 1e-6) for label in (a, a_, b)}
    result.faults.update({label: [0.0] for label in result.steps[0]})
    result.reads = {label: (0, 0) for label in (a, a_, b)}
    text = overhead.report({"MLP": result}, size="tiny", runs=2, steps=5, device="cpu")
    assert "| MLP | 335.0 µs | 321.0 µs | 305.0 µs | 305.0 µs |" in text
    added = text[text.index("What each method adds"):].splitlines()
    assert added[2] == "| model | (a) − (b) | (a') − (b) | (b') − (b) |"
    assert added[4] == "| MLP | +30.0 µs | +16.0 µs | +0.0 µs |"


def test_large_is_refused_on_a_cpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["overhead", "--large"])
    with pytest.raises(SystemExit):
        main()
    assert "--large is sized for a GPU" in capsys.readouterr().err


def test_each_size_has_its_own_report() -> None:
    names = {results_path("overhead", size=size, device=device).name  # type: ignore[arg-type]
             for size in ("tiny", "quick", "full", "large") for device in ("cpu", "cuda")}
    assert names == {"overhead.md", "overhead_tiny.md", "overhead_quick.md", "overhead_large.md",
                     "overhead_cuda.md", "overhead_tiny_cuda.md", "overhead_quick_cuda.md", "overhead_large_cuda.md"}


@pytest.mark.parametrize(("argv", "refusal"), [
    (["--inductor", "no_such_option=1", "-o", "x.md"], "an option of torch._inductor.config"),
    (["--inductor", "combo_kernels"], "KEY=VALUE"),
    (["--inductor", "combo_kernels=True"], "name its report with -o"),
    (["--measure-every", "-1", "-o", "x.md"], "M >= 0"),
    (["--measure-every", "0"], "name its report with -o"),
    (["--measure-every", "16"], "name its report with -o"),
    (["--system-heap"], "name its report with -o"),
])
def test_options_that_change_what_is_measured_are_refused_unless_valid_and_reported_apart(
        argv: list[str], refusal: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["overhead", *argv])
    with pytest.raises(SystemExit):
        main()
    assert refusal in capsys.readouterr().err


def test_measure_every_reaches_autoscales_scalers_alone() -> None:
    """``--measure-every``: (a) and (a') measure every M-th step, beside (a1), which measures every
    step; the baseline is torch.amp's as ever."""
    model, _, _ = MODELS["MLP"]("quick")
    methods = overhead._methods(model, "cpu", measure_every=4)
    every = {label: m.scaler.config.measure_every for label, m in methods.items()
             if isinstance(m.scaler, autoscale.GradScaler)}
    assert every == {overhead.A: 4, overhead.A_UNWATCHED: 4, overhead.A_EVERY: 1}
    assert not {overhead.C, overhead.D} & set(methods)  # (no part of what the option is measured against)
    assert overhead.A_EVERY not in overhead._methods(model, "cpu", references=False)
    assert isinstance(methods[overhead.B].scaler, torch.amp.GradScaler)


@pytest.mark.parametrize("executor", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_measure_every_0_measures_the_first_step_alone(executor: str) -> None:
    """``--measure-every 0``, the floor: (a) and (a') measure their first step and no other, so that
    every timed step runs the graph whose points only multiply and check; the report says so. The
    steps as the benchmark compiles them (Inductor) in the slow suite; with the eager executor, the
    same scaler, in the default one."""
    model, x, y = MODELS["MLP"]("tiny")
    methods = overhead._methods(model, "cpu", measure_every=0)
    scalers = {label: m.scaler for label, m in methods.items() if isinstance(m.scaler, autoscale.GradScaler)}
    assert {label: s.config.measure_every for label, s in scalers.items()} == {
        overhead.A: overhead.FLOOR, overhead.A_UNWATCHED: overhead.FLOOR, overhead.A_EVERY: 1}
    floor = methods[overhead.A]
    if executor == "eager":
        owner = floor.owner
        eager = autoscale.backend(autoscale.Config(executor="eager"))
        floor = overhead._Method(torch.compile(owner, backend=eager), floor.scaler, owner)
    measured = []
    for _ in range(4):
        measured.append(floor.scaler._state.measuring)
        floor.step(x, y)
    assert measured == [True, False, False, False]
    result = overhead.Result(rounds=1)
    result.steps = [{overhead.A: 2.0, overhead.A_UNWATCHED: 2.0, overhead.B: 1.0, overhead.B_AGAIN: 1.0,
                     overhead.A_EVERY: 2.5}]
    result.phases = {label: dict.fromkeys(overhead.PHASES, 1e-3) for label in result.steps[0]}
    result.faults.update({label: [0.0] for label in result.steps[0]})
    result.reads = {label: (0, 0) for label in (overhead.A, overhead.A_UNWATCHED, overhead.B)}
    text = overhead.report({"MLP": result}, size="quick", runs=1, steps=5, device="cpu", measure_every=0)
    assert "measuring their gradients at their first step only" in text


@pytest.mark.parametrize(("every", "steps"), [(1, 5), (2, 6), (16, 16), (0, 5)])
def test_each_round_times_whole_periods_of_at_least_5_steps(every: int, steps: int) -> None:
    assert overhead.steps_per_round(every) == steps


class _Seen:
    """A method's stand-in that notes the Inductor option it steps under."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def step(self, *args: object, **kwargs: object) -> None:
        self.seen.append(torch._inductor.config.max_autotune_pointwise)


def test_methods_compile_under_the_inductor_options() -> None:
    """``compile_methods`` steps every method (compile and warm-up) under the options ``--inductor``
    asks for, and restores them; the whole benchmark's run is the slow test below."""
    methods = {label: _Seen() for label in (overhead.A, overhead.B)}
    overhead.compile_methods(methods, torch.zeros(1), torch.zeros(1), "cpu",  # type: ignore[arg-type]
                             inductor={"max_autotune_pointwise": True})
    assert all(m.seen == [True] * 3 for m in methods.values())
    assert not torch._inductor.config.max_autotune_pointwise
    result = overhead.Result(rounds=1)
    result.steps = [{overhead.A: 2.0, overhead.A_UNWATCHED: 2.0, overhead.B: 1.0, overhead.B_AGAIN: 1.0}]
    result.phases = {label: dict.fromkeys(overhead.PHASES, 1e-3) for label in result.steps[0]}
    result.faults.update({label: [0.0] for label in result.steps[0]})
    result.reads = {label: (0, 0) for label in (overhead.A, overhead.A_UNWATCHED, overhead.B)}
    text = overhead.report({"MLP": result}, size="quick", runs=1, steps=1, device="cpu",
                           inductor={"max_autotune_pointwise": True})
    assert "every method compiled with Inductor's max_autotune_pointwise=True" in text


@pytest.mark.slow
def test_every_method_compiles_under_the_inductor_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``--inductor`` asks for is in force while each method compiles (its first steps), and
    the report says so."""
    seen: list[bool] = []
    real = overhead._Method.step

    def step(self: overhead._Method, *args: object, **kwargs: object) -> None:
        seen.append(torch._inductor.config.max_autotune_pointwise)
        real(self, *args, **kwargs)

    monkeypatch.setattr(overhead._Method, "step", step)
    result = overhead.measure("MLP", "quick", runs=1, rounds=1, steps=1, device="cpu",
                              inductor={"max_autotune_pointwise": True})
    assert seen[:3 * len(result.steps[0])] == [True] * (3 * len(result.steps[0]))  # (the compiles and warm-ups)
    assert not torch._inductor.config.max_autotune_pointwise  # (restored)
    text = overhead.report({"MLP": result}, size="quick", runs=1, steps=1, device="cpu",
                           inductor={"max_autotune_pointwise": True})
    assert "every method compiled with Inductor's max_autotune_pointwise=True" in text
    assert overhead.HEAPS[overhead.HEAP_KEPT] in text  # (the default: which heap the steps allocated from)
    faults = text[text.index("Page faults a step"):].splitlines()
    assert faults[4].startswith("| MLP | ") and faults[4].count("|") == len(result.steps[0]) + 2


def test_each_model_prints_its_ratios_as_it_is_done() -> None:
    """What a run cut short by a time limit keeps: per model, each ratio over (b), run by run."""
    result = overhead.Result(rounds=1)
    result.steps = [{overhead.A: 2.0, overhead.B: 1.0, overhead.B_AGAIN: 1.0},
                    {overhead.A: 3.0, overhead.B: 2.0, overhead.B_AGAIN: 2.5}]
    assert overhead.progress("MLP", result) == "MLP: a/b 2.000 1.500, b'/b 1.000 1.250"


@pytest.mark.parametrize("n", range(1, 9))
def test_the_rounds_orders_balance_positions_and_predecessors(n: int) -> None:
    """Over one design, every method takes every position, and comes right after every other
    method, equally often: a method's time depends on the method run just before it, and a
    rotation of one order keeps every method's predecessor in every round."""
    orders = overhead.balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert len(orders) == (2 * n if n % 2 and n > 1 else n)
    positions = Counter((k, i) for order in orders for i, k in enumerate(order))
    assert set(positions.values()) == {len(orders) // n}
    pairs = _successions(orders)
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1


def test_a_rotation_of_one_order_would_not_balance_predecessors() -> None:
    """The test above can fail: the rotation the benchmark used before keeps each predecessor."""
    n = 6
    rotations = [[(k + shift) % n for k in range(n)] for shift in range(n)]
    pairs = _successions(rotations)
    assert len(pairs) < n * (n - 1)


def _successions(orders: list[list[int]]) -> Counter[tuple[int, int]]:
    """How often each method comes right after each other, over ``orders``."""
    return Counter(pair for order in orders for pair in pairwise(order))
