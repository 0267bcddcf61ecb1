"""Backend options: from ``torch.compile(..., options={...})``, else the environment, else defaults.

Every option has one row in ``OPTIONS``; an unknown name or a value of the wrong kind is an
``OptionsError`` that names it, never silently ignored.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from torch_kernelize.core.errors import OptionsError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_OFF = {"", "off", "none", "0", "false"}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_kernelize"


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise OptionsError(f"option {name!r} must be a boolean (true/false, 1/0), got {value!r}")


def _as_path(name: str, value: Any) -> Path:
    if isinstance(value, (str, os.PathLike)) and str(value).strip():
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            raise OptionsError(f"option {name!r} must be a path, got {value!r}, which reads as a yes/no; "
                               f"for a file or folder of that name write './{value.strip()}'")
        return Path(os.path.expanduser(str(value)))
    raise OptionsError(f"option {name!r} must be a path, got {value!r}")


def _as_optional_path(name: str, value: Any) -> Path | None:
    """A path, or None when the value switches the feature off ("off", "", False, None)."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    return _as_path(name, value)


def _as_folder_or_keyword(name: str, value: Any, keywords: str) -> Path | None:
    """An optional folder for an option that also takes keywords: a bare word that is none of
    them and names no existing folder is a typo far more often than a wish for ./word/, so it
    must be written as a path."""
    path = _as_optional_path(name, value)
    word = str(value).strip() if isinstance(value, (str, os.PathLike)) else ""
    if path is not None and os.sep not in word and "/" not in word and not word.startswith(("~", ".")) \
            and not path.is_dir():
        raise OptionsError(f"option {name!r} is {word!r}: not one of {keywords} and not an existing folder; "
                           f"to make a new folder of that name in the current directory, write './{word}' "
                           "(an absolute path is safer: the current directory differs between processes)")
    return path


def _as_repro_dir(name: str, value: Any) -> Path | None:
    return _as_folder_or_keyword(name, value, "'off'")


def _as_graph_cache(name: str, value: Any) -> Path | str | None:
    """"auto" (inside the kernel cache dir), off, or a folder."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return _as_folder_or_keyword(name, value, "'auto', 'off'")


def _as_count(name: str, value: Any) -> int:
    """A non-negative whole number (from the environment, a string of digits)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise OptionsError(f"option {name!r} must be a whole number >= 0, got {value!r}")


