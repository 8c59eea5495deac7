"""Conv2d 64->64, 3x3, padding 1, then BatchNorm2d with batch statistics (training mode) and ReLU, on
32x64x128x128 (a ResNet block's first layer while it trains)."""

import torch
import torch.nn as nn

batch_size = 32
channels = 64
height, width = 128, 128


class Model(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


def get_inputs():
    return [torch.randn(batch_size, channels, height, width)]


def get_init_inputs():
    return [channels]
