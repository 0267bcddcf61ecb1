"""Pointwise ATen ops: unary math, binary arithmetic with broadcasting and scalars, comparisons,
where, clamp, casts and copies — one generic strided kernel.

The kernel walks the output in its memory order, one program per BLOCK of outputs. Dims of size 1
are dropped, dims are ordered by the output's strides and neighbours that are contiguous in every
tensor are merged, so the common case (all operands dense in the same layout) is one flat offset;
otherwise each operand's offset comes from the flat index by div/mod with literal sizes. A
broadcast scalar operand (all strides 0) is loaded once.

Types follow ATen: the spec's output dtype is the result of promotion; arithmetic runs in that
type, with fp16/bf16 upcast to fp32 (ATen's opmath), comparisons in the operands' common type;
the result is rounded to the output dtype on store. fp64 is computed in fp64 by the ops of FP64_OPS
(elementwise functions whose expression holds in fp64); the others only copy/select it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.elementwise_math import MATH_HELPERS
from torch_kernelize.lowering.kernels.base import Config, KernelFamily, sample_generator, sample_tensor, to_device
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec, TensorMeta

# --- helper device functions (emitted into a module only when its kernel uses them) ------------

HELPERS: dict[str, str] = {
    "_tanh": '''
@triton.jit
def _tanh(x):
    # tanh = sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|); near 0 an odd series avoids the cancellation
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    t = (1.0 - e) / (1.0 + e)
    x2 = x * x
    series = x + x * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397))
    return tl.where(ax < 0.125, series, tl.where(x < 0.0, -t, t))
''',
    "_sigmoid": '''
@triton.jit
def _sigmoid(x):
    return tl.div_rn(1.0, 1.0 + tl.exp(-x))
''',
    "_expm1": '''
@triton.jit
def _expm1(x):
    # exp(x) - 1 loses digits near 0: there (u - 1) * x / log(u) (Kahan) is accurate to a few ulps
    u = tl.exp(x)
    near0 = (u - 1.0) * x / tl.log(u)
    return tl.where(tl.abs(x) < 0.5, tl.where(u == 1.0, x, near0), u - 1.0)
''',
    "_log1p": '''
@triton.jit
def _log1p(x):
    # log(1 + x) loses digits near 0: there log(u) * x / (u - 1) with u = 1 + x (Kahan)
    u = 1.0 + x
    near0 = tl.log(u) * x / (u - 1.0)
    return tl.where(tl.abs(x) < 0.5, tl.where(u == 1.0, x, near0), tl.log(u))
''',
    "_pow": '''
@triton.jit
def _pow(x, y):
    # std::pow: |x|^y as exp2(y * log2|x|); a negative x (or -0.0) keeps its sign for an odd integer
    # y; a finite negative x to a fractional y is NaN; pow(x, 0), pow(1, y), pow(-1, +-inf) are 1.
    # Also float64 (1 / x: tl.div_rn is fp32 only; its rounding does not matter to the sign of -0)
    whole = tl.floor(y) == y
    odd = whole & (tl.floor(y * 0.5) * 2.0 != y)
    mag = tl.exp2(y * tl.log2(tl.abs(x)))
    negative = (x < 0.0) | ((x == 0.0) & (1.0 / x < 0.0))
    r = tl.where(negative & odd, -mag, mag)
    r = tl.where((x < 0.0) & (x > -float('inf')) & ~whole, float('nan'), r)
    one = (y == 0.0) | (x == 1.0) | ((x == -1.0) & (tl.abs(y) == float('inf')))
    return tl.where(one, 1.0, r)
''',
    "_asinh": '''
@triton.jit
def _asinh(x):
    # sign(x) * log1p(|x| + x^2 / (1 + sqrt(1 + x^2))): no cancellation near 0; log(2|x|) past 1e18
    a = tl.abs(x)
    small = _log1p(a + a * a / (1.0 + tl.sqrt_rn(1.0 + a * a)))
    r = tl.where(a > 1e18, tl.log(a) + 0.6931471805599453, small)
    return tl.where(x < 0.0, -r, r)
''',
    "_trunc": '''
@triton.jit
def _trunc(x):
    return tl.where(x < 0.0, tl.ceil(x), tl.floor(x))
''',
    "_div_floor": '''
@triton.jit
def _div_floor(a, b):
    # c10::div_floor_floating: from the exact fmod, so a quotient near an integer rounds the right way
    q = tl.div_rn(a, b)
    mod = a % b  # fmod: the sign of a
    div = tl.div_rn(a - mod, b)
    div = tl.where((mod != 0.0) & ((b < 0.0) != (mod < 0.0)), div - 1.0, div)
    fl = tl.floor(div)
    fl = tl.where(div - fl > 0.5, fl + 1.0, fl)
    zero = (q.to(tl.int32, bitcast=True) & -2147483648).to(tl.float32, bitcast=True)  # copysign(0, a / b)
    return tl.where(b == 0.0, q, tl.where(div != 0.0, fl, zero))
''',
    "_div64": '''
@triton.jit
def _div64(x, y):
    return x / y
''',
    **MATH_HELPERS,
}

# A GEMM's epilogue runs between its tiles' MMAs on the same threads: there the sigmoid's IEEE
# division (tl.div_rn, which ATen's CUDA kernels match) is most of its instructions. In Mixtral's
# gated experts (grouped_mm_glu, fp16, a 128x128 pair) the sm_90 cubin held 13783 SASS lines
# with it and 10119 with the approximate division (MUFU.RCP, at most 2 ulp of fp32, far below a
# 16-bit product's rounding; spilled stack 232 bytes a thread against 88). The epilogues of
# matmul_source.py and grouped_mm_glu.py take these helpers; the elementwise kernels keep HELPERS.
EPILOGUE_HELPERS: dict[str, str] = {**HELPERS, "_sigmoid": '''
@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))
'''}

# --- the op table --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PointwiseOp:
    """How one ATen op computes: which arguments are operands and the expression over them.

    kind: "float"   math that needs a floating type (output fp32/fp16/bf16, computed in fp32)
          "arith"   integer or floating arithmetic in the output's (compute) type
          "compare" a bool result computed in the operands' common type
          "logical" a bool result of the operands' truth values
          "select"  where: values are selected, not computed (exact in any type)
          "copy"    clone/_to_copy: a conversion only
    body(ops, args, ctype) -> expression; ops are operand expressions already in ctype.
    """
    operands: tuple[str, ...]
    kind: str
    body: Callable[[list[str], dict[str, Any], str], str]
    helpers: tuple[str, ...] = ()
    check: Callable[[dict[str, Any]], str | None] | None = None


def _lit(v: Any, ctype: str) -> str:
    return cg.literal(v, ctype)


def _nan_safe(x: str, expr: str, ctype: str) -> str:
    """``expr``, except NaN where x is NaN (tl.maximum/minimum drop NaN on GPUs; ATen keeps it)."""
    return f"tl.where({x} != {x}, {x}, {expr})" if cg.is_float(ctype) else expr


def _clamp(x: str, lo: Any, hi: Any, ctype: str) -> str:
    e = x
    if lo is not None:
        e = f"tl.maximum({e}, {_lit(lo, ctype)})"
    if hi is not None:
        e = f"tl.minimum({e}, {_lit(hi, ctype)})"
    return _nan_safe(x, e, ctype)


def _alpha(args: dict[str, Any]) -> Any:
    return cg.scalar_value(args.get("alpha", 1)) if args.get("alpha") is not None else 1


def _plus(x: str, y: str, alpha: Any, sign: str, ctype: str) -> str:
    if alpha == 1:
        return f"{x} {sign} {y}"
    return f"{x} {sign} {y} * {_lit(alpha, ctype)}"


def _pow_scalar(x: str, args: dict[str, Any], ctype: str) -> str:
    e = float(cg.scalar_value(args["exponent"]))
    exact = {0.0: f"tl.where({x} == {x}, 1.0, 1.0)", 1.0: x, 2.0: f"{x} * {x}", 3.0: f"{x} * {x} * {x}",
             4.0: f"({x} * {x}) * ({x} * {x})", -1.0: f"tl.div_rn(1.0, {x})", -2.0: f"tl.div_rn(1.0, {x} * {x})",
             0.5: f"tl.sqrt_rn({x})", -0.5: f"tl.div_rn(1.0, tl.sqrt_rn({x}))"}
    if e in exact:
        return exact[e]
    el = cg.float_literal(e)
    if e == int(e):
        mag = f"tl.exp2({el} * tl.log2(tl.abs({x})))"
        if int(e) % 2 == 0:
            return mag
        # odd integer exponent: the sign of x (including -0.0) carries over
        return f"tl.where({_signbit(x, ctype)}, -{mag}, {mag})"
    # non-integer exponent: NaN for finite x < 0 (log2 of a negative), C's pow limits at -inf
    return f"tl.exp2({el} * tl.log2(tl.where({x} == -float('inf'), -{x}, {x})))"


def _float64(literal: str, ctype: str) -> str:
    """A number operand that a function takes alone (not in arithmetic with a tensor, which converts
    it exactly) as a float64 value where the arithmetic is float64: alone it would be float32."""
    return f"tl.full([1], {literal}, tl.float64)" if ctype == "float64" else literal


def _check_pow(args: dict[str, Any]) -> str | None:
    e = cg.scalar_value(args.get("exponent"))
    if e is None or isinstance(e, bool):
        return "pow exponent must be a number"
    if not math.isfinite(float(e)):
        return "non-finite pow exponent"
    return None


def _check_nothing(args: dict[str, Any]) -> str | None:
    return None


def _remainder(x: str, y: str) -> str:
    m = f"({x} % {y})"
    return f"tl.where(({m} != 0) & (({m} < 0) != ({y} < 0)), {m} + {y}, {m})"


def _shift(x: str, y: str, ctype: str, left: bool) -> str:
    """c10's shifts: a shift by a negative amount or by the width or more gives 0 (left) or the
    sign (right; 0 for unsigned types), where LLVM's would be undefined."""
    bits = torch.iinfo(getattr(torch, ctype)).bits
    out_of_range = f"(({y} < 0) | ({y} >= {bits}))"
    if left or ctype.startswith("uint"):
        return f"tl.where({out_of_range}, 0, {x} {'<<' if left else '>>'} {y})"
    return f"tl.where({out_of_range}, {x} >> {bits - 1}, {x} >> {y})"


