"""aten.sort: every row along a dim in order, and the indices that order it; a stable sort.

Each element's place in the sorted row is its rank: the number of elements of its row that come
before it, i.e. that compare before it or equal it at a lower index. A program owns BLOCK_I
elements of one row and counts, over the row in blocks of BLOCK_J, how many of the row's elements
come before each; then it stores each element (its bits as they were) and its index at its rank.
Ranks are a permutation of the row, so the stores never collide, and any dtype sorts the same way
(no packing of values and indices into one key). The work is N^2 compares per row: rows are
limited to MAX_N elements. MoE routing sorts the flat expert ids of the tokens (tokens x top-k).

Rows of up to BITONIC_MAX elements of a dtype of 32 bits or fewer have a second variant,
VARIANT="bitonic": BLOCK_M rows per program, each a row of keys ``(order key << 32) | index`` in
int64 (the value's bits mapped to an int32 whose order is the sort's; NaN the largest, -0.0 as
+0.0, descending negated), sorted by a bitonic network (log2(n)^2 / 2 compare-exchanges, each a
reshape, split and join: no reduction, which the interpreter would run element by element); the
index comes from the low bits (keys are distinct, so the order is the stable one) and the value
is gathered from the input (its bits as they were). The rank variant is N^2 compares: 8000
elements took minutes on the interpreter, where the bitonic network takes a fraction of a second.

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
BITONIC_MAX = 1 << 14     # a bitonic row is one block of int64 keys (registers)
BITONIC_DTYPES = ("float32", "float16", "bfloat16", "int32", "int16", "int8", "uint8", "bool")


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
        if c.get("VARIANT", "rank") == "bitonic":
            bm, w, n = c["BLOCK_M"], c["num_warps"], next_pow2(plan.rows.N)
            return (plan.dtype in BITONIC_DTYPES and n <= BITONIC_MAX and _is_pow2(bm) and bm <= next_pow2(plan.rows.M)
                    and bm * n <= BITONIC_MAX and w in (1, 2, 4, 8, 16) and (bm * n >= 32 * w or w == 1))
        if c.get("VARIANT", "rank") != "rank":
            return False
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

    def _bitonic(self, plan: _Plan, tile: int) -> Config:
        """``tile`` keys a program (whole rows), about 16 a thread (64-bit keys: registers)."""
        n = next_pow2(plan.rows.N)
        bm = max(1, min(tile // n, next_pow2(plan.rows.M)))
        return Config.of(VARIANT="bitonic", BLOCK_M=bm, num_warps=max(1, min(16, bm * n // 512)))

    def _seeds(self, spec: KernelSpec, plan: _Plan) -> list[Config]:
        bitonic = [self._bitonic(plan, 2048), self._bitonic(plan, 8192)]
        return bitonic + [self._cfg(plan, 64, 128, 4), self._cfg(plan, 128, 128, 8), self._cfg(plan, 32, 256, 4),
                self._cfg(plan, 16, 64, 1)]

    def _steps(self, plan: _Plan, c: Config) -> list[Config]:
        if c.get("VARIANT", "rank") == "bitonic":
            return doubled_and_halved(c, ("BLOCK_M", "num_warps"))
        return doubled_and_halved(c, ("BLOCK_I", "BLOCK_J", "num_warps"))

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.checked_plan(spec, config)
        if config.get("VARIANT", "rank") == "bitonic":
            return _generate_bitonic(spec, plan, int(config["BLOCK_M"]), int(config["num_warps"]))
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


def _generate_bitonic(spec: KernelSpec, plan: _Plan, bm: int, warps: int) -> KernelProgram:
    """BLOCK_M rows per program, each sorted as one block of distinct int64 keys (module doc)."""
    p, n = plan.rows, next_pow2(plan.rows.N)
    s = cg.Source()
    s(cg.HEADER, cg.describe_spec(spec))
    s(f"# {p.M} rows over sizes {list(p.m_sizes)}, strides [in, values, indices] {[list(x) for x in p.m_strides]}",
      f"# rows of {p.N} (a block of {n} keys), strides along them [in, values, indices] {list(p.n_strides)}; "
      f"{'descending' if plan.descending else 'ascending'}, bitonic", "")
    s("@triton.jit", "def sort_kernel(in0_ptr, out0_ptr, out1_ptr, BLOCK_M: tl.constexpr):").indent()
    offs, rm = cg.block_offsets(s, "rows", "tl.program_id(0)", "BLOCK_M", bm, p.M, p.wide, "row_mask",
                                p.m_sizes, p.m_strides, "m")
    in_row, val_row, idx_row = (cg.as_block(o, "rows") for o in offs)
    s(f"cols = tl.arange(0, {n}){'.to(tl.int64)' if p.wide else ''}",
      f"mask = {'row_mask[:, None] & ' if rm else ''}(cols < {p.N})[None, :]",
      f"x = tl.load(in0_ptr + ({in_row})[:, None] + ({cg.scaled('cols', p.n_strides[0])})[None, :], mask=mask)")
    s(*_order_key(plan),
      "key = (order.to(tl.int64) << 32) | cols[None, :].to(tl.int64)   # distinct: ties by index",
      "key = tl.where(mask, key, 0x7FFFFFFFFFFFFFFF)                 # padding sorts last")
    s(*_bitonic_network(n))
    s("idx = key & 0xFFFFFFFF",
      f"value = tl.load(in0_ptr + ({in_row})[:, None] + {cg.scaled('idx', p.n_strides[0])}, mask=mask)",
      f"tl.store(out0_ptr + ({val_row})[:, None] + ({cg.scaled('cols', p.n_strides[1])})[None, :], value, mask=mask)",
      f"tl.store(out1_ptr + ({idx_row})[:, None] + ({cg.scaled('cols', p.n_strides[2])})[None, :], idx, mask=mask)")
    s.dedent()
    launch = Launch("sort_kernel", (-(-p.M // bm),), (("in", 0), ("out", 0), ("out", 1)), {"BLOCK_M": bm}, warps, 1)
    return KernelProgram(s.text(), (launch,))


def _order_key(p: _Plan) -> list[str]:
    """Lines making ``order``: an int32 per element whose ascending order is the sort's."""
    if p.dtype in cg.FLOAT_TYPES:
        lines = [f"f = x{'.to(tl.float32)' if p.dtype != 'float32' else ''}",
                 "b = tl.where(f == 0.0, 0.0, f).to(tl.int32, bitcast=True)   # -0.0 ties +0.0",
                 "order = tl.where(b < 0, b ^ 0x7FFFFFFF, b)                  # float order as int order",
                 "order = tl.where(f != f, 0x7FFFFFFF, order)                 # NaN: the largest"]
    else:
        lines = ["order = x.to(tl.int32)"]
    return lines + (["order = order ^ -1   # descending: the order reversed (NaN first)"] if p.descending else [])


