"""The warm-up during Dynamo's tracing (prewarm.py): what an executable records of its vendor
calls, which calls may be replayed on zeros, the program's index, and the compile-start hook.
The CPU tests widen ``vendor_replay.WARM_DEVICES`` to CPU (the real runs warm CUDA only); the
last test replays on CUDA."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_kernelize import backend
from torch_kernelize.serving import vendor_replay
from torch_kernelize.warm_start import prewarm


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch):
    """Each test is a new process to prewarm: not triggered yet, nothing noted, CPU allowed."""
    monkeypatch.setattr(prewarm, "_triggered", False)
    monkeypatch.setattr(prewarm, "_thread", None)
    monkeypatch.setattr(prewarm, "_noted", set())
    monkeypatch.setattr(prewarm, "stats", prewarm.collections.Counter())
    monkeypatch.setattr(vendor_replay, "WARM_DEVICES", frozenset({"cpu", "cuda"}))
    prewarm.install()  # the conftest's torch._dynamo.reset() removed it
    yield
    prewarm.wait()


def routed(x, w, i, noise):
    """mm on a transposed weight, softmax, an index, floor division, sort; and a random op."""
    p = torch.softmax(x @ w.t(), -1)
    return p[i] // 2, x.sort(-1).values, torch.rand_like(noise) + noise


def _inputs():
    torch.manual_seed(0)
    return torch.randn(8, 16), torch.randn(24, 16), torch.tensor([0, 3, 5]), torch.randn(4)


def _compile_and_run(fn=routed, **options):
    torch._dynamo.reset()
    prewarm.install()
    opts = {"target": "interpreter", "repro_dir": "off", **options}
    with torch.no_grad():
        return torch.compile(fn, backend="kernelize", options=opts)(*_inputs())


def _new_process(monkeypatch):
    monkeypatch.setattr(prewarm, "_triggered", False)
    monkeypatch.setattr(prewarm, "_noted", set())
    monkeypatch.setattr(prewarm, "stats", prewarm.collections.Counter())


class _Log(TorchDispatchMode):
    """The ops run in this thread, with their tensor arguments' (shape, stride, dtype) and values."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        self.calls.append((func, [(tuple(t.shape), t.stride(), t.dtype) for t in tensors],
                           all(bool((t == 0).all()) for t in tensors if t.numel())))
        return func(*args, **(kwargs or {}))


def test_an_executable_records_its_warmable_vendor_calls_with_their_layouts():
    _compile_and_run()
    [entry] = prewarm.read_index(prewarm.index_path())
    assert entry["path"].endswith(".exe") and os.path.exists(entry["path"])
    calls = {c["op"]: c for c in entry["vendor"]}
    # the random op is not warmable (a replay would shift the program's random numbers)
    # (a lowered graph sorts stably: compiling/stable_sorts.py)
    assert set(calls) == {"aten.mm.default", "aten._softmax.default", "aten.index.Tensor",
                          "aten.div.Tensor_mode", "aten.sort.stable"}
    x, w = calls["aten.mm.default"]["args"]
    assert x["tensor"][:2] == [[8, 16], [16, 1]]
    assert w["tensor"][:2] == [[16, 24], [1, 16]]  # the transposed weight, as cuBLAS will see it
    assert calls["aten.div.Tensor_mode"]["kwargs"] == {"rounding_mode": "floor"}
    assert calls["aten.mm.default"]["bytes"] == 4 * (8 * 16 + 24 * 16 + 8 * 24)


