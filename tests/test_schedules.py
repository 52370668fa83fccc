"""Tests for autoscale.schedules: the cyclic-precision-training bit schedules."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscale import schedules
from autoscale.schedules import Schedule, average_cost, cost_proxy, get, names

NAMES = (
    "cosine-repeated",
    "cosine-triangular",
    "linear-repeated",
    "linear-triangular",
    "exponential-repeated",
    "exponential-triangular",
    "exponential-flipped-repeated",
    "exponential-flipped-triangular",
    "rex-repeated",
    "rex-triangular",
    "rex-flipped-repeated",
    "rex-flipped-triangular",
)
TRIANGULAR = tuple(name for name in NAMES if name.endswith("-triangular"))
REPEATED = tuple(name for name in NAMES if name.endswith("-repeated"))

# Run under a loaded machine without flaky deadline failures; the examples themselves are small.
FAST = settings(deadline=None, max_examples=100)


def half_up(x: float) -> int:
    """Round half up, written independently of the module's helper."""
    return math.floor(x + 0.5)


# Hand-computed values for q_min=2, q_max=8 (Δ=6), total_steps=100, n_cycles=2, so T=50 steps.
# Steps 0, 12, 25, 49 lie in cycle 0 at z = 0, 12/50, 25/50, 49/50 (start, early, middle, end);
# steps 50, 75, 99 lie in cycle 1 at z = 0, 25/50, 49/50 (boundary, middle, end). Triangular
# schedules evaluate cycle 1 at 1 - z: 1, 25/50, 1/50. Each row: (name, step, S written out, bits).
HAND = [
    # cosine: 2 + ½·6·(1 - cos πz)
    ("cosine-repeated", 0, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 0 / 50)), 2),
    ("cosine-repeated", 12, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 12 / 50)), 3),  # 2.813
    ("cosine-repeated", 25, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 25 / 50)), 5),  # 5.0
    ("cosine-repeated", 49, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 49 / 50)), 8),  # 7.994
    ("cosine-repeated", 50, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 0 / 50)), 2),
    ("cosine-repeated", 75, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 25 / 50)), 5),
    ("cosine-repeated", 99, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 49 / 50)), 8),
    ("cosine-triangular", 0, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 0 / 50)), 2),
    ("cosine-triangular", 12, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 12 / 50)), 3),
    ("cosine-triangular", 25, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 25 / 50)), 5),
    ("cosine-triangular", 49, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 49 / 50)), 8),
    ("cosine-triangular", 50, 2 + 0.5 * 6 * (1 - math.cos(math.pi * 1)), 8),  # 8.0
    ("cosine-triangular", 75, 2 + 0.5 * 6 * (1 - math.cos(math.pi * (1 - 25 / 50))), 5),
    ("cosine-triangular", 99, 2 + 0.5 * 6 * (1 - math.cos(math.pi * (1 - 49 / 50))), 2),  # 2.006
    # linear: 2 + 6z
    ("linear-repeated", 0, 2 + 6 * 0 / 50, 2),
    ("linear-repeated", 12, 2 + 6 * 12 / 50, 3),  # 3.44
    ("linear-repeated", 25, 2 + 6 * 25 / 50, 5),  # 5.0
    ("linear-repeated", 49, 2 + 6 * 49 / 50, 8),  # 7.88
    ("linear-repeated", 50, 2 + 6 * 0 / 50, 2),
    ("linear-repeated", 75, 2 + 6 * 25 / 50, 5),
    ("linear-repeated", 99, 2 + 6 * 49 / 50, 8),
    ("linear-triangular", 0, 2 + 6 * 0 / 50, 2),
    ("linear-triangular", 12, 2 + 6 * 12 / 50, 3),
    ("linear-triangular", 25, 2 + 6 * 25 / 50, 5),
    ("linear-triangular", 49, 2 + 6 * 49 / 50, 8),
    ("linear-triangular", 50, 2 + 6 * 1, 8),
    ("linear-triangular", 75, 2 + 6 * (1 - 25 / 50), 5),
    ("linear-triangular", 99, 2 + 6 * (1 - 49 / 50), 2),  # 2.12
    # exponential: 8 - 6·e^(-4z)
    ("exponential-repeated", 0, 8 - 6 * math.exp(-4 * 0 / 50), 2),
    ("exponential-repeated", 12, 8 - 6 * math.exp(-4 * 12 / 50), 6),  # 5.703
    ("exponential-repeated", 25, 8 - 6 * math.exp(-4 * 25 / 50), 7),  # 7.188
    ("exponential-repeated", 49, 8 - 6 * math.exp(-4 * 49 / 50), 8),  # 7.881
    ("exponential-repeated", 50, 8 - 6 * math.exp(-4 * 0 / 50), 2),
    ("exponential-repeated", 75, 8 - 6 * math.exp(-4 * 25 / 50), 7),
    ("exponential-repeated", 99, 8 - 6 * math.exp(-4 * 49 / 50), 8),
    ("exponential-triangular", 0, 8 - 6 * math.exp(-4 * 0 / 50), 2),
    ("exponential-triangular", 12, 8 - 6 * math.exp(-4 * 12 / 50), 6),
    ("exponential-triangular", 25, 8 - 6 * math.exp(-4 * 25 / 50), 7),
    ("exponential-triangular", 49, 8 - 6 * math.exp(-4 * 49 / 50), 8),
    ("exponential-triangular", 50, 8 - 6 * math.exp(-4 * 1), 8),  # 7.890: q_max - Δe^-4, not 8.0
    ("exponential-triangular", 75, 8 - 6 * math.exp(-4 * (1 - 25 / 50)), 7),
    ("exponential-triangular", 99, 8 - 6 * math.exp(-4 * (1 - 49 / 50)), 2),  # 2.462
    # exponential-flipped: 2 + 8 - (8 - 6·e^(-4(1-z)))
    ("exponential-flipped-repeated", 0, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 0 / 50))), 2),  # 2.110
    ("exponential-flipped-repeated", 12, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 12 / 50))), 2),  # 2.287
    ("exponential-flipped-repeated", 25, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 25 / 50))), 3),  # 2.812
    ("exponential-flipped-repeated", 49, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 49 / 50))), 8),  # 7.539
    ("exponential-flipped-repeated", 50, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 0 / 50))), 2),
    ("exponential-flipped-repeated", 75, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 25 / 50))), 3),
    ("exponential-flipped-repeated", 99, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 49 / 50))), 8),
    ("exponential-flipped-triangular", 0, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 0 / 50))), 2),
    ("exponential-flipped-triangular", 12, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 12 / 50))), 2),
    ("exponential-flipped-triangular", 25, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 25 / 50))), 3),
    ("exponential-flipped-triangular", 49, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 49 / 50))), 8),
    ("exponential-flipped-triangular", 50, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - 1))), 8),  # 8.0
    ("exponential-flipped-triangular", 75, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - (1 - 25 / 50)))), 3),
    ("exponential-flipped-triangular", 99, 2 + 8 - (8 - 6 * math.exp(-4 * (1 - (1 - 49 / 50)))), 2),  # 2.118
    # rex: 8 - 6·(1-z)/(0.1 + 0.9(1-z))
    ("rex-repeated", 0, 8 - 6 * (1 - 0 / 50) / (0.1 + 0.9 * (1 - 0 / 50)), 2),
    ("rex-repeated", 12, 8 - 6 * (1 - 12 / 50) / (0.1 + 0.9 * (1 - 12 / 50)), 2),  # 2.184
    ("rex-repeated", 25, 8 - 6 * (1 - 25 / 50) / (0.1 + 0.9 * (1 - 25 / 50)), 3),  # 2.545
    ("rex-repeated", 49, 8 - 6 * (1 - 49 / 50) / (0.1 + 0.9 * (1 - 49 / 50)), 7),  # 6.983
    ("rex-repeated", 50, 8 - 6 * (1 - 0 / 50) / (0.1 + 0.9 * (1 - 0 / 50)), 2),
    ("rex-repeated", 75, 8 - 6 * (1 - 25 / 50) / (0.1 + 0.9 * (1 - 25 / 50)), 3),
    ("rex-repeated", 99, 8 - 6 * (1 - 49 / 50) / (0.1 + 0.9 * (1 - 49 / 50)), 7),
    ("rex-triangular", 0, 8 - 6 * (1 - 0 / 50) / (0.1 + 0.9 * (1 - 0 / 50)), 2),
    ("rex-triangular", 12, 8 - 6 * (1 - 12 / 50) / (0.1 + 0.9 * (1 - 12 / 50)), 2),
    ("rex-triangular", 25, 8 - 6 * (1 - 25 / 50) / (0.1 + 0.9 * (1 - 25 / 50)), 3),
    ("rex-triangular", 49, 8 - 6 * (1 - 49 / 50) / (0.1 + 0.9 * (1 - 49 / 50)), 7),
    ("rex-triangular", 50, 8 - 6 * (1 - 1) / (0.1 + 0.9 * (1 - 1)), 8),  # 8.0
    ("rex-triangular", 75, 8 - 6 * (1 - 25 / 50) / (0.1 + 0.9 * (1 - 25 / 50)), 3),  # 1 - z = z here
    ("rex-triangular", 99, 8 - 6 * (49 / 50) / (0.1 + 0.9 * (49 / 50)), 2),  # z' = 1/50: 2.012
    # rex-flipped: 2 + 8 - (8 - 6·z/(0.1 + 0.9z)), i.e. rex at 1 - z mirrored
    ("rex-flipped-repeated", 0, 2 + 8 - (8 - 6 * (0 / 50) / (0.1 + 0.9 * (0 / 50))), 2),
    ("rex-flipped-repeated", 12, 2 + 8 - (8 - 6 * (12 / 50) / (0.1 + 0.9 * (12 / 50))), 7),  # 6.557
    ("rex-flipped-repeated", 25, 2 + 8 - (8 - 6 * (25 / 50) / (0.1 + 0.9 * (25 / 50))), 7),  # 7.455
    ("rex-flipped-repeated", 49, 2 + 8 - (8 - 6 * (49 / 50) / (0.1 + 0.9 * (49 / 50))), 8),  # 7.988
    ("rex-flipped-repeated", 50, 2 + 8 - (8 - 6 * (0 / 50) / (0.1 + 0.9 * (0 / 50))), 2),
    ("rex-flipped-repeated", 75, 2 + 8 - (8 - 6 * (25 / 50) / (0.1 + 0.9 * (25 / 50))), 7),
    ("rex-flipped-repeated", 99, 2 + 8 - (8 - 6 * (49 / 50) / (0.1 + 0.9 * (49 / 50))), 8),
    ("rex-flipped-triangular", 0, 2 + 8 - (8 - 6 * (0 / 50) / (0.1 + 0.9 * (0 / 50))), 2),
    ("rex-flipped-triangular", 12, 2 + 8 - (8 - 6 * (12 / 50) / (0.1 + 0.9 * (12 / 50))), 7),
    ("rex-flipped-triangular", 25, 2 + 8 - (8 - 6 * (25 / 50) / (0.1 + 0.9 * (25 / 50))), 7),
    ("rex-flipped-triangular", 49, 2 + 8 - (8 - 6 * (49 / 50) / (0.1 + 0.9 * (49 / 50))), 8),
    ("rex-flipped-triangular", 50, 2 + 8 - (8 - 6 * 1 / (0.1 + 0.9 * 1)), 8),  # 8.0
    ("rex-flipped-triangular", 75, 2 + 8 - (8 - 6 * (1 - 25 / 50) / (0.1 + 0.9 * (1 - 25 / 50))), 7),
    ("rex-flipped-triangular", 99, 2 + 8 - (8 - 6 * (1 - 49 / 50) / (0.1 + 0.9 * (1 - 49 / 50))), 3),  # 3.017
]


