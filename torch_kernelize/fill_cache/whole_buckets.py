"""Graph-level winners over shape buckets: a dynamic graph competes whole, one bucket at a time.

``fill_cache --model M --dynamic I:D:LO-HI`` traces M with dynamic shapes (buckets.py). Each
graph that can be one program over the sizes of that dim (compiling/whole_graph.py's
``dynamic_whole``: every node an ATen or prims op, an input or output dim that size itself, or
else a multiple of it, a token count, read off divided by the bucket's scale), or
where ops no program may call break it (an MoE router's top-k, its experts' custom op) each
stretch between them (``stretch_module``: a graph of its own), becomes one BucketWork per
bucket, keyed by the graph's canonical form
at two probe sizes and the bucket's range (``whole_probe_keys``, core/buckets.probe_prefix). Its
candidate is Inductor's output, compiled once with that size dynamic over the bucket
(``mark_dynamic`` with the bucket's edges), recorded at several sizes of the bucket
(inductor_program.py) and fitted into one program (program_fit.py). It competes at the upper edge
with the graph as serving would run it without it (``dynamic_assembly``: the nodes' and regions'
own bucket entries, filled before it) and is validated at the edges and inside like any bucket's
winner (buckets.BucketMeasurer). Serving finds the bucket by the graph's prefix and
runs the program at the call's size: no compile, no code generation, no disk read
(compiling/bucket_lookup.py).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.regions import region_spec
from torch_kernelize.compiling.whole_graph import DynamicWhole, dynamic_stretches, dynamic_whole, whole_probe_keys
from torch_kernelize.core.buckets import unbucketable
from torch_kernelize.core.shapes import concrete_value
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.fill_cache.graph_candidates import WHOLE_GRAPH_DOMAIN
from torch_kernelize.fill_cache.inductor import GENERATOR, RECORD_SEED, InductorGenerator, _compiling, _output_module
from torch_kernelize.fill_cache.inductor_program import record_whole
from torch_kernelize.fill_cache.program_fit import fit_program
from torch_kernelize.lowering.kernels import Config, KernelFamily, KernelProgram
from torch_kernelize.lowering.kernels.recording import RecordingError, recorded_once

log = logging.getLogger("torch_kernelize.fill_cache")

FIT_SIZES = 5  # sizes a program is recorded at: the edges and three inside (every size of a smaller bucket)


@dataclasses.dataclass
class DynamicGraph:
    """A dynamic graph of the trace, whole over one symbol: what its buckets are made from."""
    gm: fx.GraphModule
    whole: DynamicWhole
    bindings: dict  # every symbol at its traced size (the varying one is replaced per size)

    def spec_at(self, values: Sequence[int]) -> KernelSpec:
        spec = region_spec(self.whole.region, {**self.bindings, self.whole.symbol: int(values[0])})
        if spec is None:
            raise RecordingError(f"the graph has a size that is not bound at {self.whole.symbol}={values[0]}")
        return spec

    def probes(self) -> tuple[str, ...] | None:
        return whole_probe_keys(self.whole, self.bindings)

    def symbol_source(self) -> tuple[int, int, int] | None:
        """Where a call's tensors give the varying size: (input, dim, the number it is divided
        by), the first input dim of its bucket's; None where none is an input's."""
        at = next(((i, d) for side, i, d, _ in self.whole.dims if side == "in"), None)
        scale = self.whole.scale(self.bindings)
        return (*at, scale) if at is not None and scale is not None else None


def fit_sizes(lo: int, hi: int) -> list[int]:
    """Where a bucket's program is recorded: every size of a small bucket; else both edges, the
    sizes next to them and the middle."""
    if hi - lo + 1 <= FIT_SIZES:
        return list(range(lo, hi + 1))
    return sorted({lo, lo + 1, (lo + hi) // 2, hi - 1, hi})


class WholeBucketGenerator(KernelFamily):
    """Inductor's output for one dynamic graph over one bucket, as one fitted program."""

    name = GENERATOR
    generates_in_parent = True  # it holds the graph, which no worker process has

    def __init__(self, graph: DynamicGraph, bucket: tuple[int, int]):
        self.graph, self.bucket = graph, bucket
        self._programs: dict[Any, KernelProgram | RecordingError] = {}

    def supports(self, spec: KernelSpec) -> str | None:
        return None

    def bucket_support(self, spec: KernelSpec, dims: Any) -> str | None:
        return None

    def bucket_config_problem(self, config: Config) -> str | None:
        return None

    def seed_configs(self, spec: KernelSpec) -> list[Config]:
        return [Config.of(mode="default")]

    def evaluations(self, spec: KernelSpec, budget: int) -> int:
        return 1

    def neighbours(self, spec: KernelSpec, config: Config) -> list[Config]:
        return []

    def sample_inputs(self, spec, seed, kind="random", device="cpu"):
        return WHOLE_GRAPH_DOMAIN.sample_inputs(spec, seed, kind, device)

    def provenance(self, config: Config) -> dict[str, Any]:
        out = InductorGenerator().provenance(config)
        out["inductor"]["dynamic"] = {"symbol": str(self.graph.whole.symbol), "bucket": list(self.bucket),
                                      "recorded_at": fit_sizes(*self.bucket)}
        return out

    def generate_bucketed(self, spec: KernelSpec, config: Config, dims: Any) -> KernelProgram:
        mode = config.get("mode", "default")
        return recorded_once(self._programs, mode, lambda: self._capture(spec, mode),
                             f"no Inductor candidate over the bucket ({mode})")

    def _capture(self, spec: KernelSpec, mode: str) -> KernelProgram:
        lo, hi = self.bucket
        on_gpu = spec.outputs[0].device == "cuda" and torch.cuda.is_available()
        device = "cuda" if on_gpu else "cpu"
        sizes = fit_sizes(lo, hi)
        specs = {v: self.graph.spec_at([v]) for v in sizes}
        inputs = {v: WHOLE_GRAPH_DOMAIN.sample_inputs(specs[v], RECORD_SEED, "random", device) for v in sizes}
        with _compiling(on_gpu, mode) as loaded:
            compiled, example = _compile_dynamic(self.graph, inputs[hi], lo, hi)
            module = _output_module(loaded)

            def call(*tensors: torch.Tensor) -> Any:
                return compiled(*_graph_arguments(example, _host_scalars_as_vectors(self.graph, tensors)))
            if on_gpu:  # Inductor autotunes on its first call, at the upper edge
                with torch.no_grad():
                    call(*inputs[hi])
                torch.cuda.synchronize()
            recorded = {v: record_whole(call, module, specs[v], inputs[v]) for v in sizes}
        return fit_program(recorded, every_size=len(sizes) == hi - lo + 1)


