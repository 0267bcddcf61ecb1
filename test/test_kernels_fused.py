"""The fused-region family on the Triton interpreter. Regions are cut from real graphs (make_fx with
the core ATen decompositions, then find_regions / region_spec), validated against the float64
reference and compared with the node-by-node vendor execution (run_region_graph)."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kernel_testing import assert_valid, compare_eager, compile_sm90, run_validation
from torch_kernelize.core import targets
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.fused import FAMILY, MAX_PASSES, analyse
from torch_kernelize.compiling.regions import find_regions, region_spec
from torch_kernelize.core.spec import KernelSpec

# the interpreter runs numpy, which warns on inf/NaN arithmetic the edge-value trials do on purpose
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def region_specs(fn, *inputs) -> list[KernelSpec]:
    gm = make_fx(fn, tracing_mode="fake", decomposition_table=torch._decomp.core_aten_decompositions())(*inputs)
    return [region_spec(r, {}) for r in find_regions(gm, targets.get_target("interpreter"))]


def one_region(fn, *inputs, kind: str | None = None) -> KernelSpec:
    specs = region_specs(fn, *inputs)
    assert len(specs) == 1, [s.describe() for s in specs]
    if kind is not None:
        assert json.loads(specs[0].graph)["kind"] == kind
    return specs[0]


def looped(spec: KernelSpec, block_n: int = 16, block_m: int = 2, **kw) -> Config:
    return Config.of(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=1, num_stages=2, ALIGN=True, EVICT=True).replace(**kw)


# --- the functions regions are cut from ----------------------------------------------------------

def rmsnorm(x, w):  # torch_kernelize.model_zoo.RMSNorm
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def swish_mul_add(x, y, z):
    return x * torch.sigmoid(x) * y + z


def masked_softmax(x, mask):
    return torch.softmax(x * 0.125 + mask, -1)


def cast_log_softmax(x):
    return torch.log_softmax(x.to(F16) * 2, -1)


def layernorm_manual(x, w, b):
    m = x.mean(-1, keepdim=True)
    d = x - m
    return d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w + b


def multi_output(x, y):
    a = x * y
    s = a.softmax(-1)
    return s, a.amax(-1, keepdim=True), a.amin(-1, keepdim=True) * 2, s.sum(-1, keepdim=True), a + 1


def bool_mask_softmax(x, keep):
    return x.masked_fill(~keep, float("-inf")).softmax(-1)


CASES = {
    "rmsnorm_f16": lambda: one_region(rmsnorm, torch.randn(6, 100, dtype=F16), torch.randn(100, dtype=F16), kind="rowwise"),
    "swish_pointwise": lambda: one_region(swish_mul_add, torch.randn(7, 33), torch.randn(33), torch.randn(7, 1), kind="pointwise"),
    "masked_softmax_f16": lambda: one_region(masked_softmax, torch.randn(2, 4, 50, dtype=F16), torch.randn(4, 50, dtype=F16)),
    "cast_log_softmax": lambda: one_region(cast_log_softmax, torch.randn(6, 30)),
    "layernorm_manual_bf16": lambda: one_region(layernorm_manual, torch.randn(5, 48, dtype=BF16),
                                                torch.randn(48, dtype=BF16), torch.randn(48, dtype=BF16)),
    "multi_output": lambda: one_region(multi_output, torch.randn(5, 24), torch.randn(5, 24)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_seed_config_validates(case, tmp_path):
    spec = CASES[case]()
    assert FAMILY.supports(spec) is None, FAMILY.supports(spec)
    configs = FAMILY.seed_configs(spec)
    assert 1 <= len(configs) <= 5
    for config in configs:
        assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,), eager=config is configs[0])
    for n in FAMILY.neighbours(spec, configs[0]):  # one step away: still valid and generated
        assert n.key != configs[0].key
        FAMILY.generate(spec, n)


@pytest.mark.parametrize("case", ["rmsnorm_f16", "masked_softmax_f16", "cast_log_softmax", "layernorm_manual_bf16",
                                  "multi_output"])
def test_looped_variant(case, tmp_path):
    """Rows walked in blocks shorter than the row: one pass per reduction level, then the stores."""
    spec = CASES[case]()
    program = assert_valid(FAMILY, spec, tmp_path, looped(spec), seeds=(0, 1))
    passes = {"rmsnorm_f16": 2, "masked_softmax_f16": 2, "cast_log_softmax": 2, "layernorm_manual_bf16": 3,
              "multi_output": 2}[case]
    assert f"pass {passes} of {passes}" in program.source and "for c0 in range(0, " in program.source


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("shape", [(6, 100), (2, 3, 64), (1, 37)], ids=str)
def test_rmsnorm_dtypes_and_shapes(dtype, shape, tmp_path):
    spec = one_region(rmsnorm, torch.randn(*shape, dtype=dtype), torch.randn(shape[-1], dtype=dtype))
    assert_valid(FAMILY, spec, tmp_path, seeds=(0,))


LAYOUTS = {
    # rows that are a slice of wider rows (row stride != N)
    "sliced_rows": lambda: one_region(rmsnorm, torch.randn(5, 80, dtype=F16)[:, :72], torch.randn(72, dtype=F16)),
    # last dim not contiguous: the row is read with a stride
    "transposed_rows": lambda: one_region(rmsnorm, torch.randn(40, 6).t(), torch.randn(40)),
    # leading dims permuted: row offsets by div/mod
    "permuted_lead": lambda: one_region(masked_softmax, torch.randn(3, 2, 20).transpose(0, 1), torch.randn(3, 1)),
    # a strided weight
    "strided_weight": lambda: one_region(rmsnorm, torch.randn(4, 24), torch.randn(48)[::2]),
    # pointwise: transposed operands and a 0-d tensor
    "pointwise_transposed": lambda: one_region(swish_mul_add, torch.randn(33, 7, dtype=F16).t(),
                                               torch.randn(33, dtype=F16), torch.tensor(0.5, dtype=F16)),
    "pointwise_expanded": lambda: one_region(swish_mul_add, torch.randn(4, 1, 9).expand(4, 3, 9),
                                             torch.randn(3, 1), torch.randn(4, 3, 9)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_noncontiguous_layouts(layout, tmp_path):
    spec = LAYOUTS[layout]()
    assert_valid(FAMILY, spec, tmp_path, seeds=(0,))
    if json.loads(spec.graph)["kind"] == "rowwise":
        assert_valid(FAMILY, spec, tmp_path, looped(spec, block_n=16), seeds=(0,), eager=False)


def test_bool_mask_and_scalar_inputs(tmp_path):
    spec = one_region(bool_mask_softmax, torch.randn(4, 20), torch.rand(4, 20) > 0.3)
    assert any(m.dtype == "bool" for m in spec.inputs)
    assert_valid(FAMILY, spec, tmp_path, seeds=(0,))
    assert_valid(FAMILY, spec, tmp_path, looped(spec), seeds=(0,), eager=False)


def test_mixed_types_and_helpers(tmp_path):
    """Comparisons, where, integer and bool operands, type promotion and helper functions (tanh)."""
    def f(x, k, keep):
        y = torch.where(x > 0, x * k, (k + 1) * keep)
        return torch.nn.functional.gelu(y, approximate="tanh").clamp(-1, 2), (y > 0.5) & keep
    spec = one_region(f, torch.randn(6, 20, dtype=F16), torch.randint(-3, 4, (20,), dtype=torch.int32),
                      torch.rand(6, 1) > 0.5, kind="pointwise")
    assert [m.dtype for m in spec.outputs] == ["float16", "bool"]
    program = assert_valid(FAMILY, spec, tmp_path, seeds=(0,))
    assert "def _tanh(x):" in program.source


def test_multi_output_layouts_and_values(tmp_path):
    """Full and row-shaped outputs of one region, each in its own dtype and strides."""
    spec = CASES["multi_output"]()
    assert [tuple(m.shape) for m in spec.outputs] == [(5, 24), (5, 1), (5, 1), (5, 1), (5, 24)]
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    x, y = torch.randn(5, 24), torch.randn(5, 24)
    compare_eager(FAMILY, spec, program, tmp_path, inputs=[x, y])

    def rows_and_cast(x):
        h = x.float() * 3
        return h.to(BF16), (h * h).sum(-1, keepdim=True)
    spec = one_region(rows_and_cast, torch.randn(3, 2, 17, dtype=F16))
    assert [m.dtype for m in spec.outputs] == ["bfloat16", "float32"]
    assert_valid(FAMILY, spec, tmp_path, seeds=(0,))


def test_cast_rounds_like_the_graph(tmp_path):
    """An explicit _to_copy to fp16 rounds (the value then feeds fp32 math): bit-equal to ATen here."""
    def f(x):
        return x.to(F16).float() * 3.0 + x
    spec = one_region(f, torch.randn(8, 40))
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    assert ".to(tl.float16).to(tl.float32)" in program.source
    compare_eager(FAMILY, spec, program, tmp_path, exact=True)


def test_unaligned_inputs_take_the_plain_body(tmp_path):
    """The kernel tests pointer alignment at run time: an input at an odd offset still computes right."""
    spec = CASES["rmsnorm_f16"]()
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    assert "aligned = " in program.source and "tl.multiple_of" in program.source
    base = torch.randn(6 * 100 + 1, dtype=F16)
    x = base[1:].view(6, 100)  # 2 bytes past an aligned address
    assert x.data_ptr() % 16 != 0
    compare_eager(FAMILY, spec, program, tmp_path, inputs=[x, torch.randn(100, dtype=F16)])


def _broken(program, old: str, new: str):
    assert old in program.source, program.source
    return dataclasses.replace(program, source=program.source.replace(old, new, 1))


@pytest.mark.parametrize("what", ["eps", "col_mask", "online_softmax", "rounding_pointwise"])
def test_broken_programs_fail_validation(what, tmp_path):
    if what == "eps":  # RMSNorm with a wrong epsilon (2.5% off for unit rows)
        spec = CASES["rmsnorm_f16"]()
        bad = _broken(FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]), "+ 1e-06", "+ 0.05")
    elif what == "col_mask":  # the last column is never written (outputs are poisoned)
        spec = CASES["rmsnorm_f16"]()
        bad = _broken(FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]), "col_mask = cols < 100", "col_mask = cols < 99")
    elif what == "online_softmax":  # looped softmax without rescaling the running sum
        spec = CASES["masked_softmax_f16"]()
        program = FAMILY.generate(spec, looped(spec))
        bad = _broken(program, "tl.where(m_new == -float('inf'), 1.0, tl.exp(m2 - m_new))", "1.0")
    else:  # a pointwise region reading the broadcast operand with the wrong coordinate
        spec = CASES["swish_pointwise"]()
        bad = _broken(FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]), "i1 = idx % 33", "i1 = idx % 32")
    rec = run_validation(FAMILY, spec, bad, tmp_path)
    assert not rec.ok and rec.reason


def _with_graph(spec: KernelSpec, edit) -> KernelSpec:
    g = json.loads(spec.graph)
    edit(g)
    return dataclasses.replace(spec, graph=json.dumps(g, sort_keys=True, separators=(",", ":")))


def test_refusals():
    rms = CASES["rmsnorm_f16"]()
    # not a region / another kind
    assert FAMILY.supports(dataclasses.replace(rms, graph=None))
    assert "matmul" in FAMILY.supports(_with_graph(rms, lambda g: g.update(kind="matmul")))
    # a float -> int cast inside a region: undefined outside the integer range
    spec = one_region(lambda x: (x * 4).to(torch.int32) + 1, torch.randn(4, 8))
    assert "int32" in FAMILY.supports(spec)
    # float64 anywhere
    assert "float64" in FAMILY.supports(one_region(lambda x: x.exp() * 2, torch.randn(4, 8, dtype=torch.float64)))

    # reductions must be over the last dim with keepdim (regions.py only forms those; the family checks)
    def reduce_dim0(g):
        g["nodes"][2]["args"][1] = [0]
    assert "last dim" in FAMILY.supports(_with_graph(rms, reduce_dim0))

    def half_to_float(g):
        g["nodes"][-1]["args"][2] = True
    assert "half_to_float" in FAMILY.supports(_with_graph(CASES["masked_softmax_f16"](), half_to_float))

    def unknown_op(g):
        g["nodes"][3]["op"] = "aten.cumsum.default"
    assert FAMILY.supports(_with_graph(rms, unknown_op))
    # rows too long for registers that would need more than MAX_PASSES passes
    def chain(x):
        for _ in range(MAX_PASSES + 1):
            x = x - x.mean(-1, keepdim=True)
        return x
    with FakeTensorMode():
        big = torch.empty(2, 32768)
    spec = one_region(chain, big)
    assert "passes" in FAMILY.supports(spec)
    with FakeTensorMode():
        ok = torch.empty(2, 8192)
    assert FAMILY.supports(one_region(chain, ok)) is None  # fits in registers: one pass


def test_registry():
    assert family_for(CASES["rmsnorm_f16"]()) is FAMILY
    assert family_for(CASES["swish_pointwise"]()) is FAMILY


def _sm90_ptx(spec: KernelSpec, program) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torch_kernelize.serving.launch import import_source

    import tempfile
    from pathlib import Path
    d = Path(tempfile.mkdtemp())
    (d / "kernel.py").write_text(program.source)
    module = import_source(d / "kernel.py", f"tk_test_fused_ptx.m{abs(hash(program.source))}")
    launch = program.launches[0]
    compiled = triton.compile(ASTSource(getattr(module, launch.kernel), signature=program.signature(launch, spec),
                                        constexprs=dict(launch.constexprs)),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    return compiled.asm["ptx"]


def test_rmsnorm_4096x8192_compiles_for_sm90_vectorized(tmp_path):
    """The benchmark region (RMSNorm 4096x8192 fp16): every seed compiles for sm_90, and the aligned
    body moves 16 bytes per load/store."""
    with FakeTensorMode():
        x, w = torch.empty(4096, 8192, dtype=F16), torch.empty(8192, dtype=F16)
    spec = one_region(rmsnorm, x, w)
    configs = FAMILY.seed_configs(spec)
    assert configs[0].to_json() == {"ALIGN": True, "BLOCK_M": 1, "BLOCK_N": 8192, "EVICT": False,
                                    "num_stages": 1, "num_warps": 8}
    for config in configs:
        compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)
    ptx = _sm90_ptx(spec, FAMILY.generate(spec, configs[0]))
    assert re.search(r"ld\.global[\w:.]*\.v4\.b32", ptx) and re.search(r"st\.global[\w:.]*\.v4\.b32", ptx)


def test_other_regions_compile_for_sm90(tmp_path):
    with FakeTensorMode():
        big = (torch.empty(64, 32768, dtype=BF16), torch.empty(32768, dtype=BF16))      # looped RMSNorm
        sm = (torch.empty(8, 16, 1000, dtype=F16), torch.empty(16, 1000, dtype=F16))      # masked softmax
        pw = (torch.empty(512, 1024, dtype=F16), torch.empty(1024, dtype=F16), torch.empty(512, 1, dtype=F16))
        huge = (torch.empty(65536, 32769, dtype=F16), torch.empty(32769, dtype=F16))    # > 2^31 elements
    for spec in [one_region(rmsnorm, *big), one_region(masked_softmax, *sm), one_region(swish_mul_add, *pw),
                 one_region(multi_output, *sm)]:
        config = FAMILY.seed_configs(spec)[0]
        compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)
    spec = one_region(rmsnorm, *big)
    assert "pass 2 of 2" in FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]).source
    spec = one_region(rmsnorm, *huge)
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    assert "pid.to(tl.int64)" in program.source
    compile_sm90(spec, program, tmp_path)


def test_plan_levels():
    """Levels count the reductions on a node's path; passes = what the looped variant walks."""
    spec = CASES["layernorm_manual_bf16"]()
    plan = analyse(json.loads(spec.graph), spec.inputs, spec.outputs)
    assert plan.passes == 3 and plan.N == 48 and plan.M == 5
    assert [n.shape for n in plan.nodes if n.role == "reduce"] == ["row", "row"]
    assert [t.cls for t in plan.inputs] == ["full", "col", "col"]


