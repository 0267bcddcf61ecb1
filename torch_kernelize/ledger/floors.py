"""The chip's ceilings and each spec's floor: its bytes at the copy bandwidth, its FLOPs at the
matmul rate, whichever takes longer.

Ceilings come from the target's chip file (``bandwidth_gbs``, ``[tflops]``: core/targets.py).
The built-in ``cuda`` target measures them once per device and torch/triton versions (a large
copy and a bf16 matmul, timed with triton.testing.do_bench, as shared/notes records for the H200)
and keeps them in the cache dir. Other targets without a chip file's ceilings have none: their
floor is n/a.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

from torch_kernelize.core import costs
from torch_kernelize.core.targets import Target

log = logging.getLogger("torch_kernelize.ledger")
CEILINGS_FILE = "ceilings.json"  # in the target's cache namespace (measured ones only)


@dataclasses.dataclass(frozen=True)
class Ceilings:
    bandwidth_gbs: float | None
    tflops: dict[str, float]      # dtype -> dense matmul TFLOP/s
    source: str                   # "chip file", "measured <date>" or "none"

    @property
    def known(self) -> bool:
        return self.bandwidth_gbs is not None

    def rate(self, dtype: str) -> float | None:
        """TFLOP/s for ``dtype``: its own, else the highest given (a floor must stay a lower bound)."""
        return self.tflops.get(dtype, max(self.tflops.values(), default=None))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Floor:
    bytes: int
    flops: int
    us: float | None   # None: the target has no ceilings
    bound: str         # "memory", "compute" or "n/a"


def floor(spec: Any, ceilings: Ceilings) -> Floor:
    """The least time a kernel of ``spec`` can take at ``ceilings``."""
    moved, work = costs.bytes_moved(spec), costs.flops(spec)
    if not ceilings.known:
        return Floor(moved, work, None, "n/a")
    memory_us = moved / (ceilings.bandwidth_gbs * 1e3)   # bytes / (GB/s) in microseconds
    rate = ceilings.rate(costs.compute_dtype(spec)) if work else None
    compute_us = work / (rate * 1e6) if rate else 0.0
    return Floor(moved, work, max(memory_us, compute_us), "compute" if compute_us > memory_us else "memory")


def ceilings_for(target: Target, cache_dir: Path | None,
                 measure: Callable[[], dict[str, Any]] | None = None) -> Ceilings:
    """The target's ceilings: its chip file's; on a cuda device without them, measured once and
    kept in ``cache_dir`` (``measure`` replaces the measurement in tests); else none."""
    if target.bandwidth_gbs is not None:
        return Ceilings(target.bandwidth_gbs, dict(target.tflops), "chip file")
    if target.device != "cuda":
        return Ceilings(None, {}, "none")
    path = Path(cache_dir) / target.fingerprint_id() / CEILINGS_FILE if cache_dir is not None else None
    if path is not None and path.exists():
        try:
            data = json.loads(path.read_text())
            return Ceilings(float(data["bandwidth_gbs"]), {k: float(v) for k, v in data["tflops"].items()},
                            data.get("source", "measured"))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("%s is unreadable (%s): measuring the ceilings again", path, e)
    data = (measure or measure_cuda)()
    if path is not None:  # written whole, then renamed: a reader never sees half of it
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    return Ceilings(float(data["bandwidth_gbs"]), dict(data["tflops"]), data.get("source", "measured"))


def measure_cuda() -> dict[str, Any]:
    """The current GPU's copy bandwidth (1 GiB read + 1 GiB written) and bf16 matmul rate
    (8192^3), medians of triton.testing.do_bench: what shared/notes measured on the H200."""
    import datetime

    import torch
    from triton.testing import do_bench

    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    bandwidth = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3) / 1e9
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    mm_ms = do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    tflops = 2 * n ** 3 / (mm_ms * 1e-3) / 1e12
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"bandwidth_gbs": round(bandwidth, 1), "tflops": {"bfloat16": round(tflops, 1)},
            "source": f"measured on {torch.cuda.get_device_name()} {date}"}
