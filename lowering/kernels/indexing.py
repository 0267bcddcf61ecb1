"""Indexing ops: rows or elements picked by an index tensor (gathers) or added at it (scatter-adds).

Ops and how they are seen:
- "rows" ops move whole rows of the dims after the indexed dim ``d``. The data is viewed as
  [P, L, Q]: P = the dims before d, L = the index tensor's dims, Q = the dims after d (merged
  where contiguous; usually one contiguous row, e.g. the hidden dim):
    aten.index.Tensor     one index tensor (at any position; None elsewhere): out[p, l, q] = x[p, idx[l], q]
    aten.index_select     out[p, l, q] = x[p, idx[l], q]     (idx 0-d or 1-d)
    aten.embedding        out[l, q] = weight[idx[l], q]       (padding_idx etc. only matter for grads)
    aten.index_add        out = self.clone(); out[p, idx[l], q] += alpha * source[p, l, q]
    aten.index_put        one index tensor (None elsewhere), values broadcast to [P, L, Q]:
                          out = self.clone(); out[p, idx[l], q] = values[p, l, q]  (+= with accumulate)
  A program owns a BLOCK_R x BLOCK_D tile: BLOCK_R rows (one index load each) by BLOCK_D
  contiguous columns (wide coalesced loads and stores along the row).
- "elements" ops index one element per index element, in the index tensor's own shape:
    aten.gather           out[c] = self[c with c_d = idx[c]]
    aten.scatter_add      out = self.clone(); out[c with c_d = idx[c]] += src[c]
  A program owns BLOCK elements of the index tensor, walked in memory order.

Accumulation (index_add, scatter_add, index_put) first copies ``self`` into the output (a copy
kernel), then writes at the index: index_put stores its values (accumulate=False; which of two
writes at one element wins is unspecified in ATen, so validation draws distinct indices and an
index longer than its dim, which must repeat, is declined); the others add with atomics, so the summation order of repeated indices is not deterministic (within the
dtype tolerance). fp16/bf16 choose by config: VARIANT "direct" adds with fp16/bf16 atomics into
the output (each add rounds to the dtype, as ATen does), VARIANT "fp32" accumulates in an fp32
temporary that a last kernel rounds into the output (one rounding: more accurate; more traffic).

Index values: int64 or int32. aten.index.Tensor and index_put wrap negative indices as ATen does; the other
ops reject negative indices in ATen, and an index out of range makes ATen raise. A kernel cannot
raise (and ``tl.device_assert`` would leave a CUDA context unusable): it never touches memory out
of bounds (a gathered row or element with an invalid index reads NaN (floats) or 0 (integers), an
add at an invalid index is dropped) and sets a flag that the program's check turns into eager's
IndexError after the launch. Validation draws valid indices (``sample_inputs``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import (Config, KernelFamily, doubled_and_halved, sample_generator,
                                                   sample_tensor, to_device)
from torch_kernelize.core.program import Buffer, Check, Donation, KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec

OPS = {
    "aten.index.Tensor": "index",
    "aten.index_select.default": "index_select",
    "aten.embedding.default": "embedding",
    "aten.index_add.default": "index_add",
    "aten.gather.default": "gather",
    "aten.scatter_add.default": "scatter_add",
    "aten.index_put.default": "index_put",
    "aten._unsafe_index_put.default": "index_put",
}
ROW_OPS = ("index", "index_select", "embedding", "index_add", "index_put")
ACCUMULATE = ("index_add", "scatter_add", "index_put")   # copy ``self``, then write at the index
COPY_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32")   # gathered values
ADD_DTYPES = ("float32", "float16", "bfloat16")                       # accumulated values
INDEX_DTYPES = ("int64", "int32")
MAX_TILE = 16384          # elements of one BLOCK_R x BLOCK_D tile
COPY_BLOCK = 1024         # the clone kernel of the accumulating ops


@dataclasses.dataclass
class _Plan:
    name: str                       # short op name (OPS values)
    rows: bool                      # "rows" op (else "elements")
    accumulate: bool                # copies self, then writes at the index
    dtype: str                      # value dtype
    index_dtype: str
    dim_size: int                   # size of the indexed dim: valid indices are [0, dim_size)
    wrap: bool                      # negative indices count from the end (aten.index.Tensor)
    src: int                        # input number of the values read (x / weight / source / src)
    idx: int                        # input number of the index
    self_in: int | None             # accumulate: input number of ``self``
    alpha: float = 1.0
    overwrite: bool = False         # index_put(accumulate=False): stores, not atomic adds
    # the index tensor's walk: rows (rows ops) or elements (elements ops); stride sets are
    # [src, idx, dst(out), dst(contiguous fp32 temp)]
    r_sizes: tuple[int, ...] = ()
    r_strides: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    # rows ops: the columns; stride sets [src, dst(out), dst(temp)]
    q_sizes: tuple[int, ...] = ()
    q_strides: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    # the stride the index multiplies: in src (gathers) or in dst (accumulation), [out, temp]
    ind_stride: tuple[int, int] = (0, 0)
    R: int = 1                      # rows (or elements)
    Q: int = 1                      # columns (rows ops)
    wide: bool = False              # int64 offsets


def _norm_dim(d, ndim: int) -> int | None:
    if not isinstance(d, int) or isinstance(d, bool):
        return None
    n = max(ndim, 1)
    if not -n <= d < n:
        return None
    return d % n


# --- analysis ------------------------------------------------------------------------------------
# ``_analyse`` in steps: which inputs are the values and the index (``_operands``), the checks
# every op shares (``_checked``), then the walk of a "rows" or an "elements" op, whose stride
# sets the kernels read.

def _operands(name: str, a: dict[str, Any]) -> tuple[int, int, object] | str:
    """(input number of the values, of the index, the indexed dim as given), or why not."""
    if name == "embedding":
        src, idx = cg.tensor_index(a.get("weight")), cg.tensor_index(a.get("indices"))
        d = 0
    elif name in ("index", "index_put"):
        src = cg.tensor_index(a.get("self"))
        indices = a.get("indices")
        if not isinstance(indices, list):
            return "indices must be a list"
        pos = [k for k, v in enumerate(indices) if v is not None]
        if len(pos) != 1 or cg.tensor_index(indices[pos[0]]) is None:
            return "only one index tensor (None elsewhere) is generated"
        d, idx = pos[0], cg.tensor_index(indices[pos[0]])
    else:
        src = cg.tensor_index(a.get("self"))
        idx = cg.tensor_index(a.get("index"))
        d = a.get("dim")
    if src is None or idx is None:
        return "values and index must be tensors"
    return src, idx, d


def _checked(spec: KernelSpec, name: str, a: dict[str, Any], src: int, idx: int, d) -> tuple[_Plan, int] | str:
    """The checks every op shares (dtypes, devices, the dim, sizes): the plan without its walk,
    and the indexed dim (normalized)."""
    O = spec.outputs[0]
    V, I = spec.inputs[src], spec.inputs[idx]
    if I.dtype not in INDEX_DTYPES:
        return f"index dtype {I.dtype} is not generated (int64/int32; bool masks give data-dependent shapes)"
    accumulate = name in ACCUMULATE
    overwrite = name == "index_put" and not a.get("accumulate", False)
    if V.dtype not in (ADD_DTYPES if accumulate and not overwrite else COPY_DTYPES):
        return f"values of dtype {V.dtype} are not generated for {name}"
    if O.dtype != V.dtype:
        return f"output dtype {O.dtype} differs from the values' {V.dtype}"
    if any(m.device != V.device for m in spec.inputs + spec.outputs):
        return "tensors on different devices"
    ndim = len(V.shape)
    if ndim == 0 and name in ROW_OPS:
        return "0-d values"
    d = _norm_dim(d, ndim)
    if d is None:
        return f"bad dim {a.get('dim')!r}"
    if name == "embedding" and ndim != 2:
        return "embedding weight must be 2-d"
    if name in ("index", "index_put") and d >= ndim:
        return "more indices than dims"
    if overwrite and I.numel > V.shape[d]:
        return (f"{I.numel} indices into a dim of {V.shape[d]}: some element is written twice, and ATen "
                "leaves which write wins unspecified")
    if I.numel == 0 or V.numel == 0 or O.numel == 0:
        return "empty tensors: nothing to compute"
    plan = _Plan(name, name in ROW_OPS, accumulate, V.dtype, I.dtype, V.shape[d] if ndim else 1, name in ("index", "index_put"),
                 src, idx, None, overwrite=overwrite)
    if name == "index_add":
        plan.alpha = cg.scalar_value(a.get("alpha", 1))
        if plan.alpha is None or isinstance(plan.alpha, bool):
            return "alpha must be a number"
    return plan, d


# a rows op's strides: (src_r, dst_r, tmp_r) over [P, L], (src_q, dst_q, tmp_q) over Q, and the
# index's stride in [out, temp] (``_Plan.ind_stride``)
_RowStrides = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...],
                    tuple[int, ...], tuple[int, int]]


def _rows_walk(spec: KernelSpec, plan: _Plan, a: dict[str, Any], d: int) -> tuple[int, int] | str:
    """A rows op's walk: rows over [P, L] and columns over Q (fills ``plan``); the index's stride."""
    name, O, V, I = plan.name, spec.outputs[0], spec.inputs[plan.src], spec.inputs[plan.idx]
    temp = cg.contiguous_strides(O.shape)
    P, Qs = V.shape[:d], V.shape[d + 1:]
    if name in ("index_select", "index_add") and len(I.shape) > 1:
        return "index must be 0-d or 1-d"
    L = tuple(I.shape) if name in ("index", "embedding", "index_put") else (I.numel,)
    l_idx = tuple(I.stride) if name in ("index", "embedding", "index_put") else ((I.stride[0],) if I.shape else (0,))
    if name == "index_put":
        strides = _put_rows(spec, plan, a, d, P, L, Qs, temp)
    elif name != "index_add":
        strides = _gather_rows(spec, plan, d, P, L, Qs, temp)
    else:
        strides = _add_rows(spec, plan, a, d, P, L, Qs, temp)
    if isinstance(strides, str):
        return strides
    src_r, dst_r, tmp_r, src_q, dst_q, tmp_q, ind = strides
    idx_r = (0,) * len(P) + l_idx
    r_sizes = tuple(P) + L
    plan.r_sizes, plan.r_strides = cg.simplify(r_sizes, [src_r, idx_r, dst_r, tmp_r],
                                               order_by=0 if plan.accumulate else 2)
    plan.q_sizes, plan.q_strides = cg.simplify(Qs, [src_q, dst_q, tmp_q], order_by=0 if plan.accumulate else 1)
    plan.R, plan.Q = math.prod(r_sizes), math.prod(Qs)
    return ind


def _put_rows(spec: KernelSpec, plan: _Plan, a: dict[str, Any], d: int, P, L, Qs, temp) -> _RowStrides | str:
    """index_put: values broadcast to [P, L, Q] are stored (or added) at rows of the output."""
    O, V = spec.outputs[0], spec.inputs[plan.src]
    plan.self_in, plan.src = plan.src, cg.tensor_index(a.get("values"))
    if plan.src is None:
        return "values must be a tensor"
    S = spec.inputs[plan.src]
    if tuple(O.shape) != tuple(V.shape):
        return "output shape differs from self"
    if S.dtype != V.dtype:
        return "values dtype differs from self"
    try:
        vs = cg.broadcast_strides(S, tuple(P) + L + tuple(Qs))
    except ValueError as e:
        return f"values: {e}"
    nl = len(L)
    dst_r, tmp_r = tuple(O.stride[:d]) + (0,) * nl, tuple(temp[:d]) + (0,) * nl
    return vs[:d + nl], dst_r, tmp_r, vs[d + nl:], tuple(O.stride[d + 1:]), tuple(temp[d + 1:]), (O.stride[d], temp[d])


def _gather_rows(spec: KernelSpec, plan: _Plan, d: int, P, L, Qs, temp) -> _RowStrides | str:
    """index, index_select, embedding: rows of the values gathered into the output."""
    O, V = spec.outputs[0], spec.inputs[plan.src]
    if tuple(O.shape) != tuple(P) + L + tuple(Qs):
        return f"output shape {O.shape} is not {tuple(P) + L + tuple(Qs)}"
    nl = len(L)
    src_r = tuple(V.stride[:d]) + (0,) * nl
    return (src_r, tuple(O.stride[:d + nl]), tuple(temp[:d + nl]), tuple(V.stride[d + 1:]), tuple(O.stride[d + nl:]),
            tuple(temp[d + nl:]), (V.stride[d], V.stride[d]))


def _add_rows(spec: KernelSpec, plan: _Plan, a: dict[str, Any], d: int, P, L, Qs, temp) -> _RowStrides | str:
    """index_add: rows of ``source`` added at rows of the output."""
    O, V = spec.outputs[0], spec.inputs[plan.src]
    S = spec.inputs[cg.tensor_index(a.get("source"))]
    plan.self_in = plan.src
    plan.src = cg.tensor_index(a.get("source"))
    if tuple(O.shape) != tuple(V.shape):
        return "output shape differs from self"
    if S.dtype != V.dtype:
        return "source dtype differs from self"
    if tuple(S.shape) != tuple(P) + L + tuple(Qs):
        return f"source shape {S.shape} is not {tuple(P) + L + tuple(Qs)}"
    dst_r, tmp_r = tuple(O.stride[:d]) + (0,), tuple(temp[:d]) + (0,)
    return (tuple(S.stride[:d + 1]), dst_r, tmp_r, tuple(S.stride[d + 1:]), tuple(O.stride[d + 1:]),
            tuple(temp[d + 1:]), (O.stride[d], temp[d]))


def _zero_dim_as_1d(spec: KernelSpec) -> KernelSpec:
    """``spec`` with each 0-d tensor seen as 1-d of one element (ATen's gather/scatter_add treat
    a 0-d self, index or src so; the index selects along a dim of size 1)."""
    if all(m.shape for m in spec.inputs + spec.outputs):
        return spec
    return dataclasses.replace(spec, inputs=tuple(map(cg.as_1d, spec.inputs)), outputs=tuple(map(cg.as_1d, spec.outputs)))


def _elements_walk(spec: KernelSpec, plan: _Plan, a: dict[str, Any], d: int) -> tuple[int, int] | str:
    """An elements op's walk over the index tensor (fills ``plan``); the index's stride."""
    O, V, I = spec.outputs[0], spec.inputs[plan.src], spec.inputs[plan.idx]
    ndim, temp = len(V.shape), cg.contiguous_strides(O.shape)
    if len(I.shape) != ndim:
        return "index must have as many dims as self"
    if plan.name == "gather":
        if tuple(O.shape) != tuple(I.shape):
            return "output shape differs from the index's"
        if any(I.shape[k] > V.shape[k] for k in range(ndim) if k != d):
            return "index larger than self outside dim"
        sets = [tuple(0 if k == d else s for k, s in enumerate(V.stride)), tuple(I.stride),
                tuple(O.stride), tuple(temp)]
        ind = (V.stride[d], V.stride[d])
    else:
        S = spec.inputs[cg.tensor_index(a.get("src"))]
        plan.self_in, plan.src = plan.src, cg.tensor_index(a.get("src"))
        if tuple(O.shape) != tuple(V.shape) or S.dtype != V.dtype:
            return "output/src do not match self"
        if len(S.shape) != ndim or any(I.shape[k] > S.shape[k] for k in range(ndim)) or any(
                I.shape[k] > V.shape[k] for k in range(ndim) if k != d):
            return "index larger than src/self"
        sets = [tuple(S.stride[:ndim]), tuple(I.stride),
                tuple(0 if k == d else s for k, s in enumerate(O.stride)),
                tuple(0 if k == d else s for k, s in enumerate(temp))]
        ind = (O.stride[d], temp[d])
    plan.r_sizes, plan.r_strides = cg.simplify(I.shape, sets, order_by=1)
    plan.R = I.numel
    return ind


class IndexingFamily(KernelFamily):
    name = "indexing"
    ops = frozenset(OPS)
    edge_kinds = ("zeros", "large", "negative", "special")

    # --- analysis ---------------------------------------------------------------------------
    def _analyse(self, spec: KernelSpec) -> _Plan | str:
        name = OPS[spec.op]
        a = cg.bind(spec)
        if len(spec.outputs) != 1:
            return f"expected one output, got {len(spec.outputs)}"
        picked = _operands(name, a)
        if isinstance(picked, str):
            return picked
        checked = _checked(spec, name, a, *picked)
        if isinstance(checked, str):
            return checked
        plan, d = checked
        if not plan.rows:
            spec = _zero_dim_as_1d(spec)
        ind = (_rows_walk if plan.rows else _elements_walk)(spec, plan, a, d)
        if isinstance(ind, str):
            return ind
        plan.ind_stride = ind
        spans = [cg.max_offset(m.shape, m.stride) for m in spec.inputs + spec.outputs] + [spec.outputs[0].numel]
        plan.wide = max(spans) + 2 * MAX_TILE > cg.INT32_MAX or plan.R * max(1, plan.Q) + MAX_TILE > cg.INT32_MAX
        return plan

    @staticmethod
    def _fp32_variant(plan: _Plan) -> bool:
        """Whether VARIANT "fp32" (sums in an fp32 temporary) is an option: atomic adds of fp16/bf16."""
        return plan.accumulate and not plan.overwrite and plan.dtype != "float32"

    # --- configs ------------------------------------------------------------------------------
    def _valid(self, plan: _Plan, c: Config) -> bool:
        if c["num_warps"] not in (1, 2, 4, 8, 16):
            return False
        v = c.get("VARIANT", "direct")
        if v not in ("direct", "fp32") or (v == "fp32" and not self._fp32_variant(plan)):
            return False
        if plan.rows:
            br, bd = c["BLOCK_R"], c["BLOCK_D"]
            if not (_is_pow2(br) and _is_pow2(bd)) or br * bd > MAX_TILE or br > _p2(plan.R) or bd > _p2(plan.Q):
                return False
            return br * bd >= 32 * c["num_warps"] or c["num_warps"] == 1
        b = c["BLOCK"]
        return _is_pow2(b) and 32 <= b <= min(MAX_TILE, max(32, _p2(plan.R))) and b >= 32 * c["num_warps"]

    def _cfg(self, plan: _Plan, size: int, bd: int | None = None, warps: int | None = None,
             variant: str = "direct") -> Config:
        extra = {"VARIANT": variant} if self._fp32_variant(plan) else {}
        if plan.rows:
            bd = max(1, min(bd or 1024, _p2(plan.Q)))
            br = max(1, min(max(1, size // bd), _p2(plan.R), MAX_TILE // bd))
            w = warps or max(1, min(8, (br * bd) // 256))
            w = min(w, max(1, (br * bd) // 32))
            return Config.of(BLOCK_R=br, BLOCK_D=bd, num_warps=w, **extra)
        b = max(32, min(size, _p2(plan.R), MAX_TILE))
        w = max(1, min(warps or 4, b // 32))
        return Config.of(BLOCK=b, num_warps=w, **extra)

    def _seeds(self, spec: KernelSpec, plan: _Plan) -> list[Config]:
        variants = ["direct", "fp32"] if self._fp32_variant(plan) else ["direct"]
        seeds = []
        for v in variants:
            if plan.rows:
                # rows of the hidden size: a whole row (up to 1K) per tile row, a few rows per program
                seeds += [self._cfg(plan, 4096, 1024, 4, v), self._cfg(plan, 8192, 512, 8, v),
                          self._cfg(plan, 2048, 256, 4, v)]
            else:
                seeds += [self._cfg(plan, 1024, warps=4, variant=v), self._cfg(plan, 4096, warps=8, variant=v)]
        return seeds

    def _steps(self, plan: _Plan, c: Config) -> list[Config]:
        keys = ("BLOCK_R", "BLOCK_D", "num_warps") if plan.rows else ("BLOCK", "num_warps")
        cands = doubled_and_halved(c, keys)
        if "VARIANT" in dict(c.params):
            cands.append(c.replace(VARIANT="fp32" if c["VARIANT"] == "direct" else "direct"))
        return cands

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.checked_plan(spec, config)
        return _Gen(spec, plan, config).program()

    # --- validation inputs --------------------------------------------------------------------
    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Values by ``kind``; indices always valid, uniform over the indexed dim (so repeated
        indices occur for the scatter-adds), negative ones too where ATen wraps them; distinct
        where index_put overwrites (which of two writes wins is unspecified)."""
        plan = self.plan(spec)
        g = sample_generator(seed, device)  # drawn where they are used: an embedding table is 100s of MB
        out = []
        for i, m in enumerate(spec.inputs):
            if not isinstance(plan, str) and i == plan.idx and plan.overwrite:
                t = sample_tensor(m, g, "zeros")
                pos = torch.randperm(plan.dim_size, generator=g, device=g.device)[:m.numel]
                wrap = torch.rand(m.numel, generator=g, device=g.device) < 0.5  # i and i - size name one element
                t.copy_(torch.where(wrap, pos - plan.dim_size, pos).reshape(m.shape))
            elif not isinstance(plan, str) and i == plan.idx:
                lo = -plan.dim_size if plan.wrap else 0
                t = sample_tensor(m, g, "random", low=lo, high=plan.dim_size)
            else:
                t = sample_tensor(m, g, kind)
            out.append(to_device(t, device))
        return out


