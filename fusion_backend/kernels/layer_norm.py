"""Triton kernels for ``conv output -> pointwise pre-chain -> layer norm -> pointwise post-chain``,
forward and backward.

These kernels know only tensors, op codes and the row geometry; the fused op that calls them
(``fusion_backend.ops.conv_layer_norm``) owns the configuration, the autograd wiring and the fallback.

Semantics (torch's ``layer_norm`` over the trailing ``k`` dims of the conv output): each *row*, one
slice over those dims, of ``v = pre(y + bias)`` has mean ``mu`` and biased variance ``var``; ``x_hat
= (v - mu) * rstd`` with ``rstd = 1 / sqrt(var + eps)``; ``out = post(x_hat * gamma[e] + beta[e])``
with ``e`` the element's index in the normalized shape (row-major).  All arithmetic is fp32.

Rows.  The conv output is seen as ``(N, C, S)`` (``norm_common``; contiguous or channels-last), and a
row is ``RC`` channels by ``L`` consecutive positions of one sample (``RowGeometry``):

* the normalized shape covers the channels (``k = rank - 1``): a row is a sample, ``RC = C``, ``L = S``;
* it covers trailing spatial dims only: a row is ``L = prod(normalized_shape)`` positions of one
  channel, ``RC = 1``, and each channel of a sample holds ``RP = S / L`` rows.

Rows are numbered as ``native_layer_norm`` numbers its statistics: ``m = (n * CB + c // RC) * RP +
outer`` (``CB = C / RC``), so row ``m`` starts at channel ``c_first = ((m // RP) % CB) * RC`` and
position ``s_first = (m % RP) * L``; element ``(c, s)`` of it has affine index ``e = (c - c_first) *
L + (s - s_first)`` into the ``E = RC * L`` values of gamma and beta.

Two ways through the rows (``plan``):

* *Packed* (``RC = 1``, ``L <= MAX_PACKED_ROW``: many short rows, e.g. ``nn.LayerNorm(W)``): a tile
  holds ``BLOCK_R`` whole rows of ``BLOCK_L = next_pow2(L)`` lanes; statistics are the exact two-pass
  ones in registers, of the values less the row's first value.  Each program walks a contiguous range of row blocks.  On a channels-last conv
  output (``CHANNELS_FAST``) the rows of a tile are consecutive *channels* of one position block
  (stride 1 in memory) and the tile is laid out rows-last (``EL = 0``: a row's elements along axis 0),
  so that loads along a warp are coalesced; otherwise rows follow ``m`` and the tile is rows-first
  (``EL = 1``).  The backward needs no second pass: a row's sums are in registers.
* *Walk* (every other row: a sample, or a long run of positions): ``norm_common``'s chunked walk,
  ``[BLOCK_C, BLOCK_S]`` tiles, rows cut along their positions into ``SPLIT`` chunks of ``CHUNK``
  positions (``chunk_positions``).  Forward grid ``(M, SPLIT)``: with ``SPLIT = 1`` each program walks
  its row twice in one launch; else a first kernel writes per-chunk ``(shift, mean, m2)`` to a fp32
  workspace and a second combines them (``combined_moments``) before writing its chunk.  Backward: a
  first kernel over ``(M, SPLIT)`` writes per chunk the sums of ``dz * gamma`` and ``dz * gamma *
  x_hat``; a second over ``(tile groups, row groups)`` walks, per tile of a row's elements, the rows
  of its group (tile-outer, row-inner), writing ``grad_y`` and accumulating gamma's and beta's
  gradients (which are per *element*, summed over rows) in registers.

Backward: ``dz`` (the post-chain walked back from ``grad_out``), ``dxh = dz * gamma``, ``grad_v =
rstd * (dxh - mean(dxh) - x_hat * mean(dxh * x_hat))`` (means over the row), then the pre-chain walked
back gives ``grad_y``.  Partial sums, fp32, no atomics, each reduced by torch over a fixed shape:
per-channel operand gradients of the chains per (row, chunk or position block, channel of the row);
gamma's and beta's per (program or row group, element).  Every result is bitwise reproducible run to
run for a given shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chain_math import MAX_SLOTS, KernelStep, apply_chain_at, chain_grad_at, op_codes, step_codes
from .host import cdiv, next_pow2
from .launch import FastLaunch
from .norm_common import (
    PROGRAMS_PER_SM,
    accumulate,
    accumulate_slots,
    chunk_moments,
    chunk_positions,
    combined_moments,
    sm_count,
    store_rows,
    tile_values,
)
from .plan_cache import PlanCache, flat_strides

#: Elements of a program's tile (``BLOCK_R * BLOCK_L`` packed, ``BLOCK_C * BLOCK_S`` walking).
TILE_ELEMENTS = 2048
#: Most channels of a row held in one walking tile; wider rows are walked in channel blocks.
MAX_BLOCK_C = 64
#: Longest row (in lanes, ``next_pow2(L)``) the packed kernels hold in one tile; longer rows walk.
#: NOTE: one tile's worth, so that the packed backward keeps y, grad_out and the chain's values of
#: a whole row in registers (chosen by reasoning, not yet timed).
MAX_PACKED_ROW = 2048


# --------------------------------------------------------------------------------------------------
# Device functions
# --------------------------------------------------------------------------------------------------


@triton.jit
def _packed_rows(q, C, RP, CHANNELS_FAST: tl.constexpr):
    """``(n, c, outer, m)`` of the rows numbered ``q`` in the packed walk's order: channels fastest
    (``CHANNELS_FAST``) or the statistics' order (``m == q``)."""
    if CHANNELS_FAST:
        c = q % C
        rest = q // C
        outer = rest % RP
        n = rest // RP
    else:
        outer = q % RP
        rest = q // RP
        c = rest % C
        n = rest // C
    return n, c, outer, (n * C + c) * RP + outer


