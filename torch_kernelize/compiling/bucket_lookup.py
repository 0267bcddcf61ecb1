"""Serving shape buckets: a node of a dynamic graph runs the kernel of the filled bucket that
holds its concrete sizes when no exact-shape entry exists (an exact entry always wins).

Which dims of a node vary is read off its symbolic metadata once: each tensor dim whose size is
a size symbol, or a product of size symbols and a positive integer (``8*s0``: a [batch, seq]
input flattened into the rows of a GEMM), is a variable, one per distinct size (numbered by first
appearance); a node with any other symbolic size or argument (``s0 - 1``, a SymInt argument) is
not bucketed. A graph's ``GraphBuckets`` lists the cache once, when the graph is planned, and
loads every bucket entry of its nodes then; a new shape later is answered from memory: an exact
key absent from the listing is a miss without a look at the disk, and a bucket hit needs only its
launch sizes computed (``bucket_runner``).
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.whole_graph import size_symbols, whole_probe_keys
from torch_kernelize.core.buckets import (PREFIX_LEN, Bucket, Dim, contains, instantiate, key_prefix, probe_prefix,
                                          unbucketable, values_of)
from torch_kernelize.core.spec import KernelSpec, tensor_input_nodes
from torch_kernelize.kernel_cache.entry import CacheEntry
from torch_kernelize.kernel_cache.interfaces import Cache, Lookup
from torch_kernelize.kernel_cache.store import LookupLog


def _size_expr(v: Any) -> Any:
    return v.node.expr if isinstance(v, torch.SymInt) else v


def _is_product(e: Any) -> bool:
    """Whether ``e`` is a size symbol or a product of them and a positive integer: a size that
    grows with each of its symbols (so a range of them maps to a range of it)."""
    if isinstance(e, sympy.Symbol):
        return True
    return isinstance(e, sympy.Mul) and all(
        isinstance(f, sympy.Symbol) or (isinstance(f, sympy.Integer) and f > 0) for f in e.args)


def bucket_dims(node: fx.Node) -> tuple[Dim, ...] | None:
    """The variable dims of ``node``'s spec (its tensor inputs in spec order, then its outputs);
    None when none varies or a size or argument is another symbolic expression."""
    found = bucket_sizes(node)
    return found[0] if found is not None else None


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _symbolic_argument(node: fx.Node) -> bool:
    flat, _ = pytree.tree_flatten((list(node.args), dict(node.kwargs)))
    return any(isinstance(a.meta.get("val") if isinstance(a, fx.Node) else a, _SYMBOLIC) for a in flat)


def bucket_sizes(node: fx.Node) -> tuple[tuple[Dim, ...], tuple[Any, ...]] | None:
    """``bucket_dims(node)`` and each variable's size as a sympy expression of the size symbols."""
    if _symbolic_argument(node):
        return None
    out = node.meta.get("val")
    outs = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [("in", i, n.meta.get("val")) for i, n in enumerate(tensor_input_nodes(node))]
    tensors += [("out", i, t) for i, t in enumerate(o for o in outs if o is not None)]
    return _variable_dims(tensors)


def region_bucket_sizes(region: Any) -> tuple[tuple[Dim, ...], tuple[Any, ...]] | None:
    """The variable dims of a fused region's spec (its inputs, outputs and the values of its graph's
    nodes, ``"node"``) and each variable's size; None where a size is another expression, a node
    reads a symbolic scalar (a view's computed sizes), or a tuple-valued node's pieces vary (the
    graph keeps their sizes in one list, which a bucket does not abstract)."""
    tensors = [("in", i, n.meta.get("val")) for i, n in enumerate(region.inputs)]
    tensors += [("out", i, n.meta.get("val")) for i, n in enumerate(region.outputs)]
    for j, n in enumerate(region.nodes):
        val = n.meta.get("val")
        if _symbolic_argument(n) or isinstance(val, _SYMBOLIC):
            return None
        if isinstance(val, (tuple, list)):
            if any(isinstance(v, torch.Tensor) and not all(isinstance(_size_expr(x), (int, sympy.Integer)) for x in v.shape)
                   for v in val):
                return None
            continue
        tensors.append(("node", j, val))
    return _variable_dims(tensors)


def _variable_dims(tensors: list[tuple[str, int, Any]]) -> tuple[tuple[Dim, ...], tuple[Any, ...]] | None:
    var_of: dict[Any, int] = {}
    dims = []
    for side, i, t in tensors:
        if not isinstance(t, torch.Tensor):
            return None
        for d, size in enumerate(t.shape):
            e = _size_expr(size)
            if isinstance(e, (int, sympy.Integer)):
                continue
            if not _is_product(e):
                return None
            dims.append((side, i, d, var_of.setdefault(e, len(var_of))))
    return (tuple(dims), tuple(var_of)) if dims else None


