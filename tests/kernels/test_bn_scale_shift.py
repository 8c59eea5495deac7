"""``kernels/bn_scale_shift``: an eval batch norm's per-channel scale and shift in one kernel, against
float64 (the formula of ``ops/bn_fold.py``), every operand's dtype of at most 32 bits, gamma and beta
each optional, channel counts with partial blocks, NaN and inf statistics where eager's batch norm has
them; ``bn_fold.scale_and_shift_direct`` (what a graph without Inductor runs) with the reference's
values and gradients; one-line errors for statistics the kernel cannot walk.  Under the interpreter
on CPU, with CUDA on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.kernels.plan_cache import ContractError
from fusion_backend.ops import bn_fold

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.fixture
def kernel(triton_kernels):
    from fusion_backend.kernels import bn_scale_shift

    return bn_scale_shift


def _stats(channels: int, dtype: torch.dtype, seed: int, affine: tuple[bool, bool]):
    g = torch.Generator().manual_seed(seed)
    mean = (torch.randn(channels, generator=g) * 3).to(DEVICE, dtype)
    var = (torch.rand(channels, generator=g) * 4 + 1e-3).to(DEVICE, dtype)
    gamma = torch.randn(channels, generator=g).to(DEVICE, dtype) if affine[0] else None
    beta = torch.randn(channels, generator=g).to(DEVICE, dtype) if affine[1] else None
    return mean, var, gamma, beta


def _float64(mean, var, gamma, beta, eps):  # noqa: ANN001, ANN202
    scale = 1 / torch.sqrt(var.double() + eps) * (1 if gamma is None else gamma.double())
    return scale, (0 if beta is None else beta.double()) - mean.double() * scale


@pytest.mark.parametrize("channels", [1, 7, 512, 1100])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("affine", [(True, True), (False, False), (True, False), (False, True)],
                         ids=lambda a: f"gamma{int(a[0])}-beta{int(a[1])}")  # fmt: skip
def test_scale_and_shift_match_float64(kernel, channels, dtype, affine):
    eps = 1e-5 if channels % 2 else 1e-3
    mean, var, gamma, beta = _stats(channels, dtype, channels + 3 * affine[0] + affine[1], affine)
    scale, shift = kernel.scale_and_shift(mean, var, gamma, beta, eps)
    assert scale.dtype == shift.dtype == torch.float32 and scale.shape == shift.shape == (channels,)
    want_scale, want_shift = _float64(mean, var, gamma, beta, eps)
    # fp32 arithmetic on exact inputs: the device's rsqrt (a few ulp) and a product, then a product and a sum
    fp32 = torch.finfo(torch.float32).eps
    assert ((scale.double() - want_scale).abs() <= 8 * fp32 * want_scale.abs()).all()
    terms = (mean.double() * want_scale).abs() + (0 if beta is None else beta.double().abs())
    assert ((shift.double() - want_shift).abs() <= 8 * fp32 * terms + 1e-30).all()


def test_the_normalized_values_match_eager_batch_norm_in_float64(kernel):
    """``y * scale + shift`` is eval batch norm: the same values as ``F.batch_norm`` in float64."""
    mean, var, gamma, beta = _stats(9, torch.float32, 5, (True, True))
    scale, shift = kernel.scale_and_shift(mean, var, gamma, beta, 1e-5)
    y = torch.randn(2, 9, 4, 3, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = y.double() * scale.double().view(9, 1, 1) + shift.double().view(9, 1, 1)
    want = F.batch_norm(y.double(), mean.double(), var.double(), gamma.double(), beta.double(), False, 0.0, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_nan_and_inf_statistics_poison_the_channels_eager_poisons(kernel):
    mean, var, gamma, beta = _stats(6, torch.float32, 2, (True, True))
    var[1], var[2], mean[3], gamma[4] = -1.0, -1e-5, float("inf"), float("nan")  # sqrt(<0), 1/0, inf*scale, nan
    scale, shift = kernel.scale_and_shift(mean, var, gamma, beta, 1e-5)
    want_scale, want_shift = bn_fold.scale_and_shift(mean, var, gamma, beta, 1e-5, 0)
    for got, want in ((scale, want_scale), (shift, want_shift)):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (got, want)
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-6)


def test_statistics_the_kernel_cannot_walk_get_a_one_line_error(kernel):
    mean, var, gamma, beta = _stats(8, torch.float32, 4, (True, True))
    with pytest.raises(ContractError, match=r"^batch norm scale and shift: running_var must hold 8 channel values"):
        kernel.ScaleShiftPlan(mean, torch.randn(16, device=DEVICE)[::2], gamma, beta, 1e-5)
    with pytest.raises(ContractError, match="gamma must hold 8 channel values") as info:
        kernel.ScaleShiftPlan(mean, var, gamma[:5], beta, 1e-5)
    assert "\n" not in str(info.value)
    with pytest.raises(ContractError, match="must hold 1 channel values"):
        kernel.ScaleShiftPlan(mean[:0], var[:0], None, None, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_direct_form_gives_the_reference_values_and_gradients(kernel, dtype):
    """What a graph without Inductor runs: the kernel's values as ``(C, 1, 1)`` chain operands, and
    gradients for gamma and beta (and the statistics, were they to require them) equal to the torch
    formula's."""
    mean, var, gamma, beta = _stats(5, dtype, 8, (True, True))
    leaves = [t.clone().requires_grad_(need) for t, need in ((mean, True), (var, True), (gamma, True), (beta, False))]
    scale, shift = bn_fold.scale_and_shift_direct(*leaves, 1e-3, 2)
    ref_leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    ref_scale, ref_shift = bn_fold.scale_and_shift(*ref_leaves, 1e-3, 2)
    assert scale.shape == ref_scale.shape == (5, 1, 1) and scale.dtype == ref_scale.dtype == torch.float32
    torch.testing.assert_close(scale, ref_scale, rtol=2e-6, atol=0)
    torch.testing.assert_close(shift, ref_shift, rtol=2e-6, atol=2e-6)
    g = torch.Generator().manual_seed(9)
    up = [torch.randn(5, 1, 1, generator=g).to(DEVICE) for _ in range(2)]
    got = torch.autograd.grad((scale, shift), leaves[:3], up)
    want = torch.autograd.grad((ref_scale, ref_shift), ref_leaves[:3], up)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        s, _ = bn_fold.scale_and_shift_direct(*leaves, 1e-3, 1)
    assert s.shape == (5, 1) and not s.requires_grad


