"""``layer_of``: which of the model's modules an op belongs to, from Dynamo's module stack."""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn

from autoscale.passes.graph_utils import layer_of, module_entry


class _Rotate(nn.Module):
    """A module the model calls but does not hold: transformers 5.25 turns functions such as
    ``apply_rotary_pos_emb`` into ``nn.Module`` instances held by the modeling file."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., 1:], x[..., :1]), dim=-1) * 0.5


ROTATE = _Rotate()


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ROTATE(self.q(x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.attn(x))


def _layers(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[str, str]]:
    seen: dict[str, tuple[str, str]] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        for n in gm.graph.nodes:
            if n.op == "call_function" and (entry := module_entry(n)) is not None:
                seen[n.name] = (layer_of(n), getattr(entry[1], "__name__", str(entry[1])))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x)
    return seen


def test_a_module_the_model_does_not_hold_belongs_to_the_module_that_calls_it() -> None:
    seen = _layers(_Model(), torch.randn(2, 8))
    assert seen, "no op carried a module stack"
    names = {name: layer for name, (layer, _) in seen.items()}
    assert names["cat"] == "attn" and names["mul"] == "attn", seen  # not "" (the root) nor "ROTATE"
    assert all(layer in ("attn", "attn.q", "norm") for layer in names.values()), seen
    assert seen["cat"][1] == "_Attention"


def test_the_model_s_own_modules_keep_their_paths() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    layers = {layer for layer, _ in _layers(model, torch.randn(3, 4)).values()}
    assert layers == {"0", "1.0", "1.1"}