def _check_div(args: dict[str, Any]) -> str | None:
    if args.get("rounding_mode") not in (None, "trunc", "floor"):
        return f"div rounding_mode={args['rounding_mode']!r} is not one of None, 'trunc', 'floor'"
    return None


def _div_mode(x: str, y: str, args: dict[str, Any], ctype: str) -> str:
    """div with ``rounding_mode`` as ATen computes it (c10::div_floor_integer/_floating, trunc)."""
    mode = args.get("rounding_mode")
    if cg.is_int(ctype):
        # triton's // and % truncate (C semantics); floor steps down where the signs differ
        if mode == "floor":
            return f"tl.where(({x} % {y} != 0) & (({x} % {y} < 0) != ({y} < 0)), {x} // {y} - 1, {x} // {y})"
        return f"{x} // {y}"
    if mode is None:
        return f"tl.div_rn({x}, {y})"
    if mode == "trunc":
        # fp16/bf16: of the fp32 quotient, like floor (ATen truncates the quotient rounded to the
        # dtype: one apart where it lies within half a dtype ulp below an integer)
        return f"_trunc(tl.div_rn({x}, {y}))"
    return f"_div_floor({x}, {y})"


def _unary(kind: str, body: Callable[[str], str], *helpers: str) -> PointwiseOp:
    return PointwiseOp(("self",), kind, lambda o, a, t: body(o[0]), tuple(helpers))


def _binary(kind: str, body: Callable[[str, str], str], names=("self", "other"), check=None) -> PointwiseOp:
    return PointwiseOp(names, kind, lambda o, a, t: body(o[0], o[1]), (), check)


def _round_decimals(x: str, args: dict[str, Any]) -> str:
    """ATen's round(x, decimals): nearbyint(x * 10^d) / 10^d, or nearbyint(x / 10^-d) * 10^-d for d < 0."""
    d = int(args.get("decimals", 0))
    p = cg.float_literal(10.0 ** abs(d))
    return f"tl.div_rn(_round_even({x} * {p}), {p})" if d >= 0 else f"_round_even(tl.div_rn({x}, {p})) * {p}"


def _check_decimals(args: dict[str, Any]) -> str | None:
    d = args.get("decimals", 0)
    if not isinstance(d, int) or isinstance(d, bool) or abs(d) > 30:
        return f"round decimals={d!r} is not an integer within 30"
    return None


