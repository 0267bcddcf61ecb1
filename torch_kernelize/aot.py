"""Ahead-of-time artifacts: a kernelize-compiled function saved once, loaded in a fresh process
without Dynamo's tracing.

    torch_kernelize.aot.save(model.forward, (x,), "model.kz", options={"cache_dir": "kc"})
    run = torch_kernelize.aot.load("model.kz", model)     # a later process
    y = run(x)

A fresh process's first call of ``torch.compile(model, backend="kernelize")`` spends most of its
time in Dynamo tracing the Python code (H200 host, 4-layer Llama: ~1 s of ~1.6 s). Torch's
``aot_compile`` (experimental; torch >= 2.10) saves Dynamo's result -- the graph's guards and
bytecode -- once a backend's compiled callable can serialize itself. Here that callable keeps the
Dynamo FX graph, the options and the example inputs' layout; loading lowers that graph again,
and kernelize's graph cache then supplies the ATen graph (no aot_autograd), its executable cache
the bound executable (no lowering) and the kernel cache the kernels. Dynamo does not run.

What torch's format imposes: the whole function must be one graph (``fullgraph``); the artifact
loads only under the same Python and torch versions; its guards (input shapes, strides, dtypes,
grad mode, the number of CPU threads) are checked on every call and a mismatch raises, with no
recompilation (save again for other shapes). A module's parameters stay inputs of the graph:
``load`` binds the loaded function to the module given.
"""
from __future__ import annotations

import functools
import pickle
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from torch_kernelize.core.errors import KernelizeError

try:  # torch 2.10+ (2.13 re-exports it from aot_compile_types)
    from torch._dynamo.aot_compile import SerializableCallable
except ImportError:  # pragma: no cover - older torch has no aot_compile
    SerializableCallable = None

FORMAT = 1
# functorch flags that aot_compile turns on around the backend for Inductor's own serialization:
# with them, aot_autograd insists on Inductor's OutputCode ("expected OutputCode, got function");
# kernelize serializes itself, so its aot_autograd runs with them as in a plain torch.compile
_AOT_COMPILE_FLAGS = ("strict_autograd_cache", "bypass_autograd_cache_key", "bundled_autograd_cache",
                      "force_non_lazy_backward_lowering", "force_autograd_cache")


def _functorch_defaults() -> dict[str, Any]:
    config = torch._functorch.config
    return {k: config._config[k].default for k in _AOT_COMPILE_FLAGS if k in config._config}


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), t.requires_grad


def _compile(gm: torch.fx.GraphModule, inputs: Sequence[Any], options: Mapping[str, Any] | None,
             mode: str | None) -> Callable:
    from torch_kernelize.backend import kernelize
    with torch._functorch.config.patch(_functorch_defaults()):
        return kernelize(gm, inputs, mode=mode, options=options)


if SerializableCallable is not None:
    class CompiledGraph(SerializableCallable):
        """kernelize's compiled callable for one Dynamo graph, in a form torch's aot_compile saves:
        the Dynamo graph (GraphPickler), options, mode, grad mode and the inputs' layouts."""

        def __init__(self, gm: torch.fx.GraphModule, layouts: list[tuple], options: Mapping[str, Any] | None,
                     mode: str | None, grad: bool, run: Callable):
            self.gm, self.layouts, self.options, self.mode, self.grad = gm, layouts, options, mode, grad
            self.run = run

        def __call__(self, *args: Any) -> Any:
            return self.run(*args)

        @classmethod
        def serialize_compile_artifacts(cls, fn: "CompiledGraph") -> bytes:
            from torch.fx._graph_pickler import GraphPickler, Options as PickleOptions
            gm, nodes = fn.gm, list(fn.gm.graph.nodes)
            # Only the placeholders' fake values survive, which the graph cache's key reads:
            # Dynamo's other metadata holds frames and weak references (so do fake views'
            # values), and nothing downstream needs it (aot_autograd traces the inputs again).
            saved = [n.meta for n in nodes], gm.meta
            try:
                for n in nodes:
                    val = n.meta.get("val", n.meta.get("example_value")) if n.op == "placeholder" else None
                    n.meta = {"val": val} if val is not None else {}
                gm.meta = {}
                graph = GraphPickler.dumps(gm, PickleOptions(ops_filter=None))
            finally:
                for n, meta in zip(nodes, saved[0]):
                    n.meta = meta
                gm.meta = saved[1]
            return pickle.dumps({"format": FORMAT, "graph": graph, "layouts": fn.layouts,
                                 "options": dict(fn.options or {}), "mode": fn.mode, "grad": fn.grad})

        @classmethod
        def deserialize_compile_artifacts(cls, data: bytes) -> "CompiledGraph":
            from torch._subclasses import FakeTensorMode
            from torch.fx._graph_pickler import GraphPickler
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            state = pickle.loads(data)
            if state.get("format") != FORMAT:
                raise KernelizeError(f"kernelize artifact format {state.get('format')!r}, expected {FORMAT}: "
                                     "save it again with this version")
            gm = GraphPickler.loads(state["graph"], FakeTensorMode(shape_env=ShapeEnv()))
            gm.recompile()
            # A Dynamo attribute without the placeholders' sources (not pickled): aot_autograd
            # (on a graph-cache miss) would ask each placeholder for its source.
            gm.__dict__.pop("_param_name_to_source", None)
            inputs = [torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad)
                      for shape, stride, dtype, device, grad in state["layouts"]]
            with torch.set_grad_enabled(state["grad"]):
                run = _compile(gm, inputs, state["options"], state["mode"])
            return cls(gm, state["layouts"], state["options"], state["mode"], state["grad"], run)