def _as_target(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise OptionsError(f"option {name!r} must be a target name or a path to a target TOML file, got {value!r}")


@dataclasses.dataclass(frozen=True)
class _Option:
    env: str
    parse: Callable[[str, Any], Any]
    default: Callable[[], Any]
    help: str


OPTIONS: dict[str, _Option] = {
    "target": _Option("KERNELIZE_TARGET", _as_target, lambda: None,
                      "built-in target name (cuda, cpu, interpreter) or path to a target TOML file; "
                      "default: follows the device of the inputs"),
    "cache_dir": _Option("KERNELIZE_CACHE_DIR", _as_path, default_cache_dir,
                         "kernel cache directory"),
    "repro_dir": _Option("KERNELIZE_REPRO_DIR", _as_repro_dir, lambda: Path("kernelize_repros"),
                         "where misses and missing ops are dumped as reproducers ('off' disables)"),
    "repro_max": _Option("KERNELIZE_REPRO_MAX", _as_count, lambda: 512,
                         "the most misses a process records as reproducers; beyond it they are counted only"),
    "repro_max_bytes": _Option("KERNELIZE_REPRO_MAX_BYTES", _as_count, lambda: 2**30,
                               "the most bytes of captured inputs a process's miss reproducers hold"),
    "report": _Option("KERNELIZE_REPORT", _as_optional_path, lambda: None,
                      "path of a JSON coverage report, rewritten after each compile"),
    "strict": _Option("KERNELIZE_STRICT", _as_bool, lambda: False,
                      "raise MissingOpsError instead of running missing ops on the host fallback"),
    "check": _Option("KERNELIZE_CHECK", _as_bool, lambda: False,
                     "run every Triton kernel beside its vendor op and minify any mismatch"),
    "cudagraphs": _Option("KERNELIZE_CUDAGRAPHS", _as_bool, lambda: False,
                          "wrap compiled CUDA graphs in CUDA graphs (mode='reduce-overhead' sets it)"),
    "graph_cache": _Option("KERNELIZE_GRAPH_CACHE", _as_graph_cache, lambda: "auto",
                           "folder of cached ATen graphs that let a new process skip aot_autograd "
                           "('auto': <cache_dir>/graphs; 'off' disables)"),
    "executable_cache": _Option("KERNELIZE_EXECUTABLE_CACHE", _as_bool, lambda: True,
                                "keep cached graphs' bound executables next to them: a new process whose "
                                "kernel cache is unchanged skips lowering too (needs graph_cache)"),
    "bucket_warm_ms": _Option("KERNELIZE_BUCKET_WARM_MS", _as_count, lambda: 2000,
                              "when a shape bucket's program is bound, run its vendor calls (cuBLAS, cuDNN) "
                              "at each size of the bucket on zeros, for up to this many ms per bucket, so "
                              "that a new size's first call does not pay their first use (0 disables; "
                              "see serving/bucket_warm.py)"),
    "prewarm": _Option("KERNELIZE_PREWARM", _as_bool, lambda: True,
                       "while Dynamo traces a process's first frame, warm in the background the vendor ops "
                       "of the executables this program ran last time (read from the environment: the "
                       "warm-up starts before the backend gets its options; see prewarm.py)"),
}

_MODES = {None: {}, "default": {}, "reduce-overhead": {"cudagraphs": True}}


@dataclasses.dataclass(frozen=True)
class Options:
    target: str | None = None
    cache_dir: Path = dataclasses.field(default_factory=default_cache_dir)
    repro_dir: Path | None = Path("kernelize_repros")
    repro_max: int = 512  # a whole model's distinct misses fit; a server seeing new shapes stops there
    repro_max_bytes: int = 2**30
    report: Path | None = None
    strict: bool = False
    check: bool = False
    cudagraphs: bool = False
    graph_cache: Path | str | None = "auto"
    executable_cache: bool = True
    bucket_warm_ms: int = 2000
    prewarm: bool = True

    @classmethod
    def resolve(cls, options: Mapping[str, Any] | None = None, mode: str | None = None,
                env: Mapping[str, str] | None = None) -> "Options":
        """Explicit options win over the environment, which wins over defaults."""
        env = os.environ if env is None else env
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise OptionsError(
                f"unknown kernelize option(s) {unknown}; valid options are {sorted(OPTIONS)}")
        if mode not in _MODES:
            raise OptionsError(f"kernelize supports mode in {sorted(m for m in _MODES if m)}, got {mode!r}")
        values: dict[str, Any] = {}
        for name, opt in OPTIONS.items():
            if name in options:
                values[name] = opt.parse(name, options[name])
            elif name in _MODES[mode]:
                values[name] = _MODES[mode][name]
            elif opt.env in env:
                values[name] = opt.parse(f"{name} (from ${opt.env})", env[opt.env])
            else:
                values[name] = opt.default()
        return cls(**values)

    @classmethod
    def for_fill(cls, cache_dir: Path | str, repro_dir: Path | None = None) -> "Options":
        """The options of fill_cache's own lowering sessions: no report, reproducers only where
        asked, and no bucket warm (a fill times steady calls; the warm is a served process's
        first-call cost)."""
        return cls(target=None, cache_dir=Path(cache_dir), repro_dir=repro_dir, report=None, bucket_warm_ms=0)

    @property
    def graph_cache_dir(self) -> Path | None:
        """Where the graph cache lives (None: off)."""
        if self.graph_cache == "auto":
            return Path(self.cache_dir) / "graphs"
        return None if self.graph_cache is None else Path(self.graph_cache)

    def as_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}
