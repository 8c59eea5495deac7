"""The conv family's input gradient (dgrad): one Triton implicit-GEMM kernel with the backward hooks in
its epilogue, and its host launcher :func:`conv_dgrad`.

``grad_a = conv_input_grad(grad_y, weight)``, then (optionally) ``grad_z = grad_a * act_in'(z)`` with
``z = prologue(x_prev)`` recomputed from the saved pre-prologue input, and the per-channel sums a
BatchNorm backward needs (``grad_epilogue``).  The same GEMM is the forward of a transposed conv
(``conv_transpose(y, weight, stride, padding, output_padding, groups, dilation)`` is the dgrad of
``grad_y = y`` with ``input_size`` carrying the output padding): no separate entry point is needed.

GEMM mapping (ranks lifted to 3d as in ``fprop``):

* ``M`` = ``N * D * H * W`` *input* positions, row-major over ``(n, d, h, w)``: the result is the
  row-major ``[M, C_in]`` matrix of a channels-last tensor.
* ``N_gemm`` = the group's ``C_in / groups`` channels; ``K`` = ``taps * C_out / groups``, taps outer and
  output channels inner (the ``tiles`` K walks, with ``C_out/g`` in the place of ``C_in/g``).
* ``A[m, (tap, co)] = grad_y[n, o, g*Cog + co]`` where, per spatial dim, ``o = (i + pad - tap * dil) /
  stride`` if that is a non-negative multiple of the stride with ``o < O``, else 0: a masked gather
  (:func:`load_dy_tile`), correct for every stride and for the tails a stride leaves (inputs no
  output window reached get 0).
  For stride > 1 all but ``1 / stride`` of those taps (per dim) are masked for any one row.  The
  *phased* walk (``PHASED``, tap-major K, dilation 1) skips them: the rows are split into the
  ``SD * SH * SW`` residue classes of ``i mod stride`` (the *phases*), each program takes M tiles of
  one phase, and its K loop runs over just the taps that land on that phase, ``kernel / stride`` per
  dim, each a dense shifted window of ``grad_y`` (:func:`_phase_rows`, :func:`_phase_tap`); a phase no
  tap lands on (a 1x1 conv's odd rows at stride 2) loops zero times and stores zeros.  The flat K walk
  (few output channels per group) keeps the masked gather.
* Box loads (``TileConfig.box_w``; stride and dilation 1, grad_y's strides 16-byte multiples, with groups
  output channels that fill the K blocks): a program owns a box of an input plane (``prologue.box_coords``),
  and each tap's A tile is the grad_y block under it shifted back by the tap, one tensor-descriptor
  load whose reads outside grad_y are the zeros of the masked gather.  NOTE: sm_90 SASS of ResNet-50's
  3x3 (bf16, 128 x 64 x 64; ``python tools/compile_check.py conv_family --cases
  resnet_3x3-bf16-box,resnet_3x3-bf16-hooked-box --kernels dgrad --sass`` against the cases without
  ``-box``): 18 instructions per MMA in the main loop against 38, hooked 19 against 39; not timed on a
  GPU yet.
* ``B[(tap, co), ci] = weight[g*Cog + co, ci, tap]``: read in place from a channels-last weight whose
  channels the tile does not pad (row ``(tap, co)`` at ``(co * taps + tap) * C_in/g``), else
  prearranged once per call by ``fprop.prearrange_weight`` applied to the weight with its two channel
  axes swapped per group, so that every B tile is one unmasked, K-contiguous load.
* One input channel per group (depthwise): no GEMM but a direct tile over ``BLOCK_N`` input channels
  of any groups, each gathering its multiplier's output channels over the taps
  (:func:`_depthwise_grad_tile`), grid ``(M tiles, C_in tiles, 1)``, with the same epilogue.
* Grid ``(M tiles, N tiles, groups)`` (phased: ``(M tiles of the largest phase, N tiles, groups x
  phases)``); one K loop of ``tl.dot``s into an fp32 accumulator; the epilogue.

Numerics: operands in grad_y's dtype (fp16: fp32 accumulation), fp32 dots in TF32 iff allowed
(``tf32.backward_dot_precision``); the epilogue in fp32, one rounding at the store.  No atomics.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from ..chain_math import op_codes
from ..conv_common import peel_coords
from ..host import cdiv, element_extent
from ..launch import FastLaunch
from ..plan_cache import ContractError, PlanCache, plan_key
from ..tf32 import backward_dot_precision, round_tf32
from . import hooks, tma_fprop
from .boxes import box_descriptor, box_grid, box_refusal
from .fprop import (
    _BIG_INDEX_THRESHOLD,
    _INT32_LIMIT,
    _check_call,
    _Geometry,
    _hashable,
    channels_last,
    dense_channels_last,
    empty_channels_last,
    prearrange_weight,
    to_channels_last,
)
from .grad_epilogue import load_saved_input, store_grad_tile
from .hooks import ActivationLike, NormStats, Prologue
from .prologue import _tap_coords, box_coords
from .stats import BatchNormGradSums, empty_grad_sums, reduce_grad_partials
from .tiles import TileConfig, cached_plan, candidates, tuned_tile
from .wgrad import _layout_of, _spatial_strides, check_grad_y


@triton.jit
def _source(i, tap, OUT, S: tl.constexpr, P: tl.constexpr, DIL: tl.constexpr):
    """Per spatial dim: the output index ``o`` whose window puts tap ``tap`` on input index ``i``, and
    whether there is one (``(i + P - tap * DIL)`` a non-negative multiple of ``S`` below ``S * OUT``)."""
    t = i + P - tap * DIL
    if S == 1:
        return t, (t >= 0) & (t < OUT)
    o = t // S
    return o, (t >= 0) & (t - o * S == 0) & (o < OUT)


@triton.jit
def load_dy_tile(dy_ptr, kk, row_base, d, h, w, m_ok, OD, OH, OW, dy_sd, dy_sh, dy_sw,
                 C_OUT_G: tl.constexpr, COUT_PAD: tl.constexpr, KD: tl.constexpr, KH: tl.constexpr,
                 KW: tl.constexpr, SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                 PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DD: tl.constexpr, DH: tl.constexpr,
                 DW: tl.constexpr, FLAT_K: tl.constexpr, BIG: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The ``[BLOCK_M, BLOCK_K]`` A tile of K step ``kk`` (module docstring), grad_y's dtype.

    ``row_base`` ``[BLOCK_M]``: each row's element offset of its sample in its group's first output
    channel; ``d, h, w``: the rows' input coordinates, ``m_ok`` the real rows; ``O*``: grad_y's sizes,
    ``dy_s*`` its spatial element strides (channel stride 1).  Tap-major (``FLAT_K`` False): ``COUT_PAD``
    is ``C_OUT_G`` rounded up to ``BLOCK_K`` and step ``kk`` is tap ``kk // (COUT_PAD // BLOCK_K)``;
    flat: ``k`` runs over ``KD * KH * KW * C_OUT_G`` (tap, channel) pairs.  Invalid taps, tail rows and
    padded channels load 0."""
    if FLAT_K:
        k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        tap = k // C_OUT_G
        co = k % C_OUT_G
        c_ok = k < KD * KH * KW * C_OUT_G
        kd, kh, kw = _tap_coords(tap, KH, KW)
        od, d_ok = _source(d[:, None], kd[None, :], OD, SD, PD, DD)
        oh, h_ok = _source(h[:, None], kh[None, :], OH, SH, PH, DH)
        ow, w_ok = _source(w[:, None], kw[None, :], OW, SW, PW, DW)
        mask = d_ok & h_ok & w_ok & (m_ok[:, None] & c_ok[None, :])
        if BIG:
            od, oh, ow = od.to(tl.int64), oh.to(tl.int64), ow.to(tl.int64)
        offs = row_base[:, None] + (od * dy_sd + oh * dy_sh + ow * dy_sw + co[None, :])
    else:
        CB: tl.constexpr = COUT_PAD // BLOCK_K
        tap = kk // CB
        co = (kk % CB) * BLOCK_K + tl.arange(0, BLOCK_K)
        c_ok = co < C_OUT_G
        kd, kh, kw = _tap_coords(tap, KH, KW)
        od, d_ok = _source(d, kd, OD, SD, PD, DD)
        oh, h_ok = _source(h, kh, OH, SH, PH, DH)
        ow, w_ok = _source(w, kw, OW, SW, PW, DW)
        r_ok = m_ok & d_ok & h_ok & w_ok
        mask = r_ok[:, None] & c_ok[None, :]
        if BIG:
            od, oh, ow = od.to(tl.int64), oh.to(tl.int64), ow.to(tl.int64)
        offs = (row_base + od * dy_sd + oh * dy_sh + ow * dy_sw)[:, None] + co[None, :]
    return tl.load(dy_ptr + offs, mask=mask, other=0.0)


