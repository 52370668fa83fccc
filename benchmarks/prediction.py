"""Per-layer predictions of the underflow analysis against one measured float32 step.

    python -m benchmarks.prediction [--models a,b,...] [--quick]     # writes docs/results/prediction.md

Models: the test models (``tests/models.py``: ``mlp``, ``convnet``, ``transformer``, ``mobilenet``) and
the public model zoo (``benchmarks/zoo/models.py``: 15 Hugging Face ``transformers`` models at small
random-init configurations), each with its batch; ``--quick`` runs the test models and GPT-2.

How: each model (a private copy) is compiled with a Dynamo backend that does what autoscale's does up
to the analysis — ``seed_inputs`` on the real inputs, then the Dynamo stage of the pipeline through
``analyze_underflow`` with ``autoscale.Config()``'s defaults — for every graph Dynamo hands it (one
per graph break), and runs the graph as captured. One float32 training step follows: the loss
(``model(**batch).loss`` for the zoo, ``cross_entropy(model(x), y)`` for the test models, whose loss
is outside the model as a user's usually is) and its backward. That step gives every graph's real
output gradients (zero for outputs the loss does not read: a KV cache, hidden states). Then, per
graph, ``autoscale.layer_numbers``: ``predict_layers`` reads the analysis' moments, and
``measure_layers`` runs the graph once more in float32 with those real output gradients. Both are
at loss scale 1; the definitions are in ``autoscale/layer_numbers.py``.

Per quantity and model, over the layers (module paths, per graph) where the float32 step measured the
quantity: how many the analysis predicted at all ("unknown": no prediction, None), Spearman's rank
correlation of predicted against measured across the compared layers ("-" when either side has no
spread), and the share within tolerance: a factor 2 either way for the magnitudes (the largest
weight gradient, incoming gradient and forward value), 0.1 absolute for the underflow shares (of
the weight gradients' entries and of the incoming gradients' entries that float16 flushes to zero).
The overall row pools every model's layers.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
import torch.utils._pytree
from torch import nn
from torch.fx import GraphModule

import autoscale
from autoscale.layer_numbers import LayerNumbers, measure_layers, predict_layers
from autoscale.passes import PIPELINE, analyze_underflow, run_stage
from autoscale.passes.analysis.seeding import calibrate, seed_inputs
from autoscale.passes.graph_utils import copy_graph_module
from benchmarks import machine_line, write_report

__all__ = ["MAGNITUDES", "QUANTITIES", "RATES", "Comparison", "Model", "agreement", "compare", "models",
           "spearman"]

log = logging.getLogger("benchmarks.prediction")

MAGNITUDES = ("weight_grad_max", "grad_max", "forward_max")
RATES = ("weight_underflow", "grad_underflow")
QUANTITIES = ("weight_underflow", "weight_grad_max", "grad_underflow", "grad_max", "forward_max")
FACTOR = 2.0  # magnitudes: within this factor either way
RATE_TOLERANCE = 0.1  # underflow shares: within this, absolute
TITLES = {
    "weight_underflow": "Weight-gradient underflow share (within 0.1 absolute)",
    "weight_grad_max": "Largest weight gradient (within 2x)",
    "grad_underflow": "Incoming-gradient underflow share (within 0.1 absolute)",
    "grad_max": "Largest incoming gradient (within 2x)",
    "forward_max": "Largest forward value (within 2x)",
}
TEST_MODELS = ("mlp", "convnet", "transformer", "mobilenet")
QUICK = (*TEST_MODELS, "gpt2")


@dataclass(frozen=True)
class Model:
    """A model to compare on: ``build(seed)`` gives the model and ``step``, which runs the (compiled)
    model on its batch and returns the loss."""

    name: str
    build: Callable[[int], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]


def _test_model(case: Callable[[int], tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor | None]]
                ) -> Callable[[int], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]:
    def build(seed: int) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
        model, inputs, targets = case(seed)

        def step(m: nn.Module) -> torch.Tensor:
            out = m(*inputs)
            return out if targets is None else F.cross_entropy(out, targets)

        return model, step

    return build


def _zoo_model(name: str) -> Callable[[int], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]:
    def build(seed: int) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
        from benchmarks.zoo.models import MODELS

        model, batch = MODELS[name].build(seed)
        return model, lambda m: m(**batch).loss

    return build


def models() -> dict[str, Model]:
    """The test models, then the zoo's (when ``transformers`` is installed)."""
    from tests.models import conv_case, mlp_case, mobilenet_case, transformer_case

    cases = {"mlp": mlp_case, "convnet": conv_case, "transformer": transformer_case, "mobilenet": mobilenet_case}
    found = {name: Model(name, _test_model(case)) for name, case in cases.items()}
    try:
        from benchmarks.zoo.models import MODELS
    except ImportError:  # pragma: no cover (the zoo needs transformers)
        return found
    return found | {name: Model(name, _zoo_model(name)) for name in MODELS}


