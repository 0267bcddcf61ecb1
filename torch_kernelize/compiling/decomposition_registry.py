"""The decorator every decomposition table registers with (decompositions.py and the modules
whose tables it merges: decompositions_scatter.py, ranking_decompositions.py,
decompositions_conv.py, decompositions_sampling.py)."""
from __future__ import annotations

from typing import Any, Callable


def registrar(table: dict[Any, Callable], overrides: set[Any] | None = None) -> Callable:
    """``@register(op, ...[, override=True])``: the function decomposes each op into ``table``;
    ``override``: it is used in place of torch's own decomposition (``overrides``)."""
    def register(*ops: Any, override: bool = False) -> Callable[[Callable], Callable]:
        def deco(fn: Callable) -> Callable:
            for op in ops:
                table[op] = fn
                if override:
                    overrides.add(op)
            return fn
        return deco
    return register
