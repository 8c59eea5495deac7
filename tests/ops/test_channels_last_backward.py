"""The library backward's channels-last variant (``ops/conv_epilogue/backward.LibraryBackward``,
``channels_last=True``): the epilogue kernel writes the conv-output gradient channels-last from an
NCHW saved state (a transposing tile), x is cast and relaid in one copy, the conv backward runs on
channels-last tensors, and the gradients come back in the inputs' layouts.

The variant is one of ``auto``'s measured backward candidates on CUDA; here it is forced, so the
CPU run (interpreter) checks the same values the GPU run does.  Every gradient is checked against
float64, on odd sizes, with negative multipliers and max-pool ties.
"""

from __future__ import annotations

import os

import pytest
import torch
from conv_cases import GELU, LEAKY, MUL0, conv_spec

from fusion_backend.ir.specs import PoolSpec
from fusion_backend.kernels import epilogue as kernels
from fusion_backend.ops import chain_lowering, conv_io
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.testing import compare

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


#: name -> (conv spec, chain, pool, x shape, weight shape, has bias, multiplier shape)
CASES = {
    # the op of demos/seeds/conv2d_mul_leaky_gelu.py at a small, odd size
    "conv2d-mul-leaky-gelu": (conv_spec(2), (MUL0, LEAKY, GELU), None, (2, 5, 7, 9), (6, 5, 3, 3), True, (6, 1, 1)),
    "conv2d-s2-max-pool": (
        conv_spec(2, stride=2), (LEAKY, MUL0), PoolSpec("max", (2, 2), (2, 2), (0, 0)), (2, 3, 11, 10), (4, 3, 3, 3),
        True, (4, 1, 1),
    ),
    "conv2d-avg-pool-partial": (
        conv_spec(2), (MUL0,), PoolSpec("avg", (3, 3), (2, 2), (1, 1)), (1, 4, 9, 7), (5, 4, 3, 3), False, (1,),
    ),
    "conv2d-groups-dilation": (
        conv_spec(2, padding=2, dilation=2, groups=2), (LEAKY,), None, (2, 4, 8, 7), (6, 2, 3, 3), False, None,
    ),
    # the op of demos/seeds/convt3d_leaky_mul_leaky_maxpool.py (channels_last_3d)
    "convT3d-leaky-mul-leaky-max-pool": (
        conv_spec(3, stride=2, transposed=True, output_padding=1), (LEAKY, MUL0, LEAKY),
        PoolSpec("max", (2, 2, 2), (2, 2, 2), (0, 0, 0)), (2, 3, 3, 4, 5), (3, 4, 3, 3, 3), True, (4, 1, 1, 1),
    ),
}


@pytest.fixture
def channels_last_backward(monkeypatch, exact_fp32, fresh_plans):
    """The fused op with its backward forced to the channels-last library variant."""
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path on CPU tensors needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setenv(ce.CONV_IMPL_ENV, "library")
    built = []

    def backward_plan(grad_out, x, weight, bias, operands, saved_y0, saved_winner, cfg, mask):
        plans = ce.backward.backward_candidates(grad_out, x, weight, bias, operands, saved_y0, saved_winner, cfg, mask)
        built.append(plans["library-channels-last"])
        return plans["library-channels-last"], True

    monkeypatch.setattr(ce.backward, "plan_for", backward_plan)
    return built


def _inputs(case: str, dtype: torch.dtype = torch.float32):
    spec, chain, pool, x_shape, w_shape, has_bias, m_shape = CASES[case]
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    x = torch.randn(x_shape, generator=g)
    w = torch.randn(w_shape, generator=g) * 0.3
    b = torch.randn(w_shape[1] * spec.groups if spec.transposed else w_shape[0], generator=g) if has_bias else None
    ops = [torch.randn(m_shape, generator=g)] if m_shape is not None else []
    if ops:
        ops[0].view(-1)[0] = -abs(ops[0].view(-1)[0]) - 0.5  # a negative multiplier flips max-pool winners
    leaves = [t.to(DEVICE, dtype).requires_grad_(True) for t in (x, w, b, *ops) if t is not None]
    config = ConvEpilogueConfig(conv=spec, chain=chain, pool=pool, strict=True).to_json()
    return leaves, has_bias, config


