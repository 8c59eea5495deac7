"""Matching of the conv_epilogue family: every conv and pool kind it anchors and takes, and every rejection reason.

These run only the find phase (``dry_run``: Dynamo + our matcher, no rewrite, no Inductor), so each
case costs a Dynamo trace and nothing else.
"""


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from chain_models import X2, Chain, regions

from fusion_backend.testing import assert_not_fused, dry_run

CONVS = {
    "conv1d": (nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2), (2, 3, 16), "conv1d"),
    "conv3d": (nn.Conv3d(3, 4, 3, padding=1, bias=False), (1, 3, 5, 6, 7), "conv3d"),
    "conv2d groups": (nn.Conv2d(4, 6, 3, groups=2, stride=(2, 1)), (1, 4, 9, 9), "conv2d"),
    "conv2d padding valid": (nn.Conv2d(3, 4, 3, padding="valid"), (1, 3, 9, 9), "conv2d"),
    "convT1d": (nn.ConvTranspose1d(3, 4, 3, stride=2, output_padding=1), (2, 3, 8), "conv_transpose1d"),
    "convT2d": (nn.ConvTranspose2d(3, 4, 3, stride=3, padding=1, dilation=2, groups=1), (1, 3, 5, 5), "conv_transpose2d"),
    "convT3d": (nn.ConvTranspose3d(2, 4, 3, 2, 1, 1), (1, 2, 3, 4, 4), "conv_transpose3d"),
}


@pytest.mark.parametrize("name", list(CONVS))
def test_every_conv_kind_anchors_a_chain(name):
    conv, shape, label = CONVS[name]
    model = Chain(lambda s, y: F.relu(y), conv=conv)
    (region,) = regions(model, (torch.rand(shape),))
    assert region[1] == f"{label} -> relu"


@pytest.mark.parametrize("functional", [True, False])
def test_functional_conv_with_keyword_arguments(functional):
    w = torch.randn(4, 3, 3, 3)

    def f(x, w):
        y = F.conv2d(x, w, stride=2, padding=1) if functional else torch.conv2d(input=x, weight=w, padding=(1, 1))
        return torch.sigmoid(y)

    result = dry_run(f, (torch.rand(1, 3, 8, 8), w), patterns=["conv_epilogue"])
    assert [r[1] for r in result.regions] == ["conv2d -> sigmoid"]


POOLS = {
    "nn.MaxPool2d": (lambda s, y: nn.MaxPool2d(2)(F.relu(y)), "max_pool2d"),
    "F.max_pool2d kw": (lambda s, y: F.max_pool2d(F.relu(y), kernel_size=3, stride=2, padding=1, ceil_mode=True), "max_pool2d"),
    "F.avg_pool2d": (lambda s, y: F.avg_pool2d(y * s.m, 2, count_include_pad=False), "avg_pool2d"),
    "nn.AvgPool2d ceil": (lambda s, y: nn.AvgPool2d(3, 2, 1, ceil_mode=True, divisor_override=5)(F.silu(y)), "avg_pool2d"),
    "pool only": (lambda s, y: F.max_pool2d(y, 2), "max_pool2d"),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_a_terminal_pool_joins_the_region(name):
    body, pool = POOLS[name]
    (region,) = regions(Chain(body))
    assert region[1].endswith(pool)


def test_convt3d_pipeline_is_one_region_static_and_dynamic(seed_models):
    model, inputs = seed_models("convt3d_leaky_mul_leaky_maxpool", shrink=True)
    for dynamic in (False, True):
        (region,) = regions(model, inputs, dynamic=dynamic)
        assert region[1] == "conv_transpose3d -> leaky_relu -> mul -> leaky_relu -> max_pool3d"


def test_conv2d_pipeline_is_one_region_with_mark_dynamic(seed_models):
    model, (x,) = seed_models("conv2d_mul_leaky_gelu_small", shrink=True)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 2)
    (region,) = regions(model, (x,))
    assert region[1] == "conv2d -> mul -> leaky_relu -> gelu"


def test_symbolically_traced_graph_with_call_module_nodes_matches():
    from fusion_backend.match.engine import find_regions

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LeakyReLU(0.1), nn.Hardtanh(-1, 2), nn.MaxPool2d(2))
    gm = torch.fx.symbolic_trace(model)
    from fusion_backend.backend import _ensure_fake_values

    _ensure_fake_values(gm, [torch.rand(1, 3, 8, 8)])
    found = find_regions(gm, ["conv_epilogue"])
    assert [c.summary for _, c in found.accepted] == ["conv2d -> leaky_relu -> hardtanh -> max_pool2d"]


