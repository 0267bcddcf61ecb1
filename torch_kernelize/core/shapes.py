"""Concrete shapes for a symbolic graph: bind the graph's size symbols from the call's inputs,
then evaluate every node's (possibly symbolic) metadata to plain integers.

One ATen graph serves many shapes (dynamic shapes); kernels are keyed on concrete shapes. A
``SymbolBinder`` reads, from a call's arguments, exactly the values that fix every backed size
symbol; that tuple is the specialization key of the call. Values that depend on data (unbacked
symbols, e.g. after nonzero) cannot be fixed this way and evaluate to None.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx

from torch_kernelize.core.spec import TensorMeta, dtype_name


def _expr(v: Any) -> Any:
    return v.node.expr if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) else v


def _hint(v: Any) -> Any:
    """A concrete value for an example argument: ints stay, SymInts give their hint."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return v.node.hint
    return v


class SymbolBinder:
    """Where in a graph's arguments each free size symbol can be read."""

    def __init__(self, gm: fx.GraphModule):
        self.sites: list[tuple[int, str, int, sympy.Symbol]] = []
        seen: set[sympy.Symbol] = set()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, ph in enumerate(placeholders):
            val = ph.meta.get("val")
            candidates: list[tuple[str, int, Any]] = []
            if isinstance(val, torch.Tensor):
                candidates += [("size", d, s) for d, s in enumerate(val.shape)]
                candidates += [("stride", d, s) for d, s in enumerate(val.stride())]
            elif isinstance(val, torch.SymInt):
                candidates.append(("int", 0, val))
            for kind, d, s in candidates:
                e = _expr(s)
                if isinstance(e, sympy.Symbol) and e not in seen:
                    seen.add(e)
                    self.sites.append((i, kind, d, e))
        self.symbols = tuple(site[3] for site in self.sites)
        self.call_key = self._call_key()

    def _call_key(self) -> Callable[[Sequence[Any]], tuple]:
        """``key`` for a call's real arguments (plain ints, no SymInt hints), as one generated
        expression: the hot path of a dynamic graph's dispatch is this and one dict lookup."""
        read = {"size": "args[{i}].size({d})", "stride": "args[{i}].stride({d})", "int": "args[{i}]"}
        items = "".join(read[kind].format(i=i, d=d) + ", " for i, kind, d, _ in self.sites)
        return eval(f"lambda args: ({items})")  # built from ints and fixed names only

    @property
    def is_static(self) -> bool:
        return not self.sites

    def key(self, args: Sequence[Any]) -> tuple:
        """The specialization key of a call: the value of every bound symbol."""
        out = []
        for i, kind, d, _ in self.sites:
            a = args[i]
            out.append(a.shape[d] if kind == "size" else a.stride(d) if kind == "stride" else a)
        return tuple(_hint(v) for v in out)

    def bindings(self, key: tuple) -> dict[sympy.Symbol, sympy.Integer]:
        return {sym: sympy.Integer(int(v)) for sym, v in zip(self.symbols, key) if v is not None}


def sizes_read_off(nodes: Sequence[fx.Node], boundary: Sequence[fx.Node]) -> list[tuple[fx.Node, Any]] | None:
    """Each size read (``sym_size``) off a value of ``nodes`` by a node outside them, with where
    a tensor of ``boundary`` (their inputs and outputs) has that size: ``(reader, (tensor, dim))``;
    None where one has no such tensor. A dynamic graph's stretch fused into one call keeps its
    boundary only (an MoE router's token count read off its view, by a later stretch)."""
    inside, found = set(nodes), []
    for n in nodes:
        for u in n.users:
            if u in inside or u.target is not torch.ops.aten.sym_size.int:
                continue
            want = _expr(n.meta["val"].shape[u.args[1]])
            at = next(((b, d) for b in boundary for d, size in enumerate(getattr(b.meta.get("val"), "shape", ()))
                       if _expr(size) == want), None)
            if at is None:
                return None
            found.append((u, at))
    return found


