"""The conv backward kernels that read the conv-output gradient from a implicit form.

Every case is checked against ``aten.convolution_backward`` in float64 on the full-size gradient
(inputs rounded to the kernel dtype first, so the reference sees exactly what the kernel sees).
Without CUDA the kernels run under Triton's interpreter: small shapes, fp32 and fp16.
GPU tests (``-m gpu``) check the ``seeds`` suite's ConvTranspose3d 16->32 + MaxPool3d(2) (max-pooled
form) and Conv2d 64->64 (dense form) at full size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.errors import UnsupportedInputError
from fusion_backend.kernels import conv_fused_bwd as K
from fusion_backend.testing import stable_seed

# fp32 parity is checked at ~1e-5: TF32 off (on CUDA both the fused kernels and cuDNN follow the flag).
pytestmark = pytest.mark.usefixtures("exact_fp32")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


@dataclass(frozen=True)
class Case:
    dims: int
    transposed: bool
    c_in: int
    c_out: int
    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    output_padding: int = 0
    groups: int = 1
    size: tuple[int, ...] = (7,)
    batch: int = 2

    def conv_args(self) -> tuple:
        d = self.dims
        return ((self.stride,) * d, (self.padding,) * d, (self.dilation,) * d, self.transposed,
                (self.output_padding,) * d, self.groups)  # fmt: skip

    def spatial(self) -> tuple[int, ...]:
        return tuple(self.size[i % len(self.size)] + i for i in range(self.dims))  # odd, unequal sizes


@dataclass(frozen=True)
class Pool:
    kernel: int
    stride: int | None = None
    padding: int = 0
    dilation: int = 1
    ceil_mode: bool = False
    ties: bool = False


def make(case: Case, dtype: torch.dtype, device: str, channels_last: bool = False):
    """x, w rounded to ``dtype`` (float64 copies) and the kernel-side tensors on ``device``."""
    g = torch.Generator().manual_seed(stable_seed(case) % 2**31)
    x = torch.randn(case.batch, case.c_in, *case.spatial(), generator=g, dtype=torch.float64)
    k = (case.kernel,) * case.dims
    if case.transposed:
        w = torch.randn(case.c_in, case.c_out // case.groups, *k, generator=g, dtype=torch.float64)
    else:
        w = torch.randn(case.c_out, case.c_in // case.groups, *k, generator=g, dtype=torch.float64)
    x, w = x.to(dtype).double(), w.to(dtype).double()
    xk, wk = x.to(device, dtype), w.to(device, dtype)
    if channels_last and case.dims >= 2:
        fmt = torch.channels_last if case.dims == 2 else torch.channels_last_3d
        xk, wk = xk.contiguous(memory_format=fmt), wk.contiguous(memory_format=fmt)
    return x, w, xk, wk


def pooled_grad(y: torch.Tensor, pool: Pool, dtype: torch.dtype, device: str, gen: torch.Generator):
    """(PooledGrad on device, full-size float64 gradient) from a real max pool over a tensor of y's shape."""
    dims = y.dim() - 2
    z = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    if pool.ties:
        z = z.round().clamp(-1, 1)  # many equal values per window: PyTorch's tie rule picks one
    fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[dims - 1]
    stride = pool.stride or pool.kernel
    _, flat = fn(z, pool.kernel, stride, pool.padding, pool.dilation, ceil_mode=pool.ceil_mode, return_indices=True)
    # flat index in the plane -> row-major index over the window's taps (what the forward saves)
    spatial = list(y.shape[2:])
    win = torch.zeros_like(flat)
    for j in range(dims):
        plane_stride = math.prod(spatial[j + 1 :])
        coord = (flat // plane_stride) % spatial[j]
        shape = [1] * flat.dim()
        shape[2 + j] = flat.shape[2 + j]
        origin = (torch.arange(flat.shape[2 + j]) * stride - pool.padding).reshape(shape)
        win = win + (coord - origin) // pool.dilation * pool.kernel ** (dims - 1 - j)
    g_win = torch.randn(flat.shape, generator=gen, dtype=torch.float64).to(dtype).double()
    full = torch.zeros(y.shape[0], y.shape[1], y[0, 0].numel(), dtype=torch.float64)
    full.scatter_add_(2, flat.reshape(*flat.shape[:2], -1), g_win.reshape(*flat.shape[:2], -1))
    implicit = K.PooledGrad(
        g_win.to(device, dtype), win.to(device, torch.int8), (pool.kernel,) * dims, (stride,) * dims,
        (pool.padding,) * dims, (pool.dilation,) * dims, pool.ceil_mode,
    )  # fmt: skip
    return implicit, full.reshape(y.shape)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def check(case: Case, dtype, device, pool: Pool | None = None, channels_last: bool = False, mask=(True, True, True)):
    x, w, xk, wk = make(case, dtype, device, channels_last)
    args = case.conv_args()
    y = torch.ops.aten.convolution(x, w, None, *args)
    gen = torch.Generator().manual_seed(1)
    if pool is None:
        full = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype).double()
        grad = full.to(device, dtype)
        if channels_last and case.dims >= 2:
            grad = grad.contiguous(memory_format=torch.channels_last if case.dims == 2 else torch.channels_last_3d)
    else:
        grad, full = pooled_grad(y, pool, dtype, device, gen)
    assert K.unsupported_reason(grad, xk, wk, *args) is None
    want = torch.ops.aten.convolution_backward(full, x, w, [y.shape[1]], *args, list(mask))
    got = K.convolution_backward(grad, xk, wk, *args, mask)
    for name, g, e, ref in zip(("x", "w", "b"), got, want, (xk, wk, None), strict=True):
        if e is None:
            assert g is None
            continue
        assert g.shape == e.shape, name
        if ref is not None:
            assert g.dtype == ref.dtype and g.stride() == torch.empty_like(ref).stride(), name
        assert rel_err(g, e) <= TOL[dtype], f"grad {name}: rel err {rel_err(g, e):.2e}"


