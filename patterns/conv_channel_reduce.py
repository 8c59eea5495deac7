"""Pattern family ``conv_channel_reduce``: conv / conv-transpose → pointwise chain → ONE reduction over
the channels → pointwise chain.

Anchor: any ``Conv`` (1-3 spatial dims, transposed or not, any hyper-parameters) whose output is
batched and floating point, followed, through a pointwise chain (``ops/chain.py``'s catalogue, DAG
chains included, as ``conv_epilogue`` grows them), by a reduction over dim 1 (negative dims
normalised):

* ``torch.min(y, 1[, keepdim])[0]`` / ``.values``, ``torch.max`` likewise (the indices unused),
  ``y.min(1)``; ``amin`` / ``amax``; ``sum`` / ``mean``; ``torch.logsumexp``;
* ``softmax`` / ``log_softmax`` over dim 1: ``torch.softmax``, ``F.softmax``, ``Tensor.softmax``,
  ``nn.Softmax(dim=1)`` (and the same for log_softmax); their result keeps every element.

After the reduction a pointwise chain may follow (numbers and one-element tensors as operands; for
softmax / log_softmax also per-channel tensors).  The fused op (``ops/conv_channel_reduce/``) runs
the conv once and everything after it in one Triton kernel per direction.

Priority 150: above ``conv_epilogue`` (100), which would otherwise take the conv and the chain
before the reduction and leave the reduction to Inductor; below ``conv_global_mean`` (200), whose
global mean over the spatial dims stays its own.  Near misses (only where a reduction is in sight):
a reduction over other dims (a mean / sum over spatial dims is ``conv_global_mean``'s and not
reported here), the indices of ``torch.min`` / ``max`` used, a ``dtype=`` argument, a second
reduction after the first, more than ``MAX_CHANNELS`` channels, an unsupported dtype, and the chain's
own reasons (operands, shared intermediates, length).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import Conv, GlobalReduce, Pointwise, Reduce
from ..frontend.normalize import describe_target
from ..match.chain_walk import ChainPart, ChainValues, grow_chain_after, pointwise_step
from ..match.engine import Candidate, ConvAnchoredPattern, MatchContext, fake_of, register_pattern
from ..match.rewrite import dtype_name, rewrite_conv_region
from ..ops.chain import MAX_CHAIN_LENGTH
from ..report import Match, NearMiss, ReasonKind

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Most channels the fused kernels reduce over (``kernels/channel_reduce.py``).
MAX_CHANNELS = 1024
_LOOKAHEAD = 8


@dataclass
class ChannelReduceRegion:
    conv: Conv
    pre: ChainPart
    reduction: Reduce | GlobalReduce
    result: fx.Node
    """The reduction's value: the reduction node, or for min / max its ``[0]``."""
    keepdim: bool
    post: ChainPart

    @property
    def kind(self) -> str:
        return self.reduction.kind


