"""Grid-synchronized launches (program.py): one launch whose programs wait at a grid barrier
between phases. The interpreter runs each phase as its own launch over the whole grid; on CUDA the
kernel is compiled once (PHASE=0) for a cooperative launch, with its semaphore in a state buffer
kept per device and stream. The barrier itself runs only on a GPU (test_kernels_gpu.py): here its
semaphore arithmetic is checked on a model, and its sm_90 binary for the fence and atomics."""
from __future__ import annotations

import json
import random

import pytest
import torch

import torch_kernelize.serving.launch as launch_mod
from kernel_testing import load, spec_of
from torch_kernelize.building.programs import write_program
from torch_kernelize.building.triton_compile import sass
from torch_kernelize.serving.launch import ProgramRunner
from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.core.program import PHASE, Buffer, KernelProgram, Launch

aten = torch.ops.aten
P = 4

# Phase 1: each program stores a partial; phase 2: each program sums every program's partial,
# right only if phase 1 ran in all programs first.
SOURCE = cg.HEADER + cg.grid_barrier_source(P) + f'''

@triton.jit
def two_phase_kernel(x_ptr, out_ptr, part_ptr, sync_ptr, PHASE: tl.constexpr):
    pid = tl.program_id(0)
    if PHASE == 0 or PHASE == 1:
        tl.store(part_ptr + pid, tl.load(x_ptr + pid) * 2.0)
    if PHASE == 0:
        _grid_barrier(sync_ptr)
    if PHASE == 0 or PHASE == 2:
        tl.store(out_ptr + pid, tl.sum(tl.load(part_ptr + tl.arange(0, {P}), cache_modifier=".cg"), 0) + pid)
'''


def _program(phases: int = 2) -> KernelProgram:
    launch = Launch("two_phase_kernel", (P,), (("in", 0), ("out", 0), ("tmp", 0), ("state", 0)), {PHASE: 0},
                    4, 1, phases)
    return KernelProgram(SOURCE, (launch,), temps=(Buffer((P,), "float32"),), state=(Buffer((1,), "int32", 0),))


def _spec():
    return spec_of(aten.neg.default, (torch.randn(P),))


def test_interpreter_runs_each_phase_over_the_whole_grid(tmp_path):
    x = torch.randn(P)
    runner = load(tmp_path, _spec(), _program())
    for _ in range(2):
        got = runner.run_poisoned([x])[0]
        assert torch.allclose(got, 2 * x.sum() + torch.arange(P, dtype=torch.float32))


def test_a_synchronized_launch_declares_its_phase():
    args = (("in", 0), ("out", 0))
    with pytest.raises(ValueError, match="PHASE"):
        Launch("k", (4,), args, {}, 4, 1, 2)            # phases without the constexpr
    with pytest.raises(ValueError, match="PHASE"):
        Launch("k", (4,), args, {PHASE: 0}, 4, 1, 1)    # the constexpr without phases
    with pytest.raises(ValueError, match="must be 0"):
        Launch("k", (4,), args, {PHASE: 1}, 4, 1, 2)    # the GPU binary runs every phase
    assert Launch("k", (4,), args, {PHASE: 0}, 4, 1, 3).synchronized


def test_state_buffers_round_trip_and_start_at_zero():
    program = _program(3)
    again = KernelProgram.from_json(json.loads(json.dumps(program.to_json())), program.source)
    assert again == program and again.launches[0].phases == 3
    plain = Launch("two_phase_kernel", (P,), (("in", 0), ("out", 0), ("tmp", 0), ("tmp", 0)), {PHASE: 0}, 4, 1, 2)
    assert "state" not in KernelProgram(SOURCE, (plain,), temps=(Buffer((P,), "float32"),)).to_json()
    with pytest.raises(ValueError, match="start at zero"):
        KernelProgram(SOURCE, program.launches, temps=program.temps, state=(Buffer((1,), "int32", 5),))
    with pytest.raises(ValueError, match="no state buffer 0"):
        KernelProgram(SOURCE, program.launches, temps=program.temps)


@pytest.mark.parametrize("programs", [1, 2, 3, 264, 1024])
def test_barrier_semaphore_flips_exactly_when_the_last_program_arrives(programs):
    """A model of _grid_barrier's int32 arithmetic over consecutive barriers, arrivals in random
    order: nobody passes before the last arrival, everybody after, and no reset is needed."""
    wrap = lambda v: (v + 2**31) % 2**32 - 2**31  # int32 two's complement
    rng = random.Random(programs)
    sem = 0
    for _ in range(4):
        seen = {}
        order = list(range(programs))
        rng.shuffle(order)
        for k, pid in enumerate(order):
            seen[pid] = sem
            sem = wrap(sem + (cg.first_arrival_add(programs) if pid == 0 else 1))
            passed = [(old ^ sem) < 0 for old in seen.values()]
            assert all(passed) if k == programs - 1 else not any(passed), (k, pid)
        assert sem & 0x7FFFFFFF == 0  # only the sign bit moved


class _Launcher:
    dropped = frozenset()

    def __init__(self):
        self.calls = []

    def run(self, gx, gy, gz, stream, *args):
        self.calls.append((stream, args))


def test_cuda_runner_keeps_one_zeroed_state_per_stream(monkeypatch):
    stream = [7]
    monkeypatch.setattr(launch_mod, "_raw_stream", lambda device: stream[0])
    launcher = _Launcher()
    runner = ProgramRunner(_spec(), _program(), [launcher], "cuda")
    x = torch.randn(P)
    runner(x)
    runner(x)
    stream[0] = 9
    runner(x)
    (s1, a1), (s2, a2), (s3, a3) = launcher.calls
    assert (s1, s2, s3) == (7, 7, 9)
    assert a1[0] is x and a1[3] is a2[3] and a3[3] is not a1[3]  # the same semaphore on one stream
    assert a1[3].dtype == torch.int32 and a1[3].shape == (1,) and not a1[3].any()
    assert a1[2] is not a2[2]  # temporaries are per call


def test_sm90_binary_is_cooperative_with_a_gpu_scope_barrier(tmp_path):
    """The launch is compiled for a cooperative launch (the driver refuses a grid that cannot be
    resident at once, instead of a hang); the arrival is a fenced gpu-scope atomic, and the wait
    invalidates L1 before the second phase reads what other programs wrote."""
    spec = _spec()
    write_program(tmp_path / "sync", spec, _program(), "cuda", ("cuda", 90, 32))
    assert json.loads((tmp_path / "sync" / "launch0.json").read_text())["launch_cooperative_grid"] is True
    code = sass(tmp_path / "sync" / "launch0.cubin")
    assert "MEMBAR" in code and "ATOMG.E.ADD.STRONG.GPU" in code and "CCTL.IVALL" in code
    from torch_kernelize.lowering.kernels.elementwise import FAMILY
    plain_spec = spec_of(aten.add.Tensor, (torch.randn(64), torch.randn(64)))
    write_program(tmp_path / "plain", plain_spec, FAMILY.generate(plain_spec, FAMILY.seed_configs(plain_spec)[0]),
                  "cuda", ("cuda", 90, 32))
    assert json.loads((tmp_path / "plain" / "launch0.json").read_text())["launch_cooperative_grid"] is False
