"""Conv2d 128->128, 3x3, padding 1, then SiLU, on a single 128x128x128 image (batch 1)."""

import torch
import torch.nn as nn

batch_size = 1
channels = 128
height, width = 128, 128
kernel_size, padding = 3, 1


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, padding):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding)
        self.silu = nn.SiLU()

    def forward(self, x):
        return self.silu(self.conv(x))


def get_inputs():
    return [torch.rand(batch_size, channels, height, width)]


def get_init_inputs():
    return [channels, channels, kernel_size, padding]
