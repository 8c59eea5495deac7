"""The row-softmax kernels of ``fusion::attention`` (``kernels/softmax_rows.py``) against float64:
forward probabilities in the output dtype, the backward's probabilities (bitwise the forward's) and
the scores' gradient; rows shorter than, as long as and longer than one slice; ``-inf`` and NaN
scores as eager's softmax treats them; the contract's one-line errors."""

from __future__ import annotations

import pytest
import torch

from fusion_backend.kernels.plan_cache import ContractError
from fusion_backend.kernels.softmax_rows import MAX_BLOCK, softmax_rows_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OUT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
#: the output dtype's rounding: what separates a correct kernel from float64
ROUNDING = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("rows,length", [(3, 1), (5, 7), (2, MAX_BLOCK), (3, MAX_BLOCK + 3)])
def test_forward_and_backward_are_float64_s_softmax_and_its_gradient(out_dtype, rows, length):
    torch.manual_seed(rows * 1000 + length)
    s = torch.randn(rows, length, device=DEVICE) * 6 + torch.randn(rows, 1, device=DEVICE) * 20  # far-apart row maxima
    dp = torch.randn(rows, length, device=DEVICE)
    scale = 0.37
    plan = softmax_rows_plan(rows, length, out_dtype, s.device)
    p = plan.forward(s, scale)
    p_again, ds = plan.backward(s, dp, scale)
    want = torch.softmax(s.double() * scale, -1)
    want_ds = want * (dp.double() - (want * dp.double()).sum(-1, keepdim=True)) * scale
    assert p.dtype == ds.dtype == out_dtype and p.is_contiguous() and ds.is_contiguous()
    assert torch.equal(p, p_again), "the backward's probabilities differ from the forward's"
    tol = ROUNDING[out_dtype]
    assert (p.double() - want).abs().max() <= tol * want.abs().max() + 1e-30
    assert (ds.double() - want_ds).abs().max() <= 4 * tol * want_ds.abs().max() + 1e-12


def test_minus_infinity_and_nan_scores_give_eager_s_softmax():
    s = torch.tensor([[1.0, float("-inf"), 2.0, float("-inf")],
                      [float("-inf")] * 4,
                      [1.0, float("nan"), 2.0, 0.5]], device=DEVICE)  # fmt: skip
    got = softmax_rows_plan(3, 4, torch.float32, s.device).forward(s, 1.0)
    torch.testing.assert_close(got, torch.softmax(s, -1), equal_nan=True)
    _, ds = softmax_rows_plan(3, 4, torch.float32, s.device).backward(s, torch.ones_like(s), 1.0)
    assert torch.isnan(ds[1:]).all() and not torch.isnan(ds[0]).any()


def test_the_contract_is_one_clear_error():
    plan = softmax_rows_plan(2, 5, torch.float16, torch.device(DEVICE))
    with pytest.raises(ContractError, match=r"softmax rows: s must be a contiguous torch.float32 of 2 rows of 5"):
        plan.forward(torch.randn(2, 5, device=DEVICE, dtype=torch.float16), 1.0)
    with pytest.raises(ContractError, match=r"s must be a contiguous"):
        plan.forward(torch.randn(5, 2, device=DEVICE).t(), 1.0)
    with pytest.raises(ContractError, match=r"needs at least one row of at least one score, got \(0, 5\)"):
        softmax_rows_plan(0, 5, torch.float16, torch.device(DEVICE))
    with pytest.raises(ContractError, match="no torch.int32 output"):
        softmax_rows_plan(2, 5, torch.int32, torch.device(DEVICE))
