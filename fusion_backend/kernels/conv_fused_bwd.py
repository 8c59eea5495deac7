"""Triton implicit-GEMM backward of a convolution whose output gradient is never materialised.

WHY: ``conv_epilogue``'s backward used to write the FULL-SIZE gradient ``g`` of the conv output and
hand it to ``aten.convolution_backward``.  Behind a 2x2x2 max pool (the ConvT3d pipeline) 7/8 of that
tensor are zeros, and writing + re-reading it costs more than the GEMMs.  The kernels here read ``g``
through a loader that computes it on the fly from one of two compact forms:

* **dense** (form a): ``g`` is a tensor of the conv-output shape (no pool; any strides);
* **max-pooled** (form b): ``PooledGrad(g_win, winner, pool geometry)``: ``g_win`` (pooled shape) is
  the gradient at each window's winner (``grad_out * chain'(y0_winner)``), ``winner`` the winner's
  row-major index inside its window (int8/int32, the format ``epilogue_forward`` saves).  Then
  ``g[n, c, o] = sum over windows j containing o with winner[n, c, j] == offset of o in j of
  g_win[n, c, j]`` (overlapping windows are summed, exactly like ``_scatter_to_windows``).
* An avg pool (form c) is NOT offered: ``g`` at ``o`` is ``sum_j grad[j] / div_j * chain'(y0[o])``,
  so the loader would need the full-size saved ``y0`` and the whole pointwise-chain derivative
  template (op codes, operand matrix) of ``kernels/epilogue.py`` inside the GEMM loops.  Use the
  dense form after the epilogue's backward kernel there.

Public launchers (they know only tensors; see each docstring for the exact contract):

* ``convolution_backward(grad, x, weight, stride, padding, dilation, transposed, output_padding,
  groups, output_mask) -> (grad_x | None, grad_w | None, grad_b | None)``: the drop-in for
  ``aten.convolution_backward`` (same argument order, minus ``bias_sizes``).
* ``conv_input_grad(...)``, ``conv_weight_grad(...)``, ``conv_bias_grad(grad)``: the three parts.
* ``unsupported_reason(grad, x, weight, ...) -> str | None``: None when the kernels take the case.

How to wire (``ops/conv_epilogue.py::_triton_backward``): with a max pool, replace the full-size
``grad_y`` written by ``epilogue_backward`` with ``PooledGrad(g_win, saved_a, kernel_size, stride,
padding, ceil_mode=...)`` where ``g_win`` (pooled shape, any float dtype, fp32 recommended) is the
chain's backward evaluated at the winners only (``y0 = saved_b + bias``); without a pool keep
``grad_y`` and pass it as the dense form.  Then call ``convolution_backward(grad, x, weight,
spec.stride, spec.padding, spec.dilation, spec.transposed, spec.output_padding, spec.groups,
[mask[0], mask[1], mask[2]])`` when ``unsupported_reason(...)`` is None, else keep the aten path.
The bias gradient comes out of the compact form (``sum g == sum g_win``), so the epilogue kernel no
longer needs its bias partials.  ``saved_a`` goes in as it is (int8 or int32, any strides); nothing
of the conv-output size is allocated on this path.

Algorithms (1d/2d/3d all lifted to 3d with singleton leading dims; ``k`` a tap, ``s`` stride, ``p``
padding, ``dl`` dilation; conv: ``x[i]`` feeds ``y0[o]`` when ``i = o*s - p + k*dl``; transposed:
``y0[o]`` gets ``x[i]`` when ``o = i*s - p + k*dl``):

* input grad, transposed conv: ``dx[i] = sum_{co,k} g[i*s - p + k*dl] w[ci, co, k]``: a strided
  gather conv.  Conv: ``dx[i] = sum_{co,k: (i+p-k*dl) % s == 0} g[(i+p-k*dl)/s] w[co, ci, k]``,
  done per phase ``r = i mod s`` (sub-pixel decomposition): a program owns positions of one phase
  and walks only that phase's taps, from a host-built table, so no MAC is wasted on a zero tap.
  GEMM: M = positions, N = x channels (per group), K = (tap, g channel), K = tap-major so that a
  K block of channels-last g is contiguous.
* weight grad: ``dw[a, b, k] = sum_{n,t} A[n, a, t] B[n, b, t*s - p + k*dl]`` with (A, B) = (g, x)
  for a conv and (x, g) for a transposed conv (``a`` always indexes weight dim 0, ``b`` dim 1).
  GEMM per tap: M = a, N = b, K = n x spatial: split into chunks over programs, each writing an fp32
  partial; a second pass sums the partials in a fixed order (``torch.sum`` over a fixed shape): the
  result is bitwise reproducible run to run, no float atomics anywhere.
* bias grad: fp32 ``sum`` of the compact form over (n, spatial) (``g_win`` for form b).

Tensor cores: ``tl.dot`` with fp32 accumulation; both operands in x's dtype (the gradient is
rounded to it, as aten's conv backward would see a ``grad_y`` of the conv's dtype); fp32 in TF32
iff ``torch.backends.cudnn.allow_tf32`` (like cuDNN, rounded to nearest: ``kernels.tf32``), IEEE fp32
under the interpreter.  Any strides
(contiguous or channels-last); grads come back in the layout of ``torch.empty_like`` of their
forward tensor.  Offsets are int32 unless a tensor spans 2**31 elements or more (then int64).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

import torch
import triton
import triton.language as tl

from .. import environment
from ..ir.shapes import conv_output_length, pool_output_length
from .host import (
    INTERPRETER,
    best_first,
    cdiv,
    element_extent,
    lift3,
    lift_5d,
    next_pow2,
    persistent_device_copies,
)
from .launch import launch
from .tf32 import backward_dot_precision, round_tf32

_INTERPRET = INTERPRETER  # kernels/host.py: whether Triton's interpreter is on
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Most candidate windows (product over dims of ceil(window extent / pool stride)) a conv-output
#: position may belong to; the loader unrolls them.
MAX_CANDIDATE_WINDOWS = 8


@dataclass(frozen=True)
class PooledGrad:
    """Form (b): the conv-output gradient behind a max pool, as per-window winner gradients.

    Attributes:
      g_win: (N, C, *pooled) any float dtype, any strides: gradient at each window's winner.
      winner: (N, C, *pooled) int8/int32, any strides: the winner's row-major index over the window's
        taps (kd, kh, kw).  A pooled entry whose winner is out of range contributes nothing.
      kernel_size, stride, padding, dilation: one entry per spatial dim (``stride=()`` means
        ``kernel_size``, ``dilation=()`` means 1), PyTorch's max-pool geometry.
      ceil_mode: only used to validate the pooled shape (partial windows are clipped either way).
    """

    g_win: torch.Tensor
    winner: torch.Tensor
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()
    ceil_mode: bool = False

    def geometry(self, dims: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """(kernel, stride, padding, dilation) lifted to 3 dims."""
        k = list(self.kernel_size)
        s = list(self.stride) if self.stride else k
        p = list(self.padding) if self.padding else [0] * dims
        d = list(self.dilation) if self.dilation else [1] * dims
        pad = 3 - dims
        return [1] * pad + k, [1] * pad + s, [0] * pad + p, [1] * pad + d


#: What the launchers take as the conv-output gradient.
Grad = Union[torch.Tensor, PooledGrad]


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
def _load_at(
    ptr, win_ptr, n64, pd, ph, pw, row_ok, c, c_ok,
    D, H, W, JD, JH, JW,
    s_n, s_c, s_d, s_h, s_w,
    w_sn, w_sc, w_sd, w_sh, w_sw,
    POOLED: tl.constexpr,
    PKD: tl.constexpr, PKH: tl.constexpr, PKW: tl.constexpr,
    PSD: tl.constexpr, PSH: tl.constexpr, PSW: tl.constexpr,
    PPD: tl.constexpr, PPH: tl.constexpr, PPW: tl.constexpr,
    PDD: tl.constexpr, PDH: tl.constexpr, PDW: tl.constexpr,
    NJD: tl.constexpr, NJH: tl.constexpr, NJW: tl.constexpr, I64: tl.constexpr,
):  # fmt: skip
    """Tile of values at positions ``(n, pd, ph, pw)`` x channels ``c``; 0 outside (D, H, W).

    Dense: the tensor's dtype; pooled: fp32 (sums over windows).

    ``n64, pd, ph, pw, row_ok`` share one "row" shape and ``c, c_ok`` one "channel" shape that
    broadcast against each other ([R, 1] and [1, C], or [1, R] and [C, 1]): all index arithmetic
    runs on the row vectors, per element only an address add, the loads and a compare remain.
    Dense (``POOLED`` False): ``ptr`` is an ``(N, C, D, H, W)`` tensor with strides ``s_*``.
    Pooled: ``ptr`` is ``g_win`` (strides ``s_*``) and ``win_ptr`` the winners (strides ``w_s*``),
    both ``(N, C, JD, JH, JW)``; the value is the sum over the (at most NJD*NJH*NJW) windows that
    contain the position and whose winner is it.
    """
    row_ok = row_ok & (pd >= 0) & (pd < D) & (ph >= 0) & (ph < H) & (pw >= 0) & (pw < W)
    c64 = _ix(c, I64)
    if not POOLED:
        row = n64 * s_n + _ix(pd, I64) * s_d + _ix(ph, I64) * s_h + _ix(pw, I64) * s_w
        # NOTE: no cast here: a load that feeds tl.dot directly is what Triton's pipeliner
        # multi-buffers (a bf16 -> fp32 -> bf16 round trip defeats it).
        return tl.load(ptr + (row + c64 * s_c), mask=row_ok & c_ok, other=0.0)
    else:
        # Shift to non-negative coordinates so that // and % agree between C and Python semantics.
        qd = tl.where(row_ok, pd, 0) + PPD
        qh = tl.where(row_ok, ph, 0) + PPH
        qw = tl.where(row_ok, pw, 0) + PPW
        acc = tl.zeros((row_ok & c_ok).shape, tl.float32)
        g_col = c64 * s_c
        w_col = c64 * w_sc
        for ad in tl.static_range(NJD):
            jd = qd // PSD - ad
            rd = qd - jd * PSD
            ok_d = row_ok & (jd >= 0) & (jd < JD) & (rd % PDD == 0) & (rd < PKD * PDD)
            for ah in tl.static_range(NJH):
                jh = qh // PSH - ah
                rh = qh - jh * PSH
                ok_h = ok_d & (jh >= 0) & (jh < JH) & (rh % PDH == 0) & (rh < PKH * PDH)
                for aw in tl.static_range(NJW):
                    jw = qw // PSW - aw
                    rw = qw - jw * PSW
                    hit = ok_h & (jw >= 0) & (jw < JW) & (rw % PDW == 0) & (rw < PKW * PDW)
                    widx = (rd // PDD) * (PKH * PKW) + (rh // PDH) * PKW + rw // PDW
                    jd64 = _ix(jd, I64)
                    jh64 = _ix(jh, I64)
                    jw64 = _ix(jw, I64)
                    w_row = n64 * w_sn + jd64 * w_sd + jh64 * w_sh + jw64 * w_sw
                    g_row = n64 * s_n + jd64 * s_d + jh64 * s_h + jw64 * s_w
                    win = tl.load(win_ptr + (w_row + w_col), mask=hit & c_ok, other=-1)
                    take = (win.to(tl.int32) == widx) & hit & c_ok
                    acc += tl.load(ptr + (g_row + g_col), mask=take, other=0.0).to(tl.float32)
        return acc


# --------------------------------------------------------------------------------------------------
# Input gradient
# --------------------------------------------------------------------------------------------------


def _dgrad_configs() -> list[triton.Config]:
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
def _dgrad_kernel(
    g_ptr, win_ptr, w_ptr, tab_ptr, cnt_ptr, dx_ptr,
    CI_G, CO_G, NTAP_MAX, ID, IH, IW, OD, OH, OW, JD, JH, JW, MAXT, num_c_blocks,
    x_sn, x_sc, x_sd, x_sh, x_sw,
    g_sn, g_sc, g_sd, g_sh, g_sw,
    v_sn, v_sc, v_sd, v_sh, v_sw,
    w_s_grp, w_s_out, w_s_red,
    XSD: tl.constexpr, XSH: tl.constexpr, XSW: tl.constexpr,
    GSD: tl.constexpr, GSH: tl.constexpr, GSW: tl.constexpr,
    POOLED: tl.constexpr, G_CL: tl.constexpr, X_CL: tl.constexpr,
    PKD: tl.constexpr, PKH: tl.constexpr, PKW: tl.constexpr,
    PSD: tl.constexpr, PSH: tl.constexpr, PSW: tl.constexpr,
    PPD: tl.constexpr, PPH: tl.constexpr, PPW: tl.constexpr,
    PDD: tl.constexpr, PDH: tl.constexpr, PDW: tl.constexpr,
    NJD: tl.constexpr, NJH: tl.constexpr, NJW: tl.constexpr,
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
            a = _load_at(
                g_ptr, win_ptr, n64, o_d[:, None], o_h[:, None], o_w[:, None], m_ok[:, None], g_ch[None, :],
                co_ok[None, :], OD, OH, OW, JD, JH, JW, g_sn, g_sc, g_sd, g_sh, g_sw, v_sn, v_sc, v_sd, v_sh, v_sw,
                POOLED, PKD, PKH, PKW, PSD, PSH, PSW, PPD, PPH, PPW, PDD, PDH, PDW, NJD, NJH, NJW, I64,
            )  # fmt: skip
        else:
            a = _load_at(
                g_ptr, win_ptr, n64, o_d[None, :], o_h[None, :], o_w[None, :], m_ok[None, :], g_ch[:, None],
                co_ok[:, None], OD, OH, OW, JD, JH, JW, g_sn, g_sc, g_sd, g_sh, g_sw, v_sn, v_sc, v_sd, v_sh, v_sw,
                POOLED, PKD, PKH, PKW, PSD, PSH, PSW, PPD, PPH, PPW, PDD, PDH, PDW, NJD, NJH, NJW, I64,
            )  # fmt: skip
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


_dgrad_tuned = triton.autotune(
    configs=best_first(_dgrad_configs()),
    key=["CI_G", "CO_G", "MAXT", "NTAP_MAX", "BLOCK_N", "BLOCK_K", "POOLED", "G_CL", "X_CL", "PREC", "I64"],
    cache_results=True,  # tile choices kept in Triton's cache dir across processes
)(_dgrad_kernel)


# --------------------------------------------------------------------------------------------------
# Weight gradient
# --------------------------------------------------------------------------------------------------


def _wgrad_configs() -> list[triton.Config]:
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
def _wgrad_kernel(
    a_ptr, b_ptr, win_ptr, tab_ptr, part_ptr,
    A_G, B_G, KVOL, LINES, SPLIT, PART_NUMEL, lines_per_split, num_a_blocks, num_b_blocks,
    TD, TH, TW, BD, BH, BW, JD, JH, JW,
    a_sn, a_sc, a_sd, a_sh, a_sw,
    b_sn, b_sc, b_sd, b_sh, b_sw,
    v_sn, v_sc, v_sd, v_sh, v_sw,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    G_IS_A: tl.constexpr, A_POOLED: tl.constexpr, B_POOLED: tl.constexpr, A_CL: tl.constexpr, B_CL: tl.constexpr,
    LINE_MODE: tl.constexpr,
    PKD: tl.constexpr, PKH: tl.constexpr, PKW: tl.constexpr,
    PSD: tl.constexpr, PSH: tl.constexpr, PSW: tl.constexpr,
    PPD: tl.constexpr, PPH: tl.constexpr, PPW: tl.constexpr,
    PDD: tl.constexpr, PDH: tl.constexpr, PDW: tl.constexpr,
    NJD: tl.constexpr, NJH: tl.constexpr, NJW: tl.constexpr,
    PREC: tl.constexpr, I64: tl.constexpr,
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
    Rows (``LINE_MODE`` only changes the walk): all W positions of the lines ``(n, td, th)`` numbered ``n*TD*TH + td*TH + th`` in
    ``[split*lines_per_split, (split+1)*lines_per_split) & [0, LINES)``.
    Program ids: 0 -> (group, A block, tap, B block), 1 -> split (so the programs sharing rows run
    together and share them through L2).
    """
    pid0 = tl.program_id(0)
    split = tl.program_id(1)
    bb = pid0 % num_b_blocks
    rest = pid0 // num_b_blocks
    j = rest % KVOL
    rest = rest // KVOL
    ab = rest % num_a_blocks
    grp = rest // num_a_blocks

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
        # NOTE: each is loaded with its memory-contiguous axis last, then transposed if needed.
        b_d = (td * SD + o_d)
        b_h = (th * SH + o_h)
        b_w = (tw * SW + o_w)
        if A_CL:
            at = _load_at(
                a_ptr, win_ptr, n64[:, None], td[:, None], th[:, None], tw[:, None], r_ok[:, None],
                a_ch[None, :], a_ok[None, :], TD, TH, TW, JD, JH, JW,
                a_sn, a_sc, a_sd, a_sh, a_sw, v_sn, v_sc, v_sd, v_sh, v_sw,
                A_POOLED, PKD, PKH, PKW, PSD, PSH, PSW, PPD, PPH, PPW, PDD, PDH, PDW, NJD, NJH, NJW, I64,
            )  # fmt: skip
            at = tl.trans(at)
        else:
            at = _load_at(
                a_ptr, win_ptr, n64[None, :], td[None, :], th[None, :], tw[None, :], r_ok[None, :],
                a_ch[:, None], a_ok[:, None], TD, TH, TW, JD, JH, JW,
                a_sn, a_sc, a_sd, a_sh, a_sw, v_sn, v_sc, v_sd, v_sh, v_sw,
                A_POOLED, PKD, PKH, PKW, PSD, PSH, PSW, PPD, PPH, PPW, PDD, PDH, PDW, NJD, NJH, NJW, I64,
            )  # fmt: skip
        if B_CL:
            bt = _load_at(
                b_ptr, win_ptr, n64[:, None], b_d[:, None], b_h[:, None], b_w[:, None], r_ok[:, None],
                b_ch[None, :], b_ok[None, :], BD, BH, BW, JD, JH, JW,
                b_sn, b_sc, b_sd, b_sh, b_sw, v_sn, v_sc, v_sd, v_sh, v_sw,
                B_POOLED, PKD, PKH, PKW, PSD, PSH, PSW, PPD, PPH, PPW, PDD, PDH, PDW, NJD, NJH, NJW, I64,
            )  # fmt: skip
        else:
            bt = _load_at(
                b_ptr, win_ptr, n64[None, :], b_d[None, :], b_h[None, :], b_w[None, :], r_ok[None, :],
                b_ch[:, None], b_ok[:, None], BD, BH, BW, JD, JH, JW,
                b_sn, b_sc, b_sd, b_sh, b_sw, v_sn, v_sc, v_sd, v_sh, v_sw,
                B_POOLED, PKD, PKH, PKW, PSD, PSH, PSW, PPD, PPH, PPW, PDD, PDH, PDW, NJD, NJH, NJW, I64,
            )  # fmt: skip
            bt = tl.trans(bt)
        if G_IS_A:
            at = at.to(b_ptr.dtype.element_ty)
            bt = bt.to(b_ptr.dtype.element_ty)
        else:
            at = at.to(a_ptr.dtype.element_ty)
            bt = bt.to(a_ptr.dtype.element_ty)
        acc = tl.dot(round_tf32(at, PREC), round_tf32(bt, PREC), acc, input_precision=PREC)
    out = part_ptr + _ix(split, I64) * PART_NUMEL + _ix(a_ch[:, None], I64) * (B_G * KVOL) + (bch * KVOL + j)[None, :]
    tl.store(out, acc, mask=a_ok[:, None] & b_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


_wgrad_tuned = triton.autotune(
    configs=best_first(_wgrad_configs()),
    key=["A_G", "B_G", "KVOL", "LINES", "TW", "SPLIT", "BLOCK_A", "BLOCK_R", "LINE_MODE", "BLOCK_G", "A_POOLED",
         "B_POOLED", "A_CL", "B_CL", "PREC", "I64"],
    cache_results=True,
)(_wgrad_kernel)


def _launcher(tuned, raw, configs: list[triton.Config]):
    """The autotuned kernel, or with ``FUSION_CONV_AUTOTUNE=0`` (deterministic compile times: no
    tile search on a first call) the raw kernel bound to the first config's tile."""
    if environment.measuring():
        return tuned, {}
    first = configs[0]
    return raw, dict(first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)


def conv_output_spatial(
    x_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
) -> list[int]:  # fmt: skip
    """Spatial sizes of ``aten.convolution``'s output."""
    return [conv_output_length(i, k, s, p, d, transposed, op)
            for i, k, s, p, d, op in zip(x_spatial, kernel, stride, padding, dilation, output_padding, strict=True)]


def pooled_spatial(
    spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], ceil_mode: bool,
) -> list[int]:  # fmt: skip
    """PyTorch's max-pool output sizes (``pooling_output_shape``)."""
    return [pool_output_length(size, k, s, p, d, ceil_mode)
            for size, k, s, p, d in zip(spatial, kernel, stride, padding, dilation, strict=True)]


