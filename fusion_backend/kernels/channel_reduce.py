"""Triton kernels for ``conv output -> pointwise pre-chain -> one reduction over the channels ->
pointwise post-chain``, forward and backward.

These kernels know only tensors, op codes and a reduction code; the fused op that calls them
(``fusion_backend.ops.conv_channel_reduce``) owns the configuration, the autograd wiring and the
fallback.

Reductions (``KIND``: ``reduction_kind.ReductionKind``), each over dim 1 with torch's semantics:

* ``min`` / ``max`` (``torch.min(y, 1)``): the value and the FIRST index holding it; a NaN in the
  column wins (the first NaN), as torch's kernels do.  ``amin`` / ``amax``: the same value; their
  backward splits the gradient evenly among the ties (``grad / count * (v == r)``, so a NaN column
  gets NaN gradients, as torch's formula gives).
* ``sum`` / ``mean``.
* ``logsumexp``: ``log(sum(exp(v - m'))) + m'`` with ``m'`` the column max, or 0 where it is
  infinite (torch's formula: an all ``-inf`` column gives ``-inf``, a ``+inf`` gives ``+inf``).
* ``softmax`` / ``log_softmax``: full-size results ``exp(v - m) / s`` / ``v - m - log(s)``; a column
  whose max is infinite is NaN throughout (as eager: ``inf - inf``), a NaN anywhere in a column makes
  it NaN throughout.

Data layout.  Tensors are seen as ``(N, C, S)`` with ``S`` the flattened spatial positions (every
conv output flattens: contiguous or channels-last); the kernels take element strides ``(sn, sc, ss)``.
The operand matrices are ``kernels/chain_math.py``'s: ``P`` ``(NUM_PARAM_ROWS, C)`` for the pre-chain
(row ``BIAS_ROW``: the conv bias) and ``Q`` ``(NUM_PARAM_ROWS, CQ)`` for the post-chain, ``CQ == C`` for
softmax / log_softmax (per-channel operands) and 1 for the reductions (one value).

Tiling.  A program owns ``BLOCK_S`` positions of one sample and every channel.  When the channels fit
the register budget (``ONE_BLOCK``: ``BLOCK_C = next_pow2(C)``) the conv output is read once and kept
in registers between the statistics and the write; otherwise the program loops over channel blocks
twice (statistics, then the write), re-reading the tile (from L2 at these tile sizes).

Saved state (forward with ``SAVE``; fp32 ``stats`` of shape ``(2, N, S)``, row stride ``st_row``):

=====================  ===============================  =====================================
kind                   stats row 0                      stats row 1 / index
=====================  ===============================  =====================================
min / max              r (the post-chain's input)       y + bias at the winner; index: int16/32
amin / amax            r                                number of ties ``v == r``
sum / mean / lse       r                                (unused)
softmax / log_softmax  m (column max, NaN ignored)      s = sum(exp(v - m'))
=====================  ===============================  =====================================

Backward reductions over positions (gradients of per-channel pre-chain operands; of post-chain
operands) are written as one partial sum per (program, channel) and summed afterwards in a fixed
order: bitwise reproducible, no atomics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .chain_math import (
    MAX_SLOTS,
    KernelStep,
    apply_chain_at,
    chain_forward,
    chain_grad_at,
    load_chain_operands,
    op_codes,
    step_codes,
)
from .host import cdiv, next_pow2
from .launch import FastLaunch
from .plan_cache import (
    ContractError,
    PlanCache,
    flat_strides,
    require_rows,
    require_same_device,
    spatial_flat_strides,
)
from .reduction_kind import (
    ReductionKind,
    backward_reads_y,
    is_extremum,
    is_full_size,
    is_kind,
    keeps_winner_index,
    splits_ties,
    sums_exponentials,
    sums_values,
    takes_minimum,
)

#: The reductions the launchers take, by torch's name, with the kernels' ``KIND`` codes.
REDUCTION_CODES = {kind.name.lower(): kind for kind in ReductionKind}
#: Largest ``next_pow2(C)`` held in registers at once (one read of the conv output); above it the
#: channels are walked in blocks of ``LOOP_BLOCK_C``, twice.
ONE_BLOCK_LIMIT = 256
LOOP_BLOCK_C = 128
#: Elements of a program's tile (``BLOCK_C * BLOCK_S``).
TILE_ELEMENTS = 4096
#: Most channels the kernels take (the winner index is int16 up to here; the pattern's limit).
MAX_CHANNELS = 1024
#: Rows of the pre-chain partial sums (one per slot) and of the post-chain ones.
PRE_GRAD_ROWS = MAX_SLOTS
POST_GRAD_ROWS = MAX_SLOTS


# --------------------------------------------------------------------------------------------------
# Device functions
# --------------------------------------------------------------------------------------------------


@triton.jit
def _safe(m):
    """torch.logsumexp's reference point: the max, or 0 where it is infinite."""
    return tl.where(tl.abs(m) == float("inf"), 0.0, m)


