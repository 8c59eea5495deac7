"""Conv3d 16->32, 3x3x3, then softmax over the channels and x2, on 8x16x32x64x64 (a volumetric
segmentation head)."""

import torch
import torch.nn as nn

batch_size = 8
in_channels, out_channels = 16, 32
depth, height, width = 32, 64, 64


class Model(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, 3)

    def forward(self, x):
        return torch.softmax(self.conv(x), dim=1) * 2.0


def get_inputs():
    return [torch.randn(batch_size, in_channels, depth, height, width)]


def get_init_inputs():
    return [in_channels, out_channels]
