"""Plain-Triton math helpers for the pointwise family (issue 44): inverse trigonometric and
hyperbolic functions, tan, hypot, round, erfc, erfinv, i0, lgamma, digamma and polygamma, nextafter,
igamma and igammac.

Each is a ``@triton.jit`` function emitted into a kernel's module only when its op uses it (the
``helpers`` of its ``PointwiseOp``; a helper that calls another lists both, callee first). They use
only what runs on the Triton interpreter and compiles on CUDA alike: tl.exp/log/sin/cos/sqrt/erf/
floor, arithmetic, bitcasts (no libdevice). They compute in fp32 (the family's opmath for
fp32/fp16/bf16 outputs) to the accuracy the float64 reference of validation asks (core/tolerances:
1e-4 relative, and edge trials with 0, -0, +-inf, NaN, |x| ~ 1e4), keeping each function's special
values: the sign of zero where the op keeps it, poles as infinities, NaN outside the domain.
"""
from __future__ import annotations

# Chebyshev coefficients of exp(-x) I0(x) on [0, 8] and of exp(-x) sqrt(x) I0(x) on [8, inf]
# (Cephes, as ATen's calc_i0), without the leading terms below fp32's resolution.
_I0_A = (-5.18979560163526290666E-10, 2.65982372468238665035E-9, -1.30002500998624804212E-8,
         6.04699502254191894932E-8, -2.67079385394061173391E-7, 1.11738753912010371815E-6,
         -4.41673835845875056359E-6, 1.64484480707288970893E-5, -5.75419501008210370398E-5,
         1.88502885095841655729E-4, -5.76375574538582365885E-4, 1.63947561694133579842E-3,
         -4.32430999505057594430E-3, 1.05464603945949983183E-2, -2.37374148058994688156E-2,
         4.93052842396707084878E-2, -9.49010970480476444210E-2, 1.71620901522208775349E-1,
         -3.04682672343198398683E-1, 6.76795274409476084995E-1)
_I0_B = (-1.32158118404477131188E-11, -3.14991652796324136454E-11, 1.18891471078464383424E-11,
         4.94060238822496958910E-10, 3.39623202570838634515E-9, 2.26666899049817806459E-8,
         2.04891858946906374183E-7, 2.89137052083475648297E-6, 6.88975834691682398426E-5,
         3.36911647825569408990E-3, 8.04490411014108831608E-1)


def _chebyshev(name: str, coeffs: tuple[float, ...]) -> str:
    """A Clenshaw evaluation of a Chebyshev series (Cephes' chbevl), unrolled."""
    lines = ["@triton.jit", f"def {name}(x):", "    b1 = tl.zeros_like(x)", f"    b0 = b1 + {coeffs[0]!r}", "    b2 = b1"]
    for c in coeffs[1:]:
        lines += ["    b2 = b1", "    b1 = b0", f"    b0 = x * b1 - b2 + {c!r}"]
    lines.append("    return 0.5 * (b0 - b2)")
    return "\n".join(lines)


