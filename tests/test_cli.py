"""The ``autoscale`` command line: help, exit codes and messages, diff/convert/report end to end.

End-to-end cases run ``python -m autoscale`` in subprocesses, started together (each pays ~2 s of
``import torch``, and a diff or convert a few seconds more); the matrix of error messages runs
``main()`` in-process, where a case costs milliseconds.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoscale
from autoscale import report
from autoscale.cli import main

REPO = Path(__file__).resolve().parent.parent
FACTORIES = "tests/cli_factories.py"  # relative to REPO, the subprocesses' working directory
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*argvs: Sequence[str], cwd: Path = REPO) -> list[Result]:
    """Run ``python -m autoscale ARGV`` for every argv at once; results in the same order."""
    procs = [subprocess.Popen([sys.executable, "-m", "autoscale", *argv], cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for argv in argvs]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        results.append(Result(p.returncode, out, err))
    return results


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    """``main(argv)`` in-process; argparse's usage errors (SystemExit) give their code."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return Result(code, out, err)


def assert_one_line_error(r: Result, *words: str) -> None:
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoscale "), r.stderr
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def train_with_telemetry(path: Path, steps: int = 16, overflow_at: Sequence[int] = (5, 11)) -> None:
    """A tiny MLP trained with autoscale.GradScaler(telemetry=path). Scale points at every layer
    (``placement="all"``, the default, spelled out), and the loss multiplied by 1e5 at
    ``overflow_at`` so that float16 gradients overflow (in the last layer first) and those steps are skipped.
    (Inputs blown up instead would overflow the forward, which is not the gradient scales' doing:
    see ``test_report_shows_forward_overflow_promotions``.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    cfg = autoscale.Config(executor="eager", scaling=autoscale.ScalingConfig(placement="all"))
    run: nn.Module = torch.compile(model, backend=autoscale.backend(cfg))  # type: ignore[assignment]
    scaler = autoscale.GradScaler(run, telemetry=path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        opt.zero_grad()
        loss = F.cross_entropy(run(x), y) * (1e5 if step in overflow_at else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def record(step: int, skipped: bool = False, **layers: float) -> str:
    return json.dumps({"step": step, "skipped": skipped, "loss_scale": 1.0,
                       "layers": {k: {"scale": v, "zero_rate": 0.01, "overflows": 0} for k, v in layers.items()}})


# --------------------------------------------------------------------------------- basics


def test_module_entry_prints_version() -> None:
    out = subprocess.run([sys.executable, "-m", "autoscale", "--version"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == autoscale.__version__


def test_usage_error_exits_2() -> None:
    out = subprocess.run([sys.executable, "-m", "autoscale", "--bogus"], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert "unrecognized arguments: --bogus" in out.stderr


def test_help_of_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    (diff,) = run_cli(["diff", "--help"])  # one through the real entry point, the rest in-process
    top, convert, rep = (run_main(capsys, *argv) for argv in (["--help"], ["convert", "--help"], ["report", "--help"]))
    for r in (top, diff, convert, rep):
        assert r.returncode == 0, r.stderr
        assert r.stderr == ""
    assert all(c in top.stdout for c in ("diff", "convert", "report", "--version"))
    assert "MODULE:FACTORY" in diff.stdout and "--backward-only" in diff.stdout and "example:" in diff.stdout
    assert "-o FILE" in convert.stdout and "example:" in convert.stdout
    assert "telemetry" in rep.stdout and "-o DIR" in rep.stdout and "example:" in rep.stdout


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_main(capsys)
    assert r.returncode == 0 and "commands" in r.stdout


# ---------------------------------------------------------------------------- error paths


@pytest.mark.parametrize(("spec", "words"), [
    ("missing.py:make", ["no such file", "missing.py"]),
    ("no_such_pkg.models:make", ["cannot import module", "no_such_pkg"]),
    (f"{FACTORIES}:nothing", ["has no factory 'nothing'", "tiny_mlp"]),
    ("tests.cli_factories:nothing", ["has no factory 'nothing'"]),
    (f"{FACTORIES}:not_a_factory", ["not callable", "int"]),
    (f"{FACTORIES}:needs_arguments", ["needs arguments", "width"]),
    (f"{FACTORIES}:raises", ["raised FileNotFoundError", "weights.pt"]),
    (f"{FACTORIES}:wrong_return", ["returned a Linear", "(model, example_inputs)"]),
    (f"{FACTORIES}:triple", ["3-item tuple", "(model, example_inputs)"]),
    (f"{FACTORIES}:not_a_module", ["str as the model", "torch.nn.Module"]),
    (f"{FACTORIES}:bad_inputs", ["dict as example_inputs"]),
])
def test_factory_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, spec: str,
                        words: list[str]) -> None:
    monkeypatch.chdir(REPO)
    for command in (["diff", spec], ["convert", spec, "-o", "unused.autoscale"]):
        assert_one_line_error(run_main(capsys, *command), *words)
    assert not (REPO / "unused.autoscale").exists()


def test_broken_module(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "broken_models.py").write_text("import torch\nraise ImportError('needs torchvision')\n")
    (tmp_path / "syntax_models.py").write_text("def make(:\n")
    r = run_main(capsys, "diff", f"{tmp_path}/broken_models.py:make")
    assert_one_line_error(r, "importing", "broken_models.py", "failed", "needs torchvision")
    assert_one_line_error(run_main(capsys, "diff", f"{tmp_path}/syntax_models.py:make"), "SyntaxError")


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(Exception, match="raised FileNotFoundError") as info:
        main(["diff", f"{REPO}/{FACTORIES}:raises", "--debug"])
    assert isinstance(info.value.__cause__, FileNotFoundError)


@pytest.mark.parametrize("spec", ["nocolon", "models.py:", ":make", "models.py:make-it", "my models:make"])
def test_malformed_spec_is_a_usage_error(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    r = run_main(capsys, "diff", spec)
    assert r.returncode == 2
    assert "MODULE:FACTORY" in r.stderr and "usage:" in r.stderr


def test_report_log_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = run_main(capsys, "report", str(tmp_path / "run.jsonl"))
    assert_one_line_error(missing, "no such telemetry log", "telemetry=")
    assert_one_line_error(run_main(capsys, "report", str(tmp_path)), "not a file")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert_one_line_error(run_main(capsys, "report", str(empty)), "empty", "telemetry=")
    cases = {
        "not JSON": record(1) + "\n{\"step\": 2, oops}\n",
        "JSON list": "[1, 2]\n",
        "has no 'layers'": '{"step": 1, "skipped": false, "loss_scale": 1.0}\n',
        "'skipped' is": record(1).replace("false", '"no"') + "\n",
        "layer 'fc'": record(1) + "\n" + record(2, fc=2.0).replace('"overflows": 0', '"overflows": "x"') + "\n",
    }
    for words, text in cases.items():
        log = tmp_path / "bad.jsonl"
        log.write_text(text)
        line = "2" if text.count("\n") == 2 else "1"
        assert_one_line_error(run_main(capsys, "report", str(log)), words, f"bad.jsonl:{line}:", f"line {line}",
                              "not the scaler's telemetry")


def test_diff_telemetry_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A missing or foreign --telemetry log is named as such, before the model is captured."""
    spec = f"{REPO}/{FACTORIES}:single_tensor"
    missing = run_main(capsys, "diff", spec, "--telemetry", str(tmp_path / "run.jsonl"))
    assert_one_line_error(missing, "--telemetry", "no such file", "telemetry=LOG")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    assert_one_line_error(run_main(capsys, "diff", spec, "--telemetry", str(bad)), "--telemetry", "bad.jsonl:1:")


