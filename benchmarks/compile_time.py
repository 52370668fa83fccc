"""Compile time of autoscale's passes against Inductor's, as the graph grows; and end to end.

    python -m benchmarks.compile_time [--inductor-max NODES] [--repeats N]   # writes docs/results/compile_time.md
    python -m benchmarks.compile_time --end-to-end [--device cuda] [--models MODEL...]
                                  # writes docs/results/compile_time_models[_cuda].md

Graphs: an MLP chain of Linear + GELU layers with an autoscale.GradScaler attached (so every pass
has work: painting, emulation, the analysis, scale points), sized from ~100 to ~10,000 Dynamo
nodes. "dynamo stage" is the pipeline's Dynamo stage on the captured graph, invariant checks
included, as the median of --repeats runs, each on a fresh capture. For sizes up to
--inductor-max nodes (beyond that Inductor takes minutes on a 2-core CPU): "joint stage" is the
pipeline's joint-graph stage, timed inside a full compile with backend="autoscale"; "Inductor
compile" is torch.compile's default backend compiling the same model's forward and backward
(FX graph cache off); "passes / Inductor" is both stages against it. Targets: passes ≤ 10% of
Inductor's time; 10k nodes < 2 s; growth linear.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch._inductor.config
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule

import autoscale
from autoscale.passes import PIPELINE, run_stage
from autoscale.passes.analysis.seeding import seed_inputs
from benchmarks import Autocast, machine_line, results_path, write_report


def chain(layers: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    body: list[nn.Module] = []
    for _ in range(layers):
        body += [nn.Linear(32, 32), nn.GELU()]
    return nn.Sequential(*body), torch.randn(8, 32)


def capture(model: nn.Module, x: torch.Tensor) -> tuple[GraphModule, list[Any]]:
    graphs: list[tuple[GraphModule, list[Any]]] = []

    def grab(gm: GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=grab)(x)
    return graphs[0]


def passes_seconds(layers: int, repeats: int) -> tuple[int, list[float]]:
    """The passes' time on ``repeats`` fresh captures of the same model (a capture is rewritten in
    place, so each run needs its own)."""
    times = []
    for _ in range(repeats):
        model, x = chain(layers)
        autoscale.GradScaler(model)
        gm, example = capture(model, x)
        nodes = len(gm.graph.nodes)
        cfg = autoscale.Config().resolved(torch.device("cpu"))
        gc.collect()  # the previous run's garbage is not this run's cost
        start = time.perf_counter()
        seed_inputs(gm, example)
        run_stage(gm, cfg, "dynamo", PIPELINE)
        times.append(time.perf_counter() - start)
    return nodes, times


def inductor_seconds(layers: int) -> float:
    model, x = chain(layers)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False):
        compiled = torch.compile(model)
        start = time.perf_counter()
        F.mse_loss(compiled(x), x).backward()
    return time.perf_counter() - start


def joint_stage_seconds(layers: int) -> float:
    """The joint stage's passes, as run by a full autoscale compile (Inductor) of the model."""
    model, x = chain(layers)
    autoscale.GradScaler(model)
    backend = autoscale.backend()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False):
        F.mse_loss(torch.compile(model, backend=backend)(x), x).backward()
    return sum(r.seconds for r in backend.records[0].passes if r.stage == "joint")


END_TO_END = """End to end, cold: the compile time of a model's first training step (forward, backward, and
for autoscale the scaler's step and update: everything, from Dynamo to the C++ or Triton kernels),
measured as the first step's time less a steady step's (the median of the next three), each method
in a fresh process with an empty cache directory and Inductor's and AOTAutograd's caches on
(torch's defaults). Warm: the same in another fresh process, with the caches the cold one left, as
a restarted job finds them.
Methods: "Inductor" is ``torch.compile(model)`` in float32; "Inductor + autocast" is torch.amp's
mixed precision compiled, ``torch.compile`` of the model under ``torch.autocast(float16)`` with
``torch.amp.GradScaler``: the baseline of ``benchmarks.overhead`` on CUDA (on CPU it runs native
float16 GEMMs, about 100x slower, which the steady step takes out of its compile time); "autoscale,
no scaler" is ``backend="autoscale"`` without a GradScaler (the precision pass and, on CPU,
emulated float16: no scale points, no overflow checks); "autoscale" is the default with
``autoscale.GradScaler`` (also compiling the scaler's update). "kernels" counts the compiled
kernels each method left in its cache (C++ shared objects, and Triton binaries on CUDA; Inductor
compiles a kernel once per distinct source: a repeated layer's kernels are compiled once)."""

E2E_MODELS = ("T5 1+1", "T5 3+3", "MLP (overhead --quick)", "transformer block (overhead --quick)")
E2E_METHODS = ("Inductor", "Inductor + autocast", "autoscale, no scaler", "autoscale")
E2E_BASELINES = ("Inductor", "Inductor + autocast", "autoscale, no scaler")  # (the ratios' denominators)


def _e2e_model(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], bool]:
    """(model, inputs, returns_loss) for an end-to-end case."""
    torch.manual_seed(0)
    if name.startswith("T5"):
        from benchmarks.overflow_models import T5, t5_batch

        return T5(ff_gain=28.0, layers=1 if "1+1" in name else 3), t5_batch(0), True
    from benchmarks.overhead import MODELS

    model, x, _ = MODELS[name.split(" (")[0]]("quick")
    return model, (x,), False