def test_hand_table_covers_every_schedule() -> None:
    assert sorted({name for name, *_ in HAND}) == sorted(NAMES)


@pytest.mark.parametrize(("name", "step", "exact", "bits"), HAND, ids=[f"{n}@{s}" for n, s, *_ in HAND])
def test_hand_computed_values(name: str, step: int, exact: float, bits: int) -> None:
    # The literal guards the arithmetic written out above as much as it guards the module.
    assert half_up(exact) == bits
    assert get(name, q_min=2, q_max=8, total_steps=100, n_cycles=2)(step) == bits


def test_names_are_the_twelve_in_order() -> None:
    assert names() == NAMES
    assert len(set(names())) == 12
    for name in names():
        assert get(name, 2, 8, 100, 2).name == name


@pytest.mark.parametrize("name", REPEATED)
def test_repeated_restarts_at_q_min_at_each_boundary(name: str) -> None:
    schedule = get(name, q_min=2, q_max=8, total_steps=100, n_cycles=4)  # T = 25
    for boundary in (0, 25, 50, 75, 100, 125):
        assert schedule(boundary) == 2
        if boundary:
            assert schedule(boundary - 1) > 2  # the drop really is a restart, not a plateau


@pytest.mark.parametrize("name", TRIANGULAR)
def test_triangular_is_continuous_at_boundaries(name: str) -> None:
    # With T = 50 steps and Δ = 6 bits even REX's steepest stretch (slope 10Δ at its top) moves the
    # unrounded value by about one bit per step, so neighbours across a boundary differ by <= 1.
    schedule = get(name, q_min=2, q_max=8, total_steps=200, n_cycles=4)
    for boundary in (50, 100, 150, 200, 250):
        assert abs(schedule(boundary) - schedule(boundary - 1)) <= 1, boundary


