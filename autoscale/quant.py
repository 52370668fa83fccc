"""Fake quantization for cyclic precision training, and float8 with per-node scales.

The functions here are what ``autoscale/passes/dynamo/insert_fake_quant.py`` puts in the graph. They are plain
torch (as ``ops.rescale`` is): AOTAutograd traces them into ATen, so Inductor fuses them into the
kernels around them, and their arithmetic is its own test oracle.

Quantizers (docs/design.md#quantizers) are min/max uniform affine, with the range widened to include 0 so that
zero (ReLU outputs, padding) stays exact, and the bit-width a runtime tensor (``2**bits - 1``
levels), so that a precision schedule changes it every step without recompiling:

* weights (``fake_quant_weight``): per output channel (dim 0), from the weight's own min/max;
* activations (``fake_quant_activation``): per tensor, from a running min/max (exponential moving
  average, ``momentum`` 0.9, initialized from the first batch) kept in the model's buffers; frozen
  in eval mode;
* both with a straight-through estimator: the backward passes the gradient through unchanged;
* gradients (``quant_grad``): identity forward; the backward quantizes the arriving gradient per
  tensor at fixed bits with stochastic rounding (unbiased: E[Q(g)] = g), as CPT's backward does.

Float8 (``Config(dtype="float8")``), simulated: a GEMM's inputs are rounded to E4M3 with a
per-tensor scale from their current max (Transformer Engine's "current scaling", with a power of
two so that applying and undoing it is exact), saturating at ±448 as the format has no infinity
(``float8_forward``); the gradient arriving at a GEMM's output is rounded to E5M2 after its
layer's scale point has scaled it (``float8_grad``); E5M2 has an infinity, and an overflow becomes
one, which the scaler sees and skips.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from autoscale.ops import attach_quant, identity_output
from autoscale.protocol import E4M3_MAX, E5M2_MAX, LAYOUT_SEP
from autoscale.runtime import announce_in_forward, unwrap
from autoscale.schedules import Schedule

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "FakeQuant",
    "affine_quantize",
    "fake_quant_activation",
    "fake_quant_weight",
    "float8_forward",
    "float8_grad",
    "quant_grad",
]

log = logging.getLogger("autoscale")

_BITS, _RANGES = "_autoscale_qbits", "_autoscale_qranges"
_STATE_ATTR = "_autoscale_quant"
SLOTS = 2  # activation quantizers per module: a GEMM reads at most two activations (q·kᵀ)


# ---------------------------------------------------------------------------------- quantizers


def affine_quantize(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: torch.Tensor,
                    noise: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` rounded to ``2**bits`` evenly spaced levels spanning ``[min(lo, 0), max(hi, 0)]``, in
    float32. Nearest rounding, or ``floor(t + noise)`` (stochastic rounding when ``noise`` is
    uniform in [0, 1)). Values outside the range clamp to its ends."""
    x = x.float()
    levels = torch.exp2(bits.float()) - 1
    lo, hi = torch.clamp(lo.float(), max=0.0), torch.clamp(hi.float(), min=0.0)
    step = torch.clamp((hi - lo) / levels, min=torch.finfo(torch.float32).tiny)
    zero = torch.round(-lo / step)
    t = x / step + zero
    q = torch.round(t) if noise is None else torch.floor(t + noise)
    return (torch.minimum(torch.clamp(q, min=0.0), levels) - zero) * step


