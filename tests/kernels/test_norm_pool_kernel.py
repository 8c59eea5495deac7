"""The pooled normalise pass (``kernels/norm_pool.py``) and the norms' backward kernels behind a pool
(``kernels/batch_norm.py``, ``kernels/group_norm.py``), called through their launchers, on CPU under
Triton's interpreter (on CUDA when present): the pooled output and max-pool winners against torch
(overlapping windows, exact ties, ceil_mode, padding), the conv-output gradient against autograd for
both statistics layouts (per channel, per sample and group), groups split into chunks, the group
statistics pass alone, channels-last and an expanded gradient, and argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.ir.specs import PoolSpec
from fusion_backend.kernels import batch_norm as bn
from fusion_backend.kernels import group_norm as gn
from fusion_backend.kernels.chain_math import OP_CODES
from fusion_backend.kernels.epilogue import build_params
from fusion_backend.kernels.norm_pool import norm_pool_forward
from fusion_backend.ops.chain_reference import window_winners
from fusion_backend.ops.conv_io import pooled_output_shape, run_pool

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

MAX_3_2_1 = PoolSpec("max", (3, 3), (2, 2), (1, 1))
POST = [(OP_CODES["leaky_relu"], [0.1])]


def tensors(shape, seed, device, tie_rows=0):
    """y (its first ``tie_rows`` rows one constant: whole windows tie), bias, gamma, beta, affine rows."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(shape, generator=gen)
    if tie_rows:
        y[..., :tie_rows, :] = 0.25
    c = shape[1]
    bias, gamma, beta = torch.randn(c, generator=gen), torch.rand(c, generator=gen) + 0.5, torch.randn(c, generator=gen)
    return [t.to(device) for t in (y, bias, gamma, beta, torch.stack([gamma, beta]).contiguous())]


def pooled(y, pool, dtype=torch.float32, save=True):
    shape = pooled_output_shape(y.shape, pool)
    out = torch.empty(shape, dtype=dtype, device=y.device)
    winner = torch.empty(shape, dtype=torch.int8, device=y.device) if save and pool.kind == "max" else None
    return out, winner


@pytest.mark.parametrize("pool", [MAX_3_2_1, PoolSpec("max", (2, 2), ceil_mode=True),
                                  PoolSpec("avg", (3, 3), (2, 2), (1, 1), True, False)],
                         ids=["max 3/2/1", "max 2 ceil_mode", "avg 3/2/1 ceil_mode without the padding"])  # fmt: skip
def test_batch_norm_pooled_forward_and_backward_match_torch(pool, kernel_device):
    y, bias, gamma, beta, affine = tensors((2, 5, 7, 9), 0, kernel_device, tie_rows=3)
    stats = bn.batch_norm_stats(y, bias, 1e-5)[:2]
    params, q = build_params([], bias, 5, y.device), build_params(POST, None, 5, y.device)
    out, winner = pooled(y, pool)
    norm_pool_forward(y, True, [], POST, params, q, affine, stats, pool, out, winner)
    yl, gl, bl = (t.detach().clone().requires_grad_() for t in (y + bias[:, None, None], gamma, beta))
    full = F.leaky_relu(F.batch_norm(yl, None, None, gl, bl, True, 0.1, 1e-5), 0.1)
    if pool.kind == "max":
        want, flat = run_pool(full, pool, return_indices=True)
        assert torch.equal(winner, window_winners(flat, y.shape[2:], pool))  # ties: the first maximum
    else:
        want = run_pool(full, pool)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(kernel_device)
    grad_y = torch.empty_like(y)
    dgamma, dbeta, _ = bn.batch_norm_backward(g, y, bias, POST, q, affine, stats, grad_y, (), pool, winner)
    for name, got, w in zip(("grad_y", "gamma", "beta"), (grad_y, dgamma, dbeta), torch.autograd.grad(want, (yl, gl, bl), g),
                            strict=True):  # fmt: skip
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("kind, chunk", [("max", 16), ("avg", None)],
                         ids=["max, groups split into chunks", "avg, one chunk per group"])  # fmt: skip
