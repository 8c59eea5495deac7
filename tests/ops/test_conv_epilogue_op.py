"""The fused op ``conv_epilogue``: eager parity, autograd, custom-op contracts, saved state, fallback.

The oracle is the eager composite (``F.conv*`` with bias -> ``chain.apply_step`` per step ->
``F.*_pool*d``) in float64, with gradients of x, weight, bias and every operand tensor by autograd.
CPU runs the plain-torch reference; ``FUSION_CPU_KERNELS=triton`` runs the Triton path on CPU tensors
under the interpreter (conftest sets ``TRITON_INTERPRET=1`` without CUDA), autograd included.
GPU tests (``-m gpu``) check fp32 and bf16 parity on the ``seeds`` suite's ConvT3d and Conv2d pipelines
at full size.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from fusion_backend import impl_choice
from fusion_backend.errors import KernelError, UnsupportedInputError
from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.kernels import epilogue as kernels
from fusion_backend.kernels import host
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef, apply_step
from fusion_backend.ops.config import ConvEpilogueConfig

PK = PointwiseKind
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@dataclass(frozen=True)
class ConvCase:
    """A conv problem: input shape, weight shape and ConvSpec."""

    name: str
    x: tuple[int, ...]
    w: tuple[int, ...]
    spec: ConvSpec

    @property
    def nd(self) -> int:
        return len(self.x) - 2

    @property
    def out_channels(self) -> int:
        return self.w[1] * self.spec.groups if self.spec.transposed else self.w[0]


def _spec(nd, transposed=False, stride=1, padding=0, dilation=1, output_padding=0, groups=1) -> ConvSpec:
    t = lambda v: tuple(v) if isinstance(v, tuple) else (v,) * nd  # noqa: E731
    return ConvSpec(transposed, t(stride), t(padding), t(dilation), t(output_padding), groups)


CONVS = [
    ConvCase("conv1d-s2p1", (2, 4, 9), (6, 4, 3), _spec(1, stride=2, padding=1)),
    ConvCase("convT1d-s2p1op1", (2, 4, 5), (4, 3, 3), _spec(1, True, stride=2, padding=1, output_padding=1)),
    ConvCase("conv2d-dil-groups", (2, 4, 7, 6), (6, 2, 3, 3), _spec(2, stride=(1, 2), padding=(1, 0), dilation=(2, 1), groups=2)),
    ConvCase("convT2d-groups", (2, 4, 4, 5), (4, 3, 3, 2), _spec(2, True, stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2)),
    ConvCase("conv3d-pad", (1, 3, 5, 6, 5), (4, 3, 2, 3, 3), _spec(3, padding=(0, 1, 1))),
    ConvCase("convT3d-s2p1op1", (1, 3, 3, 4, 4), (3, 4, 3, 3, 3), _spec(3, True, stride=2, padding=1, output_padding=1)),
]  # fmt: skip


def _pool(kind: str, nd: int, k=2, s=None, p=0, **kw) -> PoolSpec:
    t = lambda v: tuple(v) if isinstance(v, tuple) else (v,) * nd  # noqa: E731
    return PoolSpec(kind, t(k), t(s if s is not None else k), t(p), **kw)


def _variants(nd: int) -> dict[str, tuple[tuple[ChainStep, ...], PoolSpec | None]]:
    """Chains/pools exercised on every conv: leaky, x m, leaky, max pool; x m, leaky, GELU, no pool;
    add, SiLU, avg pool."""
    leaky = ChainStep(PK.LEAKY_RELU, (Const(0.2),))
    mul = ChainStep(PK.MUL, (TensorRef(0),))
    return {
        "leaky-mul-leaky-maxpool": ((leaky, mul, leaky), _pool("max", nd, 2)),
        "mul-leaky-gelu": ((mul, ChainStep(PK.LEAKY_RELU, (Const(0.01),)), ChainStep(PK.GELU)), None),
        "add-silu-avgpool-overlap": (
            (ChainStep(PK.ADD, (TensorRef(0),)), ChainStep(PK.SILU)),
            _pool("avg", nd, 3, 2, 1, ceil_mode=True, count_include_pad=False),
        ),
    }


def config_of(spec: ConvSpec, chain, pool=None, out_dtype=None, strict=False) -> str:
    return ConvEpilogueConfig(
        conv=spec, chain=tuple(chain), pool=pool, out_dtype=out_dtype, strict=strict
    ).to_json()


def eager(x, w, b, operands, spec: ConvSpec, chain, pool: PoolSpec | None, out_dtype=None):
    """The eager composite, written independently of the op module."""
    nd = x.dim() - 2
    if spec.transposed:
        y = getattr(F, f"conv_transpose{nd}d")(x, w, b, spec.stride, spec.padding, spec.output_padding, spec.groups,
                                                spec.dilation)  # fmt: skip
    else:
        y = getattr(F, f"conv{nd}d")(x, w, b, spec.stride, spec.padding, spec.dilation, spec.groups)
    for step in chain:
        args = [o.value if isinstance(o, Const) else operands[o.index] for o in step.operands]
        y = apply_step(step.kind, y, args)
    if pool is not None:
        if pool.kind == "max":
            y = getattr(F, f"max_pool{nd}d")(
                y, pool.kernel_size, pool.stride, pool.padding, ceil_mode=pool.ceil_mode
            )
        elif nd == 1:
            y = F.avg_pool1d(
                y, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, pool.count_include_pad
            )
        else:
            y = getattr(F, f"avg_pool{nd}d")(y, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode,
                                             pool.count_include_pad, pool.divisor_override)  # fmt: skip
    return y if out_dtype is None else y.to(out_dtype)


def make_inputs(case: ConvCase, dtype=torch.float64, bias=True, operand_shape="channel", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(case.x, generator=g, dtype=dtype)
    w = torch.randn(case.w, generator=g, dtype=dtype) * 0.3
    b = torch.randn(case.out_channels, generator=g, dtype=dtype) if bias else None
    c = case.out_channels
    shape = {"channel": (c,) + (1,) * case.nd, "batch-channel": (1, c) + (1,) * case.nd, "scalar": ()}[
        operand_shape
    ]
    m = torch.randn(shape, generator=g, dtype=dtype)
    return x, w, b, [m]


def check_against_eager(case: ConvCase, chain, pool, inputs, tol: float, grad_tol: float, out_dtype=None):
    """Forward and every gradient of the fused op vs the float64 eager composite (norm-wise).

    On the Triton path the config is strict, so that a kernel failure cannot hide behind the
    reference fallback.
    """
    x, w, b, operands = inputs
    strict = os.environ.get("FUSION_CPU_KERNELS") == "triton"
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, *(() if b is None else (b,)), *operands)]
    xl, wl = leaves[:2]
    bl = leaves[2] if b is not None else None
    ol = leaves[3 if b is not None else 2 :]
    config = config_of(
        case.spec, chain, pool, None if out_dtype is None else str(out_dtype).split(".")[1], strict
    )
    out = ce.conv_epilogue(xl, wl, bl, ol, config)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rb = ref_leaves[2] if b is not None else None
    ro = ref_leaves[3 if b is not None else 2 :]
    want = eager(ref_leaves[0], ref_leaves[1], rb, ro, case.spec, chain, pool)
    assert out.shape == want.shape and out.dtype == (out_dtype or x.dtype)
    assert rel_err(out, want) <= tol
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    exp = torch.autograd.grad(want, ref_leaves, grad_out)
    names = ["x", "weight"] + (["bias"] if b is not None else []) + [f"operand{i}" for i in range(len(ol))]
    for name, g_, e_ in zip(names, got, exp, strict=True):
        assert (
            g_.shape == e_.shape
            and g_.dtype == next(t for n, t in zip(names, leaves, strict=True) if n == name).dtype
        )
        assert rel_err(g_, e_) <= grad_tol, name
    return out


# --- the reference (CPU) against eager, float64 ------------------------------------------------------


@pytest.mark.parametrize("variant", ["leaky-mul-leaky-maxpool", "mul-leaky-gelu", "add-silu-avgpool-overlap"])
@pytest.mark.parametrize("case", CONVS, ids=lambda c: c.name)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_reference_matches_eager_in_float64(case, variant, bias):
    chain, pool = _variants(case.nd)[variant]
    check_against_eager(case, chain, pool, make_inputs(case, bias=bias), 1e-12, 1e-12)


def test_reference_handles_big_windows_with_int32_winners():
    case = CONVS[4]
    pool = _pool("max", 3, (2, 6, 5), (1, 2, 3), (1, 3, 2))  # 60 taps
    big = _pool("max", 3, (3, 6, 5), 1, (1, 3, 2))  # 90 taps > kernel unroll limit
    chain = (ChainStep(PK.MUL, (TensorRef(0),)), ChainStep(PK.TANH))
    for p in (pool, big):
        check_against_eager(case, chain, p, make_inputs(case), 1e-12, 1e-12)
    x, w, b, ops = make_inputs(case)
    huge = _pool("max", 3, (4, 6, 6), 1, (2, 3, 3))  # 144 taps
    _, _, saved_winner = torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config_of(case.spec, chain, huge), True)
    assert saved_winner.dtype == torch.int32


def test_gradcheck_of_the_reference_in_float64():
    case = ConvCase("tiny", (1, 2, 5, 4), (3, 2, 2, 2), _spec(2, padding=1))
    chain = (ChainStep(PK.MUL, (TensorRef(0),)), ChainStep(PK.GELU), ChainStep(PK.SUB, (TensorRef(1),)))
    for pool in (None, _pool("max", 2, 2, 1, 1), _pool("avg", 2, 3, 2, 1, ceil_mode=True)):
        config = config_of(case.spec, chain, pool)
        x, w, b, (m,) = make_inputs(case)
        inputs = [t.requires_grad_() for t in (x, w, b, m, torch.randn(()).double())]
        fn = lambda x, w, b, m, s, config=config: ce.conv_epilogue(x, w, b, [m, s], config)  # noqa: E731
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


# --- the Triton path on CPU (interpreter), autograd included ------------------------------------------


def cpu_kernels(monkeypatch) -> None:
    """Route CPU calls through the Triton launchers (needs Triton's interpreter)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path on CPU tensors needs TRITON_INTERPRET=1 (CPU-only machines)")
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Route CPU calls through the Triton launchers and count the epilogue kernels' launches (the
    op's call plans launch through ``ForwardLaunch`` / ``BackwardLaunch``)."""
    cpu_kernels(monkeypatch)
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = kernels.ForwardLaunch.__call__, kernels.BackwardLaunch.__call__

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(kernels.ForwardLaunch, "__call__", count("forward", fwd))
    monkeypatch.setattr(kernels.BackwardLaunch, "__call__", count("backward", bwd))
    return calls


@pytest.mark.parametrize("variant", ["leaky-mul-leaky-maxpool", "mul-leaky-gelu", "add-silu-avgpool-overlap"])
@pytest.mark.parametrize("case", CONVS, ids=lambda c: c.name)
def test_triton_path_end_to_end_fp32(case, variant, triton_on_cpu):
    chain, pool = _variants(case.nd)[variant]
    check_against_eager(case, chain, pool, make_inputs(case, torch.float32), 1e-5, 2e-5)
    assert triton_on_cpu == {"forward": 1, "backward": 1}


_KIND_OPERANDS = {
    PK.LEAKY_RELU: (Const(0.1),), PK.CLAMP: (Const(-0.5), Const(0.7)), PK.CLAMP_MIN: (Const(-0.3),),
    PK.CLAMP_MAX: (Const(0.4),), PK.HARDTANH: (Const(-0.6), Const(0.5)),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(PointwiseKind), ids=lambda k: k.name.lower())
def test_every_kind_end_to_end(kind, triton_on_cpu):
    case = ConvCase("small", (2, 3, 5, 5), (4, 3, 3, 3), _spec(2, padding=1))
    operands = _KIND_OPERANDS.get(kind, (TensorRef(0),) * kind.arity)
    chain = [ChainStep(kind, operands)]
    if kind is PK.RDIV:  # keep the divisor away from 0
        chain.insert(0, ChainStep(PK.SIGMOID))
    if not any(isinstance(o, TensorRef) for o in operands):  # the operand tensor still gets a gradient to check
        chain.append(ChainStep(PK.MUL, (TensorRef(0),)))
    x, w, b, (m,) = make_inputs(case, torch.float32)
    m = m.sign() * (m.abs() + 0.5)
    check_against_eager(case, chain, _pool("max", 2, 2), (x, w, b, [m]), 1e-5, 2e-5)


@pytest.mark.parametrize("operand_shape", ["channel", "scalar"])
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_tensor_clamp_bounds_that_require_grad(operand_shape, path, monkeypatch):
    """``torch.clamp(y, min=t)`` / ``max=t`` with a tensor bound that requires grad: the bound gets
    torch's gradient (where it was taken), on both paths, behind a max pool and without one."""
    if path == "triton":
        cpu_kernels(monkeypatch)
    case = CONVS[2]
    x, w, b, (m,) = make_inputs(case, torch.float32, operand_shape=operand_shape)
    lo, hi = m * 0.1 - 0.3, m * 0.1 + 0.4
    for pool in (None, _pool("max", 2, 2)):
        chain = [ChainStep(PK.CLAMP_MIN, (TensorRef(0),)), ChainStep(PK.MUL, (TensorRef(2),)),
                 ChainStep(PK.CLAMP_MAX, (TensorRef(1),))]  # fmt: skip
        check_against_eager(case, chain, pool, (x, w, b, [lo, hi, m]), 1e-5, 2e-5)


def test_a_clamp_bound_tied_with_the_value_gives_the_gradient_to_the_value():
    """At ``v == bound`` torch's clamp_min / clamp_max backward send the gradient to ``v`` and none to
    the bound; NaN sends it to neither."""
    case = CONVS[2]
    x, w, _, _ = make_inputs(case, torch.float32)
    w = torch.zeros_like(w)  # the conv output is exactly the bias: 0, or NaN in channel 1
    b = torch.zeros(case.out_channels)
    b[1] = float("nan")
    for kind in (PK.CLAMP_MIN, PK.CLAMP_MAX):
        bound = torch.zeros((), requires_grad=True)
        bl = b.clone().requires_grad_()
        config = config_of(case.spec, [ChainStep(kind, (TensorRef(0),))], None)
        out = ce.conv_epilogue(x, w, bl, [bound], config)
        out.backward(torch.ones_like(out))
        assert bound.grad.item() == 0.0, kind
        assert bl.grad[0].item() == out[:, 0].numel() and bl.grad[1].item() == 0.0, kind


def test_a_long_chain_sharing_one_operand(triton_on_cpu):
    case = CONVS[2]
    mul0, add1 = ChainStep(PK.MUL, (TensorRef(0),)), ChainStep(PK.ADD, (TensorRef(1),))
    chain = [mul0, ChainStep(PK.LEAKY_RELU, (Const(0.2),)), add1, ChainStep(PK.TANH), mul0,
             ChainStep(PK.DIV, (Const(-1.5),)), ChainStep(PK.RSUB, (TensorRef(1),)), ChainStep(PK.MISH)]  # fmt: skip
    x, w, b, (m,) = make_inputs(case, torch.float32)
    check_against_eager(case, chain, _pool("max", 2, 3, 2, 1), (x, w, b, [m, torch.randn(())]), 1e-5, 2e-5)


@pytest.mark.parametrize("operand_shape", ["channel", "batch-channel", "scalar"])
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_operand_shapes(operand_shape, path, monkeypatch):
    if path == "triton":
        cpu_kernels(monkeypatch)
    case = CONVS[2]
    chain, pool = _variants(2)["leaky-mul-leaky-maxpool"]
    check_against_eager(
        case, chain, pool, make_inputs(case, torch.float32, operand_shape=operand_shape), 1e-5, 2e-5
    )


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_channels_last_input_gives_channels_last_output(path, monkeypatch):
    if path == "triton":
        cpu_kernels(monkeypatch)
    for case, fmt in ((CONVS[2], torch.channels_last), (CONVS[5], torch.channels_last_3d)):
        x, w, b, ops = make_inputs(case, torch.float32)
        for variant in ("leaky-mul-leaky-maxpool", "mul-leaky-gelu"):
            chain, pool = _variants(case.nd)[variant]
            out = check_against_eager(
                case, chain, pool, (x.contiguous(memory_format=fmt), w, b, ops), 1e-5, 2e-5
            )
            eager_out = eager(x.contiguous(memory_format=fmt), w, b, ops, case.spec, chain, pool)
            assert out.is_contiguous(memory_format=fmt) == eager_out.is_contiguous(memory_format=fmt)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_out_dtype_follows_type_promotion(path, monkeypatch):
    if path == "triton":
        cpu_kernels(monkeypatch)
    case = CONVS[2]
    chain, pool = _variants(2)["mul-leaky-gelu"]
    x, w, b, (m,) = make_inputs(case, torch.float32)
    # an fp64 per-channel operand promotes the fp32 chain to fp64, as eager does
    check_against_eager(case, chain, pool, (x, w, b, [m.double()]), 1e-5, 2e-5, out_dtype=torch.float64)


def test_fp16_conv_with_fp32_operand_returns_fp32(triton_on_cpu):
    case = ConvCase("small", (2, 3, 6, 6), (4, 3, 3, 3), _spec(2))
    chain, pool = _variants(2)["leaky-mul-leaky-maxpool"]
    x, w, b, (m,) = make_inputs(case, torch.float32)
    config = config_of(case.spec, chain, pool, "float32", strict=True)
    x16, w16, b16 = (t.half().requires_grad_() for t in (x, w, b))
    m32 = m.clone().requires_grad_()
    out = ce.conv_epilogue(x16, w16, b16, [m32], config)
    want = eager(*(t.double() for t in (x16, w16, b16)), [m32.double()], case.spec, chain, pool)
    assert out.dtype == torch.float32 and rel_err(out, want) < 2e-3
    out.sum().backward()
    assert x16.grad.dtype == torch.float16 and m32.grad.dtype == torch.float32
    assert triton_on_cpu["forward"] == 1 and triton_on_cpu["backward"] == 1


def test_nan_in_the_input_propagates_like_eager(monkeypatch):
    case = CONVS[2]
    chain, pool = _variants(2)["leaky-mul-leaky-maxpool"]
    x, w, b, ops = make_inputs(case, torch.float32)
    x[0, 1, 3, 2] = float("nan")
    want = eager(x, w, b, ops, case.spec, chain, pool)
    for path in ("", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("",):
        monkeypatch.setenv("FUSION_CPU_KERNELS", path)
        out = ce.conv_epilogue(x, w, b, ops, config_of(case.spec, chain, pool, strict=path == "triton"))
        assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out).any()
        assert torch.allclose(out.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-6)


def test_negative_multipliers_and_ties_route_gradients_like_eager(triton_on_cpu):
    case = CONVS[2]
    chain, pool = _variants(2)["leaky-mul-leaky-maxpool"]
    x, w, b, (m,) = make_inputs(case, torch.float32)
    m = torch.tensor([-1.0, 0.0, 2.0, -0.5, 0.0, 1.0]).reshape(6, 1, 1)  # zeros: every window ties
    check_against_eager(case, chain, pool, (x, w, b, [m]), 1e-5, 2e-5)


# --- custom-op contracts -------------------------------------------------------------------------------


def _op_args(case: ConvCase, variant: str, save: bool, fmt=None):
    chain, pool = _variants(case.nd)[variant]
    x, w, b, ops = make_inputs(case, torch.float32)
    if fmt is not None:
        x = x.contiguous(memory_format=fmt)
    strict = os.environ.get("FUSION_CPU_KERNELS") == "triton"
    return (x, w, b, ops, config_of(case.spec, chain, pool, strict=strict), save)


@pytest.mark.parametrize(
    "case, variant, save, fmt",
    [
        (CONVS[2], "leaky-mul-leaky-maxpool", True, None),
        (CONVS[3], "add-silu-avgpool-overlap", True, torch.channels_last),
        (CONVS[0], "mul-leaky-gelu", False, None),
        (CONVS[5], "leaky-mul-leaky-maxpool", True, torch.channels_last_3d),
    ],
    ids=["maxpool-save", "avgpool-channels-last", "nopool-nosave", "3d-channels-last-3d"],
)
def test_opcheck_forward_and_backward_ops(case, variant, save, fmt):
    args = _op_args(case, variant, save, fmt)
    torch.library.opcheck(torch.ops.fusion.conv_epilogue_fwd.default, args)
    if save:
        x, w, b, ops, config, _ = args
        out, saved_y0, saved_winner = torch.ops.fusion.conv_epilogue_fwd(*args)
        bwd_args = (torch.randn_like(out), x, w, b, ops, saved_y0, saved_winner, config, [True, True, True, True])
        torch.library.opcheck(torch.ops.fusion.conv_epilogue_bwd.default, bwd_args)
    grad_args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args[:3]) + args[3:]
    torch.library.opcheck(
        torch.ops.fusion.conv_epilogue_fwd.default, grad_args, test_utils=("test_autograd_registration",)
    )


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_fake_and_real_outputs_agree_on_shape_dtype_and_strides(path, monkeypatch):
    if path == "triton":
        cpu_kernels(monkeypatch)
    for case, fmt in ((CONVS[3], torch.channels_last), (CONVS[5], torch.channels_last_3d), (CONVS[1], None)):
        for variant in ("leaky-mul-leaky-maxpool", "mul-leaky-gelu", "add-silu-avgpool-overlap"):
            for save in (True, False):
                args = _op_args(case, variant, save, fmt)
                real = torch.ops.fusion.conv_epilogue_fwd(*args)
                with FakeTensorMode() as mode:
                    fake_args = tuple(
                        mode.from_tensor(a) if isinstance(a, torch.Tensor)
                        else [mode.from_tensor(t) for t in a] if isinstance(a, list) else a
                        for a in args
                    )  # fmt: skip
                    fake = torch.ops.fusion.conv_epilogue_fwd(*fake_args)
                for r, f in zip(real, fake, strict=True):
                    assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), (
                        case.name,
                        variant,
                        save,
                    )


