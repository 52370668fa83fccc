"""Watch the forward for overflow at run time: a ``watch`` after every value that can overflow.

What the analysis cannot predict — weights that grow during training, an unusual batch — shows at
run time. This pass puts ``autoscale.ops.watch(x, peaks, slot)`` after

* every float16 GEMM/convolution output and every float16 elementwise result that can grow
  (allow and infer ops, but the ``op_tables.BOUNDED`` ones such as GELU or tanh, which are never
  larger than their input, and attention's output, ``softmax(scores) @ v`` or
  ``scaled_dot_product_attention``, each element a weighted average of ``v``'s, which a finite
  float16 ``v`` bounds (``_weighted_average``); data movement only moves values, and a masked fill
  with -inf is not an overflow);
* every cast of a float32 value into float16 (the rounding itself can overflow: a float32
  residual stream cast for the next GEMM, an unnormalized input), but a parameter's (a weight
  that grows overflows the GEMM it feeds first, which is watched) and a normalization's output
  predicted far inside the range (``_normalized``: a norm op, or an RMS norm written out as T5's
  and Llama's are, with its affine weight, scaled down by a constant at most), and a float16
  value's elements cast back from float32 (``_narrowed_back``). The check reads the float32
  source, so it sees the magnitude the cast loses;
* every op kept in float32 because of forward overflow, and the graph's float outputs, but an
  output that only widens a watched value (the float32 logits of a float16 head GEMM, through its
  scale point): that value's check is marked as the output's instead, as a second check would read
  the same values again (for a language model, a pass over its logits).

A value non-finite in float32 too (the log of 0) is named by the first cast of it into float16 (its
check reads the float32 source) or by the output it reaches, not promoted forever. Float32 deny ops
(norms, softmax, exp, log) are not watched themselves: on the overhead benchmark's CNN, a check on
each batch norm's output keeps Inductor from fusing the norm's kernels (docs/results/overhead.md,
"The forward checks"), and the cast after it names the same value.

``watch`` folds ``max |x|`` into the slot: Inductor fuses the reduction into the kernel that
produces ``x``, and the scaler reads the peaks after the step (``autoscale.overflow``). Why in the
forward, though the peaks are read after the backward: moved into the backward wherever it reads
``x`` anyway (AOTAutograd's ``must_be_in_backward`` tag, a probe), a check cost the same on the
CPU and took more launches on a GPU, most of the moved maxima unfused there
(docs/results/overhead_quick.md, kernel_counts.md); and a loop that calls ``update()`` without a
backward after a non-finite loss would no longer see the overflow. Slots are
numbered per graph here; the backend maps them to the scaler state's slots by each site's key.
The sites, with their keys, predictions and nearest watched sites upstream (to tell an overflow
from its consequences), go to ``gm.meta[SITES_KEY]``. Runs only for float16, with
``Config.overflow.watch`` and a ``GradScaler`` (whose ``attach`` ``predict_overflow`` found), in a
step that measures (``attach``'s ``measuring``: a step that measures no gradient watches no value,
``ScalingConfig.measure_every``); it removes nothing. It is the last pass of the Dynamo stage, so
that no other pass sees a check as a reader of the value it watches (a GEMM read only by its cast
stays one scale point).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from autoscale.ops import rescale, watch
from autoscale.overflow import CAST_SUFFIX, OVERFLOW_REASON, Site, SiteKind
from autoscale.protocol import FP16_MAX

from ..analysis.analyze_underflow import MOMENTS_KEY
from ..fold_casts import is_lossless
from ..graph_utils import (
    KEY,
    PROVENANCE_KEY,
    cast_of,
    dtype_name,
    float_dtype,
    layer_of,
    new_node,
    op_args,
    op_name,
    parameter_path,
    provenance,
    source_line,
    tensor_val,
)
from ..manager import PassResult
from ..op_tables import (
    BOUNDED,
    FIXED,
    LAST_DIM_PRODUCTS,
    NORMALIZATIONS,
    TRUE_DIVISIONS,
    VIEWS,
    Category,
    category_of,
)
from .predict_overflow import PEAKS_INPUT_KEY

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["SITES_KEY", "insert_overflow_checks"]

PASS = "insert_overflow_checks"
SITES_KEY = "autoscale_sites"
OUTPUT_SUFFIX = "@output"
CAST_MARGIN = 2.0**8
"""How far below the threshold a normalized value's predicted max must be for its cast into float16
to go unwatched (``_normalized``): norm weights grow, but not 256-fold."""
_GROWS = (Category.ALLOW, Category.INFER)
_SAME_VALUES = FIXED | {"contiguous", "clone"}
"""Ops whose output holds their input's values, in another dtype or layout at most."""


