"""Triton 3.6's interpreter on numpy >= 2.4 (the GPU machine has 2.5).

While it runs a kernel, the interpreter gives ``tl.tensor`` an ``__index__`` that converts the
scalar's 1-element array with ``int()``, which numpy 2.4 refuses ("only 0-dimensional arrays can
be converted to Python scalars"): a Python ``range`` over a tensor bound fails, the tile loop of
every persistent kernel (grouped_mm's TMA variant). triton-lang/triton#9171, fixed upstream after
3.6 by squeezing the array first; ``fix_scalar_index`` applies that fix on top of Triton's own
patching, restored with it. pyproject keeps numpy below 2.4 for the suite all the same.
"""
from __future__ import annotations

import functools


@functools.cache
def fix_scalar_index() -> None:
    """Make the interpreter's scalar ``__index__`` squeeze its array first (once per process)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:  # another Triton: nothing known to fix
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        # after Triton's own: the scope restores both, last first
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