def test_saved_state_layout(monkeypatch):
    case = CONVS[2]
    chain, _ = _variants(2)["leaky-mul-leaky-maxpool"]
    pool = _pool("max", 2, 3, 2, 1)
    x, w, b, ops = make_inputs(case, torch.float32)
    config = config_of(case.spec, chain, pool, strict=True)
    y0 = F.conv2d(x, w, None, case.spec.stride, case.spec.padding, case.spec.dilation, case.spec.groups)
    v = eager(x, w, b, ops, case.spec, chain, None)
    _, flat = F.max_pool2d(v, 3, 2, 1, return_indices=True)
    oh = torch.arange(flat.shape[2]).reshape(-1, 1) * 2 - 1
    ow = torch.arange(flat.shape[3]) * 2 - 1
    want_win = (flat // y0.shape[3] - oh) * 3 + (flat % y0.shape[3] - ow)
    want_y = y0.flatten(2).gather(2, flat.flatten(2)).reshape(flat.shape)
    for path in ("", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("",):
        monkeypatch.setenv("FUSION_CPU_KERNELS", path)
        out, saved_y0, saved_winner = torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config, True)
        assert saved_winner.dtype == torch.int8 and saved_winner.shape == out.shape
        assert torch.equal(saved_winner.long(), want_win)
        assert saved_y0.dtype == x.dtype and torch.allclose(saved_y0, want_y, atol=1e-6)  # y WITHOUT bias
        nopool = config_of(case.spec, chain, strict=True)
        _, full, empty = torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, nopool, True)
        assert torch.allclose(full, y0, atol=1e-6) and empty.numel() == 0
        for a in torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config, False)[1:]:
            assert a.shape == (0,)


