"""Core: the vocabulary every layer shares (KernelSpec, KernelProgram, Target, shapes, numerics,
errors, options). Imports nothing else of torch_kernelize."""
