"""The conv walk itself (``match/conv_walk.py``), with a family declared here: a centre on group
norms of two groups, matched on small FX graphs (symbolic traces with fake values, find phase only):
the chains before and after the centre, a trailing pool allowed or refused, the centre's refusals,
the near-miss wording the plain chain takes from what a family claims, and precedence."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from fusion_backend.frontend.canonical import CanonicalOp, GroupNorm
from fusion_backend.match import engine
from fusion_backend.match.conv_walk import (
    NOT_MATCHED,
    Centre,
    CentreSite,
    ConvRegion,
    ConvWalkPattern,
    Refusal,
    claim_wording,
)
from fusion_backend.match.engine import Precedence, find_regions, precedence_order
from fusion_backend.report import ReasonKind

W = torch.randn(8, 3, 3, 3)
X = torch.randn(2, 3, 10, 10)


def _refusal(site: CentreSite) -> Optional[Refusal]:
    groups = site.op.groups
    if groups == 8:
        return NOT_MATCHED
    if groups != 2:
        return Refusal(ReasonKind.UNSUPPORTED_ARGUMENT, f"`{site.node.name}` has {groups} groups; this family takes 2")
    return None


def _facts(site: CentreSite) -> int:
    return site.op.groups


def _label(region: ConvRegion) -> str:
    return f"two_group_norm({region.facts})"


TWO_GROUP_NORM = Centre(GroupNorm, "the two-group norm", _label, _refusal, _facts, trailing_pool=True)


class ConvTwoGroupNorm(ConvWalkPattern):
    name = "conv_two_group_norm"
    description = "conv → pointwise chain → group norm of two groups → pointwise chain → optional pool"
    centre = TWO_GROUP_NORM

    def claim(self, node: fx.Node, op: CanonicalOp, rank: int) -> Optional[str]:
        return claim_wording("normalizes over channel groups:", self.name) if isinstance(op, GroupNorm) else None


class ConvTwoGroupNormNoPool(ConvTwoGroupNorm):
    name = "conv_two_group_norm_no_pool"
    centre = dataclasses.replace(TWO_GROUP_NORM, trailing_pool=False)


@pytest.fixture
def only(monkeypatch):
    """Make the registry hold exactly the given families (by instance), for this test.  The built-in
    families are registered first, into the registry the other tests see."""
    engine.registered_patterns()

    def install(*families: engine.Pattern) -> list[str]:
        monkeypatch.setattr(engine, "_REGISTRY", {family.name: family for family in families})
        return [family.name for family in families]

    return install


def find(fn, *families_enabled: str):
    gm = fx.symbolic_trace(fn)
    from fusion_backend.backend import _ensure_fake_values

    _ensure_fake_values(gm, [X, W])
    return find_regions(gm, families_enabled)


def summaries(found) -> list[tuple[str, str]]:
    return [(pattern.name, candidate.summary) for pattern, candidate in found.accepted]


def misses(found) -> list[tuple[str, str, str, str]]:
    return [(m.pattern, m.reason.value, m.node, m.message) for m in found.near_misses]


def test_the_chains_before_and_after_the_centre_join_the_region(only):
    names = only(ConvTwoGroupNorm())
    found = find(lambda x, w: torch.sigmoid(F.group_norm(F.relu(F.conv2d(x, w)) * 2.0, 2)) + 1.0, *names)
    assert summaries(found) == [("conv_two_group_norm", "conv2d -> relu -> mul -> two_group_norm(2) -> sigmoid -> add")]
    assert misses(found) == []
    (_, candidate), = found.accepted
    assert [n.name for n in candidate.nodes] == ["conv2d", "relu", "mul", "group_norm", "sigmoid", "add"]
    region = candidate.payload
    assert len(region.pre.steps) == 2 and len(region.post.steps) == 2 and region.pool is None


def test_a_conv_without_its_centre_in_sight_is_not_the_familys(only):
    names = only(ConvTwoGroupNorm())
    found = find(lambda x, w: torch.sigmoid(F.relu(F.conv2d(x, w))), *names)
    assert found.accepted == [] and found.near_misses == []


def test_a_centre_refusal_is_the_near_miss_with_its_reason_and_not_matched_is_silent(only):
    names = only(ConvTwoGroupNorm())
    found = find(lambda x, w: F.group_norm(F.relu(F.conv2d(x, w)), 4), *names)
    assert found.accepted == []
    assert misses(found) == [("conv_two_group_norm", "unsupported_argument", "group_norm",
                              "`group_norm` has 4 groups; this family takes 2")]
    found = find(lambda x, w: F.group_norm(F.relu(F.conv2d(x, w)), 8), *names)
    assert found.accepted == [] and found.near_misses == []


def test_a_value_of_the_chain_before_read_outside_is_a_shared_intermediate(only):
    names = only(ConvTwoGroupNorm())

    def fn(x, w):
        y = F.relu(F.conv2d(x, w))
        return F.group_norm(y, 2), y

    found = find(fn, *names)
    assert found.accepted == []
    assert misses(found) == [("conv_two_group_norm", "shared_intermediate", "relu",
                              "`relu` is read again outside the chain (by `group_norm`, the graph output)")]


def test_a_trailing_pool_joins_where_the_centre_allows_one(only):
    names = only(ConvTwoGroupNorm(), ConvTwoGroupNormNoPool())
    fn = lambda x, w: F.max_pool2d(F.silu(F.group_norm(F.conv2d(x, w), 2)), 2)  # noqa: E731
    found = find(fn, names[0])
    assert summaries(found) == [("conv_two_group_norm", "conv2d -> two_group_norm(2) -> silu -> max_pool2d")]
    found = find(fn, names[1])
    assert summaries(found) == [("conv_two_group_norm_no_pool", "conv2d -> two_group_norm(2) -> silu")]
    assert found.near_misses == []


def test_a_pool_that_cannot_join_is_a_near_miss_and_the_region_ends_before_it(only):
    names = only(ConvTwoGroupNorm())
    found = find(lambda x, w: F.max_pool2d(F.silu(F.group_norm(F.conv2d(x, w), 2)), 2, dilation=2), *names)
    assert summaries(found) == [("conv_two_group_norm", "conv2d -> two_group_norm(2) -> silu")]
    assert misses(found) == [("conv_two_group_norm", "unsupported_argument", "max_pool2d",
                              "`max_pool2d`: max pool with dilation=2")]


def test_the_plain_chain_names_the_family_that_claims_the_op_it_stopped_at(only):
    from fusion_backend.patterns.conv_epilogue import ConvEpiloguePattern

    epilogue = ConvEpiloguePattern()
    fn = lambda x, w: F.group_norm(F.relu(F.conv2d(x, w)), 4)  # noqa: E731
    names = only(epilogue, ConvTwoGroupNorm())
    found = find(fn, *names)
    assert summaries(found) == [("conv_epilogue", "conv2d -> relu")]
    (claimed,) = [m for m in found.near_misses if m.pattern == "conv_epilogue"]
    assert claimed.reason is ReasonKind.UNSUPPORTED_OP and claimed.node == "group_norm"
    assert claimed.message.endswith(
        "normalizes over channel groups: the conv_two_group_norm family's (its near miss says why it did not fuse)")
    only(epilogue)
    (unclaimed,) = find(fn, "conv_epilogue").near_misses
    assert unclaimed.message.endswith("is not a fusible pointwise op or pool")


def test_a_family_with_a_centre_takes_the_conv_before_the_plain_chain(only):
    from fusion_backend.patterns.conv_epilogue import ConvEpiloguePattern

    names = only(ConvEpiloguePattern(), ConvTwoGroupNorm())
    assert ConvEpiloguePattern().precedence is Precedence.CHAIN_ONLY
    assert ConvTwoGroupNorm().precedence is Precedence.CLAIMS_AN_OP
    assert precedence_order() == ["conv_two_group_norm", "conv_epilogue"]
    found = find(lambda x, w: F.group_norm(F.relu(F.conv2d(x, w)), 2), *names)
    assert summaries(found) == [("conv_two_group_norm", "conv2d -> relu -> two_group_norm(2)")]
    assert found.near_misses == []  # the epilogue's CLAIMED near miss of a conv a preceding family fused is dropped


def test_the_built_in_families_precedence():
    assert precedence_order() == ["batch_norm_conv", "conv_global_mean", "conv_group_norm", "conv_layer_norm", "conv_batch_norm",
                                  "conv_channel_reduce", "conv_epilogue", "attention"]
