"""ConvTranspose2d 64->32, 4x4, stride 2, padding 1, then GroupNorm(8 groups) and SiLU, on 16x64x64x64
(a decoder's upsampling layer)."""

import torch
import torch.nn as nn

batch_size = 16
in_channels, out_channels = 64, 32
height, width = 64, 64
groups = 8


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, groups):
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, out_channels, 4, stride=2, padding=1)
        self.norm = nn.GroupNorm(groups, out_channels)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.norm(self.up(x)))


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, groups]
