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

Measured on an H100 (torch 2.11, triton 3.6) at the seed's size, x (16, 64, 512, 512) fp32 with one
set per dim: ``_set_sums_kernel`` 0.36 ms (~3 TB/s of x), ``_set_broadcast_kernel`` 0.34 ms; with
three sets per dim (a padded "same" conv) 0.59 / 0.46 ms.  channels_last x is read in place but with
strided loads along W: 2.7 ms for the same tensor.  NOTE: a channels-innermost tiling (a program
per spatial block, a vector of channels per row) would restore full bandwidth; not written yet, and
``x.contiguous()`` first (~1.1 ms, +1 copy of x in memory) would also beat the strided reads.

The launchers take 5-D views ``(N, C, D, H, W)`` (1-d and 2-d problems unsqueezed in front) with any
strides, so channels_last inputs are read in place.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

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


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _tile_shape(rows: int, width: int) -> tuple[int, int]:
    block_w = min(_next_pow2(width), _MAX_BLOCK_W)
    block_a = min(_next_pow2(rows), max(1, _TILE_ELEMENTS // block_w))
    return block_a, block_w


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _choose_split(
    planes: int, rows: int, block_a: int, device: torch.device, split: int | None
) -> tuple[int, int]:
    """Return ``(split, rows_per_split)``; ``rows_per_split`` is a multiple of ``block_a``."""
    row_tiles = triton.cdiv(rows, block_a)
    if split is None:
        if device.type == "cuda":
            split = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), max(planes, 1))
        else:
            split = 1  # the interpreter runs programs one after another: parallelism buys nothing
    split = max(1, min(int(split), row_tiles))
    rows_per_split = triton.cdiv(row_tiles, split) * block_a
    return triton.cdiv(rows, rows_per_split), rows_per_split


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
    J1: tl.constexpr,
    J2: tl.constexpr,
    J3: tl.constexpr,
    J12_PAD: tl.constexpr,
    J3_PAD: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Adjoint of ``_set_sums_kernel``: ``out[n, c, i] = sum of q[n, c, j] over the sets j containing i``.

    Grid: ``(N*C, SPLIT)``; program ``(p, s)`` writes rows ``[s*rows_per_split, ...)`` of plane ``p``.
    Every output element is written exactly once (no accumulation into memory).

    Pointer contract:
      * ``q_ptr``: contiguous fp32 ``(N*C, J1*J2*J3)``, set index ``(j1*J2 + j2)*J3 + j3``.
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


def _check_launch(
    name: str, t: torch.Tensor, bits: tuple[torch.Tensor, ...], sets: tuple[int, int, int]
) -> None:
    if t.dim() != 5:
        raise ValueError(f"{name}: expected a 5-D (N, C, D, H, W) tensor, got shape {tuple(t.shape)}")
    if t.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} has no kernel (supported: {_KERNEL_DTYPES})")
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
        J12_PAD=_next_pow2(j1 * j2),
        J3_PAD=_next_pow2(j3),
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
        J1=j1,
        J2=j2,
        J3=j3,
        J12_PAD=_next_pow2(j1 * j2),
        J3_PAD=_next_pow2(j3),
        BLOCK_A=block_a,
        BLOCK_W=block_w,
        num_warps=_NUM_WARPS,
    )
    return out
