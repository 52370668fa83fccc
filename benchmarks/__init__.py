"""Benchmarks: each writes a report under docs/results/ (see README.md's Results)."""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path
from typing import Literal

import torch
from torch import nn

Size = Literal["tiny", "quick", "full", "large"]
"""How large a step benchmark's models are: ``--tiny`` (where the benchmark has it: its arithmetic
negligible, a step is what it costs besides), ``--quick``, the default, or ``--large`` (GPU only)."""

NOTES_HEADING = "## What the numbers say"


class Autocast(nn.Module):
    """``model`` under ``torch.autocast(device, float16)``, its output as float32: torch.amp's
    forward, the baseline that compiles it (torch.compile of this module) is measured against."""

    def __init__(self, model: nn.Module, device: str) -> None:
        super().__init__()
        self.model, self.device = model, device

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device, dtype=torch.float16):
            out: torch.Tensor = self.model(*inputs)
        return out.float()


def notes_of(path: Path) -> str:
    """The hand-written analysis of an existing report, from ``NOTES_HEADING`` to the end ("" when
    there is none), so that a re-run replaces the figures and keeps the analysis for review."""
    if not path.exists():
        return ""
    text = path.read_text()
    return text[text.index(NOTES_HEADING):] if NOTES_HEADING in text else ""


def results_path(stem: str, *, size: Size = "full", device: str = "cpu") -> Path:
    """docs/results/<stem>[_tiny|_quick|_large][_<device>].md: where a benchmark's report goes by default."""
    suffix = ("" if size == "full" else f"_{size}") + ("" if device == "cpu" else f"_{device}")
    return Path(__file__).resolve().parent.parent / "docs" / "results" / f"{stem}{suffix}.md"


def step_parser(doc: str | None, stem: str, quick_help: str, large_help: str | None = None,
                tiny_help: str | None = None) -> argparse.ArgumentParser:
    """The options of a benchmark of training steps: --quick (and --large and --tiny, where the
    benchmark has such models: ``large_help``, ``tiny_help``), --device, -o (see ``publish``).
    ``size_of`` reads the size."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help=quick_help)
    if large_help is not None:
        sizes.add_argument("--large", action="store_true", help=large_help)
    if tiny_help is not None:
        sizes.add_argument("--tiny", action="store_true", help=tiny_help)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("-o", "--output", type=Path, help=f"report path (default docs/results/{stem}*.md)")
    return parser


def publish(text: str, stem: str, args: argparse.Namespace) -> None:
    """Write a ``step_parser`` benchmark's report where its options say, and print it."""
    write_report(args.output or results_path(stem, size=size_of(args), device=args.device), text)
    print(text)


def size_of(args: argparse.Namespace) -> Size:
    """The model size a ``step_parser`` benchmark's options ask for."""
    if getattr(args, "tiny", False):
        return "tiny"
    return "quick" if args.quick else "large" if getattr(args, "large", False) else "full"


def write_report(path: Path, text: str) -> None:
    """Write a report's ``text`` to ``path``, then the run's date (``run_line``), then the
    hand-written analysis of the report already there (``notes_of``), kept. docs/results/README.md,
    the index, gives each report's latest figure with that date."""
    notes = notes_of(path)
    path.write_text(with_run_line(text) + ("\n" + notes if notes else ""))


def run_line() -> str:
    """The line that dates a report's figures: the day the run wrote them."""
    return f"Run on {datetime.date.today().isoformat()}."


def with_run_line(text: str) -> str:
    """A report's generated ``text`` with ``run_line`` after it."""
    return text.rstrip("\n") + "\n\n" + run_line() + "\n"


def machine_line() -> str:
    """The machine line of a CPU report: architecture, threads, torch version."""
    return f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
