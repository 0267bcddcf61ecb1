"""aten.topk: the k largest (or smallest) values of every row along a dim, and their indices.

A program owns BLOCK_M rows; a whole row (N padded to BLOCK_N, a power of two) sits in registers.
Each value becomes one int64 key that orders like ATen and carries its column:

    key32  = float bits, negatives flipped (x ^ ((x >> 31) & 0x7FFFFFFF)): integer order = float
             order, with NaN made the largest (as ATen orders it) and -0.0 just below +0.0
    packed = key32 << 32 | (BLOCK_N - 1 - column)        (largest=False: ~key32)

Keys are distinct within a row, so selecting the k largest keys is exact, and on equal values the
lower column wins. VARIANT "bitonic" takes them with ``tl.topk`` (a bitonic top-k over the row);
VARIANT "passes" runs k rounds of max-and-remove (cheap for short rows or small k). Values and
indices are unpacked from the selected keys (the value bits are exact, NaN comes back as a
canonical NaN) and stored sorted, largest first (smallest first for largest=False).

Ties: ATen does not specify which of equal values comes first; on exact ties the values agree and
the indices may differ. Random trials draw rows without ties (``sample_inputs``); on inputs with
ties (captured from a model, or check mode) ``resolve_ties`` accepts any index that names an
element equal to the reference's, as long as a row names no element twice.

Shape buckets (core/buckets.py): along the last dim of contiguous tensors, where only leading dims
vary, the same kernel takes the number of rows as the argument ``n_rows`` (every block masked by
it; the row length, k and the int64 decision stay those of the representative, the upper edge).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import (Config, PicksAlongDim, doubled_and_halved, sample_tensor,
                                                   to_device)
from torch_kernelize.core.buckets import product, unbucketable
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec

MAX_K = 64
MAX_N = 16384
MAX_TILE = 16384          # int64 keys of one BLOCK_M x BLOCK_N tile
PAD = "-9223372036854775807"   # below every real key (those are > -2^63 + 2^32)


@dataclasses.dataclass
class _Plan:
    dtype: str
    k: int
    largest: bool
    M: int
    N: int
    m_sizes: tuple[int, ...]
    m_strides: list[tuple[int, ...]]   # [in, values, indices]
    n_strides: tuple[int, int, int]    # along the dim: in, values, indices
    dim: int
    wide: bool


class TopkFamily(PicksAlongDim):
    name = "topk"
    ops = frozenset({"aten.topk.default"})
    edge_kinds = ("large", "negative", "special")   # no "zeros": all ties

    def _analyse(self, spec: KernelSpec) -> _Plan | str:
        a, x = cg.operand(spec, "self", cg.FLOAT_TYPES)
        k, d = a.get("k"), a.get("dim", -1)
        largest, srt = a.get("largest", True), a.get("sorted", True)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
            return f"k={k!r}: only 1 <= k <= {MAX_K} is generated"
        if not srt:
            return "sorted=False: ATen leaves the order unspecified (CPU and CUDA differ), so it cannot be validated"
        d = cg.dim_arg(d, len(x.shape))
        if isinstance(d, str):
            return d
        N = cg.as_1d(x).shape[d]
        if k > N:
            return f"k={k} > {N} elements"
        if N > MAX_N:
            return f"rows of {N} > {MAX_N} elements do not fit in registers"
        if any(s > 1 and st == 0 for s, st in zip(x.shape, x.stride)):
            return "expanded (stride-0) input"
        out_shape = tuple(x.shape[:d]) + (k,) + tuple(x.shape[d + 1:]) if x.shape else ()  # 0-d: k is 1
        if len(spec.outputs) != 2 or tuple(spec.outputs[0].shape) != out_shape or tuple(spec.outputs[1].shape) != out_shape:
            return f"outputs {[o.shape for o in spec.outputs]} are not two {out_shape}"
        v, ix = spec.outputs
        if v.dtype != x.dtype or ix.dtype != "int64":
            return "outputs are not (values in the input dtype, int64 indices)"
        r = cg.rows_along(tuple(map(cg.as_1d, (x, v, ix))), d)  # 0-d: one row of 1
        return _Plan(x.dtype, k, bool(largest), r.M, N, r.m_sizes, r.m_strides, r.n_strides, d, r.wide)

    # --- configs ------------------------------------------------------------------------------
    def _valid(self, plan: _Plan, c: Config) -> bool:
        bm, v, w = c["BLOCK_M"], c["VARIANT"], c["num_warps"]
        if v not in ("bitonic", "passes") or w not in (1, 2, 4, 8, 16) or not _is_pow2(bm):
            return False
        return bm <= _p2(plan.M) and bm * _p2(plan.N) <= MAX_TILE

    def _cfg(self, plan: _Plan, rows_elems: int, variant: str, warps: int | None = None) -> Config:
        n = _p2(plan.N)
        bm = max(1, min(max(1, rows_elems // n), _p2(plan.M), MAX_TILE // n))
        w = warps or max(1, min(8, bm * n // 256))
        return Config.of(BLOCK_M=bm, VARIANT=variant, num_warps=w)

    def _seeds(self, spec: KernelSpec, plan: _Plan) -> list[Config]:
        return [self._cfg(plan, 2048, "bitonic"), self._cfg(plan, 2048, "passes"),
                self._cfg(plan, 8192, "bitonic"), self._cfg(plan, 512, "passes", 2)]

    def _steps(self, plan: _Plan, c: Config) -> list[Config]:
        return doubled_and_halved(c, ("BLOCK_M", "num_warps")) + [
            c.replace(VARIANT="passes" if c["VARIANT"] == "bitonic" else "bitonic")]

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        return self._program(spec, self.checked_plan(spec, config), config)

    def _program(self, spec: KernelSpec, p: _Plan, config: Config, rows: Any = None) -> KernelProgram:
        """The module of ``generate``; ``rows``, a bucketed kernel's number of rows as a SizeExpr,
        makes it the run-time argument ``n_rows`` (the one thing that differs between the two)."""
        bm, warps, variant = int(config["BLOCK_M"]), int(config["num_warps"]), config["VARIANT"]
        bn, kp = _p2(p.N), _p2(p.k)
        s = cg.Source()
        s(cg.HEADER, cg.describe_spec(spec))
        count = f"{p.M} rows" if rows is None else f"n_rows rows (a run-time size, at most {p.M})"
        s(f"# {count} over sizes {list(p.m_sizes)}, strides [in, values, indices] {[list(x) for x in p.m_strides]}",
          f"# rows of {p.N} (stride {p.n_strides[0]}), padded to BLOCK_N = {bn}; k = {p.k} "
          f"{'largest' if p.largest else 'smallest'}, taken as the {kp} largest keys", "")
        s("@triton.jit", f"def topk_kernel(in0_ptr, out0_ptr, out1_ptr{'' if rows is None else ', n_rows'}, "
          "BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K: tl.constexpr):").indent()
        offs, rm = cg.block_offsets(s, "rows", "tl.program_id(0)", "BLOCK_M", bm, p.M if rows is None else "n_rows",
                                    p.wide, "row_mask", p.m_sizes, p.m_strides, "m")
        for name, off in zip(("in_row", "val_row", "idx_row"), offs):
            s(f"{name} = {cg.as_block(off, 'rows')}")
        s("cols = tl.arange(0, BLOCK_N)")
        masks = [f"{rm}[:, None]"] if rm else []
        if bn != p.N:
            s(f"col_mask = cols < {p.N}")
            masks.append("col_mask[None, :]")
        kw = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
        s(f"x = tl.load(in0_ptr + in_row[:, None] + {_scaled('cols', p.n_strides[0])}[None, :]{kw})"
          f"{'' if p.dtype == 'float32' else '.to(tl.float32)'}")
        s("# an int32 key with the float order (NaN largest), then the column below it",
          "bits = x.to(tl.int32, bitcast=True)",
          "key = bits ^ ((bits >> 31) & 0x7FFFFFFF)",
          "key = tl.where(x != x, 0x7FC00000, key)")
        if not p.largest:
            s("key = ~key  # smallest first")
        s("packed = (key.to(tl.int64) << 32) | (BLOCK_N - 1 - cols).to(tl.int64)[None, :]")
        if bn != p.N:
            s(f"packed = tl.where(col_mask[None, :], packed, {PAD})")
        if variant == "bitonic":
            s("top = tl.topk(packed, K)  # [BLOCK_M, K], largest key first")
        else:
            s("kc = tl.arange(0, K)",
              f"top = tl.full([BLOCK_M, K], {PAD}, tl.int64)")
            s(f"for j in {'tl.static_range' if kp <= 8 else 'range'}({p.k}):").indent()
            s("best = tl.max(packed, axis=1)",
              "top = tl.where(kc[None, :] == j, best[:, None], top)",
              f"packed = tl.where(packed == best[:, None], {PAD}, packed)  # keys are distinct: removes one")
            s.dedent()
        s("key = (top >> 32).to(tl.int32)")
        if not p.largest:
            s("key = ~key")
        s("bits = key ^ ((key >> 31) & 0x7FFFFFFF)",
          f"values = bits.to(tl.float32, bitcast=True){'' if p.dtype == 'float32' else '.to(' + cg.tl_type(p.dtype) + ')'}",
          "indices = (BLOCK_N - 1 - (top & 0xFFFFFFFF)).to(tl.int64)",
          "kk = tl.arange(0, K)")
        kmask = [f"{rm}[:, None]"] if rm else []
        if kp != p.k:
            kmask.append(f"(kk < {p.k})[None, :]")
        kw = f", mask={' & '.join(kmask)}" if kmask else ""
        s(f"tl.store(out0_ptr + val_row[:, None] + {_scaled('kk', p.n_strides[1])}[None, :], values{kw})",
          f"tl.store(out1_ptr + idx_row[:, None] + {_scaled('kk', p.n_strides[2])}[None, :], indices{kw})")
        s.dedent()
        args, sizes = (("in", 0), ("out", 0), ("out", 1)), {}
        if rows is not None:
            args, sizes = cg.runtime_size(args, p.M, rows, bm, p.M + bm > cg.INT32_MAX)
        launch = Launch("topk_kernel", (-(-p.M // bm),), args, {"BLOCK_M": bm, "BLOCK_N": bn, "K": kp}, warps, 1,
                        runtime_sizes=sizes)
        return KernelProgram(s.text(), (launch,))

    # --- shape buckets ------------------------------------------------------------------------
    def bucket_support(self, spec: KernelSpec, dims) -> str | None:
        """Buckets over the rows: topk along the last dim of a contiguous input into contiguous
        outputs, only leading dims varying, each with the same variable in the input and both
        outputs. The rows are then one run of stride N (k in the outputs), literal in the kernel."""
        plan = self.plan(spec)
        if isinstance(plan, str):
            return plan
        if problem := unbucketable(spec, dims):
            return problem
        ndim = len(spec.inputs[0].shape)
        if plan.dim != ndim - 1:
            return f"topk along dim {plan.dim}, not the last: the rows are not the leading dims"
        for side, metas in (("in", spec.inputs), ("out", spec.outputs)):
            if bad := [i for i, m in enumerate(metas) if not m.is_contiguous()]:
                return f"{side}put {bad[0]} is not contiguous: its strides are no function of its sizes"
        var_in = {d: v for side, _, d, v in dims if side == "in"}
        if plan.dim in var_in:
            return f"the topk dim {plan.dim} varies: the row length is literal in the kernel"
        for k in range(len(spec.outputs)):
            if {d: v for side, i, d, v in dims if side == "out" and i == k} != var_in:
                return f"output {k} varies in other dims than the input's rows"
        if len(plan.m_sizes) > 1:
            return "the rows are not one strided run"
        return None

    def generate_bucketed(self, spec: KernelSpec, config: Config, dims) -> KernelProgram:
        """The kernel of ``generate`` with the number of rows a run-time argument ``n_rows``: one
        binary serves every size of the bucket (its launch's grid and ``n_rows`` are SizeExprs).
        Offsets and int64 indexing are decided at the representative, the bucket's largest size."""
        if problem := self.bucket_support(spec, dims):
            raise ValueError(f"{spec.describe()} cannot be bucketed: {problem}")
        plan = self.checked_plan(spec, config)
        var_of = {d: v for side, _, d, v in dims if side == "in"}
        lead = spec.inputs[0].shape[:plan.dim]
        return self._program(spec, plan, config, product([f"v{var_of[d]}" if d in var_of else n
                                                          for d, n in enumerate(lead)]))

    # --- validation inputs --------------------------------------------------------------------
    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Rows of distinct values (ties would let indices legitimately differ from ATen's);
        "special" puts one NaN, +inf and -inf in each row."""
        plan = self.plan(spec)
        g = torch.Generator().manual_seed(seed)
        m = spec.inputs[0]
        if isinstance(plan, str):
            return [to_device(sample_tensor(mm, g, kind), device) for mm in spec.inputs]
        rows = _distinct_rows(plan.M, plan.N, m.torch_dtype, g, kind)
        keep = [j for j in range(len(m.shape)) if j != plan.dim]
        logical = rows.reshape([m.shape[j] for j in keep] + [plan.N]).movedim(-1, plan.dim)
        x = sample_tensor(m, g, "zeros")
        x.copy_(logical.reshape(m.shape))  # a 0-d input: its one row of 1
        return [to_device(x, device)]


def _distinct_rows(M: int, N: int, dtype: torch.dtype, g: torch.Generator, kind: str) -> torch.Tensor:
    """[M, N] values of ``dtype``, distinct within each row, spread over many magnitudes."""
    pool = torch.empty(0, dtype=dtype)
    n = 4 * N + 64
    while pool.numel() < 2 * N:
        v = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(1.5 * torch.randn(n, generator=g, dtype=torch.float64))
        if kind == "large":
            v = v * (100.0 if dtype == torch.float16 else 1e4)
        elif kind == "negative":
            v = -v.abs() - 0.5
        v = v.to(dtype)
        pool = torch.unique(torch.cat([pool, v[v.isfinite()]]))
        n *= 2
    out = torch.empty(M, N, dtype=dtype)
    chunk = max(1, (1 << 22) // pool.numel())
    for r0 in range(0, M, chunk):
        r1 = min(M, r0 + chunk)
        pick = torch.rand(r1 - r0, pool.numel(), generator=g).argsort(dim=1)[:, :N]
        out[r0:r1] = pool[pick]
    if kind == "special":
        specials = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
        for r in range(M):
            pos = torch.randperm(N, generator=g)[:min(3, N - 1) if N > 1 else 0]
            out[r, pos] = specials[:pos.numel()]
    return out


def _scaled(expr: str, stride: int) -> str:
    return expr if stride == 1 else f"({expr} * {stride})"


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


FAMILY = TopkFamily()
