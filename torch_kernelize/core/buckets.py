"""Shape buckets: one kernel validated for a range of sizes in the dims a model varies.

A *bucketed spec* is a concrete KernelSpec (the representative, normally the bucket's upper edge)
plus ``dims``: which dims of its inputs and outputs are *variables* (the batch, the sequence),
each one a ``(side, tensor, dim, var)`` with side "in" or "out", or "node" for the value of node
``tensor`` of a fused region's graph (its intermediate results have sizes too). A *bucket* gives
each variable a range ``[lo, hi]``. Every tensor holding a variable dim must be contiguous, so
its strides are a function of its sizes and one kernel can serve every size of the bucket; a
node's value may also be rows of fixed strides (varied in its outermost dim alone, a slice).

Keys: ``abstract_key`` hashes the spec's canonical form with the variable sizes replaced by
their variable and those strides by "contiguous"; a bucket's cache key is that hash's first 16
hex digits and 8 more of its ranges. All buckets of one abstract spec thus share a key prefix,
which lets serving find them by listing the cache once, whatever boundaries filled them.

A bucketed program's launches name, in ``Launch.runtime_sizes``, which grid entries and scalar
arguments are functions of the variables (``SizeExpr``); ``instantiate`` evaluates them for one
concrete size. Nothing else changes between sizes: the same binaries run the whole bucket.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Sequence, Union

from torch_kernelize.core.sized_programs import Resizer, SizeSource, source_strides
from torch_kernelize.core.spec import KernelSpec, TensorMeta

BUCKET_VERSION = 1
PREFIX_LEN = 16  # hex digits of the abstract key that start every bucket key of that spec
SIDES = ("in", "out", "node")

Dim = tuple[str, int, int, int]          # (side, tensor index, dim, variable)
Range = tuple[int, int]                  # inclusive
# an int, a variable ("v0"), or [op, operand, ...] with op "add", "mul" or "cdiv"
SizeExpr = Union[int, str, list]


# --- bucket boundaries --------------------------------------------------------------------------

def pow2_bucket(n: int) -> Range:
    """The default bucket of a size: 1, 2, 3-4, 5-8, 9-16, ..."""
    if n < 1:
        raise ValueError(f"a bucketed size must be at least 1, not {n}")
    hi = 1 << (n - 1).bit_length()
    return (hi // 2 + 1 if hi > 1 else 1, hi)


@dataclasses.dataclass(frozen=True)
class Boundaries:
    """Buckets from the upper edges a user gives: ``8,64,512`` makes 1-8, 9-64, 65-512 (empty:
    powers of two). A size above the last edge is in no bucket."""
    edges: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> "Boundaries":
        if not text:
            return cls()
        try:
            edges = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
        except ValueError:
            raise ValueError(f"--buckets {text!r}: write the buckets' upper edges as integers, e.g. 8,64,512") from None
        if not edges or edges[0] < 1:
            raise ValueError(f"--buckets {text!r}: the upper edges must be integers of at least 1")
        return cls(edges)

    def bucket_of(self, n: int) -> Range | None:
        if not self.edges:
            return pow2_bucket(n)
        lo = 1
        for hi in self.edges:
            if n <= hi:
                return (lo, hi) if n >= lo else None
            lo = hi + 1
        return None

    def covering(self, lo: int, hi: int) -> list[Range]:
        """The buckets that together hold every size in ``[lo, hi]``, in order."""
        out, n = [], lo
        while n <= hi:
            b = self.bucket_of(n)
            if b is None:
                break
            out.append(b)
            n = b[1] + 1
        return out


# --- keys ---------------------------------------------------------------------------------------

def _graph_nodes(spec: KernelSpec) -> list[dict[str, Any]]:
    return json.loads(spec.graph)["nodes"] if spec.graph is not None else []


def _node_meta(node: dict[str, Any]) -> TensorMeta | None:
    """A region graph node's value as a TensorMeta; None for a tuple-valued node (its pieces are
    getitem nodes of their own) or one without a tensor."""
    meta = node.get("meta")
    return TensorMeta.from_json(meta) if isinstance(meta, dict) else None


def _metas(spec: KernelSpec, side: str) -> tuple[TensorMeta | None, ...]:
    if side == "node":
        return tuple(_node_meta(n) for n in _graph_nodes(spec))
    return spec.inputs if side == "in" else spec.outputs


def unbucketable(spec: KernelSpec, dims: Sequence[Dim]) -> str | None:
    """Why ``spec`` cannot be bucketed in ``dims`` (None: it can)."""
    if not dims:
        return "no dim varies"
    metas = {side: _metas(spec, side) for side in {s for s, *_ in dims} & set(SIDES)}
    for side, i, d, _ in dims:
        if side not in SIDES or i >= len(metas[side]) or metas[side][i] is None or d >= len(metas[side][i].shape):
            return f"no dim {d} of {side}put {i}" if side != "node" else f"no dim {d} of region node {i}'s value"
        if not metas[side][i].is_contiguous() and not (side == "node" and _rows_of_fixed_strides(metas[side][i], dims, i)):
            what = f"{side}put {i}" if side != "node" else f"region node {i}'s value"
            return f"{what} is not contiguous: its strides are no function of its sizes"
    return None


def _rows_of_fixed_strides(meta: TensorMeta, dims: Sequence[Dim], i: int) -> bool:
    """A region node's value that varies in its outermost dim 0 alone (a slice of a wider value's
    rows: an MoE's gate and up halves): its strides are the same at every size of it. Inputs and
    outputs stay contiguous: their strides are the caller's, which the key must not assume."""
    varied = {d for side, j, d, _ in dims if side == "node" and j == i}
    shape, stride = meta.shape, meta.stride
    return varied == {0} and all(stride[0] >= stride[k] * max(shape[k], 1) for k in range(1, len(shape)))