def rope_gqa_k(kv, cos, sin):
    """RoPE on k of a GQA layer (torch_kernelize.model_zoo DecoderLayer/Rope, scaled down: 2 kv heads
    of 16): k is a select of a permute of the packed kv projection, a view with gaps (v between)."""
    b, s, _ = kv.shape
    k, v = kv.view(b, s, 2, 2, 16).permute(2, 0, 3, 1, 4)
    c, sn = cos[:s].to(k.dtype), sin[:s].to(k.dtype)
    k1, k2 = k.chunk(2, -1)
    return k * c + torch.cat([-k2, k1], -1) * sn, v


def test_rope_over_gqa_k_view(tmp_path):
    """Regression (fill_cache on an H200, Llama k RoPE: no correct candidate, ~93% of elements wrong).

    The kernel was right; its validation inputs were not: sample_inputs moved them to the GPU with
    Tensor.to, which keeps strides only for dense tensors, so k arrived contiguous while the kernel
    bakes in k's spec strides. The interpreter runs on the CPU, where that move is a no-op: the
    "meta" device stands in for the GPU here."""
    b, s, kvh, hd = 2, 16, 2, 16
    t = torch.arange(32.0)[:, None] * (1.0 / 10000 ** (torch.arange(0, hd, 2) / hd))
    emb = torch.cat([t, t], -1)
    spec = one_region(rope_gqa_k, torch.randn(b, s, 2 * kvh * hd, dtype=F16), emb.cos(), emb.sin(), kind="pointwise")
    k_stride = (s * 2 * kvh * hd, hd, 2 * kvh * hd, 1)
    assert spec.inputs[0].stride == k_stride and spec.outputs[0].stride == (s * kvh * hd, hd, kvh * hd, 1)
    assert_valid(FAMILY, spec, tmp_path, seeds=(0, 1))
    for kind in ("random", "special"):
        moved = FAMILY.sample_inputs(spec, 0, kind, "meta")
        assert [x.stride() for x in moved] == [m.stride for m in spec.inputs], kind
    # captured inputs (repros) go through the same move: v's storage offset is kept too
    from torch_kernelize.core.devices import to_device
    v = torch.randn(b, s, 2, kvh, hd).permute(2, 0, 3, 1, 4)[1]
    on_meta = to_device(v, "meta")
    assert (on_meta.stride(), on_meta.storage_offset()) == (v.stride(), v.storage_offset())


