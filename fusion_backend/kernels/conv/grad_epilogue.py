"""Device side of the dgrad kernel's store: one ``[BLOCK_M, BLOCK_N]`` tile of ``grad_a`` (the gradient
of the conv's input, which the forward's prologue produced as ``a = act_in(z)``, ``z = prologue(x_prev)``)
through the backward hooks, stored channels-last, and its BatchNorm-backward partial sums.

Order (per element, fp32 from the fp32 accumulator; one rounding, at the store)::

    v = acc                                         grad_a
    x = x_prev[m, c]                                (ACT or SUMS: the saved pre-prologue input)
    z = prologue(x)                                 (ACT: ``prologue.normalise``, the forward's own code)
    v = v * act_in'(z)                              (ACT: ``chain_math.step_backward``: torch's
                                                     conventions, relu'(0) = 0, leaky'(0) = slope)
    out[m, c] = round(v)                            grad_z (grad_a without ACT)
    SUMS: per channel, over the tile's rows, of the stored round(v):
          Σ grad_z  and  Σ grad_z · x̂,  x̂ = (x - mean[c]) * rstd[c]

The sums are of the value *written* (as the forward's statistics are): the BatchNorm backward that
consumes them combines them with that stored ``grad_z``.  Rows past ``M`` and channels past the group's
count contribute nothing.  Each program writes its M tile's row of ``(2, M_TILES, C)`` partials; no two
programs write the same element and there are no atomics, so the host's fixed-order sum over the tiles
(``stats.reduce_grad_partials``) is bitwise reproducible run to run.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..chain_math import step_backward
from .prologue import normalise


@triton.jit
def load_saved_input(m_ok, n, d, h, w, c, c_ok, xp_ptr, xp_sn, xp_sd, xp_sh, xp_sw,
                     ACT: tl.constexpr, SUMS: tl.constexpr, BIG: tl.constexpr):  # fmt: skip
    """x_prev's ``[BLOCK_M, BLOCK_N]`` tile for :func:`store_grad_tile`, in x_prev's dtype (0 outside ``m_ok`` x
    ``c_ok``); a zero scalar where the hooks read none (neither ACT nor SUMS).  Rows and columns as
    :func:`store_grad_tile`'s (``d, h, w`` the rows' coordinates; element ``(n, c, d, h, w)`` of x_prev at
    ``n * xp_sn + d * xp_sd + h * xp_sh + w * xp_sw + c``).  A read apart from the store, whose tile a kernel
    with its own addressing passes instead (the TMA kernel's dense rows)."""
    if ACT != 0 or SUMS:
        if BIG:
            xrow = n.to(tl.int64) * xp_sn + d.to(tl.int64) * xp_sd + h.to(tl.int64) * xp_sh + w.to(tl.int64) * xp_sw
        else:
            xrow = n * xp_sn + d * xp_sd + h * xp_sh + w * xp_sw
        return tl.load(xp_ptr + xrow[:, None] + c[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0)
    else:
        return 0.0


@triton.jit
def store_grad_tile(acc, x_saved, m, m_ok, n, c, c_ok, pid_m, out_ptr, part_ptr, mean_ptr, rstd_ptr,
                    p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope, C_IN, M_TILES,
                    PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr,
                    ACT: tl.constexpr, SUMS: tl.constexpr, BIG: tl.constexpr):  # fmt: skip
    """Finish and store one tile (module docstring for the order).

    acc       fp32 ``[BLOCK_M, BLOCK_N]`` grad_a: rows ``m`` (input positions, ``m_ok``: ``< M``; ``n`` their
              sample), columns ``c`` (input channels, ``c_ok``: real ones of this group).
    x_saved   ACT or SUMS: :func:`load_saved_input`'s tile of x_prev (N, C_IN, D, H, W), channel stride 1.
    out_ptr   the result, channels-last dense: element ``(m, c)`` at ``m * C_IN + c``, its dtype stored.
    p0..p3    ACT: the forward's prologue vectors (``prologue.normalise``; PROLOGUE 0: ``z = x_prev``).
    mean_ptr, rstd_ptr: SUMS: fp32 ``(C_IN,)``.
    part_ptr  SUMS: fp32 ``(2, M_TILES, C_IN)`` contiguous: ``[0, pid_m, c]`` Σ grad_z, ``[1, pid_m, c]``
              Σ grad_z · x̂ over the tile's rows.
    slope     ACT leaky_relu's negative slope.  BIG: int64 element offsets.
    Returns the stored values (the output dtype; a caller summing its own BatchNorm-backward sums of them).
    """
    if BIG:
        m = m.to(tl.int64)
        pid_m = pid_m.to(tl.int64)
    mask = m_ok[:, None] & c_ok[None, :]
    v = acc
    if ACT != 0 or SUMS:
        x = x_saved.to(tl.float32)
    if ACT != 0:
        z = normalise(x, n, c, mask, c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN, PROLOGUE, G_NORM, NORM_AFFINE)
        v, _ = step_backward(v, z, slope, 0.0, ACT)
    y = v.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m[:, None] * C_IN + c[None, :], y, mask=mask)
    if SUMS:
        gz = tl.where(mask, y.to(tl.float32), 0.0)
        mean = tl.load(mean_ptr + c, mask=c_ok, other=0.0)
        rstd = tl.load(rstd_ptr + c, mask=c_ok, other=0.0)
        xhat = (x - mean[None, :]) * rstd[None, :]
        tl.store(part_ptr + pid_m * C_IN + c, tl.sum(gz, axis=0), mask=c_ok)
        tl.store(part_ptr + (M_TILES + pid_m) * C_IN + c, tl.sum(gz * xhat, axis=0), mask=c_ok)
    return y
