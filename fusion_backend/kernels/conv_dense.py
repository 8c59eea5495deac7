"""Triton implicit-GEMM forward of a dense stride-1 2d (or 1d) convolution with the chain fused in.

``out = chain(conv(x, w) + bias)`` (and optionally the conv output without bias, ``saved_y0``) for
the sub-case ``conv_fused`` serves slowly: not transposed, groups 1, stride 1, dilation 1, any
padding, no pool (e.g. Conv2d(64, 64, 3) over (64, 64, 256, 256), the ``conv2d_mul_leaky_gelu``
workload, where the general gather kernel is several times slower than cuDNN).  Same launch-plan
contract as ``conv_fused.forward_launch`` for that sub-case, plus ``compute_dtype`` (the operands are
rounded to it in registers, so autocast's casts of ``x`` and ``w`` cost no pass of their own).

Status: ``fusion::conv_epilogue``'s fused forward for the cases it serves (``ops.conv_epilogue.
forward.forward_kernels``; ``auto`` still measures it against the library path per shape).  Its times
against the library op and ``conv_fused`` are in ``docs/perf/RESULTS.md``, *Kernel design measurements*.

Mapping.  The spatial dims of one (sample, channel) plane are walked as ONE axis ``p = h * R + w``
(``R``: the row pitch of ``x`` in units of its W stride; ``R == W`` for NCHW and channels-last
tensors).  A virtual output ``v = oh * R + ow`` then reads tap ``(kh, kw)`` at
``p = v + (kh - PH) * R + kw - PW``: a conv over the flattened axis with a *constant* shift per tap.
Outputs with ``ow >= OW`` (the last ``R - OW`` of each virtual row) are computed and never stored.

* GEMM ``M``: ``BLOCK_M`` consecutive positions of one sample (they cross image rows freely).  ``N``:
  ``BLOCK_N`` output channels (Conv2d 64->64: all 64, so ``x`` is read once).  ``K``: input channels x
  ``KH`` tap rows, ONE flattened runtime loop that Triton software-pipelines (``num_stages``).
* The ``KW`` taps of a row are NOT separate K steps: ``KWG == KW`` (``KW <= MAX_KW_GROUP``) dots
  share one ``[BLOCK_M, BLOCK_K]`` X tile per K step, one accumulator per tap
  (``acc_s[j] = sum_{kh, ci} w[co, ci, kh, s] * x[ci, p_j(kh)]``), and the epilogue combines
  ``y[q] = sum_s acc_s[q + s]`` (``tl.gather`` along M, once per tile).  WHY: a tile shifted by
  ``kw`` elements is misaligned, so Triton loads it 4 bytes at a time with a mask per element; the
  shared tile starts 16-byte aligned (the tile origin is shifted left by ``C_SHIFT``), loads in
  16-byte vectors, and is loaded ``KW`` times less often (a 3x3 conv: 3 X tiles per output tile instead
  of 9, ~12x fewer load instructions per MMA).  A tile of ``BLOCK_M`` rows thus yields ``STEP =
  BLOCK_M - (KW - 1)`` (rounded down to the alignment) outputs; consecutive tiles overlap by the halo.
* Padding: a tap whose input row lies outside ``x`` reads positions outside ``[0, P_END)``: masked to
  0 at the load.  A tap whose input *column* lies outside ``x`` would read the neighbouring row (the
  flattening wraps): its accumulator term is dropped when the taps are combined (``tl.where``, not a
  multiply, so an inf/NaN it picked up never leaks).  Wider kernels (``KW > MAX_KW_GROUP``) take one
  tap per K step (``KWG == 1``, shifted and unaligned X tiles) with the column test in the load mask.
* ``x`` layouts: any whose (H, W) dims flatten with an integer pitch ``R >= max(W, OW)`` (NCHW,
  channels-last, slices along W...); others, and paddings wider than "same" (``OW > W``), are copied
  once per call into a buffer of pitch ``R`` (``_Launch.relayout``).
* Weights: prearranged once per call by ``_dense_weight_kernel`` into ``Wm[co, kh, kw, ci]`` (K
  contiguous, zero padded to ``COUT_PAD x CIN_PAD``, in the compute dtype, TF32-rounded when the dot
  runs in TF32): every B tile is one unmasked load, K-major in shared memory as TF32 wgmma needs it.

Numerics (as ``conv_fused``'s ``_offset_epilogue``): fp32 accumulation; the conv output and the bias
are rounded to the compute dtype, then added in fp32 before the chain; ``saved_y0`` receives the conv
output without bias.  fp32 compute
uses TF32 iff ``allow_tf32`` (operands rounded to nearest first, ``kernels.tf32``), ``ieee`` otherwise
and always under the interpreter.  inf/NaN in ``x`` reach exactly the outputs whose taps read them.  A
non-finite *weight* reaches the outputs whose taps fall on padded rows (masked loads read 0, and
0 * NaN = NaN, as in ``conv_fused``) but, with ``KWG > 1``, not those whose taps fall on padded
columns (those terms are dropped).  No atomics; results are deterministic.

Performance: ``docs/perf/RESULTS.md``, *Kernel design measurements* (``tools/bench_conv_dense.py``).
NOTE: ncu (fp32, 64x32 tile): issue slots 45 % busy with ~2 warps per scheduler, DRAM traffic at the
floor (x read once, out written once), L2 51 %: instruction- and latency-bound, not memory-bound.
~130 (fp32) / ~105 (bf16) thread instructions per output element, about half of them in the
epilogue (the tap-combining ``tl.gather`` lowers to layout conversions through shared memory plus a
shuffle and a select per element; the chain's erf ~25 per element).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from .. import environment
from ..ir.specs import ConvSpec, PoolSpec
from .chain_math import chain_forward, load_chain_operands, op_constexprs
from .conv_common import AutotunedLaunch, ForwardArgs, WeightMatrixLaunch, cached_forward_launch, run_forward
from .conv_fused import conv_output_size
from .host import INTERPRETER, best_first, cdiv, next_pow2, tile_bench
from .plan_cache import PlanCache
from .tf32 import dot_precision, round_tf32

_INT32_LIMIT = 2**31 - 1
#: Tensors with more elements than this get int64 index math (BIG); a module constant so that tests
#: can exercise that path on small tensors.
_BIG_INDEX_THRESHOLD = _INT32_LIMIT
_INTERPRET = INTERPRETER  # kernels/host.py: whether Triton's interpreter is on
#: Most taps of one kernel row that share an X tile (one accumulator each; ``KWG``).  Wider kernels
#: take one tap per K step.
MAX_KW_GROUP = 4
#: Input channels are padded to a multiple of this in the prearranged weight matrix; the tiles'
#: ``BLOCK_K`` must divide the padded count (``_prune``).
_CIN_ALIGN = 16
#: Problems below this many multiply-adds take the heuristic tile (autotuning is not worth it).
_AUTOTUNE_MIN_MACS = 2**28
#: Accumulator registers per thread the tiles may use (``BLOCK_M * BLOCK_N * KWG / threads``): 192
#: admits 128 rows x 64 channels x 3 taps on 4 warps, the fastest tile on large problems (``_TILES``).
_MAX_ACC_REGS = 192
#: Shared memory the autotuned tiles' pipeline buffers may use (Conv2d 64->64 k3, fp32: 64x32 3 stages,
#: 88 KB, two programs per multiprocessor; 128x32 8 warps 3 stages, 120 KB, one).
_MAX_STAGE_BYTES = 120 * 1024


@triton.jit
def _dense_weight_kernel(
    w_ptr, wm_ptr, C_IN, C_OUT, w_so, w_si, w_sh, w_sw,
    KH: tl.constexpr, KW: tl.constexpr, CIN_PAD: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One program per row ``co`` of the prearranged weight matrix ``Wm`` (``COUT_PAD`` rows).

    w_ptr   weight (C_OUT, C_IN, KH, KW), any float dtype and strides ``w_s*`` (1d lifted: KH 1).
    wm_ptr  ``Wm`` (COUT_PAD, KH, KW, CIN_PAD), the compute dtype, contiguous: ``w[co, ci, kh, kw]``,
            TF32-rounded with ``PRECISION == "tf32"`` (the launcher passes "tf32" only for an fp32
            ``Wm``); 0 for ``co >= C_OUT`` or ``ci >= C_IN``.
    """
    co = tl.program_id(0)
    tap = tl.arange(0, BLOCK_T)
    kh = tap // KW
    kw = tap % KW
    t_ok = tap < KH * KW
    # (a tensor, not the scalar compare: the interpreter makes ``tensor & scalar-bool`` an int32 mask)
    row_ok = (tap * 0 + co) < C_OUT
    for c0 in tl.static_range(0, CIN_PAD, BLOCK_C):
        ci = c0 + tl.arange(0, BLOCK_C)
        ok = (t_ok & row_ok)[:, None] & (ci < C_IN)[None, :]
        v = tl.load(
            w_ptr + co * w_so + ci[None, :] * w_si + (kh * w_sh + kw * w_sw)[:, None], mask=ok, other=0.0
        )
        v = round_tf32(v.to(tl.float32), PRECISION)
        tl.store(wm_ptr + co * (KH * KW * CIN_PAD) + tap[:, None] * CIN_PAD + ci[None, :],
                 v.to(wm_ptr.dtype.element_ty), mask=t_ok[:, None])  # fmt: skip


