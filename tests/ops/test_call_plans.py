"""Per-signature call plans of ``fusion::conv_epilogue`` (``ops/conv_epilogue/``).

A call whose signature (config, shapes, strides, dtypes, devices, TF32 flag, switches) was seen
runs a kept plan: no checks, no decisions, only allocations and launches.  These tests pin what a
plan must never change: the values it reads (a parameter updated in place between calls), a new
layout getting its own plan, the backward reading the saved state of its own forward, and the
operand matrix being the one ``build_params`` gives.  On CPU the kernels run under the interpreter
(``FUSION_CPU_KERNELS=triton``); with CUDA on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from fusion_backend import environment
from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.kernels import epilogue as kernels
from fusion_backend.ops import chain_lowering
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef
from fusion_backend.ops.config import ConvEpilogueConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PK = PointwiseKind


@pytest.fixture
def planned(monkeypatch, exact_fp32, fresh_plans):
    """The fused conv path (forced), empty plan caches, and a count of plans built per direction."""
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path on CPU tensors needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setenv(ce.CONV_IMPL_ENV, "triton")
    built = {"forward": 0, "backward": 0}
    real_forward, real_backward = ce.forward.plan_for, ce.backward.plan_for

    def forward_plan(*args):
        built["forward"] += 1
        return real_forward(*args)

    def backward_plan(*args):
        built["backward"] += 1
        return real_backward(*args)

    monkeypatch.setattr(ce.forward, "plan_for", forward_plan)
    monkeypatch.setattr(ce.backward, "plan_for", backward_plan)
    return built


def _convt3d_pipeline_op(c_in: int = 4, c_out: int = 6):
    """The ``convt3d_leaky_mul_leaky_maxpool`` op (conv-transpose 3d stride 2, leaky, x per-channel, leaky,
    max pool 2) at a small size."""
    spec = ConvSpec(True, (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
    leaky = ChainStep(PK.LEAKY_RELU, (Const(0.2),))
    chain = (leaky, ChainStep(PK.MUL, (TensorRef(0),)), leaky)
    pool = PoolSpec("max", (2, 2, 2), (2, 2, 2), (0, 0, 0))
    config = ConvEpilogueConfig(conv=spec, chain=chain, pool=pool, strict=True).to_json()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, c_in, 3, 4, 5, generator=g)
    w = torch.randn(c_in, c_out, 3, 3, 3, generator=g) * 0.3
    b = torch.randn(c_out, generator=g)
    m = torch.randn(c_out, 1, 1, 1, generator=g)  # signs mixed: negative multipliers flip the max
    return [t.to(DEVICE).requires_grad_(True) for t in (x, w, b, m)], config


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


def test_a_kept_plan_reads_parameters_updated_in_place(planned):
    """The second and third calls run the kept plans, and see the bias and multiplier as they are
    now (an optimizer updates them in place), in the forward and in the backward."""
    (x, w, b, m), config = _convt3d_pipeline_op()
    for step in range(3):
        out = ce.conv_epilogue(x, w, b, [m], config)
        want = ce.conv_epilogue_eager(x, w, b, [m], config)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        grad = torch.randn_like(out)
        for got_g, want_g in zip(_grads(out, (x, w, b, m), grad), _grads(want, (x, w, b, m), grad), strict=True):
            torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            b.add_(0.5 * (step + 1))
            m.mul_(-1.5)  # flips which element wins each window
            w.mul_(0.9)
    assert planned == {"forward": 1, "backward": 1}, "the plans were not kept"


def test_a_new_layout_gets_its_own_plan(planned):
    """channels_last input and a non-contiguous weight: a second plan, with the right results."""
    (x, w, b, m), config = _convt3d_pipeline_op()
    out = ce.conv_epilogue(x, w, b, [m], config)
    x_cl = x.detach().to(memory_format=torch.channels_last_3d).requires_grad_(True)
    w_nc = w.detach().transpose(3, 4).contiguous().transpose(3, 4).requires_grad_(True)
    out_cl = ce.conv_epilogue(x_cl, w_nc, b, [m], config)
    torch.testing.assert_close(out_cl, out, rtol=1e-5, atol=1e-5)
    assert out_cl.stride() == ce.conv_epilogue_eager(x_cl, w_nc, b, [m], config).stride()
    grad = torch.randn_like(out)
    for got_g, want_g in zip(_grads(out_cl, (x_cl, w_nc, b, m), grad), _grads(out, (x, w, b, m), grad), strict=True):
        torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-4)
    assert planned == {"forward": 2, "backward": 2}


def test_a_switched_variable_gets_a_new_plan(planned, monkeypatch):
    """A switch a plan depends on, set, changed or unset between calls (a notebook cell, a test's
    ``setenv``), makes the next call plan again; switching back finds the first plan."""
    (x, w, b, m), config = _convt3d_pipeline_op()
    x, w, b, m = (t.detach() for t in (x, w, b, m))
    monkeypatch.delenv(environment.CONV_AUTOTUNE, raising=False)
    ce.conv_epilogue(x, w, b, [m], config)
    for value in ("0", "1"):
        monkeypatch.setenv(environment.CONV_AUTOTUNE, value)
        ce.conv_epilogue(x, w, b, [m], config)
    monkeypatch.delenv(environment.CONV_AUTOTUNE)
    ce.conv_epilogue(x, w, b, [m], config)
    assert planned["forward"] == 3


def test_the_backward_reads_its_own_forwards_state(planned):
    """Two forwards before their backwards (two micro-batches): each backward uses its own saved
    winners and values, not the last forward's."""
    (x, w, b, m), config = _convt3d_pipeline_op()
    x2 = torch.randn_like(x).requires_grad_(True)
    out1 = ce.conv_epilogue(x, w, b, [m], config)
    out2 = ce.conv_epilogue(x2, w, b, [m], config)
    grad = torch.randn_like(out1)
    for out, xi in ((out1, x), (out2, x2)):
        want = ce.conv_epilogue_eager(xi, w, b, [m], config)
        got_g = _grads(out, (xi, w, b, m), grad)
        for g_, w_ in zip(got_g, _grads(want, (xi, w, b, m), grad), strict=True):
            torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)


