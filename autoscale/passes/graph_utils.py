"""Small helpers the passes share: op names, tensor metadata, layer names, provenance, casts."""

from __future__ import annotations

import inspect
import operator
import os
import re
from collections.abc import Callable
from functools import cache, lru_cache, partial
from operator import is_not
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from autoscale.ops import Attached, emulated, resolve

from .op_tables import FIXED, SPARSE_GRADIENT, VIEWS

__all__ = [
    "DYNAMO_ROOT",
    "KEY",
    "MAY_ALIAS",
    "PREFIX_KEY",
    "PROVENANCE_KEY",
    "attach_of",
    "cast_of",
    "copy_graph_module",
    "source_line",
    "source_name",
    "sparse_gradient",
    "dtype_name",
    "float_dtype",
    "inplace_position",
    "input_path",
    "insert_cast",
    "is_attach",
    "is_inplace",
    "layer_of",
    "module_entry",
    "mutated_aliases",
    "new_constant",
    "new_fake_call",
    "new_node",
    "node_keys",
    "op_args",
    "op_name",
    "parameter_path",
    "provenance",
    "redirect_uses",
    "requires_grad_map",
    "target_name",
    "retyped",
    "tensor_val",
]

PROVENANCE_KEY = "autoscale"
KEY = "autoscale_key"
"""A node's name that every compile of the same model gives the same node (``node_keys``)."""
# On an ``attach`` node the backend added (a graph after a graph break): the path of the scaler's
# model in the graph's module paths (where the forward's own ``attach`` has its module stack).
PREFIX_KEY = "autoscale_prefix"

# Ops whose result may share storage with their first argument.
MAY_ALIAS = VIEWS | FIXED

# Python operators as Dynamo records them, by the name of the tensor op they stand for.
_OPERATOR_NAMES: dict[Callable[..., Any], str] = {
    operator.add: "add", operator.iadd: "add_", operator.sub: "sub", operator.isub: "sub_",
    operator.mul: "mul", operator.imul: "mul_", operator.truediv: "truediv",
    operator.itruediv: "div_", operator.floordiv: "floordiv", operator.matmul: "matmul",
    operator.neg: "neg", operator.pow: "pow", operator.ipow: "pow_", operator.getitem: "getitem",
    operator.abs: "abs", operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge",
}


def target_name(node: Node) -> str | None:
    """The name of the op a call node runs, as written (``relu_``, ``add``, ``addmm``)."""
    target = node.target
    if node.op == "call_method":
        assert isinstance(target, str)
        return target
    if node.op != "call_function":
        return None
    try:
        return _function_name(target)
    except TypeError:  # an unhashable callable
        return _function_name.__wrapped__(target)


@lru_cache(maxsize=1024)  # asked several times per node by every pass
def _function_name(target: Callable[..., Any]) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    if target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[target]
    return getattr(target, "__name__", None)


def _has_inplace_suffix(name: str | None) -> bool:
    return name is not None and name.endswith("_") and not name.endswith("__")


def is_inplace(node: Node) -> bool:
    """Whether ``node`` mutates its first argument (``relu_``, ``x += y``, ``F.relu(x, inplace=True)``,
    and ``F.hardtanh(x, 0.0, 6.0, True)``: what ``nn.ReLU6(inplace=True)`` traces to)."""
    if node.kwargs.get("inplace") is True or _has_inplace_suffix(target_name(node)):
        return True
    at = inplace_position(node.target) if node.op == "call_function" else None
    return at is not None and len(node.args) > at and node.args[at] is True


@cache
def inplace_position(target: Any) -> int | None:
    """Where a Python function takes ``inplace`` positionally (``F.hardtanh``: 3), or None."""
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # a builtin or an op without a Python signature
        return None
    return names.index("inplace") if "inplace" in names else None


def op_name(node: Node) -> str | None:
    """The table key of a call node: its op's name with any in-place ``_`` suffix removed. For an
    ``emulated(op, dtype, ...)`` call (``emulate_compute``), the name of ``op``."""
    name = target_name(node)
    if node.target is emulated and node.args and isinstance(node.args[0], str):
        name = _function_name(resolve(node.args[0]))
    return name[:-1] if name is not None and _has_inplace_suffix(name) else name


