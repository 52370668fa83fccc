"""Achieved memory bandwidth of the fused scale kernel (needs a CUDA GPU).

    python -m benchmarks.kernel_bandwidth            # writes docs/results/kernels.md
    python -m benchmarks.kernel_bandwidth --sweep    # also: every launch shape (autoscale.kernels.Launch)

For float16 gradients of 2^20 to 2^28 elements: the fused op (``autoscale::scale_grad``: the
Triton kernel, its output and its two zeroed statistics buffers), the same computation in plain
torch (``scale_grad_reference``, unfused: several passes), and a plain device-to-device copy of
the same bytes as the ceiling. Bytes counted: one read of the gradient and one write of the
result. The op and the copy are timed two ways, medians of ``triton.testing``: called from Python
in a loop (``do_bench``: where the op's host cost, its dispatch and three allocations, exceeds the
kernel's time, it shows), and replayed as a CUDA graph (``do_bench_cudagraph``: the device's time
alone, as in a graph launched without Python in between). The reference copies a host value to
the device, which a graph cannot capture: it is timed in the loop only.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from functools import partial

import torch

from benchmarks import results_path, write_report

SIZES = (20, 22, 24, 26, 28)


def _gbs(moved: int, fn: Callable[[], object], graph: bool) -> float:
    """GB/s of ``fn`` moving ``moved`` bytes, called in a loop or replayed as a CUDA graph."""
    import triton.testing

    bench = triton.testing.do_bench_cudagraph if graph else triton.testing.do_bench
    return moved / bench(fn, return_mode="median") / 1e6


def _gradient(exponent: int) -> torch.Tensor:
    return torch.randn(2**exponent, device="cuda", dtype=torch.float16) * 1e-3


def _moved(g: torch.Tensor) -> int:
    """The bytes a pass over ``g`` must move: one read of it, one write of the result."""
    return 2 * g.numel() * g.element_size()


def table(scale: torch.Tensor, carried: torch.Tensor) -> list[str]:
    from autoscale.kernels.reference import scale_grad_reference
    from autoscale.kernels.scale_grad import scale_grad

    lines = ["| elements | fused op GB/s (loop / graph) | copy GB/s (loop / graph) "
             "| fused / faster copy (loop / graph) | torch reference GB/s (loop) |", "|---|---|---|---|---|"]
    for exponent in SIZES:
        g = _gradient(exponent)
        out = torch.empty_like(g)
        moved = _moved(g)
        fused, copy = partial(scale_grad, g, scale, carried), partial(out.copy_, g)
        loop = [_gbs(moved, fn, graph=False) for fn in (fused, copy)]
        graph = [_gbs(moved, fn, graph=True) for fn in (fused, copy)]
        reference = _gbs(moved, partial(scale_grad_reference, g, scale / carried, carried), graph=False)
        ceiling = max(loop[1], graph[1])  # (a copy replayed in a graph ran slower at 2^28 on an H200)
        lines.append(f"| 2^{exponent} | {loop[0]:.0f} / {graph[0]:.0f} | {loop[1]:.0f} / {graph[1]:.0f} "
                     f"| {loop[0] / ceiling:.2f} / {graph[0] / ceiling:.2f} | {reference:.0f} |")
    return lines


def sweep(scale: torch.Tensor, carried: torch.Tensor) -> list[str]:
    """Every launch shape at 2^24 and 2^28 elements, in CUDA graphs, against the faster copy."""
    from autoscale.kernels.scale_grad import LAUNCH, Launch, scale_grad_triton

    exponents = (24, 28)
    grads = {e: _gradient(e) for e in exponents}
    copies = {e: max(_gbs(_moved(g), partial(torch.empty_like(g).copy_, g), graph=graph) for graph in (False, True))
              for e, g in grads.items()}
    lines = ["| block | warps | programs per SM | " + " | ".join(f"2^{e} GB/s (of copy)" for e in exponents)
             + " |", "|---|---|---|" + "---|" * len(exponents)]
    best: tuple[float, Launch] = (0.0, LAUNCH)
    for block, warps, per_sm in itertools.product((1024, 2048, 4096), (4, 8), (1, 2, 4, 8)):
        launch = Launch(block=block, num_warps=warps, programs_per_sm=per_sm)
        rates = [_gbs(_moved(g), partial(scale_grad_triton, g, scale, carried, launch=launch), graph=True)
                 for g in grads.values()]
        fractions = [rate / copies[e] for rate, e in zip(rates, exponents, strict=True)]
        best = max(best, (min(fractions), launch), key=lambda b: b[0])
        mark = " (current)" if launch == LAUNCH else ""
        lines.append(f"| {block} | {warps} | {per_sm}{mark} | "
                     + " | ".join(f"{r:.0f} ({f:.2f})" for r, f in zip(rates, fractions, strict=True)) + " |")
    ceilings = ", ".join(f"2^{e} {c:.0f} GB/s" for e, c in copies.items())
    lines.append(f"\nCopy (the faster of loop and graph): {ceilings}. Best by its worse fraction of a copy: "
                 f"{best[1]} at {best[0]:.2f}.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time every launch shape (about a minute)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_bandwidth needs a CUDA GPU")
    scale, carried = torch.tensor(2.0**14, device="cuda"), torch.tensor(2.0**10, device="cuda")
    from autoscale.kernels.scale_grad import LAUNCH

    name = torch.cuda.get_device_name()
    text = (f"# Fused scale kernel bandwidth\n\n{__doc__}\nDevice: {name}, torch {torch.__version__}; "
            f"launch {LAUNCH}.\n\n" + "\n".join(table(scale, carried)) + "\n")
    if args.sweep:
        text += "\n## Launch shapes (CUDA graphs)\n\n" + "\n".join(sweep(scale, carried)) + "\n"
    print(text)
    write_report(results_path("kernels"), text)


if __name__ == "__main__":
    main()
