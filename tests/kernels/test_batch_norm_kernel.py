"""The training BatchNorm's kernels (``kernels/batch_norm.py``) through their launchers, on CPU under
Triton's interpreter (on CUDA when present), against float64 torch: the statistics, the normalise pass
with a chain after it, and the backward (its sums and the input gradient), for every way the kernels walk
a tensor: channels-last and dense (the flat walk, no division per element), one sample of a contiguous
tensor (flat too), several contiguous samples and a spatially sliced input (the divided walk); chunks of
several full tiles and a partial last tile; a mean that dwarfs its spread."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.kernels import batch_norm as bn
from fusion_backend.kernels.chain_math import OP_CODES
from fusion_backend.kernels.epilogue import build_params
from fusion_backend.kernels.plan_cache import forget_call_plans, spatial_flat_strides
from fusion_backend.testing import stable_seed

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

RELU = [(OP_CODES["relu"], [])]


@pytest.fixture(params=[(0, 1), (1, 1), None], ids=["pointwise-chunks", "pointwise-tile-per-program", "defaults"])
def few_programs(monkeypatch, request):
    """Launches of at most 4 programs per channel block.  With chunks of any size (``MIN_CHUNK_TILES``
    1): several chunks of several full tiles at test sizes, and the elementwise passes walking the
    reductions' chunks or one tile per program; or the module's own chunking (one chunk per channel
    block at test sizes)."""
    monkeypatch.setattr(bn, "TARGET_PROGRAMS", 4)
    if request.param is not None:
        monkeypatch.setattr(bn, "POINTWISE_TILES", request.param[0])
        monkeypatch.setattr(bn, "MIN_CHUNK_TILES", request.param[1])
    forget_call_plans()
    yield
    forget_call_plans()


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its channels innermost (a 1-d tensor: its (N, L, C) transposed)."""
    if t.dim() == 3:
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)


def _laid_out(kind: str, shape, gen, device):
    """A y of ``shape`` as the named layout, and whether the kernels walk it flat."""
    if kind == "channels_last":
        return _channels_last(torch.randn(shape, generator=gen).to(device)), True
    if kind == "one_sample":
        return torch.randn((1, *shape[1:]), generator=gen).to(device), True
    if kind == "contiguous":
        return torch.randn(shape, generator=gen).to(device), False
    if kind == "batch_slice_channels_last":  # still flat: the samples keep their spacing
        big = _channels_last(torch.randn((shape[0] + 2, *shape[1:]), generator=gen).to(device))
        return big[1:-1], True
    assert kind == "channels_slice_channels_last"  # flat, channels strided inside each position
    big = _channels_last(torch.randn((shape[0], shape[1] + 3, *shape[2:]), generator=gen).to(device))
    return big[:, 2:-1], True


LAYOUTS = ["channels_last", "one_sample", "contiguous", "batch_slice_channels_last", "channels_slice_channels_last"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (2, 16, 5, 33), (3, 6, 40), (2, 5, 3, 4, 7)],
                         ids=["2d-5ch", "2d-16ch", "1d", "3d"])  # fmt: skip
