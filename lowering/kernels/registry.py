"""The table of kernel families (op family -> generator). Order matters: first match wins."""
from __future__ import annotations

from torch_kernelize.lowering.kernels.base import KernelFamily
from torch_kernelize.lowering.kernels.elementwise import FAMILY as ELEMENTWISE
from torch_kernelize.lowering.kernels.histc import FAMILY as HISTC
from torch_kernelize.lowering.kernels.reductions import FAMILY as REDUCTIONS

FAMILIES: list[KernelFamily] = [ELEMENTWISE, REDUCTIONS, HISTC]
