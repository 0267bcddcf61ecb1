"""Decision: what the planner chose for one node or fused region (tier, reason, why each higher
tier was not taken, spec key), the plan's unit that serving binds and the report counts."""
from __future__ import annotations

import dataclasses
from typing import Any

from torch_kernelize.core.spec import KernelSpec

TIERS = ("decompose", "triton", "vendor", "fallback")


@dataclasses.dataclass
class Decision:
    node: str
    op: str
    tier: str
    reason: str
    rejected: dict[str, str] = dataclasses.field(default_factory=dict)  # higher tier -> why not
    spec_key: str | None = None
    shapes: str | None = None
    family: str | None = None
    miss: bool = False      # vendor ran it because the cache had no entry (a generator exists)
    missing: bool = False   # nothing on the target runs it
    repro: str | None = None
    spec: KernelSpec | None = dataclasses.field(default=None, repr=False, compare=False)
    entry: Any = dataclasses.field(default=None, repr=False, compare=False)
    # a cache miss whose family (and so ``family``, ``miss`` and the rejection text) is not yet
    # known: see ``resolve_family``
    family_pending: bool = dataclasses.field(default=False, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("spec", "entry", "family_pending")}
        return {k: v for k, v in d.items() if v not in (None, False) or k in ("tier", "reason")}
