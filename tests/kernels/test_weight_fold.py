"""``kernels/weight_fold``: a per-output-channel scale and shift folded into a conv's weight and bias in
one kernel, against the same arithmetic in float64 (each value rounded once to the conv's dtype, so at
most one rounding step from the exact fold) and against ``fold_reference`` (what CPU tensors run);
contiguous and channels-last weights, odd sizes with partial blocks, every operand optional, casts from
fp32 weights (autocast); a one-line error for a weight it cannot walk.  Under the interpreter on CPU,
with CUDA on the GPU."""

from __future__ import annotations

import pytest
import torch

from fusion_backend.kernels.plan_cache import ContractError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CL = {4: torch.channels_last, 5: torch.channels_last_3d}


@pytest.fixture
def fold(triton_kernels):
    from fusion_backend.kernels import weight_fold

    return weight_fold


def _fold(fold, weight, scale, shift, bias, dtype):  # noqa: ANN001, ANN202
    """One call through a plan built for these tensors (``fold_plan``), as the op makes and keeps it."""
    return fold.fold_plan(weight, scale, shift, bias, dtype)(weight, scale, shift, bias)


def _ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("shape,layout", [
    ((37, 5, 3, 3), "contiguous"), ((37, 5, 3, 3), "channels-last"), ((300, 7, 1, 1), "channels-last"),
    ((6, 4, 3, 3, 3), "channels-last"), ((1, 1, 1, 1), "contiguous"), ((9, 2, 5), "contiguous"),
], ids=str)  # fmt: skip
@pytest.mark.parametrize("parts", ["scale-shift-bias", "scale-shift", "shift", "scale-bias"])
@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float16), (torch.float32, torch.float16),
                                    (torch.float32, torch.float32)], ids=lambda d: f"{d[0]}->{d[1]}")  # fmt: skip
def test_the_fold_rounds_the_exact_product_once(fold, shape, layout, parts, dtypes):
    src, dtype = dtypes
    g = torch.Generator().manual_seed(len(shape) * 31 + shape[0] + len(parts))
    c = shape[0]
    weight = torch.randn(shape, generator=g).to(DEVICE, src)
    if layout == "channels-last":
        weight = weight.contiguous(memory_format=CL[len(shape)])
    scale = (torch.rand(c, generator=g) + 0.5).to(DEVICE) if "scale" in parts else None
    shift = torch.randn(c, generator=g).to(DEVICE) if "shift" in parts else None
    bias = torch.randn(c, generator=g).to(DEVICE, src) if "bias" in parts else None
    w, b = _fold(fold, weight, scale, shift, bias, dtype)
    assert w.dtype == b.dtype == dtype and w.stride() == weight.stride() and b.shape == (c,)
    exact_w = weight.double() * (1.0 if scale is None else scale.double().view(-1, *([1] * (len(shape) - 1))))
    base = torch.zeros(c, dtype=torch.float64, device=DEVICE) if bias is None else bias.double()
    product = base * (1.0 if scale is None else scale.double())
    exact_b = product + (0.0 if shift is None else shift.double())
    # one rounding to dtype (half an ulp) plus the fp32 arithmetic: a product (the weight), a product and a
    # sum (the bias, whose fp32 error scales with its terms, not with the sum)
    fp32 = torch.finfo(torch.float32).eps
    assert ((w.double() - exact_w).abs() <= _ulp(dtype) * exact_w.abs() + 1e-30).all()
    terms = product.abs() + (0.0 if shift is None else shift.double().abs())
    assert ((b.double() - exact_b).abs() <= _ulp(dtype) * exact_b.abs() + 2 * fp32 * terms + 1e-30).all()
    ref_w, ref_b = fold.fold_reference(weight, scale, shift, bias, dtype)
    torch.testing.assert_close(w, ref_w, rtol=_ulp(dtype), atol=0)
    torch.testing.assert_close(b, ref_b, rtol=_ulp(dtype), atol=2 * _ulp(dtype) * terms.max().item())


def test_a_chain_operands_per_channel_shape_folds_as_its_values(fold):
    """Scale and shift as the chain hands them over (``(1, C, 1, 1)`` views) fold as their ``C`` values do,
    the same plan called again giving the same bits."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(5, 3, 3, 3, generator=g).to(DEVICE).contiguous(memory_format=torch.channels_last)
    scale, shift = (torch.rand(5, generator=g) + 0.5).to(DEVICE), torch.randn(5, generator=g).to(DEVICE)
    flat = _fold(fold, weight, scale, shift, None, torch.float16)
    plan = fold.fold_plan(weight, scale.view(1, 5, 1, 1), shift.view(1, 5, 1, 1), None, torch.float16)
    for _ in range(2):
        got = plan(weight, scale.view(1, 5, 1, 1), shift.view(1, 5, 1, 1), None)
        assert torch.equal(got[0], flat[0]) and torch.equal(got[1], flat[1])
    ref = fold.fold_reference(weight, scale.view(1, 5, 1, 1), shift.view(1, 5, 1, 1), None, torch.float16)
    torch.testing.assert_close(ref, flat, rtol=1e-3, atol=1e-3)


def test_nan_and_inf_in_the_weight_stay_where_they_are(fold):
    weight = torch.randn(4, 3, 3, 3).to(DEVICE)
    weight[1, 2, 0, 0], weight[3, 0, 2, 1] = float("nan"), float("inf")
    w, _ = _fold(fold, weight, torch.full((4,), 2.0, device=DEVICE), None, None, torch.float32)
    assert torch.equal(w.isnan(), weight.isnan()) and torch.equal(w.isinf(), weight.isinf())
    finite = weight.isfinite()
    assert torch.equal(w[finite], weight[finite] * 2)


def test_a_weight_it_cannot_walk_is_refused_in_one_line(fold):
    weight = torch.randn(8, 6, 3, 3, device=DEVICE)[:, ::2]  # channel stride 2: not dense
    with pytest.raises(ContractError, match="weight fold: the weight must be dense") as info:
        _fold(fold, weight, None, torch.zeros(8, device=DEVICE), None, torch.float32)
    assert "\n" not in str(info.value)
    with pytest.raises(ContractError, match="scale must hold the weight's 8 output channels"):
        _fold(fold, torch.randn(8, 6, 3, 3, device=DEVICE), torch.ones(7, device=DEVICE), None, None, torch.float32)
