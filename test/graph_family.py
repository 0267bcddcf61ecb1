"""A test generator for one graph region that no family of ours generates: the region between
model_zoo.Centered's two GEMMs (a mean over the batch dim, the first GEMM's sigmoid epilogue,
and what joins them). It stands for a whole-graph generator (the Inductor one) in the tests of
graph regions: its program is recorded from ``launch`` like a candidate file's and goes through
fill_cache's harness. ``WRONG`` makes a family whose kernel is off by a little (no correct candidate)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from torch_kernelize.lowering.kernels.base import Config, KernelFamily
from torch_kernelize.lowering.kernels.recording import record_program

OPS = ["aten.mean.dim", "aten.sub.Tensor", "aten.sigmoid.default", "aten.mul.Tensor"]


@triton.jit
def centered_region(h, mean_out, sub_out, sig_out, mul_out, M, N, s_hm, s_hn, s_mn, s_sm, s_sn, s_gm, s_gn,
                    s_pm, s_pn, BM: tl.constexpr, BN: tl.constexpr, WRONG: tl.constexpr):
    rows = tl.arange(0, BM)[:, None]
    cols = tl.arange(0, BN)[None, :]
    inside = (rows < M) & (cols < N)
    x = tl.load(h + rows * s_hm + cols * s_hn, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / M
    if WRONG:
        mean = mean + 0.01
    sub = x - mean[None, :]
    sig = tl.sigmoid(x)
    tl.store(mean_out + cols * s_mn, mean[None, :], mask=cols < N)
    tl.store(sub_out + rows * s_sm + cols * s_sn, sub, mask=inside)
    tl.store(sig_out + rows * s_gm + cols * s_gn, sig, mask=inside)
    tl.store(mul_out + rows * s_pm + cols * s_pn, sub * sig, mask=inside)


def launch(h, outputs=("mul",), wrong=False):
    """The region's outputs, named by their ops' short names (mean, sub, sigmoid, mul)."""
    M, N = h.shape
    values = {"mean": torch.empty((1, N), dtype=h.dtype, device=h.device)}
    for name in ("sub", "sigmoid", "mul"):
        values[name] = torch.empty_like(h)
    mean, sub, sig, mul = values["mean"], values["sub"], values["sigmoid"], values["mul"]
    centered_region[(1,)](h, mean, sub, sig, mul, M, N, *h.stride(), mean.stride(1), *sub.stride(), *sig.stride(),
                          *mul.stride(), BM=triton.next_power_of_2(M), BN=triton.next_power_of_2(N), WRONG=wrong)
    return tuple(values[name] for name in outputs)


class CenteredRegionFamily(KernelFamily):
    edge_kinds = ()

    def __init__(self, wrong: bool = False):
        self.wrong = wrong
        self.name = "test_centered_region" + ("_wrong" if wrong else "")

    def supports(self, spec):
        graph = json.loads(spec.graph) if spec.graph is not None else {}
        if graph.get("kind") != "graph" or [n["op"] for n in graph["nodes"]] != OPS:
            return f"{self.name} only generates the graph region {OPS}"
        return None

    def seed_configs(self, spec):
        return [Config.of(variant="one_program")]

    def generate(self, spec, config):
        graph = json.loads(spec.graph)
        names = tuple(graph["nodes"][i]["op"].split(".")[1] for i in graph["outputs"])
        module = sys.modules[__name__]
        inputs = self.sample_inputs(spec, 7)
        return record_program(lambda h: launch(h, names, self.wrong), inputs, spec,
                              Path(__file__).read_text(), module)


RIGHT = CenteredRegionFamily()
WRONG = CenteredRegionFamily(wrong=True)
