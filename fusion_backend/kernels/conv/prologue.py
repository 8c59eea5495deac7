"""Device side of the conv family's load: one ``[BLOCK_M, BLOCK_K]`` A tile of the implicit GEMM,
gathered from channels-last ``x`` with the previous layer's normalisation and activation applied.

Everything is ``@triton.jit`` and inlined into the kernels that call it (``fprop``, ``wgrad``; ``dgrad``
recomputes ``normalise`` in its epilogue); the hooks are
selected by constexprs, so a conv without a prologue compiles to a plain masked load.

The A tile of K step ``kk`` (``tiles`` explains the two K walks):

* row ``i`` is output position ``m`` (sample ``n``, ``(od, oh, ow)``); its window starts at input
  ``(od * SD - PD, oh * SH - PH, ow * SW - PW)``, and the caller hoists that origin and the row's
  element offset ``row_base`` (sample, origin, the group's first channel) out of the K loop;
* column ``j`` is K index ``k = kk * BLOCK_K + j``: tap ``(kd, kh, kw)`` and channel ``ci`` of the
  group, read at ``row_base + (kd * DD * x_sd + kh * DH * x_sh + kw * DW * x_sw) + ci`` (channel
  stride 1).

Order of the hook (what ``x'`` is, per element, in fp32): load ``x``; prologue (scale/shift, group
scale/shift and affine, or gate); input activation; then the pad mask: taps outside the input, rows
past ``M`` and channels past ``C_in/groups`` become exactly 0.  The conv pads the *activated* tensor
(``conv(act(bn(x)))`` zero-pads ``act(bn(x))``), so the mask must come after the prologue: a shift
would otherwise turn a padded 0 into ``shift[c]``.  Without a prologue the load's ``other=0`` is that
0 already (every activation of the catalogue maps 0 to 0), and the ``where`` is left out.  The channel
affine (a BatchNorm) masks its shift instead (``x * scale + where(mask, shift, 0)``, ``x`` loaded as 0
there): the same 0 before the activation, selected in fp32 where the compiler otherwise selected on
the converted bf16 pairs, unpacking and repacking them (NOTE at :func:`normalise`).  Only a non-finite
scale tells the two apart (``0 * inf``), where eager's conv output is non-finite already.  ``x'`` is
rounded once to the compute dtype (the weight matrix's; TF32-rounded for a "tf32" dot) for the dot.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..chain_math import step_forward
from ..conv_common import peel_coords


@triton.jit
def activation(v, ACT: tl.constexpr, slope):
    """``v`` (fp32) through the activation with ``chain_math`` op code ``ACT`` (0: none); ``slope``:
    leaky_relu's negative slope (ignored by the others)."""
    return step_forward(v, slope, 0.0, ACT)


@triton.jit
def _tap_coords(tap, KH: tl.constexpr, KW: tl.constexpr):
    """Tap index ``tap`` (row-major over ``(KD, KH, KW)``) -> ``(kd, kh, kw)``."""
    kw = tap % KW
    rest = tap // KW
    return rest // KH, rest % KH, kw


