"""Shape classes (compiling/shape_classes.py): the signatures of a dynamic graph that find the same
cache entries share one specialization, so a new shape inside a filled bucket is served without
planning, binding or generating code; exact entries stay classes of their own; a specialization
whose kernels are not valid over its whole class is never shared."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import sympy
import torch

from torch_kernelize.backend import compile_with_session
from torch_kernelize.compiling import lower as lower_module
from torch_kernelize.compiling.lower import Session
from torch_kernelize.compiling.planner import GraphPlan
from torch_kernelize.compiling.shape_classes import ShapeClasses
from torch_kernelize.core.options import Options
from torch_kernelize.fill_cache.cli import main as fill_main
from torch_kernelize.serving.bucket_call import BucketCall
from torch_kernelize.serving.runtime import KernelState, TritonCall

MODEL = '''
import torch
def make():
    return torch.nn.Sigmoid(), (torch.randn({rows}, 16),)
'''


def _fill_bucket(tmp_path: Path, rows: int = 6, dynamic: str = "0:0:5-8") -> None:
    """An exact entry at (rows, 16) and the bucket ``dynamic`` around it."""
    (tmp_path / "model.py").write_text(MODEL.format(rows=rows))
    assert fill_main(["--target", "interpreter", "--cache-dir", str(tmp_path / "cache"), "--quiet", "--budget", "1",
                      "--model", f"{tmp_path / 'model.py'}:make", "--dynamic", dynamic]) == 0


def _serving(tmp_path: Path, **options):
    opts = Options.resolve({"target": "interpreter", "cache_dir": str(tmp_path / "cache"), "repro_dir": "off",
                            "graph_cache": "off", **options})
    session, graphs = Session(opts), []
    compiled = torch.compile(torch.sigmoid, dynamic=True,
                             backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    return compiled, graphs


def _specialization(graph, rows: int):
    (spec,) = {id(s): s for k, s in graph.specializations().items() if rows in k}.values()
    return spec


def _sigmoid(spec):
    (d,) = [d for d in spec.decisions if d.op == "aten.sigmoid.default"]
    return d


def test_a_new_size_inside_a_filled_bucket_is_served_without_planning(tmp_path, monkeypatch):
    _fill_bucket(tmp_path)
    compiled, graphs = _serving(tmp_path)
    with torch.no_grad():
        x = torch.randn(7, 16)
        torch.testing.assert_close(compiled(x), torch.sigmoid(x))  # planned: the class 7-8 of the bucket 5-8

        def forbidden(*a, **k):
            raise AssertionError("a new size of a planned shape class must not be planned, bound or generated")
        monkeypatch.setattr(GraphPlan, "decide", forbidden)
        monkeypatch.setattr(lower_module, "bind_graph", forbidden)
        monkeypatch.setattr(lower_module, "flat_function", forbidden)
        x = torch.randn(8, 16)
        torch.testing.assert_close(compiled(x), torch.sigmoid(x))
        monkeypatch.undo()
        for rows in (5, 6, 9):  # 5 and 6 are classes of their own (6 has an exact entry); 9 is outside
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), torch.sigmoid(x))
    (g,) = graphs
    seven, eight = _specialization(g, 7), _specialization(g, 8)
    assert seven is eight
    call = next(n.target for n in seven.gm.graph.nodes if isinstance(n.target, BucketCall))
    assert sorted(call._sized) == [(7,), (8,)]  # one launch plan per size, the same binaries
    assert _sigmoid(seven).entry.bucket.ranges == ((5, 8),)
    six = _sigmoid(_specialization(g, 6))
    assert six.entry.bucket is None and six.entry.key == six.spec_key  # the exact entry wins
    assert _specialization(g, 5) is not seven and _sigmoid(_specialization(g, 5)).entry.bucket is not None
    assert _sigmoid(_specialization(g, 9)).tier == "vendor"
    # the report counts what first calls cost: 7, 5, 6 and 9 planned, 8 served by 7's class
    assert g.report.to_json()["planning"] == {"planned": 4, "shared": 1, "unshared": {}, "pinned": {}, "per_size": {}}


def test_a_specialization_with_an_exact_kernel_is_never_shared(tmp_path, monkeypatch):
    """Even where the partition does not isolate an exact entry's sizes (here: a partition without
    any cut), the specialization that binds its kernel serves that one signature."""
    _fill_bucket(tmp_path)
    monkeypatch.setattr(lower_module, "shape_classes",
                        lambda symbols, *a, **k: ShapeClasses(symbols, record_buckets=False))
    compiled, graphs = _serving(tmp_path)
    with torch.no_grad():
        for rows in (6, 7, 12):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), torch.sigmoid(x))
    (g,) = graphs
    six, seven = _specialization(g, 6), _specialization(g, 7)
    assert six is not seven and _sigmoid(six).entry.bucket is None
    # without cuts the bucket's call cannot prove 12 inside its bucket: 7's is not shared either
    assert _specialization(g, 12) is not seven and _sigmoid(_specialization(g, 12)).tier == "vendor"
    # and the report says why each planned signature served itself alone, naming the kernel
    rows, cols = g.binder.symbols  # (dynamic=True: the 16 columns are a size symbol too)
    needs = "in its class, and a kernel bound needs one value of it (aten.sigmoid.default at sigmoid (triton))"
    assert g.planning.to_json() == {"planned": 3, "shared": 0, "pinned": {}, "per_size": {}, "unshared": {
        f"{rows} takes -inf..inf {needs}": 1,   # 6: its exact kernel
        f"{cols} takes -inf..inf {needs}": 1}}  # 7: its bucket's kernel, at the columns it was filled for


def test_the_partition_cells_and_what_a_class_admits():
    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    classes = ShapeClasses((s0, s1), record_buckets=False)
    classes.cut(s0, 5, 8)
    classes.isolate({s0: 6})
    classes.pin([s1], "what pinned it")
    assert classes.pinned_by == {"s1": "what pinned it"}
    assert classes.of((7, 16)) == classes.of((8, 16)) != classes.of((6, 16))
    assert classes.of((7, 16)) != classes.of((7, 17))  # s1 pinned: every value a class
    assert classes.of((9, 16)) == classes.of((100, 16)) != classes.of((8, 16))
    assert classes.cell((7, 16), s0) == (7, 8) and classes.cell((6, 16), s0) == (6, 6)
    assert classes.cell((7, 16), s1) == (16, 16)
    assert classes.admits((7, 16), single=[s1], ranges={s0: (5, 8)})
    assert not classes.admits((7, 16), single=[s0], ranges={})       # 7 and 8 share the class
    assert not classes.admits((9, 16), single=[], ranges={s0: (5, 8)})  # 9.. is outside the bucket
    assert classes.refusal((7, 16), [s0], {}) == (s0, "s0 takes 7..8 in its class, and a kernel bound needs one value of it")
    assert classes.refusal((9, 16), [], {s0: (5, 8)}) == (s0, "s0 takes 9..inf in its class, past the bound bucket's 5-8")
    recording = ShapeClasses((s0, s1), record_buckets=True)
    assert recording.of((5, 16)) == recording.of((8, 16)) != recording.of((9, 16))  # pow2 recording buckets


def test_a_bucket_call_makes_one_checked_call_per_size():
    from torch_kernelize.core.buckets import spec_at
    from torch_kernelize.core.spec import KernelSpec
    x8 = torch.randn(8, 16)
    spec = KernelSpec.from_call(torch.ops.aten.sigmoid.default, [x8], {}, torch.sigmoid(x8))
    dims = (("in", 0, 0, 0), ("out", 0, 0, 0))
    made = []

    def make(values):
        made.append(values)
        return TritonCall(spec_at(spec, dims, values), lambda x: x * 2, KernelState("k"))

    call = BucketCall(spec, dims, KernelState("k"), make).checking([0])
    x = torch.randn(7, 16)
    torch.testing.assert_close(call(x), x * 2)
    call(torch.randn(7, 16))
    assert made == [(7,)] and call.sized((7,)).layout_checks == ((0, (16, 1)),)
    assert call(x.t().contiguous().t()) is not None  # another layout: the vendor op (sigmoid)
    torch.testing.assert_close(call(x.t().contiguous().t()), torch.sigmoid(x))
    with pytest.raises(ValueError, match="appears on no input"):
        BucketCall(spec, (("out", 0, 0, 0),), KernelState("k"), make)


def test_a_bucket_calls_its_generated_call_while_healthy_and_each_sizes_call_on_a_failure():
    """A bucket with one generated call for every size (lower._bucket_direct) runs it; the call
    of a size is made only for what it does not cover: a failure (that size's call decides: here
    the vendor op, the kernel disabled for the bucket) and an input a vendor op laid out
    otherwise than the kernel reads it (checking() keeps the generated call for the rest)."""
    from torch_kernelize.core.buckets import spec_at
    from torch_kernelize.core.spec import KernelSpec
    x8 = torch.randn(8, 16)
    spec = KernelSpec.from_call(torch.ops.aten.sigmoid.default, [x8], {}, torch.sigmoid(x8))
    dims = (("in", 0, 0, 0), ("out", 0, 0, 0))
    made, state = [], KernelState("k")

    def make(values):
        made.append(values)
        return TritonCall(spec_at(spec, dims, values), lambda x: x * 2, state)

    call = BucketCall(spec, dims, state, make)
    assert call.sizes_source == "(i0.shape[0], )"
    call.generic = lambda x: x * 3
    x = torch.randn(7, 16)
    torch.testing.assert_close(call(x), x * 3)
    assert made == []
    checked = call.checking([0])
    torch.testing.assert_close(checked(x), x * 3)  # laid out as the kernel reads it: the generated call
    assert made == [] and checked._layouts == {(7,): ((0, (16, 1)),)}  # (no size's call made for it)
    odd = x.t().contiguous().t()
    torch.testing.assert_close(checked(odd), torch.sigmoid(odd))  # another layout: its size's call, the vendor op
    assert made == [(7,)] and state.disabled is None
    torch.testing.assert_close(call.per_size(x), x * 2)  # (what the generated call hands back)

    def broken(x):
        raise RuntimeError("CUDA driver error: invalid argument (injected)")
    call.generic = broken
    torch.testing.assert_close(call(x), torch.sigmoid(x))
    assert state.disabled is not None
    assert call(torch.randn(5, 16)).shape == (5, 16)  # disabled: each size's vendor call


def test_sizes_that_are_products_of_symbols_are_coordinates_of_their_own():
    """A GEMM of a [batch, seq] input flattened into batch*seq rows: the bucket 9-64 of its rows
    is a range of the product (the cell of batch*seq, whatever batch and seq are apart), and an
    exact entry's sizes are read back through the product."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch_kernelize.compiling.shape_classes import bucket_symbols, product_factors, read_sizes
    from torch_kernelize.core.spec import TensorMeta
    env = ShapeEnv()
    batch, seq = env.create_symbol(2, ConstantSource("batch")), env.create_symbol(5, ConstantSource("seq"))
    with FakeTensorMode(shape_env=env):
        rows = torch.empty(env.create_symintnode(batch, hint=2) * env.create_symintnode(seq, hint=5), 16)
        eight = torch.empty(8 * env.create_symintnode(seq, hint=5), 16)
    product = rows.shape[0].node.expr
    assert product_factors(product) == (1, tuple(sorted((batch, seq), key=str)))
    assert product_factors(eight.shape[0].node.expr) == (8, (seq,)) and product_factors(seq + 1) is None
    dims = (("in", 0, 0, 0),)
    assert bucket_symbols({"in": [rows]}, dims, [(9, 64)]) == {product: (9, 64)}
    bound, sizes = read_sizes([eight], [TensorMeta((40, 16), (16, 1), "float32")])
    assert bound == {seq: 5} and sizes == {8 * seq: 40}
    assert read_sizes([eight], [TensorMeta((41, 16), (16, 1), "float32")]) is None  # not a multiple of 8
    bound, sizes = read_sizes([rows], [TensorMeta((12, 16), (16, 1), "float32")])
    assert math.prod(bound.values()) == 12 and sizes == {product: 12}  # (only the product is fixed)

    classes = ShapeClasses((batch, seq), record_buckets=False)
    classes.cut(product, 9, 64)
    assert classes.of((2, 5)) == classes.of((4, 16)) == classes.of((3, 7)) != classes.of((2, 4))
    assert classes.admits((2, 5), single=[], ranges={product: (9, 64)})
    assert not classes.admits((2, 5), single=[seq], ranges={})  # seq itself is free in the class


