"""Stored CUDA binaries, compiled here for sm_90 with Triton's bundled ptxas (no GPU):

- binaries for unaligned views: a stored kernel carries a second cubin per launch compiled
  without the 16-byte pointer alignment assumption, validated by fill_cache, which the runner
  takes for inputs off a 16-byte boundary (before: the vendor op ran those calls); the runner's
  choice is checked with stand-in launchers;
- loading without importing the kernel source (KernelSignature), whose parameter names are read
  from the `def` alone."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

import torch_kernelize.serving.launch as launch_mod
from kernel_testing import spec_of
from torch_kernelize.building.programs import add_unaligned_binaries, write_program
from torch_kernelize.building.triton_compile import sass as _sass
from torch_kernelize.core.program import has_unaligned
from torch_kernelize.serving.launch import MisalignedInput, ProgramRunner
from torch_kernelize.lowering.kernels.elementwise import FAMILY

SM90 = ("cuda", 90, 32)
aten = torch.ops.aten


def _add_program():
    spec = spec_of(aten.add.Tensor, (torch.randn(1 << 12), torch.randn(1 << 12)))
    return spec, FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])


def test_stored_kernel_gets_a_binary_without_the_alignment_assumption(tmp_path):
    spec, program = _add_program()
    files = write_program(tmp_path, spec, program, "cuda", SM90)
    assert "launch0.cubin" in files and not has_unaligned(tmp_path, 1)
    added = add_unaligned_binaries(tmp_path, spec, SM90)
    assert added == ["launch0.unaligned.cubin", "launch0.unaligned.json"] and has_unaligned(tmp_path, 1)
    # aligned: 16-byte vector loads; unaligned: none (each element loaded on its own), but the
    # output is the runner's own aligned allocation in both: still stored 16 bytes at a time
    load, store = re.compile(r"LDG\.E\.128"), re.compile(r"STG\.E\.128")
    aligned, unaligned = _sass(tmp_path / "launch0.cubin"), _sass(tmp_path / "launch0.unaligned.cubin")
    assert load.search(aligned) and store.search(aligned)
    assert not load.search(unaligned) and store.search(unaligned)


def test_unaligned_binary_keeps_fp16_atomics_on_its_own_output(tmp_path):
    # MoE's index_add with an odd slice of token indices: a compare-and-swap loop per element
    # (10x slower on the H200) when the output lost its alignment too; the runner allocates it.
    from torch_kernelize.lowering.kernels import family_for
    out, src = torch.zeros(256, 64, dtype=torch.half), torch.randn(40, 64, dtype=torch.half)
    spec = spec_of(aten.index_add.default, (out, 0, torch.randperm(256)[:40], src))
    family = family_for(spec)
    write_program(tmp_path, spec, family.generate(spec, family.seed_configs(spec)[0]), "cuda", SM90)
    add_unaligned_binaries(tmp_path, spec, SM90)
    for cubin in tmp_path.glob("launch*.cubin"):
        assert "ATOMG.E.CAS" not in _sass(cubin), cubin.name
    assert any("REDG.E.ADD.F16" in _sass(c) for c in tmp_path.glob("launch*.unaligned.cubin"))


class _Launcher:
    dropped = frozenset()

    def __init__(self, calls: list, tag: str):
        self.calls, self.tag = calls, tag
        self.args: list[tuple] = []

    def run(self, gx, gy, gz, stream, *args):
        self.calls.append(self.tag)
        self.args.append(((gx, gy, gz), stream, args))


def _runner(loader):
    spec, program = _add_program()
    calls: list[str] = []
    unaligned = None if loader is None else (lambda: loader(calls))
    return ProgramRunner(spec, program, [_Launcher(calls, "aligned")], "cuda", unaligned), calls


@pytest.fixture
def no_stream(monkeypatch):
    monkeypatch.setattr(launch_mod, "_raw_stream", lambda device: 0)


def test_runner_takes_the_unaligned_binary_for_an_unaligned_view(no_stream):
    loads = []

    def loader(calls):
        loads.append(1)
        return [_Launcher(calls, "unaligned")]

    runner, calls = _runner(loader)
    x = torch.randn((1 << 12) + 1)
    aligned, shifted = x[:-1], x[1:]  # shifted starts 4 bytes past the allocation
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 4
    outs, temps = runner.allocate(torch.device("cpu"))
    runner.launch([aligned, aligned], outs, temps)
    runner.launch([aligned, shifted], outs, temps)
    runner.launch([shifted, aligned], outs, temps)
    assert calls == ["aligned", "unaligned", "unaligned"] and loads == [1]  # loaded once, when first needed


def test_without_an_unaligned_binary_the_call_goes_to_the_vendor_op(no_stream, caplog):
    runner, _ = _runner(None)
    x = torch.randn((1 << 12) + 1)
    outs, temps = runner.allocate(torch.device("cpu"))
    with pytest.raises(MisalignedInput):
        runner.launch([x[1:], x[:-1]], outs, temps)

    def broken(calls):
        raise FileNotFoundError("launch0.unaligned.cubin")

    runner, _ = _runner(broken)
    with caplog.at_level(logging.WARNING, logger="torch_kernelize.serving.launch"), pytest.raises(MisalignedInput):
        runner.launch([x[1:], x[:-1]], outs, temps)
    assert "did not load" in caplog.text
    with pytest.raises(MisalignedInput):  # not retried on every call
        runner.launch([x[1:], x[:-1]], outs, temps)


def test_worker_compiles_the_unaligned_binaries_or_leaves_none(tmp_path):
    from torch_kernelize.fill_cache.builder import _build_unaligned

    spec, program = _add_program()
    good, bad = tmp_path / "good", tmp_path / "bad"
    write_program(good, spec, program, "cuda", SM90)
    assert _build_unaligned(spec.to_json(), str(good), SM90) is None and has_unaligned(good, 1)
    write_program(bad, spec, program, "cuda", SM90)
    (bad / "kernel.py").write_text(program.source.replace("tl.arange(0, BLOCK)", "tl.arange(0, BLOCK + 1)"))
    error = _build_unaligned(spec.to_json(), str(bad), SM90)
    assert error and not list(bad.glob("*.unaligned.*"))


def test_fill_stores_a_winner_once_its_unaligned_binaries_are_built(tmp_path, caplog):
    """fill_cache does not wait for that compile: the winner is stored when its future is done and
    the binaries pass validation (else without them), every pending winner before the run ends."""
    import concurrent.futures

    from torch_kernelize.fill_cache.cli import FillRun
    from torch_kernelize.core.targets import get_target

    class Cache:
        def __init__(self):
            self.stored, self.files = [], {}

        def put(self, record, built, replace=False):
            assert Path(built).is_dir()  # not discarded before its put
            self.stored.append(record["key"])
            self.files[record["key"]] = sorted(p.name for p in Path(built).iterdir())

    class Measurer:  # what the pending store asks of the spec's measurer
        contains_faults = False

        def __init__(self, spec, verdict):
            self.spec, self.verdict = spec, verdict

        def validate_unaligned(self, built):
            return self.verdict

        def close(self):
            pass

    cache = Cache()
    run = FillRun(get_target("interpreter"), cache, 2, False, False, 1.03)
    try:
        futures = {k: concurrent.futures.Future() for k in "abcd"}
        dirs = {}
        for k, fut in futures.items():
            spec, program = _add_program()
            dirs[k] = built = run.builder.root / f"spec-{k}" / "0"
            write_program(built, spec, program, "interpreter")
            (built / "launch0.unaligned.cubin").write_bytes(b"stand-in")
            verdict = "output 0: 3 of 4096 elements differ" if k == "d" else None
            run._pending.append((fut, {"key": k}, built, False, Measurer(spec, verdict)))
        futures["a"].set_result(None)
        futures["c"].set_result("CompilationError: too many registers")
        futures["d"].set_result(None)
        run._store_pending(wait=False)
        assert cache.stored == ["a", "c", "d"] and [p[1]["key"] for p in run._pending] == ["b"]
        assert "launch0.unaligned.cubin" in cache.files["a"]
        assert "launch0.unaligned.cubin" not in cache.files["c"] + cache.files["d"]  # nothing half-made is stored
        assert "no binary for unaligned views" in caplog.text and "failed validation" in caplog.text
        futures["b"].set_result(None)
        run._store_pending(wait=True)
        assert cache.stored == ["a", "c", "d", "b"] and not run._pending
    finally:
        run.builder.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int64])
def test_unaligned_copy_keeps_values_and_strides(dtype):
    from torch_kernelize.fill_cache.measure import unaligned_copy

    t = (torch.arange(60) % 7).to(dtype).reshape(3, 4, 5).transpose(0, 2)[:, 1:]
    u = unaligned_copy(t)
    assert u.data_ptr() % 16 != 0 and u.stride() == t.stride() and u.shape == t.shape
    assert torch.equal(u, t)


def test_launchers_need_no_import_of_the_source(tmp_path):
    """Serving loads stored binaries with a KernelSignature instead of importing each kernel's
    source, and reads them as a StoredBinary instead of Triton's CompiledKernel: Triton's launch
    source and torch's static launcher see the same kernel every way."""
    from triton.compiler import CompiledKernel
    from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel

    from torch_kernelize.core.program import launch_files
    from torch_kernelize.serving.triton_binaries import KernelSignature, StoredBinary, ast_source
    from torch_kernelize.serving.launch import import_source
    from torch_kernelize.lowering.kernels.histc import FAMILY as HISTC

    spec = spec_of(aten.histc.default, (torch.randn(4096), 64, -2.0, 2.0))  # constexprs, several launches
    program = HISTC.generate(spec, HISTC.seed_configs(spec)[0])
    write_program(tmp_path, spec, program, "cuda", SM90)
    module = import_source(tmp_path / "kernel.py", "tk_test_signature")
    for i, launch in enumerate(program.launches):
        cubin, meta = launch_files(i)
        files = {cubin: str(tmp_path / cubin), meta: str(tmp_path / meta)}
        seen = []
        for fn, stored in ((getattr(module, launch.kernel), False), (KernelSignature.of(launch, program), False),
                           (KernelSignature.of(launch, program), True)):
            src = ast_source(fn, launch, program, spec)
            if stored:
                compiled = StoredBinary(src, tmp_path / cubin, tmp_path / meta, "h")
                full = compiled.compiled()  # what Triton's launcher is built from, where torch's refuses
                assert full.metadata == compiled.metadata and full.name == compiled.name
            else:
                compiled = CompiledKernel(src, files, json.loads((tmp_path / meta).read_text())["hash"])
                compiled._cubin_path = files[cubin]
            static = StaticallyLaunchedCudaKernel(compiled)  # no CUDA needed until load_kernel
            seen.append((src.name, src.constants, src.signature, src.attrs, compiled.name, compiled.hash,
                         compiled.metadata, {k: v for k, v in vars(static).items()}))
        assert seen[0] == seen[1] == seen[2], launch.kernel


