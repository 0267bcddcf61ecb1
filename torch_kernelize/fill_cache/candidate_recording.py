"""Record a candidate file's launches in a process of its own; what comes back is data.

A candidate file is code from elsewhere: importing it runs whatever it holds at its top level
(which could, say, patch the validation functions of the process that judges it). So the judging
process never imports it. A spawned Python process imports it, records ``launch`` on two draws of
inputs (lowering/kernels/recording.py) and hands back the recorded KernelProgram as JSON, with a
source that holds only the recorded ``@triton.jit`` functions, the jit functions and constants they
name, and the imports those need: extracted from the file by ``ast``, not by running it. That
source must pass kernel_cache/source_check.py before anything of it is built, validated, timed or
stored; serving and ``verify`` load it like any generated kernel file.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.kernel_cache.source_check import source_problems
from torch_kernelize.lowering.kernels.recording import RecordingError

RECORD_SEEDS = (7, 8)  # the launcher is recorded on two draws: its launches must not depend on values
RECORD_TIMEOUT_S = 600


_recorded: dict[tuple[str, str], KernelProgram | RecordingError] = {}  # (sha256, spec key): per process


def record_candidate(path: Path, sha256: str, spec: KernelSpec, what: str) -> KernelProgram:
    """The candidate at ``path``'s recorded program for ``spec``, from a spawned process (once per
    file content and spec in this process); raises RecordingError saying what went wrong (its
    import, its launches, its kernels' source)."""
    key = (sha256, spec.key)
    if key not in _recorded:
        try:
            _recorded[key] = _record_in_process(path, sha256, spec, what)
        except RecordingError as e:
            _recorded[key] = e
    if isinstance(_recorded[key], RecordingError):
        raise _recorded[key]
    return _recorded[key]


def _record_in_process(path: Path, sha256: str, spec: KernelSpec, what: str) -> KernelProgram:
    with tempfile.TemporaryDirectory(prefix="kernelize-record-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({"path": str(path), "sha256": sha256, "spec": spec.to_json()}))
        try:
            proc = subprocess.run([sys.executable, "-m", __name__, str(request), str(result)], cwd=tmp,
                                  capture_output=True, text=True, timeout=RECORD_TIMEOUT_S,
                                  env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        except subprocess.TimeoutExpired:
            raise RecordingError(f"recording {what} took over {RECORD_TIMEOUT_S} s") from None
        try:
            answer = json.loads(result.read_text())
        except (OSError, ValueError):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            raise RecordingError(f"the process recording {what} ended without a result: {tail[0]}") from None
    if isinstance(answer, dict) and "error" in answer:
        raise RecordingError(str(answer["error"]))
    # the recording process ran the candidate: its answer is checked like anything from elsewhere
    try:
        source, program = answer["source"], KernelProgram.from_json(answer["program"], answer["source"])
    except Exception as e:
        raise RecordingError(f"the process recording {what} answered nonsense ({type(e).__name__}: {e})") from None
    problems = source_problems(source, "the recorded kernels")
    if program.language != "triton" or problems:
        raise RecordingError("the recorded kernels fail the static source check (docs/trust.md): "
                             + (problems[0] if problems else f"a {program.language} program"))
    return program


def kernels_source(source: str, kernels: Sequence[str], filename: str = "candidate") -> str:
    """The part of ``source`` that the ``kernels`` (names of its top-level @triton.jit functions)
    need: those functions, the top-level functions and constants they name (transitively), and
    the imports that bind a name any of them uses. Nothing else of the file is kept."""
    tree = ast.parse(source, filename)
    top: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            top[node.name] = node
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            top.update({t.id: node for t in node.targets})
    keep: list[ast.stmt] = []
    todo, seen = list(kernels), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in top:
            continue
        seen.add(name)
        node = top[name]
        if node not in keep:
            keep.append(node)
        todo += [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    used = {n.id for node in keep for n in ast.walk(node) if isinstance(n, ast.Name)}
    used |= {n.value.id for node in keep for n in ast.walk(node)
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    body = []  # in the file's order; of an import, the names used alone
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used]
            if names:
                body.append(ast.Import(names=names) if isinstance(node, ast.Import) else
                            ast.ImportFrom(module=node.module, names=names, level=node.level))
        elif node in keep:
            body.append(node)
    return ast.unparse(ast.Module(body=body, type_ignores=[])) + "\n"


def _record(request: dict[str, Any]) -> dict[str, Any]:
    """In the spawned process: import the candidate, record it, extract and check its kernels."""
    import hashlib

    import torch

    from torch_kernelize.lowering.kernels import KernelFamily, family_for
    from torch_kernelize.lowering.kernels.recording import record_program
    from torch_kernelize.core.source_module import load_source_module

    path, spec = Path(request["path"]), KernelSpec.from_json(request["spec"])
    source = path.read_text()
    if hashlib.sha256(source.encode()).hexdigest() != request["sha256"]:
        return {"error": f"{path} changed while fill_cache ran (its sha256 is not the one it started with)"}
    name = f"kernelize_candidate_{request['sha256'][:16]}"
    try:  # from its text, never from bytecode beside it (core/source_module.py)
        module = load_source_module(path, name)
    except Exception as e:
        return {"error": f"importing it failed: {type(e).__name__}: {e}"}
    launch = getattr(module, "launch", None)
    if not callable(launch):
        return {"error": "it defines no launch(*args)"}
    family = family_for(spec) or KernelFamily()
    # on the spec's device where there is one (a launcher may allocate there); nothing runs
    device = spec.inputs[0].device if spec.inputs else "cpu"
    device = device if device == "cpu" or torch.cuda.is_available() else "cpu"
    programs = []
    try:
        for seed in RECORD_SEEDS:
            inputs = family.sample_inputs(spec, seed, "random", device)
            programs.append(record_program(launch, inputs, spec, source, module))
    except RecordingError as e:
        return {"error": str(e)}
    if programs[0].describe() != programs[1].describe():
        return {"error": "launch() made different launches for two inputs of the same shapes, strides and "
                         "dtypes: what it launches may depend only on those (the program is recorded once "
                         "and replayed for every input)"}
    kernels = kernels_source(source, sorted({l.kernel for l in programs[0].launches}), path.name)
    return {"program": programs[0].to_json(), "source": kernels}


def main(argv: Sequence[str]) -> int:
    request, result = argv
    try:
        answer = _record(json.loads(Path(request).read_text()))
    except Exception as e:  # the candidate's fault or an unreadable file: said as the recording's error
        answer = {"error": f"recording failed: {type(e).__name__}: {e}"}
    Path(result).write_text(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
