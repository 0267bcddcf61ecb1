"""Shape classes: which concrete shapes of a dynamic graph share one specialization.

A dynamic graph is specialised per concrete shape signature (the values of its size symbols), and
planning one (specs, lookups, regions, binding, code generation) takes tens of milliseconds, while
a server sees a new signature on almost every request. Two signatures get the same decisions when
every kernel-eligible node and region finds the same cache entry at both (or none at both); then
one bound graph serves both: vendor ops take their sizes from their inputs at run time, a bucket's
kernel reads its sizes off its inputs (serving/bucket_call.py), and view folding leaves symbolic
layouts alone.

The class of a signature is read off a partition of the values of its *coordinates*: each size
symbol, and each product of them that is a size (under ``dynamic=True`` a GEMM's rows are
``batch*seq``: its buckets bound the product, not either symbol). The partition is made once per
graph from the cache listing it is planned against (``shape_classes``):

- an exact entry of a node or region, at the sizes it was made for, isolates those sizes (a cell
  of one value in each of its sizes);
- a bucket entry cuts its variables' sizes at its edges and isolates the sizes it holds fixed;
- a node or region with an entry whose sizes cannot be read back onto the graph's symbols pins
  its symbols (every value a class of its own);
- a whole-graph bucket (the graph filled whole over one size: whole_graph.DynamicWhole) cuts that
  size at its edges and isolates the other sizes it was filled at; lower.py plans its classes
  when the graph is compiled (``whole_buckets``).

An entry whose sizes are read back imperfectly (a product's symbols that nothing else fixes are
guessed, all but one set to 1) may fail to isolate its point; that signature is then served by
its class's bucket kernels instead of the exact one: slower, never wrong.

When misses are recorded, a class also holds each symbol's default recording bucket (pow2), so
each recording bucket is planned, and its misses recorded, once.

A specialization is shared over its class only if ``ShapeClasses.admits`` it: every kernel it
binds is valid over the whole cell (an exact kernel's and a host fallback's symbols in a cell of
one value; a bucket kernel's cell inside its bucket). Otherwise it serves its own signature. So a
partition that is too coarse costs planning time, never a wrong kernel; one that is too fine only
plans more often.
"""
from __future__ import annotations

import bisect
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.planner import build_spec
from torch_kernelize.compiling.regions import Region, region_spec
from torch_kernelize.core.buckets import PREFIX_LEN, Range, key_prefix, pow2_bucket, probe_prefix
from torch_kernelize.core.region_graph import GETITEM, spec_ops
from torch_kernelize.core.spec import tensor_input_nodes
from torch_kernelize.core.targets import op_name
from torch_kernelize.compiling.whole_graph import whole_probe_keys


def _expr(v: Any) -> Any:
    return v.node.expr if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) else v


def _value_symbols(v: Any) -> set[sympy.Symbol]:
    """The size symbols a traced value (a tensor's sizes, strides and offset; a SymInt) depends on."""
    found: set[sympy.Symbol] = set()
    for leaf in pytree.tree_leaves(v):
        if isinstance(leaf, torch.Tensor):
            try:
                parts = (*leaf.shape, *leaf.stride(), leaf.storage_offset())
            except Exception:  # a sparse or opaque tensor: its sizes only
                parts = tuple(leaf.shape)
            for p in parts:
                found |= _value_symbols(p)
        elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            found |= set(_expr(leaf).free_symbols)
    return found


def node_symbols(node: fx.Node) -> set[sympy.Symbol]:
    """The size symbols a node's spec depends on: of its output and of every value it reads."""
    found = _value_symbols(node.meta.get("val"))
    for a in node.all_input_nodes:
        found |= _value_symbols(a.meta.get("val"))
    return found


def region_symbols(region: Region) -> set[sympy.Symbol]:
    """The size symbols a region's spec depends on (its nodes' read their inputs too)."""
    found: set[sympy.Symbol] = set()
    for n in region.nodes:
        found |= node_symbols(n)
    return found


def node_tensors(node: fx.Node) -> tuple[list[Any], list[Any]]:
    """A node's traced tensors in its spec's order: (the tensor inputs, the outputs)."""
    out = node.meta.get("val")
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [n.meta.get("val") for n in tensor_input_nodes(node)], [o for o in outs if o is not None]


