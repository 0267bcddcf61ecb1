"""A DLRM-style ranking model on a GEMM-only chip (issue 44): EmbeddingBag tables with offsets
(sum mode, one with per_sample_weights, an empty bag), a bottom MLP on dense features, the
pairwise dot-product interaction of the embeddings and the bottom output (bmm, then a triu
index gather with two index tensors), a top MLP and a sigmoid. After one fill through bring-up,
inference and a training step (embedding_bag's backward and per_sample_weights' gradient
included) run every node on the chip and match eager; the embedding bags decompose."""
from __future__ import annotations

import json

import pytest
import torch

from torch_kernelize import bringup
from torch_kernelize.core.errors import IndexOutOfRange
from torch_kernelize.core.targets import Target
from torch_kernelize.fill_cache.collect import served_model

GEMM_ONLY = ["aten.mm", "aten.addmm", "aten.bmm", "aten.convolution"]
MODEL = '''
import torch
class DLRM(torch.nn.Module):
    def __init__(self, rows=(10, 7, 12), dim=4, dense=5):
        super().__init__()
        self.tables = torch.nn.ModuleList(torch.nn.EmbeddingBag(n, dim, mode="sum") for n in rows)
        self.bottom = torch.nn.Sequential(torch.nn.Linear(dense, 8), torch.nn.ReLU(), torch.nn.Linear(8, dim),
                                          torch.nn.ReLU())
        f = len(rows) + 1
        li, lj = torch.triu_indices(f, f, offset=1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.top = torch.nn.Sequential(torch.nn.Linear(dim + f * (f - 1) // 2, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))

    def forward(self, dense, ids0, off0, ids1, off1, ids2, off2, weights2):
        x = self.bottom(dense)
        e = [self.tables[0](ids0, off0), self.tables[1](ids1, off1),
             self.tables[2](ids2, off2, per_sample_weights=weights2)]
        t = torch.stack([x] + e, 1)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.li, self.lj]
        return torch.sigmoid(self.top(torch.cat([x, z], 1)))

def make():
    torch.manual_seed(0)
    ids0, off0 = torch.tensor([1, 3, 9, 0, 3, 2]), torch.tensor([0, 2, 2, 5])      # bag 1 empty
    ids1, off1 = torch.tensor([6, 0, 5, 5]), torch.tensor([0, 1, 2, 3])
    ids2, off2 = torch.tensor([11, 4, 7, 0, 1, 2, 3]), torch.tensor([0, 3, 3, 3])  # bags 1, 2 empty
    return DLRM(), (torch.randn(4, 5), ids0, off0, ids1, off1, ids2, off2, torch.rand(7))
'''


def _bringup(tmp_path, *extra: str) -> tuple[int, str, list[dict]]:
    (tmp_path / "dlrm.py").write_text(MODEL)
    chip = tmp_path / "chip.toml"
    chip.write_text('name = "chip"\ndevice = "cpu"\ntriton = "interpreter"\n[ops]\nsupported = '
                    + str(GEMM_ONLY).replace("'", '"') + "\n")
    summary = tmp_path / "summary.json"
    code = bringup.main(["--target", str(chip), "--model", f"{tmp_path / 'dlrm.py'}:make", "--budget", "1",
                         "--cache-dir", str(tmp_path / "kc"), "--repro-dir", str(tmp_path / "repros"),
                         "--json", str(summary), *extra])
    return code, summary.read_text() if summary.exists() else "", json.loads(summary.read_text() or "[]")


def _check_on_chip(result: dict, ops: list[str]) -> None:
    assert result["on_target_pct"] == 100.0 and result["matches"] and result["tiers"]["fallback"] == 0, result
    for op in ops:  # decomposed into what the families generate, never on the vendor tier or the host
        assert set(result["per_op"][op]) == {"decompose"}, (op, result["per_op"][op])


