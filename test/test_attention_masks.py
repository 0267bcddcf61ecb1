"""Constant attention masks folded on Dynamo's graph (compiling/attention_masks.py): a mask built
from aranges that changes nothing is dropped, the top-left causal one becomes is_causal, and any
mask that depends on an input, on random values or differs from both is kept; outputs unchanged."""
import torch
import torch.nn.functional as F

from torch_kernelize.compiling.attention_masks import classify_mask, fold_constant_masks


class Attention(torch.nn.Module):
    """Two SDPA layers sharing one mask, built the way a traced transformers model builds it."""

    def __init__(self, kind: str, width: int = 2):
        super().__init__()
        self.kind, self.width = kind, width

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
            return (cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - self.width)
        if self.kind == "input":
            return x[..., :1, 0:1].expand(-1, -1, n, n) > -10
        return torch.rand(n, n) >= 0  # random: all True, but no constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mask(x)
        y = F.scaled_dot_product_attention(x, x, x, attn_mask=m)
        return F.scaled_dot_product_attention(y, x, x, attn_mask=m)


def _fold(kind: str, dynamic: bool = False, width: int = 2):
    model, x = Attention(kind, width), torch.randn(2, 3, 5, 4)
    graphs, counts = [], []

    def backend(gm, example_inputs):
        counts.append(fold_constant_masks(gm))
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    torch.testing.assert_close(compiled(x), model(x))
    if dynamic:  # the one graph serves other lengths, past any window too, with outputs unchanged
        for n in (3, 9, 17):
            y = torch.randn(2, 3, n, 4)
            torch.testing.assert_close(compiled(y), model(y))
        assert len(graphs) == 1
    sdpa = [n for n in graphs[0].graph.nodes if n.target is torch._C._nn.scaled_dot_product_attention]
    return counts[0], sdpa


def test_constant_masks_are_folded():
    for kind, causal in (("full", False), ("causal", True), ("additive", True)):
        count, sdpa = _fold(kind)
        assert count == 2, kind
        assert all(n.kwargs.get("attn_mask") is None for n in sdpa), kind
        assert all(bool(n.kwargs.get("is_causal")) == causal for n in sdpa), kind


def test_masks_of_the_sizes_alone_are_folded_in_a_dynamic_graph():
    """A dynamic trace builds its mask from the size inputs: folded where it is the same kind at
    every size probed, and the size inputs stay (Dynamo passes them)."""
    for kind, causal in (("full", False), ("causal", True), ("additive", True)):
        count, sdpa = _fold(kind, dynamic=True)
        assert count == 2, kind
        assert all(n.kwargs.get("attn_mask") is None for n in sdpa), kind
        assert all(bool(n.kwargs.get("is_causal")) == causal for n in sdpa), kind


def test_a_window_wider_than_the_traced_length_is_kept_in_a_dynamic_graph():
    """Traced at length 5, a window of 6 is causal there and not past 6: the probes on each side of
    its width find that; a width past MAX_PROBE is not probed, and the mask stays."""
    from torch_kernelize.compiling.attention_masks import MAX_PROBE
    for width in (2, 6, MAX_PROBE + 1):
        count, sdpa = _fold("window", dynamic=True, width=width)
        assert count == 0 and all(n.kwargs.get("attn_mask") is not None for n in sdpa), width
    assert _fold("window", width=6)[0] == 2  # (a static graph of length 5: causal, rightly)


def test_other_masks_are_kept():
    for kind, dynamic in (("window", False), ("input", False), ("random", False), ("input", True), ("random", True)):
        count, sdpa = _fold(kind, dynamic)
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
