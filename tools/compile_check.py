"""Compile the project's Triton kernels for sm_90a (H100) without a GPU: catches GPU-only compile errors.

    python tools/compile_check.py [KERNEL ...] [--quick] [--cases [KERNEL:]CASE,...] [--kernels NAME,...]
        [--sass] [--dump-sass DIR] [--verbose]
        [--tiles T;...] [--dgrad-tiles T;...] [--wgrad-tiles T;...]

KERNEL (a job; none: all): ``conv_fused``, ``conv_dense``, ``conv_fused_bwd``, ``conv_phase_aligned_bwd``,
``conv_family``, ``conv_halo``, ``conv_tma``, ``conv_tma_wgrad``, ``epilogue``, ``global_mean``, ``channel_reduce``, ``group_norm``, ``batch_norm``, ``layer_norm``.  A kernel that runs under the interpreter (the CPU tests) can still fail to
compile for the GPU; on ``conv_global_mean``'s default path such a kernel makes the op fall back to
the slow torch reference (with one warning).  Run this after every change to a kernel.

How: per case, the real launchers run on empty CPU tensors of the full shapes (never read) while
every kernel launch is recorded instead of run (``tools/kernel_compile.py``).  Each recorded launch
goes through Triton's own argument binder and ``_pack_args`` (the code a real launch runs), so the
signature, the constexprs and the divisibility attributes are exactly the ones a CUDA launch
compiles; then Triton -> PTX -> cubin for sm_90a, and Triton's bundled ``ptxas-blackwell -v``
reports registers and spill stores, besides shared memory and whether ``wgmma`` appears in the PTX,
and its ``wgmma`` pipeline advisories (``wgmma_advice=C7517x1``: a ``warpgroup.wait`` ptxas injected, or
C7515, ``wgmma`` serialised; MMAs the kernel meant to keep in flight then run synchronously).
A job's tiled kernel is compiled for every tile of its list that fits the launch (only the first
with ``--quick``): ``conv_fused`` / ``conv_dense``: the tiles their ``_prune`` keeps (what the
autotuner times); ``conv_fused_bwd``: every config of ``_dgrad_configs`` / ``_wgrad_configs``;
``conv_phase_aligned_bwd``: ``DGRAD_TILES`` / ``WGRAD_TILES`` clamped to the problem (``fit_tiles``).  Other
kernels are compiled as launched.  A specialisation already compiled in the run is not compiled
again (its line names the case that compiled it).  Environment: ``TRITON_INTERPRET`` is removed
before the kernels are imported, ``FUSION_CONV_AUTOTUNE=0`` (the launchers take their heuristic
tile at once), ``TRITON_DEFAULT_FP_FUSION=1`` unless set; split counts are an H100's (132 SMs).
Compiles go through Triton's cache (``TRITON_CACHE_DIR``): a specialisation compiled by an earlier
run prints a cache hit's seconds.

Jobs and cases (``--cases``: each listed case must belong to every named job; ``KERNEL:CASE`` is a case of
that job alone, e.g. ``conv_family epilogue --cases conv_family:resnet_3x3-bf16,epilogue:none-fp32``
compiles both jobs in one process; a named job without a case of its own keeps its defaults):

* ``conv_fused``: ``fusion::conv_epilogue``'s Triton forward (``ops.conv_epilogue.forward.
  _fused_conv_forward``) on the ``seeds`` suite's ConvTranspose3d 16->32 k3 s2 + leaky_relu -> mul
  -> leaky_relu + MaxPool3d(2) over (16, 16, 16, 32, 32) (``convt3d``), or the same with 48 input
  channels (``convt3d_wide``: PHASE_ALIGNED with several channel blocks): ``conv_fused_fwd_kernel`` and,
  with one channel block, the weight-matrix kernel.  Dtypes ``fp32`` (TF32), ``bf16``, ``amp`` (fp32 tensors, bf16
  compute: autocast's casts absorbed into the loaders); ``-save``: the training forward (writes the
  backward state).  Cases ``{convt3d,convt3d_wide}-{fp32,bf16,amp}[-save]``; default
  ``convt3d-{fp32,bf16,amp}-save``.
* ``conv_dense``: the same forward on the ``seeds`` suite's Conv2d(64, 64, 3) + mul -> leaky_relu ->
  gelu over (64, 64, 256, 256), no pool (which the op sends to ``conv_dense``): the weight
  prearrangement and ``_conv_dense_fwd_kernel``.  Cases ``conv2d-{fp32,bf16,amp}[-save]``; default
  all six.
* ``conv_fused_bwd``: ``dgrad_kernel`` and ``wgrad_kernel`` (``plan._input_grad`` / ``plan._weight_grad``)
  for ``convt3d`` (the ConvTranspose3d above, p1 op1, behind MaxPool3d(2): the pooled gradient),
  ``conv2d`` (the Conv2d above: a dense gradient) and ``conv2d_narrow`` (that Conv2d over (64, 64,
  256, 20): its 18-wide output rows take the weight grad's flat ``LINE_MODE=False`` path); ``fp32``
  (TF32) or ``bf16``; ``-cl``: channels-last.  Cases ``{convt3d,conv2d,conv2d_narrow}-{fp32,bf16}
  [-cl]``; default ``convt3d-fp32``, ``conv2d-fp32``, ``conv2d-fp32-cl``, ``conv2d_narrow-fp32-cl``.
* ``conv_phase_aligned_bwd``: ``phase_aligned_dgrad_kernel``, ``phase_aligned_wgrad_kernel`` and the finish kernel
  (weight-grad partials -> taps) for ``convt3d`` (as above, its MaxPool3d(2) gradient in implicit form
  with an fp32 ``g_win``); ``fp32`` (TF32), ``bf16``, ``fp16``; ``-cl``: channels-last.  Cases
  ``convt3d-{fp32,bf16,fp16}[-cl]``; default ``convt3d-fp32``, ``convt3d-bf16``.
* ``conv_family``: ``kernels/conv/``'s ``conv_fprop_kernel``, ``conv_dgrad_kernel`` and ``conv_wgrad_kernel``
  through their launchers, with the tile ``pick_tile`` picks (the launchers refuse CPU tensors, bf16 and
  TF32 outside a GPU: ``_launchable_on_cpu_tensors`` lifts that for the recording), on ResNet-50's
  bottleneck 1x1 and 3x3, layer2's strided 3x3 and the 7x7 stem (batch 64), an EfficientNet-B0 depthwise
  3x3 and the SD VAE decoder's 512-channel 3x3 (``CONV_FAMILY_SHAPES``); ``bf16`` or ``fp32`` (TF32);
  ``-hooked``: a BatchNorm + ReLU's hooks (prologue, relu, output statistics, and GroupNorm's
  statistics where 32 divides the output channels; relu' and the BatchNorm-backward sums; the prologue
  recomputed in wgrad).  Cases ``{resnet_1x1,resnet_3x3,resnet_3x3_s2,resnet_stem,depthwise,vae_3x3}-
  {bf16,fp32}[-hooked][-box|-taps]`` (``-box``: the input and weight gradients load boxes, the stride-1
  shapes alone; the forward has no box path; ``-taps``: the weight gradient's several-taps tiles the
  timed choice weighs, then its first tile on 8 warps with 1 and with 3 taps per program, the 3-wide
  kernels with more than one channel per group); default six of them.
* ``conv_halo``: ``kernels/conv/halo.py``'s ``conv_fprop_halo_kernel`` through ``conv_fprop`` with the
  halo's wide and short tiles (``tiles.halo_tiles``; the depthwise path's tile on the depthwise shape),
  each flat and as box tiles, then, on the
  depthwise shape, ``conv_wgrad_kernel`` with its halo
  (the tile the timed choice weighs), on ``conv_family``'s 'same' stride-1 3x3 shapes (ResNet-50's of 64
  channels, the SD VAE's of 512, an EfficientNet-B0 depthwise of 144: its halo over the direct tile's
  channels); ``bf16`` or ``fp32``; ``-hooked``: the BatchNorm + ReLU prologue and the output statistics.
  Cases ``{resnet_3x3,vae_3x3,depthwise_s1}-{bf16,fp32}[-hooked]``; the bf16 hooked three by default.
* ``conv_tma``: ``kernels/conv/tma_fprop.py``'s ``tma_fprop_kernel`` (Gluon) through ``conv_fprop`` with
  each of the TMA forward's tiles (``tiles.tma_tiles``), on ``conv_family``'s 1x1 shapes, ``bf16``;
  ``-hooked``: a BatchNorm + ReLU between convs (the prologue, relu on load and the output statistics,
  no saved raw conv; at stride 2 the forward's strided boxes); then the same kernel as the input gradient
  (``GRAD``; at stride 2 its results at the stride and zeros between) through ``conv_dgrad`` with each of
  its tiles (``-hooked``: relu' and the BatchNorm-backward sums).  Cases
  ``{resnet_1x1,resnet_1x1_s2}-bf16[-hooked]``, all four by default.
* ``conv_tma_wgrad``: ``kernels/conv/tma_wgrad.py``'s ``tma_wgrad_kernel`` (Gluon) through ``conv_wgrad``
  with each of its tiles (``tiles.tma_wgrad_tiles``), then its first with one split (the gradient written
  by the programs themselves, ``DIRECT``) and with three, on ``conv_family``'s stride-1 shapes, ``bf16``
  (``resnet_3x3_14``: boxes past the plane, read through clipped descriptors); ``-hooked``: the BatchNorm
  + ReLU prologue recomputed (and the bias gradient where the conv has a bias).  Cases
  ``{resnet_1x1,resnet_3x3,resnet_3x3_14,vae_3x3}-bf16[-hooked]``, ResNet-50's six by default.
* ``epilogue``: ``kernels/epilogue.py``'s forward and backward kernels (the library path's epilogue) on
  the ``seeds`` Conv2d's output with a chain that reads earlier values again (``EPILOGUE_CHAIN``), no
  pool, a max or an avg pool; ``fp32``, ``bf16``.  Cases ``{none,max,avg}-{fp32,bf16}``, all by default.
  In this job a spill fails the compile.
* ``global_mean``: every CUDA-path kernel of ``kernels/global_mean/``: the launchers
  ``set_sums_partial``, ``contract_forward``, ``params_backward`` and ``grad_broadcast`` called as
  the op does for the ``seeds`` suite's global-mean pipeline (x (16, 64, 512, 512), ConvTranspose2d
  64->128 k3, the folded ``+ bias`` operand: ``convt2d``), in ``fp32`` and ``bf16`` (fp32 output as
  under autocast), and for a padded grouped Conv2d without bias, off that pipeline's path
  (``conv2d_padded``, fp32: 3 index sets per dim, the other constexpr branches); ``-cl``:
  channels-last x.  Default: all six cases.  In this job a spill fails the compile.
* ``channel_reduce``: ``kernels/channel_reduce.py``'s forward (saving the backward's state) and
  backward on the ``families`` demos' conv outputs (``min_tanh``: Conv2d 64->128 over (64, 64, 128,
  128) -> min over the channels -> tanh; ``softmax_mul``: Conv3d 16->32 over (8, 16, 32, 64, 64) ->
  softmax -> x2) and on 512 channels with both chains (``wide_min``, ``wide_softmax``: the two-pass
  channel loop); ``fp32``, ``bf16``.  Cases ``{min_tanh,softmax_mul,wide_min,wide_softmax}-{fp32,bf16}``,
  all by default.
* ``group_norm``: ``kernels/group_norm.py``'s forward (saving the statistics) and backward (every
  gradient wanted) on the ``families`` GroupNorm demo's conv output (``decoder``: ConvTranspose2d
  64->32 over (16, 64, 64, 64) -> GroupNorm(8) -> SiLU), on an instance norm with both chains over a
  channels-last (8, 96, 80, 80) (``instance_cl``), on 64 channels per group (``wide_groups``: the
  channel-block loop), all three with their groups split into chunks (the partial kernels and the
  combining ones), and on groups of 2 x 256 elements with both chains (``small_groups``: one chunk
  per group, the one-launch kernels), and on the SD VAE decoder's largest GroupNorm input, channels-last
  (1, 128, 512, 512) with groups of 4 channels and SiLU (``vae_cl``: the channels-last kernels); with a pool after the post-chain, the statistics pass alone,
  ``kernels/norm_pool.py``'s pooled normalise pass and the pooled backward: the demo with a 3x3 max
  pool of stride 2 and padding 1 (``decoder_max_pool``), the instance norm with a 2x2 avg pool in
  ceil_mode without the padding (``instance_cl_avg_pool``); ``fp32``, ``bf16``.  Cases
  ``{decoder,instance_cl,wide_groups,small_groups,vae_cl,decoder_max_pool,instance_cl_avg_pool}-{fp32,bf16}``,
  all by default.
* ``batch_norm``: ``kernels/batch_norm.py``'s statistics and normalisation kernels and both backward
  kernels (every gradient wanted) on the ``families`` BatchNorm-training demo's conv output
  (``bench``: Conv2d 64->64 over (32, 64, 128, 128) -> BatchNorm2d -> ReLU), the same channels-last
  (``bench_cl``) and a Conv3d output with a chain of operands (``conv3d_chain``: (4, 48, 16, 32, 32));
  with a pool after the chain, ``kernels/norm_pool.py``'s pooled normalise pass and the pooled
  backward on a channels-last conv output (the op's library conv runs channels-last), the result in
  the workload's layout: the ``families`` ResNet-stem-in-training demo's conv output, (32, 64, 112,
  112) -> ReLU -> MaxPool2d(3, 2, 1), an NCHW result (``stem``: the transposing tile) or a
  channels-last one (``stem_cl``), and the Conv3d chain with a 2x2x2 avg pool in ceil_mode
  (``conv3d_avg_pool``); ``fp32``, ``bf16``.  Cases
  ``{bench,bench_cl,conv3d_chain,stem,stem_cl,conv3d_avg_pool}-{fp32,bf16}``, all by default.
* ``layer_norm``: ``kernels/layer_norm.py``'s forward (saving the statistics) and backward (every
  gradient wanted) on the ``families`` LayerNorm demo's conv output (``bench``: Conv2d 64->64 over (32,
  64, 64, 64) -> LayerNorm([C, H, W]) -> ReLU: walking sample rows split into chunks), the same
  channels-last (``bench_cl``), a ConvTranspose3d output normalised over W alone (``w_rows``: (16, 64,
  32, 64, 64) -> LayerNorm(W) -> GELU -> x scale: the packed kernels), the same channels-last
  (``w_rows_cl``: channels-fast, rows-last tiles), and rows of (H, W) too long to pack with both chains
  (``hw_rows``: (8, 32, 96, 96), walking rows of one channel); ``fp32``, ``bf16``.  Cases
  ``{bench,bench_cl,w_rows,w_rows_cl,hw_rows}-{fp32,bf16}``, all by default.

Options for some jobs only (given for another job: an error): ``--tiles 'M,N,K,warps,stages;...'``
(``conv_fused``) or ``'M,K,warps,stages;...'`` (``conv_dense``; N is the conv's); ``--dgrad-tiles``
/ ``--wgrad-tiles``: ``'M,CI,CO,KPB,warps,stages;...'`` (``conv_phase_aligned_bwd``), ``'M,warps,stages'`` /
``'warps,stages'`` (``conv_fused_bwd``): these tiles instead of the kernel's list.

``--kernels dgrad,finish``: only the recorded kernels whose name contains one of the words.
``--verbose``: each specialisation's ``ASTSource`` signature and constexprs.  A tuple parameter's
signature entry is a tuple of per-element types, e.g. ``ops: ('*fp32',)``; an element Triton
specialises (an int equal to 1) is ``'constexpr'`` with its value under ``(arg_index,
element_index)`` in the constexprs; a ``tl.constexpr`` tuple parameter is ``'constexpr'`` with the
whole tuple under ``(arg_index,)``.

``--sass``: disassemble each cubin (bundled ``cuobjdump -sass``) and count its instructions by class
for the whole kernel and for its *main loop*: the innermost loop (a backward branch) holding MMA
instructions, among several the one with the most (conv_fused PHASE_ALIGNED: the shared-X-tile
offsets loop; conv_phase_aligned_bwd: the weight grad's loop over unit rows, the input grad's loop over live
offset blocks).  Printed for the main loop: ``instr/MMA`` (instructions per MMA instruction, the
headline static cost proxy; compare like with like: an fp32/TF32 HGMMA has K=8, a bf16 one K=16,
and the HGMMA shape follows the tile), the six most frequent opcodes, and per job:
``thread-instr/output`` (conv_fused, conv_dense: ``loop * 32 * warps / (BLOCK_M * BLOCK_N)``, thread
instructions per conv-output element of one iteration); ``instr/row`` (per unit row of BLOCK_M) and
``warp-instr/kMAC`` (conv_phase_aligned_bwd: the loop's instructions times the CTA's warps per 1000
multiply-adds of one iteration, comparable across tiles; an H100 SM issues 4 warp-instructions per
clock and runs ~1000 TF32 / ~2000 bf16 dense MACs per clock).  Static counts: predicated-off
instructions and latencies are not modelled.  ``--dump-sass DIR`` (implies ``--sass``) writes each
specialisation's SASS listing and cubin to DIR as ``<job>_<case>_<kernel>_<tile>.{sass,cubin}``;
the environment variables ``KEEP_PTX=DIR`` / ``KEEP_TTGIR=DIR`` do the same with its PTX / TTGIR
(layouts).

Exit status 1 when a case or a compile failed (ptxas included; a kernel asking for more shared memory
than an sm_90 block has, ``SM90_MAX_SHARED``; in ``global_mean``, also a spill), else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are decorated
os.environ["FUSION_CONV_AUTOTUNE"] = "0"  # the launchers take the heuristic tile: one recorded launch
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what a launch uses today, without Triton's warning
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernel_compile as kc  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from seed_convs import seed_conv  # noqa: E402

from fusion_backend.ir.specs import ConvSpec, PoolSpec  # noqa: E402
from fusion_backend.kernels import batch_norm as BN  # noqa: E402
from fusion_backend.kernels import channel_reduce as CR  # noqa: E402
from fusion_backend.kernels import conv as FAMILY  # noqa: E402
from fusion_backend.kernels import conv_dense as CD  # noqa: E402
from fusion_backend.kernels import conv_fused as CF  # noqa: E402
from fusion_backend.kernels import conv_fused_bwd as FB  # noqa: E402
from fusion_backend.kernels import conv_phase_aligned_bwd as S  # noqa: E402
from fusion_backend.kernels import epilogue as EP  # noqa: E402
from fusion_backend.kernels import global_mean as GM  # noqa: E402
from fusion_backend.kernels import group_norm as GN  # noqa: E402
from fusion_backend.kernels import layer_norm as LN  # noqa: E402
from fusion_backend.kernels import norm_pool as NP  # noqa: E402
from fusion_backend.kernels import tf32 as TF32  # noqa: E402
from fusion_backend.kernels.chain_math import OP_CODES  # noqa: E402
from fusion_backend.kernels.conv import fprop as FAMILY_FPROP  # noqa: E402
from fusion_backend.kernels.conv import tiles as FAMILY_TILES  # noqa: E402
from fusion_backend.kernels.conv import tma_fprop as FAMILY_TMA  # noqa: E402
from fusion_backend.kernels.conv import tma_wgrad as FAMILY_TMA_WGRAD  # noqa: E402
from fusion_backend.ops import chain_lowering, conv_io  # noqa: E402
from fusion_backend.ops import conv_epilogue as ce  # noqa: E402
from fusion_backend.ops import conv_global_mean as cgm  # noqa: E402
from fusion_backend.ops.chain import ChainStep, ChainValue, Const, PointwiseKind, TensorRef  # noqa: E402
from fusion_backend.ops.config import ConvEpilogueConfig  # noqa: E402

H100_SMS = 132
#: Shared memory one block may use on sm_90 (227 KiB); a kernel asking for more compiles but cannot launch.
SM90_MAX_SHARED = 232448

# --------------------------------------------------------------------------------------------------
# Workloads: each runs the real launchers on empty CPU tensors (under ``kc.recording``)
# --------------------------------------------------------------------------------------------------

#: forward dtype name -> (x and weight dtype, compute dtype)
FORWARD_DTYPES = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "amp": (torch.float32, "bfloat16"),
}
BACKWARD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


#: The epilogue job's chain: mul(m) -> tanh -> add(conv output) -> mul(itself) -> leaky_relu(0.01), a
#: chain that reads earlier values again (codes from ``ops.chain.kernel_code``).
EPILOGUE_CHAIN = (
    ChainStep(PointwiseKind.MUL, (TensorRef(0),)), ChainStep(PointwiseKind.TANH),
    ChainStep(PointwiseKind.ADD, (ChainValue(0),)), ChainStep(PointwiseKind.MUL, (ChainValue(3),)),
    ChainStep(PointwiseKind.LEAKY_RELU, (Const(0.01),)),
)


def epilogue_pass(pool: str, dtype: str) -> None:
    """``kernels/epilogue.py``'s forward (training: saving the backward's state) and backward on the
    ``seeds`` Conv2d's output (64, 64, 254, 254) with ``EPILOGUE_CHAIN`` and no pool, a 2x2 max pool or a
    3x3 stride-2 avg pool."""
    dt = BACKWARD_DTYPES[dtype]
    y = torch.empty(64, 64, 254, 254, dtype=dt)
    spec = {"none": None, "max": PoolSpec("max", (2, 2)), "avg": PoolSpec("avg", (3, 3), (2, 2), (1, 1))}[pool]
    out_shape = y.shape if spec is None else (64, 64, 127, 127)
    cfg = ConvEpilogueConfig(conv=ConvSpec(False, (1, 1), (0, 0), (1, 1), (0, 0), 1), chain=EPILOGUE_CHAIN, pool=spec)
    steps = chain_lowering.kernel_steps(cfg.chain, [torch.ones(64, 1, 1)], y.dim(), 64)
    bias, out = torch.zeros(64, dtype=dt), torch.empty(out_shape, dtype=dt)
    winner = torch.empty(out_shape, dtype=torch.int8) if pool == "max" else None
    winner_y = torch.empty(out_shape, dtype=dt) if pool == "max" else None
    EP.epilogue_forward(y, bias, steps, spec, out, winner, winner_y, torch.empty_like(y) if spec is None else None)
    EP.epilogue_backward(torch.empty(out_shape, dtype=dt), None if pool == "max" else y, winner, winner_y, bias,
                         steps, spec, torch.empty_like(y), [True] + [False] * (len(steps) - 1), True)


#: The channel_reduce job's workloads: conv output shape, reduction, pre-chain, post-chain (the
#: ``families`` demos, and 512 channels with both chains: the two-pass channel loop).
CHANNEL_REDUCE_WORKLOADS = {
    "min_tanh": ((64, 128, 126, 126), "min", (), (ChainStep(PointwiseKind.TANH),)),
    "softmax_mul": ((8, 32, 30, 62, 62), "softmax", (), (ChainStep(PointwiseKind.MUL, (Const(2.0),)),)),
    "wide_min": ((16, 512, 62, 62), "min", EPILOGUE_CHAIN, (ChainStep(PointwiseKind.MUL, (TensorRef(1),)),)),
    "wide_softmax": ((16, 512, 62, 62), "softmax", EPILOGUE_CHAIN, (ChainStep(PointwiseKind.MUL, (TensorRef(1),)),)),
}


def channel_reduce_pass(workload: str, dtype: str) -> None:
    """``kernels/channel_reduce.py``'s forward (saving the backward's state) and backward as
    ``fusion::conv_channel_reduce`` calls them, on ``CHANNEL_REDUCE_WORKLOADS[workload]``; every
    operand gradient wanted."""
    shape, kind, pre, post = CHANNEL_REDUCE_WORKLOADS[workload]
    dt = BACKWARD_DTYPES[dtype]
    n, c, *spatial = shape
    y = torch.empty(shape, dtype=dt)
    full = kind in ("softmax", "log_softmax")
    columns = c if full else 1
    operands = [torch.ones(c, 1, 1), torch.ones(columns, 1, 1)]
    pre_steps = chain_lowering.kernel_steps(pre, operands, y.dim(), c)
    post_steps = chain_lowering.kernel_steps(post, operands, y.dim(), columns)
    bias = torch.zeros(c, dtype=dt)
    params, post_params = EP.build_params(pre_steps, bias, c, y.device), EP.build_params(post_steps, None, columns, y.device)
    out = torch.empty_like(y) if full else torch.empty([n, 1, *spatial], dtype=dt)
    index = torch.empty([n, *spatial], dtype=torch.int16)
    stats = torch.empty([2, n, *spatial], dtype=torch.float32)
    CR.channel_reduce_forward(y, True, pre_steps, post_steps, kind, params, post_params, out,
                              index if kind in ("min", "max") else None, stats)  # fmt: skip
    CR.channel_reduce_backward(torch.empty_like(out), y, index, stats, True, pre_steps, post_steps, kind, params,
                               post_params, torch.empty_like(y), [True] * len(pre_steps), [True] * len(post_steps))  # fmt: skip


#: The ResNet stem's max pool (3x3, stride 2, padding 1: overlapping windows).
MAX_3_2_1 = PoolSpec("max", (3, 3), (2, 2), (1, 1))
#: The group_norm job's workloads: conv output shape, groups, channels-last, pre-chain, post-chain, pool.
GROUP_NORM_WORKLOADS = {
    "decoder": ((16, 32, 128, 128), 8, False, (), (ChainStep(PointwiseKind.SILU),), None),
    "instance_cl": ((8, 96, 80, 80), 96, True, EPILOGUE_CHAIN, (ChainStep(PointwiseKind.MUL, (TensorRef(1),)),), None),
    "wide_groups": ((4, 256, 40, 40), 4, False, (), (ChainStep(PointwiseKind.SILU),), None),
    "small_groups": ((8, 64, 16, 16), 32, False, EPILOGUE_CHAIN, (ChainStep(PointwiseKind.SILU),), None),
    "vae_cl": ((1, 128, 512, 512), 32, True, (), (ChainStep(PointwiseKind.SILU),), None),
    "decoder_max_pool": ((16, 32, 128, 128), 8, False, (), (ChainStep(PointwiseKind.SILU),), MAX_3_2_1),
    "instance_cl_avg_pool": ((8, 96, 80, 80), 96, True, EPILOGUE_CHAIN, (ChainStep(PointwiseKind.MUL, (TensorRef(1),)),),
                             PoolSpec("avg", (2, 2), ceil_mode=True, count_include_pad=False)),
}


def group_norm_pass(workload: str, dtype: str) -> None:
    """``kernels/group_norm.py``'s forward (saving the statistics) and backward as
    ``fusion::conv_group_norm`` calls them, on ``GROUP_NORM_WORKLOADS[workload]``; every gradient wanted."""
    shape, groups, channels_last, pre, post, pool = GROUP_NORM_WORKLOADS[workload]
    dt = BACKWARD_DTYPES[dtype]
    n, c = shape[:2]
    y = torch.empty(shape, dtype=dt, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    operands = [torch.ones(c, 1, 1), torch.ones(c, 1, 1)]
    pre_steps = chain_lowering.kernel_steps(pre, operands, y.dim(), c)
    post_steps = chain_lowering.kernel_steps(post, operands, y.dim(), c)
    params = EP.build_params(pre_steps, torch.zeros(c, dtype=dt), c, y.device)
    post_params = EP.build_params(post_steps, None, c, y.device)
    affine = torch.empty(2, c, dtype=torch.float32)
    out, stats = torch.empty_like(y), torch.empty(2, n, groups, dtype=torch.float32)
    winner = None
    if pool is not None:  # the statistics pass alone, the pooled normalise pass, the pooled backward
        out, winner = pooled_outputs(y, pool)
    with mock.patch.object(GN, "sm_count", lambda device: H100_SMS):
        if pool is None:
            GN.group_norm_forward(y, True, pre_steps, post_steps, groups, 1e-5, params, post_params, affine, out, stats)
        else:
            GN.group_norm_stats(y, True, pre_steps, groups, 1e-5, params, stats)
            NP.norm_pool_forward(y, True, pre_steps, post_steps, params, post_params, affine, stats, pool, out, winner)
        GN.group_norm_backward(torch.empty_like(out), y, stats, True, pre_steps, post_steps, groups, params,
                               post_params, affine, torch.empty_like(y), [True] * len(pre_steps),
                               [True] * len(post_steps), (True, True), pool=pool, winner=winner)  # fmt: skip


def pooled_outputs(y: torch.Tensor, pool: PoolSpec,
                   fmt: torch.memory_format | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The pooled result in ``fmt`` (default y's layout) and (max pool) its int8 winners in y's layout,
    as the norm families allocate them (``conv_group_norm.common.allocate_result``)."""
    shape = conv_io.pooled_output_shape(y.shape, pool)
    out = torch.empty(shape, dtype=y.dtype, memory_format=fmt or conv_io.output_memory_format(y))
    winner = torch.empty(shape, dtype=torch.int8, memory_format=conv_io.output_memory_format(y))
    return out, winner if pool.kind == "max" else None


