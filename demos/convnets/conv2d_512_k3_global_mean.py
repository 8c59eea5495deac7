"""Conv2d 512->512, 3x3, padding 1, then the mean over H and W, on 32x512x7x7 (a classifier head)."""

import torch
import torch.nn as nn

batch_size = 32
channels = 512
height, width = 7, 7
kernel_size, padding = 3, 1


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, padding):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding)

    def forward(self, x):
        return self.conv(x).mean((2, 3))


def get_inputs():
    return [torch.rand(batch_size, channels, height, width)]


def get_init_inputs():
    return [channels, channels, kernel_size, padding]
