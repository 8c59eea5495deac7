"""Corpus of ``conv_batch_norm``: conv layers of networks trained from scratch, each normalised by a
batch norm in training mode, and the near misses the family reports."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from . import CorpusCase, Then, x_of

CASES = [
    CorpusCase("resnet_basic_block_conv_bn_relu",
               lambda: (nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()).train(),
                        x_of(2, 8, 6, 6)),  # fmt: skip
               regions=("conv2d -> batch_norm(train) -> relu",)),
    CorpusCase("temporal_conv1d_bn_gelu",
               lambda: (nn.Sequential(nn.Conv1d(4, 8, 5), nn.BatchNorm1d(8, momentum=0.01), nn.GELU()).train(),
                        x_of(2, 4, 20)),  # fmt: skip
               regions=("conv1d -> batch_norm(train) -> gelu",)),
    CorpusCase("unet_upsample_bn_without_running_statistics",
               lambda: (nn.Sequential(nn.ConvTranspose2d(8, 4, 2, stride=2), nn.BatchNorm2d(4, track_running_stats=False),
                                      nn.LeakyReLU(0.1)), x_of(2, 8, 4, 4)),  # fmt: skip
               regions=("conv_transpose2d -> batch_norm(train) -> leaky_relu",)),
    CorpusCase("resnet_stem_in_training",
               lambda: (nn.Sequential(nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.MaxPool2d(3, stride=2, padding=1)).train(), x_of(2, 3, 16, 16)),  # fmt: skip
               regions=("conv2d -> batch_norm(train) -> relu -> max_pool2d",)),
    CorpusCase("vgg_style_conv1d_bn_avg_pool",
               lambda: (nn.Sequential(nn.Conv1d(4, 8, 3), nn.BatchNorm1d(8), nn.ReLU(), nn.AvgPool1d(2, ceil_mode=True)).train(),
                        x_of(2, 4, 15)),  # fmt: skip
               regions=("conv1d -> batch_norm(train) -> relu -> avg_pool1d",)),
    # near misses
    CorpusCase("adaptive_pool_after_the_norm",
               lambda: (nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveMaxPool2d(2)).train(),
                        x_of(2, 3, 9, 9)),  # fmt: skip
               regions=("conv2d -> batch_norm(train) -> relu",),
               near_misses=(("conv_batch_norm", "unsupported_op", "is an adaptive pool"),)),
    CorpusCase("sync_batch_norm",
               lambda: (nn.Sequential(nn.Conv2d(3, 8, 3), nn.SyncBatchNorm(8), nn.ReLU()).train(), x_of(2, 3, 9, 9)),
               near_misses=(("conv_batch_norm", "unsupported_op", "SyncBatchNorm"),
                            ("conv_epilogue", "unsupported_op", "the conv_batch_norm family's"))),
    CorpusCase("conv_output_also_returned",
               lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: (F.batch_norm(y, None, None, training=True), y)),
                        x_of(2, 3, 9, 9)),  # fmt: skip
               near_misses=(("conv_batch_norm", "shared_intermediate", "is used by `batch_norm`"),
                            ("conv_epilogue", "unsupported_op", "the conv_batch_norm family's"))),
]
