"""The table of kernel families (op family -> generator). Order matters: first match wins."""
from __future__ import annotations

from torch_kernelize.lowering.kernels.advanced_indexing import FAMILY as ADVANCED_INDEXING
from torch_kernelize.lowering.kernels.attention import FAMILY as ATTENTION
from torch_kernelize.lowering.kernels.base import KernelFamily
from torch_kernelize.lowering.kernels.conv1d import FAMILY as CONV1D
from torch_kernelize.lowering.kernels.elementwise import FAMILY as ELEMENTWISE
from torch_kernelize.lowering.kernels.fused import FAMILY as FUSED
from torch_kernelize.lowering.kernels.grouped_mm import FAMILY as GROUPED_MM
from torch_kernelize.lowering.kernels.grouped_mm_glu import FAMILY as GROUPED_MM_GLU
from torch_kernelize.lowering.kernels.histc import FAMILY as HISTC
from torch_kernelize.lowering.kernels.indexing import FAMILY as INDEXING
from torch_kernelize.lowering.kernels.layernorm import FAMILY as LAYERNORM
from torch_kernelize.lowering.kernels.matmul import FAMILY as MATMUL
from torch_kernelize.lowering.kernels.reductions import FAMILY as REDUCTIONS
from torch_kernelize.lowering.kernels.scan import FAMILY as SCAN
from torch_kernelize.lowering.kernels.sort import FAMILY as SORT
from torch_kernelize.lowering.kernels.topk import FAMILY as TOPK

FAMILIES: list[KernelFamily] = [ELEMENTWISE, REDUCTIONS, HISTC, FUSED, LAYERNORM, INDEXING, ADVANCED_INDEXING, SCAN, TOPK,
                             SORT, MATMUL, GROUPED_MM, GROUPED_MM_GLU, CONV1D, ATTENTION]
