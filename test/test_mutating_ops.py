"""Mutating ops are decided by the ladder against the chip's op list: eval BatchNorm on a chip
without it is decomposed (never claimed by the vendor tier), and a host fallback keeps its writes."""
from __future__ import annotations

import torch

from torch_kernelize import bringup
from torch_kernelize.core.targets import Target
from torch_kernelize.fallbacks.host import _write_back

aten = torch.ops.aten
GEMM_ONLY = ["aten.mm", "aten.addmm", "aten.bmm", "aten.convolution"]
MODEL = '''
import torch
def make():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1); m[1].running_var.uniform_(0.5, 2)
    return m, (torch.randn(2, 3, 6, 6),)
'''


def _conv_bn():
    ns: dict = {}
    exec(MODEL, ns)
    return ns["make"]()


def test_eval_batchnorm_is_not_on_the_vendor_tier_of_a_chip_without_it(tmp_path):
    from torch_kernelize.fill_cache.collect import run_compiled
    (tmp_path / "convbn.py").write_text(MODEL)
    chip = Target("chip", device="cpu", triton="none", supported=frozenset())
    model, (x,), got, graphs = run_compiled(f"{tmp_path / 'convbn.py'}:make", chip, tmp_path / "kc")
    decisions = [d for g in graphs for d in g.report.decisions]
    norms = [d for d in decisions if "batch_norm" in d.op]
    assert norms and all(d.tier == "decompose" for d in norms), norms
    computed = [d for d in decisions if d.tier == "vendor" and "view op" not in d.reason
                and "factory op" not in d.reason]
    assert not computed, computed  # the chip runs nothing: no op that computes is the vendor's
    with torch.no_grad():
        torch.testing.assert_close(got, model(x))


def test_conv_batchnorm_runs_on_a_gemm_only_chip_after_one_fill(tmp_path, capsys):
    (tmp_path / "convbn.py").write_text(MODEL)
    chip = tmp_path / "chip.toml"
    chip.write_text('name = "chip"\ndevice = "cpu"\ntriton = "interpreter"\n[ops]\nsupported = '
                    + str(GEMM_ONLY).replace("'", '"') + "\n")
    code = bringup.main(["--target", str(chip), "--model", f"{tmp_path / 'convbn.py'}:make", "--budget", "1",
                         "--cache-dir", str(tmp_path / "kc"), "--repro-dir", str(tmp_path / "repros")])
    out = capsys.readouterr().out
    assert code == 0 and "100.0%" in out and "no host fallback left" in out, out
    from torch_kernelize.fill_cache.collect import run_compiled
    target = Target("chip", device="cpu", triton="interpreter", supported=frozenset(GEMM_ONLY))
    _, _, _, graphs = run_compiled(f"{tmp_path / 'convbn.py'}:make", target, tmp_path / "kc")
    vendor = {d.op for g in graphs for d in g.report.decisions if d.tier == "vendor" and "view op" not in d.reason
              and "factory op" not in d.reason}
    assert vendor == {"aten.convolution.default"}, vendor  # the BatchNorm runs as the chip's kernels


def test_a_host_fallback_on_a_device_writes_a_mutating_ops_writes_back():
    # (the host ran the op on copies of the device tensors: the writes must reach the originals)
    dev, src = torch.zeros(3), torch.ones(3)
    host_dev, host_src = dev.clone(), src.clone()
    aten.add_.Tensor(host_dev, host_src)
    _write_back(aten.add_.Tensor, ((dev, src), {}), ((host_dev, host_src), {}))
    assert torch.equal(dev, torch.ones(3)) and torch.equal(src, torch.ones(3))


def test_an_op_with_only_empty_outputs_is_an_allocation():
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.compiling.op_classes import NodeClass, classify
    gm = make_fx(lambda x: (x[:, :0] * 2, x * 2), tracing_mode="fake")(torch.randn(3, 4))
    muls = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    assert [classify(n)[0] for n in muls] == [NodeClass.VIEW, NodeClass.COMPUTE]