def product_factors(e: Any) -> tuple[int, tuple[sympy.Symbol, ...]] | None:
    """``(c, symbols)`` for a size ``c * s0 * s1 ...`` (a bare symbol; ``8*s0``: a [batch, seq]
    input flattened into a GEMM's rows; ``s0*s1``); None for any other expression."""
    if isinstance(e, sympy.Symbol):
        return 1, (e,)
    if isinstance(e, sympy.Mul):
        c, syms = 1, []
        for f in e.args:
            if isinstance(f, sympy.Integer) and f > 0:
                c *= int(f)
            elif isinstance(f, sympy.Symbol):
                syms.append(f)
            else:
                return None
        return (c, tuple(sorted(syms, key=str))) if syms else None
    return None


def read_sizes(traced: Sequence[Any], metas: Sequence[Any]) -> tuple[dict, dict] | None:
    """Where the traced tensors ``traced`` are the concrete ``metas`` (TensorMetas, the same
    tensors): (a value of each size symbol that gives them those sizes, the value of each symbolic
    size); None where they cannot be the same tensors (another rank, a static size that differs, a
    size that no symbols' values give). A product's symbols that no other dim fixes are solved
    last, all but one set to 1: the sizes, and so the spec, depend only on their product."""
    if len(traced) != len(metas):
        return None
    sizes: dict[Any, int] = {}
    for t, m in zip(traced, metas):
        if not isinstance(t, torch.Tensor) or len(t.shape) != len(m.shape):
            return None
        for size, want in zip(t.shape, m.shape):
            e = _expr(size)
            if isinstance(e, (int, sympy.Integer)):
                if int(e) != want:
                    return None
            elif sizes.setdefault(e, want) != want:
                return None
    found: dict[sympy.Symbol, int] = {}
    pending = []
    for e, want in sizes.items():
        factors = product_factors(e)
        if factors is not None:
            pending.append((factors, want))
    for relax in (False, True):
        progress = True
        while progress and pending:
            progress, left = False, []
            for (c, syms), want in pending:
                free = [x for x in syms if x not in found]
                if len(free) > 1 and relax:
                    for x in free[:-1]:
                        found[x] = 1
                    free = free[-1:]
                known = c * math.prod(found[x] for x in syms if x in found)
                if not free:
                    if known != want:
                        return None
                elif len(free) == 1:
                    if want % known:
                        return None
                    found[free[0]] = want // known
                else:
                    left.append(((c, syms), want))
                    continue
                progress = True
            pending = left
    return found, sizes


def variable_sizes(tensors: Mapping[str, Sequence[Any]], dims: Sequence[Any]) -> dict[int, Any] | None:
    """Each bucket variable's symbolic size on the node or region (``tensors``: its traced values
    by bucket side, "in", "out" and a region's "node"); None if a variable's dim is no product of
    size symbols there, or two sizes, or one size is under two variables."""
    size_of: dict[int, Any] = {}
    for side, i, d, v in dims:
        values = tensors.get(side, ())
        t = values[i] if i < len(values) else None
        e = _expr(t.shape[d]) if isinstance(t, torch.Tensor) and d < len(t.shape) else None
        if e is None or product_factors(e) is None or size_of.setdefault(v, e) != e:
            return None
    if len(set(size_of.values())) != len(size_of):
        return None  # one size under two variables: no box of its own
    return size_of


def bucket_symbols(tensors: Mapping[str, Sequence[Any]], dims: Sequence[Any],
                   ranges: Sequence[Range]) -> dict[Any, Range] | None:
    """The range of each symbolic size a bucket's variables are on the node or region, given the
    variables' ``ranges`` (None as ``variable_sizes``)."""
    size_of = variable_sizes(tensors, dims)
    return None if size_of is None else {e: tuple(ranges[v]) for v, e in size_of.items()}


