"""Instructions per element of the fused scale kernel's loop, compiled for Hopper without a GPU.

    python -m benchmarks.kernel_sass [--json]    # prints a table; no GPU needed

The kernel is bound by the instructions it issues per element, not by memory: an H100 and an H200,
same SMs and clocks, 1.4x apart in memory bandwidth, ran it at the same rate (docs/results/
kernels.md). So its speed follows the length of its loop, which this counts without a GPU: Triton
compiles the kernel for sm_90 with the ``ptxas`` its package carries, its ``cuobjdump`` prints the
machine code, and the loop is the code between the backward branch and its target. Arguments are
specialized as Triton specializes them at run time for 16-byte aligned pointers and sizes
divisible by 16 (what makes the loads and stores vector-wide). Measured against the GPU: 37.2 and
38.9 instructions per element (8 and 4 warps) for the kernel that ran at 1657 and 1492 GB/s on 2^24
elements on an H200.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
import warnings
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget

from autoscale.kernels.scale_grad import LAUNCH, _scale_grad_kernel

SIGNATURE = {"g_ptr": "*fp16", "out_ptr": "*fp16", "stats_ptr": "*fp64", "scale_ptr": "*fp32", "carried_ptr": "*fp32",
             "n": "i32", "BLOCK_SIZE": "constexpr"}
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH = re.compile(r"BRA (0x[0-9a-f]+)")


@dataclass(frozen=True)
class Loop:
    """The kernel's loop: its instructions, per element, and by opcode."""

    instructions: int
    per_element: float
    opcodes: collections.Counter[str]


def sass(block: int, num_warps: int) -> str:
    """The kernel's machine code for sm_90 (Hopper), compiled here with Triton's own tools."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # (the interpreter patches triton.language: no compile)
        raise RuntimeError("compiling for sm_90 needs TRITON_INTERPRET unset")
    source = triton.compiler.ASTSource(fn=_scale_grad_kernel, signature=SIGNATURE, constexprs={"BLOCK_SIZE": block},
                                       attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout


def loop(block: int, num_warps: int) -> Loop:
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in _INSTRUCTION.finditer(sass(block, num_warps))]
    targets = [(at, int(b.group(1), 16)) for at, text in code if (b := _BRANCH.search(text))]
    backward = [(at, target) for at, target in targets if target < at]
    if len(backward) != 1:
        raise RuntimeError(f"expected one backward branch (the loop), found {len(backward)}")
    end, start = backward[0]
    body = [text for at, text in code if start <= at <= end]
    opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for text in body)
    return Loop(len(body), len(body) / (block / (32 * num_warps)), opcodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON object per launch shape")
    args = parser.parse_args()
    shapes = ((1024, 4), (1024, 8), (2048, 8))
    found = {shape: loop(*shape) for shape in shapes}
    if args.json:
        for (block, warps), f in found.items():
            print(json.dumps({"block": block, "warps": warps, "per_element": f.per_element, "opcodes": f.opcodes}))
        return
    print(f"triton {triton.__version__}, sm_90; the launch in use: {LAUNCH}\n")
    print("| block | warps | loop instructions | per element | most frequent |\n|---|---|---|---|---|")
    for (block, warps), f in found.items():
        top = ", ".join(f"{op} {k}" for op, k in f.opcodes.most_common(6))
        print(f"| {block} | {warps} | {f.instructions} | {f.per_element:.1f} | {top} |")


if __name__ == "__main__":
    main()