def _compile_dynamic(graph: DynamicGraph, inputs: list[torch.Tensor], lo: int, hi: int) -> tuple[Callable, list]:
    """Inductor's compile of the graph with its varying size dynamic over [lo, hi], and the
    example arguments (fake tensors and SymInts) of the graph it compiled."""
    from torch._dynamo.backends.common import aot_autograd

    whole = graph.whole
    function = _graph_function(graph)
    examples = [t.clone() for t in _host_scalars_as_vectors(graph, inputs)]
    for i, n in enumerate(whole.region.inputs):
        for d, size in enumerate(n.meta["val"].shape):
            if ("in", i, d, 0) in whole.dims:
                scale = whole.scale(graph.bindings)
                torch._dynamo.mark_dynamic(examples[i], d, min=lo * scale, max=hi * scale)
            elif isinstance(size, torch.SymInt) and whole.symbol in size.node.expr.free_symbols:
                # (another size of it, a token count: dynamic too, or Inductor specialises the
                # program at the upper edge; Dynamo may find it the product it is)
                torch._dynamo.maybe_mark_dynamic(examples[i], d)
    got: dict[str, Any] = {}

    def compile_forward(gm: fx.GraphModule, example: list) -> Callable:
        got["compiled"] = torch._inductor.compile(gm, example)
        got["example"] = list(example)
        return gm.forward  # (not run here: on the interpreter Inductor's kernels only record)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(function, backend=aot_autograd(fw_compiler=compile_forward), fullgraph=True,
                          dynamic=False)(*examples)
    except Exception as e:
        raise RecordingError(f"Inductor failed on the dynamic graph: {type(e).__name__}: {str(e)[:400]}") from None
    finally:
        torch._dynamo.reset()
    if "compiled" not in got:
        raise RecordingError("the dynamic graph compiled to nothing")
    if not any(isinstance(a, torch.SymInt) for a in got["example"]):
        raise RecordingError(f"Inductor specialised the graph at {whole.symbol}={hi}: no program serves the bucket")
    return got["compiled"], got["example"]


