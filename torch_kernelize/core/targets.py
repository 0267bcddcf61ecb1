"""Targets: what a chip's vendor library runs, which Triton backend it has, and its fingerprint.

Built-ins: ``cuda`` (ATen CUDA as vendor, Triton compiled for the GPU), ``cpu`` (ATen CPU, no
Triton) and ``interpreter`` (ATen CPU as vendor, Triton kernels run through Triton's CPU
interpreter; this is how CI exercises the Triton tier). A new chip is a small TOML file::

    name = "mychip"
    device = "cpu"            # cpu | cuda: where its tensors live
    triton = "interpreter"    # cuda | interpreter | none
    [ops]
    unsupported = ["aten.gelu", "aten.histc.default"]   # or: supported = [...] (an allow-list)

An op name without an overload ("aten.gelu") covers all its overloads. Optional ceilings, which
the bottleneck ledger divides bytes and FLOPs by (ledger/floors.py)::

    bandwidth_gbs = 3350      # copy bandwidth, GB/s (bytes read + written)
    [tflops]                  # dense matmul rate per dtype, TFLOP/s
    bfloat16 = 989
    float16 = 989
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import platform
import sys
from pathlib import Path
from typing import Any, Iterable

import torch

from torch_kernelize.core.errors import TargetError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEVICES = ("cpu", "cuda")
TRITON_BACKENDS = ("cuda", "interpreter", "none")
HOST_ONLY_SUFFIXES = ("_for_cpu", "_for_cpu_backward")  # op packets ATen runs on CPU tensors only


def op_name(op: Any) -> str:
    """'aten.gelu.default' for an OpOverload; str(target) for anything else."""
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}.{op._overloadname}"
    return getattr(op, "__name__", str(op)) if callable(op) else str(op)


def op_packet_name(op: Any) -> str:
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}"
    return op_name(op)


# Ops of other libraries that a kernel family implements (compiling/op_classes.FAMILY_OPS), by
# the module whose import registers them: a process that never imported it (a build or measure
# worker, a reproducer's check) imports it to resolve the op.
REGISTERED_BY = {"transformers.grouped_mm_fallback.default": "transformers.integrations.moe"}


def resolve_op(name: str) -> torch._ops.OpOverload:
    """'aten.gelu.default' -> torch.ops.aten.gelu.default; raises KeyError naming what is missing."""
    parts = name.split(".")
    if len(parts) != 3:
        raise KeyError(f"{name!r} is not a full op name like 'aten.gelu.default'")
    ns, op, overload = parts
    if name in REGISTERED_BY and not hasattr(getattr(torch.ops, ns), op):
        try:
            importlib.import_module(REGISTERED_BY[name])
        except ImportError as e:
            raise KeyError(f"{name!r} is not a registered operator (its module {REGISTERED_BY[name]} "
                           f"does not import: {e})") from e
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError) as e:
        raise KeyError(f"{name!r} is not a registered operator") from e


def _check_op_names(names: Iterable[str], where: str) -> frozenset[str]:
    out = set()
    for name in names:
        if not isinstance(name, str) or name.count(".") not in (1, 2):
            raise TargetError(f"{where}: {name!r} is not an op name; write 'aten.gelu' or 'aten.gelu.default'")
        ns, op, *overload = name.split(".")
        try:
            packet = getattr(getattr(torch.ops, ns), op)
            if overload:
                getattr(packet, overload[0])
        except (AttributeError, RuntimeError):
            raise TargetError(f"{where}: {name!r} is not a registered PyTorch operator") from None
        out.add(name)
    return frozenset(out)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    device: str
    triton: str
    unsupported: frozenset[str] = frozenset()
    supported: frozenset[str] | None = None  # an allow-list when given
    source: str = "built-in"
    bandwidth_gbs: float | None = None           # the chip file's ceilings (floors of the ledger)
    tflops: tuple[tuple[str, float], ...] = ()    # (dtype, TFLOP/s) pairs

    def __post_init__(self):
        if self.device not in DEVICES:
            raise TargetError(f"target {self.name!r}: device must be one of {DEVICES}, got {self.device!r}")
        if self.triton not in TRITON_BACKENDS:
            raise TargetError(f"target {self.name!r}: triton must be one of {TRITON_BACKENDS}, got {self.triton!r}")
        if self.triton == "cuda" and self.device != "cuda":
            raise TargetError(f"target {self.name!r}: triton = 'cuda' needs device = 'cuda'")
        if self.triton == "interpreter" and self.device != "cpu":
            raise TargetError(f"target {self.name!r}: the Triton interpreter runs on CPU tensors; use device = 'cpu'")

    @property
    def has_triton(self) -> bool:
        return self.triton != "none"

    def vendor_runs(self, op: Any) -> bool:
        """Whether the target's own library runs ``op`` (an OpOverload or other call target)."""
        full, packet = op_name(op), op_packet_name(op)
        if self.device == "cuda" and packet.endswith(HOST_ONLY_SUFFIXES):
            return False  # ATen has CPU kernels only (the device-neutral attention, neutral_attention.py)
        if self.supported is not None:
            return full in self.supported or packet in self.supported
        return full not in self.unsupported and packet not in self.unsupported

    def fingerprint(self) -> dict[str, str]:
        """What a compiled kernel depends on; namespaces the kernel cache."""
        import triton

        if self.device == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            device = f"{torch.cuda.get_device_name()} sm_{major}{minor}"
        else:
            device = f"{platform.machine()} cpu"
        return {
            "triton_backend": self.triton,
            "device": device,
            "torch": torch.__version__.split("+")[0],
            "triton": triton.__version__,
        }

    def fingerprint_id(self) -> str:
        """A readable, filesystem-safe name for the fingerprint: backend-device-hash."""
        fp = self.fingerprint()
        digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
        dev = "".join(c if c.isalnum() else "-" for c in fp["device"]).strip("-").lower()
        return f"{fp['triton_backend']}-{dev}-{digest}"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "device": self.device, "triton": self.triton, "source": self.source,
            "unsupported": sorted(self.unsupported),
            "supported": None if self.supported is None else sorted(self.supported),
        }


