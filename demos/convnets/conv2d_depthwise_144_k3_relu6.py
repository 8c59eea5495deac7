"""Depthwise Conv2d 144->144 (groups=144), 3x3, padding 1, then ReLU6, on 32x144x56x56 (MobileNetV2)."""

import torch
import torch.nn as nn

batch_size = 32
channels = 144
height, width = 56, 56
kernel_size, padding = 3, 1


class Model(nn.Module):
    def __init__(self, channels, kernel_size, padding):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size, padding=padding, groups=channels)
        self.relu6 = nn.ReLU6()

    def forward(self, x):
        return self.relu6(self.conv(x))


def get_inputs():
    return [torch.rand(batch_size, channels, height, width)]


def get_init_inputs():
    return [channels, kernel_size, padding]
