"""Pattern family ``conv_epilogue``: conv / conv-transpose → [batch norm, eval] → pointwise chain → optional pool.

Anchor: any ``Conv`` (1-3 spatial dims, transposed or not, any hyper-parameters, bias or not) whose
output is batched and floating point.  From there the chain grows one user at a time while

* the next op is the current value's only user, or, of several users, the only fusible one whose
  inputs the chain already holds (the others must join the chain later: ``y + torch.tanh(y)``);
* that op is a supported pointwise op (``ops/chain.py``) whose other operands are numbers, 0-d or
  one-element tensors, per-channel tensors, or a value the chain computed before (a DAG epilogue: the
  first operand of an arithmetic op, ``minimum`` / ``maximum`` or a clamp bound, ``ChainValue``); an
  operand computed from the conv output outside the chain stops it;
* the chain is shorter than ``MAX_CHAIN_LENGTH``.

The region then ends at the last value of the longest prefix whose earlier values are read only
inside it (a value read outside, such as a graph output, can only be the region's result).

A batch norm with running statistics (eval mode) joins the chain as a per-channel ``mul`` and
``add``, their operands computed from its statistics when the region is rewritten
(``ops/bn_fold.py``); one with batch statistics (training mode) stops it.
A max or avg pool with the conv's number of spatial dims may end the region.  A region needs at least
one pointwise op or a pool.  Every stop is recorded as a ``NearMiss`` with its reason.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import BatchNorm, Conv, Opaque, ParamRef, Pointwise, Pool
from ..frontend.normalize import describe_target, target_name
from ..match.chain_walk import ChainValues, pointwise_step
from ..match.engine import Candidate, ConvAnchoredPattern, MatchContext, fake_of, register_pattern
from ..match.rewrite import Deferred, dtype_name, materialize, rewrite_conv_region
from ..ops.chain import MAX_CHAIN_LENGTH, ChainStep, PointwiseKind, TensorRef
from ..ops.config import ConvEpilogueConfig
from ..report import Match, NearMiss, ReasonKind

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class EpilogueRegion:
    conv: Conv
    steps: list[ChainStep]
    step_nodes: list[fx.Node]
    """The nodes after the conv, in graph order: one per op (a batch norm is two chain steps)."""
    operands: list[Union[fx.Node, Deferred]]
    pool: Optional[Pool]
    labels: list[str] = field(default_factory=list)
    """What each of ``step_nodes`` is, for the summary."""


@register_pattern
class ConvEpiloguePattern(ConvAnchoredPattern):
    name = "conv_epilogue"
    priority = 100
    description = ("conv/conv-transpose (1-3d) → chain of pointwise ops with scalar, per-channel or earlier "
                   "chain values as operands, and eval-mode batch norms (folded into per-channel scale and shift) "
                   "→ optional max/avg pool")

    def match_conv(self, ctx: MatchContext, conv: Conv) -> Union[Candidate, NearMiss]:
        anchor = conv.node
        y = fake_of(anchor)
        miss = lambda at, kind, msg: ctx.near_miss(self.name, anchor, at, kind, msg)  # noqa: E731
        if not isinstance(y, torch.Tensor):
            return miss(anchor, ReasonKind.MISSING_METADATA, f"no shape/dtype metadata for `{anchor.name}`")
        if y.dtype not in FUSED_DTYPES:
            return miss(anchor, ReasonKind.UNSUPPORTED_DTYPE, f"conv output dtype {y.dtype} is not a floating type the fused op supports")
        if y.dim() != conv.spec.spatial_dims + 2:
            return miss(anchor, ReasonKind.DIMENSION_MISMATCH, f"unbatched conv input (output rank {y.dim()})")

        region = EpilogueRegion(conv, [], [], [], None)
        chain = ChainValues(anchor)
        stop: Optional[NearMiss] = None
        current = anchor
        while True:
            chain.prefix_ends_at(region)
            user, why = chain.next_user(ctx, current)
            if user is None:
                stop = miss(current, ReasonKind.SHARED_INTERMEDIATE, why)
                break
            op = ctx.op(user)
            if isinstance(op, BatchNorm):
                why = _unfoldable(op, current, y)
                if why is not None:
                    stop = miss(user, ReasonKind.UNSUPPORTED_OP, why)
                    break
                if len(region.steps) + 2 > MAX_CHAIN_LENGTH:
                    stop = miss(user, ReasonKind.CHAIN_TOO_LONG,
                                f"the fused chain holds at most {MAX_CHAIN_LENGTH} ops (a batch norm takes two)")
                    break
                n = len(region.operands)
                region.steps += [ChainStep(PointwiseKind.MUL, (TensorRef(n),)), ChainStep(PointwiseKind.ADD, (TensorRef(n + 1),))]
                region.operands += _folded_operands(ctx, op, conv.spec.spatial_dims)
                region.step_nodes.append(user)
                region.labels.append("batch_norm (folded)")
                current = chain.computed(user, len(region.steps))
                continue
            if isinstance(op, Pointwise):
                if len(region.steps) == MAX_CHAIN_LENGTH:
                    stop = miss(user, ReasonKind.CHAIN_TOO_LONG, f"the fused chain holds at most {MAX_CHAIN_LENGTH} ops")
                    break
                step = pointwise_step(ctx, self.name, anchor, op, current, region.operands, y, chain, FUSED_DTYPES)
                if isinstance(step, NearMiss):
                    stop = step
                    break
                region.steps.append(step)
                region.step_nodes.append(user)
                region.labels.append(chain.label(step))
                current = chain.computed(user, len(region.steps))
                continue
            if isinstance(op, Pool):
                stop = self._pool(ctx, op, conv, region, miss)
                break
            description = op.description if isinstance(op, Opaque) else describe_target(user)
            why = _not_fused_yet(user, y.dim()) or "is not a fusible pointwise op or pool"
            stop = miss(user, ReasonKind.UNSUPPORTED_OP, f"`{user.name}` ({description}) {why}")
            break
        if region.pool is None or not chain.closed(region, region.pool.node):
            region.pool = None
            current, read_outside = chain.longest_closed_prefix(region)
            if read_outside is not None:
                stop = miss(read_outside, ReasonKind.SHARED_INTERMEDIATE, chain.outside_users(read_outside))

        if not region.steps and region.pool is None:
            if stop is None or [u.op for u in anchor.users] == ["output"]:
                return miss(anchor, ReasonKind.NO_EPILOGUE, "the conv output goes straight to the graph output")
            return stop
        nodes = [anchor, *region.step_nodes] + ([region.pool.node] if region.pool else [])
        # A chain that simply ends at the graph output or at the next conv is no near miss; any other
        # stop is reported.
        natural_end = [u.op for u in current.users] == ["output"] or (
            len(current.users) == 1 and isinstance(ctx.op(next(iter(current.users))), Conv))
        notes = [stop] if stop is not None and region.pool is None and not natural_end else []
        return Candidate(self.name, anchor, nodes, region, _summary(conv, region), notes)

    def _pool(self, ctx: MatchContext, op: Pool, conv: Conv, region: EpilogueRegion, miss) -> Optional[NearMiss]:
        if op.spatial_dims != conv.spec.spatial_dims:
            return miss(op.node, ReasonKind.DIMENSION_MISMATCH,
                        f"a {op.spatial_dims}-d pool after a {conv.spec.spatial_dims}-d conv")
        if op.unsupported:
            return miss(op.node, ReasonKind.UNSUPPORTED_ARGUMENT, f"{op.spec.kind}-pool with {op.unsupported}")
        if not isinstance(fake_of(op.node), torch.Tensor):
            return miss(op.node, ReasonKind.MISSING_METADATA, f"no metadata for `{op.node.name}`")
        region.pool = op
        return None

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_epilogue as op_module

        region: EpilogueRegion = candidate.payload
        conv = region.conv
        conv_fake, out_fake = fake_of(conv.node), fake_of(candidate.nodes[-1])
        # WHY absorb autocast's casts only before a max pool or where no gradient flows: the op then
        # takes the fp32 input, weight and bias and its kernels cast them as they load them (no cast
        # kernels around it; the Triton backward reads x as it is).  With a gradient and no max pool
        # the backward may run the library conv backward, which needs x in the conv's dtype: the
        # graph's cast, done once and saved, is cheaper there than casting again in the backward
        # (Conv2d 64->64 k3 on 64x64x256x256, bf16 train: +0.55 ms, H100).  Without a gradient (the
        # graph was traced under no_grad, or nothing in it requires grad; Dynamo guards on grad mode)
        # nothing is saved, so the cast pass is pure cost.
        absorb = (region.pool is not None and region.pool.spec.kind == "max") or not conv_fake.requires_grad
        config = ConvEpilogueConfig(
            conv=conv.spec,
            chain=tuple(region.steps),
            pool=region.pool.spec if region.pool else None,
            out_dtype=dtype_name(out_fake.dtype) if out_fake.dtype != conv_fake.dtype else None,
            strict=ctx.strict,
            compute_dtype=dtype_name(conv_fake.dtype) if absorb else None,
        ).to_json()
        return rewrite_conv_region(
            ctx, candidate, conv, region.operands, op_module.conv_epilogue, config, "fusion::conv_epilogue_fwd",
            op_module.kernel_path(config, conv_fake.dtype, conv_fake.device.type), cast_inputs=not absorb,
        )


#: Normalizations with statistics per sample (or per group of channels), by function name, and the
#: family that takes each (None: none yet).
_SAMPLE_NORMS = {"group_norm": ("GroupNorm", "conv_group_norm"), "instance_norm": ("InstanceNorm", "conv_group_norm"),
                 "layer_norm": ("LayerNorm", "conv_layer_norm")}
#: Reductions that, over the conv's channels, the ``conv_channel_reduce`` family takes.
_REDUCTIONS = {"softmax", "log_softmax", "min", "max", "amin", "amax", "sum", "mean", "logsumexp"}


def _not_fused_yet(node: fx.Node, rank: int) -> Optional[str]:
    """What a near miss says about a normalization or a reduction over the conv's channels (families
    the conv epilogue does not take), or None for any other op.  ``rank``: the conv output's rank."""
    name = target_name(node)
    if name in _SAMPLE_NORMS:
        label, family = _SAMPLE_NORMS[name]
        if family is None:
            return f"normalizes by statistics of the conv output ({label}), which is not fused yet"
        return (f"normalizes by statistics of the conv output ({label}): the {family} family's (its near miss says "
                "why it did not fuse)")
    if name not in _REDUCTIONS:
        return None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if all(isinstance(d, int) and not isinstance(d, bool) for d in dims) and 1 in {d % rank for d in dims}:
        article = "an" if name[0] in "aeiou" else "a"
        return (f"reduces over the conv's channels: {article} {name} over dim 1 is the conv_channel_reduce family's "
                "(its near miss says why it did not fuse)")
    return None


