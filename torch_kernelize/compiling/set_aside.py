"""The cache as a lowering looks it up with some entries set aside: each taken as "vendor wins".

A fused region tried before the stretches of a graph (an MoE's gated experts: compiling/
glu_regions.py) keeps the nodes it holds from the stretch programs that would run them; its own
verdict compares it with the vendor running its nodes, not with the kernels its parts get
without it. fill_cache times the graph's assembly as the cache gives it and with the region set
aside here (fill_cache/region_judgment.py); a session that sets keys aside (Session.set_aside)
is one of fill_cache's, never a served model's.
"""
from __future__ import annotations

from typing import Any

from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.kernel_cache.interfaces import Lookup, Lookups

SET_ASIDE = "set aside by fill_cache's judgment of a fused region"


class SetAside:
    """``inner`` (interfaces.Lookups) answering "vendor" for the keys in ``keys``."""

    def __init__(self, inner: Lookups, keys: frozenset[str]):
        self.inner, self.keys = inner, keys
        self.witnesses = inner.witnesses  # (the executable cache keeps what every lookup saw)

    def _set_aside(self, found: Lookup, key: str) -> Lookup:
        return ("vendor", found[1], f"vendor wins for {key}: {SET_ASIDE}") if key in self.keys else found

    def lookup(self, key: str) -> Lookup:
        return self._set_aside(self.inner.lookup(key), key)

    def lookup_node(self, node: Any, spec: KernelSpec) -> Lookup:
        return self._set_aside(self.inner.lookup_node(node, spec), spec.key)

    def lookup_region(self, region: Any, spec: KernelSpec) -> Lookup:
        return self._set_aside(self.inner.lookup_region(region, spec), spec.key)