CONVS = [
    Case(1, False, 3, 5, 3, stride=3, padding=2, dilation=2, size=(13,)),
    Case(1, False, 3, 5, 3, padding=1, size=(40,)),  # several W blocks per line
    Case(2, False, 3, 5, 3, padding=1, size=(7,)),
    Case(2, False, 4, 6, 3, stride=2, padding=1, groups=2, size=(9,)),
    Case(2, False, 3, 20, 2, stride=3, size=(8,)),  # taps of some phases are empty
    Case(3, False, 2, 3, 3, stride=2, padding=1, dilation=2, size=(5,)),
    Case(1, True, 4, 6, 4, stride=3, padding=1, output_padding=2, groups=2, size=(6,)),
    Case(1, True, 3, 4, 3, stride=2, padding=1, output_padding=1, size=(37,)),
    Case(2, True, 4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, size=(5,)),
    Case(2, True, 17, 3, 3, stride=1, padding=2, dilation=2, size=(6,)),
    Case(3, True, 3, 4, 3, stride=2, padding=1, output_padding=1, size=(3,)),
]


@pytest.mark.parametrize("case", CONVS, ids=lambda c: f"{c.dims}d{'T' if c.transposed else ''}s{c.stride}g{c.groups}")
def test_dense_gradient_matches_aten_fp32(case, kernel_device):
    check(case, torch.float32, kernel_device)


@pytest.mark.parametrize("case", [CONVS[3], CONVS[8]], ids=["conv", "convT"])
def test_dense_gradient_matches_aten_fp16(case, kernel_device):
    check(case, torch.float16, kernel_device)


@pytest.mark.parametrize("case", [CONVS[3], CONVS[5], CONVS[8], CONVS[10]], ids=["2d", "3d", "2dT", "3dT"])
def test_channels_last_inputs_give_grads_in_their_layout(case, kernel_device):
    check(case, torch.float32, kernel_device, channels_last=True)


POOLED = [
    (Case(3, True, 3, 4, 3, stride=2, padding=1, output_padding=1, size=(3,)), Pool(2)),  # ConvT3d pipeline
    (Case(2, False, 3, 5, 3, padding=1, size=(7,)), Pool(2, ceil_mode=True)),  # partial windows
    (Case(2, True, 4, 6, 3, stride=2, padding=1, groups=2, size=(4,)), Pool(3, 2, padding=1, ceil_mode=True)),  # overlap
    (Case(1, False, 3, 5, 3, stride=2, size=(15,)), Pool(2, ties=True)),
    (Case(2, False, 3, 4, 3, size=(9,)), Pool(2, 1, ties=True)),  # overlap, ties
    (Case(2, True, 3, 4, 2, stride=2, size=(4,)), Pool(2, 2, dilation=2)),
]