def _graph_function(graph: DynamicGraph) -> Callable:
    """The graph as a function of its region's tensor inputs, in their order: its size inputs
    read off their dims (the varying one and the rest alike), a float input at its traced value,
    a constant (``get_attr``) from the inputs too; its outputs in the region's order. Each input
    is touched in order first, so Dynamo lifts them in that order (``_graph_arguments``)."""
    region = graph.whole.region
    index = {n: i for i, n in enumerate(region.inputs)}
    device = _device(graph)
    where = _size_sources(region)
    source = graph.symbol_source()
    readers: list[Callable[[Sequence[torch.Tensor]], Any]] = []
    for node in graph.gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not node.users:  # (a dynamic trace's size input nothing reads)
            readers.append(lambda ts: None)
        elif node in index and _is_host_scalar(val):
            readers.append(lambda ts, i=index[node]: ts[i].reshape(()).to(device))
        elif node in index:
            readers.append(lambda ts, i=index[node]: ts[i])
        elif isinstance(val, torch.SymInt) and val.node.expr in where:
            i, d = where[val.node.expr]
            readers.append(lambda ts, i=i, d=d: ts[i].shape[d])
        elif isinstance(val, torch.SymInt) and val.node.expr == graph.whole.symbol:
            if source is None:
                raise RecordingError(f"no input dim of the graph gives {graph.whole.symbol}")
            i, d, scale = source  # (a multiple of it: a token count)
            readers.append(lambda ts, i=i, d=d, scale=scale: ts[i].shape[d] // scale)
        else:  # a number fixed by the trace's bindings
            value = concrete_value(val, graph.bindings) if not isinstance(val, torch.Tensor) else None
            readers.append(lambda ts, value=value: value)
    # the graph with each constant the region reads as one more input (after the graph's own)
    constants = [n for n in region.inputs if n.op == "get_attr"]
    new, env = fx.Graph(), {}
    for node in graph.gm.graph.find_nodes(op="placeholder"):
        env[node] = new.placeholder(node.name)
    for node in constants:
        env[node] = new.placeholder(f"constant_{node.name}")
        readers.append(lambda ts, i=index[node]: ts[i])
    for node in graph.gm.graph.nodes:
        if node not in env:
            env[node] = new.node_copy(node, lambda n: env[n])
    module = fx.GraphModule(graph.gm, new)  # (also: the planner's module is lazy, which Dynamo does not trace)
    positions = _output_positions(graph)

    def function(*tensors: torch.Tensor) -> tuple:
        for t in tensors:
            t.dim()  # (lifted in this order)
        out = pytree.tree_leaves(module(*[r(tensors) for r in readers]))
        return tuple(out[p] for p in positions)
    return function


def dynamic_assembly(graph: DynamicGraph, target: Any, cache_dir: Any) -> Callable[[Sequence[torch.Tensor]], tuple]:
    """The graph as serving runs it without its whole-graph bucket, a function of the region's
    inputs: lowered once with its sizes dynamic, its nodes and regions on their own buckets (or
    exact entries) from ``cache_dir``. The baseline a bucket's program is timed against."""
    from torch_kernelize.compiling.lower import lower
    from torch_kernelize.core.options import Options

    region = graph.whole.region
    index = {n: i for i, n in enumerate(region.inputs)}
    placeholders = list(graph.gm.graph.find_nodes(op="placeholder"))
    where = _size_sources(region)
    source = graph.symbol_source()

    def arguments(tensors: Sequence[torch.Tensor]) -> list:
        out = []
        for node in placeholders:
            val = node.meta.get("val")
            if node in index:
                out.append(tensors[index[node]])
            elif isinstance(val, torch.SymInt) and val.node.expr in where:
                i, d = where[val.node.expr]
                out.append(int(tensors[i].shape[d]))
            elif isinstance(val, torch.SymInt) and val.node.expr == graph.whole.symbol and source is not None:
                i, d, scale = source  # (a multiple of it: a token count)
                out.append(int(tensors[i].shape[d]) // scale)
            else:  # a number fixed by the trace's bindings (a size no input gives: nothing reads it)
                out.append(concrete_value(val, graph.bindings))
        return out
    positions = _output_positions(graph)
    lowered: list = []

    def run(tensors: Sequence[torch.Tensor]) -> tuple:
        args = arguments(tensors)
        if not lowered:
            options = Options.for_fill(cache_dir)
            lowered.append(lower(fx.GraphModule(graph.gm, graph.gm.graph), args, options, "inference", target,
                                 whole=False))
        out = pytree.tree_leaves(lowered[0](list(args)))
        return tuple(out[p] for p in positions)
    return run


def _size_sources(region: Any) -> dict[Any, tuple[int, int]]:
    """Each size symbol of the region's inputs -> (the first input, its dim) of that size."""
    where: dict[Any, tuple[int, int]] = {}
    for i, n in enumerate(region.inputs):
        for d, size in enumerate(n.meta["val"].shape):
            if isinstance(size, torch.SymInt):
                where.setdefault(size.node.expr, (i, d))
    return where


def _output_positions(graph: DynamicGraph) -> list[int]:
    """Where each of the region's outputs is among the graph's output leaves."""
    leaves = pytree.tree_leaves(graph.gm.graph.output_node().args)
    return [leaves.index(o) for o in graph.whole.region.outputs]


def _is_host_scalar(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.device.type == "cpu"


def _device(graph: DynamicGraph) -> torch.device:
    """Where the graph computes: the device of its first input that is no host scalar."""
    vals = [n.meta["val"] for n in graph.whole.region.inputs]
    return next((v.device for v in vals if not _is_host_scalar(v)), torch.device("cpu"))


def _host_scalars_as_vectors(graph: DynamicGraph, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The region's inputs with each 0-d host tensor (a Python float that a dynamic trace made a
    graph input: a norm's eps) as a one-element view. Inductor reads a 0-d host input on the host
    (``.item()``), which a program cannot; the graph takes it back to 0-d on its device, which
    Inductor's code does as an op the program records (a copy to the device on CUDA)."""
    vals = [n.meta["val"] for n in graph.whole.region.inputs]
    return [t.reshape(1) if _is_host_scalar(v) else t for t, v in zip(tensors, vals)]


def _graph_arguments(example: list, tensors: Sequence[torch.Tensor]) -> list:
    """The compiled graph's arguments for ``tensors`` (the region's inputs, in order): its tensor
    arguments are those, its size arguments read off their dims."""
    fakes = [e for e in example if isinstance(e, torch.Tensor)]
    def same(f: torch.Tensor, t: torch.Tensor) -> bool:
        return f.dtype == t.dtype and f.dim() == t.dim() and all(
            isinstance(a, torch.SymInt) or a == b for a, b in zip(f.shape, t.shape))
    if len(fakes) != len(tensors) or not all(same(f, t) for f, t in zip(fakes, tensors)):
        raise RecordingError("the compiled graph's tensor arguments are not the region's inputs in order")
    out, k = [], 0
    for e in example:
        if isinstance(e, torch.Tensor):
            out.append(tensors[k])
            k += 1
        elif isinstance(e, torch.SymInt):
            out.append(_size_of(e, fakes, tensors))
        else:
            out.append(e)
    return out


def _size_of(sym: torch.SymInt, fakes: list, tensors: Sequence[torch.Tensor]) -> int:
    """The value of a size argument: an input's size or stride (a size-1 dim's stride is a
    symbol of its own) that is that symbol."""
    for fake, t in zip(fakes, tensors):
        for mine, theirs in ((fake.shape, t.shape), (fake.stride(), t.stride())):
            for d, size in enumerate(mine):
                if isinstance(size, torch.SymInt) and size.node.expr == sym.node.expr:
                    return int(theirs[d])
    raise RecordingError(f"the compiled graph takes the size {sym} that no input's size or stride gives")


def whole_works(graphs: Sequence[Any], example: dict[int, Any], boundaries: Any, source: str,
                make_work: Callable[..., Any]) -> list[Any]:
    """A bucket's work (``make_work``: buckets.BucketWork, which imports this module) per bucket
    of each dynamic inference graph of the trace that can be one program over a --dynamic size,
    or of each stretch between the ops that break it (``example``: the --dynamic dims by their
    traced size)."""
    works = []
    for g in graphs:
        if g.plan is None or g.binder.is_static or g.kind != "inference":
            continue
        for key in g.specializations():
            bindings = g.binder.bindings(key)
            for symbol, value in bindings.items():
                dim = example.get(value)
                if dim is None:
                    continue
                for place, graph in _dynamic_graphs(g, symbol, bindings):
                    probes, scale = graph.probes(), graph.whole.scale(bindings)
                    if probes is None or scale is None:
                        log.info("%s: not offered whole over %s (a size is unbound)", g.name, symbol)
                        continue
                    for lo, hi in boundaries.covering(dim.lo, dim.hi):
                        if lo < 2 or hi == lo:  # (a size of 0 or 1, or one size, is traced static)
                            continue
                        rep = graph.spec_at([hi])
                        if unbucketable(rep, graph.whole.dims) is None:
                            works.append(make_work(rep, graph.whole.dims, ((lo, hi),), source, probes,
                                                   WholeBucketGenerator(graph, (lo, hi)), graph.spec_at,
                                                   functools.partial(dynamic_assembly, graph), [(place, (lo, hi))],
                                                   scale))
    return works


def _dynamic_graphs(g: Any, symbol: Any, bindings: dict) -> list[tuple[str, DynamicGraph]]:
    """The graph of ``g`` whole over ``symbol``, or else each of its stretches (whole_graph.
    dynamic_stretches) as a graph of its own, whole over it, each with its place (program_places);
    [] (logged why) where none is."""
    whole, why = dynamic_whole(g.plan.gm, symbol)
    if whole is not None:
        return [(g.name, DynamicGraph(g.plan.gm, whole, bindings))]
    graphs = []
    for region in dynamic_stretches(g.plan.gm):
        sub = stretch_module(g.plan.gm, region)
        whole = dynamic_whole(sub, symbol)[0] if sub is not None else None
        if whole is not None:
            graphs.append((_stretch_place(g.name, region), DynamicGraph(sub, whole, bindings)))
    if not graphs:
        log.info("%s: not offered whole over %s (%s)", g.name, symbol, why)
    return graphs


def _stretch_place(graph: str, region: Any) -> str:
    return f"{graph}/stretch at {region.nodes[0].name}"


def program_places(g: Any, symbol: Any) -> dict[str, str]:
    """Where a program over ``symbol`` would serve each node of ``g`` (the place the quick fill
    keys the sizes of stored programs by, fill_run._fill_buckets): a stretch's nodes by their
    stretch's, so that a stretch's stored program spares the buckets of its own nodes and no
    other's; {} where the graph is one program over ``symbol`` (every node: the graph's place)."""
    if dynamic_whole(g.plan.gm, symbol)[0] is not None:
        return {}
    return {n.name: _stretch_place(g.name, region) for region in dynamic_stretches(g.plan.gm) for n in region.nodes}


def stretch_module(gm: fx.GraphModule, region: Any) -> fx.GraphModule | None:
    """A stretch of dynamic ``gm`` as a graph of its own: the graph's size inputs and bookkeeping,
    then the stretch's tensor inputs in its order, its nodes, its outputs (None where it reads a
    size no sum or product of the size inputs gives). Its canonical form is the stretch's in
    ``gm`` (serving's lookup key)."""
    new, env = fx.Graph(), {}
    sizes = {}  # each size input's symbol -> its node in the new graph
    for node in gm.graph.find_nodes(op="placeholder"):
        if isinstance(node.meta.get("val"), torch.SymInt):
            env[node] = _with_meta(new.placeholder(node.name), node.meta)
            sizes[node.meta["val"].node.expr] = env[node]
    for node in region.inputs:
        env[node] = _with_meta(new.get_attr(node.target) if node.op == "get_attr" else new.placeholder(node.name),
                               node.meta)
    inside = set(region.nodes)
    for node in gm.graph.nodes:
        if node in env or node.op != "call_function":
            continue
        sized = isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))
        if all(a in env for a in node.all_input_nodes) and (node in inside or sized):
            env[node] = new.node_copy(node, lambda n: env[n])
        elif sized and isinstance(node.meta["val"], torch.SymInt):  # (a size read off a tensor outside)
            expr = node.meta["val"].node.expr
            made = _size_node(new, expr, sizes)
            if made is not None:  # (a node made for it takes its meta; a size input keeps its own)
                env[node] = _with_meta(made, node.meta) if isinstance(made, fx.Node) and not expr.is_Symbol else made
        elif node in inside:
            return None
    new.output(tuple(env[o] for o in region.outputs))
    return fx.GraphModule(gm, new)


def _with_meta(node: fx.Node, meta: dict) -> fx.Node:
    node.meta = dict(meta)
    return node


def _size_node(graph: fx.Graph, expr: Any, sizes: dict) -> fx.Node | int | None:
    """``expr`` (a sum or product of size symbols and integers) computed in ``graph`` from the size
    inputs ``sizes``; None where it is something else."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return sizes.get(expr)
    if not (expr.is_Add or expr.is_Mul):
        return None
    parts = [_size_node(graph, a, sizes) for a in expr.args]
    if any(p is None for p in parts):
        return None
    op = operator.add if expr.is_Add else operator.mul
    out = parts[0]
    for p in parts[1:]:
        value = op(*(x.meta["val"] if isinstance(x, fx.Node) else x for x in (out, p)))
        out = graph.call_function(op, (out, p))
        out.meta["val"] = value
    return out
