"""How many kernels a training step's compiled graphs launch on a GPU, counted without one.

    python -m benchmarks.kernel_counts [--quick] [-o FILE]
                                       # writes docs/results/kernel_counts[_quick].md

On a GPU, the full models of ``benchmarks.overhead`` are bound by the host: it launches their
kernels faster than an H200 runs them, so a step's time follows how many it launches
(docs/results/step_profile_cuda.md). This counts them on a machine without a GPU. Each method's
graphs are compiled by Inductor's Triton backend for CPU tensors (``cpu_backend="triton"``), with
an H200's device properties standing in for the CPU's (how Inductor splits a reduction depends on
the number of SMs), and each compiled graph's ``call`` is read for the kernels it launches: Triton
kernels, and extern calls (GEMMs, which cuBLAS runs on a GPU); and for the tensors it makes, new
ones and views (the host's other work in a launch-bound step). Nothing is compiled to machine code
and nothing runs on a device: every Triton kernel is a stub that does nothing, so the steps compute
garbage and only the graphs' structure is measured. The loss, ``step()`` (the optimizer, and
torch.amp's unscaling) and torch.amp's own scale update are not in a compiled graph and are not
counted; autoscale's update is, a compiled graph in the default form, and in the
"fewer_launches" form one launch of its own Triton kernel (``autoscale.kernels.update``), which is
counted as it launches (a stub too: the update's check of its first call then finds garbage, and
warns).

Models: those of ``benchmarks.overhead``; a wide CNN (its CNN at 128 channels, which a GPU lays
out channels-last, as a ResNet's convolutions); and T5 1+1 (``benchmarks.overflow_models``: a
real architecture's graph, attention with Q, K and V projections of their own). Methods, for each:
  (a) autoscale on a GPU as it runs by default: float16 GEMMs, and the points and checks in the
      default form (``autoscale.protocol.FORMS["default"]``): each point's output written after
      its peak, in place; each reduction whole
  (a-fl) the same with ``Config(form="fewer_launches")``, laid out for a GPU's launch count: each
      output written by its producer's kernel, each reduction handed to the fold as partial
      results, by rows; the update one launch. Never yet timed on a GPU, so not the default
  (b) the baseline of ``benchmarks.overhead --device cuda``: torch.compile of the model under
      ``torch.autocast(float16)``, with torch.amp.GradScaler

The counts follow the GPU's: a 2026-11-27 GPU lease profiled torch.amp's full MLP at 32 kernels in
its forward and 47 in its backward (docs/results/step_profile_cuda.md), where this counts 29 and 41
in its graphs, the rest being the loss's kernels and ``scale()``'s multiply.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import autoscale
from benchmarks import Autocast, Size, publish, size_of, step_parser
from benchmarks.overflow_models import T5, t5_batch
from benchmarks.overhead import MODELS, _Method, conv_net

__all__ = ["COUNTED", "GRAPHS", "METHODS", "Counts", "count", "count_step", "launches", "main", "report", "t5",
           "triton_codegen_on_cpu", "wide_cnn"]

A_DEFAULT, A_FEWER, B = ("(a) autoscale", '(a-fl) autoscale, form="fewer_launches"',
                          "(b) torch.compile + autocast(float16) + torch.amp.GradScaler")
METHODS = (A_DEFAULT, A_FEWER, B)
A_IN_PARTS = '(a-fl-parts) autoscale, form="fewer_launches_in_parts"'
"""Not in the report: (a-fl) without ``Form.rows``, which tests weigh (a-fl) against."""
FORM = {A_DEFAULT: "default", A_FEWER: "fewer_launches", A_IN_PARTS: "fewer_launches_in_parts"}
GRAPHS = ("forward", "backward", "update")
H200 = {"multi_processor_count": 132, "cc": 90, "major": 9, "regs_per_multiprocessor": 65536,
        "max_threads_per_multi_processor": 2048, "max_threads_per_block": 1024, "warp_size": 32}
"""The device properties Inductor's Triton codegen reads (``DeviceProperties``), an H200's."""


@dataclasses.dataclass
class Counts:
    """The kernels one compiled graph launches per call, and the tensors its wrapper makes."""

    triton: int
    extern: int
    tensors: int
    """New tensors (``empty_strided``) and views (``reinterpret_tensor``) the graph's Python
    wrapper makes per call: each is host work of its own, beside the launches (on a GPU a new
    tensor is an allocation from the caching allocator)."""


@contextlib.contextmanager
def triton_codegen_on_cpu(seen: list[tuple[str, Counts]]) -> Iterator[None]:
    """Within: Inductor generates Triton for CPU tensors, with an H200's properties and stub
    kernels (module docstring), and appends each graph it compiles to ``seen`` as (what the graph
    is: ``GRAPHS``, its ``Counts``). Inductor's and AOTAutograd's caches are off, so that every
    graph is generated. oneDNN is off, so that Inductor lays a graph with convolutions out as on a
    GPU: with oneDNN, a CPU's convolutions are always channels-last (``decide_layout_opt``), where
    on a GPU its heuristics keep a graph whose convolutions all have at most 64 channels, as the
    CNN's 32, in NCHW. Everything
    patched is restored on the way out."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.graph import GraphLowering
    from torch._inductor.runtime.hints import DeviceProperties

    from autoscale.kernels import update as fused

    compile_to_module = GraphLowering.compile_to_module
    gpu = DeviceProperties(type="cpu", index=None, **H200)  # type: ignore[arg-type]

    def recorded(self: GraphLowering) -> Any:
        module = compile_to_module(self)
        kind = "backward" if self.is_backward else "update" if self.is_inference else "forward"
        seen.append((kind, launches(Path(module.__file__).read_text())))
        return module

    patches: list[tuple[Any, str, Any]] = [
        (torch_triton, "triton_hash_with_backend", lambda: "stub"),
        (torch_triton, "triton_backend", lambda: None),
        (AsyncCompile, "triton", lambda self, name, source, *a, **k: _Stub()),
        (DeviceProperties, "create", classmethod(lambda cls, device: gpu)),
        (GraphLowering, "compile_to_module", recorded),
        (fused, "_adaptive_update_kernel", _Launched(seen, "update")),
    ]
    saved = [(owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
             for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        with inductor_config.patch(cpu_backend="triton", fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False), torch.backends.mkldnn.flags(enabled=False):
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


class _Stub:
    """A Triton kernel that launches nothing."""

    def run(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _Launched:
    """One of autoscale's own Triton kernels, called as ``kernel[grid](...)``: it launches nothing,
    and records each launch in ``seen`` as a graph of ``kind`` that launches one kernel."""

    def __init__(self, seen: list[tuple[str, Counts]], kind: str) -> None:
        self._seen, self._kind = seen, kind

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return self._launch

    def _launch(self, *args: Any, **kwargs: Any) -> None:
        self._seen.append((self._kind, Counts(triton=1, extern=0, tensors=0)))


def launches(source: str) -> Counts:
    """The kernels a compiled graph's module launches in its ``call`` (Triton kernels' ``.run``,
    and extern kernels: ``extern_kernels.mm`` and the like), and the tensors it makes there."""
    body = source[source.index("def call("):]
    return Counts(triton=len(re.findall(r"^\s+\w+\.run\(", body, re.M)),
                  extern=len(re.findall(r"\bextern_kernels\.\w+\(", body)),
                  tensors=len(re.findall(r"\b(?:empty_strided\w*|reinterpret_tensor)\(", body)))


def wide_cnn(size: Size) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``benchmarks.overhead``'s CNN at 128 channels, a ResNet's width, which a GPU's Inductor lays
    out channels-last (more than 64 channels: ``GraphLowering.decide_layout_opt``), on images small
    enough for this CPU to run its convolutions (the counts do not depend on their size)."""
    return conv_net(128, *{"quick": (8, 8), "full": (16, 16), "large": (32, 32)}[size])


class _T5Logits(nn.Module):
    """``benchmarks.overflow_models.T5`` (1 encoder and 1 decoder layer: Q, K and V projections
    of their own, as in T5, BERT or Llama) as a step's model: the logits of a copy task's batch,
    whose cross entropy the step takes, as T5's own forward does."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.t5 = T5(layers=1)
        self.register_buffer("target", target)

    def forward(self, source: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.t5.logits(source, self.target).flatten(0, 1)
        return out


def t5(size: Size) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """T5 1+1 on a batch of 8 sequences of 16 tokens (``--quick``: 4 of 8)."""
    batch, seq = {"quick": (4, 8), "full": (8, 16), "large": (32, 64)}[size]
    source, target = t5_batch(0, batch=batch, seq=seq)
    return _T5Logits(target), source, target.flatten()


COUNTED: dict[str, Callable[[Size], tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {
    **MODELS, "wide CNN": wide_cnn, "T5 1+1": t5}
"""The models counted: ``benchmarks.overhead``'s, a CNN a GPU lays out channels-last, and a T5."""


def count(name: str, size: Size, methods: tuple[str, ...] = METHODS) -> dict[str, dict[str, Counts]]:
    """Per method (``METHODS``, or those of them given), the kernels of each graph a step of model
    ``name`` compiles."""
    return count_step(*COUNTED[name](size), methods, name=name)


def count_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, methods: tuple[str, ...] = METHODS, *,
               name: str = "the model") -> dict[str, dict[str, Counts]]:
    """``count`` for any model: a step of ``model`` on inputs ``x`` and class targets ``y``."""
    def make(label: str, m: nn.Module) -> _Method:
        if label == B:
            return _Method(torch.compile(Autocast(m, "cpu")), torch.amp.GradScaler("cpu"), m)
        config = autoscale.Config(compute="native", form=FORM[label])
        return _Method(torch.compile(m, backend=autoscale.backend(config)), autoscale.GradScaler(m, config), m)

    out: dict[str, dict[str, Counts]] = {}
    for label in methods:
        seen: list[tuple[str, Counts]] = []
        with triton_codegen_on_cpu(seen):
            torch._dynamo.reset()
            make(label, copy.deepcopy(model)).step(x, y)
        graphs = dict(seen)
        if len(graphs) != len(seen):
            raise RuntimeError(f"{label} on {name}: {[k for k, _ in seen]} compiled, one graph of each kind expected")
        out[label] = graphs
    return out


def report(results: dict[str, dict[str, dict[str, Counts]]], *, size: Size) -> str:
    """The Markdown report: Triton launches, and extern calls, per graph, step and method, and the
    tensors a step's graphs make."""
    lines = [
        "# Kernels a step launches on a GPU" + ("" if size == "full" else f" (--{size})"), "",
        (__doc__ or "").split("\n\n", 1)[1].strip("\n"), "",
        f"torch {torch.__version__}, {size} models; per graph: Triton kernels + extern calls (GEMMs).", "",
        "| model | method | forward | backward | update | step | step / (b)'s | host tensors a step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, methods in results.items():
        base = _total(methods[B])
        for label, graphs in methods.items():
            cells = [f"{c.triton} + {c.extern}" if (c := graphs.get(g)) else "–" for g in GRAPHS]
            total = _total(graphs)
            tensors = sum(c.tensors for c in graphs.values())
            lines.append(f"| {name} | {label} | {' | '.join(cells)} | {total} | {total / base:.2f} | {tensors} |")
    return "\n".join(lines) + "\n"


def _total(graphs: dict[str, Counts]) -> int:
    return sum(c.triton + c.extern for c in graphs.values())


def main() -> None:
    args = step_parser(__doc__, "kernel_counts", "the small models (benchmarks.overhead --quick)").parse_args()
    if args.device != "cpu":
        raise SystemExit("kernel_counts counts a GPU's kernels without one: run it on the CPU (--device cpu)")
    size = size_of(args)
    publish(report({name: count(name, size) for name in COUNTED}, size=size), "kernel_counts", args)


if __name__ == "__main__":
    main()
