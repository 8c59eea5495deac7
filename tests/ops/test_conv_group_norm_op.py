"""The ``conv_group_norm`` fused op: config, custom-op contract, output and every gradient against
float64 (x, conv weight and bias, the norm's weight and bias, chain operands), group counts from one to
one per channel, affine or not, layouts, NaN / inf, eps, bad input, the failure policy; GPU parity at
realistic sizes.

The oracle is the literal eager composite (conv, the chains with ``apply_step``, ``F.group_norm``)
run in float64; the op in fp32 / fp16 may be off from it by ``max(tol, 2 x eager's own error)``
(``fusion_backend.testing.compare``), the yardstick the other op tests use.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.errors import KernelError, UnsupportedInputError
from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.ops.chain import ChainStep, ChainValue, Const, PointwiseKind, TensorRef
from fusion_backend.ops.chain_reference import apply_chain
from fusion_backend.ops.conv_group_norm import (
    ConvGroupNormConfig,
    conv_group_norm,
    conv_group_norm_bwd,
    conv_group_norm_fwd,
    kernel_path,
)
from fusion_backend.ops.conv_io import run_pool
from fusion_backend.testing import TOLERANCES, compare, relative_error, stable_seed

K = PointwiseKind
CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.usefixtures("exact_fp32"),
]

CONV2D = ConvSpec(False, (1, 2), (1, 0), (1, 1), (0, 0), 1)
CONVT2D = ConvSpec(True, (2, 2), (1, 1), (1, 1), (0, 0), 1)
CONVT1D = ConvSpec(True, (2,), (1,), (1,), (1,), 1)
CONV3D = ConvSpec(False, (1, 1, 1), (1, 1, 1), (1, 1, 1), (0, 0, 0), 2)


def weight_shape(spec: ConvSpec, c_in: int, c_out: int, k: int) -> tuple[int, ...]:
    kernel = (k,) * spec.spatial_dims
    return (c_in, c_out // spec.groups, *kernel) if spec.transposed else (c_out, c_in // spec.groups, *kernel)


def eager(x, w, b, operands, cfg: ConvGroupNormConfig):
    """The composite the op stands for, with torch's own ops (autograd differentiates it)."""
    y = torch.ops.aten.convolution(x, w, b, list(cfg.conv.stride), list(cfg.conv.padding), list(cfg.conv.dilation),
                                   cfg.conv.transposed, list(cfg.conv.output_padding), cfg.conv.groups)  # fmt: skip
    v = apply_chain(y, cfg.pre, operands)
    gamma = None if cfg.weight is None else operands[cfg.weight]
    beta = None if cfg.bias is None else operands[cfg.bias]
    out = apply_chain(F.group_norm(v, cfg.groups, gamma, beta, cfg.eps), cfg.post, operands)
    return out if cfg.pool is None else run_pool(out, cfg.pool)


def make(spec: ConvSpec, c_in: int, c_out: int, size: tuple[int, ...], seed: int, operands=(), dtype=torch.float32,
         batch: int = 2):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, c_in, *size), generator=gen, dtype=torch.float64)
    w = torch.randn(weight_shape(spec, c_in, c_out, 3), generator=gen, dtype=torch.float64) * 0.5
    b = torch.randn((c_out,), generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (x, w, b, *operands)]


def operands(c_out: int, seed: int, spatial_dims: int = 2) -> list[torch.Tensor]:
    """gamma, beta (C,), a per-channel p (1, C, 1, ...) with negative entries, a scalar s."""
    gen = torch.Generator().manual_seed(seed + 100)
    gamma = torch.randn(c_out, generator=gen, dtype=torch.float64)
    beta = torch.randn(c_out, generator=gen, dtype=torch.float64)
    p = torch.randn(1, c_out, *([1] * spatial_dims), generator=gen, dtype=torch.float64)
    s = torch.tensor(-0.7, dtype=torch.float64)
    return [gamma, beta, p, s]


#: y * p, leaky_relu, a DAG step reading the product again.
PRE = (ChainStep(K.MUL, (TensorRef(2),)), ChainStep(K.LEAKY_RELU, (Const(0.2),)), ChainStep(K.ADD, (ChainValue(1),)))
#: silu, x * s, + p (per channel).
POST = (ChainStep(K.SILU), ChainStep(K.MUL, (TensorRef(3),)), ChainStep(K.ADD, (TensorRef(2),)))


