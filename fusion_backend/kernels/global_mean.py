"""Triton kernels of the ``conv_global_mean`` fused op: one pass over x forward, one pass over grad_x backward.

What the kernels compute
------------------------
The op (``fusion_backend.ops.conv_global_mean``) reduces the mean over all output positions of a
convolution to sums of the input over a few *index sets*.  Per spatial dim the host computes the
distinct sets of input indices that the kernel taps touch (an arithmetic progression per tap, see the
op module) and encodes them as a bit table: ``bits_dim[i]`` has bit ``j`` set iff input index ``i`` of
that dim belongs to set ``j``.  A set of the full nd problem is a product ``(j1, j2, j3)`` of one set
per dim (dims are padded in front to three with trivial size-1 dims, whose one set is ``{0}``).

* ``_set_sums_kernel`` (forward): for every plane ``(n, c)`` and every set triple,
  ``R[n, c, j1, j2, j3] = sum over i in set1[j1] x set2[j2] x set3[j3] of x[n, c, i]`` -- reading x
  exactly once.
* ``_set_broadcast_kernel`` (backward): the adjoint,
  ``grad_x[n, c, i] = sum over (j1, j2, j3) with i in the product set of Q[n, c, j1, j2, j3]``.

Both work on a plane viewed as ``rows x W`` with ``rows = D*H``: a tile is ``BLOCK_A`` rows by
``BLOCK_W`` columns.  Membership is separable, so the inner dim costs ``J3`` masked row-reductions
(or broadcasts) of the tile, and the two outer dims are handled once per row as a
``[J12_PAD, BLOCK_A]`` mask (``J12 = J1*J2``), never a per-element loop over all ``J1*J2*J3`` sets.

Determinism: no atomics.  A plane may be split into ``SPLIT`` row ranges (for parallelism when there
are few planes); each split writes its own partial row of the output and the launcher sums the splits
in a fixed order.

Measured on an H100 (torch 2.11, triton 3.6) at the size of the ``seeds`` suite's ConvTranspose2d
64->128 k3 pipeline, x (16, 64, 512, 512) fp32 with one set per dim: ``_set_sums_kernel`` 0.36 ms
(~3 TB/s of x), ``_set_broadcast_kernel`` 0.34 ms; with three sets per dim (a padded "same" conv)
0.59 / 0.46 ms.  channels_last x read by the plane kernel (strided loads along W) took 2.7 ms:
``_set_sums_cl_kernel`` / ``_grad_broadcast_cl_kernel`` now tile ``positions x channels`` so each tile
row is a contiguous run of channels (not yet timed on a GPU).

The fused op's pipeline (``set_sums_partial`` -> ``contract_forward`` forward, ``params_backward`` ->
``grad_broadcast`` backward) is one launch per launcher: the split partials are reduced inside
``_contract_fwd_kernel``, and grad_x's per-set coefficients are formed in ``_set_broadcast_kernel``'s
prologue (``FROM_GRAD``) from ``G`` and the weight.  ``set_sums`` / ``set_broadcast`` remain as the
plain building blocks (tests use them).

The launchers take 5-D views ``(N, C, D, H, W)`` (1-d and 2-d problems unsqueezed in front) with any
strides, so channels_last inputs are read in place.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from .host import cdiv, next_pow2
from .launch import FastLaunch

#: Largest number of distinct index sets per spatial dim (bits of an int32 table entry).
MAX_SETS_PER_DIM = 31

# NOTE: tile sizes.  ~4096 elements per tile (16 KB of fp32) with 4 warps keeps 32 elements per
# thread in flight: enough to stream x at close to HBM bandwidth while the per-tile mask work (J3
# masked reductions plus a J12_PAD x BLOCK_A mask) stays well below the memory time.
_TILE_ELEMENTS = 4096
_MAX_BLOCK_W = 256
_NUM_WARPS = 4
# Programs to aim for per SM when choosing how many row-splits a plane gets.
_PROGRAMS_PER_SM = 4


def _tile_shape(rows: int, width: int) -> tuple[int, int]:
    block_w = min(next_pow2(width), _MAX_BLOCK_W)
    block_a = min(next_pow2(rows), max(1, _TILE_ELEMENTS // block_w))
    return block_a, block_w


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _choose_split(
    planes: int, rows: int, block_a: int, device: torch.device, split: int | None
) -> tuple[int, int]:
    """Return ``(split, rows_per_split)``; ``rows_per_split`` is a multiple of ``block_a``."""
    row_tiles = cdiv(rows, block_a)
    if split is None:
        if device.type == "cuda":
            split = cdiv(_PROGRAMS_PER_SM * _sm_count(device), max(planes, 1))
        else:
            split = 1  # the interpreter runs programs one after another: parallelism buys nothing
    split = max(1, min(int(split), row_tiles))
    rows_per_split = cdiv(row_tiles, split) * block_a
    return cdiv(rows, rows_per_split), rows_per_split


@triton.jit
def _row_set_mask(
    rows, row_ok, bits_d_ptr, bits_h_ptr, H, J1: tl.constexpr, J2: tl.constexpr, J12_PAD: tl.constexpr
):
    """``[J12_PAD, BLOCK_A]`` mask: entry (j1*J2 + j2, r) is set iff row r = d*H + h has d in set j1 of
    dim D and h in set j2 of dim H (padding entries j12 >= J1*J2 are never set)."""
    d = rows // H
    h = rows - d * H
    bd = tl.load(bits_d_ptr + d, mask=row_ok, other=0)
    bh = tl.load(bits_h_ptr + h, mask=row_ok, other=0)
    j12 = tl.arange(0, J12_PAD)
    valid = j12 < J1 * J2
    # NOTE: clamp the shift amounts of the padding entries so that no shift reaches 32 bits.
    j1 = tl.where(valid, j12 // J2, 0)
    j2 = tl.where(valid, j12 % J2, 0)
    in1 = ((bd[None, :] >> j1[:, None]) & 1) != 0
    in2 = ((bh[None, :] >> j2[:, None]) & 1) != 0
    return in1 & in2 & valid[:, None] & row_ok[None, :]


@triton.jit
def _tap_coef(
    g_ptr, w_ptr, n, ci, ci_ok, t, CIN_G, COUT_G, C_OUT, s_co, s_ci, s_t, off_g, BLOCK_CO: tl.constexpr
):
    """``[BLOCK_C]``: ``sum over co in the group of ci of G[n, co] * W(ci, co, t)`` for a vector ``ci``.

    ``g_ptr``: contiguous fp32 ``(N, C_OUT)``.  ``w_ptr``: the conv weight (any float dtype); element
    ``(ci, co, t)`` (``t`` the flattened tap) lives at ``co*s_co + ci*s_ci - group*off_g + t*s_t``
    (this covers both layouts: regular ``(C_out, C_in/g, *k)`` and transposed ``(C_in, C_out/g, *k)``).
    """
    gi = ci // CIN_G
    acc = tl.zeros(ci.shape, dtype=tl.float32)
    for co0 in range(0, COUT_G, BLOCK_CO):
        col = co0 + tl.arange(0, BLOCK_CO)
        m = ci_ok[:, None] & (col < COUT_G)[None, :]
        co = gi[:, None] * COUT_G + col[None, :]
        w_off = co.to(tl.int64) * s_co + (ci.to(tl.int64) * s_ci - gi.to(tl.int64) * off_g)[:, None] + t * s_t
        w = tl.load(w_ptr + w_off, mask=m, other=0.0).to(tl.float32)
        gv = tl.load(g_ptr + n.to(tl.int64) * C_OUT + co, mask=m, other=0.0)
        acc += tl.sum(w * gv, axis=1)
    return acc


@triton.jit
def _set_sums_kernel(
    x_ptr,
    bits_d_ptr,
    bits_h_ptr,
    bits_w_ptr,
    out_ptr,
    C,
    H,
    W,
    rows,
    rows_per_split,
    stride_xn,
    stride_xc,
    stride_xd,
    stride_xh,
    stride_xw,
    J1: tl.constexpr,
    J2: tl.constexpr,
    J3: tl.constexpr,
    J12_PAD: tl.constexpr,
    J3_PAD: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Per-plane sums of x over every product of per-dim index sets (forward pass; reads x once).

    Grid: ``(N*C, SPLIT)``; program ``(p, s)`` reduces rows ``[s*rows_per_split, (s+1)*rows_per_split)``
    of plane ``p = n*C + c``.

    Pointer contract:
      * ``x_ptr``: x as a 5-D ``(N, C, D, H, W)`` tensor of fp32/fp16/bf16 with element strides
        ``stride_x{n,c,d,h,w}`` (any layout; channels_last included); ``rows = D*H``.
      * ``bits_{d,h,w}_ptr``: contiguous int32 of length D, H, W; bit ``j`` of entry ``i`` set iff
        index ``i`` is in set ``j`` of that dim (``j < J1``, ``J2``, ``J3`` respectively, all <= 31).
      * ``out_ptr``: contiguous fp32 ``(N*C, SPLIT, J1*J2*J3)`` with ``SPLIT`` the grid's second dim; entry ``(p, s, (j1*J2 + j2)*J3 + j3)``
        receives this program's partial sum.  Accumulation is fp32.
    """
    plane = tl.program_id(0)
    split = tl.program_id(1)
    n = plane // C
    c = plane - n * C
    base = x_ptr + n.to(tl.int64) * stride_xn + c.to(tl.int64) * stride_xc

    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, rows)
    j3v = tl.arange(0, J3_PAD)
    acc = tl.zeros([J12_PAD, J3_PAD], dtype=tl.float32)

    for a0 in range(row_start, row_end, BLOCK_A):
        r = a0 + tl.arange(0, BLOCK_A)
        row_ok = r < row_end
        mask12 = _row_set_mask(r, row_ok, bits_d_ptr, bits_h_ptr, H, J1, J2, J12_PAD)
        d = r // H
        row_off = d.to(tl.int64) * stride_xd + (r - d * H).to(tl.int64) * stride_xh
        for w0 in range(0, W, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            col_ok = cols < W
            bw = tl.load(bits_w_ptr + cols, mask=col_ok, other=0)
            ptrs = base + row_off[:, None] + cols.to(tl.int64)[None, :] * stride_xw
            xt = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            for j3 in tl.static_range(J3):
                in3 = ((bw >> j3) & 1) != 0
                row_sums = tl.sum(tl.where(in3[None, :], xt, 0.0), axis=1)  # [BLOCK_A]
                part = tl.sum(tl.where(mask12, row_sums[None, :], 0.0), axis=1)  # [J12_PAD]
                acc += tl.where(j3v[None, :] == j3, part[:, None], 0.0)

    j12v = tl.arange(0, J12_PAD)
    out_ptrs = (
        out_ptr
        + (plane.to(tl.int64) * tl.num_programs(1) + split) * (J1 * J2 * J3)
        + j12v[:, None] * J3
        + j3v[None, :]
    )
    tl.store(out_ptrs, acc, mask=(j12v[:, None] < J1 * J2) & (j3v[None, :] < J3))


@triton.jit
def _set_broadcast_kernel(
    q_ptr,
    bits_d_ptr,
    bits_h_ptr,
    bits_w_ptr,
    out_ptr,
    C,
    H,
    W,
    rows,
    rows_per_split,
    stride_on,
    stride_oc,
    stride_od,
    stride_oh,
    stride_ow,
    g_ptr,
    w_ptr,
    tapset_ptr,
    T,
    CIN_G,
    COUT_G,
    C_OUT,
    s_co,
    s_ci,
    s_t,
    off_g,
    J1: tl.constexpr,
    J2: tl.constexpr,
    J3: tl.constexpr,
    J12_PAD: tl.constexpr,
    J3_PAD: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_W: tl.constexpr,
    FROM_GRAD: tl.constexpr,
    BLOCK_CO: tl.constexpr,
):
    """Adjoint of ``_set_sums_kernel``: ``out[n, c, i] = sum of q[n, c, j] over the sets j containing i``.

    Grid: ``(N*C, SPLIT)``; program ``(p, s)`` writes rows ``[s*rows_per_split, ...)`` of plane ``p``.
    Every output element is written exactly once (no accumulation into memory).

    Pointer contract:
      * ``q_ptr``: contiguous fp32 ``(N*C, J1*J2*J3)``, set index ``(j1*J2 + j2)*J3 + j3``; unused when
        ``FROM_GRAD``: then each program computes its plane's coefficients in a prologue,
        ``q[n, ci, j] = sum over taps t of set j, co of ci's group of G[n, co] * W(ci, co, t)``
        (see ``_tap_coef`` for the ``g_ptr``/``w_ptr``/``tapset_ptr`` contract).
      * ``bits_{d,h,w}_ptr``: as in ``_set_sums_kernel``.
      * ``out_ptr``: 5-D ``(N, C, D, H, W)`` output of fp32/fp16/bf16 with element strides
        ``stride_o{n,c,d,h,w}``; values are computed in fp32 and cast to the element type on store.
    """
    plane = tl.program_id(0)
    split = tl.program_id(1)
    n = plane // C
    c = plane - n * C
    base = out_ptr + n.to(tl.int64) * stride_on + c.to(tl.int64) * stride_oc

    j12v = tl.arange(0, J12_PAD)
    j3v = tl.arange(0, J3_PAD)
    if FROM_GRAD:
        ci = tl.full([1], 0, tl.int32) + c
        q = tl.zeros([J12_PAD, J3_PAD], dtype=tl.float32)
        for t in range(T):
            coef = tl.sum(
                _tap_coef(g_ptr, w_ptr, n, ci, ci < C, t, CIN_G, COUT_G, C_OUT, s_co, s_ci, s_t, off_g, BLOCK_CO),
                axis=0,
            )
            jt = tl.load(tapset_ptr + t)
            hit = (j12v[:, None] == jt // J3) & (j3v[None, :] == jt % J3)
            q += tl.where(hit, coef, 0.0)
    else:
        q_ptrs = q_ptr + plane.to(tl.int64) * (J1 * J2 * J3) + j12v[:, None] * J3 + j3v[None, :]
        q = tl.load(q_ptrs, mask=(j12v[:, None] < J1 * J2) & (j3v[None, :] < J3), other=0.0)  # [J12_PAD, J3_PAD]

    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, rows)
    for a0 in range(row_start, row_end, BLOCK_A):
        r = a0 + tl.arange(0, BLOCK_A)
        row_ok = r < row_end
        mask12 = _row_set_mask(r, row_ok, bits_d_ptr, bits_h_ptr, H, J1, J2, J12_PAD)
        d = r // H
        row_off = d.to(tl.int64) * stride_od + (r - d * H).to(tl.int64) * stride_oh
        for w0 in range(0, W, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            col_ok = cols < W
            bw = tl.load(bits_w_ptr + cols, mask=col_ok, other=0)
            val = tl.zeros([BLOCK_A, BLOCK_W], dtype=tl.float32)
            for j3 in tl.static_range(J3):
                q_col = tl.sum(tl.where(j3v[None, :] == j3, q, 0.0), axis=1)  # [J12_PAD]
                row_coef = tl.sum(tl.where(mask12, q_col[:, None], 0.0), axis=0)  # [BLOCK_A]
                in3 = ((bw >> j3) & 1) != 0
                val += tl.where(in3[None, :], row_coef[:, None], 0.0)
            ptrs = base + row_off[:, None] + cols.to(tl.int64)[None, :] * stride_ow
            tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: bit tables already checked, keyed by their ids with the sizes and device they were checked for; the
#: value keeps the tables alive so that an id is never reused while its entry exists.  The op's tables
#: are cached per geometry and never freed, so this stays as small as that cache.
_CHECKED_TABLES: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}


def _check_launch(
    name: str, t: torch.Tensor, bits: tuple[torch.Tensor, ...], sets: tuple[int, int, int]
) -> None:
    """Validate a pass launch; the bit tables only the first time they are seen with these sizes (the
    launch runs on every step of a host-bound training loop)."""
    if t.dim() != 5:
        raise ValueError(f"{name}: expected a 5-D (N, C, D, H, W) tensor, got shape {tuple(t.shape)}")
    if t.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} has no kernel (supported: {_KERNEL_DTYPES})")
    key = (*map(id, bits), *sets, *t.shape[2:], t.device)
    if key in _CHECKED_TABLES:
        return
    _check_tables(name, t, bits, sets)
    _CHECKED_TABLES[key] = tuple(bits)


