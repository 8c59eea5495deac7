"""``ops/library_conv.py``: the conv backward the norm and channel-reduction families run after their
own kernel: which layout the conv-output gradient is written in, and gradients equal to
``aten.convolution_backward`` on the caller's own layouts, with the input gradient in x's layout."""

from __future__ import annotations

import pytest
import torch

from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops.conv_io import run_conv
from fusion_backend.ops.library_conv import conv_backward_plan

pytestmark = pytest.mark.usefixtures("exact_fp32")

CONV2D = ConvSpec(False, (1, 2), (1, 0), (1, 1), (0, 0), 1)
CONVT3D = ConvSpec(True, (2, 1, 2), (1, 0, 1), (1, 1, 1), (1, 0, 0), 1)
GROUPED2D = ConvSpec(False, (1, 1), (1, 1), (2, 1), (0, 0), 2)
CONV1D = ConvSpec(False, (2,), (1,), (1,), (0,), 1)


def _weight(spec: ConvSpec, c_in: int, c_out: int, gen) -> torch.Tensor:
    k = (3,) * spec.spatial_dims
    shape = (c_in, c_out // spec.groups, *k) if spec.transposed else (c_out, c_in // spec.groups, *k)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


LAYOUTS = {
    "contiguous": lambda t: t,
    "channels_last": lambda t: t.to(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d),
    "sliced": lambda t: t[..., 1:],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("spec", [CONV2D, CONVT3D, GROUPED2D], ids=["conv2d", "convt3d", "grouped2d"])
def test_channels_last_backward_matches_aten_on_the_callers_layouts(spec, layout, kernel_device) -> None:
    """Gradients of x, weight and bias against ``aten.convolution_backward`` in float64 on the caller's
    tensors; the conv-output gradient is channels-last; the input gradient has ``empty_like(x)``'s
    strides (channels-last x: channels-last; a slice: contiguous)."""
    gen = torch.Generator().manual_seed(3)
    size = (5, 6) if spec.spatial_dims == 2 else (3, 4, 5)
    base = torch.randn((2, 4, *size[:-1], size[-1] + 1), generator=gen, dtype=torch.float64)
    x64 = LAYOUTS[layout](base)
    w64 = _weight(spec, 4, 6, gen)
    y_shape = run_conv(x64, w64, None, spec).shape
    g64 = torch.randn(y_shape, generator=gen, dtype=torch.float64)
    want = torch.ops.aten.convolution_backward(
        g64, x64, w64, [6], list(spec.stride), list(spec.padding), list(spec.dilation), spec.transposed,
        list(spec.output_padding), spec.groups, [True, True, True],
    )  # fmt: skip

    x, w = LAYOUTS[layout](base.float().to(kernel_device)), w64.float().to(kernel_device)
    plan = conv_backward_plan(x, w, spec, run_conv(x, w, None, spec))
    grad_y = plan.new_grad_y(x.device)
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    assert grad_y.shape == y_shape and grad_y.dtype == torch.float32 and grad_y.is_contiguous(memory_format=fmt)
    grad_y.copy_(g64)
    got = plan(grad_y, x, w, True, True, True)
    assert got[0].stride() == torch.empty_like(x).stride()
    for name, a, e in zip(("x", "weight", "bias"), got, want, strict=True):
        err = (a.double().cpu() - e).norm() / e.norm()
        assert err < 1e-5, (name, err.item())


def test_the_plan_keeps_aten_s_layout_where_cudnn_has_no_channels_last_kernels(kernel_device) -> None:
    """1-d convs and float64 keep the saved conv output's memory format and relay nothing."""
    x = torch.randn(2, 4, 9, device=kernel_device)
    w = torch.randn(6, 4, 3, device=kernel_device)
    plan = conv_backward_plan(x, w, CONV1D, x)
    assert plan.x_relayout is None and plan.grad_x_relayout is None
    assert plan.new_grad_y(x.device).is_contiguous()
    x2 = torch.randn(2, 4, 5, 6, dtype=torch.float64, device=kernel_device)
    w2 = torch.randn(6, 4, 3, 3, dtype=torch.float64, device=kernel_device)
    plan = conv_backward_plan(x2, w2, CONV2D, x2)
    assert plan.x_relayout is None and plan.new_grad_y(x2.device).is_contiguous()


def test_only_the_wanted_gradients_are_computed(kernel_device) -> None:
    x = torch.randn(2, 4, 5, 6, device=kernel_device)
    w = torch.randn(6, 4, 3, 3, device=kernel_device)
    plan = conv_backward_plan(x, w, CONV2D, run_conv(x, w, None, CONV2D))
    grad_y = plan.new_grad_y(x.device).normal_()
    gx, gw, gb = plan(grad_y, x, w, False, True, False)
    assert gx is None and gb is None and gw.shape == w.shape
    assert plan(grad_y, x, w, False, False, False) == (None, None, None)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("spec", [CONV2D, CONVT3D, GROUPED2D], ids=["conv2d", "convt3d", "grouped2d"])
def test_the_forward_runs_channels_last_with_eager_s_values_and_its_fake_s_layout(spec, layout, kernel_device) -> None:
    """``conv_forward`` gives aten's values, channels-last, with the same strides on real and fake
    tensors (an op's fake calls it); ``nominal_format`` is the layout of aten's own conv output."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusion_backend.ops.conv_io import output_memory_format
    from fusion_backend.ops.library_conv import conv_forward, nominal_format

    gen = torch.Generator().manual_seed(5)
    size = (5, 6) if spec.spatial_dims == 2 else (3, 4, 5)
    x = LAYOUTS[layout](torch.randn((2, 4, *size[:-1], size[-1] + 1), generator=gen).to(kernel_device))
    w = _weight(spec, 4, 6, gen).float().to(kernel_device)
    want = run_conv(x, w, None, spec)
    got = conv_forward(x, w, spec, channels_last=True)
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    assert got.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert nominal_format(x, w, spec) == output_memory_format(want)
    mode = FakeTensorMode()
    fake_x, fake_w = mode.from_tensor(x), mode.from_tensor(w)
    with mode:
        assert conv_forward(fake_x, fake_w, spec, channels_last=True).stride() == got.stride()
        assert nominal_format(fake_x, fake_w, spec) == output_memory_format(want)
    kept = conv_forward(x, w, spec, channels_last=False)
    assert kept.stride() == want.stride()
