"""The grouped_mm family (transformers' MoE expert matmul) on the Triton interpreter: offsets drawn
by the op's input domain, validated against the float64 reference and compared with the op's own
loop; empty experts, rows of no expert, a transposed weight view, the dtypes; refusals; a broken
program fails; sm_90 compiles."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import assert_mutant_fails, assert_valid, compare_eager, compile_sm90, spec_of
from torch_kernelize.core.input_domains import constrain, requirements
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.grouped_mm import FAMILY

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _op():
    """transformers' op where transformers is installed; else one of the same name, schema and loop
    (transformers/integrations/moe.py), so that the family is tested without it."""
    try:
        import transformers.integrations.moe  # noqa: F401 - registers transformers::grouped_mm_fallback
    except Exception:
        pass
    if not hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        def loop(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            output = torch.zeros(input.size(0), weight.size(2), device=input.device, dtype=input.dtype)
            start = 0
            for i, end in enumerate(offs.tolist()):
                if start != end:
                    torch.mm(input[start:end], weight[i], out=output[start:end])
                start = end
            return output
        torch.library.custom_op("transformers::grouped_mm_fallback", loop, mutates_args=(),
                                schema="(Tensor input, Tensor weight, Tensor offs) -> Tensor")
        torch.library.register_fake("transformers::grouped_mm_fallback",
                                    lambda input, weight, offs: input.new_empty(input.size(0), weight.size(2)))
    return torch.ops.transformers.grouped_mm_fallback.default


def _spec(S=40, K=24, N=36, E=5, dtype=F32, offs=None, transposed=False, offs_dtype=torch.int64):
    x = torch.randn(S, K, dtype=dtype)
    w = torch.randn(E, N, K, dtype=dtype).transpose(1, 2) if transposed else torch.randn(E, K, N, dtype=dtype)
    o = torch.tensor(offs if offs is not None else [8, 8, 21, 33, S][:E], dtype=offs_dtype)
    return spec_of(_op(), (x, w, o)), (x, w, o)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_every_seed_config_validates(dtype, tmp_path):
    spec, _ = _spec(dtype=dtype)
    assert family_for(spec) is FAMILY
    for config in FAMILY.seed_configs(spec):
        if dtype == BF16 and not config["DOT_UPCAST"]:  # the interpreter's bf16 dots are wrong; the GPU judges it
            FAMILY.generate(spec, config)
            continue
        assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,), eager=False)
        for n in FAMILY.neighbours(spec, config):
            FAMILY.generate(spec, n)


def _first_seed(spec, tma: bool):
    """The first seed of the pointer kernel, or of the TMA variant (module docstring)."""
    return next(c for c in FAMILY.seed_configs(spec) if bool(c["TMA"]) == tma)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("case", ["empty experts", "rows of no expert", "transposed weight", "int32 offsets",
                                  "one expert", "rows span many tiles", "blocks divide K and N"])
def test_matches_the_ops_own_loop(case, tma, tmp_path):
    """Exactly the loop's outputs in fp32 up to summation order, on the given offsets, from both
    kernels (the TMA variant's descriptors take the weight as [E, K, N] and, transposed, [E, N, K])."""
    kwargs = {"empty experts": dict(offs=[0, 0, 17, 17, 40]),
              "rows of no expert": dict(offs=[5, 9, 12, 20, 29]),      # rows 29.. stay zero
              "transposed weight": dict(transposed=True),              # transformers passes a view
              "int32 offsets": dict(offs_dtype=torch.int32),
              "one expert": dict(E=1, offs=[40]),
              "rows span many tiles": dict(S=150, offs=[1, 70, 71, 149, 150]),
              "blocks divide K and N": dict(K=64, N=128)}[case]       # (no K or column masks)
    spec, inputs = _spec(**kwargs)
    program = assert_valid(FAMILY, spec, tmp_path, _first_seed(spec, tma), seeds=(0,), eager=False)
    assert ("tl.make_tensor_descriptor(" in program.source) == tma
    compare_eager(FAMILY, spec, program, tmp_path, inputs=list(inputs))


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_atens_grouped_mm_is_served_by_the_same_kernels(dtype, tmp_path):
    """``aten._grouped_mm(self, mat2, offs=...)`` (transformers' bfloat16 experts) goes to this
    family; its float64 reference (the op takes no float64) is the experts' products with zeros
    past the last offset, which the op leaves unwritten. Eager is compared where every row is
    some expert's."""
    from torch_kernelize.core.float64_references import float64_reference
    aten_op = torch.ops.aten._grouped_mm.default
    x, w = torch.randn(40, 24, dtype=dtype), torch.randn(5, 36, 24, dtype=dtype).transpose(1, 2)
    for ends in ([8, 8, 21, 33, 40], [5, 9, 12, 20, 29]):
        offs = torch.tensor(ends, dtype=torch.int32)
        spec = spec_of(aten_op, (x, w), {"offs": offs})
        assert family_for(spec) is FAMILY and requirements(spec) == {
            2: "offs: each group's end, non-decreasing in [0, self.size(0)]"}
        (ref,) = spec.reference([x, w, offs])
        loop = torch.zeros(40, 36, dtype=torch.float64)
        for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
            loop[start:end] = x[start:end].double() @ w[e].double()
        torch.testing.assert_close(ref, loop)
        for tma in (False, True):
            program = assert_valid(FAMILY, spec, tmp_path, _first_seed(spec, tma), seeds=(0, 1), eager=False)
            if ends[-1] == 40:
                compare_eager(FAMILY, spec, program, tmp_path, inputs=[x, w, offs])
    assert float64_reference(aten_op, [x, w]) is None  # (it runs as it is where it can)
    with pytest.raises(ValueError, match="bias"):
        float64_reference(aten_op, [x.double()])(x.double(), w.double(), offs, torch.zeros(36))


def test_the_offsets_are_drawn_as_the_op_requires():
    """Validation draws offs as each group's end, non-decreasing within the rows (core/input_domains.py)."""
    spec, _ = _spec(S=40, E=5)
    assert requirements(spec) == {2: "offs: each group's end, non-decreasing in [0, input.size(0)]"}
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        offs = constrain(spec, [torch.randn(40, 24), torch.randn(5, 24, 36), torch.randint(-8, 9, (5,))], g)[2]
        assert bool((offs.diff() >= 0).all()) and 0 <= int(offs[0]) and int(offs[-1]) <= 40


def test_refusals():
    import dataclasses
    spec, _ = _spec()
    a, w, offs = spec.inputs
    as_type = lambda meta, dtype: dataclasses.replace(meta, dtype=dtype)  # noqa: E731
    assert "an integer tensor" in FAMILY.supports(dataclasses.replace(spec, inputs=(a, w, as_type(offs, "float32"))))
    assert "one float dtype" in FAMILY.supports(dataclasses.replace(spec, inputs=(as_type(a, "float16"), w, offs)))
    assert "sizes do not match" in FAMILY.supports(dataclasses.replace(spec, inputs=(a, w, offs), outputs=(w,)))


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_a_broken_program_fails_validation(tma, tmp_path):
    spec, _ = _spec()
    program = FAMILY.generate(spec, _first_seed(spec, tma))
    # a program that takes every expert's rows from the first expert's start
    assert_mutant_fails(FAMILY, spec, program, "before = tl.sum(tl.where(e < expert, tiles, 0), 0)",
                        "before = 0 * expert", tmp_path)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_a_program_that_leaves_rows_of_no_expert_unwritten_fails(tma, tmp_path):
    """The output is not zero-filled first: the spare slots (the TMA variant: every program, after
    the experts' tiles) zero [last end, S), and validation's poisoned outputs catch a tail left as
    it was (half the drawn offsets end below S)."""
    spec, _ = _spec()
    program = FAMILY.generate(spec, _first_seed(spec, tma))
    assert program.output_init == ()
    assert_mutant_fails(FAMILY, spec, program, "last = tl.max(ends, 0)", "last = tl.max(ends, 0) + BLOCK_M", tmp_path)


def test_a_tma_tile_past_k_reads_zeros_not_the_next_experts_weights(tmp_path):
    """K = 24 in tiles of 32: a descriptor over the experts end to end would read the next
    expert's first rows into the tile's last 8, and the input's zeros times an inf there are NaN
    (validation's special trial). One expert per block keeps them zeros."""
    spec, _ = _spec()
    program = FAMILY.generate(spec, _first_seed(spec, True).replace(BLOCK_K=32))
    assert "block_shape=[1, BLOCK_K, BLOCK_N]" in program.source
    flat = f"shape=[{5 * 24}, 36], strides=[36, 1], block_shape=[BLOCK_K, BLOCK_N]"
    mutant = program.source.replace("shape=[5, 24, 36], strides=[864, 36, 1], block_shape=[1, BLOCK_K, BLOCK_N]", flat)
    mutant = mutant.replace("b_desc.load([expert, k0, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)",
                            "b_desc.load([expert * 24 + k0, pid_n * BLOCK_N])")
    assert mutant.count(flat) == 1 and "expert * 24 + k0" in mutant
    assert_mutant_fails(FAMILY, spec, program, program.source, mutant, tmp_path)


def test_the_tma_variant_is_offered_where_its_layout_rules_hold_and_builds_no_unaligned_binary(tmp_path):
    """TMA wants a contiguous last dimension and 16-byte strides: fp16 [E, K, N] weights with N = 36
    (72-byte rows) get the pointer kernel alone; transformers' transposed view with K = 24 (48-byte
    rows) gets TMA as the first seed (the quick fill's, since it won on the H100). Tensor descriptors need aligned bases whatever the binary assumed,
    so no binary for unaligned views is compiled (the runner sends those calls to the vendor op)."""
    from torch_kernelize.building.triton_compile import compile_launches
    plain, _ = _spec(dtype=F16)
    assert not any(c["TMA"] for c in FAMILY.seed_configs(plain))
    transposed, _ = _spec(dtype=F16, transposed=True)
    seeds = FAMILY.seed_configs(transposed)
    tma = seeds[0]
    assert tma["TMA"] and tma["PROGRAMS"] >= 1 and not seeds[1]["TMA"]
    assert any(not n["TMA"] for n in FAMILY.neighbours(transposed, tma))   # the search can step back
    big, _ = _spec(S=600, N=600, dtype=F16, transposed=True)   # a descriptor's block is 256 at most
    tma_seed = _first_seed(big, True)
    assert tma_seed["BLOCK_N"] == 256
    assert not any(n["TMA"] and n["BLOCK_N"] == 512 for n in FAMILY.neighbours(big, tma_seed))
    assert any(n["BLOCK_N"] == 512 and not n["TMA"] for n in FAMILY.neighbours(big, _first_seed(big, False)))
    with pytest.raises(ValueError, match="invalid config"):
        FAMILY.generate(big, tma_seed.replace(BLOCK_N=512))
    program = FAMILY.generate(transposed, tma)
    assert program.aligned_only and program.launches[0].grid == (tma["PROGRAMS"],)
    assert not FAMILY.generate(transposed, _first_seed(transposed, False)).aligned_only
    with pytest.raises(ValueError, match="aligned pointers only"):
        compile_launches(tmp_path, transposed, program, ("cuda", 90, 32), aligned=False)


def test_the_spare_slots_always_cover_the_rows_of_no_expert():
    """The bound the kernel's tail zeroing rests on: for ends non-decreasing in [0, S], the experts'
    tiles and the tail's fit in cdiv(S, BM) + E slots (so no spare slot strides twice)."""
    g = torch.Generator().manual_seed(0)
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    for _ in range(3000):
        S, E, BM = int(torch.randint(1, 600, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g)), \
            int(2 ** torch.randint(4, 9, (1,), generator=g))
        ends = sorted(torch.randint(0, S + 1, (E,), generator=g).tolist())
        if torch.rand(1, generator=g) < 0.3:
            ends[-1] = S
        rows = [b - a for a, b in zip([0] + ends[:-1], ends)]
        assert sum(cdiv(r, BM) for r in rows) + cdiv(S - ends[-1], BM) <= cdiv(S, BM) + E, (S, E, BM, ends)


def test_compiles_for_sm90(tmp_path):
    """At Mixtral's gate_up size in the suite (metas only: nothing that large runs here)."""
    import dataclasses
    from torch_kernelize.core.spec import TensorMeta
    small, _ = _spec(E=4, offs=[8, 8, 21, 40], dtype=F16)
    S, K, N, E = 8192, 2048, 11264, 8
    meta = lambda shape, stride, dtype="float16": TensorMeta(shape, stride, dtype, "cpu")  # noqa: E731
    spec = dataclasses.replace(small, inputs=(meta((S, K), (K, 1)), meta((E, K, N), (K * N, 1, K)),
                                              meta((E,), (1,), "int64")), outputs=(meta((S, N), (N, 1)),))
    assert FAMILY.supports(spec) is None
    for config in FAMILY.seed_configs(spec):
        compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)