BUILTIN_TARGETS: dict[str, Target] = {
    "cuda": Target("cuda", device="cuda", triton="cuda"),
    "cpu": Target("cpu", device="cpu", triton="none"),
    "interpreter": Target("interpreter", device="cpu", triton="interpreter"),
}

_TOP_KEYS = {"name", "device", "triton", "description", "ops", "bandwidth_gbs", "tflops"}
_OPS_KEYS = {"unsupported", "supported"}


def load_target_file(path: str | Path) -> Target:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise TargetError(f"target file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:  # a folder, unreadable, not text
        raise TargetError(f"target file {path} cannot be read as a .toml file: "
                          f"{getattr(e, 'strerror', None) or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise TargetError(f"target file {path} is not valid TOML: {e}") from None
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise TargetError(f"target file {path}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    for key in ("name", "device", "triton"):
        if not isinstance(data.get(key), str):
            raise TargetError(f"target file {path}: '{key}' is required and must be a string")
    ops = data.get("ops", {})
    if not isinstance(ops, dict) or set(ops) - _OPS_KEYS:
        raise TargetError(f"target file {path}: [ops] may only hold {sorted(_OPS_KEYS)}")
    if "unsupported" in ops and "supported" in ops:
        raise TargetError(f"target file {path}: give [ops] 'supported' (allow-list) or 'unsupported', not both")
    for key, value in ops.items():
        if not isinstance(value, list):
            raise TargetError(f"target file {path}: [ops] {key} must be a list of op names")
    where = f"target file {path}"
    supported = _check_op_names(ops["supported"], where) if "supported" in ops else None
    unsupported = _check_op_names(ops.get("unsupported", []), where)
    return Target(name=data["name"], device=data["device"], triton=data["triton"],
                  unsupported=unsupported, supported=supported, source=str(path.resolve()),
                  **_ceilings(data, where))


def _ceilings(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A chip file's optional ``bandwidth_gbs`` and ``[tflops]`` (dtype = TFLOP/s), checked."""
    def positive(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
    bandwidth = data.get("bandwidth_gbs")
    if bandwidth is not None and not positive(bandwidth):
        raise TargetError(f"{where}: bandwidth_gbs must be a positive number (GB/s), got {bandwidth!r}")
    tflops = data.get("tflops", {})
    if not isinstance(tflops, dict) or not all(positive(v) for v in tflops.values()):
        raise TargetError(f"{where}: [tflops] must map dtype names to positive numbers (TFLOP/s), e.g. bfloat16 = 989")
    bad = [k for k in tflops if not isinstance(getattr(torch, k, None), torch.dtype)]
    if bad:
        raise TargetError(f"{where}: [tflops] {bad} are not torch dtype names (float16, bfloat16, float32, ...)")
    return {"bandwidth_gbs": None if bandwidth is None else float(bandwidth),
            "tflops": tuple(sorted((k, float(v)) for k, v in tflops.items()))}


def get_target(spec: str | None, input_device: str | None = None) -> Target:
    """A built-in name, a path to a TOML file, or None (follow the device of the inputs)."""
    if spec is None:
        return BUILTIN_TARGETS["cuda" if input_device == "cuda" else "cpu"]
    if spec in BUILTIN_TARGETS:
        return BUILTIN_TARGETS[spec]
    if spec.endswith(".toml") or Path(spec).exists():
        return load_target_file(spec)
    raise TargetError(f"unknown target {spec!r}: use one of {sorted(BUILTIN_TARGETS)} or a path to a .toml file")