def op_args(node: Node) -> tuple[Any, ...]:
    """The positional arguments of the op ``node`` computes: for an ``emulated(op, dtype, ...)``
    call (``emulate_compute``), those after ``op`` and ``dtype``."""
    return node.args[2:] if node.target is emulated else node.args


def sparse_gradient(node: Node) -> bool:
    """Whether ``node`` asks for a sparse weight gradient (an op in ``SPARSE_GRADIENT`` with its flag set)."""
    flag = SPARSE_GRADIENT.get(op_name(node) or "") if node.op in ("call_function", "call_method") else None
    if flag is None:
        return False
    keyword, position = flag
    return bool(node.kwargs.get(keyword, node.args[position] if len(node.args) > position else False))


def mutated_aliases(graph: Graph) -> set[Node]:
    """Every node that may share storage with a tensor that some op of ``graph`` mutates in place.

    Casts of these are copies whose value depends on where they are taken, so passes never share,
    move or merge them.
    """
    nodes = list(graph.nodes)
    if not any(is_inplace(n) for n in nodes):  # the usual case once remove_inplace has run
        return set()
    parent: dict[Node, Node] = {}

    def root(n: Node) -> Node:
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    for n in nodes:
        src = n.args[0] if n.args else None
        if isinstance(src, Node) and (op_name(n) in MAY_ALIAS or is_inplace(n)):
            parent[root(n)] = root(src)
    mutated = {root(n) for n in nodes if is_inplace(n)}
    return {n for n in nodes if root(n) in mutated} if mutated else set()


def dtype_name(dtype: torch.dtype | None) -> str:
    """``torch.float16`` -> ``"float16"``, for reports and provenance."""
    return str(dtype).removeprefix("torch.")


def tensor_val(node: Node) -> Any:
    """The fake value recorded for ``node`` (``meta["val"]``, or Dynamo's ``example_value``)."""
    return node.meta.get("val", node.meta.get("example_value"))


def retyped(val: Any, dtype: torch.dtype) -> Any:
    """``val`` (a fake tensor, or a tuple of them) with its floating tensors in ``dtype``: the value
    of a dtype-preserving op once its inputs are cast. Passes record it for the nodes they create
    or retype. A static-shape fake tensor is built directly rather than by dispatching ``.to`` through
    its fake mode, an order of magnitude dearer, which on a 10,000-node graph would be most of a pass's
    time.
    """
    if isinstance(val, tuple | list):
        return type(val)(retyped(v, dtype) for v in val)
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point or val.dtype == dtype:
        return val
    if isinstance(val, FakeTensor) and all(isinstance(s, int) for s in (*val.shape, *val.stride())):
        meta = torch.empty_strided(val.shape, val.stride(), dtype=dtype, device="meta")
        return FakeTensor(val.fake_mode, meta, val.device)
    return val.to(dtype)


def requires_grad_map(graph: Graph) -> dict[Node, bool]:
    """Which nodes carry a gradient: by their recorded values, or because a floating input does
    (higher-order ops such as ``autograd_function_apply`` lose the flag in fake propagation)."""
    requires: dict[Node, bool] = {}
    for n in graph.nodes:
        val = tensor_val(n)
        vals = val if isinstance(val, tuple | list) else (val,)
        if not any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals):
            requires[n] = False
        elif isinstance(val, torch.Tensor) and n.meta.get("requires_grad", val.requires_grad):
            requires[n] = True
        else:
            requires[n] = (n.op in ("call_function", "call_method") and op_name(n) != "detach"
                           and any(requires.get(a, False) for a in n.all_input_nodes))
    return requires


def float_dtype(node: Any) -> torch.dtype | None:
    """The dtype of ``node`` if it is a graph node producing one floating-point tensor."""
    if not isinstance(node, Node):
        return None
    val = tensor_val(node)
    if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
        return val.dtype
    return None


