"""Decompositions of the triangular linear algebra outside ``linalg.*`` (issue 44) into static loops
of elementwise ops, row sums and gathers, one step per row: merged into
decompositions.OWN_DECOMPOSITIONS.

- ``triangular_solve``: substitution, row by row from the end of the triangle (``transpose``
  and ``unitriangular`` too); only the triangle of A is read, as BLAS's trsm reads it; the
  second output is A broadcast to the batch, as ATen returns it;
- ``lu_unpack``: L and U by triangle masks, P from the pivots as their row swaps applied in
  order to ``arange(m)`` (LAPACK's convention: A = P L U); a pivot out of [1, m] raises;
- ``linalg_lu_solve``: P^T, then the two triangular solves (``adjoint`` and ``left=False`` by
  transposes);
- ``linalg_lu_factor_ex`` (with pivoting, as on the CPU): Gaussian elimination column by column,
  the pivot the first row of largest magnitude at or below the diagonal (LAPACK's isamax), info
  the first zero pivot (1-based); near-equal magnitudes may pick another row than LAPACK's
  blocked rounding does, as with any other LU;
- ``_linalg_slogdet``: that LU (of A^T where A is contiguous, as ATen), the sign from the diagonal's signs and the pivots' swaps;
- ``cholesky``: the Cholesky-Banachiewicz columns, reading the lower (upper) triangle as LAPACK
  does; an input that is not positive-definite raises.

Each step is a broadcast multiply, a row sum and a select over the whole matrix: O(n^2 k) work
per step, n steps. Matrices past STEPS_MAX rows decline (the loop is unrolled into the graph).
Where eager raises on the values (a pivot out of range, a non-positive pivot of Cholesky), the
values are read through a gather whose index is out of range exactly then: an IndexError where
ATen raises a RuntimeError. Real floating dtypes only (complex and integers decline).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from torch_kernelize.compiling.decomposition_registry import registrar

aten = torch.ops.aten
TRIANGULAR_DECOMPOSITIONS: dict[Any, Callable] = {}  # merged into decompositions.OWN_DECOMPOSITIONS
STEPS_MAX = 64  # rows of a matrix: one unrolled step each

_register = registrar(TRIANGULAR_DECOMPOSITIONS)


def _real(*ts: torch.Tensor) -> bool:
    return all(t.is_floating_point() for t in ts)


def _raise_unless(ok: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` read back through a gather of its elements whose index is out of range (an IndexError)
    wherever ``ok`` (broadcast to x's shape) is False."""
    flat = x.reshape(-1)
    n = flat.numel()
    index = torch.where(ok.expand(x.shape).reshape(-1), torch.arange(n, device=x.device), n)
    return flat.index_select(0, index).reshape(x.shape)


def _solve(a: torch.Tensor, b: torch.Tensor, upper: bool, unit: bool) -> torch.Tensor:
    """X with tri(A) X = B (A: (..., n, n), B: (..., n, k)), by substitution: row i of X is row i
    of B less the solved rows times A's row, over A's diagonal (1 if ``unit``)."""
    n = a.size(-1)
    row = torch.arange(n, device=a.device)
    keep = (row.unsqueeze(1) < row) if upper else (row.unsqueeze(1) > row)  # the strict triangle
    strict = torch.where(keep, a, 0.0)
    x = torch.zeros(b.shape, dtype=b.dtype, device=b.device)
    for i in (reversed(range(n)) if upper else range(n)):
        r = b[..., i, :] - (strict[..., i, :].unsqueeze(-1) * x).sum(-2)
        if not unit:
            r = r / a[..., i, i].unsqueeze(-1)
        x = torch.where((row == i).unsqueeze(-1), r.unsqueeze(-2), x)
    return x