def _call(fn, leaves, has_bias, config):
    x, w, *rest = leaves
    b = rest.pop(0) if has_bias else None
    return fn(x, w, b, rest, config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_channels_last_backward_matches_float64(case, channels_last_backward):
    leaves, has_bias, config = _inputs(case)
    out = _call(ce.conv_epilogue, leaves, has_bias, config)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(_call(ce.conv_epilogue_eager, leaves, has_bias, config), leaves, grad)
    leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = torch.autograd.grad(_call(ce.conv_epilogue_eager, leaves64, has_bias, config), leaves64, grad.double())
    assert len(channels_last_backward) == 1, "the forced plan was not used"
    plan = channels_last_backward[0]
    fmt = conv_io.channels_last_format(leaves[0].dim())
    shape, stride, _ = plan.g_layout
    assert stride == torch.empty(shape, device="meta", memory_format=fmt).stride(), "grad_y is not channels-last"
    for name, leaf, g, w_, r in zip("x weight bias multiplier".split(), leaves, got, want, ref, strict=False):
        assert g.stride() == leaf.stride(), f"{name}: strides {g.stride()} != the input's {leaf.stride()}"
        problem = compare(name, g, w_, tol=1e-5, reference=r)
        assert problem is None, problem


def test_channels_last_backward_with_a_sliced_input(channels_last_backward):
    """x a slice of a wider tensor (its spatial dims do not flatten: the relayout into
    channels-last takes torch's copy); its gradient comes back in ``empty_like(x)``'s layout."""
    leaves, has_bias, config = _inputs("conv2d-mul-leaky-gelu")
    wide = torch.randn(2, 5, 7, 12, device=DEVICE)
    x = wide[..., 2:11].detach().requires_grad_(True)
    leaves[0] = x
    out = _call(ce.conv_epilogue, leaves, has_bias, config)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(_call(ce.conv_epilogue_eager, leaves, has_bias, config), leaves, grad)
    assert got[0].stride() == torch.empty_like(x).stride()
    for name, g, w_ in zip("x weight bias multiplier".split(), got, want, strict=True):
        problem = compare(name, g, w_, tol=1e-5)
        assert problem is None, problem


def test_channels_last_backward_with_half_compute(channels_last_backward):
    """fp32 tensors with ``compute_dtype=float16`` (autocast's casts absorbed): x is cast and relaid
    in one copy; the gradients come back in fp32 and in NCHW."""
    leaves, has_bias, _ = _inputs("conv2d-mul-leaky-gelu")
    spec, chain, *_ = CASES["conv2d-mul-leaky-gelu"]
    config = ConvEpilogueConfig(conv=spec, chain=chain, compute_dtype="float16", strict=True).to_json()
    out = _call(ce.conv_epilogue, leaves, has_bias, config)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(_call(ce.conv_epilogue_eager, leaves, has_bias, config), leaves, grad)
    for name, leaf, g, w_ in zip("x weight bias multiplier".split(), leaves, got, want, strict=True):
        assert g.dtype == torch.float32 and g.stride() == leaf.stride(), name
        problem = compare(name, g, w_, tol=2e-3)
        assert problem is None, problem


def test_max_pool_ties_go_to_one_winner(channels_last_backward):
    """A constant input gives every pool window a tie; the gradient reaches exactly one element
    per window (as eager's max pool does), through the transposing write."""
    leaves, has_bias, config = _inputs("conv2d-s2-max-pool")
    with torch.no_grad():
        leaves[0].fill_(0.5)
        leaves[1].fill_(0.25)
    out = _call(ce.conv_epilogue, leaves, has_bias, config)
    grad = torch.rand_like(out) + 0.5
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(_call(ce.conv_epilogue_eager, leaves, has_bias, config), leaves, grad)
    for name, g, w_ in zip("x weight bias multiplier".split(), got, want, strict=True):
        problem = compare(name, g, w_, tol=1e-5)
        assert problem is None, problem


def test_transposing_epilogue_kernel_writes_the_same_values(exact_fp32, monkeypatch):
    """``BackwardLaunch`` with an NCHW y and a channels-last grad_y gives grad_y's values bitwise
    as the same-layout launch does (an elementwise gradient), and the same per-channel sums up to
    their summation order (the transposing tile groups positions differently)."""
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    spec, chain, _, x_shape, w_shape, _, m_shape = CASES["conv2d-mul-leaky-gelu"]
    cfg = ConvEpilogueConfig(conv=spec, chain=chain)
    g = torch.Generator().manual_seed(3)
    y = torch.randn(3, 70, 9, 11, generator=g).to(DEVICE)  # 70 channels: two channel blocks, one partial
    bias = torch.randn(70, generator=g).to(DEVICE)
    mult = torch.randn(70, 1, 1, generator=g).to(DEVICE)
    grad_out = torch.randn(y.shape, generator=g).to(DEVICE)
    steps = chain_lowering.kernel_steps(cfg.chain, [mult], 4, 70)
    results = {}
    for fmt in (torch.contiguous_format, torch.channels_last):
        grad_y = torch.empty(y.shape, device=DEVICE, memory_format=fmt)
        sums, grad_bias = kernels.epilogue_backward(grad_out, y, None, None, bias, steps, None, grad_y, [True], True)
        results[fmt] = grad_y, sums[0], grad_bias
    (gy_a, s_a, b_a), (gy_b, s_b, b_b) = results.values()
    assert gy_b.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(gy_a, gy_b)
    torch.testing.assert_close(s_b, s_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b_b, b_a, rtol=1e-5, atol=1e-5)


def test_which_cases_get_a_channels_last_candidate():
    """2-d and 3-d convs on NCHW-style tensors; not 1-d convs (no cuDNN channels-last kernels),
    not tensors already channels-last (the library backward is channels-last there), not float64."""
    x4 = torch.randn(2, 3, 5, 5)
    assert ce.backward.channels_last_backward_unsupported(x4, torch.randn(2, 4, 5, 5)) is None
    assert ce.backward.channels_last_backward_unsupported(torch.randn(2, 3, 4, 4, 4), torch.randn(2, 4, 4, 4, 4)) is None
    assert "1-d" in ce.backward.channels_last_backward_unsupported(torch.randn(2, 3, 5), torch.randn(2, 4, 5))
    assert "float64" in ce.backward.channels_last_backward_unsupported(x4.double(), torch.randn(2, 4, 5, 5))
    x_cl = x4.to(memory_format=torch.channels_last)
    y_cl = torch.randn(2, 4, 5, 5).to(memory_format=torch.channels_last)
    assert "already" in ce.backward.channels_last_backward_unsupported(x_cl, y_cl)