# The root of a module path as Dynamo spells it: a frame local or global (``L['root']``,
# ``L['self']``), possibly reached through a bound method's ``__self__``, or the module whose
# announcing forward (``GradScaler``'s ``functools.partial`` over it, ``autoscale.runtime``) was
# compiled on its own, as in ``model.forward = torch.compile(model.forward)`` (``L['fn'].args[0]``).
DYNAMO_ROOT = re.compile(r"^[LG]\['[^']*'\](?:\.__self__|(?<=\['fn'\])\.args\[0\])?")
_ROOT = re.compile(DYNAMO_ROOT.pattern + r"\.?")
# Inside the model, wrappers that are the module they wrap: a submodule with an announcing forward,
# reached through it (``inner.forward.args[0].fc1`` is ``inner.fc1``: the scaler's model is part of
# the compiled one), and a submodule compiled on its own (``inner._orig_mod.fc1``: Dynamo inlines
# it into the outer graph).
_WRAPPED = re.compile(r"\.(?:forward\.args\[0\]|_orig_mod)(?=\.|$)")
_INDEX = re.compile(r"\[(\d+)\]|\['([^']*)'\]")


# Where a module stack entry's path starts: its root and, for a module that is a positional
# argument (``L['args'][0]``: the announcing forward's), the argument's index.
_SOURCE = re.compile(DYNAMO_ROOT.pattern + r"(?:\[\d+\])?")


def module_entry(node: Node) -> tuple[str, Any] | None:
    """The innermost module of the model that ``node`` runs in, as Dynamo's module stack gives it:
    ``(dynamo_path, module_class)``, or None outside any module.

    Forward nodes carry Dynamo's ``nn_module_stack``; backward nodes of AOTAutograd's joint graph
    carry ``fwd_nn_module_stack``. The model's modules are those reached from the root the
    outermost entry is reached from. A module the model calls but does not hold is reached from
    elsewhere and is passed over: its ops belong to the module that called it. transformers 5.25
    made such modules of functions (``apply_rotary_pos_emb`` is an ``nn.Module`` instance held by
    the modeling file, ``G['__import_transformers...'].apply_rotary_pos_emb``); read as a path,
    it named no layer of the model, and its ops fell to the model's top level.
    """
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    entries = [(str(path), rest[0] if rest else None) for path, *rest in stack.values()]
    root = _source_of(entries[0][0])
    return next((path, cls) for path, cls in reversed(entries) if _source_of(path) == root)


def layer_of(node: Node) -> str:
    """The module path (``layers.0.fc``) that ``node`` belongs to (``module_entry``), or "" at the
    model's top level."""
    entry = module_entry(node)
    return _module_path(entry[0]) if entry is not None else ""


@lru_cache(maxsize=4096)
def _source_of(dynamo_path: str) -> str:
    match = _SOURCE.match(dynamo_path)
    return match.group(0) if match else ""


@lru_cache(maxsize=4096)
def _module_path(dynamo_path: str) -> str:
    path = _WRAPPED.sub("", _ROOT.sub("", dynamo_path))
    return _INDEX.sub(lambda m: "." + (m.group(1) or m.group(2)), path).lstrip(".")


_CONTAINERS = re.compile(r"\._(?:modules|parameters|buffers)(?=\[)")


def source_name(node: Node) -> str:
    """Dynamo's source of a graph input (``L['self']._modules['fc1']._parameters['weight']``), or ""
    for a node that is not one, or of a graph Dynamo did not make. Read off ``_dynamo_source``,
    which outlives the ``grapharg`` meta Dynamo drops once the backend returns."""
    if node.op != "placeholder":
        return ""
    source = getattr(node, "_dynamo_source", None) or getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return ""
    return source.name if isinstance(source.name, str) else str(source.name())  # (a method in older torch)


def input_path(node: Node) -> str | None:
    """The dotted path (``fc1.weight``) of the parameter or buffer that Dynamo graph input ``node``
    is, or None for any other input (a forward argument's placeholder name, ``l_x_``, already says
    what it is). Users know their parameters by these names, not by Dynamo's placeholder names."""
    name = source_name(node)
    if "._parameters[" not in name and "._buffers[" not in name:
        return None
    return _module_path(_CONTAINERS.sub("", name)) or None