def bindings_at(size_of: Mapping[int, Any], values: Sequence[int]) -> dict[sympy.Symbol, int] | None:
    """The size symbols' values where each variable ``v`` (its size ``size_of[v]``) is
    ``values[v]``: a size ``c * s`` of one symbol fixes s; None for a product of several symbols
    or a value ``c`` does not divide."""
    found: dict[sympy.Symbol, int] = {}
    for v, e in size_of.items():
        c, symbols = product_factors(e)
        if len(symbols) != 1 or values[v] % c:
            return None
        found[symbols[0]] = values[v] // c
    return found


def region_tensors(region: Region) -> dict[str, list[Any]]:
    """A region's traced values by bucket side (core/buckets.py): inputs, outputs, graph nodes."""
    return {"in": [n.meta.get("val") for n in region.inputs], "out": [n.meta.get("val") for n in region.outputs],
            "node": [n.meta.get("val") for n in region.nodes]}


class ShapeClasses:
    """A partition of the values of each size symbol and of each product of them (a *coordinate*);
    a signature's class is its cell in each."""

    def __init__(self, symbols: Sequence[sympy.Symbol], record_buckets: bool):
        self.symbols = tuple(symbols)
        self._index = {s: j for j, s in enumerate(self.symbols)}
        self._coords: dict[Any, int] = dict(self._index)  # size expression -> coordinate
        self._values: list[Callable[[Sequence[Any]], Any]] = [lambda k, j=j: k[j] for j in range(len(self.symbols))]
        self._cuts: list[set[int]] = [set() for _ in self.symbols]
        self._pinned = [False] * len(self.symbols)
        self.pinned_by: dict[str, str] = {}  # a pinned symbol -> what pinned it (the report's, lower.py)
        self._sorted: list[list[int]] | None = None
        self.record_buckets = record_buckets
        # the graph's whole-graph buckets: (its varying symbol, lo, hi, the other sizes it holds)
        self.whole_buckets: list[tuple[sympy.Symbol, int, int, dict]] = []

    def _coord(self, expr: Any, make: bool) -> int | None:
        """The coordinate of a size expression (made if ``make``); None for one of symbols the
        binder does not read, or not a product."""
        j = self._coords.get(expr)
        if j is not None or not make:
            return j
        factors = product_factors(expr)
        if factors is None or any(x not in self._index for x in factors[1]):
            return None
        c, syms = factors
        at = [self._index[x] for x in syms]
        self._values.append(lambda k, c=c, at=at: c * math.prod(k[i] for i in at)
                            if all(type(k[i]) is int for i in at) else None)
        self._cuts.append(set())
        self._pinned.append(False)
        j = self._coords[expr] = len(self._values) - 1
        return j

    # --- made once, before the first class is asked -----------------------------------------------
    def isolate(self, values: Mapping[Any, int]) -> None:
        for e, v in values.items():
            self.cut(e, v, v)

    def cut(self, expr: Any, lo: int, hi: int) -> None:
        """Make ``[lo, hi]`` a union of cells of the size ``expr`` (a symbol or a product)."""
        j = self._coord(expr, make=True)
        if j is not None:
            self._cuts[j] |= {int(lo), int(hi) + 1}
            self._sorted = None

    def pin(self, symbols: Iterable[sympy.Symbol], why: str = "") -> None:
        for s in symbols:
            j = self._index.get(s)
            if j is not None:
                self._pinned[j] = True
                self.pinned_by.setdefault(str(s), why)

    # --- asked per new signature ------------------------------------------------------------------
    def _cells(self) -> list[list[int]]:
        if self._sorted is None:
            self._sorted = [sorted(c) for c in self._cuts]
        return self._sorted

    def of(self, key: Sequence[Any]) -> tuple:
        """The class of the signature ``key`` (the symbols' values, in ``symbols`` order)."""
        cells = self._cells()
        out = []
        for j, value in enumerate(self._values):
            v = value(key)
            if self._pinned[j] or type(v) is not int:
                out.append(("=", v))
            elif cells[j]:
                out.append(bisect.bisect_right(cells[j], v))
        if self.record_buckets:
            out.append(tuple(pow2_bucket(v) if type(v) is int and v >= 1 else v for v in key))
        return tuple(out)

    def cell(self, key: Sequence[Any], expr: Any) -> Range | None:
        """The values of the size ``expr`` (a symbol or a product) in ``key``'s class (an end far
        off where it is unbounded); None for a size of no coordinate, or a value that is no int.
        A product's cell is its own: its symbols' cells do not bound it (nor it them)."""
        j = self._coord(expr, make=False)
        if j is None:
            return None
        v = self._values[j](key)
        if type(v) is not int:
            return None
        if self._pinned[j]:
            return (v, v)
        cuts = self._cells()[j]
        at = bisect.bisect_right(cuts, v)
        lo = cuts[at - 1] if at > 0 else -(1 << 62)
        hi = cuts[at] - 1 if at < len(cuts) else 1 << 62
        return (lo, hi)

    def starts(self, expr: Any, lo: int, hi: int) -> list[int]:
        """The first value in [lo, hi] of each cell of the size ``expr`` that meets that range."""
        j = self._coord(expr, make=False)
        cuts = self._cells()[j] if j is not None and not self._pinned[j] else []
        return [lo] + [c for c in cuts if lo < c <= hi]

    def admits(self, key: Sequence[Any], single: Iterable[Any], ranges: Mapping[Any, Range]) -> bool:
        """Whether in ``key``'s class every size of ``single`` has one value and each size of
        ``ranges`` stays inside its range: what a bound kernel needs to serve the whole class."""
        return self.refusal(key, single, ranges) is None

    def refusal(self, key: Sequence[Any], single: Iterable[Any],
                ranges: Mapping[Any, Range]) -> tuple[Any, str] | None:
        """Why ``admits`` says no: the first size it fails on (in the binder's order of the
        symbols, then products), and how; None where it says yes."""
        for e in sorted(single, key=lambda e: (self._coords.get(e, len(self._coords)), str(e))):
            c = self.cell(key, e)
            if c is None or c[0] != c[1]:
                return e, f"{e} takes {_span(c)} in its class, and a kernel bound needs one value of it"
        for e, (lo, hi) in ranges.items():
            c = self.cell(key, e)
            if c is None or c[0] < lo or c[1] > hi:
                return e, f"{e} takes {_span(c)} in its class, past the bound bucket's {lo}-{hi}"
        return None


