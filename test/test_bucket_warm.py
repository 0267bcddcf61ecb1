"""Warming a shape bucket's vendor calls at its sizes when it is bound (serving/bucket_warm.py):
the sizes it visits, the layouts it replays (each step's at that size), its time limit, and that
it runs once per bucket in a process. The CPU tests widen ``vendor_replay.WARM_DEVICES`` to CPU
(the real runs warm CUDA only); test_whole_buckets.py checks the warm of a served graph against
the calls it then makes."""
from __future__ import annotations

import collections

import pytest
import torch

from torch_kernelize.core.program import Buffer, KernelProgram, Launch
from torch_kernelize.core.program_steps import VendorStep
from torch_kernelize.core.sized_programs import Resizer
from torch_kernelize.core.spec import TensorMeta
from torch_kernelize.fill_cache.program_fit import fit_program
from torch_kernelize.serving import bucket_warm, vendor_replay

SOURCE = "import triton\n@triton.jit\ndef k(x, y, n, XBLOCK: tl.constexpr):\n    pass\n"
W = TensorMeta((16, 24), (1, 16), "float32")  # a weight, transposed as cuBLAS sees it


def _program(s: int) -> KernelProgram:
    """Inductor's output at length ``s``, as recorded: a kernel, then ``mm`` of a view of its
    output by the weight into a view of a temporary, the same ``mm`` again (a second layer), a
    ``bmm`` into the output, and a step no library chooses a kernel for (``add``)."""
    launch = Launch("k", (s, 1, 1), (("tmp", 0), ("tmp", 1), ("i32", s)), {"XBLOCK": 16}, 4, 1)
    mm = VendorStep("aten.mm.out", [{"buf": ["tmp", 0], "view": [[2 * s, 16], [16, 1], 0]}, {"buf": ["in", 1]}],
                    {"out": {"buf": ["tmp", 1], "view": [[2 * s, 24], [24, 1], 0]}}, 1)
    bmm = VendorStep("aten.bmm.out", [{"buf": ["tmp", 1], "view": [[2, s, 24], [24 * s, 24, 1], 0]},
                                      {"buf": ["tmp", 2], "view": [[2, 24, s], [24 * s, 1, 24], 0]}],
                     {"out": {"buf": ["out", 0]}}, 1)
    add = VendorStep("aten.add.Tensor", [{"buf": ["tmp", 0]}, {"buf": ["tmp", 0]}], {}, 1)
    return KernelProgram(SOURCE, (launch,), temps=(Buffer((32 * s,), "float32"), Buffer((48 * s,), "float32"),
                                                   Buffer((48 * s,), "float32")), steps=(mm, mm, bmm, add))


def _metas(s: int) -> tuple[tuple, tuple]:
    return (TensorMeta((2, s, 16), (16 * s, 16, 1), "float32"), W), (TensorMeta((2, s, s), (s * s, s, 1), "float32"),)


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch):
    monkeypatch.setattr(bucket_warm, "_warmed", set())
    monkeypatch.setattr(bucket_warm, "stats", collections.Counter())
    monkeypatch.setattr(vendor_replay, "WARM_DEVICES", frozenset({"cpu", "cuda"}))


def test_sizes_go_coarse_to_fine_and_each_comes_once():
    order = list(bucket_warm.coarse_to_fine(33, 64))
    assert sorted(order) == list(range(33, 65))
    assert order[:3] == [33, 64, 49] and set(order[:5]) == {33, 41, 49, 57, 64}
    assert list(bucket_warm.coarse_to_fine(7, 7)) == [7]


def test_each_distinct_warmable_step_is_recorded_with_its_layouts_at_the_size():
    program = Resizer(fit_program({s: _program(s) for s in (4, 5, 6, 8)}))((7,))
    records = bucket_warm.step_records(program, *_metas(7), "cpu")
    assert [r["op"] for r in records] == ["aten.mm.out", "aten.bmm.out"]  # one mm (two steps), no add
    (x, w), out = records[0]["args"], records[0]["kwargs"]["out"]
    assert x["tensor"] == [[14, 16], [16, 1], 0, "float32", "cpu"]
    assert w["tensor"] == [[16, 24], [1, 16], 0, "float32", "cpu"]  # the input's own layout
    assert out["tensor"][:2] == [[14, 24], [24, 1]]
    a, b = records[1]["args"]
    assert (a["tensor"][:2], b["tensor"][:2]) == ([[2, 7, 24], [168, 24, 1]], [[2, 24, 7], [168, 1, 24]])
    assert records[1]["kwargs"]["out"]["tensor"][:2] == [[2, 7, 7], [49, 7, 1]]  # the output's meta
    # a replay runs them as the served call would (zeros of those layouts)
    assert [vendor_replay.replay(r) for r in records] == ["vendor", "vendor"]
    # an input of no known layout at the size: that step is left out, the others are not
    assert [r["op"] for r in bucket_warm.step_records(program, None, _metas(7)[1], "cpu")] == ["aten.bmm.out"]


