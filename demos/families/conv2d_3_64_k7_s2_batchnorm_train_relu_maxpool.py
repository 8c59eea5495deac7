"""ResNet's stem while it trains: Conv2d 3->64, 7x7, stride 2, padding 3, then BatchNorm2d with batch
statistics (training mode), ReLU and a 3x3 max-pool with stride 2 and padding 1, on 32x3x224x224."""

import torch
import torch.nn as nn

batch_size = 32
in_channels, out_channels = 3, 64
height, width = 224, 224


class Model(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 7, stride=2, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x):
        return self.pool(self.relu(self.bn(self.conv(x))))


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels]
