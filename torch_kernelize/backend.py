"""The ``kernelize`` torch.compile backend (entry point group ``torch_dynamo_backends``).

    torch.compile(model, backend="kernelize", options={"target": "interpreter"})

Dynamo's FX graph has its constant attention masks folded (compiling/attention_masks.py: what
eager skips is skipped here too), then goes through aot_autograd (functional ATen, torch's core decompositions except
the fused ops vendors run whole, see compiling/decompositions.KEEP_WHOLE_AT_TRACE;
inference, forward and backward graphs), and each ATen graph is lowered by ``lower.LoweredGraph``.
Inference graphs are kept in the graph cache (graph_cache.py): a later process loads the ATen
graph instead of running aot_autograd again; and their bound executables in the executable cache
(executable_cache.py): a later process whose kernel cache is unchanged skips lowering too.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from torch_kernelize.warm_start import prewarm
from torch_kernelize.core.errors import KernelizeError, LoweringError
from torch_kernelize.core.options import Options

if TYPE_CHECKING:
    from torch_kernelize.core.targets import Target

log = logging.getLogger("torch_kernelize.repro")

prewarm.install()  # imported when torch.compile looks the backend up: before Dynamo's first trace


def _import_serving_path() -> None:
    """Import what a first call runs -- lowering, the graph and executable caches, the launcher
    of stored binaries -- when torch.compile looks the backend up, as Inductor's torch.compile()
    imports Inductor: ~50 ms that would otherwise land inside the first call (H200 host)."""
    import torch

    from torch_kernelize.warm_start import executable_cache, graph_cache  # noqa: F401

    from torch_kernelize.compiling import lower  # noqa: F401
    if torch.backends.cuda.is_built():  # a build flag: no CUDA driver call, so fork-safe
        from torch_kernelize.serving import triton_binaries
        triton_binaries.import_launcher()


_import_serving_path()


def kernelize(gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
              options: Mapping[str, Any] | None = None):
    """Backend entry: Dynamo calls it with its FX graph and example inputs."""
    from torch_kernelize.compiling.lower import Session

    return compile_with_session(gm, example_inputs, Session(Options.resolve(options, mode)), use_graph_cache=True)


def _executable(aten_gm: fx.GraphModule, aten_inputs: Sequence[Any], session: Any, kind: str,
                on_lowered: Callable[[Any], None] | None) -> Callable[[list], Any]:
    """Lower one ATen graph and return its boxed executable (one list of arguments)."""
    from torch_kernelize.compiling.lower import LoweredGraph

    try:
        lowered = LoweredGraph(aten_gm, aten_inputs, session, kind)
    except KernelizeError:
        raise
    except Exception as e:  # a bug in lowering: leave a minified repro, then say where
        folder = dump_lowering_failure(aten_gm, aten_inputs, e, session.target_for(aten_inputs), session.options)
        raise LoweringError(f"kernelize could not lower a {kind} graph: {type(e).__name__}: {e}"
                            + (f"\nminified repro: {folder}" if folder else "")) from e
    if on_lowered is not None:
        on_lowered(lowered)
    return _boxed(lowered, aten_inputs, session, kind)


def _boxed(lowered: Any, aten_inputs: Sequence[Any], session: Any, kind: str) -> Callable[[list], Any]:
    """A LoweredGraph as aot_autograd's boxed executable, under CUDA graphs if asked."""
    run = lowered
    if session.options.cudagraphs:
        from torch_kernelize.serving.cudagraphs import wrap_cudagraphs
        run = wrap_cudagraphs(lowered, aten_inputs, kind)

    def boxed(args: list) -> Any:
        return run(args)
    # aot_autograd passes one list of arguments to functions marked this way; a plain
    # function keeps the mark through the wrappers aot_autograd puts around it.
    boxed._boxed_call = True
    boxed.lowered = lowered
    return boxed