# NOTE: ResNet-50's 3x3 fprop with BatchNorm + ReLU on load (bf16, 128 x 64 x 64, sm_90): 675 SASS
# instructions per K step with the mask on the result, 592 with it on the shift (84 and 74 per MMA; the
# plain kernel 29): ``python tools/compile_check.py conv_family --cases resnet_3x3-bf16-hooked --kernels
# fprop --sass``.
@triton.jit
def normalise(v, n, c, mask, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN,
              PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr,
              MASK_PAD: tl.constexpr = True, ONE_SAMPLE: tl.constexpr = False):  # fmt: skip
    """The normalisation part of the hook on ``v`` (fp32 ``[BLOCK_M, BLOCK_K]``): ``n`` the rows'
    samples ``[BLOCK_M]`` (``ONE_SAMPLE``: the tile's one sample, a scalar: a per-sample prologue's
    vectors are then ``[BLOCK_K]`` loads, not a gather per element), ``c`` the columns' input channels
    ``[BLOCK_K]`` (``c_ok``: which are real), ``mask`` the tile's valid elements.  ``MASK_PAD`` False: the
    tile has no padded lanes but channel tails (an unpadded conv's, ``load_a_tile``), which the vectors'
    ``c_ok`` loads keep at 0, so the channel affine's shift needs no mask.  A per-sample prologue's pad
    lanes come out as anything: its callers mask them after it.  Pointers (fp32, contiguous;
    ``hooks.prologue_tensors``):
      PROLOGUE 1 (channel affine): p0 scale (C_IN,), p1 shift (C_IN,).
      PROLOGUE 2 (group affine):   p0 scale (N, G_NORM), p1 shift (N, G_NORM); NORM_AFFINE: p2 weight
                                   (C_IN,), p3 bias (C_IN,).
      PROLOGUE 3 (gate):           p0 gate (N, C_IN).
    """
    if PROLOGUE == 1:  # the pad lanes: their shift masked, their x loaded as 0 (module docstring)
        scale = tl.load(p0_ptr + c, mask=c_ok, other=0.0)
        shift = tl.load(p1_ptr + c, mask=c_ok, other=0.0)
        if MASK_PAD:
            v = v * scale[None, :] + tl.where(mask, shift[None, :], 0.0)
        else:
            v = v * scale[None, :] + shift[None, :]
    elif PROLOGUE == 2:
        if ONE_SAMPLE:
            ng = n * G_NORM + c // (C_IN // G_NORM)
            scale = tl.load(p0_ptr + ng, mask=c_ok, other=0.0)[None, :]
            shift = tl.load(p1_ptr + ng, mask=c_ok, other=0.0)[None, :]
        else:
            ng = n[:, None] * G_NORM + (c // (C_IN // G_NORM))[None, :]
            scale = tl.load(p0_ptr + ng, mask=mask, other=0.0)
            shift = tl.load(p1_ptr + ng, mask=mask, other=0.0)
        v = v * scale + shift
        if NORM_AFFINE:
            weight = tl.load(p2_ptr + c, mask=c_ok, other=0.0)
            bias = tl.load(p3_ptr + c, mask=c_ok, other=0.0)
            v = v * weight[None, :] + bias[None, :]
    elif PROLOGUE == 3:
        if ONE_SAMPLE:
            gate = tl.load(p0_ptr + n * C_IN + c, mask=c_ok, other=0.0)[None, :]
        else:
            gate = tl.load(p0_ptr + n[:, None] * C_IN + c[None, :], mask=mask, other=0.0)
        v = v * gate
    return v


# NOTE: the unpadded walk (no pad mask; rows past M clamped by the caller, channel tails masked only where
# the K blocks have one) on ResNet-50's 1x1 bottleneck conv (bf16, 128 x 64 x 64, sm_90): fprop with the
# BatchNorm + ReLU prologue 46 SASS instructions per MMA in its main loop against 67, 186 registers against
# 224; its wgrad (rows past M still masked: ``ROWS_ZERO``) 74 against 91; the plain wgrad 46 against 59
# (``python tools/compile_check.py conv_family
# --cases resnet_1x1-bf16,resnet_1x1-bf16-hooked --kernels fprop,wgrad --sass``).  Not timed on a GPU yet.
@triton.jit
def load_a_tile(x_ptr, kk, row_base, n, id0, ih0, iw0, m_ok, g, D, H, W, x_sd, x_sh, x_sw,
                p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                C_IN_G: tl.constexpr, CIN_PAD: tl.constexpr, KD: tl.constexpr, KH: tl.constexpr,
                KW: tl.constexpr, DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr,
                ACT_IN: tl.constexpr, FLAT_K: tl.constexpr, PADDED: tl.constexpr, ROWS_ZERO: tl.constexpr,
                COMPUTE: tl.constexpr, BLOCK_K: tl.constexpr, ONE_SAMPLE: tl.constexpr = False):  # fmt: skip
    """The A tile of K step ``kk`` in the compute dtype ``COMPUTE`` (module docstring).

    ``row_base`` ``[BLOCK_M]``: each row's element offset of its window origin in its group's first
    channel (int64 for BIG tensors); ``n``, ``id0``, ``ih0``, ``iw0``: its sample and origin (``n`` a
    scalar with ``ONE_SAMPLE``: every row of the tile is in that sample, :func:`normalise`);
    ``m_ok``: rows that are real outputs.  ``D, H, W``: input sizes; ``x_s*``: element strides of the
    spatial dims (channel stride 1).  Tap-major (``FLAT_K`` False): ``CIN_PAD`` is ``C_IN_G`` rounded up
    to ``BLOCK_K``, so step ``kk`` is tap ``kk // (CIN_PAD // BLOCK_K)``; flat: ``k`` runs over
    ``KD * KH * KW * C_IN_G`` (tap, channel) pairs.  ``g``: the conv group; ``C_IN``: all input
    channels (the prologue vectors' length).

    Rows past ``M`` must address real memory (the caller clamps them to the last row).  ``PADDED``
    False (the conv has no padding): every window lies inside the input, so only channel tails are
    masked (none where ``CIN_PAD`` is ``C_IN_G``: a plain load), and the prologue needs no select on
    the pad lanes; the rows past ``M`` are then read as they are (a forward never stores them), or as
    0 with ``ROWS_ZERO`` (a weight gradient sums over them: times their zero ``grad_y``, the last row's
    values would add 0, but an infinite one NaN)."""
    if FLAT_K:
        k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        tap = k // C_IN_G
        ci = k % C_IN_G
        c_ok = k < KD * KH * KW * C_IN_G
        kd, kh, kw = _tap_coords(tap, KH, KW)
        di = id0[:, None] + (kd * DD)[None, :]
        hi = ih0[:, None] + (kh * DH)[None, :]
        wi = iw0[:, None] + (kw * DW)[None, :]
        if PADDED:
            inside = (di >= 0) & (di < D) & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
            mask = inside & (m_ok[:, None] & c_ok[None, :])
        else:
            mask = (m_ok[:, None] | (not ROWS_ZERO)) & c_ok[None, :]  # [BLOCK_M, BLOCK_K]
        col = kd * (DD * x_sd) + kh * (DH * x_sh) + kw * (DW * x_sw) + ci
        offs = row_base[:, None] + col[None, :]
    else:
        CB: tl.constexpr = CIN_PAD // BLOCK_K
        tap = kk // CB
        ci = (kk % CB) * BLOCK_K + tl.arange(0, BLOCK_K)
        c_ok = ci < C_IN_G
        kd, kh, kw = _tap_coords(tap, KH, KW)
        offs = (row_base + (kd * (DD * x_sd) + kh * (DH * x_sh) + kw * (DW * x_sw)))[:, None] + ci[None, :]
        if PADDED:
            di = id0 + kd * DD
            hi = ih0 + kh * DH
            wi = iw0 + kw * DW
            r_ok = m_ok & (di >= 0) & (di < D) & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
            mask = r_ok[:, None] & c_ok[None, :]
        else:
            mask = (m_ok[:, None] | (not ROWS_ZERO)) & c_ok[None, :]  # [BLOCK_M, BLOCK_K]
    if PADDED or FLAT_K or ROWS_ZERO or CIN_PAD != C_IN_G:
        a = tl.load(x_ptr + offs, mask=mask, other=0.0)
    else:  # every lane real: no predicate
        a = tl.load(x_ptr + offs)
    if PROLOGUE != 0 or ACT_IN != 0:
        v = a.to(tl.float32)
        v = normalise(v, n, g * C_IN_G + ci, mask, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN,
                      PROLOGUE, G_NORM, NORM_AFFINE, PADDED, ONE_SAMPLE)  # fmt: skip
        if PROLOGUE > 1 and PADDED:  # the pad lanes: 0, which the activation keeps (channel affine: above)
            v = tl.where(mask, v, 0.0)
        a = activation(v, ACT_IN, slope_in)
    return a.to(COMPUTE)


@triton.jit
def window_rows(m, OD, OH, OW, SD, SH, SW, PD, PH, PW, x_sn, x_sd, x_sh, x_sw, BIG: tl.constexpr):
    """Output rows ``m`` (flat over ``(n, od, oh, ow)``) -> ``(n, od, oh, ow, id0, ih0, iw0, row_base)``:
    their coordinates, their windows' origin in the input (``o * S - P`` per dim) and that origin's
    element offset in ``x`` (strides ``x_s*``; int64 for ``BIG``).  Sizes, strides and paddings may be
    runtime values or constexprs (a constexpr size divides by a multiply)."""
    ow, oh, od, n = peel_coords(m, OW, OH, OD)
    id0 = od * SD - PD
    ih0 = oh * SH - PH
    iw0 = ow * SW - PW
    if BIG:
        row_base = n.to(tl.int64) * x_sn + id0.to(tl.int64) * x_sd + ih0.to(tl.int64) * x_sh + iw0.to(tl.int64) * x_sw
    else:
        row_base = n * x_sn + id0 * x_sd + ih0 * x_sh + iw0 * x_sw
    return n, od, oh, ow, id0, ih0, iw0, row_base


@triton.jit
def load_depthwise_tile(x_ptr, tap, row_base, n, id0, ih0, iw0, m_ok, ci, c_ok, D, H, W, x_sd, x_sh, x_sw,
                        p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                        KH: tl.constexpr, KW: tl.constexpr, DD: tl.constexpr, DH: tl.constexpr,
                        DW: tl.constexpr, PROLOGUE: tl.constexpr, G_NORM: tl.constexpr,
                        NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr, COMPUTE: tl.constexpr):  # fmt: skip
    """The ``[BLOCK_M, BLOCK_N]`` input tile of tap ``tap`` for a conv with one input channel per group:
    the rows' windows (``window_rows``) at that tap, input channels ``ci`` (``c_ok``: real ones), through
    the prologue and input activation with the pad lanes 0 (the same order as :func:`load_a_tile`),
    rounded to ``COMPUTE``."""
    kd = tap // (KH * KW)
    kh = (tap // KW) % KH
    kw = tap % KW
    di = id0 + kd * DD
    hi = ih0 + kh * DH
    wi = iw0 + kw * DW
    r_ok = m_ok & (di >= 0) & (di < D) & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
    mask = r_ok[:, None] & c_ok[None, :]
    offs = (row_base + (kd * DD * x_sd + kh * DH * x_sh + kw * DW * x_sw))[:, None] + ci[None, :]
    a = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if PROLOGUE != 0 or ACT_IN != 0:
        v = normalise(a.to(tl.float32), n, ci, mask, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN, PROLOGUE,
                      G_NORM, NORM_AFFINE)  # fmt: skip
        if PROLOGUE > 1:
            v = tl.where(mask, v, 0.0)
        a = activation(v, ACT_IN, slope_in)
    return a.to(COMPUTE)


@triton.jit
def box_coords(b, PLANES_D, H_TILES, W_TILES, BOX_W: tl.constexpr, BLOCK_M: tl.constexpr):
    """Box ``b`` of a walk over planes in boxes (``tiles`` module docstring): ``(n, d, th, tw, h, w)``,
    its sample and plane depth (of ``PLANES_D`` per sample), its box row and column (``tw`` fastest, then
    ``th``, depth, sample) and its ``BLOCK_M`` positions ``(h, w)`` in the plane, ``BOX_W`` per row."""
    BOX_H: tl.constexpr = BLOCK_M // BOX_W
    tw = b % W_TILES
    rest = b // W_TILES
    th = rest % H_TILES
    rest = rest // H_TILES
    i = tl.arange(0, BLOCK_M)
    return rest // PLANES_D, rest % PLANES_D, th, tw, th * BOX_H + i // BOX_W, tw * BOX_W + i % BOX_W


@triton.jit
def load_a_box(x_desc, kk, n, od, oh0, ow0, oh, ow, g, D, H, W, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
               C_IN_G: tl.constexpr, CIN_PAD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
               PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
               PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr,
               PADDED: tl.constexpr, COMPUTE: tl.constexpr, BOX_H: tl.constexpr, BOX_W: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    """The A tile of K step ``kk`` loaded as one box (``tiles`` module docstring), in ``COMPUTE``.

    ``x_desc``: a tensor descriptor of the input as ``(N, D, H, W, C_IN)`` (channel stride 1), block
    ``(1, 1, BOX_H, BOX_W, BLOCK_K)``, zero padding.  The tile's rows are the ``BOX_H x BOX_W`` output
    positions from ``(oh0, ow0)`` of plane ``(n, od)`` (stride and dilation 1), row ``i`` at ``(oh, ow)``
    ``[BLOCK_M]``; K step ``kk`` is tap ``kk // (CIN_PAD // BLOCK_K)`` and a block of the group ``g``'s
    channels, tap-major as ``load_a_tile``.  The copy reads every element outside the input, and every
    channel past ``C_IN``, as 0: the conv's zero padding where no prologue runs.  With one, the pad lanes
    are masked after it, as ``load_a_tile`` does (``PADDED`` False: there are none).  A group's channel
    tail reads the next group's channels: the weight gradient, the one caller, drops those K entries."""
    CB: tl.constexpr = CIN_PAD // BLOCK_K
    tap = kk // CB
    c0 = (kk % CB) * BLOCK_K
    kd, kh, kw = _tap_coords(tap, KH, KW)
    box = x_desc.load([n, od + kd - PD, oh0 + kh - PH, ow0 + kw - PW, g * C_IN_G + c0])
    a = tl.reshape(box, [BOX_H * BOX_W, BLOCK_K])
    if PROLOGUE != 0 or ACT_IN != 0:
        ci = c0 + tl.arange(0, BLOCK_K)
        c_ok = ci < C_IN_G
        if PADDED:
            hi = oh + kh - PH
            wi = ow + kw - PW
            r_ok = (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
            if PD > 0:  # the plane's input depth, one for every row (as a row vector: a mask is a tensor)
                di = tl.zeros_like(oh) + (od + kd - PD)
                r_ok = r_ok & (di >= 0) & (di < D)
            mask = r_ok[:, None] & c_ok[None, :]
        else:
            mask = (oh[:, None] >= 0) & c_ok[None, :]  # [BLOCK_M, BLOCK_K]: the channel tail alone
        v = normalise(a.to(tl.float32), n, g * C_IN_G + ci, mask, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN,
                      PROLOGUE, G_NORM, NORM_AFFINE, PADDED, True)  # fmt: skip
        if PROLOGUE > 1 and PADDED:
            v = tl.where(mask, v, 0.0)
        a = activation(v, ACT_IN, slope_in)
    return a.to(COMPUTE)
