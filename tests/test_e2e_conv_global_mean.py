"""torch.compile(backend="fusion") end to end for the conv_global_mean family (seed C and friends):
one fused op, output and every gradient equal to eager and to a float64 reference, on the CPU
reference and on the Triton kernels under the interpreter (with CUDA: on the GPU, plus full size)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.testing import Autocast, assert_fused

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


pytestmark = pytest.mark.usefixtures("exact_fp32")


def test_seed_c(kernels, seed_models):
    model, (x,) = seed_models("seed_c_small", shrink=True)
    reports = assert_fused(model.to(DEVICE), [x.to(DEVICE)], expect={"conv_global_mean": 1})
    assert reports[0].near_misses == ()


class Head(nn.Module):
    def __init__(self, conv, body):
        super().__init__()
        torch.manual_seed(2)
        self.conv = conv
        self.a = nn.Parameter(torch.randn(conv.out_channels, *([1] * (len(conv.kernel_size)))))
        self.body = body

    def forward(self, x):
        return self.body(self, self.conv(x))


CASES = {
    "convT2d pad stride affine": (nn.ConvTranspose2d(3, 5, 3, stride=2, padding=1, output_padding=1),
                                  (2, 3, 5, 6), lambda s, y: (y * s.a - 0.5).mean((2, 3), keepdim=True)),
    "conv2d pad dilation groups sum/n": (nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2),
                                         (2, 4, 7, 9), lambda s, y: y.sum((-1, -2)) / 63),
    "conv1d stride operand on the left": (nn.Conv1d(3, 4, 3, stride=2, padding=1), (3, 3, 11),
                                          lambda s, y: (s.a + y).mean(2)),
    "conv2d mean of mean": (nn.Conv2d(3, 4, 3, stride=2), (2, 3, 9, 8), lambda s, y: y.mean(-1).mean(-1)),
    "convT3d adaptive": (nn.ConvTranspose3d(2, 3, 2, stride=2, bias=False), (2, 2, 3, 2, 3),
                         lambda s, y: F.adaptive_avg_pool3d(y * s.a, 1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_conv_variants(kernels, name):
    conv, shape, body = CASES[name]
    torch.manual_seed(4)
    x = torch.rand(shape)
    model = Head(conv, body)
    assert_fused(model.to(DEVICE), [x.to(DEVICE)], expect={"conv_global_mean": 1})


def test_channels_last_input(kernels, seed_models):
    model, (x,) = seed_models("seed_c_small", shrink=True)
    x = x.to(memory_format=torch.channels_last)
    assert_fused(model.to(DEVICE), [x.to(DEVICE)], expect={"conv_global_mean": 1})


def test_dynamic_shapes_compile_once(kernels, fusion_rewrites, seed_models):
    model, _ = seed_models("seed_c_small", shrink=True)
    model = model.to(DEVICE)
    compiled = torch.compile(model, backend="fusion", dynamic=True, options={"strict": True})
    for shape in ((2, 3, 6, 7), (5, 3, 9, 4), (3, 3, 11, 8)):
        x = torch.rand(shape, device=DEVICE)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert [r.counts() for r in fusion_rewrites] == [{"conv_global_mean": 1}]


def test_autocast_bf16(kernels, seed_models):
    if kernels == "triton":
        pytest.skip("Triton's interpreter has no bf16")
    model, (x,) = seed_models("seed_c_small", shrink=True)
    assert_fused(Autocast(model.to(DEVICE), DEVICE), [x.to(DEVICE)], expect={"conv_global_mean": 1}, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["seed_c", "seed_c_small"])
def test_full_size_seed_c_on_gpu(name, seed_models):
    model, (x,) = seed_models(name)
    assert_fused(model.cuda(), [x.cuda()], expect={"conv_global_mean": 1})
