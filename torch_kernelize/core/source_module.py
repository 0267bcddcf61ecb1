"""Load a Python file as a module from its source text, never from bytecode.

importlib's file loader prefers the ``__pycache__/*.pyc`` beside a source file, and runs one
compiled with an unchecked hash without reading the source at all: whoever could write that
folder (an archive's member, another user of a shared cache) would choose the code that runs,
unseen by every check of the source. So kernels, candidate files, models and reproducers are
read as text, compiled here and executed into a fresh module: Python's bytecode cache is
neither read nor written.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import linecache
import sys
import types
from pathlib import Path


def load_source_module(path: Path | str, name: str) -> types.ModuleType:
    """Execute the source at ``path`` as the module ``name`` (in ``sys.modules`` while and after
    it runs: Triton and dataclasses look functions' modules up there) and return it.

    The text compiled is the text ``inspect.getsource`` sees (Triton's @jit reads its kernels'
    source): it is put in ``linecache`` under ``path``, replacing what an earlier load of that
    path left there. Raises what reading, compiling or running the file raises (the module is
    then removed from ``sys.modules``).
    """
    filename = str(path)
    text = importlib.util.decode_source(Path(path).read_bytes())  # honours a coding cookie
    code = compile(text, filename, "exec", dont_inherit=True)
    # mtime None: linecache.checkcache keeps the entry, so the lines stay the compiled ones
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=filename)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
