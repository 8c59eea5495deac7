"""``conv_epilogue`` examples: conv -> pointwise chain -> optional pool, as real networks write it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CorpusCase, Then, x_of


class _ReadsConvTwice(nn.Module):
    """``join(y)`` reads the conv output ``y`` twice: a residual ``y + relu(y)`` is a DAG epilogue;
    ``relu(y) + tanh(y)``, two branches, is more than one chain can carry."""

    def __init__(self, join) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.join = join

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.join(self.conv(x))


class _Swish(nn.Module):
    """EfficientNet's Swish as older code spells it, then a per-channel scale."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(16, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return (y * torch.sigmoid(y)) * self.scale


class _LearnedClamp(nn.Module):
    """A learned floor (a 0-d parameter) clamps the conv output; its gradient is where it was taken."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.floor = nn.Parameter(torch.tensor(-0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.clamp(self.conv(x), min=self.floor))


class _LearnedBand(nn.Module):
    """Both bounds of one clamp are learned: a kernel slot has room for one operand gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.lo = nn.Parameter(torch.tensor(-0.5))
        self.hi = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(self.conv(x), min=self.lo, max=self.hi)


CASES = [
    CorpusCase("vgg_block", lambda: (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
                                                   nn.MaxPool2d(2)), x_of(2, 3, 16, 16)),  # fmt: skip
               regions=("conv2d -> relu -> max_pool2d",)),
    CorpusCase("resnet_stem_eval", lambda: (nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8),
                                                          nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)).eval(),
                                            x_of(2, 3, 32, 32)),  # fmt: skip
               regions=("conv2d -> batch_norm (folded) -> relu -> max_pool2d",)),
    CorpusCase("mobilenet_depthwise", lambda: (nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU6()),
                                               x_of(2, 8, 16, 16)),  # fmt: skip
               regions=("conv2d -> hardtanh",)),
    CorpusCase("efficientnet_swish_spelled_out", lambda: (_Swish(), x_of(2, 8, 12, 12)),
               regions=("conv2d -> silu -> mul",)),
    CorpusCase("unet_decoder_up", lambda: (nn.Sequential(nn.ConvTranspose2d(16, 8, 2, 2), nn.ReLU()),
                                           x_of(2, 16, 8, 8)),  # fmt: skip
               regions=("conv_transpose2d -> relu",)),
    CorpusCase("decoder_upsample_conv", lambda: (nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(16, 8, 3, padding=1)),
                                                 x_of(2, 16, 8, 8)),  # fmt: skip
               regions=("upsample(2) -> conv2d",)),
    CorpusCase("dcgan_output", lambda: (nn.Sequential(nn.ConvTranspose2d(16, 3, 4, 2, 1), nn.Tanh()), x_of(2, 16, 8, 8)),
               regions=("conv_transpose2d -> tanh",)),
    CorpusCase("conv3d_leaky_maxpool", lambda: (nn.Sequential(nn.Conv3d(4, 8, 3, padding=1), nn.LeakyReLU(0.01),
                                                              nn.MaxPool3d(2)), x_of(1, 4, 8, 8, 8)),  # fmt: skip
               regions=("conv3d -> leaky_relu -> max_pool3d",)),
    CorpusCase("wav2vec_conv1d_gelu", lambda: (nn.Sequential(nn.Conv1d(8, 16, 5, padding=2), nn.GELU()), x_of(2, 8, 40)),
               regions=("conv1d -> gelu",)),
    CorpusCase("residual_reads_conv_twice",
               lambda: (_ReadsConvTwice(lambda y: y + torch.relu(y)), x_of(2, 8, 12, 12)),
               regions=("conv2d -> relu -> add(conv2d)",)),
    CorpusCase("learned_clamp_floor", lambda: (_LearnedClamp(), x_of(2, 3, 12, 12)),
               regions=("conv2d -> clamp_min -> relu",)),
    # near misses
    CorpusCase("batch_norm_training_after_an_activation",
               lambda: (nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8)).train(), x_of(2, 3, 12, 12)),
               regions=("conv2d -> relu",),
               near_misses=(("conv_batch_norm", "unsupported_op", "between the conv and the batch norm"),
                            ("conv_epilogue", "unsupported_op", "the conv_batch_norm family's"))),
    CorpusCase("channel_reduction_beyond_the_channel_family",
               lambda: (Then(nn.Conv2d(3, 1100, 1), lambda y: torch.relu(y).amax(dim=1)), x_of(1, 3, 4, 4)),
               regions=("conv2d -> relu",),
               near_misses=(("conv_epilogue", "unsupported_op", "an amax over dim 1 is the conv_channel_reduce family's"),
                            ("conv_channel_reduce", "dimension_mismatch", "at most 1024"))),
    CorpusCase("layer_norm_over_the_batch_too",
               lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: F.layer_norm(torch.relu(y), y.shape)), x_of(2, 3, 12, 12)),
               regions=("conv2d -> relu",),
               near_misses=(("conv_epilogue", "unsupported_op", "(LayerNorm): the conv_layer_norm family's"),
                            ("conv_layer_norm", "dimension_mismatch", "the batch dim included"))),
    CorpusCase("sum_over_space_is_not_a_channel_reduction",
               lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: y.sum(dim=-1)), x_of(2, 3, 12, 12)),
               near_misses=(("conv_epilogue", "unsupported_op", "is not a fusible pointwise op or pool"),
                            ("conv_global_mean", "dimension_mismatch", "not every spatial dim"))),
    CorpusCase("learned_clamp_band", lambda: (_LearnedBand(), x_of(2, 3, 12, 12)),
               near_misses=(("conv_epilogue", "unsupported_operand", "requires grad"),)),
    CorpusCase("two_branches_of_the_conv_output",
               lambda: (_ReadsConvTwice(lambda y: torch.relu(y) + torch.tanh(y)), x_of(2, 8, 12, 12)),
               near_misses=(("conv_epilogue", "shared_intermediate", "the chain would branch"),)),
]
