"""ConvTranspose2d 128->64, 2x2, stride 2, then ReLU, on 8x128x64x64 (a U-Net decoder upsampling)."""

import torch
import torch.nn as nn

batch_size = 8
in_channels, out_channels = 128, 64
height, width = 64, 64
kernel_size, stride = 2, 2


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride=stride)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv_transpose(x))


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride]
