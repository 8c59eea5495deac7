"""ResNet-18 (torchvision ``resnet18``, random weights) on a channels-last 64x3x224x224 batch: the
1000-class logits.  Not in the ``realnets`` suite: the model of ``demos/distributed_train.py``'s ResNet
check, 32 images per GPU on two, e.g.

    torchrun --nproc-per-node 2 demos/distributed_train.py --model demos/realnets/resnet18.py

Its ``TRAIN_*`` attributes are that demo's training defaults: SGD with lr 0.001, momentum 0.9 and weight
decay 1e-4, cross-entropy against random labels, 3 checked steps.  So small a step and so few because
float32 and float64 part over the steps, faster with a larger step, and the check (within twice eager
float32's own error vs float64) only sees differences larger than that drift.  Measured on CPU with this
batch (the same network built without torchvision, no weight decay), eager float32's whole update vs
float64: 1.1e-2 after one step at either rate; after 3 steps 1.7e-2 at lr 0.001, 6e-2 at lr 0.01 (1.7e-1
after 6); Inductor's compiled steps stayed within 1.01x of eager's error on every parameter over 3 steps
at lr 0.001.  The labels are random: no learning rate learns anything here.

Needs torchvision, imported when the model is built, so the file loads without it.  Rows (bench):
fp32 and bf16, inference in eval mode, training.
"""

import torch
import torch.nn as nn

DTYPES = ("fp32", "bf16")
MODES = ("infer", "train")
REQUIRES = ("torchvision",)
INFER_EVAL = True
TRAIN_OPTIMIZER = "sgd"
TRAIN_LR = 0.001
TRAIN_MOMENTUM = 0.9
TRAIN_WEIGHT_DECAY = 1e-4
TRAIN_LOSS = "cross-entropy"
TRAIN_STEPS = 3

batch_size = 64
channels, height, width = 3, 224, 224


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        from torchvision.models import resnet18

        self.net = resnet18(weights=None)
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.net(x)


def get_inputs():
    return [torch.randn(batch_size, channels, height, width).to(memory_format=torch.channels_last)]


def get_init_inputs():
    return []