def test_triton_kernel_arg_names_come_from_the_signature_alone_or_the_whole_parse():
    """A warm process reads each kernel's parameter names; only the ``def`` is parsed when its
    brackets can be matched, else the whole source (a comment or string inside the signature)."""
    from torch_kernelize.core.program import KernelProgram, Launch, _arg_names, _signature_source
    src = ("import triton\n\n@triton.jit\ndef k_2(a):\n    pass\n\n@triton.jit\n"
           "def k(x_ptr, y_ptr: 'tl.pointer', n,\n      SHAPE: tl.constexpr = (1, 2), BLOCK: tl.constexpr = 128):\n"
           "    pass\n\n@triton.jit\ndef c(a,  # the input\n      b):\n    pass\n")
    assert _signature_source(src, "k") is None  # the annotation is a string: left to the whole parse
    p = KernelProgram(src, (Launch("k", (1,), ()), Launch("k_2", (1,), ()), Launch("c", (1,), ())))
    assert p.kernel_arg_names("k") == ["x_ptr", "y_ptr", "n", "SHAPE", "BLOCK"]
    assert p.kernel_arg_names("k_2") == ["a"]
    assert _signature_source(src, "c") is None and p.kernel_arg_names("c") == ["a", "b"]
    plain = src.replace("'tl.pointer'", "tl.pointer")
    assert _signature_source(plain, "k").startswith("def k(x_ptr, y_ptr: tl.pointer, n,")
    assert _arg_names(plain, "k") == ("x_ptr", "y_ptr", "n", "SHAPE", "BLOCK")
    with pytest.raises(ValueError, match="not defined"):
        _arg_names(plain, "k_")


