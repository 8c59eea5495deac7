"""The channel-reduction kernels (``kernels/channel_reduce.py``) called through their launchers, on CPU
under Triton's interpreter (on CUDA when present): the saved state they write, both tilings (every
channel in registers; the two-pass channel loop past ``ONE_BLOCK_LIMIT``), and argument checks."""

from __future__ import annotations

import pytest
import torch

from fusion_backend.kernels import channel_reduce as cr
from fusion_backend.kernels.chain_math import OP_CODES
from fusion_backend.kernels.epilogue import build_params

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def launch(y, bias, kind, pre=(), post=(), keepdim=False):
    """Forward through the launcher with saved state: ``(out, index, stats)``."""
    n, c = y.shape[:2]
    full = kind in ("softmax", "log_softmax")
    params = build_params(list(pre), bias, c, y.device)
    post_params = build_params(list(post), None, c if full else 1, y.device)
    spatial = list(y.shape[2:])
    out = torch.empty_like(y) if full else torch.empty([n, *([1] if keepdim else []), *spatial], device=y.device)
    index = torch.empty([n, *spatial], dtype=torch.int16, device=y.device)
    stats = torch.empty([2, n, *spatial], dtype=torch.float32, device=y.device)
    cr.channel_reduce_forward(y, bias is not None, list(pre), list(post), kind, params, post_params, out,
                              index if kind in ("min", "max") else None, stats)  # fmt: skip
    return out, index, stats


@pytest.mark.parametrize("channels", [5, 300], ids=["in registers", "channel loop"])
def test_extrema_values_first_index_ties_and_winner_value(channels, kernel_device):
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(2, channels, 3, 5, generator=gen).round(decimals=0)  # integers: many ties
    y[0, 2, 1, 1] = float("nan")
    y[1, :, 0, 0] = float("-inf")
    y = y.to(kernel_device)
    bias = torch.randn(channels, generator=gen).round(decimals=0).to(kernel_device)
    yb = y + bias[:, None, None]
    for kind in ("min", "max", "amin", "amax"):
        out, index, stats = launch(y, bias, kind)
        r = getattr(torch, kind)(yb, 1)
        values = r[0] if kind in ("min", "max") else r
        torch.testing.assert_close(out, values, equal_nan=True)
        if kind in ("min", "max"):
            assert torch.equal(index.long(), r[1])  # torch's index: the first extremum, a NaN first
            torch.testing.assert_close(stats[1], yb.gather(1, r[1][:, None]).squeeze(1), equal_nan=True)
        else:
            assert torch.equal(stats[1], (yb == values[:, None]).sum(1).float())


@pytest.mark.parametrize("channels", [7, 260], ids=["in registers", "channel loop"])
def test_sums_logsumexp_and_softmax_with_chains(channels, kernel_device):
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(2, channels, 4, 3, generator=gen).to(kernel_device)
    scale = torch.randn(channels, generator=gen).to(kernel_device)
    pre = [(OP_CODES["mul"], [scale]), (OP_CODES["gelu"], [])]
    v = torch.nn.functional.gelu(y * scale[:, None, None])
    for kind, want in (("sum", v.sum(1)), ("mean", v.mean(1)), ("logsumexp", torch.logsumexp(v, 1))):
        out, _, stats = launch(y, None, kind, pre, [(OP_CODES["tanh"], [])], keepdim=True)
        torch.testing.assert_close(out, torch.tanh(want)[:, None], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stats[0], want, rtol=1e-5, atol=1e-5)  # the post-chain's input
    for kind, fn in (("softmax", torch.softmax), ("log_softmax", torch.log_softmax)):
        out, _, stats = launch(y, None, kind, pre, [(OP_CODES["mul"], [2.0])])
        torch.testing.assert_close(out, 2.0 * fn(v, 1), rtol=1e-5, atol=1e-5)
        m = v.amax(1)
        torch.testing.assert_close(stats[0], m)
        torch.testing.assert_close(stats[1], torch.exp(v - m[:, None]).sum(1), rtol=1e-5, atol=1e-5)


def test_backward_of_the_channel_loop_matches_autograd(kernel_device):
    """softmax past the register budget, with a per-channel operand after it: the two-pass backward."""
    gen = torch.Generator().manual_seed(2)
    channels = 270
    y = torch.randn(1, channels, 2, 3, generator=gen).to(kernel_device)
    q = torch.randn(channels, generator=gen).to(kernel_device)
    post = [(OP_CODES["mul"], [q])]
    out, _, stats = launch(y, None, "softmax", (), post)
    g = torch.randn(out.shape, generator=gen).to(kernel_device)
    grad_y = torch.empty_like(y)
    params = build_params([], None, channels, y.device)
    post_params = build_params(post, None, channels, y.device)
    _, post_sums = cr.channel_reduce_backward(g, y, None, stats, False, [], post, "softmax", params, post_params,
                                              grad_y, [], [True])  # fmt: skip
    yy, qq = y.clone().requires_grad_(), q.clone().requires_grad_()
    want = torch.softmax(yy, 1) * qq[:, None, None]
    gy, gq = torch.autograd.grad(want, [yy, qq], g)
    torch.testing.assert_close(grad_y, gy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(post_sums[0], gq, rtol=1e-5, atol=1e-6)


def test_the_launchers_reject_what_they_cannot_serve(kernel_device):
    y = torch.randn(2, 4, 3, 3, device=kernel_device)
    params = build_params([], None, 4, y.device)
    one = build_params([], None, 1, y.device)
    with pytest.raises(ValueError, match="unknown reduction"):
        cr.channel_reduce_forward(y, False, [], [], "median", params, one, torch.empty(2, 3, 3, device=y.device))
    with pytest.raises(ValueError, match="out must have y's shape"):
        cr.channel_reduce_forward(y, False, [], [], "softmax", params, params, torch.empty(2, 3, 3, device=y.device))
    with pytest.raises(ValueError, match="Q must have 1 columns"):
        cr.channel_reduce_forward(y, False, [], [], "sum", params, params, torch.empty(2, 3, 3, device=y.device))
    wide = torch.randn(1, cr.MAX_CHANNELS + 1, 1, 1, device=kernel_device)
    with pytest.raises(ValueError, match="at most 1024 channels"):
        cr.channel_reduce_forward(wide, False, [], [], "sum", params, one, torch.empty(1, 1, 1, device=y.device))


def test_reduction_codes_cover_the_ops_reductions():
    from fusion_backend.ops.conv_channel_reduce import REDUCTIONS

    assert set(cr.REDUCTION_CODES) == set(REDUCTIONS)
