"""Small models for the tests: each one exercises a different part of the precision tables."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Linear + ReLU/GELU stack; logits out (the loss is taken outside the model)."""

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.relu(self.fc1(x)))))


class ResidualBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class ConvNet(nn.Module):
    """Conv + batch norm + a residual block + pooling + linear head, for 8x8 one-channel images."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.block = ResidualBlock(c)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        x = self.block(x)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class TransformerLM(nn.Module):
    """A one-block causal language model: embeddings, a scaled-dot-product-attention layer, an
    attention layer written out with softmax, a GELU MLP, layer norms, and the cross-entropy loss
    inside the model (so the compiled graph holds it)."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.ln1, self.ln2, self.ln3, self.ln_f = (nn.LayerNorm(d) for _ in range(4))
        self.qkv1, self.qkv2 = nn.Linear(d, 3 * d), nn.Linear(d, 3 * d)
        self.proj1, self.proj2 = nn.Linear(d, d), nn.Linear(d, d)
        self.fc, self.fc_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, _ = qkv.shape
        return qkv.view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = x.shape
        return x.transpose(1, 2).reshape(b, t, -1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        q, k, v = self._heads(self.qkv1(self.ln1(x)))
        x = x + self.proj1(self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        q, k, v = self._heads(self.qkv2(self.ln2(x)))
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        x = x + self.proj2(self._merge(attn @ v))
        x = x + self.fc_out(F.gelu(self.fc(self.ln3(x))))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class InvertedResidual(nn.Module):
    """MobileNetV2's block (torchvision's layout): 1x1 expand conv + BN + ReLU6 (unless the expansion
    is 1), 3x3 depthwise conv + BN + ReLU6, 1x1 projection conv + BN with no activation, and the
    residual when the shapes match."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        self.residual = stride == 1 and c_in == c_out
        expansion = [nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)]
        self.conv = nn.Sequential(
            *(expansion if expand != 1 else []),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


class MobileNetV2(nn.Module):
    """torchvision's MobileNetV2 at width 0.35 (17 inverted-residual blocks, channels rounded to
    multiples of 8) with its initialisation, written out here: depthwise (grouped) convolutions,
    ReLU6, and projections whose batch norm feeds the next block's convolution and batch norm."""

    SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
               (6, 320, 1, 1))  # expansion, channels, blocks, first stride

    def __init__(self, classes: int = 5, width: float = 0.35) -> None:
        super().__init__()

        def channels(c: float) -> int:
            return max(8, int(c * width + 4) // 8 * 8)

        c_in = channels(32)
        layers: list[nn.Module] = [nn.Conv2d(3, c_in, 3, 2, 1, bias=False), nn.BatchNorm2d(c_in),
                                   nn.ReLU6(inplace=True)]
        for expand, c, blocks, stride in self.SETTING:
            for i in range(blocks):
                layers.append(InvertedResidual(c_in, channels(c), stride if i == 0 else 1, expand))
                c_in = channels(c)
        layers += [nn.Conv2d(c_in, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(1280, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


def mlp_case(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """``(model, inputs, targets)`` where the loss is cross-entropy of the model's logits."""
    torch.manual_seed(seed)
    return MLP(), (torch.randn(8, 16),), torch.randint(0, 5, (8,))


def conv_case(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    torch.manual_seed(seed)
    return ConvNet(), (torch.randn(4, 1, 8, 8),), torch.randint(0, 5, (4,))


def transformer_case(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...], None]:
    """The transformer computes its own loss: targets are part of the inputs."""
    torch.manual_seed(seed)
    idx = torch.randint(0, 32, (2, 8))
    return TransformerLM(), (idx, torch.roll(idx, -1, dims=1)), None


def mobilenet_case(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    torch.manual_seed(seed)
    return MobileNetV2(), (torch.randn(8, 3, 64, 64),), torch.randint(0, 5, (8,))
