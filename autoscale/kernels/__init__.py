"""Fused kernels. Importing this package imports triton: ``import autoscale`` never does."""
