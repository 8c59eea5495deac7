"""The ``conv_layer_norm`` fused op: config, custom-op contract, output and every gradient against
float64 (x, conv weight and bias, the norm's weight and bias, chain operands) for the three kinds of
normalized shape (the last dim alone, trailing spatial dims, the channels and every spatial dim),
affine or not, both kernel paths (short rows packed in tiles, long rows walked), layouts, fp16, NaN,
eps, bad input, the failure policy; GPU parity at realistic sizes.

The oracle is the literal eager composite (conv, the chains with ``apply_step``, ``F.layer_norm``)
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
from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops.chain import ChainStep, ChainValue, Const, PointwiseKind, TensorRef
from fusion_backend.ops.chain_reference import apply_chain
from fusion_backend.ops.conv_layer_norm import (
    ConvLayerNormConfig,
    conv_layer_norm,
    conv_layer_norm_bwd,
    conv_layer_norm_fwd,
    kernel_path,
)
from fusion_backend.testing import compare

K = PointwiseKind
CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.usefixtures("exact_fp32"),
]

CONV2D = ConvSpec(False, (1, 2), (1, 0), (1, 1), (0, 0), 1)
CONVT1D = ConvSpec(True, (2,), (1,), (1,), (1,), 1)
CONV3D = ConvSpec(False, (1, 1, 1), (1, 1, 1), (1, 1, 1), (0, 0, 0), 2)


def weight_shape(spec: ConvSpec, c_in: int, c_out: int, k: int) -> tuple[int, ...]:
    kernel = (k,) * spec.spatial_dims
    return (c_in, c_out // spec.groups, *kernel) if spec.transposed else (c_out, c_in // spec.groups, *kernel)


def conv(x, w, b, spec: ConvSpec):
    return torch.ops.aten.convolution(x, w, b, list(spec.stride), list(spec.padding), list(spec.dilation),
                                      spec.transposed, list(spec.output_padding), spec.groups)  # fmt: skip


def eager(x, w, b, operands, cfg: ConvLayerNormConfig):
    """The composite the op stands for, with torch's own ops (autograd differentiates it)."""
    v = apply_chain(conv(x, w, b, cfg.conv), cfg.pre, operands)
    gamma = None if cfg.weight is None else operands[cfg.weight]
    beta = None if cfg.bias is None else operands[cfg.bias]
    return apply_chain(F.layer_norm(v, cfg.normalized_shape, gamma, beta, cfg.eps), cfg.post, operands)


def make(spec: ConvSpec, c_in: int, c_out: int, size: tuple[int, ...], seed: int, operands=(), dtype=torch.float32,
         batch: int = 2):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, c_in, *size), generator=gen, dtype=torch.float64)
    w = torch.randn(weight_shape(spec, c_in, c_out, 3), generator=gen, dtype=torch.float64) * 0.5
    b = torch.randn((c_out,), generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (x, w, b, *operands)]


def operands(shape: tuple[int, ...], c_out: int, seed: int, spatial_dims: int = 2) -> list[torch.Tensor]:
    """gamma, beta of the normalized ``shape``, a per-channel p (1, C, 1, ...) with negative entries,
    a scalar s."""
    gen = torch.Generator().manual_seed(seed + 100)
    gamma = torch.randn(shape, generator=gen, dtype=torch.float64)
    beta = torch.randn(shape, generator=gen, dtype=torch.float64)
    p = torch.randn(1, c_out, *([1] * spatial_dims), generator=gen, dtype=torch.float64)
    s = torch.tensor(-0.7, dtype=torch.float64)
    return [gamma, beta, p, s]


#: y * p, leaky_relu, a DAG step reading the product again.
PRE = (ChainStep(K.MUL, (TensorRef(2),)), ChainStep(K.LEAKY_RELU, (Const(0.2),)), ChainStep(K.ADD, (ChainValue(1),)))
#: silu, x * s, + p (per channel).
POST = (ChainStep(K.SILU), ChainStep(K.MUL, (TensorRef(3),)), ChainStep(K.ADD, (TensorRef(2),)))


def check(cfg: ConvLayerNormConfig, tensors, device: str, grad_mask=None, tol=None, layout=None):
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
    out = conv_layer_norm(mine[0], mine[1], mine[2], mine[3:], config)
    theirs = leaves(dtype, device)
    want = eager(theirs[0], theirs[1], theirs[2], theirs[3:], cfg)
    exact = leaves(torch.float64, device)
    truth = eager(exact[0], exact[1], exact[2], exact[3:], cfg)
    problems = [compare("output", out.cpu(), want.cpu(), tol, reference=truth.cpu())]
    assert out.shape == want.shape and out.dtype == want.dtype
    assert out.is_contiguous()  # eager's layer norm returns a contiguous tensor whatever its input's layout
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


