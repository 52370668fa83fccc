"""Runtime state the compiled graphs read and write: per-layer scales and statistics.

The state lives on the user's model as non-persistent buffers (they stay out of the model's
``state_dict``; the scaler saves them). Dynamo lifts buffers into graph inputs, so updating a
scale in place never recompiles, and the compiled backward writes its statistics straight into
``stats`` with no host synchronisation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from autoscale.ops import FP16_MAX, NUM_STATS

__all__ = ["LOSS_ROW", "LAYOUT_SEP", "ScaleState", "install_state", "state_of", "unwrap"]

LOSS_ROW = 0
LAYOUT_SEP = "\x1f"
_LOSS_NAME = "<loss>"
_STATE_ATTR = "_autoscale_state"
_SCALES, _STATS = "_autoscale_scales", "_autoscale_stats"


class ScaleState:
    """Row 0 is the loss scale; row ``i`` > 0 belongs to the module named ``layers[i]``.

    The tensors are non-persistent buffers of the model's root module (not a submodule: a
    container such as ``nn.Sequential`` calls every child), looked up by name on each access so
    that ``model.to(device)`` carries them along.
    """

    def __init__(self, root: nn.Module, layer_names: Sequence[str], *, moments: bool = False) -> None:
        self.root = root
        self.moments = moments  # record Σ g and Σ g² (the paper rule reads them)
        # Tensors whose gradients a compiled graph checks for inf/nan as it unscales them (the
        # backend registers them), so GradScaler.step need not read them again.
        self.checked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.graphs = 0  # graphs the backend compiled against this state
        self.scaled_graphs = 0  # of which with scale points (none in bfloat16: nothing to scale)
        self.gradient_max = FP16_MAX  # the smallest max of the formats the graphs round gradients to
        self.layers: tuple[str, ...] = (_LOSS_NAME, *layer_names)
        self.layout = LAYOUT_SEP.join(self.layers)
        device = next((p.device for p in root.parameters()), torch.device("cpu"))
        scales = torch.ones(len(self.layers), device=device)  # the backend seeds layers from its analysis
        root.register_buffer(_SCALES, scales, persistent=False)
        root.register_buffer(_STATS, torch.zeros(len(self.layers), NUM_STATS, device=device), persistent=False)
        _STATES[scales] = self

    @property
    def scales(self) -> torch.Tensor:
        scales: torch.Tensor = getattr(self.root, _SCALES)
        if scales not in _STATES:  # moved (``model.to``): the backend finds the state by this tensor
            _STATES[scales] = self
        return scales

    @property
    def stats(self) -> torch.Tensor:
        return getattr(self.root, _STATS)


_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # scales tensor -> its ScaleState


def state_of(scales: torch.Tensor) -> ScaleState | None:
    """The ScaleState whose scales tensor this is (None if it is no longer any state's)."""
    state = _STATES.get(scales)
    return state if isinstance(state, ScaleState) and state.scales is scales else None


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module behind ``torch.compile``'s wrapper."""
    return getattr(model, "_orig_mod", model)


def install_state(model: nn.Module, *, moments: bool = False) -> ScaleState:
    """Give ``model`` a ScaleState (a row per named module) and make its forward announce the
    state to the backend. Idempotent: a second call returns the installed state (asking it for
    ``moments`` too, if this call does; graphs compiled before keep what they record)."""
    root = unwrap(model)
    existing = getattr(root, _STATE_ATTR, None)
    if isinstance(existing, ScaleState):
        existing.moments |= moments
        return existing
    state = ScaleState(root, [name for name, _ in root.named_modules()], moments=moments)
    object.__setattr__(root, _STATE_ATTR, state)  # a plain attribute, not a submodule
    inner = root.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kw: Any) -> Any:
        torch.ops.autoscale.attach(getattr(root, _SCALES), getattr(root, _STATS), state.layout, state.moments)
        return inner(*args, **kw)

    root.forward = forward
    return state
