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


@dataclass(frozen=True)
class BatchNormGradSums:
    """The two per-channel sums a BatchNorm backward needs from the gradient of its output ``grad_z``
    (as ``dgrad``'s epilogue produces them): ``sum_dz = Σ grad_z`` (the gradient of its shift ``β``)
    and ``sum_dz_xhat = Σ grad_z · x̂`` (that of its scale ``γ``), float64 ``(C,)`` over the ``count``
    positions ``N * D * H * W``.  With them the input gradient is
    ``γ · rstd · (grad_z - sum_dz / count - x̂ · sum_dz_xhat / count)`` (batch statistics)."""

    sum_dz: torch.Tensor
    sum_dz_xhat: torch.Tensor
    count: int


def reduce_grad_partials(partials: torch.Tensor, count: int) -> BatchNormGradSums:
    """The sums from the dgrad epilogue's partials, fp32 ``(2, M_TILES, C)`` contiguous (row 0 the tiles'
    ``Σ grad_z``, row 1 their ``Σ grad_z · x̂``), in float64 over the tiles in one fixed-shape reduction
    (bitwise reproducible, as :func:`reduce_partials`)."""
    total = partials.sum(dim=1, dtype=torch.float64)
    return BatchNormGradSums(total[0], total[1], count)


def empty_grad_sums(c: int, device: torch.device) -> BatchNormGradSums:
    """The sums of an empty input (no position): zeros, count 0."""
    zeros = torch.zeros(c, dtype=torch.float64, device=device)
    return BatchNormGradSums(zeros, zeros.clone(), 0)
