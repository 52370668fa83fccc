"""The fused update (one Triton launch) computes ``adaptive_update``, bit for bit, inf and nan
included; ``CompiledUpdate`` runs it where the device's form asks for it, and Inductor's code where
it does not or the state is beyond it. On a CPU the kernel runs in Triton's interpreter
(conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.runtime.jit import JITFunction

import autoscale
from autoscale.kernels import update as kernels_update
from autoscale.kernels.update import MAX_ROWS, fused_update
from autoscale.protocol import NUM_STATS, STAT
from autoscale.update import CompiledUpdate, UpdateTensors, adaptive_update
from tests.test_update import CONSTANTS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
special = st.sampled_from([0.0, math.inf, -math.inf, math.nan, 65504.0, 3.4e38, 2.0**-149])
magnitudes = st.one_of(special, st.floats(0.0, 1e6, width=32), st.floats(2.0**-126, 2.0**-100, width=32))
flags = st.one_of(st.sampled_from([0.0, 1.0]), special)


@st.composite
def states(draw: st.DrawFn) -> tuple[UpdateTensors, torch.Tensor | None]:
    """A scaler's update state with any rows and slots (none included), anything in its cells."""
    rows, slots = draw(st.integers(1, 40)), draw(st.integers(0, 20))

    def floats(n: int, values: st.SearchStrategy[float]) -> torch.Tensor:
        return torch.tensor(draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float32)

    stats = floats(rows * NUM_STATS, magnitudes).reshape(rows, NUM_STATS)
    stats[:, STAT["nonfinite"]] = floats(rows, flags)
    last = torch.zeros(rows, NUM_STATS)
    last[:, STAT["nonfinite"]] = floats(rows, flags)
    scales = 2.0 ** torch.tensor(draw(st.lists(st.integers(-24, 40), min_size=rows, max_size=rows)),
                                 dtype=torch.float32)
    scales[0] = 1.0
    state = UpdateTensors(
        scales, stats, last, floats(rows, st.integers(0, 5).map(float)), torch.tensor(float(draw(st.integers(0, 9)))),
        torch.tensor(draw(flags)), torch.tensor(draw(st.booleans())), floats(slots, magnitudes),
        floats(slots, st.sampled_from([0.5 * 65504, math.inf])), floats(slots, st.sampled_from([65504.0, math.inf])),
        torch.tensor(draw(st.lists(st.booleans(), min_size=slots, max_size=slots)), dtype=torch.bool),
        torch.zeros(slots + 2))
    bound = floats(rows, st.one_of(st.floats(0.0, 2.0**30, width=32), special)) if draw(st.booleans()) else None
    return state, bound


def _copy(state: UpdateTensors, bound: torch.Tensor | None, device: str | torch.device = DEVICE
          ) -> tuple[torch.Tensor | None, ...]:
    return (*(t.clone().to(device) for t in state), None if bound is None else bound.clone().to(device))


def _assert_same(fused: tuple[torch.Tensor | None, ...], eager: tuple[torch.Tensor | None, ...]) -> None:
    for name, a, b in zip((*UpdateTensors._fields, "bound"), fused, eager, strict=True):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), name
        assert torch.equal(a.signbit() | a.isnan(), b.signbit() | b.isnan()), name


@settings(max_examples=60, deadline=None)
@given(drawn=states(), due=st.booleans(), growth=st.sampled_from([1.0, 2.0, 4.0]))
def test_the_fused_update_is_adaptive_update(drawn: tuple[UpdateTensors, torch.Tensor | None], due: bool,
                                             growth: float) -> None:
    state, bound = drawn
    constants = {**CONSTANTS, "growth": growth}
    fused, eager = _copy(state, bound), _copy(state, bound)
    adaptive_update(*eager, due=due, **constants)
    launch = fused_update(fused, due=due, **constants)
    assert launch is not None
    launch(*(t for t in fused if t is not None))
    _assert_same(fused, eager)


