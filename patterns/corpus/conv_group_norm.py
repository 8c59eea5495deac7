"""Corpus of ``conv_group_norm``: decoder and UNet blocks that normalise a conv's output per group of
channels (or per channel), and the near misses the family reports."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from . import CorpusCase, Then, x_of

CASES = [
    CorpusCase("decoder_upsample_group_norm_silu",
               lambda: (nn.Sequential(nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1), nn.GroupNorm(2, 4), nn.SiLU()),
                        x_of(2, 8, 6, 6)),  # fmt: skip
               regions=("conv_transpose2d -> group_norm(2) -> silu",)),
    CorpusCase("unet_block_group_norm", lambda: (nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.SiLU()),
                                                 x_of(2, 3, 12, 12)),  # fmt: skip
               regions=("conv2d -> group_norm(2) -> silu",)),
    CorpusCase("style_transfer_instance_norm_relu",
               lambda: (nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8, affine=True), nn.ReLU()), x_of(2, 3, 9, 9)),
               regions=("conv2d -> instance_norm -> relu",)),
    CorpusCase("volumetric_instance_norm_leaky",
               lambda: (nn.Sequential(nn.Conv3d(2, 4, 3), nn.InstanceNorm3d(4), nn.LeakyReLU(0.2)), x_of(1, 2, 5, 6, 6)),
               regions=("conv3d -> instance_norm -> leaky_relu",)),
    CorpusCase("encoder_block_group_norm_silu_max_pool",
               lambda: (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.MaxPool2d(2)),
                        x_of(2, 3, 10, 10)),  # fmt: skip
               regions=("conv2d -> group_norm(2) -> silu -> max_pool2d",)),
    # near misses
    CorpusCase("instance_norm_with_running_statistics",
               lambda: (nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8, track_running_stats=True)), x_of(2, 3, 9, 9)),
               near_misses=(("conv_group_norm", "unsupported_argument", "running statistics"),
                            ("conv_epilogue", "unsupported_op", "the conv_group_norm family's"))),
    CorpusCase("conv_output_also_returned",
               lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: (F.group_norm(y, 4), y)), x_of(2, 3, 9, 9)),
               near_misses=(("conv_group_norm", "shared_intermediate", "read again outside the chain (by `group_norm`, the graph output)"),
                            ("conv_epilogue", "shared_intermediate", "is used by `group_norm`"))),
    CorpusCase("pooled_value_also_returned",
               lambda: (Then(nn.Conv2d(3, 8, 3), lambda y: (lambda z: (F.avg_pool2d(z, 2), z))(F.silu(F.group_norm(y, 2)))),
                        x_of(2, 3, 9, 9)),  # fmt: skip
               regions=("conv2d -> group_norm(2) -> silu",),
               near_misses=(("conv_group_norm", "shared_intermediate", "a pool whose input is read elsewhere"),)),
]