@pytest.mark.parametrize("name", TRIANGULAR)
def test_triangular_odd_cycle_mirrors_even_cycle(name: str) -> None:
    # Cycle 1 at position z is cycle 0 at position 1 - z: step 50 + j mirrors step 50 - j.
    schedule = get(name, q_min=2, q_max=8, total_steps=100, n_cycles=2)
    for offset in range(1, 50):
        assert schedule(50 + offset) == schedule(50 - offset)


def test_round_half_up_on_exact_ties() -> None:
    # linear, q 2..3, T = 2: step 1 is z = 1/2, S = 2.5 -> 3 (banker's rounding would give 2).
    assert get("linear-repeated", 2, 3, 2, 1)(1) == 3
    # cosine, q 2..8, T = 6: step 2 is z = 1/3, S = 2 + 3(1 - cos π/3) = 3.5 exactly, which floating
    # point computes as 3.4999999999999996; it must still round up to 4.
    assert half_up(2 + 0.5 * 6 * (1 - math.cos(math.pi * 2 / 6))) == 3  # the naive floor misses it
    assert get("cosine-repeated", 2, 8, 6, 1)(2) == 4


def test_fractional_period_uses_exact_cycle_positions() -> None:
    # total_steps=10, n_cycles=3: T = 10/3. Cycle k = floor(3t/10), z = (3t mod 10)/10.
    schedule = get("linear-repeated", q_min=1, q_max=11, total_steps=10, n_cycles=3)  # Δ = 10
    expected = {
        0: 1 + 10 * 0 / 10,  # k=0, z=0
        3: 1 + 10 * 9 / 10,  # k=0, z=0.9 (3 mod 3.33 = 3)
        4: 1 + 10 * 2 / 10,  # k=1, z=0.2 (4 - 3.33 = 0.67 = 0.2 T)
        6: 1 + 10 * 8 / 10,  # k=1, z=0.8
        7: 1 + 10 * 1 / 10,  # k=2, z=0.1
        9: 1 + 10 * 7 / 10,  # k=2, z=0.7
        10: 1 + 10 * 0 / 10,  # k=3, z=0: past the end, periodic
    }
    assert {step: schedule(step) for step in expected} == {step: half_up(s) for step, s in expected.items()}
    assert schedule.period == pytest.approx(10 / 3)


