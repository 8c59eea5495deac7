"""Pattern family ``conv_batch_norm``: conv / conv-transpose → batch norm with batch statistics
(training mode) → pointwise chain → optional max / avg pool.

Anchor: any ``Conv`` (1-3 spatial dims, transposed or not, any hyper-parameters) whose output is
batched and floating point and read only by a ``BatchNorm`` canonical op with batch statistics:
``nn.BatchNorm{1,2,3}d`` in train mode (or without running statistics), ``F.batch_norm(...,
training=True)``; affine or not, with or without running statistics, momentum a number.  A pointwise
chain may follow the norm (per-channel operands included), then a max or avg pool of the conv's
dimensionality (``match/pool_end.py``: the ResNet stem's ``MaxPool2d(3, 2, 1)``).  The fused op (``ops/conv_batch_norm/``)
runs the conv once, the statistics and the normalisation in Triton kernels, and updates the running
statistics in place as eager does.  ``nn.BatchNorm``'s ``num_batches_tracked += 1`` is a node of its
own in Dynamo's graph, outside the region: it stays there and runs once per step, as in eager.

A conv walk centred on the norm (``match/conv_walk.py``) with no chain before it: it takes a conv
before the plain chain of ``conv_epilogue`` would, which would stop at the norm and leave it to
Inductor.  Near misses (only where a training
batch norm reads the conv output): ``nn.SyncBatchNorm`` (its statistics span every process), a conv
output read outside the norm, a pointwise op between the conv and the norm, a momentum that is not a
number (``momentum=None`` makes Dynamo break the graph at ``float(num_batches_tracked)``, so that norm
never reaches a backend), a batch norm module call (it would hide ``num_batches_tracked``'s
increment), a norm weight or bias that is not one value per channel, an unsupported dtype, a dynamic
channel count, the chain's own reasons, and a pool after it that does not fuse (its input read
elsewhere, another dimensionality, dilation or ``return_indices``, an adaptive pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.fx as fx

from ..frontend.canonical import BatchNorm, CanonicalOp
from ..match.chain_walk import operand_index
from ..match.conv_walk import (
    NOT_MATCHED,
    Centre,
    CentreSite,
    ConvRegion,
    ConvWalkPattern,
    Refusal,
    batch_norm_problem,
    claim_wording,
    is_sync_batch_norm,
)
from ..match.engine import Candidate, MatchContext, fake_of, register_pattern
from ..match.rewrite import dtype_if_changed, region_result, rewrite_conv_region
from ..report import Match, ReasonKind


@dataclass(frozen=True)
class BatchNormFacts:
    """What the config needs from the norm: its momentum and its weight's and bias's indices among
    the region's operands (None: not affine)."""

    momentum: float
    weight: Optional[int]
    bias: Optional[int]


def _in_sight(op: BatchNorm, rank: int) -> bool:
    return op.training


def _refusal(site: CentreSite) -> Optional[Refusal]:
    norm: BatchNorm = site.op
    user, anchor = site.node, site.anchor
    if is_sync_batch_norm(user):
        return Refusal(ReasonKind.UNSUPPORTED_OP,
                       f"`{user.name}` is a SyncBatchNorm: its statistics span every process, which one process's "
                       "fused op cannot compute")  # fmt: skip
    if norm.input is not site.flowing:
        return Refusal(ReasonKind.UNSUPPORTED_OP,
                       "a pointwise op between the conv and the batch norm is not fused yet (the batch norm must "
                       "read the conv output)")  # fmt: skip
    if len(anchor.users) != 1:
        return Refusal(ReasonKind.SHARED_INTERMEDIATE, site.ctx.sole_user(anchor)[1], at=anchor)
    problem = batch_norm_problem(norm, int(site.y.shape[1]))
    if problem is not None:
        return Refusal(*problem)
    if (norm.running_mean is None) != (norm.running_var is None):
        return NOT_MATCHED  # torch takes batch statistics and updates nothing: rare enough to leave alone
    return None


def _facts(site: CentreSite) -> BatchNormFacts:
    norm: BatchNorm = site.op
    return BatchNormFacts(float(norm.momentum), operand_index(norm.weight, site.operands),
                          operand_index(norm.bias, site.operands))  # fmt: skip


def _region_refusal(region: ConvRegion) -> Optional[Refusal]:
    norm: BatchNorm = region.centre
    if any(v in (norm.running_mean, norm.running_var) for v in region.post.operands):
        return Refusal(ReasonKind.UNSUPPORTED_OPERAND, "the chain reads the running statistics the batch norm updates")
    return None


def _label(region: ConvRegion) -> str:
    return "batch_norm(train)"


#: Looks two ops ahead: at the norm, or past one pointwise op only to say it is not fused yet.
BATCH_NORM = Centre(BatchNorm, "the batch norm", _label, _refusal, _facts, in_sight=_in_sight, lookahead=2,
                    chain_before=False, trailing_pool=True, region_refusal=_region_refusal)  # fmt: skip


@register_pattern
class ConvBatchNormPattern(ConvWalkPattern):
    name = "conv_batch_norm"
    description = ("conv/conv-transpose (1-3d) → batch norm with batch statistics (training mode) → pointwise chain "
                   "→ optional max/avg pool")
    centre = BATCH_NORM

    def claim(self, node: fx.Node, op: CanonicalOp, rank: int) -> Optional[str]:
        if not (isinstance(op, BatchNorm) and op.training):
            return None
        return claim_wording("a batch norm with batch statistics (training mode) is", self.name)

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_batch_norm as op_module

        region: ConvRegion = candidate.payload
        conv, norm, facts = region.conv, region.centre, region.facts
        conv_fake = fake_of(conv.node)
        running = norm.running_mean is not None
        config = op_module.ConvBatchNormConfig(
            conv=conv.spec,
            eps=norm.eps,
            momentum=facts.momentum,
            weight=facts.weight,
            bias=facts.bias,
            running_stats=running,
            post=tuple(region.post.steps),
            norm_dtype=dtype_if_changed(fake_of(norm.node), conv_fake),
            out_dtype=dtype_if_changed(region_result(ctx, candidate.nodes[-1]), conv_fake),
            strict=ctx.strict,
            pool=region.pool.spec if region.pool else None,
        ).to_json()
        operands = [*region.post.operands, *((norm.running_mean, norm.running_var) if running else ())]
        return rewrite_conv_region(
            ctx, candidate, conv, operands, op_module.conv_batch_norm, config, "fusion::conv_batch_norm_fwd",
            op_module.kernel_path(config, conv_fake.dtype, conv_fake.device.type),
        )  # fmt: skip
