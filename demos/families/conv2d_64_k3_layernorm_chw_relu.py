"""Conv2d 64->64, 3x3, padding 1, then LayerNorm over each sample's (C, H, W) with its elementwise
affine, and ReLU, on 32x64x64x64 (a conv block normalised per sample, batch-size independent)."""

import torch
import torch.nn as nn

batch_size = 32
channels = 64
height, width = 64, 64


class Model(nn.Module):
    def __init__(self, channels, height, width):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.LayerNorm([channels, height, width])
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.norm(self.conv(x)))


def get_inputs():
    return [torch.randn(batch_size, channels, height, width)]


def get_init_inputs():
    return [channels, height, width]
