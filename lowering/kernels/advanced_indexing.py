"""Advanced indexing: ``index.Tensor`` and ``index_put`` with several index tensors, or a bool mask.

The indexing family (indexing.py) moves whole rows for one index tensor; this one takes what it
declines, numpy's advanced indexing in full:
- several int64/int32 index tensors that broadcast against each other to a shape B, with None
  (sliced) dims before, between and after them. The result's dims are B in place of the indexed
  dims when those are adjacent, else B first, then the sliced dims (ATen's rule). One program
  owns BLOCK elements of the result: it splits each one's flat index over the result's dims, loads
  every index tensor at its broadcast offset, wraps negative indices, and gathers (``index``) or
  writes (``index_put``: a copy of ``self``, then stores, or atomic adds with accumulate=True).
- a bool mask in ``index_put`` (``x[mask] = v``) whose values do not follow the mask's true
  elements (a scalar, or values broadcast over the dims after the mask): an elementwise select
  (or add) over ``self``. A bool mask in ``index`` has a data-dependent shape: never a spec.

Out of range: ATen raises IndexError. A kernel cannot raise, and ``tl.device_assert`` would leave
a CUDA context unusable; so an invalid index is clamped (no access out of bounds) and sets its
index tensor's flag, a zeroed temporary that the program's ``checks`` turn into eager's error
(``IndexOutOfRange``, an IndexError) after the launches.

index_put without accumulate: which of two writes to one element wins is unspecified in ATen, so
its index tensors must not broadcast against each other (validation then draws distinct index
combinations; more combinations than the indexed dims hold is declined).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import (Config, KernelFamily, doubled_and_halved, sample_generator,
                                                   sample_tensor, to_device)
from torch_kernelize.core.program import Buffer, Check, Donation, KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec

OPS = {
    "aten.index.Tensor": "index",
    "aten._unsafe_index.Tensor": "index",
    "aten.index_put.default": "index_put",
    "aten._unsafe_index_put.default": "index_put",
}
VALUE_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")
ADD_DTYPES = ("float32", "int32")     # accumulate=True: atomic adds (the masked form adds elementwise)
INDEX_DTYPES = ("int64", "int32")
MAX_BLOCK = 4096


@dataclasses.dataclass
class _Plan:
    name: str                        # "index" | "index_put"
    masked: bool                     # a bool mask (index_put): elementwise over self
    accumulate: bool
    dtype: str
    src: int                         # input: self (index) or values (index_put)
    self_in: int | None              # index_put: input number of self
    idx: list[int]                   # inputs: the index tensors (or the mask)
    dims: list[int]                  # the dim of self each index tensor selects along
    sizes: list[int]                 # those dims' sizes (valid indices: [-n, n))
    domain: tuple[int, ...]          # the elements one kernel walks (the result's, or self's)
    # per domain dim: strides of [src/values, dst(out), each index tensor...]
    strides: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    ind: list[int] = dataclasses.field(default_factory=list)  # stride of each index in src (index) or out (put)
    wide: bool = False

    @property
    def N(self) -> int:
        return math.prod(self.domain)


class AdvancedIndexingFamily(KernelFamily):
    name = "advanced_indexing"
    ops = frozenset(OPS)

    # --- analysis ---------------------------------------------------------------------------
    def _analyse(self, spec: KernelSpec) -> _Plan | str:
        name = OPS[spec.op]
        a = cg.bind(spec)
        indices = a.get("indices")
        if not isinstance(indices, list) or len(spec.outputs) != 1:
            return "indices must be a list, with one output"
        src = cg.tensor_index(a.get("self"))
        if src is None:
            return "self must be a tensor"
        V, O = spec.inputs[src], spec.outputs[0]
        entries = [(k, cg.tensor_index(v)) for k, v in enumerate(indices) if v is not None]
        if any(i is None for _, i in entries) or not entries:
            return "indices must be tensors or None"
        kinds = {spec.inputs[i].dtype for _, i in entries}
        if V.dtype not in VALUE_DTYPES or O.dtype != V.dtype:
            return f"values of dtype {V.dtype} are not generated"
        if len(indices) > len(V.shape) or V.numel == 0 or O.numel == 0:
            return "more indices than dims, or empty tensors"
        if kinds & {"bool", "uint8"}:
            return self._masked(spec, a, name, src, entries)
        if not kinds <= set(INDEX_DTYPES):
            return f"index dtypes {sorted(kinds)} are not generated"
        if len(entries) < 2:
            return "one index tensor: the indexing family's"
        return self._integer(spec, a, name, src, entries)

    def _integer(self, spec, a, name, src, entries) -> _Plan | str:
        V, O = spec.inputs[src], spec.outputs[0]
        metas = [spec.inputs[i] for _, i in entries]
        try:
            B = tuple(torch.broadcast_shapes(*(tuple(m.shape) for m in metas)))
        except RuntimeError:
            return "index tensors do not broadcast against each other"
        dims = [k for k, _ in entries]
        sliced = [d for d in range(len(V.shape)) if d not in dims]
        adjacent = dims == list(range(dims[0], dims[-1] + 1))
        # the result's dims: ("b", j) for B's, ("s", d) for a sliced dim of self
        before = [("s", d) for d in sliced if adjacent and d < dims[0]]
        after = [("s", d) for d in sliced if not adjacent or d > dims[-1]]
        layout = before + [("b", j) for j in range(len(B))] + after
        result = tuple(B[v] if k == "b" else V.shape[v] for k, v in layout)
        idx_strides = [cg.broadcast_strides(m, B) for m in metas]
        accumulate = name == "index_put" and bool(a.get("accumulate", False))
        plan = _Plan(name, False, accumulate, V.dtype, src, None, [i for _, i in entries], dims,
                     [V.shape[d] for d in dims], result)
        if name == "index":
            if tuple(O.shape) != result:
                return f"output shape {tuple(O.shape)} is not {result}"
            src_st = [V.stride[v] if k == "s" else 0 for k, v in layout]
            plan.ind = [V.stride[d] for d in dims]
        else:
            plan.self_in, plan.src = src, cg.tensor_index(a.get("values"))
            if plan.src is None or tuple(O.shape) != tuple(V.shape) or spec.inputs[plan.src].dtype != V.dtype:
                return "values must be a tensor of self's dtype; the output self's shape"
            if accumulate and V.dtype not in ADD_DTYPES:
                return f"accumulate of {V.dtype} is not generated (atomic adds: {', '.join(ADD_DTYPES)})"
            if not accumulate and (any(tuple(m.shape) != B for m in metas) or math.prod(B) > math.prod(plan.sizes)):
                return ("index_put without accumulate over index tensors that broadcast (or more combinations than "
                        "the dims hold): an element written twice, and ATen leaves which write wins unspecified")
            try:
                src_st = list(cg.broadcast_strides(spec.inputs[plan.src], result))
            except ValueError as e:
                return f"values: {e}"
            plan.ind = [O.stride[d] for d in dims]
        dst_st = ([O.stride[v] if k == "s" else 0 for k, v in layout] if name == "index_put" else list(O.stride))
        sets = [tuple(src_st), tuple(dst_st)] + [tuple(st[v] if k == "b" else 0 for k, v in layout)
                                                 for st in idx_strides]
        plan.domain, plan.strides = cg.simplify(result, sets, order_by=1 if name == "index" else 0)
        plan.wide = cg.needs_int64(result, sets, MAX_BLOCK) or any(
            cg.max_offset(m.shape, m.stride) > cg.INT32_MAX for m in spec.inputs + spec.outputs)
        return plan

    def _masked(self, spec, a, name, src, entries) -> _Plan | str:
        V, O = spec.inputs[src], spec.outputs[0]
        if name != "index_put" or len(entries) != 1:
            return "a bool mask is generated in index_put alone, as its only index (index's shape depends on it)"
        (p, i), = entries
        M = spec.inputs[i]
        m = len(M.shape)
        if M.dtype != "bool" or tuple(M.shape) != tuple(V.shape[p:p + m]) or tuple(O.shape) != tuple(V.shape):
            return "the mask must be bool, of the shape of the dims it covers"
        vi = cg.tensor_index(a.get("values"))
        if vi is None or spec.inputs[vi].dtype != V.dtype:
            return "values must be a tensor of self's dtype"
        accumulate = bool(a.get("accumulate", False))
        if accumulate and V.dtype == "bool":
            return "accumulate of bool"
        try:  # the values' dim of the mask's true elements must be broadcast: else they follow the data
            vs = cg.broadcast_strides(spec.inputs[vi], tuple(V.shape[:p]) + (1,) + tuple(V.shape[p + m:]))
        except ValueError:
            return "values follow the mask's true elements: a data-dependent layout"
        val = tuple(vs[:p]) + (0,) * m + tuple(vs[p + 1:])
        mask = (0,) * p + tuple(M.stride) + (0,) * (len(V.shape) - p - m)
        plan = _Plan(name, True, accumulate, V.dtype, vi, src, [i], [p], [V.shape[p]], tuple(V.shape))
        sets = [val, tuple(O.stride), tuple(V.stride), mask]
        plan.domain, plan.strides = cg.simplify(V.shape, sets, order_by=1)
        plan.wide = cg.needs_int64(V.shape, sets, MAX_BLOCK)
        return plan

    # --- configs ------------------------------------------------------------------------------
    def _valid(self, plan: _Plan, c: Config) -> bool:
        b, w = c["BLOCK"], c["num_warps"]
        return (isinstance(b, int) and b & (b - 1) == 0 and 32 <= b <= min(MAX_BLOCK, max(32, _p2(plan.N)))
                and w in (1, 2, 4, 8) and b >= 32 * w)

    def _seeds(self, spec: KernelSpec, plan: _Plan) -> list[Config]:
        blocks = [(max(32, min(b, _p2(plan.N))), w) for b, w in ((1024, 4), (256, 2), (4096, 8))]
        return [Config.of(BLOCK=b, num_warps=min(w, b // 32)) for b, w in blocks]

    def _steps(self, plan: _Plan, c: Config) -> list[Config]:
        return doubled_and_halved(c, ("BLOCK", "num_warps"))

    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        return _Gen(spec, self.checked_plan(spec, config), config).program()

    # --- validation inputs --------------------------------------------------------------------
    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Values by ``kind``; indices valid (negative ones too: ATen wraps them), distinct
        combinations where index_put overwrites; masks half true."""
        plan = self.plan(spec)
        g = sample_generator(seed, device)  # drawn where they are used (a gathered table is large)
        on = g.device
        out = [sample_tensor(m, g, kind) for m in spec.inputs]
        if not isinstance(plan, str) and not plan.masked:
            metas = [spec.inputs[i] for i in plan.idx]
            if plan.name == "index_put" and not plan.accumulate:  # distinct combinations (same shapes)
                flat = torch.randperm(math.prod(plan.sizes), generator=g, device=on)[:metas[0].numel]
                coords = torch.unravel_index(flat, tuple(plan.sizes))
            else:
                coords = [torch.randint(0, n, (m.numel,), generator=g, device=on) for m, n in zip(metas, plan.sizes)]
            for i, m, c, n in zip(plan.idx, metas, coords, plan.sizes):
                wrap = torch.rand(m.numel, generator=g, device=on) < 0.5   # i and i - n name one element
                out[i].copy_(torch.where(wrap, c - n, c).reshape(m.shape))
        return [to_device(t, device) for t in out]


