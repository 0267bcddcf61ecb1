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
