"""The benchmark's tasks: data, models and training settings. Everything is bundled or generated.

* ``mlp`` — an MLP on scikit-learn's digits (8×8 images, 10 classes, bundled with sklearn).
* ``cnn`` — a small CNN with batch norm and two residual blocks on the same digits, as 1×8×8 images.
* ``lm`` — a character-level transformer language model on Python's standard library, read from
  this interpreter's own ``Lib/`` directory (plain ASCII bytes; the first files in sorted order,
  so every machine with the same Python reads the same text). Its accuracy is next-character
  accuracy on held-out text.

Each has a stress variant (``mlp-stress``, ``cnn-stress``, ``lm-stress``) where float16 underflow
bites. The lever is the gradient magnitude, with the network made deeper too:

* the loss of each step is divided by ``STRESS_DIVISOR`` = 2^12, as when a step's loss is the mean
  over 4096 times more examples than one batch holds (gradient accumulation over many
  micro-batches, or a per-token mean over long sequences: the usual way real gradients get small).
  Adam's ``eps`` is divided alike, so float32 training is mathematically unchanged (Adam is
  invariant to a loss scale except through ``eps``); float16 is not: its gradients fall 12 binary
  orders of magnitude towards the underflow threshold;
* and the network is deeper (MLP: 6 hidden layers instead of 2; CNN: 4 residual blocks instead of
  2; LM: 4 transformer blocks instead of 2), which spreads the gradients' magnitudes over more
  layers, so no single global scale suits all of them.

This is a choice, not the only one: a deep narrow network with its natural vanishing gradients
also underflows in float16, but there float32 Adam barely moves those layers either (their
gradients are below ``eps``), so accuracy cannot show the difference. Here it can.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["STRESS_DIVISOR", "TASKS", "Block", "Data", "Task", "get"]

STRESS_DIVISOR = 2.0**12


@dataclass(frozen=True)
class Data:
    """Train and test tensors (inputs, targets)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@dataclass(frozen=True)
class Task:
    """One training task: how to build its model and data, and how to train it.

    ``model(seed)`` returns the network (logits out). ``loss_divisor`` divides each step's loss
    (and Adam's eps): 1 for the base tasks, ``STRESS_DIVISOR`` for the stress variants.
    ``quick_steps`` replaces ``steps`` in a ``--quick`` run.
    """

    name: str
    title: str
    model: Callable[[int], nn.Module]
    data: Callable[[], Data]
    steps: int
    quick_steps: int
    batch: int
    lr: float
    loss_divisor: float = 1.0

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (over all positions of a sequence), divided by ``loss_divisor``."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) / self.loss_divisor


# ------------------------------------------------------------------------------------- digits


@cache
def _digits() -> Data:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return Data(x_train, y_train, x_test, y_test)


@cache
def _digit_images() -> Data:
    d = _digits()
    return Data(d.x_train.view(-1, 1, 8, 8), d.y_train, d.x_test.view(-1, 1, 8, 8), d.y_test)


def _mlp(hidden: int) -> Callable[[int], nn.Module]:
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(64, 128), nn.ReLU()]
        for _ in range(hidden - 1):
            layers += [nn.Linear(128, 128), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(128, 10))
    return make


class _Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class _CNN(nn.Module):
    def __init__(self, blocks: int, c: int = 16) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.blocks = nn.Sequential(*(_Residual(c) for _ in range(blocks)))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.head(x.mean((2, 3)))


def _cnn(blocks: int) -> Callable[[int], nn.Module]:
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return _CNN(blocks)
    return make


# ----------------------------------------------------------------------------------------- LM

VOCAB, SEQ, TEXT_BYTES = 128, 64, 400_000


@cache
def _stdlib_text() -> bytes:
    """The first ``TEXT_BYTES`` ASCII bytes of the standard library's .py files, sorted by path
    (non-ASCII bytes dropped). Raises if the library cannot be found (an embedded Python)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files in {lib}: the lm tasks read the standard library's source")
    out = bytearray()
    for path in files:
        out += bytes(b for b in path.read_bytes() if b < VOCAB)
        if len(out) >= TEXT_BYTES:
            break
    return bytes(out[:TEXT_BYTES])


@cache
def _text() -> Data:
    """Sequences of ``SEQ + 1`` characters: the first 90% of the text for training, the rest for
    testing (disjoint, non-overlapping windows)."""
    tokens = torch.tensor(list(_stdlib_text()), dtype=torch.long)
    windows = tokens[: len(tokens) // (SEQ + 1) * (SEQ + 1)].view(-1, SEQ + 1)
    split = int(0.9 * len(windows))
    train, test = windows[:split], windows[split:]
    return Data(train[:, :-1], train[:, 1:], test[:, :-1], test[:, 1:])


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP, each residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _LM(nn.Module):
    def __init__(self, layers: int, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def _lm(layers: int) -> Callable[[int], nn.Module]:
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return _LM(layers)
    return make


# -------------------------------------------------------------------------------------- table

_BASE = (
    Task("mlp", "MLP on digits", _mlp(2), _digits, steps=400, quick_steps=60, batch=64, lr=2e-3),
    Task("cnn", "CNN (batch norm, residual blocks) on digits", _cnn(2), _digit_images, steps=300, quick_steps=40,
         batch=64, lr=3e-3),
    Task("lm", "character transformer LM on the standard library", _lm(2), _text, steps=300, quick_steps=30,
         batch=32, lr=2e-3),
)
_DEEPER = {"mlp": _mlp(6), "cnn": _cnn(4), "lm": _lm(4)}

TASKS: dict[str, Task] = {t.name: t for t in _BASE}
_STRESS = f"stress: deeper, loss / 2^{int(math.log2(STRESS_DIVISOR))}"
TASKS.update({
    f"{t.name}-stress": Task(f"{t.name}-stress", f"{t.title}, {_STRESS}", _DEEPER[t.name], t.data, t.steps,
                             t.quick_steps, t.batch, t.lr, STRESS_DIVISOR)
    for t in _BASE
})
"""Every task by name: the three base tasks, then their stress variants."""


def get(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; the tasks are {', '.join(TASKS)}")
    return TASKS[name]