def _straight_through(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``q`` in the forward, the identity in the backward."""
    return x + (q.to(x.dtype) - x).detach()


def fake_quant_weight(w: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """A weight quantized per output channel (dim 0) from its own min/max; straight-through."""
    flat = w.detach().float().flatten(1)
    shape = (-1,) + (1,) * (w.dim() - 1)
    lo, hi = flat.amin(1).view(shape), flat.amax(1).view(shape)
    return _straight_through(w, affine_quantize(w.detach(), lo, hi, bits))


def fake_quant_activation(x: torch.Tensor, ranges: torch.Tensor, row: int, bits: torch.Tensor, momentum: float,
                          training: bool) -> torch.Tensor:
    """An activation quantized per tensor from the running range in ``ranges[row]`` (lo, hi,
    seen), which training updates in place: ``r ← momentum·r + (1 - momentum)·current``, or the
    current range on the first batch. Straight-through."""
    current = x.detach().float()
    if training:
        seen = ranges[row, 2] > 0
        lo = torch.where(seen, momentum * ranges[row, 0] + (1 - momentum) * current.amin(), current.amin())
        hi = torch.where(seen, momentum * ranges[row, 1] + (1 - momentum) * current.amax(), current.amax())
        ranges[row] = torch.stack([lo, hi, torch.ones_like(lo)])
    else:
        lo, hi = ranges[row, 0], ranges[row, 1]
    return _straight_through(x, affine_quantize(current, lo, hi, bits))


class _QuantGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, bits: int) -> torch.Tensor:
        ctx.bits = bits
        return identity_output(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = grad.float()
        bits = torch.full((), float(ctx.bits), device=g.device)
        q = affine_quantize(g, g.amin(), g.amax(), bits, noise=torch.rand_like(g))
        return q.to(grad.dtype), None


def quant_grad(y: torch.Tensor, bits: int) -> torch.Tensor:
    """Identity forward; backward: the arriving gradient quantized per tensor at ``bits`` with
    stochastic rounding."""
    out: torch.Tensor = _QuantGrad.apply(y, bits)
    return out


def _float8(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, saturate: bool) -> torch.Tensor:
    """``x·scale`` rounded to ``dtype`` and scaled back, in ``x``'s dtype."""
    scaled = x.float() * scale
    if saturate:
        fmax = torch.finfo(dtype).max
        scaled = torch.clamp(scaled, min=-fmax, max=fmax)
    return (scaled.to(dtype).float() / scale).to(x.dtype)


def float8_forward(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to E4M3 with a per-tensor power-of-two scale putting its max near 448
    (current scaling), saturating; straight-through."""
    amax = x.detach().float().abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return _straight_through(x, _float8(x.detach(), torch.float8_e4m3fn, scale, saturate=True))


class _Float8Grad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        return identity_output(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _float8(grad, torch.float8_e5m2, torch.ones((), device=grad.device), saturate=False)


def float8_grad(y: torch.Tensor) -> torch.Tensor:
    """Identity forward; backward: the arriving (already scaled) gradient rounded to E5M2, where
    an overflow becomes inf."""
    out: torch.Tensor = _Float8Grad.apply(y)
    return out


# ------------------------------------------------------------------------------- runtime state


class FakeQuant:
    """Fake quantization's runtime state on a model, and the precision schedule that drives it.

    Create it before the model's first forward (as ``GradScaler``), compile the model with a
    ``Config(quant=QuantConfig(...))``, and call ``step(t)`` (or ``set_bits``) before each training
    step. The forward bit-width is a buffer of the model: changing it never recompiles.

        quant = autoscale.FakeQuant(model, schedule=autoscale.schedules.get("cosine-repeated", 3, 8, steps, 8))
        run = torch.compile(model, backend=autoscale.backend(autoscale.Config(quant=autoscale.QuantConfig())))
        for t, (x, y) in enumerate(data):
            quant.step(t)
            ...
    """

    def __init__(self, model: nn.Module, *, schedule: Schedule | None = None, bits: int = 8) -> None:
        root = unwrap(model)
        if getattr(root, _STATE_ATTR, None) is not None:
            raise ValueError("this model already has an autoscale.FakeQuant; create one per model")
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 24:
            raise ValueError(f"FakeQuant bits={bits!r} is not valid; it must be an int in [1, 24]")
        self.schedule = schedule
        names = [name for name, _ in root.named_modules()]
        self.layout = LAYOUT_SEP.join(names)
        device = next((p.device for p in root.parameters()), torch.device("cpu"))
        root.register_buffer(_BITS, torch.full((), float(bits), device=device), persistent=False)
        root.register_buffer(_RANGES, torch.zeros(len(names) * SLOTS, 3, device=device), persistent=False)
        object.__setattr__(root, _STATE_ATTR, self)
        self._root = root
        announce_in_forward(model, lambda m: attach_quant(
            getattr(m, _BITS), getattr(m, _RANGES), self.layout, m.training))
        if schedule is not None:
            self.step(0)

    @property
    def bits(self) -> int:
        """The forward bit-width the next step uses."""
        return int(getattr(self._root, _BITS).item())

    def set_bits(self, bits: int) -> None:
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 24:
            raise ValueError(f"bits={bits!r} is not valid; it must be an int in [1, 24]")
        getattr(self._root, _BITS).fill_(float(bits))

    def step(self, t: int) -> int:
        """Set the bits of training step ``t`` from the schedule; returns them."""
        if self.schedule is None:
            raise ValueError("FakeQuant.step needs a schedule; give one, or call set_bits")
        bits = self.schedule(t)
        self.set_bits(bits)
        return bits

    def state_dict(self) -> dict[str, Any]:
        return {"bits": self.bits, "ranges": getattr(self._root, _RANGES).clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_bits(int(state["bits"]))
        getattr(self._root, _RANGES).copy_(state["ranges"])


def rows(layout: str) -> dict[str, int]:
    """Module path -> its first row in the ranges buffer (``SLOTS`` rows per module)."""
    return {name: i * SLOTS for i, name in enumerate(layout.split(LAYOUT_SEP))}
