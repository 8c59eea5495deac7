"""Tile configurations of the conv family's kernels and the heuristic that picks one per problem.

A :class:`TileConfig` is everything about a launch that changes speed but not the result (apart
from the order of the fp32 sums, which the tile's ``BLOCK_K`` fixes): the three GEMM block sizes, the
warps, the software-pipeline depth, and how the K axis is walked (``flat_k``, see below).  It is a
plain frozen dataclass so that a per-shape cache (measured on the GPU) can store and return one;
:func:`pick_tile` is the fallback that needs no measurement.  Nothing here is tuned yet: the numbers
follow the usual shape of a Hopper GEMM (64/128-row tiles, 4-8 warps, 3-4 stages), not a measurement.

The K axis (``C_in/groups * KD * KH * KW``, the weight's order: taps outer, channels inner):

* ``flat_k=False`` (*tap-major*): a K step is ``BLOCK_K`` channels of ONE tap.  Each row of the A
  tile then reads ``BLOCK_K`` contiguous channels (channels-last), and the bounds test of the tap is one
  test per row.  Wants ``C_in/groups >= BLOCK_K``; the channels are padded to a multiple of
  ``BLOCK_K`` in the weight matrix (the A tile masks them).
* ``flat_k=True``: a K step is ``BLOCK_K`` consecutive entries of the flattened (tap, channel) axis,
  which may span several taps.  For few channels per group (an RGB stem: 3 channels x 49 taps;
  depthwise: 1 x 9), where tap-major steps would be mostly padding.  The bounds test is per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..host import next_pow2
from ..plan_cache import ContractError

#: Channels per group below which K is walked flat (a tap-major step would be mostly padding).
FLAT_K_BELOW = 16


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration: ``[block_m, block_k] x [block_k, block_n]`` dots (powers of two, at
    least 16: ``tl.dot``'s minimum), ``num_warps``, ``num_stages`` (the K loop's pipeline depth) and
    the K walk (``flat_k``, module docstring)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    flat_k: bool = False

    def check(self) -> None:
        """Raise :class:`ContractError` unless the blocks are powers of two >= 16 and the launch
        options are positive."""
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ContractError(f"tile {name} must be a power of two >= 16, got {v}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1) or self.num_stages < 1:
            raise ContractError(f"tile num_warps must be a power of two and num_stages >= 1, got "
                                f"{self.num_warps} / {self.num_stages}")  # fmt: skip


def pick_tile(cin_g: int, cout_g: int, taps: int, m: int, dtype: torch.dtype) -> TileConfig:
    """A tile for a conv of ``cin_g`` input and ``cout_g`` output channels per group, ``taps`` kernel
    taps, ``m`` output positions and operand ``dtype``, without measuring (module docstring).

    * N: all the group's output channels up to 128 (64 for fp32, whose operands take twice the
      shared memory), so that ``x`` is read once per M tile where the layer is narrow.
    * K: tap-major with the widest ``BLOCK_K`` in (64, 32, 16) that divides ``cin_g`` (no masked
      channel step), else the widest that fits; flat when ``cin_g < FLAT_K_BELOW``.  fp32 caps it at 32.
    * M: 128 rows where the problem has several tiles of 128 and N is at most 64 (the accumulator stays
      within 64 fp32 registers per thread on 4 warps), else 64; never wider than ``m`` needs.
    """
    wide = dtype != torch.float32
    block_n = min(max(16, next_pow2(cout_g)), 128 if wide else 64)
    k_caps = (64, 32, 16) if wide else (32, 16)
    flat_k = cin_g < FLAT_K_BELOW
    if flat_k:
        block_k = 32 if cin_g * taps > 16 else 16
    else:
        block_k = next((k for k in k_caps if cin_g % k == 0), None) or next(k for k in k_caps if k <= cin_g)
    block_m = 128 if (m >= 4 * 128 and block_n <= 64) else 64
    block_m = min(block_m, max(16, next_pow2(m)))
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    return TileConfig(block_m, block_n, block_k, num_warps, num_stages=3 if wide else 2, flat_k=flat_k)
