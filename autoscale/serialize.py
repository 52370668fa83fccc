"""A converted module as plain data: its graph node by node and its module tree, written and read
back without the model's code; and the errors a conversion, a save or a load raises.

The graph is stored node by node (op, name, target by qualified name, arguments, autoscale's
provenance), not as a pickled ``GraphModule``: that pickles Python code and re-traces it on load,
which inlines plain Python functions (``autoscale.ops.rescale`` came back as ``view_as``, silently
dropping every scale point) and forgets each node's provenance. The model is stored as its module
tree with its parameters and buffers (types by name only): a loaded module needs autoscale and
torch, not the code of the model's class. ``autoscale.convert`` writes and reads the file around it.
"""

from __future__ import annotations

import operator
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import _get_qualified_name, map_aggregate

from autoscale.ops import resolve
from autoscale.passes.graph_utils import PROVENANCE_KEY
from autoscale.runtime import ScaleState

__all__ = ["RECONVERT", "ConvertError", "ConvertedFileError", "CorruptedFileError", "FormatVersionError",
           "NotConvertedFileError", "SavedModule", "TruncatedFileError", "dump_graph", "dump_modules", "load_graph",
           "load_modules"]

RECONVERT = "re-run autoscale.convert and save again"
"""What a refused file's message tells the user to do."""


class ConvertError(RuntimeError):
    """``convert`` cannot turn this model into one static graph (the message says why and what to do)."""


class ConvertedFileError(ValueError):
    """A file that ``load`` refuses; the subclass says which problem it is."""


class NotConvertedFileError(ConvertedFileError):
    """The file does not start with autoscale's magic bytes: it was not written by ``autoscale.save``."""


class TruncatedFileError(ConvertedFileError):
    """The file ends before its header or its payload does (an interrupted write or copy)."""


class CorruptedFileError(ConvertedFileError):
    """The payload's SHA-256 differs from the header's, or bytes follow the payload."""


class FormatVersionError(ConvertedFileError):
    """The file was written in a format version this autoscale does not read."""


class SavedModule(nn.Module):
    """A module of a loaded converted model: the original's parameters and buffers under their
    names, and no code (the graph is the code). ``type_name`` is the original class, for repr."""

    def __init__(self, type_name: str) -> None:
        super().__init__()
        self.type_name = type_name

    def extra_repr(self) -> str:
        return f"saved from {self.type_name}"


def dump_modules(model: nn.Module, state: ScaleState | None) -> list[dict[str, Any]]:
    """The module tree in ``named_modules`` order, each distinct module once with its own
    parameters and buffers (shared tensors and modules stay shared: pickle keeps identity). The
    scale state's buffers are left out: ``load`` installs the state afresh and copies its values."""
    skip = {id(state.scales), id(state.stats)} if state is not None else set()
    refs: dict[int, int] = {}
    entries: list[dict[str, Any]] = []
    for path, m in model.named_modules(remove_duplicate=False):
        first = id(m) not in refs
        entry: dict[str, Any] = {"path": path, "ref": refs.setdefault(id(m), len(refs)), "training": m.training}
        if first:
            entry["type"] = f"{type(m).__module__}.{type(m).__qualname__}"
            entry["parameters"] = list(m._parameters.items())
            entry["buffers"] = [(name, b, name not in m._non_persistent_buffers_set)
                                for name, b in m._buffers.items() if b is None or id(b) not in skip]
        entries.append(entry)
    return entries


def load_modules(entries: list[dict[str, Any]]) -> nn.Module:
    by_ref: dict[int, nn.Module] = {}
    by_path: dict[str, nn.Module] = {}
    for entry in entries:
        module = by_ref.get(entry["ref"])
        if module is None:
            module = SavedModule(entry["type"])
            for name, p in entry["parameters"]:
                module.register_parameter(name, p)
            for name, b, persistent in entry["buffers"]:
                module.register_buffer(name, b, persistent=persistent)
            module.training = entry["training"]
            by_ref[entry["ref"]] = module
        path = entry["path"]
        if path:
            parent, _, name = path.rpartition(".")
            if name not in by_path[parent]._modules:
                by_path[parent].add_module(name, module)
        by_path[path] = module
    return by_path[""]


