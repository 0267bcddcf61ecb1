"""Shared helpers for the kernel family tests: build a generated program, load it on the Triton
interpreter, validate it against the float64 reference, compare it with eager ATen, and
(optionally) compile it ahead of time for an H100/H200 (sm_90) to prove it is real GPU code.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any, Sequence

import torch

from torch_kernelize.building.programs import write_program
from torch_kernelize.serving.launch import ProgramRunner, load_program
from torch_kernelize.lowering.kernels.base import Config, KernelFamily
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.validate import ValidationRecord, compare, validate

_counter = itertools.count()


def spec_of(op, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> KernelSpec:
    """A KernelSpec from a real eager call (its output gives the output metas)."""
    kwargs = kwargs or {}
    return KernelSpec.from_call(op, args, kwargs, op(*args, **kwargs))


def load(tmp_path: Path, spec: KernelSpec, program: KernelProgram) -> ProgramRunner:
    d = Path(tmp_path) / f"prog{next(_counter)}"
    write_program(d, spec, program, "interpreter")
    return load_program(d, spec, "interpreter", module_name=f"tk_test_kernels.m{next(_counter)}")


def run_validation(family: KernelFamily, spec: KernelSpec, program: KernelProgram, tmp_path: Path,
                   seeds: Sequence[int] = (0, 1, 2), kinds: Sequence[str] | None = None) -> ValidationRecord:
    runner = load(tmp_path, spec, program)
    return validate(runner.run_poisoned, spec, family.sample_inputs,
                    family.edge_kinds if kinds is None else kinds, seeds=seeds, resolve_ties=family.resolve_ties,
                    magnitudes=family.term_magnitudes)


def assert_mutant_fails(family: KernelFamily, spec: KernelSpec, program: KernelProgram, old: str, new: str,
                        tmp_path: Path, seeds: Sequence[int] = (0,)) -> None:
    """``program`` with ``old`` replaced by ``new`` in its source fails validation: the check
    that a test of the generated code can fail."""
    assert old in program.source, program.source
    bad = dataclasses.replace(program, source=program.source.replace(old, new))
    rec = run_validation(family, spec, bad, tmp_path, seeds=seeds)
    assert not rec.ok and rec.reason


class BenchRows(list):
    """GPU benchmark rows: each printed (JSON) as it comes, all written to ``out`` by ``save``."""

    def add(self, **row: Any) -> None:
        self.append(row)
        print(json.dumps(row), flush=True)

    def save(self, out: str | None) -> list[dict]:
        if out:
            Path(out).write_text(json.dumps(self, indent=1))
        return list(self)


def compare_eager(family: KernelFamily, spec: KernelSpec, program: KernelProgram, tmp_path: Path,
                  seed: int = 123, exact: bool = False, inputs: Sequence[torch.Tensor] | None = None) -> None:
    """Run the program and the eager ATen op on the same inputs; assert they agree."""
    runner = load(tmp_path, spec, program)
    inputs = list(inputs) if inputs is not None else family.sample_inputs(spec, seed, "random", "cpu")
    got = runner.run_poisoned(inputs)
    want = spec.run_vendor(inputs)
    assert len(got) == len(want)
    got = family.resolve_ties(spec, inputs, got, want)   # which of equal elements an index names
    for g, w, m in zip(got, want, spec.outputs):
        assert tuple(g.shape) == tuple(w.shape) and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        assert g.stride() == tuple(m.stride), (g.stride(), m.stride)
        if exact:
            assert torch.equal(g, w) or (g.is_floating_point() and torch.equal(g.isnan(), w.isnan())
                                        and torch.equal(g.nan_to_num(), w.nan_to_num())), \
                f"{spec.describe()}: differs from eager\n got {g}\nwant {w}"
        else:
            c = compare(g, w.to(torch.float64) if w.is_floating_point() else w, spec.op, g.dtype)
            assert c.ok, f"{spec.describe()} vs eager: {c.reason}"


def assert_valid(family: KernelFamily, spec: KernelSpec, tmp_path: Path, config: Config | None = None,
                 seeds: Sequence[int] = (0, 1, 2), eager: bool = True, kinds: Sequence[str] | None = None) -> KernelProgram:
    assert family.supports(spec) is None, family.supports(spec)
    config = config or family.seed_configs(spec)[0]
    program = family.generate(spec, config)
    rec = run_validation(family, spec, program, tmp_path, seeds, kinds)
    assert rec.ok, f"{spec.describe()} [{config}]: {rec.reason}\n{program.source}"
    if eager:
        compare_eager(family, spec, program, tmp_path)
    return program


def assert_bucket_valid(family: KernelFamily, spec: KernelSpec, dims: Sequence[tuple[str, int, int, int]],
                        ranges: Sequence[tuple[int, int]], tmp_path: Path, config: Config | None = None,
                        seeds: Sequence[int] = (0,)) -> KernelProgram:
    """The bucketed program of ``spec`` (a representative: each variable of ``dims`` at its
    range's upper edge), built and loaded once, then validated against the float64 reference at
    the lower edges, the upper edges and a size inside, launched as serving launches it."""
    from torch_kernelize.compiling.bucket_lookup import bucket_runner
    from torch_kernelize.core.buckets import spec_at, values_of

    assert tuple(hi for _, hi in ranges) == values_of(spec, dims), "the representative is the upper edge"
    assert family.bucket_support(spec, dims) is None, family.bucket_support(spec, dims)
    config = config or family.seed_configs(spec)[0]
    program = family.generate_bucketed(spec, config, dims)
    base = load(tmp_path, spec, program)
    sizes = [tuple(lo for lo, _ in ranges), tuple((lo + hi) // 2 for lo, hi in ranges), tuple(hi for _, hi in ranges)]
    for values in dict.fromkeys(sizes):
        concrete = spec_at(spec, dims, values)
        rec = validate(bucket_runner(concrete, dims, base).run_poisoned, concrete, family.sample_inputs,
                       family.edge_kinds, seeds=seeds, resolve_ties=family.resolve_ties,
                       magnitudes=family.term_magnitudes)
        assert rec.ok, f"{concrete.describe()} [{config}] at sizes {values}: {rec.reason}\n{program.source}"
    return program


def compile_sm90(spec: KernelSpec, program: KernelProgram, tmp_path: Path) -> list[dict[str, int]]:
    """Compile every launch for sm_90 (H100/H200) with triton's bundled ptxas: no GPU needed. Per
    launch, its resource use as cuobjdump -res-usage reads it off the cubin (REG: registers a
    thread; STACK: bytes of local stack a thread, where registers spill), where triton ships it."""
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torch_kernelize.building.triton_compile import compile_options
    from torch_kernelize.serving.launch import import_source

    d = Path(tmp_path) / f"sm90_{next(_counter)}"
    d.mkdir(parents=True)
    (d / "kernel.py").write_text(program.source)
    module = import_source(d / "kernel.py", f"tk_test_sm90.m{next(_counter)}")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = []
    for i, launch in enumerate(program.launches):
        fn = getattr(module, launch.kernel)
        src = ASTSource(fn, signature=program.signature(launch, spec), constexprs=dict(launch.constexprs))
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=compile_options(launch))
        assert compiled.asm.get("cubin"), f"{launch.kernel}: no cubin"
        if cuobjdump.exists():
            (d / f"{i}.cubin").write_bytes(compiled.asm["cubin"])
            text = subprocess.run([str(cuobjdump), "-res-usage", str(d / f"{i}.cubin")], capture_output=True,
                                  text=True, check=True).stdout
            usage.append({k: int(v) for k, v in re.findall(r"\b(REG|STACK):(\d+)", text)})
    return usage


def aten_counts(x: torch.Tensor, bins: int = 100, lo: float = 0, hi: float = 0) -> torch.Tensor:
    """torch.histc's counts with ATen's (CPU) bin arithmetic, but exact: ATen CPU accumulates counts
    in the input dtype per thread, so bf16 counts stop growing at 256 (fp16 at 2048). Chunks of 128
    elements keep every partial count exact; the sum is rounded to the dtype once, as the kernel does."""
    flat = x.cpu().reshape(-1)
    if lo == hi:  # the range from the data, as histc derives it (then passed explicitly: same edges)
        lo, hi = float(flat.min()), float(flat.max())
        if lo == hi:
            lo, hi = lo - 1, hi + 1
    total = torch.zeros(bins, dtype=torch.float64)
    for chunk in flat.split(128):
        total += torch.histc(chunk, bins, lo, hi).double()
    return total.to(x.dtype)


def jit_runner(tmp_path: Path, spec: KernelSpec, program: KernelProgram) -> ProgramRunner:
    """A runner that launches the program's kernels through triton's JIT on the current GPU."""
    from torch_kernelize.serving.launch import import_source

    d = Path(tmp_path) / f"jit{next(_counter)}"
    d.mkdir(parents=True)
    (d / "kernel.py").write_text(program.source)
    module = import_source(d / "kernel.py", f"tk_test_jit.m{next(_counter)}")
    # the "interpreter" launch convention passes num_warps/num_stages to kernel[grid](...)
    return ProgramRunner(spec, program, [getattr(module, l.kernel) for l in program.launches], "interpreter")


def gpu_benchmarks(out: str | None = None) -> list[dict]:
    """Median times (triton.testing.do_bench) of each seed config against eager ATen, on the GPU.

    Run on the GPU machine: python -c "import sys; sys.path.insert(0, 'test'); import kernel_testing as k; k.gpu_benchmarks()"
    """
    import tempfile

    from triton.testing import do_bench

    from torch_kernelize.lowering.kernels import family_for

    aten = torch.ops.aten
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *shape, dtype=torch.float32: torch.randn(*shape, device="cuda", generator=g).to(dtype)
    f16, bf16 = torch.float16, torch.bfloat16
    cases = [
        ("add f16 [4096x8192]+[8192]", aten.add.Tensor, (r(4096, 8192, dtype=f16), r(8192, dtype=f16)), {}),
        ("gelu bf16 16M", aten.gelu.default, (r(1 << 24, dtype=bf16),), {}),
        ("to bf16 from f32 16M", aten._to_copy.default, (r(1 << 24),), {"dtype": bf16}),
        ("clone f16 transposed [8192x4096].t()", aten.clone.default, (r(8192, 4096, dtype=f16).t(),), {"memory_format": torch.contiguous_format}),
        ("sum f16 [4096x8192] dim -1", aten.sum.dim_IntList, (r(4096, 8192, dtype=f16), [-1]), {}),
        ("sum f16 [8192x4096] dim 0", aten.sum.dim_IntList, (r(8192, 4096, dtype=f16), [0]), {}),
        ("sum f32 16M full", aten.sum.default, (r(1 << 24),), {}),
        ("var_mean f32 [4096x8192] dim -1", aten.var_mean.correction, (r(4096, 8192), [-1]), {"keepdim": True}),
        ("amax bf16 [4096x8192] dim -1", aten.amax.default, (r(4096, 8192, dtype=bf16), [-1]), {}),
        ("softmax f16 [4096x4096]", aten._softmax.default, (r(4096, 4096, dtype=f16), -1, False), {}),
        ("log_softmax f32 [256x50257]", aten._log_softmax.default, (r(256, 50257), -1, False), {}),
        ("histc f32 16M 256 bins fixed", aten.histc.default, (r(1 << 24), 256, -3.0, 3.0), {}),
        ("histc f32 16M 256 bins data range", aten.histc.default, (r(1 << 24), 256), {}),
    ]
    rows = BenchRows()
    with tempfile.TemporaryDirectory() as tmp:
        for name, op, args, kwargs in cases:
            result = op(*args, **kwargs)
            spec = KernelSpec.from_call(op, args, kwargs, result)
            family = family_for(spec)
            inputs = [a for a in args if isinstance(a, torch.Tensor)]
            nbytes = sum(t.untyped_storage().nbytes() for t in inputs) + sum(
                o.numel() * o.element_size() for o in (result if isinstance(result, tuple) else (result,)))
            eager = do_bench(lambda: op(*args, **kwargs), warmup=25, rep=100)
            best = None
            for config in family.seed_configs(spec):
                runner = jit_runner(Path(tmp), spec, family.generate(spec, config))
                runner(*inputs)
                t = do_bench(lambda: runner(*inputs), warmup=25, rep=100)
                if best is None or t < best[0]:
                    best = (t, str(config))
            rows.add(case=name, eager_ms=round(eager, 4), ours_ms=round(best[0], 4), config=best[1],
                     speedup=round(eager / best[0], 2), ours_TBps=round(nbytes / best[0] / 1e9, 2))
    return rows.save(out)


def gpu_sweep(out: str | None = None, only: str | None = None, repeat: int = 1) -> list[dict]:
    """Time many configs of a few cases on the GPU (to choose seed heuristics); prints JSON lines."""
    import itertools as it
    import tempfile

    from triton.testing import do_bench

    from torch_kernelize.lowering.kernels import family_for

    aten = torch.ops.aten
    r = lambda *shape, dtype=torch.float32: torch.randn(*shape, device="cuda").to(dtype)
    cases = [
        ("histc fixed", aten.histc.default, (r(1 << 24), 256, -4.0, 4.0),
         [Config.of(BLOCK=b, ITERS=i, num_warps=8, VARIANT="shared", COPIES=k, STREAM=st) for b, i, k, st in
          it.product((4096, 8192), (4, 16), (8, 32), ("", "evict_first"))] +
         [Config.of(BLOCK=4096, ITERS=4, num_warps=4, VARIANT="local")]),
        ("histc data range", aten.histc.default, (r(1 << 24), 256),
         [Config.of(BLOCK=b, ITERS=i, num_warps=8, VARIANT="shared", COPIES=k, STREAM=st, REVERSE=rev)
          for b, i, k, st, rev in it.product((2048, 4096), (4, 16), (1, 32), ("", "evict_first"), (False, True))]),
        ("sum full", aten.sum.default, (r(1 << 24),),
         [Config.of(BLOCK_M=1, BLOCK_R=b, SPLIT=s, num_warps=w, num_stages=2) for b, s, w in
          it.product((1024, 2048, 4096), (256, 512, 1024, 2048), (4, 8))]),
        ("log_softmax vocab", aten._log_softmax.default, (r(256, 50257), -1, False),
         [Config.of(BLOCK_M=1, BLOCK_R=b, SPLIT=1, num_warps=w, num_stages=s) for b, w, s in
          it.product((4096, 8192, 16384, 32768), (8, 16), (1, 2, 3))]),
        ("gelu bf16", aten.gelu.default, (r(1 << 24, dtype=torch.bfloat16),),
         [Config.of(BLOCK=b, num_warps=w) for b, w in it.product((512, 1024, 2048, 4096, 8192), (2, 4, 8, 16))]),
    ]
    rows = BenchRows()
    with tempfile.TemporaryDirectory() as tmp:
        for name, op, args, configs in [c for c in cases if only is None or only in c[0]] * repeat:
            spec = KernelSpec.from_call(op, args, {}, op(*args))
            family = family_for(spec)
            inputs = [a for a in args if isinstance(a, torch.Tensor)]
            eager = do_bench(lambda: op(*args), warmup=25, rep=100)
            plan = family.plan(spec)
            for config in configs:
                if not family._valid(plan, config):
                    continue
                runner = jit_runner(Path(tmp), spec, family.generate(spec, config))
                got, want = runner(*inputs), op(*args)  # a sanity check beside the time (validation is the tests')
                same = bool(torch.allclose(got.double(), want.double(), rtol=1e-3, atol=1e-3, equal_nan=True))
                t = do_bench(lambda: runner(*inputs), warmup=10, rep=50)
                rows.add(case=name, config=str(config), ms=round(t, 4), eager_ms=round(eager, 4), matches_eager=same)
    return rows.save(out)


def trial_holding_check(compute):
    """(run, calls) for validate(): ``run`` computes ``compute(inputs)`` and asserts, at each
    trial's first run (each trial runs twice: core/fills.py), that no tensor of an earlier trial
    is still alive; call it with the garbage collector off (reference counting alone must free
    them). ``calls`` counts the runs."""
    import weakref
    earlier: list = []
    calls: list[int] = []

    def run(inputs):
        calls.append(len(calls))
        if len(calls) % 2:
            assert all(r() is None for r in earlier), "a tensor of an earlier trial is still alive"
        out = compute(inputs)
        earlier.extend(weakref.ref(t) for t in (*inputs, *out))
        return out
    return run, calls
