"""The scale update as a device function: compiled (one Inductor kernel) equals eager, bit for bit;
a compiled variant that disagrees is dropped for the eager function; the rule's power of two is
exact; the host mirror hands snapshots back in order, without waiting on a CPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscale.mirror import HostMirror
from autoscale.protocol import NUM_STATS, STAT
from autoscale.update import CompiledUpdate, UpdateTensors, _boxed, adaptive_update, pow2floor

ROWS, SITES = 6, 5
CONSTANTS = {"backoff": 0.5, "repeated_backoff": 2.0**-6, "growth": 2.0, "high": 2.0**40, "headroom": 65504 / 64}


def _state(amax: list[float], flags: list[bool], last_flags: list[bool], peaks: list[float], found: bool
           ) -> UpdateTensors:
    stats = torch.zeros(ROWS, NUM_STATS)
    stats[:, STAT["amax"]] = torch.tensor(amax)
    stats[:, STAT["nonfinite"]] = torch.tensor(flags, dtype=torch.float32)
    stats[:, STAT["numel"]] = 100.0
    last = torch.zeros(ROWS, NUM_STATS)
    last[:, STAT["nonfinite"]] = torch.tensor(last_flags, dtype=torch.float32)
    low = torch.tensor([0.5 * 65504, 0.5 * 65504, math.inf, 0.5 * 65504, math.inf])
    high = torch.tensor([math.inf, 65504.0, math.inf, math.inf, math.inf])
    return UpdateTensors(2.0 ** torch.arange(ROWS, dtype=torch.float32), stats, last, torch.zeros(ROWS),
                         torch.zeros(()), torch.tensor(float(found)), torch.zeros((), dtype=torch.bool),
                         torch.tensor(peaks), low, high, torch.tensor([False, False, True, False, False]),
                         torch.zeros(SITES + 2))


magnitudes = st.one_of(st.just(0.0), st.floats(2.0**-100, 1e6, width=32))
peak_values = st.one_of(st.floats(0, 1e5, width=32), st.sampled_from([math.inf, math.nan, 65504.0, 3.4e38]))
COMPILED = CompiledUpdate(adaptive_update)  # (compiled once, reused: one variant per `due`)


@settings(max_examples=40, deadline=None)
@given(amax=st.lists(magnitudes, min_size=ROWS, max_size=ROWS), flags=st.lists(st.booleans(), min_size=ROWS,
       max_size=ROWS), last_flags=st.lists(st.booleans(), min_size=ROWS, max_size=ROWS),
       peaks=st.lists(peak_values, min_size=SITES, max_size=SITES), found=st.booleans(), due=st.booleans())
def test_compiled_update_equals_the_eager_function(amax: list[float], flags: list[bool], last_flags: list[bool],
                                                   peaks: list[float], found: bool, due: bool) -> None:
    eager, compiled = (_state(amax, flags, last_flags, peaks, found) for _ in range(2))
    CompiledUpdate(adaptive_update)((*eager, None), variant=due, compile=False, due=due, **CONSTANTS)
    ran = COMPILED((*compiled, None), variant=due, compile=True, due=due, **CONSTANTS)
    assert not COMPILED._failed and ran is not None
    assert ran.__qualname__.startswith("_boxed")  # (Inductor's output code, called directly)
    for name, a, b in zip(UpdateTensors._fields, compiled, eager, strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), name


@pytest.mark.parametrize("layer", ["compile_fx", "compile_fx_inner"])
def test_a_compiled_variant_that_disagrees_is_dropped(layer: str, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """If Inductor compiled the update wrongly (seen once while writing it), the first call's check
    keeps the eager results, warns, and every later call runs eagerly: whether the wrong code is
    what ``compile_fx`` returns (called when no single output code was caught) or the output code
    that ``compile_fx_inner`` made (called directly)."""
    import torch._inductor.compile_fx as compile_fx

    def wrong(args: list[torch.Tensor]) -> None:
        args[0].add_(1.0)  # scales: wrong
        args.clear()

    def miscompiled_fx(gm: torch.fx.GraphModule, inputs: list[torch.Tensor], **kwargs: object) -> object:
        return lambda *tensors: wrong(list(tensors))  # (a wrapper: never calls the inner compiler)

    def miscompiled_inner(gm: torch.fx.GraphModule, inputs: list[torch.Tensor], **kwargs: object) -> object:
        return wrong

    monkeypatch.setattr(compile_fx, layer, miscompiled_fx if layer == "compile_fx" else miscompiled_inner)
    update = CompiledUpdate(adaptive_update)
    state, reference = (_state([1.0] * ROWS, [False] * ROWS, [False] * ROWS, [0.0] * SITES, False) for _ in range(2))
    assert update((*state, None), variant=True, compile=True, due=True, **CONSTANTS) is None
    CompiledUpdate(adaptive_update)((*reference, None), variant=True, compile=False, due=True, **CONSTANTS)
    assert all(torch.equal(a, b) for a, b in zip(state, reference, strict=True))
    assert update._failed and "differ from the eager function" in caplog.text


def test_a_variant_called_on_other_layouts_compiles_for_them() -> None:
    """A variant is compiled without Inductor's size asserts, so tensors of another shape (here:
    twice the forward sites) must get code of their own, not the first shape's."""
    update = CompiledUpdate(adaptive_update)
    peaks = [70000.0, 1.0, 2.0, 3.0, 4.0]
    first = _state([1.0] * ROWS, [False] * ROWS, [False] * ROWS, peaks, False)
    assert update((*first, None), variant=True, compile=True, due=True, **CONSTANTS) is not None
    wider = [_state([1.0] * ROWS, [False] * ROWS, [False] * ROWS, peaks, False) for _ in range(2)]
    for t in wider:  # (every per-site tensor twice as long: the second half's sites see nothing)
        for name in ("peaks", "alarm_low", "alarm_high", "outputs"):
            old = getattr(t, name)
            getattr(t, name).set_(torch.cat([old, torch.zeros_like(old) if name in ("peaks", "outputs")
                                             else torch.full_like(old, math.inf)]))
        t.snapshot.set_(torch.zeros(2 * SITES + 2))
    ran = update((*wider[0], None), variant=True, compile=True, due=True, **CONSTANTS)
    CompiledUpdate(adaptive_update)((*wider[1], None), variant=True, compile=False, due=True, **CONSTANTS)
    assert ran is not None and len(update._variants) == 2
    for name, a, b in zip(UpdateTensors._fields, *wider, strict=True):
        assert torch.equal(a, b), name