@dataclass(frozen=True)
class _NodeRef:
    """A node argument in a saved graph: the name of the node it refers to."""

    name: str


_KEEP_META = ("stack_trace",)
_PARAMETER_TYPES = (torch.Tensor, nn.Parameter)


def dump_graph(gm: GraphModule) -> dict[str, Any]:
    """``gm`` node by node: op, name, target (a function by its qualified name), arguments (nodes
    as ``_NodeRef``), the placeholder's annotation, and the picklable metadata autoscale reads:
    its provenance and annotations, the stack trace, the module stack as strings."""
    nodes = []
    attrs: dict[str, Any] = {}
    for n in gm.graph.nodes:
        target: Any = n.target
        if n.op == "call_function":
            target = _qualified_name(target)
        elif n.op in ("get_attr", "call_module"):
            attrs[n.target] = _dump_attr(gm, n.target)
        nodes.append({
            "op": n.op, "name": n.name, "target": target,
            "args": map_aggregate(n.args, _ref), "kwargs": map_aggregate(n.kwargs, _ref),
            "type": n.type if n.type in _PARAMETER_TYPES else None,
            "meta": _portable_meta(n),
        })
    meta = {k: v for k, v in gm.meta.items() if k.startswith("autoscale")}
    return {"nodes": nodes, "attrs": attrs, "meta": meta}


def _ref(a: Any) -> Any:
    return _NodeRef(a.name) if isinstance(a, Node) else a


def _dump_attr(gm: GraphModule, target: str) -> tuple[str, Any]:
    value = operator.attrgetter(target)(gm)
    if isinstance(value, GraphModule):
        return ("graph", dump_graph(value))
    if isinstance(value, torch.Tensor):
        return ("tensor", value)
    raise ConvertError(f"cannot save: the graph uses attribute {target!r}, a {type(value).__name__}; only tensors "
                       "and graph modules are supported")


def _portable_meta(n: Node) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, value in n.meta.items():
        if key == PROVENANCE_KEY or key.startswith("autoscale") or key in _KEEP_META:
            try:
                pickle.dumps(value)
            except Exception:
                continue
            meta[key] = value
    stack = n.meta.get("nn_module_stack")
    if isinstance(stack, dict):  # (its values hold the module classes: kept as names)
        meta["nn_module_stack"] = {k: (v[0], v[1] if isinstance(v[1], str) else _type_name(v[1]))
                                   for k, v in stack.items() if isinstance(v, tuple) and len(v) == 2}
    return meta


def _type_name(t: Any) -> str:
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', repr(t))}"


def _qualified_name(target: Any) -> str:
    """The importable name of a call's target; refused at save time if ``load`` would not find it."""
    try:
        name = _get_qualified_name(target)
        found = resolve(name) is target
    except Exception:
        found, name = False, repr(target)
    if not found:
        raise ConvertError(f"cannot save: the graph calls {name}, which cannot be imported by name (a lambda or "
                           "local function?); call module-level functions from the forward")
    return name


def load_graph(saved: dict[str, Any]) -> GraphModule:
    graph = Graph()
    env: dict[str, Node] = {}

    def node_of(a: Any) -> Any:
        return env[a.name] if isinstance(a, _NodeRef) else a

    for entry in saved["nodes"]:
        target = resolve(entry["target"]) if entry["op"] == "call_function" else entry["target"]
        node = graph.create_node(entry["op"], target, map_aggregate(entry["args"], node_of),
                                 map_aggregate(entry["kwargs"], node_of), name=entry["name"], type_expr=entry["type"])
        if node.name != entry["name"]:
            raise ConvertedFileError(f"saved graph node {entry['name']!r} came back as {node.name!r}; {RECONVERT}")
        node.meta.update(entry["meta"])
        env[node.name] = node
    root: dict[str, Any] = {}
    for target, (kind, value) in saved["attrs"].items():
        root[target] = load_graph(value) if kind == "graph" else value
    gm = GraphModule(root, graph)
    gm.meta.update(saved["meta"])
    return gm