def test_group_norm_pooled_forward_and_backward_match_torch(kind, chunk, layout, kernel_device):
    """The group statistics alone (``group_norm_stats``), the pooled pass on them, and the pooled
    backward, with a pre-chain, a per-channel post operand whose gradient is summed, and overlapping
    3 x 3 windows (stride 2, padding 1, ceil_mode; tied rows); ``chunk`` forces the split two-kernel
    paths (3 chunks of a group's 35 positions); a channels-last y takes the channels-last kernels."""
    y, bias, gamma, beta, affine = tensors((1, 6, 5, 7), 2, kernel_device, tie_rows=2)
    y = y.to(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)
    p = torch.randn(6, generator=torch.Generator().manual_seed(3)).to(kernel_device)
    pre, post = [(OP_CODES["tanh"], [])], [(OP_CODES["mul"], [p]), (OP_CODES["silu"], [])]
    pool = PoolSpec(kind, (3, 3), (2, 2), (1, 1), ceil_mode=True)
    params, q = build_params(pre, bias, 6, y.device), build_params(post, None, 6, y.device)
    stats = torch.empty(2, 1, 3, device=kernel_device)
    gn.group_norm_stats(y, True, pre, 3, 1e-5, params, stats, chunk=chunk)
    v = torch.tanh(y + bias[:, None, None]).reshape(1, 3, -1)
    torch.testing.assert_close(stats[0], v.mean(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats[1], (v.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-5, atol=1e-6)
    out, winner = pooled(y, pool)
    norm_pool_forward(y, True, pre, post, params, q, affine, stats, pool, out, winner)
    yl, pl, gl, bl = (t.detach().clone().requires_grad_() for t in (y, p, gamma, beta))
    full = F.silu(F.group_norm(torch.tanh(yl + bias[:, None, None]), 3, gl, bl, 1e-5) * pl[:, None, None])
    want = run_pool(full, pool)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(kernel_device)

    grad_y = torch.empty_like(y)
    _, post_sums, affine_sums = gn.group_norm_backward(
        g, y, stats, True, pre, post, 3, params, q, affine, grad_y, (), [True, False], (True, True), chunk=chunk,
        pool=pool, winner=winner)  # fmt: skip
    want_grads = torch.autograd.grad(want, (yl, pl, gl, bl), g)
    for name, got, w in zip(("grad_y", "p", "gamma", "beta"), (grad_y, post_sums[0], *affine_sums), want_grads,
                            strict=True):  # fmt: skip
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5, msg=name)


def test_channels_last_y_a_strided_gradient_and_no_winners_without_saving(kernel_device):
    """A channels-last conv output and pooled result, the pooled gradient an expanded (stride 0)
    tensor as ``out.sum()``'s backward gives it; an inference call writes no winners."""
    y, bias, gamma, beta, affine = tensors((2, 4, 6, 7), 5, kernel_device, tie_rows=2)
    y = y.to(memory_format=torch.channels_last)
    stats = bn.batch_norm_stats(y, bias, 1e-5)[:2]
    params, q = build_params([], bias, 4, y.device), build_params(POST, None, 4, y.device)
    shape = pooled_output_shape(y.shape, MAX_3_2_1)
    out = torch.empty(shape, device=kernel_device).to(memory_format=torch.channels_last)
    winner = torch.empty(shape, dtype=torch.int8, device=kernel_device).to(memory_format=torch.channels_last)
    norm_pool_forward(y, True, [], POST, params, q, affine, stats, MAX_3_2_1, out, winner)
    inference = torch.empty_like(out)
    norm_pool_forward(y, True, [], POST, params, q, affine, stats, MAX_3_2_1, inference)
    assert torch.equal(inference, out)
    yl = (y + bias[:, None, None]).detach().requires_grad_()
    want = run_pool(F.leaky_relu(F.batch_norm(yl, None, None, gamma, beta, True, 0.1, 1e-5), 0.1), MAX_3_2_1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    g = torch.ones(()).to(kernel_device).expand(shape)
    grad_y = torch.empty_like(y)
    bn.batch_norm_backward(g, y, bias, POST, q, affine, stats, grad_y, (), MAX_3_2_1, winner)
    torch.testing.assert_close(grad_y, torch.autograd.grad(want, yl, g)[0], rtol=1e-4, atol=1e-5)


def test_arguments_are_checked_with_one_line_messages(kernel_device):
    y, bias, _, _, affine = tensors((2, 4, 6, 7), 6, kernel_device)
    stats = bn.batch_norm_stats(y, bias, 1e-5)[:2]
    params = build_params([], bias, 4, y.device)
    out, winner = pooled(y, MAX_3_2_1)
    with pytest.raises(ValueError, match=r"stats must be \(2, 4\) or \(2, 2, G\)"):
        norm_pool_forward(y, True, [], [], params, params, affine, stats[:, :3].contiguous(), MAX_3_2_1, out, winner)
    with pytest.raises(ValueError, match="winners are only saved for a max pool"):
        norm_pool_forward(y, True, [], [], params, params, affine, stats, PoolSpec("avg", (2, 2)), out, winner)
    with pytest.raises(ValueError, match="needs int8/int32 winners"):
        bn.batch_norm_backward(out, y, bias, [], params, affine, stats, torch.empty_like(y), (), MAX_3_2_1, None)
