"""Inputs an op constrains (core/input_domains.py): trials draw embedding_bag offsets rising from
0 and ids in range, sorted sequences for searchsorted, so the reference accepts them; an input
the reference rejects is "could not check" (exit 2), never a rejected candidate."""
from __future__ import annotations

import pytest
import torch

from torch_kernelize.core.errors import InputRejected
from torch_kernelize.core.input_domains import requirements
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.validate import Trials
from torch_kernelize.fill_cache.external import CandidateGenerator
from torch_kernelize.repro.task import _domain_lines

aten = torch.ops.aten


def _bag_spec(include_last: bool) -> KernelSpec:
    w, ids = torch.randn(10, 4), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 3, 3, 8] if include_last else [0, 3, 3])
    args = [w, ids, offsets, False, 0, False, None, include_last]
    return KernelSpec.from_call(aten._embedding_bag.default, args, {}, aten._embedding_bag.default(*args))


@pytest.mark.parametrize("include_last", [False, True])
def test_embedding_bag_trials_draw_valid_offsets_and_ids(include_last):
    spec = _bag_spec(include_last)
    generator = CandidateGenerator([], None)  # no family generates it: the candidate route's own draws
    for seed in range(5):
        w, ids, offsets = generator.sample_inputs(spec, seed)
        assert offsets[0] == 0 and bool((offsets.diff() >= 0).all()) and int(offsets[-1]) <= ids.numel()
        assert not include_last or int(offsets[-1]) == ids.numel()
        assert bool(((ids >= 0) & (ids < w.size(0))).all())
        spec.reference([w, ids, offsets])  # the reference accepts them
        assert torch.equal(generator.sample_inputs(spec, seed)[2], offsets)  # the seed fixes them
    assert "non-decreasing from 0" in requirements(spec)[2] and "ids in [0, weight.size(0))" in requirements(spec)[1]
    assert any("offsets: non-decreasing from 0" in line for line in _domain_lines(spec))


def test_searchsorted_trials_draw_a_sorted_sequence():
    seq, v = torch.randn(3, 16).sort(-1).values, torch.randn(3, 5)
    spec = KernelSpec.from_call(aten.searchsorted.Tensor, [seq, v], {}, torch.searchsorted(seq, v))
    s, _ = CandidateGenerator([], None).sample_inputs(spec, 0)
    assert torch.equal(s, s.sort(-1).values) and not torch.equal(s, torch.zeros_like(s))


def test_repeat_interleave_trials_draw_repeats_summing_to_the_output_size():
    r = torch.tensor([2, 0, 3])
    spec = KernelSpec.from_call(aten.repeat_interleave.Tensor, [r], {"output_size": 5},
                                torch.repeat_interleave(r, output_size=5))
    for seed in range(3):
        (drawn,) = CandidateGenerator([], None).sample_inputs(spec, seed)
        assert int(drawn.sum()) == 5 and bool((drawn >= 0).all()) and drawn.dtype == r.dtype
        spec.reference([drawn])  # the reference accepts them
    assert "summing to output_size (5)" in requirements(spec)[0]


def test_inputs_the_reference_rejects_are_could_not_check():
    # take's ids out of range (no rule for take): the harness, not a candidate, is at fault
    x, i = torch.randn(3), torch.tensor([0, 2])
    spec = KernelSpec.from_call(aten.take.default, [x, i], {}, aten.take.default(x, i))
    source = Trials(spec, lambda s, seed, kind, dev: [torch.randn(3), torch.tensor([7, -9])], "cpu")
    with pytest.raises(InputRejected, match="could not check"):
        source.reference(0, "random", source.inputs(0, "random"))


def _repro_of(tmp_path, op, args):
    from torch_kernelize.core.targets import get_target
    from torch_kernelize.serving.repro_writer import write_repro
    spec = KernelSpec.from_call(op, args, {}, op(*args))
    folder = tmp_path / "repro"
    assert write_repro(folder, spec, [a for a in args if isinstance(a, torch.Tensor)], get_target("interpreter"),
                       "missing", None)
    return folder


def test_an_embedding_bag_candidate_is_checked_on_valid_offsets(tmp_path, capsys):
    """No family generates _embedding_bag: its reproducer's candidate is judged on trials whose
    offsets rise from 0 and whose ids name rows (uniform draws made the reference raise)."""
    from torch_kernelize.fill_cache.external import check_main
    from conftest import REPO
    w, ids, offsets = torch.randn(10, 4), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 3])
    folder = _repro_of(tmp_path, aten._embedding_bag.default, [w, ids, offsets, False, 1, False, None, False])
    import json
    assert json.loads((folder / "spec.json").read_text())["input_domains"]["2"].startswith("offsets: non-decreasing")
    code = check_main(folder, [str(REPO / "test" / "candidates" / "embedding_bag_mean.py"), "--target", "interpreter"])
    out = capsys.readouterr()
    assert code == 0 and "ACCEPTED" in out.out, out


def test_check_candidate_exits_2_when_the_reference_rejects_the_inputs(tmp_path, capsys, monkeypatch):
    """Without embedding_bag's domain rule the trials' offsets are uniform integers, which the
    reference rejects: the harness could not check the candidate (exit 2, one line), it did not
    reject it."""
    from torch_kernelize.core import input_domains
    from torch_kernelize.fill_cache.external import check_main
    from conftest import REPO
    monkeypatch.delitem(input_domains.RULES, "aten._embedding_bag.default")
    w, ids, offsets = torch.randn(10, 4), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 3])
    folder = _repro_of(tmp_path, aten._embedding_bag.default, [w, ids, offsets, False, 1, False, None, False])
    code = check_main(folder, [str(REPO / "test" / "candidates" / "embedding_bag_mean.py"), "--target", "interpreter"])
    out = capsys.readouterr()
    err = out.err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "could not check" in err, out
