"""The graph cache (option ``graph_cache``): a warm process loads the ATen graph instead of running
aot_autograd; the key follows the graph, its inputs and the versions; bad entries are ignored;
graphs whose aot_autograd wrapper has work to do are never stored."""
from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import last_json, run_python, write_target
from torch_kernelize.warm_start import graph_cache
from torch_kernelize.model_zoo import make_conv1d, make_inplace, make_mlp, make_transformer
from torch_kernelize.core.options import Options


def _entries(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "graphs").glob(f"*{graph_cache.SUFFIX}"))


def _run(model, inputs, cache_dir: Path, grad: bool = False, **options):
    """One compile from scratch (Dynamo reset) and one call; returns (output, stats delta)."""
    torch._dynamo.reset()
    before = graph_cache.stats.copy()
    # the executable cache above this one would answer a warm compile first: its own tests cover it
    options = {"target": "cpu", "cache_dir": str(cache_dir), "repro_dir": "off", "executable_cache": False,
               **options}
    compiled = torch.compile(model, backend="kernelize", options=options)
    with torch.set_grad_enabled(grad):
        out = compiled(*inputs)
    delta = {k: v - before.get(k, 0) for k, v in graph_cache.stats.items() if v != before.get(k, 0)}
    return out, delta


@pytest.mark.parametrize("make", [make_mlp, make_conv1d, make_transformer])
def test_second_compile_loads_the_graph_and_matches(make, tmp_path):
    model, inputs = make()
    with torch.no_grad():
        ref = model(*inputs)
    cold, s1 = _run(model, inputs, tmp_path)
    assert s1 == {"miss": 1, "save": 1}
    assert len(_entries(tmp_path)) == 1
    warm, s2 = _run(model, inputs, tmp_path)
    assert s2 == {"hit": 1}
    off, s3 = _run(model, inputs, tmp_path, graph_cache="off")
    assert s3 == {}
    torch.testing.assert_close(warm, cold, rtol=0, atol=0)
    torch.testing.assert_close(off, cold, rtol=0, atol=0)
    torch.testing.assert_close(cold, ref, rtol=1e-5, atol=1e-5)


def test_hit_is_lowered_for_each_target(tmp_path):
    """The entry is the ATen graph before lowering: a target without gelu decomposes it on a hit too."""
    model, inputs = make_mlp()
    report = tmp_path / "report.json"
    chip = write_target(tmp_path / "chip.toml", unsupported=["aten.gelu"], triton="none")
    _run(model, inputs, tmp_path)  # stored while compiling for the cpu target
    out, stats = _run(model, inputs, tmp_path, target=str(chip), report=str(report))
    assert stats == {"hit": 1}
    nodes = json.loads(report.read_text())["graphs"][0]["nodes"]
    assert any(n["op"] == "aten.gelu.default" and n["tier"] == "decompose" for n in nodes), nodes
    with torch.no_grad():
        torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)


def _probe(fn, *inputs, grad: bool = False, **compile_kw) -> graph_cache.Probe:
    probes = []

    def backend(gm, example_inputs):
        probes.append(graph_cache.probe(gm, example_inputs))
        return gm.forward
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        torch.compile(fn, backend=backend, **compile_kw)(*inputs)
    assert len(probes) == 1
    return probes[0]


def test_key_follows_graph_inputs_state_and_sources(monkeypatch):
    model, (x,) = make_mlp()
    key = _probe(model, x).key
    assert key is not None and _probe(model, x).key == key, "the key must be deterministic"
    conv, (c,) = make_conv1d()
    changed = {
        "shape": _probe(model, torch.randn(4, 32)).key,
        "dtype": _probe(make_mlp()[0].double(), x.double()).key,
        "model": _probe(conv, c).key,
        "code": _probe(lambda t: model(t) * 2, x).key,
        "grad mode": _probe(model, x, grad=True).key,
        "requires_grad": _probe(model, x.clone().requires_grad_()).key,
        "layout": _probe(model, x.t().contiguous().t()).key,
    }
    monkeypatch.setattr(graph_cache, "_source_hash", lambda: "another kernelize")
    changed["kernelize sources"] = _probe(model, x).key
    for what, k in changed.items():
        assert k is not None and k != key, f"the key did not change with the {what}"
    assert len(set(changed.values())) == len(changed)