def _signbit(x: str, ctype: str) -> str:
    if ctype in ("float32", "float64"):
        return f"{x}.to(tl.int{ctype[-2:]}, bitcast=True) < 0"
    return f"{x} < 0" if ctype != "bool" else f"{x} != {x}"


def _polygamma(x: str, args: dict[str, Any]) -> str:
    n = int(args["n"])
    return f"_digamma({x})" if n == 0 else f"_polygamma({x}, {n}, {cg.float_literal((-1) ** (n + 1) * math.factorial(n))})"


def _check_polygamma(args: dict[str, Any]) -> str | None:
    n = args.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 4:
        return f"polygamma n={n!r} is not generated (n = 0..4)"
    return None


# nested, not ``(x > y) | (x != x)``: the interpreter types a comparison of two one-element values
# as float, which ``|`` with a block of bools refuses (a 0-d operand of a fused region)
_MAX = lambda x, y: f"tl.where({x} != {x}, {x}, tl.where({x} > {y}, {x}, {y}))"
_MIN = lambda x, y: f"tl.where({x} != {x}, {x}, tl.where({x} < {y}, {x}, {y}))"

OPS: dict[str, PointwiseOp] = {
    # unary math (floating)
    "aten.exp.default": _unary("float", lambda x: f"tl.exp({x})"),
    "aten.exp2.default": _unary("float", lambda x: f"tl.exp2({x})"),
    "aten.expm1.default": _unary("float", lambda x: f"_expm1({x})", "_expm1"),
    "aten.log.default": _unary("float", lambda x: f"tl.log({x})"),
    "aten.log2.default": _unary("float", lambda x: f"tl.log2({x})"),
    "aten.log10.default": _unary("float", lambda x: f"tl.log({x}) * 0.4342944819032518"),
    "aten.log1p.default": _unary("float", lambda x: f"_log1p({x})", "_log1p"),
    "aten.sqrt.default": _unary("float", lambda x: f"tl.sqrt_rn({x})"),
    "aten.rsqrt.default": _unary("float", lambda x: f"tl.div_rn(1.0, tl.sqrt_rn({x}))"),
    "aten.sin.default": _unary("float", lambda x: f"tl.sin({x})"),
    "aten.cos.default": _unary("float", lambda x: f"tl.cos({x})"),
    "aten.tanh.default": _unary("float", lambda x: f"_tanh({x})", "_tanh"),
    "aten.sigmoid.default": _unary("float", lambda x: f"_sigmoid({x})", "_sigmoid"),
    "aten.erf.default": _unary("float", lambda x: f"tl.erf({x})"),
    "aten.reciprocal.default": _unary("float", lambda x: f"tl.div_rn(1.0, {x})"),
    "aten.silu.default": _unary("float", lambda x: f"tl.div_rn({x}, 1.0 + tl.exp(-{x}))"),
    "aten.floor.default": _unary("float", lambda x: f"tl.floor({x})"),
    "aten.ceil.default": _unary("float", lambda x: f"tl.ceil({x})"),
    "aten.trunc.default": _unary("float", lambda x: f"tl.where({x} < 0.0, tl.ceil({x}), tl.floor({x}))"),
    "aten.hardsigmoid.default": _unary(
        "float", lambda x: f"tl.div_rn({_clamp(f'({x} + 3.0)', 0.0, 6.0, 'float32')}, 6.0)"),
    "aten.hardswish.default": _unary(
        "float", lambda x: f"tl.div_rn({x} * {_clamp(f'({x} + 3.0)', 0.0, 6.0, 'float32')}, 6.0)"),
    "aten.gelu.default": PointwiseOp(
        ("self",), "float",
        lambda o, a, t: (f"0.5 * {o[0]} * (1.0 + tl.erf({o[0]} * 0.7071067811865476))"
                         if a.get("approximate", "none") == "none" else
                         f"0.5 * {o[0]} * (1.0 + _tanh(0.7978845608028654 * ({o[0]} + 0.044715 * {o[0]} * {o[0]} * {o[0]})))"),
        ("_tanh",),
        lambda a: None if a.get("approximate", "none") in ("none", "tanh") else f"gelu approximate={a.get('approximate')!r}"),
    "aten.leaky_relu.default": PointwiseOp(
        ("self",), "float",
        lambda o, a, t: f"tl.where({o[0]} > 0.0, {o[0]}, {o[0]} * {_lit(cg.scalar_value(a['negative_slope']), t)})"),
    "aten.hardtanh.default": PointwiseOp(
        ("self",), "arith",
        lambda o, a, t: _clamp(o[0], cg.scalar_value(a["min_val"]), cg.scalar_value(a["max_val"]), t)),
    "aten.pow.Tensor_Scalar": PointwiseOp(("self",), "float", lambda o, a, t: _pow_scalar(o[0], a, t), (), _check_pow),
    "aten.pow.Tensor_Tensor": PointwiseOp(("self", "exponent"), "float", lambda o, a, t: f"_pow({o[0]}, {o[1]})", ("_pow",)),
    "aten.pow.Scalar": PointwiseOp(("self", "exponent"), "float", lambda o, a, t: f"_pow({_float64(o[0], t)}, {o[1]})",
                                   ("_pow",)),
    # unary, integer or floating
    "aten.abs.default": _unary("arith", lambda x: f"tl.abs({x})"),
    "aten.neg.default": _unary("arith", lambda x: f"-{x}"),
    "aten.relu.default": PointwiseOp(("self",), "arith", lambda o, a, t: f"tl.where({o[0]} < {_lit(0, t)}, {_lit(0, t)}, {o[0]})"),
    "aten.sign.default": PointwiseOp(
        ("self",), "arith",
        lambda o, a, t: f"tl.where({o[0]} > {_lit(0, t)}, {_lit(1, t)}, tl.where({o[0]} < {_lit(0, t)}, {_lit(-1, t)}, {_lit(0, t)}))"),
    "aten.clamp.default": PointwiseOp(
        ("self",), "arith", lambda o, a, t: _clamp(o[0], cg.scalar_value(a["min"]), cg.scalar_value(a["max"]), t)),
    "aten.clamp_min.default": PointwiseOp(("self",), "arith", lambda o, a, t: _clamp(o[0], cg.scalar_value(a["min"]), None, t)),
    "aten.clamp_max.default": PointwiseOp(("self",), "arith", lambda o, a, t: _clamp(o[0], None, cg.scalar_value(a["max"]), t)),
    # binary arithmetic (other may be a number)
    "aten.add.Tensor": PointwiseOp(("self", "other"), "arith", lambda o, a, t: _plus(o[0], o[1], _alpha(a), "+", t)),
    "aten.add.Scalar": PointwiseOp(("self", "other"), "arith", lambda o, a, t: _plus(o[0], o[1], _alpha(a), "+", t)),
    "aten.sub.Tensor": PointwiseOp(("self", "other"), "arith", lambda o, a, t: _plus(o[0], o[1], _alpha(a), "-", t)),
    "aten.sub.Scalar": PointwiseOp(("self", "other"), "arith", lambda o, a, t: _plus(o[0], o[1], _alpha(a), "-", t)),
    "aten.rsub.Tensor": PointwiseOp(("self", "other"), "arith", lambda o, a, t: _plus(o[1], o[0], _alpha(a), "-", t)),
    "aten.rsub.Scalar": PointwiseOp(("self", "other"), "arith", lambda o, a, t: _plus(o[1], o[0], _alpha(a), "-", t)),
    "aten.mul.Tensor": _binary("arith", lambda x, y: f"{x} * {y}"),
    "aten.mul.Scalar": _binary("arith", lambda x, y: f"{x} * {y}"),
    "aten.div.Tensor": _binary("float", lambda x, y: f"tl.div_rn({x}, {y})"),
    "aten.div.Scalar": _binary("float", lambda x, y: f"tl.div_rn({x}, {y})"),
    # with a rounding mode integers stay integers (no promotion to float), so these are "arith"
    "aten.div.Tensor_mode": PointwiseOp(("self", "other"), "arith", lambda o, a, t: _div_mode(o[0], o[1], a, t),
                                        ("_trunc", "_div_floor"), _check_div),
    "aten.div.Scalar_mode": PointwiseOp(("self", "other"), "arith", lambda o, a, t: _div_mode(o[0], o[1], a, t),
                                        ("_trunc", "_div_floor"), _check_div),
    "aten.maximum.default": PointwiseOp(("self", "other"), "arith",
                                        lambda o, a, t: _MAX(*o) if cg.is_float(t) else f"tl.maximum({o[0]}, {o[1]})"),
    "aten.minimum.default": PointwiseOp(("self", "other"), "arith",
                                        lambda o, a, t: _MIN(*o) if cg.is_float(t) else f"tl.minimum({o[0]}, {o[1]})"),
    # comparisons and logic -> bool
    **{f"aten.{name}.{ov}": _binary("compare", lambda x, y, s=sym: f"{x} {s} {y}")
       for name, sym in (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="))
       for ov in ("Tensor", "Scalar")},
    "aten.logical_not.default": _unary("logical", lambda x: f"{x} == 0"),
    "aten.logical_and.default": _binary("logical", lambda x, y: f"({x} != 0) & ({y} != 0)"),
    "aten.logical_or.default": _binary("logical", lambda x, y: f"({x} != 0) | ({y} != 0)"),
    "aten.logical_xor.default": _binary("logical", lambda x, y: f"({x} != 0) ^ ({y} != 0)"),
    # bitwise ops on bool tensors (attention masks) are the logical ones; on integers the family
    # declines them (a logical op must produce bool)
    "aten.bitwise_not.default": _unary("logical", lambda x: f"{x} == 0"),
    "aten.bitwise_and.Tensor": _binary("logical", lambda x, y: f"({x} != 0) & ({y} != 0)"),
    "aten.bitwise_or.Tensor": _binary("logical", lambda x, y: f"({x} != 0) | ({y} != 0)"),
    "aten.bitwise_xor.Tensor": _binary("logical", lambda x, y: f"({x} != 0) ^ ({y} != 0)"),
    # hyperbolic functions from exp/log1p, each in its accurate form near 0
    "aten.cosh.default": _unary("float", lambda x: f"0.5 * (tl.exp({x}) + tl.exp(-{x}))"),
    "aten.atanh.default": _unary("float", lambda x: f"0.5 * _log1p(tl.div_rn(2.0 * {x}, 1.0 - {x}))", "_log1p"),
    "aten.asinh.default": _unary("float", lambda x: f"_asinh({x})", "_log1p", "_asinh"),
    # fmax/fmin: NaN only where both are NaN
    "aten.fmax.default": _binary("arith", lambda x, y: f"tl.where({x} != {x}, {y}, tl.where({y} != {y}, {x}, tl.maximum({x}, {y})))"),
    "aten.fmin.default": _binary("arith", lambda x, y: f"tl.where({x} != {x}, {y}, tl.where({y} != {y}, {x}, tl.minimum({x}, {y})))"),
    "aten.copysign.Tensor": _binary("float", lambda x, y: f"tl.where({y}.to(tl.int32, bitcast=True) < 0, -tl.abs({x}), tl.abs({x}))"),
    "aten.copysign.Scalar": _binary("float", lambda x, y: f"tl.where({y} < 0.0, -tl.abs({x}), tl.abs({x}))"),
    # isnan reads its operand as stored (NaN != NaN; an integer is never NaN)
    "aten.isnan.default": _unary("logical", lambda x: f"{x} != {x}"),
    # triton's % is C's fmod (the sign of the dividend) on integers and floats alike; remainder
    # takes the divisor's sign (c10's remainder: fmod, plus the divisor where the signs differ)
    **{f"aten.fmod.{ov}": _binary("arith", lambda x, y: f"{x} % {y}", check=_check_nothing)
       for ov in ("Tensor", "Scalar")},
    **{f"aten.remainder.{ov}": _binary("arith", lambda x, y: _remainder(x, y), check=_check_nothing)
       for ov in ("Tensor", "Scalar")},
    # inverse trigonometric / hyperbolic, tan, hypot, rounding, special functions (elementwise_math)
    "aten.atan.default": _unary("float", lambda x: f"_atan({x})", "_atan"),
    "aten.asin.default": _unary("float", lambda x: f"_asin({x})", "_atan", "_asin"),
    "aten.acos.default": _unary("float", lambda x: f"_acos({x})", "_atan", "_acos"),
    "aten.atan2.default": PointwiseOp(("self", "other"), "float", lambda o, a, t: f"_atan2({o[0]}, {o[1]})", ("_atan", "_atan2")),
    "aten.acosh.default": _unary("float", lambda x: f"_acosh({x})", "_log1p", "_acosh"),
    "aten.sinh.default": _unary("float", lambda x: f"_sinh({x})", "_expm1", "_sinh"),
    "aten.tan.default": _unary("float", lambda x: f"_tan({x})", "_tan"),
    "aten.hypot.default": PointwiseOp(("self", "other"), "float", lambda o, a, t: f"_hypot({o[0]}, {o[1]})", ("_hypot",)),
    "aten.round.default": _unary("float", lambda x: f"_round_even({x})", "_round_even"),
    "aten.round.decimals": PointwiseOp(("self",), "float", lambda o, a, t: _round_decimals(o[0], a), ("_round_even",),
                                       _check_decimals),
    # signbit: the sign bit as stored (-0.0 and -NaN included); an integer's sign
    "aten.signbit.default": PointwiseOp(("self",), "compare", lambda o, a, t: _signbit(o[0], t)),
    "aten.angle.default": _unary("float", lambda x: f"tl.where({x} != {x}, {x}, tl.where({x} < 0.0, 3.141592653589793, 0.0))"),
    "aten.erfc.default": _unary("float", lambda x: f"_erfc({x})", "_erfc"),
    "aten.i0.default": _unary("float", lambda x: f"_i0({x})", "_i0_a", "_i0_b", "_i0"),
    "aten.erfinv.default": _unary("float", lambda x: f"_erfinv({x})", "_erfc", "_erfinv"),
    **{f"aten.{name}.default": PointwiseOp(("self", "other"), "float", lambda o, a, t, u=upper: f"_igamma({o[0]}, {o[1]}, {u})",
                                           ("_log1p", "_erfc", "_lgamma_pos", "_igamma"))
       for name, upper in (("igamma", False), ("igammac", True))},
    "aten.lgamma.default": _unary("float", lambda x: f"_lgamma({x})", "_lgamma_pos", "_sinpi_abs", "_lgamma"),
    "aten.digamma.default": _unary("float", lambda x: f"_digamma({x})", "_cotpi", "_digamma"),
    "aten.polygamma.default": PointwiseOp(("self",), "float", lambda o, a, t: _polygamma(o[0], a),
                                          ("_cotpi", "_digamma", "_polygamma"), _check_polygamma),
    "aten.nextafter.default": PointwiseOp(("self", "other"), "float", lambda o, a, t: f"_nextafter({o[0]}, {o[1]})",
                                          ("_nextafter",)),
    # selection and copies
    "aten.where.self": PointwiseOp(("condition", "self", "other"), "select",
                                   lambda o, a, t: f"tl.where({o[0]}, {o[1]}, {o[2]})"),
    "aten.clone.default": _unary("copy", lambda x: x),
    "aten._to_copy.default": _unary("copy", lambda x: x),
}

# ops whose expression is right in float64 too (computed in float64 where an operand or the output
# is float64): no fp32 constants of limited precision, bit tricks of fp32 or truncated series. The
# comparisons are exact in any type. tl.div_rn/tl.sqrt_rn are fp32 only: in float64 the emitter
# writes IEEE division (_div64) and tl.sqrt for them.
FP64_OPS = frozenset(
    [f"aten.{n}.{ov}" for n in ("add", "sub", "rsub", "mul", "div") for ov in ("Tensor", "Scalar")]
    + [f"aten.{n}.default" for n in ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
                                     "sin", "cos", "reciprocal", "floor", "ceil", "trunc", "abs", "neg", "relu",
                                     "sign", "maximum", "minimum", "fmax", "fmin", "isnan", "signbit",
                                     "clamp", "clamp_min", "clamp_max", "logical_not", "logical_and",
                                     "logical_or", "logical_xor")]
    + [f"aten.{n}.{ov}" for n in ("eq", "ne", "lt", "le", "gt", "ge") for ov in ("Tensor", "Scalar")]
    # exp2(y log2|x|) in float64: relative error ~ |y log2 x| * 2^-53, under 1e-12 wherever pow is finite
    + ["aten.pow.Tensor_Tensor", "aten.pow.Tensor_Scalar", "aten.pow.Scalar"])
