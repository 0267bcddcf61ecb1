"""Constant attention masks folded on Dynamo's graph (compiling/attention_masks.py): a mask built
from aranges that changes nothing is dropped, the top-left causal one becomes is_causal, and any
mask that depends on an input, on random values or differs from both is kept; outputs unchanged."""
import torch
import torch.nn.functional as F

from torch_kernelize.compiling.attention_masks import classify_mask, fold_constant_masks


class Attention(torch.nn.Module):
    """Two SDPA layers sharing one mask, built the way a traced transformers model builds it."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[2]
        rows, cols = torch.arange(n), torch.arange(n)
        if self.kind == "full":
            return (cols[None, :] >= 0).expand(x.shape[0], 1, n, n)
        if self.kind == "causal":
            return (cols[None, :] <= rows[:, None])[None, None].expand(x.shape[0], 1, n, n)
        if self.kind == "additive":
            return torch.where(cols[None, :] <= rows[:, None], 0.0, torch.finfo(x.dtype).min)
        if self.kind == "window":  # a sliding window: neither all True nor causal
            return (cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - 2)
        if self.kind == "input":
            return x[..., :1, 0:1].expand(-1, -1, n, n) > -10
        return torch.rand(n, n) >= 0  # random: all True, but no constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mask(x)
        y = F.scaled_dot_product_attention(x, x, x, attn_mask=m)
        return F.scaled_dot_product_attention(y, x, x, attn_mask=m)


def _fold(kind: str):
    model, x = Attention(kind), torch.randn(2, 3, 5, 4)
    graphs, counts = [], []

    def backend(gm, example_inputs):
        counts.append(fold_constant_masks(gm))
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(model, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(got, model(x))
    sdpa = [n for n in graphs[0].graph.nodes if n.target is torch._C._nn.scaled_dot_product_attention]
    return counts[0], sdpa


def test_constant_masks_are_folded():
    for kind, causal in (("full", False), ("causal", True), ("additive", True)):
        count, sdpa = _fold(kind)
        assert count == 2, kind
        assert all(n.kwargs.get("attn_mask") is None for n in sdpa), kind
        assert all(bool(n.kwargs.get("is_causal")) == causal for n in sdpa), kind


def test_other_masks_are_kept():
    for kind in ("window", "input", "random"):
        count, sdpa = _fold(kind)
        assert count == 0, kind
        assert all(n.kwargs.get("attn_mask") is not None for n in sdpa), kind


def test_classify_mask_shapes():
    causal = torch.ones(3, 4, dtype=torch.bool).tril()
    assert classify_mask(causal, 3, 4) == "causal"
    assert classify_mask(causal[None, None], 3, 4) == "causal"
    assert classify_mask(torch.ones(1, 4, dtype=torch.bool), 3, 4) == "none"
    assert classify_mask(causal, 4, 3) is None          # shape does not fit (L, S)
    assert classify_mask(torch.zeros(3, 4), 3, 4) == "none"
    assert classify_mask(torch.full((3, 4), -1.0), 3, 4) is None  # a bias, not a mask
    assert classify_mask(torch.ones(3, 4, dtype=torch.int64), 3, 4) is None
