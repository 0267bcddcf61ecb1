"""Advanced indexing (lowering/kernels/advanced_indexing.py): index.Tensor and index_put with
several index tensors that broadcast, None dims between them, negative, int32 and int64 indices,
bool masks, against float64; an index out of range raises eager's IndexError, never a device
assert (a flag checked after the launch)."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import load, run_validation, spec_of
from torch_kernelize.core.errors import IndexOutOfRange
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.advanced_indexing import FAMILY
from torch_kernelize.lowering.kernels.base import Config

aten = torch.ops.aten
i64, i32 = torch.int64, torch.int32


def _idx(shape, n, dtype=i64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-n, n, shape, generator=g).to(dtype)


CASES = {
    # transformers' padding-mask construction (Llama with an attention_mask): b8[2x16] gathered
    # at [2x1x1x1] x [1x1x1x16]; and an i64 table at [2x1x1x1] x [1x1x16x1]
    "llama_mask": lambda: (aten.index.Tensor, (torch.rand(2, 16) < 0.7,
                                               [torch.arange(2).view(2, 1, 1, 1), torch.arange(16).view(1, 1, 1, 16)])),
    "llama_mask_i64": lambda: (aten.index.Tensor, (torch.arange(32).reshape(2, 16),
                                                   [torch.arange(2).view(2, 1, 1, 1), torch.arange(16).view(1, 1, 16, 1)])),
    "broadcast_adjacent": lambda: (aten.index.Tensor, (torch.randn(5, 6, 7), [_idx((3, 1), 5), _idx((1, 4), 6, i32)])),
    "none_between": lambda: (aten.index.Tensor, (torch.randn(5, 6, 7), [_idx((4,), 5), None, _idx((4,), 7)])),
    "none_before_int32": lambda: (aten.index.Tensor, (torch.randn(3, 5, 6, 2),
                                                      [None, _idx((2, 3), 5, i32), _idx((2, 3), 6, i32)])),
    "put_accumulate": lambda: (aten.index_put.default, (torch.randn(5, 6, 3), [_idx((4, 1), 5), _idx((1, 3), 6)],
                                                         torch.randn(4, 3, 3), True)),
    "put_none_between": lambda: (aten.index_put.default, (torch.randn(4, 3, 5), [torch.tensor([0, -1, 2]), None,
                                                                                 torch.tensor([4, 1, -2])],
                                                          torch.randn(3), False)),
    "put_bool_mask": lambda: (aten.index_put.default, (torch.randn(4, 6, 3), [torch.rand(4, 6) < 0.5],
                                                       torch.tensor(-7.0), False)),
    "put_bool_mask_unmasked_block": lambda: (aten.index_put.default, (torch.randn(8, 16), [torch.rand(8, 16) < 0.5],
                                                                      torch.tensor(2.0), True)),
    "put_bool_mask_rows": lambda: (aten.index_put.default, (torch.randn(4, 6, 3), [None, torch.rand(6, 3) < 0.5],
                                                            torch.randn(4, 1, ), True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_advanced_indexing_matches_float64_and_eager(case, tmp_path):
    op, args = CASES[case]()
    spec = spec_of(op, args)
    assert family_for(spec) is FAMILY, FAMILY.supports(spec)
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    rec = run_validation(FAMILY, spec, program, tmp_path, seeds=(0, 1), kinds=("special",))
    assert rec.ok, rec.reason
    got = load(tmp_path, spec, program)(*_spec_order(args))
    torch.testing.assert_close(got, op(*args))


def _spec_order(args):
    """The tensors of a call in KernelSpec order (pytree order of the arguments)."""
    return [t for t in torch.utils._pytree.tree_leaves(list(args)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("case", ["llama_mask", "none_between", "put_accumulate"])
def test_an_index_out_of_range_raises_eagers_error(case, tmp_path):
    op, args = CASES[case]()
    spec = spec_of(op, args)
    runner = load(tmp_path, spec, FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]))
    tensors = _spec_order(args)
    k = next(i for i, t in enumerate(tensors) if not t.is_floating_point() and i > 0)
    bad = tensors[k].clone()
    bad.view(-1)[-1] = 10 ** 4
    orig, tensors[k] = tensors[k], bad
    swap = lambda a: bad if a is orig else a  # noqa: E731
    with pytest.raises(IndexError):  # eager's
        op(*torch.utils._pytree.tree_map(swap, list(args)))
    with pytest.raises(IndexOutOfRange, match="out of bounds for dimension"):
        runner(*tensors)


def test_what_is_declined_says_why():
    x = torch.randn(4, 5)
    dup = spec_of(aten.index_put.default, (x, [_idx((3, 1), 4), _idx((1, 2), 5)], torch.randn(3, 2), False))
    assert "unspecified" in FAMILY.supports(dup)
    mask = torch.rand(4, 5) < 0.5
    follow = spec_of(aten.index_put.default, (x, [mask], torch.randn(int(mask.sum())), False))
    assert "data-dependent" in FAMILY.supports(follow)


def test_a_kernel_without_its_range_check_fails(tmp_path):
    # the check is what makes an out-of-range index an error: without the flag store, none
    op, args = CASES["none_between"]()
    spec = spec_of(op, args)
    program = FAMILY.generate(spec, Config.of(BLOCK=32, num_warps=1))
    assert program.checks and "tl.store(flag0_ptr" in program.source
    tensors = _spec_order(args)
    tensors[1] = tensors[1].clone().fill_(99)
    import dataclasses
    lines = [l for l in program.source.splitlines() if "tl.store(flag" not in l]
    quiet = dataclasses.replace(program, source="\n".join(lines) + "\n")
    load(tmp_path, spec, quiet)(*tensors)  # no error: it is the flag that raises
    with pytest.raises(IndexOutOfRange):
        load(tmp_path, spec, program)(*tensors)


def test_a_compiled_model_raises_eagers_error_and_keeps_its_kernel(tmp_path, caplog):
    """Through the backend: the gather runs on Triton after a fill; an index out of range raises
    IndexError from the call (the kernel is not disabled: the input was wrong, not the kernel)."""
    from conftest import write_target
    from torch_kernelize.fill_cache import cli as fill_cli
    (tmp_path / "m.py").write_text(
        "import torch\nclass M(torch.nn.Module):\n    def forward(self, x, i, j):\n        return x[i, :, j] * 2\n"
        "def make():\n    return M(), (torch.randn(5, 3, 7), torch.tensor([[0], [-1]]), torch.tensor([[1, 6, -7]]))\n")
    chip = write_target(tmp_path / "chip.toml", supported=["aten.mm"])
    assert fill_cli.main(["--model", f"{tmp_path / 'm.py'}:make", "--target", str(chip), "--cache-dir",
                          str(tmp_path / "kc"), "--budget", "1", "--quiet"]) == 0
    from torch_kernelize.fill_cache.collect import load_model
    model, (x, i, j) = load_model(f"{tmp_path / 'm.py'}:make")
    compiled = torch.compile(model, backend="kernelize", options={
        "target": str(chip), "cache_dir": str(tmp_path / "kc"), "repro_dir": "off", "report": str(tmp_path / "r.json")})
    torch.testing.assert_close(compiled(x, i, j), model(x, i, j))
    import json
    nodes = [n for g in json.loads((tmp_path / "r.json").read_text())["graphs"] for n in g["nodes"]]
    assert [n["tier"] for n in nodes if n["op"] == "aten.index.Tensor"] == ["triton"]
    with pytest.raises(IndexOutOfRange, match="out of bounds"):
        compiled(x, torch.tensor([[0], [5]]), j)
    assert "is disabled" not in caplog.text  # still served by the kernel
    torch.testing.assert_close(compiled(x, i, j), model(x, i, j))