def compile_with_session(gm: fx.GraphModule, example_inputs: Sequence[Any], session: Any,
                         on_lowered: Callable[[Any], None] | None = None, use_graph_cache: bool = False):
    """aot_autograd around kernelize's lowering; ``on_lowered`` sees each LoweredGraph (fill_cache).
    With ``use_graph_cache`` (and the option on), a cached ATen graph replaces aot_autograd."""
    session.target_for(example_inputs)  # resolve (and validate) the target before tracing
    from torch_kernelize.compiling.attention_masks import fold_constant_masks
    fold_constant_masks(gm)  # the mask eager would skip, skipped here too (before any key is taken)
    cache = probe = executables = exe_key = None
    if use_graph_cache and session.options.graph_cache_dir is not None:
        from torch_kernelize.warm_start import graph_cache
        cache = graph_cache.GraphCache(session.options.graph_cache_dir)
        from torch_kernelize.compiling.decompositions import trace_rewrites
        probe = graph_cache.probe(gm, example_inputs, trace_rewrites(session.target_for(example_inputs),
                                                                     _varying_inference(example_inputs)))
        if probe.key is not None:
            if session.options.executable_cache and on_lowered is None:
                from torch_kernelize.warm_start.executable_cache import ExecutableCache, key_for
                executables, exe_key = ExecutableCache(cache.root), key_for(probe.key, session)
                restored = executables.load(exe_key, session, example_inputs)
                if restored is not None:
                    run = _boxed(restored.lowered, example_inputs, session, "inference")
                    return graph_cache.cached_runtime(run, restored.version_bumps, restored.returned_inputs)
            hit = cache.load(probe, example_inputs)
            if hit is not None:
                run = _executable(hit.gm, example_inputs, session, "inference", on_lowered)
                if executables is not None:
                    executables.save(exe_key, run.lowered, hit.version_bumps, hit.returned_inputs)
                return graph_cache.cached_runtime(run, hit.version_bumps, hit.returned_inputs)

    from torch._dynamo.backends.common import aot_autograd

    from torch_kernelize.compiling.decompositions import trace_decompositions

    def compiler(kind: str):
        def compile_graph(aten_gm: fx.GraphModule, aten_inputs: Sequence[Any]):
            run = _executable(aten_gm, aten_inputs, session, kind, on_lowered)
            if kind == "inference" and probe is not None and probe.key is not None:
                work = cache.save(probe, aten_gm, len(example_inputs))
                if work is not None and executables is not None:
                    executables.save(exe_key, run.lowered, work["version_bumps"], work["returned_inputs"])
            return run
        return compile_graph

    backend = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=trace_decompositions(session.target_for(example_inputs), _varying_inference(example_inputs)),
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)


def _varying_inference(example_inputs: Sequence[Any]) -> bool:
    """Whether Dynamo traced these inputs with symbolic sizes and no gradient will be asked of
    the graph (aot_autograd's inference graph): a graph served at many sizes."""
    symbolic = any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
        isinstance(s, torch.SymInt) for s in x.shape)) for x in example_inputs)
    needs_grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                                 for x in example_inputs)
    return symbolic and not needs_grad


def dump_lowering_failure(gm: fx.GraphModule, example_inputs: Sequence[Any], error: BaseException,
                          target: Target, options: Options) -> Path | None:
    """A graph kernelize could not lower: minify it (pinned to this error) and dump it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if options.repro_dir is None:
        return None
    try:
        with unset_fake_temporarily():  # we are inside aot_autograd's fake mode: real tensors here
            return _dump_lowering_failure(gm, example_inputs, error, target, options)
    except Exception:
        log.exception("could not dump the graph that failed to lower")
        return None


def _dump_lowering_failure(gm: fx.GraphModule, example_inputs: Sequence[Any], error: BaseException,
                           target: Target, options: Options) -> Path:
    import hashlib

    from torch_kernelize.compiling.lower import lowering_error_predicate
    from torch_kernelize.compiling.minify import minify, real_inputs_like
    from torch_kernelize.serving.repro_writer import write_repro

    inputs = real_inputs_like(example_inputs)
    result = minify(gm, inputs, lowering_error_predicate(error, target, options))
    small, small_inputs = result if result is not None else (gm, inputs)
    digest = hashlib.sha256(small.code.encode()).hexdigest()[:10]
    folder = Path(options.repro_dir) / f"lowering-{type(error).__name__}-{digest}"
    write_repro(folder, None, small_inputs, target, "lowering", options.cache_dir,
                {"cause": f"{type(error).__name__}: {error}", "minified": result is not None}, gm=small)
    return folder
