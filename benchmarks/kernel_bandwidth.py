"""Achieved memory bandwidth of the fused scale kernel (needs a CUDA GPU).

    python -m benchmarks.kernel_bandwidth        # writes docs/results/kernels.md

For float16 gradients of 2^20 to 2^28 elements: the Triton kernel (``autoscale::scale_grad``),
the same computation in plain torch (``scale_grad_reference``, unfused: several passes), and a
plain device-to-device copy of the same bytes as the ceiling. Bytes counted: one read of the
gradient and one write of the result. Times are medians of ``triton.testing.do_bench``.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("kernel_bandwidth needs a CUDA GPU")
    import triton.testing

    from autoscale.kernels.reference import scale_grad_reference
    from autoscale.kernels.scale_grad import scale_grad

    factor, carried = torch.tensor(2.0**4, device="cuda"), torch.tensor(2.0**10, device="cuda")
    lines = ["| elements | fused kernel GB/s | torch reference GB/s | copy GB/s | fused / copy |",
             "|---|---|---|---|---|"]
    for exponent in (20, 22, 24, 26, 28):
        g = torch.randn(2**exponent, device="cuda", dtype=torch.float16) * 1e-3
        out = torch.empty_like(g)
        moved = 2 * g.numel() * g.element_size()
        fused = triton.testing.do_bench(partial(scale_grad, g, factor, carried), return_mode="median")
        reference = triton.testing.do_bench(partial(scale_grad_reference, g, factor, carried), return_mode="median")
        copy = triton.testing.do_bench(partial(out.copy_, g), return_mode="median")
        gbs = [moved / t / 1e6 for t in (fused, reference, copy)]
        lines.append(f"| 2^{exponent} | {gbs[0]:.0f} | {gbs[1]:.0f} | {gbs[2]:.0f} | {gbs[0] / gbs[2]:.2f} |")
    name = torch.cuda.get_device_name()
    text = (f"# Fused scale kernel bandwidth\n\n{__doc__}\nDevice: {name}, torch {torch.__version__}.\n\n"
            + "\n".join(lines) + "\n")
    print(text)
    Path(__file__).resolve().parent.parent.joinpath("docs", "results", "kernels.md").write_text(text)


if __name__ == "__main__":
    main()
