"""A batch norm in eval mode in a conv's chain is folded into it as a per-channel scale and shift
(``ops/bn_fold.py``) and the region fuses as ``conv_epilogue``: output and every gradient (input, conv
weight and bias, batch norm's weight and bias) equal eager's against float64, on the CPU reference and
on the Triton kernels under the interpreter (or on CUDA).  Batch norm in training mode stays with
Inductor, with the reason."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.ops import bn_fold
from fusion_backend.testing import assert_fused, dry_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("exact_fp32")


def _randomize(bn: nn.modules.batchnorm._BatchNorm, gen: torch.Generator) -> None:
    """Running statistics and affine parameters far from their identity defaults."""
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(bn.num_features, generator=gen))
        bn.running_var.copy_(torch.rand(bn.num_features, generator=gen) * 2 + 0.25)
        if bn.affine:
            bn.weight.copy_(torch.randn(bn.num_features, generator=gen))
            bn.bias.copy_(torch.randn(bn.num_features, generator=gen))


class FunctionalBatchNorm(nn.Module):
    """Conv1d (no bias) -> F.batch_norm with the module's own buffers (the functional spelling) -> leaky."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, bias=False)
        self.register_buffer("mean", torch.randn(6))
        self.register_buffer("var", torch.rand(6) + 0.5)
        self.gamma, self.beta = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))

    def forward(self, x):
        y = F.batch_norm(self.conv(x), self.mean, self.var, self.gamma, self.beta, False, 0.1, 1e-3)
        return F.leaky_relu(y, 0.1)


class ScaledAfterBatchNorm(nn.Module):
    """Conv2d -> BatchNorm2d -> x a per-channel multiplier -> + a scalar -> GELU: chain operands of
    their own after the folded ones."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5)
        self.multiplier = nn.Parameter(torch.randn(5, 1, 1))

    def forward(self, x):
        return F.gelu(self.bn(self.conv(x)) * self.multiplier + 0.5)


def _case(name: str):
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    if name == "conv2d-relu-maxpool":
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        x = torch.randn(2, 3, 9, 8)
    elif name == "conv2d-channels-last":
        model = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6, eps=1e-2), nn.SiLU())
        x = torch.randn(2, 4, 7, 6).to(memory_format=torch.channels_last)
    elif name == "convt2d-grouped-no-affine":
        model = nn.Sequential(nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), nn.BatchNorm2d(6, affine=False),
                              nn.Tanh())
        x = torch.randn(2, 4, 4, 5)
    elif name == "conv3d-sliced-avgpool":
        model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.AvgPool3d(2))
        x = torch.randn(1, 2, 4, 4, 9)[..., ::2]
    elif name == "multiplier-after":
        model = ScaledAfterBatchNorm()
        x = torch.randn(2, 3, 7, 7)
    elif name == "functional-conv1d":
        model = FunctionalBatchNorm()
        x = torch.randn(3, 4, 11)
    else:
        raise AssertionError(name)
    for bn in model.modules():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            _randomize(bn, gen)
    return model.eval().to(DEVICE), [x.to(DEVICE)]


CASES = ("conv2d-relu-maxpool", "conv2d-channels-last", "convt2d-grouped-no-affine", "conv3d-sliced-avgpool",
         "functional-conv1d", "multiplier-after")


@pytest.mark.parametrize("name", CASES)
def test_eval_batch_norm_is_folded_and_every_gradient_matches(kernels, name):
    model, inputs = _case(name)
    (report,) = assert_fused(model, inputs, expect={"conv_epilogue": 1}, train=True)
    assert "batch_norm (folded)" in report.matches[0].summary


def test_nan_statistics_poison_the_same_channels_as_eager(kernels):
    model, inputs = _case("conv2d-relu-maxpool")
    with torch.no_grad():
        model[1].running_var[3] = -1.0  # rsqrt of a negative variance: NaN in channel 3 only
    assert_fused(model, inputs, expect={"conv_epilogue": 1}, train=False)


def test_batch_norm_in_training_mode_is_not_folded_but_left_to_its_own_family():
    model, inputs = _case("conv2d-relu-maxpool")
    model.train()
    result = dry_run(model, inputs)
    assert result.counts() == {"conv_batch_norm": 1}  # conv -> batch norm (batch statistics) -> relu -> max pool
    assert result.regions[0][1].endswith("max_pool2d"), result.regions


class BatchNormInsideTheChain(nn.Module):
    """Conv2d -> ReLU -> BatchNorm2d -> x 2 -> BatchNorm2d: batch norms anywhere in the chain, twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn1, self.bn2 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4, affine=False)

    def forward(self, x):
        return self.bn2(self.bn1(torch.relu(self.conv(x))) * 2.0)


