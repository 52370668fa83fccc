"""Predict, before anything runs, the magnitude of every value and gradient in the graph.

Each floating-point node gets ``Moments`` (mean, mean square, max |x|) for its value, from the
real inputs and parameters, propagated forward with per-op rules; then ``Moments`` for its
gradient, propagated backward from the outputs (a scalar output — the loss — gets gradient 1; a
tensor output is assumed to feed a mean-reduced cross-entropy over its last dimension). From the
gradient's spread σ the predicted float16 underflow rate is ``erf(u_min / (√2·σ))`` (zero-mean
Gaussian model, u_min = 2⁻²⁴), and the overflow risk is whether the predicted max exceeds
65504 / 2^margin.

Rules are a registry keyed by op name; an op without a rule makes its value (or gradient)
unknown, never a crash. Reduction lengths are sympy expressions (symbolic under dynamic shapes),
evaluated with the shape environment's hints. Results go to ``node.meta``:
``autoscale_moments`` = {"value": Moments | None, "grad": Moments | None}, and, where the
gradient is known, ``autoscale_underflow`` (rate) and ``autoscale_overflow`` (bool).
Predictions assume float16, the dtype gradient scaling exists for.

Seeds: ``seed_inputs(gm, example_inputs)`` records the moments of real example tensors on the
placeholders (the backend does it; the pass itself sees only fake tensors). ``calibrate(gm,
example_inputs)`` goes further: it runs the graph once in float32 on copies of the inputs and
records every node's measured value and gradient moments, which the pass then uses instead of
its predictions.
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

from .graph_utils import cast_of, op_name, tensor_val
from .manager import PassResult

if TYPE_CHECKING:
    from autoscale.config import Config

__all__ = ["VALUE_KEY", "Moments", "analyze_underflow", "calibrate", "clear_caches", "forward_moments",
           "predicted_underflow", "seed_inputs"]

PASS = "analyze_underflow"
U_MIN = 2.0**-24
SEED_KEY, MOMENTS_KEY, CALIBRATION_KEY = "autoscale_seed", "autoscale_moments", "autoscale_calibration"
VALUE_KEY = "autoscale_value"


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
    """Fraction of a zero-mean Gaussian with the gradient's spread that float16 rounds to zero."""
    sigma = math.sqrt(max(grad.ms, 0.0))
    return 1.0 if sigma == 0 else math.erf(U_MIN / (math.sqrt(2) * sigma))


# The size one optimizer step gives a parameter (Adam's default learning rate, 1e-3).
UPDATE_SIZE = 1e-3
TRAINABLE_KEY = "autoscale_trainable"


