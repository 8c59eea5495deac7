"""Statistics of a conv's output, as the epilogue produces them for the next normalization: per
channel for a BatchNorm (:class:`ChannelStats`), per sample and group of channels for a GroupNorm
(:class:`GroupStats`, from a launch whose tiles do not cross samples).

The kernel writes one row of partials per M tile (``epilogue.store_tile``), each channel's: a shift
``k`` (the tile's mean as fp32 rounds it), the sum of the values less ``k``, and the sum of their
squared deviations from their mean.  :func:`reduce_partials` combines the tiles as Chan et al.'s
parallel variance does, in float64, with torch reductions over fixed shapes: the result is the same
bits on every run (no atomics anywhere); about ten small torch ops per call (host time a fused
kernel could take back).  WHY the shift: where a channel's mean dwarfs its spread (a
conv with a large bias), an fp32 tile sum rounds at ``2**-24`` of the sum, and so would an fp32 mean;
the tile's mean as ``k`` plus the small, nearly exact sum of ``y - k`` keeps it.  And WHY not sums of
squares: ``E[y^2] - E[y]^2`` from fp32 partials leaves the rounding of ``mean^2`` as an error of the
variance itself, where eager's BatchNorm (Welford) has none.  NOTE: on the case of
``tests/kernels/test_conv_family_fprop.py -k dwarfs`` (a bias of 3000 over a spread of about 1, fp32,
16-row tiles) the variance was 4-22% off with fp32 sums and sums of squares per tile, 2e-6-3e-5 off
with tile sums and deviations without the shift, and is 4e-10-2.5e-8 off with it (fp32 ``Tensor.var``
of the same output: 3e-9-3e-8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChannelStats:
    """``sum`` and ``m2``: float64 ``(C_out,)`` sums over the ``count`` output positions (``N * OD * OH
    * OW``) of each channel's stored values and of their squared deviations from the channel's mean."""

    sum: torch.Tensor
    m2: torch.Tensor
    count: int

    def mean(self) -> torch.Tensor:
        """float64 ``(C_out,)`` mean (NaN for an empty output)."""
        return self.sum / self.count if self.count else torch.full_like(self.sum, float("nan"))

    def var(self, unbiased: bool = False) -> torch.Tensor:
        """float64 ``(C_out,)`` variance, biased (BatchNorm normalises with it) or unbiased (its
        running estimate); NaN where the count does not define it."""
        if self.count - int(unbiased) <= 0:
            return torch.full_like(self.m2, float("nan"))
        return self.m2 / (self.count - int(unbiased))

    def sum_sq(self) -> torch.Tensor:
        """float64 ``(C_out,)`` sums of the squared values (``m2 + sum^2 / count``), for comparisons
        with a pass that sums squares."""
        return self.m2 + (self.sum * self.sum / self.count if self.count else 0.0)


@dataclass(frozen=True)
class GroupStats(ChannelStats):
    """GroupNorm's statistics of a conv's output, as :class:`ChannelStats` (its methods too) with
    ``sum`` and ``m2`` float64 ``(N, G)`` over the ``count`` values (``C_out / G`` channels times ``OD *
    OH * OW`` positions) of each sample's group of channels; GroupNorm normalises with the biased
    ``var()``."""


def _combine(partials: torch.Tensor, rows: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, m2)`` float64 of the values whose partials (fp32 ``(3, ...)``: shift, shifted sum,
    squared deviations) are combined over ``dims`` (of the partials less their first axis), ``rows``
    (broadcastable to them) each partial's count: ``mean_t = k + Σ(y - k) / n_t``, ``M2 = Σ_t M2_t +
    Σ_t n_t (mean_t - mean)^2`` (Chan et al.), in a fixed order."""
    shift, shifted_sum, m2 = partials.to(torch.float64).unbind(0)
    tile_mean = shift + shifted_sum / rows
    total = (rows * tile_mean).sum(dim=dims, keepdim=True)
    count = (rows * torch.ones_like(tile_mean)).sum(dim=dims, keepdim=True)
    spread = rows * (tile_mean - total / count) ** 2
    return total.sum(dim=dims), m2.sum(dim=dims) + spread.sum(dim=dims)  # (size 1 along dims: summed away)


def reduce_partials(partials: torch.Tensor, count: int, block_m: int) -> ChannelStats:
    """The per-channel statistics from the kernel's partials, fp32 ``(3, M_TILES, C_out)`` contiguous
    (per tile: the shift ``k``, the sum of the values less ``k``, the sum of their squared deviations
    from their mean), over ``count`` output positions, tile ``t`` holding rows ``[t * block_m, (t +
    1) * block_m)`` of them."""
    starts = torch.arange(partials.shape[1], dtype=torch.float64, device=partials.device) * block_m
    rows = (count - starts).clamp(max=block_m)[:, None]
    total, m2 = _combine(partials, rows, (0,))
    return ChannelStats(total, m2, count)


def reduce_group_partials(partials: torch.Tensor, n: int, rows_per_sample: int, block_m: int,
                          groups: int) -> GroupStats:  # fmt: skip
    """GroupNorm's statistics from the kernel's partials of a launch whose tiles do not cross samples,
    fp32 ``(3, n * T, C_out)`` contiguous (as :func:`reduce_partials`'s; tile ``i * T + t`` holds rows
    ``[t * block_m, (t + 1) * block_m)`` of sample ``i``'s ``rows_per_sample``, ``T`` their tiles),
    over each sample's ``groups`` groups of ``C_out / groups`` consecutive channels."""
    tiles, c_out = partials.shape[1] // n, partials.shape[2]
    starts = torch.arange(tiles, dtype=torch.float64, device=partials.device) * block_m
    rows = (rows_per_sample - starts).clamp(max=block_m).view(1, tiles, 1, 1)
    grouped = partials.view(3, n, tiles, groups, c_out // groups)
    total, m2 = _combine(grouped, rows, (1, 3))
    return GroupStats(total, m2, rows_per_sample * (c_out // groups))


def empty_group_stats(groups: int, count: int, device: torch.device) -> GroupStats:
    """The statistics of an empty batch (no sample): ``(0, groups)`` sums."""
    zeros = torch.zeros(0, groups, dtype=torch.float64, device=device)
    return GroupStats(zeros, zeros.clone(), count)


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
