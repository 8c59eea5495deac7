"""The two passes of ``conv_global_mean`` over full-size tensors: the per-set sums of x (forward) and
grad_x written from per-set coefficients (backward), in a plane layout and a channels-last layout,
with their launchers (``set_sums`` / ``set_broadcast`` the plain building blocks, ``set_sums_partial``
/ ``grad_broadcast`` the fused op's pipeline steps).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl

from ..host import cdiv, next_pow2
from ..launch import launch
from ..plan_cache import ContractError, cached_plans
from .common import NUM_WARPS, Launch, WeightLayout

#: Largest number of distinct index sets per spatial dim (bits of an int32 table entry).
MAX_SETS_PER_DIM = 31

#: The per-dim int32 bit tables ``(bits_d, bits_h, bits_w)`` (see the package docstring).
BitTables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: ``(J1, J2, J3)``: the number of index sets of each dim.
SetCounts = tuple[int, int, int]


# NOTE: tile sizes.  ~4096 elements per tile (16 KB of fp32) with 4 warps keeps 32 elements per
# thread in flight: enough to stream x at close to HBM bandwidth while the per-tile mask work (J3
# masked reductions plus a J12_PAD x BLOCK_A mask) stays well below the memory time.
_TILE_ELEMENTS = 4096


_MAX_BLOCK_W = 256


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
    programs: int, length: int, block: int, device: torch.device, split: int | None
) -> tuple[int, int]:
    """Cut a walk of ``length`` rows (plane kernels) or positions (channels-last kernels), tiled by
    ``block``, into parts for ``programs`` programs per part; return ``(split, per_split)``, the
    number of parts and their length (a multiple of ``block``).  ``split=None`` aims at
    ``_PROGRAMS_PER_SM`` programs per SM on CUDA."""
    tiles = cdiv(length, block)
    if split is None:
        if device.type == "cuda":
            split = cdiv(_PROGRAMS_PER_SM * _sm_count(device), max(programs, 1))
        else:
            split = 1  # the interpreter runs programs one after another: parallelism buys nothing
    split = max(1, min(int(split), tiles))
    per_split = cdiv(tiles, split) * block
    return cdiv(length, per_split), per_split


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
def _plane_program(ptr, C, stride_n, stride_c):
    """This program of a ``(N*C, SPLIT)`` grid: ``(plane, split, n, c, base)`` with ``plane = n*C + c``
    and ``base`` the origin of plane ``(n, c)`` of the 5-D tensor at ``ptr`` (batch and channel
    element strides ``stride_n``, ``stride_c``; offsets in int64)."""
    plane = tl.program_id(0)
    split = tl.program_id(1)
    n = plane // C
    c = plane - n * C
    base = ptr + n.to(tl.int64) * stride_n + c.to(tl.int64) * stride_c
    return plane, split, n, c, base


@triton.jit
def _plane_rows(
    a0, row_end, bits_d_ptr, bits_h_ptr, H, stride_d, stride_h,
    J1: tl.constexpr, J2: tl.constexpr, J12_PAD: tl.constexpr, BLOCK_A: tl.constexpr,
):  # fmt: skip
    """Rows ``r`` in ``[a0, a0 + BLOCK_A)`` of a plane seen as ``rows x W`` (``r = d*H + h``), valid
    below ``row_end``: ``(row_ok, mask12, row_off)`` with ``mask12`` their ``[J12_PAD, BLOCK_A]``
    set mask (``_row_set_mask``) and ``row_off`` the int64 element offset ``d*stride_d + h*stride_h``."""
    r = a0 + tl.arange(0, BLOCK_A)
    row_ok = r < row_end
    mask12 = _row_set_mask(r, row_ok, bits_d_ptr, bits_h_ptr, H, J1, J2, J12_PAD)
    d = r // H
    row_off = d.to(tl.int64) * stride_d + (r - d * H).to(tl.int64) * stride_h
    return row_ok, mask12, row_off


@triton.jit
def _plane_cols(w0, W, bits_w_ptr, BLOCK_W: tl.constexpr):
    """Columns ``[w0, w0 + BLOCK_W)`` of a plane: ``(cols, col_ok, bw)`` with ``col_ok = cols < W`` and
    ``bw`` their entries of dim W's bit table (0 past the end)."""
    cols = w0 + tl.arange(0, BLOCK_W)
    col_ok = cols < W
    bw = tl.load(bits_w_ptr + cols, mask=col_ok, other=0)
    return cols, col_ok, bw


