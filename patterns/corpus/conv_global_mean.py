"""``conv_global_mean`` examples: conv -> global mean over every spatial dim -> small tail."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CorpusCase, x_of


class _GapHead(nn.Module):
    """A classifier head: conv, global average pool, flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(self.conv(x), 1).flatten(1)


class _MeanBiasLogsumexp(nn.Module):
    """ConvTranspose2d -> mean over H, W -> + bias -> logsumexp over channels -> sum -> x10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_transpose = nn.ConvTranspose2d(4, 8, 3)
        self.bias = nn.Parameter(torch.randn(8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.mean(self.conv_transpose(x), dim=(2, 3), keepdim=True) + self.bias
        return torch.sum(torch.logsumexp(y, dim=1, keepdim=True), dim=(2, 3)) * 10.0


class _MeanOverChannels(nn.Module):
    """A mean over the channels is not a global (spatial) mean (``conv_channel_reduce`` takes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean(dim=1)


CASES = [
    CorpusCase("classifier_head", lambda: (_GapHead(), x_of(2, 8, 10, 10)), regions=("conv2d -> global_mean",)),
    CorpusCase("convt_mean_bias_logsumexp", lambda: (_MeanBiasLogsumexp(), x_of(2, 4, 9, 9)),
               regions=("conv_transpose2d -> global_mean",)),
    CorpusCase("mean_over_channels", lambda: (_MeanOverChannels(), x_of(2, 3, 10, 10)),
               regions=("conv2d -> mean(dim=1)",),
               near_misses=(("conv_global_mean", "dimension_mismatch", "only spatial dims"),)),
]
