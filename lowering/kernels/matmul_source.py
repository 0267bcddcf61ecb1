"""The Triton source of the matmul family: the tiled GEMM kernel of a plan (program ids and the
GROUP_M swizzle, operand pointer tiles with their edges, the K loop, alignment hints and the ALIGN
variant's two bodies), its epilogue on the accumulator tile, the kernel of a matmul group (each
program finds its member), and a bucketed kernel's run-time M and grid."""
from __future__ import annotations

import json
from typing import Any, Callable

import torch

from torch_kernelize.core.buckets import product
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.elementwise import EPILOGUE_HELPERS
from torch_kernelize.lowering.kernels.matmul_buckets import Varying
from torch_kernelize.lowering.kernels.matmul_group import Group
from torch_kernelize.lowering.kernels.matmul_plan import Node, Plan, pad3


def _term(expr: str, stride: int | str) -> str:
    return expr if stride == 1 else f"{expr} * {stride}"


def _join(terms: list[str]) -> str:
    terms = [t for t in terms if t]
    return " + ".join(terms) if terms else "0"


class Gen:
    """The kernel of one GEMM (a plan), or of a group: then ``spec`` and ``plan`` are the template
    member's (in its own numbering), and ``program`` adds the selection of each member's pointers
    and M. ``varying``: a bucketed kernel's run-time sizes (``plan`` is the bucket's upper edge)."""

    def __init__(self, spec: KernelSpec, plan: Plan, config: Config, group: Group | None = None,
                 varying: Varying | None = None):
        self.spec, self.p, self.c, self.group, self.varying = spec, plan, config, group, varying
        self.runtime_m = varying is not None and varying.m is not None
        self.bm, self.bn, self.bk = int(config["BLOCK_M"]), int(config["BLOCK_N"]), int(config["BLOCK_K"])
        self.mb, self.nb = -(-plan.M // self.bm), -(-plan.N // self.bn)
        self.src = cg.Source()
        p = plan
        # int64 offsets when any tensor's reach (with the padded tile edges) passes int32
        mbs = [-(-m.M // self.bm) for m in group.members] if group else [self.mb]
        pm, pn, pk = max(mbs) * self.bm, self.nb * self.bn, -(-p.K // self.bk) * self.bk
        reach = [cg.max_offset((p.B, pm, pk), p.a_strides), cg.max_offset((p.B, pk, pn), p.b_strides)]
        reach += [cg.max_offset((p.B, pm, pn), st) for st in p.tile_inputs.values()]
        reach += [cg.max_offset((p.B, pm, pn), pad3(m.stride)) for m in spec.outputs]
        self.wide = max(reach) > cg.INT32_MAX
        # a group's programs: member g owns [starts[g], starts[g + 1])
        self.starts = [sum(mbs[:g]) * self.nb for g in range(len(mbs) + 1)]

    def program(self) -> KernelProgram:
        if self.group:
            return self.group_program()
        p, s = self.p, self.src
        s(cg.HEADER)
        self.header()
        for h in p.helpers:
            s.blank()(EPILOGUE_HELPERS[h].strip("\n"))
        s.blank()("")
        inputs = sorted({p.a, p.b} | set(p.tile_inputs))
        ptrs = [f"in{i}_ptr" for i in inputs] + [f"out{o}_ptr" for o in range(len(p.outputs))]
        ptrs += ["M"] if self.runtime_m else []   # (not a pointer: the run-time size after them)
        consts = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"]
        kname = ("region_" if p.region else "") + p.op + "_kernel"
        pids = ["pid"] + (["pid_b"] if p.B > 1 else [])
        hinted = self.hinted_pointers() if self.c.get("ALIGN", False) else []
        if hinted:
            # one body, compiled twice: with alignment hints when every hinted pointer is 16-byte
            # aligned (vector loads, cp.async pipelining), plain otherwise; the kernel picks at run time
            s("@triton.jit",
              f"def {kname}_body({', '.join(ptrs + pids + [c + ': tl.constexpr' for c in consts + ['ALIGNED']])}):").indent()
            self.body(hints=True)
            s.dedent().blank()("")
        s("@triton.jit", f"def {kname}({', '.join(ptrs + [c + ': tl.constexpr' for c in consts])}):").indent()
        s("pid = tl.program_id(0)")
        if p.B > 1:
            s(f"pid_b = tl.program_id(1){'.to(tl.int64)' if self.wide else ''}")
        if hinted:
            bits = " | ".join(f"{x}.to(tl.int64)" for x in hinted)
            call = ", ".join(ptrs + pids + consts)
            s("# 16-byte vector loads/stores and cp.async need 16-byte aligned pointers: test them once",
              f"aligned = (({bits}) % 16) == 0",
              "if aligned:").indent()(f"{kname}_body({call}, True)").dedent()
            s("else:").indent()(f"{kname}_body({call}, False)").dedent()
        else:
            self.body(hints=False)
        s.dedent()
        grid = (self.mb * self.nb,) + ((p.B,) if p.B > 1 else ())
        args = tuple(("in", i) for i in inputs) + tuple(("out", o) for o in range(len(p.outputs)))
        args += (("i32", p.M),) if self.runtime_m else ()
        launch = Launch(kname, grid, args,
                        {"BLOCK_M": self.bm, "BLOCK_N": self.bn, "BLOCK_K": self.bk, "GROUP_M": int(self.c["GROUP_M"])},
                        num_warps=int(self.c["num_warps"]), num_stages=int(self.c["num_stages"]),
                        runtime_sizes=self.runtime_sizes(len(args)))
        return KernelProgram(s.text(), (launch,))

    def runtime_sizes(self, n_args: int) -> dict[str, Any]:
        """A bucketed launch's grid and M argument as functions of the bucket's variables."""
        v, p = self.varying, self.p
        if v is None:
            return {}
        members = len(self.group.members) if self.group else 1
        grid: list[Any] = [product([["cdiv", f"v{v.m}", self.bm], self.nb * members]) if self.runtime_m
                           else self.mb * self.nb]
        if p.B > 1:
            grid.append(f"v{v.batch}" if v.batch is not None else p.B)
        return {"grid": grid, **({"args": {str(n_args - 1): f"v{v.m}"}} if self.runtime_m else {})}

    def m_factor(self, tile: str, stride: int) -> int | None:
        """Where pointer tile ``tile``'s batch stride ``stride`` is a multiple of the run-time M
        (a contiguous [B, M, *] tensor of a bucketed bmm): that multiple."""
        return self.varying.m_scaled.get(tile) if self.runtime_m and stride else None

    def batch_stride(self, tile: str, stride: int) -> int | str:
        """The batch stride of pointer tile ``tile``: a literal, or an expression of the run-time M."""
        factor = self.m_factor(tile, stride)
        return stride if factor is None else "M" if factor == 1 else f"M * {factor}"

    def group_program(self) -> KernelProgram:
        """One launch for every member: program ``pid`` finds its member (a chain of comparisons
        with the members' first programs), takes that member's pointers and M under the template's
        names, and runs the GEMM body on its tile ``pid - start``. Bucketed, M is the kernel's
        argument (every member's) and the members' first programs are multiples of its tile count."""
        p, s, g = self.p, self.src, self.group
        s(cg.HEADER)
        ms = "M, a run-time size (one for every member)" if self.runtime_m else f"M = {[m.M for m in g.members]}"
        s(f"# matmul group: {len(g.members)} GEMMs of one structure, {ms}")
        self.header()
        for h in p.helpers:
            s.blank()(EPILOGUE_HELPERS[h].strip("\n"))
        s.blank()("")
        n_in, n_out = len(g.spec.inputs), len(g.spec.outputs)
        params = [f"g_in{i}_ptr" for i in range(n_in)] + [f"g_out{o}_ptr" for o in range(n_out)]
        params += ["M"] if self.runtime_m else []
        consts = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"]
        s("@triton.jit", f"def region_group_{p.op}_kernel({', '.join(params + [c + ': tl.constexpr' for c in consts])}):").indent()
        s(f"pid = tl.program_id(0){'.to(tl.int64)' if self.wide else ''}")
        local = sorted({p.a, p.b} | set(p.tile_inputs))
        if self.runtime_m:
            # every member has the run-time M rows: member j owns programs [j * tiles, (j + 1) * tiles)
            s(f"mb = (M + {self.bm - 1}) // BLOCK_M", f"tiles = mb * {self.nb}")
        # a fixed-size group's M is a run-time value too (``pid * 0 + m``: a tensor, which the
        # if-blocks may rebind; a literal would be a constexpr)
        for j, (member, ins, outs) in enumerate(zip(g.members, g.in_maps, g.out_maps)):
            # (``pid * 0 + ``: every branch binds ``start`` with pid's type, int64 where it is wide)
            start = f"pid * 0 + {j} * tiles" if self.runtime_m else str(self.starts[j])
            assign = [f"in{i}_ptr = g_in{ins[i]}_ptr" for i in local] + \
                     [f"out{o}_ptr = g_out{outs[o]}_ptr" for o in range(len(outs))] + \
                     ([] if self.runtime_m else [f"M = pid * 0 + {member.M}"]) + [f"start = {start}"]
            if j == 0:
                s(f"# member 0: programs [0, {'tiles' if self.runtime_m else self.starts[1]})", *assign)
            else:
                s(f"if pid >= {start}:  # member {j}").indent()(*assign).dedent()
        if not self.runtime_m:
            s(f"mb = (M + {self.bm - 1}) // BLOCK_M")
        s("pid = pid - start")
        self.body(hints=False)
        s.dedent()
        args = tuple(("in", i) for i in range(n_in)) + tuple(("out", o) for o in range(n_out))
        args += (("i32", p.M),) if self.runtime_m else ()
        launch = Launch(f"region_group_{p.op}_kernel", (self.starts[-1],), args,
                        {"BLOCK_M": self.bm, "BLOCK_N": self.bn, "BLOCK_K": self.bk, "GROUP_M": int(self.c["GROUP_M"])},
                        num_warps=int(self.c["num_warps"]), num_stages=int(self.c["num_stages"]),
                        runtime_sizes=self.runtime_sizes(len(args)))
        return KernelProgram(s.text(), (launch,))

    # alignment hints ---------------------------------------------------------------------------
    @staticmethod
    def _hint(sm: int, sn: int, sb: int, elt: int, batched: bool) -> list[int] | None:
        """tl.multiple_of values for a [rows, cols] pointer tile whose base is 16-byte aligned: the
        first element of every contiguous run is then 16-byte aligned too (strides in bytes % 16)."""
        if batched and (sb * elt) % 16:
            return None
        if sn == 1 and (sm * elt) % 16 == 0:
            return [1, 16]
        if sm == 1 and (sn * elt) % 16 == 0:
            return [16, 1]
        return None

    def hints(self) -> dict[str, list[int] | None]:
        """Hint per pointer tile: "a", "b", "in<i>" (epilogue inputs), "out<o>"."""
        p = self.p
        elt = lambda dt: 1 if dt == "bool" else torch.finfo(getattr(torch, dt)).bits // 8
        (asb, asm, ask), (bsb, bsk, bsn) = p.a_strides, p.b_strides
        e = elt(p.dtype)
        # a batch stride that is a multiple of a run-time M is a multiple of 16 bytes for every M
        # exactly when its factor is: the hints test that factor
        sb_ = lambda tile, sb: self.m_factor(tile, sb) or sb
        out = {"a": self._hint(asm, ask, sb_("a", asb), e, p.B > 1), "b": self._hint(bsk, bsn, bsb, e, p.B > 1)}
        for i, (sb, sm, sn) in p.tile_inputs.items():
            out[f"in{i}"] = None if (sm, sn) == (0, 0) else self._hint(sm, sn, sb_(f"in{i}", sb),
                                                                       elt(self.spec.inputs[i].dtype), p.B > 1)
        for o, m in enumerate(self.spec.outputs):
            sb, sm, sn = pad3(m.stride)
            out[f"out{o}"] = self._hint(sm, sn, sb_(f"out{o}", sb), elt(m.dtype), p.B > 1)
        return out

    def hinted_pointers(self) -> list[str]:
        h = self.hints()
        names = {"a": f"in{self.p.a}_ptr", "b": f"in{self.p.b}_ptr"}
        ptrs = []
        for k, v in h.items():
            if v is not None:
                name = names.get(k, f"{k}_ptr")
                if name not in ptrs:
                    ptrs.append(name)
        return ptrs

    def pointer(self, var: str, expr: str, key: str) -> str:
        """Emit ``var = expr`` (a pointer tile), with its alignment hint in the ALIGNED body."""
        self.src(f"{var} = {expr}")
        hint = self.hint_of.get(key) if self.use_hints else None
        if hint is not None:
            self.src("if ALIGNED:").indent()(f"{var} = tl.multiple_of({var}, {hint})").dedent()
        return var

    def header(self) -> None:
        s, p, spec = self.src, self.p, self.spec
        if p.region:
            from torch_kernelize.core.region_graph import describe_region
            s(f"# {describe_region(spec)}")
            for n in json.loads(spec.graph)["nodes"]:
                s(f"#   {n['op']} args={json.dumps(n['args'])} kwargs={json.dumps(n['kwargs'])} -> {n['meta']['dtype']}")
            s(f"# outputs: nodes {p.outputs}")
            for i, m in enumerate(spec.inputs):
                s(f"# in{i}: {m.dtype} shape {list(m.shape)} stride {list(m.stride)}")
            for i, m in enumerate(spec.outputs):
                s(f"# out{i}: {m.dtype} shape {list(m.shape)} stride {list(m.stride)}")
        else:
            s(cg.describe_spec(spec))

    # the kernel body ---------------------------------------------------------------------------
    def body(self, hints: bool) -> None:
        p, s = self.p, self.src
        self.use_hints, self.hint_of = hints, self.hints()
        batch = f"batch {p.B} x " if p.op == "bmm" else ""
        # M is a run-time value in a group and in a bucketed kernel (whose upper edge is p.M: where
        # that fits one row block, every M of the bucket does)
        if self.group:
            M, mb = "M", "mb"
        elif self.runtime_m:
            M, mb = "M", 1 if self.mb == 1 else "mb"
        else:
            M, mb = p.M, self.mb
        asb, asm, ask = p.a_strides
        s(f"# C[{batch}M={M}, N={p.N}] = A[{M}, K={p.K}] @ B[{p.K}, {p.N}], fp32 accumulation; "
          f"{mb} x {self.nb} tiles")
        s(f"# strides (batch, row, col): A [{self.batch_stride('a', asb)}, {asm}, {ask}], B {list(p.b_strides)}")
        if self.runtime_m:
            s(f"# M is a run-time size (at most {p.M}, the bucket's upper edge): rows are masked by it")
            if mb != 1 and self.nb != 1 and not self.group:
                s(f"mb = (M + {self.bm - 1}) // BLOCK_M")
        self.tile_ids(mb)
        cast = ".to(tl.int64)" if self.wide else ""
        s(f"rm = {'' if mb == 1 else 'pid_m * BLOCK_M + '}tl.arange(0, BLOCK_M){cast}",
          f"rn = {'' if self.nb == 1 else 'pid_n * BLOCK_N + '}tl.arange(0, BLOCK_N){cast}",
          "rk = tl.arange(0, BLOCK_K)")
        ms = [m.M for m in self.group.members] if self.group else [p.M]
        self.m_masked, self.n_masked = self.runtime_m or any(m % self.bm for m in ms), p.N % self.bn != 0
        if self.m_masked:
            s(f"m_mask = rm < {M}")
        if self.n_masked:
            s(f"n_mask = rn < {p.N}")
        a_mask, b_mask = self.operand_tiles(M)
        self.k_loop(a_mask, b_mask)
        self.epilogue()

    def tile_ids(self, mb: int | str) -> None:
        """Emit the program's tile (pid_m, pid_n) from ``pid``; ``mb``: the row blocks."""
        s = self.src
        if mb == 1:
            s("pid_m = 0", "pid_n = pid")
        elif self.nb == 1:
            s("pid_m = pid", "pid_n = 0")
        else:
            s("# grouped order: GROUP_M row blocks walk the column blocks together (A and B stay in L2)",
              f"width = GROUP_M * {self.nb}",
              "first_m = (pid // width) * GROUP_M",
              f"rows = tl.minimum({mb} - first_m, GROUP_M)",
              "pid_m = first_m + (pid % width) % rows",
              "pid_n = (pid % width) // rows")

    def operand_tiles(self, M: int | str) -> tuple[str | None, str | None]:
        """Emit the A and B pointer tiles; their masks along M and N (None where unmasked)."""
        p, s = self.p, self.src
        (asb, asm, ask), (bsb, bsk, bsn) = p.a_strides, p.b_strides
        # operand rows/cols at the edges: contiguous dims are masked, others wrapped into range

        def edge(index: str, masked: bool, stride: int, mask: str, wrapped: str, n: int, what: tuple[str, str]):
            """An operand's indices along a masked edge: masked where contiguous, else wrapped."""
            if not masked:
                return index, None
            if stride == 1:
                return index, mask
            s(f"{wrapped} = {index} % {n}  # {what[0]} past {what[1]} re-read valid {what[0]}; they are never stored")
            return wrapped, None
        a_rows, a_mask = edge("rm", self.m_masked, asm, "m_mask[:, None]", "ram", M, ("rows", "M"))
        b_cols, b_mask = edge("rn", self.n_masked, bsn, "n_mask[None, :]", "rbn", p.N, ("columns", "N"))
        a_b = _term("pid_b", self.batch_stride("a", asb)) if p.B > 1 and asb else ""
        b_b = _term("pid_b", bsb) if p.B > 1 and bsb else ""
        # (a zero stride keeps its "* 0": the pointer tile must keep both dims for the dot)
        self.pointer("a_ptrs", f"in{p.a}_ptr + {_join([a_b, _term(f'{a_rows}[:, None]', asm), _term('rk[None, :]', ask)])}", "a")
        self.pointer("b_ptrs", f"in{p.b}_ptr + {_join([b_b, _term('rk[:, None]', bsk), _term(f'{b_cols}[None, :]', bsn)])}", "b")
        return a_mask, b_mask

    def k_loop(self, a_mask: str | None, b_mask: str | None) -> None:
        """Emit the accumulator and the walk of K: the full BLOCK_K steps (literal bounds), then the
        masked tail."""
        p, s = self.p, self.src
        ask, bsk = p.a_strides[2], p.b_strides[1]
        s("acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
        full, rem = divmod(p.K, self.bk)
        if full:
            s(f"for k in range(0, {full}):  # K = {p.K}: {full} full step(s) of BLOCK_K").indent()
            self.step(a_mask, b_mask)
            s(f"a_ptrs += BLOCK_K * {ask}", f"b_ptrs += BLOCK_K * {bsk}")
            s.dedent()
        if rem:
            s(f"# the last {rem} of K")
            s(f"k_mask = rk < {rem}")
            am = "k_mask[None, :]" if a_mask is None else f"{a_mask} & k_mask[None, :]"
            bmask = "k_mask[:, None]" if b_mask is None else f"k_mask[:, None] & {b_mask}"
            self.step(am, bmask)

    def step(self, a_mask: str | None, b_mask: str | None) -> None:
        s, p = self.src, self.p
        s(f"a = tl.load(a_ptrs{f', mask={a_mask}, other=0.0' if a_mask else ''})",
          f"b = tl.load(b_ptrs{f', mask={b_mask}, other=0.0' if b_mask else ''})")
        if p.dtype == "float32":
            s('acc = tl.dot(a, b, acc, input_precision="ieee")')
        elif self.c["DOT_UPCAST"]:
            s('acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")')
        else:
            s("acc = tl.dot(a, b, acc)")

    # epilogue ----------------------------------------------------------------------------------
    def tile_offset(self, strides: tuple[int, int, int], tile: str) -> tuple[str, str | None]:
        """Offset expression of a (batch, m, n)-strided tensor over the tile, and its mask."""
        sb, sm, sn = strides
        terms, masks = [], []
        if self.p.B > 1 and sb:
            terms.append(_term("pid_b", self.batch_stride(tile, sb)))
        if sm:
            terms.append(_term("rm[:, None]", sm))
            if self.m_masked:
                masks.append("m_mask[:, None]")
        if sn:
            terms.append(_term("rn[None, :]", sn))
            if self.n_masked:
                masks.append("n_mask[None, :]")
        return _join(terms), " & ".join(masks) or None

    def epilogue(self) -> None:
        s, p = self.src, self.p
        nodes = {n.index: n for n in p.nodes}
        users: dict[int, int] = {}
        for n in p.nodes:
            for kind, v in n.operands:
                if kind == "node":
                    users[v] = users.get(v, 0) + 1
        self.loaded: dict[int, str] = {}
        s("# epilogue on the fp32 accumulator tile")
        # node 0
        v0 = "acc"
        if p.op == "addmm":
            alpha = "" if p.alpha == 1 else f" * {cg.float_literal(p.alpha)}"
            if p.bias is not None:
                bias = self.load_input(p.bias)
                beta = "" if p.beta == 1 else f" * {cg.float_literal(p.beta)}"
                s(f"acc = acc{alpha} + {bias}{beta}  # addmm: beta * self + alpha * (mat1 @ mat2)")
            elif alpha:
                s(f"acc = acc{alpha}  # addmm with beta == 0: self is ignored")
        if nodes and p.dtype in cg.HALF:
            # The graph's matmul node produces fp16/bf16: its epilogue reads rounded values, as eager
            # and a vendor GEMM followed by separate kernels do. (Keeping the fp32 accumulator would be
            # closer to the float64 reference, but can flip discrete decisions downstream, e.g. an
            # MoE router's top-k on near-tied logits.)
            s(f"acc = acc.to({cg.HALF[p.dtype]}).to(tl.float32)  # the matmul's {p.dtype} output")
        self.values = {0: v0}
        for j in sorted(nodes):
            self.emit_node(nodes[j], users)
        s("# outputs")
        for o, j in enumerate(p.outputs):
            m = self.spec.outputs[o]
            off, mask = self.tile_offset(pad3(m.stride), f"out{o}")
            value = self.values[j]
            if m.dtype in cg.HALF:
                value = f"{value}.to({cg.HALF[m.dtype]})"
            ptr = self.pointer(f"o{o}_ptrs", f"out{o}_ptr + {off}", f"out{o}")
            s(f"tl.store({ptr}, {value}{f', mask={mask}' if mask else ''})")

    def load_input(self, i: int) -> str:
        if i in self.loaded:
            return self.loaded[i]
        m = self.spec.inputs[i]
        off, mask = self.tile_offset(self.p.tile_inputs[i], f"in{i}")
        var = f"x{i}"
        kw = f", mask={mask}, other={'0' if m.dtype == 'bool' else '0.0'}" if mask else ""
        conv = ".to(tl.float32)" if m.dtype in cg.HALF else ""
        s = self.src
        ptr = f"in{i}_ptr + {off}"
        if self.use_hints and self.hint_of.get(f"in{i}") is not None:
            ptr = self.pointer(f"x{i}_ptrs", ptr, f"in{i}")
        s(f"{var} = tl.load({ptr}{kw}){conv}  # in{i} {m.dtype} {list(m.shape)}")
        self.loaded[i] = var
        return var

    def operand(self, kind: str, v: Any, want: str) -> str:
        """An operand as an expression: want "f32" (arithmetic) or "raw" (bool stays bool)."""
        if kind == "scalar":
            if want == "raw" and isinstance(v, bool):
                return str(int(v))
            return cg.float_literal(float(v))
        if kind == "node":
            expr, dt = self.values[v], (self.p.dtype if v == 0 else next(n.dtype for n in self.p.nodes if n.index == v))
        else:
            expr, dt = self.load_input(v), self.spec.inputs[v].dtype
        if dt == "bool" and want == "f32":
            return f"{expr}.to(tl.float32)"
        return expr

    def emit_node(self, n: Node, users: dict[int, int]) -> None:
        var = f"v{n.index}"
        self.src(*node_lines(n, var, self.operand, users))
        self.values[n.index] = var


def node_lines(n: Node, var: str, operand: Callable[[str, Any, str], str], users: dict[int, int]) -> list[str]:
    """The lines that compute epilogue node ``n`` into ``var``, its operands given by ``operand(kind,
    v, want)`` (want "f32": arithmetic, "raw": bool stays bool); an explicit cast to fp16/bf16 that
    later nodes read rounds there (they read its fp16/bf16 values, as eager's do)."""
    kind = n.pw.kind
    if kind in ("float", "arith", "copy"):
        expr = n.pw.body([operand(k, v, "f32") for k, v in n.operands], n.args, "float32")
    elif kind == "compare":
        ops = []
        for k, v in n.operands:
            if k == "scalar" and n.compare_dtype in cg.HALF:
                # a number compared with a half tensor is converted to the tensor's type first
                v = float(torch.tensor(float(v), dtype=getattr(torch, n.compare_dtype)))
            ops.append(operand(k, v, "f32"))
        expr = n.pw.body(ops, n.args, "float32")
    elif kind == "logical":
        expr = n.pw.body([operand(k, v, "raw") for k, v in n.operands], n.args, "bool")
    else:  # select
        cond = operand(*n.operands[0], "raw")
        expr = n.pw.body([cond] + [operand(k, v, "f32") for k, v in n.operands[1:]], n.args, "float32")
    lines = [f"{var} = {expr}  # {n.op} -> {n.dtype}"]
    if kind == "copy" and n.dtype in cg.HALF and users.get(n.index):
        lines.append(f"{var} = {var}.to({cg.HALF[n.dtype]}).to(tl.float32)  # the cast rounds: later nodes read {n.dtype} values")
    return lines
