"""Code generation for fused regions (fused.py): ``_Emitter``, what both kinds of kernel share
(node expressions, the module head, the alignment test of ALIGN), and ``_PointwiseEmitter``, the
flat walk of a pointwise plan. The rowwise emitter is fused_emit_rowwise.py."""
from __future__ import annotations

import json
import math
from typing import Any

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.elementwise import HELPERS
from torch_kernelize.lowering.kernels.fused_plan import Ref, _itemsize, _Node, _Plan, _Tensor, _vtype
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.region_graph import node_ref


def _convert(expr: str, src: str, dst: str) -> str:
    """A variable of type ``src`` as type ``dst`` (variable types: float32, integers, bool)."""
    if src == dst:
        return expr
    if dst == "bool":
        return f"({expr} != 0)"
    return f"{expr}.to({cg.tl_type(dst)})"


class _Emitter:
    """Writes the Triton module of a plan under one config."""

    def __init__(self, plan: _Plan, config: Config, header: str, kname: str):
        self.p, self.c, self.header, self.kname = plan, config, header, kname
        self.s = cg.Source()
        self.align = bool(config.get("ALIGN", False))
        self.evict = bool(config.get("EVICT", False))
        self.graph_nodes: list[dict[str, Any]] = []

    # shared pieces ------------------------------------------------------------------------
    def var(self, r: Ref) -> str:
        return f"x{r[1]}" if r[0] == "input" else f"v{r[1]}"

    def vtype(self, r: Ref) -> str:
        return _vtype(self.p.inputs[r[1]].meta.dtype) if r[0] == "input" else self.p.nodes[r[1]].vtype

    def describe(self, n: _Node) -> str:
        def show(a: Any) -> str:
            r = node_ref(a)
            if r:
                return self.var(r)
            if isinstance(a, list):
                return "[" + ", ".join(show(x) for x in a) + "]"
            return json.dumps(a) if not isinstance(a, (int, float)) or isinstance(a, bool) else repr(a)
        g = self.graph_nodes[n.index]
        parts = [show(a) for a in g.get("args", [])] + [f"{k}={show(v)}" for k, v in g.get("kwargs", {}).items()]
        return f"# {self.var(('node', n.index))} = {n.op.removeprefix('aten.')}({', '.join(parts)}) -> {n.meta.short()}"

    def pointwise_expr(self, n: _Node) -> str:
        pw, ctype = n.pw, n.ctype
        if pw.kind == "copy":
            r = n.operands[0]
            src, e = self.vtype(r), self.var(r)
            dst = n.meta.dtype
            if dst == "bool":
                return _convert(e, src, "bool")
            if dst in cg.FLOAT_TYPES:
                e = _convert(e, src, "float32")
                if n.rounds:
                    e = f"{e}.to({cg.tl_type(dst)}).to(tl.float32)"  # the cast rounds to {dst}
                return e
            return _convert(e, src, dst)
        exprs = []
        for k, r in enumerate(n.operands):
            if r[0] == "const":
                exprs.append(str(int(bool(r[1]))) if ctype == "bool" else cg.literal(r[1], ctype))
                continue
            raw = pw.kind == "logical" or (pw.kind == "select" and k == 0)
            exprs.append(self.var(r) if raw else _convert(self.var(r), self.vtype(r), ctype))
        e = pw.body(exprs, n.args, ctype)
        if n.vtype in ("int8", "int16", "uint8"):
            e = f"({e}).to({cg.tl_type(n.vtype)})"  # keep the narrow integer type (wraps as in ATen)
        return e

    def store_value(self, n: _Node, out: _Tensor) -> str:
        """The node's variable in the output's dtype (fp32 values are rounded once, here)."""
        return _convert(self.var(("node", n.index)), n.vtype, out.meta.dtype)

    def module_head(self) -> None:
        s = self.s
        s(cg.HEADER, self.header)
        for h in self.p.helpers:
            s.blank()(HELPERS[h].strip("\n"))
        s.blank()("")

    def params(self) -> list[str]:
        return [f"{t.name}_ptr" for t in self.p.inputs] + [f"{t.name}_ptr" for t in self.p.outputs]

    def wrap(self, consts: list[str], body) -> None:
        """The kernel: either the body inline, or an alignment test choosing between two bodies."""
        s = self.s
        ptrs = self.params()
        hinted = [t for t in self.p.inputs + self.p.outputs if t.hint]
        if not (self.align and hinted):
            s("@triton.jit", f"def {self.kname}({', '.join(ptrs + [c + ': tl.constexpr' for c in consts])}):").indent()
            s("pid = tl.program_id(0)")
            body(False)
            s.dedent()
            return
        s("@triton.jit", f"def {self.kname}_body({', '.join(ptrs + ['pid'] + [c + ': tl.constexpr' for c in consts + ['ALIGNED']])}):").indent()
        body(True)
        s.dedent().blank()("")
        s("@triton.jit", f"def {self.kname}({', '.join(ptrs + [c + ': tl.constexpr' for c in consts])}):").indent()
        s("pid = tl.program_id(0)")
        bits = " | ".join(f"{t.name}_ptr.to(tl.int64)" for t in hinted)
        s("# 16-byte vector loads/stores need 16-byte aligned pointers: test them once, then run the body",
          "# that asserts it (tl.multiple_of), or the plain one",
          f"aligned = (({bits}) % 16) == 0")
        call = ", ".join(ptrs + ["pid"] + consts)
        s("if aligned:").indent()(f"{self.kname}_body({call}, True)").dedent()
        s("else:").indent()(f"{self.kname}_body({call}, False)").dedent()
        s.dedent()


