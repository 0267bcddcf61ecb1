"""The rowwise emitter of fused regions (fused.py): the Triton kernel of a rowwise plan, one
pass with the row in registers or passes over the row in blocks (see fused.py's docstring)."""
from __future__ import annotations

from typing import Any

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.fused_emit import _Emitter
from torch_kernelize.lowering.kernels.fused_plan import Ref, _Node, _Tensor, _vtype
from torch_kernelize.core.program import KernelProgram, Launch

INF = "float('inf')"


class _RowwiseEmitter(_Emitter):
    """``runtime_rows``: a bucketed kernel's number of rows as a SizeExpr (core/buckets.py); the
    kernel then takes it as the argument ``n_rows`` and masks every block of rows."""
    runtime_rows: Any = None

    def params(self) -> list[str]:
        return super().params() + ([] if self.runtime_rows is None else ["n_rows"])

    def program(self, graph_nodes: list[dict[str, Any]]) -> KernelProgram:
        self.graph_nodes = graph_nodes
        p, s = self.p, self.s
        self.bm, self.bn = int(self.c["BLOCK_M"]), int(self.c["BLOCK_N"])
        self.single = self.bn >= p.N
        sets = p.lead_strides
        self.wide = cg.needs_int64(p.lead_sizes, sets, slack=self.bm) or any(
            cg.max_offset(p.lead_sizes, st) + (p.N - 1 + self.bn) * abs(t.col_stride) > cg.INT32_MAX
            for st, t in zip(sets, p.inputs + p.outputs))
        self.module_head()
        rows = f"M={p.M}" if self.runtime_rows is None else f"n_rows (a run-time size, at most {p.M})"
        s(f"# rows: {rows} over sizes {list(p.lead_sizes)}; row length N={p.N}; "
          + ("one pass, the row in registers" if self.single else
             f"{p.passes} pass(es) over the row in blocks of {self.bn}"),
          "# row strides: " + ", ".join(f"{t.name} {list(st)}" for t, st in zip(p.inputs + p.outputs, sets)),
          "# last-dim strides: " + ", ".join(f"{t.name} {t.col_stride}" for t in p.inputs + p.outputs))
        self.wrap(["BLOCK_M", "BLOCK_N"], self.body)
        args = tuple(("in", i) for i in range(len(p.inputs))) + tuple(("out", k) for k in range(len(p.outputs)))
        sizes = {}
        if self.runtime_rows is not None:
            args, sizes = cg.runtime_size(args, p.M, self.runtime_rows, self.bm, p.M + self.bm > cg.INT32_MAX)
        launch = Launch(self.kname, (-(-p.M // self.bm),), args, {"BLOCK_M": self.bm, "BLOCK_N": self.bn},
                        num_warps=int(self.c["num_warps"]), num_stages=int(self.c["num_stages"]), runtime_sizes=sizes)
        return KernelProgram(s.text(), (launch,))

    # rows, columns, masks, pointers ---------------------------------------------------------
    def rows(self) -> None:
        p, s = self.p, self.s
        offs, self.row_mask = cg.block_offsets(s, "rows", "pid", "BLOCK_M", self.bm,
                                               p.M if self.runtime_rows is None else "n_rows", self.wide, "row_mask",
                                               p.lead_sizes, p.lead_strides, "m")
        self.col_mask = None
        named: dict[str, str] = {}
        for t, off in zip(p.inputs + p.outputs, offs):
            if " " in off:  # a compound offset: computed once, shared by the tensors with these strides
                if off not in named:
                    named[off] = f"row_off{len(named)}"
                    s(f"{named[off]} = {off}")
                off = named[off]
            t.row_off = off

    def cols(self, start: str | None) -> None:
        s = self.s
        base = "tl.arange(0, BLOCK_N)" if start is None else f"{start} + tl.arange(0, BLOCK_N)"
        if self.wide:
            base = f"({base}).to(tl.int64)"
        s(f"cols = {base}")
        self.col_mask = None
        if (self.single and self.bn != self.p.N) or (not self.single and self.p.N % self.bn):
            s(f"col_mask = cols < {self.p.N}")
            self.col_mask = "col_mask"

    def mask(self, cls: str) -> str | None:
        r = f"{self.row_mask}[:, None]" if self.row_mask else None
        c = f"{self.col_mask}[None, :]" if self.col_mask else None
        if cls == "full":
            return f"{r} & {c}" if r and c else (r or c)
        if cls == "row":
            return r
        if cls == "col":
            return c
        return None

    def pointer(self, t: _Tensor, cls: str, hinted: bool) -> str:
        row = f"({t.row_off})" if " " in t.row_off else t.row_off
        col = cg.scaled("cols", t.col_stride)
        col = f"({col})" if " " in col else col
        if cls == "row":
            return f"{t.name}_ptr + {row if t.row_off != '0' else '(rows * 0)'}[:, None]"
        if cls == "col":
            ptr = f"{t.name}_ptr + {col}[None, :]"
        else:
            ptr = f"{t.name}_ptr + {row if t.row_off != '0' else '(rows * 0)'}[:, None] + {col}[None, :]"
        if hinted and t.hint:
            self.s(f"p_{t.name} = {ptr}", "if ALIGNED:").indent()(
                f"p_{t.name} = tl.multiple_of(p_{t.name}, [1, 16])").dedent()
            return f"p_{t.name}"
        return ptr

    def load(self, i: int, hinted: bool, last_pass: bool) -> None:
        t = self.p.inputs[i]
        conv = "" if _vtype(t.meta.dtype) == t.meta.dtype else ".to(tl.float32)"
        if t.cls == "scalar":
            self.s(f"x{i} = tl.load({t.name}_ptr){conv}  # one element, broadcast")
            return
        ptr = self.pointer(t, t.cls, hinted)
        m = self.mask(t.cls)
        other = "0" if t.meta.dtype == "bool" or cg.is_int(t.meta.dtype) else "0.0"
        kw = f", mask={m}, other={other}" if m else ""
        if self.evict and t.cls != "row":
            kw += ", eviction_policy=" + ("'evict_first'" if t.cls == "full" and last_pass else "'evict_last'")
        note = {"row": "  # [BLOCK_M, 1]: one value per row", "col": "  # [1, BLOCK_N]: the same for every row"}.get(t.cls, "")
        self.s(f"x{i} = tl.load({ptr}{kw}){conv}{note}")

    def store(self, k: int, hinted: bool) -> None:
        t, j = self.p.outputs[k], self.p.out_nodes[k]
        ptr = self.pointer(t, t.cls, hinted)
        m = self.mask(t.cls)
        self.s(f"tl.store({ptr}, {self.store_value(self.p.nodes[j], t)}{', mask=' + m if m else ''})")

    def cls_of(self, r: Ref) -> str:
        if r[0] == "const":
            return "scalar"
        if r[0] == "input":
            return self.p.inputs[r[1]].cls
        n = self.p.nodes[r[1]]
        if n.role == "reduce":
            return "row"
        if n.role == "softmax":
            return self.widen(self.cls_of(n.operands[0]))
        cls = "scalar"
        for x in n.operands:
            cls = _join(cls, self.cls_of(x))
        return cls

    @staticmethod
    def widen(cls: str) -> str:
        return cls if cls in ("full", "col") else "full"

    def tile(self, r: Ref) -> str:
        """A full-shape operand of a reduction as a tile with a column axis."""
        v = self.var(r)
        return v if self.cls_of(r) in ("full", "col") else f"tl.broadcast_to({v}, (BLOCK_M, BLOCK_N))"

    # node emission ------------------------------------------------------------------------
    def reduce_single(self, n: _Node) -> None:
        s, v = self.s, self.var(("node", n.index))
        x = self.tile(n.operands[0])
        cm = f"{self.col_mask}[None, :]" if self.col_mask else None
        if n.reduce in ("sum", "mean"):
            t = f"tl.where({cm}, {x}, 0.0)" if cm else x
            total = f"tl.sum({t}, 1)[:, None]"
            s(f"{v} = {total}" if n.reduce == "sum" else f"{v} = tl.div_rn({total}, {cg.float_literal(self.p.N)})")
        elif n.reduce in ("amax", "amin"):
            init = "-" + INF if n.reduce == "amax" else INF
            red = "tl.max" if n.reduce == "amax" else "tl.min"
            if cm:
                s(f"t{n.index} = tl.where({cm}, {x}, {init})")
                x = f"t{n.index}"
            s(f"{v} = {red}({x}, 1)[:, None]",
              f"{v} += tl.sum(tl.where({x} != {x}, {x}, 0.0), 1)[:, None]  # a NaN in the row wins, as in ATen")
        else:  # softmax / log_softmax: statistics and value at once
            j = n.index
            if cm:
                s(f"t{j} = tl.where({cm}, {x}, -{INF})")
                x = f"t{j}"
            s(f"rmax{j} = tl.max({x}, 1)[:, None]", f"e{j} = tl.exp({x} - rmax{j})")
            if cm:
                s(f"e{j} = tl.where({cm}, e{j}, 0.0)  # padding: exp(-inf - -inf) would be NaN")
            s(f"rsum{j} = tl.sum(e{j}, 1)[:, None]")
            s(f"{v} = tl.div_rn(e{j}, rsum{j})" if n.reduce == "softmax"
              else f"{v} = {x} - rmax{j} - tl.log(rsum{j})")

    def softmax_value(self, n: _Node) -> str:
        j, x = n.index, self.var(n.operands[0])
        if n.reduce == "softmax":
            return f"tl.div_rn(tl.exp({x} - rmax{j}), rsum{j})"
        return f"{x} - rmax{j} - tl.log(rsum{j})"

    def body(self, hinted: bool) -> None:
        self.rows()
        if self.single:
            self.single_pass(hinted)
        else:
            self.looped(hinted)

    def single_pass(self, hinted: bool) -> None:
        p, s = self.p, self.s
        self.cols(None)
        outs = {j: k for k, j in enumerate(p.out_nodes)}
        loaded: set[int] = set()
        for n in p.nodes:
            # each input is loaded right before its first use (as Inductor does): a weight read after
            # the row's reduction holds no registers across it
            for r in n.operands:
                if r[0] == "input" and r[1] not in loaded:
                    loaded.add(r[1])
                    self.load(r[1], hinted, last_pass=True)
            s(self.describe(n))
            if n.role == "pointwise":
                s(f"v{n.index} = {self.pointwise_expr(n)}")
            else:
                self.reduce_single(n)
            if n.index in outs:
                self.store(outs[n.index], hinted)

    def looped(self, hinted: bool) -> None:
        p = self.p
        outs = {j: k for k, j in enumerate(p.out_nodes)}
        for i, t in enumerate(p.inputs):
            if t.cls in ("row", "scalar"):
                self.load(i, hinted, last_pass=False)
        self.row_nodes(0, outs, hinted)
        for pas in range(p.passes):
            self.one_pass(pas, outs, hinted)
            self.row_nodes(pas + 1, outs, hinted)

    def one_pass(self, pas: int, outs: dict[int, int], hinted: bool) -> None:
        """Pass ``pas`` over the row in blocks of BLOCK_N: the reductions of level ``pas`` + 1
        accumulated block by block, the full-shape outputs of level ``pas`` stored."""
        p, s = self.p, self.s
        reds = [n for n in p.nodes if n.role != "pointwise" and n.level == pas + 1]
        stores = [j for j in p.out_nodes if p.nodes[j].shape == "full" and p.nodes[j].level == pas]
        need = self.needed([n.operands[0] for n in reds] + [("node", j) for j in stores])
        s.blank()(f"# pass {pas + 1} of {p.passes}: " + ", ".join(
            [f"{n.reduce} v{n.index}" for n in reds] + [f"store v{j}" for j in stores]))
        for n in reds:
            self.accumulator(n)
        s(f"for c0 in range(0, {p.N}, BLOCK_N):").indent()
        self.cols("c0")
        for i, t in enumerate(p.inputs):
            if t.cls in ("full", "col") and ("input", i) in need:
                self.load(i, hinted, last_pass=pas == p.passes - 1)
        for n in p.nodes:
            if ("node", n.index) in need:
                s(self.describe(n))
                s(f"v{n.index} = {self.pointwise_expr(n) if n.role == 'pointwise' else self.softmax_value(n)}")
        cm = f"{self.col_mask}[None, :]" if self.col_mask else None
        for n in reds:
            self.accumulate(n, cm)
        for j in stores:
            self.store(outs[j], hinted)
        s.dedent()
        for n in reds:
            self.reduced(n)

    def accumulator(self, n: _Node) -> None:
        """The [BLOCK_M, BLOCK_N] accumulator(s) of a looped reduction, before the blocks."""
        s, j = self.s, n.index
        if n.reduce in ("sum", "mean"):
            s(f"acc{j} = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
        elif n.reduce in ("amax", "amin"):
            s(f"acc{j} = tl.full([BLOCK_M, BLOCK_N], {'-' if n.reduce == 'amax' else ''}{INF}, dtype=tl.float32)")
        else:
            s(f"m{j} = tl.full([BLOCK_M, BLOCK_N], -{INF}, dtype=tl.float32)",
              f"s{j} = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")

    def accumulate(self, n: _Node, cm: str | None) -> None:
        """One block of a looped reduction added to its accumulator(s) (``cm``: the column mask)."""
        s = self.s
        j, x = n.index, self.tile(n.operands[0])
        if n.reduce in ("sum", "mean"):
            s(f"acc{j} += tl.where({cm}, {x}, 0.0)" if cm else f"acc{j} += {x}")
        elif n.reduce in ("amax", "amin"):
            init, better = ("-" + INF, ">") if n.reduce == "amax" else (INF, "<")
            if cm:
                s(f"t{j} = tl.where({cm}, {x}, {init})")
                x = f"t{j}"
            s(f"acc{j} = tl.where(({x} {better} acc{j}) | ({x} != {x}), {x}, acc{j})  # NaN sticks")
        else:
            if cm:
                s(f"t{j} = tl.where({cm}, {x}, -{INF})")
                x = f"t{j}"
            s(f"m_new = tl.maximum(m{j}, {x})",
              "# lanes that have only seen -inf keep sum 0 (exp(-inf - -inf) would be NaN)",
              f"s{j} = s{j} * tl.where(m_new == -{INF}, 1.0, tl.exp(m{j} - m_new)) + "
              f"tl.where(m_new == -{INF}, 0.0, tl.exp({x} - m_new))",
              f"m{j} = m_new")

    def reduced(self, n: _Node) -> None:
        """A looped reduction's row value from its accumulator(s), after the blocks (softmax: its
        row statistics, which ``softmax_value`` reads)."""
        s, j, v = self.s, n.index, f"v{n.index}"
        if n.reduce == "sum":
            s(f"{v} = tl.sum(acc{j}, 1)[:, None]")
        elif n.reduce == "mean":
            s(f"{v} = tl.div_rn(tl.sum(acc{j}, 1)[:, None], {cg.float_literal(self.p.N)})")
        elif n.reduce in ("amax", "amin"):
            s(f"{v} = {'tl.max' if n.reduce == 'amax' else 'tl.min'}(acc{j}, 1)[:, None]",
              f"{v} += tl.sum(tl.where(acc{j} != acc{j}, acc{j}, 0.0), 1)[:, None]  # keep NaN")
        else:
            s(f"rmax{j} = tl.max(m{j}, 1)[:, None]",
              f"rsum{j} = tl.sum(tl.where(m{j} == -{INF}, 0.0, s{j} * tl.exp(m{j} - rmax{j})), 1)[:, None]")

    def row_nodes(self, level: int, outs: dict[int, int], hinted: bool) -> None:
        """Row-shape values available after pass ``level`` (0: before the first): computed and stored."""
        for n in self.p.nodes:
            if n.shape == "row" and n.level == level:
                if n.role == "pointwise":
                    self.s(self.describe(n), f"v{n.index} = {self.pointwise_expr(n)}")
                if n.index in outs:
                    self.store(outs[n.index], hinted)

    def needed(self, roots: list[Ref]) -> set[Ref]:
        """Full-shape nodes (and inputs) a pass recomputes for ``roots``: row values are known."""
        seen: set[Ref] = set()
        stack = list(roots)
        while stack:
            r = stack.pop()
            if r in seen or r[0] == "const":
                continue
            if r[0] == "input":
                seen.add(r)
                continue
            n = self.p.nodes[r[1]]
            if n.shape == "row":
                continue
            seen.add(r)
            stack.extend(n.operands)
        return seen


def _join(a: str, b: str) -> str:
    order = {"scalar": 0, "row": 1, "col": 1, "full": 2}
    if {a, b} == {"row", "col"}:
        return "full"
    return a if order[a] >= order[b] else b
