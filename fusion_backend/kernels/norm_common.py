"""What the normalization kernels share (``group_norm``, ``layer_norm``): reading a tile of the conv
output through the pre-chain, the numerically sound statistics of a chunk of a row (per-tile exact
two-pass statistics merged with Chan's formula) and the fixed-order combine of several chunks'
statistics, the per-channel partial sums of operand gradients, and the (N, C, S) view of a conv
output.

Data layout.  A conv output is seen as ``(N, C, S)`` with ``S`` the flattened spatial positions
(every conv output flattens: contiguous or channels-last), addressed by element strides ``(sn, sc,
ss)`` (``flat_strides``).  A *row* (a group of a group norm, a row of a layer norm) is a block of
``RC`` consecutive channels by a range of positions of one sample; the device functions take the
sample's base pointer ``y_base``, the channels ``c`` ([BLOCK_C, 1] or any shape broadcasting against
the positions) and positions ``s``.  Operand matrices are ``kernels/chain_math.py``'s: ``P``
``(NUM_PARAM_ROWS, C)`` fp32 for the pre-chain (row ``BIAS_ROW``: the conv bias).  All arithmetic is
fp32.

Chunk statistics.  ``chunk_moments`` returns a chunk's ``(shift, mean, m2, count)``: all values less
``shift`` (the mean of the chunk's first tile: values far from zero keep the digits of their
spread), each tile's exact two-pass mean and sum of squared deviations merged into the running ones
with Chan's parallel formula (no ``E[x^2] - E[x]^2`` cancellation).  ``combined_moments`` merges the
``split`` chunks of one row kept in a fp32 ``(rows, split, 3)`` workspace with the same
decomposition, ``M2 = sum_k M2_k + sum_k n_k (r_k - mean)^2``, each chunk's mean taken relative to
chunk 0's shift as ``r_k = (shift_k - shift_0) + mean_k`` (the shifts of one row are close, so
their difference is exact).  Every sum has a fixed order: results are bitwise reproducible.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .chain_math import apply_chain_at
from .host import cdiv

#: Programs a split aims at per multiprocessor (``chunk_positions``): several resident programs per
#: SM keep loads in flight on these memory-bound walks.  NOTE: chosen by reasoning, not yet timed.
PROGRAMS_PER_SM = 8
#: Fewest elements a chunk of a split row holds (``chunk_positions``): a chunk's program also pays
#: for its start (the combine of its row's partials, its first tile read twice), which a walk of
#: two or more tiles amortises.  NOTE: chosen by reasoning, not yet timed.
MIN_CHUNK_ELEMENTS = 4096


@triton.jit
def tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``(yb, v)`` at channels ``c`` and positions ``s`` (shapes broadcasting to the tile's): the conv
    output plus bias (the bias rounded to y's dtype first, as the conv adds it) and the pre-chain's
    result, fp32.  Lanes outside ``valid`` hold values the callers mask."""
    cmask = c < C
    yb = tl.load(y_base + c.to(tl.int64) * y_sc + s.to(tl.int64) * y_ss, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        yb = yb + tl.load(p_ptr + c, mask=cmask, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
    return yb, apply_chain_at(yb, p_ptr, c, C, cmask, PRE)


@triton.jit
def accumulate(acc, ga, keep, WANT: tl.constexpr):
    """``acc`` ([BLOCK_C]) plus the per-channel sum of ``ga`` over the tile's positions where ``keep``."""
    if WANT:
        acc += tl.sum(tl.where(keep, ga, 0.0), axis=1)
    return acc


@triton.jit
def accumulate_lanes(acc, ga, keep, WANT: tl.constexpr):
    """``acc`` (the tile's shape) plus ``ga`` where ``keep``: per-lane sums that a walk reduces across
    its lanes once, at its end (a reduction per tile costs the lanes' exchange on every tile)."""
    if WANT:
        acc += tl.where(keep, ga, 0.0)
    return acc


@triton.jit
def _accumulate_slot(acc, ga, keep, WANT: tl.constexpr, LANES: tl.constexpr):
    """``accumulate_lanes`` with ``LANES``, else ``accumulate``."""
    if LANES:
        acc = accumulate_lanes(acc, ga, keep, WANT)
    else:
        acc = accumulate(acc, ga, keep, WANT)
    return acc


@triton.jit
def accumulate_slots(p0, p1, p2, p3, p4, p5, p6, p7, a0, a1, a2, a3, a4, a5, a6, a7, keep, MASK: tl.constexpr,
                     LANES: tl.constexpr):  # fmt: skip
    """The eight slots' sums ``p0..p7`` plus their values ``a0..a7`` where ``keep``, for each slot wanted
    (``MASK`` bit k): per lane (``LANES``: ``accumulate_lanes``) or per channel (``accumulate``)."""
    p0 = _accumulate_slot(p0, a0, keep, (MASK & 1) != 0, LANES)
    p1 = _accumulate_slot(p1, a1, keep, (MASK & 2) != 0, LANES)
    p2 = _accumulate_slot(p2, a2, keep, (MASK & 4) != 0, LANES)
    p3 = _accumulate_slot(p3, a3, keep, (MASK & 8) != 0, LANES)
    p4 = _accumulate_slot(p4, a4, keep, (MASK & 16) != 0, LANES)
    p5 = _accumulate_slot(p5, a5, keep, (MASK & 32) != 0, LANES)
    p6 = _accumulate_slot(p6, a6, keep, (MASK & 64) != 0, LANES)
    p7 = _accumulate_slot(p7, a7, keep, (MASK & 128) != 0, LANES)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def store_rows(ptr, row_stride, c1, cmask, r0, r1, r2, r3, r4, r5, r6, r7, MASK: tl.constexpr,
               LANES: tl.constexpr = False):  # fmt: skip
    """Row ``k`` of a partial-sum buffer at offsets ``c1`` for every wanted slot ``k`` (``MASK`` bit k);
    with ``LANES`` the rows are per-lane sums (``[BLOCK_C, BLOCK_S]``), summed over their positions first."""
    rows = (r0, r1, r2, r3, r4, r5, r6, r7)
    for k in tl.static_range(8):
        if ((MASK >> k) & 1) != 0:
            if LANES:
                tl.store(ptr + k * row_stride + c1, tl.sum(rows[k], axis=1), mask=cmask)
            else:
                tl.store(ptr + k * row_stride + c1, rows[k], mask=cmask)


@triton.jit
def chunk_moments(y_ptr, p_ptr, y_base, c_first, s_lo, s_hi, C, CG, y_sc, y_ss, PRE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """``(shift, mean, m2, count)`` of ``v`` over channels ``c_first + [0, CG)`` and positions
    ``[s_lo, s_hi)`` (not empty): ``shift`` the mean of the chunk's first tile, ``mean`` the mean of
    ``v - shift``, ``m2`` the sum of squared deviations from it, ``count`` the number of values.
    Tiles' exact two-pass statistics merged with Chan's formula, in a fixed order."""
    cb = tl.arange(0, BLOCK_C)[:, None]
    sb = tl.arange(0, BLOCK_S)[None, :]
    first = (cb < CG) & (s_lo + sb < s_hi)
    _, v = tile_values(y_ptr, p_ptr, y_base, c_first + cb, s_lo + sb, first, C, y_sc, y_ss, PRE, HAS_BIAS)
    shift = tl.sum(tl.sum(tl.where(first, v, 0.0), axis=1), axis=0) / tl.sum(tl.sum(first.to(tl.float32), axis=1), axis=0)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for c0 in range(0, CG, BLOCK_C):
        c = c_first + c0 + cb
        for s0 in range(s_lo, s_hi, BLOCK_S):
            s = s0 + sb
            valid = (c0 + cb < CG) & (s < s_hi)
            _, v = tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
            v = v - shift
            n_t = tl.sum(tl.sum(valid.to(tl.float32), axis=1), axis=0)
            mean_t = tl.sum(tl.sum(tl.where(valid, v, 0.0), axis=1), axis=0) / n_t
            d = tl.where(valid, v - mean_t, 0.0)
            m2_t = tl.sum(tl.sum(d * d, axis=1), axis=0)
            total = count + n_t
            delta = mean_t - mean
            mean = mean + delta * (n_t / total)
            m2 = m2 + m2_t + delta * delta * (count * n_t / total)
            count = total
    return shift, mean, m2, count


@triton.jit
def combined_moments(ws_ptr, pid, split, CG, S, CHUNK, SPLIT_P2: tl.constexpr):
    """``(mean, var)`` of row ``pid`` (``CG`` channels by ``S`` positions) from its ``split`` chunks'
    ``(shift, mean, m2)`` in the forward workspace (chunk ``k``: positions ``k * CHUNK + [0, CHUNK)``
    of the row, clipped to ``S``): ``M2 = sum M2_k + sum n_k (r_k - mean)^2`` with ``r_k = (shift_k -
    shift_0) + mean_k``, every sum a fixed-shape reduction over ``SPLIT_P2`` lanes."""
    k = tl.arange(0, SPLIT_P2)
    live = k < split
    w = ws_ptr + (pid * split + k) * 3
    shift = tl.load(w, mask=live, other=0.0)
    shift0 = tl.load(ws_ptr + pid * split * 3)
    r = tl.where(live, (shift - shift0) + tl.load(w + 1, mask=live, other=0.0), 0.0)
    n_k = tl.where(live, (CG * (tl.minimum(S, (k + 1) * CHUNK) - k * CHUNK)).to(tl.float32), 0.0)
    count = tl.sum(n_k, axis=0)
    mean = tl.sum(n_k * r, axis=0) / count
    d = r - mean
    m2 = tl.sum(tl.load(w + 2, mask=live, other=0.0), axis=0) + tl.sum(n_k * d * d, axis=0)
    return mean + shift0, m2 / count


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA ``device``; 0 for any other (no GPU: the interpreter runs programs
    one after another, so a split buys nothing)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def chunk_positions(rows_total: int, row_channels: int, positions: int, block_s: int, sms: int) -> int:
    """Positions per chunk of a row of ``row_channels`` channels by ``positions`` positions (the
    kernels' ``CHUNK``; ``SPLIT = cdiv(positions, CHUNK)``).

    ``positions`` (one chunk: the one-launch path) when ``sms`` is 0 (no GPU: the interpreter runs
    programs one after another, so a split buys nothing), when the ``rows_total`` rows alone give
    ``PROGRAMS_PER_SM * sms`` programs, or when no split leaves each chunk ``MIN_CHUNK_ELEMENTS``.
    Otherwise about ``PROGRAMS_PER_SM * sms`` programs (or as many as keep ``MIN_CHUNK_ELEMENTS``
    each): chunks of whole tiles (a multiple of ``block_s`` positions), so the count rounds to what
    whole tiles give.  E.g. the GroupNorm(8) of a (16, 32, 128, 128) conv output on 132 SMs: 128
    groups of 4 x 16384, tiles of 4 x 512, 8 chunks of 2048 positions (1024 programs of 8192 elements).
    """
    tiles = cdiv(positions, block_s)
    wanted = cdiv(PROGRAMS_PER_SM * sms, max(rows_total, 1)) if sms > 0 else 1
    most = tiles // cdiv(MIN_CHUNK_ELEMENTS, row_channels * block_s)
    split = max(1, min(wanted, most))
    return positions if split == 1 else cdiv(tiles, split) * block_s