def test_exponential_stops_short_of_q_max_for_a_wide_range() -> None:
    # The published exponential ends a cycle at q_max - Δe^-4; with Δ = 32 that is 0.59 below q_max.
    exponential = get("exponential-repeated", q_min=1, q_max=33, total_steps=1000, n_cycles=1)
    assert half_up(33 - 32 * math.exp(-4 * 999 / 1000)) == 32
    assert max(exponential.values()) == 32
    # Its flip starts at q_min + Δe^-4 = 1.586, i.e. 2 bits, and REX reaches q_max.
    assert get("exponential-flipped-repeated", 1, 33, 1000, 1)(0) == 2
    assert max(get("rex-repeated", 1, 33, 1000, 1).values()) == 33


@st.composite
def schedule_args(draw: st.DrawFn, max_steps: int = 2000) -> tuple[str, int, int, int, int]:
    name = draw(st.sampled_from(NAMES))
    q_min = draw(st.integers(1, 16))
    q_max = draw(st.integers(q_min, q_min + 24))
    total_steps = draw(st.integers(1, max_steps))
    n_cycles = draw(st.integers(1, total_steps))
    return name, q_min, q_max, total_steps, n_cycles


@FAST
@given(args=schedule_args(), data=st.data())
def test_bits_stay_within_range(args: tuple[str, int, int, int, int], data: st.DataObject) -> None:
    name, q_min, q_max, total_steps, n_cycles = args
    schedule = get(*args)
    step = data.draw(st.integers(0, 3 * total_steps))
    assert q_min <= schedule(step) <= q_max
    assert isinstance(schedule(step), int)


