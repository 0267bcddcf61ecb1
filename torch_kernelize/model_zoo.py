"""The models this project defines, each with its input builder: one zoo for the demo, the tests,
``fill_cache --model`` and the benchmarks.

Each ``make_*`` function returns ``(model, example_inputs)``, the form ``fill_cache --model
torch_kernelize.model_zoo:make_moe`` expects. Its arguments size the model and its inputs; the
defaults are small, so that it runs on CPU and on the Triton interpreter in seconds
(``make_conv1d_layer``'s are a GPU shape). The benchmarks' seed workloads are the same models at
their benchmark sizes (``make_seed_*``, ``SEED_WORKLOADS``), built on ``$KERNELIZE_BENCH_DEVICE``
(default ``cuda``; ``cpu`` for a dry run of the planning). Models we do not write (transformers')
are built from configs at the end. This module imports only torch (transformers where asked), so
a test can load it by file path without importing torch_kernelize.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

ModelAndInputs = tuple[nn.Module, tuple]  # what every make_* returns: fill_cache --model's form


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))).softmax(-1)


class Conv1dStack(nn.Module):
    def __init__(self, c: int = 8, k: int = 3, layers: int = 2):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(c, c, k, padding=k // 2) for _ in range(layers))

    def forward(self, x):
        for conv in self.convs:
            x = F.silu(conv(x)) + x
        return x


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class TransformerBlock(nn.Module):
    """Pre-norm block: RMSNorm, causal multi-head attention, RMSNorm, SwiGLU MLP."""

    def __init__(self, d: int = 32, heads: int = 4, hidden: int = 64):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, GLM/DeepSeek style: tokens per expert counted with torch.histc,
    sorted by expert, and a loop over the experts (the formulation of the baseline measured in
    ../shared/notes; the demo's, the tests' and the benchmark's MoE)."""

    def __init__(self, d: int = 32, f: int = 32, experts: int = 4, k: int = 2, init_std: float = 0.1):
        super().__init__()
        self.experts, self.k = experts, k
        self.gate = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, f, d) * init_std)
        self.w3 = nn.Parameter(torch.randn(experts, f, d) * init_std)
        self.w2 = nn.Parameter(torch.randn(experts, d, f) * init_std)

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


