"""autoscale's graph passes, one per module, and the pipeline that orders them.

Installed as ``autoscale.passes``. Each pass is ``verb_noun(gm, cfg) -> PassResult`` and rewrites
``gm`` in place; ``run_stage`` (the pass manager) runs them and checks the invariants listed in
README.md beside this file.
"""

from __future__ import annotations

from .analyze_underflow import analyze_underflow
from .batch_records import batch_records
from .batch_row_reads import batch_row_reads
from .convert_precision import convert_precision
from .emulate_compute import emulate_compute
from .fold_casts import fold_casts
from .insert_fake_quant import insert_fake_quant
from .insert_grad_scaling import insert_grad_scaling
from .insert_overflow_checks import insert_overflow_checks
from .lay_out_partials import lay_out_partials
from .manager import InvariantError, PassRecord, PassResult, PassSpec, Stage, run_stage
from .predict_overflow import predict_overflow
from .reduce_at_source import reduce_at_source
from .remove_inplace import remove_inplace
from .rewrite_avg_pool import rewrite_avg_pool

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
    "convert_precision",
    "emulate_compute",
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
    PassSpec(rewrite_avg_pool, "dynamo"),  # before the analysis and painting: they see the mean
    PassSpec(predict_overflow, "dynamo"),  # before painting: which values float16 cannot hold
    PassSpec(convert_precision, "dynamo"),
    PassSpec(analyze_underflow, "dynamo"),
    PassSpec(insert_grad_scaling, "dynamo"),
    PassSpec(insert_fake_quant, "dynamo"),  # after the scale points: gradients are scaled, then rounded
    PassSpec(fold_casts, "dynamo"),
    PassSpec(emulate_compute, "dynamo"),  # the passes above see each op itself
    PassSpec(insert_overflow_checks, "dynamo"),  # last: no other pass sees the checks as users of a value
    # AOTAutograd's joint forward+backward ATen graph, before partitioning.
    PassSpec(fold_casts, "joint"),
    PassSpec(reduce_at_source, "joint"),  # the points' and checks' maxima read their sources in order
    PassSpec(batch_records, "joint"),  # one fold of the rescale points' statistics per graph
    PassSpec(batch_row_reads, "joint"),  # each set of rows' scale computed once, in the graph
    # (after the fold: a partial reduction read from a GEMM's copy moves after that GEMM)
    PassSpec(lay_out_partials, "joint"),  # a GPU's partial results read as Inductor will lay their values out
)
"""The pipeline, in order."""