def dense_order(shape: Sequence[Any], stride: Sequence[Any]) -> list[int] | None:
    """The dims from outermost to innermost if ``stride`` is a dense layout of ``shape`` (a
    permutation of a contiguous tensor); None for overlapping or gapped layouts."""
    sizes, strides = [int(_hint(n)) for n in shape], [int(_hint(s)) for s in stride]
    order = sorted(range(len(sizes)), key=lambda d: (-strides[d], -sizes[d]))
    expect = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expect:
            return None
        expect *= sizes[d]
    return order


def evaluate(v: Any, bindings: dict[sympy.Symbol, int]) -> Any:
    """A concrete int/float/bool for a Python or symbolic scalar; None if it cannot be fixed."""
    e = _expr(v)
    if isinstance(e, (bool, int, float)):
        return e
    if isinstance(e, sympy.Basic):
        r = sympy.sympify(e.xreplace(bindings))
        if r.free_symbols:
            return None
        if r.is_Boolean or r in (sympy.true, sympy.false):
            return bool(r)
        return int(r) if r.is_integer else float(r)
    return v


def concrete_meta(val: Any, bindings: dict[sympy.Symbol, int]) -> TensorMeta | None:
    """The TensorMeta of a (fake) tensor with every size fixed, or None if some size is unbound."""
    shape = [evaluate(s, bindings) for s in val.shape]
    stride = [evaluate(s, bindings) for s in val.stride()]
    if any(x is None for x in shape + stride):
        return None
    return TensorMeta(tuple(shape), tuple(stride), dtype_name(val.dtype), val.device.type)


def meta_of_size(val: Any, bindings: dict[sympy.Symbol, int], symbol: sympy.Symbol) -> Callable[[int], TensorMeta | None]:
    """``concrete_meta(val, {**bindings, symbol: n})`` as a function of ``n``, its sympy work done
    once: each size and stride becomes a polynomial of ``n`` with integer coefficients (a new
    size's first call pays for the arithmetic alone). Where one is no such polynomial (a floor
    division, another unbound symbol), every size takes the general evaluation."""
    polys = [_int_polynomial(_expr(e), bindings, symbol) for e in (*val.shape, *val.stride())]
    if any(p is None for p in polys):
        def general(n: int) -> TensorMeta | None:
            return concrete_meta(val, {**bindings, symbol: int(n)})
        general.polynomial = False
        return general
    rank, dtype, device = len(val.shape), dtype_name(val.dtype), val.device.type

    def at(n: Any) -> TensorMeta:
        """(``n`` may also be a sized_programs.SizeSource: the sizes come back as source)"""
        xs = [_horner(p, n) for p in polys]
        return TensorMeta(tuple(xs[:rank]), tuple(xs[rank:]), dtype, device)
    at.polynomial = True
    return at


def _int_polynomial(e: Any, bindings: dict[sympy.Symbol, int], symbol: sympy.Symbol) -> tuple[int, ...] | None:
    """The integer coefficients of ``e`` as a polynomial of ``symbol`` (highest power first),
    the other symbols at ``bindings``; None where it is no such polynomial."""
    if isinstance(e, int) and not isinstance(e, bool):
        return (e,)
    if not isinstance(e, sympy.Basic):
        return None
    r = e.xreplace({k: v for k, v in bindings.items() if k != symbol})
    if r.free_symbols - {symbol}:
        return None
    try:
        poly = sympy.Poly(r, symbol)
    except sympy.PolynomialError:
        return None
    coeffs = poly.all_coeffs()
    return tuple(int(c) for c in coeffs) if all(c.is_Integer for c in coeffs) else None


def _horner(coeffs: tuple[int, ...], n: Any) -> Any:
    out = 0
    for c in coeffs:
        out = out * n + c
    return out


def concrete_value(val: Any, bindings: dict[sympy.Symbol, int]) -> Any:
    """TensorMeta for tensors, numbers for scalars, tuples element-wise; None if unresolvable."""
    if isinstance(val, torch.Tensor):
        return concrete_meta(val, bindings)
    if isinstance(val, (tuple, list)):
        items = [concrete_value(v, bindings) for v in val]
        return None if any(i is None and v is not None for i, v in zip(items, val)) else type(val)(items)
    return evaluate(val, bindings)
