"""``kernels/upsample_fold``: a folded upsample's transposed-conv weight in one kernel, against the
torch ops of ``ops/upsample_fold.py`` (the definition) and float64: 1-3 spatial dims, groups, mixed
scales, even kernels, channels-last and strided weights, fp32 and half precision, NaN and inf taps;
``upsampled_conv_weight_direct`` (what a graph without Inductor runs) with the definition's gradient;
a weight the kernel cannot take goes to the torch ops.  Under the interpreter on CPU, with CUDA on the
GPU."""

from __future__ import annotations

import pytest
import torch

from fusion_backend.kernels.plan_cache import ContractError
from fusion_backend.ops.upsample_fold import upsampled_conv_weight, upsampled_conv_weight_direct

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

#: name -> (weight shape, scale, groups, layout)
CASES = {
    "3x3, 2x, channels-last": ((6, 4, 3, 3), (2, 2), 1, "channels-last"),
    "3x5, 2x1, groups 2": ((8, 3, 3, 5), (2, 1), 2, "contiguous"),
    "1-d, 4x, kernel 4": ((4, 3, 4), (4,), 1, "contiguous"),
    "3-d, 2x, depthwise, channels-last": ((6, 1, 3, 3, 3), (2, 2, 2), 6, "channels-last"),
    "2x3, 2x, a strided view": ((5, 4, 2, 3), (2, 2), 1, "strided"),
    "1x1, 4x2": ((7, 5, 1, 1), (4, 2), 1, "contiguous"),
}


@pytest.fixture
def fold(triton_kernels):
    """``fold_weight`` in the weight's dtype (or ``dtype``) and the layout the op asks for."""
    from fusion_backend.kernels.upsample_fold import fold_weight
    from fusion_backend.ops.upsample_fold import folded_layout

    return lambda w, scale, groups, dtype=None: fold_weight(w, scale, groups, dtype or w.dtype, folded_layout(w))


def _weight(shape, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    if layout == "strided":
        w = torch.randn(*shape[:-1], 2 * shape[-1], generator=g)[..., ::2]
    else:
        w = torch.randn(shape, generator=g)
    w = w.to(DEVICE, dtype)
    if layout == "channels-last":
        w = w.to(memory_format=torch.channels_last if w.dim() == 4 else torch.channels_last_3d)
    return w


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_folds_as_the_torch_ops_do(fold, case, dtype):
    shape, scale, groups, layout = CASES[case]
    w = _weight(shape, dtype, layout, hash(case) % 2**31)
    got, want = fold(w, scale, groups), upsampled_conv_weight(w, scale, groups)
    assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == dtype
    exact = upsampled_conv_weight(w.double(), scale, groups)
    # fp32 sums of at most 8 taps: one rounding of the result, plus a few of the sums for fp32
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_nan_and_inf_taps_reach_exactly_the_folded_taps_that_sum_them(fold):
    w = _weight((4, 3, 3, 3), torch.float32, "contiguous", 7)
    w[1, 2, 0, 1], w[2, 0, 2, 2] = float("nan"), float("inf")
    got, want = fold(w, (2, 2), 1), upsampled_conv_weight(w, (2, 2), 1)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite])


def test_the_direct_implementation_is_the_kernel_with_the_definition_s_gradient(triton_kernels, monkeypatch):
    from fusion_backend.kernels import upsample_fold as kernel

    launched = []
    monkeypatch.setattr(kernel, "fold_weight", lambda *a: (launched.append(a), kernel.FoldPlan(*a)(a[0]))[1])  # (w, s, g, dtype, layout)
    w = _weight((6, 2, 3, 3), torch.float32, "channels-last", 8).requires_grad_()
    grad = torch.randn(4, 3, 4, 4, device=DEVICE)
    got = upsampled_conv_weight_direct(w, (2, 2), 2)
    with torch.no_grad():
        upsampled_conv_weight_direct(w, (2, 2), 2)
    assert len(launched) == 2  # with a gradient (through its autograd function) and without
    want = upsampled_conv_weight(w, (2, 2), 2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (g_got,), (g_want,) = (torch.autograd.grad(t, w, grad) for t in (got, want))
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=0)


def test_a_weight_the_kernel_cannot_take_says_why_and_the_torch_ops_take_it(fold):
    w = _weight((4, 3, 3, 3), torch.float32, "contiguous", 9)
    with pytest.raises(ContractError, match=r"scale \(2,\) and groups 1 do not fit a weight of shape \(4, 3, 3, 3\)"):
        fold(w, (2,), 1)
    wide = w.double()
    torch.testing.assert_close(upsampled_conv_weight_direct(wide, (2, 2), 1), upsampled_conv_weight(wide, (2, 2), 1))


def test_a_failed_launch_warns_once_and_the_torch_ops_serve_that_weight_from_then_on(triton_kernels, monkeypatch):
    from fusion_backend.kernels import upsample_fold as kernel

    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(kernel, "fold_weight", failing)
    w = _weight((5, 3, 3, 3), torch.float32, "contiguous", 10)
    with pytest.warns(RuntimeWarning, match="the upsample fold's kernel failed .* simulated launch failure"):
        got = upsampled_conv_weight_direct(w, (2, 2), 1)
    assert torch.equal(got, upsampled_conv_weight(w, (2, 2), 1))
    upsampled_conv_weight_direct(w, (2, 2), 1)
    assert len(calls) == 1  # not tried again for that weight


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: str(d).replace("torch.", ""))
def test_an_fp32_weight_folds_into_the_conv_s_half_precision_rounded_once(fold, dtype):
    """Under autocast the rewrite asks for the conv's dtype: fp32 sums rounded once, as the torch
    ops round them (no cast of the folded weight after it)."""
    w = _weight((6, 4, 3, 3), torch.float32, "channels-last", 11)
    got, want = fold(w, (2, 2), 1, dtype), upsampled_conv_weight(w, (2, 2), 1, dtype)
    assert got.dtype == dtype and got.stride() == want.stride()
    torch.testing.assert_close(got, want)  # (fp32 sums in another order may round to a neighbour)
    torch.testing.assert_close(upsampled_conv_weight_direct(w, (2, 2), 1, dtype), want)