def device_of(kernels: str, kernel_device: str) -> str:
    return kernel_device if kernels != "reference" else "cpu"


# ------------------------------------------------------------------------------------------------
# Config and contract
# ------------------------------------------------------------------------------------------------


def test_config_round_trips_and_rejects_what_it_cannot_mean() -> None:
    cfg = ConvLayerNormConfig(CONV2D, (4, 5, 6), 1e-3, 0, 1, PRE, POST, "float32", "float32", True)
    assert ConvLayerNormConfig.from_json(cfg.to_json()) == cfg
    assert (cfg.normalized_dims, cfg.elements) == (3, 120)
    with pytest.raises(ValueError, match="1 to 3 positive ints"):
        ConvLayerNormConfig(CONV2D, (2, 4, 5, 6))  # the batch dim too
    with pytest.raises(ValueError, match="positive ints"):
        ConvLayerNormConfig(CONV2D, ())
    with pytest.raises(ValueError, match="positive ints"):
        ConvLayerNormConfig(CONV2D, [5])
    with pytest.raises(ValueError, match="eps"):
        ConvLayerNormConfig(CONV2D, (5,), eps=-1.0)
    with pytest.raises(ValueError, match="operand index"):
        ConvLayerNormConfig(CONV2D, (5,), weight=-1)
    with pytest.raises(ValueError, match="has not computed"):
        ConvLayerNormConfig(CONV2D, (5,), post=(ChainStep(K.ADD, (ChainValue(3),)),))
    with pytest.raises(ValueError, match="not a torch dtype"):
        ConvLayerNormConfig(CONV2D, (5,), out_dtype="float77")


def test_kernel_path_names_the_reason_for_the_reference() -> None:
    config = ConvLayerNormConfig(CONV2D, (5,)).to_json()
    assert kernel_path(config, torch.bfloat16, "cuda") == ("triton", None)
    path, why = kernel_path(config, torch.float64, "cuda")
    assert path == "reference" and "float64" in why
    assert kernel_path(config, torch.float32, "meta")[0] == "reference"


def test_opcheck_forward_and_backward() -> None:
    x, w, b, *ops = make(CONV2D, 3, 4, (5, 11), 0, operands((5, 5), 4, 0))
    cfg = ConvLayerNormConfig(CONV2D, (5, 5), 1e-5, 0, 1, PRE, POST)
    args = [t.requires_grad_() for t in (x, w, b)]
    ops = [t.requires_grad_() for t in ops]
    torch.library.opcheck(conv_layer_norm_fwd, (*args, ops, cfg.to_json(), True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))  # fmt: skip
    out, saved_y, stats = conv_layer_norm_fwd(*[a.detach() for a in args], [o.detach() for o in ops], cfg.to_json(), True)
    bwd_args = (torch.randn_like(out), *[a.detach() for a in args], [o.detach() for o in ops], saved_y, stats,
                cfg.to_json(), [True] * 7)  # fmt: skip
    torch.library.opcheck(conv_layer_norm_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))


