"""The seed workloads of the benchmark suite, in plain torch. Each make_* returns (model, inputs)
on CUDA, and is also a fill_cache --model target (benchmarks/workloads.py:make_conv1d)."""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_kernelize.examples import RMSNorm  # the same module the tests and the demo use

DEV = os.environ.get("KERNELIZE_BENCH_DEVICE", "cuda")  # "cpu" for a dry run of the planning


def _seed():
    torch.manual_seed(0)


class Conv1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(96, 96, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


def make_conv1d():
    _seed()
    return Conv1d().to(DEV).half().eval(), (torch.randn(2048, 96, 200, device=DEV, dtype=torch.half),)


class HistcFixed(nn.Module):
    def forward(self, x):
        return torch.histc(x, bins=256, min=-4.0, max=4.0)


class HistcData(nn.Module):
    def forward(self, x):
        return torch.histc(x, bins=256)


def make_histc_fixed():
    _seed()
    return HistcFixed().eval(), (torch.randn(1 << 24, device=DEV),)


def make_histc_data():
    _seed()
    return HistcData().eval(), (torch.randn(1 << 24, device=DEV),)


def make_rmsnorm():
    _seed()
    return RMSNorm(8192).to(DEV).half().eval(), (torch.randn(4096, 8192, device=DEV, dtype=torch.half),)


class MoE(nn.Module):
    """GLM/DeepSeek-style routed experts; tokens per expert counted with torch.histc; a loop over
    experts (the same formulation as the baseline measured in ../shared/notes)."""

    def __init__(self, d=1024, f=512, experts=16, k=4):
        super().__init__()
        self.experts, self.k = experts, k
        self.gate = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, f, d) * 0.02)
        self.w3 = nn.Parameter(torch.randn(experts, f, d) * 0.02)
        self.w2 = nn.Parameter(torch.randn(experts, d, f) * 0.02)

    def forward(self, x):
        probs = self.gate(x).float().softmax(-1)
        topw, topi = probs.topk(self.k, -1)
        topw = (topw / topw.sum(-1, keepdim=True)).to(x.dtype)
        counts = torch.histc(topi.float(), bins=self.experts, min=0, max=self.experts - 1)
        flat = topi.flatten()
        order = flat.argsort()
        tok = order // self.k
        xs = x[tok]
        out = torch.zeros_like(x)
        ends = counts.cumsum(0).long().tolist()
        start = 0
        for e in range(self.experts):
            end = ends[e]
            if end > start:
                h = xs[start:end]
                h = F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())
                h = h @ self.w2[e].t()
                out.index_add_(0, tok[start:end], h * topw.flatten()[order[start:end]].unsqueeze(-1))
            start = end
        return out


def make_moe():
    _seed()
    return MoE().to(DEV).half().eval(), (torch.randn(4096, 1024, device=DEV, dtype=torch.half),)


class Rope(nn.Module):
    def __init__(self, head_dim: int, max_seq: int = 4096, base: float = 10000.0):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        t = torch.arange(max_seq).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], -1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, q, k):
        s = q.shape[-2]
        cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)

        def rot(x):
            x1, x2 = x.chunk(2, -1)
            return torch.cat([-x2, x1], -1)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class DecoderLayer(nn.Module):
    def __init__(self, d=1024, heads=16, kv_heads=4, hidden=2816):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        self.rope = Rope(self.hd)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        q, k = self.rope(q, k)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, layers=4, d=1024, vocab=32000):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def make_llama():
    _seed()
    model = Llama().to(DEV).half().eval()
    for p in model.parameters():  # keep activations in range in fp16
        p.data.mul_(0.5)
    return model, (torch.randint(0, 32000, (8, 512), device=DEV),)


WORKLOADS = {
    "conv1d_B2048_C96_L200_k3_fp16": make_conv1d,
    "histc_16M_256bins_fixed": make_histc_fixed,
    "histc_16M_256bins_data_range": make_histc_data,
    "rmsnorm_4096x8192_fp16": make_rmsnorm,
    "moe_T4096_d1024_E16_top4_fp16": make_moe,
    "llama4L_d1024_b8_s512_fp16": make_llama,
}

# bytes / FLOPs floors (see benchmarks/README.md): for the notes
FLOORS = {
    "conv1d_B2048_C96_L200_k3_fp16": dict(bytes=2 * 2048 * 96 * 200 * 2, flops=2 * 2048 * 200 * 96 * 96 * 3),
    "histc_16M_256bins_fixed": dict(bytes=4 * (1 << 24), flops=0),
    "histc_16M_256bins_data_range": dict(bytes=4 * (1 << 24), flops=0),
    "rmsnorm_4096x8192_fp16": dict(bytes=2 * 2 * 4096 * 8192, flops=0),
}
