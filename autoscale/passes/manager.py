"""The pass manager: runs the pipeline, and is the one place invariants are checked.

A pass is a function ``verb_noun(gm, cfg) -> PassResult`` that rewrites ``gm.graph`` in place and
says whether it changed it. It keeps the fake values (``node.meta["val"]``) of the nodes it creates
or retypes up to date itself: re-propagating them through the whole graph after every pass cost
~80% of the pipeline's time. After every pass that changed the graph, the manager recompiles the
module and checks:

* every node the pass created records its provenance (``node.meta["autoscale"]["pass"]``);
* the graph's outputs keep their dtypes and shapes (a pass may change how a value is computed,
  never the module's interface);
* with ``Config.verify``, that the graph lints (``Graph.lint``: arguments defined before use,
  unique names, targets that exist) and that every recorded value's dtype and shape is what fake
  propagation through the rewritten graph gives.

Without ``verify`` the graph is linted once, at the end of the stage: a broken graph is still
refused before it leaves the pipeline, without paying a lint per pass (~5% of the time on a large
graph); ``verify`` (the "debug" recipe, and every test of the passes) names the pass that broke it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from .graph_utils import PROVENANCE_KEY, tensor_val

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["InvariantError", "PassRecord", "PassResult", "PassSpec", "Stage", "check_order", "run_stage"]

log = logging.getLogger("autoscale.passes")

Stage = Literal["dynamo", "joint"]
"""Where a pass runs: on Dynamo's torch-level graph before autograd, or on AOTAutograd's joint
forward+backward ATen graph before it is partitioned."""


@dataclass(frozen=True)
class PassResult:
    """What a pass did: the (same) module, whether it changed, and counts of its rewrites."""

    gm: GraphModule
    modified: bool
    counts: Mapping[str, int] = field(default_factory=dict)


PassFn = Callable[[GraphModule, "Config"], PassResult]


@dataclass(frozen=True)
class PassSpec:
    """One entry of the pipeline: a pass, the stage it runs at, and its order constraints:
    ``after``, the passes of its stage that must run before it (when the pipeline has them), and
    ``last``, that every other pass of its stage must. ``check_order`` checks them, as
    ``torch.fx.passes.infra``'s pass manager checks its constraints."""

    fn: PassFn
    stage: Stage
    after: tuple[str, ...] = ()
    last: bool = False

    @property
    def name(self) -> str:
        return self.fn.__name__


def check_order(pipeline: Sequence[PassSpec]) -> None:
    """Raise ``ValueError`` naming the pair when a pass of ``pipeline`` runs before one it must
    follow (``PassSpec.after``, ``PassSpec.last``), or follows a name no pass of its stage has."""
    for stage in dict.fromkeys(spec.stage for spec in pipeline):
        specs = [spec for spec in pipeline if spec.stage == stage]
        names = [spec.name for spec in specs]
        for i, spec in enumerate(specs):
            for earlier in spec.after:
                if earlier not in names:
                    raise ValueError(f"pass {spec.name!r} ({stage} stage) must run after {earlier!r}, which the "
                                     "stage does not have")
                if earlier not in names[:i]:
                    raise ValueError(f"pass {spec.name!r} ({stage} stage) must run after {earlier!r}, but runs "
                                     "before it")
            if spec.last and i != len(specs) - 1:
                raise ValueError(f"pass {spec.name!r} must run last in the {stage} stage, but {names[i + 1]!r} "
                                 "runs after it")


@dataclass(frozen=True)
class PassRecord:
    """What one pass did in one run of the pipeline."""

    name: str
    stage: Stage
    modified: bool
    counts: Mapping[str, int]
    seconds: float


class InvariantError(RuntimeError):
    """A pass broke an invariant of the pipeline: a bug in autoscale, never in the user's model."""


