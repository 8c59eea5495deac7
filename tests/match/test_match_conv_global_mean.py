"""Matching of the conv_global_mean family: every spelling of the global mean, and the rejections."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.testing import assert_not_fused, dry_run


class Head(nn.Module):
    def __init__(self, body, conv=None):
        super().__init__()
        self.conv = conv or nn.ConvTranspose2d(3, 4, 3)
        self.b = nn.Parameter(torch.randn(4, 1, 1))
        self.s = nn.Parameter(torch.randn(()))
        self.body = body

    def forward(self, x):
        return self.body(self, self.conv(x))


X = (torch.rand(2, 3, 6, 6),)  # ConvTranspose2d(k3) output: (2, 4, 8, 8), 64 positions


def summary(model, inputs=X, **kw):
    result = dry_run(model, inputs, **kw)
    return [r[1] for r in result.regions if r[0] == "conv_global_mean"], result


SPELLINGS = {
    "torch.mean keepdim": (lambda s, y: torch.mean(y, dim=(2, 3), keepdim=True), "global_mean"),
    "x.mean negative dims": (lambda s, y: y.mean((-1, -2)), "global_mean"),
    "x.mean list kw": (lambda s, y: y.mean(dim=[2, 3]), "global_mean"),
    "adaptive_avg_pool2d": (lambda s, y: F.adaptive_avg_pool2d(y, 1), "global_mean"),
    "nn.AdaptiveAvgPool2d": (lambda s, y: nn.AdaptiveAvgPool2d((1, 1))(y), "global_mean"),
    "mean of mean": (lambda s, y: y.mean(2).mean(2), "global_mean(mean+mean)"),
    "mean of mean partial keepdim": (lambda s, y: y.mean(2, keepdim=True).mean(-1), "global_mean(mean+mean)"),
    "sum / n": (lambda s, y: y.sum((2, 3)) / 64, "global_mean(sum)"),
    "sum * (1/n)": (lambda s, y: y.sum(dim=(2, 3), keepdim=True) * (1 / 64), "global_mean(sum)"),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_spelling_of_the_global_mean_fuses(name):
    body, label = SPELLINGS[name]
    fused, _ = summary(Head(body))
    assert fused == [f"conv_transpose2d -> {label}"]


def test_global_mean_pipeline_fuses_its_conv_and_mean_and_leaves_the_tail(seed_models):
    model, inputs = seed_models("convt2d_global_mean_bias_logsumexp_small", shrink=True)
    for dynamic in (False, True):
        fused, result = summary(model, inputs, dynamic=dynamic)
        assert fused == ["conv_transpose2d -> global_mean"]
        assert result.near_misses == ()  # conv_epilogue says nothing about a conv fused better


def test_per_channel_affine_ops_before_the_mean_are_folded():
    fused, _ = summary(Head(lambda s, y: ((s.b * y + 1.5) / s.s - s.b).mean((2, 3))))
    assert fused == ["conv_transpose2d -> mul -> add -> div -> sub -> global_mean"]


@pytest.mark.parametrize(
    "conv,shape,label",
    [
        (nn.Conv1d(3, 4, 3, stride=2, padding=1), (2, 3, 9), "conv1d"),
        (nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), (1, 4, 9, 9), "conv2d"),
        (nn.ConvTranspose3d(2, 4, 3, stride=2, padding=1, output_padding=1, bias=False), (1, 2, 3, 4, 4), "conv_transpose3d"),
    ],
)
def test_every_conv_kind_anchors_a_global_mean(conv, shape, label):
    d = len(shape) - 2
    fused, _ = summary(Head(lambda s, y: y.mean(tuple(range(2, 2 + d))), conv=conv), (torch.rand(shape),))
    assert fused == [f"{label} -> global_mean"]


def test_a_nonlinear_op_before_the_mean_goes_to_conv_epilogue_with_a_reason():
    fused, result = summary(Head(lambda s, y: F.relu(y).mean((2, 3))))
    assert fused == []
    assert [r[1] for r in result.regions] == ["conv_transpose2d -> relu"]
    (miss,) = [n for n in result.near_misses if n.pattern == "conv_global_mean"]
    assert miss.reason.value == "unsupported_op" and "not a per-channel affine op" in miss.message


@pytest.mark.parametrize(
    "body,reason",
    [
        (lambda s, y: y.mean(2), "dimension_mismatch"),  # not every spatial dim
        (lambda s, y: y.mean((1, 2, 3)), "dimension_mismatch"),  # channels too
        (lambda s, y: y.sum((2, 3)) / 10, "unsupported_op"),  # wrong divisor
        (lambda s, y: y.sum((2, 3)), "unsupported_op"),  # a plain sum
        (lambda s, y: (y * torch.ones(8, device=y.device)).mean((2, 3)), "unsupported_operand"),
        (lambda s, y: y.mean((2, 3)) + y.amax(), "shared_intermediate"),
    ],
    ids=["partial", "channels", "wrong-divisor", "plain-sum", "spatial-operand", "shared"],
)
def test_rejections_carry_their_reason(body, reason):
    assert_not_fused(Head(body), X, "conv_global_mean", reason=reason)


def test_a_step_reading_the_regions_own_one_element_value_is_refused_and_the_conv_epilogue_takes_it():
    """A conv output of one element (1 channel, 1x1) passes the one-element operand rule: ``y + y``
    before the mean must still not take ``y`` as an operand from outside (the rewrite would erase the
    node the fused op reads); conv_epilogue fuses ``conv -> add(y)`` instead, reading the value again."""
    head = Head(lambda s, y: (y + y).mean((2, 3)), conv=nn.Conv2d(3, 1, 3, stride=2))
    fused, result = summary(head, (torch.rand(1, 3, 3, 3),))
    assert fused == [] and [r[1] for r in result.regions] == ["conv2d -> add(conv2d)"], result.regions
    (miss,) = [n for n in result.near_misses if n.pattern == "conv_global_mean"]
    assert miss.reason.value == "unsupported_operand" and "the region's own value" in miss.message


def test_convs_without_any_reduction_are_not_near_misses_of_this_family():
    _, result = summary(Head(lambda s, y: torch.softmax(y, 1)))
    assert [n for n in result.near_misses if n.pattern == "conv_global_mean"] == []
