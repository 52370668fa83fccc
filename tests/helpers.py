"""Test helpers: capture Dynamo graphs without compiling, run the pipeline, train a step."""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.fx import GraphModule

import autoscale
from autoscale import Config
from autoscale.executors import inductor_keeps_roundings
from autoscale.passes import PIPELINE, PassSpec, run_stage
from tests.models import mlp_case
from tests.tolerances import SQNR_MIN_DB, sqnr

keeps_roundings = pytest.mark.skipif(
    not inductor_keeps_roundings(),
    reason=f"torch {torch.__version__}: Inductor's pointless_convert folds float32->float16->float32 round trips",
)
"""For tests that compare Inductor's emulated compute bit-for-bit with the eager executor."""


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


def symbolic(gm: GraphModule) -> bool:
    """Whether Dynamo traced ``gm`` with symbolic shapes (a size among its inputs)."""
    return any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder")


def rewrite(fn: Callable[..., Any], *inputs: Any, config: Config | None = None,
            pipeline: Sequence[PassSpec] = PIPELINE) -> GraphModule:
    """The single Dynamo graph of ``fn(*inputs)`` after the pipeline's Dynamo stage (verified:
    every pass's recorded fake values are checked against a full propagation)."""
    cfg = (config or Config(compute="native")).replace(verify=True).resolved(torch.device("cpu"))
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


@dataclass
class Comparison:
    """One training step through autoscale next to the same step in eager float32."""

    backend: autoscale.Backend
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    ref_loss: torch.Tensor
    ref_grads: dict[str, torch.Tensor]


def step_vs_fp32(model: torch.nn.Module, inputs: Sequence[torch.Tensor], targets: torch.Tensor | None,
                 config: Config | None = None) -> Comparison:
    """Run one step of ``model`` compiled with ``config`` (default: the eager executor) and one of
    an untouched copy in eager float32."""
    reference = twin(model)
    backend = autoscale.backend(config or Config(executor="eager", verify=True))
    loss, grads = step(model, torch.compile(model, backend=backend), inputs, targets)
    ref_loss, ref_grads = step(reference, None, inputs, targets)
    return Comparison(backend, loss, grads, ref_loss, ref_grads)


def assert_matches_fp32(c: Comparison, dtype: torch.dtype = torch.float16, *,
                        unresolved: Collection[str] = ()) -> None:
    """Within the tolerance table: the loss, all gradients together, and each one; gradients
    arrive in float32 (master weights). The gradients named in ``unresolved`` (see
    ``tests.tolerances.GRAD_RESOLUTION_DB``) are checked only as part of all gradients together."""
    assert sqnr(c.ref_loss, c.loss) >= SQNR_MIN_DB[(dtype, "output")], (c.loss, c.ref_loss)
    assert c.grads.keys() == c.ref_grads.keys()
    flat = [torch.cat([g[k].flatten() for k in sorted(g)]) for g in (c.ref_grads, c.grads)]
    assert sqnr(*flat) >= SQNR_MIN_DB[(dtype, "grads")]
    for name, ref in c.ref_grads.items():
        assert c.grads[name].dtype == torch.float32, name
        if name in unresolved:
            continue
        assert sqnr(ref, c.grads[name]) >= SQNR_MIN_DB[(dtype, "grad")], (name, sqnr(ref, c.grads[name]))


def assert_identical(a: object, b: object, where: str = "") -> None:
    """``a`` and ``b`` (state dicts: nested dicts of tensors and plain values) are equal bit for bit."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    else:
        assert a == b, where


@dataclass(frozen=True)
class PipelineStep:
    """One backward of the MLP case through the eager executor (``step_through_pipeline``)."""

    stats: torch.Tensor
    peaks: torch.Tensor
    grads: list[torch.Tensor]
    counts: list[dict[str, int]]
    """The rewrite counts of the pass in question, per compiled graph (none without it)."""


def step_through_pipeline(pass_fn: Callable[..., Any], *, without: bool = False) -> PipelineStep:
    """One backward of ``tests.models.mlp_case`` compiled with the eager executor and the whole
    pipeline, or the pipeline without ``pass_fn``: what the scaler's state recorded, the gradients,
    and ``pass_fn``'s counts. For a joint-stage pass that must change how, not what, a step computes."""
    torch.manual_seed(0)
    model, (x,), y = mlp_case()
    scaler = autoscale.GradScaler(model)
    pipeline = tuple(p for p in PIPELINE if not (without and p.fn is pass_fn))
    backend = autoscale.Backend(Config(executor="eager", verify=True), pipeline=pipeline)
    scaler.scale(F.cross_entropy(torch.compile(model, backend=backend)(x), y)).backward()
    state = scaler._state
    assert state is not None
    counts = [dict(r.counts) for record in backend.records for r in record.passes if r.name == pass_fn.__name__]
    return PipelineStep(state.stats.clone(), state.peaks.clone(), [p.grad.clone() for p in model.parameters()
                                                                   if p.grad is not None], counts)