def run_stage(gm: GraphModule, cfg: Config, stage: Stage, pipeline: Sequence[PassSpec]) -> list[PassRecord]:
    """Run the passes of ``pipeline`` that belong to ``stage`` on ``gm``, in order."""
    with _cyclic_gc_paused():
        return _run_stage(gm, cfg, stage, pipeline)


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """The passes allocate many small objects, and each of Python's full collections walks the
    whole heap, which grows with the graph: with collection on, the cost per node grows with the
    graph. Reference counting still frees everything acyclic; the
    cycles (erased FX nodes) are collected once collection resumes."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _run_stage(gm: GraphModule, cfg: Config, stage: Stage, pipeline: Sequence[PassSpec]) -> list[PassRecord]:
    _ensure_vals(gm)
    records = []
    modified = False
    for spec in pipeline:
        if spec.stage != stage:
            continue
        before = set(gm.graph.nodes)
        signature = _output_signature(gm)
        start = time.perf_counter()
        result = spec.fn(gm, cfg)
        if result.gm is not gm:
            raise InvariantError(f"pass {spec.name} returned a different GraphModule; passes rewrite in place")
        if result.modified:
            modified = True
            if cfg.verify:
                gm.graph.lint()
                _check_vals(gm, spec.name)
            gm.recompile()
            _check_provenance(gm.graph.nodes, before, spec.name)
            _check_signature(signature, _output_signature(gm), spec.name)
        records.append(PassRecord(spec.name, stage, result.modified, dict(result.counts),
                                  time.perf_counter() - start))
        log.debug("%s (%s): modified=%s %s", spec.name, stage, result.modified, dict(result.counts))
    if modified and not cfg.verify:
        gm.graph.lint()
    return records


def _ensure_vals(gm: GraphModule) -> None:
    """Give every node that is read ``meta["val"]``: Dynamo's graphs carry it as ``example_value``;
    graphs built by hand get it propagated from their inputs."""
    for node in gm.graph.nodes:
        if "val" not in node.meta and "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]
    if any("val" not in n.meta for n in gm.graph.nodes if n.op != "output" and n.users):  # (not e.g. attach: None)
        refresh_vals(gm)


class _Propagate(FakeTensorProp):
    """FakeTensorProp that also records ``meta["requires_grad"]`` (its stored values are detached)."""

    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        n.meta["requires_grad"] = isinstance(result, torch.Tensor) and result.requires_grad
        return result


def refresh_vals(gm: GraphModule) -> None:
    """Re-propagate fake values through ``gm`` after a rewrite, in the fake mode of its inputs.

    Placeholders start from Dynamo's ``example_value`` where there is one: it keeps whether the
    input requires grad, which the scaling pass needs.
    """
    inputs = [p.meta.get("example_value", tensor_val(p)) for p in gm.graph.find_nodes(op="placeholder")]
    modes = {v.fake_mode for v in inputs if isinstance(v, torch._subclasses.FakeTensor)}
    if len(modes) != 1:  # no fake inputs (or several modes): nothing to propagate in
        return
    _Propagate(gm, modes.pop()).propagate_dont_convert_inputs(*inputs)


def _meta_of(val: Any) -> Any:
    vals = val if isinstance(val, tuple | list) else (val,)
    return tuple((v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else None for v in vals)


def _check_vals(gm: GraphModule, pass_name: str) -> None:
    recorded = {n: _meta_of(tensor_val(n)) for n in gm.graph.nodes}
    refresh_vals(gm)
    wrong = [f"{n.name} recorded {recorded[n]}, is {_meta_of(tensor_val(n))}"
             for n in gm.graph.nodes if n.op != "output" and recorded[n] != _meta_of(tensor_val(n))]
    if wrong:
        raise InvariantError(f"pass {pass_name} left wrong fake values: {'; '.join(wrong[:5])}")


def _output_signature(gm: GraphModule) -> list[Any]:
    (out,) = gm.graph.find_nodes(op="output")
    sig = []
    for arg in pytree.tree_leaves(out.args):
        val = tensor_val(arg) if isinstance(arg, Node) else None
        sig.append((val.dtype, tuple(val.shape)) if isinstance(val, torch.Tensor) else None)
    return sig


def _check_provenance(nodes: Iterable[Node], before: set[Node], pass_name: str) -> None:
    missing = [n.name for n in nodes if n not in before and
               n.meta.get(PROVENANCE_KEY, {}).get("pass") != pass_name]
    if missing:
        raise InvariantError(f"pass {pass_name} created nodes without provenance: {', '.join(missing)}")


def _check_signature(before: list[Any], after: list[Any], pass_name: str) -> None:
    if before != after:
        raise InvariantError(f"pass {pass_name} changed the graph's outputs from {before} to {after}")