def test_errors_end_to_end(tmp_path: Path) -> None:
    """The real entry point: one line on stderr and no traceback (argparse's exit 2: see --bogus)."""
    raised, log = run_cli(["convert", f"{FACTORIES}:raises", "-o", str(tmp_path / "m.autoscale")],
                          ["report", str(tmp_path / "run.jsonl")])
    assert_one_line_error(raised, "raised FileNotFoundError")
    assert_one_line_error(log, "no such telemetry log")


# --------------------------------------------------------------------------------- diff


class _FakeDiff:
    """Stands in for autoscale.diff's GraphDiff where only the CLI's choices are under test."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def to_text(self, **kw: Any) -> str:
        self.calls.append(("text", kw))
        return "text"

    def to_json(self, **kw: Any) -> dict[str, Any]:
        self.calls.append(("json", kw))
        return {"a": [1]}

    def to_html(self, **kw: Any) -> str:
        self.calls.append(("html", kw))
        return "<html></html>"

    def __str__(self) -> str:
        return "summary"


def test_diff_options_reach_the_renderer(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    diff_module = importlib.import_module("autoscale.diff")  # (autoscale.diff is the function)
    fake = _FakeDiff()
    seen: list[tuple[Any, ...]] = []

    measured: list[bool] = []

    def fake_diff(model: nn.Module, inputs: tuple[Any, ...], **kw: Any) -> _FakeDiff:
        seen.append(inputs)
        measured.append(kw["measure"])
        return fake

    monkeypatch.setattr(diff_module, "diff", fake_diff)
    spec = f"{REPO}/{FACTORIES}:single_tensor"
    assert run_main(capsys, "diff", spec).stdout == "text\n"
    assert isinstance(seen[-1], tuple) and len(seen[-1]) == 1  # the one tensor, wrapped
    run_main(capsys, "diff", spec, "--color", "always", "--backward-only")
    run_main(capsys, "diff", spec, "--color", "always", "-o", str(tmp_path / "d.txt"))
    run_main(capsys, "diff", spec, "--summary", "--measure")
    off = {"backward_only": False, "summary_only": False}
    assert [c[1] for c in fake.calls] == [{**off, "color": False},  # stdout is not a TTY
                                          {**off, "color": True, "backward_only": True},
                                          {**off, "color": True},
                                          {**off, "color": False, "summary_only": True}]
    assert measured == [False, False, False, True]
    r = run_main(capsys, "diff", spec, "--format", "json")
    assert json.loads(r.stdout) == {"a": [1]} and "\n  " in r.stdout  # pretty-printed
    r = run_main(capsys, "diff", spec, "--format", "html", "-o", str(tmp_path / "sub" / "d.html"))
    assert r.returncode == 0 and "wrote" in r.stdout and "summary" in r.stdout
    assert (tmp_path / "sub" / "d.html").read_text().startswith("<html")


def test_diff_and_convert_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("autoscale.diff")
    convert_module = pytest.importorskip("autoscale.convert")
    text, converted, untraceable = run_cli(
        ["diff", "tests.cli_factories:tiny_mlp"],
        ["convert", f"{FACTORIES}:tiny_mlp", "-o", str(tmp_path / "m.autoscale")],
        ["diff", f"{FACTORIES}:untraceable"])
    assert text.returncode == 0, text.stderr
    assert "--- forward" in text.stdout and "+++ backward" in text.stdout and "float16" in text.stdout
    assert "\x1b[" not in text.stdout  # not a terminal: no colour
    assert converted.returncode == 0, converted.stderr
    assert "wrote" in converted.stdout and (tmp_path / "m.autoscale").stat().st_size > 0
    model = convert_module.load(tmp_path / "m.autoscale")
    assert model(torch.randn(4, 8)).shape == (4, 4)
    assert_one_line_error(untraceable, "could not diff", "untraceable", "must have same reduction dim")
    assert "fake_tensor" not in untraceable.stderr  # torch's own error log is kept quiet


def test_diff_json_and_html(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The real diff, rendered by the CLI (in-process: the subprocess path is covered above)."""
    pytest.importorskip("autoscale.diff")
    r = run_main(capsys, "diff", f"{REPO}/{FACTORIES}:single_tensor", "--format", "json", "--backward-only")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert isinstance(doc, dict) and doc
    r = run_main(capsys, "diff", f"{REPO}/{FACTORIES}:tiny_mlp", "--format", "html", "-o", str(tmp_path / "d.html"))
    assert r.returncode == 0, r.stderr
    assert "<html" in (tmp_path / "d.html").read_text(encoding="utf-8")[:500].lower()
    assert r.stdout.startswith(f"wrote {tmp_path / 'd.html'}")


