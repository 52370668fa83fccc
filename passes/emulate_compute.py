"""Emulated low-precision compute: low-precision storage and rounding, float32 GEMM arithmetic.

Why: CPUs without FP16 matrix units run half-precision GEMMs ~100x slower than float32
(DESIGN.md §3). A product of two float16 numbers is exact in float32, and GPU tensor cores
accumulate in float32, so computing an allow-list op in float32 from its float16 inputs and rounding
the result to float16 gives what the GPU gives, up to summation order. Autograd differentiates
through the casts, so the backward GEMMs are emulated the same way: their float16 inputs are
upcast and their results rounded to float16.

Every tensor stays exactly as native low precision would store it; only the arithmetic inside the
op is wider. Runs after ``convert_precision``, only when ``Config.compute == "emulate"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node

from .graph_utils import dtype_name, float_dtype, insert_cast, op_name, provenance, redirect_uses, retyped, tensor_val
from .manager import PassResult
from .op_tables import Category, category_of

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["emulate_compute"]

PASS = "emulate_compute"


def emulate_compute(gm: GraphModule, cfg: Config) -> PassResult:
    """Compute every low-precision allow-list op in float32 from its low-precision inputs."""
    if cfg.compute != "emulate":
        return PassResult(gm, modified=False)
    graph, low = gm.graph, cfg.dtype
    upcasts: dict[Node, Node] = {}
    emulated = 0
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        if category_of(op_name(node) or "", cfg.op_overrides) is not Category.ALLOW:
            continue
        inputs = [a for a in dict.fromkeys(node.all_input_nodes) if float_dtype(a) is not None]
        if float_dtype(node) != low or not inputs or any(float_dtype(a) != low for a in inputs):
            continue
        for a in inputs:
            if a not in upcasts:
                upcasts[a] = _cast(graph, a, torch.float32, node, f"upcast {a.name} for emulated {node.name}")
            node.replace_input_with(a, upcasts[a])
        rounded = _cast(graph, node, low, node.next, f"round emulated {node.name} to {dtype_name(low)}", like=node)
        redirect_uses(node, rounded)
        node.meta["val"] = retyped(tensor_val(node), torch.float32)
        emulated += 1
    return PassResult(gm, modified=emulated > 0, counts={"emulated": emulated, "upcasts": len(upcasts)})


def _cast(graph: torch.fx.Graph, src: Node, dtype: torch.dtype, before: Node, reason: str,
          like: Node | None = None) -> Node:
    cast = insert_cast(graph, src, dtype, before=before, like=like)
    provenance(cast, PASS, reason, created=True)
    return cast
