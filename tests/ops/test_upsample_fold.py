"""A nearest upsample folded into the conv after it (``ops/upsample_fold.py``): the transposed conv on
the folded weight is the upsampled conv, in float64 to rounding, with the same gradients; the folded
weight keeps the weight's dtype and layout; what cannot fold says why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops.upsample_fold import (
    transposed_equivalent,
    upsample_fold_problem,
    upsampled_conv_weight,
)

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}

#: name -> (scale, kernel, padding, groups, channels in, channels out, input spatial sizes)
CASES = {
    "2x, 3x3, pad 1 (decoders, UNets)": ((2, 2), (3, 3), (1, 1), 1, 5, 7, (6, 9)),
    "2x1, 3x5, pads 0 and 2, groups 2": ((2, 1), (3, 5), (0, 2), 2, 6, 8, (5, 7)),
    "1-d, 4x, kernel 4, pad 2": ((4,), (4,), (2,), 1, 3, 4, (7,)),
    "3-d, 2x, 3x3x3, depthwise": ((2, 2, 2), (3, 3, 3), (1, 1, 1), 4, 4, 4, (3, 4, 5)),
    "1x1 conv": ((2, 2), (1, 1), (0, 0), 1, 4, 3, (5, 6)),
    "even kernel 2x3, pads 1 and 0": ((2, 2), (2, 3), (1, 0), 1, 3, 5, (4, 5)),
    "a size-1 input": ((2, 2), (3, 3), (1, 1), 1, 2, 3, (1, 1)),
}


def _upsampled_conv(x, w, b, scale, padding, groups):
    return CONV[x.dim() - 2](F.interpolate(x, scale_factor=scale, mode="nearest"), w, b, padding=padding, groups=groups)


def _folded_conv(x, w, b, scale, padding, groups):
    kernel = tuple(w.shape[2:])
    spec = ConvSpec(False, (1,) * len(kernel), tuple(padding), (1,) * len(kernel), (0,) * len(kernel), groups)
    assert upsample_fold_problem(spec, kernel, scale) is None
    t = transposed_equivalent(spec, kernel, scale)
    return CONV_T[x.dim() - 2](x, upsampled_conv_weight(w, scale, groups), b, stride=t.stride, padding=t.padding,
                               groups=groups)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_transposed_conv_on_the_folded_weight_is_the_upsampled_conv(case):
    """Output and the gradients of x, the weight and the bias, float64, fresh random values."""
    scale, kernel, padding, groups, c_in, c_out, sizes = CASES[case]
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    x, w, b = (torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
               for s in ((2, c_in, *sizes), (c_out, c_in // groups, *kernel), (c_out,)))  # fmt: skip
    want = _upsampled_conv(x, w, b, scale, padding, groups)
    got = _folded_conv(x, w, b, scale, padding, groups)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    for g, e in zip(torch.autograd.grad(got, (x, w, b), grad), torch.autograd.grad(want, (x, w, b), grad), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_folded_weight_keeps_the_weight_s_dtype_and_layout_and_rounds_once(dtype):
    """Each folded tap is a float32 sum of the weight's taps (exact for half-precision taps) rounded
    once to its dtype; a channels-last weight gives a channels-last folded weight (cuDNN's fast
    layout for both)."""
    w = torch.randn(6, 4, 3, 3).to(dtype).to(memory_format=torch.channels_last)
    folded = upsampled_conv_weight(w, (2, 2), 1)
    assert folded.dtype == dtype and folded.shape == (4, 6, 4, 4)
    assert folded.is_contiguous(memory_format=torch.channels_last) and not folded.is_contiguous()
    exact = upsampled_conv_weight(w.double(), (2, 2), 1)
    exact_to = 4e-6 if dtype == torch.float32 else 0  # float32 sums round; half-precision ones do not
    torch.testing.assert_close(folded, exact.to(dtype), rtol=exact_to, atol=0)
    assert upsampled_conv_weight(torch.randn(6, 4, 3, 3), (2, 2), 1).is_contiguous()


@pytest.mark.parametrize(("spec", "kernel", "scale", "why"), [
    (ConvSpec(False, (2, 2), (1, 1), (1, 1), (0, 0), 1), (3, 3), (2, 2), "has stride (2, 2) and dilation (1, 1)"),
    (ConvSpec(False, (1, 1), (2, 2), (2, 2), (0, 0), 1), (3, 3), (2, 2), "has stride (1, 1) and dilation (2, 2)"),
    (ConvSpec(False, (1, 1), (3, 1), (1, 1), (0, 0), 1), (3, 3), (2, 2), "padding (3, 1) exceeds its kernel (3, 3)"),
    (ConvSpec(True, (1, 1), (1, 1), (1, 1), (0, 0), 1), (3, 3), (2, 2), "is a transposed conv"),
    (ConvSpec(False, (1, 1), (1, 1), (1, 1), (0, 0), 1), (3, 3), (1, 1), "keeps every size"),
], ids=["strided", "dilated", "padding beyond the kernel", "transposed", "scale 1"])
def test_what_does_not_fold_says_why(spec, kernel, scale, why):
    assert why in upsample_fold_problem(spec, kernel, scale)


@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
def test_a_folded_bias_free_region_runs_the_conv_alone_and_a_bias_goes_to_the_epilogue(layout, triton_kernels):
    """``conv_epilogue``'s library plan for ``upsample -> conv`` alone, saving nothing: without a bias,
    one aten conv (no epilogue pass over the output); with a bias (aten adds it in a slow broadcast
    add of its own), a chain, or saving for a backward, the conv then the epilogue kernel; eager's
    values and the op's fake layout either way."""
    from fusion_backend.ops import conv_epilogue as ce
    from fusion_backend.ops.chain import ChainStep, PointwiseKind
    from fusion_backend.ops.config import ConvEpilogueConfig

    fmt = torch.channels_last if layout == "channels-last" else torch.contiguous_format
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(2, 4, 5, 6, device=device).to(memory_format=fmt)
    w, b = torch.randn(6, 4, 3, 3, device=device).to(memory_format=fmt), torch.randn(6, device=device)
    spec = transposed_equivalent(ConvSpec(False, (1, 1), (1, 1), (1, 1), (0, 0), 1), (3, 3), (2, 2))
    folded = upsampled_conv_weight(w, (2, 2), 1)
    cfg = ConvEpilogueConfig(conv=spec)
    plan = ce.forward.LibraryForward(x, folded, None, [], cfg, False)
    assert plan.conv_alone
    out, *_ = plan(x, folded, None, [])
    assert torch.equal(out, F.conv_transpose2d(x, folded, None, stride=2, padding=1))
    fake, *_ = ce.reference.forward(x, folded, None, [], cfg, False)
    assert out.stride() == fake.stride()
    relu = ConvEpilogueConfig(conv=spec, chain=(ChainStep(PointwiseKind.RELU),))
    assert not ce.forward.LibraryForward(x, folded, b, [], cfg, False).conv_alone
    assert not ce.forward.LibraryForward(x, folded, None, [], relu, False).conv_alone
    assert not ce.forward.LibraryForward(x, folded, None, [], cfg, True).conv_alone
