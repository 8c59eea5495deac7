"""The group-norm kernels (``kernels/group_norm.py``) called through their launchers, on CPU under
Triton's interpreter (on CUDA when present): the statistics they save (numerically sound on a group
far from zero), groups walked in several channel blocks and position tiles, bitwise reproducible
partial sums, the per-channel gradient sums against autograd, and argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.kernels import group_norm as gn
from fusion_backend.kernels.chain_math import OP_CODES
from fusion_backend.kernels.epilogue import build_params

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def inputs(y, bias, groups, pre=(), post=(), gamma=None, beta=None):
    c = y.shape[1]
    affine = torch.stack([torch.ones(c) if gamma is None else gamma.cpu(), torch.zeros(c) if beta is None else beta.cpu()])
    return (build_params(list(pre), bias, c, y.device), build_params(list(post), None, c, y.device),
            affine.float().contiguous().to(y.device))  # fmt: skip


def forward(y, bias, groups, eps=1e-5, pre=(), post=(), gamma=None, beta=None, out_dtype=None):
    params, post_params, affine = inputs(y, bias, groups, pre, post, gamma, beta)
    out = torch.empty_like(y, dtype=out_dtype or y.dtype)
    stats = torch.empty(2, y.shape[0], groups, device=y.device)
    gn.group_norm_forward(y, bias is not None, list(pre), list(post), groups, eps, params, post_params, affine, out, stats)
    return out, stats


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 2 channels x 4 positions: a group spans several channel blocks and position tiles.
    The channels-last kernels' tiles: 4 channels x 2 positions, so a block holds parts of two groups
    of 3 and a group straddles two blocks; their combine reads one chunk of 2 channels at a time."""
    monkeypatch.setattr(gn, "MAX_BLOCK_C", 2)
    monkeypatch.setattr(gn, "TILE_ELEMENTS", 8)
    monkeypatch.setattr(gn, "CHANNELS_LAST_BLOCK_C", 4)
    monkeypatch.setattr(gn, "COMBINE_LANES", 2)
    monkeypatch.setattr(gn, "COMBINE_GROUP_LANES", 2)
    gn._FORWARD_LAUNCHES.clear()
    gn._BACKWARD_LAUNCHES.clear()
    yield
    gn._FORWARD_LAUNCHES.clear()
    gn._BACKWARD_LAUNCHES.clear()


