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

A graph traced with dynamic sizes builds its mask from the size inputs (transformers 5's
``sdpa_mask``: aranges of the length and the batch): no one value, but a function of the sizes
alone. It is folded where it has the same kind at every size it is evaluated at: the traced sizes,
2 and 3, and on each side of every integer literal of its computation (a sliding window's width
or a chunk's length is one: such a mask differs from the causal one just past it). Such a
literal past ``MAX_PROBE`` keeps the mask. Without this a varying-length graph kept its mask,
and with it cuDNN's attention, which builds a plan at every new length (issue 41: 60 of a first
call's 73-81 ms on the H100).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

log = logging.getLogger("torch_kernelize.compiling.attention_masks")

SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
# ops whose values differ from call to call (or are uninitialized): a mask using them is no constant
_NOT_CONSTANT = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson",
                 "exponential", "empty", "seed")
_MASK_POS, _CAUSAL_POS = 3, 5  # scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, ...)
MAX_PROBE = 8192  # the longest size a mask of the sizes is evaluated at (a bool mask of 8194^2: 67 MB)


def _arg(node: fx.Node, pos: int, name: str, default: Any = None) -> Any:
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def _set_arg(node: fx.Node, pos: int, name: str, value: Any) -> None:
    if len(node.args) > pos:
        args = list(node.args)
        args[pos] = value
        node.args = tuple(args)
    else:
        node.update_kwarg(name, value)


def _is_size_input(n: fx.Node) -> bool:
    return n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.SymInt)


def _constant_ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order (size inputs among them), or None if
    any is a tensor input or random."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_size_input(n):
            continue
        if n.op in ("placeholder", "output", "call_module"):
            return None
        name = getattr(n.target, "__name__", str(n.target)).lower()
        if any(word in name for word in _NOT_CONSTANT):
            return None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(gm: fx.GraphModule, nodes: list[fx.Node], sizes: Sequence[int] = ()) -> Any:
    """Run ``nodes`` (closed under inputs; its placeholders, size inputs, take ``sizes`` in graph
    order) and return the last one's value."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[nodes[-1]])
    with torch.no_grad(), unset_fake_temporarily():
        return fx.GraphModule(gm, g)(*sizes)


def _literals(nodes: list[fx.Node]) -> set[int]:
    """The integer literals >= 2 of the nodes' arguments (slices' bounds included)."""
    found: set[int] = set()

    def visit(a: Any) -> None:
        if isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)
        elif isinstance(a, slice):
            visit((a.start, a.stop, a.step))
        elif isinstance(a, int) and not isinstance(a, bool) and abs(a) >= 2:
            found.add(abs(a))
    for n in nodes:
        visit((n.args, n.kwargs))
    return found


def _probe_sizes(symbols: list, hints: list[int], literals: set[int]) -> list[dict] | None:
    """The size bindings a mask of the sizes is evaluated at: the traced sizes, then each symbol
    in turn at 2, 3 and c - 1 .. c + 2 for every literal c (the others at 2); None where a literal
    is past MAX_PROBE."""
    if any(c + 2 > MAX_PROBE for c in literals):
        return None
    values = sorted({2, 3} | {v for c in literals for v in (c - 1, c, c + 1, c + 2) if v >= 2})
    bindings = [dict(zip(symbols, hints))]
    for s in symbols:
        bindings += [{**dict.fromkeys(symbols, 2), s: v} for v in values]
    return bindings


def _value_at(size: Any, binding: dict) -> int | None:
    """A (symbolic) size of q or k at ``binding``; None where it has other symbols."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if not expr.free_symbols <= set(binding):
        return None
    return int(expr.xreplace(binding))


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
    """'none', 'causal' or None for the mask ``node`` (an SDPA call) reads: one kind at every size
    it is evaluated at; ``memo`` holds each mask's kinds, evaluated once per size and (L, S)
    however many layers share it (the kinds, not the values: a probe's mask may be 8194^2)."""
    q, k = (a.meta.get("example_value") if isinstance(a, fx.Node) else None for a in node.args[:2])
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return None
    if mask not in memo:
        nodes = _constant_ancestors(mask)
        memo[mask] = (nodes, {})
    nodes, kinds_at = memo[mask]
    if nodes is None:
        return None
    sizes = [n for n in nodes if n.op == "placeholder"]
    symbols = [n.meta["example_value"].node.expr for n in sizes]
    hints = [n.meta["example_value"].node.hint for n in sizes]
    if any(h is None for h in hints):  # (a size with no traced value: nothing to probe from)
        return None
    bindings = [{}] if not sizes else _probe_sizes(symbols, hints, _literals(nodes))
    if bindings is None:
        return None
    kinds = set()
    for binding in bindings:
        length, source = _value_at(q.shape[-2], binding), _value_at(k.shape[-2], binding)
        if length is None or source is None:
            return None
        key = (tuple(binding[s] for s in symbols), length, source)
        if key not in kinds_at:
            try:
                value = _evaluate(gm, nodes, key[0])
            except Exception as e:  # a mask we cannot evaluate is kept: the trace handles it as before
                log.debug("attention mask %s not evaluated at %s: %s", mask.name, key[0], e)
                value = None
            kinds_at[key] = classify_mask(value, length, source) if isinstance(value, torch.Tensor) else None
        kinds.add(kinds_at[key])
        if len(kinds) > 1 or None in kinds:
            return None
    return kinds.pop()


def fold_constant_masks(gm: fx.GraphModule) -> int:
    """Drop every constant attention mask that changes nothing, or turn it into ``is_causal``;
    return how many SDPA calls were rewritten. ``gm`` is Dynamo's graph (torch-level calls)."""
    memo: dict[fx.Node, tuple[list[fx.Node] | None, dict]] = {}  # mask -> (its nodes, kind per sizes)
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
    computed = {n for nodes, _ in memo.values() for n in nodes or []}
    for n in sorted(computed, key=order.__getitem__, reverse=True):  # what nothing reads any more
        if not n.users and n.op != "placeholder":  # (a size input stays: Dynamo passes it)
            gm.graph.erase_node(n)
    gm.recompile()
    log.info("attention: %d constant mask(s) folded (%d as is_causal)", folded, causal)
    return folded
