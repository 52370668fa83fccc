"""One model of the zoo, trained three ways from the same weights on the same batch, and compared.

  float32    eager float32: the reference;
  torch.amp  eager, ``torch.autocast("cpu", float16)`` + ``torch.amp.GradScaler`` (its defaults, as a
             user gets them: init scale 2^16);
  autoscale  ``torch.compile(backend=autoscale.backend(Config(executor=...)))`` + ``autoscale.GradScaler``.

All three take ``steps`` optimizer steps (AdamW by default, or SGD; lr 1e-3) on one batch. Measured:

* the loss trajectory's gap to float32's: max over steps of |loss - float32's| / float32's first loss;
* first-step gradient SQNR against float32 (all parameters' gradients, unscaled, as one vector):
  autoscale's, and torch.amp's at the largest power-of-two loss scale from 2^16 down that does not
  overflow on that step (its defaults may skip the first step: that is a skip, not an SQNR);
* with Inductor, the same SQNR for plain ``torch.compile`` (Inductor, float32): what the executor
  alone changes;
* skipped steps, the graphs compiled (and how many more than the same model compiled with a backend
  that does nothing: graph breaks autoscale caused), ops the precision tables do not know, the layers
  autoscale scaled and their scales, and autoscale's compile time (first step less a later step's
  time) and step time.

On this CPU torch.autocast computes its float16 ops natively and autoscale emulates float16 (float16
storage and rounding, float32 GEMM arithmetic): both round where a float16 GPU would.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
from torch import nn

import autoscale
from benchmarks.zoo.models import Batch, ZooModel

__all__ = ["LOSS_GAP_TARGET", "SQNR_SLACK_DB", "ZooResult", "amp_sqnr", "compare", "float32_grads", "grads",
           "sqnr_db"]

LR = 1e-3
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
LOSS_GAP_TARGET = 0.05  # of the initial loss, or at least as close as torch.amp
SQNR_SLACK_DB = 1.0  # autoscale's first-step SQNR may be this much below torch.amp's


@dataclass
class ZooResult:
    name: str
    family: str
    steps: int
    executor: str
    optimizer: str = "adamw"
    losses: dict[str, list[float]] = field(default_factory=dict)  # method -> loss per step
    skipped: dict[str, int] = field(default_factory=dict)
    sqnr: dict[str, float] = field(default_factory=dict)  # method -> first-step gradient SQNR (dB)
    amp_sqnr_scale: float = math.nan  # the loss scale torch.amp's SQNR was measured at
    graphs: int = 0  # autoscale's graphs with floating-point ops, at the first step
    plain_graphs: int = 0  # the same model's, under a backend that does nothing
    recompiles: int = 0  # autoscale's compiles after the first step (forward-overflow repairs)
    promoted: list[str] = field(default_factory=list)  # ops promoted to float32 at run time
    unknown_ops: list[str] = field(default_factory=list)
    scaled_layers: int = 0
    scale_range: tuple[float, float] = (math.nan, math.nan)  # smallest, largest layer scale at the end
    compile_s: float = math.nan
    step_ms: dict[str, float] = field(default_factory=dict)  # method -> median step time after the first
    error: str = ""  # what stopped autoscale's run, if anything
    missing: list[str] = field(default_factory=list)  # parameters float32 gives a gradient and autoscale none (or 0)

    def gap(self, method: str) -> float:
        """max over steps |loss - float32's| / float32's first loss (inf if any loss is not finite)."""
        ref, ours = self.losses.get("float32", []), self.losses.get(method, [])
        if not ref or len(ours) != len(ref):
            return math.inf
        if not all(math.isfinite(x) for x in ours):
            return math.inf
        return max(abs(a - b) for a, b in zip(ours, ref, strict=True)) / abs(ref[0])

    @property
    def extra_graphs(self) -> int:
        return self.graphs - self.plain_graphs

    @property
    def loss_ok(self) -> bool:
        return self.gap("autoscale") <= max(LOSS_GAP_TARGET, self.gap("torch.amp"))

    @property
    def sqnr_ok(self) -> bool:
        return self.sqnr.get("autoscale", -math.inf) >= self.sqnr.get("torch.amp", math.inf) - SQNR_SLACK_DB

    @property
    def ok(self) -> bool:
        return not self.error and not self.missing and self.extra_graphs <= 0 and self.loss_ok and self.sqnr_ok


def sqnr_db(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor | None]) -> float:
    """10 log10(|ref|² / |ref - got|²) over all gradients as one vector; -inf if any is missing or
    not finite, inf if they are equal."""
    signal = noise = 0.0
    for name, r in ref.items():
        g = got.get(name)
        if g is None:
            g = torch.zeros_like(r)
        g = g.double()
        if not torch.isfinite(g).all():
            return -math.inf
        signal += float(r.double().square().sum())
        noise += float((r.double() - g).square().sum())
    if noise == 0.0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def grads(model: nn.Module, divide: float = 1.0) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's gradient, in float32 and divided by ``divide``; None if it has none."""
    return {n: (p.grad.detach().float() / divide if p.grad is not None else None)
            for n, p in model.named_parameters() if p.requires_grad}


