"""ConvTranspose3d(16->32, k3, s2) -> LeakyReLU -> x * per-channel multiplier -> LeakyReLU -> MaxPool3d(2).

Input 16x16x16x32x32.  Benchmark layout: ``Model``, ``get_inputs()``, ``get_init_inputs()``.
"""

import torch
import torch.nn as nn

batch_size = 16
in_channels, out_channels = 16, 32
depth, height, width = 16, 32, 32
kernel_size, stride, padding, output_padding = 3, 2, 1, 1
multiplier_shape = (out_channels, 1, 1, 1)
negative_slope = 0.2


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, output_padding, multiplier_shape):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, output_padding=output_padding
        )
        self.multiplier = nn.Parameter(torch.randn(multiplier_shape))
        self.leaky_relu = nn.LeakyReLU(negative_slope=negative_slope)
        self.max_pool = nn.MaxPool3d(kernel_size=2)

    def forward(self, x):
        x = self.conv_transpose(x)
        x = self.leaky_relu(x)
        x = x * self.multiplier
        x = self.leaky_relu(x)
        x = self.max_pool(x)
        return x


def get_inputs():
    return [torch.rand(batch_size, in_channels, depth, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding, output_padding, multiplier_shape]
