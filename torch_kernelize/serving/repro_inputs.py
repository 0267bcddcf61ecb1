"""Read a reproducer folder as data: spec.json and the captured inputs in its content store.

A folder may come from elsewhere (someone sent it), so the tools (fill_cache --repros,
check_candidate.py, task.md, replay) never execute its repro.py, which stays a standalone script
for people. The inputs were saved by torch's ``generate_compiler_repro_string(..., save_dir=)``:
``repro.py``'s ``load_args`` names each storage (its sha1 in ``inputs/storages/``) and each tensor
over it. That function is parsed, not run: only ``reader.storage(...)`` and ``reader.tensor(...)``
calls with literal arguments are accepted. Every storage read is hashed again and every tensor
checked against the spec's input metas; a folder that fails a check raises ReproProblem.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import torch

INPUTS_DIR = "inputs"


class ReproProblem(ValueError):
    """A reproducer folder's files fail their checks; the message says which and how."""


def read_meta(folder: Path) -> dict[str, Any]:
    """spec.json of the reproducer in ``folder``."""
    try:
        meta = json.loads((Path(folder) / "spec.json").read_text())
    except (OSError, ValueError) as e:
        raise ReproProblem(f"spec.json unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise ReproProblem("spec.json is not an object")
    return meta


def read_inputs(folder: Path, spec: Any = None) -> list[torch.Tensor]:
    """The captured inputs of the reproducer in ``folder`` (CPU tensors with their strides), checked
    against the content store's hashes and, given a KernelSpec, against its input metas."""
    from torch._dynamo.debug_utils import InputReader
    from torch.utils._content_store import hash_storage

    folder = Path(folder)
    store = folder / INPUTS_DIR
    if not store.is_dir():
        raise ReproProblem(f"{INPUTS_DIR}/ is missing: the captured inputs are gone")
    storages, tensors = _load_plan(folder / "repro.py")
    reader = InputReader(save_dir=str(store))
    buffers = {}
    for name, (digest, nbytes) in storages.items():
        if not (store / "storages" / digest).is_file():  # (InputReader would make up random data)
            raise ReproProblem(f"{INPUTS_DIR}/storages/{digest} is missing")
        try:
            storage = reader.store.read_storage(digest, device="cpu")  # torch.load(weights_only=True)
        except Exception as e:
            raise ReproProblem(f"{INPUTS_DIR}/storages/{digest} unreadable ({type(e).__name__}: {e})") from None
        if storage.nbytes() != nbytes or hash_storage(storage, stable_hash=True) != digest:
            raise ReproProblem(f"{INPUTS_DIR}/storages/{digest} does not hold what its name (a sha1) says")
        buffers[name] = storage
    for buf, shape, stride, offset, dtype in tensors:
        span = sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else 0
        if (offset + span) * dtype.itemsize > buffers[buf].nbytes():
            raise ReproProblem(f"a captured input {list(shape)} reaches past its storage")
        reader.tensor(buffers[buf], shape, stride, storage_offset=offset, dtype=dtype, is_leaf=True)
    if spec is not None:
        _check_metas(reader.args, spec)
    return list(reader.args)


def _check_metas(inputs: list[torch.Tensor], spec: Any) -> None:
    if len(inputs) != len(spec.inputs):
        raise ReproProblem(f"{len(inputs)} captured input(s); the spec has {len(spec.inputs)}")
    for i, (t, m) in enumerate(zip(inputs, spec.inputs)):
        if tuple(t.shape) != tuple(m.shape) or t.dtype != m.torch_dtype:
            raise ReproProblem(f"captured input {i} is {t.dtype}{list(t.shape)}; the spec says "
                               f"{m.dtype}{list(m.shape)}")


def _load_plan(script: Path) -> tuple[dict[str, tuple[str, int]], list[tuple]]:
    """repro.py's ``load_args`` as data: {buffer: (sha1, nbytes)} and the tensors over them."""
    try:
        tree = ast.parse(script.read_text())
    except (OSError, SyntaxError, ValueError) as e:
        raise ReproProblem(f"repro.py unreadable ({e})") from None
    body = next((n.body for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "load_args"), None)
    if body is None:
        raise ReproProblem("repro.py has no load_args: the captured inputs are not described")
    storages: dict[str, tuple[str, int]] = {}
    tensors = []
    for stmt in body:
        call = stmt.value if isinstance(stmt, (ast.Assign, ast.Expr)) else None
        what = _reader_call(call)
        if what == "storage" and isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            digest, nbytes = (_literal(a) for a in call.args[:2])
            if not (isinstance(digest, str) and digest.isalnum() and isinstance(nbytes, int)):
                raise ReproProblem(f"repro.py line {stmt.lineno}: a storage is not (sha1, nbytes)")
            storages[stmt.targets[0].id] = (digest, nbytes)
        elif what == "tensor" and call.args and isinstance(call.args[0], ast.Name) and call.args[0].id in storages:
            tensors.append(_tensor_plan(call))
        elif not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):  # a docstring
            raise ReproProblem(f"repro.py line {stmt.lineno}: load_args does more than read stored tensors "
                               "(it is read as data, never run)")
    return storages, tensors


def _reader_call(node: Any) -> str | None:
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "reader"):
        return node.func.attr
    return None


def _tensor_plan(call: ast.Call) -> tuple:
    shape = _literal(call.args[1]) if len(call.args) > 1 else None
    stride = _literal(call.args[2]) if len(call.args) > 2 else None
    kw = {k.arg: k.value for k in call.keywords}
    offset = _literal(kw["storage_offset"]) if "storage_offset" in kw else 0
    dtype = _dtype(kw["dtype"]) if "dtype" in kw else torch.float32
    if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise ReproProblem(f"repro.py line {call.lineno}: a tensor's shape is not a tuple of sizes")
    if stride is None:
        stride = tuple(torch.empty(shape, device="meta").stride())
    if not (isinstance(stride, tuple) and len(stride) == len(shape) and all(isinstance(s, int) and s >= 0
                                                                            for s in stride)
            and isinstance(offset, int) and offset >= 0):
        raise ReproProblem(f"repro.py line {call.lineno}: a tensor's strides or offset are not sizes")
    return call.args[0].id, shape, stride, offset, dtype


def _literal(node: Any) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError) as e:
        raise ReproProblem(f"repro.py line {getattr(node, 'lineno', '?')}: not a literal ({e})") from None


def _dtype(node: Any) -> torch.dtype:
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
            and isinstance(getattr(torch, node.attr, None), torch.dtype)):
        return getattr(torch, node.attr)
    raise ReproProblem(f"repro.py line {getattr(node, 'lineno', '?')}: a dtype is not torch.<dtype>")