def abstract_canonical(spec: KernelSpec, dims: Sequence[Dim]) -> dict[str, Any]:
    """The spec's canonical form with the variable sizes as ``{"var": v}`` and their tensors'
    strides as "contiguous": the same for every size of every bucket."""
    problem = unbucketable(spec, dims)
    if problem is not None:
        raise ValueError(f"{spec.describe()} cannot be bucketed: {problem}")
    d = spec.canonical()
    nodes = _graph_nodes(spec)
    names = {"in": "inputs", "out": "outputs"}
    metas = {side: _metas(spec, side) for side in {s for s, *_ in dims}}
    for side, i, dim, var in dims:
        meta = nodes[i]["meta"] if side == "node" else d[names[side]][i]
        meta["shape"][dim] = {"var": var}
        if metas[side][i].is_contiguous():  # (else a node's rows of fixed strides: they stay)
            meta["stride"] = "contiguous"
    if nodes and any(side == "node" for side, *_ in dims):
        graph = json.loads(spec.graph)
        d["graph"] = json.dumps(dict(graph, nodes=nodes), sort_keys=True, separators=(",", ":"))
    d["bucket_version"] = BUCKET_VERSION
    return d


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def key_prefix(spec: KernelSpec, dims: Sequence[Dim]) -> str:
    """The first hex digits of every bucket key of this abstract spec."""
    return digest(abstract_canonical(spec, dims))[:PREFIX_LEN]


def bucket_key(spec: KernelSpec, dims: Sequence[Dim], ranges: Sequence[Range], prefix: str | None = None) -> str:
    """The cache key of the bucket ``ranges`` (one per variable) of ``spec`` bucketed in ``dims``
    (``prefix``: its abstract spec's, where the caller wrote it another way: a dynamic graph's)."""
    return (prefix or key_prefix(spec, dims)) + digest([list(r) for r in ranges])[:24 - PREFIX_LEN]


def variables(dims: Sequence[Dim]) -> int:
    return 1 + max(v for *_, v in dims) if dims else 0


def values_of(spec: KernelSpec, dims: Sequence[Dim]) -> tuple[int, ...]:
    """Each variable's size in ``spec``."""
    out: dict[int, int] = {}
    metas: dict[str, tuple] = {}
    for side, i, d, v in sorted(dims, key=lambda dim: dim[0] == "node"):  # (a region's graph parsed last, if at all)
        if v not in out:
            out[v] = (metas.get(side) or metas.setdefault(side, _metas(spec, side)))[i].shape[d]
    return tuple(out[v] for v in range(variables(dims)))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def metas_at(spec: KernelSpec, dims: Sequence[Dim], values: Sequence[int], side: str = "out") -> tuple[TensorMeta, ...]:
    """The inputs or outputs (``side``) of ``spec_at(spec, dims, values)``, without the rest of the
    spec. ``values`` sized_programs.SIZES: the varied sizes and strides come back as SizeSources
    (a call generated once for every size of the bucket, ProgramRunner.bucket_direct)."""
    metas = _metas(spec, side)
    shapes = [list(m.shape) for m in metas]
    for s, i, d, v in dims:
        if s == side:
            shapes[i][d] = values[v] if isinstance(values[v], SizeSource) else int(values[v])
    varied = {i for s, i, _, _ in dims if s == side}
    return tuple(TensorMeta(tuple(shapes[i]), source_strides(shapes[i]), m.dtype, m.device) if i in varied else m
                 for i, m in enumerate(metas))


def spec_at(spec: KernelSpec, dims: Sequence[Dim], values: Sequence[int]) -> KernelSpec:
    """The concrete spec of ``spec`` with each variable set to ``values`` (contiguous strides)."""
    metas = {"in": [list(m.shape) for m in spec.inputs], "out": [list(m.shape) for m in spec.outputs]}
    nodes = _graph_nodes(spec) if any(side == "node" for side, *_ in dims) else []
    node_metas = _metas(spec, "node") if nodes else ()
    for side, i, d, v in dims:
        if side == "node":
            meta = nodes[i]["meta"]
            meta["shape"][d] = int(values[v])
            if node_metas[i].is_contiguous():  # (a node's rows of fixed strides keep theirs)
                meta["stride"] = list(contiguous_strides(meta["shape"]))
        else:
            metas[side][i][d] = int(values[v])
    varied = {(side, i) for side, i, _, _ in dims}

    def rebuilt(side: str) -> tuple[TensorMeta, ...]:
        return tuple(dataclasses.replace(m, shape=tuple(metas[side][i]),
                                         stride=contiguous_strides(metas[side][i]) if (side, i) in varied else m.stride)
                     for i, m in enumerate(_metas(spec, side)))
    graph = spec.graph
    if nodes:
        graph = json.dumps(dict(json.loads(spec.graph), nodes=nodes), sort_keys=True, separators=(",", ":"))
    return dataclasses.replace(spec, inputs=rebuilt("in"), outputs=rebuilt("out"), graph=graph)