# ---------------------------------------------------------------------------------------------
# Rejections: every reason the family records.


def test_two_branches_of_the_conv_output_are_a_near_miss_naming_both_users():
    misses = assert_not_fused(Chain(lambda s, y: F.relu(y) + torch.tanh(y)), X2, "conv_epilogue",
                              reason="shared_intermediate")
    assert "is used by" in misses[0].message and "test_match_conv_epilogue.py" in misses[0].message
    assert "the chain would branch" in misses[0].message


@pytest.mark.parametrize("body, summary", [
    (lambda s, y: F.relu(y) + y, "conv2d -> relu -> add(conv2d)"),
    (lambda s, y: y * torch.sigmoid(2 * y), "conv2d -> mul -> sigmoid -> mul(conv2d)"),
    (lambda s, y: y * y, "conv2d -> mul(conv2d)"),
    (lambda s, y: torch.maximum(torch.tanh(y) * s.m, y) - 1, "conv2d -> tanh -> mul -> maximum(conv2d) -> sub"),
    (lambda s, y: (lambda z: z / (torch.relu(z) + 1))(y * s.m), "conv2d -> mul -> relu -> add -> rdiv(mul)"),
], ids=["residual", "quick-gelu-like", "square", "maximum", "reads-a-later-value"])
def test_a_value_the_chain_computed_may_be_read_again_as_an_operand(body, summary):
    assert [r[1] for r in regions(Chain(body))] == [summary]


def test_a_value_read_again_outside_the_chain_is_where_the_region_ends():
    """``w`` also goes to the graph output: the region cannot end after the tanh that reads it, so it
    ends at ``w`` (its result); ``relu(y)`` alone could not end it, as ``w`` reads ``y`` again."""
    def body(s, y):
        w = F.relu(y) * y
        return torch.tanh(w), w

    result = dry_run(Chain(body), X2, patterns=["conv_epilogue"])
    assert [r[1] for r in result.regions] == ["conv2d -> relu -> mul(conv2d)"]
    (note,) = result.near_misses
    assert note.reason.value == "shared_intermediate" and "read again outside the chain" in note.message
    misses = assert_not_fused(Chain(lambda s, y: (lambda z: (z * y, z))(F.relu(y))), X2, "conv_epilogue",
                              reason="shared_intermediate")
    assert "read again outside the chain" in misses[0].message


def test_a_value_the_conv_output_feeds_outside_the_chain_is_no_operand():
    misses = assert_not_fused(Chain(lambda s, y: torch.relu(y) * torch.amax(y, (0, 2, 3), keepdim=True)), X2,
                              "conv_epilogue", reason="shared_intermediate")
    assert "`conv2d` is read again outside the chain (by `relu`, `amax`)" in misses[0].message


def test_chain_stops_before_a_shared_intermediate_which_is_still_produced():
    def body(s, y):
        z = F.relu(y)
        w = z * s.m
        return torch.softmax(w, 1) + w

    result = dry_run(Chain(body), X2, patterns=["conv_epilogue"])
    assert [r[1] for r in result.regions] == ["conv2d -> relu -> mul"]
    (note,) = result.near_misses
    assert note.reason.value == "shared_intermediate" and note.node == "w"


def test_operand_computed_from_the_chain_stops_it_as_shared():
    assert_not_fused(Chain(lambda s, y: y * y.mean()), X2, "conv_epilogue", reason="shared_intermediate")


def test_unsupported_op_after_conv():
    misses = assert_not_fused(Chain(lambda s, y: torch.cumsum(y, 1)), X2, "conv_epilogue", reason="unsupported_op")
    assert "cumsum" in misses[0].message  # (a softmax is conv_channel_reduce's: tests/match/test_match_conv_channel_reduce.py)


def test_conv_alone_has_no_epilogue():
    assert_not_fused(Chain(lambda s, y: y), X2, "conv_epilogue", reason="no_epilogue")