@triton.jit
def _set_sums_kernel(
    x_ptr, bits_d_ptr, bits_h_ptr, bits_w_ptr, out_ptr,
    C, H, W, rows, rows_per_split,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    J1: tl.constexpr, J2: tl.constexpr, J3: tl.constexpr, J12_PAD: tl.constexpr, J3_PAD: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
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
    plane, split, n, c, base = _plane_program(x_ptr, C, stride_xn, stride_xc)

    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, rows)
    j3v = tl.arange(0, J3_PAD)
    acc = tl.zeros([J12_PAD, J3_PAD], dtype=tl.float32)

    for a0 in range(row_start, row_end, BLOCK_A):
        row_ok, mask12, row_off = _plane_rows(a0, row_end, bits_d_ptr, bits_h_ptr, H, stride_xd, stride_xh,
                                              J1, J2, J12_PAD, BLOCK_A)  # fmt: skip
        for w0 in range(0, W, BLOCK_W):
            cols, col_ok, bw = _plane_cols(w0, W, bits_w_ptr, BLOCK_W)
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
    q_ptr, bits_d_ptr, bits_h_ptr, bits_w_ptr, out_ptr,
    C, H, W, rows, rows_per_split,
    stride_on, stride_oc, stride_od, stride_oh, stride_ow,
    g_ptr, w_ptr, tapset_ptr, T, CIN_G, COUT_G, C_OUT, s_co, s_ci, s_t, off_g,
    J1: tl.constexpr, J2: tl.constexpr, J3: tl.constexpr, J12_PAD: tl.constexpr, J3_PAD: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_W: tl.constexpr, FROM_GRAD: tl.constexpr, BLOCK_CO: tl.constexpr,
):  # fmt: skip
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
    plane, split, n, c, base = _plane_program(out_ptr, C, stride_on, stride_oc)

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
        row_ok, mask12, row_off = _plane_rows(a0, row_end, bits_d_ptr, bits_h_ptr, H, stride_od, stride_oh,
                                              J1, J2, J12_PAD, BLOCK_A)  # fmt: skip
        for w0 in range(0, W, BLOCK_W):
            cols, col_ok, bw = _plane_cols(w0, W, bits_w_ptr, BLOCK_W)
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
        raise ContractError(f"{name}: expected a 5-D (N, C, D, H, W) tensor, got shape {tuple(t.shape)}")
    if t.dtype not in _KERNEL_DTYPES:
        raise ContractError(f"{name}: dtype {t.dtype} has no kernel (supported: {_KERNEL_DTYPES})")
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


def _plane_plan(
    shape: tuple[int, ...], stride: tuple[int, ...], device: torch.device, sets: tuple[int, int, int],
    split: int | None, kernel: Any, **extra: Any,
) -> Launch:
    """Launch of a plane kernel (``_set_sums_kernel``, ``_set_broadcast_kernel``; ``extra``: further
    constexprs) over a non-empty 5-D ``shape``/``stride`` tensor: grid ``(N*C, SPLIT)``, integer
    arguments ``(C, H, W, rows, rows_per_split, *stride)``; the buffer fields describe the sums'
    ``(N, C, SPLIT, J)`` partial buffer."""
    n, c, d, h, w = shape
    j1, j2, j3 = sets
    jn = j1 * j2 * j3
    rows = d * h
    block_a, block_w = _tile_shape(rows, w)
    nsplit, rows_per_split = _choose_split(n * c, rows, block_a, device, split)
    return Launch(
        kernel, (n * c, nsplit), (c, h, w, rows, rows_per_split, *stride),
        dict(J1=j1, J2=j2, J3=j3, J12_PAD=next_pow2(j1 * j2), J3_PAD=next_pow2(j3), BLOCK_A=block_a,
             BLOCK_W=block_w, num_warps=NUM_WARPS, **extra),
        (n, c, nsplit, jn), (c * nsplit * jn, nsplit * jn, jn, 1), nsplit,
    )  # fmt: skip