@triton.jit
def _tap_term(acc, q, ow, S: tl.constexpr, PW: tl.constexpr, W, BLOCK_M: tl.constexpr):
    """Tap ``S``'s term of the combined conv output at tile rows ``q``: ``acc[q + S]`` (rows past
    the tile read the last row; they are never stored), 0 where its input column lies outside
    ``[0, W)`` (the flattened read wrapped into a neighbouring row)."""
    col = ow + (S - PW)
    ok = ((col >= 0) & (col < W))[:, None]
    if S == 0:
        return tl.where(ok, acc, 0.0)
    idx = tl.minimum(q + S, BLOCK_M - 1)[:, None] + tl.zeros(acc.shape, tl.int32)
    return tl.where(ok, tl.gather(acc, idx, 0), 0.0)


@triton.jit
def _tile_of(tile, C_OUT, OH, R, C_SHIFT: tl.constexpr, STEP: tl.constexpr, BLOCK_N: tl.constexpr,
             BIG: tl.constexpr):  # fmt: skip
    """Tile ``tile`` -> (sample ``n``, tile ``t`` within the sample, channel block ``nb``): ``nb``
    fastest, then ``t``, so that the tiles running together share their input rows in L2."""
    n_blocks = tl.cdiv(C_OUT, BLOCK_N)
    tiles = tl.cdiv(OH * R + C_SHIFT, STEP)
    nb = tile % n_blocks
    rest = tile // n_blocks
    t = rest % tiles
    n = rest // tiles
    if BIG:
        n = n.to(tl.int64)
    return n, t, nb


