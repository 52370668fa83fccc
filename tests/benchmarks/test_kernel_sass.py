"""The fused kernel's loop, compiled for Hopper here (no GPU): short, with vector-wide memory access.

The kernel is bound by the instructions it issues per element (docs/results/kernels.md), so the
length of its loop is its speed; this guards it. Counted with Triton's own ptxas and cuobjdump by
``benchmarks.kernel_sass``, in a process of its own: the tests run Triton's interpreter, which
patches ``triton.language`` and so cannot compile. The figures are this Triton version's codegen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def test_the_loop_is_short_and_its_memory_access_vector_wide() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.kernel_sass", "--json"], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        if "cuobjdump" in done.stderr or "ptxas" in done.stderr:  # (a Triton without its NVIDIA tools)
            pytest.skip(f"cannot compile for sm_90 here: {done.stderr[-300:]}")
        raise AssertionError(done.stderr)
    loops = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(loops) == 3
    for loop in loops:
        # 37-39 before each count became one predicate (the version an H200 ran at 1657 GB/s)
        assert loop["per_element"] <= 28, loop
        loads = [op for op in loop["opcodes"] if op.startswith("LDG")]
        stores = [op for op in loop["opcodes"] if op.startswith("STG")]
        assert loads and all(op in ("LDG.E.64", "LDG.E.128") for op in loads), loop
        assert stores and all(op in ("STG.E.64", "STG.E.128") for op in stores), loop
        assert loop["opcodes"][loads[0]] == loop["opcodes"][stores[0]] == 1, loop  # one of each per block
