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

Priority 170: above ``conv_epilogue`` (100), which would otherwise take the conv and the chain before
the norm and leave the norm to Inductor; above ``conv_channel_reduce`` (150), which never takes a
norm's conv (a region of each never shares a conv, so the order between them only fixes which near
miss a conv gets); below ``conv_global_mean`` (200), whose algebraic route never writes the conv
output.  Near misses (only where a group norm is in sight): an instance norm with running statistics,
a norm weight or bias that is not one value per channel, a norm whose input is read outside the
region, an unsupported dtype, a dynamic channel count, the chains' own reasons, and a pool after the
chain that does not fuse (its input read elsewhere, another dimensionality, dilation or
``return_indices``, an adaptive pool).  A channel count that the groups do not divide is not matched
(torch rejects it).  LayerNorm normalises over trailing dims, not channel groups: ``conv_layer_norm``'s,
not this family's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import Conv, GroupNorm, ParamRef, Pointwise, Pool
from ..frontend.normalize import describe_target
from ..match.chain_walk import (
    ChainPart,
    ChainValues,
    grow_chain_after,
    operand_index,
    per_channel_problem,
    pointwise_step,
)
from ..match.engine import Candidate, ConvAnchoredPattern, MatchContext, fake_of, register_pattern
from ..match.pool_end import pool_after
from ..match.rewrite import Deferred, dtype_name, materialize, rewrite_conv_region
from ..ops.chain import MAX_CHAIN_LENGTH
from ..report import Match, NearMiss, ReasonKind

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOOKAHEAD = 8


@dataclass
class GroupNormRegion:
    conv: Conv
    pre: ChainPart
    norm: GroupNorm
    groups: int
    weight: Optional[int]
    bias: Optional[int]
    post: ChainPart
    pool: Optional[Pool] = None