#: The batch_norm job's workloads: conv output shape, channels-last, post-chain, pool.
BATCH_NORM_WORKLOADS = {
    "bench": ((32, 64, 128, 128), False, (ChainStep(PointwiseKind.RELU),), None),
    "bench_cl": ((32, 64, 128, 128), True, (ChainStep(PointwiseKind.RELU),), None),
    "conv3d_chain": ((4, 48, 16, 32, 32), False, EPILOGUE_CHAIN, None),
    "stem": ((32, 64, 112, 112), False, (ChainStep(PointwiseKind.RELU),), MAX_3_2_1),
    "stem_cl": ((32, 64, 112, 112), True, (ChainStep(PointwiseKind.RELU),), MAX_3_2_1),
    "conv3d_avg_pool": ((4, 48, 16, 32, 32), False, EPILOGUE_CHAIN, PoolSpec("avg", (2, 2, 2), ceil_mode=True)),
}


def batch_norm_pass(workload: str, dtype: str) -> None:
    """``kernels/batch_norm.py``'s forward and backward as ``fusion::conv_batch_norm`` calls them, on
    ``BATCH_NORM_WORKLOADS[workload]``; every gradient wanted."""
    shape, channels_last, post, pool = BATCH_NORM_WORKLOADS[workload]
    dt = BACKWARD_DTYPES[dtype]
    c = shape[1]
    fmt = (torch.channels_last if len(shape) == 4 else torch.channels_last_3d) if channels_last else torch.contiguous_format
    y = torch.empty(shape, dtype=dt, memory_format=fmt)
    steps = chain_lowering.kernel_steps(post, [torch.ones(c, *[1] * (y.dim() - 2))], y.dim(), c)
    post_params = EP.build_params(steps, None, c, y.device)
    bias, affine, stats = torch.zeros(c, dtype=dt), torch.empty(2, c, dtype=torch.float32), torch.empty(2, c)
    BN.batch_norm_stats(y, bias, 1e-5)
    out, winner = torch.empty_like(y), None
    if pool is None:
        BN.batch_norm_apply(y, bias, steps, post_params, affine, stats, out)
    else:  # the pooled normalise pass (the bias in P's row, no pre-chain) on the conv output as the op has it,
        # channels-last (``library_conv.conv_forward``), writing the result in eager's layout (``fmt``)
        y = y.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
        out, winner = pooled_outputs(y, pool, fmt)
        NP.norm_pool_forward(y, True, [], steps, EP.build_params([], bias, c, y.device), post_params, affine, stats,
                             pool, out, winner)  # fmt: skip
    BN.batch_norm_backward(torch.empty_like(out), y, bias, steps, post_params, affine, stats, torch.empty_like(y),
                           [True] * len(steps), pool, winner)
    if pool is None:  # ``fusion::batch_norm_conv``'s: the norm folded for the next conv, its input gradient
        folded = BN.batch_norm_stats(y, None, 1e-5, fold=(torch.empty(c), torch.empty(c, dtype=dt)))
        sums = torch.empty(2, c, dtype=torch.float64)
        BN.batch_norm_input_grad(torch.empty_like(y), y, folded[5:7], folded, sums[0], sums[1], torch.empty_like(y),
                                 (torch.empty(c), torch.empty(c)))  # fmt: skip