# --- code generation -------------------------------------------------------------------------


class _Gen:
    def __init__(self, spec: KernelSpec, plan: _Plan, config: Config):
        self.spec, self.p, self.c = spec, plan, config
        self.temp = plan.accumulate and config.get("VARIANT", "direct") == "fp32"
        self.s = cg.Source()
        self.T = cg.tl_type(plan.dtype)

    def _idx(self, offset: str, mask: str | None, axis: str, block: str) -> None:
        """Emit: load the index, wrap negatives (index.Tensor), ``ok`` = valid, ``i`` clamped;
        an index out of range sets the flag that the program's check turns into eager's error."""
        p, s = self.p, self.s
        offset = cg.as_block(offset, axis)   # one index for all: keep the block shape
        kw = f", mask={mask}, other=0" if mask else ""
        s(f"i = tl.load(idx_ptr + {offset}{kw}).to(tl.int64)")
        if p.wrap:
            s(f"i = tl.where(i < 0, i + {p.dim_size}, i)  # negative indices count from the end")
        ok = f"(i >= 0) & (i < {p.dim_size})"
        s(f"ok = {mask + ' & ' if mask else ''}{ok}  # ATen raises for an index out of range:")
        s(f"tl.store(flag_ptr + {axis} * 0, tl.full([{block}], 1, tl.int32), mask={mask + ' & ' if mask else ''}"
          f"(({ok}) == 0))  # the check after the launch raises it")
        s(f"i = tl.where(ok, i, 0){'' if p.wide else '.to(tl.int32)'}")

    def header(self) -> None:
        p, s = self.p, self.s
        s(cg.HEADER, cg.describe_spec(self.spec))
        if p.rows:
            s(f"# {p.R} rows over sizes {list(p.r_sizes)}, strides [src, idx, dst, fp32 dst] "
              f"{[list(x) for x in p.r_strides]}",
              f"# {p.Q} columns over sizes {list(p.q_sizes)}, strides [src, dst, fp32 dst] "
              f"{[list(x) for x in p.q_strides]}")
        else:
            s(f"# {p.R} index elements over sizes {list(p.r_sizes)}, strides [src, idx, dst, fp32 dst] "
              f"{[list(x) for x in p.r_strides]}")
        s(f"# the index selects along a dim of size {p.dim_size}, stride {p.ind_stride[1 if self.temp else 0]} in "
          f"{'the destination' if p.accumulate else 'the source'}")
        s.blank()

    def program(self) -> KernelProgram:
        self.header()
        launches, temps = [], []
        p = self.p
        O = self.spec.outputs[0]
        if p.accumulate:
            if self.temp:
                temps.append(Buffer(tuple(O.shape), "float32"))
            launches.append(self.copy_kernel("clone_kernel", ("in", p.self_in), ("tmp", 0) if self.temp else ("out", 0),
                                             self.spec.inputs[p.self_in].stride,
                                             cg.contiguous_strides(O.shape) if self.temp else O.stride))
        temps.append(Buffer((1,), "int32", 0))  # the out-of-range flag
        launches.append(self.rows_kernel() if p.rows else self.elements_kernel())
        if self.temp:
            launches.append(self.copy_kernel("round_kernel", ("tmp", 0), ("out", 0), cg.contiguous_strides(O.shape),
                                             O.stride, cast=self.T))
        donations = ()
        if p.accumulate and not self.temp and self.spec.inputs[p.self_in] == O:
            donations = (Donation(0, p.self_in, (0,)),)  # a dead ``self`` is accumulated into as it is
        check = Check(len(temps) - 1, f"{self.spec.op}: an index is out of bounds for the indexed dimension "
                                      f"of size {p.dim_size}")
        return KernelProgram(self.s.text(), tuple(launches), temps=tuple(temps), donations=donations, checks=(check,))

    def copy_kernel(self, name: str, src, dst, src_strides, dst_strides, cast: str | None = None) -> Launch:
        s, O = self.s, self.spec.outputs[0]
        sizes, sets = cg.simplify(O.shape, [tuple(src_strides), tuple(dst_strides)], order_by=1)
        n = O.numel
        block = min(COPY_BLOCK, _p2(n))
        what = "fp32 sums -> output dtype" if cast else ("self -> fp32 accumulator" if self.temp else "self -> output")
        s("@triton.jit", f"def {name}(src_ptr, dst_ptr, BLOCK: tl.constexpr):").indent()
        s(f"# {what}: {n} elements over sizes {list(sizes)}, strides {[list(x) for x in sets]}")
        offs, mask = cg.block_offsets(s, "e", "tl.program_id(0)", "BLOCK", block, n, self.p.wide, "mask", sizes, sets, "k")
        kw = f", mask={mask}" if mask else ""
        conv = f".to({cast})" if cast else (".to(tl.float32)" if self.temp else "")
        s(f"v = tl.load(src_ptr + {offs[0]}{kw}){conv}")
        s(f"tl.store(dst_ptr + {offs[1]}, v{kw})")
        s.dedent().blank()
        return Launch(name, (-(-n // block),), (src, dst), {"BLOCK": block}, 4 if block >= 512 else 1, 1)

    def _named(self, names: list[str], offs: list[str]) -> list[str]:
        """Give compound offsets a name (one line each), so that tiles read clearly."""
        out = []
        for name, off in zip(names, offs):
            if " " in off and name:
                self.s(f"{name} = {off}")
                out.append(name)
            else:
                out.append(off)
        return out

    def rows_kernel(self) -> Launch:
        p, s, c = self.p, self.s, self.c
        br, bd, warps = int(c["BLOCK_R"]), int(c["BLOCK_D"]), int(c["num_warps"])
        dst_k = 3 if self.temp else 2          # which dst stride set (output or fp32 temp)
        ind = p.ind_stride[1 if self.temp else 0]
        kname = {"index": "index_rows_kernel", "index_select": "index_select_kernel",
                 "embedding": "embedding_kernel", "index_add": "index_add_kernel",
                 "index_put": "index_put_kernel"}[p.name]
        s("@triton.jit", f"def {kname}(src_ptr, idx_ptr, dst_ptr, flag_ptr, BLOCK_R: tl.constexpr, "
                         "BLOCK_D: tl.constexpr):").indent()
        s("# a BLOCK_R x BLOCK_D tile: rows (one index each) by contiguous columns")
        sets = [p.r_strides[0], p.r_strides[1], p.r_strides[dst_k]]
        offs, r_mask = cg.block_offsets(s, "r", "tl.program_id(0)", "BLOCK_R", br, p.R, p.wide, "r_mask",
                                        p.r_sizes, sets, "m")
        src_row, idx_off, dst_row = self._named(["src_row", "", "dst_row"], offs)
        self._idx(idx_off, r_mask, "r", "BLOCK_R")
        if p.accumulate:
            dst_row = f"{'' if dst_row == '0' else dst_row + ' + '}{cg.scaled('i', ind)}"
        else:
            src_row = f"{'' if src_row == '0' else src_row + ' + '}{cg.scaled('i', ind)}"
        qsets = [p.q_strides[0], p.q_strides[1 if not self.temp else 2]]
        qoffs, c_mask = cg.block_offsets(s, "c", "tl.program_id(1)", "BLOCK_D", bd, p.Q, p.wide, "c_mask",
                                         p.q_sizes, qsets, "n")
        src_col, dst_col = self._named(["src_col", "dst_col"], qoffs)
        tile = lambda row, col: (f"{_wrap(cg.as_block(row, 'r'))}[:, None] + "
                                 f"{_wrap(cg.as_block(col, 'c'))}[None, :]")
        both = lambda rm: (f"{rm}[:, None] & {c_mask}[None, :]" if rm and c_mask else
                           f"{rm}[:, None]" if rm else f"{c_mask}[None, :]" if c_mask else None)
        if p.overwrite:
            m = both(r_mask)
            s(f"v = tl.load(src_ptr + {tile(src_row, src_col)}{', mask=' + m if m else ''})")
            s(f"tl.store(dst_ptr + {tile(dst_row, dst_col)}, v, mask={both('ok')})  # an invalid index writes nothing")
        elif p.accumulate:
            m = both(r_mask)
            kw = f", mask={m}" if m else ""
            acc = "tl.float32" if (self.temp or p.dtype != "float32") else None
            v = f"tl.load(src_ptr + {tile(src_row, src_col)}{kw})"
            if acc:
                v += ".to(tl.float32)"
            s(f"v = {v}")
            if p.alpha != 1:
                s(f"v = v * {cg.float_literal(p.alpha)}")
            if not self.temp and p.dtype != "float32":
                s(f"v = v.to({self.T})")
            s(f"tl.atomic_add(dst_ptr + {tile(dst_row, dst_col)}, v, mask={both('ok')}, sem=\"relaxed\")")
        else:
            other = "float('nan')" if cg.is_float(p.dtype) else "0"
            s(f"v = tl.load(src_ptr + {tile(src_row, src_col)}, mask={both('ok')}, other={other})")
            m = both(r_mask)
            s(f"tl.store(dst_ptr + {tile(dst_row, dst_col)}, v{', mask=' + m if m else ''})")
        s.dedent().blank()
        grid = (-(-p.R // br), -(-p.Q // bd))
        if grid[1] > 65535:
            raise ValueError(f"BLOCK_D {bd} leaves {grid[1]} column programs (grid dim 1 is at most 65535)")
        return Launch(kname, grid, (("in", p.src), ("in", p.idx), ("tmp", 0) if self.temp else ("out", 0),
                                    ("tmp", 1 if self.temp else 0)), {"BLOCK_R": br, "BLOCK_D": bd}, warps, 1)

    def elements_kernel(self) -> Launch:
        p, s, c = self.p, self.s, self.c
        block, warps = int(c["BLOCK"]), int(c["num_warps"])
        dst_k = 3 if self.temp else 2
        ind = p.ind_stride[1 if self.temp else 0]
        kname = "gather_kernel" if p.name == "gather" else "scatter_add_kernel"
        s("@triton.jit", f"def {kname}(src_ptr, idx_ptr, dst_ptr, flag_ptr, BLOCK: tl.constexpr):").indent()
        s("# BLOCK elements of the index tensor, in its memory order")
        sets = [p.r_strides[0], p.r_strides[1], p.r_strides[dst_k]]
        offs, mask = cg.block_offsets(s, "e", "tl.program_id(0)", "BLOCK", block, p.R, p.wide, "mask", p.r_sizes, sets, "k")
        src_off, idx_off, dst_off = self._named(["src_off", "", "dst_off"], offs)
        self._idx(idx_off, mask, "e", "BLOCK")
        # an offset with no term ("0": one index element, or a tensor broadcast over the index)
        # is made a block wherever a block mask or value meets its pointer (``cg.as_block``)
        at = lambda off: f"{'' if off == '0' else off + ' + '}{cg.scaled('i', ind)}"  # noqa: E731
        if p.accumulate:
            dst_off = cg.as_block(at(dst_off), "e")
            kw = f", mask={mask}" if mask else ""
            v = f"tl.load(src_ptr + {cg.as_block(src_off, 'e') if mask else src_off}{kw})"
            if self.temp:
                v += ".to(tl.float32)"
            s(f"v = {v}")
            s(f"tl.atomic_add(dst_ptr + {dst_off}, v, mask=ok, sem=\"relaxed\")")
        else:
            src_off = cg.as_block(at(src_off), "e")
            other = "float('nan')" if cg.is_float(p.dtype) else "0"
            s(f"v = tl.load(src_ptr + {src_off}, mask=ok, other={other})")
            kw = f", mask={mask}" if mask else ""
            s(f"tl.store(dst_ptr + {cg.as_block(dst_off, 'e')}, v{kw})")
        s.dedent().blank()
        return Launch(kname, (-(-p.R // block),), (("in", p.src), ("in", p.idx), ("tmp", 0) if self.temp else ("out", 0),
                                                   ("tmp", 1 if self.temp else 0)), {"BLOCK": block}, warps, 1)


def _wrap(expr: str) -> str:
    return f"({expr})" if " " in expr else expr


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


FAMILY = IndexingFamily()
