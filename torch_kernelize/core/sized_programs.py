"""A shape bucket's program at one of its sizes, made fast enough for a serving call.

A bucketed KernelProgram names its size-dependent integers as SizeExprs: launch grids and scalar
arguments in ``Launch.runtime_sizes``, and (a graph bucket's program) buffer sizes and vendor
steps' views in ``KernelProgram.sized``. The first call at a new size of a filled bucket needs the
program at that size, and that is the only host work a new size adds, so it must stay well under
the millisecond that issue 41 allows over a repeat call.

``Resizer(program)`` does the per-program work once: every SizeExpr becomes an expression of a
single generated function of the sizes (built from ints, ``v[i]``, +, * and ``cdiv`` only), which
also builds the JSON of each sized buffer, step or view (only the containers on a sized path are
new; the rest is the template's). ``resizer(values)`` then evaluates that function once and
rebuilds only what changed: unchanged launches, steps and buffers are the base program's own
objects. The base program was validated when it was loaded, and a size changes its integers,
not its structure; so only what a size can break is checked again (grids of at least one block,
views inside their buffers).

``resizer.symbolic()`` evaluates the same function on symbols (``SizeSource``): the program with
each sized integer as source text, from which serving/direct_call.py writes one call for every
size of the bucket.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Sequence

from torch_kernelize.core.program import KernelProgram, View

SIZED_FIELDS = ("temps", "steps", "views")


def size_source(expr: Any) -> str:
    """Python source for a SizeExpr (core/buckets.py) of the variables ``v`` (a tuple): ints,
    ``v[i]``, +, * and a ceiling division by a positive divisor; ValueError for anything else."""
    if isinstance(expr, bool):
        raise ValueError(f"bad size expression {expr!r}")
    if isinstance(expr, int):
        return str(expr)
    if isinstance(expr, str) and expr.startswith("v") and expr[1:].isascii() and expr[1:].isdigit():
        return f"v[{int(expr[1:])}]"
    if isinstance(expr, list) and expr and expr[0] in ("add", "mul") and len(expr) > 1:
        return "(" + f" {'+' if expr[0] == 'add' else '*'} ".join(size_source(e) for e in expr[1:]) + ")"
    if isinstance(expr, list) and len(expr) == 3 and expr[0] == "cdiv":
        return f"cdiv({size_source(expr[1])}, {size_source(expr[2])})"
    raise ValueError(f"bad size expression {expr!r}")


class SizeSource(str):
    """An integer of a bucket's program not known until the call: the Python source computing it
    from the sizes ``v`` (a tuple the generated call reads off its inputs). Arithmetic on it
    writes source, so evaluating a program's sizing function on ``SIZES`` gives every sized
    integer as source (``Resizer.symbolic``)."""

    def _op(self, sign: str, other: Any, swapped: bool = False) -> Any:
        if isinstance(other, int) and not isinstance(other, bool):
            if other == (0 if sign == "+" else 1):
                return self
            if sign == "*" and other == 0:
                return 0
        elif not isinstance(other, SizeSource):
            return NotImplemented
        a, b = (other, self) if swapped else (self, other)
        return SizeSource(f"({a} {sign} {b})")

    def __add__(self, other: Any) -> Any:
        return self._op("+", other)

    def __radd__(self, other: Any) -> Any:
        return self._op("+", other, swapped=True)

    def __mul__(self, other: Any) -> Any:
        return self._op("*", other)

    def __rmul__(self, other: Any) -> Any:
        return self._op("*", other, swapped=True)


class _Sizes:
    """``v`` of a sizing function evaluated for its source: ``v[i]`` is SizeSource("v[i]")."""

    def __getitem__(self, i: int) -> SizeSource:
        return SizeSource(f"v[{int(i)}]")


SIZES = _Sizes()


def cdiv(a: Any, b: Any) -> Any:
    if isinstance(a, SizeSource) or isinstance(b, SizeSource):
        return SizeSource(f"cdiv({a}, {b})")
    if b <= 0:
        raise ValueError(f"a size expression divides by {b}")
    return -(-a // b)


def source_strides(shape: Sequence[Any]) -> tuple[Any, ...]:
    """A contiguous layout's strides of ``shape``, whose sizes may be SizeSources (each at least
    1 inside its bucket)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * (size if isinstance(size, SizeSource) else max(int(size), 1))
    return tuple(reversed(strides))


def _compiled(body: str, consts: list) -> Callable:
    """``lambda v: body``, where ``body`` reads the variables ``v``, ``cdiv`` and constants ``c``
    (the source is built from ints, operators and indices only: nothing from a cache is code)."""
    return eval(f"lambda v: {body}", {"cdiv": cdiv, "c": tuple(consts), "__builtins__": {}})


def _tuple(items: Any) -> str:
    items = list(items)
    return ", ".join(items) + ("," if len(items) == 1 else "")


