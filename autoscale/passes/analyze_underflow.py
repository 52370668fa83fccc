"""Predict, before anything runs, the magnitude of every value and gradient in the graph.

Each floating-point node gets ``Moments`` (mean, mean square, max |x|) for its value, from the
real inputs and parameters, propagated forward with per-op rules; then ``Moments`` for its
gradient, propagated backward from the outputs the loss is taken from (``loss_outputs``: a scalar
output — the loss — gets gradient 1; without one, a tensor output the graph does not read itself
is assumed to feed a mean-reduced cross-entropy over its last dimension). From the
gradient's spread σ the predicted float16 underflow rate is ``erf(2⁻²⁵ / (√2·σ))`` (zero-mean
Gaussian model; 2⁻²⁵ is the largest magnitude float16 rounds to zero), and the overflow risk is
whether the predicted max exceeds 65504 / 2^margin.

Rules are a registry keyed by op name; an op without a rule makes its value (or gradient)
unknown, never a crash. What the graph builds from constants, shapes and small buffers alone
(causal masks, position indices and buckets, rotary tables) is computed exactly at compile time
(``_concrete``); where a value holds mask fills (-inf, finfo.min) is tracked beside its moments,
which are of its other entries, so that a softmax or an attention knows each row's live keys.
Reduction lengths are sympy expressions (symbolic under dynamic shapes), evaluated with the shape
environment's hints. Results go to ``node.meta``:
``autoscale_moments`` = {"value": Moments | None, "grad": Moments | None, "reached": bool} (a
gradient is None where unknown, and where none arrives: "reached" tells them apart), and, where the
gradient is known, ``autoscale_underflow`` (rate) and ``autoscale_overflow`` (bool).
Predictions assume float16, the dtype gradient scaling exists for.

Seeds: ``seed_inputs(gm, example_inputs)`` records the moments of real example tensors on the
placeholders (the backend does it; the pass itself sees only fake tensors). ``calibrate(gm,
example_inputs)`` goes further: it runs the graph once in float32 on copies of the inputs
(``reference_step``) and records every node's measured value and gradient moments, which the pass
then uses instead of its predictions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import sympy
import torch
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree
from torch.fx import GraphModule, Node

from autoscale.ops import gradient_max, headroom

from .graph_utils import cast_of, op_name, source_name, tensor_val
from .manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["FLUSH", "MASK_MAGNITUDE", "VALUE_KEY", "Moments", "analyze_underflow", "calibrate", "clear_caches",
           "element_count", "forward_moments", "loss_outputs", "predicted_underflow", "reference_step", "seed_inputs"]

PASS = "analyze_underflow"
# The largest magnitude float16 rounds to zero: 2^-25, half its smallest subnormal 2^-24 (round to
# nearest even sends (2^-25, 2^-24) up to 2^-24, and the tie 2^-25 down to 0). The rate below counts
# what is *flushed*, so it uses this, not the subnormal (which the paper's scale rule uses as u_min).
FLUSH = 2.0**-25
SEED_KEY, MOMENTS_KEY, CALIBRATION_KEY = "autoscale_seed", "autoscale_moments", "autoscale_calibration"
VALUE_KEY = "autoscale_value"
# Per-pipeline caches beside VALUE_KEY (dropped with it at the end of the pass): a value computed at
# compile time (``_concrete``), the positions of a value that hold a mask fill (``_mask_pattern``),
# and a softmax's or an attention's row statistics (``_attention_stats``).
CONCRETE_KEY, MASK_KEY, ATTENTION_KEY = "autoscale_concrete", "autoscale_mask", "autoscale_attention"
_CACHE_KEYS = (VALUE_KEY, CONCRETE_KEY, MASK_KEY, ATTENTION_KEY)
# A fill of at least this magnitude (or infinite) is a mask: -inf, float32's finfo.min (what Hugging
# Face fills attention masks with). Softmax turns it into an exact 0, float16 turns it into -inf as
# intended; it is no magnitude of the data. The moments of a value are of its other entries, and
# where a value holds mask fills is tracked beside them (``MASK_KEY``) for the softmax after it.
MASK_MAGNITUDE = 2.0**100


class Moments(NamedTuple):
    """Magnitude statistics of a tensor's elements: mean, mean square, max |x|. (A named tuple:
    the analysis makes two per node, and a tuple of floats is cheap to build and untracked by the
    cyclic garbage collector.)"""

    mean: float
    ms: float
    amax: float

    @property
    def std(self) -> float:
        return math.sqrt(max(self.ms - self.mean**2, 0.0))

    @staticmethod
    def of(t: torch.Tensor) -> Moments:
        if t.numel() == 0:
            return Moments(0.0, 0.0, 0.0)
        x = t.detach().double().flatten()
        total, squares, amax = torch.stack((x.sum(), x.dot(x), x.abs().max())).tolist()
        return Moments(total / x.numel(), squares / x.numel(), amax)

    @staticmethod
    def gaussian(mean: float, ms: float, n: float) -> Moments:
        """Moments with the max a Gaussian sample of ``n`` values would have."""
        std = math.sqrt(max(ms - mean**2, 0.0))
        return Moments(mean, ms, abs(mean) + std * math.sqrt(2 * math.log(max(n, 2.0))))

    def scaled(self, c: float) -> Moments:
        return Moments(self.mean * c, self.ms * c * c, self.amax * abs(c))


def predicted_underflow(grad: Moments) -> float:
    """Fraction of a zero-mean Gaussian with the gradient's spread that float16 rounds to zero:
    ``P(|x| <= 2^-25) = erf(2^-25 / (√2·σ))``, the share of all entries (a Gaussian has no exact
    zeros: the measured counterpart, ``autoscale.layer_numbers.flushed_share``, counts the
    entries nonzero in float32 and zero in float16 over all entries). A spread of 0 is the limit,
    1: a predicted 0 is a spread too small for float64 (a product of many tiny factors:
    EfficientNet's squeeze-and-excitation gradients are ~1e-36), far more often than an exactly
    zero gradient. (Counted below the smallest subnormal 2^-24 instead, every rate came out twice
    the flushed share, for rates well below 1.)"""
    sigma = math.sqrt(max(grad.ms, 0.0))
    return 1.0 if sigma == 0 else math.erf(FLUSH / (math.sqrt(2) * sigma))


# The size one optimizer step gives a parameter (Adam's default learning rate, 1e-3).
UPDATE_SIZE = 1e-3
TRAINABLE_KEY = "autoscale_trainable"


def seed_inputs(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Record the moments of the real example tensors on ``gm``'s placeholders, and which are
    trainable parameters (``TRAINABLE_KEY``: their size is floored in the backward, ``_updated``).

    A small module buffer that takes no gradient (a rotary embedding's ``inv_freq``) is recorded
    itself (``CONCRETE_KEY``, a reference, not a copy): what the graph computes from it and from
    constants alone (cos and sin tables, masks) is then computed exactly at compile time."""
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs, strict=False):
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point and not value.is_meta:
            node.meta[SEED_KEY] = Moments.of(value)
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                node.meta[TRAINABLE_KEY] = True
            elif (not value.requires_grad and value.numel() <= CONCRETE_LIMIT and not _is_fake(value)
                  and "._buffers[" in source_name(node)):
                node.meta[CONCRETE_KEY] = value


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def _updated(gm: GraphModule, value: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """The moments the backward rules see: a trainable parameter smaller than ``UPDATE_SIZE`` (and
    its casts and views) at that size, everything else as predicted.

    ConvNeXt's and CaiT's layer scales start at 1e-6, a zero-initialized gate at 0: neither stays so
    after the first update, and the gradients they multiply grow with them. Predicted at 1e-6, the
    gradients behind a ConvNeXt layer scale got scales 2^34 high, and the first Adam step, which
    moved the layer scale to ~1e-3, made them overflow. The forward's values (what overflow
    prediction reads) keep the parameter's real size."""
    floored = dict(value)
    for n in gm.graph.nodes:
        source = n
        while source.op != "placeholder" and ((op_name(source) or "") in _IDENTITY or cast_of(source) is not None):
            if not source.args or not isinstance(source.args[0], Node):
                break
            source = source.args[0]
        m = value.get(n)
        if source.meta.get(TRAINABLE_KEY) and m is not None and m.ms < UPDATE_SIZE**2:
            floored[n] = Moments(m.mean, UPDATE_SIZE**2, max(m.amax, UPDATE_SIZE))
    return floored


def calibrate(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Measure one float32 step of ``gm`` and record each node's value and gradient moments.

    The step is ``reference_step``'s: on copies of the inputs, so it changes nothing the caller
    owns (batch-norm statistics and other in-place updates land in the copies), with the
    gradients the analysis assumes arrive at the outputs (``_output_gradient``; a tensor's as
    Gaussian noise).
    """
    for n, t in reference_step(gm, example_inputs).items():
        n.meta[CALIBRATION_KEY] = {"value": Moments.of(t), "grad": Moments.of(t.grad) if t.grad is not None else None}


def reference_step(gm: GraphModule, example_inputs: Sequence[Any],
                   output_grads: Sequence[torch.Tensor | None] | None = None) -> dict[Node, torch.Tensor]:
    """One float32 forward and backward of ``gm`` on copies of ``example_inputs``: every floating
    node's value, with ``.grad`` filled where a gradient reached it (None where none did).

    What the analysis predicts, measured: the inputs are copied (the step changes nothing the
    caller owns); a cast into a narrower floating dtype (``convert_precision``'s, or the model's
    own ``.half()``) is skipped, because the analysis' moments are of the values as float32
    computes them; and a node whose op returns its input itself (``contiguous`` of a contiguous
    tensor, ``.float()`` of a float32 one) gets a view of it, so that each node's ``.grad`` is the
    gradient of that node alone, as the analysis has it, not the sum over every node sharing the
    tensor. ``output_grads`` (one per tensor leaf of the graph's output, None for an output that
    gets no gradient) are the gradients arriving at the outputs; by default, what the analysis
    assumes (``_output_gradients``: a tensor's as Gaussian noise of the assumed spread).
    """
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
              for x in example_inputs]
    values: dict[Node, torch.Tensor] = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n: Node) -> Any:
            cast = cast_of(n)
            if cast is not None and cast[1].is_floating_point and cast[1].itemsize < 4:
                source = self.env[cast[0]]
                result = source.view_as(source) if _floating(source) else super().run_node(n)
            else:
                result = super().run_node(n)
                if n.op != "placeholder" and _floating(result) and any(
                        result is self.env.get(a) for a in n.all_input_nodes):
                    result = result.view_as(result)
            if _floating(result):
                if result.requires_grad and not result.is_leaf:
                    result.retain_grad()
                values[n] = result
            return result

    with torch.enable_grad():
        leaves = torch.utils._pytree.tree_leaves(_Record(gm).run(*inputs))
        outputs = [o if isinstance(o, torch.Tensor) else None for o in leaves]
        if output_grads is None:
            output_grads = _output_gradients(gm, outputs)
        if len(output_grads) != len(outputs):
            raise ValueError(f"{len(output_grads)} output gradients for {len(outputs)} graph outputs")
        pairs = [(o, g) for o, g in zip(outputs, output_grads, strict=True)
                 if o is not None and g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
    return values


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point


def _output_gradients(gm: GraphModule, outputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The gradients the analysis assumes arrive at the graph's outputs (``loss_outputs``,
    ``_output_gradient``), as tensors: 1 for a scalar, Gaussian noise of the assumed spread for any
    other tensor, none for an output that is assumed to get none."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    nodes = torch.utils._pytree.tree_leaves(output.args[0])
    receiving = set(loss_outputs(gm))
    grads: list[torch.Tensor | None] = []
    for node, out in zip(nodes, outputs, strict=True):
        if out is None or not out.requires_grad or not out.dtype.is_floating_point or node not in receiving:
            grads.append(None)
        elif out.dim() == 0:
            grads.append(torch.ones_like(out))
        else:
            expected = _output_gradient_of_shape(tuple(float(s) for s in out.shape))
            grads.append(torch.randn_like(out) * math.sqrt(expected.ms))
    return grads


def analyze_underflow(gm: GraphModule, cfg: Config) -> PassResult:
    """Annotate every node with predicted value and gradient moments (see the module docstring)."""
    try:
        return _analyze(gm, cfg)
    finally:
        clear_caches()
        for n in gm.graph.nodes:  # (the cache serves one pipeline run: a later one may see other inputs)
            for key in _CACHE_KEYS:
                n.meta.pop(key, None)


def forward_moments(gm: GraphModule) -> dict[Node, Moments | None]:
    """The predicted (or calibrated) moments of every node's value, propagated from the inputs.

    Cached on the nodes (``VALUE_KEY``): ``predict_overflow`` computes them before the precision
    pass and this pass reuses them, computing only the nodes added in between (casts, which keep
    their source's moments). The moments are of the values as float32 computes them: a cast
    changes none."""
    value: dict[Node, Moments | None] = {}
    for n in gm.graph.nodes:
        if VALUE_KEY in n.meta:
            value[n] = n.meta[VALUE_KEY]
            continue
        concrete = n.meta.get(CONCRETE_KEY) if n.op == "placeholder" else _concrete(n)
        if concrete is not None:
            n.meta[CONCRETE_KEY] = concrete
        pattern = _mask_pattern(n)
        if pattern is not None:
            n.meta[MASK_KEY] = pattern
        if _empty(n):
            value[n] = None
        elif measured := n.meta.get(CALIBRATION_KEY, {}).get("value"):
            value[n] = measured
        elif isinstance(concrete, torch.Tensor):
            value[n] = _live_moments(concrete)
        else:
            value[n] = n.meta.get(SEED_KEY) if n.op == "placeholder" else _unless_empty(_forward, n, value)
        n.meta[VALUE_KEY] = value[n]
    return value


def loss_outputs(gm: GraphModule) -> list[Node]:
    """The graph outputs a gradient is assumed to arrive at.

    A scalar floating output is the loss: when there is one, only such outputs get a gradient
    (a model that returns its loss returns its logits, caches and hidden states beside it, for
    inspection). Otherwise the loss is computed after the graph (by the user, or by the graph after
    a graph break), from the outputs the graph does not read itself: a value it also reads is a
    by-product returned for later use, such as a KV cache (GPT-2 returns its keys and values, and
    a cross-entropy's gradient assumed on them was 50 times the real gradient of its keys). When
    every output is also read inside, all of them."""
    outputs = [a for out in gm.graph.find_nodes(op="output") for a in out.all_input_nodes]
    floating = [o for o in outputs if isinstance(val := tensor_val(o), torch.Tensor) and val.dtype.is_floating_point]
    losses = [o for o in floating if tensor_val(o).dim() == 0 and _requires_grad(o)]
    if losses:
        return losses
    final = [o for o in floating if not _read_inside(o)]
    return final or floating


def _read_inside(out: Node) -> bool:
    """Whether the value ``out`` returns is also read inside the graph: by a node other than the
    casts and views leading from it to ``out`` (the precision pass casts a returned value back to
    float32 for the output alone)."""
    chain = {out}
    node = out
    while (op_name(node) or "") in _IDENTITY or cast_of(node) is not None:
        if not node.args or not isinstance(node.args[0], Node):
            break
        node = node.args[0]
        chain.add(node)
    return any(u not in chain and u.op != "output" for n in chain for u in n.users)


def _requires_grad(n: Node) -> bool:
    val = tensor_val(n)
    return isinstance(val, torch.Tensor) and bool(n.meta.get("requires_grad", val.requires_grad))


def _analyze(gm: GraphModule, cfg: Config) -> PassResult:
    nodes = list(gm.graph.nodes)
    value = forward_moments(gm)
    grad: dict[Node, list[Moments | None]] = {}
    for arg in loss_outputs(gm):
        grad.setdefault(arg, []).append(None if _empty(arg) else _output_gradient(arg, value))
    known = 0
    limit = headroom(cfg.scaling.margin, gradient_max(cfg.float8))
    updated = _updated(gm, value)
    unknown: set[Node] = set()  # nodes a gradient reaches through an unknown one
    for n in reversed(nodes):
        parts = grad.get(n, [])
        # a tuple's elements are disjoint pieces (unbind, chunk): their gradients do not add up
        g = _average(parts) if isinstance(tensor_val(n), tuple | list) else _sum(parts)
        g = None if _empty(n) else n.meta.get(CALIBRATION_KEY, {}).get("grad") or g
        # "reached": whether any gradient arrives at all (a None gradient is then unknown; without one,
        # nothing flows back to the node: a returned by-product, a value the loss does not read)
        reached = bool(parts) or n in unknown
        n.meta[MOMENTS_KEY] = {"value": value.get(n), "grad": g, "reached": reached}
        if g is None:
            if reached and n.op in ("call_function", "call_method"):
                unknown.update(n.all_input_nodes)
            continue
        known += 1
        n.meta["autoscale_underflow"] = predicted_underflow(g)
        n.meta["autoscale_overflow"] = g.amax > limit
        if n.op in ("call_function", "call_method"):
            for arg, ga in (_unless_empty(_backward, n, g, updated) or {}).items():
                grad.setdefault(arg, []).append(ga)
    return PassResult(gm, modified=False, counts={"nodes": len(nodes), "gradients_known": known})


def clear_caches() -> None:
    """Drop the expectations cached for one pass (``_expect``)."""
    _expect.cache_clear()


# ------------------------------------------------------------------------------------ helpers


def _hint(size: Any) -> float:
    """A size as a number; symbolic sizes are sympy expressions evaluated with their hints."""
    if isinstance(size, torch.SymInt):
        if size.node.hint is not None:
            return float(size.node.hint)
        env = size.node.shape_env
        values = getattr(env, "backed_var_to_val", None) or env.var_to_val
        expr: sympy.Expr = size.node.expr
        return float(expr.subs(values))
    return float(size)


def _empty(n: Node) -> bool:
    """Whether ``n`` is a tensor without elements (a batch of 0): there is nothing to predict."""
    return isinstance(tensor_val(n), torch.Tensor) and _numel(n) == 0


_R = TypeVar("_R")


def _unless_empty(rule: Callable[..., _R], *args: Any) -> _R | None:
    """``rule(*args)``, or None (unknown) where a zero extent (an empty tensor among the rule's
    inputs: a sum over no elements, a concatenation with an empty piece) makes it divide by zero."""
    try:
        return rule(*args)
    except ZeroDivisionError:
        return None


def element_count(n: Node) -> float:
    """How many elements ``n``'s tensor has (symbolic sizes at their hints; 1 for a non-tensor)."""
    return _numel(n)


def _numel(n: Any) -> float:
    val = tensor_val(n) if isinstance(n, Node) else None
    if not isinstance(val, torch.Tensor):
        return 1.0
    return math.prod(_hint(s) for s in val.shape)


def _shape(n: Any) -> tuple[float, ...]:
    val = tensor_val(n) if isinstance(n, Node) else None
    return tuple(_hint(s) for s in val.shape) if isinstance(val, torch.Tensor) else ()


def _m(arg: Any, value: dict[Node, Moments | None]) -> Moments | None:
    if isinstance(arg, Node):
        return value.get(arg)
    if isinstance(arg, int | float) and not isinstance(arg, bool):
        return Moments(float(arg), float(arg) ** 2, abs(float(arg)))
    return None


def _known(parts: list[Moments | None]) -> list[Moments] | None:
    known = [p for p in parts if p is not None]
    return known if known and len(known) == len(parts) else None


def _sum(parts: list[Moments | None]) -> Moments | None:
    """Moments of a sum of independent contributions (a gradient used in several places)."""
    known = _known(parts)
    if known is None:
        return None
    mean = sum(p.mean for p in known)
    return Moments(mean, sum(p.std**2 for p in known) + mean**2, sum(p.amax for p in known))


def _average(parts: list[Moments | None]) -> Moments | None:
    """Moments of disjoint pieces of equal size taken together (the elements of a tuple)."""
    known = _known(parts)
    if known is None:
        return None
    k = len(known)
    return Moments(sum(p.mean for p in known) / k, sum(p.ms for p in known) / k, max(p.amax for p in known))


@functools.cache
def _hermite(points: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss–Hermite nodes and weights for E[f(Z)], Z ~ N(0, 1) (Golub–Welsch)."""
    k = torch.arange(1, points, dtype=torch.float64)
    jacobi = torch.diag(torch.sqrt(k), 1) + torch.diag(torch.sqrt(k), -1)
    nodes, vectors = torch.linalg.eigh(jacobi)
    return nodes, vectors[0] ** 2


@functools.cache
def _expect(f: Callable[[torch.Tensor], torch.Tensor], m: Moments) -> tuple[float, float, float]:
    """E[f(X)], E[f(X)²] and E[f'(X)²] for X Gaussian with m's mean and spread.

    f' by central differences in float64 (step ~ eps^(1/3) relative: ~1e-10 relative error), in
    the same call as f: autograd cost 3x as much, and this runs for every elementwise op. Cached
    for the length of a pass (``analyze_underflow`` clears it): an op's backward rule asks for the
    expectation its forward rule computed.
    """
    z, w = _hermite()
    x = m.mean + m.std * z
    h = 6e-6 * (x.abs() + m.std) + 1e-300
    y, up, down = f(torch.stack([x, x + h, x - h])).unbind(0)
    dy = (up - down) / (2 * h)
    return float((w * y).sum()), float((w * y * y).sum()), float((w * dy * dy).sum())


# ------------------------------------------------------------- compile-time constants and masks

CONCRETE_LIMIT = 1 << 20  # the most elements a value computed at compile time may have
# Ops that are pure functions of their arguments (nothing random, nothing in place): a node of one
# of these whose inputs are all known at compile time is computed then. What a model builds from
# constants and shapes alone — causal masks, position indices, relative-position buckets, rotary
# tables — is so known exactly, where moments could only guess (a mask's share, a bucket's log).
_CONSTANT_OPS = frozenset({
    "arange", "tensor", "scalar_tensor", "full", "zeros", "ones", "full_like", "zeros_like", "ones_like",
    "new_full", "new_zeros", "new_ones", "new_tensor", "tril", "triu", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_not", "logical_xor", "and_", "or_", "xor", "invert", "bitwise_not",
    "bitwise_and", "bitwise_or", "where", "masked_fill", "add", "sub", "rsub", "mul", "div", "truediv",
    "floordiv", "floor_divide", "remainder", "mod", "neg", "abs", "log", "exp", "sqrt", "pow", "min", "max",
    "minimum", "maximum", "clamp", "clamp_min", "clamp_max", "to", "float", "long", "int", "bool", "double",
    "half", "type_as", "view", "reshape", "expand", "expand_as", "unsqueeze", "squeeze", "getitem", "permute",
    "transpose", "t", "contiguous", "clone", "flatten", "cat", "concat", "stack", "sum", "cumsum", "cos", "sin",
    "floor", "ceil", "round", "sign", "any", "all", "repeat", "view_as", "narrow", "select", "detach", "outer",
    "diff", "alias", "log2", "reciprocal", "rsqrt", "unbind", "split", "chunk",
})


def _concrete(n: Node) -> Any:
    """``n``'s value computed now, when its op is in ``_CONSTANT_OPS`` and every input is known at
    compile time (an earlier such value, a seeded buffer, a symbolic size at its hint); else None."""
    if n.op not in ("call_function", "call_method") or (op_name(n) or "") not in _CONSTANT_OPS:
        return None
    if isinstance(tensor_val(n), torch.Tensor) and _numel(n) > CONCRETE_LIMIT:
        return None
    env: dict[Node, Any] = {}
    for a in n.all_input_nodes:
        known = a.meta.get(CONCRETE_KEY)
        if known is None:
            val = tensor_val(a)
            if not isinstance(val, torch.SymInt | int) or isinstance(val, bool):
                return None
            known = int(_hint(val))
        env[a] = known

    def plain(x: Any) -> Any:
        return int(_hint(x)) if isinstance(x, torch.SymInt) else x

    args = torch.utils._pytree.tree_map(plain, torch.fx.node.map_arg(n.args, env.__getitem__))
    kwargs = torch.utils._pytree.tree_map(plain, torch.fx.node.map_arg(n.kwargs, env.__getitem__))
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
            if n.op == "call_method":
                result = getattr(args[0], str(n.target))(*args[1:], **kwargs)
            else:
                result = n.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # (an argument this cannot stand in for: leave the node to the rules)
        return None
    leaves = torch.utils._pytree.tree_leaves(result)
    if not all(isinstance(x, torch.Tensor | int | float | bool) for x in leaves):
        return None
    return result


def _live_moments(t: torch.Tensor) -> Moments:
    """The moments of a known tensor's entries other than mask fills."""
    if t.dtype.is_floating_point:
        t = t[t.isfinite() & (t.abs() < MASK_MAGNITUDE)]
    return Moments.of(t)


def _is_mask_value(x: Any) -> bool:
    """Whether ``x`` (a number, or a node known at compile time) is a mask fill (``MASK_MAGNITUDE``)."""
    if isinstance(x, Node):
        x = x.meta.get(CONCRETE_KEY)
        if isinstance(x, torch.Tensor) and x.numel() == 1 and x.dtype.is_floating_point:
            x = float(x)
    return isinstance(x, float | int) and not isinstance(x, bool) and (math.isinf(x) or abs(x) >= MASK_MAGNITUDE)


def _known_bool(x: Any) -> torch.Tensor | None:
    """``x``'s value if it is a boolean tensor known at compile time."""
    c = x.meta.get(CONCRETE_KEY) if isinstance(x, Node) else None
    return c if isinstance(c, torch.Tensor) and c.dtype == torch.bool else None


def _pattern(x: Any) -> torch.Tensor | None:
    p = x.meta.get(MASK_KEY) if isinstance(x, Node) else None
    return p if isinstance(p, torch.Tensor) else None


def _either(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    try:
        return torch.logical_or(a, b)
    except RuntimeError:  # (shapes that do not broadcast: not a mask this can follow)
        return None


def _mask_pattern(n: Node) -> torch.Tensor | None:
    """Where ``n``'s value holds mask fills, as a boolean tensor broadcastable to it (None: nowhere,
    or not known). Set by a known value with such entries, by ``masked_fill`` or ``where`` with a
    mask fill and a known condition, carried through additions (an additive mask), scalings, casts
    and layout ops."""
    concrete = n.meta.get(CONCRETE_KEY)
    if isinstance(concrete, torch.Tensor):
        if not concrete.dtype.is_floating_point:
            return None
        fills = ~concrete.isfinite() | (concrete.abs() >= MASK_MAGNITUDE)
        return fills if bool(fills.any()) else None
    if n.op not in ("call_function", "call_method"):
        return None
    name, args = op_name(n) or "", list(n.args)
    if name == "masked_fill" and len(args) > 2 and _is_mask_value(args[2]):
        return _either(_pattern(args[0]), _known_bool(args[1]))
    if name == "where" and len(args) > 2:
        cond = _known_bool(args[0])
        if cond is not None and _is_mask_value(args[2]):
            return _either(_pattern(args[1]), ~cond)
        if cond is not None and _is_mask_value(args[1]):
            return _either(_pattern(args[2]), cond)
        return None
    if name in ("add", "sub", "rsub"):
        return _either(_pattern(args[0]), _pattern(args[1]) if len(args) > 1 else None)
    if name in ("mul", "div", "truediv") and len(args) > 1 and not isinstance(args[1], Node):
        return _pattern(args[0])
    if (name in _IDENTITY or cast_of(n) is not None) and args:
        return _carried(n, _pattern(args[0]))
    return None


def _carried(n: Node, pattern: torch.Tensor | None) -> torch.Tensor | None:
    """A layout op's or a cast's input pattern, for its output: as it is when the shape is kept,
    else the op applied to the pattern (expanded to the input's shape when it is broadcast)."""
    src = n.args[0]
    if pattern is None or not isinstance(src, Node):
        return None
    if _shape(n) == _shape(src):
        return pattern
    if math.prod(_shape(src)) > CONCRETE_LIMIT:
        return None
    env = {a: a.meta.get(CONCRETE_KEY) for a in n.all_input_nodes if a is not src}
    if any(v is None for v in env.values()):
        return None
    full = pattern.expand(tuple(int(s) for s in _shape(src)))
    env[src] = full
    try:
        args = torch.fx.node.map_arg(n.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(n.kwargs, env.__getitem__)
        if n.op == "call_method":
            out = getattr(args[0], str(n.target))(*args[1:], **kwargs)
        else:
            out = n.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:
        return None
    return out if isinstance(out, torch.Tensor) and out.dtype == torch.bool else None


def _row_counts(pattern: torch.Tensor | None, shape: tuple[float, ...], dim: int) -> tuple[tuple[int, float], ...]:
    """The rows along ``dim`` of a value of ``shape`` masked by ``pattern``: (live entries, share of
    the rows) pairs. Without a pattern, every row is whole."""
    length = int(shape[dim])
    if pattern is None or not shape:
        return ((length, 1.0),)
    p = pattern.reshape((1,) * (len(shape) - pattern.dim()) + tuple(pattern.shape))
    dim = dim % len(shape)
    live = (~p).sum(dim) if p.shape[dim] == length else torch.where(p.squeeze(dim), 0, length)
    counts, rows = torch.unique(live.flatten(), return_counts=True)
    total = float(rows.sum())
    return tuple((int(c), float(r) / total) for c, r in zip(counts.tolist(), rows.tolist(), strict=True))


class _Rows(NamedTuple):
    """Statistics of softmax rows, averaged over a value's rows: the sum of squared weights (what a
    weighted average keeps of its inputs' spread), ``Σw² − 2Σw³ + (Σw²)²`` (what softmax's backward
    keeps of an incoming gradient's spread, summed over the row: ``w ⊙ (g − Σ w·g)``), and the
    largest weight. Per group of rows with the same live length: (share of rows, Σw², max weight)."""

    squares: float
    backward: float
    top: float
    groups: tuple[tuple[float, float, float], ...]


def _attention_stats(std: float, counts: tuple[tuple[int, float], ...], length: int) -> _Rows:
    """``_Rows`` for softmax rows of Gaussian logits of spread ``std`` with the live lengths
    ``counts`` (``_row_counts``) out of ``length``. A row with no live entry (every key masked)
    is taken as uniform, as a finfo.min fill makes it. At most 24 lengths are simulated: more
    (a causal mask has one per row) are grouped geometrically."""
    groups: dict[int, float] = {}
    for count, share in counts:
        groups[count] = groups.get(count, 0.0) + share
    if len(groups) > 24:
        binned: dict[int, list[float]] = {}
        for count, share in groups.items():
            bucket = int(round(math.log2(count) * 4)) if count > 0 else -1
            acc = binned.setdefault(bucket, [0.0, 0.0])
            acc[0] += share
            acc[1] += share * count
        groups = {}
        for share, weighted in binned.values():
            rep = int(round(weighted / share)) if share > 0 else 0
            groups[rep] = groups.get(rep, 0.0) + share
    squares = backward = top = 0.0
    parts = []
    for count, share in sorted(groups.items()):
        s2, b, t = _row_stats(float(min(std, 50.0)), count) if count > 0 else _row_stats(0.0, length)
        squares += share * s2
        backward += share * b
        top = max(top, t)
        parts.append((share, s2, t))
    return _Rows(squares, backward, top, tuple(parts))


@functools.cache
def _row_stats(std: float, length: int) -> tuple[float, float, float]:
    """(Σw², Σw² − 2Σw³ + (Σw²)², max w) of softmax rows over ``length`` Gaussian logits of spread
    ``std``, averaged over a fixed sample of rows (the max: over them). Measured, not a closed form:
    over few keys the normalizer is dominated by the largest terms (``_softmax_ms``)."""
    if length <= 1:
        return (1.0, 0.0, 1.0) if length == 1 else (0.0, 0.0, 0.0)
    sampled = min(length, 1 << 16)
    rows = max(16, min(256, (1 << 16) // sampled))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, sampled, generator=g, dtype=torch.float64) * std
    w = torch.softmax(logits, dim=-1) * (sampled / length)
    s2 = w.square().sum(-1) * (length / sampled)
    s3 = w.pow(3).sum(-1) * (length / sampled)
    return float(s2.mean()), float((s2 - 2 * s3 + s2.square()).mean()), float(w.max())


# ------------------------------------------------------------------------------ forward rules

_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "elu": F.elu, "leaky_relu": F.leaky_relu, "relu6": F.relu6, "softplus": F.softplus,
    "mish": F.mish, "hardswish": F.hardswish, "abs": torch.abs, "neg": torch.neg, "square": torch.square,
    "sin": torch.sin, "cos": torch.cos, "erf": torch.erf, "exp": torch.exp,
}
_IDENTITY = frozenset({
    "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "contiguous", "clone", "expand",
    "squeeze", "unsqueeze", "unbind", "split", "chunk", "getitem", "dropout", "detach",
    "rescale", "to", "float", "half", "bfloat16", "type_as", "repeat", "roll",
    "narrow", "select", "slice", "alias", "view_as",
})


def _gemm(x: Moments, w: Moments, k: float, n: float, bias: Moments | None = None) -> Moments:
    """y = Σ_k x·w over a reduction of length k (+ bias), independent factors."""
    mean = k * x.mean * w.mean + (bias.mean if bias else 0.0)
    var = k * (x.ms * w.ms - (x.mean * w.mean) ** 2) + (bias.std**2 if bias else 0.0)
    return Moments.gaussian(mean, var + mean**2, n)


@functools.cache
def _power(p: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """x ** p as a function (cached: ``_expect`` caches by the function)."""
    return functools.partial(torch.pow, exponent=p)


@functools.cache
def _clamp(low: float | None, high: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """clamp to [low, high] as a function (cached: ``_expect`` caches by the function)."""
    return functools.partial(torch.clamp, min=low, max=high)


# Ops that clamp their input, with where their bounds are: (argument index, keyword, default) each.
_CLAMPS: dict[str, tuple[tuple[int, str, float | None], tuple[int, str, float | None]]] = {
    "hardtanh": ((1, "min_val", -1.0), (2, "max_val", 1.0)),  # (what nn.ReLU6 traces to: hardtanh(x, 0, 6))
    "clamp": ((1, "min", None), (2, "max", None)), "clip": ((1, "min", None), (2, "max", None)),
    "clamp_min": ((1, "min", None), (9, "", None)), "clamp_max": ((9, "", None), (1, "max", None)),
}


def _elementwise(n: Node) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The function of a unary elementwise op of a Gaussian input (``_expect`` integrates it):
    a table entry, ``pow`` with an integer exponent (``x.pow(2)`` in an RMS norm), or a clamp with
    its own bounds (``hardtanh``'s defaults are [-1, 1], ReLU6's [0, 6])."""
    name = op_name(n) or ""
    if name in _UNARY:
        return _UNARY[name]
    if name == "pow" and len(n.args) > 1 and isinstance(n.args[1], int | float) and float(n.args[1]).is_integer():
        return _power(float(n.args[1]))
    if name in _CLAMPS:
        bounds = [n.kwargs.get(key, n.args[at] if len(n.args) > at else default) for at, key, default in _CLAMPS[name]]
        numbers = [float(b) if isinstance(b, int | float) and not isinstance(b, bool) else b for b in bounds]
        if all(b is None or isinstance(b, float) for b in numbers):
            return _clamp(*numbers)  # type: ignore[arg-type]
    return None


def _forward(n: Node, value: dict[Node, Moments | None]) -> Moments | None:
    if n.op not in ("call_function", "call_method"):
        return None
    name = op_name(n) or ""
    if name in _IDENTITY or cast_of(n) is not None:
        src = n.args[0] if n.args else None
        return value.get(src) if isinstance(src, Node) else None
    rule = _FORWARD.get(name)
    if rule is not None:
        return rule(n, value)
    f = _elementwise(n)
    if f is not None and n.args:
        m = _m(n.args[0], value)
        if m is None:
            return None
        mean, ms, _ = _expect(f, m)
        return Moments.gaussian(mean, ms, _numel(n))
    return None


_POSITIVE_POWERS = {"rsqrt": -0.5, "sqrt": 0.5, "reciprocal": -1.0}


def _positive_power(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """x ** p of a positive, concentrated x (a mean of squares plus eps in a norm): the delta
    method. Unknown when x may come near 0 (within three spreads), where x ** p has no bound."""
    x = _m(n.args[0], v)
    p = _POSITIVE_POWERS[op_name(n) or ""]
    if x is None or x.mean <= 0 or x.mean - 3 * x.std <= 0:
        return None
    mean = x.mean**p
    var = (p * x.mean ** (p - 1) * x.std) ** 2
    return Moments(mean, mean**2 + var, max((x.mean - 3 * x.std) ** p, (x.mean + 3 * x.std) ** p))


def _constant(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """A tensor filled with one value (``zeros``, ``ones``, ``full``, and their ``_like`` forms)."""
    name = op_name(n) or ""
    if "full" in name:
        at = 2 if name == "new_full" else 1  # (size, fill) / (input, fill) / (self, size, fill)
        fill = n.kwargs.get("fill_value", n.args[at] if len(n.args) > at else None)
        if not isinstance(fill, int | float) or isinstance(fill, bool):
            return None
        c = float(fill)
    else:
        c = 1.0 if "ones" in name else 0.0
    return Moments(c, c * c, abs(c))


def _linear(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    x, w = _m(n.args[0], v), _m(n.args[1], v)
    bias = _m(n.args[2], v) if len(n.args) > 2 and n.args[2] is not None else None
    if x is None or w is None:
        return None
    return _gemm(x, w, _shape(n.args[0])[-1], _numel(n), bias)


def _matmul(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    a, b = _m(n.args[0], v), _m(n.args[1], v)
    if a is None or b is None:
        return None
    out = _gemm(a, b, _shape(n.args[0])[-1], _numel(n))
    if _is_softmax(n.args[0]):
        # attention's probabilities @ values: each row a weighted average of b's rows, which can
        # reach b's max (a row that puts its weight on one key, as a causal mask's first row does)
        return Moments(out.mean, out.ms, max(out.amax, b.amax))
    return out


def _is_softmax(x: Any) -> bool:
    """Whether ``x`` is a softmax's output (through casts and views): rows of weights summing to 1."""
    while isinstance(x, Node) and ((op_name(x) or "") in _IDENTITY or cast_of(x) is not None):
        x = x.args[0] if x.args else None
    return isinstance(x, Node) and op_name(x) == "softmax"


def _conv(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    x, w = _m(n.args[0], v), _m(n.args[1], v)
    bias = _m(n.args[2], v) if len(n.args) > 2 and isinstance(n.args[2], Node) else None
    if x is None or w is None:
        return None
    wshape = _shape(n.args[1])
    k = wshape[1] * _taps_per_output(n, n.args[0], [int(s) for s in wshape[2:]])  # type: ignore[arg-type]
    return _gemm(x, w, k, _numel(n), bias)


def _binary(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    a, b = _m(n.args[0], v), _m(n.args[1], v) if len(n.args) > 1 else None
    if a is None or b is None:
        return None
    name = op_name(n)
    if name in ("add", "sub", "rsub"):
        sign = -1.0 if name == "sub" else 1.0
        mean = a.mean + sign * b.mean
        return Moments.gaussian(mean, a.std**2 + b.std**2 + mean**2, _numel(n))
    if name == "mul":
        return _product(a, b, _numel(n))
    if name in ("div", "truediv") and not isinstance(n.args[1], Node):
        return a.scaled(1.0 / float(n.args[1]))  # type: ignore[arg-type]
    return None


# where a normalization op takes its affine weight, bias and eps (rms_norm has no bias: index 5 is None)
_NORM_ARGS = {"layer_norm": (2, 3, 4), "group_norm": (2, 3, 4), "batch_norm": (3, 4, 7), "rms_norm": (2, 5, 3)}


def _product(a: Moments, b: Moments, n: float) -> Moments:
    """Moments of x·y for independent x and y, with the max of ``n`` such products.

    x·y = μx·μy + μx·(y-μy) + μy·(x-μx) + (x-μx)·(y-μy): the middle terms are Gaussian, but the
    product of two spreads has exponential tails (its max over n grows like ln n, not √(2 ln n)),
    so a gated feed-forward's gelu(a)·b peaks ~2.5x above a Gaussian of the same spread. The max
    adds the parts' maxima, and never exceeds the product of the factors' maxima."""
    gaussian = math.sqrt((a.mean * b.std) ** 2 + (b.mean * a.std) ** 2)
    log_n = math.log(max(n, 2.0))
    amax = abs(a.mean * b.mean) + gaussian * math.sqrt(2 * log_n) + a.std * b.std * log_n
    return Moments(a.mean * b.mean, a.ms * b.ms, min(amax, a.amax * b.amax))


def _normalized_ms(n: Node, x: Moments, v: dict[Node, Moments | None]) -> tuple[float, float]:
    """The variance a normalization divides by and its ``eps``: what is left of the input's spread
    after it (``var / (var + eps)``, below 1 when the input's spread is near ``eps`` — BatchNorm
    after small-initialized convolutions) and the factor its backward multiplies by (``1 / (var +
    eps)``) both depend on the two together. RMS norm divides by the mean square, not the variance;
    batch norm in eval mode by its running variance."""
    name = op_name(n) or ""
    args = list(n.args) + [None] * 8
    eps = n.kwargs.get("eps", args[_NORM_ARGS[name][2]])
    if not isinstance(eps, int | float):
        eps = 1e-5 if name != "rms_norm" else torch.finfo(torch.float32).eps
    var = x.ms if name == "rms_norm" else x.std**2
    if name == "batch_norm" and not n.kwargs.get("training", args[5]):
        running = n.kwargs.get("running_var", args[2])
        if isinstance(running, Node) and isinstance(rv := _m(running, v), Moments):
            var = rv.mean
    elif name == "batch_norm" and (within := _within_channel_var(n.args[0], v)) is not None:
        var = min(var, within)
    return max(var, 0.0), float(eps)


def _within_channel_var(x: Any, v: dict[Node, Moments | None]) -> float | None:
    """The variance of a convolution's output within a channel, where it is ``x`` (through casts
    and views): what a batch norm after it divides by. Each output channel's mean is its input's
    mean times the sum of the channel's weights (plus its bias): it differs from channel to
    channel, and the output's variance over all channels counts those differences, which a batch
    norm, normalizing each channel by its own statistics, does not see. After a ReLU or a max pool
    (inputs with a mean near their spread) they were half the variance: ResNet's and RegNet's
    batch norms' backward was predicted ~2x too weak each, compounding to 4-20x at the stem."""
    while isinstance(x, Node) and ((op_name(x) or "") in _IDENTITY or cast_of(x) is not None):
        x = x.args[0] if x.args else None
    if not isinstance(x, Node) or (op_name(x) or "") not in ("conv1d", "conv2d", "conv3d"):
        return None
    xm, wm = _m(x.args[0], v), _m(x.args[1], v)
    if xm is None or wm is None:
        return None
    wshape = _shape(x.args[1])
    k = wshape[1] * _taps_per_output(x, x.args[0], [int(s) for s in wshape[2:]])  # type: ignore[arg-type]
    return k * wm.ms * xm.std**2


def _normalize(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """layer/batch/group/RMS norm: the input's spread divided by √(var + eps), then the affine
    weight and bias."""
    weight_at, bias_at, _ = _NORM_ARGS[op_name(n) or ""]
    args = list(n.args) + [None] * 6
    x = _m(n.args[0], v)
    w = _m(n.kwargs.get("weight", args[weight_at]), v)
    b = _m(n.kwargs.get("bias", args[bias_at]), v)
    kept = 1.0
    if x is not None:
        var, eps = _normalized_ms(n, x, v)
        kept = var / (var + eps) if var + eps > 0 else 1.0
    w_ms = w.ms if w else 1.0
    mean = b.mean if b else 0.0
    return Moments.gaussian(mean, w_ms * kept + (b.ms if b else 0.0), _numel(n))


def _pad_args(n: Node) -> tuple[Any, Any, float]:
    """``F.pad``'s widths, mode and fill value (0 when not given, nan when not a number)."""
    def arg(at: int, name: str, default: Any) -> Any:
        return n.kwargs.get(name, n.args[at] if len(n.args) > at else default)

    fill = arg(3, "value", None)
    value = 0.0 if fill is None else float(fill) if isinstance(fill, int | float) else math.nan
    return arg(1, "pad", None), arg(2, "mode", "constant"), value


def _pad(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """Constant padding: the added entries (``value``, 0 by default) dilute the mean and mean square
    by the share they take; on a small feature map a 1-pixel border is most of it (2x2 -> 4x4)."""
    x = _m(n.args[0], v)
    _, mode, fill = _pad_args(n)
    if x is None or mode != "constant" or math.isnan(fill):
        return x
    kept = _numel(n.args[0]) / max(_numel(n), 1.0)
    return Moments(x.mean * kept + fill * (1 - kept), x.ms * kept + fill**2 * (1 - kept), max(x.amax, abs(fill)))


def _softmax(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """Rows of weights summing to 1 over ``dim``, each row over its live entries only where the
    input holds mask fills (a causal mask's first row is one weight of 1). The row statistics
    (``_attention_stats``) are kept for the backward and for a product with the values after it."""
    x = _m(n.args[0], v)
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else -1)
    if x is None or not isinstance(dim, int):
        return None
    shape = _shape(n.args[0])
    length = int(shape[dim])
    if length <= 0:
        raise ZeroDivisionError  # (an empty row: nothing to predict)
    rows = _attention_stats(x.std, _row_counts(_pattern(n.args[0]), shape, dim), length)
    n.meta[ATTENTION_KEY] = rows
    return Moments(1.0 / length, rows.squares / length, rows.top)


@functools.cache
def _softmax_ms(std: float, length: int, rows: int = 256) -> float:
    """E[w²] of softmax weights over ``length`` Gaussian logits of spread ``std``: measured on a
    fixed sample of ``rows`` rows. The closed form e^{σ²}/L² assumes the normalizer is its mean;
    over few keys it is dominated by the largest terms, and the closed form came out 4.5x too high
    on T5's unscaled attention logits (σ² = 2.8 over 16 keys)."""
    if length <= 0:
        raise ZeroDivisionError  # (an empty row: nothing to predict)
    sampled = min(length, 1 << 16)  # (a longer row spreads its weight over more keys: each is smaller)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, sampled, generator=g, dtype=torch.float64) * min(std, 50.0)
    weights = torch.softmax(logits, dim=-1) * (sampled / length)
    return float(weights.square().mean())


def _attention_args(n: Node) -> tuple[Any, bool, float]:
    """``scaled_dot_product_attention``'s mask argument, ``is_causal`` and scale (1/√d by default)."""
    def arg(at: int, name: str, default: Any) -> Any:
        return n.kwargs.get(name, n.args[at] if len(n.args) > at else default)

    scale = arg(6, "scale", None)
    d = _shape(n.args[0])[-1]
    return arg(3, "attn_mask", None), bool(arg(5, "is_causal", False)), (
        float(scale) if isinstance(scale, int | float) else 1.0 / math.sqrt(d))


def _sdpa(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """softmax(s·QKᵀ + mask)·V: each output row a weighted average of V's rows, which keeps
    ``Σw²`` of their spread (``_attention_stats``). The scores' spread across keys: s²·d·E[q²]·var(k)
    (k's mean adds the same to every key of a row, which softmax ignores), plus an additive float
    mask's (T5's position bias). The rows' live lengths: ``is_causal``'s lower triangle, a boolean
    mask known at compile time (True: attend), the mask fills of a float mask (``MASK_KEY``).
    (The rule this replaces took a causal row as half the keys and ignored ``scale`` and masks: a
    causal attention's rows average over 1..L keys, and its first rows keep most of V's spread.)"""
    q, k, val = (_m(a, v) for a in n.args[:3])
    if q is None or k is None or val is None:
        return None
    mask, causal, scale = _attention_args(n)
    shape_q, shape_k = _shape(n.args[0]), _shape(n.args[1])
    queries, keys, d = int(shape_q[-2]), int(shape_k[-2]), shape_q[-1]
    pattern = ~torch.ones(queries, keys, dtype=torch.bool).tril() if causal else None
    score_var = scale**2 * d * q.ms * k.std**2
    if isinstance(mask, Node):
        known = _known_bool(mask)
        if known is not None:
            pattern = _either(pattern, ~known)
        else:
            bias = v.get(mask)
            if bias is None:
                return None
            pattern = _either(pattern, _pattern(mask))
            score_var += bias.std**2
    scores = (*shape_q[:-1], float(keys))
    rows = _attention_stats(math.sqrt(score_var), _row_counts(pattern, scores, -1), keys)
    n.meta[ATTENTION_KEY] = rows
    ms = val.mean**2 + val.std**2 * rows.squares
    # the largest output: per group of rows, a Gaussian max of its entries (a row over one key is a
    # row of V itself)
    amax = max((abs(val.mean) + val.std * math.sqrt(squares) * math.sqrt(2 * math.log(max(share * _numel(n), 2.0)))
                for share, squares, _ in rows.groups), default=0.0)
    return Moments(val.mean, ms, min(amax, val.amax) if val.amax > 0 else amax)


def _masked_fill(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """``x.masked_fill(mask, value)``: a mask fill (``MASK_MAGNITUDE``) leaves the moments of the
    entries kept (and ``MASK_KEY`` says where the fills are); another value mixes in at the share of
    the mask known at compile time, or, unknown, counts only in the max."""
    x, fill = _m(n.args[0], v), _m(n.args[2], v) if len(n.args) > 2 else None
    if x is None:
        return None
    if _is_mask_value(n.args[2]) if len(n.args) > 2 else False:
        return x
    if fill is None:
        return None
    known = _known_bool(n.args[1])
    if known is None:
        return Moments(x.mean, x.ms, max(x.amax, fill.amax))
    return _mixture(x, fill, 1.0 - float(known.double().mean()))


def _mixture(a: Moments, b: Moments, share_a: float) -> Moments:
    """Entries from ``a`` at ``share_a`` of the positions, from ``b`` at the rest."""
    share_b = 1.0 - share_a
    amax = max(a.amax if share_a > 0 else 0.0, b.amax if share_b > 0 else 0.0)
    return Moments(share_a * a.mean + share_b * b.mean, share_a * a.ms + share_b * b.ms, amax)


def _where(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """``where(cond, a, b)``: a mask fill on one side leaves the other side's moments (``MASK_KEY``
    says where the fills are); else a mixture at the share of ``cond`` known at compile time, or
    half and half."""
    if len(n.args) < 3:
        return None
    cond, a, b = n.args[:3]
    if _is_mask_value(b):
        return _m(a, v)
    if _is_mask_value(a):
        return _m(b, v)
    ma, mb = _m(a, v), _m(b, v)
    if ma is None or mb is None:
        return None
    known = _known_bool(cond)
    return _mixture(ma, mb, float(known.double().mean()) if known is not None else 0.5)


def _max_pool(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """The max of each window: the largest of ``window`` draws from the input's distribution
    (Gaussian of its moments, ``_max_of``). (Taken as the input itself, ResNet's stem max pool was
    predicted at 0.45 of its spread.)"""
    x = _m(n.args[0], v)
    kernel = n.kwargs.get("kernel_size", n.args[1] if len(n.args) > 1 else None)
    if x is None or kernel is None:
        return None
    dims = 2 if "2d" in (op_name(n) or "") else 1
    sizes = list(kernel) if isinstance(kernel, list | tuple) else [kernel] * dims
    window = 1
    for k in sizes:
        if not isinstance(k, int):
            return None
        window *= k
    mean, ms = _max_of(x.mean / x.std if x.std > 0 else 0.0, window)
    return Moments(mean * x.std if x.std > 0 else x.mean, ms * x.std**2 if x.std > 0 else x.mean**2, x.amax)


@functools.cache
def _max_of(shift: float, window: int, draws: int = 4096) -> tuple[float, float]:
    """Mean and mean square of the max of ``window`` draws of N(shift, 1), on a fixed sample."""
    g = torch.Generator().manual_seed(0)
    top = (torch.randn(draws, window, generator=g, dtype=torch.float64) + shift).amax(-1)
    return float(top.mean()), float(top.square().mean())


def _max_pool_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """Each window's gradient goes to its largest input: the input's gradient has the output's
    spread on one element per window (overlapping windows share some), zeros elsewhere."""
    x = n.args[0]
    if not isinstance(x, Node):
        return {}
    ratio = min(_numel(n) / max(_numel(x), 1.0), 1.0)
    return {x: Moments(g.mean * ratio, g.ms * ratio, g.amax)}


def _addmm(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    """``addmm(bias, a, b)`` = bias + a @ b (what Hugging Face's Conv1D, GPT-2's projections, is)."""
    bias, a, b = (_m(x, v) for x in n.args[:3])
    if a is None or b is None or (bias is None and isinstance(n.args[0], Node)):
        return None
    return _gemm(a, b, _shape(n.args[1])[-1], _numel(n), bias)


def _embedding(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    return _m(n.args[1], v)


def _pool_mean(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    x = _m(n.args[0], v)
    if x is None:
        return None
    window = _numel(n.args[0]) / max(_numel(n), 1.0)
    return Moments.gaussian(x.mean, x.mean**2 + x.std**2 / window, _numel(n))


def _reduce(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    x = _m(n.args[0], v)
    if x is None:
        return None
    count = _numel(n.args[0]) / max(_numel(n), 1.0)
    mean = x.mean if op_name(n) == "mean" else x.mean * count
    spread = x.std**2 / count if op_name(n) == "mean" else x.std**2 * count
    return Moments.gaussian(mean, spread + mean**2, _numel(n))


def _cross_entropy(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    classes = _shape(n.args[0])[-1] if _shape(n.args[0]) else 2.0
    return Moments(math.log(classes), math.log(classes) ** 2, math.log(classes))


def _cat(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    tensors = [a for a in n.args[0] if _numel(a) > 0]  # type: ignore[union-attr]  # (an empty cache)
    moments = _known([_m(a, v) for a in tensors])
    if moments is None:
        return None
    sizes = [_numel(a) for a in tensors]
    total = sum(sizes)
    mean = sum(size * m.mean for size, m in zip(sizes, moments, strict=True)) / total
    ms = sum(size * m.ms for size, m in zip(sizes, moments, strict=True)) / total
    return Moments(mean, ms, max(m.amax for m in moments))


_FORWARD: dict[str, Callable[[Node, dict[Node, Moments | None]], Moments | None]] = {
    "linear": _linear, "matmul": _matmul, "mm": _matmul, "bmm": _matmul,
    "conv1d": _conv, "conv2d": _conv, "conv3d": _conv,
    "add": _binary, "sub": _binary, "rsub": _binary, "mul": _binary, "div": _binary, "truediv": _binary,
    "layer_norm": _normalize, "batch_norm": _normalize, "group_norm": _normalize, "rms_norm": _normalize,
    **dict.fromkeys(_POSITIVE_POWERS, _positive_power),
    **dict.fromkeys(("zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
                     "new_full"), _constant),
    "softmax": _softmax, "scaled_dot_product_attention": _sdpa, "embedding": _embedding,
    "adaptive_avg_pool2d": _pool_mean, "avg_pool2d": _pool_mean, "mean": _reduce, "sum": _reduce,
    "cross_entropy": _cross_entropy, "cat": _cat, "concat": _cat, "pad": _pad,
    "masked_fill": _masked_fill, "where": _where, "addmm": _addmm, "max_pool1d": _max_pool, "max_pool2d": _max_pool,
}


# ----------------------------------------------------------------------------- backward rules


def _output_gradient(out: Node, value: dict[Node, Moments | None]) -> Moments | None:
    """The gradient arriving at a graph output: 1 for a scalar loss; for a tensor, the gradient of
    a mean-reduced cross-entropy over its last dimension, (softmax - onehot) / batch."""
    return _output_gradient_of_shape(_shape(out))


def _output_gradient_of_shape(shape: tuple[float, ...]) -> Moments:
    if not shape:
        return Moments(1.0, 1.0, 1.0)
    classes, batch = shape[-1], math.prod(shape) / shape[-1]
    ms = (1.0 - 1.0 / classes) / classes / batch**2
    return Moments(0.0, ms, 1.0 / batch)


def _grad(ms: float, n: Any, mean: float = 0.0, like: Moments | None = None) -> Moments:
    """A gradient of mean square ``ms`` over ``n``'s elements, its max that of a Gaussian sample;
    or, for a map that keeps each element's gradient where it was (elementwise maps, a
    normalization, softmax: ``like`` is the incoming gradient), at least the incoming gradient's
    max scaled as its spread. A gradient with zeros in most places keeps its peaks so: a
    classifier that reads one position (ViT's and BERT's CLS token) sends back a gradient whose
    spread over the whole sequence is 1/65 of the position's, and its max, as a Gaussian of that
    spread, came out 30x too small. A product with a matrix (a GEMM's input gradient) mixes each
    row's elements: its max is a Gaussian's again."""
    m = Moments.gaussian(mean, ms, _numel(n))
    if like is not None and like.ms > 0 and ms > 0:
        return Moments(m.mean, m.ms, max(m.amax, like.amax * math.sqrt(ms / like.ms)))
    return m


# Layout ops whose backward is not the identity on the gradient's moments: a part taken out of a
# tensor passes its gradient back to that part alone (zeros elsewhere: ViT's classifier reads the
# CLS token, 1 of 65 positions, and the gradient of the whole sequence was predicted 8x too large);
# a broadcast or repeat sums the gradients of its copies.
_PART_OF = frozenset({"getitem", "select", "narrow", "slice"})
_COPIES_OF = frozenset({"expand", "expand_as", "repeat"})


def _backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    name = op_name(n) or ""
    if name in _IDENTITY or cast_of(n) is not None:
        src = n.args[0] if n.args else None
        if not isinstance(src, Node):
            return {}
        if isinstance(tensor_val(src), torch.Tensor) and (name in _PART_OF or name in _COPIES_OF):
            ratio = _numel(n) / max(_numel(src), 1.0)
            if (name in _PART_OF and ratio < 1) or (name in _COPIES_OF and ratio > 1):
                return {src: _grad(g.std**2 * ratio + (g.mean * ratio) ** 2, src, g.mean * ratio)
                        if name in _COPIES_OF else Moments(g.mean * ratio, g.ms * ratio, g.amax)}
        return {src: g}
    rule = _BACKWARD.get(name)
    if rule is not None:
        return rule(n, g, v)
    f = _elementwise(n)
    if f is not None and isinstance(n.args[0], Node) and v.get(n.args[0]) is not None:
        _, _, slope = _expect(f, v[n.args[0]])
        return {n.args[0]: _grad(g.ms * slope, n.args[0], like=g)}
    # no rule: the inputs' gradients are unknown
    return {a: None for a in n.all_input_nodes if v.get(a) is not None or a.op == "placeholder"}


def _gemm_backward(x: Node, w: Node, g: Moments, v: dict[Node, Moments | None], *, out_features: float,
                   rows: float, bias: Any = None) -> dict[Node, Moments | None]:
    xm, wm = v.get(x), v.get(w)
    grads: dict[Node, Moments | None] = {
        x: _grad(out_features * g.ms * wm.ms, x) if wm else None,
        w: _grad(rows * g.ms * xm.ms, w) if xm else None,
    }
    if isinstance(bias, Node):
        grads[bias] = _grad(rows * g.std**2 + (rows * g.mean) ** 2, bias)
    return grads


def _linear_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    x, w = n.args[0], n.args[1]
    assert isinstance(x, Node) and isinstance(w, Node)
    out_features = _shape(w)[0]
    return _gemm_backward(x, w, g, v, out_features=out_features, rows=_numel(n) / out_features,
                          bias=n.args[2] if len(n.args) > 2 else None)


def _matmul_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    a, b = n.args[0], n.args[1]
    assert isinstance(a, Node) and isinstance(b, Node)
    am, bm = v.get(a), v.get(b)
    return {a: _grad(_shape(b)[-1] * g.ms * bm.ms, a) if bm else None,
            b: _grad(_shape(a)[-2] * g.ms * am.ms, b) if am and len(_shape(a)) >= 2 else None}


def _conv_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    x, w = n.args[0], n.args[1]
    assert isinstance(x, Node) and isinstance(w, Node)
    wshape = _shape(w)
    # How many outputs an input element feeds: its own group's out_channels / groups filters (a
    # depthwise convolution's one), each at the kernel positions that land on it (fewer with a
    # stride, and at a small feature map's padded border). The whole out_channels times the kernel
    # overstated the gradient's spread by up to groups x stride^d, compounded over every depthwise
    # layer of a MobileNet: its scales were seeded at the floor and its gradients underflowed.
    groups = n.kwargs.get("groups", n.args[6] if len(n.args) > 6 else 1)
    per_group = wshape[0] / (groups if isinstance(groups, int) else 1)
    fan_out = per_group * _taps_per_input(n, x, [int(k) for k in wshape[2:]])
    rows = _numel(n) / wshape[0]  # batch × output positions
    return _gemm_backward(x, w, g, v, out_features=fan_out, rows=rows,
                          bias=n.args[2] if len(n.args) > 2 else None)


def _taps_per_input(n: Node, x: Node, kernel: list[int]) -> float:
    """The kernel taps that land on an input element, on average over the input: per spatial
    dimension, the (output position, tap) pairs inside the input divided by its size. When the
    input is a zero ``pad`` (TF-style "same" padding written out, as Hugging Face's MobileNetV2
    does), over its interior only: the border's gradient is dropped by the pad's backward, and on a
    2x2 map padded to 4x4 the interior's elements get 1.8x the average's taps. The kernel's size
    when the convolution's arguments are not plain integers."""
    return _taps(n, x, kernel, per_output=False)


def _taps_per_output(n: Node, x: Node, kernel: list[int]) -> float:
    """The kernel taps that land inside the input, on average over the output positions: the
    reduction length of a convolution per input channel. On a small feature map most of a padded
    3x3 kernel reads the zero padding (on a 2x2 map, 4 of its 9 taps are inside): counted as the
    whole kernel, the output's spread came out 1.5x too high on MobileNetV2's last blocks, its
    batch norms' backward divided by it, and the gradients of the first layers were predicted 300x
    too small."""
    return _taps(n, x, kernel, per_output=True)


def _taps(n: Node, x: Node, kernel: list[int], *, per_output: bool) -> float:
    def spatial(at: int, name: str, default: int) -> list[int] | None:
        value = n.kwargs.get(name, n.args[at] if len(n.args) > at else default)
        values = list(value) if isinstance(value, list | tuple) else [value] * len(kernel)
        ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        return ints if len(ints) == len(kernel) else None  # (not a string padding, not symbolic)

    stride, padding, dilation = spatial(3, "stride", 1), spatial(4, "padding", 0), spatial(5, "dilation", 1)
    sizes_in, sizes_out = _shape(x)[-len(kernel):], _shape(n)[-len(kernel):]
    if stride is None or padding is None or dilation is None or len(sizes_in) != len(kernel):
        return float(math.prod(kernel))
    # (per output, a zero pad's border is inside: the pad's moments are diluted by its zeros already)
    border = (None if per_output else _zero_border(x, len(kernel))) or [(0, 0)] * len(kernel)
    taps = 1.0
    for k, s, p, d, size_in, size_out, (lo, hi) in zip(kernel, stride, padding, dilation, sizes_in, sizes_out,
                                                       border, strict=True):
        inside = sum(lo <= o * s - p + t * d < size_in - hi for o in range(int(size_out)) for t in range(k))
        taps *= inside / max(size_out if per_output else size_in - lo - hi, 1.0)
    return taps


def _zero_border(x: Node, dims: int) -> list[tuple[int, int]] | None:
    """The (before, after) widths of a zero ``pad`` on the last ``dims`` dimensions of ``x``, in
    dimension order; None when ``x`` is not such a pad."""
    if op_name(x) != "pad" or not x.args:
        return None
    widths, mode, fill = _pad_args(x)
    if mode != "constant" or fill != 0.0 or not isinstance(widths, list | tuple):
        return None
    if not all(isinstance(w, int) for w in widths) or len(widths) % 2:
        return None
    pairs = [(int(widths[i]), int(widths[i + 1])) for i in range(0, len(widths), 2)][::-1]  # last dim first
    pairs = [(0, 0)] * max(dims - len(pairs), 0) + pairs
    return pairs[-dims:]


def _binary_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    name = op_name(n)
    grads: dict[Node, Moments | None] = {}
    for i, arg in enumerate(n.args[:2]):
        if not isinstance(arg, Node):
            continue
        other = n.args[1 - i]
        part: Moments | None
        if name in ("add", "sub", "rsub"):
            part = g
        elif name == "mul":
            om = _m(other, v)
            part = _grad(g.ms * om.ms, arg, like=g) if om else None
        elif name in ("div", "truediv") and i == 0 and not isinstance(other, Node):
            part = g.scaled(1.0 / float(other))  # type: ignore[arg-type]
        else:
            part = None
        broadcast = _numel(n) / max(_numel(arg), 1.0)
        if part is not None and broadcast > 1:  # summed over broadcast dimensions
            part = _grad(part.std**2 * broadcast + (part.mean * broadcast) ** 2, arg, part.mean * broadcast)
        grads[arg] = part
    return grads


def _normalize_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    weight_at, bias_at, _ = _NORM_ARGS[op_name(n) or ""]
    args = list(n.args) + [None] * 6
    x, w, b = args[0], n.kwargs.get("weight", args[weight_at]), n.kwargs.get("bias", args[bias_at])
    xm, wm = _m(x, v), _m(w, v)
    var, eps = _normalized_ms(n, xm, v) if xm else (1.0, 0.0)
    grads: dict[Node, Moments | None] = {}
    if isinstance(x, Node):
        grads[x] = _grad(g.ms * (wm.ms if wm else 1.0) / max(var + eps, 1e-12), x, like=g) if xm else None
    rows = _numel(n) / max(_numel(w), 1.0) if isinstance(w, Node) else 1.0
    if isinstance(w, Node):  # the normalized input's mean square: var / (var + eps)
        grads[w] = _grad(rows * g.ms * (var / (var + eps) if var + eps > 0 else 1.0), w)
    if isinstance(b, Node):
        grads[b] = _grad(rows * g.ms, b)
    return grads


def _pad_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """The interior of the padded gradient, taken to have the whole's mean square (a convolution
    reading the pad predicts its interior's: ``_taps_per_input``)."""
    return {n.args[0]: g} if isinstance(n.args[0], Node) else {}


def _softmax_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """y ⊙ (g - Σ y·g): the mean of g cancels, and a row keeps ``Σy² − 2Σy³ + (Σy²)²`` of g's
    spread (``_Rows.backward``: nothing of a row over one key, which E[y²] alone counted in full)."""
    y = v.get(n)
    x = n.args[0]
    if not isinstance(x, Node) or y is None:
        return {}
    rows = n.meta.get(ATTENTION_KEY)
    if not isinstance(rows, _Rows):
        return {x: _grad(g.std**2 * y.ms, x)}
    length = _shape(x)[_softmax_dim(n)]
    return {x: _grad(g.std**2 * rows.backward / length, x, like=g)}


def _softmax_dim(n: Node) -> int:
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else -1)
    return dim if isinstance(dim, int) else -1


def _cross_entropy_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    logits = n.args[0]
    if not isinstance(logits, Node):
        return {}
    grad = _output_gradient(logits, v)
    assert grad is not None
    return {logits: grad.scaled(g.mean if g.mean else 1.0)}


def _reduce_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    x = n.args[0]
    if not isinstance(x, Node):
        return {}
    count = _numel(x) / max(_numel(n), 1.0)
    return {x: g.scaled(1.0 / count) if op_name(n) == "mean" else g}


def _pool_mean_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    x = n.args[0]
    window = _numel(x) / max(_numel(n), 1.0) if isinstance(x, Node) else 1.0
    return {x: g.scaled(1.0 / window)} if isinstance(x, Node) else {}


def _sdpa_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """The backward of softmax(s·QKᵀ + mask)·V, with P the weights, dO the incoming gradient and
    dP = dO·Vᵀ (d products; the part of V's mean shared by a row's keys cancels in softmax's
    backward, so var(dP) = d·E[dO²]·var(v)):

    * dV = Pᵀ·dO: a key's gradient sums the dO of the queries attending to it, weighted: per key,
      (L/S)·E[Σw²]·E[dO²] (L queries, S keys). (The rule this replaces took dV as dO: its spread
      2.2-3.6x too large over 32 keys, and dQ's and dK's up to 2.9x.)
    * dS = P ⊙ (dP − Σ P·dP): ``_Rows.backward``·var(dP) per row.
    * dQ = s·dS·K: s²·E[row Σ dS²]·var(k) (Σ_j dS = 0: k's mean cancels); dK = s·dSᵀ·Q, per key
      (L/S) of it with E[q²].
    * a float mask that takes a gradient (a learned position bias) gets dS, summed over the
      dimensions it is broadcast along.

    With grouped-query attention (``enable_gqa``) each key and value head serves G query heads:
    its gradients sum G of them."""
    q, k, val = n.args[:3]
    if not all(isinstance(a, Node) for a in (q, k, val)):
        return {}
    qm, km, vm = v.get(q), v.get(k), v.get(val)  # type: ignore[arg-type]
    mask, _, scale = _attention_args(n)
    inputs: list[Node] = [q, k, val] + ([mask] if isinstance(mask, Node) and _known_bool(mask) is None else [])  # type: ignore[assignment]
    rows = n.meta.get(ATTENTION_KEY)
    if qm is None or km is None or vm is None or not isinstance(rows, _Rows):
        return dict.fromkeys(inputs)
    shape_q, shape_k, shape_v = _shape(q), _shape(k), _shape(val)
    queries, keys = shape_q[-2], shape_k[-2]
    group = shape_q[-3] / shape_k[-3] if len(shape_q) >= 3 and len(shape_k) >= 3 else 1.0
    dp = shape_v[-1] * g.ms * vm.std**2
    row_ds = rows.backward * dp  # Σ_j dS_ij² per query row
    grads: dict[Node, Moments | None] = {
        val: _grad(g.ms * (queries / keys) * rows.squares * group, val),  # type: ignore[dict-item]
        q: _grad(scale**2 * row_ds * km.std**2, q),  # type: ignore[dict-item]
        k: _grad(scale**2 * (queries / keys) * row_ds * qm.ms * group, k),  # type: ignore[dict-item]
    }
    if len(inputs) > 3:
        scores = _numel(q) / shape_q[-1] * keys
        broadcast = scores / max(_numel(mask), 1.0)
        grads[mask] = _grad(row_ds / keys * broadcast, mask)
    return grads


def _masked_fill_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """The kept entries' gradient. Before a softmax, a mask fill's entries get softmax's zero
    gradient already (its moments average them in): passed on as it is. Another fill zeroes the
    gradient at the share of the mask known at compile time; the fill value, where it is a tensor,
    gets the rest, summed over its broadcast."""
    x = n.args[0]
    fill = n.args[2] if len(n.args) > 2 else None
    known = _known_bool(n.args[1]) if len(n.args) > 1 else None
    share = float(known.double().mean()) if known is not None and not _is_mask_value(fill) else 0.0
    grads: dict[Node, Moments | None] = {}
    if isinstance(x, Node):
        grads[x] = _grad(g.ms * (1.0 - share), x, like=g) if share > 0 else g
    if isinstance(fill, Node) and not _is_mask_value(fill):
        grads[fill] = _grad(g.ms * share * _numel(n) / max(_numel(fill), 1.0), fill)
    return grads


def _where_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """Each side gets the gradient where it was chosen (at the known share of ``cond``, or half),
    summed over the dimensions it is broadcast along."""
    if len(n.args) < 3:
        return {}
    cond, a, b = n.args[:3]
    known = _known_bool(cond)
    share = float(known.double().mean()) if known is not None else 0.5
    grads: dict[Node, Moments | None] = {}
    for side, part in ((a, share), (b, 1.0 - share)):
        if isinstance(side, Node) and not _is_mask_value(side):
            broadcast = _numel(n) / max(_numel(side), 1.0)
            grads[side] = _grad(g.ms * part * broadcast, side)
    return grads


def _addmm_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    bias, a, b = n.args[:3]
    if not isinstance(a, Node) or not isinstance(b, Node):
        return {}
    out_features = _shape(b)[-1]
    grads = _gemm_backward(a, b, g, v, out_features=out_features, rows=_shape(a)[-2])
    if isinstance(bias, Node):
        rows = _numel(n) / max(_numel(bias), 1.0)
        grads[bias] = _grad(rows * g.std**2 + (rows * g.mean) ** 2, bias)
    return grads


def _positive_power_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    """x ** p of a concentrated positive x (``_positive_power``): the slope at its mean."""
    x = n.args[0]
    xm = _m(x, v)
    if not isinstance(x, Node):
        return {}
    if xm is None or xm.mean <= 0:
        return {x: None}
    p = _POSITIVE_POWERS[op_name(n) or ""]
    return {x: _grad(g.ms * (p * xm.mean ** (p - 1)) ** 2, x, like=g)}


def _embedding_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    weight = n.args[1]
    if not isinstance(weight, Node):
        return {}
    rows = _shape(weight)[0]
    lookups = _numel(n) / _shape(weight)[-1]
    return {weight: _grad(g.ms * lookups / rows, weight)}  # scatter-added over the rows used


def _cat_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    return {a: g for a in n.args[0] if isinstance(a, Node) and _numel(a) > 0}  # type: ignore[union-attr]


_BACKWARD: dict[str, Callable[[Node, Moments, dict[Node, Moments | None]], dict[Node, Moments | None]]] = {
    "linear": _linear_backward, "matmul": _matmul_backward, "mm": _matmul_backward, "bmm": _matmul_backward,
    "conv1d": _conv_backward, "conv2d": _conv_backward, "conv3d": _conv_backward,
    "add": _binary_backward, "sub": _binary_backward, "rsub": _binary_backward, "mul": _binary_backward,
    "div": _binary_backward, "truediv": _binary_backward,
    "layer_norm": _normalize_backward, "batch_norm": _normalize_backward, "group_norm": _normalize_backward,
    "rms_norm": _normalize_backward, "pad": _pad_backward,
    "softmax": _softmax_backward, "cross_entropy": _cross_entropy_backward, "mean": _reduce_backward,
    "sum": _reduce_backward, "adaptive_avg_pool2d": _pool_mean_backward, "avg_pool2d": _pool_mean_backward,
    "scaled_dot_product_attention": _sdpa_backward, "embedding": _embedding_backward,
    "cat": _cat_backward, "concat": _cat_backward, "masked_fill": _masked_fill_backward, "where": _where_backward,
    "addmm": _addmm_backward, **dict.fromkeys(_POSITIVE_POWERS, _positive_power_backward),
    "max_pool1d": _max_pool_backward, "max_pool2d": _max_pool_backward,
}
