"""Replay a reproducer: rebuild the graph, lower it with kernelize on the target, compare.

    python -m torch_kernelize.repro.run FOLDER [--target T] [--cache-dir D]
    python -m torch_kernelize.repro.run --batch FOLDER... [--target T] [--cache-dir D]   # one JSON line each

reads the folder as data (spec.json, the content store of captured inputs, reference.pt: see
serving/repro_inputs.py); its repro.py, a script for people, runs the same through ``main``.
Exit status: 0 fixed, 1 the problem still reproduces, 2 the repro itself could not run.
"""
from __future__ import annotations

import argparse
import json
import operator
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from torch_kernelize.serving.repro_writer import load_inputs

if TYPE_CHECKING:
    from torch_kernelize.compiling.lower import LoweredGraph

FIXED, REPRODUCES, ERROR = 0, 1, 2


def to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    """Captured inputs keep their strides on the device (expanded and gapped views included)."""
    from torch_kernelize.core.devices import to_device as move
    return move(t, device)


def compare_outputs(outs: list[torch.Tensor], refs: list[torch.Tensor], op: str | None):
    from torch_kernelize.core.validate import Comparison, compare
    if len(outs) != len(refs):
        return Comparison(False, reason=f"{len(outs)} outputs, the reference has {len(refs)}")
    worst = Comparison(True)
    for i, (o, r) in enumerate(zip(outs, refs)):
        c = compare(o, r, op)
        if not c.ok:
            c.reason = f"output {i}: {c.reason}"
            return c
        worst.max_abs = max(worst.max_abs, c.max_abs)
    return worst


def run_repro(module: torch.nn.Module, inputs: list[torch.Tensor], meta: dict[str, Any], target: str,
              cache_dir: str | None) -> tuple[int, str]:
    """(status, message) of one repro run."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_kernelize.compiling.lower import lower
    from torch_kernelize.core.targets import get_target
    from torch_kernelize.core.spec import KernelSpec

    kind = meta["kind"]
    spec = KernelSpec.from_json(meta["spec"]) if meta.get("spec") else None
    tgt = get_target(target)
    inputs = [to_device(t, tgt.device) for t in inputs]
    gm = make_fx(module, tracing_mode="fake")(*inputs)
    options = {"target": target, "repro_dir": "off", "report": None}
    if cache_dir:
        options["cache_dir"] = cache_dir
    try:
        lowered = lower(gm, inputs, options, kind="repro")
    except Exception as e:
        if kind == "lowering":
            return REPRODUCES, f"lowering still fails: {type(e).__name__}: {e}"
        raise
    outs = lowered(list(inputs))
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else [outs]) if isinstance(o, torch.Tensor)]
    ref = list(torch.load(Path(meta["folder"]) / "reference.pt", weights_only=True))  # data, never code
    single_op = (spec.op if spec is not None and spec.graph is None  # (a tuple's getitems are no ops)
                 and sum(n.op == "call_function" and n.target is not operator.getitem for n in gm.graph.nodes) == 1
                 else None)
    if single_op is not None:  # an index naming an element equal to the reference's is as right (sort, topk)
        from torch_kernelize.lowering.kernels import family_for
        family = family_for(spec)
        if family is not None:
            outs = list(family.resolve_ties(spec, inputs, outs, ref))
    cmp = compare_outputs(outs, ref, single_op)
    if spec is None:  # a graph that failed to lower: fixed once it lowers and computes right
        if not cmp.ok:
            return REPRODUCES, f"the graph lowers now but computes WRONG: {cmp.reason}"
        return FIXED, "the graph lowers and matches the reference"
    decisions = lowered.report.decisions + lowered.report.regions
    node = next((d for d in decisions if d.spec_key == spec.key and d.tier == "triton"),
                next((d for d in decisions if d.spec_key == spec.key), None))
    tier = node.tier if node else "?"
    where = f"{spec.describe()}: tier {tier}" + (f" ({node.reason})" if node else "")
    if not cmp.ok:
        return REPRODUCES, f"{where}; output WRONG: {cmp.reason}"
    if kind == "miss" and tier != "triton":
        why = node.rejected.get("triton", node.reason) if node else ""
        return REPRODUCES, f"{where}; still a miss: {why}"
    if kind == "missing" and tier == "fallback":
        return REPRODUCES, f"{where}; still missing on target {target!r}"
    if kind == "failure" and any(getattr(d.entry, "key", None) and d.tier == "triton" for d in decisions):
        failed = [c for c in _triton_calls(lowered) if c.state.disabled]
        if failed:
            return REPRODUCES, f"{where}; the kernel failed again: {failed[0].state.disabled}"
    if kind == "slow":  # a performance reproducer: this script judges the answer only
        return FIXED, (f"{where}; output matches the reference (max abs err {cmp.max_abs:.3g}); its speed is what "
                       "check_candidate.py --time and python -m torch_kernelize.bottlenecks measure")
    return FIXED, f"{where}; output matches the reference (max abs err {cmp.max_abs:.3g})"


def _triton_calls(lowered: LoweredGraph) -> list[Any]:
    from torch_kernelize.serving.runtime import TritonCall
    return [n.target for s in lowered.specializations().values() for n in s.gm.graph.nodes
            if isinstance(n.target, TritonCall)]


def main(repro_cls: type, load_args: Callable, file: str, argv: list[str] | None = None) -> int:
    """What a repro.py runs: its own graph and ``load_args``."""
    folder = Path(file).resolve().parent
    return _replay(folder, argv, lambda: repro_cls(), lambda: load_inputs(load_args, folder))


def main_folder(argv: list[str] | None = None) -> int:
    """Replay a folder from its data alone (``python -m torch_kernelize.repros replay``): the graph
    from spec.json's spec, the inputs from the content store; nothing of the folder is executed."""
    from torch_kernelize.serving.repro_inputs import ReproProblem, read_inputs, read_meta
    from torch_kernelize.serving.repro_writer import spec_graph
    from torch_kernelize.core.spec import KernelSpec

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m torch_kernelize.repro.run FOLDER [--target T] [--cache-dir D]", file=sys.stderr)
        return ERROR
    folder = Path(argv.pop(0)).resolve()

    def spec() -> KernelSpec | None:
        meta = read_meta(folder)
        return KernelSpec.from_json(meta["spec"]) if meta.get("spec") else None

    def graph() -> torch.nn.Module:
        if spec() is None:
            raise ReproProblem("a graph that failed to lower is only in this folder's repro.py (code): run that "
                               "script yourself if you trust the folder, or replay with --run-scripts")
        return spec_graph(spec())
    return _replay(folder, argv, graph, lambda: read_inputs(folder, spec()))


