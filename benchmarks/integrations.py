"""autoscale and torch.amp side by side, trained through the training frameworks themselves.

    python -m benchmarks.integrations [--quick] [-o PATH] [--json PATH]    # writes docs/results/integrations.md

The other benchmarks drive the training loop by hand; users do not: they call Lightning's
``Trainer.fit`` or Hugging Face's ``Trainer.train`` and pick a precision there. This benchmark trains
the same models, from the same initial weights on the same batches in the same order, through those
entry points:

Lightning ``Trainer.fit`` (Adam, lr 1e-3, digits from scikit-learn, batch 64):
  float32                 ``precision="32-true"``: the reference;
  torch.amp + GradScaler  ``plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]``:
                          torch.autocast(float16) and a loss scale (init 2^16), as on a GPU;
  torch.amp, no scaler    ``precision="16-mixed"``: what a CPU user actually gets (Lightning creates
                          no GradScaler for a CPU accelerator: autocast without loss scaling);
  autoscale               ``plugins=[AutoscalePrecision()]`` (Inductor; ``--quick``: the eager executor).
Models: benchmarks/numerics' ``mlp-stress`` (6 hidden layers of 128; each step's loss divided by 2^12
and Adam's eps alike, so float32 training is unchanged and float16's gradients sit 12 binary orders
nearer underflow, spread over more layers than one global scale suits: benchmarks/numerics/tasks.py),
and the ConvNet of tests/models.py (conv + batch norm + a residual block: an ordinary model, loss as is).
The 32-layer MLP of benchmarks/stress_underflow.py, where one global scale zeroes whole layers
(docs/results/scaling.md), is not used: float32 Adam does not train it either in 300 steps (its first
layer's gradients are ~1e-16, far below Adam's eps), so no loss could tell the methods apart.

Hugging Face ``Trainer.train()`` (tiny random-init GPT-2 of the zoo: 2 layers, width 64, vocab 256,
sequences of 32 tokens drawn from a pool of 16; the Trainer's defaults: fused AdamW, linear decay;
lr 1e-3, batch 8):
  float32                 ``Trainer``;
  torch.amp               ``Trainer`` with ``TrainingArguments(fp16=True)``: run, and what accelerate
                          made of it is reported (on CPU it builds no GradScaler and no autocast);
  autoscale               ``AutoscaleTrainer`` (Inductor; ``--quick``: eager).

Per run: the **final loss** is the trained weights' float32 eager loss on held-out data (digits' test
split; GPT-2: the pool of 16 sequences), so that every method is judged by the same arithmetic; its
**gap** is |final - float32's final| / the initial loss. **Verdict**: for a torch.amp row, who is
closer to float32, autoscale or that row (a tie when the gaps differ by less than 0.5% of the initial
loss); the autoscale row states the comparison with the scaled torch.amp baseline. **Skipped**:
autoscale's ``scaler.skipped_steps``; torch.amp's scale decreases (each is a skipped step); "n/a"
without a scaler (then the steps whose gradients were not finite, applied anyway, are counted).
**Step ms**: median wall time of a training batch (Lightning's ``on_train_batch_start`` to ``_end``;
HF's ``on_step_begin`` to ``_end``) after 3 warm-up steps; **first step s**: the first batch, which
holds Dynamo's and the backend's compile for autoscale; **fit s**: the whole ``fit``/``train`` call.
**Graphs**: the graphs autoscale's backend compiled.

On this CPU torch.autocast computes float16 natively (GEMMs with float16 inputs and outputs) and
autoscale emulates float16 (float16 storage and rounding, float32 GEMM arithmetic); both round where a
float16 GPU would, but their step times compare different kernels and say little about a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import autoscale
from benchmarks import machine_line, write_report
from benchmarks.numerics.tasks import STRESS_DIVISOR, TASKS, Data

log = logging.getLogger("benchmarks.integrations")

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "integrations.md"
TIE = 0.005  # gaps closer than this (a fraction of the initial loss) are a tie
WARMUP = 3  # steps left out of the median step time
LIGHTNING_LR, LIGHTNING_BATCH = 1e-3, 64
HF_LR, HF_BATCH, HF_POOL, HF_SAMPLES = 1e-3, 8, 16, 64

FLOAT32 = "float32"
AMP_SCALED = "torch.amp + GradScaler"
AMP_UNSCALED = "torch.amp, no scaler (precision=\"16-mixed\")"
AMP_HF = "torch.amp (fp16=True)"
AUTOSCALE = "autoscale"
LIGHTNING, HF = "Lightning Trainer.fit", "HF Trainer.train"
METHODS = {LIGHTNING: (FLOAT32, AMP_SCALED, AMP_UNSCALED, AUTOSCALE), HF: (FLOAT32, AMP_HF, AUTOSCALE)}
BASELINE = {LIGHTNING: AMP_SCALED, HF: AMP_HF}  # what the autoscale row's verdict compares with


@dataclass
class Run:
    """One training run through a framework; what the report's row shows."""

    framework: str
    model: str
    method: str
    steps: int
    initial_loss: float = math.nan  # float32 eval loss of the initial weights
    final_loss: float = math.nan  # float32 eval loss of the trained weights
    train_losses: list[float] = field(default_factory=list)  # the framework's training loss per step
    skipped: int | None = None  # None: no scaler that could skip
    nonfinite_steps: int | None = None  # steps with inf/nan gradients applied anyway (no scaler)
    step_ms: float = math.nan
    first_step_s: float = math.nan
    fit_s: float = math.nan
    graphs: int | None = None  # autoscale backend records
    scale_range: str = ""  # torch.amp: first..last loss scale; autoscale: per-layer scales at the end
    note: str = ""
    error: str = ""

    @property
    def finite(self) -> bool:
        return not self.error and math.isfinite(self.final_loss) and all(map(math.isfinite, self.train_losses))


