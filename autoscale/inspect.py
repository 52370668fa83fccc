"""Reports read off a rewritten graph's provenance (``node.meta["autoscale"]``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from autoscale.passes.graph_utils import PROVENANCE_KEY, cast_of, dtype_name, op_name, target_name
from autoscale.protocol import LAYOUT_SEP, PROMOTED_SEP

__all__ = ["Island", "PrecisionReport", "format_graph", "precision_report"]

_CAST_PASSES = ("convert_precision", "fold_casts")


@dataclass(frozen=True)
class Island:
    """Ops of one kind kept in float32 for one reason."""

    op: str
    reason: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class PrecisionReport:
    """What the precision pass did to one graph.

    ``converted`` of ``total`` floating-point ops compute in ``dtype``, using ``casts`` casts
    (not counting the extra casts of emulated compute, which native hardware does not run);
    ``islands`` are the ops kept in float32 and why; ``unknown_ops`` are ops the tables do not know.
    """

    dtype: str
    compute: str
    converted: int
    total: int
    casts: int
    islands: tuple[Island, ...]
    unknown_ops: tuple[str, ...]

    def __str__(self) -> str:
        text = (f"converted {self.converted} of {self.total} nodes to {self.dtype} using {self.casts} "
                f"casts (compute: {self.compute})")
        if self.islands:
            text += "; FP32 islands: " + "; ".join(
                f"{i.op}{f' x{len(i.nodes)}' if len(i.nodes) > 1 else ''} -> {i.reason}" for i in self.islands)
        if self.unknown_ops:
            text += "; unknown ops (kept in float32): " + ", ".join(self.unknown_ops)
        return text


def precision_report(gm: GraphModule, *, dtype: str, compute: str) -> PrecisionReport:
    """Summarize the precision decisions recorded on ``gm``'s nodes."""
    converted = total = casts = 0
    islands: dict[tuple[str, str], list[str]] = defaultdict(list)
    unknown: dict[str, None] = {}
    for node in gm.graph.nodes:
        prov = node.meta.get(PROVENANCE_KEY)
        if prov is None:
            continue
        if prov.get("created"):
            if prov["pass"] in _CAST_PASSES and cast_of(node) is not None:
                casts += 1
            continue
        if "precision" not in prov:
            continue
        total += 1
        op = op_name(node) or str(node.target)
        if prov["precision"] == dtype:
            converted += 1
        else:
            islands[(op, prov["reason"])].append(node.name)
        if prov["category"] == "unknown":
            unknown[op] = None
    return PrecisionReport(
        dtype=dtype, compute=compute, converted=converted, total=total, casts=casts,
        islands=tuple(Island(op, reason, tuple(nodes)) for (op, reason), nodes in islands.items()),
        unknown_ops=tuple(unknown),
    )


_PACKED = (LAYOUT_SEP, PROMOTED_SEP)
_DTYPE_ABBREV = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64", "int64": "i64",
                 "int32": "i32", "bool": "b8", "uint8": "u8", "int8": "i8"}


def format_graph(gm: GraphModule, *, provenance: bool = True, names: Mapping[Node, str] | None = None) -> str:
    """The graph as stable, readable text: one line per node with its dtype and shape, the op and
    its arguments, and (optionally) which autoscale pass made or decided it and why.

    Made for golden tests and diffs: no memory addresses, no Python code, no line numbers.
    ``names`` renames nodes wherever they appear (the diff names parameter inputs by their module
    path, ``h.0.ln_1.weight``, rather than Dynamo's ``l_self_modules_h_modules_0_..._weight_``).
    """
    shown = names or {}

    def arg(a: object) -> str:
        return _format_arg(a, shown)

    lines = []
    for node in gm.graph.nodes:
        val = node.meta.get("val", node.meta.get("example_value"))
        typ = _format_type(val)
        if node.op == "placeholder":
            line = f"input {shown.get(node, node.name)}: {typ}"
        elif node.op == "output":
            line = f"return {arg(node.args[0])}"
        else:
            op = target_name(node) or str(node.target)
            args = [arg(a) for a in node.args] + [f"{k}={arg(v)}" for k, v in node.kwargs.items()]
            line = f"{shown.get(node, node.name)}: {typ} = {op}({', '.join(args)})"
        prov = node.meta.get(PROVENANCE_KEY)
        if provenance and prov:
            tag = "+" if prov.get("created") else prov.get("precision", "")
            tag += ", emulated" if prov.get("emulated") else ""
            line += f"  # [{prov['pass']}{' ' + tag if tag else ''}] {prov['reason']}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _format_type(val: object) -> str:
    if isinstance(val, torch.Tensor):
        dtype = dtype_name(val.dtype)
        return f"{_DTYPE_ABBREV.get(dtype, dtype)}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, tuple | list):
        return "(" + ", ".join(_format_type(v) for v in val) + ")"
    return type(val).__name__ if val is not None else "?"


def _format_arg(arg: object, names: Mapping[Node, str]) -> str:
    if isinstance(arg, Node):
        return names.get(arg, arg.name)
    if isinstance(arg, tuple | list):
        inner = ", ".join(_format_arg(a, names) for a in arg)
        return f"({inner}{',' if len(arg) == 1 else ''})" if isinstance(arg, tuple) else f"[{inner}]"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k}: {_format_arg(v, names)}" for k, v in arg.items()) + "}"
    if isinstance(arg, torch.dtype):
        return dtype_name(arg)
    if isinstance(arg, str) and (sep := next((c for c in _PACKED if c in arg), None)) is not None:
        return f"<{len(arg.split(sep))} names>"  # (separator bytes mean nothing to a reader)
    return repr(arg)
