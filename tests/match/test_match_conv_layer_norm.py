"""Matching of the conv_layer_norm family: every spelling of a layer norm after a conv and the three
kinds of normalized shape, the chains around it, its priority against conv_epilogue, and every
near-miss reason."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.testing import dry_run

FAMILY = "conv_layer_norm"


class Block(nn.Module):
    """``body(self, conv(x))`` on a (2, 6, 5, 5) conv output, with a norm weight ``w`` and bias ``b``
    over W, a per-channel parameter ``p``, a scalar ``s`` and a positional table ``pos`` over (H, W)."""

    def __init__(self, body, conv=None, norm=None):
        super().__init__()
        self.conv = conv or nn.Conv2d(3, 6, 3)
        self.norm = norm
        self.w = nn.Parameter(torch.rand(5) + 0.5)
        self.b = nn.Parameter(torch.randn(5))
        self.p = nn.Parameter(torch.randn(1, 6, 1, 1))
        self.s = nn.Parameter(torch.randn(()))
        self.pos = nn.Parameter(torch.randn(5, 5))
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
    "nn.LayerNorm over W": (nn.LayerNorm(5), lambda s, y: s.norm(y), "layer_norm[W]"),
    "nn.LayerNorm over (H, W), no affine": (nn.LayerNorm([5, 5], elementwise_affine=False), lambda s, y: s.norm(y),
                                            "layer_norm[H, W]"),
    "nn.LayerNorm over (C, H, W), no bias": (nn.LayerNorm([6, 5, 5], bias=False), lambda s, y: s.norm(y),
                                             "layer_norm[C, H, W]"),
    "F.layer_norm positional": (None, lambda s, y: F.layer_norm(y, (5,), s.w, s.b, 1e-3), "layer_norm[W]"),
    "F.layer_norm keywords, shape of the output": (None, lambda s, y: F.layer_norm(y, normalized_shape=y.shape[-2:],
                                                                                   eps=1e-4), "layer_norm[H, W]"),
    "torch.layer_norm": (None, lambda s, y: torch.layer_norm(y, [5], s.w, s.b), "layer_norm[W]"),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_spelling_and_kind_of_normalized_shape_fuses(name):
    norm, body, label = SPELLINGS[name]
    regions, result = found(Block(body, norm=norm))
    assert regions == [f"conv2d -> {label}"]
    assert misses_of(result) == [] and misses_of(result, "conv_epilogue") == []


def test_chains_before_and_after_the_norm_dag_ones_included_join_the_region():
    """conv_epilogue would take ``conv -> mul -> leaky_relu`` and leave the norm to Inductor: this
    family comes first."""
    def body(s, y):
        v = F.leaky_relu(y * s.p, 0.1)
        z = F.layer_norm(v, (6, 5, 5))
        z = z + torch.tanh(z)  # a DAG step: reads z twice
        return F.silu(z * s.s) + s.p

    regions, result = found(Block(body))
    assert regions == ["conv2d -> mul -> leaky_relu -> layer_norm[C, H, W] -> tanh -> add(z) -> mul -> silu -> add"]
    assert result.near_misses == ()


@pytest.mark.parametrize("conv, x, shape, label", [
    (nn.Conv1d(3, 6, 3), (2, 3, 9), (7,), "conv1d -> layer_norm[L]"),
    (nn.ConvTranspose3d(3, 4, 3, stride=2, padding=1, output_padding=1), (1, 3, 2, 3, 2), (4,),
     "conv_transpose3d -> layer_norm[W]"),
    (nn.Conv3d(3, 4, 3), (1, 3, 4, 5, 5), (4, 2, 3, 3), "conv3d -> layer_norm[C, D, H, W]"),
])  # fmt: skip
def test_every_conv_kind_anchors_the_region(conv, x, shape, label):
    regions, _ = found(Block(lambda s, y: F.layer_norm(y, shape), conv=conv), (torch.rand(*x),))
    assert regions == [label]


def test_the_bench_demo_fuses(demo_model):
    model = demo_model("families", "conv2d_64_k3_layernorm_chw_relu")
    regions, result = found(model, (torch.randn(2, 64, 64, 64),))
    assert regions == ["conv2d -> layer_norm[C, H, W] -> relu"] and result.near_misses == ()


def test_a_post_chain_operand_of_the_normalized_shape_ends_the_region_with_a_note():
    regions, result = found(Block(lambda s, y: torch.relu(F.layer_norm(y, (5, 5)) * s.pos)))
    assert regions == ["conv2d -> layer_norm[H, W]"]
    (reason, message), = misses_of(result)
    assert reason == "unsupported_operand" and "per-channel tensors" in message


def test_near_misses_name_their_reason():
    cases = {
        "the batch dim too": (Block(lambda s, y: F.layer_norm(y, y.shape)), "dimension_mismatch", "the batch dim included"),
        "positional table before the norm": (Block(lambda s, y: F.layer_norm(y + s.pos, (5, 5))), "unsupported_operand",
                                             "per-channel tensors"),
        "conv output read elsewhere": (Block(lambda s, y: F.layer_norm(y, (5,)) + y.mean()), "shared_intermediate",
                                       "read again outside the chain"),
        "pre-chain value read elsewhere": (Block(lambda s, y: (F.layer_norm(torch.relu(y), (5,)), torch.relu(y) * 2)),
                                           "shared_intermediate", "is used by"),
        "weight computed from the conv output": (Block(lambda s, y: F.layer_norm(y, (5,), y.mean((0, 1, 2)))),
                                                 "shared_intermediate", "is used by"),
    }
    for name, (model, reason, words) in cases.items():
        regions, result = found(model)
        assert not any("layer_norm" in r for r in regions), name
        misses = misses_of(result)
        assert misses and misses[0][0] == reason, (name, misses)
        assert words in misses[0][1], (name, misses)
    # a norm out of sight (behind an op that is not pointwise): not this family's conv, no near miss
    regions, result = found(Block(lambda s, y: F.layer_norm(F.max_pool2d(y, 1), (5,))))
    assert regions == ["conv2d -> max_pool2d"] and misses_of(result) == []  # conv_epilogue's region
    # conv_epilogue takes the conv where it can and says whose the norm is
    _, result = found(Block(lambda s, y: F.layer_norm(torch.relu(y), y.shape)))
    assert any("the conv_layer_norm family's" in m for _, m in misses_of(result, "conv_epilogue"))


def test_traced_sizes_and_eps_are_near_misses_under_dynamic_shapes():
    regions, result = found(Block(lambda s, y: F.layer_norm(y, y.shape[-2:])), dynamic=True)
    assert regions == [] and "not known at compile time" in misses_of(result)[0][1]
    regions, result = found(Block(lambda s, y: s.norm(y), norm=nn.LayerNorm(5)), dynamic=True)
    assert regions == [] and "eps is a traced value" in misses_of(result)[0][1]


def test_a_normalized_shape_other_than_the_trailing_sizes_is_not_matched():
    """torch rejects such a norm at trace time already: there is nothing to fuse or to report."""
    with pytest.raises(Exception, match="normalized_shape|expected input"):
        found(Block(lambda s, y: F.layer_norm(y, (4,))))