@triton.jit
def _load_pre(y_ptr, p_ptr, y_base, c, s64, valid, C, y_sc, y_ss, PRE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``(yb, v)`` at channels ``c`` ([BLOCK_C, 1]) and positions ``s64`` ([1, BLOCK_S]): the conv
    output plus bias (the bias rounded to y's dtype first, as the conv adds it) and the pre-chain's
    result, fp32.  Lanes outside ``valid`` hold garbage the callers mask."""
    cmask = c < C
    yb = tl.load(y_base + c.to(tl.int64) * y_sc + s64 * y_ss, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        yb = yb + tl.load(p_ptr + c, mask=cmask, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
    a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7 = load_chain_operands(
        p_ptr, c, C, cmask, PRE[0], PRE[1], PRE[2], PRE[3], PRE[4], PRE[5], PRE[6], PRE[7])  # fmt: skip
    v = chain_forward(yb, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
                      PRE[0], PRE[1], PRE[2], PRE[3], PRE[4], PRE[5], PRE[6], PRE[7])  # fmt: skip
    return yb, v


@triton.jit
def _block_stats(v, valid, KIND: tl.constexpr):
    """First-pass statistics of one channel block, per position: ``(m, s, nan)``.

    ``m``: the max of ``v`` (of ``-v`` for min / amin) over valid non-NaN lanes (``-inf`` if none);
    ``nan``: 1 where a valid lane is NaN.  ``s``: sum / mean: the sum; logsumexp / softmax /
    log_softmax: ``sum(exp(v - _safe(m)))`` (NaN lanes make it NaN); 0 otherwise."""
    nan = tl.max(tl.where(valid & (v != v), 1, 0), axis=0)
    w = v
    if takes_minimum(KIND):
        w = -v
    m = tl.max(tl.where(valid & (w == w), w, float("-inf")), axis=0)
    s = tl.zeros_like(m)
    if sums_values(KIND):
        s = tl.sum(tl.where(valid, v, 0.0), axis=0)
    elif sums_exponentials(KIND):
        s = tl.sum(tl.where(valid, tl.exp(v - _safe(m)[None, :]), 0.0), axis=0)
    return m, s, nan


@triton.jit
def _combine_stats(m, s, nan, m2, s2, nan2, KIND: tl.constexpr):
    """Two blocks' ``_block_stats`` as one (the online max; the sum rescaled to the new reference)."""
    big = tl.maximum(m, m2)
    if sums_values(KIND):
        s = s + s2
    elif sums_exponentials(KIND):
        s = s * tl.exp(_safe(m) - _safe(big)) + s2 * tl.exp(_safe(m2) - _safe(big))
    return big, s, tl.maximum(nan, nan2)


@triton.jit
def _reduced(m, s, nan, C, KIND: tl.constexpr):
    """The reduction's value per position from the statistics (extremum, sum, mean, logsumexp); for
    softmax / log_softmax ``m`` itself (unused)."""
    r = m
    if is_extremum(KIND):
        r = tl.where(nan > 0, float("nan"), m)
        if takes_minimum(KIND):
            r = -r
    elif is_kind(KIND, "SUM"):
        r = s
    elif is_kind(KIND, "MEAN"):
        r = s / C
    elif is_kind(KIND, "LOGSUMEXP"):
        r = tl.log(s) + _safe(m)
    return r


@triton.jit
def _softmax_value(v, m, s, KIND: tl.constexpr):
    """softmax or log_softmax of ``v`` given the column statistics; NaN throughout a column whose
    max is infinite (eager computes ``inf - inf`` there)."""
    inf_col = (tl.abs(m) == float("inf"))[None, :]
    if is_kind(KIND, "SOFTMAX"):
        out = tl.exp(v - m[None, :]) / s[None, :]
    else:
        out = v - m[None, :] - tl.log(s)[None, :]
    return tl.where(inf_col, float("nan"), out)


@triton.jit
def _program_positions(pid, num_s_blocks, S, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program ``pid``'s sample and positions over a grid of ``N * num_s_blocks``: ``(n64, s1,
    smask1, s, s64, cb)``: the sample (int64), its positions as a [BLOCK_S] row and their mask, the
    positions as a [1, BLOCK_S] row (and int64), the channel offsets of a block as a [BLOCK_C, 1]
    column."""
    n64 = (pid // num_s_blocks).to(tl.int64)
    s1 = (pid % num_s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
    s = s1[None, :]
    return n64, s1, s1 < S, s, s.to(tl.int64), tl.arange(0, BLOCK_C)[:, None]


@triton.jit
def _softmax_block_grad(y_ptr, p_ptr, q_ptr, gout_ptr, y_base, n64, c, s, s64, m, sm, C, S, CQ, y_sc, y_ss,
                        g_sn, g_sc, g_ss, PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr,
                        KIND: tl.constexpr):  # fmt: skip
    """For channels ``c`` of a softmax / log_softmax: ``(valid, yb, sv, gp, q0..q7)``: the lanes, the
    conv output plus bias, the softmax (log_softmax) value, the post-chain walked back from grad_out
    there and its operand gradients."""
    valid = (c < C) & (s < S)
    yb, v = _load_pre(y_ptr, p_ptr, y_base, c, s64, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
    sv = _softmax_value(v, m, sm, KIND)
    g = tl.load(gout_ptr + n64 * g_sn + c.to(tl.int64) * g_sc + s64 * g_ss, mask=valid, other=0.0)
    gp, q0, q1, q2, q3, q4, q5, q6, q7 = chain_grad_at(g.to(tl.float32), sv, q_ptr, c, CQ, c < CQ, POST)
    return valid, yb, sv, gp, q0, q1, q2, q3, q4, q5, q6, q7


@triton.jit
def _winner_block(v, yb, c, valid, r, nan, BIG: tl.constexpr):
    """For one block: the first channel holding ``r`` (the first NaN where the column has one; ``BIG``
    if none in the block), ``y + bias`` there, and the number of lanes equal to ``r``."""
    hit = valid & tl.where((nan > 0)[None, :], v != v, v == r[None, :])
    idx = tl.min(tl.where(hit, c, BIG), axis=0)
    yw = tl.sum(tl.where(c == idx[None, :], yb, 0.0), axis=0)
    ties = tl.sum(tl.where(valid & (v == r[None, :]), 1.0, 0.0), axis=0)
    return idx, yw, ties


@triton.jit
def _store_partials(part_ptr, row_stride, c1, pmask, ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7, keep,
                    MASK: tl.constexpr, AXIS: tl.constexpr):  # fmt: skip
    """Per wanted slot k (``MASK`` bit k) the sum over the tile's ``AXIS`` of its operand gradient
    (where ``keep``, which gives the tile's shape), stored at ``part_ptr + k * row_stride + c1``."""
    grads = (ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7)
    for k in tl.static_range(8):
        if ((MASK >> k) & 1) != 0:
            tl.store(part_ptr + k * row_stride + c1, tl.sum(tl.where(keep, grads[k], 0.0), axis=AXIS), mask=pmask)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _channel_reduce_fwd_kernel(
    y_ptr, p_ptr, q_ptr, out_ptr, idx_ptr, st_ptr,
    C, S, CQ, num_s_blocks,
    y_sn, y_sc, y_ss, o_sn, o_sc, o_ss, st_row, st_sn,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, KIND: tl.constexpr, SAVE: tl.constexpr,
    ONE_BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out = post(reduce_c(pre(y + bias))).

    Pointers (element strides; ``S`` flattened positions):
      y_ptr    conv output without bias, (N, C, S), fp32/fp16/bf16, strides ``y_s*``.
      p_ptr    pre-chain operand matrix P, (NUM_PARAM_ROWS, C) fp32 contiguous (row 0: bias).
      q_ptr    post-chain operand matrix Q, (NUM_PARAM_ROWS, CQ) fp32 contiguous.
      out_ptr  result, any float dtype: (N, S) for a reduction (``o_sc`` unused), (N, C, S) for
               softmax / log_softmax; strides ``o_s*``.
      idx_ptr  (SAVE, min / max) winner channel, (N, S) contiguous, int16 / int32.
      st_ptr   (SAVE) fp32 statistics (2, N, S): row stride ``st_row``, sample stride ``st_sn``,
               positions contiguous (module docstring's table).
    Grid: ``(N * num_s_blocks,)``; each program covers ``BLOCK_S`` positions and every channel.
    """
    pid = tl.program_id(0)
    n64, s1, smask1, s, s64, cb = _program_positions(pid, num_s_blocks, S, BLOCK_C, BLOCK_S)
    y_base = y_ptr + n64 * y_sn
    BIG: tl.constexpr = 1 << 30

    # 1. statistics over the channels
    if ONE_BLOCK:
        valid = (cb < C) & (s < S)
        yb, v = _load_pre(y_ptr, p_ptr, y_base, cb, s64, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
        m, sm, nan = _block_stats(v, valid, KIND)
    else:
        valid = (cb < C) & (s < S)
        yb, v = _load_pre(y_ptr, p_ptr, y_base, cb, s64, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
        m, sm, nan = _block_stats(v, valid, KIND)
        for c0 in range(BLOCK_C, C, BLOCK_C):
            c = c0 + cb
            valid = (c < C) & (s < S)
            yb, v = _load_pre(y_ptr, p_ptr, y_base, c, s64, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
            m2, sm2, nan2 = _block_stats(v, valid, KIND)
            m, sm, nan = _combine_stats(m, sm, nan, m2, sm2, nan2, KIND)
    r = _reduced(m, sm, nan, C, KIND)
    st_off = n64 * st_sn + s1.to(tl.int64)

    # 2. the result (and what the backward needs)
    if is_full_size(KIND):
        qmask_all = cb < CQ
        if ONE_BLOCK:
            out = apply_chain_at(_softmax_value(v, m, sm, KIND), q_ptr, cb, CQ, qmask_all, POST)
            o = out_ptr + n64 * o_sn + cb.to(tl.int64) * o_sc + s64 * o_ss
            tl.store(o, out.to(out_ptr.dtype.element_ty), mask=(cb < C) & (s < S))
        else:
            for c0 in range(0, C, BLOCK_C):
                c = c0 + cb
                valid = (c < C) & (s < S)
                yb, v = _load_pre(y_ptr, p_ptr, y_base, c, s64, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
                out = apply_chain_at(_softmax_value(v, m, sm, KIND), q_ptr, c, CQ, c < CQ, POST)
                o = out_ptr + n64 * o_sn + c.to(tl.int64) * o_sc + s64 * o_ss
                tl.store(o, out.to(out_ptr.dtype.element_ty), mask=valid)
        if SAVE:
            tl.store(st_ptr + st_off, m, mask=smask1)
            tl.store(st_ptr + st_row + st_off, sm, mask=smask1)
    else:
        cz = tl.zeros([BLOCK_S], tl.int32)
        out = apply_chain_at(r, q_ptr, cz, CQ, cz < CQ, POST)
        tl.store(out_ptr + n64 * o_sn + s1.to(tl.int64) * o_ss, out.to(out_ptr.dtype.element_ty), mask=smask1)
        if SAVE:
            tl.store(st_ptr + st_off, r, mask=smask1)
            if is_extremum(KIND):
                if ONE_BLOCK:
                    idx, yw, ties = _winner_block(v, yb, cb, valid, r, nan, BIG)
                else:
                    idx = tl.full([BLOCK_S], BIG, tl.int32)
                    yw = tl.zeros([BLOCK_S], tl.float32)
                    ties = tl.zeros([BLOCK_S], tl.float32)
                    for c0 in range(0, C, BLOCK_C):
                        c = c0 + cb
                        valid = (c < C) & (s < S)
                        yb, v = _load_pre(y_ptr, p_ptr, y_base, c, s64, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
                        idx2, yw2, ties2 = _winner_block(v, yb, c, valid, r, nan, BIG)
                        take = (idx == BIG) & (idx2 < BIG)
                        idx = tl.where(take, idx2, idx)
                        yw = tl.where(take, yw2, yw)
                        ties += ties2
                if keeps_winner_index(KIND):
                    tl.store(idx_ptr + st_off, idx.to(idx_ptr.dtype.element_ty), mask=smask1)
                    tl.store(st_ptr + st_row + st_off, yw, mask=smask1)
                else:
                    tl.store(st_ptr + st_row + st_off, ties, mask=smask1)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _grad_v(v, g, r, extra, c, C, KIND: tl.constexpr):
    """d out / d v for the extremum-free reductions and amin / amax, per element: ``g`` is the
    reduced value's gradient ([BLOCK_S]), ``r`` the reduced value, ``extra`` the ties (amin / amax)."""
    gb = g[None, :]
    if splits_ties(KIND):  # torch: grad / count * (v == r)
        gv = (gb / extra[None, :]) * tl.where(v == r[None, :], 1.0, 0.0)
    elif is_kind(KIND, "SUM"):
        gv = gb + tl.zeros_like(v)
    elif is_kind(KIND, "MEAN"):
        gv = gb / C + tl.zeros_like(v)
    else:  # logsumexp: grad * exp(v - r)
        gv = gb * tl.exp(v - r[None, :])
    return gv


@triton.jit
def _channel_reduce_bwd_kernel(
    gout_ptr, y_ptr, idx_ptr, st_ptr, p_ptr, q_ptr, gy_ptr, part_ptr, qpart_ptr,
    C, S, CQ, num_s_blocks, part_row, qpart_row,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, gy_sn, gy_sc, gy_ss, st_row, st_sn,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, KIND: tl.constexpr,
    PRE_MASK: tl.constexpr, POST_MASK: tl.constexpr, NEEDS_Y: tl.constexpr,
    ONE_BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """grad_y (the gradient of the conv output, bias included, full size) and partial sums of the
    operand gradients.

    Pointers (element strides; ``S`` flattened positions):
      gout_ptr  gradient of the op's output, out's shape as (N, S) or (N, C, S), any float dtype,
                strides ``g_s*`` (any, expanded included).
      y_ptr     (NEEDS_Y) conv output without bias, (N, C, S), strides ``y_s*``.
      idx_ptr   (min / max) winner channel, (N, S) contiguous.
      st_ptr    the forward's fp32 statistics (2, N, S), strides ``st_row``, ``st_sn``, 1.
      p_ptr, q_ptr  the forward's operand matrices.
      gy_ptr    output: grad of the conv output, (N, C, S), strides ``gy_s*``, the conv's dtype.
      part_ptr  output: fp32 (PRE_GRAD_ROWS, programs, C), row stride ``part_row``: per program and
                channel the sum over its positions of d/d(first operand of pre-chain slot k); only
                the rows of ``PRE_MASK``'s bits.
      qpart_ptr output: fp32 (POST_GRAD_ROWS, programs, CQ), row stride ``qpart_row``: the same for
                the post-chain's slots (``POST_MASK``); CQ == 1 after a reduction.
    Without ``NEEDS_Y`` (min / max; sum / mean without a pre-chain) y is not read: min / max
    differentiate the pre-chain at the saved winner value only and write 0 elsewhere (eager gives
    0 * chain'(y) there, which differs only where that derivative is not finite).
    """
    pid = tl.program_id(0)
    n64, s1, smask1, s, s64, cb = _program_positions(pid, num_s_blocks, S, BLOCK_C, BLOCK_S)
    y_base = y_ptr + n64 * y_sn
    st_off = n64 * st_sn + s1.to(tl.int64)
    part = part_ptr + pid.to(tl.int64) * C
    qpart = qpart_ptr + pid.to(tl.int64) * CQ

    if not is_full_size(KIND):
        # d out / d r through the post-chain, and the post operands' grads (one value each)
        g = tl.load(gout_ptr + n64 * g_sn + s1.to(tl.int64) * g_ss, mask=smask1, other=0.0).to(tl.float32)
        r = tl.load(st_ptr + st_off, mask=smask1, other=1.0)
        cz = tl.zeros([BLOCK_S], tl.int32)
        gr, q0, q1, q2, q3, q4, q5, q6, q7 = chain_grad_at(g, r, q_ptr, cz, CQ, cz < CQ, POST)
        if POST_MASK != 0:
            z = tl.arange(0, 1)
            _store_partials(qpart, qpart_row, z, z < 1, q0, q1, q2, q3, q4, q5, q6, q7, smask1[None, :], POST_MASK, 1)
        extra = tl.load(st_ptr + st_row + st_off, mask=smask1, other=1.0)
        if keeps_winner_index(KIND):
            idx = tl.load(idx_ptr + st_off, mask=smask1, other=0).to(tl.int32)
            cz = tl.zeros([BLOCK_S], tl.int32)
            # the pre-chain differentiated at the winner (y + bias there is ``extra``), per position
            gw, w0, w1, w2, w3, w4, w5, w6, w7 = _chain_grad_at_winner(gr, extra, p_ptr, idx, C, smask1, PRE)
            for c0 in range(0, C, BLOCK_C):
                c = c0 + cb
                valid = (c < C) & (s < S)
                won = valid & (c == idx[None, :])
                gy = tl.where(won, gw, 0.0)
                tl.store(gy_ptr + n64 * gy_sn + c.to(tl.int64) * gy_sc + s64 * gy_ss,
                         gy.to(gy_ptr.dtype.element_ty), mask=valid)  # fmt: skip
                if PRE_MASK != 0:
                    c1 = c0 + tl.arange(0, BLOCK_C)
                    _store_partials(part, part_row, c1, c1 < C, w0, w1, w2, w3, w4, w5, w6, w7, won, PRE_MASK, 1)
        else:
            for c0 in range(0, C, BLOCK_C):
                c = c0 + cb
                cmask = c < C
                valid = cmask & (s < S)
                if NEEDS_Y:
                    yb, v = _load_pre(y_ptr, p_ptr, y_base, c, s64, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
                else:
                    yb = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
                    v = yb
                gv = _grad_v(v, gr, r, extra, c, C, KIND)
                gy, a0, a1, a2, a3, a4, a5, a6, a7 = chain_grad_at(gv, yb, p_ptr, c, C, cmask, PRE)
                tl.store(gy_ptr + n64 * gy_sn + c.to(tl.int64) * gy_sc + s64 * gy_ss,
                         gy.to(gy_ptr.dtype.element_ty), mask=valid)  # fmt: skip
                if PRE_MASK != 0:
                    c1 = c0 + tl.arange(0, BLOCK_C)
                    _store_partials(part, part_row, c1, c1 < C, a0, a1, a2, a3, a4, a5, a6, a7, valid, PRE_MASK, 1)
    else:
        m = tl.load(st_ptr + st_off, mask=smask1, other=0.0)
        sm = tl.load(st_ptr + st_row + st_off, mask=smask1, other=1.0)
        # pass 1: the post-chain's gradient at each output and its sum over the channels
        if ONE_BLOCK:
            valid, yb, sv, gp, q0, q1, q2, q3, q4, q5, q6, q7 = _softmax_block_grad(
                y_ptr, p_ptr, q_ptr, gout_ptr, y_base, n64, cb, s, s64, m, sm, C, S, CQ, y_sc, y_ss, g_sn, g_sc, g_ss,
                PRE, POST, HAS_BIAS, KIND)  # fmt: skip
            if is_kind(KIND, "SOFTMAX"):
                dot = tl.sum(tl.where(valid, gp * sv, 0.0), axis=0)
            else:
                dot = tl.sum(tl.where(valid, gp, 0.0), axis=0)
        else:
            dot = tl.zeros([BLOCK_S], tl.float32)
            for c0 in range(0, C, BLOCK_C):
                valid, yb, sv, gp, q0, q1, q2, q3, q4, q5, q6, q7 = _softmax_block_grad(
                    y_ptr, p_ptr, q_ptr, gout_ptr, y_base, n64, c0 + cb, s, s64, m, sm, C, S, CQ, y_sc, y_ss, g_sn,
                    g_sc, g_ss, PRE, POST, HAS_BIAS, KIND)  # fmt: skip
                if is_kind(KIND, "SOFTMAX"):
                    dot += tl.sum(tl.where(valid, gp * sv, 0.0), axis=0)
                else:
                    dot += tl.sum(tl.where(valid, gp, 0.0), axis=0)
        # pass 2: softmax' / log_softmax', then the pre-chain
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cb
            cmask = c < C
            valid = cmask & (s < S)
            if not ONE_BLOCK:
                valid, yb, sv, gp, q0, q1, q2, q3, q4, q5, q6, q7 = _softmax_block_grad(
                    y_ptr, p_ptr, q_ptr, gout_ptr, y_base, n64, c, s, s64, m, sm, C, S, CQ, y_sc, y_ss, g_sn, g_sc,
                    g_ss, PRE, POST, HAS_BIAS, KIND)  # fmt: skip
            if is_kind(KIND, "SOFTMAX"):  # torch: out * (grad - sum(grad * out))
                gv = sv * (gp - dot[None, :])
            else:  # torch: grad - exp(out) * sum(grad)
                gv = gp - tl.exp(sv) * dot[None, :]
            gy, a0, a1, a2, a3, a4, a5, a6, a7 = chain_grad_at(gv, yb, p_ptr, c, C, cmask, PRE)
            tl.store(gy_ptr + n64 * gy_sn + c.to(tl.int64) * gy_sc + s64 * gy_ss,
                     gy.to(gy_ptr.dtype.element_ty), mask=valid)  # fmt: skip
            c1 = c0 + tl.arange(0, BLOCK_C)
            if PRE_MASK != 0:
                _store_partials(part, part_row, c1, c1 < C, a0, a1, a2, a3, a4, a5, a6, a7, valid, PRE_MASK, 1)
            if POST_MASK != 0:
                _store_partials(qpart, qpart_row, c1, c1 < CQ, q0, q1, q2, q3, q4, q5, q6, q7, valid, POST_MASK, 1)


@triton.jit
def _chain_grad_at_winner(g, yw, p_ptr, idx, C, smask, PRE: tl.constexpr):
    """The pre-chain walked back from ``g`` at ``yw`` (y + bias at the winner), with each position's
    operands read at its winning channel ``idx`` ([BLOCK_S])."""
    return chain_grad_at(g, yw, p_ptr, idx, C, smask & (idx < C), PRE)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _tile(channels: int, positions: int) -> tuple[bool, int, int]:
    """``(ONE_BLOCK, BLOCK_C, BLOCK_S)``: every channel in registers while ``next_pow2(C)`` is at most
    ``ONE_BLOCK_LIMIT``, else blocks of ``LOOP_BLOCK_C``; ``BLOCK_S`` fills ``TILE_ELEMENTS``."""
    c_pow = next_pow2(channels)
    one = c_pow <= ONE_BLOCK_LIMIT
    block_c = c_pow if one else LOOP_BLOCK_C
    block_s = max(1, min(next_pow2(max(positions, 1)), TILE_ELEMENTS // block_c))
    return one, block_c, block_s


def _reduced_flat(t: torch.Tensor) -> tuple[int, int, int]:
    """``(sn, 0, ss)`` of a reduced tensor, (N, *spatial) or (N, 1, *spatial), seen as (N, S)."""
    lifted = t if t.dim() >= 3 and t.shape[1] == 1 else t.unsqueeze(1)
    sn, _, ss = flat_strides("the reduced tensor", lifted)
    return sn, 0, ss


def _check_stats(stats: torch.Tensor, n: int) -> None:
    """The saved statistics' contract: contiguous fp32 (2, N, *spatial) (the kernels address a row
    and a sample by stride, the positions as one contiguous axis)."""
    if tuple(stats.shape[:2]) != (2, n) or not stats.is_contiguous() or stats.dtype != torch.float32:
        raise ContractError(f"stats must be contiguous fp32 (2, N, *spatial), got {tuple(stats.shape)} {stats.dtype}")


#: Launch plans by what they depend on (shapes, strides, dtypes, op codes, kind, wanted outputs).
_FORWARD_LAUNCHES = PlanCache()
_BACKWARD_LAUNCHES = PlanCache()


def channel_reduce_forward(
    y: torch.Tensor, has_bias: bool, pre: Sequence[KernelStep], post: Sequence[KernelStep], kind: str,
    params: torch.Tensor, post_params: torch.Tensor, out: torch.Tensor, index: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write ``out = post(reduce(pre(y + bias)))`` (and with ``stats`` the saved state) in one launch.

    Args:
      y: conv output without bias, (N, C, *spatial) with 1-3 spatial dims that flatten (contiguous or
        channels-last), fp32/fp16/bf16, C <= ``MAX_CHANNELS``.
      has_bias: whether ``params``' bias row holds a bias.
      pre, post: the chains as ``(op code, operand values)`` (values only decide the op codes here).
      kind: a key of ``REDUCTION_CODES``.
      params: P, fp32 (NUM_PARAM_ROWS, C) contiguous (``kernels.epilogue.build_params``).
      post_params: Q, fp32 (NUM_PARAM_ROWS, CQ) contiguous; CQ = C for softmax / log_softmax, 1 else.
      out: preallocated: y's shape for softmax / log_softmax (spatial dims flatten), else (N, *spatial)
        or (N, 1, *spatial); any float dtype.
      index: (min / max, with stats) preallocated (N, *spatial) contiguous int16 / int32.
      stats: None, or preallocated fp32 (2, N, *spatial) contiguous (module docstring's table).
    """
    launch = _FORWARD_LAUNCHES.plan(
        (y, has_bias, step_codes(pre), step_codes(post), kind, params, post_params, out, index, stats),
        lambda: _ForwardLaunch(y, has_bias, pre, post, kind, params, post_params, out, index, stats))
    launch(y, params, post_params, out, index, stats)


class _ForwardLaunch:
    """``channel_reduce_forward`` for one signature: arguments checked and the launch worked out once."""

    def __init__(self, y: torch.Tensor, has_bias: bool, pre: Sequence[KernelStep], post: Sequence[KernelStep],
                 kind: str, params: torch.Tensor, post_params: torch.Tensor, out: torch.Tensor,
                 index: torch.Tensor | None, stats: torch.Tensor | None) -> None:  # fmt: skip
        code = ReductionKind.named(kind)
        if not 3 <= y.dim() <= 5:
            raise ValueError(f"y must be (N, C, *spatial) with 1-3 spatial dims, got {tuple(y.shape)}")
        n, channels = y.shape[:2]
        if channels > MAX_CHANNELS:
            raise ValueError(f"at most {MAX_CHANNELS} channels, got {channels}")
        require_same_device(y.device, params=params, post_params=post_params, out=out, index=index, stats=stats)
        positions = y[0, 0].numel()
        y_flat = flat_strides("y", y)
        full_size = is_full_size(code)
        if full_size:
            if out.shape != y.shape:
                raise ContractError(f"out must have y's shape {tuple(y.shape)}, got {tuple(out.shape)}")
            o_flat = flat_strides("out", out)
        else:
            if out.numel() != n * positions:
                raise ContractError(f"out must hold N x spatial = {n * positions} values, got {tuple(out.shape)}")
            o_flat = _reduced_flat(out)
        require_rows("P", params, channels)
        cq = post_params.shape[1]
        if cq != (channels if full_size else 1):
            raise ContractError(f"Q must have {channels if full_size else 1} columns, got {cq}")
        require_rows("Q", post_params, cq)
        needs_index = stats is not None and keeps_winner_index(code)
        if needs_index and (index is None or index.dtype not in (torch.int16, torch.int32) or not index.is_contiguous()):
            raise ContractError("min / max with stats need a contiguous int16 / int32 index")
        if stats is not None:
            _check_stats(stats, n)
        one, block_c, block_s = _tile(channels, positions)
        num_s_blocks = cdiv(positions, block_s)
        self.needs_index = needs_index
        self.save = stats is not None
        self.launch = None
        if out.numel() > 0:
            st_row, st_sn = (stats.stride(0), stats.stride(1)) if stats is not None else (0, 0)
            ints = (channels, positions, cq, num_s_blocks, *y_flat, *o_flat, st_row, st_sn)
            self.launch = FastLaunch(_channel_reduce_fwd_kernel, (n * num_s_blocks,), dict(
                PRE=op_codes(pre), POST=op_codes(post), HAS_BIAS=has_bias, KIND=int(code), SAVE=self.save,
                ONE_BLOCK=one, BLOCK_C=block_c, BLOCK_S=block_s, num_warps=8 if block_c * block_s >= 2048 else 4,
            ), fixed=ints)  # fmt: skip

    def __call__(self, y, params, post_params, out, index, stats) -> None:
        if self.launch is None:
            return
        self.launch(y, params, post_params, out, index if self.needs_index else out,
                    stats if self.save else params)  # fmt: skip


def channel_reduce_backward(
    grad_out: torch.Tensor, y: torch.Tensor | None, index: torch.Tensor | None, stats: torch.Tensor,
    has_bias: bool, pre: Sequence[KernelStep], post: Sequence[KernelStep], kind: str, params: torch.Tensor,
    post_params: torch.Tensor, grad_y: torch.Tensor, pre_grad_slots: Sequence[bool] = (),
    post_grad_slots: Sequence[bool] = (),
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:  # fmt: skip
    """Write the conv-output gradient into ``grad_y``; return the operand gradients' per-channel sums.

    Args:
      grad_out: gradient of ``out`` (its shape, any strides, any float dtype).
      y: the conv output without bias as given to the forward; None where the backward needs none
        (min / max; sum / mean without a pre-chain).
      index, stats: the forward's saved state.
      has_bias, pre, post, kind, params, post_params: as given to the forward.
      grad_y: preallocated (N, C, *spatial), spatial dims flattening, the conv output's dtype.
      pre_grad_slots / post_grad_slots: per slot of each chain, whether its first operand's gradient
        is wanted.
    Returns:
      ``(pre_sums, post_sums)``: per slot, None or the fp32 per-channel sum (C,) (pre-chain; CQ values
      for the post-chain) of d out / d operand weighted by grad_out, summed over fixed-order partials.
    """
    launch = _BACKWARD_LAUNCHES.plan(
        (grad_out, y, index, stats, has_bias, step_codes(pre), step_codes(post), kind, post_params, grad_y,
         tuple(map(bool, pre_grad_slots)), tuple(map(bool, post_grad_slots))),
        lambda: _BackwardLaunch(grad_out, y, index, stats, has_bias, pre, post, kind, post_params, grad_y,
                                pre_grad_slots, post_grad_slots))  # fmt: skip
    return launch(grad_out, y, index, stats, params, post_params, grad_y)


class _BackwardLaunch:
    """``channel_reduce_backward`` for one signature: arguments checked and the launch worked out once."""

    def __init__(self, grad_out, y, index, stats, has_bias, pre, post, kind, post_params, grad_y,
                 pre_grad_slots, post_grad_slots) -> None:  # fmt: skip
        code = ReductionKind.named(kind)
        n, channels = grad_y.shape[:2]
        positions = grad_y[0, 0].numel()
        needs_y = backward_reads_y(code, len(pre) > 0)
        if needs_y and y is None:
            raise ValueError(f"the {kind} backward needs y")
        if keeps_winner_index(code) and index is None:
            raise ValueError(f"the {kind} backward needs the winner index")
        require_same_device(grad_y.device, grad_out=grad_out, y=y, index=index, stats=stats, post_params=post_params)
        _check_stats(stats, n)
        gy_flat = flat_strides("grad_y", grad_y)
        y_flat = flat_strides("y", y) if needs_y else gy_flat
        self.copy_grad_out = False
        if is_full_size(code):
            g_flat = spatial_flat_strides(grad_out)
            if g_flat is None:
                self.copy_grad_out, g_flat = True, gy_flat
        else:
            lifted = grad_out if grad_out.dim() == grad_y.dim() else grad_out.unsqueeze(1)
            g_flat = spatial_flat_strides(lifted)
            if g_flat is None:
                self.copy_grad_out, g_flat = True, (positions, 0, 1)
            g_flat = (g_flat[0], 0, g_flat[2])
        cq = post_params.shape[1]
        one, block_c, block_s = _tile(channels, positions)
        num_s_blocks = cdiv(positions, block_s)
        programs = n * num_s_blocks
        self.pre_slots = [k < len(pre_grad_slots) and bool(pre_grad_slots[k]) for k in range(len(pre))]
        self.post_slots = [k < len(post_grad_slots) and bool(post_grad_slots[k]) for k in range(len(post))]
        pre_mask = sum(1 << k for k, w in enumerate(self.pre_slots) if w)
        post_mask = sum(1 << k for k, w in enumerate(self.post_slots) if w)
        self.part_shape = (PRE_GRAD_ROWS, programs, channels)
        self.qpart_shape = (POST_GRAD_ROWS, programs, cq)
        self.needs_y, self.has_index = needs_y, keeps_winner_index(code)
        self.launch = None
        if grad_y.numel() > 0:
            ints = (channels, positions, cq, num_s_blocks, programs * channels, programs * cq, *g_flat, *y_flat,
                    *gy_flat, stats.stride(0), stats.stride(1))  # fmt: skip
            self.launch = FastLaunch(_channel_reduce_bwd_kernel, (programs,), dict(
                PRE=op_codes(pre), POST=op_codes(post), HAS_BIAS=has_bias, KIND=int(code), PRE_MASK=pre_mask,
                POST_MASK=post_mask, NEEDS_Y=needs_y, ONE_BLOCK=one, BLOCK_C=block_c, BLOCK_S=block_s,
                num_warps=8 if block_c * block_s >= 2048 else 4,
            ), fixed=ints)  # fmt: skip

    def __call__(self, grad_out, y, index, stats, params, post_params, grad_y):
        if self.copy_grad_out:
            grad_out = grad_out.contiguous()
        wanted_pre, wanted_post = any(self.pre_slots), any(self.post_slots)
        part = torch.zeros(self.part_shape if wanted_pre else (1,), dtype=torch.float32, device=grad_y.device)
        qpart = torch.zeros(self.qpart_shape if wanted_post else (1,), dtype=torch.float32, device=grad_y.device)
        if self.launch is not None:
            self.launch(grad_out, y if self.needs_y else grad_y, index if self.has_index else stats, stats, params,
                        post_params, grad_y, part, qpart)  # fmt: skip
        # NOTE: torch's reduction over a fixed shape runs in a fixed order: bitwise reproducible sums.
        pre_sums = [part[k].sum(0) if w else None for k, w in enumerate(self.pre_slots)]
        post_sums = [qpart[k].sum(0) if w else None for k, w in enumerate(self.post_slots)]
        return pre_sums, post_sums
