"""The layer-norm kernels (``kernels/layer_norm.py``) called through their launchers, on CPU under
Triton's interpreter (on CUDA when present): how rows are cut and planned, the output, the statistics
and every gradient sum against autograd for short rows packed in tiles (in the statistics' order
and channels-fast on a channels-last output) and for long rows walked in chunks (a row per sample,
or a long run of one channel's positions), several programs per launch forced so that each
program's loops and the fixed-order sums over programs are exercised, bitwise reproducibility,
numerically sound statistics far from zero, and argument checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.kernels import layer_norm as ln
from fusion_backend.kernels.chain_math import OP_CODES
from fusion_backend.kernels.epilogue import build_params

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def test_rows_and_plans_follow_the_normalized_dims_and_fill_an_h100(monkeypatch):
    geo = ln.row_geometry((16, 64, 32, 64, 64), 1)  # LayerNorm(W) of the ConvTranspose3d example
    assert (geo.row_channels, geo.row_positions, geo.rows_per_channel, geo.rows, geo.packed) == (1, 64, 2048,
                                                                                                2 ** 21, True)  # fmt: skip
    geo = ln.row_geometry((32, 64, 64, 64), 3)  # the families workload: a row per sample
    assert (geo.row_channels, geo.row_positions, geo.rows, geo.elements, geo.packed) == (64, 4096, 32, 2 ** 18, False)
    assert ln.row_geometry((2, 3, 40, 70), 2).packed is False  # 2800 positions: too long to pack
    with pytest.raises(ValueError, match="not the batch"):
        ln.row_geometry((2, 3, 4, 5), 4)
    monkeypatch.setattr(ln, "sm_count", lambda device: 132)
    y = torch.empty(32, 64, 64, 64, device="meta")
    p = ln.plan(geo, y)
    assert (p.block_c, p.block_s, p.split) == (64, 32, 32)  # 32 rows x 32 chunks: about 8 programs per SM
    assert p.tile_programs * p.row_programs >= 4 * 132 and p.rows_per_program * p.row_programs >= 32
    y = torch.empty(16, 64, 32, 64, 64, device="meta").to(memory_format=torch.channels_last_3d)
    p = ln.plan(ln.row_geometry(y.shape, 1), y)
    assert (p.packed, p.channels_fast, p.block_r, p.block_l) == (True, True, 32, 64)
    assert 7 * 132 < p.programs <= 8 * 132 and p.programs * p.blocks_per_program >= p.blocks > (p.programs - 1) * p.blocks_per_program


def case(shape, dims, layout=None, seed=0):
    """A conv output of ``shape`` (in ``layout``), a bias, a pre-chain ``tanh(y * p)`` and a post-chain
    ``gelu(z + q)`` with per-channel p and q, and gamma / beta of the normalized shape."""
    gen, dev = torch.Generator().manual_seed(seed), torch.empty(0).device  # drawn on the CPU, then moved

    def draw(*size):
        return torch.randn(*size, generator=gen, device="cpu").to(dev)

    y = draw(*shape)
    if layout is not None:
        y = y.to(memory_format=layout)
    c, normalized = shape[1], shape[len(shape) - dims:]
    bias, p, q = (draw(c) for _ in range(3))
    gamma, beta = (draw(*normalized) for _ in range(2))
    return y, bias, p, q, gamma, beta


def run(y, dims, bias, p, q, gamma, beta, grad, programs=None, chunk=None, eps=1e-5):
    """Forward and backward through the launchers: ``(out, stats, grad_y, p's, q's, gamma's, beta's gradients)``."""
    c = y.shape[1]
    pre = [(OP_CODES["mul"], [p]), (OP_CODES["tanh"], [])]
    post = [(OP_CODES["add"], [q]), (OP_CODES["gelu"], [])]
    params, post_params = build_params(pre, bias, c, y.device), build_params(post, None, c, y.device)
    affine = torch.stack([gamma.reshape(-1), beta.reshape(-1)]).contiguous()
    out = torch.empty(y.shape, device=y.device)
    stats = torch.empty(2, ln.row_geometry(y.shape, dims).rows, device=y.device)
    ln.layer_norm_forward(y, dims, True, pre, post, eps, params, post_params, affine, out, stats, programs, chunk)
    grad_y = torch.empty_like(y)
    pre_sums, post_sums, affine_sums = ln.layer_norm_backward(
        grad, y, stats, dims, True, pre, post, params, post_params, affine, grad_y, [True, False], [True, False],
        (True, True), programs, chunk)  # fmt: skip
    assert pre_sums[1] is None and post_sums[1] is None
    return out, stats, grad_y, pre_sums[0], post_sums[0], affine_sums[0], affine_sums[1]


def check_against_torch(shape, dims, layout=None, programs=None, chunk=None, seed=0, again=True):
    y, bias, p, q, gamma, beta = case(shape, dims, layout, seed)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1), device="cpu").to(y.device)
    got = run(y, dims, bias, p, q, gamma, beta, grad, programs, chunk)
    view = (1, -1) + (1,) * (len(shape) - 2)
    leaves = [t.detach().clone().requires_grad_() for t in (y, p, q, gamma, beta)]
    yl, pl, ql, gl, bl = leaves
    v = torch.tanh((yl + bias.view(view)) * pl.view(view))
    out = F.gelu(F.layer_norm(v, gamma.shape, gl, bl, 1e-5) + ql.view(view))
    want = torch.autograd.grad(out, leaves, grad)
    torch.testing.assert_close(got[0], out.detach(), rtol=1e-5, atol=1e-5)
    assert got[0].is_contiguous()
    rows = v.detach().reshape(-1, math.prod(gamma.shape))
    torch.testing.assert_close(got[1][0], rows.mean(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1][1], (rows.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-4, atol=1e-5)
    names = ("grad_y", "p", "q", "gamma", "beta")
    for name, g, w in zip(names, got[2:], (want[0], want[1], want[2], want[3].reshape(-1), want[4].reshape(-1)),
                          strict=True):  # fmt: skip
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)
    assert got[2].stride() == y.stride()  # grad_y in the conv output's layout
    if again:
        rerun = run(y, dims, bias, p, q, gamma, beta, grad, programs, chunk)
        assert all(torch.equal(a, b) for a, b in zip(rerun, got, strict=True)), "not bitwise reproducible"


@pytest.fixture
def short_rows_walk(monkeypatch):
    """Rows longer than 4 positions walk (the interpreter is slow on the long rows that walk by default)."""
    monkeypatch.setattr(ln, "MAX_PACKED_ROW", 4)
    ln._FORWARD_LAUNCHES.clear()
    ln._BACKWARD_LAUNCHES.clear()
    yield
    ln._FORWARD_LAUNCHES.clear()
    ln._BACKWARD_LAUNCHES.clear()


@pytest.mark.parametrize("layout", [None, torch.channels_last_3d], ids=["contiguous", "channels-last"])
def test_packed_rows_match_torch_and_are_bitwise_reproducible(layout, kernel_device):
    """LayerNorm(W) and over (H, W): rows of one channel, several to a tile; three programs walk the
    row blocks, so each loops and the gamma / beta partials of three programs are summed."""
    with torch.device(kernel_device):
        check_against_torch((2, 3, 3, 4, 6), 1, layout, programs=3)
        check_against_torch((2, 3, 3, 4, 6), 2, layout, programs=2, seed=1)


def test_walked_rows_split_into_chunks_match_torch_and_are_bitwise_reproducible(short_rows_walk, kernel_device):
    """A row per sample (channels and positions), split into chunks of 5 positions (the last one
    shorter), the gradient pass over 2 row groups; and rows of one channel too long to pack, on a
    channels-last output, split in two, the gradient pass over 2 tile groups."""
    with torch.device(kernel_device):
        check_against_torch((2, 3, 2, 4), 3, chunk=5, programs=2)
        check_against_torch((1, 2, 2, 5), 2, torch.channels_last, chunk=6, programs=3, seed=3, again=False)


@pytest.mark.parametrize("dims, chunk", [(1, None), (3, 5)], ids=["packed", "walked in chunks"])
def test_variance_far_from_zero_is_sound_in_fp32(dims, chunk, kernel_device):
    """Values around 3000 with spread 0.01: E[x^2] - E[x]^2 in fp32 loses every digit of the variance;
    two-pass statistics in registers, and Chan-merged shifted ones across tiles and chunks, keep it."""
    gen = torch.Generator().manual_seed(4)
    y = (3000.0 + 0.01 * torch.randn(2, 4, 6, 7, generator=gen, dtype=torch.float64)).float().to(kernel_device)
    c = y.shape[1]
    params, post_params = build_params([], None, c, y.device), build_params([], None, c, y.device)
    normalized = y.shape[4 - dims:]
    affine = torch.stack([torch.ones(math.prod(normalized)), torch.zeros(math.prod(normalized))]).to(kernel_device)
    rows = ln.row_geometry(y.shape, dims).rows
    stats = torch.empty(2, rows, device=kernel_device)
    ln.layer_norm_forward(y, dims, False, [], [], 0.0, params, post_params, affine, torch.empty_like(y), stats,
                          chunk=chunk)  # fmt: skip
    exact = y.double().reshape(rows, -1)
    torch.testing.assert_close(stats[1].double().cpu(), exact.var(-1, unbiased=False).rsqrt().cpu(), rtol=1e-4, atol=0)
    torch.testing.assert_close(stats[0].double().cpu(), exact.mean(-1).cpu(), rtol=0, atol=1e-3)


def test_arguments_are_checked_with_one_line_messages(kernel_device):
    y = torch.randn(2, 6, 4, 5, device=kernel_device)
    params = build_params([], None, 6, y.device)
    affine = torch.zeros(2, 5, device=kernel_device)
    out = torch.empty_like(y)
    with pytest.raises(ValueError, match="the affine rows must be contiguous fp32 with 20 columns"):
        ln.layer_norm_forward(y, 2, False, [], [], 1e-5, params, params, affine, out)
    with pytest.raises(ValueError, match="out must have y's shape"):
        ln.layer_norm_forward(y, 1, False, [], [], 1e-5, params, params, affine, out[:, :3])
    with pytest.raises(ValueError, match=r"stats must be contiguous fp32 \(2, 48\)"):
        ln.layer_norm_forward(y, 1, False, [], [], 1e-5, params, params, affine, out, torch.empty(2, 12))
    with pytest.raises(ValueError, match="P must be contiguous fp32 with 6 columns"):
        ln.layer_norm_forward(y, 1, False, [], [], 1e-5, params[:, :4], params, affine, out)
    with pytest.raises(ValueError, match="spatial dims must flatten"):
        ln.layer_norm_forward(y[..., ::2], 1, False, [], [], 1e-5, params, params, affine[:, :3].contiguous(),
                              out[..., ::2])  # fmt: skip
