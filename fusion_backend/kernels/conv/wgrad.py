"""The conv family's weight gradient (wgrad): one Triton implicit-GEMM kernel that recomputes the
forward's prologue while loading the input, split over M, and its host launcher :func:`conv_wgrad`.

``grad_w[g*Cog + co, ci, tap] = sum_m grad_y[m, g*Cog + co] * A[m, (tap, ci)]`` with ``A`` the forward's
implicit-GEMM input *after* its hooks: ``A = act_in(prologue(x))`` zero-padded, exactly the A tile
``fprop`` feeds its dot (``prologue.load_a_tile`` is shared).  So the caller saves the pre-prologue
tensor (the previous layer's output, which exists anyway) and never the normalised activation.
Optionally ``grad_bias[c] = sum_m grad_y[m, c]``.

GEMM mapping (ranks lifted to 3d as in ``fprop``):

* the result is the ``[C_out/g, K]`` matrix of each group, ``K`` in the forward's order (taps outer,
  channels inner; ``tiles`` explains the tap-major and flat K walks and their padding): a program owns
  one ``[BLOCK_N, BLOCK_K]`` tile of it (``BLOCK_N`` output channels, K step ``kk``);
* the reduction runs over ``M = N * OD * OH * OW`` output positions in ``BLOCK_M`` steps:
  ``acc += grad_y_tile^T @ A_tile`` (``[BLOCK_N, BLOCK_M] x [BLOCK_M, BLOCK_K]``, fp32 accumulator).

Split-K over M: M is long (every output position) while the result is small, so the M tiles are cut
into ``split`` contiguous runs of ``tiles_per_split`` tiles, one run per program along the grid's third
axis (``(K steps, N tiles, split * groups)``).  Each program writes its fp32 partial tile to its own
slot of a ``(split, groups, COUT_PAD, K_ROW)`` buffer (and its bias partial to ``(split, C_out)``);
nothing is accumulated with atomics.  One more launch (:func:`sum_splits_kernel`) sums each element's
slots in float64 in a fixed order, rounds once to the weight's dtype and stores it straight into the
gradient at the weight's strides (the padding dropped): for one plan (shapes, tile, split) the result
is the same bits on every run.  A different ``split`` or tile changes the order of the fp32 sums, not
the mapping.  With one split (the GEMM form's, ``DIRECT``) each program rounds its accumulators into the
gradient itself: no partials and no sum launch, the same bits.

Box loads (``TileConfig.box_w``; stride and dilation 1, 16-byte strides): the M tiles are boxes of the
output planes, as the forward's (``fprop`` module docstring), and both operands, the box of
``grad_y`` and the input block under it shifted by the tap, are tensor-descriptor loads with no
per-row index arithmetic (:func:`_box_weight_grad`).  NOTE: sm_90 SASS of ResNet-50's 3x3 (bf16, 128 x
64 x 64; ``python tools/compile_check.py conv_family --cases resnet_3x3-bf16-box --kernels wgrad --sass``
against ``resnet_3x3-bf16``): 57 instructions per MMA in the main loop against 64, of which the
masking of the boxes that hang over the plane's edge (8 x 16 boxes on 56 x 56: one column of 7 in
28) is about half and runs on those alone; not timed on a GPU yet.

Several taps per program (``TileConfig.taps_per_program`` 2 or 3; tap-major gather, the kernel's taps a
multiple): a program owns that many consecutive taps of one channel block, one accumulator each, and
loads each ``grad_y`` tile once for all of them, where one tap per program reads it once per tap (the
re-reads that bind this pass: ``docs/perf/RESULTS.md``, the conv kernels section).  The grid's first
dim shrinks by that factor; the partials' layout and their sum are the same.  The timed tile choice
weighs several taps on a 64 x 64 tile on 4 warps and on the heuristic's tile (``tiles.candidates``, NOTE
there: on the H200 three taps ran fastest on ResNet-50's 3x3s); ``tools/sweep_conv_tiles.py --taps`` times it on
every tile of its grid.
NOTE: sm_90a SASS, one tap against three per program on the same 8-warp, 3-stage tile (bf16; ``python
tools/compile_check.py conv_family --cases resnet_3x3-bf16-taps,resnet_3x3-bf16-hooked-taps,vae_3x3-bf16-taps
--kernels wgrad --sass``): ResNet-50's 3x3 at 128 x 64 x 64, 36.3 -> 20.2 instructions per MMA in the main
loop (with the BatchNorm + ReLU prologue 52.6 -> 37.4), registers 42 -> 116, shared memory 96 -> 192 KiB;
the SD VAE's 512-channel 3x3 at 64 x 128, 101.5 -> 42.9, no spill (on 4 warps three taps spill 32 bytes
there).

One input channel per group (depthwise): no GEMM (its K would be the taps alone) but one program per
(tap, channel block, split) summing ``grad_y * a`` over its split's rows (``_depthwise_weight_grad``),
into the same partial layout (no padding), summed by the same launch.

On sm_90 a tile with ``tma`` runs the Gluon kernel of ``tma_wgrad`` instead (stride 1, one group,
fp16/bf16): TMA boxes of both operands, the same partial layout and split sum; its tiles join the
timed choice where they have won (``tiles.tma_wgrad_tiles``).

Numerics: operands in the input dtype (fp16: fp32 accumulation), fp32 dots in TF32 iff allowed
(``tf32.backward_dot_precision``), the prologue in fp32 rounded once to the compute dtype (as the
forward does, so the recomputed A is the forward's A bit for bit).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from ..host import cdiv, element_extent, multiprocessors
from ..launch import FastLaunch
from ..plan_cache import ContractError, PlanCache, plan_key
from ..tf32 import backward_dot_precision, round_tf32
from . import halo, hooks, tma_wgrad
from .boxes import box_descriptor, box_grid, box_refusal
from .fprop import (
    _BIG_INDEX_THRESHOLD,
    _check_call,
    _Geometry,
    _hashable,
    channels_last,
    dense_channels_last,
    empty_channels_last,
    to_channels_last,
)
from .halo import window_tap, write_window
from .hooks import ActivationLike, Prologue
from .prologue import (
    box_coords,
    load_a_box,
    load_a_tile,
    load_depthwise_tile,
    window_rows,
)
from .split_sum import split_sum_blocks, sum_dim, sum_slots, weight_grad_offsets
from .tiles import TileConfig, cached_plan, candidates, tma_wgrad_programs, tma_wgrad_tiles, tuned_tile

#: Each split of a weight gradient's M keeps at least this many M tiles (``pick_split``).
_MIN_TILES_PER_SPLIT = 4


@triton.jit
def _dy_rows(n, od, oh, ow, dy_sn, dy_sd, dy_sh, dy_sw, BIG: tl.constexpr):
    """The element offsets of output rows ``(n, od, oh, ow)`` in ``grad_y`` (int64 for ``BIG``)."""
    if BIG:
        n, od, oh, ow = n.to(tl.int64), od.to(tl.int64), oh.to(tl.int64), ow.to(tl.int64)
    return n * dy_sn + od * dy_sd + oh * dy_sh + ow * dy_sw


@triton.jit
def _depthwise_weight_grad(x_ptr, dy_ptr, part_ptr, bpart_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, M, D, H, W,
                           C_IN, C_OUT, MULT, TILES_PER_SPLIT, x_sn, x_sd, x_sh, x_sw, dy_sn, dy_sd, dy_sh, dy_sw,
                           OD: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
                           KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                           SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                           PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                           DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                           PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr,
                           ACT_IN: tl.constexpr, BIAS_GRAD: tl.constexpr, BIG: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The weight gradient of a conv with one input channel per group (``fprop._depthwise_tile``'s):
    program ``(tap, channel block, split)`` sums ``grad_y[m, c] * a[m, tap, c // MULT]`` over its
    split's M tiles (``a`` the forward's prologue recomputed on load, rounded to the input dtype as the
    forward's), in fp32, into ``part[split, c, tap]`` (``(splits, C_OUT, taps)``, the GEMM form's
    ``(splits, groups, COUT_PAD, K_ROW)`` with one input channel per group); the tap-0 programs write
    the bias partials ``bpart[split, c]``."""
    TAPS: tl.constexpr = KD * KH * KW
    tap = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    c_ok = c < C_OUT
    ci = c // MULT
    mb = tl.arange(0, BLOCK_M)
    # per (row, channel) products summed over the M steps, the rows summed once after the loop: a sum
    # over the tile's rows per step would cross threads every step
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    bacc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for t in range(0, TILES_PER_SPLIT):
        m = (split * TILES_PER_SPLIT + t) * BLOCK_M + mb
        m_ok = m < M
        n, od, oh, ow, id0, ih0, iw0, row_base = window_rows(m, OD, OH, OW, SD, SH, SW, PD, PH, PW, x_sn, x_sd,
                                                             x_sh, x_sw, BIG)  # fmt: skip
        a = load_depthwise_tile(x_ptr, tap, row_base, n, id0, ih0, iw0, m_ok, ci, c_ok, D, H, W, x_sd, x_sh, x_sw,
                                p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN, KH, KW, DD, DH, DW, PROLOGUE,
                                G_NORM, NORM_AFFINE, ACT_IN, x_ptr.dtype.element_ty)  # fmt: skip
        dy = tl.load(dy_ptr + _dy_rows(n, od, oh, ow, dy_sn, dy_sd, dy_sh, dy_sw, BIG)[:, None] + c[None, :],
                     mask=m_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc += dy * a.to(tl.float32)
        if BIAS_GRAD:
            bacc += dy
    tl.store(part_ptr + (split * C_OUT + c) * TAPS + tap, tl.sum(acc, axis=0), mask=c_ok)
    if BIAS_GRAD:
        if tap == 0:
            tl.store(bpart_ptr + split * C_OUT + c, tl.sum(bacc, axis=0), mask=c_ok)


@triton.jit
def _depthwise_halo_weight_grad(x_ptr, dy_ptr, scratch_ptr, part_ptr, bpart_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
                                slope_in, M, H, W, C_IN, C_OUT, TILES_PER_SPLIT, dy_sn, dy_sd, dy_sh, dy_sw,
                                OD: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr, KH: tl.constexpr,
                                KW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr,
                                DW: tl.constexpr, PROLOGUE: tl.constexpr, G_NORM: tl.constexpr,
                                NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr, BIAS_GRAD: tl.constexpr,
                                BIG: tl.constexpr, HALO_CAP: tl.constexpr, HALO_CHUNK: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """:func:`_depthwise_weight_grad` with the halo (``HALO``; a 'same' stride-1 1-d/2-d depthwise conv
    without a channel multiplier, x channels-last dense): program ``(0, channel block, split)`` puts each M
    step's window of rows (``BLOCK_M + (KH - 1) * DH * W + (KW - 1) * DW`` of them, ``halo.write_window``)
    through the prologue once, reads the step's ``grad_y`` tile once, and sums every tap's products from
    the window (``halo.window_tap``) into one row of ``[taps, BLOCK_N]`` fp32 accumulators; the same
    partials (``part[split, c, tap]``) and bias partials."""
    TAPS: tl.constexpr = KH * KW
    TAPS_P2: tl.constexpr = triton.next_power_of_2(TAPS)
    PADDED: tl.constexpr = (PH > 0) or (PW > 0)
    pid_c = tl.program_id(1)
    split = tl.program_id(2)
    slot = scratch_ptr + (pid_c + tl.num_programs(1) * split) * (HALO_CAP * BLOCK_N)
    c = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = c < C_OUT
    mb = tl.arange(0, BLOCK_M)
    taps = tl.arange(0, TAPS_P2)
    acc = tl.zeros([TAPS_P2, BLOCK_N], tl.float32)
    bacc = tl.zeros([BLOCK_N], tl.float32)
    for t in range(0, TILES_PER_SPLIT):
        m0 = (split * TILES_PER_SPLIT + t) * BLOCK_M
        m = m0 + mb
        m_ok = m < M
        mc = tl.minimum(m, M - 1)
        ow = mc % OW
        oh = (mc // OW) % OH
        n = mc // (OW * OH * OD)
        write_window(x_ptr, slot, m0 - (PH * W + PW), M, c, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                     H * W, BLOCK_M + (KH - 1) * DH * W + (KW - 1) * DW, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN, BIG,
                     HALO_CHUNK, BLOCK_N)  # fmt: skip
        dy = tl.load(dy_ptr + _dy_rows(n, tl.zeros_like(oh), oh, ow, dy_sn, dy_sd, dy_sh, dy_sw, BIG)[:, None]
                     + c[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        for tap in range(0, TAPS):  # a loop, not unrolled: the taps' loads all in flight spilled (as the forward's)
            a = window_tap(slot, tap, oh, ow, m_ok, c_ok, H, W, KW, PH, PW, DH, DW, PADDED, BLOCK_M, BLOCK_N)
            acc += tl.where(taps[:, None] == tap, tl.sum(dy * a.to(tl.float32), axis=0)[None, :], 0.0)
        if BIAS_GRAD:
            bacc += tl.sum(dy, axis=0)
    tl.store(part_ptr + (split * C_OUT + c)[None, :] * TAPS + taps[:, None], acc,
             mask=(taps < TAPS)[:, None] & c_ok[None, :])  # fmt: skip
    if BIAS_GRAD:
        tl.store(bpart_ptr + split * C_OUT + c, bacc, mask=c_ok)


# NOTE: every M step peels its rows' output coordinates (two divisions per row); by runtime sizes a
# division is a dozen instructions, by constexprs a multiply-high: the main loop of ResNet-50's 3x3 wgrad
# (bf16, 128 x 64 x 64 tile, sm_90) went from 776 to 504 SASS instructions per step, 97 to 63 per MMA,
# hooked from 993 to 747 (``python tools/compile_check.py conv_family --cases
# resnet_3x3-bf16,resnet_3x3-bf16-hooked --kernels wgrad --sass``).  The price: one compile per output size.
@triton.jit
def conv_wgrad_kernel(
    x_ptr, dy_ptr, x_desc, dy_desc, scratch_ptr, part_ptr, bpart_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
    out_ptr, slope_in,
    M, D, H, W, C_IN, C_OUT, C_OUT_G, TILES_PER_SPLIT, GROUPS, OH_TILES, OW_TILES,
    x_sn, x_sd, x_sh, x_sw, dy_sn, dy_sd, dy_sh, dy_sw, w_so, w_si, w_sd, w_sh, w_sw,
    OD: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
    C_IN_G: tl.constexpr, CIN_PAD: tl.constexpr, K_ROW: tl.constexpr, COUT_PAD: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr,
    BIAS_GRAD: tl.constexpr, PRECISION: tl.constexpr, BIG: tl.constexpr, FLAT_K: tl.constexpr,
    DEPTHWISE: tl.constexpr, BOX_W: tl.constexpr, TAPS_PER_PROGRAM: tl.constexpr, HALO: tl.constexpr,
    HALO_CAP: tl.constexpr, HALO_CHUNK: tl.constexpr, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_N, BLOCK_K]`` partial tile of group ``g`` over split ``s``'s M tiles, where
    ``program_id(2) = s * GROUPS + g`` (module docstring); with ``BOX_W`` the M tiles are boxes of the
    output planes and both operands are loaded as boxes (:func:`_box_weight_grad`).  ``TAPS_PER_PROGRAM``
    (2 or 3; tap-major, gather): the program owns that many consecutive taps of one channel block, one
    accumulator each, and reads each ``grad_y`` tile once for all of them (``TileConfig.taps_per_program``).
    ``HALO`` (a depthwise conv's alone: :func:`_depthwise_halo_weight_grad`).

    Pointers (element offsets):
      x_ptr     the forward's input before its prologue, (N, C_IN, D, H, W), channel stride 1: element
                ``(n, c, d, h, w)`` at ``n * x_sn + d * x_sd + h * x_sh + w * x_sw + c``.
      dy_ptr    grad_y (N, C_OUT, OD, OH, OW), x's dtype, channel stride 1, strides ``dy_s*``.
      part_ptr  fp32 (splits, GROUPS, COUT_PAD, K_ROW) contiguous: every element written once (the
                padding included: padded channels and K entries come out 0).
      bpart_ptr BIAS_GRAD: fp32 (splits, C_OUT) contiguous, written by the ``kk == 0`` programs.
      x_desc, dy_desc ``BOX_W``: tensor descriptors of x and grad_y (``_box_weight_grad``); else any
                tensors, unused.
      scratch_ptr ``HALO``: the depthwise halo's slots (:func:`_depthwise_halo_weight_grad`); else any
                tensor, unused.
      p0..p3    the forward's prologue vectors (``prologue.normalise``).
      out_ptr   ``DIRECT``: the weight gradient, element ``(co, ci, kd, kh, kw)`` at ``co * w_so + ci * w_si +
                kd * w_sd + kh * w_sh + kw * w_sw``; else any tensor, unused.
    ``DIRECT`` (one split, the GEMM form's): each program rounds its accumulators into the gradient
    itself, no partials and no sum launch (the same bits: the sum launch adds one slot in float64).
    Runtime: ``slope_in`` the leaky slope of ``ACT_IN``; ``M = N * OD * OH * OW``; ``TILES_PER_SPLIT``
    the M tiles of one split; ``OH_TILES`` / ``OW_TILES`` the boxes along an output plane (``BOX_W``).  Constexprs: the output's sizes ``OD, OH, OW``, then as
    ``fprop.conv_fprop_kernel``'s (``K_ROW``: the K extent of one output channel, a multiple of ``BLOCK_K``).
    """
    if DEPTHWISE and HALO:  # program (channel block, split), every tap from one window per M step
        _depthwise_halo_weight_grad(x_ptr, dy_ptr, scratch_ptr, part_ptr, bpart_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
                                    slope_in, M, H, W, C_IN, C_OUT, TILES_PER_SPLIT, dy_sn, dy_sd, dy_sh, dy_sw, OD,
                                    OH, OW, KH, KW, PH, PW, DH, DW, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN, BIAS_GRAD,
                                    BIG, HALO_CAP, HALO_CHUNK, BLOCK_M, BLOCK_N)  # fmt: skip
        return
    if DEPTHWISE:  # one input channel per group: program (tap, channel block, split), no GEMM
        _depthwise_weight_grad(x_ptr, dy_ptr, part_ptr, bpart_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, M, D, H,
                               W, C_IN, C_OUT, C_OUT_G, TILES_PER_SPLIT, x_sn, x_sd, x_sh, x_sw, dy_sn, dy_sd, dy_sh,
                               dy_sw, OD, OH, OW, KD, KH, KW, SD, SH, SW, PD, PH, PW, DD, DH, DW, PROLOGUE, G_NORM,
                               NORM_AFFINE, ACT_IN, BIAS_GRAD, BIG, BLOCK_M, BLOCK_N)  # fmt: skip
        return
    kk = tl.program_id(0)
    CB: tl.constexpr = CIN_PAD // BLOCK_K  # channel blocks per tap (tap-major)
    if TAPS_PER_PROGRAM > 1:  # program (tap group, channel block): its first K step
        kk = (kk // CB) * (TAPS_PER_PROGRAM * CB) + kk % CB
    pid_n = tl.program_id(1)
    pid_z = tl.program_id(2)
    g = pid_z % GROUPS
    split = pid_z // GROUPS
    compute = x_ptr.dtype.element_ty

    co = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    co_ok = co < C_OUT_G
    mb = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # TAPS_PER_PROGRAM > 1: the next taps' (else unused)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    bacc = tl.zeros([BLOCK_N], tl.float32)
    PADDED: tl.constexpr = (PD > 0) or (PH > 0) or (PW > 0)
    if BOX_W > 0:
        acc, bacc = _box_weight_grad(x_desc, dy_desc, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, kk, pid_n, g, split,
                                     acc, bacc, D, H, W, C_IN, C_OUT_G, TILES_PER_SPLIT, OH_TILES, OW_TILES, OD, OH,
                                     OW, C_IN_G, CIN_PAD, KH, KW, PD, PH, PW, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN,
                                     PADDED, BIAS_GRAD, PRECISION, compute, BOX_W, BLOCK_M, BLOCK_N,
                                     BLOCK_K)  # fmt: skip
    else:
        for t in range(0, TILES_PER_SPLIT):
            m = (split * TILES_PER_SPLIT + t) * BLOCK_M + mb
            m_ok = m < M
            # rows past M address the last row's window, read as 0 (``load_a_tile``'s ROWS_ZERO)
            n, od, oh, ow, id0, ih0, iw0, row_base = window_rows(tl.minimum(m, M - 1), OD, OH, OW, SD, SH, SW, PD, PH,
                                                                 PW, x_sn, x_sd, x_sh, x_sw, BIG)  # fmt: skip
            dy_row = _dy_rows(n, od, oh, ow, dy_sn, dy_sd, dy_sh, dy_sw, BIG)
            row_base += g * C_IN_G
            a = load_a_tile(x_ptr, kk, row_base, n, id0, ih0, iw0, m_ok, g, D, H, W, x_sd, x_sh, x_sw,
                            p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                            C_IN_G, CIN_PAD, KD, KH, KW, DD, DH, DW, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN,
                            FLAT_K, PADDED, True, compute, BLOCK_K)  # fmt: skip
            dy_mask = m_ok[:, None] & co_ok[None, :]
            dy = tl.load(dy_ptr + (dy_row + g * C_OUT_G)[:, None] + co[None, :], mask=dy_mask, other=0.0)
            dy_t = round_tf32(tl.trans(dy), PRECISION)
            acc = tl.dot(dy_t, round_tf32(a, PRECISION), acc, input_precision=PRECISION)
            if TAPS_PER_PROGRAM > 1:  # the same grad_y tile against the next taps' A tiles
                a = load_a_tile(x_ptr, kk + CB, row_base, n, id0, ih0, iw0, m_ok, g, D, H, W, x_sd, x_sh, x_sw,
                                p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                                C_IN_G, CIN_PAD, KD, KH, KW, DD, DH, DW, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN,
                                False, PADDED, True, compute, BLOCK_K)  # fmt: skip
                acc1 = tl.dot(dy_t, round_tf32(a, PRECISION), acc1, input_precision=PRECISION)
            if TAPS_PER_PROGRAM > 2:
                a = load_a_tile(x_ptr, kk + 2 * CB, row_base, n, id0, ih0, iw0, m_ok, g, D, H, W, x_sd, x_sh,
                                x_sw, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                                C_IN_G, CIN_PAD, KD, KH, KW, DD, DH, DW, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN,
                                False, PADDED, True, compute, BLOCK_K)  # fmt: skip
                acc2 = tl.dot(dy_t, round_tf32(a, PRECISION), acc2, input_precision=PRECISION)
            if BIAS_GRAD:
                bacc += tl.sum(dy.to(tl.float32), axis=0)

    k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
    if DIRECT:  # one split: the accumulators are the gradient
        dst, ok = weight_grad_offsets(g, co[:, None], k[None, :], C_OUT_G, w_so, w_si, w_sd, w_sh, w_sw, C_IN_G,
                                      CIN_PAD, KD, KH, KW, FLAT_K)  # fmt: skip
        tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=ok)
        if TAPS_PER_PROGRAM > 1:  # the next taps' K entries: one tap further is CB K steps further
            dst, ok = weight_grad_offsets(g, co[:, None], (k + CB * BLOCK_K)[None, :], C_OUT_G, w_so, w_si, w_sd,
                                          w_sh, w_sw, C_IN_G, CIN_PAD, KD, KH, KW, FLAT_K)  # fmt: skip
            tl.store(out_ptr + dst, acc1.to(out_ptr.dtype.element_ty), mask=ok)
        if TAPS_PER_PROGRAM > 2:
            dst, ok = weight_grad_offsets(g, co[:, None], (k + 2 * CB * BLOCK_K)[None, :], C_OUT_G, w_so, w_si,
                                          w_sd, w_sh, w_sw, C_IN_G, CIN_PAD, KD, KH, KW, FLAT_K)  # fmt: skip
            tl.store(out_ptr + dst, acc2.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        slot = split * GROUPS + g
        if BIG:
            slot = slot.to(tl.int64)
        rows = part_ptr + (slot * COUT_PAD + co)[:, None] * K_ROW
        tl.store(rows + k[None, :], acc)
        if TAPS_PER_PROGRAM > 1:
            tl.store(rows + (k + CB * BLOCK_K)[None, :], acc1)
        if TAPS_PER_PROGRAM > 2:
            tl.store(rows + (k + 2 * CB * BLOCK_K)[None, :], acc2)
    if BIAS_GRAD:
        if kk == 0:
            tl.store(bpart_ptr + split * C_OUT + g * C_OUT_G + co, bacc, mask=co_ok)


@triton.jit
def _box_weight_grad(x_desc, dy_desc, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, kk, pid_n, g, split, acc, bacc, D, H, W,
                     C_IN, C_OUT_G, TILES_PER_SPLIT, OH_TILES, OW_TILES, OD: tl.constexpr, OH: tl.constexpr,
                     OW: tl.constexpr, C_IN_G: tl.constexpr, CIN_PAD: tl.constexpr, KH: tl.constexpr,
                     KW: tl.constexpr, PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, PROLOGUE: tl.constexpr,
                     G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr, PADDED: tl.constexpr,
                     BIAS_GRAD: tl.constexpr, PRECISION: tl.constexpr, COMPUTE: tl.constexpr, BOX_W: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``(acc, bacc)`` summed over split ``split``'s boxes (stride and dilation 1): box ``b`` is ``(n, od,
    th, tw)`` of the output (``tw`` fastest: ``prologue.box_coords``), its ``grad_y`` one box of
    ``dy_desc`` ((N, OD, OH, OW, C_OUT) block ``(1, 1, BOX_H, BOX_W, BLOCK_N)``) and its A tile the
    forward's (``prologue.load_a_box`` on ``x_desc``).  Boxes past the last (a split's tail) and the
    positions past the plane's edge read ``grad_y`` as 0 (outside its descriptor); their A rows are
    zeroed too where the box does not divide the plane, as the gather's rows past M are (an infinite
    input times 0 would be NaN)."""
    BOX_H: tl.constexpr = BLOCK_M // BOX_W
    EDGE: tl.constexpr = (OH % BOX_H != 0) or (OW % BOX_W != 0)
    for t in range(0, TILES_PER_SPLIT):
        n, od, th, tw, oh, ow = box_coords(split * TILES_PER_SPLIT + t, OD, OH_TILES, OW_TILES, BOX_W, BLOCK_M)
        dy = tl.reshape(dy_desc.load([n, od, th * BOX_H, tw * BOX_W, g * C_OUT_G + pid_n * BLOCK_N]),
                        [BLOCK_M, BLOCK_N])  # fmt: skip
        a = load_a_box(x_desc, kk, n, od, th * BOX_H, tw * BOX_W, oh, ow, g, D, H, W, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
                       slope_in, C_IN, C_IN_G, CIN_PAD, KH, KW, PD, PH, PW, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN,
                       PADDED, COMPUTE, BOX_H, BOX_W, BLOCK_K)  # fmt: skip
        if EDGE:  # a box that does not divide the plane: its last row and column of boxes hang over
            if (th == OH_TILES - 1) | (tw == OW_TILES - 1):
                a = tl.where(((oh < OH) & (ow < OW))[:, None], a, 0.0).to(COMPUTE)
        acc = tl.dot(round_tf32(tl.trans(dy), PRECISION), round_tf32(a, PRECISION), acc, input_precision=PRECISION)
        if BIAS_GRAD:
            bacc += tl.sum(dy.to(tl.float32), axis=0)
    return acc, bacc


@triton.jit
def sum_splits_kernel(part_ptr, out_ptr, SPLIT, TOTAL, C_OUT_G, w_so, w_si, w_sd, w_sh, w_sw,
                      C_IN_G: tl.constexpr, CIN_PAD: tl.constexpr, K_ROW: tl.constexpr, COUT_PAD: tl.constexpr,
                      KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, FLAT_K: tl.constexpr,
                      BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr):  # fmt: skip
    """``BLOCK`` elements of the weight gradient: element ``e`` of the ``(GROUPS, COUT_PAD, K_ROW)``
    partial layout (``TOTAL`` of them per split), summed over its ``SPLIT`` slots in float64
    (``split_sum.sum_slots``: a fixed order for one plan), rounded once to ``out_ptr``'s dtype and stored at ``(g * C_OUT_G + co) * w_so + ci
    * w_si + kd * w_sd + kh * w_sh + kw * w_sw``; padded output channels and K entries are not stored.
    How many of each per program: ``split_sum.split_sum_blocks``."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = e < TOTAL
    k = e % K_ROW
    row = e // K_ROW
    acc = sum_slots(part_ptr, e, in_range, SPLIT, TOTAL, SPLIT_BLOCK, "")  # slot s of element e at s * TOTAL + e
    dst, ok = weight_grad_offsets(row // COUT_PAD, row % COUT_PAD, k, C_OUT_G, w_so, w_si, w_sd, w_sh, w_sw, C_IN_G,
                                  CIN_PAD, KD, KH, KW, FLAT_K)  # fmt: skip
    tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=in_range & ok)


def sum_splits_launch(geo: _Geometry, split: int, cin_pad: int, k_row: int, cout_pad: int, flat_k: bool) -> FastLaunch:
    """The launch of :func:`sum_splits_kernel` over a plan's ``(split, groups, cout_pad, k_row)`` partials
    (its blocks: ``split_sum.split_sum_blocks``)."""
    total = geo.groups * cout_pad * k_row
    block, slots = split_sum_blocks(total, split)
    return FastLaunch(sum_splits_kernel, (cdiv(total, block),), dict(
        C_IN_G=geo.c_in_g, CIN_PAD=cin_pad, K_ROW=k_row, COUT_PAD=cout_pad, KD=geo.kernel[0], KH=geo.kernel[1],
        KW=geo.kernel[2], FLAT_K=flat_k, BLOCK=block, SPLIT_BLOCK=slots, num_warps=4))  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host
# --------------------------------------------------------------------------------------------------


def wgrad_box_refusal(geo: _Geometry, x: torch.Tensor, dy: torch.Tensor, tile: TileConfig | None) -> str:
    """Why the weight gradient of a call of geometry ``geo`` cannot load ``x`` and ``dy`` (channels-last,
    as the kernel reads them) as boxes with ``tile`` (None: any box tile); "" where it can:
    ``boxes.box_refusal``'s rules for both, a group's channel tail free (its K entries are dropped)."""
    return (box_refusal(geo, x, tile)
            or box_refusal(geo, dy, tile, what="grad_y"))  # fmt: skip


def pick_split(m_tiles: int, programs_per_split: int, tile: TileConfig, device: torch.device) -> int:
    """How many splits of M a launch of ``programs_per_split`` programs (K steps x N tiles x groups)
    over ``m_tiles`` M tiles uses (module docstring): enough for ``tile.programs_per_sm`` programs per SM
    of ``device``, never so many that a split holds fewer than ``_MIN_TILES_PER_SPLIT`` tiles; at least 1.
    Each split writes and the split sum reads one fp32 partial of the whole gradient: where a program's
    reads are few (a short M, a wide gradient), fewer splits win (``TileConfig.programs_per_sm``); where
    one split's programs reach that many, the programs write the gradient themselves (``DIRECT``).
    ``tile.one_split``: one split, whatever the programs.
    NOTE: one wave instead (at most one program per SM for ``programs_per_sm`` 1, so one split from 67
    programs on) was slower where it took one split of fewer programs than SMs: R3D-18's 3x3x3 of 256
    channels at 4 x 14 x 14, 108 programs, 0.0782 ms against two splits' 0.0685 (H200, bf16, ``python
    tools/bench_conv.py demos/realnets/r3d_18.py --passes wgrad --no-hooks --filter '*k3x3x3 p1 g1*'``,
    ``tile_ms``)."""
    if tile.one_split:
        return 1
    want = cdiv(multiprocessors(device) * tile.programs_per_sm, max(1, programs_per_split))
    return max(1, min(want, m_tiles // _MIN_TILES_PER_SPLIT))


def _spatial_strides(t: torch.Tensor) -> list[int]:
    """``(sn, sd, sh, sw)`` element strides of an (N, C, *spatial) tensor, lifted to 3 spatial dims."""
    strides = list(t.stride()[2:])
    return [t.stride(0), *([0] * (3 - len(strides))), *strides]


def _gradient_strides(weight: torch.Tensor) -> tuple[int, ...]:
    """The element strides of ``weight``'s gradient as :meth:`_WgradPlan.run` allocates it
    (``empty_like(weight)``: the weight's where it is dense) over (output channel, input channel, kd, kh,
    kw), the kernel dims lifted to 3 (a missing dim: stride 0)."""
    strides = torch.empty_like(weight, device="meta").stride()
    return (strides[0], strides[1], *([0] * (5 - weight.dim())), *strides[2:])


def _layout_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if channels-last (channel stride 1), else a meta channels-last tensor of its shape:
    the strides the kernel will read after the relayout."""
    return t if channels_last(t) else empty_channels_last(t.shape, t.dtype, torch.device("meta"))


class _WgradPlan:
    """Everything :func:`conv_wgrad` derives from a call's signature, built once (``_PLANS``)."""

    def __init__(self, geo: _Geometry, x: torch.Tensor, grad_y: torch.Tensor, weight: torch.Tensor,
                 prologue: Prologue | None, act_in: int, bias_grad: bool, tile: TileConfig, split: int | None,
                 precision: str) -> None:  # fmt: skip
        self.geo, self.tile, self.bias_grad = geo, tile, bias_grad
        self.dtype, self.device = x.dtype, x.device
        self.w_strides = _gradient_strides(weight)
        self.relayout_x, self.relayout_dy = not channels_last(x), not channels_last(grad_y)
        xs, dys = _layout_of(x), _layout_of(grad_y)
        big = max(element_extent(xs), element_extent(dys)) > _BIG_INDEX_THRESHOLD
        #: one input channel per group: the direct depthwise sums (``_depthwise_weight_grad``), whose
        #: partials are the GEMM form's with no padding (CIN_PAD 1, K_ROW the taps, COUT_PAD the multiplier)
        self.depthwise = geo.c_in_g == 1
        flat_k = tile.flat_k and not self.depthwise
        self.cin_pad = 1 if self.depthwise else cdiv(geo.c_in_g, tile.block_k) * tile.block_k
        k = geo.taps * geo.c_in_g
        self.k_row = cdiv(k, tile.block_k) * tile.block_k if flat_k else geo.taps * self.cin_pad
        self.cout_pad = geo.c_out_g if self.depthwise else cdiv(geo.c_out_g, tile.block_n) * tile.block_n
        m_tiles = cdiv(geo.m, tile.block_m)
        #: the Gluon kernel (``tma_wgrad``): TMA boxes of both operands, wgmma on them as they landed
        self.tma = tile.tma
        if self.tma:
            self._init_tma(geo, x, grad_y, weight, prologue, act_in, bias_grad, tile, split, big)
            return
        #: the M tiles are boxes of the output planes (``_box_weight_grad``): ``(OH_TILES, OW_TILES)`` per plane
        self.box = bool(tile.box_w)
        box_tiles = (0, 0)
        if self.box:
            box_tiles, m_tiles = box_grid(geo.out_size, geo.n, tile, wgrad_box_refusal(geo, xs, dys, tile))
        taps_per = tile.taps_per_program
        if taps_per > 1 and (self.depthwise or geo.taps % taps_per):  # (the tile's own walk: ``TileConfig.check``)
            raise ContractError(f"tile taps_per_program={taps_per} needs a kernel whose {geo.taps} taps it divides, "
                                "with more than one input channel per group")
        if self.depthwise:  # grid (taps, channel blocks, splits); with the halo every tap in one program
            k_steps, n_tiles = 1 if tile.halo else geo.taps, cdiv(geo.c_out, tile.block_n)
        else:  # programs: K steps, or (tap groups x channel blocks) with several taps per program
            k_steps, n_tiles = self.k_row // tile.block_k // taps_per, self.cout_pad // tile.block_n
        programs = k_steps * n_tiles * (1 if self.depthwise else geo.groups)
        split = pick_split(m_tiles, programs, tile, x.device) if split is None else min(split, max(1, m_tiles))
        tiles_per_split = cdiv(m_tiles, split)
        self.split = cdiv(m_tiles, tiles_per_split) if m_tiles else 1  # no empty split
        big = big or self.split * geo.groups * self.cout_pad * self.k_row > _BIG_INDEX_THRESHOLD
        g_norm, norm_affine = 1, False
        if isinstance(prologue, hooks.GroupAffine):
            g_norm, norm_affine = prologue.groups, prologue.weight is not None
        #: the halo's scratch (``HALO``): one slot per program of ``halo_cap`` rows (elements; 0: none)
        # steps of 32 rows: the forward's wider steps (``halo.halo_chunk``) were not timed on this kernel
        self.scratch_elems, halo_cap, chunk = 0, 0, halo.HALO_CHUNKS[-1]
        if tile.halo:  # a depthwise conv's alone (NOTE at ``conv_wgrad``'s candidates)
            why = "a conv that is not depthwise" if not self.depthwise else halo.applies(
                geo, not self.relayout_x and dense_channels_last(x), False)  # fmt: skip
            if why is not None:
                raise ContractError(f"tile {tile.label()}: the halo weight gradient does not take {why}")
            # one window of every tap's rows per program and M step
            rows = halo.halo_rows(tile.block_m, geo.size[2], geo.kernel[1:], geo.dilation[1:])
            halo_cap = cdiv(rows, chunk) * chunk
            self.scratch_elems = n_tiles * self.split * halo_cap * tile.block_n
        constexprs = dict(
            C_IN_G=geo.c_in_g, CIN_PAD=self.cin_pad, K_ROW=self.k_row, COUT_PAD=self.cout_pad,
            KD=geo.kernel[0], KH=geo.kernel[1], KW=geo.kernel[2],
            SD=geo.stride[0], SH=geo.stride[1], SW=geo.stride[2],
            PD=geo.padding[0], PH=geo.padding[1], PW=geo.padding[2],
            DD=geo.dilation[0], DH=geo.dilation[1], DW=geo.dilation[2],
            PROLOGUE=hooks.prologue_code(prologue), G_NORM=g_norm, NORM_AFFINE=norm_affine, ACT_IN=act_in,
            BIAS_GRAD=bias_grad, PRECISION=precision, BIG=big, FLAT_K=flat_k, DEPTHWISE=self.depthwise,
            BOX_W=tile.box_w, TAPS_PER_PROGRAM=tile.taps_per_program, HALO=tile.halo, HALO_CAP=halo_cap,
            HALO_CHUNK=chunk, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )  # fmt: skip
        #: one split of the GEMM form: the programs write the gradient themselves (``DIRECT``); the
        #: depthwise sums keep the sum launch
        self.direct = self.split == 1 and not self.depthwise
        # the output's sizes are constexprs: every M step peels its rows' coordinates by them, and a
        # division by a constant is a multiply (NOTE at ``conv_wgrad_kernel``)
        constexprs.update(OD=geo.out_size[0], OH=geo.out_size[1], OW=geo.out_size[2], DIRECT=self.direct)
        fixed = (geo.m, *geo.size, geo.c_in, geo.c_out, geo.c_out_g, tiles_per_split, geo.groups, *box_tiles,
                 *_spatial_strides(xs), *_spatial_strides(dys), *self.w_strides)  # fmt: skip
        grid = (k_steps, n_tiles, self.split * (1 if self.depthwise else geo.groups))
        self.launch = FastLaunch(conv_wgrad_kernel, grid, constexprs, fixed=fixed)
        self.sum_splits = sum_splits_launch(geo, self.split, self.cin_pad, self.k_row, self.cout_pad, flat_k)

    def _init_tma(self, geo: _Geometry, x: torch.Tensor, grad_y: torch.Tensor, weight: torch.Tensor,
                  prologue: Prologue | None, act_in: int, bias_grad: bool, tile: TileConfig, split: int | None,
                  big: bool) -> None:  # fmt: skip
        """The plan of a ``tma`` tile (``tma_wgrad``): its partials in the gather kernel's tap-major
        layout, summed by the same launch."""
        why = tma_wgrad.refusal(geo, x.dtype, tile)
        if not why and not tma_wgrad.supports(x, grad_y, weight, geo.stride, geo.groups):
            why = "the call is outside the TMA weight gradient's contract (tma_wgrad.supports)"
        if why:
            raise ContractError(f"tile {tile.label()}: {why}")
        self.depthwise = self.box = False
        self.relayout_x = self.relayout_dy = False  # (the launch reads dense channels-last copies itself)
        self.cin_pad = cdiv(geo.c_in, tile.block_k) * tile.block_k
        self.cout_pad = cdiv(geo.c_out, tile.block_n) * tile.block_n
        self.k_row = geo.taps * self.cin_pad
        g_norm, norm_affine = 1, False
        if isinstance(prologue, hooks.GroupAffine):
            g_norm, norm_affine = prologue.groups, prologue.weight is not None
        boxes = geo.n * geo.out_size[0] * cdiv(geo.out_size[1], tile.box_h) * cdiv(geo.out_size[2], tile.box_w)
        programs = tma_wgrad_programs(tile, geo.c_in, geo.c_out, geo.taps)
        want = pick_split(boxes, programs, tile, x.device) if split is None else split
        big = big or want * self.cout_pad * self.k_row > _BIG_INDEX_THRESHOLD
        hook_codes = dict(PROLOGUE=hooks.prologue_code(prologue), G_NORM=g_norm, NORM_AFFINE=norm_affine,
                          ACT_IN=act_in, BIG=big)  # fmt: skip
        self.launch = tma_wgrad.TmaWgradLaunch(tile, geo, self.k_row, self.cout_pad, max(1, want),
                                               hook_codes, x.dtype, self.w_strides)  # fmt: skip
        self.split, self.direct = self.launch.split, self.launch.direct
        self.sum_splits = sum_splits_launch(geo, self.split, self.cin_pad, self.k_row, self.cout_pad, False)

    def run(self, grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, prologue: Prologue | None,
            slope_in: float) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        geo = self.geo
        grad_w = torch.empty_like(weight)
        if geo.m == 0:  # N == 0: empty sums, nothing to launch
            grad_w.zero_()
            return grad_w, (torch.zeros(geo.c_out, dtype=self.dtype, device=self.device) if self.bias_grad else None)
        if self.relayout_x:
            x = to_channels_last(x)
        if self.relayout_dy:
            grad_y = to_channels_last(grad_y)
        part = (grad_w if self.direct else
                torch.empty((self.split, geo.groups, self.cout_pad, self.k_row), dtype=torch.float32,
                            device=self.device))  # fmt: skip
        p = [part if t is None else t for t in hooks.prologue_tensors(prologue)]
        if self.tma:
            x, grad_y = tma_wgrad.dense_channels_last(x), tma_wgrad.dense_channels_last(grad_y)
            self.launch(x, grad_y, part, *p, grad_w, slope_in)
            if not self.direct:
                self.sum_splits(part, grad_w, self.split, part[0].numel(), geo.c_out_g, *self.w_strides)
            # NOTE: the TMA kernel leaves the bias gradient to one reduction of grad_y: summed in the
            # kernel by the programs of the first K step, it held the launch to those programs' time (the
            # SD VAE decoder's 512-channel 3x3 at 256 x 256, batch 1, bf16, H200: 1.268 ms with the bias
            # against 0.750-0.778 without, cuDNN 0.67 with it; ``docs/perf/RESULTS.md``, "Wider tiles for
            # the TMA weight gradient").  torch's reduction is deterministic for one shape.
            dims = [d for d in range(grad_y.dim()) if d != 1]
            grad_b = grad_y.sum(dims, dtype=torch.float32).to(self.dtype) if self.bias_grad else None
            return grad_w, grad_b
        bpart = torch.empty((self.split, geo.c_out), dtype=torch.float32, device=self.device) if self.bias_grad else part
        x_desc: Any = x
        dy_desc: Any = grad_y
        if self.box:
            tile = self.tile
            x_desc = box_descriptor(x, [1, 1, tile.box_h, tile.box_w, tile.block_k])
            dy_desc = box_descriptor(grad_y, [1, 1, tile.box_h, tile.box_w, tile.block_n])
        scratch = torch.empty(self.scratch_elems, dtype=x.dtype, device=self.device) if self.scratch_elems else part
        self.launch(x, grad_y, x_desc, dy_desc, scratch, part, bpart, *p, grad_w, slope_in)
        if not self.direct:
            self.sum_splits(part, grad_w, self.split, part[0].numel(), geo.c_out_g, *self.w_strides)
        grad_b = (bpart[0] if self.split == 1 else sum_dim(bpart, 0)).to(self.dtype) if self.bias_grad else None
        return grad_w, grad_b


#: Launch plans by ``plan_key`` of a call's signature.
_PLANS = PlanCache()


def conv_wgrad(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    prologue: Prologue | None = None,
    act_in: ActivationLike = None,
    bias_grad: bool = False,
    tile: TileConfig | None = None,
    split: int | None = None,
    allow_tf32: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (and bias) gradient of ``conv_fprop(x, weight, prologue=prologue, act_in=act_in,
    stride=..., padding=..., dilation=..., groups=...)`` for the output gradient ``grad_y``, the
    forward's prologue and input activation recomputed while loading ``x`` (module docstring).

    grad_y    (N, C_out, *out_spatial) as the forward's output, x's dtype; channels-last strides are
              read in place, any other layout (NCHW) is copied once to channels-last first.
    x         the forward's input *before* its prologue: (N, C_in, *spatial), 1 to 3 spatial dims,
              fp32/fp16/bf16 (no bf16 under the interpreter); layouts as grad_y's.
    weight    the forward's weight (C_out, C_in/groups, *k), x's dtype: only its shape, dtype and
              strides are read (the gradient takes them).
    stride, padding, dilation, groups, prologue, act_in: the forward's (``conv_fprop``).
    bias_grad also return ``grad_bias = grad_y.sum(all dims but C)``, (C_out,) in x's dtype.
    tile      a ``TileConfig`` (None: ``tiles.tuned_tile``'s): ``block_n`` output channels x ``block_k``
              K entries per program, ``block_m`` output positions per reduction step.
    split     how many programs share the M reduction (None: ``pick_split``'s).
    allow_tf32: fp32 dots in TF32 (never under the interpreter); None: ``torch.backends.cudnn.allow_tf32``.

    Returns ``(grad_w, grad_bias or None)``: grad_w of weight's shape, dtype and strides (``empty_like``),
    summed in fp32 per split and in float64 over the splits, rounded once.  Bitwise reproducible run to
    run.  N == 0 returns zeros without a launch.  Raises ``plan_cache.ContractError`` (one line) for any
    broken contract before anything launches.
    """
    if not all(isinstance(t, torch.Tensor) for t in (grad_y, x, weight)):
        raise ContractError("grad_y, x and weight must be tensors")
    if tile is not None and not isinstance(tile, TileConfig):
        raise ContractError(f"tile must be a TileConfig or None, got {type(tile).__name__}")
    if split is not None and (not isinstance(split, int) or split < 1):
        raise ContractError(f"split must be a positive int or None, got {split!r}")
    code_in, slope_in = hooks.activation_args(hooks.as_activation(act_in, "act_in"))
    precision_flag = bool(torch.backends.cudnn.allow_tf32 if allow_tf32 is None else allow_tf32)
    key = plan_key(grad_y, x, weight, *hooks.prologue_tensors(prologue), hooks.plan_parts(prologue),
                   _hashable(stride), _hashable(padding), _hashable(dilation), groups, code_in, bool(bias_grad),
                   tile, split, precision_flag)  # fmt: skip

    def build() -> _WgradPlan:
        geo = _check_call(x, weight, None, None, None, stride, padding, dilation, groups)
        check_grad_y(grad_y, geo.out_shape, x)
        hooks.check_prologue(prologue, geo.n, geo.c_in, x.device)
        precision = backward_dot_precision(x.dtype, precision_flag)

        def plan_with(t: TileConfig) -> _WgradPlan:
            t.check_for("wgrad")
            return _WgradPlan(geo, x, grad_y, weight, prologue, code_in, bool(bias_grad), t, split, precision)

        if tile is not None:
            return plan_with(tile)
        xs, dys = _layout_of(x), _layout_of(grad_y)
        # boxes only where the hooks take the tile through registers anyway (``tiles.candidates``)
        hooked = prologue is not None or code_in != 0
        boxed = hooked and not wgrad_box_refusal(geo, xs, dys, None)
        # the direct depthwise tile's halo (``_WgradPlan``).  NOTE: a dense conv's weight gradient has no
        # halo: with one (several taps of a kernel row per program, their rows through the prologue once),
        # on the H200 (bf16, batch 64, ResNet-50's four 3x3s, BatchNorm + ReLU prologue,
        # ``python tools/bench_conv.py demos/realnets/resnet50.py --passes wgrad --filter '*k3x3 p1 g1*'``,
        # ``tile_ms``) the best halo tile took 0.118 / 0.113 / 0.117 / 0.096 ms where the several-taps tiles
        # without it took 0.087 / 0.083 / 0.078 / 0.100 (the committed ``conv-kernels-wgrad`` report; the
        # halo's barriers stop Triton pipelining the M loop's loads); a depthwise conv's halo was the
        # fastest tile on 3 of EfficientNet-B0's 8 hooked stride-1 depthwise weight gradients, 1.15-1.69x
        # the best tile without it (``python tools/bench_conv.py demos/realnets/efficientnet_b0.py
        # --passes wgrad --filter '*k3x3 p1 g[2-9]*,*k5x5 p2 g[2-9]*,*k3x3 p1 g1[0-9]*,*k5x5 p2 g1[0-9]*'``).
        with_halo = (hooked and geo.c_in_g == 1
                     and halo.applies(geo, not channels_last(x) or dense_channels_last(x), False) is None)  # fmt: skip
        tiles = candidates("wgrad", geo.c_in_g, geo.c_out_g, geo.taps, geo.m, x.dtype,
                           geo.c_out if geo.c_in_g == 1 else None,  # the direct depthwise sums
                           geo.out_size[1:] if boxed else None, halo=with_halo)  # fmt: skip
        if geo.m and tma_wgrad.supports(x, grad_y, weight, geo.stride, geo.groups):
            tiles = [*tiles, *tma_wgrad_tiles(geo.c_in, geo.c_out, geo.taps, geo.out_size[1:],
                                              geo.taps == 1 and not any(geo.padding), hooked,
                                              tma_wgrad.clippable_dims(geo), multiprocessors(x.device))]  # fmt: skip
        return plan_with(tuned_tile("wgrad", key, tiles, lambda t: functools.partial(
            plan_with(t).run, grad_y, x, weight, prologue, slope_in), x.device))

    plan = cached_plan(_PLANS, key, build)
    return plan.run(grad_y, x, weight, prologue, slope_in)


def check_grad_y(grad_y: Any, out_shape: tuple[int, ...], like: torch.Tensor) -> None:
    """Raise :class:`ContractError` unless ``grad_y`` is a tensor of the forward output's shape
    ``out_shape``, on ``like``'s device in its dtype."""
    if not isinstance(grad_y, torch.Tensor) or grad_y.device != like.device:
        where = grad_y.device if isinstance(grad_y, torch.Tensor) else type(grad_y).__name__
        raise ContractError(f"grad_y must be a tensor on {like.device}, got {where}")
    if tuple(grad_y.shape) != tuple(out_shape) or grad_y.dtype != like.dtype:
        raise ContractError(f"grad_y must be {tuple(out_shape)} {like.dtype} like the forward's output, got "
                            f"{tuple(grad_y.shape)} {grad_y.dtype}")  # fmt: skip
