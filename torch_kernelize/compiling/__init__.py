"""Compiling: from an ATen graph to a lowered graph. The planner with the tier ladder, regions,
decompositions and the coverage report."""
