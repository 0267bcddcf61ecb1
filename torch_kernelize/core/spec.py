"""TensorMeta and KernelSpec: what a kernel must compute, keyed by a canonical form.

A KernelSpec names the ATen op (or a fused region's canonical FX code), its non-tensor arguments
and the exact metadata (shape, stride, dtype, device type) of its tensor inputs and outputs. Its
key is a hash of that canonical form, so a cache entry matches only the shapes it was validated
on. A spec can run itself (the vendor op) and rebuild its own float64 CPU reference.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from torch_kernelize.core.encoding import decode_arg, dtype_from_name, dtype_name, encode_arg
from torch_kernelize.core.float64_references import REFERENCES, float64_reference
from torch_kernelize.core.region_graph import run_region_graph
from torch_kernelize.core.targets import op_name, resolve_op

SPEC_VERSION = 1  # bump when the canonical form changes: old cache entries then stop matching
# A spec's ``condition`` when it is served inside a CUDA graph (option ``cudagraphs``) and its op,
# run as given, reads the device on the host (serving/graph_split.py): a capturable kernel then also
# saves the cut and the wait there, so the race is run again, timed as served (fill_cache/benchmark.
# queued_ms), under a key of its own. A spec without one keeps its key from before.
GRAPHED = "graphed"


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str = "cpu"  # device type only: a spec is the same on cuda:0 and cuda:1

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()),
                   dtype_name(t.dtype), t.device.type)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in reversed(list(zip(self.shape, self.stride))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def empty(self, device: str | torch.device | None = None) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.torch_dtype,
                                   device=device if device is not None else self.device)

    def short(self) -> str:
        short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
                 "int64": "i64", "int32": "i32", "bool": "b8", "int8": "i8", "uint8": "u8"}
        return f"{short.get(self.dtype, self.dtype)}[{'x'.join(map(str, self.shape))}]"

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "stride": list(self.stride), "dtype": self.dtype, "device": self.device}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TensorMeta":
        return cls(tuple(d["shape"]), tuple(d["stride"]), d["dtype"], d.get("device", "cpu"))


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What one kernel must compute. ``op`` is an op name like 'aten.gelu.default' or 'region'."""

    op: str
    args: Any              # encoded positional args; tensors appear as {"tensor": i}
    kwargs: Any            # encoded keyword args
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    tuple_output: bool = False   # the op returns a tuple (even of one tensor)
    graph: str | None = None     # canonical JSON of a fused region's nodes (compiling/regions.py)
    condition: str = ""          # how it is served where that changes the winner: "" or GRAPHED

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_call(cls, op: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any,
                  input_metas: Sequence[TensorMeta] | None = None) -> "KernelSpec":
        """From an op call whose tensors (real or fake with concrete sizes) are in args/out.

        ``input_metas`` overrides the metas read off the argument tensors (used when the
        arguments are only metas evaluated from a symbolic graph).
        """
        flat, tree = pytree.tree_flatten((list(args), dict(kwargs)))
        metas, enc = [], []
        for leaf in flat:
            if _is_tensor(leaf) or isinstance(leaf, TensorMeta):
                enc.append({"tensor": len(metas)})
                metas.append(leaf if isinstance(leaf, TensorMeta) else TensorMeta.of(leaf))
            else:
                enc.append(encode_arg(leaf))
        if input_metas is not None:
            metas = list(input_metas)
        eargs, ekwargs = pytree.tree_unflatten(enc, tree)
        tuple_output = isinstance(out, (tuple, list))
        outs = tuple(o if isinstance(o, TensorMeta) else TensorMeta.of(o)
                     for o in (out if tuple_output else (out,)) if o is not None)
        return cls(op_name(op), list(eargs), dict(sorted(ekwargs.items())), tuple(metas), outs,
                   tuple_output)

    # --- identity -------------------------------------------------------------------------------
    def canonical(self) -> dict[str, Any]:
        d = {
            "version": SPEC_VERSION,
            "op": self.op,
            "args": self.args,
            "kwargs": self.kwargs,
            "inputs": [m.to_json() for m in self.inputs],
            "outputs": [m.to_json() for m in self.outputs],
            "tuple_output": self.tuple_output,
        }
        if self.graph is not None:
            d["graph"] = self.graph
        if self.condition:
            d["condition"] = self.condition
        return d

    @functools.cached_property  # a spec is immutable; lowering asks for its key many times
    def key(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    @property
    def short_name(self) -> str:
        """'gelu' for aten.gelu.default; 'region' for a fused region."""
        return self.op.split(".")[1] if self.op.count(".") == 2 else self.op

    @property
    def slug(self) -> str:
        """Readable folder name: op, first input, key prefix."""
        name = self.short_name
        first = self.inputs[0].short() if self.inputs else "noinput"
        safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in f"{name}-{first}")
        return f"{safe}-{self.key[:10]}"

    def describe(self) -> str:
        ins = ", ".join(m.short() for m in self.inputs)
        outs = ", ".join(m.short() for m in self.outputs)
        return f"{self.op}({ins}) -> {outs}" + (f" [{self.condition}]" if self.condition else "")

    def graphed(self) -> "KernelSpec":
        """This spec as served inside a CUDA graph (its GRAPHED key)."""
        return dataclasses.replace(self, condition=GRAPHED)

    def to_json(self) -> dict[str, Any]:
        d = self.canonical()
        d["key"] = self.key
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "KernelSpec":
        if d.get("version", SPEC_VERSION) != SPEC_VERSION:
            raise ValueError(f"spec version {d.get('version')} is not {SPEC_VERSION}")
        spec = cls(d["op"], d["args"], d["kwargs"],
                   tuple(TensorMeta.from_json(m) for m in d["inputs"]),
                   tuple(TensorMeta.from_json(m) for m in d["outputs"]),
                   d.get("tuple_output", False), d.get("graph"), d.get("condition", ""))
        if "key" in d and d["key"] != spec.key:
            raise ValueError(f"spec key {d['key']} does not match its content ({spec.key})")
        return spec

    # --- execution ------------------------------------------------------------------------------
    @property
    def op_overload(self) -> torch._ops.OpOverload:
        return resolve_op(self.op)

    def build_args(self, tensors: Sequence[torch.Tensor], device: str | None = None) -> tuple[list, dict]:
        args = [decode_arg(a, tensors, device) for a in self.args]
        kwargs = {k: decode_arg(v, tensors, device) for k, v in self.kwargs.items()}
        return args, kwargs

    def run_vendor(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run the spec's own op (ATen on the tensors' device); always returns a tuple.

        Where ATen has no kernel for the op on that device (the device-neutral attention of
        compiling/neutral_attention.py has CPU kernels only), the CPU runs it on copies, as the host
        fallback would: references, vendor timings and a disabled kernel's calls still work."""
        if self.graph is not None:
            return tuple(run_region_graph(self, tensors))
        device = tensors[0].device.type if tensors else None
        args, kwargs = self.build_args(tensors, device)
        try:
            out = self.op_overload(*args, **kwargs)
        except NotImplementedError:
            if device in (None, "cpu"):
                raise
            outs = self.run_vendor([t.cpu() for t in tensors])
            return tuple(o.to(tensors[0].device) if isinstance(o, torch.Tensor) else o for o in outs)
        return tuple(out) if self.tuple_output else (out,)

    def reference(self, tensors: Sequence[torch.Tensor], device: str = "cpu") -> tuple[torch.Tensor, ...]:
        """The float64 reference: floating inputs upcast, the op run by ATen in float64.

        On the CPU by default. fill_cache may compute the references of large specs in float64 on
        the GPU (IEEE float64 either way, far below any tolerance; recorded in the validation).
        Outputs stay float64 (integer outputs keep their dtype) for comparison with any dtype.
        """
        up = [t.detach().to(device, upcast_dtype(t)) for t in tensors]
        if self.graph is not None:  # a region's casts (x.float()) must not leave float64
            return tuple(run_region_graph(self, up, reference=True))
        if self.op_overload in REFERENCES:  # an op with no float64 kernel (its args built once, here)
            args, kwargs = self.build_args(up, device)
            written_out = float64_reference(self.op_overload, args)
            if written_out is not None:
                out = written_out(*args, **kwargs)
                return tuple(out) if self.tuple_output else (out,)
        return self.run_vendor(up)

    def make_outputs(self, device: str | torch.device | None = None) -> list[torch.Tensor]:
        return [m.empty(device) for m in self.outputs]


def upcast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of ``t`` in a float64 reference: float64 for floating, complex128 for complex
    (never a cast that drops the imaginary part), its own otherwise."""
    return torch.float64 if t.is_floating_point() else torch.complex128 if t.is_complex() else t.dtype


def tensor_input_nodes(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in KernelSpec order (pytree order of args then kwargs)."""
    flat, _ = pytree.tree_flatten((list(node.args), dict(node.kwargs)))
    return [a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