def _check_tables(
    name: str, t: torch.Tensor, bits: tuple[torch.Tensor, ...], sets: tuple[int, int, int]
) -> None:
    if len(bits) != 3 or len(sets) != 3:
        raise ValueError(
            f"{name}: expected three bit tables and three set counts, got {len(bits)}, {len(sets)}"
        )
    for dim, (table, count, size) in enumerate(zip(bits, sets, t.shape[2:], strict=True)):
        if (
            table.dtype != torch.int32
            or table.dim() != 1
            or table.numel() != size
            or not table.is_contiguous()
        ):
            raise ValueError(
                f"{name}: bit table of dim {dim} must be contiguous int32 of length {size}, got "
                f"{table.dtype} shape {tuple(table.shape)}"
            )
        if table.device != t.device:
            raise ValueError(f"{name}: bit table on {table.device}, tensor on {t.device}")
        if not 1 <= count <= MAX_SETS_PER_DIM:
            raise ValueError(
                f"{name}: dim {dim} has {count} index sets; the kernel supports 1..{MAX_SETS_PER_DIM}"
            )


def set_sums(
    x5: torch.Tensor,
    bits: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sets: tuple[int, int, int],
    split: int | None = None,
) -> torch.Tensor:
    """Sums of each ``(n, c)`` plane of ``x5`` over every product of per-dim index sets.

    Args:
        x5: ``(N, C, D, H, W)`` fp32/fp16/bf16, any strides.
        bits: per-dim int32 bit tables of lengths ``D``, ``H``, ``W`` (see the module docstring).
        sets: ``(J1, J2, J3)``, the number of sets of each dim.
        split: row-splits per plane; ``None`` picks one from the device's SM count.

    Returns:
        fp32 ``(N, C, J1*J2*J3)`` contiguous, set index ``(j1*J2 + j2)*J3 + j3``.
    """
    _check_launch("set_sums", x5, bits, sets)
    n, c, d, h, w = x5.shape
    j1, j2, j3 = sets
    planes, rows = n * c, d * h
    if planes == 0 or rows * w == 0:
        return torch.zeros((n, c, j1 * j2 * j3), dtype=torch.float32, device=x5.device)
    block_a, block_w = _tile_shape(rows, w)
    nsplit, rows_per_split = _choose_split(planes, rows, block_a, x5.device, split)
    partial = torch.empty((planes, nsplit, j1 * j2 * j3), dtype=torch.float32, device=x5.device)
    _set_sums_kernel[(planes, nsplit)](
        x5,
        bits[0],
        bits[1],
        bits[2],
        partial,
        c,
        h,
        w,
        rows,
        rows_per_split,
        *x5.stride(),
        J1=j1,
        J2=j2,
        J3=j3,
        J12_PAD=next_pow2(j1 * j2),
        J3_PAD=next_pow2(j3),
        BLOCK_A=block_a,
        BLOCK_W=block_w,
        num_warps=_NUM_WARPS,
    )
    # NOTE: a fixed-order reduction over the splits keeps the result bitwise reproducible.
    out = partial[:, 0] if nsplit == 1 else partial.sum(dim=1)
    return out.view(n, c, j1 * j2 * j3)