@pytest.mark.parametrize("case,pool", POOLED, ids=["convT3d_s2", "ceil", "overlapT", "ties1d", "overlap_ties", "dilated"])
def test_max_pooled_gradient_matches_aten_fp32(case, pool, kernel_device):
    check(case, torch.float32, kernel_device, pool)


def test_max_pooled_gradient_fp16_channels_last(kernel_device):
    case, pool = POOLED[0]
    check(case, torch.float16, kernel_device, pool, channels_last=True)


def test_int64_offsets_give_the_same_grads(kernel_device, monkeypatch):
    # tensors of 2**31 elements don't fit a CPU test: force the int64 path on a small case
    monkeypatch.setattr(K.plan, "_needs_int64", lambda *tensors: True)
    case, pool = POOLED[2]
    check(case, torch.float32, kernel_device, pool)


def test_output_mask_skips_grads(kernel_device):
    check(CONVS[2], torch.float32, kernel_device, mask=(False, True, False))
    check(CONVS[2], torch.float32, kernel_device, mask=(True, False, True))


def test_expanded_gradient_is_read_through_its_strides(kernel_device):
    # what ``out.sum().backward()`` hands over: one value broadcast with stride 0
    case = CONVS[8]
    x, w, xk, wk = make(case, torch.float32, kernel_device)
    args = case.conv_args()
    y = torch.ops.aten.convolution(x, w, None, *args)
    grad = torch.full((1,), 0.5, device=kernel_device).expand(y.shape)
    want = torch.ops.aten.convolution_backward(grad.double().cpu(), x, w, [y.shape[1]], *args, [True, True, True])
    for got, e in zip(K.convolution_backward(grad, xk, wk, *args), want, strict=True):
        assert rel_err(got, e) <= TOL[torch.float32]


def test_weight_grad_is_bitwise_reproducible(kernel_device):
    case, pool = POOLED[3]
    x, w, xk, wk = make(case, torch.float32, kernel_device)
    y = torch.ops.aten.convolution(x, w, None, *case.conv_args())
    grad, _ = pooled_grad(y, pool, torch.float32, kernel_device, torch.Generator().manual_seed(3))
    first = K.conv_weight_grad(grad, xk, wk, *case.conv_args())
    assert torch.equal(first, K.conv_weight_grad(grad, xk, wk, *case.conv_args()))


def test_bias_grad_comes_from_the_implicit_form(kernel_device):
    case, pool = POOLED[4]
    x, w, _, _ = make(case, torch.float32, kernel_device)
    y = torch.ops.aten.convolution(x, w, None, *case.conv_args())
    grad, full = pooled_grad(y, pool, torch.float32, kernel_device, torch.Generator().manual_seed(4))
    assert rel_err(K.conv_bias_grad(grad), full.sum((0, 2, 3))) < 1e-6


def test_unsupported_cases_say_why(kernel_device):
    case = CONVS[2]
    x, w, xk, wk = make(case, torch.float32, kernel_device)
    args = case.conv_args()
    y_shape = torch.ops.aten.convolution(x, w, None, *args).shape
    bad = torch.zeros(y_shape[0], y_shape[1], 3, 3, device=kernel_device)
    assert "conv output's shape" in K.unsupported_reason(bad, xk, wk, *args)
    with pytest.raises(UnsupportedInputError, match="conv output's shape"):
        K.conv_input_grad(bad, xk, wk, *args)
    win = torch.zeros(y_shape[0], y_shape[1], 3, 3, dtype=torch.int8, device=kernel_device)
    pooled = K.PooledGrad(win.float(), win, (2, 2))
    assert "max-pooling the conv output" in K.unsupported_reason(pooled, xk, wk, *args)
    ok_shape = [y_shape[0], y_shape[1], y_shape[2] - 5, y_shape[3] - 5]
    wide = K.PooledGrad(torch.zeros(ok_shape, device=kernel_device),
                        torch.zeros(ok_shape, dtype=torch.int8, device=kernel_device), (6, 6), (1, 1))  # fmt: skip  36 candidates
    assert "overlap" in K.unsupported_reason(wide, xk, wk, *args)
    assert "share" in K.unsupported_reason(torch.zeros(y_shape), xk.double(), wk.double(), *args)


