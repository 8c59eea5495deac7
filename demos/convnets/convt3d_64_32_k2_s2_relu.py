"""ConvTranspose3d 64->32, 2x2x2, stride 2, then ReLU, on 2x64x32x32x32 (a 3D U-Net decoder upsampling)."""

import torch
import torch.nn as nn

batch_size = 2
in_channels, out_channels = 64, 32
depth, height, width = 32, 32, 32
kernel_size, stride = 2, 2


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(in_channels, out_channels, kernel_size, stride=stride)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv_transpose(x))


def get_inputs():
    return [torch.rand(batch_size, in_channels, depth, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride]
