"""The ``conv_batch_norm`` fused op: config, custom-op contract, output and every gradient against
float64 (x, conv weight and bias, the norm's weight and bias, chain operands), the running statistics
over several steps (momentum, with and without them, affine or not), eps, layouts, NaN / inf, fp16,
bitwise reproducibility, bad input, the failure policy; GPU parity at the bench workload's size.

The oracle is the literal eager composite (conv, ``F.batch_norm(training=True)``, the chain with
``apply_step``) run in float64; the op in fp32 / fp16 may be off from it by ``max(tol, 2 x eager's own
error)`` (``fusion_backend.testing.compare``), the yardstick the other op tests use.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.errors import KernelError, UnsupportedInputError
from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.ops.batch_statistics import AFFINE_ROWS, STATS_ROWS
from fusion_backend.ops.chain import ChainStep, ChainValue, Const, PointwiseKind, TensorRef
from fusion_backend.ops.chain_reference import apply_chain
from fusion_backend.ops.conv_batch_norm import (
    ConvBatchNormConfig,
    batch_norm_running_update,
    conv_batch_norm,
    conv_batch_norm_bwd,
    conv_batch_norm_fwd,
    kernel_path,
)
from fusion_backend.ops.conv_io import run_pool
from fusion_backend.testing import TOLERANCES, compare, relative_error

K = PointwiseKind
CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.usefixtures("exact_fp32"),
]

CONV2D = ConvSpec(False, (1, 2), (1, 0), (1, 1), (0, 0), 1)
CONVT1D = ConvSpec(True, (2,), (1,), (1,), (1,), 1)
CONV3D = ConvSpec(False, (1, 1, 1), (1, 1, 1), (1, 1, 1), (0, 0, 0), 2)

#: A 3x3 max pool with stride 2 and padding 1 (the ResNet stem's): windows overlap.
MAX_3_2_1 = PoolSpec("max", (3, 3), (2, 2), (1, 1))
#: silu, x * s (scalar tensor), + p (per channel), a DAG step reading the silu's input again.
POST = (ChainStep(K.SILU), ChainStep(K.MUL, (TensorRef(3),)), ChainStep(K.ADD, (TensorRef(2),)),
        ChainStep(K.ADD, (ChainValue(0),)))  # fmt: skip


def weight_shape(spec: ConvSpec, c_in: int, c_out: int, k: int) -> tuple[int, ...]:
    kernel = (k,) * spec.spatial_dims
    return (c_in, c_out // spec.groups, *kernel) if spec.transposed else (c_out, c_in // spec.groups, *kernel)


def eager(x, w, b, operands, cfg: ConvBatchNormConfig, running=(None, None)):
    """The composite the op stands for, with torch's own ops (autograd differentiates it)."""
    y = torch.ops.aten.convolution(x, w, b, list(cfg.conv.stride), list(cfg.conv.padding), list(cfg.conv.dilation),
                                   cfg.conv.transposed, list(cfg.conv.output_padding), cfg.conv.groups)  # fmt: skip
    gamma = None if cfg.weight is None else operands[cfg.weight]
    beta = None if cfg.bias is None else operands[cfg.bias]
    z = F.batch_norm(y, running[0], running[1], gamma, beta, True, cfg.momentum, cfg.eps)
    out = apply_chain(z, cfg.post, operands)
    return out if cfg.pool is None else run_pool(out, cfg.pool)


