"""A whole graph is judged as a compiled model is: against float64, relative to the vendor's own
error in the graph's precision (core/graph_accuracy.py), in validate() too."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.compiling.regions import region_spec
from torch_kernelize.compiling.whole_graph import whole_graph_region
from torch_kernelize.core.graph_accuracy import is_whole, judge, judge_output
from torch_kernelize.core.validate import BY_VENDOR_ERROR, validate
from torch_kernelize.fill_cache.graph_candidates import WHOLE_GRAPH_DOMAIN


def test_an_output_within_three_times_the_vendors_float16_error_passes_and_five_times_fails():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4096, generator=g, dtype=torch.float64)
    noise = torch.randn(4096, generator=g, dtype=torch.float64) * 1e-2
    vendor = (ref + noise).half()
    assert judge_output((ref + 2 * noise).half(), ref, vendor) is None
    why = judge_output((ref + 5 * noise).half(), ref, vendor)
    assert why is not None and "above 3 x the vendor's" in why
    assert judge_output((ref + 2.5 * noise).float(), ref, (ref + noise).float()) is not None  # 2x in float32


def test_nan_where_the_vendor_has_none_and_a_wrong_integer_fail():
    ref = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    vendor = ref.half()
    assert "non-finite" in judge_output(torch.tensor([1.0, float("nan"), 3.0]).half(), ref, vendor)
    ids = torch.tensor([3, 1, 2])
    assert judge_output(ids, ids, ids) is None
    assert "1 element(s) differ" in judge_output(torch.tensor([3, 0, 2]), ids, ids)
    assert "output 1" in judge([ref.half(), torch.tensor([0])], [ref, ids[:1]], [vendor, ids[:1]])


def test_integers_from_rounded_floats_may_make_the_vendors_choices_but_no_third():
    """An MoE router's stable sort of expert ids: float64 picks another expert at a near-tie and every
    later position of the sort moves. A program that makes the vendor's choices passes, as
    torch._dynamo's ``same`` compares integers with the eager result; one that makes neither fails."""
    ref, vendor = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 2, 1, 3])
    assert judge_output(vendor.clone(), ref, vendor) is None
    assert judge_output(torch.tensor([0, 3, 1, 2]), ref, vendor) == \
        "3 element(s) differ from the reference, 2 from the vendor's"


def test_a_value_kept_finite_where_the_vendor_overflowed_is_judged_against_float64():
    ref = torch.tensor([1.0, 7.0e4, 3.0], dtype=torch.float64)     # 7e4: beyond float16
    vendor = torch.tensor([1.0, float("inf"), 3.0], dtype=torch.float16)
    upcast = torch.tensor([1.0, 65504.0, 3.0], dtype=torch.float16)  # (its float32 math, then float16's max)
    assert judge_output(vendor.clone(), ref, vendor) is None        # the vendor's overflow, where it is
    why = judge_output(upcast, ref, vendor)                        # finite as float64 is: its error counts
    assert why is not None and why.startswith("RMSE against float64")
    close = torch.tensor([1.0, 7.0e4, 3.0], dtype=torch.float32)
    assert judge_output(close, ref, vendor.float()) is None
    # where the vendor overflowed, NaN or -inf is that overflow summed in another order (inf - inf);
    # the H100 fill of Mixtral's last stretch met it on its "large" trial
    for other in (float("nan"), float("-inf")):
        assert judge_output(torch.tensor([1.0, other, 3.0], dtype=torch.float16), ref, vendor) is None
    nan_elsewhere = torch.tensor([float("nan"), float("inf"), 3.0], dtype=torch.float16)
    why = judge_output(nan_elsewhere, ref, vendor)
    assert "neither where the vendor's are nor where the reference's" in why and "first at flat index 0: nan" in why


def test_where_the_vendor_has_no_finite_element_its_error_is_unbounded():
    """ConvNeXt's whole graph on its "large" trial (every weight drawn large): eager's float32 is NaN
    throughout, float64 about 1e10, Inductor's program finite but far off. With no finite vendor
    element there is no error to scale the bar by (it was read as 0: the strictest bar of all)."""
    ref = torch.tensor([1.0e10, -3.0e9, 7.0e9], dtype=torch.float64)
    vendor = torch.full((3,), float("nan"))
    assert judge_output(torch.tensor([4.0e9, -1.0e9, 2.0e9]), ref, vendor) is None
    assert judge_output(vendor.clone(), ref, vendor) is None
    # one finite vendor element is evidence of its error: the output is judged by the RMSE again
    partly = torch.tensor([1.0e10, float("nan"), float("nan")])
    assert judge_output(torch.tensor([4.0e9, -1.0e9, 2.0e9]), ref, partly).startswith("RMSE against float64")


def test_an_infinity_at_the_edge_of_the_range_is_a_rounding_across_it():
    """float64 just under float16's largest value: the vendor's order of a sum stays under it, another
    crosses it. An infinity of float64's sign there passes; of the other sign, or far from the edge, not."""
    ref = torch.tensor([1.0, 65400.0, -65400.0, 3.0], dtype=torch.float64)
    vendor = ref.half()
    inf = float("inf")
    assert judge_output(torch.tensor([1.0, inf, -inf, 3.0], dtype=torch.float16), ref, vendor) is None
    assert judge_output(torch.tensor([1.0, -inf, -inf, 3.0], dtype=torch.float16), ref, vendor) is not None
    assert judge_output(torch.tensor([1.0, 65400.0, -65400.0, inf], dtype=torch.float16), ref, vendor) is not None


def _whole_spec():
    def deep(x, w):
        for _ in range(12):
            x = torch.tanh(x @ w) * 1.5
        return x

    args = (torch.randn(64, 64, dtype=torch.float16), torch.randn(64, 64, dtype=torch.float16) / 8)
    return region_spec(whole_graph_region(make_fx(deep, tracing_mode="fake")(*args))[0], {})


def _off_by(k: float, spec):
    """A 'candidate' whose outputs are the vendor's moved ``k`` times its own error further from float64."""
    def run(inputs):
        vendor = spec.run_vendor(inputs)
        ref = spec.run_vendor([t.double() for t in inputs])
        return [(v.double() + (k - 1) * (v.double() - r)).to(v.dtype) for v, r in zip(vendor, ref)]
    return run


def test_validate_judges_a_whole_graph_by_the_vendors_error():
    spec = _whole_spec()
    assert is_whole(spec) and spec.outputs[0].dtype == "float16"
    record = validate(_off_by(2.0, spec), spec, WHOLE_GRAPH_DOMAIN.sample_inputs)
    assert record.ok, record.reason
    assert record.decided_by.startswith(BY_VENDOR_ERROR)  # one float16 op's bar alone fails it
    record = validate(_off_by(6.0, spec), spec, WHOLE_GRAPH_DOMAIN.sample_inputs)
    assert not record.ok and "RMSE against float64" in record.reason
