"""Conv2d 64->128, 3x3, then the minimum over the channels and tanh, on 64x64x128x128."""

import torch
import torch.nn as nn

batch_size = 64
in_channels, out_channels = 64, 128
height, width = 128, 128


class Model(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3)

    def forward(self, x):
        return torch.tanh(torch.min(self.conv(x), dim=1, keepdim=True)[0])


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels]
