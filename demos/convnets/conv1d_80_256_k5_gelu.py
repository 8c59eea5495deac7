"""Conv1d 80->256, kernel 5, padding 2, then GELU, on 16x80x3000 (a speech front end over mel frames)."""

import torch
import torch.nn as nn

batch_size = 16
in_channels, out_channels = 80, 256
length = 3000
kernel_size, padding = 5, 2


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, padding):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, padding=padding)
        self.gelu = nn.GELU()

    def forward(self, x):
        return self.gelu(self.conv(x))


def get_inputs():
    return [torch.rand(batch_size, in_channels, length)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, padding]
