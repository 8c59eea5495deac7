"""Pattern family ``conv_group_norm``: conv / conv-transpose → pointwise chain → group norm or instance
norm (batch statistics) → pointwise chain → optional max / avg pool.

Anchor: any ``Conv`` (1-3 spatial dims, transposed or not, any hyper-parameters) whose output is
batched and floating point, followed, through an optional pointwise chain (``ops/chain.py``'s
catalogue, DAG chains included, as ``conv_epilogue`` grows them), by a ``GroupNorm`` canonical op:
``nn.GroupNorm`` / ``F.group_norm`` / ``torch.group_norm``, or ``nn.InstanceNorm{1,2,3}d`` /
``F.instance_norm`` with batch statistics and no running statistics (one channel per group); affine or
not.  A pointwise chain may follow the norm (per-channel operands included), then a max or avg pool
of the conv's dimensionality (``match/pool_end.py``).  The fused op (``ops/conv_group_norm/``) runs
the conv once and everything after it in one Triton kernel per direction.

A conv walk centred on the norm (``match/conv_walk.py``): it takes a conv before the plain chain of
``conv_epilogue`` would, which would leave the norm to Inductor.  Near misses (only where a group
norm is in sight): an instance norm with running statistics, a norm weight or bias that is not one
value per channel, a norm whose input is read outside the region, an unsupported dtype, a dynamic
channel count, the chains' own reasons, and a pool after the chain that does not fuse (its input read elsewhere, another dimensionality, dilation or
``return_indices``, an adaptive pool).  A channel count that the groups do not divide is not matched
(torch rejects it).  LayerNorm normalises over trailing dims, not channel groups: ``conv_layer_norm``'s,
not this family's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.fx as fx

from ..frontend.canonical import CanonicalOp, GroupNorm
from ..frontend.normalize import target_name
from ..match.chain_walk import operand_index, per_channel_problem
from ..match.conv_walk import (
    NOT_MATCHED,
    Centre,
    CentreSite,
    ConvRegion,
    ConvWalkPattern,
    Refusal,
    claim_wording,
)
from ..match.engine import Candidate, MatchContext, fake_of, register_pattern
from ..match.rewrite import dtype_if_changed, region_result, rewrite_conv_region
from ..report import Match, ReasonKind

#: The normalizations this family takes, by function name, as its near misses' words name them.
_NORMS = {"group_norm": "GroupNorm", "instance_norm": "InstanceNorm"}


@dataclass(frozen=True)
class GroupNormFacts:
    """What the config needs from the norm: its number of groups and its weight's and bias's
    indices among the region's operands (None: not affine)."""

    groups: int
    weight: Optional[int]
    bias: Optional[int]


def _groups(site: CentreSite) -> int:
    norm: GroupNorm = site.op
    return int(site.y.shape[1]) if norm.groups is None else norm.groups


def _refusal(site: CentreSite) -> Optional[Refusal]:
    norm: GroupNorm = site.op
    name = site.node.name
    if norm.input is not site.flowing:
        return Refusal(ReasonKind.UNSUPPORTED_OPERAND, f"`{name}` does not normalise the chain's value")
    if norm.running_stats:
        return Refusal(ReasonKind.UNSUPPORTED_ARGUMENT,
                       f"`{name}` is an instance norm with running statistics (track_running_stats=True); only "
                       "batch statistics fuse")  # fmt: skip
    channels, groups = int(site.y.shape[1]), _groups(site)
    if groups < 1 or channels % groups != 0:
        return NOT_MATCHED  # torch rejects it: nothing to report
    for what in ("weight", "bias"):
        why = per_channel_problem(getattr(norm, what), channels)
        if why is not None:
            return Refusal(ReasonKind.UNSUPPORTED_OPERAND, f"the norm's {what} {why}")
    return None


def _facts(site: CentreSite) -> GroupNormFacts:
    norm: GroupNorm = site.op
    return GroupNormFacts(_groups(site), operand_index(norm.weight, site.operands), operand_index(norm.bias, site.operands))


def _label(region: ConvRegion) -> str:
    return "instance_norm" if region.centre.groups is None else f"group_norm({region.facts.groups})"


GROUP_NORM = Centre(GroupNorm, "the group norm", _label, _refusal, _facts, trailing_pool=True)


@register_pattern
class ConvGroupNormPattern(ConvWalkPattern):
    name = "conv_group_norm"
    description = ("conv/conv-transpose (1-3d) → pointwise chain → group norm / instance norm (batch statistics) "
                   "→ pointwise chain → optional max/avg pool")
    centre = GROUP_NORM

    def claim(self, node: fx.Node, op: CanonicalOp, rank: int) -> Optional[str]:
        label = _NORMS.get(target_name(node))
        return None if label is None else claim_wording(f"normalizes by statistics of the conv output ({label}):", self.name)

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_group_norm as op_module

        region: ConvRegion = candidate.payload
        conv, norm, facts = region.conv, region.centre, region.facts
        conv_fake = fake_of(conv.node)
        config = op_module.ConvGroupNormConfig(
            conv=conv.spec,
            groups=facts.groups,
            eps=norm.eps,
            weight=facts.weight,
            bias=facts.bias,
            pre=tuple(region.pre.steps),
            post=tuple(region.post.steps),
            norm_dtype=dtype_if_changed(fake_of(norm.node), conv_fake),
            out_dtype=dtype_if_changed(region_result(ctx, candidate.nodes[-1]), conv_fake),
            strict=ctx.strict,
            pool=region.pool.spec if region.pool else None,
        ).to_json()
        return rewrite_conv_region(
            ctx, candidate, conv, region.post.operands, op_module.conv_group_norm, config, "fusion::conv_group_norm_fwd",
            op_module.kernel_path(config, conv_fake.dtype, conv_fake.device.type),
        )  # fmt: skip