def parameter_path(node: Node) -> str | None:
    """``input_path`` for a module parameter only (None for a buffer), in ``layer_of``'s terms: the
    module that owns it is everything before the last dot.

    Read off Dynamo's source of the input, not off the node's module stack, which is the module of
    the parameter's first use: a tied weight (GPT-2's ``lm_head`` reads ``transformer.wte.weight``)
    belongs to the module that holds it."""
    return input_path(node) if "._parameters[" in source_name(node) else None


def provenance(node: Node, pass_name: str, reason: str, **extra: Any) -> None:
    """Record on ``node`` which pass decided what about it, for which layer, and why."""
    node.meta[PROVENANCE_KEY] = {"pass": pass_name, "layer": layer_of(node), "reason": reason, **extra}


_CAST_METHODS: dict[str, torch.dtype] = {
    "float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64,
}


def cast_of(node: Node) -> tuple[Node, torch.dtype] | None:
    """``(source, dtype)`` if ``node`` only converts the dtype of ``source``, else None.

    Recognizes ``x.to(dtype)``, ``x.float()``/``half()``/…, ``prims.convert_element_type`` and a
    dtype-only ``aten._to_copy``, so one fold serves the Dynamo and the ATen graphs.
    """
    args, kwargs = node.args, node.kwargs
    if not args or not isinstance(args[0], Node):
        return None
    src, dtype = args[0], None  # type: tuple[Node, Any]
    name = target_name(node)
    if node.op == "call_method" and name in _CAST_METHODS and len(args) == 1 and not kwargs:
        dtype = _CAST_METHODS[name]
    elif node.op == "call_method" and name == "to" and set(kwargs) <= {"dtype"}:
        positional = args[1:]
        if "dtype" in kwargs and not positional:
            dtype = kwargs["dtype"]
        elif "dtype" not in kwargs and len(positional) == 1:
            dtype = positional[0]  # x.to(device) or x.to(tensor) are not dtype casts: rejected below
    elif node.target is torch.ops.prims.convert_element_type.default:
        dtype = args[1]
    elif node.target is torch.ops.aten._to_copy.default and len(args) == 1 and _same_place(src, kwargs):
        dtype = kwargs.get("dtype")
    return (src, dtype) if isinstance(dtype, torch.dtype) else None


def redirect_uses(old: Node, new: Node) -> None:
    """Make every user of ``old`` except ``new`` itself read ``new`` (``new`` wraps ``old``)."""
    old.replace_all_uses_with(new, delete_user_cb=partial(is_not, new))


def _same_place(src: Node, kwargs: dict[str, Any]) -> bool:
    """``_to_copy`` kwargs that change nothing but the dtype (AOTAutograd spells out layout and device)."""
    val = tensor_val(src)
    return (set(kwargs) <= {"dtype", "layout", "device"}
            and kwargs.get("layout", torch.strided) == torch.strided
            and (kwargs.get("device") is None
                 or (isinstance(val, torch.Tensor) and torch.device(kwargs["device"]) == val.device)))


