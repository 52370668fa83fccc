"""The fused scale kernel against its pure-torch reference: natively on a GPU, and in the Triton
interpreter on CPU (conftest.py sets TRITON_INTERPRET=1 when there is no GPU).

Outputs and counts must match exactly; the sums to float32 rounding (the kernel adds per-block
partial sums atomically, in another order).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoscale.measure
from autoscale.kernels.reference import STATS, pack, scale_grad_reference
from autoscale.kernels.scale_grad import BLOCK, Launch, scale_grad_triton
from autoscale.measure import Measured, largest, max_scale, scale_and_measure, taken
from autoscale.ops import rescale
from autoscale.protocol import ARRIVED, BAD, FORMS, LOSS_ROW, MADE, NUM_STATS, PEAK, STAT, Form

SPECIAL = [0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-25, 6.1e-5, 65504.0, -65504.0, 65519.0, 1e-3,
           float("inf"), float("-inf"), float("nan")]
DEFAULT = FORMS["default"]
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _check(grad: torch.Tensor, factor: float, carried: float, launch: Launch | None = None) -> None:
    f, c = torch.tensor(factor, device=grad.device), torch.tensor(carried, device=grad.device)
    out, stats = scale_grad_triton(grad, f * c, c, **({} if launch is None else {"launch": launch}))
    ref_out, ref_fstats, ref_counts = scale_grad_reference(grad, f, c)
    assert out.dtype == grad.dtype and out.shape == grad.shape
    assert stats.dtype == torch.float64 and stats.shape == (len(STATS),)
    assert torch.equal(out, ref_out)
    assert stats[3:].tolist() == ref_counts.tolist()
    fstats = stats[:3].float()
    assert fstats[0].item() == ref_fstats[0].item()  # a max: exact
    # Sums agree to float32 rounding: a float32 sum of n terms in any order is within
    # n·2⁻²³·Σ|term| of the exact one (the kernel adds per-program partial sums, in another order).
    g = grad.double().cpu()
    safe = torch.where(torch.isfinite(g), g, 0.0) / carried
    for i, terms in ((1, safe.abs()), (2, safe * safe)):
        bound = 2 * g.numel() * 2.0**-23 * float(terms.sum())
        assert abs(fstats[i].item() - ref_fstats[i].item()) <= bound, (i, fstats, ref_fstats)


values = st.one_of(st.floats(width=16, allow_nan=True, allow_infinity=True), st.sampled_from(SPECIAL))
sizes = st.one_of(st.sampled_from([0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5]), st.integers(0, 2500))


# The kernel property tests' settings. too_slow: on a GPU the first call JITs, and 64-value lists are
# slow to draw; filter_too_much: a 64-value list of float16s now and then overruns Hypothesis's
# buffer, which it counts as a filtered input (seen in full runs, in each of the three tests).
KERNEL_PROPERTIES = settings(max_examples=60, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@KERNEL_PROPERTIES
@given(size=sizes, data=st.data(), dtype=st.sampled_from([torch.float16, torch.float32]),
       factor=st.sampled_from([1.0, 2.0**10, 2.0**-10, 2.0**24, 2.0**-20]),
       carried=st.sampled_from([1.0, 2.0**15, 2.0**-3]))
def test_kernel_matches_reference(size: int, data: st.DataObject, dtype: torch.dtype, factor: float,
                                  carried: float) -> None:
    fill = data.draw(st.lists(values, min_size=min(size, 64), max_size=min(size, 64)))
    base = torch.tensor(fill or [0.0], dtype=torch.float32)
    grad = base.repeat(size // max(len(base), 1) + 1)[:size].to(dtype)
    _check(grad.to(DEVICE), factor, carried)


@KERNEL_PROPERTIES
@given(size=sizes, data=st.data(), dtype=st.sampled_from([torch.float16, torch.float32]),
       factor=st.sampled_from([1.0, 2.0**10, 2.0**-10, 2.0**24, 2.0**-20]),
       carried=st.sampled_from([1.0, 2.0**15, 2.0**-3]))
def test_cpu_path_measures_what_the_reference_counts(size: int, data: st.DataObject, dtype: torch.dtype,
                                                     factor: float, carried: float) -> None:
    """The lean CPU path measures one maximum instead of counting: its value reads as the oracle's
    counts and maximum do (every mode takes the same of both), with the same output and statistics."""
    fill = data.draw(st.lists(values, min_size=min(size, 64), max_size=min(size, 64)))
    base = torch.tensor(fill or [0.0], dtype=torch.float32)
    grad = base.repeat(size // max(len(base), 1) + 1)[:size].to(dtype)
    f, c = torch.tensor(factor), torch.tensor(carried)
    out, m = scale_and_measure(grad, f * c, c, DEFAULT, moments=True, zeros=True)
    ref_out, fstats, counts = scale_grad_reference(grad, f, c)
    assert torch.equal(out, ref_out)
    assert m.total is not None and m.squares is not None and m.zeros is not None
    assert [m.total.item(), m.squares.item(), m.zeros.item()] == [*fstats[1:].tolist(), counts[2].item()]
    _reads_alike(m.value, Measured.from_stats(pack(fstats, counts), leaving=False).value)
    lean = scale_and_measure(grad, f * c, c, DEFAULT)[1]  # (what a point records by default: the same, and no more)
    assert lean.total is None and lean.squares is None and lean.zeros is None
    assert torch.equal(lean.value, m.value) or (lean.value.isnan() and m.value.isnan())


def test_a_float32_gradient_scaled_past_its_range_reads_as_made() -> None:
    """A float32 gradient the point's factor lifts past float32's range (a gradient of the loss
    scaled by 1e38) overflowed at the point: its value reads as "made", as the oracle counts it."""
    grad, f, c = torch.tensor([1e37, -2.0]), torch.tensor(2.0**10), torch.tensor(2.0**-3)
    out, m = scale_and_measure(grad, f * c, c, DEFAULT)
    ref_out, fstats, counts = scale_grad_reference(grad, f, c)
    assert torch.equal(out, ref_out)
    _reads_alike(m.value, Measured.from_stats(pack(fstats, counts), leaving=False).value)
    assert taken(MADE, m.value).item() == 1.0


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3), data=st.data())
def test_largest_is_the_max_of_every_element_as_one_element(shape: list[int], data: st.DataObject) -> None:
    """``largest`` (how a point or a check hands its peak to the fold) is ``amax`` over every
    element, nan and inf carried through, as a one-element vector; 0 for no element."""
    n = math.prod(shape)
    x = torch.tensor(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float32).view(shape)
    peak = largest(x, DEFAULT)
    assert peak.shape == (1,)
    expected = x.amax() if n else torch.tensor(0.0)
    assert torch.equal(peak.isnan(), expected.isnan().view(1))
    assert torch.equal(peak.nan_to_num(), expected.nan_to_num().view(1))


def _reads_alike(value: torch.Tensor, expected: torch.Tensor) -> None:
    """Every mode takes the same of both values (nan and inf both read as 'arrived non-finite')."""
    for mode in (PEAK, ARRIVED, MADE, BAD):
        assert taken(mode, value).item() == taken(mode, expected).item(), mode


@KERNEL_PROPERTIES
@given(size=sizes, data=st.data(), dtype=st.sampled_from([torch.float16, torch.float32]),
       factor=st.sampled_from([1.0, 2.0**10, 2.0**-10, 2.0**24, 2.0**-20]),
       carried=st.sampled_from([1.0, 2.0**15, 2.0**-3]))
def test_cpu_path_for_a_leaving_gradient_measures_its_output(size: int, data: st.DataObject, dtype: torch.dtype,
                                                             factor: float, carried: float) -> None:
    """A gradient leaving the graph (``leaving=True``) is handed back unguarded and measured as the
    reference measures a gradient that carries the output's scale. For float32 parameter
    gradients of float16 values, that is what measuring the arriving gradient gives."""
    fill = data.draw(st.lists(values, min_size=min(size, 64), max_size=min(size, 64)))
    base = torch.tensor(fill or [0.0], dtype=torch.float32)
    grad = base.repeat(size // max(len(base), 1) + 1)[:size].to(dtype)
    f, c = torch.tensor(factor), torch.tensor(carried)
    out, m = scale_and_measure(grad, f * c, c, DEFAULT, leaving=True, moments=True, zeros=True)
    torch.testing.assert_close(out, (grad.float() * f).to(dtype), rtol=0, atol=0, equal_nan=True)  # exactly
    _, fstats, counts = scale_grad_reference(out, torch.tensor(1.0), f * c)
    assert m.total is not None and m.squares is not None and m.zeros is not None
    assert [m.total.item(), m.squares.item(), m.zeros.item()] == [*fstats[1:].tolist(), counts[2].item()]
    _reads_alike(m.value, Measured.from_stats(pack(fstats, counts), leaving=True).value)
    assert taken(MADE, m.value).item() == 0.0  # (a leaving gradient's non-finite values all read as arrived)
    if dtype == torch.float32:
        _, fstats_in, counts_in = scale_grad_reference(grad, f, c)
        _reads_alike(m.value, Measured.from_stats(pack(fstats_in, counts_in), leaving=True).value)
        assert int(m.zeros) == int(counts_in[2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_special_cases(dtype: torch.dtype) -> None:
    _check(torch.zeros(BLOCK + 3, dtype=dtype, device=DEVICE), 2.0**8, 1.0)          # all zeros
    _check(torch.tensor([2.0**-24], dtype=dtype, device=DEVICE), 2.0**-1, 1.0)       # subnormal underflows
    _check(torch.tensor([60000.0, -60000.0], dtype=dtype, device=DEVICE), 2.0, 1.0)  # fp16 overflow made
    _check(torch.tensor([float("inf"), float("nan"), 1.0], dtype=dtype, device=DEVICE), 1.0, 4.0)
    _check(torch.empty(0, dtype=dtype, device=DEVICE), 2.0, 1.0)
    # more blocks than programs: each program strides over several (the persistent loop)
    _check((torch.randn(9 * BLOCK + 7) * 1e-6).to(dtype).to(DEVICE), 2.0**-4, 2.0**3)


@pytest.mark.parametrize("launch", [Launch(256, 2, 1), Launch(2048, 8, 2), Launch(4096, 4, 16)],
                         ids=lambda s: f"{s.block}x{s.num_warps}x{s.programs_per_sm}")
def test_every_launch_shape_computes_the_same(launch: Launch) -> None:
    """``benchmarks.kernel_bandwidth --sweep`` times launch shapes; each must compute the reference's
    result, the elements counted once whatever the number of programs."""
    grad = torch.randn(5 * 4096 + 3) * 1e-4
    grad[::97] = 0.0
    grad[7], grad[4096 + 1] = float("inf"), 2.0**-24
    _check(grad.half().to(DEVICE), 2.0**-2, 2.0**3, launch)


def test_launch_shapes_are_validated() -> None:
    with pytest.raises(ValueError, match="block must be a power of two"):
        Launch(block=1000)
    with pytest.raises(ValueError, match="programs_per_sm"):
        Launch(programs_per_sm=0)


def test_counts_mean_what_they_say() -> None:
    g = torch.tensor([0.0, 2.0**-24, 1.0, 40000.0, float("inf")], dtype=torch.float16)
    out, _, counts = scale_grad_reference(g, torch.tensor(2.0**-1), torch.tensor(1.0))
    arrived, elements, zeros, made, underflowed = counts.tolist()
    assert (arrived, elements, zeros, made, underflowed) == (1, 5, 1, 0, 1)
    out, _, counts = scale_grad_reference(g, torch.tensor(2.0), torch.tensor(1.0))
    assert counts[3].item() == 1 and out[3].item() == 0.0  # 80000 overflows float16: zeroed


def test_op_has_fake_impl_and_reference_cpu_path() -> None:
    """``autoscale::scale_grad`` traces under fake tensors and runs the reference on CPU."""
    g = torch.tensor([1.0, 0.0, 2.0**-24], dtype=torch.float16)
    scale, c = torch.tensor(0.5), torch.tensor(2.0)
    out, stats = torch.ops.autoscale.scale_grad(g, scale, c)
    ref = scale_grad_reference(g, scale / c, c)
    assert torch.equal(out, ref[0]) and torch.equal(stats, pack(*ref[1:]))
    with torch._subclasses.FakeTensorMode() as mode:
        fake_out, fake_stats = torch.ops.autoscale.scale_grad(
            mode.from_tensor(g), mode.from_tensor(scale), mode.from_tensor(c))
    assert fake_out.shape == g.shape and fake_stats.dtype == torch.float64 and fake_stats.shape == (len(STATS),)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(0, 5), max_size=5))
def test_set_scale_hands_a_sets_largest_scale_in_a_storage_of_its_own(rows: list[int]) -> None:
    """``autoscale::set_scale`` (one set's scale: what a point reads when traced, and computes where
    no pass gathers the reads): the set's largest scale as ``max_scale`` computes it eagerly (the loss
    row's and an empty set's 1), in a storage of its own as the schema promises, and a fake impl."""
    scales = torch.tensor([1.0, 2.0**15, 0.5, 2.0**-3, 8.0, 3.0])
    largest = autoscale.ops.set_scale(scales, rows)
    assert largest.dim() == 0 and largest.item() == max_scale(scales, tuple(rows)).item()
    assert largest.untyped_storage().data_ptr() != scales.untyped_storage().data_ptr()
    torch.library.opcheck(torch.ops.autoscale.set_scale.default, (scales, rows))


def test_a_point_takes_the_loss_rows_scale_as_one_without_reading_it() -> None:
    """The loss row's scale is 1 by construction (``LOSS_ROW``): eagerly a point never reads it (here
    it is nan, which any read would carry through), and takes it as 1 in a largest-of; read with a
    select or with ``set_scale``'s own implementation, alike. (A compiled graph's reductions read it,
    as the 1 it is: tests/passes/test_batch_row_reads.py.)"""
    scales = torch.tensor([math.nan, 4.0, 0.5])
    assert LOSS_ROW == 0
    for read in (lambda rows: max_scale(scales, rows), lambda rows: autoscale.ops.set_scale(scales, list(rows))):
        assert read((0,)).item() == 1.0 and read(()).item() == 1.0
        assert read((0, 2)).item() == 1.0 and read((0, 1)).item() == 4.0
        assert read((2,)).item() == 0.5 and read((1, 2)).item() == 4.0


def _through_rescale(grad: torch.Tensor, scales: list[float], out_rows: tuple[int, ...], in_rows: tuple[int, ...],
                     *, unscale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad`` back through one eager rescale point: (the gradient it hands on, the stats it wrote)."""
    stats = torch.zeros(len(scales), NUM_STATS)
    x = torch.zeros(grad.shape, dtype=grad.dtype, requires_grad=True)
    rescale(x, torch.tensor(scales), stats, out_rows, in_rows, out_rows + in_rows, unscale=unscale).backward(grad)
    assert x.grad is not None
    return x.grad, stats