# ---------------------------------------------------------------------------------- capture


@dataclass
class _Graph:
    """One Dynamo graph, analyzed, with its example inputs (as they were at compile time) and the
    gradients the training step sent to its outputs."""

    gm: GraphModule
    inputs: list[Any]
    output_grads: list[torch.Tensor | None] = field(default_factory=list)


_ANALYSIS = PIPELINE[:[spec.fn for spec in PIPELINE].index(analyze_underflow) + 1]


def _snapshot(x: Any) -> Any:
    """A copy of an input as it is now (a later step's in-place updates do not show), keeping
    whether it is a parameter (the analysis floors trainable parameters' sizes in the backward)."""
    if isinstance(x, nn.Parameter):
        return nn.Parameter(x.detach().clone(), requires_grad=x.requires_grad)
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    return x


def capture(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], cfg: autoscale.Config) -> list[_Graph]:
    """Compile a copy of ``model`` with a backend that analyzes each graph as autoscale's backend
    does, run one float32 step (``step``'s loss, backward), and return the graphs with the output
    gradients that step gave them."""
    cfg = cfg.resolved(torch.device("cpu"))
    graphs: list[_Graph] = []

    def store(record: _Graph, at: int, grad: torch.Tensor) -> None:
        held = record.output_grads[at]
        record.output_grads[at] = grad.detach().clone() if held is None else held + grad.detach()

    def backend(gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        runs = copy_graph_module(gm)
        record = _Graph(gm, [_snapshot(x) for x in example_inputs])
        seed_inputs(gm, example_inputs)
        if cfg.scaling.calibrate:
            calibrate(gm, example_inputs)
        run_stage(gm, cfg, "dynamo", _ANALYSIS)
        graphs.append(record)

        def run(*args: Any) -> Any:
            out = runs.forward(*args)
            leaves, spec = torch.utils._pytree.tree_flatten(out)
            record.output_grads = [None] * len(leaves)
            for at, o in enumerate(leaves):
                if isinstance(o, torch.Tensor) and o.requires_grad:
                    # an alias of its own: the hook sees only the gradient from outside the graph (the
                    # output tensor itself also gets what the graph's own uses of it send back)
                    leaves[at] = o = o.view_as(o)
                    o.register_hook(functools.partial(store, record, at))
            return torch.utils._pytree.tree_unflatten(leaves, spec)

        return run

    subject = copy.deepcopy(model)
    torch._dynamo.reset()
    with torch.enable_grad():
        step(torch.compile(subject, backend=backend)).backward()
    torch._dynamo.reset()
    return graphs


# ---------------------------------------------------------------------------------- compare


@dataclass
class Comparison:
    """One model's layers, predicted and measured (keyed ``graph:layer``)."""

    model: str
    predicted: dict[str, LayerNumbers]
    measured: dict[str, LayerNumbers]
    graphs: int
    seconds: float

    def pairs(self, quantity: str) -> list[tuple[str, float | None, float]]:
        """(layer, predicted, measured) for every layer where the step measured ``quantity``."""
        out = []
        for key, m in self.measured.items():
            value = getattr(m, quantity)
            if value is not None:
                p = self.predicted.get(key)
                out.append((key, getattr(p, quantity) if p is not None else None, float(value)))
        return out


def compare(model: Model, seed: int = 0, cfg: autoscale.Config | None = None) -> Comparison:
    """Predict and measure ``model``'s layers (see the module docstring)."""
    start = time.perf_counter()
    net, step = model.build(seed)
    graphs = capture(net, step, cfg or autoscale.Config())
    predicted: dict[str, LayerNumbers] = {}
    measured: dict[str, LayerNumbers] = {}
    for i, g in enumerate(graphs):
        prefix = f"{i}:" if len(graphs) > 1 else ""
        predicted.update({prefix + k: v for k, v in predict_layers(g.gm).items()})
        measured.update({prefix + k: v for k, v in measure_layers(g.gm, g.inputs, g.output_grads).items()})
    return Comparison(model.name, predicted, measured, len(graphs), time.perf_counter() - start)


def _ranks(xs: Sequence[float]) -> list[float]:
    """Ranks from 1, ties at their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's of the ranks, ties averaged); nan when fewer than
    three pairs or either side has no spread."""
    if len(a) != len(b) or len(a) < 3:
        return math.nan
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else math.nan


def within(quantity: str, predicted: float, measured: float) -> bool:
    """Whether a prediction is within the quantity's tolerance of the measurement."""
    if quantity in RATES:
        return abs(predicted - measured) <= RATE_TOLERANCE
    if predicted == measured:
        return True
    if predicted <= 0 or measured <= 0 or not (math.isfinite(predicted) and math.isfinite(measured)):
        return False
    return 1 / FACTOR <= predicted / measured <= FACTOR


@dataclass(frozen=True)
class Agreement:
    """How predictions of one quantity agree with measurement over a set of layers."""

    measured: int  # layers where the step measured the quantity
    compared: int  # of those, with a prediction
    rank_correlation: float
    within: float  # share of the compared within tolerance (nan when none)
    outliers: tuple[tuple[str, float, float], ...]  # (layer, predicted, measured) outside tolerance

    @property
    def unknown(self) -> int:
        return self.measured - self.compared


def agreement(pairs: list[tuple[str, float | None, float]], quantity: str) -> Agreement:
    known = [(k, p, m) for k, p, m in pairs if p is not None]
    ok = [within(quantity, p, m) for _, p, m in known]
    outliers = tuple((k, p, m) for (k, p, m), good in zip(known, ok, strict=True) if not good)
    return Agreement(len(pairs), len(known), spearman([p for _, p, _ in known], [m for _, _, m in known]),
                     sum(ok) / len(ok) if ok else math.nan, outliers)


# ---------------------------------------------------------------------------------- report


def _f(x: float, spec: str = ".2f") -> str:
    return "-" if math.isnan(x) else f"{x:{spec}}"


def markdown(results: list[Comparison], *, machine: str, minutes: float) -> str:
    lines = [f"Machine: {machine}. Models: {len(results)}. Wall time: {minutes:.1f} min.", ""]
    summary = ["| quantity | layers measured | compared (predicted) | rank correlation | within tolerance |",
               "|---|---|---|---|---|"]
    sections = []
    for q in QUANTITIES:
        rows = [f"### {TITLES[q]}", "",
                "| model | layers measured | unknown | compared | rank correlation | within tolerance |",
                "|---|---|---|---|---|---|"]
        pooled: list[tuple[str, float | None, float]] = []
        for r in results:
            pairs = r.pairs(q)
            pooled += [(f"{r.model} {k}", p, m) for k, p, m in pairs]
            a = agreement(pairs, q)
            rows.append(f"| {r.model} | {a.measured} | {a.unknown} | {a.compared} | {_f(a.rank_correlation)} | "
                        f"{_f(a.within, '.0%')} |")
        a = agreement(pooled, q)
        rows.append(f"| **overall** | {a.measured} | {a.unknown} | {a.compared} | {_f(a.rank_correlation)} | "
                    f"{_f(a.within, '.0%')} |")
        summary.append(f"| {q} | {a.measured} | {a.compared} | {_f(a.rank_correlation)} | {_f(a.within, '.0%')} |")
        worst = sorted(a.outliers, key=lambda o: -_miss(q, o[1], o[2]))[:8]
        if worst:
            rows += ["", "Furthest off (predicted / measured): " + "; ".join(
                f"{k}: {p:.3g} / {m:.3g}" for k, p, m in worst)]
        sections += [*rows, ""]
    lines += ["### Overall", "", *summary, "", *sections]
    lines += ["Graphs per model (one per graph break) and seconds (compile, one step, measurement): "
              + ", ".join(f"{r.model} {r.graphs} ({r.seconds:.0f} s)" for r in results), ""]
    return "\n".join(lines)


def _miss(quantity: str, predicted: float, measured: float) -> float:
    """How far off a prediction is: the absolute difference for a rate, the log-ratio for a magnitude."""
    if quantity in RATES:
        return abs(predicted - measured)
    if not (predicted > 0 and measured > 0):
        return math.inf
    return abs(math.log(predicted) - math.log(measured))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help="comma-separated names (default: all; --quick: a subset)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="default: docs/results/prediction.md (--quick: print only)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    available = models()
    names = [n for n in args.models.split(",") if n] or (list(QUICK) if args.quick else list(available))
    unknown = sorted(set(names) - set(available))
    if unknown:
        parser.error(f"unknown models {unknown}; there are {', '.join(available)}")
    output = args.output or (None if args.quick else Path("docs/results/prediction.md"))
    start = time.perf_counter()
    results = []
    for name in names:
        r = compare(available[name], seed=args.seed)
        log.warning("%s: %d layers, %d graphs, %.0f s", name, len(r.measured), r.graphs, r.seconds)
        results.append(r)
    machine = machine_line()
    body = markdown(results, machine=machine, minutes=(time.perf_counter() - start) / 60)
    if output is not None:
        write_report(output, f"# Per-layer predictions against measurement\n\n{__doc__}\n{body}")
    print(body)


if __name__ == "__main__":
    main()
