"""Triton kernels for ``conv output -> batch norm with batch statistics -> pointwise post-chain``,
forward and backward.

These kernels know only tensors, op codes and eps; the fused op that calls them
(``fusion_backend.ops.conv_batch_norm``) owns the configuration, the running statistics, the autograd
wiring and the fallback.

Semantics (torch's ``batch_norm`` in training mode): per channel ``c``, ``v = y + bias[c]`` over every
sample and spatial position (``R = N * S`` values) has mean ``mu`` and biased variance ``var``;
``x_hat = (v - mu) * rstd`` with ``rstd = 1 / sqrt(var + eps)``; ``out = post(x_hat * gamma[c] +
beta[c])``.  All arithmetic is fp32.

Data layout.  Tensors are seen as ``(N, C, S)`` with ``S`` the flattened spatial positions (every
conv output flattens: contiguous or channels-last); the kernels take element strides ``(sn, sc, ss)``
and walk a channel's values by the flat index ``r = n * S + s`` in ``[0, R)``.  ``bias_ptr`` is the conv
bias itself, ``(C,)`` in its own dtype (rounded to y's dtype as the conv adds it); ``Q`` is
``kernels/chain_math.py``'s ``(NUM_PARAM_ROWS, C)`` fp32 operand matrix of the post-chain; ``A`` the
norm's scale and shift, fp32 ``(2, C)`` contiguous (row 0 gamma, row 1 beta); ``ST`` the statistics,
fp32 ``(2, C)`` contiguous (row 0 mean, row 1 rstd).

Tiling.  Grid ``(channel blocks, chunks)``: a program owns ``BLOCK_C`` channels and one chunk of
``CHUNK`` consecutive flat indices (a multiple of ``BLOCK_R``), walked in ``[BLOCK_C, BLOCK_R]``
tiles in a fixed order.  A channel's ``R`` values split over many chunks so that the grid fills the
GPU whatever C is, but a chunk of a small tensor holds about ``MIN_CHUNK_TILES`` tiles (``Plan``); the
elementwise passes (normalise, input gradient) need no combination and walk chunks of their own
(``POINTWISE_TILES``); every loop is software-pipelined.  Every cross-chunk combination reduces the
small ``(C, chunks)`` partials over a fixed shape in a fixed order (the forward's in a kernel, the backward's in torch), so
every result is bitwise reproducible.

Forward: ``batch_norm_stats`` (kernel A) writes per (channel, chunk) the chunk's mean and sum of
squared deviations (per-lane Welford accumulators merged with Chan's parallel formula: no
``E[x^2] - E[x]^2`` cancellation); the combine kernel merges the chunks (the same formula) into
``mu``, ``rstd`` and the unbiased variance; ``batch_norm_apply`` (kernel B) normalises, applies gamma /
beta and the post-chain and writes ``out`` in its own layout and dtype.

Backward: kernel A recomputes ``x_hat`` and the post-chain from the saved conv output, walks the chain
back from ``grad_out`` to ``dz`` (the gradient at the norm's output) and writes per (channel, chunk)
the sums of ``dz``, ``dz * x_hat`` and the post-chain's operand gradients; the combine sums the chunks
(``dbeta = sum dz``, ``dgamma = sum dz * x_hat``, written by kernel B's first chunk); kernel B writes
``grad_y = gamma * rstd * (dz - mean(dz) - x_hat * mean(dz * x_hat))``.

A max or avg pool after the post-chain: the forward's normalise pass is ``kernels/norm_pool.py``'s
(kernel B is not used), which writes only the pooled result; in the backward ``grad_out`` is the
pooled result's gradient, and both kernels gather each position's gradient from the windows that hold
it (``norm_pool.pool_input_grad``: a max pool's only at the saved winners).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..ir.specs import PoolSpec
from .chain_math import (
    MAX_SLOTS,
    KernelStep,
    apply_chain_at,
    chain_grad_at,
    op_codes,
)
from .host import cdiv, next_pow2
from .launch import FastLaunch
from .norm_pool import pool_arguments, pool_input_grad, pooled_grad_strides
from .plan_cache import PlanCache, flat_strides, require_rows, spatial_flat_strides

#: Elements of a program's tile (``BLOCK_C * BLOCK_R``).
TILE_ELEMENTS = 2048
#: Channels of a tile when the channels are the innermost dim (channels-last), else.
CHANNELS_INNER_BLOCK_C = 64
CHANNELS_OUTER_BLOCK_C = 8
#: Programs a launch aims at: about 8 per SM of a 132-SM H100, so that a channel's values split
#: over many chunks even when C is small (64 channels of 524,288 values: 1024 programs).
TARGET_PROGRAMS = 1024
#: Rows of the backward's partial sums: sum dz, sum dz * x_hat, then one per post-chain slot.
SUM_ROWS = 2 + MAX_SLOTS
#: A reduction splits a channel's values into at most one chunk per this many tiles (balanced chunks of
#: about this many tiles each on a small tensor: fewer, longer programs rather than ``TARGET_PROGRAMS``
#: of one tile each).
MIN_CHUNK_TILES = 16
#: Software-pipelining stages of the reductions' loops (the statistics, the backward's sums) and of the
#: elementwise passes' loops (normalise, input gradient): ``tl.range(num_stages=...)``, 1 for none.
REDUCE_STAGES = 3
POINTWISE_STAGES = 4
#: Tiles per program of the elementwise passes (0: the reductions' chunks).
POINTWISE_TILES = 16
# NOTE: ResNet-50's nine BatchNorm inputs (H200, bf16, batch 64, channels-last; GPU us summed over the nine):
# statistics 229, normalise 218, backward 746 with none of the three (chunks of one tile on the small
# tensors, loops unpipelined, the elementwise passes on the reductions' chunks); 190 / 191 / 578 with them
# (Inductor's compile of relu(batch_norm(...)) alone: forward 481, backward 637).  One tile per program in
# the elementwise passes: 276 / 1,272; pipelining the reductions in 2 stages: slower than none
# (``python tools/bench_batch_norm.py``; the sweep behind these in docs/perf/RESULTS.md, "BatchNorm's
# passes pipelined").  The knobs change no elementwise bit; MIN_CHUNK_TILES regroups the statistics' sums.
#: The most programs along a launch grid's second axis (CUDA's limit).
MAX_GRID_Y = 65535


# --------------------------------------------------------------------------------------------------
# Device functions
# --------------------------------------------------------------------------------------------------


@triton.jit
def _offsets(c, r, S, sn, sc, ss, FLAT: tl.constexpr):
    """Element offsets of channels ``c`` and flat indices ``r`` in a tensor of strides ``(sn, sc, ss)``;
    with ``FLAT`` (``walks_flat``: one sample, or ``sn == S * ss``) without dividing ``r`` by ``S``.
    NOTE: with the division and remainder per element, ResNet-50's nine BatchNorm shapes (bf16, batch 64,
    channels-last) took 887 us in the statistics and normalise passes and 1,405 us in the backward, on
    the H200, against 765 and 1,358 us without; reading and writing their tensors once each at the copy
    rate would take 427 and 711 us (``python tools/bench_batch_norm.py``; ``docs/perf/RESULTS.md``,
    "BatchNorm's training passes walked without a division")."""
    if FLAT:
        return r.to(tl.int64) * ss + c.to(tl.int64) * sc
    return (r // S).to(tl.int64) * sn + c.to(tl.int64) * sc + (r % S).to(tl.int64) * ss


def walks_flat(plan: Plan, *strides: tuple[int, int, int]) -> bool:
    """Whether every ``(sn, sc, ss)`` walks the flat index ``r = n * positions + s`` of ``plan``'s tensors
    with one stride (one sample, or ``sn == positions * ss``: channels-last and dense), so ``_offsets``
    needs no division."""
    return plan.values == plan.positions or all(sn == plan.positions * ss for sn, _, ss in strides)


@triton.jit
def _load_v(y_ptr, bias_ptr, c, r, valid, C, S, y_sn, y_sc, y_ss, HAS_BIAS: tl.constexpr, FLAT: tl.constexpr):
    """``v = y + bias`` (fp32) at channels ``c`` ([BLOCK_C, 1]) and flat indices ``r`` ([1, BLOCK_R]);
    lanes outside ``valid`` hold 0."""
    v = tl.load(y_ptr + _offsets(c, r, S, y_sn, y_sc, y_ss, FLAT), mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + c, mask=c < C, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
        v = tl.where(valid, v + b, 0.0)
    return v


@triton.jit
def _norm_grad_tile(gout_ptr, y_ptr, bias_ptr, q_ptr, win_ptr, c, r, valid, mu, rstd, gamma, beta, C, S,
                    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sn, w_sc, w_sd, w_sh, w_sw,
                    POST: tl.constexpr, HAS_BIAS: tl.constexpr, POOL: tl.constexpr,
                    POOL_GEOM: tl.constexpr, FLAT: tl.constexpr):  # fmt: skip
    """One tile of the backward: ``(x_hat, dz, q0..q7)``: the normalised value, the gradient at the
    norm's output (the post-chain walked back from grad_out; 0 outside ``valid``) and the post-chain's
    operand gradients.  With a pool (POOL 1 max, 2 avg) grad_out is the pooled gradient and each
    position's gradient is gathered from the windows that hold it (``norm_pool.pool_input_grad``: a
    max pool's only at its winners), so nothing full-size is read but y."""
    v = _load_v(y_ptr, bias_ptr, c, r, valid, C, S, y_sn, y_sc, y_ss, HAS_BIAS, FLAT)
    xh = (v - mu) * rstd
    if POOL == 0:
        g = tl.load(gout_ptr + _offsets(c, r, S, g_sn, g_sc, g_ss, FLAT), mask=valid, other=0.0).to(tl.float32)
    else:
        n64 = (r // S).to(tl.int64)
        c64 = c.to(tl.int64)
        g = pool_input_grad(gout_ptr, win_ptr, n64 * g_sn + c64 * g_sc, n64 * w_sn + c64 * w_sc, r % S, valid, D, H, W,
                            OD, OH, OW, g_sd, g_sh, g_ss, w_sd, w_sh, w_sw, POOL, POOL_GEOM)  # fmt: skip
    dz, q0, q1, q2, q3, q4, q5, q6, q7 = chain_grad_at(g, xh * gamma + beta, q_ptr, c, C, c < C, POST)
    return xh, tl.where(valid, dz, 0.0), q0, q1, q2, q3, q4, q5, q6, q7


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _batch_norm_stats_kernel(
    y_ptr, bias_ptr, ws_ptr, C, S, R, CHUNK, K,
    y_sn, y_sc, y_ss,
    HAS_BIAS: tl.constexpr, FLAT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Per (channel, chunk): the chunk's mean and sum of squared deviations of ``v = y + bias``.

    Each lane of the ``[BLOCK_C, BLOCK_R]`` tile keeps its own Welford mean, sum of squared deviations
    and count over the chunk's tiles; the lanes are merged once, at the end, with Chan's formula.  Every
    lane of a channel holds a value in each of the chunk's full tiles, so there the count is the loop's
    (no per-lane count to keep and no mask); the chunk's last, partial tile counts per lane.
    NOTE: the loop is elementwise, so the kernel reads at memory speed; a two-pass reduction across
    the lanes of every tile (a tile mean, then the deviations from it) made it 3.6x slower than
    Inductor's statistics pass on a channels-last 32x64x128x128 fp32 conv output, 0.167 vs 0.046 ms
    (H100; ``FUSION_DECIDE=fuse python tools/profile_step.py
    demos/families/conv2d_64_k3_batchnorm_train_relu.py --backends fusion,inductor --mode infer``).

    Pointers (element strides; ``S`` flattened positions, ``R = N * S``):
      y_ptr     conv output without bias, (N, C, S), fp32/fp16/bf16, strides ``y_s*``.
      bias_ptr  (HAS_BIAS) the conv bias, (C,) contiguous, any float dtype.
      ws_ptr    fp32 (2, C, K) contiguous: row 0 the chunk means, row 1 the chunk sums of squared
                deviations (``K`` chunks).
    Grid: ``(cdiv(C, BLOCK_C), K)``; program ``(i, k)`` owns channels ``i * BLOCK_C + [0, BLOCK_C)`` and
    flat indices ``[k * CHUNK, min((k + 1) * CHUNK, R))``.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
    cmask = c < C
    k = tl.program_id(1)
    rb = tl.arange(0, BLOCK_R)[None, :]
    start = k * CHUNK
    end = tl.minimum(start + CHUNK, R)
    full = (end - start) // BLOCK_R
    mean = tl.zeros([BLOCK_C, BLOCK_R], tl.float32)
    m2 = tl.zeros([BLOCK_C, BLOCK_R], tl.float32)
    # NOTE: the Welford step multiplies by the tile's ``1 / count``, computed once per tile: dividing each
    # lane by the count costs the division's range scaling per element, 114 against 93 SASS instructions
    # in the loop on a channels-last bf16 input (``python tools/compile_check.py batch_norm --cases
    # bench_cl-bf16 --kernels stats --dump-sass DIR``; ``group_norm``'s channels-last statistics, ``--cases
    # vae_cl-bf16``: 127 against 107).  On the H200 the loop is not the bound for BatchNorm (``python
    # tools/bench_batch_norm.py --no-inductor``: forward rows 390.6 against 388.4 us in all, noise) and
    # saves 2% for GroupNorm (``--groups 32``: 400.4 against 391.5 us); the result differs in the last bit.
    for i in tl.range(0, full, num_stages=STAGES):  # full tiles: every lane's count is i + 1 (a channel past C: never stored)
        v = _load_v(y_ptr, bias_ptr, c, start + i * BLOCK_R + rb, cmask, C, S, y_sn, y_sc, y_ss, HAS_BIAS, FLAT)
        delta = v - mean
        mean = mean + delta * (1.0 / (i + 1.0))
        m2 = m2 + delta * (v - mean)
    n = tl.zeros([BLOCK_C, BLOCK_R], tl.float32) + full.to(tl.float32)
    r = start + full * BLOCK_R + rb
    if start + full * BLOCK_R < end:  # the partial tile: per-lane counts
        valid = cmask & (r < end)
        v = _load_v(y_ptr, bias_ptr, c, r, valid, C, S, y_sn, y_sc, y_ss, HAS_BIAS, FLAT)
        n_new = n + valid.to(tl.float32)
        delta = v - mean
        mean = mean + tl.where(valid, delta / tl.maximum(n_new, 1.0), 0.0)
        m2 = m2 + tl.where(valid, delta * (v - mean), 0.0)
        n = n_new
    n = tl.where(cmask, n, 0.0)
    count = tl.sum(n, axis=1)
    chunk_mean = tl.sum(mean * n, axis=1) / tl.maximum(count, 1.0)
    d = mean - chunk_mean[:, None]
    chunk_m2 = tl.sum(m2 + n * d * d, axis=1)
    c1 = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask1 = c1 < C
    tl.store(ws_ptr + c1 * K + k, chunk_mean, mask=cmask1)
    tl.store(ws_ptr + C * K + c1 * K + k, chunk_m2, mask=cmask1)


@triton.jit
def _batch_norm_combine_kernel(ws_ptr, counts_ptr, st_ptr, gamma_ptr, beta_ptr, C, K, VALUES, eps,
                               FOLD: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
                               BLOCK_K: tl.constexpr):  # fmt: skip
    """Per channel (program ``c``): Chan's merge of the ``K`` chunks' means and sums of squared
    deviations (``ws_ptr``, the statistics kernel's (2, C, K); ``counts_ptr`` fp32 (K,) values per
    chunk; ``VALUES`` their total, > 1) into ``st_ptr``, fp32 (3, C) contiguous: row 0 the mean, row 1
    ``1 / sqrt(var + eps)`` (``var`` biased), row 2 the unbiased variance.  With ``FOLD`` (7, C): rows 3
    and 4 the norm folded with its affine into ``scale = gamma * rstd`` and ``shift = beta - mean *
    scale`` (what a conv's prologue applies), rows 5 and 6 ``gamma`` and ``beta`` in fp32 (what its
    backward reads); ``gamma_ptr`` / ``beta_ptr`` (C,) contiguous, any float dtype, or 1 and 0 without
    ``HAS_GAMMA`` / ``HAS_BETA``.  One program reduces a fixed shape in a fixed order: bitwise
    reproducible."""
    c = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    kmask = k < K
    means = tl.load(ws_ptr + c * K + k, mask=kmask, other=0.0)
    m2s = tl.load(ws_ptr + C * K + c * K + k, mask=kmask, other=0.0)
    counts = tl.load(counts_ptr + k, mask=kmask, other=0.0)
    mean = tl.sum(means * counts, axis=0) / VALUES
    d = means - mean
    var = (tl.sum(m2s, axis=0) + tl.sum(counts * d * d, axis=0)) / VALUES
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    tl.store(st_ptr + c, mean)
    tl.store(st_ptr + C + c, rstd)
    tl.store(st_ptr + 2 * C + c, var * (VALUES / (VALUES - 1.0)))
    if FOLD:
        gamma = tl.load(gamma_ptr + c).to(tl.float32) if HAS_GAMMA else 1.0
        beta = tl.load(beta_ptr + c).to(tl.float32) if HAS_BETA else 0.0
        scale = gamma * rstd
        tl.store(st_ptr + 3 * C + c, scale)
        tl.store(st_ptr + 4 * C + c, beta - mean * scale)
        tl.store(st_ptr + 5 * C + c, gamma)
        tl.store(st_ptr + 6 * C + c, beta)


@triton.jit
def _batch_norm_apply_kernel(
    y_ptr, bias_ptr, q_ptr, a_ptr, st_ptr, out_ptr, C, S, R, CHUNK,
    y_sn, y_sc, y_ss, o_sn, o_sc, o_ss,
    POST: tl.constexpr, HAS_BIAS: tl.constexpr, FLAT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """out = post((y + bias - mean) * rstd * gamma + beta).

    Pointers (element strides):
      y_ptr, bias_ptr  as in the statistics kernel.
      q_ptr     post-chain operand matrix Q, (NUM_PARAM_ROWS, C) fp32 contiguous.
      a_ptr     gamma and beta, (2, C) fp32 contiguous.
      st_ptr    mean and rstd, (2, C) fp32 contiguous.
      out_ptr   result, (N, C, S), any float dtype, strides ``o_s*``.
    Grid: as the statistics kernel's.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
    cmask = c < C
    rb = tl.arange(0, BLOCK_R)[None, :]
    start = tl.program_id(1) * CHUNK
    mu = tl.load(st_ptr + c, mask=cmask, other=0.0)
    rstd = tl.load(st_ptr + C + c, mask=cmask, other=0.0)
    gamma = tl.load(a_ptr + c, mask=cmask, other=0.0)
    beta = tl.load(a_ptr + C + c, mask=cmask, other=0.0)
    for r0 in tl.range(start, tl.minimum(start + CHUNK, R), BLOCK_R, num_stages=STAGES):
        r = r0 + rb
        valid = cmask & (r < R)
        v = _load_v(y_ptr, bias_ptr, c, r, valid, C, S, y_sn, y_sc, y_ss, HAS_BIAS, FLAT)
        out = apply_chain_at((v - mu) * rstd * gamma + beta, q_ptr, c, C, cmask, POST)
        tl.store(out_ptr + _offsets(c, r, S, o_sn, o_sc, o_ss, FLAT), out.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _batch_norm_bwd_sums_kernel(
    gout_ptr, y_ptr, bias_ptr, q_ptr, a_ptr, st_ptr, part_ptr, win_ptr, C, S, R, CHUNK, K,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sn, w_sc, w_sd, w_sh, w_sw,
    POST: tl.constexpr, HAS_BIAS: tl.constexpr, POST_MASK: tl.constexpr, POOL: tl.constexpr, POOL_GEOM: tl.constexpr,
    FLAT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Per (channel, chunk) sums of ``dz``, ``dz * x_hat`` and the post-chain's operand gradients.

    Pointers (element strides):
      gout_ptr  gradient of out, (N, C, S), any float dtype, strides ``g_s*``; with a pool the pooled
                gradient, (N, C, OD, OH, OW), strides ``(g_sn, g_sc, g_sd, g_sh, g_ss)``.
      y_ptr, bias_ptr, q_ptr, a_ptr, st_ptr   as in the forward (``st_ptr``: the forward's statistics).
      part_ptr  fp32 (SUM_ROWS, C, K) contiguous: row 0 the sums of dz, row 1 of dz * x_hat, row 2 + k
                (POST_MASK bit k) of the post-chain slot k's first-operand gradient.
      win_ptr   (max pool) the forward's winners, int8/int32, (N, C, OD, OH, OW), strides ``w_s*``.
    ``(D, H, W)``: y's spatial sizes (``S = D * H * W``), read with a pool only.  POOL: 0 none, 1 max,
    2 avg; POOL_GEOM: ``chain_math.pool_geometry``'s.
    Grid: as the forward's.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
    cmask = c < C
    k = tl.program_id(1)
    rb = tl.arange(0, BLOCK_R)[None, :]
    start = k * CHUNK
    mu = tl.load(st_ptr + c, mask=cmask, other=0.0)
    rstd = tl.load(st_ptr + C + c, mask=cmask, other=0.0)
    gamma = tl.load(a_ptr + c, mask=cmask, other=0.0)
    beta = tl.load(a_ptr + C + c, mask=cmask, other=0.0)
    # Per-lane sums, reduced across the lanes once at the end (as the statistics kernel, whose NOTE
    # says why): the loop stays elementwise.
    s_dz = tl.zeros([BLOCK_C, BLOCK_R], tl.float32)
    s_dzxh = tl.zeros([BLOCK_C, BLOCK_R], tl.float32)
    p0, p1, p2, p3, p4, p5, p6, p7 = s_dz, s_dz, s_dz, s_dz, s_dz, s_dz, s_dz, s_dz
    for r0 in tl.range(start, tl.minimum(start + CHUNK, R), BLOCK_R, num_stages=STAGES):
        r = r0 + rb
        valid = cmask & (r < R)
        xh, dz, q0, q1, q2, q3, q4, q5, q6, q7 = _norm_grad_tile(
            gout_ptr, y_ptr, bias_ptr, q_ptr, win_ptr, c, r, valid, mu, rstd, gamma, beta, C, S, g_sn, g_sc, g_ss,
            y_sn, y_sc, y_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sn, w_sc, w_sd, w_sh, w_sw, POST, HAS_BIAS, POOL,
            POOL_GEOM, FLAT)  # fmt: skip
        s_dz += dz  # 0 outside valid
        s_dzxh += tl.where(valid, dz * xh, 0.0)
        if (POST_MASK & 1) != 0:
            p0 += tl.where(valid, q0, 0.0)
        if (POST_MASK & 2) != 0:
            p1 += tl.where(valid, q1, 0.0)
        if (POST_MASK & 4) != 0:
            p2 += tl.where(valid, q2, 0.0)
        if (POST_MASK & 8) != 0:
            p3 += tl.where(valid, q3, 0.0)
        if (POST_MASK & 16) != 0:
            p4 += tl.where(valid, q4, 0.0)
        if (POST_MASK & 32) != 0:
            p5 += tl.where(valid, q5, 0.0)
        if (POST_MASK & 64) != 0:
            p6 += tl.where(valid, q6, 0.0)
        if (POST_MASK & 128) != 0:
            p7 += tl.where(valid, q7, 0.0)
    c1 = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask1 = c1 < C
    at = part_ptr + c1 * K + k
    row = C * K
    tl.store(at, tl.sum(s_dz, axis=1), mask=cmask1)
    tl.store(at + row, tl.sum(s_dzxh, axis=1), mask=cmask1)
    rows = (p0, p1, p2, p3, p4, p5, p6, p7)
    for j in tl.static_range(8):
        if ((POST_MASK >> j) & 1) != 0:
            tl.store(at + (2 + j) * row, tl.sum(rows[j], axis=1), mask=cmask1)


@triton.jit
def _batch_norm_bwd_dx_kernel(
    gout_ptr, y_ptr, bias_ptr, q_ptr, a_ptr, st_ptr, sz_ptr, szx_ptr, gy_ptr, win_ptr, dg_ptr, db_ptr, C, S, R, CHUNK,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, gy_sn, gy_sc, gy_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sn, w_sc, w_sd, w_sh,
    w_sw, POST: tl.constexpr, HAS_BIAS: tl.constexpr, POOL: tl.constexpr, POOL_GEOM: tl.constexpr,
    AFFINE_GRADS: tl.constexpr, FLAT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """grad_y = gamma * rstd * (dz - mean(dz) - x_hat * mean(dz * x_hat)).

    Pointers (element strides):
      gout_ptr, y_ptr, bias_ptr, q_ptr, a_ptr, st_ptr, win_ptr   as in the sums kernel (the pool
                arguments too).
      sz_ptr, szx_ptr  per channel Σ dz and Σ dz * x_hat over its R values, (C,) contiguous each, fp32 or
                float64; each mean is the sum divided by R in float64, rounded once to fp32.
      gy_ptr    grad_y, (N, C, S), the conv output's dtype, strides ``gy_s*``.
      dg_ptr, db_ptr  AFFINE_GRADS: the norm's weight and bias gradients, (C,) contiguous, any float
                dtype: Σ dz * x_hat and Σ dz rounded to it, written by the programs of the first chunk.
    Grid: as the forward's.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
    cmask = c < C
    rb = tl.arange(0, BLOCK_R)[None, :]
    start = tl.program_id(1) * CHUNK
    mu = tl.load(st_ptr + c, mask=cmask, other=0.0)
    rstd = tl.load(st_ptr + C + c, mask=cmask, other=0.0)
    gamma = tl.load(a_ptr + c, mask=cmask, other=0.0)
    beta = tl.load(a_ptr + C + c, mask=cmask, other=0.0)
    sum_dz = tl.load(sz_ptr + c, mask=cmask, other=0.0)
    sum_dzxh = tl.load(szx_ptr + c, mask=cmask, other=0.0)
    mean_dz = (sum_dz.to(tl.float64) / R).to(tl.float32)
    mean_dzxh = (sum_dzxh.to(tl.float64) / R).to(tl.float32)
    if AFFINE_GRADS:
        if tl.program_id(1) == 0:
            tl.store(dg_ptr + c, sum_dzxh.to(dg_ptr.dtype.element_ty), mask=cmask)
            tl.store(db_ptr + c, sum_dz.to(db_ptr.dtype.element_ty), mask=cmask)
    for r0 in tl.range(start, tl.minimum(start + CHUNK, R), BLOCK_R, num_stages=STAGES):
        r = r0 + rb
        valid = cmask & (r < R)
        xh, dz, _q0, _q1, _q2, _q3, _q4, _q5, _q6, _q7 = _norm_grad_tile(
            gout_ptr, y_ptr, bias_ptr, q_ptr, win_ptr, c, r, valid, mu, rstd, gamma, beta, C, S, g_sn, g_sc, g_ss,
            y_sn, y_sc, y_ss, D, H, W, OD, OH, OW, g_sd, g_sh, w_sn, w_sc, w_sd, w_sh, w_sw, POST, HAS_BIAS, POOL,
            POOL_GEOM, FLAT)  # fmt: skip
        gy = gamma * rstd * (dz - mean_dz - xh * mean_dzxh)
        tl.store(gy_ptr + _offsets(c, r, S, gy_sn, gy_sc, gy_ss, FLAT), gy.to(gy_ptr.dtype.element_ty), mask=valid)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


class Plan:
    """How a ``(N, C, S)`` tensor is tiled: ``block_c`` x ``block_r`` tiles, ``chunks`` chunks of
    ``chunk`` flat indices per channel block for the reductions (``grid``), chunks of
    ``pointwise_chunk`` for the elementwise passes (``pointwise_grid``; see the module docstring)."""

    def __init__(self, y: torch.Tensor) -> None:
        if not 3 <= y.dim() <= 5:
            raise ValueError(f"y must be (N, C, *spatial) with 1-3 spatial dims, got {tuple(y.shape)}")
        n, channels = y.shape[:2]
        self.channels = channels
        self.positions = y[0, 0].numel() if y.numel() else int(torch.Size(y.shape[2:]).numel())
        self.values = n * self.positions
        channels_inner = y.stride(1) == 1 and channels > 1
        cap = CHANNELS_INNER_BLOCK_C if channels_inner else CHANNELS_OUTER_BLOCK_C
        self.block_c = min(next_pow2(channels), cap)
        self.block_r = max(1, min(next_pow2(max(self.values, 1)), TILE_ELEMENTS // self.block_c))
        channel_blocks = cdiv(channels, self.block_c)
        wanted = max(1, min(cdiv(self.values, self.block_r * MIN_CHUNK_TILES), cdiv(TARGET_PROGRAMS, channel_blocks)))
        self.chunk = cdiv(cdiv(max(self.values, 1), wanted), self.block_r) * self.block_r
        self.chunks = cdiv(max(self.values, 1), self.chunk)
        self.grid = (channel_blocks, self.chunks)
        #: the elementwise passes' chunk and grid: no cross-chunk combination, so any chunking gives the
        #: same bits
        tiles_cap = cdiv(cdiv(max(self.values, 1), MAX_GRID_Y), self.block_r) * self.block_r
        self.pointwise_chunk = max(self.block_r * POINTWISE_TILES, tiles_cap) if POINTWISE_TILES else self.chunk
        self.pointwise_grid = (channel_blocks, cdiv(max(self.values, 1), self.pointwise_chunk))
        self.num_warps = 8 if self.block_c * self.block_r >= 2048 else 4

    def chunk_counts(self, device: torch.device) -> torch.Tensor:
        """fp32 ``(chunks,)``: how many values of a channel each chunk holds."""
        counts = torch.full((self.chunks,), float(self.chunk), dtype=torch.float32)
        counts[-1] = self.values - self.chunk * (self.chunks - 1)
        return counts.to(device)



def _check_bias(bias: torch.Tensor | None, channels: int) -> None:
    if bias is not None and (bias.numel() != channels or not bias.is_contiguous()):
        raise ValueError(f"the bias must be contiguous with {channels} values, got {tuple(bias.shape)}")


#: Plans and their chunk counts by the tensor's shape, strides, dtype and device.
_PLANS = PlanCache()


def plan_for(y: torch.Tensor) -> tuple[Plan, torch.Tensor]:
    """The cached ``(Plan, chunk_counts)`` of ``y``'s signature."""
    return _PLANS.plan((y,), lambda: (lambda p: (p, p.chunk_counts(y.device)))(Plan(y)))


#: Rows of ``batch_norm_stats``' result with its ``fold``: mean, rstd, unbiased variance, the folded scale
#: and shift, gamma and beta.
FOLDED_ROWS = 7


def batch_norm_stats(y: torch.Tensor, bias: torch.Tensor | None, eps: float, out: torch.Tensor | None = None,
                     fold: tuple[torch.Tensor | None, torch.Tensor | None] | None = None) -> torch.Tensor:  # fmt: skip
    """Per-channel batch statistics of ``v = y + bias``: fp32 ``(3, C)`` contiguous (``out`` where
    given), row 0 the mean, row 1 ``rstd = 1 / sqrt(var + eps)`` (``var`` biased), row 2 the unbiased
    variance (what a running variance is updated with).  Rows 0-1 are what ``batch_norm_apply`` and
    the backward take.  With ``fold`` the result is ``(FOLDED_ROWS, C)``: rows 3-4 the norm folded with
    its affine, ``scale = gamma * rstd`` and ``shift = beta - mean * scale``
    (``kernels.conv.hooks.ChannelAffine``: what the conv that reads the norm's output applies as it
    loads it), rows 5-6 gamma and beta in fp32 (the affine rows its backward reads,
    ``batch_norm_input_grad``).  Two launches: the statistics kernel and the combine kernel.

    Args:
      y: conv output without bias, (N, C, *spatial) with 1-3 spatial dims that flatten (contiguous or
        channels-last), fp32/fp16/bf16, more than one value per channel.
      bias: None or the conv bias, C values, contiguous.
      fold: None or the norm's ``(gamma, beta)``, each None (1 and 0) or C contiguous values of any float
        dtype.
    """
    plan, counts = plan_for(y)
    _check_bias(bias, plan.channels)
    if plan.values < 2:
        raise ValueError(f"batch statistics need more than one value per channel, got y {tuple(y.shape)}")
    rows = 3 if fold is None else FOLDED_ROWS
    gamma, beta = (None, None) if fold is None else fold
    for name, t in (("gamma", gamma), ("beta", beta)):
        if t is not None and (t.numel() != plan.channels or not t.is_contiguous() or not t.is_floating_point()):
            raise ValueError(f"{name} must be {plan.channels} contiguous floating values, got {tuple(t.shape)} {t.dtype}")
    if out is None:
        out = torch.empty((rows, plan.channels), dtype=torch.float32, device=y.device)
    elif out.shape != (rows, plan.channels) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous fp32 ({rows}, {plan.channels}), got {tuple(out.shape)} {out.dtype}")
    launch = _STATS_LAUNCHES.plan((y, bias is None, rows, gamma is None, beta is None),
                                  lambda: _StatsLaunch(y, bias is not None, fold is not None, gamma is not None,
                                                       beta is not None, plan))  # fmt: skip
    launch(y, y if bias is None else bias, counts, out, out if gamma is None else gamma, out if beta is None else beta,
           float(eps))  # fmt: skip
    return out


class _StatsLaunch:
    """``batch_norm_stats``' two launches for one signature of y, worked out once (``FastLaunch``):
    the host time of a small step is what it waits on."""

    def __init__(self, y: torch.Tensor, has_bias: bool, fold: bool, has_gamma: bool, has_beta: bool,
                 plan: Plan) -> None:  # fmt: skip
        self.plan = plan
        y_flat = flat_strides("y", y)
        self.stats = FastLaunch(_batch_norm_stats_kernel, plan.grid, dict(
            HAS_BIAS=has_bias, FLAT=walks_flat(plan, y_flat), BLOCK_C=plan.block_c, BLOCK_R=plan.block_r,
            STAGES=REDUCE_STAGES, num_warps=plan.num_warps,
        ), fixed=(plan.channels, plan.positions, plan.values, plan.chunk, plan.chunks, *y_flat))  # fmt: skip
        self.combine = FastLaunch(_batch_norm_combine_kernel, (plan.channels,), dict(
            FOLD=fold, HAS_GAMMA=has_gamma, HAS_BETA=has_beta, BLOCK_K=next_pow2(plan.chunks),
            num_warps=4 if plan.chunks <= 512 else 8,
        ))  # fmt: skip

    def __call__(self, y: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor, out: torch.Tensor,
                 gamma: torch.Tensor, beta: torch.Tensor, eps: float) -> None:  # fmt: skip
        plan = self.plan
        ws = torch.empty((2, plan.channels, plan.chunks), dtype=torch.float32, device=y.device)
        self.stats(y, bias, ws)
        self.combine(ws, counts, out, gamma, beta, plan.channels, plan.chunks, float(plan.values), eps)


_STATS_LAUNCHES = PlanCache()
_APPLY_LAUNCHES = PlanCache()


def batch_norm_apply(y: torch.Tensor, bias: torch.Tensor | None, post: Sequence[KernelStep],
                     post_params: torch.Tensor, affine: torch.Tensor, stats: torch.Tensor,
                     out: torch.Tensor) -> None:  # fmt: skip
    """Write ``out = post((y + bias - mean) * rstd * gamma + beta)``.

    Args:
      y, bias: as given to ``batch_norm_stats``.
      post: the chain as ``(op code, operand values)`` (values only decide the op codes here).
      post_params: Q, fp32 (NUM_PARAM_ROWS, C) contiguous (``kernels.epilogue.build_params``).
      affine: fp32 (2, C) contiguous: gamma, beta (ones / zeros without an affine norm).
      stats: fp32 (2, C) or (3, C) contiguous, rows 0-1 as ``batch_norm_stats`` writes them.
      out: preallocated, y's shape (spatial dims flatten), any float dtype.
    """
    plan, _ = plan_for(y)
    _check_bias(bias, plan.channels)
    for name, t, rows in (("Q", post_params, None), ("the affine rows", affine, 2), ("stats", stats, None)):
        require_rows(name, t, plan.channels, rows)
    if out.shape != y.shape:
        raise ValueError(f"out must have y's shape {tuple(y.shape)}, got {tuple(out.shape)}")
    if out.numel() == 0:
        return
    ops = op_codes(post)

    def build() -> FastLaunch:
        y_flat, out_flat = flat_strides("y", y), flat_strides("out", out)
        return FastLaunch(_batch_norm_apply_kernel, plan.pointwise_grid, dict(
            POST=ops, HAS_BIAS=bias is not None, FLAT=walks_flat(plan, y_flat, out_flat), BLOCK_C=plan.block_c,
            BLOCK_R=plan.block_r, STAGES=POINTWISE_STAGES, num_warps=plan.num_warps),
            fixed=(plan.channels, plan.positions, plan.values, plan.pointwise_chunk, *y_flat, *out_flat))  # fmt: skip

    launch = _APPLY_LAUNCHES.plan((y, out, bias is None, ops), build)
    launch(y, y if bias is None else bias, post_params, affine, stats, out)


def _layout_of(t: torch.Tensor) -> torch.memory_format:
    """channels-last(-3d) where ``t``'s channels are its contiguous axis, else contiguous."""
    if t.dim() >= 4 and t.stride(1) == 1 and t.shape[1] > 1 and t[0, 0].numel() > 1:
        return torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return torch.contiguous_format


def flattening(t: torch.Tensor) -> torch.Tensor:
    """``t`` where its spatial dims flatten to one stride, as these kernels walk a tensor (contiguous,
    channels-last, a slice along N or C), else a dense copy in its layout (a slice along a spatial dim)."""
    return t if spatial_flat_strides(t) is not None else t.contiguous(memory_format=_layout_of(t))


def batch_norm_backward(
    grad_out: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, post: Sequence[KernelStep],
    post_params: torch.Tensor, affine: torch.Tensor, stats: torch.Tensor, grad_y: torch.Tensor,
    post_grad_slots: Sequence[bool] = (), pool: PoolSpec | None = None, winner: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:  # fmt: skip
    """Write the conv-output gradient into ``grad_y``; return ``(dgamma, dbeta, post_sums)``.

    Args:
      grad_out: gradient of ``out`` (y's shape, any strides, any float dtype); with ``pool``, of the
        pooled output (N, C, *pooled spatial), any strides.
      y, bias, post, post_params, affine, stats: as given to the forward.
      grad_y: preallocated (N, C, *spatial), spatial dims flattening, the conv output's dtype.
      post_grad_slots: per slot of the chain, whether its first operand's gradient is wanted.
      pool: None, or the max / avg pool the forward applied after the chain
        (``norm_pool.norm_pool_forward``).
      winner: a max pool's winners as that forward saved them (int8 / int32, grad_out's shape).
    Returns:
      fp32 (C,) ``sum dz * x_hat`` (gamma's gradient) and ``sum dz`` (beta's), each a tensor of its own
      (written by the input-gradient launch), and per slot None or the fp32 (C,) sum of its operand
      gradient (a row of one tensor); the chunks' partials summed in a fixed order.
    """
    plan, _ = plan_for(y)
    _check_bias(bias, plan.channels)
    for name, t, rows in (("Q", post_params, None), ("the affine rows", affine, 2), ("stats", stats, 2)):
        require_rows(name, t, plan.channels, rows)
    for name, t in (("grad_out", grad_out), ("grad_y", grad_y))[1 if pool is not None else 0:]:
        if t.shape != y.shape:
            raise ValueError(f"{name} must have y's shape {tuple(y.shape)}, got {tuple(t.shape)}")
    if pool is None:
        grad_out = flattening(grad_out)
        g_flat = flat_strides("grad_out", grad_out)
    else:
        if _layout_of(grad_out) != _layout_of(y):
            # NOTE: the kernels gather each position's pooled gradient over the tile's channels and
            # positions; in y's layout those loads run along its contiguous axis.  The pooled gradient
            # is a fraction of y's size (1/4 behind a stride-2 pool).
            grad_out = grad_out.contiguous(memory_format=_layout_of(y))
        g_flat = pooled_grad_strides(grad_out, y, pool, winner)
    win = winner if winner is not None else y
    slots = tuple(k < len(post_grad_slots) and bool(post_grad_slots[k]) for k in range(len(post)))
    ops = op_codes(post)
    parts = (grad_out, y, grad_y, win, bias is None, ops, slots, pool)
    launch = _BACKWARD_LAUNCHES.plan(parts, lambda: _BackwardLaunch(grad_out, y, grad_y, win, winner, bias is not None,
                                                                 ops, slots, pool, g_flat, plan))  # fmt: skip
    # the sums kernel writes every row whose sum is used (not a row between two wanted slots); an empty y
    # launches nothing
    alloc = torch.empty if y.numel() > 0 else torch.zeros
    part = alloc((launch.rows, plan.channels, plan.chunks), dtype=torch.float32, device=y.device)
    dgamma, dbeta = (alloc(plan.channels, dtype=torch.float32, device=y.device) for _ in range(2))
    common = (y, y if bias is None else bias, post_params, affine, stats)
    if y.numel() > 0:
        launch.sums(grad_out, *common, part, win)
    # NOTE: torch's reduction over a fixed shape runs in a fixed order: bitwise reproducible sums.
    sums = part.sum(2)
    if y.numel() > 0:
        launch.dx(grad_out, *common, sums[0], sums[1], grad_y, win, dgamma, dbeta)
    return dgamma, dbeta, [sums[2 + k] if w else None for k, w in enumerate(slots)]


_BACKWARD_LAUNCHES = PlanCache()


def batch_norm_input_grad(grad_z: torch.Tensor, y: torch.Tensor, affine: torch.Tensor, stats: torch.Tensor,
                          sum_dz: torch.Tensor, sum_dz_xhat: torch.Tensor, grad_y: torch.Tensor,
                          affine_grads: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:  # fmt: skip
    """Write ``grad_y = gamma * rstd * (grad_z - mean(grad_z) - x_hat * mean(grad_z * x_hat))``, the
    input gradient of a batch norm (batch statistics, no bias, no chain after it) whose output's
    gradient ``grad_z`` and its two sums someone else computed (``kernels.conv.conv_dgrad``'s epilogue,
    which produces them as the conv reading the norm's output stores its input gradient), and with
    ``affine_grads`` the norm's weight and bias gradients.  One launch of the backward's second kernel.

    Args:
      grad_z: the gradient at the norm's (affine) output, y's shape, spatial dims flattening.
      y: the norm's input, (N, C, *spatial), spatial dims flattening, fp32/fp16/bf16.
      affine: fp32 (2, C) contiguous: gamma, beta (ones / zeros without an affine norm).
      stats: fp32 (2+, C) contiguous, rows 0-1 the mean and rstd (``batch_norm_stats``).
      sum_dz, sum_dz_xhat: ``Σ grad_z`` and ``Σ grad_z * x_hat`` per channel over its ``N *
        prod(spatial)`` values, (C,) contiguous each, fp32 or float64.
      grad_y: preallocated, y's shape, spatial dims flattening, any float dtype.
      affine_grads: None or preallocated ``(grad_gamma, grad_beta)``, C contiguous values each, any float
        dtype: ``sum_dz_xhat`` and ``sum_dz`` rounded to it.
    """
    plan, _ = plan_for(y)
    for name, t, rows in (("the affine rows", affine, 2), ("stats", stats, None)):
        require_rows(name, t, plan.channels, rows)
    for name, t in (("sum_dz", sum_dz), ("sum_dz_xhat", sum_dz_xhat), *(
            zip(("grad_gamma", "grad_beta"), affine_grads, strict=True) if affine_grads is not None else ())):
        if t.numel() != plan.channels or not t.is_contiguous() or not t.is_floating_point():
            raise ValueError(f"{name} must be {plan.channels} contiguous floating values, got {tuple(t.shape)} {t.dtype}")
    for name, t in (("grad_z", grad_z), ("grad_y", grad_y)):
        if t.shape != y.shape:
            raise ValueError(f"{name} must have y's shape {tuple(y.shape)}, got {tuple(t.shape)}")
    if y.numel() == 0:
        return

    def build() -> FastLaunch:
        pool_ints, pool_consts = pool_arguments(grad_z, y, None, None)
        walks = flat_strides("grad_z", grad_z), flat_strides("y", y), flat_strides("grad_y", grad_y)
        return FastLaunch(_batch_norm_bwd_dx_kernel, plan.pointwise_grid, dict(
            POST=op_codes(()), HAS_BIAS=False, **pool_consts, AFFINE_GRADS=affine_grads is not None,
            FLAT=walks_flat(plan, *walks), BLOCK_C=plan.block_c, BLOCK_R=plan.block_r, STAGES=POINTWISE_STAGES,
            num_warps=plan.num_warps),
            fixed=(plan.channels, plan.positions, plan.values, plan.pointwise_chunk, *walks[0], *walks[1], *walks[2],
                   *pool_ints))  # fmt: skip

    launch = _INPUT_GRAD_LAUNCHES.plan((grad_z, y, grad_y, sum_dz, *(affine_grads or (None, None))), build)
    dg, db = affine_grads if affine_grads is not None else (y, y)
    launch(grad_z, y, y, affine, affine, stats, sum_dz, sum_dz_xhat, grad_y, y, dg, db)


_INPUT_GRAD_LAUNCHES = PlanCache()


class _BackwardLaunch:
    """``batch_norm_backward``'s two kernel launches for one call signature, worked out once
    (``FastLaunch``): the partial sums' row count, the pool's arguments, the strides."""

    def __init__(self, grad_out: torch.Tensor, y: torch.Tensor, grad_y: torch.Tensor, win: torch.Tensor,
                 winner: torch.Tensor | None, has_bias: bool, ops: tuple[int, ...], slots: tuple[bool, ...],
                 pool: PoolSpec | None, g_flat: tuple[int, int, int], plan: Plan) -> None:  # fmt: skip
        pool_ints, pool_consts = pool_arguments(grad_out, y, pool, winner)
        mask = sum(1 << k for k, w in enumerate(slots) if w)
        #: rows of the partial sums: sum dz, sum dz * x_hat, then the post-chain slots up to the last wanted
        self.rows = 2 + (max(k for k, w in enumerate(slots) if w) + 1 if mask else 0)
        sizes = (plan.channels, plan.positions, plan.values, plan.chunk)
        y_flat, gy_flat = flat_strides("y", y), flat_strides("grad_y", grad_y)
        # a pooled gradient is gathered per window, not walked by ``_offsets``
        flat = walks_flat(plan, y_flat, gy_flat, *(() if pool is not None else (g_flat,)))
        tiles = dict(POST=ops, HAS_BIAS=has_bias, **pool_consts, FLAT=flat, BLOCK_C=plan.block_c,
                     BLOCK_R=plan.block_r, num_warps=plan.num_warps)  # fmt: skip
        self.sums = FastLaunch(_batch_norm_bwd_sums_kernel, plan.grid, dict(tiles, POST_MASK=mask, STAGES=REDUCE_STAGES),
                               fixed=(*sizes, plan.chunks, *g_flat, *y_flat, *pool_ints))  # fmt: skip
        self.dx = FastLaunch(_batch_norm_bwd_dx_kernel, plan.pointwise_grid,
                             dict(tiles, AFFINE_GRADS=True, STAGES=POINTWISE_STAGES),
                             fixed=(*sizes[:3], plan.pointwise_chunk, *g_flat, *y_flat, *gy_flat, *pool_ints))  # fmt: skip