def rope_halves(q, cos, sin):
    """Llama's RoPE (torch_kernelize.model_zoo Rope): the rotated halves are a cat of a negated slice
    and a slice, which the region reads in place (the neg computed where its piece is read)."""
    q1, q2 = q.chunk(2, -1)
    return q * cos + torch.cat([-q2, q1], -1) * sin


def cat_three(a, b, c, w):
    return torch.cat([a, b, c], 1) * w + 1


def cat_computed_pieces(a, b, c, s, w):
    """Pieces computed from broadcast inputs and a scalar; one piece also read by a later node
    (it stays outside the region: the region former only takes values that only the cat reads),
    and one that reads an input another piece reads (it stays outside too)."""
    p0 = torch.sigmoid(a * s) + w[:2]
    p1 = b.exp()
    p2 = c * 3
    return torch.cat([p0, p1, p2, c], 0) * 2, p1


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_cat_pieces_read_in_place(dtype, tmp_path):
    q = torch.randn(2, 20, 3, 16).to(dtype).transpose(1, 2)  # a transposed view, like q in attention
    spec = one_region(rope_halves, q, torch.randn(20, 16).to(dtype), torch.randn(20, 16).to(dtype), kind="pointwise")
    nodes = [n["op"] for n in json.loads(spec.graph)["nodes"]]
    assert "aten.cat.default" in nodes and "aten.neg.default" in nodes  # one kernel: no neg, no cat launch
    assert FAMILY.supports(spec) is None
    program = assert_valid(FAMILY, spec, tmp_path, seeds=(0,))
    assert "index along the cat dim" in program.source and "# piece 1: [8, 16)" in program.source
    if dtype == F16:
        compile_sm90(spec, program, tmp_path)  # what the GPU build does (the interpreter is lenient)
    # three pieces along a middle dim, one of them broadcast-free but non-contiguous; a tail block
    a, b, c = torch.randn(3, 2, 7), torch.randn(3, 5, 7)[:, ::2], torch.randn(3, 1, 7)
    spec = one_region(cat_three, a, b, c, torch.randn(7), kind="pointwise")
    assert FAMILY.supports(spec) is None
    assert_valid(FAMILY, spec, tmp_path, seeds=(0,))
    if dtype == F32:
        specs = region_specs(cat_computed_pieces, torch.randn(2, 9), torch.randn(3, 9), torch.randn(1, 9),
                             torch.tensor(0.5), torch.randn(4, 9))
        spec = next(sp for sp in specs if "aten.cat.default" in sp.graph)
        ops = [n["op"] for n in json.loads(spec.graph)["nodes"]]
        assert "aten.sigmoid.default" in ops and "aten.exp.default" not in ops and ops.count("aten.mul.Tensor") == 2
        assert FAMILY.supports(spec) is None
        assert_valid(FAMILY, spec, tmp_path, seeds=(0,))


