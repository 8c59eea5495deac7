"""The DCGAN generator of the PyTorch DCGAN example (nz 100, ngf 64, nc 3), written out here: 128 noise
vectors of 100x1x1, channels-last, to 128x3x64x64 images.

Five ConvTranspose2d (kernel 4; stride 1 then 2), a BatchNorm2d and ReLU after each but the last, Tanh
at the end; weights initialized as the example does (conv N(0, 0.02), BatchNorm weight N(1, 0.02), bias
0).  Rows: bf16, inference and training.  No library needed.  Inference rows run the network in eval mode
(``INFER_EVAL``), training rows in training mode.
"""

import torch
import torch.nn as nn

DTYPES = ("bf16",)
MODES = ("infer", "train")
INFER_EVAL = True

batch_size = 128
nz, ngf, nc = 100, 64, 3


def weights_init(m):
    """The example's initialization."""
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Model(nn.Module):
    def __init__(self, nz, ngf, nc):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),  # -> (ngf*8) x 4 x 4
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),  # -> (ngf*4) x 8 x 8
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),  # -> (ngf*2) x 16 x 16
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),  # -> ngf x 32 x 32
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),  # -> nc x 64 x 64
            nn.Tanh(),
        )
        self.apply(weights_init)
        self.to(memory_format=torch.channels_last)

    def forward(self, noise):
        return self.main(noise)


def get_inputs():
    return [torch.randn(batch_size, nz, 1, 1).to(memory_format=torch.channels_last)]


def get_init_inputs():
    return [nz, ngf, nc]
