"""What a training step's forward saves for its backward: activation memory, by method and dtype.

    python -m benchmarks.memory [--quick] [--zoo NAMES] [-o FILE]   # docs/results/memory[_quick].md

Every tensor autograd keeps for the backward passes through ``torch.autograd.graph``'s saved-tensor
hooks, those a compiled graph saves too (AOTAutograd's function saves its forward's outputs for the
backward). One forward of each method is run under a hook that records each distinct storage it
is handed, once, with its size and dtype; the storages of the model's parameters and buffers (the
scaler's state among them) and of the inputs are left out, since they are held either way. What is
left is the activation memory a step holds between its forward and its backward.

Methods, for each model, each compiled by Inductor:
  float32     torch.compile of the model
  torch.amp   torch.compile of the model under ``torch.autocast(float16)``, a tensor output as float32
  native      autoscale, ``Config(compute="native")``: float16 GEMMs, as on a GPU
  emulated    autoscale as it runs on a CPU (``compute="emulate"``): float16 storage, GEMMs computed
              in float32 from float16 inputs (``autoscale/passes/dynamo/emulate_compute.py``)

Models: ``benchmarks.overhead``'s (``--quick``: their quick sizes) and, with ``--zoo``, models of
``benchmarks.zoo`` by name (``--zoo all``: every one).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autoscale
from benchmarks import machine_line, results_path, write_report
from benchmarks.overhead import MODELS

__all__ = ["METHODS", "Saved", "main", "measure", "report", "saved_by"]

METHODS = ("float32", "torch.amp", "native", "emulated")

Step = Callable[[nn.Module], torch.Tensor]
"""One forward of a model to its loss."""


@dataclass
class Saved:
    """The distinct storages a forward saved for its backward, by dtype (bytes)."""

    by_dtype: dict[torch.dtype, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_dtype.values())


def saved_by(model: nn.Module, forward: Callable[[], torch.Tensor], held: Iterable[torch.Tensor] = ()) -> Saved:
    """What ``forward()`` saves for its backward, less the storages of ``model``'s parameters and
    buffers and of the tensors ``held`` (the inputs): each distinct storage once."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), *held)}
    seen: dict[int, tuple[int, torch.dtype]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                seen.setdefault(storage.data_ptr(), (storage.nbytes(), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    del loss  # (the graph, and what it saved, go with it)
    out = Saved()
    for nbytes, dtype in seen.values():
        out.by_dtype[dtype] = out.by_dtype.get(dtype, 0) + nbytes
    return out


def measure(model: nn.Module, step: Step, held: Iterable[torch.Tensor] = (),
            methods: Iterable[str] = METHODS) -> dict[str, Saved]:
    """Per method, what one compiled forward of a copy of ``model`` saves (``saved_by``); each
    method's first forward compiles, the second is measured."""
    held = tuple(held)
    out: dict[str, Saved] = {}
    for method in methods:
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        if method == "float32":
            run: nn.Module = torch.compile(m)
        elif method == "torch.amp":
            run = torch.compile(_Autocast(m))
        else:
            config = autoscale.Config(compute="native" if method == "native" else "emulate")
            autoscale.GradScaler(m, config)
            run = torch.compile(m, backend=autoscale.backend(config))
        step(run).backward()  # (the compile, and the scales' first step)
        m.zero_grad(set_to_none=True)
        out[method] = saved_by(m, lambda r=run: step(r), held)  # type: ignore[misc]
    return out


class _Autocast(nn.Module):
    """``model`` under ``torch.autocast("cpu", float16)``, a tensor output as float32 (as
    ``benchmarks.Autocast``, for models called with keyword arguments too)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.float16):
            out = self.model(*args, **kwargs)
        return out.float() if isinstance(out, torch.Tensor) else out


def _overhead_model(name: str, quick: bool) -> tuple[nn.Module, Step, tuple[torch.Tensor, ...]]:
    model, x, y = MODELS[name]("quick" if quick else "full")
    return model, lambda run: F.cross_entropy(run(x), y), (x, y)


def _zoo_model(name: str) -> tuple[nn.Module, Step, tuple[torch.Tensor, ...]]:
    from benchmarks.zoo.models import MODELS as ZOO

    model, batch = ZOO[name].build(0)
    return model, lambda run: run(**batch).loss, tuple(batch.values())


def report(results: dict[str, dict[str, Saved]], *, quick: bool) -> str:
    """The Markdown report: each method's saved bytes, their float32 share, and the ratio to float32's."""
    lines = [
        "# Activation memory: what the forward saves for the backward" + (" (--quick)" if quick else ""), "",
        (__doc__ or "").split("\n\n", 1)[1].strip("\n"), "",
        machine_line(), "",
        "| model | " + " | ".join(METHODS) + " | native / torch.amp | emulated / torch.amp |",
        "|---|" + "---|" * (len(METHODS) + 2),
    ]
    for name, saved in results.items():
        base = saved["float32"].total or 1
        cells = []
        for method in METHODS:
            s = saved[method]
            f32 = s.by_dtype.get(torch.float32, 0)
            cells.append(f"{_kib(s.total)} ({s.total / base:.2f}×; float32 {_kib(f32)})")
        amp = saved["torch.amp"].total or 1
        lines.append(f"| {name} | {' | '.join(cells)} | {saved['native'].total / amp:.2f} | "
                     f"{saved['emulated'].total / amp:.2f} |")
    return "\n".join(lines) + "\n"


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the overhead models' quick sizes")
    parser.add_argument("--zoo", default="", help="comma-separated benchmarks.zoo models too ('all': every one)")
    parser.add_argument("-o", "--output", type=Path, help="report path (default docs/results/memory[_quick].md)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results: dict[str, dict[str, Saved]] = {}
    for name in MODELS:
        model, step, held = _overhead_model(name, args.quick)
        results[name] = measure(model, step, held)
    if args.zoo:
        from benchmarks.zoo.models import MODELS as ZOO

        for name in (list(ZOO) if args.zoo == "all" else args.zoo.split(",")):
            model, step, held = _zoo_model(name)
            results[name] = measure(model, step, held)
    text = report(results, quick=args.quick)
    write_report(args.output or results_path("memory", size="quick" if args.quick else "full"), text)
    print(text)


if __name__ == "__main__":
    main()
