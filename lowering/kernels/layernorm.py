"""aten.native_layer_norm.default: (out, mean, rstd) over the trailing ``normalized_shape`` dims.

    mean = sum(x) / N,  d = x - mean,  var = sum(d * d) / N (biased),  rstd = 1 / sqrt(var + eps)
    out  = d * rstd [* weight] [+ bias]

The op is generated as a rowwise region (fused.py) written from this definition: the input seen
as [rows, N] (N = prod(normalized_shape); the normalized dims must form one strided run, as they
do for any dense layout), every step in fp32, the variance in two passes over the row held in
registers (exact, no E[x^2] - E[x]^2 cancellation). ``out`` is rounded once to its dtype; mean
and rstd are stored in the dtypes the spec gives (fp32 on CUDA for fp16/bf16 inputs, the input
dtype on CPU). Rows longer than 16K elements take three passes (mean, variance, output).
A shape bucket over the leading dims takes the number of rows at run time (``n_rows``).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels import fused
from torch_kernelize.lowering.kernels.base import Config, KernelFamily, to_device
from torch_kernelize.core.buckets import product
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.spec import KernelSpec, TensorMeta

OP = "aten.native_layer_norm.default"


def _meta(shape: tuple[int, ...], stride: tuple[int, ...], dtype: str) -> dict[str, Any]:
    return TensorMeta(tuple(shape), tuple(stride), dtype).to_json()


class LayerNormFamily(KernelFamily):
    name = "layernorm"
    ops = frozenset({OP})
    edge_kinds = ("zeros", "large", "negative", "special")

    def _analyse(self, spec: KernelSpec):
        """(fused plan, region graph) or the reason the spec is not generated."""
        args = cg.bind(spec)
        ix = cg.tensor_index(args.get("input"))
        if ix is None:
            return "input must be a tensor"
        x = spec.inputs[ix]
        norm = args.get("normalized_shape")
        if not isinstance(norm, list) or not all(isinstance(s, int) for s in norm):
            return f"normalized_shape {norm!r} is not a list of sizes"
        k = len(norm)
        if k == 0 or k > len(x.shape) or list(x.shape[len(x.shape) - k:]) != norm:
            return f"normalized_shape {norm} does not match the input {list(x.shape)}"
        eps = cg.scalar_value(args.get("eps"))
        if eps is None or isinstance(eps, bool):
            return f"eps {args.get('eps')!r} is not a number"
        if len(spec.outputs) != 3:
            return f"expected (out, mean, rstd), got {len(spec.outputs)} outputs"
        y, mean, rstd = spec.outputs
        if x.dtype not in cg.FLOAT_TYPES or any(m.dtype not in cg.FLOAT_TYPES for m in spec.outputs):
            return f"dtypes {x.dtype} -> {[m.dtype for m in spec.outputs]} (fp32/fp16/bf16 only)"
        lead = tuple(x.shape[:len(x.shape) - k])
        if tuple(y.shape) != tuple(x.shape) or tuple(mean.shape) != lead + (1,) * k or tuple(rstd.shape) != tuple(mean.shape):
            return f"output shapes {[m.shape for m in spec.outputs]} do not match the input {x.shape}"
        affine: dict[str, int] = {}
        for name in ("weight", "bias"):
            i = cg.tensor_index(args.get(name))
            if args.get(name) is not None and i is None:
                return f"{name} must be a tensor or None"
            if i is not None:
                m = spec.inputs[i]
                if list(m.shape) != norm:
                    return f"{name} shape {list(m.shape)} is not normalized_shape {norm}"
                if m.dtype not in cg.FLOAT_TYPES:
                    return f"{name} dtype {m.dtype} is not fp32/fp16/bf16"
                affine[name] = i
        N = math.prod(norm)
        if N < 2 or x.numel == 0:
            return f"nothing to normalize (rows of {N}, {x.numel} elements)"

        # the normalized dims as one run: N elements with one stride per tensor
        tail = lambda m: tuple(m.stride[len(m.shape) - k:])
        full_metas = [x, y] + [spec.inputs[i] for i in affine.values()]
        sizes, strides = cg.simplify(norm, [tail(m) for m in full_metas], order_by=None)
        if len(sizes) != 1:
            return "the normalized dims are not one strided run in every tensor"
        col = {id(m): st[0] for m, st in zip(full_metas, strides)}
        lead_stride = lambda m: tuple(m.stride[:len(lead)])

        view = lambda m, c: _meta(lead + (N,), lead_stride(m) + (c,), m.dtype)
        row_view = lambda m: TensorMeta(lead + (1,), lead_stride(m) + (1,), m.dtype)
        in_metas: list[TensorMeta | None] = [None] * len(spec.inputs)
        in_metas[ix] = TensorMeta.from_json(view(x, col[id(x)]))
        for i in affine.values():
            m = spec.inputs[i]
            in_metas[i] = TensorMeta((N,), (col[id(m)],), m.dtype)
        if any(m is None for m in in_metas):
            return "an input is neither the input, the weight nor the bias"
        out_metas = [TensorMeta.from_json(view(y, col[id(y)])), row_view(mean), row_view(rstd)]

        full32 = _meta(lead + (N,), cg.contiguous_strides(lead + (N,)), "float32")
        row = lambda dtype: _meta(lead + (1,), cg.contiguous_strides(lead + (1,)), dtype)
        X = {"input": ix}
        nodes = [
            {"op": "aten.mean.dim", "args": [X, [-1], True], "kwargs": {}, "meta": row(mean.dtype)},      # 0 mean
            {"op": "aten.sub.Tensor", "args": [X, {"node": 0}], "kwargs": {}, "meta": full32},           # 1 d
            {"op": "aten.mul.Tensor", "args": [{"node": 1}, {"node": 1}], "kwargs": {}, "meta": full32},  # 2 d * d
            {"op": "aten.mean.dim", "args": [{"node": 2}, [-1], True], "kwargs": {}, "meta": row("float32")},  # 3 var
            {"op": "aten.add.Tensor", "args": [{"node": 3}, float(eps)], "kwargs": {}, "meta": row("float32")},
            {"op": "aten.rsqrt.default", "args": [{"node": 4}], "kwargs": {}, "meta": row(rstd.dtype)},   # 5 rstd
            {"op": "aten.mul.Tensor", "args": [{"node": 1}, {"node": 5}], "kwargs": {}, "meta": full32},  # 6
        ]
        for name, op in (("weight", "aten.mul.Tensor"), ("bias", "aten.add.Tensor")):
            if name in affine:
                nodes.append({"op": op, "args": [{"node": len(nodes) - 1}, {"input": affine[name]}], "kwargs": {},
                              "meta": full32})
        nodes[-1]["meta"] = _meta(lead + (N,), cg.contiguous_strides(lead + (N,)), y.dtype)
        graph = {"kind": "rowwise", "nodes": nodes, "outputs": [len(nodes) - 1, 0, 5]}
        plan = fused.analyse(graph, in_metas, out_metas)
        if isinstance(plan, str):
            return plan
        return plan, graph

    def _valid(self, got, config: Config) -> bool:
        return fused.rowwise_valid(got[0], config)

    def _seeds(self, spec: KernelSpec, got) -> list[Config]:
        return fused.rowwise_seeds(got[0])

    def _steps(self, got, config: Config) -> list[Config]:
        return fused.rowwise_neighbours(got[0], config)

    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        return self._program(spec, config)

    def _program(self, spec: KernelSpec, config: Config, rows: Any = None) -> KernelProgram:
        plan, graph = self.checked_plan(spec, config)
        header = cg.describe_spec(spec) + "\n# computed as the rowwise region below (two-pass variance, fp32)"
        return fused.generate_plan(plan, graph, config, header, "layer_norm_kernel", runtime_rows=rows)

    # --- shape buckets ------------------------------------------------------------------------
    def bucket_support(self, spec: KernelSpec, dims) -> str | None:
        """Buckets over the rows: contiguous input and outputs, only leading (not normalized) dims
        varying, each with the same variable in the input, ``out``, ``mean`` and ``rstd``; the
        weight and bias fixed."""
        got = self.plan(spec)
        if isinstance(got, str):
            return got
        args = cg.bind(spec)
        ix = cg.tensor_index(args.get("input"))
        lead = len(spec.inputs[ix].shape) - len(args["normalized_shape"])
        for side, metas in (("in", spec.inputs), ("out", spec.outputs)):
            for i, m in enumerate(metas):
                if not m.is_contiguous():
                    return f"{side}put {i} is not contiguous: its strides are no function of its sizes"
        if any(side == "in" and i != ix for side, i, _, _ in dims):
            return "the weight or bias varies: only the input's rows may"
        var_in = {d: v for side, i, d, v in dims if side == "in"}
        if bad := sorted(d for d in var_in if d >= lead):
            return f"input dim(s) {bad} vary but are normalized: the row length is literal in the kernel"
        for k in range(len(spec.outputs)):
            if {d: v for side, i, d, v in dims if side == "out" and i == k} != var_in:
                return f"output {k} varies in other dims than the input's rows"
        return fused.rowwise_bucket_problem(got[0])

    def generate_bucketed(self, spec: KernelSpec, config: Config, dims) -> KernelProgram:
        """The kernel of ``generate`` with the number of rows a run-time argument ``n_rows``
        (int64 indexing decided at the representative, the bucket's largest size)."""
        problem = self.bucket_support(spec, dims)
        if problem is not None:
            raise ValueError(f"{spec.describe()} cannot be bucketed: {problem}")
        args = cg.bind(spec)
        x = spec.inputs[cg.tensor_index(args.get("input"))]
        var_of = {d: v for side, i, d, v in dims if side == "in"}
        lead = len(x.shape) - len(args["normalized_shape"])
        return self._program(spec, config, product([f"v{var_of[d]}" if d in var_of else x.shape[d] for d in range(lead)]))

    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        inputs = super().sample_inputs(spec, seed, kind, device)
        if kind == "special":
            # ATen's (Welford) mean of a row holding +-inf is inf or NaN depending on where the inf
            # falls in its processing order; this kernel's sum gives inf. Rows with NaN still test
            # propagation: infinities become NaN here (as the reductions family does for var_mean).
            for t in inputs:
                if t.is_floating_point() and t.numel():
                    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
                    flat = torch.as_strided(t, (span,), (1,), t.storage_offset())
                    flat.copy_(torch.where(flat.isinf(), torch.full_like(flat, float("nan")), flat))
        return [to_device(t, device) for t in inputs]


FAMILY = LayerNormFamily()
