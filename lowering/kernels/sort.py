"""aten.sort: every row along a dim in order, and the indices that order it; a stable sort.

Each element's place in the sorted row is its rank: the number of elements of its row that come
before it, i.e. that compare before it or equal it at a lower index. A program owns BLOCK_I
elements of one row and counts, over the row in blocks of BLOCK_J, how many of the row's elements
come before each; then it stores each element (its bits as they were) and its index at its rank.
Ranks are a permutation of the row, so the stores never collide, and any dtype sorts the same way
(no packing of values and indices into one key). The work is N^2 compares per row: rows are
limited to MAX_N elements. MoE routing sorts the flat expert ids of the tokens (tokens x top-k).

Order follows ATen: ascending puts NaN last, descending first; -0.0 and +0.0 are equal. ATen's
sort (stable=False) leaves the order of equal elements unspecified (on CPU and CUDA it is not
stable): the values agree on any input and ``resolve_ties`` accepts any index that names an
element equal to the reference's, so long as a row names no element twice. stable=True asks for
what the kernel does anyway.
"""
from __future__ import annotations

import dataclasses

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import Config, PicksAlongDim, doubled_and_halved, next_pow2
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec

DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
MAX_N = 1 << 17           # N^2 compares per row: 2^34 at most
MAX_TILE = 16384          # compares of one BLOCK_I x BLOCK_J tile


@dataclasses.dataclass
class _Plan:
    dtype: str
    descending: bool
    dim: int
    rows: cg.Rows                      # stride sets [in, values, indices]


