"""The Inductor generator: Inductor compiles a spec's ATen graph offline, and the Triton kernels
it generated, in the order its output code launches them, become a KernelProgram.

fill_cache only: the spec's graph (its op, or its region's nodes, traced with make_fx on inputs
of the spec's metas) goes through ``torch._inductor.compile``, in default mode, and in
``max-autotune`` as a further configuration where the graph holds a GEMM or a convolution. Its
output module's ``call`` then runs once under the launch recorder (lowering/kernels/recording.py):
each ``CachingAutotuner.run`` is recorded, not executed, as a launch of the autotuner's
``@triton.jit`` function with the config it chose (block sizes, warps, stages) and the grid that
config gives. The program's source is a plain module: the imports Inductor's kernels use
(``triton_helpers``, ``libdevice``) and each kernel with its ``@triton_heuristics`` decorator
removed (it builds an autotuner at import). Serving loads that source and its binaries like any
entry's: no Inductor lowering, codegen or autotuning, no Triton compile.

On CUDA, Inductor autotunes for real (one call of the compiled graph) before the recording; then,
in a whole graph's output, each kernel with several configs is timed again on each of them inside
the program, and records with the fastest there (inductor_retune.py: Inductor's own choice unless
another beats it). Without a GPU, Inductor can still generate Triton for
CPU tensors (``cpu_backend = "triton"``) under Triton's interpreter; its backend hash, which asks
for an active Triton driver, is patched for the compile, nothing is compiled or benchmarked, and
each kernel's config is the first of its heuristic list. The program then runs on the
interpreter target like any candidate: that is what CI covers.

Output code that calls anything but Triton kernels (``extern_kernels.mm``, an ATen fallback) has
no program for a node or region spec: the evaluation fails with that reason in the journal, and
the other candidates compete. A whole graph's spec (compiling/whole_graph.py) is recorded with
those calls as vendor steps (inductor_program.py): Inductor's complete output is its candidate.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import types
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch

from torch_kernelize.lowering.kernels import Config, KernelFamily, KernelProgram
from torch_kernelize.lowering.kernels.recording import RecordingError, record_program, recorded_once
from torch_kernelize.fill_cache.inductor_output import (_autotuner_launches, _autotuners, dispatching_helpers,
                                                       kernels_namespace, program_source)
from torch_kernelize.fill_cache.inductor_program import record_whole
from torch_kernelize.fill_cache.inductor_retune import offered_configs, retune
from torch_kernelize.fill_cache.graph_candidates import WHOLE_GRAPH_DOMAIN
from torch_kernelize.compiling.graph_rewrites import REWRITES, SITES, counted
from torch_kernelize.compiling.whole_graph import is_whole_graph
from torch_kernelize.core.region_graph import region_graph, spec_ops
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import Target

GENERATOR = "inductor"
log = logging.getLogger("torch_kernelize.fill_cache")
RECORD_SEED = 7
# Ops Inductor may lower to templates (max-autotune's Triton GEMM/conv kernels) or extern calls
TEMPLATE_OPS = frozenset({"aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default",
                          "aten.convolution.default", "aten._scaled_mm.default"})
# Inductor config per mode (torch._inductor.list_mode_options, less CUDA graphs: a program is its launches)
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True},
}
# From scratch, in this process: kernels loaded from Inductor's caches or compiled in its
# subprocesses come back without their Python function, which the program's source is
# comprehensive_padding off: a program's outputs have the traced strides (the layout contract of
# every tier); Inductor's padded strides (BERT's 30522-wide logits at a row stride of 30528) would
# not be the spec's output
COMMON_OPTIONS = {"triton.cudagraphs": False, "force_disable_caches": True, "compile_threads": 1,
                  "comprehensive_padding": False}
# Without a GPU: Triton code for CPU tensors
CPU_CAPTURE_OPTIONS = {"cpu_backend": "triton"}


class InductorGenerator(KernelFamily):
    """One configuration per Inductor mode; no neighbours (Inductor does its own search)."""

    name = GENERATOR
    generates_in_parent = True  # it autotunes on the GPU and keeps its captures

    def __init__(self) -> None:
        self._programs: dict[tuple[str, str], KernelProgram | RecordingError] = {}

    def supports(self, spec: KernelSpec) -> str | None:
        devices = {m.device for m in spec.inputs + spec.outputs}
        if not devices <= {"cpu", "cuda"}:
            return f"Inductor generates Triton for CPU and CUDA tensors, not {sorted(devices - {'cpu', 'cuda'})}"
        if not spec.outputs or any(m.numel == 0 for m in spec.outputs):
            return "no output elements to compute"
        return None

    def asked_by_default(self, target: Target) -> str | None:
        if target.triton != "cuda":
            return (f"off by default on a {target.triton} target (an Inductor compile per spec costs seconds, "
                    "and only CUDA autotunes); ask for it with --generators")
        return None

    def seed_configs(self, spec: KernelSpec) -> list[Config]:
        """Default mode; for a whole graph where a rewrite has something to change, default mode
        over the graph so rewritten (compiling/graph_rewrites.py); max-autotune where a GEMM or a
        convolution could take a template. Default-mode seeds first: budget 1 asks for them."""
        configs = [Config.of(mode="default")]
        if is_whole_graph(spec):
            configs += [Config.of(mode="default", rewrite=name) for name in _rewrites_for(spec)]
        if _on_gpu(spec) and TEMPLATE_OPS & set(spec_ops(spec)):
            configs.append(Config.of(mode="max-autotune"))
        return configs

    def evaluations(self, spec: KernelSpec, budget: int) -> int:
        """Budget 1 (the quick fill) asks for the default-mode seeds of whole graphs alone (the
        graph as traced, and as each rewrite with something to change gives it): an
        Inductor compile per node or region spec costs seconds (Mixtral's quick fill spent most
        of its 136 s so on the H200), where the spec's family has a seed of its own (a spec no
        family generates still gets Inductor's default: generators.Competition). Budget 2 adds
        max-autotune for whole graphs, where it can fuse an epilogue into a GEMM template; node
        and region specs get Inductor's modes from budget 3 on: max-autotune's GEMM and
        convolution autotuning takes tens of seconds per spec, and a whole graph holding the node
        competes already."""
        whole = is_whole_graph(spec)
        if budget <= 1 or (budget == 2 and not whole):
            return sum(c.get("mode") == "default" for c in self.seed_configs(spec)) if whole else 0
        return len(self.seed_configs(spec))

    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        mode, rewrite = config.get("mode"), config.get("rewrite")
        if mode not in MODES:
            raise ValueError(f"unknown Inductor mode {mode!r}; expected one of {sorted(MODES)}")
        if rewrite is not None and rewrite not in REWRITES:
            raise ValueError(f"unknown graph rewrite {rewrite!r}; expected one of {sorted(REWRITES)}")
        # a whole graph: Inductor's whole output, extern calls included (inductor_program.py)
        record = record_whole if is_whole_graph(spec) else None
        return recorded_once(self._programs, (spec.key, mode, rewrite),
                             lambda: capture(spec, mode, record, rewrite),
                             f"no Inductor candidate ({mode}{', ' + rewrite if rewrite else ''})")

    def provenance(self, config: Config) -> dict[str, Any]:
        mode = config.get("mode")
        how = ("Inductor's own autotuning on CUDA (in a whole graph, each multi-config kernel then timed on "
               "each config in the program, Inductor's choice kept unless another was faster there)"
               if torch.cuda.is_available() else
               "the first config of Inductor's heuristic list (no GPU: captured under Triton's interpreter)")
        rewrite = {"rewrite": config.get("rewrite")} if config.get("rewrite") else {}
        return {"generator": GENERATOR, "inductor": {"torch": torch.__version__, "mode": mode, **rewrite,
                                                     "config": {**MODES.get(mode, {}), **COMMON_OPTIONS},
                                                     "configs_from": how}}


GENERATOR_INSTANCE = InductorGenerator()


def _rewrites_for(spec: KernelSpec) -> list[str]:
    """The graph rewrites with something to change in ``spec``'s graph (graph_rewrites.SITES)."""
    nodes = region_graph(spec)["nodes"]

    def shape_of(ref: Any) -> Any:
        if isinstance(ref, dict) and "input" in ref:
            return spec.inputs[ref["input"]].shape
        return nodes[ref["node"]]["meta"]["shape"]
    return [name for name, site in SITES.items() if any(site(n, shape_of) for n in nodes)]


