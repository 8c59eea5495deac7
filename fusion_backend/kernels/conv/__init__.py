"""The conv kernel family: ONE Triton implicit-GEMM convolution, specialised by constexprs, whose load
applies the previous layer's normalisation and activation (the *prologue*) and whose store applies the
bias, activation and residual and produces the next normalisation's statistics (the *epilogue*).

Why a family: in a conv network most of the time outside the convs is normalisation, activation and
residual passes over the conv outputs (ResNet-50 training under CUDA graphs on the H200: 6.0 of 10.9 ms
per step in Inductor's Triton kernels for BatchNorm, ReLU, residual adds and pooling, 4.7 ms in the
convs).  A conv that reads
``relu(y * scale + shift)`` while loading ``y``, and writes its own output's per-channel sums while
storing it, removes those passes: the normalised activation never exists in memory.

Modules (one responsibility each):

* ``hooks``     the host descriptions of the hooks (prologue kinds, activations, residual placement),
                their constexpr codes and their contract checks;
* ``tiles``     ``TileConfig`` (block sizes, warps, stages, K walk) and the heuristic picking one;
* ``prologue``  device: the A tile of the implicit GEMM, gathered with the prologue applied;
* ``epilogue``  device: bias, activation, residual, store, per-tile statistics;
* ``stats``     the statistics' host reduction (deterministic) and ``ChannelStats``;
* ``fprop``     the forward kernel and its launcher ``conv_fprop``;
* ``dgrad``     the input gradient (also a transposed conv's forward) and ``conv_dgrad``;
* ``grad_epilogue`` device: dgrad's store with the backward hooks (act', BatchNorm-backward sums);
* ``wgrad``     the weight gradient, the forward's prologue recomputed on load, and ``conv_wgrad``;
* ``reference`` the same computation in plain torch (the tests' truth and yardstick).

Status: forward, input and weight gradients, correct on CPU under Triton's interpreter; not wired into any
fused op.
"""

from .dgrad import conv_dgrad
from .fprop import conv_fprop
from .hooks import Activation, ChannelAffine, GroupAffine, NormStats, SampleChannelScale
from .stats import BatchNormGradSums, ChannelStats
from .tiles import TileConfig, pick_tile
from .wgrad import conv_wgrad

__all__ = [
    "Activation",
    "BatchNormGradSums",
    "ChannelAffine",
    "ChannelStats",
    "GroupAffine",
    "NormStats",
    "SampleChannelScale",
    "TileConfig",
    "conv_dgrad",
    "conv_fprop",
    "conv_wgrad",
    "pick_tile",
]