class GraphBuckets:
    """One dynamic graph's view of the cache's buckets: the cache's keys as listed when the graph
    was planned, each node's variable dims, and the bucket entries of each abstract spec."""

    def __init__(self, cache: Cache, load_runner: Callable[[KernelSpec, CacheEntry], Any],
                 wholes: Sequence[Any] = ()):
        """``wholes``: the graph whole over each of its sizes (whole_graph.DynamicWhole)."""
        self.cache = cache
        self.wholes = list(wholes)
        self._probes: dict[tuple, str | None] = {}  # (whole, the other sizes) -> its buckets' key prefix
        try:
            self.keys = frozenset(cache.keys())
        except OSError:  # an unreadable cache: every lookup misses (the session has warned once)
            self.keys = frozenset()
        self._by_prefix: dict[str, list[str]] = {}  # every key by its first PREFIX_LEN digits
        for key in sorted(self.keys):
            self._by_prefix.setdefault(key[:PREFIX_LEN], []).append(key)
        self._load_runner = load_runner
        self._dims: dict[str, tuple[Dim, ...] | None] = {}   # node name -> its variable dims
        self._prefixes: dict[tuple, str] = {}
        self._buckets: dict[str, list[tuple[Any, Any]]] = {}  # key prefix -> [(Bucket, CacheEntry)]
        self.miss_dims: dict[str, tuple[Dim, ...]] = {}  # a bucketable miss's spec key -> its dims (its repro's)
        self._entries: list[Any] | None = None
        self._lock = threading.Lock()

    def dims(self, node: fx.Node) -> tuple[Dim, ...] | None:
        if node.name not in self._dims:
            self._dims[node.name] = bucket_dims(node)
        return self._dims[node.name]

    def region_dims(self, region: Any) -> tuple[Dim, ...] | None:
        name = region_name(region)
        if name not in self._dims:
            found = region_bucket_sizes(region)
            self._dims[name] = found[0] if found is not None else None
        return self._dims[name]

    def prefix(self, name: str, spec: KernelSpec, dims: tuple[Dim, ...], sub: tuple[Dim, ...]) -> str:
        """``key_prefix(spec, sub)``, hashed once per node (or region: ``name``) and sizes of the
        dims ``sub`` leaves fixed (what else it hashes is the same for every shape of the node)."""
        fixed = {(s, i, d) for s, i, d, _ in dims} - {(s, i, d) for s, i, d, _ in sub}
        sizes = tuple(values_of(spec, [(s, i, d, k) for k, (s, i, d) in enumerate(sorted(fixed))]))
        memo = (name, sub, sizes)
        found = self._prefixes.get(memo)
        if found is None:
            found = self._prefixes[memo] = key_prefix(spec, sub)
        return found

    def buckets(self, prefix: str) -> list[tuple[Any, Any]]:
        """Every valid bucket entry whose key starts with ``prefix`` (read once per graph, with
        their kernels loaded)."""
        with self._lock:
            found = self._buckets.get(prefix)
            if found is None:
                found = []
                for key in self._by_prefix.get(prefix, ()):
                    entry = self.cache.get(key)
                    bucket = entry.bucket if entry is not None else None
                    if bucket is None:
                        continue
                    if entry.winner == "triton":
                        self._load_runner(entry.spec, entry)  # loaded now, not on a later call's path
                    found.append((bucket, entry))
                self._buckets[prefix] = found
            return found

    def entries(self) -> list[CacheEntry]:
        """Every valid entry of the listing (read once per graph: shape_classes.py partitions the
        graph's shapes by them)."""
        with self._lock:
            if self._entries is None:
                self._entries = [e for e in map(self.cache.get, sorted(self.keys)) if e is not None]
            return self._entries

    def lookups(self, log: LookupLog, bindings: dict | None = None) -> "BucketLookup":
        return BucketLookup(self, log, bindings or {})

    def whole_prefix(self, whole: Any, bindings: dict) -> str | None:
        """The key prefix of ``whole``'s buckets with its other sizes as ``bindings`` give them
        (written once per such sizes: two canonical forms of the graph)."""
        others = tuple(sorted((str(s), bindings[s]) for s in size_symbols(whole) if s in bindings))
        memo = (id(whole), others)
        with self._lock:
            if memo not in self._probes:
                probes, scale = whole_probe_keys(whole, bindings), whole.scale(bindings)
                found = probes is not None and scale is not None
                self._probes[memo] = probe_prefix(probes, whole.dims, scale) if found else None
            return self._probes[memo]