@dataclass(frozen=True)
class _Geometry:
    """Everything the launchers derive from the arguments, lifted to 3 spatial dims."""

    dims: int
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    kernel: list[int]
    out_spatial: list[int]  # conv output (N, C_out, *out_spatial), lifted
    c_out: int
    transposed: bool
    groups: int


def _geometry(
    x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> _Geometry:  # fmt: skip
    dims = x.dim() - 2
    kernel = list(weight.shape[2:])
    out = conv_output_spatial(x.shape[2:], kernel, stride, padding, dilation, transposed, output_padding)
    c_out = weight.shape[1] * groups if transposed else weight.shape[0]
    return _Geometry(
        dims, lift3(stride, 1), lift3(padding, 0), lift3(dilation, 1), lift3(kernel, 1), lift3(out, 1),
        c_out, bool(transposed), int(groups),
    )  # fmt: skip


def _pool_args(grad: Grad, dims: int) -> dict[str, int | bool]:
    if not isinstance(grad, PooledGrad):
        return dict(PKD=1, PKH=1, PKW=1, PSD=1, PSH=1, PSW=1, PPD=0, PPH=0, PPW=0, PDD=1, PDH=1, PDW=1,
                    NJD=1, NJH=1, NJW=1)  # fmt: skip
    k, s, p, d = grad.geometry(dims)
    nj = [cdiv((kk - 1) * dd + 1, ss) for kk, ss, dd in zip(k, s, d, strict=True)]
    return dict(
        PKD=k[0], PKH=k[1], PKW=k[2], PSD=s[0], PSH=s[1], PSW=s[2], PPD=p[0], PPH=p[1], PPW=p[2],
        PDD=d[0], PDH=d[1], PDW=d[2], NJD=nj[0], NJH=nj[1], NJW=nj[2],
    )  # fmt: skip


def _grad_operands(grad: Grad) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int]]:
    """(values, winners, values' lifted strides, winners' lifted strides, pooled lifted spatial)."""
    if isinstance(grad, PooledGrad):
        sizes, strides = lift_5d(grad.g_win)
        return grad.g_win, grad.winner, strides, lift_5d(grad.winner)[1], sizes[2:]
    _, strides = lift_5d(grad)
    return grad, grad, strides, [0] * 5, [1, 1, 1]


