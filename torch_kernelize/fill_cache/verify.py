"""Re-validate cached kernels: load each Triton entry as serving would, and validate it again on
fresh seeds (and the edge kinds its family admits) against the float64 reference, and against
the vendor op's output under the elementwise bar a stored kernel met."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable

import numpy as np

from torch_kernelize.serving.launch import load_program
from torch_kernelize.fill_cache.generators import default_domain
from torch_kernelize.lowering.kernels import families, family_for
from torch_kernelize.core.targets import Target
from torch_kernelize.core.validate import validate

VERIFY_SEEDS = (101, 102, 103)  # not the seeds fill_cache validated on


@dataclasses.dataclass
class Verdict:
    key: str
    spec: str
    ok: bool
    detail: str


def verify_entries(cache: Any, target: Target, keys: Iterable[str] | None = None) -> list[Verdict]:
    device = "cuda" if target.device == "cuda" else "cpu"
    out = []
    for key in keys if keys is not None else cache.keys():
        status, entry, reason = cache.lookup(key)
        if status == "vendor":
            out.append(Verdict(key, entry.spec.describe(), True, "vendor wins: nothing to run"))
            continue
        if status != "hit":
            out.append(Verdict(key, "?", False, f"{status}: {reason}"))
            continue
        spec = entry.spec
        family = family_for(spec)
        if family is None and entry.family not in {f.name for f in families()}:
            family = default_domain(spec)  # a candidate file's, Inductor's, a plugin's: as when it was stored
        if family is None:
            out.append(Verdict(key, spec.describe(), False, "no kernel family generates this spec any more"))
            continue
        try:
            runner = load_program(entry.program_dir, spec, target.triton,
                                  module_name=f"torch_kernelize_verify.k{key}")
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore", RuntimeWarning)
                record = validate(runner.run_poisoned, spec, family.sample_inputs, family.edge_kinds,
                                  seeds=VERIFY_SEEDS, device=device, resolve_ties=family.resolve_ties,
                                  elementwise_bar=True)
        except Exception as e:
            out.append(Verdict(key, spec.describe(), False, f"could not run: {type(e).__name__}: {e}"))
            continue
        out.append(Verdict(key, spec.describe(), record.ok,
                           f"{record.trials} trials, max err {record.max_err:.2e}" if record.ok else record.reason))
    return out
