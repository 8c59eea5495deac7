"""ResNet-50 (torchvision ``resnet50``, random weights) on a channels-last 64x3x224x224 batch: the
1000-class logits.

Rows: fp32 and bf16, inference and training (``DTYPES``, ``MODES``).  Needs torchvision, imported when
the model is built, so the file loads without it.  Inference rows run the
network in eval mode (``INFER_EVAL``), training rows in training mode.
"""

import torch
import torch.nn as nn

DTYPES = ("fp32", "bf16")
MODES = ("infer", "train")
REQUIRES = ("torchvision",)
INFER_EVAL = True

batch_size = 64
channels, height, width = 3, 224, 224


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        from torchvision.models import resnet50

        self.net = resnet50(weights=None)
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.net(x)


def get_inputs():
    return [torch.randn(batch_size, channels, height, width).to(memory_format=torch.channels_last)]


def get_init_inputs():
    return []
