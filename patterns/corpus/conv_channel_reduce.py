"""Corpus of ``conv_channel_reduce``: heads that reduce a conv's channels (segmentation softmax,
per-pixel min / max / logsumexp), and the near misses the family reports."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CorpusCase, Then, x_of


def _max_and_argmax(y: torch.Tensor) -> torch.Tensor:
    values, indices = torch.max(y, dim=1)
    return values + indices


CASES = [
    CorpusCase("segmentation_softmax", lambda: (nn.Sequential(nn.Conv2d(8, 5, 1), nn.Softmax(dim=1)), x_of(2, 8, 12, 12)),
               regions=("conv2d -> softmax(dim=1)",)),
    CorpusCase("volumetric_softmax_scaled", lambda: (Then(nn.Conv3d(4, 6, 3), lambda y: torch.softmax(y, dim=1) * 2.0),
                                                     x_of(1, 4, 6, 6, 6)),  # fmt: skip
               regions=("conv3d -> softmax(dim=1) -> mul",)),
    CorpusCase("speech_log_softmax", lambda: (nn.Sequential(nn.Conv1d(8, 16, 3), nn.LogSoftmax(dim=1)), x_of(2, 8, 20)),
               regions=("conv1d -> log_softmax(dim=1)",)),
    CorpusCase("channel_min_tanh",
               lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: torch.tanh(torch.amin(y, dim=1, keepdim=True))), x_of(2, 3, 12, 12)),
               regions=("conv2d -> amin(dim=1, keepdim) -> tanh",)),
    CorpusCase("relu_logsumexp", lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: torch.logsumexp(F.relu(y), 1)), x_of(2, 3, 9, 9)),
               regions=("conv2d -> relu -> logsumexp(dim=1)",)),
    CorpusCase("max_values_negative_dim",
               lambda: (Then(nn.ConvTranspose2d(4, 8, 2, 2), lambda y: torch.max(y, dim=-3)[0]), x_of(2, 4, 6, 6)),
               regions=("conv_transpose2d -> max(dim=1)",)),
    # near misses
    CorpusCase("max_with_its_indices", lambda: (Then(nn.Conv2d(3, 8, 3), _max_and_argmax), x_of(2, 3, 9, 9)),
               near_misses=(("conv_channel_reduce", "unsupported_op", "only its values fuse"),
                            ("conv_epilogue", "unsupported_op", "a max over dim 1"))),
    CorpusCase("softmax_with_dtype", lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: F.softmax(y, 1, dtype=torch.float64)),
                                              x_of(2, 3, 9, 9)),  # fmt: skip
               near_misses=(("conv_channel_reduce", "unsupported_argument", "dtype="),
                            ("conv_epilogue", "unsupported_op", "a softmax over dim 1"))),
    CorpusCase("amax_over_space", lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: torch.relu(y).amax(dim=(2, 3))),
                                           x_of(2, 3, 9, 9)),  # fmt: skip
               regions=("conv2d -> relu",),
               near_misses=(("conv_channel_reduce", "dimension_mismatch", "only a reduction over the channels"),
                            ("conv_epilogue", "unsupported_op", "is not a fusible pointwise op"))),
    CorpusCase("two_reductions", lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: torch.softmax(y, 1).amax(1)), x_of(2, 3, 9, 9)),
               regions=("conv2d -> softmax(dim=1)",),
               near_misses=(("conv_channel_reduce", "unsupported_op", "a second reduction"),)),
]
