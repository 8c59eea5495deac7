"""Triton kernels for ``conv output -> pointwise chain -> optional pool``, forward and backward.

These kernels know only tensors, op codes and pool geometry; the fused op that calls them
(``fusion_backend.ops.conv_epilogue``) owns the configuration, the autograd wiring and the fallback.

One template per direction serves every chain, every pool and 1d/2d/3d:

* The chain is up to ``MAX_SLOTS`` op-code slots (the constexpr tuple ``OPS``, one code per slot,
  0 = empty slot), using the stable codes of ``fusion_backend.ops.chain.PointwiseKind`` (kept as
  plain integers here).
* Every chain operand value (constants, per-channel or scalar tensors) lives in one small fp32
  matrix ``P`` of shape ``(NUM_PARAM_ROWS, C)`` built by the launchers: rows ``1 + 2*k`` and
  ``2 + 2*k`` hold the first and second operand of slot ``k``, each expanded over the ``C`` output
  channels.  The kernels load ``P[row, c]``.  The conv bias is read through its own pointer, as the
  caller holds it (C contiguous values, any float dtype); ``P``'s row ``BIAS_ROW`` is for kernels
  that read the bias from ``P`` (``build_params`` with a bias fills it).  WHY: with the bias out of
  ``P``, a chain without tensor operands (the usual conv + bias + activation) launches with the
  cached constant ``P`` and builds nothing per call; the ``torch.cat`` that built it cost as much
  host time per call as a launch (``docs/perf/RESULTS.md``, *Kernel design measurements*).
* Tensors are seen as ``(N, C, D, H, W)``: 1d/2d are lifted with leading size-1 spatial dims (and the
  pool with kernel 1 / stride 1 / padding 0 there), so one kernel serves all ranks.  The pool is the
  constexpr tuple ``POOL_GEOM`` (``pool_geometry``): ``(window, stride, padding)``, each per
  (d, h, w), then ``count_include_pad`` and the divisor override (0: none).
* The chain is computed in fp32 whatever the storage dtype (fp32, fp16 or bf16).

Programs work on a ``[BLOCK_C, BLOCK_S]`` tile: ``BLOCK_C`` channels of one sample by ``BLOCK_S``
flattened spatial positions.  Program id 0 enumerates ``(n, spatial block)``, id 1 channel blocks.
Addresses are computed from explicit element strides, so NCDHW-contiguous and channels-last tensors
both work without copies; the tile shape is chosen per layout so that the contiguous axis is the long
one.  Offsets are computed in int64: a single activation easily exceeds 2**31 elements.

Backward reductions (operand and bias gradients, which are per-channel sums over N x spatial) are
written as one partial sum per (program, channel) and summed afterwards in a fixed order: results
are bitwise reproducible run to run, and no float atomics are used anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..ir.specs import PoolSpec
from .chain_math import (
    BIAS_ROW,
    MAX_SLOTS,
    NUM_GRAD_ROWS,
    NUM_PARAM_ROWS,
    OPERAND_GRAD_CODES,
    SOURCE_STRIDE,
    KernelStep,
    OperandValue,
    add_spatial_offset,
    chain_backward,
    chain_forward,
    chain_slot_inputs,
    load_chain_operands,
    op_codes,
    pool_accumulate,
    pool_code,
    pool_divisor,
    pool_gather,
    pool_geometry,
    spatial_coords,
    step_codes,
)
from .host import cdiv, lift_5d, next_pow2, persistent_device_copies
from .launch import FastLaunch
from .plan_cache import PlanCache

# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _program_tile(C, S, num_s_blocks, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """This program's ``[BLOCK_C, BLOCK_S]`` tile of (channel, flat position) for a grid of
    ``(N * num_s_blocks, cdiv(C, BLOCK_C))`` programs over ``S`` positions per (sample, channel):
    ``(n64, c, c64, s, s64, cmask, mask)`` with ``c`` a ``[BLOCK_C, 1]`` and ``s`` a ``[1, BLOCK_S]``
    column / row, their int64 copies for offsets, ``cmask = c < C`` and ``mask`` the tile's valid
    elements."""
    pid0 = tl.program_id(0)
    n = pid0 // num_s_blocks
    sb = pid0 % num_s_blocks
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[:, None]
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)[None, :]
    cmask = c < C
    mask = cmask & (s < S)
    return n.to(tl.int64), c, c.to(tl.int64), s, s.to(tl.int64), cmask, mask


@triton.jit
def store_pooled(out_ptr, win_ptr, win_y_ptr, off, mask, best, win, win_y, total, od, oh, ow, D, H, W,
                 POOL: tl.constexpr, SAVE: tl.constexpr, POOL_GEOM: tl.constexpr):  # fmt: skip
    """Store a pool's result at element offsets ``off`` (where ``mask``) of out and, with SAVE, of the
    winner tensors (out's shape and strides).  Max pool (POOL 1): the maximum ``best``, with SAVE the
    winner's row-major index ``win`` in its window (``win_ptr``, int8/int32) and the conv output
    (without bias) there ``win_y`` (``win_y_ptr``).  Avg pool (POOL 2): the window sum ``total``
    over ``pool_divisor`` of window ``(od, oh, ow)`` over an input of spatial sizes ``(D, H, W)``
    with geometry ``POOL_GEOM``.  Every value is converted to its pointer's dtype."""
    if POOL == 1:
        tl.store(out_ptr + off, best.to(out_ptr.dtype.element_ty), mask=mask)
        if SAVE:
            tl.store(win_ptr + off, win.to(win_ptr.dtype.element_ty), mask=mask)
            tl.store(win_y_ptr + off, win_y.to(win_y_ptr.dtype.element_ty), mask=mask)
    else:
        div = pool_divisor(od, oh, ow, D, H, W, POOL_GEOM)
        tl.store(out_ptr + off, (total / div).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue_fwd_kernel(
    y_ptr, p_ptr, b_ptr, r_ptr, out_ptr, win_ptr, win_y_ptr,
    C, D, H, W, OD, OH, OW, num_s_blocks,
    y_sn, y_sc, y_sd, y_sh, y_sw,
    o_sn, o_sc, o_sd, o_sh, o_sw,
    r_sn, r_sc, r_sw,
    OPS: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    POOL: tl.constexpr, POOL_GEOM: tl.constexpr, SAVE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out = pool(chain(y + bias)); with a max pool and SAVE, also the winner and its y; without a
    pool and with SAVE, also a copy of y in out's layout.  With a residual (HAS_RESIDUAL, no pool):
    out = tail(head(y + bias) + r), the chain split at the residual's empty slot.

    Pointers (all element strides, dims (N, C, D, H, W)):
      y_ptr     conv output without bias, (N, C, D, H, W), fp32/fp16/bf16, strides ``y_s*``
                (independent of out's: the channels-last library forward reads a channels-last y
                and writes an NCHW out).
      p_ptr     operand matrix P, (NUM_PARAM_ROWS, C) fp32, contiguous (its bias row is not read).
      b_ptr     (HAS_BIAS) the bias, C contiguous values, any float dtype.
      out_ptr   result, (N, C, OD, OH, OW), any float dtype, strides ``o_s*``.  Without a pool
                OD, OH, OW == D, H, W.
      win_ptr   (max pool and SAVE only) winner index within the window, row-major over
                (kd, kh, kw), int8 or int32, same shape and strides as out.
      win_y_ptr (SAVE only) with a max pool: y (without bias) at the winner; without a pool: y
                (without bias) itself; any float dtype (y's for the saved state), same shape and
                strides as out.
      r_ptr     (HAS_RESIDUAL only) the residual, y's shape, any float dtype, strides ``r_s*`` over
                (n, c, flat position): its spatial dims flatten.
    OPS: the chain's op codes, one per slot (0 = empty), whose operands are loaded; HEAD and TAIL:
    OPS with the slots from the residual's on, and up to it, emptied (without a residual HEAD is
    OPS and TAIL all empty).  POOL: 0 none, 1 max, 2 avg (SAVE is not
    used with an avg pool); POOL_GEOM: its geometry (module docstring; the identity pool without a
    pool).  Without a pool the spatial dims must flatten for y and out (s_h == W*s_w and
    s_d == H*s_h where those sizes exceed 1): only ``*_sw`` is used then, so that contiguous rows
    give vectorised accesses.  Where y and out have different contiguous axes (channels vs
    positions) each access is coalesced along its own tensor's contiguous axis: Triton lays out the
    load and the store by their pointers' contiguity and converts between the two register layouts
    through shared memory, which is the transposing tile (``tile_shape`` gives it a square shape).
    Max-pool parity with PyTorch: taps are scanned in row-major order, the first valid tap wins
    initially and a later one replaces it when ``v > best or isnan(v)``; padding never wins.
    """
    n64, c, c64, s, s64, cmask, mask = _program_tile(C, OD * OH * OW, num_s_blocks, BLOCK_C, BLOCK_S)

    bias = 0.0
    if HAS_BIAS:  # in the conv's dtype, as the conv adds it (an fp32 bias under autocast is cast)
        bias = tl.load(b_ptr + c, mask=cmask, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
    a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7 = load_chain_operands(
        p_ptr, c, C, cmask, OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])  # fmt: skip

    y_base = y_ptr + n64 * y_sn + c64 * y_sc
    o_off = n64 * o_sn + c64 * o_sc
    if POOL == 0:
        y_raw = tl.load(y_base + s64 * y_sw, mask=mask, other=1.0)
        y = y_raw.to(tl.float32)
        if HAS_BIAS:
            y = y + bias
        v = chain_forward(y, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
                          HEAD[0], HEAD[1], HEAD[2], HEAD[3], HEAD[4], HEAD[5], HEAD[6], HEAD[7])  # fmt: skip
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + n64 * r_sn + c64 * r_sc + s64 * r_sw, mask=mask, other=0.0)
            v = chain_forward(v + r.to(tl.float32), a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
                              TAIL[0], TAIL[1], TAIL[2], TAIL[3], TAIL[4], TAIL[5], TAIL[6], TAIL[7])  # fmt: skip
        tl.store(out_ptr + o_off + s64 * o_sw, v.to(out_ptr.dtype.element_ty), mask=mask)
        if SAVE:  # the conv output itself, relaid into out's layout (the saved state)
            tl.store(win_y_ptr + o_off + s64 * o_sw, y_raw.to(win_y_ptr.dtype.element_ty), mask=mask)
    else:
        od, oh, ow = spatial_coords(s, OH, OW)
        KD: tl.constexpr = POOL_GEOM[0][0]
        KH: tl.constexpr = POOL_GEOM[0][1]
        KW: tl.constexpr = POOL_GEOM[0][2]
        STRIDE: tl.constexpr = POOL_GEOM[1]
        PAD: tl.constexpr = POOL_GEOM[2]
        d0 = od * STRIDE[0] - PAD[0]
        h0 = oh * STRIDE[1] - PAD[1]
        w0 = ow * STRIDE[2] - PAD[2]
        best = tl.full([BLOCK_C, BLOCK_S], float("-inf"), tl.float32)
        win = tl.full([BLOCK_C, BLOCK_S], -1, tl.int32)
        win_y = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
        acc = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
        for kd in tl.static_range(KD):
            idd = d0 + kd
            ok_d = (idd >= 0) & (idd < D)
            for kh in tl.static_range(KH):
                ih = h0 + kh
                ok_h = ok_d & (ih >= 0) & (ih < H)
                for kw in tl.static_range(KW):
                    iw = w0 + kw
                    ok = mask & ok_h & (iw >= 0) & (iw < W)
                    off = add_spatial_offset(0, idd, ih, iw, y_sd, y_sh, y_sw)
                    y_raw = tl.load(y_base + off, mask=ok, other=1.0).to(tl.float32)
                    y = y_raw
                    if HAS_BIAS:
                        y = y + bias
                    v = chain_forward(y, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
                                   OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])  # fmt: skip
                    best, win, acc, take = pool_accumulate(best, win, acc, v, ok, kd * KH * KW + kh * KW + kw, POOL)
                    if POOL == 1:
                        if SAVE:
                            win_y = tl.where(take, y_raw, win_y)
        o_off = add_spatial_offset(o_off, od, oh, ow, o_sd, o_sh, o_sw)
        store_pooled(out_ptr, win_ptr, win_y_ptr, o_off, mask, best, win, win_y, acc, od, oh, ow, D, H, W,
                     POOL, SAVE, POOL_GEOM)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _epilogue_bwd_kernel(
    gout_ptr, y_ptr, win_ptr, win_y_ptr, p_ptr, b_ptr, gy_ptr, part_ptr,
    C, D, H, W, OD, OH, OW, num_s_blocks, part_row_stride,
    g_sn, g_sc, g_sd, g_sh, g_sw,
    y_sn, y_sc, y_sd, y_sh, y_sw,
    gy_sn, gy_sc, gy_sd, gy_sh, gy_sw,
    w_sn, w_sc, w_sd, w_sh, w_sw,
    OPS: tl.constexpr, HAS_BIAS: tl.constexpr,
    POOL: tl.constexpr, POOL_GEOM: tl.constexpr, GRAD_MASK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Gradient of the conv output (full size) and per-block partial sums of operand/bias grads.

    Each program owns a tile of conv-output elements and *gathers* what flows into them (no
    scatter, no atomics): without a pool, grad_out at the same position; with a pool, the
    grad_out of the windows containing the element (at most ceil(K/S) per dim): those it won
    (max) or its 1/divisor share (avg).  Then the chain is recomputed at the element's value and
    differentiated step by step.

    Pointers (element strides, dims (N, C, D, H, W)):
      gout_ptr  gradient of the op's output, (N, C, OD, OH, OW) (D, H, W without a pool), any float
                dtype, strides ``g_s*`` (any, e.g. expanded with stride 0).
      y_ptr     (no pool / avg) conv output without bias, (N, C, D, H, W), strides ``y_s*``.
      win_ptr   (max) winner index per window, int8/int32, (N, C, OD, OH, OW), strides ``w_s*``.
      win_y_ptr (max) y (without bias) at the winner, same shape and strides as win.
      p_ptr     operand matrix P, (NUM_PARAM_ROWS, C) fp32 contiguous (its bias row is not read).
      b_ptr     (HAS_BIAS) the bias, C contiguous values, any float dtype.
      gy_ptr    output: gradient of the conv output, (N, C, D, H, W), strides ``gy_s*`` (may differ
                from y's: the library backward asks for a channels-last gradient of an NCHW y, the
                tile then transposes through shared memory), dtype of the conv output.
      part_ptr  output: fp32 (NUM_GRAD_ROWS, number of programs along id 0, C) contiguous, row
                stride ``part_row_stride``; row k < MAX_SLOTS holds the sum of d/d(first operand of
                slot k), row MAX_SLOTS the bias grad (sum of grad y), per program id 0 and channel.
                Only the rows selected by the GRAD_MASK bits are written (bit k: row k).
    OPS, POOL, POOL_GEOM: as in ``_epilogue_fwd_kernel``.
    Without a pool the spatial dims of gout, y and gy must flatten (only ``*_sw`` is used).
    Elements that win no window get exactly 0 (eager gives 0 * chain'(y), which differs only
    where chain'(y) is not finite).
    """
    n64, c, c64, s, s64, cmask, mask = _program_tile(C, D * H * W, num_s_blocks, BLOCK_C, BLOCK_S)

    a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7 = load_chain_operands(
        p_ptr, c, C, cmask, OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])  # fmt: skip

    y_off = n64 * y_sn + c64 * y_sc
    gy_off = n64 * gy_sn + c64 * gy_sc
    active = mask
    if POOL == 0:
        y_off = y_off + s64 * y_sw
        gy_off = gy_off + s64 * gy_sw
        y = tl.load(y_ptr + y_off, mask=mask, other=1.0).to(tl.float32)
        g = tl.load(gout_ptr + n64 * g_sn + c64 * g_sc + s64 * g_sw, mask=mask, other=0.0).to(tl.float32)
    else:
        d, h, w = spatial_coords(s, H, W)
        y_off = add_spatial_offset(y_off, d, h, w, y_sd, y_sh, y_sw)
        gy_off = add_spatial_offset(gy_off, d, h, w, gy_sd, gy_sh, gy_sw)
        # NOTE: lanes that are masked off or win nothing hold y = 1.0 (not 0.0), so that their
        # discarded chain derivatives stay finite (rdiv/div would give inf/NaN at 0).
        y = tl.full([BLOCK_C, BLOCK_S], 1.0, tl.float32)
        won = mask & (s < 0)
        if POOL == 2:
            y = tl.load(y_ptr + y_off, mask=mask, other=1.0).to(tl.float32)
        g, y, won = pool_gather(gout_ptr, win_ptr, win_y_ptr, n64 * g_sn + c64 * g_sc, n64 * w_sn + c64 * w_sc,
                                d, h, w, mask, y, won, D, H, W, OD, OH, OW, g_sd, g_sh, g_sw, w_sd, w_sh, w_sw,
                                POOL, POOL_GEOM, True)  # fmt: skip
        if POOL == 1:
            active = won
    if HAS_BIAS:  # in the conv's dtype (gy's), as the forward added it; loaded here, where it is used,
        # so that no register holds it through the window loops (NOTE: loaded first, the max-pool
        # bf16 specialisation spilled: ``python tools/compile_check.py epilogue --cases max-bf16``)
        y = y + tl.load(b_ptr + c, mask=cmask, other=0.0).to(gy_ptr.dtype.element_ty).to(tl.float32)

    # Recompute the chain's intermediates (the input and first operand of each slot), then walk back.
    v0, v1, v2, v3, v4, v5, v6, v7, a0, a1, a2, a3, a4, a5, a6, a7 = chain_slot_inputs(
        y, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
        OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])  # fmt: skip
    g, ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7 = chain_backward(
        g, v0, v1, v2, v3, v4, v5, v6, v7, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
        OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])  # fmt: skip
    g = tl.where(active, g, 0.0)
    tl.store(gy_ptr + gy_off, g.to(gy_ptr.dtype.element_ty), mask=mask)

    c1 = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # the tile's channels as a row
    part = part_ptr + tl.program_id(0).to(tl.int64) * C + c1
    pmask = c1 < C
    row = part_row_stride
    operand_grads = (ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7)
    for k in tl.static_range(len(OPS)):
        if ((GRAD_MASK >> k) & 1) != 0:
            tl.store(part + k * row, tl.sum(tl.where(active, operand_grads[k], 0.0), axis=1), mask=pmask)
    BIAS_GRAD_ROW: tl.constexpr = len(OPS)
    if ((GRAD_MASK >> BIAS_GRAD_ROW) & 1) != 0:
        tl.store(part + BIAS_GRAD_ROW * row, tl.sum(g, axis=1), mask=pmask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------




def _spatial_flattens(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """True when (D, H, W) can be walked as one axis of stride ``strides[4]``."""
    _, _, d, h, w = sizes
    sd, sh, sw = strides[2:]
    return (h == 1 or sh == w * sw) and (d == 1 or sd == h * w * sw)


def tile_shape(channels: int, spatial: int, channels_inner: bool, transposing: bool = False) -> tuple[int, int]:
    """``(BLOCK_C, BLOCK_S)`` of about 1024 elements, long along the contiguous axis.

    Channels-last tiles take up to 64 channels so that each spatial position reads a contiguous run of
    128 to 256 bytes.  A transposing tile (reads in one layout, writes in the other) is 32 x 32:
    measured on H100, the backward of Conv2d 64->64 on 64x64x256x256 with an NCHW y and a
    channels-last grad_y, fp32 / bf16 y: 32 x 32 1.45 / 1.29 ms, 16 x 128 2.75 / 2.01, 32 x 64 3.46 /
    3.41, 64 x 32 4.00 / 3.20, 64 x 64 6.13 / 5.45 (the same-layout NCHW tile: 1.67 / 1.40).  The
    forward's transposing case (a channels-last y read, an NCHW out written: the channels-last library
    forward) takes the same 32 x 32 shape; it has not been measured on its own.
    NOTE: measured on H100 (torch 2.11, triton 3.6), fp32, 4 warps, launcher time incl. P build:
      Conv2d y (64, 64, 254, 254), no pool:    fwd 0.85 ms (2.5 TB/s) NCHW, 0.71 ms (3.0 TB/s) NHWC;
                                               bwd 1.63 ms (1.9 TB/s) NCHW, 1.39 ms (2.3 TB/s) NHWC.
      ConvT3d y (16, 32, 32, 64, 64), max 2^3: fwd 0.24 ms (1.4 TB/s) NCDHW, 0.20 ms (1.7 TB/s) NDHWC;
                                               bwd 0.49 ms (0.7 TB/s) NCDHW, 0.38 ms (0.9 TB/s) NDHWC.
    The pooled kernels are bound by the per-element index arithmetic (div/mod by runtime sizes,
    int64 offsets), not by bandwidth: the first thing to tune if they matter.
    """
    c_pow = next_pow2(channels)
    s_pow = next_pow2(max(spatial, 1))
    if transposing:
        return min(c_pow, 32), min(s_pow, 32)
    if channels_inner:
        block_c = min(c_pow, 64)
        block_s = min(s_pow, max(1024 // block_c, 1))
    else:
        block_s = min(s_pow, 1024)
        block_c = min(c_pow, max(1024 // block_s, 1))
    return block_c, block_s


def channels_innermost(strides: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether the channels are the contiguous axis of a tensor of (N, C, D, H, W) ``sizes`` and
    ``strides`` (``lift_5d``): channels-last with more than one channel and position."""
    return strides[1] == 1 and sizes[1] > 1 and any(sz > 1 for sz in sizes[2:])


#: (constant per row, channels, device) -> the device matrix ``P`` with those constants and zero
#: rows elsewhere.  Never evicted: a recorded CUDA graph keeps reading the addresses it saw
#: (``host.persistent_device_copies``); the keys are the distinct constant sets of the model's chains.
_CONSTANT_PARAMS: dict[tuple[tuple[float, ...], int, torch.device], torch.Tensor] = {}


class OperandMatrix:
    """How ``P`` is assembled for one chain signature: which rows are constants, which come from
    which operand tensor (and whether that tensor is one value to expand over the channels).

    Built once per signature (a call plan keeps it); ``build`` then only reshapes the tensors and
    concatenates.  ``build`` takes the tensor rows in row order (``tensor_rows``: the bias first,
    then each slot's tensor operands).
    NOTE: host time matters here (the ConvT3d pipeline's launch is host-bound): one ``torch.cat`` of
    the tensor rows and slices of the cached constant matrix replaces a ``zeros`` plus one
    ``copy_``/``fill_`` per row (5 device ops on the ConvT3d pipeline).
    """

    def __init__(self, steps: Sequence[KernelStep], bias: torch.Tensor | None, channels: int,
                 device: torch.device) -> None:  # fmt: skip
        if len(steps) > MAX_SLOTS:
            raise ValueError(f"chains of at most {MAX_SLOTS} steps fit the kernel template, got {len(steps)}")
        values: list[OperandValue | None] = [None] * NUM_PARAM_ROWS
        if bias is not None:
            values[BIAS_ROW] = bias
        for slot, (_, operands) in enumerate(steps):
            if len(operands) > 2:
                raise ValueError(f"slot {slot}: at most 2 operands per step, got {len(operands)}")
            for j, value in enumerate(operands):
                values[1 + 2 * slot + j] = value
        constants = tuple(0.0 if v is None or isinstance(v, torch.Tensor) else float(v) for v in values)
        device = torch.device(device)
        key = (constants, channels, device)
        base = _CONSTANT_PARAMS.get(key)
        if base is None:
            table = torch.tensor(constants, dtype=torch.float32)[:, None].expand(NUM_PARAM_ROWS, channels)
            base = _CONSTANT_PARAMS[key] = persistent_device_copies([table.contiguous()], device)[0]
        self.base, self.channels, self.device = base, channels, device
        #: per piece of the concatenation: a slice of ``base``, or ``(source number, expand, convert)``
        #: (convert: the tensor is not fp32 on ``device``)
        self.pieces: list[torch.Tensor | tuple[int, bool, bool]] = []
        #: how many tensor rows ``build`` takes (no tensor is kept: a cached plan must not hold them)
        self.num_sources = 0
        done = 0
        for row, value in enumerate(values):
            if not isinstance(value, torch.Tensor):
                continue
            if value.numel() not in (1, channels):
                raise ValueError(
                    f"P row {row}: an operand tensor must have 1 or {channels} elements, got shape {tuple(value.shape)}"
                )
            if row > done:
                self.pieces.append(base[done:row])
            convert = value.dtype != torch.float32 or value.device != device
            self.pieces.append((self.num_sources, value.numel() == 1 and channels != 1, convert))
            self.num_sources += 1
            done = row + 1
        if done < NUM_PARAM_ROWS and self.num_sources:
            self.pieces.append(base[done:])

    def build(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``P`` for ``tensors`` (``tensor_rows`` of a call like the constructor's: same numel,
        dtype and device per row).

        The result is read-only: without tensor rows it is the cached constant matrix itself."""
        if not self.num_sources:
            return self.base
        pieces = []
        for piece in self.pieces:
            if isinstance(piece, torch.Tensor):
                pieces.append(piece)
                continue
            index, expand, convert = piece
            row = tensors[index].detach().reshape(1, -1)
            if expand:
                row = row.expand(1, self.channels)
            pieces.append(row.to(device=self.device, dtype=torch.float32) if convert else row)
        return torch.cat(pieces)


#: ``OperandMatrix`` per chain signature (``_matrix_key``): a matrix holds no tensor of a call.
_MATRICES = PlanCache()


def _matrix_key(steps: Sequence[KernelStep], bias: torch.Tensor | None, channels: int, device: torch.device) -> tuple:
    """What ``OperandMatrix`` is built from: each constant's value, each tensor's size, dtype and device."""

    def part(value: object) -> object:
        return (value.numel(), value.dtype, value.device) if isinstance(value, torch.Tensor) else value

    rows = tuple((code, tuple(part(v) for v in operands)) for code, operands in steps)
    return rows, None if bias is None else part(bias), channels, str(device)


def build_params(
    steps: Sequence[KernelStep], bias: torch.Tensor | None, channels: int, device: torch.device
) -> torch.Tensor:
    """The operand matrix ``P``: fp32 ``(NUM_PARAM_ROWS, channels)``, contiguous (see module doc);
    read-only (see ``OperandMatrix.build``).  The matrix's plan is kept per chain signature.
    NOTE: ``conv_group_norm``'s Python API on a CPU tensor with the kernel launches and the conv stubbed
    (the Triton path's host work alone) took 218 us per call with the kept plans against 227-232
    without (this repository's CPU machine, alternating runs)."""
    matrix = _MATRICES.get(_matrix_key(steps, bias, channels, device),
                           lambda: OperandMatrix(steps, bias, channels, device))  # fmt: skip
    return matrix.build(tensor_rows(steps, bias))


def _flat_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as the kernels read it: its C values, contiguous."""
    return None if bias is None else bias.reshape(-1).contiguous()


def tensor_rows(steps: Sequence[KernelStep], bias: torch.Tensor | None) -> list[torch.Tensor]:
    """The tensors of ``P``'s rows in row order (what ``OperandMatrix.build`` takes)."""
    rows = [] if bias is None else [bias]
    return rows + [v for _, operands in steps for v in operands if isinstance(v, torch.Tensor)]



def epilogue_forward(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    steps: Sequence[KernelStep],
    pool: PoolSpec | None,
    out: torch.Tensor,
    winner: torch.Tensor | None = None,
    winner_y: torch.Tensor | None = None,
    y_copy: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    residual_at: int | None = None,
) -> None:
    """Write ``out = pool(chain(y + bias))`` (and the max-pool winners) with one kernel launch.

    Args:
      y: conv output without bias, (N, C, *spatial) with 1 to 3 spatial dims, fp32/fp16/bf16, any
        strides, independent of out's (without a pool, spatial dims must flatten: contiguous or
        channels-last; a channels-last y with an NCHW out goes through a transposing tile).
      bias: None or C values (any float dtype), rounded to y's dtype (as the conv adds it in its
        dtype), then added in fp32 before the chain.
      steps: up to MAX_SLOTS ``(op code, operand values)``; see ``OperandValue``.
      pool: None, or the pool over the chain's result.
      out: preallocated result, (N, C, *pooled spatial) or y's shape without a pool, any float dtype;
        without a pool its spatial dims must flatten.
      winner, winner_y: max pool only, both or neither: preallocated like ``out`` (same shape and
        strides), int8/int32 and y's dtype; receive the winner's row-major index in its window and
        y (without bias) at the winner.
      y_copy: no pool only: None, or preallocated like ``out`` (same shape and strides), any float
        dtype (y's for a saved conv output); receives y (without bias), i.e. y relaid into out's
        layout in the same pass.
      residual, residual_at: no pool only: None, or a tensor of out's shape (any float dtype and
        strides) added where the chain's step ``residual_at`` is, an empty step ``(0, [])``:
        ``out = tail(head(y + bias) + residual)`` (``residual_split``).
    """
    parts = (
        y, bias is None, step_codes(steps), pool, out,
        winner, winner_y, y_copy, residual, residual_at,
    )  # fmt: skip
    launch = _FORWARD_LAUNCHES.plan(parts, lambda: ForwardLaunch(
        y, bias, steps, pool, out, winner, winner_y, y_copy=y_copy, residual=residual, residual_at=residual_at))
    launch(y, build_params(steps, None, launch.channels, y.device), _flat_bias(bias), out, winner, winner_y,
           y_copy=y_copy, residual=residual)  # fmt: skip


def residual_split(ops: Sequence[int], at: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(HEAD, TAIL)`` of a chain ``ops`` whose residual add is the empty slot ``at``: the slots before
    it, and those after it, each with the others emptied.  ValueError where slot ``at`` is not empty,
    or a step after it reads a chain value from before the residual (the tail starts from the sum)."""
    if not 0 <= at < len(ops) or ops[at] != 0:
        raise ValueError(f"the residual's slot {at} must be an empty slot of the chain {tuple(ops)}")
    for code in ops[at + 1:]:
        source = code // SOURCE_STRIDE - 1  # the slot whose input the step reads, -1 for none
        if 0 <= source <= at:
            raise ValueError(f"a step after the residual add reads the chain value before slot {source}")
    head = tuple(code if k < at else 0 for k, code in enumerate(ops))
    tail = tuple(code if k > at else 0 for k, code in enumerate(ops))
    return head, tail


#: ``epilogue_forward``'s launch plans by what they depend on (layouts, op codes, pool).
_FORWARD_LAUNCHES = PlanCache()


class ForwardLaunch:
    """``epilogue_forward`` for one signature (shapes, strides, dtypes, chain codes, bias presence,
    pool, which saved outputs): the arguments are checked and the launch worked out once (the
    tensors may be meta tensors); a call only launches (``FastLaunch``).

    ``__call__(y, params, bias, out, winner, winner_y, y_copy=None)`` takes tensors laid out like
    the constructor's (``params``: ``P`` as ``build_params`` gives it for the constructor's
    ``steps``; ``bias``: None without one, else its C values, contiguous).

    The tile follows the layouts: long along the contiguous axis when y and out share it, square
    (``tile_shape``'s transposing tile) when y's contiguous axis is the channels and out's the positions
    or the other way round (the channels-last library forward: cuDNN's channels-last conv output
    read coalesced along channels, an NCHW out written coalesced along positions).
    """

    def __init__(self, y: torch.Tensor, bias: torch.Tensor | None, steps: Sequence[KernelStep],
                 pool: PoolSpec | None, out: torch.Tensor, winner: torch.Tensor | None = None,
                 winner_y: torch.Tensor | None = None, y_copy: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, residual_at: int | None = None) -> None:  # fmt: skip
        if (residual is None) != (residual_at is None):
            raise ValueError("residual and residual_at go together")
        if (winner is None) != (winner_y is None):
            raise ValueError("winner and winner_y go together")
        if winner is not None and (pool is None or pool.kind != "max"):
            raise ValueError("winners are only saved for a max pool")
        if y_copy is not None and pool is not None:
            raise ValueError(f"y_copy is only written without a pool, got pool {pool}")
        save = winner is not None or y_copy is not None
        for name, t in (("winner", winner), ("winner_y", winner_y), ("y_copy", y_copy)):
            if t is not None and (t.shape != out.shape or t.stride() != out.stride()):
                raise ValueError(
                    f"{name} must have out's shape and strides {tuple(out.shape)}/{out.stride()}, got "
                    f"{tuple(t.shape)}/{t.stride()}"
                )
        if winner is not None and winner.dtype not in (torch.int8, torch.int32):
            raise ValueError(f"winner must be int8 or int32, got {winner.dtype}")
        y_sizes, y_strides = lift_5d(y)
        o_sizes, o_strides = lift_5d(out)
        channels = y_sizes[1]
        #: y is copied into out's (flattening) layout first
        self.copy_y = False
        if pool is None:
            if list(out.shape) != list(y.shape):
                raise ValueError(
                    f"without a pool out must have y's shape {tuple(y.shape)}, got {tuple(out.shape)}"
                )
            if not _spatial_flattens(o_sizes, o_strides):
                raise ValueError(f"out's spatial dims must flatten, got strides {out.stride()}")
            if not _spatial_flattens(y_sizes, y_strides):
                self.copy_y = True
                y_strides = lift_5d(torch.empty_like(out, dtype=y.dtype, device="meta"))[1]
        pool_geom = pool_geometry(pool, y.dim() - 2)
        ops = op_codes(steps)  # checks the op codes before anything is kept
        head, tail = ops, (0,) * len(ops)
        #: the residual is copied into out's (flattening) layout first
        self.copy_residual = False
        r_strides = (0, 0, 0)
        if residual is not None:
            head, tail = residual_split(ops, residual_at)
            if pool is not None or tuple(residual.shape) != tuple(out.shape):
                raise ValueError(f"a residual has out's shape {tuple(out.shape)} and no pool, got shape "
                                 f"{tuple(residual.shape)} and pool {pool}")  # fmt: skip
            r_sizes, r_lifted = lift_5d(residual)
            if not _spatial_flattens(r_sizes, r_lifted):
                self.copy_residual = True
                r_lifted = o_strides
            r_strides = (r_lifted[0], r_lifted[1], r_lifted[4])
        s_out = o_sizes[2] * o_sizes[3] * o_sizes[4]
        write_inner = channels_innermost(o_strides, o_sizes)
        read_inner = channels_innermost(y_strides, y_sizes)
        block_c, block_s = tile_shape(channels, s_out, write_inner, transposing=read_inner != write_inner)
        num_s_blocks = cdiv(s_out, block_s)
        grid = (y_sizes[0] * num_s_blocks, cdiv(channels, block_c))
        self.channels = channels
        self.save = save
        self.launch = None
        if out.numel() > 0:
            ints = (channels, *y_sizes[2:], *o_sizes[2:], num_s_blocks, *y_strides, *o_strides, *r_strides)
            self.launch = FastLaunch(_epilogue_fwd_kernel, grid, dict(
                OPS=ops, HEAD=head, TAIL=tail, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                POOL=pool_code(pool), POOL_GEOM=pool_geom, SAVE=save,
                BLOCK_C=block_c, BLOCK_S=block_s, num_warps=4,
            ), fixed=ints)  # fmt: skip

    def __call__(self, y: torch.Tensor, params: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                 winner: torch.Tensor | None = None, winner_y: torch.Tensor | None = None,
                 y_copy: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> None:  # fmt: skip
        if self.launch is None:
            return
        if self.copy_y:
            y = torch.empty_like(out, dtype=y.dtype).copy_(y)
        b = params if bias is None else bias  # (the bias pointer is not read without a bias)
        if residual is None:
            r = y  # (not read without a residual)
        else:
            r = torch.empty_like(out, dtype=residual.dtype).copy_(residual) if self.copy_residual else residual
        if not self.save:
            self.launch(y, params, b, r, out, out, out)
        elif y_copy is not None:  # (the winner pointer is not read without a pool)
            self.launch(y, params, b, r, out, out, y_copy)
        else:
            self.launch(y, params, b, r, out, winner, winner_y)


def epilogue_backward(
    grad_out: torch.Tensor,
    y: torch.Tensor | None,
    winner: torch.Tensor | None,
    winner_y: torch.Tensor | None,
    bias: torch.Tensor | None,
    steps: Sequence[KernelStep],
    pool: PoolSpec | None,
    grad_y: torch.Tensor,
    operand_grad_slots: Sequence[bool] = (),
    bias_grad: bool = False,
) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """Write the conv-output gradient into ``grad_y`` and return per-channel operand/bias grads.

    Args:
      grad_out: gradient of ``out`` (its shape, any strides, any float dtype).
      y: conv output without bias (no pool / avg pool), as given to ``epilogue_forward``; None with a
        max pool.
      winner, winner_y: max pool only: what ``epilogue_forward`` saved.
      bias, steps, pool: as given to ``epilogue_forward``.
      grad_y: preallocated (N, C, *spatial), y's shape (any strides whose spatial dims flatten
        without a pool: e.g. channels-last for an NCHW y, for a channels-last library backward),
        the conv output's dtype; receives the gradient of the conv output (bias included:
        d/d(y + bias)).
      operand_grad_slots: per slot, whether the gradient of its first operand is wanted (only the
        arithmetic ops mul/add/sub/rsub/div/rdiv have one).
      bias_grad: whether the bias gradient is wanted.
    Returns:
      ``(slot_grads, bias_grad)``: per slot, None or the fp32 (C,) per-channel sum of d out/d operand
      weighted by grad_out (the caller sums channels for scalar operands); the fp32 (C,) bias grad or
      None.  Sums are over fixed-order per-block partials, so they are bitwise reproducible.
    """
    parts = (
        grad_out, y, winner, winner_y, bias is None,
        step_codes(steps), pool, grad_y, tuple(map(bool, operand_grad_slots)),
        bool(bias_grad),
    )  # fmt: skip
    launch = _BACKWARD_LAUNCHES.plan(parts, lambda: BackwardLaunch(grad_out, y, winner, winner_y, bias, steps, pool, grad_y, operand_grad_slots, bias_grad)
    )
    params = build_params(steps, None, launch.channels, grad_y.device)
    return launch(grad_out, y, winner, winner_y, params, _flat_bias(bias), grad_y)


#: ``epilogue_backward``'s launch plans by what they depend on (layouts, op codes, pool, wanted
#: sums): a kept plan's ``FastLaunch`` skips Triton's generic launch path on later calls.
_BACKWARD_LAUNCHES = PlanCache()


class BackwardLaunch:
    """``epilogue_backward`` for one signature (shapes, strides, dtypes, chain codes, pool, wanted
    grads): the arguments are checked and the launch worked out once; a call only allocates the
    partial sums, launches (``FastLaunch``) and reduces them.

    ``__call__(grad_out, y, winner, winner_y, params, bias, grad_y)`` takes tensors like the
    constructor's (``params``: ``P`` as ``build_params`` gives it for the constructor's ``steps``;
    ``bias``: None without one, else its C values, contiguous) and returns what
    ``epilogue_backward`` returns.
    """

    def __init__(self, grad_out: torch.Tensor, y: torch.Tensor | None, winner: torch.Tensor | None,
                 winner_y: torch.Tensor | None, bias: torch.Tensor | None, steps: Sequence[KernelStep],
                 pool: PoolSpec | None, grad_y: torch.Tensor, operand_grad_slots: Sequence[bool] = (),
                 bias_grad: bool = False) -> None:  # fmt: skip
        if pool is not None and pool.kind == "max":
            if winner is None or winner_y is None:
                raise ValueError("a max pool's backward needs winner and winner_y")
            if winner.stride() != winner_y.stride():
                raise ValueError(f"winner/winner_y strides differ: {winner.stride()} vs {winner_y.stride()}")
        elif y is None:
            raise ValueError("y is required without a max pool")
        elif y.shape != grad_y.shape:
            raise ValueError(f"grad_y must have y's shape {tuple(y.shape)}, got {tuple(grad_y.shape)}")
        for slot, wanted in enumerate(operand_grad_slots):
            if wanted and int(steps[slot][0]) not in OPERAND_GRAD_CODES:
                raise ValueError(f"slot {slot} (op code {steps[slot][0]}) has no differentiable operand")
        gy_sizes, gy_strides = lift_5d(grad_y)
        #: y's strides (grad_y's where there is no y: a max pool loads no y)
        y_strides = lift_5d(y)[1] if y is not None else gy_strides
        g_sizes, g_strides = lift_5d(grad_out)
        n, channels = gy_sizes[:2]
        #: grad_out is copied into grad_y's (flattening) layout first
        self.copy_grad_out = False
        if pool is None:
            if list(grad_out.shape) != list(grad_y.shape):
                raise ValueError(
                    f"grad_out must have y's shape {tuple(grad_y.shape)}, got {tuple(grad_out.shape)}"
                )
            for name, strides in (("grad_y", gy_strides), ("y", y_strides)):
                if not _spatial_flattens(gy_sizes, strides):
                    raise ValueError(f"{name}'s spatial dims must flatten, got strides {tuple(strides[-grad_y.dim():])}")
            if not _spatial_flattens(g_sizes, g_strides):
                self.copy_grad_out = True
                g_sizes, g_strides = gy_sizes, gy_strides
        pool_geom = pool_geometry(pool, grad_y.dim() - 2)
        w_strides = lift_5d(winner)[1] if winner is not None else [0] * 5
        grad_mask = sum(1 << k for k, wanted in enumerate(operand_grad_slots) if wanted)
        if bias_grad:
            grad_mask |= 1 << MAX_SLOTS
        s_full = gy_sizes[2] * gy_sizes[3] * gy_sizes[4]
        read_inner = channels_innermost(y_strides, gy_sizes)  # grad_y's own where there is no y
        write_inner = channels_innermost(gy_strides, gy_sizes)
        block_c, block_s = tile_shape(channels, s_full, write_inner, transposing=read_inner != write_inner)
        num_s_blocks = cdiv(s_full, block_s)
        grid = (n * num_s_blocks, cdiv(channels, block_c))
        self.channels = channels
        self.partials_shape = (NUM_GRAD_ROWS, grid[0], channels)
        ints = (
            channels, *gy_sizes[2:], *g_sizes[2:], num_s_blocks, grid[0] * channels, *g_strides, *y_strides,
            *gy_strides, *w_strides,
        )  # fmt: skip
        self.launch = None
        if grad_y.numel() > 0:
            self.launch = FastLaunch(_epilogue_bwd_kernel, grid, dict(
                OPS=op_codes(steps), HAS_BIAS=bias is not None, POOL=pool_code(pool), POOL_GEOM=pool_geom,
                GRAD_MASK=grad_mask, BLOCK_C=block_c, BLOCK_S=block_s, num_warps=4,
            ), fixed=ints)  # fmt: skip
        self.slots = [k < len(operand_grad_slots) and bool(operand_grad_slots[k]) for k in range(len(steps))]
        self.bias_grad = bias_grad

    def __call__(self, grad_out: torch.Tensor, y: torch.Tensor | None, winner: torch.Tensor | None,
                 winner_y: torch.Tensor | None, params: torch.Tensor, bias: torch.Tensor | None,
                 grad_y: torch.Tensor) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:  # fmt: skip
        if self.copy_grad_out:
            grad_out = torch.empty_like(grad_y, dtype=grad_out.dtype).copy_(grad_out)
        partials = torch.empty(self.partials_shape, dtype=torch.float32, device=grad_y.device)
        if self.launch is not None:
            self.launch(
                grad_out, y if y is not None else grad_y, winner if winner is not None else grad_y,
                winner_y if winner_y is not None else grad_y, params, params if bias is None else bias, grad_y,
                partials,
            )  # fmt: skip
        else:
            partials.zero_()
        # NOTE: torch's reduction over a fixed shape runs in a fixed order (no atomics), so these
        # sums, like the in-kernel block sums, are bitwise reproducible.  One reduction per wanted
        # row: each result is its own tensor (a custom op's outputs must not alias each other).
        slot_grads = [partials[k].sum(0) if wanted else None for k, wanted in enumerate(self.slots)]
        return slot_grads, partials[MAX_SLOTS].sum(0) if self.bias_grad else None