class SortFamily(PicksAlongDim):
    name = "sort"
    ops = frozenset({"aten.sort.default", "aten.sort.stable"})
    edge_kinds = ("zeros", "large", "negative", "special")   # "zeros": every element ties

    def _analyse(self, spec: KernelSpec) -> _Plan | str:
        a, x = cg.operand(spec, "self", DTYPES)
        d, desc = cg.dim_arg(a.get("dim", -1), len(x.shape)), a.get("descending", False)
        if isinstance(d, str):
            return d
        if not isinstance(desc, bool):
            return f"descending={desc!r} is not a bool"
        if x.numel == 0:
            return "empty input: nothing to sort"
        N = cg.as_1d(x).shape[d]
        if N > MAX_N:
            return f"rows of {N} > {MAX_N} elements (N^2 compares)"
        if len(spec.outputs) != 2 or any(tuple(o.shape) != tuple(x.shape) for o in spec.outputs):
            return f"outputs {[o.shape for o in spec.outputs]} are not two {tuple(x.shape)}"
        v, ix = spec.outputs
        if v.dtype != x.dtype or ix.dtype != "int64":
            return "outputs are not (values in the input dtype, int64 indices)"
        if any(not cg.non_overlapping(o) for o in (v, ix)):
            return "output strides overlap (some elements share memory)"
        return _Plan(x.dtype, desc, d, cg.rows_along(tuple(map(cg.as_1d, (x, v, ix))), d))  # 0-d: one row of 1

    # --- configs ------------------------------------------------------------------------------
    def _valid(self, plan: _Plan, c: Config) -> bool:
        bi, bj, w = c["BLOCK_I"], c["BLOCK_J"], c["num_warps"]
        if not (_is_pow2(bi) and _is_pow2(bj)) or w not in (1, 2, 4, 8, 16):
            return False
        n = next_pow2(plan.rows.N)
        # a tile of fewer than 32 * num_warps compares only where the whole row fits it (short rows)
        return bi <= n and bj <= n and bi * bj <= MAX_TILE and (bi * bj >= 32 * w or (w == 1 and bi == bj == n))

    def _cfg(self, plan: _Plan, bi: int, bj: int, warps: int) -> Config:
        n = next_pow2(plan.rows.N)
        bi, bj = min(bi, n), min(bj, n)
        return Config.of(BLOCK_I=bi, BLOCK_J=bj, num_warps=max(1, min(warps, bi * bj // 32)))

    def _seeds(self, spec: KernelSpec, plan: _Plan) -> list[Config]:
        return [self._cfg(plan, 64, 128, 4), self._cfg(plan, 128, 128, 8), self._cfg(plan, 32, 256, 4),
                self._cfg(plan, 16, 64, 1)]

    def _steps(self, plan: _Plan, c: Config) -> list[Config]:
        return doubled_and_halved(c, ("BLOCK_I", "BLOCK_J", "num_warps"))

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.checked_plan(spec, config)
        p = plan.rows
        bi, bj, warps = int(config["BLOCK_I"]), int(config["BLOCK_J"]), int(config["num_warps"])
        blocks = -(-p.N // bi)
        s = cg.Source()
        s(cg.HEADER, cg.describe_spec(spec))
        s(f"# {p.M} rows over sizes {list(p.m_sizes)}, strides [in, values, indices] {[list(x) for x in p.m_strides]}",
          f"# rows of {p.N}, strides along them [in, values, indices] {list(p.n_strides)}; "
          f"{'descending' if plan.descending else 'ascending'}, {blocks} programs per row", "")
        s("@triton.jit", "def sort_kernel(in0_ptr, out0_ptr, out1_ptr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):").indent()
        s(f"pid = tl.program_id(0){'.to(tl.int64)' if p.wide else ''}",
          f"row = pid // {blocks}",
          f"i = (pid % {blocks}) * BLOCK_I + tl.arange(0, BLOCK_I)",
          f"i_mask = i < {p.N}")
        lines, offs = cg.decompose("row", p.m_sizes, p.m_strides, "m")
        for line in lines:
            s(line)
        in_row, val_row, idx_row = offs
        key = {"bool": ".to(tl.int8)", "float16": ".to(tl.float32)", "bfloat16": ".to(tl.float32)"}.get(plan.dtype, "")

        def at(row: str, idx: str, stride: int) -> str:
            return f"{'' if row == '0' else row + ' + '}{cg.scaled(idx, stride)}"

        s(f"xi = tl.load(in0_ptr + {at(in_row, 'i', p.n_strides[0])}, mask=i_mask)",
          f"ki = xi{key}",
          "rank = tl.zeros([BLOCK_I], dtype=tl.int32)",
          f"for j0 in range(0, {p.N}, BLOCK_J):").indent()
        s("j = j0 + tl.arange(0, BLOCK_J)",
          f"kj = tl.load(in0_ptr + {at(in_row, 'j', p.n_strides[0])}, mask=j < {p.N}){key}",
          "a = kj[None, :]",
          "b = ki[:, None]",
          f"j_first = {_comes_first('a', 'b', plan)}",
          f"i_first = {_comes_first('b', 'a', plan)}",
          "# j before i: it compares before, or ties with it at a lower index (a stable order)",
          f"before = (j_first | (~i_first & (j[None, :] < i[:, None]))) & (j < {p.N})[None, :]",
          "rank += tl.sum(before.to(tl.int32), axis=1)")
        s.dedent()
        s(f"tl.store(out0_ptr + {at(val_row, 'rank', p.n_strides[1])}, xi, mask=i_mask)",
          f"tl.store(out1_ptr + {at(idx_row, 'rank', p.n_strides[2])}, i.to(tl.int64), mask=i_mask)")
        s.dedent()
        launch = Launch("sort_kernel", (p.M * blocks,), (("in", 0), ("out", 0), ("out", 1)),
                        {"BLOCK_I": bi, "BLOCK_J": bj}, warps, 1)
        return KernelProgram(s.text(), (launch,))


def _comes_first(a: str, b: str, p: _Plan) -> str:
    """Whether ``a`` sorts strictly before ``b`` (ATen: NaN is the largest float)."""
    op = ">" if p.descending else "<"
    if p.dtype not in cg.FLOAT_TYPES:
        return f"({a} {op} {b})"
    if p.descending:
        return f"(({a} > {b}) | (({a} != {a}) & ({b} == {b})))"
    return f"(({a} < {b}) | (({a} == {a}) & ({b} != {b})))"


def _is_pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v == next_pow2(v)


FAMILY = SortFamily()
