"""EfficientNet-B0 (torchvision ``efficientnet_b0``, random weights) on a channels-last 64x3x224x224
batch: the 1000-class logits.

The classifier's dropout and the blocks' stochastic depth are 0 (torchvision's defaults are 0.2): random
masks would make every backend compute another function than eager, and the bench checks each against
eager before timing it.  Rows: bf16, inference and training.  Needs torchvision, imported when the
model is built.  Inference rows run the network in eval mode
(``INFER_EVAL``), training rows in training mode.
"""

import torch
import torch.nn as nn

DTYPES = ("bf16",)
MODES = ("infer", "train")
REQUIRES = ("torchvision",)
INFER_EVAL = True

batch_size = 64
channels, height, width = 3, 224, 224


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        from torchvision.models import efficientnet_b0

        self.net = efficientnet_b0(weights=None, dropout=0.0, stochastic_depth_prob=0.0)
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.net(x)


def get_inputs():
    return [torch.randn(batch_size, channels, height, width).to(memory_format=torch.channels_last)]


def get_init_inputs():
    return []