def _e2e_child(name: str, method: str, device: str) -> dict[str, float]:
    """The compile time of ``name``'s first step with ``method`` on ``device``, in this (fresh)
    process: the first step's time less a steady step's."""
    model, inputs, returns_loss = _e2e_model(name)
    model, inputs = model.to(device), tuple(x.to(device) for x in inputs)
    scaler: Any = None
    if method == "Inductor":
        run: Any = torch.compile(model)
    elif method == "Inductor + autocast":
        run, scaler = torch.compile(Autocast(model, device)), torch.amp.GradScaler(device)
    else:
        run = torch.compile(model, backend="autoscale")
        scaler = autoscale.GradScaler(run) if method == "autoscale" else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def clock() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def step() -> tuple[float, float]:
        """(the step's seconds, of which its ``step()`` and ``update()``)."""
        opt.zero_grad(set_to_none=True)
        start = clock()
        out = run(*inputs)
        loss = out if returns_loss else out.float().square().mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        middle = clock()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        end = clock()
        return end - start, end - middle

    first, first_update = step()
    steady = [step() for _ in range(3)]
    steady_step = statistics.median(s for s, _ in steady)
    steady_update = statistics.median(u for _, u in steady)
    return {"seconds": first - steady_step, "update": first_update - steady_update, "steady": steady_step}


def _e2e_run(name: str, method: str, device: str, cache: str) -> dict[str, float]:
    """``_e2e_child`` in a fresh process whose Inductor caches live in ``cache``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    for switch in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TRITON_CACHE_DIR"):
        env.pop(switch, None)  # (torch's defaults: both caches on, Triton's under Inductor's directory)
    done = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--child", name, method, device],
                          env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _kernels(cache: str) -> int:
    """Compiled kernels in an Inductor cache directory: C++ shared objects and Triton binaries."""
    return sum(1 for pattern in ("*.so", "*.cubin") for _ in Path(cache).rglob(pattern))


def end_to_end(models: tuple[str, ...], device: str) -> str:
    ratios = [f"autoscale / {m}" for m in E2E_BASELINES]
    cold = ["| model | " + " | ".join(E2E_METHODS) + " | " + " | ".join(ratios) + " | first update() | kernels ("
            + " / ".join(E2E_METHODS) + ") | steady step (" + " / ".join(E2E_METHODS) + ") |",
            "|---" * (len(E2E_METHODS) + len(ratios) + 4) + "|"]
    warm = ["| model | " + " | ".join(E2E_METHODS) + " | " + " | ".join(ratios) + " |",
            "|---" * (len(E2E_METHODS) + len(ratios) + 1) + "|"]
    for name in models:
        times: dict[str, dict[str, float]] = {}
        for method in E2E_METHODS:
            with tempfile.TemporaryDirectory() as cache:
                times[method] = _e2e_run(name, method, device, cache)
                times[method]["kernels"] = _kernels(cache)
                times[method]["warm"] = _e2e_run(name, method, device, cache)["seconds"]
            print(name, method, times[method], flush=True)
        for table, key in ((cold, "seconds"), (warm, "warm")):
            t = {m: times[m][key] for m in E2E_METHODS}
            row = (f"| {name} | " + " | ".join(f"{t[m]:.1f} s" for m in E2E_METHODS) + " | "
                   + " | ".join(f"{t['autoscale'] / t[m]:.2f}" for m in E2E_BASELINES) + " |")
            if table is cold:
                row += (f" {times['autoscale']['update']:.1f} s | "
                        + " / ".join(str(int(times[m]["kernels"])) for m in E2E_METHODS) + " | "
                        + " / ".join(f"{times[m]['steady'] * 1e3:.0f} ms" for m in E2E_METHODS) + " |")
            table.append(row)
    machine = (f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
               if device == "cuda" else machine_line())
    return (f"# Compile time, end to end\n\n{END_TO_END}\n\nMachine: {machine}.\n\n"
            "Cold:\n\n" + "\n".join(cold) + "\n\nWarm:\n\n" + "\n".join(warm) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inductor-max", type=int, default=1000, help="largest graph (nodes) to compile with Inductor")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the passes per size (median reported)")
    parser.add_argument("--end-to-end", action="store_true", help="models' first steps, cold and warm (~25 min)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="with --end-to-end")
    parser.add_argument("--models", nargs="+", choices=E2E_MODELS, default=E2E_MODELS, metavar="MODEL",
                        help=f"with --end-to-end (default all: {', '.join(E2E_MODELS)})")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "METHOD", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_e2e_child(*args.child)))
        return
    if args.end_to_end:
        path = results_path("compile_time_models", device=args.device)
        text = end_to_end(tuple(args.models), args.device)
        write_report(path, text)
        print(text)
        return
    lines = ["| Dynamo nodes | dynamo stage (median) | range | per node | joint stage | Inductor compile "
             "| passes / Inductor |", "|---|---|---|---|---|---|---|"]
    for layers in (25, 75, 250, 750, 2500):
        nodes, times = passes_seconds(layers, args.repeats)
        ours = statistics.median(times)
        if nodes <= args.inductor_max:
            joint, theirs = joint_stage_seconds(layers), inductor_seconds(layers)
            compared = f"{joint:.3f} s | {theirs:.1f} s | {(ours + joint) / theirs:.1%}"
        else:
            compared = "not run | not run | —"
        lines.append(f"| {nodes} | {ours:.2f} s | {min(times):.2f}–{max(times):.2f} s | {ours / nodes * 1e3:.2f} ms | "
                     f"{compared} |")
        print(lines[-1], flush=True)
    text = (f"# Compile time\n\n{__doc__}\nMachine: {torch.get_num_threads()} threads, torch {torch.__version__}.\n\n"
            + "\n".join(lines) + "\n")
    # (write_report keeps the report's hand-written "What the numbers say" below the new table)
    write_report(results_path("compile_time"), text)


if __name__ == "__main__":
    main()
