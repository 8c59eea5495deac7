"""Vocabulary shared by the tests of the conv family's Gluon kernels: the marker of the machines they run
on, and the TMA row kernel's (``kernels/conv/tma_fprop.py``: a 1x1 conv's forward and input gradient)
tiles and the shapes both its passes are checked on."""

import pytest
import torch

from fusion_backend.kernels.conv import TileConfig

#: Gluon has no interpreter: the kernels run on sm_90 alone (the CPU suite compiles it:
#: ``test_conv_family_sm90.py``).
requires_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the Gluon TMA kernels run on sm_90 alone (no interpreter)",
)

#: Tiles of every shape the kernel takes: one warpgroup (over 64 and over 128 channels, and over 128 rows
#: of 128 channels), a 4-stage ring with K steps of 32, two warpgroups over 128 and over 256 channels,
#: and warps side by side along N (64 rows on 8 warps, 16-channel K steps).
TMA_ROW_TILES = [
    TileConfig(64, 64, 64, 4, 2, tma=True),
    TileConfig(128, 64, 32, 4, 4, tma=True),
    TileConfig(128, 128, 64, 8, 3, tma=True),
    TileConfig(128, 128, 64, 4, 2, tma=True),
    TileConfig(128, 256, 64, 8, 2, tma=True),
    TileConfig(64, 128, 64, 4, 3, tma=True),
    TileConfig(64, 32, 16, 8, 2, tma=True),
]

#: name, the forward input's shape, its output channels: rows that fill no tile; channels that fill no
#: K step or N tile of either pass (72 and 40 against 64 and 32; 256 and 200), a K step narrower than the
#: tile (24 channels), 1-d and 3-d.
TMA_1X1_SHAPES = [
    ("2d-tails", (3, 72, 7, 9), 40),
    ("2d-wide", (2, 256, 9, 8), 200),
    ("1d-narrow-k", (3, 24, 50), 48),
    ("3d", (2, 16, 3, 5, 7), 24),
]

#: name, the forward input's shape, its output channels, the stride: the TMA forward's strided boxes
#: (``tma_fprop.StridedRows``) where rows run on across samples (a 2-d height twice the output's), where
#: a sample's rows end its plane and boxes hang past it (odd sizes, two strides), 1-d and 3-d; channels that
#: fill no K step or N tile.
TMA_STRIDED_1X1_SHAPES = [
    ("2d-even", (3, 72, 14, 12), 40, 2),
    ("2d-odd", (2, 48, 9, 11), 24, 2),
    ("2d-3x2", (2, 32, 10, 9), 72, (3, 2)),
    ("1d", (3, 24, 50), 48, 2),
    ("3d", (2, 16, 4, 6, 7), 24, 2),
]