def _on_gpu(spec: KernelSpec) -> bool:
    return any(m.device == "cuda" for m in spec.inputs + spec.outputs) and torch.cuda.is_available()


def capture(spec: KernelSpec, mode: str, record: Callable | None = None,
            rewrite: str | None = None) -> KernelProgram:
    """Inductor's kernels for ``spec`` in ``mode``, recorded as a KernelProgram; RecordingError
    (with the reason) where there is none. ``record(compiled, module, spec, inputs)``: how the
    compiled output is recorded (default: its Triton launches alone). ``rewrite``: the graph is
    traced through that rewrite first (compiling/graph_rewrites.py); RecordingError, before any
    compile, where it changes nothing."""
    from torch.fx.experimental.proxy_tensor import make_fx

    on_gpu = _on_gpu(spec)
    domain = WHOLE_GRAPH_DOMAIN if is_whole_graph(spec) else KernelFamily()  # (a graph's token ids in range)
    inputs = domain.sample_inputs(spec, RECORD_SEED, "random", "cuda" if on_gpu else "cpu")
    applied: list[str] = []
    table = counted(rewrite, applied) if rewrite else None
    try:
        with torch.no_grad():
            gm = make_fx(lambda *ts: spec.run_vendor(list(ts)), decomposition_table=table)(*inputs)
    except Exception as e:
        raise RecordingError(f"its ATen graph could not be traced: {type(e).__name__}: {e}") from None
    if rewrite and not applied:
        raise RecordingError(f"the rewrite {rewrite!r} changes nothing in this graph")
    with _compiling(on_gpu, mode) as loaded:
        try:
            compiled = torch._inductor.compile(gm, list(inputs))
            offered = offered_configs(loaded)
            if on_gpu:  # Inductor autotunes on its first call; the recording takes what it chose
                with torch.no_grad():
                    compiled(*inputs)
                torch.cuda.synchronize()
        except Exception as e:
            raise RecordingError(f"Inductor failed: {type(e).__name__}: {str(e)[:400]}") from None
        module = _output_module(loaded)
        # in a whole graph a kernel runs among others; a node's or region's runs alone, as Inductor timed it
        config_of = _retuned(compiled, module, inputs, offered) if on_gpu and is_whole_graph(spec) else None
        try:
            return (record or _record)(compiled, module, spec, inputs, config_of)
        finally:
            if on_gpu:  # the measure worker judges free device memory: give back what autotuning held
                del compiled
                torch.cuda.empty_cache()


