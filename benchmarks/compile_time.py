"""Compile time of autoscale's passes against Inductor's, as the graph grows; and end to end.

    python -m benchmarks.compile_time [--inductor-max NODES] [--repeats N]   # writes docs/results/compile_time.md
    python -m benchmarks.compile_time --end-to-end                  # writes docs/results/compile_time_models.md

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
from autoscale.passes.analyze_underflow import seed_inputs
from benchmarks import write_report


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


END_TO_END = """End to end, cold: the time of a model's first training step (forward, backward, and
for autoscale the scaler's step and update: compiling everything, from Dynamo to the C++ or
Triton kernels), each method in a fresh process with an empty cache directory and Inductor's and
AOTAutograd's caches on (torch's defaults). Warm: the same in another fresh process, with the
caches the cold one left, as a restarted job finds them.
Methods: "Inductor" is ``torch.compile(model)`` in float32; "autoscale, no scaler" is
``backend="autoscale"`` without a GradScaler (the precision pass and, on CPU, emulated float16:
no scale points, no overflow checks); "autoscale" is the default with ``autoscale.GradScaler``
(also compiling the scaler's update). On CPU the emulation's casts are part of autoscale's graph;
torch.amp's autocast on CPU would compile no casts but run native float16 GEMMs (~100x slower).
"C++ kernels" counts the compiled kernels each method left in its cache (Inductor compiles a
kernel once per distinct source: a repeated layer's kernels are compiled once)."""

E2E_MODELS = ("T5 1+1", "T5 3+3", "MLP (overhead --quick)", "transformer block (overhead --quick)")
E2E_METHODS = ("Inductor", "autoscale, no scaler", "autoscale")


def _e2e_model(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], bool]:
    """(model, inputs, returns_loss) for an end-to-end case."""
    torch.manual_seed(0)
    if name.startswith("T5"):
        from benchmarks.overflow_models import T5, t5_batch

        return T5(ff_gain=28.0, layers=1 if "1+1" in name else 3), t5_batch(0), True
    from benchmarks.overhead import MODELS

    model, x, _ = MODELS[name.split(" (")[0]]("quick")
    return model, (x,), False


def _e2e_child(name: str, method: str) -> dict[str, float]:
    """One first step of ``name`` with ``method``, timed in this (fresh) process."""
    model, inputs, returns_loss = _e2e_model(name)
    scaler: Any = None
    if method == "Inductor":
        run = torch.compile(model)
    else:
        run = torch.compile(model, backend="autoscale")
        scaler = autoscale.GradScaler(run) if method == "autoscale" else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    out = run(*inputs)
    loss = out if returns_loss else out.float().square().mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    middle = time.perf_counter()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    end = time.perf_counter()
    return {"seconds": end - start, "update": end - middle}


def _e2e_run(name: str, method: str, cache: str) -> dict[str, float]:
    """``_e2e_child`` in a fresh process whose Inductor caches live in ``cache``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    for switch in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        env.pop(switch, None)  # (torch's defaults: both on)
    done = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--child", name, method],
                          env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def end_to_end() -> str:
    cold = ["| model | " + " | ".join(E2E_METHODS) + " | autoscale / Inductor | autoscale / no scaler | "
            "first update() | C++ kernels (" + " / ".join(E2E_METHODS) + ") |", "|---" * (len(E2E_METHODS) + 5) + "|"]
    warm = ["| model | " + " | ".join(E2E_METHODS) + " | autoscale / Inductor | autoscale / no scaler |",
            "|---" * (len(E2E_METHODS) + 3) + "|"]
    for name in E2E_MODELS:
        times: dict[str, dict[str, float]] = {}
        for method in E2E_METHODS:
            with tempfile.TemporaryDirectory() as cache:
                times[method] = _e2e_run(name, method, cache)
                times[method]["kernels"] = sum(1 for _ in Path(cache).rglob("*.so"))
                times[method]["warm"] = _e2e_run(name, method, cache)["seconds"]
            print(name, method, times[method], flush=True)
        t = {m: times[m]["seconds"] for m in E2E_METHODS}
        cold.append(f"| {name} | " + " | ".join(f"{t[m]:.1f} s" for m in E2E_METHODS)
                    + f" | {t['autoscale'] / t['Inductor']:.2f} | {t['autoscale'] / t['autoscale, no scaler']:.2f} "
                    f"| {times['autoscale']['update']:.1f} s | "
                    + " / ".join(str(int(times[m]["kernels"])) for m in E2E_METHODS) + " |")
        w = {m: times[m]["warm"] for m in E2E_METHODS}
        warm.append(f"| {name} | " + " | ".join(f"{w[m]:.1f} s" for m in E2E_METHODS)
                    + f" | {w['autoscale'] / w['Inductor']:.2f} | {w['autoscale'] / w['autoscale, no scaler']:.2f} |")
    return (f"# Compile time, end to end\n\n{END_TO_END}\n\nMachine: {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}.\n\nCold:\n\n" + "\n".join(cold) + "\n\nWarm:\n\n" + "\n".join(warm) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inductor-max", type=int, default=1000, help="largest graph (nodes) to compile with Inductor")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the passes per size (median reported)")
    parser.add_argument("--end-to-end", action="store_true", help="models' first steps, cold and warm (~20 min)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_e2e_child(*args.child)))
        return
    if args.end_to_end:
        path = Path(__file__).resolve().parent.parent / "docs" / "results" / "compile_time_models.md"
        text = end_to_end()
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
    Path(__file__).resolve().parent.parent.joinpath("docs", "results", "compile_time.md").write_text(text)


if __name__ == "__main__":
    main()
