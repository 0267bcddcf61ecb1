"""Matmul groups (one launch for several GEMMs of one structure: a layer's Q/K/V projections)
serve shape buckets: every member's M is the same run-time variable (the tokens they all read),
so the members' tile ranges, the swizzle and the grid are computed from it (interpreter target).
Groups are cut from graphs traced with symbolic shapes; their bucket dims, node values included,
come from compiling/bucket_lookup.region_bucket_sizes, as the planner reads them."""
from __future__ import annotations

import sympy
import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from kernel_testing import assert_bucket_valid, compile_sm90
from torch_kernelize.compiling.bucket_lookup import region_bucket_sizes
from torch_kernelize.compiling.regions import find_regions, group_matmuls, region_spec
from torch_kernelize.core.buckets import evaluate, spec_at
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import get_target
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.matmul import FAMILY

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf/NaN edge trials

F16 = torch.float16
# tiles small enough for several row blocks per member (the swizzle, a masked last block)
SMALL = Config.of(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=2, DOT_UPCAST=False,
                  ALIGN=False)


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.3).to(dtype)


def bucketed_group(fn, *inputs: torch.Tensor, vary: tuple[int, ...]) -> tuple[KernelSpec, tuple]:
    """The one matmul group of ``fn`` traced with symbolic shapes, as a spec at the inputs'
    sizes, and its bucket dims in the sizes ``vary`` only (every size of the inputs is distinct,
    so a size names its symbol); the variables numbered as in ``vary``."""
    gm = make_fx(fn, tracing_mode="symbolic", decomposition_table=core_aten_decompositions())(*inputs)
    target = get_target("interpreter")
    groups = group_matmuls(gm, find_regions(gm, target), target)
    assert len(groups) == 1, groups
    dims, symbols = region_bucket_sizes(groups[0])
    size_of = {v: int(groups[0].inputs[i].meta["val"].shape[d].node.hint) for side, i, d, v in dims if side == "in"}
    spec = region_spec(groups[0], {s: sympy.Integer(size_of[v]) for v, s in enumerate(symbols)})
    return spec, tuple((side, i, d, vary.index(size_of[v])) for side, i, d, v in dims if size_of[v] in vary)


def qkv(x, wq, wk, wv):
    return x @ wq.t(), x @ wk.t(), x @ wv.t()


def biased_relu_pair(x, wq, bq, wk, bk):
    """Two Linear layers with a bias and an epilogue: matmul regions whose node values vary too."""
    return torch.relu(F.linear(x, wq, bq)), torch.relu(F.linear(x, wk, bk))


def residual_pair(x, wq, wk, r):
    """An epilogue input of M rows (a residual), read by both members."""
    return x @ wq.t() + r, x @ wk.t() + r