@pytest.mark.parametrize(
    "body",
    [
        lambda s, y: y * torch.ones(8, device=y.device),  # broadcast along the last dim
        lambda s, y: y * torch.ones(8, 1, device=y.device),  # varies along H, not C
        lambda s, y: y * torch.ones(2, 4, 1, 1),  # batch-dependent operand
    ],
    ids=["last-dim", "rank-2", "per-batch"],
)
def test_operands_that_are_not_scalar_or_per_channel_are_rejected(body):
    assert_not_fused(Chain(body), X2, "conv_epilogue", reason="unsupported_operand")


def test_pool_with_return_indices_or_dilation_is_an_unsupported_argument():
    misses = assert_not_fused(Chain(lambda s, y: F.max_pool2d(y, 2, return_indices=True)[0]), X2, "conv_epilogue",
                              reason="unsupported_argument")
    assert "return_indices" in misses[0].message
    assert_not_fused(Chain(lambda s, y: F.max_pool2d(y, 2, dilation=2)), X2, "conv_epilogue", reason="unsupported_argument")


def test_relu_then_pool_with_return_indices_keeps_the_chain_without_the_pool():
    result = dry_run(Chain(lambda s, y: F.max_pool2d(F.relu(y), 2, return_indices=True)[0]), X2, patterns=["conv_epilogue"])
    assert [r[1] for r in result.regions] == ["conv2d -> relu"]


def test_pool_of_other_dimensionality_is_a_dimension_mismatch():
    model = Chain(lambda s, y: F.max_pool1d(y.flatten(2), 2), conv=nn.Conv2d(3, 4, 3))
    assert_not_fused(model, X2, "conv_epilogue", reason="unsupported_op")
    conv1 = nn.Conv1d(3, 4, 3)
    m1 = Chain(lambda s, y: F.max_pool2d(F.relu(y), 2), conv=conv1)
    result = dry_run(m1, (torch.rand(2, 3, 10),), patterns=["conv_epilogue"])
    assert [r[1] for r in result.regions] == ["conv1d -> relu"]
    assert [n.reason.value for n in result.near_misses] == ["dimension_mismatch"]


def test_integer_conv_is_an_unsupported_dtype():
    from fusion_backend.match.engine import find_regions

    class IntConv(nn.Module):
        def forward(self, x):
            return torch.relu(x)

    # aten has no integer conv on CPU; build the graph by hand and fake an integer conv output.
    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    c = g.call_function(torch.conv2d, (x, w))
    r = g.call_function(torch.relu, (c,))
    g.output(r)
    gm = torch.fx.GraphModule(IntConv(), g)
    for node, val in ((x, torch.empty(1, 3, 5, 5, dtype=torch.int32)), (w, torch.empty(2, 3, 3, 3, dtype=torch.int32)),
                      (c, torch.empty(1, 2, 3, 3, dtype=torch.int32)), (r, torch.empty(1, 2, 3, 3, dtype=torch.int32))):
        node.meta["val"] = val
    found = find_regions(gm, ["conv_epilogue"])
    assert not found.accepted and found.near_misses[0].reason.value == "unsupported_dtype"


def test_chain_longer_than_the_maximum_is_cut_with_a_reason():
    from fusion_backend.ops.chain import MAX_CHAIN_LENGTH

    def body(s, y):
        for _ in range(MAX_CHAIN_LENGTH + 2):
            y = y * 1.01
        return y

    result = dry_run(Chain(body), X2, patterns=["conv_epilogue"])
    (region,) = result.regions
    assert region[1].count("mul") == MAX_CHAIN_LENGTH
    assert [n.reason.value for n in result.near_misses] == ["chain_too_long"]


def test_two_clamp_bounds_that_require_grad_are_rejected():
    def body(s, y):
        return torch.clamp(y, min=s.s, max=s.m)  # a kernel slot has room for one operand gradient

    assert_not_fused(Chain(body), X2, "conv_epilogue", reason="unsupported_operand")


@pytest.mark.parametrize("spelling", ["clamp(min=t)", "clamp_max(t)"])
def test_one_clamp_bound_that_requires_grad_fuses(spelling):
    body = {"clamp(min=t)": lambda s, y: torch.clamp(y, min=s.s), "clamp_max(t)": lambda s, y: y.clamp_max(s.m)}[spelling]
    (region,) = regions(Chain(body))
    assert region[1] == "conv2d -> " + ("clamp_min" if "min" in spelling else "clamp_max")


def test_disabled_pattern_fuses_nothing():
    result = dry_run(Chain(lambda s, y: F.relu(y)), X2, patterns=[])
    assert result.regions == ()