@pytest.mark.parametrize("rows", [1, MAX_ROWS])
def test_the_fused_update_takes_one_row_to_the_most(rows: int) -> None:
    """The kernel's blocks at both ends of what it takes, every row measured, one overflowed."""
    state, _ = _state(rows)
    state.stats[:, STAT["amax"]] = torch.linspace(1e-6, 1e4, rows)
    state.stats[-1, STAT["nonfinite"]] = 1.0
    fused, eager = _copy(state, None), _copy(state, None)
    for due in (False, True):
        adaptive_update(*eager, due=due, **CONSTANTS)
        launch = fused_update(fused, due=due, **CONSTANTS)
        assert launch is not None
        launch(*(t for t in fused if t is not None))
        _assert_same(fused, eager)


def _compiled_for_a_gpu(x_ptr):  # type: ignore[no-untyped-def]
    pass


def test_a_state_beyond_the_kernel_is_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Too many rows, a layout the scaler does not make, or CPU tensors for a kernel compiled for a
    GPU (not interpreted): Inductor's update runs instead."""
    state, _ = _state(MAX_ROWS + 1)
    assert fused_update((*state, None), due=True, **CONSTANTS) is None
    rows, _ = _state(8)
    strided = rows._replace(scales=torch.ones(16)[::2])
    assert fused_update((*strided, None), due=True, **CONSTANTS) is None
    assert fused_update(_copy(rows, None), due=True, **CONSTANTS) is not None  # (on DEVICE: taken)
    monkeypatch.setattr(kernels_update, "_adaptive_update_kernel", JITFunction(_compiled_for_a_gpu))
    assert fused_update((*rows, None), due=True, **CONSTANTS) is None  # (on the CPU)


def _state(rows: int) -> tuple[UpdateTensors, None]:
    return UpdateTensors(torch.ones(rows), torch.zeros(rows, NUM_STATS), torch.zeros(rows, NUM_STATS),
                         torch.zeros(rows), torch.zeros(()), torch.zeros(()), torch.zeros((), dtype=torch.bool),
                         torch.zeros(3), torch.full((3,), math.inf), torch.full((3,), math.inf),
                         torch.zeros(3, dtype=torch.bool), torch.zeros(5)), None


@pytest.mark.parametrize("fewer_launches", [True, False])
def test_compiled_update_runs_the_fused_kernel_where_the_form_asks(fewer_launches: bool) -> None:
    """In the form laid out for a GPU's launch count (``Config(form="fewer_launches")``) the scaler's
    update is the one launch; in the default form, Inductor's code. A state beyond the kernel takes
    Inductor's code in either."""
    model = torch.nn.Linear(4, 4)
    config = autoscale.Config(form="fewer_launches" if fewer_launches else "default")
    scaler = autoscale.GradScaler(model, config)
    assert (scaler._update_scales._fused is not None) == fewer_launches
    built: list[bool] = []

    def fused(tensors: tuple[torch.Tensor | None, ...], **constants: float) -> object:
        launch = fused_update(tensors, **constants)  # type: ignore[arg-type]
        built.append(launch is not None)
        return launch

    for rows in (8, MAX_ROWS + 1):
        state = UpdateTensors(*(t.to(DEVICE) for t in _state(rows)[0]))
        state.stats[1:, STAT["amax"]] = 3.0
        eager = _copy(state, None, DEVICE)
        adaptive_update(*eager, due=True, **CONSTANTS)
        update = CompiledUpdate(adaptive_update, fused=fused if fewer_launches else None)
        ran = update((*state, None), variant=True, compile=True, due=True, **CONSTANTS)
        assert ran is not None and not update._failed
        assert ran.__qualname__.startswith("fused_update" if fewer_launches and rows == 8 else "_boxed"), rows
        _assert_same((*state, None), eager)
    assert built == ([True, False] if fewer_launches else [])