def test_runner_passes_the_launch_arguments_in_order(no_stream):
    # inputs, outputs and literal scalars in the kernel's parameter order; the constexprs the
    # static launcher does not take are left out (``dropped``)
    spec, program = _add_program()
    (launch,) = program.launches
    names = program.kernel_arg_names(launch.kernel)
    calls: list[str] = []
    launcher = _Launcher(calls, "aligned")
    launcher.dropped = frozenset(i for i, n in enumerate(names) if n in launch.constexprs)
    runner = ProgramRunner(spec, program, [launcher], "cuda")
    x, y = torch.randn(1 << 12), torch.randn(1 << 12)
    out = runner(x, y)
    (grid, stream, args), = launcher.args
    runtime = [n for n in names if n not in launch.constexprs]
    assert len(args) == len(runtime) == len(launch.args) and stream == 0
    assert grid == tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    for got, (kind, value) in zip(args, launch.args):
        want = {"in": (x, y), "out": (out,)}.get(kind)
        assert got is want[value] if want is not None else got == value


def test_an_input_the_spec_holds_on_the_host_is_launched_from_the_device(no_stream):
    """A dynamic graph's tensorified floats are 0-d CPU tensors; the fill validated the program with
    them on the device. Passed as host pointers, torch's launcher failed on the H100 ("CUDA driver
    error: invalid argument"): the runner moves them to the others' device ("meta" stands in)."""
    import dataclasses
    spec = spec_of(aten.add.Tensor, (torch.randn(1 << 12), torch.tensor(0.5, dtype=torch.float64)))
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    spec = dataclasses.replace(spec, inputs=(dataclasses.replace(spec.inputs[0], device="cuda"), spec.inputs[1]))
    assert spec.inputs[1].device == "cpu" and spec.inputs[1].shape == ()
    launcher = _Launcher([], "aligned")
    runner = ProgramRunner(spec, program, [launcher], "cuda")
    # the general path (``__call__``); the generated one (``direct``, built where CUDA is) moves
    # them too: test_launch_direct.py
    runner(torch.empty(1 << 12, device="meta"), torch.tensor(0.5, dtype=torch.float64))
    (_, _, args), = launcher.args
    assert [a.device.type for a in args if isinstance(a, torch.Tensor)] == ["meta", "meta", "meta"]


