"""Write a reproducer folder for one KernelSpec.

    <repro_dir>/<op>-<first input>-<key prefix>/
        spec.json       what happened (kind, spec, decision, target, cache dir, versions)
        graph.py        the minimal FX graph, as readable code
        inputs/         the inputs captured from the real run (torch's content-addressed store:
                        exact values and strides)
        reference.pt    the float64 CPU reference outputs
        repro.py        standalone: rebuilds the graph, runs it through kernelize on the target,
                        compares with the reference; exit 1 while the problem reproduces, 0 once fixed

Folders are deduplicated by spec key across graphs, runs and processes; each is written into
a temporary folder first and renamed into place, so a half-written repro is never seen.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from torch_kernelize.core.input_domains import requirements
from torch_kernelize.core.targets import Target
from torch_kernelize.serving import repro_recorder as recorder
from torch_kernelize.serving.repro_recorder import repro_counts
from torch_kernelize.core.spec import KernelSpec, upcast_dtype

log = logging.getLogger("torch_kernelize.repro")

KINDS = {
    "miss": "the node ran on the vendor kernel: the kernel cache has no entry for its spec",
    "missing": "nothing on the target runs this op: it ran on the host fallback",
    "mismatch": "a cached Triton kernel gave a wrong answer inside the model (check mode)",
    "failure": "a cached Triton kernel raised at run time and was disabled",
    "lowering": "kernelize failed to lower this graph",
    "slow": "the kernel is right but far from the chip's floor: one of the model's slowest (the bottleneck ledger)",
}

REPRO_MAIN = '''

if __name__ == "__main__":
    import sys
    from torch_kernelize.repro.run import main
    sys.exit(main(Repro, load_args, __file__))
'''


def spec_graph(spec: KernelSpec) -> fx.GraphModule:
    """The one-node ATen graph that computes ``spec`` (placeholders in spec input order)."""
    if spec.graph is not None:
        from torch_kernelize.core.region_graph import region_graph_module
        return region_graph_module(spec)
    graph = fx.Graph()
    phs = [graph.placeholder(f"arg{i}") for i in range(len(spec.inputs))]
    args, kwargs = spec.build_args(phs)
    out = graph.call_function(spec.op_overload, tuple(args), kwargs)
    graph.output((out,) if not spec.tuple_output else out)
    return fx.GraphModule(torch.nn.Module(), graph)


def graph_reference(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The float64 CPU reference of a graph: floating inputs upcast, ATen on CPU, node by node."""
    up = [t.detach().to("cpu", upcast_dtype(t)) for t in inputs]
    out = gm(*up)
    out = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(o.contiguous() for o in out if isinstance(o, torch.Tensor))


def target_ref(target: Target) -> str:
    """How a repro names its target: the built-in name or the TOML file's absolute path."""
    return target.source if target.source != "built-in" else target.name


