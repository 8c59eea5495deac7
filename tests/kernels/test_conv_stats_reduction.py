"""The conv family's statistics reduction (``kernels/conv/stats.py``, ``PartialsReduction``): the store's
per-tile partials combined into float64 sums and sums of squared deviations, against the same
statistics computed straight from the values in float64.

The partials are made here as the store makes them (per tile and channel, in fp32: the tile's mean as
the shift ``k``, the sum of ``y - k``, the squared deviations from the tile's mean), from values with a
mean that dwarfs their spread, so a combination that lost the shift or summed squares would show.
Sizes are chosen so that the kernel's loops run more than once: more tiles than one step takes (256),
channel counts that fill no block of 16, groups wider than 16 channels, last tiles that are partial.
"""

from __future__ import annotations

import pytest
import torch

from fusion_backend.kernels import arrival
from fusion_backend.kernels.conv.stats import BatchNormForm, ChannelStats, GroupStats, PartialsReduction
from fusion_backend.kernels.plan_cache import ContractError
from fusion_backend.testing import stable_seed

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _partials(values: torch.Tensor, block_m: int) -> torch.Tensor:
    """fp32 ``(3, tiles, C)`` partials of float64 ``values`` ``(rows, C)`` (one run of tiles)."""
    parts = []
    for start in range(0, values.shape[0], block_m):
        y = values[start:start + block_m].float()
        k = y.mean(0)
        e = y - k
        d = e - e.sum(0) / y.shape[0]
        parts.append(torch.stack([k, e.sum(0), (d * d).sum(0)]))
    return torch.stack(parts, 1).contiguous()


