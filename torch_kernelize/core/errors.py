"""Exceptions a user can meet. Each message says what was wrong and what to do about it."""
from __future__ import annotations


class KernelizeError(Exception):
    """Base class of every error torch_kernelize raises on purpose."""


class OptionsError(KernelizeError, ValueError):
    """An option given to the backend (or through the environment) is unknown or malformed."""


class TargetError(KernelizeError, ValueError):
    """A target name or target description file is unknown or malformed."""


class MissingOpsError(KernelizeError):
    """Strict mode: some ATen ops can run nowhere on the target.

    ``missing`` maps each op name to the repro folder written for it (``None`` when dumping is off).
    """

    def __init__(self, target: str, missing: dict[str, str | None]):
        self.target = target
        self.missing = dict(missing)
        lines = [
            f"strict mode: {len(missing)} ATen op(s) have no implementation on target {target!r} "
            "(no vendor kernel, no decomposition, no cached Triton kernel):"
        ]
        for op, folder in sorted(missing.items()):
            lines.append(f"  {op:<40} repro: {folder or '(repro dumping is off)'}")
        lines.append(
            "Add a kernel (python -m torch_kernelize.fill_cache --repros <repro_dir>), mark the op "
            "supported in the target file, or drop `strict` to run these ops on the host fallback."
        )
        super().__init__("\n".join(lines))


class CacheError(KernelizeError):
    """The kernel cache cannot be used (bad directory, bad archive, failed verification)."""


class LoweringError(KernelizeError):
    """kernelize failed to lower a graph (a bug on our side); the message names the repro folder."""


class InputRejected(KernelizeError):
    """The op's own reference rejects a trial's inputs: the harness cannot check a candidate on
    them (the op needs a rule in core/input_domains.py)."""
