"""Triton kernels for ``conv output -> pointwise pre-chain -> group norm -> pointwise post-chain``,
forward and backward.

These kernels know only tensors, op codes and the group count; the fused op that calls them
(``fusion_backend.ops.conv_group_norm``) owns the configuration, the autograd wiring and the fallback.

Semantics (torch's ``group_norm``; an instance norm is one channel per group): per sample ``n`` and
group ``g`` of ``CG = C / G`` consecutive channels, ``v = pre(y + bias)`` over the group's channels and
every spatial position has mean ``mu`` and biased variance ``var``; ``x_hat = (v - mu) * rstd`` with
``rstd = 1 / sqrt(var + eps)``; ``out = post(x_hat * gamma[c] + beta[c])``.  All arithmetic is fp32.

Data layout.  Tensors are seen as ``(N, C, S)`` with ``S`` the flattened spatial positions (every
conv output flattens: contiguous or channels-last); the kernels take element strides ``(sn, sc, ss)``.
Operand matrices are ``kernels/chain_math.py``'s: ``P`` ``(NUM_PARAM_ROWS, C)`` for the pre-chain
(row ``BIAS_ROW``: the conv bias) and ``Q`` ``(NUM_PARAM_ROWS, C)`` for the post-chain; ``A`` is the
norm's scale and shift, fp32 ``(2, C)`` contiguous (row 0 gamma, row 1 beta).

Tiling.  One program per (sample, group), grid ``(N * G,)``; a program walks its group in tiles of
``[BLOCK_C, BLOCK_S]`` (channel blocks outer, positions inner), always in the same order, so every
result is bitwise reproducible.

Forward: pass 1 reads the group once for its statistics: each tile's own mean and sum of squared
deviations (exact two-pass inside the tile, which is in registers), merged into the running ones
with Chan's parallel formula (no ``E[x^2] - E[x]^2`` cancellation), all of the values less the first
tile's mean (values far from zero keep the digits of their spread); pass 2 reads it again,
normalises, applies gamma / beta and the post-chain, and writes ``out`` in its own layout and dtype.
With ``SAVE`` it writes ``mu`` and ``rstd`` (fp32 ``(2, N, G)``).

Backward: pass 1 recomputes ``x_hat`` and the post-chain, walks the post-chain back from
``grad_out`` (``dz``) and sums over the group ``dz * gamma`` and ``dz * gamma * x_hat``; pass 2
recomputes them and writes ``grad_y = pre'(rstd * (dz*gamma - mean(dz*gamma) - x_hat *
mean(dz*gamma*x_hat)))``.  Per-(sample, channel) partial sums of gamma's and beta's gradients and of
the chains' operand gradients are written to ``(rows, N, C)`` fp32 buffers, one row per wanted
slot, which the launcher reduces over ``N`` in a fixed order (no atomics).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .chain_math import MAX_SLOTS, KernelStep, apply_chain_at, chain_grad_at, op_constexprs
from .host import BoundedCache, next_pow2, tensor_key
from .launch import FastLaunch

#: Elements of a program's tile (``BLOCK_C * BLOCK_S``).
TILE_ELEMENTS = 2048
#: Most channels of a group held in one tile; wider groups are walked in channel blocks.
MAX_BLOCK_C = 64


# --------------------------------------------------------------------------------------------------
# Device functions
# --------------------------------------------------------------------------------------------------


@triton.jit
def _tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``(yb, v)`` at channels ``c`` ([BLOCK_C, 1]) and positions ``s`` ([1, BLOCK_S]): the conv
    output plus bias (the bias rounded to y's dtype first, as the conv adds it) and the pre-chain's
    result, fp32.  Lanes outside ``valid`` hold values the callers mask."""
    cmask = c < C
    yb = tl.load(y_base + c.to(tl.int64) * y_sc + s.to(tl.int64) * y_ss, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        yb = yb + tl.load(p_ptr + c, mask=cmask, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
    return yb, apply_chain_at(yb, p_ptr, c, C, cmask, PRE)


@triton.jit
def _accumulate(acc, ga, keep, WANT: tl.constexpr):
    """``acc`` ([BLOCK_C]) plus the per-channel sum of ``ga`` over the tile's positions where ``keep``."""
    if WANT:
        acc += tl.sum(tl.where(keep, ga, 0.0), axis=1)
    return acc


@triton.jit
def _store_rows(ptr, row_stride, c1, cmask, r0, r1, r2, r3, r4, r5, r6, r7, MASK: tl.constexpr):
    """Row ``k`` of a partial-sum buffer at channels ``c1`` for every wanted slot ``k`` (``MASK`` bit k)."""
    rows = (r0, r1, r2, r3, r4, r5, r6, r7)
    for k in tl.static_range(8):
        if ((MASK >> k) & 1) != 0:
            tl.store(ptr + k * row_stride + c1, rows[k], mask=cmask)


@triton.jit
def _norm_backward_tile(gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_base, g_base, c, s, valid, mu, rstd, C,
                        y_sc, y_ss, g_sc, g_ss, PRE: tl.constexpr, POST: tl.constexpr,
                        HAS_BIAS: tl.constexpr):  # fmt: skip
    """One tile of the backward: ``(yb, x_hat, dz, dxh, q0..q7)``: the conv output plus bias, the
    normalised value, the gradient of the norm's output (the post-chain walked back from grad_out),
    ``dz * gamma`` (0 outside ``valid``), and the post-chain's operand gradients."""
    cmask = c < C
    yb, v = _tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
    xh = (v - mu) * rstd
    gamma = tl.load(a_ptr + c, mask=cmask, other=0.0)
    beta = tl.load(a_ptr + C + c, mask=cmask, other=0.0)
    g = tl.load(g_base + c.to(tl.int64) * g_sc + s.to(tl.int64) * g_ss, mask=valid, other=0.0).to(tl.float32)
    dz, q0, q1, q2, q3, q4, q5, q6, q7 = chain_grad_at(g, xh * gamma + beta, q_ptr, c, C, cmask, POST)
    dxh = tl.where(valid, dz * gamma, 0.0)
    return yb, xh, dz, dxh, q0, q1, q2, q3, q4, q5, q6, q7


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _group_norm_fwd_kernel(
    y_ptr, p_ptr, q_ptr, a_ptr, out_ptr, st_ptr,
    eps, C, S, G, CG, st_row,
    y_sn, y_sc, y_ss, o_sn, o_sc, o_ss,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out = post(group_norm(pre(y + bias)) * gamma + beta).

    Pointers (element strides; ``S`` flattened positions):
      y_ptr    conv output without bias, (N, C, S), fp32/fp16/bf16, strides ``y_s*``.
      p_ptr    pre-chain operand matrix P, (NUM_PARAM_ROWS, C) fp32 contiguous (row 0: bias).
      q_ptr    post-chain operand matrix Q, (NUM_PARAM_ROWS, C) fp32 contiguous.
      a_ptr    gamma and beta, (2, C) fp32 contiguous.
      out_ptr  result, (N, C, S), any float dtype, strides ``o_s*``.
      st_ptr   (SAVE) fp32 (2, N, G) contiguous: row 0 mean, row 1 rstd; row stride ``st_row``.
    Grid: ``(N * G,)``; program ``pid`` owns sample ``pid // G``, channels ``(pid % G) * CG + [0, CG)``.
    """
    pid = tl.program_id(0)
    n64 = (pid // G).to(tl.int64)
    c_first = (pid % G) * CG
    y_base = y_ptr + n64 * y_sn
    cb = tl.arange(0, BLOCK_C)[:, None]
    sb = tl.arange(0, BLOCK_S)[None, :]

    # 1. mean and variance of the group (Chan's merge of exact per-tile statistics), of the values
    #    less the first tile's mean: far from zero, the deviations then keep their digits
    first = (cb < CG) & (sb < S)
    _, v = _tile_values(y_ptr, p_ptr, y_base, c_first + cb, sb, first, C, y_sc, y_ss, PRE, HAS_BIAS)
    shift = tl.sum(tl.sum(tl.where(first, v, 0.0), axis=1), axis=0) / tl.sum(tl.sum(first.to(tl.float32), axis=1), axis=0)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for c0 in range(0, CG, BLOCK_C):
        c = c_first + c0 + cb
        for s0 in range(0, S, BLOCK_S):
            s = s0 + sb
            valid = (c0 + cb < CG) & (s < S)
            _, v = _tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
            v = v - shift
            n_t = tl.sum(tl.sum(valid.to(tl.float32), axis=1), axis=0)
            mean_t = tl.sum(tl.sum(tl.where(valid, v, 0.0), axis=1), axis=0) / n_t
            d = tl.where(valid, v - mean_t, 0.0)
            m2_t = tl.sum(tl.sum(d * d, axis=1), axis=0)
            total = count + n_t
            delta = mean_t - mean
            mean = mean + delta * (n_t / total)
            m2 = m2 + m2_t + delta * delta * (count * n_t / total)
            count = total
    rstd = 1.0 / tl.sqrt(m2 / count + eps)
    mean = mean + shift
    if SAVE:
        tl.store(st_ptr + pid, mean)
        tl.store(st_ptr + st_row + pid, rstd)

    # 2. normalise, scale and shift, post-chain, write
    o_base = out_ptr + n64 * o_sn
    for c0 in range(0, CG, BLOCK_C):
        c = c_first + c0 + cb
        cmask = c < C
        gamma = tl.load(a_ptr + c, mask=cmask, other=0.0)
        beta = tl.load(a_ptr + C + c, mask=cmask, other=0.0)
        for s0 in range(0, S, BLOCK_S):
            s = s0 + sb
            valid = (c0 + cb < CG) & (s < S)
            _, v = _tile_values(y_ptr, p_ptr, y_base, c, s, valid, C, y_sc, y_ss, PRE, HAS_BIAS)
            z = (v - mean) * rstd * gamma + beta
            out = apply_chain_at(z, q_ptr, c, C, cmask, POST)
            tl.store(o_base + c.to(tl.int64) * o_sc + s.to(tl.int64) * o_ss, out.to(out_ptr.dtype.element_ty),
                     mask=valid)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _group_norm_bwd_kernel(
    gout_ptr, y_ptr, st_ptr, p_ptr, q_ptr, a_ptr, gy_ptr, part_ptr, qpart_ptr, apart_ptr,
    C, S, G, CG, st_row, part_row,
    g_sn, g_sc, g_ss, y_sn, y_sc, y_ss, gy_sn, gy_sc, gy_ss,
    PRE: tl.constexpr, POST: tl.constexpr, HAS_BIAS: tl.constexpr, PRE_MASK: tl.constexpr,
    POST_MASK: tl.constexpr, AFFINE_MASK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """grad_y of ``out = post(group_norm(pre(y + bias)) * gamma + beta)`` and per-(n, c) partial sums.

    Pointers (element strides; ``S`` flattened positions):
      gout_ptr   gradient of out, (N, C, S), any float dtype, strides ``g_s*``.
      y_ptr      the conv output without bias as the forward read it, strides ``y_s*``.
      st_ptr     the forward's fp32 (2, N, G) statistics (row 0 mean, row 1 rstd), row stride ``st_row``.
      p_ptr, q_ptr, a_ptr   as in the forward.
      gy_ptr     grad_y, (N, C, S), the conv output's dtype, strides ``gy_s*``.
      part_ptr   (PRE_MASK) fp32 (MAX_SLOTS, N, C) contiguous: row k, the per-(n, c) sum over positions of
                 the pre-chain slot k's first-operand gradient; ``part_row`` = N * C.
      qpart_ptr  (POST_MASK) the same for the post-chain.
      apart_ptr  (AFFINE_MASK: bit 0 gamma, bit 1 beta) fp32 (2, N, C) contiguous: per-(n, c) sums of
                 ``dz * x_hat`` (gamma's gradient) and ``dz`` (beta's).
    Grid: ``(N * G,)`` as the forward's.
    """
    pid = tl.program_id(0)
    n64 = (pid // G).to(tl.int64)
    c_first = (pid % G) * CG
    y_base = y_ptr + n64 * y_sn
    g_base = gout_ptr + n64 * g_sn
    cb = tl.arange(0, BLOCK_C)[:, None]
    sb = tl.arange(0, BLOCK_S)[None, :]
    mu = tl.load(st_ptr + pid)
    rstd = tl.load(st_ptr + st_row + pid)
    row_base = n64 * C

    # pass 1: the group's sums of dz * gamma and dz * gamma * x_hat; gamma / beta and post-chain partials
    sum_dxh = 0.0
    sum_dxh_xh = 0.0
    for c0 in range(0, CG, BLOCK_C):
        c = c_first + c0 + cb
        cmask1 = c0 + tl.arange(0, BLOCK_C) < CG
        dgamma = tl.zeros([BLOCK_C], tl.float32)
        dbeta = tl.zeros([BLOCK_C], tl.float32)
        p0 = tl.zeros([BLOCK_C], tl.float32)
        p1, p2, p3, p4, p5, p6, p7 = p0, p0, p0, p0, p0, p0, p0
        for s0 in range(0, S, BLOCK_S):
            s = s0 + sb
            valid = (c0 + cb < CG) & (s < S)
            yb, xh, dz, dxh, q0, q1, q2, q3, q4, q5, q6, q7 = _norm_backward_tile(
                gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_base, g_base, c, s, valid, mu, rstd, C, y_sc, y_ss, g_sc,
                g_ss, PRE, POST, HAS_BIAS)  # fmt: skip
            sum_dxh += tl.sum(tl.sum(dxh, axis=1), axis=0)
            sum_dxh_xh += tl.sum(tl.sum(tl.where(valid, dxh * xh, 0.0), axis=1), axis=0)
            dgamma = _accumulate(dgamma, dz * xh, valid, (AFFINE_MASK & 1) != 0)
            dbeta = _accumulate(dbeta, dz, valid, (AFFINE_MASK & 2) != 0)
            p0 = _accumulate(p0, q0, valid, (POST_MASK & 1) != 0)
            p1 = _accumulate(p1, q1, valid, (POST_MASK & 2) != 0)
            p2 = _accumulate(p2, q2, valid, (POST_MASK & 4) != 0)
            p3 = _accumulate(p3, q3, valid, (POST_MASK & 8) != 0)
            p4 = _accumulate(p4, q4, valid, (POST_MASK & 16) != 0)
            p5 = _accumulate(p5, q5, valid, (POST_MASK & 32) != 0)
            p6 = _accumulate(p6, q6, valid, (POST_MASK & 64) != 0)
            p7 = _accumulate(p7, q7, valid, (POST_MASK & 128) != 0)
        c1 = row_base + c_first + c0 + tl.arange(0, BLOCK_C)
        if AFFINE_MASK != 0:
            _store_rows(apart_ptr, part_row, c1, cmask1, dgamma, dbeta, dbeta, dbeta, dbeta, dbeta, dbeta, dbeta,
                        AFFINE_MASK)  # fmt: skip
        if POST_MASK != 0:
            _store_rows(qpart_ptr, part_row, c1, cmask1, p0, p1, p2, p3, p4, p5, p6, p7, POST_MASK)
    count = CG * 1.0 * S
    mean_dxh = sum_dxh / count
    mean_dxh_xh = sum_dxh_xh / count

    # pass 2: the norm's input gradient, the pre-chain walked back, grad_y and pre-chain partials
    gy_base = gy_ptr + n64 * gy_sn
    for c0 in range(0, CG, BLOCK_C):
        c = c_first + c0 + cb
        cmask = c < C
        cmask1 = c0 + tl.arange(0, BLOCK_C) < CG
        p0 = tl.zeros([BLOCK_C], tl.float32)
        p1, p2, p3, p4, p5, p6, p7 = p0, p0, p0, p0, p0, p0, p0
        for s0 in range(0, S, BLOCK_S):
            s = s0 + sb
            valid = (c0 + cb < CG) & (s < S)
            yb, xh, dz, dxh, q0, q1, q2, q3, q4, q5, q6, q7 = _norm_backward_tile(
                gout_ptr, y_ptr, p_ptr, q_ptr, a_ptr, y_base, g_base, c, s, valid, mu, rstd, C, y_sc, y_ss, g_sc,
                g_ss, PRE, POST, HAS_BIAS)  # fmt: skip
            dv = rstd * (dxh - mean_dxh - xh * mean_dxh_xh)
            gy, a0, a1, a2, a3, a4, a5, a6, a7 = chain_grad_at(dv, yb, p_ptr, c, C, cmask, PRE)
            tl.store(gy_base + c.to(tl.int64) * gy_sc + s.to(tl.int64) * gy_ss, gy.to(gy_ptr.dtype.element_ty),
                     mask=valid)  # fmt: skip
            p0 = _accumulate(p0, a0, valid, (PRE_MASK & 1) != 0)
            p1 = _accumulate(p1, a1, valid, (PRE_MASK & 2) != 0)
            p2 = _accumulate(p2, a2, valid, (PRE_MASK & 4) != 0)
            p3 = _accumulate(p3, a3, valid, (PRE_MASK & 8) != 0)
            p4 = _accumulate(p4, a4, valid, (PRE_MASK & 16) != 0)
            p5 = _accumulate(p5, a5, valid, (PRE_MASK & 32) != 0)
            p6 = _accumulate(p6, a6, valid, (PRE_MASK & 64) != 0)
            p7 = _accumulate(p7, a7, valid, (PRE_MASK & 128) != 0)
        if PRE_MASK != 0:
            c1 = row_base + c_first + c0 + tl.arange(0, BLOCK_C)
            _store_rows(part_ptr, part_row, c1, cmask1, p0, p1, p2, p3, p4, p5, p6, p7, PRE_MASK)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _flat(name: str, t: torch.Tensor) -> tuple[int, int, int]:
    """``(sn, sc, ss)`` of ``t`` (N, C, *spatial) seen as (N, C, S); ``ValueError`` when its spatial
    dims do not flatten to one stride."""
    inner, ss = 1, None
    for size, stride in reversed(list(zip(t.shape[2:], t.stride()[2:], strict=True))):
        if size == 1:
            continue
        if ss is not None and stride != inner:
            raise ValueError(f"{name}'s spatial dims must flatten to one stride, got strides {t.stride()}")
        if ss is None:
            ss = stride
        inner = stride * size
    return t.stride(0), t.stride(1), 1 if ss is None else ss


def _tile(group_channels: int, positions: int) -> tuple[int, int]:
    """``(BLOCK_C, BLOCK_S)``: the group's channels (at most ``MAX_BLOCK_C`` at once), positions
    filling ``TILE_ELEMENTS``."""
    block_c = min(next_pow2(group_channels), MAX_BLOCK_C)
    block_s = max(1, min(next_pow2(max(positions, 1)), TILE_ELEMENTS // block_c))
    return block_c, block_s


def _ops(steps: Sequence[KernelStep]) -> tuple[int, ...]:
    return tuple(op_constexprs(steps).values())


def _check_common(y: torch.Tensor, groups: int, params: torch.Tensor, post_params: torch.Tensor,
                  affine: torch.Tensor) -> tuple[int, int, int]:  # fmt: skip
    """``(N, C, S)`` of ``y`` after checking the arguments every launch shares."""
    if not 3 <= y.dim() <= 5:
        raise ValueError(f"y must be (N, C, *spatial) with 1-3 spatial dims, got {tuple(y.shape)}")
    n, channels = y.shape[:2]
    if groups < 1 or channels % groups != 0:
        raise ValueError(f"{channels} channels do not split into {groups} groups")
    for name, t, rows in (("P", params, None), ("Q", post_params, None), ("the affine rows", affine, 2)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.shape[-1] != channels or (rows and t.shape[0] != rows):
            raise ValueError(f"{name} must be contiguous fp32 with {channels} columns, got {tuple(t.shape)} {t.dtype}")
    return n, channels, y[0, 0].numel()


#: Launch plans by what they depend on (shapes, strides, dtypes, op codes, groups, wanted outputs).
_FORWARD_LAUNCHES = BoundedCache(256)
_BACKWARD_LAUNCHES = BoundedCache(256)


def group_norm_forward(
    y: torch.Tensor, has_bias: bool, pre: Sequence[KernelStep], post: Sequence[KernelStep], groups: int, eps: float,
    params: torch.Tensor, post_params: torch.Tensor, affine: torch.Tensor, out: torch.Tensor,
    stats: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write ``out = post(group_norm(pre(y + bias)) * gamma + beta)`` (and with ``stats`` the group
    statistics) in one launch.

    Args:
      y: conv output without bias, (N, C, *spatial) with 1-3 spatial dims that flatten (contiguous or
        channels-last), fp32/fp16/bf16.
      has_bias: whether ``params``' bias row holds a bias.
      pre, post: the chains as ``(op code, operand values)`` (values only decide the op codes here).
      groups: G, dividing C.
      eps: added to each group's biased variance.
      params: P, fp32 (NUM_PARAM_ROWS, C) contiguous (``kernels.epilogue.build_params``).
      post_params: Q, the same for the post-chain (no bias row content).
      affine: fp32 (2, C) contiguous: gamma, beta (ones / zeros without an affine norm).
      out: preallocated, y's shape (spatial dims flatten), any float dtype.
      stats: None, or preallocated fp32 (2, N, G) contiguous: mean, rstd.
    """
    key = (tensor_key(y), has_bias, tuple(int(c) for c, _ in pre), tuple(int(c) for c, _ in post), groups,
           float(eps), tensor_key(params), tensor_key(post_params), tensor_key(affine), tensor_key(out),
           tensor_key(stats))  # fmt: skip
    launch = _FORWARD_LAUNCHES.get(key, lambda: _ForwardLaunch(y, has_bias, pre, post, groups, eps, params,
                                                               post_params, affine, out, stats))  # fmt: skip
    launch(y, params, post_params, affine, out, stats)


class _ForwardLaunch:
    """``group_norm_forward`` for one signature: arguments checked and the launch worked out once."""

    def __init__(self, y, has_bias, pre, post, groups, eps, params, post_params, affine, out, stats) -> None:
        n, channels, positions = _check_common(y, groups, params, post_params, affine)
        if out.shape != y.shape:
            raise ValueError(f"out must have y's shape {tuple(y.shape)}, got {tuple(out.shape)}")
        if stats is not None and (tuple(stats.shape) != (2, n, groups) or not stats.is_contiguous()
                                  or stats.dtype != torch.float32):  # fmt: skip
            raise ValueError(f"stats must be contiguous fp32 (2, {n}, {groups}), got {tuple(stats.shape)} {stats.dtype}")
        group_channels = channels // groups
        block_c, block_s = _tile(group_channels, positions)
        self.save = stats is not None
        self.launch = None
        if out.numel() > 0:
            ints = (float(eps), channels, positions, groups, group_channels, n * groups, *_flat("y", y),
                    *_flat("out", out))  # fmt: skip
            self.launch = FastLaunch(_group_norm_fwd_kernel, (n * groups,), dict(
                PRE=_ops(pre), POST=_ops(post), HAS_BIAS=has_bias, SAVE=self.save, BLOCK_C=block_c, BLOCK_S=block_s,
                num_warps=8 if block_c * block_s >= 2048 else 4,
            ), fixed=ints)  # fmt: skip

    def __call__(self, y, params, post_params, affine, out, stats) -> None:
        if self.launch is not None:
            self.launch(y, params, post_params, affine, out, stats if self.save else params)


def group_norm_backward(
    grad_out: torch.Tensor, y: torch.Tensor, stats: torch.Tensor, has_bias: bool, pre: Sequence[KernelStep],
    post: Sequence[KernelStep], groups: int, params: torch.Tensor, post_params: torch.Tensor, affine: torch.Tensor,
    grad_y: torch.Tensor, pre_grad_slots: Sequence[bool] = (), post_grad_slots: Sequence[bool] = (),
    affine_grads: tuple[bool, bool] = (False, False),
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[torch.Tensor | None]]:  # fmt: skip
    """Write the conv-output gradient into ``grad_y``; return the per-channel parameter gradients.

    Args:
      grad_out: gradient of ``out`` (y's shape, any strides, any float dtype).
      y: the conv output without bias as given to the forward.
      stats: the forward's fp32 (2, N, G) statistics.
      has_bias, pre, post, groups, params, post_params, affine: as given to the forward.
      grad_y: preallocated (N, C, *spatial), spatial dims flattening, the conv output's dtype.
      pre_grad_slots / post_grad_slots: per slot of each chain, whether its first operand's gradient
        is wanted; affine_grads: whether gamma's / beta's are.
    Returns:
      ``(pre_sums, post_sums, affine_sums)``: per slot (per gamma, beta), None or the fp32 (C,) sum over
      samples and positions of its gradient, the samples' partials summed in a fixed order.
    """
    key = (tensor_key(grad_out), tensor_key(y), tensor_key(stats), has_bias, tuple(int(c) for c, _ in pre),
           tuple(int(c) for c, _ in post), groups, tensor_key(params), tensor_key(post_params), tensor_key(affine),
           tensor_key(grad_y), tuple(map(bool, pre_grad_slots)), tuple(map(bool, post_grad_slots)),
           tuple(map(bool, affine_grads)))  # fmt: skip
    launch = _BACKWARD_LAUNCHES.get(key, lambda: _BackwardLaunch(
        grad_out, y, stats, has_bias, pre, post, groups, params, post_params, affine, grad_y, pre_grad_slots,
        post_grad_slots, affine_grads))  # fmt: skip
    return launch(grad_out, y, stats, params, post_params, affine, grad_y)


class _BackwardLaunch:
    """``group_norm_backward`` for one signature: arguments checked and the launch worked out once."""

    def __init__(self, grad_out, y, stats, has_bias, pre, post, groups, params, post_params, affine, grad_y,
                 pre_grad_slots, post_grad_slots, affine_grads) -> None:  # fmt: skip
        n, channels, positions = _check_common(y, groups, params, post_params, affine)
        for name, t in (("grad_out", grad_out), ("grad_y", grad_y)):
            if t.shape != y.shape:
                raise ValueError(f"{name} must have y's shape {tuple(y.shape)}, got {tuple(t.shape)}")
        if tuple(stats.shape) != (2, n, groups) or not stats.is_contiguous() or stats.dtype != torch.float32:
            raise ValueError(f"stats must be contiguous fp32 (2, {n}, {groups}), got {tuple(stats.shape)} {stats.dtype}")
        self.copy_grad_out = False
        try:
            g_flat = _flat("grad_out", grad_out)
        except ValueError:
            self.copy_grad_out, g_flat = True, _flat("grad_out", torch.empty(grad_out.shape, device="meta"))
        group_channels = channels // groups
        block_c, block_s = _tile(group_channels, positions)
        self.pre_slots = [k < len(pre_grad_slots) and bool(pre_grad_slots[k]) for k in range(len(pre))]
        self.post_slots = [k < len(post_grad_slots) and bool(post_grad_slots[k]) for k in range(len(post))]
        self.affine_slots = [bool(a) for a in affine_grads]
        masks = [sum(1 << k for k, w in enumerate(slots) if w) for slots in (self.pre_slots, self.post_slots,
                                                                              self.affine_slots)]  # fmt: skip
        self.shape = (n, channels)
        self.launch = None
        if grad_y.numel() > 0:
            ints = (channels, positions, groups, group_channels, n * groups, n * channels, *g_flat, *_flat("y", y),
                    *_flat("grad_y", grad_y))  # fmt: skip
            self.launch = FastLaunch(_group_norm_bwd_kernel, (n * groups,), dict(
                PRE=_ops(pre), POST=_ops(post), HAS_BIAS=has_bias, PRE_MASK=masks[0], POST_MASK=masks[1],
                AFFINE_MASK=masks[2], BLOCK_C=block_c, BLOCK_S=block_s, num_warps=8 if block_c * block_s >= 2048 else 4,
            ), fixed=ints)  # fmt: skip

    def __call__(self, grad_out, y, stats, params, post_params, affine, grad_y):
        if self.copy_grad_out:
            grad_out = grad_out.contiguous()
        device = grad_y.device

        def buffer(slots: list[bool], rows: int) -> torch.Tensor:
            return torch.zeros((rows, *self.shape) if any(slots) else (1,), dtype=torch.float32, device=device)

        part, qpart, apart = buffer(self.pre_slots, MAX_SLOTS), buffer(self.post_slots, MAX_SLOTS), buffer(self.affine_slots, 2)
        if self.launch is not None:
            self.launch(grad_out, y, stats, params, post_params, affine, grad_y, part, qpart, apart)
        # NOTE: torch's reduction over a fixed shape runs in a fixed order: bitwise reproducible sums.
        return tuple([buf[k].sum(0) if w else None for k, w in enumerate(slots)]
                     for buf, slots in ((part, self.pre_slots), (qpart, self.post_slots), (apart, self.affine_slots)))  # fmt: skip