@triton.jit
def _phase_dim(first, SIZE, S: tl.constexpr, P: tl.constexpr, K: tl.constexpr):
    """One spatial dim of a phase whose rows are the inputs ``first, first + S, ...`` below ``SIZE``:
    ``(rows, taps, residue, base)``: how many rows, how many kernel taps land on them (``tap =
    residue + j * S``, ``j < taps``), and the output index of tap ``residue`` at the phase's row
    ``q = 0`` (the row ``q``'s tap ``j`` reads output ``q + base - j``)."""
    residue = (first + P) % S
    return (SIZE - first + S - 1) // S, (K - residue + S - 1) // S, residue, (first + P - residue) // S


@triton.jit
def _phase_rows(pid_m, phase, M, D, H, W, SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, KD: tl.constexpr, KH: tl.constexpr,
                KW: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """The rows of M tile ``pid_m`` of ``phase`` (row-major over the ``SD x SH x SW`` first inputs):
    ``(m, m_ok, n, d, h, w, qd, qh, qw, geometry)``: the rows' global input position ``m`` (row-major
    ``(n, d, h, w)``) and whether it is real, their coordinates and in-phase coordinates, and per dim
    ``(taps, residue, base)`` of :func:`_phase_dim` as a 9-tuple."""
    fw = phase % SW
    fh = (phase // SW) % SH
    fd = phase // (SW * SH)
    rows_d, taps_d, res_d, base_d = _phase_dim(fd, D, SD, PD, KD)
    rows_h, taps_h, res_h, base_h = _phase_dim(fh, H, SH, PH, KH)
    rows_w, taps_w, res_w, base_w = _phase_dim(fw, W, SW, PW, KW)
    q = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = q < (M // (D * H * W)) * rows_d * rows_h * rows_w
    qw, qh, qd, n = peel_coords(q, tl.maximum(rows_w, 1), tl.maximum(rows_h, 1), tl.maximum(rows_d, 1))
    d = fd + qd * SD
    h = fh + qh * SH
    w = fw + qw * SW
    m = ((n * D + d) * H + h) * W + w
    return m, m_ok, n, d, h, w, qd, qh, qw, (taps_d, taps_h, taps_w, res_d, res_h, res_w, base_d, base_h, base_w)


@triton.jit
def _phase_tap(j, qd, qh, qw, m_ok, OD, OH, OW, geometry, SD: tl.constexpr, SH: tl.constexpr,
               SW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr):  # fmt: skip
    """The phase's ``j``-th tap (row-major over its ``taps_d x taps_h x taps_w``): its index in the
    weight's tap order, and per row the output position it reads and whether that exists."""
    taps_d, taps_h, taps_w, res_d, res_h, res_w, base_d, base_h, base_w = geometry
    jw = j % taps_w
    jh = (j // taps_w) % taps_h
    jd = j // (taps_w * taps_h)
    od = qd + base_d - jd
    oh = qh + base_h - jh
    ow = qw + base_w - jw
    ok = m_ok & (od >= 0) & (od < OD) & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
    tap = ((res_d + jd * SD) * KH + res_h + jh * SH) * KW + res_w + jw * SW
    return tap, od, oh, ow, ok


@triton.jit
def _weight_rows(tap, co, C_IN_G: tl.constexpr, TAPS: tl.constexpr, COUT_PAD: tl.constexpr,
                 W_IN_PLACE: tl.constexpr):  # fmt: skip
    """The ``[BLOCK_K, 1]`` element offsets of the B rows ``(tap, co)`` from a group's first weight
    column: in the weight itself, row ``co`` of tap ``tap`` is at ``(co * TAPS + tap) * C_IN_G``; in the
    prearranged matrix at ``tap * COUT_PAD + co``."""
    if W_IN_PLACE:
        return ((co * TAPS + tap) * C_IN_G)[:, None]
    return (tap * COUT_PAD + co)[:, None]


@triton.jit
def _depthwise_grad_tile(dy_ptr, w_ptr, n, d, h, w, m_ok, ci, ci_ok, OD, OH, OW, MULT, dy_sn, dy_sd, dy_sh, dy_sw,
                         KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                         SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                         PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                         DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                         BIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The fp32 ``[BLOCK_M, BLOCK_N]`` input gradient of a conv with one input channel per group
    (``fprop._depthwise_tile``'s backward): input channel ``ci`` gathers its ``MULT`` output channels
    ``ci * MULT + j`` over the taps, each tap's output position found as in the GEMM form
    (:func:`_source`), times the weight ``w[(ci * MULT + j) * taps + tap]``."""
    TAPS: tl.constexpr = KD * KH * KW
    if BIG:
        row_base = n.to(tl.int64) * dy_sn
    else:
        row_base = n * dy_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for tap in range(0, TAPS):  # a loop, as the forward's (NOTE at fprop._depthwise_tile)
        od, d_ok = _source(d, tap // (KH * KW), OD, SD, PD, DD)
        oh, h_ok = _source(h, (tap // KW) % KH, OH, SH, PH, DH)
        ow, w_ok = _source(w, tap % KW, OW, SW, PW, DW)
        if BIG:
            od, oh, ow = od.to(tl.int64), oh.to(tl.int64), ow.to(tl.int64)
        rows = row_base + od * dy_sd + oh * dy_sh + ow * dy_sw
        mask = (m_ok & d_ok & h_ok & w_ok)[:, None] & ci_ok[None, :]
        for j in range(0, MULT):
            co = ci * MULT + j
            g = tl.load(dy_ptr + rows[:, None] + co[None, :], mask=mask, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + co * TAPS + tap, mask=ci_ok, other=0.0).to(tl.float32)
            acc += g * wv[None, :]
    return acc


@triton.jit
def conv_dgrad_kernel(
    dy_ptr, dy_desc, w_ptr, out_ptr, xp_ptr, part_ptr, mean_ptr, rstd_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
    slope,
    M, D, H, W, OD, OH, OW, C_IN, C_OUT, M_TILES, H_TILES, W_TILES,
    dy_sn, dy_sd, dy_sh, dy_sw, xp_sn, xp_sd, xp_sh, xp_sw,
    C_IN_G: tl.constexpr, C_OUT_G: tl.constexpr, COUT_PAD: tl.constexpr, K_ROW: tl.constexpr,
    CIN_PAD: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, ACT: tl.constexpr,
    SUMS: tl.constexpr, PRECISION: tl.constexpr, BIG: tl.constexpr, FLAT_K: tl.constexpr, PHASED: tl.constexpr,
    W_IN_PLACE: tl.constexpr, DEPTHWISE: tl.constexpr, BOX_W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` tile of the input gradient of group ``program_id(2)`` (phased: group
    ``program_id(2) % groups`` of phase ``program_id(2) // groups``; ``BOX_W``: a box of an input plane
    whose A tiles are boxes of grad_y; module docstring).

    Pointers (element offsets):
      dy_ptr   grad_y (N, C_OUT, OD, OH, OW), channel stride 1, spatial strides ``dy_s*``.
      w_ptr    the prearranged weight (groups, CIN_PAD, K_ROW), grad_y's dtype, contiguous, zero padded:
               row ``ci`` of group ``g`` over K in (tap, co) order; with ``W_IN_PLACE`` the weight
               itself, channels-last dense, whose channels need no padding; ``DEPTHWISE``: (C_OUT, taps)
               rows, contiguous (``_depthwise_grad_tile``).
      out_ptr, part_ptr, mean_ptr, rstd_ptr, p0..p3: ``grad_epilogue.store_grad_tile``'s; xp_ptr
               ``grad_epilogue.load_saved_input``'s.
      dy_desc  ``BOX_W``: grad_y as an (N, OD, OH, OW, C_OUT) tensor descriptor, block ``(1, 1, BLOCK_M //
               BOX_W, BOX_W, BLOCK_K)``, zero padding; else any tensor, unused.
    Unused pointers receive any tensor and are never dereferenced.
    Runtime: ``M = N * D * H * W``; ``H_TILES`` / ``W_TILES`` the boxes along an input plane (``BOX_W``);
    ``M_TILES`` the partial-sum rows, the grid's first dim (phased:
    times the phases; phase ``p``'s tile ``i`` writes row ``p * grid0 + i``).  Constexprs: ``C_IN_G`` / ``C_OUT_G``
    channels per group, ``COUT_PAD`` (tap-major) ``C_OUT_G`` rounded up to ``BLOCK_K``, ``K_ROW`` one
    input channel's K extent in ``w``, ``CIN_PAD`` ``C_IN_G`` rounded up to ``BLOCK_N``; kernel size,
    stride, padding, dilation per dim; the hooks' codes; ``PRECISION`` the dot's input precision.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ci = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if DEPTHWISE:  # one input channel per group: ``BLOCK_N`` input channels of any groups, directly
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < M
        w, h, d, n = peel_coords(m, W, H, D)
        acc = _depthwise_grad_tile(dy_ptr, w_ptr, n, d, h, w, m_ok, ci, ci < C_IN, OD, OH, OW, C_OUT_G,
                                   dy_sn, dy_sd, dy_sh, dy_sw, KD, KH, KW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
                                   BIG, BLOCK_M, BLOCK_N)  # fmt: skip
        x_saved = load_saved_input(m_ok, n, d, h, w, ci, ci < C_IN, xp_ptr, xp_sn, xp_sd, xp_sh, xp_sw, ACT, SUMS, BIG)
        store_grad_tile(acc, x_saved, m, m_ok, n, ci, ci < C_IN, pid_m, out_ptr, part_ptr, mean_ptr, rstd_ptr,
                        p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope, C_IN, M_TILES, PROLOGUE, G_NORM, NORM_AFFINE, ACT, SUMS,
                        BIG)  # fmt: skip
        return
    if PHASED:
        groups = C_IN // C_IN_G
        g = tl.program_id(2) % groups
        phase = tl.program_id(2) // groups
        m, m_ok, n, d, h, w, qd, qh, qw, geometry = _phase_rows(pid_m, phase, M, D, H, W, SD, SH, SW, PD, PH, PW,
                                                                KD, KH, KW, BLOCK_M)  # fmt: skip
        part_row = phase * tl.num_programs(0) + pid_m
    elif BOX_W > 0:  # a box of an input plane (``prologue.box_coords``): its sample and depth per row too
        g = tl.program_id(2)
        n0, d0, th, tw, h, w = box_coords(pid_m, D, H_TILES, W_TILES, BOX_W, BLOCK_M)
        n = tl.zeros([BLOCK_M], tl.int32) + n0
        d = tl.zeros([BLOCK_M], tl.int32) + d0
        m_ok = (h < H) & (w < W)
        m = ((n * D + d) * H + h) * W + w
        part_row = pid_m
    else:
        g = tl.program_id(2)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < M
        w, h, d, n = peel_coords(m, W, H, D)
        part_row = pid_m
    if BIG:
        row_base = n.to(tl.int64) * dy_sn
    else:
        row_base = n * dy_sn
    row_base += g * C_OUT_G
    if W_IN_PLACE:  # the weight itself, channels-last dense: (C_OUT, taps, C_IN_G), C_IN_G contiguous
        TAPS: tl.constexpr = KD * KH * KW
        w_cols = w_ptr + g * (C_OUT_G * TAPS * C_IN_G) + ci[None, :]
    else:  # prearranged, zero padded: no mask
        w_cols = w_ptr + g * (CIN_PAD * K_ROW) + ci[None, :] * K_ROW

    if PHASED:
        CB: tl.constexpr = COUT_PAD // BLOCK_K
        taps_d, taps_h, taps_w = geometry[0], geometry[1], geometry[2]
        for kk in range(0, taps_d * taps_h * taps_w * CB):
            tap, od, oh, ow, r_ok = _phase_tap(kk // CB, qd, qh, qw, m_ok, OD, OH, OW, geometry, SD, SH, SW, KH, KW)
            co = (kk % CB) * BLOCK_K + kb
            if BIG:
                od, oh, ow = od.to(tl.int64), oh.to(tl.int64), ow.to(tl.int64)
            offs = (row_base + od * dy_sd + oh * dy_sh + ow * dy_sw)[:, None] + co[None, :]
            a = tl.load(dy_ptr + offs, mask=r_ok[:, None] & (co < C_OUT_G)[None, :], other=0.0)
            b = tl.load(w_cols + _weight_rows(tap, co, C_IN_G, KD * KH * KW, COUT_PAD, W_IN_PLACE))
            acc = tl.dot(round_tf32(a, PRECISION), round_tf32(b, PRECISION), acc, input_precision=PRECISION)
    elif BOX_W > 0:  # stride and dilation 1: the tap's grad_y block is the input box shifted back by it
        BOX_H: tl.constexpr = BLOCK_M // BOX_W
        CBLOCKS_BOX: tl.constexpr = COUT_PAD // BLOCK_K
        for kk in range(0, K_ROW // BLOCK_K):
            tap = kk // CBLOCKS_BOX
            co0 = (kk % CBLOCKS_BOX) * BLOCK_K
            kd, kh, kw = _tap_coords(tap, KH, KW)
            box = dy_desc.load([n0, d0 + PD - kd, th * BOX_H + PH - kh, tw * BOX_W + PW - kw, g * C_OUT_G + co0])
            a = tl.reshape(box, [BLOCK_M, BLOCK_K])
            if W_IN_PLACE:
                b = tl.load(w_cols + _weight_rows(tap, co0 + kb, C_IN_G, KD * KH * KW, COUT_PAD, W_IN_PLACE))
            else:
                b = tl.load(w_cols + (kk * BLOCK_K + kb)[:, None])
            acc = tl.dot(round_tf32(a, PRECISION), round_tf32(b, PRECISION), acc, input_precision=PRECISION)
    else:
        for kk in range(0, K_ROW // BLOCK_K):
            a = load_dy_tile(dy_ptr, kk, row_base, d, h, w, m_ok, OD, OH, OW, dy_sd, dy_sh, dy_sw,
                             C_OUT_G, COUT_PAD, KD, KH, KW, SD, SH, SW, PD, PH, PW, DD, DH, DW, FLAT_K, BIG,
                             BLOCK_K)  # fmt: skip
            if W_IN_PLACE:
                CBLOCKS: tl.constexpr = COUT_PAD // BLOCK_K
                b = tl.load(w_cols + _weight_rows(kk // CBLOCKS, (kk % CBLOCKS) * BLOCK_K + kb, C_IN_G,
                                                  KD * KH * KW, COUT_PAD, W_IN_PLACE))  # fmt: skip
            else:
                b = tl.load(w_cols + (kk * BLOCK_K + kb)[:, None])
            acc = tl.dot(round_tf32(a, PRECISION), round_tf32(b, PRECISION), acc, input_precision=PRECISION)

    # NOTE: x_prev read after the K loop, not before it: read before, its tile held registers through the
    # loop (ResNet-50's hooked 3x3 of 64 channels, 128 x 64 x 64 on 4 warps: 226 against 168) and the pass
    # took 72.6 against 62.8 us (H200, bf16, batch 64: ``python tools/bench_conv.py demos/realnets/resnet50.py
    # --passes dgrad --profile --filter '*64x64x56x56 -> 64 k3x3*'``)
    c_in = g * C_IN_G + ci
    x_saved = load_saved_input(m_ok, n, d, h, w, c_in, ci < C_IN_G, xp_ptr, xp_sn, xp_sd, xp_sh, xp_sw, ACT, SUMS, BIG)
    store_grad_tile(acc, x_saved, m, m_ok, n, c_in, ci < C_IN_G, part_row, out_ptr, part_ptr, mean_ptr, rstd_ptr,
                    p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope, C_IN, M_TILES, PROLOGUE, G_NORM, NORM_AFFINE, ACT, SUMS,
                    BIG)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host
# --------------------------------------------------------------------------------------------------


def dgrad_box_refusal(geo: _Geometry, dy: torch.Tensor, tile: TileConfig | None) -> str:
    """Why the input gradient of a call of geometry ``geo`` cannot load its A tiles as boxes of grad_y
    ``dy`` (channels-last, as the kernel reads it) with ``tile`` (None: any box tile); "" where it can.
    ``boxes.box_refusal``'s rules, the output channels in the K blocks' place: with groups they must
    fill them (a group's channel tail would read the next group's grad_y)."""
    why = box_refusal(geo, dy, tile, what="grad_y")
    if why:
        return why
    if geo.groups > 1 and (tile is None or geo.c_out_g % tile.block_k):
        return f"with groups, the {geo.c_out_g} output channels per group must fill the K blocks"
    return ""


def prearrange_dgrad_weight(weight: torch.Tensor, groups: int, tile: TileConfig, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (C_out, C_in/groups, *k) as the dgrad kernel reads it: ``(groups, CIN_PAD, K_ROW)``,
    row ``ci`` of group ``g`` over K in (tap, co) order; ``fprop.prearrange_weight`` of the weight with
    its channel axes swapped per group (the dgrad GEMM is a forward GEMM with C_in and C_out exchanged)."""
    c_out, cin_g, *k = weight.shape
    cout_g = c_out // groups
    swapped = weight.reshape(groups, cout_g, cin_g, *k).transpose(1, 2).reshape(groups * cin_g, cout_g, *k)
    return prearrange_weight(swapped, groups, tile, dtype)


class _DgradPlan:
    """Everything :func:`conv_dgrad` derives from a call's signature, built once (``_PLANS``)."""

    def __init__(self, geo: _Geometry, grad_y: torch.Tensor, weight: torch.Tensor, x_prev: torch.Tensor | None,
                 prologue: Prologue | None, act: int, sums: bool, tile: TileConfig, precision: str) -> None:  # fmt: skip
        self.geo, self.tile, self.sums = geo, tile, sums
        self.dtype, self.device = grad_y.dtype, grad_y.device
        self.in_shape = (geo.n, geo.c_in, *geo.size[3 - (len(geo.out_shape) - 2):])
        self.m = geo.n * math.prod(geo.size)
        self.relayout_dy = not channels_last(grad_y)
        self.relayout_xp = x_prev is not None and not channels_last(x_prev)
        dys = _layout_of(grad_y)
        xps = _layout_of(x_prev) if x_prev is not None else None
        extents = [element_extent(dys), self.m * geo.c_in] + ([element_extent(xps)] if xps is not None else [])
        big = max(extents) > _BIG_INDEX_THRESHOLD
        cout_pad = cdiv(geo.c_out_g, tile.block_k) * tile.block_k
        k_row = cdiv(geo.taps * geo.c_out_g, tile.block_k) * tile.block_k if tile.flat_k else geo.taps * cout_pad
        cin_pad = cdiv(geo.c_in_g, tile.block_n) * tile.block_n
        #: the phased walk (module docstring): tap-major, dilation 1, some stride > 1
        #: one input channel per group: the direct depthwise tile (``_depthwise_grad_tile``)
        self.depthwise = geo.c_in_g == 1
        self.phased = not self.depthwise and not tile.flat_k and geo.dilation == (1, 1, 1) and max(geo.stride) > 1
        #: the rows are boxes of the input planes, the A tiles boxes of grad_y (stride and dilation 1)
        self.box = bool(tile.box_w)
        #: the weight is read as it is, not prearranged per call (channels-last dense, tap-major, and
        #: the tile pads neither channel axis)
        self.weight_in_place = (not self.depthwise and dense_channels_last(weight) and not tile.flat_k
                                and cout_pad == geo.c_out_g and cin_pad == geo.c_in_g)  # fmt: skip
        phases = math.prod(geo.stride) if self.phased else 1
        largest = geo.n * math.prod(cdiv(i, s) for i, s in zip(geo.size, geo.stride, strict=True))  # phase 0's rows
        m_tiles = cdiv(largest if self.phased else self.m, tile.block_m)
        box_tiles = (0, 0)
        if self.box:
            box_tiles, m_tiles = box_grid(geo.size, geo.n, tile, dgrad_box_refusal(geo, dys, tile))
        #: partial-sum rows: every program of every phase writes its own
        self.m_tiles = m_tiles * phases
        grid = (m_tiles, cin_pad // tile.block_n, geo.groups * phases)
        if self.depthwise:
            grid = (m_tiles, cdiv(geo.c_in, tile.block_n), 1)
        g_norm, norm_affine = 1, False
        if isinstance(prologue, hooks.GroupAffine):
            g_norm, norm_affine = prologue.groups, prologue.weight is not None
        constexprs = dict(
            C_IN_G=geo.c_in_g, C_OUT_G=geo.c_out_g, COUT_PAD=cout_pad, K_ROW=k_row, CIN_PAD=cin_pad,
            KD=geo.kernel[0], KH=geo.kernel[1], KW=geo.kernel[2],
            SD=geo.stride[0], SH=geo.stride[1], SW=geo.stride[2],
            PD=geo.padding[0], PH=geo.padding[1], PW=geo.padding[2],
            DD=geo.dilation[0], DH=geo.dilation[1], DW=geo.dilation[2],
            PROLOGUE=hooks.prologue_code(prologue) if act else hooks.PROLOGUE_NONE, G_NORM=g_norm,
            NORM_AFFINE=norm_affine, ACT=act, SUMS=sums, PRECISION=precision, BIG=big, FLAT_K=tile.flat_k,
            PHASED=self.phased, W_IN_PLACE=self.weight_in_place, DEPTHWISE=self.depthwise, BOX_W=tile.box_w,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )  # fmt: skip
        xp_strides = _spatial_strides(xps) if xps is not None else [0, 0, 0, 0]
        fixed = (self.m, *geo.size, *geo.out_size, geo.c_in, geo.c_out, self.m_tiles, *box_tiles,
                 *_spatial_strides(dys), *xp_strides)  # fmt: skip
        #: the Gluon kernel's persistent launch (``tma_fprop``, ``GRAD``): the sums per program lane
        self.tma = None
        if tile.tma:
            if not tma_fprop.supports_grad(grad_y, weight, geo.stride, geo.padding, geo.groups):
                raise ContractError(f"tile {tile.label()}: this call is not one the TMA input gradient takes "
                                    "(tma_fprop.supports_grad)")
            rounded = tma_fprop.round_first(True, act)
            m_tiles = cdiv(geo.m, tile.block_m)  # row tiles of grad_y (the output's positions, at any stride)
            programs = tma_fprop.grid_programs(tile, geo.c_out, geo.c_in, m_tiles, grad_y.device, sums,
                                               tma_fprop.exchange_bytes(rounded))  # fmt: skip
            self.m_tiles = programs // cdiv(geo.c_in, tile.block_n) if sums else m_tiles
            hook_codes = dict(PROLOGUE=constexprs["PROLOGUE"], G_NORM=g_norm, NORM_AFFINE=norm_affine, ACT_IN=act,
                              SAVE_CONV=False, HAS_SCALE=False, HAS_BIAS=False, CHAIN=op_codes([]), ACT_OUT=0,
                              RESIDUAL=0, STATS=sums, BIG=big)  # fmt: skip
            self.tma = tma_fprop.TmaLaunch(tile, geo, m_tiles, programs, hook_codes, sums, grad_y.dtype, rounded,
                                           grad=True)  # fmt: skip
        else:
            self.launch = FastLaunch(conv_dgrad_kernel, grid, constexprs, fixed=fixed)

    def run(self, grad_y: torch.Tensor, weight: torch.Tensor, x_prev: torch.Tensor | None, prologue: Prologue | None,
            norm_stats: NormStats | None, slope: float) -> tuple[torch.Tensor, BatchNormGradSums | None]:  # fmt: skip
        geo = self.geo
        out = empty_channels_last(self.in_shape, self.dtype, self.device)
        if self.m == 0:  # N == 0: nothing to launch
            return out, (empty_grad_sums(geo.c_in, self.device) if self.sums else None)
        part = None
        if self.sums:
            part = torch.empty((2, self.m_tiles, geo.c_in), dtype=torch.float32, device=self.device)
        p = [out if t is None else t for t in hooks.prologue_tensors(prologue)]
        mean, rstd = (norm_stats.mean, norm_stats.rstd) if norm_stats is not None else (out, out)
        if self.tma is not None:  # its operands as rows, in any layout (``tma_fprop.input_rows``)
            self.tma.input_grad(grad_y, weight, out, part, p, x_prev, mean, rstd, slope)
            return out, None if part is None else reduce_grad_partials(part, self.m)
        if self.relayout_dy:
            grad_y = to_channels_last(grad_y)
        if self.relayout_xp:
            x_prev = to_channels_last(x_prev)
        if self.depthwise:  # (C_out, taps) rows
            w = weight.reshape(geo.c_out, geo.taps).contiguous()
        elif self.weight_in_place:
            w = weight
        else:
            w = prearrange_dgrad_weight(weight, geo.groups, self.tile, self.dtype)
        dy_desc: Any = grad_y
        if self.box:
            tile = self.tile
            dy_desc = box_descriptor(grad_y, [1, 1, tile.box_h, tile.box_w, tile.block_k])
        self.launch(grad_y, dy_desc, w, out, out if x_prev is None else x_prev, out if part is None else part, mean,
                    rstd, *p, slope)  # fmt: skip
        return out, None if part is None else reduce_grad_partials(part, self.m)


#: Launch plans by ``plan_key`` of a call's signature.
_PLANS = PlanCache()


def conv_dgrad(
    grad_y: torch.Tensor,
    weight: torch.Tensor,
    input_size: Sequence[int],
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    x_prev: torch.Tensor | None = None,
    prologue: Prologue | None = None,
    act_in: ActivationLike = None,
    norm_stats: NormStats | None = None,
    tile: TileConfig | None = None,
    allow_tf32: bool | None = None,
) -> tuple[torch.Tensor, BatchNormGradSums | None]:
    """The input gradient of ``conv_fprop(x, weight, stride=..., padding=..., dilation=..., groups=...)``
    for the output gradient ``grad_y``, through the forward's input activation when asked, in one launch
    (plus the weight prearrangement and the relayout of inputs that are not channels-last).

    grad_y    (N, C_out, *out_spatial), 1 to 3 spatial dims, fp32/fp16/bf16 (no bf16 under the
              interpreter); channels-last strides read in place, any other layout copied once.
    weight    (C_out, C_in/groups, *k), grad_y's dtype, any strides: read in place where it is
              channels-last dense and the tile pads neither channel axis, else prearranged per call.
    input_size the forward input's shape (N, C_in, *spatial): it fixes the tails a stride leaves (a
              transposed conv's ``output_padding``); the conv of that size must give grad_y's shape.
    stride, padding, dilation, groups: the forward's.
    x_prev    the forward's input before its prologue (input_size, grad_y's dtype, layouts as grad_y's):
              needed by ``act_in`` and ``norm_stats``.
    prologue, act_in: the forward's (``hooks``); with ``act_in`` the result is ``grad_z = grad_a *
              act_in'(prologue(x_prev))``, else ``grad_a`` (the prologue alone is affine: its backward is
              the caller's, from the sums).
    norm_stats ``hooks.NormStats`` (per-channel mean and rstd the forward's BatchNorm used): also return
              the ``stats.BatchNormGradSums`` of the result (``Σ grad_z``, ``Σ grad_z · x̂``), bitwise
              reproducible.  (GroupNorm's backward sums, per sample and group, are not produced.)
    tile      a ``TileConfig`` (None: ``tiles.tuned_tile``'s, C_in and C_out exchanged).
    allow_tf32: fp32 dots in TF32 (never under the interpreter); None: ``torch.backends.cudnn.allow_tf32``.

    Returns ``(grad, sums or None)``: grad of ``input_size`` in grad_y's dtype, channels-last dense.
    N == 0 returns an empty gradient (and zero sums) without a launch.  Raises
    ``plan_cache.ContractError`` (one line) for any broken contract before anything launches.
    """
    if not isinstance(grad_y, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ContractError("grad_y and weight must be tensors")
    if tile is not None and not isinstance(tile, TileConfig):
        raise ContractError(f"tile must be a TileConfig or None, got {type(tile).__name__}")
    act = hooks.as_activation(act_in, "act_in")
    code, slope = hooks.activation_args(act)
    precision_flag = bool(torch.backends.cudnn.allow_tf32 if allow_tf32 is None else allow_tf32)
    size = _input_size(input_size)
    stats_parts = (norm_stats.mean, norm_stats.rstd) if isinstance(norm_stats, NormStats) else (None, None)
    key = plan_key(grad_y, weight, size, x_prev, *hooks.prologue_tensors(prologue), hooks.plan_parts(prologue),
                   _hashable(stride), _hashable(padding), _hashable(dilation), groups, code, type(norm_stats).__name__, *stats_parts, tile,
                   precision_flag)  # fmt: skip

    def build() -> _DgradPlan:
        if len(size) != grad_y.dim():
            raise ContractError(f"input_size must have grad_y's rank {grad_y.dim()}, got {size}")
        # a stand-in for x with no memory: the forward's checks and geometry on the input's shape
        x_like = torch.empty((), dtype=grad_y.dtype, device=grad_y.device).expand(size)
        geo = _check_call(x_like, weight, None, None, None, stride, padding, dilation, groups)
        check_grad_y(grad_y, geo.out_shape, x_like)
        if geo.n * math.prod(geo.size) > _INT32_LIMIT:
            raise ContractError(f"{geo.n * math.prod(geo.size)} input positions exceed the kernel's int32 row index")
        if (code or norm_stats is not None) and x_prev is None:
            raise ContractError("act_in and norm_stats need x_prev, the forward's input before its prologue")
        if x_prev is not None:
            if not isinstance(x_prev, torch.Tensor) or x_prev.device != grad_y.device:
                raise ContractError(f"x_prev must be a tensor on {grad_y.device}")
            if tuple(x_prev.shape) != size or x_prev.dtype != grad_y.dtype:
                raise ContractError(f"x_prev must be {size} {grad_y.dtype}, got {tuple(x_prev.shape)} {x_prev.dtype}")
        hooks.check_prologue(prologue, geo.n, geo.c_in, grad_y.device)
        hooks.check_norm_stats(norm_stats, geo.c_in, grad_y.device)
        precision = backward_dot_precision(grad_y.dtype, precision_flag)

        def plan_with(t: TileConfig) -> _DgradPlan:
            t.check_for("dgrad")
            return _DgradPlan(geo, grad_y, weight, x_prev, prologue, code, norm_stats is not None, t, precision)

        if tile is not None:
            return plan_with(tile)
        m = geo.n * math.prod(geo.size)
        dys = _layout_of(grad_y)
        # boxes only where the hooks take the tile through registers anyway (``tiles.candidates``)
        hooked = code != 0 or norm_stats is not None
        boxed = hooked and not dgrad_box_refusal(geo, dys, None)
        tiles = candidates("dgrad", geo.c_out_g, geo.c_in_g, geo.taps, m, grad_y.dtype,
                           geo.c_in if geo.c_in_g == 1 else None,  # the direct depthwise path
                           geo.size[1:] if boxed else None, epilogue_hooks=hooked, plain=not hooked,
                           tma=tma_fprop.supports_grad(grad_y, weight, geo.stride, geo.padding, geo.groups))  # fmt: skip
        tiles = [t for t in tiles if not t.box_w or not dgrad_box_refusal(geo, dys, t)]
        return plan_with(tuned_tile("dgrad", key, tiles, lambda t: functools.partial(
            plan_with(t).run, grad_y, weight, x_prev, prologue, norm_stats, slope), grad_y.device))

    plan = cached_plan(_PLANS, key, build)
    return plan.run(grad_y, weight, x_prev, prologue, norm_stats, slope)


def _input_size(input_size: Any) -> tuple[int, ...]:
    """``input_size`` as a tuple of ints (a ``torch.Size`` or any sequence of ints)."""
    try:
        size = tuple(input_size)
    except TypeError:
        size = None
    if size is None or not all(isinstance(s, int) and s >= 0 for s in size):
        raise ContractError(f"input_size must be a sequence of non-negative ints, got {input_size!r}")
    return size
