"""Attention masks that are constants of the graph, folded before tracing.

transformers builds its attention mask inside the model. In eager it skips the mask when it
would change nothing (no padding: all True; a causal mask SDPA can express as ``is_causal``), so
``scaled_dot_product_attention`` runs flash or cuDNN attention. While tracing it cannot look at
values, so a compiled model materializes the mask (a ``(B, 1, L, S)`` bool tensor from aranges;
transformers issue #48925), and a masked SDPA on CUDA can only take the efficient or the math
kernel: on the H200 BERT's attention took 5.1 ms of GPU per call under torch.compile against
2.9 ms in eager.

A mask computed from no input of the graph (no placeholder among its ancestors, nothing random)
is a constant: this pass evaluates it once on the Dynamo graph, before aot_autograd, and where it
is all True (or all zero, additive) drops it; where it is exactly the top-left causal mask of
``(L, S)`` (True / 0 on and below the diagonal, False / -inf or the dtype's minimum above) it
becomes ``is_causal=True``. Both are the op's own semantics, so outputs are unchanged; then the
trace picks the kernel eager would pick. Any other mask is left as it is.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

log = logging.getLogger("torch_kernelize.compiling.attention_masks")

SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
# ops whose values differ from call to call (or are uninitialized): a mask using them is no constant
_NOT_CONSTANT = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson",
                 "exponential", "empty", "seed")
_MASK_POS, _CAUSAL_POS = 3, 5  # scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, ...)


def _arg(node: fx.Node, pos: int, name: str, default: Any = None) -> Any:
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def _set_arg(node: fx.Node, pos: int, name: str, value: Any) -> None:
    if len(node.args) > pos:
        args = list(node.args)
        args[pos] = value
        node.args = tuple(args)
    else:
        node.update_kwarg(name, value)


def _constant_ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order, or None if any is an input or random."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "output", "call_module"):
            return None
        name = getattr(n.target, "__name__", str(n.target)).lower()
        if any(word in name for word in _NOT_CONSTANT):
            return None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(gm: fx.GraphModule, nodes: list[fx.Node]) -> Any:
    """Run ``nodes`` (closed under inputs, no placeholders) and return the last one's value."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[nodes[-1]])
    with torch.no_grad(), unset_fake_temporarily():
        return fx.GraphModule(gm, g)()


def classify_mask(mask: torch.Tensor, length: int, source: int) -> str | None:
    """'none' if ``mask`` changes nothing, 'causal' if it is SDPA's top-left causal mask of
    ``(length, source)``, else None. Broadcast over any leading dims."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) not in ((length, source), (1, source), (length, 1), (1, 1)):
        return None
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        low = torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | (mask <= low)).all()):
            return None
        keep = mask == 0
    else:
        return None
    keep = keep.expand(*keep.shape[:-2], length, source)
    if bool(keep.all()):
        return "none"
    causal = torch.ones(length, source, dtype=torch.bool, device=mask.device).tril()
    return "causal" if bool((keep == causal).all()) else None


def _mask_kind(gm: fx.GraphModule, node: fx.Node, mask: fx.Node, memo: dict) -> str | None:
    """'none', 'causal' or None for the mask ``node`` (an SDPA call) reads; ``memo`` holds each
    mask's value, evaluated once however many layers share it."""
    q, k = (a.meta.get("example_value") if isinstance(a, fx.Node) else None for a in node.args[:2])
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return None
    length, source = q.shape[-2], k.shape[-2]
    if not isinstance(length, int) or not isinstance(source, int):  # symbolic: no one constant fits
        return None
    if mask not in memo:
        nodes = _constant_ancestors(mask)
        try:
            memo[mask] = (_evaluate(gm, nodes), nodes) if nodes is not None else (None, None)
        except Exception as e:  # a mask we cannot evaluate is kept: the trace handles it as before
            log.debug("attention mask %s not evaluated: %s", mask.name, e)
            memo[mask] = (None, None)
    value = memo[mask][0]
    return classify_mask(value, length, source) if isinstance(value, torch.Tensor) else None


def fold_constant_masks(gm: fx.GraphModule) -> int:
    """Drop every constant attention mask that changes nothing, or turn it into ``is_causal``;
    return how many SDPA calls were rewritten. ``gm`` is Dynamo's graph (torch-level calls)."""
    memo: dict[fx.Node, tuple[Any, list[fx.Node] | None]] = {}
    folded = causal = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA:
            continue
        mask = _arg(node, _MASK_POS, "attn_mask")
        if not isinstance(mask, fx.Node) or _arg(node, _CAUSAL_POS, "is_causal", False):
            continue
        kind = _mask_kind(gm, node, mask, memo)
        if kind is None:
            continue
        _set_arg(node, _MASK_POS, "attn_mask", None)
        if kind == "causal":
            _set_arg(node, _CAUSAL_POS, "is_causal", True)
            causal += 1
        folded += 1
    if not folded:
        return 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    computed = {n for _, nodes in memo.values() for n in nodes or []}
    for n in sorted(computed, key=order.__getitem__, reverse=True):  # what nothing reads any more
        if not n.users:
            gm.graph.erase_node(n)
    gm.recompile()
    log.info("attention: %d constant mask(s) folded (%d as is_causal)", folded, causal)
    return folded