def test_a_vendor_call_that_reads_a_fused_kernels_output_is_recorded():
    """A fused region's call (and each of its outputs) keeps the traced value of the output it
    replaces, so the vendor calls that read it are recorded like any other (the Llama attention,
    which reads the RoPE kernel's outputs, was not)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_kernelize.serving.runtime import _fuse

    def f(x, w):
        h = torch.sin(x) * 2.0
        return torch.mm(h, w), torch.sort(torch.cos(x) + 1.0).values

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 24))
    nodes = {str(n.target): n for n in gm.graph.nodes}
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    region = [nodes[k] for k in ("aten.sin.default", "aten.mul.Tensor", "aten.cos.default", "aten.add.Tensor")]
    new = _fuse(gm.graph, region, [x], [nodes["aten.mul.Tensor"], nodes["aten.add.Tensor"]], lambda a: (a, a))
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in new.values())
    calls = {c["op"]: c for c in prewarm.vendor_calls(gm)}
    assert set(calls) == {"aten.mm.default", "aten.sort.default"}
    assert calls["aten.mm.default"]["args"][0]["tensor"][:2] == [[8, 16], [16, 1]]
    assert calls["aten.sort.default"]["args"][0]["tensor"][:2] == [[8, 16], [16, 1]]


def test_the_rules_refuse_calls_that_zeros_would_make_unsafe(monkeypatch):
    def call(op, *args, nbytes=0, **kwargs):
        return vendor_replay.Call(op, [vendor_replay.encode(a) for a in args],
                                  {k: vendor_replay.encode(v) for k, v in kwargs.items()},
                            nbytes)
    src, idx = torch.randn(0, 4), torch.zeros(3, dtype=torch.long)
    empty = call(torch.ops.aten.index_select.default, src, 0, idx)
    assert not vendor_replay.WARMABLE["aten.index_select"](empty)  # index 0 of an empty dim is out of bounds
    index_select = torch.ops.aten.index_select.default
    assert vendor_replay.WARMABLE["aten.index_select"](call(index_select, torch.randn(2, 4), 0, idx))
    q = torch.randn(1, 2, 8, 4)
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert not vendor_replay.WARMABLE["aten._scaled_dot_product_flash_attention"](call(flash, q, q, q, 0.1))
    assert vendor_replay.WARMABLE["aten._scaled_dot_product_flash_attention"](call(flash, q, q, q, 0.0, True))
    # a call over the size limit is not recorded
    monkeypatch.setattr(vendor_replay, "MAX_CALL_BYTES", 1100)  # index: 1080 bytes, div 576; the rest more
    _compile_and_run()
    [entry] = prewarm.read_index(prewarm.index_path())
    assert {c["op"] for c in entry["vendor"]} == {"aten.index.Tensor", "aten.div.Tensor_mode"}
    # nor replayed when a record understates it (the header is not covered by the entry's hash)
    mm = call(torch.ops.aten.mm.default, torch.randn(8, 16), torch.randn(16, 24)).to_record()
    prewarm._replay({**mm, "bytes": 0})
    assert prewarm.stats["skipped"] == 1 and not prewarm.stats["vendor"]


def test_replay_runs_each_distinct_call_once_on_zeros_of_the_recorded_layout():
    _compile_and_run()
    [entry] = prewarm.read_index(prewarm.index_path())
    twin = {"path": entry["path"], "vendor": entry["vendor"][::-1]}  # a second executable, same calls
    bogus = {"path": entry["path"], "vendor": [{"op": "aten.mm.default", "args": [{"tensor": [[2, 2], [2, 1], 0,
             "float32", "cpu"]}], "kwargs": {}, "bytes": 16},  # wrong arity: fails, is logged, the rest goes on
             {"op": "aten.nonexistent.default", "args": [], "kwargs": {}, "bytes": 0}]}
    with _Log() as log:
        prewarm._warm([entry, twin, bogus])
    ran = {}
    for func, layouts, zeros in log.calls:
        ran.setdefault(str(func), []).append(layouts)
        assert zeros, f"{func} ran on non-zero inputs"
    assert ran["aten.mm.default"] == [[((8, 16), (16, 1), torch.float32), ((16, 24), (1, 16), torch.float32)]]
    for op in ("aten._softmax.default", "aten.index.Tensor", "aten.div.Tensor_mode", "aten.sort.stable"):
        assert len(ran[op]) == 1, op
    assert prewarm.stats["vendor"] == 5 and prewarm.stats["failed"] == 2


def test_records_that_are_not_objects_are_skipped_with_one_warning(caplog):
    _compile_and_run()
    [entry] = prewarm.read_index(prewarm.index_path())
    bad = {"path": entry["path"], "vendor": [5, "aten.mm.default", [1, 2], None, *entry["vendor"]]}
    with caplog.at_level("WARNING", logger="torch_kernelize"):
        prewarm._warm([{"path": entry["path"], "vendor": 7}, bad])  # the thread's body: it returns
    said = [r.getMessage() for r in caplog.records if "not JSON objects" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("prewarm: 5 vendor call record(s)"), said
    assert prewarm.stats["vendor"] == 5  # the good records behind them still ran


def test_the_index_is_written_only_when_it_changes_and_forgets_when_asked(monkeypatch, tmp_path):
    _compile_and_run()
    path = prewarm.index_path()
    before = os.stat(path)
    _new_process(monkeypatch)
    _compile_and_run()  # an executable-cache hit of a listed executable: nothing written
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    _new_process(monkeypatch)
    _compile_and_run(prewarm=False)  # the option in options: dropped, so the next process warms nothing
    assert prewarm.read_index(path) == []
    # bounded; entries whose executable is gone are dropped
    section = {"format": prewarm.FORMAT, "vendor": []}
    for i in range(prewarm.MAX_EXECUTABLES + 3):
        exe = tmp_path / f"{i}.exe"
        exe.write_bytes(b"")
        prewarm.note(exe, section)
    (tmp_path / f"{prewarm.MAX_EXECUTABLES + 2}.exe").unlink()
    prewarm.note(tmp_path / "last.exe", section)
    paths = [e["path"] for e in prewarm.read_index(path)]
    assert len(paths) == prewarm.MAX_EXECUTABLES and paths[0].endswith("last.exe")
    assert str(tmp_path / f"{prewarm.MAX_EXECUTABLES + 2}.exe") not in paths
    path.write_text("{not json")
    assert prewarm.read_index(path) == []


def test_the_warm_up_starts_when_dynamo_starts_tracing_before_the_backend_runs(monkeypatch):
    _compile_and_run()
    assert prewarm.stats["runs"] == 0  # nothing recorded yet in the first process
    _new_process(monkeypatch)
    seen = []
    real = backend.compile_with_session

    def spy(*a, **k):
        seen.append(prewarm._thread is not None)
        return real(*a, **k)
    monkeypatch.setattr(backend, "compile_with_session", spy)
    out = _compile_and_run()
    prewarm.wait()
    assert seen == [True]
    assert prewarm.stats["runs"] == 1 and prewarm.stats["vendor"] == 5 and not prewarm.stats["failed"]
    ref = routed(*_inputs())
    torch.testing.assert_close(out[:2], ref[:2])  # (the third output is random)


def test_nothing_starts_when_the_environment_turns_it_off_or_the_device_is_not_ready(monkeypatch):
    _compile_and_run()
    _new_process(monkeypatch)
    monkeypatch.setenv("KERNELIZE_PREWARM", "off")
    assert prewarm.start() is None
    monkeypatch.delenv("KERNELIZE_PREWARM")
    monkeypatch.setattr(vendor_replay, "WARM_DEVICES", frozenset({"cuda"}))
    if not torch.cuda.is_initialized():
        assert prewarm.start() is None  # the warm-up never creates a CUDA context
    monkeypatch.setattr(vendor_replay, "WARM_DEVICES", frozenset({"cpu"}))
    monkeypatch.chdir(prewarm.index_path().parent)  # another program (working directory): its own index
    assert prewarm.start() is None
    with pytest.raises(Exception, match="prewarm"):
        from torch_kernelize.core.options import Options
        Options.resolve({"prewarm": "sometimes"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replay_of_the_benchmarks_vendor_calls_leaves_the_context_healthy():
    """The calls the MoE and Llama executables record (fp16 GEMM on a transposed weight, attention,
    softmax, argsort, floor division, indexing), replayed from their records on the GPU."""
    dev = "cuda"
    x, w = torch.randn(64, 32, device=dev, dtype=torch.float16), torch.randn(48, 32, device=dev, dtype=torch.float16)
    q = torch.randn(2, 4, 64, 64, device=dev, dtype=torch.float16)
    logits, ids = torch.randn(64, 16, device=dev), torch.randint(0, 16, (256,), device=dev)
    aten = torch.ops.aten
    calls = [(aten.mm.default, (x, w.t()), {}), (aten._softmax.default, (logits, -1, False), {}),
             (aten.sort.default, (ids,), {}), (aten.div.Tensor_mode, (ids, 4), {"rounding_mode": "floor"}),
             (aten.index.Tensor, (logits, [ids // 16]), {}),
             (aten._scaled_dot_product_efficient_attention.default, (q, q, q, None, False, 0.0, True), {})]
    encode = vendor_replay.encode
    records = [vendor_replay.Call(op, encode(list(a)), {k: encode(v) for k, v in kw.items()}, 0).to_record()
               for op, a, kw in calls]
    torch.cuda.synchronize()
    prewarm._warm([{"path": __file__, "vendor": json.loads(json.dumps(records))}])
    torch.cuda.synchronize()
    assert prewarm.stats["vendor"] == len(calls) and not prewarm.stats["failed"] and not prewarm.stats["skipped"]
