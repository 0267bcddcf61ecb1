"""A ranking model's preprocessing on a GEMM-only chip (issue 44): EmbeddingBag (mean, padding_idx,
empty bag), searchsorted of a sorted boundary row, bucketize (both sides, an int32 result), a
modulo hash of int64 ids, truncation of jagged rows by their lengths (cumsum to offsets, a padded
[rows, K] gather with a validity mask), the rows' ids (repeat_interleave with output_size) and
sums (segment_reduce), scatter_add of values into their buckets, histc over the data's range:
every node on the chip after one fill, every output (integers too) exactly eager's."""
from __future__ import annotations

import torch

from torch_kernelize import bringup
from torch_kernelize.compiling.report import column
from torch_kernelize.core.targets import Target
from torch_kernelize.fill_cache.collect import run_compiled

GEMM_ONLY = ["aten.mm", "aten.addmm", "aten.bmm", "aten.convolution"]
MODEL = '''
import torch
import torch.nn.functional as F
K = 3  # values kept per jagged row

class Preprocess(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(20, 8, mode="mean", padding_idx=3)

    def forward(self, ids, offsets, x, boundaries, values, lengths):
        left = torch.bucketize(x, boundaries)
        right = torch.bucketize(x, boundaries, right=True, out_int32=True)
        ends = torch.cumsum(lengths, 0)
        starts = F.pad(ends, (1, 0))[:-1]                       # cumsum to offsets
        kept = torch.clamp(lengths, max=K)
        valid = torch.arange(K).unsqueeze(0) < kept.unsqueeze(1)
        truncated = torch.where(valid, values[torch.where(valid, starts.unsqueeze(1) + torch.arange(K), 0)], 0.0)
        row_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=values.numel())
        return (self.bag(ids, offsets), torch.searchsorted(boundaries, x, side="right"),
                torch.remainder(ids * 31 ^ 7, 5), left, right, truncated, kept, row_of,
                torch.segment_reduce(values, "sum", lengths=lengths),
                torch.zeros(boundaries.numel() + 1).scatter_add(0, left, x), torch.histc(values, bins=6))

def make():
    torch.manual_seed(0)
    ids = torch.tensor([3, 1, 7, 19, 3, 0, 5, 5, 12, 3, 8, 2])
    x = torch.cat([torch.randn(6), torch.tensor([-0.5, 0.0, 0.5])])  # three on the boundaries
    lengths = torch.tensor([2, 0, 5, 3, 1])                              # an empty row, two longer than K
    return Preprocess().eval(), (ids, torch.tensor([0, 4, 4, 9]), x, torch.linspace(-2, 2, 9), torch.randn(11),
                                 lengths)
'''


def test_preprocessing_runs_on_a_gemm_only_chip_after_one_fill(tmp_path, capsys):
    (tmp_path / "prep.py").write_text(MODEL)
    chip = tmp_path / "chip.toml"
    chip.write_text('name = "chip"\ndevice = "cpu"\ntriton = "interpreter"\n[ops]\nsupported = '
                    + str(GEMM_ONLY).replace("'", '"') + "\n")
    ref = f"{tmp_path / 'prep.py'}:make"
    code = bringup.main(["--target", str(chip), "--model", ref, "--budget", "1", "--cache-dir", str(tmp_path / "kc"),
                         "--repro-dir", str(tmp_path / "repros")])
    out = capsys.readouterr().out
    assert code == 0 and "no host fallback left" in out, out
    target = Target("chip", device="cpu", triton="interpreter", supported=frozenset(GEMM_ONLY))
    model, inputs, got, graphs = run_compiled(ref, target, tmp_path / "kc")
    ops = {d.op for g in graphs for d in g.report.decisions}
    for op in ("aten.searchsorted.Tensor", "aten.bucketize.Tensor", "aten.repeat_interleave.Tensor",
               "aten.segment_reduce.default", "aten.scatter_add.default", "aten.histc.default", "aten.cumsum.default",
               "aten.constant_pad_nd.default", "aten.remainder.Scalar"):
        assert op in ops, (op, ops)
    assert any("embedding_bag" in op for op in ops), ops
    # every node computes on Triton (after its decomposition), none on the host or the vendor
    assert {column(d) for g in graphs for d in g.report.decisions} <= {"decompose", "triton", "view"}
    with torch.no_grad():
        want = model(*inputs)
    assert len(got) == len(want) == 11
    for g, w in zip(got, want):
        if w.is_floating_point():
            torch.testing.assert_close(g, w)
        else:  # ids, bucket ids, hashes, row ids and lengths: exactly eager's, dtype included
            assert g.dtype == w.dtype and torch.equal(g, w), (g, w)
    assert got[4].dtype == torch.int32
