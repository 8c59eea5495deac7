"""Backward of a transposed conv whose max pool lines up with the conv's phases (the SHIFT_K idea, reversed).

WHY: the ConvT3d pipeline (ConvTranspose3d(16->32, k3, s2, p1, op1) then MaxPool3d(2) on
16x16x16x32x32, ``demos/seeds/convt3d_leaky_mul_leaky_maxpool.py``) trains through
``conv_fused_bwd``'s generic kernels: 1.7 ms (input grad) + 2.6 ms (weight grad) in fp32 on an
H100.  They treat the pooled gradient as a sparse full-size gradient and walk taps.  When the pool
stride equals the conv stride on every dim, a pooled unit ``u`` and a window offset ``kp`` address
the conv output ``o = u*US - UP + kp``, and every live (offset, tap) pair reads the input at
``i = u + j`` with a COMPILE-TIME shift ``j``: the same structure as the forward's SHIFT_K path
(``conv_fused._shift_k_*``), so both gradients become a few large dense GEMMs over the compact
gradient, with no per-tap index arithmetic and nothing full-size ever written.

Notation (per spatial dim, every rank lifted to 3d): conv stride ``s``, padding ``p``, dilation
``dl``, taps ``T``; pool kernel ``KP``, pool stride ``US == s``, pool padding ``UP`` (pool dilation 1).
Offset ``kp`` and tap ``t`` form a *live pair* iff ``(kp - UP + p - t*dl) % s == 0``; the pair reads
``i = u + j`` with ``j = (kp - UP + p - t*dl) // s``.  The distinct shifts along a dim are
``LO .. LO+NS-1``; a given (kp, j) has at most one tap, a given (kp, t) exactly one j.  The ConvT3d
pipeline: 2 shifts per dim, 8 in all, 27 live (offset, shift) pairs of 64 (one per tap).

The compact gradient is ``PooledGrad(g_win, winner, ...)`` (``conv_fused_bwd``): ``Gexp[n, u, kp, co]
= g_win[n, co, u]`` if ``winner[n, co, u] == kp`` and ``o`` lies inside the conv output, else 0.
It is built in registers with ``tl.where`` from the compact form, never materialised in memory.
Overlapping windows (``KP > s``) need nothing special: each (window, offset) is its own column.

Kernels (weights of a transposed conv are ``w[ci, co, t]`` per group):

* input grad ``dx[n, ci, i] = sum_{j, kp, co} Gexp[n, i - j, kp, co] * w[ci, co, t(kp, j)]``:
  M = input positions (n, i), N = ci, K = (kp, co).  Outer runtime loop over the shifts j (and
  output-channel blocks): the compact tile at ``u = i - j`` is loaded, rounded and checked once;
  inner runtime loop over a host-built table of the shift's *live blocks* (``KPB`` consecutive
  window offsets holding at least one live pair): A = Gexp ``[BLOCK_M, BLOCK_CO * KPB]``, B = the
  weight rows of (kp, j), zero for dead pairs.  ``KPB`` = all offsets is the plain "one dot per
  shift" form; ``KPB = 1`` skips every dead pair (the ConvT3d pipeline: 27 of 64 blocks run).
  Every dx element is written once, no atomics.
* weight grad ``dw[ci, co, t] = sum_{n, u, kp live for t} x[n, ci, u + j(kp, t)] * Gexp[n, u, kp, co]``:
  the reduction runs over chunks of units (one chunk per program along grid axis 0).  Per block of
  ``BLOCK_M`` units, ``P^T += Gexp^T @ X`` with X the ``[BLOCK_M, KS shifts x BLOCK_CI]`` tile of
  the forward's ``_shift_k_x_tile`` (0 outside x) and Gexp^T ``[BLOCK_CO * KPB, BLOCK_M]`` (the
  expanded tile is the wgmma A operand in registers, X goes to shared memory as B).  Each program
  writes an fp32 partial for every (shift, offset) pair of its (group, channel, offset) tile; a
  finish kernel sums, per tap, its live pairs over all partials in a fixed order and writes ``dw``
  (bitwise reproducible run to run; dead pairs are computed but never read).
* bias grad: ``conv_fused_bwd.conv_bias_grad`` (sum of ``g_win``).

Numerics: ``tl.dot`` with fp32 accumulation; operands in x's dtype (``Gexp`` is rounded to it, as
``conv_fused_bwd`` does: aten's backward would see a gradient of the conv's dtype); fp32 uses TF32
iff ``torch.backends.cudnn.allow_tf32`` (never under the interpreter), operands rounded to nearest
first (``kernels.tf32``).

Non-finite values reach the outputs the float64 aten reference puts them in (tested): in the input
grad, dead (offset, shift) pairs are zero on BOTH sides, so an inf in ``g_win`` or ``w`` never
meets a structural zero.  In the weight grad, the X tile reads 0 where ``u + shift`` lies outside x
(a *border* unit), and 0 * inf would poison that shift's partial: the main loop leaves inf/NaN
gradients of border units out, and a fix-up pass (run only by programs that met one) adds their
masked outer products with the x values inside (selecting products, not operands).  Two
differences remain, both only when x itself holds inf/NaN: (1) at a border position whose
shifted unit lies outside the pooled grid, it spreads to fewer taps of ``dw[ci]`` than aten's CPU
im2col path, which multiplies it by the conv's zero padding; (2) x inf times an inf gradient of a
border unit gives NaN where aten gives +-inf.

Public API (mirrors ``conv_fused_bwd`` so that the two are interchangeable):
``unsupported_reason(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups)``
and ``convolution_backward(..., output_mask)``.  How to wire: in ``ops/conv_epilogue.py``'s
backward, try ``conv_shift_bwd.unsupported_reason(...)`` first and fall back to ``conv_fused_bwd``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import environment
from .conv_fused_bwd import (
    Grad,
    PooledGrad,
    conv_bias_grad,
    conv_output_spatial,
    pooled_spatial,
)
from .host import (
    INTERPRETER,
    BoundedCache,
    best_first,
    cdiv,
    element_extent,
    lift3,
    lift_5d,
    next_pow2,
    persistent_device_copies,
    tensor_key,
)
from .launch import FastLaunch, launch
from .tf32 import backward_dot_precision, compute_code, round_tf32, to_compute

_INTERPRET = INTERPRETER  # kernels/host.py: whether Triton's interpreter is on
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Most distinct input shifts (rounded up to a power of 2): the weight-grad X tile is
#: ``[slots * BLOCK_CI, BLOCK_M]`` and its accumulator ``slots * BLOCK_CI`` rows.
MAX_SHIFT_SLOTS = 8
#: Most pool-window offsets (KD * KH * KW): columns of the weight grad's partial.
MAX_WINDOW_VOLUME = 64
#: Offsets of every tensor (and of its masked neighbours) stay int32: tensors may span at most
#: half the int32 range (room for the masked out-of-range offsets of shifted loads).
_INDEX_LIMIT = 2**30
#: Header of the input-grad live-block table: (start row, row count) for every KPB <= MAX_WINDOW_VOLUME.
_TABLE_HEADER = tl.constexpr(2 * (MAX_WINDOW_VOLUME + 1))


# --------------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _tap_of(kp, j, UP: tl.constexpr, P: tl.constexpr, S: tl.constexpr, DIL: tl.constexpr, T: tl.constexpr):
    """Tap ``t`` linking window offset ``kp`` to input shift ``j`` along one dim
    (``kp - UP + P - t*DIL == S*j``), and whether it exists (``0 <= t < T``)."""
    num = kp - UP + P - S * j
    t = num // DIL
    return t, (num >= 0) & (num % DIL == 0) & (t < T)


@triton.jit
def _load_pooled(g_ptr, v_ptr, n, ud, uh, uw, row_ok, ch, ch_ok,
                 g_sn, g_sc, g_sd, g_sh, g_sw, v_sn, v_sc, v_sd, v_sh, v_sw, CL: tl.constexpr):  # fmt: skip
    """``g_win`` (its dtype) and ``winner`` (int32, -1 where masked) at units ``(n, ud, uh, uw)``
    (``[BLOCK_M]`` each) x channels ``ch`` (``[BLOCK_CO]``), as ``[BLOCK_M, BLOCK_CO]`` tiles.

    Each tile is loaded with the memory-contiguous axis last (Triton's thread order, coalesced:
    ``CL`` says channels are that axis) and transposed in registers where needed.
    """
    g_row = n * g_sn + ud * g_sd + uh * g_sh + uw * g_sw
    v_row = n * v_sn + ud * v_sd + uh * v_sh + uw * v_sw
    if CL:
        mask = row_ok[:, None] & ch_ok[None, :]
        g = tl.load(g_ptr + g_row[:, None] + (ch * g_sc)[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + v_row[:, None] + (ch * v_sc)[None, :], mask=mask, other=-1).to(tl.int32)
    else:
        mask = ch_ok[:, None] & row_ok[None, :]
        g = tl.trans(tl.load(g_ptr + g_row[None, :] + (ch * g_sc)[:, None], mask=mask, other=0.0))
        v = tl.trans(tl.load(v_ptr + v_row[None, :] + (ch * v_sc)[:, None], mask=mask, other=-1).to(tl.int32))
    return g, v


@triton.jit
def _valid_winner(v, ud, uh, uw, row_ok, OD, OH, OW,
                  SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                  UPD: tl.constexpr, UPH: tl.constexpr, UPW: tl.constexpr,
                  KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, ROWS_FIRST: tl.constexpr):  # fmt: skip
    """``v`` (winners of the units ``(ud, uh, uw)``, ``[BLOCK_M]`` each; ``[BLOCK_M, BLOCK_CO]`` when
    ``ROWS_FIRST``, else ``[BLOCK_CO, BLOCK_M]``), with
    -1 where the row is masked or the winner is no window offset whose conv-output position
    ``o = u*US - UP + kp`` exists (such a winner contributes nothing, as in ``conv_fused_bwd``).

    NOTE: checked once per compact element, not per (row, offset) of the expanded tile: a
    ``[BLOCK_M, KPB]`` mask took the 3d expansion's layout (all rows of a column in one thread's
    registers) and the input-grad kernel hit 255 registers."""
    if ROWS_FIRST:
        od0, oh0, ow0, r_ok = (
            (ud * SD - UPD)[:, None],
            (uh * SH - UPH)[:, None],
            (uw * SW - UPW)[:, None],
            row_ok[:, None],
        )
    else:
        od0, oh0, ow0, r_ok = (
            (ud * SD - UPD)[None, :],
            (uh * SH - UPH)[None, :],
            (uw * SW - UPW)[None, :],
            row_ok[None, :],
        )
    od = od0 + v // (KH * KW)
    oh = oh0 + (v // KW) % KH
    ow = ow0 + v % KW
    ok = (r_ok & (v >= 0) & (v < KD * KH * KW) & (od >= 0) & (od < OD) & (oh >= 0) & (oh < OH)
          & (ow >= 0) & (ow < OW))  # fmt: skip
    return tl.where(ok, v, -1)


@triton.jit
def _expand(g, v, kp, live, BLOCK_M: tl.constexpr, KPB: tl.constexpr, BLOCK_CO: tl.constexpr):
    """``Gexp`` ``[BLOCK_M, BLOCK_CO * KPB]`` from the compact ``[BLOCK_M, BLOCK_CO]`` tiles ``g`` and
    ``v`` (validated winners): column ``c * KPB + q`` (channel ``c``, offset ``kp[q]``) holds ``g``
    where the winner is ``kp[q]`` and ``live[q]``, else 0."""
    sel = (v[:, :, None] == kp[None, None, :]) & live[None, None, :]
    return tl.reshape(tl.where(sel, g[:, :, None], 0.0), [BLOCK_M, BLOCK_CO * KPB])


@triton.jit
def _unit_rows(m0, hi, UD, UH, UW, BLOCK_M: tl.constexpr, CARRY: tl.constexpr):
    """Units ``m0 .. m0 + BLOCK_M`` (row-major over (N, UD, UH, UW)) as ``(n, ud, uh, uw, m < hi)``.

    ``CARRY`` (``BLOCK_M <= UW``: the block spans at most two lines): ``m0`` is decomposed once as
    scalars and each row adds its index with one carry per dim.
    NOTE: Triton's integer division by a runtime value is ~20 SASS instructions, and the row
    vectors are rematerialised per element in each layout they feed: with per-row divisions the
    row arithmetic was about half of the weight-grad loop."""
    r = tl.arange(0, BLOCK_M)
    if CARRY:
        q_w = m0 // UW
        q_h = q_w // UH
        q_d = q_h // UD
        uw = (m0 - q_w * UW) + r
        c = uw >= UW
        uw = tl.where(c, uw - UW, uw)
        uh = (q_w - q_h * UH) + c.to(tl.int32)
        c = uh >= UH
        uh = tl.where(c, uh - UH, uh)
        ud = (q_h - q_d * UD) + c.to(tl.int32)
        c = ud >= UD
        ud = tl.where(c, ud - UD, ud)
        n = q_d + c.to(tl.int32)
    else:
        m = m0 + r
        uw = m % UW
        rest = m // UW
        uh = rest % UH
        rest = rest // UH
        ud = rest % UD
        n = rest // UD
    return n, ud, uh, uw, m0 + r < hi


@triton.jit
def _shift_bits(ud, uh, uw, m_ok, ID, IH, IW, LOD: tl.constexpr, LOH: tl.constexpr, LOW: tl.constexpr,
                NSD: tl.constexpr, NSH: tl.constexpr, NSW: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Per unit (``[BLOCK_M]``), bit ``s`` set iff input shift ``s`` (flat ``(sd*NSH + sh)*NSW + sw``)
    reads inside x: ``u + LO + (sd, sh, sw)`` within ``(ID, IH, IW)``; 0 for masked rows."""
    bits = tl.zeros([BLOCK_M], tl.int32)
    for sidx in tl.static_range(NSD * NSH * NSW):
        xd = ud + (LOD + sidx // (NSW * NSH))
        xh = uh + (LOH + (sidx // NSW) % NSH)
        xw = uw + (LOW + sidx % NSW)
        ok = m_ok & (xd >= 0) & (xd < ID) & (xh >= 0) & (xh < IH) & (xw >= 0) & (xw < IW)
        bits = bits | (ok.to(tl.int32) << sidx)
    return bits


@triton.jit
def _line_dh_bits(ud, uh, ID, IH, LOD: tl.constexpr, LOH: tl.constexpr,
                  NSD: tl.constexpr, NSH: tl.constexpr, NSW: tl.constexpr):  # fmt: skip
    """Scalar: the ``_shift_bits`` bits of the shifts whose (d, h) part reads inside x at ``(ud, uh)``
    (all ``NSW`` w shifts of each such (sd, sh))."""
    dh = 0
    for sdh in tl.static_range(NSD * NSH):
        xd = ud + (LOD + sdh // NSH)
        xh = uh + (LOH + sdh % NSH)
        ok = (xd >= 0) & (xd < ID) & (xh >= 0) & (xh < IH)
        dh = dh | tl.where(ok, ((1 << NSW) - 1) << (sdh * NSW), 0)
    return dh


@triton.jit
def _line_w_ok(r, w_lo, w_hi, sw: tl.constexpr, LOW: tl.constexpr):
    """Rows ``r`` (``[BLOCK_M]``, units ``uw0 + r`` of one line) whose w shift ``sw`` reads inside x:
    ``w_lo - sw <= r < w_hi - sw`` with ``w_lo = -LOW - uw0``, ``w_hi = IW - LOW - uw0`` (the lower
    bound holds by itself when ``LOW + sw >= 0``)."""
    if LOW + sw >= 0:
        return r < w_hi - sw
    else:
        return (r >= w_lo - sw) & (r < w_hi - sw)


# --------------------------------------------------------------------------------------------------
# Input gradient
# --------------------------------------------------------------------------------------------------


@triton.jit
def _shift_dgrad_kernel(
    g_ptr, v_ptr, w_ptr, tab_ptr, dx_ptr,
    M_TOTAL, CI_G, CO_G,
    ID, IH, IW, OD, OH, OW, UD, UH, UW,
    x_sn, x_sc, x_sd, x_sh, x_sw,
    g_sn, g_sc, g_sd, g_sh, g_sw,
    v_sn, v_sc, v_sd, v_sh, v_sw,
    w_sci, w_sco, w_sd, w_sh, w_sw,
    TD: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    UPD: tl.constexpr, UPH: tl.constexpr, UPW: tl.constexpr,
    KPB: tl.constexpr, G_CL: tl.constexpr, X_CL: tl.constexpr, WIN_INSIDE: tl.constexpr, V_SAME: tl.constexpr,
    CDT: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_CI: tl.constexpr, BLOCK_CO: tl.constexpr,
):  # fmt: skip
    """``dx[n, grp*CI_G + ci, i] = sum_{shifts j} sum_{live blocks kp0} sum_{kp, co} Gexp[n, i - j, kp, co] w[ci, co, t(kp, j)]``.

    Pointers (element strides, every tensor lifted to (N, C, D, H, W)):
      g_ptr, v_ptr  ``g_win`` (any float dtype, strides ``g_s*``) and ``winner`` (int8/int32, strides
                    ``v_s*``), both (N, groups*CO_G, UD, UH, UW).
      w_ptr         weight (groups*CI_G, CO_G, TD, TH, TW), fp32/fp16/bf16 (cast to the compute
                    dtype ``CDT`` as loaded): element (ci, co, t) at
                    ``ci*w_sci + co*w_sco + td*w_sd + th*w_sh + tw*w_sw`` (launched ci-innermost).
      tab_ptr       int32 live-block table (``_dgrad_table``): per ``KPB``, entries ``(jd, jh, jw,
                    first, count)``: a shift and where its live offset blocks' first offsets
                    (row-major flat index over (KD, KH, KW)) lie in the table.
      dx_ptr        result (N, groups*CI_G, ID, IH, IW) in x's dtype (from the fp32 accumulator),
                    strides ``x_s*``: every element written once.
    Program ids: 0 -> block of BLOCK_M input positions (n, id, ih, iw) row-major over M_TOTAL;
    1 -> (group, block of BLOCK_CI input channels).  ``WIN_INSIDE``: every pool window lies inside
    the conv output (no partial windows), so winners need no range check.
    """
    if V_SAME:  # winner laid out like g_win: one offset computation serves both
        v_sn, v_sc, v_sd, v_sh, v_sw = g_sn, g_sc, g_sd, g_sh, g_sw
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_cib = tl.cdiv(CI_G, BLOCK_CI)
    grp = pid_n // n_cib
    cib = pid_n % n_cib
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M_TOTAL
    iw = m % IW
    r = m // IW
    ih = r % IH
    r = r // IH
    i_d = r % ID
    n = r // ID
    ci = cib * BLOCK_CI + tl.arange(0, BLOCK_CI)
    ci_ok = ci < CI_G
    w_cols = w_ptr + ((grp * CI_G + ci) * w_sci)[None, :]  # [1, BLOCK_CI]
    kq = tl.arange(0, KPB)
    col = tl.arange(0, KPB * BLOCK_CO)
    col_q = col % KPB
    col_c = col // KPB
    n_cob = tl.cdiv(CO_G, BLOCK_CO)
    sh_start = tl.load(tab_ptr + 2 * KPB)
    n_sh = tl.load(tab_ptr + 2 * KPB + 1)
    entries = tab_ptr + _TABLE_HEADER + 5 * sh_start
    acc = tl.zeros([BLOCK_M, BLOCK_CI], tl.float32)
    # NOTE: runtime loops: unrolled, every block's weight tile would be hoisted into registers.
    # Outer: (shift, channel block): the compact tile at u = i - j is loaded once; inner: the
    # shift's live offset blocks (the ConvT3d pipeline with KPB = 1: 8 shifts, 27 blocks).
    for it in range(0, n_sh * n_cob):
        e = it // n_cob
        cob = it - e * n_cob
        jd = tl.load(entries + e * 5)
        jh = tl.load(entries + e * 5 + 1)
        jw = tl.load(entries + e * 5 + 2)
        kp_first = tl.load(entries + e * 5 + 3)
        kp_count = tl.load(entries + e * 5 + 4)
        ud = i_d - jd
        uh = ih - jh
        uw = iw - jw
        row_ok = m_ok & (ud >= 0) & (ud < UD) & (uh >= 0) & (uh < UH) & (uw >= 0) & (uw < UW)
        co = cob * BLOCK_CO + tl.arange(0, BLOCK_CO)
        co_ok = co < CO_G
        g, v = _load_pooled(g_ptr, v_ptr, n, ud, uh, uw, row_ok, grp * CO_G + co, co_ok,
                            g_sn, g_sc, g_sd, g_sh, g_sw, v_sn, v_sc, v_sd, v_sh, v_sw, G_CL)  # fmt: skip
        # NOTE: rounded to the MMA dtype (and to TF32) once per shift tile, not once per offset
        # block: the expansion below only selects values or zeros, so A stays exact for the dot.
        g = round_tf32(to_compute(g, CDT), PREC)
        if KPB > 1 and not WIN_INSIDE:
            v = _valid_winner(v, ud, uh, uw, row_ok, OD, OH, OW, SD, SH, SW, UPD, UPH, UPW, KD, KH, KW, True)
        for q in range(0, kp_count):
            kp0 = tl.load(tab_ptr + kp_first + q)
            vq = v
            if (
                KPB == 1 and not WIN_INSIDE
            ):  # one offset: check its position per row (cheaper than decoding v)
                od = ud * SD - UPD + kp0 // (KH * KW)
                oh = uh * SH - UPH + (kp0 // KW) % KH
                ow = uw * SW - UPW + kp0 % KW
                o_ok = row_ok & (od >= 0) & (od < OD) & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
                vq = tl.where(o_ok[:, None], v, -1)
            if KPB == 1:  # table entries of single offsets are live pairs by construction
                a = tl.where(vq == kp0, g, 0.0)
            else:  # the block's offsets and which of them form a live pair with this shift
                kp = kp0 + kq
                _, ok_d = _tap_of(kp // (KH * KW), jd, UPD, PD, SD, DD, TD)
                _, ok_h = _tap_of((kp // KW) % KH, jh, UPH, PH, SH, DH, TH)
                _, ok_w = _tap_of(kp % KW, jw, UPW, PW, SW, DW, TW)
                live = (kp < KD * KH * KW) & ok_d & ok_h & ok_w
                a = _expand(g, vq, kp, live, BLOCK_M, KPB, BLOCK_CO)
            # B: row (c, q) = w[ci, co, t(kp0 + q, j)], zero for a dead pair (never 0 * inf with A).
            kpc = kp0 + col_q
            tdc, okc_d = _tap_of(kpc // (KH * KW), jd, UPD, PD, SD, DD, TD)
            thc, okc_h = _tap_of((kpc // KW) % KH, jh, UPH, PH, SH, DH, TH)
            twc, okc_w = _tap_of(kpc % KW, jw, UPW, PW, SW, DW, TW)
            coc = cob * BLOCK_CO + col_c
            row_live = (kpc < KD * KH * KW) & okc_d & okc_h & okc_w & (coc < CO_G)
            b = tl.load(w_cols + (coc * w_sco + tdc * w_sd + thc * w_sh + twc * w_sw)[:, None],
                        mask=row_live[:, None] & ci_ok[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(a, round_tf32(to_compute(b, CDT), PREC), acc, input_precision=PREC)
    x_row = n * x_sn + i_d * x_sd + ih * x_sh + iw * x_sw
    x_col = (grp * CI_G + ci) * x_sc
    out = acc.to(dx_ptr.dtype.element_ty)
    if X_CL:
        tl.store(dx_ptr + x_row[:, None] + x_col[None, :], out, mask=m_ok[:, None] & ci_ok[None, :])
    else:  # positions are the contiguous axis: store [BLOCK_CI, BLOCK_M]
        tl.store(dx_ptr + x_row[None, :] + x_col[:, None], tl.trans(out), mask=ci_ok[:, None] & m_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Weight gradient
# --------------------------------------------------------------------------------------------------


@triton.jit
def _shift_wgrad_kernel(
    x_ptr, g_ptr, v_ptr, part_ptr,
    M_TOTAL, CI_G, CO_G, ROWS_PER_SPLIT, PART_SPLIT,
    ID, IH, IW, OD, OH, OW, UD, UH, UW,
    x_sn, x_sc, x_sd, x_sh, x_sw,
    g_sn, g_sc, g_sd, g_sh, g_sw,
    v_sn, v_sc, v_sd, v_sh, v_sw,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    UPD: tl.constexpr, UPH: tl.constexpr, UPW: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    LOD: tl.constexpr, LOH: tl.constexpr, LOW: tl.constexpr,
    NSD: tl.constexpr, NSH: tl.constexpr, NSW: tl.constexpr, KS: tl.constexpr,
    KPB: tl.constexpr, X_CL: tl.constexpr, G_CL: tl.constexpr, WIN_INSIDE: tl.constexpr, V_SAME: tl.constexpr,
    CARRY: tl.constexpr, LINE_DIV: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_CI: tl.constexpr, BLOCK_CO: tl.constexpr,
):  # fmt: skip
    """Partial ``P[split, grp, s, ci, kp, co] = sum_{rows} x[n, grp*CI_G + ci, u + LO + s] * Gexp[n, u, kp, co]``.

    Pointers (element strides, lifted to (N, C, D, H, W)):
      x_ptr         input (N, groups*CI_G, ID, IH, IW), fp32/fp16/bf16 (cast to the compute dtype
                    ``CDT`` as loaded), strides ``x_s*``.
      g_ptr, v_ptr  ``g_win`` / ``winner`` (N, groups*CO_G, UD, UH, UW), strides ``g_s*`` / ``v_s*``.
      part_ptr      fp32 (splits, groups, NS, CI_G, KD*KH*KW, CO_G) contiguous (``PART_SPLIT``
                    elements per split), NS = NSD*NSH*NSW
                    shifts (flat ``(sd*NSH + sh)*NSW + sw``, relative to LO): every element written
                    once per launch (also dead (shift, offset) pairs, which the finish kernel skips).
    Rows: units ``(n, ud, uh, uw)`` row-major, ``[split*ROWS_PER_SPLIT, (split+1)*ROWS_PER_SPLIT) &
    [0, M_TOTAL)`` for program id 0 = split (``CARRY``: ``BLOCK_M <= UW``, see ``_unit_rows``;
    ``LINE`` (``BLOCK_M`` divides ``LINE_DIV``, the largest power of 2 dividing ``UW`` and
    ``ROWS_PER_SPLIT``): ``BLOCK_M`` divides both, so every block is ``BLOCK_M`` units
    of one line: ``(n, ud, uh)`` are scalars walked by carries from block to block, the w index is
    ``uw0 + row``, and the shift bits / border rows come from scalar bounds).  Program id 1 ->
    (group, BLOCK_CI input channels, KPB window offsets, BLOCK_CO output channels).  The accumulator is ``P^T``: rows (co, offset),
    columns (shift slot s < KS, ci).  ``WIN_INSIDE``, ``V_SAME`` as for the input-grad kernel.
    """
    LINE: tl.constexpr = LINE_DIV % BLOCK_M == 0
    split = tl.program_id(0)
    pid = tl.program_id(1)
    n_cob = tl.cdiv(CO_G, BLOCK_CO)
    n_kpb: tl.constexpr = (KD * KH * KW + KPB - 1) // KPB
    n_cib = tl.cdiv(CI_G, BLOCK_CI)
    cob = pid % n_cob
    r = pid // n_cob
    kpb = r % n_kpb
    r = r // n_kpb
    cib = r % n_cib
    grp = r // n_cib
    # X columns / accumulator columns: (shift slot, input channel)
    kcol = tl.arange(0, KS * BLOCK_CI)
    s_col = kcol // BLOCK_CI
    ci = cib * BLOCK_CI + kcol % BLOCK_CI
    jw = s_col % NSW
    jh = (s_col // NSW) % NSH
    jd = s_col // (NSW * NSH)
    k_ok = (s_col < NSD * NSH * NSW) & (ci < CI_G)
    x_col = (grp * CI_G + ci) * x_sc + (LOD + jd) * x_sd + (LOH + jh) * x_sh + (LOW + jw) * x_sw
    out_col = ((grp * (NSD * NSH * NSW) + s_col) * CI_G + ci) * (KD * KH * KW * CO_G)
    # NOTE: P^T = Gexp^T @ X: the expanded tile (computed in registers) is the wgmma A operand and
    # X the B operand, straight from its load to shared memory (K-major as loaded from channels-first
    # x).  The other way round, the [KS*BLOCK_CI, BLOCK_M] X tile sat in registers: ~250 registers.
    kpn = KD * KH * KW
    row = tl.arange(
        0, BLOCK_CO * KPB
    )  # accumulator rows (c, q): channel cob*BLOCK_CO + c, offset kpb*KPB + q
    kpr = kpb * KPB + row % KPB
    cor = cob * BLOCK_CO + row // KPB
    row_ok = (kpr < kpn) & (cor < CO_G)
    if V_SAME:  # winner laid out like g_win: one offset computation serves both
        v_sn, v_sc, v_sd, v_sh, v_sw = g_sn, g_sc, g_sd, g_sh, g_sw
    g_rows = (grp * CO_G + cor) * g_sc
    v_rows = (grp * CO_G + cor) * v_sc
    acc = tl.zeros([BLOCK_CO * KPB, KS * BLOCK_CI], tl.float32)
    # border units with an inf/NaN gradient, set elementwise (reduced once after the loop)
    flagged = tl.zeros([BLOCK_CO * KPB, BLOCK_M], tl.int32)
    lo = split * ROWS_PER_SPLIT
    hi = tl.minimum(lo + ROWS_PER_SPLIT, M_TOTAL)
    x_bit = tl.where(k_ok, 1 << s_col, 0)  # per X column: its shift's bit in ``inside`` (0: padding)
    FULL: tl.constexpr = (1 << (NSD * NSH * NSW)) - 1  # every shift inside x
    REP: tl.constexpr = FULL // ((1 << NSW) - 1)  # the bit of w shift 0 in every (d, h) slot
    if LINE:  # the first row's unit as scalars, walked by carries below (no division in the loop)
        uw0 = lo % UW
        q_w = lo // UW
        uh0 = q_w % UH
        q_h = q_w // UH
        ud0 = q_h % UD
        n0 = q_h // UD
        r_m = tl.arange(0, BLOCK_M)
    for m0 in range(lo, hi, BLOCK_M):
        if LINE:
            uw = uw0 + r_m
            # shifts inside x per row (see _shift_bits): the (d, h) part is one scalar per block,
            # the w part one compare of the row index per w shift
            dh = _line_dh_bits(ud0, uh0, ID, IH, LOD, LOH, NSD, NSH, NSW)
            w_lo = -LOW - uw0
            w_hi = IW - LOW - uw0
            inside = tl.zeros([BLOCK_M], tl.int32)
            for sw in tl.static_range(NSW):
                inside = inside | tl.where(_line_w_ok(r_m, w_lo, w_hi, sw, LOW), REP << sw, 0)
            inside = inside & dh
            # border rows (some shift reads outside x): in the gradient tile's layout, from scalars
            border = r_m >= tl.where(dh != FULL, 0, w_hi - (NSW - 1))
            if LOW < 0:
                border = border | (r_m < w_lo)
            x_row = (n0 * x_sn + ud0 * x_sd + uh0 * x_sh) + uw * x_sw
            m_ok = r_m < BLOCK_M  # (every row is a unit: the block lies inside a line and [lo, hi))
            ud = tl.zeros([BLOCK_M], tl.int32) + ud0
            uh = tl.zeros([BLOCK_M], tl.int32) + uh0
            n = tl.zeros([BLOCK_M], tl.int32) + n0
        else:
            n, ud, uh, uw, m_ok = _unit_rows(m0, hi, UD, UH, UW, BLOCK_M, CARRY)
            # NOTE: per unit, a bit mask of the shifts inside x: per element the mask is then one
            # shift and test (the per-dim range checks per element were ~15 integer ops).
            inside = _shift_bits(ud, uh, uw, m_ok, ID, IH, IW, LOD, LOH, LOW, NSD, NSH, NSW, BLOCK_M)
            border = m_ok & (inside != FULL)
            x_row = n * x_sn + ud * x_sd + uh * x_sh + uw * x_sw
        # X tile [BLOCK_M, KS*BLOCK_CI]: x at (n, ci, u + LO + s); 0 outside x and for padding slots.
        if X_CL:
            x_ok = (inside[:, None] & x_bit[None, :]) != 0
            xb = tl.load(x_ptr + x_row[:, None] + x_col[None, :], mask=x_ok, other=0.0)
        else:
            x_ok = (inside[None, :] & x_bit[:, None]) != 0
            xb = tl.trans(tl.load(x_ptr + x_col[:, None] + x_row[None, :], mask=x_ok, other=0.0))
        # Gexp^T [BLOCK_CO * KPB, BLOCK_M], rows (c, q): g_win / winner loaded straight into that
        # shape (each compact element read by KPB rows, from L1).
        # NOTE: a [BLOCK_CO, BLOCK_M] tile broadcast to 3d and reshaped was converted to the 3d
        # layout right after its load, replicating every per-element op KPB times (the winner
        # decode among them): ~1650 instructions per warp and iteration, ALU-bound (ncu).
        g_units = n * g_sn + ud * g_sd + uh * g_sh + uw * g_sw
        v_units = n * v_sn + ud * v_sd + uh * v_sh + uw * v_sw
        if G_CL:  # channels contiguous: load [BLOCK_M, rows] (coalesced), then transpose
            gv_mask = m_ok[:, None] & row_ok[None, :]
            g = tl.trans(tl.load(g_ptr + g_units[:, None] + g_rows[None, :], mask=gv_mask, other=0.0))
            v = tl.trans(
                tl.load(v_ptr + v_units[:, None] + v_rows[None, :], mask=gv_mask, other=-1).to(tl.int32)
            )
        else:
            gv_mask = row_ok[:, None] & m_ok[None, :]
            g = tl.load(g_ptr + g_rows[:, None] + g_units[None, :], mask=gv_mask, other=0.0)
            v = tl.load(v_ptr + v_rows[:, None] + v_units[None, :], mask=gv_mask, other=-1).to(tl.int32)
        if not WIN_INSIDE:
            v = _valid_winner(v, ud, uh, uw, m_ok, OD, OH, OW, SD, SH, SW, UPD, UPH, UPW, KD, KH, KW, False)
        sel = v == kpr[:, None]
        # NOTE: X reads 0 where u + shift lies outside x, and 0 * inf = NaN would poison that
        # shift's columns: an inf/NaN gradient of such a *border* unit is left out here and added
        # by the fix-up pass below ((g - g) != 0 only for inf and NaN).  Interior units' inf/NaN
        # meet only real x values, as in the reference.
        # (the flag is set for every inf/NaN of a border unit, selected or not: the fix-up pass
        # selects exactly; (g - g) != 0 only for inf and NaN)
        odd = ((g - g) != 0) & border[None, :]
        flagged = tl.where(odd, 1, flagged)
        # (every pair is computed here, dead ones included: the finish kernel never reads those)
        # (rounded before the select: round(0) == 0, the same values)
        ga = tl.where(sel & ~odd, round_tf32(to_compute(g, CDT), PREC), 0.0)
        acc = tl.dot(ga, round_tf32(to_compute(xb, CDT), PREC), acc, input_precision=PREC)
        if LINE:  # next block: BLOCK_M divides UW, so a line ends exactly at a block's end
            uw0 += BLOCK_M
            c = (uw0 >= UW).to(tl.int32)
            uw0 -= c * UW
            uh0 += c
            c = (uh0 >= UH).to(tl.int32)
            uh0 -= c * UH
            ud0 += c
            c = (ud0 >= UD).to(tl.int32)
            ud0 -= c * UD
            n0 += c
    out_row = split * PART_SPLIT + kpr * CO_G + cor  # this program's partial: rows (co, offset)
    tl.store(part_ptr + out_row[:, None] + out_col[None, :], acc, mask=row_ok[:, None] & k_ok[None, :])
    if tl.max(tl.max(flagged, axis=1), axis=0) != 0:
        # Fix-up pass (rare: inf/NaN gradients at border units): per such unit and shift whose input
        # lies inside x, the masked outer product of its inf/NaN Gexp entries with x, added to this
        # program's own partial (read-modify-write, no atomics: no other program touches it).  The
        # mask selects products, not operands, so no 0 * inf arises (an inf/NaN in x is multiplied
        # by those entries only).
        # NOTE: a separate pass rather than a masked branch in the main loop: that branch kept a
        # second accumulator live there (~50 more registers in the common path).
        tl.debug_barrier()  # the partial was stored in the accumulator's layout by other threads
        ci_blk = cib * BLOCK_CI + tl.arange(0, BLOCK_CI)
        ci_ok = ci_blk < CI_G
        q_co = cob * BLOCK_CO + row // KPB  # the accumulator rows (co, offset) as a vector
        q_kp = kpb * KPB + row % KPB
        for m in range(lo, hi):
            uw1 = m % UW
            rest = m // UW
            uh1 = rest % UH
            rest = rest // UH
            ud1 = rest % UD
            n1 = rest // UD
            in_x = ((ud1 + LOD >= 0) & (ud1 + LOD + NSD - 1 < ID) & (uh1 + LOH >= 0) & (uh1 + LOH + NSH - 1 < IH)
                    & (uw1 + LOW >= 0) & (uw1 + LOW + NSW - 1 < IW))  # fmt: skip
            if not in_x:  # a border unit
                ch = grp * CO_G + q_co
                g1 = tl.load(
                    g_ptr + n1 * g_sn + ch * g_sc + ud1 * g_sd + uh1 * g_sh + uw1 * g_sw,
                    mask=row_ok,
                    other=0.0,
                )
                v1 = tl.load(
                    v_ptr + n1 * v_sn + ch * v_sc + ud1 * v_sd + uh1 * v_sh + uw1 * v_sw,
                    mask=row_ok,
                    other=-1,
                )
                v1 = v1.to(tl.int32)
                od = ud1 * SD - UPD + v1 // (KH * KW)
                oh = uh1 * SH - UPH + (v1 // KW) % KH
                ow = uw1 * SW - UPW + v1 % KW
                sel = (row_ok & (v1 == q_kp) & ((g1 - g1) != 0) & (od >= 0) & (od < OD) & (oh >= 0) & (oh < OH)
                       & (ow >= 0) & (ow < OW))  # fmt: skip
                if tl.max(sel.to(tl.int32), axis=0) != 0:
                    for sidx in range(0, NSD * NSH * NSW):
                        xd1 = ud1 + LOD + sidx // (NSW * NSH)
                        xh1 = uh1 + LOH + (sidx // NSW) % NSH
                        xw1 = uw1 + LOW + sidx % NSW
                        if (xd1 >= 0) & (xd1 < ID) & (xh1 >= 0) & (xh1 < IH) & (xw1 >= 0) & (xw1 < IW):
                            xs = tl.load(x_ptr + n1 * x_sn + (grp * CI_G + ci_blk) * x_sc + xd1 * x_sd + xh1 * x_sh
                                         + xw1 * x_sw, mask=ci_ok, other=0.0)  # fmt: skip
                            xs = to_compute(xs, CDT).to(tl.float32)  # x as the conv saw it
                            prod = g1.to(tl.float32)[:, None] * xs[None, :]
                            col = ((grp * (NSD * NSH * NSW) + sidx) * CI_G + ci_blk) * (kpn * CO_G)
                            ptrs = part_ptr + out_row[:, None] + col[None, :]
                            p_ok = row_ok[:, None] & ci_ok[None, :]
                            old = tl.load(ptrs, mask=p_ok, other=0.0)
                            tl.store(ptrs, old + tl.where(sel[:, None], prod, 0.0), mask=p_ok)


@triton.jit
def _shift_wgrad_finish_kernel(
    part_ptr, tab_ptr, dw_ptr,
    SPLITS, CI_G, CO_G, MAXP, PART_SPLIT,
    w_sci, w_sco, w_sd, w_sh, w_sw,
    TH: tl.constexpr, TW: tl.constexpr, NS: tl.constexpr, KPN: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """``dw[grp*CI_G + ci, co, t] = sum_{q < MAXP} sum_{split} P[split, grp, s_q, ci, kp_q, co]``.

    ``part_ptr``: the weight-grad partials (splits, groups, NS, CI_G, KPN, CO_G) fp32 contiguous,
    ``PART_SPLIT`` elements per split.  ``tab_ptr``: int32 (taps, MAXP, 2): the live (flat shift,
    flat offset) pairs of each tap (row-major over (TD, TH, TW)), padded with -1.  ``dw_ptr``: the
    weight (groups*CI_G, CO_G, TD, TH, TW) in its dtype, strides ``w_s*``; written once per element.
    Program ids: 0 -> tap, 1 -> (group, BLOCK_A input channels, BLOCK_B output channels).  A fixed
    summation order: bitwise reproducible.
    """
    t = tl.program_id(0)
    pid = tl.program_id(1)
    n_bb = tl.cdiv(CO_G, BLOCK_B)
    n_ab = tl.cdiv(CI_G, BLOCK_A)
    bb = pid % n_bb
    r = pid // n_bb
    ab = r % n_ab
    grp = r // n_ab
    ci = ab * BLOCK_A + tl.arange(0, BLOCK_A)
    co = bb * BLOCK_B + tl.arange(0, BLOCK_B)
    tile_ok = (ci < CI_G)[:, None] & (co < CO_G)[None, :]
    tile = part_ptr + grp * (NS * CI_G * KPN * CO_G) + (ci * (KPN * CO_G))[:, None] + co[None, :]
    acc = tl.zeros([BLOCK_A, BLOCK_B], tl.float32)
    for q in range(0, MAXP):
        s = tl.load(tab_ptr + (t * MAXP + q) * 2)
        kp = tl.load(tab_ptr + (t * MAXP + q) * 2 + 1)
        # (tl.where: under the interpreter ``tensor & scalar`` came out as an int32 array, which
        # tl.load refuses as a mask)
        ok = tl.where(s >= 0, tile_ok, False)
        ptrs = tile + (s * (CI_G * KPN * CO_G) + kp * CO_G)
        for sp in range(0, SPLITS):
            acc += tl.load(ptrs + sp * PART_SPLIT, mask=ok, other=0.0)
    tw = t % TW
    th = (t // TW) % TH
    td = t // (TW * TH)
    off = ((grp * CI_G + ci) * w_sci)[:, None] + (co * w_sco)[None, :] + (td * w_sd + th * w_sh + tw * w_sw)
    tl.store(dw_ptr + off, acc.to(dw_ptr.dtype.element_ty), mask=tile_ok)


# --------------------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------------------

#: Input-grad tiles (BLOCK_M, BLOCK_CI, BLOCK_CO, KPB, num_warps, num_stages), best first for the
#: ConvT3d pipeline (the heuristic takes the first that fits).  KPB = 1 skips every dead (offset,
#: shift) pair (there: 27 of 64 blocks run) and measured fastest; KPB 4 was 5-8x slower (H200,
#: Triton 3.6).
#: NOTE: registers for the ConvT3d pipeline on the H200 (Triton 3.6, the compiled kernel's n_regs):
#: 96-168, no spills; Triton 3.9's ptxas numbers (``tools/compile_check.py conv_shift_bwd``) run lower.
_DGRAD_TILES = (
    (128, 16, 32, 1, 4, 2), (64, 16, 32, 1, 4, 2), (128, 16, 32, 1, 8, 1), (128, 16, 32, 1, 8, 2),
    (128, 16, 32, 2, 8, 2), (128, 32, 32, 1, 4, 2), (128, 64, 32, 1, 8, 2),
)  # fmt: skip
#: Weight-grad tiles (BLOCK_M, BLOCK_CI, BLOCK_CO, KPB, num_warps, num_stages), best first for the
#: ConvT3d pipeline; the accumulator is ``[BLOCK_CO * KPB, KS * BLOCK_CI]`` (there: KS = 8, 128
#: columns).
#: NOTE: BLOCK_CO * KPB >= 64 keeps wgmma (32 rows fell back to mma.sync).  On the H200 (Triton 3.6)
#: these run 0.42-0.63 ms for the ConvT3d pipeline at 220-250 registers without spills; the 4-warp
#: tiles of 32 x 32/16 channel rows were as fast but spilled (42-50 bytes), BLOCK_M 64 at 4 warps
#: spilled ~100 bytes, and every 2-stage tile was slower than its 1-stage twin.
_WGRAD_TILES = (
    (16, 16, 32, 2, 4, 1), (16, 16, 16, 4, 4, 1), (32, 16, 32, 4, 8, 1), (64, 16, 32, 2, 8, 1),
    (16, 16, 32, 4, 8, 1),
)  # fmt: skip
#: Weight-grad programs launched per SM (the unit rows are split to reach about this many).
_WGRAD_PROGRAMS_PER_SM = 2
#: The finish kernel's tile.
_FINISH_BLOCK = 32


def _tile_config(tile: tuple[int, ...]) -> triton.Config:
    bm, bci, bco, kpb, warps, stages = tile
    return triton.Config(
        dict(BLOCK_M=bm, BLOCK_CI=bci, BLOCK_CO=bco, KPB=kpb), num_warps=warps, num_stages=stages
    )


def _fit(tiles: Sequence[tuple[int, ...]], ci_g: int, co_g: int, kpn: int) -> list[tuple[int, ...]]:
    """``tiles`` clamped to the problem (masked lanes cost full MMA work), duplicates dropped, order kept.

    Every block stays a power of 2 with the channel blocks >= 16, so each dot keeps K >= 16."""
    ci_max, co_max, kp_max = max(16, next_pow2(ci_g)), max(16, next_pow2(co_g)), next_pow2(kpn)
    clamped = [
        (bm, min(bci, ci_max), min(bco, co_max), min(kpb, kp_max), w, st)
        for bm, bci, bco, kpb, w, st in tiles
    ]
    return list(dict.fromkeys(clamped))


def _pruner(tiles: Sequence[tuple[int, ...]]):
    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        kpn = kwargs["KD"] * kwargs["KH"] * kwargs["KW"]
        return best_first([_tile_config(t) for t in _fit(tiles, int(named_args["CI_G"]), int(named_args["CO_G"]), kpn)])

    return prune


_dgrad_tuned = triton.autotune(
    configs=[_tile_config(t) for t in _DGRAD_TILES],
    key=[
        "M_TOTAL",
        "CI_G",
        "CO_G",
        "KD",
        "KH",
        "KW",
        "SD",
        "SH",
        "SW",
        "TD",
        "TH",
        "TW",
        "G_CL",
        "X_CL",
        "CDT",
        "PREC",
    ],
    prune_configs_by={"early_config_prune": _pruner(_DGRAD_TILES)},
    cache_results=True,  # the best tile per key is kept in Triton's cache dir across processes
)(_shift_dgrad_kernel)
_wgrad_tuned = triton.autotune(
    configs=[_tile_config(t) for t in _WGRAD_TILES],
    key=["M_TOTAL", "CI_G", "CO_G", "ROWS_PER_SPLIT", "KD", "KH", "KW", "KS", "X_CL", "G_CL", "CDT", "PREC"],
    prune_configs_by={"early_config_prune": _pruner(_WGRAD_TILES)},
    cache_results=True,
)(_shift_wgrad_kernel)


def _heuristic_tile(kind: str, ci_g: int, co_g: int, kpn: int) -> tuple[int, ...]:
    """The tile used under the interpreter (small: numpy cost grows with tile size), with
    ``FUSION_CONV_AUTOTUNE=0``, and for problems too small to be worth a tile search."""
    if _INTERPRET:  # NOTE: per-op overhead dominates there: few, large programs run fastest
        return _fit([(64, 16, 16, 4 if kind == "dgrad" else 8, 4, 1)], ci_g, co_g, kpn)[0]
    return _fit(_DGRAD_TILES if kind == "dgrad" else _WGRAD_TILES, ci_g, co_g, kpn)[0]


def _use_autotune(macs: int) -> bool:
    return not _INTERPRET and environment.measuring() and macs >= 2**28


# --------------------------------------------------------------------------------------------------
# Host side: geometry, tables, checks, launchers
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Geometry:
    """Everything the launchers derive from the arguments (spatial tuples lifted to 3 dims)."""

    dims: int
    in_size: tuple[int, int, int]
    conv_out: tuple[int, int, int]
    units: tuple[int, int, int]  # pooled sizes
    taps: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int]
    dilation: tuple[int, int, int]
    window: tuple[int, int, int]  # pool kernel
    pool_padding: tuple[int, int, int]
    shifts: tuple[
        tuple[int, int], ...
    ]  # per dim (lowest shift LO, number of shifts NS); (0, 0): no live pair
    groups: int
    ci_g: int
    co_g: int

    @property
    def n_shifts(self) -> int:
        return math.prod(ns for _, ns in self.shifts)

    @property
    def window_volume(self) -> int:
        return math.prod(self.window)

    @property
    def windows_inside(self) -> bool:
        """Every pool window lies inside the conv output (no pool padding, no partial window)."""
        return all(
            up == 0 and (u - 1) * s + k <= o
            for up, u, s, k, o in zip(
                self.pool_padding, self.units, self.stride, self.window, self.conv_out, strict=True
            )
        )






def _live_shifts(kp_n: int, up: int, p: int, s: int, dl: int, taps: int) -> list[int]:
    """Input shift of every live (window offset, tap) pair along one dim."""
    return [
        (kp - up + p - t * dl) // s
        for kp in range(kp_n)
        for t in range(taps)
        if (kp - up + p - t * dl) % s == 0
    ]


def _geometry(grad: PooledGrad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
              padding: Sequence[int], dilation: Sequence[int], output_padding: Sequence[int],
              groups: int) -> _Geometry:  # fmt: skip
    dims = x.dim() - 2
    kernel = list(weight.shape[2:])
    out = conv_output_spatial(x.shape[2:], kernel, stride, padding, dilation, True, output_padding)
    k, _, p, _ = grad.geometry(dims)
    s3, p3, d3, t3 = lift3(stride, 1), lift3(padding, 0), lift3(dilation, 1), lift3(kernel, 1)
    shifts = []
    for j in range(3):
        live = _live_shifts(k[j], p[j], p3[j], s3[j], d3[j], t3[j])
        shifts.append((min(live), max(live) - min(live) + 1) if live else (0, 0))
    return _Geometry(
        dims, lift3(x.shape[2:], 1), lift3(out, 1), lift3(grad.g_win.shape[2:], 1), t3, s3, p3, d3,
        tuple(k), tuple(p), tuple(shifts), int(groups), x.shape[1] // groups, weight.shape[1],
    )  # fmt: skip


def unsupported_reason(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    compute_dtype: torch.dtype | None = None,
) -> str | None:  # fmt: skip
    """None when ``convolution_backward`` handles these arguments, else why not (never raises).

    Arguments as for ``convolution_backward``.  Taken: a transposed conv and a ``PooledGrad`` with
    pool dilation 1 and pool stride == conv stride on every dim, at most ``MAX_SHIFT_SLOTS`` input
    shifts (rounded up to a power of 2) and ``MAX_WINDOW_VOLUME`` window offsets, fp32/fp16/bf16
    (fp32/fp16 under the interpreter), every tensor within half the int32 offset range.
    """
    try:
        return _reason(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups,
                       compute_dtype or x.dtype)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - a malformed argument is a reason, not a crash
        return f"arguments not understood: {type(err).__name__}: {err}"


def _reason(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups, compute_dtype) -> str | None:  # noqa: ANN001
    if not isinstance(grad, PooledGrad):
        return "the gradient is not a PooledGrad (dense gradients: use conv_fused_bwd)"
    if not transposed:
        return "not a transposed conv (the shift decomposition is for conv-transpose phases)"
    if not 3 <= x.dim() <= 5 or weight.dim() != x.dim():
        return f"x and weight must be (N, C, *spatial) with 1 to 3 spatial dims, got {tuple(x.shape)} and {tuple(weight.shape)}"
    dims = x.dim() - 2
    for name, v in (
        ("stride", stride),
        ("padding", padding),
        ("dilation", dilation),
        ("output_padding", output_padding),
    ):
        if len(v) != dims:
            return f"{name} {tuple(v)} must have {dims} entries"
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or min(output_padding) < 0 or groups < 1:
        return f"invalid conv hyper-parameters stride={stride} padding={padding} dilation={dilation} groups={groups}"
    if any(dtype not in _DTYPES for dtype in (x.dtype, weight.dtype, compute_dtype)):
        return f"x, weight and compute dtype must be in {_DTYPES}, got {x.dtype}, {weight.dtype}, {compute_dtype}"
    if grad.g_win.dtype not in _DTYPES:
        return f"g_win must be fp32/fp16/bf16, got {grad.g_win.dtype}"
    if _INTERPRET and torch.bfloat16 in (x.dtype, weight.dtype, compute_dtype, grad.g_win.dtype):
        return "Triton's interpreter has no bf16"
    if grad.winner.dtype not in (torch.int8, torch.int32):
        return f"winner must be int8 or int32, got {grad.winner.dtype}"
    tensors = (x, weight, grad.g_win, grad.winner)
    if len({t.device for t in tensors}) != 1:
        return f"tensors on several devices: {[str(t.device) for t in tensors]}"
    if x.device.type != "cuda" and not (_INTERPRET and x.device.type == "cpu"):
        return f"Triton kernels need CUDA tensors (or CPU under TRITON_INTERPRET=1), got {x.device}"
    c_in = x.shape[1]
    if weight.shape[0] != c_in or c_in % groups:
        return f"conv-transpose weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}, groups={groups}"
    if any(op >= max(s, d) for op, s, d in zip(output_padding, stride, dilation, strict=True)):
        return f"output_padding {tuple(output_padding)} must be smaller than stride or dilation"
    out = conv_output_spatial(x.shape[2:], weight.shape[2:], stride, padding, dilation, True, output_padding)
    if min(out) < 1:
        return f"empty conv output {out}"
    if grad.winner.shape != grad.g_win.shape:
        return f"winner {tuple(grad.winner.shape)} and g_win {tuple(grad.g_win.shape)} differ in shape"
    geom = [
        grad.kernel_size,
        grad.stride or grad.kernel_size,
        grad.padding or (0,) * dims,
        grad.dilation or (1,) * dims,
    ]
    if any(len(v) != dims for v in geom):
        return f"pool geometry {grad} does not have {dims} spatial dims"
    k, s, p, d = geom
    if min(k) < 1 or min(s) < 1 or min(p) < 0:
        return f"invalid pool geometry {grad}"
    if any(dd != 1 for dd in d):
        return f"pool dilation {tuple(d)}: only 1 (windows must be dense runs of conv phases)"
    if tuple(s) != tuple(stride):
        return (
            f"pool stride {tuple(s)} differs from the conv stride {tuple(stride)}: the shifts are not static"
        )
    c_out = weight.shape[1] * groups
    pooled = pooled_spatial(out, k, s, p, d, grad.ceil_mode)
    if list(grad.g_win.shape) != [x.shape[0], c_out, *pooled]:
        return (
            f"pooled gradient has shape {tuple(grad.g_win.shape)}, but max-pooling the conv output "
            f"{[x.shape[0], c_out, *out]} with {grad} gives {[x.shape[0], c_out, *pooled]}"
        )
    if math.prod(k) > MAX_WINDOW_VOLUME:
        return f"pool window of {math.prod(k)} offsets exceeds {MAX_WINDOW_VOLUME}"
    geo = _geometry(grad, x, weight, stride, padding, dilation, output_padding, groups)
    if next_pow2(geo.n_shifts) > MAX_SHIFT_SLOTS:
        return f"{geo.n_shifts} distinct input shifts (per dim {[ns for _, ns in geo.shifts]}) exceed {MAX_SHIFT_SLOTS} slots"
    for name, t in (("x", x), ("weight", weight), ("g_win", grad.g_win), ("winner", grad.winner)):
        if element_extent(t) >= _INDEX_LIMIT:
            return f"{name} spans {element_extent(t)} elements: beyond the int32 offsets these kernels use (< {_INDEX_LIMIT})"
    if groups * cdiv(geo.ci_g, 16) * max(1, cdiv(geo.co_g, 16)) * math.prod(k) >= 2**16:
        return f"grid range: groups x channel blocks x window offsets ({groups} groups) must stay below 2**16"
    return None


def _check(grad: Grad, x: torch.Tensor, weight: torch.Tensor, *conv_args, compute_dtype: torch.dtype) -> None:
    reason = unsupported_reason(grad, x, weight, *conv_args, compute_dtype=compute_dtype)
    if reason is not None:
        from ..errors import UnsupportedInputError

        raise UnsupportedInputError(f"conv_shift_bwd: {reason} (check unsupported_reason() first)")


def _channels_inner(t: torch.Tensor) -> bool:
    """True when channels are the memory-contiguous axis (channels-last): tiles then put them last."""
    return t.stride(1) == 1 and t.shape[1] > 1 and math.prod(t.shape[2:]) > 1


def _ci_innermost(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (C_in, C_out/g, *k) stored with C_in innermost (a copy unless it already is).

    WHY: the input-grad B tile is ``[(offset, co) rows, BLOCK_CI]``; with ci contiguous a warp reads
    whole rows.  The weight is tiny next to the activations.
    """
    if weight.stride(0) == 1 or weight.shape[0] == 1:
        return weight
    return weight.movedim(0, -1).contiguous().movedim(-1, 0)


@functools.cache  # never evicts: recorded CUDA graphs keep the tables' addresses
def _dgrad_table(geo: _Geometry, device: torch.device) -> torch.Tensor:
    """int32 live-block table of the input-grad kernel, for every power-of-2 ``KPB`` at once (the
    autotuner compares tiles of different KPB with one table argument).

    Layout: ``_TABLE_HEADER`` entries, ``(first entry, entry count)`` at ``2*KPB``; then the shift
    entries ``(jd, jh, jw, first, count)`` of every KPB (5 ints each, shifts holding a live pair);
    then the block lists: ``count`` first offsets (multiples of KPB) at table index ``first``, one
    per block of KPB window offsets holding at least one live (offset, shift) pair.
    """
    kpn = geo.window_volume
    per_dim = []
    for j in range(3):
        (lo, ns), kp_n = geo.shifts[j], geo.window[j]
        up, p, s, dl, taps = geo.pool_padding[j], geo.padding[j], geo.stride[j], geo.dilation[j], geo.taps[j]
        per_dim.append({
            (sh, kp) for sh in range(lo, lo + ns) for kp in range(kp_n)
            if (num := kp - up + p - s * sh) >= 0 and num % dl == 0 and num // dl < taps
        })  # fmt: skip
    kh, kw = geo.window[1], geo.window[2]

    def live(shift: tuple[int, int, int], kp: int) -> bool:
        return ((shift[0], kp // (kh * kw)) in per_dim[0] and (shift[1], kp // kw % kh) in per_dim[1]
                and (shift[2], kp % kw) in per_dim[2])  # fmt: skip

    shifts = [(a, b, c) for a in range(geo.shifts[0][0], sum(geo.shifts[0]))
              for b in range(geo.shifts[1][0], sum(geo.shifts[1])) for c in range(geo.shifts[2][0], sum(geo.shifts[2]))]  # fmt: skip
    header = [0] * _TABLE_HEADER.value
    entries: list[list[int]] = []  # (jd, jh, jw, index into blocks, count)
    blocks: list[int] = []
    kpb = 1
    while kpb <= next_pow2(kpn):
        header[2 * kpb] = len(entries)
        for sh in shifts:
            firsts = [
                kp0
                for kp0 in range(0, kpn, kpb)
                if any(live(sh, kp) for kp in range(kp0, min(kp0 + kpb, kpn)))
            ]
            if firsts:
                entries.append([*sh, len(blocks), len(firsts)])
                blocks += firsts
        header[2 * kpb + 1] = len(entries) - header[2 * kpb]
        kpb *= 2
    base = _TABLE_HEADER.value + 5 * len(entries)
    flat = header + [v for e in entries for v in (*e[:3], base + e[3], e[4])] + blocks
    return persistent_device_copies([torch.tensor(flat, dtype=torch.int32)], device)[0]


@functools.cache  # never evicts: recorded CUDA graphs keep the tables' addresses
def _finish_table(geo: _Geometry, device: torch.device) -> torch.Tensor:
    """int32 (taps, MAXP, 2): per tap (row-major), its live (flat shift, flat offset) pairs, -1 padded."""
    nsh, nsw = geo.shifts[1][1], geo.shifts[2][1]
    kh, kw = geo.window[1], geo.window[2]
    pairs = []
    for t in [(a, b, c) for a in range(geo.taps[0]) for b in range(geo.taps[1]) for c in range(geo.taps[2])]:
        row = []
        for kp in [(a, b, c) for a in range(geo.window[0]) for b in range(kh) for c in range(kw)]:
            rel = []
            for j in range(3):
                num = kp[j] - geo.pool_padding[j] + geo.padding[j] - t[j] * geo.dilation[j]
                if num % geo.stride[j]:
                    break
                rel.append(num // geo.stride[j] - geo.shifts[j][0])
            else:
                row.append(((rel[0] * nsh + rel[1]) * nsw + rel[2], (kp[0] * kh + kp[1]) * kw + kp[2]))
        pairs.append(row)
    maxp = max(1, max(len(r) for r in pairs))
    table = torch.full((len(pairs), maxp, 2), -1, dtype=torch.int32)
    for t, row in enumerate(pairs):
        if row:
            table[t, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return persistent_device_copies([table], device)[0]


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _tile_meta(tile: tuple[int, ...]) -> dict:
    bm, bci, bco, kpb, warps, stages = tile
    return dict(BLOCK_M=bm, BLOCK_CI=bci, BLOCK_CO=bco, KPB=kpb, num_warps=warps, num_stages=stages)


class _KernelLaunch:
    """One kernel launch of a backward plan: ``raw`` with ``tile`` through ``FastLaunch``, or, with
    ``tile`` None, the autotuned kernel on the first call and its pick through ``FastLaunch`` after.

    WHY: Triton's generic launch costs 20-90 us of host time per call on the GPU hosts, and a
    training step of the ConvT3d pipeline at 16x16x16x32x32 waits on the host (H100: 0.93 ms of GPU
    work in a 2.07 ms step).
    NOTE: ``python tools/profile_step.py demos/seeds/convt3d_leaky_mul_leaky_maxpool.py --mode train``
    shows both times."""

    def __init__(self, tuned, raw, tile: tuple[int, ...] | None, grid, constexprs: dict, fixed: tuple = ()) -> None:  # noqa: ANN001
        self.tuned, self.raw, self.grid, self.constexprs, self.fixed = tuned, raw, grid, constexprs, fixed
        self.fast = None if tile is None else self._bind(_tile_meta(tile))

    def _bind(self, meta: dict) -> FastLaunch:
        return FastLaunch(self.raw, self.grid(meta), {**self.constexprs, **meta}, fixed=self.fixed)

    def __call__(self, *args) -> None:  # noqa: ANN002
        """Launch with the tensors (the runtime arguments before ``fixed``, the plan's integers)."""
        if self.fast is not None:
            self.fast(*args)
            return
        launched = launch(self.tuned, self.grid, *args, *self.fixed, **self.constexprs)
        best = getattr(self.tuned, "best_config", None)  # the tile of this call's key
        if launched and best is not None:
            self.fast = self._bind(best.all_kwargs())


def _prepare_input_grad(grad: PooledGrad, x: torch.Tensor, weight: torch.Tensor, geo: _Geometry,
                        compute_dtype: torch.dtype):  # noqa: ANN202  # fmt: skip
    """``(grad, x, weight) -> dx`` for tensors with these shapes, strides and dtypes (a plan)."""
    if x.numel() == 0:
        return lambda grad, x, weight: torch.empty_like(x)
    if geo.n_shifts == 0 or grad.g_win.numel() == 0:
        return lambda grad, x, weight: torch.empty_like(x).zero_()
    g, v = grad.g_win, grad.winner
    w = _ci_innermost(weight)  # the launched weight's strides (a copy only here, on a plan miss)
    dx = torch.empty_like(x, device="meta")
    m_total = x.shape[0] * math.prod(geo.in_size)
    kpn = geo.window_volume
    macs = m_total * geo.ci_g * geo.co_g * kpn * geo.n_shifts
    tile = None if _use_autotune(macs) else _heuristic_tile("dgrad", geo.ci_g, geo.co_g, kpn)
    table = _dgrad_table(geo, x.device)

    def grid(meta):
        return (cdiv(m_total, meta["BLOCK_M"]), geo.groups * cdiv(geo.ci_g, meta["BLOCK_CI"]))

    ints = (
        m_total, geo.ci_g, geo.co_g, *geo.in_size, *geo.conv_out, *geo.units,
        *lift_5d(dx)[1], *lift_5d(g)[1], *lift_5d(v)[1], w.stride(0), w.stride(1), *lift3(w.stride()[2:], 0),
    )  # fmt: skip
    launch = _KernelLaunch(_dgrad_tuned, _shift_dgrad_kernel, tile, grid, dict(
        TD=geo.taps[0], TH=geo.taps[1], TW=geo.taps[2], SD=geo.stride[0], SH=geo.stride[1], SW=geo.stride[2],
        PD=geo.padding[0], PH=geo.padding[1], PW=geo.padding[2],
        DD=geo.dilation[0], DH=geo.dilation[1], DW=geo.dilation[2],
        KD=geo.window[0], KH=geo.window[1], KW=geo.window[2],
        UPD=geo.pool_padding[0], UPH=geo.pool_padding[1], UPW=geo.pool_padding[2],
        G_CL=_channels_inner(g), X_CL=_channels_inner(dx), WIN_INSIDE=geo.windows_inside,
        V_SAME=g.stride() == v.stride(), CDT=compute_code(compute_dtype), PREC=backward_dot_precision(compute_dtype),
    ), fixed=ints)  # fmt: skip

    def run(grad: PooledGrad, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        launch(grad.g_win, grad.winner, _ci_innermost(weight), table, out)
        return out

    return run


def _prepare_weight_grad(grad: PooledGrad, x: torch.Tensor, weight: torch.Tensor, geo: _Geometry,
                         compute_dtype: torch.dtype):  # noqa: ANN202  # fmt: skip
    """``(grad, x, weight) -> dw`` for tensors with these shapes, strides and dtypes (a plan)."""
    if weight.numel() == 0:
        return lambda grad, x, weight: torch.empty_like(weight)
    n = x.shape[0]
    m_total = n * math.prod(geo.units)
    if geo.n_shifts == 0 or m_total == 0:
        return lambda grad, x, weight: torch.empty_like(weight).zero_()
    dw = torch.empty_like(weight, device="meta")
    g, v = grad.g_win, grad.winner
    kpn = geo.window_volume
    ns = geo.n_shifts
    slots = next_pow2(ns)
    macs = m_total * slots * geo.ci_g * kpn * geo.co_g
    tile = None if _use_autotune(macs) else _heuristic_tile("wgrad", geo.ci_g, geo.co_g, kpn)
    # Splits of the unit rows: about two waves of programs, each reducing >= MIN_ROWS rows.  The
    # split count depends on the shape only (the partials buffer is sized before tuning).
    ref = tile or _fit(_WGRAD_TILES, geo.ci_g, geo.co_g, kpn)[0]
    tiles_est = geo.groups * cdiv(geo.ci_g, ref[1]) * cdiv(geo.co_g, ref[2]) * cdiv(kpn, ref[3])
    min_rows, align = (32, 16) if _INTERPRET else (2048, 256)
    splits = max(
        1, min(cdiv(_WGRAD_PROGRAMS_PER_SM * _sm_count(x.device), tiles_est), cdiv(m_total, min_rows))
    )
    rows_per_split = cdiv(cdiv(m_total, splits), align) * align
    splits = cdiv(m_total, rows_per_split)
    part_split = geo.groups * ns * geo.ci_g * kpn * geo.co_g
    if splits * part_split >= 2**31:
        splits = 1
        rows_per_split = m_total
    part_numel = splits * part_split
    # CARRY: BLOCK_M is a power of 2, what holds for the largest candidate holds for every one.
    # LINE_DIV: the largest power of 2 dividing the pooled width and the split length (a tile's
    # BLOCK_M divides both iff it divides LINE_DIV: the kernel decides per tile).
    max_bm = max(t[0] for t in ([tile] if tile else _fit(_WGRAD_TILES, geo.ci_g, geo.co_g, kpn)))
    constexprs = dict(
        SD=geo.stride[0], SH=geo.stride[1], SW=geo.stride[2],
        UPD=geo.pool_padding[0], UPH=geo.pool_padding[1], UPW=geo.pool_padding[2],
        KD=geo.window[0], KH=geo.window[1], KW=geo.window[2],
        LOD=geo.shifts[0][0], LOH=geo.shifts[1][0], LOW=geo.shifts[2][0],
        NSD=geo.shifts[0][1], NSH=geo.shifts[1][1], NSW=geo.shifts[2][1], KS=slots,
        X_CL=_channels_inner(x), G_CL=_channels_inner(g), WIN_INSIDE=geo.windows_inside,
        V_SAME=g.stride() == v.stride(), CARRY=max_bm <= geo.units[2],
        LINE_DIV=math.gcd(geo.units[2], rows_per_split) & -math.gcd(geo.units[2], rows_per_split),
        CDT=compute_code(compute_dtype), PREC=backward_dot_precision(compute_dtype),
    )  # fmt: skip

    def grid(meta):
        tiles = (geo.groups * cdiv(geo.ci_g, meta["BLOCK_CI"]) * cdiv(geo.co_g, meta["BLOCK_CO"])
                 * cdiv(kpn, meta["KPB"]))  # fmt: skip
        return (splits, tiles)

    ints = (
        m_total, geo.ci_g, geo.co_g, rows_per_split, part_split, *geo.in_size, *geo.conv_out, *geo.units,
        *lift_5d(x)[1], *lift_5d(g)[1], *lift_5d(v)[1],
    )  # fmt: skip
    partials = _KernelLaunch(_wgrad_tuned, _shift_wgrad_kernel, tile, grid, constexprs, fixed=ints)
    table = _finish_table(geo, x.device)
    fb = _FINISH_BLOCK if not _INTERPRET else 16
    finish_grid = (math.prod(geo.taps), geo.groups * cdiv(geo.ci_g, fb) * cdiv(geo.co_g, fb))
    finish_ints = (splits, geo.ci_g, geo.co_g, table.shape[1], part_split, dw.stride(0), dw.stride(1),
                   *lift3(dw.stride()[2:], 0))  # fmt: skip
    finish = FastLaunch(_shift_wgrad_finish_kernel, finish_grid,
                        dict(TH=geo.taps[1], TW=geo.taps[2], NS=ns, KPN=kpn, BLOCK_A=fb, BLOCK_B=fb),
                        fixed=finish_ints)  # fmt: skip

    def run(grad: PooledGrad, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        part = torch.empty(part_numel, dtype=torch.float32, device=x.device)
        out = torch.empty_like(weight)
        partials(x, grad.g_win, grad.winner, part)
        finish(part, table, out)
        return out

    return run


def convolution_backward(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    output_mask: Sequence[bool] = (True, True, True), compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Drop-in for ``conv_fused_bwd.convolution_backward`` on the cases ``unsupported_reason`` accepts.

    Args:
      grad: ``PooledGrad`` (g_win any float dtype, winner int8/int32; any strides).
      x: (N, C_in, *spatial) conv-transpose input, 1 to 3 spatial dims, fp32/fp16/bf16, any strides.
      weight: (C_in, C_out/groups, *k), fp32/fp16/bf16, any strides.
      stride, padding, dilation, transposed, output_padding, groups: as ``aten.convolution``.
      output_mask: which of (grad_x, grad_w, grad_b) to compute.
      compute_dtype: the dtype the forward conv ran in (None: x's); x, weight and the gradient are
        cast to it as they are loaded (the backward of ``conv(x.to(dtype), weight.to(dtype))`` under
        autocast, without a cast pass over x), and the fp32 sums are written in x's / weight's dtype.
    Returns ``(grad_x, grad_w, grad_b)``, None where ``output_mask`` is False: grad_x like
    ``empty_like(x)``, grad_w like ``empty_like(weight)``, grad_b (C_out,) in weight's dtype.
    Raises ``UnsupportedInputError`` when ``unsupported_reason(...)`` is not None.
    """
    conv_args = (tuple(stride), tuple(padding), tuple(dilation), bool(transposed), tuple(output_padding), int(groups))
    key = (
        tensor_key(grad.g_win) if isinstance(grad, PooledGrad) else None, None if not isinstance(grad, PooledGrad)
        else (tensor_key(grad.winner), grad.kernel_size, grad.stride, grad.padding, grad.dilation, grad.ceil_mode),
        tensor_key(x), tensor_key(weight), conv_args, tuple(bool(m) for m in output_mask[:2]),
        compute_dtype, backward_dot_precision(compute_dtype or x.dtype), environment.measuring(),
    )  # fmt: skip
    run = _PLANS.get(key, lambda: backward_plan(grad, x, weight, *conv_args, output_mask[:2], compute_dtype))
    gx, gw = run(grad, x, weight)
    gb = conv_bias_grad(grad).to(weight.dtype) if output_mask[2] else None
    return gx, gw, gb


def backward_plan(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    output_mask: Sequence[bool] = (True, True), compute_dtype: torch.dtype | None = None,
) -> Callable[[Grad, torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]]:
    """``(grad, x, weight) -> (grad_x, grad_w)`` for tensors laid out like these (a per-signature
    call plan keeps it): ``convolution_backward`` without the bias, the per-call checks and the
    cache lookup (``convolution_backward`` keeps these per shape).  Raises ``UnsupportedInputError``
    as ``convolution_backward`` does."""
    conv_args = (tuple(stride), tuple(padding), tuple(dilation), bool(transposed), tuple(output_padding), int(groups))
    input_grad, weight_grad = _plan(grad, x, weight, conv_args, output_mask, compute_dtype or x.dtype)

    def run(grad: Grad, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (None if input_grad is None else input_grad(grad, x, weight),
                None if weight_grad is None else weight_grad(grad, x, weight))  # fmt: skip

    return run


#: ``convolution_backward``'s plans by shapes, strides, dtypes, geometry and mask: the checks,
#: the geometry and the launch arguments are worked out once (host time is what the ConvT3d
#: pipeline's training step waits on).
_PLANS = BoundedCache(256)


def _plan(grad: Grad, x: torch.Tensor, weight: torch.Tensor, conv_args: tuple, output_mask: Sequence[bool],
          compute_dtype: torch.dtype):  # noqa: ANN202  # fmt: skip
    """``(input_grad, weight_grad)`` runners for these arguments (None where the mask is off);
    raises ``UnsupportedInputError`` when ``unsupported_reason`` names a reason."""
    _check(grad, x, weight, *conv_args, compute_dtype=compute_dtype)
    stride, padding, dilation, _, output_padding, groups = conv_args
    geo = _geometry(grad, x, weight, stride, padding, dilation, output_padding, groups)
    input_grad = _prepare_input_grad(grad, x, weight, geo, compute_dtype) if output_mask[0] else None
    weight_grad = _prepare_weight_grad(grad, x, weight, geo, compute_dtype) if output_mask[1] else None
    return input_grad, weight_grad