def _span(cell: Range | None) -> str:
    if cell is None:
        return "values no cell tells"
    lo, hi = cell
    return f"{lo if lo > -(1 << 61) else '-inf'}..{hi if hi < 1 << 61 else 'inf'}"


def shape_classes(symbols: Sequence[sympy.Symbol], nodes: Iterable[tuple[fx.Node, str]],
                  regions: Iterable[Region], entries: Iterable[Any], record_buckets: bool,
                  wholes: Iterable[Any] = (), bindings: dict | None = None) -> ShapeClasses:
    """The partition of a graph's signatures by the cache ``entries`` (CacheEntries of the listing)
    its kernel-eligible ``nodes`` ((node, op name)) and ``regions`` could find, and the graph whole
    over a size (``wholes``: whole_graph.DynamicWhole) its buckets (``bindings``: a signature's
    sizes, the other sizes of a whole whose tensors do not tell them apart)."""
    classes = ShapeClasses(symbols, record_buckets)
    entries = list(entries)
    for whole in wholes:
        _whole_cells(classes, whole, entries, bindings or {})
    known = set(symbols)
    by_op: dict[str, list[Any]] = {}
    for e in entries:
        by_op.setdefault(e.spec.op, []).append(e)
    for node, op in nodes:
        syms = node_symbols(node)
        if syms and by_op.get(op):
            _node_cells(classes, node, syms, by_op[op], known)
    region_entries = {}
    for e in by_op.get("region", ()):
        region_entries.setdefault((tuple(spec_ops(e.spec)), len(e.spec.inputs)), []).append(e)
    for region in regions:
        syms = region_symbols(region)
        ops = tuple(o for o in (op_name(n.target) for n in region.nodes) if o != GETITEM)
        found = region_entries.get((ops, len(region.inputs)))
        if syms and found:
            _region_cells(classes, region, syms, found, known)
    return classes


