"""Triton implicit-GEMM convolution with the pointwise chain and the pool fused in (forward only).

One kernel template computes ``pool(chain(conv(x, w) + bias))`` without ever writing the conv output:
the conv runs as an implicit GEMM with ``tl.dot`` (fp32 accumulation), the chain runs in registers
(the ``@triton.jit`` helpers of ``fusion_backend.kernels.epilogue``), the optional max/avg pool reduces
in registers, and only the final output plus the backward state are stored.  The saved state has the
exact format of ``epilogue_forward`` (max pool: int8/int32 winner index in its window and the conv
output, without bias, at the winner; otherwise the full conv output ``y0``), so the existing backward
(``epilogue_backward``) consumes it unchanged.

Mapping (every rank lifted to 3d with leading singleton spatial dims):

* GEMM ``M`` = "units" of one program: pooled-output positions with a pool; conv-output positions for
  a plain conv; for a transposed conv without pool, *super-positions* ``u`` each standing for the
  ``s_d * s_h * s_w`` outputs ``o = u * s + r`` (one per phase ``r``).  ``M`` flattens
  ``(n, ud, uh, uw)``.  ``N`` = output channels of one group (``BLOCK_N`` of them), ``K`` = input
  channels of the group (``BLOCK_K`` at a time) x taps (unrolled statically).
* Every unit has a static set of *window offsets* ``kp`` (the pool window; the phases of a
  transposed conv without pool; a single offset for a plain conv without pool); the conv output at
  ``o = u * US - UP + kp`` is computed for each, the chain applied, then reduced (pool) or stored.
* Conv-transpose uses the phase (sub-pixel) decomposition: tap ``k`` contributes to output ``o`` iff
  ``(o + p - k * dil) % s == 0``, from input ``i = (o + p - k * dil) / s``.  When ``US`` is a multiple
  of ``s`` (always without a pool; e.g. the ConvT3d pipeline's MaxPool(2) after a stride-2
  ConvTranspose3d(16->32, k3, p1, op1), the ``convt3d_leaky_mul_leaky_maxpool`` workload), the phase
  of every offset is a compile-time constant: taps that cannot contribute are skipped at compile time
  and no multiply by an inserted zero happens.  With a static phase along every dim and at most
  ``_SHIFT_K_MAX_SLOTS`` distinct input shifts (offset ``kp`` and tap ``t`` read ``i = u * US / s +
  (kp - UP + p - t * dil) / s``, a compile-time shift; the ConvT3d pipeline: 2 per dim, 8 in all), the
  *SHIFT_K* path makes every window offset ONE dense dot: K = (input shift, channel), the X tile
  ``[BLOCK_M, 8 shifts x C_in]`` loaded once per channel block and shared by the dots of all offsets,
  the weight tile zero where no tap links the offset to the shift (the ConvT3d pipeline: 27 live of 64
  (offset, shift) blocks, so 2.4x the MMA work of the live taps, traded for 8 large dots with one live
  accumulator instead of 27 K=16 dots with 8).  Other static cases unroll the live taps
  (``tl.static_range``).  Otherwise (a pool stride that is not a multiple of the conv stride) the
  kernel falls back to a *masked all-taps* loop: every tap is visited and lanes whose phase does not
  match are masked (correct, up to ``s**d`` times more MMA work).

Numerics: the accumulator is rounded to the storage dtype of the conv before the bias and chain, as
the library conv + epilogue kernel path does (the conv output is materialised in that dtype there).
fp32 operands use TF32 iff the launcher is told so (``torch.backends.cudnn.allow_tf32`` on CUDA),
``ieee`` otherwise and always under the interpreter; TF32 operands are rounded to nearest first, as
cuDNN does (``kernels.tf32``: the tensor cores would truncate them).  inf/NaN in ``x`` reach exactly
the outputs they reach in aten's conv; a non-finite *weight* also reaches the outputs whose taps fall
on the zero padding (masked loads read 0, and 0 * NaN = NaN), as in implicit-GEMM convs generally.  No atomics; results are deterministic.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import environment
from ..ir.shapes import conv_output_length
from .chain_math import (
    MAX_WINDOW_VOLUME,
    KernelStep,
    PoolGeometry,
    avg_divisor,
    chain_forward,
    load_operands,
    op_constexprs,
)
from .epilogue import build_params
from .host import INTERPRETER, BoundedCache, best_first, cdiv, lift_5d, next_pow2, tensor_key
from .launch import FastLaunch, launch
from .tf32 import compute_code, dot_precision, round_tf32, to_compute

#: Largest number of (window offset, tap) pairs the kernel unrolls (compile time and code size grow
#: with it).  The ConvT3d pipeline: 27 effective pairs (8 phases x 1..8 taps); a 3x3x3 conv under a
#: 2x2x2 pool: 216.
MAX_UNROLLED_TAPS = 256
_INT32_LIMIT = 2**31 - 1
#: Tensors with more elements than this get int64 index math (BIG); a module constant so that tests
#: can exercise that path on small tensors.
_BIG_INDEX_THRESHOLD = _INT32_LIMIT
_INTERPRET = INTERPRETER  # kernels/host.py: whether Triton's interpreter is on
#: Environment variable: "0" launches one heuristic tile instead of autotuning (CUDA).
AUTOTUNE_ENV = environment.CONV_AUTOTUNE
#: Problems below this many multiply-adds (live taps only) take the heuristic tile: autotuning
#: compiles every config once per shape key, not worth it for small convs (and GPU tests).
_AUTOTUNE_MIN_MACS = 2**28
#: Most input-shift slots (distinct shifts rounded up to a power of 2) of the SHIFT_K path: its
#: X tile is ``[BLOCK_M, slots * SHIFT_K_BLOCK_K]`` (the ConvT3d pipeline: 8 slots, K = 128).
_SHIFT_K_MAX_SLOTS = 8
#: The SHIFT_K path's channel block (every tile of ``_SHIFT_K_TILES``): inputs with at most this
#: many channels per group (the ConvT3d pipeline: 16) load their X tile once for all window offsets.
SHIFT_K_BLOCK_K = 16


@triton.jit
def _in_index(u, o, KP: tl.constexpr, TAP: tl.constexpr, US: tl.constexpr, UP: tl.constexpr,
              S: tl.constexpr, P: tl.constexpr, DIL: tl.constexpr, SIZE_IN,
              TRANSPOSED: tl.constexpr, STATIC_PHASE: tl.constexpr):  # fmt: skip
    """Input coordinate feeding output coordinate ``o = u * US - UP + KP`` through tap ``TAP`` along
    one dim, and whether it is valid (in range, and for a transposed conv, of the right phase)."""
    if TRANSPOSED:
        if STATIC_PHASE:
            # (o + P - TAP*DIL) = u*US + R with R = KP - UP + P - TAP*DIL static; the caller skips
            # taps with R % S != 0, so R // S is exact.
            i = u * (US // S) + (KP - UP + P - TAP * DIL) // S
            ok = (i >= 0) & (i < SIZE_IN)
        else:
            num = o + P - TAP * DIL
            i = num // S
            ok = (num >= 0) & (num % S == 0) & (i < SIZE_IN)
    else:
        i = o * S - P + TAP * DIL
        ok = (i >= 0) & (i < SIZE_IN)
    return i, ok


@triton.jit
def _in_index_rt(o, tap, S: tl.constexpr, P: tl.constexpr, DIL: tl.constexpr, SIZE_IN,
                 TRANSPOSED: tl.constexpr):  # fmt: skip
    """``_in_index`` for a runtime tap (the flat K loop): phases are masked, not skipped."""
    if TRANSPOSED:
        num = o + P - tap * DIL
        i = num // S
        ok = (num >= 0) & (num % S == 0) & (i < SIZE_IN)
    else:
        i = o * S - P + tap * DIL
        ok = (i >= 0) & (i < SIZE_IN)
    return i, ok


@triton.jit
def _conv_flat(acc, x_base, w_base, od, oh, ow, o_ok, ck, cmask, CIN_G, ID, IH, IW,
               x_sc, x_sd, x_sh, x_sw, w_sci, w_sd, w_sh, w_sw,
               TRANSPOSED: tl.constexpr, TD: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
               SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
               PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
               DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
               CDT: tl.constexpr, PRECISION: tl.constexpr, BIG: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``acc += conv at (od, oh, ow)`` as ONE runtime loop over K = taps x input-channel blocks.

    A single ``scf.for`` that Triton software-pipelines (``num_stages``): the shape of a plain conv
    (every tap live), and of the masked all-taps fallback of a transposed conv.
    """
    k_blocks = tl.cdiv(CIN_G, BLOCK_K)
    for kk in range(0, TD * TH * TW * k_blocks):
        tap = kk // k_blocks
        ci = (kk - tap * k_blocks) * BLOCK_K + ck
        tw = tap % TW
        t2 = tap // TW
        th = t2 % TH
        td = t2 // TH
        i_d, v_d = _in_index_rt(od, td, SD, PD, DD, ID, TRANSPOSED)
        i_h, v_h = _in_index_rt(oh, th, SH, PH, DH, IH, TRANSPOSED)
        i_w, v_w = _in_index_rt(ow, tw, SW, PW, DW, IW, TRANSPOSED)
        valid = o_ok & v_d & v_h & v_w
        if BIG:
            sp = i_d.to(tl.int64) * x_sd + i_h.to(tl.int64) * x_sh + i_w.to(tl.int64) * x_sw
        else:
            sp = i_d * x_sd + i_h * x_sh + i_w * x_sw
        ci_ok = ci < CIN_G
        a = tl.load(
            (x_base + sp)[:, None] + ci[None, :] * x_sc, mask=valid[:, None] & ci_ok[None, :], other=0.0
        )
        b = tl.load(w_base + (td * w_sd + th * w_sh + tw * w_sw) + ci[:, None] * w_sci,
                    mask=ci_ok[:, None] & cmask, other=0.0)  # fmt: skip
        acc = tl.dot(round_tf32(to_compute(a, CDT), PRECISION), round_tf32(to_compute(b, CDT), PRECISION), acc,
                     input_precision=PRECISION)  # fmt: skip
    return acc