LINEARS = '''
import torch
def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8, bias=False)), \\
        (torch.randn(6, 16),)
'''


def test_a_fused_region_from_its_bucket_serves_its_class_too(tmp_path, monkeypatch):
    """addmm + ReLU (a matmul region) filled as a bucket of rows: its kernel is bound as a
    BucketCall, so a new batch size in the class runs fused without planning."""
    (tmp_path / "model.py").write_text(LINEARS)
    assert fill_main(["--target", "interpreter", "--cache-dir", str(tmp_path / "cache"), "--quiet", "--budget", "1",
                      "--model", f"{tmp_path / 'model.py'}:make", "--dynamic", "0:0:5-8"]) == 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8, bias=False))
    opts = Options.resolve({"target": "interpreter", "cache_dir": str(tmp_path / "cache"), "repro_dir": "off",
                            "graph_cache": "off"})
    session, graphs = Session(opts), []
    compiled = torch.compile(model, dynamic=True,
                             backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    with torch.no_grad():
        x = torch.randn(7, 16)
        torch.testing.assert_close(compiled(x), model(x))
        monkeypatch.setattr(GraphPlan, "decide", lambda *a, **k: pytest.fail("planned again"))
        x = torch.randn(8, 16)
        torch.testing.assert_close(compiled(x), model(x))
    (g,) = graphs
    spec = _specialization(g, 7)
    assert spec is _specialization(g, 8)
    (region,) = [d for d in spec.regions if d.tier == "triton"]
    assert region.entry.bucket is not None and region.entry.bucket.ranges == ((5, 8),)
    fused = [n.target for n in spec.gm.graph.nodes if isinstance(n.target, BucketCall) and n.target.spec.op == "region"]
    assert len(fused) == 1 and sorted(fused[0]._sized) == [(7,), (8,)]


def test_a_bucket_kernel_that_fails_at_a_new_size_answers_with_the_vendor_op_at_that_size(tmp_path, monkeypatch):
    """The size's call makes its spec only now (the vendor op's outputs take its sizes), and the
    kernel is disabled for the whole bucket."""
    _fill_bucket(tmp_path)
    compiled, graphs = _serving(tmp_path)
    with torch.no_grad():
        x = torch.randn(7, 16)
        torch.testing.assert_close(compiled(x), torch.sigmoid(x))
        import torch_kernelize.serving.launch as launch

        def broken(self, *inputs):
            raise RuntimeError("a launch failed")
        monkeypatch.setattr(launch.ProgramRunner, "__call__", broken)
        x = torch.randn(8, 16)
        torch.testing.assert_close(compiled(x), torch.sigmoid(x))
    (g,) = graphs
    call = next(n.target for n in _specialization(g, 8).gm.graph.nodes if isinstance(n.target, BucketCall))
    eight = call.sized((8,))
    assert eight.spec.inputs[0].shape == (8, 16) and "a launch failed" in (eight.state.disabled or "")
    assert call.sized((7,)).state.disabled  # (one state: the bucket's)