def _unfoldable(bn: BatchNorm, flowing: fx.Node, y: torch.Tensor) -> Optional[str]:
    """Why batch norm ``bn``, reading the chain's ``flowing`` value, cannot join the chain, or None."""
    if bn.training:
        return ("a batch norm with batch statistics (training mode) is the conv_batch_norm family's (its near miss "
                "says why it did not fuse); in eval mode it is folded")
    if bn.input is not flowing:
        return "the chain's value is not the batch norm's input"
    for name in ("running_mean", "running_var", "weight", "bias"):
        value = getattr(bn, name)
        if isinstance(value, fx.Node):
            fake = fake_of(value)
            if not isinstance(fake, torch.Tensor) or tuple(fake.shape) != (y.shape[1],):
                return f"the batch norm's {name} `{value.name}` is not one value per conv output channel"
        elif value is not None and not isinstance(value, ParamRef):
            return f"the batch norm's {name} is not a tensor"
    return None


def _folded_operands(ctx: MatchContext, bn: BatchNorm, spatial_dims: int) -> list[Deferred]:
    """Batch norm's per-channel scale and shift (``ops/bn_fold.py``), made when the region is rewritten."""
    from ..ops import bn_fold

    made: dict[fx.Graph, fx.Node] = {}

    def both(graph: fx.Graph) -> fx.Node:  # one call makes both operands, once per rewritten graph
        if graph not in made:
            stats = (materialize(graph, ctx.resolve(v)) for v in (bn.running_mean, bn.running_var, bn.weight, bn.bias))
            made[graph] = graph.call_function(bn_fold.scale_and_shift, (*stats, bn.eps, spatial_dims))
        return made[graph]

    return [Deferred(lambda graph, i=i: graph.call_function(operator.getitem, (both(graph), i))) for i in (0, 1)]


def _summary(conv: Conv, region: EpilogueRegion) -> str:
    d = conv.spec.spatial_dims
    parts = [f"conv{'_transpose' if conv.spec.transposed else ''}{d}d"]
    parts += region.labels
    if region.pool:
        parts.append(f"{region.pool.spec.kind}_pool{d}d")
    return " -> ".join(parts)
