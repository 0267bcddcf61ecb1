"""Scaled dot-product attention as flash-attention kernels: forward and backward, one pass over K/V.

Ops (the ones aot_autograd leaves in ATen graphs, see decompositions.KEEP_WHOLE_AT_TRACE):

- ``aten._scaled_dot_product_flash_attention_for_cpu.default`` -> (out, logsumexp): what
  ``F.scaled_dot_product_attention`` becomes on CPU tensors, in inference and training graphs (a
  boolean mask arrives already turned into an additive float mask by a ``where``);
- ``aten._scaled_dot_product_flash_attention_for_cpu_backward.default`` -> (grad_q, grad_k,
  grad_v): its backward, in training graphs;
- ``aten.scaled_dot_product_attention.default`` -> out: the composite op itself, where a graph
  keeps it (boolean or float mask, ``enable_gqa``).

Forward (one program per BLOCK_M query rows of one batch x head): S = scale * Q K^T (+ mask) on the
tensor cores with fp32 accumulation, an online softmax in base 2 (running max and sum, rescaling the
fp32 accumulator), acc += P V, out = acc / sum; logsumexp = ln(sum) + max. Causal attention is
top-left aligned (query i sees keys j <= i), as SDPA defines it, and a program stops at its last
visible key block. GQA: query head h reads key/value head h // (H / Hkv). A row that sees no key
(every score -inf) gives out = 0 and logsumexp = 0, as ATen's CPU kernel does.

Backward (FlashAttention-2's split, no atomics): a first launch computes Delta = rowsum(dO * O)
into an fp32 temporary; a second runs one program per BLOCK_N keys of one key/value head and
accumulates dK, dV over every query row of every query head of its group; a third runs one
program per BLOCK_M query rows and accumulates dQ. P is recomputed from the given logsumexp.

fp16/bf16 operands feed tl.dot directly (P and dS rounded to the operand type, as flash kernels
do); DOT_UPCAST converts them to fp32 first, the variant that exists because Triton's CPU
interpreter computes bf16 dots wrongly. fp32 dots use input_precision="ieee". Every tensor is read
and written through its real strides (outputs keep the traced ones: ATen's CPU kernel gives a
[B, L, H, D]-ordered out for transposed inputs and [B, L, H]-ordered logsumexp).

Declined, with the reason: dropout_p > 0 (random), other ops' rng/optional outputs, ranks other
than 3/4, head dims over 256, non-float masks (except sdpa's bool), mask shapes that do not
broadcast to [B, H, L, S], float64.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import (Config, KernelFamily, doubled_and_halved, next_pow2,
                                                   sample_tensor, to_device)
from torch_kernelize.core.program import Buffer, KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec, TensorMeta

FWD_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"
BWD_CPU = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
SDPA = "aten.scaled_dot_product_attention.default"
FORWARD_OPS = (FWD_CPU, SDPA)
BACKWARD_OPS = (BWD_CPU,)

SMEM_BYTES = 232448      # sm_90: 227 KB of shared memory per block
MAX_REGS = 224           # fp32 values per thread a config may hold live (of 255 registers)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass
class _Plan:
    op: str
    backward: bool
    dtype: str                 # q/k/v dtype
    B: int
    H: int
    Hkv: int
    L: int
    S: int
    E: int                     # q/k head dim
    Ev: int                    # v head dim
    causal: bool
    scale: float
    q: tuple[int, tuple[int, int, int, int]]          # input index, (batch, head, row, col) strides
    k: tuple[int, tuple[int, int, int, int]]
    v: tuple[int, tuple[int, int, int, int]]
    mask: tuple[int, tuple[int, int, int, int], str] | None   # input, strides over [B, H, L, S], dtype
    out: tuple[int, tuple[int, int, int, int]] | None         # forward: output index; backward: input
    lse: tuple[int, tuple[int, int, int]] | None              # forward: output (or None); backward: input
    grad_out: tuple[int, tuple[int, int, int, int]] | None = None     # backward inputs and outputs
    grads: tuple[tuple[int, int, int, int], ...] = ()                 # dq, dk, dv strides

    @property
    def group(self) -> int:
        return self.H // self.Hkv

    @property
    def d(self) -> int:
        return max(16, next_pow2(self.E))

    @property
    def dv(self) -> int:
        return max(16, next_pow2(self.Ev))


def _as4(m: TensorMeta) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Shape and strides of a rank-3 ([B, L, D]) or rank-4 ([B, H, L, D]) tensor as rank 4."""
    if len(m.shape) == 3:
        return (m.shape[0], 1, m.shape[1], m.shape[2]), (m.stride[0], 0, m.stride[1], m.stride[2])
    return tuple(m.shape), tuple(m.stride)