def test_a_kernel_with_tensor_descriptors_gets_triton_an_allocator_where_none_is_set(tmp_path):
    """The grouped_mm family's TMA variant builds its tensor descriptors in Triton's global scratch:
    its stored metadata says so (torch's static launcher refuses such kernels; Triton's launcher
    asks the allocator of the calling thread's context, whose default raises). The runner sets one
    from torch's caching allocator where none is set, and keeps one the user set."""
    import contextvars

    import triton
    from triton.runtime._allocation import NullAllocator, _allocator

    from test_kernels_grouped_mm import _spec
    from torch_kernelize.lowering.kernels.grouped_mm import FAMILY as GROUPED
    from torch_kernelize.serving import triton_binaries

    spec, _ = _spec(dtype=torch.float16, transposed=True)
    config = next(c for c in GROUPED.seed_configs(spec) if c["TMA"])
    write_program(tmp_path, spec, GROUPED.generate(spec, config), "cuda", SM90)
    assert json.loads((tmp_path / "launch0.json").read_text())["global_scratch_size"] > 0

    def fresh():
        assert isinstance(_allocator.get(), NullAllocator)
        triton_binaries._give_triton_an_allocator()
        return _allocator.get()
    assert contextvars.Context().run(fresh) is triton_binaries._scratch

    def users(size, alignment, stream):
        raise AssertionError("not called here")

    def kept():
        triton.set_allocator(users)
        triton_binaries._give_triton_an_allocator()
        return _allocator.get()
    assert contextvars.Context().run(kept) is users
