"""Models whose forward leaves float16's range, for the forward-overflow benchmark and tests.

* :class:`T5` — a T5 v1.1-style encoder-decoder written in plain torch after Hugging Face's
  ``modeling_t5``: RMS layer norm without bias or mean, attention without 1/√d and with a learnt
  relative-position bias in each stack's first layer, a gated-GELU feed-forward (``wi_0``, ``wi_1``,
  ``wo``, no biases), an untied LM head, the cross-entropy inside the model. Like the library's
  code, its feed-forward clamps float16 hidden states (``if hidden.dtype == torch.float16``): under
  autoscale the traced model is float32, so that protection never runs, and autoscale must do
  without it. ``ff_gain`` multiplies the feed-forward weights at initialisation (the outputs grow
  as its cube): at 28 the float32 feed-forward outputs reach ~7e4, as a trained T5 v1.1's do.
* :class:`Drifting` — a regressor whose targets are large (un-normalised, as prices or counts
  are): training grows its output layer's weights step by step until the outputs pass 65504. The
  example inputs at compile time show nothing; the overflow appears only after training has run.
* :class:`LogOfZero` — a model that is non-finite in float32 too (the log of a ReLU output that
  is exactly zero on some batches): no precision can help, and autoscale must say so.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Drifting", "LogOfZero", "T5", "drifting_batch", "t5_batch"]


class _RMSNorm(nn.Module):
    """T5's layer norm: scales by the root mean square, no mean subtracted, no bias."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, *, relative_bias: bool, causal: bool, buckets: int = 16) -> None:
        super().__init__()
        self.heads, self.causal, self.buckets = heads, causal, buckets
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.relative = nn.Embedding(2 * buckets + 1, heads) if relative_bias else None

    def bias(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        """The relative-position bias (positions clipped to ±buckets), with the causal mask."""
        assert self.relative is not None
        rel = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
        bias = self.relative(rel.clamp(-self.buckets, self.buckets) + self.buckets).permute(2, 0, 1)
        if self.causal:
            bias = bias.masked_fill(rel[None] > 0, torch.finfo(bias.dtype).min)
        return bias[None]

    def forward(self, x: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k(kv).view(b, kv.shape[1], self.heads, -1).transpose(1, 2)
        v = self.v(kv).view(b, kv.shape[1], self.heads, -1).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) + bias  # T5: no 1/sqrt(d)
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        return self.o((weights @ v).transpose(1, 2).reshape(b, t, d))


class _GatedFF(nn.Module):
    """T5 v1.1's feed-forward: ``wo(gelu(wi_0 x) * wi_1 x)``."""

    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.wi_0, self.wi_1 = nn.Linear(d, d_ff, bias=False), nn.Linear(d, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))


def _clamp_fp16(hidden: torch.Tensor) -> torch.Tensor:
    """Hugging Face T5's hand-written protection (``T5Block.forward``): it only acts on a float16
    tensor, which a model traced in float32 never has."""
    if hidden.dtype == torch.float16:
        limit = torch.where(torch.isinf(hidden).any(), torch.finfo(hidden.dtype).max - 1000,
                            torch.finfo(hidden.dtype).max)
        hidden = torch.clamp(hidden, min=-limit, max=limit)
    return hidden


class _Block(nn.Module):
    def __init__(self, d: int, d_ff: int, heads: int, *, first: bool, decoder: bool) -> None:
        super().__init__()
        self.ln_self, self.ln_ff = _RMSNorm(d), _RMSNorm(d)
        self.attn = _Attention(d, heads, relative_bias=first, causal=decoder)
        self.ln_cross = _RMSNorm(d) if decoder else None
        self.cross = _Attention(d, heads, relative_bias=False, causal=False) if decoder else None
        self.ff = _GatedFF(d, d_ff)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, memory: torch.Tensor | None = None,
                cross_bias: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln_self(x)
        x = _clamp_fp16(x + self.attn(h, h, bias))
        if self.cross is not None and self.ln_cross is not None and memory is not None and cross_bias is not None:
            x = _clamp_fp16(x + self.cross(self.ln_cross(x), memory, cross_bias))
        return _clamp_fp16(x + self.ff(self.ln_ff(x)))


class T5(nn.Module):
    """A T5 v1.1-style encoder-decoder (see the module docstring); ``forward`` returns the loss."""

    def __init__(self, vocab: int = 128, d: int = 64, d_ff: int = 256, heads: int = 4, layers: int = 3,
                 ff_gain: float = 1.0) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, d)
        self.encoder = nn.ModuleList(_Block(d, d_ff, heads, first=i == 0, decoder=False) for i in range(layers))
        self.decoder = nn.ModuleList(_Block(d, d_ff, heads, first=i == 0, decoder=True) for i in range(layers))
        self.ln_enc, self.ln_dec = _RMSNorm(d), _RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():  # T5's initialisation (factor 1), then the gain on the feed-forward inputs
            self.shared.weight.normal_(0.0, 1.0)
            self.lm_head.weight.normal_(0.0, d**-0.5)
            for block in (*self.encoder, *self.decoder):
                ff = block.ff
                ff.wi_0.weight.normal_(0.0, ff_gain * d**-0.5)
                ff.wi_1.weight.normal_(0.0, ff_gain * d**-0.5)
                ff.wo.weight.normal_(0.0, ff_gain * d_ff**-0.5)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(source, target).flatten(0, 1), target.flatten())

    def logits(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The next-token logits for ``target`` given ``source`` (teacher forcing)."""
        decoder_in = F.pad(target[:, :-1], (1, 0))  # shift right, start token 0
        x = self.shared(source)
        bias = self.encoder[0].attn.bias(x.shape[1], x.shape[1], x.device)
        for block in self.encoder:
            x = block(x, bias)
        memory = self.ln_enc(x)
        y = self.shared(decoder_in)
        bias = self.decoder[0].attn.bias(y.shape[1], y.shape[1], y.device)
        cross = torch.zeros(1, 1, 1, 1, device=y.device)
        for block in self.decoder:
            y = block(y, bias, memory, cross)
        out: torch.Tensor = self.lm_head(self.ln_dec(y))
        return out


def t5_batch(seed: int, *, batch: int = 8, seq: int = 16, vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy task: the target is the source reversed."""
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(1, vocab, (batch, seq), generator=g)
    return source, source.flip(1)


class Drifting(nn.Module):
    """An MLP regressor with large targets (``forward`` returns the loss); see the module docstring.

    The output layer's outputs grow with its weights while the model learns the targets' scale,
    and pass 65504 long after the compile; the hidden layers stay small.
    """

    def __init__(self, d_in: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pred = self.out(F.relu(self.fc2(F.relu(self.fc1(x))))).squeeze(-1)
        return F.mse_loss(pred / 1e4, y / 1e4)  # a loss of order 1: only the outputs are large


def drifting_batch(seed: int, *, batch: int = 64, d_in: int = 32, target: float = 1.2e5
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ~N(0, 1); targets a fixed linear function of them, rescaled to mean ``target``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_in, generator=g)
    w = torch.randn(d_in, generator=g) / math.sqrt(d_in)
    return x, target * (1.0 + 0.1 * (x @ w))


class LogOfZero(nn.Module):
    """``log(relu(fc(x)))`` summed: -inf in float32 whenever a unit is dead (always, for some)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.log(F.relu(self.fc(x)))
        return F.mse_loss(self.head(h).squeeze(-1), y)
