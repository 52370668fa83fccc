"""Numerics evidence: per-layer underflow, accuracy and skipped steps of autoscale against the usual
float16 recipes, side by side on small CPU tasks.

    python -m benchmarks.numerics [--quick] [--seeds N] [--tasks ...] [--methods ...]   # or: make bench-numerics

writes docs/results/numerics.md and its plots (docs/results/numerics/*.png) and ends with one line:
``numerics: adaptive max layer underflow X.Xe-0Y, accuracy gap to fp32 Z.ZZ pts, skipped N``.

Modules: ``tasks`` (data, models, the stress variants and why), ``methods`` (what is compared),
``train`` (one run and what it measures), ``report`` (tables, targets, plots).
"""