def set_broadcast(
    q: torch.Tensor,
    bits: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sets: tuple[int, int, int],
    out: torch.Tensor,
    split: int | None = None,
) -> torch.Tensor:
    """Write ``out[n, c, i] = sum of q[n, c, j] over the product sets j that contain i``; returns ``out``.

    Args:
        q: ``(N, C, J1*J2*J3)`` coefficients (converted to contiguous fp32 here; it is tiny).
        bits, sets: as in ``set_sums``; ``bits`` lengths are ``out``'s ``D``, ``H``, ``W``.
        out: ``(N, C, D, H, W)`` fp32/fp16/bf16 destination, any strides; fully overwritten.
        split: row-splits per plane; ``None`` picks one from the device's SM count.
    """
    _check_launch("set_broadcast", out, bits, sets)
    n, c, d, h, w = out.shape
    j1, j2, j3 = sets
    if tuple(q.shape) != (n, c, j1 * j2 * j3):
        raise ValueError(f"set_broadcast: q must have shape {(n, c, j1 * j2 * j3)}, got {tuple(q.shape)}")
    planes, rows = n * c, d * h
    if planes == 0 or rows * w == 0:
        return out
    q32 = q.to(device=out.device, dtype=torch.float32).contiguous()
    block_a, block_w = _tile_shape(rows, w)
    nsplit, rows_per_split = _choose_split(planes, rows, block_a, out.device, split)
    _set_broadcast_kernel[(planes, nsplit)](
        q32,
        bits[0],
        bits[1],
        bits[2],
        out,
        c,
        h,
        w,
        rows,
        rows_per_split,
        *out.stride(),
        q32,  # g_ptr, w_ptr, tapset_ptr: unused without FROM_GRAD
        q32,
        bits[0],
        *(0,) * 8,
        J1=j1,
        J2=j2,
        J3=j3,
        J12_PAD=next_pow2(j1 * j2),
        J3_PAD=next_pow2(j3),
        BLOCK_A=block_a,
        BLOCK_W=block_w,
        FROM_GRAD=False,
        BLOCK_CO=1,
        num_warps=_NUM_WARPS,
    )
    return out


# --------------------------------------------------------------------------------------------------
# Channels-last variants: a program owns a block of channels and a range of spatial positions, so
# every tile row is a contiguous run of channels (full-bandwidth loads/stores).
# --------------------------------------------------------------------------------------------------


@triton.jit
def _position_bits(p, p_ok, bits_d_ptr, bits_h_ptr, bits_w_ptr, H, W):
    hw = H * W
    d = p // hw
    rem = p - d * hw
    h = rem // W
    w = rem - h * W
    bd = tl.load(bits_d_ptr + d, mask=p_ok, other=0)
    bh = tl.load(bits_h_ptr + h, mask=p_ok, other=0)
    bw = tl.load(bits_w_ptr + w, mask=p_ok, other=0)
    return bd, bh, bw