def _whole_cells(classes: ShapeClasses, whole: Any, entries: list[Any], bindings: dict) -> None:
    """The cells of a graph's whole-graph buckets (fill_cache/whole_buckets.py): each bucket's
    range of the varying symbol, the other sizes at the values its winner was filled for (read back
    off its representative, or where its tensors hold only products of them, an MoE router's
    token counts, the ``bindings``'; checked by the key prefix serving looks it up by)."""
    tensors, symbols = region_tensors(whole.region), region_symbols(whole.region)
    for e in entries:
        bucket = e.bucket
        if bucket is None or tuple(map(tuple, bucket.dims)) != tuple(whole.dims) or len(bucket.ranges) != 1:
            continue
        read = read_sizes([*tensors["in"], *tensors["out"]], (*e.spec.inputs, *e.spec.outputs)) \
            if whole.factor == 1 else None
        if read is not None:
            others = {x: v for x, v in read[0].items() if x != whole.symbol}
        else:
            others = {x: v for x, v in bindings.items() if x != whole.symbol and x in symbols}
        probes, scale = whole_probe_keys(whole, others), whole.scale(others)
        if probes is None or scale is None or probe_prefix(probes, whole.dims, scale) != e.key[:PREFIX_LEN]:
            continue
        (lo, hi), = bucket.ranges
        classes.cut(whole.symbol, lo, hi)
        classes.isolate(others)
        classes.whole_buckets.append((whole.symbol, int(lo), int(hi), others))


def _node_cells(classes: ShapeClasses, node: fx.Node, syms: set, entries: list[Any], known: set) -> None:
    inputs, outputs = node_tensors(node)
    for e in entries:
        read = read_sizes([*inputs, *outputs], (*e.spec.inputs, *e.spec.outputs))
        if read is None:
            continue  # never this node's, at any size
        bound, sizes = read
        if not syms <= bound.keys() or not syms <= known:
            classes.pin(syms, _unread(node.name, e, syms, bound, known))
            return
        try:
            spec = build_spec(node, {s: sympy.Integer(v) for s, v in bound.items()})
        except (TypeError, ValueError):
            spec = None
        if spec is not None:
            _entry_cells(classes, spec, e, sizes, {"in": inputs, "out": outputs})


def _region_cells(classes: ShapeClasses, region: Region, syms: set, entries: list[Any], known: set) -> None:
    tensors = region_tensors(region)
    for e in entries:
        read = read_sizes([*tensors["in"], *tensors["out"]], (*e.spec.inputs, *e.spec.outputs))
        if read is None:
            continue
        bound, sizes = read
        if not syms <= bound.keys() or not syms <= known:
            classes.pin(syms, _unread(f"region at {region.nodes[0].name}", e, syms, bound, known))
            return
        spec = region_spec(region, {s: sympy.Integer(v) for s, v in bound.items()})
        if spec is not None:
            _entry_cells(classes, spec, e, sizes, tensors)


def _unread(where: str, e: Any, syms: set, bound: Mapping, known: set) -> str:
    """Why an entry pins its node's symbols: the sizes its spec does not give back, or gives of
    symbols the graph's binder does not read."""
    lost = sorted(map(str, (syms - bound.keys()) | (syms - known)))
    return f"{where}: entry {e.key} does not give back {', '.join(lost)}"


def _entry_cells(classes: ShapeClasses, spec: Any, e: Any, sizes: dict, tensors: Mapping[str, Any]) -> None:
    """The cells entry ``e`` draws for a node or region whose spec is ``spec`` where its symbolic
    sizes have the values ``sizes`` (read back off ``e``): the point of an exact entry, the box of
    a bucket (its other sizes at their values)."""
    bucket = e.bucket
    if bucket is None:
        if spec.key == e.key:
            classes.isolate(sizes)
        return
    varied = bucket_symbols(tensors, bucket.dims, bucket.ranges)
    if varied is None:
        return
    try:
        same = key_prefix(spec, bucket.dims) == e.key[:PREFIX_LEN]
    except (ValueError, IndexError):
        same = False
    if same:
        for size, (lo, hi) in varied.items():
            classes.cut(size, lo, hi)
        classes.isolate({size: v for size, v in sizes.items() if size not in varied})
