"""``ops/failure.py``: the policy every fused op follows when its Triton path cannot serve a call or
fails (the families' op tests exercise it through each op; these pin the shared pieces)."""

from __future__ import annotations

import pytest
import torch

from fusion_backend.errors import UnsupportedInputError
from fusion_backend.ops.failure import check_backward_call, triton_or_reference, triton_serves


def test_the_triton_path_runs_where_it_serves_and_the_reference_where_it_does_not() -> None:
    failures = []
    assert triton_or_reference(True, lambda: "triton", lambda: "reference", failures.append) == "triton"
    assert triton_or_reference(False, lambda: "triton", lambda: "reference", failures.append) == "reference"
    assert failures == []


def test_a_failing_triton_path_reports_its_error_then_runs_the_reference() -> None:
    failures = []

    def broken():
        raise RuntimeError("kernel exploded")

    assert triton_or_reference(True, broken, lambda: "reference", failures.append) == "reference"
    assert [str(e) for e in failures] == ["kernel exploded"]


def test_a_strict_policy_stops_before_the_reference() -> None:
    def strict(error: Exception) -> None:
        raise error

    def broken():
        raise RuntimeError("kernel exploded")

    def reference():
        raise AssertionError("the reference must not run")

    with pytest.raises(RuntimeError, match="kernel exploded"):
        triton_or_reference(True, broken, reference, strict)


def test_unserved_cases_raise_only_under_strict_on_cuda() -> None:
    assert triton_serves("conv_x", None, strict=True, device_type="cuda")
    assert not triton_serves("conv_x", "fp64", strict=False, device_type="cuda")
    assert not triton_serves("conv_x", "fp64", strict=True, device_type="cpu")
    with pytest.raises(UnsupportedInputError, match="fusion::conv_x has no Triton kernel here: fp64"):
        triton_serves("conv_x", "fp64", strict=True, device_type="cuda")


def test_backward_calls_outside_the_autograd_formula_get_one_line_errors() -> None:
    stats = torch.empty(2, 3)
    check_backward_call("conv_x", [True] * 5, 2, [stats])
    with pytest.raises(ValueError, match="output_mask needs 5 entries, got 4"):
        check_backward_call("conv_x", [True] * 4, 2, [stats])
    with pytest.raises(RuntimeError, match=r"fusion::conv_x_bwd: the forward ran with save_for_backward=False"):
        check_backward_call("conv_x", [True] * 5, 2, [torch.empty(0)])