def test_the_direct_form_takes_what_the_kernel_cannot_through_the_reference(kernel):
    """float64 statistics and a strided view: the torch formula, the same values."""
    mean, var, gamma, beta = _stats(4, torch.float32, 6, (True, True))
    for args in ((mean.double(), var.double(), gamma.double(), beta.double()),
                 (torch.stack([mean, mean], 1)[:, 0], var, gamma, beta)):  # fmt: skip
        scale, shift = bn_fold.scale_and_shift_direct(*args, 1e-5, 2)
        ref_scale, ref_shift = bn_fold.scale_and_shift(*args, 1e-5, 2)
        assert scale.dtype == ref_scale.dtype
        torch.testing.assert_close(scale, ref_scale, rtol=0, atol=0)
        torch.testing.assert_close(shift, ref_shift, rtol=0, atol=0)


@pytest.mark.parametrize("affine", [True, False])
def test_the_batched_op_gives_each_batch_norm_s_values_one_after_another(kernel, affine):
    """``bn_fold.BATCHED`` (what a graph's batched call runs): the concatenation of each batch norm's
    ``scale_and_shift``, fp32; its fake and schema agree with it (``opcheck``)."""
    sets = [_stats(c, torch.float16, c, (affine, affine)) for c in (3, 512, 7)]
    means, variances = [s[0] for s in sets], [s[1] for s in sets]
    gammas = [s[2] for s in sets] if affine else []
    betas = [s[3] for s in sets] if affine else []
    scale, shift = bn_fold.BATCHED(means, variances, gammas, betas, 1e-4)
    assert scale.dtype == shift.dtype == torch.float32 and scale.shape == shift.shape == (522,)
    want = [bn_fold.scale_and_shift(*s, 1e-4, 0) for s in sets]
    torch.testing.assert_close(scale, torch.cat([w[0] for w in want]), rtol=2e-6, atol=0)
    torch.testing.assert_close(shift, torch.cat([w[1] for w in want]), rtol=2e-6, atol=2e-6)
    torch.library.opcheck(bn_fold.BATCHED, (means, variances, gammas, betas, 1e-4),
                          test_utils=("test_schema", "test_faketensor"))