# ------------------------------------------------------------------------------------------ data/models


def _digits() -> Data:
    from benchmarks.numerics.tasks import _digits as digits  # bundled with scikit-learn: no download

    return digits()


def stress_mlp(seed: int = 0) -> nn.Module:
    """benchmarks/numerics' ``mlp-stress`` network: Linear(64, 128), 6 hidden layers of 128, ReLU, 10 classes."""
    return TASKS["mlp-stress"].model(seed)


def convnet(seed: int = 0) -> nn.Module:
    """tests/models.py's ConvNet (conv, batch norm, a residual block, pooling, linear head), 10 classes."""
    from tests.models import ConvNet

    torch.manual_seed(seed)
    return ConvNet(c=8, classes=10)


@dataclass(frozen=True)
class LightningCase:
    """A Lightning model and its data: ``build(seed)`` makes the network, ``shape`` views a digit;
    ``loss_divisor`` divides each training step's loss and Adam's eps (the stress recipe)."""

    name: str
    build: Callable[[int], nn.Module]
    shape: tuple[int, ...]
    steps: int
    quick_steps: int
    loss_divisor: float = 1.0

    def data(self) -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
        d = _digits()
        return (TensorDataset(d.x_train.view(-1, *self.shape), d.y_train), d.x_test.view(-1, *self.shape),
                d.y_test)


LIGHTNING_CASES = (
    LightningCase(f"mlp-stress (6 x 128, loss / 2^{int(math.log2(STRESS_DIVISOR))})", stress_mlp, (64,), steps=300,
                  quick_steps=40, loss_divisor=STRESS_DIVISOR),
    LightningCase("ConvNet (tests/models.py)", convnet, (1, 8, 8), steps=200, quick_steps=30),
)


def gpt2(seed: int = 0) -> nn.Module:
    """The zoo's GPT-2, with ``loss_type`` set: unset, transformers logs a warning inside the forward,
    which breaks the graph into three (docs/integrations/huggingface.md)."""
    from benchmarks.zoo.models import gpt2 as zoo_gpt2

    model, _ = zoo_gpt2(seed)
    model.loss_type = "ForCausalLM"
    return model


