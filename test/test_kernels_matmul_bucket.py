"""The matmul family serving a shape bucket (interpreter target): one kernel with M (and bmm's
batch) taken at run time, instantiated at the bucket's edges and inside, matches the float64
reference; what cannot vary (K, N, strides that depend on M) is refused with a reason; and a
Linear layer filled with ``fill_cache --dynamic`` runs its GEMMs on the bucket's kernel."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from kernel_testing import compile_sm90, run_validation, spec_of
from test_kernels_matmul import matmul_regions
from test_kernels_matmul_group import experts, groups_of, moe_args
from torch_kernelize.backend import compile_with_session
from torch_kernelize.building.programs import write_program
from torch_kernelize.compiling.lower import Session
from torch_kernelize.compiling.regions import region_spec
from torch_kernelize.core import buckets as B
from torch_kernelize.core.options import Options
from torch_kernelize.core.spec import KernelSpec, TensorMeta
from torch_kernelize.core.targets import get_target
from torch_kernelize.fill_cache.buckets import inside_sizes
from torch_kernelize.fill_cache.cli import main as fill_main
from torch_kernelize.kernel_cache import KernelCache
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.matmul import FAMILY
from torch_kernelize.serving.launch import import_source
from torch_kernelize.serving.triton_binaries import ast_source

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf/NaN edge trials

aten = torch.ops.aten
F16 = torch.float16


def rand(*shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype)


def varying(spec: KernelSpec, variables: dict[int, int]) -> tuple[B.Dim, ...]:
    """The bucket dims of ``spec``: every dim whose size is a key of ``variables`` (sizes chosen
    apart from every other dim's) is that variable."""
    return tuple((side, i, d, variables[n]) for side, metas in (("in", spec.inputs), ("out", spec.outputs))
                 for i, m in enumerate(metas) for d, n in enumerate(m.shape) if n in variables)


def config(**changes) -> Config:
    """Tiles small enough for several row blocks (the GROUP_M swizzle, a masked last block)."""
    base = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=2, DOT_UPCAST=False, ALIGN=False)
    return Config.of(**{**base, **changes})


