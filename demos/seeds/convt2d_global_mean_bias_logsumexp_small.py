"""ConvTranspose2d(3->16, k3) -> global mean -> + bias -> logsumexp over channels -> sum -> * 10.

Input 128x3x32x32: the small variant of ``convt2d_global_mean_bias_logsumexp.py``.  Benchmark layout: ``Model``, ``get_inputs()``, ``get_init_inputs()``.
"""

import torch
import torch.nn as nn

batch_size = 128
in_channels, out_channels = 3, 16
height, width = 32, 32
kernel_size = 3
bias_shape = (out_channels, 1, 1)


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, bias_shape):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose2d(in_channels, out_channels, kernel_size)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        x = self.conv_transpose(x)
        x = torch.mean(x, dim=(2, 3), keepdim=True)
        x = x + self.bias
        x = torch.logsumexp(x, dim=1, keepdim=True)
        x = torch.sum(x, dim=(2, 3))
        x = x * 10.0
        return x


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, bias_shape]
