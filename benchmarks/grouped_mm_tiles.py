"""transformers' MoE expert matmul (``transformers::grouped_mm_fallback``) at the real-model suite's
Mixtral sizes: the grouped_mm family's tiles (lowering/kernels/grouped_mm.py), compiled ahead of time
as the fill stores them, against the op itself (a loop of cuBLAS calls after one host sync) and the
same loop without the sync (the offsets read beforehand: the floor of what the loop costs).

    python benchmarks/grouped_mm_tiles.py OUT.json      # CUDA only

Rows: 8192 tokens (batch 8 x 512, top-2) routed uniformly at random over 8 experts (seed 0);
gate/up K 2048 -> N 11264 and down K 5632 -> N 2048, fp16, the weight a transposed view as
transformers passes it. Each time is triton.testing.do_bench's median (25 warm-up, 200 ms); each
tile's max abs error against the op (tiles of the pointer kernel, then of the TMA variant:
lowering/kernels/grouped_mm.py); and both as fill_cache times a GRAPHED spec's race (the op's
host sync inside a captured model): behind 2 ms of queued GPU work, the tile captured and replayed
(``fill_cache/benchmark.queued_ms``). Also ``torch._grouped_mm`` where this torch has it (does it take
fp16, is it capturable). Exit codes: 0 done; 2 no CUDA device.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

# BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M (1: row tiles in order within a column, as before
# 2026-12-05), TMA (the persistent variant with tensor descriptors, one program per SM)
TILES = ((128, 256, 64, 8, 3, 1, False), (128, 256, 64, 8, 3, 8, False), (128, 256, 64, 8, 3, 16, False),
         (128, 128, 64, 8, 3, 8, False), (256, 128, 64, 8, 3, 8, False), (128, 128, 64, 4, 4, 8, False),
         (64, 256, 64, 4, 3, 8, False), (128, 256, 64, 8, 3, 8, True), (128, 256, 64, 8, 4, 8, True),
         (128, 256, 64, 8, 3, 16, True), (128, 128, 64, 8, 4, 8, True))
SHAPES = {"gate_up": (8192, 2048, 11264), "down": (8192, 5632, 2048)}


def main(out: Path) -> int:
    if not torch.cuda.is_available():
        print("grouped_mm_tiles: needs a CUDA device", file=sys.stderr)
        return 2
    import transformers.integrations.moe  # noqa: F401 (registers the op)
    from triton.testing import do_bench
    from torch_kernelize.building.programs import write_program
    from torch_kernelize.core.spec import KernelSpec
    from torch_kernelize.fill_cache.benchmark import queued_ms
    from torch_kernelize.lowering.kernels.base import Config
    from torch_kernelize.lowering.kernels.grouped_mm import FAMILY
    from torch_kernelize.serving.launch import load_program

    op = torch.ops.transformers.grouped_mm_fallback.default
    torch.manual_seed(0)
    offs = torch.bincount(torch.randint(0, 8, (8192,)), minlength=8).cumsum(0).to(torch.int32).cuda()
    ends, tmp, results = offs.tolist(), Path(tempfile.mkdtemp()), {}
    for name, (S, K, N) in SHAPES.items():
        x = torch.randn(S, K, device="cuda", dtype=torch.float16)
        w = (torch.randn(8, N, K, device="cuda", dtype=torch.float16) / K ** 0.5).transpose(1, 2)
        expected = op(x, w, offs)
        spec = KernelSpec.from_call(op, (x, w, offs), {}, expected)

        def loop() -> torch.Tensor:  # the op's own loop, its offsets read beforehand
            o, start = torch.zeros(S, N, device="cuda", dtype=x.dtype), 0
            for e, end in enumerate(ends):
                torch.mm(x[start:end], w[e], out=o[start:end])
                start = end
            return o
        row = {"vendor_ms": do_bench(lambda: op(x, w, offs), warmup=25, rep=200),
               "loop_no_sync_ms": do_bench(loop, warmup=25, rep=200),
               "vendor_queued_ms": queued_ms(lambda: op(x, w, offs))}
        row["torch._grouped_mm"] = _torch_grouped(x, w, offs, expected, queued_ms)
        programs = torch.cuda.get_device_properties(0).multi_processor_count
        for i, (bm, bn, bk, warps, stages, group, tma) in enumerate(TILES):
            config = Config.of(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, DOT_UPCAST=False,
                               GROUP_M=group, TMA=tma, PROGRAMS=programs if tma else 0)
            label = f"{'tma ' if tma else ''}{bm}x{bn}x{bk} w{warps} s{stages} g{group}"
            try:
                write_program(tmp / f"{name}{i}", spec, FAMILY.generate(spec, config), "cuda")
                runner = load_program(tmp / f"{name}{i}", spec, "cuda")
                err = float((runner(x, w, offs).float() - expected.float()).abs().max())
                row[label] = {"ms": do_bench(lambda: runner(x, w, offs), warmup=25, rep=200), "max_abs_err": err,
                              "queued_graphed_ms": queued_ms(lambda: runner(x, w, offs), graphed=True)}
            except Exception as e:  # a tile that does not build or run is reported, the rest go on
                row[label] = f"{type(e).__name__}: {str(e)[:200]}"
        results[name] = row
        print(name, json.dumps(row, indent=1), flush=True)
        out.write_text(json.dumps(results, indent=1))
    return 0


def _torch_grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, expected: torch.Tensor,
                   queued_ms) -> dict | str:
    """torch's own grouped GEMM as a vendor candidate (issue 38): whether this torch takes fp16
    (its CUTLASS path took bf16 only, fp16 falling back to a loop: pytorch issue 159547), its time,
    its error, and whether it captures in a CUDA graph (no host sync)."""
    from triton.testing import do_bench
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    try:
        got = torch._grouped_mm(x, w, offs=offs)
        row = {"max_abs_err": float((got.float() - expected.float()).abs().max()),
               "ms": do_bench(lambda: torch._grouped_mm(x, w, offs=offs), warmup=25, rep=200)}
        from torch_kernelize.fill_cache.benchmark import _captured
        row["captures"] = _captured(lambda: torch._grouped_mm(x, w, offs=offs)) is not None
        row["queued_graphed_ms"] = queued_ms(lambda: torch._grouped_mm(x, w, offs=offs), graphed=True)
        return row
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1])))