def _channels_inner(lifted_strides: Sequence[int], t: torch.Tensor) -> bool:
    """True when channels are the memory-contiguous axis (channels-last), so tiles put them last."""
    return lifted_strides[1] == 1 and t.shape[1] > 1 and math.prod(t.shape[2:]) > 1




def _needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an element offset of one of ``tensors`` may reach 2**31 (offsets then go int64)."""
    return any(element_extent(t) >= 2**31 for t in tensors)




def _block(channels: int, cap: int) -> int:
    """A tl.dot tile dim for ``channels``: a power of 2 in [16, cap] (masked beyond ``channels``)."""
    return max(16, min(cap, next_pow2(max(channels, 1))))


def unsupported_reason(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> str | None:  # fmt: skip
    """None when ``convolution_backward`` and the per-part launchers handle these arguments, else why not.

    Arguments as for ``convolution_backward``.
    """
    if not 3 <= x.dim() <= 5 or weight.dim() != x.dim():
        return f"x and weight must be (N, C, *spatial) with 1 to 3 spatial dims, got {tuple(x.shape)} and {tuple(weight.shape)}"
    dims = x.dim() - 2
    for name, v in (("stride", stride), ("padding", padding), ("dilation", dilation), ("output_padding", output_padding)):
        if len(v) != dims:
            return f"{name} {tuple(v)} must have {dims} entries"
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or min(output_padding) < 0 or groups < 1:
        return f"invalid conv hyper-parameters stride={stride} padding={padding} dilation={dilation} groups={groups}"
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return f"x and weight must share one of {_DTYPES}, got {x.dtype} and {weight.dtype}"
    values = grad.g_win if isinstance(grad, PooledGrad) else grad
    if values.dtype not in _DTYPES:
        return f"the gradient must be fp32/fp16/bf16, got {values.dtype}"
    if _INTERPRET and torch.bfloat16 in (x.dtype, values.dtype):
        return "Triton's interpreter has no bf16"
    tensors = [x, weight, values] + ([grad.winner] if isinstance(grad, PooledGrad) else [])
    if len({t.device for t in tensors}) != 1:
        return f"tensors on several devices: {[str(t.device) for t in tensors]}"
    if x.device.type != "cuda" and not (_INTERPRET and x.device.type == "cpu"):
        return f"Triton kernels need CUDA tensors (or CPU under TRITON_INTERPRET=1), got {x.device}"
    c_in = x.shape[1]
    if transposed:
        if weight.shape[0] != c_in or c_in % groups:
            return f"conv-transpose weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}, groups={groups}"
    elif weight.shape[1] * groups != c_in or weight.shape[0] % groups:
        return f"conv weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}, groups={groups}"
    if not transposed and any(op != 0 for op in output_padding):
        return "output_padding is only for a transposed conv"
    geo = _geometry(x, weight, stride, padding, dilation, transposed, output_padding, groups)
    y_shape = [x.shape[0], geo.c_out, *geo.out_spatial[3 - dims :]]
    if min(y_shape[2:]) < 1:
        return f"empty conv output {y_shape}"
    x_rows = x.shape[0] * math.prod(x.shape[2:])
    y_rows = x.shape[0] * math.prod(y_shape[2:])
    if max(x_rows, y_rows) >= 2**31:
        return f"index range: N x spatial ({x_rows}, {y_rows}) must stay below 2**31"
    if groups * cdiv(c_in // groups, 16) >= 2**16:
        return f"grid range: groups x channel blocks ({groups} groups) must stay below 2**16"
    if not isinstance(grad, PooledGrad):
        if list(grad.shape) != y_shape:
            return f"dense gradient must have the conv output's shape {y_shape}, got {tuple(grad.shape)}"
        return None
    if grad.winner.dtype not in (torch.int8, torch.int32):
        return f"winner must be int8 or int32, got {grad.winner.dtype}"
    if grad.winner.shape != grad.g_win.shape:
        return f"winner {tuple(grad.winner.shape)} and g_win {tuple(grad.g_win.shape)} differ in shape"
    geom = [grad.kernel_size, grad.stride or grad.kernel_size, grad.padding or (0,) * dims, grad.dilation or (1,) * dims]
    if any(len(v) != dims for v in geom):
        return f"pool geometry {grad} does not have {dims} spatial dims"
    k, s, p, d = geom
    if min(k) < 1 or min(s) < 1 or min(d) < 1 or min(p) < 0:
        return f"invalid pool geometry {grad}"
    pooled = pooled_spatial(y_shape[2:], k, s, p, d, grad.ceil_mode)
    if list(grad.g_win.shape) != y_shape[:2] + pooled:
        return (
            f"pooled gradient has shape {tuple(grad.g_win.shape)}, but max-pooling the conv output "
            f"{y_shape} with {grad} gives {y_shape[:2] + pooled}"
        )
    candidates = math.prod(cdiv((kk - 1) * dd + 1, ss) for kk, ss, dd in zip(k, s, d, strict=True))
    if candidates > MAX_CANDIDATE_WINDOWS:
        return f"pool windows overlap {candidates}-fold (> {MAX_CANDIDATE_WINDOWS} unrolled candidates)"
    return None


def _check(grad: Grad, x: torch.Tensor, weight: torch.Tensor, *conv_args) -> None:
    reason = unsupported_reason(grad, x, weight, *conv_args)
    if reason is not None:
        from ..errors import UnsupportedInputError

        raise UnsupportedInputError(f"conv_fused_bwd: {reason} (check unsupported_reason() first)")


def _taps(kernel: Sequence[int]) -> list[tuple[int, int, int]]:
    return [(a, b, c) for a in range(kernel[0]) for b in range(kernel[1]) for c in range(kernel[2])]


@functools.cache  # never evicts: recorded CUDA graphs keep the tables' addresses
def _dgrad_table(
    transposed: bool, kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
    dilation: tuple[int, ...], w_tap_strides: tuple[int, ...], device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The input-grad kernel's per-phase tap table (phases, kvol, 4) and tap counts (phases,), int32.

    Entry ``[r, j]``: weight tap offset (elements) and g offsets (d, h, w) of phase r's j-th tap.
    NOTE: cached per geometry, so that a backward makes no host-to-device copy (a pageable copy
    would stall the host until the stream drains).
    """
    taps = _taps(kernel)
    w_tap = [sum(k * st for k, st in zip(tap, w_tap_strides, strict=True)) for tap in taps]
    s, p, dl = stride, padding, dilation
    if transposed:
        rows = [[(w_tap[t], *(-p[i] + k[i] * dl[i] for i in range(3))) for t, k in enumerate(taps)]]
    else:
        rows = []
        for r in [(a, b, c) for a in range(s[0]) for b in range(s[1]) for c in range(s[2])]:
            rows.append([
                (w_tap[t], *((r[i] + p[i] - k[i] * dl[i]) // s[i] for i in range(3)))
                for t, k in enumerate(taps)
                if all((r[i] + p[i] - k[i] * dl[i]) % s[i] == 0 for i in range(3))
            ])  # fmt: skip
    table = torch.zeros(len(rows), len(taps), 4, dtype=torch.int32)
    for ph, row in enumerate(rows):
        if row:
            table[ph, : len(row)] = torch.tensor(row, dtype=torch.int32)
    counts = torch.tensor([len(row) for row in rows], dtype=torch.int32)
    table, counts = persistent_device_copies([table, counts], device)
    return table, counts


@functools.cache  # never evicts: recorded CUDA graphs keep the table's address
def _wgrad_table(
    kernel: tuple[int, ...], padding: tuple[int, ...], dilation: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """The weight-grad kernel's tap table (kvol, 4) int32: (unused, ``-p + k*dl`` per dim); cached."""
    rows = [(0, *(-padding[i] + k[i] * dilation[i] for i in range(3))) for k in _taps(kernel)]
    return persistent_device_copies([torch.tensor(rows, dtype=torch.int32)], device)[0]


def conv_input_grad(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> torch.Tensor:  # fmt: skip
    """Gradient of ``aten.convolution(x, weight, ...)`` w.r.t. ``x``, from a compact output gradient.

    Args:
      grad: the conv-output gradient ``g``: a dense tensor of the conv output's shape (form a), or a
        ``PooledGrad`` (form b).  Any strides, fp32/fp16/bf16 (converted to x's dtype for the MMA).
      x: the conv input (only its shape, dtype, device and layout are used), (N, C_in, *spatial),
        1 to 3 spatial dims, fp32/fp16/bf16, any strides.
      weight: (C_out, C_in/groups, *k) for a conv, (C_in, C_out/groups, *k) for a transposed conv,
        x's dtype, any strides.
      stride, padding, dilation, transposed, output_padding, groups: as ``aten.convolution``.
    Returns:
      grad_x: ``torch.empty_like(x)`` layout and dtype (fp32 accumulation inside).
    """
    conv_args = (stride, padding, dilation, transposed, output_padding, groups)
    _check(grad, x, weight, *conv_args)
    return _input_grad(grad, x, weight, *conv_args)


def _input_grad(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> torch.Tensor:  # fmt: skip
    """``conv_input_grad`` without the argument check (done once by the caller)."""
    conv_args = (stride, padding, dilation, transposed, output_padding, groups)
    geo = _geometry(x, weight, *conv_args)
    dx = torch.empty_like(x)
    if dx.numel() == 0:
        return dx
    x_sizes, x_strides = lift_5d(dx)
    n, c_in = x_sizes[:2]
    w_sizes, w_strides = lift_5d(weight)
    s = geo.stride
    if transposed:
        ci_g, co_g = c_in // groups, w_sizes[1]
        w_s_grp, w_s_out, w_s_red = ci_g * w_strides[0], w_strides[0], w_strides[1]
        xs, gs = [1, 1, 1], s
    else:
        ci_g, co_g = w_sizes[1], w_sizes[0] // groups
        w_s_grp, w_s_out, w_s_red = co_g * w_strides[0], w_strides[1], w_strides[0]
        xs, gs = s, [1, 1, 1]
    table, counts = _dgrad_table(
        bool(transposed), tuple(geo.kernel), tuple(s), tuple(geo.padding), tuple(geo.dilation),
        tuple(w_strides[2:]), x.device,
    )  # fmt: skip
    kvol, num_phases = table.shape[1], table.shape[0]
    values, winners, g_strides, v_strides, pooled = _grad_operands(grad)
    max_t = math.prod(cdiv(size, step) for size, step in zip(x_sizes[2:], xs, strict=True))
    block_n = _block(ci_g, 16 if _INTERPRET else 128)
    block_k = _block(co_g, 16 if _INTERPRET else 64)
    num_c_blocks = cdiv(ci_g, block_n)

    def grid(meta):
        return (n * num_phases * cdiv(max_t, meta["BLOCK_M"]), groups * num_c_blocks)

    kernel, tile = _launcher(_dgrad_tuned, _dgrad_kernel, _dgrad_configs())
    launch(
        kernel, grid, values, winners, weight, table, counts, dx,
        ci_g, co_g, kvol, *x_sizes[2:], *geo.out_spatial, *pooled, max_t, num_c_blocks,
        *x_strides, *g_strides, *v_strides, w_s_grp, w_s_out, w_s_red,
        XSD=xs[0], XSH=xs[1], XSW=xs[2], GSD=gs[0], GSH=gs[1], GSW=gs[2],
        POOLED=isinstance(grad, PooledGrad), G_CL=_channels_inner(g_strides, values),
        X_CL=_channels_inner(x_strides, dx), **_pool_args(grad, geo.dims), PREC=backward_dot_precision(x.dtype),
        I64=_needs_int64(values, winners, dx, weight),
        BLOCK_N=block_n, BLOCK_K=block_k, **tile,
    )  # fmt: skip
    return dx


def conv_weight_grad(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> torch.Tensor:  # fmt: skip
    """Gradient of ``aten.convolution(x, weight, ...)`` w.r.t. ``weight``, from a compact output gradient.

    Args as ``conv_input_grad`` (here ``x``'s values are read).  The reduction over N x spatial is
    split over programs into fp32 partials ``(splits, *weight.shape)`` that are summed in a fixed
    order afterwards: bitwise reproducible run to run.
    Returns:
      grad_w: ``torch.empty_like(weight)`` layout and dtype.
    """
    conv_args = (stride, padding, dilation, transposed, output_padding, groups)
    _check(grad, x, weight, *conv_args)
    return _weight_grad(grad, x, weight, *conv_args)


def _weight_grad(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> torch.Tensor:  # fmt: skip
    """``conv_weight_grad`` without the argument check (done once by the caller)."""
    conv_args = (stride, padding, dilation, transposed, output_padding, groups)
    geo = _geometry(x, weight, *conv_args)
    dw = torch.empty_like(weight)
    x_sizes, x_strides = lift_5d(x)
    n = x_sizes[0]
    w_sizes = lift_5d(weight)[0]
    a_g, b_g = w_sizes[0] // groups, w_sizes[1]
    s = geo.stride
    table = _wgrad_table(tuple(geo.kernel), tuple(geo.padding), tuple(geo.dilation), x.device)
    kvol = table.shape[0]
    values, winners, g_strides, v_strides, pooled = _grad_operands(grad)
    pooled_form = isinstance(grad, PooledGrad)
    if transposed:  # A = x over x's grid, B = g over the conv output
        a_t, a_strides, b_t, b_strides = x, x_strides, values, g_strides
        t_sizes, b_sizes = x_sizes[2:], geo.out_spatial
    else:  # A = g over the conv output's grid, B = x
        a_t, a_strides, b_t, b_strides = values, g_strides, x, x_strides
        t_sizes, b_sizes = geo.out_spatial, x_sizes[2:]
    rows = n * math.prod(t_sizes)
    if dw.numel() == 0:
        return dw
    if rows == 0:
        return dw.zero_()
    block_a = _block(a_g, 16 if _INTERPRET else 128)
    block_g = _block(b_g, 16 if _INTERPRET else 128)
    num_a_blocks = cdiv(a_g, block_a)
    num_b_blocks = cdiv(b_g, block_g)
    tiles = groups * num_a_blocks * kvol * num_b_blocks
    # NOTE: about 4 waves of programs on an H100 (132 SMs), each reducing >= 1024 rows; a step
    # covers BLOCK_R positions of one W line (masked beyond TW, so narrow W wastes lanes).
    tw = t_sizes[2]
    # NOTE: 64 fp32 rows keep 3 pipeline stages of 64-channel tiles at 96 KB of shared memory (two
    # programs per SM on an H100); 16-bit tiles are half the size, so 128 rows.
    cap = 16 if _INTERPRET else (128 if x.element_size() == 2 else 64)
    block_r = max(16, min(cap, next_pow2(tw)))
    line_mode = tw >= 0.75 * cdiv(tw, block_r) * block_r  # few masked lanes per W block
    if not line_mode:
        block_r = 32 if _INTERPRET else 64
    lines = n * t_sizes[0] * t_sizes[1]
    min_rows, target = (16, 8) if _INTERPRET else (1024, 4 * 132)
    splits = max(1, min(cdiv(target, tiles), cdiv(lines, cdiv(min_rows, t_sizes[2]))))
    lines_per_split = cdiv(lines, splits)
    splits = cdiv(lines, lines_per_split)
    part_numel = w_sizes[0] * b_g * kvol
    partials = torch.empty(splits, part_numel, dtype=torch.float32, device=x.device)

    grid = (tiles, splits)

    kernel, tile = _launcher(_wgrad_tuned, _wgrad_kernel, _wgrad_configs())
    launch(
        kernel, grid, a_t, b_t, winners, table, partials,
        a_g, b_g, kvol, lines, splits, part_numel, lines_per_split, num_a_blocks, num_b_blocks,
        *t_sizes, *b_sizes, *pooled, *a_strides, *b_strides, *v_strides,
        SD=s[0], SH=s[1], SW=s[2], G_IS_A=not transposed,
        A_POOLED=pooled_form and not transposed, B_POOLED=pooled_form and transposed,
        A_CL=_channels_inner(a_strides, a_t), B_CL=_channels_inner(b_strides, b_t),
        **_pool_args(grad, geo.dims), PREC=backward_dot_precision(x.dtype), BLOCK_A=block_a, BLOCK_G=block_g,
        BLOCK_R=block_r, LINE_MODE=line_mode,
        I64=_needs_int64(values, winners, x, partials), **tile,
    )  # fmt: skip
    # NOTE: torch's sum over a fixed shape runs in a fixed order (no atomics): reproducible.
    dw.copy_(partials.sum(0).view(weight.shape))
    return dw


def conv_bias_grad(grad: Grad) -> torch.Tensor:
    """fp32 (C_out,) per-channel sum of the conv-output gradient, from the compact form.

    With a ``PooledGrad`` every window adds its ``g_win`` to exactly one conv-output position, so
    the sum of ``g`` is the sum of ``g_win``.  Deterministic (fixed-order torch reduction).
    """
    values = grad.g_win if isinstance(grad, PooledGrad) else grad
    return values.sum([d for d in range(values.dim()) if d != 1], dtype=torch.float32)


def backward_plan(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    output_mask: Sequence[bool] = (True, True),
) -> Callable[[Grad, torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]]:
    """``(grad, x, weight) -> (grad_x, grad_w)`` for tensors laid out like these (the same API as
    ``conv_shift_bwd.backward_plan``): ``convolution_backward`` without the bias.  The arguments
    are checked here; each call runs ``convolution_backward``'s launchers."""
    conv_args = (stride, padding, dilation, transposed, output_padding, groups)
    _check(grad, x, weight, *conv_args)
    need_x, need_w = bool(output_mask[0]), bool(output_mask[1])

    def run(grad: Grad, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (_input_grad(grad, x, weight, *conv_args) if need_x else None,
                _weight_grad(grad, x, weight, *conv_args) if need_w else None)  # fmt: skip

    return run


def convolution_backward(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    output_mask: Sequence[bool] = (True, True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Drop-in for ``aten.convolution_backward`` (without ``bias_sizes``) taking a compact gradient.

    Returns ``(grad_x, grad_w, grad_b)``, None where ``output_mask`` is False: grad_x like
    ``empty_like(x)``, grad_w like ``empty_like(weight)``, grad_b (C_out,) in weight's dtype.
    Raises ``UnsupportedInputError`` when ``unsupported_reason(...)`` is not None.
    """
    run = backward_plan(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask[:2])
    gx, gw = run(grad, x, weight)
    gb = conv_bias_grad(grad).to(weight.dtype) if output_mask[2] else None
    return gx, gw, gb
