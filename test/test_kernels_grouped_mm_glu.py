"""Gated experts (compiling/glu_regions.py, lowering/kernels/grouped_mm_glu.py) on the Triton
interpreter: the region found in traced experts code of transformers' forms (SiLU through fp32
casts, the masked rows of no expert, chunk or split), refused where a half escapes or the
product is not cut in halves; the kernel validated against the float64 reference and compared
with the nodes run by ATen, both variants; a broken epilogue fails; buckets over S; sm_90 compiles."""
from __future__ import annotations

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kernel_testing import assert_bucket_valid, assert_mutant_fails, assert_valid, compare_eager, compile_sm90
from test_kernels_grouped_mm import _op
from torch_kernelize.compiling.decompositions import trace_decompositions
from torch_kernelize.compiling.glu_regions import KIND, find_glu_regions, halve_products
from torch_kernelize.compiling.regions import region_spec
from torch_kernelize.core.input_domains import requirements
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.grouped_mm_glu import FAMILY

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


def _experts(form: str):
    """transformers' experts up to the down projection (integrations/moe.py), in its forms."""
    op = _op()

    def experts(x, w, offs, mask):
        if form == "aten":  # transformers' bfloat16 experts: torch's grouped GEMM, offs by keyword
            gu = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        else:
            gu = op(x, w.transpose(1, 2), offs)             # weight [E, 2I, K], passed transposed
        if form == "masked":  # transformers 5.17: the rows of no expert zeroed (masked_fill)
            gu = gu.masked_fill(mask, 0.0)
        gate, up = gu.chunk(2, dim=-1) if form == "chunk" else gu.split([gu.size(1) // 2] * 2, dim=-1)
        if form == "gelu":
            return torch.nn.functional.gelu(gate, approximate="tanh") * up
        if form == "escapes":   # the gate is also returned: a second output
            return torch.nn.functional.silu(gate) * up, gate
        # SiLU as ATen's decomposition leaves it for 16-bit floats: in fp32, rounded back
        act = gate.float() * torch.sigmoid(gate.float())
        return act.to(gate.dtype) * up
    return experts


def _inputs(S=40, K=24, I=20, E=5, dtype=F32, offs=(8, 8, 21, 33, 36), device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S, K, generator=g).to(dtype)
    w = (torch.randn(E, 2 * I, K, generator=g) / K ** 0.5).to(dtype)
    o = torch.tensor(offs[:E], dtype=torch.int32)
    mask = (torch.arange(S) >= o[-1]).unsqueeze(-1)
    return tuple(t.to(device) for t in (x, w, o, mask))


def _trace(fn, inputs):
    """``fn`` as the backend traces and plans it: torch's core decompositions (masked_fill as
    where), the product's split in halves as two slices."""
    gm = make_fx(fn, decomposition_table=trace_decompositions(), tracing_mode="fake")(*inputs)
    halve_products(gm.graph)
    gm.recompile()
    return gm


def _region(form="silu", **kw):
    inputs = _inputs(**kw)
    gm = _trace(_experts(form), inputs)
    return gm, find_glu_regions(gm), inputs


@pytest.mark.parametrize("form", ["silu", "chunk", "masked", "gelu", "aten"])
def test_the_region_holds_the_gemm_and_its_gated_activation(form):
    gm, regions, _ = _region(form, dtype=BF16 if form == "aten" else F16)  # (_grouped_mm traces bf16 alone)
    (r,) = regions
    assert r.kind == KIND and r.nodes[0].target is (torch.ops.aten._grouped_mm.default if form == "aten" else _op())
    assert [n.target for n in r.outputs] == [torch.ops.aten.mul.Tensor]
    assert r.inputs[1].target is torch.ops.aten.permute.default   # the weight's transposed view
    # every node but the inputs' (the view; in the masked form the scalar 0) is the region's
    assert {n for n in gm.graph.nodes if n.op == "call_function"} - set(r.inputs) == set(r.nodes)
    if form == "masked":
        assert [n.target for n in r.inputs[3:]] == ["mask_1", torch.ops.aten.scalar_tensor.default]


def test_a_half_read_elsewhere_or_an_unsplit_product_is_no_region():
    assert find_glu_regions(_trace(_experts("escapes"), _inputs())) == []

    def unsplit(x, w, offs, mask):
        return torch.sigmoid(_op()(x, w.transpose(1, 2), offs))
    assert find_glu_regions(_trace(unsplit, _inputs())) == []


def _spec(form="silu", **kw):
    gm, (r,), inputs = _region(form, **kw)
    spec = region_spec(r, {})
    by_node = {n: t for n, t in zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs)}
    return spec, [by_node[n] if n in by_node else None for n in r.inputs], inputs


def test_validation_draws_the_offsets_as_the_op_does():
    spec, *_ = _spec()
    assert requirements(spec) == {2: "offs: each group's end, non-decreasing in [0, input.size(0)]"}


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("form,dtype", [("silu", F32), ("silu", F16), ("masked", F16), ("chunk", F32),
                                        ("gelu", F32), ("aten", BF16)], ids=str)
def test_the_kernel_validates_and_matches_the_nodes(form, dtype, tma, tmp_path):
    # (aten._grouped_mm leaves rows of no expert unwritten: eager is compared with every row routed)
    spec, *_ = _spec(form, dtype=dtype, **({"offs": (8, 8, 21, 33, 40)} if form == "aten" else {}))
    assert family_for(spec) is FAMILY, FAMILY.supports(spec)
    # (the interpreter computes bf16 dots wrongly: its tiles upcast first, DOT_UPCAST)
    config = next(c for c in FAMILY.seed_configs(spec) if bool(c["TMA"]) == tma
                  and c["DOT_UPCAST"] == (dtype == BF16))
    program = assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,), eager=False)
    assert program.source.count("tl.dot(") == 2 and ("tl.make_tensor_descriptor(" in program.source) == tma
    # the epilogue's sigmoid divides approximately (elementwise.EPILOGUE_HELPERS); a mask of rows is
    # loaded once, one value a row, for both halves
    assert "tl.div_rn" not in program.source
    if form == "masked":
        assert program.source.count("x3 = tl.load(in3_ptr + rows[:, None] * 1, mask=(rows < ") == 1, program.source
    compare_eager(FAMILY, spec, program, tmp_path)