def test_a_bucket_is_warmed_at_every_size_once_per_process_within_its_time(monkeypatch):
    program = fit_program({s: _program(s) for s in (4, 5, 6, 8)})
    resize = Resizer(program)
    seen = []

    def replay(record):
        seen.append((record["op"], record["args"][0]["tensor"][0][0]))
        return "vendor"

    def at_size(v):
        return resize((v,)), *_metas(v)
    done = bucket_warm.warm_bucket("b", ("key",), 4, 8, at_size, "cpu", 2000, replay)
    assert done["sizes"] == 5 and done["vendor"] == 10 and not done["failed"]
    assert sorted(m for op, m in seen if op == "aten.mm.out") == [8, 10, 12, 14, 16]  # 2 x size rows
    assert bucket_warm.warm_bucket("b", ("key",), 4, 8, at_size, "cpu", 2000, replay) is None  # once
    assert bucket_warm.stats["buckets"] == 1 and bucket_warm.stats["vendor"] == 10

    # its time is spent after two sizes (a clock of one second per reading): the range's ends
    ticks = iter(range(100))
    seen.clear()
    done = bucket_warm.warm_bucket("c", ("other",), 4, 8, at_size, "cpu", 2500, replay, lambda: next(ticks))
    assert done["sizes"] == 2 and sorted({m for op, m in seen if op == "aten.mm.out"}) == [8, 16]
    # a size the program cannot be made at is passed over; off, or a device not warmed: nothing
    assert bucket_warm.warm_bucket("d", ("d",), 4, 5, lambda v: None, "cpu", 2000, replay)["sizes"] == 0
    assert bucket_warm.warm_bucket("e", ("e",), 4, 5, at_size, "cpu", 0, replay) is None
    monkeypatch.setattr(bucket_warm, "_capturing", lambda device: True)  # inside a CUDA graph's capture
    assert bucket_warm.warm_bucket("g", ("g",), 4, 5, at_size, "cpu", 2000, replay) is None
    monkeypatch.undo()
    monkeypatch.setattr(vendor_replay, "WARM_DEVICES", frozenset({"cuda"}))
    assert bucket_warm.warm_bucket("f", ("f",), 4, 5, at_size, "cpu", 2000, replay) is None


def test_a_failing_replay_is_counted_and_the_rest_goes_on():
    program = Resizer(fit_program({s: _program(s) for s in (4, 5, 6, 8)}))
    bad = program((5,))
    records = bucket_warm.step_records(bad, *_metas(5), "cpu")
    records[0]["args"] = records[0]["args"][:1]  # wrong arity
    assert [vendor_replay.replay(r) for r in records] == ["failed", "vendor"]


MM_RECORD = {"op": "aten.mm.default", "args": [{"tensor": [[3, 4], [4, 1], 0, "float32", "cpu"]},
                                               {"tensor": [[4, 5], [1, 4], 0, "float32", "cpu"]}],
             "kwargs": {}, "bytes": 0}


def test_a_replay_inside_a_compiles_fake_mode_runs_on_real_tensors(monkeypatch):
    """A bucket binds while Dynamo compiles, under its FakeTensorMode: a replay there must leave
    it, or the library never sees the call (the H100 traces warmed 3360 fake GEMMs)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    ran = []
    real_run = vendor_replay.Call.run

    def run(call):
        out = real_run(call)
        ran.append(out)
        return out
    monkeypatch.setattr(vendor_replay.Call, "run", run)
    with FakeTensorMode():
        assert torch.zeros(1).__class__ is FakeTensor  # (the mode is on)
        assert vendor_replay.replay(MM_RECORD) == "vendor"
    (out,) = ran
    assert type(out) is torch.Tensor and out.shape == (3, 5) and not out.any()


def test_a_replay_inside_another_trace_is_skipped():
    """Under a mode it cannot leave (a proxy trace's), a replay would be traced, not run."""
    from torch.fx.experimental.proxy_tensor import make_fx
    results = []

    def f(x):
        results.append(vendor_replay.replay(MM_RECORD))
        return x + 1
    gm = make_fx(f)(torch.ones(2))
    assert results == ["skipped"]
    assert "mm" not in str(gm.graph)
