"""``fusion::conv_epilogue``'s cuDNN fused forward (``CudnnFusedForward``): an inference conv, its folded
eval BatchNorm (a per-channel ``mul`` and ``add``), an optional residual ``add`` and ``relu``, as one
``torch.cudnn_convolution_relu`` / ``cudnn_convolution_add_relu`` with the norm folded into the weight
and bias.  On CPU the plan runs the same folded arithmetic in torch ops; the candidates offer it on CUDA
alone.  Against float64 with eager's own error as the yardstick (``compare``)."""

from __future__ import annotations

import pytest
import torch

from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.ops.chain import ChainStep, PointwiseKind, TensorRef
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.ops.conv_epilogue.forward import CudnnFusedForward, cudnn_fused_unsupported
from fusion_backend.ops.conv_epilogue.reference import forward as reference_forward
from fusion_backend.testing import compare

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MUL0, ADD1 = ChainStep(PointwiseKind.MUL, (TensorRef(0),)), ChainStep(PointwiseKind.ADD, (TensorRef(1),))
RELU = ChainStep(PointwiseKind.RELU)
RESIDUAL = ChainStep(PointwiseKind.ADD, (TensorRef(2),))


def _spec(dims: int, padding: int = 1, stride: int = 1, groups: int = 1) -> ConvSpec:
    return ConvSpec(False, (stride,) * dims, (padding,) * dims, (1,) * dims, (0,) * dims, groups)


