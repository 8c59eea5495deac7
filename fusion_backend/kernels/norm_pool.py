"""Triton kernel for the normalise pass of a norm followed by a pool: ``conv output -> [pre-chain] ->
norm with known statistics -> gamma / beta -> post-chain -> max or avg pool``, the forward's second
pass of ``fusion::conv_batch_norm`` and ``fusion::conv_group_norm`` when their region ends in a pool.

These kernels know only tensors, op codes, statistics and pool geometry; the fused ops that call them
own the configuration, the statistics pass, the autograd wiring and the fallback.  The backward of
such a region needs no kernel of its own: the norms' backward kernels (``batch_norm``, ``group_norm``)
gather each position's gradient from the pooled gradient with ``chain_math.pool_gather``.

Semantics: per output window, over its taps (input positions), ``v = pre(y + bias)``, ``z = (v -
mean) * rstd * gamma[c] + beta[c]``, ``o = post(z)``; the window's max (PyTorch's tie and NaN rule:
``chain_math.pool_accumulate``) or average (PyTorch's divisor: ``chain_math.pool_divisor``).  The
statistics are per channel (a batch norm: ``(2, C)``) or per (sample, group of ``C / G`` consecutive
channels) (a group norm: ``(2, N, G)``); the kernel reads ``mean`` / ``rstd`` at ``n * st_sn + c //
CG`` of rows 0 / 1 (``st_sn`` 0 and ``CG`` 1 for a batch norm).  All arithmetic is fp32.

Layout and tiling as ``kernels/epilogue.py``'s pooled forward: tensors seen as ``(N, C, D, H, W)``
(``lift_5d``), a program owns ``BLOCK_C`` channels of one sample by ``BLOCK_S`` flat pooled
positions (``epilogue.tile_shape``: long along the output's contiguous axis, or the square
transposing tile where y's contiguous axis is not the output's, e.g. ``conv_batch_norm``'s
channels-last conv output under an NCHW result), and walks each window's taps unrolled
(``POOL_GEOM``).  Only the pooled output is written (and, with ``SAVE`` and a max pool,
each window's winner: its row-major tap index, int8 or int32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..ir.specs import PoolSpec
from .chain_math import (
    KernelStep,
    add_spatial_offset,
    chain_forward,
    load_chain_operands,
    op_codes,
    pool_accumulate,
    pool_code,
    pool_divisor,
    pool_gather,
    pool_geometry,
    spatial_coords,
    step_codes,
)
from .epilogue import channels_innermost, tile_shape
from .host import cdiv, lift_5d
from .launch import FastLaunch
from .plan_cache import PlanCache, require_rows, require_same_device


@triton.jit
def _norm_pool_fwd_kernel(
    y_ptr, p_ptr, q_ptr, a_ptr, st_ptr, out_ptr, win_ptr,
    C, D, H, W, OD, OH, OW, num_s_blocks, CG, st_sn, st_row,
    y_sn, y_sc, y_sd, y_sh, y_sw,
    o_sn, o_sc, o_sd, o_sh, o_sw,
    w_sn, w_sc, w_sd, w_sh, w_sw,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, POOL: tl.constexpr, POOL_GEOM: tl.constexpr,
    SAVE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out = pool(post(norm(pre(y + bias)) * gamma + beta)); with SAVE and a max pool, the winners.

    Pointers (element strides, dims (N, C, D, H, W)):
      y_ptr    conv output without bias, (N, C, D, H, W), fp32/fp16/bf16, strides ``y_s*``.
      p_ptr    pre-chain operand matrix P, (NUM_PARAM_ROWS, C) fp32 contiguous (row 0: the bias, read
               with HAS_BIAS and rounded to y's dtype as the conv adds it).
      q_ptr    post-chain operand matrix Q, (NUM_PARAM_ROWS, C) fp32 contiguous.
      a_ptr    gamma and beta, (2, C) fp32 contiguous.
      st_ptr   fp32 statistics: row 0 the means, row 1 the rstds, row stride ``st_row``; the entry of
               (sample n, channel c) at ``n * st_sn + c // CG``.
      out_ptr  result, (N, C, OD, OH, OW), any float dtype, strides ``o_s*``.
      win_ptr  (SAVE, max pool) winner index per window, int8/int32, out's shape, strides ``w_s*``
               (the saved state's layout: y's, where out has eager's).
    Grid: ``(N * num_s_blocks, cdiv(C, BLOCK_C))``: program ``(i, j)`` owns sample ``i // num_s_blocks``,
    pooled positions ``(i % num_s_blocks) * BLOCK_S + [0, BLOCK_S)`` and channels ``j * BLOCK_C + [0,
    BLOCK_C)``.  POOL: 1 max, 2 avg; POOL_GEOM: ``chain_math.pool_geometry``'s.
    """
    pid0 = tl.program_id(0)
    n64 = (pid0 // num_s_blocks).to(tl.int64)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[:, None]
    s = (pid0 % num_s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)[None, :]
    cmask = c < C
    mask = cmask & (s < OD * OH * OW)
    c64 = c.to(tl.int64)

    st = st_ptr + n64 * st_sn + c // CG
    mean = tl.load(st, mask=cmask, other=0.0)
    rstd = tl.load(st + st_row, mask=cmask, other=0.0)
    gamma = tl.load(a_ptr + c, mask=cmask, other=0.0)
    beta = tl.load(a_ptr + C + c, mask=cmask, other=0.0)
    bias = 0.0
    if HAS_BIAS:  # in the conv's dtype, as the conv adds it
        bias = tl.load(p_ptr + c, mask=cmask, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
    pa0, pb0, pa1, pb1, pa2, pb2, pa3, pb3, pa4, pb4, pa5, pb5, pa6, pb6, pa7, pb7 = load_chain_operands(
        p_ptr, c, C, cmask, PRE[0], PRE[1], PRE[2], PRE[3], PRE[4], PRE[5], PRE[6], PRE[7])  # fmt: skip
    qa0, qb0, qa1, qb1, qa2, qb2, qa3, qb3, qa4, qb4, qa5, qb5, qa6, qb6, qa7, qb7 = load_chain_operands(
        q_ptr, c, C, cmask, POST[0], POST[1], POST[2], POST[3], POST[4], POST[5], POST[6], POST[7])  # fmt: skip

    od, oh, ow = spatial_coords(s, OH, OW)
    KD: tl.constexpr = POOL_GEOM[0][0]
    KH: tl.constexpr = POOL_GEOM[0][1]
    KW: tl.constexpr = POOL_GEOM[0][2]
    STRIDE: tl.constexpr = POOL_GEOM[1]
    PAD: tl.constexpr = POOL_GEOM[2]
    d0 = od * STRIDE[0] - PAD[0]
    h0 = oh * STRIDE[1] - PAD[1]
    w0 = ow * STRIDE[2] - PAD[2]
    y_base = y_ptr + n64 * y_sn + c64 * y_sc
    best = tl.full([BLOCK_C, BLOCK_S], float("-inf"), tl.float32)
    win = tl.full([BLOCK_C, BLOCK_S], -1, tl.int32)
    acc = tl.zeros([BLOCK_C, BLOCK_S], tl.float32)
    for kd in tl.static_range(KD):
        idd = d0 + kd
        ok_d = (idd >= 0) & (idd < D)
        for kh in tl.static_range(KH):
            ih = h0 + kh
            ok_h = ok_d & (ih >= 0) & (ih < H)
            for kw in tl.static_range(KW):
                iw = w0 + kw
                ok = mask & ok_h & (iw >= 0) & (iw < W)
                yb = tl.load(y_base + add_spatial_offset(0, idd, ih, iw, y_sd, y_sh, y_sw), mask=ok,
                             other=0.0).to(tl.float32)  # fmt: skip
                if HAS_BIAS:
                    yb = yb + bias
                v = chain_forward(yb, pa0, pb0, pa1, pb1, pa2, pb2, pa3, pb3, pa4, pb4, pa5, pb5, pa6, pb6, pa7, pb7,
                                  PRE[0], PRE[1], PRE[2], PRE[3], PRE[4], PRE[5], PRE[6], PRE[7])  # fmt: skip
                z = (v - mean) * rstd * gamma + beta
                o = chain_forward(z, qa0, qb0, qa1, qb1, qa2, qb2, qa3, qb3, qa4, qb4, qa5, qb5, qa6, qb6, qa7, qb7,
                                  POST[0], POST[1], POST[2], POST[3], POST[4], POST[5], POST[6], POST[7])  # fmt: skip
                best, win, acc, _ = pool_accumulate(best, win, acc, o, ok, kd * KH * KW + kh * KW + kw, POOL)
    o_off = add_spatial_offset(n64 * o_sn + c64 * o_sc, od, oh, ow, o_sd, o_sh, o_sw)
    if POOL == 1:
        tl.store(out_ptr + o_off, best.to(out_ptr.dtype.element_ty), mask=mask)
        if SAVE:
            w_off = add_spatial_offset(n64 * w_sn + c64 * w_sc, od, oh, ow, w_sd, w_sh, w_sw)
            tl.store(win_ptr + w_off, win.to(win_ptr.dtype.element_ty), mask=mask)
    else:
        div = pool_divisor(od, oh, ow, D, H, W, POOL_GEOM)
        tl.store(out_ptr + o_off, (acc / div).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def pool_input_grad(gout_ptr, win_ptr, g_nc, w_nc, s, mask, D, H, W, OD, OH, OW, g_sd, g_sh, g_sw, w_sd, w_sh, w_sw,
                    POOL: tl.constexpr, POOL_GEOM: tl.constexpr):  # fmt: skip
    """The gradient (fp32, 0 outside ``mask``) at the pool's input positions ``s`` (flat over ``(D, H,
    W)``) from the pooled gradient ``gout_ptr`` (any float dtype) and, for a max pool, the winners
    ``win_ptr`` (int8 / int32): ``chain_math.pool_gather`` without the winner values.  ``g_nc`` /
    ``w_nc``: the int64 (sample, channel) offsets of the two tensors, broadcasting against ``mask``;
    ``g_s*`` / ``w_s*`` their spatial strides; ``(OD, OH, OW)`` the pooled sizes.  What the norms'
    backward kernels read where they read the gradient of their output."""
    d, h, w = spatial_coords(s, H, W)
    zero = tl.where(mask, 0.0, 0.0)
    g, _, _ = pool_gather(gout_ptr, win_ptr, win_ptr, g_nc, w_nc, d, h, w, mask, zero, mask & (s < 0), D, H, W, OD,
                          OH, OW, g_sd, g_sh, g_sw, w_sd, w_sh, w_sw, POOL, POOL_GEOM, False)  # fmt: skip
    return g


def pooled_grad_strides(grad_out: torch.Tensor, y: torch.Tensor, pool: PoolSpec,
                        winner: torch.Tensor | None) -> tuple[int, int, int]:  # fmt: skip
    """``(sn, sc, sw)`` of the pooled gradient ``grad_out`` (N, C, *pooled) of a norm's output ``y``
    (N, C, *spatial), after checking it and, for a max pool, its ``winner`` (int8 / int32, grad_out's
    shape): the strides the norms' backward kernels take where they take a flat gradient's."""
    if grad_out.dim() != y.dim() or list(grad_out.shape[:2]) != list(y.shape[:2]):
        raise ValueError(f"grad_out must be the pooled output's gradient (N, C, *pooled) of y {tuple(y.shape)}, got "
                         f"{tuple(grad_out.shape)}")  # fmt: skip
    if pool.kind == "max" and (winner is None or winner.shape != grad_out.shape
                               or winner.dtype not in (torch.int8, torch.int32)):  # fmt: skip
        raise ValueError(f"a max pool's backward needs int8/int32 winners of grad_out's shape {tuple(grad_out.shape)}")
    strides = lift_5d(grad_out)[1]
    return strides[0], strides[1], strides[4]


#: ``pool_arguments`` without a pool: placeholders the kernels do not read (sizes 1, strides 0).
_NO_POOL = ((1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0), {"POOL": 0, "POOL_GEOM": pool_geometry(None, 1)})


def pool_arguments(grad_out: torch.Tensor, y: torch.Tensor, pool: PoolSpec | None,
                   winner: torch.Tensor | None) -> tuple[tuple[int, ...], dict]:  # fmt: skip
    """The pool arguments of the norms' backward kernels: the ints ``(D, H, W, OD, OH, OW, g_sd, g_sh,
    w_sn, w_sc, w_sd, w_sh, w_sw)`` (y's and the pooled spatial sizes, the pooled gradient's and the
    winners' strides, ``lift_5d``) and the constexprs ``POOL`` / ``POOL_GEOM``; placeholders without a
    pool (or the winners' strides without a max pool)."""
    if pool is None:
        return _NO_POOL
    g_sizes, g_strides = lift_5d(grad_out)
    w_strides = lift_5d(winner)[1] if pool.kind == "max" and winner is not None else [0] * 5
    ints = (*lift_5d(y)[0][2:], *g_sizes[2:], g_strides[2], g_strides[3], *w_strides)
    return ints, {"POOL": pool_code(pool), "POOL_GEOM": pool_geometry(pool, y.dim() - 2)}



#: Launch plans by what they depend on (shapes, strides, dtypes, op codes, pool, statistics layout).
_LAUNCHES = PlanCache()


def norm_pool_forward(
    y: torch.Tensor, has_bias: bool, pre: Sequence[KernelStep], post: Sequence[KernelStep], params: torch.Tensor,
    post_params: torch.Tensor, affine: torch.Tensor, stats: torch.Tensor, pool: PoolSpec, out: torch.Tensor,
    winner: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write ``out = pool(post((pre(y + bias) - mean) * rstd * gamma + beta))`` and, with ``winner``
    (max pool only), each window's winner.

    Args:
      y: conv output without bias, (N, C, *spatial) with 1-3 spatial dims, fp32/fp16/bf16, any strides.
      has_bias: whether ``params``' bias row holds a bias.
      pre, post: the chains as ``(op code, operand values)`` (values only decide the op codes here).
      params: P, fp32 (NUM_PARAM_ROWS, C) contiguous (``kernels.epilogue.build_params``, bias row 0).
      post_params: Q, the same for the post-chain.
      affine: fp32 (2, C) contiguous: gamma, beta (ones / zeros without an affine norm).
      stats: fp32, contiguous: ``(2, C)`` per channel (a batch norm) or ``(2, N, G)`` per (sample,
        group), G dividing C (a group norm); row 0 the means, row 1 the rstds.
      pool: the max or avg pool (its spatial dims are y's; at most ``MAX_WINDOW_VOLUME`` taps).
      out: preallocated (N, C, *pooled spatial) (``pooled_output_shape``), any float dtype, any strides.
      winner: None, or preallocated with out's shape (any strides: the backward reads it best in y's
        layout), int8 (windows up to 127 taps) or int32: the winner's row-major index in its window.
    """
    parts = (y, has_bias, step_codes(pre), step_codes(post),
           params, post_params, affine, stats, pool,
           out, winner)  # fmt: skip
    launch = _LAUNCHES.plan(parts, lambda: _Launch(y, has_bias, pre, post, params, post_params, affine, stats, pool, out,
                                                winner))  # fmt: skip
    launch(y, params, post_params, affine, stats, out, winner)


class _Launch:
    """``norm_pool_forward`` for one signature: arguments checked and the launch worked out once."""

    def __init__(self, y, has_bias, pre, post, params, post_params, affine, stats, pool, out, winner) -> None:
        y_sizes, y_strides = lift_5d(y)
        o_sizes, o_strides = lift_5d(out)
        n, channels = y_sizes[:2]
        for name, t, rows in (("P", params, None), ("Q", post_params, None), ("the affine rows", affine, 2)):
            require_rows(name, t, channels, rows)
        require_same_device(y.device, params=params, post_params=post_params, affine=affine, stats=stats, out=out,
                            winner=winner)
        if list(out.shape[:2]) != [n, channels] or out.dim() != y.dim():
            raise ValueError(f"out must be (N, C, *pooled) for y {tuple(y.shape)}, got {tuple(out.shape)}")
        if stats.dtype != torch.float32 or not stats.is_contiguous() or stats.shape[0] != 2:
            raise ValueError(f"stats must be contiguous fp32 (2, C) or (2, N, G), got {tuple(stats.shape)} {stats.dtype}")
        if stats.dim() == 2 and stats.shape[1] == channels:
            group_channels, st_sn, st_row = 1, 0, channels
        elif stats.dim() == 3 and stats.shape[1] == n and stats.shape[2] >= 1 and channels % stats.shape[2] == 0:
            groups = stats.shape[2]
            group_channels, st_sn, st_row = channels // groups, groups, n * groups
        else:
            raise ValueError(f"stats must be (2, {channels}) or (2, {n}, G) with G dividing {channels}, got "
                             f"{tuple(stats.shape)}")  # fmt: skip
        if pool.kind == "avg" and winner is not None:
            raise ValueError("winners are only saved for a max pool")
        if winner is not None and (winner.shape != out.shape or winner.dtype not in (torch.int8, torch.int32)):
            raise ValueError(f"winner must be int8/int32 with out's shape {tuple(out.shape)}, got {tuple(winner.shape)} "
                             f"{winner.dtype}")  # fmt: skip
        if winner is not None and winner.dtype == torch.int8 and pool.window_volume > 127:
            raise ValueError(f"a window of {pool.window_volume} taps needs int32 winners")
        pool_geom = pool_geometry(pool, y.dim() - 2)
        s_out = o_sizes[2] * o_sizes[3] * o_sizes[4]
        write_inner = channels_innermost(o_strides, o_sizes)
        transposing = channels_innermost(y_strides, y_sizes) != write_inner
        block_c, block_s = tile_shape(channels, s_out, write_inner, transposing=transposing)
        num_s_blocks = cdiv(s_out, block_s)
        self.save = winner is not None
        self.launch = None
        if out.numel() > 0:
            w_strides = lift_5d(winner)[1] if winner is not None else [0] * 5
            ints = (channels, *y_sizes[2:], *o_sizes[2:], num_s_blocks, group_channels, st_sn, st_row, *y_strides,
                    *o_strides, *w_strides)  # fmt: skip
            self.launch = FastLaunch(_norm_pool_fwd_kernel, (n * num_s_blocks, cdiv(channels, block_c)), dict(
                PRE=op_codes(pre), POST=op_codes(post), HAS_BIAS=bool(has_bias), POOL=pool_code(pool), POOL_GEOM=pool_geom,
                SAVE=self.save, BLOCK_C=block_c, BLOCK_S=block_s, num_warps=4,
            ), fixed=ints)  # fmt: skip

    def __call__(self, y, params, post_params, affine, stats, out, winner) -> None:
        if self.launch is not None:
            self.launch(y, params, post_params, affine, stats, out, winner if self.save else out)