def test_every_seed_and_its_neighbours_generate(tmp_path):
    spec, *_ = _spec(dtype=F16)
    for config in FAMILY.seed_configs(spec):
        assert config["BLOCK_N"] <= 32   # (I = 20: the half's columns cap the tile)
        FAMILY.generate(spec, config)
        for n in FAMILY.neighbours(spec, config):
            FAMILY.generate(spec, n)


def test_rows_of_no_expert_and_empty_experts(tmp_path):
    spec, *_ = _spec("masked", dtype=F16, S=70, offs=(0, 0, 17, 17, 50))
    program = assert_valid(FAMILY, spec, tmp_path, seeds=(0, 1))
    compare_eager(FAMILY, spec, program, tmp_path, seed=7)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_a_broken_epilogue_fails_validation(tma, tmp_path):
    spec, *_ = _spec(dtype=F16)
    config = next(c for c in FAMILY.seed_configs(spec) if bool(c["TMA"]) == tma)
    program = FAMILY.generate(spec, config)
    # the up half read from the gate's columns
    old = "acc2 = tl.dot(a, b.T, acc2" if tma else "b = tl.load(b_ptrs + 480"   # (I 20 columns of stride K 24)
    new = "acc2 = tl.dot(a, b.T, acc2 * 0 + acc" if tma else "b = tl.load(b_ptrs + 0"
    assert_mutant_fails(FAMILY, spec, program, old, new, tmp_path)


def test_refusals():
    import dataclasses
    spec, *_ = _spec()
    out = spec.outputs[0]
    wrong = dataclasses.replace(out, dtype="float16")
    assert "is not one half" in FAMILY.supports(dataclasses.replace(spec, outputs=(wrong,)))
    assert "takes grouped_mm_glu regions" in FAMILY.supports(dataclasses.replace(spec, graph='{"kind": "matmul"}'))


