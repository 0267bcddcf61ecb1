"""Decompositions of elementwise ops that torch decomposes only to primitives (issue 44): merged
into decompositions.OWN_DECOMPOSITIONS (OVERRIDES: ELEMENTWISE_OVERRIDES).

- ``frexp``: the exponent field and the mantissa read from the bits (a same-size integer view,
  shifts and masks the elementwise family generates), subnormals first scaled by a power of two
  into the normal range: exact in every float dtype. 0, +-inf and NaN give (x, 0), as ATen's
  std::frexp does on the CPU.
- ``_to_copy`` to a complex dtype: a real value becomes the pair (x, 0) of the complex dtype's
  real type, selected into a fresh (..., 2) tensor in the output's memory order and viewed as
  complex; a complex value converts its (real, imaginary) pairs (``view_as_real``). A copy
  without a dtype is torch's decomposition (a clone), as before; other conversions decline.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._decomp import decomposition_table as _torch_table

from torch_kernelize.compiling.decomposition_registry import registrar
from torch_kernelize.core.shapes import dense_order

aten = torch.ops.aten
ELEMENTWISE_DECOMPOSITIONS: dict[Any, Callable] = {}
ELEMENTWISE_OVERRIDES: set[Any] = set()

_register = registrar(ELEMENTWISE_DECOMPOSITIONS, ELEMENTWISE_OVERRIDES)

# float dtype -> (the integer dtype of its size, mantissa bits, exponent bias)
_FORMATS = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023),
            torch.float16: (torch.int16, 10, 15), torch.bfloat16: (torch.int16, 7, 127)}


@_register(aten.frexp.Tensor, override=True)  # torch's is prims.frexp
def _frexp(x: torch.Tensor):
    """(mantissa, exponent) with x = mantissa * 2**exponent, 0.5 <= |mantissa| < 1."""
    if x.dtype not in _FORMATS:
        return NotImplemented
    ibits, mant, bias = _FORMATS[x.dtype]
    field_mask = (1 << (torch.finfo(x.dtype).bits - 1 - mant)) - 1
    # a subnormal times 2**(mant + 1) is normal (exact: a power of two); its exponent less as much
    size = x.abs()
    sub = (size < torch.finfo(x.dtype).tiny) & (x != 0)
    bits = torch.where(sub, x * float(2 ** (mant + 1)), x).view(ibits)
    field = (bits >> mant) & field_mask
    exponent = torch.where(sub, field - (bias + mant), field - (bias - 1))
    # the exponent field set to bias - 1: the same sign and fraction in [0.5, 1)
    mantissa = ((bits & ~(field_mask << mant)) | ((bias - 1) << mant)).view(x.dtype)
    special = (x == 0) | (size == float("inf")) | (x != x)
    return torch.where(special, x, mantissa), torch.where(special, 0, exponent.to(torch.int32))


def _output_order(x: torch.Tensor, memory_format: torch.memory_format | None) -> list[int]:
    """The dims of ``_to_copy(x)``'s output from outermost to innermost: x's own order where x is
    dense (preserve_format keeps its strides), else the contiguous one."""
    order = dense_order(x.shape, x.stride()) if memory_format in (None, torch.preserve_format) else None
    return list(range(x.dim())) if order is None else order


def _convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (strides as t's where t is dense), as a copy into a new tensor: a
    _to_copy here would be the traced op itself; the planner decomposes the copy into one."""
    return t if t.dtype == dtype else aten.copy.default(torch.empty_like(t, dtype=dtype), t)


@_register(aten._to_copy.default, override=True)  # torch's is prims.convert_element_type
def _to_copy(x: torch.Tensor, *, dtype: torch.dtype | None = None, layout=None, device=None, pin_memory=None,
             non_blocking: bool = False, memory_format: torch.memory_format | None = None):
    """A conversion to a complex dtype through the real dtype of its parts. Without a dtype,
    torch's (a clone); any other conversion declines: it stays the op (the elementwise family
    generates it), and so do the real conversions traced here, in the same table."""
    if dtype is None:
        return _torch_table[aten._to_copy.default](x, layout=layout, device=device, pin_memory=pin_memory,
                                                   non_blocking=non_blocking, memory_format=memory_format)
    same_device = device is None or torch.device(device) == x.device
    if (not dtype.is_complex or layout not in (None, torch.strided) or not same_device or pin_memory
            or x.is_conj() or x.is_neg()):
        return NotImplemented
    real = dtype.to_real()
    if x.is_complex():
        # (real, imaginary) pairs converted, innermost as in x
        if memory_format not in (None, torch.preserve_format):
            return NotImplemented
        return torch.view_as_complex(_convert(torch.view_as_real(x), real))
    order = _output_order(x, memory_format)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    values = _convert(x.permute(order), real).unsqueeze(-1)
    first = torch.arange(2, device=x.device) == 0
    pairs = torch.where(first, values, x.new_zeros((), dtype=real)).contiguous()
    return torch.view_as_complex(pairs).permute(inverse)
