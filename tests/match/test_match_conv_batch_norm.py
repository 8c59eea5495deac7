"""Matching of the conv_batch_norm family: every spelling of a training-mode batch norm after a conv,
the chain after it, its priority against conv_epilogue (and eval mode left to conv_epilogue's fold),
and every near-miss reason."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.testing import dry_run

FAMILY = "conv_batch_norm"


class Block(nn.Module):
    """``body(self, conv(x))`` with batch-norm buffers ``rm`` / ``rv``, a norm weight ``w`` and bias ``b``
    (6 channels), a per-channel parameter ``p`` at hand."""

    def __init__(self, body, conv=None, norm=None):
        super().__init__()
        self.conv = conv or nn.Conv2d(3, 6, 3)
        self.norm = norm
        self.register_buffer("rm", torch.zeros(6))
        self.register_buffer("rv", torch.ones(6))
        self.w = nn.Parameter(torch.rand(6) + 0.5)
        self.b = nn.Parameter(torch.randn(6))
        self.p = nn.Parameter(torch.randn(1, 6, 1, 1))
        self.body = body

    def forward(self, x):
        return self.body(self, self.conv(x))


X = (torch.rand(2, 3, 7, 7),)


def found(model, inputs=X):
    result = dry_run(model.train(), inputs)
    return [r[1] for r in result.regions], result


def misses_of(result, pattern=FAMILY):
    return [(m.reason.value, m.message) for m in result.near_misses if m.pattern == pattern]


SPELLINGS = {
    "nn.BatchNorm2d": (None, nn.BatchNorm2d(6), lambda s, y: F.relu(s.norm(y)), "relu"),
    "nn.BatchNorm2d affine=False, no running stats": (None, nn.BatchNorm2d(6, affine=False, track_running_stats=False),
                                                       lambda s, y: s.norm(y) * s.p, "mul"),
    "nn.BatchNorm1d after Conv1d": (nn.Conv1d(3, 6, 3), nn.BatchNorm1d(6, momentum=0.3), lambda s, y: F.gelu(s.norm(y)),
                                    "gelu"),
    "nn.BatchNorm3d after ConvTranspose3d": (nn.ConvTranspose3d(3, 6, 2, stride=2), nn.BatchNorm3d(6),
                                             lambda s, y: F.silu(s.norm(y)), "silu"),
    "F.batch_norm training=True": (None, None, lambda s, y: torch.tanh(F.batch_norm(y, s.rm, s.rv, s.w, s.b, training=True,
                                                                                     momentum=0.2, eps=1e-3)), "tanh"),
    "F.batch_norm without running stats": (None, None, lambda s, y: F.batch_norm(y, None, None, s.w, None, True) + 1.0,
                                           "add"),
}
INPUTS = {"nn.BatchNorm1d after Conv1d": (torch.rand(2, 3, 9),),
          "nn.BatchNorm3d after ConvTranspose3d": (torch.rand(2, 3, 3, 3, 3),)}  # fmt: skip


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_spelling_of_a_training_batch_norm_fuses(name):
    conv, norm, body, last = SPELLINGS[name]
    regions, result = found(Block(body, conv=conv, norm=norm), INPUTS.get(name, X))
    assert len(regions) == 1 and "batch_norm(train)" in regions[0] and regions[0].endswith(last), regions
    assert dry_run(Block(body, conv=conv, norm=norm).train(), INPUTS.get(name, X)).counts() == {FAMILY: 1}
    assert not misses_of(result)


def test_the_bench_demo_fuses_and_num_batches_tracked_stays_outside():
    from tests.conftest import load_demo_module

    demo = load_demo_module("families", "conv2d_64_k3_batchnorm_train_relu")
    model = demo.Model(*demo.get_init_inputs()).train()
    x = torch.rand(2, 64, 8, 8)
    result = dry_run(model, [x])
    assert result.counts() == {FAMILY: 1}, result
    assert result.regions[0][1] == "conv2d -> batch_norm(train) -> relu"
    assert not any("add_" in n for n in result.regions[0][2])  # num_batches_tracked += 1: not in the region


def test_eval_mode_stays_with_conv_epilogue_and_training_mode_points_here():
    model = Block(lambda s, y: F.relu(s.norm(y)), norm=nn.BatchNorm2d(6))
    assert dry_run(model.eval(), X).counts() == {"conv_epilogue": 1}
    result = dry_run(Block(lambda s, y: torch.maximum(s.norm(y), y), norm=nn.BatchNorm2d(6)).train(), X)
    epilogue = [m.message for m in result.near_misses if m.pattern == "conv_epilogue"]
    assert any("conv_batch_norm family" in m for m in epilogue), result.near_misses


NEAR_MISSES = {
    "SyncBatchNorm": (nn.SyncBatchNorm(6), lambda s, y: F.relu(s.norm(y)), "unsupported_op", "SyncBatchNorm"),
    "conv output read again": (nn.BatchNorm2d(6), lambda s, y: s.norm(y) + y, "shared_intermediate", "is used by"),
    "pointwise op before the norm": (nn.BatchNorm2d(6), lambda s, y: s.norm(F.relu(y)), "unsupported_op",
                                     "between the conv and the batch norm"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_misses_say_why(name):
    norm, body, reason, words = NEAR_MISSES[name]
    regions, result = found(Block(body, norm=norm))
    assert not [r for r in regions if "batch_norm(train)" in r], regions
    misses = misses_of(result)
    assert any(r == reason and words in m for r, m in misses), misses


POOLS = {
    "nn.MaxPool2d(3, 2, 1) after ReLU (the ResNet stem)": (None, lambda s, y: nn.MaxPool2d(3, 2, 1)(F.relu(s.norm(y))),
                                                           X, "relu -> max_pool2d"),
    "F.avg_pool2d ceil_mode, count_include_pad=False": (None, lambda s, y: F.avg_pool2d(
        s.norm(y), 3, 2, 1, ceil_mode=True, count_include_pad=False), X, "batch_norm(train) -> avg_pool2d"),
    "F.max_pool1d after Conv1d": (nn.Conv1d(3, 6, 3), lambda s, y: F.max_pool1d(F.gelu(s.norm(y)), 2), (torch.rand(2, 3, 9),),
                                  "gelu -> max_pool1d"),
    "nn.AvgPool3d divisor_override after ConvTranspose3d": (nn.ConvTranspose3d(3, 6, 2, stride=2), lambda s, y: nn.AvgPool3d(
        2, divisor_override=3)(F.silu(s.norm(y))), (torch.rand(2, 3, 3, 3, 3),), "silu -> avg_pool3d"),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_a_max_or_avg_pool_of_the_convs_dimensionality_ends_the_region(name):
    conv, body, inputs, ending = POOLS[name]
    regions, result = found(Block(body, conv=conv, norm=nn.BatchNorm2d(6) if conv is None else
                                  (nn.BatchNorm1d(6) if isinstance(conv, nn.Conv1d) else nn.BatchNorm3d(6))), inputs)  # fmt: skip
    assert len(regions) == 1 and regions[0].endswith(ending) and "batch_norm(train)" in regions[0], regions
    assert not misses_of(result) and result.counts() == {FAMILY: 1}


POOL_NEAR_MISSES = {
    "the pooled value read again": (lambda s, y: (lambda z: F.max_pool2d(z, 2) + z.mean())(F.relu(s.norm(y))),
                                    "shared_intermediate", "a pool whose input is read elsewhere"),
    "an adaptive pool": (lambda s, y: F.adaptive_avg_pool2d(F.relu(s.norm(y)), 2), "unsupported_op", "is an adaptive pool"),
    "a global average pool": (lambda s, y: F.adaptive_avg_pool2d(F.relu(s.norm(y)), 1), "unsupported_op",
                              "is an adaptive pool"),
    "a dilated max pool": (lambda s, y: F.max_pool2d(F.relu(s.norm(y)), 2, dilation=2), "unsupported_argument",
                           "dilation=2"),
    "a 3-d pool after a 2-d conv": (lambda s, y: F.max_pool3d(F.relu(s.norm(y)), 2), "dimension_mismatch",
                                    "a 3-d pool after a 2-d conv"),
}


@pytest.mark.parametrize("name", list(POOL_NEAR_MISSES))
def test_a_pool_that_cannot_end_the_region_is_left_out_with_its_reason(name):
    body, reason, words = POOL_NEAR_MISSES[name]
    regions, result = found(Block(body, norm=nn.BatchNorm2d(6)))
    assert regions == ["conv2d -> batch_norm(train) -> relu"], regions
    assert any(r == reason and words in m for r, m in misses_of(result)), misses_of(result)


def test_a_chain_value_read_outside_cuts_the_chain_there():
    regions, result = found(Block(lambda s, y: (lambda z: (torch.sigmoid(z), z))(F.relu(s.norm(y))), norm=nn.BatchNorm2d(6)))
    assert regions == ["conv2d -> batch_norm(train) -> relu"]