def write_repro(folder: Path, spec: KernelSpec | None, inputs: Sequence[torch.Tensor], target: Target,
                kind: str, cache_dir: Path | None, extra: dict[str, Any] | None = None,
                gm: fx.GraphModule | None = None) -> bool:
    """Write one repro folder atomically; False if it already exists (another writer won).

    ``spec`` is the kernel the repro is about (None for a graph that failed to lower: then
    ``gm`` is required).
    """
    from torch._dynamo.repro.after_aot import generate_compiler_repro_string

    if kind not in KINDS:
        raise ValueError(f"unknown repro kind {kind!r}")
    folder = Path(folder)
    if (folder / "spec.json").exists():
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
    try:
        gm = gm if gm is not None else spec_graph(spec)
        cpu_inputs = [t.detach().cpu() for t in inputs]
        # stable_hash: the content store hashes with sha1. Its default hash is a torch.compile'd
        # kernel that reseeds the global RNG while it runs: on this background thread that is an
        # Inductor compile racing the model's, and random numbers drawn meanwhile on any thread
        # come from seed 0.
        code = generate_compiler_repro_string(gm, cpu_inputs, save_dir=str(tmp / "inputs"), stable_hash=True)
        code = code.replace(str(tmp / "inputs"), "inputs")  # the folder may move: paths are relative
        what = spec.describe() if spec is not None else f"graph of {len(gm.graph.nodes)} nodes"
        header = (f"# torch_kernelize reproducer ({kind}): {what}\n"
                  f"# {KINDS[kind]}.\n"
                  f"# Run: python repro.py [--target T] [--cache-dir D]; exit 0 = fixed, 1 = reproduces, "
                  f"2 = error.\n")
        (tmp / "repro.py").write_text(header + code + REPRO_MAIN)
        (tmp / "graph.py").write_text(gm.print_readable(print_output=False))
        torch.save(graph_reference(gm, cpu_inputs), tmp / "reference.pt")
        meta = {
            "kind": kind,
            "what": KINDS[kind],
            "op": spec.op if spec is not None else None,
            "spec": spec.to_json() if spec is not None else None,
            # per input, what the op requires of the values beside the captured ones (offsets rising from 0, ...)
            "input_domains": {str(i): t for i, t in requirements(spec).items()} if spec is not None else {},
            "target": target_ref(target),
            "target_description": target.describe(),
            "cache_dir": str(Path(cache_dir).resolve()) if cache_dir else None,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
        }
        meta.update(extra or {})
        (tmp / "spec.json").write_text(json.dumps(meta, indent=1, default=str))
        try:
            os.rename(tmp, folder)
        except OSError:  # someone else wrote it first (rename onto a non-empty folder fails)
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        return True
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_inputs(load_args: Callable, folder: Path) -> list[torch.Tensor]:
    """The captured inputs of the reproducer in ``folder``, read by its ``load_args``."""
    from torch._dynamo.debug_utils import InputReader
    store = folder / "inputs"
    if not store.is_dir():
        raise FileNotFoundError(f"{store} is missing: the captured inputs are gone")
    reader = InputReader(save_dir=str(store))
    load_args(reader)
    return list(reader.args)


def device_ready(inputs: Sequence[torch.Tensor]) -> Any:
    """An event recorded on the current stream of each CUDA device of ``inputs`` (after the work
    that made them), {device: event}; None when all are on the host."""
    devices = {t.device for t in inputs if t.is_cuda}
    if not devices:
        return None
    events = {}
    for device in devices:
        events[device] = torch.cuda.Event()
        events[device].record(torch.cuda.current_stream(device))
    return events


def host_copies(inputs: Sequence[torch.Tensor], ready: Any) -> list[torch.Tensor]:
    """CPU copies of ``inputs``, each device's made on a stream of their own once its ``ready``
    event has passed: the model's streams never wait for them, only the calling thread does."""
    if not ready:
        return list(inputs)
    streams = {}
    for device, event in ready.items():
        streams[device] = torch.cuda.Stream(device)
        streams[device].wait_event(event)
    out = []
    for t in inputs:
        if not t.is_cuda:
            out.append(t)
            continue
        with torch.cuda.stream(streams[t.device]):
            out.append(t.to("cpu"))  # (blocking: the copy is done before ``t`` can be freed)
    return out