def test_saved_state_is_the_conv_output_and_the_row_statistics(kernels, kernel_device) -> None:
    dev = device_of(kernels, kernel_device)
    x, w, b, *ops = [t.to(dev) for t in make(CONV2D, 3, 6, (5, 11), 1, operands((5,), 6, 1))]
    cfg = ConvLayerNormConfig(CONV2D, (5,), 1e-5, 0, 1, PRE, ())
    out, saved_y, stats = conv_layer_norm_fwd(x, w, b, ops, cfg.to_json(), True)
    y0 = F.conv2d(x, w, None, (1, 2), (1, 0))
    # without the bias; the op's conv runs channels-last (``ops/library_conv.py``), another cuDNN
    # kernel than this NCHW one: equal up to the summation order
    assert saved_y.shape == y0.shape
    torch.testing.assert_close(saved_y, y0, rtol=1e-5, atol=1e-5)
    v = apply_chain(y0 + b.view(1, -1, 1, 1), PRE, ops)
    assert stats.shape == (2, 2 * 6 * 5) and stats.dtype == torch.float32  # rows: (N, C, H) in order
    torch.testing.assert_close(stats[0], v.mean(-1).reshape(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[1], (v.var(-1, unbiased=False) + 1e-5).rsqrt().reshape(-1), rtol=1e-4, atol=1e-5)
    _, saved_y, stats = conv_layer_norm_fwd(x, w, b, ops, cfg.to_json(), False)
    assert saved_y.numel() == stats.numel() == 0


# ------------------------------------------------------------------------------------------------
# Parity against float64
# ------------------------------------------------------------------------------------------------

#: name -> (conv, C_in, C_out, spatial size, normalized shape, weight / bias operand indices, pre, post).
#: The normalized shapes: the last dim alone and trailing spatial dims (rows of one channel, packed in
#: tiles; (45, 50) is too long to pack and walks), the channels and every spatial dim (a row per sample).
CASES = {
    "conv2d over W, both chains": (CONV2D, 3, 4, (5, 11), (5,), 0, 1, PRE, POST),
    "conv_transpose1d over (C, L), no affine": (CONVT1D, 3, 5, (5,), (5, 10), None, None, (),
                                                (ChainStep(K.GELU), ChainStep(K.MUL, (TensorRef(3),)))),
    "conv3d over (H, W), weight only, odd sizes": (CONV3D, 4, 6, (3, 4, 5), (4, 5), 0, None, (ChainStep(K.TANH),),
                                                   (ChainStep(K.ADD, (TensorRef(2),)),)),
    "conv2d over (H, W), rows too long to pack, bias only": (CONV2D, 2, 3, (45, 100), (45, 49), None, 1,
                                                             (ChainStep(K.LEAKY_RELU, (Const(0.1),)),),
                                                             (ChainStep(K.SILU),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_output_and_every_gradient_match_float64(name, kernels, kernel_device) -> None:
    spec, c_in, c_out, size, shape, wi, bi, pre, post = CASES[name]
    cfg = ConvLayerNormConfig(spec, shape, 1e-5, wi, bi, pre, post)
    tensors = make(spec, c_in, c_out, size, len(name), operands(shape, c_out, 3, spec.spatial_dims))
    check(cfg, tensors, device_of(kernels, kernel_device))


@pytest.mark.parametrize("shape", [(8,), (4, 6, 8)], ids=["over W", "over (C, H, W)"])
def test_channels_last_and_sliced_inputs(shape, kernels, kernel_device) -> None:
    """Without a pre-chain, a row of one channel holds one bias value, which the norm takes out: the
    bias's gradient is zero up to rounding, which no relative comparison judges, so it is left out there."""
    dev = device_of(kernels, kernel_device)
    cfg = ConvLayerNormConfig(CONV2D, shape, 1e-5, 0, 1, (), POST)
    tensors = make(CONV2D, 3, 4, (6, 18), 11, operands(shape, 4, 11))
    mask = [True, True, len(shape) > 1] + [True] * 4
    check(cfg, tensors, dev, mask, layout=lambda t: t.to(memory_format=torch.channels_last))
    wide = [t.clone() for t in tensors]
    wide[0] = torch.cat([tensors[0], tensors[0]], dim=-1)
    check(cfg, wide, dev, mask, layout=lambda t: t[..., ::2])  # a strided slice of x


def test_fp16_output_and_gradients(kernels, kernel_device) -> None:
    cfg = ConvLayerNormConfig(CONV2D, (5,), 1e-5, 0, 1, PRE, POST)
    check(cfg, make(CONV2D, 3, 4, (5, 11), 5, operands((5,), 4, 5), dtype=torch.float16), device_of(kernels, kernel_device))


def test_eps_is_honoured_on_nearly_constant_rows(kernels, kernel_device) -> None:
    """Rows whose variance is far below eps: the result is ``(v - mean) / sqrt(eps)``, so a wrong eps
    (or none) shows at once."""
    dev = device_of(kernels, kernel_device)
    x, w, b = make(CONV2D, 3, 4, (5, 11), 2)
    x, b = x * 1e-3, b * 1e-3
    for shape in ((5,), (4, 5, 5)):
        cfg = ConvLayerNormConfig(CONV2D, shape, 0.5, strict=True)
        out = conv_layer_norm(x.to(dev), w.to(dev), b.to(dev), [], cfg.to_json())
        want = F.layer_norm(F.conv2d(x, w, b, (1, 2), (1, 0)), shape, eps=0.5)
        torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-6)
        assert want.abs().max() < 0.1  # eps dominates (eps 1e-5 would give values around 1)


def test_nan_and_inf_spread_over_their_row_as_eager(kernels, kernel_device) -> None:
    dev = device_of(kernels, kernel_device)
    x, w, b, *ops = make(CONV2D, 3, 4, (5, 11), 9, operands((5,), 4, 9))
    x = x.clone()
    x[1, :, 2, 3] = float("inf")  # sample 1: an infinity reaches every channel, rows H = 1..2
    b = b.clone()
    b[0] = float("nan")  # channel 0 of every sample is NaN
    for shape in ((5,), (4, 5, 5)):
        cfg = ConvLayerNormConfig(CONV2D, shape, 1e-5, None, None, (), (ChainStep(K.SILU),), strict=True)
        out = conv_layer_norm(x.to(dev), w.to(dev), b.to(dev), ops[:0], cfg.to_json())
        want = eager(x, w, b, [], cfg)
        assert torch.equal(out.cpu().isnan(), want.isnan()) and torch.equal(out.cpu().isinf(), want.isinf())
        assert out.cpu().isnan()[:, 0].all()
        if shape == (5,):  # rows of one channel: the NaN channel and the rows the infinity reaches, no others
            assert not out.cpu()[0, 1:].isnan().any() and out.cpu()[1, 1:, 2].isnan().all()


def test_bad_inputs_get_one_line_errors() -> None:
    x, w, b, *ops = make(CONV2D, 3, 6, (5, 11), 1, operands((5,), 6, 1))
    with pytest.raises(UnsupportedInputError, match=r"does not end in the normalized shape \(4,\)"):
        conv_layer_norm(x, w, b, ops, ConvLayerNormConfig(CONV2D, (4,)).to_json())
    with pytest.raises(UnsupportedInputError, match="needs x and weight with 4 dims"):
        conv_layer_norm(x[0], w, b, ops, ConvLayerNormConfig(CONV2D, (5,)).to_json())
    with pytest.raises(UnsupportedInputError, match=r"norm's weight must hold 5 floating values"):
        conv_layer_norm(x, w, b, [ops[0][:3], *ops[1:]], ConvLayerNormConfig(CONV2D, (5,), 1e-5, 0, 1).to_json())
    with pytest.raises(UnsupportedInputError, match="operands\\[7\\]"):
        conv_layer_norm(x, w, b, ops, ConvLayerNormConfig(CONV2D, (5,), post=(ChainStep(K.MUL, (TensorRef(7),)),)).to_json())


# ------------------------------------------------------------------------------------------------
# Failure policy
# ------------------------------------------------------------------------------------------------


def test_a_kernel_failure_falls_back_to_the_reference_or_raises_under_strict(kernel_device, failing_kernels) -> None:
    from fusion_backend.kernels import layer_norm as kernels_module

    failing_kernels(kernels_module, "layer_norm_forward", "layer_norm_backward")
    x, w, b, *ops = [t.to(kernel_device) for t in make(CONV2D, 3, 4, (5, 11), 4, operands((5,), 4, 4))]
    cfg = ConvLayerNormConfig(CONV2D, (5,), 1e-5, 0, 1, (), (ChainStep(K.SILU),))
    x.requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = conv_layer_norm(x, w, b, ops, cfg.to_json())
        out.sum().backward()
    assert any("conv_layer_norm forward Triton kernel failed" in str(c.message) for c in caught)
    assert any("Falling back to the plain-torch reference" in str(c.message) for c in caught)
    torch.testing.assert_close(out, eager(x, w, b, ops, cfg), rtol=1e-5, atol=1e-5)
    with pytest.raises(KernelError, match="simulated launch failure"):
        conv_layer_norm(x, w, b, ops, dataclasses.replace(cfg, strict=True).to_json())


# ------------------------------------------------------------------------------------------------
# GPU: the Triton paths at realistic sizes
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_realistic_sizes(dtype) -> None:
    """Conv2d 64->64 k3 p1 -> LayerNorm([C, H, W]) -> ReLU on 8x64x64x64 (the families workload's layer,
    rows split into chunks), ConvTranspose3d 32->64 k3 s2 p1 op1 -> LayerNorm(W) -> GELU -> x s on
    2x32x8x16x32 (packed rows), channels-last too, and rows of (H, W) too long to pack."""
    tol = 1e-2 if dtype == torch.bfloat16 else None
    spec = ConvSpec(False, (1, 1), (1, 1), (1, 1), (0, 0), 1)
    cfg = ConvLayerNormConfig(spec, (64, 64, 64), 1e-5, 0, 1, (), (ChainStep(K.RELU),))
    check(cfg, make(spec, 64, 64, (64, 64), 0, operands((64, 64, 64), 64, 0), dtype=dtype, batch=8), "cuda", tol=tol)
    spec = ConvSpec(True, (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
    cfg = ConvLayerNormConfig(spec, (64,), 1e-5, 0, 1, (), (ChainStep(K.GELU), ChainStep(K.MUL, (TensorRef(3),))))
    tensors = make(spec, 32, 64, (8, 16, 32), 1, operands((64,), 64, 1, 3), dtype=dtype)
    check(cfg, tensors, "cuda", tol=tol)
    check(cfg, tensors, "cuda", tol=tol, layout=lambda t: t.to(memory_format=torch.channels_last_3d))
    cfg = ConvLayerNormConfig(CONV2D, (96, 48), 1e-5, 0, 1, PRE, POST)
    check(cfg, make(CONV2D, 16, 32, (96, 98), 2, operands((96, 48), 32, 2), dtype=dtype, batch=4), "cuda", tol=tol)