@register_pattern
class ConvGroupNormPattern(ConvAnchoredPattern):
    name = "conv_group_norm"
    priority = 170
    description = ("conv/conv-transpose (1-3d) → pointwise chain → group norm / instance norm (batch statistics) "
                   "→ pointwise chain → optional max/avg pool")

    def match_conv(self, ctx: MatchContext, conv: Conv) -> Optional[Union[Candidate, NearMiss]]:
        anchor = conv.node
        y = fake_of(anchor)
        if not isinstance(y, torch.Tensor) or y.dim() != conv.spec.spatial_dims + 2:
            return None
        if not _norm_ahead(ctx, anchor):
            return None  # no group norm in sight: not this family's conv

        def miss(at: fx.Node, kind: ReasonKind, msg: str) -> NearMiss:
            return ctx.near_miss(self.name, anchor, at, kind, msg)

        if y.dtype not in FUSED_DTYPES:
            return miss(anchor, ReasonKind.UNSUPPORTED_DTYPE, f"conv output dtype {y.dtype} is not a floating type the fused op supports")
        channels = y.shape[1]
        if isinstance(channels, torch.SymInt) and not channels.node.expr.is_number:
            return miss(anchor, ReasonKind.DIMENSION_MISMATCH, f"the conv has a dynamic number of channels ({channels})")
        channels = int(channels)

        # 1. the chain before the norm
        pre = ChainPart([])
        chain = ChainValues(anchor)
        current = anchor
        while True:
            user, why = chain.next_user(ctx, current, fusible=(Pointwise, GroupNorm))
            if user is None:
                return miss(current, ReasonKind.SHARED_INTERMEDIATE, why)
            op = ctx.op(user)
            if isinstance(op, GroupNorm):
                break
            if not isinstance(op, Pointwise):
                return miss(user, ReasonKind.UNSUPPORTED_OP,
                            f"`{user.name}` ({describe_target(user)}) before the group norm is not a fusible pointwise op")
            if len(pre.steps) == MAX_CHAIN_LENGTH:
                return miss(user, ReasonKind.CHAIN_TOO_LONG, f"the chain before the group norm holds at most {MAX_CHAIN_LENGTH} ops")
            step = pointwise_step(ctx, self.name, anchor, op, current, pre.operands, y, chain, FUSED_DTYPES)
            if isinstance(step, NearMiss):
                return step
            pre.steps.append(step)
            pre.step_nodes.append(user)
            pre.labels.append(chain.label(step))
            current = chain.computed(user, len(pre.steps))

        # 2. the norm
        norm: GroupNorm = op
        if norm.input is not current:
            return miss(user, ReasonKind.UNSUPPORTED_OPERAND, f"`{user.name}` does not normalise the chain's value")
        if norm.running_stats:
            return miss(user, ReasonKind.UNSUPPORTED_ARGUMENT,
                        f"`{user.name}` is an instance norm with running statistics (track_running_stats=True); only "
                        "batch statistics fuse")  # fmt: skip
        groups = channels if norm.groups is None else norm.groups
        if groups < 1 or channels % groups != 0:
            return None  # torch rejects it: nothing to report
        for name in ("weight", "bias"):
            why = per_channel_problem(getattr(norm, name), channels)
            if why is not None:
                return miss(user, ReasonKind.UNSUPPORTED_OPERAND, f"the norm's {name} {why}")
        if not chain.closed(pre, user):
            read_outside = next(n for n in [anchor, *pre.step_nodes] if any(u not in {anchor, *pre.step_nodes, user} for u in n.users))
            return miss(read_outside, ReasonKind.SHARED_INTERMEDIATE, chain.outside_users(read_outside))
        normed = fake_of(user)
        if not isinstance(normed, torch.Tensor):
            return miss(user, ReasonKind.MISSING_METADATA, f"no metadata for `{user.name}`")
        if normed.dtype not in FUSED_DTYPES:
            return miss(user, ReasonKind.UNSUPPORTED_DTYPE, f"`{user.name}` yields {normed.dtype}")
        post = ChainPart(pre.operands)
        weight = operand_index(norm.weight, post.operands)
        bias = operand_index(norm.bias, post.operands)

        # 3. the chain after it, then an optional pool
        notes = grow_chain_after(ctx, self.name, anchor, user, post, y, FUSED_DTYPES, "the group norm")
        pool, pool_notes = pool_after(ctx, self.name, anchor, post.step_nodes[-1] if post.step_nodes else user,
                                      conv.spec.spatial_dims)  # fmt: skip

        region = GroupNormRegion(conv, pre, norm, groups, weight, bias, post, pool)
        nodes = [anchor, *pre.step_nodes, user, *post.step_nodes] + ([pool.node] if pool else [])
        return Candidate(self.name, anchor, nodes, region, _summary(region), notes + pool_notes)

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_group_norm as op_module

        region: GroupNormRegion = candidate.payload
        conv = region.conv
        conv_fake, normed, final = fake_of(conv.node), fake_of(region.norm.node), fake_of(candidate.nodes[-1])
        config = op_module.ConvGroupNormConfig(
            conv=conv.spec,
            groups=region.groups,
            eps=region.norm.eps,
            weight=region.weight,
            bias=region.bias,
            pre=tuple(region.pre.steps),
            post=tuple(region.post.steps),
            norm_dtype=dtype_name(normed.dtype) if normed.dtype != conv_fake.dtype else None,
            out_dtype=dtype_name(final.dtype) if final.dtype != conv_fake.dtype else None,
            strict=ctx.strict,
            pool=region.pool.spec if region.pool else None,
        ).to_json()
        operands = [Deferred(lambda graph, ref=v: materialize(graph, ref)) if isinstance(v, ParamRef) else v
                    for v in region.post.operands]  # fmt: skip
        return rewrite_conv_region(
            ctx, candidate, conv, operands, op_module.conv_group_norm, config, "fusion::conv_group_norm_fwd",
            op_module.kernel_path(config, conv_fake.dtype, conv_fake.device.type),
        )  # fmt: skip


def _norm_ahead(ctx: MatchContext, node: fx.Node) -> bool:
    """Whether a group norm reading the chain follows within a few pointwise steps (DAG chains included)."""
    frontier, seen = [node], {node}
    for _ in range(_LOOKAHEAD):
        following = []
        for current in frontier:
            for user in current.users:
                op = ctx.op(user)
                if isinstance(op, GroupNorm) and op.input is current:
                    return True
                if isinstance(op, Pointwise) and user not in seen:
                    seen.add(user)
                    following.append(user)
        frontier = following
    return False


def _summary(region: GroupNormRegion) -> str:
    spec = region.conv.spec
    parts = [f"conv{'_transpose' if spec.transposed else ''}{spec.spatial_dims}d", *region.pre.labels]
    name = "instance_norm" if region.norm.groups is None else f"group_norm({region.groups})"
    parts.append(name)
    parts += region.post.labels
    if region.pool:
        parts.append(f"{region.pool.spec.kind}_pool{spec.spatial_dims}d")
    return " -> ".join(parts)
