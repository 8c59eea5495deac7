"""Copy a tensor into another memory format (and dtype) at memory speed: ``relayout(src, dst)``.

WHY: the channels-last library backward (``ops/conv_epilogue.LibraryBackward``) relays x into
channels-last and the input gradient back.  torch's strided copy moves such tensors at about a
fifth of the memory's bandwidth (``docs/perf/RESULTS.md``, *Kernel design measurements*): it walks the destination in order and gathers the source
with a stride.  A tile of channels x positions read along one layout's contiguous axis and
written along the other's (Triton converts the register layout between the two through shared
memory) does not.

Contract of ``relayout(src, dst)``: same shape ``(N, C, *spatial)``, any float dtypes (cast on the
copy, as ``Tensor.copy_``), any strides whose spatial dims flatten to one axis (contiguous,
channels-last and the 3-d forms do; ``relayout_supported`` says).  CUDA tensors, or CPU tensors
under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .host import cdiv, next_pow2
from .launch import FastLaunch
from .plan_cache import PlanCache, spatial_flat_strides


@triton.jit
def _relayout_kernel(
    src_ptr, dst_ptr, C, S, num_s_blocks,
    src_sn, src_sc, src_ss, dst_sn, dst_sc, dst_ss,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """dst[n, c, s] = src[n, c, s] for one (sample, position block, channel block) tile; strides
    in elements, spatial dims flattened to ``s``."""
    pid0 = tl.program_id(0)
    n = (pid0 // num_s_blocks).to(tl.int64)
    sb = pid0 % num_s_blocks
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[:, None]
    s = (sb * BLOCK_S + tl.arange(0, BLOCK_S))[None, :]
    mask = (c < C) & (s < S)
    c64, s64 = c.to(tl.int64), s.to(tl.int64)
    v = tl.load(src_ptr + n * src_sn + c64 * src_sc + s64 * src_ss, mask=mask)
    tl.store(dst_ptr + n * dst_sn + c64 * dst_sc + s64 * dst_ss, v.to(dst_ptr.dtype.element_ty), mask=mask)


def relayout_supported(src: torch.Tensor, dst: torch.Tensor) -> str | None:
    """None when ``relayout(src, dst)`` serves the pair, else why not."""
    if src.shape != dst.shape:
        return f"shapes differ: {tuple(src.shape)} vs {tuple(dst.shape)}"
    if src.dim() < 3:
        return f"a {src.dim()}-d tensor (needs (N, C, *spatial))"
    if not (src.is_floating_point() and dst.is_floating_point()):
        return f"non-float dtypes {src.dtype} -> {dst.dtype}"
    for name, t in (("source", src), ("destination", dst)):
        if spatial_flat_strides(t) is None:
            return f"the {name}'s spatial dims do not flatten (strides {t.stride()})"
    return None


#: A tile of 64 channels x 64 positions, 8 warps (each side moves runs of >= 128 bytes in bf16).
#: NOTE: measured on an H100 on a (64, 64, 256, 256) tensor, either direction: 0.72 ms fp32 / 0.37 ms
#: bf16 per copy (2.97 TB/s; the device copies at 3.01), torch's ``copy_`` 1.1-2.2 ms.  The other
#: tiles of 64 channels (32-128 positions, 4 or 8 warps) ran within 3 % of it, tiles of 32 channels
#: up to 1.2x and of 16 channels up to 1.9x slower.
TILE = (64, 64, 8)

_LAUNCHES = PlanCache()


def relayout(src: torch.Tensor, dst: torch.Tensor, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (see the module docstring); returns ``dst``.  ``tile``:
    ``(BLOCK_C, BLOCK_S, num_warps)``, ``TILE`` by default (for probes).  Raises ValueError for
    layouts it does not serve (``relayout_supported``)."""
    why = relayout_supported(src, dst)
    if why is not None:
        raise ValueError(f"relayout: {why}")
    return _launch(src, dst, tile)


def relayout_or_copy(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)``: through the kernel where it serves the layouts, torch's copy otherwise."""
    if relayout_supported(src, dst) is not None:
        return dst.copy_(src)
    return _launch(src, dst, None)


def _launch(src: torch.Tensor, dst: torch.Tensor, tile: tuple[int, int, int] | None) -> torch.Tensor:
    launch = _LAUNCHES.plan((src, dst, tile), lambda: _plan(src, dst, tile or TILE))
    if launch is not None:
        launch(src, dst)
    return dst


def _plan(src: torch.Tensor, dst: torch.Tensor, tile: tuple[int, int, int]) -> FastLaunch | None:
    n, c = src.shape[:2]
    s = math.prod(src.shape[2:])
    if src.numel() == 0:
        return None
    block_c = min(tile[0], next_pow2(c))
    block_s = min(tile[1], next_pow2(s))
    num_s_blocks = cdiv(s, block_s)
    grid = (n * num_s_blocks, cdiv(c, block_c))
    ints = (c, s, num_s_blocks, *spatial_flat_strides(src), *spatial_flat_strides(dst))
    return FastLaunch(_relayout_kernel, grid, dict(BLOCK_C=block_c, BLOCK_S=block_s, num_warps=tile[2]), fixed=ints)


class PlannedRelayout:
    """``relayout`` from one source layout into fresh tensors of one destination layout, worked out
    once: ``plan(src) -> dst`` (``dst`` newly allocated with the plan's shape, strides and dtype).

    The op plans (``ops/conv_epilogue``) relay x, the weight or a gradient on every call, and the
    step of a small conv waits on the host.  WHY a plan: ``relayout_or_copy`` checks both layouts,
    builds two cache keys and looks its launch up on every call, which with the
    ``torch.empty(..., memory_format=...)`` before it was a third of the channels-last library
    forward's host time (cProfile of Conv2d 128->256 k3 s2 on 32x128x28x28 on the H100 host).
    Contract: ``src`` has the plan's source shape and dtype (the caller's plan signature guarantees
    it); a source with other strides than planned takes ``relayout_or_copy`` (still correct).  Keeps
    no tensor: a plan outlives the calls, and a tensor it made during a CUDA-graph capture would live
    in the graph's pool.
    """

    def __init__(self, src: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> None:
        self.src_stride = src.stride()
        self.layout = (tuple(shape), tuple(stride), dtype)
        dst = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        src_meta = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="meta")
        #: whether the kernel serves the pair (else torch's copy); its launch (None: nothing to copy)
        self.by_kernel = relayout_supported(src_meta, dst) is None
        self.launch = _plan(src_meta, dst, TILE) if self.by_kernel else None

    def __call__(self, src: torch.Tensor) -> torch.Tensor:
        shape, stride, dtype = self.layout
        dst = torch.empty_strided(shape, stride, dtype=dtype, device=src.device)
        if src.stride() != self.src_stride:
            return relayout_or_copy(src, dst)
        if self.launch is not None:
            self.launch(src, dst)
        elif not self.by_kernel:
            dst.copy_(src)
        return dst
