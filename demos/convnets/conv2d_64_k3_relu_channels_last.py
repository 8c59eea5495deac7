"""Conv2d 64->64, 3x3, padding 1, then ReLU, on a channels-last 32x64x56x56 input."""

import torch
import torch.nn as nn

batch_size = 32
channels = 64
height, width = 56, 56
kernel_size, padding = 3, 1


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, padding):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x))


def get_inputs():
    return [torch.rand(batch_size, channels, height, width).to(memory_format=torch.channels_last)]


def get_init_inputs():
    return [channels, channels, kernel_size, padding]
