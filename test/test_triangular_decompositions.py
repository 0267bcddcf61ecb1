"""Decompositions of the triangular linear algebra outside linalg.* (compiling/
decompositions_triangular.py) on a chip that runs none of them, against eager in float64:
triangular_solve (upper/lower, transposed, unit diagonal, batch broadcast), lu_unpack of wide and
tall LU, lu_solve (left/right, adjoint), lu_factor_ex (a singular matrix's info), slogdet (of a
singular matrix too), cholesky (both triangles); a pivot out of range and a
matrix that is not positive-definite raise."""
from __future__ import annotations

import functools

import pytest
import torch

from decomposition_testing import check_against_eager, lowered_decomposing

F64 = torch.float64
_check = functools.partial(check_against_eager, tol=1e-10)  # substitution and elimination round




def _matrix() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, 4, 4, dtype=F64) + 3 * torch.eye(4, dtype=F64)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_triangular_solve():
    a, b = _matrix(), torch.randn(4, 3, dtype=F64)
    op = "aten.triangular_solve.default"
    _check(lambda b, a: torch.triangular_solve(b, a), b, a, op=op)
    _check(lambda b, a: torch.triangular_solve(b, a, upper=False, transpose=True, unitriangular=True), b, a, op=op)


def test_lu_unpack_and_lu_solve():
    a = _matrix()
    for m in (a[0, :3], a[0, :, :3]):  # wide and tall
        _check(lambda lu, p: torch.lu_unpack(lu, p), *torch.linalg.lu_factor(m), op="aten.lu_unpack.default")
    lu, piv = torch.linalg.lu_factor(a)
    b = torch.randn(2, 4, 3, dtype=F64)
    op = "aten.linalg_lu_solve.default"
    _check(lambda lu, p, b: torch.linalg.lu_solve(lu, p, b), lu, piv, b, op=op)
    _check(lambda lu, p, b: torch.linalg.lu_solve(lu, p, b, left=False, adjoint=True), lu, piv, b.mT, op=op)
    piv[1, 0] = 5
    with pytest.raises(IndexError):
        lowered_decomposing(lambda lu, p: torch.lu_unpack(lu, p), lu, piv, op="aten.lu_unpack.default")([lu, piv])


def test_lu_factor_and_slogdet():
    a = _matrix()
    # singular with a zero row: every elimination order (LAPACK's LU of it, or of its transpose,
    # which MKL's slogdet takes on AVX-512) leaves an exact zero pivot; a row twice another left
    # MKL a 2e-16 pivot there, sign -1 where the LU of the matrix itself gives 0
    singular = torch.tensor([[1., 2., 3.], [0., 0., 0.], [1., 1., 1.]], dtype=F64)
    for m in (a[0, :3], singular):
        _check(lambda a: torch.linalg.lu_factor_ex(a), m, op="aten.linalg_lu_factor_ex.default")
    for m in (a[:, :3, :3], singular):
        _check(lambda a: torch.ops.aten._linalg_slogdet(a), m, op="aten._linalg_slogdet.default")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cholesky():
    a = _matrix()
    spd = a @ a.mT
    _check(lambda a: torch.cholesky(a, upper=True), spd, op="aten.cholesky.default")
    spd[1, 2, 2] = -1.0
    with pytest.raises(IndexError):
        lowered_decomposing(lambda a: torch.cholesky(a), spd, op="aten.cholesky.default")([spd])
