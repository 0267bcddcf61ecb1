"""Generators: what offers candidate kernels for a spec, and how fill_cache asks all of them.

A generator implements the KernelFamily interface (lowering/kernels/base.py); ``KernelGenerator``
names what fill_cache asks of one: ``supports(spec)``, ``seed_configs``, ``neighbours``,
``generate(spec, config) -> KernelProgram``, ``provenance``, and the input domain it is judged on.
Our kernel families are generators; so are the Inductor generator (inductor.py) and any object
a package names under the entry-point group ``torch_kernelize.generators``::

    [project.entry-points."torch_kernelize.generators"]
    mygen = "my_package.kernels:GENERATOR"   # a KernelFamily instance, or a class that makes one

For each spec, fill_cache asks the spec's own family (``family_for``: the one that also says how
its inputs are drawn and its ties settled) and every other generator of the run that supports
it, through one ``Competition``: all their candidates go through the same harness (build,
validate against float64, time against the vendor kernel) and the winner's entry names the
generator that made it. A configuration of the spec's family is written as it always was; every
other generator's carries ``generator=<name>``, so the journal (and ``--resume``) knows whose
it is.
"""
from __future__ import annotations

import importlib.metadata
import logging
from typing import Any, Callable, Protocol, Sequence

import torch

from torch_kernelize.fill_cache.collect import UsageError
from torch_kernelize.fill_cache.graph_candidates import WHOLE_GRAPH_DOMAIN
from torch_kernelize.lowering.kernels import Config, KernelFamily, KernelProgram, families
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import Target

ENTRY_POINT_GROUP = "torch_kernelize.generators"
TAG = "generator"  # the config parameter that names a generator other than the spec's family

log = logging.getLogger("torch_kernelize.fill_cache")


class KernelGenerator(Protocol):
    """What fill_cache asks of a generator: a kernel family, a Competition of several, a candidate
    file's (external.py), Inductor's, a plugin's. KernelFamily implements it."""

    name: str
    edge_kinds: Sequence[str]  # the edge inputs its candidates are validated on

    def supports(self, spec: KernelSpec) -> str | None:
        """None when it generates ``spec``, else why not."""

    def seed_configs(self, spec: KernelSpec) -> list[Config]: ...

    def neighbours(self, spec: KernelSpec, config: Config) -> list[Config]: ...

    def evaluations(self, spec: KernelSpec, budget: int) -> int:
        """How many configurations a search of ``spec`` may evaluate at the run's budget."""

    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram: ...

    def provenance(self, config: Config) -> dict[str, Any]:
        """What the entry of ``config``'s kernel records as its origin (``generator`` at least)."""

    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]: ...

    def resolve_ties(self, spec: KernelSpec, inputs: list, outs: list, refs: list) -> list: ...


# spec -> the generator of its family (candidate files joined in: external.with_candidates), or None
FamilyFor = Callable[[KernelSpec], KernelGenerator | None]


class AnyOp(KernelFamily):
    """The input domain, edge kinds and tie rule of a spec that no family of ours generates: the
    defaults (random values of the metas, every edge kind, nothing left open)."""

    name = "any-op"

    def supports(self, spec: KernelSpec) -> str | None:
        return None


ANY_OP = AnyOp()


def default_domain(spec: KernelSpec) -> KernelFamily:
    """The input domain of a spec no family of ours generates: a whole graph's (its token ids in
    range, graph_candidates.py), else any op's."""
    return WHOLE_GRAPH_DOMAIN if WHOLE_GRAPH_DOMAIN.supports(spec) is None else ANY_OP


def builtin_generators() -> list[KernelFamily]:
    """The generators of this package besides the kernel families."""
    from torch_kernelize.fill_cache.inductor import GENERATOR_INSTANCE
    return [GENERATOR_INSTANCE]


def entry_points() -> Sequence[importlib.metadata.EntryPoint]:
    """The installed entry points of ``torch_kernelize.generators`` (tests replace this)."""
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def plugin_generators() -> list[KernelFamily]:
    """The generators named by entry points of ``torch_kernelize.generators``; one that cannot be
    loaded is skipped with a warning that says why."""
    found = []
    for ep in entry_points():
        try:
            obj = ep.load()
            if not isinstance(obj, KernelFamily) and callable(obj):
                obj = obj()
        except Exception as e:
            log.warning("generator entry point %s = %s could not be loaded (%s: %s); skipped", ep.name, ep.value,
                        type(e).__name__, e)
            continue
        if not isinstance(obj, KernelFamily) or not obj.name:
            log.warning("generator entry point %s = %s is not a named KernelFamily (got %r); skipped", ep.name,
                        ep.value, obj)
            continue
        found.append(obj)
    return found


def available_generators() -> dict[str, KernelFamily]:
    """Every generator by name: the kernel families, this package's others, then the plugins
    (a plugin whose name is taken is skipped with a warning)."""
    out: dict[str, KernelFamily] = {}
    for g in [*families(), *builtin_generators(), *plugin_generators()]:
        if g.name in out and out[g.name] is not g:
            log.warning("generator %r is registered twice (%s and %s); the first is used", g.name,
                        type(out[g.name]).__module__, type(g).__module__)
            continue
        out[g.name] = g
    return out


