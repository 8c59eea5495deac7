"""Device code of the Triton conv backward (``kernels/conv_fused_bwd``): the gradient loader, the
input-grad (``dgrad_kernel``) and weight-grad (``wgrad_kernel``) kernels, their tiles and autotuned
wrappers.  The implicit gradient forms, the numerics and the arguments are described in the package
docstring and at each kernel; ``plan.py`` builds their launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..conv_common import peel_coords
from ..host import INTERPRETER, best_first, tile_bench
from ..tf32 import round_tf32

_INTERPRET = INTERPRETER  # kernels/host.py: whether Triton's interpreter is on


# --------------------------------------------------------------------------------------------------
# Loader: the conv-output gradient (or x) at (row positions) x (channels).
# --------------------------------------------------------------------------------------------------


@triton.jit
def _ix(v, I64: tl.constexpr):
    """``v`` as an offset: int64 when ``I64`` (some tensor spans 2**31 elements or more), else int32."""
    if I64:
        return v.to(tl.int64)
    else:
        return v


@triton.jit
def _window_candidate(q, a, ok, J, K: tl.constexpr, S: tl.constexpr, DIL: tl.constexpr):
    """Along one dim of a max pool (``K`` taps, stride ``S``, dilation ``DIL``, ``J`` windows): the
    ``a``-th candidate window of position ``q`` (shifted by the pool padding, so non-negative),
    counting down from the last window starting at or before it.  Returns ``(j, r, ok)``: the
    window, ``q``'s offset in it, and ``ok`` narrowed to where that window exists and holds ``q``
    on one of its taps."""
    j = q // S - a
    r = q - j * S
    return j, r, ok & (j >= 0) & (j < J) & (r % DIL == 0) & (r < K * DIL)


@triton.jit
def _load_at(
    ptr, win_ptr, n64, pd, ph, pw, row_ok, c, c_ok,
    D, H, W, JD, JH, JW,
    s_n, s_c, s_d, s_h, s_w,
    w_sn, w_sc, w_sd, w_sh, w_sw,
    POOLED: tl.constexpr, POOL_GEOM: tl.constexpr, I64: tl.constexpr,
):  # fmt: skip
    """Tile of values at positions ``(n, pd, ph, pw)`` x channels ``c``; 0 outside (D, H, W).

    Dense: the tensor's dtype; pooled: fp32 (sums over windows).

    ``n64, pd, ph, pw, row_ok`` share one "row" shape and ``c, c_ok`` one "channel" shape that
    broadcast against each other ([R, 1] and [1, C], or [1, R] and [C, 1]): all index arithmetic
    runs on the row vectors, per element only an address add, the loads and a compare remain.
    Dense (``POOLED`` False): ``ptr`` is an ``(N, C, D, H, W)`` tensor with strides ``s_*``.
    Pooled: ``ptr`` is ``g_win`` (strides ``s_*``) and ``win_ptr`` the winners (strides ``w_s*``),
    both ``(N, C, JD, JH, JW)``; the value is the sum over the (at most NJD*NJH*NJW) windows that
    contain the position and whose winner is it.  ``POOL_GEOM``: the max pool's ``(kernel, stride,
    padding, dilation, NJ)``, each per (d, h, w); ``NJ``: candidate windows per position.
    """
    PK: tl.constexpr = POOL_GEOM[0]
    PS: tl.constexpr = POOL_GEOM[1]
    PP: tl.constexpr = POOL_GEOM[2]
    PDIL: tl.constexpr = POOL_GEOM[3]
    # (scalars: tl.static_range takes a constexpr, and an element of a tuple launch argument may be
    # a plain int)
    NJD: tl.constexpr = POOL_GEOM[4][0]
    NJH: tl.constexpr = POOL_GEOM[4][1]
    NJW: tl.constexpr = POOL_GEOM[4][2]
    row_ok = row_ok & (pd >= 0) & (pd < D) & (ph >= 0) & (ph < H) & (pw >= 0) & (pw < W)
    c64 = _ix(c, I64)
    if not POOLED:
        row = n64 * s_n + _ix(pd, I64) * s_d + _ix(ph, I64) * s_h + _ix(pw, I64) * s_w
        # NOTE: no cast here: a load that feeds tl.dot directly is what Triton's pipeliner
        # multi-buffers (a bf16 -> fp32 -> bf16 round trip defeats it).
        return tl.load(ptr + (row + c64 * s_c), mask=row_ok & c_ok, other=0.0)
    else:
        # Shift to non-negative coordinates so that // and % agree between C and Python semantics.
        qd = tl.where(row_ok, pd, 0) + PP[0]
        qh = tl.where(row_ok, ph, 0) + PP[1]
        qw = tl.where(row_ok, pw, 0) + PP[2]
        acc = tl.zeros((row_ok & c_ok).shape, tl.float32)
        g_col = c64 * s_c
        w_col = c64 * w_sc
        for ad in tl.static_range(NJD):
            jd, rd, ok_d = _window_candidate(qd, ad, row_ok, JD, PK[0], PS[0], PDIL[0])
            for ah in tl.static_range(NJH):
                jh, rh, ok_h = _window_candidate(qh, ah, ok_d, JH, PK[1], PS[1], PDIL[1])
                for aw in tl.static_range(NJW):
                    jw, rw, hit = _window_candidate(qw, aw, ok_h, JW, PK[2], PS[2], PDIL[2])
                    widx = (rd // PDIL[0]) * (PK[1] * PK[2]) + (rh // PDIL[1]) * PK[2] + rw // PDIL[2]
                    jd64 = _ix(jd, I64)
                    jh64 = _ix(jh, I64)
                    jw64 = _ix(jw, I64)
                    w_row = n64 * w_sn + jd64 * w_sd + jh64 * w_sh + jw64 * w_sw
                    g_row = n64 * s_n + jd64 * s_d + jh64 * s_h + jw64 * s_w
                    win = tl.load(win_ptr + (w_row + w_col), mask=hit & c_ok, other=-1)
                    take = (win.to(tl.int32) == widx) & hit & c_ok
                    acc += tl.load(ptr + (g_row + g_col), mask=take, other=0.0).to(tl.float32)
        return acc


@triton.jit
def _load_rows(ptr, win_ptr, n64, pd, ph, pw, row_ok, c, c_ok, layout, POOLED: tl.constexpr,
               POOL_GEOM: tl.constexpr, I64: tl.constexpr, CL: tl.constexpr, ROWS_FIRST: tl.constexpr):  # fmt: skip
    """``_load_at``'s tile at rows ``(n64, pd, ph, pw, row_ok)`` (``[R]`` each) x channels ``(c,
    c_ok)`` (``[C]`` each) as ``[R, C]`` (``ROWS_FIRST``) or ``[C, R]``; ``layout``: ``_load_at``'s
    ``(D, H, W, JD, JH, JW, s_n, s_c, s_d, s_h, s_w, w_sn, w_sc, w_sd, w_sh, w_sw)``.

    NOTE: the tile is loaded with the memory-contiguous axis last (Triton's default thread order;
    ``CL``: the channels are that axis), then transposed in registers where that is not the order
    asked for."""
    if CL:
        t = _load_at(ptr, win_ptr, n64[:, None], pd[:, None], ph[:, None], pw[:, None], row_ok[:, None], c[None, :],
                     c_ok[None, :], *layout, POOLED, POOL_GEOM, I64)  # fmt: skip
        if not ROWS_FIRST:
            t = tl.trans(t)
    else:
        t = _load_at(ptr, win_ptr, n64[None, :], pd[None, :], ph[None, :], pw[None, :], row_ok[None, :], c[:, None],
                     c_ok[:, None], *layout, POOLED, POOL_GEOM, I64)  # fmt: skip
        if ROWS_FIRST:
            t = tl.trans(t)
    return t


# --------------------------------------------------------------------------------------------------
# Input gradient
# --------------------------------------------------------------------------------------------------


def dgrad_configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 32}, num_warps=4, num_stages=1)]
    # NOTE: tiles for Hopper; BLOCK_N (x channels) and BLOCK_K (g channels) are set by the launcher.
    return [
        triton.Config({"BLOCK_M": 128}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 256}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=4),
    ]


@triton.jit
def dgrad_kernel(
    g_ptr, win_ptr, w_ptr, tab_ptr, cnt_ptr, dx_ptr,
    CI_G, CO_G, NTAP_MAX, ID, IH, IW, OD, OH, OW, JD, JH, JW, MAXT, num_c_blocks,
    x_sn, x_sc, x_sd, x_sh, x_sw,
    g_sn, g_sc, g_sd, g_sh, g_sw,
    v_sn, v_sc, v_sd, v_sh, v_sw,
    w_s_grp, w_s_out, w_s_red,
    XSD: tl.constexpr, XSH: tl.constexpr, XSW: tl.constexpr,
    GSD: tl.constexpr, GSH: tl.constexpr, GSW: tl.constexpr,
    POOLED: tl.constexpr, G_CL: tl.constexpr, X_CL: tl.constexpr, POOL_GEOM: tl.constexpr,
    PREC: tl.constexpr, I64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``dx[n, grp*CI_G + ci, r + XS*t] = sum_{j < cnt[r], co} g[n, grp*CO_G + co, GS*t + off_j] * w_j``.

    Pointers (element strides, dims lifted to (N, C, D, H, W)):
      g_ptr, win_ptr  conv-output gradient, dense (N, C_out, OD, OH, OW) strides ``g_s*``; or pooled
                      ``g_win`` (strides ``g_s*``) + ``winner`` (strides ``v_s*``), (N, C_out, JD, JH, JW).
      w_ptr           weight; element ``(grp, out channel ci, reduction channel co, tap j)`` at
                      ``grp*w_s_grp + ci*w_s_out + co*w_s_red + tab[r, j, 0]``.
      tab_ptr         int32 (phases, NTAP_MAX, 4): per phase r and its j-th tap: weight tap offset
                      (elements) and the g offsets (d, h, w).  ``cnt_ptr``: int32 (phases,) taps per phase.
      dx_ptr          result (N, C_in, ID, IH, IW), strides ``x_s*``; every element written once.
    ``POOL_GEOM``: the pooled gradient's max pool (``_load_at``).
    Program ids: 0 -> (n, phase, M block), 1 -> (group, N block).  Phases: (XSD, XSH, XSW) grid
    (all 1 for a transposed conv); a phase's positions are ``r + XS*t``.  The K loop walks (tap,
    BLOCK_K channels): offsets are uniform per K block, so the position arithmetic is per row.
    """
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    num_m_blocks = tl.cdiv(MAXT, BLOCK_M)
    mb = pid0 % num_m_blocks
    rest = pid0 // num_m_blocks
    ph = rest % (XSD * XSH * XSW)
    n = rest // (XSD * XSH * XSW)
    cb = pid1 % num_c_blocks
    grp = pid1 // num_c_blocks
    rw = ph % XSW
    rh = (ph // XSW) % XSH
    rd = ph // (XSW * XSH)
    TD = (ID - rd + XSD - 1) // XSD
    TH = (IH - rh + XSH - 1) // XSH
    TW = (IW - rw + XSW - 1) // XSW

    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < TD * TH * TW
    tw = m % TW
    th = (m // TW) % TH
    td = m // (TW * TH)
    ci = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    ci_ok = ci < CI_G
    n64 = _ix(n, I64)
    ntap = tl.load(cnt_ptr + ph)
    n_cc = tl.cdiv(CO_G, BLOCK_K)
    w_base = w_ptr + _ix(grp, I64) * w_s_grp + _ix(ci[None, :], I64) * w_s_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for it in range(0, ntap * n_cc):
        j = it // n_cc
        co = (it - j * n_cc) * BLOCK_K + tl.arange(0, BLOCK_K)
        co_ok = co < CO_G
        tab = tab_ptr + (ph * NTAP_MAX + j) * 4
        w_off = tl.load(tab)
        o_d = td * GSD + tl.load(tab + 1)
        o_h = th * GSH + tl.load(tab + 2)
        o_w = tw * GSW + tl.load(tab + 3)
        g_ch = grp * CO_G + co
        # NOTE: the tile is loaded with the memory-contiguous axis last (Triton's default thread
        # order), so channels-first g is read as [K, M] and transposed in registers.
        if G_CL:
            a = _load_at(g_ptr, win_ptr, n64, o_d[:, None], o_h[:, None], o_w[:, None], m_ok[:, None], g_ch[None, :],
                         co_ok[None, :], OD, OH, OW, JD, JH, JW, g_sn, g_sc, g_sd, g_sh, g_sw, v_sn, v_sc, v_sd,
                         v_sh, v_sw, POOLED, POOL_GEOM, I64)  # fmt: skip
        else:
            a = _load_at(g_ptr, win_ptr, n64, o_d[None, :], o_h[None, :], o_w[None, :], m_ok[None, :], g_ch[:, None],
                         co_ok[:, None], OD, OH, OW, JD, JH, JW, g_sn, g_sc, g_sd, g_sh, g_sw, v_sn, v_sc, v_sd,
                         v_sh, v_sw, POOLED, POOL_GEOM, I64)  # fmt: skip
            a = tl.trans(a)
        b = tl.load(w_base + _ix(co[:, None], I64) * w_s_red + w_off, mask=co_ok[:, None] & ci_ok[None, :], other=0.0)
        acc = tl.dot(round_tf32(a.to(b.dtype), PREC), round_tf32(b, PREC), acc, input_precision=PREC)
    x_row = (
        n64 * x_sn
        + _ix(rd + XSD * td, I64) * x_sd
        + _ix(rh + XSH * th, I64) * x_sh
        + _ix(rw + XSW * tw, I64) * x_sw
    )
    x_col = _ix(grp * CI_G + ci, I64) * x_sc
    if X_CL:
        x_off = x_row[:, None] + x_col[None, :]
        tl.store(dx_ptr + x_off, acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & ci_ok[None, :])
    else:
        x_off = x_row[None, :] + x_col[:, None]
        tl.store(dx_ptr + x_off, tl.trans(acc).to(dx_ptr.dtype.element_ty), mask=m_ok[None, :] & ci_ok[:, None])


dgrad_tuned = triton.autotune(
    configs=best_first(dgrad_configs()),
    key=["CI_G", "CO_G", "MAXT", "NTAP_MAX", "BLOCK_N", "BLOCK_K", "POOLED", "G_CL", "X_CL", "PREC", "I64"],
    do_bench=tile_bench,
    cache_results=True,  # tile choices kept in Triton's cache dir across processes
)(dgrad_kernel)


# --------------------------------------------------------------------------------------------------
# Weight gradient
# --------------------------------------------------------------------------------------------------


def wgrad_configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    # NOTE: BLOCK_A / BLOCK_G (weight dim-0 / dim-1 channels per program) and BLOCK_R (positions
    # along W per step) are set by the launcher.
    return [
        triton.Config({}, num_warps=4, num_stages=3),
        triton.Config({}, num_warps=4, num_stages=4),
        triton.Config({}, num_warps=8, num_stages=3),
        triton.Config({}, num_warps=8, num_stages=4),
        triton.Config({}, num_warps=4, num_stages=2),
    ]


@triton.jit
def wgrad_kernel(
    a_ptr, b_ptr, win_ptr, tab_ptr, part_ptr,
    A_G, B_G, KVOL, LINES, SPLIT, PART_NUMEL, lines_per_split, num_a_blocks, num_b_blocks,
    TD, TH, TW, BD, BH, BW, JD, JH, JW,
    a_sn, a_sc, a_sd, a_sh, a_sw,
    b_sn, b_sc, b_sd, b_sh, b_sw,
    v_sn, v_sc, v_sd, v_sh, v_sw,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    G_IS_A: tl.constexpr, A_POOLED: tl.constexpr, B_POOLED: tl.constexpr, A_CL: tl.constexpr, B_CL: tl.constexpr,
    LINE_MODE: tl.constexpr, POOL_GEOM: tl.constexpr, PREC: tl.constexpr, I64: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Partial ``dw[grp*A_G + a, b, j] = sum_{rows} A[n, grp*A_G + a, t] * B[n, grp*B_G + b, t*S + off_j]``.

    Pointers (element strides, dims lifted to (N, C, D, H, W)):
      a_ptr  the "A" tensor over the (TD, TH, TW) reduction grid, strides ``a_s*``: g (conv; dense, or
             pooled ``g_win`` + ``win_ptr`` with strides ``v_s*`` and pooled sizes JD, JH, JW) or x
             (transposed conv).
      b_ptr  the "B" tensor (BD, BH, BW), strides ``b_s*``: x (conv) or g (transposed conv, same
             dense/pooled rule).  ``G_IS_A`` says which one is g; the MMA runs in x's dtype.
      tab_ptr int32 (KVOL, 4): per tap j: unused, and the offsets ``off_j`` (d, h, w) = ``-p + k*dl``.
      part_ptr fp32 (SPLIT, C_w0, B_G, KVOL) contiguous: this program's partial sums.
    ``POOL_GEOM``: the pooled gradient's max pool (``_load_at``).
    Rows (``LINE_MODE`` only changes the walk): all W positions of the lines ``(n, td, th)`` numbered ``n*TD*TH + td*TH + th`` in
    ``[split*lines_per_split, (split+1)*lines_per_split) & [0, LINES)``.
    Program ids: 0 -> (group, A block, tap, B block), 1 -> split (so the programs sharing rows run
    together and share them through L2).
    """
    pid0 = tl.program_id(0)
    split = tl.program_id(1)
    bb, j, ab, grp = peel_coords(pid0, num_b_blocks, KVOL, num_a_blocks)

    a = ab * BLOCK_A + tl.arange(0, BLOCK_A)
    a_ok = a < A_G
    bch = bb * BLOCK_G + tl.arange(0, BLOCK_G)
    b_ok = bch < B_G
    o_d = tl.load(tab_ptr + j * 4 + 1)
    o_h = tl.load(tab_ptr + j * 4 + 2)
    o_w = tl.load(tab_ptr + j * 4 + 3)
    a_ch = grp * A_G + a
    b_ch = grp * B_G + bch
    # NOTE: with LINE_MODE (W wide enough to fill BLOCK_R) rows are walked as (line, W block),
    # a line being (n, td, th): the index arithmetic is scalar per step instead of three vector
    # div/mods by runtime sizes per row.  Otherwise BLOCK_R consecutive rows, decomposed per row.
    l_lo = split * lines_per_split
    l_hi = tl.minimum(l_lo + lines_per_split, LINES)
    if LINE_MODE:
        n_wb = tl.cdiv(TW, BLOCK_R)
        it_lo = l_lo * n_wb
        it_hi = l_hi * n_wb
    else:
        n_wb = 1
        it_lo = (l_lo * TW) // BLOCK_R  # a block straddling two splits is done by both, masked
        it_hi = tl.cdiv(l_hi * TW, BLOCK_R)
    acc = tl.zeros([BLOCK_A, BLOCK_G], tl.float32)
    for it in range(it_lo, it_hi):
        if LINE_MODE:
            line = it // n_wb
            tw = (it - line * n_wb) * BLOCK_R + tl.arange(0, BLOCK_R)
            r_ok = tw < TW
            n = line // (TD * TH)
            rem = line - n * (TD * TH)
            # NOTE: scalars splat to the row vector's shape (the interpreter rejects masks built
            # from scalar comparisons; on the GPU a splat costs nothing).
            zero = tl.zeros([BLOCK_R], tl.int32)
            td = rem // TH + zero
            th = rem - (rem // TH) * TH + zero
            n = n + zero
        else:
            r = it * BLOCK_R + tl.arange(0, BLOCK_R)
            r_ok = (r >= l_lo * TW) & (r < l_hi * TW)
            line = r // TW
            tw = r - line * TW
            n = line // (TD * TH)
            rem = line - n * (TD * TH)
            td = rem // TH
            th = rem - td * TH
        n64 = _ix(n, I64)
        # A tile [BLOCK_A, BLOCK_R] at the row positions; B tile [BLOCK_R, BLOCK_G] at t*S + off_j.
        b_d = (td * SD + o_d)
        b_h = (th * SH + o_h)
        b_w = (tw * SW + o_w)
        at = _load_rows(a_ptr, win_ptr, n64, td, th, tw, r_ok, a_ch, a_ok,
                        (TD, TH, TW, JD, JH, JW, a_sn, a_sc, a_sd, a_sh, a_sw, v_sn, v_sc, v_sd, v_sh, v_sw),
                        A_POOLED, POOL_GEOM, I64, A_CL, False)  # fmt: skip
        bt = _load_rows(b_ptr, win_ptr, n64, b_d, b_h, b_w, r_ok, b_ch, b_ok,
                        (BD, BH, BW, JD, JH, JW, b_sn, b_sc, b_sd, b_sh, b_sw, v_sn, v_sc, v_sd, v_sh, v_sw),
                        B_POOLED, POOL_GEOM, I64, B_CL, True)  # fmt: skip
        if G_IS_A:
            at = at.to(b_ptr.dtype.element_ty)
            bt = bt.to(b_ptr.dtype.element_ty)
        else:
            at = at.to(a_ptr.dtype.element_ty)
            bt = bt.to(a_ptr.dtype.element_ty)
        acc = tl.dot(round_tf32(at, PREC), round_tf32(bt, PREC), acc, input_precision=PREC)
    out = part_ptr + _ix(split, I64) * PART_NUMEL + _ix(a_ch[:, None], I64) * (B_G * KVOL) + (bch * KVOL + j)[None, :]
    tl.store(out, acc, mask=a_ok[:, None] & b_ok[None, :])

wgrad_tuned = triton.autotune(
    configs=best_first(wgrad_configs()),
    key=["A_G", "B_G", "KVOL", "LINES", "TW", "SPLIT", "BLOCK_A", "BLOCK_R", "LINE_MODE", "BLOCK_G", "A_POOLED",
         "B_POOLED", "A_CL", "B_CL", "PREC", "I64"],
    do_bench=tile_bench,
    cache_results=True,
)(wgrad_kernel)