def _batched(b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b and a broadcast over their batch dims (ATen's _linalg_broadcast_batch_dims)."""
    batch = torch.broadcast_shapes(b.shape[:-2], a.shape[:-2])
    return b.expand(*batch, *b.shape[-2:]), a.expand(*batch, *a.shape[-2:])


@_register(aten.triangular_solve.default)
def _triangular_solve(b, a, upper: bool = True, transpose: bool = False, unitriangular: bool = False):
    if not _real(a, b) or a.dim() < 2 or b.dim() < 2 or a.size(-1) != a.size(-2) \
            or b.size(-2) != a.size(-1) or a.size(-1) > STEPS_MAX:
        return NotImplemented
    b, a = _batched(b, a)
    coefficient = a.clone()
    if transpose:
        a, upper = a.mT, not upper
    return _solve(a, b, upper, unitriangular), coefficient


def _permutation(pivots: torch.Tensor, m: int) -> torch.Tensor:
    """perm (..., m): the pivots' row swaps (1-based: row i with row pivots[i] - 1) applied in order
    to arange(m); P[..., perm[..., j], j] = 1."""
    swap = pivots.to(torch.int64) - 1
    swap = _raise_unless((swap >= 0) & (swap < m), swap)  # ATen: pivots must be in [1, m]
    pos = torch.arange(m, device=pivots.device)
    perm = pos.expand(*pivots.shape[:-1], m)
    for i in range(pivots.size(-1)):
        j = swap[..., i:i + 1]
        at_i, at_j = perm[..., i:i + 1], perm.gather(-1, j)
        perm = torch.where(pos == i, at_j, torch.where(pos == j, at_i, perm))
    return perm


def _unpacked(lu: torch.Tensor, pivots: torch.Tensor, data: bool = True, with_p: bool = True):
    m, n = lu.shape[-2:]
    k = min(m, n)
    empty = lu.new_zeros(0)
    p = l_ = u = empty
    if with_p:
        perm = _permutation(pivots, m)
        p = (torch.arange(m, device=lu.device).unsqueeze(-1) == perm.unsqueeze(-2)).to(lu.dtype)
    if data:
        row, col = torch.arange(m, device=lu.device).unsqueeze(-1), torch.arange(n, device=lu.device)
        l_ = torch.where(row > col, lu, 0.0) + (row == col).to(lu.dtype)
        l_, u = l_[..., :, :k], torch.where(row <= col, lu, 0.0)[..., :k, :]
    return p, l_, u


@_register(aten.lu_unpack.default)
def _lu_unpack(lu, pivots, unpack_data: bool = True, unpack_pivots: bool = True):
    if not _real(lu) or lu.dim() < 2 or pivots.dtype != torch.int32 or min(lu.shape[-2:]) > STEPS_MAX \
            or pivots.shape != lu.shape[:-2] + (min(lu.shape[-2:]),):
        return NotImplemented
    return _unpacked(lu, pivots, unpack_data, unpack_pivots)


@_register(aten.linalg_lu_solve.default)
def _lu_solve(lu, pivots, b, *, left: bool = True, adjoint: bool = False):
    """A X = B with A = P L U; A^T X = B (``adjoint``); X A = B (not ``left``: A^T X^T = B^T)."""
    n = lu.size(-1)
    if not _real(lu, b) or lu.dim() < 2 or lu.size(-2) != n or n > STEPS_MAX or pivots.dtype != torch.int32:
        return NotImplemented
    if not left:
        return _lu_solve(lu, pivots, b.mT, left=True, adjoint=not adjoint).mT
    if b.size(-2) != n:
        return NotImplemented
    perm = _permutation(pivots, n)
    b, lu = _batched(b, lu)
    perm = perm.expand(*b.shape[:-2], n)
    if not adjoint:  # L U X = P^T B: P^T B's row j is B's row perm[j]
        y = b.gather(-2, perm.unsqueeze(-1).expand(b.shape))
        return _solve(lu, _solve(lu, y, upper=False, unit=True), upper=True, unit=False)
    w = _solve(lu.mT, b, upper=False, unit=False)   # U^T L^T (P^T X) = B
    w = _solve(lu.mT, w, upper=True, unit=True)
    inverse = torch.argsort(perm, -1)  # X's row perm[j] is w's row j
    return w.gather(-2, inverse.unsqueeze(-1).expand(w.shape))


def _lu_factor(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(LU, pivots, info) of A (..., m, n) by elimination with partial pivoting; a zero pivot
    leaves its column unscaled (LAPACK)."""
    m, n = a.shape[-2:]
    rows, cols = torch.arange(m, device=a.device), torch.arange(n, device=a.device)
    lu, pivots, infos = a, [], []
    for j in range(min(m, n)):
        size = torch.where(rows >= j, lu[..., :, j].abs(), -1.0)
        p = torch.argmax(size, -1, keepdim=True)  # (..., 1): the first largest
        row_j, row_p = lu[..., j:j + 1, :], lu.gather(-2, p.unsqueeze(-1).expand(*p.shape[:-1], 1, n))
        lu = torch.where((rows == j).unsqueeze(-1), row_p, torch.where((rows.unsqueeze(-1) == p.unsqueeze(-1)), row_j, lu))
        d = lu[..., j:j + 1, j:j + 1]
        below = (rows > j).unsqueeze(-1)
        l_ = torch.where(below & (d != 0), lu[..., :, j:j + 1] / d, lu[..., :, j:j + 1])
        update = lu - torch.where(d != 0, l_, 0.0) * lu[..., j:j + 1, :]
        lu = torch.where(below & (cols > j), update, torch.where(below & (cols == j), l_, lu))
        pivots.append(p)
        infos.append(torch.where(d.reshape(d.shape[:-2]) == 0, float(j + 1), float(m + n + 1)))
    if not pivots:
        return lu.clone(), torch.zeros(*a.shape[:-2], 0, dtype=torch.int32, device=a.device), \
            torch.zeros(a.shape[:-2], dtype=torch.int32, device=a.device)
    first = torch.stack(infos, -1).amin(-1)  # (in float32, the reductions family's type: exact)
    info = torch.where(first > m + n, 0.0, first).to(torch.int32)
    return lu, (torch.cat(pivots, -1) + 1).to(torch.int32), info


@_register(aten.linalg_lu_factor_ex.default)
def _linalg_lu_factor_ex(a, *, pivot: bool = True, check_errors: bool = False):
    if not pivot or check_errors or not _real(a) or a.dim() < 2 or min(a.shape[-2:]) > STEPS_MAX:
        return NotImplemented  # (no pivoting: ATen's CPU error; check_errors raises on values)
    return _lu_factor(a)


@_register(aten._linalg_slogdet.default)
def _linalg_slogdet(a):
    """sign and log|det| of A from an LU (the one ATen returns: of A^T where A is contiguous,
    its layout trick, else of A; det(A^T) = det(A)): the diagonal's signs and log-magnitudes,
    times -1 per pivot that swapped rows (a zero on the diagonal: sign 0, log|det| -inf)."""
    n = a.size(-1)
    if not _real(a) or a.dim() < 2 or a.size(-2) != n or n > STEPS_MAX:
        return NotImplemented
    lu, pivots, _ = _lu_factor(a.mT if a.is_contiguous() else a)
    if n == 0:  # (the empty product: no reduction of nothing)
        return torch.ones(a.shape[:-2], dtype=a.dtype, device=a.device), \
            torch.zeros(a.shape[:-2], dtype=a.dtype, device=a.device), lu, pivots
    diag = torch.diagonal(lu, 0, -2, -1)
    swaps = (pivots != torch.arange(1, n + 1, device=a.device, dtype=torch.int32)).to(a.dtype).sum(-1)
    negatives = (diag < 0).to(a.dtype).sum(-1)
    sign = 1.0 - 2.0 * torch.remainder(swaps + negatives, 2.0)
    sign = torch.where((diag == 0).to(a.dtype).sum(-1) > 0, 0.0, sign)
    return sign, diag.abs().log().sum(-1), lu, pivots


@_register(aten.cholesky.default)
def _cholesky(a, upper: bool = False):
    """L L^T = A from A's lower triangle (U^T U = A from its upper one: the lower factor of A^T,
    transposed); column j: d = sqrt(a_jj - |L_j|^2), then (a_ij - L_i . L_j) / d below it."""
    n = a.size(-1)
    if not _real(a) or a.dim() < 2 or a.size(-2) != n or n > STEPS_MAX:
        return NotImplemented
    if upper:
        return _cholesky(a.mT, False).mT
    row = torch.arange(n, device=a.device)
    low = torch.zeros(a.shape, dtype=a.dtype, device=a.device)
    diag = []
    for j in range(n):
        v = a[..., :, j] - (low * low[..., j:j + 1, :]).sum(-1)
        d = v[..., j:j + 1]
        diag.append(d)
        col = torch.where(row == j, torch.sqrt(d), torch.where(row > j, v / torch.sqrt(d), 0.0))
        low = torch.where(row == j, col.unsqueeze(-1), low)  # (row == j: the column j, broadcast over rows)
    if not n:
        return low
    pivots = torch.cat(diag, -1)  # (NaN is no pivot either)
    return _raise_unless((pivots > 0).unsqueeze(-1), low)
