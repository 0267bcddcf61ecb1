"""One program for a bucket of sizes, from the same compiled code recorded at several of them.

Inductor compiled with a dynamic size (fill_cache/whole_buckets.py) emits one output code for a
range of sizes: its kernels take the sizes as arguments, and its wrapper computes grids, buffer
sizes and views from them. Recorded at several sizes (fill_cache/inductor_program.py), it gives
programs of one structure (the same kernels, configs, steps and buffers) that differ only in
integers. ``fit_program`` writes each such integer as a SizeExpr of the size (core/buckets.py): a
polynomial of degree at most two with integer coefficients (a buffer of ``8*s*s`` elements, a
view's stride ``64*s``, an offset ``64*s + 32``), or the ceiling division of a polynomial the same
launch passes by a block size (a grid ``cdiv(128*s, XBLOCK)``). Every expression is checked at
every recorded size, and a polynomial is only taken where more sizes confirm it than define it
(or where the recordings cover every size of the bucket); anything else refuses the bucket with
the reason. Validation at the bucket's edges and inside (buckets.BucketMeasurer) is the judge of
the result, as for any bucket's kernel.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, Sequence

from torch_kernelize.core.buckets import SizeExpr, evaluate, product
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.lowering.kernels.recording import RecordingError

VAR = "v0"
MAX_DEGREE = 2
# the parts of a launch that select its binary: equal at every size, or the code is another one
_BINARY = ("kernel", "constexprs", "num_warps", "num_stages", "phases", "shared")
_MAX_BLOCK = 1 << 16


def fit_program(recorded: dict[int, KernelProgram], every_size: bool = False) -> KernelProgram:
    """The program at the largest recorded size, with ``sized`` naming each integer that varies
    as a SizeExpr of the size; RecordingError where the recordings differ otherwise or an integer
    fits no expression. ``every_size``: the recordings cover every size of the bucket."""
    sizes = sorted(recorded)
    if len(sizes) < 2:
        raise RecordingError("a bucket's program is fitted from recordings at two sizes or more")
    trees = [recorded[s].to_json() for s in sizes]
    varying: dict[tuple, list[int]] = {}
    _compare(trees, (), varying)
    polys: dict[tuple, list[int]] = {}   # path -> polynomial coefficients (constant term first)
    for path, values in varying.items():
        coefficients = _polynomial(sizes, values, every_size)
        if coefficients is not None:
            polys[path] = coefficients
    sized = []
    for path, values in varying.items():
        if path in polys:
            sized.append((path, _poly_expr(polys[path])))
            continue
        expr = _ceil_division(path, sizes, values, polys, trees[-1])
        if expr is None:
            raise RecordingError(f"{_where(path)} takes the values {values} at sizes {sizes}: no polynomial of the "
                                 "size, nor a block count of one, gives them")
        sized.append((path, expr))
    return _placed(recorded[sizes[-1]], sized)


def _placed(program: KernelProgram, sized: list[tuple[tuple, SizeExpr]]) -> KernelProgram:
    """``program`` with each launch's grid and scalar arguments that vary in its runtime_sizes
    (as any bucket's: they are compiled without divisibility assumptions) and the rest in ``sized``."""
    runtime: dict[int, dict[str, Any]] = {}
    rest = []
    for path, expr in sized:
        if path[0] == "launches" and path[2] == "grid":
            launch = program.launches[path[1]]
            grid = runtime.setdefault(path[1], {}).setdefault("grid", list(launch.grid))
            grid[path[3]] = expr
        elif path[0] == "launches" and path[2] == "args" and path[4] == 1:
            runtime.setdefault(path[1], {}).setdefault("args", {})[str(path[3])] = expr
        else:
            rest.append((path, expr))
    launches = tuple(dataclasses.replace(l, runtime_sizes=runtime[i]) if i in runtime else l
                     for i, l in enumerate(program.launches))
    return dataclasses.replace(program, launches=launches, sized=tuple(rest))


def _compare(trees: list[Any], path: tuple, varying: dict[tuple, list[int]]) -> None:
    """Walk the programs' JSON forms together; the paths of integers that differ go to ``varying``."""
    first = trees[0]
    if isinstance(first, dict):
        if any(not isinstance(t, dict) or t.keys() != first.keys() for t in trees):
            raise RecordingError(f"{_where(path)} differs in its fields between sizes")
        for k in first:
            _compare([t[k] for t in trees], path + (k,), varying)
    elif isinstance(first, list):
        if any(not isinstance(t, list) or len(t) != len(first) for t in trees):
            raise RecordingError(f"{_where(path)} has another length at another size: the compiled code "
                                 "takes other steps there")
        for i in range(len(first)):
            _compare([t[i] for t in trees], path + (i,), varying)
    elif all(t == first and type(t) is type(first) for t in trees):
        return
    elif all(type(t) is int for t in trees) and not any(p in _BINARY for p in path if isinstance(p, str)):
        varying[path] = list(trees)
    else:
        raise RecordingError(f"{_where(path)} is {trees[0]!r} at one size and {trees[-1]!r} at another: "
                             "another kernel or config, not another size")


def _polynomial(sizes: Sequence[int], values: Sequence[int], every_size: bool) -> list[int] | None:
    """Integer coefficients (constant first) of the lowest-degree polynomial through every
    (size, value), confirmed by at least one point beyond those that define it (unless the
    sizes are all the bucket has); None where there is none of degree <= MAX_DEGREE."""
    for degree in range(MAX_DEGREE + 1):
        if len(sizes) < degree + 1 or (len(sizes) == degree + 1 and not every_size and degree > 0):
            return None
        coefficients = _interpolate(sizes[:degree + 1], values[:degree + 1])
        if coefficients is None:
            continue
        if all(_at(coefficients, s) == v for s, v in zip(sizes, values)):
            return coefficients
    return None


def _interpolate(xs: Sequence[int], ys: Sequence[int]) -> list[int] | None:
    """The polynomial through the points (Lagrange, exactly), if its coefficients are integers."""
    coefficients = [Fraction(0)] * len(xs)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        basis, denominator = [Fraction(1)], Fraction(1)
        for j, xj in enumerate(xs):
            if j != i:
                basis = [Fraction(0)] + basis  # times x ...
                for k in range(len(basis) - 1):
                    basis[k] -= xj * basis[k + 1]  # ... minus xj
                denominator *= xi - xj
        for k, b in enumerate(basis):
            coefficients[k] += yi * b / denominator
    if any(c.denominator != 1 for c in coefficients):
        return None
    return [int(c) for c in coefficients]


def _at(coefficients: Sequence[int], x: int) -> int:
    return sum(c * x ** k for k, c in enumerate(coefficients))


def _poly_expr(coefficients: Sequence[int]) -> SizeExpr:
    terms = [product([c] + [VAR] * k) for k, c in enumerate(coefficients) if c]
    if not terms:
        return 0
    return terms[0] if len(terms) == 1 else ["add", *reversed(terms)]


def _ceil_division(path: tuple, sizes: Sequence[int], values: Sequence[int], polys: dict[tuple, list[int]],
                   program: dict[str, Any]) -> SizeExpr | None:
    """``cdiv(P, block)`` for a polynomial P that the same launch passes (its element count) and
    a block size of its config (or a power of two), where that gives ``values`` at every size."""
    if path[:1] != ("launches",) or len(path) < 2:
        return None
    launch = path[:2]
    numerators = [p for q, p in polys.items() if q[:2] == launch]
    config = sorted({v for v in program["launches"][path[1]]["constexprs"].values()
                     if type(v) is int and 1 < v <= _MAX_BLOCK})
    blocks = config + [1 << k for k in range(1, 17) if 1 << k not in config]  # its config's first
    for block in blocks:
        for numerator in numerators:
            expr = ["cdiv", _poly_expr(numerator), block]
            if all(evaluate(expr, [s]) == v for s, v in zip(sizes, values)):
                return expr
    return None


def _where(path: tuple) -> str:
    return "the program" if not path else "program field " + ".".join(map(str, path))
