"""Device code of the fused conv forward (``kernels/conv_fused``): ``conv_fused_fwd_kernel`` (implicit-GEMM
conv or conv-transpose + bias + chain + pool, in registers), ``phase_aligned_weight_kernel`` (the PHASE_ALIGNED
path's prearranged weight matrix) and their device helpers.  The paths, the numerics and the
arguments are described in the package docstring and at each kernel; ``plan.py`` builds the launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..chain_math import chain_forward, load_chain_operands
from ..conv_common import live_tap, peel_coords, row_channel_tile
from ..epilogue import store_pooled
from ..tf32 import round_tf32, to_compute


@triton.jit
def _in_index(u, o, KP: tl.constexpr, TAP: tl.constexpr, US: tl.constexpr, UP: tl.constexpr,
              S: tl.constexpr, P: tl.constexpr, DIL: tl.constexpr, SIZE_IN,
              TRANSPOSED: tl.constexpr, STATIC_PHASE: tl.constexpr):  # fmt: skip
    """Input coordinate feeding output coordinate ``o = u * US - UP + KP`` through tap ``TAP`` along
    one dim, and whether it is valid (in range, and for a transposed conv, of the right phase)."""
    if TRANSPOSED and STATIC_PHASE:
        # (o + P - TAP*DIL) = u*US + R with R = KP - UP + P - TAP*DIL static; the caller skips
        # taps with R % S != 0, so R // S is exact.
        i = u * (US // S) + (KP - UP + P - TAP * DIL) // S
        ok = (i >= 0) & (i < SIZE_IN)
    else:
        i, ok = _in_index_rt(o, TAP, S, P, DIL, SIZE_IN, TRANSPOSED)
    return i, ok


@triton.jit
def _in_index_rt(o, tap, S: tl.constexpr, P: tl.constexpr, DIL: tl.constexpr, SIZE_IN,
                 TRANSPOSED: tl.constexpr):  # fmt: skip
    """``_in_index`` for a runtime tap (the flat K loop; also a compile-time one without a static
    phase): phases are masked, not skipped."""
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
def _live_taps(kd, kh, kw, jd, jh, jw, TAPS: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr,
               DIL: tl.constexpr, UORIGIN: tl.constexpr, LO: tl.constexpr):  # fmt: skip
    """Per dim, the tap carrying input shift ``j`` (relative to the lowest, ``LO``) to window offset
    ``k``, and whether one does: ``(td, th, tw, ok_d, ok_h, ok_w)``.  Along each dim offset ``kp``
    reads shift ``j`` through tap ``t`` iff ``kp - UP + P - t * DIL == S * (LO + j)`` (see
    ``_in_index``); for a given ``j`` at most one tap satisfies it.  ``TAPS``, ``STRIDE``, ``PAD``,
    ``DIL``, ``UORIGIN`` (the units' origin ``UP``), ``LO``: (d, h, w) constexprs."""
    td, ok_d = live_tap(kd - UORIGIN[0] + PAD[0] - STRIDE[0] * (LO[0] + jd), DIL[0], TAPS[0])
    th, ok_h = live_tap(kh - UORIGIN[1] + PAD[1] - STRIDE[1] * (LO[1] + jh), DIL[1], TAPS[1])
    tw, ok_w = live_tap(kw - UORIGIN[2] + PAD[2] - STRIDE[2] * (LO[2] + jw), DIL[2], TAPS[2])
    return td, th, tw, ok_d, ok_h, ok_w


@triton.jit
def _phase_aligned_columns(KS: tl.constexpr, NS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K axis of the phase-aligned path: column ``s * BLOCK_K + c`` is channel ``c`` of the block at
    input shift ``s = (jd * NSH + jh) * NSW + jw`` (``NS = (NSD, NSH, NSW)``: shifts per dim).
    Returns ``(s, c, jd, jh, jw)``, each ``[KS * BLOCK_K]``."""
    kcol = tl.arange(0, KS * BLOCK_K)
    s = kcol // BLOCK_K
    jw = s % NS[2]
    jh = (s // NS[2]) % NS[1]
    jd = s // (NS[2] * NS[1])
    return s, kcol % BLOCK_K, jd, jh, jw


@triton.jit
def _phase_aligned_x_tile(x_in, m_ok, NS: tl.constexpr, KS: tl.constexpr, BIG: tl.constexpr,
                          BLOCK_K: tl.constexpr):  # fmt: skip
    """``[BLOCK_M, KS * BLOCK_K]`` X tile (the group's input channels fit one block): row ``m`` and
    column ``(s, c)`` hold ``x[n, c, i0 + shift s]`` (``x_in``: see ``_phase_aligned_offsets``;
    ``x_rows``: pointers at ``(n, group's first channel, i0)``, ``i0 = (i_d0, i_h0, i_w0)`` the
    lowest shift's input position).  Padding shifts (``s >= NSD * NSH * NSW``), channels past
    ``CIN_G`` and out-of-range inputs read 0."""
    x_rows, i_d0, i_h0, i_w0, _, CIN_G, ID, IH, IW, x_sc, x_sd, x_sh, x_sw = x_in
    s, ci, jd, jh, jw = _phase_aligned_columns(KS, NS, BLOCK_K)
    col_ok = (s < NS[0] * NS[1] * NS[2]) & (ci < CIN_G)
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
def _phase_aligned_w_tile(w_in, CIN_G, kd, kh, kw, TAPS: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr,
                          DIL: tl.constexpr, UORIGIN: tl.constexpr, LO: tl.constexpr, NS: tl.constexpr,
                          KS: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``[KS * BLOCK_K, BLOCK_N]`` weight tile of window offset ``(kd, kh, kw)`` matching
    ``_phase_aligned_x_tile``'s columns: row ``(s, c)`` holds the weight of the tap that carries input
    shift ``s`` to that offset (``_live_taps``), or 0 where no tap does (a dead (offset, shift) pair).
    ``w_in``: ``(w_base, cmask, w_sci, w_sd, w_sh, w_sw)``, ``w_base`` ``[1, BLOCK_N]`` pointers at
    (group's first input channel, output channel, tap 0), ``cmask`` the real output channels
    (``[1, BLOCK_N]``), then the weight's strides along the input channel and the taps."""
    w_base, cmask, w_sci, w_sd, w_sh, w_sw = w_in
    s, ci, jd, jh, jw = _phase_aligned_columns(KS, NS, BLOCK_K)
    td, th, tw, ok_d, ok_h, ok_w = _live_taps(kd, kh, kw, jd, jh, jw, TAPS, STRIDE, PAD, DIL, UORIGIN, LO)
    ok = (s < NS[0] * NS[1] * NS[2]) & (ci < CIN_G) & ok_d & ok_h & ok_w
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
def _offset_epilogue(acc, kk, first, od, oh, ow, o_ok, state, epi, EPI: tl.constexpr, FULL: tl.constexpr,
                     FIRST: tl.constexpr = 0):  # fmt: skip
    """Bias + chain on the conv output ``acc`` of window offset ``kk`` (row-major index in the
    window) at conv-output position ``(od, oh, ow)``; then store it (no pool), fold it into the
    running max (``best``, winner ``win``, conv value at the winner ``win_y``) or the avg-pool sum,
    and store the saved conv output (SAVE without max pool).  ``state``: ``(best, win, win_y,
    pooled)``; returns it updated.

    ``epi`` (built once by the kernel): ``(nn, c64, cmask, bias, operands, out_ptr, o_sn, o_sc, o_sd,
    o_sh, o_sw, y0_ptr, y_sn, y_sc, y_sd, y_sh, y_sw)``: the rows' samples (``[BLOCK_M]``), the
    tile's output channels (``[BLOCK_N]``, int64 when BIG) and which are real (``[1, BLOCK_N]``), the
    bias (``[1, BLOCK_N]``, fp32, in the compute dtype's values; 0.0 without) and the chain's
    ``load_chain_operands``, then ``out`` and ``y0`` with their strides.  ``EPI``: the constexprs
    ``((OP0, ..., OP7), CDT, HAS_BIAS, POOL, SAVE, BIG)`` of the kernel.

    ``o_ok`` (``[BLOCK_M]``): the rows whose offset lies in the conv output (and in M).  ``first``
    (``[BLOCK_M, 1]`` or a scalar): the offset is the first valid one of the row's window in
    row-major order (``_first_offset``), where the max pool takes it without a compare.  FULL
    (``full_windows``: every offset of every unit lies in the conv output): ``o_ok`` is ``m_ok``,
    ``first`` is ``kk == 0`` and rows past M are never stored, so the max pool and the avg-pool
    sum need no row mask.  FIRST (FULL max pool, offset 0 peeled by the caller): 1 for offset 0
    (sets best/win/win_y, no compare), 2 for the later offsets (no ``first`` test), 0 otherwise.  Max pool: output channels past ``C_OUT`` (``cmask``) are computed but never
    stored, so they are not masked.
    """
    OPS: tl.constexpr = EPI[0]
    CDT: tl.constexpr = EPI[1]
    HAS_BIAS: tl.constexpr = EPI[2]
    POOL: tl.constexpr = EPI[3]
    SAVE: tl.constexpr = EPI[4]
    BIG: tl.constexpr = EPI[5]
    best, win, win_y, pooled = state
    nn, c64, cmask, bias, operands, out_ptr, o_sn, o_sc, o_sd, o_sh, o_sw, y0_ptr, y_sn, y_sc, y_sd, y_sh, y_sw = epi
    # The conv output as the library path materialises it (storage dtype), then the chain.
    y_raw = to_compute(acc, CDT).to(tl.float32)
    y = y_raw
    if HAS_BIAS:
        y = y + bias
    v = chain_forward(y, *operands, OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])
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
        tl.store(y0_ptr + (nn * y_sn + o_sp)[:, None] + c64[None, :] * y_sc,
                 y_raw.to(y0_ptr.dtype.element_ty), mask=ok2)  # fmt: skip
    return best, win, win_y, pooled


@triton.jit
def _phase_aligned_offset(kk, FIRST: tl.constexpr, a_all, SHARED_X: tl.constexpr, x_in, w_in, wm_base, wm_sk,
                          units, state, epi, EPI: tl.constexpr, FULL: tl.constexpr, TAPS: tl.constexpr,
                          STRIDE: tl.constexpr, PAD: tl.constexpr, DIL: tl.constexpr, WINDOW: tl.constexpr,
                          USTRIDE: tl.constexpr, UORIGIN: tl.constexpr, LO: tl.constexpr, NS: tl.constexpr,
                          KS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One window offset ``kk`` of ``_phase_aligned_offsets`` (same arguments): its dot, then
    ``_offset_epilogue`` (FIRST: 1 offset 0 of a FULL window, peeled; 2 a later offset of a FULL
    window after the peeled one; 0 otherwise).  Returns the updated ``state``."""
    CDT: tl.constexpr = EPI[1]
    x_rows, i_d0, i_h0, i_w0, ck, CIN_G, ID, IH, IW, x_sc, x_sd, x_sh, x_sw = x_in
    w_base, cmask, w_sci, w_sd, w_sh, w_sw = w_in
    ud, uh, uw, m_ok, OD, OH, OW = units
    kd = kk // (WINDOW[1] * WINDOW[2])
    kh = (kk // WINDOW[2]) % WINDOW[1]
    kw = kk % WINDOW[2]
    od = ud * USTRIDE[0] - UORIGIN[0] + kd
    oh = uh * USTRIDE[1] - UORIGIN[1] + kh
    ow = uw * USTRIDE[2] - UORIGIN[2] + kw
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
            for sidx in range(0, NS[0] * NS[1] * NS[2]):
                jw = sidx % NS[2]
                jh = (sidx // NS[2]) % NS[1]
                jd = sidx // (NS[2] * NS[1])
                td, th, tw, ok_d, ok_h, ok_w = _live_taps(kd, kh, kw, jd, jh, jw, TAPS, STRIDE, PAD, DIL, UORIGIN, LO)
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
    return _offset_epilogue(acc, kk, first, od, oh, ow, o_ok, state, epi, EPI, FULL, FIRST)


@triton.jit
def _phase_aligned_offsets(a_all, SHARED_X: tl.constexpr, x_in, w_in, wm_base, wm_sk, units, state, epi,
                           EPI: tl.constexpr, FULL: tl.constexpr, TAPS: tl.constexpr, STRIDE: tl.constexpr,
                           PAD: tl.constexpr, DIL: tl.constexpr, WINDOW: tl.constexpr, USTRIDE: tl.constexpr,
                           UORIGIN: tl.constexpr, LO: tl.constexpr, NS: tl.constexpr, KS: tl.constexpr,
                           PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):  # fmt: skip
    """The phase-aligned path's loop over window offsets: per offset one dot over (input shift, channel),
    then ``_offset_epilogue``.  SHARED_X: every offset's dot reads ``a_all`` (the one channel
    block's X tile, all finite) and the offset's rows of the prearranged weight matrix
    (``wm_base``: ``[1, BLOCK_N]`` pointers at the group's offset 0, row 0; offsets ``wm_sk`` apart, rows contiguous;
    see ``phase_aligned_weight_matrix``; dead (offset, shift) pairs multiply by zero weights); else each
    offset runs one small dot per (channel block, shift) pair, loading its X tile with the dead
    pairs masked to zero on both sides (several channel blocks, or a tile holding inf/NaN, where
    0 * inf would make NaN).

    Bundles (built once by the kernel): ``x_in`` ``(x_rows, i_d0, i_h0, i_w0, ck, CIN_G, ID, IH, IW,
    x_sc, x_sd, x_sh, x_sw)``: pointers at each row's sample, the group's first input channel and
    the lowest shift's input position ``(i_d0, i_h0, i_w0)``, the channel lanes of a block
    (``[BLOCK_K]``), the group's input channels, x's spatial sizes and strides; ``w_in``: see
    ``_phase_aligned_w_tile``; ``units`` ``(ud, uh, uw, m_ok, OD, OH, OW)``: the rows' units, which
    rows are real, the conv output's sizes; ``state``, ``epi``, ``EPI``: see ``_offset_epilogue``.
    Constexprs: FULL (``full_windows``), and per (d, h, w): ``TAPS``, ``STRIDE``, ``PAD``, ``DIL``
    of the conv, ``WINDOW`` (offsets per unit), ``USTRIDE``, ``UORIGIN`` of the units, ``LO`` / ``NS``
    (lowest input shift / number of shifts); ``KS``: shift slots.
    Returns the updated ``state``.
    """
    # NOTE: a runtime loop (not static_range): unrolled, the compiler hoisted all 8 weight-tile loads
    # of the ConvT3d pipeline into registers at once (255 registers, spills); as a loop, each offset's
    # tile is loaded when its dot needs it.
    # FULL max pool with the shared X tile: offset 0 is every row's first valid offset and is
    # peeled (set without compares; the loop's offsets then compare without a first-offset test).
    # Not in the masked variant (tiles with inf/NaN only): its dots would be duplicated.
    POOL: tl.constexpr = EPI[3]
    PEEL: tl.constexpr = 1 if FULL and POOL == 1 and SHARED_X else 0
    for kk in tl.static_range(PEEL):
        state = _phase_aligned_offset(kk, 1, a_all, SHARED_X, x_in, w_in, wm_base, wm_sk, units, state, epi, EPI,
                                      FULL, TAPS, STRIDE, PAD, DIL, WINDOW, USTRIDE, UORIGIN, LO, NS, KS,
                                      PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    for kk in range(PEEL, WINDOW[0] * WINDOW[1] * WINDOW[2]):
        state = _phase_aligned_offset(kk, 2 * PEEL, a_all, SHARED_X, x_in, w_in, wm_base, wm_sk, units, state,
                                      epi, EPI, FULL, TAPS, STRIDE, PAD, DIL, WINDOW, USTRIDE, UORIGIN, LO, NS,
                                      KS, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    return state


@triton.jit
def conv_fused_fwd_kernel(
    x_ptr, w_ptr, wm_ptr, p_ptr, b_ptr, out_ptr, y0_ptr, win_ptr,
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
    CDT: tl.constexpr, PRECISION: tl.constexpr, BIG: tl.constexpr, FLAT_K: tl.constexpr, PHASE_ALIGNED: tl.constexpr,
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
      wm_ptr  PHASE_ALIGNED with ONE_CBLOCK: the prearranged weight matrix of ``phase_aligned_weight_matrix``
              ((groups, KD*KH*KW, COUT_G, KS*BLOCK_K), the compute dtype, contiguous); else unused.
      p_ptr   operand matrix P of ``epilogue.build_params``, (NUM_PARAM_ROWS, C_OUT) fp32 contiguous
              (its bias row is not read).
      b_ptr   (HAS_BIAS) the bias, C_OUT contiguous values, any float dtype.
      out_ptr result (N, C_OUT, pooled or conv-output spatial), any float dtype, strides ``o_s*``.
      y0_ptr  SAVE: the conv output without bias, the compute dtype.  Max pool: its value at each
              window's winner, out's shape and strides; otherwise the whole of it,
              (N, C_OUT, OD, OH, OW), strides ``y_s*``.
      win_ptr SAVE and max pool: winner index in its window (int8/int32), out's shape and strides.
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
    PHASE_ALIGNED: transposed conv with a static phase along every dim: per window offset ONE dot whose K
    axis is (input shift, channel) over all ``NSD * NSH * NSW`` distinct input shifts (padded to
    ``KS``, a power of 2), the weight tile zero where no tap links the offset to the shift
    (``_phase_aligned_x_tile`` / ``_phase_aligned_w_tile``; ``LO*``/``NS*``: the lowest shift and the number of
    shifts per dim).  ONE_CBLOCK (``CIN_G <= BLOCK_K``): the X tile is loaded once and feeds the
    dots of every window offset.
    """
    pid_m = tl.program_id(0)
    m, m_ok, grp, nb = row_channel_tile(pid_m, tl.program_id(1), M_TOTAL, COUT_G, BLOCK_M, BLOCK_N)
    uw, uh, ud, nn = peel_coords(m, UW, UH, UD)
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
        bias = to_compute(tl.load(b_ptr + c, mask=cmask, other=0.0), CDT).to(tl.float32)
    operands = load_chain_operands(p_ptr, c, C_OUT, cmask, OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7)

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
    # What every window offset's epilogue reads (see _offset_epilogue).
    epi = (nn, c64, cmask, bias, operands, out_ptr, o_sn, o_sc, o_sd, o_sh, o_sw, y0_ptr, y_sn, y_sc, y_sd, y_sh, y_sw)
    EPI: tl.constexpr = ((OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7), CDT, HAS_BIAS, POOL, SAVE, BIG)

    best = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    win = tl.full([BLOCK_M, BLOCK_N], -1, tl.int32)
    win_y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    pooled = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    state = (best, win, win_y, pooled)
    if PHASE_ALIGNED:
        # Input position of the lowest shift; offset kp and tap t read i0 + (shift - LO) (static).
        i_d0 = ud * (USD // SD) + LOD
        i_h0 = uh * (USH // SH) + LOH
        i_w0 = uw * (USW // SW) + LOW
        if BIG:
            x_rows = x_base + (i_d0.to(tl.int64) * x_sd + i_h0.to(tl.int64) * x_sh + i_w0.to(tl.int64) * x_sw)
        else:
            x_rows = x_base + (i_d0 * x_sd + i_h0 * x_sh + i_w0 * x_sw)
        # The bundles and per-dim constexprs of _phase_aligned_offsets.
        x_in = (x_rows, i_d0, i_h0, i_w0, ck, CIN_G, ID, IH, IW, x_sc, x_sd, x_sh, x_sw)
        w_in = (w_base, cmask, w_sci, w_sd, w_sh, w_sw)
        units = (ud, uh, uw, m_ok, OD, OH, OW)
        TAPS: tl.constexpr = (TD, TH, TW)
        STRIDE: tl.constexpr = (SD, SH, SW)
        PAD: tl.constexpr = (PD, PH, PW)
        DIL: tl.constexpr = (DD, DH, DW)
        WINDOW: tl.constexpr = (KD, KH, KW)
        USTRIDE: tl.constexpr = (USD, USH, USW)
        UORIGIN: tl.constexpr = (UPD, UPH, UPW)
        LO: tl.constexpr = (LOD, LOH, LOW)
        NS: tl.constexpr = (NSD, NSH, NSW)
        masked = 1  # several channel blocks: the masked variant (a_all does not exist)
        if ONE_CBLOCK:
            a_all = _phase_aligned_x_tile(x_in, m_ok, NS, KS, BIG, BLOCK_K)
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
                    state = _phase_aligned_offsets(
                        a_cur, True, x_in, w_in, wm_base, COUT_G * (KS * BLOCK_K), units, state, epi, EPI,
                        FULL_WINDOWS, TAPS, STRIDE, PAD, DIL, WINDOW, USTRIDE, UORIGIN, LO, NS, KS, PRECISION,
                        BLOCK_M, BLOCK_N, BLOCK_K,
                    )  # fmt: skip
                    if a_cur.dtype == tl.float32:
                        a_cur = a_cur + (_once - pid_m).to(a_cur.dtype)
        # A runtime branch with one channel block; a static one otherwise (masked stays the int 1,
        # so the shared-tile call above is never compiled without a_all).
        if masked != 0:
            state = _phase_aligned_offsets(0.0, False, x_in, w_in, w_base, COUT_G, units, state, epi, EPI, FULL_WINDOWS,
                                           TAPS, STRIDE, PAD, DIL, WINDOW, USTRIDE, UORIGIN, LO, NS, KS, PRECISION,
                                           BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip

    for kd in tl.static_range(KD * (1 - PHASE_ALIGNED)):
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
                state = _offset_epilogue(acc, kd * KH * KW + kh * KW + kw, first, od, oh, ow, o_ok, state, epi, EPI,
                                         False)  # fmt: skip

    if POOL != 0:
        best, win, win_y, pooled = state
        if BIG:
            q = nn * o_sn + ud.to(tl.int64) * o_sd + uh.to(tl.int64) * o_sh + uw.to(tl.int64) * o_sw
        else:
            q = nn * o_sn + ud * o_sd + uh * o_sh + uw * o_sw
        q2 = q[:, None] + c64[None, :] * o_sc
        # The pool over the conv output: its window, stride and padding are the units' offsets,
        # stride and origin.
        POOL_GEOM: tl.constexpr = ((KD, KH, KW), (USD, USH, USW), (UPD, UPH, UPW), COUNT_INCLUDE_PAD, DIVISOR)
        store_pooled(out_ptr, win_ptr, y0_ptr, q2, m_ok[:, None] & cmask, best, win, win_y, pooled,
                     ud[:, None], uh[:, None], uw[:, None], OD, OH, OW, POOL, SAVE, POOL_GEOM)  # fmt: skip


@triton.jit
def phase_aligned_weight_kernel(
    w_ptr, wm_ptr, CIN_G, COUT_G, w_sci, w_sco, w_sd, w_sh, w_sw,
    TAPS: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr, DIL: tl.constexpr, WINDOW: tl.constexpr,
    UORIGIN: tl.constexpr, LO: tl.constexpr, NS: tl.constexpr, KS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program per (window offset, group x output-channel block): writes that offset's
    ``[KS * BLOCK_K, BLOCK_N]`` slice of the prearranged weight matrix (``_phase_aligned_w_tile``'s tile,
    cast to the matrix's dtype (the compute dtype), then TF32-rounded when PRECISION says so) at
    ``wm_ptr`` (see ``phase_aligned_weight_matrix``).  The geometry as ``_phase_aligned_offsets``
    takes it, per (d, h, w): ``TAPS``, ``STRIDE``, ``PAD``, ``DIL`` of the conv, ``WINDOW`` (offsets
    per unit), ``UORIGIN``, ``LO`` / ``NS``; ``KS``: shift slots."""
    kk = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_blocks_n = tl.cdiv(COUT_G, BLOCK_N)
    grp = pid_n // n_blocks_n
    co = (pid_n % n_blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = (co < COUT_G)[None, :]
    kd = kk // (WINDOW[1] * WINDOW[2])
    kh = (kk // WINDOW[2]) % WINDOW[1]
    kw = kk % WINDOW[2]
    w_base = w_ptr + (grp * CIN_G) * w_sci + co[None, :] * w_sco
    tile = _phase_aligned_w_tile((w_base, cmask, w_sci, w_sd, w_sh, w_sw), CIN_G, kd, kh, kw, TAPS, STRIDE, PAD,
                                 DIL, UORIGIN, LO, NS, KS, BLOCK_K)  # fmt: skip
    krow = tl.arange(0, KS * BLOCK_K)
    tl.store(wm_ptr + ((grp * (WINDOW[0] * WINDOW[1] * WINDOW[2]) + kk) * COUT_G + co[None, :]) * (KS * BLOCK_K)
             + krow[:, None],
             round_tf32(tile.to(wm_ptr.dtype.element_ty), PRECISION), mask=cmask)  # fmt: skip