def _case(dims: int, chain: tuple, residual: bool, bias: bool, dtype: torch.dtype, groups: int = 1):  # noqa: ANN202
    g = torch.Generator().manual_seed(len(chain) * 7 + dims + residual)
    spatial = (6, 5) if dims == 2 else (4, 3, 5)
    fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
    x = torch.randn(2, 8, *spatial, generator=g).to(DEVICE, dtype).contiguous(memory_format=fmt)
    w = (torch.randn(6, 8 // groups, *([3] * dims), generator=g) * 0.3).to(DEVICE, dtype).contiguous(memory_format=fmt)
    b = torch.randn(6, generator=g).to(DEVICE, dtype) if bias else None
    scale = (torch.rand(6, generator=g) + 0.5).to(DEVICE).view(1, 6, *([1] * dims))
    shift = torch.randn(6, generator=g).to(DEVICE).view(1, 6, *([1] * dims))
    operands = [scale, shift]
    if residual:
        operands.append(torch.randn(2, 6, *spatial, generator=g).to(DEVICE, dtype).contiguous(memory_format=fmt))
    cfg = ConvEpilogueConfig(conv=_spec(dims, groups=groups), chain=chain, residual=2 if residual else None)
    return x, w, b, operands, cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("dims,chain,residual,bias,groups", [
    (2, (MUL0, ADD1, RELU), False, False, 1),
    (2, (MUL0, ADD1, RELU), False, True, 2),
    (2, (ADD1, RELU), False, True, 1),
    (2, (RELU,), False, True, 1),
    (2, (MUL0, ADD1, RESIDUAL, RELU), True, False, 1),
    (3, (MUL0, ADD1, RELU), False, True, 1),
], ids=["bn-relu", "bias-bn-relu-groups2", "shift-relu", "relu", "bn-residual-relu", "3d-bias-bn-relu"])  # fmt: skip
def test_the_folded_conv_matches_float64_with_eagers_error(dims, chain, residual, bias, groups, dtype):
    """The norm folded into the weight and the bias gives what the region computes: every output against
    float64, eager's own error (the reference's) as the yardstick; the output laid out as the op's."""
    x, w, b, operands, cfg = _case(dims, chain, residual, bias, dtype, groups)
    assert cudnn_fused_unsupported(x, w, operands, cfg, False) is None
    out, saved, winner = CudnnFusedForward(x, w, b, operands, cfg, False)(x, w, b, operands)
    eager = reference_forward(x, w, b, operands, cfg, False)[0]
    double = [t.double() for t in operands]
    truth = reference_forward(x.double(), w.double(), None if b is None else b.double(), double,
                              ConvEpilogueConfig(conv=cfg.conv, chain=cfg.chain, residual=cfg.residual), False)[0]
    why = compare("cudnn fused", out, eager, reference=truth.to(out.device))
    assert why is None, why
    assert out.stride() == eager.stride() and saved.numel() == 0 and winner.numel() == 0


@pytest.mark.parametrize("why,kw", [
    ("saves", dict(save=True)),
    ("a pool", dict(pool=PoolSpec("max", (2, 2), (2, 2), (0, 0), (1, 1), False))),
    ("a chain other", dict(chain=(MUL0, ADD1))),
    ("a chain other", dict(chain=(ADD1, MUL0, RELU))),
    ("1-d", dict(dims=1)),
], ids=["training", "pool", "no-relu", "shift-before-scale", "1d"])  # fmt: skip
def test_calls_it_cannot_serve_say_why(why, kw):
    """Training calls (the backward needs the conv's output), pools, other chains and 1-d convs keep the
    library path: ``cudnn_fused_unsupported`` names the reason."""
    dims = kw.pop("dims", 2)
    save = kw.pop("save", False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, *([6] * dims), generator=g)
    w = torch.randn(6, 4, *([3] * dims), generator=g)
    operands = [torch.rand(1, 6, *([1] * dims)), torch.randn(1, 6, *([1] * dims))]
    cfg = ConvEpilogueConfig(conv=_spec(dims), chain=kw.pop("chain", (MUL0, ADD1, RELU)), **kw)
    reason = cudnn_fused_unsupported(x, w, operands, cfg, save)
    assert reason is not None and why in reason, reason


@pytest.mark.parametrize("weight_layout", ["contiguous", "channels-last"])
def test_a_weight_in_another_layout_than_x_folds_into_xs_and_the_plan_is_reused(weight_layout, monkeypatch):
    """A channels-last x with a contiguous weight (a model converted by hand) folds into a channels-last
    weight, as cuDNN's channels-last conv wants; the plan, kept per signature, gives the same bits on a
    second call, and follows new values of the norm's scale and shift (the fold runs every call).  fp32
    without TF32: both paths exact enough for a tight tolerance."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    x, w, b, operands, cfg = _case(2, (MUL0, ADD1, RELU), False, True, torch.float32)
    if weight_layout == "contiguous":
        w = w.contiguous()
    plan = CudnnFusedForward(x, w, b, operands, cfg, False)
    out = plan(x, w, b, operands)[0]
    assert torch.equal(plan(x, w, b, operands)[0], out)
    eager = reference_forward(x, w, b, operands, cfg, False)[0]
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    changed = [operands[0] * 2, operands[1] - 1]
    torch.testing.assert_close(plan(x, w, b, changed)[0], reference_forward(x, w, b, changed, cfg, False)[0],
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_a_residual_region_is_timed_against_the_library_pass_and_on_cuda_the_fused_conv(monkeypatch):
    """A ResNet block's tail (folded BatchNorm, residual add, ReLU) without a backward: its candidates
    are the library conv with the residual added in the epilogue pass, the conv family's forward and,
    on CUDA, cuDNN's fused conv + add + ReLU."""
    from fusion_backend.ops.conv_epilogue import forward as fwd

    x, w, b, operands, cfg = _case(2, (MUL0, ADD1, RESIDUAL, RELU), True, False, torch.float32)
    timed = {}
    monkeypatch.setattr(fwd, "_measured_forward", lambda plans, *a, **k: timed.update(plans) or (plans["library"], True))
    monkeypatch.setattr(fwd, "_times_library_layouts", lambda x: True)
    fwd._family_or_reference_plan(x, w, b, operands, cfg, False, "auto")
    assert isinstance(timed["library"], fwd.LibraryForward) and "family" in timed
    assert ("cudnn-fused" in timed) == (DEVICE == "cuda")
