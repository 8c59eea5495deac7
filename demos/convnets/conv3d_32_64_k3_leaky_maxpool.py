"""Conv3d 32->64, 3x3x3, padding 1, then LeakyReLU(0.01) and 2x2x2 max-pool, on 2x32x64x64x64 (3D U-Net)."""

import torch
import torch.nn as nn

batch_size = 2
in_channels, out_channels = 32, 64
depth, height, width = 64, 64, 64
kernel_size, padding = 3, 1
negative_slope = 0.01
pool_size = 2


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, padding, negative_slope, pool_size):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, padding=padding)
        self.leaky_relu = nn.LeakyReLU(negative_slope)
        self.max_pool = nn.MaxPool3d(pool_size)

    def forward(self, x):
        return self.max_pool(self.leaky_relu(self.conv(x)))


def get_inputs():
    return [torch.rand(batch_size, in_channels, depth, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, padding, negative_slope, pool_size]