class _Tokens(Dataset[dict[str, torch.Tensor]]):
    """``HF_SAMPLES`` sequences drawn from a pool of ``HF_POOL`` random ones: learnable in a few dozen steps."""

    def __init__(self) -> None:
        from benchmarks.zoo.models import SEQ, VOCAB

        g = torch.Generator().manual_seed(1)
        self.pool = torch.randint(1, VOCAB, (HF_POOL, SEQ), generator=g)
        self.ids = self.pool[torch.randint(0, HF_POOL, (HF_SAMPLES,), generator=g)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# -------------------------------------------------------------------------------------------- helpers


def _fresh_copy(build: Callable[[int], nn.Module], trained: nn.Module) -> nn.Module:
    """A new, uncompiled model with ``trained``'s weights and buffers, for a float32 eager evaluation that
    sees neither autoscale's compiled forward nor anything its scaler attached to the module."""
    fresh = build(0)
    state = trained.state_dict()
    fresh.load_state_dict({k: state[k] for k in fresh.state_dict()})
    return fresh.eval()


@torch.no_grad()
def _classifier_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(F.cross_entropy(model.eval()(x), y))


@torch.no_grad()
def _lm_loss(model: nn.Module, ids: torch.Tensor) -> float:
    return float(model.eval()(input_ids=ids, labels=ids).loss)


def _error(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:300]


def _median_ms(times: list[float]) -> float:
    later = times[WARMUP:] or times[1:] or times
    return 1e3 * statistics.median(later) if later else math.nan


def _layer_scales(scaler: autoscale.GradScaler) -> str:
    scales = [r.scale for r in scaler.layers() if r.name != "(root)" and r.scale > 0]
    if not scales:
        return ""
    return f"layers 2^{math.log2(min(scales)):.0f}..2^{math.log2(max(scales)):.0f}"


# ------------------------------------------------------------------------------------------- Lightning


def _lightning_run(case: LightningCase, method: str, steps: int, executor: str) -> Run:
    """Train ``case`` with one method through ``L.Trainer.fit``."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from autoscale.integrations.lightning import AutoscalePrecision

    class Classifier(L.LightningModule):
        """The network as a LightningModule: the loss is taken from ``self(x)``, the forward autoscale compiles."""

        def __init__(self, net: nn.Module, divisor: float) -> None:
            super().__init__()
            self.net, self.divisor = net, divisor
            self.losses: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.losses.append(loss.detach())  # recorded undivided, comparable with the eval loss
            return loss / self.divisor

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=LIGHTNING_LR, eps=1e-8 / self.divisor)

    class Probe(L.Callback):
        """Step times; torch.amp's loss scale after every step; non-finite gradients without a scaler."""

        def __init__(self, check_grads: bool) -> None:
            self.times: list[float] = []
            self.scales: list[float] = []
            self.nonfinite = 0
            self.check_grads = check_grads
            self._start = 0.0

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            self._start = time.perf_counter()

        def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, opt: Any) -> None:
            if self.check_grads:
                grads = [p.grad for p in module.parameters() if p.grad is not None]
                self.nonfinite += not all(bool(torch.isfinite(g).all()) for g in grads)

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            self.times.append(time.perf_counter() - self._start)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if isinstance(scaler, torch.amp.GradScaler):
                self.scales.append(scaler.get_scale())

    dataset, x_test, y_test = case.data()
    net = case.build(0)
    run = Run(LIGHTNING, case.name, method, steps, initial_loss=_classifier_loss(case.build(0), x_test, y_test))
    plugin: Any = None
    kwargs: dict[str, Any] = {}
    if method == FLOAT32:
        kwargs["precision"] = "32-true"
    elif method == AMP_SCALED:
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    elif method == AMP_UNSCALED:
        kwargs["precision"] = "16-mixed"
    else:
        plugin = AutoscalePrecision(config=autoscale.Config(executor=executor))  # type: ignore[arg-type]
    probe = Probe(check_grads=method == AMP_UNSCALED)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, limit_val_batches=0, plugins=[plugin] if plugin else None,
                        callbacks=[probe], **kwargs)
    model = Classifier(net, case.loss_divisor)
    # the same batches in the same order for every method: a fresh generator with the same seed
    loader = DataLoader(dataset, batch_size=LIGHTNING_BATCH, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        trainer.fit(model, train_dataloaders=loader)
    except Exception as e:  # reported in the table: one failing run must not stop the others
        run.error = _error(e)
        log.exception("%s / %s / %s failed", LIGHTNING, case.name, method)
    run.fit_s = time.perf_counter() - start
    run.train_losses = [float(v) for v in model.losses]
    run.step_ms, run.first_step_s = _median_ms(probe.times), (probe.times[0] if probe.times else math.nan)
    run.final_loss = _classifier_loss(_fresh_copy(case.build, net), x_test, y_test)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if method == AUTOSCALE and isinstance(plugin, AutoscalePrecision):
        run.graphs = len(plugin.backend.records)
        if not run.error:
            run.skipped, run.scale_range = plugin.scaler.skipped_steps, _layer_scales(plugin.scaler)
    elif isinstance(scaler, torch.amp.GradScaler):
        run.skipped = sum(b < a for a, b in zip(probe.scales, probe.scales[1:], strict=False))
        if probe.scales:
            first = 2.0**16  # GradScaler's init_scale, before the first update
            run.skipped += probe.scales[0] < first
            run.scale_range = f"2^16 -> 2^{math.log2(probe.scales[-1]):.0f}"
    elif method == AMP_UNSCALED:
        run.nonfinite_steps = probe.nonfinite
        run.note = f"trainer.precision_plugin: {type(trainer.precision_plugin).__name__}, scaler {scaler!r}"
    return run


# ---------------------------------------------------------------------------------------- Hugging Face


def _hf_run(method: str, steps: int, executor: str, workdir: Path) -> Run:
    """Train the tiny GPT-2 with one method through ``transformers.Trainer.train``."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from autoscale.integrations.huggingface import AutoscaleTrainer

    class Probe(TrainerCallback):  # type: ignore[misc]
        """Step times (the Trainer's optimizer step: forward, backward, clip, step, schedule)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self._start = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.times.append(time.perf_counter() - self._start)

    dataset = _Tokens()
    model = gpt2(0)
    run = Run(HF, "GPT-2 (zoo: 2 layers, width 64)", method, steps, initial_loss=_lm_loss(gpt2(0), dataset.pool))
    args = TrainingArguments(output_dir=str(workdir / method.replace(" ", "_")), use_cpu=True, report_to=[],
                             per_device_train_batch_size=HF_BATCH, max_steps=steps, learning_rate=HF_LR, seed=0,
                             save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                             fp16=method == AMP_HF)
    probe = Probe()
    trainer: Trainer
    if method == AUTOSCALE:
        trainer = AutoscaleTrainer(model=model, args=args, train_dataset=dataset, callbacks=[probe],
                                   autoscale_config=autoscale.Config(executor=executor))  # type: ignore[arg-type]
    else:
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[probe])
    trainer.remove_callback(PrinterCallback)  # with disable_tqdm it prints every log line to stdout
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        trainer.train()
    except Exception as e:  # reported in the table: a refusal is a result here
        run.error = _error(e)
        if method != AMP_HF:
            log.exception("%s / %s failed", HF, method)
    run.fit_s = time.perf_counter() - start
    run.train_losses = [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    run.step_ms, run.first_step_s = _median_ms(probe.times), (probe.times[0] if probe.times else math.nan)
    run.final_loss = _lm_loss(_fresh_copy(gpt2, model), dataset.pool)
    acc = trainer.accelerator
    if method == AUTOSCALE:
        run.graphs = len(acc.autoscale_backend.records)
        if acc.scaler is not None:
            run.skipped, run.scale_range = acc.scaler.skipped_steps, _layer_scales(acc.scaler)
    elif method == AMP_HF:
        scaler = acc.scaler
        run.note = (f"accelerate: mixed_precision={acc.mixed_precision!r}, native_amp={acc.native_amp}, "
                    f"scaler={type(scaler).__name__ if scaler is not None else None}")
        if scaler is None:
            run.note += " (no autocast, no GradScaler: the run trains in float32)"
    return run


# ---------------------------------------------------------------------------------------------- report


def gap(run: Run, reference: Run) -> float:
    """|final loss - float32's| / float32's initial loss (inf when either did not finish finite)."""
    if not (run.finite and reference.finite):
        return math.inf
    return abs(run.final_loss - reference.final_loss) / abs(reference.initial_loss)


def verdict(autoscale_gap: float, other_gap: float) -> str:
    """Who is closer to float32: "autoscale", "torch.amp", "tie" (within ``TIE``), or "neither" (both failed)."""
    if math.isinf(autoscale_gap) and math.isinf(other_gap):
        return "neither"
    if abs(autoscale_gap - other_gap) <= TIE:
        return "tie"
    return "autoscale" if autoscale_gap < other_gap else "torch.amp"


def _f(x: float | None, digits: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return ("inf" if x > 0 else "-inf") if math.isinf(x) else f"{x:{digits}}"


def rows(runs: list[Run]) -> list[dict[str, str]]:
    """The report's table, one row per run, as column -> text (the test reads these too)."""
    out = []
    groups: dict[tuple[str, str], dict[str, Run]] = {}
    for r in runs:
        groups.setdefault((r.framework, r.model), {})[r.method] = r
    for (framework, _), by_method in groups.items():
        ref, ours = by_method.get(FLOAT32), by_method.get(AUTOSCALE)
        for method, r in by_method.items():
            g = gap(r, ref) if ref else math.nan
            if method == FLOAT32:
                who = "reference"
            elif method == AUTOSCALE:
                base = by_method.get(BASELINE[framework])
                who = (f"{verdict(g, gap(base, ref))} (vs {BASELINE[framework]})" if base and ref else "-")
            else:
                who = verdict(gap(ours, ref), g) if ours and ref else "-"
            skipped = "n/a" if r.skipped is None else str(r.skipped)
            if r.nonfinite_steps is not None:
                skipped += f" ({r.nonfinite_steps} non-finite applied)"
            out.append({
                "framework": framework, "model": r.model, "method": method, "steps": str(r.steps),
                "initial loss": _f(r.initial_loss, ".4f"), "final loss": _f(r.final_loss, ".4f"),
                "gap to float32": "0" if method == FLOAT32 else _f(g, ".2e"), "verdict": who, "skipped": skipped,
                "step ms": _f(r.step_ms, ".1f"), "first step s": _f(r.first_step_s, ".2f"),
                "fit s": _f(r.fit_s, ".1f"), "graphs": "-" if r.graphs is None else str(r.graphs),
                "scales": r.scale_range or "-", "finite": "yes" if r.finite else "**no**"})
    return out


def markdown(runs: list[Run], *, machine: str, minutes: float, quick: bool, executor: str) -> str:
    table = rows(runs)
    columns = list(table[0]) if table else []
    lines = [f"Machine: {machine}. {'`--quick`' if quick else 'Full'} run, autoscale executor: {executor}. "
             f"Wall time: {minutes:.1f} min.", "",
             "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(row[c] for c in columns) + " |" for row in table]
    said = [f"* {r.framework} / {r.model} / {r.method}: " + "; ".join(x for x in (r.error, r.note) if x)
            for r in runs if r.error or r.note]
    if said:
        lines += ["", "Run notes (recorded by the benchmark):", "", *said]
    lines += ["", "Training loss per step (every 10th step and the last; the framework's own loss, in the "
              "method's precision):", ""]
    for r in runs:
        picked = [f"{i}:{x:.4g}" for i, x in enumerate(r.train_losses) if i % 10 == 0 or i == len(r.train_losses) - 1]
        lines.append(f"* {r.framework} / {r.model} / {r.method}: " + (" ".join(picked) or "-"))
    return "\n".join(lines) + "\n"


def measure(quick: bool, executor: str) -> list[Run]:
    """Every (framework, model, method) run, in the report's order."""
    runs: list[Run] = []
    for case in LIGHTNING_CASES:
        steps = case.quick_steps if quick else case.steps
        for method in METHODS[LIGHTNING]:
            runs.append(_lightning_run(case, method, steps, executor))
            _log(runs[-1])
    with tempfile.TemporaryDirectory(prefix="autoscale-bench-hf-") as tmp:
        for method in METHODS[HF]:
            runs.append(_hf_run(method, 12 if quick else 80, executor, Path(tmp)))
            _log(runs[-1])
    torch._dynamo.reset()
    return runs


def _log(r: Run) -> None:
    log.warning("%s / %s / %s: final loss %s (initial %s), skipped %s, step %s ms, first step %s s, fit %s s%s",
                r.framework, r.model, r.method, _f(r.final_loss, ".4f"), _f(r.initial_loss, ".4f"), r.skipped,
                _f(r.step_ms, ".1f"), _f(r.first_step_s, ".2f"), _f(r.fit_s, ".1f"),
                f" ERROR {r.error}" if r.error else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and the eager executor (about 25 s, 2 cores)")
    parser.add_argument("--executor", choices=("inductor", "eager"), default=None,
                        help="autoscale's executor (default: inductor; --quick: eager)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="the markdown report (default: docs/results/integrations.md; --quick: print only)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's numbers as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    for noisy in ("transformers", "lightning", "lightning.pytorch", "lightning.fabric", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning.*")
    executor = args.executor or ("eager" if args.quick else "inductor")
    output = args.output or (None if args.quick else DEFAULT_OUTPUT)
    start = time.perf_counter()
    runs = measure(args.quick, executor)
    versions = {}
    for name in ("lightning", "transformers", "accelerate"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "missing"
    machine = machine_line() + ", " + ", ".join(f"{k} {v}" for k, v in versions.items())
    body = markdown(runs, machine=machine, minutes=(time.perf_counter() - start) / 60, quick=args.quick,
                    executor=executor)
    if output is not None:
        title = "# Through the training frameworks: float32, torch.amp and autoscale"
        write_report(output, f"{title}\n\n{__doc__}\n{body}")
    if args.json is not None:
        args.json.write_text(json.dumps([{**asdict(r), "finite": r.finite} for r in runs], indent=1))
    print(body)


if __name__ == "__main__":
    main()
