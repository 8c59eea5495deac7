"""ConvTranspose2d 256->128, 4x4, stride 2, padding 1, then ReLU, on 64x256x16x16 (a DCGAN generator)."""

import torch
import torch.nn as nn

batch_size = 64
in_channels, out_channels = 256, 128
height, width = 16, 16
kernel_size, stride, padding = 4, 2, 1


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride=stride,
                                                 padding=padding)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv_transpose(x))


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding]
