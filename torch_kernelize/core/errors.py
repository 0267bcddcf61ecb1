"""Exceptions a user can meet. Each message says what was wrong and what to do about it."""
from __future__ import annotations

import errno

# OS errors that say the machine, not the work, is at fault: a full disk or quota, a permission
# taken away, a read-only filesystem. fill_cache stops on them (exit 4) instead of blaming a candidate.
MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})


def machine_error(e: BaseException) -> bool:
    """Whether ``e`` is an OSError of MACHINE_ERRNOS."""
    return isinstance(e, OSError) and e.errno in MACHINE_ERRNOS


class KernelizeError(Exception):
    """Base class of every error torch_kernelize raises on purpose."""


class IndexOutOfRange(KernelizeError, IndexError):
    """A kernel's inputs hold an index outside the dim it indexes: the IndexError eager raises.
    The kernel never reads or writes out of bounds (no device assert, which would leave a CUDA
    context unusable); it sets a flag that its program's ``checks`` turn into this error."""


class OptionsError(KernelizeError, ValueError):
    """An option given to the backend (or through the environment) is unknown or malformed."""


class TargetError(KernelizeError, ValueError):
    """A target name or target description file is unknown or malformed."""


class MissingOpsError(KernelizeError):
    """Strict mode: some ATen ops can run nowhere on the target.

    ``missing`` maps each op name to the repro folder written for it (``None`` when dumping is off).
    """

    def __init__(self, target: str, missing: dict[str, str | None], fill_hint: str | None = None):
        self.target = target
        self.missing = dict(missing)
        lines = [
            f"strict mode: {len(missing)} ATen op(s) have no implementation on target {target!r} "
            "(no vendor kernel, no decomposition, no cached Triton kernel):"
        ]
        for op, folder in sorted(missing.items()):
            lines.append(f"  {op:<40} repro: {folder or '(repro dumping is off)'}")
        lines.append(
            f"Add a kernel ({fill_hint or 'python -m torch_kernelize.fill_cache --repros <repro_dir>'}), mark the op "
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