def test_dlrm_inference_runs_on_a_gemm_only_chip_after_one_fill(tmp_path, capsys):
    """Then served again with invalid values of the same shapes: an id past its table, a negative
    id, a first offset other than 0 and an offset past the ids raise on the chip where eager raises
    (an IndexError from the kernels' range checks, where eager's is a RuntimeError)."""
    code, text, (result,) = _bringup(tmp_path)
    out = capsys.readouterr().out
    assert code == 0 and "no host fallback left" in out, out
    assert result["max_err"] <= 1e-5, text
    _check_on_chip(result, ["aten._embedding_bag.default"])
    assert result["per_op"]["aten._embedding_bag.default"]["decompose"] == 3
    assert set(result["per_op"]["aten.index.Tensor"]) == {"triton"}  # the triu gather (two index tensors)
    assert set(result["per_op"]["aten.bmm.default"]) <= {"triton", "vendor"}

    target = Target("chip", device="cpu", triton="interpreter", supported=frozenset(GEMM_ONLY))
    with served_model(f"{tmp_path / 'dlrm.py'}:make", target, tmp_path / "kc") as (model, inputs, compiled, _, _):
        for position, bad in [(1, [1, 3, 10, 0, 3, 2]), (1, [1, 3, -1, 0, 3, 2]), (2, [1, 2, 2, 5]), (2, [0, 2, 2, 7])]:
            args = list(inputs)
            args[position] = torch.tensor(bad)
            with torch.no_grad():
                with pytest.raises(RuntimeError):
                    model(*args)
                with pytest.raises(IndexOutOfRange):
                    compiled(*args)
        with torch.no_grad():  # the same graph, valid values again
            torch.testing.assert_close(compiled(*inputs), model(*inputs))


def test_dlrm_training_step_runs_on_a_gemm_only_chip_after_one_fill(tmp_path, capsys):
    """Forward and backward graphs after `--training`'s fill: embedding_bag's bookkeeping outputs
    (offset2bag, bag sizes) feed its decomposed backward; gradients of every table, both MLPs
    and the dense and per-sample-weight inputs match eager's."""
    code, text, (result,) = _bringup(tmp_path, "--training")
    out = capsys.readouterr().out
    assert code == 0 and "no host fallback left" in out, out
    assert result["kinds"] == {"backward": 100.0, "forward": 100.0}, text
    assert result["max_err"] <= 1e-5, text
    _check_on_chip(result, ["aten._embedding_bag.default", "aten._embedding_bag_backward.default",
                            "aten._embedding_bag_per_sample_weights_backward.default"])



POOLING = '''
import torch
class Pooling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(9, 3, mode="max", padding_idx=2, include_last_offset=True)

    def forward(self, ids, offsets, values, lengths):
        return self.bag(ids, offsets), torch.segment_reduce(values, "max", lengths=lengths, initial=0.5)

def make():
    torch.manual_seed(0)
    model = Pooling().eval()
    with torch.no_grad():
        model.bag.weight[4, 0] = float("nan")           # a bag's first row: its max is NaN
        model.bag.weight[7, 1] = model.bag.weight[1, 1]  # a tie: the first one's id
    return model, (torch.tensor([4, 1, 7, 2, 2, 0]), torch.tensor([0, 3, 3, 5, 6]), torch.randn(4),
                   torch.tensor([3, 0, 1]))
'''


def test_max_pooled_bags_and_segments_run_on_the_chip(tmp_path, capsys):
    """Max-mode bags (padding_idx, include_last_offset, an empty bag, a bag of padding only, NaN and
    ties) and segment max with an initial value, on a chip whose vendor runs nothing: their
    segmented scans run on the chip, matching eager."""
    (tmp_path / "pool.py").write_text(POOLING)
    chip = tmp_path / "chip.toml"
    chip.write_text('name = "chip"\ndevice = "cpu"\ntriton = "interpreter"\n[ops]\nsupported = []\n')
    code = bringup.main(["--target", str(chip), "--model", f"{tmp_path / 'pool.py'}:make", "--budget", "1",
                         "--cache-dir", str(tmp_path / "kc"), "--repro-dir", str(tmp_path / "repros")])
    out = capsys.readouterr().out
    assert code == 0 and "no host fallback left" in out, out
