"""Models for the fill_cache tests (referenced as test/fill_models.py:FN on the command line)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Small(nn.Module):
    """Elementwise ops (silu decomposes to sigmoid and mul), a row reduction and histc."""

    def forward(self, x):
        h = F.silu(x) * 2.0
        return h.softmax(-1), torch.histc(x, bins=8, min=-2.0, max=2.0)


def make_small():
    torch.manual_seed(0)
    return Small(), (torch.randn(16, 32),)


class Wide(nn.Module):
    """One elementwise op on 16K elements: each interpreter candidate takes a noticeable time,
    so that a test can kill fill_cache in the middle of a search."""

    def forward(self, x):
        return torch.tanh(x)


def make_wide():
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


def make_experts():
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


def make_crossed():
    torch.manual_seed(0)
    return Crossed(), (torch.randn(8, 16), torch.randn(4, 32))


def make_conv1d():
    """A conv1d that the conv1d family's CUDA C++ configurations take (fp16, stride 1, on the GPU)."""
    torch.manual_seed(0)
    model = nn.Conv1d(32, 48, 3, padding=1).cuda().half()
    return model, (torch.randn(6, 32, 64, device="cuda", dtype=torch.float16),)


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


def make_attention():
    torch.manual_seed(0)
    # head dim 8 against 512 keys: the math decomposition's [L, S] scores are 16x the op's tensors
    return Attention(), (torch.randn(1, 512, 16),)


def make_tiny_llama():
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


class Centered(nn.Module):
    """Between two GEMMs, a region no fused kind holds: a mean over the batch dim (not the last),
    a pointwise epilogue of the first GEMM, and what joins them."""

    def __init__(self, d=32, f=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2((h - h.mean(0, keepdim=True)) * torch.sigmoid(h))


def make_centered():
    torch.manual_seed(0)
    return Centered(), (torch.randn(8, 32),)
