"""The table of kernel families (op family -> generator). Order matters: first match wins."""
from __future__ import annotations

from torch_kernelize.lowering.kernels.base import KernelFamily

FAMILIES: list[KernelFamily] = []
