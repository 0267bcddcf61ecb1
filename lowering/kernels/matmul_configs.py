"""The matmul family's configuration space: which configs are valid for a plan (power-of-two tiles
within the problem, accumulator registers, shared memory), the seeds a search starts from and the
steps it takes."""
from __future__ import annotations

from typing import Any

import torch

from torch_kernelize.lowering.kernels.base import SMS, Config, next_pow2
from torch_kernelize.lowering.kernels.matmul_group import Group
from torch_kernelize.lowering.kernels.matmul_plan import Plan

SMEM_BYTES = 232448          # sm_90: 227 KB of shared memory per block
MAX_ACC_REGS = 128           # fp32 accumulator registers per thread a config may use
GROUPS = (1, 4, 8, 16)


def _caps(plan: Plan) -> tuple[int, int, int]:
    """The largest tile along M, N and K: the next power of two of each size (at least 16)."""
    return (max(16, next_pow2(plan.M)), max(16, next_pow2(plan.N)), max(16, next_pow2(plan.K)))


def valid(plan: Plan | Group, c: Config) -> bool:
    """Whether ``c`` is a point of the configuration space for ``plan``."""
    if isinstance(plan, Group):
        # no ALIGN body: a group selects its pointers at run time (the build compiles them
        # 16-byte aligned, with a launch-time check)
        return not c.get("ALIGN", False) and valid(plan.rep, c)
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    if not all(16 <= v <= 256 and v & (v - 1) == 0 for v in (bm, bn, bk)):
        return False
    cm, cn, ck = _caps(plan)
    if bm > cm or bn > cn or bk > ck:
        return False
    if c["GROUP_M"] not in GROUPS or c["num_warps"] not in (4, 8) or not 2 <= c["num_stages"] <= 5:
        return False
    if c["DOT_UPCAST"] not in (True, False) or (c["DOT_UPCAST"] and plan.dtype == "float32"):
        return False
    if c.get("ALIGN", False) not in (True, False):
        return False
    if bm * bn > MAX_ACC_REGS * 32 * c["num_warps"]:
        return False
    elt = torch.finfo(getattr(torch, plan.dtype)).bits // 8
    return c["num_stages"] * (bm * bk + bk * bn) * elt <= SMEM_BYTES


def _fit(plan: Plan, bm: int, bn: int, bk: int, warps: int, stages: int, upcast: bool = False,
         group: int = 8, align: bool = False) -> Config:
    """A config of these tiles clipped to the problem, 4 warps for small tiles, stages within shared memory."""
    cm, cn, ck = _caps(plan)
    bm, bn, bk = min(bm, cm), min(bn, cn), min(bk, ck)
    if bm * bn <= 64 * 64:
        warps = 4
    elt = torch.finfo(getattr(torch, plan.dtype)).bits // 8
    while stages > 2 and stages * (bm * bk + bk * bn) * elt > SMEM_BYTES:
        stages -= 1
    return Config.of(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages,
                     DOT_UPCAST=bool(upcast and plan.dtype != "float32"), ALIGN=align)


def _filling(plan: Plan, tiles: Any = None) -> list[Config]:
    """A tile small enough to give every SM a program, where 128x128 tiles would leave most of
    them idle (an MoE expert's [~1000, 1024] x [1024, 512] makes 32 such tiles for 132 SMs):
    the largest of 128x64, 64x128, 64x64 that makes at least SMS tiles, else 64x64.
    ``tiles(bm, bn)``: the launch's tile count (a group's, over its members)."""
    tiles = tiles or (lambda bm, bn: plan.B * -(-plan.M // bm) * -(-plan.N // bn))
    if tiles(128, 128) * 2 > SMS:
        return []
    for bm, bn in ((128, 64), (64, 128), (64, 64)):
        if tiles(bm, bn) >= SMS:
            break
    return [_fit(plan, bm, bn, 64, 4, 4)]


def seeds(plan: Plan | Group) -> list[Config]:
    """The configs a search starts from (tiles clipped to the problem; a group's from its template)."""
    group = plan if isinstance(plan, Group) else None
    plan = group.rep if group else plan
    filling = _filling(plan, group.tiles if group else None)
    if plan.dtype == "float32":
        # ieee fp32 dots run on FMA units, not tensor cores: moderate tiles, shallow pipelines
        return [_fit(plan, 64, 64, 32, 4, 3), _fit(plan, 128, 64, 32, 8, 3),
                _fit(plan, 128, 128, 32, 8, 2), _fit(plan, 64, 128, 32, 4, 3),
                _fit(plan, 32, 32, 32, 4, 2), _fit(plan, 64, 64, 32, 4, 3, align=True)]
    # classic Hopper tensor-core tiles (Triton's tutorial / Inductor's mm configs), clipped
    # to the problem; a small tile for tiny shapes; the first with the run-time alignment
    # test (for builds that compile without alignment facts); fp32-upcast variants of the
    # first and the small one (the interpreter's bf16 dot is wrong; the search keeps what
    # validates on the target)
    return [_fit(plan, 128, 128, 64, 8, 3), *filling, _fit(plan, 128, 256, 64, 8, 3),
            _fit(plan, 64, 128, 32, 4, 4), _fit(plan, 128, 64, 32, 4, 4),
            _fit(plan, 256, 128, 64, 8, 3), _fit(plan, 32, 32, 32, 4, 2),
            _fit(plan, 128, 128, 64, 8, 3, align=True),
            _fit(plan, 128, 128, 64, 8, 3, upcast=True), _fit(plan, 32, 32, 32, 4, 2, upcast=True)]


def steps(plan: Plan | Group, c: Config) -> list[Config]:
    """The configs one step from ``c``: each tile size doubled and halved, the next GROUP_M, the
    other warp count, one stage more or less, the other dot and alignment variants."""
    cands = []
    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        cands += [c.replace(**{k: c[k] * 2}), c.replace(**{k: c[k] // 2})]
    g = GROUPS.index(c["GROUP_M"]) if c["GROUP_M"] in GROUPS else 2
    cands += [c.replace(GROUP_M=GROUPS[x]) for x in (g - 1, g + 1) if 0 <= x < len(GROUPS)]
    cands += [c.replace(num_warps=8 if c["num_warps"] == 4 else 4)]
    cands += [c.replace(num_stages=c["num_stages"] + 1), c.replace(num_stages=c["num_stages"] - 1)]
    cands += [c.replace(DOT_UPCAST=not c["DOT_UPCAST"]), c.replace(ALIGN=not c.get("ALIGN", False))]
    return cands
