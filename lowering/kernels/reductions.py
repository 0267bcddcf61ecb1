"""Row reductions: sum, mean, prod, amax, amin, var/std/var_mean over any dims, and softmax/log_softmax.

The input is seen as a matrix: the kept dims form the row axis M, the reduced dims the column axis
R (each ordered by the input's strides and merged where contiguous; what does not merge is
indexed by div/mod with literal sizes, so any layout works, and the common one is a single
stride per axis). A program owns BLOCK_M rows and walks R in BLOCK_R columns: one pass when
BLOCK_R covers R (the tile stays in registers), else a loop with a BLOCK_M x BLOCK_R accumulator
reduced at the end. Triton lays the tile out along whichever axis is contiguous, so reducing the
last dim and reducing an outer dim (M contiguous) are both coalesced.

Few rows and a long R (e.g. a full reduction) leave most of the GPU idle: SPLIT > 1 cuts R into
SPLIT chunks reduced by separate programs into a temporary of the accumulation type, and a second
small kernel combines the partials (sum / product / max / min directly; var by Chan's parallel formula).

Dtypes: fp32/fp16/bf16 accumulate in fp32, float64 in float64 (every kind); integer and bool inputs
(sum, prod, amax, amin; mean with a float dtype=) in int64, exactly: sums and products wrap around
as ATen's, whose promotion the outputs follow (sum/prod of ints and bools -> int64 unless dtype=).
Results are rounded (or truncated) to the output dtype on store. Softmax uses the online max/sum
update when R does not fit one block. Rows of no elements (R == 0) get the value ATen gives them
(0, 1, NaN) from a kernel that reads nothing.

Shape buckets (core/buckets.py): where only the kept leading dims vary and every tensor is
contiguous, the same kernel takes the number of rows as the argument ``n_rows`` (the reduced
length stays literal); SPLIT > 1 is not bucketed (its temporary is sized by the rows).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import (Config, KernelFamily, doubled_and_halved, sample_generator,
                                                   to_device)
from torch_kernelize.core.buckets import product
from torch_kernelize.core.program import Buffer, KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec, TensorMeta

REDUCE_OPS = {
    "aten.sum.dim_IntList": "sum", "aten.sum.default": "sum",
    "aten.prod.dim_int": "prod", "aten.prod.default": "prod",
    "aten.mean.dim": "mean", "aten.mean.default": "mean",
    "aten.amax.default": "amax", "aten.amin.default": "amin",
    "aten.var.correction": "var", "aten.std.correction": "std", "aten.var_mean.correction": "var_mean",
}
SOFTMAX_OPS = {"aten._softmax.default": "softmax", "aten._log_softmax.default": "log_softmax"}

MAX_TILE = 32768        # elements of one BLOCK_M x BLOCK_R fp32 tile (registers; half that for 8-byte types)
INF = "float('inf')"
FLOATS = cg.FLOAT_TYPES + ("float64",)
ALL_TYPES = FLOATS + cg.INT_TYPES + ("bool",)
INT_KINDS = ("sum", "prod", "amax", "amin")   # the kinds ATen defines on integer and bool inputs
# what a row of no elements reduces to (ATen: mean and var of nothing are NaN; amax/amin raise)
EMPTY_VALUES = {"sum": 0, "prod": 1, "mean": "nan", "var": "nan", "std": "nan", "var_mean": "nan"}


def _acc_type(dtype: str) -> str:
    """What values of ``dtype`` are reduced in: fp32 for fp32/fp16/bf16, float64, else int64
    (integer sums and products wrap around in 64 bits, like ATen's, and are exact)."""
    return "float64" if dtype == "float64" else "float32" if dtype in cg.FLOAT_TYPES else "int64"


def _types(kind: str, src: str, args: dict[str, Any]) -> tuple[str | None, str, str] | str:
    """(pre_cast, accumulation type, output dtype) of ``kind`` on a ``src`` input, as ATen types
    it; or why it is not generated. ``dtype=`` (sum/mean/prod) converts the input first."""
    if src not in FLOATS and kind not in INT_KINDS and not (kind == "mean" and args.get("dtype") is not None):
        return f"{kind} of dtype {src} is not generated (ATen defines it on floating inputs only)"
    cast = None
    if kind in ("sum", "mean", "prod"):
        cast = cg.dtype_arg(args.get("dtype"))
        if args.get("dtype") is not None and cast is None:
            return f"bad dtype argument {args.get('dtype')!r}"
        if cast is not None and not (cast in FLOATS or (cast in cg.INT_TYPES and src not in FLOATS and kind != "mean")):
            return f"{kind} of {src} with dtype={cast} is not generated (float, or int from int/bool only)"
    if cast is None and kind in ("sum", "prod") and src not in FLOATS:
        cast = "int64"      # ATen: the sum/product of integers or bools is int64
    value = cast or src
    acc = _acc_type(value)
    return (cast if cast not in (None, src, acc) else None), acc, value


@dataclasses.dataclass
class _Plan:
    kind: str                         # sum mean prod amax amin var std var_mean softmax log_softmax
    in_dtype: str
    pre_cast: str | None              # sum/mean/prod dtype=: the input is converted to this first
    out_dtypes: list[str]
    M: int
    R: int
    m_sizes: tuple[int, ...]          # row axis, merged
    m_strides: list[tuple[int, ...]]  # [input, output0, output1...] strides over m_sizes
    r_sizes: tuple[int, ...]          # reduced axis, merged
    r_strides: list[tuple[int, ...]]  # [input] (+ [output] for softmax)
    denom: float = 0.0                # var: max(0, R - correction)
    kept: tuple[int, ...] = ()        # the input's dims that form the rows, in order
    acc: str = "float32"              # what the kernel computes in: float32, float64 or int64


def _norm_dims(dims: Any, ndim: int) -> list[int] | str:
    if dims is None or dims == []:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    out = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            return f"bad dim {d!r}"
        n = max(ndim, 1)
        if not -n <= d < n:
            return f"dim {d} out of range for {ndim}-d input"
        out.append(d % n if ndim else 0)
    if len(set(out)) != len(out):
        return "repeated dim"
    return sorted(set(out) & set(range(ndim))) if ndim else []


class ReductionFamily(KernelFamily):
    name = "reductions"
    ops = frozenset(REDUCE_OPS) | frozenset(SOFTMAX_OPS)
    edge_kinds = ("zeros", "large", "negative", "special")

    # --- analysis ---------------------------------------------------------------------------
    def _analyse(self, spec: KernelSpec) -> _Plan | str:
        args, x = cg.operand(spec, "self", ALL_TYPES)
        kind = REDUCE_OPS.get(spec.op) or SOFTMAX_OPS[spec.op]
        types = _types(kind, x.dtype, args)
        if isinstance(types, str):
            return types
        pre_cast, acc, out_dtype = types
        if any(o.dtype != out_dtype for o in spec.outputs):
            return f"output dtypes {[o.dtype for o in spec.outputs]}: {kind} of {x.dtype} gives {out_dtype}"
        if x.numel == 0 and (kind not in EMPTY_VALUES or not all(o.numel for o in spec.outputs)):
            return "empty input: nothing to reduce"
        ndim = len(x.shape)
        denom = 0.0
        if kind in SOFTMAX_OPS.values():
            if args.get("half_to_float"):
                return "half_to_float=True is not generated (ATen refuses it on CPU, so it cannot be validated)"
            dims = _norm_dims(args.get("dim"), ndim)
            if isinstance(dims, str):
                return dims
            keep = [d for d in range(ndim) if d not in dims]
            exp_shapes = [x.shape]
        else:
            dims = _norm_dims(args.get("dim") if "dim" in args else None, ndim)
            if isinstance(dims, str):
                return dims
            keepdim = bool(args.get("keepdim", False))
            keep = [d for d in range(ndim) if d not in dims]
            if kind in ("var", "std", "var_mean"):
                c = args.get("correction")
                c = 1 if c is None else cg.scalar_value(c)
                if c is None:
                    return "correction must be a number"
                R = math.prod(x.shape[d] for d in dims)
                denom = float(max(0.0, R - c))
            shape = tuple(1 if d in dims else x.shape[d] for d in range(ndim)) if keepdim else \
                tuple(x.shape[d] for d in keep)
            exp_shapes = [shape] * (2 if kind == "var_mean" else 1)
        if len(spec.outputs) != len(exp_shapes) or any(tuple(o.shape) != tuple(s)
                                                        for o, s in zip(spec.outputs, exp_shapes)):
            return f"outputs {[o.shape for o in spec.outputs]} do not match the reduction {exp_shapes}"
        if any(o.device != x.device for o in spec.outputs):
            return "input and output devices differ"

        M = math.prod(x.shape[d] for d in keep)
        R = math.prod(x.shape[d] for d in dims)
        # row axis: kept dims, ordered by the input's strides; output strides of the same dims
        out_keep_strides = []
        for o in spec.outputs:
            if tuple(o.shape) == tuple(x.shape):          # softmax, or keepdim
                out_keep_strides.append(tuple(o.stride[d] for d in keep))
            elif len(o.shape) == len(keep):
                out_keep_strides.append(tuple(o.stride))
            else:
                out_keep_strides.append(tuple(o.stride[d] for d in keep))
        m_sizes, m_strides = cg.simplify([x.shape[d] for d in keep],
                                         [tuple(x.stride[d] for d in keep)] + out_keep_strides, order_by=0)
        r_sets = [tuple(x.stride[d] for d in dims)]
        if kind in SOFTMAX_OPS.values():
            r_sets.append(tuple(spec.outputs[0].stride[d] for d in dims))
        r_sizes, r_strides = cg.simplify([x.shape[d] for d in dims], r_sets, order_by=0)
        return _Plan(kind, x.dtype, pre_cast, [o.dtype for o in spec.outputs], M, R, m_sizes, m_strides,
                     r_sizes, r_strides, denom, tuple(keep), acc)

    # --- configs ------------------------------------------------------------------------------
    def _valid(self, plan: _Plan, c: Config) -> bool:
        bm, br, split = c["BLOCK_M"], c["BLOCK_R"], c["SPLIT"]
        if not all(_is_pow2(v) for v in (bm, br, split)):
            return False
        if c["num_warps"] not in (1, 2, 4, 8, 16) or c["num_stages"] not in (1, 2, 3, 4):
            return False
        if bm > _p2(plan.M) or bm * br > _max_tile(plan):
            return False
        if split > 1 and (plan.kind in SOFTMAX_OPS.values() or split > -(-plan.R // br)):
            return False
        chunk = -(-plan.R // split)
        if br > _p2(chunk):
            return False
        if split == 1 and br >= plan.R and c["num_stages"] != 1:
            return False  # single pass: no loop to pipeline
        return True

    def _cfg(self, plan: _Plan, bm: int, br: int, split: int = 1, warps: int | None = None,
             stages: int = 2) -> Config:
        bm = max(1, min(bm, _p2(plan.M)))
        chunk = -(-plan.R // split)
        br = max(1, min(br, _p2(chunk), _max_tile(plan) // bm))
        if split > 1:
            split = max(1, min(split, _floor2(-(-plan.R // br))))
        if warps is None:
            warps = max(1, min(16, (bm * br) // 512))
        single = split == 1 and br >= plan.R
        return Config.of(BLOCK_M=bm, BLOCK_R=br, SPLIT=split, num_warps=warps,
                         num_stages=1 if single else stages)

    def _seeds(self, spec: KernelSpec, plan: _Plan) -> list[Config]:
        R, M = plan.R, plan.M
        in_r = plan.r_strides[0][-1] if plan.r_sizes else 1
        in_m = plan.m_strides[0][-1] if plan.m_sizes else 0
        softmax = plan.kind in SOFTMAX_OPS.values()
        seeds = []
        if in_r != 1 and in_m == 1:
            # reducing an outer dim: rows are contiguous, walk R with a short block; with few row
            # blocks, split R too, so that a few hundred programs share the work (132 SMs)
            for bm, br, stages in ((64, 32, 3), (128, 16, 2), (32, 64, 2)):
                blocks = -(-M // min(bm, _p2(M)))
                split = max(1, min(_floor2(max(1, 528 // blocks)), _floor2(max(1, R // (br * 8)))))
                seeds.append(self._cfg(plan, bm, br, split if not softmax else 1, stages=stages))
        else:
            # softmax keeps a row in registers up to 16K columns; longer rows loop over 8K blocks
            # (measured best on an H200 for a 50K vocabulary)
            one = (_p2(R) if _p2(R) <= 16384 else 8192) if softmax else min(_p2(R), 4096)
            seeds += [self._cfg(plan, max(1, 4096 // one), one, stages=2),
                      self._cfg(plan, max(1, 2048 // min(_p2(R), 1024)), 1024, stages=2),
                      self._cfg(plan, max(1, 8192 // one), one, stages=3)]
        if not softmax and -(-M // seeds[0]["BLOCK_M"]) < 132 and R >= 8192:
            # few rows, long rows (132 SMs on an H200): split R into chunks of >= ~8K elements,
            # up to ~2K programs in all (a 16M-element sum was fastest with 2048 chunks)
            bm = 32 if in_m == 1 and in_r != 1 else 1
            split = max(2, min(_floor2(R // 8192), _floor2(max(2, 2048 // -(-M // bm)))))
            seeds += [self._cfg(plan, bm, 2048 if bm == 1 else 64, split, 4)]
        return seeds

    def _steps(self, plan: _Plan, c: Config) -> list[Config]:
        cands = doubled_and_halved(c, ("BLOCK_M", "BLOCK_R", "SPLIT", "num_warps"))
        cands += [c.replace(num_stages=c["num_stages"] + 1), c.replace(num_stages=c["num_stages"] - 1)]
        # growing BLOCK_R into a single pass drops the stages, which only apply to a loop
        cands += [x.replace(num_stages=1) for x in list(cands) if x["BLOCK_R"] >= plan.R and x["SPLIT"] == 1]
        return cands

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.checked_plan(spec, config)
        gen = _Gen(spec, plan, config)
        return gen.program()

    # --- shape buckets ------------------------------------------------------------------------
    def bucket_support(self, spec: KernelSpec, dims) -> str | None:
        """Buckets over the rows: a contiguous input reduced (or softmaxed) over its trailing dims,
        contiguous outputs, and only kept dims varying, each with the same variable in the input
        and every output. The rows are then one run whose stride is a product of literal sizes."""
        plan = self.plan(spec)
        if isinstance(plan, str):
            return plan
        x = spec.inputs[0]
        ndim = len(x.shape)
        reduced = [d for d in range(ndim) if d not in plan.kept]
        if reduced != list(range(ndim - len(reduced), ndim)):
            return f"reduces dims {reduced}, not trailing ones: the rows are not the leading dims"
        for side, metas in (("in", spec.inputs), ("out", spec.outputs)):
            for i, m in enumerate(metas):
                if not m.is_contiguous():
                    return f"{side}put {i} is not contiguous: its strides are no function of its sizes"
        var_in = {d: v for side, i, d, v in dims if side == "in"}
        if bad := sorted(d for d in var_in if d not in plan.kept):
            return f"input dim(s) {bad} vary but are reduced: the reduced length is literal in the kernel"
        for k, o in enumerate(spec.outputs):
            same_rank = len(o.shape) == ndim  # softmax, keepdim: dim d is the input's d
            var_out = {(d if same_rank else plan.kept[d]): v for side, i, d, v in dims if side == "out" and i == k}
            if var_out != var_in:
                return f"output {k} varies in other dims than the input's rows"
        if len(plan.m_sizes) > 1:
            return "the rows are not one strided run"
        return None

    def bucket_config_problem(self, config: Config) -> str | None:
        if int(config["SPLIT"]) > 1:
            return "SPLIT > 1 keeps partial results in a temporary sized by the rows: not bucketed"
        return None

    def generate_bucketed(self, spec: KernelSpec, config: Config, dims) -> KernelProgram:
        """The kernel of ``generate`` with the number of rows a run-time argument ``n_rows``: one
        binary serves every size of the bucket (its launch's grid and ``n_rows`` are SizeExprs).
        Offsets and int64 indexing are decided at the representative, the bucket's largest size."""
        problem = self.bucket_support(spec, dims) or self.bucket_config_problem(config)
        if problem is not None:
            raise ValueError(f"{spec.describe()} cannot be bucketed: {problem}")
        plan = self.checked_plan(spec, config)
        var_of = {d: v for side, i, d, v in dims if side == "in"}
        rows = product([f"v{var_of[d]}" if d in var_of else spec.inputs[0].shape[d] for d in plan.kept])
        return _Gen(spec, plan, config, rows).program()

    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        plan = self.plan(spec)
        if kind in ("large", "negative") and not isinstance(plan, str) and plan.acc == "int64" \
                and cg.is_int(plan.in_dtype):
            g = sample_generator(seed, device)
            return [to_device(_int_edge(m, g, kind), device) for m in spec.inputs]
        inputs = super().sample_inputs(spec, seed, kind, device)
        if kind == "special" and spec.op == "aten.var_mean.correction":
            # ATen's Welford mean of a row holding +-inf is inf only when the inf comes last in its
            # processing order, else NaN (order-dependent); this kernel returns the mean (inf).
            # NaN inputs still test propagation: infinities become NaN here.
            for t, m in zip(inputs, spec.inputs):
                if m.numel:
                    span = 1 + sum((n - 1) * st for n, st in zip(m.shape, m.stride))
                    flat = torch.as_strided(t, (span,), (1,), t.storage_offset())
                    flat.copy_(torch.where(flat.isinf(), torch.full_like(flat, float("nan")), flat))
        return [to_device(t, device) for t in inputs]


def _int_edge(meta: TensorMeta, g: torch.Generator, kind: str) -> torch.Tensor:
    """Integers for an exact reduction's edge trials (the default draws lie in [-8, 9) whatever
    the kind): "large" spans the dtype's whole range, its extremes sprinkled in (sums and products
    wrap around; amax/amin meet the values their padding holds); "negative" draws only negatives
    (a row's maximum below 0, so padding with 0 would show), or the whole range if unsigned."""
    dtype, info = meta.torch_dtype, torch.iinfo(meta.torch_dtype)
    if not meta.numel:
        return torch.empty_strided(meta.shape, meta.stride, dtype=dtype, device=g.device)
    span = 1 + sum((n - 1) * st for n, st in zip(meta.shape, meta.stride))
    if kind == "negative" and info.min < 0:
        flat = torch.randint(max(info.min, -1000), 0, (span,), generator=g, device=g.device).to(dtype)
    else:   # random bytes seen as the dtype: uniform over its range
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (span, size), generator=g, device=g.device, dtype=torch.uint8)
        flat = raw.view(dtype).reshape(span).clone()
        if kind == "large":
            idx = torch.randint(0, span, (max(1, span // 16),), generator=g, device=g.device)
            ends = torch.tensor([info.min, info.max], dtype=dtype, device=g.device)
            flat[idx] = ends[torch.randint(0, 2, idx.shape, generator=g, device=g.device)]
    return torch.as_strided(flat, meta.shape, meta.stride)


# --- code generation -------------------------------------------------------------------------


class _Gen:
    """The module of one (spec, config). ``rows``: a bucketed kernel's number of rows as a SizeExpr
    (core/buckets.py); the kernel then takes it as the argument ``n_rows`` and masks every block."""

    def __init__(self, spec: KernelSpec, plan: _Plan, config: Config, rows: Any = None):
        self.spec, self.p, self.c, self.runtime_rows = spec, plan, config, rows
        self.bm, self.br = int(config["BLOCK_M"]), int(config["BLOCK_R"])
        split = int(config["SPLIT"])
        self.chunk = max(1, -(-plan.R // split))                  # (R == 0: no chunk is read)
        self.chunk = -(-self.chunk // self.br) * self.br          # a whole number of blocks
        self.split = -(-plan.R // self.chunk)                     # chunks actually needed
        self.single = self.split == 1 and self.br >= plan.R
        sets = plan.m_strides + [tuple(plan.R * s for s in cg.contiguous_strides(plan.m_sizes))]
        self.wide = cg.needs_int64(plan.m_sizes, sets, slack=self.bm) or cg.needs_int64(
            plan.r_sizes, plan.r_strides, slack=self.chunk + self.br) or \
            cg.max_offset(plan.m_sizes, plan.m_strides[0]) + cg.max_offset(plan.r_sizes, plan.r_strides[0]) > cg.INT32_MAX
        self.src = cg.Source()
        self.kname = spec.op.split(".")[1].lstrip("_")
        self.acc = plan.acc
        self.zero, self.one = ("0.0", "1.0") if cg.is_float(plan.acc) else ("0", "1")

    # arithmetic in the accumulation type -----------------------------------------------------
    def div(self, a: str, b: str) -> str:
        """``a / b`` rounded to nearest (tl.div_rn takes fp32 only; a float64 ``/`` is IEEE)."""
        return f"tl.div_rn({a}, {b})" if self.acc == "float32" else f"{a} / {b}"

    def sqrt(self, a: str) -> str:
        return f"tl.sqrt_rn({a})" if self.acc == "float32" else f"tl.sqrt({a})"

    def extreme(self, kind: str) -> str:
        """The identity of amax (the lowest value) or amin (the highest) in the input's type."""
        dt = self.p.in_dtype
        if cg.is_float(dt):
            return "-" + INF if kind == "amax" else INF
        if dt == "bool":
            return "0" if kind == "amax" else "1"
        info = torch.iinfo(getattr(torch, dt))
        return str(info.min if kind == "amax" else info.max)

    # small emitters ------------------------------------------------------------------------
    @property
    def size_params(self) -> str:
        """The kernel's run-time size parameters, after its pointers."""
        return "" if self.runtime_rows is None else ", n_rows"

    def row_launch(self, kernel: str, args: tuple, consts: dict[str, int], warps: int, stages: int) -> Launch:
        """The launch of one program per BLOCK_M rows; a bucketed one's grid and ``n_rows`` are
        the SizeExprs of the rows."""
        grid = (-(-self.p.M // self.bm),)
        if self.runtime_rows is None:
            return Launch(kernel, grid, args, consts, warps, stages)
        args, sizes = cg.runtime_size(args, self.p.M, self.runtime_rows, self.bm, self.p.M + self.bm > cg.INT32_MAX)
        return Launch(kernel, grid, args, consts, warps, stages, runtime_sizes=sizes)

    def rows(self, pid: str = "pid") -> tuple[list[str], str | None]:
        """Emit row indices, their mask and per-tensor row offsets; returns (offsets, row_mask)."""
        p, s = self.p, self.src
        offs, row_mask = cg.block_offsets(s, "rows", pid, "BLOCK_M", self.bm,
                                          p.M if self.runtime_rows is None else "n_rows", self.wide, "row_mask",
                                          p.m_sizes, p.m_strides, "m")
        names = ["in_row"] + [f"out{i}_row" for i in range(len(offs) - 1)]
        for k, (name, off) in enumerate(zip(names, offs)):
            if " " in off:  # a compound offset: name it once
                if off in offs[:k]:
                    offs[k] = offs[offs.index(off)]
                    continue
                s(f"{name} = {off}")
                offs[k] = name
        return offs, row_mask

    def cols(self, start: str | None) -> tuple[list[str], str | None]:
        """Emit the column indices of one block (from ``start``) and their offsets and mask."""
        p, s = self.p, self.src
        base = "tl.arange(0, BLOCK_R)" if start is None else f"{start} + tl.arange(0, BLOCK_R)"
        if self.wide:
            base = f"({base}).to(tl.int64)"
        s(f"r = {base}")
        col_mask = None
        if (self.single and self.br != p.R) or (not self.single and (p.R % self.br or self.split > 1)):
            s(f"col_mask = r < {p.R}")
            col_mask = "col_mask"
        lines, offs = cg.decompose("r", p.r_sizes, p.r_strides, "k")
        for line in lines:
            s(line)
        return offs, col_mask

    @staticmethod
    def mask2(row_mask: str | None, col_mask: str | None) -> str | None:
        if row_mask and col_mask:
            return f"{row_mask}[:, None] & {col_mask}[None, :]"
        if row_mask:
            return f"{row_mask}[:, None]"
        if col_mask:
            return f"{col_mask}[None, :]"
        return None

    @staticmethod
    def tile(row_off: str, col_off: str) -> str:
        """A BLOCK_M x BLOCK_R offset tile (a zero offset keeps its axis: ``rows * 0``)."""
        row = "rows * 0" if row_off == "0" else row_off
        col = "r * 0" if col_off == "0" else col_off
        wrap = lambda o: f"({o})" if " " in o else o
        return f"{wrap(row)}[:, None] + {wrap(col)}[None, :]"

    def load(self, var: str, row_off: str, col_off: str, mask: str | None, other: str) -> None:
        p = self.p
        ptr = "in0_ptr + " + self.tile(row_off, col_off)
        kw = f", mask={mask}, other={other}" if mask else ""
        conv = ""
        if p.pre_cast:
            conv += f".to({cg.tl_type(p.pre_cast)})"
        if (p.pre_cast or p.in_dtype) != p.acc:
            conv += f".to({cg.tl_type(p.acc)})"
        self.src(f"{var} = tl.load({ptr}{kw}){conv}")

    def store(self, out: int, row_off: str, value: str, row_mask: str | None) -> None:
        dt = self.p.out_dtypes[out]
        v = value if dt == self.acc else f"{value}.to({cg.tl_type(dt)})"
        kw = f", mask={row_mask}" if row_mask else ""
        # one row (M == 1): rows == [0], which keeps the stored value and the pointer both blocks
        ptr = f"out{out}_ptr + {'rows' if row_off == '0' else row_off}"
        self.src(f"tl.store({ptr}, {v}{kw})")

    def header(self) -> None:
        s, p = self.src, self.p
        s(cg.HEADER, cg.describe_spec(self.spec))
        s((f"# rows M={p.M}" if self.runtime_rows is None else f"# rows n_rows (a run-time size, at most {p.M})")
          + f" over sizes {list(p.m_sizes)}, strides " + ", ".join(
            f"{n} {list(st)}" for n, st in zip(["in0"] + [f"out{i}" for i in range(len(p.out_dtypes))], p.m_strides)))
        s(f"# reduced R={p.R} over sizes {list(p.r_sizes)}, strides " + ", ".join(
            f"{n} {list(st)}" for n, st in zip(["in0", "out0"], p.r_strides)))
        s.blank()

    def program(self) -> KernelProgram:
        self.header()
        if self.p.R == 0:
            return self.empty_rows()
        if self.p.kind == "prod":  # tl.reduce's combine function: triton has no tl.prod
            self.src("@triton.jit", "def _multiply(a, b):", "    return a * b").blank()
        if self.p.kind in SOFTMAX_OPS.values():
            return self.softmax()
        return self.reduction()

    # reductions --------------------------------------------------------------------------------
    def accumulate(self, row_offs: list[str], row_mask: str | None, start: str | None) -> None:
        """Emit the body that leaves per-row results: total (sum, prod), best (amax/amin), mean+m2 (var)."""
        s, p, kind = self.src, self.p, self.p.kind
        loop = not self.single
        acc_t, zero = cg.tl_type(self.acc), self.zero

        def block_loop(body):
            if loop:
                s(f"for r0 in range(0, {self.chunk if self.split > 1 else p.R}, BLOCK_R):").indent()
                offs, col_mask = self.cols("r0" if start is None else f"{start} + r0")
            else:
                offs, col_mask = self.cols(start)
            mask = self.mask2(row_mask, col_mask)
            body(offs[0], mask)
            if loop:
                s.dedent()

        if kind in ("sum", "mean"):
            if loop:
                s(f"acc = tl.zeros([BLOCK_M, BLOCK_R], dtype={acc_t})")
                block_loop(lambda off, mask: (self.load("x", row_offs[0], off, mask, zero), s("acc += x")))
                s("total = tl.sum(acc, 1)")
            else:
                block_loop(lambda off, mask: self.load("x", row_offs[0], off, mask, zero))
                s("total = tl.sum(x, 1)")
            return
        if kind == "prod":
            if loop:
                s(f"acc = tl.full([BLOCK_M, BLOCK_R], {self.one}, dtype={acc_t})")
                block_loop(lambda off, mask: (self.load("x", row_offs[0], off, mask, self.one), s("acc *= x")))
                s("total = tl.reduce(acc, 1, _multiply)")
            else:
                block_loop(lambda off, mask: self.load("x", row_offs[0], off, mask, self.one))
                s("total = tl.reduce(x, 1, _multiply)")
            return
        if kind in ("amax", "amin"):
            red, better = ("tl.max", ">") if kind == "amax" else ("tl.min", "<")
            init = self.extreme(kind)
            floats = cg.is_float(self.acc)
            if loop:
                s(f"acc = tl.full([BLOCK_M, BLOCK_R], {init}, dtype={acc_t})")

                def body(off, mask):
                    self.load("x", row_offs[0], off, mask, init)
                    s(f"acc = tl.where((x {better} acc) | (x != x), x, acc)  # NaN sticks, as in ATen" if floats
                      else f"acc = tl.where(x {better} acc, x, acc)")
                block_loop(body)
            else:
                block_loop(lambda off, mask: self.load("acc", row_offs[0], off, mask, init))
            s(f"best = {red}(acc, 1)")
            if floats:
                s("# tl.max/tl.min skip NaN; ATen's amax/amin return NaN for a row holding one: add it back",
                  "best += tl.sum(tl.where(acc != acc, acc, 0.0), 1)")
            return
        # var / std / var_mean: two passes (mean, then squared deviations), exact in fp32 (or fp64)
        n = "n" if self.split > 1 else cg.float_literal(p.R)
        if self.split > 1:
            s(f"n = tl.minimum({p.R} - pid_s * {self.chunk}, {self.chunk}).to({acc_t})  # elements in this chunk")
        if loop:
            s(f"acc = tl.zeros([BLOCK_M, BLOCK_R], dtype={acc_t})")
            block_loop(lambda off, mask: (self.load("x", row_offs[0], off, mask, zero), s("acc += x")))
            s(f"mean = {self.div('tl.sum(acc, 1)', n)}")
            s(f"acc = tl.zeros([BLOCK_M, BLOCK_R], dtype={acc_t})")

            def body2(off, mask):
                self.load("x", row_offs[0], off, mask, zero)
                s(f"d = tl.where({mask}, x - mean[:, None], 0.0)" if mask else "d = x - mean[:, None]")
                s("acc += d * d")
            block_loop(body2)
            s("m2 = tl.sum(acc, 1)")
        else:
            def body(off, mask):
                self.load("x", row_offs[0], off, mask, zero)
                s(f"mean = {self.div('tl.sum(x, 1)', n)}")
                s(f"d = tl.where({mask}, x - mean[:, None], 0.0)" if mask else "d = x - mean[:, None]")
                s("m2 = tl.sum(d * d, 1)")
            block_loop(body)

    def finish(self, row_offs: list[str], row_mask: str | None) -> None:
        """Store the final outputs from total / best / mean+m2."""
        s, p, kind = self.src, self.p, self.p.kind
        out_offs = row_offs[1:]
        if kind in ("sum", "prod"):
            self.store(0, out_offs[0], "total", row_mask)
        elif kind == "mean":
            s(f"mean = {self.div('total', cg.float_literal(p.R))}")
            self.store(0, out_offs[0], "mean", row_mask)
        elif kind in ("amax", "amin"):
            self.store(0, out_offs[0], "best", row_mask)
        else:
            s(f"var = {self.div('m2', cg.float_literal(p.denom))}  # max(0, N - correction)")
            if kind == "std":
                s(f"std = {self.sqrt('var')}")
                self.store(0, out_offs[0], "std", row_mask)
            else:
                self.store(0, out_offs[0], "var", row_mask)
            if kind == "var_mean":
                self.store(1, out_offs[1], "mean", row_mask)

    def reduction(self) -> KernelProgram:
        s, p = self.src, self.p
        nout = len(p.out_dtypes)
        grid_m = -(-p.M // self.bm)
        consts = {"BLOCK_M": self.bm, "BLOCK_R": self.br}
        warps, stages = int(self.c["num_warps"]), int(self.c["num_stages"])
        if self.split == 1:
            outs = ", ".join(f"out{i}_ptr" for i in range(nout))
            s("@triton.jit", f"def {self.kname}_kernel(in0_ptr, {outs}{self.size_params}, "
              "BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):").indent()
            s("pid = tl.program_id(0)")
            offs, row_mask = self.rows()
            self.accumulate(offs, row_mask, None)
            self.finish(offs, row_mask)
            s.dedent()
            launch = self.row_launch(f"{self.kname}_kernel", (("in", 0),) + tuple(("out", i) for i in range(nout)),
                                     consts, warps, stages)
            return KernelProgram(s.text(), (launch,))

        # split: partial results per (chunk, row) into tmp, then a combine kernel
        nparts = 2 if p.kind in ("var", "std", "var_mean") else 1
        S, M = self.split, p.M
        short = {"float32": "fp32", "float64": "fp64"}.get(self.acc, self.acc)
        s(f"# R is cut into {S} chunks of {self.chunk}; partial results go to tmp[part, chunk, row] ({short})")
        s.blank()
        s("@triton.jit", f"def {self.kname}_partial_kernel(in0_ptr, tmp_ptr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):").indent()
        s("pid = tl.program_id(0)", "pid_s = tl.program_id(1)  # which chunk of R")
        offs, row_mask = self.rows()
        self.accumulate(offs, row_mask, f"pid_s * {self.chunk}")
        dest = f"{cg.scaled('pid_s', M)} + rows"
        kw = f", mask={row_mask}" if row_mask else ""
        if p.kind in ("sum", "mean", "prod"):
            s(f"tl.store(tmp_ptr + {dest}, total{kw})")
        elif p.kind in ("amax", "amin"):
            s(f"tl.store(tmp_ptr + {dest}, best{kw})")
        else:
            s(f"tl.store(tmp_ptr + {dest}, mean{kw})", f"tl.store(tmp_ptr + {S * M} + {dest}, m2{kw})")
        s.dedent().blank()

        # combine: one program per BLOCK_M rows reads all chunks of its rows
        sp2 = _p2(S)
        bm2 = max(1, min(_p2(M), 4096 // sp2))
        outs = ", ".join(f"out{i}_ptr" for i in range(nout))
        s("@triton.jit", f"def {self.kname}_combine_kernel(tmp_ptr, {outs}, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):").indent()
        s("pid = tl.program_id(0)")
        saved_bm = self.bm
        self.bm = bm2
        offs, row_mask = self.rows()
        self.bm = saved_bm
        s("chunk = tl.arange(0, BLOCK_S)")
        cmask = None
        if sp2 != S:
            s(f"chunk_mask = chunk < {S}")
            cmask = "chunk_mask"
        mask = self.mask2(row_mask, cmask)
        where = f"rows[:, None] + {'chunk' if M == 1 else f'(chunk * {M})'}[None, :]"
        kw = (lambda other: f", mask={mask}, other={other}") if mask else (lambda other: "")
        if p.kind in ("sum", "mean"):
            s(f"total = tl.sum(tl.load(tmp_ptr + {where}{kw(self.zero)}), 1)")
        elif p.kind == "prod":
            s(f"total = tl.reduce(tl.load(tmp_ptr + {where}{kw(self.one)}), 1, _multiply)")
        elif p.kind in ("amax", "amin"):
            red = "tl.max" if p.kind == "amax" else "tl.min"
            s(f"acc = tl.load(tmp_ptr + {where}{kw(self.extreme(p.kind))})", f"best = {red}(acc, 1)")
            if cg.is_float(self.acc):
                s("best += tl.sum(tl.where(acc != acc, acc, 0.0), 1)  # keep NaN")
        else:
            s(f"part_mean = tl.load(tmp_ptr + {where}{kw('0.0')})",
              f"part_m2 = tl.load(tmp_ptr + {S * M} + {where}{kw('0.0')})",
              f"n = tl.minimum({p.R} - chunk * {self.chunk}, {self.chunk}).to({cg.tl_type(self.acc)})  # elements per chunk",
              f"mean = {self.div('tl.sum(part_mean * n[None, :], 1)', cg.float_literal(p.R))}",
              "# Chan et al.: m2 = sum of the chunks' m2 + n * (chunk mean - mean)^2",
              "d = part_mean - mean[:, None]")
            spread = "part_m2 + n[None, :] * d * d"
            s(f"m2 = tl.sum(tl.where({mask}, {spread}, 0.0), 1)" if mask else f"m2 = tl.sum({spread}, 1)")
        self.finish(offs, row_mask)
        s.dedent()
        partial = Launch(f"{self.kname}_partial_kernel", (grid_m, S), (("in", 0), ("tmp", 0)), consts, warps, stages)
        combine = Launch(f"{self.kname}_combine_kernel", (-(-M // bm2),), (("tmp", 0),) + tuple(("out", i) for i in range(nout)),
                         {"BLOCK_M": bm2, "BLOCK_S": sp2}, 4 if bm2 * sp2 >= 1024 else 1, 1)
        tmp = Buffer((nparts, S, M), self.acc)
        return KernelProgram(s.text(), (partial, combine), temps=(tmp,))

    def empty_rows(self) -> KernelProgram:
        """R == 0: every row reduces nothing, its outputs are the kind's value of no elements."""
        s, p = self.src, self.p
        nout = len(p.out_dtypes)
        value = EMPTY_VALUES[p.kind]
        value = "float('nan')" if value == "nan" else self.one if value else self.zero
        outs = ", ".join(f"out{i}_ptr" for i in range(nout))
        s("@triton.jit", f"def {self.kname}_kernel({outs}{self.size_params}, BLOCK_M: tl.constexpr):").indent()
        s("pid = tl.program_id(0)")
        offs, row_mask = self.rows()
        s(f"empty = tl.full([BLOCK_M], {value}, dtype={cg.tl_type(self.acc)})  # a row of no elements")
        for i in range(nout):
            self.store(i, offs[1 + i], "empty", row_mask)
        s.dedent()
        launch = self.row_launch(f"{self.kname}_kernel", tuple(("out", i) for i in range(nout)),
                                 {"BLOCK_M": self.bm}, int(self.c["num_warps"]), 1)
        return KernelProgram(s.text(), (launch,))

    # softmax -----------------------------------------------------------------------------------
    def softmax(self) -> KernelProgram:
        s, p = self.src, self.p
        log = p.kind == "log_softmax"
        s("@triton.jit", f"def {self.kname}_kernel(in0_ptr, out0_ptr{self.size_params}, "
          "BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):").indent()
        s("pid = tl.program_id(0)")
        offs, row_mask = self.rows()
        in_row, out_row = offs[0], offs[1]

        def out_tile(col_offs):
            return "out0_ptr + " + self.tile(out_row, col_offs[1])

        def result(mask, col_offs, exp="tl.exp(x - row_max[:, None])"):
            """Store the row's softmax (``exp``: its exponentials) or log-softmax."""
            if log:
                s("y = x - row_max[:, None] - tl.log(row_sum)[:, None]")
            else:
                s(f"y = {self.div(exp, 'row_sum[:, None]')}")
            dt = p.out_dtypes[0]
            v = "y" if dt == self.acc else f"y.to({cg.tl_type(dt)})"
            s(f"tl.store({out_tile(col_offs)}, {v}{', mask=' + mask if mask else ''})")

        def load_x(start: str | None) -> tuple[list[str], str | None]:
            """Load x, the block of columns from ``start`` (-inf past the row); its offsets and mask."""
            col_offs, col_mask = self.cols(start)
            mask = self.mask2(row_mask, col_mask)
            self.load("x", in_row, col_offs[0], mask, "-" + INF)
            return col_offs, mask

        if self.single:
            col_offs, mask = load_x(None)
            s("row_max = tl.max(x, 1)", "e = tl.exp(x - row_max[:, None])")
            if mask:
                s(f"e = tl.where({mask}, e, 0.0)  # padding would be exp(-inf - -inf) = NaN for all--inf rows")
            s("row_sum = tl.sum(e, 1)")
            result(mask, col_offs, "e")
        else:
            s("# pass 1: running max and sum of exp(x - max) per lane (online softmax)",
              f"m_i = tl.full([BLOCK_M, BLOCK_R], -{INF}, dtype={cg.tl_type(self.acc)})",
              f"s_i = tl.zeros([BLOCK_M, BLOCK_R], dtype={cg.tl_type(self.acc)})")
            s(f"for r0 in range(0, {p.R}, BLOCK_R):").indent()
            col_offs, mask = load_x("r0")
            s("m_new = tl.maximum(m_i, x)",
              "# lanes that have only seen -inf keep sum 0 (exp(-inf - -inf) would be NaN)",
              f"alpha = tl.where(m_new == -{INF}, 1.0, tl.exp(m_i - m_new))",
              f"s_i = s_i * alpha + tl.where(m_new == -{INF}, 0.0, tl.exp(x - m_new))",
              "m_i = m_new")
            s.dedent()
            s("row_max = tl.max(m_i, 1)",
              f"row_sum = tl.sum(tl.where(m_i == -{INF}, 0.0, s_i * tl.exp(m_i - row_max[:, None])), 1)",
              "# pass 2: normalise")
            s(f"for r0 in range(0, {p.R}, BLOCK_R):").indent()
            col_offs, mask = load_x("r0")
            result(mask, col_offs)
            s.dedent()
        s.dedent()
        launch = self.row_launch(f"{self.kname}_kernel", (("in", 0), ("out", 0)), {"BLOCK_M": self.bm, "BLOCK_R": self.br},
                                 int(self.c["num_warps"]), int(self.c["num_stages"]))
        return KernelProgram(s.text(), (launch,))


def _max_tile(plan: _Plan) -> int:
    """Elements of the largest tile: MAX_TILE of 4-byte values, half as many 8-byte ones."""
    return MAX_TILE if plan.acc == "float32" else MAX_TILE // 2


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _floor2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _is_pow2(v: Any) -> bool:
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


FAMILY = ReductionFamily()
