"""The CUDA hot path of a loaded program as one generated function (ProgramRunner.direct): the
same launches with the same arguments as the general path, which still takes every call it does
not cover. On CPU, with stand-ins for the CUDA stream, device and allocator entries."""
from __future__ import annotations

import pytest
import torch

from test_cuda_binaries import _add_program, _Launcher
from torch_kernelize.serving import launch as launch_mod
from torch_kernelize.serving.launch import MisalignedInput, ProgramRunner


@pytest.fixture
def cpu_stand_ins(monkeypatch):
    monkeypatch.setattr(launch_mod, "_raw_stream", lambda device: 7)
    monkeypatch.setattr(launch_mod, "_RAW_STREAM", lambda index: 7)
    monkeypatch.setattr(launch_mod, "_CUDA_DEVICE", lambda: -1)  # what a CPU tensor's get_device() says
    monkeypatch.setattr(launch_mod, "_EMPTY_STRIDED_CUDA", launch_mod._EMPTY_STRIDED_CPU)


def _runner():
    spec, program = _add_program()
    (launch,) = program.launches
    names = program.kernel_arg_names(launch.kernel)
    launcher = _Launcher([], "aligned")
    launcher.dropped = frozenset(i for i, n in enumerate(names) if n in launch.constexprs)
    return ProgramRunner(spec, program, [launcher], "cuda"), launcher, spec


def test_the_direct_call_launches_what_the_general_path_launches(cpu_stand_ins):
    runner, launcher, spec = _runner()
    assert runner.direct is not None and "for " not in runner.direct.source
    x, y = torch.randn(1 << 12), torch.randn(1 << 12)
    general, direct = runner(x, y), runner.direct(x, y)
    (grid, stream, args), (grid2, stream2, args2) = launcher.args
    assert (grid, stream) == (grid2, stream2) and len(args) == len(args2)
    for a, b in zip(args, args2):
        if a is general:
            assert b is direct
        else:
            assert a is b or a == b
    (meta,) = spec.outputs
    assert direct.shape == general.shape == meta.shape and direct.stride() == meta.stride
    assert direct.dtype == general.dtype


def test_calls_the_direct_path_does_not_cover_take_the_general_one(cpu_stand_ins, monkeypatch):
    runner, launcher, _ = _runner()
    x = torch.randn((1 << 12) + 1)
    with pytest.raises(MisalignedInput):  # off a 16-byte boundary, and no unaligned binary
        runner.direct(x[1:], x[:-1])
    monkeypatch.setattr(launch_mod, "_CUDA_DEVICE", lambda: 0)  # an input on another device
    general = []
    monkeypatch.setattr(ProgramRunner, "__call__", lambda self, *a: general.append(a) or "general")
    runner = _runner()[0]
    assert runner.direct(x[:-1], x[:-1]) == "general" and len(general) == 1


def test_no_direct_call_for_donating_programs_or_the_interpreter(cpu_stand_ins):
    runner, _, spec = _runner()
    assert ProgramRunner(spec, runner.program, [object()], "interpreter").direct is None
    assert runner.donating() is None or runner.donating().direct is None


def test_a_program_with_vendor_steps_and_views_runs_straight_line(cpu_stand_ins):
    """A compiler's whole output: a vendor step's result (a list of buffers in its arguments)
    read by a launch through a pointer view,
    the launch writing its part of a temporary, a later step reading that part re-strided and
    writing the output (``out=``). The direct call runs it without loops and matches the general
    path."""
    import dataclasses

    from torch_kernelize.core.program import Buffer, View
    from torch_kernelize.core.program_steps import VendorStep
    spec, program = _add_program()
    (launch,) = program.launches
    n = spec.inputs[0].shape[0]
    cat = VendorStep("aten.cat.default", [[{"buf": ["in", 0]}, {"buf": ["in", 1]}], 0], {}, 0, (("tmp", 0),))
    add = VendorStep("aten.add.out", [{"buf": ["tmp", 1], "view": [[n], [1], n]}, {"buf": ["in", 0]}],
                     {"alpha": 2, "out": {"buf": ["out", 0]}}, 1)
    program = dataclasses.replace(
        program, temps=(Buffer((2 * n,), "float32"), Buffer((2 * n,), "float32")), steps=(cat, add),
        views=(View(("tmp", 1), n), View(("tmp", 0), n)),
        launches=(dataclasses.replace(launch, args=(("view", 1), ("in", 1), ("view", 0))),))

    class Adder:  # the kernel: c = a + b over the first n elements of each pointer
        dropped = frozenset(i for i, name in enumerate(program.kernel_arg_names(launch.kernel))
                            if name in launch.constexprs)

        def run(self, gx, gy, gz, stream, a, b, c):
            c[:n].copy_(a[:n] + b)
    runner = ProgramRunner(spec, program, [Adder()], "cuda")
    assert runner.direct is not None
    assert "for " not in runner.direct.source and "r = " in runner.direct.source
    x, y = torch.randn(n), torch.randn(n)
    want = y + y + 2 * x
    torch.testing.assert_close(runner(x, y), want)
    torch.testing.assert_close(runner.direct(x, y), want)


