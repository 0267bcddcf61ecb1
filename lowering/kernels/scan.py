"""aten.cumsum, aten.cumprod and aten.logcumsumexp: an inclusive prefix sum (product, log-sum-exp)
along one dim, any layout.

The input is seen as rows (the other dims, merged where contiguous) by the scanned dim of length
N. A program owns BLOCK_M rows and walks N in blocks of BLOCK_N: each block is scanned with
``tl.cumsum`` (an associative scan in registers) and offset by the carried sum of the blocks
before it. Long rows with few of them (one row of millions) would leave the GPU idle: SPLIT > 1
cuts every row into SPLIT chunks; a first kernel sums each chunk into a temporary, a second scans
each chunk starting from the sum of the chunks before it (read from the temporary).
cumprod is the same scan with ``tl.cumprod`` and a carried product (SPLIT = 1 only): a zero, an
inf or a NaN anywhere in the prefix gives what ATen's sequential product gives.
logcumsumexp (float inputs only) is ``tl.associative_scan`` with ATen's log-add-exp,
max + log1p(exp(min - max)), and a carried log-sum-exp (SPLIT = 1 only): -inf is its identity
(padding and the first carry), two equal infinities combine to themselves (not inf - inf = NaN), a
NaN propagates.

Types follow ATen: the result dtype is ``dtype=`` if given, else the input's (integers and bool
promote to int64); the input is converted to it first (a float to an integer truncates toward
zero, as C casts; MoE routing takes the cumsum of float histc counts as int32). Floating types
accumulate in fp32 (fp16 and bf16 round once, on store), integers in int64 (exact, wrapping like
ATen). A float outside the integer's range (or NaN) converts to no defined value in C, so
validation draws float inputs of integer cumsums within +-1000.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import (Config, KernelFamily, doubled_and_halved, sample_generator,
                                                   sample_tensor, to_device)
from torch_kernelize.core.program import Buffer, KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.lowering.kernels.elementwise import HELPERS

IN_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")
OUT_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32")
MAX_TILE = 16384          # elements of one BLOCK_M x BLOCK_N tile
KINDS = {"aten.cumsum.default": "sum", "aten.cumprod.default": "prod", "aten.logcumsumexp.default": "logsumexp"}
IDENTITY = {"sum": "0", "prod": "1", "logsumexp": "float('-inf')"}   # padding and the first carry


@dataclasses.dataclass
class _Plan:
    in_dtype: str
    out_dtype: str
    acc: str                           # float32 | int64
    M: int
    N: int
    m_sizes: tuple[int, ...]
    m_strides: list[tuple[int, ...]]   # [in, out] over m_sizes
    n_stride: tuple[int, int]          # (in, out) stride of the scanned dim
    wide: bool
    kind: str = "sum"                  # sum | prod | logsumexp


class CumsumFamily(KernelFamily):
    name = "scan"
    ops = frozenset(KINDS)
    edge_kinds = ("zeros", "large", "negative", "special")

    def _analyse(self, spec: KernelSpec) -> _Plan | str:
        a, x = cg.operand(spec, "self", IN_DTYPES)
        if len(spec.outputs) != 1:
            return f"expected one output, got {len(spec.outputs)}"
        o = spec.outputs[0]
        if o.dtype not in OUT_DTYPES:
            return f"{spec.op} to {o.dtype} is not generated"
        if tuple(o.shape) != tuple(x.shape):
            return "output shape differs from the input's"
        if x.numel == 0:
            return "empty input"
        kind = KINDS[spec.op]
        if kind == "logsumexp" and not (cg.is_float(x.dtype) and o.dtype == x.dtype):
            return f"logcumsumexp of {x.dtype} to {o.dtype} is not generated (float inputs only)"
        d = cg.dim_arg(a.get("dim"), len(x.shape))
        if isinstance(d, str):
            return d
        if not x.shape:
            shape, xs, os_ = (1,), (0,), (0,)
        else:
            shape, xs, os_ = tuple(x.shape), tuple(x.stride), tuple(o.stride)
        keep = [k for k in range(len(shape)) if k != d]
        m_sizes, m_strides = cg.simplify([shape[k] for k in keep], [tuple(xs[k] for k in keep),
                                                                    tuple(os_[k] for k in keep)], order_by=0)
        M, N = math.prod(shape[k] for k in keep), shape[d]
        acc = "float32" if cg.is_float(o.dtype) else "int64"
        # blocks never reach past twice a dim (BLOCK <= next_pow2 of it): bound the offsets by that
        wide = any(2 * (cg.max_offset(m.shape, m.stride) + sum(abs(v) for v in m.stride)) + 2 > cg.INT32_MAX
                   for m in (x, o)) or 2 * x.numel > cg.INT32_MAX
        return _Plan(x.dtype, o.dtype, acc, M, N, m_sizes, m_strides, (xs[d], os_[d]), wide, kind)

    # --- configs ------------------------------------------------------------------------------
    def _valid(self, plan: _Plan, c: Config) -> bool:
        bm, bn, split = c["BLOCK_M"], c["BLOCK_N"], c["SPLIT"]
        if not all(_is_pow2(v) for v in (bm, bn, split)) or c["num_warps"] not in (1, 2, 4, 8, 16):
            return False
        if plan.kind != "sum" and split > 1:
            return False  # (chunk products and log-sum-exps: not generated)
        if bm * bn > MAX_TILE or bm > _p2(plan.M):
            return False
        chunk = -(-plan.N // split)
        if bn > _p2(chunk) or (split > 1 and (split * bn > 2 * plan.N or split > 1024)):
            return False
        return True

    def _cfg(self, plan: _Plan, tile: int, bn: int, split: int = 1, warps: int | None = None) -> Config:
        chunk = -(-plan.N // split)
        bn = max(1, min(bn, _p2(chunk), MAX_TILE))
        bm = max(1, min(max(1, tile // bn), _p2(plan.M)))
        w = warps or max(1, min(8, bm * bn // 512))
        return Config.of(BLOCK_M=bm, BLOCK_N=bn, SPLIT=split, num_warps=w)

    def _seeds(self, spec: KernelSpec, plan: _Plan) -> list[Config]:
        seeds = [self._cfg(plan, 4096, 4096), self._cfg(plan, 8192, 1024), self._cfg(plan, 2048, 256)]
        if plan.M < 264 and plan.N >= 65536 and plan.kind == "sum":
            # few long rows: split them so that a few hundred programs share the work (132 SMs)
            split = max(2, min(1024, _floor2(max(2, 528 // plan.M)), _floor2(plan.N // 4096)))
            seeds.append(self._cfg(plan, 4096, 4096, split, 8))
        return seeds

    def _steps(self, plan: _Plan, c: Config) -> list[Config]:
        return doubled_and_halved(c, ("BLOCK_M", "BLOCK_N", "SPLIT", "num_warps"))

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.checked_plan(spec, config)
        p = plan
        bm, bn, warps = int(config["BLOCK_M"]), int(config["BLOCK_N"]), int(config["num_warps"])
        chunk = -(-p.N // int(config["SPLIT"]))
        chunk = -(-chunk // bn) * bn                     # whole blocks per chunk
        split = -(-p.N // chunk)                         # chunks actually needed
        acc = cg.tl_type(p.acc)
        s = cg.Source()
        s(cg.HEADER, cg.describe_spec(spec))
        if p.kind == "logsumexp":
            s.blank()(HELPERS["_log1p"].strip("\n")).blank()(_LOGADDEXP.strip("\n")).blank()
        s(f"# {p.M} rows over sizes {list(p.m_sizes)}, strides [in, out] {[list(x) for x in p.m_strides]}",
          f"# scanned dim: {p.N} long, stride in {p.n_stride[0]}, out {p.n_stride[1]}; accumulates in {p.acc}")
        if split > 1:
            s(f"# {split} chunks of {chunk} per row: chunk_sums_kernel -> tmp0 [{p.M}, {split}], then scans")
        s.blank()

        def rows() -> str | None:
            offs, rm = cg.block_offsets(s, "rows", "tl.program_id(0)", "BLOCK_M", bm, p.M, p.wide, "row_mask",
                                        p.m_sizes, p.m_strides, "m")
            for name, off in zip(("in_row", "out_row"), offs):
                s(f"{name} = {cg.as_block(off, 'rows')}")
            return rm

        def load(start: str, rm: str | None, end: int) -> str:
            s(f"cols = {start} + tl.arange(0, BLOCK_N)")
            masks = ([f"{rm}[:, None]"] if rm else [])
            if p.N % bn or split > 1:
                masks.append(f"(cols < {end})[None, :]")
            if masks:
                s(f"mask = {' & '.join(masks)}")
            conv = ""
            if p.in_dtype != p.out_dtype:
                conv += f".to({cg.tl_type(p.out_dtype)})"    # ATen converts to dtype= first
            if p.out_dtype != p.acc:
                conv += f".to({acc})"
            kw = f", mask=mask, other={IDENTITY[p.kind]}" if masks else ""
            s(f"x = tl.load(in0_ptr + in_row[:, None] + {_col(p.n_stride[0])}[None, :]{kw}){conv}")
            return "mask" if masks else ""

        launches, temps = [], []
        if split > 1:
            temps.append(Buffer((p.M, split), p.acc))
            s("@triton.jit", "def chunk_sums_kernel(in0_ptr, sums_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):").indent()
            s("chunk = tl.program_id(1)")
            rm = rows()
            s(f"total = tl.zeros([BLOCK_M], dtype={acc})",
              f"for n0 in range(0, {chunk}, BLOCK_N):").indent()
            load(f"chunk * {chunk} + n0", rm, p.N)
            s("total += tl.sum(x, axis=1)")
            s.dedent()
            s(f"tl.store(sums_ptr + rows * {split} + chunk, total{', mask=' + rm if rm else ''})")
            s.dedent().blank()
            launches.append(Launch("chunk_sums_kernel", (-(-p.M // bm), split), (("in", 0), ("tmp", 0)),
                                   {"BLOCK_M": bm, "BLOCK_N": bn}, warps, 1))
        params = ["in0_ptr", "out0_ptr"] + (["sums_ptr"] if split > 1 else []) + ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"]
        s("@triton.jit", f"def cumsum_kernel({', '.join(params)}):").indent()
        rm = rows()
        if split > 1:
            sp = _p2(split)
            s("chunk = tl.program_id(1)",
              "# the carry: the sums of the chunks before this one",
              f"k = tl.arange(0, {sp})",
              f"before = tl.load(sums_ptr + rows[:, None] * {split} + k[None, :], "
              f"mask={rm + '[:, None] & ' if rm else ''}(k < chunk)[None, :], other=0)",
              "carry = tl.sum(before, axis=1)")
            start, length = f"chunk * {chunk} + n0", chunk
        else:
            s(f"carry = tl.full([BLOCK_M], {IDENTITY[p.kind]}, dtype={acc})")
            start, length = "n0", p.N
        single = length <= bn
        if single:
            s("n0 = 0")
        else:
            s(f"for n0 in range(0, {length}, BLOCK_N):").indent()
        m = load(start, rm, p.N)
        s({"sum": "y = tl.cumsum(x, axis=1) + carry[:, None]", "prod": "y = tl.cumprod(x, axis=1) * carry[:, None]",
           "logsumexp": "y = _logaddexp(tl.associative_scan(x, 1, _logaddexp), carry[:, None])"}[p.kind])
        out = "y" if p.out_dtype == p.acc else f"y.to({cg.tl_type(p.out_dtype)})"
        s(f"tl.store(out0_ptr + out_row[:, None] + {_col(p.n_stride[1])}[None, :], {out}"
          f"{', mask=' + m if m else ''})")
        if not single:
            # the carry is the block's last prefix (a sum of x next to the scan trips triton 3.6's
            # thread-locality pass)
            s("carry = tl.sum(tl.where((tl.arange(0, BLOCK_N) == BLOCK_N - 1)[None, :], y, 0), axis=1)")
            s.dedent()
        s.dedent()
        args = (("in", 0), ("out", 0)) + ((("tmp", 0),) if split > 1 else ())
        launches.append(Launch("cumsum_kernel", (-(-p.M // bm), split), args, {"BLOCK_M": bm, "BLOCK_N": bn},
                               warps, 1 if single else 2))
        return KernelProgram(s.text(), tuple(launches), temps=tuple(temps))

    # --- validation inputs --------------------------------------------------------------------
    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """By ``kind``; floats summed as integers stay within +-1000 (no inf, NaN or overflow,
        whose conversion C leaves undefined)."""
        plan = self.plan(spec)
        if isinstance(plan, str) or not (cg.is_float(plan.in_dtype) and not cg.is_float(plan.out_dtype)):
            return super().sample_inputs(spec, seed, kind, device)
        g = sample_generator(seed, device)
        bounds = {"zeros": (0.0, 0.0), "negative": (-1000.0, -0.5)}.get(kind, (-1000.0, 1000.0))
        return [to_device(sample_tensor(m, g, "random", *bounds), device) for m in spec.inputs]


_LOGADDEXP = '''
@triton.jit
def _logaddexp(a, b):
    # ATen's log_add_exp: max + log1p(exp(min - max)); a NaN propagates (neither compares
    # greater); equal infinities give themselves, where min - max would be inf - inf = NaN
    hi = tl.where(a > b, a, b)
    lo = tl.where(a > b, b, a)
    same_inf = (lo == hi) & (tl.abs(hi) == float('inf'))
    return tl.where(same_inf, hi, hi + _log1p(tl.exp(tl.where(same_inf, 0.0, lo - hi))))
'''


def _col(stride: int) -> str:
    """The column offsets ``cols * stride`` (a 1-long scanned dim may have stride 0)."""
    if stride == 1:
        return "cols"
    return f"(cols * {stride})"


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _floor2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def _is_pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


FAMILY = CumsumFamily()