# --------------------------------------------------------------------------------------------------
# GPU: the seeds suite's ConvT3d and Conv2d pipelines at full size
# --------------------------------------------------------------------------------------------------


def _convt3d_maxpool(device: str = "cuda"):
    """ConvTranspose3d 16->32 k3 s2 p1 op1 on (16, 16, 16, 32, 32), gradient behind MaxPool3d(2)."""
    torch.manual_seed(0)
    x = torch.rand(16, 16, 16, 32, 32, device=device)
    w = torch.randn(16, 32, 3, 3, 3, device=device) * 0.1
    args = ((2, 2, 2), (1, 1, 1), (1, 1, 1), True, (1, 1, 1), 1)
    y = torch.ops.aten.convolution(x, w, None, *args)
    _, flat = F.max_pool3d(y, 2, return_indices=True)
    # row-major index within the 2x2x2 window from the flat in-plane index
    d, h, ww = (flat // (64 * 64)) % 32, (flat // 64) % 64, flat % 64
    win = ((d % 2) * 4 + (h % 2) * 2 + (ww % 2)).to(torch.int8)
    g_win = torch.randn(flat.shape, device=device)
    full = torch.zeros(y.numel() // y[0, 0].numel(), y[0, 0].numel(), device=device)
    full.scatter_add_(1, flat.reshape(full.shape[0], -1), g_win.reshape(full.shape[0], -1))
    return x, w, args, K.PooledGrad(g_win, win, (2, 2, 2)), full.reshape(y.shape)


def _conv2d_dense(device: str = "cuda"):
    """Conv2d 64->64 k3 on (64, 64, 256, 256), dense gradient."""
    torch.manual_seed(0)
    x = torch.rand(64, 64, 256, 256, device=device)
    w = torch.randn(64, 64, 3, 3, device=device) * 0.05
    args = ((1, 1), (0, 0), (1, 1), False, (0, 0), 1)
    g = torch.randn(64, 64, 254, 254, device=device)
    return x, w, args, g, g


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("workload", ["convt3d_maxpool", "conv2d_dense"])
def test_gpu_full_size_workloads_match_aten(workload, dtype, exact_fp32):
    x, w, args, grad, full = (_convt3d_maxpool if workload == "convt3d_maxpool" else _conv2d_dense)()
    want = torch.ops.aten.convolution_backward(full, x, w, [full.shape[1]], *args, [True, True, True])
    x, w = x.to(dtype), w.to(dtype)
    if dtype != torch.float32:  # the implicit form stays fp32 (what the epilogue kernel produces)
        grad = grad if isinstance(grad, K.PooledGrad) else grad.to(dtype)
    assert K.unsupported_reason(grad, x, w, *args) is None
    got = K.convolution_backward(grad, x, w, *args)
    for name, g, e, ref in zip("xwb", got, want, (x, w, None), strict=True):
        if ref is not None:
            assert g.dtype == ref.dtype and g.stride() == ref.stride(), name
        err = ((g.float() - e).abs().max() / e.abs().max()).item()
        # fp32: each weight-gradient element of the dense case sums N*H*W ~ 8e6 products; two fp32 reductions in
        # different orders (split-K here, cuDNN's there) differ by ~sqrt(8e6) * 6e-8 ~ 1.7e-4 of the max
        # (measured on an H200: 1.46e-4); a wrong index gives O(1).
        assert err < (3e-4 if dtype == torch.float32 else 2e-2), f"{workload} grad {name}: {err:.2e}"


def test_autotune_off_binds_the_first_tile(monkeypatch):
    """``FUSION_CONV_AUTOTUNE=0``: the raw kernel with the first config, no tile search."""
    configs = K.device.dgrad_configs()
    monkeypatch.setenv("FUSION_CONV_AUTOTUNE", "0")
    kernel, tile = K.plan.launcher(K.device.dgrad_tuned, K.device.dgrad_kernel, configs)
    assert kernel is K.device.dgrad_kernel
    assert tile == dict(configs[0].kwargs, num_warps=configs[0].num_warps, num_stages=configs[0].num_stages)
    monkeypatch.setenv("FUSION_CONV_AUTOTUNE", "1")
    assert K.plan.launcher(K.device.wgrad_tuned, K.device.wgrad_kernel, K.device.wgrad_configs()) == (K.device.wgrad_tuned, {})
