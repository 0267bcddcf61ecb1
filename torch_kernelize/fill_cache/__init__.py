"""Offline kernel generation: ``python -m torch_kernelize.fill_cache``.

For each KernelSpec a model needs (or a reproducer recorded), generate candidates from the
kernel families' templates, search their configurations, validate each against a float64 CPU
reference, benchmark it against the vendor kernel, and store the winner in the kernel cache.
Layout follows the builder/runner/search/storage split: measure.py (build + run + validate +
time), search.py (the policy), journal.py (the checkpoint), kernel_cache (storage).
"""