@triton.jit
def _walk_row(m, CB, RP, RC, L):
    """``(n, c_first, s_first)`` of row ``m``."""
    n = m // (CB * RP)
    q = m % (CB * RP)
    return n, (q // RP) * RC, (q % RP) * L


@triton.jit
def _backward_tile(gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_base, g_base, c, s, e, valid, mu, rstd, C, E,
                   y_sc, y_ss, g_sc, g_ss, PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """One tile of the backward at channels ``c``, positions ``s`` and affine indices ``e``: ``(yb,
    x_hat, dz, dxh, q0..q7)``: the conv output plus bias, the normalised value, the gradient of the
    norm's output (the post-chain walked back from grad_out; 0 outside ``valid``), ``dz * gamma``,
    and the post-chain's operand gradients."""
    yb, v = tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
    xh = (v - mu) * rstd
    gamma = tl.load(a_ptr + e, mask=valid, other=0.0)
    beta = tl.load(a_ptr + E + e, mask=valid, other=0.0)
    g = tl.load(g_base + c.to(tl.int64) * g_sc + s.to(tl.int64) * g_ss, mask=valid, other=0.0).to(tl.float32)
    dz, q0, q1, q2, q3, q4, q5, q6, q7 = chain_grad_at(g, xh * gamma + beta, q_ptr, c, C, c < C, POST)
    dz = tl.where(valid, dz, 0.0)
    return yb, xh, dz, dz * gamma, q0, q1, q2, q3, q4, q5, q6, q7


@triton.jit
def _store_row_sums(ptr, row_stride, m1, live1, valid, r0, r1, r2, r3, r4, r5, r6, r7, MASK: tl.constexpr,
                    EL: tl.constexpr):  # fmt: skip
    """For every wanted slot ``k`` (``MASK`` bit k): row ``k`` of a per-row buffer at rows ``m1``
    gets the sum over each row's elements (axis ``EL``) of ``r_k`` where ``valid``."""
    rows = (r0, r1, r2, r3, r4, r5, r6, r7)
    for k in tl.static_range(8):
        if ((MASK >> k) & 1) != 0:
            tl.store(ptr + k * row_stride + m1, tl.sum(tl.where(valid, rows[k], 0.0), axis=EL), mask=live1)


# --------------------------------------------------------------------------------------------------
# Packed rows
# --------------------------------------------------------------------------------------------------


@triton.jit
def _layer_norm_packed_fwd_kernel(
    y_ptr, p_ptr, q_ptr, a_ptr, out_ptr, st_ptr,
    eps, M, C, RP, L, BLOCKS, BLOCKS_PER_PROGRAM,
    y_sn, y_sc, y_ss, o_sn, o_sc, o_ss,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE: tl.constexpr,
    CHANNELS_FAST: tl.constexpr, EL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """out = post(layer_norm(pre(y + bias)) * gamma + beta) on rows of one channel of ``L <= BLOCK_L``
    positions, ``BLOCK_R`` whole rows per tile.

    Pointers (element strides; ``S`` flattened positions):
      y_ptr    conv output without bias, (N, C, S), fp32/fp16/bf16, strides ``y_s*``.
      p_ptr    pre-chain operand matrix P, (NUM_PARAM_ROWS, C) fp32 contiguous (row 0: bias).
      q_ptr    post-chain operand matrix Q, (NUM_PARAM_ROWS, C) fp32 contiguous.
      a_ptr    gamma and beta, (2, L) fp32 contiguous.
      out_ptr  result, (N, C, S), any float dtype, strides ``o_s*``.
      st_ptr   (SAVE) fp32 (2, M) contiguous: row 0 each row's mean, row 1 its rstd.
    Grid: ``(programs,)``; program ``p`` walks row blocks ``[p * BLOCKS_PER_PROGRAM, ...)`` (of
    ``BLOCKS`` in all), block ``b`` holding rows ``b * BLOCK_R + [0, BLOCK_R)`` in ``_packed_rows``'
    order.  ``EL``: the tile axis of a row's elements (0 with ``CHANNELS_FAST``, else 1).
    """
    pid = tl.program_id(0)
    r = tl.expand_dims(tl.arange(0, BLOCK_R), EL)
    j = tl.expand_dims(tl.arange(0, BLOCK_L), 1 - EL)
    r1 = tl.arange(0, BLOCK_R)
    jmask = j < L
    gamma = tl.load(a_ptr + j, mask=jmask, other=0.0)
    beta = tl.load(a_ptr + L + j, mask=jmask, other=0.0)
    b_lo = pid * BLOCKS_PER_PROGRAM
    for b in range(b_lo, tl.minimum(b_lo + BLOCKS_PER_PROGRAM, BLOCKS)):
        q = b * BLOCK_R + r
        n, c, outer, _ = _packed_rows(q, C, RP, CHANNELS_FAST)
        valid = (q < M) & jmask
        s = outer * L + j
        _, v = tile_values(y_ptr, p_ptr, y_ptr + n.to(tl.int64) * y_sn, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
        # each row less its first value first: the sum of values far from zero would lose the
        # digits of their spread (the mean of 7 values around 3000 in fp32 is off by 3e-4)
        shift = tl.expand_dims(tl.sum(tl.where(valid & (j == 0), v, 0.0), axis=EL), EL)
        v = tl.where(valid, v - shift, 0.0)
        mean = tl.sum(v, axis=EL) / L
        d = tl.where(valid, v - tl.expand_dims(mean, EL), 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=EL) / L + eps)
        z = d * tl.expand_dims(rstd, EL) * gamma + beta
        mean = mean + tl.sum(shift, axis=EL)
        out = apply_chain_at(z, q_ptr, c, C, c < C, POST)
        o = out_ptr + n.to(tl.int64) * o_sn + c.to(tl.int64) * o_sc + s.to(tl.int64) * o_ss
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=valid)
        if SAVE:
            q1 = b * BLOCK_R + r1
            _, _, _, m1 = _packed_rows(q1, C, RP, CHANNELS_FAST)
            tl.store(st_ptr + m1, mean, mask=q1 < M)
            tl.store(st_ptr + M + m1, rstd, mask=q1 < M)


@triton.jit
def _layer_norm_packed_bwd_kernel(
    gout_ptr, y_ptr, st_ptr, p_ptr, q_ptr, a_ptr, gy_ptr, part_ptr, qpart_ptr, apart_ptr,
    M, C, RP, L, BLOCKS, BLOCKS_PER_PROGRAM,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, gy_sn, gy_sc, gy_ss,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, PRE_MASK: tl.constexpr,
    POST_MASK: tl.constexpr, AFFINE_MASK: tl.constexpr, CHANNELS_FAST: tl.constexpr, EL: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """grad_y of the packed forward, and partial sums, on the forward's grid and row blocks.

    Pointers (element strides):
      gout_ptr   gradient of out, (N, C, S), any float dtype, strides ``g_s*``.
      y_ptr      the conv output without bias as the forward read it, strides ``y_s*``.
      st_ptr     the forward's fp32 (2, M) statistics (row 0 mean, row 1 rstd).
      p_ptr, q_ptr, a_ptr   as in the forward.
      gy_ptr     grad_y, (N, C, S), the conv output's dtype, strides ``gy_s*``.
      part_ptr   (PRE_MASK) fp32 (MAX_SLOTS, M) contiguous: row k, per row the sum over its elements
                 of the pre-chain slot k's first-operand gradient.
      qpart_ptr  (POST_MASK) the same for the post-chain.
      apart_ptr  (AFFINE_MASK: bit 0 gamma, bit 1 beta) fp32 (2, programs, L) contiguous: per program
                 the sums over its rows of ``dz * x_hat`` (gamma's gradient) and ``dz`` (beta's).
    """
    pid = tl.program_id(0)
    r = tl.expand_dims(tl.arange(0, BLOCK_R), EL)
    j = tl.expand_dims(tl.arange(0, BLOCK_L), 1 - EL)
    r1 = tl.arange(0, BLOCK_R)
    jmask = j < L
    dgamma = tl.zeros([BLOCK_L], tl.float32)
    dbeta = tl.zeros([BLOCK_L], tl.float32)
    b_lo = pid * BLOCKS_PER_PROGRAM
    for b in range(b_lo, tl.minimum(b_lo + BLOCKS_PER_PROGRAM, BLOCKS)):
        q = b * BLOCK_R + r
        n, c, outer, m = _packed_rows(q, C, RP, CHANNELS_FAST)
        live = q < M
        valid = live & jmask
        s = outer * L + j
        mu = tl.load(st_ptr + m, mask=live, other=0.0)
        rstd = tl.load(st_ptr + M + m, mask=live, other=0.0)
        n64 = n.to(tl.int64)
        yb, xh, dz, dxh, q0, q1, q2, q3, q4, q5, q6, q7 = _backward_tile(
            gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_ptr + n64 * y_sn, gout_ptr + n64 * g_sn, c, s, j, valid, mu, rstd,
            C, L, y_sc, y_ss, g_sc, g_ss, PRE, POST, HAS_BIAS)  # fmt: skip
        mean_dxh = tl.expand_dims(tl.sum(dxh, axis=EL) / L, EL)
        mean_dxh_xh = tl.expand_dims(tl.sum(tl.where(valid, dxh * xh, 0.0), axis=EL) / L, EL)
        dv = rstd * (dxh - mean_dxh - xh * mean_dxh_xh)
        gy, a0, a1, a2, a3, a4, a5, a6, a7 = chain_grad_at(dv, yb, p_ptr, c, C, c < C, PRE)
        tl.store(gy_ptr + n64 * gy_sn + c.to(tl.int64) * gy_sc + s.to(tl.int64) * gy_ss,
                 gy.to(gy_ptr.dtype.element_ty), mask=valid)  # fmt: skip
        qr = b * BLOCK_R + r1
        _, _, _, m1 = _packed_rows(qr, C, RP, CHANNELS_FAST)
        if PRE_MASK != 0:
            _store_row_sums(part_ptr, M, m1, qr < M, valid, a0, a1, a2, a3, a4, a5, a6, a7, PRE_MASK, EL)
        if POST_MASK != 0:
            _store_row_sums(qpart_ptr, M, m1, qr < M, valid, q0, q1, q2, q3, q4, q5, q6, q7, POST_MASK, EL)
        if (AFFINE_MASK & 1) != 0:
            dgamma += tl.sum(tl.where(valid, dz * xh, 0.0), axis=1 - EL)
        if (AFFINE_MASK & 2) != 0:
            dbeta += tl.sum(dz, axis=1 - EL)
    j1 = tl.arange(0, BLOCK_L)
    if (AFFINE_MASK & 1) != 0:
        tl.store(apart_ptr + pid * L + j1, dgamma, mask=j1 < L)
    if (AFFINE_MASK & 2) != 0:
        tl.store(apart_ptr + (tl.num_programs(0) + pid) * L + j1, dbeta, mask=j1 < L)


# --------------------------------------------------------------------------------------------------
# Walking rows
# --------------------------------------------------------------------------------------------------


@triton.jit
def _layer_norm_walk_fwd_partial_kernel(
    y_ptr, p_ptr, ws_ptr,
    C, CB, RP, RC, L, CHUNK,
    y_sn, y_sc, y_ss,
    PRE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Per-chunk statistics of ``v = pre(y + bias)``, the first of the walking forward's two kernels
    when ``SPLIT > 1``.

    Pointers: y_ptr, p_ptr as in ``_layer_norm_walk_fwd_kernel``; ws_ptr fp32 (M, SPLIT, 3) contiguous:
    per chunk its ``shift``, the mean of its values less ``shift`` and their sum of squared
    deviations from that mean.  Grid ``(M, SPLIT)``: program ``(m, k)`` owns positions ``k * CHUNK +
    [0, CHUNK)`` (clipped to ``L``) of row ``m``'s ``RC`` channels.
    """
    m = tl.program_id(0)
    k = tl.program_id(1)
    n, c_first, s_first = _walk_row(m, CB, RP, RC, L)
    s_lo = s_first + k * CHUNK
    s_hi = s_first + tl.minimum(k * CHUNK + CHUNK, L)
    shift, mean, m2, _ = chunk_moments(y_ptr, p_ptr, y_ptr + n.to(tl.int64) * y_sn, c_first, s_lo, s_hi, C, RC,
                                       y_sc, y_ss, PRE, HAS_BIAS, BLOCK_C, BLOCK_S)  # fmt: skip
    w = ws_ptr + (m * tl.num_programs(1) + k) * 3
    tl.store(w, shift)
    tl.store(w + 1, mean)
    tl.store(w + 2, m2)


@triton.jit
def _layer_norm_walk_fwd_kernel(
    y_ptr, p_ptr, q_ptr, a_ptr, out_ptr, st_ptr, ws_ptr,
    eps, M, C, CB, RP, RC, L, E, CHUNK,
    y_sn, y_sc, y_ss, o_sn, o_sc, o_ss,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE: tl.constexpr, SPLIT_P2: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out = post(layer_norm(pre(y + bias)) * gamma + beta) on one chunk of a row per program.

    Pointers (element strides; ``S`` flattened positions):
      y_ptr    conv output without bias, (N, C, S), fp32/fp16/bf16, strides ``y_s*``.
      p_ptr    pre-chain operand matrix P, (NUM_PARAM_ROWS, C) fp32 contiguous (row 0: bias).
      q_ptr    post-chain operand matrix Q, (NUM_PARAM_ROWS, C) fp32 contiguous.
      a_ptr    gamma and beta, (2, E) fp32 contiguous (``E = RC * L``).
      out_ptr  result, (N, C, S), any float dtype, strides ``o_s*``.
      st_ptr   (SAVE) fp32 (2, M) contiguous: mean, rstd; written by the programs of chunk 0.
      ws_ptr   (SPLIT_P2 > 1) ``_layer_norm_walk_fwd_partial_kernel``'s workspace.
    Grid ``(M, SPLIT)`` as the partial kernel's.  ``SPLIT_P2``: 1 when ``SPLIT`` is 1 (the program
    computes its row's statistics itself, one launch), else ``SPLIT`` rounded up to a power of two.
    """
    m = tl.program_id(0)
    k = tl.program_id(1)
    n, c_first, s_first = _walk_row(m, CB, RP, RC, L)
    n64 = n.to(tl.int64)
    y_base = y_ptr + n64 * y_sn
    if SPLIT_P2 == 1:
        shift, mean, m2, count = chunk_moments(y_ptr, p_ptr, y_base, c_first, s_first, s_first + L, C, RC, y_sc,
                                               y_ss, PRE, HAS_BIAS, BLOCK_C, BLOCK_S)  # fmt: skip
        mean = mean + shift
        var = m2 / count
    else:
        mean, var = combined_moments(ws_ptr, m, tl.num_programs(1), RC, L, CHUNK, SPLIT_P2)
    rstd = 1.0 / tl.sqrt(var + eps)
    if SAVE:
        if k == 0:
            tl.store(st_ptr + m, mean)
            tl.store(st_ptr + M + m, rstd)
    cb = tl.arange(0, BLOCK_C)[:, None]
    sb = tl.arange(0, BLOCK_S)[None, :]
    s_lo = s_first + k * CHUNK
    s_hi = s_first + tl.minimum(k * CHUNK + CHUNK, L)
    o_base = out_ptr + n64 * o_sn
    for c0 in range(0, RC, BLOCK_C):
        crow = c0 + cb
        c = c_first + crow
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + sb
            valid = (crow < RC) & (s < s_hi)
            _, v = tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
            e = crow * L + (s - s_first)
            gamma = tl.load(a_ptr + e, mask=valid, other=0.0)
            beta = tl.load(a_ptr + E + e, mask=valid, other=0.0)
            out = apply_chain_at((v - mean) * rstd * gamma + beta, q_ptr, c, C, c < C, POST)
            tl.store(o_base + c.to(tl.int64) * o_sc + s.to(tl.int64) * o_ss, out.to(out_ptr.dtype.element_ty),
                     mask=valid)  # fmt: skip


@triton.jit
def _layer_norm_walk_bwd_sums_kernel(
    gout_ptr, y_ptr, st_ptr, p_ptr, q_ptr, a_ptr, ws_ptr, qpart_ptr,
    M, C, CB, RP, RC, L, E, CHUNK, part_row,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, POST_MASK: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The walking backward's first pass per chunk of a row.

    Pointers (element strides):
      gout_ptr   gradient of out, (N, C, S), any float dtype, strides ``g_s*``.
      y_ptr      the conv output without bias as the forward read it, strides ``y_s*``.
      st_ptr     the forward's fp32 (2, M) statistics.
      p_ptr, q_ptr, a_ptr   as in the forward.
      ws_ptr     fp32 (M, SPLIT, 2) contiguous: per chunk the sums of ``dz * gamma`` and ``dz * gamma * x_hat``.
      qpart_ptr  (POST_MASK) fp32 (MAX_SLOTS, M * SPLIT, RC) contiguous: row k, per (row, chunk,
                 channel of the row) the sum over the chunk's positions of the post-chain slot k's
                 first-operand gradient; ``part_row`` = M * SPLIT * RC.
    Grid ``(M, SPLIT)`` as the forward's.
    """
    m = tl.program_id(0)
    k = tl.program_id(1)
    split = tl.num_programs(1)
    n, c_first, s_first = _walk_row(m, CB, RP, RC, L)
    n64 = n.to(tl.int64)
    y_base = y_ptr + n64 * y_sn
    g_base = gout_ptr + n64 * g_sn
    mu = tl.load(st_ptr + m)
    rstd = tl.load(st_ptr + M + m)
    cb = tl.arange(0, BLOCK_C)[:, None]
    sb = tl.arange(0, BLOCK_S)[None, :]
    s_lo = s_first + k * CHUNK
    s_hi = s_first + tl.minimum(k * CHUNK + CHUNK, L)
    sum_dxh = 0.0
    sum_dxh_xh = 0.0
    for c0 in range(0, RC, BLOCK_C):
        crow = c0 + cb
        c = c_first + crow
        p0 = tl.zeros([BLOCK_C], tl.float32)
        p1, p2, p3, p4, p5, p6, p7 = p0, p0, p0, p0, p0, p0, p0
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + sb
            valid = (crow < RC) & (s < s_hi)
            _, xh, _, dxh, q0, q1, q2, q3, q4, q5, q6, q7 = _backward_tile(
                gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_base, g_base, c, s, crow * L + (s - s_first), valid, mu,
                rstd, C, E, y_sc, y_ss, g_sc, g_ss, PRE, POST, HAS_BIAS)  # fmt: skip
            sum_dxh += tl.sum(tl.sum(dxh, axis=1), axis=0)
            sum_dxh_xh += tl.sum(tl.sum(tl.where(valid, dxh * xh, 0.0), axis=1), axis=0)
            p0, p1, p2, p3, p4, p5, p6, p7 = accumulate_slots(
                p0, p1, p2, p3, p4, p5, p6, p7, q0, q1, q2, q3, q4, q5, q6, q7, valid, POST_MASK, False)
        if POST_MASK != 0:
            c1 = c0 + tl.arange(0, BLOCK_C)
            store_rows(qpart_ptr, part_row, (m * split + k) * RC + c1, c1 < RC, p0, p1, p2, p3, p4, p5, p6, p7,
                       POST_MASK)  # fmt: skip
    w = ws_ptr + (m * split + k) * 2
    tl.store(w, sum_dxh)
    tl.store(w + 1, sum_dxh_xh)


@triton.jit
def _layer_norm_walk_bwd_dy_kernel(
    gout_ptr, y_ptr, st_ptr, p_ptr, q_ptr, a_ptr, gy_ptr, ws_ptr, part_ptr, apart_ptr,
    M, C, CB, RP, RC, L, E, SPLIT, NSB, TILES, TILES_PER_PROGRAM, ROWS_PER_PROGRAM, part_row,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, gy_sn, gy_sc, gy_ss,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, PRE_MASK: tl.constexpr,
    AFFINE_MASK: tl.constexpr, SPLIT_P2: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """grad_y of the walking forward, the pre-chain's partial sums and gamma's and beta's.

    Pointers (element strides):
      gout_ptr, y_ptr, st_ptr, p_ptr, q_ptr, a_ptr   as in ``_layer_norm_walk_bwd_sums_kernel``.
      gy_ptr     grad_y, (N, C, S), the conv output's dtype, strides ``gy_s*``.
      ws_ptr     ``_layer_norm_walk_bwd_sums_kernel``'s fp32 (M, SPLIT, 2) workspace.
      part_ptr   (PRE_MASK) fp32 (MAX_SLOTS, M * NSB, RC) contiguous: row k, per (row, position
                 block, channel of the row) the sum over the block's positions of the pre-chain slot
                 k's first-operand gradient; ``part_row`` = M * NSB * RC.
      apart_ptr  (AFFINE_MASK: bit 0 gamma, bit 1 beta) fp32 (2, row groups, E) contiguous: per row
                 group the sums over its rows of ``dz * x_hat`` (gamma's gradient) and ``dz`` (beta's).
    Grid ``(tile groups, row groups)``: a row's elements are ``TILES`` tiles of ``[BLOCK_C, BLOCK_S]``
    (tile ``t``: channel block ``t // NSB``, position block ``t % NSB`` of the row); program ``(i,
    g)`` takes tiles ``i * TILES_PER_PROGRAM + [0, TILES_PER_PROGRAM)`` of rows ``g *
    ROWS_PER_PROGRAM + [0, ROWS_PER_PROGRAM)``, tiles outer and rows inner, so that a tile's gamma
    and beta gradients stay in registers over its rows.
    """
    t_lo = tl.program_id(0) * TILES_PER_PROGRAM
    g = tl.program_id(1)
    m_lo = g * ROWS_PER_PROGRAM
    m_hi = tl.minimum(m_lo + ROWS_PER_PROGRAM, M)
    cb = tl.arange(0, BLOCK_C)[:, None]
    sb = tl.arange(0, BLOCK_S)[None, :]
    kk = tl.arange(0, SPLIT_P2)
    for t in range(t_lo, tl.minimum(t_lo + TILES_PER_PROGRAM, TILES)):
        crow = (t // NSB) * BLOCK_C + cb
        srow = (t % NSB) * BLOCK_S + sb
        inside = (crow < RC) & (srow < L)
        e = crow * L + srow
        dgamma = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
        dbeta = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
        for m in range(m_lo, m_hi):
            n, c_first, s_first = _walk_row(m, CB, RP, RC, L)
            n64 = n.to(tl.int64)
            c = c_first + crow
            s = s_first + srow
            mu = tl.load(st_ptr + m)
            rstd = tl.load(st_ptr + M + m)
            w = ws_ptr + (m * SPLIT + kk) * 2
            mean_dxh = tl.sum(tl.load(w, mask=kk < SPLIT, other=0.0), axis=0) / E
            mean_dxh_xh = tl.sum(tl.load(w + 1, mask=kk < SPLIT, other=0.0), axis=0) / E
            yb, xh, dz, dxh, _, _, _, _, _, _, _, _ = _backward_tile(
                gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_ptr + n64 * y_sn, gout_ptr + n64 * g_sn, c, s, e, inside, mu,
                rstd, C, E, y_sc, y_ss, g_sc, g_ss, PRE, POST, HAS_BIAS)  # fmt: skip
            dv = rstd * (dxh - mean_dxh - xh * mean_dxh_xh)
            gy, a0, a1, a2, a3, a4, a5, a6, a7 = chain_grad_at(dv, yb, p_ptr, c, C, c < C, PRE)
            tl.store(gy_ptr + n64 * gy_sn + c.to(tl.int64) * gy_sc + s.to(tl.int64) * gy_ss,
                     gy.to(gy_ptr.dtype.element_ty), mask=inside)  # fmt: skip
            if PRE_MASK != 0:
                zero = tl.zeros([BLOCK_C], tl.float32)
                c1 = (t // NSB) * BLOCK_C + tl.arange(0, BLOCK_C)
                store_rows(part_ptr, part_row, (m * NSB + t % NSB) * RC + c1, c1 < RC,
                           accumulate(zero, a0, inside, (PRE_MASK & 1) != 0),
                           accumulate(zero, a1, inside, (PRE_MASK & 2) != 0),
                           accumulate(zero, a2, inside, (PRE_MASK & 4) != 0),
                           accumulate(zero, a3, inside, (PRE_MASK & 8) != 0),
                           accumulate(zero, a4, inside, (PRE_MASK & 16) != 0),
                           accumulate(zero, a5, inside, (PRE_MASK & 32) != 0),
                           accumulate(zero, a6, inside, (PRE_MASK & 64) != 0),
                           accumulate(zero, a7, inside, (PRE_MASK & 128) != 0), PRE_MASK)  # fmt: skip
            if (AFFINE_MASK & 1) != 0:
                dgamma += tl.where(inside, dz * xh, 0.0)
            if (AFFINE_MASK & 2) != 0:
                dbeta += dz
        if (AFFINE_MASK & 1) != 0:
            tl.store(apart_ptr + g * E + e, dgamma, mask=inside)
        if (AFFINE_MASK & 2) != 0:
            tl.store(apart_ptr + (tl.num_programs(1) + g) * E + e, dbeta, mask=inside)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowGeometry:
    """How a conv output of ``n`` samples, ``channels`` channels and ``positions`` flattened spatial
    positions splits into the rows of a layer norm: each row ``row_channels`` channels by
    ``row_positions`` consecutive positions of one sample (see the module docstring)."""

    n: int
    channels: int
    positions: int
    row_channels: int
    row_positions: int

    @property
    def channel_blocks(self) -> int:
        """``CB``: rows side by side over a sample's channels (C for rows of one channel, else 1)."""
        return self.channels // self.row_channels

    @property
    def rows_per_channel(self) -> int:
        """``RP``: rows one after another along a channel's positions."""
        return self.positions // self.row_positions if self.row_positions else 0

    @property
    def rows(self) -> int:
        """``M``."""
        return self.n * self.channel_blocks * self.rows_per_channel

    @property
    def elements(self) -> int:
        """``E``: a row's values, the number of gamma's (and beta's) values."""
        return self.row_channels * self.row_positions

    @property
    def packed(self) -> bool:
        """Whether the packed kernels take these rows (short rows of one channel)."""
        return self.row_channels == 1 and next_pow2(self.row_positions) <= MAX_PACKED_ROW


def row_geometry(shape: Sequence[int], normalized_dims: int) -> RowGeometry:
    """The rows of a layer norm over the trailing ``normalized_dims`` dims of a ``(N, C, *spatial)``
    conv output of ``shape`` (1 to ``len(shape) - 1`` dims: not the batch)."""
    rank = len(shape)
    if not 3 <= rank <= 5:
        raise ValueError(f"y must be (N, C, *spatial) with 1-3 spatial dims, got {tuple(shape)}")
    if not 1 <= normalized_dims <= rank - 1:
        raise ValueError(f"a layer norm over {normalized_dims} trailing dims of a {rank}-d conv output: 1 to "
                         f"{rank - 1} dims (not the batch)")  # fmt: skip
    n, channels = int(shape[0]), int(shape[1])
    positions = math.prod(int(d) for d in shape[2:])
    if normalized_dims == rank - 1:
        return RowGeometry(n, channels, positions, channels, positions)
    return RowGeometry(n, channels, positions, 1, math.prod(int(d) for d in shape[rank - normalized_dims:]))


def channel_sums(partials: torch.Tensor, geo: RowGeometry) -> torch.Tensor:
    """Per-channel totals, fp32 (C,), of per-(row, block, channel of the row) partial sums, given as
    ``partials`` of ``M * blocks * RC`` values in that order; a fixed-shape reduction."""
    if geo.rows == 0:
        return torch.zeros(geo.channels, dtype=partials.dtype, device=partials.device)
    parts = partials.reshape(geo.n, geo.channel_blocks, geo.rows_per_channel, -1, geo.row_channels)
    return parts.sum(dim=(0, 2, 3)).reshape(geo.channels)



def _walk_tile(geo: RowGeometry) -> tuple[int, int]:
    """``(BLOCK_C, BLOCK_S)`` of the walking kernels: the row's channels (at most ``MAX_BLOCK_C`` at
    once), positions filling ``TILE_ELEMENTS``."""
    block_c = min(next_pow2(geo.row_channels), MAX_BLOCK_C)
    return block_c, max(1, min(next_pow2(max(geo.row_positions, 1)), TILE_ELEMENTS // block_c))


def _target_programs(device: torch.device, programs: int | None) -> int:
    """How many programs a launch spreads its work over: ``programs`` when given (tests), else
    ``PROGRAMS_PER_SM`` per multiprocessor, 1 without a GPU (the interpreter runs programs one after
    another)."""
    if programs is not None:
        if programs < 1:
            raise ValueError(f"programs must be positive, got {programs}")
        return int(programs)
    return max(1, PROGRAMS_PER_SM * sm_count(device))


def _spread(items: int, target: int) -> tuple[int, int]:
    """``(programs, items per program)``: ``items`` in contiguous ranges over at most ``target``
    programs, none empty."""
    per = cdiv(max(items, 1), max(1, min(target, items)))
    return cdiv(max(items, 1), per), per


@dataclass(frozen=True)
class Plan:
    """How one launch walks its rows (``plan``).

    Packed: ``block_r`` rows of ``block_l`` lanes per tile, ``programs`` programs of
    ``blocks_per_program`` row blocks (``blocks`` in all), ``channels_fast`` order.  Walking:
    ``(block_c, block_s)`` tiles, ``chunk`` positions per chunk, ``split`` chunks per row and
    ``split_p2`` its lanes; the backward's second kernel over ``tile_programs`` x ``row_programs``
    programs of ``tiles_per_program`` tiles (``tiles`` per row, ``nsb`` position blocks) and
    ``rows_per_program`` rows.
    """

    geo: RowGeometry
    packed: bool
    block_r: int = 1
    block_l: int = 1
    blocks: int = 0
    programs: int = 1
    blocks_per_program: int = 1
    channels_fast: bool = False
    block_c: int = 1
    block_s: int = 1
    chunk: int = 1
    split: int = 1
    split_p2: int = 1
    nsb: int = 1
    tiles: int = 1
    tile_programs: int = 1
    tiles_per_program: int = 1
    row_programs: int = 1
    rows_per_program: int = 1

    @property
    def num_warps(self) -> int:
        tile = self.block_r * self.block_l if self.packed else self.block_c * self.block_s
        return 8 if tile >= 2048 else 4


def plan(geo: RowGeometry, y: torch.Tensor, programs: int | None = None, chunk: int | None = None) -> Plan:
    """The launch plan for rows ``geo`` of the conv output ``y`` (its device and strides).

    ``programs`` (tests): how many programs to spread over instead of the GPU's fill; ``chunk``
    (tests): positions per chunk of a walking row instead of ``chunk_positions``' choice."""
    target = _target_programs(y.device, programs)
    if geo.packed:
        block_l = next_pow2(max(geo.row_positions, 1))
        block_r = max(1, min(TILE_ELEMENTS // block_l, next_pow2(max(geo.rows, 1))))
        blocks = cdiv(geo.rows, block_r)
        count, per = _spread(blocks, target)
        sc, ss = flat_strides("y", y)[1:]
        return Plan(geo, True, block_r, block_l, blocks, count, per, channels_fast=geo.channels > 1 and sc < ss)
    block_c, block_s = _walk_tile(geo)
    if chunk is None:
        chunk = chunk_positions(geo.rows, geo.row_channels, geo.row_positions, block_s, sm_count(y.device))
    else:
        if chunk < 1:
            raise ValueError(f"chunk must be positive, got {chunk}")
        block_s = min(block_s, next_pow2(chunk))
    chunk = max(1, min(int(chunk), max(geo.row_positions, 1)))
    split = cdiv(max(geo.row_positions, 1), chunk)
    nsb = cdiv(max(geo.row_positions, 1), block_s)
    tiles = cdiv(geo.row_channels, block_c) * nsb
    tile_programs, tiles_per_program = _spread(tiles, target)
    row_programs, rows_per_program = _spread(geo.rows, max(1, target // tile_programs))
    return Plan(geo, False, block_c=block_c, block_s=block_s, chunk=chunk, split=split,
                split_p2=1 if split == 1 else next_pow2(split), nsb=nsb, tiles=tiles, tile_programs=tile_programs,
                tiles_per_program=tiles_per_program, row_programs=row_programs,
                rows_per_program=rows_per_program)  # fmt: skip


def _check_common(y: torch.Tensor, normalized_dims: int, params: torch.Tensor, post_params: torch.Tensor,
                  affine: torch.Tensor) -> RowGeometry:  # fmt: skip
    """The rows of ``y`` after checking the arguments every launch shares."""
    geo = row_geometry(y.shape, normalized_dims)
    for name, t, columns in (("P", params, geo.channels), ("Q", post_params, geo.channels),
                             ("the affine rows", affine, geo.elements)):  # fmt: skip
        if t.dtype != torch.float32 or not t.is_contiguous() or t.shape[-1] != columns or (
                name == "the affine rows" and t.shape[0] != 2):  # fmt: skip
            raise ValueError(f"{name} must be contiguous fp32 with {columns} columns, got {tuple(t.shape)} {t.dtype}")
    return geo


def _check_stats(stats: torch.Tensor, rows: int) -> None:
    if tuple(stats.shape) != (2, rows) or not stats.is_contiguous() or stats.dtype != torch.float32:
        raise ValueError(f"stats must be contiguous fp32 (2, {rows}), got {tuple(stats.shape)} {stats.dtype}")


#: Launch plans by what they depend on (shapes, strides, dtypes, op codes, normalized dims, wanted outputs).
_FORWARD_LAUNCHES = PlanCache()
_BACKWARD_LAUNCHES = PlanCache()


def layer_norm_forward(
    y: torch.Tensor, normalized_dims: int, has_bias: bool, pre: Sequence[KernelStep], post: Sequence[KernelStep],
    eps: float, params: torch.Tensor, post_params: torch.Tensor, affine: torch.Tensor, out: torch.Tensor,
    stats: torch.Tensor | None = None, programs: int | None = None, chunk: int | None = None,
) -> None:  # fmt: skip
    """Write ``out = post(layer_norm(pre(y + bias)) * gamma + beta)`` over the trailing
    ``normalized_dims`` dims (and with ``stats`` each row's statistics).

    Args:
      y: conv output without bias, (N, C, *spatial) with 1-3 spatial dims that flatten (contiguous or
        channels-last), fp32/fp16/bf16.
      normalized_dims: how many trailing dims a row covers (1 to y.dim() - 1).
      has_bias: whether ``params``' bias row holds a bias.
      pre, post: the chains as ``(op code, operand values)`` (values only decide the op codes here).
      eps: added to each row's biased variance.
      params: P, fp32 (NUM_PARAM_ROWS, C) contiguous (``kernels.epilogue.build_params``).
      post_params: Q, the same for the post-chain (no bias row content).
      affine: fp32 (2, E) contiguous: gamma, beta over the normalized shape, row-major (ones / zeros
        without them).
      out: preallocated, y's shape (spatial dims flatten), any float dtype.
      stats: None, or preallocated fp32 (2, M) contiguous: mean, rstd per row in
        ``native_layer_norm``'s order.
      programs, chunk: ``plan``'s (tests).
    """
    parts = (y, normalized_dims, has_bias, step_codes(pre), step_codes(post),
           float(eps), params, post_params, affine, out,
           stats, programs, chunk)  # fmt: skip
    launch = _FORWARD_LAUNCHES.plan(parts, lambda: _ForwardLaunch(y, normalized_dims, has_bias, pre, post, eps, params,
                                                               post_params, affine, out, stats, programs, chunk))  # fmt: skip
    launch(y, params, post_params, affine, out, stats)


class _ForwardLaunch:
    """``layer_norm_forward`` for one signature: arguments checked and the launches worked out once."""

    def __init__(self, y, normalized_dims, has_bias, pre, post, eps, params, post_params, affine, out, stats,
                 programs, chunk) -> None:  # fmt: skip
        geo = _check_common(y, normalized_dims, params, post_params, affine)
        if out.shape != y.shape:
            raise ValueError(f"out must have y's shape {tuple(y.shape)}, got {tuple(out.shape)}")
        if stats is not None:
            _check_stats(stats, geo.rows)
        self.save = stats is not None
        self.launch = self.partial = None
        self.workspace: tuple[int, ...] | None = None
        self.packed = geo.packed
        if out.numel() == 0:
            return
        p = plan(geo, y, programs, chunk)
        strides = (*flat_strides("y", y), *flat_strides("out", out))
        consts = dict(PRE=op_codes(pre), POST=op_codes(post), HAS_BIAS=has_bias, SAVE=self.save, num_warps=p.num_warps)
        if p.packed:
            self.launch = FastLaunch(_layer_norm_packed_fwd_kernel, (p.programs,), dict(
                consts, CHANNELS_FAST=p.channels_fast, EL=0 if p.channels_fast else 1, BLOCK_R=p.block_r,
                BLOCK_L=p.block_l), fixed=(float(eps), geo.rows, geo.channels, geo.rows_per_channel,
                                           geo.row_positions, p.blocks, p.blocks_per_program, *strides))  # fmt: skip
            return
        grid = (geo.rows, p.split)
        shape = (geo.channels, geo.channel_blocks, geo.rows_per_channel, geo.row_channels, geo.row_positions)
        tiles = dict(BLOCK_C=p.block_c, BLOCK_S=p.block_s)
        if p.split > 1:
            self.workspace = (geo.rows, p.split, 3)
            self.partial = FastLaunch(_layer_norm_walk_fwd_partial_kernel, grid, dict(
                PRE=op_codes(pre), HAS_BIAS=has_bias, num_warps=p.num_warps, **tiles),
                fixed=(*shape, p.chunk, *strides[:3]))  # fmt: skip
        self.launch = FastLaunch(_layer_norm_walk_fwd_kernel, grid, dict(consts, SPLIT_P2=p.split_p2, **tiles),
                                 fixed=(float(eps), geo.rows, *shape, geo.elements, p.chunk, *strides))  # fmt: skip

    def __call__(self, y, params, post_params, affine, out, stats) -> None:
        if self.launch is None:
            return
        st = stats if self.save else params
        if self.packed:
            self.launch(y, params, post_params, affine, out, st)
            return
        ws = params
        if self.partial is not None:
            ws = torch.empty(self.workspace, dtype=torch.float32, device=y.device)
            self.partial(y, params, ws)
        self.launch(y, params, post_params, affine, out, st, ws)


def layer_norm_backward(
    grad_out: torch.Tensor, y: torch.Tensor, stats: torch.Tensor, normalized_dims: int, has_bias: bool,
    pre: Sequence[KernelStep], post: Sequence[KernelStep], params: torch.Tensor, post_params: torch.Tensor,
    affine: torch.Tensor, grad_y: torch.Tensor, pre_grad_slots: Sequence[bool] = (),
    post_grad_slots: Sequence[bool] = (), affine_grads: tuple[bool, bool] = (False, False),
    programs: int | None = None, chunk: int | None = None,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[torch.Tensor | None]]:  # fmt: skip
    """Write the conv-output gradient into ``grad_y``; return the parameter gradients.

    Args:
      grad_out: gradient of ``out`` (y's shape, any strides, any float dtype).
      y: the conv output without bias as given to the forward.
      stats: the forward's fp32 (2, M) statistics.
      normalized_dims, has_bias, pre, post, params, post_params, affine: as given to the forward.
      grad_y: preallocated (N, C, *spatial), spatial dims flattening, the conv output's dtype.
      pre_grad_slots / post_grad_slots: per slot of each chain, whether its first operand's gradient
        is wanted; affine_grads: whether gamma's / beta's are.
      programs, chunk: ``plan``'s (tests).
    Returns:
      ``(pre_sums, post_sums, affine_sums)``: per slot, None or the fp32 (C,) sum over every element
      of its gradient; per gamma, beta, None or the fp32 (E,) sum over rows; each the kernels'
      partials summed in a fixed order.
    """
    parts = (grad_out, y, stats, normalized_dims, has_bias,
           step_codes(pre), step_codes(post), params, post_params,
           affine, grad_y, tuple(map(bool, pre_grad_slots)), tuple(map(bool, post_grad_slots)),
           tuple(map(bool, affine_grads)), programs, chunk)  # fmt: skip
    launch = _BACKWARD_LAUNCHES.plan(parts, lambda: _BackwardLaunch(
        grad_out, y, stats, normalized_dims, has_bias, pre, post, params, post_params, affine, grad_y, pre_grad_slots,
        post_grad_slots, affine_grads, programs, chunk))  # fmt: skip
    return launch(grad_out, y, stats, params, post_params, affine, grad_y)


class _BackwardLaunch:
    """``layer_norm_backward`` for one signature: arguments checked and the launches worked out once."""

    def __init__(self, grad_out, y, stats, normalized_dims, has_bias, pre, post, params, post_params, affine, grad_y,
                 pre_grad_slots, post_grad_slots, affine_grads, programs, chunk) -> None:  # fmt: skip
        geo = self.geo = _check_common(y, normalized_dims, params, post_params, affine)
        for name, t in (("grad_out", grad_out), ("grad_y", grad_y)):
            if t.shape != y.shape:
                raise ValueError(f"{name} must have y's shape {tuple(y.shape)}, got {tuple(t.shape)}")
        _check_stats(stats, geo.rows)
        self.copy_grad_out = False
        try:
            g_flat = flat_strides("grad_out", grad_out)
        except ValueError:
            self.copy_grad_out, g_flat = True, flat_strides("grad_out", torch.empty(grad_out.shape, device="meta"))
        self.pre_slots = [k < len(pre_grad_slots) and bool(pre_grad_slots[k]) for k in range(len(pre))]
        self.post_slots = [k < len(post_grad_slots) and bool(post_grad_slots[k]) for k in range(len(post))]
        self.affine_slots = [bool(a) for a in affine_grads]
        pre_mask, post_mask, affine_mask = [sum(1 << k for k, w in enumerate(slots) if w)
                                            for slots in (self.pre_slots, self.post_slots, self.affine_slots)]  # fmt: skip
        self.launch = self.partial = None
        self.workspace: tuple[int, ...] | None = None
        # sizes of the partial-sum buffers: pre-chain, post-chain (per row) and affine (per program)
        self.part_rows = self.qpart_rows = geo.rows
        self.apart = (2, 1, geo.elements)
        if grad_y.numel() == 0:
            return
        p = plan(geo, y, programs, chunk)
        y_flat, gy_flat = flat_strides("y", y), flat_strides("grad_y", grad_y)
        consts = dict(PRE=op_codes(pre), POST=op_codes(post), HAS_BIAS=has_bias, num_warps=p.num_warps)
        shape = (geo.channels, geo.channel_blocks, geo.rows_per_channel, geo.row_channels, geo.row_positions)
        if p.packed:
            self.apart = (2, p.programs, geo.elements)
            self.launch = FastLaunch(_layer_norm_packed_bwd_kernel, (p.programs,), dict(
                consts, PRE_MASK=pre_mask, POST_MASK=post_mask, AFFINE_MASK=affine_mask, CHANNELS_FAST=p.channels_fast,
                EL=0 if p.channels_fast else 1, BLOCK_R=p.block_r, BLOCK_L=p.block_l),
                fixed=(geo.rows, geo.channels, geo.rows_per_channel, geo.row_positions, p.blocks, p.blocks_per_program,
                       *g_flat, *y_flat, *gy_flat))  # fmt: skip
            return
        tiles = dict(BLOCK_C=p.block_c, BLOCK_S=p.block_s)
        self.workspace = (geo.rows, p.split, 2)
        self.qpart_rows = geo.rows * p.split * geo.row_channels
        self.part_rows = geo.rows * p.nsb * geo.row_channels
        self.apart = (2, p.row_programs, geo.elements)
        self.partial = FastLaunch(_layer_norm_walk_bwd_sums_kernel, (geo.rows, p.split), dict(
            consts, POST_MASK=post_mask, **tiles), fixed=(geo.rows, *shape, geo.elements, p.chunk, self.qpart_rows,
                                                         *g_flat, *y_flat))  # fmt: skip
        self.launch = FastLaunch(_layer_norm_walk_bwd_dy_kernel, (p.tile_programs, p.row_programs), dict(
            consts, PRE_MASK=pre_mask, AFFINE_MASK=affine_mask, SPLIT_P2=p.split_p2, **tiles),
            fixed=(geo.rows, *shape, geo.elements, p.split, p.nsb, p.tiles, p.tiles_per_program, p.rows_per_program,
                   self.part_rows, *g_flat, *y_flat, *gy_flat))  # fmt: skip

    def __call__(self, grad_out, y, stats, params, post_params, affine, grad_y):
        if self.copy_grad_out:
            grad_out = grad_out.contiguous()
        device = grad_y.device
        # every entry of a wanted row is written when the kernels run
        alloc = torch.zeros if self.launch is None else torch.empty

        def buffer(slots: list[bool], shape: tuple[int, ...]) -> torch.Tensor:
            return alloc(shape if any(slots) else (1,), dtype=torch.float32, device=device)

        part = buffer(self.pre_slots, (MAX_SLOTS, self.part_rows))
        qpart = buffer(self.post_slots, (MAX_SLOTS, self.qpart_rows))
        apart = buffer(self.affine_slots, self.apart)
        if self.launch is not None:
            if self.partial is None:
                self.launch(grad_out, y, stats, params, post_params, affine, grad_y, part, qpart, apart)
            else:
                ws = torch.empty(self.workspace, dtype=torch.float32, device=device)
                self.partial(grad_out, y, stats, params, post_params, affine, ws, qpart)
                self.launch(grad_out, y, stats, params, post_params, affine, grad_y, ws, part, apart)
        # NOTE: torch's reduction over a fixed shape runs in a fixed order: bitwise reproducible sums.
        geo = self.geo
        return ([channel_sums(part[k], geo) if w else None for k, w in enumerate(self.pre_slots)],
                [channel_sums(qpart[k], geo) if w else None for k, w in enumerate(self.post_slots)],
                [apart[k].sum(0) if w else None for k, w in enumerate(self.affine_slots)])  # fmt: skip