def test_state_is_saved_only_when_autograd_needs_it(monkeypatch):
    seen = []
    ref = ce.reference.forward
    spy = dataclasses.replace(ce.CONV_EPILOGUE.d, reference_forward=lambda *a: seen.append(a[-1]) or ref(*a))
    monkeypatch.setattr(ce.CONV_EPILOGUE, "d", spy)
    case = CONVS[0]
    chain, pool = _variants(1)["leaky-mul-leaky-maxpool"]
    x, w, b, ops = make_inputs(case, torch.float32)
    config = config_of(case.spec, chain, pool)
    ce.conv_epilogue(x, w, b, ops, config)
    w.requires_grad_()
    with torch.no_grad():
        ce.conv_epilogue(x, w, b, ops, config)
    ce.conv_epilogue(x, w, b, ops, config)
    assert seen == [False, False, True]


def test_backward_without_saved_state_says_what_to_do():
    case = CONVS[0]
    args = list(_op_args(case, "mul-leaky-gelu", False))
    args[1] = args[1].requires_grad_()
    out, _, _ = torch.ops.fusion.conv_epilogue_fwd(*args)
    with pytest.raises(RuntimeError, match="save_for_backward=False"):
        out.sum().backward()


def test_dynamic_shapes_under_aot_autograd():
    case = CONVS[2]
    chain, pool = _variants(2)["leaky-mul-leaky-maxpool"]
    config = config_of(case.spec, chain, pool)
    fn = torch.compile(
        lambda x, w, b, m: ce.conv_epilogue(x, w, b, [m], config), backend="aot_eager", dynamic=True
    )
    for h in (7, 9):
        x, w, b, (m,) = make_inputs(ConvCase("dyn", (2, 4, h, 6), case.w, case.spec), torch.float32)
        leaves = [t.requires_grad_() for t in (x, w, b, m)]
        out = fn(*leaves)
        want = eager(*[t.detach().double() for t in (x, w, b)], [m.detach().double()], case.spec, chain, pool)
        assert rel_err(out, want) < 1e-5
        out.sum().backward()
        assert all(t.grad is not None for t in leaves)