def chosen_generators(names: str | None, target: Target) -> list[KernelFamily]:
    """The generators a run asks beside each spec's family. ``names``: "all", "none", or a comma
    list (``--generators``); None: those that are asked by default on ``target``."""
    own = {f.name for f in families()}
    others = {n: g for n, g in available_generators().items() if n not in own}
    if names is None:
        return [g for g in others.values() if g.asked_by_default(target) is None]
    if names.strip() == "all":
        return list(others.values())
    if names.strip() == "none":
        return []
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in others]
    if unknown:
        raise UsageError(f"--generators: no generator named {', '.join(unknown)}; there are "
                         f"{', '.join(sorted(others)) or 'none'} (the kernel families are always asked)")
    return [others[n] for n in wanted]


def generator_notes(target: Target) -> list[str]:
    """One line per generator that this target leaves out by default, and why."""
    own = {f.name for f in families()}
    return [f"{n}: {g.asked_by_default(target)}" for n, g in available_generators().items()
            if n not in own and g.asked_by_default(target) is not None]


def check_resumable(space: KernelFamily, records: Sequence[dict[str, Any]]) -> None:
    """Raise UsageError if a journal's ``records`` hold configs of a generator ``space`` lacks."""
    have = set(getattr(space, "others", {}))
    missing = sorted({r["config"].get(TAG) for r in records} - {None} - have)
    if missing:
        raise UsageError(f"the journal names generator {missing[0]!r}, which this run does not ask for this spec: "
                         f"give --generators {','.join(missing)} again, or search without --resume")


class Competition(KernelFamily):
    """The candidates of every generator for one spec, as one search space."""

    def __init__(self, primary: KernelFamily | None, others: Sequence[KernelFamily],
                 judge: KernelFamily | None = None, budget: int | None = None):
        """``judge``: the input domain and tie rule where no family generates the spec (default:
        any op's). ``budget``: the run's; each other generator seeds only the candidates its
        ``evaluations`` grants at it (Inductor: its default mode alone at budget 1)."""
        self.primary = primary
        self.budget = budget
        self.others = {g.name: g for g in others}
        self.judge = primary if primary is not None else (judge or ANY_OP)  # what a correct kernel is
        self.edge_kinds = self.judge.edge_kinds
        self.name = "+".join(([primary.name] if primary is not None else []) + list(self.others))

    @classmethod
    def of(cls, spec: KernelSpec, primary: KernelFamily | None, others: Sequence[KernelFamily],
           budget: int | None = None) -> KernelFamily | None:
        """The spec's search space: ``primary`` alone where no other generator supports the spec,
        or none grants it an evaluation at ``budget`` beside its family (the quick fill asks
        Inductor for graph-level candidates only where a family generates the spec)."""
        supporting = [g for g in others if g is not primary and g.supports(spec) is None]
        if budget is not None and primary is not None:
            supporting = [g for g in supporting if g.evaluations(spec, budget) > 0]
        if not supporting:
            return primary
        return cls(primary, supporting, default_domain(spec), budget)

    def generator_of(self, config: Config) -> tuple[KernelFamily, Config]:
        """The generator that made ``config`` and the config as that generator knows it."""
        name = config.get(TAG)
        if name is None:
            if self.primary is None:
                raise UsageError(f"config {config} names no generator, and no kernel family generates this spec")
            return self.primary, config
        if name not in self.others:
            raise UsageError(f"the journal names generator {name!r}, which this run does not ask for this spec: "
                             f"give --generators {name} again, or search without --resume")
        return self.others[name], Config.of(**{k: v for k, v in config.params if k != TAG})

    @staticmethod
    def tagged(name: str, configs: Sequence[Config]) -> list[Config]:
        return [c.replace(**{TAG: name}) for c in configs]

    def supports(self, spec: KernelSpec) -> str | None:
        gens = ([self.primary] if self.primary is not None else []) + list(self.others.values())
        return None if any(g.supports(spec) is None for g in gens) else "no generator of this run supports it"

    def seed_configs(self, spec: KernelSpec) -> list[Config]:
        # Others first: their few configs are within the budget they add (evaluations)
        out = [c for n, g in self.others.items() for c in self.tagged(n, self._seeds(g, spec))]
        return out + (self.primary.seed_configs(spec) if self.primary is not None else [])

    def _seeds(self, gen: KernelFamily, spec: KernelSpec) -> list[Config]:
        """``gen``'s seeds at the budget; one at least where no family generates the spec (then
        the other generators are all it has)."""
        seeds = gen.seed_configs(spec)
        return seeds if self.budget is None else seeds[:self._granted(gen, spec, self.budget)]

    def _granted(self, gen: KernelFamily, spec: KernelSpec, budget: int) -> int:
        return max(gen.evaluations(spec, budget), 1 if self.primary is None else 0)

    def evaluations(self, spec: KernelSpec, budget: int) -> int:
        own = self.primary.evaluations(spec, budget) if self.primary is not None else 0
        return own + sum(self._granted(g, spec, budget) for g in self.others.values())

    def neighbours(self, spec: KernelSpec, config: Config) -> list[Config]:
        gen, own = self.generator_of(config)
        near = gen.neighbours(spec, own)
        return near if gen is self.primary else self.tagged(gen.name, near)

    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        gen, own = self.generator_of(config)
        return gen.generate(spec, own)

    def provenance(self, config: Config) -> dict[str, Any]:
        gen, own = self.generator_of(config)
        return {"generator": gen.name, **gen.provenance(own)}

    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        return self.judge.sample_inputs(spec, seed, kind, device)

    def resolve_ties(self, spec, inputs, outs, refs):
        return self.judge.resolve_ties(spec, inputs, outs, refs)
