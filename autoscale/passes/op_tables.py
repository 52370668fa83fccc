"""The precision tables: which ops run in low precision, which must not, which follow their inputs.

This module is data. Ops are keyed by name, so one table serves the torch-level graph Dynamo
produces (``linear``, ``softmax``, ``add``) and the ATen graph AOTAutograd produces (``addmm``,
``_softmax``, ``native_layer_norm``). Users extend or override it with ``Config.allow`` /
``deny`` / ``infer`` / ``clear``.

Categories (the four lists of TensorFlow's auto-mixed-precision pass and of torch.autocast):

allow   low precision is fast and safe: GEMMs and convolutions (FP32 accumulation in hardware).
deny    must stay float32: exponentials/logs/powers that overflow, reductions over large extents,
        normalization statistics, losses. The value is the reason shown in reports.
infer   elementwise math: low precision when it sits between low-precision ops, else float32.
clear   data movement and exact ops (views, relu, max): follow their neighbours at no risk.
fixed   explicit dtype conversions written in the model, and tensor creation (``zeros``,
        ``arange``, ``tensor``) whose dtype the model names or defaults: the model's choice is kept.
meta    ops that read only sizes and strides: never cast.

An op in none of these is *unknown*: it stays float32 and is reported, never a crash.

Beside the categories, the op sets the other passes and the underflow analysis key their
decisions on (``PASS_THROUGH``, ``FOLDABLE``, ``TRUE_DIVISIONS``, ...), each said where it is defined.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final

__all__ = [
    "ALIASES", "ALLOW", "AVERAGE_POOLS", "BOUNDED", "CLAMP_BOUNDS", "CLEAR", "CREATION", "DENY", "EXTERN_GEMMS",
    "FIXED", "FOLDABLE", "INFER", "LAST_DIM_PRODUCTS", "META", "NORMALIZATIONS", "NORM_ARGUMENTS", "PASS_THROUGH",
    "POSITIVE_POWERS", "REARRANGING", "REORDERING", "REPEATING", "SLICING", "SPARSE_GRADIENT", "TRUE_DIVISIONS",
    "UNARY_ELEMENTWISE", "VIEWS", "Category", "category_of", "deny_reason",
]


class Category(StrEnum):
    ALLOW = "allow"
    DENY = "deny"
    INFER = "infer"
    CLEAR = "clear"
    FIXED = "fixed"
    META = "meta"
    UNKNOWN = "unknown"


ALLOW: Final = frozenset({
    # torch level
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "einsum",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "scaled_dot_product_attention", "bilinear",
    # aten level
    "convolution", "_convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
})

_EXP = "exp/log/pow overflow or lose precision in float16"
_REDUCE = "reduction over a large extent accumulates error in float16"
_NORM = "normalization statistics need float32"
_LOSS = "losses are computed in float32"
_SOFTMAX = "softmax exponentiates: float32 avoids overflow"

# Normalizations: their outputs have a spread set by their affine weights, whatever their input's.
NORMALIZATIONS: Final = frozenset({
    "layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm", "local_response_norm",
    "native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training", "_fused_rms_norm",
    "weight_norm",
})

DENY: Final[Mapping[str, str]] = MappingProxyType({
    **dict.fromkeys(
        ("exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "pow", "float_power", "reciprocal",
         "rsqrt", "sinh", "cosh", "tan", "acos", "asin", "erfinv", "softplus", "logit", "xlogy"),
        _EXP),
    **dict.fromkeys(
        ("sum", "mean", "nansum", "nanmean", "cumsum", "cumprod", "prod", "var", "std", "var_mean",
         "std_mean", "logsumexp", "logcumsumexp", "norm", "linalg_vector_norm", "vector_norm",
         "frobenius_norm", "dist", "cdist", "pdist", "renorm", "cosine_similarity", "normalize",
         "sum_to_size", "trace"),
        _REDUCE),
    **dict.fromkeys(("softmax", "log_softmax", "softmin", "_softmax", "_log_softmax",
                     "gumbel_softmax"), _SOFTMAX),
    **dict.fromkeys(NORMALIZATIONS, _NORM),
    **dict.fromkeys(
        ("cross_entropy", "nll_loss", "nll_loss_forward", "nll_loss2d", "mse_loss", "l1_loss",
         "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
         "kl_div", "poisson_nll_loss", "gaussian_nll_loss", "cosine_embedding_loss", "ctc_loss",
         "margin_ranking_loss", "hinge_embedding_loss", "multi_margin_loss", "multilabel_margin_loss",
         "multilabel_soft_margin_loss", "soft_margin_loss", "triplet_margin_loss"),
        _LOSS),
})

INFER: Final = frozenset({
    "add", "sub", "rsub", "mul", "div", "truediv", "floordiv", "true_divide", "neg", "square", "sqrt",
    "addcmul", "addcdiv", "lerp", "fma", "gelu", "silu", "mish", "tanh", "sigmoid", "hardsigmoid",
    "hardswish", "elu", "selu", "celu", "leaky_relu", "rrelu", "prelu", "glu", "logsigmoid",
    "softsign", "tanhshrink", "sin", "cos", "erf", "erfc", "atan", "atan2", "sign", "avg_pool1d",
    "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "_adaptive_avg_pool2d", "interpolate", "upsample_nearest2d", "upsample_bilinear2d",
    "pixel_shuffle", "pixel_unshuffle", "hypot",
})

# Infer ops whose result is never larger in magnitude than their input (or than a small constant):
# they cannot overflow float16 where their input did not, so the forward's overflow checks skip them.
BOUNDED: Final = frozenset({
    "gelu", "silu", "mish", "tanh", "sigmoid", "hardsigmoid", "hardswish", "elu", "celu", "leaky_relu", "rrelu",
    "glu", "logsigmoid", "softsign", "tanhshrink", "sin", "cos", "erf", "erfc", "atan", "sign", "avg_pool1d",
    "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "_adaptive_avg_pool2d", "pixel_shuffle", "pixel_unshuffle", "neg",
})

CLEAR: Final = frozenset({
    "view", "reshape", "_reshape_alias", "_unsafe_view", "flatten", "unflatten", "permute",
    "transpose", "t", "contiguous", "clone", "expand", "expand_as", "squeeze", "unsqueeze", "narrow",
    "select", "slice", "getitem", "unbind", "split", "split_with_sizes", "chunk", "tensor_split",
    "cat", "concat", "concatenate", "stack", "hstack", "vstack", "repeat", "repeat_interleave",
    "tile", "roll", "flip", "index_select", "gather", "take_along_dim", "masked_fill", "where",
    "index", "pad", "constant_pad_nd", "embedding", "relu", "relu6", "hardtanh", "threshold",
    "clamp", "clamp_min", "clamp_max", "clip", "abs", "maximum", "minimum", "max", "min", "amax",
    "amin", "max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "max_pool2d_with_indices", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "feature_alpha_dropout", "native_dropout", "detach", "alias", "zeros_like", "ones_like",
    "empty_like", "full_like", "channel_shuffle", "movedim", "swapaxes", "diagonal", "tril", "triu",
    "as_strided", "view_as", "sort", "topk",
})

# Ops that read only metadata (sizes, strides): their inputs are never cast.
META: Final = frozenset({
    "size", "sym_size", "dim", "ndimension", "numel", "sym_numel", "nelement", "stride",
    "sym_stride", "getattr", "is_floating_point", "is_contiguous", "element_size", "storage_offset",
})

# Ops whose output aliases their (first) input: a cast in between would break the alias.
VIEWS: Final = frozenset({
    "view", "reshape", "_reshape_alias", "flatten", "unflatten", "permute", "transpose", "t",
    "contiguous", "expand", "expand_as", "squeeze", "unsqueeze", "narrow", "select", "slice",
    "getitem", "unbind", "split", "split_with_sizes", "chunk", "tensor_split", "detach", "alias",
    "as_strided", "view_as", "movedim", "swapaxes", "diagonal", "rescale",
})

# ATen ops whose output holds the elements of their (first) input and no others, rearranged or
# repeated (``view`` by a shape, not by a dtype: ``reduce_at_source`` checks the dtype is kept). A
# full max over the output is a full max over the input.
REARRANGING: Final = frozenset({
    "view", "_unsafe_view", "reshape", "clone", "permute", "transpose", "t", "alias", "squeeze", "unsqueeze",
    "expand",
})

# The rearrangements among them that change the order of the elements: a reduction over their
# output loops over their input out of its memory order.
REORDERING: Final = frozenset({"permute", "transpose", "t"})

# Unary elementwise ATen ops (casts aside: ``graph_utils.cast_of``): each output element depends on
# its input element alone, so they commute with every rearrangement.
UNARY_ELEMENTWISE: Final = frozenset({"abs"})

FIXED: Final = frozenset({
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "_to_copy",
    "convert_element_type", "_to_dtype",
})

# Ops that make a tensor from sizes or Python numbers, not from a floating input: nothing to round
# and no range to leave, so there is no decision to make (every Hugging Face language model makes
# its masks and positions with some of them). Category FIXED: they keep the dtype the model gives.
CREATION: Final = frozenset({
    "tensor", "as_tensor", "scalar_tensor", "lift_fresh", "lift_fresh_copy", "zeros", "ones", "full", "empty",
    "empty_strided", "arange", "linspace", "logspace", "eye", "new_zeros", "new_ones", "new_full", "new_empty",
    "new_tensor", "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
})

# Ops that can give their weight a sparse gradient: op -> (keyword, position) of the flag that asks for
# it (``F.embedding(input, weight, ..., sparse)``). Such an op keeps its weight in float32: autograd
# cannot pass a sparse gradient back through a cast (``ToCopyBackward`` refuses the layout), and a
# gather needs no low precision to be fast. Its output is cast instead, where a reader wants it.
SPARSE_GRADIENT: Final[Mapping[str, tuple[str, int]]] = MappingProxyType({
    "embedding": ("sparse", 6), "embedding_bag": ("sparse", 7),
})

# ----------------------------------------------------------- the underflow analysis (passes/analysis/)

# Ops whose output has its (first) input's moments, and passes its gradient straight back (but for
# SLICING and REPEATING): layout ops, copies, casts, dropout, rescale points.
PASS_THROUGH: Final = frozenset({
    "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "contiguous", "clone", "expand",
    "squeeze", "unsqueeze", "unbind", "split", "chunk", "getitem", "dropout", "detach",
    "rescale", "to", "float", "half", "bfloat16", "type_as", "repeat", "roll",
    "narrow", "select", "slice", "alias", "view_as",
})

# Layout ops that take a part out of their input: its gradient is theirs on that part, zeros elsewhere.
SLICING: Final = frozenset({"getitem", "select", "narrow", "slice"})

# Layout ops that copy their input (a broadcast, a repeat): its gradient sums its copies'.
REPEATING: Final = frozenset({"expand", "expand_as", "repeat"})

# Pure functions of their arguments (nothing random, nothing in place): where every input is known
# at compile time (masks, positions, rotary tables), the analysis computes the value then.
FOLDABLE: Final = frozenset({
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

# Powers of a positive, concentrated input (a norm's mean square plus eps): op -> exponent.
POSITIVE_POWERS: Final[Mapping[str, float]] = MappingProxyType({"rsqrt": -0.5, "sqrt": 0.5, "reciprocal": -1.0})

# Where a normalization takes its affine weight, bias and eps: op -> argument indices (rms_norm has no
# bias: its index 5 is None).
NORM_ARGUMENTS: Final[Mapping[str, tuple[int, int, int]]] = MappingProxyType({
    "layer_norm": (2, 3, 4), "group_norm": (2, 3, 4), "batch_norm": (3, 4, 7), "rms_norm": (2, 5, 3),
})

_Bound = tuple[int, str, float | None]  # (argument index, keyword, default) of a bound
# Ops that clamp their input, with where their bounds are: op -> (lower bound, upper bound).
CLAMP_BOUNDS: Final[Mapping[str, tuple[_Bound, _Bound]]] = MappingProxyType({
    "hardtanh": ((1, "min_val", -1.0), (2, "max_val", 1.0)),  # (what nn.ReLU6 traces to: hardtanh(x, 0, 6))
    "clamp": ((1, "min", None), (2, "max", None)), "clip": ((1, "min", None), (2, "max", None)),
    "clamp_min": ((1, "min", None), (9, "", None)), "clamp_max": ((9, "", None), (1, "max", None)),
})

# ------------------------------------------------------------------------------- the other passes

# True divisions (not floor or rounding ones): by a number of magnitude >= 1, never larger than their input.
TRUE_DIVISIONS: Final = frozenset({"div", "truediv", "true_divide"})

# Products whose first operand's last dimension is the one contracted (softmax(s) @ v: attention written out).
LAST_DIM_PRODUCTS: Final = frozenset({"matmul", "bmm"})

# Average pools: op -> how many trailing dimensions it pools.
AVERAGE_POOLS: Final[Mapping[str, int]] = MappingProxyType({"avg_pool1d": 1, "avg_pool2d": 2, "avg_pool3d": 3})

# ATen GEMMs Inductor leaves to extern kernels: cuBLAS, not a kernel of Inductor's, writes their outputs.
EXTERN_GEMMS: Final = frozenset({"mm", "bmm", "addmm", "baddbmm"})

# ATen ops whose output is their input itself, aliased.
ALIASES: Final = frozenset({"alias", "detach"})

_BUILTIN: Final[Mapping[str, Category]] = MappingProxyType({
    **{op: Category.CLEAR for op in CLEAR},
    **{op: Category.INFER for op in INFER},
    **{op: Category.DENY for op in DENY},
    **{op: Category.ALLOW for op in ALLOW},
    **{op: Category.FIXED for op in FIXED | CREATION},
    **{op: Category.META for op in META},
})


def category_of(op: str, overrides: Mapping[str, str] | None = None) -> Category:
    """The category of op name ``op``; ``overrides`` (op -> category name) wins over the tables."""
    if overrides and op in overrides:
        return Category(overrides[op])
    return _BUILTIN.get(op, Category.UNKNOWN)


def deny_reason(op: str) -> str:
    """Why ``op`` stays float32 (for reports)."""
    return DENY.get(op, "listed as deny in Config.deny")