class InPlace(nn.Module):
    """In-place ops on intermediates and on an input buffer (functionalization must keep both)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("steps", torch.zeros(d))

    def forward(self, x):
        h = self.lin(x)
        h.relu_()
        h.mul_(2.0).add_(1.0)
        self.steps.add_(1.0)
        return h.sigmoid_() + self.steps


def _seeded(model: nn.Module, *inputs: torch.Tensor) -> ModelAndInputs:
    return model.eval(), inputs


def make_mlp(batch: int = 8) -> ModelAndInputs:
    torch.manual_seed(0)
    return _seeded(MLP(), torch.randn(batch, 32))


def make_conv1d(batch: int = 2) -> ModelAndInputs:
    torch.manual_seed(0)
    return _seeded(Conv1dStack(), torch.randn(batch, 8, 24))


def make_transformer(batch: int = 2, seq: int = 8) -> ModelAndInputs:
    torch.manual_seed(0)
    return _seeded(TransformerBlock(), torch.randn(batch, seq, 32))


def make_moe(tokens: int = 16, d: int = 32, f: int = 32, experts: int = 4, k: int = 2, init_std: float = 0.1,
             dtype: torch.dtype = torch.float32, device: str = "cpu") -> ModelAndInputs:
    torch.manual_seed(0)
    model = MoE(d, f, experts, k, init_std).to(device, dtype)
    return _seeded(model, torch.randn(tokens, d, device=device, dtype=dtype))


def make_inplace(batch: int = 4) -> ModelAndInputs:
    torch.manual_seed(0)
    return _seeded(InPlace(), torch.randn(batch, 16))


class LogSpaceScan(nn.Module):
    """Running log-normalizers of scaled scores (a log-space prefix sum, as in CTC or linear
    recurrences), relative to the last one: aten.logcumsumexp (demo_external's op), which has no
    decomposition (the scan family generates it)."""

    def __init__(self, scale: float = 0.5):
        super().__init__()
        self.scale = scale

    def forward(self, scores):
        running = torch.logcumsumexp(scores * self.scale, dim=-1)
        return running - running[:, -1:]


def make_log_scan(rows: int = 8, cols: int = 64) -> ModelAndInputs:
    torch.manual_seed(0)
    return _seeded(LogSpaceScan(), torch.randn(rows, cols))


class Demo(nn.Module):
    """The demo's embedded example: a pre-norm MLP block followed by an MoE layer."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.norm = RMSNorm(d)
        self.mlp = MLP(d, 2 * d, d)
        self.moe = MoE(d, d, experts=2, k=1)  # (each expert adds three GEMMs to fill on the interpreter)

    def forward(self, x):
        x = x + self.mlp(self.norm(x))
        return x + self.moe(x)


def make_demo(tokens: int = 16) -> ModelAndInputs:
    torch.manual_seed(0)
    return _seeded(Demo(), torch.randn(tokens, 32))


# The small models the backend's end-to-end tests run on every target.
SMALL_MODELS = {"mlp": make_mlp, "conv1d": make_conv1d, "transformer": make_transformer, "moe": make_moe,
                "inplace": make_inplace, "demo": make_demo}


# --- models that each put one mechanism of the backend under test (fill_cache, regions, groups) ---

class Small(nn.Module):
    """Elementwise ops (silu decomposes to sigmoid and mul), a row reduction and histc."""

    def forward(self, x):
        h = F.silu(x) * 2.0
        return h.softmax(-1), torch.histc(x, bins=8, min=-2.0, max=2.0)


def make_small() -> ModelAndInputs:
    torch.manual_seed(0)
    return Small(), (torch.randn(16, 32),)


class Wide(nn.Module):
    """One elementwise op on 16K elements: each interpreter candidate takes a noticeable time,
    so that a test can kill fill_cache in the middle of a search."""

    def forward(self, x):
        return torch.tanh(x)


def make_wide() -> ModelAndInputs:
    torch.manual_seed(0)
    return Wide(), (torch.randn(64, 256),)


class Experts(nn.Module):
    """An MoE's expert loop with fixed routing (rows [start, end) go to expert e): GEMMs of one
    structure with different row counts, which run as matmul groups."""

    def __init__(self, ends=(5, 24, 40), d=32, f=16):
        super().__init__()
        self.ends = ends
        self.w1 = nn.Parameter(torch.randn(len(ends), f, d) * 0.2)
        self.w3 = nn.Parameter(torch.randn(len(ends), f, d) * 0.2)
        self.w2 = nn.Parameter(torch.randn(len(ends), d, f) * 0.2)

    def forward(self, x):
        out, start = [], 0
        for e, end in enumerate(self.ends):
            h = x[start:end]
            h = F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())
            out.append(h @ self.w2[e].t())
            start = end
        return torch.cat(out)


def make_experts() -> ModelAndInputs:
    torch.manual_seed(0)
    return Experts(), (torch.randn(40, 32),)