def test_batch_norms_inside_the_chain_are_folded_where_they_stand(kernels):
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    model = BatchNormInsideTheChain()
    for bn in (model.bn1, model.bn2):
        _randomize(bn, gen)
    model = model.eval().to(DEVICE)
    (report,) = assert_fused(model, [torch.randn(2, 3, 7, 6, device=DEVICE)], expect={"conv_epilogue": 1}, train=True)
    assert report.matches[0].summary == "conv2d -> relu -> batch_norm (folded) -> mul -> batch_norm (folded)"


def test_a_conv_and_its_batch_norm_alone_fuse():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval().to(DEVICE)
    result = dry_run(model, [torch.randn(1, 3, 6, 6, device=DEVICE)])
    assert result.counts() == {"conv_epilogue": 1}


@pytest.mark.parametrize("affine", [True, False])
def test_the_scale_and_shift_equal_batch_norm_in_float64(affine):
    gen = torch.Generator().manual_seed(3)
    mean, var = torch.randn(6, generator=gen).double(), torch.rand(6, generator=gen).double() + 0.1
    gamma, beta = (torch.randn(6, generator=gen).double() for _ in range(2)) if affine else (None, None)
    y = torch.randn(2, 6, 5, 4, generator=gen).double()
    want = F.batch_norm(y, mean, var, gamma, beta, False, 0.0, 1e-5)
    scale, shift = bn_fold.scale_and_shift(mean, var, gamma, beta, 1e-5, 2)
    got = y * scale + shift
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_under_autocast_the_folded_conv_gives_eager_s_dtype_and_gradients(kernels):
    """bf16 autocast: eager runs the conv in bf16 and batch norm on its bf16 output (statistics in
    float32); the folded weight is made in float32 and cast once by the fused op."""
    if DEVICE == "cpu" and kernels == "triton":
        pytest.skip("Triton's interpreter has no bf16")
    from fusion_backend.testing import Autocast

    model, inputs = _case("conv2d-relu-maxpool")
    (report,) = assert_fused(Autocast(model, DEVICE), inputs, expect={"conv_epilogue": 1}, train=True)
    assert "batch_norm (folded)" in report.matches[0].summary


def test_a_graph_run_directly_makes_the_scale_and_shift_in_one_kernel(kernels, monkeypatch):
    """Conv -> batch norm -> ReLU alone runs without Inductor (``runtime/direct.py``): its scale and shift
    come from the one-kernel form (``bn_fold.scale_and_shift_direct``) once per call where the Triton
    kernels run, and the values and gradients stay eager's."""
    from fusion_backend.kernels import bn_scale_shift

    calls = []
    real = bn_scale_shift.scale_and_shift
    monkeypatch.setattr(bn_scale_shift, "scale_and_shift", lambda *a: calls.append(1) or real(*a))
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    _randomize(model[1], torch.Generator().manual_seed(2))
    model = model.eval().to(DEVICE)
    (report,) = assert_fused(model, [torch.randn(2, 3, 6, 5, device=DEVICE)], expect={"conv_epilogue": 1}, train=True)
    assert report.runner == "direct"
    assert len(calls) == (0 if kernels == "reference" and DEVICE == "cpu" else 1)  # assert_fused calls the model once