def test_an_unmeasured_rescale_point_only_multiplies() -> None:
    """``measured=False`` (a float32 gradient's alignment): the gradient comes back times the factor,
    exactly, non-finite values included, and nothing is recorded; it takes no rows to record into."""
    scales, stats = torch.tensor([1.0, 2.0**-3, 2.0**5]), torch.zeros(3, NUM_STATS)
    grad = torch.tensor([1.5, -3e-30, float("inf"), float("nan")])
    x = torch.zeros(4, requires_grad=True)
    rescale(x, scales, stats, (1, 2), (1,), measured=False).backward(grad)
    assert x.grad is not None
    expected = grad * 2.0**8  # max(2^-3, 2^5) / 2^-3
    assert torch.equal(x.grad[:2], expected[:2]) and x.grad[2] == math.inf and x.grad[3].isnan()
    assert not stats.any()
    with pytest.raises(ValueError, match="records nothing"):
        rescale(x, scales, stats, (1, 2), (1,), (1, 2), measured=False)


def test_rescale_blames_non_finite_values_on_the_scale_that_made_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 1 sends the gradient (in_rows), row 2 is the point's own scale (out_rows)."""
    nonfinite = STAT["nonfinite"]
    arrived = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    out, stats = _through_rescale(arrived, [1.0, 1.0, 2.0], (2,), (1,), unscale=False)
    assert stats[:, nonfinite].tolist() == [0.0, 1.0, 0.0] and out.tolist() == [2.0, 0.0]  # zeroed below
    out, stats = _through_rescale(torch.tensor([1.0, 40000.0], dtype=torch.float16), [1.0, 1.0, 2.0], (2,), (1,),
                                  unscale=False)
    assert stats[:, nonfinite].tolist() == [0.0, 0.0, 1.0] and out.tolist() == [2.0, 0.0]  # made here
    # an unscale point (to row 0): on CPU the gradient leaves as is and its inf is the layer's
    out, stats = _through_rescale(arrived, [1.0, 4.0], (0,), (1,), unscale=True)
    assert stats[:, nonfinite].tolist() == [0.0, 1.0] and out.tolist() == [0.25, float("inf")]
    # what CUDA's kernel reports apart, an overflow the unscale made (a float16 parameter's gradient
    # whose layer scale fell below 1), is the layer's too, not lost
    def like_cuda(grad: torch.Tensor, scale: torch.Tensor, carried: torch.Tensor, form: Form, *, leaving: bool = False,
                  moments: bool = False, zeros: bool = False, fused: bool = True) -> tuple[torch.Tensor, Measured]:
        out, fstats, counts = scale_grad_reference(grad, scale / carried, carried)
        return out, Measured.from_stats(pack(fstats, counts), leaving=leaving)
    monkeypatch.setattr(autoscale.measure, "scale_and_measure", like_cuda)
    out, stats = _through_rescale(torch.tensor([1.0, 40000.0], dtype=torch.float16), [1.0, 0.5], (0,), (1,),
                                  unscale=True)
    assert stats[:, nonfinite].tolist() == [0.0, 1.0]