# --- dispatch and failure policy ---------------------------------------------------------------------


def test_kernel_path_reports_what_runs(monkeypatch):
    config = config_of(_spec(2), [ChainStep(PK.RELU)], _pool("max", 2, 2))
    monkeypatch.delenv("FUSION_CPU_KERNELS", raising=False)
    assert ce.kernel_path(config, torch.float32, "cuda") == ("triton", None)
    assert ce.kernel_path(config, torch.bfloat16, "cuda") == ("triton", None)
    path, why = ce.kernel_path(config, torch.float64, "cuda")
    assert path == "reference" and "float64" in why
    path, why = ce.kernel_path(config, torch.float32, "cpu")
    assert path == "reference" and "FUSION_CPU_KERNELS" in why
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setattr(host, "INTERPRETER", True)  # as under TRITON_INTERPRET=1, on any machine
    assert ce.kernel_path(config, torch.float32, "cpu") == ("triton", None)
    assert ce.kernel_path(config, torch.bfloat16, "cpu")[0] == "reference"
    big = config_of(_spec(2), [ChainStep(PK.RELU)], _pool("max", 2, 9, 1))
    assert "unroll limit" in ce.kernel_path(big, torch.float32, "cuda")[1]
    long_chain = config_of(_spec(2), [ChainStep(PK.RELU)] * 9)
    assert "9 steps" in ce.kernel_path(long_chain, torch.float32, "cuda")[1]


