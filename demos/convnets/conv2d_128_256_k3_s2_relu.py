"""Conv2d 128->256, 3x3, stride 2, padding 1, then ReLU, on 32x128x28x28 (a ResNet downsampling layer)."""

import torch
import torch.nn as nn

batch_size = 32
in_channels, out_channels = 128, 256
height, width = 28, 28
kernel_size, stride, padding = 3, 2, 1


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x))


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding]
