"""An MoE's gated experts at the real-model suite's Mixtral size: the grouped_mm_glu region's kernel
(lowering/kernels/grouped_mm_glu.py, each seed compiled ahead of time as the fill stores it)
against the parts it replaces: the plain grouped GEMM's kernel (grouped_mm.py's first seed) with
Inductor's kernel for the rest (the rows of no expert zeroed, SiLU(gate) * up), and transformers'
op with eager's pointwise kernels.

    python benchmarks/glu_tiles.py OUT.json [--smoke]     # CUDA; --smoke: tiny, on the CPU

8192 rows (batch 8 x 512, top-2) routed uniformly at random over 8 experts (seed 0), K 2048, the
product [8192, 2 x 5632] in fp16, the weight a transposed view as transformers passes it, the
last 64 rows routed to no expert (transformers 5.17 zeroes them). Each time is
triton.testing.do_bench's median (25 warm-up, 200 ms); each kernel's max abs error against the
eager region. With --smoke the sizes are tiny, the kernels run on Triton's interpreter and
nothing is timed (what the script does is checked on a CPU). Exit codes: 0 done; 2 no CUDA
device (without --smoke).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

SIZE = {"S": 8192, "K": 2048, "I": 5632, "E": 8, "unrouted": 64}
SMOKE = {"S": 48, "K": 32, "I": 24, "E": 4, "unrouted": 5}


def experts_op() -> Any:
    """transformers' grouped GEMM op (the test suite's stand-in where transformers is missing)."""
    try:
        import transformers.integrations.moe  # noqa: F401 (registers transformers::grouped_mm_fallback)
    except Exception:
        pass
    if not hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test"))
        from test_kernels_grouped_mm import _op
        return _op()
    return torch.ops.transformers.grouped_mm_fallback.default


def inputs(size: dict[str, int], device: str) -> tuple[torch.Tensor, ...]:
    S, K, I, E = size["S"], size["K"], size["I"], size["E"]
    g = torch.Generator().manual_seed(0)
    routed = S - size["unrouted"]
    offs = torch.bincount(torch.randint(0, E, (routed,), generator=g), minlength=E).cumsum(0).to(torch.int32)
    x = torch.randn(S, K, generator=g).half()
    w = (torch.randn(E, 2 * I, K, generator=g) / K ** 0.5).half()
    mask = (torch.arange(S) >= routed).unsqueeze(-1)
    return tuple(t.to(device) for t in (x, w, offs, mask))


def region(op: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, mask: torch.Tensor):
    """(the region's spec, its inputs as tensors, the eager region's output, the eager region)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_kernelize.compiling.decompositions import trace_decompositions
    from torch_kernelize.compiling.glu_regions import find_glu_regions, halve_products
    from torch_kernelize.compiling.regions import region_spec

    def experts(x, w, offs, mask):  # transformers 5.17's experts up to the down projection
        gate, up = op(x, w.transpose(1, 2), offs).masked_fill(mask, 0.0).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    gm = make_fx(experts, decomposition_table=trace_decompositions(), tracing_mode="fake")(x, w, offs, mask)
    halve_products(gm.graph)
    gm.recompile()
    (r,) = find_glu_regions(gm)
    seen: dict[Any, Any] = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, n):
            seen[n] = super().run_node(n)
            return seen[n]
    with torch.no_grad():
        Keep(gm).run(x, w, offs, mask)
    return region_spec(r, {}), [seen[n] for n in r.inputs], seen[r.outputs[0]], lambda: experts(x, w, offs, mask)


def built(directory: Path, spec: Any, program: Any, backend: str) -> Callable:
    """``program`` written and loaded as the fill stores and serving loads it."""
    from torch_kernelize.building.programs import write_program
    from torch_kernelize.serving.launch import load_program
    write_program(directory, spec, program, backend)
    return load_program(directory, spec, backend)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the interpreter, nothing timed")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("glu_tiles: needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    from torch_kernelize.core.spec import KernelSpec
    from torch_kernelize.lowering.kernels.grouped_mm import FAMILY as GEMM
    from torch_kernelize.lowering.kernels.grouped_mm_glu import FAMILY as GLU

    device, backend = ("cpu", "interpreter") if args.smoke else ("cuda", "cuda")
    if args.smoke:
        import os
        os.environ["TRITON_INTERPRET"] = "1"
    op = experts_op()
    x, w, offs, mask = inputs(SMOKE if args.smoke else SIZE, device)
    spec, region_inputs, expected, eager = region(op, x, w, offs, mask)
    tmp, rows = Path(tempfile.mkdtemp()), {}

    def timed(fn: Callable) -> float | None:
        if args.smoke:
            fn()
            return None
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=200))

    def err(got: torch.Tensor) -> float:
        return float((got.float() - expected.float()).abs().max())

    rows["eager (transformers' op, eager pointwise)"] = {"ms": timed(eager), "max_abs_err": err(eager())}
    # the parts: the plain grouped GEMM's first seed, then Inductor's kernel for the rest
    wt = w.transpose(1, 2)
    product = op(x, wt, offs)
    gemm_spec = KernelSpec.from_call(op, (x, wt, offs), {}, product)
    gemm = built(tmp / "gemm", gemm_spec, GEMM.generate(gemm_spec, GEMM.seed_configs(gemm_spec)[0]), backend)

    def rest(gu: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        gate, up = gu.masked_fill(mask, 0.0).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    post = rest if args.smoke else torch.compile(rest)
    parts = lambda: post(gemm(x, wt, offs), mask)  # noqa: E731
    rows["parts (grouped_mm seed 0 + Inductor's pointwise)"] = {
        "ms": timed(parts), "max_abs_err": err(parts()), "gemm_ms": timed(lambda: gemm(x, wt, offs)),
        "pointwise_ms": timed(lambda: post(product, mask)), "gemm_config": GEMM.seed_configs(gemm_spec)[0].to_json()}
    for i, config in enumerate(GLU.seed_configs(spec)):
        label = f"glu seed {i}: {'tma ' if config['TMA'] else ''}{config['BLOCK_M']}x(2x{config['BLOCK_N']})" \
                f"x{config['BLOCK_K']} w{config['num_warps']} s{config['num_stages']}"
        try:
            runner = built(tmp / f"glu{i}", spec, GLU.generate(spec, config), backend)
            rows[label] = {"ms": timed(lambda: runner(*region_inputs)), "max_abs_err": err(runner(*region_inputs)),
                           "config": config.to_json()}
        except Exception as e:  # a seed that does not build or run is reported, the rest go on
            rows[label] = f"{type(e).__name__}: {str(e)[:300]}"
    about = {"device": torch.cuda.get_device_name() if not args.smoke else "cpu (interpreter)",
             "torch": torch.__version__, "size": SMOKE if args.smoke else SIZE}
    args.out.write_text(json.dumps({"about": about, "rows": rows}, indent=1))
    for label, row in rows.items():
        print(f"{label}: {json.dumps(row)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