#: The layouts of a conv output: the group kernels walk a contiguous one, the channels-last kernels the others.
LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tiling", ["one tile", "many tiles"])
def test_statistics_and_output_match_torch(tiling, layout, kernel_device, request):
    if tiling == "many tiles":
        request.getfixturevalue("small_tiles")
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(2, 10, 3, 5, generator=gen).to(kernel_device).to(memory_format=LAYOUTS[layout])
    bias = torch.randn(10, generator=gen).to(kernel_device)
    gamma, beta = torch.randn(10, generator=gen).to(kernel_device), torch.randn(10, generator=gen).to(kernel_device)
    pre = [(OP_CODES["leaky_relu"], [0.1])]
    post = [(OP_CODES["silu"], [])]
    out, stats = forward(y, bias, 2, 1e-4, pre, post, gamma, beta)
    v = F.leaky_relu(y + bias[:, None, None], 0.1)
    torch.testing.assert_close(out, F.silu(F.group_norm(v, 2, gamma, beta, 1e-4)), rtol=1e-5, atol=1e-5)
    grouped = v.reshape(2, 2, -1)
    torch.testing.assert_close(stats[0], grouped.mean(-1))
    torch.testing.assert_close(stats[1], (grouped.var(-1, unbiased=False) + 1e-4).rsqrt())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_variance_far_from_zero_is_sound_in_fp32(layout, small_tiles, kernel_device):
    """Values around 3000 with spread 0.01: E[x^2] - E[x]^2 in fp32 loses every digit of the variance;
    the shifted per-tile two-pass statistics merged with Chan's formula keep it (the group kernels),
    as do the per-lane Welford accumulators merged with it (the channels-last kernels)."""
    gen = torch.Generator().manual_seed(2)
    y64 = 3000.0 + 0.01 * torch.randn(2, 4, 6, 7, generator=gen, dtype=torch.float64)
    y = y64.float().to(kernel_device).to(memory_format=LAYOUTS[layout])
    _, stats = forward(y, None, 2, eps=0.0)
    var = y.double().reshape(2, 2, -1).var(-1, unbiased=False)
    torch.testing.assert_close(stats[1].double().cpu(), var.rsqrt().cpu(), rtol=1e-4, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backward_gradients_match_autograd_and_are_bitwise_reproducible(layout, small_tiles, kernel_device):
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(3, 6, 5, 3, generator=gen).to(kernel_device).to(memory_format=LAYOUTS[layout])
    bias, gamma, beta, p, q = (torch.randn(6, generator=gen).to(kernel_device) for _ in range(5))
    pre = [(OP_CODES["mul"], [p]), (OP_CODES["tanh"], [])]
    post = [(OP_CODES["add"], [q]), (OP_CODES["gelu"], [])]
    _, stats = forward(y, bias, 3, 1e-5, pre, post, gamma, beta)
    g = torch.randn(y.shape, generator=gen).to(kernel_device)
    params, post_params, affine = inputs(y, bias, 3, pre, post, gamma, beta)

    def backward():
        grad_y = torch.empty_like(y)
        sums = gn.group_norm_backward(g, y, stats, True, pre, post, 3, params, post_params, affine, grad_y,
                                      [True, False], [True, False], (True, True))  # fmt: skip
        return grad_y, sums

    grad_y, (pre_sums, post_sums, affine_sums) = backward()
    leaves = [t.detach().clone().requires_grad_() for t in (y, p, q, gamma, beta)]
    yl, pl, ql, gl, bl = leaves
    v = torch.tanh((yl + bias[:, None, None]) * pl[:, None, None])
    out = F.gelu(F.group_norm(v, 3, gl, bl, 1e-5) + ql[:, None, None])
    want = torch.autograd.grad(out, leaves, g)
    for name, got, w in zip(("grad_y", "p", "q", "gamma", "beta"),
                            (grad_y, pre_sums[0], post_sums[0], affine_sums[0], affine_sums[1]), want, strict=True):  # fmt: skip
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5, msg=name)
    assert pre_sums[1] is None and post_sums[1] is None
    again_y, (again_pre, again_post, again_affine) = backward()
    assert torch.equal(again_y, grad_y) and torch.equal(again_pre[0], pre_sums[0])
    assert torch.equal(again_affine[0], affine_sums[0]) and torch.equal(again_post[0], post_sums[0])


