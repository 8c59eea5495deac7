"""Triton kernels for ``conv output -> pointwise pre-chain -> group norm -> pointwise post-chain``,
forward and backward.

These kernels know only tensors, op codes and the group count; the fused op that calls them
(``fusion_backend.ops.conv_group_norm``) owns the configuration, the autograd wiring and the fallback.

Semantics (torch's ``group_norm``; an instance norm is one channel per group): per sample ``n`` and
group ``g`` of ``CG = C / G`` consecutive channels, ``v = pre(y + bias)`` over the group's channels and
every spatial position has mean ``mu`` and biased variance ``var``; ``x_hat = (v - mu) * rstd`` with
``rstd = 1 / sqrt(var + eps)``; ``out = post(x_hat * gamma[c] + beta[c])``.  All arithmetic is fp32.

Data layout.  Tensors are seen as ``(N, C, S)`` with ``S`` the flattened spatial positions (every
conv output flattens: contiguous or channels-last); the kernels take element strides ``(sn, sc, ss)``.
Operand matrices are ``kernels/chain_math.py``'s: ``P`` ``(NUM_PARAM_ROWS, C)`` for the pre-chain
(row ``BIAS_ROW``: the conv bias) and ``Q`` ``(NUM_PARAM_ROWS, C)`` for the post-chain; ``A`` is the
norm's scale and shift, fp32 ``(2, C)`` contiguous (row 0 gamma, row 1 beta).

Chunks.  A group is cut along its positions into ``SPLIT`` chunks of ``CHUNK`` positions (the last
one shorter when ``CHUNK`` does not divide ``S``), each holding all ``CG`` channels of the group;
``chunk_positions`` is the one place that chooses them.  Grid ``(N * G, SPLIT)``: program ``(pid,
k)`` owns sample ``pid // G``, channels ``(pid % G) * CG + [0, CG)`` and positions ``k * CHUNK +
[0, CHUNK)``, and walks them in tiles of ``[BLOCK_C, BLOCK_S]`` (channel blocks outer, positions
inner), always in the same order.  With ``SPLIT = 1`` a group is one program that walks it twice in
one launch; with ``SPLIT > 1`` a first kernel writes per-chunk partials to a small fp32 workspace and
a second kernel, over the same grid, combines its group's ``SPLIT`` partials (a fixed-shape
reduction, the same in every program of the group) before its own chunk's pass.  Every result is
bitwise reproducible run to run (no atomics); it depends on ``SPLIT``, which depends on the shape only.

Channels-last kernels.  On a channels-last ``y`` a group's ``CG`` channels at one position are a run
of ``CG`` elements, and a program walking one group reads runs of a few bytes (a quarter of each
32-byte sector for 4 bf16 channels).  Where that run is shorter than a sector or the groups split into
chunks (``takes_channels_last_kernels``), the call takes kernels whose program owns ``BLOCK_C``
consecutive channels (parts of several groups) by one chunk of one sample's positions (``_ChannelBlocks``:
BatchNorm's channels-last tiling): per (sample, chunk, channel) statistics, then a combine per (sample,
group), then the normalise pass; in the backward, per (sample, chunk, channel) sums, their combine per
group, then the input gradient.  Each channel reads its group's statistics by ``c // CG``.  Every sum
keeps per-lane accumulators over the walk and reduces across lanes once, at its end.

Forward statistics: a chunk's tiles are read once: each tile's own mean and sum of squared
deviations (exact two-pass inside the tile, which is in registers) are merged into the chunk's
running ones with Chan's parallel formula (no ``E[x^2] - E[x]^2`` cancellation), all of the values
less the mean of the chunk's first tile (``shift``: values far from zero keep the digits of their
spread).  The chunks combine with the same decomposition, ``M2 = sum_k M2_k + sum_k n_k (m_k -
mean)^2`` with each chunk's mean taken relative to chunk 0's shift as ``(shift_k - shift_0) + m_k``
(the shifts of one group are close, so their difference is exact).  The second pass normalises,
applies gamma / beta and the post-chain, and writes ``out`` in its own layout and dtype.  With
``SAVE`` chunk 0's program writes ``mu`` and ``rstd`` (fp32 ``(2, N, G)``).

Backward: the first pass recomputes ``x_hat`` and the post-chain, walks the post-chain back from
``grad_out`` (``dz``) and sums over the chunk ``dz * gamma`` and ``dz * gamma * x_hat``; the group's
sums are the chunks' summed in a fixed order.  The second pass recomputes them and writes ``grad_y =
pre'(rstd * (dz*gamma - mean(dz*gamma) - x_hat * mean(dz*gamma*x_hat)))``.  Per-(sample, chunk,
channel) partial sums of gamma's and beta's gradients and of the chains' operand gradients are written
to ``(rows, N * SPLIT, C)`` fp32 buffers, one row per wanted slot, which the launcher reduces over
``N * SPLIT`` in a fixed order (no atomics).

A max or avg pool after the post-chain: the forward's statistics pass runs alone
(``group_norm_stats``: the partial kernel, then the chunks combined in torch) and
``kernels/norm_pool.py`` normalises, pools and writes the pooled result; in the backward
``grad_out`` is the pooled result's gradient, and both passes gather each position's gradient from
the windows that hold it (``norm_pool.pool_input_grad``: a max pool's only at the saved winners).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ..ir.specs import PoolSpec
from .batch_norm import (
    CHANNELS_INNER_BLOCK_C,
    POINTWISE_STAGES,
    REDUCE_STAGES,
    TARGET_PROGRAMS,
)
from .chain_math import MAX_SLOTS, KernelStep, apply_chain_at, chain_grad_at, op_codes, step_codes
from .epilogue import channels_innermost
from .host import cdiv, next_pow2
from .launch import FastLaunch
from .norm_common import (
    MIN_CHUNK_ELEMENTS,
    PROGRAMS_PER_SM,
    accumulate,
    accumulate_lanes,
    accumulate_slots,
    chunk_moments,
    chunk_positions,
    combined_moments,
    sm_count,
    store_rows,
    tile_values,
)
from .norm_pool import pool_arguments, pool_input_grad, pooled_grad_strides
from .plan_cache import PlanCache, flat_strides, require_rows, require_same_device

__all__ = ["MIN_CHUNK_ELEMENTS", "PROGRAMS_PER_SM", "chunk_positions"]

#: Elements of a program's tile (``BLOCK_C * BLOCK_S``).
TILE_ELEMENTS = 2048
#: Most channels of a group held in one tile; wider groups are walked in channel blocks.
MAX_BLOCK_C = 64
#: Channels of a channels-last kernel's tile: BatchNorm's, whose tiling these kernels share.
CHANNELS_LAST_BLOCK_C = CHANNELS_INNER_BLOCK_C
#: The channels-last kernels' chunks hold at least this many tiles (``_ChannelBlocks.plan``), and their
#: loops' software-pipelining stages (the reductions', the elementwise passes': BatchNorm's).
#: NOTE: H200, bf16, the 13 shapes of ``takes_channels_last_kernels``' NOTE summed, GPU us forward /
#: backward: chunks of at least 2 / 4 / 8 tiles 580 / 1,198, 563 / 1,152, 553 / 1,114 (stages 3 / 4);
#: with 8, stages 1 / 1 613 / 1,536 and 2 / 2 669 / 1,428.  Fewer tiles per chunk helped the smallest
#: tensors (32x128x16x16 4 tiles: 12.7 / 23.4 against 14.8 / 28.4) and cost the middle ones
#: (1x512x128x128 34.6 / 74.9 against 27.1 / 58.4).
CL_MIN_CHUNK_TILES = 8
CL_REDUCE_STAGES = REDUCE_STAGES
CL_POINTWISE_STAGES = POINTWISE_STAGES
#: Lanes of the channels-last combine (chunks x channels of a group read at once), and the most
#: channels of a group among them; larger groups and more chunks are walked in blocks.
COMBINE_LANES = 4096
COMBINE_GROUP_LANES = 64


# --------------------------------------------------------------------------------------------------
# Device functions
# --------------------------------------------------------------------------------------------------


@triton.jit
def _norm_backward_tile(gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_base, g_base, w_base, c, s, valid, mu, rstd, C,
                        y_sc, y_ss, g_sc, g_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sc, w_sd, w_sh, w_sw,
                        PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, POOL: tl.constexpr,
                        POOL_GEOM: tl.constexpr):  # fmt: skip
    """One tile of the backward: ``(yb, x_hat, dz, dxh, q0..q7)``: the conv output plus bias, the
    normalised value, the gradient of the norm's output (the post-chain walked back from grad_out),
    ``dz * gamma`` (0 outside ``valid``), and the post-chain's operand gradients.  With a pool (POOL 1
    max, 2 avg) ``g_base`` is the sample's pooled gradient and each position's gradient is gathered
    from the windows that hold it (``norm_pool.pool_input_grad``; a max pool's only at its winners,
    ``w_base``: the sample's winners)."""
    cmask = c < C
    yb, v = tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
    xh = (v - mu) * rstd
    gamma = tl.load(a_ptr + c, mask=cmask, other=0.0)
    beta = tl.load(a_ptr + C + c, mask=cmask, other=0.0)
    if POOL == 0:
        g = tl.load(g_base + c.to(tl.int64) * g_sc + s.to(tl.int64) * g_ss, mask=valid, other=0.0).to(tl.float32)
    else:
        g = pool_input_grad(g_base, w_base, c.to(tl.int64) * g_sc, c.to(tl.int64) * w_sc, s, valid, D, H, W, OD, OH,
                            OW, g_sd, g_sh, g_ss, w_sd, w_sh, w_sw, POOL, POOL_GEOM)  # fmt: skip
    dz, q0, q1, q2, q3, q4, q5, q6, q7 = chain_grad_at(g, xh * gamma + beta, q_ptr, c, C, cmask, POST)
    dxh = tl.where(valid, dz * gamma, 0.0)
    return yb, xh, dz, dxh, q0, q1, q2, q3, q4, q5, q6, q7


@triton.jit
def _input_grad_tile(gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, gy_ptr, y_base, g_base, w_base, gy_base, c, s, valid, mu,
                     rstd, mean_dxh, mean_dxh_xh, C, y_sc, y_ss, g_sc, g_ss, gy_sc, gy_ss, D, H, W, OD, OH, OW, g_sd,
                     g_sh, w_sc, w_sd, w_sh, w_sw, PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr,
                     POOL: tl.constexpr, POOL_GEOM: tl.constexpr):  # fmt: skip
    """The conv-output gradient on one tile, ``pre'(rstd * (dz * gamma - mean_dxh - x_hat * mean_dxh_xh))``,
    stored at ``gy_base`` where ``valid``; returns the pre-chain's operand gradients ``(a0, ..., a7)``.
    ``mu``, ``rstd`` and the group means of ``dz * gamma`` and ``dz * gamma * x_hat`` broadcast against the
    tile (a group's scalars, or per-channel vectors)."""
    yb, xh, dz, dxh, q0, q1, q2, q3, q4, q5, q6, q7 = _norm_backward_tile(
        gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_base, g_base, w_base, c, s, valid, mu, rstd, C, y_sc, y_ss, g_sc, g_ss,
        D, H, W, OD, OH, OW, g_sd, g_sh, w_sc, w_sd, w_sh, w_sw, PRE, POST, HAS_BIAS, POOL, POOL_GEOM)  # fmt: skip
    dv = rstd * (dxh - mean_dxh - xh * mean_dxh_xh)
    gy, a0, a1, a2, a3, a4, a5, a6, a7 = chain_grad_at(dv, yb, p_ptr, c, C, c < C, PRE)
    tl.store(gy_base + c.to(tl.int64) * gy_sc + s.to(tl.int64) * gy_ss, gy.to(gy_ptr.dtype.element_ty), mask=valid)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _backward_chunk_sums(gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, qpart_ptr, apart_ptr, y_base, g_base, w_base,
                         c_first, s_lo, s_hi, mu, rstd, row_base, part_row, C, CG, y_sc, y_ss, g_sc, g_ss,
                         D, H, W, OD, OH, OW, g_sd, g_sh, w_sc, w_sd, w_sh, w_sw,
                         PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, POOL: tl.constexpr,
                         POOL_GEOM: tl.constexpr, POST_MASK: tl.constexpr, AFFINE_MASK: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """The backward's first pass over channels ``c_first + [0, CG)`` and positions ``[s_lo, s_hi)``:
    returns the sums of ``dz * gamma`` and ``dz * gamma * x_hat``; stores the per-channel sums of
    gamma's, beta's and the post-chain's operand gradients at ``row_base + c`` of their rows."""
    cb = tl.arange(0, BLOCK_C)[:, None]
    sb = tl.arange(0, BLOCK_S)[None, :]
    sum_dxh = 0.0
    sum_dxh_xh = 0.0
    for c0 in range(0, CG, BLOCK_C):
        c = c_first + c0 + cb
        cmask1 = c0 + tl.arange(0, BLOCK_C) < CG
        dgamma = tl.zeros([BLOCK_C], tl.float32)
        dbeta = tl.zeros([BLOCK_C], tl.float32)
        p0 = tl.zeros([BLOCK_C], tl.float32)
        p1, p2, p3, p4, p5, p6, p7 = p0, p0, p0, p0, p0, p0, p0
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + sb
            valid = (c0 + cb < CG) & (s < s_hi)
            yb, xh, dz, dxh, q0, q1, q2, q3, q4, q5, q6, q7 = _norm_backward_tile(
                gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_base, g_base, w_base, c, s, valid, mu, rstd, C, y_sc, y_ss,
                g_sc, g_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sc, w_sd, w_sh, w_sw, PRE, POST, HAS_BIAS, POOL,
                POOL_GEOM)  # fmt: skip
            sum_dxh += tl.sum(tl.sum(dxh, axis=1), axis=0)
            sum_dxh_xh += tl.sum(tl.sum(tl.where(valid, dxh * xh, 0.0), axis=1), axis=0)
            dgamma = accumulate(dgamma, dz * xh, valid, (AFFINE_MASK & 1) != 0)
            dbeta = accumulate(dbeta, dz, valid, (AFFINE_MASK & 2) != 0)
            p0, p1, p2, p3, p4, p5, p6, p7 = accumulate_slots(
                p0, p1, p2, p3, p4, p5, p6, p7, q0, q1, q2, q3, q4, q5, q6, q7, valid, POST_MASK, False)
        c1 = row_base + c_first + c0 + tl.arange(0, BLOCK_C)
        if AFFINE_MASK != 0:
            store_rows(apart_ptr, part_row, c1, cmask1, dgamma, dbeta, dbeta, dbeta, dbeta, dbeta, dbeta, dbeta,
                        AFFINE_MASK)  # fmt: skip
        if POST_MASK != 0:
            store_rows(qpart_ptr, part_row, c1, cmask1, p0, p1, p2, p3, p4, p5, p6, p7, POST_MASK)
    return sum_dxh, sum_dxh_xh


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _group_norm_fwd_partial_kernel(
    y_ptr, p_ptr, ws_ptr,
    C, S, G, CG, CHUNK,
    y_sn, y_sc, y_ss,
    PRE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Per-chunk statistics of ``v = pre(y + bias)``, the first of the forward's two kernels when
    ``SPLIT > 1``.

    Pointers (element strides; ``S`` flattened positions):
      y_ptr    conv output without bias, (N, C, S), fp32/fp16/bf16, strides ``y_s*``.
      p_ptr    pre-chain operand matrix P, (NUM_PARAM_ROWS, C) fp32 contiguous (row 0: bias).
      ws_ptr   fp32 (N * G, SPLIT, 3) contiguous: per chunk its ``shift`` (the mean of its first tile),
               the mean of its values less ``shift`` and their sum of squared deviations from that mean.
    Grid: ``(N * G, SPLIT)``; program ``(pid, k)`` owns the chunk of positions ``k * CHUNK + [0, CHUNK)``
    (clipped to ``S``) of sample ``pid // G``'s channels ``(pid % G) * CG + [0, CG)``.
    """
    pid = tl.program_id(0)
    k = tl.program_id(1)
    s_lo = k * CHUNK
    shift, mean, m2, _ = chunk_moments(y_ptr, p_ptr, y_ptr + (pid // G).to(tl.int64) * y_sn, (pid % G) * CG, s_lo,
                                        tl.minimum(s_lo + CHUNK, S), C, CG, y_sc, y_ss, PRE, HAS_BIAS, BLOCK_C,
                                        BLOCK_S)  # fmt: skip
    w = ws_ptr + (pid * tl.num_programs(1) + k) * 3
    tl.store(w, shift)
    tl.store(w + 1, mean)
    tl.store(w + 2, m2)


@triton.jit
def _group_norm_fwd_kernel(
    y_ptr, p_ptr, q_ptr, a_ptr, out_ptr, st_ptr, ws_ptr,
    eps, C, S, G, CG, CHUNK, st_row,
    y_sn, y_sc, y_ss, o_sn, o_sc, o_ss,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE: tl.constexpr, SPLIT_P2: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out = post(group_norm(pre(y + bias)) * gamma + beta) on one chunk per program.

    Pointers (element strides; ``S`` flattened positions):
      y_ptr    conv output without bias, (N, C, S), fp32/fp16/bf16, strides ``y_s*``.
      p_ptr    pre-chain operand matrix P, (NUM_PARAM_ROWS, C) fp32 contiguous (row 0: bias).
      q_ptr    post-chain operand matrix Q, (NUM_PARAM_ROWS, C) fp32 contiguous.
      a_ptr    gamma and beta, (2, C) fp32 contiguous.
      out_ptr  result, (N, C, S), any float dtype, strides ``o_s*``.
      st_ptr   (SAVE) fp32 (2, N, G) contiguous: row 0 mean, row 1 rstd; row stride ``st_row``; written
               by the programs of chunk 0.
      ws_ptr   (SPLIT_P2 > 1) ``_group_norm_fwd_partial_kernel``'s fp32 (N * G, SPLIT, 3) workspace.
    Grid: ``(N * G, SPLIT)`` as the partial kernel's.  ``SPLIT_P2``: 1 when ``SPLIT`` is 1 (the program
    computes its group's statistics itself, no workspace, one launch), else ``SPLIT`` rounded up to
    a power of two (the lanes of the combine).
    """
    pid = tl.program_id(0)
    k = tl.program_id(1)
    n64 = (pid // G).to(tl.int64)
    c_first = (pid % G) * CG
    y_base = y_ptr + n64 * y_sn
    cb = tl.arange(0, BLOCK_C)[:, None]
    sb = tl.arange(0, BLOCK_S)[None, :]
    s_lo = k * CHUNK
    s_hi = tl.minimum(s_lo + CHUNK, S)

    # 1. the group's mean and variance: the whole group's walk, or its chunks' partials combined
    if SPLIT_P2 == 1:
        shift, mean, m2, count = chunk_moments(y_ptr, p_ptr, y_base, c_first, 0, S, C, CG, y_sc, y_ss, PRE,
                                                HAS_BIAS, BLOCK_C, BLOCK_S)  # fmt: skip
        mean = mean + shift
        var = m2 / count
    else:
        mean, var = combined_moments(ws_ptr, pid, tl.num_programs(1), CG, S, CHUNK, SPLIT_P2)
    rstd = 1.0 / tl.sqrt(var + eps)
    if SAVE:
        if k == 0:
            tl.store(st_ptr + pid, mean)
            tl.store(st_ptr + st_row + pid, rstd)

    # 2. normalise, scale and shift, post-chain, write
    o_base = out_ptr + n64 * o_sn
    for c0 in range(0, CG, BLOCK_C):
        c = c_first + c0 + cb
        cmask = c < C
        gamma = tl.load(a_ptr + c, mask=cmask, other=0.0)
        beta = tl.load(a_ptr + C + c, mask=cmask, other=0.0)
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + sb
            valid = (c0 + cb < CG) & (s < s_hi)
            _, v = tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
            z = (v - mean) * rstd * gamma + beta
            out = apply_chain_at(z, q_ptr, c, C, cmask, POST)
            tl.store(o_base + c.to(tl.int64) * o_sc + s.to(tl.int64) * o_ss, out.to(out_ptr.dtype.element_ty),
                     mask=valid)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _group_norm_bwd_partial_kernel(
    gout_ptr, y_ptr, st_ptr, p_ptr, q_ptr, a_ptr, ws_ptr, qpart_ptr, apart_ptr, win_ptr,
    C, S, G, CG, CHUNK, st_row, part_row,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sn, w_sc, w_sd, w_sh, w_sw,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, POOL: tl.constexpr, POOL_GEOM: tl.constexpr,
    POST_MASK: tl.constexpr, AFFINE_MASK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The backward's first pass per chunk, the first of its two kernels when ``SPLIT > 1``.

    Pointers (element strides; ``S`` flattened positions):
      gout_ptr   gradient of out, (N, C, S), any float dtype, strides ``g_s*``.
      y_ptr      the conv output without bias as the forward read it, strides ``y_s*``.
      st_ptr     the forward's fp32 (2, N, G) statistics (row 0 mean, row 1 rstd), row stride ``st_row``.
      p_ptr, q_ptr, a_ptr   as in the forward.
      ws_ptr     fp32 (N * G, SPLIT, 2) contiguous: per chunk the sums of ``dz * gamma`` and
                 ``dz * gamma * x_hat``.
      qpart_ptr  (POST_MASK) fp32 (MAX_SLOTS, N * SPLIT, C) contiguous: row k, the per-(n, chunk, c) sum
                 over the chunk's positions of the post-chain slot k's first-operand gradient;
                 ``part_row`` = N * SPLIT * C.
      apart_ptr  (AFFINE_MASK: bit 0 gamma, bit 1 beta) fp32 (2, N * SPLIT, C) contiguous: the same sums
                 of ``dz * x_hat`` (gamma's gradient) and ``dz`` (beta's).
      win_ptr    (max pool) the forward's winners, int8/int32, (N, C, OD, OH, OW), strides ``w_s*``.
    With a pool (POOL 1 max, 2 avg; POOL_GEOM ``chain_math.pool_geometry``'s) ``gout_ptr`` is the pooled
    output's gradient, (N, C, OD, OH, OW), strides ``(g_sn, g_sc, g_sd, g_sh, g_ss)``, and ``(D, H,
    W)`` are y's spatial sizes (``S = D * H * W``); these arguments are not read without one.
    Grid: ``(N * G, SPLIT)`` as the forward's.
    """
    pid = tl.program_id(0)
    k = tl.program_id(1)
    split = tl.num_programs(1)
    n64 = (pid // G).to(tl.int64)
    s_lo = k * CHUNK
    sum_dxh, sum_dxh_xh = _backward_chunk_sums(
        gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, qpart_ptr, apart_ptr, y_ptr + n64 * y_sn, gout_ptr + n64 * g_sn,
        win_ptr + n64 * w_sn, (pid % G) * CG, s_lo, tl.minimum(s_lo + CHUNK, S), tl.load(st_ptr + pid),
        tl.load(st_ptr + st_row + pid), (n64 * split + k) * C, part_row, C, CG, y_sc, y_ss, g_sc, g_ss, D, H, W, OD,
        OH, OW, g_sd, g_sh, w_sc, w_sd, w_sh, w_sw, PRE, POST, HAS_BIAS, POOL, POOL_GEOM, POST_MASK, AFFINE_MASK,
        BLOCK_C, BLOCK_S)  # fmt: skip
    w = ws_ptr + (pid * split + k) * 2
    tl.store(w, sum_dxh)
    tl.store(w + 1, sum_dxh_xh)


@triton.jit
def _group_norm_bwd_kernel(
    gout_ptr, y_ptr, st_ptr, p_ptr, q_ptr, a_ptr, gy_ptr, ws_ptr, part_ptr, qpart_ptr, apart_ptr, win_ptr,
    C, S, G, CG, CHUNK, st_row, part_row,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, gy_sn, gy_sc, gy_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sn, w_sc, w_sd, w_sh,
    w_sw, PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, POOL: tl.constexpr, POOL_GEOM: tl.constexpr,
    PRE_MASK: tl.constexpr, POST_MASK: tl.constexpr, AFFINE_MASK: tl.constexpr, SPLIT_P2: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """grad_y of ``out = post(group_norm(pre(y + bias)) * gamma + beta)`` on one chunk per program,
    and per-(n, chunk, c) partial sums.

    Pointers (element strides; ``S`` flattened positions):
      gout_ptr, y_ptr, st_ptr, p_ptr, q_ptr, a_ptr, win_ptr   as in ``_group_norm_bwd_partial_kernel`` (the
                 pool arguments too).
      gy_ptr     grad_y, (N, C, S), the conv output's dtype, strides ``gy_s*``.
      ws_ptr     (SPLIT_P2 > 1) ``_group_norm_bwd_partial_kernel``'s fp32 (N * G, SPLIT, 2) workspace.
      part_ptr   (PRE_MASK) fp32 (MAX_SLOTS, N * SPLIT, C) contiguous: row k, the per-(n, chunk, c) sum
                 over the chunk's positions of the pre-chain slot k's first-operand gradient;
                 ``part_row`` = N * SPLIT * C.
      qpart_ptr, apart_ptr   (SPLIT_P2 == 1 only; else the partial kernel writes them) as in
                 ``_group_norm_bwd_partial_kernel`` with SPLIT = 1.
    Grid: ``(N * G, SPLIT)``.  ``SPLIT_P2``: 1 when ``SPLIT`` is 1 (the program walks its group for the
    sums itself, one launch), else ``SPLIT`` rounded up to a power of two (the lanes of the combine).
    """
    pid = tl.program_id(0)
    k = tl.program_id(1)
    split = tl.num_programs(1)
    n64 = (pid // G).to(tl.int64)
    c_first = (pid % G) * CG
    y_base = y_ptr + n64 * y_sn
    g_base = gout_ptr + n64 * g_sn
    w_base = win_ptr + n64 * w_sn
    cb = tl.arange(0, BLOCK_C)[:, None]
    sb = tl.arange(0, BLOCK_S)[None, :]
    mu = tl.load(st_ptr + pid)
    rstd = tl.load(st_ptr + st_row + pid)
    row_base = (n64 * split + k) * C
    s_lo = k * CHUNK
    s_hi = tl.minimum(s_lo + CHUNK, S)

    # pass 1: the group's sums of dz * gamma and dz * gamma * x_hat: its own walk, or the chunks' sums
    if SPLIT_P2 == 1:
        sum_dxh, sum_dxh_xh = _backward_chunk_sums(
            gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, qpart_ptr, apart_ptr, y_base, g_base, w_base, c_first, 0, S, mu,
            rstd, row_base, part_row, C, CG, y_sc, y_ss, g_sc, g_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sc, w_sd,
            w_sh, w_sw, PRE, POST, HAS_BIAS, POOL, POOL_GEOM, POST_MASK, AFFINE_MASK, BLOCK_C, BLOCK_S)  # fmt: skip
    else:
        kk = tl.arange(0, SPLIT_P2)
        w = ws_ptr + (pid * split + kk) * 2
        sum_dxh = tl.sum(tl.load(w, mask=kk < split, other=0.0), axis=0)
        sum_dxh_xh = tl.sum(tl.load(w + 1, mask=kk < split, other=0.0), axis=0)
    count = CG * 1.0 * S
    mean_dxh = sum_dxh / count
    mean_dxh_xh = sum_dxh_xh / count

    # pass 2: the norm's input gradient, the pre-chain walked back, grad_y and pre-chain partials
    gy_base = gy_ptr + n64 * gy_sn
    for c0 in range(0, CG, BLOCK_C):
        c = c_first + c0 + cb
        cmask1 = c0 + tl.arange(0, BLOCK_C) < CG
        p0 = tl.zeros([BLOCK_C], tl.float32)
        p1, p2, p3, p4, p5, p6, p7 = p0, p0, p0, p0, p0, p0, p0
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + sb
            valid = (c0 + cb < CG) & (s < s_hi)
            a0, a1, a2, a3, a4, a5, a6, a7 = _input_grad_tile(
                gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, gy_ptr, y_base, g_base, w_base, gy_base, c, s, valid, mu, rstd,
                mean_dxh, mean_dxh_xh, C, y_sc, y_ss, g_sc, g_ss, gy_sc, gy_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sc,
                w_sd, w_sh, w_sw, PRE, POST, HAS_BIAS, POOL, POOL_GEOM)  # fmt: skip
            p0, p1, p2, p3, p4, p5, p6, p7 = accumulate_slots(
                p0, p1, p2, p3, p4, p5, p6, p7, a0, a1, a2, a3, a4, a5, a6, a7, valid, PRE_MASK, False)
        if PRE_MASK != 0:
            c1 = row_base + c_first + c0 + tl.arange(0, BLOCK_C)
            store_rows(part_ptr, part_row, c1, cmask1, p0, p1, p2, p3, p4, p5, p6, p7, PRE_MASK)


# --------------------------------------------------------------------------------------------------
# Channels-last kernels: a program owns a block of channels (of several groups) of one sample's chunk
# --------------------------------------------------------------------------------------------------


@triton.jit
def _channel_block(C, S, CHUNK, K, BLOCK_C: tl.constexpr):
    """What program ``(i, n * K + k)`` of a channels-last kernel owns: ``(c, cmask, n, start, end)``, its
    channels ``i * BLOCK_C + [0, BLOCK_C)`` as a ``[BLOCK_C, 1]`` column and their mask, its sample, and
    its chunk's positions ``[start, end)``."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
    j = tl.program_id(1)
    start = (j % K) * CHUNK
    return c, c < C, j // K, start, tl.minimum(start + CHUNK, S)


@triton.jit
def _per_channel(rows_ptr, row_stride, n, c, G, CG, cmask):
    """Rows 0 and 1 of a fp32 ``(2, N, G)`` buffer at each channel's group: ``[BLOCK_C, 1]`` each."""
    at = n * G + c // CG
    return (tl.load(rows_ptr + at, mask=cmask, other=0.0),
            tl.load(rows_ptr + row_stride + at, mask=cmask, other=0.0))  # fmt: skip


@triton.jit
def _group_norm_cl_stats_kernel(
    y_ptr, p_ptr, ws_ptr, C, S, CHUNK, K,
    y_sn, y_sc, y_ss,
    PRE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Per (sample, chunk, channel): the statistics of ``v = pre(y + bias)`` over the chunk's
    positions as ``shift`` (the channel's value at the chunk's first position), the mean of ``v -
    shift`` and the sum of squared deviations from it.  Each lane of the ``[BLOCK_C, BLOCK_S]`` tile
    keeps its own Welford accumulators of ``v - shift`` over the chunk's tiles, merged once at the end
    with Chan's formula (as ``batch_norm._batch_norm_stats_kernel``: the loop is elementwise).  The
    shift keeps the digits of a spread small against the values' size (3000 +- 0.01: unshifted, fp32
    Welford means lose them).

    Pointers (element strides; ``S`` flattened positions):
      y_ptr, p_ptr  as in ``_group_norm_fwd_partial_kernel``.
      ws_ptr   fp32 (N * K, 3, C) contiguous: rows shift, mean, sum of squared deviations.
    Grid: ``(cdiv(C, BLOCK_C), N * K)``; program ``(i, n * K + k)`` owns channels ``i * BLOCK_C + [0,
    BLOCK_C)`` and positions ``k * CHUNK + [0, CHUNK)`` (clipped to ``S``) of sample ``n``.
    """
    c, cmask, n, start, end = _channel_block(C, S, CHUNK, K, BLOCK_C)
    y_base = y_ptr + n.to(tl.int64) * y_sn
    sb = tl.arange(0, BLOCK_S)[None, :]
    full = (end - start) // BLOCK_S
    shift = tile_values(y_ptr, p_ptr, y_base, c, start, cmask, C, y_sc, y_ss, PRE, HAS_BIAS)[1]
    mean = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
    m2 = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
    for i in tl.range(0, full, num_stages=STAGES):  # full tiles: every lane's count is i + 1
        _, v = tile_values(y_ptr, p_ptr, y_base, c, start + i * BLOCK_S + sb, cmask, C, y_sc, y_ss, PRE, HAS_BIAS)
        v = v - shift
        delta = v - mean
        mean = mean + delta * (1.0 / (i + 1.0))  # one reciprocal per tile (NOTE in ``batch_norm``'s statistics)
        m2 = m2 + delta * (v - mean)
    count = tl.zeros([BLOCK_C, BLOCK_S], tl.float32) + full.to(tl.float32)
    s = start + full * BLOCK_S + sb
    if start + full * BLOCK_S < end:  # the partial tile: per-lane counts
        valid = cmask & (s < end)
        _, v = tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
        v = v - shift
        n_new = count + valid.to(tl.float32)
        delta = v - mean
        mean = mean + tl.where(valid, delta / tl.maximum(n_new, 1.0), 0.0)
        m2 = m2 + tl.where(valid, delta * (v - mean), 0.0)
        count = n_new
    total = tl.sum(count, axis=1)
    chunk_mean = tl.sum(mean * count, axis=1) / tl.maximum(total, 1.0)
    d = mean - chunk_mean[:, None]
    chunk_m2 = tl.sum(m2 + count * d * d, axis=1)
    c1 = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    w = ws_ptr + tl.program_id(1).to(tl.int64) * 3 * C + c1
    tl.store(w, tl.sum(shift, axis=1), mask=c1 < C)
    tl.store(w + C, chunk_mean, mask=c1 < C)
    tl.store(w + 2 * C, chunk_m2, mask=c1 < C)


@triton.jit
def _combine_lanes(rows, k, g, K, CG, C, S, CHUNK, ROWS: tl.constexpr):
    """Lanes of chunks ``k`` by group channels ``g`` of one (sample, group)'s combine: ``(live, at,
    count)``, which lanes hold an entry, their row-0 addresses in ``rows``, and their chunk's value count."""
    live = (k < K) & (g < CG)
    count = tl.where(live, tl.minimum(CHUNK, S - k * CHUNK), 0).to(tl.float32)
    return live, rows + k * ROWS * C + g, count


@triton.jit
def _shifted_mean(at, live, C, shift0):
    """A chunk's mean relative to the group's first shift: ``(shift - shift0) + mean`` (0 off ``live``)."""
    return (tl.load(at, mask=live, other=0.0) - shift0) + tl.load(at + C, mask=live, other=0.0)


@triton.jit
def _group_norm_cl_combine_kernel(ws_ptr, out_ptr, eps, C, S, G, CG, CHUNK, K, out_row,
                                  MOMENTS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """Per (sample, group) (program ``n * G + g``): its ``K`` chunks' by ``CG`` channels' entries of
    ``ws_ptr`` combined into row 0 and row 1 of ``out_ptr`` (fp32 (2, N, G) contiguous, row stride
    ``out_row``).  ``MOMENTS``: ``ws_ptr`` is ``_group_norm_cl_stats_kernel``'s (N * K, 3, C) rows of
    ``min(CHUNK, S - k * CHUNK)`` values each, combined with Chan's decomposition ``M2 = sum M2_i + sum
    n_i (r_i - mean)^2``, each mean taken relative to the group's first shift as ``r_i = (shift_i -
    shift_0) + mean_i`` (the shifts of values close together are close, so their difference is
    exact), into the group's mean and ``1 / sqrt(var + eps)``; else ``ws_ptr`` is (N * K, 2, C) sums,
    and the results their totals over the group divided by its ``CG * S`` values.  Every sum runs over
    a fixed shape in a fixed order: bitwise reproducible."""
    pid = tl.program_id(0)
    ROWS: tl.constexpr = 3 if MOMENTS else 2
    rows = ws_ptr + (pid // G).to(tl.int64) * K * ROWS * C + (pid % G) * CG
    kk = tl.arange(0, BLOCK_K)[:, None]
    gg = tl.arange(0, BLOCK_G)[None, :]
    values = CG * 1.0 * S
    shift0 = tl.load(rows) if MOMENTS else 0.0
    acc0 = tl.zeros([BLOCK_K, BLOCK_G], tl.float32)
    acc1 = tl.zeros([BLOCK_K, BLOCK_G], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for g0 in range(0, CG, BLOCK_G):
            live, at, count = _combine_lanes(rows, k0 + kk, g0 + gg, K, CG, C, S, CHUNK, ROWS)
            if MOMENTS:
                acc0 += count * _shifted_mean(at, live, C, shift0)
                acc1 += tl.load(at + 2 * C, mask=live, other=0.0)
            else:
                acc0 += tl.load(at, mask=live, other=0.0)
                acc1 += tl.load(at + C, mask=live, other=0.0)
    first = tl.sum(tl.sum(acc0, axis=1), axis=0) / values
    second = tl.sum(tl.sum(acc1, axis=1), axis=0)
    if MOMENTS:
        dev = tl.zeros([BLOCK_K, BLOCK_G], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            for g0 in range(0, CG, BLOCK_G):
                live, at, count = _combine_lanes(rows, k0 + kk, g0 + gg, K, CG, C, S, CHUNK, ROWS)
                d = _shifted_mean(at, live, C, shift0) - first
                dev += count * d * d
        second = 1.0 / tl.sqrt((second + tl.sum(tl.sum(dev, axis=1), axis=0)) / values + eps)
        first = first + shift0
    else:
        second = second / values
    tl.store(out_ptr + pid, first)
    tl.store(out_ptr + out_row + pid, second)


@triton.jit
def _group_norm_cl_apply_kernel(
    y_ptr, p_ptr, q_ptr, a_ptr, st_ptr, out_ptr, C, S, G, CG, CHUNK, K, st_row,
    y_sn, y_sc, y_ss, o_sn, o_sc, o_ss,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """out = post(group_norm(pre(y + bias)) * gamma + beta) from the group statistics ``st_ptr`` (fp32
    (2, N, G): mean, rstd; row stride ``st_row``); pointers otherwise as in ``_group_norm_fwd_kernel``.
    Grid: as ``_group_norm_cl_stats_kernel``'s."""
    c, cmask, n, start, end = _channel_block(C, S, CHUNK, K, BLOCK_C)
    mu, rstd = _per_channel(st_ptr, st_row, n, c, G, CG, cmask)
    scale = rstd * tl.load(a_ptr + c, mask=cmask, other=0.0)
    beta = tl.load(a_ptr + C + c, mask=cmask, other=0.0)
    y_base = y_ptr + n.to(tl.int64) * y_sn
    o_base = out_ptr + n.to(tl.int64) * o_sn
    sb = tl.arange(0, BLOCK_S)[None, :]
    for s0 in tl.range(start, end, BLOCK_S, num_stages=STAGES):
        s = s0 + sb
        valid = cmask & (s < end)
        _, v = tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
        out = apply_chain_at((v - mu) * scale + beta, q_ptr, c, C, cmask, POST)
        tl.store(o_base + c.to(tl.int64) * o_sc + s.to(tl.int64) * o_ss, out.to(out_ptr.dtype.element_ty),
                 mask=valid)  # fmt: skip


@triton.jit
def _group_norm_cl_bwd_sums_kernel(
    gout_ptr, y_ptr, st_ptr, p_ptr, q_ptr, a_ptr, ws_ptr, qpart_ptr, apart_ptr, win_ptr,
    C, S, G, CG, CHUNK, K, st_row, part_row,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sn, w_sc, w_sd, w_sh, w_sw,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, POOL: tl.constexpr, POOL_GEOM: tl.constexpr,
    POST_MASK: tl.constexpr, AFFINE_MASK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """The backward's sums per (sample, chunk, channel): of ``dz * gamma`` and ``dz * gamma * x_hat``
    into ``ws_ptr`` (fp32 (N * K, 2, C) contiguous), of gamma's, beta's and the post-chain's operand
    gradients into their rows of ``apart_ptr`` / ``qpart_ptr`` (as ``_group_norm_bwd_partial_kernel``'s,
    with ``N * K`` (sample, chunk) rows).  Other pointers as there.  Grid: as
    ``_group_norm_cl_stats_kernel``'s."""
    c, cmask, n, start, end = _channel_block(C, S, CHUNK, K, BLOCK_C)
    n64 = n.to(tl.int64)
    j = tl.program_id(1)  # the (sample, chunk) row of the partial sums
    mu, rstd = _per_channel(st_ptr, st_row, n, c, G, CG, cmask)
    y_base = y_ptr + n64 * y_sn
    g_base = gout_ptr + n64 * g_sn
    w_base = win_ptr + n64 * w_sn
    sb = tl.arange(0, BLOCK_S)[None, :]
    # per-lane sums, reduced across the lanes once after the walk (the loop stays elementwise)
    sum_dxh = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
    sum_dxh_xh = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
    dgamma = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
    dbeta = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
    p0 = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
    p1, p2, p3, p4, p5, p6, p7 = p0, p0, p0, p0, p0, p0, p0
    for s0 in tl.range(start, end, BLOCK_S, num_stages=STAGES):
        s = s0 + sb
        valid = cmask & (s < end)
        yb, xh, dz, dxh, q0, q1, q2, q3, q4, q5, q6, q7 = _norm_backward_tile(
            gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_base, g_base, w_base, c, s, valid, mu, rstd, C, y_sc, y_ss,
            g_sc, g_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sc, w_sd, w_sh, w_sw, PRE, POST, HAS_BIAS, POOL,
            POOL_GEOM)  # fmt: skip
        sum_dxh += dxh
        sum_dxh_xh += tl.where(valid, dxh * xh, 0.0)
        dgamma = accumulate_lanes(dgamma, dz * xh, valid, (AFFINE_MASK & 1) != 0)
        dbeta = accumulate_lanes(dbeta, dz, valid, (AFFINE_MASK & 2) != 0)
        p0, p1, p2, p3, p4, p5, p6, p7 = accumulate_slots(
            p0, p1, p2, p3, p4, p5, p6, p7, q0, q1, q2, q3, q4, q5, q6, q7, valid, POST_MASK, True)
    c1 = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask1 = c1 < C
    w = ws_ptr + j.to(tl.int64) * 2 * C + c1
    tl.store(w, tl.sum(sum_dxh, axis=1), mask=cmask1)
    tl.store(w + C, tl.sum(sum_dxh_xh, axis=1), mask=cmask1)
    row = j.to(tl.int64) * C + c1
    if AFFINE_MASK != 0:
        store_rows(apart_ptr, part_row, row, cmask1, dgamma, dbeta, dbeta, dbeta, dbeta, dbeta, dbeta, dbeta, AFFINE_MASK,
                   LANES=True)  # fmt: skip
    if POST_MASK != 0:
        store_rows(qpart_ptr, part_row, row, cmask1, p0, p1, p2, p3, p4, p5, p6, p7, POST_MASK, LANES=True)


@triton.jit
def _group_norm_cl_bwd_dx_kernel(
    gout_ptr, y_ptr, st_ptr, gs_ptr, p_ptr, q_ptr, a_ptr, gy_ptr, part_ptr, win_ptr,
    C, S, G, CG, CHUNK, K, st_row, part_row,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, gy_sn, gy_sc, gy_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sn, w_sc, w_sd, w_sh,
    w_sw, PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, POOL: tl.constexpr, POOL_GEOM: tl.constexpr,
    PRE_MASK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """grad_y (``gy_ptr``, strides ``gy_s*``) from the group means of ``dz * gamma`` and ``dz * gamma *
    x_hat`` (``gs_ptr``, fp32 (2, N, G), row stride ``st_row`` as the statistics'), and the pre-chain's
    per-(sample, chunk, channel) operand-gradient sums (``part_ptr``, as ``_group_norm_bwd_kernel``'s
    with ``N * K`` rows).  Other pointers as in ``_group_norm_cl_bwd_sums_kernel``; same grid."""
    c, cmask, n, start, end = _channel_block(C, S, CHUNK, K, BLOCK_C)
    n64 = n.to(tl.int64)
    j = tl.program_id(1)  # the (sample, chunk) row of the partial sums
    mu, rstd = _per_channel(st_ptr, st_row, n, c, G, CG, cmask)
    mean_dxh, mean_dxh_xh = _per_channel(gs_ptr, st_row, n, c, G, CG, cmask)
    y_base = y_ptr + n64 * y_sn
    g_base = gout_ptr + n64 * g_sn
    w_base = win_ptr + n64 * w_sn
    gy_base = gy_ptr + n64 * gy_sn
    sb = tl.arange(0, BLOCK_S)[None, :]
    p0 = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)  # per-lane sums, as the sums kernel's
    p1, p2, p3, p4, p5, p6, p7 = p0, p0, p0, p0, p0, p0, p0
    for s0 in tl.range(start, end, BLOCK_S, num_stages=STAGES):
        s = s0 + sb
        valid = cmask & (s < end)
        a0, a1, a2, a3, a4, a5, a6, a7 = _input_grad_tile(
            gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, gy_ptr, y_base, g_base, w_base, gy_base, c, s, valid, mu, rstd,
            mean_dxh, mean_dxh_xh, C, y_sc, y_ss, g_sc, g_ss, gy_sc, gy_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sc, w_sd,
            w_sh, w_sw, PRE, POST, HAS_BIAS, POOL, POOL_GEOM)  # fmt: skip
        p0, p1, p2, p3, p4, p5, p6, p7 = accumulate_slots(
            p0, p1, p2, p3, p4, p5, p6, p7, a0, a1, a2, a3, a4, a5, a6, a7, valid, PRE_MASK, True)
    if PRE_MASK != 0:
        c1 = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        store_rows(part_ptr, part_row, j.to(tl.int64) * C + c1, c1 < C, p0, p1, p2, p3, p4, p5, p6, p7, PRE_MASK,
                   LANES=True)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _tile(group_channels: int, positions: int) -> tuple[int, int]:
    """``(BLOCK_C, BLOCK_S)``: the group's channels (at most ``MAX_BLOCK_C`` at once), positions
    filling ``TILE_ELEMENTS``."""
    block_c = min(next_pow2(group_channels), MAX_BLOCK_C)
    block_s = max(1, min(next_pow2(max(positions, 1)), TILE_ELEMENTS // block_c))
    return block_c, block_s


@dataclass(frozen=True)
class _Chunks:
    """How one launch cuts its groups: ``(BLOCK_C, BLOCK_S)`` tiles, ``chunk`` positions per chunk,
    ``split`` chunks per group, ``split_p2`` the kernels' ``SPLIT_P2`` (see their docstrings)."""

    block_c: int
    block_s: int
    chunk: int
    split: int
    split_p2: int

    @staticmethod
    def plan(n: int, groups: int, group_channels: int, positions: int, device: torch.device,
             chunk: int | None) -> _Chunks:  # fmt: skip
        """``chunk`` given (tests force a split with it): that many positions per chunk, tiles no
        longer than a chunk; else ``chunk_positions``' choice."""
        block_c, block_s = _tile(group_channels, positions)
        if chunk is None:
            chunk = chunk_positions(n * groups, group_channels, positions, block_s, sm_count(device))
        else:
            if chunk < 1:
                raise ValueError(f"chunk_positions must be positive, got {chunk}")
            chunk = min(int(chunk), max(positions, 1))
            block_s = min(block_s, next_pow2(chunk))
        chunk = max(chunk, 1)  # no positions: nothing launches
        split = cdiv(max(positions, 1), chunk)
        return _Chunks(block_c, block_s, chunk, split, 1 if split == 1 else next_pow2(split))

    @property
    def num_warps(self) -> int:
        return 8 if self.block_c * self.block_s >= 2048 else 4


#: Bytes of a DRAM sector, what one memory transaction moves (``takes_channels_last_kernels``).
SECTOR_BYTES = 32


def takes_channels_last_kernels(y: torch.Tensor, groups: int, chunk: int | None = None) -> bool:
    """Whether a call on ``y`` (N, C, *spatial) runs the channels-last kernels: ``y``'s channels are its
    contiguous axis, and the group kernels would not read it well, because a position's run of a
    group's ``C / groups`` channels is shorter than a DRAM sector (most of each sector read is other
    groups' data) or because they split its groups into chunks (two launches, each reading those runs).
    Otherwise the group kernels' one launch (a program normalising a group whole) is kept.
    NOTE: measured on the H200 (bf16, GroupNorm + SiLU, GPU us per call forward / backward, group
    kernels against channels-last kernels; a scratch sweep over ``tools/bench_batch_norm.py
    --groups``' functions, docs/perf/RESULTS.md "GroupNorm on channels-last tensors"): 1x512x256x256,
    G 32 (split groups of 16 channels) 177 / 327 against 82 / 154; 64x64x56x56, G 32 (one launch,
    runs of 4 bytes) 181 / 269 against 46 / 110; 13 shapes summed 1,349 / 1,939 against 552 / 1,120.
    The sector rule costs small tensors their launches: 32x128x16x16 (2 MB) 11.1 / 20.4 against
    14.8 / 28.4, 4x96x32x32 9.1 / 15.6 against 14.6 / 26.2."""
    n, channels = y.shape[:2]
    if not channels_innermost(y.stride(), y.shape) or y.numel() == 0:
        return False
    group_channels = channels // groups
    if group_channels * y.element_size() < SECTOR_BYTES:
        return True
    return _Chunks.plan(n, groups, group_channels, y[0, 0].numel(), y.device, chunk).split > 1


@dataclass(frozen=True)
class _ChannelBlocks:
    """How the channels-last kernels cut a ``(N, C, S)`` tensor: ``[block_c, block_s]`` tiles,
    ``blocks`` channel blocks, ``chunks`` chunks of ``chunk`` positions per sample (every kernel of a
    call the same), ``grid``; the combine's lanes ``block_k`` x ``block_g``."""

    block_c: int
    block_s: int
    chunk: int
    chunks: int
    blocks: int
    block_k: int
    block_g: int

    @staticmethod
    def plan(n: int, channels: int, group_channels: int, positions: int, chunk: int | None) -> _ChannelBlocks:
        """BatchNorm's channels-last tiling (``kernels/batch_norm.py``): 64 channels by the positions
        that fill ``TILE_ELEMENTS``; chunks of ``CL_MIN_CHUNK_TILES`` tiles or more, as many as bring
        the grid to ``TARGET_PROGRAMS``.  ``chunk`` given (tests): that many positions per chunk."""
        block_c = min(next_pow2(channels), CHANNELS_LAST_BLOCK_C)
        block_s = max(1, min(next_pow2(max(positions, 1)), TILE_ELEMENTS // block_c))
        blocks = cdiv(channels, block_c)
        if chunk is None:
            tiles, rows = cdiv(max(positions, 1), block_s), blocks * max(n, 1)
            wanted = max(1, min(cdiv(tiles, CL_MIN_CHUNK_TILES), cdiv(TARGET_PROGRAMS, rows)))
            chunk = cdiv(tiles, wanted) * block_s
        else:
            if chunk < 1:
                raise ValueError(f"chunk_positions must be positive, got {chunk}")
            block_s = min(block_s, next_pow2(chunk))
        chunk = min(chunk, max(positions, 1))
        chunks = cdiv(max(positions, 1), chunk)
        block_g = min(next_pow2(group_channels), COMBINE_GROUP_LANES)
        block_k = min(next_pow2(chunks), max(1, COMBINE_LANES // block_g))
        return _ChannelBlocks(block_c, block_s, chunk, chunks, blocks, block_k, block_g)

    def grid(self, n: int) -> tuple[int, int]:
        return (self.blocks, n * self.chunks)

    def tiles(self, stages: int) -> dict[str, int]:
        """The tile constexprs and launch options of the walking kernels."""
        return dict(BLOCK_C=self.block_c, BLOCK_S=self.block_s, STAGES=stages,
                    num_warps=8 if self.block_c * self.block_s >= 2048 else 4)  # fmt: skip

    def combine(self, n: int, groups: int, channels: int, positions: int, moments: bool) -> FastLaunch:
        """The combine's launch over ``n * groups`` programs (``_group_norm_cl_combine_kernel``)."""
        return FastLaunch(_group_norm_cl_combine_kernel, (n * groups,), dict(
            MOMENTS=moments, BLOCK_K=self.block_k, BLOCK_G=self.block_g, num_warps=4),
            fixed=(channels, positions, groups, channels // groups, self.chunk, self.chunks, n * groups))  # fmt: skip


def _check_common(y: torch.Tensor, groups: int, params: torch.Tensor, post_params: torch.Tensor,
                  affine: torch.Tensor) -> tuple[int, int, int]:  # fmt: skip
    """``(N, C, S)`` of ``y`` after checking the arguments every launch shares."""
    if not 3 <= y.dim() <= 5:
        raise ValueError(f"y must be (N, C, *spatial) with 1-3 spatial dims, got {tuple(y.shape)}")
    n, channels = y.shape[:2]
    if groups < 1 or channels % groups != 0:
        raise ValueError(f"{channels} channels do not split into {groups} groups")
    for name, t, rows in (("P", params, None), ("Q", post_params, None), ("the affine rows", affine, 2)):
        require_rows(name, t, channels, rows)
        require_same_device(y.device, **{name: t})
    return n, channels, y[0, 0].numel()


#: Launch plans by what they depend on (shapes, strides, dtypes, op codes, groups, wanted outputs).
_FORWARD_LAUNCHES = PlanCache()
_BACKWARD_LAUNCHES = PlanCache()


def group_norm_forward(
    y: torch.Tensor, has_bias: bool, pre: Sequence[KernelStep], post: Sequence[KernelStep], groups: int, eps: float,
    params: torch.Tensor, post_params: torch.Tensor, affine: torch.Tensor, out: torch.Tensor,
    stats: torch.Tensor | None = None, chunk: int | None = None,
) -> None:  # fmt: skip
    """Write ``out = post(group_norm(pre(y + bias)) * gamma + beta)`` (and with ``stats`` the group
    statistics): one launch when each group is one chunk, else two (partials, then combine and write).

    Args:
      y: conv output without bias, (N, C, *spatial) with 1-3 spatial dims that flatten (contiguous or
        channels-last), fp32/fp16/bf16.
      has_bias: whether ``params``' bias row holds a bias.
      pre, post: the chains as ``(op code, operand values)`` (values only decide the op codes here).
      groups: G, dividing C.
      eps: added to each group's biased variance.
      params: P, fp32 (NUM_PARAM_ROWS, C) contiguous (``kernels.epilogue.build_params``).
      post_params: Q, the same for the post-chain (no bias row content).
      affine: fp32 (2, C) contiguous: gamma, beta (ones / zeros without an affine norm).
      out: preallocated, y's shape (spatial dims flatten), any float dtype.
      stats: None, or preallocated fp32 (2, N, G) contiguous: mean, rstd.
      chunk: positions per chunk of a group instead of ``chunk_positions``' choice (tests).
    """
    parts = (y, has_bias, step_codes(pre), step_codes(post), groups,
           float(eps), params, post_params, affine, out,
           stats, chunk)  # fmt: skip
    launch = _FORWARD_LAUNCHES.plan(parts, lambda: group_norm_launch(y, has_bias, pre, post, groups, eps, params,
                                                                  post_params, affine, out, stats, chunk))  # fmt: skip
    launch(y, params, post_params, affine, out, stats, float(eps))


def group_norm_launch(
    y: torch.Tensor, has_bias: bool, pre: Sequence[KernelStep], post: Sequence[KernelStep], groups: int, eps: float,
    params: torch.Tensor, post_params: torch.Tensor, affine: torch.Tensor, out: torch.Tensor,
    stats: torch.Tensor | None = None, chunk: int | None = None,
) -> Any:
    """``group_norm_forward``'s launch for its arguments' signature, checked and worked out, for a
    caller that keeps it (a fused op's call plan): ``launch(y, params, post_params, affine, out, stats,
    eps)`` runs it on any tensors of that signature."""
    return _ForwardLaunch(y, has_bias, pre, post, groups, eps, params, post_params, affine, out, stats, chunk)


class _ForwardLaunch:
    """``group_norm_forward`` for one signature: arguments checked and the launches worked out once.
    A channels-last ``y`` takes the channels-last kernels: statistics per channel, their combine per
    group, then the normalise pass (three launches); any other the group kernels (one or two)."""

    def __init__(self, y, has_bias, pre, post, groups, eps, params, post_params, affine, out, stats, chunk) -> None:
        n, channels, positions = _check_common(y, groups, params, post_params, affine)
        if out.shape != y.shape:
            raise ValueError(f"out must have y's shape {tuple(y.shape)}, got {tuple(out.shape)}")
        if stats is not None and (tuple(stats.shape) != (2, n, groups) or not stats.is_contiguous()
                                  or stats.dtype != torch.float32):  # fmt: skip
            raise ValueError(f"stats must be contiguous fp32 (2, {n}, {groups}), got {tuple(stats.shape)} {stats.dtype}")
        group_channels = channels // groups
        self.save = stats is not None
        self.workspace = self.stats_shape = None
        self.launch = self.partial = self.combine = None
        if out.numel() == 0:
            return
        y_flat, out_flat = flat_strides("y", y), flat_strides("out", out)
        if takes_channels_last_kernels(y, groups, chunk):
            blocks = _ChannelBlocks.plan(n, channels, group_channels, positions, chunk)
            self.workspace, self.stats_shape = (n * blocks.chunks, 3, channels), (2, n, groups)
            self.partial = FastLaunch(_group_norm_cl_stats_kernel, blocks.grid(n), dict(
                PRE=op_codes(pre), HAS_BIAS=has_bias, **blocks.tiles(CL_REDUCE_STAGES)),
                fixed=(channels, positions, blocks.chunk, blocks.chunks, *y_flat))  # fmt: skip
            self.combine = blocks.combine(n, groups, channels, positions, moments=True)
            self.launch = FastLaunch(_group_norm_cl_apply_kernel, blocks.grid(n), dict(
                PRE=op_codes(pre), POST=op_codes(post), HAS_BIAS=has_bias, **blocks.tiles(CL_POINTWISE_STAGES)),
                fixed=(channels, positions, groups, group_channels, blocks.chunk, blocks.chunks, n * groups, *y_flat,
                       *out_flat))  # fmt: skip
            return
        plan = _Chunks.plan(n, groups, group_channels, positions, y.device, chunk)
        self.workspace = (n * groups, plan.split, 3) if plan.split > 1 else None
        grid = (n * groups, plan.split)
        tiles = dict(BLOCK_C=plan.block_c, BLOCK_S=plan.block_s, num_warps=plan.num_warps)
        if self.workspace is not None:
            self.partial = FastLaunch(_group_norm_fwd_partial_kernel, grid, dict(
                PRE=op_codes(pre), HAS_BIAS=has_bias, **tiles), fixed=(channels, positions, groups, group_channels,
                                                                   plan.chunk, *y_flat))  # fmt: skip
        ints = (float(eps), channels, positions, groups, group_channels, plan.chunk, n * groups, *y_flat, *out_flat)
        self.launch = FastLaunch(_group_norm_fwd_kernel, grid, dict(
            PRE=op_codes(pre), POST=op_codes(post), HAS_BIAS=has_bias, SAVE=self.save, SPLIT_P2=plan.split_p2, **tiles,
        ), fixed=ints)  # fmt: skip

    def __call__(self, y, params, post_params, affine, out, stats, eps: float) -> None:
        if self.launch is None:
            return
        ws = params
        if self.partial is not None:
            ws = torch.empty(self.workspace, dtype=torch.float32, device=y.device)
            self.partial(y, params, ws)
        if self.combine is not None:
            if not self.save:
                stats = torch.empty(self.stats_shape, dtype=torch.float32, device=y.device)
            self.combine(ws, stats, eps)
            self.launch(y, params, post_params, affine, stats, out)
            return
        self.launch(y, params, post_params, affine, out, stats if self.save else params, ws)


def group_norm_stats(y: torch.Tensor, has_bias: bool, pre: Sequence[KernelStep], groups: int, eps: float,
                     params: torch.Tensor, stats: torch.Tensor, chunk: int | None = None) -> None:  # fmt: skip
    """Write the group statistics of ``pre(y + bias)`` into ``stats`` and nothing else: the forward's
    statistics pass alone, for a region whose normalise pass is another kernel's (a pool after the
    post-chain: ``norm_pool.norm_pool_forward``).  The chunks are ``group_norm_forward``'s; the
    per-chunk partial kernel runs over them (one chunk per group where the plan does not split),
    then torch combines the partials with ``norm_common.combined_moments``' decomposition over the
    fixed ``(N * G, SPLIT)`` shape: bitwise reproducible.

    Args:
      y, has_bias, pre, groups, eps, params, chunk: as ``group_norm_forward`` takes them.
      stats: preallocated fp32 (2, N, G) contiguous: row 0 the means, row 1 ``1 / sqrt(var + eps)``.
    """
    parts = (y, has_bias, step_codes(pre), groups, params, stats,
           chunk)  # fmt: skip
    launch = _STATS_LAUNCHES.plan(parts, lambda: _StatsLaunch(y, has_bias, pre, groups, params, stats, chunk))
    launch(y, params, stats, float(eps))


_STATS_LAUNCHES = PlanCache()


class _StatsLaunch:
    """``group_norm_stats`` for one signature: arguments checked and the launches worked out once (a
    channels-last ``y``: the channels-last statistics and their combine, as ``_ForwardLaunch``)."""

    def __init__(self, y, has_bias, pre, groups, params, stats, chunk) -> None:
        n, channels, positions = _check_common(y, groups, params, params, params[:2])  # (only P is read here)
        if tuple(stats.shape) != (2, n, groups) or not stats.is_contiguous() or stats.dtype != torch.float32:
            raise ValueError(f"stats must be contiguous fp32 (2, {n}, {groups}), got {tuple(stats.shape)} {stats.dtype}")
        group_channels = channels // groups
        self.launch = self.combine = None
        if y.numel() == 0:
            return
        if takes_channels_last_kernels(y, groups, chunk):
            blocks = _ChannelBlocks.plan(n, channels, group_channels, positions, chunk)
            self.workspace = (n * blocks.chunks, 3, channels)
            self.launch = FastLaunch(_group_norm_cl_stats_kernel, blocks.grid(n), dict(
                PRE=op_codes(pre), HAS_BIAS=has_bias, **blocks.tiles(CL_REDUCE_STAGES)),
                fixed=(channels, positions, blocks.chunk, blocks.chunks, *flat_strides("y", y)))  # fmt: skip
            self.combine = blocks.combine(n, groups, channels, positions, moments=True)
            return
        plan = _Chunks.plan(n, groups, group_channels, positions, y.device, chunk)
        self.workspace = (n * groups, plan.split, 3)
        self.values = float(group_channels * positions)
        ends = torch.minimum(torch.arange(1, plan.split + 1) * plan.chunk, torch.tensor(positions))
        #: values per chunk of a group, fp32 (SPLIT,)
        self.counts = (group_channels * (ends - torch.arange(plan.split) * plan.chunk)).to(torch.float32).to(y.device)
        self.launch = FastLaunch(_group_norm_fwd_partial_kernel, (n * groups, plan.split), dict(
            PRE=op_codes(pre), HAS_BIAS=has_bias, BLOCK_C=plan.block_c, BLOCK_S=plan.block_s,
            num_warps=plan.num_warps), fixed=(channels, positions, groups, group_channels, plan.chunk,
                                              *flat_strides("y", y)))  # fmt: skip

    def __call__(self, y, params, stats, eps: float) -> None:
        if self.launch is None:
            stats.zero_()
            return
        ws = torch.empty(self.workspace, dtype=torch.float32, device=y.device)
        self.launch(y, params, ws)
        if self.combine is not None:
            self.combine(ws, stats, eps)
            return
        shift, means, m2s = ws.unbind(2)
        r = (shift - shift[:, :1]) + means  # each chunk's mean relative to chunk 0's shift
        mean = (r * self.counts).sum(1) / self.values
        m2 = m2s.sum(1) + (self.counts * (r - mean[:, None]).square()).sum(1)
        stats[0].copy_((mean + shift[:, 0]).view(stats.shape[1:]))
        stats[1].copy_(torch.rsqrt(m2 / self.values + eps).view(stats.shape[1:]))


def group_norm_backward(
    grad_out: torch.Tensor, y: torch.Tensor, stats: torch.Tensor, has_bias: bool, pre: Sequence[KernelStep],
    post: Sequence[KernelStep], groups: int, params: torch.Tensor, post_params: torch.Tensor, affine: torch.Tensor,
    grad_y: torch.Tensor, pre_grad_slots: Sequence[bool] = (), post_grad_slots: Sequence[bool] = (),
    affine_grads: tuple[bool, bool] = (False, False), chunk: int | None = None, pool: PoolSpec | None = None,
    winner: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[torch.Tensor | None]]:  # fmt: skip
    """Write the conv-output gradient into ``grad_y``; return the per-channel parameter gradients.
    One launch when each group is one chunk, else two (per-chunk sums, then combine and write).

    Args:
      grad_out: gradient of ``out`` (y's shape, any strides, any float dtype); with ``pool``, of the
        pooled output (N, C, *pooled spatial), any strides.
      y: the conv output without bias as given to the forward.
      stats: the forward's fp32 (2, N, G) statistics.
      has_bias, pre, post, groups, params, post_params, affine: as given to the forward.
      grad_y: preallocated (N, C, *spatial), spatial dims flattening, the conv output's dtype.
      pre_grad_slots / post_grad_slots: per slot of each chain, whether its first operand's gradient
        is wanted; affine_grads: whether gamma's / beta's are.
      chunk: positions per chunk of a group instead of ``chunk_positions``' choice (tests).
      pool: None, or the max / avg pool the forward applied after the post-chain
        (``norm_pool.norm_pool_forward``).
      winner: a max pool's winners as that forward saved them (int8 / int32, grad_out's shape).
    Returns:
      ``(pre_sums, post_sums, affine_sums)``: per slot (per gamma, beta), None or the fp32 (C,) sum over
      samples and positions of its gradient, the (sample, chunk) partials summed in a fixed order.
    """
    parts = (grad_out, y, stats, has_bias, step_codes(pre),
           step_codes(post), groups, params, post_params, affine,
           grad_y, tuple(map(bool, pre_grad_slots)), tuple(map(bool, post_grad_slots)),
           tuple(map(bool, affine_grads)), chunk, pool, winner)  # fmt: skip
    launch = _BACKWARD_LAUNCHES.plan(parts, lambda: group_norm_backward_launch(
        grad_out, y, stats, has_bias, pre, post, groups, params, post_params, affine, grad_y, pre_grad_slots,
        post_grad_slots, affine_grads, chunk, pool, winner))  # fmt: skip
    return launch(grad_out, y, stats, params, post_params, affine, grad_y, winner)


def group_norm_backward_launch(
    grad_out: torch.Tensor, y: torch.Tensor, stats: torch.Tensor, has_bias: bool, pre: Sequence[KernelStep],
    post: Sequence[KernelStep], groups: int, params: torch.Tensor, post_params: torch.Tensor, affine: torch.Tensor,
    grad_y: torch.Tensor, pre_grad_slots: Sequence[bool] = (), post_grad_slots: Sequence[bool] = (),
    affine_grads: tuple[bool, bool] = (False, False), chunk: int | None = None, pool: PoolSpec | None = None,
    winner: torch.Tensor | None = None,
) -> Any:
    """``group_norm_backward``'s launch for its arguments' signature, checked and worked out, for a
    caller that keeps it (a fused op's call plan): ``launch(grad_out, y, stats, params, post_params,
    affine, grad_y, winner)`` runs it on any tensors of that signature and returns the sums."""
    return _BackwardLaunch(grad_out, y, stats, has_bias, pre, post, groups, params, post_params, affine, grad_y,
                           pre_grad_slots, post_grad_slots, affine_grads, chunk, pool, winner)  # fmt: skip


class _BackwardLaunch:
    """``group_norm_backward`` for one signature: arguments checked and the launches worked out once.
    A channels-last ``y`` takes the channels-last kernels (the sums per channel, their combine per
    group, then grad_y: three launches), any other the group kernels (one or two)."""

    def __init__(self, grad_out, y, stats, has_bias, pre, post, groups, params, post_params, affine, grad_y,
                 pre_grad_slots, post_grad_slots, affine_grads, chunk, pool=None, winner=None) -> None:  # fmt: skip
        n, channels, positions = _check_common(y, groups, params, post_params, affine)
        for name, t in (("grad_out", grad_out), ("grad_y", grad_y))[1 if pool is not None else 0:]:
            if t.shape != y.shape:
                raise ValueError(f"{name} must have y's shape {tuple(y.shape)}, got {tuple(t.shape)}")
        if tuple(stats.shape) != (2, n, groups) or not stats.is_contiguous() or stats.dtype != torch.float32:
            raise ValueError(f"stats must be contiguous fp32 (2, {n}, {groups}), got {tuple(stats.shape)} {stats.dtype}")
        self.copy_grad_out = False
        if pool is not None:
            g_flat = pooled_grad_strides(grad_out, y, pool, winner)
        else:
            try:
                g_flat = flat_strides("grad_out", grad_out)
            except ValueError:
                self.copy_grad_out, g_flat = True, flat_strides("grad_out", torch.empty(grad_out.shape, device="meta"))
        pool_ints, pool_consts = pool_arguments(grad_out, y, pool, winner)
        group_channels = channels // groups
        self.pre_slots = [k < len(pre_grad_slots) and bool(pre_grad_slots[k]) for k in range(len(pre))]
        self.post_slots = [k < len(post_grad_slots) and bool(post_grad_slots[k]) for k in range(len(post))]
        self.affine_slots = [bool(a) for a in affine_grads]
        masks = [sum(1 << k for k, w in enumerate(slots) if w) for slots in (self.pre_slots, self.post_slots,
                                                                              self.affine_slots)]  # fmt: skip
        self.launch = self.partial = self.combine = None
        self.workspace = self.sums_shape = None
        blocks = _ChannelBlocks.plan(n, channels, group_channels, positions, chunk) \
            if takes_channels_last_kernels(y, groups, chunk) else None  # fmt: skip
        plan = None if blocks else _Chunks.plan(n, groups, group_channels, positions, y.device, chunk)
        self.rows = (n * (blocks.chunks if blocks else plan.split), channels)
        if grad_y.numel() == 0:
            return
        y_flat = flat_strides("y", y)
        common = dict(PRE=op_codes(pre), POST=op_codes(post), HAS_BIAS=has_bias, **pool_consts)
        if blocks is not None:
            self.workspace, self.sums_shape = (n * blocks.chunks, 2, channels), (2, n, groups)
            head = (channels, positions, groups, group_channels, blocks.chunk, blocks.chunks, n * groups,
                    self.rows[0] * channels)  # fmt: skip
            self.partial = FastLaunch(_group_norm_cl_bwd_sums_kernel, blocks.grid(n), dict(
                common, POST_MASK=masks[1], AFFINE_MASK=masks[2], **blocks.tiles(CL_REDUCE_STAGES)),
                fixed=(*head, *g_flat, *y_flat, *pool_ints))  # fmt: skip
            self.combine = blocks.combine(n, groups, channels, positions, moments=False)
            self.launch = FastLaunch(_group_norm_cl_bwd_dx_kernel, blocks.grid(n), dict(
                common, PRE_MASK=masks[0], **blocks.tiles(CL_POINTWISE_STAGES)),
                fixed=(*head, *g_flat, *y_flat, *flat_strides("grad_y", grad_y), *pool_ints))  # fmt: skip
            return
        self.workspace = (n * groups, plan.split, 2) if plan.split > 1 else None
        grid = (n * groups, plan.split)
        common.update(POST_MASK=masks[1], AFFINE_MASK=masks[2], BLOCK_C=plan.block_c, BLOCK_S=plan.block_s,
                      num_warps=plan.num_warps)  # fmt: skip
        head = (channels, positions, groups, group_channels, plan.chunk, n * groups, n * plan.split * channels)
        if self.workspace is not None:
            self.partial = FastLaunch(_group_norm_bwd_partial_kernel, grid, common,
                                      fixed=(*head, *g_flat, *y_flat, *pool_ints))  # fmt: skip
        self.launch = FastLaunch(_group_norm_bwd_kernel, grid, dict(
            common, PRE_MASK=masks[0], SPLIT_P2=plan.split_p2), fixed=(*head, *g_flat, *y_flat,
                                                                        *flat_strides("grad_y", grad_y),
                                                                        *pool_ints))  # fmt: skip

    def __call__(self, grad_out, y, stats, params, post_params, affine, grad_y, winner=None):
        if self.copy_grad_out:
            grad_out = grad_out.contiguous()
        device = grad_y.device
        # every (sample, chunk, channel) of a wanted row is written when the kernels run
        alloc = torch.zeros if self.launch is None else torch.empty

        def buffer(slots: list[bool], rows: int) -> torch.Tensor:
            return alloc((rows, *self.rows) if any(slots) else (1,), dtype=torch.float32, device=device)

        part, qpart, apart = buffer(self.pre_slots, MAX_SLOTS), buffer(self.post_slots, MAX_SLOTS), buffer(self.affine_slots, 2)
        if self.launch is not None:
            ws = params
            win = y if winner is None else winner  # (not read without a max pool)
            if self.partial is not None:
                ws = torch.empty(self.workspace, dtype=torch.float32, device=device)
                self.partial(grad_out, y, stats, params, post_params, affine, ws, qpart, apart, win)
            if self.combine is not None:
                sums = torch.empty(self.sums_shape, dtype=torch.float32, device=device)
                self.combine(ws, sums, 0.0)
                self.launch(grad_out, y, stats, sums, params, post_params, affine, grad_y, part, win)
            else:
                self.launch(grad_out, y, stats, params, post_params, affine, grad_y, ws, part, qpart, apart, win)
        # NOTE: torch's reduction over a fixed shape runs in a fixed order: bitwise reproducible sums.
        return tuple([buf[k].sum(0) if w else None for k, w in enumerate(slots)]
                     for buf, slots in ((part, self.pre_slots), (qpart, self.post_slots), (apart, self.affine_slots)))  # fmt: skip