def new_node(graph: Graph, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Node:
    """``graph.create_node(op, target, args, kwargs)`` at the insert point, for arguments that hold
    only nodes and plain constants (dtypes, ints, tuples of them), as the passes' own nodes do.

    Since torch 2.13, ``create_node`` walks every argument with pytree to warn about raw SymInts;
    that walk is a large share of its cost, and the passes create thousands of nodes
    (docs/results/compile_time.md). The node is created bare and its arguments assigned
    through ``Node.args``/``Node.kwargs``, which keep the use lists exactly as ``create_node``
    would. Arguments copied from the user's graph keep going through ``create_node``.
    """
    node = graph.create_node(op, target)
    node.args = args
    if kwargs:
        node.kwargs = kwargs
    return node


def insert_cast(graph: Graph, src: Node, dtype: torch.dtype, *, before: Node, like: Node | None = None) -> Node:
    """Insert ``src.to(dtype)`` right before ``before`` (the first op that reads it).

    The cast gets its fake value, and the module stack and source line of ``like`` (default
    ``before``: the op it serves), so that AOTAutograd's backward nodes for it map to that op's
    layer (``fwd_nn_module_stack``).
    """
    with graph.inserting_before(before):
        cast = new_node(graph, "call_method", "to", (src,), {"dtype": dtype})
    val = tensor_val(src)
    if isinstance(val, torch.Tensor):
        cast.meta["val"] = retyped(val, dtype)
    like = like if like is not None else before
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in like.meta:
            cast.meta[key] = like.meta[key]
    return cast


def is_attach(n: Node) -> bool:
    """Whether ``n`` is the scaler state's marker op (``autoscale::attach``)."""
    return n.op == "call_function" and n.target in (torch.ops.autoscale.attach, torch.ops.autoscale.attach.default)


def attach_of(graph: Graph) -> tuple[Node, Attached, str] | None:
    """The graph's ``attach`` node, its arguments by name, and the path of the scaler's model in
    the graph's module paths ("" when the model was compiled directly); None without a scaler."""
    node = next((n for n in graph.nodes if is_attach(n)), None)
    if node is None:
        return None
    return node, Attached(*node.args), node.meta.get(PREFIX_KEY, layer_of(node))


def node_keys(graph: Graph, prefix: str = "") -> dict[Node, str]:
    """A stable name per input and op: ``<module path>:<op>#<k>``, the k-th such op of that module in
    graph order (module paths relative to ``prefix``, the scaler's model), ``input:<name>`` for a
    placeholder. Dynamo traces the same model to the same graph, so a key learnt in one compile
    names the same node in the next, in a resumed run and in ``autoscale diff``."""
    counts: dict[tuple[str, str], int] = {}
    keys: dict[Node, str] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            keys[n] = f"input:{n.name}"
        elif n.op in ("call_function", "call_method", "call_module"):
            layer = layer_of(n)
            if prefix:
                layer = "" if layer == prefix else layer.removeprefix(prefix + ".")
            op = op_name(n) or str(n.target)
            k = counts.get((layer, op), 0)
            counts[layer, op] = k + 1
            keys[n] = f"{layer}:{op}#{k}"
    return keys


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` with the same node names and shallow copies of their meta, so that the
    passes' rewrites of the copy (and of its nodes' meta entries) do not show through in ``gm``:
    the graph before the passes, kept to diff against or to rewrite again."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)


def source_line(n: Node) -> str:
    """Where the model's code made ``n``: ``models.py:163: h = torch.log(F.relu(self.fc(x)))`` (the
    innermost frame of Dynamo's stack trace), or "" when the node has none."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n([^\n]*)', n.meta.get("stack_trace") or "")
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f"{os.path.basename(path)}:{line}: {code.strip()}"


def new_fake_call(graph: Graph, fake_mode: FakeTensorMode, target: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any] | None = None) -> Node:
    """A call_function node at the insert point (``new_node``), with its fake value: ``target`` run
    in ``fake_mode`` on its arguments' values. For the ATen nodes a joint-stage pass builds."""
    node = new_node(graph, "call_function", target, args, kwargs)
    with fake_mode:
        node.meta["val"] = target(*map_arg(args, _val), **map_arg(kwargs or {}, _val))
    return node


def _val(n: Node) -> Any:
    return n.meta["val"]


def new_constant(gm: GraphModule, fake_mode: FakeTensorMode, name: str, make: Callable[[], torch.Tensor]) -> Node:
    """A get_attr at the insert point of the real tensor ``make()`` returns, held by ``gm`` as
    ``name``, with its fake value. ``make`` runs outside the fake mode (a pass may run under it).
    The caller reads it as traced code reads a constant, through ``lift_fresh_copy``:
    FakeTensorProp takes a real tensor only that way."""
    with unset_fake_temporarily():
        tensor = make()
    setattr(gm, name, tensor)
    attr = new_node(gm.graph, "get_attr", name, ())
    attr.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
    return attr