def test_cat_refusals_and_no_cat_in_rowwise():
    # a piece computed in the region must be read by that piece alone (the region former only
    # takes such values in): the same value as both pieces is refused
    spec = one_region(rope_halves, torch.randn(2, 8, 16), torch.randn(8, 16), torch.randn(8, 16))
    graph = json.loads(spec.graph)
    cat = next(n for n in graph["nodes"] if n["op"] == "aten.cat.default")
    cat["args"][0][1] = cat["args"][0][0]
    bad = dataclasses.replace(spec, graph=json.dumps(graph))
    assert "read outside its cat piece" in FAMILY.supports(bad)
    # a softmax over a cat: the cat stays out of the rowwise region
    specs = region_specs(lambda a, b, m: torch.softmax(torch.cat([a, b], -1) + m, -1),
                         torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 16))
    for sp in specs:
        kinds = [n["op"] for n in json.loads(sp.graph)["nodes"]]
        assert "aten.cat.default" not in kinds or json.loads(sp.graph)["kind"] == "pointwise"


def test_running_a_region_lets_each_intermediate_go_after_its_last_reader(monkeypatch):
    """The vendor run and the float64 reference of a region over GB-sized tensors: each node's
    value is dropped once no later node reads it (all of them stayed alive, 4 GB each in float64),
    and all of them once the run is done."""
    import gc
    import weakref

    import torch_kernelize.core.region_graph as regions

    spec = one_region(rmsnorm, torch.randn(8, 64, dtype=F16), torch.randn(64, dtype=F16))
    made, alive_at_last = [], []
    resolve = regions.resolve_op

    def watched(name):
        op = resolve(name)

        def run(*args, **kwargs):
            alive_at_last[:] = [r for r in made if r() is not None]
            out = op(*args, **kwargs)
            made.append(weakref.ref(out))
            return out
        return run
    monkeypatch.setattr(regions, "resolve_op", watched)
    x, w = torch.randn(8, 64, dtype=F16), torch.randn(64, dtype=F16)
    gc.disable()  # reference counting alone must free them
    try:
        out = regions.run_region_graph(spec, [x, w])
        assert len(made) >= 6
        assert len(alive_at_last) == 1, "intermediates outlived their last reader"  # the last node's operand
        assert torch.equal(out[0], rmsnorm(x, w))
        del out, alive_at_last[:]
        gone = weakref.ref(x)
        del x
        # nothing of the run is held by a reference cycle (a recursive closure held the inputs and
        # every value until the cycle collector ran: 108 GB of a region's trials on an H200)
        assert gone() is None and all(r() is None for r in made)
    finally:
        gc.enable()