# ops generated for a float32 output only (they step in the output type's bits)
FP32_ONLY = frozenset({"aten.nextafter.default"})
# integer/float arithmetic whose bool result ATen defines by truth values: mul of bools is "and"
BOOL_ARITH: dict[str, PointwiseOp] = {
    "aten.mul.Tensor": _binary("logical", lambda x, y: f"({x} != 0) & ({y} != 0)"),
}

_DIV_MODES = ("aten.div.Tensor_mode", "aten.div.Scalar_mode")
# ops whose integer divisor must not be 0 (ATen raises ZeroDivisionError)
_INT_DIVISIONS = _DIV_MODES + ("aten.fmod.Tensor", "aten.fmod.Scalar", "aten.remainder.Tensor", "aten.remainder.Scalar")
# the bitwise ops on integers (hashes): bit arithmetic in the output's type; on bool the logical rows
INT_BITWISE: dict[str, PointwiseOp] = {
    "aten.bitwise_not.default": _unary("arith", lambda x: f"~{x}"),
    **{f"aten.bitwise_{name}.{ov}": _binary("arith", lambda x, y, s=sym: f"{x} {s} {y}")
       for name, sym in (("and", "&"), ("or", "|"), ("xor", "^")) for ov in ("Tensor", "Scalar")},
    **{op: PointwiseOp(("self", "other"), "arith", lambda o, a, t, left=left: _shift(o[0], o[1], t, left))
       for left, names in ((True, ("aten.bitwise_left_shift.Tensor", "aten.bitwise_left_shift.Tensor_Scalar",
                                   "aten.__lshift__.Tensor", "aten.__lshift__.Scalar")),
                           (False, ("aten.bitwise_right_shift.Tensor", "aten.bitwise_right_shift.Tensor_Scalar",
                                    "aten.__rshift__.Tensor", "aten.__rshift__.Scalar")))
       for op in names},
}