def _output_module(loaded: list[types.ModuleType]) -> types.ModuleType:
    module = next((m for m in reversed(loaded) if callable(getattr(m, "call", None))), None)
    if module is None:
        raise RecordingError("Inductor's output module was not seen loading (this torch's Inductor loads its "
                             "code differently)")
    return module


def _retuned(compiled: Callable, module: types.ModuleType, inputs: list,
             offered: dict[int, list[Any]]) -> Callable[[Any], Any] | None:
    """Each kernel's config as chosen again in the program (inductor_retune.py); None (Inductor's
    own choices, with a warning) where that cannot be done."""
    try:
        return retune(compiled, module, inputs, offered).config_of
    except Exception as e:  # (the profiler, or a config that does not compile): Inductor's choice stands
        log.warning("Inductor's kernel configs were not timed in the program (%s: %s); its own choices are kept",
                    type(e).__name__, str(e)[:300])
        return None


def _record(compiled: Callable, module: types.ModuleType, spec: KernelSpec, inputs: list,
            config_of: Callable[[Any], Any] | None = None) -> KernelProgram:
    """One call of ``compiled`` (whose output code is ``module``) recorded as a KernelProgram, each
    kernel with ``config_of(autotuner)`` where given (else the config Inductor chose)."""
    kernels = _autotuners(module)
    if not kernels:
        raise RecordingError("Inductor's output code launches no Triton kernel (it calls ATen or extern "
                             "kernels only)")
    source = program_source(Path(module.__file__).read_text(), kernels)
    namespace = kernels_namespace(kernels)
    try:
        with mock.patch.dict(module.__dict__, dispatching_helpers(module)), torch.no_grad():
            return record_program(compiled, inputs, spec, source, namespace, arguments=(list(inputs), {}),
                                  hooks=[functools.partial(_autotuner_launches, config_of=config_of)])
    except RecordingError as e:
        raise RecordingError(f"Inductor's output code is not only Triton launches ({e})") from None


@contextlib.contextmanager
def _compiling(on_gpu: bool, mode: str) -> Iterator[list[types.ModuleType]]:
    """Inductor's config for ``mode`` (and, without a GPU, for Triton on CPU under the
    interpreter); yields the list of modules Inductor loads meanwhile."""
    import torch._inductor.config as inductor_config
    from torch._inductor.codecache import PyCodeCache

    for owner, name in ((PyCodeCache, "load_by_key_path"), (torch.utils._triton, "triton_hash_with_backend"),
                        (torch._inductor, "compile")):
        if not hasattr(owner, name):
            raise RecordingError(f"this torch ({torch.__version__}) has no {owner.__name__}.{name}, which the capture "
                                 "of Inductor's kernels relies on")
    loaded: list[types.ModuleType] = []
    load = PyCodeCache.load_by_key_path.__func__

    def load_by_key_path(cls, *args, **kwargs):
        module = load(cls, *args, **kwargs)
        loaded.append(module)
        return module

    options = {**MODES[mode], **COMMON_OPTIONS, **({} if on_gpu else CPU_CAPTURE_OPTIONS)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(options))
        stack.enter_context(mock.patch.object(PyCodeCache, "load_by_key_path", classmethod(load_by_key_path)))
        if not on_gpu:
            # The interpreter decorates the kernels when the output module loads; Inductor's
            # backend hash (of the kernels' metadata only) asks Triton for a driver there is none of.
            stack.enter_context(mock.patch.dict(os.environ, TRITON_INTERPRET="1"))
            stack.enter_context(mock.patch.object(torch.utils._triton, "triton_hash_with_backend",
                                                  lambda: "TORCH-KERNELIZE-CPU-CAPTURE"))
        yield loaded