def test_the_output_code_is_called_through_its_wrapper_once_then_directly() -> None:
    """``_boxed``: the first call goes through the output code's ``__call__``, which closes its
    compile's bookkeeping; later calls go straight to the generated module's ``call`` it wraps
    (``current_callable``). Output code without one is called as it is, every time."""
    calls: list[tuple[str, int]] = []

    class OutputCode:
        def __init__(self) -> None:
            self.current_callable = lambda args: calls.append(("module", len(args)))

        def __call__(self, args: list[torch.Tensor]) -> None:
            calls.append(("output code", len(args)))
            self.current_callable(args)

    t = torch.zeros(1)
    run = _boxed(OutputCode())
    for _ in range(3):
        run(t, t)
    assert calls == [("output code", 2), ("module", 2), ("module", 2), ("module", 2)]
    calls.clear()
    plain = _boxed(lambda args: calls.append(("plain", len(args))))
    plain(t)
    plain(t)
    assert calls == [("plain", 1), ("plain", 1)]


def test_pow2floor_is_exact_around_powers_of_two() -> None:
    """The rule's power of two is exact even where ``log2`` rounds the wrong way (compiled and
    eager ``log2`` may differ in the last bit): just below, at, and just above each power."""
    powers = torch.tensor([2.0**k for k in range(-30, 60)])
    for x, want in ((powers, powers), (torch.nextafter(powers, powers * 2), powers),
                    (torch.nextafter(powers, powers * 0), powers * 0.5)):
        assert torch.equal(pow2floor(x), want)


def test_host_mirror_hands_copies_back_in_order_and_reuses_its_buffers() -> None:
    """On a CPU the device writes into a host buffer directly (no copy), and ``poll`` hands each
    back at once, in order; a buffer read is free again for the next ``destination``."""
    mirror = HostMirror()
    device = torch.device("cpu")
    seen = []
    for step in range(3):
        target = mirror.destination(4, device)
        target.fill_(step)
        mirror.post(target)
        seen += [b.tolist() for b in mirror.poll()]
    assert seen == [[0.0] * 4, [1.0] * 4, [2.0] * 4]
    (free,) = mirror.buffers()  # (one buffer, reused)
    assert list(mirror.values(free)) == [2.0] * 4  # (read in place, as Python floats)
    free[-1] = 5.0
    assert mirror.values(free)[-1] == 5.0
    assert mirror.destination(4, device) is free