def make(spec: ConvSpec, c_in: int, c_out: int, size: tuple[int, ...], seed: int, dtype=torch.float32, batch: int = 2):
    """x, w, b, then the operands: gamma, beta (C,), a per-channel p (1, C, 1, ...), a scalar s."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, c_in, *size), generator=gen, dtype=torch.float64)
    w = torch.randn(weight_shape(spec, c_in, c_out, 3), generator=gen, dtype=torch.float64) * 0.5
    b = torch.randn((c_out,), generator=gen, dtype=torch.float64) + 3.0  # far from zero: the mean matters
    gamma = torch.randn(c_out, generator=gen, dtype=torch.float64)
    beta = torch.randn(c_out, generator=gen, dtype=torch.float64)
    p = torch.randn(1, c_out, *([1] * spec.spatial_dims), generator=gen, dtype=torch.float64)
    s = torch.tensor(-0.7, dtype=torch.float64)
    return [t.to(dtype) for t in (x, w, b, gamma, beta, p, s)]


def device_of(kernels: str, kernel_device: str) -> str:
    return kernel_device if kernels != "reference" else "cpu"


def check(cfg: ConvBatchNormConfig, tensors, device: str, tol=None, layout=None, relu_mask_of_each_side=False):
    """Run the op on ``tensors`` (x, w, b, *operands) on ``device`` and compare output and every
    gradient with eager in the same dtype, measured against eager in float64.  ``layout(t)`` makes x
    (e.g. channels-last, or a slice).  Strict: a Triton path that fails raises.

    ``relu_mask_of_each_side`` (a post-chain ending in ReLU): each side's gradients are measured
    against a float64 truth that keeps the ReLU mask of that side's own output.  At millions of
    values some norm outputs lie within rounding of zero, where fp32 and float64 may disagree on
    the sign; one such position moves a gradient by a whole ``grad_out`` value, so without this the
    verdict depends on how many such positions each side happens to draw.  With it, a backward whose
    mask disagrees with its own forward still fails."""
    config = dataclasses.replace(cfg, strict=True).to_json()
    layout = layout or (lambda t: t)

    def leaves(dtype):
        made = [t.detach().to(device=device, dtype=dtype) for t in tensors]
        made[0] = layout(made[0])
        return [t.requires_grad_() if t.is_leaf else t for t in made]

    mine, theirs, exact = leaves(tensors[0].dtype), leaves(tensors[0].dtype), leaves(torch.float64)
    out = conv_batch_norm(mine[0], mine[1], mine[2], mine[3:], config)
    want = eager(theirs[0], theirs[1], theirs[2], theirs[3:], cfg)
    truth = eager(exact[0], exact[1], exact[2], exact[3:], cfg)
    assert out.shape == want.shape and out.dtype == want.dtype
    problems = [compare("output", out.cpu(), want.cpu(), tol, reference=truth.cpu())]
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(device)
    names = ["x", "weight", "bias", "gamma", "beta", "p", "s"]
    got = torch.autograd.grad(out, mine, g.to(out.dtype), allow_unused=True)
    ref = torch.autograd.grad(want, theirs, g.to(want.dtype), allow_unused=True)
    tru = torch.autograd.grad(truth, exact, g, allow_unused=True)
    truths = (tru, tru)
    if relu_mask_of_each_side:
        assert cfg.post and cfg.post[-1].kind == K.RELU, "the post-chain must end in ReLU"
        pre_relu = dataclasses.replace(cfg, post=cfg.post[:-1])
        truths = tuple(torch.autograd.grad(eager(*exact[:3], exact[3:], pre_relu) * (side > 0), exact, g,
                                           allow_unused=True) for side in (out, want))  # fmt: skip
    for name, a, e, t, t_eager in zip(names, got, ref, *truths, strict=False):
        if e is None:
            assert a is None or not a.any(), name
            continue
        assert a is not None and a.dtype == e.dtype and a.shape == e.shape, name
        if name == "bias":  # the norm removes any per-channel shift: zero up to each side's rounding
            bound = 100 * max(e.abs().max().item(), torch.finfo(e.dtype).eps * want.numel() / want.shape[1])
            assert t.abs().max() < 1e-9 and a.abs().max() <= bound, (a, e)
            continue
        if relu_mask_of_each_side:  # each side against the truth of its own mask
            bound = max(tol or TOLERANCES[e.dtype], 2 * relative_error(e.cpu(), t_eager.cpu()))
            problems.append(compare(f"grad of {name}", a.cpu(), t.to(a.dtype).cpu(), bound))
            continue
        problems.append(compare(f"grad of {name}", a.cpu(), e.cpu(), tol, reference=t.cpu()))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)
    return out


# ------------------------------------------------------------------------------------------------
# Config and contract
# ------------------------------------------------------------------------------------------------


def test_config_round_trips_and_rejects_what_it_cannot_mean() -> None:
    cfg = ConvBatchNormConfig(CONV2D, 1e-3, 0.3, 0, 1, True, POST, "float32", "float32", True)
    assert ConvBatchNormConfig.from_json(cfg.to_json()) == cfg
    assert cfg.pre == ()
    with pytest.raises(ValueError, match="eps"):
        ConvBatchNormConfig(CONV2D, eps=-1.0)
    with pytest.raises(ValueError, match="momentum must be a number"):
        ConvBatchNormConfig(CONV2D, momentum=None)
    with pytest.raises(ValueError, match="operand index"):
        ConvBatchNormConfig(CONV2D, weight=-1)
    with pytest.raises(ValueError, match="has not computed"):
        ConvBatchNormConfig(CONV2D, post=(ChainStep(K.ADD, (ChainValue(3),)),))
    with pytest.raises(ValueError, match="not a torch dtype"):
        ConvBatchNormConfig(CONV2D, out_dtype="float77")


def test_kernel_path_names_the_reason_for_the_reference() -> None:
    config = ConvBatchNormConfig(CONV2D).to_json()
    assert kernel_path(config, torch.bfloat16, "cuda") == ("triton", None)
    path, why = kernel_path(config, torch.float64, "cuda")
    assert path == "reference" and "float64" in why


@pytest.mark.parametrize("pool", [None, PoolSpec("max", (3, 3), (2, 2), (1, 1))], ids=["no pool", "max pool"])
def test_opcheck_forward_backward_and_running_update(pool, kernels, kernel_device) -> None:
    if pool is not None and kernels == "triton":
        pytest.skip("the fake and the schema are the same on every path: the reference run checks them")
    dev = device_of(kernels, kernel_device)
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1, False, POST, pool=pool)
    x, w, b, *ops = [t.to(dev).requires_grad_() for t in make(CONV2D, 3, 4, (5, 6), 0)]
    torch.library.opcheck(conv_batch_norm_fwd, (x, w, b, ops, cfg.to_json(), True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))  # fmt: skip
    detached = [t.detach() for t in (x, w, b)]
    out, saved_y, winner, stats = conv_batch_norm_fwd(*detached, [o.detach() for o in ops], cfg.to_json(), True)
    assert winner.dtype == torch.int8 and winner.shape == out.shape if pool else winner.numel() == 0
    torch.library.opcheck(conv_batch_norm_bwd, (torch.randn_like(out), *detached, [o.detach() for o in ops], saved_y,
                                                winner, stats, cfg.to_json(), [True] * 7),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
    running = (torch.zeros(4, device=dev), torch.ones(4, device=dev))
    torch.library.opcheck(batch_norm_running_update, (*running, stats, 0.1), test_utils=("test_schema", "test_faketensor"))


def test_saved_state_is_the_conv_output_and_the_channel_statistics(kernels, kernel_device) -> None:
    dev = device_of(kernels, kernel_device)
    x, w, b, *ops = [t.to(dev) for t in make(CONV2D, 3, 6, (5, 6), 1)]
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1)
    out, saved_y, winner, stats = conv_batch_norm_fwd(x, w, b, ops, cfg.to_json(), True)
    assert winner.numel() == 0  # no pool
    y0 = F.conv2d(x, w, None, (1, 2), (1, 0))
    # without the bias; the op's conv runs channels-last (``ops/library_conv.py``), another cuDNN
    # kernel than this NCHW one: equal up to the summation order
    assert saved_y.shape == y0.shape
    torch.testing.assert_close(saved_y, y0, rtol=1e-5, atol=1e-5)
    v = (y0 + b.view(1, -1, 1, 1)).transpose(0, 1).reshape(6, -1)
    assert stats.shape == (STATS_ROWS, 6) and stats.dtype == torch.float32
    torch.testing.assert_close(stats[0], v.mean(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[1], (v.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats[2], v.var(-1, unbiased=True), rtol=1e-4, atol=1e-5)
    gamma, beta = ops[0].float(), ops[1].float()  # the affine rows the kernels read, and the norm folded
    torch.testing.assert_close(stats[AFFINE_ROWS], torch.stack([gamma, beta]), rtol=0, atol=0)
    torch.testing.assert_close(stats[3], gamma * stats[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats[4], beta - stats[0] * stats[3], rtol=1e-6, atol=1e-6)
    _, saved_y, _, stats = conv_batch_norm_fwd(x, w, b, ops, cfg.to_json(), False)
    assert saved_y.numel() == 0 and stats.shape == (STATS_ROWS, 6)  # the statistics feed the running update


# ------------------------------------------------------------------------------------------------
# Parity against float64
# ------------------------------------------------------------------------------------------------

#: name -> (conv, C_in, C_out, spatial size, weight / bias operand indices, post, batch)
CASES = {
    "conv2d affine, chain with operands": (CONV2D, 3, 6, (6, 7), 0, 1, POST, 2),
    "conv_transpose1d no affine, gelu": (CONVT1D, 3, 5, (5,), None, None, (ChainStep(K.GELU),), 3),
    "conv3d groups, weight only, odd sizes": (CONV3D, 4, 6, (3, 4, 5), 0, None, (ChainStep(K.RELU),), 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_output_and_every_gradient_match_float64(name, kernels, kernel_device) -> None:
    spec, c_in, c_out, size, wi, bi, post, batch = CASES[name]
    cfg = ConvBatchNormConfig(spec, 1e-5, 0.1, wi, bi, False, post)
    check(cfg, make(spec, c_in, c_out, size, len(name), batch=batch), device_of(kernels, kernel_device))


def test_channels_last_and_sliced_inputs(kernels, kernel_device) -> None:
    dev = device_of(kernels, kernel_device)
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1, False, POST)
    tensors = make(CONV2D, 3, 4, (6, 9), 11)
    out = check(cfg, tensors, dev, layout=lambda t: t.to(memory_format=torch.channels_last))
    assert out.is_contiguous(memory_format=torch.channels_last)  # the conv's layout, kept
    wide = [t.clone() for t in tensors]
    wide[0] = torch.cat([tensors[0], tensors[0]], dim=-1)
    check(cfg, wide, dev, layout=lambda t: t[..., ::2])  # a strided slice of x


def test_fp16_output_and_gradients(kernels, kernel_device) -> None:
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1, False, POST)
    check(cfg, make(CONV2D, 3, 4, (5, 6), 5, dtype=torch.float16), device_of(kernels, kernel_device))


@pytest.mark.parametrize("momentum,affine,tracked,pool", [
    (0.1, True, True, None), (0.5, False, True, None), (0.1, True, False, None), (0.1, True, True, MAX_3_2_1)],
    ids=["momentum 0.1 affine", "momentum 0.5 no affine", "no running statistics", "max pool after the chain"])  # fmt: skip
def test_running_statistics_follow_eager_over_steps(momentum, affine, tracked, pool, kernels, kernel_device) -> None:
    """Three steps on fresh batches: the running mean and the (unbiased) running variance match eager's
    ``F.batch_norm(training=True)`` after each (a pool after the chain changes nothing there); without
    running statistics nothing is updated."""
    dev = device_of(kernels, kernel_device)
    cfg = ConvBatchNormConfig(CONV2D, 1e-3, momentum, 0 if affine else None, 1 if affine else None, tracked,
                              (ChainStep(K.RELU),), strict=True, pool=pool)  # fmt: skip
    mine = [torch.zeros(4, device=dev), torch.ones(4, device=dev)]
    theirs = [t.clone() for t in mine]
    for step in range(3):
        x, w, b, gamma, beta, *_ = [t.to(dev) for t in make(CONV2D, 3, 4, (5, 6), 20 + step)]
        ops = [gamma, beta] if affine else []
        out = conv_batch_norm(x, w, b, ops + (mine if tracked else []), cfg.to_json())
        want = eager(x, w, b, ops, cfg, theirs if tracked else (None, None))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine[0], theirs[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine[1], theirs[1], rtol=1e-6, atol=1e-6)
    if tracked:
        assert not torch.equal(mine[0], torch.zeros(4, device=dev))
    else:
        assert torch.equal(mine[0], torch.zeros(4, device=dev)) and torch.equal(mine[1], torch.ones(4, device=dev))


# ------------------------------------------------------------------------------------------------
# A pool after the chain
# ------------------------------------------------------------------------------------------------

LEAKY = ChainStep(K.LEAKY_RELU, (Const(0.1),))
#: name -> (conv, C_in, C_out, spatial size, post, pool, batch, how x is made (or None))
POOLED_CASES = {
    # x is zero over its top rows: there the conv output is the bias exactly, so whole windows tie and
    # the gradient (leaky_relu passes it) must go to the first maximum in window order, as eager's
    "conv2d, leaky, max 3/2/1 (overlapping windows), tied windows": (
        CONV2D, 3, 4, (9, 13), (LEAKY, ChainStep(K.ADD, (TensorRef(2),))), MAX_3_2_1, 2, "zero top"),
    # beta -50 on channel 0: the ReLU zeroes the whole channel, every window ties at 0
    "conv2d, relu zeroing a channel, max 2 ceil_mode, odd sizes": (
        CONV2D, 3, 4, (7, 11), (ChainStep(K.RELU),), PoolSpec("max", (2, 2), ceil_mode=True), 2, "dead channel"),
    "conv_transpose1d, gelu, avg 3/2/1 ceil_mode without the padding": (
        CONVT1D, 3, 5, (6,), (ChainStep(K.GELU),), PoolSpec("avg", (3,), (2,), (1,), True, False), 3, None),
    "conv2d, avg 2 with a divisor override": (
        CONV2D, 3, 4, (6, 9), POST, PoolSpec("avg", (2, 2), padding=(1, 0), divisor_override=3), 2, None),
    "conv3d groups, relu, max 2 ceil_mode, odd sizes": (
        CONV3D, 4, 6, (3, 4, 5), (ChainStep(K.RELU),), PoolSpec("max", (2, 2, 2), ceil_mode=True), 1, None),
}


def pooled_tensors(name: str, dtype=torch.float32):
    spec, c_in, c_out, size, _, _, batch, how = POOLED_CASES[name]
    tensors = make(spec, c_in, c_out, size, len(name), batch=batch)
    if how == "zero top":
        tensors[0][..., : size[0] // 2 + 1, :] = 0.0
    if how == "dead channel":
        tensors[4][0] = -50.0
    return [t.to(dtype) for t in tensors]


@pytest.mark.parametrize("name", list(POOLED_CASES))
def test_pooled_output_and_every_gradient_match_float64(name, kernels, kernel_device) -> None:
    spec, _, _, _, post, pool, _, _ = POOLED_CASES[name]
    cfg = ConvBatchNormConfig(spec, 1e-5, 0.1, 0, 1, False, post, pool=pool)
    check(cfg, pooled_tensors(name), device_of(kernels, kernel_device))


def test_pooled_channels_last_and_sliced_inputs(kernels, kernel_device) -> None:
    dev = device_of(kernels, kernel_device)
    name = "conv2d, leaky, max 3/2/1 (overlapping windows), tied windows"
    spec, _, _, _, post, pool, _, _ = POOLED_CASES[name]
    cfg = ConvBatchNormConfig(spec, 1e-5, 0.1, 0, 1, False, post, pool=pool)
    tensors = pooled_tensors(name)
    out = check(cfg, tensors, dev, layout=lambda t: t.to(memory_format=torch.channels_last))
    assert out.is_contiguous(memory_format=torch.channels_last)  # the conv's layout, kept
    wide = [t.clone() for t in tensors]
    wide[0] = torch.cat([tensors[0], tensors[0]], dim=-1)
    check(cfg, wide, dev, layout=lambda t: t[..., ::2])  # a strided slice of x


def test_pooled_nan_spreads_over_its_channel_as_eager(kernels, kernel_device) -> None:
    """A NaN conv bias poisons its channel's statistics: every window of that channel is NaN, in the
    output and in the gradients, as in eager."""
    dev = device_of(kernels, kernel_device)
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1, False, (ChainStep(K.SILU),), strict=True, pool=MAX_3_2_1)
    x, w, b, *ops = make(CONV2D, 3, 4, (5, 6), 9)
    b = b.clone()
    b[0] = float("nan")
    leaves = [t.to(dev).requires_grad_() for t in (x, w, b)]
    out = conv_batch_norm(*leaves, [o.to(dev) for o in ops], cfg.to_json())
    theirs = [t.clone().requires_grad_() for t in (x, w, b)]
    want = eager(*theirs, ops, cfg)
    assert torch.equal(out.detach().cpu().isnan(), want.isnan()) and out.detach().cpu().isnan()[:, 0].all()
    got = torch.autograd.grad(out, leaves, torch.ones_like(out))
    expected = torch.autograd.grad(want, theirs, torch.ones_like(want))
    for name, a, e in zip(("x", "weight", "bias"), got, expected, strict=True):
        assert torch.equal(a.cpu().isnan(), e.isnan()) and e.isnan().any(), name


def test_fp16_running_statistics_are_updated_in_their_own_dtype(kernels, kernel_device) -> None:
    dev = device_of(kernels, kernel_device)
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1, True, strict=True)
    x, w, b, gamma, beta, *_ = [t.to(dev) for t in make(CONV2D, 3, 4, (5, 6), 3, dtype=torch.float16)]
    mine = [torch.zeros(4, device=dev, dtype=torch.float16), torch.ones(4, device=dev, dtype=torch.float16)]
    theirs = [t.clone() for t in mine]
    conv_batch_norm(x, w, b, [gamma, beta, *mine], cfg.to_json())
    eager(x, w, b, [gamma, beta], cfg, theirs)
    assert mine[0].dtype == torch.float16
    torch.testing.assert_close(mine[0], theirs[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(mine[1], theirs[1], rtol=2e-3, atol=2e-3)


def test_eps_is_honoured_on_nearly_constant_channels(kernels, kernel_device) -> None:
    """Channels whose variance is far below eps: the result is ``(v - mean) / sqrt(eps)``, so a wrong
    eps (or none) shows at once.  Measured against float64 with eager's own error as the yardstick:
    ``v - mean`` cancels the bias (about 3) down to about 1e-3, so a few fp32 ulps of the conv output
    that depend on its summation order are a visible share of the result."""
    dev = device_of(kernels, kernel_device)
    x, w, b, *_ = make(CONV2D, 3, 4, (5, 6), 2, dtype=torch.float64)
    x = x * 1e-3
    cfg = ConvBatchNormConfig(CONV2D, 0.5, strict=True)

    def composite(x, w, b):
        return F.batch_norm(F.conv2d(x, w, b, (1, 2), (1, 0)), None, None, training=True, eps=0.5)

    x32, w32, b32 = (t.float() for t in (x, w, b))
    out = conv_batch_norm(x32.to(dev), w32.to(dev), b32.to(dev), [], cfg.to_json())
    truth = composite(x, w, b)
    assert compare("output", out.cpu(), composite(x32, w32, b32), reference=truth) is None
    assert truth.abs().max() < 0.1  # eps dominates (eps 1e-5 would give values around 1)


def test_nan_and_inf_spread_over_their_channel_as_eager(kernels, kernel_device) -> None:
    dev = device_of(kernels, kernel_device)
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1, False, (ChainStep(K.SILU),), strict=True)
    x, w, b, *ops = make(CONV2D, 3, 4, (5, 6), 9)
    b = b.clone()
    b[0] = float("nan")  # channel 0 is NaN
    x = x.clone()
    x[1, :, 2, 3] = float("inf")  # an infinity reaches every channel
    out = conv_batch_norm(x.to(dev), w.to(dev), b.to(dev), [o.to(dev) for o in ops], cfg.to_json())
    want = eager(x, w, b, ops, cfg)
    assert torch.equal(out.cpu().isnan(), want.isnan())
    assert out.cpu().isnan()[:, 0].all()


def test_the_conv_bias_gradient_is_exactly_zero_and_nan_where_eagers_is(kernel_device, monkeypatch) -> None:
    """The norm subtracts each channel's mean, so the conv bias has no effect on the output: the Triton
    path returns its gradient as the exact zero (eager's is rounding residue), and NaN in the channels
    where eager's is NaN (a NaN in the output's gradient)."""
    if kernel_device == "cpu":
        monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1, False, POST, strict=True)
    x, w, b, *ops = [t.to(kernel_device) for t in make(CONV2D, 3, 5, (6, 7), 11)]
    grads = {}
    for name, run in (("fused", lambda *t: conv_batch_norm(*t[:3], t[3:], cfg.to_json())),
                      ("eager", lambda *t: eager(*t[:3], t[3:], cfg))):  # fmt: skip
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b, *ops)]
        out = run(*leaves)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(kernel_device)
        finite = torch.autograd.grad(out, leaves[2], g, retain_graph=True)[0]
        g[1, 2, 0, 1] = float("nan")  # channel 2's gradient
        grads[name] = (finite, torch.autograd.grad(out, leaves[2], g)[0])
    assert torch.equal(grads["fused"][0], torch.zeros_like(b)), grads["fused"][0]
    assert grads["eager"][0].abs().max() > 0  # eager's residue: what the exact zero replaces
    assert torch.equal(grads["fused"][1].isnan(), grads["eager"][1].isnan()) and grads["fused"][1].isnan()[2]
    assert not grads["fused"][1][~grads["fused"][1].isnan()].any()


def test_statistics_and_gradients_are_bitwise_reproducible(kernels, kernel_device) -> None:
    dev = device_of(kernels, kernel_device)
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1, True, POST, strict=True).to_json()
    tensors = [t.to(dev) for t in make(CONV2D, 3, 4, (7, 9), 4, batch=3)]

    def run():
        leaves = [t.clone().requires_grad_() for t in tensors]
        running = [torch.zeros(4, device=dev), torch.ones(4, device=dev)]
        out = conv_batch_norm(leaves[0], leaves[1], leaves[2], leaves[3:] + running, cfg)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out) * 0.3 + out.detach())
        return [out, *running, *grads]

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


# ------------------------------------------------------------------------------------------------
# The conv family's forward as the norm's conv (its statistics written as it stores)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def family_conv(monkeypatch, kernel_device) -> str:
    """The Triton path with the conv family's forward forced as the norm's conv (``statistics.py``)."""
    from fusion_backend import environment

    monkeypatch.setenv(environment.CONV_IMPL, "family")
    if kernel_device == "cpu":
        monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    return kernel_device


#: name -> (conv, C_in, C_out, spatial size, post, pool, dtype, batch): 2-d and 3-d, grouped, strided,
#: pooled, fp16; the bias far from zero (``make``) so that the mean's path matters
FAMILY_CASES = {
    "conv2d stride, chain": (CONV2D, 3, 6, (6, 7), POST, None, torch.float32, 2),
    "conv3d groups, relu": (CONV3D, 4, 6, (3, 4, 5), (ChainStep(K.RELU),), None, torch.float32, 1),
    "conv2d max pool": (CONV2D, 3, 5, (7, 8), (ChainStep(K.RELU),), MAX_3_2_1, torch.float32, 3),
    "conv2d fp16": (CONV2D, 3, 4, (5, 6), POST, None, torch.float16, 2),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_the_conv_familys_forward_as_the_norms_conv_matches_float64(name, family_conv, monkeypatch) -> None:
    from fusion_backend.kernels import conv as family
    from fusion_backend.ops.conv_batch_norm import statistics

    launches = []
    real = family.conv_fprop
    monkeypatch.setattr(family, "conv_fprop", lambda *a, **k: launches.append(k["stats"]) or real(*a, **k))
    monkeypatch.setattr(statistics, "_library", lambda *a: pytest.fail("the library conv ran"))
    spec, c_in, c_out, size, post, pool, dtype, batch = FAMILY_CASES[name]
    cfg = ConvBatchNormConfig(spec, 1e-5, 0.1, 0, 1, False, post, pool=pool)
    tensors = make(spec, c_in, c_out, size, len(name), dtype=dtype, batch=batch)
    check(cfg, tensors, family_conv, layout=lambda t: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4
          else t.contiguous(memory_format=torch.channels_last_3d))  # fmt: skip
    assert launches == [True]


def test_the_conv_familys_statistics_and_saved_output_are_the_library_paths(family_conv, monkeypatch) -> None:
    from fusion_backend import environment

    x, w, b, *ops = [t.to(family_conv) for t in make(CONV2D, 3, 6, (5, 6), 1)]
    x = x.contiguous(memory_format=torch.channels_last)
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1).to_json()
    out, saved_y, _, stats = conv_batch_norm_fwd(x, w, b, ops, cfg, True)
    monkeypatch.setenv(environment.CONV_IMPL, "library")
    out_lib, saved_lib, _, stats_lib = conv_batch_norm_fwd(x, w, b, ops, cfg, True)
    assert saved_y.stride() == saved_lib.stride() and out.stride() == out_lib.stride()
    torch.testing.assert_close(saved_y, saved_lib, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats, stats_lib, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, out_lib, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family_ms,perturb,want", [(1.0, 0.0, "family"), (3.0, 0.0, "library"),
                                                     (1.0, 1e-2, "library")],
                         ids=["family faster", "library faster", "family disagrees"])  # fmt: skip
def test_the_timed_choice_takes_the_faster_path_whose_results_agree(family_ms, perturb, want, kernel_device,
                                                                   monkeypatch, tmp_path) -> None:  # fmt: skip
    """``statistics.timed_candidates`` (what ``auto`` runs once the family's candidate is measured on a
    GPU): the faster path by a fake timer, never a family whose statistics disagree with the library's."""
    from fusion_backend import impl_choice
    from fusion_backend.ops.conv_batch_norm import statistics

    if kernel_device == "cpu":
        monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setenv(impl_choice.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(impl_choice.MEASURE_ENV, "1")
    impl_choice.forget_in_memory()
    ran: list[str] = []
    real = {"library": statistics._library, "family": statistics._family}

    def path(name):
        def run(*args):
            ran.append(name)
            y0, stats = real[name](*args)
            return y0, stats * (1 + perturb) if name == "family" else stats
        return run

    def choose(key, candidates, default, **kwargs):
        names = {id(fn): name for name, fn in candidates.items()}

        def timer(fn):
            fn()
            return {"library": 2.0, "family": family_ms}[names[id(fn)]]

        return real_choose(key, candidates, default, timer=timer, **kwargs)

    real_choose = impl_choice.choose
    monkeypatch.setattr(statistics, "_library", path("library"))
    monkeypatch.setattr(statistics, "_family", path("family"))
    monkeypatch.setattr(impl_choice, "choose", choose)
    x, w, b, *_ = [t.to(kernel_device) for t in make(CONV2D, 3, 6, (5, 6), 2)]
    try:
        statistics.timed_candidates(x.contiguous(memory_format=torch.channels_last), w, b,
                                    ConvBatchNormConfig(CONV2D, 1e-5, 0.1), (None, None))  # fmt: skip
    finally:
        impl_choice.forget_in_memory()
    assert "family" in ran[:-1] and ran[-1] == want  # both timed, then the chosen one ran


def test_a_conv_the_family_cannot_run_is_named_when_forced(family_conv) -> None:
    spec, c_in, c_out, size, wi, bi, post, batch = CASES["conv_transpose1d no affine, gelu"]
    x, w, b, *ops = [t.to(family_conv) for t in make(spec, c_in, c_out, size, 1, batch=batch)]
    with pytest.raises(UnsupportedInputError, match="FUSION_CONV_IMPL=family but .* a transposed conv"):
        conv_batch_norm(x, w, b, ops, ConvBatchNormConfig(spec, strict=True).to_json())


def test_bad_inputs_get_one_line_errors() -> None:
    x, w, b, *ops = make(CONV2D, 3, 6, (5, 6), 1)
    with pytest.raises(UnsupportedInputError, match="needs x and weight with 4 dims"):
        conv_batch_norm(x[0], w, b, ops, ConvBatchNormConfig(CONV2D).to_json())
    with pytest.raises(UnsupportedInputError, match="norm's weight must hold 6 floating values"):
        conv_batch_norm(x, w, b, [ops[0][:3], *ops[1:]], ConvBatchNormConfig(CONV2D, weight=0, bias=1).to_json())
    with pytest.raises(UnsupportedInputError, match="operands\\[7\\]"):
        conv_batch_norm(x, w, b, ops, ConvBatchNormConfig(CONV2D, post=(ChainStep(K.MUL, (TensorRef(7),)),)).to_json())
    with pytest.raises(UnsupportedInputError, match="running_mean must hold 6"):
        conv_batch_norm(x, w, b, [torch.zeros(5), torch.ones(6)], ConvBatchNormConfig(CONV2D, running_stats=True).to_json())
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        conv_batch_norm(x[:1, :, :1, :3], w, b, [], ConvBatchNormConfig(CONV2D).to_json())


# ------------------------------------------------------------------------------------------------
# Failure policy
# ------------------------------------------------------------------------------------------------


def test_a_kernel_failure_falls_back_to_the_reference_or_raises_under_strict(kernel_device, failing_kernels) -> None:
    from fusion_backend.kernels import batch_norm as kernels_module

    failing_kernels(kernels_module, "batch_norm_stats", "batch_norm_backward")
    x, w, b, *ops = [t.to(kernel_device) for t in make(CONV2D, 3, 4, (5, 6), 4)]
    cfg = ConvBatchNormConfig(CONV2D, 1e-5, 0.1, 0, 1, True, (ChainStep(K.SILU),))
    running = [torch.zeros(4, device=kernel_device), torch.ones(4, device=kernel_device)]
    theirs = [t.clone() for t in running]
    x.requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = conv_batch_norm(x, w, b, [*ops[:2], *running], cfg.to_json())
        out.sum().backward()
    assert any("Falling back to the plain-torch reference" in str(c.message) for c in caught)
    torch.testing.assert_close(out, eager(x, w, b, ops, cfg, theirs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(running, theirs)  # updated once, by the reference
    with pytest.raises(KernelError, match="simulated launch failure"):
        conv_batch_norm(x, w, b, ops[:2], dataclasses.replace(cfg, strict=True, running_stats=False).to_json())


# ------------------------------------------------------------------------------------------------
# GPU: the Triton path at the bench workload's size
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("conv", ["auto", "family"])
def test_gpu_bench_workload_size(dtype, channels_last, conv, monkeypatch) -> None:
    """Conv2d 64->64 k3 p1 -> BatchNorm2d(64) -> ReLU on 32x64x128x128 (524,288 values per channel);
    ``family``: the norm's conv and statistics from the conv kernel family (``statistics.py``)."""
    from fusion_backend import environment

    monkeypatch.setenv(environment.CONV_IMPL, conv)
    spec = ConvSpec(False, (1, 1), (1, 1), (1, 1), (0, 0), 1)
    cfg = ConvBatchNormConfig(spec, 1e-5, 0.1, 0, 1, False, (ChainStep(K.RELU),))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, 128, 128, generator=gen, dtype=torch.float64)
    w = torch.randn(64, 64, 3, 3, generator=gen, dtype=torch.float64) * 0.05
    b = torch.randn(64, generator=gen, dtype=torch.float64)
    gamma, beta = torch.rand(64, generator=gen, dtype=torch.float64) + 0.5, torch.randn(64, generator=gen, dtype=torch.float64)
    layout = (lambda t: t.to(memory_format=torch.channels_last)) if channels_last else None
    check(cfg, [t.to(dtype) for t in (x, w, b, gamma, beta)], "cuda", tol=2e-2 if dtype == torch.bfloat16 else None,
          layout=layout, relu_mask_of_each_side=True)  # fmt: skip


def _flat_winners(winner: torch.Tensor, pool: PoolSpec, width: int) -> torch.Tensor:
    """The saved winners of a 2d max pool (each window's row-major tap) as flat indices into their
    (sample, channel) plane of ``width`` columns, as ``return_indices`` gives them."""
    oh = torch.arange(winner.shape[2], device=winner.device).view(-1, 1)
    ow = torch.arange(winner.shape[3], device=winner.device).view(1, -1)
    tap = winner.long()
    row = oh * pool.stride[0] - pool.padding[0] + tap // pool.kernel_size[1]
    col = ow * pool.stride[1] - pool.padding[1] + tap % pool.kernel_size[1]
    return row * width + col


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_resnet_stem_in_training(dtype) -> None:
    """Conv2d 3->64 k7 s2 p3 (no bias) -> BatchNorm2d(64) -> ReLU -> MaxPool2d(3, 2, 1) on 32x3x224x224.

    Gradients are measured, for each side (the op and eager in ``dtype``), against a float64 truth
    that keeps that side's own decisions: its max-pool winners and its ReLU mask.  Over 6.4M
    overlapping windows some hold two values within rounding of each other, or a value within rounding
    of zero, where the two precisions may decide differently; one such decision moves a gradient by a
    whole ``grad_out`` value, so without this the verdict would depend on how many each side happens
    to draw.  A backward that does not follow its own forward's winners still fails."""
    spec = ConvSpec(False, (2, 2), (3, 3), (1, 1), (0, 0), 1)
    cfg = ConvBatchNormConfig(spec, 1e-5, 0.1, 0, 1, False, (ChainStep(K.RELU),), strict=True, pool=MAX_3_2_1)
    config = cfg.to_json()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 224, 224, generator=gen, dtype=torch.float64)
    w = torch.randn(64, 3, 7, 7, generator=gen, dtype=torch.float64) * 0.1
    gamma, beta = torch.rand(64, generator=gen, dtype=torch.float64) + 0.5, torch.randn(64, generator=gen, dtype=torch.float64)
    tol = 2e-2 if dtype == torch.bfloat16 else None

    def leaves(t_dtype):
        return [t.to(device="cuda", dtype=t_dtype).requires_grad_() for t in (x, w, gamma, beta)]

    def pre_pool(xx, ww, gg, bb):  # conv -> batch norm, full size
        return F.batch_norm(F.conv2d(xx, ww, None, 2, 3), None, None, gg, bb, True, 0.1, 1e-5)

    mine, theirs, exact = leaves(dtype), leaves(dtype), leaves(torch.float64)
    # the op's forward and backward called directly: the winners its gradients follow are at hand
    mine = [t.detach() for t in mine]
    out, saved_y, winner, stats = conv_batch_norm_fwd(mine[0], mine[1], None, mine[2:], config, True)
    want, want_idx = F.max_pool2d(F.relu(pre_pool(*theirs)), 3, 2, 1, return_indices=True)
    truth_pre = pre_pool(*exact)
    truth = F.max_pool2d(F.relu(truth_pre), 3, 2, 1)
    problems = [compare("output", out.float().cpu(), want.float().cpu(), tol, reference=truth.cpu())]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).cuda()
    grads = conv_batch_norm_bwd(g.to(dtype), mine[0], mine[1], None, mine[2:], saved_y, winner, stats, config,
                                [True, True, False, True, True])  # fmt: skip
    got = [grads[0], grads[1], *grads[3:]]
    ref = torch.autograd.grad(want, theirs, g.to(dtype))
    flat_pre = truth_pre.flatten(2)

    def truth_grads(side_out, idx):  # the float64 truth with this side's winners and ReLU mask
        pooled = flat_pre.gather(2, idx.flatten(2)).view(side_out.shape) * (side_out.detach() > 0)
        return torch.autograd.grad(pooled, exact, g, retain_graph=True)

    mine_truth = truth_grads(out, _flat_winners(winner, MAX_3_2_1, 112))
    their_truth = truth_grads(want, want_idx)
    for name, a, e, t, t_eager in zip(("x", "weight", "gamma", "beta"), got, ref, mine_truth, their_truth, strict=True):
        bound = max(tol or TOLERANCES[e.dtype], 2 * relative_error(e.cpu(), t_eager.cpu()))
        problems.append(compare(f"grad of {name}", a.cpu(), t.to(a.dtype).cpu(), bound))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_the_bench_workload_splits_each_channel_over_enough_programs_to_fill_an_h100(channels_last) -> None:
    """64 channels of 524,288 values: the grid holds several programs per SM of a 132-SM GPU."""
    from fusion_backend.kernels.batch_norm import Plan

    y = torch.empty(32, 64, 128, 128, device="meta")
    plan = Plan(y.to(memory_format=torch.channels_last) if channels_last else y)
    programs = plan.grid[0] * plan.grid[1]
    assert programs >= 4 * 132 and plan.chunk % plan.block_r == 0
    assert (plan.chunks - 1) * plan.chunk < plan.values <= plan.chunks * plan.chunk