# ------------------------------------------------------------------------------- report


def test_report_on_a_real_training_log(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    train_with_telemetry(log)
    (r,) = run_cli(["report", str(log)])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "steps:         16 (steps 1-16)" in lines
    assert any(line.startswith("skipped steps: 2 ") and line.endswith(": 6, 12") for line in lines), r.stdout
    header = next(line for line in lines if line.startswith("layer"))
    for column in ("final scale", "min scale", "max scale", "mean zero rate", "overflows"):
        assert column in header
    rows = {line.split()[0]: line.split() for line in lines[lines.index(header) + 2:] if line.strip()
            and line.split()[0] in ("0", "2", "4")}
    assert set(rows) == {"0", "2", "4"}
    assert all(row[1].startswith("2^") for row in rows.values())
    # both overflows blamed on the last layer, where the gradient first overflows; an inf arriving is not the others'
    assert [rows[r][-1] for r in ("0", "2", "4")] == ["0", "0", "2"]
    out = tmp_path / "run_report"
    for name in ("scales.png", "zero_rates.png", "skipped.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
        assert str(out / name) in r.stdout


def test_report_output_dir_and_several_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    log.write_text("\n".join([record(1, fc=4.0), record(2, fc=8.0), "", record(1, fc=2.0),
                              record(2, True, fc=1.0), record(3, fc=2.0)]) + "\n")
    r = run_main(capsys, "report", str(log), "-o", str(tmp_path / "plots"))
    assert r.returncode == 0, r.stderr
    assert "2 runs" in r.stdout and "lines 4" in r.stdout  # the second run starts on line 4
    assert "steps:         3 (steps 1-3)" in r.stdout and "skipped steps: 1 (33.3 %): 2" in r.stdout
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["scales.png", "skipped.png", "zero_rates.png"]
    r = run_main(capsys, "report", str(log), "--no-plots", "-o", str(tmp_path / "none"))
    assert r.returncode == 0 and not (tmp_path / "none").exists()


def test_report_leaves_out_an_incomplete_last_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A run killed while writing its last record: the report covers the rest and says so."""
    log = tmp_path / "killed.jsonl"
    log.write_text(record(1, fc=2.0) + "\n" + record(2, fc=4.0) + "\n" + record(3, fc=4.0)[:25])
    r = run_main(capsys, "report", str(log), "--no-plots")
    assert r.returncode == 0, r.stderr
    assert "steps:         2 (steps 1-2)" in r.stdout and "line 3, the last, is incomplete" in r.stdout
    log.write_text(record(1, fc=2.0)[:25] + "\n" + record(2, fc=4.0) + "\n")  # cut off, then more: not a crash
    assert_one_line_error(run_main(capsys, "report", str(log)), "killed.jsonl:1:", "not JSON")


def test_summary_numbers(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    rows = [{"step": 1, "skipped": False, "loss_scale": 1.0, "layers": {"a": {"scale": 8.0, "zero_rate": 0.1,
                                                                                "overflows": 0}}},
            {"step": 2, "skipped": True, "loss_scale": 1.0, "layers": {"a": {"scale": 4.0, "zero_rate": 0.0,
                                                                               "overflows": 1},
                                                                         "b": {"scale": 3.0, "zero_rate": 0.0,
                                                                               "overflows": 1}}},
            {"step": 3, "skipped": False, "loss_scale": 1.0, "layers": {"a": {"scale": 16.0, "zero_rate": 0.3,
                                                                                "overflows": 1}}}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = report.summarize(report.load_telemetry(log))
    a, b = summary.layers
    assert (a.name, a.final_scale, a.min_scale, a.max_scale, a.overflows) == ("a", 16.0, 4.0, 16.0, 1)
    assert a.mean_zero_rate == pytest.approx(0.2) and a.max_zero_rate == pytest.approx(0.3)  # skipped step left out
    assert b.name == "b" and math.isnan(b.mean_zero_rate)  # only seen on a skipped step
    assert summary.skipped_steps == (2,)
    text = report.format_summary(summary)
    assert "2^4" in text and "2.00e-01" in text and "skipped steps: 1 (33.3 %): 2" in text


def test_report_without_per_layer_scales(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A dynamic-mode log: a loss scale, no layers. Tables say so, plots are still written."""
    log = tmp_path / "dyn.jsonl"
    log.write_text("".join(json.dumps({"step": i, "skipped": i == 3, "loss_scale": 2.0**(16 - (i >= 3)),
                                       "layers": {}}) + "\n" for i in range(1, 6)))
    r = run_main(capsys, "report", str(log))
    assert r.returncode == 0, r.stderr
    assert "no per-layer scales" in r.stdout and "2^15 at the end (min 2^15, max 2^16)" in r.stdout
    assert (tmp_path / "dyn_report" / "skipped.png").read_bytes().startswith(PNG_MAGIC)
