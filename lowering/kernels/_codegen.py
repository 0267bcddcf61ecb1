"""Shared code generation helpers for the pointwise, reduction and histogram families.

Sizes and strides are concrete (a KernelSpec is per shape), so the generators bake them into the
source as literals; these helpers keep that arithmetic in one place:

- dtype names: torch name <-> ``tl.*`` type, the compute type of a storage type;
- argument binding: the one schema binder (a spec's or a region node's encoded args/kwargs ->
  {schema name: value} with defaults filled in), and typed reads of bound tensors and dims;
- layouts: broadcast strides, dropping size-1 dims, ordering dims by a layout, collapsing dims
  that are contiguous in every tensor, and the index arithmetic (div/mod by literals) that turns
  a flat index into one offset per tensor, and tensors seen as rows along a dim (topk, sort);
- a small source writer so that generated kernels are indented and commented like hand code.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Sequence

from torch_kernelize.core.targets import resolve_op
from torch_kernelize.core.spec import KernelSpec, TensorMeta

TL_TYPES = {
    "float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16", "float64": "tl.float64",
    "int64": "tl.int64", "int32": "tl.int32", "int16": "tl.int16", "int8": "tl.int8", "uint8": "tl.uint8",
    "bool": "tl.int1",
}
FLOAT_TYPES = ("float32", "float16", "bfloat16")     # what the families compute on (fp32 math)
HALF = {"float16": "tl.float16", "bfloat16": "tl.bfloat16"}   # 16-bit floats: stored, computed in fp32
INT_TYPES = ("int64", "int32", "int16", "int8", "uint8")
INT32_MAX = 2**31 - 1


def tl_type(dtype: str) -> str:
    return TL_TYPES[dtype]


def is_float(dtype: str) -> bool:
    return dtype in ("float32", "float16", "bfloat16", "float64")


def is_int(dtype: str) -> bool:
    return dtype in INT_TYPES


def compute_type(dtype: str) -> str:
    """The type arithmetic runs in for values stored as ``dtype``: fp32 for low-precision floats."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def float_literal(value: float) -> str:
    """A float as source triton reads as a float (``float('inf')`` works inside @triton.jit too)."""
    value = float(value)
    if math.isnan(value):
        return "float('nan')"
    if math.isinf(value):
        return "float('inf')" if value > 0 else "-float('inf')"
    text = repr(value)
    return text if any(c in text for c in ".en") else text + ".0"


def literal(value: Any, dtype: str) -> str:
    """``value`` as a literal for arithmetic in ``dtype`` (int for integer types, else float)."""
    if is_float(dtype):
        return float_literal(value)
    return str(int(value))


# --- arguments ---------------------------------------------------------------------------------

class Unsupported(ValueError):
    """Why a spec is not generated, raised from inside an analysis (KernelFamily.plan returns the
    message as the reason, like any other)."""


class ArgumentError(Unsupported):
    """Arguments that do not fit their op's schema (a spec or region node no family generates)."""


