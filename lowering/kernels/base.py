"""The interface every kernel generator implements: our op families (one module each), and the
generators fill_cache finds beside them (fill_cache/generators.py: Inductor, plugins).

A family turns a concrete KernelSpec and a Config into a KernelProgram. The search (fill_cache)
starts from ``seed_configs`` and walks ``neighbours``; validation draws inputs through
``sample_inputs`` (a family restricts the domain where its ops need it, e.g. index ranges).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch

from torch_kernelize.lowering.kernels._codegen import Unsupported
from torch_kernelize.core.devices import to_device  # noqa: F401 (the families' import)
from torch_kernelize.core.index_ties import settle_index_ties
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.spec import KernelSpec, TensorMeta

if TYPE_CHECKING:
    from torch_kernelize.core.targets import Target

# Multiprocessors of an H100 SXM/H200: what seeds of persistent grids start from (the search varies it)
SMS = 132

# Kinds of validation input. "random" always applies; a family lists the edge kinds its ops admit.
INPUT_KINDS = ("random", "zeros", "large", "negative", "special")


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of a family's configuration space: block sizes, warps, stages, variant."""
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, **params: Any) -> "Config":
        return cls(tuple(sorted(params.items())))

    def __getitem__(self, name: str) -> Any:
        return dict(self.params)[name]

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def replace(self, **changes: Any) -> "Config":
        d = dict(self.params)
        d.update(changes)
        return Config.of(**d)

    def to_json(self) -> dict[str, Any]:
        return dict(self.params)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Config":
        return cls.of(**d)

    @property
    def key(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.params)