@triton.jit
def _k_step(acc0, acc1, acc2, acc3, kk, x_n, wm_rows, t, j, ck, C_IN, W, R, P_END, x_sc, x_sp,
            KW: tl.constexpr, KWG: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
            C_PW: tl.constexpr, CIN_PAD: tl.constexpr, STEP: tl.constexpr, PRECISION: tl.constexpr,
            BIG: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """K step ``kk`` = (kernel row ``kh``, tap group ``g``, channel block ``cb``) of tile ``t``: one
    ``[BLOCK_M, BLOCK_K]`` X tile (``x_n``: the sample's base pointer) and ``KWG`` dots, one per tap of
    the group (``wm_rows``: ``[1, BLOCK_N]`` row pointers into ``Wm``).  Returns the accumulators."""
    NG: tl.constexpr = KW // KWG
    K_BLOCKS: tl.constexpr = CIN_PAD // BLOCK_K
    compute = wm_rows.dtype.element_ty
    cb = kk % K_BLOCKS  # constexpr divisors: no integer division per step
    t2 = kk // K_BLOCKS
    g = t2 % NG
    kh = t2 // NG
    ci = cb * BLOCK_K + ck
    p = t * STEP + (kh - PH) * R + g * KWG - C_PW + j
    ok = (p >= 0) & (p < P_END)
    if KWG == 1:  # one tap per step: its column test here (C_SHIFT == 0: the virtual output is t*STEP + j)
        col = (t * STEP + j) % R + (g - PW)
        ok = ok & (col >= 0) & (col < W)
    if BIG:
        offs = p.to(tl.int64)[:, None] * x_sp + ci.to(tl.int64)[None, :] * x_sc
    else:
        offs = p[:, None] * x_sp + ci[None, :] * x_sc
    a = tl.load(x_n + offs, mask=ok[:, None] & (ci < C_IN)[None, :], other=0.0)
    a = round_tf32(a.to(compute), PRECISION)
    k0 = (kh * KW + g * KWG) * CIN_PAD + cb * BLOCK_K
    b = tl.load(wm_rows + (k0 + ck)[:, None])
    acc0 = tl.dot(a, b, acc0, input_precision=PRECISION)
    if KWG > 1:
        b = tl.load(wm_rows + (k0 + CIN_PAD + ck)[:, None])
        acc1 = tl.dot(a, b, acc1, input_precision=PRECISION)
    if KWG > 2:
        b = tl.load(wm_rows + (k0 + 2 * CIN_PAD + ck)[:, None])
        acc2 = tl.dot(a, b, acc2, input_precision=PRECISION)
    if KWG > 3:
        b = tl.load(wm_rows + (k0 + 3 * CIN_PAD + ck)[:, None])
        acc3 = tl.dot(a, b, acc3, input_precision=PRECISION)
    return acc0, acc1, acc2, acc3


@triton.jit
def _epilogue(acc0, acc1, acc2, acc3, n, t, co, j, wm_ptr, p_ptr, b_ptr, out_ptr, y0_ptr, C_OUT, W, R, OH, OW,
              o_sn, o_sc, o_sh, o_sw, y_sn, y_sc, y_sh, y_sw,
              OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
              OP4: tl.constexpr, OP5: tl.constexpr, OP6: tl.constexpr, OP7: tl.constexpr,
              HAS_BIAS: tl.constexpr, SAVE: tl.constexpr, KWG: tl.constexpr, PW: tl.constexpr,
              C_SHIFT: tl.constexpr, STEP: tl.constexpr, BIG: tl.constexpr,
              BLOCK_M: tl.constexpr):  # fmt: skip
    """Combine the taps (``y[q] = sum_s acc_s[q + s]`` over the taps whose input column is in
    range), then as conv_fused's ``_offset_epilogue``: the conv output in the compute dtype, bias,
    chain, store ``out`` (and ``saved_y0``: the conv output without bias)."""
    v = t * STEP - C_SHIFT + j
    oh = v // R
    ow = v % R
    o_ok = (j < STEP) & (v >= 0) & (v < OH * R) & (ow < OW)
    if KWG == 1:
        y = acc0
    else:
        y = _tap_term(acc0, j, ow, 0, PW, W, BLOCK_M)
        y += _tap_term(acc1, j, ow, 1, PW, W, BLOCK_M)
        if KWG > 2:
            y += _tap_term(acc2, j, ow, 2, PW, W, BLOCK_M)
        if KWG > 3:
            y += _tap_term(acc3, j, ow, 3, PW, W, BLOCK_M)
    c = co[None, :]
    cmask = (co < C_OUT)[None, :]
    compute = wm_ptr.dtype.element_ty
    y_raw = y.to(compute).to(tl.float32)  # the conv output in its storage (compute) dtype
    val = y_raw
    if HAS_BIAS:  # the bias as the conv sees it: rounded to the compute dtype
        val = val + tl.load(b_ptr + c, mask=cmask, other=0.0).to(compute).to(tl.float32)
    operands = load_chain_operands(p_ptr, c, C_OUT, cmask, OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7)
    val = chain_forward(val, *operands, OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7)
    ok2 = o_ok[:, None] & cmask
    if BIG:
        oh = oh.to(tl.int64)
        ow = ow.to(tl.int64)
        c = c.to(tl.int64)
    tl.store(out_ptr + (n * o_sn + oh * o_sh + ow * o_sw)[:, None] + c * o_sc,
             val.to(out_ptr.dtype.element_ty), mask=ok2)  # fmt: skip
    if SAVE:
        tl.store(y0_ptr + (n * y_sn + oh * y_sh + ow * y_sw)[:, None] + c * y_sc,
                 y_raw.to(y0_ptr.dtype.element_ty), mask=ok2)  # fmt: skip


@triton.jit
def _conv_dense_fwd_kernel(
    x_ptr, wm_ptr, p_ptr, b_ptr, out_ptr, y0_ptr,
    C_IN, C_OUT, W, R, OH, OW, P_END,
    x_sn, x_sc, x_sp,
    o_sn, o_sc, o_sh, o_sw,
    y_sn, y_sc, y_sh, y_sw,
    OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
    OP4: tl.constexpr, OP5: tl.constexpr, OP6: tl.constexpr, OP7: tl.constexpr,
    HAS_BIAS: tl.constexpr, SAVE: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, KWG: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    ALIGN: tl.constexpr, C_SHIFT: tl.constexpr, CIN_PAD: tl.constexpr,
    PRECISION: tl.constexpr, BIG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out = chain(conv(x, w) + bias)`` for one tile: ``STEP`` consecutive virtual outputs x
    ``BLOCK_N`` channels.

    Pointers (element strides):
      x_ptr   input, fp32/fp16/bf16: element ``(n, ci, h, w)`` at ``n * x_sn + ci * x_sc + p * x_sp``,
              ``p = h * R + w`` (``R >= W``: the row pitch; positions with ``w >= W`` are read only by
              dropped terms).  ``P_END = (H - 1) * R + W``: positions ``>= P_END`` (and ``< 0``) read 0.
      wm_ptr  ``Wm`` of ``_dense_weight_kernel`` (COUT_PAD, KH, KW, CIN_PAD), the compute dtype
              (the dot's operand dtype: ``x`` is converted to it after the load).
      p_ptr   operand matrix P of ``epilogue.build_params``, (NUM_PARAM_ROWS, C_OUT) fp32 contiguous
              (its bias row is not read).
      b_ptr   (HAS_BIAS) the bias, C_OUT contiguous values, any float dtype.
      out_ptr result (N, C_OUT, OH, OW), any float dtype, strides ``o_s*``.
      y0_ptr  SAVE: the conv output without bias (N, C_OUT, OH, OW), any float dtype (the values are
              rounded to the compute dtype), strides ``y_s*``; else unused.
    Geometry: program ``pid`` is tile (sample ``n``, ``t``, channel block ``nb``; ``_tile_of``); it
    covers virtual outputs ``v = t * STEP - C_SHIFT + q`` (``q < STEP``); its X tiles start at position
    ``t * STEP + (kh - PH) * R - (C_SHIFT + PW)``, 16-byte aligned when ``ALIGN`` elements are (``x_sp``
    1, ``C_SHIFT + PW`` and ``R`` multiples of ``ALIGN``).
    KWG: taps per X tile (``KW`` when ``KW <= MAX_KW_GROUP``, else 1: one tap per K step, its column
    test in the load mask).  BIG: int64 offsets (some tensor spans more than 2**31 - 1 elements).
    """
    HALO: tl.constexpr = KWG - 1
    STEP: tl.constexpr = ((BLOCK_M - HALO) // ALIGN) * ALIGN
    C_PW: tl.constexpr = C_SHIFT + PW
    K_ITERS: tl.constexpr = KH * (KW // KWG) * (CIN_PAD // BLOCK_K)

    n, t, nb = _tile_of(tl.program_id(0), C_OUT, OH, R, C_SHIFT, STEP, BLOCK_N, BIG)
    j = tl.arange(0, BLOCK_M)
    ck = tl.arange(0, BLOCK_K)
    co = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    x_n = x_ptr + n * x_sn
    wm_rows = wm_ptr + co[None, :] * (KH * KW * CIN_PAD)  # [1, BLOCK_N]; rows padded: no mask
    acc0 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kk in range(0, K_ITERS):
        acc0, acc1, acc2, acc3 = _k_step(
            acc0, acc1, acc2, acc3, kk, x_n, wm_rows, t, j, ck, C_IN, W, R, P_END, x_sc, x_sp,
            KW, KWG, PH, PW, C_PW, CIN_PAD, STEP, PRECISION, BIG, BLOCK_K,
        )  # fmt: skip
    _epilogue(acc0, acc1, acc2, acc3, n, t, co, j, wm_ptr, p_ptr, b_ptr, out_ptr, y0_ptr, C_OUT, W, R, OH, OW,
              o_sn, o_sc, o_sh, o_sw, y_sn, y_sc, y_sh, y_sw, OP0, OP1, OP2, OP3, OP4, OP5, OP6,
              OP7, HAS_BIAS, SAVE, KWG, PW, C_SHIFT, STEP, BIG, BLOCK_M)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

#: Tiles (BLOCK_M, BLOCK_K, num_warps, num_stages) the autotuner tries (``BLOCK_N`` is the plan's);
#: ``_prune`` drops those whose accumulators (``KWG`` of ``[BLOCK_M, BLOCK_N]`` fp32) exceed
#: ``_MAX_ACC_REGS`` registers per thread and ``BLOCK_K`` not dividing the padded channels.
#: NOTE (H100, Triton 3.6; ``python tools/bench_conv_dense.py --cases fp32,bf16 --save off --dense-only
#: --tiles ...`` and the same sweep over the ``convnets`` suite's dense convs: Conv2d 64->64 and
#: 128->128 k3 at batch 32 / 8 / 1, NCHW and channels-last, Conv1d 80->256 k5, fp32 and bf16):
#: 128 rows with 4 warps and 3 stages (192 accumulator registers per thread with a 3-tap group, one
#: program per multiprocessor) is the fastest on the large problems (Conv2d 64->64 on
#: 64x64x256x256: 2.18 ms fp32 / 1.74 ms bf16, against 2.53 / 1.91 for 64x32 4 warps 3 stages and
#: 2.75 / 2.14 for 128x32 8 warps); 64x32 and 64x64 with 2 stages (three programs per
#: multiprocessor) win the smaller ones (Conv2d 64->64 at 32x64x56x56, 128->128 at batch 1) by up to
#: 11 %.  With those three first, the tile the autotuner picks is within 7 % of the sweep's best in
#: every case (within 2 % in all but Conv1d at batch 1 and Conv2d 64->64 at batch 1).  Measured worse,
#: so left out: 8 or 16 warps per 64/128 rows (the warpgroups split N: +15-45 %), BLOCK_K 16
#: (+3-40 %), 128x64 tiles (+2-120 %), a persistent grid walking the tiles in one flattened (tile, K
#: step) loop with the epilogue inside (+30 %), weight tiles through L1 (``cache_modifier=".ca"``:
#: unchanged, L1 hit rate 3 %).
_TILES = ((128, 32, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3),
          (64, 32, 4, 4), (64, 16, 4, 4))


def _configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
        for bm, bk, warps, stages in _TILES
    ]


def _acc_regs(block_m: int, block_n: int, kwg: int, num_warps: int) -> float:
    return block_m * block_n * kwg / (32 * num_warps)


def _stage_bytes(block_m: int, block_k: int, block_n: int, kwg: int, x_size: int, w_size: int) -> int:
    """Shared memory of one pipeline stage: the X tile and the ``KWG`` weight tiles."""
    return block_k * (block_m * x_size + kwg * block_n * w_size)


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The autotuner's pruner: ``_fitting`` for the launch's constexprs and operand dtypes."""
    return _fitting(configs, kwargs["BLOCK_N"], kwargs["KWG"], kwargs["CIN_PAD"], kwargs["ALIGN"],
                    named_args["x_ptr"].element_size(), named_args["wm_ptr"].element_size())


def _fitting(configs: list[triton.Config], bn: int, kwg: int, cin_pad: int, align: int, x_size: int,
             w_size: int) -> list[triton.Config]:  # fmt: skip
    """Tiles that fit, best first: accumulators within ``_MAX_ACC_REGS`` registers per thread,
    ``BLOCK_K`` dividing ``CIN_PAD``, at least one output per tile, and pipeline buffers within
    ``_MAX_STAGE_BYTES`` (``x_size`` / ``w_size``: bytes per element of x and of the weight matrix)."""
    kept = [
        c for c in configs
        if _acc_regs(c.kwargs["BLOCK_M"], bn, kwg, c.num_warps) <= _MAX_ACC_REGS
        and cin_pad % c.kwargs["BLOCK_K"] == 0 and c.kwargs["BLOCK_M"] - (kwg - 1) >= align
        and c.num_stages * _stage_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"], bn, kwg, x_size, w_size)
        <= _MAX_STAGE_BYTES
    ]  # fmt: skip
    return best_first(kept) or [min(configs, key=lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"]))]


_conv_dense_fwd_tuned = triton.autotune(
    configs=_configs(),
    # SAVE is left out: the same tile serves the inference and the training forward (one tuning each
    # for both; the dtypes of the tensors are part of Triton's key).
    key=["C_IN", "C_OUT", "W", "R", "OH", "OW", "KH", "KW", "KWG", "BLOCK_N", "PRECISION"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=tile_bench,
    cache_results=True,
)(_conv_dense_fwd_kernel)


def _heuristic_config(block_n: int, kwg: int, cin_pad: int, align: int) -> dict:
    """One tile for the interpreter (small blocks: numpy cost grows with tile size) or when
    ``FUSION_CONV_AUTOTUNE=0`` / the problem is small: 4 warps, the most rows whose accumulators
    stay within 96 registers per thread (Conv2d 64->64 k3: 64)."""
    block_k = 32 if cin_pad % 32 == 0 else 16
    if _INTERPRET:
        return dict(BLOCK_M=max(16, next_pow2(kwg - 1 + align)), BLOCK_K=16)
    block_m = 128 if _acc_regs(128, block_n, kwg, 4) <= 96 else 64
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4, num_stages=3)


class _Launch(AutotunedLaunch):
    """One launch plan of ``_conv_dense_fwd_kernel`` (``conv_fused.plan._Launch``'s contract): an
    ``AutotunedLaunch`` (the heuristic tile bound at once, or the autotuner's pick on the first
    call; ``first_tile``: ``_fitting``'s first) with the weight prearrangement and the relayout of
    ``x`` when its layout does not flatten."""

    transposed = False

    def __init__(self, ints: tuple[int, ...], constexprs: dict, grid_args: tuple[int, ...], cout: int,
                 cfg: dict | None, weight_launch: WeightMatrixLaunch, relayout: tuple | None,
                 first_tile: dict) -> None:  # fmt: skip
        self.cout = cout
        self.grid_args = grid_args  # (N, OH * R, C_SHIFT, channel blocks)
        self.weight_launch = weight_launch
        #: None, or (shape of the relaid buffer (N, C, H, R), spatial dims of x): x is copied per call
        self.relayout = relayout
        super().__init__(_conv_dense_fwd_tuned, _conv_dense_fwd_kernel, constexprs, ints, cfg, first_tile)

    def tile(self) -> dict | None:
        """The bound tile (``BLOCK_*``, warps, stages), or None before the first tuned call."""
        if self.fast is None:
            return None
        keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
        return {k: self.fast.constexprs[k] for k in keys if k in self.fast.constexprs}

    def grid(self, meta: dict) -> tuple[int]:
        n, v_total, c_shift, n_blocks = self.grid_args
        kwg, align = self.constexprs["KWG"], self.constexprs["ALIGN"]
        step = ((meta["BLOCK_M"] - (kwg - 1)) // align) * align
        return (n * cdiv(v_total + c_shift, step) * n_blocks,)

    def relaid(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the kernel reads it: itself, or (relayout) a copy with row pitch ``R``."""
        if self.relayout is None:
            return x
        shape, dims = self.relayout
        buf = torch.empty(shape, dtype=x.dtype, device=x.device)
        buf[..., : x.shape[-1]].copy_(x if dims == 2 else x.unsqueeze(2))
        return buf

    def run(self, x: torch.Tensor, weight: torch.Tensor, params: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor, saved_y0: torch.Tensor | None, saved_winner: torch.Tensor | None) -> None:  # fmt: skip
        """Launch for tensors like the ones this plan was made for (``conv_dense_forward``'s
        arguments; ``params``: ``build_params`` of its steps; ``bias``: None or its C values,
        contiguous; ``saved_winner`` is always None)."""
        del saved_winner
        self(self.relaid(x), self.weight_launch(weight), params, params if bias is None else bias, out,
             saved_y0 if saved_y0 is not None else out)  # fmt: skip


def _spatial(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """(H, W) sizes and strides of a (N, C, W) or (N, C, H, W) tensor (1d: H = 1)."""
    if t.dim() == 3:
        return [1, t.shape[2]], [t.shape[2] * t.stride(2), t.stride(2)]
    return list(t.shape[2:]), list(t.stride()[2:])


def _flat_pitch(sizes: Sequence[int], strides: Sequence[int]) -> tuple[int, int] | None:
    """``(R, sp)``: positions ``p = h * R + w`` at element offset ``p * sp`` when (H, W) flatten with
    an integer row pitch ``R >= W``; None otherwise."""
    (h, w), (sh, sw) = sizes, strides
    if w == 1:
        sw = sh if h > 1 else 1
    if h == 1:
        sh = w * sw
    if sw <= 0 or sh % sw != 0 or sh // sw < w:
        return None
    return sh // sw, sw


def unsupported_reason(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv: ConvSpec,
    pool: PoolSpec | None,
    save: bool = False,
) -> str | None:
    """Why ``conv_dense_forward`` cannot serve this case, or None when it can (``save`` changes
    nothing; it is taken for ``conv_fused.unsupported_reason``'s shape of call)."""
    del save
    kernel_dtypes = (
        (torch.float32, torch.float16) if _INTERPRET else (torch.float32, torch.float16, torch.bfloat16)
    )
    if x.dtype not in kernel_dtypes or weight.dtype not in kernel_dtypes:
        return f"x/weight dtypes {x.dtype}/{weight.dtype}: the dense conv covers {kernel_dtypes}"
    if conv.transposed:
        return "transposed convolution: the dense conv covers plain convolutions"
    if pool is not None:
        return "a pool after the chain: the dense conv writes the chain's output only"
    if x.dim() not in (3, 4) or weight.dim() != x.dim():
        return f"x {tuple(x.shape)} / weight {tuple(weight.shape)}: only 1d/2d convolutions"
    if conv.groups != 1:
        return f"groups={conv.groups}: the dense conv covers groups == 1"
    if any(s != 1 for s in conv.stride):
        return f"stride {conv.stride}: the dense conv covers stride 1"
    if any(d != 1 for d in conv.dilation):
        return f"dilation {conv.dilation}: the dense conv covers dilation 1"
    if weight.shape[1] != x.shape[1]:
        return f"weight {tuple(weight.shape)} does not take x's {x.shape[1]} channels"
    sizes = conv_output_size(x, weight, conv)
    if min(sizes) <= 0:
        return f"empty conv output {sizes}"
    # Flattened positions (input and virtual output, with the halo and the relayout pitch) are int32.
    rows = max(x.shape[2] if x.dim() == 4 else 1, sizes[0] if x.dim() == 4 else 1) + 1
    positions = rows * (max(x.shape[-1], sizes[-1]) + 64)
    if positions > _INT32_LIMIT // 2:
        return f"{positions} flattened positions per plane exceed int32"
    return None


#: Launch plans by ``_launch_key``.
_LAUNCHES = PlanCache()


def _prepare(args: ForwardArgs) -> _Launch:
    """Validate a call and derive its launch plan (everything but the tensors' data).  Depends only
    on ``args.plan_key()`` and the module switches ``forward_launch`` keys the plan by."""
    x, weight, bias, steps, conv, pool, out, saved_y0, saved_winner, allow_tf32, compute_dtype = args
    compute = x.dtype if compute_dtype is None else compute_dtype
    if compute not in (torch.float32, torch.float16, torch.bfloat16) or (
        _INTERPRET and compute == torch.bfloat16
    ):
        raise ValueError(f"conv_dense_forward: unsupported compute dtype {compute}")
    if saved_winner is not None:
        raise ValueError("saved_winner is only written with a max pool, which the dense conv does not serve")
    why = unsupported_reason(x, weight, conv, pool, saved_y0 is not None)
    if why is not None:
        raise ValueError(f"conv_dense_forward cannot run this case: {why}")
    dims = x.dim() - 2
    n, cin, cout = x.shape[0], x.shape[1], weight.shape[0]
    conv_out = conv_output_size(x, weight, conv)
    expected = [n, cout, *conv_out]
    if list(out.shape) != expected:
        raise ValueError(f"out must have shape {expected}, got {tuple(out.shape)}")
    if saved_y0 is not None and list(saved_y0.shape) != expected:
        raise ValueError(f"saved_y0 must have the conv output's shape {expected}, got {tuple(saved_y0.shape)}")
    if bias is not None and bias.numel() != cout:
        raise ValueError(f"bias must have {cout} values, got {bias.numel()}")

    kh, kw = (1, weight.shape[2]) if dims == 1 else tuple(weight.shape[2:])
    ph, pw = (0, conv.padding[0]) if dims == 1 else tuple(conv.padding)
    (h, w), _ = _spatial(x)
    oh, ow = (1, conv_out[0]) if dims == 1 else tuple(conv_out)
    kwg = kw if kw <= MAX_KW_GROUP else 1
    align = 16 // x.element_size() if kwg > 1 else 1
    flat = _flat_pitch(*_spatial(x))
    relayout = None
    if flat is None or flat[0] < ow:
        pitch = -(-max(w, ow) // align) * align
        relayout = ((n, cin, h, pitch), dims)
        r, sp, x_sn, x_sc = pitch, 1, cin * h * pitch, h * pitch
    else:
        r, sp = flat
        x_sn, x_sc = x.stride(0), x.stride(1)
    if sp != 1:
        align = 1  # positions are not contiguous: nothing to align (channels-last: along ci instead)
    c_shift = (-pw) % align if kwg > 1 else 0
    p_end = (h - 1) * r + w

    precision = dot_precision(compute, allow_tf32, _INTERPRET)
    block_n = min(max(16, next_pow2(cout)), 64)
    n_blocks = cdiv(cout, block_n)
    cin_pad = cdiv(cin, _CIN_ALIGN) * _CIN_ALIGN
    w_str = list(weight.stride())
    w_taps = (0, w_str[2]) if dims == 1 else (w_str[2], w_str[3])
    weight_launch = WeightMatrixLaunch(
        _dense_weight_kernel, (n_blocks * block_n,), (n_blocks * block_n, kh, kw, cin_pad), compute,
        (cin, cout, w_str[0], w_str[1], *w_taps),
        # TF32 rounding only for an fp32 matrix: before a cast to bf16 it would round twice (the
        # values must be exactly ``weight.to(compute)``'s)
        dict(KH=kh, KW=kw, CIN_PAD=cin_pad, PRECISION=precision if compute == torch.float32 else "ieee",
             BLOCK_T=next_pow2(kh * kw),
             BLOCK_C=64 if cin_pad % 64 == 0 else 16),
    )  # fmt: skip

    def hw_strides(t: torch.Tensor | None) -> list[int]:
        if t is None:
            return [0, 0, 0, 0]
        return [t.stride(0), t.stride(1), 0, t.stride(2)] if dims == 1 else list(t.stride())

    big_elems = max(t.numel() for t in (x, out, saved_y0) if t is not None)
    if relayout is not None:
        big_elems = max(big_elems, math.prod(relayout[0]))
    big = big_elems > _BIG_INDEX_THRESHOLD
    ints = (cin, cout, w, r, oh, ow, p_end, x_sn, x_sc, sp, *hw_strides(out), *hw_strides(saved_y0))
    constexprs = dict(
        **op_constexprs(steps), HAS_BIAS=bias is not None, SAVE=saved_y0 is not None,
        KH=kh, KW=kw, KWG=kwg, PH=ph, PW=pw, ALIGN=align, C_SHIFT=c_shift, CIN_PAD=cin_pad,
        PRECISION=precision, BIG=big, BLOCK_N=block_n,
    )  # fmt: skip
    macs = n * oh * ow * cout * cin * kh * kw
    tuned = not (_INTERPRET or not environment.measuring() or macs < _AUTOTUNE_MIN_MACS)
    if tuned:
        first = _fitting(_configs(), block_n, kwg, cin_pad, align, x.element_size(), compute.itemsize)[0]
        first_tile = dict(first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)
    else:
        first_tile = _heuristic_config(block_n, kwg, cin_pad, align)
    return _Launch(ints, constexprs, (n, oh * r, c_shift, n_blocks), cout, None if tuned else first_tile,
                   weight_launch, relayout, first_tile)


def forward_launch(*args: Any, **kwargs: Any) -> _Launch | None:
    """The checked launch plan of ``conv_dense_forward`` for these arguments (``ForwardArgs``; cached
    per shapes, strides, dtypes, geometry, op codes, precision and compute dtype), or None when
    ``out`` is empty (the arguments are still checked).  Its ``run(x, weight, params, bias, out, saved_y0,
    saved_winner)`` launches for tensors laid out like these.  Raises ValueError as
    ``conv_dense_forward`` does."""
    return cached_forward_launch(ForwardArgs(*args, **kwargs), _LAUNCHES, _prepare, _BIG_INDEX_THRESHOLD,
                                 MAX_KW_GROUP)  # fmt: skip


def conv_dense_forward(*args: Any, **kwargs: Any) -> None:
    """Write ``out = chain(conv(x, weight) + bias)`` (and ``saved_y0``) with one kernel launch (plus
    the weight prearrangement).

    Arguments: ``ForwardArgs`` (``conv_fused_forward``'s), for the cases ``unsupported_reason``
    accepts: x (N, C_in, W) or (N, C_in, H, W); weight (C_out, C_in, [KH,] KW); conv not transposed,
    groups 1, stride 1, dilation 1; pool None; out (N, C_out, [OH,] OW); saved_y0 None or the conv
    output without bias (out's shape, any float dtype and strides; the values are rounded to the
    compute dtype); saved_winner None.
    Raises ValueError when ``unsupported_reason`` names a reason or the tensors disagree.
    """
    args = ForwardArgs(*args, **kwargs)
    run_forward(forward_launch(*args), args)
