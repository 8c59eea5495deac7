"""torch.compile(backend="fusion") end to end on blocks of networks the suites do not hold: a MobileNetV3
inverted residual (hardswish, a squeeze-and-excitation gate with hardsigmoid), a RegNetY block (grouped
stride-2 conv, a sigmoid gate, a projected shortcut), a ConvNeXt block (depthwise 7x7, LayerNorm over
the permuted channels, an MLP, a layer scale), a diffusion UNet residual block (GroupNorm, SiLU, a time
embedding added per sample and channel), a wav2vec2-style conv1d feature extractor, a DCGAN-style
transposed-conv decoder, a 3d conv block with a max pool and DeepLab's atrous pyramid (dilated branches
and an image-pooling branch upsampled back).

Every region fused (``fusion_backend.testing.assert_fused``: ``decide="fuse"``, ``strict``), the
regions each block is expected to hold counted, its output and every gradient (parameters and inputs)
against eager and a float64 reference, in training and inference, contiguous and channels-last, and
under bf16 autocast; on the CPU reference and the Triton kernels under the interpreter, with CUDA on
the GPU.  What the blocks do not fuse (the ConvNeXt block's permuted LayerNorm, the UNet block's
per-sample embedding, a residual add with gradients flowing) stays Inductor's, and the results are
eager's all the same.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.report import collect_reports
from fusion_backend.testing import Autocast, assert_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [pytest.mark.usefixtures("exact_fp32"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]  # fmt: skip


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduced: int, gate: type[nn.Module]) -> None:
        super().__init__()
        self.reduce, self.expand, self.gate = nn.Conv2d(channels, reduced, 1), nn.Conv2d(reduced, channels, 1), gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.expand(F.relu(self.reduce(x.mean((2, 3), keepdim=True)))))


class InvertedResidual(nn.Module):
    """MobileNetV3's: 1x1 expansion, 5x5 depthwise, both BatchNorm + hardswish; a hardsigmoid gate; 1x1 projection."""

    def __init__(self, channels: int = 16, expanded: int = 48) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(channels, expanded, 1, bias=False), nn.BatchNorm2d(expanded), nn.Hardswish())
        self.depthwise = nn.Sequential(nn.Conv2d(expanded, expanded, 5, padding=2, groups=expanded, bias=False),
                                       nn.BatchNorm2d(expanded), nn.Hardswish())  # fmt: skip
        self.se = SqueezeExcite(expanded, 16, nn.Hardsigmoid)
        self.project = nn.Sequential(nn.Conv2d(expanded, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.se(self.depthwise(self.expand(x))))


class RegNetYBlock(nn.Module):
    """RegNetY's: 1x1, grouped 3x3 of stride 2, a sigmoid gate, 1x1, and a strided 1x1 shortcut, ReLU after the sum."""

    def __init__(self, channels: int = 32, group_width: int = 8) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(channels, channels, 3, stride=2, padding=1, groups=channels // group_width,
                                         bias=False), nn.BatchNorm2d(channels), nn.ReLU())  # fmt: skip
        self.se = SqueezeExcite(channels, 8, nn.Sigmoid)
        self.c = nn.Sequential(nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels))
        self.shortcut = nn.Sequential(nn.Conv2d(channels, channels, 1, stride=2, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.shortcut(x) + self.c(self.se(self.b(self.a(x)))))


class ConvNeXtBlock(nn.Module):
    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.up, self.down = nn.Linear(channels, 4 * channels), nn.Linear(4 * channels, channels)
        self.scale = nn.Parameter(torch.full((channels,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(x).permute(0, 2, 3, 1)
        return x + (self.down(F.gelu(self.up(self.norm(y)))) * self.scale).permute(0, 3, 1, 2)


class UNetResBlock(nn.Module):
    def __init__(self, channels: int = 32, embedding: int = 16) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(8, channels), nn.Conv2d(channels, channels, 3, padding=1)
        self.time = nn.Linear(embedding, channels)
        self.norm2, self.conv2 = nn.GroupNorm(8, channels), nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.time(F.silu(t))[:, :, None, None]
        return x + self.conv2(F.silu(self.norm2(h)))


class DecoderUpBlock(nn.Module):
    """The SD VAE decoder's up block, small: a residual block (GroupNorm, SiLU, conv, twice, plus its
    input), then ``Upsample2D``'s nearest upsample and conv, and the next block's GroupNorm, SiLU, conv."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.res = UNetResBlock(channels)
        self.upsample_conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm, self.conv = nn.GroupNorm(4, channels), nn.Conv2d(channels, 8, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.upsample_conv(F.interpolate(self.res(x, t), scale_factor=2.0, mode="nearest"))
        return self.conv(F.silu(self.norm(h)))


class FeatureExtractor(nn.Module):
    """wav2vec2's first layers: a strided conv1d, GroupNorm with a group per channel, GELU, a second conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0, self.norm = nn.Conv1d(1, 32, 10, stride=5, bias=False), nn.GroupNorm(32, 32)
        self.conv1 = nn.Conv1d(32, 32, 3, stride=2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.conv1(F.gelu(self.norm(self.conv0(x)))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Sequential(nn.ConvTranspose2d(16, 8, 4, 2, 1, bias=False), nn.BatchNorm2d(8), nn.LeakyReLU(0.2),
                                nn.ConvTranspose2d(8, 3, 4, 2, 1), nn.Tanh())  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)


class AtrousPyramid(nn.Module):
    """DeepLab's ASPP: a 1x1 branch, two dilated 3x3 branches, the image pooled to 1x1, convolved and
    upsampled back, all concatenated and projected."""

    def __init__(self, channels: int = 16, width: int = 8) -> None:
        super().__init__()

        def branch(k: int, dilation: int = 1) -> nn.Module:
            return nn.Sequential(nn.Conv2d(channels, width, k, padding=dilation * (k // 2), dilation=dilation,
                                           bias=False), nn.BatchNorm2d(width), nn.ReLU())  # fmt: skip

        self.branches = nn.ModuleList([branch(1), branch(3, 2), branch(3, 3)])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(channels, width, 1, bias=False), nn.ReLU())
        self.project = nn.Sequential(nn.Conv2d(4 * width, channels, 1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.interpolate(self.pool(x), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return self.project(torch.cat([b(x) for b in self.branches] + [pooled], 1))


class Conv3dBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv3d(4, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool3d(F.relu(self.norm(self.conv(x))), 2)


#: name -> (the block, its inputs' shapes, the regions it holds: in inference, in training).  In training
#: a conv's BatchNorm takes its batch statistics (``conv_batch_norm``); the rest ``conv_epilogue``.
BLOCKS = {
    "mobilenetv3 inverted residual": (InvertedResidual, [(2, 16, 9, 11)],
                                      {"conv_epilogue": 4}, {"conv_batch_norm": 3, "conv_epilogue": 1}),
    "regnety block": (RegNetYBlock, [(2, 32, 12, 12)], {"conv_epilogue": 6}, {"conv_batch_norm": 4, "conv_epilogue": 2}),
    "convnext block": (ConvNeXtBlock, [(2, 32, 10, 10)], {}, {}),
    "unet residual block": (UNetResBlock, [(2, 32, 8, 8), (2, 16)], {}, {}),
    "vae decoder up block": (DecoderUpBlock, [(2, 16, 5, 6), (2, 16)], {"conv_group_norm": 1}, {"conv_group_norm": 1}),
    "wav2vec2 feature extractor": (FeatureExtractor, [(2, 1, 400)], {"conv_group_norm": 1, "conv_epilogue": 1},
                                   {"conv_group_norm": 1, "conv_epilogue": 1}),
    "dcgan decoder": (Decoder, [(2, 16, 4, 4)], {"conv_epilogue": 2}, {"conv_batch_norm": 1, "conv_epilogue": 1}),
    "conv3d block": (Conv3dBlock, [(2, 4, 6, 6, 6)], {"conv_epilogue": 1}, {"conv_batch_norm": 1}),
    "deeplab atrous pyramid": (AtrousPyramid, [(2, 16, 9, 9)], {"conv_epilogue": 5}, None),
}  # fmt: skip


def _build(name: str, channels_last: bool) -> tuple[nn.Module, list[torch.Tensor]]:
    block, shapes, _, _ = BLOCKS[name]
    torch.manual_seed(5)
    model, inputs = block().to(DEVICE), [torch.randn(s).to(DEVICE) for s in shapes]
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        inputs = [t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in inputs]
    return model, inputs


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_a_block_of_a_network_runs_fused_as_eager_does(kernels, name, train, channels_last):
    if channels_last and len(BLOCKS[name][1][0]) != 4:
        pytest.skip("channels-last is a 4-d layout")
    if BLOCKS[name][3 if train else 2] is None:
        pytest.skip("no strict expectation: test_a_block_whose_rewrite_fails_to_compile_trains_as_eager_does")
    model, inputs = _build(name, channels_last)
    assert_fused(model.train(train), inputs, expect=BLOCKS[name][3 if train else 2], train=train)


@pytest.mark.parametrize("name", ["mobilenetv3 inverted residual", "regnety block", "dcgan decoder", "vae decoder up block"])
def test_a_block_under_bf16_autocast_trains_as_eager_does(kernels, name):
    """Autocast's bf16 convs and fp32 norms, fused as eager runs them: against float64 with eager's own
    error as the yardstick."""
    model, inputs = _build(name, True)
    assert_fused(Autocast(model.train(), DEVICE), inputs, expect=BLOCKS[name][3], tol=3e-2)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_a_block_whose_rewrite_fails_to_compile_trains_as_eager_does(kernels, channels_last):
    """DeepLab's pyramid in training: the upsample's gradient scatters into the pooled branch's fused op,
    and on CPU Inductor's code generator asserts on that backward (torch 2.13).  The backward compiles
    with the forward, so the graph falls back to Inductor's as given during the compile, and the step's
    output and every gradient are eager's; where the rewrite compiles (another device or torch), it runs
    fused with the same results."""
    model, inputs = _build("deeplab atrous pyramid", channels_last)
    eager = copy.deepcopy(model)
    x, x_eager = (inputs[0].clone().requires_grad_(True) for _ in range(2))
    torch._dynamo.reset()
    with collect_reports() as reports, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's own warning, where there is one
        out = torch.compile(model, backend="fusion", options={"decide": "fuse"})(x)
    want = eager(x_eager)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-4)
    g = torch.randn_like(want)
    out.backward(g)
    want.backward(g)
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-3, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    fallbacks = [f for r in reports for f in r.fallbacks]
    assert all(f.stage == "compile" for f in fallbacks)
    assert fallbacks or sum(r.counts().get("conv_batch_norm", 0) for r in reports) == 4


# Spellings and edge cases inside such blocks: a BatchNorm that normalises with the batch's statistics in
# eval (no running statistics), one with a cumulative average (momentum None: not fused in training),
# one without affine; a conv used twice (tied weights); a weight computed in the forward (weight
# standardisation before a GroupNorm); ``padding="same"`` and a reflect-padded conv; 1x1 inputs to a
# padded 3x3; a conv called functionally on a reshaped parameter; a sliced input; a graph break between
# two blocks; a LayerNorm over (C, H, W).


class _ConvNormAct(nn.Module):
    def __init__(self, norm: nn.Module, act: Any = F.relu, c_in: int = 4, c_out: int = 8, **conv: Any) -> None:
        super().__init__()
        self.conv, self.norm, self.act = nn.Conv2d(c_in, c_out, 3, **{"padding": 1, "bias": False, **conv}), norm, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.conv(x)))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn1, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv(F.relu(self.bn1(self.conv(x))))))


class _WeightStandardised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight, self.norm = nn.Parameter(torch.randn(8, 4, 3, 3)), nn.GroupNorm(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight - self.weight.mean((1, 2, 3), keepdim=True)
        return F.silu(self.norm(F.conv2d(x, w / (w.std((1, 2, 3), keepdim=True) + 1e-5), padding=1)))


class _SameThenReflect(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 8, 3, padding="same")
        # no bias before the BatchNorm: its gradient is zero up to rounding, which no comparison can judge
        self.b, self.norm = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect", bias=False), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.b(F.relu(self.a(x)))))


class _Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flat, self.bias = nn.Parameter(torch.randn(8 * 4 * 9) * 0.2), nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.conv2d(x, self.flat.view(8, 4, 3, 3), self.bias, padding=1))


class _Sliced(_ConvNormAct):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x[:, :, 1:-1, ::2])


class _GraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _ConvNormAct(nn.BatchNorm2d(8)), _ConvNormAct(nn.BatchNorm2d(8), c_in=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y)


#: name -> (the block, x's shape, its regions in inference, in training)
EDGES = {
    "batch norm without running statistics": (lambda: _ConvNormAct(nn.BatchNorm2d(8, track_running_stats=False)),
                                              (2, 4, 6, 6), {"conv_batch_norm": 1}, {"conv_batch_norm": 1}),
    "batch norm with a cumulative average": (lambda: _ConvNormAct(nn.BatchNorm2d(8, momentum=None), F.silu),
                                             (2, 4, 6, 6), {"conv_epilogue": 1}, {}),
    "batch norm without affine": (lambda: _ConvNormAct(nn.BatchNorm2d(8, affine=False)), (2, 4, 6, 6),
                                  {"conv_epilogue": 1}, {"conv_batch_norm": 1}),
    "a conv used twice": (_Tied, (2, 8, 6, 6), {"conv_epilogue": 2}, {"conv_batch_norm": 2}),
    "a weight standardised in the forward": (_WeightStandardised, (2, 4, 6, 6), {"conv_group_norm": 1},
                                             {"conv_group_norm": 1}),
    "same and reflect padding": (_SameThenReflect, (2, 4, 7, 6), {"conv_epilogue": 1}, {"conv_batch_norm": 1}),
    "1x1 inputs to a padded 3x3": (lambda: _ConvNormAct(nn.BatchNorm2d(16), c_in=16, c_out=16), (4, 16, 1, 1),
                                   {"conv_epilogue": 1}, {"conv_batch_norm": 1}),
    "a functional conv on a reshaped parameter": (_Functional, (2, 4, 6, 6), {"conv_epilogue": 1},
                                                  {"conv_epilogue": 1}),
    "a sliced input": (lambda: _Sliced(nn.BatchNorm2d(8)), (2, 4, 8, 9), {"conv_epilogue": 1}, {"conv_batch_norm": 1}),
    "a graph break between blocks": (_GraphBreak, (2, 4, 6, 6), {"conv_epilogue": 2}, {"conv_batch_norm": 2}),
    "layer norm over channels and plane": (lambda: _ConvNormAct(nn.LayerNorm([8, 6, 6]), F.gelu, bias=True),
                                           (2, 4, 6, 6), {"conv_layer_norm": 1}, {"conv_layer_norm": 1}),
}  # fmt: skip


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("name", list(EDGES))
def test_an_edge_case_inside_a_block_runs_fused_as_eager_does(kernels, name, train):
    block, shape, infer_regions, train_regions = EDGES[name]
    torch.manual_seed(6)
    model = block().to(DEVICE)
    assert_fused(model.train(train), [torch.randn(shape).to(DEVICE)], expect=train_regions if train else infer_regions,
                 train=train)
