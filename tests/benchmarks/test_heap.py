"""The benchmarks' C heap (``benchmarks.heap``): kept, a step's buffers fault no page once warm;
as glibc leaves it, a large buffer faults its pages in again at every allocation."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

_STEPS = """
import sys, torch
from benchmarks.heap import page_faults, retain_freed_memory
if sys.argv[1] == "kept":
    assert retain_freed_memory()
counts = []
for _ in range(10):  # a step's buffers, 40 MB and 4 MB: allocated, written, freed
    before = page_faults()
    a = torch.ones(10 * 2**20); b = torch.ones(2**20); del a; c = torch.ones(10 * 2**20); del b, c
    counts.append(page_faults() - before)
print(max(counts[-3:]))  # once warm
"""


def _faults_once_warm(heap: str) -> int:
    """The most page faults one of the last three of ten steps took, in a process of its own (the
    heap's setting lasts for the process). 40 MB is above the largest size glibc's malloc ever
    takes from its heap by default."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _STEPS, heap], capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_a_kept_heap_faults_no_page_where_glibcs_faults_every_one_in_again() -> None:
    pages = 10 * 2**20 * 4 // 4096  # a 40 MB buffer's 4 KiB pages
    assert _faults_once_warm("system") > pages // 2
    assert _faults_once_warm("kept") < pages // 100