MATH_HELPERS: dict[str, str] = {
    "_atan": '''
@triton.jit
def _atan(x):
    # Cephes atanf: |x| reduced to [0, tan(pi/8)] by atan(x) = pi/2 + atan(-1/x) (x > tan(3pi/8))
    # or pi/4 + atan((x-1)/(x+1)), then an odd minimax polynomial (2 ulp); the sign of x (and -0) kept
    a = tl.abs(x)
    big = a > 2.414213562373095
    mid = (a > 0.4142135623730950) & ~big
    t = tl.where(big, -1.0 / a, tl.where(mid, (a - 1.0) / (a + 1.0), a))
    base = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z = t * t
    p = (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * t + t
    r = base + p
    return tl.where(x < 0.0, -r, tl.where(x == 0.0, x, r))
''',
    "_atan2": '''
@triton.jit
def _atan2(y, x):
    # atan of min/max of |x|, |y| (in [0, 1]), then the octant; C's special cases: atan2(+-0, -0) =
    # +-pi, atan2(+-inf, +-inf) = +-pi/4 or +-3pi/4, the sign of y (and of a zero y) kept
    ax = tl.abs(x)
    ay = tl.abs(y)
    mx = tl.where(ax > ay, ax, ay)
    mn = tl.where(ax > ay, ay, ax)
    t = mn / mx
    t = tl.where(mx == 0.0, 0.0, tl.where((ax == float('inf')) & (ay == float('inf')), 1.0, t))
    r = _atan(t)
    r = tl.where(ay > ax, 1.5707963267948966 - r, r)
    r = tl.where(x.to(tl.int32, bitcast=True) < 0, 3.141592653589793 - r, r)
    r = tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)
    return tl.where((x != x) | (y != y), float('nan'), r)
''',
    "_asin": '''
@triton.jit
def _asin(x):
    # atan(x / sqrt((1 - x)(1 + x))): 1 - x is exact near 1, so no cancellation; NaN past |x| > 1
    return _atan(x / tl.sqrt_rn((1.0 - x) * (1.0 + x)))
''',
    "_acos": '''
@triton.jit
def _acos(x):
    # 2 atan(sqrt((1 - x) / (1 + x))): relative accuracy near 1 (result ~0) and near -1 (pi)
    return 2.0 * _atan(tl.sqrt_rn((1.0 - x) / (1.0 + x)))
''',
    "_acosh": '''
@triton.jit
def _acosh(x):
    # log1p(t + sqrt(2t + t^2)), t = x - 1 (exact near 1); log(2x) past 1e18; NaN below 1
    t = x - 1.0
    r = _log1p(t + tl.sqrt_rn(2.0 * t + t * t))
    r = tl.where(x > 1e18, tl.log(x) + 0.6931471805599453, r)
    return tl.where(x < 1.0, float('nan'), r)
''',
    "_sinh": '''
@triton.jit
def _sinh(x):
    # (e + e / (e + 1)) / 2 with e = expm1(|x|): accurate near 0; past 10, exp(|x|/2)^2 / 2, which
    # stays finite up to fp32's range (exp(|x|) alone overflows first); -0 stays -0
    a = tl.abs(x)
    e = _expm1(a)
    r = 0.5 * (e + e / (e + 1.0))
    h = tl.exp(0.5 * a)
    r = tl.where(a > 10.0, (0.5 * h) * h, r)
    return tl.where(x < 0.0, -r, tl.where(x == 0.0, x, r))
''',
    "_tan": '''
@triton.jit
def _tan(x):
    # Cephes tanf on z = x - j pi/2, with the reduction in float64 (exact for |x| < 1e5: pi/2 split
    # in a 33-bit head and a tail), so tan keeps its relative accuracy near the poles (-1/tan(z) for
    # odd j); beyond 1e5, sin/cos of the platform, whose reductions are exact
    xd = x.to(tl.float64)
    j = tl.floor(xd * 0.6366197723675814 + 0.5)
    zd = (xd - j * 1.57079632673412561417) - j * 6.07710050650619224932e-11
    z = zd.to(tl.float32)
    zz = z * z
    p = (((((9.38540185543e-3 * zz + 3.11992232697e-3) * zz + 2.44301354525e-2) * zz + 5.34112807005e-2) * zz
          + 1.33387994085e-1) * zz + 3.33331568548e-1) * zz * z + z
    odd = (j - 2.0 * tl.floor(j * 0.5)) != 0.0
    r = tl.where(odd, -1.0 / p, p)
    r = tl.where(tl.abs(x) > 1e5, tl.sin(x) / tl.cos(x), r)
    return tl.where(x == 0.0, x, r)
''',
    "_hypot": '''
@triton.jit
def _hypot(x, y):
    # max * sqrt(1 + (min/max)^2): no overflow or underflow of the squares; inf wins over NaN
    a = tl.abs(x)
    b = tl.abs(y)
    mx = tl.where(a > b, a, b)
    mn = tl.where(a > b, b, a)
    q = mn / mx
    r = mx * tl.sqrt_rn(1.0 + q * q)
    r = tl.where(mx == 0.0, 0.0, r)
    r = tl.where((a != a) | (b != b), float('nan'), r)
    return tl.where((a == float('inf')) | (b == float('inf')), float('inf'), r)
''',
    "_round_even": '''
@triton.jit
def _round_even(x):
    # nearbyint (ties to even): floor, then up past a half or at a half from an odd floor; x - floor(x)
    # is exact in fp32, and past 2^23 every value is already whole; the sign of a zero result is x's
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
    return tl.where(r == 0.0, x * 0.0, r)
''',
    "_erfc": '''
@triton.jit
def _erfc(x):
    # 1 - erf(x) where that does not cancel (x < 0.5); else t exp(-x^2 + P(t)), t = 1 / (1 + x/2)
    # (Numerical Recipes' erfcc, relative error < 1.2e-7), relative accuracy down to the underflow
    a = tl.abs(x)
    t = 1.0 / (1.0 + 0.5 * a)
    p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    tail = t * tl.exp(-a * a + p)
    tail = tl.where(x < 0.0, 2.0 - tail, tail)
    return tl.where(x < 0.5, 1.0 - tl.erf(x), tail)
''',
    "_erfinv": '''
@triton.jit
def _erfinv(x):
    # Giles' single-precision approximation ("Approximating the erfinv function", 2010): a
    # polynomial in w - 2.5 (w = -log(1 - x^2) < 5) or in sqrt(w) - 3, then one Newton step on
    # erf (|x| < 0.5) or on erfc(y) - (1 - |x|), where 1 - |x| is exact and erf(y) would round
    # to 1. +-1 give +-inf, |x| > 1 NaN; -0 stays -0
    a = tl.abs(x)
    w = -tl.log((1.0 - a) * (1.0 + a))
    c = w - 2.5
    p = 2.81022636e-08
    p = p * c + 3.43273939e-07
    p = p * c - 3.5233877e-06
    p = p * c - 4.39150654e-06
    p = p * c + 0.00021858087
    p = p * c - 0.00125372503
    p = p * c - 0.00417768164
    p = p * c + 0.246640727
    p = p * c + 1.50140941
    t = tl.sqrt_rn(w) - 3.0
    q = -0.000200214257
    q = q * t + 0.000100950558
    q = q * t + 0.00134934322
    q = q * t - 0.00367342844
    q = q * t + 0.00573950773
    q = q * t - 0.0076224613
    q = q * t + 0.00943887047
    q = q * t + 1.00167406
    q = q * t + 2.83297682
    y = tl.where(w < 5.0, p, q) * a
    slope = 1.1283791670955126 * tl.exp(-y * y)
    y = tl.where(a < 0.5, y - (tl.erf(y) - a) / slope, y + (_erfc(y) - (1.0 - a)) / slope)
    y = tl.where(a == 1.0, float('inf'), tl.where(a > 1.0, float('nan'), y))
    return tl.where(x < 0.0, -y, tl.where(x == 0.0, x, y))
''',
    "_igamma": '''
@triton.jit
def _igamma(a, x, UPPER: tl.constexpr):
    # regularized incomplete gamma P(a, x) (UPPER: Q = 1 - P) in float64, as ATen's calc_igamma
    # chooses: for a > 1000 Temme's uniform expansion to its first term, Q = erfc(eta sqrt(a/2)) / 2
    # + exp(-a eta^2 / 2) / sqrt(2 pi a) c0(eta) (the next term is below 1e-7); else Cephes: the
    # series of P (x <= 1 or x <= a) or the continued fraction of Q, until every lane has converged
    # (~7 sqrt(a) terms, 2000 at most), times x^a e^-x / Gamma(a) (from lgamma, exact in float64)
    ad = a.to(tl.float64)
    xd = x.to(tl.float64)
    active = (ad > 0.0) & (xd > 0.0) & (ad < float('inf')) & (xd < float('inf'))
    big = active & (ad > 1000.0)
    cf = active & ~big & (xd > 1.0) & (xd > ad)
    series = active & ~big & ~cf
    sa = tl.where(active, ad, 1.0)
    sx = tl.where(active, xd, 1.0)
    pre = tl.exp(sa * tl.log(sx) - sx - _lgamma_pos(sa))
    r = sa
    c = tl.zeros_like(sa) + 1.0
    total = c
    y = 1.0 - sa
    z = sx + y + 1.0
    k = tl.zeros_like(sa)
    pkm2 = c
    qkm2 = sx
    pkm1 = sx + 1.0
    qkm1 = z * sx
    frac = pkm1 / qkm1
    done = ~(series | cf)
    n = tl.full([], 0, tl.int32)
    while (n < 2000) & (tl.min(done.to(tl.int32)) == 0):
        r = r + 1.0
        c = c * sx / r
        total = total + c
        k = k + 1.0
        y = y + 1.0
        z = z + 2.0
        yc = y * k
        pk = pkm1 * z - pkm2 * yc
        qk = qkm1 * z - qkm2 * yc
        nxt = tl.where(qk != 0.0, pk / tl.where(qk != 0.0, qk, 1.0), frac)
        step = tl.where(qk != 0.0, tl.abs((frac - nxt) / nxt), 1.0)
        frac = nxt
        pkm2 = pkm1
        pkm1 = pk
        qkm2 = qkm1
        qkm1 = qk
        huge = tl.abs(pk) > 4503599627370496.0
        pkm2 = tl.where(huge, pkm2 * 2.220446049250313e-16, pkm2)
        pkm1 = tl.where(huge, pkm1 * 2.220446049250313e-16, pkm1)
        qkm2 = tl.where(huge, qkm2 * 2.220446049250313e-16, qkm2)
        qkm1 = tl.where(huge, qkm1 * 2.220446049250313e-16, qkm1)
        done = done | (series & (c <= total * 1e-15)) | (cf & (step <= 1e-15))
        n += 1
    lower = tl.where(series, total * pre / sa, 1.0 - frac * pre)
    # Temme: lam = x / a, eta = sign(lam - 1) sqrt(2 (lam - 1 - log lam)); c0 = 1/(lam - 1) - 1/eta,
    # by its series near lam = 1, where the two cancel
    d = (sx - sa) / sa
    g = tl.where(tl.abs(d) < 0.5, d - _log1p(d), d - tl.log(1.0 + d))
    eta = tl.where(d < 0.0, -1.0, 1.0) * tl.sqrt(2.0 * g)
    se = tl.where(eta == 0.0, 1.0, eta)
    sd = tl.where(d == 0.0, 1.0, d)
    c0 = tl.where(tl.abs(eta) < 0.05, -0.3333333333333333 + eta * (0.08333333333333333 + eta * (
        -0.014814814814814815 + eta * (0.0011574074074074073 + eta * 0.0003527336860670194))), 1.0 / sd - 1.0 / se)
    upper = 0.5 * _erfc(eta * tl.sqrt(0.5 * sa)) + tl.exp(-0.5 * sa * eta * eta) / tl.sqrt(6.283185307179586 * sa) * c0
    lower = tl.where(big, 1.0 - upper, lower)
    # ATen's special values, checked in its order (a NaN passes the checks before it): a negative
    # argument NaN; a = 0: 1 (NaN at x = 0); x = 0: 0; a = inf: 0 (NaN at x = inf); x = inf: 1
    lower = tl.where((ad != ad) | (xd != xd), float('nan'), lower)
    lower = tl.where(xd == float('inf'), 1.0, lower)
    lower = tl.where(ad == float('inf'), tl.where(xd == float('inf'), float('nan'), 0.0), lower)
    lower = tl.where(xd == 0.0, 0.0, lower)
    lower = tl.where(ad == 0.0, tl.where(xd > 0.0, 1.0, float('nan')), lower)
    lower = tl.where((ad < 0.0) | (xd < 0.0), float('nan'), lower)
    if UPPER:  # Q itself where it was computed, else 1 - P (the special values, exact)
        lower = tl.where(big, upper, tl.where(cf, frac * pre, 1.0 - lower))
    return lower.to(tl.float32)
''',
    "_i0_a": _chebyshev("_i0_a", _I0_A),
    "_i0_b": _chebyshev("_i0_b", _I0_B),
    "_i0": '''
@triton.jit
def _i0(x):
    # Cephes i0: exp(|x|) times a Chebyshev series in |x|/2 - 2 (|x| <= 8) or 32/|x| - 2 over
    # sqrt|x|; exp(|x|) as exp(|x|/2)^2 so that it stays finite as far as I0 does. +-inf gives NaN,
    # as ATen's calc_i0 (inf * series / sqrt(inf)) does in float64 too
    a = tl.abs(x)
    h = tl.exp(0.5 * a)
    small = _i0_a(0.5 * a - 2.0)
    large = _i0_b(32.0 / a - 2.0) / tl.sqrt_rn(a)
    r = (h * tl.where(a <= 8.0, small, large)) * h
    return tl.where(a == float('inf'), float('nan'), r)
''',
    "_lgamma_pos": '''
@triton.jit
def _lgamma_pos(x):
    # log|Gamma(x)| for x > 0: Lanczos' series (g = 5, Numerical Recipes' gammln, < 2e-10), with
    # (x + 0.5) log(x + 5.5) - (x + 5.5) exact enough to reach fp32's range
    s = 1.000000000190015 + 76.18009172947146 / (x + 1.0) - 86.50532032941677 / (x + 2.0) \\
        + 24.01409824083091 / (x + 3.0) - 1.231739572450155 / (x + 4.0) \\
        + 1.208650973866179e-3 / (x + 5.0) - 5.395239384953e-6 / (x + 6.0)
    t = x + 5.5
    return (x + 0.5) * tl.log(t) - t + (tl.log(2.5066282746310005 * s) - tl.log(x))
''',
    "_sinpi_abs": '''
@triton.jit
def _sinpi_abs(x):
    # |sin(pi x)| from x less its nearest integer (exact, in [-1/2, 1/2], x itself when tiny): pi x
    # itself would lose the digits that matter
    m = tl.abs(x - tl.floor(x + 0.5))
    return tl.sin(3.141592653589793 * m)
''',
    "_lgamma": '''
@triton.jit
def _lgamma(x):
    # x > 0 directly; x < 0 by reflection, log(pi / |sin(pi x)|) - lgamma(1 - x); inf at 0, -0,
    # the non-positive integers and +-inf
    y = tl.where(x < 0.0, 1.0 - x, x)
    g = _lgamma_pos(y)
    refl = tl.log(3.141592653589793 / _sinpi_abs(x)) - g
    r = tl.where(x < 0.0, refl, g)
    pole = (x == 0.0) | ((x < 0.0) & (tl.floor(x) == x)) | (tl.abs(x) == float('inf'))
    return tl.where(pole, float('inf'), r)
''',
    "_cotpi": '''
@triton.jit
def _cotpi(x):
    # cot(pi x) from x less its nearest integer (exact, in [-1/2, 1/2]): accurate near the poles
    m = x - tl.floor(x + 0.5)
    return tl.cos(3.141592653589793 * m) / tl.sin(3.141592653589793 * m)
''',
    "_digamma": '''
@triton.jit
def _digamma(x):
    # x >= 0: shifted to >= 10 by psi(x) = psi(x + 1) - 1/x (ten steps at most), then the asymptotic
    # series log q - 1/(2q) - sum B2k / (2k q^2k); x < 0: psi(1 - x) - pi cot(pi x). As ATen: -+inf at
    # +-0, NaN at the negative integers and -inf
    q = tl.where(x < 0.0, 1.0 - x, x)
    acc = tl.zeros_like(q)
    for _ in tl.static_range(10):
        small = q < 10.0
        acc = tl.where(small, acc - 1.0 / q, acc)
        q = tl.where(small, q + 1.0, q)
    z = 1.0 / (q * q)
    series = z * (8.33333333333333333333e-2 + z * (-8.33333333333333333333e-3 + z * (3.96825396825396825397e-3
                  + z * (-4.16666666666666666667e-3 + z * (7.57575757575757575758e-3 + z * -2.10927960927960927961e-2)))))
    r = acc + tl.log(q) - 0.5 / q - series
    r = tl.where(x < 0.0, r - 3.141592653589793 * _cotpi(x), r)
    r = tl.where(x == 0.0, tl.where(x.to(tl.int32, bitcast=True) < 0, float('inf'), -float('inf')), r)
    return tl.where((x < 0.0) & (tl.floor(x) == x), float('nan'), r)
''',
    "_polygamma": '''
@triton.jit
def _polygamma(x, N: tl.constexpr, C: tl.constexpr):
    # psi^(n)(x) = C zeta(n+1, q), C = (-1)^(n+1) n!, for x > 0: ten shift steps (q^-s of each) to
    # q >= 10, then Euler-Maclaurin: q^(1-s)/(s-1) + q^-s/2 + sum B2k/(2k)! (s)_(2k-1) q^(1-s-2k).
    # x < 0 by reflection: psi^(n)(x) = (-1)^n psi^(n)(1 - x) - pi d^n/dx^n cot(pi x) (n = 1..4).
    # At 0, the negative integers and -inf ATen's zeta is inf (C * inf); at +inf psi^(1) is 0 and the
    # others NaN, as ATen gives them
    q = tl.where(x < 0.0, 1.0 - x, x)
    acc = tl.zeros_like(q)
    for _ in tl.static_range(10):
        small = q < 10.0
        r = 1.0 / q
        p = r
        for _k in tl.static_range(N):
            p = p * r
        acc = tl.where(small, acc + p, acc)
        q = tl.where(small, q + 1.0, q)
    r = 1.0 / q
    r2 = r * r
    pn = r
    for _k in tl.static_range(N - 1):
        pn = pn * r
    p = pn * r
    t = p * r * (N + 1)
    series = t * 0.08333333333333333
    t = t * r2 * ((N + 2) * (N + 3))
    series += t * -0.001388888888888889
    t = t * r2 * ((N + 4) * (N + 5))
    series += t * 3.306878306878307e-05
    t = t * r2 * ((N + 6) * (N + 7))
    series += t * -8.267195767195767e-07
    t = t * r2 * ((N + 8) * (N + 9))
    series += t * 2.08767569878681e-08
    v = (acc + (pn / N + 0.5 * p + series)) * C
    # reflection: d^n/dx^n cot(pi x) with c = cot, s2 = csc^2 = 1 + c^2
    c = _cotpi(x)
    s2 = 1.0 + c * c
    if N == 1:
        d = -3.141592653589793 * s2
    elif N == 2:
        d = 19.739208802178716 * c * s2
    elif N == 3:
        d = -62.01255336059963 * s2 * (s2 + 2.0 * c * c)
    else:
        d = 779.2727283380762 * c * s2 * (2.0 * s2 + c * c)
    if N % 2 == 1:
        refl = -3.141592653589793 * d - v
    else:
        refl = -3.141592653589793 * d + v
    v = tl.where(x < 0.0, refl, v)
    v = tl.where((x <= 0.0) & (tl.floor(x) == x), C * float('inf'), v)
    if N == 1:
        # ATen's trigamma reflects with sin(pi x) in float64, which is not 0 at a negative integer
        # k: its value there is pi^2 / sin(fl(pi) k)^2 (finite, ~1e32), and NaN at -inf
        s64 = tl.sin(x.to(tl.float64) * 3.141592653589793)
        v = tl.where((x <= 0.0) & (tl.floor(x) == x), (9.869604401089358 / (s64 * s64)).to(tl.float32), v)
        v = tl.where(x == float('inf'), 0.0, v)
    else:
        v = tl.where(x == float('inf'), float('nan'), v)
    return v
''',
    "_nextafter": '''
@triton.jit
def _nextafter(x, y):
    # one fp32 ulp from x towards y, on the bits: y where they are equal, the smallest subnormal
    # with y's sign from a zero, NaN where either is NaN
    b = x.to(tl.int32, bitcast=True)
    up = (y > x) == (x > 0.0)
    nb = tl.where(up, b + 1, b - 1)
    nb = tl.where(x == 0.0, tl.where(y > 0.0, 1, -2147483647), nb)
    r = nb.to(tl.float32, bitcast=True)
    r = tl.where(x == y, y, r)
    return tl.where((x != x) | (y != y), float('nan'), r)
''',
}