@triton.jit
def _set_sums_cl_kernel(
    x_ptr,
    bits_d_ptr,
    bits_h_ptr,
    bits_w_ptr,
    out_ptr,
    C,
    H,
    W,
    P,
    p_per_split,
    stride_xn,
    stride_xc,
    stride_xp,
    J1: tl.constexpr,
    J2: tl.constexpr,
    J3: tl.constexpr,
    J_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Channels-last ``_set_sums_kernel``: same sums, x read as ``(N, P = D*H*W, C)`` rows of channels.

    Grid: ``(N, cdiv(C, BLOCK_C), SPLIT)``; program ``(n, cb, s)`` reduces positions
    ``[s*p_per_split, (s+1)*p_per_split)`` for channels ``[cb*BLOCK_C, ...)``.

    Pointer contract:
      * ``x_ptr``: fp32/fp16/bf16; element ``(n, c, p)`` at ``n*stride_xn + c*stride_xc + p*stride_xp``
        where ``p = (d*H + h)*W + w`` (valid for channels_last / channels_last_3d: ``stride_xc == 1``).
      * ``bits_*``: as in ``_set_sums_kernel``.
      * ``out_ptr``: contiguous fp32 ``(N, SPLIT, J1*J2*J3, C)`` partial sums (fixed-order reduced later).
    """
    n = tl.program_id(0)
    cb = tl.program_id(1)
    split = tl.program_id(2)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    base = x_ptr + n.to(tl.int64) * stride_xn
    p_start = split * p_per_split
    p_end = tl.minimum(p_start + p_per_split, P)
    jv = tl.arange(0, J_PAD)
    acc = tl.zeros([J_PAD, BLOCK_C], dtype=tl.float32)
    # NOTE: with a single set (every tap sees the same positions: an unpadded conv's case) the tile is
    # accumulated elementwise and reduced across positions once at the end, not once per tile.
    acc1 = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(p_start, p_end, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        p_ok = p < p_end
        ptrs = base + p.to(tl.int64)[:, None] * stride_xp + c.to(tl.int64)[None, :] * stride_xc
        xt = tl.load(ptrs, mask=p_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        bd, bh, bw = _position_bits(p, p_ok, bits_d_ptr, bits_h_ptr, bits_w_ptr, H, W)
        if J1 * J2 * J3 == 1:
            acc1 += tl.where(((bd & bh & bw & 1) != 0)[:, None], xt, 0.0)
        else:
            for j in tl.static_range(J1 * J2 * J3):
                inside = (((bd >> (j // (J2 * J3))) & (bh >> ((j // J3) % J2)) & (bw >> (j % J3))) & 1) != 0
                part = tl.sum(tl.where(inside[:, None], xt, 0.0), axis=0)  # [BLOCK_C]
                acc += tl.where(jv[:, None] == j, part[None, :], 0.0)
    if J1 * J2 * J3 == 1:
        acc += tl.sum(acc1, axis=0)[None, :]
    nsplit = tl.num_programs(2)
    out_ptrs = out_ptr + ((n.to(tl.int64) * nsplit + split) * (J1 * J2 * J3) + jv[:, None]) * C + c[None, :]
    tl.store(out_ptrs, acc, mask=(jv[:, None] < J1 * J2 * J3) & c_ok[None, :])


@triton.jit
def _grad_broadcast_cl_kernel(
    g_ptr,
    w_ptr,
    tapset_ptr,
    bits_d_ptr,
    bits_h_ptr,
    bits_w_ptr,
    out_ptr,
    C,
    H,
    W,
    P,
    p_per_split,
    stride_on,
    stride_oc,
    stride_op,
    T,
    CIN_G,
    COUT_G,
    C_OUT,
    s_co,
    s_ci,
    s_t,
    off_g,
    J1: tl.constexpr,
    J2: tl.constexpr,
    J3: tl.constexpr,
    J_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_CO: tl.constexpr,
):
    """Channels-last grad_x: ``out[n, c, p] = sum over sets j containing p of q[n, c, j]``, with
    ``q`` computed in the prologue from ``G`` and the weight (see ``_tap_coef``).

    Grid: ``(N, cdiv(C, BLOCK_C), SPLIT)``.  ``out_ptr`` addressed like ``x_ptr`` of
    ``_set_sums_cl_kernel``; every element is written exactly once.
    """
    n = tl.program_id(0)
    cb = tl.program_id(1)
    split = tl.program_id(2)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    jv = tl.arange(0, J_PAD)
    q = tl.zeros([J_PAD, BLOCK_C], dtype=tl.float32)
    for t in range(T):
        coef = _tap_coef(g_ptr, w_ptr, n, c, c_ok, t, CIN_G, COUT_G, C_OUT, s_co, s_ci, s_t, off_g, BLOCK_CO)
        jt = tl.load(tapset_ptr + t)
        q += tl.where(jv[:, None] == jt, coef[None, :], 0.0)
    base = out_ptr + n.to(tl.int64) * stride_on
    p_start = split * p_per_split
    p_end = tl.minimum(p_start + p_per_split, P)
    for p0 in range(p_start, p_end, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        p_ok = p < p_end
        bd, bh, bw = _position_bits(p, p_ok, bits_d_ptr, bits_h_ptr, bits_w_ptr, H, W)
        val = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(J1 * J2 * J3):
            inside = (((bd >> (j // (J2 * J3))) & (bh >> ((j // J3) % J2)) & (bw >> (j % J3))) & 1) != 0
            qj = tl.sum(tl.where(jv[:, None] == j, q, 0.0), axis=0)  # [BLOCK_C]
            val += tl.where(inside[:, None], qj[None, :], 0.0)
        ptrs = base + p.to(tl.int64)[:, None] * stride_op + c.to(tl.int64)[None, :] * stride_oc
        tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & c_ok[None, :])


# --------------------------------------------------------------------------------------------------
# The small kernels: the contraction with the weights plus the folded affine chain (forward), and
# every parameter gradient from the saved sums (backward).
# --------------------------------------------------------------------------------------------------

# ``KINDS`` entries are the op codes of ``chain_math.OP_CODES`` (``PointwiseKind.code``): mul 13, add 14,
# sub 15, rsub 16, div 17 (the jitted code compares them as literals).
# Where the backward kernel puts a step operand's gradient (``OUT_MODE`` entries).
GRAD_NONE, GRAD_DIRECT, GRAD_SCRATCH = 0, 1, 2


@triton.jit
def _operand(co, co_ok, ops, op_strides, TENSOR: tl.constexpr, CONSTS: tl.constexpr, i: tl.constexpr):
    """Value of step ``i``'s operand per channel ``co``, fp64: a tensor element or a constant."""
    if TENSOR[i]:
        v = tl.load(ops[i] + co.to(tl.int64) * op_strides[i], mask=co_ok, other=1.0).to(tl.float64)
    else:
        v = tl.full(co.shape, CONSTS[i], tl.float64)
    return v


@triton.jit
def _apply(u, v, KIND: tl.constexpr):
    if KIND == 13:  # mul
        r = u * v
    elif KIND == 14:  # add
        r = u + v
    elif KIND == 15:  # sub
        r = u - v
    elif KIND == 16:  # rsub
        r = v - u
    else:
        r = u / v
    return r


@triton.jit
def _contract_fwd_kernel(
    r_ptr,
    rs_n,
    rs_c,
    rs_s,
    rs_j,
    NSPLIT,
    tapset_ptr,
    w_ptr,
    s_co,
    s_ci,
    s_t,
    off_g,
    bias_ptr,
    bias_stride,
    ops,
    op_strides,
    out_ptr,
    mean_ptr,
    taps_ptr,
    C_IN,
    C_OUT,
    CIN_G,
    COUT_G,
    T,
    P,
    KINDS: tl.constexpr,
    TENSOR: tl.constexpr,
    CONSTS: tl.constexpr,
    NS: tl.constexpr,
    NS_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    BLOCK_CO: tl.constexpr,
):
    """Forward tail in one launch: tap sums, the contraction with W, bias, mean scale, affine chain.

    Grid: ``(N, groups, cdiv(COUT_G, BLOCK_CO))``; program ``(n, g, cb)`` produces output channels
    ``g*COUT_G + [cb*BLOCK_CO, ...)`` of batch element ``n``.  The reduction index ``k = ci_local*T + t``
    (``K = CIN_G*T`` of them) is walked in ``[BLOCK_K]`` chunks whose loads do not depend on the
    previous chunk: per chunk one ``[BLOCK_K, BLOCK_CO]`` weight tile and one ``[BLOCK_K, BLOCK_S]``
    tile of split partials (``ONE_CHUNK``: ``NSPLIT <= BLOCK_S``, else a loop over split chunks).

    Pointer contract:
      * ``r_ptr``: fp32 partial set sums; element ``(n, c, split, j)`` at
        ``n*rs_n + c*rs_c + split*rs_s + j*rs_j``, ``split < NSPLIT`` (summed here, fp64).
      * ``tapset_ptr``: int32 ``(T,)``, the product-set index of every flattened tap.
      * ``w_ptr``/``s_*``/``off_g``: the weight, as in ``_tap_coef``.
      * ``bias_ptr``: ``(C_OUT,)`` with stride ``bias_stride`` (unused without ``HAS_BIAS``).
      * ``ops``/``op_strides``: one pointer per affine step (a dummy for constant steps); element
        ``co`` of a tensor operand at ``co*op_strides[i]`` (stride 0 for a one-element operand).
      * ``out_ptr``: contiguous ``(N, C_OUT)`` in the output dtype; ``mean_ptr``: contiguous fp64
        ``(N, C_OUT)`` conv mean before the chain; ``taps_ptr``: contiguous fp64 ``(N, C_IN, T)`` tap
        sums (written by the ``cb == 0`` programs).
    Accumulation: fp64 (the contraction cancels; it is tiny).  Determinism: every sum has a fixed
    order for a given launch configuration (``tl.sum`` trees over constexpr shapes, chunks in order);
    no atomics.
    """
    n = tl.program_id(0)
    gi = tl.program_id(1)
    cb = tl.program_id(2)
    col = cb * BLOCK_CO + tl.arange(0, BLOCK_CO)
    co_ok = col < COUT_G
    co = gi * COUT_G + col

    # NOTE: everything the epilogue reads that does not depend on the contraction (bias, step
    # operands) is loaded before the loop, so its memory latency overlaps the loop's instead of
    # adding a round trip after it.
    bias = tl.zeros([BLOCK_CO], dtype=tl.float64)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + co * bias_stride, mask=co_ok, other=0.0).to(tl.float64)
    slot = tl.arange(0, NS_PAD)
    # -0.0 fill: x + (-0.0) == x for every x (signed zeros included), so the row extraction below
    # returns each operand bitwise
    opv = tl.full([NS_PAD, BLOCK_CO], -0.0, tl.float64)
    for i in tl.static_range(NS):
        opv = tl.where(slot[:, None] == i, _operand(co, co_ok, ops, op_strides, TENSOR, CONSTS, i)[None, :], opv)

    K = CIN_G * T
    kv = tl.arange(0, BLOCK_K)
    sv = tl.arange(0, BLOCK_S)
    n64 = n.to(tl.int64)
    acc = tl.zeros([BLOCK_K, BLOCK_CO], dtype=tl.float64)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kv
        k_ok = k < K
        cil = k // T
        t = k - cil * T
        ci = gi * CIN_G + cil
        w_off = co.to(tl.int64)[None, :] * s_co + (ci.to(tl.int64) * s_ci - gi * off_g + t * s_t)[:, None]
        w = tl.load(w_ptr + w_off, mask=k_ok[:, None] & co_ok[None, :], other=0.0)
        j = tl.load(tapset_ptr + t, mask=k_ok, other=0)
        r_row = r_ptr + n64 * rs_n + ci.to(tl.int64) * rs_c + j.to(tl.int64) * rs_j  # [BLOCK_K] pointers
        if ONE_CHUNK:
            part = tl.load(r_row[:, None] + sv[None, :] * rs_s, mask=k_ok[:, None] & (sv < NSPLIT)[None, :], other=0.0)
            s = tl.sum(part.to(tl.float64), axis=1)
        else:
            s = tl.zeros([BLOCK_K], dtype=tl.float64)
            for s0 in range(0, NSPLIT, BLOCK_S):
                sp = s0 + sv
                part = tl.load(r_row[:, None] + sp[None, :] * rs_s, mask=k_ok[:, None] & (sp < NSPLIT)[None, :], other=0.0)
                s += tl.sum(part.to(tl.float64), axis=1)
        tl.store(taps_ptr + (n64 * C_IN + gi * CIN_G) * T + k, s, mask=k_ok & ((k * 0 + cb) == 0))
        acc += s[:, None] * w.to(tl.float64)
    mean = tl.sum(acc, axis=0) / P + bias
    tl.store(mean_ptr + n64 * C_OUT + co, mean, mask=co_ok)
    v = mean
    for i in tl.static_range(NS):
        v = _apply(v, tl.sum(tl.where(slot[:, None] == i, opv, -0.0), axis=0), KINDS[i])
    tl.store(out_ptr + n64 * C_OUT + co, v.to(tl.float32).to(out_ptr.dtype.element_ty), mask=co_ok)