def check(cfg: ConvGroupNormConfig, tensors, device: str, grad_mask=None, tol=None, layout=None):
    """Run the op on ``tensors`` (x, w, b, *operands) on ``device`` and compare output and every
    gradient with eager in the same dtype, measured against eager in float64.  ``layout(t)`` makes x
    (e.g. channels-last, or a slice).  Strict: a Triton path that fails raises."""
    config = dataclasses.replace(cfg, strict=True).to_json()
    grad_mask = grad_mask or [True] * len(tensors)
    layout = layout or (lambda t: t)

    def leaves(dtype, dev):
        made = [t.detach().to(device=dev, dtype=dtype) for t in tensors]
        made[0] = layout(made[0])
        return [t.requires_grad_(m) if t.is_leaf else t for t, m in zip(made, grad_mask, strict=True)]

    dtype = tensors[0].dtype
    mine = leaves(dtype, device)
    out = conv_group_norm(mine[0], mine[1], mine[2], mine[3:], config)
    theirs = leaves(dtype, device)
    want = eager(theirs[0], theirs[1], theirs[2], theirs[3:], cfg)
    exact = leaves(torch.float64, device)
    truth = eager(exact[0], exact[1], exact[2], exact[3:], cfg)
    problems = [compare("output", out.cpu(), want.cpu(), tol, reference=truth.cpu())]
    assert out.shape == want.shape and out.dtype == want.dtype
    # The op keeps the conv output's layout.  Eager's group_norm does too on the CPU; its CUDA kernel
    # returns a contiguous tensor for a channels-last input (same values, another layout).
    if want.device.type == "cpu":
        assert out.stride() == want.stride()
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    names = ["x", "weight", "bias", "gamma", "beta"] + [f"operand {i}" for i in range(2, len(tensors) - 3)]
    wanted = [i for i, m in enumerate(grad_mask) if m]
    got = torch.autograd.grad(out, [mine[i] for i in wanted], g.to(device=device, dtype=out.dtype), allow_unused=True)
    ref = torch.autograd.grad(want, [theirs[i] for i in wanted], g.to(device=device, dtype=want.dtype), allow_unused=True)
    tru = torch.autograd.grad(truth, [exact[i] for i in wanted], g.to(device), allow_unused=True)
    for i, a, e, t in zip(wanted, got, ref, tru, strict=True):
        if e is None:
            assert a is None or not a.any(), names[i]
            continue
        assert a is not None, f"grad of {names[i]} missing"
        assert a.dtype == e.dtype and a.shape == e.shape, names[i]
        problems.append(compare(f"grad of {names[i]}", a.cpu(), e.cpu(), tol, reference=t.cpu()))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)
    return out


# ------------------------------------------------------------------------------------------------
# Config and contract
# ------------------------------------------------------------------------------------------------


def test_config_round_trips_and_rejects_what_it_cannot_mean() -> None:
    cfg = ConvGroupNormConfig(CONV2D, 4, 1e-3, 0, 1, PRE, POST, "float32", "float32", True)
    assert ConvGroupNormConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="positive int"):
        ConvGroupNormConfig(CONV2D, 0)
    with pytest.raises(ValueError, match="eps"):
        ConvGroupNormConfig(CONV2D, 2, eps=-1.0)
    with pytest.raises(ValueError, match="operand index"):
        ConvGroupNormConfig(CONV2D, 2, weight=-1)
    with pytest.raises(ValueError, match="has not computed"):
        ConvGroupNormConfig(CONV2D, 2, post=(ChainStep(K.ADD, (ChainValue(3),)),))
    with pytest.raises(ValueError, match="not a torch dtype"):
        ConvGroupNormConfig(CONV2D, 2, out_dtype="float77")


def test_kernel_path_names_the_reason_for_the_reference() -> None:
    config = ConvGroupNormConfig(CONV2D, 2).to_json()
    assert kernel_path(config, torch.bfloat16, "cuda") == ("triton", None)
    path, why = kernel_path(config, torch.float64, "cuda")
    assert path == "reference" and "float64" in why
    assert kernel_path(config, torch.float32, "meta")[0] == "reference"


