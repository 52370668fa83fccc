"""The training-framework benchmark (``python -m benchmarks.integrations``): its ``--quick`` run, end to end, in
a subprocess as a user runs it, into a temporary path (about 40 s on 2 cores: eager executor, a few dozen
steps; marked slow), and the verdict rule the report applies. The fast twins of the run are the plugins'
own ``Trainer.fit``/``Trainer.train``/Fabric/accelerate loops in tests/integrations, which check that each
trains through the backend close to float32."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the benchmark trains through Lightning: pip install -e '.[lightning]'")
pytest.importorskip("transformers", reason="the benchmark trains through transformers: pip install -e '.[huggingface]'")
pytest.importorskip("accelerate", reason="the benchmark trains through transformers: pip install -e '.[huggingface]'")

from benchmarks.integrations import AUTOSCALE, FLOAT32, LIGHTNING_CASES, METHODS, TIE, verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _table(markdown: str) -> list[dict[str, str]]:
    """The report's main table as rows of column -> cell."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[1:]]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("integrations")
    report, numbers = out / "integrations.md", out / "integrations.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "benchmarks.integrations", "--quick", "-o", str(report),
                           "--json", str(numbers)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return report.read_text(), json.loads(numbers.read_text())


@pytest.mark.slow
def test_every_run_finishes_with_a_finite_loss_and_float32_learns(quick_run: tuple[str, list[dict[str, Any]]]) -> None:
    _, runs = quick_run
    for r in runs:
        where = (r["framework"], r["model"], r["method"])
        assert r["finite"] and not r["error"], (where, r["error"])
        assert math.isfinite(r["final_loss"]) and r["train_losses"], where
        assert all(map(math.isfinite, r["train_losses"])), where
        assert len(r["train_losses"]) == r["steps"], where  # the framework ran every step it was asked for
        if r["method"] == FLOAT32:
            assert r["final_loss"] < r["initial_loss"], where  # the reference trained: gaps mean something


@pytest.mark.slow
def test_autoscale_runs_went_through_the_backend(quick_run: tuple[str, list[dict[str, Any]]]) -> None:
    """A run that silently trained in float32 (the plugin or the Trainer not compiling the model) would
    still finish: the backend's records and the per-layer scales show the forward was rewritten."""
    _, runs = quick_run
    ours = [r for r in runs if r["method"] == AUTOSCALE]
    assert len(ours) == len(LIGHTNING_CASES) + 1
    for r in ours:
        assert r["graphs"] is not None and r["graphs"] >= 1, r
        assert r["scale_range"].startswith("layers 2^"), r
        assert r["skipped"] is not None


@pytest.mark.slow
def test_the_table_lists_every_framework_and_method(quick_run: tuple[str, list[dict[str, Any]]]) -> None:
    report, _ = quick_run
    rows = _table(report)
    listed = {(row["framework"], row["model"], row["method"]) for row in rows}
    assert len(listed) == len(rows)  # no run listed twice
    assert {(f, m) for f, _, m in listed} == {(f, m) for f, methods in METHODS.items() for m in methods}
    lightning_models = {model for f, model, _ in listed if f == next(iter(METHODS))}
    assert len(lightning_models) == len(LIGHTNING_CASES)
    for row in rows:
        assert row["finite"] == "yes", row
        assert row["verdict"].split(" ")[0] in {"reference", "autoscale", "torch.amp", "tie"}, row
        assert row["final loss"] != "-" and row["step ms"] != "-", row


def test_verdict_calls_ties_and_failures() -> None:
    assert verdict(0.0, TIE / 2) == "tie"
    assert verdict(0.0, 3 * TIE) == "autoscale"
    assert verdict(3 * TIE, 0.0) == "torch.amp"
    assert verdict(math.inf, 0.0) == "torch.amp" and verdict(0.0, math.inf) == "autoscale"
    assert verdict(math.inf, math.inf) == "neither"
