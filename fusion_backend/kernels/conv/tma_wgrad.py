"""The conv family's weight gradient on sm_90 written in Gluon (the *TMA weight gradient*): the same
result, partial layout and split sum as :func:`wgrad.conv_wgrad_kernel`, with both operands loaded as
TMA boxes of the planes and ``wgmma``'s operands in the layouts the data arrives in.  A
:class:`tiles.TileConfig` with ``tma`` and a box (``box_w``) selects it for a weight gradient.

The GEMM, per tap: ``grad_w[co, ci, tap] = sum_m a_tap[m, ci] * dy[m, co]`` over the output positions
``m``, ``a_tap`` the forward's input after its prologue, shifted by the tap.  Here it is computed
transposed, ``grad_w^T[ci, co] = a_tap^T @ dy``:

* an M step is one box of ``BOX_H x BOX_W`` output positions of one plane (``(n, od)``); its ``dy``
  operand is that box of ``grad_y`` (``[positions, BLOCK_N]``, channels contiguous: the MN-major B
  operand ``wgmma`` takes for 16-bit types), and tap ``(kd, kh, kw)``'s ``a`` operand the box of ``x``
  at the same positions shifted by the tap (TMA reads the padding as zeros);
* ``wgmma``'s M is ``BLOCK_K`` input channels (64 per warpgroup), its N ``BLOCK_N`` output channels,
  its K the box's positions.  Without a prologue ``a^T`` is read from shared memory as it landed (an
  MN-major A operand); with one (or where boxes hang over the output plane's edge) each thread loads
  its part of ``a^T`` into ``wgmma``'s register layout, applies the prologue there (fp32, one rounding to
  the compute dtype: the forward's A bit for bit) and zeroes the positions that are padding or past the
  plane (the prologue of a zero is not zero; an infinite input times a zero gradient is NaN);
* a box over the output plane's edge computes positions that are not outputs: their ``dy`` reads zeros
  (past ``grad_y``'s extent), and a tap reading left or up reads real inputs there, which eager never
  pairs with a gradient (an infinite one would make the sum NaN).  Where only the first kernel row
  (column) reads so, its taps load through a descriptor of ``x`` whose H (W) extent ends where the
  last output's tap does (:func:`overhang_clips`): TMA reads zeros past it, and ``a^T`` comes from
  shared memory as on a plane the boxes tile; elsewhere the register path masks those positions;
* the rank-5 box ``[1, 1, BOX_H, BOX_W, C]`` lands in shared memory row after row of ``C`` channels,
  swizzled by address as a rank-2 ``[BOX_H * BOX_W, C]`` tile of the same rows is: the kernel reads it
  as that tile (``_as_rows``).

The prologue's vectors depend on the sample alone (a channel affine: on nothing), and a box holds
one sample: a group affine or a gate is a per-channel scale and shift for the whole box.

The GEMM's K axis, the gather kernel's tap-major order, is walked in K steps of ``(tap, BLOCK_K input
channels)``.  A program owns ``TileConfig.taps_per_program`` consecutive K steps (``SLOTS``: one
accumulator each, reading each ``dy`` box once for all of them) and one ``BLOCK_N`` output-channel
block, over one split's run of boxes; the grid is ``(K-step groups x output blocks, splits)``, the
first dim fastest so that the programs of a split, which read the same boxes, run together.  The boxes
arrive through a ring of ``STAGES`` stages (the ``dy`` box and the K steps' ``x`` boxes of one M step
per stage, one mbarrier each).  With ``a^T`` from shared memory a step's ``wgmma`` groups stay in
flight while the next step's issue, and the previous step's stage is refilled once they retire; with
register operands each step's retire before the next step loads (NOTE at ``_retire``).  Each program writes its fp32 partials to its split's slot of the
``(splits, 1, COUT_PAD, K_ROW)`` buffer (tap-major rows, every element once, padding included) and
:func:`wgrad.sum_splits_kernel` sums the slots in a fixed order (with one split each program writes the
gradient itself, ``DIRECT``): bitwise reproducible run to run for one plan, as the gather kernel.

Contract (:func:`supports`): fp16 or bf16 on sm_90, one group, more than one input channel, stride 1
(any kernel size, padding and dilation), ``x`` and ``grad_y`` whose channel counts are multiples of 8
(TMA strides of 16 bytes), in any layout (read as dense, 16-byte aligned channels-last copies where
they are not: :func:`dense_channels_last`).  No bias gradient: the plan sums it apart (``wgrad``, NOTE
at ``_WgradPlan.run``).  Gluon has no interpreter: on CPU this
kernel is compiled (``tools/compile_check.py conv_tma_wgrad``), never run; on the GPU, what it measured
and where the timed choice offers it: ``tiles.tma_wgrad_tiles``' NOTE.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ..host import INTERPRETER, cdiv, lift3
from ..launch import FastLaunch
from .hooks import PROLOGUE_GROUP_AFFINE, PROLOGUE_SAMPLE_CHANNEL_SCALE
from .prologue import activation
from .split_sum import weight_grad_offsets
from .tiles import TileConfig
from .tma_fprop import _DTYPES, CHANNEL_ALIGN, GLUON, _dense, _is_sm90, _shared_layout, kept_descriptor

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .tma_fprop import _thread_barrier, _tma_load

    #: Triton 3.9 names a shared-memory view's reinterpretation ``reinterpret``; 3.6 ``_reinterpret``
    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def _as_rows(box, BLOCK_M: gl.constexpr, C: gl.constexpr):
        """A ``[1, 1, BOX_H, BOX_W, C]`` box in shared memory as the ``[BLOCK_M, C]`` tile of its rows
        (module docstring: the swizzle is by address, rows of ``C`` channels either way)."""
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, C], box.dtype)
        if _PUBLIC_REINTERPRET:
            rows = box.reinterpret(box.dtype, [BLOCK_M, C], layout)
        else:
            rows = box._reinterpret(box.dtype, [BLOCK_M, C], layout)
        return rows

    @gluon.jit
    def _box_vectors(n, ci, ci_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN, PROLOGUE: gl.constexpr,
                     G_NORM: gl.constexpr, NORM_AFFINE: gl.constexpr, BLOCK_K: gl.constexpr,
                     layout: gl.constexpr):  # fmt: skip
        """The prologue of sample ``n`` on channels ``ci`` as ``(scale, shift, weight, bias)`` vectors
        (``prologue.normalise``'s formulas, with one sample per box); 0 past ``C_IN`` (``ci_ok``)."""
        one = gl.full([BLOCK_K], 1.0, gl.float32, layout)
        zero = gl.zeros([BLOCK_K], gl.float32, layout)
        if PROLOGUE == 1:  # channel affine
            return (gl.load(p0_ptr + ci, mask=ci_ok, other=0.0), gl.load(p1_ptr + ci, mask=ci_ok, other=0.0),
                    one, zero)  # fmt: skip
        elif PROLOGUE == 2:  # group affine: (N, G) statistics, then the (C,) affine
            ng = n * G_NORM + ci // (C_IN // G_NORM)
            scale = gl.load(p0_ptr + ng, mask=ci_ok, other=0.0)
            shift = gl.load(p1_ptr + ng, mask=ci_ok, other=0.0)
            if NORM_AFFINE:
                return (scale, shift, gl.load(p2_ptr + ci, mask=ci_ok, other=0.0),
                        gl.load(p3_ptr + ci, mask=ci_ok, other=0.0))  # fmt: skip
            return scale, shift, one, zero
        elif PROLOGUE == 3:  # gate: (N, C)
            return gl.load(p0_ptr + n * C_IN + ci, mask=ci_ok, other=0.0), zero, one, zero
        return one, zero, one, zero

    @gluon.jit
    def _a_registers(x_box, scale, shift, weight, bias, ok, slope_in, a_layout: gl.constexpr,
                     PROLOGUE: gl.constexpr, NORM_AFFINE: gl.constexpr, ACT_IN: gl.constexpr,
                     MASKED: gl.constexpr):  # fmt: skip
        """``a^T`` ``[BLOCK_K, BLOCK_M]`` of one tap in ``wgmma``'s register layout: the ``x`` box's rows
        read transposed, the prologue in fp32 (the forward's order: ``x * scale + shift``, then the group
        affine's ``* weight + bias``, then ``act_in``), rounded once, the positions not ``ok`` zeroed."""
        a = x_box.permute((1, 0)).load(a_layout)
        v = a.to(gl.float32)
        if PROLOGUE == 3:
            v = v * scale[:, None]
        elif PROLOGUE != 0:
            v = v * scale[:, None] + shift[:, None]
            if PROLOGUE == 2 and NORM_AFFINE:
                v = v * weight[:, None] + bias[:, None]
        v = activation(v, ACT_IN, slope_in)
        if MASKED:
            v = gl.where(ok[None, :], v, 0.0)
        return v.to(a.dtype)

    @gluon.jit
    def _positions_ok(od, oh0, ow0, kd, kh, kw, D, H, W, OH, OW, PD: gl.constexpr, PH: gl.constexpr,
                      PW: gl.constexpr, DD: gl.constexpr, DH: gl.constexpr, DW: gl.constexpr, BOX_W: gl.constexpr,
                      BLOCK_M: gl.constexpr, layout: gl.constexpr):  # fmt: skip
        """Which of a box's ``BLOCK_M`` positions (row-major ``BOX_H x BOX_W`` from ``(oh0, ow0)`` of
        output plane ``od``) are output positions whose tap ``(kd, kh, kw)`` reads inside the input."""
        i = gl.arange(0, BLOCK_M, layout=layout)
        oh = oh0 + i // BOX_W
        ow = ow0 + i % BOX_W
        ih = oh + kh * DH - PH
        iw = ow + kw * DW - PW
        idd = od + kd * DD - PD
        return ((oh < OH) & (ow < OW) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                & (idd >= 0) & (idd < D))  # fmt: skip

    @gluon.jit
    def _slot(k, CI_BLOCKS, KH: gl.constexpr, KW: gl.constexpr, BLOCK_K: gl.constexpr):
        """K step ``k`` (tap-major over ``(tap, channel block)``) -> ``(kd, kh, kw, ci0)``."""
        tap = k // CI_BLOCKS
        return tap // (KH * KW), (tap // KW) % KH, tap % KW, (k % CI_BLOCKS) * BLOCK_K

    @gluon.jit
    def _load_step(x_desc, x_desc_h, x_desc_w, x_desc_hw, dy_desc, x_ring, dy_ring, ready, step, first_box, k0, co0,
                   CI_BLOCKS, OD, OH_TILES, OW_TILES, KH: gl.constexpr, KW: gl.constexpr, PD: gl.constexpr,
                   PH: gl.constexpr, PW: gl.constexpr, DD: gl.constexpr, DH: gl.constexpr, DW: gl.constexpr,
                   CLIP_H: gl.constexpr, CLIP_W: gl.constexpr, BOX_H: gl.constexpr, BOX_W: gl.constexpr,
                   BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """Issue the TMA loads of the program's ``step``-th box into its ring stage: the ``dy`` box and
        the ``x`` box of each of the program's K steps (its tap's shift, its channel block; the first
        tap row's or column's through its clipped descriptor, :func:`_x_box_load`)."""
        n, od, oh0, ow0 = _box_origin(first_box + step, OD, OH_TILES, OW_TILES, BOX_H, BOX_W)
        stage = step % STAGES
        mbarrier.expect(ready.index(stage), dy_desc.block_type.nbytes + SLOTS * x_desc.block_type.nbytes)
        _tma_load(dy_desc, [n, od, oh0, ow0, co0], ready.index(stage), dy_ring.index(stage))
        for j in gl.static_range(SLOTS):
            kd, kh, kw, ci0 = _slot(k0 + j, CI_BLOCKS, KH, KW, BLOCK_K)
            _x_box_load(x_desc, x_desc_h, x_desc_w, x_desc_hw, n, od + kd * DD - PD, oh0 + kh * DH - PH,
                        ow0 + kw * DW - PW, ci0, kh == 0, kw == 0, ready.index(stage),
                        x_ring.index(stage * SLOTS + j), CLIP_H, CLIP_W)  # fmt: skip

    @gluon.jit
    def _x_box_load(x_desc, x_desc_h, x_desc_w, x_desc_hw, n, d, h, w, c, first_row, first_col, bar, dst,
                    CLIP_H: gl.constexpr, CLIP_W: gl.constexpr):  # fmt: skip
        """The ``x`` box at ``(n, d, h, w, c)`` into ``dst``: a tap of the first kernel row (``first_row``)
        through the descriptor whose H extent is clipped where ``CLIP_H``, of the first column through the
        W-clipped one where ``CLIP_W``, both through ``x_desc_hw`` (:func:`overhang_clips`)."""
        if CLIP_H and CLIP_W:
            if first_row & first_col:
                _tma_load(x_desc_hw, [n, d, h, w, c], bar, dst)
            elif first_row:
                _tma_load(x_desc_h, [n, d, h, w, c], bar, dst)
            elif first_col:
                _tma_load(x_desc_w, [n, d, h, w, c], bar, dst)
            else:
                _tma_load(x_desc, [n, d, h, w, c], bar, dst)
        elif CLIP_H:
            if first_row:
                _tma_load(x_desc_h, [n, d, h, w, c], bar, dst)
            else:
                _tma_load(x_desc, [n, d, h, w, c], bar, dst)
        elif CLIP_W:
            if first_col:
                _tma_load(x_desc_w, [n, d, h, w, c], bar, dst)
            else:
                _tma_load(x_desc, [n, d, h, w, c], bar, dst)
        else:
            _tma_load(x_desc, [n, d, h, w, c], bar, dst)

    @gluon.jit
    def _box_origin(b, OD, OH_TILES, OW_TILES, BOX_H: gl.constexpr, BOX_W: gl.constexpr):
        """Box ``b`` of the walk over the output planes (``tw`` fastest, then ``th``, the depth, the
        sample): ``(n, od, oh0, ow0)``."""
        tw = b % OW_TILES
        rest = b // OW_TILES
        th = rest % OH_TILES
        rest = rest // OH_TILES
        return rest // OD, rest % OD, th * BOX_H, tw * BOX_W

    @gluon.jit
    def _slot_mma(x_ring, dy_tile, acc, ring_slot, k, n, od, oh0, ow0, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in,
                  C_IN, CI_BLOCKS, D, H, W, OH, OW, KH: gl.constexpr, KW: gl.constexpr, PD: gl.constexpr,
                  PH: gl.constexpr, PW: gl.constexpr, DD: gl.constexpr, DH: gl.constexpr, DW: gl.constexpr,
                  a_layout: gl.constexpr, PROLOGUE: gl.constexpr, G_NORM: gl.constexpr,
                  NORM_AFFINE: gl.constexpr, ACT_IN: gl.constexpr, REGISTER_A: gl.constexpr,
                  MASKED: gl.constexpr, BOX_W: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_K: gl.constexpr):  # fmt: skip
        """Issue K step ``k``'s ``wgmma`` of this box (async), its ``x`` box in ring slot ``ring_slot``:
        ``acc += a^T @ dy``; returns ``(acc, a)``, ``a`` the operand (in registers: to keep alive until
        the MMA retires)."""
        x_tile = _as_rows(x_ring.index(ring_slot), BLOCK_M, BLOCK_K)
        if REGISTER_A:
            kd, kh, kw, ci0 = _slot(k, CI_BLOCKS, KH, KW, BLOCK_K)
            ci = ci0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, a_layout))
            scale, shift, weight, bias = _box_vectors(n, ci, ci < C_IN, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN,
                                                      PROLOGUE, G_NORM, NORM_AFFINE, BLOCK_K,
                                                      gl.SliceLayout(1, a_layout))  # fmt: skip
            ok = _positions_ok(od, oh0, ow0, kd, kh, kw, D, H, W, OH, OW, PD, PH, PW, DD, DH, DW, BOX_W, BLOCK_M,
                               gl.SliceLayout(0, a_layout))  # fmt: skip
            a = _a_registers(x_tile, scale, shift, weight, bias, ok, slope_in, a_layout, PROLOGUE, NORM_AFFINE,
                             ACT_IN, MASKED)  # fmt: skip
        else:
            a = x_tile.permute((1, 0))
        return warpgroup_mma(a, dy_tile, acc, is_async=True), a

    @gluon.jit
    def _retire(acc0, acc1, acc2, a0, a1, a2, SLOTS: gl.constexpr, REGISTER_A: gl.constexpr,
                OUTSTANDING: gl.constexpr):  # fmt: skip
        """Wait until at most ``OUTSTANDING`` ``wgmma`` groups are in flight; ``a0..a2``: the register
        operands of the groups that retire (kept alive until then; unused without ``REGISTER_A``).

        NOTE: register operands in flight across steps make ptxas serialise every ``wgmma`` ("C7515:
        wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator
        registers"), whether the previous step's operands are kept alive as loop-carried copies or not
        at all; retiring each step's MMAs before the next step's loads compiles without it (sm_90a,
        Triton 3.6: ``python tools/compile_check.py conv_tma_wgrad --cases resnet_3x3-bf16-hooked``, then
        ``ptxas -arch=sm_90a -v`` on the kernel's PTX in Triton's cache).  On the H200 the two timed
        alike (ResNet-50's 3x3 of 64 channels at 56 x 56 with the prologue: 0.166 ms retiring each step,
        0.157 with the copies; ``docs/perf/RESULTS.md``), so the register path retires each step."""
        if REGISTER_A:
            if SLOTS == 1:
                acc0, a0 = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc0, a0))
            elif SLOTS == 2:
                acc0, acc1, a0, a1 = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc0, acc1, a0, a1))
            else:
                acc0, acc1, acc2, a0, a1, a2 = warpgroup_mma_wait(num_outstanding=OUTSTANDING,
                                                                  deps=(acc0, acc1, acc2, a0, a1, a2))  # fmt: skip
        else:
            if SLOTS == 1:
                acc0 = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc0,))
            elif SLOTS == 2:
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc0, acc1))
            else:
                acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc0, acc1, acc2))
        return acc0, acc1, acc2

    @gluon.jit
    def tma_wgrad_kernel(
        x_desc, x_desc_h, x_desc_w, x_desc_hw, dy_desc, part_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, out_ptr,
        slope_in,
        C_IN, C_OUT, D, H, W, OD, OH, OW, OH_TILES, OW_TILES, BOXES, BOXES_PER_SPLIT, CI_BLOCKS, CO_BLOCKS,
        w_so, w_si, w_sd, w_sh, w_sw,
        K_ROW: gl.constexpr, COUT_PAD: gl.constexpr, CIN_PAD: gl.constexpr,
        KH: gl.constexpr, KW: gl.constexpr,
        PD: gl.constexpr, PH: gl.constexpr, PW: gl.constexpr,
        DD: gl.constexpr, DH: gl.constexpr, DW: gl.constexpr,
        PROLOGUE: gl.constexpr, G_NORM: gl.constexpr, NORM_AFFINE: gl.constexpr, ACT_IN: gl.constexpr,
        REGISTER_A: gl.constexpr, MASKED: gl.constexpr, CLIP_H: gl.constexpr, CLIP_W: gl.constexpr,
        BIG: gl.constexpr, SLOTS: gl.constexpr, BOX_H: gl.constexpr, BOX_W: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """Program ``(K-step group, output block)`` x split (module docstring): its ``SLOTS`` partial
        tiles ``[BLOCK_K, BLOCK_N]`` (transposed) over the split's boxes, K steps ``k0 .. k0 + SLOTS - 1``
        of the tap-major ``(tap, channel block)`` axis.

        x_desc    TMA descriptor of the forward's input before its prologue as ``(N, D, H, W, C_IN)``,
                  box ``[1, 1, BOX_H, BOX_W, BLOCK_K]``, zero padding.
        x_desc_h, x_desc_w, x_desc_hw
                  the same with the H extent, the W extent, both clipped: the first kernel row's taps
                  read through them where ``CLIP_H``, the first column's where ``CLIP_W``
                  (:func:`overhang_clips`; ``x_desc`` itself where unused).
        dy_desc   TMA descriptor of grad_y as ``(N, OD, OH, OW, C_OUT)``, box ``[1, 1, BOX_H, BOX_W,
                  BLOCK_N]``.
        part_ptr  fp32 ``(splits, 1, COUT_PAD, K_ROW)``, ``K_ROW = taps * CI_BLOCKS * BLOCK_K``: element
                  ``(s, 0, co, k * BLOCK_K + ci)`` for K step ``k``; every element written once.
        p0..p3    the prologue's vectors (``hooks.prologue_tensors``).
        out_ptr, ``w_s*``, ``DIRECT``: one split, each program rounds its accumulators into the gradient
                  itself (element ``(co, ci, kd, kh, kw)`` at ``co * w_so + ci * w_si + kd * w_sd + kh *
                  w_sh + kw * w_sw``; ``CIN_PAD`` input channels per tap in K), as
                  ``wgrad.conv_wgrad_kernel``'s; ``part_ptr`` unused.
        Runtime: ``BOXES`` boxes in all (``OH_TILES x OW_TILES`` per plane, ``OD`` planes per sample),
        ``BOXES_PER_SPLIT`` per split; ``CI_BLOCKS``, ``CO_BLOCKS``: channel blocks of ``x`` and ``dy``.
        ``REGISTER_A``: ``a^T`` through registers (a prologue, or ``MASKED``: positions to zero, where
        boxes hang over the plane without clipped descriptors to read zeros there, or the prologue meets
        padding)."""
        BLOCK_M: gl.constexpr = BOX_H * BOX_W
        WARPS_M: gl.constexpr = min(num_warps, BLOCK_K // 16)
        WARPS_N: gl.constexpr = num_warps // WARPS_M
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, BLOCK_N // WARPS_N, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

        pid = gl.program_id(0)
        split = gl.program_id(1)
        co0 = (pid % CO_BLOCKS) * BLOCK_N
        k0 = (pid // CO_BLOCKS) * SLOTS
        first_box = split * BOXES_PER_SPLIT
        steps = gl.minimum(BOXES - first_box, BOXES_PER_SPLIT)

        x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES * SLOTS, 1, 1, BOX_H, BOX_W, BLOCK_K], x_desc.layout)
        dy_ring = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, 1, 1, BOX_H, BOX_W, BLOCK_N], dy_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(STAGES):
            if i < steps:
                _load_step(x_desc, x_desc_h, x_desc_w, x_desc_hw, dy_desc, x_ring, dy_ring, ready, i, first_box, k0,
                           co0, CI_BLOCKS, OD, OH_TILES, OW_TILES, KH, KW, PD, PH, PW, DD, DH, DW, CLIP_H, CLIP_W,
                           BOX_H, BOX_W, BLOCK_K, SLOTS, STAGES)  # fmt: skip

        acc0 = gl.zeros((BLOCK_K, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        acc1 = gl.zeros((BLOCK_K, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        acc2 = gl.zeros((BLOCK_K, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for step in range(steps):
            s = step % STAGES
            n, od, oh0, ow0 = _box_origin(first_box + step, OD, OH_TILES, OW_TILES, BOX_H, BOX_W)
            mbarrier.wait(ready.index(s), (step // STAGES) & 1)
            dy_tile = _as_rows(dy_ring.index(s), BLOCK_M, BLOCK_N)
            acc0, a0 = _slot_mma(x_ring, dy_tile, acc0, s * SLOTS, k0, n, od, oh0, ow0, p0_ptr, p1_ptr, p2_ptr,
                                 p3_ptr, slope_in, C_IN, CI_BLOCKS, D, H, W, OH, OW, KH, KW, PD, PH, PW, DD, DH, DW,
                                 a_layout, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN, REGISTER_A, MASKED, BOX_W,
                                 BLOCK_M, BLOCK_K)  # fmt: skip
            a1 = a0  # (placeholders where the program has fewer K steps)
            a2 = a0
            if SLOTS > 1:
                acc1, a1 = _slot_mma(x_ring, dy_tile, acc1, s * SLOTS + 1, k0 + 1, n, od, oh0, ow0, p0_ptr, p1_ptr,
                                     p2_ptr, p3_ptr, slope_in, C_IN, CI_BLOCKS, D, H, W, OH, OW, KH, KW, PD, PH, PW,
                                     DD, DH, DW, a_layout, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN, REGISTER_A, MASKED,
                                     BOX_W, BLOCK_M, BLOCK_K)  # fmt: skip
            if SLOTS > 2:
                acc2, a2 = _slot_mma(x_ring, dy_tile, acc2, s * SLOTS + 2, k0 + 2, n, od, oh0, ow0, p0_ptr, p1_ptr,
                                     p2_ptr, p3_ptr, slope_in, C_IN, CI_BLOCKS, D, H, W, OH, OW, KH, KW, PD, PH, PW,
                                     DD, DH, DW, a_layout, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN, REGISTER_A, MASKED,
                                     BOX_W, BLOCK_M, BLOCK_K)  # fmt: skip
            if REGISTER_A:
                # the step's MMAs retire, their register operands with them (NOTE above: in flight across
                # steps they serialise every wgmma), and the stage takes the box STAGES steps ahead
                acc0, acc1, acc2 = _retire(acc0, acc1, acc2, a0, a1, a2, SLOTS, True, 0)
                _thread_barrier()
                if step + STAGES < steps:
                    _load_step(x_desc, x_desc_h, x_desc_w, x_desc_hw, dy_desc, x_ring, dy_ring, ready, step + STAGES,
                               first_box, k0, co0, CI_BLOCKS, OD, OH_TILES, OW_TILES, KH, KW, PD, PH, PW, DD, DH, DW,
                               CLIP_H, CLIP_W, BOX_H, BOX_W, BLOCK_K, SLOTS, STAGES)  # fmt: skip
            else:
                # this step's MMAs stay in flight while the previous step's retire; every warp is then past
                # the previous step's stage, which takes the box STAGES steps after it
                acc0, acc1, acc2 = _retire(acc0, acc1, acc2, a0, a1, a2, SLOTS, False, SLOTS)
                _thread_barrier()
                if (step > 0) & (step - 1 + STAGES < steps):
                    _load_step(x_desc, x_desc_h, x_desc_w, x_desc_hw, dy_desc, x_ring, dy_ring, ready,
                               step - 1 + STAGES, first_box, k0, co0, CI_BLOCKS, OD, OH_TILES, OW_TILES, KH, KW, PD, PH,
                               PW, DD, DH, DW, CLIP_H, CLIP_W, BOX_H, BOX_W, BLOCK_K, SLOTS, STAGES)  # fmt: skip
        acc0, acc1, acc2 = _retire(acc0, acc1, acc2, acc0, acc1, acc2, SLOTS, False, 0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        # the partial tiles, transposed: element (ci, co) of K step k at part[split, 0, co, k * BLOCK_K + ci]
        rows = k0 * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, acc_layout))
        cols = co0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        if DIRECT:  # one split: the accumulators are the gradient
            dst, ok = weight_grad_offsets(0, cols[None, :], rows[:, None], C_OUT, w_so, w_si, w_sd, w_sh, w_sw, C_IN,
                                          CIN_PAD, 1, KH, KW, False)  # fmt: skip
            gl.store(out_ptr + dst, acc0.to(out_ptr.dtype.element_ty), mask=ok)
            if SLOTS > 1:
                dst, ok = weight_grad_offsets(0, cols[None, :], rows[:, None] + BLOCK_K, C_OUT, w_so, w_si, w_sd,
                                              w_sh, w_sw, C_IN, CIN_PAD, 1, KH, KW, False)  # fmt: skip
                gl.store(out_ptr + dst, acc1.to(out_ptr.dtype.element_ty), mask=ok)
            if SLOTS > 2:
                dst, ok = weight_grad_offsets(0, cols[None, :], rows[:, None] + 2 * BLOCK_K, C_OUT, w_so, w_si,
                                              w_sd, w_sh, w_sw, C_IN, CIN_PAD, 1, KH, KW, False)  # fmt: skip
                gl.store(out_ptr + dst, acc2.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            slot = split
            if BIG:
                slot = slot.to(gl.int64)
            base = part_ptr + (slot * COUT_PAD + cols)[None, :] * K_ROW + rows[:, None]
            gl.store(base, acc0)
            if SLOTS > 1:
                gl.store(base + BLOCK_K, acc1)
            if SLOTS > 2:
                gl.store(base + 2 * BLOCK_K, acc2)


def supports(x: torch.Tensor, grad_y: torch.Tensor, weight: torch.Tensor, stride: tuple[int, ...],
             groups: int) -> bool:  # fmt: skip
    """Whether a weight-gradient call can run here (module docstring's contract); layouts are not
    asked: the launch reads channels-last copies where the tensors are not."""
    return (GLUON and not INTERPRETER and _is_sm90(x.device) and x.dtype in _DTYPES and grad_y.dtype == x.dtype
            and weight.dtype == x.dtype and groups == 1 and all(s == 1 for s in stride) and x.shape[1] > 1
            and x.shape[1] % CHANNEL_ALIGN == 0 and grad_y.shape[1] % CHANNEL_ALIGN == 0)  # fmt: skip


def refusal(geo: Any, dtype: torch.dtype, tile: TileConfig) -> str:
    """Why ``tile`` cannot run a weight gradient of geometry ``geo`` in ``dtype`` on this kernel (""
    where it can); the tile's own limits (a warpgroup's ``wgmma``, a box) are
    ``TileConfig.check_for("wgrad")``'s, the device's and layouts' :func:`supports`'s."""
    if dtype not in _DTYPES:
        return f"the TMA weight gradient takes fp16 or bf16, got {dtype}"
    if geo.groups != 1 or any(s != 1 for s in geo.stride):
        return f"the TMA weight gradient takes one group and stride 1, got {geo.groups} and {geo.stride}"
    if geo.taps * cdiv(geo.c_in, tile.block_k) % tile.taps_per_program:
        return (f"taps_per_program={tile.taps_per_program} must divide the {geo.taps} taps x "
                f"{cdiv(geo.c_in, tile.block_k)} channel blocks of K")  # fmt: skip
    return ""


def _planes(t: torch.Tensor, rows: int, clip_h: int = 0, clip_w: int = 0) -> torch.Tensor:
    """``t`` (channels-last, dense in that order, 16-byte aligned) viewed as the ``(N, D, H, W, C)``
    tensor its TMA descriptor spans (``boxes._descriptor_dims``' sizes and strides), its H and W extents
    cut to ``clip_h`` and ``clip_w`` where they are not 0 (:func:`overhang_clips`); ``rows`` > 0: as
    ``(rows, 1, 1, M / rows, C)``, its positions ``rows`` rows."""
    from .boxes import _descriptor_dims

    if rows:
        m, c = t.numel() // t.shape[1] // rows, t.shape[1]
        sizes, strides = [rows, 1, 1, m, c], [m * c, m * c, m * c, c, 1]
    else:
        sizes, strides = _descriptor_dims(t)
        sizes[2], sizes[3] = clip_h or sizes[2], clip_w or sizes[3]
    return t.as_strided(sizes, strides)


def _first_tap_clip(out: int, size: int, kernel: int, dilation: int, padding: int) -> int | None:
    """The extent of an input dim of ``size`` that its first kernel tap reads through where boxes hang
    past the output's ``out`` positions: 0 where no tap reads real input there (each reads past the
    input's end), ``out - padding`` (where the last output's first tap reads, exclusive) where only the
    first tap does, None where a later tap does too (it would need an extent of its own)."""
    reading = [k for k in range(kernel) if out + k * dilation - padding < size]
    if not reading:
        return 0
    return out - padding if reading == [0] and out - padding >= 1 else None


def _first_tap_clips(geo: Any) -> list[int | None]:
    """:func:`_first_tap_clip` of each output dim (H, W) of a stride-1 conv of geometry ``geo``."""
    return [_first_tap_clip(o, s, k, d, p) for o, s, k, d, p in zip(
        geo.out_size[1:], geo.size[1:], geo.kernel[1:], geo.dilation[1:], geo.padding[1:], strict=True)]  # fmt: skip


def clippable_dims(geo: Any) -> tuple[bool, bool]:
    """Per output dim (H, W) of a stride-1 conv of geometry ``geo``: whether boxes hanging past its edge
    can read zeros there through a clipped descriptor (:func:`overhang_clips`)."""
    return tuple(clip is not None for clip in _first_tap_clips(geo))


def clippable_for_shapes(x_shape: Sequence[int], w_shape: Sequence[int], padding: Sequence[int],
                         dilation: Sequence[int]) -> tuple[bool, bool]:  # fmt: skip
    """:func:`clippable_dims` of a stride-1 conv of input ``x_shape`` and weight ``w_shape`` (N, C, *spatial
    and C_out, C_in, *kernel, 1 to 3 spatial dims) with ``padding`` and ``dilation`` per spatial dim."""
    from .fprop import output_size

    out = output_size(x_shape[2:], w_shape[2:], (1,) * len(padding), padding, dilation)
    return clippable_dims(SimpleNamespace(size=lift3(x_shape[2:], 1), out_size=lift3(out, 1), kernel=lift3(
        w_shape[2:], 1), dilation=lift3(dilation, 1), padding=lift3(padding, 0)))  # fmt: skip


def overhang_clips(geo: Any, box: tuple[int, int]) -> tuple[int, int] | None:
    """The H and W extents of ``x``'s descriptor for the first kernel row's and column's taps (``CLIP_H``,
    ``CLIP_W``; 0: that dim needs none) so that ``box`` (rows, columns) tiles hanging past the output plane
    read zeros there, as the gradient does (module docstring); None where a dim's overhang cannot be
    clipped so (:func:`_first_tap_clip`; the register path masks it)."""
    clips = tuple(clip if o % b else 0 for clip, o, b in zip(_first_tap_clips(geo), geo.out_size[1:], box, strict=True))
    return None if None in clips else clips


class TmaWgradLaunch:
    """The launch of :func:`tma_wgrad_kernel` for one weight-gradient plan (``wgrad._WgradPlan`` with a
    ``tma`` tile), called as ``(x, grad_y, part, p0, p1, p2, p3, grad_w, slope_in)`` with channels-last,
    16-byte aligned ``x`` and ``grad_y`` (the plan copies them where they are not).

    ``geo``: the plan's ``_Geometry``; ``k_row``, ``cout_pad``: the partial layout's;
    ``split``: the splits of the boxes; ``hook_codes``: the prologue's constexprs (``PROLOGUE``,
    ``G_NORM``, ``NORM_AFFINE``, ``ACT_IN``, ``BIG``); ``dtype``: the operands'; ``w_strides``: the
    gradient's over (output channel, input channel, kd, kh, kw).  The call takes the gradient after
    ``p3``: written by the programs themselves where ``direct`` (one split).  The
    descriptors are kept per operand by data pointer, as the TMA forward's (``tma_fprop.kept_descriptor``)."""

    def __init__(self, tile: TileConfig, geo: Any, k_row: int, cout_pad: int, split: int,
                 hook_codes: dict[str, Any], dtype: torch.dtype, w_strides: Sequence[int]) -> None:  # fmt: skip
        self.tile = tile
        #: a 1x1 conv without padding reads its positions as rows (``box_w`` must be ``block_m``): all
        #: samples' positions as one row of ``M``, or where the prologue's vectors are per sample (a box
        #: holds one sample) each sample's as a row of its own
        rows = geo.taps == 1 and not any(geo.padding)
        per_sample = hook_codes["PROLOGUE"] in (PROLOGUE_GROUP_AFFINE, PROLOGUE_SAMPLE_CHANNEL_SCALE)
        #: the descriptors' rows (``_descriptor``): 0 where they span the planes
        self.row_count = (geo.n if per_sample else 1) if rows else 0
        n, (od, oh, ow), size = geo.n, geo.out_size, geo.size
        if rows:
            n, row = self.row_count, geo.m // max(1, self.row_count)
            (od, oh, ow), size = (1, 1, row), (1, 1, row)
        self.box_tiles = (cdiv(oh, tile.box_h), cdiv(ow, tile.box_w))
        self.boxes = n * od * self.box_tiles[0] * self.box_tiles[1]
        self.boxes_per_split = cdiv(self.boxes, split)
        self.split = cdiv(self.boxes, self.boxes_per_split) if self.boxes else 1
        padded = any(p > 0 for p in geo.padding)
        hooked = hook_codes["PROLOGUE"] != 0 or hook_codes["ACT_IN"] != 0
        # positions past the output plane's edge whose taps read real input (a left-looking tap of a box
        # over the right edge); an input there may be inf, its dy is 0: read through clipped descriptors
        # where only the first tap row or column does so, else masked
        clips = (0, 0) if rows else overhang_clips(geo, (tile.box_h, tile.box_w))
        overhang = clips is None
        #: the H and W extents of the first tap row's and column's descriptors (0: ``x``'s own)
        self.clips = (0, 0) if clips is None else clips
        ci_blocks, co_blocks = cdiv(geo.c_in, tile.block_k), cdiv(geo.c_out, tile.block_n)
        constexprs = dict(
            hook_codes, K_ROW=k_row, COUT_PAD=cout_pad, KH=geo.kernel[1], KW=geo.kernel[2],
            PD=geo.padding[0], PH=geo.padding[1], PW=geo.padding[2],
            DD=geo.dilation[0], DH=geo.dilation[1], DW=geo.dilation[2],
            # positions to zero: the overhang's, and the padding the prologue would turn into act(shift)
            # (a plain box reads the padding as zeros)
            MASKED=overhang or (hooked and padded), CLIP_H=self.clips[0] > 0, CLIP_W=self.clips[1] > 0,
            SLOTS=tile.taps_per_program, BOX_H=tile.box_h, BOX_W=tile.box_w,
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, STAGES=tile.num_stages, num_warps=tile.num_warps,
        )  # fmt: skip
        constexprs["REGISTER_A"] = hooked or constexprs["MASKED"]
        self.direct = self.split == 1
        constexprs.update(CIN_PAD=ci_blocks * tile.block_k, DIRECT=self.direct)
        fixed = (geo.c_in, geo.c_out, *size, od, oh, ow, *self.box_tiles, self.boxes, self.boxes_per_split,
                 ci_blocks, co_blocks, *w_strides)  # fmt: skip
        grid = (geo.taps * ci_blocks // tile.taps_per_program * co_blocks, self.split)
        self.launch = FastLaunch(tma_wgrad_kernel, grid, constexprs, fixed=fixed)
        self.x_block = [1, 1, tile.box_h, tile.box_w, tile.block_k]
        self.dy_block = [1, 1, tile.box_h, tile.box_w, tile.block_n]
        self.x_layout, self.dy_layout = _shared_layout(self.x_block, dtype), _shared_layout(self.dy_block, dtype)
        #: the extents of the kernel's four x descriptors (none, H, W, both clipped; a dim not clipped keeps
        #: x's own, so an unused descriptor is the unclipped one), each clip's views kept per operand
        h, w = self.clips
        self._x_clips = [(0, 0), (h, 0), (0, w), (h, w)]
        self._x_planes = {c: functools.partial(_planes, rows=self.row_count, clip_h=c[0], clip_w=c[1])
                          for c in self._x_clips}  # fmt: skip
        self._x_kept: dict[tuple[int, int], dict[int, Any]] = {c: {} for c in self._x_clips}
        self._dy_planes = functools.partial(_planes, rows=self.row_count)
        self._dy_kept: dict[int, Any] = {}

    def __call__(self, x: torch.Tensor, grad_y: torch.Tensor, *pointers: Any) -> None:
        x_descs = [kept_descriptor(self._x_kept[c], x, self._x_planes[c], self.x_block, self.x_layout)[0]
                   for c in self._x_clips]  # fmt: skip
        dy_desc, _ = kept_descriptor(self._dy_kept, grad_y, self._dy_planes, self.dy_block, self.dy_layout)
        self.launch(*x_descs, dy_desc, *pointers)


def dense_channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` as TMA reads it: channels-last, dense in that order, 16-byte aligned; itself where it is."""
    return _dense(t.movedim(1, -1)).movedim(-1, 1)

