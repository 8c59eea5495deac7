"""Pattern family ``conv_epilogue``: conv / conv-transpose → [batch norm, eval] → pointwise chain → optional pool.

Anchor: any ``Conv`` (1-3 spatial dims, transposed or not, any hyper-parameters, bias or not) whose
output is batched and floating point.  From there the chain grows one user at a time while

* the current value has exactly one user and is not a graph output (otherwise the chain stops
  *before* that user: the shared value must still be produced, so it becomes the region's result);
* that user is a supported pointwise op (``ops/chain.py``) whose other operands are numbers, 0-d or
  one-element tensors, or per-channel tensors, none computed from the region itself;
* the chain is shorter than ``MAX_CHAIN_LENGTH``.

A batch norm with running statistics (eval mode) joins the chain as a per-channel ``mul`` and
``add``, their operands computed from its statistics when the region is rewritten
(``ops/bn_fold.py``); one with batch statistics (training mode) stops it.
A max or avg pool with the conv's number of spatial dims may end the region.  A region needs at least
one pointwise op or a pool.  Every stop is recorded as a ``NearMiss`` with its reason.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import BatchNorm, Conv, Opaque, ParamRef, Pointwise, Pool
from ..frontend.normalize import describe_target
from ..match.engine import Candidate, MatchContext, Pattern, fake_of, register_pattern
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
class ConvEpiloguePattern(Pattern):
    name = "conv_epilogue"
    priority = 100
    description = ("conv/conv-transpose (1-3d) → chain of pointwise ops with scalar or per-channel operands and "
                   "eval-mode batch norms (folded into per-channel scale and shift) → optional max/avg pool")

    def find(self, ctx: MatchContext) -> Iterator[Union[Candidate, NearMiss]]:
        for conv in ctx.convs():
            yield self._grow(ctx, conv)

    def _grow(self, ctx: MatchContext, conv: Conv) -> Union[Candidate, NearMiss]:
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
        stop: Optional[NearMiss] = None
        current = anchor
        while True:
            user, why = ctx.sole_user(current)
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
                current = user
                continue
            if isinstance(op, Pointwise):
                if len(region.steps) == MAX_CHAIN_LENGTH:
                    stop = miss(user, ReasonKind.CHAIN_TOO_LONG, f"the fused chain holds at most {MAX_CHAIN_LENGTH} ops")
                    break
                step = self._step(ctx, op, current, region, y)
                if isinstance(step, NearMiss):
                    stop = step
                    break
                region.steps.append(step)
                region.step_nodes.append(user)
                region.labels.append(step.kind.name.lower())
                current = user
                continue
            if isinstance(op, Pool):
                stop = self._pool(ctx, op, conv, region, miss)
                break
            description = op.description if isinstance(op, Opaque) else describe_target(user)
            stop = miss(user, ReasonKind.UNSUPPORTED_OP, f"`{user.name}` ({description}) is not a fusible pointwise op or pool")
            break

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

    def _step(self, ctx: MatchContext, op: Pointwise, flowing: fx.Node, region: EpilogueRegion, y) -> Union[ChainStep, NearMiss]:
        anchor = region.conv.node
        seen = op.with_flowing(flowing)
        if isinstance(seen, str):
            return ctx.near_miss(self.name, anchor, op.node, ReasonKind.UNSUPPORTED_OPERAND, seen)
        kind, values = seen
        out = fake_of(op.node)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(fake_of(flowing).shape):
            return ctx.near_miss(self.name, anchor, op.node, ReasonKind.UNSUPPORTED_OPERAND,
                                 f"`{op.node.name}` changes the shape (an operand broadcasts the result)")
        if out.dtype not in FUSED_DTYPES:
            return ctx.near_miss(self.name, anchor, op.node, ReasonKind.UNSUPPORTED_DTYPE, f"`{op.node.name}` yields {out.dtype}")
        # An operand cannot be computed from the region: that would need a second user of a region
        # node, and the chain already stops at any value with two users.
        operands = []
        trial = list(region.operands)
        for value in values:
            got = ctx.classify_operand(value, y, trial)
            if isinstance(got, str):
                return ctx.near_miss(self.name, anchor, op.node, ReasonKind.UNSUPPORTED_OPERAND, got)
            operands.append(got)
        for i, got in enumerate(operands):
            if isinstance(got, TensorRef) and i not in kind.differentiable_operands:
                fake = fake_of(trial[got.index])
                if getattr(fake, "requires_grad", False):
                    return ctx.near_miss(self.name, anchor, op.node, ReasonKind.UNSUPPORTED_OPERAND,
                                         f"the {kind.name.lower()} parameter `{trial[got.index].name}` requires grad; only arithmetic operands and the bound of clamp_min / clamp_max get gradients")
        region.operands[:] = trial
        return ChainStep(kind, tuple(operands))

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


def _unfoldable(bn: BatchNorm, flowing: fx.Node, y: torch.Tensor) -> Optional[str]:
    """Why batch norm ``bn``, reading the chain's ``flowing`` value, cannot join the chain, or None."""
    if bn.training:
        return "a batch norm with batch statistics (training mode) is not fused yet; in eval mode it is folded"
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
