"""``python -m benchmarks.numerics``: run every task × method × seed, write the report and plots.

Each finished run is appended to a JSON-lines cache (default ``benchmarks/numerics/.runs.jsonl``,
not committed); a later invocation reuses the runs it finds there for the same task, method, seed
and step count, so an interrupted benchmark resumes and the report can be rebuilt without
training (``--fresh`` retrains everything). The hand-written "What the numbers say" section of an
existing report is kept when the report is rewritten.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from benchmarks import machine_line, notes_of, with_run_line

from . import report
from .methods import METHODS
from .tasks import TASKS
from .train import RunResult, run

ROOT = Path(__file__).resolve().parents[2]
def _load(cache: Path) -> dict[tuple[str, str, int, int], RunResult]:
    runs = {}
    if cache.exists():
        for line in cache.read_text().splitlines():
            if line.strip():
                r = RunResult(**json.loads(line))
                runs[(r.task, r.method, r.seed, r.steps)] = r
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 seed, few steps (under 3 minutes)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per task and method (default 5; 1 with --quick)")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--cache", type=Path, default=Path(__file__).with_name(".runs.jsonl"))
    parser.add_argument("--fresh", action="store_true", help="ignore the cache and train every run again")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results",
                        help="where numerics.md and numerics/*.png go")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 5)
    if args.quick and args.out == parser.get_default("out"):
        args.out = args.out / "numerics_quick"  # a smoke run does not overwrite the real results

    from tqdm import tqdm

    cached = {} if args.fresh else _load(args.cache)
    plan = [(t, m, s) for t in args.tasks for m in args.methods for s in range(seeds)]
    runs: list[RunResult] = []
    start = time.perf_counter()
    with tqdm(plan, desc="numerics", unit="run", dynamic_ncols=True) as bar:
        for task_name, method_name, seed in bar:
            task = TASKS[task_name]
            steps = task.quick_steps if args.quick else task.steps
            bar.set_postfix_str(f"{task_name} {method_name} seed {seed}")
            result = cached.get((task_name, method_name, seed, steps))
            if result is None:
                result = run(task, METHODS[method_name], seed, quick=args.quick)
                args.cache.parent.mkdir(parents=True, exist_ok=True)
                with args.cache.open("a") as f:
                    f.write(json.dumps(dataclasses.asdict(result)) + "\n")
            runs.append(result)
    minutes = (time.perf_counter() - start) / 60

    summary = report.summarize(runs)
    out_md = args.out / "numerics.md"
    machine = machine_line()
    args.out.mkdir(parents=True, exist_ok=True)
    notes = notes_of(out_md)
    text = with_run_line(report.markdown(summary, seeds=seeds, quick=args.quick, machine=machine, minutes=minutes,
                                         notes=""))
    out_md.write_text(text + ("\n" + notes if notes else ""))
    written = report.plot(summary, runs, args.out / "numerics")
    print(f"wrote {os.path.relpath(out_md)} and {', '.join(os.path.relpath(p) for p in written)}")
    print(report.final_line(summary))


if __name__ == "__main__":
    main()