def test_extern_ops_are_called_through_the_bindings_inductor_calls_them_by():
    """Every op BINDINGS names runs through torch's generated binding, as Inductor's extern
    kernels do, with the overload's result (``out=`` picking the .out overload); any other op
    through its overload's C++ entry."""
    from torch_kernelize.core.program_steps import BINDINGS, StepCall, VendorStep
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)
    x, w = torch.randn(1, 3, 6, 6), torch.randn(2, 3, 3, 3)
    bufs = {"in": [a, b, c, x, w, a.expand(2, 3, 4).contiguous(), b.expand(2, 4, 5).contiguous(),
                   c.expand(2, 3, 5).contiguous()], "out": [torch.empty(3, 5), torch.empty(2, 3, 5)], "tmp": []}
    i = lambda k: {"buf": ["in", k]}  # noqa: E731
    cases = {"aten.mm": ([i(0), i(1)], {}), "aten.addmm": ([i(2), i(0), i(1)], {"beta": 2, "alpha": 0.5}),
             "aten.bmm": ([i(5), i(6)], {}), "aten.baddbmm": ([i(7), i(5), i(6)], {"alpha": 3})}
    for op, (args, kwargs) in cases.items():
        out = {"out": {"buf": ["out", 0 if op in ("aten.mm", "aten.addmm") else 1]}}
        for overload, kw in (("default", kwargs), ("out", {**kwargs, **out})):
            step = VendorStep(f"{op}.{overload}", args, kw, 0, (("tmp", 0),) if overload == "default" else ())
            call = StepCall(step)
            assert call.call is getattr(torch._C._VariableFunctions, op.split(".")[1])
            bufs["tmp"] = [None]
            call(bufs, "cpu")
            got = bufs["tmp"][0] if overload == "default" else bufs["out"][out["out"]["buf"][1]]
            want = getattr(torch.ops.aten, op.split(".")[1]).default(*[bufs["in"][a["buf"][1]] for a in args],
                                                                     **kwargs)
            torch.testing.assert_close(got, want)
    conv = VendorStep("aten.convolution.default", [i(3), i(4), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1],
                      {}, 0, (("tmp", 0),))
    call = StepCall(conv)
    assert call.call is torch._C._VariableFunctions.convolution and conv.op in BINDINGS
    call(bufs, "cpu")
    torch.testing.assert_close(bufs["tmp"][0], torch.nn.functional.conv2d(x, w, padding=1))
    cat = StepCall(VendorStep("aten.cat.default", [[i(0), i(0)], 0], {}, 0, (("tmp", 0),)))
    assert cat.call is torch.ops.aten.cat.default._op