def _json_source(node: Any, holes: dict[tuple, str], consts: list, used: set, at: tuple = ()) -> str:
    """Source that builds ``node`` (JSON) with each path of ``holes`` set to its source: only the
    containers on a path are built, every other part is the template's own (a constant ``c[i]``)."""
    if at in holes:
        used.add(at)
        return holes[at]
    if not any(h[:len(at)] == at for h in holes) or not isinstance(node, (dict, list, tuple)):
        consts.append(node)
        return f"c[{len(consts) - 1}]"
    if isinstance(node, dict):
        parts = []
        for k, v in node.items():
            consts.append(k)
            parts.append(f"c[{len(consts) - 1}]: {_json_source(v, holes, consts, used, at + (k,))}")
        return "{" + ", ".join(parts) + "}"
    items = [_json_source(v, holes, consts, used, at + (i,)) for i, v in enumerate(node)]
    return f"[{', '.join(items)}]" if isinstance(node, list) else f"({_tuple(items)})"


class Resizer:
    """``program`` at any size of its bucket: ``Resizer(program)(values)``, its sizing function
    generated once (core/buckets.instantiate makes one for a single use)."""

    def __init__(self, program: KernelProgram):
        self.program = program
        exprs: list[Any] = []
        # per launch with sizes: (its index, where its grid starts in the values or None, its
        # grid's length, [(argument position, where its value is)])
        self._launches: list[tuple[int, int | None, int, list[tuple[int, int]]]] = []
        for li, launch in enumerate(program.launches):
            sizes = launch.runtime_sizes
            if not sizes:
                continue
            grid_at, grid = None, sizes.get("grid", ())
            if grid:
                grid_at = len(exprs)
                exprs.extend(grid)
            args = []
            for pos, expr in sizes.get("args", {}).items():
                args.append((int(pos), len(exprs)))
                exprs.append(expr)
            self._launches.append((li, grid_at, len(grid), args))
        holes: dict[tuple[str, int], dict[tuple, str]] = {}  # per sized buffer, step or view: path -> source
        for path, expr in program.sized:
            field, i = path[0], path[1]
            if field not in SIZED_FIELDS:
                raise ValueError(f"a program's sized integer at {list(path)} is not in a buffer, step or view")
            if len(path) < 3:
                raise ValueError(f"a program's sized integer at {list(path)} names no integer inside its item")
            holes.setdefault((field, i), {})[tuple(path[2:])] = size_source(expr)
        self._items = list(holes)
        consts: list = []
        items = []
        for (f, i), h in holes.items():
            used: set = set()
            items.append(_json_source(getattr(program, f)[i].to_json(), h, consts, used))
            if len(used) != len(h):
                missing = [[f, i, *p] for p in h if p not in used]
                raise ValueError(f"a program's sized integers at {missing} are not in the program")
        # one function of the sizes: the launches' integers, and each sized item's JSON at them
        self._sizes = _compiled(f"(({_tuple(size_source(e) for e in exprs)}), ({_tuple(items)}))", consts)

    def __call__(self, values: Sequence[int]) -> KernelProgram:
        return self._build(self._sizes(tuple(values)), values)

    def symbolic(self) -> KernelProgram:
        """The program with each sized integer a SizeSource of ``v``: what a call generated once
        for the whole bucket computes (serving/direct_call.py). Not a program to validate or
        store: its integers are source text."""
        return self._build(self._sizes(SIZES), None)

    def _build(self, sized_values: tuple, values: Sequence[int] | None) -> KernelProgram:
        """The program with the sizing function's results; ``values`` None: they are source."""
        ints, jsons = sized_values
        program = self.program
        launches = list(program.launches)
        for li, grid_at, grid_len, args in self._launches:
            launch = launches[li]
            new = copy.copy(launch)
            if grid_at is not None:
                grid = ints[grid_at:grid_at + grid_len]
                if values is not None and any(g < 1 for g in grid):
                    raise ValueError(f"launch {launch.kernel}: bad grid {grid} at sizes {tuple(values)}")
                object.__setattr__(new, "grid", tuple(grid))
            if args:
                a = list(launch.args)
                for pos, at in args:
                    a[pos] = (a[pos][0], ints[at])
                object.__setattr__(new, "args", tuple(a))
            launches[li] = new
        fields: dict[str, list] = {}
        for (field, i), d in zip(self._items, jsons):
            items = fields.setdefault(field, list(getattr(program, field)))
            items[i] = type(items[i]).from_json(d) if values is not None or field != "views" else View(
                (d[0], int(d[1])), d[2])  # (its offset may be source)
        sized = copy.copy(program)
        for name, value in (("launches", tuple(launches)), ("sized", ()),
                            *((f, tuple(items)) for f, items in fields.items())):
            object.__setattr__(sized, name, value)
        if values is not None:
            _check_views(sized, values)
        return sized


def _check_views(program: KernelProgram, values: Sequence[int]) -> None:
    """What a size can break in a program's views (KernelProgram.__post_init__ checks the rest)."""
    for v in program.views:
        kind, i = v.buffer
        if v.offset <= 0 or (kind == "tmp" and v.offset >= math.prod(program.temps[i].shape)):
            raise ValueError(f"view {v.to_json()} at sizes {tuple(values)}: outside its buffer")
