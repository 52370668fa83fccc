"""Test helpers: capture Dynamo graphs without compiling, run the pipeline, train a step."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
from autoscale.passes import PIPELINE, PassSpec, run_stage
from torch.fx import GraphModule

from autoscale import Config


def capture(fn: Callable[..., Any], *inputs: Any) -> list[tuple[GraphModule, list[Any]]]:
    """The graphs Dynamo hands a backend for ``fn(*inputs)`` (one per graph break), uncompiled."""
    graphs: list[tuple[GraphModule, list[Any]]] = []

    def grab(gm: GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab)(*inputs)
    torch._dynamo.reset()
    return graphs


def rewrite(fn: Callable[..., Any], *inputs: Any, config: Config | None = None,
            pipeline: Sequence[PassSpec] = PIPELINE) -> GraphModule:
    """The single Dynamo graph of ``fn(*inputs)`` after the pipeline's Dynamo stage."""
    cfg = (config or Config(compute="native")).resolved(torch.device("cpu"))
    (gm, _), = capture(fn, *inputs)
    run_stage(gm, cfg, "dynamo", pipeline)
    return gm


def loss_of(model: torch.nn.Module, inputs: Sequence[torch.Tensor], targets: torch.Tensor | None) -> torch.Tensor:
    out = model(*inputs)
    return out if targets is None else F.cross_entropy(out, targets)


def step(model: torch.nn.Module, compiled: Callable[..., Any] | None, inputs: Sequence[torch.Tensor],
         targets: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward; returns the loss and every parameter's gradient (by name)."""
    model.zero_grad(set_to_none=True)
    out = (model if compiled is None else compiled)(*inputs)
    loss = out if targets is None else F.cross_entropy(out, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def twin(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)
