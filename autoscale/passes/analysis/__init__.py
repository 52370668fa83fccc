"""The underflow analysis' model of a graph: ``Moments`` (mean, mean square, max |x|) for every
value, propagated forward from the real inputs and parameters, and for every gradient, propagated
backward from the loss, by per-op rules. The pass that runs it is ``analyze_underflow``.

Layers, each importing only those above it:

* ``nodes``, ``moments``: sizes, and the arithmetic of moments;
* ``registry``: the rule tables and their decorators;
* ``constants``, ``taps``: what is known exactly at compile time (masks, positions), and where a
  convolution's kernel lands;
* the rules, one module per op family (``gemm``, ``attention``, ``normalization``, ``elementwise``,
  ``pooling``, ``shape``, ``losses``);
* ``seeding``: the moments of the real example inputs, or of one measured float32 step.

To add an op, write its forward rule, ``(node, values) -> Moments | None``, and its backward rule,
``(node, grad, values) -> {input: Moments | None}``, side by side in its family's module, each
registered by ``@forward("op")`` / ``@backward("op")`` right above it. An op with neither is
unknown (its value and its inputs' gradients), never a crash. Two kinds of op need no rule of their
own: one whose moments pass through unchanged (a layout op) goes in ``op_tables.PASS_THROUGH``, a
unary elementwise function of a Gaussian input in ``elementwise._UNARY``.
"""

from __future__ import annotations

# (imported for their registrations: each rule module fills the registry when it is imported)
from . import attention, elementwise, gemm, losses, normalization, pooling, shape  # noqa: F401
