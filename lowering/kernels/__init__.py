"""Kernel generators, one module per op family; the table below maps ops to their family.

To add a family: write a module with a ``KernelFamily`` subclass (``_analyse`` a spec into a plan,
``_valid``, ``_seeds`` and ``_steps`` over configs, ``generate``: see base.py) and its interpreter
tests, then add an instance to ``registry.FAMILIES``.
"""
from __future__ import annotations

from typing import Any

from torch_kernelize.lowering.kernels.base import Config, KernelFamily
from torch_kernelize.core.program import KernelProgram, Launch, Buffer

FAMILIES: list[KernelFamily] = []


def _load_families() -> None:
    from torch_kernelize.lowering.kernels import registry
    FAMILIES.extend(registry.FAMILIES)


def families() -> list[KernelFamily]:
    if not FAMILIES:
        _load_families()
    return FAMILIES


def family_for_op(op_name: str) -> KernelFamily | None:
    for fam in families():
        if op_name in fam.ops:
            return fam
    return None


def family_for(spec: Any) -> KernelFamily | None:
    """The family that can generate ``spec`` (a KernelSpec), or None."""
    for fam in families():
        if fam.supports(spec) is None:
            return fam
    return None


__all__ = ["Config", "KernelFamily", "KernelProgram", "Launch", "Buffer", "families", "family_for",
           "family_for_op"]
