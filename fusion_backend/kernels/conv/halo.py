"""The conv family's forward with its prologue applied once per input element and channel block (the
*halo forward*): a variant of :func:`fprop.conv_fprop_kernel` for hooked convs wider than 1x1, which a
:class:`tiles.TileConfig` with ``halo`` selects.

WHY: the gather forward applies the prologue (the previous layer's normalisation and activation) to its
A tile on every K step, so a 3x3 conv normalises each input element nine times, ALU work of the order
of the MMA's at 64 output channels per tile (docs/perf/RESULTS.md: the hooked 3x3 of 64 channels at 56 x
56 0.109 ms against the plain kernel's 0.050).  Here a program first normalises its tile's input window,
the *halo*, once per channel block into a scratch slot of its own (global memory, L2-resident: one slot
per program of a persistent grid), and each tap's A tile is then a plain masked load from the slot.

Which convs: stride 1, 'same' size (the output plane is the input plane: ``OH == H``, ``OW == W``), one
or two spatial dims (``KD == 1``), any kernel size, padding and dilation, groups, a channels-last dense
``x``.  Then output row ``m`` (flat over ``(n, oh, ow)``) reads, at tap ``(kh, kw)``, input row ``m -
(PH * W + PW) + kh * DH * W + kw * DW`` of ``x``'s flat ``[N * H * W, C_in]`` rows (where the tap lies
inside the plane; the pad mask zeroes the others, as the gather kernel's): a shift uniform over the
tile.  So the rows a tile's taps read are the ``HALO_ROWS = BLOCK_M + (KH - 1) * DH * W + (KW - 1) * DW``
consecutive rows from its first row less ``PH * W + PW`` (:func:`halo_rows`).

Per tile and channel block: a CTA barrier (every thread's reads of the slot's previous block are done),
the halo's rows in steps of :func:`halo_chunk` rows: loaded, normalised and activated (fp32, one
rounding to the compute dtype, as :func:`prologue.load_a_tile`), stored to the slot; a barrier; then
each tap's A tile loaded from the slot (through L2: ``.cg``, the slot was written by other threads of
the CTA) with the gather kernel's pad mask, and one dot with the weight's block of the tap.  Within a CTA, global writes
before a barrier are visible to the CTA's loads after it.  The epilogue is :func:`epilogue.store_tile`.
NOTE: the tap loop is short (nine steps per block), its pipeline filled and drained once per block; a
slot holding every block's window, all written first, then one K loop over (tap, block) pipelined whole
(one program per SM, the slots in L2) ran 1.02-1.06x the time of this walk on the wide halo tile and
1.4-1.9x on the short one (H200, bf16, the SD VAE decoder's GroupNorm + SiLU 3x3s and ResNet-50's hooked
3x3s: ``python tools/bench_conv.py demos/realnets/sd_vae_decoder.py --passes fprop --fprop-hooks
gn-silu``, ``tile_ms``, the whole-K tiles added to the timed choice's candidates), so the walk stays per
block.

Prologue work per tile: ``HALO_ROWS`` rows (rounded up to a step, :func:`halo_chunk`) against
``BLOCK_M`` rows per tap (nine taps) in the gather kernel, 1.1-1.9x the tile's rows for ResNet-50's
3x3s at 7 x 7 to 56 x 56; the slot is written once and read once per tap.

Box tiles (``TileConfig.box_w``): on a wide plane the flat halo is mostly the rows above and below the
tile (a 3x3 over planes 512 wide: 64 output rows read a halo of 1,090), so a tile may instead be a box of
``BLOCK_M // BOX_W`` rows by ``BOX_W`` columns of one sample's plane (:func:`box_rows`), whose window is
the box widened by the kernel's reach, ``(BOX_H + (KH - 1) * DH) x (BOX_W + (KW - 1) * DW)`` positions
(8 x 16 boxes of a 3x3: 180 for 128 outputs).  The window is written with the padding's zeros in place
(:func:`write_box_window`), so a tap's tile is an unmasked load of the window shifted by the tap
(:func:`box_tap`); positions of a box past the plane's edge are computed and not stored.  A box holds one
sample (a per-sample prologue's vectors are read once per chunk).  A box's statistics are its real
positions' (the store masks the others), their count per box given to the reduction
(``boxes.box_positions``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..host import cdiv
from ..tf32 import round_tf32
from .epilogue import store_tile
from .prologue import activation, box_coords, normalise

#: Programs per SM of the halo kernel's persistent grid, each with its scratch slot (the slots of a
#: grid that fits the device at once stay in L2: 528 slots of 256 x 64 bf16 rows are 17 MB).
PROGRAMS_PER_SM = 4
#: The rows of the halo written per step (:func:`halo_chunk`): the first where it holds at most 64 x 64
#: values and pads the window with no more rows than the second.
HALO_CHUNKS = (64, 32)


@triton.jit
def write_window(x_ptr, slot, first, ROWS, c, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN, PLANE, HALO_ROWS,
                 PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr,
                 BIG: tl.constexpr, HALO_CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                 ONE_SAMPLE: tl.constexpr = False):  # fmt: skip
    """``HALO_ROWS`` flat rows of x (channels-last dense: row ``r`` at ``r * C_IN``) from ``first``, at
    channels ``c`` (``c_ok`` the real ones), through the prologue and ``act_in`` (fp32, rounded once to
    x's dtype, as ``prologue.load_a_tile``), into ``slot`` (row-major ``[rows, BLOCK_K]``), in chunks of
    ``HALO_CHUNK`` rows (:func:`halo_chunk`), between two CTA barriers: the slot's previous window read by
    every thread before, this one written by every thread after.  Rows outside ``[0, ROWS)`` (x's) are written as anything:
    the taps' loads mask them.  ``PLANE``: rows per sample (a per-sample prologue's index; ``ONE_SAMPLE``:
    x holds one sample, whose vectors the prologue reads once per chunk)."""
    rc = tl.arange(0, HALO_CHUNK)
    kb = tl.arange(0, BLOCK_K)
    tl.debug_barrier()
    for r0 in range(0, HALO_ROWS, HALO_CHUNK):
        rows = first + r0 + rc
        mask = ((rows >= 0) & (rows < ROWS) & (r0 + rc < HALO_ROWS))[:, None] & c_ok[None, :]
        if BIG:
            offs = rows.to(tl.int64)[:, None] * C_IN + c[None, :]
        else:
            offs = rows[:, None] * C_IN + c[None, :]
        v = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if PROLOGUE != 0 or ACT_IN != 0:
            if ONE_SAMPLE:
                n = 0
            else:
                n = tl.minimum(tl.maximum(rows, 0), ROWS - 1) // PLANE
            v = normalise(v.to(tl.float32), n, c, mask, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN, PROLOGUE, G_NORM,
                          NORM_AFFINE, True, ONE_SAMPLE)  # fmt: skip
            v = activation(v, ACT_IN, slope_in)
        tl.store(slot + (r0 + rc)[:, None] * BLOCK_K + kb[None, :], v.to(x_ptr.dtype.element_ty))
    tl.debug_barrier()


@triton.jit
def box_rows(pid_m, H, W, BOX_W: tl.constexpr, BLOCK_M: tl.constexpr):
    """Box tile ``pid_m`` of the planes (``BOX_H = BLOCK_M // BOX_W`` rows by ``BOX_W`` columns of one
    sample's plane, walked as ``prologue.box_coords`` walks them): ``(n, oh0, ow0, m, m_ok)``, its sample
    and first position, and its ``BLOCK_M`` output rows (flat over ``(n, oh, ow)``; a position past the
    plane's edge is not real and addresses the edge's)."""
    BOX_H: tl.constexpr = BLOCK_M // BOX_W
    n, _, th, tw, oh, ow = box_coords(pid_m, 1, (H + BOX_H - 1) // BOX_H, (W + BOX_W - 1) // BOX_W, BOX_W, BLOCK_M)
    m = n * (H * W) + tl.minimum(oh, H - 1) * W + tl.minimum(ow, W - 1)
    return n, th * BOX_H, tw * BOX_W, m, (oh < H) & (ow < W)


@triton.jit
def write_box_window(x_ptr, slot, n, ih0, iw0, H, W, c, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                     HALO_ROWS, WIN_W: tl.constexpr, PROLOGUE: tl.constexpr, G_NORM: tl.constexpr,
                     NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr, BIG: tl.constexpr, HALO_CHUNK: tl.constexpr,
                     WIDTH: tl.constexpr):  # fmt: skip
    """A box tile's window (module docstring): the ``HALO_ROWS / WIN_W`` rows by ``WIN_W`` columns of
    sample ``n``'s input plane from ``(ih0, iw0)`` (may start or run past the plane), at channels ``c``
    (``c_ok`` the real ones), through the prologue and ``act_in`` (fp32, rounded once to x's dtype, as
    ``prologue.load_a_tile``), into ``slot`` (window position ``j`` at row ``j``, ``[rows, WIDTH]``), in
    chunks of ``HALO_CHUNK`` rows between two CTA barriers, as :func:`write_window`.  Positions outside
    the plane and channels past ``c_ok`` are written as 0 (the conv's padding of the activated tensor),
    so that the taps' loads need no mask (:func:`box_tap`).  A box holds one sample: a per-sample
    prologue reads its vectors once per chunk."""
    rc = tl.arange(0, HALO_CHUNK)
    kb = tl.arange(0, WIDTH)
    tl.debug_barrier()
    for r0 in range(0, HALO_ROWS, HALO_CHUNK):
        j = r0 + rc
        ih = ih0 + j // WIN_W
        iw = iw0 + j % WIN_W
        inside = (j < HALO_ROWS) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        rows = n * (H * W) + ih * W + iw
        if BIG:
            rows = rows.to(tl.int64)
        mask = inside[:, None] & c_ok[None, :]
        v = tl.load(x_ptr + rows[:, None] * C_IN + c[None, :], mask=mask, other=0.0)
        if PROLOGUE != 0 or ACT_IN != 0:
            v = normalise(v.to(tl.float32), n, c, mask, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN, PROLOGUE, G_NORM,
                          NORM_AFFINE, True, True)  # fmt: skip
            v = tl.where(mask, activation(v, ACT_IN, slope_in), 0.0)
        tl.store(slot + j[:, None] * WIDTH + kb[None, :], v.to(x_ptr.dtype.element_ty))
    tl.debug_barrier()


@triton.jit
def box_tap(slot, tap, KW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, WIN_W: tl.constexpr,
            BOX_W: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """Tap ``tap``'s ``[BLOCK_M, WIDTH]`` input tile of a box tile from its window in ``slot``
    (:func:`write_box_window`): output position ``(bh, bw)`` of the box at window position ``(bh + kh *
    DH, bw + kw * DW)``; unmasked (the window holds the padding's zeros)."""
    kh = tap // KW
    kw = tap % KW
    r = tl.arange(0, BLOCK_M)
    local = (r // BOX_W + kh * DH) * WIN_W + r % BOX_W + kw * DW
    return tl.load(slot + local[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :], cache_modifier=".cg")


@triton.jit
def conv_fprop_halo_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, res_ptr, out_ptr, conv_ptr, part_ptr, q_ptr, p0_ptr, p1_ptr, p2_ptr,
    p3_ptr, slope_in, slope_out, scratch_ptr,
    M, H, W, C_IN, C_OUT, C_OUT_G, M_TILES, N_TILES, TILES, HALO_ROWS,
    C_IN_G: tl.constexpr, CIN_PAD: tl.constexpr, K_ROW: tl.constexpr, COUT_PAD: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr,
    SAVE_CONV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, CHAIN: tl.constexpr,
    ACT_OUT: tl.constexpr, RESIDUAL: tl.constexpr, STATS: tl.constexpr, PRECISION: tl.constexpr,
    BIG: tl.constexpr, DEPTHWISE: tl.constexpr, ONE_SAMPLE: tl.constexpr, BOX_W: tl.constexpr,
    HALO_CAP: tl.constexpr, HALO_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Tiles ``program_id(0), + num_programs(0), ...`` of the ``TILES = groups * M_TILES * N_TILES``
    output tiles (group slowest, then M tile, then N tile), each ``[BLOCK_M, BLOCK_N]`` (module
    docstring).  ``x_ptr``: channels-last dense ``(N, C_IN, H, W)`` (row ``r`` of the flat ``[N * H *
    W, C_IN]`` at ``r * C_IN``); ``scratch_ptr``: one slot of ``HALO_CAP * BLOCK_K`` elements of the
    compute dtype per program (of ``HALO_CAP * BLOCK_N`` with ``DEPTHWISE``); ``HALO_ROWS``: the rows a
    tile's taps read (:func:`halo_rows`), written in chunks of ``HALO_CHUNK`` rows; ``HALO_CAP`` at least
    that, a multiple of ``HALO_CHUNK``.  ``DEPTHWISE``: one input channel per output channel (no channel
    multiplier), the weight ``(C_OUT, taps)`` rows, N tiles over all channels (one group).  The other
    pointers, sizes and constexprs are :func:`fprop.conv_fprop_kernel`'s (the weight prearranged or in
    place as there, tap-major); ``ONE_SAMPLE`` here: x holds one sample (:func:`write_window`).  ``BOX_W``
    (box tiles, module docstring): ``M_TILES`` boxes of ``BLOCK_M // BOX_W`` rows by ``BOX_W`` columns,
    ``HALO_ROWS`` the positions of one box's window."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    CB: tl.constexpr = CIN_PAD // BLOCK_K
    TAPS: tl.constexpr = KH * KW
    PADDED: tl.constexpr = (PH > 0) or (PW > 0)
    plane = H * W
    rows_total = M  # 'same' stride 1: the input's flat rows are the output's
    WIDTH: tl.constexpr = BLOCK_N if DEPTHWISE else BLOCK_K  # a window row's channels
    slot = scratch_ptr + pid * (HALO_CAP * WIDTH)
    r = tl.arange(0, BLOCK_M)
    kb = tl.arange(0, BLOCK_K)
    WIN_W: tl.constexpr = BOX_W + (KW - 1) * DW  # a box's window's columns (box tiles)
    for t in range(pid, TILES, programs):
        g = t // (M_TILES * N_TILES)
        pid_m = (t // N_TILES) % M_TILES
        pid_n = t % N_TILES
        if BOX_W > 0:  # a box of one sample's plane, its window the box widened by the kernel's reach
            n, oh0, ow0, m, m_ok = box_rows(pid_m, H, W, BOX_W, BLOCK_M)
            ih0 = oh0 - PH
            iw0 = ow0 - PW
            oh, ow, first = 0, 0, 0  # the flat window's (unused)
        else:
            m = pid_m * BLOCK_M + r
            m_ok = m < M
            mc = tl.minimum(m, M - 1)
            oh = (mc % plane) // W
            ow = mc % W
            first = pid_m * BLOCK_M - (PH * W + PW)  # the halo's first flat input row (may be negative)
            n, ih0, iw0 = 0, 0, 0  # the box's (unused)
        co = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_cols = w_ptr + g * (COUT_PAD * K_ROW) + co[None, :] * K_ROW  # [1, BLOCK_N]; padded rows: no mask
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        # per channel block, the window, then each tap's tile of it; DEPTHWISE: one block, the tile's own
        # channels, and per tap a product with the channels' weights (``fprop._depthwise_tile``'s, summed in
        # fp32), no dot
        for cb in range(0, 1 if DEPTHWISE else CB):
            if DEPTHWISE:
                c, c_ok = co, co < C_OUT
            else:
                ci = cb * BLOCK_K + kb
                c, c_ok = g * C_IN_G + ci, ci < C_IN_G
            write_tile_window(x_ptr, slot, n, ih0, iw0, first, rows_total, H, W, c, c_ok, p0_ptr, p1_ptr, p2_ptr,
                              p3_ptr, slope_in, C_IN, plane, HALO_ROWS, WIN_W, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN,
                              BIG, HALO_CHUNK, WIDTH, ONE_SAMPLE, BOX_W)  # fmt: skip
            for tap in range(0, TAPS):
                a = tap_tile(slot, tap, oh, ow, m_ok, c_ok, H, W, KW, PH, PW, DH, DW, PADDED, WIN_W, BOX_W, BLOCK_M,
                             WIDTH)  # fmt: skip
                if DEPTHWISE:
                    wv = tl.load(w_ptr + co * TAPS + tap, mask=c_ok, other=0.0).to(tl.float32)
                    acc += a.to(tl.float32) * wv[None, :]
                else:
                    b = tl.load(w_cols + (tap * CIN_PAD + cb * BLOCK_K + kb)[:, None])
                    acc = tl.dot(round_tf32(a, PRECISION), round_tf32(b, PRECISION), acc, input_precision=PRECISION)
        if DEPTHWISE:  # the tile's channels are the output's own
            cols, cols_ok = co, co < C_OUT
        else:
            cols, cols_ok = g * C_OUT_G + co, co < C_OUT_G
        store_tile(acc, m, m_ok, cols, cols_ok, pid_m, out_ptr, conv_ptr, scale_ptr, bias_ptr, res_ptr, part_ptr,
                   q_ptr, slope_out, C_OUT, M_TILES, SAVE_CONV, HAS_SCALE, HAS_BIAS, CHAIN, ACT_OUT, RESIDUAL, STATS,
                   BIG)  # fmt: skip


@triton.jit
def write_tile_window(x_ptr, slot, n, ih0, iw0, first, ROWS, H, W, c, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
                      slope_in, C_IN, PLANE, HALO_ROWS, WIN_W: tl.constexpr, PROLOGUE: tl.constexpr,
                      G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr, BIG: tl.constexpr,
                      HALO_CHUNK: tl.constexpr, WIDTH: tl.constexpr, ONE_SAMPLE: tl.constexpr,
                      BOX_W: tl.constexpr):  # fmt: skip
    """A tile's window at channels ``c``: a box tile's (``BOX_W`` > 0: :func:`write_box_window` from
    ``(n, ih0, iw0)``) or the flat halo's (:func:`write_window` from row ``first``)."""
    if BOX_W > 0:
        write_box_window(x_ptr, slot, n, ih0, iw0, H, W, c, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                         HALO_ROWS, WIN_W, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN, BIG, HALO_CHUNK, WIDTH)  # fmt: skip
    else:
        write_window(x_ptr, slot, first, ROWS, c, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN, PLANE,
                     HALO_ROWS, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN, BIG, HALO_CHUNK, WIDTH, ONE_SAMPLE)  # fmt: skip


@triton.jit
def tap_tile(slot, tap, oh, ow, m_ok, c_ok, H, W, KW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
             DH: tl.constexpr, DW: tl.constexpr, PADDED: tl.constexpr, WIN_W: tl.constexpr, BOX_W: tl.constexpr,
             BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """Tap ``tap``'s ``[BLOCK_M, WIDTH]`` tile of the window :func:`write_tile_window` wrote: a box
    tile's (:func:`box_tap`) or the flat halo's (:func:`window_tap`)."""
    if BOX_W > 0:
        a = box_tap(slot, tap, KW, DH, DW, WIN_W, BOX_W, BLOCK_M, WIDTH)
    else:
        a = window_tap(slot, tap, oh, ow, m_ok, c_ok, H, W, KW, PH, PW, DH, DW, PADDED, BLOCK_M, WIDTH)
    return a


@triton.jit
def window_tap(slot, tap, oh, ow, m_ok, c_ok, H, W, KW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                DH: tl.constexpr, DW: tl.constexpr, PADDED: tl.constexpr, BLOCK_M: tl.constexpr,
                WIDTH: tl.constexpr):  # fmt: skip
    """Tap ``tap``'s ``[BLOCK_M, WIDTH]`` input tile from the window in ``slot`` (rows of ``WIDTH``
    channels, :func:`write_window`): output row ``i`` (``(oh, ow)`` its position) at slot row ``i + kh *
    DH * W + kw * DW``; taps outside the plane, rows past M (``m_ok``) and channels past ``c_ok`` 0, as
    the gather kernel's pad mask."""
    kh = tap // KW
    kw = tap % KW
    local = tl.arange(0, BLOCK_M) + (kh * DH * W + kw * DW)
    if PADDED:
        hi = oh - PH + kh * DH
        wi = ow - PW + kw * DW
        r_ok = m_ok & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
    else:
        r_ok = m_ok
    return tl.load(slot + local[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :], mask=r_ok[:, None] & c_ok[None, :],
                   other=0.0, cache_modifier=".cg")  # fmt: skip


def halo_rows(block_m: int, width: int, kernel: tuple[int, int], dilation: tuple[int, int], box_w: int = 0) -> int:
    """The input positions one tile of ``block_m`` output rows reads over every tap of a 'same',
    stride-1 conv over planes ``width`` wide (module docstring): consecutive flat rows, or with ``box_w``
    (box tiles of ``block_m // box_w`` rows by ``box_w`` columns) the box's window."""
    if box_w:
        return (block_m // box_w + (kernel[0] - 1) * dilation[0]) * (box_w + (kernel[1] - 1) * dilation[1])
    return block_m + (kernel[0] - 1) * dilation[0] * width + (kernel[1] - 1) * dilation[1]


def halo_chunk(rows: int, block_m: int, width: int) -> int:
    """The rows of a window of ``rows`` positions by ``width`` channels that a tile of ``block_m``
    output rows writes per step (``HALO_CHUNK``; the window is padded to a multiple of it,
    ``HALO_CAP``): 64 where a step holds at most 64 x 64 values and pads the window with no more rows
    than steps of 32 (every lane of a step loads, runs the prologue and stores), else 32; at most
    ``block_m``.  WHY: a step's prologue waits for its loads, so fewer, wider steps keep more of them in
    flight.  NOTE: steps of 64 rows of 64 channels ran 1.03-1.26x faster than steps of 32 on the SD VAE
    decoder's GroupNorm + SiLU 3x3s (512 channels at 128 x 128, 256 and 128 at 512 x 512; the wide halo
    tile 0.190 -> 0.170, 0.727 -> 0.647, 0.387 -> 0.354 ms, the short one 0.293 -> 0.255, 1.205 ->
    0.955, 0.293 -> 0.283), steps of 128 and 256 rows slower than 64 on all six (H200, bf16,
    ``conv_fprop`` with fixed box tiles, CUDA events; windows of 180 and 100 positions, padded alike by
    32 and 64); wider steps (a depthwise tile's 128 channels) were not timed."""
    steps = [min(c, block_m) for c in HALO_CHUNKS if c == HALO_CHUNKS[-1] or c * width <= 64 * 64]
    return min(steps, key=lambda c: (cdiv(rows, c) * c, -c))


def applies(geo: object, x_dense: bool, per_sample_stats: bool) -> str | None:
    """Why the halo forward cannot run a call (``fprop._Geometry`` ``geo``), or None where it can: stride
    1, 'same' size, no depth (``KD == 1``), more than one input channel per group or a depthwise conv
    without a channel multiplier, a channels-last dense ``x`` (``x_dense``) and no per-sample statistics
    (its tiles cross samples)."""
    if any(s != 1 for s in geo.stride):
        return "a strided conv"
    if tuple(geo.out_size) != tuple(geo.size):
        return "an output plane of another size than the input's"
    if geo.kernel[0] != 1 or geo.size[0] != 1:
        return "a 3-d conv"
    if geo.c_in_g == 1 and geo.c_out != geo.c_in:
        return "a depthwise conv with a channel multiplier"
    if not x_dense:
        return "an x that is not channels-last dense"
    if per_sample_stats:
        return "per-sample statistics"
    return None