@triton.jit
def _params_bwd_kernel(
    go_ptr,
    go_sn,
    go_sc,
    mean_ptr,
    taps_ptr,
    ops,
    op_strides,
    gops,
    gop_strides,
    gw_ptr,
    gw_s_co,
    gw_s_ci,
    gw_s_t,
    gw_off_g,
    gbias_ptr,
    gbias_stride,
    coef_ptr,
    scratch_ptr,
    N,
    C_IN,
    C_OUT,
    CIN_G,
    COUT_G,
    T,
    P,
    KINDS: tl.constexpr,
    TENSOR: tl.constexpr,
    CONSTS: tl.constexpr,
    OUT_MODE: tl.constexpr,
    NS: tl.constexpr,
    NS_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NEED_OPS: tl.constexpr,
    BLOCK_CI: tl.constexpr,
    BLOCK_CO: tl.constexpr,
):
    """Backward tail in one launch: grad_weight, grad_bias, operand gradients and ``G`` for grad_x.

    With ``A[co]`` the chain's scale (d out / d mean) and ``G[n, co] = g[n, co] * A[co] / P``:
    ``dW(ci, co, t) = sum_n G[n, co] * S[n, ci, t]``, ``dbias[co] = sum_n g*A``, and each step's
    operand gradient by reverse mode through the chain (values recomputed from the saved mean).

    Grid: ``(groups, cdiv(COUT_G, BLOCK_CO), cdiv(CIN_G, BLOCK_CI) * T)``; program ``(g, cb, k)``
    writes the ``[BLOCK_CI, BLOCK_CO]`` tile of tap ``k % T`` of grad_weight; the ``k == 0`` programs
    also write the per-channel results.  Sums over n run in order in each program: deterministic.

    Pointer contract:
      * ``go_ptr``: grad of the output, element ``(n, co)`` at ``n*go_sn + co*go_sc`` (any dtype).
      * ``mean_ptr``: fp64 ``(N, C_OUT)``; ``taps_ptr``: fp64 ``(N, C_IN, T)`` (the forward's outputs).
      * ``ops``/``op_strides``: as in ``_contract_fwd_kernel``.
      * ``gops``/``gop_strides``: per step, where ``OUT_MODE[i] == GRAD_DIRECT`` puts its operand's
        gradient (element ``co`` at ``co*gop_strides[i]``, the operand's dtype).  ``GRAD_SCRATCH`` steps
        write their per-channel fp64 partials (summed over n) to row ``i`` of ``scratch_ptr``
        (``(NS, C_OUT)`` contiguous) for the host to combine.
      * ``gw_ptr``: grad_weight in the weight's dtype, addressed like ``w_ptr`` in ``_tap_coef``.
      * ``gbias_ptr``: ``(C_OUT,)`` with stride ``gbias_stride``; ``coef_ptr``: contiguous fp32
        ``(N, C_OUT)`` receiving ``G``.
    """
    gi = tl.program_id(0)
    cb = tl.program_id(1)
    k = tl.program_id(2)
    col = cb * BLOCK_CO + tl.arange(0, BLOCK_CO)
    co_ok = col < COUT_G
    co = gi * COUT_G + col

    a = tl.full([BLOCK_CO], 1.0, tl.float64)
    for i in tl.static_range(NS):
        if KINDS[i] == 13:  # mul
            a = a * _operand(co, co_ok, ops, op_strides, TENSOR, CONSTS, i)
        elif KINDS[i] == 17:  # div
            a = a / _operand(co, co_ok, ops, op_strides, TENSOR, CONSTS, i)
        elif KINDS[i] == 16:  # rsub
            a = -a
    scale = a / P

    # grad_weight tile
    cib = k // T
    t = k - cib * T
    cil = cib * BLOCK_CI + tl.arange(0, BLOCK_CI)
    ci_ok = cil < CIN_G
    ci = gi * CIN_G + cil
    acc = tl.zeros([BLOCK_CI, BLOCK_CO], dtype=tl.float64)
    for n in range(N):
        gv = tl.load(go_ptr + n * go_sn + co * go_sc, mask=co_ok, other=0.0).to(tl.float64) * scale
        s = tl.load(taps_ptr + (n * C_IN + ci.to(tl.int64)) * T + t, mask=ci_ok, other=0.0)
        acc += s[:, None] * gv[None, :]
    gw_off = co.to(tl.int64)[None, :] * gw_s_co + (ci.to(tl.int64) * gw_s_ci - gi * gw_off_g)[:, None] + t * gw_s_t
    tl.store(gw_ptr + gw_off, acc.to(tl.float32).to(gw_ptr.dtype.element_ty), mask=ci_ok[:, None] & co_ok[None, :])

    # per-channel results (only the k == 0 programs store them)
    first = co_ok & ((col * 0 + k) == 0)
    slot = tl.arange(0, NS_PAD)
    gbias = tl.zeros([BLOCK_CO], dtype=tl.float64)
    opacc = tl.zeros([NS_PAD, BLOCK_CO], dtype=tl.float64)
    for n in range(N):
        g = tl.load(go_ptr + n * go_sn + co * go_sc, mask=co_ok, other=0.0).to(tl.float64)
        tl.store(coef_ptr + n * C_OUT + co, (g * scale).to(tl.float32), mask=first)
        gbias += g * a
        if NEED_OPS:
            # forward values before each step, then reverse mode through the chain
            us = tl.zeros([NS_PAD, BLOCK_CO], dtype=tl.float64)
            u = tl.load(mean_ptr + n * C_OUT + co, mask=co_ok, other=0.0)
            for i in tl.static_range(NS):
                us = tl.where(slot[:, None] == i, u[None, :], us)
                u = _apply(u, _operand(co, co_ok, ops, op_strides, TENSOR, CONSTS, i), KINDS[i])
            d = g
            # reverse order; the loop variable itself stays a constexpr (a plain assignment such as
            # ``j = NS - 1 - ii`` would turn it into a tensor, which cannot index the KINDS tuple)
            for j in tl.static_range(NS - 1, -1, -1):
                v = _operand(co, co_ok, ops, op_strides, TENSOR, CONSTS, j)
                ui = tl.sum(tl.where(slot[:, None] == j, us, 0.0), axis=0)
                if KINDS[j] == 13:  # mul
                    gvi = d * ui
                    d = d * v
                elif KINDS[j] == 17:  # div
                    gvi = -d * ui / (v * v)
                    d = d / v
                elif KINDS[j] == 14:  # add
                    gvi = d
                elif KINDS[j] == 15:  # sub
                    gvi = -d
                else:
                    gvi = d
                    d = -d
                opacc += tl.where(slot[:, None] == j, gvi[None, :], 0.0)
    if HAS_BIAS:
        tl.store(gbias_ptr + co * gbias_stride, gbias.to(tl.float32).to(gbias_ptr.dtype.element_ty), mask=first)
    if NEED_OPS:
        for i in tl.static_range(NS):
            row = tl.sum(tl.where(slot[:, None] == i, opacc, 0.0), axis=0)
            if OUT_MODE[i] == 1:
                tl.store(gops[i] + co * gop_strides[i], row.to(tl.float32).to(gops[i].dtype.element_ty), mask=first)
            elif OUT_MODE[i] == 2:
                tl.store(scratch_ptr + i * C_OUT + co, row, mask=first)


