"""Does a TMA load accept an innermost start that is not a multiple of 16 bytes when the shared
layout is unswizzled? (Triton's swizzled descriptors faulted for fp16 offsets 1, -1, 3 in the
sixth session.) Each case runs in its own process, since a fault kills the CUDA context.

    python benchmarks/experiments/tma_unaligned_probe.py     # on the GPU; JSON to $OUT or /tmp

H200, triton 3.6: offsets 0 and 8 load; 1, -1, 3, 195 fault with swizzle 0, 32 and 128 alike.
"""
import json, os, subprocess, sys
import torch


def case(sw: int, off: int, rows: int, cols: int) -> dict:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    @gluon.jit
    def probe(desc, out_ptr, OFF: gl.constexpr, R: gl.constexpr, C: gl.constexpr):
        smem = gl.allocate_shared_memory(gl.float16, [R, C], desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, R * C * 2)
        tma.async_copy_global_to_shared(desc, [0, OFF], bar, smem)
        mbarrier.wait(bar, phase=0)
        mbarrier.invalidate(bar)
        layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
        v = smem.load(layout)
        r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
        gl.store(out_ptr + r[:, None] * C + c[None, :], v)

    x = torch.arange(rows * 200, device="cuda", dtype=torch.float32).reshape(rows, 200).half()
    layout = gl.NVMMASharedLayout(swizzle_byte_width=sw, element_bitwidth=16, rank=2)
    desc = TensorDescriptor.from_tensor(x, [rows, cols], layout)
    out = torch.empty(rows, cols, device="cuda", dtype=torch.float16)
    probe[(1,)](desc, out, off, rows, cols, num_warps=4)
    torch.cuda.synchronize()
    want = torch.zeros(rows, cols, dtype=torch.float16)
    lo, hi = max(off, 0), min(off + cols, 200)
    want[:, lo - off:hi - off] = x.cpu()[:, lo:hi]
    return {"ok": bool(torch.equal(out.cpu(), want))}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sw, off, rows, cols = map(int, sys.argv[1:])
        print(json.dumps(case(sw, off, rows, cols)))
        sys.exit(0)
    res = {}
    for sw, off, rows, cols in [(0, 0, 64, 8), (0, 8, 64, 8), (0, 1, 64, 8), (0, -1, 64, 8), (0, 3, 64, 8),
                                (0, 195, 64, 8), (0, 1, 64, 64), (128, 0, 64, 64), (128, 1, 64, 64),
                                (32, 1, 64, 16)]:
        p = subprocess.run([sys.executable, __file__, str(sw), str(off), str(rows), str(cols)],
                           capture_output=True, text=True, timeout=120)
        out = p.stdout.strip().splitlines()
        res[f"sw{sw}_off{off}_{rows}x{cols}"] = json.loads(out[-1]) if p.returncode == 0 and out else \
            {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
        print(f"sw{sw}_off{off}_{rows}x{cols}", res[f"sw{sw}_off{off}_{rows}x{cols}"], flush=True)
    open(os.path.join(os.environ.get("OUT", "/tmp"), "tma_probe.json"), "w").write(json.dumps(res, indent=1))
