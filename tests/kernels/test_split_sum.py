"""The float64 sums over one axis that the conv family's passes reduce their partials with
(``kernels/conv/split_sum.py``): exact to float64 rounding, the same bits on every run, launches that
spread few elements over many programs."""

from __future__ import annotations

import pytest
import torch

from fusion_backend.kernels import arrival
from fusion_backend.kernels.conv import split_sum

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("total", [1, 100, 2304, 4096, 4224, 70_000, 2_359_296])
@pytest.mark.parametrize("split", [1, 2, 5, 40, 262, 600])
def test_blocks_spread_few_elements_over_programs(total, split):  # noqa: ANN001
    """Elements per program a power of two in 16..1024, programs enough to fill a GPU where the elements
    allow (a small gradient over many splits must not be a few programs walking their slots), each step
    about 4,096 loads and never more slots than the split has."""
    block, slots = split_sum.split_sum_blocks(total, split)
    assert block & (block - 1) == 0 and 16 <= block <= 1024
    assert slots & (slots - 1) == 0 and 1 <= slots <= max(1, 2 * split - 1) and block * slots <= 4096
    programs = -(-total // block)
    assert programs >= min(split_sum._PROGRAMS, -(-total // 1024))
    assert block == 16 or programs >= split_sum._PROGRAMS
    assert -(-split // slots) <= max(1, -(-split // (4096 // block)))


@pytest.mark.parametrize("shape,dim", [
    ((7, 33), 0),  # a split axis in front, odd sizes
    ((2, 600, 24), 1),  # the input gradient's (2, tiles, C), 600 tiles: three steps of 256 slots
    ((3, 5, 70), 2),  # the last axis
    ((1, 1), 0),
], ids=["leading", "middle-three-steps", "last", "single"])
def test_sums_match_float64_bit_for_bit_across_runs(shape, dim):  # noqa: ANN001
    """Against float64 ``torch.sum`` of the same fp32 values (fresh draws of mixed magnitudes): equal to
    float64 rounding; two runs give the same bits."""
    g = torch.Generator().manual_seed(sum(shape) * 7 + dim)
    parts = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g))).to(DEVICE)
    got = split_sum.sum_dim(parts, dim)
    want = parts.double().sum(dim)
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13 * want.abs().max().item())
    assert torch.equal(got, split_sum.sum_dim(parts, dim))
    _, blocks, chunks = split_sum._LAUNCHES.values()[-1]  # several steps: one program per step, then the steps
    assert chunks == -(-shape[dim] // split_sum.split_sum_blocks(got.numel(), shape[dim])[1])
    assert not arrival.counters(parts.device, blocks).any()  # the last chunk of each block left its counter 0


def test_inf_and_nan_reach_their_sums_and_empty_axes_sum_to_zero():
    """A slot's inf or NaN is its element's sum (nothing masks it away); no slots sum to zeros, no
    elements to an empty result."""
    parts = torch.zeros(300, 3, device=DEVICE)
    parts[5, 0], parts[299, 1] = float("inf"), float("nan")
    got = split_sum.sum_dim(parts, 0).cpu()
    assert got[0] == float("inf") and got[1].isnan() and got[2] == 0
    assert torch.equal(split_sum.sum_dim(torch.zeros(0, 4, device=DEVICE), 0).cpu(), torch.zeros(4, dtype=torch.float64))
    assert split_sum.sum_dim(torch.zeros(4, 0, device=DEVICE), 0).shape == (0,)