def bind_arguments(op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call of ``op`` (a full op name) by schema name, defaults filled in (None
    where a parameter has neither value nor default). Values stay as given: encoded, as in a
    KernelSpec ({"tensor": i}) or a region node ({"input": i}, {"node": j}). An ArgumentError for
    an unknown op, more positional arguments than parameters, or an unknown keyword."""
    try:
        schema = resolve_op(op)._schema
    except Exception:  # noqa: BLE001 - any failure means the op is unknown here
        raise ArgumentError(f"unknown op {op}") from None
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise ArgumentError(f"{op}: {len(args)} positional arguments for {len(positional)} parameters")
    unknown = set(kwargs) - {a.name for a in schema.arguments}
    if unknown:
        raise ArgumentError(f"{op}: unknown keyword arguments {sorted(unknown)}")
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def bind(spec: KernelSpec) -> dict[str, Any]:
    """The spec's arguments by schema name (``bind_arguments``; tensors are {"tensor": i})."""
    return bind_arguments(spec.op, spec.args, spec.kwargs)


def operand(spec: KernelSpec, name: str, dtypes: Sequence[str]) -> tuple[dict[str, Any], TensorMeta]:
    """The spec's arguments (``bind``) and the meta of its tensor argument ``name``; Unsupported
    when that is no tensor, or a tensor of a dtype not in ``dtypes``."""
    args = bind(spec)
    i = tensor_index(args.get(name))
    if i is None:
        raise Unsupported(f"{name} must be a tensor")
    x = spec.inputs[i]
    if x.dtype not in dtypes:
        raise Unsupported(f"{spec.short_name} of dtype {x.dtype} is not generated ({'/'.join(dtypes)})")
    return args, x


def dim_arg(value: Any, ndim: int) -> int | str:
    """A dim argument of a ``ndim``-d tensor, wrapped to [0, ndim) (0 for a 0-d one), or why it is none."""
    n = max(ndim, 1)
    if not isinstance(value, int) or isinstance(value, bool) or not -n <= value < n:
        return f"bad dim {value!r}"
    return value % n


def tensor_index(value: Any) -> int | None:
    """The input index of an encoded tensor argument, else None."""
    if isinstance(value, dict) and set(value) == {"tensor"}:
        return int(value["tensor"])
    return None


def scalar_value(value: Any) -> float | int | bool | None:
    """A Python number from an encoded scalar argument (None if it is not one)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, dict) and set(value) == {"float"}:
        return float(value["float"])
    return None


def dtype_arg(value: Any) -> str | None:
    if isinstance(value, dict) and set(value) == {"dtype"}:
        return value["dtype"]
    return None


# --- layouts -----------------------------------------------------------------------------------

def broadcast_strides(meta: TensorMeta, shape: Sequence[int]) -> tuple[int, ...]:
    """``meta``'s strides seen as a tensor of ``shape`` (trailing alignment, stride 0 where broadcast)."""
    lead = len(shape) - len(meta.shape)
    if lead < 0:
        raise ValueError(f"cannot broadcast {meta.shape} to {tuple(shape)}")
    strides = [0] * lead
    for size, stride, target in zip(meta.shape, meta.stride, shape[lead:]):
        if size == target:
            strides.append(stride if size != 1 else 0)
        elif size == 1:
            strides.append(0)
        else:
            raise ValueError(f"cannot broadcast {meta.shape} to {tuple(shape)}")
    return tuple(strides)


def contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def simplify(sizes: Sequence[int], stride_sets: Sequence[Sequence[int]],
             order_by: int | None = 0) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Drop size-1 dims, order dims by tensor ``order_by``'s strides (largest first), then merge
    neighbouring dims that are contiguous with each other in every tensor.

    The result iterates the same elements; with ``order_by`` the flat index walks that tensor's
    memory in order (coalesced writes for the output, or coalesced reads for a reduction input).
    """
    dims = [d for d, s in enumerate(sizes) if s != 1]
    if order_by is not None:
        key = stride_sets[order_by]
        # stable: equal strides keep their logical order
        dims.sort(key=lambda d: -key[d])
    sz = [sizes[d] for d in dims]
    st = [[ss[d] for d in dims] for ss in stride_sets]
    k = 0
    while k + 1 < len(sz):
        if all(s[k] == s[k + 1] * sz[k + 1] for s in st):
            sz[k] *= sz[k + 1]
            for s in st:
                s[k] = s[k + 1]
                del s[k + 1]
            del sz[k + 1]
        else:
            k += 1
    return tuple(sz), [tuple(s) for s in st]


@dataclasses.dataclass(frozen=True)
class Rows:
    """Tensors of one shape seen as M rows (the other dims, merged where contiguous) by N along a dim."""
    M: int
    N: int
    m_sizes: tuple[int, ...]
    m_strides: list[tuple[int, ...]]   # one stride set per tensor, over m_sizes
    n_strides: tuple[int, ...]         # each tensor's stride along the dim
    wide: bool                         # offsets (up to twice a dim's reach) need int64


def rows_along(metas: Sequence[TensorMeta], d: int) -> Rows:
    """``metas`` (same shape; the first orders the merge) as rows along dim ``d`` (normalized)."""
    shape = metas[0].shape
    keep = [j for j in range(len(shape)) if j != d]
    m_sizes, m_strides = simplify([shape[j] for j in keep], [tuple(m.stride[j] for j in keep) for m in metas],
                                  order_by=0)
    wide = any(2 * (max_offset(m.shape, m.stride) + sum(abs(s) for s in m.stride)) + 2 > INT32_MAX for m in metas)
    return Rows(math.prod(shape[j] for j in keep), shape[d], m_sizes, m_strides, tuple(m.stride[d] for m in metas),
                wide)


def as_1d(meta: TensorMeta) -> TensorMeta:
    """A 0-d tensor as 1-d of one element (shape (1,), stride (1,)), as ATen's ops along a dim
    see it (sort, topk, gather, scatter_add: dim 0 or -1 of size 1); any other as it is."""
    return dataclasses.replace(meta, shape=(1,), stride=(1,)) if not meta.shape else meta


def max_offset(sizes: Sequence[int], strides: Sequence[int]) -> int:
    return sum((s - 1) * abs(st) for s, st in zip(sizes, strides))


def needs_int64(sizes: Sequence[int], stride_sets: Iterable[Sequence[int]], slack: int = 0) -> bool:
    """Whether offsets or the flat index (plus ``slack``, e.g. a block) can pass int32."""
    if math.prod(sizes) + slack > INT32_MAX:
        return True
    return any(max_offset(sizes, st) + slack > INT32_MAX for st in stride_sets)


def decompose(index: str, sizes: Sequence[int], stride_sets: Sequence[Sequence[int]],
              prefix: str) -> tuple[list[str], list[str]]:
    """Lines splitting flat ``index`` over ``sizes`` (row-major) and one offset expression per stride set.

    A tensor whose strides are the row-major strides of ``sizes`` gets ``index`` itself; a tensor
    with all strides 0 gets "0" (a broadcast scalar). Only coordinates some tensor needs are made.
    """
    n = len(sizes)
    flat = contiguous_strides(sizes)
    coord = {0: index} if n == 1 else {k: f"{prefix}{k}" for k in range(n)}
    offsets, used = [], set()
    for st in stride_sets:
        if n == 0 or all(s == 0 for s in st):
            offsets.append("0")
        elif tuple(st) == flat:
            offsets.append(index)
        else:
            terms = [scaled(coord[k], s) for k, s in enumerate(st) if s != 0]
            used.update(k for k, s in enumerate(st) if s != 0)
            offsets.append(" + ".join(terms))
    lines = []
    if n > 1:
        for k in sorted(used):
            inner = math.prod(sizes[k + 1:])
            if k == 0:
                expr = f"{index} // {inner}"
            elif inner == 1:
                expr = f"{index} % {sizes[k]}"
            else:
                expr = f"({index} // {inner}) % {sizes[k]}"
            lines.append(f"{coord[k]} = {expr}")
    return lines, offsets


def block_offsets(s: "Source", index: str, program: str, block: str, size: int, n: int | str, wide: bool,
                  mask: str, sizes: Sequence[int], stride_sets: Sequence[Sequence[int]],
                  prefix: str) -> tuple[list[str], str | None]:
    """Emit a program's block of flat indices, ``index = program * block + tl.arange(0, block)``
    (``block`` the constexpr, ``size`` its value; int64 when ``wide``), the ``mask`` of those
    below ``n`` where blocks overrun it, and the split of ``index`` over ``sizes`` (``decompose``).
    ``n`` may name a run-time argument (a shape bucket's size): then every block is masked.
    Returns the offset of each stride set and the mask's name (None when every index is in range)."""
    s(f"{index} = {program}{'.to(tl.int64)' if wide else ''} * {block} + tl.arange(0, {block})")
    masked = isinstance(n, str) or n % size != 0
    if masked:
        s(f"{mask} = {index} < {n}")
    lines, offs = decompose(index, sizes, stride_sets, prefix)
    for line in lines:
        s(line)
    return offs, mask if masked else None


def as_block(offset: str, index: str) -> str:
    """``offset`` (of ``decompose``/``block_offsets``) as a block like ``index``'s.

    An offset with no term left is "0": a tensor broadcast over the whole block, or one of a
    single element (a 0-d or one-element walk, where every size-1 dim is dropped, so no offset
    names the index at all). A pointer built from it is a scalar, and the Triton interpreter
    (like the compiler) refuses a block value stored through a scalar pointer, or a block mask
    on one ('Value/Mask argument cannot be block type if pointer argument is not a block').
    Such an offset becomes ``index * 0``: every lane the same address, the pointer a block.
    An offset with a term is returned as it is. Use it where a block value is stored (or added)
    through the pointer or a block mask applied; an unmasked load may stay a scalar (a broadcast)."""
    return f"{index} * 0" if offset == "0" else offset


def runtime_size(args: tuple, n: int, expr: Any, block: int, wide: bool) -> tuple[tuple, dict[str, Any]]:
    """A launch of one program per ``block`` of a size taken at run time (a shape bucket's: the
    SizeExpr ``expr``, ``n`` at the representative): its arguments, ``args`` and the size (i64 if
    ``wide``), and its ``runtime_sizes`` (the grid ``cdiv(expr, block)`` and that argument)."""
    args = args + (("i64" if wide else "i32", n),)
    return args, {"grid": [["cdiv", expr, block]], "args": {str(len(args) - 1): expr}}


def scaled(expr: str, stride: int) -> str:
    """``expr * stride`` without the noise of 0 and 1."""
    if stride == 0:
        return "0"
    if stride == 1:
        return expr
    return f"{expr} * {stride}"


# --- source -----------------------------------------------------------------------------------

class Source:
    """Builds an indented Python/Triton module, line by line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._indent = 0

    def __call__(self, *lines: str) -> "Source":
        for text in lines:
            for line in text.split("\n"):
                self.lines.append(("    " * self._indent + line) if line else "")
        return self

    def indent(self) -> "Source":
        self._indent += 1
        return self

    def dedent(self) -> "Source":
        self._indent -= 1
        return self

    def blank(self) -> "Source":
        if self.lines and self.lines[-1] != "":
            self.lines.append("")
        return self

    def text(self) -> str:
        return "\n".join(self.lines).rstrip() + "\n"


HEADER = "import triton\nimport triton.language as tl\n"


def first_arrival_add(programs: int) -> int:
    """What program 0 adds to a grid barrier's int32 semaphore: 2^31 - (programs - 1), wrapped to
    int32, so that with the others' 1 each the sum is 2^31 (the sign bit flips, the rest stays)."""
    v = (2**31 - (programs - 1)) % 2**32
    return v - 2**32 if v >= 2**31 else v


def grid_barrier_source(programs: int) -> str:
    """``_grid_barrier(sem_ptr)``: each program of a grid of ``programs`` waits there until all have
    arrived (a grid-synchronized launch: see program.py; the cooperative launch guarantees they are
    all resident). The int32 semaphore starts at zero and is never reset: each barrier flips its
    sign bit exactly when the last program arrives and leaves its other bits as they were, ready
    for the next barrier; a program waits for the flip of the sign bit it saw on arrival. Stores
    before the barrier are released by the arrival and acquired by the wait (gpu scope)."""
    return f'''
@triton.jit
def _grid_barrier(sem_ptr):
    tl.debug_barrier()  # every thread of the program has issued its stores
    arrived = tl.atomic_add(sem_ptr, tl.where(tl.program_id(0) == 0, {first_arrival_add(programs)}, 1),
                            sem="release", scope="gpu")
    now = tl.atomic_add(sem_ptr, 0, sem="acquire", scope="gpu")
    while (arrived ^ now) >= 0:  # the sign bit has not flipped: not everyone is here yet
        now = tl.atomic_add(sem_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
'''


def describe_spec(spec: KernelSpec) -> str:
    """A comment block naming the spec (op, argument values, metas) at the top of a module."""
    lines = [f"# {spec.describe()}"]
    non_tensor = {k: v for k, v in bind(spec).items() if tensor_index(v) is None and v is not None}
    if non_tensor:
        lines.append("# arguments: " + ", ".join(f"{k}={v!r}" for k, v in non_tensor.items()))
    for i, m in enumerate(spec.inputs):
        lines.append(f"# in{i}: {m.dtype} shape {list(m.shape)} stride {list(m.stride)}")
    for i, m in enumerate(spec.outputs):
        lines.append(f"# out{i}: {m.dtype} shape {list(m.shape)} stride {list(m.stride)}")
    return "\n".join(lines)


def clip_pow2(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def non_overlapping(m: TensorMeta) -> bool:
    """No two elements of ``m`` share memory (an output must be writable element by element)."""
    dims = sorted((st, s) for s, st in zip(m.shape, m.stride) if s > 1)
    reach = 1
    for st, s in dims:
        if st < reach:
            return False
        reach = st * s
    return True
