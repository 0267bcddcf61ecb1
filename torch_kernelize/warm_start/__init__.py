"""Warm start: what makes a process's first call fast. The graph and executable caches and the
prewarm of a model's kernels."""
