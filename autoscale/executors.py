"""Executors: how the rewritten Dynamo graph becomes code (imported only when compiling).

Both run AOTAutograd on the graph (so the backward is derived through the inserted casts) and
the joint stage of the pipeline on its joint forward+backward graph before partitioning:

* ``inductor`` hands the graph to Inductor's ``compile_fx``, with the joint stage as its
  ``joint_custom_pre_pass``, ``emulate_precision_casts`` on (without it Inductor drops
  float32 -> float16 -> float32 round trips inside fused kernels, silently computing in float32)
  and ``static_launch_user_defined_triton_kernels`` on: the fused scale kernel is a user-defined
  Triton kernel, which Inductor otherwise launches through Triton's own Python launcher
  (``cuLaunchKernelEx`` in a profile) rather than its static launcher, at every scale point of
  every step of a launch-bound backward (docs/results/step_profile_cuda.md). A kernel the static
  launcher cannot take falls back to Triton's launcher, as Inductor's own do; on a CPU the
  setting does nothing;
* ``eager`` runs AOTAutograd's graphs as they are (but for ``view``, see :func:`_run_views_as_reshapes`),
  with the joint stage in the partitioner.

Inductor's two caches both serve autoscale's graphs: its FX graph cache (the compiled forward
and backward, keyed by what reaches Inductor, the joint stage's work included), and AOTAutograd's
cache, keyed by the graph Dynamo hands over, which spares a warm start the joint trace, the joint
stage, the partition and Inductor's lowering (:func:`_let_aot_autograd_cache`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.fx import Graph, GraphModule

import autoscale
import autoscale.passes

__all__ = ["EXECUTORS", "JointStage", "inductor_keeps_roundings"]


@dataclass(frozen=True)
class JointStage:
    """The joint stage of the pipeline, bound to one compile, as the executors receive it.

    ``run`` rewrites AOTAutograd's joint graph in place; ``passes`` and ``key`` (the config and
    pass names) identify what it does, for Inductor's caches.
    """

    run: Callable[[GraphModule], None]
    passes: tuple[Callable[..., Any], ...]
    key: str


Executor = Callable[[GraphModule, Sequence[Any], JointStage], Callable[..., Any]]


_PACKAGE = Path(autoscale.__file__).parent
_PASS_SOURCES = tuple(sorted(str(p) for p in Path(autoscale.passes.__file__).parent.glob("*.py")))
_TRACED_SOURCES = tuple(sorted(str(p) for d in (_PACKAGE, _PACKAGE / "kernels") for p in d.glob("*.py")))


class _JointPass(CustomGraphPass):
    """The joint stage as an Inductor custom pass. ``uuid`` covers the passes' source and the
    config, so Inductor's caches never serve code built by other passes or settings."""

    def __init__(self, stage: JointStage) -> None:
        self._stage = stage
        sources = sorted({inspect.getsourcefile(fn) or "" for fn in stage.passes} | set(_PASS_SOURCES))
        self._uuid = get_hash_for_files(tuple(sources), extra=stage.key).hex()

    def __call__(self, graph: Graph) -> None:
        gm = graph.owning_module
        assert isinstance(gm, GraphModule)
        self._stage.run(gm)

    def uuid(self) -> str:
        return self._uuid


@functools.cache
def inductor_keeps_roundings() -> bool:
    """Whether this torch's Inductor keeps float32 -> float16 -> float32 round trips.

    With ``emulate_precision_casts`` torch 2.13 keeps them. Older Inductors (2.11 on the GPU
    machines) fold every chain of float casts in the joint-graph pattern ``pointless_convert``,
    roundings included, so emulated GEMMs there read unrounded float32 parameters. Native
    compute is unaffected: the precision pass never emits such a chain.
    """
    from torch._inductor.fx_passes import joint_graph

    try:
        source = inspect.getsource(joint_graph.pointless_convert)
    except (AttributeError, OSError, TypeError):
        return False
    return "emulate_precision_casts" in source


def compile_inductor(gm: GraphModule, example_inputs: Sequence[Any], stage: JointStage) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    _let_aot_autograd_cache(gm)
    patches = {"emulate_precision_casts": True, "joint_custom_pre_pass": _JointPass(stage),
               "static_launch_user_defined_triton_kernels": True}
    compiled: Callable[..., Any] = compile_fx(gm, list(example_inputs), config_patches=patches)  # type: ignore[assignment]
    return compiled


