"""Graph-level winners over shape buckets (issue 41): a dynamic graph's Inductor output, compiled
once over a bucket of sizes and fitted into one program (fill_cache/program_fit.py), is filled per
bucket and serves every size in it with no compile, no code generation and no disk read."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from torch_kernelize.backend import compile_with_session
from torch_kernelize.compiling.lower import Session
from torch_kernelize.core.buckets import instantiate
from torch_kernelize.core.options import Options
from torch_kernelize.core.program import Buffer, KernelProgram, Launch
from torch_kernelize.core.program_steps import VendorStep
from torch_kernelize.core.targets import get_target
from torch_kernelize.fill_cache.cli import main as fill_main
from torch_kernelize.fill_cache.program_fit import fit_program
from torch_kernelize.kernel_cache import KernelCache
from torch_kernelize.lowering.kernels.recording import RecordingError
from torch_kernelize.core.program_steps import StepCall
from torch_kernelize.core.targets import op_packet_name
from torch_kernelize.serving import bucket_warm, vendor_replay

SOURCE = "import triton\n@triton.jit\ndef k(x, y, n, m, XBLOCK: tl.constexpr):\n    pass\n"


def _program(s: int, block: int = 256, extra: int = 0) -> KernelProgram:
    """What Inductor's dynamic output recorded at size ``s`` looks like: a grid that is a block
    count, scalars and buffers that are polynomials of the size, a vendor step on views."""
    launch = Launch("k", (-(-128 * s // block), 1, 1), (("tmp", 0), ("out", 0), ("i32", s), ("i32", 128 * s + extra)),
                    {"XBLOCK": block}, 4, 1)
    step = VendorStep("aten.bmm.out", [{"buf": ["tmp", 0], "view": [[8, s, 16], [16 * s, 16, 1], 0]},
                                       {"buf": ["tmp", 1], "view": [[8, 16, s], [16 * s, s, 1], 0]}],
                      {"out": {"buf": ["tmp", 2], "view": [[8, s, s], [s * s, s, 1], 0]}}, 1)
    return KernelProgram(SOURCE, (launch,), temps=(Buffer((128 * s,), "float32"), Buffer((128 * s,), "float32"),
                                                   Buffer((8 * s * s,), "float32")), steps=(step,))


def test_a_program_recorded_at_several_sizes_is_one_program_of_the_size():
    fitted = fit_program({s: _program(s) for s in (33, 34, 48, 63, 64)})
    stored = copy.deepcopy(fitted.to_json())
    assert fitted.launches[0].runtime_sizes == {"grid": [["cdiv", ["mul", 128, "v0"], 256], 1, 1],
                                                "args": {"2": "v0", "3": ["mul", 128, "v0"]}}
    assert (("temps", 2, "shape", 0), ["mul", 8, "v0", "v0"]) in fitted.sized
    for s in (64, 33, 40, 51):  # sizes never recorded too
        got = instantiate(fitted, [s]).to_json()
        for launch in got["launches"]:
            del launch["runtime_sizes"]
        assert got == _program(s).to_json()
    assert fitted.to_json() == stored  # (instantiating leaves the stored program as it was)
    assert KernelProgram.from_json(fitted.to_json(), SOURCE) == fitted  # stored and read back as it was


def test_what_no_size_expression_gives_refuses_the_bucket_with_the_reason():
    with pytest.raises(RecordingError, match="another kernel or config"):  # Inductor chose another block
        fit_program({33: _program(33), 64: _program(64, block=128)})
    cubic = {s: _program(s, extra=s ** 3) for s in (33, 34, 48, 63, 64)}
    with pytest.raises(RecordingError, match="no polynomial of the size"):
        fit_program(cubic)
    # three sizes fix a quadratic and leave nothing to check it by: refused unless they are the whole bucket
    squares = {s: _program(s, extra=s * s) for s in (3, 4, 5)}
    with pytest.raises(RecordingError):
        fit_program(squares)
    assert fit_program(squares, every_size=True).launches[0].runtime_sizes["args"]["3"] == \
        ["add", ["mul", "v0", "v0"], ["mul", 128, "v0"]]


def _layouts(op: str, encoded: list) -> tuple:
    """A vendor call as (op, the (shape, stride, dtype) of each tensor argument in order), from
    its arguments encoded as replay records encode them."""
    tensors = [a["tensor"] for a in torch.utils._pytree.tree_leaves(encoded, is_leaf=lambda x: isinstance(x, dict))
               if isinstance(a, dict) and "tensor" in a]
    return op, tuple((tuple(t[0]), tuple(t[1]), t[3]) for t in tensors)


class _VendorSteps:
    """The warmable vendor steps that programs run inside the block, as _layouts."""

    def __init__(self):
        self.calls = []

    def __enter__(self) -> "_VendorSteps":
        self._run = run = StepCall.__call__

        def logged(step, bufs, device):
            if op_packet_name(step.op) in vendor_replay.WARMABLE:
                args = vendor_replay.encode([read(bufs, device) for read in step._args])
                kwargs = vendor_replay.encode([read(bufs, device) for _, read in step._kwargs])
                self.calls.append(_layouts(step.step.op, [args, kwargs]))
            return run(step, bufs, device)
        StepCall.__call__ = logged
        return self

    def __exit__(self, *exc) -> None:
        StepCall.__call__ = self._run


MODEL = '''
import torch
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
    def forward(self, x):
        b, t, d = x.shape
        h = self.proj(x).view(b, t, 2, 4).transpose(1, 2)
        a = torch.softmax(h @ h.transpose(-1, -2), -1) @ h
        return self.norm(a.transpose(1, 2).reshape(b, t, d) + x)
def make():
    torch.manual_seed(0)
    return Block().eval(), (torch.randn(1, 6, 8),)
'''


def _filled(model, source: str, dynamic: str):
    """``source`` written to ``model`` and filled at the quick budget over ``dynamic``, whole
    graphs asked for: the model, the cache's folder, the cache, its graph-level bucket entries."""
    model.write_text(source)
    cache_dir = model.parent / "cache"
    assert fill_main(["--target", "interpreter", "--cache-dir", str(cache_dir), "--quiet", "--budget", "1",
                      "--model", f"{model}:make", "--dynamic", dynamic, "--generators", "inductor"]) == 0
    cache = KernelCache.for_target(cache_dir, get_target("interpreter"))
    return model, cache_dir, cache, [e for e in cache.entries() if e.bucket is not None and e.bucket.probes]


