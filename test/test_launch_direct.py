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