def _bitonic_network(n: int) -> list[str]:
    """Lines sorting ``key`` ([BLOCK_M, n], n a power of two) ascending along its rows: for each
    merge size k and distance j, the pairs (p, p + j) split out by a reshape, ordered (ascending
    where p & k is 0, except in the last merge, all ascending), joined back."""
    lines, k = [], 2
    while k <= n:
        j = k // 2
        while j >= 1:
            q = n // (2 * j)
            pairs = f"tl.reshape(key, [BLOCK_M, {q}, 2])" if j == 1 else \
                f"tl.permute(tl.reshape(key, [BLOCK_M, {q}, 2, {j}]), [0, 1, 3, 2])"
            lines.append(f"lo, hi = tl.split({pairs})   # k={k}, j={j}")
            if k == n:
                lines.append("swap = lo > hi")
            else:
                down = f"(((tl.arange(0, {q}) * {2 * j}) & {k}) != 0)"
                lines.append(f"swap = (lo > hi) != {down}[None, :{', None' if j > 1 else ''}]")
            lines.append("lo, hi = tl.where(swap, hi, lo), tl.where(swap, lo, hi)")
            joined = "tl.join(lo, hi)" if j == 1 else "tl.permute(tl.join(lo, hi), [0, 1, 3, 2])"
            lines.append(f"key = tl.reshape({joined}, [BLOCK_M, {n}])")
            j //= 2
        k *= 2
    return lines


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
