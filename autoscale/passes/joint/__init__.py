"""The joint-stage passes: they rewrite AOTAutograd's joint forward and backward ATen graph, before
partitioning, so that the points' and checks' measurements compile to few nodes and kernels."""
