"""autoscale's graph passes, one per module, and the pipeline that orders them.

Each pass is ``verb_noun(gm, cfg) -> PassResult`` and rewrites ``gm`` in place; ``run_stage`` (the
pass manager, ``manager.py``) runs them and checks the invariants listed in README.md beside this
file. The folders are the layers: ``dynamo/`` (Dynamo's torch-level graph), ``joint/``
(AOTAutograd's joint graph) and ``analysis/`` (the underflow analysis: its pass and its per-op
rules); beside them the manager, the op tables, the graph helpers, and ``fold_casts``, which runs
in both stages.
"""

from __future__ import annotations

from .analysis.analyze_underflow import analyze_underflow
from .dynamo.convert_precision import convert_precision
from .dynamo.emulate_compute import emulate_compute
from .dynamo.insert_fake_quant import insert_fake_quant
from .dynamo.insert_grad_scaling import insert_grad_scaling
from .dynamo.insert_overflow_checks import insert_overflow_checks
from .dynamo.predict_overflow import predict_overflow
from .dynamo.remove_inplace import remove_inplace
from .dynamo.rewrite_avg_pool import rewrite_avg_pool
from .fold_casts import fold_casts
from .joint.batch_records import batch_records
from .joint.batch_row_reads import batch_row_reads
from .joint.expand_points import expand_points
from .joint.lay_out_partials import lay_out_partials
from .joint.reduce_at_source import reduce_at_source
from .manager import InvariantError, PassRecord, PassResult, PassSpec, Stage, check_order, run_stage

__all__ = [
    "PIPELINE",
    "InvariantError",
    "PassRecord",
    "PassResult",
    "PassSpec",
    "analyze_underflow",
    "batch_records",
    "batch_row_reads",
    "Stage",
    "check_order",
    "convert_precision",
    "emulate_compute",
    "expand_points",
    "fold_casts",
    "insert_fake_quant",
    "insert_grad_scaling",
    "insert_overflow_checks",
    "lay_out_partials",
    "predict_overflow",
    "reduce_at_source",
    "remove_inplace",
    "rewrite_avg_pool",
    "run_stage",
]

PIPELINE: tuple[PassSpec, ...] = (
    # Dynamo's torch-level graph, before autograd: what is computed in which dtype.
    PassSpec(remove_inplace, "dynamo"),
    # (the analysis and the painting see the mean a pool is rewritten to)
    PassSpec(rewrite_avg_pool, "dynamo"),
    # (which values float16 cannot hold, before the painting keeps them in float32)
    PassSpec(predict_overflow, "dynamo", after=("rewrite_avg_pool",)),
    PassSpec(convert_precision, "dynamo", after=("rewrite_avg_pool", "predict_overflow")),
    # (the analysis follows values through the dtypes the painting chose)
    PassSpec(analyze_underflow, "dynamo", after=("rewrite_avg_pool", "convert_precision")),
    # (the points are seeded with the analysis' scales and moments)
    PassSpec(insert_grad_scaling, "dynamo", after=("analyze_underflow",)),
    # (gradients are scaled, then rounded)
    PassSpec(insert_fake_quant, "dynamo", after=("insert_grad_scaling",)),
    PassSpec(fold_casts, "dynamo", after=("convert_precision",)),
    # (the passes before see each op itself, not its emulation)
    PassSpec(emulate_compute, "dynamo", after=("convert_precision", "analyze_underflow", "insert_grad_scaling",
                                               "insert_fake_quant", "fold_casts")),
    # (no other pass sees the checks as users of the values they watch)
    PassSpec(insert_overflow_checks, "dynamo", last=True),
    # AOTAutograd's joint forward+backward ATen graph, before partitioning.
    # (the points' backward as the ops it computes, which the trace took as one op each)
    PassSpec(expand_points, "joint"),
    PassSpec(fold_casts, "joint", after=("expand_points",)),
    # (the points' and checks' maxima read their sources in memory order)
    PassSpec(reduce_at_source, "joint", after=("expand_points",)),
    # (one fold of the rescale points' statistics per graph)
    PassSpec(batch_records, "joint", after=("expand_points",)),
    # (each set of rows' scale computed once, in the graph; after the fold, which reads a point's
    # scale from its own read)
    PassSpec(batch_row_reads, "joint", after=("batch_records",)),
    # (a GPU's partial results read as Inductor will lay their values out; after the fold, since a
    # partial reduction read from a GEMM's copy moves after that GEMM)
    PassSpec(lay_out_partials, "joint", after=("batch_records", "batch_row_reads"), last=True),
)
"""The pipeline, in order; ``check_order`` checks the order each pass declares."""

check_order(PIPELINE)
