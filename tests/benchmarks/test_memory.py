"""Activation memory (``benchmarks.memory``): on an MLP, autoscale's native float16 forward saves no
more for the backward than torch.amp's, and no float32 copy beyond torch.amp's; the emulation's excess
is float32. (Not yet so on language models with an LM head: docs/results/memory_quick.md.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.memory import measure, saved_by


def test_parameters_buffers_and_inputs_are_not_counted() -> None:
    linear, x = nn.Linear(8, 4), torch.randn(16, 8)
    assert saved_by(linear, lambda: linear(x).sum(), (x,)).total == 0  # (it saves x and its weight)
    relu = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    saved = saved_by(relu, lambda: relu(x).sum(), (x,))
    assert saved.by_dtype == {torch.float32: 16 * 4 * 4}  # (the ReLU's output, once)


def test_native_float16_saves_what_torch_amp_saves_and_the_emulation_keeps_float32_copies() -> None:
    """On a small MLP (Inductor): autoscale's native forward saves at most torch.amp's bytes, of which
    no more in float32 than torch.amp's (no scale point, statistic or check keeps a float32 copy
    alive); emulated on a CPU, it keeps float32 copies of its GEMMs' float16 inputs, which autograd
    saves for their backward (``autoscale/passes/dynamo/emulate_compute.py``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    saved = measure(model, lambda run: F.cross_entropy(run(x), y), (x, y))
    amp, native, emulated = saved["torch.amp"], saved["native"], saved["emulated"]
    assert 0 < native.total <= amp.total
    assert native.by_dtype.get(torch.float32, 0) <= amp.by_dtype.get(torch.float32, 0)
    extra = emulated.by_dtype.get(torch.float32, 0) - native.by_dtype.get(torch.float32, 0)
    assert extra > 0 and emulated.total > native.total