def _broken_forward(*args, **kwargs):
    raise RuntimeError("boom: simulated compile failure")


def test_kernel_failure_falls_back_with_one_warning(monkeypatch, caplog):
    cpu_kernels(monkeypatch)
    monkeypatch.setattr(kernels.ForwardLaunch, "__call__", _broken_forward)
    case = CONVS[2]
    chain, pool = _variants(2)["leaky-mul-leaky-maxpool"]
    x, w, b, ops = make_inputs(case, torch.float32)
    config = config_of(
        case.spec, chain + (ChainStep(PK.ADD, (Const(0.125),)),), pool
    )  # a config not yet warned
    with (
        caplog.at_level(logging.WARNING, logger="fusion_backend"),
        pytest.warns(RuntimeWarning, match="boom"),
    ):
        out = ce.conv_epilogue(x, w, b, ops, config)
    assert any("boom" in r.getMessage() and "falling back" in r.getMessage().lower() for r in caplog.records)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = ce.conv_epilogue(x, w, b, ops, config)  # warned once per config
    assert torch.equal(out, again)
    monkeypatch.delenv("FUSION_CPU_KERNELS")
    assert torch.equal(out, ce.conv_epilogue(x, w, b, ops, config))


def test_kernel_failure_raises_under_strict(monkeypatch):
    cpu_kernels(monkeypatch)
    monkeypatch.setattr(kernels.ForwardLaunch, "__call__", _broken_forward)
    case = CONVS[2]
    chain, pool = _variants(2)["leaky-mul-leaky-maxpool"]
    x, w, b, ops = make_inputs(case, torch.float32)
    with pytest.raises(KernelError) as info:
        ce.conv_epilogue(x, w, b, ops, config_of(case.spec, chain, pool, strict=True))
    message = str(info.value)
    for part in (
        "forward",
        "leaky_relu(0.2), mul(operands[0])",
        "max",
        str(tuple(x.shape)),
        "float32",
        "boom",
    ):
        assert part in message


