"""Re-validate cached kernels: load each Triton entry as serving would, and validate it again on
fresh seeds (and the edge kinds its family admits) against the float64 reference, and against
the vendor op's output under the elementwise bar a stored kernel met.

The entries may come from elsewhere (``import --revalidate``, a shared cache): each one runs in
a measure worker (measure_worker.py) with a time limit, so a kernel that hangs, segfaults or
faults the device fails only its own entry; the worker is replaced and the others go on.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Iterable

import numpy as np

from torch_kernelize.serving.launch import load_program
from torch_kernelize.fill_cache.generators import default_domain
from torch_kernelize.fill_cache.measure import device_fault
from torch_kernelize.fill_cache.measure_worker import MeasureWorker, WorkerDied, entry_time_limit_s
from torch_kernelize.lowering.kernels import families, family_for
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import Target
from torch_kernelize.core.validate import validate
from torch_kernelize.kernel_cache.entry import CacheEntry
from torch_kernelize.kernel_cache.interfaces import Cache

VERIFY_SEEDS = (101, 102, 103)  # not the seeds fill_cache validated on


@dataclasses.dataclass
class Verdict:
    key: str
    spec: str
    ok: bool
    detail: str


def verify_entries(cache: Cache, target: Target, keys: Iterable[str] | None = None,
                   time_limit: float | None = None) -> list[Verdict]:
    """A verdict per entry; ``time_limit``: seconds per entry (default: measure_worker's for the target)."""
    worker = MeasureWorker.for_target(target, entry_time_limit_s(target, time_limit))
    out = []
    try:
        for key in keys if keys is not None else cache.keys():
            status, entry, reason = cache.lookup(key)  # records and hashes: nothing of it runs here
            if status == "vendor":
                out.append(Verdict(key, entry.spec.describe(), True, "vendor wins: nothing to run"))
            elif status != "hit":
                out.append(Verdict(key, "?", False, f"{status}: {reason}"))
            else:
                out.append(_verify_in(worker, target, key, entry))
    finally:
        worker.close()
    return out


def _verify_in(worker: MeasureWorker, target: Target, key: str, entry: CacheEntry) -> Verdict:
    try:
        verdict = worker.call(_verify_entry, key, entry.spec.to_json(), entry.family, str(entry.program_dir), target)
    except WorkerDied as e:  # it hung or crashed: the worker was replaced
        return Verdict(key, entry.spec.describe(), False, str(e))
    if not verdict.ok and target.device == "cuda" and device_fault(verdict.detail):
        worker.restart()  # its CUDA context is unusable
    return verdict


def _verify_entry(key: str, spec_json: dict, family_name: str | None, program_dir: str, target: Target) -> Verdict:
    """In the worker: load one entry's program and validate it."""
    spec = KernelSpec.from_json(spec_json)
    family = family_for(spec)
    if family is None and family_name not in {f.name for f in families()}:
        family = default_domain(spec)  # a candidate file's, Inductor's, a plugin's: the default domain, as when it was stored
    if family is None:
        return Verdict(key, spec.describe(), False, "no kernel family generates this spec any more")
    device = "cuda" if target.device == "cuda" else "cpu"
    try:
        runner = load_program(program_dir, spec, target.triton, module_name=f"torch_kernelize_verify.k{key}")
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            record = validate(runner.run_poisoned, spec, family.sample_inputs, family.edge_kinds,
                              seeds=VERIFY_SEEDS, device=device, resolve_ties=family.resolve_ties,
                              elementwise_bar=True, magnitudes=family.term_magnitudes)
    except Exception as e:
        return Verdict(key, spec.describe(), False, f"could not run: {type(e).__name__}: {e}")
    return Verdict(key, spec.describe(), record.ok,
                   f"{record.trials} trials, max err {record.max_err:.2e}" if record.ok else record.reason)
