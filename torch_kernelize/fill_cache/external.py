"""Candidate files: kernels written by a person or an agent, entered through the families' harness.

A candidate is a Python file with ``@triton.jit`` kernels at its top level and a function
``launch(*args)`` that is called with the node's arguments in the ATen schema's order (tensors
and scalars as the op receives them), or for a fused region with the region's inputs in order,
and returns the op's (the region's) outputs. It names what it is for with
``SPECS = ["<spec key>", ...]`` (the keys a task.md gives) or ``OP = "aten.<op>.<overload>"`` (every
shape of that op). ``launch`` runs once per spec, under the recorder (lowering/kernels/recording.py),
in a process of its own (candidate_recording.py: the file is never imported by the process that
judges it), which turns its launches into a KernelProgram whose source is the recorded kernels
alone; from there the candidate is one more configuration
of the spec's search: built, validated against float64 (seeds, edge values, two output fills, its
inputs checked untouched), timed against the vendor kernel beside the generated candidates, and,
if it wins, stored with provenance ``external`` and the file's sha256. Serving launches the
recorded program's binaries; the file's ``launch`` never runs again.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from torch_kernelize.fill_cache.collect import UsageError, Work
from torch_kernelize.lowering.kernels import Config, KernelFamily, KernelProgram, family_for
from torch_kernelize.fill_cache.candidate_recording import record_candidate
from torch_kernelize.lowering.kernels.recording import RecordingError, recorded_once
from torch_kernelize.core.errors import InputRejected
from torch_kernelize.core.spec import KernelSpec

if TYPE_CHECKING:
    from torch_kernelize.core.targets import Target
    from torch_kernelize.fill_cache.measure import Measurer

GENERATOR = "external"


class Candidate:
    """One candidate file, read (never imported here: candidate_recording.py imports it in a
    process of its own). What it is for (SPECS or OP) is read from its text, as literals."""

    def __init__(self, path: Path):
        self.path = Path(path).resolve()
        try:
            self.source = self.path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--candidate {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        self.sha256 = hashlib.sha256(self.source.encode()).hexdigest()
        names = self._top_level(path)
        if not isinstance(names.get("launch"), ast.FunctionDef):
            raise UsageError(f"--candidate {path}: define launch(*args), called with the op's arguments in "
                             "its schema's order, returning its outputs")
        specs, op = self._literal(path, names, "SPECS"), self._literal(path, names, "OP")
        if specs is None and op is None:
            raise UsageError(f"--candidate {path}: say what it is for: SPECS = ['<spec key>', ...] (from the "
                             "reproducer's task.md) or OP = 'aten.<op>.<overload>' (every shape of the op)")
        if not (specs is None or isinstance(specs, (list, tuple)) and all(isinstance(k, str) for k in specs)):
            raise UsageError(f"--candidate {path}: SPECS must be a list of spec keys (strings)")
        if not (op is None or isinstance(op, str)):
            raise UsageError(f"--candidate {path}: OP must be a string such as 'aten.sigmoid.default'")
        self.specs = frozenset(specs) if specs is not None else None
        self.op = op

    def _top_level(self, path: Path) -> dict[str, ast.stmt]:
        try:
            tree = ast.parse(self.source, str(self.path))
        except (SyntaxError, ValueError) as e:
            raise UsageError(f"--candidate {path}: it does not parse: {e}") from None
        names: dict[str, ast.stmt] = {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                names[node.name] = node
            elif isinstance(node, ast.Assign):
                names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        return names

    @staticmethod
    def _literal(path: Path, names: dict[str, ast.stmt], name: str) -> Any:
        node = names.get(name)
        if node is None:
            return None
        try:
            return ast.literal_eval(node.value)
        except (ValueError, TypeError, SyntaxError):
            raise UsageError(f"--candidate {path}: {name} must be a literal (it is read, not run)") from None

    def is_for(self, spec: KernelSpec) -> bool:
        return spec.key in self.specs if self.specs is not None else spec.op == self.op

    @property
    def config(self) -> Config:
        return Config.of(external=self.sha256[:16])  # the entry's provenance keeps the whole sha256

    def describe(self) -> str:
        return f"{self.path.name} (sha256 {self.sha256[:12]})"


class CandidateGenerator(KernelFamily):
    """The candidates given for one spec, competing with the spec's own family (if it has one).

    Each candidate is one configuration (``external=<sha256 prefix>``), evaluated first; the family's
    configurations follow with the run's usual budget. The input domain, edge kinds and tie
    rules are the family's: the harness, not the candidate, says what a correct kernel is.
    """

    name = GENERATOR

    def __init__(self, candidates: Sequence[Candidate], base: KernelFamily | None):
        self.candidates = {c.config["external"]: c for c in candidates}
        self.base = base
        if base is not None:
            self.name = f"{base.name}+{GENERATOR}"
            self.edge_kinds = base.edge_kinds
        self._programs: dict[tuple[str, str], KernelProgram | RecordingError] = {}

    @property
    def judge(self) -> KernelFamily:
        """What a correct kernel is, in the measure worker (which never imports a candidate file):
        the spec's family, else any op's default domain."""
        from torch_kernelize.fill_cache.generators import ANY_OP
        return self.base if self.base is not None else ANY_OP

    def supports(self, spec: KernelSpec) -> str | None:
        return None if any(c.is_for(spec) for c in self.candidates.values()) else "no candidate is for this spec"

    def _candidate(self, config: Config) -> Candidate | None:
        sha = config.get("external")
        if sha is None:
            return None
        if sha not in self.candidates:
            raise UsageError(f"the journal names candidate sha256 {sha}..., which this run was not given: "
                             "give its file with --candidate again, or search without --resume")
        return self.candidates[sha]

    def seed_configs(self, spec: KernelSpec) -> list[Config]:
        own = [c.config for c in self.candidates.values() if c.is_for(spec)]
        return own + (self.base.seed_configs(spec) if self.base is not None else [])

    def evaluations(self, spec: KernelSpec, budget: int) -> int:
        return budget + sum(c.is_for(spec) for c in self.candidates.values())

    def neighbours(self, spec: KernelSpec, config: Config) -> list[Config]:
        if self._candidate(config) is not None or self.base is None:
            return []
        return self.base.neighbours(spec, config)

    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        candidate = self._candidate(config)
        if candidate is None:
            return self.base.generate(spec, config)
        return recorded_once(self._programs, (spec.key, candidate.sha256), lambda: self.record(spec, candidate),
                             candidate.describe())

    def record(self, spec: KernelSpec, candidate: Candidate) -> KernelProgram:
        """The candidate's launches for ``spec``, recorded in a process of its own on two draws of
        inputs that must agree; its source holds only the recorded kernels (candidate_recording.py)."""
        return record_candidate(candidate.path, candidate.sha256, spec, candidate.describe())

    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        if self.base is not None:
            return self.base.sample_inputs(spec, seed, kind, device)
        return super().sample_inputs(spec, seed, kind, device)

    def resolve_ties(self, spec, inputs, outs, refs):
        return self.base.resolve_ties(spec, inputs, outs, refs) if self.base is not None else outs

    def provenance(self, config: Config) -> dict[str, Any]:
        candidate = self._candidate(config)
        if candidate is None:
            return self.base.provenance(config)
        return {"generator": GENERATOR, "candidate": {"file": str(candidate.path), "sha256": candidate.sha256}}


def load_candidates(paths: Sequence[Path]) -> list[Candidate]:
    candidates: dict[str, Candidate] = {}
    for p in paths:
        if not Path(p).is_file():
            raise UsageError(f"--candidate {p}: no such file")
        c = Candidate(p)
        candidates.setdefault(c.sha256, c)
    return list(candidates.values())


def with_candidates(paths: Sequence[Path], work: Sequence[Work]) -> Callable[[KernelSpec], KernelFamily | None]:
    """``family_for`` with the candidate files at ``paths`` joined in: for a spec some candidate
    is for, its CandidateGenerator (one per spec, so that its recordings are kept); else the
    spec's family. Work a candidate is for is searched again even if cached. A candidate that is
    for none of ``work`` is a usage error."""
    candidates = load_candidates(paths)
    for c in candidates:
        if not any(c.is_for(w.spec) for w in work):
            what = f"spec(s) {sorted(c.specs)}" if c.specs is not None else f"op {c.op}"
            raise UsageError(f"--candidate {c.path}: it is for {what}, which no reproducer or model given "
                             "records (the reproducer's task.md names its spec key)")
    for w in work:
        w.candidate = any(c.is_for(w.spec) for c in candidates)
    made: dict[str, KernelFamily | None] = {}

    def family(spec: KernelSpec) -> KernelFamily | None:
        if spec.key not in made:
            own = [c for c in candidates if c.is_for(spec)]
            made[spec.key] = CandidateGenerator(own, family_for(spec)) if own else family_for(spec)
        return made[spec.key]
    return family


# --- check_candidate.py: one candidate against one reproducer, as fill_cache judges it ------------

def check_main(repro: Path, argv: Sequence[str] | None = None) -> int:
    """Exit 0: the candidate is correct (and, on a GPU, its time beside the vendor kernel's);
    1: it is rejected, with the first failing trial; 2: it could not be checked (bad arguments, or
    inputs the op's reference rejects)."""
    from torch_kernelize.fill_cache.collect import read_repro_work
    from torch_kernelize.fill_cache.measure import Measurer
    from torch_kernelize.core.targets import get_target

    p = argparse.ArgumentParser(prog="check_candidate.py", description=check_main.__doc__)
    p.add_argument("candidate", type=Path, help="the candidate file")
    p.add_argument("--target", default=None, help="cuda or interpreter (default: cuda where a GPU is present)")
    p.add_argument("--time", action="store_true", help="also time the accepted candidate on the captured inputs "
                   "(median, and under CUDA-graph replay) against perf.json's time to beat, where there is one; "
                   "needs a GPU")
    args = p.parse_args(argv)
    try:
        target = get_target(args.target or ("cuda" if torch.cuda.is_available() else "interpreter"))
        work = read_repro_work(repro)  # data: the folder's repro.py is not run
        candidate, = load_candidates([args.candidate])
        if not candidate.is_for(work.spec):
            raise UsageError(f"{candidate.describe()} does not say it is for this spec: add "
                             f"SPECS = [{work.spec.key!r}] (or OP = {work.spec.op!r})")
    except (UsageError, ValueError) as e:  # (a ReproProblem is a ValueError)
        print(f"check_candidate: error: {e}", file=sys.stderr)
        return 2
    generator = CandidateGenerator([candidate], family_for(work.spec))
    measurer = Measurer(work.spec, generator, target, [work.captured] if work.captured else [])
    try:
        ev = measurer.evaluate(candidate.config)
        timed = _timed_verdict(repro, measurer, candidate, work, target) if ev.correct and args.time else None
    except InputRejected as e:  # the harness's inputs, not the candidate, are at fault
        print(f"check_candidate: {e}", file=sys.stderr)
        return 2
    finally:  # (the built candidate goes with the builder: timed before)
        measurer.builder.close()
    print(json.dumps({"spec": work.spec.key, "candidate": candidate.describe(), "correct": ev.correct,
                      "error": ev.error, "max_err": (ev.validation or {}).get("max_err"),
                      "candidate_ms": ev.candidate_ms, "vendor_ms": ev.vendor_ms,
                      "speedup": ev.fitness if ev.measured else None}, indent=1))
    print(f"ACCEPTED: correct on every trial of {target.name}" if ev.correct else f"REJECTED: {ev.error}")
    if timed is not None:
        print(timed)
    return 0 if ev.correct else 1


def _timed_verdict(repro: Path, measurer: Measurer, candidate: Candidate, work: Work, target: Target) -> str:
    """check_candidate --time: the candidate's median and CUDA-graph replay times on the captured
    inputs (random ones where none were captured), beside the reproducer's time to beat."""
    perf_path = repro / "perf.json"
    perf = json.loads(perf_path.read_text()) if perf_path.exists() else {}
    beat = perf.get("time_to_beat_us")
    if target.triton != "cuda":
        return (f"TIME: not measured: timing needs a GPU (target {target.name!r} runs kernels through "
                f"{target.triton}); run this with --target cuda on one" + (f" (time to beat: {beat:.3g} us)" if beat else ""))
    from torch_kernelize.core.devices import to_device
    from torch_kernelize.fill_cache.benchmark import graph_replay_ms, median_ms
    _, runner = measurer.build(candidate.config)
    inputs = work.captured or measurer.family.sample_inputs(work.spec, 0, "random", "cpu")
    inputs = [to_device(t, "cuda") if isinstance(t, torch.Tensor) else t for t in inputs]
    median_us = median_ms(lambda: runner(*inputs), rep_ms=200) * 1e3
    replay = graph_replay_ms(lambda: runner(*inputs))
    line = f"TIME: {median_us:.3g} us median" + (f", {replay * 1e3:.3g} us under CUDA-graph replay" if replay else "")
    if not beat:
        return line + " (no perf.json here: nothing to beat)"
    beat_replay = perf.get("graph_replay_us")
    won = median_us < beat and (replay is None or not beat_replay or replay * 1e3 < beat_replay)
    return (line + f"; time to beat {beat:.3g} us" + (f" ({beat_replay:.3g} us replayed)" if beat_replay else "")
            + (": FASTER, hand it back with fill_cache --candidate" if won else ": NOT FASTER"))
