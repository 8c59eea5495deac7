"""A conv2d followed by a chain written as a lambda, for the front end's and the matcher's tests."""

import torch
import torch.nn as nn

from fusion_backend.testing import dry_run

X2 = (torch.rand(2, 3, 10, 10),)


class Chain(nn.Module):
    """conv2d(3→4, k3) followed by ``body(self, y)``; ``m``, ``m4`` and ``s`` are per-channel and 0-d
    parameters the body may use."""

    def __init__(self, body, conv=None):
        super().__init__()
        self.conv = conv or nn.Conv2d(3, 4, 3)
        self.m = nn.Parameter(torch.randn(4, 1, 1))
        self.m4 = nn.Parameter(torch.randn(1, 4, 1, 1))
        self.s = nn.Parameter(torch.randn(()))
        self.body = body

    def forward(self, x):
        return self.body(self, self.conv(x))


def regions(model, inputs=X2, **kw):
    """The ``(anchor, summary, ...)`` of every conv_epilogue region ``dry_run`` finds."""
    return dry_run(model, inputs, patterns=["conv_epilogue"], **kw).regions
