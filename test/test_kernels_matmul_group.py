"""Horizontal groups of GEMMs (matmul_group regions): formation on real graphs (make_fx + core
decompositions + find_regions + group_matmuls), the family's checks, and the grouped kernel on the
Triton interpreter against the float64 reference."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from kernel_testing import assert_valid, compile_sm90
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.matmul import FAMILY
from torch_kernelize.compiling.regions import closes_cycle, find_regions, group_matmuls, region_spec
from torch_kernelize.core.targets import get_target

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf/NaN edge trials

F16 = torch.float16


def experts(x, w1, w3, w2, ends):
    """An MoE's expert loop (fixed routing): rows [start, end) of x go through expert e."""
    out, start = [], 0
    for e, end in enumerate(ends):
        h = x[start:end]
        h = F.silu(h @ w1[e].t()) * (h @ w3[e].t())
        out.append(h @ w2[e].t())
        start = end
    return torch.cat(out)


def groups_of(fn, *args):
    gm = make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*args)
    target = get_target("interpreter")
    regions = find_regions(gm, target)
    return gm, regions, group_matmuls(gm, regions, target)


def moe_args(ends=(5, 24, 40), d=32, f=16, dtype=torch.float32):
    E = len(ends)
    return (torch.randn(ends[-1], d, dtype=dtype), torch.randn(E, f, d, dtype=dtype) * 0.2,
            torch.randn(E, f, d, dtype=dtype) * 0.2, torch.randn(E, d, f, dtype=dtype) * 0.2, ends)


def test_expert_loop_forms_one_group_per_gemm_kind():
    _, regions, groups = groups_of(lambda x, a, b, c: experts(x, a, b, c, (5, 24, 40)), *moe_args()[:4])
    # per expert: mm(h, w1) -> silu -> mul(., mm(h, w3)) is a region, mm(h, w3) and mm(., w2) are lone mms
    assert len(groups) == 3
    for g in groups:
        assert g.kind == "matmul_group" and len(g.members) == 3
        assert set(g.nodes) == {n for m in g.members for n in m}
    covered = {n for g in groups for n in g.nodes}
    assert {n for r in regions if r.kind == "matmul" for n in r.nodes} <= covered


def test_dependent_gemms_are_not_grouped():
    """A chain x @ w0 @ w1 @ w2 has three GEMMs of one structure, each reading the previous one."""
    def chain(x, w):
        for i in range(3):
            x = x @ w[i]
        return x
    _, _, groups = groups_of(chain, torch.randn(8, 16), torch.randn(3, 16, 16))
    assert groups == []


def test_two_groups_feeding_each_other_close_a_cycle():
    """X = {xa, xd}, Y = {yb, yc}: yb reads xa and xd reads yc. Each group is independent inside,
    but fused together they would wait for each other: the second one fused is refused."""
    from torch_kernelize.model_zoo import make_crossed
    model, inputs = make_crossed()
    _, regions, groups = groups_of(lambda x, z, w, v: torch.func.functional_call(model, {"w": w, "v": v}, (x, z)),
                                   *inputs, model.w.detach(), model.v.detach())
    assert len(groups) == 2
    assert not closes_cycle(groups[0], []) and not closes_cycle(groups[1], [])
    assert closes_cycle(groups[1], [groups[0]]) and closes_cycle(groups[0], [groups[1]])


def test_qkv_projections_group_with_the_same_rows():
    def qkv(x, wq, wk, wv):
        return x @ wq.t(), x @ wk.t(), x @ wv.t()
    _, _, groups = groups_of(qkv, torch.randn(24, 32), *[torch.randn(16, 32) for _ in range(3)])
    assert len(groups) == 1 and len(groups[0].members) == 3


@pytest.mark.parametrize("dtype", [torch.float32, F16], ids=str)
def test_grouped_kernel_matches_float64(dtype, tmp_path):
    """Members of 5, 19 and 16 rows (masked tile edges), an epilogue with an extra input."""
    args = moe_args(dtype=dtype)
    gm, _, groups = groups_of(lambda x, a, b, c: experts(x, a, b, c, args[4]), *args[:4])
    specs = [region_spec(g, {}) for g in groups]
    assert all(family_for(s) is FAMILY for s in specs)
    for spec in specs:
        config = FAMILY.seed_configs(spec)[0]
        program = assert_valid(FAMILY, spec, tmp_path, config.replace(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16))
        launch = program.launches[0]
        assert launch.kernel == "region_group_mm_kernel"
        # one program per tile of every member: 1 + 2 + 1 row blocks of 16
        n = spec.outputs[0].shape[1]
        assert launch.grid == (4 * -(-n // 16),)


def test_group_seeds_count_every_members_tiles():
    args = moe_args(ends=(1000, 2013, 3047, 4000), d=1024, f=512, dtype=F16)
    gm = make_fx(lambda x, a, b, c: experts(x, a, b, c, args[4]), decomposition_table=core_aten_decompositions(),
                 tracing_mode="fake")(*args[:4])
    target = get_target("interpreter")
    spec = region_spec(group_matmuls(gm, find_regions(gm, target), target)[0], {})
    seeds = FAMILY.seed_configs(spec)
    assert not any(c.get("ALIGN") for c in seeds)      # pointers are selected at run time
    # 4 members of ~1000 rows x 512 columns: 128 tiles of 128x128 fill the GPU, no smaller seed
    assert (64, 64) not in {(c["BLOCK_M"], c["BLOCK_N"]) for c in seeds}


def test_family_refuses_members_that_differ_beyond_m():
    """The family, not the formation heuristic, is the authority: members that are not one GEMM
    each, GEMMs of different N, or a single member are refused with the reason."""
    from torch_kernelize.compiling.regions import Region
    args = moe_args()
    _, _, groups = groups_of(lambda x, a, b, c: experts(x, a, b, c, args[4]), *args[:4])
    spec = region_spec(groups[0], {})

    def regraph(members):
        graph = dict(json.loads(spec.graph), members=members)
        return dataclasses.replace(spec, graph=json.dumps(graph, sort_keys=True, separators=(",", ":")))
    members = json.loads(spec.graph)["members"]
    assert "not a pointwise op" in FAMILY.supports(regraph([members[0] + members[1]] + members[2:]))
    assert "two members" in FAMILY.supports(regraph(members[:1]))
    # two lone mms of different N, grouped by hand
    gm = make_fx(lambda x, w, v: (x @ w, x @ v), tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 32),
                                                                      torch.randn(16, 24))
    mms = [n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default]
    inputs = list(dict.fromkeys(a for n in mms for a in n.args))
    odd = region_spec(Region("matmul_group", mms, inputs, mms, [[n] for n in mms]), {})
    assert "differs from member" in FAMILY.supports(odd)


def test_grouped_kernel_compiles_for_sm90(tmp_path):
    args = moe_args(ends=(100, 300, 301, 512), d=64, f=32, dtype=F16)
    gm, _, groups = groups_of(lambda x, a, b, c: experts(x, a, b, c, args[4]), *args[:4])
    for g in groups:
        spec = region_spec(g, {})
        compile_sm90(spec, FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]), tmp_path)


