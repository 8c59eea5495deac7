"""Corpus of ``conv_layer_norm``: conv layers whose output is normalised over trailing dims by a layer
norm (the whole sample, a channel's plane, or the last dim alone), and the near misses the family
reports."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CorpusCase, Then, x_of


class _UpsampleLayerNormW(nn.Module):
    """ConvTranspose3d, then ``nn.LayerNorm(C)`` applied to the (N, C, D, H, W) output whose W is C
    (a norm over W alone), GELU and a learned scale."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(3, 8, 3, stride=2, padding=1, output_padding=1)
        self.norm = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.up(x))) * self.scale


class _PositionalBeforeNorm(nn.Module):
    """A positional table of the normalized shape added before the norm: not one value per channel."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.pos = nn.Parameter(torch.zeros(10, 10))
        self.norm = nn.LayerNorm([10, 10])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x) + self.pos)


CASES = [
    CorpusCase("conv2d_layer_norm_over_the_sample_relu",
               lambda: (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.LayerNorm([8, 12, 12]), nn.ReLU()),
                        x_of(2, 3, 12, 12)),  # fmt: skip
               regions=("conv2d -> layer_norm[C, H, W] -> relu",)),
    CorpusCase("upsample3d_layer_norm_over_w_gelu_scale", lambda: (_UpsampleLayerNormW(), x_of(2, 3, 2, 3, 4)),
               regions=("conv_transpose3d -> layer_norm[W] -> gelu -> mul",)),
    CorpusCase("spectrogram_conv_layer_norm_per_plane",
               lambda: (Then(nn.Conv2d(1, 4, 3, padding=1), lambda y: F.silu(F.layer_norm(y, y.shape[-2:]))),
                        x_of(2, 1, 16, 20)),  # fmt: skip
               regions=("conv2d -> layer_norm[H, W] -> silu",)),
    CorpusCase("conv1d_layer_norm_over_time_no_affine",
               lambda: (nn.Sequential(nn.Conv1d(4, 6, 3), nn.LeakyReLU(0.1), nn.LayerNorm(14, elementwise_affine=False)),
                        x_of(2, 4, 16)),  # fmt: skip
               regions=("conv1d -> leaky_relu -> layer_norm[L]",)),
    # near misses
    CorpusCase("positional_table_before_the_norm", lambda: (_PositionalBeforeNorm(), x_of(2, 3, 12, 12)),
               near_misses=(("conv_layer_norm", "unsupported_operand", "per-channel tensors"),
                            ("conv_epilogue", "unsupported_operand", "per-channel tensors"))),
    CorpusCase("conv_output_also_returned",
               lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: (F.layer_norm(y, y.shape[1:]), y)), x_of(2, 3, 9, 9)),
               near_misses=(("conv_layer_norm", "shared_intermediate", "read again outside the chain (by `layer_norm`, the graph output)"),
                            ("conv_epilogue", "shared_intermediate", "is used by `layer_norm`"))),
]
