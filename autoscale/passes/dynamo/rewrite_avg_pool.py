"""Rewrite an average pool whose one window overhangs its whole input as the mean it is.

Why: Inductor's ``avg_pool2d`` backward divides every window's gradient by the kernel's area,
where eager (and Inductor's own forward) divide a window that ``ceil_mode=True`` lets overhang the
input by the part of it inside the input (pytorch/pytorch#198119, open in torch 2.14 and nightly).
A compiled model gets silently wrong gradients there. Hugging Face's EfficientNet pools globally
with ``AvgPool2d(hidden_dim, ceil_mode=True)``: on its 2x2 map the one window holds 4 of 320²
positions, and under Inductor (autoscale's default executor, and plain ``torch.compile``) every
gradient below the pool came out 25,600 times too small.

A pool with one window along each dimension, no padding, and a kernel at least the input's size
is a mean over the pooled dimensions: rewritten as ``mean(x, dims, keepdim=True)``, which is exact
and which every executor differentiates alike. Other pools with an overhanging window are left as
they are and, under Inductor, named in a warning.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import GraphModule, Node

from ..graph_utils import new_node, op_name, provenance, tensor_val
from ..manager import PassResult
from ..op_tables import AVERAGE_POOLS

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["rewrite_avg_pool"]

PASS = "rewrite_avg_pool"
log = logging.getLogger("autoscale")

_PARAMS = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")


def rewrite_avg_pool(gm: GraphModule, cfg: Config) -> PassResult:
    """Rewrite global average pools written with ``ceil_mode`` as means (see the module docstring)."""
    rewritten, left = 0, []
    for node in list(gm.graph.nodes):
        dims = AVERAGE_POOLS.get(op_name(node) or "")
        if dims is None or node.op != "call_function":
            continue
        args = {**dict(zip(_PARAMS, node.args, strict=False)), **node.kwargs}
        windows = _windows(args, node, dims)
        if windows is None or not args.get("ceil_mode", False):
            continue
        sizes, kernel, stride, padding, out = windows
        if not any((o - 1) * s + k > n + 2 * p for n, k, s, p, o in zip(sizes, kernel, stride, padding, out,
                                                                     strict=True)):
            continue  # no window overhangs: every executor divides alike
        if (all(o == 1 for o in out) and not any(padding) and all(k >= n for k, n in zip(kernel, sizes, strict=True))
                and args.get("divisor_override") is None):
            with gm.graph.inserting_before(node):
                mean = new_node(gm.graph, "call_function", torch.mean, (args["input"], tuple(range(-dims, 0))),
                                {"keepdim": True})
            mean.meta.update(node.meta)
            provenance(mean, PASS, f"{op_name(node)} with one window over its whole input, as a mean "
                       "(Inductor's ceil_mode backward divides by the kernel's area: pytorch/pytorch#198119)",
                       created=True)
            node.replace_all_uses_with(mean)
            gm.graph.erase_node(node)
            rewritten += 1
        else:
            left.append(node.name)
    if left and cfg.executor == "inductor":
        log.warning("average pools with ceil_mode=True and a window overhanging the input (%s): Inductor's "
                    "backward divides such a window by the whole kernel's size, not by the part inside the "
                    "input as eager does (pytorch/pytorch#198119), so their gradients are wrong at the border. "
                    "Use ceil_mode=False with explicit padding, or Config(executor='eager')", ", ".join(left))
    return PassResult(gm, modified=rewritten > 0, counts={"rewritten": rewritten, "left": len(left)})


def _windows(args: dict[str, Any], node: Node, dims: int
             ) -> tuple[list[int], list[int], list[int], list[int], list[int]] | None:
    """Input sizes, kernel, stride, padding and output sizes along the pooled dimensions, as ints;
    None when any is not a plain int (symbolic shapes: left alone)."""
    x, y = args.get("input"), tensor_val(node)
    if not isinstance(x, Node) or not isinstance(tensor_val(x), torch.Tensor) or not isinstance(y, torch.Tensor):
        return None

    def per_dim(value: Any, default: Any) -> list[Any]:
        value = default if value is None or value == [] or value == () else value
        return list(value) if isinstance(value, list | tuple) else [value] * dims

    kernel = per_dim(args.get("kernel_size"), None)
    stride = per_dim(args.get("stride"), kernel)
    padding = per_dim(args.get("padding", 0), 0)
    sizes, out = list(tensor_val(x).shape[-dims:]), list(y.shape[-dims:])
    values = [sizes, kernel, stride, padding, out]
    if not all(len(v) == dims and all(type(i) is int for i in v) for v in values):
        return None
    return sizes, kernel, stride, padding, out