def float32_grads(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """The gradients eager float32 gives a copy of ``model`` on ``batch``: the reference."""
    probe = copy.deepcopy(model)
    _loss(probe, batch).backward()
    return {n: g for n, g in grads(probe).items() if g is not None}


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


def _float32(model: nn.Module, batch: Batch, steps: int, result: ZooResult) -> dict[str, torch.Tensor]:
    opt = OPTIMIZERS[result.optimizer](model.parameters(), lr=LR)
    first: dict[str, torch.Tensor] = {}
    times = []
    for step in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch)
        loss.backward()
        if step == 0:
            first = {n: g for n, g in grads(model).items() if g is not None}
        opt.step()
        times.append(time.perf_counter() - start)
        result.losses.setdefault("float32", []).append(float(loss.detach()))
    result.step_ms["float32"] = 1e3 * statistics.median(times[1:] or times)
    return first


def amp_sqnr(model: nn.Module, batch: Batch, ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The SQNR of torch.amp's gradients of a copy of ``model`` on ``batch`` against ``ref``, and the
    loss scale: the largest from 2^16 down at which none overflows (nan, nan if none)."""
    scale = 2.0**16
    while scale >= 1.0:
        probe = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(probe, batch)
        (loss.float() * scale).backward()
        got = grads(probe, scale)
        if all(g is None or bool(torch.isfinite(g).all()) for g in got.values()):
            return sqnr_db(ref, got), scale
        scale /= 2
    return math.nan, math.nan


def _amp(model: nn.Module, batch: Batch, steps: int, ref: dict[str, torch.Tensor], result: ZooResult) -> None:
    initial = copy.deepcopy(model)
    opt = OPTIMIZERS[result.optimizer](model.parameters(), lr=LR)
    amp = torch.amp.GradScaler("cpu")
    times, skipped = [], 0
    for step in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, batch)
        amp.scale(loss).backward()
        if step == 0:
            amp.unscale_(opt)
            got = grads(model)
            if all(g is None or bool(torch.isfinite(g).all()) for g in got.values()):
                result.sqnr["torch.amp"], result.amp_sqnr_scale = sqnr_db(ref, got), amp.get_scale()
        before = amp.get_scale()
        amp.step(opt)
        amp.update()
        skipped += amp.get_scale() < before
        times.append(time.perf_counter() - start)
        result.losses.setdefault("torch.amp", []).append(float(loss.detach()))
    result.skipped["torch.amp"] = skipped
    result.step_ms["torch.amp"] = 1e3 * statistics.median(times[1:] or times)
    if "torch.amp" not in result.sqnr:
        sqnr, result.amp_sqnr_scale = amp_sqnr(initial, batch, ref)
        if not math.isnan(sqnr):
            result.sqnr["torch.amp"] = sqnr


def missing(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor | None]) -> list[str]:
    """The parameters float32 gives a gradient that ``got`` lacks: none at all, or all zeros where
    float32's is not rounding noise (above 2^-24 of the largest gradient's norm): underflowed to
    nothing, as the layers whose scales were seeded too low did (issue 18's MobileNetV2)."""
    largest = max((float(g.norm()) for g in ref.values()), default=0.0)
    return sorted(name for name, g in ref.items()
                  if (x := got.get(name)) is None or (not x.any() and float(g.norm()) > 2.0**-24 * largest))


def _has_float_ops(gm: torch.fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        val = n.meta.get("example_value", n.meta.get("val"))
        if n.op.startswith("call") and isinstance(val, torch.Tensor) and val.is_floating_point():
            return True
    return False


def _plain_graphs(model: nn.Module, batch: Batch) -> int:
    """How many graphs with floating-point ops Dynamo hands a backend that does nothing."""
    torch._dynamo.reset()
    graphs = []

    def count(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(_has_float_ops(gm))
        return gm.forward

    _loss(torch.compile(model, backend=count), batch).backward()
    return sum(graphs)


def _inductor_float32(model: nn.Module, batch: Batch, ref: dict[str, torch.Tensor], result: ZooResult) -> None:
    """The first-step gradient SQNR of plain Inductor in float32 against eager float32: what the
    executor alone changes (autoscale's Inductor runs are measured against eager float32 too)."""
    torch._dynamo.reset()
    _loss(torch.compile(model, backend="inductor"), batch).backward()
    result.sqnr["inductor float32"] = sqnr_db(ref, grads(model))


def _autoscale(model: nn.Module, batch: Batch, steps: int, ref: dict[str, torch.Tensor], executor: str,
               result: ZooResult) -> None:
    torch._dynamo.reset()
    backend = autoscale.backend(autoscale.Config(executor=executor))  # type: ignore[arg-type]
    scaler = autoscale.GradScaler(model)
    opt = OPTIMIZERS[result.optimizer](model.parameters(), lr=LR)
    compiled = torch.compile(model, backend=backend)
    times, first = [], 0
    try:
        for step in range(steps):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = _loss(compiled, batch)
            scaler.scale(loss).backward()
            if step == 0:
                scaler.unscale_(opt)
                got = grads(model)
                result.sqnr["autoscale"] = sqnr_db(ref, got)
                result.missing = missing(ref, got)
                first = len(backend.records)
                result.graphs = sum(r.report.total > 0 for r in backend.records)
            scaler.step(opt)
            scaler.update()
            times.append(time.perf_counter() - start)
            result.losses.setdefault("autoscale", []).append(float(loss.detach()))
    except Exception as e:  # reported in the table, not raised: one model must not stop the zoo
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    result.skipped["autoscale"] = scaler.skipped_steps
    result.recompiles = len(backend.records) - first
    result.promoted = [f"{p.key} (step {p.step})" for p in scaler.promotions()]
    result.unknown_ops = sorted({op for r in backend.records for op in r.report.unknown_ops})
    layers = [r for r in scaler.layers() if r.name != "(root)"]
    result.scaled_layers = len(layers)
    if layers:
        result.scale_range = (min(r.scale for r in layers), max(r.scale for r in layers))
    if len(times) > 1:
        later = statistics.median(times[1:])
        result.compile_s, result.step_ms["autoscale"] = times[0] - later, 1e3 * later


def compare(entry: ZooModel, *, steps: int = 8, seed: int = 0, executor: str = "inductor",
            optimizer: str = "adamw", plain: bool = True) -> ZooResult:
    """Train ``entry`` with float32, torch.amp and autoscale from the same initial weights; with
    ``plain``, also count the graphs plain Dynamo makes of it (``ZooResult.extra_graphs``)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: the zoo trains with {', '.join(OPTIMIZERS)}")
    model, batch = entry.build(seed)
    result = ZooResult(entry.name, entry.family, steps, executor, optimizer)
    methods = ("torch.amp", "autoscale", *(("plain",) if plain else ()),
               *(("inductor",) if executor == "inductor" else ()))
    copies = {m: copy.deepcopy(model) for m in methods}  # before float32 trains the original
    ref = _float32(model, batch, steps, result)
    _amp(copies["torch.amp"], batch, steps, ref, result)
    if "plain" in copies:
        result.plain_graphs = _plain_graphs(copies["plain"], batch)
    if "inductor" in copies:
        _inductor_float32(copies["inductor"], batch, ref, result)
    _autoscale(copies["autoscale"], batch, steps, ref, executor, result)
    torch._dynamo.reset()
    return result
