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

Priority 160: above ``conv_epilogue`` (100), which would otherwise take the conv alone and leave the
norm to Inductor; no other family takes a conv followed by a training-mode batch norm
(``conv_channel_reduce``, 150, ``conv_group_norm``, 170, and ``conv_global_mean``, 200, stop at it), so
the order between them only fixes which near miss a conv gets.  Near misses (only where a training
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
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import BatchNorm, Conv, ParamRef, Pointwise, Pool
from ..match.chain_walk import (
    ChainPart,
    grow_chain_after,
    operand_index,
    per_channel_problem,
)
from ..match.engine import Candidate, ConvAnchoredPattern, MatchContext, fake_of, register_pattern
from ..match.pool_end import pool_after
from ..match.rewrite import Deferred, dtype_name, materialize, rewrite_conv_region
from ..report import Match, NearMiss, ReasonKind

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class BatchNormRegion:
    conv: Conv
    norm: BatchNorm
    momentum: float
    weight: Optional[int]
    bias: Optional[int]
    post: ChainPart
    pool: Optional[Pool] = None


@register_pattern
class ConvBatchNormPattern(ConvAnchoredPattern):
    name = "conv_batch_norm"
    priority = 160
    description = ("conv/conv-transpose (1-3d) → batch norm with batch statistics (training mode) → pointwise chain "
                   "→ optional max/avg pool")

    def match_conv(self, ctx: MatchContext, conv: Conv) -> Optional[Union[Candidate, NearMiss]]:
        anchor = conv.node
        y = fake_of(anchor)
        if not isinstance(y, torch.Tensor) or y.dim() != conv.spec.spatial_dims + 2:
            return None
        norm = _training_norm_ahead(ctx, anchor)
        if norm is None:
            return None  # no training-mode batch norm in sight: not this family's conv

        def miss(at: fx.Node, kind: ReasonKind, msg: str) -> NearMiss:
            return ctx.near_miss(self.name, anchor, at, kind, msg)

        user = norm.node
        if y.dtype not in FUSED_DTYPES:
            return miss(anchor, ReasonKind.UNSUPPORTED_DTYPE, f"conv output dtype {y.dtype} is not a floating type the fused op supports")
        channels = y.shape[1]
        if isinstance(channels, torch.SymInt) and not channels.node.expr.is_number:
            return miss(anchor, ReasonKind.DIMENSION_MISMATCH, f"the conv has a dynamic number of channels ({channels})")
        channels = int(channels)
        if _is_sync_batch_norm(user):
            return miss(user, ReasonKind.UNSUPPORTED_OP,
                        f"`{user.name}` is a SyncBatchNorm: its statistics span every process, which one process's "
                        "fused op cannot compute")  # fmt: skip
        if norm.input is not anchor:
            return miss(user, ReasonKind.UNSUPPORTED_OP,
                        "a pointwise op between the conv and the batch norm is not fused yet (the batch norm must "
                        "read the conv output)")  # fmt: skip
        if len(anchor.users) != 1:
            return miss(anchor, ReasonKind.SHARED_INTERMEDIATE, ctx.sole_user(anchor)[1])
        if user.op == "call_module":
            return miss(user, ReasonKind.UNSUPPORTED_OP,
                        f"`{user.name}` calls a batch norm module, which also counts num_batches_tracked; only its "
                        "inlined F.batch_norm (what Dynamo records) fuses")  # fmt: skip
        momentum = norm.momentum
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
            return miss(user, ReasonKind.UNSUPPORTED_ARGUMENT,
                        f"the batch norm's momentum {_describe(momentum)} is not a number")  # fmt: skip
        for name in ("weight", "bias", "running_mean", "running_var"):
            why = per_channel_problem(getattr(norm, name), channels)
            if why is not None:
                return miss(user, ReasonKind.UNSUPPORTED_OPERAND, f"the batch norm's {name} {why}")
        if (norm.running_mean is None) != (norm.running_var is None):
            return None  # torch takes batch statistics and updates nothing: rare enough to leave alone
        normed = fake_of(user)
        if not isinstance(normed, torch.Tensor):
            return miss(user, ReasonKind.MISSING_METADATA, f"no metadata for `{user.name}`")
        if normed.dtype not in FUSED_DTYPES:
            return miss(user, ReasonKind.UNSUPPORTED_DTYPE, f"`{user.name}` yields {normed.dtype}")
        post = ChainPart([])
        weight = operand_index(norm.weight, post.operands)
        bias = operand_index(norm.bias, post.operands)

        # the chain after the norm, then an optional pool
        notes = grow_chain_after(ctx, self.name, anchor, user, post, y, FUSED_DTYPES, "the batch norm")
        if any(v in (norm.running_mean, norm.running_var) for v in post.operands):
            return miss(user, ReasonKind.UNSUPPORTED_OPERAND, "the chain reads the running statistics the batch norm updates")
        pool, pool_notes = pool_after(ctx, self.name, anchor, post.step_nodes[-1] if post.step_nodes else user,
                                      conv.spec.spatial_dims)  # fmt: skip

        region = BatchNormRegion(conv, norm, float(momentum), weight, bias, post, pool)
        nodes = [anchor, user, *post.step_nodes] + ([pool.node] if pool else [])
        return Candidate(self.name, anchor, nodes, region, _summary(region), notes + pool_notes)

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_batch_norm as op_module

        region: BatchNormRegion = candidate.payload
        conv, norm = region.conv, region.norm
        conv_fake, normed, final = fake_of(conv.node), fake_of(norm.node), fake_of(candidate.nodes[-1])
        running = norm.running_mean is not None
        config = op_module.ConvBatchNormConfig(
            conv=conv.spec,
            eps=norm.eps,
            momentum=region.momentum,
            weight=region.weight,
            bias=region.bias,
            running_stats=running,
            post=tuple(region.post.steps),
            norm_dtype=dtype_name(normed.dtype) if normed.dtype != conv_fake.dtype else None,
            out_dtype=dtype_name(final.dtype) if final.dtype != conv_fake.dtype else None,
            strict=ctx.strict,
            pool=region.pool.spec if region.pool else None,
        ).to_json()
        values = [*region.post.operands, *((norm.running_mean, norm.running_var) if running else ())]
        operands = [Deferred(lambda graph, ref=v: materialize(graph, ref)) if isinstance(v, ParamRef) else v
                    for v in values]  # fmt: skip
        return rewrite_conv_region(
            ctx, candidate, conv, operands, op_module.conv_batch_norm, config, "fusion::conv_batch_norm_fwd",
            op_module.kernel_path(config, conv_fake.dtype, conv_fake.device.type),
        )  # fmt: skip


def _training_norm_ahead(ctx: MatchContext, node: fx.Node) -> Optional[BatchNorm]:
    """The batch norm with batch statistics that reads ``node`` directly or through one pointwise op
    (the latter only to say why it is not fused), or None."""
    for user in node.users:
        op = ctx.op(user)
        if isinstance(op, BatchNorm) and op.training and op.input is node:
            return op
    for user in node.users:
        if isinstance(ctx.op(user), Pointwise):
            for second in user.users:
                op = ctx.op(second)
                if isinstance(op, BatchNorm) and op.training and op.input is user:
                    return op
    return None


def _is_sync_batch_norm(node: fx.Node) -> bool:
    """Whether Dynamo recorded ``node`` inside an ``nn.SyncBatchNorm``'s forward."""
    stack = node.meta.get("nn_module_stack") or {}
    return any(isinstance(t, type) and issubclass(t, torch.nn.SyncBatchNorm) for _, t in stack.values())


def _describe(value: Any) -> str:
    return f"`{value.name}` (a traced value)" if isinstance(value, fx.Node) else repr(value)


def _summary(region: BatchNormRegion) -> str:
    spec = region.conv.spec
    parts = [f"conv{'_transpose' if spec.transposed else ''}{spec.spatial_dims}d", "batch_norm(train)"]
    parts += region.post.labels
    if region.pool:
        parts.append(f"{region.pool.spec.kind}_pool{spec.spatial_dims}d")
    return " -> ".join(parts)
