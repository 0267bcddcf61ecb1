"""The JSON form of a KernelSpec's non-tensor arguments and dtypes (shared by KernelSpec and the
region graphs it may hold)."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


# --- non-tensor arguments <-> JSON -------------------------------------------------------------

def encode_arg(x: Any) -> Any:
    """Canonical JSON form of one non-tensor argument (tensors are replaced before this)."""
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"float": repr(x)}
    if isinstance(x, torch.dtype):
        return {"dtype": dtype_name(x)}
    if isinstance(x, torch.device):
        return {"device": x.type}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    if isinstance(x, (list, tuple)):
        return [encode_arg(v) for v in x]
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TypeError("a KernelSpec needs concrete arguments; evaluate symbolic sizes first")
    raise TypeError(f"cannot put an argument of type {type(x).__name__} in a KernelSpec")


def decode_arg(x: Any, tensors: Sequence[torch.Tensor], device: str | None = None) -> Any:
    if isinstance(x, list):
        return [decode_arg(v, tensors, device) for v in x]
    if isinstance(x, dict):
        (kind, value), = x.items()
        if kind == "tensor":
            return tensors[value]
        if kind == "float":
            return float(value)
        if kind == "dtype":
            return dtype_from_name(value)
        if kind == "device":
            return torch.device(device or value)
        if kind in ("layout", "memory_format"):
            return getattr(torch, value)
        raise ValueError(f"unknown encoded argument {x!r}")
    return x
