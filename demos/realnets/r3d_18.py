"""ResNet3D-18 video classifier (torchvision ``r3d_18``, random weights) on a channels-last-3d batch of
8 clips of 16 frames, 3x112x112: the 400-class logits.

Rows: bf16, inference and training.  Needs torchvision, imported when the model is built.  Inference rows run the network in eval mode
(``INFER_EVAL``), training rows in training mode.
"""

import torch
import torch.nn as nn

DTYPES = ("bf16",)
MODES = ("infer", "train")
REQUIRES = ("torchvision",)
INFER_EVAL = True

batch_size = 8
channels, frames, height, width = 3, 16, 112, 112


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        from torchvision.models.video import r3d_18

        self.net = r3d_18(weights=None)
        self.to(memory_format=torch.channels_last_3d)

    def forward(self, x):
        return self.net(x)


def get_inputs():
    x = torch.randn(batch_size, channels, frames, height, width)
    return [x.to(memory_format=torch.channels_last_3d)]


def get_init_inputs():
    return []
