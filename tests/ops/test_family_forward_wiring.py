"""``fusion::conv_epilogue``'s forward on the conv kernel family (``kernels.conv.conv_fprop``).

The family's forward serves the calls of a direct conv without a pool whose output is channels-last:
the conv, the bias and the chain (a folded eval BatchNorm, a multiplier, activations) run in one
kernel, which in training also writes the conv output the backward reads.
``FUSION_CONV_IMPL=family`` forces it (on CPU under the interpreter,
``FUSION_CPU_KERNELS=triton``); under ``auto`` it is one of the measured
candidates.  Every case is checked against float64 with eager's own error as the yardstick
(``assert_fused``), and the family must be what ran.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.errors import UnsupportedInputError
from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.testing import assert_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class ConvBnAct(nn.Module):
    """conv -> BatchNorm (eval: folded into the chain) -> activation, as in ResNet's and EfficientNet's blocks."""

    def __init__(self, conv: nn.Module, act: nn.Module | None) -> None:
        super().__init__()
        self.conv = conv
        bn = (nn.BatchNorm3d if isinstance(conv, nn.Conv3d) else nn.BatchNorm2d)(conv.out_channels)
        with torch.no_grad():  # running statistics and affine parameters away from their initial values
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
        self.bn, self.act = bn, act or nn.Identity()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class ConvMulLeakyGelu(nn.Module):
    """conv (+ bias) -> x per-channel multiplier -> leaky -> GELU (the seeds' chain)."""

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv = conv
        self.multiplier = nn.Parameter(torch.randn(conv.out_channels, 1, 1))

    def forward(self, x):
        return F.gelu(F.leaky_relu(self.conv(x) * self.multiplier, 0.2))


#: name -> (model builder, input shape); every input channels-last
CASES = {
    "k3-bn-relu": (lambda: ConvBnAct(nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.ReLU()), (2, 8, 7, 6)),
    "1x1-s2-bn": (lambda: ConvBnAct(nn.Conv2d(8, 12, 1, stride=2, bias=False), None), (2, 8, 9, 8)),
    "stem-k7-s2-bn-relu": (lambda: ConvBnAct(nn.Conv2d(3, 16, 7, stride=2, padding=3, bias=False), nn.ReLU()),
                           (2, 3, 13, 11)),
    "depthwise-k3-bn-silu": (lambda: ConvBnAct(nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.SiLU()),
                             (2, 16, 6, 5)),
    "groups2-s2-bias-mul-leaky-gelu": (lambda: ConvMulLeakyGelu(nn.Conv2d(8, 12, 3, stride=2, groups=2)),
                                       (2, 8, 9, 7)),
}
if DEVICE == "cuda":  # cuDNN writes channels-last-3d outputs for channels-last-3d inputs; aten's CPU conv3d does not
    CASES["conv3d-bn-relu"] = (lambda: ConvBnAct(nn.Conv3d(4, 8, 3, padding=1, bias=False), nn.ReLU()),
                               (1, 4, 4, 5, 3))


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_inference_regions_run_on_the_family_forward(family_forward, name, dtype):
    build, shape = CASES[name]
    torch.manual_seed(3)
    model = build().eval().requires_grad_(False).to(DEVICE)
    model = model.to(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    x = _channels_last(torch.randn(shape, device=DEVICE))
    assert_fused(model, [x], expect={"conv_epilogue": 1}, train=False, dtype=dtype)
    assert family_forward, "the family's forward did not run"
    for call in family_forward:  # a folded BatchNorm in the kernel's scale and bias, the rest in its chain
        if name.startswith("groups2"):  # a conv bias first: the multiplier stays a chain step
            assert call["scale"] is None and len(call["chain"]) == 3
        else:
            assert call["scale"] is not None and len(call["chain"]) == (0 if name == "1x1-s2-bn" else 1)


#: training regions: (model builder, input shape); the BatchNorm frozen in eval mode (fine-tuning), so
#: that it folds into the region as in inference while every parameter and the input get gradients
TRAINING = {
    "k3-frozen-bn-relu": (lambda: ConvBnAct(nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.ReLU()), (2, 8, 7, 6)),
    "groups2-s2-bias-mul-leaky-gelu": CASES["groups2-s2-bias-mul-leaky-gelu"],
    "depthwise-k3-frozen-bn-silu": CASES["depthwise-k3-bn-silu"],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(TRAINING))
def test_training_regions_run_on_the_family_forward_and_back(family_forward, name, dtype):
    """In training the family's forward also writes the saved conv output, from which the backward
    (the library one) computes every gradient: the input's and each parameter's, against float64."""
    build, shape = TRAINING[name]
    torch.manual_seed(5)
    model = build().to(DEVICE).to(memory_format=torch.channels_last)
    if hasattr(model, "bn"):
        model.bn.eval()
    x = _channels_last(torch.randn(shape, device=DEVICE))
    assert_fused(model, [x], expect={"conv_epilogue": 1}, train=True, dtype=dtype)
    assert family_forward and all(call["saved"] is not None for call in family_forward)


def _call(x, weight, cfg: ConvEpilogueConfig, save=False):
    return ce.forward.family_forward_unsupported(x, weight, [], cfg, save)


def _config(transposed=False, pool=None) -> ConvEpilogueConfig:
    conv = ConvSpec(transposed=transposed, stride=(1, 1), padding=(1, 1), dilation=(1, 1), output_padding=(0, 0),
                    groups=1)  # fmt: skip
    return ConvEpilogueConfig(conv=conv, pool=pool)


def test_the_family_forward_says_why_it_cannot_serve_a_call():
    x = _channels_last(torch.randn(2, 4, 6, 6))
    w = torch.randn(5, 4, 3, 3)
    assert _call(x, w, _config()) is None and _call(x, w, _config(), save=True) is None
    assert "float64 conv" in _call(x.double(), w.double(), _config())
    assert "not channels-last" in _call(torch.randn(2, 4, 6, 6), w, _config())
    if DEVICE == "cpu":
        x3 = torch.randn(1, 4, 4, 5, 3).to(memory_format=torch.channels_last_3d)
        w3 = torch.randn(5, 4, 3, 3, 3).to(memory_format=torch.channels_last_3d)
        conv3 = ConvSpec(transposed=False, stride=(1, 1, 1), padding=(1, 1, 1), dilation=(1, 1, 1),
                         output_padding=(0, 0, 0), groups=1)  # fmt: skip
        assert "not channels-last" in _call(x3, w3, ConvEpilogueConfig(conv=conv3))
    # a 1-d conv has no channels-last format: a reason, not an error (under ``auto`` on CUDA every
    # Conv1d region's forward asks, and an error there sent the op to its reference)
    conv1 = ConvSpec(transposed=False, stride=(1,), padding=(1,), dilation=(1,), output_padding=(0,), groups=1)
    for save in (False, True):
        assert "1-d conv" in _call(torch.randn(2, 4, 9), torch.randn(5, 4, 3), ConvEpilogueConfig(conv=conv1), save)
    assert "family" not in ce.forward.forward_candidates(torch.randn(2, 4, 9), torch.randn(5, 4, 3), None, [],
                                                          ConvEpilogueConfig(conv=conv1), True, fused=False)
    assert "transposed" in _call(x, torch.randn(4, 5, 3, 3), _config(transposed=True))
    assert "pool" in _call(x, w, _config(pool=PoolSpec(kind="max", kernel_size=(2, 2), stride=(2, 2),
                                                       padding=(0, 0))))


def test_forcing_the_family_where_it_cannot_serve_raises_one_clear_error(monkeypatch, fresh_plans):
    monkeypatch.setenv(ce.CONV_IMPL_ENV, "family")
    x, w = torch.randn(2, 4, 6, 6), torch.randn(5, 4, 3, 3)  # NCHW: the output would not be channels-last
    with pytest.raises(UnsupportedInputError, match="FUSION_CONV_IMPL=family but .*not channels-last"):
        ce.forward.plan_for(x, w, None, [], _config(), False)


def test_auto_measures_the_family_among_the_candidates_where_it_serves(fresh_plans):
    x = _channels_last(torch.randn(2, 4, 6, 6))
    w = torch.randn(5, 4, 3, 3).to(memory_format=torch.channels_last)
    cfg = _config()
    assert "family" in ce.forward.forward_candidates(x, w, None, [], cfg, False, fused=False)
    assert "family" in ce.forward.forward_candidates(x, w, None, [], cfg, True, fused=False)
    assert "family" not in ce.forward.forward_candidates(x.contiguous(), w.contiguous(), None, [], cfg, True, fused=False)


def test_the_family_launch_is_planned_once_per_signature_and_not_kept_while_launches_only_compile(
        family_forward, monkeypatch):  # fmt: skip
    """The plan keeps the family's launch from its first call on (no per-call plan key); a launch made
    while launches only compile holds an untimed tile and is asked for again at the next call."""
    from fusion_backend.kernels.conv import fprop

    x = _channels_last(torch.randn(2, 4, 6, 6, device=DEVICE))
    w = torch.randn(5, 4, 3, 3, device=DEVICE).to(memory_format=torch.channels_last)
    plan = ce.forward.FamilyForward(x, w, None, [], _config(), False)
    monkeypatch.setattr(fprop, "compiling_only", lambda: True)
    plan(x, w, None, [])
    assert plan.launch is None and len(family_forward) == 1
    monkeypatch.setattr(fprop, "compiling_only", lambda: False)
    first, _, _ = plan(x, w, None, [])
    again, _, _ = plan(x, w, None, [])
    assert plan.launch is not None and len(family_forward) == 2
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    torch.testing.assert_close(first, ce.reference.forward(x, w, None, [], _config(), False)[0])
