"""The conv family's forward on sm_90 written in Gluon (the *TMA forward*): the same conv, hooks and
store as :func:`fprop.conv_fprop_kernel`, with its operands loaded as TMA boxes and its layouts
chosen; a :class:`tiles.TileConfig` with ``tma`` selects it.  It takes 1x1 convs without padding and
with one group: the GEMM ``out[M, C_out] = a(x)[M, C_in] @ W[C_in, C_out]`` over the channels-last rows
of ``x`` the conv reads.  At stride 1 those are all of x's rows: an M tile is ``BLOCK_M`` consecutive
rows (*row tiles*), a K step one ``[BLOCK_M, BLOCK_K]`` box of them.  At a larger stride they are x's
rows at the stride, which no 2-d box spans: the descriptor spans them as the 5-d view ``[P2, P1, R,
W_out, C_in]`` of :class:`StridedRows` (the output's ``(N, D_out, H_out)`` rows merged into as few dims
as their strides allow: a 2-d conv's whose height is the stride times the output's is one dim of ``N *
H_out`` rows), and an M tile is the ``[1, 1, box_h, box_w]`` box of it (*strided boxes*; ``box_h * box_w
= BLOCK_M``, powers of two chosen so that the boxes cover the fewest positions past the plane), loaded
into the ring as such and read by ``wgmma`` as the ``[BLOCK_M, BLOCK_K]`` tile it is.  A box's
positions past the plane (below its last ``R`` row or right of its last column) read zeros and are never
stored or counted.  The forward's timed tile choice weighs its tiles against the gather kernel's
(``tiles.candidates``).  NOTE: H200, bf16, ResNet-50's 1x1s at stride 2, batch 64 (GPU ms per call,
strided boxes' best tile against the gather kernel's): 256 -> 512 at 56 x 56 0.0389 against 0.0451 (cuDNN
0.0318), with BatchNorm + ReLU on load and the statistics 0.0826 against 0.1008; 512 -> 1024 at 28 x 28
0.0323 against 0.0306 and 1024 -> 2048 at 14 x 14 0.0330 against 0.0251, where the gather is chosen
(``python tools/bench_conv.py demos/realnets/resnet50.py --passes fprop --filter '*k1x1 s2*' --profile``,
the report's ``tile_ms``).

The same kernel is such a conv's input gradient (``GRAD``, :meth:`TmaLaunch.input_grad`):
``grad_a[M, C_in] = dy[M, C_out] @ W[C_out, C_in]``, the forward's GEMM with the channels exchanged
(at a stride past 1 over grad_y's rows, each result stored at its input position at the stride and the
window's other positions, which no output reads, stored as 0 through the same store; NOTE: H200, bf16,
ResNet-50's 1x1s at stride 2, plain, against the gather kernel's phases: 256 -> 512 at 56 x 56 0.0509
against 0.0748 ms (cuDNN 0.0586), 512 -> 1024 at 28 x 28 0.0448 against 0.0472, 1024 -> 2048 at 14 x 14
0.0357 against 0.0323; with relu' and the sums 1.7-1.9x the gather's time while every zero went through
act' and the sums reading x_prev, which :func:`zeros_read_x` now spares ReLU's (not yet timed):
``python tools/bench_conv.py demos/realnets/resnet50.py --passes dgrad --filter '*k1x1 s2*'``, the
report's ``tile_ms``),
the weight's box read as it lies (``wgmma`` takes a 16-bit B MN-major), the store
:func:`grad_epilogue.store_grad_tile` (act' of the recomputed prologue), and the BatchNorm-backward sums
per program as the forward's statistics below.  NOTE: on ResNet-50's 1x1 input gradients with relu' and
the sums (H200, bf16, batch 64), 256 -> 64 at 56 x 56 0.0837 ms against the gather kernel's 0.171, 64
-> 64 0.0314 against 0.0447; plain 64 -> 64 0.0157 against 0.0165 (``python tools/bench_conv.py
demos/realnets/resnet50.py --passes dgrad --profile``, ``docs/perf/h200/conv-kernels-dgrad/``).
NOTE: a TMA store of the output tile (a shared-memory tile stored asynchronously while the next tile
computes, and the plain store in the accumulator's layout) was written and timed on the same rows and
removed: plain forwards unchanged (64 -> 256 0.0436 against 0.0442 ms), hooked rows 10% faster or
slower by shape (64 -> 256 forward with the prologue and statistics 0.064 against 0.071, the 256 -> 64
hooked input gradient 0.093 against 0.084).

NOTE: no box tiles (an M tile a box of the output plane, a K step the input box shifted by its tap,
for kernels wider than 1x1): written, GPU-tested and timed, they lost to the gather kernel on every
shape, plain and hooked (H200, bf16, GPU ms per call, plain / BatchNorm + ReLU on load + statistics:
ResNet-50's 3x3 of 64 channels at 56 x 56, batch 64, 0.063 / 0.142 against the gather's 0.050 / 0.109;
of 512 at 7 x 7 0.107 / 0.217 against 0.043 / 0.094, its 8 x 16 boxes mostly past the plane; the SD VAE
decoder's 512-channel 3x3 at 256 x 256 0.49 against 0.42 plain, its best tile each; the sweep
``CONVK_TMA=1 CONVK_TESTS=0 CONVK_BENCH=0 CONVK_SWEEP=0 bash tools/gpu_session.sh convk`` at commit
f8cb842, whose ``tiles.tma_tiles`` offered box tiles; docs/perf/RESULTS.md).  A 3x3's prologue runs once
per tap on every element, ALU work of the order of the MMA's at 64 output channels, whatever loads the
boxes; applying it once per element needs the taps' A operands as row-shifted views of one normalized
box in shared memory, which Triton's shared-memory slices refuse (a slice's offset must be a multiple of
its length).

WHY a kernel of its own: Triton's ``tl.dot`` form fixes the layouts, and two of them cost the hooked
forward most of its time.  (1) A prologue on the A tile (``relu(x * scale + shift)``) takes the tile
from shared memory into a blocked layout and back before ``wgmma`` reads it, beside the gather's
per-row address arithmetic: the hooked 3x3 issues 587 SASS instructions per K step against the plain
kernel's 231.  (2) The statistics' sums over a tile's rows run in the accumulator's layout, where a
column's rows are spread over 8 lanes and every warp: shuffles and a shared-memory exchange per sum,
per tile.  Gluon states its layouts:

* both operands arrive by TMA in a ring of stages, each with its mbarrier; the kernel is persistent
  (a program per SM's worth of tiles) and walks its (tile, K step) pairs in one loop, so the next
  tile's first boxes load during this tile's store;
* with a prologue, each thread loads its part of the A tile straight into ``wgmma``'s register
  operand layout (``DotOperandLayout``), applies the prologue there (fp32, one rounding to the compute
  dtype, as :func:`prologue.load_a_tile`; the channel affine's vectors are loaded before the stage's
  wait) and issues ``wgmma`` with A from registers; without one, ``wgmma`` reads A from
  shared memory; one ``wgmma`` group stays in flight while the next step's prologue runs;
* the store converts the accumulator to a layout whose lanes run along the channels and whose
  threads each hold ``BLOCK_M / num_warps`` rows of their columns, and calls the family's own
  :func:`epilogue.store_tile` there: the bias, scale, chain, activations, residual and saved conv are
  the gather kernel's formulas; a store with no fp32 arithmetic before its one rounding converts the
  accumulator already rounded (:func:`round_first`: 16-bit values in the exchange's shared memory);
* a BatchNorm's statistics are summed per program, not per tile: the grid is a multiple of the N
  tiles, so a program's tiles share their channels; each thread adds its own rows' deviations from the
  program's shift (its first tile's mean) and their squares in registers over all the program's
  tiles, and the program reduces them across threads once, at its end (:func:`grid_programs`,
  :func:`lane_rows`; the reduction then forms the squared deviations in float64,
  ``stats.PartialsReduction``'s ``raw_squares``).  Per tile, the gather kernel's store sums each tile
  across lanes and warps and writes a row of partials.

NOTE: the statistics, not the prologue, were the hooked forward's cost on 1x1 convs (measured with
the statistics summed per tile in the store's layout, before the per-program sums).  H200, bf16,
batch 64 (GPU ms per call; ``conv_fprop`` plain, with BatchNorm + ReLU on load, with the output's
statistics, with both), 64 -> 256 channels at 56 x 56: gather 0.049 / 0.058 / 0.133 / 0.145, row
tiles with the statistics per tile 0.044 / 0.053 / 0.083 / 0.093, per program 0.044 / 0.054 / 0.064 /
0.072 (the 128 x 64 tile); 512 -> 128 at 28 x 28: gather 0.022 / 0.024 / 0.041 / 0.044, row tiles per
program 0.024 / 0.032 / 0.033 / 0.041 (``tools/sweep_conv_tiles.py --passes fprop --tma [--hooked]``
times these tiles).  Where ``C_in`` is 256 or more the plain K loop trails the gather kernel's, where
the timed choice takes the gather.

Contract (:func:`supports` says whether a call qualifies): fp16 or bf16 (TMA boxes of 16-bit elements;
fp32 keeps the gather kernel and its TF32 rounding), ``C_in`` a multiple of 8 (TMA strides are multiples
of 16 bytes), a 1x1 kernel, one group, no padding, any stride; the prologue a channel affine, a group
affine or a gate, any input activation; every store hook but GroupNorm's per-sample statistics (tiles
cross samples).  An ``x`` or weight that is not the dense, 16-byte aligned tensor the boxes read (a
slice, a view at an odd offset) is copied to one first.  K tails (``C_in`` not a multiple of
``BLOCK_K``): the boxes read zeros past ``C_in`` in ``x`` and in the weight, and the prologue's vectors
are masked to 0, so those lanes add ``act(0) * 0 = 0``.  Rows past ``M`` are computed and never stored or
counted.

Gluon is Triton's experimental explicit-layout language (``triton.experimental.gluon``); the kernel
compiles with Triton 3.6 and 3.9, whose TMA load and CTA barrier differ in name (``_tma_load``,
``_thread_barrier``).  It has no interpreter: on CPU this path is compiled
(``tools/compile_check.py conv_tma``) but never run, and
:func:`supports` is False there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..chain_math import OP_CODES
from ..host import INTERPRETER, multiprocessors
from ..launch import FastLaunch

try:  # Gluon is experimental: a Triton without it (or with another API) keeps the gather kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    #: Triton 3.9 names the TMA load ``async_load``; 3.6 ``async_copy_global_to_shared``
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    #: and a CTA-wide barrier ``barrier`` (3.9) or ``thread_barrier`` (3.6)
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    GLUON = False

from .epilogue import store_tile
from .grad_epilogue import store_grad_tile
from .prologue import activation, normalise
from .tiles import tma_programs_per_sm, tma_stages

#: Element sizes the TMA boxes take here (16-bit operands).
_DTYPES = (torch.float16, torch.bfloat16)
#: Channel counts a TMA box's channel dim takes (16-byte strides: multiples of 8 16-bit elements).
CHANNEL_ALIGN = 8


if GLUON:

    @gluon.jit
    def _a_operand(a_smem, scale, shift, k0, n, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                   a_layout: gl.constexpr, PROLOGUE: gl.constexpr, G_NORM: gl.constexpr,
                   NORM_AFFINE: gl.constexpr, ACT_IN: gl.constexpr, EVEN_K: gl.constexpr):  # fmt: skip
        """The A tile of the K step at channel ``k0`` in ``wgmma``'s register layout, through the
        prologue (``prologue.normalise``, then ``act_in``, in fp32; one rounding to the compute dtype).
        ``scale``, ``shift``: a channel affine's vectors for the step (:func:`_channel_vectors`, loaded
        before the step's wait); ``n``: the tile rows' samples (``[BLOCK_M]``, the group affine's and the
        gate's index)."""
        a = a_smem.load(a_layout)
        v = a.to(gl.float32)
        if PROLOGUE == 1:
            v = v * scale[None, :] + shift[None, :]
        elif PROLOGUE != 0:
            BLOCK_K: gl.constexpr = a.shape[1]
            c = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_layout))
            c_ok = _channels_ok(c, C_IN, EVEN_K, BLOCK_K, gl.SliceLayout(0, a_layout))
            v = normalise(v, n, c, c_ok[None, :], c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN, PROLOGUE, G_NORM,
                          NORM_AFFINE, MASK_PAD=False)  # fmt: skip
        v = activation(v, ACT_IN, slope_in)
        return v.to(a.dtype)

    @gluon.jit
    def _channels_ok(c, C_IN, EVEN_K: gl.constexpr, BLOCK_K: gl.constexpr, layout: gl.constexpr):
        if EVEN_K:  # a constant mask: the vectors' loads compile unmasked (and vectorised)
            return gl.full([BLOCK_K], 1, gl.int1, layout=layout)
        return c < C_IN

    @gluon.jit
    def _channel_vectors(k0, p0_ptr, p1_ptr, C_IN, a_layout: gl.constexpr, PROLOGUE: gl.constexpr,
                         EVEN_K: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """A channel affine's scale and shift for the K step at channel ``k0`` (0 past ``C_IN``), in the
        A operand's column layout; zeros for the other prologues (unused)."""
        layout: gl.constexpr = gl.SliceLayout(0, a_layout)
        c = k0 + gl.arange(0, BLOCK_K, layout=layout)
        if PROLOGUE == 1:
            c_ok = _channels_ok(c, C_IN, EVEN_K, BLOCK_K, layout)
            return gl.load(p0_ptr + c, mask=c_ok, other=0.0), gl.load(p1_ptr + c, mask=c_ok, other=0.0)
        zero = gl.zeros([BLOCK_K], gl.float32, layout=layout)
        return zero, zero

    @gluon.jit
    def _tile_rows(pid_m, M, SAMPLE_ROWS, BOX_R, BOX_WO, BLOCK_M: gl.constexpr, BOX_W: gl.constexpr,
                   layout: gl.constexpr):  # fmt: skip
        """M tile ``pid_m``'s rows in ``layout``'s row slice: ``(m, m_ok, n)``, the output positions
        (row-major ``(n, *spatial)``), which are real, and their samples.  ``BOX_W`` 0: a row tile's
        ``BLOCK_M`` consecutive positions; else a strided box's (:func:`_box_origin`), position ``i`` of
        the tile its row ``i // BOX_W`` and column ``i % BOX_W``, real where those are below ``BOX_R`` and
        ``BOX_WO``."""
        i = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        if BOX_W == 0:
            m = pid_m * BLOCK_M + i
            m_ok = m < M
        else:
            p, r0, w0 = _box_origin(pid_m, BOX_R, BOX_WO, BLOCK_M // BOX_W, BOX_W)
            r = r0 + i // BOX_W
            w = w0 + i % BOX_W
            m = (p * BOX_R + r) * BOX_WO + w
            m_ok = (r < BOX_R) & (w < BOX_WO)
        return m, m_ok, gl.minimum(m, M - 1) // SAMPLE_ROWS

    @gluon.jit
    def _box_origin(pid_m, BOX_R, BOX_WO, BOX_H: gl.constexpr, BOX_W: gl.constexpr):
        """Strided box ``pid_m``'s ``(p, row, column)`` in the ``[P, BOX_R, BOX_WO]`` positions of
        :class:`StridedRows` (``P = P2 * P1``): boxes column-major fastest, then down the rows, then ``p``
        (programs running together read neighbouring columns of the same rows)."""
        col_boxes = gl.cdiv(BOX_WO, BOX_W)
        row_boxes = gl.cdiv(BOX_R, BOX_H)
        row = ((pid_m // col_boxes) % row_boxes) * BOX_H
        return pid_m // (col_boxes * row_boxes), row, (pid_m % col_boxes) * BOX_W

    @gluon.jit
    def _load_step(a_desc, b_desc, a_ring, b_ring, ready, step, pid, programs, k_steps, n_tiles, BOX_P1, BOX_R,
                   BOX_WO, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   STAGES: gl.constexpr, GRAD: gl.constexpr, BOX_W: gl.constexpr):  # fmt: skip
        """Issue the TMA loads of this program's ``step``-th (tile, K step) pair into its ring stage: the
        tile's ``[BLOCK_M, BLOCK_K]`` rows of the A matrix at the step's channels (a row tile's, or a strided
        box's ``[1, 1, BLOCK_M / BOX_W, BOX_W, BLOCK_K]``) and the weight's block of them, ``[BLOCK_N,
        BLOCK_K]`` (the forward's) or ``[BLOCK_K, BLOCK_N]`` (``GRAD``)."""
        tile = pid + (step // k_steps) * programs
        c0 = (step % k_steps) * BLOCK_K
        stage = step % STAGES
        mbarrier.expect(ready.index(stage), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        if BOX_W == 0:
            _tma_load(a_desc, [(tile // n_tiles) * BLOCK_M, c0], ready.index(stage), a_ring.index(stage))
        else:
            p, r0, w0 = _box_origin(tile // n_tiles, BOX_R, BOX_WO, BLOCK_M // BOX_W, BOX_W)
            _tma_load(a_desc, [p // BOX_P1, p % BOX_P1, r0, w0, c0], ready.index(stage), a_ring.index(stage))
        if GRAD:
            _tma_load(b_desc, [c0, (tile % n_tiles) * BLOCK_N], ready.index(stage), b_ring.index(stage))
        else:
            _tma_load(b_desc, [(tile % n_tiles) * BLOCK_N, c0], ready.index(stage), b_ring.index(stage))

    @gluon.jit
    def _x_prev_tile(xp_ptr, pid_m, tile, n_tiles, M, N_CH, SAMPLE_ROWS, BIG: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, layout: gl.constexpr):  # fmt: skip
        """The input gradient's ``[BLOCK_M, BLOCK_N]`` tile of x_prev (``xp_ptr``: its dense ``[M, N_CH]``
        rows) under output tile ``tile`` (M tile ``pid_m``, a row tile), in ``layout``; 0 past ``M`` and
        ``N_CH``."""
        rows, rows_ok, _ = _tile_rows(pid_m, M, SAMPLE_ROWS, 0, 0, BLOCK_M, 0, layout)
        cols = (tile % n_tiles) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        return _x_prev_rows(xp_ptr, rows, rows_ok, cols, N_CH, BIG)

    @gluon.jit
    def _x_prev_rows(xp_ptr, rows, rows_ok, cols, N_CH, BIG: gl.constexpr):
        """x_prev's elements ``(rows, cols)`` of its dense ``[rows, N_CH]`` matrix; 0 where a row is not
        ``rows_ok`` or a column is past ``N_CH``."""
        if BIG:
            rows = rows.to(gl.int64)
        return gl.load(xp_ptr + rows[:, None] * N_CH + cols[None, :], mask=rows_ok[:, None] & (cols < N_CH)[None, :],
                       other=0.0)  # fmt: skip

    @gluon.jit
    def _window_corners(m, OUT_D, OUT_H, OUT_W, IN_D, IN_H, IN_W, SD: gl.constexpr, SH: gl.constexpr,
                        SW: gl.constexpr):  # fmt: skip
        """A strided input gradient's input positions under output rows ``m`` (row-major ``(n, od, oh,
        ow)`` of the ``OUT_D x OUT_H x OUT_W`` output): ``(row, d, h, w)`` of ``(s * od, ...)``, the corner of
        each row's window, its row row-major in the ``IN_D x IN_H x IN_W`` input (:func:`_window_row`
        offsets it)."""
        ow = m % OUT_W
        t = m // OUT_W
        oh = t % OUT_H
        t = t // OUT_H
        od = t % OUT_D
        d = od * SD
        h = oh * SH
        w = ow * SW
        return ((t // OUT_D * IN_D + d) * IN_H + h) * IN_W + w, d, h, w

    @gluon.jit
    def _zero_windows(out_ptr, xp_ptr, mean_ptr, rstd_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, pid_m, tile,
                      n_tiles, M, N_CH, SAMPLE_ROWS, OUT_D, OUT_H, OUT_W, IN_D, IN_H, IN_W, PROLOGUE: gl.constexpr,
                      G_NORM: gl.constexpr, NORM_AFFINE: gl.constexpr, ACT_IN: gl.constexpr, READS_X: gl.constexpr,
                      STATS: gl.constexpr, BIG: gl.constexpr, SD: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):  # fmt: skip
        """A strided input gradient's zeros: for M tile ``pid_m``'s rows (row tiles of grad_y) and tile
        ``tile``'s channels, the input positions at every window offset but the corner (:func:`_window_row`),
        which no output reads: 0, through the input gradient's store where it reads x_prev there (``READS_X``,
        :func:`zeros_read_x`: 0 * act'(z) is eager's, NaN where act'(z) is) and then ``(Σ grad_z, Σ grad_z ·
        x̂)`` over them (``STATS``; ``[BLOCK_N]`` each, 0 without), else stored as they are.  A few rows at a time in
        ``layout`` (16 bytes per thread and row), so that it holds few registers beside the tile's result:
        in the store's layout the 4-warp 128 x 128 tile spilled (``python tools/compile_check.py conv_tma
        --cases resnet_1x1_s2-bf16,resnet_1x1_s2-bf16-hooked``)."""
        ROWS: gl.constexpr = layout.threads_per_warp[0] * layout.warps_per_cta[0]
        cols: gl.constexpr = gl.SliceLayout(0, layout)
        c = (tile % n_tiles) * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols)
        c_ok = c < N_CH
        zsum = gl.zeros([BLOCK_N], gl.float32, cols)
        zsq = gl.zeros([BLOCK_N], gl.float32, cols)
        if STATS:
            mean = gl.load(mean_ptr + c, mask=c_ok, other=0.0)
            rstd = gl.load(rstd_ptr + c, mask=c_ok, other=0.0)
        zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, layout)
        for r0 in range(0, BLOCK_M, ROWS):
            m = pid_m * BLOCK_M + r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
            m_ok = m < M
            n = gl.minimum(m, M - 1) // SAMPLE_ROWS
            corner, d0, h0, w0 = _window_corners(m, OUT_D, OUT_H, OUT_W, IN_D, IN_H, IN_W, SD, SH, SW)
            for f in gl.static_range(1, SD * SH * SW):
                rows, ok = _window_row(corner, d0, h0, w0, m_ok, IN_D, IN_H, IN_W, f, SH, SW)
                if READS_X:
                    x = _x_prev_rows(xp_ptr, rows, ok, c, N_CH, BIG)
                    y = store_grad_tile(zeros, x, rows, ok, n, c, c_ok, 0, out_ptr, out_ptr, mean_ptr, rstd_ptr,
                                        p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, N_CH, 0, PROLOGUE, G_NORM,
                                        NORM_AFFINE, ACT_IN, False, BIG)  # fmt: skip
                    if STATS:
                        gz = gl.where(ok[:, None], y.to(gl.float32), 0.0)
                        zsum += gl.sum(gz, axis=0)
                        zsq += gl.sum(gz * ((x.to(gl.float32) - mean[None, :]) * rstd[None, :]), axis=0)
                else:
                    if BIG:
                        rows = rows.to(gl.int64)
                    gl.store(out_ptr + rows[:, None] * N_CH + c[None, :], zeros.to(out_ptr.dtype.element_ty),
                             mask=ok[:, None] & c_ok[None, :])  # fmt: skip
        return zsum, zsq

    @gluon.jit
    def _window_row(corner, d, h, w, m_ok, IN_D, IN_H, IN_W, F: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr):
        """The input rows at window offset ``F`` (row-major over the ``SD x SH x SW`` window) from
        :func:`_window_corners`' corners, and which of them lie in the input."""
        FD: gl.constexpr = F // (SH * SW)
        FH: gl.constexpr = (F // SW) % SH
        FW: gl.constexpr = F % SW
        ok = m_ok & (d + FD < IN_D) & (h + FH < IN_H) & (w + FW < IN_W)
        return corner + (FD * IN_H + FH) * IN_W + FW, ok

    @gluon.jit
    def _row_sums(v, ROWS_PT: gl.constexpr, sums3: gl.constexpr):
        """``v`` ``[BLOCK_M, BLOCK_N]`` in the store's layout summed over each thread's own rows: ``[BLOCK_M //
        ROWS_PT, BLOCK_N]``, no exchange between threads (the program's sums, reduced across threads once
        at its end)."""
        BLOCK_M: gl.constexpr = v.shape[0]
        BLOCK_N: gl.constexpr = v.shape[1]
        return gl.sum(gl.convert_layout(gl.reshape(v, [BLOCK_M // ROWS_PT, ROWS_PT, BLOCK_N]), sums3), axis=1)

    @gluon.jit
    def tma_fprop_kernel(
        a_desc, b_desc, scale_ptr, bias_ptr, res_ptr, out_ptr, conv_ptr, part_ptr, q_ptr, p0_ptr, p1_ptr, p2_ptr,
        p3_ptr, slope_in, slope_out, xp_ptr, mean_ptr, rstd_ptr, M, K_CH, N_CH, M_TILES, SAMPLE_ROWS, BOX_P1, BOX_R,
        BOX_WO, OUT_D, OUT_H, OUT_W, IN_D, IN_H, IN_W, PROLOGUE: gl.constexpr, G_NORM: gl.constexpr,
        NORM_AFFINE: gl.constexpr, ACT_IN: gl.constexpr,
        SAVE_CONV: gl.constexpr, HAS_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, CHAIN: gl.constexpr,
        ACT_OUT: gl.constexpr, RESIDUAL: gl.constexpr, STATS: gl.constexpr, BIG: gl.constexpr,
        PROGRAM_STATS: gl.constexpr, GRAD: gl.constexpr, EVEN_K: gl.constexpr, ROUND_FIRST: gl.constexpr,
        EARLY_X: gl.constexpr, BOX_W: gl.constexpr, SD: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr,
        ZEROS_READ_X: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """The ``[BLOCK_M, BLOCK_N]`` tiles ``pid, pid + programs, ...`` of ``out[M, N_CH] = A[M, K_CH] @
        B[K_CH, N_CH]`` (module docstring), tile ``t`` being M tile ``t // N_TILES`` and N tile ``t %
        N_TILES`` (programs running together share their A rows in L2).  One walk over the program's
        (tile, K step) pairs keeps ``STAGES - 1`` loads in flight across tiles: the next tile's first boxes
        arrive during this tile's store.  A K step: ``BLOCK_K`` channels.

        The forward (``GRAD`` False): ``K_CH = C_in``, ``N_CH = C_out``.
        a_desc  TMA descriptor of x: as the row-major ``[M, C_in]`` matrix of its channels-last rows, box
                ``[BLOCK_M, BLOCK_K]`` (``BOX_W`` 0, stride 1); or (strided boxes, ``BOX_W`` their width) as
                :class:`StridedRows`' ``[P2, P1, BOX_R, BOX_WO, C_in]`` view of its rows at the stride
                (``BOX_P1`` = P1), box ``[1, 1, BLOCK_M // BOX_W, BOX_W, BLOCK_K]``.
        b_desc  TMA descriptor of the 1x1 weight as the row-major ``[C_out, C_in]`` matrix, box
                ``[BLOCK_N, BLOCK_K]`` (read transposed by ``wgmma``).
        The other pointers and the hooks' constexprs are :func:`fprop.conv_fprop_kernel`'s (the
        store's are :func:`epilogue.store_tile`'s); ``xp_ptr``, ``mean_ptr``, ``rstd_ptr`` unused.

        The input gradient (``GRAD``; the same GEMM with the conv's channels exchanged: ``K_CH = C_out``,
        ``N_CH = C_in``): ``a_desc`` grad_y's ``[M, C_out]`` rows, ``b_desc`` the weight's ``[C_out, C_in]``
        matrix with box ``[BLOCK_K, BLOCK_N]`` (read as it lies), no prologue on A; the store is
        ``grad_epilogue.store_grad_tile``'s, its x_prev tile (``xp_ptr``, the ``[M, C_in]`` rows, dense)
        read before the wait of the tile's one K step or after its K loop (``EARLY_X``); ``PROLOGUE`` ..
        ``ACT_IN`` the forward's hooks that it recomputes (``ACT_IN`` 0: none), ``p0..p3`` their vectors,
        ``slope_in`` act_in's slope; ``STATS`` (with
        ``PROGRAM_STATS``): the BatchNorm-backward sums per program (``mean_ptr``, ``rstd_ptr``: fp32
        ``(C_in,)``), one row of ``(2, programs / N_TILES, C_in)`` in ``part_ptr``: Σ grad_z and Σ grad_z · x̂
        over the program's rows (``stats.reduce_grad_partials``).  The forward's other pointers unused.

        A strided input gradient (``GRAD``, stride ``(SD, SH, SW)`` past 1; the forward's is 1): the GEMM's
        rows are grad_y's (the output's ``OUT_D x OUT_H x OUT_W`` positions); a row's result lands on its
        window's corner (:func:`_window_corners`, in the ``IN_D x IN_H x IN_W`` input), and the window's
        other ``SD * SH * SW - 1`` positions, which no output reads, on 0 in a pass after the loop
        (:func:`_zero_windows`; ``ZEROS_READ_X``, :func:`zeros_read_x`: through act' and into the sums):
        together every input position once.  The sizes are 0 where unused.
        ``SAMPLE_ROWS``: positions per sample (the rows' samples, which a per-sample prologue reads).
        ``M_TILES``: row tiles, or strided boxes (``P2 * P1 * cdiv(BOX_R, BLOCK_M // BOX_W) * cdiv(BOX_WO,
        BOX_W)``).
        ``EVEN_K``: ``BLOCK_K`` divides ``K_CH``.  ``ROUND_FIRST`` (:func:`round_first`): the store does no
        fp32 arithmetic before its one rounding, so the accumulator is rounded before its exchange into the
        store's layout (16-bit values in the exchange's shared memory, :func:`exchange_bytes`).  ``EARLY_X``
        (:func:`early_x_read`: the GEMM has one K step): the input gradient reads its x_prev tile before the
        step's wait, not after the K loop."""
        # warps stacked along M (16 rows each per wgmma), the rest side by side along N
        WARPS_M: gl.constexpr = min(num_warps, BLOCK_M // 16)
        WARPS_N: gl.constexpr = num_warps // WARPS_M
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, BLOCK_N // WARPS_N, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        # The store's layout: a warp's lanes side by side along the channels (a row of the tile per
        # store instruction, contiguous), each thread down BLOCK_M / num_warps rows of its columns, so
        # that the statistics' sums over the rows run in registers and then across warps alone (in the
        # accumulator's layout each sum also crossed 8 lanes by shuffles).
        LANES_N: gl.constexpr = min(32, BLOCK_N)
        VEC: gl.constexpr = BLOCK_N // LANES_N
        ROWS_PT: gl.constexpr = max(1, BLOCK_M // (num_warps * (32 // LANES_N)))
        out_layout: gl.constexpr = gl.BlockedLayout([ROWS_PT, VEC], [32 // LANES_N, LANES_N], [num_warps, 1], [1, 0])
        HOOKED: gl.constexpr = (PROLOGUE != 0 or ACT_IN != 0) and not GRAD
        # the input gradient's store reads x_prev (act' recomputed, or x̂ for the sums)
        READS_X: gl.constexpr = GRAD and (ACT_IN != 0 or STATS)
        # PROGRAM_STATS: every tile of a program holds the same N tile (the grid is a multiple of N_TILES);
        # each thread sums its rows' deviations from the program's shift (its first tile's mean) and their
        # squares over all its tiles in registers, and the program reduces them across threads once, at
        # its end: its partials are one row of (3, programs / N_TILES, C_OUT), the shift, the sum and the
        # sum of squares, which the reduction turns into squared deviations from the mean in float64
        # (``stats.PartialsReduction``'s ``raw_squares``, with each program's count).  The input gradient
        # sums Σ grad_z and Σ grad_z · x̂ in the same two registers (x̂'s mean is known: no shift).
        TPW_M: gl.constexpr = 32 // LANES_N
        GROUPS: gl.constexpr = BLOCK_M // ROWS_PT
        sums3: gl.constexpr = gl.BlockedLayout([1, ROWS_PT, VEC], [TPW_M, 1, LANES_N], [num_warps, 1, 1], [2, 1, 0])
        sums_layout: gl.constexpr = gl.SliceLayout(1, sums3)
        cols_layout: gl.constexpr = gl.SliceLayout(0, out_layout)

        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        n_tiles = gl.cdiv(N_CH, BLOCK_N)
        k_steps = gl.cdiv(K_CH, BLOCK_K)
        steps = gl.cdiv(M_TILES * n_tiles - pid, programs) * k_steps

        if BOX_W == 0:
            a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        else:  # a strided box lands as [1, 1, rows, columns, channels]: the same bytes as [BLOCK_M, BLOCK_K]
            a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 1, 1, BLOCK_M // BOX_W, BOX_W, BLOCK_K],
                                               a_desc.layout)  # fmt: skip
        if GRAD:
            b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
        else:
            b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(STAGES - 1):
            if i < steps:
                _load_step(a_desc, b_desc, a_ring, b_ring, ready, i, pid, programs, k_steps, n_tiles, BOX_P1, BOX_R,
                           BOX_WO, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GRAD, BOX_W)  # fmt: skip

        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        stat_shift = gl.zeros([BLOCK_N], gl.float32, cols_layout)
        dev_sum = gl.zeros([GROUPS, BLOCK_N], gl.float32, sums_layout)
        dev_sq = gl.zeros([GROUPS, BLOCK_N], gl.float32, sums_layout)
        # a strided input gradient's rows, one per thread; its zeros' layout (``_zero_windows``): 16 bytes per
        # thread and row
        one_row: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        ZERO_LANES: gl.constexpr = min(32, max(1, BLOCK_N // 8))
        zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // ZERO_LANES, ZERO_LANES], [num_warps, 1], [1, 0])
        if GRAD and STATS:  # a program's tiles share their channels (PROGRAM_STATS): x̂'s vectors once
            c_prog = (pid % n_tiles) * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
            mean = gl.load(mean_ptr + c_prog, mask=c_prog < N_CH, other=0.0)
            rstd = gl.load(rstd_ptr + c_prog, mask=c_prog < N_CH, other=0.0)
        for step in range(steps):
            ki = step % k_steps
            tile = pid + (step // k_steps) * programs
            pid_m = tile // n_tiles
            s = step % STAGES
            if GRAD:
                b = b_ring.index(s)
            else:
                b = b_ring.index(s).permute((1, 0))
            if BOX_W == 0:
                a_tile = a_ring.index(s)
            else:
                a_tile = a_ring.index(s).reshape([BLOCK_M, BLOCK_K])
            if READS_X and EARLY_X:  # one K step per tile: issued before its wait, its latency under the step's
                x_early = _x_prev_tile(xp_ptr, pid_m, tile, n_tiles, M, N_CH, SAMPLE_ROWS, BIG, BLOCK_M, BLOCK_N,
                                       out_layout)  # fmt: skip
            if HOOKED:
                # the vectors' loads go out before the wait, their latency under the box's
                c0 = ki * BLOCK_K
                scale, shift = _channel_vectors(c0, p0_ptr, p1_ptr, K_CH, a_layout, PROLOGUE, EVEN_K, BLOCK_K)
                n_a = _tile_rows(pid_m, M, SAMPLE_ROWS, BOX_R, BOX_WO, BLOCK_M, BOX_W, a_layout)[2]
                mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                a = _a_operand(a_tile, scale, shift, c0, n_a, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, K_CH,
                               a_layout, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN, EVEN_K)  # fmt: skip
                acc = warpgroup_mma(a, b, acc, use_acc=ki > 0, is_async=True)
            else:
                mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                acc = warpgroup_mma(a_tile, b, acc, use_acc=ki > 0, is_async=True)
            # one group in flight: the previous step's MMA has finished, its stage takes the step
            # STAGES - 1 ahead (every warp read that stage's A before its MMA was issued)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            _thread_barrier()
            if step + STAGES - 1 < steps:
                _load_step(a_desc, b_desc, a_ring, b_ring, ready, step + STAGES - 1, pid, programs, k_steps, n_tiles,
                           BOX_P1, BOX_R, BOX_WO, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GRAD, BOX_W)  # fmt: skip
            if ki == k_steps - 1:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                if ROUND_FIRST:  # the stored values are the rounded accumulator: half the exchange's bytes
                    out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), out_layout)
                else:
                    out = gl.convert_layout(acc, out_layout)
                m, m_ok, n = _tile_rows(pid_m, M, SAMPLE_ROWS, BOX_R, BOX_WO, BLOCK_M, BOX_W, out_layout)
                c = (tile % n_tiles) * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
                x_saved = 0.0  # the tile of x_prev, where the store reads one
                if READS_X and SD * SH * SW == 1:
                    if EARLY_X:
                        x_saved = x_early
                    else:
                        x_saved = _x_prev_tile(xp_ptr, pid_m, tile, n_tiles, M, N_CH, SAMPLE_ROWS, BIG, BLOCK_M,
                                               BLOCK_N, out_layout)  # fmt: skip
                if GRAD:
                    rows_x = m  # the input's rows: the output's at stride 1
                    if SD * SH * SW > 1:  # at their windows' corners (the windows' zeros after the loop); the
                        # index arithmetic one row per thread, then spread to the store's rows (in the store's
                        # layout, a row vector per thread and step, the plain 4-warp 128 x 128 tile spilled)
                        m_one = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=one_row)
                        rows_x = gl.convert_layout(
                            _window_corners(m_one, OUT_D, OUT_H, OUT_W, IN_D, IN_H, IN_W, SD, SH, SW)[0],
                            gl.SliceLayout(1, out_layout))
                        if READS_X:
                            x_saved = _x_prev_rows(xp_ptr, rows_x, m_ok, c, N_CH, BIG)
                    y = store_grad_tile(out, x_saved, rows_x, m_ok, n, c, c < N_CH, pid_m, out_ptr, part_ptr, mean_ptr,
                                        rstd_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, N_CH, M_TILES, PROLOGUE,
                                        G_NORM, NORM_AFFINE, ACT_IN, False, BIG)  # fmt: skip
                    if STATS:
                        gz = gl.where(m_ok[:, None], y.to(gl.float32), 0.0)  # channels past N_CH: rstd 0
                        xhat = (x_saved.to(gl.float32) - mean[None, :]) * rstd[None, :]
                        dev_sum += _row_sums(gz, ROWS_PT, sums3)
                        dev_sq += _row_sums(gz * xhat, ROWS_PT, sums3)
                else:
                    y = store_tile(out, m, m_ok, c, c < N_CH, pid_m, out_ptr, conv_ptr, scale_ptr, bias_ptr, res_ptr,
                                   part_ptr, q_ptr, slope_out, N_CH, M_TILES, SAVE_CONV, HAS_SCALE, HAS_BIAS, CHAIN,
                                   ACT_OUT, RESIDUAL, STATS and not PROGRAM_STATS, BIG)  # fmt: skip
                    if PROGRAM_STATS:
                        ok = m_ok[:, None]
                        if step < k_steps:  # the program's first tile: its mean is the program's shift
                            first = gl.sum(gl.where(ok, y.to(gl.float32), 0.0), axis=0)
                            stat_shift = gl.convert_layout(first / gl.sum(m_ok.to(gl.float32), axis=0),
                                                           cols_layout)  # fmt: skip
                        e = gl.where(ok, y.to(gl.float32) - stat_shift[None, :], 0.0)
                        dev_sum += _row_sums(e, ROWS_PT, sums3)  # a thread's own rows: no exchange between threads
                        dev_sq += _row_sums(e * e, ROWS_PT, sums3)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
        if GRAD and SD * SH * SW > 1:
            # NOTE: a strided input gradient's zeros, once the loop's accumulator and ring have let their
            # registers go; each program its own tiles, in their order.  Inside the loop, under the next
            # tile's loads, the hooked tiles spilled 108 bytes (``python tools/compile_check.py conv_tma
            # --cases resnet_1x1_s2-bf16-hooked``) and plain ones ran 1-2% faster (H200, bf16, ResNet-50's
            # 256 -> 512 1x1 at stride 2: 0.0499 against 0.0509 ms; ``python tools/bench_conv.py
            # demos/realnets/resnet50.py --passes dgrad --filter '*k1x1 s2*'``, both kernels in one run)
            for tile in range(pid, M_TILES * n_tiles, programs):
                zs, zq = _zero_windows(out_ptr, xp_ptr, mean_ptr, rstd_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in,
                                       tile // n_tiles, tile, n_tiles, M, N_CH, SAMPLE_ROWS, OUT_D, OUT_H, OUT_W, IN_D,
                                       IN_H, IN_W, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN, ZEROS_READ_X,
                                       STATS and ZEROS_READ_X, BIG, SD, SH, SW, BLOCK_M, BLOCK_N, zero_layout)  # fmt: skip
                if STATS and ZEROS_READ_X:  # into the first of the program's row sums (a fixed place: the same bits run to run)
                    first = (gl.arange(0, GROUPS, layout=gl.SliceLayout(1, sums_layout)) == 0)[:, None]
                    dev_sum += gl.where(first, gl.convert_layout(zs, gl.SliceLayout(0, sums_layout))[None, :], 0.0)
                    dev_sq += gl.where(first, gl.convert_layout(zq, gl.SliceLayout(0, sums_layout))[None, :], 0.0)
        if PROGRAM_STATS:
            lanes = programs // n_tiles
            lane = pid // n_tiles
            c = (pid % n_tiles) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, sums_layout))
            c_ok = c < N_CH
            if GRAD:  # (Σ grad_z, Σ grad_z · x̂): ``stats.reduce_grad_partials``
                gl.store(part_ptr + lane * N_CH + c, gl.sum(dev_sum, axis=0), mask=c_ok)
                gl.store(part_ptr + (lanes + lane) * N_CH + c, gl.sum(dev_sq, axis=0), mask=c_ok)
            else:  # (shift, sum of the deviations from it, sum of their squares): ``raw_squares``
                gl.store(part_ptr + lane * N_CH + c, gl.convert_layout(stat_shift, gl.SliceLayout(0, sums_layout)),
                         mask=c_ok)
                gl.store(part_ptr + (lanes + lane) * N_CH + c, gl.sum(dev_sum, axis=0), mask=c_ok)
                gl.store(part_ptr + (2 * lanes + lane) * N_CH + c, gl.sum(dev_sq, axis=0), mask=c_ok)


def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _one_by_one_gemm(a: torch.Tensor, weight: torch.Tensor, padding: Sequence[int], groups: int) -> bool:
    """What both passes ask: a 1x1 conv with no padding and one group, its GEMM operand ``a`` (x or
    grad_y) and weight of one 16-bit dtype, on sm_90 with Gluon."""
    return (GLUON and not INTERPRETER and _is_sm90(a.device) and a.dtype in _DTYPES and weight.dtype == a.dtype
            and groups == 1 and all(p == 0 for p in padding) and math.prod(weight.shape[2:]) == 1)  # fmt: skip


def supports(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
             groups: int, stats_groups: int) -> bool:  # fmt: skip
    """Whether a forward call can run here: a 1x1 conv with no padding and one group (any stride: strided
    boxes past 1), fp16 or bf16 on sm_90, ``C_in`` a multiple of 8, and not GroupNorm's per-sample
    statistics (``stats_groups`` 0: the tiles cross samples).  Any layout qualifies: an ``x`` or weight
    that is not the dense, 16-byte aligned tensor the boxes read is copied to one first (:func:`_dense`),
    which the timed tile choice weighs."""
    return (_one_by_one_gemm(x, weight, padding, groups) and x.shape[1] % CHANNEL_ALIGN == 0
            and stats_groups == 0)  # fmt: skip


def supports_grad(grad_y: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
                  groups: int) -> bool:  # fmt: skip
    """Whether an input gradient can run here (``GRAD``): the forward's GEMM with the channels exchanged,
    so a 1x1 conv with no padding and one group (any stride: the results land at the stride, the other
    input positions on 0), fp16 or bf16 on sm_90, ``C_out`` and ``C_in`` multiples of 8 (grad_y's rows and
    the weight's are the boxes' 16-byte strides).  Any layout, as :func:`supports`."""
    return (_one_by_one_gemm(grad_y, weight, padding, groups) and weight.shape[0] % CHANNEL_ALIGN == 0
            and weight.shape[1] % CHANNEL_ALIGN == 0)  # fmt: skip


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` dense (row-major in its dim order) and 16-byte aligned, as TMA reads it: itself where it
    is, else a copy."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _shared_layout(block: list[int], dtype: torch.dtype) -> Any:
    """The swizzled shared-memory layout of a ``block`` box of ``dtype`` (TMA's and wgmma's)."""
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def round_first(grad: bool, act: int, store_arithmetic: bool = False) -> bool:
    """Whether the kernel's store rounds the accumulator before exchanging it into the store's layout
    (``ROUND_FIRST``): where it does no fp32 arithmetic before its one rounding.  The forward: no
    ``store_arithmetic`` (a saved raw conv, a scale, bias, chain, output activation or residual; the
    statistics are of the rounded values); the input gradient: no act' (``act``, the forward's input
    activation, 0)."""
    return act == 0 if grad else not store_arithmetic


def exchange_bytes(rounded: bool) -> int:
    """Bytes per element of the store's layout exchange: 16-bit values where the store rounds first
    (:func:`round_first`), else fp32."""
    return 2 if rounded else 4


# NOTE: the input gradient's x_prev tile is read at the tile's first K step where the GEMM has one K step,
# else after the K loop.  H200, bf16, ResNet-50 at batch 64, hooked 1x1 input gradients (relu' and the
# sums), kernel us early / late / copied into shared memory by cp.async, one run: K of 64 channels 64 ->
# 64 26.4 / 34.2 / 31.2 and 256 -> 64 80.4 / 96.9 / 94.8; K of 256 or more 64 -> 256 50.2 / 53.3 / 46.8,
# 512 -> 256 70.1 / 65.1 / 64.6, 1024 -> 256 41.5 / 39.5 / 39.0, 2048 -> 512 30.5 / 28.4 / 31.1
# (``python tools/bench_conv.py demos/realnets/resnet50.py --passes dgrad --profile``, each variant of the
# kernel in turn).  With one step the early read hides under that step's load; with several, the tile's
# registers held through the loop cost more than they hide.  The early tile is the step's own value, not
# one carried through the loop: carried, the hooked 8-warp 128 x 128 tile spilled 68 bytes under Triton
# 3.9 (``python tools/compile_check.py conv_tma --cases resnet_1x1-bf16-hooked``).
def early_x_read(k_channels: int, block_k: int) -> bool:
    """Whether the input gradient reads its x_prev tile at the tile's first K step (``EARLY_X``): where
    the GEMM over ``k_channels`` takes one K step of ``block_k`` (NOTE above)."""
    return k_channels <= block_k


#: Input activations whose derivative times a zero gradient is 0 at every input (torch's backward formulas
#: are selections: ``where(z <= 0, 0, g)``, ``where(z > 0, g, g * slope)``), NaN and inf included.
_ZERO_PRESERVING = (0, OP_CODES["relu"], OP_CODES["leaky_relu"])


def zeros_read_x(act: int) -> bool:
    """Whether a strided input gradient's zeros (the positions no output reads, ``_zero_windows``) go
    through act' and the BatchNorm-backward sums, reading x_prev there: where the forward's input
    activation ``act`` is not zero-preserving (:data:`_ZERO_PRESERVING`: GELU and SiLU, whose derivative
    at an infinite input is NaN, and 0 * NaN is eager's NaN).  Elsewhere their gradient is 0 whatever
    x_prev holds, and their share of the sums ``(Σ grad_z, Σ grad_z · x̂)`` is 0 too, exactly so where the
    statistics are x_prev's own (a non-finite x_prev makes its mean non-finite, and then every position's
    x̂, the output's included): the zeros are stored as they are, and x_prev read at the outputs' rows
    alone (a quarter of it at stride 2)."""
    return act not in _ZERO_PRESERVING


def ring_stages(tile: Any, k_channels: int, store_bytes: int = 2) -> int:
    """The ring's stages: the tile's (chosen for a store that rounds first, ``tiles.tma_tiles``), no more
    than the K steps over ``k_channels``, and where the store's exchange takes ``store_bytes`` per element
    (:func:`exchange_bytes`) no more than keep the programs per SM the tile's stages keep and fit the SM's
    shared memory; but 2 (the ring refills the stage whose MMA the wait before it retired)."""
    fit = tma_stages(tile, tile.num_stages, store_bytes, programs=tma_programs_per_sm(tile, tile.num_stages))
    return max(2, min(tile.num_stages, -(-k_channels // tile.block_k), fit))


def grid_programs(tile: Any, k_channels: int, n_channels: int, m_tiles: int, device: torch.device,
                  program_stats: bool, store_bytes: int = 2) -> int:  # fmt: skip
    """The persistent grid of a GEMM over ``k_channels`` into ``n_channels``: as many programs as fit the
    device's SMs at once (by shared memory, the store's exchange of ``store_bytes`` per element included,
    and registers), at most one per tile; with ``program_stats`` (each program sums the statistics of its
    tiles, which then must share one N tile) a multiple of the N tiles, ``lanes`` of them each."""
    n_tiles = -(-n_channels // tile.block_n)
    stages = ring_stages(tile, k_channels, store_bytes)
    capacity = tma_programs_per_sm(tile, stages, store_bytes) * multiprocessors(device)
    if program_stats:
        return max(1, min(m_tiles, capacity // n_tiles)) * n_tiles
    return min(m_tiles * n_tiles, capacity)


def lane_rows(tile_rows: Sequence[int], lanes: int) -> list[int]:
    """The output positions each of ``lanes`` programs' statistics cover, program lane ``j`` taking M
    tiles ``j, j + lanes, ...`` of ``tile_rows`` positions each."""
    return [sum(tile_rows[j::lanes]) for j in range(lanes)]


@dataclass(frozen=True)
class StridedRows:
    """A strided 1x1 forward's A operand (module docstring, *strided boxes*): x's channels-last rows at
    the stride as the 5-d view ``[P2, P1, R, W_out, C_in]`` (:meth:`view`), and the boxes of ``box_h x
    box_w`` output positions that tile each ``R x W_out`` plane, ``box_h * box_w = block_m`` (powers of
    two), the pair whose boxes cover the fewest positions past the plane (:meth:`of`).  ``(P2, P1, R)``
    are the output's ``(N, D_out, H_out)`` merged from the inside wherever a dim's stride at the stride
    is the next one's extent, so that boxes run on across samples and planes where x's memory allows (a
    2-d conv whose height is the stride times the output's: one dim of ``N * H_out`` rows); ``strides``
    are their element strides in x's dense channels-last memory."""

    dims: tuple[int, int, int]
    strides: tuple[int, int, int]
    out_w: int
    w_stride: int
    box_h: int
    box_w: int

    @classmethod
    def of(cls, n: int, c_in: int, size: Sequence[int], out_size: Sequence[int], stride: Sequence[int],
           block_m: int) -> StridedRows:  # fmt: skip
        """The view of an ``(N, C_in, D, H, W)`` channels-last dense input (sizes lifted to 3 spatial
        dims) read at ``stride`` into ``out_size``, for tiles of ``block_m`` rows."""
        d, h, w = size
        merged = [[out_size[1], stride[1] * w * c_in]]  # (extent, stride), innermost first: H_out's
        for extent, step in ((out_size[0], stride[0] * h * w * c_in), (n, d * h * w * c_in)):
            inner_extent, inner_step = merged[-1]
            if extent == 1:
                continue
            if inner_extent == 1:
                merged[-1] = [extent, step]
            elif step == inner_extent * inner_step:
                merged[-1] = [extent * inner_extent, inner_step]
            else:
                merged.append([extent, step])
        while len(merged) < 3:  # a dim of extent 1 strides over the one inside it (TMA: 16-byte strides)
            merged.append([1, merged[-1][0] * merged[-1][1]])
        (r, sr), (p1, s1), (p2, s2) = merged
        out_w = out_size[2]
        widths = [1 << i for i in range(block_m.bit_length()) if (1 << i) <= block_m]
        # the fewest positions covered (the MMA's work), then the widest box
        box_w = min(widths, key=lambda bw: (-(-r * bw // block_m) * block_m // bw * -(-out_w // bw) * bw, -bw))
        return cls((p2, p1, r), (s2, s1, sr), out_w, stride[2] * c_in, block_m // box_w, box_w)

    def view(self, x_rows: torch.Tensor) -> torch.Tensor:
        """The ``[P2, P1, R, W_out, C_in]`` view of ``x_rows`` (x's dense channels-last memory, any shape)
        the descriptor spans."""
        c_in = x_rows.shape[-1]
        return x_rows.as_strided((*self.dims, self.out_w, c_in), (*self.strides, self.w_stride, 1))

    @property
    def m_tiles(self) -> int:
        """Boxes in all: ``P2 * P1`` times the boxes of one ``R x W_out`` plane."""
        return self.dims[0] * self.dims[1] * -(-self.dims[2] // self.box_h) * -(-self.out_w // self.box_w)

    def tile_rows(self) -> list[int]:
        """Each box's real output positions, in the kernel's box order (``_box_origin``: columns fastest,
        then rows, then the planes): fewer in the boxes past the plane's last row or column."""
        r, w = self.dims[2], self.out_w
        plane = [min(self.box_h, r - r0) * min(self.box_w, w - w0) for r0 in range(0, r, self.box_h)
                 for w0 in range(0, w, self.box_w)]  # fmt: skip
        return plane * (self.dims[0] * self.dims[1])


class _Base:
    """What a tensor descriptor reads of its tensor (the data pointer, the dtype), without holding the
    tensor: the descriptors a launch keeps (:class:`TmaLaunch`) must not keep activations alive."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, t: torch.Tensor) -> None:
        self._ptr, self.dtype = t.data_ptr(), t.dtype

    def data_ptr(self) -> int:
        return self._ptr


#: Descriptors a :class:`TmaLaunch` keeps per operand (by data pointer) before it starts over.
_KEPT_DESCRIPTORS = 16


class TmaLaunch:
    """The launch of :func:`tma_fprop_kernel` for one plan: a forward (``fprop._Plan`` with a ``tma``
    tile) that :func:`supports` accepted, called as the gather kernel's launch is: ``(x, weight, scale,
    bias, res, out, conv, part, q, p0, p1, p2, p3, slope_in, slope_out)``, ``weight`` the 1x1 weight in
    any layout; or, with ``grad``, an input gradient (``dgrad._DgradPlan``) that :func:`supports_grad`
    accepted, called by :meth:`input_grad`.

    ``geo``: the plan's ``_Geometry`` (the forward's; the input gradient's GEMM exchanges its channels);
    ``strided``: a strided forward's :class:`StridedRows` (None: row tiles); ``m_tiles``: row tiles of
    ``block_m`` rows or strided boxes; ``programs``: the persistent grid (:func:`grid_programs`,
    which the plan's reduction reads too); ``constexprs``: the hooks' (``PROLOGUE`` .. ``BIG`` of the
    gather kernel's); ``program_stats``: the sums per program, not per tile (:func:`lane_rows`);
    ``rounded``: the store rounds first (:func:`round_first`).

    The tensor descriptors are kept per operand by data pointer (the plan fixes every shape and stride
    they hold): a call on memory seen before builds none.  NOTE: building and validating the two per
    call was a third of the launch's host time (H200, ResNet-50's 64 -> 256 1x1 at 56 x 56, batch 64:
    0.051 against the gather kernel's 0.030 ms per plan call; the operand matrices
    6.5 us, two ``TensorDescriptor`` 4.6 us; a scratch timing of the plan's calls)."""

    def __init__(self, tile: Any, geo: Any, m_tiles: int, programs: int, constexprs: dict[str, Any],
                 program_stats: bool, dtype: torch.dtype, rounded: bool, grad: bool = False,
                 strided: StridedRows | None = None) -> None:  # fmt: skip
        self.tile, self.geo = tile, geo
        k_channels, n_channels = (geo.c_out, geo.c_in) if grad else (geo.c_in, geo.c_out)
        stages = ring_stages(tile, k_channels, exchange_bytes(rounded))
        #: an input gradient's stride (its results land at the stride, the other positions on 0)
        grad_stride = tuple(geo.stride) if grad else (1, 1, 1)
        strided_grad = grad_stride != (1, 1, 1)
        constexprs = dict(constexprs, EVEN_K=k_channels % tile.block_k == 0, ROUND_FIRST=rounded,
                          EARLY_X=grad and not strided_grad and early_x_read(k_channels, tile.block_k),
                          SD=grad_stride[0], SH=grad_stride[1], SW=grad_stride[2],
                          ZEROS_READ_X=strided_grad and zeros_read_x(constexprs["ACT_IN"]), BLOCK_M=tile.block_m,
                          BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, STAGES=stages, PROGRAM_STATS=program_stats,
                          GRAD=grad, BOX_W=strided.box_w if strided else 0, num_warps=tile.num_warps)  # fmt: skip
        boxes = (strided.dims[1], strided.dims[2], strided.out_w) if strided else (0, 0, 0)
        sizes = (*geo.out_size, *geo.size) if strided_grad else (0,) * 6
        fixed = (geo.m, k_channels, n_channels, m_tiles, math.prod(geo.out_size), *boxes, *sizes)
        self.launch = FastLaunch(tma_fprop_kernel, (programs,), constexprs, fixed=fixed)
        if strided:
            self.a_block = [1, 1, strided.box_h, strided.box_w, tile.block_k]
            self.a_matrix = strided_input(strided)
        else:
            self.a_block = [tile.block_m, tile.block_k]
            self.a_matrix = input_rows
        self.b_block = [tile.block_k, tile.block_n] if grad else [tile.block_n, tile.block_k]
        self.a_layout, self.b_layout = _shared_layout(self.a_block, dtype), _shared_layout(self.b_block, dtype)
        self._a_kept: dict[int, Any] = {}
        self._b_kept: dict[int, Any] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, *pointers: Any) -> None:
        """The forward: the gather kernel's arguments (class docstring)."""
        out = pointers[3]
        self._launch(x, weight, *pointers, out, out, out)  # the input gradient's three pointers unused

    def input_grad(self, grad_y: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, part: torch.Tensor | None,
                   prologue_vectors: Sequence[torch.Tensor], x_prev: torch.Tensor | None,
                   mean: torch.Tensor | None, rstd: torch.Tensor | None, slope: float) -> None:  # fmt: skip
        """The input gradient into ``out`` (channels-last dense, the forward input's shape): ``part`` the
        sums' ``(2, lanes, C_in)`` partials (None: no sums), ``prologue_vectors`` ``hooks.prologue_tensors``'
        four (any tensor where unused), ``x_prev`` the forward's input before its prologue (any layout: its
        rows copied dense where they are not), ``mean`` / ``rstd`` the sums' fp32 vectors, ``slope``
        act_in's."""
        rows = out if x_prev is None else input_rows(x_prev)
        unused = out
        self._launch(grad_y, weight, unused, unused, unused, out, unused, unused if part is None else part, unused,
                     *prologue_vectors, slope, 0.0, rows, unused if mean is None else mean,
                     unused if rstd is None else rstd)  # fmt: skip

    def _launch(self, a: torch.Tensor, weight: torch.Tensor, *pointers: Any) -> None:
        a_desc, a_copy = kept_descriptor(self._a_kept, a, self.a_matrix, self.a_block, self.a_layout)
        b_desc, b_copy = kept_descriptor(self._b_kept, weight, weight_matrix, self.b_block, self.b_layout)
        self.launch(a_desc, b_desc, *pointers)
        del a_copy, b_copy  # the copies the descriptors point at lived until the launch was queued


def kept_descriptor(kept: dict[int, Any], t: torch.Tensor, matrix: Any, block: list[int],
                    layout: Any) -> tuple[Any, torch.Tensor | None]:  # fmt: skip
    """``(descriptor, copy)``: the TMA descriptor of ``matrix(t)`` (the operand as the kernel's
    descriptor spans it, shape and strides) with box ``block`` in ``layout``, and the copy of ``t`` it
    points at (None where ``matrix(t)`` is a view of ``t``).  A view's descriptor is kept in ``kept`` by
    ``t``'s data pointer: a launch plan fixes the view's shape and strides, so the pointer is all that
    differs between calls (:class:`TmaLaunch`'s NOTE: building them was a third of a launch's host time)."""
    ptr = t.data_ptr()
    desc = kept.get(ptr)
    if desc is not None:
        return desc, None
    m = matrix(t)
    desc = TensorDescriptor(_Base(m), list(m.shape), list(m.stride()), block, layout)
    if m.data_ptr() != ptr:
        return desc, m
    if len(kept) >= _KEPT_DESCRIPTORS:
        kept.clear()
    kept[ptr] = desc
    return desc, None


def input_rows(x: torch.Tensor) -> torch.Tensor:
    """The ``[M, C]`` matrix of x's channels-last rows (x any ``(N, C, *spatial)`` tensor: an input, an
    output gradient) that its descriptor spans; dense and 16-byte aligned (a copy where ``x`` is not)."""
    return _dense(x.movedim(1, -1)).view(-1, x.shape[1])


def strided_input(strided: StridedRows) -> Any:
    """The function from x to the view of its rows at the stride that a strided forward's descriptor
    spans (:meth:`StridedRows.view` of x's dense, 16-byte aligned channels-last memory: a copy where x
    is not that)."""
    return lambda x: strided.view(_dense(x.movedim(1, -1)))


def weight_matrix(weight: torch.Tensor) -> torch.Tensor:
    """The ``[C_out, C_in]`` matrix of a 1x1 weight (any layout) that its descriptor spans; dense and
    16-byte aligned (a copy where the weight is not)."""
    return _dense(weight.reshape(weight.shape[0], weight.shape[1]))
