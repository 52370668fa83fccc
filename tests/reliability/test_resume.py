"""Checkpoint and resume: stop at step k, save, continue in a new process, compare with the
uninterrupted run at step 2k, bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers import assert_identical

REPO = Path(__file__).resolve().parents[2]
K = 40


def _script(*argv: str) -> None:
    out = subprocess.run([sys.executable, "-m", "tests.reliability.resume", *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]


def test_resumed_run_is_bit_identical_to_the_uninterrupted_one(tmp_path: Path) -> None:
    straight, checkpoint, resumed = tmp_path / "straight.pt", tmp_path / "ckpt.pt", tmp_path / "resumed.pt"
    _script("run", str(2 * K), str(straight))
    _script("stop", str(K), str(checkpoint))
    _script("resume", str(K), str(checkpoint), str(resumed))
    a, b = torch.load(straight, weights_only=False), torch.load(resumed, weights_only=False)
    assert a["step"] == b["step"] == 2 * K
    assert_identical(a["model"], b["model"])  # weights and buffers
    assert_identical(a["optimizer"]["state"], b["optimizer"]["state"])
    assert_identical(a["scaler"], b["scaler"])  # per-layer scales, statistics, step and skip counts
    state = torch.load(checkpoint, weights_only=False)
    assert state["step"] == K and state["scaler"]["steps"] == K
    assert float(state["scaler"]["scales"].max()) > 1.0  # the scaler had learnt scales worth restoring