def test_fill_then_serve_runs_the_groups_fused(tmp_path):
    """fill_cache stores the groups (and their members); a fresh process then runs each group as
    one launch, with the eager result."""
    from test_fill_cache import MODELS, compile_in_fresh_process, fill_cache
    cache = tmp_path / "cache"
    fill_cache("--model", f"{MODELS}:make_experts", "--target", "interpreter", "--cache-dir", str(cache), "--budget", "1")
    summary = json.loads(sorted(cache.glob("*/runs/*.json"))[-1].read_text())
    statuses = [r["status"] for r in summary["specs"]]
    # the three groups are searched; their member regions and nodes are not (the groups hold them)
    assert statuses.count("stored") == 3 and set(statuses) == {"stored", "in a fused region"}, statuses
    res, _ = compile_in_fresh_process(tmp_path, cache, fn="make_experts")
    assert res["err"] < 1e-4
    doc = json.loads((tmp_path / "report.json").read_text())
    regions = [r for g in doc["graphs"] for r in g["regions"]]
    groups = [r for r in regions if "matmul_group" in r["shapes"]]
    assert len(groups) == 3 and all(r["tier"] == "triton" for r in groups), regions
    # the members were covered: not looked up on their own
    assert not [r for r in regions if "matmul_group" not in r["shapes"]], regions
    assert all(n["tier"] == "triton" for g in doc["graphs"] for n in g["nodes"] if n["op"] == "aten.mm.default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_grouped_kernels_validate(tmp_path):
    """On the GPU: every seed of each group (one member of a single row) validates, through
    Triton's JIT and through the project's ahead-of-time CUDA path."""
    from kernel_testing import jit_runner
    from torch_kernelize.building.programs import write_program
    from torch_kernelize.serving.launch import load_program
    from torch_kernelize.core.validate import validate
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in moe_args(ends=(100, 300, 301, 812), d=256, f=128, dtype=F16)]
    _, _, groups = groups_of(lambda x, a, b, c: experts(x, a, b, c, args[4]), *args[:4])
    assert len(groups) == 3
    for i, g in enumerate(groups):
        spec = region_spec(g, {})
        for config in FAMILY.seed_configs(spec):
            program = FAMILY.generate(spec, config)
            rec = validate(jit_runner(tmp_path, spec, program).run_poisoned, spec, FAMILY.sample_inputs,
                           FAMILY.edge_kinds, device="cuda", magnitudes=FAMILY.term_magnitudes)
            assert rec.ok, f"[{config}]: {rec.reason}\n{program.source}"
        write_program(tmp_path / f"aot{i}", spec, program, "cuda")
        runner = load_program(tmp_path / f"aot{i}", spec, "cuda")
        rec = validate(runner.run_poisoned, spec, FAMILY.sample_inputs, FAMILY.edge_kinds, device="cuda",
                       magnitudes=FAMILY.term_magnitudes)
        assert rec.ok, rec.reason


def test_serving_two_crossed_groups_fuses_one(tmp_path):
    """Serving fuses the first group and runs the other's members on their own (that group would
    wait for the first): fill_cache does not search it, and serving does not look it up."""
    from test_fill_cache import MODELS, compile_in_fresh_process, fill_cache
    cache = tmp_path / "cache"
    fill_cache("--model", f"{MODELS}:make_crossed", "--target", "interpreter", "--cache-dir", str(cache), "--budget", "1")
    res, _ = compile_in_fresh_process(tmp_path, cache, fn="make_crossed")
    assert res["err"] < 1e-4
    doc = json.loads((tmp_path / "report.json").read_text())
    groups = [r for g in doc["graphs"] for r in g["regions"] if "matmul_group" in r["shapes"]]
    assert sorted(r["tier"] for r in groups) == ["triton", "vendor"], groups
    assert any("wait for its own outputs" in r["reason"] for r in groups), groups