CASES = {
    # name: (fn, inputs at the upper edge, the bucket of the rows)
    "qkv-f32": (qkv, lambda: (_x(40, 32), _x(24, 32), _x(24, 32), _x(24, 32)), (17, 40)),
    "qkv-f16-one-row-block": (qkv, lambda: (_x(13, 48, dtype=F16), *[_x(24, 48, dtype=F16) for _ in range(3)]), (9, 13)),
    "bias-relu-f16": (biased_relu_pair, lambda: (_x(40, 32, dtype=F16), _x(24, 32, dtype=F16), _x(24, dtype=F16),
                                                 _x(24, 32, dtype=F16), _x(24, dtype=F16)), (1, 40)),
    "residual-f32": (residual_pair, lambda: (_x(36, 32), _x(24, 32), _x(24, 32), _x(36, 24)), (20, 36)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bucketed_group_is_right_at_both_edges_and_inside(case, tmp_path):
    fn, inputs, rows = CASES[case]
    spec, dims = bucketed_group(fn, *inputs(), vary=(rows[1],))
    assert {v for *_, v in dims} == {0}
    if case.startswith("bias"):
        assert any(side == "node" for side, *_ in dims)
    program = assert_bucket_valid(FAMILY, spec, dims, (rows,), tmp_path, SMALL)
    (launch,) = program.launches
    assert launch.kernel.startswith("region_group_") and launch.args[-1][0] == "i32"
    # every member owns cdiv(M, 16) x cdiv(N, 16) programs, from M at run time
    members, n = len(spec.outputs), spec.outputs[0].shape[1]
    for m in (rows[0], rows[1]):
        assert evaluate(launch.runtime_sizes["grid"][0], [m]) == members * -(-m // 16) * -(-n // 16)


def test_the_fixed_size_group_kernel_is_unchanged_by_bucketing():
    """A group without a bucket still bakes each member's M and tile range in as literals."""
    spec, dims = bucketed_group(qkv, *CASES["qkv-f32"][1](), vary=(40,))
    fixed = FAMILY.generate(spec, SMALL)
    assert not fixed.launches[0].runtime_sizes and "M = pid * 0 + 40" in fixed.source
    bucketed = FAMILY.generate_bucketed(spec, SMALL, dims)
    assert "M = pid * 0 + 40" not in bucketed.source and "tiles = mb * 2" in bucketed.source


def test_bucketed_group_kernels_compile_for_sm90(tmp_path):
    """Real GPU code, with int32 and (an upper edge of 2^27 rows) int64 offsets: M is an i32
    argument of the binary and every member's first program is computed from it."""
    spec, dims = bucketed_group(qkv, *CASES["qkv-f16-one-row-block"][1](), vary=(13,))
    config = FAMILY.seed_configs(spec)[0]
    for rep in (spec, spec_at(spec, dims, (1 << 27,))):
        program = FAMILY.generate_bucketed(rep, config, dims)
        assert program.launches[0].args[-1][0] == "i32"
        assert (".to(tl.int64)" in program.source) == (rep is not spec)
        compile_sm90(rep, program, tmp_path)


def test_what_a_bucketed_group_refuses_and_why():
    spec, dims = bucketed_group(qkv, *CASES["qkv-f32"][1](), vary=(40,))
    assert FAMILY.bucket_support(spec, dims) is None
    # one member's rows left out of the bucket: its M would be a literal of a launch whose M varies
    x_only = tuple(d for d in dims if d[0] != "out" or d[1] == 0)
    assert "does not vary with M" in FAMILY.bucket_support(spec, x_only)
    # K varies (the weights' inner size): a literal of the K loop
    assert "K varies" in FAMILY.bucket_support(spec, dims + (("in", 0, 1, 1),))
    # members that read different tokens, of two variables
    two, two_dims = bucketed_group(lambda x, y, wq, wk: (x @ wq.t(), y @ wk.t()),
                                   _x(40, 32), _x(36, 32), _x(24, 32), _x(24, 32), vary=(40, 36))
    assert {v for *_, v in two_dims} == {0, 1}
    assert "different variables" in FAMILY.bucket_support(two, two_dims)
    # a member's rows that do not vary, beside members whose rows do
    fixed_y = tuple(d for d in two_dims if d[3] == 0)
    assert "its M does not vary" in FAMILY.bucket_support(two, fixed_y)
    # the tokens read through a transpose: a strided operand's strides depend on M
    t, t_dims = bucketed_group(lambda x, wq, wk: (x.t() @ wq.t(), x.t() @ wk.t()), _x(32, 40), _x(24, 32), _x(24, 32),
                                   vary=(40,))
    assert "not contiguous" in FAMILY.bucket_support(t, t_dims)
    with pytest.raises(ValueError, match="cannot be bucketed"):
        FAMILY.generate_bucketed(two, SMALL, two_dims)


QK = '''
import torch
class QK(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(16, 12, bias=False), torch.nn.Linear(16, 12, bias=False)
    def forward(self, x):
        return self.q(x), self.k(x)
def make():
    torch.manual_seed(0)
    return QK(), (torch.randn(6, 16),)
'''


def test_fill_then_serve_runs_the_group_from_its_bucket(tmp_path):
    """q = Wq x, k = Wk x filled as a bucket of rows (``--dynamic 0:0:5-8``): a dynamic=True
    compile serves 5, 7 and 8 rows with the group on triton, from that bucket."""
    from test_buckets import _fill, _serving
    from torch_kernelize.serving.bucket_call import BucketCall

    (tmp_path / "model.py").write_text(QK)
    assert _fill(tmp_path, "--model", f"{tmp_path / 'model.py'}:make", "--dynamic", "0:0:5-8") == 0
    made: dict = {}
    exec(QK, made)
    model, _ = made["make"]()
    compiled, graphs = _serving(tmp_path, model)
    with torch.no_grad():
        for rows in (5, 7, 8):
            x = torch.randn(rows, 16)
            for got, want in zip(compiled(x), model(x)):
                torch.testing.assert_close(got, want)
    (g,) = graphs
    served = {id(s): s for s in g.specializations().values()}.values()
    groups = [d for s in served for d in s.regions if d.tier == "triton"]
    assert groups and all(d.entry.bucket is not None and d.entry.bucket.ranges == ((5, 8),) for d in groups)
    calls = [n.target for s in served for n in s.gm.graph.nodes
             if isinstance(n.target, BucketCall) and n.target.spec.op == "region"]
    assert calls and all('"matmul_group"' in c.spec.graph for c in calls)
    assert not list((tmp_path / "repros").glob("*")), "a size inside the filled bucket was recorded as a miss"
