"""conv_batch_norm end to end: torch.compile(backend="fusion") over three training steps against eager
(output, every gradient, running statistics, num_batches_tracked), through Inductor (nn.BatchNorm's
``num_batches_tracked += 1`` keeps the graph there) and the direct runner (F.batch_norm alone), with
the reference and the interpreted kernels, with and without a pool ending the region (the ResNet stem); a train -> eval -> train switch; ``momentum=None``; the
region timing's copies of the running statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from train_parity import train_steps as parity_steps

from fusion_backend.report import collect_reports

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.usefixtures("exact_fp32"),
]


class ConvBnRelu(nn.Module):
    def __init__(self, **bn) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, **bn)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))) * 2.0


class FunctionalBn(nn.Module):
    """F.batch_norm with the module's own buffers: no num_batches_tracked, so the graph runs directly."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3)
        self.register_buffer("rm", torch.zeros(4))
        self.register_buffer("rv", torch.ones(4))
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        return F.silu(F.batch_norm(self.conv(x), self.rm, self.rv, self.gamma, None, True, 0.3, 1e-3))


class ResNetStem(nn.Module):
    """ResNet's stem in training at a small size: Conv2d k7 s2 p3 (no bias), BatchNorm2d, ReLU,
    MaxPool2d(3, 2, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x):
        return self.pool(F.relu(self.bn(self.conv(x))))


class FunctionalBnAvgPool(FunctionalBn):
    """``FunctionalBn`` followed by an avg pool (ceil_mode, padding not counted): runs directly."""

    def forward(self, x):
        return F.avg_pool1d(super().forward(x), 3, 2, 1, ceil_mode=True, count_include_pad=False)


def train_steps(model, shape, steps=3, device="cpu"):
    """``steps`` training steps of one input shape on ``device``, the compiled model against an eager copy
    (``train_parity.train_steps``); the conv bias's gradient is zero up to rounding (the norm removes
    any shift), compared to 1e-4."""
    return parity_steps(model, [shape] * steps, device, grad_atol={"conv.bias": 1e-4})


@pytest.mark.parametrize("bn", [{}, {"affine": False, "momentum": 0.5}, {"track_running_stats": False}],
                         ids=["default", "no affine, momentum 0.5", "no running statistics"])  # fmt: skip
def test_three_training_steps_match_eager_through_inductor(bn, kernels, kernel_device) -> None:
    model = ConvBnRelu(**bn).train()
    _, eager, reports = train_steps(model, (2, 3, 5, 6), device=kernel_device)
    assert [r.counts().get("conv_batch_norm") for r in reports][:1] == [1]
    if "track_running_stats" not in bn:
        assert model.bn.num_batches_tracked.item() == eager.bn.num_batches_tracked.item() == 3
        assert reports[0].runner == "inductor"


def test_three_training_steps_match_eager_run_directly(kernels, kernel_device) -> None:
    model = FunctionalBn()
    _, _, reports = train_steps(model, (2, 3, 9), device=kernel_device)
    assert reports[0].counts() == {"conv_batch_norm": 1} and reports[0].runner == "direct"
    assert reports[0].matches[0].kernel.startswith("triton" if kernels != "reference" else "reference")


def test_resnet_stem_three_training_steps_match_eager(kernels, kernel_device) -> None:
    """The pooled region through Inductor: output, gradients, running statistics and
    num_batches_tracked after each step, odd input sizes (partial windows at the edges)."""
    model = ResNetStem().train()
    _, eager, reports = train_steps(model, (2, 3, 19, 21), device=kernel_device)
    assert reports[0].counts() == {"conv_batch_norm": 1} and reports[0].runner == "inductor"
    assert reports[0].matches[0].summary == "conv2d -> batch_norm(train) -> relu -> max_pool2d"
    assert model.bn.num_batches_tracked.item() == eager.bn.num_batches_tracked.item() == 3


def test_avg_pool_three_training_steps_run_directly(kernels, kernel_device) -> None:
    _, _, reports = train_steps(FunctionalBnAvgPool(), (2, 3, 12), device=kernel_device)
    assert reports[0].counts() == {"conv_batch_norm": 1} and reports[0].runner == "direct"
    assert reports[0].matches[0].summary.endswith("silu -> avg_pool1d")


def test_train_eval_train_switch(kernels, kernel_device) -> None:
    model = ConvBnRelu().train()
    compiled, eager, _ = train_steps(model, (2, 3, 5, 6), steps=2, device=kernel_device)
    model.eval(), eager.eval()
    x = torch.randn(2, 3, 5, 6, device=kernel_device)
    with collect_reports() as reports:
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-6)  # the running statistics
    assert reports[0].counts() == {"conv_epilogue": 1}  # eval mode: folded
    model.train(), eager.train()
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean, rtol=1e-5, atol=1e-6)
    assert model.bn.num_batches_tracked.item() == eager.bn.num_batches_tracked.item() == 3


def test_momentum_none_follows_eager_across_its_graph_break() -> None:
    """Dynamo breaks the graph at ``float(num_batches_tracked)``: the norm runs eagerly, the running
    averages stay cumulative and exact."""
    model = ConvBnRelu(momentum=None).train()
    _, eager, _ = train_steps(model, (2, 3, 5, 6))
    assert model.bn.num_batches_tracked.item() == 3


class BnReluConv(nn.Module):
    """``batch_norm_conv``'s region: the conv reads the training norm's activation."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(F.relu(self.bn(x)))


@pytest.mark.parametrize("pattern, model", [("conv_batch_norm", ConvBnRelu), ("batch_norm_conv", BnReluConv)])
def test_region_timing_updates_copies_of_the_running_statistics(pattern, model) -> None:
    """Timing a region many times (the decision) must not move the model's own running statistics,
    whichever family's region holds the training norm."""
    from fusion_backend.match.engine import find_regions
    from fusion_backend.runtime.region_timing import extract_region, region_inputs

    seen = {}

    def backend(gm, example_inputs):
        (_, candidate), = find_regions(gm, [pattern]).accepted
        region = extract_region(gm, candidate.nodes)
        inputs = region_inputs(region, gm, example_inputs)
        seen["copies"] = [n.name for n, t in zip(region.inputs, inputs, strict=True) if t.data_ptr() not in
                          {e.data_ptr() for e in example_inputs}]  # fmt: skip
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model().train(), backend=backend)(torch.randn(2, 3, 5, 6))
    assert sorted(seen["copies"]) == ["l_self_modules_bn_buffers_running_mean_", "l_self_modules_bn_buffers_running_var_"]
