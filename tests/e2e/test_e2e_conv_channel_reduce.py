"""torch.compile(backend="fusion") end to end for the conv_channel_reduce family: the two ``families``
demos at small sizes and a few heads, one fused op each, output and every gradient equal to eager and
to a float64 reference (``fusion_backend.testing.assert_fused``, which forces ``decide="fuse"``), on
the CPU reference and on the Triton kernels under the interpreter (with CUDA: on the GPU)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.testing import assert_fused

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

pytestmark = [pytest.mark.usefixtures("exact_fp32"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]  # fmt: skip


def test_min_tanh_demo(kernels, demo_model):
    model = demo_model("families", "conv2d_64_128_k3_min_tanh")
    x = torch.randn(2, 64, 7, 6)
    reports = assert_fused(model.to(DEVICE), [x.to(DEVICE)], expect={"conv_channel_reduce": 1})
    assert reports[0].near_misses == () and "runs direct" in str(reports[0])


def test_softmax_mul_demo(kernels, demo_model):
    """The Triton kernels also through Inductor (``direct=False``: the compiled graphs call the
    autograd-free ops); the reference directly."""
    model = demo_model("families", "conv3d_16_32_k3_softmax_mul")
    x = torch.randn(2, 16, 5, 6, 5)
    direct = kernels == "reference"
    reports = assert_fused(model.to(DEVICE), [x.to(DEVICE)], expect={"conv_channel_reduce": 1},
                           options={"direct": direct})  # fmt: skip
    assert reports[0].near_misses == () and ("runs direct" if direct else "runs inductor") in str(reports[0])


class Head(nn.Module):
    def __init__(self, conv, body):
        super().__init__()
        torch.manual_seed(3)
        self.conv = conv
        self.p = nn.Parameter(-torch.rand(1, conv.out_channels, *([1] * len(conv.kernel_size))) - 0.5)
        self.s = nn.Parameter(torch.tensor(-1.3))
        self.body = body

    def forward(self, x):
        return self.body(self, self.conv(x))


CASES = {
    "convT2d scaled logsumexp": (nn.ConvTranspose2d(3, 5, 3, stride=2, padding=1), (2, 3, 4, 5),
                                 lambda s, y: torch.logsumexp(y * s.p, 1) * s.s),
    "conv1d dag amax keepdim": (nn.Conv1d(3, 6, 3, padding=1), (2, 3, 9),
                                lambda s, y: torch.sigmoid(torch.amax(y + torch.tanh(y), 1, keepdim=True))),
    "conv2d log_softmax channels-last": (nn.Conv2d(4, 5, 3), (2, 4, 7, 6),
                                         lambda s, y: F.log_softmax(F.gelu(y), dim=-3) * s.p),
    "conv2d max values sum": (nn.Conv2d(3, 4, 1), (2, 3, 5, 5), lambda s, y: y.max(1).values - y.shape[1]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_heads(kernels, name):
    conv, shape, body = CASES[name]
    torch.manual_seed(4)
    x = torch.randn(shape)
    if "channels-last" in name:
        x = x.to(memory_format=torch.channels_last)
    assert_fused(Head(conv, body).to(DEVICE), [x.to(DEVICE)], expect={"conv_channel_reduce": 1})
