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

A conv walk centred on the reduction (``match/conv_walk.py``): it takes a conv before the plain
chain of ``conv_epilogue`` would, which would leave the reduction to Inductor; a global mean over
the spatial dims is ``conv_global_mean``'s, not in this family's sight.  Near misses (only where a reduction is in sight):
a reduction over other dims (a mean / sum over spatial dims is ``conv_global_mean``'s and not
reported here), the indices of ``torch.min`` / ``max`` used, a ``dtype=`` argument, a second
reduction after the first, more than ``MAX_CHANNELS`` channels, an unsupported dtype, and the chain's
own reasons (operands, shared intermediates, length).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from ..frontend.canonical import CanonicalOp, GlobalReduce, Reduce
from ..frontend.normalize import target_name
from ..match.conv_walk import Centre, CentreSite, ConvRegion, ConvWalkPattern, Refusal, claim_wording
from ..match.engine import Candidate, MatchContext, fake_of, register_pattern
from ..match.rewrite import dtype_if_changed, region_result, rewrite_conv_region
from ..report import Match, ReasonKind

#: Most channels the fused kernels reduce over (``kernels/channel_reduce.py``).
MAX_CHANNELS = 1024
#: Reductions this family takes over the conv's channels, by function name, as its near misses' words
#: name them.
_REDUCTIONS = {"softmax", "log_softmax", "min", "max", "amin", "amax", "sum", "mean", "logsumexp"}
#: Reductions whose result keeps every element (the chain after them keeps the channels).
_FULL_SIZE = ("softmax", "log_softmax")


@dataclass(frozen=True)
class ChannelReduceFacts:
    """What the config needs from the reduction: its kind and whether its result keeps the reduced
    dim (always for softmax / log_softmax)."""

    kind: str
    keepdim: bool


def _in_sight(op: Reduce | GlobalReduce, rank: int) -> bool:
    """A reduction this family reports on: a ``Reduce`` over some dims, or a mean / sum whose dims
    include the channels (one over spatial dims only is ``conv_global_mean``'s).  A reduction over
    every dim (a loss, a ``y.mean()``) is nobody's near miss."""
    if op.dims is None:
        return False
    dims = _channel_dims(op, rank)
    return isinstance(op, Reduce) or dims is None or 1 in dims  # (None here: a dim out of range)


def _refusal(site: CentreSite) -> Optional[Refusal]:
    """Why the reduction cannot end the chain before it."""
    op: Reduce | GlobalReduce = site.op
    name, y = site.node.name, site.y
    if op.input is not site.flowing:
        return Refusal(ReasonKind.UNSUPPORTED_OPERAND, f"`{name}` does not reduce the chain's value")
    rank = y.dim()
    dims = _channel_dims(op, rank)
    if dims != {1}:
        what = "every dim" if op.dims is None else f"dims {sorted(dims) if dims is not None else list(op.dims)}"
        return Refusal(ReasonKind.DIMENSION_MISMATCH, f"`{name}` ({op.kind}) reduces {what} of the conv output; only a "
                                                      "reduction over the channels (dim 1) fuses")  # fmt: skip
    if isinstance(op, Reduce) and op.dtype is not None:
        return Refusal(ReasonKind.UNSUPPORTED_ARGUMENT, f"`{name}` ({op.kind}) has a dtype= argument ({op.dtype}), which is not fused")
    channels = y.shape[1]
    if isinstance(channels, torch.SymInt) and not channels.node.expr.is_number:
        return Refusal(ReasonKind.DIMENSION_MISMATCH, f"`{name}` reduces a dynamic number of channels ({channels})")
    if int(channels) > MAX_CHANNELS:
        return Refusal(ReasonKind.DIMENSION_MISMATCH, (f"`{name}` reduces {int(channels)} channels; the fused kernels "
                                                       f"hold at most {MAX_CHANNELS}"))  # fmt: skip
    return None


def _value_nodes(site: CentreSite) -> list[fx.Node] | Refusal:
    """The reduction's node, and for ``torch.min`` / ``max`` over a dim the ``[0]`` that takes its
    values (its indices must be unused)."""
    op, user = site.op, site.node
    if not (op.kind in ("min", "max") and isinstance(op, Reduce)):
        return [user]
    users = list(user.users)
    indices = [u for u in users if _is_getitem(u, 1)]
    if indices:
        return Refusal(ReasonKind.UNSUPPORTED_OP,
                       f"the indices of `{user.name}` ({op.kind} over the channels) are used by `{indices[0].name}`; "
                       "only its values fuse", at=indices[0])  # fmt: skip
    if len(users) != 1 or not _is_getitem(users[0], 0):
        return Refusal(ReasonKind.SHARED_INTERMEDIATE,
                       f"`{user.name}` ({op.kind} over the channels) is read other than once through its values")
    return [user, users[0]]


def _facts(site: CentreSite) -> ChannelReduceFacts:
    op = site.op
    return ChannelReduceFacts(op.kind, op.kind in _FULL_SIZE or bool(op.keepdim))


def _keeps_channels(op: Reduce | GlobalReduce) -> bool:
    return op.kind in _FULL_SIZE


def _second_reduction(node: fx.Node, op: Any, last: fx.Node) -> Optional[str]:
    if not isinstance(op, (Reduce, GlobalReduce)):
        return None
    return f"`{node.name}` is a second reduction; a fused region holds one reduction (it ends at `{last.name}`)"


def _label(region: ConvRegion) -> str:
    facts: ChannelReduceFacts = region.facts
    full = facts.kind in _FULL_SIZE
    return f"{facts.kind}(dim=1{', keepdim' if facts.keepdim and not full else ''})"


CHANNEL_REDUCTION = Centre((Reduce, GlobalReduce), "the reduction over the channels", _label, _refusal, _facts,
                           in_sight=_in_sight, static_channels=False, value_nodes=_value_nodes,
                           keeps_channels=_keeps_channels, refuse_after=_second_reduction)  # fmt: skip


@register_pattern
class ConvChannelReducePattern(ConvWalkPattern):
    name = "conv_channel_reduce"
    description = ("conv/conv-transpose (1-3d) → pointwise chain → one reduction over the channels (min, max, "
                   "amin, amax, sum, mean, logsumexp, softmax, log_softmax) → pointwise chain")
    centre = CHANNEL_REDUCTION

    def claim(self, node: fx.Node, op: CanonicalOp, rank: int) -> Optional[str]:
        name = target_name(node)
        if name not in _REDUCTIONS:
            return None
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims) or 1 not in {d % rank for d in dims}:
            return None
        article = "an" if name[0] in "aeiou" else "a"
        return claim_wording(f"reduces over the conv's channels: {article} {name} over dim 1 is", self.name)

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_channel_reduce as op_module

        region: ConvRegion = candidate.payload
        conv = region.conv
        conv_fake = fake_of(conv.node)
        config = op_module.ConvChannelReduceConfig(
            conv=conv.spec,
            reduction=region.facts.kind,
            keepdim=region.facts.keepdim,
            pre=tuple(region.pre.steps),
            post=tuple(region.post.steps),
            out_dtype=dtype_if_changed(region_result(ctx, candidate.nodes[-1]), conv_fake),
            strict=ctx.strict,
        ).to_json()
        return rewrite_conv_region(
            ctx, candidate, conv, region.post.operands, op_module.conv_channel_reduce, config,
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