class _PointwiseEmitter(_Emitter):
    """``runtime_elements``: a bucketed kernel's number of elements as a SizeExpr (core/buckets.py);
    the kernel then takes it as the argument ``n_elements``, masks every block, and the outermost
    dim of the flat walk (which holds every varying dim) is never reduced modulo its size."""
    runtime_elements: Any = None

    def params(self) -> list[str]:
        return super().params() + ([] if self.runtime_elements is None else ["n_elements"])

    def program(self, graph_nodes: list[dict[str, Any]]) -> KernelProgram:
        self.graph_nodes = graph_nodes
        p, s = self.p, self.s
        block, warps = int(self.c["BLOCK"]), int(self.c["num_warps"])
        sizes, strides = p.flat_sizes, p.flat_strides
        numel = math.prod(sizes)
        self.wide = cg.needs_int64(sizes, strides, slack=block)
        coords = list(p.cat_coords.items())
        self.coord_lines, offsets = cg.decompose("idx", sizes, list(strides) + [st for _, st in coords], "i")
        self.cat_index = {d: off for (d, _), off in zip(coords, offsets[len(strides):])}
        for t, off in zip(p.outputs + p.inputs, offsets):
            t.flat_off = off
            if t.cls == "cat":  # loaded inside the cat, off by its piece's start: never assumed aligned
                continue
            t.cls = "scalar" if off == "0" else "block"
            t.hint = off == "idx" and (block * _itemsize(t.meta.dtype)) % 16 == 0
        self.masked = numel % block != 0 or self.runtime_elements is not None
        self.module_head()
        count = f"{numel}" if self.runtime_elements is None else f"n_elements (a run-time size, at most {numel})"
        s(f"# {count} elements walked in the first output's memory order over sizes {list(sizes)};",
          "# strides: " + ", ".join(f"{t.name} {list(t.strides)}" for t in p.outputs + p.inputs))
        self.wrap(["BLOCK"], self.body)
        args = tuple(("in", i) for i in range(len(p.inputs))) + tuple(("out", k) for k in range(len(p.outputs)))
        sizes = {}
        if self.runtime_elements is not None:
            args, sizes = cg.runtime_size(args, numel, self.runtime_elements, block, self.wide)
        launch = Launch(self.kname, (-(-numel // block),), args, {"BLOCK": block}, num_warps=warps, num_stages=1,
                        runtime_sizes=sizes)
        return KernelProgram(s.text(), (launch,))

    def pointer(self, t: _Tensor, hinted: bool) -> str:
        ptr = f"{t.name}_ptr + {t.flat_off}"
        if hinted and t.hint:
            self.s(f"p_{t.name} = {ptr}", "if ALIGNED:").indent()(f"p_{t.name} = tl.multiple_of(p_{t.name}, 16)").dedent()
            return f"p_{t.name}"
        return ptr

    def body(self, hinted: bool) -> None:
        p, s = self.p, self.s
        s(f"idx = pid{'.to(tl.int64)' if self.wide else ''} * BLOCK + tl.arange(0, BLOCK)")
        mask = ""
        if self.masked:
            s(f"mask = idx < {math.prod(p.flat_sizes) if self.runtime_elements is None else 'n_elements'}")
            mask = ", mask=mask"
        for line in self.coord_lines:
            s(line)
        for i, t in enumerate(p.inputs):
            conv = "" if _vtype(t.meta.dtype) == t.meta.dtype else ".to(tl.float32)"
            if t.cls == "scalar":
                s(f"x{i} = tl.load({t.name}_ptr){conv}  # broadcast: one element")
            elif t.cls != "cat":
                s(f"x{i} = tl.load({self.pointer(t, hinted)}{mask}){conv}")
        in_pieces = {k for ns in p.pieces.values() for k in ns}
        for n in p.nodes:
            if n.index in in_pieces:
                continue  # computed inside its cat piece
            s(self.describe(n))
            if n.cat is not None:
                self.cat(n)
            else:
                s(f"v{n.index} = {self.pointwise_expr(n)}")
        for t, j in zip(p.outputs, p.out_nodes):
            v = self.store_value(p.nodes[j], t)
            if t.flat_off == "0" and self._scalar(("node", j)) and self.runtime_elements is None:
                s(f"tl.store({self.pointer(t, hinted)}, {v})")  # one element: a scalar to a scalar pointer
                continue
            if self._scalar(("node", j)):
                v = f"tl.broadcast_to({v}, (BLOCK,))"
            s(f"tl.store({self.pointer(t, hinted)}, {v}{mask})")

    def cat(self, n: _Node) -> None:
        """Each piece loaded where the index along the cat dim falls in it, then selected."""
        s, d = self.s, n.cat[0]
        c = f"c{n.index}"
        s(f"{c} = {self.cat_index[d]}  # index along the cat dim ({d})")
        ends = []
        for b, (ref, start, size) in enumerate(n.cat[1]):
            conds = ([f"({c} >= {start})"] if start else []) + ([f"({c} < {start + size})"] if start + size < n.meta.shape[d] else [])
            if self.masked:
                conds.append("mask")
            kw = f", mask={' & '.join(conds)}, other=0" if conds else ""
            s(f"# piece {b}: [{start}, {start + size}) along dim {d}")
            for i, t in enumerate(self.p.inputs):
                if t.piece != (n.index, b):
                    continue
                conv = "" if _vtype(t.meta.dtype) == t.meta.dtype else ".to(tl.float32)"
                if t.flat_off == "0":  # broadcast over the piece: one element
                    s(f"x{i} = tl.load({t.name}_ptr){conv}")
                    continue
                ptr = f"{t.name}_ptr + {t.flat_off}" + (f" - {t.shift}" if t.shift else "")
                s(f"x{i} = tl.load({ptr}{kw}){conv}")
            for k in self.p.pieces.get((n.index, b), []):  # where no element of the piece is, the
                s(self.describe(self.p.nodes[k]))           # loads give 0: those values are dropped
                s(f"v{k} = {self.pointwise_expr(self.p.nodes[k])}")
            ends.append((_convert(self.var(ref), self.vtype(ref), n.vtype), start + size))
        expr = ends[-1][0]
        for v, end in reversed(ends[:-1]):
            expr = f"tl.where({c} < {end}, {v}, {expr})"
        s(f"v{n.index} = {expr}")

    def _scalar(self, r: Ref) -> bool:
        """Whether a value is a scalar (computed only from inputs loaded as one element)."""
        if r[0] == "input":
            return self.p.inputs[r[1]].cls == "scalar"
        if r[0] == "const":
            return True
        return all(self._scalar(x) for x in self.p.nodes[r[1]].operands)