@FAST
@given(args=schedule_args(max_steps=300))
def test_monotone_within_each_cycle(args: tuple[str, int, int, int, int]) -> None:
    name, q_min, q_max, total_steps, n_cycles = args
    schedule = get(*args)
    values = schedule.values()
    cycles = [step * n_cycles // total_steps for step in range(total_steps)]  # floor(t / T)
    for step in range(1, total_steps):
        if cycles[step] != cycles[step - 1]:
            continue
        growing = name.endswith("-repeated") or cycles[step] % 2 == 0
        if growing:
            assert values[step] >= values[step - 1], (step, values)
        else:
            assert values[step] <= values[step - 1], (step, values)


@FAST
@given(args=schedule_args(max_steps=500), data=st.data())
def test_steps_past_the_end_continue_periodically(args: tuple[str, int, int, int, int], data: st.DataObject) -> None:
    name, q_min, q_max, total_steps, n_cycles = args
    schedule = get(*args)
    step = data.draw(st.integers(0, total_steps - 1))
    # Two runs' worth of steps is an even number of cycles, so every schedule repeats after it.
    assert schedule(step + 2 * total_steps) == schedule(step)
    if name.endswith("-repeated") or n_cycles % 2 == 0:
        assert schedule(step + total_steps) == schedule(step)


def test_values_matches_calls() -> None:
    schedule = get("rex-flipped-triangular", 3, 9, 37, 5)
    assert schedule.values() == [schedule(step) for step in range(37)]
    assert len(schedule.values()) == 37


def test_schedule_is_a_frozen_value() -> None:
    schedule = get("cosine-repeated", 2, 8, 100, 2)
    assert (schedule.name, schedule.q_min, schedule.q_max, schedule.total_steps, schedule.n_cycles) == (
        "cosine-repeated",
        2,
        8,
        100,
        2,
    )
    assert schedule == Schedule("cosine-repeated", 2, 8, 100, 2)
    assert hash(schedule) == hash(Schedule("cosine-repeated", 2, 8, 100, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule.q_min = 4  # type: ignore[misc]


def test_module_is_pure_python() -> None:
    assert set(schedules.__all__) == {"Schedule", "average_cost", "cost_proxy", "get", "names", "suggest_q_min"}
    assert "torch" not in vars(schedules)


def test_cost_proxy_reference_points() -> None:
    assert cost_proxy(32, 32) == 1.0
    assert cost_proxy(8, 8) == 0.0625  # (64 + 128) / 3072
    assert cost_proxy(4, 8) == (4 * 4 + 2 * 4 * 8) / (3 * 32 * 32)
    assert cost_proxy(16, 8) == (16 * 16 + 2 * 16 * 8) / (3 * 32 * 32)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_average_cost_of_constant_schedule(name: str, bits: int) -> None:
    schedule = get(name, q_min=bits, q_max=bits, total_steps=50, n_cycles=3)
    assert schedule.values() == [bits] * 50
    assert average_cost(schedule, backward_bits=8) == pytest.approx(cost_proxy(bits, 8), rel=1e-15)


def test_average_cost_is_the_mean_over_the_run() -> None:
    schedule = get("linear-repeated", q_min=1, q_max=2, total_steps=2, n_cycles=1)
    assert schedule.values() == [1, 2]  # step 1: z = 1/2, S = 1.5 -> 2
    assert average_cost(schedule, 8) == pytest.approx(((1 + 16) + (4 + 32)) / 2 / 3072)


GOOD: dict[str, Any] = {"name": "cosine-repeated", "q_min": 2, "q_max": 8, "total_steps": 100, "n_cycles": 2}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"name": "cosine"}, r"name='cosine' is not a known schedule; valid names: cosine-repeated, .*rex-flipped-tri"),
        ({"name": "Cosine-Repeated"}, r"name='Cosine-Repeated' is not a known schedule"),
        ({"name": 3}, r"name=3 is not a known schedule"),
        ({"q_min": 0}, r"q_min=0 is not valid; must be an int >= 1"),
        ({"q_min": 2.0}, r"q_min=2.0 is not valid; must be an int >= 1"),
        ({"q_min": True}, r"q_min=True is not valid"),
        ({"q_max": 1}, r"q_max=1 is not valid; must be an int >= q_min \(2\)"),
        ({"q_max": "8"}, r"q_max='8' is not valid"),
        ({"total_steps": 0}, r"total_steps=0 is not valid; must be an int >= 1"),
        ({"total_steps": 100.0}, r"total_steps=100.0 is not valid"),
        ({"n_cycles": 0}, r"n_cycles=0 is not valid; must be an int >= 1"),
        ({"n_cycles": 101}, r"n_cycles=101 is not valid; must be <= total_steps \(100\)"),
        ({"n_cycles": None}, r"n_cycles=None is not valid"),
    ],
)
def test_bad_arguments_name_the_argument(override: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get(**{**GOOD, **override})
    with pytest.raises(ValueError, match=message):
        Schedule(**{**GOOD, **override})


@pytest.mark.parametrize("step", [-1, 1.0, True, "3", None])
def test_bad_step_names_the_argument(step: Any) -> None:
    schedule = get(**GOOD)
    with pytest.raises(ValueError, match=rf"step={step!r} is not valid; must be an int >= 0"):
        schedule(step)


@pytest.mark.parametrize(
    ("forward_bits", "backward_bits", "message"),
    [
        (0, 8, r"forward_bits=0 is not valid; must be an int >= 1"),
        (8.0, 8, r"forward_bits=8.0 is not valid"),
        (8, 0, r"backward_bits=0 is not valid; must be an int >= 1"),
        (8, -8, r"backward_bits=-8 is not valid"),
    ],
)
def test_bad_cost_arguments_name_the_argument(forward_bits: Any, backward_bits: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cost_proxy(forward_bits, backward_bits)


def test_bad_average_cost_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"backward_bits=0 is not valid; must be an int >= 1"):
        average_cost(get(**GOOD), 0)
    with pytest.raises(ValueError, match=r"schedule='cosine-repeated' is not valid; must be a Schedule"):
        average_cost("cosine-repeated", 8)  # type: ignore[arg-type]


def test_suggest_q_min_finds_where_training_starts_to_rise() -> None:
    accuracy = {2: 10.0, 3: 11.0, 4: 35.0, 5: 80.0, 6: 90.0}
    tried: list[int] = []

    def probe(bits: int) -> float:
        tried.append(bits)
        return accuracy[bits]

    assert schedules.suggest_q_min(probe, range(2, 7), baseline=10.0, rise=20.0) == 4
    assert tried == [2, 3, 4]  # stops at the answer
    assert schedules.suggest_q_min(probe, range(2, 7), baseline=10.0, rise=85.0) == 6  # none: the last
    with pytest.raises(ValueError, match="rise=-1"):
        schedules.suggest_q_min(probe, baseline=10.0, rise=-1)
    with pytest.raises(ValueError, match="candidates"):
        schedules.suggest_q_min(probe, (), baseline=10.0, rise=1.0)
