"""Matching of the conv_group_norm family: every spelling of a group / instance norm after a conv, the
chains around it, its priority against conv_epilogue, and every near-miss reason."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.testing import dry_run

FAMILY = "conv_group_norm"


class Block(nn.Module):
    """``body(self, conv(x))`` with a norm weight ``w`` and bias ``b`` (6 channels), a per-channel
    parameter ``p`` and a scalar ``s`` at hand."""

    def __init__(self, body, conv=None, norm=None):
        super().__init__()
        self.conv = conv or nn.Conv2d(3, 6, 3)
        self.norm = norm
        self.w = nn.Parameter(torch.rand(6) + 0.5)
        self.b = nn.Parameter(torch.randn(6))
        self.p = nn.Parameter(torch.randn(1, 6, 1, 1))
        self.s = nn.Parameter(torch.randn(()))
        self.body = body

    def forward(self, x):
        return self.body(self, self.conv(x))


X = (torch.rand(2, 3, 7, 7),)


def found(model, inputs=X, **kw):
    result = dry_run(model, inputs, **kw)
    return [r[1] for r in result.regions], result


def misses_of(result, pattern=FAMILY):
    return [(m.reason.value, m.message) for m in result.near_misses if m.pattern == pattern]


SPELLINGS = {
    "nn.GroupNorm": (nn.GroupNorm(3, 6), lambda s, y: s.norm(y), "group_norm(3)"),
    "nn.GroupNorm affine=False": (nn.GroupNorm(2, 6, affine=False), lambda s, y: s.norm(y), "group_norm(2)"),
    "F.group_norm positional": (None, lambda s, y: F.group_norm(y, 2, s.w, s.b, 1e-3), "group_norm(2)"),
    "F.group_norm keywords": (None, lambda s, y: F.group_norm(y, num_groups=6, weight=s.w, eps=1e-4), "group_norm(6)"),
    "torch.group_norm": (None, lambda s, y: torch.group_norm(y, 1, s.w, s.b), "group_norm(1)"),
    "nn.InstanceNorm2d": (nn.InstanceNorm2d(6), lambda s, y: s.norm(y), "instance_norm"),
    "nn.InstanceNorm2d affine": (nn.InstanceNorm2d(6, affine=True), lambda s, y: s.norm(y), "instance_norm"),
    "F.instance_norm": (None, lambda s, y: F.instance_norm(y, weight=s.w, bias=s.b, use_input_stats=True, eps=1e-3),
                        "instance_norm"),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_spelling_of_a_group_or_instance_norm_fuses(name):
    norm, body, label = SPELLINGS[name]
    regions, result = found(Block(body, norm=norm))
    assert regions == [f"conv2d -> {label}"]
    assert misses_of(result) == [] and misses_of(result, "conv_epilogue") == []


def test_chains_before_and_after_the_norm_dag_ones_included_join_the_region():
    def body(s, y):
        v = F.leaky_relu(y * s.p, 0.1)
        z = F.group_norm(v, 3, s.w, s.b)
        z = z + torch.tanh(z)  # a DAG step: reads z twice
        return F.silu(z * s.s) + s.p

    regions, result = found(Block(body))
    assert regions == ["conv2d -> mul -> leaky_relu -> group_norm(3) -> tanh -> add(z) -> mul -> silu -> add"]
    assert result.near_misses == ()


@pytest.mark.parametrize("conv, x, label", [
    (nn.Conv1d(3, 6, 3), (2, 3, 9), "conv1d"),
    (nn.Conv3d(3, 6, 3), (1, 3, 4, 5, 5), "conv3d"),
    (nn.ConvTranspose2d(3, 6, 4, stride=2, padding=1), (2, 3, 4, 4), "conv_transpose2d"),
])  # fmt: skip
def test_every_conv_kind_anchors_the_region(conv, x, label):
    regions, _ = found(Block(lambda s, y: F.silu(F.group_norm(y, 2, s.w, s.b)), conv=conv), (torch.rand(*x),))
    assert regions == [f"{label} -> group_norm(2) -> silu"]


def test_the_bench_demo_and_the_conv_epilogue_priority(demo_model):
    """conv_epilogue would take ``conv -> relu`` and leave the norm to Inductor: this family comes first."""
    model = demo_model("families", "convt2d_64_32_k4_s2_groupnorm_silu")
    regions, result = found(model, (torch.randn(2, 64, 6, 6),))
    assert regions == ["conv_transpose2d -> group_norm(8) -> silu"]
    assert result.near_misses == ()
    regions, result = found(Block(lambda s, y: F.group_norm(torch.relu(y), 2)))
    assert regions == ["conv2d -> relu -> group_norm(2)"]


def test_near_misses_name_their_reason():
    cases = {
        "running statistics": (Block(lambda s, y: s.norm(y), norm=nn.InstanceNorm2d(6, track_running_stats=True)),
                               "unsupported_argument", "running statistics"),
        "conv output read elsewhere": (Block(lambda s, y: F.group_norm(y, 2) + y.mean()), "shared_intermediate",
                                       "read again outside the chain"),
        "pre-chain value read elsewhere": (Block(lambda s, y: (F.group_norm(torch.relu(y), 2), torch.relu(y) * 2)),
                                           "shared_intermediate", "is used by"),
        "weight computed from the conv output": (Block(lambda s, y: F.group_norm(y, 2, y.mean((0, 2, 3)))),
                                                 "shared_intermediate", "is used by"),
        "a non-pointwise op before the norm": (Block(lambda s, y: F.group_norm(F.max_pool2d(y, 1), 2)), None, None),
    }
    for name, (model, reason, words) in cases.items():
        regions, result = found(model)
        assert not any(r.startswith("conv2d ->") and "norm" in r for r in regions), name
        if reason is None:
            continue
        misses = misses_of(result)
        assert misses and misses[0][0] == reason, (name, misses)
        if words is not None:
            assert words in misses[0][1], (name, misses)


@pytest.mark.parametrize("conv, x, pool, label", [
    (None, (2, 3, 9, 9), lambda z: F.max_pool2d(z, 3, 2, 1, ceil_mode=True), "conv2d -> group_norm(2) -> silu -> max_pool2d"),
    (nn.Conv1d(3, 6, 3), (2, 3, 11), lambda z: F.avg_pool1d(z, 2), "conv1d -> group_norm(2) -> silu -> avg_pool1d"),
    (nn.Conv3d(3, 6, 3), (1, 3, 5, 6, 6), lambda z: nn.MaxPool3d(2)(z), "conv3d -> group_norm(2) -> silu -> max_pool3d"),
])  # fmt: skip
def test_a_max_or_avg_pool_after_the_chain_ends_the_region(conv, x, pool, label):
    regions, result = found(Block(lambda s, y: pool(F.silu(F.group_norm(y, 2, s.w, s.b))), conv=conv), (torch.rand(*x),))
    assert regions == [label] and misses_of(result) == []


def test_a_pool_that_cannot_end_the_region_is_left_out_with_its_reason():
    cases = {
        "the pooled value returned too": (lambda s, y: (lambda z: (F.avg_pool2d(z, 2), z))(F.silu(s.norm(y))),
                                          "shared_intermediate", "a pool whose input is read elsewhere"),
        "return_indices": (lambda s, y: F.max_pool2d(F.silu(s.norm(y)), 2, return_indices=True)[0],
                           "unsupported_argument", "return_indices=True"),
        "an adaptive max pool": (lambda s, y: F.adaptive_max_pool2d(F.silu(s.norm(y)), 3), "unsupported_op",
                                 "is an adaptive pool"),
    }
    for name, (body, reason, words) in cases.items():
        regions, result = found(Block(body, norm=nn.GroupNorm(3, 6)))
        assert regions == ["conv2d -> group_norm(3) -> silu"], (name, regions)
        assert any(r == reason and words in m for r, m in misses_of(result)), (name, misses_of(result))


def test_layer_norm_is_not_this_family_but_conv_layer_norms():
    regions, result = found(Block(lambda s, y: F.layer_norm(y, y.shape[1:])))
    assert regions == ["conv2d -> layer_norm[C, H, W]"] and misses_of(result) == []


def test_channels_the_groups_do_not_divide_are_not_matched():
    """torch rejects such a norm at trace time already: there is nothing to fuse or to report."""
    with pytest.raises(Exception, match="divisible|group"):
        found(Block(lambda s, y: F.group_norm(y, 4)))