class Crossed(nn.Module):
    """Two GEMM structures, each feeding the other's second member: grouped both ways, the two
    groups would wait for each other, so only one may run fused."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 16, 32) * 0.2)   # [m, 16] @ [16, 32]
        self.v = nn.Parameter(torch.randn(2, 32, 16) * 0.2)   # [m, 32] @ [32, 16]

    def forward(self, x, z):
        xa = x @ self.w[0]
        yb = xa @ self.v[0]
        yc = z @ self.v[1]
        xd = yc @ self.w[1]
        return yb, xd


def make_crossed() -> ModelAndInputs:
    torch.manual_seed(0)
    return Crossed(), (torch.randn(8, 16), torch.randn(4, 32))


class Attention(nn.Module):
    """Causal self-attention over heads cut from the input (no projections: the attention is the
    work). Its output is viewed back as [B, L, H * E] through a transpose, so a tier that changed
    the attention's output layout would break the view."""

    def __init__(self, heads=2):
        super().__init__()
        self.heads = heads

    def forward(self, x):
        b, l, d = x.shape
        q = x.view(b, l, self.heads, d // self.heads).transpose(1, 2)
        k, v = (q * 0.5).sin(), q.cos()
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.transpose(1, 2).reshape(b, l, d) * 2.0


def make_attention() -> ModelAndInputs:
    torch.manual_seed(0)
    # head dim 8 against 256 keys: the math decomposition's [L, S] scores are ~40x the op's own
    # bytes, past the planner's MAX_DECOMPOSITION_GROWTH (it keeps the op whole)
    return Attention(), (torch.randn(1, 256, 16),)


class Centered(nn.Module):
    """Between two GEMMs, a region no fused kind holds: a mean over the batch dim (not the last),
    a pointwise epilogue of the first GEMM, and what joins them."""

    def __init__(self, d=32, f=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2((h - h.mean(0, keepdim=True)) * torch.sigmoid(h))


def make_centered() -> ModelAndInputs:
    torch.manual_seed(0)
    return Centered(), (torch.randn(8, 32),)


# --- the benchmarks' seed workloads: sized by arguments (small defaults), at benchmark sizes below ---

def make_conv1d_layer(batch: int = 6, c_in: int = 32, c_out: int = 48, length: int = 64, k: int = 3,
                      dtype: torch.dtype = torch.float16, device: str = "cuda") -> ModelAndInputs:
    """One conv1d (stride 1, same padding). The defaults are a shape the conv1d family's CUDA C++
    configurations take (fp16, on the GPU)."""
    torch.manual_seed(0)
    model = nn.Conv1d(c_in, c_out, k, padding=k // 2).to(device, dtype)
    return _seeded(model, torch.randn(batch, c_in, length, device=device, dtype=dtype))


class HistcFixed(nn.Module):
    def forward(self, x):
        return torch.histc(x, bins=256, min=-4.0, max=4.0)


class HistcData(nn.Module):
    """histc over the data's own range (min = max = 0): a reduction for the range first."""

    def forward(self, x):
        return torch.histc(x, bins=256)


def make_histc_fixed(n: int = 1 << 16, device: str = "cpu") -> ModelAndInputs:
    torch.manual_seed(0)
    return _seeded(HistcFixed(), torch.randn(n, device=device))


def make_histc_data(n: int = 1 << 16, device: str = "cpu") -> ModelAndInputs:
    torch.manual_seed(0)
    return _seeded(HistcData(), torch.randn(n, device=device))


def make_rmsnorm(rows: int = 64, d: int = 1024, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> ModelAndInputs:
    torch.manual_seed(0)
    return _seeded(RMSNorm(d).to(device, dtype), torch.randn(rows, d, device=device, dtype=dtype))


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
    """Llama's decoder layer: RMSNorm, GQA attention with RoPE through SDPA, RMSNorm, SwiGLU MLP."""

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
    """A Llama-style decoder in plain torch (ours; transformers' Llama is make_hf_llama)."""

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


def make_llama(layers: int = 4, d: int = 256, vocab: int = 1000, batch: int = 1, seq: int = 64,
               dtype: torch.dtype = torch.float32, device: str = "cpu") -> ModelAndInputs:
    torch.manual_seed(0)
    model = Llama(layers, d, vocab).to(device, dtype)
    for p in model.parameters():  # keep activations in range in fp16
        p.data.mul_(0.5)
    return _seeded(model, torch.randint(0, vocab, (batch, seq), device=device))


def bench_device() -> str:
    """Where the seed workloads are built: $KERNELIZE_BENCH_DEVICE, ``cuda`` by default."""
    return os.environ.get("KERNELIZE_BENCH_DEVICE", "cuda")


def make_seed_conv1d() -> ModelAndInputs:
    return make_conv1d_layer(batch=2048, c_in=96, c_out=96, length=200, k=3, dtype=torch.half, device=bench_device())


def make_seed_histc_fixed() -> ModelAndInputs:
    return make_histc_fixed(n=1 << 24, device=bench_device())


def make_seed_histc_data() -> ModelAndInputs:
    return make_histc_data(n=1 << 24, device=bench_device())


def make_seed_rmsnorm() -> ModelAndInputs:
    return make_rmsnorm(rows=4096, d=8192, dtype=torch.half, device=bench_device())


def make_seed_moe() -> ModelAndInputs:
    return make_moe(tokens=4096, d=1024, f=512, experts=16, k=4, init_std=0.02, dtype=torch.half,
                    device=bench_device())


def make_seed_llama() -> ModelAndInputs:
    return make_llama(layers=4, d=1024, vocab=32000, batch=8, seq=512, dtype=torch.half, device=bench_device())


# The seed workloads of benchmarks/run.py, by the names its results use (each a fill_cache --model target).
SEED_WORKLOADS = {
    "conv1d_B2048_C96_L200_k3_fp16": make_seed_conv1d,
    "histc_16M_256bins_fixed": make_seed_histc_fixed,
    "histc_16M_256bins_data_range": make_seed_histc_data,
    "rmsnorm_4096x8192_fp16": make_seed_rmsnorm,
    "moe_T4096_d1024_E16_top4_fp16": make_seed_moe,
    "llama4L_d1024_b8_s512_fp16": make_seed_llama,
}


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: 7x7 depthwise conv, LayerNorm over channels (channels last), an
    inverted-bottleneck MLP with GELU, layer scale, residual."""

    def __init__(self, c: int):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """A tiny ConvNeXt: patchify stem (4x4, stride 4) + LayerNorm, a block, a downsampling stage
    (LayerNorm + 2x2 stride-2 conv), a block, global pooling, LayerNorm, classifier."""

    def __init__(self, dims: tuple[int, int] = (16, 32), classes: int = 10):
        super().__init__()
        self.stem, self.stem_norm = nn.Conv2d(3, dims[0], 4, stride=4), nn.LayerNorm(dims[0], eps=1e-6)
        self.block1, self.block2 = ConvNeXtBlock(dims[0]), ConvNeXtBlock(dims[1])
        self.down_norm, self.down = nn.LayerNorm(dims[0], eps=1e-6), nn.Conv2d(dims[0], dims[1], 2, stride=2)
        self.head_norm, self.head = nn.LayerNorm(dims[1], eps=1e-6), nn.Linear(dims[1], classes)

    @staticmethod
    def _channel_norm(norm: nn.LayerNorm, x):
        return norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def forward(self, x):
        x = self.block1(self._channel_norm(self.stem_norm, self.stem(x)))
        x = self.block2(self.down(self._channel_norm(self.down_norm, x)))
        return self.head(self.head_norm(x.mean((2, 3))))


def make_convnext(batch: int = 2, size: int = 32) -> ModelAndInputs:
    torch.manual_seed(0)
    return ConvNeXt().eval(), (torch.randn(batch, 3, size, size),)


# --- model definitions we do not write: transformers' own, built from tiny configs (no weights) ---
# Sizes fit the CPU tests and the interpreter; benchmarks/real_models.py builds them at real sizes.

def hf_model(config: object, batch: int, seq: int, dtype: torch.dtype | None = None,
             device: str = "cpu") -> ModelAndInputs:
    """transformers' model for ``config`` without weights (seeded random init), in eval mode, built on
    ``device`` in ``dtype``: a masked LM for BERT, a causal LM otherwise; random token ids as input."""
    import transformers
    torch.manual_seed(0)
    cls = transformers.AutoModelForMaskedLM if config.model_type == "bert" else transformers.AutoModelForCausalLM
    with torch.device(device):
        model = cls.from_config(config).eval()
    if dtype is not None:
        model = model.to(dtype)
    return model, (torch.randint(0, config.vocab_size, (batch, seq), device=device),)


HF_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)


def make_hf_llama(batch: int = 2, seq: int = 16) -> ModelAndInputs:
    import transformers
    return hf_model(transformers.LlamaConfig(num_key_value_heads=2, **HF_TINY), batch, seq)


def make_hf_gpt2(batch: int = 2, seq: int = 16) -> ModelAndInputs:
    import transformers
    return hf_model(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                            bos_token_id=0, eos_token_id=0), batch, seq)


def make_hf_mixtral(batch: int = 2, seq: int = 16) -> ModelAndInputs:
    import transformers
    return hf_model(transformers.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                               **HF_TINY), batch, seq)


def make_hf_qwen3_moe(batch: int = 2, seq: int = 16) -> ModelAndInputs:
    import transformers
    return hf_model(transformers.Qwen3MoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=64, head_dim=16, **HF_TINY), batch, seq)


def make_hf_bert(batch: int = 2, seq: int = 16) -> ModelAndInputs:
    import transformers
    return hf_model(transformers.BertConfig(**HF_TINY), batch, seq)


def make_hf_t5(batch: int = 2, seq: int = 8) -> ModelAndInputs:
    """transformers' T5 (one encoder and one decoder layer); returns the logits. Its relative
    position buckets put the same ops in the encoder and the decoder, fused in one and not the
    other: fill_cache must fill each spec wherever serving runs it alone (test_one_fill.py)."""
    import transformers

    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
                                num_heads=4, decoder_start_token_id=0)
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(cfg).eval()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.t5 = t5

        def forward(self, ids, decoder_ids):
            return self.t5(input_ids=ids, decoder_input_ids=decoder_ids).logits

    return Logits(), (torch.randint(0, 128, (batch, seq)), torch.randint(0, 128, (batch, seq)))


HF_MODELS = {"llama": make_hf_llama, "gpt2": make_hf_gpt2, "mixtral": make_hf_mixtral,
             "qwen3_moe": make_hf_qwen3_moe, "bert": make_hf_bert}


def make_hf_llama_logits() -> ModelAndInputs:
    """transformers' Llama (one layer, GQA: 4 query heads over 2 key/value heads) through its
    SDPA attention; returns the logits."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    llama = transformers.AutoModelForCausalLM.from_config(cfg).eval()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.llama = llama

        def forward(self, ids):
            return self.llama(ids).logits

    return Logits(), (torch.randint(0, 64, (1, 32)),)
