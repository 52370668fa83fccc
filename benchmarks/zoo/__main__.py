"""The public model zoo: float32, torch.amp and autoscale side by side on real architectures.

    python -m benchmarks.zoo [--models a,b,...] [--steps N] [--executor inductor|eager] [--quick]
                                                                        # writes docs/results/zoo.md

Models: ``benchmarks/zoo/models.py`` (Hugging Face transformers, small random-init configurations);
what is measured and how: ``benchmarks/zoo/compare.py``. ``--quick`` runs the fast subset that
``make test`` also runs (``QUICK``), with the eager executor.

A model passes when autoscale compiles it with no more graphs than Dynamo makes for a backend that
does nothing (no graph break of autoscale's), its loss trajectory stays within 5% of float32's
(relative to the initial loss) or at least as close as torch.amp's, and its first-step gradient
SQNR is at least torch.amp's minus 1 dB.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from pathlib import Path

from benchmarks import machine_line, write_report
from benchmarks.zoo.compare import LOSS_GAP_TARGET, SQNR_SLACK_DB, ZooResult, compare
from benchmarks.zoo.models import MODELS

log = logging.getLogger("benchmarks.zoo")

QUICK = ("mobilenet_v2", "gpt2", "bert", "t5")  # one of each family with a quirk: depthwise+BN, tied, encoder, enc-dec


def _f(x: float, digits: str = ".3g") -> str:
    if math.isnan(x):
        return "-"
    return ("inf" if x > 0 else "-inf") if math.isinf(x) else f"{x:{digits}}"


def _scales(r: ZooResult) -> str:
    lo, hi = r.scale_range
    if math.isnan(lo):
        return "-"
    return f"2^{math.log2(lo):.0f}..2^{math.log2(hi):.0f}"


def markdown(results: list[ZooResult], *, machine: str, minutes: float) -> str:
    passed = sum(r.ok for r in results)
    lines = [f"Machine: {machine}. Executor: {results[0].executor if results else '-'}. "
             f"{results[0].steps if results else 0} {results[0].optimizer if results else ''} steps (lr 1e-3) on "
             "one batch per model. "
             f"Wall time: {minutes:.1f} min.", "",
             f"**{passed} of {len(results)} models pass** (no graph break of autoscale's; loss gap "
             f"≤ {LOSS_GAP_TARGET:.0%} of the initial loss or ≤ torch.amp's; first-step gradient SQNR ≥ "
             f"torch.amp's − {SQNR_SLACK_DB:g} dB).", "",
             "| model | family | SQNR dB autoscale | SQNR dB torch.amp (at scale) | SQNR dB Inductor float32 | "
             "loss gap autoscale | "
             "loss gap torch.amp | skipped autoscale / torch.amp | graphs (plain) | recompiles | scaled layers "
             "(scales) | compile s | step ms autoscale / float32 eager | pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        amp_at = f" (2^{math.log2(r.amp_sqnr_scale):.0f})" if math.isfinite(r.amp_sqnr_scale) else ""
        lines.append(
            f"| {r.name} | {r.family} | {_f(r.sqnr.get('autoscale', math.nan), '.1f')} | "
            f"{_f(r.sqnr.get('torch.amp', math.nan), '.1f')}{amp_at} | "
            f"{_f(r.sqnr.get('inductor float32', math.nan), '.1f')} | {_f(r.gap('autoscale'), '.2g')} | "
            f"{_f(r.gap('torch.amp'), '.2g')} | "
            f"{r.skipped.get('autoscale', '-')} / {r.skipped.get('torch.amp', '-')} | "
            f"{r.graphs} ({r.plain_graphs}) | {r.recompiles} | {r.scaled_layers} ({_scales(r)}) | "
            f"{_f(r.compile_s, '.1f')} | {_f(r.step_ms.get('autoscale', math.nan), '.1f')} / "
            f"{_f(r.step_ms.get('float32', math.nan), '.1f')} | {'yes' if r.ok else '**no**'} |")
    notes = []
    for r in results:
        said = []
        if r.error:
            said.append(f"autoscale stopped: `{r.error}`")
        if r.unknown_ops:
            said.append("ops not in the precision tables: " + ", ".join(r.unknown_ops))
        if r.promoted:
            said.append("promoted to float32 at run time: " + ", ".join(r.promoted))
        if said:
            notes.append(f"* {r.name}: " + "; ".join(said))
    if notes:
        lines += ["", *notes]
    lines += ["", "Losses per step (float32 / torch.amp / autoscale):", ""]
    for r in results:
        per = " / ".join(" ".join(_f(x, ".4g") for x in r.losses.get(m, [])) for m in ("float32", "torch.amp",
                                                                                       "autoscale"))
        lines.append(f"* {r.name}: {per}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help="comma-separated names (default: all; --quick: the fast subset)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--executor", choices=("inductor", "eager"), default=None,
                        help="autoscale's executor (default: inductor; --quick: eager)")
    parser.add_argument("--quick", action="store_true", help=f"the fast subset ({', '.join(QUICK)}), eager executor")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="default: docs/results/zoo.md (--quick: print only)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    names = [n for n in args.models.split(",") if n] or (list(QUICK) if args.quick else list(MODELS))
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; the zoo has {', '.join(MODELS)}")
    executor = args.executor or ("eager" if args.quick else "inductor")
    output = args.output or (None if args.quick else Path("docs/results/zoo.md"))
    start = time.perf_counter()
    results = []
    for name in names:
        r = compare(MODELS[name], steps=args.steps, executor=executor, optimizer=args.optimizer)
        log.warning("%s: %s (gap %.2g vs %.2g, SQNR %.1f vs %.1f dB, skipped %s)", name, "pass" if r.ok else "FAIL",
                    r.gap("autoscale"), r.gap("torch.amp"), r.sqnr.get("autoscale", math.nan),
                    r.sqnr.get("torch.amp", math.nan), r.skipped)
        results.append(r)
    machine = machine_line()
    body = markdown(results, machine=machine, minutes=(time.perf_counter() - start) / 60)
    if output is not None:
        write_report(output, f"# The public model zoo: float32, torch.amp and autoscale\n\n{__doc__}\n{body}")
    print(body)


if __name__ == "__main__":
    main()