def test_the_op_is_computed_by_a_kernel_where_one_is_stored_and_otherwise_runs_as_given():
    """transformers' op is another library's: it used to pass through untouched. A family repeats
    it, so it is compute (a cached kernel serves it: no host sync), its vendor rung runs it as given
    even on a chip whose op list lacks it, and whole-graph programs still stop at it (Inductor's
    would call it as given, syncs and all)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.compiling.op_classes import NodeClass, classify
    from torch_kernelize.compiling.planner import plan_graph
    from torch_kernelize.compiling.whole_graph import _breaks
    from torch_kernelize.core.targets import Target
    op = _op()
    _, (x, w, offs) = _spec()
    gm = make_fx(lambda x, w, offs: op(x, w, offs) * 2)(x, w, offs)
    node = next(n for n in gm.graph.nodes if n.target is op)
    assert classify(node) == (NodeClass.COMPUTE, "")
    assert "served between programs" in _breaks(node)
    chip = Target("gemm-chip", device="cpu", triton="interpreter", supported=frozenset(["aten.mm", "aten.mul"]))
    decision = next(d for d in plan_graph(gm, chip).decide({}, None) if d.op == "transformers.grouped_mm_fallback.default")
    assert decision.tier == "vendor" and decision.family == "grouped_mm"  # a miss the fill can fill


def test_every_other_librarys_op_the_planner_computes_has_a_family_and_a_module_that_registers_it():
    from torch_kernelize.compiling.op_classes import FAMILY_OPS
    from torch_kernelize.core.targets import REGISTERED_BY, resolve_op
    from torch_kernelize.lowering.kernels.registry import FAMILIES
    for op in FAMILY_OPS:
        assert any(op in f.ops for f in FAMILIES), op
        _op()
        assert resolve_op(op) is not None and op in REGISTERED_BY


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_every_seed_validates_through_the_ahead_of_time_path(tmp_path):
    """On the GPU, at a quarter of Mixtral's suite size in fp16: each seed compiled ahead of time
    (write_program + load_program, as the fill stores it) validates against float64 on the device."""
    from torch_kernelize.building.programs import write_program
    from torch_kernelize.core.validate import validate
    from torch_kernelize.serving.launch import load_program
    op = _op()
    x = torch.randn(2048, 1024, device="cuda", dtype=F16)
    w = torch.randn(8, 2816, 1024, device="cuda", dtype=F16).transpose(1, 2)   # transformers' view
    offs = torch.tensor([300, 512, 512, 1100, 1400, 1700, 2000, 2048], device="cuda")
    spec = spec_of(op, (x, w, offs))
    for i, config in enumerate(FAMILY.seed_configs(spec)):
        write_program(tmp_path / f"p{i}", spec, FAMILY.generate(spec, config), "cuda")
        runner = load_program(tmp_path / f"p{i}", spec, "cuda")
        rec = validate(runner.run_poisoned, spec, FAMILY.sample_inputs, FAMILY.edge_kinds, device="cuda")
        assert rec.ok, f"[{config}]: {rec.reason}"