class AttentionFamily(KernelFamily):
    name = "attention"
    ops = frozenset(FORWARD_OPS + BACKWARD_OPS)
    # "special" puts -inf into the mask (rows that see no key included); q/k/v stay finite. "large"
    # is left out: scores of 1e8 make softmax a discontinuous argmax that no fp32 kernel (vendor
    # included) matches against float64.
    edge_kinds = ("zeros", "negative", "special")

    # --- analysis ---------------------------------------------------------------------------
    def _analyse(self, spec: KernelSpec) -> _Plan | str:
        if spec.graph is not None:
            return "attention regions are not generated"
        args = cg.bind(spec)
        backward = spec.op in BACKWARD_OPS
        names = ("query", "key", "value") + (("grad_out", "out", "logsumexp") if backward else ())
        idx = {}
        for n in names:
            i = cg.tensor_index(args.get(n))
            if i is None:
                return f"{n} must be a tensor"
            idx[n] = i
        q, k, v = (spec.inputs[idx[n]] for n in ("query", "key", "value"))
        dropout = cg.scalar_value(args.get("dropout_p"))
        if dropout is None or dropout != 0:
            return f"dropout_p={args.get('dropout_p')!r}: dropout is random, not generated"
        causal = args.get("is_causal")
        if not isinstance(causal, bool):
            return f"is_causal={causal!r} is not a bool"
        dtypes = {q.dtype, k.dtype, v.dtype}
        if len(dtypes) != 1 or q.dtype not in cg.FLOAT_TYPES:
            return f"q/k/v dtypes {sorted(dtypes)} (one of fp32/fp16/bf16 only)"
        if any(m.device != q.device for m in spec.inputs + spec.outputs):
            return "input and output devices differ"
        ranks = {len(q.shape), len(k.shape), len(v.shape)}
        if ranks not in ({3}, {4}):
            return f"q/k/v ranks {sorted(ranks)}: only [B, L, E] or [B, H, L, E] tensors are generated"
        (B, H, L, E), qs = _as4(q)
        (Bk, Hkv, S, Ek), ks = _as4(k)
        (Bv, Hv, Sv, Ev), vs = _as4(v)
        if (Bk, Bv) != (B, B) or Ek != E or (Hv, Sv) != (Hkv, S):
            return f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit together"
        gqa = spec.op == FWD_CPU or backward or bool(args.get("enable_gqa"))
        if Hkv != H and not (gqa and Hkv and H % Hkv == 0):
            return f"{H} query heads for {Hkv} key/value heads" + ("" if gqa else " (enable_gqa is off)")
        if L * S * E * Ev * B * H == 0:
            return "empty attention: nothing to compute"
        if max(E, Ev) > MAX_HEAD_DIM:
            return f"head dims {E}/{Ev} exceed {MAX_HEAD_DIM}"
        if B * H > 65535:
            return f"{B * H} batch x heads exceed the grid's second axis (65535)"
        scale = args.get("scale")
        scale = 1.0 / math.sqrt(E) if scale is None else cg.scalar_value(scale)
        if scale is None or isinstance(scale, bool) or not math.isfinite(scale):
            return f"scale={args.get('scale')!r} is not a finite number"

        mask = None
        mi = cg.tensor_index(args.get("attn_mask"))
        if args.get("attn_mask") is not None and mi is None:
            return "attn_mask must be a tensor or None"
        if mi is not None:
            mm = spec.inputs[mi]
            if mm.dtype == "bool" and spec.op != SDPA:
                return "a boolean attn_mask reaches only scaled_dot_product_attention"
            if mm.dtype not in cg.FLOAT_TYPES + ("bool",):
                return f"attn_mask dtype {mm.dtype} (float or bool masks only)"
            full = (B, H, L, S) if len(q.shape) == 4 else (B, L, S)
            try:
                st = cg.broadcast_strides(mm, full)
            except ValueError:
                return f"attn_mask {list(mm.shape)} does not broadcast to {list(full)}"
            mask = (mi, st if len(full) == 4 else (st[0], 0, st[1], st[2]), mm.dtype)
            if causal:
                return "is_causal with an attn_mask is not generated (SDPA rejects it too)"

        plan = _Plan(spec.op, backward, q.dtype, B, H, Hkv, L, S, E, Ev, causal, float(scale),
                     (idx["query"], qs), (idx["key"], ks), (idx["value"], vs), mask, None, None)
        rank4 = lambda m: _as4(m)
        if not backward:
            want = 2 if spec.op == FWD_CPU else 1
            if len(spec.outputs) != want:
                return f"expected {want} output(s), got {len(spec.outputs)}"
            o = spec.outputs[0]
            if tuple(rank4(o)[0]) != (B, H, L, Ev) or o.dtype != q.dtype:
                return f"output {o.short()} is not [{B}, {H}, {L}, {Ev}] {q.dtype}"
            plan.out = (0, rank4(o)[1])
            if want == 2:
                lse = spec.outputs[1]
                if tuple(lse.shape) != (B, H, L) or lse.dtype != "float32":
                    return f"logsumexp {lse.short()} is not float32 [{B}, {H}, {L}]"
                plan.lse = (1, tuple(lse.stride))
        else:
            go, out, lse = (spec.inputs[idx[n]] for n in ("grad_out", "out", "logsumexp"))
            for name, m in (("grad_out", go), ("out", out)):
                if tuple(m.shape) != tuple(q.shape[:-1]) + (Ev,) or m.dtype != q.dtype:
                    return f"{name} {m.short()} does not match the query {q.short()}"
            if tuple(lse.shape) != (B, H, L) or lse.dtype != "float32":
                return f"logsumexp {lse.short()} is not float32 [{B}, {H}, {L}]"
            plan.grad_out, plan.out = (idx["grad_out"], rank4(go)[1]), (idx["out"], rank4(out)[1])
            plan.lse = (idx["logsumexp"], tuple(lse.stride))
            if len(spec.outputs) != 3:
                return f"expected (grad_query, grad_key, grad_value), got {len(spec.outputs)} outputs"
            for g, like in zip(spec.outputs, (q, k, v)):
                if tuple(g.shape) != tuple(like.shape) or g.dtype != like.dtype:
                    return f"gradient {g.short()} does not match its input {like.short()}"
            plan.grads = tuple(rank4(g)[1] for g in spec.outputs)
        for o in spec.outputs:
            if not cg.non_overlapping(o):
                return f"output {o.short()} strides overlap (some elements share memory)"
        return plan

    # --- configs ------------------------------------------------------------------------------
    def _valid(self, plan: _Plan, c: Config) -> bool:
        bm, bn, warps, stages = c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]
        if not all(16 <= b <= 256 and b & (b - 1) == 0 for b in (bm, bn)):
            return False
        if bm > max(16, next_pow2(plan.L)) or bn > max(16, next_pow2(plan.S)):
            return False
        if warps not in (1, 2, 4, 8) or not 1 <= stages <= 5:
            return False
        if c["DOT_UPCAST"] not in (True, False) or (c["DOT_UPCAST"] and plan.dtype == "float32"):
            return False
        d, dv = plan.d, plan.dv
        if plan.backward:   # dK/dV program: k, v, dk, dv tiles plus the [BLOCK_N, BLOCK_M] scores
            live = bn * (2 * d + 2 * dv) + 2 * bm * bn
            smem = stages * bm * (d + dv) + bn * (d + dv)
        else:               # q tile, accumulator and the [BLOCK_M, BLOCK_N] scores
            live = bm * (d + dv) + 2 * bm * bn
            smem = stages * bn * (d + dv) + bm * d
        elt = 4 if (plan.dtype == "float32" or c["DOT_UPCAST"]) else 2
        return live <= MAX_REGS * 32 * warps and smem * elt <= SMEM_BYTES

    def _fit(self, plan: _Plan, bm: int, bn: int, warps: int, stages: int, upcast: bool = False) -> Config:
        bm, bn = min(bm, max(16, next_pow2(plan.L))), min(bn, max(16, next_pow2(plan.S)))
        upcast = bool(upcast and plan.dtype != "float32")
        c = Config.of(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, DOT_UPCAST=upcast)
        # fewer stages, then more warps, until the tiles fit
        while not self._valid(plan, c) and c["num_stages"] > 1:
            c = c.replace(num_stages=c["num_stages"] - 1)
        while not self._valid(plan, c) and c["num_warps"] < 8:
            c = c.replace(num_warps=c["num_warps"] * 2)
        return c

    def _seeds(self, spec: KernelSpec, plan: _Plan) -> list[Config]:
        if plan.backward:
            # FlashAttention-2's Hopper-class backward tiles (Triton's tutorial: 64 x 64/128)
            seeds = [self._fit(plan, 64, 64, 4, 2), self._fit(plan, 32, 64, 4, 2), self._fit(plan, 64, 128, 8, 2),
                     self._fit(plan, 32, 32, 4, 1), self._fit(plan, 64, 64, 4, 2, upcast=True)]
        else:
            # forward: 128-row query tiles for long sequences (Triton's tutorial / FA2 on sm_90),
            # 64 for head dims past 128 or short sequences; an fp32-upcast variant (interpreter)
            big = plan.d + plan.dv > 256
            seeds = [self._fit(plan, 64 if big else 128, 64, 8 if big else 4, 3),
                     self._fit(plan, 128, 128, 8, 2), self._fit(plan, 64, 64, 4, 3),
                     self._fit(plan, 64, 32, 4, 4), self._fit(plan, 64, 64, 4, 2, upcast=True)]
        return seeds

    def _steps(self, plan: _Plan, c: Config) -> list[Config]:
        return doubled_and_halved(c, ("BLOCK_M", "BLOCK_N", "num_warps")) + [
            c.replace(num_stages=c["num_stages"] + 1), c.replace(num_stages=c["num_stages"] - 1),
            c.replace(DOT_UPCAST=not c["DOT_UPCAST"])]

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.checked_plan(spec, config)
        gen = _Gen(spec, plan, config)
        return gen.backward() if plan.backward else gen.forward()

    # --- validation inputs --------------------------------------------------------------------
    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """q/k/v (and grad_out) of the kind; a mask of random offsets, with -inf entries and a
        fully masked row for "special"; for the backward, out and logsumexp from ATen's forward
        on these q/k/v (a random logsumexp would make exp(S - lse) overflow: no real input)."""
        plan = self.plan(spec)
        g = torch.Generator().manual_seed(seed)
        # the edge kinds apply to q/k/v (and grad_out); the mask gets its own "special" below
        mask = plan.mask[0] if not isinstance(plan, str) and plan.mask is not None else None
        inputs = [sample_tensor(m, g, "random" if kind == "special" or i == mask else kind)
                  for i, m in enumerate(spec.inputs)]
        if isinstance(plan, str):
            return [to_device(t, device) for t in inputs]
        if plan.mask is not None and kind == "special":
            i, _, dtype = plan.mask
            m, t = spec.inputs[i], inputs[i]
            blocked = False if dtype == "bool" else float("-inf")
            if t.numel():
                # through the storage: a broadcast mask (stride 0) has no element of its own to write
                span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
                flat = torch.as_strided(t, (span,), (1,), t.storage_offset())
                flat.masked_fill_(torch.rand(span, generator=g) < 0.3, blocked)
                if cg.non_overlapping(m):
                    t.select(-2, 0).fill_(blocked)   # a query row that sees no key
        if plan.backward:
            fwd = _forward_of_backward(spec, inputs, plan)
            inputs[plan.out[0]].copy_(fwd[0])
            inputs[plan.lse[0]].copy_(fwd[1])
        return [to_device(t, device) for t in inputs]


