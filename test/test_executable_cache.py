"""The executable cache (option ``executable_cache``): a warm compile rebuilds the bound executable
the normal path would bind (same code, same report, same answers) without planning; any change
to the kernel cache, a repro wanted again or a bad entry takes the normal path; what cannot be
stored (check mode, host fallbacks) never is."""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import last_json, run_python, write_target
from torch_kernelize.warm_start import executable_cache, graph_cache
from torch_kernelize import flush_repros
from torch_kernelize import model_zoo
from torch_kernelize.model_zoo import make_inplace, make_transformer
from torch_kernelize.kernel_cache import KernelCache
from torch_kernelize.kernel_cache.integrity import seal
from torch_kernelize.compiling.lower import LoweredGraph
from torch_kernelize.serving.runtime import TritonCall
from torch_kernelize.serving.view_folding import FoldedView

MODELS = "torch_kernelize.model_zoo"


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Path:
    """An interpreter-target kernel cache filled for the zoo's small model and expert loop."""
    cache = tmp_path_factory.mktemp("filled")
    for model in ("make_small", "make_experts"):
        proc = subprocess.run([sys.executable, "-m", "torch_kernelize.fill_cache", "--quiet", "--model",
                               f"{MODELS}:{model}", "--target", "interpreter", "--cache-dir", str(cache),
                               "--budget", "1"], capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
    return cache


@pytest.fixture
def cache(filled, tmp_path) -> Path:
    """A private copy of the filled cache (tests change it)."""
    shutil.copytree(filled, tmp_path / "cache", ignore=shutil.ignore_patterns("graphs"))
    return tmp_path / "cache"


def _compile(monkeypatch, model, inputs, cache: Path, **options):
    """One compile from scratch and one call: (output, graph cache stats, executable cache stats,
    the LoweredGraphs made)."""
    torch._dynamo.reset()
    lowered: list[LoweredGraph] = []
    publish = LoweredGraph._publish

    def capture(self, *a, **k):
        lowered.append(self)
        return publish(self, *a, **k)
    monkeypatch.setattr(LoweredGraph, "_publish", capture)
    before = graph_cache.stats.copy(), executable_cache.stats.copy()
    options = {"target": "interpreter", "cache_dir": str(cache), "repro_dir": "off", **options}
    with torch.no_grad():
        out = torch.compile(model, backend="kernelize", options=options)(*inputs)
    monkeypatch.setattr(LoweredGraph, "_publish", publish)
    deltas = [{k: v - b.get(k, 0) for k, v in s.items() if v != b.get(k, 0)}
              for s, b in zip((graph_cache.stats, executable_cache.stats), before)]
    return out, deltas[0], deltas[1], lowered


def _targets(lowered: LoweredGraph) -> list:
    return [n.target for n in lowered.static_specialization().gm.graph.nodes if n.op == "call_function"]


def _hit_keys(lowered: LoweredGraph) -> list[str]:
    """The keys of the cached kernels the executable calls."""
    return sorted({t.spec.key for t in _targets(lowered) if isinstance(t, TritonCall)})


MODELS_UNDER_TEST = {
    "small": model_zoo.make_small,        # a fused softmax region, histc
    "experts": model_zoo.make_experts,    # matmul groups
    "transformer": make_transformer,        # folded views, misses
}


@pytest.mark.parametrize("name", list(MODELS_UNDER_TEST))
def test_warm_compile_restores_what_lowering_binds(name, cache, monkeypatch):
    model, inputs = MODELS_UNDER_TEST[name]()
    cold, g1, e1, [lo1] = _compile(monkeypatch, model, inputs, cache)
    assert (g1, e1) == ({"miss": 1, "save": 1}, {"miss": 1, "save": 1})
    warm, g2, e2, [lo2] = _compile(monkeypatch, model, inputs, cache)
    assert (g2, e2) == ({}, {"hit": 1}), "a warm compile neither loads the ATen graph nor plans it"
    assert lo2.plan is None and lo1.plan is not None
    assert lo2.static_specialization().gm.code == lo1.static_specialization().gm.code
    # the same generated code too: the vendor ops' bindings were stored (no traced values to choose them)
    assert lo2.static_specialization()._forward.source == lo1.static_specialization()._forward.source
    assert [d.to_json() for d in lo2.report.decisions] == [d.to_json() for d in lo1.report.decisions]
    assert [d.to_json() for d in lo2.report.regions] == [d.to_json() for d in lo1.report.regions]
    kinds = {type(t) for t in _targets(lo2)}
    if name in ("small", "experts"):
        assert TritonCall in kinds and _hit_keys(lo2)
    if name == "transformer":
        assert FoldedView in kinds
    torch.testing.assert_close(warm, cold, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(warm, model(*inputs), rtol=1e-4, atol=1e-5)


def test_restored_graph_writes_its_inputs_as_the_normal_path(cache, monkeypatch):
    model, (x,) = make_inplace()  # writes its buffer under no_grad
    ref, _ = make_inplace()
    _compile(monkeypatch, model, (x,), cache)
    out, _, e2, [lo] = _compile(monkeypatch, model, (x,), cache)
    assert e2 == {"hit": 1}
    assert lo.mutated_inputs, "CUDA graphs must know which inputs the graph writes"
    with torch.no_grad():
        ref(x)
        torch.testing.assert_close(out, ref(x))
    torch.testing.assert_close(model.state_dict(), ref.state_dict())


def _remove(cache: KernelCache, key: str) -> None:
    cache.remove(key)


def _corrupt(cache: KernelCache, key: str) -> None:
    program = next(p for p in (cache.entry_dir(key) / "program").rglob("*") if p.is_file())
    program.write_bytes(program.read_bytes() + b"\n# changed\n")


def _rewrite(cache: KernelCache, key: str) -> None:
    """The same bytes put again (a new folder): a process that verified the old one cannot vouch for it."""
    folder = cache.entry_dir(key)
    copy = folder.with_name(".copy")
    shutil.copytree(folder, copy)
    shutil.rmtree(folder)
    copy.rename(folder)


@pytest.mark.parametrize("change,after", [(_remove, {"stale": 1, "save": 1}),
                                          (_corrupt, {"stale": 1, "bypass": 1}),
                                          (_rewrite, {"stale": 1, "save": 1})])
def test_a_changed_kernel_cache_takes_the_normal_path(change, after, cache, monkeypatch):
    model, inputs = model_zoo.make_small()
    _, _, _, [lo1] = _compile(monkeypatch, model, inputs, cache)
    key = _hit_keys(lo1)[0]
    kc = KernelCache(cache, next(p.name for p in cache.iterdir() if p.name.startswith("interpreter")))
    change(kc, key)
    out, g2, e2, [lo2] = _compile(monkeypatch, model, inputs, cache)
    assert (g2, e2) == ({"hit": 1}, after)
    assert lo2.plan is not None
    assert (key in _hit_keys(lo2)) == (change is _rewrite)
    with torch.no_grad():
        for o, r in zip(out, model(*inputs)):
            torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
    if after.get("save"):
        _, _, e3, _ = _compile(monkeypatch, model, inputs, cache)
        assert e3 == {"hit": 1}


def test_filling_a_miss_makes_the_entry_stale(cache, monkeypatch):
    """A warm process must run the kernels filled since: a miss is witnessed as absent."""
    model, inputs = make_transformer()
    _, _, _, [lo1] = _compile(monkeypatch, model, inputs, cache)
    miss = next(d for d in lo1.report.decisions if d.miss)
    kc = KernelCache(cache, next(p.name for p in cache.iterdir() if p.name.startswith("interpreter")))
    kc.put({"key": miss.spec_key, "spec": miss.spec.to_json(), "winner": "vendor",
            "validation": {}, "timings": {"speedup": 0.5, "measured": True}})
    _, g2, e2, [lo2] = _compile(monkeypatch, model, inputs, cache)
    assert (g2, e2) == ({"hit": 1}, {"stale": 1, "save": 1})
    assert not any(d.miss and d.spec_key == miss.spec_key for d in lo2.report.decisions)


def test_check_mode_and_host_fallbacks_are_never_stored(cache, tmp_path, monkeypatch):
    model, inputs = model_zoo.make_small()
    _, _, e1, _ = _compile(monkeypatch, model, inputs, cache, check=True)
    _, _, e2, _ = _compile(monkeypatch, model, inputs, cache, check=True)
    assert e1 == e2 == {"miss": 1, "bypass": 1}
    chip = write_target(tmp_path / "chip.toml", unsupported=["aten.histc"], triton="none")
    _, _, e3, [lo] = _compile(monkeypatch, model, inputs, cache, target=str(chip))
    assert any(d.tier == "fallback" for d in lo.report.decisions)
    assert e3 == {"miss": 1, "bypass": 1}
    assert not list((cache / "graphs").glob(f"*{executable_cache.SUFFIX}"))


def test_a_miss_whose_repro_is_wanted_again_takes_the_normal_path(cache, tmp_path, monkeypatch):
    model, inputs = make_transformer()
    repros = tmp_path / "repros"
    runs = [_compile(monkeypatch, model, inputs, cache, repro_dir=str(repros))[2] for _ in range(3)]
    # the first call writes the misses' repros (so nothing is stored); then stored; then a hit
    assert runs == [{"miss": 1, "bypass": 1}, {"miss": 1, "save": 1}, {"hit": 1}]
    assert flush_repros(120), "the first call's repros are still being written"
    shutil.rmtree(repros)
    from torch_kernelize.serving import repro_recorder as recorder
    recorder.budget = recorder.MissBudget()  # a new process: a miss is recorded once per process
    _, _, e4, _ = _compile(monkeypatch, model, inputs, cache, repro_dir=str(repros))
    assert e4 == {"stale": 1, "bypass": 1}
    assert flush_repros(120) and any(repros.iterdir()), "the wanted repros are written again"


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _garbage(path: Path, marker: Path) -> None:
    path.write_bytes(b"not an entry")


def _flipped(path: Path, marker: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _foreign_global(path: Path, marker: Path) -> None:
    """A well-sealed payload that names a function: the unpickler must refuse to build it."""
    header = json.loads(path.read_bytes().split(b"\n")[1])
    path.write_bytes(seal(executable_cache._MAGIC, {k: header[k] for k in ("format", "key")},
                          pickle.dumps(_Evil(marker))))


class _OpsRef:
    """Stands for ``torch.ops.import_module.__call__.__call__``: an "op" reference three attributes
    down ``torch.ops`` that is no operator, which pickle's REDUCE would call."""

    def __call__(self, *args):
        raise AssertionError("never called here")


class _CallOpsRef:
    def __init__(self, module: str):
        self.module = module

    def __reduce__(self):
        return (_OPS_REF, (self.module,))


_OPS_REF = _OpsRef()


class _RefPickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("op", "import_module.__call__.__call__") if obj is _OPS_REF else None


def _ops_attribute(path: Path, marker: Path) -> None:
    """A well-sealed payload whose "op" reference resolves to torch.ops.import_module, called on a
    module (in marker's folder, on sys.path) that leaves ``marker`` when imported."""
    module = f"kernelize_planted_{os.getpid()}_{marker.parent.name}"
    (marker.parent / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    header = json.loads(path.read_bytes().split(b"\n")[1])
    buf = io.BytesIO()
    _RefPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(_CallOpsRef(module))
    path.write_bytes(seal(executable_cache._MAGIC, {k: header[k] for k in ("format", "key")}, buf.getvalue()))


def _fifo(path: Path, marker: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("corrupt", [_garbage, _flipped, _foreign_global, _ops_attribute, _fifo])
def test_bad_entry_is_ignored_with_one_warning_and_rewritten(corrupt, cache, tmp_path, monkeypatch, caplog):
    monkeypatch.syspath_prepend(str(tmp_path))
    model, inputs = model_zoo.make_small()
    cold, *_ = _compile(monkeypatch, model, inputs, cache)
    [entry] = (cache / "graphs").glob(f"*{executable_cache.SUFFIX}")
    marker = tmp_path / "ran"
    corrupt(entry, marker)
    out, g2, e2, _ = _compile(monkeypatch, model, inputs, cache)
    assert (g2, e2) == ({"hit": 1}, {"corrupt": 1, "save": 1})
    assert "executable cache entry" in caplog.text and "is ignored" in caplog.text
    assert not marker.exists()
    for o, c in zip(out, cold):
        torch.testing.assert_close(o, c, rtol=0, atol=0)
    _, _, e3, _ = _compile(monkeypatch, model, inputs, cache)
    assert e3 == {"hit": 1}


def test_key_follows_options_and_target(cache, tmp_path, monkeypatch):
    model, inputs = model_zoo.make_small()
    _compile(monkeypatch, model, inputs, cache)
    _, _, e2, _ = _compile(monkeypatch, model, inputs, cache, strict=True)
    _, _, e3, _ = _compile(monkeypatch, model, inputs, cache, target=str(write_target(tmp_path / "chip.toml")))
    _, _, e4, _ = _compile(monkeypatch, model, inputs, cache, executable_cache=False)
    assert e2 == e3 == {"miss": 1, "save": 1} and e4 == {}
    assert len(list((cache / "graphs").glob(f"*{executable_cache.SUFFIX}"))) == 3
    # a report does not change what is bound; CUDA graphs may (a node that syncs is looked up under
    # its GRAPHED key first: compiling/graphed_lookups.py), so they are an entry of their own
    report = tmp_path / "report.json"
    _, _, e5, _ = _compile(monkeypatch, model, inputs, cache, report=str(report))
    assert e5 == {"hit": 1}
    assert json.loads(report.read_text())["graphs"][0]["summary"]["fused_regions"] == 1
    _, _, e6, _ = _compile(monkeypatch, model, inputs, cache, cudagraphs=True)
    assert e6 == {"miss": 1, "save": 1}


WARM_SNIPPET = """
import json, logging, sys, torch
logging.basicConfig(level=logging.INFO)
from torch_kernelize.warm_start import executable_cache
from torch_kernelize import model_zoo
model, inputs = model_zoo.make_experts()
compiled = torch.compile(model, backend="kernelize", options={{"target": "interpreter", "repro_dir": "off",
                                                              "cache_dir": {cache!r}}})
with torch.no_grad():
    out = compiled(*inputs)
print(json.dumps({{"stats": dict(executable_cache.stats), "out": out.tolist()}}))
"""


@pytest.mark.slow
def test_fresh_process_runs_the_executable_an_earlier_process_stored(cache):
    code = WARM_SNIPPET.format(cache=str(cache))
    cold, warm = run_python(code), run_python(code)
    c, w = last_json(cold), last_json(warm)
    assert c["stats"] == {"miss": 1, "save": 1} and w["stats"] == {"hit": 1}
    assert "executable cache hit" in warm.stderr and "triton" in warm.stderr
    assert w["out"] == c["out"]


def test_a_kernel_that_does_not_load_is_never_stored_nor_restored(cache, monkeypatch):
    """A kernel that fails to load runs on the vendor op in this process; a later process tries
    again: so such an executable is not stored, and a stored one whose kernel fails is stale."""
    import torch_kernelize.serving.launch as launch
    from torch_kernelize.compiling.lower import Session

    model, inputs = model_zoo.make_small()
    real = launch.load_program

    def failing(directory, spec, *a, **k):
        if spec.op == "aten.histc.default":
            raise OSError("simulated: the binary cannot be read")
        return real(directory, spec, *a, **k)

    monkeypatch.setattr(Session, "_runners", {})
    monkeypatch.setattr(launch, "load_program", failing)
    _, _, e1, [lo] = _compile(monkeypatch, model, inputs, cache)
    assert e1 == {"miss": 1, "bypass": 1}
    assert any(d.op == "aten.histc.default" and d.tier == "vendor" for d in lo.report.decisions)

    monkeypatch.setattr(Session, "_runners", {})  # a new process
    monkeypatch.setattr(launch, "load_program", real)
    _, _, e2, _ = _compile(monkeypatch, model, inputs, cache)
    assert e2 == {"miss": 1, "save": 1}
    monkeypatch.setattr(Session, "_runners", {})
    monkeypatch.setattr(launch, "load_program", failing)
    out, _, e3, [lo] = _compile(monkeypatch, model, inputs, cache)
    assert e3 == {"stale": 1, "bypass": 1}
    with torch.no_grad():
        for o, r in zip(out, model(*inputs)):
            torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