def insert_overflow_checks(gm: GraphModule, cfg: Config) -> PassResult:
    """Insert a ``watch`` after every value that can overflow (see the module docstring)."""
    graph = gm.graph
    index = gm.meta.get(PEAKS_INPUT_KEY)
    if index is None or not cfg.overflow.watch or cfg.dtype != torch.float16:
        return PassResult(gm, modified=False, counts={"sites": 0})
    peaks = list(graph.find_nodes(op="placeholder"))[index]
    (output,) = graph.find_nodes(op="output")
    outputs = {a for a in pytree.tree_leaves(output.args) if isinstance(a, Node)}
    sites: list[Site] = []
    nearest: dict[Node, frozenset[int]] = {}  # node -> the nearest watched sites it is computed from
    slot_of: dict[Node, int] = {}  # a node whose own value a check reads -> the check's slot
    for n in list(graph.nodes):
        if n.op == "output":
            break
        upstream = frozenset().union(*(nearest.get(a, frozenset()) for a in n.all_input_nodes))
        if n in outputs and (copied := slot_of.get(_exact_copy_of(n))) is not None:
            # (an output that is a watched value, widened: its check would read the same values again)
            sites[copied] = replace(sites[copied], output=True)
            nearest[n] = frozenset({copied})
            continue
        found = _site(n, cfg, n in outputs)
        if found is None:
            nearest[n] = upstream
            continue
        key, kind, reason, watched, named = found
        moments = named.meta.get(MOMENTS_KEY, {}).get("value")
        slot = len(sites)
        sites.append(Site(key, layer_of(named), op_name(named) or str(named.target), kind,
                          moments.amax if moments is not None else None, reason, tuple(sorted(upstream)),
                          output=n in outputs, where=source_line(named)))
        with graph.inserting_after(n):
            check = new_node(graph, "call_function", watch, (watched, peaks, slot),
                             None if cfg.form == "default" else {"form": cfg.form})
        for meta in ("nn_module_stack", "stack_trace"):
            if meta in n.meta:
                check.meta[meta] = n.meta[meta]
        check.meta["val"] = None
        provenance(check, PASS, f"overflow check of {watched.name} ({reason})", created=True)
        nearest[n] = frozenset({slot})
        if watched is n:  # (a cast's check reads its float32 source, not the float16 value)
            slot_of[n] = slot
    gm.meta[SITES_KEY] = sites
    return PassResult(gm, modified=bool(sites), counts={
        "sites": len(sites), **{kind: sum(s.kind == kind for s in sites) for kind in ("float16", "cast", "float32")}})


def _site(n: Node, cfg: Config, is_output: bool) -> tuple[str, SiteKind, str, Node, Node] | None:
    """``(key, kind, why it is watched, the node whose value is watched, the node that names it in
    reports)`` if ``n`` is a site."""
    if n.op not in ("call_function", "call_method") or float_dtype(n) is None:
        return None
    if not isinstance(n.meta.get("val"), torch.Tensor):
        return None
    cast = cast_of(n)
    if cast is not None and n.meta.get(PROVENANCE_KEY, {}).get("pass") == "convert_precision":
        source, dtype = cast
        parameter = source.op == "placeholder" and getattr(tensor_val(source), "requires_grad", False)
        if (dtype == cfg.dtype and float_dtype(source) == torch.float32 and KEY in source.meta and not parameter
                and not _normalized(source, cfg) and not _narrowed_back(source, cfg)):
            return source.meta[KEY] + CAST_SUFFIX, "cast", f"cast into {dtype_name(dtype)}", source, source
    if is_output and float_dtype(n) != cfg.dtype and (keyed := _keyed(n)) is not None:
        # an output in float32: where a non-finite value reaches the loss, whatever computed it
        return keyed.meta[KEY] + OUTPUT_SUFFIX, "float32", "graph output", n, keyed
    key = n.meta.get(KEY)
    if key is None or cast is not None:
        return None
    name = op_name(n) or ""
    category = category_of(name, cfg.op_overrides)
    if float_dtype(n) == cfg.dtype:
        grows = category in _GROWS and name not in BOUNDED and not _weighted_average(n, cfg)
        return (key, "float16", f"{category.value} op in {dtype_name(cfg.dtype)}", n, n) if grows else None
    reason = n.meta.get(PROVENANCE_KEY, {}).get("reason", "")
    if reason.startswith(OVERFLOW_REASON):  # kept in float32 by convert_precision, for forward overflow
        return key, "float32", reason, n, n
    return None


