"""Small example models (the demo's embedded example, the test zoo, fill_cache --model targets).

Each ``make_*`` function returns ``(model, example_inputs)``, the form fill_cache's ``--model
torch_kernelize.examples:make_moe`` expects. Sizes are small so they run on CPU and on the
Triton interpreter in seconds.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


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
    """Top-k routed experts; tokens per expert counted with torch.histc (as GLM/DeepSeek-style code does)."""

    def __init__(self, d: int = 32, hidden: int = 32, experts: int = 4, k: int = 2):
        super().__init__()
        self.experts, self.k = experts, k
        self.gate = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, d) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, d, hidden) * 0.1)

    def forward(self, x):
        probs = self.gate(x).float().softmax(-1)
        topw, topi = probs.topk(self.k, -1)
        topw = (topw / topw.sum(-1, keepdim=True)).to(x.dtype)
        counts = torch.histc(topi.float(), bins=self.experts, min=0, max=self.experts - 1)
        order = topi.flatten().argsort()
        tok = order // self.k
        xs = x[tok]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.long().tolist()):
            if n:
                h = F.silu(xs[start:start + n] @ self.w1[e].t()) @ self.w2[e].t()
                out.index_add_(0, tok[start:start + n], h * topw.flatten()[order[start:start + n]].unsqueeze(-1))
            start += n
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


def _seeded(model: nn.Module, *inputs: torch.Tensor):
    return model.eval(), inputs


def make_mlp(batch: int = 8):
    torch.manual_seed(0)
    return _seeded(MLP(), torch.randn(batch, 32))


def make_conv1d(batch: int = 2):
    torch.manual_seed(0)
    return _seeded(Conv1dStack(), torch.randn(batch, 8, 24))


def make_transformer(batch: int = 2, seq: int = 8):
    torch.manual_seed(0)
    return _seeded(TransformerBlock(), torch.randn(batch, seq, 32))


def make_moe(tokens: int = 16):
    torch.manual_seed(0)
    return _seeded(MoE(), torch.randn(tokens, 32))


def make_inplace(batch: int = 4):
    torch.manual_seed(0)
    return _seeded(InPlace(), torch.randn(batch, 16))


class LogSpaceScan(nn.Module):
    """Running log-normalizers of scaled scores (a log-space prefix sum, as in CTC or linear
    recurrences), relative to the last one: aten.logcumsumexp, which no kernel family generates
    (demo_external's op)."""

    def __init__(self, scale: float = 0.5):
        super().__init__()
        self.scale = scale

    def forward(self, scores):
        running = torch.logcumsumexp(scores * self.scale, dim=-1)
        return running - running[:, -1:]


def make_log_scan(rows: int = 8, cols: int = 64):
    torch.manual_seed(0)
    return _seeded(LogSpaceScan(), torch.randn(rows, cols))




class Demo(nn.Module):
    """The demo's embedded example: a pre-norm MLP block followed by an MoE layer."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.norm = RMSNorm(d)
        self.mlp = MLP(d, 2 * d, d)
        self.moe = MoE(d, d, experts=4, k=2)

    def forward(self, x):
        x = x + self.mlp(self.norm(x))
        return x + self.moe(x)


def make_demo(tokens: int = 16):
    torch.manual_seed(0)
    return _seeded(Demo(), torch.randn(tokens, 32))


ZOO = {"mlp": make_mlp, "conv1d": make_conv1d, "transformer": make_transformer, "moe": make_moe,
       "inplace": make_inplace, "demo": make_demo}


# --- model definitions we do not write: transformers' own, built from tiny configs (no weights) ---
# Sizes fit the CPU tests and the interpreter; benchmarks/real_models.py builds them at real sizes.

def hf_model(config: object, batch: int, seq: int, dtype: torch.dtype | None = None, device: str = "cpu"):
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


def make_hf_llama(batch: int = 2, seq: int = 16):
    import transformers
    return hf_model(transformers.LlamaConfig(num_key_value_heads=2, **HF_TINY), batch, seq)


def make_hf_gpt2(batch: int = 2, seq: int = 16):
    import transformers
    return hf_model(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                            bos_token_id=0, eos_token_id=0), batch, seq)


def make_hf_mixtral(batch: int = 2, seq: int = 16):
    import transformers
    return hf_model(transformers.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                               **HF_TINY), batch, seq)


def make_hf_qwen3_moe(batch: int = 2, seq: int = 16):
    import transformers
    return hf_model(transformers.Qwen3MoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=64, head_dim=16, **HF_TINY), batch, seq)


def make_hf_bert(batch: int = 2, seq: int = 16):
    import transformers
    return hf_model(transformers.BertConfig(**HF_TINY), batch, seq)


HF_MODELS = {"llama": make_hf_llama, "gpt2": make_hf_gpt2, "mixtral": make_hf_mixtral,
             "qwen3_moe": make_hf_qwen3_moe, "bert": make_hf_bert}