def test_key_of_a_lazy_module_is_the_key_of_its_code():
    """Dynamo hands over lazy modules; keying one must not compile it, nor change the key."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    def f(x):
        return torch.relu(x) * 2 + x.sum()
    x = torch.randn(4, 8)
    gm = torch.fx.symbolic_trace(f)
    for n in gm.graph.find_nodes(op="placeholder"):
        n.meta["val"] = x
    lazy = _LazyGraphModule(gm, gm.graph)
    assert lazy._needs_recompile()
    key = graph_cache._probe(gm, [x]).key
    assert key is not None and graph_cache._probe(lazy, [x]).key == key
    assert lazy._needs_recompile(), "keying compiled the module's code"


def test_warm_compile_generates_code_only_for_the_graph_it_runs(tmp_path, monkeypatch):
    """A graph-cache hit is lowered without FX codegen (each costs ~10 ms on a graph of 300 nodes):
    neither the loaded nor the planned nor the bound copy is compiled by FX (the bound graph runs
    as runtime's own flat function, flat_code.py), and the loaded ATen graph's code is still
    there for the repro tools."""
    model, inputs = make_transformer()
    _run(model, inputs, tmp_path)
    from torch_kernelize import backend
    compiled, inside = [], []
    real, compile_with_session = torch.fx.GraphModule.recompile, backend.compile_with_session

    def counting(gm):
        if inside:  # Dynamo's own module is compiled before the backend is called
            compiled.append(gm)
        return real(gm)

    def in_backend(*a, **k):
        inside.append(True)
        try:
            return compile_with_session(*a, **k)
        finally:
            inside.pop()
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counting)
    monkeypatch.setattr(backend, "compile_with_session", in_backend)
    loaded = []
    load = graph_cache.GraphCache.load
    monkeypatch.setattr(graph_cache.GraphCache, "load", lambda *a: loaded.append(load(*a)) or loaded[-1])
    out, stats = _run(model, inputs, tmp_path)
    assert stats == {"hit": 1}
    assert not compiled, [type(gm).__name__ for gm in compiled]
    with torch.no_grad():
        torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)
    assert "def forward" in loaded[0].gm.code  # generated when asked for (the repro writer does)


def test_dynamic_shapes_are_not_keyed():
    model, (x,) = make_mlp()
    p = _probe(model, x, dynamic=True)
    assert p.key is None and "static shape" in p.reason


def _corrupt_garbage(path: Path, other: Path) -> None:
    path.write_bytes(b"\x00garbage")


def _corrupt_flip_payload(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_other_key(path: Path, other: Path) -> None:
    path.write_bytes(other.read_bytes())  # a whole, valid entry, but of another graph


def _corrupt_fifo(path: Path, other: Path) -> None:
    path.unlink()
    os.mkfifo(path)  # read as it was, every compile would wait for a writer forever


@pytest.mark.parametrize("corrupt", [_corrupt_garbage, _corrupt_flip_payload, _corrupt_other_key, _corrupt_fifo])
def test_bad_entry_is_ignored_with_one_warning_and_rewritten(corrupt, tmp_path, caplog):
    model, inputs = make_mlp()
    other, other_inputs = make_conv1d()
    _run(other, other_inputs, tmp_path)
    [other_entry] = _entries(tmp_path)
    cold, _ = _run(model, inputs, tmp_path)
    [entry] = [p for p in _entries(tmp_path) if p != other_entry]
    corrupt(entry, other_entry)
    graph_cache._warned.clear()
    with caplog.at_level(logging.WARNING, logger="torch_kernelize.warm_start.graph_cache"):
        out, stats = _run(model, inputs, tmp_path)
    warnings = [r for r in caplog.records if r.name == "torch_kernelize.warm_start.graph_cache"]
    assert len(warnings) == 1 and "is ignored" in warnings[0].getMessage(), warnings
    assert stats == {"corrupt": 1, "save": 1}
    torch.testing.assert_close(out, cold, rtol=0, atol=0)
    again, stats = _run(model, inputs, tmp_path)
    assert stats == {"hit": 1}, "the normal path should have rewritten the entry"
    torch.testing.assert_close(again, cold, rtol=0, atol=0)


def test_training_graphs_take_the_normal_path(tmp_path):
    model, (x,) = make_mlp()
    ref, _ = make_mlp()
    model.train(), ref.train()
    for _ in range(2):
        out, stats = _run(model, (x,), tmp_path, grad=True)
        assert "save" not in stats and "hit" not in stats
        out.square().mean().backward()
    ref(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert _entries(tmp_path) == []
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class _WritesInput(nn.Module):
    """Writes its input in place (an in-graph copy_ that autograd sees: a version-counter bump)."""

    def forward(self, x, acc):
        acc.add_(x)
        return acc * 2


class _ReturnsWrittenInput(nn.Module):
    """Returns the input it wrote (as a graph break after an accumulation does): the caller gets its own tensor."""

    def forward(self, x, acc, idx):
        acc.index_add_(0, idx, x)
        return acc, x.sum()


def test_graph_that_writes_its_inputs_is_cached_and_writes_them(tmp_path):
    model, (x,) = make_inplace()  # writes its buffer under no_grad
    ref, _ = make_inplace()
    _, s1 = _run(model, (x,), tmp_path)
    out, s2 = _run(model, (x,), tmp_path)
    assert (s1, s2) == ({"miss": 1, "save": 1}, {"hit": 1})
    with torch.no_grad():
        ref(x)
        torch.testing.assert_close(out, ref(x))
    torch.testing.assert_close(model.state_dict(), ref.state_dict())

    acc, acc_cold, x = torch.zeros(4), torch.zeros(4), torch.ones(4)
    _, s1 = _run(_WritesInput(), (x, acc_cold), tmp_path, grad=True)
    out, s2 = _run(_WritesInput(), (x, acc), tmp_path, grad=True)
    assert (s1, s2) == ({"miss": 1, "save": 1}, {"hit": 1})
    assert acc.tolist() == acc_cold.tolist() == [1.0] * 4 and out.tolist() == [2.0] * 4
    assert acc._version == acc_cold._version, "version counters must move as after aot_autograd's wrapper"

    acc, acc_cold, x, idx = torch.zeros(3), torch.zeros(3), torch.ones(2), torch.tensor([0, 2])
    (cold_acc, _), s1 = _run(_ReturnsWrittenInput(), (x, acc_cold, idx), tmp_path)
    (warm_acc, total), s2 = _run(_ReturnsWrittenInput(), (x, acc, idx), tmp_path)
    assert (s1, s2) == ({"miss": 1, "save": 1}, {"hit": 1})
    assert cold_acc is acc_cold and warm_acc is acc, "an input returned as is must be the caller's object"
    assert acc.tolist() == acc_cold.tolist() == [1.0, 0.0, 1.0] and total.item() == 2.0


class _AliasingOutput(nn.Module):
    def forward(self, x):
        return x.t(), x * 2  # aot_autograd regenerates the view of the input at run time


def test_output_aliasing_an_input_takes_the_normal_path(tmp_path):
    model, x = _AliasingOutput(), torch.randn(3, 4)
    for _ in range(2):
        (t, y), stats = _run(model, (x,), tmp_path)
        assert stats == {"miss": 1, "bypass": 1}
        assert t._base is x or t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        torch.testing.assert_close(y, x * 2)
    assert _entries(tmp_path) == []


@pytest.mark.parametrize("field,value", [
    ("num_mutated_inp_runtime_indices", 1), ("num_intermediate_bases", 1), ("tokens", {0: None}),
    ("is_rng_op_functionalized", True), ("grad_enabled_mutation", True)])
def test_graphs_whose_runtime_wrapper_has_work_are_not_stored(field, value, tmp_path, monkeypatch):
    """The metadata aot_autograd gives the compiler decides; each unsafe field alone refuses."""
    real = graph_cache._tracing_context

    def patched():
        ctx = real()
        if ctx is not None and getattr(ctx, "fw_metadata", None) is not None:
            meta = copy.copy(ctx.fw_metadata)
            object.__setattr__(meta, field, value)
            ctx = copy.copy(ctx)
            ctx.fw_metadata = meta
        return ctx
    monkeypatch.setattr(graph_cache, "_tracing_context", patched)
    model, inputs = make_mlp()
    _, stats = _run(model, inputs, tmp_path)
    assert stats == {"miss": 1, "bypass": 1}
    assert _entries(tmp_path) == []


def test_graph_cache_option(tmp_path, monkeypatch):
    assert Options.resolve({"cache_dir": str(tmp_path)}).graph_cache_dir == tmp_path / "graphs"
    assert Options.resolve({"graph_cache": "off"}).graph_cache_dir is None
    assert Options.resolve({"graph_cache": str(tmp_path / "g")}).graph_cache_dir == tmp_path / "g"
    monkeypatch.setenv("KERNELIZE_GRAPH_CACHE", "off")
    assert Options.resolve().graph_cache_dir is None
    assert Options.resolve({"graph_cache": "auto", "cache_dir": str(tmp_path)}).graph_cache_dir == tmp_path / "graphs"
    model, inputs = make_mlp()
    _, stats = _run(model, inputs, tmp_path)
    assert stats == {} and not (tmp_path / "graphs").exists()


WARM_SNIPPET = """
import json, logging, torch
logging.basicConfig(level=logging.INFO)
from torch_kernelize.warm_start import graph_cache
from torch_kernelize.model_zoo import SMALL_MODELS
model, inputs = SMALL_MODELS[{name!r}]()
compiled = torch.compile(model, backend="kernelize", options={{"target": "cpu", "repro_dir": "off"}})
with torch.no_grad():
    out = compiled(*inputs)
print(json.dumps({{"stats": dict(graph_cache.stats), "out": out.tolist()}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformer", "demo"])
def test_fresh_process_uses_the_graphs_an_earlier_process_stored(name, tmp_path):
    """The real use: a new process (cache dir from $KERNELIZE_CACHE_DIR) skips aot_autograd."""
    env = {"KERNELIZE_EXECUTABLE_CACHE": "off"}  # (which would answer the warm process first)
    cold = run_python(WARM_SNIPPET.format(name=name), env=env)
    warm = run_python(WARM_SNIPPET.format(name=name), env=env)
    off = run_python(WARM_SNIPPET.format(name=name), env={**env, "KERNELIZE_GRAPH_CACHE": "off"})
    c, w, o = last_json(cold), last_json(warm), last_json(off)
    assert c["stats"].get("save", 0) >= 1 and "hit" not in c["stats"], c["stats"]
    assert w["stats"].get("hit") == c["stats"]["save"] and "save" not in w["stats"], w["stats"]
    assert "graph cache hit" in warm.stderr
    assert o["stats"] == {}
    assert w["out"] == c["out"] == o["out"]