# --------------------------------------------------------------------------------------------------
# Launchers of the fused op's pipeline (forward: big pass + contraction; backward: params + grad_x)
# --------------------------------------------------------------------------------------------------

#: Most product sets the channels-last kernels unroll (one masked reduction per set and tile).
MAX_CL_SETS = 64
_CL_TILE_ELEMENTS = 4096
_MAX_BLOCK_C = 64


@dataclass(frozen=True)
class WeightLayout:
    """How the kernels address a conv weight: element ``(ci, co, t)`` at
    ``co*s_co + ci*s_ci - (ci // cin_g)*off_g + t*s_t`` with ``t`` the row-major flattened tap."""

    tensor: torch.Tensor
    s_co: int
    s_ci: int
    s_t: int
    off_g: int
    cin_g: int
    cout_g: int
    taps: int

    @staticmethod
    def of(weight: torch.Tensor, transposed: bool, groups: int) -> WeightLayout | None:
        """``None`` when the kernel dims cannot be addressed by one flat tap stride."""
        dims = [(sz, st) for sz, st in zip(weight.shape[2:], weight.stride()[2:], strict=True) if sz != 1]
        if any(dims[i][1] != dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1)):
            return None
        s_t = dims[-1][1] if dims else 1
        taps = math.prod(weight.shape[2:])
        s0, s1 = weight.stride(0), weight.stride(1)
        if transposed:  # (C_in, C_out/g, *k)
            cin_g, cout_g = weight.shape[0] // groups, weight.shape[1]
            return WeightLayout(weight, s1, s0, s_t, cout_g * s1, cin_g, cout_g, taps)
        cout_g, cin_g = weight.shape[0] // groups, weight.shape[1]  # (C_out, C_in/g, *k)
        return WeightLayout(weight, s0, s1, s_t, cin_g * s1, cin_g, cout_g, taps)


@dataclass(frozen=True)
class ChainArgs:
    """The affine chain as kernel arguments: per step a kind (``STEP_*``), whether the operand is a
    tensor, the constant (for constant steps), the operand tensor (a dummy for constants) and its
    per-channel stride (0 for a one-element tensor).  Empty chains are padded to one dummy entry."""

    kinds: tuple[int, ...]
    tensor: tuple[bool, ...]
    consts: tuple[float, ...]
    ops: tuple[torch.Tensor, ...]
    strides: tuple[int, ...]

    @property
    def steps(self) -> int:
        return sum(1 for k in self.kinds if k)

    def static(self, steps: int) -> tuple[Any, ...]:
        """The constexpr half (kinds, tensor flags, constants) and the real step count: a cache key."""
        return (self.kinds, self.tensor, self.consts, steps)

    def padded(self, dummy: torch.Tensor) -> ChainArgs:
        if self.kinds:
            return self
        return ChainArgs((0,), (False,), (0.0,), (dummy,), (0,))


def _channels_innermost(x5: torch.Tensor) -> bool:
    """x5's spatial positions flatten to one stride and channels are unit-stride (channels_last)."""
    return _channels_innermost_meta(tuple(x5.shape), x5.stride())