class BucketLookup:
    """The lookups of one specialization (kernel_cache.interfaces.Lookups; ``log`` keeps their
    witnesses): exact keys first, in the listing; then, for a node or a region, the bucket that
    holds its sizes."""

    def __init__(self, graph: GraphBuckets, log: LookupLog, bindings: dict):
        self.graph = graph
        self.log = log
        self.bindings = bindings  # the specialization's sizes (a dynamic whole's prefix needs its other sizes)
        self.witnesses = log.witnesses

    def lookup(self, key: str) -> Lookup:
        if key not in self.graph.keys:
            self.witnesses[key] = {"absent": True}
            return "miss", None, f"no cache entry for key {key} (listing of {self.graph.cache.dir} when planned)"
        return self.log.lookup(key)

    def lookup_node(self, node: fx.Node, spec: KernelSpec) -> Lookup:
        return self._lookup(node.name, spec, self.graph.dims(node))

    def lookup_region(self, region: Any, spec: KernelSpec) -> Lookup:
        """A fused region's: its exact key, then the bucket of its family that holds its sizes;
        the graph whole over one size: its exact key, then the bucket of that size that holds it."""
        wholes = [w for w in self.graph.wholes if w.region is region]
        if wholes:
            return self._lookup_whole(wholes, spec)
        return self._lookup(region_name(region), spec, self.graph.region_dims(region))

    def _lookup_whole(self, wholes: list[Any], spec: KernelSpec) -> Lookup:
        """Its exact key, then the buckets of each of its sizes (the length's, the batch's) that
        hold it."""
        exact = self.lookup(spec.key)
        if exact[0] != "miss":
            return exact
        for whole in wholes:
            prefix = self.graph.whole_prefix(whole, self.bindings)
            if prefix is None or whole.symbol not in self.bindings:
                continue
            values = (int(self.bindings[whole.symbol]),)
            for bucket, entry in self.graph.buckets(prefix):
                if bucket.dims == whole.dims and contains(bucket.ranges, values):
                    status = "hit" if entry.winner == "triton" else "vendor"
                    where = " x ".join(f"{lo}-{hi}" for lo, hi in bucket.ranges)
                    return status, entry, f"graph bucket {entry.key} ({whole.symbol} {where}) of {entry.family or 'own assembly'}"
        return exact

    def _lookup(self, name: str, spec: KernelSpec, dims: tuple[Dim, ...] | None) -> Lookup:
        exact = self.lookup(spec.key)
        if dims is None or unbucketable(spec, dims) is not None:
            return exact
        found = [(sub, self.graph.buckets(self.graph.prefix(name, spec, dims, sub))) for sub in subsets(dims)]
        if exact[0] != "miss":
            return exact
        for sub, buckets in found:
            values = values_of(spec, sub)
            for bucket, entry in buckets:
                if bucket.dims == sub and contains(bucket.ranges, values):
                    status = "hit" if entry.winner == "triton" else "vendor"
                    where = " x ".join(f"{lo}-{hi}" for lo, hi in bucket.ranges)
                    return status, entry, f"bucket {entry.key} (sizes {where}) of {entry.family or 'vendor'}"
        self.graph.miss_dims[spec.key] = dims
        return exact


def region_name(region: Any) -> str:
    """What a region's memos are keyed by: its kind and first node (regions of one kind do not overlap)."""
    return f"region:{region.kind}:{region.nodes[0].name}"


def subsets(dims: tuple[Dim, ...]) -> list[tuple[Dim, ...]]:
    """``dims`` restricted to each non-empty subset of its variables (renumbered), most variables
    first: a bucket filled with the batch varying serves a graph whose hidden size is symbolic
    too (``dynamic=True`` makes every dim a symbol), at the hidden size it was filled for."""
    names = sorted({v for *_, v in dims})
    out = []
    for r in range(len(names), 0, -1):
        for keep in itertools.combinations(names, r):
            out.append(tuple((s, i, d, keep.index(v)) for s, i, d, v in dims if v in keep))
    return out


def bucket_runner(spec: KernelSpec, dims: tuple[Dim, ...], base: Any, scale: int = 1) -> Any:
    """The runner of ``spec`` from its bucket's loaded runner ``base`` (launch.ProgramRunner): the
    same kernels, with the launch sizes of ``spec``'s sizes (``scale``: the bucket's, what its dims
    hold per unit of the variable, core/buckets.Bucket). No disk access, no compilation."""
    values = Bucket(tuple(dims), (), scale=scale).values(spec)
    if values is None:
        raise ValueError(f"{spec.describe()}: a bucket dim is no multiple of the bucket's scale {scale}")
    return base.for_spec(spec, instantiate(base.program, values))
