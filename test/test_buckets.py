"""Shape buckets from fill to serving (interpreter target): one kernel validated over a range of
sizes serves every size in it, with no lowering and no disk access for a new size; exact-shape
entries win; outside every bucket the vendor runs; misses are recorded once per bucket."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torch_kernelize.core import buckets as B
from torch_kernelize import flush_repros
from torch_kernelize.backend import compile_with_session
from torch_kernelize.fill_cache.buckets import BucketWork, DynamicDim, inside_sizes
from torch_kernelize.fill_cache.builder import Builder
from torch_kernelize.fill_cache.cli import FillRun, main as fill_main
from torch_kernelize.kernel_cache import KernelCache
from torch_kernelize.compiling.lower import Session
from torch_kernelize.lowering.kernels.elementwise import ElementwiseFamily
from torch_kernelize.core.targets import Target, get_target
from torch_kernelize.core.options import Options
from torch_kernelize.core.spec import KernelSpec

MODEL = '''
import torch
class M(torch.nn.Module):
    def forward(self, x):
        return torch.sigmoid(x)
def make():
    return M(), (torch.randn({rows}, 16),)
'''


def _model_file(tmp_path: Path, rows: int = 6) -> str:
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(rows=rows))
    return f"{path}:make"


def _fill(tmp_path: Path, *args: str) -> int:
    return fill_main(["--target", "interpreter", "--cache-dir", str(tmp_path / "cache"), "--quiet", "--budget", "1",
                      *args])


def _serving(tmp_path: Path, fn=torch.sigmoid, **options):
    """``fn`` compiled with dynamic shapes, and the LoweredGraphs it made."""
    opts = Options.resolve({"target": "interpreter", "cache_dir": str(tmp_path / "cache"),
                            "repro_dir": str(tmp_path / "repros"), "graph_cache": "off", **options})
    session, graphs = Session(opts), []
    compiled = torch.compile(fn, dynamic=True,
                             backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    return compiled, graphs


def _decision(graphs, rows: int):
    (g,) = graphs
    (spec,) = [s for k, s in g.specializations().items() if rows in k]
    (d,) = [d for d in spec.decisions if d.op == "aten.sigmoid.default"]
    return d


def test_a_filled_bucket_serves_every_size_in_it_exact_entries_win_and_outside_runs_on_vendor(tmp_path, monkeypatch):
    # the model's example shape (6, 16) gets an exact entry; --dynamic fills the bucket 5-8 around it
    assert _fill(tmp_path, "--model", _model_file(tmp_path), "--dynamic", "0:0:5-8") == 0
    cache = KernelCache.for_target(tmp_path / "cache", get_target("interpreter"))
    entries = list(cache.entries())
    (bucket,) = [e for e in entries if e.bucket is not None]
    assert bucket.bucket.ranges == ((5, 8),) and bucket.winner == "triton"
    assert bucket.record["bucket"]["validated_sizes"][:2] == [[5], [8]]  # both edges, then inside
    assert bucket.spec.inputs[0].shape == (8, 16)  # the representative: the upper edge
    exact = {e.key for e in entries if e.bucket is None}

    compiled, graphs = _serving(tmp_path)
    import torch_kernelize.compiling.lower as lower_mod
    from torch_kernelize.core.sized_programs import SizeSource
    handed, direct = [], lower_mod._bucket_direct
    monkeypatch.setattr(lower_mod, "_bucket_direct", lambda *a: handed.append(a[2]) or direct(*a))
    with torch.no_grad():
        x = torch.randn(5, 16)
        torch.testing.assert_close(compiled(x), torch.sigmoid(x))  # planned: the bucket's kernel loaded now
        # the node's bucket is offered one generated call of every size (CUDA makes it): its output's rows as source
        assert [o.shape for (o,) in handed] == [(SizeSource("v[0]"), 16)]
        import torch_kernelize.serving.launch as launch
        import torch_kernelize.lowering.kernels.elementwise as elementwise

        def forbidden(*a, **k):
            raise AssertionError("a new size inside a filled bucket must not read the cache or generate code")
        monkeypatch.setattr(launch, "load_program", forbidden)
        monkeypatch.setattr(KernelCache, "_read", forbidden)
        monkeypatch.setattr(KernelCache, "keys", forbidden)
        monkeypatch.setattr(elementwise.ElementwiseFamily, "generate_bucketed", forbidden)
        monkeypatch.setattr(elementwise.ElementwiseFamily, "generate", forbidden)
        for rows in (7, 8):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), torch.sigmoid(x))
        monkeypatch.undo()
        for rows in (6, 9):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), torch.sigmoid(x))
    for rows in (5, 7, 8):
        d = _decision(graphs, rows)
        assert d.tier == "triton" and d.entry.key == bucket.key and "bucket" in d.reason
    six = _decision(graphs, 6)
    assert six.tier == "triton" and six.entry.key == six.spec_key and six.spec_key in exact  # exact wins
    nine = _decision(graphs, 9)
    assert nine.tier == "vendor" and nine.miss


class _WrongAt(ElementwiseFamily):
    """Elementwise kernels that add 1 to every output when the number of outputs is ``bad``."""
    name = "elementwise_wrong_at"

    def __init__(self, bad: int):
        self.bad = bad

    def generate_bucketed(self, spec, config, dims):
        p = super().generate_bucketed(spec, config, dims)
        src = p.source.replace("tl.store(out0_ptr + idx, y,", f"tl.store(out0_ptr + idx, tl.where(n_elements == {self.bad}, y + 1.0, y),")
        assert src != p.source
        import dataclasses
        return dataclasses.replace(p, source=src)


@pytest.mark.parametrize("bad_rows", [8, 5], ids=["upper-edge", "lower-edge"])
def test_a_candidate_wrong_only_at_one_edge_of_its_bucket_is_rejected(tmp_path, bad_rows):
    target = get_target("interpreter")
    cache = KernelCache.for_target(tmp_path / "cache", target)
    x = torch.randn(8, 16)
    spec = KernelSpec.from_call(torch.ops.aten.sigmoid.default, [x], {}, torch.sigmoid(x))
    dims = (("in", 0, 0, 0), ("out", 0, 0, 0))
    work = BucketWork(spec, dims, ((5, 8),), "test")
    run = FillRun(target, cache, 1, False, False, 1.03)
    row = run.process_bucket(work, Builder(target), _WrongAt(bad_rows * 16))
    assert row["status"] == "no correct candidate"
    if bad_rows == 5:  # (with the failure's details, past the 120 characters that group alike failures)
        assert "at sizes [5]" in row["winner"] and "first at index" in row["winner"][120:]
    assert cache.lookup(work.key)[0] == "miss"
    # the same kernel without the fault is stored, with the sizes it was validated at
    row = run.process_bucket(work, Builder(target), ElementwiseFamily())
    assert row["status"] == "stored"
    assert cache.get(work.key).record["bucket"]["validated_sizes"] == [list(v) for v in inside_sizes(((5, 8),), work.key)]


def _sigmoid_bucket() -> BucketWork:
    x = torch.randn(8, 16)
    spec = KernelSpec.from_call(torch.ops.aten.sigmoid.default, [x], {}, torch.sigmoid(x))
    return BucketWork(spec, (("in", 0, 0, 0), ("out", 0, 0, 0)), ((5, 8),), "test")


@pytest.mark.parametrize("chip", [False, True], ids=["vendor-runs-it", "vendor-lacks-it"])
def test_a_bucket_is_decided_by_the_store_policy_a_chip_without_the_op_keeps_the_fastest_candidate(
        tmp_path, monkeypatch, chip):
    """As for a plain spec (test_store_policy.py): a bucket's best candidate, timed at half the
    vendor kernel's speed (faked) and timed again as a near tie, is "vendor wins" where the
    target's vendor runs the op; on a chip whose vendor does not run it, "vendor wins" would leave
    the op to the host fallback, so the fastest correct candidate is stored whatever its speed."""
    import torch_kernelize.fill_cache.measure as measure
    confirmed = []
    monkeypatch.setattr(measure, "timing_available", lambda t: True)  # time on the interpreter: faked
    monkeypatch.setattr(measure, "median_ms", lambda fn: 2.0)
    monkeypatch.setattr(measure.Measurer, "vendor_ms", lambda self: 1.0)
    monkeypatch.setattr(measure, "paired_ms", lambda v, c, rounds: confirmed.append(rounds) or (1.0, 2.0))
    target = (Target("chip", device="cpu", triton="interpreter", supported=frozenset(["aten.mul"])) if chip
              else get_target("interpreter"))
    cache = KernelCache.for_target(tmp_path / "cache", target)
    work = _sigmoid_bucket()
    run = FillRun(target, cache, 1, False, False, 1.03, isolate=False)
    builder = Builder(target)
    try:
        row = run.process_bucket(work, builder)
    finally:
        builder.close()
        run.close()
    assert confirmed, "a near tie is timed again before it is decided"
    assert row["status"] == ("stored" if chip else "vendor wins"), row
    kind, entry, _ = cache.lookup(work.key)
    assert kind == ("hit" if chip else "vendor")
    assert entry.bucket is not None and entry.bucket.ranges == ((5, 8),)
    assert entry.timings["confirmed"] and entry.speedup == pytest.approx(0.5)
    if chip:
        assert "does not run aten.sigmoid.default" in entry.note
    else:
        assert entry.note.startswith("vendor wins: best Triton candidate ran at 0.500x")


def test_misses_are_recorded_once_per_bucket_and_their_sizes_define_the_buckets_fill_cache_fills(tmp_path):
    compiled, graphs = _serving(tmp_path, report=str(tmp_path / "report.json"))
    with torch.no_grad():
        for rows in (5, 6, 7, 8, 9, 11):  # two buckets: 5-8 and 9-16
            compiled(torch.randn(rows, 16))
    assert flush_repros(60)
    folders = sorted(p.parent for p in (tmp_path / "repros").glob("*/spec.json"))
    assert len(folders) == 2
    metas = [json.loads((f / "spec.json").read_text()) for f in folders]
    # dynamic=True: both dims are symbols, rows and columns
    assert all(m["bucket_dims"] == [["in", 0, 0, 0], ["in", 0, 1, 1], ["out", 0, 0, 0], ["out", 0, 1, 1]] for m in metas)
    from torch_kernelize.compiling.report import ReportWriter
    ReportWriter.for_path(tmp_path / "report.json").write()
    counts = json.loads((tmp_path / "report.json").read_text())["repros"]
    assert counts["written"] == 2 and counts["suppressed_by_reason"]["same_bucket"] == 4

    assert _fill(tmp_path, "--repros", str(tmp_path / "repros")) == 0
    cache = KernelCache.for_target(tmp_path / "cache", get_target("interpreter"))
    assert sorted(e.bucket.ranges for e in cache.entries() if e.bucket is not None) == [((5, 8), (9, 16)),
                                                                                         ((9, 16), (9, 16))]
    torch._dynamo.reset()
    compiled, graphs = _serving(tmp_path)
    with torch.no_grad():
        for rows in (7, 13):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), torch.sigmoid(x))
    assert _decision(graphs, 7).tier == "triton" and _decision(graphs, 13).tier == "triton"


def test_bad_bucket_arguments_exit_2_with_one_clear_line(tmp_path, capsys):
    (tmp_path / "none").mkdir()
    assert _fill(tmp_path, "--repros", str(tmp_path / "none"), "--dynamic", "0:0:1-4") == 2
    assert "give the model with --model" in capsys.readouterr().err
    assert _fill(tmp_path, "--model", _model_file(tmp_path), "--dynamic", "0:0:4") == 2
    assert "INPUT:DIM:LO-HI" in capsys.readouterr().err
    assert _fill(tmp_path, "--model", _model_file(tmp_path), "--dynamic", "0:0:1-4", "--buckets", "0") == 2
    assert "upper edges" in capsys.readouterr().err


def test_bucket_boundaries_keys_and_launch_sizes():
    assert [B.pow2_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [(1, 1), (2, 2), (3, 4), (3, 4), (5, 8), (5, 8), (9, 16)]
    edges = B.Boundaries.parse("8,64")
    assert edges.bucket_of(8) == (1, 8) and edges.bucket_of(9) == (9, 64) and edges.bucket_of(65) is None
    assert edges.covering(3, 20) == [(1, 8), (9, 64)]
    assert B.Boundaries().covering(3, 9) == [(3, 4), (5, 8), (9, 16)]
    with pytest.raises(ValueError, match="upper edges"):
        B.Boundaries.parse("8,x")
    with pytest.raises(Exception, match="INPUT:DIM:LO-HI"):
        DynamicDim.parse("0:1")
    dims = (("in", 0, 0, 0), ("out", 0, 0, 0))
    a, b = torch.randn(5, 16), torch.randn(16)
    spec = KernelSpec.from_call(torch.ops.aten.add.Tensor, [a, b], {}, a + b)
    other = B.spec_at(spec, dims, (7,))
    assert other.inputs[0].shape == (7, 16) and other.inputs[0].stride == (16, 1) and other.inputs[1] == spec.inputs[1]
    assert B.bucket_key(spec, dims, [(5, 8)]) == B.bucket_key(other, dims, [(5, 8)]) != B.bucket_key(spec, dims, [(9, 16)])
    assert B.bucket_key(spec, dims, [(5, 8)]).startswith(B.key_prefix(spec, dims))
    transposed = KernelSpec.from_call(torch.ops.aten.add.Tensor, [a.t(), a.t()], {}, a.t() + a.t())
    assert "not contiguous" in B.unbucketable(transposed, dims)
    program = ElementwiseFamily().generate_bucketed(spec, ElementwiseFamily().seed_configs(spec)[0], dims)
    (launch,) = B.instantiate(program, (7,)).launches
    assert launch.args[-1] == ("i32", 7 * 16) and launch.grid == (-(-7 * 16 // launch.constexprs["BLOCK"]),)


def test_a_region_nodes_rows_of_fixed_strides_vary_in_a_bucket_and_keep_their_strides():
    """A slice of a wider value's rows (an MoE's gate half) has the same strides at every row
    count: a region's node may vary so; an input may not, nor a node in an inner dim."""
    import json
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.compiling.regions import Region, region_spec

    def halves(x):
        return torch.sigmoid(x[:, :4]) * x[:, 4:]
    gm = make_fx(halves)(torch.randn(6, 8))
    (x,) = gm.graph.find_nodes(op="placeholder")
    inner = [n for n in gm.graph.nodes if n.op == "call_function"]
    spec = region_spec(Region("graph", inner, [x], inner[-1:]), {})
    nodes = json.loads(spec.graph)["nodes"]
    sliced = [j for j, n in enumerate(nodes) if n["op"] == "aten.slice.Tensor"]
    dims = (("in", 0, 0, 0), ("out", 0, 0, 0)) + tuple(("node", j, 0, 0) for j in range(len(nodes)))
    assert B.unbucketable(spec, dims) is None
    other = B.spec_at(spec, dims, (11,))
    assert [json.loads(other.graph)["nodes"][j]["meta"]["stride"] for j in sliced] == [[8, 1], [8, 1]]
    assert B.key_prefix(spec, dims) == B.key_prefix(other, dims)
    assert "not contiguous" in B.unbucketable(spec, dims + (("node", sliced[0], 1, 1),))
    x = torch.randn(8, 6).t()
    transposed = KernelSpec.from_call(torch.ops.aten.sigmoid.default, [x], {}, x.sigmoid())
    assert "input 0 is not contiguous" in B.unbucketable(transposed, (("in", 0, 0, 0),))


