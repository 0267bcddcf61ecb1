"""The bottleneck ledger: the served model's kernels ranked by time against the chip's floor,
the worst turned into performance reproducers (python -m torch_kernelize.bottlenecks)."""