@functools.cache
def _traced_code_hash() -> str:
    """A hash of the code autoscale's graph functions run when AOTAutograd traces them (the
    rescale points' backward, the checks, the emulated GEMMs, the quantizers: ``autoscale/*.py``
    and its kernels), which the graph's text does not show."""
    return get_hash_for_files(_TRACED_SOURCES).hex()


def _let_aot_autograd_cache(gm: GraphModule) -> None:
    """Make ``gm`` one AOTAutograd's cache takes, as Dynamo's own graphs are.

    The cache refuses a graph with a call of a function it does not know (``rescale``, ``watch``,
    ``emulated``: Python functions, not torch ops), and a method called on a node without Dynamo's
    ``example_value`` (the passes' nodes carry ``val``). Refused, every start ran the joint trace,
    the joint stage, the partition and Inductor's lowering again, and a warm start cost nearly a cold
    one's Python (docs/results/compile_time_models.md). The cache's escape hatch is the one
    ``torch.fx.wrap`` uses: a node marked ``is_wrapped`` with a ``user_cache_hash``, which joins the
    cache key. Ours is :func:`_traced_code_hash`, so a change
    to what the functions do misses; their arguments are in the graph's text, and the joint
    stage's passes and config are in the key through ``_JointPass.uuid``. (FX then writes
    ``torch.fx.wrap`` of the marked functions into the module's code, as for any wrapped function:
    each recompile registers that code's globals with FX's symbolic tracer, a few small entries
    per compile.)

    On a hit the joint stage does not run: ``CompileRecord.cached`` says so."""
    digest = _traced_code_hash()
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__module__", "").startswith("autoscale."):
            node.meta["is_wrapped"] = True
            node.meta["user_cache_hash"] = digest
        if "val" in node.meta and "example_value" not in node.meta:
            node.meta["example_value"] = node.meta["val"]


def compile_eager(gm: GraphModule, example_inputs: Sequence[Any], stage: JointStage) -> Callable[..., Any]:
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def partition(joint: GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[GraphModule, GraphModule]:
        stage.run(joint)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def run(graph: GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        _run_views_as_reshapes(graph)
        return boxed_nop(graph, list(inputs))

    def run_backward(graph: GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        _write_inputs_as_inductor_does(graph)
        return run(graph, inputs)

    compiler = aot_autograd(fw_compiler=run, bw_compiler=run_backward, partition_fn=partition,
                            keep_inference_input_mutations=True)
    return compiler(gm, example_inputs)


def _run_views_as_reshapes(gm: GraphModule) -> None:
    """``aten.view`` -> ``aten.reshape`` in an AOTAutograd graph run eagerly.

    The graph's views were traced on fake tensors whose strides come from the ops' meta functions;
    a real CPU kernel may return other strides (``native_batch_norm_backward`` returns a
    contiguous gradient for a transposed input, where its meta function keeps the input's
    strides), and the view then fails ("view size is not compatible with input tensor's size and
    stride"; torch's own ``aot_eager`` backend fails alike, pytorch/pytorch#120035). Inductor
    plans its own layouts and is not affected. The graphs are functional, so a reshape is the
    same value; it is the same view wherever the view would have succeeded, and a copy only where
    the view would have raised.
    """
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default  # (boxed_nop recompiles)


def _write_inputs_as_inductor_does(gm: GraphModule) -> None:
    """A backward's writes into its inputs (the statistics a rescale point records: AOTAutograd
    puts them in the backward as ``copy_`` into a tensor saved by the forward) keep that tensor's
    version counter, as Inductor's kernels do. Bumping it, as a plain ``copy_`` does, made a second
    backward through the same graph (``backward(retain_graph=True)`` twice: several losses) fail
    autograd's check that saved tensors are unmodified."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default):
        if node.args[0].op == "placeholder":
            node.target = _copy_keeping_version


def _copy_keeping_version(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    with _unsafe_preserve_version_counter(dst):
        return dst.copy_(src)


EXECUTORS: dict[str, Executor] = {"inductor": compile_inductor, "eager": compile_eager}
