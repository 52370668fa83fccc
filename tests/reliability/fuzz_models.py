"""A grammar of layers for graph fuzzing (issue 8): random small models from a printable spec.

A :class:`Spec` names a stem, a list of layers and a few sizes; :func:`build` turns it into an
``nn.Module``, its inputs and targets, all from ``spec.seed``. ``repr(spec)`` is valid Python, so a
failing example found by hypothesis can be pasted into the test file as a regression case.

Every layer maps the running activation ``h`` of shape ``(batch, TOKENS, width)`` to the same shape
(image-shaped layers reshape the tokens into a ``width x 2 x 2`` image and back), so any list of
layer names is a valid model. ``skip`` is the activation saved after layer ``save_at`` (the stem's
output before that): residual merges and concatenations read it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

__all__ = ["ACTIVATIONS", "LAYERS", "Spec", "build", "spec_of", "specs"]

TOKENS = 4  # a 2 x 2 image when a layer needs one
SIDE = 2
CLASSES = 4
IMAGE_CHANNELS = 3  # the conv stem reads (batch, 3, 4, 4) images
IN_FEATURES = 6  # the linear stem reads (batch, TOKENS, 6)


@dataclass(frozen=True)
class Spec:
    """One random model. ``repr`` is the literal to paste into a regression case."""

    layers: tuple[str, ...]
    width: int = 8
    batch: int = 4
    stem: str = "linear"  # "linear" (token input) or "conv" (image input)
    save_at: int = 0  # the layer whose output residual merges and concatenations read
    seed: int = 0
    scaling: str = "adaptive"  # the GradScaler's mode: "adaptive" (per-layer scales) or "dynamic" (one)


def _image(h: torch.Tensor) -> torch.Tensor:
    """(B, T, D) -> (B, D, 2, 2)."""
    b, _, d = h.shape
    return h.transpose(1, 2).reshape(b, d, SIDE, SIDE)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, D, 2, 2) -> (B, T, D)."""
    return x.flatten(2).transpose(1, 2)


class Layer(nn.Module):
    """A layer of the grammar: ``forward(h, skip) -> h`` with ``h`` of shape (B, T, D)."""

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class Linear(Layer):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.fc(h)


class Conv(Layer):
    """Conv2d on the image view of the tokens."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(d, d, 3, padding=1)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return _tokens(self.conv(_image(h)))


class BatchNorm2d(Layer):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(d)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return _tokens(self.bn(_image(h)))


class BatchNorm1d(Layer):
    """BatchNorm1d on the flattened (B·T, D) rows."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(d)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.bn(h.reshape(-1, h.shape[-1])).view_as(h)


class BatchNorm1dSeq(Layer):
    """BatchNorm1d on (B, D, T): channels in the middle, as for a sequence."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(d)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.bn(h.transpose(1, 2)).transpose(1, 2)


class LayerNorm(Layer):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.ln(h)


class SDPA(Layer):
    """Multi-head F.scaled_dot_product_attention with a fused QKV projection."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.heads = 2
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Attention(Layer):
    """softmax(Q Kᵀ / √d) V written out."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        return weights @ v


class TokenMix(Layer):
    """A Linear over the tokens: transpose, mix, transpose back."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(TOKENS, TOKENS)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.fc(h.transpose(1, 2)).transpose(1, 2)


class FlattenLinear(Layer):
    """flatten(1) -> Linear over every token and channel -> unflatten."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(TOKENS * d, TOKENS * d)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.fc(h.flatten(1)).unflatten(1, h.shape[1:])


class CatLinear(Layer):
    """torch.cat with the saved tensor along the channels, then a Linear back to D."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([h, skip], dim=-1))