def test_a_bucket_over_the_routed_rows(tmp_path):
    """One binary serves every S of a bucket (the mask's rows vary with it)."""
    spec, *_ = _spec("masked", dtype=F16, S=48, offs=(8, 8, 21, 33, 40))
    nodes = json.loads(spec.graph)["nodes"]
    # the rows of every value vary, the gate's and up's slices too (rows of fixed strides, not contiguous)
    dims = [("in", 0, 0, 0), ("out", 0, 0, 0), ("in", 3, 0, 0)] + [("node", j, 0, 0) for j in range(len(nodes))]
    assert [n["meta"]["stride"] for n in nodes if n["op"] == "aten.slice.Tensor"] == [[40, 1], [40, 1]]
    assert "dim 1 varies" in FAMILY.bucket_support(spec, dims + [("in", 0, 1, 0)])
    program = assert_bucket_valid(FAMILY, spec, dims, [(33, 48)], tmp_path)
    assert "S, BLOCK_M" in program.source


def test_sm90_compiles_every_seed_at_mixtrals_size_and_all_but_the_first_spill_nothing(tmp_path):
    """The first TMA seed (a 128x128 pair, as much as grouped_mm's 128x256 tile) spills with the
    epilogue: 255 registers and 376 bytes of stack a thread when this was written. Every other seed
    must fit in registers (GLU_TMA_SEEDS), read off the cubin with cuobjdump."""
    import triton
    from pathlib import Path
    spec, *_ = _spec("masked", dtype=F16, S=8192, K=2048, I=5632, E=8, offs=tuple(1024 * (e + 1) for e in range(8)))
    seeds = FAMILY.seed_configs(spec)
    assert [c["TMA"] for c in seeds[:2]] == [True, True]
    usage = [compile_sm90(spec, FAMILY.generate(spec, config), tmp_path) for config in seeds]
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton ships no cuobjdump: the seeds compiled, their registers unread")
    assert all(u[0]["STACK"] == 0 and u[0]["REG"] <= 255 for u in usage[1:]), usage


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_every_seed_validates_through_the_ahead_of_time_path(tmp_path):
    """On the GPU, at a quarter of Mixtral's suite size in fp16, masked as transformers 5.17 does:
    each seed compiled ahead of time (write_program + load_program, as the fill stores it)
    validates against float64 on the device."""
    from torch_kernelize.building.programs import write_program
    from torch_kernelize.core.validate import validate
    from torch_kernelize.serving.launch import load_program
    spec, *_ = _spec("masked", dtype=F16, S=2048, K=1024, I=1408, E=8,
                     offs=(300, 512, 512, 1100, 1400, 1700, 2000, 2040), device="cuda")
    assert FAMILY.supports(spec) is None
    for i, config in enumerate(FAMILY.seed_configs(spec)):
        write_program(tmp_path / f"p{i}", spec, FAMILY.generate(spec, config), "cuda")
        runner = load_program(tmp_path / f"p{i}", spec, "cuda")
        rec = validate(runner.run_poisoned, spec, FAMILY.sample_inputs, FAMILY.edge_kinds, device="cuda")
        assert rec.ok, f"[{config}]: {rec.reason}"


def test_transformers_mixtral_is_served_by_the_regions_kernel_once_filled(tmp_path):
    """transformers' tiny Mixtral, its quick fill, then served: each layer's experts run the
    region's kernel (its gate/up product never stored), outputs as eager's."""
    pytest.importorskip("transformers")
    from torch_kernelize import model_zoo
    from torch_kernelize.backend import compile_with_session
    from torch_kernelize.compiling.lower import Session
    from torch_kernelize.core.options import Options
    from torch_kernelize.fill_cache import cli
    ref, cache = "torch_kernelize.model_zoo:make_hf_mixtral", tmp_path / "cache"
    assert cli.main(["--quiet", "--target", "interpreter", "--model", ref, "--cache-dir", str(cache), "--budget", "1"]) == 0
    model, inputs = model_zoo.make_hf_mixtral()
    session, graphs = Session(Options.resolve({"target": "interpreter", "cache_dir": str(cache), "repro_dir": "off",
                                               "graph_cache": "off"})), []
    compiled = torch.compile(model, backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs).logits, model(*inputs).logits)
    (graph,) = graphs
    (spec,) = graph.specializations().values()
    served = [d for d in spec.regions if d.tier == "triton" and d.entry is not None and d.entry.family == FAMILY.name]
    assert len(served) == 2   # (two layers)