def test_no_plan_is_kept_while_the_choice_is_unmeasured(monkeypatch, planned):
    """Under ``auto`` with measuring on but the choice not settled (e.g. during CUDA-graph capture),
    nothing is kept: the next call decides again."""
    from fusion_backend import impl_choice

    monkeypatch.setenv(ce.CONV_IMPL_ENV, "auto")
    monkeypatch.setenv(impl_choice.MEASURE_ENV, "1")
    monkeypatch.setattr(ce.forward, "conv_impl", lambda *a: ("triton", None))  # as on CUDA
    monkeypatch.setattr(impl_choice, "choose", lambda *a, **k: "library")  # unsettled: nothing kept
    monkeypatch.setattr(impl_choice, "is_final", lambda key: False)
    (x, w, b, m), config = _convt3d_pipeline_op()
    with torch.no_grad():
        for _ in range(2):
            out = ce.conv_epilogue(x, w, b, [m], config)
            torch.testing.assert_close(out, ce.conv_epilogue_eager(x, w, b, [m], config), rtol=1e-5, atol=1e-5)
    assert planned["forward"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_operand_matrix_is_build_params(dtype):
    """``OperandMatrix.build`` gives ``build_params``'s matrix for a mix of constants, per-channel
    and one-value tensors (converted to fp32), rows before and after the tensor rows."""
    c = 5
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(c, generator=g).to(DEVICE, dtype)
    per_channel = torch.randn(c, 1, 1, generator=g).to(DEVICE, dtype)
    one_value = torch.randn((), generator=g).to(DEVICE, dtype)
    steps = [(PK.LEAKY_RELU.code, [0.1]), (PK.MUL.code, [per_channel]), (PK.CLAMP.code, [-0.5, 0.7]),
             (PK.ADD.code, [one_value])]  # fmt: skip
    want = kernels.build_params(steps, bias, c, torch.device(DEVICE))
    layout = kernels.OperandMatrix(steps, bias, c, torch.device(DEVICE))
    got = layout.build([bias, per_channel, one_value])
    assert got.dtype == torch.float32 and got.shape == (kernels.NUM_PARAM_ROWS, c) and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(got[kernels.BIAS_ROW], bias.float())
    assert torch.equal(got[1 + 2 * 1], per_channel.float().reshape(c))
    assert torch.equal(got[1 + 2 * 3], one_value.float().expand(c))
    assert got[1 + 2 * 2].eq(-0.5).all() and got[2 + 2 * 2].eq(0.7).all()
    constants_only = kernels.OperandMatrix(steps[:1], None, c, torch.device(DEVICE))
    assert constants_only.build([]) is constants_only.base, "no tensor rows: the cached matrix itself"


def test_a_bias_and_constant_operands_build_nothing_per_call():
    """The kernels read the bias through its own pointer, so a chain without tensor operands gets
    the cached constant matrix and the caller's bias tensor itself: nothing is built per call.  A
    bias view that is not one contiguous run is copied; tensor operands still go into ``P``."""
    spec = ConvSpec(False, (1, 1), (0, 0), (1, 1), (0, 0), 1)
    device = torch.device(DEVICE)
    bias = torch.randn(5, device=DEVICE)

    def plan(chain, operands, b):
        cfg = ConvEpilogueConfig(conv=spec, chain=tuple(chain), pool=None, strict=True)
        return ce.forward.PlannedOperands(cfg, chain_lowering.kernel_steps(cfg.chain, operands, 4, 5), b, 5, device)

    constants = plan([ChainStep(PK.LEAKY_RELU, (Const(0.1),)), ChainStep(PK.GELU, ())], [], bias)
    params, got_bias = constants(bias, [])
    assert got_bias is bias and params is constants.matrix.base
    assert params[kernels.BIAS_ROW].eq(0).all() and params[1].eq(0.1).all()
    strided = torch.randn(10, device=DEVICE)[::2]
    copied = plan([ChainStep(PK.GELU, ())], [], strided)(strided, [])[1]
    assert copied.is_contiguous() and torch.equal(copied, strided)
    m = torch.randn(5, 1, 1, device=DEVICE)
    params, got_bias = plan([ChainStep(PK.MUL, (TensorRef(0),))], [m], bias)(bias, [m])
    assert got_bias is bias and torch.equal(params[1], m.reshape(5)) and params[kernels.BIAS_ROW].eq(0).all()