# --- code generation -------------------------------------------------------------------------


class _Gen:
    def __init__(self, spec: KernelSpec, plan: _Plan, config: Config):
        self.spec, self.p, self.c = spec, plan, config
        self.s = cg.Source()

    def program(self) -> KernelProgram:
        p, s, O = self.p, self.s, self.spec.outputs[0]
        s(cg.HEADER, cg.describe_spec(self.spec))
        s(f"# {p.N} elements over sizes {list(p.domain)}, strides {[list(x) for x in p.strides]}")
        s.blank()
        launches, donations = [], ()
        if p.name == "index_put" and not p.masked:
            launches.append(self._copy())
            if self.spec.inputs[p.self_in] == O:
                donations = (Donation(0, p.self_in, (0,)),)  # a dead ``self`` is written into as it is
        launches.append(self._masked() if p.masked else self._indexed())
        flags = () if p.masked else tuple(Buffer((1,), "int32", 0) for _ in p.idx)
        checks = tuple(Check(k, f"{self.spec.op}: an index is out of bounds for dimension {d} with size {n}")
                       for k, (d, n) in enumerate(zip(p.dims, p.sizes))) if not p.masked else ()
        return KernelProgram(s.text(), tuple(launches), temps=flags, donations=donations, checks=checks)

    def _block(self, n: int, sets, prefix: str) -> tuple[list[str], str | None, int]:
        block = int(self.c["BLOCK"])
        offs, mask = cg.block_offsets(self.s, "e", "tl.program_id(0)", "BLOCK", block, n, self.p.wide, "mask",
                                      self.p.domain, sets, prefix)
        return offs, mask, block

    def _copy(self) -> Launch:
        """self -> out (the write at the index follows)."""
        V, O, s = self.spec.inputs[self.p.self_in], self.spec.outputs[0], self.s
        sizes, sets = cg.simplify(O.shape, [tuple(V.stride), tuple(O.stride)], order_by=1)
        block = min(1024, _p2(O.numel))
        s("@triton.jit", "def clone_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):").indent()
        offs, mask = cg.block_offsets(s, "e", "tl.program_id(0)", "BLOCK", block, O.numel, self.p.wide, "mask",
                                      sizes, sets, "k")
        kw = f", mask={mask}" if mask else ""
        s(f"tl.store(dst_ptr + {offs[1]}, tl.load(src_ptr + {offs[0]}{kw}){kw})")
        s.dedent().blank()
        return Launch("clone_kernel", (-(-O.numel // block),), (("in", self.p.self_in), ("out", 0)),
                      {"BLOCK": block}, 4 if block >= 512 else 1, 1)

    def _indexed(self) -> Launch:
        p, s = self.p, self.s
        k = len(p.idx)
        params = ", ".join([f"idx{j}_ptr" for j in range(k)] + [f"flag{j}_ptr" for j in range(k)])
        s("@triton.jit", f"def advanced_{p.name}_kernel(src_ptr, dst_ptr, {params}, BLOCK: tl.constexpr):").indent()
        s("# one element of the result per lane: every index tensor read at its broadcast offset")
        offs, mask, block = self._block(p.N, p.strides, "k")
        src_off, dst_off = offs[0], offs[1]
        moved = []
        for j, (n, stride) in enumerate(zip(p.sizes, p.ind)):
            kw = f", mask={mask}, other=0" if mask else ""
            s(f"i{j} = tl.load(idx{j}_ptr + {cg.as_block(offs[2 + j], 'e')}{kw}).to(tl.int64)",
              f"i{j} = tl.where(i{j} < 0, i{j} + {n}, i{j})  # negative indices count from the end",
              f"ok{j} = (i{j} >= 0) & (i{j} < {n})",
              f"tl.store(flag{j}_ptr + e * 0, tl.full([BLOCK], 1, tl.int32), mask={f'{mask} & ' if mask else ''}"
              f"(ok{j} == 0))  # out of range: eager's IndexError after the launch",
              f"i{j} = tl.where(ok{j}, i{j}, 0)  # never an access out of bounds")
            moved.append(cg.scaled(f"i{j}", stride))
        at = " + ".join([o for o in (dst_off if p.name == "index_put" else src_off,) if o != "0"] + moved)
        kw = f", mask={mask}" if mask else ""
        if p.name == "index":
            s(f"tl.store(dst_ptr + {cg.as_block(dst_off, 'e')}, tl.load(src_ptr + {at}{kw}){kw})")
        else:
            v = f"tl.load(src_ptr + {cg.as_block(src_off, 'e')}{kw})"
            if p.accumulate:
                s(f"tl.atomic_add(dst_ptr + {at}, {v}{kw}, sem=\"relaxed\")")
            else:
                s(f"tl.store(dst_ptr + {at}, {v}{kw})")
        s.dedent().blank()
        src, dst = ("in", p.src), ("out", 0)
        args = (src, dst) + tuple(("in", i) for i in p.idx) + tuple(("tmp", j) for j in range(k))
        return Launch(f"advanced_{p.name}_kernel", (-(-p.N // block),), args, {"BLOCK": block},
                      int(self.c["num_warps"]), 1)

    def _masked(self) -> Launch:
        p, s = self.p, self.s
        s("@triton.jit", "def masked_put_kernel(val_ptr, dst_ptr, self_ptr, mask_ptr, BLOCK: tl.constexpr):").indent()
        s(f"# out = {'self + where(mask, values, 0)' if p.accumulate else 'where(mask, values, self)'}, elementwise")
        offs, mask, block = self._block(p.N, p.strides, "k")
        kw = f", mask={mask}" if mask else ""
        s(f"m = tl.load(mask_ptr + {cg.as_block(offs[3], 'e')}{kw}) != 0",
          f"v = tl.load(val_ptr + {cg.as_block(offs[0], 'e')}{kw})",
          f"x = tl.load(self_ptr + {cg.as_block(offs[2], 'e')}{kw})")
        if p.accumulate:
            T = cg.tl_type(p.dtype)
            s(f"r = tl.where(m, x.to(tl.float32) + v.to(tl.float32), x.to(tl.float32)).to({T})"
              if cg.is_float(p.dtype) else "r = tl.where(m, x + v, x)")
        else:
            s("r = tl.where(m, v, x)")
        s(f"tl.store(dst_ptr + {cg.as_block(offs[1], 'e')}, r{kw})")
        s.dedent().blank()
        return Launch("masked_put_kernel", (-(-p.N // block),),
                      (("in", p.src), ("out", 0), ("in", p.self_in), ("in", p.idx[0])), {"BLOCK": block},
                      int(self.c["num_warps"]), 1)


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


FAMILY = AdvancedIndexingFamily()