def contains(ranges: Sequence[Range], values: Sequence[int]) -> bool:
    return len(ranges) == len(values) and all(lo <= v <= hi for (lo, hi), v in zip(ranges, values))


# --- the bucket record of a cache entry ---------------------------------------------------------

def probe_prefix(probes: Sequence[str], dims: Sequence[Dim], scale: int = 1) -> str:
    """The key prefix of a dynamic graph's buckets, from the keys of its canonical form at the
    probe sizes (compiling/whole_graph.py): a literal size cannot be told from a symbolic one in
    a concrete spec, so these keys, not the representative, define the graph. ``scale``: what
    its dims hold per unit of the variable (1: the variable itself)."""
    d = {"whole": list(probes), "dims": [list(d) for d in dims], "version": BUCKET_VERSION}
    return digest(d if scale == 1 else dict(d, scale=scale))[:PREFIX_LEN]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What a bucket entry's record holds under "bucket": its dims and ranges (and, written by
    fill_cache, the sizes its winner was validated at; for a dynamic graph's, its probe keys and
    the ``scale`` its dims hold the variable at: an MoE router's token counts, batch x length,
    are a multiple of the length its buckets range over)."""
    dims: tuple[Dim, ...]
    ranges: tuple[Range, ...]
    validated: tuple[tuple[int, ...], ...] = ()
    probes: tuple[str, ...] = ()
    scale: int = 1

    def key(self, spec: KernelSpec) -> str:
        prefix = probe_prefix(self.probes, self.dims, self.scale) if self.probes else None
        return bucket_key(spec, self.dims, self.ranges, prefix)

    def values(self, spec: KernelSpec) -> tuple[int, ...] | None:
        """Each variable's size in ``spec``: its dims' over the scale (None where one is no
        multiple of it)."""
        sizes = values_of(spec, self.dims)
        return None if any(v % self.scale for v in sizes) else tuple(v // self.scale for v in sizes)

    def to_json(self) -> dict[str, Any]:
        d = {"version": BUCKET_VERSION, "dims": [list(d) for d in self.dims],
             "ranges": [list(r) for r in self.ranges], "validated_sizes": [list(v) for v in self.validated]}
        if self.probes:
            d["probes"] = list(self.probes)
        if self.scale != 1:
            d["scale"] = self.scale
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Bucket":
        if d.get("version") != BUCKET_VERSION:
            raise ValueError(f"bucket version {d.get('version')!r} is not {BUCKET_VERSION}")
        if int(d.get("scale", 1)) < 1:
            raise ValueError(f"bucket scale {d['scale']!r} is not a positive integer")
        return cls(tuple((str(s), int(i), int(k), int(v)) for s, i, k, v in d["dims"]),
                   tuple((int(lo), int(hi)) for lo, hi in d["ranges"]),
                   tuple(tuple(int(x) for x in v) for v in d.get("validated_sizes", ())),
                   tuple(str(k) for k in d.get("probes", ())), int(d.get("scale", 1)))


# --- sizes computed at launch time --------------------------------------------------------------

def evaluate(expr: SizeExpr, values: Sequence[int]) -> int:
    """The value of a SizeExpr for the variables' ``values``."""
    if isinstance(expr, bool):
        raise ValueError(f"bad size expression {expr!r}")
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str) and expr.startswith("v") and expr[1:].isdigit():
        return int(values[int(expr[1:])])
    if isinstance(expr, list) and expr and expr[0] in ("add", "mul", "cdiv"):
        args = [evaluate(e, values) for e in expr[1:]]
        if expr[0] == "add":
            return sum(args)
        if expr[0] == "mul":
            out = 1
            for a in args:
                out *= a
            return out
        if len(args) == 2 and args[1] > 0:
            return -(-args[0] // args[1])
    raise ValueError(f"bad size expression {expr!r}")


def product(factors: Sequence[SizeExpr]) -> SizeExpr:
    """A SizeExpr for the product of ``factors`` (constants folded)."""
    const, rest = 1, []
    for f in factors:
        if isinstance(f, int):
            const *= f
        else:
            rest.append(f)
    if not rest:
        return const
    return ["mul", *([const] if const != 1 else []), *rest] if len(rest) > 1 or const != 1 else rest[0]


def instantiate(program: Any, values: Sequence[int]) -> Any:
    """``program`` (a KernelProgram) with every launch's run-time sizes evaluated for ``values``
    (and, for a graph bucket's program, every other integer it names in ``sized``). A caller that
    sizes one program many times keeps its sized_programs.Resizer instead."""
    return Resizer(program)(values)