def test_training_batch_norm_matches_float64(layout, shape, kernel_device, few_programs):
    gen = torch.Generator().manual_seed(stable_seed(("batch norm", layout, shape)))
    y, flat = _laid_out(layout, shape, gen, kernel_device)
    c, dims, per_channel = y.shape[1], (0, *range(2, y.dim())), (-1, *(1,) * (y.dim() - 2))
    assert bn.walks_flat(bn.plan_for(y)[0], spatial_flat_strides(y)) == flat
    bias, gamma, beta = (torch.randn(c, generator=gen).to(kernel_device) for _ in range(3))
    gamma = gamma.abs() + 0.5
    affine = torch.stack([gamma, beta]).contiguous()
    stats = bn.batch_norm_stats(y, bias, 1e-5)
    v64 = y.double() + bias.double().view(per_channel)
    mean = v64.mean(dims)
    var = v64.var(dims, unbiased=False)
    torch.testing.assert_close(stats[0].double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats[1].double(), (var + 1e-5).rsqrt(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats[2].double(), v64.var(dims, unbiased=True), rtol=1e-5, atol=1e-6)

    q = build_params(RELU, None, c, y.device)
    out = torch.empty_like(y)
    bn.batch_norm_apply(y, bias, RELU, q, affine, stats[:2], out)
    v = v64.detach().clone().requires_grad_()
    g64, b64 = (t.double().detach().clone().requires_grad_() for t in (gamma, beta))
    want = F.relu(F.batch_norm(v, None, None, g64, b64, True, 0.1, 1e-5))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)

    grad_out = torch.randn(y.shape, generator=gen).to(kernel_device)
    grad_y = torch.empty_like(y)
    dgamma, dbeta, _ = bn.batch_norm_backward(grad_out, y, bias, RELU, q, affine, stats[:2], grad_y)
    wants = torch.autograd.grad(want, (v, g64, b64), grad_out.double())
    for name, got, w in zip(("grad_y", "gamma", "beta"), (grad_y, dgamma, dbeta), wants, strict=True):
        torch.testing.assert_close(got.double(), w, rtol=1e-4, atol=1e-5, msg=name)

    # the input gradient from sums made elsewhere (what the conv family's input gradient hands over)
    dz = torch.where(want > 0, grad_out.double(), 0.0)
    xh = (v64 - mean.view(per_channel)) * (var.view(per_channel) + 1e-5).rsqrt()
    grad_y2 = torch.empty_like(y)
    bn.batch_norm_input_grad(dz.float(), y + bias.view(per_channel), affine, stats[:2], dz.sum(dims),
                             (dz * xh).sum(dims), grad_y2)  # fmt: skip
    torch.testing.assert_close(grad_y2.double(), wants[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_statistics_keep_a_spread_that_its_mean_dwarfs(layout, kernel_device, few_programs):
    """A bias of 3000 over a spread of about 1: the running means per lane keep the variance."""
    gen = torch.Generator().manual_seed(7)
    y, _ = _laid_out(layout, (2, 8, 9, 31), gen, kernel_device)
    y, dims = y + 3000.0, (0, 2, 3)
    stats = bn.batch_norm_stats(y, None, 0.0)
    var = y.double().var(dims, unbiased=False)
    # the fp32 mean within a couple of its units in the last place (2.4e-4 at 3000)
    torch.testing.assert_close(stats[0].double(), y.double().mean(dims), rtol=3e-7, atol=0.0)
    torch.testing.assert_close(stats[1].double(), var.rsqrt(), rtol=2e-4, atol=0.0)
    # Welford's running means per lane round at fp32's 2.4e-4 near 3000, a 2**-12 of the spread: a
    # variance off by about 1e-5 of itself (E[y^2] - E[y]^2 in fp32 would lose it whole)
    got_err = ((stats[1].double() ** -2) - var).abs().max() / var.max()
    assert got_err <= 5e-5, got_err


def test_the_statistics_are_the_same_bits_run_to_run(kernel_device, few_programs):
    y = torch.randn((2, 8, 9, 31), generator=torch.Generator().manual_seed(3)).to(kernel_device)
    y = y.to(memory_format=torch.channels_last)
    first = bn.batch_norm_stats(y, None, 1e-5)
    assert torch.equal(first, bn.batch_norm_stats(y, None, 1e-5))


@pytest.mark.parametrize("shape", [(64, 512, 7, 7), (64, 64, 56, 56), (2, 16, 5, 33), (1, 3, 1, 1)])
def test_a_small_tensor_is_reduced_in_chunks_of_about_the_minimum_tiles(shape):
    """A small tensor is reduced in fewer, longer programs (at most one chunk per ``MIN_CHUNK_TILES``
    tiles of a channel's values), never more programs than ``TARGET_PROGRAMS`` allows; the chunks cover
    every value once; the elementwise passes' chunks too."""
    y = torch.empty(shape, device="meta").to(memory_format=torch.channels_last)
    plan = bn.Plan(y)
    assert plan.chunk % plan.block_r == 0 and plan.pointwise_chunk % plan.block_r == 0
    assert plan.chunks <= -(-plan.values // (plan.block_r * bn.MIN_CHUNK_TILES))
    assert plan.grid[0] * plan.grid[1] <= max(bn.TARGET_PROGRAMS, plan.grid[0])
    for chunk, chunks in ((plan.chunk, plan.chunks), (plan.pointwise_chunk, plan.pointwise_grid[1])):
        assert (chunks - 1) * chunk < plan.values <= chunks * chunk
    assert plan.pointwise_grid[1] <= bn.MAX_GRID_Y