@register_pattern
class ConvChannelReducePattern(ConvAnchoredPattern):
    name = "conv_channel_reduce"
    priority = 150
    description = ("conv/conv-transpose (1-3d) → pointwise chain → one reduction over the channels (min, max, "
                   "amin, amax, sum, mean, logsumexp, softmax, log_softmax) → pointwise chain")

    def match_conv(self, ctx: MatchContext, conv: Conv) -> Optional[Union[Candidate, NearMiss]]:
        anchor = conv.node
        y = fake_of(anchor)
        if not isinstance(y, torch.Tensor) or y.dim() != conv.spec.spatial_dims + 2:
            return None
        if not _reduction_ahead(ctx, anchor, y.dim()):
            return None  # no reduction in sight: not this family's conv

        def miss(at: fx.Node, kind: ReasonKind, msg: str) -> NearMiss:
            return ctx.near_miss(self.name, anchor, at, kind, msg)

        if y.dtype not in FUSED_DTYPES:
            return miss(anchor, ReasonKind.UNSUPPORTED_DTYPE, f"conv output dtype {y.dtype} is not a floating type the fused op supports")

        # 1. the chain before the reduction
        pre = ChainPart([])
        chain = ChainValues(anchor)
        current = anchor
        while True:
            user, why = chain.next_user(ctx, current, fusible=(Pointwise, Reduce, GlobalReduce))
            if user is None:
                return miss(current, ReasonKind.SHARED_INTERMEDIATE, why)
            op = ctx.op(user)
            if isinstance(op, (Reduce, GlobalReduce)):
                break
            if not isinstance(op, Pointwise):
                return miss(user, ReasonKind.UNSUPPORTED_OP,
                            f"`{user.name}` ({describe_target(user)}) before the reduction over the channels is not a fusible pointwise op")
            if len(pre.steps) == MAX_CHAIN_LENGTH:
                return miss(user, ReasonKind.CHAIN_TOO_LONG, f"the chain before the reduction holds at most {MAX_CHAIN_LENGTH} ops")
            step = pointwise_step(ctx, self.name, anchor, op, current, pre.operands, y, chain, FUSED_DTYPES)
            if isinstance(step, NearMiss):
                return step
            pre.steps.append(step)
            pre.step_nodes.append(user)
            pre.labels.append(chain.label(step))
            current = chain.computed(user, len(pre.steps))

        # 2. the reduction
        reduction = op
        why = _reduction_unsupported(reduction, current, y)
        if why is not None:
            return miss(user, *why)
        if not chain.closed(pre, user):
            read_outside = next(n for n in [anchor, *pre.step_nodes] if any(u not in {anchor, *pre.step_nodes, user} for u in n.users))
            return miss(read_outside, ReasonKind.SHARED_INTERMEDIATE, chain.outside_users(read_outside))
        result, nodes_after = user, [user]
        if reduction.kind in ("min", "max") and isinstance(reduction, Reduce):
            users = list(user.users)
            indices = [u for u in users if _is_getitem(u, 1)]
            if indices:
                return miss(indices[0], ReasonKind.UNSUPPORTED_OP,
                            f"the indices of `{user.name}` ({reduction.kind} over the channels) are used by `{indices[0].name}`; only its values fuse")
            if len(users) != 1 or not _is_getitem(users[0], 0):
                return miss(user, ReasonKind.SHARED_INTERMEDIATE,
                            f"`{user.name}` ({reduction.kind} over the channels) is read other than once through its values")
            result = users[0]
            nodes_after.append(result)
        out = fake_of(result)
        if not isinstance(out, torch.Tensor):
            return miss(result, ReasonKind.MISSING_METADATA, f"no metadata for `{result.name}`")
        if out.dtype not in FUSED_DTYPES:
            return miss(result, ReasonKind.UNSUPPORTED_DTYPE, f"`{result.name}` yields {out.dtype}")
        full_size = reduction.kind in ("softmax", "log_softmax")

        # 3. the chain after it
        post = ChainPart(pre.operands)
        def second_reduction(node: fx.Node, op: Any, last: fx.Node) -> Optional[str]:
            if not isinstance(op, (Reduce, GlobalReduce)):
                return None
            return f"`{node.name}` is a second reduction; a fused region holds one reduction (it ends at `{last.name}`)"

        notes = grow_chain_after(ctx, self.name, anchor, result, post, out, FUSED_DTYPES, "the reduction",
                                 refuse=second_reduction, scalar_operands=not full_size)

        region = ChannelReduceRegion(conv, pre, reduction, result, full_size or bool(reduction.keepdim), post)
        nodes = [anchor, *pre.step_nodes, *nodes_after, *post.step_nodes]
        return Candidate(self.name, anchor, nodes, region, _summary(region), notes)

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_channel_reduce as op_module

        region: ChannelReduceRegion = candidate.payload
        conv = region.conv
        conv_fake, final = fake_of(conv.node), fake_of(candidate.nodes[-1])
        config = op_module.ConvChannelReduceConfig(
            conv=conv.spec,
            reduction=region.kind,
            keepdim=region.keepdim,
            pre=tuple(region.pre.steps),
            post=tuple(region.post.steps),
            out_dtype=dtype_name(final.dtype) if final.dtype != conv_fake.dtype else None,
            strict=ctx.strict,
        ).to_json()
        return rewrite_conv_region(
            ctx, candidate, conv, region.pre.operands, op_module.conv_channel_reduce, config,
            "fusion::conv_channel_reduce_fwd", op_module.kernel_path(config, conv_fake.dtype, conv_fake.device.type),
        )  # fmt: skip