def _channels_innermost_meta(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    n, c, d, h, w = shape
    sn, sc, sd, sh, sw = stride
    if c <= 1 or sc != 1:
        return False
    ok_h = h == 1 or sh == w * sw
    ok_d = d == 1 or sd == h * w * sw
    return ok_h and ok_d and sw >= c


def _cl_tiles(positions: int, channels: int) -> tuple[int, int]:
    block_c = min(next_pow2(channels), _MAX_BLOCK_C)
    block_p = min(next_pow2(positions), max(1, _CL_TILE_ELEMENTS // block_c))
    return block_p, block_c


def _cl_split(programs: int, positions: int, block_p: int, device: torch.device, split: int | None) -> tuple[int, int]:
    tiles = cdiv(positions, block_p)
    if split is None:
        split = cdiv(_PROGRAMS_PER_SM * _sm_count(device), max(programs, 1)) if device.type == "cuda" else 1
    split = max(1, min(int(split), tiles))
    per = cdiv(tiles, split) * block_p
    return cdiv(positions, per), per


@dataclass(frozen=True, eq=False)
class _Launch:
    """The shape-dependent half of one launch (kernel, grid, integer arguments, constexprs), built once
    per shape by the ``_plan_*`` functions below.

    NOTE: at the ``seeds`` suite's sizes a training step is host-bound (``python tools/profile_step.py
    demos/seeds/convt2d_global_mean_bias_logsumexp.py --mode train`` shows the GPU time against the
    host time per step): recomputing tiles, splits and grids on every call cost more host time than
    the kernels' GPU time, so the launchers look these up in an ``lru_cache`` keyed by shapes and
    strides and only bind tensors per call.
    """

    kernel: Any
    grid: tuple[int, ...]
    ints: tuple[int, ...] = ()
    consts: dict[str, Any] = field(default_factory=dict)
    #: set_sums_partial only: the partial buffer's shape, its (n, c, split, j) strides and split count
    buffer_shape: tuple[int, ...] = ()
    buffer_strides: tuple[int, int, int, int] = (0, 0, 0, 0)
    nsplit: int = 1

    @functools.cached_property
    def launch(self) -> FastLaunch:
        """``kernel[grid](*args, **consts)`` through :class:`FastLaunch` (built on first use, after
        the plan builder's last edit of ``consts``)."""
        return FastLaunch(self.kernel, self.grid, self.consts)


def _pass_plan(
    shape: tuple[int, ...], stride: tuple[int, ...], device: torch.device, sets: tuple[int, int, int],
    split: int | None, cl_kernel: Any, plane_kernel: Any, **extra: Any,
) -> _Launch | None:
    """Tiles, split, grid and integer arguments of a pass over an x-sized tensor (the sums forward,
    the broadcast backward walk it the same way); ``None`` when it is empty."""
    n, c, d, h, w = shape
    j1, j2, j3 = sets
    jn = j1 * j2 * j3
    positions = d * h * w
    if n * c == 0 or positions == 0:
        return None
    if _channels_innermost_meta(shape, stride) and jn <= MAX_CL_SETS:
        block_p, block_c = _cl_tiles(positions, c)
        cblocks = cdiv(c, block_c)
        nsplit, per = _cl_split(n * cblocks, positions, block_p, device, split)
        return _Launch(
            cl_kernel, (n, cblocks, nsplit), (c, h, w, positions, per, stride[0], stride[1], stride[4]),
            dict(J1=j1, J2=j2, J3=j3, J_PAD=next_pow2(jn), BLOCK_P=block_p, BLOCK_C=block_c, num_warps=_NUM_WARPS),
            (n, nsplit, jn, c), (nsplit * jn * c, 1, jn * c, c), nsplit,
        )  # fmt: skip
    rows = d * h
    block_a, block_w = _tile_shape(rows, w)
    nsplit, rows_per_split = _choose_split(n * c, rows, block_a, device, split)
    return _Launch(
        plane_kernel, (n * c, nsplit), (c, h, w, rows, rows_per_split, *stride),
        dict(J1=j1, J2=j2, J3=j3, J12_PAD=next_pow2(j1 * j2), J3_PAD=next_pow2(j3), BLOCK_A=block_a,
             BLOCK_W=block_w, num_warps=_NUM_WARPS, **extra),
        (n, c, nsplit, jn), (c * nsplit * jn, nsplit * jn, jn, 1), nsplit,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _plan_set_sums(
    shape: tuple[int, ...], stride: tuple[int, ...], device: torch.device, sets: tuple[int, int, int],
    split: int | None,
) -> _Launch | None:
    """``None`` for an empty x (no launch); the buffer fields describe the partial sums."""
    return _pass_plan(shape, stride, device, sets, split, _set_sums_cl_kernel, _set_sums_kernel)


def set_sums_partial(
    x5: torch.Tensor,
    bits: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sets: tuple[int, int, int],
    split: int | None = None,
) -> tuple[torch.Tensor, tuple[int, int, int, int], int]:
    """One pass over x: per-split partial set sums, not yet reduced over the splits.

    Returns ``(partial, (rs_n, rs_c, rs_s, rs_j), nsplit)``: fp32 element ``(n, c, split, j)`` of
    ``partial`` at ``n*rs_n + c*rs_c + split*rs_s + j*rs_j``.  Channels-last x (``_channels_innermost``)
    takes the channels-innermost kernel, everything else the plane kernel.
    """
    _check_launch("set_sums_partial", x5, bits, sets)
    plan = _plan_set_sums(tuple(x5.shape), x5.stride(), x5.device, tuple(sets), split)
    if plan is None:
        n, c = x5.shape[:2]
        z = torch.zeros((n, c, 1, sets[0] * sets[1] * sets[2]), dtype=torch.float32, device=x5.device)
        return z, tuple(z.stride()), 1  # type: ignore[return-value]
    partial = torch.empty(plan.buffer_shape, dtype=torch.float32, device=x5.device)
    plan.launch(x5, bits[0], bits[1], bits[2], partial, *plan.ints)
    return partial, plan.buffer_strides, plan.nsplit


def _block_co(cout_g: int) -> int:
    return min(next_pow2(cout_g), 32)


def _block_ci(cin_g: int) -> int:
    return min(next_pow2(cin_g), 32)


# NOTE: the contraction kernel is latency-bound (ConvTranspose2d 64->128 k3 on 16x64x512x512: 1.2 M
# fp64 multiply-adds, ~0.3 MB of weights): what matters is the number of programs and the number of
# dependent memory round trips per program.  16 output channels per program gives that conv (N=16,
# C_out=128) 128 programs on 132 SMs (the old grid had 64, each walking 2 ci blocks x 9 taps one after
# another: 18 dependent iterations).  A 4096-element chunk over 8 warps (16 elements per thread, 128
# registers, no spills: tools/compile_check_global_mean.py) walks K = C_in*T = 576 in 3 chunks whose
# loads do not depend on each other.  Up to 16 split partials are summed as one tile (that conv
# contiguous: 1 split; channels_last: 33 splits, 3 tiles per chunk).
_CONTRACT_CHUNK = 4096
_CONTRACT_BLOCK_CO = 16
_CONTRACT_BLOCK_S = 16
_CONTRACT_WARPS = 8


@dataclass(frozen=True)
class ContractTiles:
    """Tile of ``_contract_fwd_kernel``: output channels per program, reduction chunk, split chunk."""

    block_co: int
    block_k: int
    block_s: int


def contract_tiles(k: int, cout_g: int, nsplit: int) -> ContractTiles:
    """Tiles for a reduction of length ``k = C_in/groups * taps`` over ``nsplit`` split partials."""
    block_co = min(next_pow2(cout_g), _CONTRACT_BLOCK_CO)
    block_s = min(next_pow2(nsplit), _CONTRACT_BLOCK_S)
    block_k = max(16, min(next_pow2(k), _CONTRACT_CHUNK // max(block_co, block_s)))
    return ContractTiles(block_co, block_k, block_s)


@functools.lru_cache(maxsize=256)
def _plan_contract(
    n: int, groups: int, cout_g: int, k: int, nsplit: int, chain_static: tuple[Any, ...], has_bias: bool
) -> _Launch:
    kinds, tensor, consts, steps = chain_static
    tiles = contract_tiles(k, cout_g, nsplit)
    return _Launch(
        _contract_fwd_kernel, (n, groups, cdiv(cout_g, tiles.block_co)),
        consts=dict(KINDS=kinds, TENSOR=tensor, CONSTS=consts, NS=steps, NS_PAD=next_pow2(max(steps, 1)),
                    HAS_BIAS=has_bias, BLOCK_K=tiles.block_k, BLOCK_S=tiles.block_s,
                    ONE_CHUNK=nsplit <= tiles.block_s, BLOCK_CO=tiles.block_co, num_warps=_CONTRACT_WARPS),
    )  # fmt: skip


def contract_forward(
    partial: tuple[torch.Tensor, tuple[int, int, int, int], int],
    tapset: torch.Tensor,
    weight: WeightLayout,
    bias: torch.Tensor | None,
    chain: ChainArgs,
    n_outputs: int,
    out: torch.Tensor,
    mean: torch.Tensor,
    taps: torch.Tensor,
) -> None:
    """Launch ``_contract_fwd_kernel``: fills ``out`` ((N, C_out) contiguous, any float dtype), ``mean``
    (fp64 (N, C_out)) and ``taps`` (fp64 (N, C_in, T)) from ``set_sums_partial``'s result."""
    r, (rs_n, rs_c, rs_s, rs_j), nsplit = partial
    n, c_in, t = taps.shape
    c_out = mean.shape[1]
    if t != weight.taps or tapset.numel() != t or not (out.is_contiguous() and mean.is_contiguous() and taps.is_contiguous()):
        raise ValueError(
            f"contract_forward: taps {tuple(taps.shape)} / tapset {tuple(tapset.shape)} / weight taps "
            f"{weight.taps} disagree, or an output is not contiguous"
        )
    ch = chain.padded(mean)
    plan = _plan_contract(n, c_in // weight.cin_g, weight.cout_g, weight.cin_g * t, nsplit, ch.static(chain.steps),
                          bias is not None)  # fmt: skip
    plan.launch(
        r, rs_n, rs_c, rs_s, rs_j, nsplit, tapset,
        weight.tensor, weight.s_co, weight.s_ci, weight.s_t, weight.off_g,
        bias if bias is not None else mean, bias.stride(0) if bias is not None else 0,
        ch.ops, ch.strides, out, mean, taps,
        c_in, c_out, weight.cin_g, weight.cout_g, t, n_outputs
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _plan_params(
    groups: int, cout_g: int, cin_g: int, t: int, chain_static: tuple[Any, ...], modes: tuple[int, ...],
    has_bias: bool,
) -> _Launch:
    kinds, tensor, consts, steps = chain_static
    block_co, block_ci = _block_co(cout_g), _block_ci(cin_g)
    return _Launch(
        _params_bwd_kernel, (groups, cdiv(cout_g, block_co), cdiv(cin_g, block_ci) * t),
        consts=dict(KINDS=kinds, TENSOR=tensor, CONSTS=consts, OUT_MODE=modes, NS=steps,
                    NS_PAD=next_pow2(max(steps, 1)), HAS_BIAS=has_bias,
                    NEED_OPS=any(m != GRAD_NONE for m in modes), BLOCK_CI=block_ci, BLOCK_CO=block_co,
                    num_warps=_NUM_WARPS),
    )  # fmt: skip


def params_backward(
    grad_out: torch.Tensor,
    mean: torch.Tensor,
    taps: torch.Tensor,
    chain: ChainArgs,
    grad_targets: tuple[tuple[int, torch.Tensor, int], ...],
    grad_weight: WeightLayout,
    grad_bias: torch.Tensor | None,
    n_outputs: int,
    coef: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """Launch ``_params_bwd_kernel``.

    ``grad_out`` is viewed as ``(N, C_out)`` through its first two strides; ``grad_targets[i]`` is
    ``(mode, tensor, stride)`` for step ``i`` (``GRAD_NONE``/``GRAD_DIRECT``/``GRAD_SCRATCH``);
    ``grad_weight`` is the destination weight-shaped buffer; ``coef`` receives ``G`` (fp32 (N, C_out));
    ``scratch`` is fp64 ``(max(steps, 1), C_out)`` for ``GRAD_SCRATCH`` steps.
    """
    n, c_in, t = taps.shape
    c_out = mean.shape[1]
    ch = chain.padded(mean)
    modes = tuple(m for m, _, _ in grad_targets) or (GRAD_NONE,)
    gops = tuple(g for _, g, _ in grad_targets) or (scratch,)
    gstrides = tuple(s for _, _, s in grad_targets) or (0,)
    plan = _plan_params(c_in // grad_weight.cin_g, grad_weight.cout_g, grad_weight.cin_g, t, ch.static(chain.steps),
                        modes, grad_bias is not None)  # fmt: skip
    plan.launch(
        grad_out, grad_out.stride(0), grad_out.stride(1), mean, taps, ch.ops, ch.strides, gops, gstrides,
        grad_weight.tensor, grad_weight.s_co, grad_weight.s_ci, grad_weight.s_t, grad_weight.off_g,
        grad_bias if grad_bias is not None else coef, grad_bias.stride(0) if grad_bias is not None else 0,
        coef, scratch, n, c_in, c_out, grad_weight.cin_g, grad_weight.cout_g, t, n_outputs
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _plan_broadcast(
    shape: tuple[int, ...], stride: tuple[int, ...], device: torch.device, sets: tuple[int, int, int],
    cout_g: int, split: int | None,
) -> _Launch | None:
    """``None`` for an empty grad_x (no launch); the buffer fields are unused."""
    block_co = min(next_pow2(cout_g), 128)
    plan = _pass_plan(shape, stride, device, sets, split, _grad_broadcast_cl_kernel, _set_broadcast_kernel,
                      FROM_GRAD=True, BLOCK_CO=block_co)  # fmt: skip
    if plan is not None and plan.kernel is _grad_broadcast_cl_kernel:
        plan.consts["BLOCK_CO"] = min(block_co, 32)
    return plan


def grad_broadcast(
    coef: torch.Tensor,
    weight: WeightLayout,
    tapset: torch.Tensor,
    bits: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sets: tuple[int, int, int],
    out: torch.Tensor,
    split: int | None = None,
) -> torch.Tensor:
    """Write grad_x into ``out`` (5-D, any strides; channels-last takes the channels-innermost kernel)
    from ``G`` (``coef``, fp32 (N, C_out)) and the weight: every element written once; returns ``out``."""
    _check_launch("grad_broadcast", out, bits, sets)
    plan = _plan_broadcast(tuple(out.shape), out.stride(), out.device, tuple(sets), weight.cout_g, split)
    if plan is None:
        return out
    wdims = (weight.taps, weight.cin_g, weight.cout_g, coef.shape[1], weight.s_co, weight.s_ci, weight.s_t, weight.off_g)
    if plan.kernel is _grad_broadcast_cl_kernel:
        plan.launch(
            coef, weight.tensor, tapset, bits[0], bits[1], bits[2], out, *plan.ints, *wdims
        )  # fmt: skip
    else:
        plan.launch(
            coef, bits[0], bits[1], bits[2], out, *plan.ints, coef, weight.tensor, tapset, *wdims
        )  # fmt: skip
    return out
