"""Emulated low-precision compute: low-precision storage and rounding, float32 GEMM arithmetic.

Why: CPUs without FP16 matrix units run half-precision GEMMs ~100x slower than float32
(docs/design.md#emulated-compute). A product of two float16 numbers is exact in float32, and GPU tensor cores
accumulate in float32, so computing an allow-list op in float32 from its float16 inputs and rounding
the result to float16 gives what the GPU gives, up to summation order.

Each low-precision allow-list op becomes one call of ``autoscale.ops.emulated(name, dtype,
*args)``, which upcasts the inputs, runs the op (found by its importable name) and rounds its
result. It stays one node: AOTAutograd traces through it, so the joint graph holds the casts, and
autograd differentiates through them (the backward GEMMs are emulated alike, each input gradient
rounded to low precision as a native GEMM's output is). Spelled out as casts in this graph,
it would be four nodes per GEMM, which every later pass walks (docs/results/compile_time.md); the
joint stage's ``fold_casts`` merges the upcasts that GEMMs sharing an input repeat.

Every tensor stays exactly as native low precision would store it; only the arithmetic inside the
op is wider. Runs only when ``Config.compute == "emulate"``, as the last pass of the Dynamo stage,
so that every other pass sees the op itself, with its arguments where the tables and rules expect
them (``graph_utils.op_name`` still names the op inside an ``emulated`` call, for the reports).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import _get_qualified_name

from autoscale.ops import emulated, resolve

from ..graph_utils import PROVENANCE_KEY, dtype_name, float_dtype, op_name, provenance
from ..manager import PassResult
from ..op_tables import Category, category_of

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["emulate_compute"]

PASS = "emulate_compute"

log = logging.getLogger("autoscale.passes")


def emulate_compute(gm: GraphModule, cfg: Config) -> PassResult:
    """Compute every low-precision allow-list op in float32 from its low-precision inputs."""
    if cfg.compute != "emulate":
        return PassResult(gm, modified=False)
    low = cfg.dtype
    count = 0
    unnamed: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if category_of(op_name(node) or "", cfg.op_overrides) is not Category.ALLOW:
            continue
        inputs = [a for a in node.all_input_nodes if float_dtype(a) is not None]
        if float_dtype(node) != low or not inputs or any(float_dtype(a) != low for a in inputs):
            continue
        name = _importable_name(node)
        if name is None:
            unnamed[op_name(node) or str(node.target)] = None
            continue
        node.args = (name, low, *node.args)
        node.op, node.target = "call_function", emulated
        if PROVENANCE_KEY not in node.meta:  # (painted by convert_precision, unless a pipeline leaves it out)
            provenance(node, PASS, f"computes in {dtype_name(low)}")
        node.meta[PROVENANCE_KEY]["emulated"] = f"float32 arithmetic on {dtype_name(low)} inputs, rounded"
        count += 1
    if unnamed:
        log.warning("emulate_compute: %s cannot be found by name, so it runs natively in %s (slow on CPU); "
                    "define it at module level", ", ".join(unnamed), dtype_name(low))
    return PassResult(gm, modified=count > 0, counts={"emulated": count, "native": len(unnamed)})


def _importable_name(node: Node) -> str | None:
    """The name ``emulated`` finds ``node``'s op by (a method as ``torch.Tensor.<name>``), or None."""
    target: Any = getattr(torch.Tensor, str(node.target), None) if node.op == "call_method" else node.target
    try:
        name = _get_qualified_name(target)
        return name if resolve(name) is target else None
    except Exception:  # a lambda, a local function, an object without a name
        return None