def test_a_scaled_bucket_reads_its_variable_off_dims_that_hold_a_multiple_of_it():
    """A dynamic graph's bucket whose dims are token counts (batch x length) records the batch
    as its scale: the length is those dims over it, its key is not the unscaled one's, and a
    record whose scale is no positive integer, or a representative no multiple of it, is refused."""
    from kernel_cache.entry import _bucket_problems
    dims = (("in", 0, 0, 0), ("out", 0, 0, 0))
    a = torch.randn(32, 16)
    spec = KernelSpec.from_call(torch.ops.aten.relu.default, [a], {}, a.relu())
    scaled = B.Bucket(dims, ((9, 16),), probes=("p", "q"), scale=2)
    assert scaled.values(spec) == (16,) and B.Bucket(dims, ((9, 16),), scale=3).values(spec) is None
    assert B.Bucket.from_json(scaled.to_json()) == scaled and "scale" not in B.Bucket(dims, ((9, 16),)).to_json()
    assert scaled.key(spec) != B.Bucket(dims, ((9, 16),), probes=("p", "q")).key(spec)
    with pytest.raises(ValueError, match="scale"):
        B.Bucket.from_json(dict(scaled.to_json(), scale=0))
    assert _bucket_problems(scaled.to_json(), spec, scaled.key(spec)) == []
    odd = B.Bucket(dims, ((9, 16),), probes=("p", "q"), scale=3)
    assert any("no multiple of the bucket's scale 3" in p for p in _bucket_problems(odd.to_json(), spec, odd.key(spec)))


def test_a_bucket_whose_search_raises_is_reported_failed_and_the_run_finishes(tmp_path, monkeypatch, capsys):
    def broken(run, work, builder, family=None):
        raise RuntimeError("a bug in the bucketed family")
    monkeypatch.setattr(FillRun, "process_bucket", broken)
    summary = tmp_path / "summary.json"
    assert _fill(tmp_path, "--model", _model_file(tmp_path), "--dynamic", "0:0:5-8", "--summary", str(summary)) == 0
    rows = json.loads(summary.read_text())["specs"]
    assert [r["status"] for r in rows if "bucket" in r["spec"]] == ["failed"]
    assert "stored" in [r["status"] for r in rows]   # the exact shape, filled before the buckets
    assert "a bug in the bucketed family" in capsys.readouterr().out
