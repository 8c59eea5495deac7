"""Conv2d 256->256, 3x3, padding 1, then ReLU and 2x2 max-pool, on a channels-last 16x256x56x56 input."""

import torch
import torch.nn as nn

batch_size = 16
channels = 256
height, width = 56, 56
kernel_size, padding = 3, 1
pool_size = 2


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, padding, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding)
        self.relu = nn.ReLU()
        self.max_pool = nn.MaxPool2d(pool_size)

    def forward(self, x):
        return self.max_pool(self.relu(self.conv(x)))


def get_inputs():
    return [torch.rand(batch_size, channels, height, width).to(memory_format=torch.channels_last)]


def get_init_inputs():
    return [channels, channels, kernel_size, padding, pool_size]