def set_sums(x5: torch.Tensor, bits: BitTables, sets: SetCounts, split: int | None = None) -> torch.Tensor:
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
    n, c = x5.shape[:2]
    jn = sets[0] * sets[1] * sets[2]
    if x5.numel() == 0:
        return torch.zeros((n, c, jn), dtype=torch.float32, device=x5.device)
    plan = _plane_plan(tuple(x5.shape), x5.stride(), x5.device, tuple(sets), split, _set_sums_kernel)
    partial = torch.empty((n * c, plan.nsplit, jn), dtype=torch.float32, device=x5.device)
    launch(plan.kernel, plan.grid, x5, *bits, partial, *plan.ints, **plan.consts)
    # NOTE: a fixed-order reduction over the splits keeps the result bitwise reproducible.
    out = partial[:, 0] if plan.nsplit == 1 else partial.sum(dim=1)
    return out.view(n, c, jn)


def set_broadcast(
    q: torch.Tensor, bits: BitTables, sets: SetCounts, out: torch.Tensor, split: int | None = None
) -> torch.Tensor:
    """Write ``out[n, c, i] = sum of q[n, c, j] over the product sets j that contain i``; returns ``out``.

    Args:
        q: ``(N, C, J1*J2*J3)`` coefficients (converted to contiguous fp32 here; it is tiny).
        bits, sets: as in ``set_sums``; ``bits`` lengths are ``out``'s ``D``, ``H``, ``W``.
        out: ``(N, C, D, H, W)`` fp32/fp16/bf16 destination, any strides; fully overwritten.
        split: row-splits per plane; ``None`` picks one from the device's SM count.
    """
    _check_launch("set_broadcast", out, bits, sets)
    n, c = out.shape[:2]
    jn = sets[0] * sets[1] * sets[2]
    if tuple(q.shape) != (n, c, jn):
        raise ValueError(f"set_broadcast: q must have shape {(n, c, jn)}, got {tuple(q.shape)}")
    if out.numel() == 0:
        return out
    q32 = q.to(device=out.device, dtype=torch.float32).contiguous()
    plan = _plane_plan(tuple(out.shape), out.stride(), out.device, tuple(sets), split, _set_broadcast_kernel,
                       FROM_GRAD=False, BLOCK_CO=1)  # fmt: skip
    # g_ptr, w_ptr, tapset_ptr and the weight's integers: unused without FROM_GRAD
    launch(plan.kernel, plan.grid, q32, *bits, out, *plan.ints, q32, q32, bits[0], *(0,) * 8, **plan.consts)
    return out


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
def _in_product_set(bd, bh, bw, j: tl.constexpr, J2: tl.constexpr, J3: tl.constexpr):
    """Whether positions with per-dim bit-table entries ``bd``, ``bh``, ``bw`` lie in product set
    ``j = (j1*J2 + j2)*J3 + j3`` (bit ``j1`` of ``bd``, ``j2`` of ``bh`` and ``j3`` of ``bw`` all set)."""
    return (((bd >> (j // (J2 * J3))) & (bh >> ((j // J3) % J2)) & (bw >> (j % J3))) & 1) != 0


@triton.jit
def _channel_block_program(C, BLOCK_C: tl.constexpr):
    """This program of a ``(N, cdiv(C, BLOCK_C), SPLIT)`` grid: ``(n, split, c, c_ok)`` with ``c`` its
    ``[BLOCK_C]`` channels and ``c_ok = c < C``."""
    n = tl.program_id(0)
    cb = tl.program_id(1)
    split = tl.program_id(2)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    return n, split, c, c_ok


@triton.jit
def _set_sums_cl_kernel(
    x_ptr, bits_d_ptr, bits_h_ptr, bits_w_ptr, out_ptr,
    C, H, W, P, p_per_split,
    stride_xn, stride_xc, stride_xp,
    J1: tl.constexpr, J2: tl.constexpr, J3: tl.constexpr, J_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Channels-last ``_set_sums_kernel``: same sums, x read as ``(N, P = D*H*W, C)`` rows of channels.

    Grid: ``(N, cdiv(C, BLOCK_C), SPLIT)``; program ``(n, cb, s)`` reduces positions
    ``[s*p_per_split, (s+1)*p_per_split)`` for channels ``[cb*BLOCK_C, ...)``.

    Pointer contract:
      * ``x_ptr``: fp32/fp16/bf16; element ``(n, c, p)`` at ``n*stride_xn + c*stride_xc + p*stride_xp``
        where ``p = (d*H + h)*W + w`` (valid for channels_last / channels_last_3d: ``stride_xc == 1``).
      * ``bits_*``: as in ``_set_sums_kernel``.
      * ``out_ptr``: contiguous fp32 ``(N, SPLIT, J1*J2*J3, C)`` partial sums (fixed-order reduced later).
    """
    n, split, c, c_ok = _channel_block_program(C, BLOCK_C)
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
                inside = _in_product_set(bd, bh, bw, j, J2, J3)
                part = tl.sum(tl.where(inside[:, None], xt, 0.0), axis=0)  # [BLOCK_C]
                acc += tl.where(jv[:, None] == j, part[None, :], 0.0)
    if J1 * J2 * J3 == 1:
        acc += tl.sum(acc1, axis=0)[None, :]
    nsplit = tl.num_programs(2)
    out_ptrs = out_ptr + ((n.to(tl.int64) * nsplit + split) * (J1 * J2 * J3) + jv[:, None]) * C + c[None, :]
    tl.store(out_ptrs, acc, mask=(jv[:, None] < J1 * J2 * J3) & c_ok[None, :])


@triton.jit
def _grad_broadcast_cl_kernel(
    g_ptr, w_ptr, tapset_ptr, bits_d_ptr, bits_h_ptr, bits_w_ptr, out_ptr,
    C, H, W, P, p_per_split,
    stride_on, stride_oc, stride_op,
    T, CIN_G, COUT_G, C_OUT, s_co, s_ci, s_t, off_g,
    J1: tl.constexpr, J2: tl.constexpr, J3: tl.constexpr, J_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_CO: tl.constexpr,
):  # fmt: skip
    """Channels-last grad_x: ``out[n, c, p] = sum over sets j containing p of q[n, c, j]``, with
    ``q`` computed in the prologue from ``G`` and the weight (see ``_tap_coef``).

    Grid: ``(N, cdiv(C, BLOCK_C), SPLIT)``.  ``out_ptr`` addressed like ``x_ptr`` of
    ``_set_sums_cl_kernel``; every element is written exactly once.
    """
    n, split, c, c_ok = _channel_block_program(C, BLOCK_C)
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
            inside = _in_product_set(bd, bh, bw, j, J2, J3)
            qj = tl.sum(tl.where(jv[:, None] == j, q, 0.0), axis=0)  # [BLOCK_C]
            val += tl.where(inside[:, None], qj[None, :], 0.0)
        ptrs = base + p.to(tl.int64)[:, None] * stride_op + c.to(tl.int64)[None, :] * stride_oc
        tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & c_ok[None, :])


#: Most product sets the channels-last kernels unroll (one masked reduction per set and tile).
MAX_CL_SETS = 64


_CL_TILE_ELEMENTS = 4096


_MAX_BLOCK_C = 64


def _channels_innermost(x5: torch.Tensor) -> bool:
    """x5's spatial positions flatten to one stride and channels are unit-stride (channels_last)."""
    return channels_innermost_meta(tuple(x5.shape), x5.stride())


def channels_innermost_meta(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
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


def _cl_plan(
    shape: tuple[int, ...], stride: tuple[int, ...], device: torch.device, sets: tuple[int, int, int],
    split: int | None, kernel: Any,
) -> Launch:
    """Launch of a channels-last kernel (``_set_sums_cl_kernel``, ``_grad_broadcast_cl_kernel``) over a
    non-empty 5-D ``shape``/``stride`` tensor that ``channels_innermost_meta`` accepts: grid
    ``(N, cdiv(C, BLOCK_C), SPLIT)``, integer arguments ``(C, H, W, P, p_per_split, stride_n,
    stride_c, stride_p)``; the buffer fields describe the sums' ``(N, SPLIT, J, C)`` partial buffer."""
    n, c, d, h, w = shape
    j1, j2, j3 = sets
    jn = j1 * j2 * j3
    positions = d * h * w
    block_p, block_c = _cl_tiles(positions, c)
    cblocks = cdiv(c, block_c)
    nsplit, per = _choose_split(n * cblocks, positions, block_p, device, split)
    return Launch(
        kernel, (n, cblocks, nsplit), (c, h, w, positions, per, stride[0], stride[1], stride[4]),
        dict(J1=j1, J2=j2, J3=j3, J_PAD=next_pow2(jn), BLOCK_P=block_p, BLOCK_C=block_c, num_warps=NUM_WARPS),
        (n, nsplit, jn, c), (nsplit * jn * c, 1, jn * c, c), nsplit,
    )  # fmt: skip


def _pass_plan(
    shape: tuple[int, ...], stride: tuple[int, ...], device: torch.device, sets: tuple[int, int, int],
    split: int | None, cl_kernel: Any, plane_kernel: Any, **extra: Any,
) -> Launch | None:
    """Tiles, split, grid and integer arguments of a pass over an x-sized tensor (the sums forward,
    the broadcast backward walk it the same way): ``cl_kernel`` for channels-last data with at most
    ``MAX_CL_SETS`` product sets, else ``plane_kernel`` (with the constexprs ``extra``); ``None``
    when it is empty."""
    if math.prod(shape) == 0:
        return None
    if channels_innermost_meta(shape, stride) and sets[0] * sets[1] * sets[2] <= MAX_CL_SETS:
        return _cl_plan(shape, stride, device, sets, split, cl_kernel)
    return _plane_plan(shape, stride, device, sets, split, plane_kernel, **extra)


@cached_plans
def plan_set_sums(
    shape: tuple[int, ...], stride: tuple[int, ...], device: torch.device, sets: tuple[int, int, int],
    split: int | None,
) -> Launch | None:
    """``None`` for an empty x (no launch); the buffer fields describe the partial sums."""
    return _pass_plan(shape, stride, device, sets, split, _set_sums_cl_kernel, _set_sums_kernel)


def set_sums_partial(
    x5: torch.Tensor, bits: BitTables, sets: SetCounts, split: int | None = None
) -> tuple[torch.Tensor, tuple[int, int, int, int], int]:
    """One pass over x: per-split partial set sums, not yet reduced over the splits.

    Returns ``(partial, (rs_n, rs_c, rs_s, rs_j), nsplit)``: fp32 element ``(n, c, split, j)`` of
    ``partial`` at ``n*rs_n + c*rs_c + split*rs_s + j*rs_j``.  Channels-last x (``_channels_innermost``)
    takes the channels-innermost kernel, everything else the plane kernel.
    """
    _check_launch("set_sums_partial", x5, bits, sets)
    plan = plan_set_sums(tuple(x5.shape), x5.stride(), x5.device, tuple(sets), split)
    if plan is None:
        n, c = x5.shape[:2]
        z = torch.zeros((n, c, 1, sets[0] * sets[1] * sets[2]), dtype=torch.float32, device=x5.device)
        return z, tuple(z.stride()), 1  # type: ignore[return-value]
    partial = torch.empty(plan.buffer_shape, dtype=torch.float32, device=x5.device)
    plan.launch(x5, bits[0], bits[1], bits[2], partial, *plan.ints)
    return partial, plan.buffer_strides, plan.nsplit


@cached_plans
def plan_broadcast(
    shape: tuple[int, ...], stride: tuple[int, ...], device: torch.device, sets: tuple[int, int, int],
    cout_g: int, split: int | None,
) -> Launch | None:
    """``None`` for an empty grad_x (no launch); the buffer fields are unused."""
    block_co = min(next_pow2(cout_g), 128)
    plan = _pass_plan(shape, stride, device, sets, split, _grad_broadcast_cl_kernel, _set_broadcast_kernel,
                      FROM_GRAD=True, BLOCK_CO=block_co)  # fmt: skip
    if plan is not None and plan.kernel is _grad_broadcast_cl_kernel:
        plan.consts["BLOCK_CO"] = min(block_co, 32)
    return plan


def grad_broadcast(
    coef: torch.Tensor, weight: WeightLayout, tapset: torch.Tensor, bits: BitTables, sets: SetCounts,
    out: torch.Tensor, split: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Write grad_x into ``out`` (5-D, any strides; channels-last takes the channels-innermost kernel)
    from ``G`` (``coef``, fp32 (N, C_out)) and the weight: every element written once; returns ``out``."""
    _check_launch("grad_broadcast", out, bits, sets)
    plan = plan_broadcast(tuple(out.shape), out.stride(), out.device, tuple(sets), weight.cout_g, split)
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
