"""Matching of the conv_channel_reduce family: every spelling of each reduction over the channels, the
chains around it, its priority against the other families, and every near-miss reason."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.testing import dry_run

FAMILY = "conv_channel_reduce"


class Head(nn.Module):
    """``body(self, conv(x))`` with a per-channel parameter ``p`` and a scalar one ``s`` at hand."""

    def __init__(self, body, conv=None):
        super().__init__()
        self.conv = conv or nn.Conv2d(3, 6, 3)
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
    "torch.min dim kw [0]": (lambda s, y: torch.min(y, dim=1)[0], "min(dim=1)"),
    "torch.min keepdim .values": (lambda s, y: torch.min(y, 1, keepdim=True).values, "min(dim=1, keepdim)"),
    "Tensor.min": (lambda s, y: y.min(1)[0], "min(dim=1)"),
    "torch.max negative dim": (lambda s, y: torch.max(y, dim=-3)[0], "max(dim=1)"),
    "Tensor.max keepdim": (lambda s, y: y.max(dim=1, keepdim=True)[0], "max(dim=1, keepdim)"),
    "torch.amin": (lambda s, y: torch.amin(y, 1), "amin(dim=1)"),
    "Tensor.amax keepdim tuple": (lambda s, y: y.amax(dim=(1,), keepdim=True), "amax(dim=1, keepdim)"),
    "torch.sum": (lambda s, y: torch.sum(y, 1), "sum(dim=1)"),
    "Tensor.mean negative keepdim": (lambda s, y: y.mean(-3, keepdim=True), "mean(dim=1, keepdim)"),
    "torch.logsumexp": (lambda s, y: torch.logsumexp(y, 1), "logsumexp(dim=1)"),
    "Tensor.logsumexp keepdim": (lambda s, y: y.logsumexp(dim=1, keepdim=True), "logsumexp(dim=1, keepdim)"),
    "torch.softmax": (lambda s, y: torch.softmax(y, 1), "softmax(dim=1)"),
    "F.softmax negative dim": (lambda s, y: F.softmax(y, dim=-3), "softmax(dim=1)"),
    "Tensor.softmax": (lambda s, y: y.softmax(1), "softmax(dim=1)"),
    "nn.Softmax": (lambda s, y: nn.Softmax(dim=1)(y), "softmax(dim=1)"),
    "torch.log_softmax": (lambda s, y: torch.log_softmax(y, 1), "log_softmax(dim=1)"),
    "F.log_softmax": (lambda s, y: F.log_softmax(y, dim=1), "log_softmax(dim=1)"),
    "Tensor.log_softmax": (lambda s, y: y.log_softmax(dim=1), "log_softmax(dim=1)"),
    "nn.LogSoftmax": (lambda s, y: nn.LogSoftmax(dim=1)(y), "log_softmax(dim=1)"),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_spelling_of_a_channel_reduction_fuses(name):
    body, label = SPELLINGS[name]
    regions, result = found(Head(body))
    assert regions == [f"conv2d -> {label}"]
    assert misses_of(result) == [] and misses_of(result, "conv_epilogue") == []


def test_pre_and_post_chains_dag_ones_included_join_the_region():
    def body(s, y):
        v = F.leaky_relu(y * s.p, 0.1)
        v = v + torch.tanh(v)  # a DAG step: reads v twice
        r = torch.amax(v, dim=1, keepdim=True)
        return torch.sigmoid(r * s.s) - 0.5

    regions, result = found(Head(body))
    assert regions == ["conv2d -> mul -> leaky_relu -> tanh -> add(v) -> amax(dim=1, keepdim) -> mul -> sigmoid -> sub"]
    assert result.near_misses == ()


def test_softmax_takes_per_channel_operands_after_it_a_reduction_does_not():
    regions, _ = found(Head(lambda s, y: torch.softmax(y, 1) * s.p))
    assert regions == ["conv2d -> softmax(dim=1) -> mul"]
    # after a sum over the channels, a (N, 1, H, W) * (1, C, 1, 1) product broadcasts: not a chain step
    regions, result = found(Head(lambda s, y: y.sum(1, keepdim=True) * s.p))
    assert regions == ["conv2d -> sum(dim=1, keepdim)"]
    assert [r for r, _ in misses_of(result)] == ["unsupported_operand"]


def test_the_demos_match_exactly(demo_model):
    for name, summary in (("conv2d_64_128_k3_min_tanh", "conv2d -> min(dim=1, keepdim) -> tanh"),
                          ("conv3d_16_32_k3_softmax_mul", "conv3d -> softmax(dim=1) -> mul")):  # fmt: skip
        model = demo_model("families", name)
        x = torch.randn(1, model.conv.in_channels, *([5] * (model.conv.weight.dim() - 2)))
        regions, result = found(model, (x,))
        assert regions == [summary]
        assert result.near_misses == ()


def test_it_claims_the_conv_before_conv_epilogue_would():
    regions, result = found(Head(lambda s, y: torch.relu(y).amin(1)))
    assert regions == ["conv2d -> relu -> amin(dim=1)"]
    assert misses_of(result, "conv_epilogue") == []
    # with the family off, conv_epilogue takes the conv and the ReLU and says why it stopped
    regions, result = found(Head(lambda s, y: torch.relu(y).amin(1)), patterns=["conv_epilogue"])
    assert regions == ["conv2d -> relu"]
    assert any("conv_channel_reduce family" in m for _, m in misses_of(result, "conv_epilogue"))


def test_a_global_mean_over_space_stays_conv_global_mean_and_is_no_near_miss_here():
    regions, result = found(Head(lambda s, y: y.mean((2, 3))))
    assert regions == ["conv2d -> global_mean"]
    assert misses_of(result) == []
    regions, result = found(Head(lambda s, y: torch.relu(y).mean((2, 3))))
    assert regions == ["conv2d -> relu"]
    assert misses_of(result) == []


def _values_times_indices(pair):
    return pair.values * pair.indices


def _reduced_and_itself(v):
    return v.amax(1), v


NEAR_MISSES = {
    "amax over space": (lambda s, y: torch.amax(y, dim=(2, 3)), "dimension_mismatch", "only a reduction over the channels"),
    "softmax over a spatial dim": (lambda s, y: torch.softmax(y, -1), "dimension_mismatch", "dims [3]"),
    "sum over channels and space": (lambda s, y: y.sum((1, 2)), "dimension_mismatch", "dims [1, 2]"),
    "amax over every dim listed": (lambda s, y: torch.amax(y, dim=(0, 1, 2, 3)), "dimension_mismatch", "dims [0, 1, 2, 3]"),
    "indices used": (lambda s, y: torch.min(y, 1)[1].float(), "unsupported_op", "only its values fuse"),
    "values and indices": (lambda s, y: _values_times_indices(torch.max(y, 1)), "unsupported_op", "indices"),
    "softmax dtype": (lambda s, y: F.softmax(y, 1, dtype=torch.float64), "unsupported_argument", "dtype="),
    "log_softmax dtype": (lambda s, y: y.log_softmax(1, dtype=torch.float64), "unsupported_argument", "dtype="),
    "sum dtype": (lambda s, y: torch.sum(y, 1, dtype=torch.float64), "unsupported_argument", "dtype="),
    "pre-chain value read outside": (lambda s, y: _reduced_and_itself(torch.relu(y)), "shared_intermediate", "read again"),
    "conv output read twice": (lambda s, y: y.amax(1) + y.sum((1, 2, 3))[:, None, None], "shared_intermediate", "used by"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_misses_give_their_reason(name):
    body, reason, words = NEAR_MISSES[name]
    regions, result = found(Head(body))
    assert not any("amax(" in r or "softmax(" in r or "min(" in r or "max(dim" in r or "sum(dim" in r for r in regions)
    misses = misses_of(result)
    assert any(r == reason and words in m for r, m in misses), misses


def test_a_reduction_over_every_dim_such_as_a_loss_is_no_near_miss():
    regions, result = found(Head(lambda s, y: torch.relu(y).mean()))
    assert regions == ["conv2d -> relu"]
    assert misses_of(result) == []


def test_a_second_reduction_ends_the_region_with_a_note():
    regions, result = found(Head(lambda s, y: torch.softmax(y, 1).amax(1)))
    assert regions == ["conv2d -> softmax(dim=1)"]
    assert [r for r, m in misses_of(result) if "second reduction" in m] == ["unsupported_op"]


def test_too_many_channels_is_a_near_miss_naming_the_limit():
    model = Head(lambda s, y: torch.logsumexp(y, 1), conv=nn.Conv2d(3, 1025, 1))
    regions, result = found(model)
    assert regions == []
    assert any(r == "dimension_mismatch" and "1025 channels" in m and "1024" in m for r, m in misses_of(result))
    regions, _ = found(Head(lambda s, y: torch.logsumexp(y, 1), conv=nn.Conv2d(3, 1024, 1)))
    assert regions == ["conv2d -> logsumexp(dim=1)"]


def test_an_unsupported_conv_dtype_is_a_near_miss():
    model = Head(lambda s, y: y.sum(1), conv=nn.Conv2d(3, 5, 3, dtype=torch.complex64))
    regions, result = found(model, (torch.rand(2, 3, 7, 7, dtype=torch.complex64),))
    assert regions == []
    assert any(r == "unsupported_dtype" and "complex64" in m for r, m in misses_of(result))


def test_conv1d_3d_and_transposed_convs_match():
    for conv, x in ((nn.Conv1d(3, 5, 3), torch.rand(2, 3, 9)), (nn.Conv3d(3, 5, 3), torch.rand(1, 3, 5, 5, 5)),
                    (nn.ConvTranspose2d(3, 5, 2, 2), torch.rand(2, 3, 4, 4))):  # fmt: skip
        model = Head(lambda s, y: torch.logsumexp(y, 1), conv=conv)
        regions, _ = found(model, (x,))
        d = conv.weight.dim() - 2
        kind = "conv_transpose" if isinstance(conv, nn.ConvTranspose2d) else "conv"
        assert regions == [f"{kind}{d}d -> logsumexp(dim=1)"]