def test_non_per_channel_operand_falls_back_to_the_reference(monkeypatch):
    cpu_kernels(monkeypatch)
    case = CONVS[2]
    x, w, b, _ = make_inputs(case, torch.float32)
    along_w = torch.randn(1, 1, 1, 2)  # broadcasts along W (conv output is (2, 6, 7, 2)): not per channel
    chain = [ChainStep(PK.MUL, (TensorRef(0),))]
    config = config_of(case.spec, chain)
    with pytest.warns(RuntimeWarning, match="neither a scalar nor per-channel"):
        out = ce.conv_epilogue(x, w, b, [along_w], config)
    assert rel_err(out, eager(x, w, b, [along_w], case.spec, chain, None)) < 1e-6
    with pytest.raises(UnsupportedInputError, match="per-channel"):
        ce.conv_epilogue(x, w, b, [along_w], config_of(case.spec, chain, strict=True))


# --- GPU -------------------------------------------------------------------------------------------


@pytest.fixture
def no_tf32():
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


CONVT3D_FULL = (  # demos/seeds/convt3d_leaky_mul_leaky_maxpool.py
    ConvCase("convt3d", (16, 16, 16, 32, 32), (16, 32, 3, 3, 3), _spec(3, True, stride=2, padding=1, output_padding=1)),
    (ChainStep(PK.LEAKY_RELU, (Const(0.2),)), ChainStep(PK.MUL, (TensorRef(0),)), ChainStep(PK.LEAKY_RELU, (Const(0.2),))),
    _pool("max", 3, 2),
    (32, 1, 1, 1),
)  # fmt: skip
CONV2D_FULL = (  # demos/seeds/conv2d_mul_leaky_gelu.py
    ConvCase("conv2d", (64, 64, 256, 256), (64, 64, 3, 3), _spec(2)),
    (ChainStep(PK.MUL, (TensorRef(0),)), ChainStep(PK.LEAKY_RELU, (Const(0.01),)), ChainStep(PK.GELU)),
    None,
    (64, 1, 1),
)  # fmt: skip


