"""The matmul family on the Triton interpreter: mm / addmm / bmm in fp32, fp16, bf16 with any operand
strides (transposed, sliced, expanded), addmm beta/alpha and bias broadcasts, and fused matmul
regions built from real graphs (make_fx + core decompositions + find_regions); validated against
the float64 reference and compared with eager."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from kernel_testing import BenchRows, assert_valid, compare_eager, compile_sm90, run_validation, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.matmul import FAMILY
from torch_kernelize.compiling.regions import find_regions, region_spec
from torch_kernelize.core.targets import get_target
from torch_kernelize.core.spec import KernelSpec, TensorMeta

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf/NaN edge trials

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
FLOATS = [F32, F16, BF16]


def interp_config(spec: KernelSpec, **changes) -> Config:
    """The seed the interpreter can validate: an fp32-upcast dot for bf16 (its bf16 dot is wrong)."""
    seeds = FAMILY.seed_configs(spec)
    bf16 = any(m.dtype == "bfloat16" for m in spec.inputs)
    c = next(c for c in seeds if c["DOT_UPCAST"]) if bf16 else seeds[0]
    return c.replace(**changes) if changes else c


def check(spec: KernelSpec, tmp_path, config: Config | None = None, **kw):
    assert FAMILY.supports(spec) is None, FAMILY.supports(spec)
    return assert_valid(FAMILY, spec, tmp_path, config or interp_config(spec), **kw)


def rand(*shape, dtype=F32):
    return torch.randn(shape).to(dtype)


# the 2-d operands [M, K] @ [K, N] in several memory layouts
LAYOUTS = {
    "contiguous": lambda a, b: (a, b),
    "linear_weight": lambda a, b: (a, b.t().contiguous().t()),       # nn.Linear: weight [N, K] seen as [K, N]
    "transposed_a": lambda a, b: (a.t().contiguous().t(), b),
    "both_transposed": lambda a, b: (a.t().contiguous().t(), b.t().contiguous().t()),
    "sliced": lambda a, b: (torch.cat([a, a], 1)[:, ::2], torch.cat([b, b], 0)[1::2]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_mm_dtypes_layouts(dtype, layout, tmp_path):
    a, b = LAYOUTS[layout](rand(40, 48, dtype=dtype), rand(48, 24, dtype=dtype))
    check(spec_of(aten.mm.default, (a, b)), tmp_path)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_mm_many_tiles_k_tail_and_swizzle(dtype, tmp_path):
    """3 x 3 tiles with GROUP_M swizzling, masked/wrapped M and N edges, 2 full K steps and a tail."""
    a, b = rand(72, 80, dtype=dtype), rand(80, 40, dtype=dtype).t().contiguous().t()
    spec = spec_of(aten.mm.default, (a, b))
    config = Config.of(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=2,
                       DOT_UPCAST=dtype == BF16)
    program = check(spec, tmp_path, config, seeds=(0,))
    assert "k_mask = rk < 16" in program.source and "for k in range(0, 2)" in program.source
    assert "first_m" in program.source and program.launches[0].grid == (9,)


def test_mm_tiny_and_column_major_output(tmp_path):
    a, b = rand(3, 5), rand(5, 2)
    check(spec_of(aten.mm.default, (a, b)), tmp_path)
    spec = spec_of(aten.mm.default, (rand(20, 17), rand(17, 12)))
    out = dataclasses.replace(spec.outputs[0], stride=(1, 20))   # a column-major output layout
    check(dataclasses.replace(spec, outputs=(out,)), tmp_path, eager=False)


def test_unaligned_operands_take_the_plain_body(tmp_path):
    """ALIGN tests the pointers at run time: views starting at an odd element run the unhinted body."""
    a = torch.randn(40 * 48 + 1, dtype=F16)[1:].view(40, 48)
    b = torch.randn(24 * 48 + 3, dtype=F16)[3:].view(24, 48).t()
    spec = spec_of(aten.mm.default, (a, b))
    config = interp_config(spec, ALIGN=True)
    program = check(spec, tmp_path, config)
    assert "if aligned:" in program.source and "tl.multiple_of(a_ptrs, [1, 16])" in program.source
    compare_eager(FAMILY, spec, program, tmp_path, inputs=[a, b])
    plain = FAMILY.generate(spec, interp_config(spec))
    assert not interp_config(spec)["ALIGN"]
    assert "multiple_of" not in plain.source
    compare_eager(FAMILY, spec, plain, tmp_path, inputs=[a, b])


@pytest.mark.parametrize("bias,beta,alpha", [
    ("n", 1, 1), ("mn", 1, 1), ("1n", 1, 1), ("n", 0.5, 2.0), ("mn", 0, 1.5), ("m1", -1, 1), ("scalar", 2, 1),
], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_addmm(bias, beta, alpha, dtype, tmp_path):
    M, K, N = 24, 40, 36
    x, w = rand(M, K, dtype=dtype), rand(N, K, dtype=dtype).t()   # Linear: weight as a permuted view
    b = {"n": lambda: rand(N, dtype=dtype), "mn": lambda: rand(M, N, dtype=dtype), "1n": lambda: rand(1, N, dtype=dtype),
         "m1": lambda: rand(M, 1, dtype=dtype), "scalar": lambda: rand(dtype=dtype)}[bias]()
    spec = spec_of(aten.addmm.default, (b, x, w), {"beta": beta, "alpha": alpha})
    program = check(spec, tmp_path)
    if beta == 0:  # the bias is ignored (NaN in it must not propagate): it is not even read
        assert "in0_ptr" not in program.kernel_arg_names(program.launches[0].kernel)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded_b", "sliced"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_bmm(dtype, layout, tmp_path):
    a, b = rand(3, 24, 40, dtype=dtype), rand(3, 40, 20, dtype=dtype)
    a, b = {"contiguous": (a, b), "transposed": (a.transpose(1, 2).contiguous().transpose(1, 2), b.transpose(1, 2).contiguous().transpose(1, 2)),
            "expanded_b": (a, b[:1].expand(3, 40, 20)), "sliced": (a[:, :, ::2], b[:, ::2])}[layout]
    spec = spec_of(aten.bmm.default, (a, b))
    program = check(spec, tmp_path)
    assert program.launches[0].grid[1:] == (3,)


# --- fused matmul regions from real graphs -------------------------------------------------------

def matmul_regions(fn, *args) -> list[KernelSpec]:
    gm = make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*args)
    return [region_spec(r, {}) for r in find_regions(gm, get_target("interpreter")) if r.kind == "matmul"]


def region_ops(spec: KernelSpec) -> list[str]:
    return [n["op"].split(".")[1] for n in json.loads(spec.graph)["nodes"]]


REGIONS = {
    # name: (function, argument shapes, ops the region must hold)
    "silu_bias_residual": (lambda x, w, b, r: F.silu(x @ w.t() + b) + r, [(40, 32), (24, 32), (24,), (40, 24)],
                           ["mm", "add", "sigmoid", "mul", "add"]),
    "linear_gelu": (lambda x, w, b: F.gelu(F.linear(x, w, b)), [(40, 32), (24, 32), (24,)], ["addmm", "gelu"]),
    "linear_gelu_tanh": (lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), [(20, 48), (40, 48), (40,)],
                         ["addmm", "gelu"]),
    "leaky_where": (lambda x, w: (lambda y: torch.where(y > 0, y, y * 0.1))(x @ w.t()), [(40, 32), (24, 32)],
                    ["mm", "gt", "mul", "where"]),
    "bmm_scale_bias": (lambda a, b, c: torch.bmm(a, b) * 0.5 + c, [(3, 16, 24), (3, 24, 20), (20,)], ["bmm", "mul", "add"]),
    "casts": (lambda x, w: (x @ w.t()).float().sigmoid().to(x.dtype), [(40, 32), (24, 32)], ["mm", "sigmoid"]),
    "scalar_tensor": (lambda x, w, s: (x @ w.t()) * s - 1.5, [(40, 32), (24, 32), ()], ["mm", "mul", "sub"]),
}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(REGIONS))
def test_regions_from_graphs(name, dtype, tmp_path):
    fn, shapes, ops = REGIONS[name]
    specs = matmul_regions(fn, *[rand(*s, dtype=dtype) for s in shapes])
    assert len(specs) == 1, specs
    spec = specs[0]
    assert all(op in region_ops(spec) for op in ops), region_ops(spec)
    assert family_for(spec) is FAMILY
    check(spec, tmp_path)


def test_region_with_intermediate_outputs(tmp_path):
    """The region returns both the pre-activation h (node 1) and silu(h): each output is stored."""
    def fn(x, w, b):
        h = x @ w.t() + b
        return h, F.silu(h)
    spec, = matmul_regions(fn, rand(40, 32, dtype=F16), rand(24, 32, dtype=F16), rand(24, dtype=F16))
    assert len(spec.outputs) == 2 and json.loads(spec.graph)["outputs"][0] == 1
    program = check(spec, tmp_path)
    assert program.source.count("tl.store(") == 2


def test_region_transposed_residual_and_fp16_rounding(tmp_path):
    """A residual with transposed strides; the cast to fp16 inside the chain rounds (as the graph says)."""
    def fn(x, w, r):
        return (x @ w.t()).float().relu().half() + r.t()
    spec, = matmul_regions(fn, rand(40, 32, dtype=F16), rand(24, 32, dtype=F16), rand(24, 40, dtype=F16))
    program = check(spec, tmp_path)
    assert ".to(tl.float16).to(tl.float32)" in program.source
    assert spec.inputs[2].stride == (1, 40) and "rm[:, None] + rn[None, :] * 40" in program.source


# --- configs --------------------------------------------------------------------------------------

SEED_SPECS = {
    "mm_f16": lambda: spec_of(aten.mm.default, (rand(40, 48, dtype=F16), rand(24, 48, dtype=F16).t())),
    "addmm_f32": lambda: spec_of(aten.addmm.default, (rand(36), rand(24, 40), rand(36, 40).t())),
    "bmm_bf16": lambda: spec_of(aten.bmm.default, (rand(2, 24, 40, dtype=BF16), rand(2, 40, 36, dtype=BF16))),
    "region_bf16": lambda: matmul_regions(REGIONS["silu_bias_residual"][0],
                                          *[rand(*s, dtype=BF16) for s in REGIONS["silu_bias_residual"][1]])[0],
}


@pytest.mark.parametrize("name", list(SEED_SPECS))
def test_every_seed_config_validates(name, tmp_path):
    spec = SEED_SPECS[name]()
    configs = FAMILY.seed_configs(spec)
    assert 2 <= len(configs) <= 9
    bf16 = "bf16" in name
    if bf16 or "f16" in name:
        assert {c["DOT_UPCAST"] for c in configs} == {True, False}  # both variants are offered
    for config in configs:
        assert FAMILY._valid(FAMILY.plan(spec), config)
        program = FAMILY.generate(spec, config)
        if bf16 and not config["DOT_UPCAST"]:
            # the interpreter's bf16 dot is wrong: this variant must FAIL here (it is the GPU's variant)
            assert not run_validation(FAMILY, spec, program, tmp_path, seeds=(0,), kinds=()).ok
            continue
        assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,), eager=False, kinds=("special",))
    for n in FAMILY.neighbours(spec, configs[0]):
        assert n.key != configs[0].key
        FAMILY.generate(spec, n)


def test_seed_configs_big_shape():
    """On a real shape the classic Hopper tiles survive unclipped, within shared memory and registers."""
    a, b, o = TensorMeta((8192, 1024), (1024, 1), "float16"), TensorMeta((1024, 4096), (1, 1024), "float16"), \
        TensorMeta((8192, 4096), (4096, 1), "float16")
    spec = KernelSpec("aten.mm.default", [{"tensor": 0}, {"tensor": 1}], {}, (a, b), (o,))
    tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"]) for c in FAMILY.seed_configs(spec)}
    assert {(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 32, 4, 4)} <= tiles
    neigh = FAMILY.neighbours(spec, FAMILY.seed_configs(spec)[0])
    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "DOT_UPCAST"):
        assert any(n[k] != FAMILY.seed_configs(spec)[0][k] for n in neigh), k
    big = Config.of(BLOCK_M=256, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, DOT_UPCAST=False)
    assert not FAMILY._valid(FAMILY.plan(spec), big)   # 256 accumulator registers per thread



def test_seed_configs_fill_the_gpu():
    """An MoE expert's GEMM ([~1000, 1024] x [1024, 512]) makes 32 tiles of 128x128 for 132 SMs: a
    seed with tiles small enough for every SM comes second, inside a small search budget; a big
    GEMM gets none."""
    def mm(m, k, n):
        a, b, o = TensorMeta((m, k), (k, 1), "float16"), TensorMeta((k, n), (1, k), "float16"), \
            TensorMeta((m, n), (n, 1), "float16")
        return KernelSpec("aten.mm.default", [{"tensor": 0}, {"tensor": 1}], {}, (a, b), (o,))
    tile = lambda c: (c["BLOCK_M"], c["BLOCK_N"])
    assert tile(FAMILY.seed_configs(mm(1013, 1024, 512))[1]) == (64, 64)     # 16 x 8 = 128 tiles
    assert tile(FAMILY.seed_configs(mm(1013, 512, 1024))[1]) == (64, 64)     # 128x64 would give 128
    assert tile(FAMILY.seed_configs(mm(1408, 1024, 768))[1]) == (128, 64)    # 11 x 12 = 132 tiles
    assert (64, 64) not in {tile(c) for c in FAMILY.seed_configs(mm(8192, 1024, 4096))}

# --- validation catches broken programs -----------------------------------------------------------

def _broken(program, old: str, new: str):
    assert old in program.source, program.source
    return dataclasses.replace(program, source=program.source.replace(old, new, 1))


@pytest.mark.parametrize("what", ["k_tail", "store_mask", "bias_stride", "epilogue_constant", "alpha"])
def test_broken_programs_fail_validation(what, tmp_path):
    if what == "k_tail":        # the last K columns dropped
        spec = spec_of(aten.mm.default, (rand(40, 48), rand(48, 24)))
        bad = _broken(FAMILY.generate(spec, interp_config(spec, BLOCK_K=32)), "k_mask = rk < 16", "k_mask = rk < 15")
    elif what == "store_mask":  # the last row is never written: it stays poisoned (NaN)
        spec = spec_of(aten.mm.default, (rand(40, 48, dtype=F16), rand(48, 24, dtype=F16)))
        bad = _broken(FAMILY.generate(spec, interp_config(spec)), "m_mask = rm < 40", "m_mask = rm < 39")
    elif what == "bias_stride":  # an [M, N] bias read as [N]
        spec = spec_of(aten.addmm.default, (rand(24, 36), rand(24, 40), rand(40, 36)))
        bad = _broken(FAMILY.generate(spec, interp_config(spec)), "rm[:, None] * 36 + rn[None, :]", "rn[None, :]")
    elif what == "epilogue_constant":
        spec = matmul_regions(REGIONS["linear_gelu"][0], *[rand(*s) for s in REGIONS["linear_gelu"][1]])[0]
        bad = _broken(FAMILY.generate(spec, interp_config(spec)), "0.7071067811865476", "0.5")  # beyond the mm's rounding
    else:
        spec = spec_of(aten.addmm.default, (rand(36), rand(24, 40), rand(40, 36)), {"alpha": 0.5})
        bad = _broken(FAMILY.generate(spec, interp_config(spec)), "acc * 0.5", "acc * 0.25")
    rec = run_validation(FAMILY, spec, bad, tmp_path)
    assert not rec.ok


# --- refusals ---------------------------------------------------------------------------------------

def _region(nodes, outputs, inputs, outs) -> KernelSpec:
    graph = {"kind": "matmul", "nodes": nodes, "outputs": outputs}
    return KernelSpec("region", [], {}, tuple(inputs), tuple(outs), len(outs) > 1,
                      json.dumps(graph, sort_keys=True, separators=(",", ":")))


def test_refusals():
    a, b = rand(8, 16), rand(16, 8)
    ia, ib = torch.randint(-3, 3, (8, 16)), torch.randint(-3, 3, (16, 8))
    assert "integer" in FAMILY.supports(spec_of(aten.mm.default, (ia, ib)))
    assert "float64" in FAMILY.supports(spec_of(aten.mm.default, (a.double(), b.double())))
    assert "K == 0" in FAMILY.supports(spec_of(aten.mm.default, (torch.randn(4, 0), torch.randn(0, 4))))
    assert "empty" in FAMILY.supports(spec_of(aten.mm.default, (torch.randn(0, 4), torch.randn(4, 4))))
    assert "alpha" in FAMILY.supports(spec_of(aten.addmm.default, (rand(8), a, b), {"alpha": 0}))
    mixed = spec_of(aten.mm.default, (a, b))
    mixed = dataclasses.replace(mixed, inputs=(mixed.inputs[0], dataclasses.replace(mixed.inputs[1], dtype="float16")))
    assert "mixed" in FAMILY.supports(mixed)
    assert FAMILY.supports(spec_of(aten.add.Tensor, (a, a)))   # not a matmul
    # a region whose epilogue holds an op elementwise.OPS does not cover
    m = lambda shape, st, dt="float32": TensorMeta(shape, st, dt)
    A, B, C = m((8, 16), (16, 1)), m((16, 8), (8, 1)), m((8, 8), (8, 1))
    nodes = [{"op": "aten.mm.default", "args": [{"input": 0}, {"input": 1}], "kwargs": {}, "meta": C.to_json()},
             {"op": "aten.cumsum.default", "args": [{"node": 0}, 1], "kwargs": {}, "meta": C.to_json()}]
    assert "elementwise.OPS" in FAMILY.supports(_region(nodes, [1], [A, B], [C]))
    ok = _region(nodes[:1] + [{"op": "aten.relu.default", "args": [{"node": 0}], "kwargs": {}, "meta": C.to_json()}],
                 [1], [A, B], [C])
    assert FAMILY.supports(ok) is None
    # an epilogue producing integers, and a non-matmul region kind
    as_int = {"op": "aten._to_copy.default", "args": [{"node": 0}], "kwargs": {"dtype": {"dtype": "int32"}},
              "meta": m((8, 8), (8, 1), "int32").to_json()}
    assert "int32" in FAMILY.supports(_region(nodes[:1] + [as_int], [1], [A, B], [m((8, 8), (8, 1), "int32")]))
    pw = dataclasses.replace(ok, graph=ok.graph.replace('"kind":"matmul"', '"kind":"pointwise"'))
    assert "pointwise" in FAMILY.supports(pw)


def test_sm90_compile(tmp_path):
    """Generated programs compile for sm_90 (H100/H200): a plain linear-layout mm and a fused region."""
    a, b, o = TensorMeta((512, 256), (256, 1), "bfloat16"), TensorMeta((256, 384), (1, 256), "bfloat16"), \
        TensorMeta((512, 384), (384, 1), "bfloat16")
    spec = KernelSpec("aten.mm.default", [{"tensor": 0}, {"tensor": 1}], {}, (a, b), (o,))
    compile_sm90(spec, FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]), tmp_path)
    region = SEED_SPECS["region_bf16"]()
    compile_sm90(region, FAMILY.generate(region, FAMILY.seed_configs(region)[0]), tmp_path)
    fp32 = SEED_SPECS["addmm_f32"]()
    compile_sm90(fp32, FAMILY.generate(fp32, FAMILY.seed_configs(fp32)[0]), tmp_path)
    # past 2^31 elements the offsets are int64; the ALIGN variant (two bodies) compiles too
    a, b, o = TensorMeta((70000, 40000), (40000, 1), "bfloat16"), TensorMeta((40000, 256), (1, 40000), "bfloat16"), \
        TensorMeta((70000, 256), (256, 1), "bfloat16")
    big = KernelSpec("aten.mm.default", [{"tensor": 0}, {"tensor": 1}], {}, (a, b), (o,))
    program = FAMILY.generate(big, FAMILY.seed_configs(big)[0].replace(ALIGN=True))
    assert ".to(tl.int64)" in program.source and "tl.multiple_of" in program.source
    compile_sm90(big, program, tmp_path)


# --- GPU timing (run by hand on the GPU machine) ------------------------------------------------

def gpu_bench(out: str | None = None) -> list[dict]:
    """Median time of every seed config against eager (cuBLAS) on a few real shapes. Needs CUDA;
    launches through Triton's JIT (kernel_testing.jit_runner). ``python test/test_kernels_matmul.py [out.json]``"""
    import tempfile
    from pathlib import Path

    from triton.testing import do_bench

    from kernel_testing import jit_runner

    torch.manual_seed(0)
    r = lambda *s, dtype=F16: torch.randn(*s, device="cuda", dtype=dtype)
    silu = REGIONS["silu_bias_residual"][0]
    cases = [
        ("mm f16 4096^3", aten.mm.default, (r(4096, 4096), r(4096, 4096))),
        ("linear bf16 8192x1024 @ [4096x1024].t()", aten.mm.default, (r(8192, 1024, dtype=BF16), r(4096, 1024, dtype=BF16).t())),
        ("addmm f16 bias [4096]", aten.addmm.default, (r(4096), r(8192, 1024), r(4096, 1024).t())),
        ("mm f32 2048^3", aten.mm.default, (r(2048, 2048, dtype=F32), r(2048, 2048, dtype=F32))),
        ("bmm f16 32x512x512x64", aten.bmm.default, (r(32, 512, 64), r(32, 64, 512))),
        ("region silu(x@w.t()+b)+r f16 8192x4096x1024", None, (r(8192, 1024), r(4096, 1024), r(4096), r(8192, 4096))),
    ]
    rows = BenchRows()
    with tempfile.TemporaryDirectory() as tmp:
        for name, op, args in cases:
            if op is None:
                spec, = matmul_regions(silu, *[a.cpu() for a in args])
                vendor = lambda: silu(*args)
            else:
                spec = spec_of(op, args)
                vendor = lambda: op(*args)
            eager = do_bench(vendor, warmup=25, rep=100)
            want = vendor()
            for config in FAMILY.seed_configs(spec):
                if config["DOT_UPCAST"]:
                    continue
                runner = jit_runner(Path(tmp), spec, FAMILY.generate(spec, config))
                got = runner.run_poisoned(list(args))[0]
                err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                outs, temps = runner.allocate(args[0].device)
                t = do_bench(lambda: runner.launch(list(args), outs, temps), warmup=25, rep=100)
                rows.add(case=name, config=str(config), ms=round(t, 4), eager_ms=round(eager, 4),
                         speedup=round(eager / t, 2), rel_err=err)
    return rows.save(out)


if __name__ == "__main__":
    import sys
    gpu_bench(sys.argv[1] if len(sys.argv) > 1 else None)
