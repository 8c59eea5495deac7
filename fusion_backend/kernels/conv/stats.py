"""Per-channel statistics of a conv's output, as the epilogue produces them for the next BatchNorm.

The kernel writes one row of partial sums per M tile (``epilogue.store_tile``); :func:`reduce_partials`
sums the rows in float64 with one torch reduction over a fixed shape, so the result is the same bits
on every run (no atomics anywhere).  Float64 because the variance is formed as ``E[y^2] - E[y]^2``:
each tile's fp32 partials carry a relative error of about ``BLOCK_M * 2**-24``, the sum over thousands
of tiles adds none, and the subtraction happens in float64.  (A channel whose mean is far larger than
its spread still loses digits to the fp32 partials; Welford partials would not, at two more values per
tile and channel.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChannelStats:
    """``sum`` and ``sum_sq``: float64 ``(C_out,)`` sums over the ``count`` output positions (``N *
    OD * OH * OW``) of each channel's stored values and of their squares."""

    sum: torch.Tensor
    sum_sq: torch.Tensor
    count: int

    def mean(self) -> torch.Tensor:
        """float64 ``(C_out,)`` mean (NaN for an empty output)."""
        return self.sum / self.count if self.count else torch.full_like(self.sum, float("nan"))

    def var(self, unbiased: bool = False) -> torch.Tensor:
        """float64 ``(C_out,)`` variance, biased (BatchNorm normalises with it) or unbiased (its
        running estimate); clamped at 0 against the rounding of ``E[y^2] - E[y]^2``."""
        mean = self.mean()
        var = (self.sum_sq / self.count - mean * mean).clamp_min(0) if self.count else mean
        if unbiased:
            var = var * self.count / (self.count - 1) if self.count > 1 else torch.full_like(var, float("nan"))
        return var


def reduce_partials(partials: torch.Tensor, count: int) -> ChannelStats:
    """The statistics from the kernel's partials, fp32 ``(2, M_TILES, C_out)`` contiguous (row 0 the
    tiles' sums, row 1 their sums of squares), over ``count`` output positions."""
    total = partials.sum(dim=1, dtype=torch.float64)
    return ChannelStats(total[0], total[1], count)


def empty_stats(c_out: int, device: torch.device) -> ChannelStats:
    """The statistics of an empty output (no position): zero sums, count 0."""
    zeros = torch.zeros(c_out, dtype=torch.float64, device=device)
    return ChannelStats(zeros, zeros.clone(), 0)