def seed_inputs(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Record the moments of the real example tensors on ``gm``'s placeholders, and which are
    trainable parameters (``TRAINABLE_KEY``: their size is floored in the backward, ``_updated``)."""
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs, strict=False):
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point and not value.is_meta:
            node.meta[SEED_KEY] = Moments.of(value)
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                node.meta[TRAINABLE_KEY] = True


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

    The inputs are copied, so the step changes nothing the caller owns (batch-norm statistics and
    other in-place updates land in the copies). A scalar output is differentiated as the loss; a
    tensor output gets the gradient ``_output_gradient`` assumes, as Gaussian noise.
    """
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
              for x in example_inputs]
    values: dict[Node, torch.Tensor] = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n: Node) -> Any:
            result = super().run_node(n)
            if isinstance(result, torch.Tensor) and result.dtype.is_floating_point:
                if result.requires_grad and not result.is_leaf:
                    result.retain_grad()
                values[n] = result
            return result

    with torch.enable_grad():
        outputs = [o for o in torch.utils._pytree.tree_leaves(_Record(gm).run(*inputs))
                   if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outputs:
            return
        seeds = []
        for out in outputs:
            if out.dim() == 0:
                seeds.append(torch.ones_like(out))
            else:
                expected = _output_gradient_of_shape(tuple(out.shape))
                seeds.append(torch.randn_like(out) * math.sqrt(expected.ms))
        torch.autograd.backward(outputs, seeds)
    for n, t in values.items():
        n.meta[CALIBRATION_KEY] = {"value": Moments.of(t), "grad": Moments.of(t.grad) if t.grad is not None else None}


def analyze_underflow(gm: GraphModule, cfg: Config) -> PassResult:
    """Annotate every node with predicted value and gradient moments (see the module docstring)."""
    try:
        return _analyze(gm, cfg)
    finally:
        clear_caches()
        for n in gm.graph.nodes:  # (the cache serves one pipeline run: a later one may see other inputs)
            n.meta.pop(VALUE_KEY, None)


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
        if _empty(n):
            value[n] = None
        elif measured := n.meta.get(CALIBRATION_KEY, {}).get("value"):
            value[n] = measured
        else:
            value[n] = n.meta.get(SEED_KEY) if n.op == "placeholder" else _unless_empty(_forward, n, value)
        n.meta[VALUE_KEY] = value[n]
    return value


def _analyze(gm: GraphModule, cfg: Config) -> PassResult:
    nodes = list(gm.graph.nodes)
    value = forward_moments(gm)
    grad: dict[Node, list[Moments | None]] = {}
    for out in gm.graph.find_nodes(op="output"):
        for arg in out.all_input_nodes:
            grad.setdefault(arg, []).append(None if _empty(arg) else _output_gradient(arg, value))
    known = 0
    limit = headroom(cfg.scaling.margin, gradient_max(cfg.float8))
    updated = _updated(gm, value)
    for n in reversed(nodes):
        parts = grad.get(n, [])
        # a tuple's elements are disjoint pieces (unbind, chunk): their gradients do not add up
        g = _average(parts) if isinstance(tensor_val(n), tuple | list) else _sum(parts)
        g = None if _empty(n) else n.meta.get(CALIBRATION_KEY, {}).get("grad") or g
        n.meta[MOMENTS_KEY] = {"value": value.get(n), "grad": g}
        if g is None:
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


# ------------------------------------------------------------------------------ forward rules

_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "elu": F.elu, "leaky_relu": F.leaky_relu, "relu6": F.relu6, "softplus": F.softplus,
    "mish": F.mish, "hardswish": F.hardswish, "abs": torch.abs, "neg": torch.neg, "square": torch.square,
    "sin": torch.sin, "cos": torch.cos, "erf": torch.erf, "exp": torch.exp,
}
_IDENTITY = frozenset({
    "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "contiguous", "clone", "expand",
    "squeeze", "unsqueeze", "unbind", "split", "chunk", "getitem", "dropout", "detach", "masked_fill",
    "rescale", "to", "float", "half", "bfloat16", "type_as", "max_pool2d", "max_pool1d", "repeat", "roll",
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
    k = math.prod(_shape(n.args[1])[1:])
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
    return max(var, 0.0), float(eps)


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
    x = _m(n.args[0], v)
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else -1)
    if x is None or not isinstance(dim, int):
        return None
    length = _shape(n.args[0])[dim]
    return Moments(1.0 / length, _softmax_ms(x.std, int(length)), 1.0)


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


def _sdpa(n: Node, v: dict[Node, Moments | None]) -> Moments | None:
    q, k, val = (_m(a, v) for a in n.args[:3])
    if q is None or k is None or val is None:
        return None
    keys = _shape(n.args[1])[-2]
    causal = bool(n.kwargs.get("is_causal", False))
    effective = keys / 2 if causal else keys  # a causal row averages over half the keys on average
    score_var = _shape(n.args[0])[-1] * q.ms * k.ms / _shape(n.args[0])[-1]  # q·k/√d
    concentration = math.exp(min(score_var, 50.0)) / effective
    return Moments.gaussian(val.mean, val.mean**2 + val.std**2 * min(1.0, concentration), _numel(n))


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
    tensors = list(n.args[0])  # type: ignore[arg-type]
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


def _grad(ms: float, n: Any, mean: float = 0.0) -> Moments:
    return Moments.gaussian(mean, ms, _numel(n))


def _backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    name = op_name(n) or ""
    if name in _IDENTITY or cast_of(n) is not None:
        src = n.args[0] if n.args else None
        return {src: g} if isinstance(src, Node) else {}
    rule = _BACKWARD.get(name)
    if rule is not None:
        return rule(n, g, v)
    f = _elementwise(n)
    if f is not None and isinstance(n.args[0], Node) and v.get(n.args[0]) is not None:
        _, _, slope = _expect(f, v[n.args[0]])
        return {n.args[0]: _grad(g.ms * slope, n.args[0])}
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
    def spatial(at: int, name: str, default: int) -> list[int] | None:
        value = n.kwargs.get(name, n.args[at] if len(n.args) > at else default)
        values = list(value) if isinstance(value, list | tuple) else [value] * len(kernel)
        ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        return ints if len(ints) == len(kernel) else None  # (not a string padding, not symbolic)

    stride, padding, dilation = spatial(3, "stride", 1), spatial(4, "padding", 0), spatial(5, "dilation", 1)
    sizes_in, sizes_out = _shape(x)[-len(kernel):], _shape(n)[-len(kernel):]
    if stride is None or padding is None or dilation is None or len(sizes_in) != len(kernel):
        return float(math.prod(kernel))
    border = _zero_border(x, len(kernel)) or [(0, 0)] * len(kernel)
    taps = 1.0
    for k, s, p, d, size_in, size_out, (lo, hi) in zip(kernel, stride, padding, dilation, sizes_in, sizes_out,
                                                       border, strict=True):
        inside = sum(lo <= o * s - p + t * d < size_in - hi for o in range(int(size_out)) for t in range(k))
        taps *= inside / max(size_in - lo - hi, 1.0)
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
            part = _grad(g.ms * om.ms, arg) if om else None
        elif name in ("div", "truediv") and i == 0 and not isinstance(other, Node):
            part = g.scaled(1.0 / float(other))  # type: ignore[arg-type]
        else:
            part = None
        if part is not None:
            broadcast = _numel(n) / max(_numel(arg), 1.0)  # summed over broadcast dimensions
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
        grads[x] = _grad(g.ms * (wm.ms if wm else 1.0) / max(var + eps, 1e-12), x) if xm else None
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
    y = v.get(n)
    x = n.args[0]
    if not isinstance(x, Node) or y is None:
        return {}
    return {x: _grad(g.std**2 * y.ms, x)}  # y ⊙ (g - Σ y·g): the mean of g cancels


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
    q, k, val = n.args[:3]
    if not all(isinstance(a, Node) for a in (q, k, val)):
        return {}
    qm, km, vm = v.get(q), v.get(k), v.get(val)  # type: ignore[arg-type]
    if qm is None or km is None or vm is None:
        return {q: None, k: None, val: None}  # type: ignore[dict-item]
    keys = _shape(k)[-2]
    # dV = Pᵀ·dO sums about one row's worth of dO; dQ, dK go through softmax: ~ dO·V·K/√d scale
    d = _shape(q)[-1]
    dscores = g.ms * vm.std**2 * d / keys
    return {val: _grad(g.ms, val), q: _grad(dscores * km.ms, q), k: _grad(dscores * qm.ms, k)}  # type: ignore[dict-item]


def _embedding_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    weight = n.args[1]
    if not isinstance(weight, Node):
        return {}
    rows = _shape(weight)[0]
    lookups = _numel(n) / _shape(weight)[-1]
    return {weight: _grad(g.ms * lookups / rows, weight)}  # scatter-added over the rows used


def _cat_backward(n: Node, g: Moments, v: dict[Node, Moments | None]) -> dict[Node, Moments | None]:
    return {a: g for a in n.args[0] if isinstance(a, Node)}  # type: ignore[union-attr]


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
    "cat": _cat_backward, "concat": _cat_backward,
}
