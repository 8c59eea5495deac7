"""ConvTranspose2d 64->3, 4x4, stride 2, padding 1, then Tanh, on 64x64x32x32 (a DCGAN generator's output)."""

import torch
import torch.nn as nn

batch_size = 64
in_channels, out_channels = 64, 3
height, width = 32, 32
kernel_size, stride, padding = 4, 2, 1


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride=stride,
                                                 padding=padding)
        self.tanh = nn.Tanh()

    def forward(self, x):
        return self.tanh(self.conv_transpose(x))


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding]
