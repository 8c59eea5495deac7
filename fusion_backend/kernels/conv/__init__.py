"""The conv kernel family: ONE Triton implicit-GEMM convolution, specialised by constexprs, whose load
applies the previous layer's normalisation and activation (the *prologue*) and whose store applies the
bias, the pointwise chain, activation and residual and produces the next normalisation's statistics
(the *epilogue*).

Why a family: in a conv network most of the time outside the convs is normalisation, activation and
residual passes over the conv outputs (more than half of a ResNet-50 training step's GPU time,
``docs/perf/RESULTS.md``).  A conv that reads ``relu(y * scale + shift)`` while loading ``y``, and writes
its own output's per-channel sums while storing it, removes those passes: the normalised activation
never exists in memory.

Modules (one responsibility each):

* ``hooks``     the host descriptions of the hooks (prologue kinds, activations, residual placement),
                their constexpr codes and their contract checks;
* ``tiles``     ``TileConfig`` (block sizes, warps, stages, K walk), the heuristic picking one, and
                the timed choice among a few candidates per call signature (cached on disk);
* ``prologue``  device: the A tile of the implicit GEMM, gathered with the prologue applied;
* ``epilogue``  device: bias, the pointwise chain, activation, residual, store, per-tile statistics;
* ``stats``     the statistics' reduction of the store's partials (one or two launches, deterministic),
                ``ChannelStats`` (BatchNorm's) and ``GroupStats`` (GroupNorm's);
* ``split_sum`` float64 sums of partials over their splits or tiles, in a fixed order (the weight
                gradient's split-K, the input gradient's BatchNorm-backward sums);
* ``fprop``     the forward kernel, its launcher ``conv_fprop`` and its plan ``fprop_plan``;
* ``tma_fprop`` a 1x1 conv's forward and input gradient on sm_90 in Gluon (one GEMM, the channels
                exchanged): TMA boxes, the forward's prologue in wgmma's register layout, the gather
                kernels' stores; a tile kind of both passes (``TileConfig.tma``);
* ``dgrad``     the input gradient (also a transposed conv's forward) and ``conv_dgrad``;
* ``grad_epilogue`` device: dgrad's store with the backward hooks (act', BatchNorm-backward sums);
* ``wgrad``     the weight gradient, the forward's prologue recomputed on load, and ``conv_wgrad``;
* ``tma_wgrad`` the weight gradient on sm_90 in Gluon: TMA boxes of the output and input planes,
                ``wgmma`` on them as they landed, the same partials and split sum; a tile kind of the
                weight gradient (``TileConfig.tma`` with a box);
* ``reference`` the same computation in plain torch (the tests' truth and yardstick).

Status: forward, input and weight gradients, correct against float64 on CPU under Triton's interpreter
and on the H200 (fp32, fp16, bf16); the forward near cuDNN's speed, the gradients behind it
(``docs/perf/h200/conv-kernels``).  Each pass may also load its tiles as boxes through tensor
descriptors (``tiles`` module docstring), a candidate of the timed tile choice, checked on CPU and by
the sm_90 compile, not yet timed on a GPU.  Used by ``fusion::conv_epilogue``'s forward for calls that save
nothing (inference), where it measures faster than its other paths (``ops/conv_epilogue/forward.py``,
``FamilyForward``), as the plain conv of the fused ops' library paths in such calls where it measures
faster than cuDNN's (``ops/library_conv.py``, ``ConvAlone``), and by ``fusion::conv_batch_norm``'s forward for its conv and the output's
statistics under ``FUSION_CONV_IMPL=family`` (``ops/conv_batch_norm/statistics.py``), and by
``fusion::batch_norm_conv`` in all three passes (a training BatchNorm and its activation applied as the
conv loads its input, the backward hooks in its gradients), each pass timed against cuDNN's with the
norm's own passes (``ops/batch_norm_conv/triton_path.py``).
"""

from .dgrad import conv_dgrad
from .fprop import FpropCall, conv_fprop, fprop_plan
from .hooks import Activation, ChannelAffine, GroupAffine, NormStats, SampleChannelScale
from .stats import BatchNormForm, BatchNormGradSums, ChannelStats, GroupStats
from .tiles import TileConfig, pick_tile
from .wgrad import conv_wgrad

__all__ = [
    "Activation",
    "BatchNormForm",
    "BatchNormGradSums",
    "ChannelAffine",
    "ChannelStats",
    "FpropCall",
    "GroupAffine",
    "GroupStats",
    "NormStats",
    "SampleChannelScale",
    "TileConfig",
    "conv_dgrad",
    "conv_fprop",
    "conv_wgrad",
    "fprop_plan",
    "pick_tile",
]
