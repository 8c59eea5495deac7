"""A squeeze-and-excitation gate in ``fusion::conv_epilogue``: ``bn(conv(h * gate))``, EfficientNet's
projection conv reading its block's gated features (``gate``: one value per sample and channel).

Without gradients the region takes the product in: the conv family's forward multiplies ``h`` by the
gate as it loads it (its prologue), so the gated tensor is never written
(``ConvEpilogueConfig.gate``).  The op itself also takes a gate with gradients, running plain torch
on the device.  Checked against float64 with eager's own error as the yardstick.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.errors import UnsupportedInputError
from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.chain import ChainStep, PointwiseKind, TensorRef
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.testing import assert_fused, dry_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class SqueezeExciteProject(nn.Module):
    """torchvision's ``SqueezeExcitation`` then the projection conv and its BatchNorm (an MBConv block's tail)."""

    def __init__(self, channels: int, squeezed: int, out: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)
        self.project = nn.Conv2d(channels, out, 1, bias=False)
        self.bn = nn.BatchNorm2d(out)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, h):
        scale = torch.sigmoid(self.fc2(F.silu(self.fc1(F.adaptive_avg_pool2d(h, 1)))))
        return self.bn(self.project(scale * h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_projection_conv_applies_the_gate_as_it_loads(family_forward, dtype):
    torch.manual_seed(21)
    model = SqueezeExciteProject(8, 4, 6).eval().requires_grad_(False).to(DEVICE).to(memory_format=torch.channels_last)
    h = torch.randn(3, 8, 7, 5, device=DEVICE).to(memory_format=torch.channels_last)
    reports = assert_fused(model, [h], expect={"conv_epilogue": 3}, train=False, dtype=dtype)
    gated = [m for r in reports for m in r.matches if m.summary.startswith("mul(gate)")]
    assert len(gated) == 1 and gated[0].summary == "mul(gate) -> conv2d -> batch_norm (folded)"
    assert ConvEpilogueConfig.from_json(gated[0].config).gate is not None
    (launch,) = [c for c in family_forward if c.get("prologue") is not None]
    assert tuple(launch["prologue"].gate.shape) == (3, 8) and launch["scale"] is not None


def test_with_gradients_flowing_the_gate_stays_outside_the_region():
    torch.manual_seed(22)
    model = SqueezeExciteProject(8, 4, 6)
    model.bn.eval()
    found = dry_run(model, [torch.randn(2, 8, 5, 5, requires_grad=True)], patterns=["conv_epilogue"])
    summaries = [summary for _, summary, _ in found.regions]
    assert "conv2d -> batch_norm (folded)" in summaries and not any(s.startswith("mul(gate)") for s in summaries)


def _spec() -> ConvSpec:
    return ConvSpec(transposed=False, stride=(2, 2), padding=(1, 1), dilation=(1, 1), output_padding=(0, 0), groups=2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_the_op_s_gate_gradient_is_the_conv_input_s_gradient_summed_with_x(monkeypatch, exact_fp32, fresh_plans,
                                                                            dtype):  # fmt: skip
    """The op with a gate and gradients (its Triton-path plans run plain torch on the device): every
    gradient, the gate's included, against autograd through the eager composite."""
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    torch.manual_seed(23)
    cfg = ConvEpilogueConfig(conv=_spec(), chain=(ChainStep(PointwiseKind.MUL, (TensorRef(0),)),
                                                  ChainStep(PointwiseKind.SILU)), gate=1)
    x, w, b = (torch.randn(s, device=DEVICE, dtype=dtype) for s in ((2, 4, 7, 6), (6, 2, 3, 3), (6,)))
    m, g = torch.randn(6, 1, 1, device=DEVICE, dtype=dtype), torch.rand(2, 4, 1, 1, device=DEVICE, dtype=dtype)
    leaves = [t.requires_grad_() for t in (x, w, b, m, g)]
    got = ce.conv_epilogue(x, w, b, [m, g], cfg.to_json())
    want = ce.conv_epilogue_eager(x, w, b, [m, g], cfg.to_json())
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(got)
    for a, e in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad), strict=True):
        torch.testing.assert_close(a, e)


def test_a_gate_of_the_wrong_shape_is_one_clear_error():
    cfg = ConvEpilogueConfig(conv=_spec(), chain=(ChainStep(PointwiseKind.RELU),), gate=0)
    x, w = torch.randn(2, 4, 7, 6), torch.randn(6, 2, 3, 3)
    with pytest.raises(UnsupportedInputError, match=r"the gate operands\[0\] must be \(2, 4, 1, 1\)"):
        ce.conv_epilogue(x, w, None, [torch.rand(1, 4, 1, 1)], cfg.to_json())
    with pytest.raises(ValueError, match="no chain step reads it"):
        ConvEpilogueConfig(conv=_spec(), chain=(ChainStep(PointwiseKind.MUL, (TensorRef(0),)),), gate=0)