@pytest.mark.parametrize("pool", [None, PoolSpec("max", (3, 3), (2, 2), (1, 1))], ids=["no pool", "max pool"])
def test_opcheck_forward_and_backward(pool, kernels, kernel_device) -> None:
    if pool is not None and kernels == "triton":
        pytest.skip("the fake and the schema are the same on every path: the reference run checks them")
    cfg = ConvGroupNormConfig(CONV2D, 2, 1e-5, 0, 1, PRE, POST, pool=pool)
    x, w, b, *ops = make(CONV2D, 3, 4, (5, 6), 0, operands(4, 0))
    dev = kernel_device if kernels != "reference" else "cpu"
    args = [t.to(dev).requires_grad_() for t in (x, w, b)]
    ops = [t.to(dev).requires_grad_() for t in ops]
    torch.library.opcheck(conv_group_norm_fwd, (*args, ops, cfg.to_json(), True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))  # fmt: skip
    out, saved_y, winner, stats = conv_group_norm_fwd(*[a.detach() for a in args], [o.detach() for o in ops],
                                                      cfg.to_json(), True)  # fmt: skip
    assert winner.dtype == torch.int8 and winner.shape == out.shape if pool else winner.numel() == 0
    bwd_args = (torch.randn_like(out), *[a.detach() for a in args], [o.detach() for o in ops], saved_y, winner, stats,
                cfg.to_json(), [True] * 7)  # fmt: skip
    torch.library.opcheck(conv_group_norm_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))


