"""What the batch norms in training mode share (``ops/batch_statistics.py``): the running statistics'
update against eager's formula for every dtype of buffers, in place, and the count rule."""

from __future__ import annotations

import pytest
import torch

from fusion_backend.errors import UnsupportedInputError
from fusion_backend.ops.batch_statistics import running_update, update_running_stats, values_per_channel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_the_update_is_eagers_formula_within_an_ulp_in_place(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    stats = torch.randn(3, 7, generator=gen)
    stats[2] = stats[2].abs()
    mean, var = torch.randn(7, generator=gen).to(dtype), torch.rand(7, generator=gen).to(dtype)
    ptrs = (mean.data_ptr(), var.data_ptr())
    want = [(stats[row] * 0.3 + t.float() * 0.7).to(dtype) for row, t in ((0, mean), (2, var))]
    update_running_stats(mean, var, stats, 0.3)
    assert (mean.data_ptr(), var.data_ptr()) == ptrs
    ulp = torch.finfo(dtype).eps if dtype != torch.float64 else torch.finfo(torch.float32).eps
    for got, exp in zip((mean, var), want, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), exp.double(), rtol=2 * ulp, atol=2 * ulp)


def test_the_op_takes_buffers_of_any_shape_and_refuses_the_wrong_count() -> None:
    stats = torch.tensor([[1.0, 2.0], [0.5, 0.5], [4.0, 8.0]])
    mean, var = torch.zeros(1, 2, 1), torch.ones(2)
    running_update(mean, var, stats, 0.5)
    assert mean.flatten().tolist() == [0.5, 1.0] and var.tolist() == [2.5, 4.5]
    with pytest.raises(UnsupportedInputError, match="running_mean must hold 2 floating values"):
        running_update(torch.zeros(3), var, stats, 0.5)


def test_one_value_per_channel_is_eagers_error_and_an_empty_batch_counts_zero() -> None:
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        values_per_channel((1, 4, 1, 1))
    assert values_per_channel((0, 4, 3, 3)) == 0 and values_per_channel((2, 4, 3)) == 6
