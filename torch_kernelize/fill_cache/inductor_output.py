"""Reading Inductor's output code: its autotuners, their launches, its allocators, and the
source of its Triton kernels as a plain module. Shared by the Triton-only recorder (inductor.py)
and the whole-output recorder (inductor_program.py)."""
from __future__ import annotations

import ast
import contextlib
import inspect
import types
from typing import Any, Callable
from unittest import mock

import torch

from torch_kernelize.lowering.kernels.recording import RecordingError

# Allocators Inductor's output code binds from C++ (no dispatch: the recorder would not see them)
_ALLOCATORS = ("empty_strided_cpu", "empty_strided_cuda")


def kernels_namespace(kernels: dict[str, Any]) -> types.ModuleType:
    """A module holding each autotuner's ``@triton.jit`` function under its name in the output code."""
    namespace = types.ModuleType("inductor_kernels")
    for name, autotuner in kernels.items():
        setattr(namespace, name, autotuner.fn)
    return namespace


def dispatching_helpers(module: types.ModuleType) -> dict[str, Callable]:
    """Replacements for the output code's C++-bound allocators and ``reinterpret_tensor``, which
    go through the dispatcher (so a recorder sees the buffers and views they make)."""
    patched = {name: _allocator(getattr(module, name), "cuda" if "cuda" in name else "cpu")
               for name in _ALLOCATORS if hasattr(module, name)}
    if hasattr(module, "reinterpret_tensor"):
        patched["reinterpret_tensor"] = lambda t, size, stride, offset=0: t.as_strided(
            size, stride, t.storage_offset() + offset)
    return patched


def _autotuners(module: types.ModuleType) -> dict[str, Any]:
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    return {name: v for name, v in vars(module).items() if isinstance(v, CachingAutotuner)}


def _allocator(original: Callable, device: str) -> Callable:
    def empty_strided(size, stride, dtype, *args, **kwargs):
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    empty_strided.__wrapped__ = original
    return empty_strided


def _autotuner_launches(record: Callable[[Any, tuple, dict, Any], None],
                        config_of: Callable[[Any], Any] | None = None) -> contextlib.AbstractContextManager:
    """Routes ``CachingAutotuner.run`` to ``record``: the autotuner's JIT function, the runtime
    arguments, the chosen config's constexprs, warps and stages, and the grid it gives. The
    config is ``config_of(autotuner)`` where that is not None (inductor_retune.py), else the one
    Inductor chose (before any choice: its heuristic's first)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    def run(self, *args, stream=None, **kwargs):
        if getattr(self.fn, "fn", None) is None:
            raise RecordingError(f"kernel {getattr(self.fn, '__name__', '?')} came without its Python function "
                                 "(loaded from a cache or a compile subprocess)")
        cfg = (config_of and config_of(self)) or (self.launchers[0].config if len(self.launchers) == 1
                                                  else self.configs[0])
        try:
            call_args, grid = self._interpret_args_grid(args, cfg)
        except AttributeError as e:
            raise RecordingError(f"this torch's CachingAutotuner computes grids differently ({e})") from None
        params = list(inspect.signature(self.fn.fn).parameters)
        unbound = set(params[len(call_args):])  # a constant Inductor specialized may be passed positionally too
        constants = {k: v for k, v in (self.triton_meta.get("constants") or {}).items() if k in unbound}
        launch_kwargs = {**constants, **kwargs, **cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        record(self.fn, tuple(call_args), launch_kwargs, tuple(int(g) for g in grid))

    stack = contextlib.ExitStack()
    for cls in [CachingAutotuner, *_subclasses(CachingAutotuner)]:
        if "run" in vars(cls):
            stack.enter_context(mock.patch.object(cls, "run", run))
    return stack


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def program_source(output_code: str, kernels: dict[str, Any]) -> str:
    """A module of the kernels Inductor's output code defines: the imports their sources make
    (less ``triton_heuristics``, whose decorators are dropped) and each ``@triton.jit`` kernel."""
    sources: dict[str, str] = {}
    for node in ast.walk(ast.parse(output_code)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "triton"
                and len(node.args) >= 2 and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                                for a in node.args[:2])):
            sources[node.args[0].value] = node.args[1].value
    missing = sorted(set(kernels) - set(sources))
    if missing:
        raise RecordingError(f"the source of kernel(s) {missing} is not in Inductor's output code")
    imports: list[str] = []
    bodies: list[str] = []
    for name in kernels:
        tree = ast.parse(sources[name])
        for stmt in tree.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                kept = [a for a in stmt.names if a.name != "triton_heuristics"]
                if kept:
                    stmt.names = kept
                    line = ast.unparse(stmt)
                    if line not in imports:
                        imports.append(line)
            elif isinstance(stmt, ast.FunctionDef):
                lines = sources[name].splitlines()
                body = "\n".join(lines[stmt.lineno - 1:stmt.end_lineno])
                bodies.append(f"@triton.jit\n{body}\n")
    header = "# Triton kernels generated by torch Inductor " + torch.__version__ + " (captured by fill_cache)\n"
    return header + "\n".join(imports) + "\n\n\n" + "\n\n".join(bodies)