@dataclasses.dataclass
class _Operand:
    name: str
    tensor: int | None              # spec input index, or None for a number
    value: Any = None               # the number
    dtype: str | None = None        # storage dtype of a tensor operand


def _result_type(operands: list[_Operand], spec: KernelSpec) -> torch.dtype:
    vals = []
    for o in operands:
        if o.tensor is not None:
            m = spec.inputs[o.tensor]
            vals.append(torch.empty(m.shape, dtype=m.torch_dtype, device="meta"))
        else:
            vals.append(o.value)
    if len(vals) == 1:
        return vals[0].dtype
    return torch.result_type(vals[0], vals[1])


class _Plan(NamedTuple):
    operands: list[_Operand]
    op: PointwiseOp
    args: dict[str, Any]           # bound by schema name
    ctype: str                     # the type the arithmetic runs in
    max_block: int                 # the largest BLOCK worth a program: the output's size, clipped


def _max_block(out: TensorMeta) -> int:
    return max(128, min(8192, cg.clip_pow2(_next_pow2(math.prod(out.shape)), 128, 8192)))


class ElementwiseFamily(KernelFamily):
    name = "elementwise"
    ops = frozenset(OPS) | frozenset(INT_BITWISE)
    edge_kinds = ("zeros", "large", "negative", "special")

    # --- analysis ---------------------------------------------------------------------------
    def _analyse(self, spec: KernelSpec) -> _Plan | str:
        if spec.graph is not None:
            return "fused regions are not pointwise single ops"
        op = OPS.get(spec.op)
        if spec.op in INT_BITWISE and spec.outputs and cg.is_int(spec.outputs[0].dtype):
            op = INT_BITWISE[spec.op]
        if op is None:
            return f"{spec.op} is generated on integers only"
        args = cg.bind(spec)
        if op.check is not None and (why := op.check(args)):
            return why
        if len(spec.outputs) != 1:
            return f"expected one output, got {len(spec.outputs)}"
        out = spec.outputs[0]
        operands = []
        for name in op.operands:
            v = args.get(name)
            i = cg.tensor_index(v)
            if i is not None:
                operands.append(_Operand(name, i, dtype=spec.inputs[i].dtype))
            else:
                s = cg.scalar_value(v)
                if s is None:
                    return f"argument {name}={v!r} is neither a tensor nor a number"
                operands.append(_Operand(name, None, value=s))
        if not any(o.tensor is not None for o in operands):
            return "no tensor operand"
        for k in ("alpha", "min", "max", "min_val", "max_val", "negative_slope"):
            if k in args and args[k] is not None:
                s = cg.scalar_value(args[k])
                if s is None:
                    return f"argument {k}={args[k]!r} must be a number"
        dtypes = {o.dtype for o in operands if o.tensor is not None} | {out.dtype}
        if bad := sorted(d for d in dtypes if d not in cg.TL_TYPES):
            return f"unsupported dtype(s) {bad}"
        if out.device != spec.inputs[operands[0].tensor if operands[0].tensor is not None else 0].device:
            return "input and output devices differ"
        if math.prod(out.shape) == 0:
            return "empty output: nothing to compute"
        if not cg.non_overlapping(out):
            return "output strides overlap (some elements share memory)"
        for o in operands:
            if o.tensor is not None:
                try:
                    cg.broadcast_strides(spec.inputs[o.tensor], out.shape)
                except ValueError as e:
                    return str(e)

        if op.kind == "copy":
            if spec.op == "aten._to_copy.default":
                if args.get("layout") not in (None, {"layout": "strided"}):
                    return f"_to_copy to layout {args.get('layout')} is not a strided copy"
                dev = args.get("device")
                if dev is not None and dev != {"device": spec.inputs[0].device}:
                    return f"_to_copy to another device {dev} is a transfer, not a kernel"
                if args.get("pin_memory"):
                    return "_to_copy with pin_memory is a host allocation, not a kernel"
            return _Plan(operands, op, args, out.dtype, _max_block(out))
        if op.kind == "select":
            if operands[0].tensor is None or operands[0].dtype != "bool":
                return "where needs a bool condition tensor"
            return _Plan(operands, op, args, out.dtype, _max_block(out))
        if "float64" in dtypes and spec.op not in FP64_OPS:
            return f"float64 arithmetic is generated for {len(FP64_OPS)} ops (elementwise.FP64_OPS), not {spec.op}"
        if spec.op in FP32_ONLY and out.dtype != "float32":
            return f"{spec.op} steps in the bits of its output type: float32 only, not {out.dtype}"
        if spec.op in BOOL_ARITH and out.dtype == "bool":  # mul of bools: logical and (ATen's bool arithmetic)
            return _Plan(operands, BOOL_ARITH[spec.op], args, "bool", _max_block(out))
        if op.kind == "compare":
            if out.dtype != "bool":
                return "a comparison must produce bool"
            common = str(_result_type(operands, spec)).removeprefix("torch.")
            if common not in cg.TL_TYPES:
                return f"comparison in {common} is not generated"
            return _Plan(operands, op, args, cg.compute_type(common), _max_block(out))
        if op.kind == "logical":
            if out.dtype != "bool":
                return "logical ops here produce bool"
            return _Plan(operands, op, args, "bool", _max_block(out))
        ctype = cg.compute_type(out.dtype)
        if op.kind == "float" and ctype not in ("float32", "float64"):
            return f"{spec.op} computes in floating point; output dtype {out.dtype} is not fp32/fp16/bf16/fp64"
        if op.kind == "arith" and ctype not in ("float32", "float64") + cg.INT_TYPES:
            return f"{spec.op} with output dtype {out.dtype} is not generated"
        for o in operands:
            if o.tensor is None and cg.is_int(ctype):
                if isinstance(o.value, float) and o.value != int(o.value):
                    return f"fractional scalar {o.name}={o.value} with integer arithmetic"
                info = torch.iinfo(getattr(torch, ctype))
                if not info.min <= int(o.value) <= info.max:
                    return f"scalar {o.name}={o.value} does not fit {ctype}"
        if spec.op in _INT_DIVISIONS and cg.is_int(ctype) and any(o.tensor is None and o.value == 0 for o in operands[1:]):
            return "integer division by zero (ATen raises)"
        alpha = args.get("alpha")
        if alpha is not None and cg.is_int(ctype) and float(cg.scalar_value(alpha)) != int(cg.scalar_value(alpha)):
            return "fractional alpha with integer arithmetic"
        return _Plan(operands, op, args, ctype, _max_block(out))

    # --- configs ------------------------------------------------------------------------------
    def _valid(self, plan: _Plan, c: Config) -> bool:
        return 128 <= c["BLOCK"] <= plan.max_block and c["num_warps"] in (1, 2, 4, 8, 16) \
            and c["BLOCK"] >= 32 * c["num_warps"]

    @staticmethod
    def _fit(plan: _Plan, block: int, warps: int) -> Config:
        block = min(block, plan.max_block)
        warps = max(1, min(warps, block // 32))
        return Config.of(BLOCK=block, num_warps=warps)

    def _seeds(self, spec: KernelSpec, plan: _Plan) -> list[Config]:
        # 8 elements per thread is the usual sweet spot; on an H200 (16M-element gelu/add/casts)
        # 1024x4, 1024x2 and 4096x8 were all within a few percent of the best
        return [self._fit(plan, 1024, 4), self._fit(plan, 4096, 8), self._fit(plan, 1024, 2), self._fit(plan, 512, 2)]

    def _steps(self, plan: _Plan, c: Config) -> list[Config]:
        b, w = c["BLOCK"], c["num_warps"]
        return [Config.of(BLOCK=b * 2, num_warps=w), Config.of(BLOCK=b // 2, num_warps=w),
                Config.of(BLOCK=b, num_warps=w * 2), Config.of(BLOCK=b, num_warps=w // 2),
                Config.of(BLOCK=b * 2, num_warps=w * 2), Config.of(BLOCK=b // 2, num_warps=max(1, w // 2))]

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.planned(spec)
        operands = plan.operands
        out = spec.outputs[0]
        block = int(config["BLOCK"])
        inputs = sorted({o.tensor for o in operands if o.tensor is not None})  # kernel parameters, in spec order
        stride_sets = [out.stride] + [cg.broadcast_strides(spec.inputs[i], out.shape) for i in inputs]
        sizes, strides = cg.simplify(out.shape, stride_sets, order_by=0)
        if not sizes:  # a single element
            sizes, strides = (1,), [(1,)] + [(0,) for _ in inputs]
        numel = math.prod(sizes)
        coord_lines, offsets = cg.decompose("idx", sizes, strides, "i")
        comments = [f"# {numel} outputs, walked in the output's memory order over sizes {list(sizes)};",
                "# strides per tensor: " + ", ".join(
                    f"{n} {list(s)}" for n, s in zip(["out0"] + [f"in{i}" for i in inputs], strides))]
        src, kname = self._emit(spec, config, plan, inputs, comments, coord_lines, offsets[0],
                                dict(zip(inputs, offsets[1:])), str(numel) if numel % block else None,
                                cg.needs_int64(sizes, strides, slack=block), [])
        grid = (-(-numel // block),)
        launch = Launch(kname, grid, tuple(("in", i) for i in inputs) + (("out", 0),), {"BLOCK": block},
                        num_warps=int(config["num_warps"]), num_stages=1)
        return KernelProgram(src, (launch,))

    def bucket_support(self, spec: KernelSpec, dims) -> str | None:
        """Contiguous operands only: the output walked flat up to a run-time ``n_elements``; each
        input the same shape, one element, the output's trailing dims (none of them varying: a
        bias), read at ``idx % inner``, or one value per row (the output's shape with static
        trailing dims of size 1: a norm's statistics), read at ``idx // inner``."""
        plan = self.plan(spec)
        if isinstance(plan, str):
            return plan
        out = spec.outputs[0]
        var_of = {(side, i, d): v for side, i, d, v in dims}
        if not out.is_contiguous():
            return "the output is not contiguous"
        for i in sorted({o.tensor for o in plan[0] if o.tensor is not None}):
            m = spec.inputs[i]
            if m.numel == 1:
                continue
            if not m.is_contiguous():
                return f"input {i} is not contiguous"
            how = _bucketed_read(m, out)
            if how is None:
                return f"input {i} broadcasts otherwise than along the output's varying leading dims"
            kind, k = how
            if kind == "rows":  # the first k dims vary as the output's; the rest are static
                if any(var_of.get(("in", i, d)) != var_of.get(("out", 0, d)) for d in range(k)):
                    return f"input {i} varies in other dims than the output"
                static = [("in", i, d) for d in range(k, len(m.shape))] + [("out", 0, d) for d in range(k, len(out.shape))]
            else:  # a bias: none of its dims vary, nor the output's dims it spans
                static = [("in", i, d) for d in range(len(m.shape))] + [
                    ("out", 0, d) for d in range(len(out.shape) - k, len(out.shape))]
            if any(d in var_of for d in static):
                return f"input {i} broadcasts otherwise than along the output's varying leading dims"
        return None

    def generate_bucketed(self, spec: KernelSpec, config: Config, dims) -> KernelProgram:
        """The kernel of ``generate`` with the number of outputs a run-time argument: one binary
        serves every size of the bucket (its launch's grid and ``n_elements`` are SizeExprs)."""
        problem = self.bucket_support(spec, dims)
        if problem is not None:
            raise ValueError(f"{spec.describe()} cannot be bucketed: {problem}")
        from torch_kernelize.core.buckets import product
        plan = self.planned(spec)
        out = spec.outputs[0]
        block = int(config["BLOCK"])
        inputs = sorted({o.tensor for o in plan[0] if o.tensor is not None})
        offsets = {}
        for i in inputs:
            m = spec.inputs[i]
            kind, k = _bucketed_read(m, out) if m.numel != 1 else ("one", 0)
            offsets[i] = {"one": "0", "rows": "idx" if k == len(out.shape) else f"idx // {math.prod(out.shape[k:])}",
                          "bias": f"idx % {m.numel}"}[kind]
        wide = out.numel + block >= 2**31  # the representative is the bucket's largest size
        src, kname = self._emit(spec, config, plan, inputs, ["# n_elements outputs (a run-time size), walked flat"],
                                [], "idx", offsets, "n_elements", wide, ["n_elements"])
        var_of = {(i, d): v for side, i, d, v in dims if side == "out"}
        n = product([f"v{var_of[(0, d)]}" if (0, d) in var_of else size for d, size in enumerate(out.shape)])
        args, sizes = cg.runtime_size(tuple(("in", i) for i in inputs) + (("out", 0),), out.numel, n, block, wide)
        launch = Launch(kname, (-(-out.numel // block),), args, {"BLOCK": block}, num_warps=int(config["num_warps"]),
                        num_stages=1, runtime_sizes=sizes)
        return KernelProgram(src, (launch,))

    def _emit(self, spec: KernelSpec, config: Config, plan, inputs: list[int], comments: list[str],
              coord_lines: list[str], out_off: str,
              in_off: dict[int, str], mask_bound: str | None, wide: bool, size_params: list[str]) -> tuple[str, str]:
        """(source, kernel name) of the kernel: ``coord_lines`` compute each tensor's offset from ``idx``
        (``out_off``, ``in_off``); ``mask_bound`` masks ``idx`` (None: every block is full)."""
        operands, op, args, ctype, _ = plan
        out = spec.outputs[0]
        kname = spec.op.split(".")[1].lstrip("_") + "_kernel"
        src = cg.Source()
        src(cg.HEADER, cg.describe_spec(spec))
        for h in op.helpers + (("_div64",) if ctype == "float64" else ()):
            src.blank()(HELPERS[h].strip("\n"))
        src.blank()("")
        params = [f"in{i}_ptr" for i in inputs] + ["out0_ptr"] + size_params + ["BLOCK: tl.constexpr"]
        src("@triton.jit", f"def {kname}({', '.join(params)}):").indent()
        src(*comments)
        src("pid = tl.program_id(0)")
        src(f"idx = pid{'.to(tl.int64)' if wide else ''} * BLOCK + tl.arange(0, BLOCK)")
        mask_kw = ""
        if mask_bound is not None:
            src(f"mask = idx < {mask_bound}")
            mask_kw = ", mask=mask"
        for line in coord_lines:
            src(line)

        # load each tensor operand once; arithmetic operands are converted to the compute type
        names: dict[int, str] = {}
        for n, i in enumerate(inputs):
            var = f"x{n}"
            names[i] = var
            off = in_off[i]
            dt = spec.inputs[i].dtype
            # one element splat to a block: the interpreter types a comparison of scalars as the
            # operand's float, which ``|`` with a block of bools then refuses (on a GPU it is free)
            load = (f"tl.broadcast_to(tl.load(in{i}_ptr), [BLOCK])" if off == "0"
                    else f"tl.load(in{i}_ptr + {off}{mask_kw})")
            note = "  # broadcast: one element" if off == "0" else ""
            raw = op.kind in ("copy", "logical") or (op.kind == "select" and dt == "bool") or dt == ctype
            src(f"{var} = {load}{note}" if raw else f"{var} = {load}.to({cg.tl_type(ctype)}){note}")
        exprs = []
        for o in operands:
            if o.tensor is not None:
                exprs.append(names[o.tensor])
            elif ctype == "bool":
                exprs.append(str(int(bool(o.value))))
            else:
                exprs.append(cg.literal(o.value, ctype))
        expr = op.body(exprs, args, ctype)
        if ctype == "float64":  # the fp32-only precise division and square root: IEEE in float64
            expr = expr.replace("tl.div_rn(", "_div64(").replace("tl.sqrt_rn(", "tl.sqrt(")
        src(f"y = {expr}")
        # the type y has: the input's for a copy, bool for comparisons, else the compute type
        y_type = {"copy": spec.inputs[inputs[0]].dtype, "compare": "bool", "logical": "bool"}.get(op.kind, ctype)
        value = "y" if y_type == out.dtype else f"y.to({cg.tl_type(out.dtype)})"
        if y_type in ("bool",) + cg.INT_TYPES and out.dtype in ("float16", "bfloat16"):
            # integers reach half types through fp32, as c10::Half/BFloat16 convert them
            value = f"y.to(tl.float32).to({cg.tl_type(out.dtype)})"
        src(f"tl.store(out0_ptr + {out_off}, {value}{mask_kw})")
        src.dedent()
        return src.text(), kname

    # --- validation inputs --------------------------------------------------------------------
    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        g = sample_generator(seed, device)
        out_dtype = spec.outputs[0].dtype if spec.outputs else None
        tensors = []
        for m in spec.inputs:
            cast_to_int = (spec.op == "aten._to_copy.default" and cg.is_float(m.dtype)
                           and out_dtype is not None and cg.is_int(out_dtype))
            if cast_to_int:
                # float -> integer conversion is undefined outside the target's range (and for NaN):
                # draw in range instead of the edge kinds that leave it
                t = sample_tensor(m, g, "random" if kind in ("special", "large") else kind)
                info = torch.iinfo(getattr(torch, out_dtype))
                _restrict(t, m, lambda f: f.clamp(max(info.min, -1000), min(info.max, 1000)))
                if out_dtype == "uint8":
                    _restrict(t, m, lambda f: f.abs())
            else:
                t = sample_tensor(m, g, kind)
                if spec.op in _INT_DIVISIONS and len(tensors) == 1 and not m.torch_dtype.is_floating_point:
                    _restrict(t, m, lambda f: f.masked_fill(f == 0, 1))  # ATen raises on integer x // 0
            tensors.append(to_device(t, device))
        return tensors


def _bucketed_read(m: TensorMeta, out: TensorMeta) -> tuple[str, int] | None:
    """How a bucketed kernel reads contiguous input ``m`` (of more than one element) at the flat
    output index: ("rows", k) when ``m`` is the output's first k dims followed by size-1 dims (k =
    rank: the same shape), ("bias", k) when it is the output's last k dims after leading size-1
    dims; None otherwise. Which of those dims may vary, the caller checks."""
    if len(m.shape) == len(out.shape):
        k = len(m.shape)
        while k and m.shape[k - 1] == 1 and out.shape[k - 1] != 1:
            k -= 1
        if m.shape[:k] == out.shape[:k] and all(s == 1 for s in m.shape[k:]):
            return "rows", k
    shape = list(m.shape)
    while len(shape) > 1 and shape[0] == 1:
        shape.pop(0)
    if tuple(shape) == out.shape[len(out.shape) - len(shape):]:
        return "bias", len(shape)
    return None


def _restrict(t: torch.Tensor, meta: TensorMeta, fn) -> None:
    """Apply ``fn`` to every element of the storage behind the strided sample ``t`` (in place)."""
    if not meta.numel:
        return
    span = 1 + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride))
    flat = torch.as_strided(t, (span,), (1,), t.storage_offset())
    flat.copy_(fn(flat.clone()))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())



FAMILY = ElementwiseFamily()