# name: (the representative spec (sizes at the bucket's upper edge), variables by size, ranges, config)
CASES = {
    "mm_linear_f16": (lambda: spec_of(aten.mm.default, (rand(40, 32, dtype=F16), rand(24, 32, dtype=F16).t())),
                      {40: 0}, ((17, 40),), config()),
    "addmm_bias_and_rows_bias": (lambda: spec_of(aten.addmm.default, (rand(40, 1), rand(40, 32), rand(24, 32).t()),
                                                 {"beta": 0.5}), {40: 0}, ((17, 40),), config()),
    "addmm_one_row_block": (lambda: spec_of(aten.addmm.default, (rand(24), rand(16, 32), rand(24, 32).t())),
                            {16: 0}, ((1, 16),), config(BLOCK_N=32)),
    "bmm_rows_aligned": (lambda: spec_of(aten.bmm.default, (rand(3, 40, 24), rand(3, 24, 20))),
                         {40: 0}, ((17, 40),), config(ALIGN=True)),
    "bmm_batch_and_rows": (lambda: spec_of(aten.bmm.default, (rand(3, 40, 24), rand(3, 24, 20))),
                           {3: 0, 40: 1}, ((2, 3), (17, 40)), config()),
    "region_silu_bias_residual": (lambda: matmul_regions(lambda x, w, b, r: F.silu(x @ w.t() + b) + r, rand(40, 32),
                                                         rand(24, 32), rand(24), rand(40, 24))[0],
                                  {40: 0}, ((17, 40),), config()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_bucketed_gemm_matches_the_reference_at_both_edges_and_inside(name, tmp_path):
    make, variables, ranges, cfg = CASES[name]
    spec = make()
    dims = varying(spec, variables)
    assert FAMILY.bucket_support(spec, dims) is None, FAMILY.bucket_support(spec, dims)
    program = FAMILY.generate_bucketed(spec, cfg, dims)
    (launch,) = program.launches
    assert launch.runtime_sizes["grid"] and B.instantiate(program, B.values_of(spec, dims)) == program
    sizes = inside_sizes(ranges, name)   # the sizes fill_cache validates a bucket's winner at
    assert len(sizes) >= 3 and sizes[0] == tuple(lo for lo, _ in ranges) and sizes[1] == tuple(hi for _, hi in ranges)
    for values in sizes:
        at = B.spec_at(spec, dims, values)
        rec = run_validation(FAMILY, at, B.instantiate(program, values), tmp_path, seeds=(0,))
        assert rec.ok, f"{name} at sizes {values}: {rec.reason}\n{program.source}"


def test_only_m_differs_from_the_static_kernel():
    """The bucketed kernel is the static one with M an argument: with only bmm's batch varying it
    is the static kernel itself, launched on a grid of the run-time batch."""
    spec = spec_of(aten.bmm.default, (rand(3, 40, 24), rand(3, 24, 20)))
    static = FAMILY.generate(spec, config())
    batch = FAMILY.generate_bucketed(spec, config(), varying(spec, {3: 0}))
    assert batch.source == static.source and batch.launches[0].runtime_sizes == {"grid": [6, "v0"]}
    rows = FAMILY.generate_bucketed(spec, config(), varying(spec, {40: 0}))
    assert "M, BLOCK_M: tl.constexpr" in rows.source and "m_mask = rm < M" in rows.source
    assert "pid_b * M * 24" in rows.source and "pid_b * M * 20" in rows.source   # batch strides of [B, M, *]
    assert rows.launches[0].runtime_sizes == {"grid": [["mul", 2, ["cdiv", "v0", 16]], 3], "args": {"3": "v0"}}


@pytest.mark.parametrize("name,old,new", [
    ("mm_linear_f16", "mb = (M + 15) // BLOCK_M", "mb = (40 + 15) // BLOCK_M"),   # the swizzle skips tiles
    ("bmm_rows_aligned", "pid_b * M * 24", "pid_b * 960"),                        # A's batch stride at 40 rows
], ids=["swizzle", "batch-stride"])
def test_a_kernel_that_takes_the_upper_edge_for_m_fails_inside_the_bucket(name, old, new, tmp_path):
    """The check can fail: a kernel right at the upper edge but with something of M taken from it
    is wrong at a smaller M (skipped tiles stay poisoned, rows of another batch are read)."""
    make, variables, _, cfg = CASES[name]
    spec = make()
    dims = varying(spec, variables)
    program = FAMILY.generate_bucketed(spec, cfg, dims)
    assert old in program.source
    bad = dataclasses.replace(program, source=program.source.replace(old, new))
    assert run_validation(FAMILY, spec, bad, tmp_path, seeds=(0,)).ok
    rec = run_validation(FAMILY, B.spec_at(spec, dims, (17,)), B.instantiate(bad, (17,)), tmp_path, seeds=(0,))
    assert not rec.ok and rec.reason


def test_what_cannot_vary_is_refused_with_a_reason():
    spec = spec_of(aten.addmm.default, (rand(24), rand(40, 32), rand(24, 32).t()))
    k = varying(spec, {40: 0, 32: 1})
    assert "K varies" in FAMILY.bucket_support(spec, k)
    assert "N varies" in FAMILY.bucket_support(spec, varying(spec, {40: 0, 24: 1}))
    assert "does not vary with M" in FAMILY.bucket_support(spec, (("in", 1, 0, 0),))   # the output's rows stay 40
    with pytest.raises(ValueError, match="K varies"):
        FAMILY.generate_bucketed(spec, config(), k)
    transposed = spec_of(aten.mm.default, (rand(32, 40).t(), rand(32, 24)))   # A column-major: strides hold M
    assert "not contiguous" in FAMILY.bucket_support(transposed, varying(transposed, {40: 0}))
    bmm = spec_of(aten.bmm.default, (rand(3, 40, 24), rand(3, 24, 20)))
    one = tuple((s, i, d, 0) for s, i, d, _ in varying(bmm, {3: 0, 40: 1}))
    assert "one variable" in FAMILY.bucket_support(bmm, one)
    assert FAMILY.bucket_support(spec_of(aten.mm.default, (rand(8, 8).int(), rand(8, 8).int())), (("in", 0, 0, 0),))
    _, _, groups = groups_of(lambda x, a, b, c: experts(x, a, b, c, (5, 24, 40)), *moe_args()[:4])
    group = region_spec(groups[0], {})
    assert FAMILY.supports(group) is None
    # an MoE group's members read different rows (tokens per expert): not one run-time M
    # (test_kernels_matmul_group_bucket.py covers the groups that are)
    assert "does not vary with M" in FAMILY.bucket_support(group, (("in", 0, 0, 0),))


def test_a_bucketed_kernel_compiles_for_sm90(tmp_path):
    """bf16 bmm with M and the batch at run time, the ALIGN variant: real GPU code (bundled ptxas),
    built as fill_cache builds it for serving, with no divisibility assumed of M."""
    spec = spec_of(aten.bmm.default, (rand(4, 512, 128, dtype=torch.bfloat16), rand(4, 128, 256, dtype=torch.bfloat16)))
    cfg = FAMILY.seed_configs(spec)[0].replace(ALIGN=True)
    program = FAMILY.generate_bucketed(spec, cfg, varying(spec, {4: 0, 512: 1}))
    assert "arange(0, BLOCK_M).to(tl.int64)" not in program.source
    # the build serving's binaries come from: M = 512 is a multiple of 16, but not every M of the bucket is
    write_program(tmp_path / "bmm", spec, program, "cuda", ("cuda", 90, 32))
    module = import_source(tmp_path / "bmm" / program.source_file, "tk_test_matmul_bucket_sm90")
    (launch,) = program.launches
    names = list(program.signature(launch, spec))
    attrs = ast_source(getattr(module, launch.kernel), launch, program, spec).attrs
    assert (names.index("in0_ptr"),) in attrs and (names.index("M"),) not in attrs
    # offsets are int64 when the upper edge's pass int32 (every smaller M's then fit in them)
    a, b, o = TensorMeta((70000, 40000), (40000, 1), "bfloat16"), TensorMeta((40000, 256), (1, 40000), "bfloat16"), \
        TensorMeta((70000, 256), (256, 1), "bfloat16")
    big = KernelSpec("aten.mm.default", [{"tensor": 0}, {"tensor": 1}], {}, (a, b), (o,))
    program = FAMILY.generate_bucketed(big, FAMILY.seed_configs(big)[0], varying(big, {70000: 0}))
    assert "arange(0, BLOCK_M).to(tl.int64)" in program.source and "ram = rm % M" in program.source
    compile_sm90(big, program, tmp_path)


MODEL = '''
import torch
def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8, bias=False)), \\
        (torch.randn({example}),)
'''
GEMMS = ("aten.addmm.default", "aten.mm.default")


@pytest.mark.parametrize("shape,dynamic,sizes,ranges", [
    # a batch of rows: M is the batch
    (lambda n: (n, 16), "0:0:5-8", (5, 7, 8), {((5, 8),)}),
    # [2, seq, 16] flattened into the GEMMs' rows: M is 2 * seq (fill traces it so, serving as s0 * s1)
    (lambda n: (2, n, 16), "0:1:3-8", (3, 5, 8), {((5, 8),), ((9, 16),)}),
], ids=["batch", "batch-x-seq"])
def test_a_filled_bucket_runs_a_linear_layers_gemms_at_every_size_in_it(shape, dynamic, sizes, ranges, tmp_path,
                                                                        monkeypatch):
    (tmp_path / "model.py").write_text(MODEL.format(example=", ".join(map(str, shape(6)))))
    assert fill_main(["--target", "interpreter", "--cache-dir", str(tmp_path / "cache"), "--quiet", "--budget", "1",
                      "--model", f"{tmp_path / 'model.py'}:make", "--dynamic", dynamic]) == 0
    cache = KernelCache.for_target(tmp_path / "cache", get_target("interpreter"))
    buckets = {e.key: e for e in cache.entries() if e.bucket is not None and e.spec.op in GEMMS}
    for op in GEMMS:
        assert {e.bucket.ranges for e in buckets.values() if e.spec.op == op} == ranges
    assert all(e.winner == "triton" for e in buckets.values())

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8, bias=False))
    opts = Options.resolve({"target": "interpreter", "cache_dir": str(tmp_path / "cache"),
                            "repro_dir": str(tmp_path / "repros"), "graph_cache": "off",
                            "report": str(tmp_path / "report.json")})
    session, graphs = Session(opts), []
    compiled = torch.compile(model, dynamic=True,
                             backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    with torch.no_grad():
        x = torch.randn(shape(sizes[0]))
        torch.testing.assert_close(compiled(x), model(x))   # planned: the buckets' kernels loaded now
        import torch_kernelize.lowering.kernels.matmul as matmul
        import torch_kernelize.serving.launch as launch

        def forbidden(*a, **k):
            raise AssertionError("a new size inside a filled bucket must not read the cache or generate code")
        for owner, name in ((launch, "load_program"), (KernelCache, "_read"), (KernelCache, "keys"),
                            (matmul.MatmulFamily, "generate_bucketed"), (matmul.MatmulFamily, "generate")):
            monkeypatch.setattr(owner, name, forbidden)
        for n in sizes[1:]:
            x = torch.randn(shape(n))
            torch.testing.assert_close(compiled(x), model(x))
    # the report (of the graph's first shape): both GEMMs on triton
    (report,) = json.loads((tmp_path / "report.json").read_text())["graphs"]
    per_op = report["summary"]["per_op"]
    assert all(per_op[op] == {"triton": 1} for op in GEMMS), per_op
    (g,) = graphs
    for n in sizes:
        (spec,) = [s for k, s in g.specializations().items() if n in k]
        gemms = [d for d in spec.decisions if d.op in GEMMS]
        assert len(gemms) == 2
        regions = {d.spec_key: d for d in spec.regions if d.tier == "triton"}
        for d in gemms:
            assert d.tier == "triton", (n, d.reason)
            if d.reason.startswith("in fused region"):  # the GEMM and its ReLU: the region's bucket
                (region,) = [r for key, r in regions.items() if key in d.reason]
                assert region.entry.bucket is not None and "bucket" in region.reason, region.reason
                continue
            assert d.entry.key in buckets and "bucket" in d.reason, (n, d.reason)
            assert B.contains(d.entry.bucket.ranges, (d.spec.outputs[0].shape[0],))
        # [rows, 16]: the first Linear's addmm + ReLU runs fused, from its region's bucket ([2, seq, 16]:
        # views between them keep them apart)
        assert bool(regions) == (len(shape(1)) == 2)
