"""Benchmarks: each writes a report under docs/results/ (see README.md's Results)."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

NOTES_HEADING = "## What the numbers say"


def notes_of(path: Path) -> str:
    """The hand-written analysis of an existing report, from ``NOTES_HEADING`` to the end ("" when
    there is none), so that a re-run replaces the figures and keeps the analysis for review."""
    if not path.exists():
        return ""
    text = path.read_text()
    return text[text.index(NOTES_HEADING):] if NOTES_HEADING in text else ""


def results_path(stem: str, *, quick: bool = False, device: str = "cpu") -> Path:
    """docs/results/<stem>[_quick][_<device>].md: where a benchmark's report goes by default."""
    suffix = ("_quick" if quick else "") + ("" if device == "cpu" else f"_{device}")
    return Path(__file__).resolve().parent.parent / "docs" / "results" / f"{stem}{suffix}.md"


def step_parser(doc: str | None, stem: str, quick_help: str) -> argparse.ArgumentParser:
    """The options of a benchmark of training steps: --quick, --device, -o (see ``publish``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("-o", "--output", type=Path, help=f"report path (default docs/results/{stem}*.md)")
    return parser


def publish(text: str, stem: str, args: argparse.Namespace) -> None:
    """Write a ``step_parser`` benchmark's report where its options say, and print it."""
    write_report(args.output or results_path(stem, quick=args.quick, device=args.device), text)
    print(text)


def write_report(path: Path, text: str) -> None:
    """Write a report's ``text`` to ``path``, keeping the hand-written analysis of the report already
    there (``notes_of``) after it."""
    notes = notes_of(path)
    path.write_text(text + ("\n" + notes if notes else ""))


def machine_line() -> str:
    """The machine line of a CPU report: architecture, threads, torch version."""
    return f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