#: The layer_norm job's workloads: conv output shape, normalized dims, channels-last, pre-chain, post-chain.
LAYER_NORM_WORKLOADS = {
    "bench": ((32, 64, 64, 64), 3, False, (), (ChainStep(PointwiseKind.RELU),)),
    "bench_cl": ((32, 64, 64, 64), 3, True, (), (ChainStep(PointwiseKind.RELU),)),
    "w_rows": ((16, 64, 32, 64, 64), 1, False, (), (ChainStep(PointwiseKind.GELU), ChainStep(PointwiseKind.MUL, (TensorRef(1),)))),
    "w_rows_cl": ((16, 64, 32, 64, 64), 1, True, (), (ChainStep(PointwiseKind.GELU), ChainStep(PointwiseKind.MUL, (TensorRef(1),)))),
    "hw_rows": ((8, 32, 96, 96), 2, False, EPILOGUE_CHAIN, (ChainStep(PointwiseKind.MUL, (TensorRef(1),)),)),
}


def layer_norm_pass(workload: str, dtype: str) -> None:
    """``kernels/layer_norm.py``'s forward (saving the statistics) and backward as
    ``fusion::conv_layer_norm`` calls them, on ``LAYER_NORM_WORKLOADS[workload]``; every gradient wanted."""
    shape, dims, channels_last, pre, post = LAYER_NORM_WORKLOADS[workload]
    dt = BACKWARD_DTYPES[dtype]
    c = shape[1]
    fmt = (torch.channels_last if len(shape) == 4 else torch.channels_last_3d) if channels_last else torch.contiguous_format
    y = torch.empty(shape, dtype=dt, memory_format=fmt)
    ones = [torch.ones(c, *[1] * (len(shape) - 2))] * 2
    pre_steps = chain_lowering.kernel_steps(pre, ones, y.dim(), c)
    post_steps = chain_lowering.kernel_steps(post, ones, y.dim(), c)
    params = EP.build_params(pre_steps, torch.zeros(c, dtype=dt), c, y.device)
    post_params = EP.build_params(post_steps, None, c, y.device)
    geo = LN.row_geometry(shape, dims)
    affine = torch.empty(2, geo.elements, dtype=torch.float32)
    out, stats = torch.empty(shape, dtype=dt), torch.empty(2, geo.rows, dtype=torch.float32)
    with mock.patch.object(LN, "sm_count", lambda device: H100_SMS):
        LN.layer_norm_forward(y, dims, True, pre_steps, post_steps, 1e-5, params, post_params, affine, out, stats)
        LN.layer_norm_backward(torch.empty_like(out), y, stats, dims, True, pre_steps, post_steps, params, post_params,
                               affine, torch.empty_like(y), [True] * len(pre_steps), [True] * len(post_steps),
                               (True, True))  # fmt: skip