def _combined(partials: torch.Tensor, rows: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials combined in float64 by plain torch (Chan et al., over ``dims``; ``rows`` each
    tile's count, broadcastable): what the kernel must compute up to float64 rounding."""
    shift, shifted_sum, m2 = partials.double().unbind(0)
    tile_mean = shift + shifted_sum / rows
    total = (rows * tile_mean).sum(dim=dims, keepdim=True)
    count = (rows * torch.ones_like(tile_mean)).sum(dim=dims, keepdim=True)
    spread = rows * (tile_mean - total / count) ** 2
    return total.sum(dim=dims), m2.sum(dim=dims) + spread.sum(dim=dims)


def _tile_rows(rows: int, block_m: int) -> torch.Tensor:
    starts = torch.arange(0, rows, block_m, dtype=torch.float64)
    return (rows - starts).clamp(max=block_m)


def _check(stats: ChannelStats, combined: tuple[torch.Tensor, torch.Tensor], values: torch.Tensor) -> None:
    """The kernel's sums equal the float64 combination of the same partials (to float64 rounding), and
    are within the fp32 partials' own rounding of the statistics of the values themselves."""
    total, m2 = combined
    torch.testing.assert_close(stats.sum.cpu(), total, rtol=1e-13, atol=0)
    torch.testing.assert_close(stats.m2.cpu(), m2, rtol=1e-11, atol=0)
    y = values.float().double()  # the values as the store wrote them (rounded to fp32 here)
    torch.testing.assert_close(stats.sum.cpu(), y.sum(-1), rtol=1e-9, atol=0)
    torch.testing.assert_close(stats.m2.cpu(), ((y - y.mean(-1, keepdim=True)) ** 2).sum(-1), rtol=2e-6, atol=0)


def _values(rows: int, c: int, seed: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(stable_seed(seed))
    mean = 3000.0 + 100.0 * torch.randn(c, generator=g, dtype=torch.float64)
    return mean + torch.randn(rows, c, generator=g, dtype=torch.float64) * (0.5 + torch.rand(c, generator=g))


@pytest.mark.parametrize("rows,c,block_m", [(37, 5, 16), (16 * 300 + 3, 21, 16), (64, 16, 64), (1, 3, 16)],
                         ids=["tail", "several-steps", "one-tile", "one-row"])  # fmt: skip
def test_channel_statistics_match_float64(rows: int, c: int, block_m: int, kernel_device: str) -> None:
    values = _values(rows, c, f"channel {rows} {c}")
    partials = _partials(values, block_m).to(kernel_device)
    stats = PartialsReduction(partials.shape[1], c, block_m, rows, torch.device(kernel_device))(partials)
    assert isinstance(stats, ChannelStats) and stats.count == rows
    _check(stats, _combined(partials.cpu(), _tile_rows(rows, block_m)[:, None], (0,)), values.T)
    again = PartialsReduction(partials.shape[1], c, block_m, rows, torch.device(kernel_device))(partials)
    assert torch.equal(again.sum, stats.sum) and torch.equal(again.m2, stats.m2)  # the same bits


@pytest.mark.parametrize("n,rows_per_sample,c,groups,block_m", [(3, 37, 8, 2, 16), (2, 16 * 260, 6, 3, 16),
                                                                 (2, 20, 40, 2, 16), (1, 5, 4, 4, 16)],
                         ids=["tails", "several-steps", "wide-groups", "one-channel-groups"])  # fmt: skip
def test_group_statistics_match_float64(n: int, rows_per_sample: int, c: int, groups: int, block_m: int,
                                        kernel_device: str) -> None:  # fmt: skip
    values = _values(n * rows_per_sample, c, f"group {n} {rows_per_sample} {c} {groups}")
    per_sample = values.view(n, rows_per_sample, c)
    partials = torch.cat([_partials(s, block_m) for s in per_sample], 1).contiguous().to(kernel_device)
    reduce = PartialsReduction(partials.shape[1], c, block_m, rows_per_sample, torch.device(kernel_device),
                               groups=groups, samples=n)  # fmt: skip
    stats = reduce(partials)
    assert isinstance(stats, GroupStats) and stats.count == rows_per_sample * (c // groups)
    tiles = partials.shape[1] // n
    rows = _tile_rows(rows_per_sample, block_m).view(1, tiles, 1, 1)
    combined = _combined(partials.cpu().view(3, n, tiles, groups, c // groups), rows, (1, 3))
    grouped = per_sample.view(n, rows_per_sample, groups, c // groups).transpose(1, 2).reshape(n, groups, -1)
    _check(stats, combined, grouped)


def _irregular_tiles(rows: int, block_m: int, seed: str) -> list[int]:
    """Tile sizes summing to ``rows``, each 1..``block_m``, in no regular pattern (parts of unequal
    counts anywhere in the order)."""
    g = torch.Generator().manual_seed(stable_seed(seed))
    sizes, left = [], rows
    while left:
        sizes.append(min(left, int(torch.randint(1, block_m + 1, (1,), generator=g))))
        left -= sizes[-1]
    return sizes


def _partials_of(values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """fp32 ``(3, tiles, C)`` partials of ``values`` cut into consecutive tiles of ``sizes`` rows."""
    return torch.cat([_partials(chunk, chunk.shape[0]) for chunk in values.split(sizes)], 1).contiguous()


@pytest.mark.parametrize("rows,c", [(300, 5), (16 * 400 + 7, 21)], ids=["one-launch", "two-launches"])
def test_channel_statistics_of_tiles_with_given_rows_match_float64(rows: int, c: int, kernel_device: str) -> None:
    """``tile_rows``: tiles of any sizes (the TMA forward's program lanes), per channel, in one launch and in the
    split over more than 256 tiles (whose spans then hold given rows too)."""
    values = _values(rows, c, f"given {rows} {c}")
    sizes = _irregular_tiles(rows, 16, f"given sizes {rows}")
    partials = _partials_of(values, sizes).to(kernel_device)
    stats = PartialsReduction(len(sizes), c, 16, rows, torch.device(kernel_device), tile_rows=sizes)(partials)
    assert stats.count == rows
    tile_rows = torch.tensor(sizes, dtype=torch.float64)[:, None]
    _check(stats, _combined(partials.cpu(), tile_rows, (0,)), values.T)
    uniform = PartialsReduction(len(sizes), c, 16, rows, torch.device(kernel_device))(partials)
    assert not torch.allclose(uniform.m2, stats.m2, rtol=1e-3)  # the counts matter: taken as 16 each, wrong


def test_group_statistics_of_tiles_with_given_rows_match_float64(kernel_device: str) -> None:
    """``tile_rows`` with per-sample tiles (GroupNorm's statistics over tiles of unequal counts in each
    sample)."""
    n, per, c, groups = 3, 45, 8, 2
    values = _values(n * per, c, "given groups")
    sizes = _irregular_tiles(per, 16, "given group sizes")  # every sample cut the same way
    partials = torch.cat([_partials_of(s, sizes) for s in values.view(n, per, c)], 1).contiguous().to(kernel_device)
    stats = PartialsReduction(partials.shape[1], c, 16, per, torch.device(kernel_device), groups=groups, samples=n,
                              tile_rows=sizes * n)(partials)  # fmt: skip
    tiles = len(sizes)
    rows = torch.tensor(sizes, dtype=torch.float64).view(1, tiles, 1, 1)
    combined = _combined(partials.cpu().view(3, n, tiles, groups, c // groups), rows, (1, 3))
    grouped = values.view(n, per, groups, c // groups).transpose(1, 2).reshape(n, groups, -1)
    _check(stats, combined, grouped)


def _raw_partials_of(values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """fp32 ``(3, parts, C)``: per part (a program's rows), the shift ``k`` (its first 16 rows' mean, near
    but not at the part's), the sum of ``y - k`` and the sum of ``(y - k)^2`` (``raw_squares``)."""
    parts = []
    for chunk in values.split(sizes):
        y = chunk.float()
        k = y[:16].mean(0)
        e = y - k
        parts.append(torch.stack([k, e.sum(0), (e * e).sum(0)]))
    return torch.stack(parts, 1).contiguous()


@pytest.mark.parametrize("rows,c,parts", [(3000, 5, 7), (300 * 40 + 9, 21, 300)], ids=["one-launch", "two-launches"])
def test_raw_square_partials_of_programs_match_float64(rows: int, c: int, parts: int, kernel_device: str) -> None:
    """``raw_squares``: each part's sum of squares about its shift becomes its squared deviations from its
    mean in float64 (the TMA forward's per-program statistics), in one launch and in the split."""
    values = _values(rows, c, f"raw {rows} {c}")
    sizes = [rows // parts + (i < rows % parts) for i in range(parts)]
    raw = _raw_partials_of(values, sizes).to(kernel_device)
    stats = PartialsReduction(parts, c, 16, rows, torch.device(kernel_device), tile_rows=sizes,
                              raw_squares=True)(raw)  # fmt: skip
    n = torch.tensor(sizes, dtype=torch.float64)[:, None]
    k, e, q = raw.cpu().double().unbind(0)
    as_deviations = torch.stack([k, e, q - e * e / n])  # the store's format, in float64 as the kernel forms it
    _check(stats, _combined(as_deviations, n, (0,)), values.T)
    plain = PartialsReduction(parts, c, 16, rows, torch.device(kernel_device), tile_rows=sizes)(raw)
    assert not torch.allclose(plain.m2, stats.m2, rtol=1e-6)  # taken as squared deviations: wrong


@pytest.mark.parametrize("rows,c,has_bias", [(37, 5, False), (16 * 300 + 3, 21, True), (1, 3, True)],
                         ids=["one-span", "spans-bias", "one-row"])  # fmt: skip
def test_batch_norm_form_made_by_the_combining_launch_equals_the_form_of_the_sums(rows: int, c: int, has_bias: bool,
                                                                                kernel_device: str) -> None:  # fmt: skip
    """``BatchNormForm``: the reduction's launch writes BatchNorm's form of the sums it makes, the same
    bits ``ChannelStats.batch_norm_form`` makes of those sums in a launch of its own (its mean plus the
    bias, rstd, the unbiased variance: NaN or inf where one value leaves it undefined, as there)."""
    values = _values(rows, c, f"form {rows} {c}")
    partials = _partials(values, 16).to(kernel_device)
    g = torch.Generator().manual_seed(stable_seed(f"form bias {c}"))
    bias = (torch.randn(c, generator=g) * 10).to(kernel_device) if has_bias else None
    reduce = PartialsReduction(partials.shape[1], c, 16, rows, torch.device(kernel_device))
    stats = reduce(partials, BatchNormForm(bias, 1e-5))
    assert stats.form is not None and stats.form.shape == (3, c) and stats.form.dtype == torch.float32
    expected = stats.batch_norm_form(bias, 1e-5)
    assert torch.equal(stats.form.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(stats.form), torch.nan_to_num(expected))
    y = values.float().double()  # against float64 from the values themselves
    mean = y.mean(0) + (0 if bias is None else bias.cpu().double())
    torch.testing.assert_close(stats.form[0].cpu().double(), mean, rtol=2e-7, atol=0)
    if rows > 1:
        var = y.var(0, unbiased=False)
        torch.testing.assert_close(stats.form[1].cpu().double(), (var + 1e-5).rsqrt(), rtol=2e-6, atol=0)
        torch.testing.assert_close(stats.form[2].cpu().double(), y.var(0, unbiased=True), rtol=2e-6, atol=0)
    assert reduce(partials).form is None  # asked for nothing, made nothing


def test_spans_leave_their_arrival_counters_zero_and_results_repeat_bitwise(kernel_device: str) -> None:
    """A reduction in several spans (more than 256 tiles) combines them in the launch's last program to
    arrive: every counter it used is zero again afterwards, and launch after launch the bits repeat."""
    rows, c = 16 * 700 + 5, 40
    values = _values(rows, c, "spans counters")
    partials = _partials(values, 16).to(kernel_device)
    reduce = PartialsReduction(partials.shape[1], c, 16, rows, torch.device(kernel_device))
    assert reduce.spans == 3
    first = reduce(partials, BatchNormForm(None, 1e-3))
    assert not arrival.counters(torch.device(kernel_device), reduce.c_blocks).any()
    for _ in range(3):
        again = reduce(partials, BatchNormForm(None, 1e-3))
        assert torch.equal(again.sum, first.sum) and torch.equal(again.m2, first.m2)
        assert torch.equal(again.form, first.form)
    _check(first, _combined(partials.cpu(), _tile_rows(rows, 16)[:, None], (0,)), values.T)


def test_a_batch_norm_form_of_group_statistics_is_refused(kernel_device: str) -> None:
    partials = torch.zeros(3, 4, 8, device=kernel_device)
    reduce = PartialsReduction(4, 8, 16, 32, torch.device(kernel_device), groups=2, samples=2)
    with pytest.raises(ContractError, match="BatchNorm form is made of channel statistics"):
        reduce(partials, BatchNormForm(None, 1e-5))