def _normalized(source: Node, cfg: Config) -> bool:
    """Whether a value cast into float16 is a normalization's output, through data movement and
    bounded ops (a batch norm's ReLU, a layer norm's output for q, k and v), predicted well inside
    the range: its cast goes unwatched. Its check would be a pass over the float32 value of its own
    (Inductor does not fuse it into the norm's kernels), and a normalized value is bounded by its
    affine weights: a non-finite one comes from the norm's input, which is watched where it was
    made."""
    moments = source.meta.get(MOMENTS_KEY, {}).get("value")
    if moments is None or moments.amax * CAST_MARGIN >= cfg.overflow.threshold * FP16_MAX:
        return False
    n = _values_of(source)
    while isinstance(n, Node) and n.op in ("call_function", "call_method"):
        name = op_name(n) or ""
        if name in NORMALIZATIONS or _rms_normalized(n):
            return True
        # (a norm's affine weight, applied apart; T5's rescale before its tied head)
        if (operand := _scaled_by_parameter(n) or _shrunk(n)) is not None:
            n = _values_of(operand)
            continue
        if category_of(name, cfg.op_overrides) is not Category.CLEAR and name not in BOUNDED:
            return False
        n = _values_of(n.args[0]) if n.args else None
    return False


def _narrowed_back(source: Node, cfg: Config) -> bool:
    """Whether the float32 ``source`` holds only values of a float16 value, through data movement
    (``op_tables.VIEWS``, copies, casts) and ops never larger than their input (``BOUNDED``): cast
    back into float16 it cannot overflow, and a non-finite value in it was one in the float16 value,
    named where that was made (RoPE's ``rotate_half`` of a float16 query, computed in float32 next to
    float32 sines)."""
    n: object = source
    while isinstance(n, Node) and n.op in ("call_function", "call_method") and n.args:
        if float_dtype(n) == cfg.dtype:
            return True
        name = op_name(n) or ""
        if name not in VIEWS and name not in BOUNDED and name not in _SAME_VALUES:  # (VIEWS has rescale)
            return False
        n = n.args[0]
    return isinstance(n, Node) and float_dtype(n) == cfg.dtype


def _values_of(x: object) -> object:
    """``x`` through ops that keep its values (casts, copies, rescale points: the identity forward)."""
    while (isinstance(x, Node) and x.op in ("call_function", "call_method") and x.args
           and (x.target is rescale or op_name(x) in _SAME_VALUES)):
        x = x.args[0]
    return x


def _rms_normalized(n: Node) -> bool:
    """Whether ``n`` is ``x * rsqrt(mean(x²) + eps)`` (or ``x / sqrt(...)``), an RMS norm written out,
    as T5's and Llama's are: no element is more than √(elements averaged) times the root mean
    square, so its magnitude is bounded whatever ``x``'s (a non-finite ``x`` is watched where it is
    made). The squares' epsilon, if any, is a number added to the mean."""
    name = op_name(n)
    if name not in ("mul", "div") or len(n.args) != 2:
        return False
    pairs = [(n.args[0], n.args[1])] if name == "div" else [(n.args[0], n.args[1]), (n.args[1], n.args[0])]
    root = "sqrt" if name == "div" else "rsqrt"
    return any(_is_rms_of(_values_of(x), r, root) for x, r in pairs)