def conv_epilogue_forward(workload: str, dtype: str, save: bool) -> None:
    """``fusion::conv_epilogue``'s Triton forward for ``convt3d``, ``convt3d_wide`` or ``conv2d`` (see
    the module docstring; the shapes of ``tools/bench_conv_fused.py``)."""
    x_dtype, compute_dtype = FORWARD_DTYPES[dtype]
    spec, chain, pool = seed_conv("conv2d" if workload == "conv2d" else "convt3d")
    if workload == "conv2d":
        x, w = torch.empty(64, 64, 256, 256, dtype=x_dtype), torch.empty(64, 64, 3, 3, dtype=x_dtype)
    else:
        cin = 16 if workload == "convt3d" else 48
        x, w = torch.empty(16, cin, 16, 32, 32, dtype=x_dtype), torch.empty(cin, 32, 3, 3, 3, dtype=x_dtype)
    c = w.shape[0] if not spec.transposed else w.shape[1]
    bias, mult = torch.zeros(c, dtype=x_dtype), torch.ones((c,) + (1,) * (x.dim() - 2), dtype=x_dtype)
    cfg = ConvEpilogueConfig(conv=spec, chain=chain, pool=pool, strict=True, compute_dtype=compute_dtype)
    ce.forward._fused_conv_forward(x, w, bias, [mult], cfg, save)


def convt3d_maxpool_grad(dtype: torch.dtype, grad_dtype: torch.dtype, channels_last: bool):  # noqa: ANN201
    """``(PooledGrad, x, weight, (stride, padding, dilation, transposed, output_padding, groups))`` of
    the ``seeds`` suite's ConvTranspose3d 16->32 k3 s2 p1 op1 over (16, 16, 16, 32, 32) behind
    MaxPool3d(2)."""
    x = torch.empty(16, 16, 16, 32, 32, dtype=dtype)
    w = torch.empty(16, 32, 3, 3, 3, dtype=dtype)
    g_win = torch.empty(16, 32, 16, 32, 32, dtype=grad_dtype)
    winner = torch.empty(16, 32, 16, 32, 32, dtype=torch.int8)
    if channels_last:
        x, g_win, winner = (t.contiguous(memory_format=torch.channels_last_3d) for t in (x, g_win, winner))
    conv = ((2, 2, 2), (1, 1, 1), (1, 1, 1), True, (1, 1, 1), 1)
    return FB.PooledGrad(g_win, winner, (2, 2, 2)), x, w, conv


def conv_fused_backward(workload: str, dtype: str, channels_last: bool) -> None:
    """``conv_fused_bwd``'s input-grad and weight-grad launchers for ``convt3d``, ``conv2d`` or
    ``conv2d_narrow`` (see the module docstring)."""
    dt = BACKWARD_DTYPES[dtype]
    if workload == "convt3d":
        grad, x, w, conv = convt3d_maxpool_grad(dt, dt, channels_last)
    else:
        width = 256 if workload == "conv2d" else 20
        x, w = torch.empty(64, 64, 256, width, dtype=dt), torch.empty(64, 64, 3, 3, dtype=dt)
        grad = torch.empty(64, 64, 254, width - 2, dtype=dt)
        if channels_last:
            x, grad = (t.contiguous(memory_format=torch.channels_last) for t in (x, grad))
        conv = ((1, 1), (0, 0), (1, 1), False, (0, 0), 1)
    FB.plan._input_grad(grad, x, w, *conv)
    FB.plan._weight_grad(grad, x, w, *conv)


