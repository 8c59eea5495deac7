"""``fusion::conv_epilogue``'s fused forward takes ``kernels.conv_dense`` for the convs it serves.

A plain (not transposed) stride-1, dilation-1, groups-1 1d/2d conv without a pool goes to the dense
kernel (the case of Conv2d 64->64 k3 in the seeds suite); everything else stays on
``kernels.conv_fused``.  Either way the output and every gradient (input, weight, bias, multiplier)
must match eager and a float64 run, the training forward's saved conv output feeding the shared
backward.  ``FUSION_CONV_IMPL=triton`` forces the fused forward; on CPU the kernels run under the
interpreter (``FUSION_CPU_KERNELS=triton``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.ir.specs import ConvSpec
from fusion_backend.kernels import conv_dense, conv_fused
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.testing import assert_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class ConvChain(nn.Module):
    """conv -> x per-channel multiplier -> leaky -> GELU (conv2d_mul_leaky_gelu's chain), optional pool."""

    def __init__(self, conv: nn.Module, channels: int, nd: int, pool: nn.Module | None = None, gelu: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.conv = conv
        self.multiplier = nn.Parameter(torch.randn(channels, *(1,) * nd))
        self.pool = pool
        self.gelu = gelu

    def forward(self, x):
        y = F.leaky_relu(self.conv(x) * self.multiplier)
        y = F.gelu(y) if self.gelu else y
        return y if self.pool is None else self.pool(y)


#: name -> (model builder, input shape, channels_last input, the forward kernel module expected)
CASES = {
    "conv2d-k3": (lambda: ConvChain(nn.Conv2d(3, 5, 3), 5, 2), (2, 3, 7, 9), False, "conv_dense"),
    "conv2d-k3-pad1-nobias-cl": (
        lambda: ConvChain(nn.Conv2d(4, 6, 3, padding=1, bias=False), 6, 2), (2, 4, 6, 5), True, "conv_dense",
    ),
    "conv2d-k5x2-pad-wide": (
        lambda: ConvChain(nn.Conv2d(3, 4, (5, 2), padding=(1, 2)), 4, 2), (1, 3, 8, 6), False, "conv_dense",
    ),
    "conv1d-k3-pad2": (lambda: ConvChain(nn.Conv1d(3, 5, 3, padding=2), 5, 1), (2, 3, 11), False, "conv_dense"),
    # not the dense kernel's: stride 2, groups, a transposed conv, a pool after the chain
    "conv2d-s2": (lambda: ConvChain(nn.Conv2d(3, 4, 3, stride=2), 4, 2), (2, 3, 9, 8), False, "conv_fused"),
    "conv2d-groups2": (lambda: ConvChain(nn.Conv2d(4, 6, 3, groups=2), 6, 2), (2, 4, 6, 6), False, "conv_fused"),
    "convT2d": (lambda: ConvChain(nn.ConvTranspose2d(3, 4, 3), 4, 2), (2, 3, 5, 5), False, "conv_fused"),
    "conv2d-maxpool2": (
        lambda: ConvChain(nn.Conv2d(3, 4, 3), 4, 2, nn.MaxPool2d(2)), (2, 3, 8, 8), False, "conv_fused",
    ),
}


@pytest.fixture
def forward_kernels_run(monkeypatch, exact_fp32, fresh_plans):
    """Forces the fused forward and records the module of every forward launch plan built."""
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setenv(ce.CONV_IMPL_ENV, "triton")
    built = []
    for module in (conv_dense, conv_fused):
        real = module.forward_launch
        name = module.__name__.rsplit(".", 1)[1]

        def recording(*a, _real=real, _name=name, **k):
            built.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(module, "forward_launch", recording)
    return built


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_forward_module_and_parity(forward_kernels_run, name):
    build, shape, channels_last, expected = CASES[name]
    torch.manual_seed(1)
    x = torch.randn(shape, device=DEVICE)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    assert_fused(build().to(DEVICE), [x], expect={"conv_epilogue": 1}, train=True)
    assert forward_kernels_run and set(forward_kernels_run) == {expected}


class DagChain(nn.Module):
    """conv → z = y + tanh(y) → maximum(z * z, y), optionally max-pooled: slots that read earlier chain values."""

    def __init__(self, conv: nn.Module, pool: bool) -> None:
        super().__init__()
        self.conv, self.pool = conv, pool

    def forward(self, x):
        y = self.conv(x)
        z = y + torch.tanh(y)
        out = torch.maximum(z * z, y)
        return torch.nn.functional.max_pool2d(out, 2) if self.pool else out


@pytest.mark.parametrize("conv, pool, expected", [
    (nn.Conv2d(3, 4, 3, padding=1), False, "conv_dense"),
    (nn.Conv2d(3, 4, 3, stride=2), True, "conv_fused"),
    (nn.ConvTranspose2d(3, 4, 3, stride=2), True, "conv_fused"),
], ids=["dense", "strided-maxpool", "transposed-maxpool"])
def test_fused_forward_kernels_read_chain_values_again(forward_kernels_run, conv, pool, expected):
    torch.manual_seed(2)
    assert_fused(DagChain(conv, pool).to(DEVICE), [torch.randn(2, 3, 8, 9, device=DEVICE)],
                 expect={"conv_epilogue": 1}, train=True)
    assert set(forward_kernels_run) == {expected}


def test_dense_forward_keeps_inf_and_nan_where_eager_has_them(forward_kernels_run):
    # no GELU: eager's vectorized fp32 GELU on CPU maps +inf to NaN (float64's gives inf, as the kernel)
    model = ConvChain(nn.Conv2d(3, 4, 3, padding=1), 4, 2, gelu=False).to(DEVICE)
    x = torch.randn(2, 3, 6, 7, device=DEVICE)
    x[0, 1, 2, 3] = float("nan")
    x[1, 0, 5, 6] = float("inf")
    assert_fused(model, [x], expect={"conv_epilogue": 1}, train=False)
    assert set(forward_kernels_run) == {"conv_dense"}


def _config(**conv) -> ConvEpilogueConfig:
    spec = ConvSpec(transposed=False, stride=(1, 1), padding=(0, 0), dilation=(1, 1), output_padding=(0, 0),
                    groups=1)  # fmt: skip
    return ConvEpilogueConfig(conv=ConvSpec(**{**spec.__dict__, **conv}), chain=(), pool=None)


@pytest.mark.parametrize(
    ("conv", "expected"),
    [({}, conv_dense), ({"dilation": (2, 1)}, conv_fused), ({"stride": (1, 2)}, conv_fused)],
)
def test_forward_kernels_choice(conv, expected):
    x, w = torch.empty(2, 4, 9, 9), torch.empty(5, 4, 3, 3)
    assert ce.forward.forward_kernels(x, w, _config(**conv)) is expected