def _is_rms_of(x: object, r: object, root: str) -> bool:
    """Whether ``r`` is ``root(mean(x²) [+ eps])``."""
    if not isinstance(r, Node) or op_name(r) != root or not r.args:
        return False
    m = r.args[0]
    if isinstance(m, Node) and op_name(m) == "add":  # (+ eps)
        terms = [a for a in m.args if isinstance(a, Node)]
        m = terms[0] if len(m.args) == 2 and len(terms) == 1 else None
    if not isinstance(m, Node) or op_name(m) != "mean" or not m.args:
        return False
    square = m.args[0]
    if not isinstance(square, Node) or len(square.args) != 2:
        return False
    base, other = (_values_of(a) for a in square.args)
    squared = (op_name(square) == "pow" and other == 2) or (op_name(square) == "mul" and base is other)
    return squared and base is x


def _scaled_by_parameter(n: Node) -> Node | None:
    """The other operand of ``n`` if ``n`` multiplies a value by a parameter (a norm's affine
    weight, applied apart from the norm), else None."""
    if op_name(n) != "mul" or len(n.args) != 2:
        return None
    a, b = n.args
    for weight, value in ((_values_of(a), b), (_values_of(b), a)):
        if isinstance(value, Node) and isinstance(weight, Node) and parameter_path(weight) is not None:
            return value
    return None


def _shrunk(n: Node) -> Node | None:
    """The tensor ``n`` multiplies by a number of magnitude at most 1, or divides by one of at least
    1, else None: a value never larger than that tensor (T5's ``sequence_output * model_dim**-0.5``
    after its last norm, where the head shares the embedding's weights)."""
    args = op_args(n)
    if len(args) != 2 or n.kwargs:  # (a division with a rounding mode can round away from 0)
        return None
    a, b = args
    name = op_name(n)
    if name == "mul":
        for value, factor in ((a, b), (b, a)):
            if isinstance(value, Node) and isinstance(factor, (int, float)) and abs(factor) <= 1:
                return value
    if name in TRUE_DIVISIONS and isinstance(a, Node) and isinstance(b, (int, float)) and abs(b) >= 1:
        return a
    return None


def _weighted_average(n: Node, cfg: Config) -> bool:
    """Whether ``n`` is attention's output: ``softmax(s, dim=-1) @ v`` written out (through casts),
    or ``scaled_dot_product_attention`` without a dropout that could lift it past ``v``'s alarm.
    Each element of its output is a weighted average of a column of ``v`` (weights >= 0 summing to
    1, up to their rounding: 2^-12 at most; a dropout of rate p scales them by 1/(1-p)), so a finite
    float16 ``v`` keeps it finite, and a ``v`` near 65504 is itself watched. Every backend of
    ``scaled_dot_product_attention`` computes its scores in float32 (the math one too, unless
    ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``), so they do not overflow on
    the way. (A softmax's own non-finite values, a fully masked row's, are named by its cast into
    float16.)"""
    args = op_args(n)
    if op_name(n) == "scaled_dot_product_attention":
        p = args[4] if len(args) > 4 else n.kwargs.get("dropout_p", 0.0)
        return isinstance(p, int | float) and (p == 0 or p < 1 - cfg.overflow.threshold)
    if op_name(n) not in LAST_DIM_PRODUCTS or len(args) < 2:
        return False
    weights = _values_of(args[0])
    if not isinstance(weights, Node) or op_name(weights) != "softmax":
        return False
    dim = weights.args[1] if len(weights.args) > 1 else weights.kwargs.get("dim")
    val = tensor_val(weights)
    return isinstance(dim, int) and isinstance(val, torch.Tensor) and dim in (-1, val.dim() - 1)


def _exact_copy_of(n: Node) -> Node:
    """The value ``n`` holds exactly, through lossless casts and rescale points (whose forward is
    the identity): the head's float16 GEMM output for a float32 logits output."""
    while n.args and isinstance(n.args[0], Node) and (n.target is rescale or _lossless_cast(n)):
        n = n.args[0]
    return n


def _lossless_cast(n: Node) -> bool:
    cast = cast_of(n)
    source = float_dtype(cast[0]) if cast is not None else None
    return cast is not None and source is not None and is_lossless(source, cast[1])


def _keyed(n: Node) -> Node | None:
    """``n``, or the value it passes on unchanged (a cast, a rescale point: nodes the passes made,
    which have no key), whichever has a key."""
    while KEY not in n.meta:
        if not n.args or not isinstance(n.args[0], Node):
            return None
        n = n.args[0]
    return n
