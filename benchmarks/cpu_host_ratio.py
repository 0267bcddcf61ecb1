"""Host time per call on the ``cpu`` target: a graph of many tiny pointwise ops, where the time is
all Python and dispatch, against eager and aot_eager (issue 24's CPU target: kernelize at most
1.15x eager).

    python benchmarks/cpu_host_ratio.py [--ops 200] [--numel 16] [--calls 2000] [--profile]

Warm (compiled and called first), one thread, each figure the median over ``--repeats`` timed
blocks of ``--calls`` calls. Run it alone: other work on a small machine distorts the ratios.
``--profile`` prints where kernelize's calls spend their time (cProfile).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Callable

import torch

# Each step of the chain is one ATen pointwise op on tensors of a few elements.
_STEPS = ("h = h + x", "h = h * 0.5", "h = torch.sin(h)", "h = h - x", "h = torch.relu(h)", "h = h * x",
          "h = torch.tanh(h)", "h = h + 1.0")


def tiny_pointwise_chain(ops: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A function of two tensors that runs ``ops`` pointwise ops, written out one per line (as a
    model's forward is: no loop or helper calls of its own for eager to pay)."""
    lines = [f"    {_STEPS[i % len(_STEPS)]}\n" for i in range(ops)]
    namespace = {"torch": torch}
    exec(f"def chain(h, x):\n{''.join(lines)}    return h\n", namespace)
    return namespace["chain"]


def per_call_us(fns: dict[str, Callable], args: tuple, calls: int, repeats: int) -> dict[str, float]:
    """Per callable, the median over ``repeats`` blocks of ``calls`` calls, in microseconds per
    call; the blocks of the callables take turns, so that drift of the machine hits all alike."""
    for fn in fns.values():
        for _ in range(max(10, calls // 10)):
            fn(*args)
    blocks: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            blocks[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(b) for name, b in blocks.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--numel", type=int, default=16)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--profile", action="store_true", help="cProfile kernelize's calls")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    fn = tiny_pointwise_chain(a.ops)
    args = (torch.randn(a.numel), torch.randn(a.numel))
    compiled = {
        "eager": fn,
        "aot_eager": torch.compile(fn, backend="aot_eager", dynamic=False),
        "kernelize": torch.compile(fn, backend="kernelize", dynamic=False, options={"target": "cpu"}),
    }
    with torch.no_grad():
        want = fn(*args)
        for name, f in compiled.items():
            torch.testing.assert_close(f(*args), want, msg=lambda m: f"{name} differs from eager: {m}")
        times = per_call_us(compiled, args, a.calls, a.repeats)
        print(f"{a.ops} pointwise ops on {a.numel} elements, cpu target, 1 thread, median us per call:")
        for name, us in times.items():
            print(f"  {name:<10} {us:9.1f} us   {us / times['eager']:.3f}x eager")
        if a.profile:
            prof = cProfile.Profile()
            k = compiled["kernelize"]
            prof.runcall(lambda: [k(*args) for _ in range(a.calls)])
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