@triton.jit
def _live_tap(num, DIL: tl.constexpr, T: tl.constexpr):
    """Tap ``t`` with ``t * DIL == num`` along one dim, and whether it exists (``0 <= t < T``)."""
    t = num // DIL
    return t, (num >= 0) & (num % DIL == 0) & (t < T)


@triton.jit
def _shift_k_columns(KS: tl.constexpr, NSH: tl.constexpr, NSW: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K axis of the SHIFT_K path: column ``s * BLOCK_K + c`` is channel ``c`` of the block at
    input shift ``s = (jd * NSH + jh) * NSW + jw``.  Returns ``(s, c, jd, jh, jw)``, each ``[KS * BLOCK_K]``."""
    kcol = tl.arange(0, KS * BLOCK_K)
    s = kcol // BLOCK_K
    jw = s % NSW
    jh = (s // NSW) % NSH
    jd = s // (NSW * NSH)
    return s, kcol % BLOCK_K, jd, jh, jw


@triton.jit
def _shift_k_x_tile(x_rows, i_d0, i_h0, i_w0, m_ok, CIN_G, ID, IH, IW, x_sc, x_sd, x_sh, x_sw,
                    NSD: tl.constexpr, NSH: tl.constexpr, NSW: tl.constexpr, KS: tl.constexpr,
                    BIG: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``[BLOCK_M, KS * BLOCK_K]`` X tile (the group's input channels fit one block): row ``m`` and
    column ``(s, c)`` hold ``x[n, c, i0 + shift s]`` (``x_rows``: pointers at ``(n, group's first
    channel, i0)``, ``i0 = (i_d0, i_h0, i_w0)`` the lowest shift's input position).  Padding shifts
    (``s >= NSD * NSH * NSW``), channels past ``CIN_G`` and out-of-range inputs read 0."""
    s, ci, jd, jh, jw = _shift_k_columns(KS, NSH, NSW, BLOCK_K)
    col_ok = (s < NSD * NSH * NSW) & (ci < CIN_G)
    if BIG:
        off = jd.to(tl.int64) * x_sd + jh.to(tl.int64) * x_sh + jw.to(tl.int64) * x_sw + ci.to(tl.int64) * x_sc
    else:
        off = jd * x_sd + jh * x_sh + jw * x_sw + ci * x_sc
    d = i_d0[:, None] + jd[None, :]
    h = i_h0[:, None] + jh[None, :]
    w = i_w0[:, None] + jw[None, :]
    ok = m_ok[:, None] & col_ok[None, :] & (d >= 0) & (d < ID) & (h >= 0) & (h < IH) & (w >= 0) & (w < IW)
    return tl.load(x_rows[:, None] + off[None, :], mask=ok, other=0.0)


@triton.jit
def _shift_k_w_tile(w_base, cmask, CIN_G, w_sci, w_sd, w_sh, w_sw, kd, kh, kw,
                    TD: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
                    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                    PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                    DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                    UPD: tl.constexpr, UPH: tl.constexpr, UPW: tl.constexpr,
                    LOD: tl.constexpr, LOH: tl.constexpr, LOW: tl.constexpr,
                    NSD: tl.constexpr, NSH: tl.constexpr, NSW: tl.constexpr, KS: tl.constexpr,
                    BLOCK_K: tl.constexpr):  # fmt: skip
    """``[KS * BLOCK_K, BLOCK_N]`` weight tile of window offset ``(kd, kh, kw)`` matching
    ``_shift_k_x_tile``'s columns: row ``(s, c)`` holds the weight of the tap that carries input
    shift ``s`` to that offset, or 0 where no tap does (a dead (offset, shift) pair).

    Along each dim, offset ``kp`` reads shift ``j`` through tap ``t`` iff
    ``kp - UP + P - t * DIL == S * (LO + j)`` (see ``_in_index``); for a given ``j`` at most one
    tap satisfies it.  ``w_base``: ``[1, BLOCK_N]`` pointers at (group's first input channel,
    output channel, tap 0)."""
    s, ci, jd, jh, jw = _shift_k_columns(KS, NSH, NSW, BLOCK_K)
    td, ok_d = _live_tap(kd - UPD + PD - SD * (LOD + jd), DD, TD)
    th, ok_h = _live_tap(kh - UPH + PH - SH * (LOH + jh), DH, TH)
    tw, ok_w = _live_tap(kw - UPW + PW - SW * (LOW + jw), DW, TW)
    ok = (s < NSD * NSH * NSW) & (ci < CIN_G) & ok_d & ok_h & ok_w
    off = ci * w_sci + td * w_sd + th * w_sh + tw * w_sw
    return tl.load(w_base + off[:, None], mask=ok[:, None] & cmask, other=0.0)


@triton.jit
def _first_offset(kd, kh, kw, od, oh, ow):
    """Whether offset ``(kd, kh, kw)`` (at conv-output position ``(od, oh, ow)``, assumed valid) is
    the first valid offset of its window in row-major order: along each dim the valid offsets form
    one interval, so it is the first iff along every dim it is offset 0 or the previous offset's
    position (``o - 1``) lies before the conv output (``o == 0``)."""
    return ((od == 0) | (kd == 0)) & ((oh == 0) | (kh == 0)) & ((ow == 0) | (kw == 0))


@triton.jit
def _offset_epilogue(acc, kk, first, od, oh, ow, o_ok, nn, c64, cmask, best, win, win_y, pooled,
                     bias, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7, CDT: tl.constexpr, out_ptr, sa_ptr,
                     o_sn, o_sc, o_sd, o_sh, o_sw, y_sn, y_sc, y_sd, y_sh, y_sw,
                     OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
                     OP4: tl.constexpr, OP5: tl.constexpr, OP6: tl.constexpr, OP7: tl.constexpr,
                     HAS_BIAS: tl.constexpr, POOL: tl.constexpr, SAVE: tl.constexpr, BIG: tl.constexpr,
                     FULL: tl.constexpr, FIRST: tl.constexpr = 0):  # fmt: skip
    """Bias + chain on the conv output ``acc`` of window offset ``kk`` (row-major index in the
    window) at conv-output position ``(od, oh, ow)``; then store it (no pool), fold it into the
    running max (``best``, winner ``win``, conv value at the winner ``win_y``) or the avg-pool sum,
    and store the saved conv output (SAVE without max pool).  Returns ``best, win, win_y, pooled``.

    ``o_ok`` (``[BLOCK_M]``): the rows whose offset lies in the conv output (and in M).  ``first``
    (``[BLOCK_M, 1]`` or a scalar): the offset is the first valid one of the row's window in
    row-major order (``_first_offset``), where the max pool takes it without a compare.  FULL
    (``_full_windows``: every offset of every unit lies in the conv output): ``o_ok`` is ``m_ok``,
    ``first`` is ``kk == 0`` and rows past M are never stored, so the max pool and the avg-pool
    sum need no row mask.  FIRST (FULL max pool, offset 0 peeled by the caller): 1 for offset 0
    (sets best/win/win_y, no compare), 2 for the later offsets (no ``first`` test), 0 otherwise.  Max pool: output channels past ``C_OUT`` (``cmask``) are computed but never
    stored, so they are not masked.
    """
    # The conv output as the library path materialises it (storage dtype), then the chain.
    y_raw = to_compute(acc, CDT).to(tl.float32)
    y = y_raw
    if HAS_BIAS:
        y = y + bias
    v = chain_forward(y, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
                   OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7)  # fmt: skip
    ok2 = o_ok[:, None] & cmask
    if BIG:
        o_sp = od.to(tl.int64) * y_sd + oh.to(tl.int64) * y_sh + ow.to(tl.int64) * y_sw
    else:
        o_sp = od * y_sd + oh * y_sh + ow * y_sw
    if POOL == 0:
        if BIG:
            q = (
                nn * o_sn
                + od.to(tl.int64) * o_sd
                + oh.to(tl.int64) * o_sh
                + ow.to(tl.int64) * o_sw
            )
        else:
            q = nn * o_sn + od * o_sd + oh * o_sh + ow * o_sw
        tl.store(out_ptr + q[:, None] + c64[None, :] * o_sc, v.to(out_ptr.dtype.element_ty),
                 mask=ok2)  # fmt: skip
    elif POOL == 1:
        # PyTorch's rule: the first valid offset, then a later one iff v > best or v is NaN.
        # WHY `first`/FIRST, not `win < 0`: a per-row (or compile-time) flag instead of a compare
        # per element.
        if FIRST == 1:  # every row's first valid offset (FULL, offset 0): taken without compares
            best = v
            win = tl.zeros_like(win) + kk
            win_y = y_raw
        else:
            if FIRST == 2:  # FULL, a later offset: offset 0 was taken by the FIRST == 1 call
                take = (v > best) | (v != v)
            elif FULL:  # first: kk == 0
                take = first | (v > best) | (v != v)
            else:
                take = o_ok[:, None] & (first | (v > best) | (v != v))
            best = tl.where(take, v, best)
            win = tl.where(take, kk, win)
            win_y = tl.where(take, y_raw, win_y)
    elif FULL:
        pooled += v
    else:
        pooled += tl.where(ok2, v, 0.0)
    if SAVE and POOL != 1:
        # NOTE: with overlapping avg-pool windows the same element is stored by several
        # programs with bitwise identical values (same operands, same K order).
        tl.store(sa_ptr + (nn * y_sn + o_sp)[:, None] + c64[None, :] * y_sc,
                 y_raw.to(sa_ptr.dtype.element_ty), mask=ok2)  # fmt: skip
    return best, win, win_y, pooled


@triton.jit
def _shift_k_offset(kk, FIRST: tl.constexpr, a_all, SHARED_X: tl.constexpr, x_rows, i_d0, i_h0, i_w0, m_ok, ck, ud, uh, uw, nn, c64, cmask,
                      w_base, wm_base, wm_sk, CIN_G, ID, IH, IW, OD, OH, OW, x_sc, x_sd, x_sh, x_sw, w_sci, w_sd, w_sh, w_sw,
                      best, win, win_y, pooled,
                      bias, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7, CDT: tl.constexpr, out_ptr, sa_ptr,
                      o_sn, o_sc, o_sd, o_sh, o_sw, y_sn, y_sc, y_sd, y_sh, y_sw,
                      OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
                      OP4: tl.constexpr, OP5: tl.constexpr, OP6: tl.constexpr, OP7: tl.constexpr,
                      HAS_BIAS: tl.constexpr, POOL: tl.constexpr, SAVE: tl.constexpr, BIG: tl.constexpr,
                      FULL: tl.constexpr, TD: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
                      SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                      PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                      DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                      KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                      USD: tl.constexpr, USH: tl.constexpr, USW: tl.constexpr,
                      UPD: tl.constexpr, UPH: tl.constexpr, UPW: tl.constexpr,
                      LOD: tl.constexpr, LOH: tl.constexpr, LOW: tl.constexpr,
                      NSD: tl.constexpr, NSH: tl.constexpr, NSW: tl.constexpr, KS: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):  # fmt: skip
    """One window offset ``kk`` of ``_shift_k_offsets``: its dot, then ``_offset_epilogue`` (FIRST:
    1 offset 0 of a FULL window, peeled; 2 a later offset of a FULL window after the peeled one;
    0 otherwise)."""
    kd = kk // (KH * KW)
    kh = (kk // KW) % KH
    kw = kk % KW
    od = ud * USD - UPD + kd
    oh = uh * USH - UPH + kh
    ow = uw * USW - UPW + kw
    if FULL:
        o_ok = m_ok
        first = kk == 0
    else:
        o_ok = m_ok & (od >= 0) & (od < OD) & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
        first = _first_offset(kd, kh, kw, od, oh, ow)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SHARED_X:
        # The offset's [KS * BLOCK_K, BLOCK_N] slice of the prearranged weight matrix (zeros at
        # dead pairs, already TF32-rounded): a plain load that feeds the dot directly.
        krow = tl.arange(0, KS * BLOCK_K)
        b = tl.load(wm_base + kk * wm_sk + krow[:, None], mask=cmask, other=0.0)
        acc = tl.dot(a_all, b, acc, input_precision=PRECISION)
    else:
        # One [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] dot per (channel block, shift), dead pairs masked.
        for k0 in range(0, CIN_G, BLOCK_K):
            ci = k0 + ck
            ci_ok = ci < CIN_G
            for sidx in range(0, NSD * NSH * NSW):
                jw = sidx % NSW
                jh = (sidx // NSW) % NSH
                jd = sidx // (NSW * NSH)
                td, ok_d = _live_tap(kd - UPD + PD - SD * (LOD + jd), DD, TD)
                th, ok_h = _live_tap(kh - UPH + PH - SH * (LOH + jh), DH, TH)
                tw, ok_w = _live_tap(kw - UPW + PW - SW * (LOW + jw), DW, TW)
                # A dead pair loads nothing (both masks off) and adds 0 * 0: masks, not a
                # runtime branch around the dot.  (tl.where: under the interpreter the scalar
                # `&` chain came out as an int32 array, which tl.load refuses as a mask.)
                live = tl.where(ok_d & ok_h & ok_w, ci_ok, False)
                row_ok = (m_ok & (i_d0 + jd >= 0) & (i_d0 + jd < ID) & (i_h0 + jh >= 0) & (i_h0 + jh < IH)
                          & (i_w0 + jw >= 0) & (i_w0 + jw < IW))  # fmt: skip
                a = tl.load(x_rows[:, None] + (jd * x_sd + jh * x_sh + jw * x_sw) + ci[None, :] * x_sc,
                            mask=row_ok[:, None] & live[None, :], other=0.0)  # fmt: skip
                b = tl.load(w_base + (td * w_sd + th * w_sh + tw * w_sw) + ci[:, None] * w_sci,
                            mask=live[:, None] & cmask, other=0.0)  # fmt: skip
                acc = tl.dot(round_tf32(to_compute(a, CDT), PRECISION), round_tf32(to_compute(b, CDT), PRECISION),
                             acc, input_precision=PRECISION)  # fmt: skip
    best, win, win_y, pooled = _offset_epilogue(
        acc, kk, first, od, oh, ow, o_ok, nn, c64, cmask, best, win, win_y, pooled,
        bias, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7, CDT, out_ptr, sa_ptr,
        o_sn, o_sc, o_sd, o_sh, o_sw, y_sn, y_sc, y_sd, y_sh, y_sw,
        OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7, HAS_BIAS, POOL, SAVE, BIG, FULL, FIRST,
    )  # fmt: skip
    return best, win, win_y, pooled


@triton.jit
def _shift_k_offsets(a_all, SHARED_X: tl.constexpr, x_rows, i_d0, i_h0, i_w0, m_ok, ck, ud, uh, uw, nn, c64, cmask,
                     w_base, wm_base, wm_sk, CIN_G, ID, IH, IW, OD, OH, OW, x_sc, x_sd, x_sh, x_sw, w_sci, w_sd, w_sh, w_sw,
                     best, win, win_y, pooled,
                     bias, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7, CDT: tl.constexpr, out_ptr, sa_ptr,
                     o_sn, o_sc, o_sd, o_sh, o_sw, y_sn, y_sc, y_sd, y_sh, y_sw,
                     OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
                     OP4: tl.constexpr, OP5: tl.constexpr, OP6: tl.constexpr, OP7: tl.constexpr,
                     HAS_BIAS: tl.constexpr, POOL: tl.constexpr, SAVE: tl.constexpr, BIG: tl.constexpr,
                     FULL: tl.constexpr, TD: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
                     SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                     PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                     DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                     KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                     USD: tl.constexpr, USH: tl.constexpr, USW: tl.constexpr,
                     UPD: tl.constexpr, UPH: tl.constexpr, UPW: tl.constexpr,
                     LOD: tl.constexpr, LOH: tl.constexpr, LOW: tl.constexpr,
                     NSD: tl.constexpr, NSH: tl.constexpr, NSW: tl.constexpr, KS: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):  # fmt: skip
    """The SHIFT_K path's loop over window offsets: per offset one dot over (input shift, channel),
    then ``_offset_epilogue``.  SHARED_X: every offset's dot reads ``a_all`` (the one channel
    block's X tile, all finite) and the offset's rows of the prearranged weight matrix
    (``wm_base``: ``[1, BLOCK_N]`` pointers at the group's offset 0, row 0; offsets ``wm_sk`` apart, rows contiguous;
    see ``shift_k_weight_matrix``; dead (offset, shift) pairs multiply by zero weights); else each
    offset runs one small dot per (channel block, shift) pair, loading its X tile with the dead
    pairs masked to zero on both sides (several channel blocks, or a tile holding inf/NaN, where
    0 * inf would make NaN).
    Returns ``best, win, win_y, pooled`` as ``_offset_epilogue``.
    """
    # NOTE: a runtime loop (not static_range): unrolled, the compiler hoisted all 8 weight-tile loads
    # of the ConvT3d pipeline into registers at once (255 registers, spills); as a loop, each offset's
    # tile is loaded when its dot needs it.
    # FULL max pool with the shared X tile: offset 0 is every row's first valid offset and is
    # peeled (set without compares; the loop's offsets then compare without a first-offset test).
    # Not in the masked variant (tiles with inf/NaN only): its dots would be duplicated.
    PEEL: tl.constexpr = 1 if FULL and POOL == 1 and SHARED_X else 0
    for kk in tl.static_range(PEEL):
        best, win, win_y, pooled = _shift_k_offset(
            kk, 1,
            a_all, SHARED_X, x_rows, i_d0, i_h0, i_w0, m_ok, ck, ud, uh, uw, nn, c64, cmask, w_base,
            wm_base, wm_sk, CIN_G, ID, IH, IW, OD, OH, OW, x_sc, x_sd, x_sh, x_sw, w_sci, w_sd,
            w_sh, w_sw, best, win, win_y, pooled, bias, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5,
            b5, a6, b6, a7, b7, CDT, out_ptr, sa_ptr, o_sn, o_sc, o_sd, o_sh, o_sw, y_sn, y_sc,
            y_sd, y_sh, y_sw, OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7, HAS_BIAS, POOL, SAVE, BIG,
            FULL, TD, TH, TW, SD, SH, SW, PD, PH, PW, DD, DH, DW, KD, KH, KW, USD, USH, USW, UPD,
            UPH, UPW, LOD, LOH, LOW, NSD, NSH, NSW, KS, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K
        )  # fmt: skip
    for kk in range(PEEL, KD * KH * KW):
        best, win, win_y, pooled = _shift_k_offset(
            kk, 2 * PEEL,
            a_all, SHARED_X, x_rows, i_d0, i_h0, i_w0, m_ok, ck, ud, uh, uw, nn, c64, cmask, w_base,
            wm_base, wm_sk, CIN_G, ID, IH, IW, OD, OH, OW, x_sc, x_sd, x_sh, x_sw, w_sci, w_sd,
            w_sh, w_sw, best, win, win_y, pooled, bias, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5,
            b5, a6, b6, a7, b7, CDT, out_ptr, sa_ptr, o_sn, o_sc, o_sd, o_sh, o_sw, y_sn, y_sc,
            y_sd, y_sh, y_sw, OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7, HAS_BIAS, POOL, SAVE, BIG,
            FULL, TD, TH, TW, SD, SH, SW, PD, PH, PW, DD, DH, DW, KD, KH, KW, USD, USH, USW, UPD,
            UPH, UPW, LOD, LOH, LOW, NSD, NSH, NSW, KS, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K
        )  # fmt: skip
    return best, win, win_y, pooled


@triton.jit
def _conv_fused_fwd_kernel(
    x_ptr, w_ptr, wm_ptr, p_ptr, out_ptr, sa_ptr, sb_ptr,
    C_OUT, CIN_G, COUT_G, M_TOTAL,
    ID, IH, IW, OD, OH, OW, UD, UH, UW,
    x_sn, x_sc, x_sd, x_sh, x_sw,
    w_sci, w_sco, w_sd, w_sh, w_sw,
    o_sn, o_sc, o_sd, o_sh, o_sw,
    y_sn, y_sc, y_sd, y_sh, y_sw,
    OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
    OP4: tl.constexpr, OP5: tl.constexpr, OP6: tl.constexpr, OP7: tl.constexpr,
    HAS_BIAS: tl.constexpr, POOL: tl.constexpr, SAVE: tl.constexpr, TRANSPOSED: tl.constexpr,
    TD: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    USD: tl.constexpr, USH: tl.constexpr, USW: tl.constexpr,
    UPD: tl.constexpr, UPH: tl.constexpr, UPW: tl.constexpr,
    STATIC_D: tl.constexpr, STATIC_H: tl.constexpr, STATIC_W: tl.constexpr,
    COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR: tl.constexpr,
    CDT: tl.constexpr, PRECISION: tl.constexpr, BIG: tl.constexpr, FLAT_K: tl.constexpr, SHIFT_K: tl.constexpr,
    ONE_CBLOCK: tl.constexpr, KS: tl.constexpr, FULL_WINDOWS: tl.constexpr,
    LOD: tl.constexpr, LOH: tl.constexpr, LOW: tl.constexpr,
    NSD: tl.constexpr, NSH: tl.constexpr, NSW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out = pool(chain(conv(x, w) + bias)) for a ``[BLOCK_M units, BLOCK_N channels]`` tile.

    Pointers (element strides; every tensor lifted to (N, C, D, H, W)):
      x_ptr   input (N, CIN_G * groups, ID, IH, IW), fp32/fp16/bf16, strides ``x_s*``; x and
              weight tiles are cast to the compute dtype ``CDT`` (``tf32.compute_code``) as they
              are loaded, and the conv output is rounded to it before bias and chain.
      w_ptr   weight, any strides; ``w_sci``/``w_sco`` step the input/output channel *within the
              group* (conv: dims 1/0; transposed: dims 0/1) and the launcher has already offset
              nothing: the kernel adds the group offset itself.  Taps ``TD x TH x TW``.
      wm_ptr  SHIFT_K with ONE_CBLOCK: the prearranged weight matrix of ``shift_k_weight_matrix``
              ((groups, KD*KH*KW, COUT_G, KS*BLOCK_K), the compute dtype, contiguous); else unused.
      p_ptr   operand matrix P of ``epilogue.build_params``, (NUM_PARAM_ROWS, C_OUT) fp32 contiguous.
      out_ptr result (N, C_OUT, pooled or conv-output spatial), any float dtype, strides ``o_s*``.
      sa_ptr  SAVE and max pool: winner index (int8/int32), out's shape and strides.
              SAVE without max pool: the conv output without bias, (N, C_OUT, OD, OH, OW), the
              compute dtype, strides ``y_s*``.
      sb_ptr  SAVE and max pool: conv output (no bias) at the winner, the compute dtype, out's strides.
    Geometry: ``OD, OH, OW`` conv-output sizes; ``UD, UH, UW`` unit-grid sizes (pooled sizes, conv
    output sizes, or ceil(O / s) super-positions for a transposed conv without pool);
    ``KD, KH, KW`` window offsets per unit, ``US*``/``UP*`` unit stride/origin (o = u*US - UP + kp);
    ``STATIC_*``: transposed conv with a compile-time phase per offset along that dim.
    POOL: 0 none, 1 max, 2 avg.  Max-pool parity with PyTorch as in ``_epilogue_fwd_kernel``: offsets
    scanned row-major, the first valid one wins initially, a later one replaces it when
    ``v > best or isnan(v)``; positions outside the conv output never win / count.
    BIG: index math in int64 (some tensor spans more than 2**31 - 1 elements).
    FLAT_K: one pipelined runtime loop over taps x channel blocks (``_conv_flat``; no compile-time
    phase skipping); else taps unrolled statically, skipping dead phases (transposed conv).
    SHIFT_K: transposed conv with a static phase along every dim: per window offset ONE dot whose K
    axis is (input shift, channel) over all ``NSD * NSH * NSW`` distinct input shifts (padded to
    ``KS``, a power of 2), the weight tile zero where no tap links the offset to the shift
    (``_shift_k_x_tile`` / ``_shift_k_w_tile``; ``LO*``/``NS*``: the lowest shift and the number of
    shifts per dim).  ONE_CBLOCK (``CIN_G <= BLOCK_K``): the X tile is loaded once and feeds the
    dots of every window offset.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_blocks_n = tl.cdiv(COUT_G, BLOCK_N)
    grp = pid_n // n_blocks_n
    nb = pid_n % n_blocks_n

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M_TOTAL
    uw = m % UW
    t = m // UW
    uh = t % UH
    t = t // UH
    ud = t % UD
    nn = t // UD
    if BIG:
        nn = nn.to(tl.int64)

    co = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    co_ok = co < COUT_G
    c_glob = grp * COUT_G + co
    c = c_glob[None, :]
    cmask = co_ok[None, :]
    ck = tl.arange(0, BLOCK_K)

    bias = 0.0
    if HAS_BIAS:  # in the compute dtype, as the conv adds it (an fp32 bias under autocast is cast)
        bias = to_compute(tl.load(p_ptr + c, mask=cmask, other=0.0), CDT).to(tl.float32)
    a0, b0 = load_operands(p_ptr, 0, c, C_OUT, cmask, OP0)
    a1, b1 = load_operands(p_ptr, 1, c, C_OUT, cmask, OP1)
    a2, b2 = load_operands(p_ptr, 2, c, C_OUT, cmask, OP2)
    a3, b3 = load_operands(p_ptr, 3, c, C_OUT, cmask, OP3)
    a4, b4 = load_operands(p_ptr, 4, c, C_OUT, cmask, OP4)
    a5, b5 = load_operands(p_ptr, 5, c, C_OUT, cmask, OP5)
    a6, b6 = load_operands(p_ptr, 6, c, C_OUT, cmask, OP6)
    a7, b7 = load_operands(p_ptr, 7, c, C_OUT, cmask, OP7)

    ci0 = grp * CIN_G
    if BIG:
        ci0 = ci0.to(tl.int64)
    x_base = x_ptr + nn * x_sn + ci0 * x_sc  # [BLOCK_M] pointers
    if TRANSPOSED:
        w_base = w_ptr + ci0 * w_sci + co[None, :] * w_sco  # [1, BLOCK_N]
    else:
        w_base = w_ptr + c_glob[None, :] * w_sco
    c64 = c_glob
    if BIG:
        c64 = c_glob.to(tl.int64)

    best = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    win = tl.full([BLOCK_M, BLOCK_N], -1, tl.int32)
    win_y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    pooled = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SHIFT_K:
        # Input position of the lowest shift; offset kp and tap t read i0 + (shift - LO) (static).
        i_d0 = ud * (USD // SD) + LOD
        i_h0 = uh * (USH // SH) + LOH
        i_w0 = uw * (USW // SW) + LOW
        if BIG:
            x_rows = x_base + (i_d0.to(tl.int64) * x_sd + i_h0.to(tl.int64) * x_sh + i_w0.to(tl.int64) * x_sw)
        else:
            x_rows = x_base + (i_d0 * x_sd + i_h0 * x_sh + i_w0 * x_sw)
        masked = 1  # several channel blocks: the masked variant (a_all does not exist)
        if ONE_CBLOCK:
            a_all = _shift_k_x_tile(x_rows, i_d0, i_h0, i_w0, m_ok, CIN_G, ID, IH, IW, x_sc, x_sd, x_sh, x_sw,
                                    NSD, NSH, NSW, KS, BIG, BLOCK_K)  # fmt: skip
            a_all = to_compute(a_all, CDT)  # an fp32 x under autocast: cast here, not in a pass of its own
            # NOTE: a dead (offset, shift) pair multiplies its X column by a zero weight, and
            # 0 * inf = NaN: a tile holding a non-finite input takes the masked variant, so NaN/inf
            # reach exactly the outputs whose taps read them, as in the library conv.  Two whole
            # loops, not a branch per dot: a per-dot branch (or zeroing a_all's dead columns in
            # registers) kept the tile live across the loop: 255 registers and spills.
            # x * 0 is NaN for inf and NaN, else +-0: the tile's sum of x * 0 is NaN iff it holds a
            # non-finite value (one FFMA per element; was (x - x) != 0, converted and max-reduced).
            masked = tl.sum(tl.sum(a_all.to(tl.float32) * 0.0, axis=1), axis=0) != 0
            a_all = round_tf32(a_all, PRECISION)
            if masked == 0:
                wm_base = wm_ptr + (grp * (KD * KH * KW) * COUT_G + co[None, :]) * (KS * BLOCK_K)
                a_cur = a_all
                # WHY a one-trip loop carrying the tile: with fp32 (TF32 rounding between the load and
                # the dot) Triton otherwise keeps the dot operand in registers and reloads it from
                # shared memory on every offset (64 LDS per thread per offset on the ConvT3d
                # pipeline); loop-carried, it stays in shared memory and the MMAs read it there.  The
                # add of 0 only keeps it loop-carried.  bf16 does not need it (carrying cost +15
                # registers).  Measured statically (tools/compile_check.py conv_fused --sass, Triton
                # 3.9): the ConvT3d pipeline's fp32 main loop 403 -> 269 instructions.
                for _once in range(pid_m, pid_m + 1):
                    best, win, win_y, pooled = _shift_k_offsets(
                        a_cur, True, x_rows, i_d0, i_h0, i_w0, m_ok, ck, ud, uh, uw, nn, c64, cmask, w_base,
                        wm_base, COUT_G * (KS * BLOCK_K), CIN_G, ID, IH, IW, OD, OH, OW, x_sc, x_sd, x_sh, x_sw, w_sci, w_sd, w_sh, w_sw,
                        best, win, win_y, pooled,
                        bias, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7, CDT, out_ptr, sa_ptr,
                        o_sn, o_sc, o_sd, o_sh, o_sw, y_sn, y_sc, y_sd, y_sh, y_sw,
                        OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7, HAS_BIAS, POOL, SAVE, BIG, FULL_WINDOWS,
                        TD, TH, TW, SD, SH, SW, PD, PH, PW, DD, DH, DW, KD, KH, KW,
                        USD, USH, USW, UPD, UPH, UPW, LOD, LOH, LOW, NSD, NSH, NSW, KS,
                        PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                    )  # fmt: skip
                    if a_cur.dtype == tl.float32:
                        a_cur = a_cur + (_once - pid_m).to(a_cur.dtype)
        # A runtime branch with one channel block; a static one otherwise (masked stays the int 1,
        # so the shared-tile call above is never compiled without a_all).
        if masked != 0:
            best, win, win_y, pooled = _shift_k_offsets(
                0.0, False, x_rows, i_d0, i_h0, i_w0, m_ok, ck, ud, uh, uw, nn, c64, cmask, w_base,
                w_base, COUT_G, CIN_G, ID, IH, IW, OD, OH, OW, x_sc, x_sd, x_sh, x_sw, w_sci, w_sd, w_sh, w_sw,
                best, win, win_y, pooled,
                bias, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7, CDT, out_ptr, sa_ptr,
                o_sn, o_sc, o_sd, o_sh, o_sw, y_sn, y_sc, y_sd, y_sh, y_sw,
                OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7, HAS_BIAS, POOL, SAVE, BIG, FULL_WINDOWS,
                TD, TH, TW, SD, SH, SW, PD, PH, PW, DD, DH, DW, KD, KH, KW,
                USD, USH, USW, UPD, UPH, UPW, LOD, LOH, LOW, NSD, NSH, NSW, KS,
                PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip

    for kd in tl.static_range(KD * (1 - SHIFT_K)):
        od = ud * USD - UPD + kd
        ok_d = (od >= 0) & (od < OD)
        for kh in tl.static_range(KH):
            oh = uh * USH - UPH + kh
            ok_h = ok_d & (oh >= 0) & (oh < OH)
            for kw in tl.static_range(KW):
                ow = uw * USW - UPW + kw
                o_ok = m_ok & ok_h & (ow >= 0) & (ow < OW)
                if FLAT_K:
                    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    acc = _conv_flat(
                        acc, x_base, w_base, od, oh, ow, o_ok, ck, cmask, CIN_G, ID, IH, IW,
                        x_sc, x_sd, x_sh, x_sw, w_sci, w_sd, w_sh, w_sw,
                        TRANSPOSED, TD, TH, TW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
                        CDT, PRECISION, BIG, BLOCK_K,
                    )  # fmt: skip
                else:
                    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    for td in tl.static_range(TD):
                        if TRANSPOSED * STATIC_D * ((kd - UPD + PD - td * DD) % SD) == 0:
                            i_d, v_d = _in_index(
                                ud, od, kd, td, USD, UPD, SD, PD, DD, ID, TRANSPOSED, STATIC_D
                            )
                            for th in tl.static_range(TH):
                                if TRANSPOSED * STATIC_H * ((kh - UPH + PH - th * DH) % SH) == 0:
                                    i_h, v_h = _in_index(uh, oh, kh, th, USH, UPH, SH, PH, DH, IH, TRANSPOSED,
                                                         STATIC_H)  # fmt: skip
                                    for tw in tl.static_range(TW):
                                        if TRANSPOSED * STATIC_W * ((kw - UPW + PW - tw * DW) % SW) == 0:
                                            i_w, v_w = _in_index(uw, ow, kw, tw, USW, UPW, SW, PW, DW, IW,
                                                                 TRANSPOSED, STATIC_W)  # fmt: skip
                                            valid = o_ok & v_d & v_h & v_w
                                            if BIG:
                                                sp = (i_d.to(tl.int64) * x_sd + i_h.to(tl.int64) * x_sh
                                                      + i_w.to(tl.int64) * x_sw)  # fmt: skip
                                            else:
                                                sp = i_d * x_sd + i_h * x_sh + i_w * x_sw
                                            a_ptrs = (x_base + sp)[:, None]
                                            w_tap = w_base + (td * w_sd + th * w_sh + tw * w_sw)
                                            for k0 in range(0, CIN_G, BLOCK_K):
                                                ci = k0 + ck
                                                ci_ok = ci < CIN_G
                                                a = tl.load(
                                                    a_ptrs + ci[None, :] * x_sc,
                                                    mask=valid[:, None] & ci_ok[None, :],
                                                    other=0.0,
                                                )
                                                b = tl.load(
                                                    w_tap + ci[:, None] * w_sci,
                                                    mask=ci_ok[:, None] & cmask,
                                                    other=0.0,
                                                )
                                                acc = tl.dot(round_tf32(to_compute(a, CDT), PRECISION),
                                                             round_tf32(to_compute(b, CDT), PRECISION),
                                                             acc, input_precision=PRECISION)  # fmt: skip
                first = _first_offset(kd, kh, kw, od, oh, ow)[:, None]
                best, win, win_y, pooled = _offset_epilogue(
                    acc, kd * KH * KW + kh * KW + kw, first, od, oh, ow, o_ok, nn, c64, cmask, best, win, win_y,
                    pooled, bias, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7, CDT, out_ptr,
                    sa_ptr, o_sn, o_sc, o_sd, o_sh, o_sw, y_sn, y_sc, y_sd, y_sh, y_sw,
                    OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7, HAS_BIAS, POOL, SAVE, BIG, False,
                )  # fmt: skip

    if POOL != 0:
        if BIG:
            q = nn * o_sn + ud.to(tl.int64) * o_sd + uh.to(tl.int64) * o_sh + uw.to(tl.int64) * o_sw
        else:
            q = nn * o_sn + ud * o_sd + uh * o_sh + uw * o_sw
        q2 = q[:, None] + c64[None, :] * o_sc
        omask = m_ok[:, None] & cmask
        if POOL == 1:
            tl.store(out_ptr + q2, best.to(out_ptr.dtype.element_ty), mask=omask)
            if SAVE:
                tl.store(sa_ptr + q2, win.to(sa_ptr.dtype.element_ty), mask=omask)
                tl.store(sb_ptr + q2, win_y.to(sb_ptr.dtype.element_ty), mask=omask)
        else:
            div = avg_divisor(ud[:, None], uh[:, None], uw[:, None], OD, OH, OW, KD, KH, KW,
                               USD, USH, USW, UPD, UPH, UPW, COUNT_INCLUDE_PAD, DIVISOR)  # fmt: skip
            tl.store(out_ptr + q2, (pooled / div).to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _shift_k_weight_kernel(
    w_ptr, wm_ptr, CIN_G, COUT_G, w_sci, w_sco, w_sd, w_sh, w_sw,
    TD: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    UPD: tl.constexpr, UPH: tl.constexpr, UPW: tl.constexpr,
    LOD: tl.constexpr, LOH: tl.constexpr, LOW: tl.constexpr,
    NSD: tl.constexpr, NSH: tl.constexpr, NSW: tl.constexpr, KS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program per (window offset, group x output-channel block): writes that offset's
    ``[KS * BLOCK_K, BLOCK_N]`` slice of the prearranged weight matrix (``_shift_k_w_tile``'s tile,
    cast to the matrix's dtype (the compute dtype), then TF32-rounded when PRECISION says so) at
    ``wm_ptr`` (see ``shift_k_weight_matrix``)."""
    kk = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_blocks_n = tl.cdiv(COUT_G, BLOCK_N)
    grp = pid_n // n_blocks_n
    co = (pid_n % n_blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = (co < COUT_G)[None, :]
    kd = kk // (KH * KW)
    kh = (kk // KW) % KH
    kw = kk % KW
    w_base = w_ptr + (grp * CIN_G) * w_sci + co[None, :] * w_sco
    tile = _shift_k_w_tile(w_base, cmask, CIN_G, w_sci, w_sd, w_sh, w_sw, kd, kh, kw,
                           TD, TH, TW, SD, SH, SW, PD, PH, PW, DD, DH, DW, UPD, UPH, UPW,
                           LOD, LOH, LOW, NSD, NSH, NSW, KS, BLOCK_K)  # fmt: skip
    krow = tl.arange(0, KS * BLOCK_K)
    tl.store(wm_ptr + ((grp * (KD * KH * KW) + kk) * COUT_G + co[None, :]) * (KS * BLOCK_K) + krow[:, None],
             round_tf32(tile.to(wm_ptr.dtype.element_ty), PRECISION), mask=cmask)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvGeometry:
    """``aten.convolution``'s hyper-parameters as the kernel sees them (one entry per spatial dim)."""

    transposed: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]
    groups: int


@dataclass(frozen=True)
class _Plan:
    """Everything the launch needs that is derived from shapes and geometry (all lifted to 3d)."""

    conv_out: tuple[int, int, int]  # OD, OH, OW
    units: tuple[int, int, int]  # UD, UH, UW
    window: tuple[int, int, int]  # KD, KH, KW (window offsets per unit)
    unit_stride: tuple[int, int, int]
    unit_origin: tuple[int, int, int]
    static_phase: tuple[bool, bool, bool]
    unrolled: int  # (window offset, tap) pairs the kernel unrolls
    shift_k: bool  # the kernel's SHIFT_K path (static phase along every dim, few input shifts)
    shifts: tuple[tuple[int, int], ...]  # per dim (lowest input shift, number of shifts) for SHIFT_K
    shift_slots: int  # SHIFT_K: the number of distinct input shifts rounded up to a power of 2


def _output_channels_innermost(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``weight`` with the same shape, stored with the output-channel dim innermost (stride 1).

    WHY: every weight tile is ``[K rows, BLOCK_N output channels]``; with the output channel
    contiguous a warp reads whole rows (coalesced, vectorised).  In PyTorch's layouts it is strided
    by C_in/groups x taps (conv) or taps (transposed): 27 lines per warp load on the ConvT3d pipeline.
    The copy is one small kernel (the weight is tiny next to the activations).
    """
    co_dim = 1 if transposed else 0
    if weight.stride(co_dim) == 1 or weight.shape[co_dim] == 1:
        return weight
    return weight.movedim(co_dim, -1).contiguous().movedim(-1, co_dim)


def _pad3(values: Sequence[int], fill: int) -> list[int]:
    return [fill] * (3 - len(values)) + list(values)


def conv_output_size(x: torch.Tensor, weight: torch.Tensor, conv: ConvGeometry) -> list[int]:
    """Spatial sizes of ``aten.convolution(x, weight, ...)``'s output (not lifted)."""
    sizes = []
    for j, size in enumerate(x.shape[2:]):
        sizes.append(conv_output_length(size, weight.shape[2 + j], conv.stride[j], conv.padding[j], conv.dilation[j],
                                        conv.transposed, conv.output_padding[j]))
    return sizes


def _plan(x: torch.Tensor, weight: torch.Tensor, conv: ConvGeometry, pool: PoolGeometry | None,
          pooled_sizes: Sequence[int] | None) -> _Plan:  # fmt: skip
    dims = x.dim() - 2
    conv_out = _pad3(conv_output_size(x, weight, conv), 1)
    taps = _pad3(weight.shape[2:], 1)
    stride, padding, dilation = _pad3(conv.stride, 1), _pad3(conv.padding, 0), _pad3(conv.dilation, 1)
    if pool is not None:
        units = _pad3(pooled_sizes, 1)
        window, ustride, uorigin = _pad3(pool.kernel_size, 1), _pad3(pool.stride, 1), _pad3(pool.padding, 0)
    elif conv.transposed:
        units = [-(-o // s) for o, s in zip(conv_out, stride, strict=True)]
        window, ustride, uorigin = list(stride), list(stride), [0, 0, 0]
    else:
        units, window, ustride, uorigin = list(conv_out), [1, 1, 1], [1, 1, 1], [0, 0, 0]
    static = [conv.transposed and us % s == 0 for us, s in zip(ustride, stride, strict=True)]
    unrolled = 1
    shifts = []
    for j in range(3):
        if static[j]:
            # Input shift of every live (window offset, tap) pair: i = u * (US // S) + shift.
            live = [
                (kp - uorigin[j] + padding[j] - t * dilation[j]) // stride[j]
                for kp in range(window[j]) for t in range(taps[j])
                if (kp - uorigin[j] + padding[j] - t * dilation[j]) % stride[j] == 0
            ]  # fmt: skip
            unrolled *= len(live)
            shifts.append((min(live), max(live) - min(live) + 1) if live else (0, 0))
        else:
            unrolled *= window[j] * taps[j]
            shifts.append((0, 0))
    slots = next_pow2(math.prod(n for _, n in shifts)) if all(static) else 0
    shift_k = all(static) and 0 < slots <= _SHIFT_K_MAX_SLOTS
    del dims
    return _Plan(tuple(conv_out), tuple(units), tuple(window), tuple(ustride), tuple(uorigin),
                 tuple(static), unrolled, shift_k, tuple(shifts), slots)  # fmt: skip


def _full_windows(plan: _Plan) -> bool:
    """Whether every window offset of every unit lies in the conv output (``o = u * US - UP + kp`` in
    ``[0, O)`` for all ``u < U``, ``kp < K``): the ConvT3d pipeline's MaxPool(2) over an even conv
    output."""
    return all(
        up == 0 and (u - 1) * us + k <= o
        for o, u, k, us, up in zip(plan.conv_out, plan.units, plan.window, plan.unit_stride, plan.unit_origin,
                                   strict=True)
    )  # fmt: skip


def unsupported_reason(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv: ConvGeometry,
    pool: PoolGeometry | None,
    pooled_sizes: Sequence[int] | None = None,
    save: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> str | None:
    """Why ``conv_fused_forward`` cannot serve this case, or None when it can.

    ``pooled_sizes``: the pool's output spatial sizes (required with a pool: ceil_mode is not part
    of ``PoolGeometry``).  ``save``: whether the backward state will be written (an avg pool or no
    pool then stores the full conv output, which needs every element covered by some window).
    ``compute_dtype``: the conv's dtype (None: x's), see ``conv_fused_forward``.
    """
    kernel_dtypes = (
        (torch.float32, torch.float16) if _INTERPRET else (torch.float32, torch.float16, torch.bfloat16)
    )
    compute_dtype = compute_dtype or x.dtype
    if any(dtype not in kernel_dtypes for dtype in (x.dtype, weight.dtype, compute_dtype)):
        return (f"x/weight/compute dtypes {x.dtype}/{weight.dtype}/{compute_dtype}: the fused conv covers "
                f"{kernel_dtypes}")  # fmt: skip
    if not 3 <= x.dim() <= 5 or weight.dim() != x.dim():
        return f"x {tuple(x.shape)} / weight {tuple(weight.shape)}: only 1d/2d/3d convolutions"
    if pool is not None and pooled_sizes is None:
        return "pooled_sizes is required with a pool"
    if pool is not None and pool.window_volume > MAX_WINDOW_VOLUME:
        return f"pool window of {pool.window_volume} taps exceeds the unroll limit {MAX_WINDOW_VOLUME}"
    plan = _plan(x, weight, conv, pool, pooled_sizes)
    if math.prod(plan.window) > MAX_WINDOW_VOLUME:
        return f"{math.prod(plan.window)} phases/window offsets exceed the unroll limit {MAX_WINDOW_VOLUME}"
    if plan.unrolled > MAX_UNROLLED_TAPS:
        return f"{plan.unrolled} (window offset, tap) pairs exceed the unroll limit {MAX_UNROLLED_TAPS}"
    if min(plan.conv_out) <= 0:
        return f"empty conv output {plan.conv_out}"
    groups = conv.groups
    if groups > 65535:
        return f"{groups} groups exceed the grid's second dimension"
    if pool is not None and save and pool.kind == "avg":
        for o, u, k, s, p in zip(
            plan.conv_out, plan.units, plan.window, plan.unit_stride, plan.unit_origin, strict=True
        ):
            if s > k or (u - 1) * s - p + k < o:
                return "avg pool with saved state: some conv-output elements lie in no pool window"
    n = x.shape[0]
    if n * math.prod(plan.units) > _INT32_LIMIT:
        return f"{n * math.prod(plan.units)} tile units exceed int32"
    cout = weight.shape[1] * groups if conv.transposed else weight.shape[0]
    per_sample = max(x[0].numel(), cout * math.prod(plan.conv_out))
    if per_sample > _INT32_LIMIT:
        return f"one sample spans {per_sample} elements (> 2**31 - 1): not handled"
    return None


#: Tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the general paths.
_GENERAL_TILES = (
    # narrow problems (C_in 16, C_out 32; taps unrolled, so stages matter little)
    (128, 32, 16, 4, 2), (64, 32, 16, 4, 2), (256, 32, 16, 8, 2), (64, 32, 16, 2, 2), (128, 16, 16, 4, 2),
    # wide problems (Conv2d 64->64 k3: C_in = C_out = 64, one pipelined K loop of 9 taps x channel
    # blocks)
    (128, 64, 32, 4, 3), (128, 64, 32, 8, 4), (64, 64, 32, 4, 4), (256, 64, 32, 8, 3),
    (128, 64, 64, 8, 3), (128, 128, 32, 8, 3), (64, 128, 32, 4, 3),
)  # fmt: skip
#: Tiles of the SHIFT_K path (the ConvT3d pipeline), all with BLOCK_K = SHIFT_K_BLOCK_K.  NOTE: one
#: accumulator lives at a time; the X tile (ConvT3d pipeline fp32 at BLOCK_M 128: 64 KB) stays in
#: shared memory for all window offsets.  With one channel block, two stages let Triton prefetch the
#: next offset's slice of the prearranged weight matrix (``cp.async`` into a double buffer; ConvT3d
#: pipeline fp32 M128 N32 8 warps: 205 registers, 96 KB shared, no spills); with several blocks they
#: pipeline the K loop.
_SHIFT_K_TILES = (
    (64, 32, 16, 4, 1), (128, 32, 16, 4, 1), (128, 32, 16, 8, 1), (256, 32, 16, 8, 1),
    (64, 64, 16, 4, 1), (128, 64, 16, 8, 1), (128, 16, 16, 4, 1),
    (64, 32, 16, 4, 2), (128, 32, 16, 8, 2), (128, 64, 16, 8, 2),
)  # fmt: skip


def _tile(cfg: triton.Config) -> tuple[int, int, int, int, int]:
    kw = cfg.kwargs
    return kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], cfg.num_warps, cfg.num_stages


def _configs() -> list[triton.Config]:
    """Autotuning space on CUDA: both paths' tiles (``_prune`` keeps the path's own, per shape)."""
    configs = []
    for bm, bn, bk, warps, stages in dict.fromkeys(_GENERAL_TILES + _SHIFT_K_TILES):
        configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps,
                                     num_stages=stages))  # fmt: skip
    return configs


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Keep the tiles of the launched path (``SHIFT_K`` or not); drop tiles much wider than the
    problem (masked lanes cost full MMA work)."""
    shift_k = kwargs.get("SHIFT_K", False)
    tiles = set(_SHIFT_K_TILES if shift_k else _GENERAL_TILES)
    configs = [c for c in configs if _tile(c) in tiles] or configs
    if shift_k and not kwargs["ONE_CBLOCK"]:  # several channel blocks: a K loop, which needs two stages
        configs = [c for c in configs if c.num_stages > 1] or configs
    if shift_k and kwargs["ONE_CBLOCK"] and kwargs.get("CDT", 0) == 0:
        # fp32 shared X tile at 32+ rows per warp (4 warps, BLOCK_M >= 128): ptxas spills (the ConvT3d
        # pipeline, sm_90: 8-932 bytes; tools/compile_check.py conv_fused --tiles M,N,K,4,S shows it); M256
        # with 8 warps does not.
        configs = [c for c in configs if not (c.num_warps == 4 and c.kwargs["BLOCK_M"] >= 128)] or configs
    bn_max = max(16, next_pow2(int(named_args["COUT_G"])))
    bk_max = SHIFT_K_BLOCK_K if shift_k else max(16, next_pow2(int(named_args["CIN_G"])))
    kept = [c for c in configs if c.kwargs["BLOCK_N"] <= bn_max and c.kwargs["BLOCK_K"] <= bk_max]
    kept = kept or [min(configs, key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]
    # the heuristic tile first, then the others in list order
    h = _heuristic_config(int(named_args["CIN_G"]), int(named_args["COUT_G"]), int(named_args["M_TOTAL"]), shift_k)
    preferred = (h["BLOCK_M"], h["BLOCK_N"], h["BLOCK_K"], h.get("num_warps"), h.get("num_stages"))
    return best_first(sorted(kept, key=lambda c: _tile(c) != preferred))


_conv_fused_fwd_tuned = triton.autotune(
    configs=_configs(),
    # the path constexprs are in the key: two geometries with equal sizes must not share a tile
    key=["CIN_G", "COUT_G", "M_TOTAL", "C_OUT", "TRANSPOSED", "FLAT_K", "SHIFT_K", "KS", "KD", "KH", "KW", "CDT"],
    prune_configs_by={"early_config_prune": _prune},
    cache_results=True,  # the best tile per key is kept in Triton's cache dir across processes
)(_conv_fused_fwd_kernel)


def _heuristic_config(cin_g: int, cout_g: int, m_total: int, shift_k: bool = False) -> dict[str, int]:
    """One tile for the interpreter (small blocks: numpy cost grows with tile size) or when
    ``FUSION_CONV_AUTOTUNE=0``."""
    block_n = min(max(16, next_pow2(cout_g)), 64)
    block_k = SHIFT_K_BLOCK_K if shift_k else min(max(16, next_pow2(cin_g)), 32)
    if _INTERPRET:
        block_m = min(max(16, next_pow2(m_total)), 64)
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    if shift_k:  # see _SHIFT_K_TILES
        return dict(BLOCK_M=128, BLOCK_N=min(block_n, 32), BLOCK_K=block_k, num_warps=8, num_stages=2)
    return dict(
        BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4 if block_n <= 32 else 8, num_stages=3
    )


class _Launch:
    """One launch plan of ``_conv_fused_fwd_kernel``: its integer arguments and constexprs, and a
    :class:`FastLaunch` once the tile is known (the heuristic tile at once; with autotuning, the
    tile the autotuner picked on the first call)."""

    def __init__(self, ints: tuple[int, ...], constexprs: dict, m_total: int, groups: int, cout_g: int,
                 cout: int, cfg: dict | None, weight_matrix: _WeightMatrixLaunch | None,
                 first_tile: dict) -> None:  # fmt: skip
        self.ints, self.constexprs, self.cout = ints, constexprs, cout
        self.transposed = bool(constexprs["TRANSPOSED"])
        self.m_total, self.groups, self.cout_g = m_total, groups, cout_g
        self.fast = None if cfg is None else self._bind(cfg)
        #: the tile the autotuner times first (``_prune``'s first), which ``probe`` binds
        self.first_tile = first_tile
        #: None: the kernel reads the weight with its output channels innermost (``_output_channels_innermost``).
        self.weight_matrix = weight_matrix

    def grid(self, meta: dict) -> tuple[int, int]:
        return (cdiv(self.m_total, meta["BLOCK_M"]), self.groups * cdiv(self.cout_g, meta["BLOCK_N"]))

    def probe(self) -> _Launch:
        """This plan bound to the tile the autotuner times first: one compile instead of up to
        ``MAX_TUNED_CONFIGS``, to screen the path before tuning it (``impl_choice.choose``'s
        ``probes``; the tuned plan then finds that tile compiled)."""
        probe = copy.copy(self)
        probe.fast = self._bind(self.first_tile)
        return probe

    def _bind(self, meta: dict) -> FastLaunch:
        return FastLaunch(_conv_fused_fwd_kernel, self.grid(meta), {**self.constexprs, **meta}, fixed=self.ints)

    def run(self, x: torch.Tensor, weight: torch.Tensor, params: torch.Tensor, out: torch.Tensor,
            saved_a: torch.Tensor | None, saved_b: torch.Tensor | None) -> None:  # fmt: skip
        """Launch for tensors like the ones this plan was made for (``conv_fused_forward``'s
        arguments; ``params``: ``build_params`` of its steps and bias)."""
        if self.weight_matrix is not None:
            w, wm = weight, self.weight_matrix(weight)
        else:
            w = wm = _output_channels_innermost(weight, self.transposed)
        self((x, w, wm, params, out, saved_a if saved_a is not None else out,
              saved_b if saved_b is not None else out))  # fmt: skip

    def __call__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        if self.fast is not None:
            self.fast(*tensors)
            return
        launched = launch(_conv_fused_fwd_tuned, self.grid, *tensors, *self.ints, **self.constexprs)
        best = getattr(_conv_fused_fwd_tuned, "best_config", None)  # the tile of this call's key
        if launched and best is not None:
            self.fast = self._bind(best.all_kwargs())


class _WeightMatrixLaunch:
    """The launch of ``_shift_k_weight_kernel`` for one plan: ``(weight) -> prearranged matrix``."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, ints: tuple[int, ...], constexprs: dict,
                 grid: tuple[int, int]) -> None:  # fmt: skip
        self.shape, self.dtype = shape, dtype
        self.launch = FastLaunch(_shift_k_weight_kernel, grid, constexprs, fixed=ints)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        matrix = torch.empty(self.shape, dtype=self.dtype, device=weight.device)
        self.launch(weight, matrix)
        return matrix


def shift_k_weight_matrix(weight: torch.Tensor, plan: _Plan, conv: ConvGeometry, precision: str,
                          dtype: torch.dtype) -> _WeightMatrixLaunch:  # fmt: skip
    """The launch that writes the SHIFT_K path's prearranged weight matrix of a transposed conv.

    Matrix: ``(groups, KD * KH * KW, COUT_G, KS * SHIFT_K_BLOCK_K)``, ``dtype`` (the compute dtype:
    an fp32 weight under autocast is cast here, for free), contiguous.  Row ``(s, c)`` of window offset ``kk`` holds ``w[group's input channel c, co, tap]``
    for the tap that carries input shift ``s`` to offset ``kk``, and 0 for a dead (offset, shift)
    pair, a padding shift slot or ``c >= CIN_G``; fp32 values are rounded to TF32 with
    ``precision == "tf32"`` (``kernels.tf32``).
    K (the row) innermost: fp32 (TF32) wgmma wants B K-major in shared memory, so an output-channel-
    innermost matrix was stored there element by element (16 STS.32 per thread and offset on the
    ConvT3d pipeline, fp32 M128 N32 w8); K-contiguous rows give 4 LDG.128 + 4 STS.128.
    WHY: the main kernel's per-offset weight tile is then one contiguous, unmasked load that feeds
    the dot directly (no per-row tap arithmetic, no rounding per program, and Triton can pipeline
    it); one small launch per call replaces the weight relayout copy it made before.
    """
    groups = conv.groups
    cin_g, cout_g = weight.shape[0] // groups, weight.shape[1]
    offsets = math.prod(plan.window)
    rows = plan.shift_slots * SHIFT_K_BLOCK_K
    block_n = min(max(16, next_pow2(cout_g)), 64)
    taps = _pad3(weight.shape[2:], 1)
    stride, padding, dilation = _pad3(conv.stride, 1), _pad3(conv.padding, 0), _pad3(conv.dilation, 1)
    w_str = weight.stride()
    constexprs = dict(
        TD=taps[0], TH=taps[1], TW=taps[2], SD=stride[0], SH=stride[1], SW=stride[2],
        PD=padding[0], PH=padding[1], PW=padding[2], DD=dilation[0], DH=dilation[1], DW=dilation[2],
        KD=plan.window[0], KH=plan.window[1], KW=plan.window[2],
        UPD=plan.unit_origin[0], UPH=plan.unit_origin[1], UPW=plan.unit_origin[2],
        LOD=plan.shifts[0][0], LOH=plan.shifts[1][0], LOW=plan.shifts[2][0],
        NSD=plan.shifts[0][1], NSH=plan.shifts[1][1], NSW=plan.shifts[2][1], KS=plan.shift_slots,
        PRECISION=precision, BLOCK_K=SHIFT_K_BLOCK_K, BLOCK_N=block_n,
    )  # fmt: skip
    ints = (cin_g, cout_g, w_str[0], w_str[1], *_pad3(w_str[2:], 0))
    grid = (offsets, groups * cdiv(cout_g, block_n))
    return _WeightMatrixLaunch((groups, offsets, cout_g, rows), dtype, ints, constexprs, grid)


#: Launch plans by ``_launch_key``.
_LAUNCHES = BoundedCache(256)


def _launch_key(x, weight, bias, steps, conv, pool, out, saved_a, saved_b, allow_tf32, compute_dtype) -> tuple:  # noqa: ANN001
    """Everything ``_prepare``'s result depends on (shapes, strides, dtypes, geometry, op codes,
    precision, and the module switches tests change)."""
    return (
        tensor_key(x), tensor_key(weight), bias is None, tuple((int(code), len(values)) for code, values in steps), conv, pool,
        tensor_key(out), tensor_key(saved_a), tensor_key(saved_b), bool(allow_tf32), compute_dtype,
        environment.measuring(), _BIG_INDEX_THRESHOLD,
    )  # fmt: skip


def _prepare(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    steps: Sequence[KernelStep],
    conv: ConvGeometry,
    pool: PoolGeometry | None,
    out: torch.Tensor,
    saved_a: torch.Tensor | None,
    saved_b: torch.Tensor | None,
    allow_tf32: bool,
    compute_dtype: torch.dtype,
) -> _Launch:
    """Validate a call and derive its launch (everything but the tensors' data); see
    ``conv_fused_forward``.  Depends only on what ``_launch_key`` records."""
    is_max = pool is not None and pool.kind == "max"
    save = saved_a is not None
    if is_max and save != (saved_b is not None):
        raise ValueError("a max pool saves both saved_a (winner) and saved_b (winner value), or neither")
    if not is_max and saved_b is not None:
        raise ValueError("saved_b is only written with a max pool")
    pooled_sizes = list(out.shape[2:]) if pool is not None else None
    why = unsupported_reason(x, weight, conv, pool, pooled_sizes, save, compute_dtype)
    if why is not None:
        raise ValueError(f"conv_fused_forward cannot run this case: {why}")
    plan = _plan(x, weight, conv, pool, pooled_sizes)
    dims = x.dim() - 2
    n, groups = x.shape[0], conv.groups
    cin_g = x.shape[1] // groups
    cout_g = weight.shape[1] if conv.transposed else weight.shape[0] // groups
    cout = cout_g * groups
    conv_out_shape = [n, cout, *plan.conv_out[3 - dims :]]
    expected_out = conv_out_shape if pool is None else [n, cout, *pooled_sizes]
    if list(out.shape) != expected_out:
        raise ValueError(f"out must have shape {expected_out}, got {tuple(out.shape)}")
    if is_max and save:
        for name, t in (("saved_a", saved_a), ("saved_b", saved_b)):
            if t.shape != out.shape or t.stride() != out.stride():
                raise ValueError(f"{name} must have out's shape and strides {tuple(out.shape)}/{out.stride()}, "
                                 f"got {tuple(t.shape)}/{t.stride()}")  # fmt: skip
        if saved_a.dtype not in (torch.int8, torch.int32):
            raise ValueError(f"the winner index must be int8 or int32, got {saved_a.dtype}")
    elif save and list(saved_a.shape) != conv_out_shape:
        raise ValueError(
            f"saved_a must have the conv output's shape {conv_out_shape}, got {tuple(saved_a.shape)}"
        )
    x_strides = lift_5d(x)[1]
    o_strides = lift_5d(out)[1]
    y_strides = lift_5d(saved_a)[1] if save and not is_max else [0] * 5
    precision = dot_precision(compute_dtype, allow_tf32, _INTERPRET)
    one_cblock = cin_g <= SHIFT_K_BLOCK_K
    # SHIFT_K with one channel block reads the prearranged matrix; its masked variant (tiles with
    # inf/NaN only) reads the weight as it is.  Every other path reads the relaid weight.
    weight_matrix = None
    if plan.shift_k and one_cblock:
        weight_matrix = shift_k_weight_matrix(weight, plan, conv, precision, compute_dtype)
        w_str = list(weight.stride())
    else:  # the strides of the weight as launched (a copy only on this cache miss; exact for any layout)
        w_str = list(_output_channels_innermost(weight, conv.transposed).stride())
    w_sci, w_sco = (w_str[0], w_str[1]) if conv.transposed else (w_str[1], w_str[0])
    w_taps = _pad3(w_str[2:], 0)
    m_total = n * math.prod(plan.units)
    big = any(t.numel() > _BIG_INDEX_THRESHOLD for t in (x, out, saved_a, saved_b) if t is not None)
    if pool is None:
        pool_args = dict(COUNT_INCLUDE_PAD=True, DIVISOR=0)
    else:
        pool_args = dict(
            COUNT_INCLUDE_PAD=bool(pool.count_include_pad), DIVISOR=int(pool.divisor_override or 0)
        )
    taps = _pad3(weight.shape[2:], 1)
    stride, padding, dilation = _pad3(conv.stride, 1), _pad3(conv.padding, 0), _pad3(conv.dilation, 1)
    ints = (
        cout, cin_g, cout_g, m_total,
        *_pad3(x.shape[2:], 1), *plan.conv_out, *plan.units,
        *x_strides, w_sci, w_sco, *w_taps, *o_strides, *y_strides,
    )  # fmt: skip
    constexprs = dict(
        **op_constexprs(steps), HAS_BIAS=bias is not None,
        POOL=0 if pool is None else (1 if is_max else 2), SAVE=save, TRANSPOSED=bool(conv.transposed),
        TD=taps[0], TH=taps[1], TW=taps[2], SD=stride[0], SH=stride[1], SW=stride[2],
        PD=padding[0], PH=padding[1], PW=padding[2], DD=dilation[0], DH=dilation[1], DW=dilation[2],
        KD=plan.window[0], KH=plan.window[1], KW=plan.window[2],
        USD=plan.unit_stride[0], USH=plan.unit_stride[1], USW=plan.unit_stride[2],
        UPD=plan.unit_origin[0], UPH=plan.unit_origin[1], UPW=plan.unit_origin[2],
        STATIC_D=plan.static_phase[0], STATIC_H=plan.static_phase[1], STATIC_W=plan.static_phase[2],
        **pool_args, CDT=compute_code(compute_dtype), PRECISION=precision, BIG=big, FLAT_K=not any(plan.static_phase), SHIFT_K=plan.shift_k,
        ONE_CBLOCK=one_cblock, KS=max(plan.shift_slots, 1), FULL_WINDOWS=_full_windows(plan),
        LOD=plan.shifts[0][0], LOH=plan.shifts[1][0], LOW=plan.shifts[2][0],
        NSD=plan.shifts[0][1], NSH=plan.shifts[1][1], NSW=plan.shifts[2][1],
    )  # fmt: skip
    macs = m_total * cout_g * cin_g * plan.unrolled
    tuned = not (_INTERPRET or not environment.measuring() or macs < _AUTOTUNE_MIN_MACS)
    if tuned:
        first = _prune(_configs(), {"CIN_G": cin_g, "COUT_G": cout_g, "M_TOTAL": m_total}, **constexprs)[0]
        first_tile = dict(first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)
    else:
        first_tile = _heuristic_config(cin_g, cout_g, m_total, plan.shift_k)
    return _Launch(ints, constexprs, m_total, groups, cout_g, cout, None if tuned else first_tile, weight_matrix,
                   first_tile)


def conv_fused_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    steps: Sequence[KernelStep],
    conv: ConvGeometry,
    pool: PoolGeometry | None,
    out: torch.Tensor,
    saved_a: torch.Tensor | None = None,
    saved_b: torch.Tensor | None = None,
    allow_tf32: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> None:
    """Write ``out = pool(chain(conv(x, weight) + bias))`` (and the backward state) in one launch.

    Args:
      x: (N, C_in, *spatial) with 1 to 3 spatial dims, fp32/fp16/bf16, any strides.
      weight: conv ``(C_out, C_in/groups, *k)`` or transposed ``(C_in, C_out/groups, *k)``,
        fp32/fp16/bf16, any strides.
      bias: None or C_out values (any float dtype), rounded to the compute dtype and added in fp32
        to the conv output (after it is rounded to the compute dtype) before the chain.
      steps: the chain, as for ``epilogue.epilogue_forward`` (up to MAX_SLOTS steps).
      conv: the conv hyper-parameters.  pool: None or the pool over the chain's result.
      out: preallocated result (N, C_out, *pooled or conv-output spatial), any float dtype and strides.
      saved_a, saved_b: None (nothing saved), or the backward state, in ``epilogue_forward``'s format:
        max pool: winner index in its window (int8/int32, out's shape and strides) and the conv output
        without bias at the winner (the compute dtype, out's shape and strides); avg pool / none: ``saved_a``
        receives the full conv output without bias ((N, C_out, *conv-output spatial), the compute dtype, any
        strides) and ``saved_b`` is None.
      allow_tf32: fp32 operands use TF32 tensor cores (pass ``torch.backends.cudnn.allow_tf32``);
        ignored under the interpreter.
      compute_dtype: the conv's dtype (None: x's): x and weight are cast to it as they are loaded
        (exactly ``conv(x.to(compute_dtype), weight.to(compute_dtype))``: autocast's casts without a
        pass of their own), and the conv output is rounded to it, as it is stored in the library path.
        The saved conv output has this dtype.
    Raises ValueError when ``unsupported_reason`` names a reason or the tensors disagree.
    """
    launch = forward_launch(x, weight, bias, steps, conv, pool, out, saved_a, saved_b, allow_tf32, compute_dtype)
    if launch is not None:
        launch.run(x, weight, build_params(steps, bias, launch.cout, x.device), out, saved_a, saved_b)


def forward_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    steps: Sequence[KernelStep],
    conv: ConvGeometry,
    pool: PoolGeometry | None,
    out: torch.Tensor,
    saved_a: torch.Tensor | None = None,
    saved_b: torch.Tensor | None = None,
    allow_tf32: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> _Launch | None:
    """The checked launch plan of ``conv_fused_forward`` for these arguments (cached per shapes,
    strides, dtypes, geometry, op codes and precision), or None when ``out`` is empty (nothing to
    launch; the arguments are still checked).  Its ``run(x, weight, params, out, saved_a, saved_b)``
    launches for tensors laid out like these: a caller that keeps it (a per-signature call plan)
    skips the cache lookup.  Raises ValueError as ``conv_fused_forward`` does."""
    compute_dtype = compute_dtype or x.dtype
    args = (x, weight, bias, steps, conv, pool, out, saved_a, saved_b, allow_tf32, compute_dtype)
    if out.numel() == 0:
        _prepare(*args)  # validates
        return None
    return _LAUNCHES.get(_launch_key(*args), lambda: _prepare(*args))