class ReproWriter:
    """The backend's repro sink: one folder per spec key under ``root``.

    Misses (``check`` when planned, ``claim`` and ``write`` on the first call) are recorded by the
    process's background writer within its caps (repro_recorder.py); failures and mismatches
    (``write_failure``) are rare and written at once.
    """

    def __init__(self, root: Path, options: Any):
        self.root = Path(root)
        self.options = options

    def folder_for(self, spec: KernelSpec) -> Path:
        return self.root / spec.slug

    def _verdict(self, spec: KernelSpec, take: bool, record_key: str | None) -> str:
        """``record_key``: the key the miss is recorded once under per process: in a dynamic graph
        its node's and shape bucket's (the caller makes it), else the spec's own."""
        return recorder.budget.verdict(self.root, record_key or spec.key, self.folder_for(spec),
                                       recorder.captured_bytes(spec), self.options.repro_max,
                                       self.options.repro_max_bytes, take, spec.key)

    def wants(self, spec: KernelSpec, record_key: str | None = None) -> bool:
        """Whether a miss of ``spec`` would be recorded now (nothing is taken)."""
        return self._verdict(spec, False, record_key) == recorder.NEW

    def check(self, spec: KernelSpec, record_key: str | None = None) -> str:
        """Whether a miss of ``spec`` is to be recorded (recorder.NEW: capture its inputs on its first
        call, then ``claim`` it), was recorded already (DUPLICATE), or is suppressed by a cap (its
        name). A miss not to be recorded is counted for the report."""
        return self._counted(self._verdict(spec, False, record_key))

    def claim(self, spec: KernelSpec, record_key: str | None = None) -> bool:
        """Take a miss for recording (True), just before its inputs are captured; False when another
        graph took it or a cap was reached since ``check`` (counted for the report)."""
        taken = self._counted(self._verdict(spec, True, record_key), claiming=True) == recorder.NEW
        if taken:
            repro_counts.add("claimed")
        return taken

    def release(self, spec: KernelSpec, record_key: str | None = None) -> None:
        """Give a claimed miss back: its inputs could not be captured here."""
        recorder.budget.give_back(self.root, record_key or spec.key, recorder.captured_bytes(spec))
        repro_counts.add("released")

    def count_unplanned(self, verdict: str, resized: bool) -> None:
        """Count a miss of a signature served by another's specialization, never planned and so
        never checked: ``verdict`` was the other's miss's, ``resized`` whether its sizes differ.
        A recorded one's bucket has its reproducer (the other's); a capped one is capped still."""
        if verdict in (recorder.NEW, recorder.DUPLICATE, recorder.SAME_BUCKET):
            verdict = recorder.SAME_BUCKET if resized else recorder.DUPLICATE
        repro_counts.add(verdict)

    def _counted(self, verdict: str, claiming: bool = False) -> str:
        if verdict != recorder.NEW:
            repro_counts.add(verdict)
            if verdict not in (recorder.DUPLICATE, recorder.SAME_BUCKET):
                recorder.budget.note_cap(self.options.repro_max, self.options.repro_max_bytes)
                if claiming:  # (when planning, the misses the plan records are not taken yet)
                    recorder.budget.say_capped()
        return verdict

    def write(self, decision: Any, inputs: Sequence[torch.Tensor], target: Target, kind: str,
              bucket_dims: Sequence[Sequence[Any]] | None = None) -> None:
        """Queue the repro of a claimed miss; ``inputs`` are copies the caller no longer touches,
        on the host or on a CUDA device (made on the current stream: the writer's thread copies
        them to the host behind it, host_copies). ``bucket_dims``: the miss's variable dims when it
        is recorded for its shape bucket."""
        spec = decision.spec
        extra = {"decision": decision.to_json()}
        if bucket_dims:
            extra["bucket_dims"] = [list(d) for d in bucket_dims]
        ready = device_ready(inputs)

        def write() -> None:
            nonlocal inputs
            written = None
            try:
                on_host, inputs = host_copies(inputs, ready), ()  # (device copies freed before the slow part)
                if write_repro(self.folder_for(spec), spec, on_host, target, kind, self.options.cache_dir, extra):
                    repro_counts.add("written")
                    written = recorder.captured_bytes(spec)
                    log.debug("wrote %s repro for %s to %s", kind, spec.describe(), self.folder_for(spec))
                else:  # another process wrote it first
                    repro_counts.add(recorder.DUPLICATE)
            finally:
                recorder.budget.settle(written)
                recorder.budget.say_capped()

        if not recorder.writer.submit(write):
            self.release(spec)
            repro_counts.add(recorder.QUEUE_FULL)

    def write_failure(self, spec: KernelSpec, inputs: Sequence[torch.Tensor], target: Target, why: str,
                      kind: str = "failure", extra: dict[str, Any] | None = None,
                      gm: fx.GraphModule | None = None) -> Path | None:
        folder = self.root / f"{kind}-{spec.slug}"
        try:
            write_repro(folder, spec, inputs, target, kind, self.options.cache_dir,
                        dict({"cause": why}, **(extra or {})), gm=gm)
            return folder
        except Exception:
            log.exception("could not write the %s repro for %s", kind, spec.describe())
            return None
