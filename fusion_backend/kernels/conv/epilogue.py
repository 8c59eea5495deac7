"""Device side of the conv family's store: one ``[BLOCK_M, BLOCK_N]`` accumulator tile through the
bias, the pointwise chain, the output activation and the residual, stored channels-last, and its
per-channel statistics.

Order (per element, all in fp32 from the fp32 accumulator; one rounding, at the store)::

    conv[m, c] = round(acc)                 (SAVE_CONV: the raw conv result, for a training forward)
    v = acc * scale[c]                      (HAS_SCALE: a folded eval BatchNorm's scale, fp32)
    v = v + bias[c]                         (HAS_BIAS)
    v = chain(v)                            (CHAIN: ``chain_math`` op codes, operands from the matrix
                                             ``q``: a folded eval BatchNorm's scale and shift, a
                                             per-channel multiplier, activations, clamps, ...)
    v = v + residual[m, c]                  (RESIDUAL == before the activation: ResNet's relu(conv + bias + r))
    # <- the pre-activation: where a training forward will save it for the backward
    v = act_out(v)
    v = v + residual[m, c]                  (RESIDUAL == after the activation)
    out[m, c] = round(v)
    stats: per channel, over the tile's rows of round(v), in fp32: a shift k (the tile's mean as fp32
           rounds it), the sum of e = round(v) - k, and the sum of the squared deviations from k + that
           sum / rows, as Σ e^2 - (Σ e)^2 / rows (two reductions over the tile: k, then both sums in one;
           ``stats`` module docstring)

The conv output is not rounded to the output dtype before the bias (the library path, conv then a
pointwise kernel, rounds it there): one rounding is closer to the float64 truth, and the tests measure
against that truth.

Statistics are of the value *written*, as rounded to the output dtype: the next layer's BatchNorm
normalises the stored tensor, so its mean and variance must be those of the stored values (eager's
BatchNorm computes them from that tensor too).  Rows past ``M`` and channels past the group's count
contribute nothing.  Each program writes its M tile's row of the partials; no two programs write the
same element, and nothing is accumulated with atomics, so the fixed-order combination of the tiles
(``stats.PartialsReduction``) is bitwise reproducible run to run.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..chain_math import apply_chain_at
from .prologue import activation


@triton.jit
def store_tile(acc, m, m_ok, c, c_ok, pid_m, out_ptr, conv_ptr, scale_ptr, bias_ptr, res_ptr, part_ptr, q_ptr,
               slope_out, C_OUT, M_TILES, SAVE_CONV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
               CHAIN: tl.constexpr, ACT_OUT: tl.constexpr, RESIDUAL: tl.constexpr, STATS: tl.constexpr,
               BIG: tl.constexpr):  # fmt: skip
    """Finish and store one tile (module docstring for the order).

    acc       fp32 ``[BLOCK_M, BLOCK_N]``: rows ``m`` (output positions, ``m_ok``: ``< M``), columns ``c``
              (output channels, ``c_ok``: real ones of this group).
    out_ptr   the output, channels-last dense: element ``(m, c)`` at ``m * C_OUT + c``; its dtype is the
              stored one.
    conv_ptr  SAVE_CONV: the conv's raw result (before the scale, the bias and the chain), laid out as
              ``out``, in its own float dtype: what a backward recomputes the chain from.
    scale_ptr HAS_SCALE: ``(C_OUT,)`` contiguous, fp32 or the output dtype: multiplies the accumulator.
    bias_ptr  HAS_BIAS: ``(C_OUT,)`` contiguous, fp32 or the output dtype.
    q_ptr     CHAIN (a tuple of ``chain_math.MAX_SLOTS`` op codes, all 0: none): the chain's operand
              matrix, fp32 ``(chain_math.NUM_PARAM_ROWS, C_OUT)`` contiguous (``epilogue.build_params``).
    res_ptr   RESIDUAL (1 before ACT_OUT, 2 after): the residual, the output's dtype and strides.
    part_ptr  STATS: fp32 ``(3, M_TILES, C_OUT)`` contiguous, of the tile's stored values: ``[0, pid_m, c]``
              the shift ``k``, ``[1, pid_m, c]`` their sum less ``k`` per row, ``[2, pid_m, c]`` their
              sum of squared deviations from their mean (``stats.PartialsReduction`` combines them).
    BIG       int64 element offsets.
    Returns the stored values (the output dtype; a caller summing its own statistics of them).
    """
    if BIG:
        m = m.to(tl.int64)
        pid_m = pid_m.to(tl.int64)
    offs = m[:, None] * C_OUT + c[None, :]
    mask = m_ok[:, None] & c_ok[None, :]
    if SAVE_CONV:
        tl.store(conv_ptr + offs, acc.to(conv_ptr.dtype.element_ty), mask=mask)
    v = acc
    if HAS_SCALE:
        v = v * tl.load(scale_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if CHAIN[0] != 0:
        v = apply_chain_at(v, q_ptr, c[None, :], C_OUT, c_ok[None, :], CHAIN)
    if RESIDUAL == 1:
        v = v + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Hook point: a training forward stores the pre-activation ``v`` here (the backward of ACT_OUT
    # needs it); not part of the forward-only kernel yet.
    v = activation(v, ACT_OUT, slope_out)
    if RESIDUAL == 2:
        v = v + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = v.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=mask)
    if STATS:  # rows past M masked; channels past C_OUT are reduced like the others and never stored
        rows_ok = m_ok[:, None]
        s = tl.where(rows_ok, y.to(tl.float32), 0.0)
        rows = tl.sum(m_ok.to(tl.float32), axis=0)  # a launched tile holds at least one row
        k = tl.sum(s, axis=0) / rows
        e = tl.where(rows_ok, s - k[None, :], 0.0)  # small where the spread is: exact or nearly
        e_sum, e_sq = tl.reduce((e, e * e), 0, _add_pair)  # one reduction for both sums
        tl.store(part_ptr + pid_m * C_OUT + c, k, mask=c_ok)
        tl.store(part_ptr + (M_TILES + pid_m) * C_OUT + c, e_sum, mask=c_ok)
        # Σ (e - ē)^2 = Σ e^2 - (Σ e)^2 / rows, ē the rounding residue of k: no cancellation to speak of
        tl.store(part_ptr + (2 * M_TILES + pid_m) * C_OUT + c, tl.maximum(e_sq - e_sum * e_sum / rows, 0.0),
                 mask=c_ok)
    return y


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1