def _forward_of_backward(spec: KernelSpec, inputs: list[torch.Tensor], plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's forward (out, logsumexp) of a backward spec's q/k/v, mask, causality and scale."""
    args = cg.bind(spec)
    q, k, v = (inputs[plan.q[0]], inputs[plan.k[0]], inputs[plan.v[0]])
    mask = inputs[plan.mask[0]] if plan.mask is not None else None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, 0.0, plan.causal, attn_mask=mask, scale=args.get("scale"))


# --- code generation -------------------------------------------------------------------------


def _term(expr: str, stride: int) -> str:
    return "" if stride == 0 else (expr if stride == 1 else f"{expr} * {stride}")


def _join(*terms: str) -> str:
    terms = [t for t in terms if t]
    return " + ".join(terms) if terms else "0"


class _Gen:
    def __init__(self, spec: KernelSpec, plan: _Plan, config: Config):
        self.spec, self.p, self.c = spec, plan, config
        self.bm, self.bn = int(config["BLOCK_M"]), int(config["BLOCK_N"])
        self.upcast = bool(config["DOT_UPCAST"])
        p = plan
        shapes = [((p.B, p.H, p.L, p.E), p.q[1]), ((p.B, p.Hkv, p.S, p.E), p.k[1]), ((p.B, p.Hkv, p.S, p.Ev), p.v[1])]
        if p.mask:
            shapes.append(((p.B, p.H, p.L, p.S), p.mask[1]))
        if p.out:
            shapes.append(((p.B, p.H, p.L, p.Ev), p.out[1]))
        if p.grad_out:
            shapes.append(((p.B, p.H, p.L, p.Ev), p.grad_out[1]))
        for g, sz in zip(p.grads, ((p.B, p.H, p.L, p.E), (p.B, p.Hkv, p.S, p.E), (p.B, p.Hkv, p.S, p.Ev))):
            shapes.append((sz, g))
        # padded tile edges read and written past the last row/column stay within a block
        slack = max(self.bm, self.bn) * max((abs(s) for _, st in shapes for s in st), default=1)
        self.wide = max(cg.max_offset(sz, st) for sz, st in shapes) + slack > cg.INT32_MAX
        self.src = cg.Source()

    # helpers -----------------------------------------------------------------------------------
    def header(self, what: str) -> None:
        p, s = self.p, self.src
        s(cg.HEADER)
        s(cg.describe_spec(self.spec))
        s(f"# {what}: B={p.B} H={p.H} (kv heads {p.Hkv}) L={p.L} S={p.S} E={p.E} Ev={p.Ev} "
          f"scale={p.scale!r} causal={p.causal} mask={'none' if not p.mask else p.mask[2]}")
        s("")

    def ix(self, line: str) -> str:
        """A row/key index vector; int64 when some offset (index x stride) may pass int32."""
        return line + (".to(tl.int64)" if self.wide else "")

    def dot(self, a: str, b: str) -> str:
        if self.p.dtype == "float32":
            return f'tl.dot({a}, {b}, input_precision="ieee")'
        if self.upcast:
            return f'tl.dot({a}.to(tl.float32), {b}.to(tl.float32), input_precision="ieee")'
        return f"tl.dot({a}, {b})"

    def operand(self, expr: str) -> str:
        """An fp32 value as a dot operand: rounded to the operand type unless upcasting."""
        if self.p.dtype in cg.HALF and not self.upcast:
            return f"{expr}.to({cg.HALF[self.p.dtype]})"
        return expr

    def batch_head(self, heads: int) -> None:
        """``b``, ``h`` (and ``hk``) from program_id(1) over B x ``heads``."""
        s, p = self.src, self.p
        cast = ".to(tl.int64)" if self.wide else ""
        s(f"bh = tl.program_id(1){cast}")
        s(f"b = bh // {heads}", f"h = bh % {heads}")

    def base(self, name: str, strides: tuple[int, ...], head: str) -> str:
        sb, sh = strides[0], strides[1]
        return _join(f"{name}_ptr", _term("b", sb), _term(head, sh))

    def scores(self, rows: str, cols: str, transposed: bool, s_expr: str) -> None:
        """Emit ``s2``: scores in base-2 units with mask, causality and edge keys applied.
        ``rows``/``cols``: the query / key index vectors; ``transposed``: s_expr is [keys, queries]."""
        s, p = self.src, self.p
        r, c = (f"{rows}[None, :]", f"{cols}[:, None]") if transposed else (f"{rows}[:, None]", f"{cols}[None, :]")
        s(f"s2 = {s_expr} * {cg.float_literal(p.scale * LOG2E)}  # scale * log2(e): softmax in base 2")
        valid = [f"({c} < {p.S})"] if p.S % self.bn else []
        if p.causal:
            valid.append(f"({c} <= {r})")
        if p.mask:
            mi, (sb, sh, sm, sn), dt = p.mask
            off = _join(_term("b", sb), _term("h", sh), _term(r, sm), _term(c, sn))
            bounds = [f"({r} < {p.L})", f"({c} < {p.S})"]
            if dt == "bool":
                s(f"keep = tl.load(mask_ptr + {off}, mask={' & '.join(bounds)}, other=0) != 0")
                valid.append("keep")
            else:
                s(f"bias = tl.load(mask_ptr + {off}, mask={' & '.join(bounds)}, other=0.0).to(tl.float32)")
                s(f"s2 = s2 + bias * {cg.float_literal(LOG2E)}")
        if valid:
            s(f"s2 = tl.where({' & '.join(valid)}, s2, -float('inf'))")

    def load_tile(self, var: str, base: str, rows: str, rstride: int, nrows: int, cols: str, cstride: int,
                  ncols: int, block_cols: int, transposed: bool = False) -> None:
        """``var`` = a [rows, cols] tile (or its transpose) of a strided matrix, masked at the edges."""
        r, c = (f"{rows}[None, :]", f"{cols}[:, None]") if transposed else (f"{rows}[:, None]", f"{cols}[None, :]")
        masks = [f"({r} < {nrows})"]
        if ncols != block_cols:
            masks.append(f"({c} < {ncols})")
        self.src(f"{var} = tl.load({base} + {_join(_term(r, rstride), _term(c, cstride))}, "
                 f"mask={' & '.join(masks)}, other=0.0)")

    def store_tile(self, base: str, value: str, rows: str, rstride: int, nrows: int, cols: str, cstride: int,
                   ncols: int, block_cols: int, dtype: str) -> None:
        masks = [f"({rows}[:, None] < {nrows})"]
        if ncols != block_cols:
            masks.append(f"({cols}[None, :] < {ncols})")
        conv = f".to({cg.HALF[dtype]})" if dtype in cg.HALF else ""
        self.src(f"tl.store({base} + {_join(_term(f'{rows}[:, None]', rstride), _term(f'{cols}[None, :]', cstride))}, "
                 f"{value}{conv}, mask={' & '.join(masks)})")

    def launch(self, kernel: str, grid: tuple[int, ...], args: tuple, d: int, dv: int) -> Launch:
        return Launch(kernel, grid, args, {"BLOCK_M": self.bm, "BLOCK_N": self.bn, "BLOCK_D": d, "BLOCK_DV": dv},
                      num_warps=int(self.c["num_warps"]), num_stages=int(self.c["num_stages"]))

    def kv_hi(self, first_row: str) -> str:
        """The loop end over keys of a query block starting at ``first_row``."""
        p = self.p
        if not p.causal:
            return str(p.S)
        return f"tl.minimum({first_row} + BLOCK_M, {p.S})"

    # forward -----------------------------------------------------------------------------------
    def forward(self) -> KernelProgram:
        p, s = self.p, self.src
        self.header("flash attention forward")
        ins = ["q", "k", "v"] + (["mask"] if p.mask else [])
        in_idx = [p.q[0], p.k[0], p.v[0]] + ([p.mask[0]] if p.mask else [])
        outs = ["out"] + (["lse"] if p.lse else [])
        consts = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_D: tl.constexpr", "BLOCK_DV: tl.constexpr"]
        s("@triton.jit", f"def attention_fwd_kernel({', '.join([f'{n}_ptr' for n in ins + outs] + consts)}):").indent()
        s("pid_m = tl.program_id(0)")
        self.batch_head(p.H)
        s(f"hk = h // {p.group}" if p.group > 1 else "hk = h")
        (qb, qh, qm, qd), (kb, kh, kn, kd), (vb, vh, vn, vd) = p.q[1], p.k[1], p.v[1]
        s(self.ix("rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)"), "rd = tl.arange(0, BLOCK_D)", "rdv = tl.arange(0, BLOCK_DV)")
        s(f"q_base = {self.base('q', p.q[1], 'h')}", f"k_base = {self.base('k', p.k[1], 'hk')}",
          f"v_base = {self.base('v', p.v[1], 'hk')}")
        self.load_tile("q", "q_base", "rm", qm, p.L, "rd", qd, p.E, p.d)
        s("m_i = tl.full([BLOCK_M], -float('inf'), tl.float32)  # running max of the base-2 scores",
          "l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s2 - m_i)",
          "acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)")
        hi = self.kv_hi("pid_m * BLOCK_M")
        s(f"for start_n in range(0, {hi}, BLOCK_N):" + ("  # causal: the keys up to the block's last row" if p.causal else "")).indent()
        s(self.ix("rn = start_n + tl.arange(0, BLOCK_N)"))
        self.load_tile("kt", "k_base", "rn", kn, p.S, "rd", kd, p.E, p.d, transposed=True)
        self.scores("rm", "rn", False, self.dot("q", "kt"))
        s("m_new = tl.maximum(m_i, tl.max(s2, 1))",
          "m_safe = tl.where(m_new == -float('inf'), 0.0, m_new)  # a row that has seen no key yet",
          "p = tl.math.exp2(s2 - m_safe[:, None])",
          "alpha = tl.math.exp2(m_i - m_safe)",
          "l_i = l_i * alpha + tl.sum(p, 1)")
        self.load_tile("vt", "v_base", "rn", vn, p.S, "rdv", vd, p.Ev, p.dv)
        s(f"acc = acc * alpha[:, None] + {self.dot(self.operand('p'), 'vt')}", "m_i = m_new")
        s.dedent()
        s("seen = l_i > 0.0  # rows whose every score is -inf give 0 (and logsumexp 0), as ATen does",
          "l_safe = tl.where(seen, l_i, 1.0)",
          "o = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)")
        ob, oh, om, od = p.out[1]
        s(f"o_base = {self.base('out', p.out[1], 'h')}")
        self.store_tile("o_base", "o", "rm", om, p.L, "rdv", od, p.Ev, p.dv, p.dtype)
        if p.lse:
            lb, lh, lm = p.lse[1]
            s(f"lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * {cg.float_literal(LN2)}, 0.0)",
              f"tl.store({_join('lse_ptr', _term('b', lb), _term('h', lh), _term('rm', lm))}, lse, mask=rm < {p.L})")
        s.dedent()
        grid = (-(-p.L // self.bm), p.B * p.H)
        args = tuple(("in", i) for i in in_idx) + tuple(("out", o) for o in range(len(outs)))
        return KernelProgram(s.text(), (self.launch("attention_fwd_kernel", grid, args, p.d, p.dv),))

    # backward ----------------------------------------------------------------------------------
    def backward(self) -> KernelProgram:
        p, s = self.p, self.src
        self.header("flash attention backward (Delta, then dK/dV per key block, then dQ per query block)")
        (qb, qh, qm, qd), (kb, kh, kn, kd), (vb, vh, vn, vd) = p.q[1], p.k[1], p.v[1]
        (ob, oh, om, od), (gb, gh, gm, gd) = p.out[1], p.grad_out[1]
        lb, lh, lm = p.lse[1]
        consts = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_D: tl.constexpr", "BLOCK_DV: tl.constexpr"]
        delta_at = lambda rows: _join("delta_ptr", "bh * " + str(p.L) if p.B * p.H > 1 else "", rows)

        # 1: Delta = rowsum(dO * O), fp32, [B * H, L]
        s("@triton.jit", f"def attention_bwd_delta_kernel({', '.join(['out_ptr', 'do_ptr', 'delta_ptr'] + consts)}):").indent()
        s("pid_m = tl.program_id(0)")
        self.batch_head(p.H)
        s(self.ix("rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)"), "rdv = tl.arange(0, BLOCK_DV)")
        self.load_tile("o", self.base("out", p.out[1], "h"), "rm", om, p.L, "rdv", od, p.Ev, p.dv)
        self.load_tile("do", self.base("do", p.grad_out[1], "h"), "rm", gm, p.L, "rdv", gd, p.Ev, p.dv)
        s("delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)",
          f"tl.store({delta_at('rm')}, delta, mask=rm < {p.L})")
        s.dedent().blank()("")

        # 2: dK, dV: one program per BLOCK_N keys of one key/value head, over its group's query heads
        dk_s, dv_s = p.grads[1], p.grads[2]
        ins = ["q", "k", "v"] + (["mask"] if p.mask else []) + ["do", "lse", "delta", "dk", "dv"]
        s("@triton.jit", f"def attention_bwd_dkdv_kernel({', '.join([f'{n}_ptr' for n in ins] + consts)}):").indent()
        s("pid_n = tl.program_id(0)")
        self.batch_head(p.Hkv)
        s("hk = h")
        s(self.ix("rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)"), "rd = tl.arange(0, BLOCK_D)", "rdv = tl.arange(0, BLOCK_DV)")
        self.load_tile("k", self.base("k", p.k[1], "hk"), "rn", kn, p.S, "rd", kd, p.E, p.d)
        self.load_tile("v", self.base("v", p.v[1], "hk"), "rn", vn, p.S, "rdv", vd, p.Ev, p.dv)
        s("dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)", "dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)")
        # causal: the first query block that sees this key block
        lo = "(pid_n * BLOCK_N // BLOCK_M) * BLOCK_M" if p.causal else "0"
        s(f"for g in range(0, {p.group}):  # the query heads that read this key/value head").indent()
        s(f"h = hk * {p.group} + g" if p.group > 1 else "h = hk")
        s(f"bh_q = b * {p.H} + h")
        s(f"q_base = {self.base('q', p.q[1], 'h')}", f"do_base = {self.base('do', p.grad_out[1], 'h')}",
          f"lse_base = {_join('lse_ptr', _term('b', lb), _term('h', lh))}",
          f"delta_base = delta_ptr + bh_q * {p.L}")
        s(f"for start_m in range({lo}, {p.L}, BLOCK_M):").indent()
        s(self.ix("rm = start_m + tl.arange(0, BLOCK_M)"))
        self.load_tile("q", "q_base", "rm", qm, p.L, "rd", qd, p.E, p.d)
        self.load_tile("do", "do_base", "rm", gm, p.L, "rdv", gd, p.Ev, p.dv)
        s(f"lse2 = tl.load(lse_base + {_term('rm', lm) or '0'}, mask=rm < {p.L}, other=0.0) * {cg.float_literal(LOG2E)}",
          f"delta = tl.load(delta_base + rm, mask=rm < {p.L}, other=0.0)")
        self.scores("rm", "rn", True, self.dot("k", "tl.trans(q)"))
        s("pt = tl.math.exp2(s2 - lse2[None, :])  # P^T [keys, queries]")
        s(f"dv += {self.dot(self.operand('pt'), 'do')}")
        s(f"dpt = {self.dot('v', 'tl.trans(do)')}",
          "dst = pt * (dpt - delta[None, :])",
          f"dk += {self.dot(self.operand('dst'), 'q')}")
        s.dedent().dedent()
        s(f"dk = dk * {cg.float_literal(p.scale)}")
        self.store_tile(self.base("dk", dk_s, "hk"), "dk", "rn", dk_s[2], p.S, "rd", dk_s[3], p.E, p.d, p.dtype)
        self.store_tile(self.base("dv", dv_s, "hk"), "dv", "rn", dv_s[2], p.S, "rdv", dv_s[3], p.Ev, p.dv, p.dtype)
        s.dedent().blank()("")

        # 3: dQ: one program per BLOCK_M query rows
        dq_s = p.grads[0]
        ins = ["q", "k", "v"] + (["mask"] if p.mask else []) + ["do", "lse", "delta", "dq"]
        s("@triton.jit", f"def attention_bwd_dq_kernel({', '.join([f'{n}_ptr' for n in ins] + consts)}):").indent()
        s("pid_m = tl.program_id(0)")
        self.batch_head(p.H)
        s(f"hk = h // {p.group}" if p.group > 1 else "hk = h")
        s(self.ix("rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)"), "rd = tl.arange(0, BLOCK_D)", "rdv = tl.arange(0, BLOCK_DV)")
        self.load_tile("q", self.base("q", p.q[1], "h"), "rm", qm, p.L, "rd", qd, p.E, p.d)
        self.load_tile("do", self.base("do", p.grad_out[1], "h"), "rm", gm, p.L, "rdv", gd, p.Ev, p.dv)
        s(f"lse2 = tl.load({_join('lse_ptr', _term('b', lb), _term('h', lh), _term('rm', lm))}, mask=rm < {p.L}, other=0.0)"
          f" * {cg.float_literal(LOG2E)}",
          f"delta = tl.load({delta_at('rm')}, mask=rm < {p.L}, other=0.0)")
        s(f"k_base = {self.base('k', p.k[1], 'hk')}", f"v_base = {self.base('v', p.v[1], 'hk')}")
        s("dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)")
        s(f"for start_n in range(0, {self.kv_hi('pid_m * BLOCK_M')}, BLOCK_N):").indent()
        s(self.ix("rn = start_n + tl.arange(0, BLOCK_N)"))
        self.load_tile("k", "k_base", "rn", kn, p.S, "rd", kd, p.E, p.d)
        self.load_tile("v", "v_base", "rn", vn, p.S, "rdv", vd, p.Ev, p.dv)
        self.scores("rm", "rn", False, self.dot("q", "tl.trans(k)"))
        s("pr = tl.math.exp2(s2 - lse2[:, None])",
          f"dp = {self.dot('do', 'tl.trans(v)')}",
          "ds = pr * (dp - delta[:, None])",
          f"dq += {self.dot(self.operand('ds'), 'k')}")
        s.dedent()
        s(f"dq = dq * {cg.float_literal(p.scale)}")
        self.store_tile(self.base("dq", dq_s, "h"), "dq", "rm", dq_s[2], p.L, "rd", dq_s[3], p.E, p.d, p.dtype)
        s.dedent()

        q_i, k_i, v_i = p.q[0], p.k[0], p.v[0]
        mask = (("in", p.mask[0]),) if p.mask else ()
        common = (("in", q_i), ("in", k_i), ("in", v_i)) + mask + (("in", p.grad_out[0]), ("in", p.lse[0]), ("tmp", 0))
        launches = (
            self.launch("attention_bwd_delta_kernel", (-(-p.L // self.bm), p.B * p.H),
                        (("in", p.out[0]), ("in", p.grad_out[0]), ("tmp", 0)), p.d, p.dv),
            self.launch("attention_bwd_dkdv_kernel", (-(-p.S // self.bn), p.B * p.Hkv), common + (("out", 1), ("out", 2)),
                        p.d, p.dv),
            self.launch("attention_bwd_dq_kernel", (-(-p.L // self.bm), p.B * p.H), common + (("out", 0),), p.d, p.dv),
        )
        return KernelProgram(s.text(), launches, temps=(Buffer((p.B * p.H * p.L,), "float32"),))


FAMILY = AttentionFamily()
