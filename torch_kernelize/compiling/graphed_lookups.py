"""The cache as a graph served under CUDA graphs (option ``cudagraphs``) looks it up.

A node whose op, run as given, reads the device on the host (a sync: serving/graph_split.py;
transformers' MoE expert matmul reads its offsets with ``tolist()``) cuts the captured graph there:
the host waits for the work queued before it, then issues the op's own, and the stretch after it is
replayed on copies of what the op made. A kernel that keeps the op on the device saves all of that,
which the plain race (each timed alone) does not see. fill_cache runs that spec's race again, timed
as a captured graph serves it (fill_cache/benchmark.queued_ms; the op as given with its outputs'
copies, benchmark.with_split_copies), under the spec's GRAPHED key; this
module looks that key up first for such nodes, and the node's own lookup where it has no entry.
"""
from __future__ import annotations

from typing import Any

import torch

from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.kernel_cache.interfaces import Lookup, Lookups
from torch_kernelize.serving.graph_split import sync_reason


class GraphedLookups:
    """``inner`` (interfaces.Lookups) with the GRAPHED key first for a node that syncs on ``device``."""

    def __init__(self, inner: Lookups, device: torch.device):
        self.inner, self.device = inner, device
        self.witnesses = inner.witnesses  # (the executable cache keeps what every lookup saw)

    def lookup(self, key: str) -> Lookup:
        return self.inner.lookup(key)

    def lookup_node(self, node: Any, spec: KernelSpec) -> Lookup:
        if sync_reason(node, self.device) is not None:
            found = self.inner.lookup(spec.graphed().key)
            if found[0] in ("hit", "vendor"):
                return found
        return self.inner.lookup_node(node, spec)

    def lookup_region(self, region: Any, spec: KernelSpec) -> Lookup:
        return self.inner.lookup_region(region, spec)