else:  # pragma: no cover
    CompiledGraph = None


def _backend(options: Mapping[str, Any] | None, mode: str | None) -> Callable:
    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
        for t in example_inputs:
            if not isinstance(t, torch.Tensor):
                raise KernelizeError(f"kernelize artifacts take tensor inputs only, got {type(t).__name__} "
                                     "(a dynamic size?): save with static shapes")
        run = _compile(gm, example_inputs, options, mode)
        return CompiledGraph(gm, [_layout(t) for t in example_inputs], options, mode, torch.is_grad_enabled(), run)
    return backend


def _require_aot() -> None:
    if CompiledGraph is None or not hasattr(torch.compiler, "load_compiled_function"):
        raise KernelizeError(f"torch {torch.__version__} has no aot_compile (torch >= 2.10 does): "
                             "use torch.compile(model, backend='kernelize') instead")


def save(fn: Callable, args: Sequence[Any], path: str | Path, *, kwargs: Mapping[str, Any] | None = None,
         options: Mapping[str, Any] | None = None, mode: str | None = None) -> Path:
    """Trace ``fn`` (a function, or a module's ``forward``) on ``args`` with Dynamo, lower it with
    kernelize (``options``/``mode`` as for torch.compile) and write the artifact to ``path``.

    Call it in the grad mode the artifact will run in (e.g. under ``torch.no_grad()``): the grad
    mode is one of its guards. The kernel and graph caches named by ``options`` must be there
    when it is loaded (they are where the kernels and the ATen graph come from)."""
    _require_aot()
    if isinstance(fn, torch.nn.Module):
        raise KernelizeError("save a module's forward (model.forward), then load(path, model)")
    path = Path(path)
    with torch._dynamo.config.patch(enable_aot_compile=True):
        try:
            compiled = torch.compile(fn, fullgraph=True, backend=_backend(options, mode)).aot_compile(
                (tuple(args), dict(kwargs or {})))
        except torch._dynamo.exc.Unsupported as e:
            raise KernelizeError(f"an artifact must be one graph, and Dynamo broke this function's graph: {e}. "
                                 "Use torch.compile(model, backend='kernelize') for it") from e
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    try:
        compiled.save_compiled_function(str(tmp))
    except RuntimeError as e:
        tmp.unlink(missing_ok=True)
        if "Failed to serialize" not in str(e):
            raise
        raise KernelizeError(f"the traced code refers to objects an artifact cannot hold (torch's format keeps "
                             f"code, guards and graphs): {str(e).splitlines()[0]} -- e.g. a module the "
                             "function iterates over (nn.Sequential); save a function whose modules are "
                             "only reached through its arguments") from e
    tmp.replace(path)  # a reader never sees half an artifact
    return path


def load(path: str | Path, module: torch.nn.Module | None = None) -> Callable:
    """The function saved at ``path``, lowered again from its graph (no Dynamo tracing); bound to
    ``module`` when it was a module's forward (its parameters are the graph's inputs)."""
    _require_aot()
    path = Path(path)
    if not path.is_file():
        raise KernelizeError(f"no kernelize artifact at {path}: write one with torch_kernelize.aot.save")
    with open(path, "rb") as f:
        fn = torch.compiler.load_compiled_function(f)
    return Loaded(fn, module, path)


class Loaded:
    """A loaded artifact: calls the saved function (bound to its module); says so when its
    guards refuse the inputs, instead of torch's bare guard failure."""

    def __init__(self, fn: Callable, module: torch.nn.Module | None, path: Path):
        self._call = functools.partial(fn, module) if module is not None else fn
        self.path = path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._call(*args, **kwargs)
        except RuntimeError as e:
            if not str(e).startswith("GuardManager check failed"):
                raise
            failed = re.search(r"verbose_code_parts=\[(.*)\],\s*num_guards", str(e), re.S)
            why = failed.group(1).strip() if failed else " ".join(str(e).split())
            raise KernelizeError(f"the kernelize artifact {self.path} was saved for other inputs or another "
                                 f"state ({why}); it does not recompile: save it again for these inputs") from e