class KernelFamily:
    """Base class; subclasses set ``name`` and ``ops`` and implement ``generate``.

    The scaffold our families share: a family analyses a spec once into a plan (``_analyse``:
    the plan, or the reason the spec is not generated), memoized per spec key by ``plan``. From
    that plan derive ``supports`` (the reason, if any), ``seed_configs`` (``_seeds``, kept where
    ``_valid``), ``neighbours`` (``_steps``, likewise) and ``checked_plan`` (what ``generate``
    starts from). A generator that is not a family of ours may override the public methods instead.
    """

    name: str = ""
    ops: frozenset[str] = frozenset()        # full op names, e.g. "aten.gelu.default"
    edge_kinds: tuple[str, ...] = ("zeros", "large", "negative", "special")
    # generate() runs in fill_cache's own process, never in a build worker (it needs the GPU, or
    # keeps what it generated: fill_cache/builder.py)
    generates_in_parent: bool = False
    PLANS_KEPT = 256                         # plans memoized per family (a search asks hundreds of times)

    # --- the family's hooks -------------------------------------------------------------------
    def _analyse(self, spec: KernelSpec) -> Any:
        """The plan of a spec whose op is in ``ops``: what seeds, config checks and generation
        need, or a str that says why the spec is not generated. Plans are shared between callers:
        never change one after it is returned. The default: nothing to analyse."""
        return None

    def _valid(self, plan: Any, config: Config) -> bool:
        """Whether ``config`` is a point of the configuration space for ``plan``."""
        return True

    def _seeds(self, spec: KernelSpec, plan: Any) -> list[Config]:
        """The configs a search starts from (``seed_configs`` keeps the valid ones)."""
        raise NotImplementedError

    def _steps(self, plan: Any, config: Config) -> list[Config]:
        """Candidate configs one step from ``config`` (``neighbours`` keeps the valid new ones)."""
        return []

    # --- derived from the plan ----------------------------------------------------------------
    def plan(self, spec: KernelSpec) -> Any:
        """``_analyse(spec)``, or why ``spec`` is not this family's (op not in ``ops``); memoized
        per spec key, so that supports, seeds, neighbours and generate analyse a spec once."""
        if spec.op not in self.ops:
            return f"{self.name} does not handle {spec.op}"
        memo = self.__dict__.get("_plan_memo")
        if memo is None:
            memo = self.__dict__.setdefault("_plan_memo", _Memo(self.PLANS_KEPT))
        return memo.get(spec.key, lambda: self._analysed(spec))

    def _analysed(self, spec: KernelSpec) -> Any:
        try:
            return self._analyse(spec)
        except Unsupported as e:   # raised from deep in an analysis: a reason like any other
            return str(e)

    def supports(self, spec: KernelSpec) -> str | None:
        """None when this family can generate a kernel for ``spec``, else the reason it cannot
        (a spec none of whose configurations fits, a tiny one, is not claimed: a fill would have
        nothing to try, and the nodes' own kernels or a larger region can still take it)."""
        plan = self.plan(spec)
        if isinstance(plan, str):
            return plan
        try:
            fits = [c for c in self._seeds(spec, plan) if self._valid(plan, c)]
        except ValueError as e:  # (Unsupported too) a plan whose seeds cannot be made
            return str(e)
        if not fits:
            return f"no configuration of the {self.name} family fits {spec.short_name}'s sizes"
        return None

    def planned(self, spec: KernelSpec) -> Any:
        """The plan of a spec this family generates; a ValueError that says why, for any other."""
        plan = self.plan(spec)
        if isinstance(plan, str):
            raise ValueError(f"{spec.describe()}: {plan}")
        return plan

    def checked_plan(self, spec: KernelSpec, config: Config) -> Any:
        """The plan, for a config of its space; else a ValueError that says why not."""
        plan = self.planned(spec)
        if not self._valid(plan, config):
            raise ValueError(f"invalid config {config} for {spec.describe()}")
        return plan

    def seed_configs(self, spec: KernelSpec) -> list[Config]:
        """The configs a search of ``spec`` starts from (a ValueError for a spec not generated)."""
        plan = self.planned(spec)
        return unique([c for c in self._seeds(spec, plan) if self._valid(plan, c)])

    def neighbours(self, spec: KernelSpec, config: Config) -> list[Config]:
        """Configs one step away from ``config`` (the search expands the best ones)."""
        plan = self.plan(spec)
        if isinstance(plan, str):
            return []
        return unique([c for c in self._steps(plan, config) if c.key != config.key and self._valid(plan, c)])

    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        raise NotImplementedError

    def bucket_support(self, spec: KernelSpec, dims: Sequence[tuple[str, int, int, int]]) -> str | None:
        """None when ``generate_bucketed`` makes kernels that take the sizes of ``dims`` (see
        torch_kernelize/core/buckets.py) at run time, so one serves a whole shape bucket; else why not.
        The one place a family declares it: fill_cache offers a bucket only to such a family."""
        return f"{self.name} kernels take no sizes at run time"

    def generate_bucketed(self, spec: KernelSpec, config: Config,
                          dims: Sequence[tuple[str, int, int, int]]) -> KernelProgram:
        """The kernel of ``spec`` (a bucket's representative) with the sizes of ``dims`` taken at
        run time: its launches' ``runtime_sizes`` say which grid entries and arguments they are."""
        raise NotImplementedError(f"{self.name} generates no bucketed kernels")

    def bucket_config_problem(self, config: Config) -> str | None:
        """Why ``generate_bucketed`` does not take ``config``, a point of the family's space
        (None: it does); fill_cache's bucket search leaves such configs out. The default: all."""
        return None

    def evaluations(self, spec: KernelSpec, budget: int) -> int:
        """How many configurations a search of ``spec`` may evaluate, given the run's budget."""
        return budget

    def provenance(self, config: Config) -> dict[str, Any]:
        """What the cache entry of ``config``'s kernel records as its origin (``generator`` at least)."""
        return {"generator": self.name}

    def asked_by_default(self, target: Target) -> str | None:
        """For a generator other than a spec's own family (fill_cache/generators.py): None when
        fill_cache asks it on ``target`` unless told otherwise, else why not."""
        return None

    # Outputs that are sums of products (GEMMs and their elementwise epilogues): on an edge trial an
    # element may cancel terms far larger than itself, and no fp32 order computes it reliably.
    sums_products = False

    def term_magnitudes(self, spec: KernelSpec, inputs: Sequence[torch.Tensor],
                        device: str = "cpu") -> tuple[torch.Tensor, ...] | None:
        """The size of each output element's terms (validate's ``magnitudes``): for a family whose
        outputs are sums of products, the float64 reference on the inputs' absolute values
        (``sum |a| |b|`` for a GEMM, through its epilogue); None for the others."""
        if not self.sums_products:
            return None
        return spec.reference([t.abs() if t.is_floating_point() else t for t in inputs], device)

    def resolve_ties(self, spec: KernelSpec, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                     refs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Where the op leaves a choice open (which of equal elements an index names), make the
        candidate's outputs take the reference's choice when theirs is as good; compared after.
        The default: the ops of core/index_ties.py (argmax, max.dim, topk, sort, max pooling...);
        a family whose op leaves other choices open settles them too."""
        return settle_index_ties(spec, inputs, outs, refs)

    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Inputs for validation: fresh random values of the spec's metas, or an edge kind,
        drawn on ``device`` (``sample_generator``): the same values for the same seed; inputs
        an op constrains (offsets, sorted sequences: core/input_domains.py) hold their rule."""
        from torch_kernelize.core.input_domains import constrain
        g = sample_generator(seed, device)
        return constrain(spec, [to_device(sample_tensor(m, g, kind), device) for m in spec.inputs], g)


class PicksAlongDim(KernelFamily):
    """A family whose outputs are (values, int64 indices) of elements of its input ``self``
    picked along a dim (topk, sort): equal elements settle on the reference's indices
    (core/index_ties.py, through KernelFamily.resolve_ties)."""


def sample_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The generator a trial's inputs are drawn with: on a CUDA device, there (drawing 1-4 GB on
    the host and copying it over took seconds per trial, and the draw is cheap to repeat, so
    fill_cache need not keep inputs); elsewhere on the CPU, as always. Deterministic per seed
    and device: a CUDA seed draws other values than a CPU one."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.Generator(device=device).manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def sample_tensor(meta: TensorMeta, g: torch.Generator, kind: str = "random",
                  low: float | None = None, high: float | None = None,
                  working: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of ``meta``'s shape, stride and dtype, filled according to ``kind``, on ``g``'s device.

    Floats are drawn in ``working`` precision, then rounded to the dtype: by default float64 on
    the CPU (the values every CPU validation has used) and the dtype's own (float32 for 16-bit
    floats) on a device, where a float64 draw would double the memory and time of a large trial.
    """
    dtype, device = meta.torch_dtype, g.device
    if working is None:
        working = torch.float64 if device.type == "cpu" or dtype == torch.float64 else torch.float32
    # Fill a contiguous buffer covering the whole storage, then view it with the meta's strides.
    span = 1 + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride)) if meta.numel else 0
    if dtype == torch.bool:
        flat = torch.rand(span, generator=g, device=device) < 0.5
    elif dtype.is_complex:  # real and imaginary parts drawn (an integer draw would leave the imaginary part 0)
        wide = torch.complex128 if working == torch.float64 else torch.complex64
        flat = torch.zeros(span, dtype=wide, device=device) if kind == "zeros" else \
            torch.randn(span, generator=g, dtype=wide, device=device) * (1e4 if kind == "large" else 1.0)
        if kind == "special" and span:
            idx = torch.randint(0, span, (max(1, span // 16),), generator=g, device=device)
            flat[idx] = complex(float("inf"), float("nan"))
        flat = flat.to(dtype)
    elif not dtype.is_floating_point:
        lo, hi = int(low if low is not None else -8), int(high if high is not None else 9)
        if kind == "zeros":
            flat = torch.zeros(span, dtype=torch.int64, device=device)
        else:
            flat = torch.randint(lo, hi, (span,), generator=g, device=device)
        flat = flat.to(dtype)
    else:
        flat = torch.randn(span, generator=g, dtype=working, device=device)
        if low is not None or high is not None:
            lo, hi = (low if low is not None else -1.0), (high if high is not None else 1.0)
            flat = lo + (hi - lo) * torch.rand(span, generator=g, dtype=working, device=device)
        if kind == "zeros":
            flat = torch.zeros_like(flat)
        elif kind == "large":
            big = {torch.float16: 1e3, torch.bfloat16: 1e4}.get(dtype, 1e4)
            flat = flat * big
        elif kind == "negative":
            flat = -flat.abs() - 0.5
        elif kind == "special" and span:
            specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0], dtype=working, device=device)
            idx = torch.randint(0, span, (max(1, span // 16),), generator=g, device=device)
            flat[idx] = specials[torch.randint(0, len(specials), idx.shape, generator=g, device=device)]
        flat = flat.to(dtype)
    return torch.as_strided(flat, meta.shape, meta.stride) if meta.numel else torch.empty_strided(
        meta.shape, meta.stride, dtype=dtype, device=device)


def doubled_and_halved(config: Config, keys: Sequence[str]) -> list[Config]:
    """The configs one power-of-two step away in each of ``keys`` (halving stops at 1)."""
    out = []
    for k in keys:
        out += [config.replace(**{k: config[k] * 2}), config.replace(**{k: max(1, config[k] // 2)})]
    return out


def pow2_between(lo: int, hi: int) -> Iterable[int]:
    v = 1
    while v < lo:
        v *= 2
    while v <= hi:
        yield v
        v *= 2


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class _Memo:
    """A small thread-safe LRU map: fill_cache's measuring threads share the families."""

    def __init__(self, size: int):
        self.size, self.items, self.lock = size, collections.OrderedDict(), threading.Lock()

    def get(self, key: str, make: Callable[[], Any]) -> Any:
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        value = make()   # outside the lock: analyses of different specs run side by side
        with self.lock:
            self.items[key] = value
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return value


def unique(configs: Sequence[Config]) -> list[Config]:
    seen, out = set(), []
    for c in configs:
        if c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out