@pytest.mark.parametrize("channels, groups", [(6, 3), (16, 2)], ids=["channels-last kernels", "group kernels"])
def test_channels_last_y_and_out_in_their_own_layouts(channels, groups, kernel_device):
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(2, channels, 4, 5, generator=gen).to(kernel_device).to(memory_format=torch.channels_last)
    assert gn.takes_channels_last_kernels(y, groups) == (channels // groups < 8)
    params, post_params, affine = inputs(y, None, groups)
    out = torch.empty(y.shape, device=kernel_device)  # contiguous while y is channels-last
    stats = torch.empty(2, 2, groups, device=kernel_device)
    gn.group_norm_forward(y, False, [], [], groups, 1e-5, params, post_params, affine, out, stats)
    torch.testing.assert_close(out, F.group_norm(y, groups), rtol=1e-5, atol=1e-5)
    g = torch.randn(y.shape, generator=gen).to(kernel_device)
    grad_y = torch.empty_like(y)
    _, _, (dgamma, dbeta) = gn.group_norm_backward(g, y, stats, False, [], [], groups, params, post_params, affine,
                                                   grad_y, (), (), (True, True))  # fmt: skip
    yl, gl, bl = (t.detach().clone().requires_grad_() for t in (y, affine[0], affine[1]))
    want = torch.autograd.grad(F.group_norm(yl, groups, gl, bl, 1e-5), (yl, gl, bl), g)
    for name, got, w in zip(("grad_y", "gamma", "beta"), (grad_y, dgamma, dbeta), want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5, msg=name)


def test_which_kernels_serve_a_call():
    """The channels-last kernels where y's channels are its contiguous axis and a group's channels at a
    position are shorter than a 32-byte sector or the groups split into chunks; the group kernels else."""
    y = torch.empty(2, 64, 4, 4)
    cl = y.to(memory_format=torch.channels_last)
    assert not gn.takes_channels_last_kernels(y, 32)  # contiguous
    assert gn.takes_channels_last_kernels(cl, 32)  # 2 fp32 channels: 8 bytes per position
    assert not gn.takes_channels_last_kernels(cl, 8)  # 8 fp32 channels (a sector), one chunk (no GPU: no split)
    assert gn.takes_channels_last_kernels(cl, 8, chunk=4)  # groups split into chunks
    assert gn.takes_channels_last_kernels(cl.half(), 8)  # 8 fp16 channels: 16 bytes
    assert not gn.takes_channels_last_kernels(cl[:0], 32)  # nothing to read


def test_arguments_are_checked_with_one_line_messages(kernel_device):
    y = torch.randn(2, 6, 4, 5, device=kernel_device)
    params, post_params, affine = inputs(y, None, 3)
    out = torch.empty_like(y)
    with pytest.raises(ValueError, match="6 channels do not split into 4 groups"):
        gn.group_norm_forward(y, False, [], [], 4, 1e-5, params, post_params, affine, out)
    with pytest.raises(ValueError, match="out must have y's shape"):
        gn.group_norm_forward(y, False, [], [], 3, 1e-5, params, post_params, affine, out[:, :3])
    with pytest.raises(ValueError, match="stats must be contiguous fp32"):
        gn.group_norm_forward(y, False, [], [], 3, 1e-5, params, post_params, affine, out, torch.empty(2, 2, 2))
    with pytest.raises(ValueError, match="the affine rows must be contiguous fp32 with 6 columns"):
        gn.group_norm_forward(y, False, [], [], 3, 1e-5, params, post_params, affine[:, :4], out)
    with pytest.raises(ValueError, match="spatial dims must flatten"):
        gn.group_norm_forward(y[..., ::2], False, [], [], 3, 1e-5, params, post_params, affine, out[..., ::2])


# --------------------------------------------------------------------------------------------------
# Groups split into chunks (forced with ``chunk``: the interpreter's own choice is one chunk)
# --------------------------------------------------------------------------------------------------


def test_chunk_positions_fill_the_gpu_in_whole_tiles_and_leave_small_groups_whole():
    # the families GroupNorm demo: 128 groups of 4 channels x 16384 positions, tiles of 4 x 512
    block_c, block_s = gn._tile(4, 16384)
    chunk = gn.chunk_positions(128, 4, 16384, block_s, 132)
    assert (block_c, block_s, chunk) == (4, 512, 2048)
    assert 128 * (16384 // chunk) >= 4 * 132 and 4 * chunk >= gn.MIN_CHUNK_ELEMENTS
    assert gn.chunk_positions(128, 4, 16384, block_s, 0) == 16384  # no GPU: one chunk
    assert gn.chunk_positions(2048, 4, 16384, block_s, 132) == 16384  # the groups alone fill the GPU
    assert gn.chunk_positions(128, 2, 1024, 1024, 132) == 1024  # groups too small to split
    # 64 channels per group over 1600 positions: chunks of whole 64 x 32 tiles, at least 4096 elements
    block_c, block_s = gn._tile(64, 1600)
    chunk = gn.chunk_positions(16, 64, 1600, block_s, 132)
    assert chunk % block_s == 0 and 64 * chunk >= gn.MIN_CHUNK_ELEMENTS and 1600 // chunk > 1


def split_case(layout, seed):
    """A (2, 6, *spatial) conv output in ``layout``, 2 groups of 3 channels: with ``small_tiles`` two
    channel blocks per group; ``CHUNK`` = 6 positions, so chunks of two tiles (4 + 2 positions) and a
    shorter last chunk (the position count is not a multiple of the chunk)."""
    gen = torch.Generator().manual_seed(seed)
    spatial, fmt = {"contiguous": ((5, 3), torch.contiguous_format),
                    "channels_last": ((5, 3), torch.channels_last),
                    "channels_last_3d": ((2, 2, 4), torch.channels_last_3d)}[layout]  # fmt: skip
    y = torch.randn(2, 6, *spatial, generator=gen)
    return y.to(memory_format=fmt), gen


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "channels_last_3d"])
def test_split_groups_match_torch_and_are_bitwise_reproducible(layout, small_tiles, kernel_device):
    y, gen = split_case(layout, 5)
    y = y.to(kernel_device)
    bias, gamma, beta = (torch.randn(6, generator=gen).to(kernel_device) for _ in range(3))
    pre, post = [(OP_CODES["leaky_relu"], [0.1])], [(OP_CODES["silu"], [])]
    params, post_params, affine = inputs(y, bias, 2, pre, post, gamma, beta)

    def run(chunk):
        out = torch.empty_like(y)  # y's layout
        stats = torch.empty(2, 2, 2, device=kernel_device)
        gn.group_norm_forward(y, True, pre, post, 2, 1e-4, params, post_params, affine, out, stats, chunk=chunk)
        return out, stats

    out, stats = run(6)
    shape = (1, -1) + (1,) * (y.dim() - 2)
    v = F.leaky_relu(y + bias.reshape(shape), 0.1)
    torch.testing.assert_close(out, F.silu(F.group_norm(v, 2, gamma, beta, 1e-4)), rtol=1e-5, atol=1e-5)
    assert out.stride() == y.stride()
    grouped = v.reshape(2, 2, -1)
    torch.testing.assert_close(stats[0], grouped.mean(-1))
    torch.testing.assert_close(stats[1], (grouped.var(-1, unbiased=False) + 1e-4).rsqrt())
    again, again_stats = run(6)
    assert torch.equal(again, out) and torch.equal(again_stats, stats)
    whole, whole_stats = run(None)
    torch.testing.assert_close(whole, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(whole_stats, stats, rtol=1e-6, atol=1e-6)


def test_split_variance_far_from_zero_is_sound_in_fp32(small_tiles, kernel_device):
    """Chunks with their own shifts: combined through the shifts' exact differences, the chunks'
    means keep the digits of a spread of 0.01 around 3000."""
    gen = torch.Generator().manual_seed(6)
    y64 = 3000.0 + 0.01 * torch.randn(2, 4, 6, 7, generator=gen, dtype=torch.float64)
    y = y64.float().to(kernel_device)
    params, post_params, affine = inputs(y, None, 2)
    stats = torch.empty(2, 2, 2, device=kernel_device)
    gn.group_norm_forward(y, False, [], [], 2, 0.0, params, post_params, affine, torch.empty_like(y), stats, chunk=5)
    grouped = y.double().reshape(2, 2, -1)
    torch.testing.assert_close(stats[1].double().cpu(), grouped.var(-1, unbiased=False).rsqrt().cpu(), rtol=1e-4, atol=0)
    torch.testing.assert_close(stats[0].double().cpu(), grouped.mean(-1).cpu(), rtol=0, atol=1e-3)


def test_split_backward_gradients_match_autograd_and_are_bitwise_reproducible(small_tiles, kernel_device):
    """A channels-last conv output and grad_y, a contiguous grad_out."""
    y, gen = split_case("channels_last", 7)
    y = y.to(kernel_device)
    bias, gamma, beta, p, q = (torch.randn(6, generator=gen).to(kernel_device) for _ in range(5))
    pre = [(OP_CODES["mul"], [p]), (OP_CODES["tanh"], [])]
    post = [(OP_CODES["add"], [q]), (OP_CODES["gelu"], [])]
    _, stats = forward(y, bias, 2, 1e-5, pre, post, gamma, beta)
    g = torch.randn(y.shape, generator=gen).to(kernel_device)
    params, post_params, affine = inputs(y, bias, 2, pre, post, gamma, beta)

    def backward(chunk):
        grad_y = torch.empty_like(y)
        sums = gn.group_norm_backward(g, y, stats, True, pre, post, 2, params, post_params, affine, grad_y,
                                      [True, False], [True, False], (True, True), chunk=chunk)  # fmt: skip
        return grad_y, sums

    grad_y, (pre_sums, post_sums, affine_sums) = backward(6)
    leaves = [t.detach().clone().requires_grad_() for t in (y, p, q, gamma, beta)]
    yl, pl, ql, gl, bl = leaves
    v = torch.tanh((yl + bias[:, None, None]) * pl[:, None, None])
    out = F.gelu(F.group_norm(v, 2, gl, bl, 1e-5) + ql[:, None, None])
    want = torch.autograd.grad(out, leaves, g)
    got = (grad_y, pre_sums[0], post_sums[0], affine_sums[0], affine_sums[1])
    for name, got_t, w in zip(("grad_y", "p", "q", "gamma", "beta"), got, want, strict=True):
        torch.testing.assert_close(got_t, w, rtol=1e-4, atol=1e-5, msg=name)
    assert grad_y.stride() == y.stride()
    assert pre_sums[1] is None and post_sums[1] is None
    again_y, (again_pre, again_post, again_affine) = backward(6)
    again = (again_y, again_pre[0], again_post[0], again_affine[0], again_affine[1])
    assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True))
