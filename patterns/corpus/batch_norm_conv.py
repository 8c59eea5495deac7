"""Corpus of ``batch_norm_conv``: convs of networks trained from scratch that read the previous layer's
batch norm (training mode) and activation, and the near misses the family reports."""

from __future__ import annotations

import torch
import torch.nn as nn

from ...testing import Autocast
from . import CorpusCase, x_of


class PreActivation(nn.Module):
    """A pre-activation ResNet unit / DenseNet layer: ``conv(relu(bn(x)))`` on the block's input."""

    def __init__(self, c_in: int, c_out: int, k: int, dims: int = 2, act: nn.Module | None = None) -> None:
        super().__init__()
        self.bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[dims - 1](c_in)
        self.act = nn.ReLU() if act is None else act
        self.conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1](c_in, c_out, k, padding=k // 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.act(self.bn(x)))


class SharedActivation(PreActivation):
    """The activation is also the block's shortcut (pre-activation ResNet's projection unit)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act(self.bn(x))
        return self.conv(a) + a


def bottleneck() -> nn.Module:
    """ResNet-50's bottleneck without its shortcut: 1x1 -> bn -> relu -> 3x3 -> bn -> relu -> 1x1."""
    return nn.Sequential(nn.Conv2d(16, 8, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 16, 1, bias=False)).train()  # fmt: skip


CASES = [
    CorpusCase("resnet_bottleneck_in_training", lambda: (bottleneck(), x_of(2, 16, 6, 6)),
               regions=("batch_norm(train) -> relu -> conv2d", "batch_norm(train) -> relu -> conv2d"),
               near_misses=(("conv_batch_norm", "claimed", "already part of another fused region"),
                            ("conv_epilogue", "unsupported_op", "the conv_batch_norm family's"))),
    CorpusCase("densenet_layer_bn_relu_conv", lambda: (PreActivation(8, 4, 3).train(), x_of(2, 8, 6, 6)),
               regions=("batch_norm(train) -> relu -> conv2d",)),
    CorpusCase("efficientnet_depthwise_after_bn_silu",
               lambda: (nn.Sequential(nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8)).train(),
                        x_of(2, 8, 6, 6)),  # fmt: skip
               regions=("batch_norm(train) -> silu -> conv2d",)),
    CorpusCase("temporal_conv1d_after_bn_gelu",
               lambda: (PreActivation(4, 8, 5, dims=1, act=nn.GELU()).train(), x_of(2, 4, 12)),
               regions=("batch_norm(train) -> gelu -> conv1d",)),
    CorpusCase("video_conv3d_after_bn_without_activation",
               lambda: (PreActivation(4, 4, 3, dims=3, act=nn.Identity()).train(), x_of(2, 4, 4, 5, 5)),
               regions=("batch_norm(train) -> conv3d",)),
    # near misses
    CorpusCase("activation_also_the_shortcut", lambda: (SharedActivation(4, 4, 3).train(), x_of(2, 4, 6, 6)),
               near_misses=(("batch_norm_conv", "shared_intermediate", "is used by"),
                            ("conv_epilogue", "unsupported_operand", "a residual add with gradients flowing"))),
    CorpusCase("norm_in_fp32_before_a_bf16_conv",
               lambda: (Autocast(PreActivation(4, 4, 3).train(), "cpu"), x_of(2, 4, 6, 6)),
               near_misses=(("batch_norm_conv", "unsupported_dtype", "the fused op runs the norm in the conv's dtype"),
                            ("conv_epilogue", "no_epilogue", "goes straight to the graph output"))),
    CorpusCase("sync_batch_norm_before_the_conv",
               lambda: (nn.Sequential(nn.SyncBatchNorm(4), nn.ReLU(), nn.Conv2d(4, 4, 3)).train(), x_of(2, 4, 6, 6)),
               near_misses=(("batch_norm_conv", "unsupported_op", "SyncBatchNorm"),
                            ("conv_epilogue", "no_epilogue", "goes straight to the graph output"))),
]
