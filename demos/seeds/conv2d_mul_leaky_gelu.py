"""Conv2d(64->64, k3) -> x * per-channel multiplier -> LeakyReLU -> GELU.

Input 64x64x256x256.  Benchmark layout: ``Model``, ``get_inputs()``, ``get_init_inputs()``.
"""

import torch
import torch.nn as nn

batch_size = 64
in_channels, out_channels = 64, 64
height, width = 256, 256
kernel_size = 3
multiplier_shape = (out_channels, 1, 1)


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, multiplier_shape):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.multiplier = nn.Parameter(torch.randn(multiplier_shape))
        self.leaky_relu = nn.LeakyReLU()

    def forward(self, x):
        x = self.conv(x)
        x = x * self.multiplier
        x = self.leaky_relu(x)
        x = torch.nn.functional.gelu(x)
        return x


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, multiplier_shape]