def _replay(folder: Path, argv: list[str] | None, module: Callable[[], torch.nn.Module],
            inputs: Callable[[], list[torch.Tensor]]) -> int:
    from torch_kernelize.serving.repro_inputs import ReproProblem
    parser = argparse.ArgumentParser(description=f"torch_kernelize reproducer in {folder}")
    parser.add_argument("--target", help="target name or TOML path (default: $KERNELIZE_TARGET, else the recorded one)")
    parser.add_argument("--cache-dir", help="kernel cache (default: $KERNELIZE_CACHE_DIR, else the recorded one)")
    args = parser.parse_args(argv)
    try:
        meta = json.loads((folder / "spec.json").read_text())
        meta["folder"] = str(folder)
        target = args.target or os.environ.get("KERNELIZE_TARGET") or meta["target"]
        cache_dir = args.cache_dir or os.environ.get("KERNELIZE_CACHE_DIR") or meta.get("cache_dir")
        status, message = run_repro(module(), inputs(), meta, target, cache_dir)
    except ReproProblem as e:  # the folder's data fail their checks
        print(f"ERROR: the repro in {folder} could not run: {e}", file=sys.stderr)
        return ERROR
    except Exception:
        traceback.print_exc()
        print(f"ERROR: the repro in {folder} could not run", file=sys.stderr)
        return ERROR
    print(f"{'FIXED' if status == FIXED else 'REPRODUCES'} [{meta['kind']}] {message}")
    return status


def main_batch(argv: list[str]) -> int:
    """``--batch FOLDER... [--target T] [--cache-dir D]``: replay several folders in this one
    process (torch imported once), one JSON line each: folder, exit status, its last line of
    output. Stops after a folder that could not run (it may have left this process unusable, as a
    CUDA device assert does): the caller replays the rest each in a fresh process."""
    import contextlib
    import io
    first_option = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    folders, opts = argv[:first_option], argv[first_option:]
    for folder in folders:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main_folder([folder, *opts])
        lines = (out.getvalue().strip() or err.getvalue().strip()).splitlines()
        print(json.dumps({"folder": folder, "code": code, "detail": lines[-1] if lines else ""}), flush=True)
        if code == ERROR:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main_batch(sys.argv[2:]) if sys.argv[1:2] == ["--batch"] else main_folder())