def _served(model, cache_dir):
    """The model file's module, compiled with dynamic shapes by kernelize from ``cache_dir``;
    the LoweredGraphs it makes; the options."""
    import importlib.util
    loader = importlib.util.spec_from_file_location(f"whole_bucket_{model.stem}", model)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    block, _ = module.make()
    opts = Options.resolve({"target": "interpreter", "cache_dir": str(cache_dir), "repro_dir": "off",
                            "graph_cache": "off"})
    session, graphs = Session(opts), []
    compiled = torch.compile(block, dynamic=True,
                             backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    return block, compiled, graphs, opts


def test_a_dynamic_graph_is_filled_whole_per_bucket_and_serves_every_size_in_it(tmp_path, monkeypatch):
    model, cache_dir, cache, (whole,) = _filled(tmp_path / "block.py", MODEL, "0:1:5-8")
    assert whole.bucket.ranges == ((5, 8),) and whole.winner == "triton" and whole.family == "inductor"
    assert whole.record["bucket"]["validated_sizes"][:2] == [[5], [8]]
    assert whole.spec.inputs[0].shape == (1, 8, 8)  # the representative: the upper edge
    # the quick fill takes the graph's bucket first; a node's or region's bucket whose sizes its
    # program serves is not searched (a fill stopped early still serves the program)
    (summary,) = [json.loads(f.read_text()) for f in (cache.dir / "runs").glob("*.json")]
    buckets = [r for r in summary["specs"] if " bucket " in r["spec"]]
    assert buckets[0]["key"] == whole.key and buckets[0]["status"] == "stored"
    assert len(buckets) > 1 and all(r["status"] == "in the whole graph's program" for r in buckets[1:]), buckets

    # binding the bucket runs its vendor calls at each of its sizes (serving/bucket_warm.py; on CPU
    # here, CUDA only in a real run), with the layouts its served calls at those sizes then pass
    # (it binds while Dynamo compiles, under its fake mode: each call must run on real tensors)
    warmed = []

    def run(call):
        assert type(torch.zeros(1)) is torch.Tensor, "a warm's call ran inside the compile's fake mode"
        record = call.to_record()
        warmed.append(_layouts(record["op"], [record["args"], list(record["kwargs"].values())]))
    monkeypatch.setattr(vendor_replay, "WARM_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(bucket_warm, "_warmed", set())
    monkeypatch.setattr(vendor_replay.Call, "run", run)
    block, compiled, graphs, opts = _served(model, cache_dir)
    with torch.no_grad():
        x = torch.randn(1, 5, 8)
        torch.testing.assert_close(compiled(x), block(x))  # planned: the bucket's program loaded now
        assert {m for _, layouts in warmed for m, *_ in layouts} >= {(t, 8) for t in range(5, 9)}, warmed  # rows
        import torch_kernelize.serving.launch as launch
        import torch_kernelize.fill_cache.whole_buckets as whole_buckets

        def forbidden(*a, **k):
            raise AssertionError("a new size inside a filled bucket must not read the cache, compile or generate code")
        monkeypatch.setattr(launch, "load_program", forbidden)
        monkeypatch.setattr(KernelCache, "_read", forbidden)
        monkeypatch.setattr(KernelCache, "keys", forbidden)
        monkeypatch.setattr(torch._inductor, "compile", forbidden)
        monkeypatch.setattr(whole_buckets, "_compile_dynamic", forbidden)
        for t in (7, 8):
            x = torch.randn(1, t, 8)
            with _VendorSteps() as served:
                out = compiled(x)
            torch.testing.assert_close(out, block(x))
            assert served.calls and set(served.calls) <= set(warmed), (served.calls, warmed)
        monkeypatch.undo()
        for t in (6, 9):  # the traced size's exact entry (a static fill's) wins; outside the bucket: as before
            x = torch.randn(1, t, 8)
            torch.testing.assert_close(compiled(x), block(x))
    (graph,) = graphs
    for key, spec in graph.specializations().items():
        wholes = [d for d in spec.regions if d.entry is not None and d.entry.key == whole.key]
        assert bool(wholes and wholes[0].tier == "triton") == (max(key) in (5, 7, 8)), key

    # a launch that fails at a size of the bucket (a CUDA driver error met on the H100 at length 300
    # of a 257-512 bucket): the graph's own ops run at that size, their views' sizes its own (the
    # vendor path had the representative's [4096, 2048] baked into a view)
    import torch_kernelize.serving.launch as launch

    def failing(self, *a, **k):
        raise RuntimeError("CUDA driver error: invalid argument (injected)")
    monkeypatch.setattr(launch.ProgramRunner, "_launch_with_steps", failing)
    with torch.no_grad():
        x = torch.randn(1, 7, 8)
        torch.testing.assert_close(compiled(x), block(x))
    monkeypatch.undo()

    # compiled at a size outside the bucket (a server's warm-up), the bucket's class is planned then:
    # the first call of a new size in it binds nothing and generates no code
    from torch_kernelize.compiling import lower
    torch._dynamo.reset()
    session, graphs = Session(opts), []
    compiled = torch.compile(block, dynamic=True,
                             backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    with torch.no_grad():
        x = torch.randn(1, 12, 8)
        torch.testing.assert_close(compiled(x), block(x))
        (graph,) = graphs
        assert any(max(key) == 5 for key in graph.specializations())  # the bucket's lower edge, planned ahead
        monkeypatch.setattr(lower.LoweredGraph, "_bind", forbidden)
        for t in (7, 8):
            x = torch.randn(1, t, 8)
            torch.testing.assert_close(compiled(x), block(x))


def test_a_graph_program_wrong_at_one_edge_of_its_bucket_is_rejected_with_that_size(tmp_path, monkeypatch):
    """The fitted program is validated at both edges and inside, as any bucket's kernel: one that
    is right at the upper edge (where it is built and timed) and wrong at the lower is not stored."""
    import torch_kernelize.fill_cache.buckets as fill_buckets
    from torch_kernelize.core.buckets import Boundaries
    from torch_kernelize.fill_cache.builder import Builder
    from torch_kernelize.fill_cache.fill_run import FillRun

    model = tmp_path / "block.py"
    model.write_text(MODEL)
    target = get_target("interpreter")
    cache = KernelCache.for_target(tmp_path / "cache", target)
    works = fill_buckets.works_from_model(f"{model}:make", target, tmp_path / "cache",
                                          [fill_buckets.DynamicDim(0, 1, 5, 8)], Boundaries(), wholes=True)
    (work,) = [w for w in works if w.probes]
    # its baseline: the graph as served without it (dynamic, from the cache), at any size of the bucket
    baseline = work.baseline(target, tmp_path / "cache")
    for size in (5, 7):
        spec = work.spec_at((size,))
        inputs = [t for t in work.generator.sample_inputs(spec, 0)]
        torch.testing.assert_close(baseline(inputs)[0], spec.run_vendor(inputs)[0])
    real = fill_buckets.bucket_runner

    def wrong_at_five(spec, dims, base, scale=1):
        runner = real(spec, dims, base, scale)
        if fill_buckets.values_of(spec, dims) == (5,):
            run = runner.run_poisoned
            runner.run_poisoned = lambda *a, **k: [o + 1 for o in run(*a, **k)]
        return runner
    monkeypatch.setattr(fill_buckets, "bucket_runner", wrong_at_five)
    run = FillRun(target, cache, 1, False, False, 1.03, isolate=False)
    builder = Builder(target)
    try:
        row = run.process_bucket(work, builder)
    finally:
        builder.close()
        run.close()
    assert row["status"] == "no correct candidate", row
    assert "at sizes [5]" in row["winner"], row
    assert cache.lookup(work.key)[0] == "miss"


def test_a_nodes_bucket_knows_the_sizes_of_the_dynamic_dim_it_serves():
    """A node's variable is an increasing function of the --dynamic size (8*s, s*s, s+1): its
    bucket serves the sizes whose every variable falls in its range; a graph's programs skip it
    only where their buckets cover all of those."""
    import sympy
    from torch_kernelize.fill_cache.buckets import DynamicDim, _served_span
    from torch_kernelize.fill_cache.fill_run import _covered
    s, b = sympy.Symbol("s0"), sympy.Symbol("s1")
    bindings, example = {s: 40, b: 8}, {40: DynamicDim(0, 1, 33, 512)}
    assert _served_span([b * s], [(257, 512)], bindings, example) == (33, 64)
    assert _served_span([3 * s], [(129, 256)], bindings, example) == (43, 85)
    assert _served_span([s, s * s], [(33, 64), (1025, 2048)], bindings, example) == (33, 45)
    assert _served_span([s + 600], [(1, 64)], bindings, example) is None          # no size gets there
    two = {s: 40, b: 41}
    assert _served_span([b * s], [(1, 4096)], two, {40: DynamicDim(0, 1, 33, 64), 41: DynamicDim(1, 1, 33, 64)}) is None
    assert _covered((43, 85), [(33, 64), (65, 128)]) and not _covered((43, 85), [(33, 64), (66, 128)])
    assert not _covered((33, 64), []) and _covered((40, 50), [(65, 128), (33, 64)])


# A router's top-k breaks the graph (its picks are no program's): the first stretch gives a
# token-count tensor (batch x length) to the rest; each model below writes the rest of the forward.
ROUTED = '''
import torch
class Routed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.out = torch.nn.Linear(8, 8)
    def forward(self, x):
        b, t, d = x.shape
        flat = self.norm(self.proj(x)).reshape(b * t, d) * 2 + 1  # (written as [b*t, d], no view)
        _, idx = torch.topk(flat, 2, dim=-1)
{rest}
def make():
    torch.manual_seed(0)
    return Routed().eval(), (torch.randn(2, 6, 8),)
'''
BROKEN_MODEL = ROUTED.format(rest='''\
        picked = torch.gather(flat, -1, idx).sum(-1, keepdim=True)
        return (torch.relu(self.out(flat)) + picked).reshape(b, t, d) + x''')


def test_the_stretches_of_a_broken_dynamic_graph_are_filled_per_bucket_and_serve_every_size(tmp_path, monkeypatch):
    """A dynamic graph that ops no program may call break (an MoE router's top-k) competes stretch
    by stretch: each stretch (its canonical form the one serving looks up) gets its program per
    bucket, and a new size inside serves them with no compile or code generation, a stretch's
    token-count output (batch x length, no bucket dim) sized from the graph at that size."""
    from torch_kernelize.compiling.whole_graph import dynamic_stretches, dynamic_wholes, whole_probe_keys
    from torch_kernelize.fill_cache.whole_buckets import stretch_module
    from torch_kernelize.compiling.whole_graph import dynamic_whole

    model, cache_dir, cache, stretches = _filled(tmp_path / "routed.py", BROKEN_MODEL, "0:1:9-16")
    assert len(stretches) == 2 and all(e.winner == "triton" and e.bucket.ranges == ((9, 16),) for e in stretches)
    # the quick fill spares the buckets of the nodes the stretches' programs serve: only the op
    # that breaks the graph, which no program holds, has a node bucket of its own
    # (before 2026-12-06: nine more, the layer norm's, the linears', the adds'... that serving never runs)
    assert [e.spec.op for e in cache.entries() if e.bucket is not None and not e.bucket.probes] == ["aten.topk.default"]

    block, compiled, graphs, _ = _served(model, cache_dir)
    import torch_kernelize.serving.launch as launch
    import torch_kernelize.fill_cache.whole_buckets as whole_buckets

    def forbidden(*a, **k):
        raise AssertionError("a new size inside a filled bucket must not read the cache, compile or generate code")
    with torch.no_grad():
        x = torch.randn(2, 12, 8)  # (its class is planned from 10: 9 is the traced length, its exact entries)
        torch.testing.assert_close(compiled(x), block(x))
        monkeypatch.setattr(launch, "load_program", forbidden)
        monkeypatch.setattr(KernelCache, "_read", forbidden)
        monkeypatch.setattr(torch._inductor, "compile", forbidden)
        monkeypatch.setattr(whole_buckets, "_compile_dynamic", forbidden)
        sized = []  # the outputs each stretch's program is given at a size: the token count too (2 * t, not 2 * 16)
        resized = launch.ProgramRunner.resized
        monkeypatch.setattr(launch.ProgramRunner, "resized",
                            lambda self, program, outputs: sized.append([m.shape for m in outputs]) or
                            resized(self, program, outputs))
        for t in (13, 15):
            x = torch.randn(2, t, 8)
            torch.testing.assert_close(compiled(x), block(x))
            assert [(2 * t, 8)] in sized and [(2, t, 8)] in sized, sized
        monkeypatch.undo()
    (graph,) = graphs
    # and not planned again: 13 and 15 found in the class planned for 12 (the report's counts)
    assert graph.planning.to_json() == {"planned": 1, "shared": 2, "unshared": {}, "pinned": {}, "per_size": {}}
    keys = {e.key for e in stretches}
    for key, spec in graph.specializations().items():  # (at the traced length, 9, the static fill's exact entries)
        hits = [d for d in spec.regions if d.entry is not None and d.tier == "triton" and d.spec.inputs
                and (d.entry.key in keys) == (9 not in key) and "between ops no program calls" in d.reason]
        assert len(hits) == 2, (key, [(d.reason, d.tier) for d in spec.regions])

    # the fill's stretch, a graph of its own, has the canonical form of the stretch serving looks up
    bindings = graph.binder.bindings(next(iter(graph.specializations())))
    symbol = next(s for s, v in bindings.items() if v not in (2, 8))
    served = dynamic_wholes(graph.plan.gm, [symbol])
    assert len(dynamic_stretches(graph.plan.gm)) == 2 and len(served) == 2
    for w in served:
        own = dynamic_whole(stretch_module(graph.plan.gm, w.region), symbol)[0]
        assert whole_probe_keys(own, bindings) == whole_probe_keys(w, bindings)


# a second router cuts the graph in three: the middle stretch sees only token counts (batch x
# length, no dim of the length alone), as an MoE router's stretch does
TOKENS_MODEL = ROUTED.format(rest='''\
        mid = torch.relu(self.out(flat)) + torch.gather(flat, -1, idx).sum(-1, keepdim=True)
        _, idx2 = torch.topk(mid, 2, dim=-1)
        return (mid * 3 + torch.gather(mid, -1, idx2).sum(-1, keepdim=True)).reshape(b, t, d) + x''')


def test_a_stretch_of_token_counts_alone_is_filled_over_the_lengths_bucket_and_serves_it(tmp_path, monkeypatch):
    """A stretch whose every dim is batch x length competes over the length's buckets: its bucket
    dims hold the length times the batch (the record's scale), serving reads the length off them
    divided by it, and a new length inside runs its program with no compile or cache read."""
    model, cache_dir, _, stretches = _filled(tmp_path / "tokens.py", TOKENS_MODEL, "0:1:9-16")
    assert len(stretches) == 3 and all(e.winner == "triton" and e.bucket.ranges == ((9, 16),) for e in stretches)
    (tokens,) = [e for e in stretches if e.bucket.scale != 1]
    assert tokens.bucket.scale == 2 and all(tokens.spec.inputs[i].shape[d] == 32 for s, i, d, _ in tokens.bucket.dims
                                            if s == "in")

    block, compiled, graphs, _ = _served(model, cache_dir)
    import torch_kernelize.serving.launch as launch

    def forbidden(*a, **k):
        raise AssertionError("a new size inside a filled bucket must not read the cache, compile or generate code")
    with torch.no_grad():
        x = torch.randn(2, 12, 8)
        torch.testing.assert_close(compiled(x), block(x))
        monkeypatch.setattr(launch, "load_program", forbidden)
        monkeypatch.setattr(KernelCache, "_read", forbidden)
        monkeypatch.setattr(torch._inductor, "compile", forbidden)
        for t in (10, 13, 16):
            x = torch.randn(2, t, 8)
            torch.testing.assert_close(compiled(x), block(x))
        monkeypatch.undo()
    (graph,) = graphs
    assert graph.planning.to_json() == {"planned": 1, "shared": 3, "unshared": {}, "pinned": {}, "per_size": {}}
    for key, spec in graph.specializations().items():
        if 9 in key:  # (the traced length: the static fill's exact entries)
            continue
        hit = {d.entry.key for d in spec.regions if d.entry is not None and d.tier == "triton"}
        assert {e.key for e in stretches} <= hit, key


# three routers: the two stretches between them are one spec (a model's layers are)
LAYERS_MODEL = ROUTED.format(rest='''\
        mid = flat
        for _ in range(2):
            mid = torch.relu(mid * 3 + torch.gather(mid, -1, idx).sum(-1, keepdim=True))
            _, idx = torch.topk(mid, 2, dim=-1)
        return (mid + torch.gather(mid, -1, idx).sum(-1, keepdim=True)).reshape(b, t, d) + x''')


def test_identical_stretches_of_a_models_layers_share_a_new_lengths_class(tmp_path):
    """Two stretches of one spec (a model's layers) are two regions that one entry serves: a new
    length inside the bucket is served by its class's plan, not planned again. (Until 2026-12-06
    the regions were told apart by their spec key, so the first layer's nodes counted as kernels
    bound to one size: every new length was planned anew, 290 ms a call of the H100's Mixtral.)"""
    model, cache_dir, _, stretches = _filled(tmp_path / "layers.py", LAYERS_MODEL, "0:1:9-16")
    block, compiled, graphs, _ = _served(model, cache_dir)
    with torch.no_grad():
        for t in (12, 10, 13):
            x = torch.randn(2, t, 8)
            torch.testing.assert_close(compiled(x), block(x))
    (graph,) = graphs
    spec = graph.specializations()[next(k for k in graph.specializations() if 12 in k)]
    shared = [d for d in spec.regions if d.tier == "triton" and d.entry is not None]
    assert len(shared) > len({d.entry.key for d in shared})  # (two regions, one entry)
    assert graph.planning.to_json() == {"planned": 1, "shared": 2, "unshared": {}, "pinned": {}, "per_size": {}}


def test_a_size_read_off_a_value_a_fusion_removes_is_read_off_its_boundary():
    """sizes_read_off: a later stretch's ``sym_size`` of a value inside a stretch (an MoE router's
    token count read off its view) has a tensor of the stretch's inputs or outputs of that size,
    or the stretch cannot be fused (None)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.core.shapes import sizes_read_off

    def f(x, y):
        v = (x * 2).view(-1)
        return y.new_zeros(v.shape[0]) + 1, y * 3
    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(6), torch.randn(4))
    nodes = {n.name: n for n in gm.graph.nodes}
    x, y = [n for n in gm.graph.nodes if n.op == "placeholder"]
    stretch = [nodes["mul"], nodes["view"]]
    assert sizes_read_off(stretch, []) == []  # (make_fx reads the size off the input: nothing inside is read)
    (size,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sym_size.int and n.args[0] is x]
    size.args = (nodes["view"], 0)  # as AOT's graph of Mixtral's router reads its token count off a view
    ((reader, (tensor, dim)),) = sizes_read_off(stretch, [x])
    assert reader.target is torch.ops.aten.sym_size.int and reader.args[0] is nodes["view"]
    assert (tensor, dim) == (x, 0)
    assert sizes_read_off(stretch, [y]) is None  # y's size is another symbol: no tensor the fusion keeps has it