def conv_phase_aligned_backward(dtype: str, channels_last: bool) -> None:
    """``conv_phase_aligned_bwd``'s input-grad and weight-grad plans for the ConvTranspose3d behind
    MaxPool3d(2), run once, with an H100's SM count setting the weight grad's split count."""
    dt = BACKWARD_DTYPES[dtype]
    grad, x, w, (stride, padding, dilation, _, output_padding, groups) = convt3d_maxpool_grad(
        dt, torch.float32, channels_last
    )
    with mock.patch.object(S.plan, "_sm_count", lambda device: H100_SMS):
        geo = S.plan._geometry(grad, x, w, stride, padding, dilation, output_padding, groups)
        S.plan._prepare_input_grad(grad, x, w, geo, x.dtype)(grad, x, w)
        S.plan._prepare_weight_grad(grad, x, w, geo, x.dtype)(grad, x, w)


def global_mean_pipeline(dtype: str, channels_last: bool, padded: bool) -> None:
    """The four launchers as ``conv_global_mean`` calls them for the global-mean pipeline, or
    (``padded``) for a regular Conv2d with padding 1 and 2 groups (3 index sets per dim: the tapset
    gather), no bias, a constant step: off that pipeline's path, the other branches of the kernels."""
    dt = BACKWARD_DTYPES[dtype]
    n, c_in, c_out, size = 16, 64, 128, (512, 512)
    x = torch.empty((n, c_in, *size), dtype=dt)
    if channels_last:
        x = torch.empty((n, *size, c_in), dtype=dt).permute(0, 3, 1, 2)
    weight = torch.empty((c_in, c_out, 3, 3), dtype=dt)
    bias: torch.Tensor | None = torch.empty((c_out,), dtype=dt)
    extra = torch.empty((c_out, 1, 1), dtype=torch.float32)
    spec = ConvSpec(True, (1, 1), (0, 0), (1, 1), (0, 0), 1)
    step = ChainStep(PointwiseKind.ADD, (TensorRef(0),))
    if padded:
        weight = torch.empty((c_out, c_in // 2, 3, 3), dtype=dt)
        bias = None
        spec = ConvSpec(False, (1, 1), (1, 1), (1, 1), (0, 0), 2)
        step = ChainStep(PointwiseKind.MUL, (Const(0.5),))
    cfg = cgm.ConvGlobalMeanConfig(spec, (step,), keepdim=True, out_dtype="float32")
    geo = cgm.config.geometry_for(spec, size, (3, 3), x.device)
    x5 = cgm.config.as_5d(x)
    # the split an H100 picks (the launchers only ask the device on CUDA)
    if GM.passes._channels_innermost(x5):
        _, block_c = GM.passes._cl_tiles(size[0] * size[1], c_in)
        split = triton.cdiv(GM.passes._PROGRAMS_PER_SM * H100_SMS, n * triton.cdiv(c_in, block_c))
    else:
        split = triton.cdiv(GM.passes._PROGRAMS_PER_SM * H100_SMS, n * c_in)
    partial_sums = GM.set_sums_partial(x5, geo.bits, geo.set_counts, split=split)
    mean = torch.empty((n, c_out), dtype=torch.float64)
    taps = torch.empty((n, c_in, 9), dtype=torch.float64)
    out = torch.empty((n, c_out), dtype=torch.float32)
    layout = cgm.triton_path.weight_layout(weight, spec)
    chain = cgm.triton_path.chain_args(cfg, [extra], c_out, x.device, mean)
    GM.contract_forward(partial_sums, geo.tapset, layout, bias, chain, geo.n_outputs, out, mean, taps)
    grad = torch.empty((n, c_out, 1, 1), dtype=torch.float32)
    coef = torch.empty((n, c_out), dtype=torch.float32)
    gw = torch.empty_like(weight)
    targets = ((GM.GRAD_NONE, coef, 0),) if padded else ((GM.GRAD_DIRECT, torch.empty_like(extra), 1),)
    GM.params_backward(grad.reshape(n, c_out), mean, taps, chain, targets,
                       GM.WeightLayout.of(gw, spec.transposed, spec.groups),
                       None if bias is None else torch.empty_like(bias), geo.n_outputs, coef, coef)  # fmt: skip
    grad_x = torch.empty_strided(x.shape, cgm.config.grad_input_strides(x), dtype=dt)
    GM.grad_broadcast(
        coef, layout, geo.tapset, geo.bits, geo.set_counts, cgm.config.as_5d(grad_x), split=split
    )


#: The conv family job's problems: ``(x shape, weight shape, stride, padding, groups, bias)`` of
#: torchvision ResNet-50 at batch 64 (a bottleneck's 1x1 reduce, a downsampling 1x1 at stride 2, its 3x3, layer3's 3x3 on a plane no
#: power-of-two box tiles, layer2's strided 3x3, the 7x7 RGB stem: flat K), an EfficientNet-B0
#: depthwise 3x3 (flat K, one channel per group) and the SD VAE decoder's 512-channel 3x3 with bias
#: (batch 1, 64x64).
CONV_FAMILY_SHAPES = {
    "resnet_1x1": ((64, 256, 56, 56), (64, 256, 1, 1), 1, 0, 1, False),
    "resnet_1x1_s2": ((64, 256, 56, 56), (512, 256, 1, 1), 2, 0, 1, False),
    "resnet_3x3": ((64, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1, False),
    "resnet_3x3_14": ((64, 256, 14, 14), (256, 256, 3, 3), 1, 1, 1, False),
    "resnet_3x3_s2": ((64, 128, 56, 56), (128, 128, 3, 3), 2, 1, 1, False),
    "resnet_stem": ((64, 3, 224, 224), (64, 3, 7, 7), 2, 3, 1, False),
    "depthwise": ((64, 96, 112, 112), (96, 1, 3, 3), 2, 1, 96, False),
    "depthwise_s1": ((64, 144, 56, 56), (144, 1, 3, 3), 1, 1, 144, False),
    "vae_3x3": ((1, 512, 64, 64), (512, 512, 3, 3), 1, 1, 1, True),
}
CONV_FAMILY_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _launchable_on_cpu_tensors():  # noqa: ANN202
    """The conv family's launchers refuse CPU tensors outside the interpreter and, on CPU, bf16 and
    TF32 (the interpreter has neither): within this context they take them as a CUDA launch would
    (every dtype, TF32 for fp32 as ``torch.backends.cudnn.allow_tf32`` says), so that the recorded
    launches are a GPU's."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(FAMILY_FPROP, "INTERPRETER", True))
    stack.enter_context(mock.patch.object(FAMILY_FPROP, "_INTERPRETER_DTYPES", FAMILY_FPROP._CUDA_DTYPES))
    stack.enter_context(mock.patch.object(FAMILY_FPROP, "dot_precision",
                                          lambda dtype, allow, interpret: TF32.dot_precision(dtype, allow, False)))  # fmt: skip
    stack.enter_context(mock.patch.object(FAMILY_TMA, "_is_sm90", lambda device: True))
    stack.enter_context(mock.patch.object(FAMILY_TMA_WGRAD, "_is_sm90", lambda device: True))
    return stack


def conv_family_pass(shape: str, dtype: str, hooked: bool, box: bool = False, taps: bool = False,
                     tma: str = "", halo: bool = False) -> None:  # fmt: skip
    """``kernels/conv/``'s three launchers (``conv_fprop``, ``conv_dgrad``, ``conv_wgrad``) on one of
    :data:`CONV_FAMILY_SHAPES`, channels-last, with the tile ``pick_tile`` picks; ``box``: ``conv_dgrad``
    and ``conv_wgrad`` with their first tiles loading boxes (``tiles.box_width``); ``taps``: ``conv_wgrad``
    with its first tile on 8 warps, taking 1 and then a kernel row's 3 taps per program
    (``TileConfig.taps_per_program``), after the several-taps tiles the timed choice weighs
    (``tiles.candidates``); ``tma="rows"``: ``conv_fprop`` alone, with each of the Gluon TMA forward's tiles
    (``tiles.tma_tiles``; a 1x1 conv; the hooks without the saved raw conv), then ``conv_dgrad`` with each of
    the input gradient's (the same kernel, ``GRAD``; with the hooks relu' and the BatchNorm-backward sums);
    ``tma="wgrad"``: ``conv_wgrad``
    alone with each of the Gluon TMA weight gradient's tiles (``tiles.tma_wgrad_tiles``); ``halo``:
    ``conv_fprop`` alone with the heuristic's tile as the halo kernel's (``kernels/conv/halo.py``, 'same'
    stride-1 shapes; the hooks without the saved raw conv); ``hooked``: the hooks
    a BatchNorm + ReLU between two convs uses (fprop: ``ChannelAffine`` prologue, relu on load, output
    statistics, the raw conv output saved for a backward, and where the conv has a bias a chain after
    it, an eval norm's scale and shift; then, where 32 divides the output channels, GroupNorm's
    statistics of 32 groups instead (tiles that do not cross samples); dgrad: relu' of the recomputed
    prologue and the BatchNorm-backward sums; wgrad: the prologue recomputed on load, and the bias
    gradient where the conv has a bias)."""
    x_shape, w_shape, stride, padding, groups, has_bias = CONV_FAMILY_SHAPES[shape]
    dt = CONV_FAMILY_DTYPES[dtype]
    c_in, c_out = x_shape[1], w_shape[0]
    cpu = torch.device("cpu")
    x = FAMILY_FPROP.empty_channels_last(x_shape, dt, cpu)
    w = torch.empty(w_shape, dtype=dt)
    bias = torch.empty(c_out, dtype=dt) if has_bias else None
    geo = dict(stride=stride, padding=padding, groups=groups)
    out_shape = (x_shape[0], c_out, *FAMILY_FPROP.output_size(x_shape[2:], w_shape[2:], (stride,) * 2,
                                                               (padding,) * 2, (1, 1)))  # fmt: skip
    dy = FAMILY_FPROP.empty_channels_last(out_shape, dt, cpu)
    vec = torch.empty(c_in, dtype=torch.float32)
    hooks = dict(prologue=FAMILY.ChannelAffine(vec, vec), act_in="relu") if hooked else {}
    per_out = torch.empty(c_out, dtype=torch.float32)
    chain = [(OP_CODES["mul"], [per_out]), (OP_CODES["add"], [per_out])] if hooked and has_bias else []
    with _launchable_on_cpu_tensors():
        if tma == "rows":
            m = out_shape[0] * out_shape[2] * out_shape[3]
            # a plain call's tiles include the wide one (``tiles.tma_tiles``)
            tiles = FAMILY_TILES.tma_tiles(c_in, c_out, m) + FAMILY_TILES.tma_tiles(c_in, c_out, m, wide=not hooked)
            for tile in dict.fromkeys(tiles):  # as a BatchNorm between convs: no save
                FAMILY.conv_fprop(x, w, bias, stats=hooked, chain=chain, tile=tile, **hooks, **geo)
            # the input gradient's tiles: the channels exchanged, as the timed choice offers them; at a stride
            # with SiLU too (its zeros through act' and the sums: ``tma_fprop.zeros_read_x``)
            acts = ("relu", "silu") if hooked and stride != 1 else (hooks.get("act_in"),)
            for tile, act in itertools.product(FAMILY_TILES.candidates("dgrad", c_out, c_in, 1, m, dt,
                                                                       epilogue_hooks=hooked, tma=True,
                                                                       plain=not hooked)[1:], acts):  # fmt: skip
                FAMILY.conv_dgrad(dy, w, x_shape, x_prev=x if hooked else None,
                                  norm_stats=FAMILY.NormStats(vec, vec) if hooked else None, tile=tile,
                                  **dict(hooks, act_in=act) if hooked else {}, **geo)  # fmt: skip
            return
        if tma == "wgrad":
            taps = w_shape[2] * w_shape[3]
            rows = taps == 1 and not padding  # the plain call's tiles, hooked too: the register path compiles
            # boxes past the plane: clipped descriptors where they serve
            clippable = FAMILY_TMA_WGRAD.clippable_for_shapes(x_shape, w_shape, (padding,) * 2, (1, 1))
            tiles = FAMILY_TILES.tma_wgrad_tiles(c_in, c_out, taps, out_shape[2:], rows, False, clippable)
            for tile in tiles:
                FAMILY.conv_wgrad(dy, x, w, bias_grad=has_bias, tile=tile, **hooks, **geo)
            for split in (1, 3):  # one split: the gradient written by the programs themselves (``DIRECT``)
                FAMILY.conv_wgrad(dy, x, w, bias_grad=has_bias, tile=tiles[0], split=split, **hooks, **geo)
            return
        if halo:  # the heuristic's tile as the halo kernel's; a depthwise weight gradient's halo tile
            m = x_shape[0] * out_shape[2] * out_shape[3]
            taps = w_shape[2] * w_shape[3]
            depthwise = groups > 1 and w_shape[1] == 1  # the direct depthwise tile's halo
            first = FAMILY_TILES.candidates("fprop", w_shape[1], c_out // groups, taps, m, dt,
                                            c_out if depthwise else None)[0]  # fmt: skip
            # the depthwise path's tile as the halo's, else the halo's wide and short tiles (``tiles.halo_tiles``)
            tiles = [first] if depthwise else FAMILY_TILES.halo_tiles(first, c_out // groups, m)
            for tile in (dataclasses.replace(t, halo=True) for t in tiles):
                FAMILY.conv_fprop(x, w, bias, stats=hooked, chain=chain, tile=tile, **hooks, **geo)
                if not depthwise:  # its box tiles
                    box = FAMILY_TILES.halo_box_width(tuple(out_shape[2:]), tile.block_m, tuple(w_shape[2:]), (1, 1))
                    FAMILY.conv_fprop(x, w, bias, stats=hooked, chain=chain, tile=dataclasses.replace(tile, box_w=box),
                                      **hooks, **geo)  # fmt: skip
            if depthwise:
                for wtile in FAMILY_TILES.candidates("wgrad", 1, c_out // groups, taps, m, dt, c_out, halo=True):
                    if wtile.halo:
                        FAMILY.conv_wgrad(dy, x, w, bias_grad=has_bias, tile=wtile, **hooks, **geo)
            return
        wtile = dtile = None
        if box:
            m = dy.shape[0] * dy.shape[2] * dy.shape[3]
            wfirst = FAMILY_TILES.candidates("wgrad", c_in, c_out, w_shape[2] * w_shape[3], m, dt)[0]
            wtile = dataclasses.replace(wfirst, box_w=FAMILY_TILES.box_width(*dy.shape[2:], wfirst.block_m))
            dfirst = FAMILY_TILES.candidates("dgrad", c_out, c_in, w_shape[2] * w_shape[3], m, dt)[0]
            dtile = dataclasses.replace(dfirst, box_w=FAMILY_TILES.box_width(*x_shape[2:], dfirst.block_m))
        FAMILY.conv_fprop(x, w, bias, stats=hooked, chain=chain, saved=dy if hooked else None, **hooks,
                          **geo)  # fmt: skip
        if hooked and c_out % 32 == 0:  # GroupNorm's statistics (32 groups, as the SD VAE's): per-sample tiles
            FAMILY.conv_fprop(x, w, bias, stats_groups=32, chain=chain, **hooks, **geo)
        FAMILY.conv_dgrad(dy, w, x_shape, x_prev=x if hooked else None,
                          norm_stats=FAMILY.NormStats(vec, vec) if hooked else None, tile=dtile, **hooks,
                          **geo)  # fmt: skip
        if taps:  # the timed choice's several-taps tiles, then the first on 8 warps with one and three taps
            m = dy.shape[0] * dy.shape[2] * dy.shape[3]
            wtiles = FAMILY_TILES.candidates("wgrad", c_in, c_out, w_shape[2] * w_shape[3], m, dt)
            for wtile in [t for t in wtiles if t.taps_per_program > 1]:
                FAMILY.conv_wgrad(dy, x, w, bias_grad=has_bias, tile=wtile, **hooks, **geo)
            wtile = dataclasses.replace(wtiles[0], num_warps=8)
            FAMILY.conv_wgrad(dy, x, w, bias_grad=has_bias, tile=wtile, **hooks, **geo)
            wtile = dataclasses.replace(wtile, taps_per_program=3)
        FAMILY.conv_wgrad(dy, x, w, bias_grad=has_bias, tile=wtile, **hooks, **geo)
        if groups == c_in and w_shape[1] == 1:  # the direct depthwise path's other timed tiles
            m = out_shape[0] * out_shape[2] * out_shape[3]
            for wtile in FAMILY_TILES.depthwise_candidates(c_out, m)[1:]:
                FAMILY.conv_wgrad(dy, x, w, bias_grad=has_bias, tile=wtile, **hooks, **geo)


# --------------------------------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------------------------------


def conv_output_rate(launch: kc.Launch) -> dict[str, float]:
    """``thread-instr/output`` of a conv forward's main loop (per loop instruction)."""
    kw = launch.kwargs
    return {"thread-instr/output": 32 * launch.option("num_warps") / (kw["BLOCK_M"] * kw["BLOCK_N"])}


def phase_aligned_rates(launch: kc.Launch) -> dict[str, float]:
    """``instr/row`` and ``warp-instr/kMAC`` of a ``conv_phase_aligned_bwd`` kernel's main loop (per loop
    instruction); one iteration multiplies ``BLOCK_M * BLOCK_CI * BLOCK_CO * KPB * KS`` (the input
    grad: per offset block)."""
    kw = launch.kwargs
    macs = kw["BLOCK_M"] * kw["BLOCK_CI"] * kw["BLOCK_CO"] * kw["KPB"] * kw.get("KS", 1)
    return {"instr/row": 1 / kw["BLOCK_M"], "warp-instr/kMAC": launch.option("num_warps") * 1000 / macs}


def pruned_tiles(module) -> Callable[[kc.Launch], list[triton.Config]]:  # noqa: ANN001
    """The tiles ``module._prune`` keeps of ``module._configs()`` for a launch (what its autotuner times)."""
    return lambda launch: module._prune(module._configs(), launch.named_args, **launch.kwargs)


def phase_aligned_tiles(tiles: tuple[tuple[int, ...], ...]) -> Callable[[kc.Launch], list[triton.Config]]:
    """``tiles`` clamped to a ``conv_phase_aligned_bwd`` launch's problem (``fit_tiles``)."""

    def fit(launch: kc.Launch) -> list[triton.Config]:
        kw, named = launch.kwargs, launch.named_args
        kpn = kw["KD"] * kw["KH"] * kw["KW"]
        return [S.plan._tile_config(t) for t in S.plan.fit_tiles(tiles, named["CI_G"], named["CO_G"], kpn)]

    return fit


def as_launched(fields: tuple[str, ...]) -> Callable[[kc.Launch], list[triton.Config]]:
    """The launch's own tile (its ``fields`` constexprs, warps and stages): a kernel whose launcher picks
    its tile, listed as tiled so that the report names the tile."""
    return lambda launch: [triton.Config({f: launch.kwargs[f] for f in fields}, num_warps=launch.option("num_warps"),
                                         num_stages=launch.option("num_stages"))]  # fmt: skip


@dataclass(frozen=True)
class TiledKernel:
    """A kernel compiled once per tile of its list instead of as launched."""

    kernel: str  # the kernel's function name
    fields: tuple[str, ...]  # a tile's constexprs, in the order a tile option gives them (then warps, stages)
    option: str  # the option (argparse dest) giving tiles instead of the list
    tiles: Callable[[kc.Launch], list[triton.Config]]  # the list for a recorded launch, best first
    sass_rates: Callable[[kc.Launch], dict[str, float]] | None = None  # job-specific ``--sass`` proxies


@dataclass(frozen=True)
class Job:
    name: str
    summary: str
    cases: dict[str, Callable[[], None]]  # case -> its workload
    default_cases: tuple[str, ...] = ()  # empty: every case
    tiled: tuple[TiledKernel, ...] = ()  # every case must launch each of these
    spills_fail: bool = False


PHASE_ALIGNED_FIELDS = ("BLOCK_M", "BLOCK_CI", "BLOCK_CO", "KPB")
FAMILY_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
#: the TMA forward's M and K blocks are its tensor descriptors' boxes
TMA_FIELDS = ("BLOCK_N", "STAGES")
TMA_WGRAD_FIELDS = ("BLOCK_N", "SLOTS", "BOX_W", "STAGES", "CLIP_H", "CLIP_W")
JOBS = {job.name: job for job in (
    Job(
        "conv_fused", "conv_epilogue forward through kernels/conv_fused/ (ConvTranspose3d + chain + MaxPool3d)",
        {f"{w}-{d}{save}": partial(conv_epilogue_forward, w, d, bool(save))
         for w in ("convt3d", "convt3d_wide") for d in FORWARD_DTYPES for save in ("", "-save")},
        ("convt3d-fp32-save", "convt3d-bf16-save", "convt3d-amp-save"),
        (TiledKernel("conv_fused_fwd_kernel", ("BLOCK_M", "BLOCK_N", "BLOCK_K"), "tiles", pruned_tiles(CF.plan),
                     conv_output_rate),),
    ),
    Job(
        "conv_dense", "conv_epilogue forward through kernels/conv_dense.py (Conv2d 64->64 + chain)",
        {f"conv2d-{d}{save}": partial(conv_epilogue_forward, "conv2d", d, bool(save))
         for d in FORWARD_DTYPES for save in ("", "-save")},
        tiled=(TiledKernel("_conv_dense_fwd_kernel", ("BLOCK_M", "BLOCK_K"), "tiles", pruned_tiles(CD),
                           conv_output_rate),),
    ),
    Job(
        "conv_fused_bwd", "kernels/conv_fused_bwd/: input and weight grads (pooled and dense gradients)",
        {f"{w}-{d}{cl}": partial(conv_fused_backward, w, d, bool(cl))
         for w in ("convt3d", "conv2d", "conv2d_narrow") for d in ("fp32", "bf16") for cl in ("", "-cl")},
        ("convt3d-fp32", "conv2d-fp32", "conv2d-fp32-cl", "conv2d_narrow-fp32-cl"),
        (TiledKernel("dgrad_kernel", ("BLOCK_M",), "dgrad_tiles", lambda launch: FB.device.dgrad_configs()),
         TiledKernel("wgrad_kernel", (), "wgrad_tiles", lambda launch: FB.device.wgrad_configs())),
    ),
    Job(
        "conv_phase_aligned_bwd", "kernels/conv_phase_aligned_bwd/: input and weight grads behind a max pool (ConvTranspose3d)",
        {f"convt3d-{d}{cl}": partial(conv_phase_aligned_backward, d, bool(cl)) for d in BACKWARD_DTYPES for cl in ("", "-cl")},
        ("convt3d-fp32", "convt3d-bf16"),
        (TiledKernel("phase_aligned_dgrad_kernel", PHASE_ALIGNED_FIELDS, "dgrad_tiles", phase_aligned_tiles(S.plan.DGRAD_TILES), phase_aligned_rates),
         TiledKernel("phase_aligned_wgrad_kernel", PHASE_ALIGNED_FIELDS, "wgrad_tiles", phase_aligned_tiles(S.plan.WGRAD_TILES), phase_aligned_rates)),
    ),
    Job(
        "conv_family", "kernels/conv/: conv_fprop, conv_dgrad, conv_wgrad, plain and hooked (ResNet-50, EfficientNet, SD VAE shapes)",
        {f"{w}-{d}{h}{b}": partial(conv_family_pass, w, d, bool(h), b == "-box", b == "-taps")
         for w in CONV_FAMILY_SHAPES for d in CONV_FAMILY_DTYPES for h in ("", "-hooked")
         for b in ("", "-box", "-taps")
         if not b or (b == "-box" and CONV_FAMILY_SHAPES[w][2] == 1 and CONV_FAMILY_SHAPES[w][4] == 1)
         or (b == "-taps" and CONV_FAMILY_SHAPES[w][1][1] > 1 and CONV_FAMILY_SHAPES[w][1][-1] == 3)},
        ("resnet_3x3-bf16", "resnet_3x3-bf16-hooked", "resnet_3x3-fp32-hooked", "resnet_stem-bf16-hooked",
         "depthwise-bf16-hooked", "vae_3x3-bf16-hooked"),
        tuple(TiledKernel(k, FAMILY_FIELDS, "", as_launched(FAMILY_FIELDS))
              for k in ("conv_fprop_kernel", "conv_dgrad_kernel", "conv_wgrad_kernel")),
    ),
    Job(
        "conv_halo", "kernels/conv/halo.py: the forward normalising each tile's input window once per channel block "
        "(conv_family's 'same' stride-1 shapes)",
        {f"{w}-{d}{h}": partial(conv_family_pass, w, d, bool(h), halo=True)
         for w in ("resnet_3x3", "vae_3x3", "depthwise_s1") for d in CONV_FAMILY_DTYPES for h in ("", "-hooked")},
        ("resnet_3x3-bf16-hooked", "vae_3x3-bf16-hooked", "depthwise_s1-bf16-hooked"),
        (TiledKernel("conv_fprop_halo_kernel", FAMILY_FIELDS, "", as_launched(FAMILY_FIELDS)),),
    ),
    Job(
        "conv_tma", "kernels/conv/tma_fprop.py: the Gluon TMA forward and input gradient, plain and hooked (conv_family's "
        "1x1 shapes; at stride 2 the forward's strided boxes and the input gradient's zeros)",
        {f"{w}-bf16{h}": partial(conv_family_pass, w, "bf16", bool(h), tma="rows")
         for w in ("resnet_1x1", "resnet_1x1_s2") for h in ("", "-hooked")},
        ("resnet_1x1-bf16", "resnet_1x1-bf16-hooked", "resnet_1x1_s2-bf16", "resnet_1x1_s2-bf16-hooked"),
        (TiledKernel("tma_fprop_kernel", TMA_FIELDS, "", as_launched(TMA_FIELDS)),),
    ),
    Job(
        "conv_tma_wgrad", "kernels/conv/tma_wgrad.py: the Gluon TMA weight gradient, plain and hooked (conv_family's "
        "stride-1 shapes, each of its tiles)",
        {f"{w}-bf16{h}": partial(conv_family_pass, w, "bf16", bool(h), tma="wgrad")
         for w in ("resnet_1x1", "resnet_3x3", "resnet_3x3_14", "vae_3x3") for h in ("", "-hooked")},
        ("resnet_1x1-bf16", "resnet_1x1-bf16-hooked", "resnet_3x3-bf16", "resnet_3x3-bf16-hooked",
         "resnet_3x3_14-bf16", "resnet_3x3_14-bf16-hooked"),
        (TiledKernel("tma_wgrad_kernel", TMA_WGRAD_FIELDS, "", as_launched(TMA_WGRAD_FIELDS)),),
    ),
    Job(
        "epilogue", "kernels/epilogue.py: the epilogue kernels' forward and backward (a DAG chain, each pool kind)",
        {f"{p}-{d}": partial(epilogue_pass, p, d) for p in ("none", "max", "avg") for d in ("fp32", "bf16")},
        spills_fail=True,
    ),
    Job(
        "global_mean", "kernels/global_mean/: the conv_global_mean pipeline (ConvTranspose2d 64->128 global mean)",
        {f"{w}-{d}{cl}": partial(global_mean_pipeline, d, bool(cl), w == "conv2d_padded")
         for w, d in (("convt2d", "fp32"), ("convt2d", "bf16"), ("conv2d_padded", "fp32")) for cl in ("", "-cl")},
        spills_fail=True,
    ),
    Job(
        "channel_reduce", "kernels/channel_reduce.py: conv_channel_reduce's kernels (the families demos, 512 channels)",
        {f"{w}-{d}": partial(channel_reduce_pass, w, d) for w in CHANNEL_REDUCE_WORKLOADS for d in ("fp32", "bf16")},
    ),
    Job(
        "group_norm", "kernels/group_norm.py: conv_group_norm's kernels (the families GroupNorm demo, instance norm, wide groups, "
        "small groups; the demo with a max pool, the instance norm with an avg pool: kernels/norm_pool.py)",
        {f"{w}-{d}": partial(group_norm_pass, w, d) for w in GROUP_NORM_WORKLOADS for d in ("fp32", "bf16")},
    ),
    Job(
        "batch_norm", "kernels/batch_norm.py: conv_batch_norm's kernels (the families BatchNorm-training demo, channels-last, a Conv3d "
        "chain; the ResNet stem with its max pool, channels-last, the Conv3d chain with an avg pool: kernels/norm_pool.py)",
        {f"{w}-{d}": partial(batch_norm_pass, w, d) for w in BATCH_NORM_WORKLOADS for d in ("fp32", "bf16")},
    ),
    Job(
        "layer_norm", "kernels/layer_norm.py: conv_layer_norm's kernels (the families LayerNorm demo, LayerNorm(W) packed rows, long (H, W) rows; channels-last)",
        {f"{w}-{d}": partial(layer_norm_pass, w, d) for w in LAYER_NORM_WORKLOADS for d in ("fp32", "bf16")},
    ),
)}  # fmt: skip
TILE_OPTIONS = ("tiles", "dgrad_tiles", "wgrad_tiles")


# --------------------------------------------------------------------------------------------------
# Running a job
# --------------------------------------------------------------------------------------------------


def tile_label(launch: kc.Launch, tiled: TiledKernel | None) -> str:
    """``M128 N32 K16 w8 s2``: the tile's constexprs (``BLOCK_`` dropped), warps and stages."""
    fields = tiled.fields if tiled is not None else ()
    names = [f"{f.removeprefix('BLOCK_')}{launch.kwargs[f]}" for f in fields]
    return " ".join([*names, f"w{launch.option('num_warps')}", f"s{launch.option('num_stages')}"])


def parse_tiles(text: str, tiled: TiledKernel) -> list[triton.Config]:
    """``'a,b,...;...'`` -> configs; raises ValueError naming the format when a tile does not fit it."""
    fields = (*tiled.fields, "num_warps", "num_stages")
    configs = []
    for tile in filter(None, text.split(";")):
        values = [int(v) for v in tile.split(",")]
        if len(values) != len(fields):
            fmt = ",".join([f.removeprefix("BLOCK_") for f in tiled.fields] + ["warps", "stages"])
            raise ValueError(f"{tiled.kernel} takes tiles {fmt!r}, got {tile!r}")
        configs.append(triton.Config(dict(zip(tiled.fields, values[:-2], strict=True)), num_warps=values[-2],
                                     num_stages=values[-1]))  # fmt: skip
    return configs


class JobRun:
    """One job's run over its cases: per case the recorded launches, each compiled once per tile (a
    tiled kernel) or as launched, one printed line per compile, and the job's summary."""

    def __init__(self, job: Job, opts: argparse.Namespace, custom: dict[str, list[triton.Config]],
                 keep: dict[str, Path]) -> None:  # fmt: skip
        self.job, self.opts, self.keep = job, opts, keep
        self.custom = custom  # kernel -> the tiles given on the command line
        self.tiled = {t.kernel: t for t in job.tiled}
        self.first_case: dict[
            str, tuple[str, str]
        ] = {}  # specialisation key -> (case that compiled it, status)
        self.kernels: set[str] = set()
        self.compiled = self.failed = self.spilled = 0

    def run(self, cases: list[str]) -> int:
        """Compile every case; returns the number of failed cases and compiles."""
        print(f"== {self.job.name}: {self.job.summary}", flush=True)
        for case in cases:
            try:
                launches = self.record(case)
            except Exception as err:  # noqa: BLE001 - report every failing case, go on
                self.failed += 1
                print(f"FAIL {case}: {type(err).__name__}: {str(err)[-3000:]}", flush=True)
                continue
            words = self.opts.kernels.split(",") if self.opts.kernels else []
            for launch in launches:
                if not words or any(word in launch.name for word in words):
                    self.compile_launch(case, launch)
        kernels = f" of {', '.join(sorted(self.kernels))}" if self.kernels else ""
        print(f"{self.job.name}: {self.compiled} specialisations{kernels}")
        if self.failed:
            print(f"{self.job.name}: {self.failed} failed" + (" or spilled" if self.job.spills_fail else ""))
        elif self.spilled:
            print(f"{self.job.name}: all kernels compiled, {self.spilled} with spills")
        else:
            print(f"{self.job.name}: all kernels compiled without spills")
        return self.failed

    def record(self, case: str) -> list[kc.Launch]:
        """The case's launches; raises when it launches none of a tiled kernel (a case of another job)."""
        with kc.recording() as launches:
            self.job.cases[case]()
        launched = {launch.name for launch in launches}
        missing = sorted(set(self.tiled) - launched)
        if missing:
            raise RuntimeError(
                f"launched {', '.join(sorted(launched)) or 'nothing'}, not {', '.join(missing)}"
            )
        return launches

    def compile_launch(self, case: str, launch: kc.Launch) -> None:
        self.kernels.add(launch.name)
        tiled = self.tiled.get(launch.name)
        variants = [launch]
        if tiled is not None:
            tiles = self.custom.get(launch.name) or tiled.tiles(launch)
            variants = [launch.with_tile(t) for t in (tiles[:1] if self.opts.quick else tiles)]
        for variant in variants:
            tile = tile_label(variant, tiled)
            status, text = self.compile_variant(case, variant, tile, tiled)
            print(f"{status:4s} {case:22s} {launch.name:27s} {tile:24s} {text}", flush=True)

    def compile_variant(
        self, case: str, launch: kc.Launch, tile: str, tiled: TiledKernel | None
    ) -> tuple[str, str]:
        """``(status, report)``: ``ok`` or ``FAIL``, and ``kc.Report.line``, the error, or ``= CASE``
        for a specialisation that CASE compiled."""
        try:
            spec = kc.specialise(launch)
            key = spec.key()
            if key in self.first_case:
                earlier, status = self.first_case[key]
                return status, f"= {earlier}"
            if self.opts.verbose:
                print(f"    signature {spec.signature}\n    constexprs {spec.constexprs}")
            rates = None
            if self.opts.sass or self.opts.dump_sass:
                rates = tiled.sass_rates(launch) if tiled is not None and tiled.sass_rates is not None else {}
            label = re.sub(r"[^\w.-]+", "_", f"{self.job.name}_{case}_{launch.name}_{tile}")
            report = kc.compile_specialisation(spec, rates, self.keep, label)
        except Exception as err:  # noqa: BLE001 - report every failing specialisation, go on
            self.failed += 1
            root = err
            while root.__cause__ is not None:  # a Triton CompilationError wraps the call chain's errors
                root = root.__cause__
            return "FAIL", f"{type(err).__name__}: {str(err)[:1500]}" + (f" <- {root!r:.1500}" if root is not err else "")
        self.compiled += 1
        self.spilled += report.spills
        too_much_shared = report.shared > SM90_MAX_SHARED
        failed = not report.ok or too_much_shared or (self.job.spills_fail and report.spills)
        self.failed += failed
        status = "FAIL" if failed else "ok"
        self.first_case[key] = (case, status)
        return status, report.line() + (f" (over sm_90's {SM90_MAX_SHARED} bytes)" if too_much_shared else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="*", metavar="KERNEL", help=f"{', '.join(JOBS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="only the first tile of each tiled kernel")
    parser.add_argument(
        "--cases", default="", help="comma-separated cases instead of the jobs' defaults (KERNEL:CASE: one job's)"
    )
    parser.add_argument("--kernels", default="", help="only kernels whose name contains one of these words")
    parser.add_argument(
        "--sass", action="store_true", help="count SASS instructions by class (main loop, kernel)"
    )
    parser.add_argument(
        "--dump-sass", default="", metavar="DIR", help="write SASS listings and cubins (implies --sass)"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print each specialisation's signature and constexprs"
    )
    parser.add_argument(
        "--tiles", default="", help="conv_fused: 'M,N,K,warps,stages;...'; conv_dense: 'M,K,warps,stages;...'"
    )
    parser.add_argument(
        "--dgrad-tiles",
        default="",
        help="conv_phase_aligned_bwd: 'M,CI,CO,KPB,warps,stages;...'; conv_fused_bwd: 'M,warps,stages;...'",
    )
    parser.add_argument(
        "--wgrad-tiles",
        default="",
        help="conv_phase_aligned_bwd: 'M,CI,CO,KPB,warps,stages;...'; conv_fused_bwd: 'warps,stages;...'",
    )
    opts = parser.parse_args(argv)
    unknown = [name for name in opts.jobs if name not in JOBS]
    if unknown:
        parser.error(f"unknown KERNEL {', '.join(unknown)} (choose from {', '.join(JOBS)})")
    jobs = [JOBS[name] for name in dict.fromkeys(opts.jobs or JOBS)]
    custom: dict[str, list[triton.Config]] = {}
    for option in TILE_OPTIONS:
        text = getattr(opts, option)
        if not text:
            continue
        flag = "--" + option.replace("_", "-")
        takers = [job.name for job in JOBS.values() if any(t.option == option for t in job.tiled)]
        others = [job.name for job in jobs if job.name not in takers]
        if others:
            parser.error(f"{flag} applies to {' and '.join(takers)} only, not to {', '.join(others)}")
        for job in jobs:
            for tiled in job.tiled:
                if tiled.option == option:
                    try:
                        custom[tiled.kernel] = parse_tiles(text, tiled)
                    except ValueError as err:
                        parser.error(f"{flag}: {err}")
    cases = {job.name: list(job.default_cases or job.cases) for job in jobs}
    if opts.cases:
        listed = [(name, case) for name, _, case in (
            c.partition(":") if ":" in c else ("", "", c) for c in opts.cases.split(","))]  # fmt: skip
        unnamed = sorted({name for name, _ in listed if name and name not in {job.name for job in jobs}})
        if unnamed:
            parser.error(f"--cases names {', '.join(unnamed)}, not a KERNEL of this run")
        for job in jobs:
            mine = [case for name, case in listed if name in ("", job.name)]
            unknown = [c for c in mine if c not in job.cases]
            if unknown:
                parser.error(
                    f"{job.name} has no case {', '.join(unknown)} (its cases: {', '.join(job.cases)})"
                )
            if mine:
                cases[job.name] = mine
    keep = {ext: Path(folder) for ext, folder in
            (("ptx", os.environ.get("KEEP_PTX")), ("ttgir", os.environ.get("KEEP_TTGIR")),
             ("sass", opts.dump_sass), ("cubin", opts.dump_sass)) if folder}  # fmt: skip
    print(f"triton {triton.__version__}, target {kc.TARGET}, ptxas {kc.PTXAS.name}", flush=True)
    failed = sum(JobRun(job, opts, custom, keep).run(cases[job.name]) for job in jobs)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