def _is_getitem(node: fx.Node, index: int) -> bool:
    return node.op == "call_function" and node.target is operator.getitem and node.args[1] == index


def _channel_dims(op: Reduce | GlobalReduce, rank: int) -> Optional[set[int]]:
    """The dims ``op`` reduces, normalised to ``0..rank-1`` (None: every dim, or one out of range)."""
    if op.dims is None:
        return None
    if any(not -rank <= d < rank for d in op.dims):
        return None
    return {d % rank for d in op.dims}


def _reduction_ahead(ctx: MatchContext, node: fx.Node, rank: int) -> bool:
    """Whether a reduction this family would report on follows within a few pointwise steps (DAG
    chains included): a ``Reduce`` over some dims, or a mean / sum whose dims include the channels
    (one over spatial dims only is ``conv_global_mean``'s).  A reduction over every dim (a loss, a
    ``y.mean()``) is nobody's near miss."""
    frontier, seen = [node], {node}
    for _ in range(_LOOKAHEAD):
        following = []
        for current in frontier:
            for user in current.users:
                op = ctx.op(user)
                if isinstance(op, (Reduce, GlobalReduce)) and op.input is current and op.dims is not None:
                    dims = _channel_dims(op, rank)
                    if isinstance(op, Reduce) or dims is None or 1 in dims:  # (None here: a dim out of range)
                        return True
                if isinstance(op, Pointwise) and user not in seen:
                    seen.add(user)
                    following.append(user)
        frontier = following
    return False


def _reduction_unsupported(op: Reduce | GlobalReduce, flowing: fx.Node, y: torch.Tensor) -> Optional[tuple[ReasonKind, str]]:
    """Why the reduction ``op`` reading ``flowing`` (of rank ``y.dim()``) cannot end the fused
    chain, as ``(reason, message)``, or None."""
    name = op.node.name
    if op.input is not flowing:
        return ReasonKind.UNSUPPORTED_OPERAND, f"`{name}` does not reduce the chain's value"
    rank = y.dim()
    dims = _channel_dims(op, rank)
    if dims != {1}:
        what = "every dim" if op.dims is None else f"dims {sorted(dims) if dims is not None else list(op.dims)}"
        return ReasonKind.DIMENSION_MISMATCH, (f"`{name}` ({op.kind}) reduces {what} of the conv output; only a "
                                               "reduction over the channels (dim 1) fuses")
    if isinstance(op, Reduce) and op.dtype is not None:
        return ReasonKind.UNSUPPORTED_ARGUMENT, f"`{name}` ({op.kind}) has a dtype= argument ({op.dtype}), which is not fused"
    channels = y.shape[1]
    if isinstance(channels, torch.SymInt) and not channels.node.expr.is_number:
        return ReasonKind.DIMENSION_MISMATCH, f"`{name}` reduces a dynamic number of channels ({channels})"
    if int(channels) > MAX_CHANNELS:
        return ReasonKind.DIMENSION_MISMATCH, (f"`{name}` reduces {int(channels)} channels; the fused kernels hold at most "
                                               f"{MAX_CHANNELS}")
    return None


def _summary(region: ChannelReduceRegion) -> str:
    spec = region.conv.spec
    parts = [f"conv{'_transpose' if spec.transposed else ''}{spec.spatial_dims}d", *region.pre.labels]
    full = region.kind in ("softmax", "log_softmax")
    parts.append(f"{region.kind}(dim=1{', keepdim' if region.keepdim and not full else ''})")
    parts += region.post.labels
    return " -> ".join(parts)