@pytest.mark.parametrize("shape", [(), (1,), (1, 1, 1)], ids=str)
def test_zero_dim_and_one_element_regions(shape, tmp_path):
    """Every operand and the output one element: the value is stored as a scalar to a scalar
    pointer (the interpreter refuses a block there), as clamp_max on a 0-d tensor fuses."""
    x, y = torch.randn(shape), torch.randn(shape)
    spec = one_region(lambda a, b: torch.where(a > 0, (a * 2).clamp_max(0.5) + b, b), x, y)
    compare_eager(FAMILY, spec, assert_valid(FAMILY, spec, tmp_path, seeds=(0,)), tmp_path)


def test_zero_dim_operand_of_minimum_and_maximum(tmp_path):
    """A 0-d operand beside a block in minimum/maximum (logsigmoid's region: minimum(0, x)): its
    NaN test is a comparison of one-element values, which the interpreter types as float."""
    spec = one_region(lambda z, x: torch.minimum(z, x) - torch.maximum(z, -x).exp(), torch.zeros(()), torch.randn(20))
    compare_eager(FAMILY, spec, assert_valid(FAMILY, spec, tmp_path, seeds=(0,)), tmp_path)


@pytest.mark.parametrize("shape", [(1, 2), (3, 4), (1, 5), (5, 2), (1, 1, 3)], ids=str)
def test_rowwise_regions_smaller_than_a_warp(shape, tmp_path):
    """A region of fewer than 32 elements is one tile of one warp (the whole region, as the sort
    family's short rows): the rowwise kinds are generated, every seed config against the float64
    reference and the node-by-node run, and compile for sm_90; before, no config fitted them."""
    x = torch.randn(shape)
    for spec in (one_region(lambda a: (a * 2).softmax(-1) + 1, x, kind="rowwise"),
                 one_region(rmsnorm, x, torch.randn(shape[-1]), kind="rowwise"),
                 region_specs(multi_output, x, torch.randn(shape))[0]):
        configs = FAMILY.seed_configs(spec)
        assert configs and all(c["num_warps"] == 1 and c["BLOCK_M"] * c["BLOCK_N"] < 32 for c in configs)
        for config in configs:
            program = assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,), eager=config is configs[0])
        compile_sm90(spec, program, tmp_path)
    big = one_region(lambda a: (a * 2).softmax(-1) + 1, torch.randn(4, 9), kind="rowwise")
    assert all(c["BLOCK_M"] * c["BLOCK_N"] >= 32 * c["num_warps"] for c in FAMILY.seed_configs(big))
