"""A ranking model's preprocessing on a GEMM-only chip: EmbeddingBag (mean, padding_idx, empty
bag), searchsorted of a sorted boundary row, a modulo hash of int64 ids: every node on the chip
after one fill, every output (integers too) exactly eager's."""
from __future__ import annotations

import torch

from torch_kernelize import bringup
from torch_kernelize.core.targets import Target
from torch_kernelize.fill_cache.collect import run_compiled

GEMM_ONLY = ["aten.mm", "aten.addmm", "aten.bmm", "aten.convolution"]
MODEL = '''
import torch
class Preprocess(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(20, 8, mode="mean", padding_idx=3)
    def forward(self, ids, offsets, x, boundaries):
        return self.bag(ids, offsets), torch.searchsorted(boundaries, x, side="right"), torch.remainder(ids * 31 ^ 7, 5)
def make():
    torch.manual_seed(0)
    ids = torch.tensor([3, 1, 7, 19, 3, 0, 5, 5, 12, 3, 8, 2])
    return Preprocess().eval(), (ids, torch.tensor([0, 4, 4, 9]), torch.randn(6), torch.linspace(-2, 2, 9))
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
    assert "aten.searchsorted.Tensor" in ops and any("embedding_bag" in op for op in ops), ops
    assert not any(d.tier == "vendor" and "embedding_bag" in d.op for g in graphs for d in g.report.decisions)
    with torch.no_grad():
        want = model(*inputs)
    torch.testing.assert_close(got[0], want[0])
    assert got[1].dtype == want[1].dtype and torch.equal(got[1], want[1])
    assert got[2].dtype == want[2].dtype and torch.equal(got[2], want[2])