def test_one_generated_call_serves_every_size_of_a_bucket_as_each_sizes_program_does(cpu_stand_ins):
    """A whole graph's bucket program (fitted over sizes, as Inductor's dynamic output is) made
    once into a call of every size (ProgramRunner.bucket_direct): at each size it launches with
    the grid, scalars and buffer sizes of that size's own program, runs the vendor step on views
    of that size, and returns outputs of that size; straight-line, reading the size off input 0.
    An input off a 16-byte boundary goes to the general call it was given."""
    from test_whole_buckets import _program

    from torch_kernelize.core.sized_programs import Resizer, SizeSource
    from torch_kernelize.core.spec import KernelSpec, TensorMeta
    from torch_kernelize.fill_cache.program_fit import fit_program
    fitted = fit_program({s: _program(s) for s in (33, 34, 48, 63, 64)})
    resize = Resizer(fitted)

    class Kernel:  # records what it was given; writes its buffer (read by the step) and the output
        dropped = frozenset(i for i, name in enumerate(fitted.kernel_arg_names("k")) if name == "XBLOCK")
        seen: list = []

        def run(self, gx, gy, gz, stream, tmp, out, n, m):
            self.seen.append(((gx, gy, gz), n, m, tmp.shape, out.shape))
            tmp[:m].copy_(torch.arange(m, dtype=tmp.dtype))
            out.view(-1)[:m].fill_(n)

    x64 = torch.randn(64, 128)
    base = ProgramRunner(KernelSpec.from_call(torch.ops.aten.add.Tensor, [x64, x64], {}, x64 + x64), fitted,
                         [Kernel()], "cuda")
    outputs = (TensorMeta((SizeSource("v[0]"), 128), (128, 1), "float32", "cpu"),)
    general = []
    call = base.bucket_direct(resize.symbolic(), outputs, "(i0.shape[0],)",
                              lambda *t: general.append(t) or "general")
    assert call is not None and "for " not in call.source and "v = (i0.shape[0],)" in call.source
    # each temporary lives from its first use to its last (Inductor's `del buf`): t1 and t2, first
    # named by the step after the launch, are allocated after it, and all three are dropped there
    lines = [line.strip() for line in call.source.splitlines()]
    run0 = next(i for i, line in enumerate(lines) if line.startswith("run0("))
    assert lines.index("stream = stream_of(device)") < next(i for i, line in enumerate(lines) if line.startswith("t0 = "))
    assert run0 < next(i for i, line in enumerate(lines) if line.startswith("t1 = ")) < lines.index("del t0, t1, t2")
    for s in (33, 40, 64, 51):
        x = torch.randn(s, 128)
        own = base.resized(resize((s,)), (TensorMeta((s, 128), (128, 1), "float32", "cpu"),))
        Kernel.seen.clear()
        want, got = own(x, x), call(x, x)
        (a, b) = Kernel.seen
        assert a == b and a[0] == (-(-128 * s // 256), 1, 1) and a[1:3] == (s, 128 * s)
        assert got.shape == want.shape == (s, 128) and torch.equal(got, want)
    assert not general
    unaligned = torch.randn(41 * 128 + 1)[1:].view(41, 128)
    assert call(unaligned, unaligned) == "general" and len(general) == 1


def test_a_node_buckets_kernel_gets_one_generated_call_for_every_size_of_its_bucket(cpu_stand_ins):
    """A kernel family's bucket program (an add over 5-8 rows) with its outputs' metas at the
    sizes' source (metas_at on SIZES): one generated call launches, at each size, the grid and
    scalars of that size's own program and returns an output of that size."""
    from torch_kernelize.core.buckets import metas_at
    from torch_kernelize.core.sized_programs import SIZES, Resizer, SizeSource
    from torch_kernelize.core.spec import KernelSpec
    from torch_kernelize.lowering.kernels.elementwise import ElementwiseFamily
    dims = (("in", 0, 0, 0), ("in", 1, 0, 0), ("out", 0, 0, 0))
    a = torch.randn(8, 16)
    spec = KernelSpec.from_call(torch.ops.aten.add.Tensor, [a, a], {}, a + a)
    family = ElementwiseFamily()
    program = family.generate_bucketed(spec, family.seed_configs(spec)[0], dims)
    (out,) = metas_at(spec, dims, SIZES)
    assert out.shape == (SizeSource("v[0]"), 16) and out.stride == (16, 1)
    resize = Resizer(program)
    names = program.kernel_arg_names(program.launches[0].kernel)
    launcher = _Launcher([], "aligned")
    launcher.dropped = frozenset(i for i, n in enumerate(names) if n in program.launches[0].constexprs)
    base = ProgramRunner(spec, resize((8,)), [launcher], "cuda")
    call = base.bucket_direct(resize.symbolic(), (out,), "(i0.shape[0],)", lambda *t: "general")
    assert call is not None and "v = (i0.shape[0],)" in call.source
    for rows in (5, 7, 6, 8):
        x = torch.randn(rows, 16)
        own = base.resized(resize((rows,)), metas_at(spec, dims, (rows,)))
        launcher.args.clear()
        want, got = own(x, x), call(x, x)
        (grid, stream, args), (grid2, stream2, args2) = launcher.args
        assert grid == grid2 and stream == stream2 and got.shape == want.shape == (rows, 16)
        scalars = [[v for v in a if not isinstance(v, torch.Tensor)] for a in (args, args2)]
        assert scalars[0] == scalars[1] and rows * 16 in scalars[1]


def test_a_program_reading_a_host_scalar_input_moves_it_in_the_direct_call_too(cpu_stand_ins, monkeypatch):
    """A dynamic graph's 0-d host input (a norm's eps) is moved to the device before the launches,
    in the generated call as in the general path; the alignment check skips it."""
    from torch_kernelize.core.program import KernelProgram, Launch
    from torch_kernelize.core.spec import KernelSpec
    source = "import triton\n@triton.jit\ndef k(a, s, c, BLOCK: tl.constexpr):\n    pass\n"
    program = KernelProgram(source, (Launch("k", (1,), (("in", 0), ("in", 1), ("out", 0)), {"BLOCK": 8}),))
    x, eps = torch.randn(64), torch.tensor(0.5, dtype=torch.float64)
    spec = KernelSpec.from_call(torch.ops.aten.add.Tensor, [x, eps], {}, x + eps)
    moved = []

    class Scalar(torch.Tensor):  # records the move a CUDA device would make
        def to(self, *a, **k):
            moved.append(a)
            return torch.Tensor.to(torch.Tensor(self), *a, **k)

    class Kernel:
        dropped = frozenset({3})

        def run(self, gx, gy, gz, stream, a, s, c):
            c.copy_(a + s)
    runner = ProgramRunner(spec, program, [Kernel()], "cuda")
    assert runner._host_inputs == (1,) and runner.direct is not None
    assert "i1.to(i0.device, non_blocking=True)" in runner.direct.source and "i1.data_ptr()" not in runner.direct.source
    torch.testing.assert_close(runner.direct(x, eps.as_subclass(Scalar)), x + 0.5)
    assert moved == [(x.device,)]


def test_a_bucket_left_without_one_generated_call_says_why():
    """Each bucket whose new sizes make their own launch plan is counted with its reason (the
    report's planning: bucket_trace.py prints it), where the GPU run cannot be debugged."""
    import types

    from torch_kernelize.compiling.lower import _bucket_direct

    class Runner:
        backend = "cuda"

        def bucket_direct(self, *args):
            raise ValueError("a launch the generation cannot write")
    resize = types.SimpleNamespace(symbolic=lambda: None)
    call = types.SimpleNamespace(sizes_source="()", per_size=None, __name__="triton_x_bucket")
    assert _bucket_direct(Runner(), resize, (), call) == (None, "ValueError: a launch the generation cannot write")
    assert _bucket_direct(Runner(), resize, None, call) == (None, "outputs' sizes not polynomials of the bucket's")
    Runner.bucket_direct = lambda self, *args: None
    assert "no generated call" in _bucket_direct(Runner(), resize, (), call)[1]
    Runner.backend = "interpreter"  # (no generated calls off CUDA: nothing to say)
    assert _bucket_direct(Runner(), resize, (), call) == (None, None)


def test_a_program_with_index_checks_gets_the_direct_call_and_reads_its_flag(cpu_stand_ins):
    """An indexing program's check flag (an index out of range) no longer keeps it on the general
    path: the generated call keeps the flag temporary alive to its end and reads it there, as the
    general path does (deferred to the graph's call on a GPU); a set flag raises IndexOutOfRange."""
    from kernel_testing import spec_of
    from test_cuda_binaries import _Launcher
    from torch_kernelize.core.errors import IndexOutOfRange
    from torch_kernelize.lowering.kernels import family_for

    weight, idx = torch.randn(64, 16), torch.tensor([3, 1, 63, 0])
    spec = spec_of(torch.ops.aten.embedding.default, (weight, idx))
    family = family_for(spec)
    program = family.generate(spec, family.seed_configs(spec)[0])
    assert [program.temps[c.temp].dtype for c in program.checks] == ["int32"]

    class Kernel(_Launcher):  # sets the flag (a 1-element int32 temporary) when told the index was out of range
        out_of_range = False

        def run(self, gx, gy, gz, stream, *args):
            super().run(gx, gy, gz, stream, *args)
            for a in args:
                if self.out_of_range and isinstance(a, torch.Tensor) and a.dtype == torch.int32 and a.numel() == 1:
                    a.fill_(1)

    kernel = Kernel([], "k")
    names = program.kernel_arg_names(program.launches[0].kernel)
    kernel.dropped = frozenset(i for i, n in enumerate(names) if n in program.launches[0].constexprs)
    runner = ProgramRunner(spec, program, [kernel] * len(program.launches), "cuda")
    assert runner.direct is not None and "flag_checks(" in runner.direct.source
    runner.direct(weight, idx)  # (the flag left zero: no error)
    kernel.out_of_range = True
    with pytest.raises(IndexOutOfRange, match="out of bounds"):
        runner.direct(weight, idx)
