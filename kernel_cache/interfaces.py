"""The kernel cache as the layers above the store see it: named interfaces, so that the planner,
the fill driver and the tools say what they ask of a cache instead of taking ``Any``.

``Lookups`` is what the planner asks while it plans one shape signature: a spec's status by key,
by node and by fused region. A plain cache (KernelCache, LookupLog) answers a node or a region by
its spec's key; a dynamic graph's lookups (compiling/bucket_lookup.BucketLookup) also find the
shape bucket that holds its sizes. The planner calls the three alike and never asks which it has.

``Cache`` is what fill_cache, the verifier and the ledger read and write (KernelCache is one).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager, Mapping, Protocol

from torch_kernelize.core.spec import KernelSpec

from .entry import CacheEntry

# (status, entry, reason): status "hit", "vendor", "miss" or "invalid" (KernelCache.lookup)
Lookup = tuple[str, CacheEntry | None, str]


class Lookups(Protocol):
    """What the planner asks of the cache for one shape signature."""

    def lookup(self, key: str) -> Lookup:
        """The entry stored under ``key`` exactly."""

    def lookup_node(self, node: Any, spec: KernelSpec) -> Lookup:
        """The entry that serves ``node`` (an fx.Node) at ``spec``'s sizes: its exact key's, or a
        shape bucket's holding those sizes where the lookups know buckets."""

    def lookup_region(self, region: Any, spec: KernelSpec) -> Lookup:
        """The same for a fused region (compiling/regions.Region)."""


class Cache(Protocol):
    """The cache of one target namespace, as fill_cache and the tools read and fill it."""

    dir: Path   # this namespace's folder: root / namespace
    root: Path  # the folder of every namespace, as a session's cache_dir names it

    def lookup(self, key: str) -> Lookup: ...

    def get(self, key: str) -> CacheEntry | None: ...

    def keys(self) -> list[str]: ...

    def lock(self, key: str) -> ContextManager[Any]:
        """The per-key lock a search holds (``acquire(timeout=0)`` tries it without waiting)."""

    def journal_path(self, key: str) -> Path: ...

    def put(self, record: Mapping[str, Any], program_dir: Path | str | None = None,
            replace: bool = False) -> CacheEntry: ...
