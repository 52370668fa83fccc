"""Ahead-of-time conversion: ``convert`` a model once, train the result with plain autograd, ``save``/``load`` it.

``convert(model, example_inputs)`` captures the model's forward as ONE Dynamo graph, runs the
backend's Dynamo-stage pipeline on it (the same function, :func:`autoscale.rewrite.rewrite_graph`)
and returns a :class:`ConvertedModule`: the original model (so ``parameters()``, ``state_dict()``
and optimizers see the same Parameters) and the rewritten ``GraphModule``, run eagerly. Every
autoscale pass that matters runs before autograd, so eager autograd through the rewritten graph
differentiates through its casts and rescale points: no AOTAutograd, no Inductor, no Dynamo at
training time.

Why one graph and static shapes: the rewritten graph *is* the program. There is no Dynamo
runtime to stitch pieces together around a graph break or to re-trace for a new shape, so a graph
break is refused at conversion and an input of another shape, dtype or device at call time.

``save``/``load`` write and read a file made of a fixed header (magic, format version, payload
length, SHA-256 of the payload) and a ``torch.save`` payload, whose graph and module tree are
plain data (``autoscale.serialize``: why not a pickled ``GraphModule``).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import platform
import struct
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from autoscale.config import Config
from autoscale.inspect import PrecisionReport
from autoscale.ops import Attached
from autoscale.passes.graph_utils import attach_of, copy_graph_module
from autoscale.rewrite import CompileRecord, register_graph, rewrite_graph
from autoscale.runtime import ScaleState, install_state, recoded_forward, unwrap
from autoscale.serialize import (
    RECONVERT,
    ConvertedFileError,
    ConvertError,
    CorruptedFileError,
    FormatVersionError,
    NotConvertedFileError,
    SavedModule,
    TruncatedFileError,
    dump_graph,
    dump_modules,
    load_graph,
    load_modules,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "READ_VERSIONS",
    "ConvertError",
    "ConvertedFileError",
    "ConvertedModule",
    "CorruptedFileError",
    "FormatVersionError",
    "NotConvertedFileError",
    "SavedModule",
    "TruncatedFileError",
    "convert",
    "load",
    "save",
]

log = logging.getLogger("autoscale")

MAGIC = b"\x89autoscale\r\n\x1a\n"
"""The first bytes of a converted-module file (PNG-style: a non-ASCII byte, then line endings and
^Z that a text-mode copy would mangle)."""
FORMAT_VERSION = 3
"""The file format this autoscale writes. Version 2: a rescale node may carry ``measured=False`` (a
float32 alignment, a multiply alone), which an autoscale that writes version 1 cannot run. Version
3: a rescale or watch node may carry the ``form`` its work is laid out in (``Config.form``)."""
READ_VERSIONS = (1, 2, 3)
"""The file formats this autoscale reads: a version-1 graph measures every rescale point and a
version-2 graph takes the default form, which this one runs as written."""
_HEADER = struct.Struct("<IQ32s")  # format version, payload length, SHA-256 of the payload
_HEADER_SIZE = len(MAGIC) + _HEADER.size
_KIND = "autoscale.ConvertedModule"

# Where a graph input, or an output leaf, comes from.
Source = tuple[str, Any]  # ("input", leaf index) | ("parameter", name) | ("buffer", name) | ("constant", index)
# | ("output", graph output index) | ("value", a Python value)


# ------------------------------------------------------------------------------------ the module


@dataclass(frozen=True)
class _Signature:
    """How the user's call maps onto the graph: what each input leaf must be, where each graph
    input comes from, and how the user's output is rebuilt from the graph's."""

    in_spec: pytree.TreeSpec
    in_leaves: tuple[tuple[Any, ...], ...]  # ("tensor", shape, dtype, device) | ("value", v)
    sources: tuple[Source, ...]  # one per graph placeholder
    constants: tuple[torch.Tensor, ...]
    out_spec: pytree.TreeSpec
    out_leaves: tuple[Source, ...]
    training: bool


class ConvertedModule(nn.Module):
    """The model after ``convert`` (or ``load``): ``forward(*args)`` runs the rewritten graph eagerly.

    ``module`` is the original model (after ``load``, a tree of :class:`SavedModule` with the same
    names, parameters and buffers); it is a submodule, so ``parameters()``, ``state_dict()`` (keys
    prefixed ``module.``) and optimizers see its Parameters. ``graph_module`` is the rewritten
    graph, deliberately not a submodule: it owns no state. ``record`` is the compile record (the
    resolved config, the precision report and the passes' counts); ``extra`` holds what ``save``
    was given as ``extra`` (empty otherwise).

    Inputs must have the example inputs' structure, shapes, dtypes and devices, and the model the
    training mode it was converted in: the graph is static.
    """

    graph_module: GraphModule
    record: CompileRecord
    extra: dict[str, Any]
    _source: GraphModule | None

    def __init__(self, module: nn.Module, graph_module: GraphModule, signature: _Signature, *,
                 record: CompileRecord, extra: Mapping[str, Any] | None = None,
                 source: GraphModule | None = None) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "graph_module", graph_module)  # a plain attribute: not a submodule
        object.__setattr__(self, "record", record)
        object.__setattr__(self, "extra", dict(extra or {}))
        self._signature = signature
        # The captured graph before the passes, to rewrite again when the scaler promotes ops after a
        # forward overflow (None after ``load``: the saved graph is the rewritten one), and the
        # promotions the current graph was rewritten with.
        object.__setattr__(self, "_source", source)
        state = _state(module)
        self._promoted = state.forward.promoted_key if state is not None else ""

    @property
    def _orig_mod(self) -> nn.Module:
        """The wrapped model, under the name ``torch.compile``'s wrapper uses, so that
        ``autoscale.GradScaler(converted)`` (which unwraps) finds the scale state the graph reads."""
        return self.module

    @property
    def config(self) -> Config:
        """The resolved config the graph was converted with."""
        return self.record.config

    @property
    def report(self) -> PrecisionReport:
        """The precision report of the converted graph."""
        return self.record.report

    def forward(self, *args: Any) -> Any:
        """Check ``args`` against the captured ones, feed the graph its inputs (the arguments' tensors,
        the model's parameters and buffers looked up by name) and rebuild the model's output."""
        sig = self._signature
        leaves, spec = pytree.tree_flatten(args)
        self._check(leaves, spec)
        inputs = [self._value(source, leaves) for source in sig.sources]
        self._follow_promotions(inputs)
        outputs = self.graph_module(*inputs)
        return pytree.tree_unflatten([self._value(o, leaves, outputs) for o in sig.out_leaves], sig.out_spec)

    def _follow_promotions(self, inputs: Sequence[Any]) -> None:
        """Rewrite the graph again, from the captured one, when the scaler has promoted ops to
        float32 since it was rewritten (a forward overflow): the converted module's recompile. A
        loaded module has no captured graph and keeps its graph (the scaler then says to convert
        the model again, which applies the promotions)."""
        state = _state(self.module)
        if state is None or self._source is None or state.forward.promoted_key == self._promoted:
            return
        gm = copy_graph_module(self._source)
        found = attach_of(gm.graph)
        if found is not None:  # (the capture recorded the promotions of its time)
            found[0].update_arg(Attached._fields.index("promoted"), state.forward.promoted_key)
        record = rewrite_graph(gm, inputs, self.config)
        object.__setattr__(self, "graph_module", gm)
        object.__setattr__(self, "record", record)
        self._promoted = state.forward.promoted_key
        log.info("converted %s again for the ops promoted to float32: %s", type(self.module).__name__, record.report)

    def _value(self, source: Source, leaves: Sequence[Any], outputs: Sequence[Any] = ()) -> Any:
        kind, where = source
        if kind == "input":
            return leaves[where]
        if kind == "parameter":
            return self.module.get_parameter(where)  # by name on each call: ``.to()`` replaces buffers
        if kind == "buffer":
            return self.module.get_buffer(where)
        if kind == "constant":
            return self._signature.constants[where]
        if kind == "output":
            return outputs[where]
        return where  # "value"

    def _check(self, leaves: Sequence[Any], spec: pytree.TreeSpec) -> None:
        """Refuse a call the static graph would compute wrongly (or fail on deep inside)."""
        sig = self._signature
        if spec != sig.in_spec:
            raise ValueError(f"this converted module takes {_describe_spec(sig.in_spec)}, got {_describe_spec(spec)}; "
                             "call it with arguments structured like the example inputs given to autoscale.convert")
        for i, (leaf, expected) in enumerate(zip(leaves, sig.in_leaves, strict=True)):
            if expected[0] == "tensor":
                _, shape, dtype, device = expected
                if (not isinstance(leaf, torch.Tensor) or tuple(leaf.shape) != shape or leaf.dtype != dtype
                        or leaf.device != device):
                    got = (f"shape {tuple(leaf.shape)}, {leaf.dtype} on {leaf.device}" if isinstance(leaf, torch.Tensor)
                           else type(leaf).__name__)
                    raise ValueError(
                        f"input {i} of this converted module has {got}; it was converted for shape {shape}, "
                        f"{dtype} on {device}. A converted graph is static: pass inputs of the example inputs' "
                        "shapes, dtypes and devices, or run autoscale.convert again with examples of the new ones")
            elif not _same_value(leaf, expected[1]):
                raise ValueError(f"input {i} of this converted module is {leaf!r}; it was converted for "
                                 f"{expected[1]!r}, which the graph has baked in: pass the same value, or convert "
                                 "again with the new one")
        if self.module.training != sig.training:
            mode = "training" if sig.training else "eval"
            raise RuntimeError(f"this module was converted in {mode} mode and its graph keeps that mode's behaviour "
                               "(batch-norm statistics, dropout); set it back with .train()/.eval(), or convert "
                               "another copy of the model in the other mode")


def _describe_spec(spec: pytree.TreeSpec) -> str:
    return f"{spec.num_children} positional argument(s) ({spec.num_leaves} leaves: {spec})"


def _same_value(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == does not give a bool
        return a is b


# ----------------------------------------------------------------------------------- convert


def convert(model: nn.Module, example_inputs: tuple[Any, ...], *, config: Config | None = None) -> ConvertedModule:
    """Capture ``model(*example_inputs)`` as one graph, rewrite it with autoscale's pipeline and
    return a :class:`ConvertedModule` that trains with plain autograd.

    In adaptive scaling mode (the default) the scaler's state is installed on ``model`` first, so
    the graph gets its scale points: create ``autoscale.GradScaler(converted)`` (or one on
    ``model`` before converting) with the same scaling settings. ``config.executor`` is not used:
    the graph runs eagerly. Dynamo traces the forward but the graph is not run: converting does
    not update batch-norm statistics or other state.

    Raises ``ConvertError`` when Dynamo cannot capture the forward as a single graph.
    """
    if isinstance(model, ConvertedModule):
        raise ValueError("this model is already converted; convert the original model")
    if not isinstance(model, nn.Module):
        raise ValueError(f"autoscale.convert takes an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        raise ValueError(f"example_inputs must be a tuple of the forward's positional arguments, e.g. (x,), "
                         f"got {type(example_inputs).__name__}")
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"convert config must be an autoscale.Config, got {type(config).__name__}")
    cfg = config or Config()
    model = unwrap(model)
    if model._forward_hooks or model._forward_pre_hooks:
        log.warning("%s has forward hooks on the model itself: the converted graph does not run them (hooks of "
                    "its submodules are traced into it)", type(model).__name__)
    if cfg.scaling.mode == "adaptive":
        install_state(model, moments=cfg.scaling.rule == "paper")
    gm, graph_inputs, user_output, graph_outputs = _capture(model, example_inputs)
    if (found := attach_of(gm.graph)) is not None:  # (a converted graph measures every step: it is the only one)
        found[0].update_arg(Attached._fields.index("measuring"), True)
    leaves, in_spec = pytree.tree_flatten(example_inputs)
    sources, constants = _map_inputs(model, leaves, graph_inputs)
    out_leaves, out_spec = pytree.tree_flatten(user_output)
    outputs = tuple(_map_output(model, leaf, leaves, graph_outputs) for leaf in out_leaves)
    source = copy_graph_module(gm)
    record = rewrite_graph(gm, graph_inputs, cfg)
    log.info("converted %s: %s", type(model).__name__, record.report)
    if record.report.unknown_ops:
        log.warning("ops not in the precision tables were kept in float32: %s "
                    "(classify them with Config.allow/deny/infer/clear)", ", ".join(record.report.unknown_ops))
    in_leaves = tuple(("tensor", tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else ("value", x)
                      for x in leaves)
    signature = _Signature(in_spec, in_leaves, sources, tuple(constants), out_spec, outputs, model.training)
    return ConvertedModule(model, gm, signature, record=record, source=source)


def _capture(model: nn.Module, args: tuple[Any, ...]) -> tuple[GraphModule, list[Any], Any, tuple[Any, ...]]:
    """The one Dynamo graph of ``model(*args)`` with its real example inputs, the user-level output
    of that call and the graph outputs it was built from.

    The graph is not run: the capture backend hands Dynamo empty tensors of the outputs' shapes,
    so the user-level output only tells how the graph's outputs are arranged. Nothing is left in
    Dynamo's caches that could serve a later ``torch.compile`` of the model or count towards its
    recompile limit (see ``_fresh_forward``).
    """
    captured: list[tuple[GraphModule, list[Any]]] = []
    produced: list[Any] = []
    live = True

    def capture_backend(gm: GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        captured.append((gm, list(example_inputs)))
        (returned,) = gm.graph.find_nodes(op="output")[0].args

        def placeholders(*_: Any) -> Any:
            if not live:
                raise RuntimeError("autoscale.convert's capture graph was called after conversion; this is a bug")
            outs = map_aggregate(returned, lambda a: _empty_like(a.meta["example_value"]) if isinstance(a, Node) else a)
            produced.extend(outs if isinstance(outs, tuple | list) else (outs,))
            return outs

        return placeholders

    from torch._dynamo.exc import Unsupported, UserError  # (here: Dynamo imports Inductor and triton)

    compiled = torch.compile(_fresh_forward(model), backend=capture_backend, fullgraph=True, dynamic=False)
    try:
        with torch.enable_grad():
            output = compiled(*args)
    except (Unsupported, UserError) as e:  # (data-dependent control flow raises UserError)
        raise ConvertError(
            f"autoscale.convert needs {type(model).__name__}'s whole forward as one graph, but Dynamo cannot "
            "trace it without a graph break. Remove the graph break (print, .item()/.tolist(), Python control "
            "flow on tensor values, calls Dynamo does not support: Dynamo's message below says which and where), "
            "or train with torch.compile(model, backend=autoscale.backend(config)), which compiles the pieces "
            f"between graph breaks.\n\nDynamo: {e}") from e
    finally:
        live = False
    if len(captured) != 1:
        raise ConvertError(f"Dynamo handed over {len(captured)} graphs for one call instead of 1 (is torch.compile "
                           "disabled, e.g. by TORCHDYNAMO_DISABLE=1?); autoscale.convert needs exactly one")
    gm, graph_inputs = captured[0]
    return gm, graph_inputs, output, tuple(produced)


def _fresh_forward(model: nn.Module) -> Callable[..., Any]:
    """``model.forward`` with a code object of its own (``recoded_forward``): Dynamo starts from the
    forward, as ``torch.compile(model)`` does (so layer paths come out as the backend sees them:
    ``fc1``, not a path through the caller), and keeps its cache entries on that code object: a
    copy takes them away with it when conversion is done."""
    try:
        return recoded_forward(model)
    except TypeError as e:
        raise ConvertError(f"{e}; autoscale.convert traces Python forwards") from None


def _empty_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device=value.device)
    return value


def _named_tensors(model: nn.Module) -> dict[int, Source]:
    """Every parameter and buffer of ``model`` by identity -> its (first) name."""
    names: dict[int, Source] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), ("parameter", name))
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), ("buffer", name))
    return names


def _map_inputs(model: nn.Module, leaves: Sequence[Any], graph_inputs: Sequence[Any]
                ) -> tuple[tuple[Source, ...], list[torch.Tensor]]:
    """Where each graph input comes from: a user input leaf, a named parameter or buffer (by
    identity: Dynamo hands the backend the real tensors), or a constant kept with the module."""
    by_leaf = {id(x): i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
    named = _named_tensors(model)
    sources: list[Source] = []
    constants: list[torch.Tensor] = []
    for i, x in enumerate(graph_inputs):
        if not isinstance(x, torch.Tensor):
            raise ConvertError(f"graph input {i} is a {type(x).__name__}, not a tensor; autoscale.convert needs "
                               "static shapes (this should not happen with dynamic=False: please report it)")
        if id(x) in by_leaf:
            sources.append(("input", by_leaf[id(x)]))
        elif id(x) in named:
            sources.append(named[id(x)])
        else:
            log.warning("graph input %d (shape %s) is neither an input nor a parameter or buffer of the model (a "
                        "tensor attribute or a global?): the converted module keeps it as a constant", i,
                        tuple(x.shape))
            sources.append(("constant", len(constants)))
            constants.append(x)
    return tuple(sources), constants


def _map_output(model: nn.Module, leaf: Any, leaves: Sequence[Any], graph_outputs: Sequence[Any]) -> Source:
    if not isinstance(leaf, torch.Tensor):
        return ("value", leaf)
    for i, out in enumerate(graph_outputs):
        if out is leaf:
            return ("output", i)
    for i, x in enumerate(leaves):
        if x is leaf:
            return ("input", i)
    named = _named_tensors(model).get(id(leaf))
    if named is not None:
        return named
    raise ConvertError("the forward returns a tensor that is neither computed by the graph nor an input, parameter "
                       "or buffer; return tensors the forward computes")


# ------------------------------------------------------------------------------------- the file


def save(converted: ConvertedModule, path: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None) -> None:
    """Write ``converted`` to ``path``: header (magic, format version, payload length, SHA-256)
    then the payload. ``extra`` (e.g. ``{"scaler": scaler.state_dict(), "optimizer":
    opt.state_dict()}``) is stored in the same checksummed payload and comes back as
    ``load(path).extra``. The file is written next to ``path`` and renamed into place, so an
    interrupted save never leaves a half-written file under that name."""
    if not isinstance(converted, ConvertedModule):
        raise ValueError(f"autoscale.save takes a ConvertedModule (from autoscale.convert), got "
                         f"{type(converted).__name__}")
    import autoscale  # (here, not at the top: autoscale/__init__ imports this module)

    state = _state(converted.module)
    payload = {
        "kind": _KIND,
        "versions": {"format": FORMAT_VERSION, "autoscale": autoscale.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "graph": dump_graph(converted.graph_module),
        "modules": dump_modules(converted.module, state),
        "state": None if state is None else {
            "layers": list(state.layers), "moments": state.moments, "scales": state.scales.detach().clone(),
            "stats": state.stats.detach().clone(), "forward": state.forward.dump()},
        "signature": _dump_signature(converted._signature),
        "record": converted.record,
        "extra": dict(extra or {}),
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    header = MAGIC + _HEADER.pack(FORMAT_VERSION, len(data), hashlib.sha256(data).digest())
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("saved the converted %s to %s (%d bytes)", converted.module.__class__.__name__, target,
             len(header) + len(data))


def load(path: str | os.PathLike[str]) -> ConvertedModule:
    """Read a file written by :func:`save` and return the ConvertedModule, ready to train.

    The payload is unpickled, like ``torch.load(weights_only=False)``: it can run code, so load
    only files you trust. The checksum detects corruption, not tampering. Raises a subclass of
    ``ConvertedFileError`` for a file that is not autoscale's, truncated, corrupted, or in another
    format version.
    """
    raw = Path(path).read_bytes()
    data = _verified_payload(raw, str(path))
    try:
        payload = torch.load(io.BytesIO(data), weights_only=False)
    except Exception as e:
        raise ConvertedFileError(f"{path}: the file is intact (its checksum matches) but its payload cannot be read "
                                 f"({type(e).__name__}: {e}); it may need another autoscale or torch version: "
                                 f"{RECONVERT} with this one") from e
    if not isinstance(payload, dict) or payload.get("kind") != _KIND:
        raise ConvertedFileError(f"{path}: the payload is not a converted module; {RECONVERT}")
    versions = payload["versions"]
    if versions["torch"] != torch.__version__:
        log.warning("%s was saved with torch %s and is loaded with torch %s: its ops are found by name; if it "
                    "fails or differs, %s", path, versions["torch"], torch.__version__, RECONVERT)
    module = load_modules(payload["modules"])
    saved_state = payload["state"]
    if saved_state is not None:
        state = install_state(module, moments=saved_state["moments"])
        if list(state.layers) != saved_state["layers"]:
            raise ConvertedFileError(f"{path}: the saved module tree does not give the saved scale layout; "
                                     f"{RECONVERT}")
        try:
            state.load(saved_state["scales"], saved_state["stats"])
        except ValueError as e:
            raise ConvertedFileError(f"{path}: {e}; {RECONVERT}") from None
        # the watched sites in slot order (the graph's checks write those slots) and the promotions
        state.forward.restore(saved_state.get("forward", {}))
    gm = load_graph(payload["graph"])
    signature = _load_signature(payload["signature"])
    converted = ConvertedModule(module, gm, signature, record=payload["record"], extra=payload["extra"])
    # Tell the state that this graph serves it and which gradients the graph checks (as the
    # backend and convert do): GradScaler.step then skips those.
    register_graph(gm, [converted._value(s, ()) if s[0] != "input" else None for s in signature.sources],
              converted.config.overflow.threshold)
    return converted


def _verified_payload(raw: bytes, path: str) -> bytes:
    """The payload of a converted-module file, after checking magic, version, length and checksum
    (in that order: the version decides how the rest of the header reads)."""
    if len(raw) < len(MAGIC):
        if MAGIC.startswith(raw):
            raise TruncatedFileError(f"{path}: truncated: {len(raw)} bytes, shorter than autoscale's header "
                                     f"({_HEADER_SIZE} bytes); copy the file again, or {RECONVERT}")
        raise NotConvertedFileError(f"{path}: not an autoscale converted-module file (it does not start with "
                                    f"{MAGIC!r}); write one with autoscale.save")
    if not raw.startswith(MAGIC):
        hint = (" It looks like a torch.save file: read it with torch.load." if raw.startswith(b"PK\x03\x04")
                else "")
        raise NotConvertedFileError(f"{path}: not an autoscale converted-module file (it starts with "
                                    f"{raw[:len(MAGIC)]!r}, not {MAGIC!r}); write one with autoscale.save.{hint}")
    if len(raw) < len(MAGIC) + 4:
        raise TruncatedFileError(f"{path}: truncated inside its header ({len(raw)} of {_HEADER_SIZE} bytes); copy "
                                 f"the file again, or {RECONVERT}")
    (version,) = struct.unpack_from("<I", raw, len(MAGIC))
    if version not in READ_VERSIONS:
        action = ("upgrade autoscale" if version > FORMAT_VERSION
                  else "convert the model again with this autoscale and save it")
        raise FormatVersionError(f"{path}: saved by format version {version}, this autoscale reads versions "
                                 f"{', '.join(map(str, READ_VERSIONS))}: {action}")
    if len(raw) < _HEADER_SIZE:
        raise TruncatedFileError(f"{path}: truncated inside its header ({len(raw)} of {_HEADER_SIZE} bytes); copy "
                                 f"the file again, or {RECONVERT}")
    _, length, digest = _HEADER.unpack_from(raw, len(MAGIC))
    data = raw[_HEADER_SIZE:]
    if len(data) < length:
        raise TruncatedFileError(f"{path}: truncated: the payload ends after {len(data)} of its {length} bytes (an "
                                 f"interrupted write or copy); copy the file again, or {RECONVERT}")
    if len(data) > length:
        raise CorruptedFileError(f"{path}: corrupted: {len(data) - length} unexpected bytes follow the payload; "
                                 f"copy the file again, or {RECONVERT}")
    actual = hashlib.sha256(data).digest()
    if actual != digest:
        raise CorruptedFileError(f"{path}: corrupted: the payload's SHA-256 is {actual.hex()[:16]}..., the header "
                                 f"records {digest.hex()[:16]}... (the file changed after it was written); copy "
                                 f"the file again, or {RECONVERT}")
    return data


def _dump_signature(sig: _Signature) -> dict[str, Any]:
    """The signature's fields; the tree specs as pytree's JSON where it can write them (pickling
    a TreeSpec works too, but torch warns about its leaf class when unpickling)."""
    fields = dict(vars(sig))
    for key in ("in_spec", "out_spec"):
        try:
            fields[key] = pytree.treespec_dumps(fields[key])
        except Exception:  # a container pytree has no JSON name for (a user's namedtuple): pickled
            pass
    return fields


def _load_signature(fields: dict[str, Any]) -> _Signature:
    fields = dict(fields)
    for key in ("in_spec", "out_spec"):
        if isinstance(fields[key], str):
            fields[key] = pytree.treespec_loads(fields[key])
    return _Signature(**fields)


def _state(module: nn.Module) -> ScaleState | None:
    state = getattr(module, "_autoscale_state", None)
    return state if isinstance(state, ScaleState) else None


