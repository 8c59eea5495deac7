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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import BatchNorm, Conv, Opaque, ParamRef, Pointwise, Pool
from ..frontend.normalize import describe_target, target_name
from ..match.engine import Candidate, MatchContext, Pattern, fake_of, register_pattern
from ..match.rewrite import Deferred, dtype_name, materialize, rewrite_conv_region
from ..ops.chain import MAX_CHAIN_LENGTH, ChainStep, ChainValue, PointwiseKind, TensorRef
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
    description = ("conv/conv-transpose (1-3d) → chain of pointwise ops with scalar, per-channel or earlier "
                   "chain values as operands, and eval-mode batch norms (folded into per-channel scale and shift) "
                   "→ optional max/avg pool")

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
        chain = _ChainValues(anchor)
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
                step = self._step(ctx, op, current, region, y, chain)
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

    def _step(self, ctx: MatchContext, op: Pointwise, flowing: fx.Node, region: EpilogueRegion, y,
              chain: _ChainValues) -> Union[ChainStep, NearMiss]:  # fmt: skip
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
        operands = []
        trial = list(region.operands)
        for i, value in enumerate(values):
            got = chain.operand(value, kind, i)
            if got is None:
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


class _ChainValues:
    """What a growing chain has computed, so that it may read a value again (a DAG epilogue:
    ``y * torch.sigmoid(2 * y)``, ``y + torch.tanh(y)``).

    * ``position[node]``: the step whose input the region node is (``ChainValue(position)``);
    * ``downstream``: every node computed from the conv output; one of them outside the chain cannot be
      an operand (the fused op would read its own result);
    * the prefixes the region could end at, as the lengths of its ``steps``, ``step_nodes`` and
      ``operands`` there: a region may end at a node only if no node before it is read outside the
      region (``longest_closed_prefix``).
    """

    def __init__(self, anchor: fx.Node) -> None:
        self.anchor = anchor
        self.position: dict[fx.Node, int] = {anchor: 0}
        self.downstream = _computed_from(anchor)
        self._prefixes: list[tuple[int, int, int]] = []

    def prefix_ends_at(self, region: EpilogueRegion) -> None:
        """Record that ``region``, as it is now, could end at its last node."""
        self._prefixes.append((len(region.steps), len(region.step_nodes), len(region.operands)))

    def computed(self, node: fx.Node, steps: int) -> fx.Node:
        """Record ``node`` as the chain's value after its first ``steps`` steps; returns it."""
        self.position[node] = steps
        return node

    def label(self, step: ChainStep) -> str:
        """The step's kind, with the earlier value it reads again: ``add(conv2d)``."""
        reads = [o for o in step.operands if isinstance(o, ChainValue)]
        if not reads:
            return step.kind.name.lower()
        node = next(n for n, p in self.position.items() if p == reads[0].position)
        return f"{step.kind.name.lower()}({node.name})"

    def operand(self, value: Any, kind: PointwiseKind, index: int) -> Union[ChainValue, str, None]:
        """``ChainValue`` for a value the chain holds, a reason for one computed from the conv output
        outside the chain, None for anything else (an outside operand)."""
        if not isinstance(value, fx.Node) or (value not in self.position and value not in self.downstream):
            return None
        if value not in self.position:
            return f"operand `{value.name}` is computed from the conv output outside the chain"
        if index not in kind.differentiable_operands:
            return f"{kind.name.lower()} cannot read the chain's own value `{value.name}` as operand {index}"
        return ChainValue(self.position[value])

    def next_user(self, ctx: MatchContext, current: fx.Node) -> tuple[Optional[fx.Node], str]:
        """The op the chain continues with: ``current``'s only user, or of several users the only
        fusible one whose other inputs the chain holds (the others must join later); else
        ``(None, why)``."""
        user, why = ctx.sole_user(current)
        if user is not None:
            return user, ""
        ready = [u for u in current.users if u.op != "output" and isinstance(ctx.op(u), (Pointwise, BatchNorm, Pool))
                 and all(n in self.position or n not in self.downstream for n in u.all_input_nodes)]
        if len(ready) == 1:
            return ready[0], ""
        return None, why + (" (the chain would branch)" if len(ready) > 1 else "")

    def closed(self, region: EpilogueRegion, result: fx.Node, step_nodes: Optional[int] = None) -> bool:
        """Whether the conv, the first ``step_nodes`` of ``region``'s step nodes (all by default) and
        ``result`` form a region whose only value read outside is ``result``."""
        inside = {self.anchor, *region.step_nodes[:step_nodes], result}
        return all(u in inside for n in inside if n is not result for u in n.users)

    def longest_closed_prefix(self, region: EpilogueRegion) -> tuple[fx.Node, Optional[fx.Node]]:
        """Cut ``region`` (no pool) back to its longest prefix that is ``closed``: ``(its result, the
        first node of the whole region read outside it)`` (None when the whole chain was closed)."""
        held = [self.anchor, *region.step_nodes]
        read_outside = next((n for n in held[:-1] if any(u not in held for u in n.users)), None)
        for steps, step_nodes, operands in reversed(self._prefixes):
            result = held[step_nodes]
            if self.closed(region, result, step_nodes):
                del region.steps[steps:], region.step_nodes[step_nodes:], region.operands[operands:]
                del region.labels[step_nodes:]  # one label per step node
                return result, read_outside
        raise AssertionError("the conv output alone is always a closed region")

    @staticmethod
    def outside_users(node: fx.Node) -> str:
        return f"`{node.name}` is read again outside the chain (by " + ", ".join(
            "the graph output" if u.op == "output" else f"`{u.name}`" for u in node.users) + ")"


#: Normalizations with statistics per sample (or per group of channels), by function name.
_SAMPLE_NORMS = {"group_norm": "GroupNorm", "instance_norm": "InstanceNorm", "layer_norm": "LayerNorm"}
#: Reductions that, over the conv's channels, a channel-reduction epilogue would take.
_REDUCTIONS = {"softmax", "log_softmax", "min", "max", "amin", "amax", "sum", "mean", "logsumexp"}


def _not_fused_yet(node: fx.Node, rank: int) -> Optional[str]:
    """What a near miss says about a normalization or a reduction over the conv's channels (families
    the conv epilogue does not take), or None for any other op.  ``rank``: the conv output's rank."""
    name = target_name(node)
    if name in _SAMPLE_NORMS:
        return f"normalizes by statistics of the conv output ({_SAMPLE_NORMS[name]}), which is not fused yet"
    if name not in _REDUCTIONS:
        return None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if all(isinstance(d, int) and not isinstance(d, bool) for d in dims) and 1 in {d % rank for d in dims}:
        article = "an" if name[0] in "aeiou" else "a"
        return f"reduces over the conv's channels: {article} {name} over dim 1 is not fused yet"
    return None


def _computed_from(anchor: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(anchor.users)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.users)
    return seen


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
