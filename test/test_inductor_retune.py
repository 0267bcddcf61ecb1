"""Inductor's kernel configs chosen again in the program (fill_cache/inductor_retune.py), on CPU:
Inductor's Triton for CPU tensors runs under the interpreter, a second config is given to its
split reduction (on CPU its heuristics give one), and an injected timer stands in for the
profiler, timing each kernel by the config it was launched with."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from kernel_testing import load, spec_of
from torch_kernelize.fill_cache import inductor, inductor_retune
from torch_kernelize.fill_cache.inductor_output import _autotuners
from torch_kernelize.fill_cache.inductor_retune import choose, offered_configs, retune
from torch_kernelize.serving.launch import _interpret_nested_jit_calls

aten = torch.ops.aten
SPLIT = "triton_red_fused_sum_0"


def test_choose_keeps_inductors_config_unless_another_is_faster_by_the_margin():
    assert choose([1.0, 0.5, 0.8]) == 1
    assert choose([1.0, 0.98]) == 0            # within the margin: noise, not a win
    assert choose([1.0, None, 0.9]) == 2       # a variant that did not run is no candidate
    assert choose([None, 0.1]) == 0            # Inductor's own not timed: nothing to beat


def capture_retuned(timed_ms, reports: list):
    """Capture sum(32768) (a split reduction, then the sum of its partial sums) with a second
    config for the split kernel (R0_BLOCK 1024, 8 warps), timed by ``timed_ms(R0_BLOCK)``."""
    _interpret_nested_jit_calls()  # (Inductor's helpers called from interpreted kernels, as serving runs them)
    spec = spec_of(aten.sum.default, [torch.randn(32768)])
    launched: dict[str, dict] = {}
    original = inductor_retune._launch

    def launch(fn, args, kwargs, grid):
        launched[fn.__name__] = kwargs
        original(fn, args, kwargs, grid)

    def timer(call, calls):
        launched.clear()
        call()
        return {name: (timed_ms(kw["R0_BLOCK"]) if name == SPLIT else 0.01) for name, kw in launched.items()}

    def record(compiled, module, spec, inputs, config_of):
        split = _autotuners(module)[SPLIT]
        first = split.configs[0]
        offered = {id(split): [first, type(first)({**first.kwargs, "R0_BLOCK": 1024}, num_warps=8, num_stages=1)]}
        inductor_retune._launch = launch
        try:
            tuning = retune(compiled, module, inputs, offered, timer=timer)
        finally:
            inductor_retune._launch = original
        reports.append(tuning.report)
        return inductor._record(compiled, module, spec, inputs, tuning.config_of)
    return spec, inductor.capture(spec, "default", record)


def test_a_config_faster_in_the_program_is_recorded_and_the_program_stays_right(tmp_path):
    reports = []
    spec, program = capture_retuned(lambda r0_block: r0_block / 2048, reports)
    split = next(l for l in program.launches if l.kernel == SPLIT)
    assert split.constexprs["R0_BLOCK"] == 1024 and split.num_warps == 8, split
    (report,) = reports[0]
    assert report["kernel"] == SPLIT and report["chosen"] == 1 and report["ms"] == [1.0, 0.5]
    x = torch.randn(32768)
    out = load(tmp_path, spec, program)(x)
    torch.testing.assert_close(out, x.sum(), rtol=1e-5, atol=1e-4)


def test_inductors_config_stays_where_another_is_not_faster_beyond_the_margin():
    reports = []
    _, program = capture_retuned(lambda r0_block: 1.0 if r0_block == 2048 else 0.99, reports)
    split = next(l for l in program.launches if l.kernel == SPLIT)
    assert split.constexprs["R0_BLOCK"] == 2048 and split.num_warps != 8
    assert reports[0][0]["chosen"] == 0


def test_a_retune_that_fails_leaves_inductors_choices_with_a_warning(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no profiler here")
    monkeypatch.setattr(inductor, "retune", broken)
    with caplog.at_level("WARNING", logger="torch_kernelize.fill_cache"):
        assert inductor._retuned(None, None, [], {}) is None
    assert "were not timed in the program (RuntimeError: no profiler here)" in caplog.text


def test_a_kernel_below_the_share_of_the_graph_is_not_retuned(monkeypatch):
    class Cfg:
        def __init__(self, block):
            self.kwargs, self.num_warps, self.num_stages = {"XBLOCK": block}, 4, 1

    class Tuner:  # compiled (configs dropped), one launcher per config, not yet called
        def __init__(self):
            self.configs, self.launchers = None, [SimpleNamespace(config=Cfg(1024)), SimpleNamespace(config=Cfg(512))]

    small, big = Tuner(), Tuner()
    variants = []

    def timer(call, calls):  # the small kernel: 0.1% of the graph's time
        variants.append(call)
        return {"small": 0.001, "big": 1.0}
    monkeypatch.setattr(inductor_retune, "_autotuners", lambda module: {"small": small, "big": big})
    offered = offered_configs([object()])
    assert offered[id(big)] == [l.config for l in big.launchers]
    big.launchers = big.launchers[1:]  # Inductor's first call: its choice, the second config
    small.launchers = small.launchers[:1]
    tuning = retune(lambda: None, object(), [], offered, timer=timer)
    assert [r["kernel"] for r in tuning.report] == ["big"] and len(variants) == 2
    assert tuning.report[0]["configs"][0].startswith("XBLOCK=512")  # Inductor's choice first
    assert tuning.config_of(small) is None and tuning.config_of(big) is big.launchers[0].config
