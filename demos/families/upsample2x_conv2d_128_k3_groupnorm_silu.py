"""Nearest 2x upsample, then Conv2d 128->128, 3x3, padding 1, GroupNorm(32 groups) and SiLU, on
8x128x64x64 (a UNet decoder's upsampling step followed by its next block's norm; the upsample folds into
the conv: a transposed conv of stride 2 on the small input)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 8
channels = 128
height, width = 64, 64
groups = 32


class Model(nn.Module):
    def __init__(self, channels, groups):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.GroupNorm(groups, channels)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.norm(self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))))


def get_inputs():
    return [torch.randn(batch_size, channels, height, width)]


def get_init_inputs():
    return [channels, groups]
