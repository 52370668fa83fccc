"""MODULE:FACTORY targets for tests/test_cli.py, one per outcome the command line distinguishes.

Used both as a path (``tests/cli_factories.py:tiny_mlp``) and as a module name
(``tests.cli_factories:tiny_mlp``). The models are tiny so a diff or a convert takes seconds.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "bad_inputs",
    "needs_arguments",
    "not_a_factory",
    "not_a_module",
    "raises",
    "single_tensor",
    "small_weights",
    "tiny_mlp",
    "triple",
    "untraceable",
    "wrong_return",
]


def tiny_mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The happy path: a two-layer MLP and a batch of 4."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(4, 8),)


def small_weights() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A three-layer MLP with weights 100x too small: its float16 gradients would underflow, so the
    diff shows gradient rescale points (docs/cli.md uses it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e-2)
    return model, (torch.randn(4, 8),)


def single_tensor() -> tuple[nn.Module, torch.Tensor]:
    """example_inputs as one tensor rather than a tuple: the CLI wraps it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4)), torch.randn(2, 8)


def raises() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    raise FileNotFoundError("checkpoint weights.pt not found")


def wrong_return() -> nn.Module:
    """Forgot the inputs."""
    return nn.Linear(2, 2)


def triple() -> tuple[nn.Module, tuple[torch.Tensor, ...], int]:
    return nn.Linear(2, 2), (torch.zeros(1, 2),), 3


def not_a_module() -> tuple[str, tuple[torch.Tensor, ...]]:
    return "model", (torch.zeros(1, 2),)


def bad_inputs() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    return nn.Linear(2, 2), {"x": torch.zeros(1, 2)}


def needs_arguments(width: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return nn.Linear(width, 2), (torch.zeros(1, width),)


def untraceable() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Inputs of the wrong width: the forward fails while autoscale traces it."""
    return nn.Sequential(nn.Linear(8, 4)), (torch.randn(2, 5),)


not_a_factory = 42
