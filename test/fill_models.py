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