def test_saved_state_is_the_conv_output_and_the_group_statistics(kernels, kernel_device) -> None:
    dev = kernel_device if kernels != "reference" else "cpu"
    x, w, b, *ops = [t.to(dev) for t in make(CONV2D, 3, 6, (5, 6), 1, operands(6, 1))]
    cfg = ConvGroupNormConfig(CONV2D, 3, 1e-5, 0, 1, PRE, ())
    out, saved_y, winner, stats = conv_group_norm_fwd(x, w, b, ops, cfg.to_json(), True)
    assert winner.numel() == 0  # no pool
    y0 = F.conv2d(x, w, None, (1, 2), (1, 0))
    assert saved_y.shape == y0.shape and torch.equal(saved_y, y0)  # without the bias
    v = apply_chain(y0 + b.view(1, -1, 1, 1), PRE, ops).reshape(2, 3, -1)
    assert stats.shape == (2, 2, 3) and stats.dtype == torch.float32
    torch.testing.assert_close(stats[0], v.mean(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[1], (v.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-4, atol=1e-5)
    _, saved_y, winner, stats = conv_group_norm_fwd(x, w, b, ops, cfg.to_json(), False)
    assert saved_y.numel() == winner.numel() == stats.numel() == 0


@pytest.mark.parametrize("pool", [None, PoolSpec("max", (2, 2), (2, 2), (0, 0), False)], ids=["no pool", "max pool"])
def test_a_signature_s_later_calls_run_its_kept_plans_with_their_own_values(kernels, kernel_device, fresh_plans,
                                                                           pool) -> None:  # fmt: skip
    """The Triton path keeps its plans per call signature (``triton_path.ForwardPlan`` without a pool,
    ``BackwardPlan``): a later call of the signature with other values (x, the conv's weight and bias,
    gamma, beta, the chains' tensors, the output gradient) runs them and gives, bitwise, what a first
    call on those values gives; saving or not, and which gradients, are other signatures."""
    from fusion_backend.ops.conv_group_norm import triton_path
    from fusion_backend.testing import forget_call_plans

    dev = kernel_device if kernels != "reference" else "cpu"
    cfg = ConvGroupNormConfig(CONV2D, 2, 1e-5, 0, 1, PRE, POST, pool=pool)
    config = cfg.to_json()
    first = [t.to(dev) for t in make(CONV2D, 3, 6, (5, 6), 21, operands(6, 21))]
    later = [t.to(dev) for t in make(CONV2D, 3, 6, (5, 6), 22, operands(6, 22))]
    triton = kernels != "reference"

    def both_directions(tensors, save, mask, seed):
        outputs = conv_group_norm_fwd(*tensors[:3], tensors[3:], config, save)
        if not save:
            return list(outputs)
        grad = torch.randn(outputs[0].shape, generator=torch.Generator().manual_seed(seed)).to(dev)
        return [*outputs, *conv_group_norm_bwd(grad, *tensors[:3], tensors[3:], *outputs[1:], config, mask)]

    for save, mask in ((True, [True] * 7), (True, [True, False, False, True, False, True, False]), (False, None)):
        first_outputs = both_directions(first, save, mask, 1)
        assert (triton_path.settled(config, save, *first[:3], first[3:]) is not None) == (triton and pool is None)
        if save:
            kept = triton_path.settled_backward(config, torch.empty_like(first_outputs[0]), *first[:3], first[3:],
                                                *first_outputs[1:4], mask)  # fmt: skip
            assert (kept is not None) == triton
        got = both_directions(later, save, mask, 2)
        forget_call_plans()
        want = both_directions(later, save, mask, 2)
        for a, e in zip(got, want, strict=True):
            assert a.shape == e.shape and a.stride() == e.stride() and torch.equal(a, e)


# ------------------------------------------------------------------------------------------------
# Parity against float64
# ------------------------------------------------------------------------------------------------

#: name -> (conv, C_in, C_out, spatial size, groups, weight / bias operand indices, pre, post)
CASES = {
    "conv2d 2 groups, both chains": (CONV2D, 3, 6, (6, 7), 2, 0, 1, PRE, POST),
    "conv_transpose2d one group (layer-norm-like)": (CONVT2D, 3, 5, (3, 4), 1, 0, 1, (), (ChainStep(K.SILU),)),
    "conv_transpose1d instance norm, no affine": (CONVT1D, 3, 5, (5,), 5, None, None, (),
                                                  (ChainStep(K.GELU), ChainStep(K.MUL, (TensorRef(3),)))),
    "conv3d groups, weight only, odd sizes": (CONV3D, 4, 6, (3, 4, 5), 3, 0, None, (ChainStep(K.TANH),),
                                              (ChainStep(K.ADD, (TensorRef(2),)),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_output_and_every_gradient_match_float64(name, kernels, kernel_device) -> None:
    spec, c_in, c_out, size, groups, wi, bi, pre, post = CASES[name]
    dev = kernel_device if kernels != "reference" else "cpu"
    cfg = ConvGroupNormConfig(spec, groups, 1e-5, wi, bi, pre, post)
    tensors = make(spec, c_in, c_out, size, stable_seed(name) % 1000, operands(c_out, 3, spec.spatial_dims))
    check(cfg, tensors, dev)


def test_channels_last_and_sliced_inputs(kernels, kernel_device) -> None:
    dev = kernel_device if kernels != "reference" else "cpu"
    cfg = ConvGroupNormConfig(CONV2D, 2, 1e-5, 0, 1, (), POST)
    tensors = make(CONV2D, 3, 4, (6, 9), 11, operands(4, 11))
    out = check(cfg, tensors, dev, layout=lambda t: t.to(memory_format=torch.channels_last))
    assert out.is_contiguous(memory_format=torch.channels_last)  # the conv's layout, kept
    wide = [t.clone() for t in tensors]
    wide[0] = torch.cat([tensors[0], tensors[0]], dim=-1)
    check(cfg, wide, dev, layout=lambda t: t[..., ::2])  # a strided slice of x


def test_fp16_output_and_gradients(kernels, kernel_device) -> None:
    dev = kernel_device if kernels != "reference" else "cpu"
    cfg = ConvGroupNormConfig(CONV2D, 2, 1e-5, 0, 1, PRE, POST)
    check(cfg, make(CONV2D, 3, 4, (5, 6), 5, operands(4, 5), dtype=torch.float16), dev)


def test_eps_is_honoured_on_a_nearly_constant_group(kernels, kernel_device) -> None:
    """A group whose variance is far below eps: the result is ``(v - mean) / sqrt(eps)``, so a wrong
    eps (or none) shows at once."""
    dev = kernel_device if kernels != "reference" else "cpu"
    x, w, b = make(CONV2D, 3, 4, (5, 6), 2)
    cfg = ConvGroupNormConfig(CONV2D, 2, 0.5, strict=True)
    x, b = x * 1e-3, b * 1e-3
    out = conv_group_norm(x.to(dev), w.to(dev), b.to(dev), [], cfg.to_json())
    want = F.group_norm(F.conv2d(x, w, b, (1, 2), (1, 0)), 2, eps=0.5)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-6)
    assert want.abs().max() < 0.1  # eps dominates (eps 1e-5 would give values around 1)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels-last"])
def test_nan_and_inf_spread_over_their_group_as_eager(kernels, kernel_device, layout) -> None:
    """Contiguous: the group kernels; channels-last: the channels-last kernels (groups of 2 channels)."""
    dev = kernel_device if kernels != "reference" else "cpu"
    cfg = ConvGroupNormConfig(CONV2D, 2, 1e-5, 0, 1, (), (ChainStep(K.SILU),))
    x, w, b, *ops = make(CONV2D, 3, 4, (5, 6), 9, operands(4, 9))
    b = b.clone()
    b[0] = float("nan")  # group 0 of every sample is NaN
    x = x.clone()
    x[1, :, 2, 3] = float("inf")  # sample 1: an infinity reaches every channel
    x, w = x.to(memory_format=layout), w.to(memory_format=layout)
    out = conv_group_norm(x.to(dev), w.to(dev), b.to(dev), [o.to(dev) for o in ops], dataclasses.replace(cfg, strict=True).to_json())
    want = eager(x, w, b, ops, cfg)
    assert torch.equal(out.cpu().isnan(), want.isnan())
    assert out.cpu().isnan()[:, :2].all() and not out.cpu()[0, 2:].isnan().any()


# ------------------------------------------------------------------------------------------------
# A pool after the post-chain
# ------------------------------------------------------------------------------------------------

#: name -> (conv, C_in, C_out, spatial size, groups, pre, post, pool, how x is made (or None))
POOLED_CASES = {
    # x zero over its top rows: the conv output is the bias there, whole windows tie, and leaky_relu
    # passes the gradient, which must go to the first maximum in window order as eager's
    "conv2d 2 groups, both chains, max 3/2/1 (overlapping windows), tied windows": (
        CONV2D, 3, 4, (9, 13), 2, PRE, (ChainStep(K.LEAKY_RELU, (Const(0.1),)), ChainStep(K.MUL, (TensorRef(3),))),
        PoolSpec("max", (3, 3), (2, 2), (1, 1)), "zero top"),
    "conv_transpose1d instance norm, avg 3/2/1 ceil_mode without the padding": (
        CONVT1D, 3, 5, (6,), 5, (), (ChainStep(K.GELU),), PoolSpec("avg", (3,), (2,), (1,), True, False), None),
    "conv3d groups, relu, max 2 ceil_mode, odd sizes": (
        CONV3D, 4, 6, (3, 4, 5), 3, (ChainStep(K.TANH),), (ChainStep(K.RELU),),
        PoolSpec("max", (2, 2, 2), ceil_mode=True), None),
    "conv2d one group, silu, avg 2 with a divisor override": (
        CONV2D, 3, 4, (6, 9), 1, (), POST, PoolSpec("avg", (2, 2), padding=(1, 0), divisor_override=3), None),
}


def pooled_case(name: str):
    spec, c_in, c_out, size, groups, pre, post, pool, how = POOLED_CASES[name]
    tensors = make(spec, c_in, c_out, size, len(name), operands(c_out, len(name), spec.spatial_dims))
    if how == "zero top":
        tensors[0][..., : size[0] // 2 + 1, :] = 0.0
    return ConvGroupNormConfig(spec, groups, 1e-5, 0, 1, pre, post, pool=pool), tensors


@pytest.mark.parametrize("name", list(POOLED_CASES))
def test_pooled_output_and_every_gradient_match_float64(name, kernels, kernel_device) -> None:
    cfg, tensors = pooled_case(name)
    # an instance norm without a pre-chain removes the conv bias: its gradient is zero up to rounding,
    # which no relative comparison judges
    skip_bias = cfg.groups == tensors[2].numel() and not cfg.pre
    check(cfg, tensors, kernel_device if kernels != "reference" else "cpu",
          grad_mask=[i != 2 or not skip_bias for i in range(len(tensors))])  # fmt: skip


def test_pooled_channels_last_input(kernels, kernel_device) -> None:
    cfg, tensors = pooled_case("conv2d 2 groups, both chains, max 3/2/1 (overlapping windows), tied windows")
    out = check(cfg, tensors, kernel_device if kernels != "reference" else "cpu",
                layout=lambda t: t.to(memory_format=torch.channels_last))  # fmt: skip
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_pooled_nan_spreads_over_its_group_as_eager(kernels, kernel_device) -> None:
    dev = kernel_device if kernels != "reference" else "cpu"
    cfg = ConvGroupNormConfig(CONV2D, 2, 1e-5, 0, 1, (), (ChainStep(K.SILU),), strict=True,
                              pool=PoolSpec("max", (3, 3), (2, 2), (1, 1)))  # fmt: skip
    x, w, b, *ops = make(CONV2D, 3, 4, (5, 6), 9, operands(4, 9))
    b = b.clone()
    b[0] = float("nan")  # group 0 of every sample is NaN
    leaves = [t.to(dev).requires_grad_() for t in (x, w, b)]
    out = conv_group_norm(*leaves, [o.to(dev) for o in ops], cfg.to_json())
    theirs = [t.clone().requires_grad_() for t in (x, w, b)]
    want = eager(*theirs, ops, cfg)
    assert torch.equal(out.detach().cpu().isnan(), want.isnan()) and out.detach().cpu().isnan()[:, :2].all()
    got = torch.autograd.grad(out, leaves, torch.ones_like(out))
    expected = torch.autograd.grad(want, theirs, torch.ones_like(want))
    for name, a, e in zip(("x", "weight", "bias"), got, expected, strict=True):
        assert torch.equal(a.cpu().isnan(), e.isnan()) and e.isnan().any(), name


def test_bad_inputs_get_one_line_errors() -> None:
    x, w, b, *ops = make(CONV2D, 3, 6, (5, 6), 1, operands(6, 1))
    with pytest.raises(UnsupportedInputError, match="do not split into 4 groups"):
        conv_group_norm(x, w, b, ops, ConvGroupNormConfig(CONV2D, 4, 1e-5, 0, 1).to_json())
    with pytest.raises(UnsupportedInputError, match="needs x and weight with 4 dims"):
        conv_group_norm(x[0], w, b, ops, ConvGroupNormConfig(CONV2D, 2).to_json())
    with pytest.raises(UnsupportedInputError, match="norm's weight must hold 6 floating values"):
        conv_group_norm(x, w, b, [ops[0][:3], *ops[1:]], ConvGroupNormConfig(CONV2D, 2, 1e-5, 0, 1).to_json())
    with pytest.raises(UnsupportedInputError, match="operands\\[7\\]"):
        conv_group_norm(x, w, b, ops, ConvGroupNormConfig(CONV2D, 2, post=(ChainStep(K.MUL, (TensorRef(7),)),)).to_json())


# ------------------------------------------------------------------------------------------------
# Failure policy
# ------------------------------------------------------------------------------------------------


def test_a_kernel_failure_falls_back_to_the_reference_or_raises_under_strict(kernel_device, failing_kernels,
                                                                             fresh_plans) -> None:  # fmt: skip
    from fusion_backend.kernels import group_norm as kernels_module

    failing_kernels(kernels_module, "group_norm_forward", "group_norm_launch", "group_norm_backward")
    x, w, b, *ops = [t.to(kernel_device) for t in make(CONV2D, 3, 4, (5, 6), 4, operands(4, 4))]
    cfg = ConvGroupNormConfig(CONV2D, 2, 1e-5, 0, 1, (), (ChainStep(K.SILU),))
    x.requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = conv_group_norm(x, w, b, ops, cfg.to_json())
        out.sum().backward()
    assert any("Falling back to the plain-torch reference" in str(c.message) for c in caught)
    torch.testing.assert_close(out, eager(x, w, b, ops, cfg), rtol=1e-5, atol=1e-5)
    with pytest.raises(KernelError, match="simulated launch failure"):
        conv_group_norm(x, w, b, ops, dataclasses.replace(cfg, strict=True).to_json())


# ------------------------------------------------------------------------------------------------
# GPU: the Triton path at realistic sizes
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_decoder_block_sizes(dtype) -> None:
    """ConvTranspose2d 64->32 k4 s2 -> GroupNorm(8) -> SiLU on 4x64x32x32, and a wide instance norm."""
    cfg = ConvGroupNormConfig(CONVT2D, 8, 1e-5, 0, 1, (), (ChainStep(K.SILU),))
    spec = ConvSpec(True, (2, 2), (1, 1), (1, 1), (0, 0), 1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 32, 32, generator=gen, dtype=torch.float64)
    w = torch.randn(64, 32, 4, 4, generator=gen, dtype=torch.float64) * 0.05
    b = torch.randn(32, generator=gen, dtype=torch.float64)
    ops = operands(32, 0)[:2]
    cfg = dataclasses.replace(cfg, conv=spec)
    check(cfg, [t.to(dtype) for t in (x, w, b, *ops)], "cuda", tol=1e-2 if dtype == torch.bfloat16 else None)
    cfg = ConvGroupNormConfig(CONV2D, 96, 1e-5, 0, 1, PRE, POST)
    check(cfg, make(CONV2D, 32, 96, (40, 50), 3, operands(96, 3), dtype=dtype),
          "cuda", tol=1e-2 if dtype == torch.bfloat16 else None)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_gpu_decoder_block_with_a_pool(kind, dtype) -> None:
    """ConvTranspose2d 64->32 k4 s2 p1 -> GroupNorm(8) -> SiLU -> 3x3 pool, stride 2, padding 1, on
    8x64x64x64: 64 groups of 4 x 16384 values, split into chunks on an H100 (the pooled backward's
    two-kernel path).  A max pool's gradients are measured, for each side (the op and eager in
    ``dtype``), against a float64 truth that keeps that side's own winners: over 0.5M overlapping
    windows some hold two values within rounding of each other, where the precisions may pick
    different winners and move a gradient by a whole ``grad_out`` value."""
    spec = ConvSpec(True, (2, 2), (1, 1), (1, 1), (0, 0), 1)
    pool = PoolSpec(kind, (3, 3), (2, 2), (1, 1))
    cfg = ConvGroupNormConfig(spec, 8, 1e-5, 0, 1, (), (ChainStep(K.SILU),), strict=True, pool=pool)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, 64, 64, generator=gen, dtype=torch.float64)
    w = torch.randn(64, 32, 4, 4, generator=gen, dtype=torch.float64) * 0.05
    b = torch.randn(32, generator=gen, dtype=torch.float64)
    ops = operands(32, 0)[:2]
    tol = 1e-2 if dtype == torch.bfloat16 else None
    if kind == "avg":
        check(cfg, [t.to(dtype) for t in (x, w, b, *ops)], "cuda", tol=tol)
        return
    config = cfg.to_json()

    def leaves(t_dtype):
        return [t.to(device="cuda", dtype=t_dtype).requires_grad_() for t in (x, w, b, *ops)]

    def pre_pool(xx, ww, bb, gg, be):  # conv -> group norm -> silu, full size
        return F.silu(F.group_norm(F.conv_transpose2d(xx, ww, bb, 2, 1), 8, gg, be, 1e-5))

    mine, theirs, exact = leaves(dtype), leaves(dtype), leaves(torch.float64)
    # the op's forward and backward called directly: the winners its gradients follow are at hand
    mine = [t.detach() for t in mine]
    out, saved_y, winner, stats = conv_group_norm_fwd(mine[0], mine[1], mine[2], mine[3:], config, True)
    want, want_idx = F.max_pool2d(pre_pool(*theirs), 3, 2, 1, return_indices=True)
    truth_pre = pre_pool(*exact)
    problems = [compare("output", out.float().cpu(), want.float().cpu(), tol,
                        reference=F.max_pool2d(truth_pre, 3, 2, 1).cpu())]  # fmt: skip
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).cuda()
    got = conv_group_norm_bwd(g.to(dtype), mine[0], mine[1], mine[2], mine[3:], saved_y, winner, stats, config, [True] * 5)
    ref = torch.autograd.grad(want, theirs, g.to(dtype))
    oh = torch.arange(out.shape[2], device="cuda").view(-1, 1)
    ow = torch.arange(out.shape[3], device="cuda").view(1, -1)
    tap = winner.long()  # each window's row-major tap -> a flat index into its plane, as return_indices
    mine_idx = (oh * 2 - 1 + tap // 3) * truth_pre.shape[3] + (ow * 2 - 1 + tap % 3)

    def truth_grads(idx):
        pooled = truth_pre.flatten(2).gather(2, idx.flatten(2)).view(out.shape)
        return torch.autograd.grad(pooled, exact, g, retain_graph=True)

    names = ["x", "weight", "bias", "gamma", "beta"]
    for name, a, e, t, t_eager in zip(names, got, ref, truth_grads(mine_idx), truth_grads(want_idx), strict=True):
        bound = max(tol or TOLERANCES[e.dtype], 2 * relative_error(e.cpu(), t_eager.cpu()))
        problems.append(compare(f"grad of {name}", a.cpu(), t.to(a.dtype).cpu(), bound))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)