class Fn(Layer):
    """A parameter-free layer."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.fn(h, skip)


def _amax_softmax(h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    e = torch.exp(h - h.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def _split_gate(h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    a, b = h.split(h.shape[-1] // 2, dim=-1)
    return torch.cat([b, a * torch.sigmoid(b)], dim=-1)


def _swap_tokens(h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    first, second = h.chunk(2, dim=1)
    return torch.cat([second, first], dim=1)


def _cat_slice(h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """Concatenate along the tokens and slice a shifted window back out."""
    return torch.cat([skip, h], dim=1)[:, TOKENS - 1: 2 * TOKENS - 1]


def _permute_reshape(h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """unsqueeze -> permute -> squeeze -> reshape: a shape-preserving scramble of the elements."""
    b, t, d = h.shape
    return h.unsqueeze(-1).permute(0, 2, 3, 1).squeeze(2).reshape(b, t, d)


def _interleave(h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    b, t, d = h.shape
    return h.view(b, t, d // 2, 2).transpose(-1, -2).reshape(b, t, d)


ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "relu": lambda h, s: F.relu(h),
    "gelu": lambda h, s: F.gelu(h),
    "silu": lambda h, s: F.silu(h),
    "tanh": lambda h, s: torch.tanh(h),
    "sigmoid": lambda h, s: torch.sigmoid(h),
}

_FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    **ACTIVATIONS,
    "residual": lambda h, s: h + s,
    # reductions, kept (keepdim) and broadcast back
    "mean_center": lambda h, s: h - h.mean(dim=-1, keepdim=True),
    "sum_tokens": lambda h, s: h + 0.25 * h.sum(dim=1, keepdim=True),
    # amax as the shift of a softmax written out (exp(h - max) / sum): the shift's gradient cancels
    # exactly. A bare ``h - h.amax(-1)`` is not in the grammar: its gradient is one-hot at the
    # argmax, which float16 rounding moves wherever two values lie within ~2^-11 of each other
    # (the fuzzer found it: Spec(layers=('cat_linear', 'sigmoid', 'amax_shift', 'cat_linear',
    # 'batch_norm1d_seq', 'sdpa'), width=8, batch=5, stem='conv', save_at=2, seed=10941), step 2:
    # the stem's bias gradient at 11 dB, exactly what rounding the float32 model's weights and
    # layer outputs to float16 gives): a property of the function, not of the backend.
    "amax_softmax": _amax_softmax,
    "mean_tokens": lambda h, s: h * torch.sigmoid(h.mean(dim=1).unsqueeze(1)),
    # views and data movement
    "permute_reshape": _permute_reshape,
    "interleave": _interleave,
    "split_gate": _split_gate,
    "swap_tokens": _swap_tokens,
    "cat_slice": _cat_slice,
}

_MODULES: dict[str, Callable[[int], Layer]] = {
    "linear": Linear,
    "conv": Conv,
    "batch_norm2d": BatchNorm2d,
    "batch_norm1d": BatchNorm1d,
    "batch_norm1d_seq": BatchNorm1dSeq,
    "layer_norm": LayerNorm,
    "sdpa": SDPA,
    "attention": Attention,
    "token_mix": TokenMix,
    "flatten_linear": FlattenLinear,
    "cat_linear": CatLinear,
}

LAYERS: tuple[str, ...] = tuple(sorted({*_MODULES, *_FUNCTIONS}))


class FuzzNet(nn.Module):
    """stem -> layers -> mean over the tokens -> linear head (logits for cross-entropy)."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec, d = spec, spec.width
        self.stem: nn.Module = (nn.Linear(IN_FEATURES, d) if spec.stem == "linear"
                                else nn.Conv2d(IMAGE_CHANNELS, d, 3, stride=2, padding=1))
        self.layers = nn.ModuleList(_MODULES[name](d) if name in _MODULES else Fn(_FUNCTIONS[name])
                                    for name in spec.layers)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        if self.spec.stem == "conv":
            h = _tokens(h)
        skip = h
        for i, layer in enumerate(self.layers):
            h = layer(h, skip)
            if i == self.spec.save_at:
                skip = h
        return self.head(h.mean(dim=1))


def build(spec: Spec) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """The model, its inputs and cross-entropy targets, all determined by ``spec``."""
    unknown = set(spec.layers) - set(LAYERS)
    if unknown or spec.stem not in ("linear", "conv") or spec.width % 4 or spec.scaling not in ("adaptive", "dynamic"):
        raise ValueError(f"not a valid spec: {spec!r}")
    torch.manual_seed(spec.seed)
    model = FuzzNet(spec)
    shape = ((spec.batch, TOKENS, IN_FEATURES) if spec.stem == "linear"
             else (spec.batch, IMAGE_CHANNELS, 2 * SIDE, 2 * SIDE))
    return model, (torch.randn(shape),), torch.randint(0, CLASSES, (spec.batch,))


def spec_of(seed: int, max_layers: int = 4) -> Spec:
    """Random spec number ``seed``: 1 to ``max_layers`` layers, width 8 or 16, batch 4 to 8, either
    stem, all drawn by ``random.Random(seed)`` uniformly; the adaptive scaling mode (per-layer scale
    points, what the fuzzing is most for) three times as often as the dynamic one."""
    rng = random.Random(seed)
    n = rng.randint(1, max_layers)
    return Spec(layers=tuple(rng.choices(LAYERS, k=n)), width=rng.choice([8, 16]), batch=rng.randint(4, 8),
                stem=rng.choice(["linear", "conv"]), save_at=rng.randrange(n), seed=seed,
                scaling=rng.choice(["adaptive", "adaptive", "adaptive", "dynamic"]))


def specs(max_layers: int = 4) -> st.SearchStrategy[Spec]:
    """Random specs (``spec_of``) from a seed that hypothesis draws.

    Hypothesis draws small and repeated values far more often than others: with the layers, sizes
    and modes drawn field by field, 200 derandomized examples held 64 distinct layer lists, 84 of
    them a single layer, and some productions of the grammar never appeared. Distinct seeds spread
    the examples evenly over the grammar. (Shrinking then finds a smaller failing seed, not a
    smaller model: paste the spec it reports as a regression case, and cut it down by hand.)"""
    return st.builds(spec_of, st.integers(min_value=0, max_value=2**32 - 1), st.just(max_layers))