def _full_size_run(workload, dtype: torch.dtype, fused: bool) -> list[torch.Tensor]:
    """[out, grad x, grad weight, grad bias, grad multiplier] of a full-size workload, fused or eager.

    With a low-precision ``dtype`` the conv runs in it and the multiplier stays fp32, as under
    autocast: the result is fp32 by type promotion.
    """
    case, chain, pool, m_shape = workload
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(case.x, generator=g, device="cuda")
    w = torch.randn(case.w, generator=g, device="cuda") * 0.05
    b = torch.randn(case.out_channels, generator=g, device="cuda") * 0.1
    m = torch.randn(m_shape, generator=g, device="cuda")
    leaves = [t.to(dtype).requires_grad_() for t in (x, w, b)] + [m.requires_grad_()]
    if fused:
        config = config_of(case.spec, chain, pool, None if dtype == torch.float32 else "float32", strict=True)
        out = ce.conv_epilogue(leaves[0], leaves[1], leaves[2], [leaves[3]], config)
    else:
        out = eager(leaves[0], leaves[1], leaves[2], [leaves[3]], case.spec, chain, pool)
    grad_out = torch.randn(out.shape, generator=g, device="cuda", dtype=out.dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


NAMES = ["out", "grad x", "grad weight", "grad bias", "grad multiplier"]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("workload", [CONVT3D_FULL, CONV2D_FULL], ids=["convt3d", "conv2d"])
def test_gpu_fp32_parity_on_full_size_workloads(workload, no_tf32):
    # The default (library) path runs eager's own cuDNN conv: every tensor within 1e-5 of eager.
    # (The opt-in fused conv sums in another order, which moves max-pool near-ties: its parity is
    # refereed by float64 in tests/kernels/test_conv_fused_kernel.py and tests/ops/test_conv_epilogue_triton_backward.py.)
    fused = _full_size_run(workload, torch.float32, fused=True)
    want = _full_size_run(workload, torch.float32, fused=False)
    for name, f, e in zip(NAMES, fused, want, strict=True):
        assert f.dtype == e.dtype and f.shape == e.shape
        assert rel_err(f, e) <= 1e-5, f"{name}: {rel_err(f, e):.2e} vs eager"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("workload", [CONVT3D_FULL, CONV2D_FULL], ids=["convt3d", "conv2d"])
def test_gpu_bf16_parity_on_full_size_workloads(workload, no_tf32):
    # The fused chain runs in fp32 where eager rounds every step to bf16, so both are measured
    # against the fp32 truth: the fused op must be within 1e-2 of it, or no worse than eager bf16.
    fused = _full_size_run(workload, torch.bfloat16, fused=True)
    bf16_eager = _full_size_run(workload, torch.bfloat16, fused=False)
    truth = _full_size_run(workload, torch.float32, fused=False)
    for name, f, e, t in zip(NAMES, fused, bf16_eager, truth, strict=True):
        assert f.dtype == e.dtype and f.shape == e.shape
        assert rel_err(f, t) <= max(1e-2, 1.5 * rel_err(e, t)), name
        assert rel_err(f, e) <= 1e-2 or rel_err(f, t) <= rel_err(e, t), name


@pytest.mark.gpu
@requires_cuda
def test_gpu_strict_rejects_float64_and_the_reference_serves_it():
    case = CONVS[2]
    chain, pool = _variants(2)["leaky-mul-leaky-maxpool"]
    x, w, b, (m,) = make_inputs(case, torch.float64)
    args = [t.cuda() for t in (x, w, b)]
    with pytest.raises(UnsupportedInputError, match="float64"):
        ce.conv_epilogue(*args, [m.cuda()], config_of(case.spec, chain, pool, strict=True))
    out = ce.conv_epilogue(*args, [m.cuda()], config_of(case.spec, chain, pool))
    assert rel_err(out, eager(x, w, b, [m], case.spec, chain, pool)) < 1e-10


def test_auto_times_the_triton_backward_only_behind_a_transposed_conv_with_a_max_pool():
    def reason(spec, pool):
        return ce.backward.triton_backward_never_wins(ConvEpilogueConfig(conv=spec, chain=(ChainStep(PK.RELU),), pool=pool))

    assert reason(_spec(3, transposed=True, stride=2), _pool("max", 3)) is None
    for spec, pool in [(_spec(3), _pool("max", 3)), (_spec(2, transposed=True, stride=2), None),
                       (_spec(2, transposed=True, stride=2), _pool("avg", 2)), (_spec(1), None)]:
        assert "transposed conv with a max pool" in reason(spec, pool)


def test_op_results_agree_within_the_dtype_bound():
    """``impl_choice.results_agree``: TF32-vs-TF32 differences pass, a TF32-vs-fp32 sized one
    (conv2d_mul_leaky_gelu_small on the H100: 2.7e-4) does not; integer winners and None entries are
    ignored."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1000, generator=g)
    winners = torch.randint(0, 8, (10,), dtype=torch.int8)
    close = ref + 1e-6 * torch.randn(1000, generator=g)
    far = ref + 3e-4 * torch.randn(1000, generator=g)
    assert impl_choice.results_agree((close, winners, None), (ref, winners.flip(0), None)) is None
    assert "relative difference" in impl_choice.results_agree((far,), (ref,))
    nan = ref.clone()
    nan[3] = float("nan")
    assert "non-finite" in impl_choice.results_agree((ref,), (nan,))
    half = ref.to(torch.bfloat16)
    assert impl_choice.results_agree((half + 1e-3 * half,), (half,)) is None
