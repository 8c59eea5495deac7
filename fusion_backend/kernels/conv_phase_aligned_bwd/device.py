"""Device code of the phase-aligned backward (``kernels/conv_phase_aligned_bwd``): the input-grad, weight-grad and
weight-grad finish kernels and the helpers they share.  The notation, the numerics and each kernel's
arguments are described in the package docstring and at each kernel; ``plan.py`` builds their launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..conv_common import live_tap, peel_coords, row_channel_tile
from ..tf32 import round_tf32, to_compute

#: Most pool-window offsets (KD * KH * KW): columns of the weight grad's partial.
MAX_WINDOW_VOLUME = 64
#: Header of the input-grad live-block table: (start row, row count) for every KPB <= MAX_WINDOW_VOLUME.
TABLE_HEADER = tl.constexpr(2 * (MAX_WINDOW_VOLUME + 1))


# --------------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _tap_of(kp, j, UP: tl.constexpr, P: tl.constexpr, S: tl.constexpr, DIL: tl.constexpr, T: tl.constexpr):
    """Tap ``t`` linking window offset ``kp`` to input shift ``j`` along one dim
    (``kp - UP + P - t*DIL == S*j``), and whether it exists (``0 <= t < T``)."""
    return live_tap(kp - UP + P - S * j, DIL, T)


@triton.jit
def _offset_taps(kp, jd, jh, jw, KH: tl.constexpr, KW: tl.constexpr, TAPS: tl.constexpr, STRIDE: tl.constexpr,
                 PAD: tl.constexpr, DIL: tl.constexpr, UORIGIN: tl.constexpr):  # fmt: skip
    """``_tap_of`` per dim for window offsets ``kp`` (row-major flat over ``(KD, KH, KW)``) and input
    shift ``(jd, jh, jw)``: ``(td, th, tw, ok_d, ok_h, ok_w)``.  ``TAPS``, ``STRIDE``, ``PAD``,
    ``DIL`` (the conv's) and ``UORIGIN`` (the pool padding): (d, h, w) constexprs."""
    td, ok_d = _tap_of(kp // (KH * KW), jd, UORIGIN[0], PAD[0], STRIDE[0], DIL[0], TAPS[0])
    th, ok_h = _tap_of((kp // KW) % KH, jh, UORIGIN[1], PAD[1], STRIDE[1], DIL[1], TAPS[1])
    tw, ok_w = _tap_of(kp % KW, jw, UORIGIN[2], PAD[2], STRIDE[2], DIL[2], TAPS[2])
    return td, th, tw, ok_d, ok_h, ok_w


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
def _valid_winner(v, ud, uh, uw, row_ok, OD, OH, OW, STRIDE: tl.constexpr, UORIGIN: tl.constexpr,
                  KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, ROWS_FIRST: tl.constexpr):  # fmt: skip
    """``v`` (winners of the units ``(ud, uh, uw)``, ``[BLOCK_M]`` each; ``[BLOCK_M, BLOCK_CO]`` when
    ``ROWS_FIRST``, else ``[BLOCK_CO, BLOCK_M]``), with
    -1 where the row is masked or the winner is no window offset whose conv-output position
    ``o = u*US - UP + kp`` exists (such a winner contributes nothing, as in ``conv_fused_bwd``).
    ``STRIDE`` (the units' stride ``US``, the conv's) and ``UORIGIN`` (``UP``): (d, h, w) constexprs.

    NOTE: checked once per pooled-gradient element, not per (row, offset) of the expanded tile: a
    ``[BLOCK_M, KPB]`` mask took the 3d expansion's layout (all rows of a column in one thread's
    registers) and the input-grad kernel hit 255 registers."""
    if ROWS_FIRST:
        od0, oh0, ow0, r_ok = (
            (ud * STRIDE[0] - UORIGIN[0])[:, None],
            (uh * STRIDE[1] - UORIGIN[1])[:, None],
            (uw * STRIDE[2] - UORIGIN[2])[:, None],
            row_ok[:, None],
        )
    else:
        od0, oh0, ow0, r_ok = (
            (ud * STRIDE[0] - UORIGIN[0])[None, :],
            (uh * STRIDE[1] - UORIGIN[1])[None, :],
            (uw * STRIDE[2] - UORIGIN[2])[None, :],
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
    """``Gexp`` ``[BLOCK_M, BLOCK_CO * KPB]`` from the pooled-gradient ``[BLOCK_M, BLOCK_CO]`` tiles ``g`` and
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
        uw, uh, ud, n = peel_coords(m0 + r, UW, UH, UD)
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
def phase_aligned_dgrad_kernel(
    g_ptr, v_ptr, w_ptr, tab_ptr, dx_ptr,
    M_TOTAL, CI_G, CO_G,
    ID, IH, IW, OD, OH, OW, UD, UH, UW,
    x_sn, x_sc, x_sd, x_sh, x_sw,
    g_sn, g_sc, g_sd, g_sh, g_sw,
    v_sn, v_sc, v_sd, v_sh, v_sw,
    w_sci, w_sco, w_sd, w_sh, w_sw,
    TAPS: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr, DIL: tl.constexpr, UORIGIN: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
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
    Geometry: ``TAPS``, ``STRIDE``, ``PAD``, ``DIL`` of the conv and ``UORIGIN`` (the pool padding),
    each per (d, h, w); ``KD, KH, KW`` the pool window (its stride is the conv's).
    Program ids: 0 -> block of BLOCK_M input positions (n, id, ih, iw) row-major over M_TOTAL;
    1 -> (group, block of BLOCK_CI input channels).  ``WIN_INSIDE``: every pool window lies inside
    the conv output (no partial windows), so winners need no range check.
    """
    if V_SAME:  # winner laid out like g_win: one offset computation serves both
        v_sn, v_sc, v_sd, v_sh, v_sw = g_sn, g_sc, g_sd, g_sh, g_sw
    m, m_ok, grp, cib = row_channel_tile(tl.program_id(0), tl.program_id(1), M_TOTAL, CI_G, BLOCK_M, BLOCK_CI)
    iw, ih, i_d, n = peel_coords(m, IW, IH, ID)
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
    entries = tab_ptr + TABLE_HEADER + 5 * sh_start
    acc = tl.zeros([BLOCK_M, BLOCK_CI], tl.float32)
    # NOTE: runtime loops: unrolled, every block's weight tile would be hoisted into registers.
    # Outer: (shift, channel block): the pooled-gradient tile at u = i - j is loaded once; inner: the
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
            v = _valid_winner(v, ud, uh, uw, row_ok, OD, OH, OW, STRIDE, UORIGIN, KD, KH, KW, True)
        for q in range(0, kp_count):
            kp0 = tl.load(tab_ptr + kp_first + q)
            vq = v
            if (
                KPB == 1 and not WIN_INSIDE
            ):  # one offset: check its position per row (cheaper than decoding v)
                od = ud * STRIDE[0] - UORIGIN[0] + kp0 // (KH * KW)
                oh = uh * STRIDE[1] - UORIGIN[1] + (kp0 // KW) % KH
                ow = uw * STRIDE[2] - UORIGIN[2] + kp0 % KW
                o_ok = row_ok & (od >= 0) & (od < OD) & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
                vq = tl.where(o_ok[:, None], v, -1)
            if KPB == 1:  # table entries of single offsets are live pairs by construction
                a = tl.where(vq == kp0, g, 0.0)
            else:  # the block's offsets and which of them form a live pair with this shift
                kp = kp0 + kq
                _, _, _, ok_d, ok_h, ok_w = _offset_taps(kp, jd, jh, jw, KH, KW, TAPS, STRIDE, PAD, DIL, UORIGIN)
                live = (kp < KD * KH * KW) & ok_d & ok_h & ok_w
                a = _expand(g, vq, kp, live, BLOCK_M, KPB, BLOCK_CO)
            # B: row (c, q) = w[ci, co, t(kp0 + q, j)], zero for a dead pair (never 0 * inf with A).
            kpc = kp0 + col_q
            tdc, thc, twc, okc_d, okc_h, okc_w = _offset_taps(kpc, jd, jh, jw, KH, KW, TAPS, STRIDE, PAD, DIL, UORIGIN)
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
def phase_aligned_wgrad_kernel(
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
    cob, kpb, cib, grp = peel_coords(pid, n_cob, n_kpb, n_cib)
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
        uw0, uh0, ud0, n0 = peel_coords(lo, UW, UH, UD)
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
        # shape (each pooled-gradient element read by KPB rows, from L1).
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
            v = _valid_winner(v, ud, uh, uw, m_ok, OD, OH, OW, (SD, SH, SW), (UPD, UPH, UPW), KD, KH, KW, False)
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
            uw1, uh1, ud1, n1 = peel_coords(m, UW, UH, UD)
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
def phase_aligned_wgrad_finish_kernel(
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
