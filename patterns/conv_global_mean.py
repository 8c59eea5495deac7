"""Pattern family ``conv_global_mean``: conv / conv-transpose → per-channel affine ops → global mean.

The mean over every spatial position of a convolution is linear in its input, so the fused op
computes it from per-tap sums of the input without producing the conv output
(``ops/conv_global_mean/``).  Matched spellings of the reduction, all normalised to "mean over all spatial
dims" with or without kept dims:

* ``torch.mean(x, dims, keepdim)``, ``x.mean(...)``, negative dims, ``F.adaptive_avg_pool{d}d(x, 1)``;
* a reduction in several steps (a mean of a mean) as long as together they cover every spatial dim
  and nothing else;
* ``x.sum(dims) / n`` (or ``* (1/n)``) where ``n`` is the number of elements the sums reduced.

Before the reduction, ``mul/add/sub/div`` by numbers or per-channel tensors are folded in (they
commute with the mean).  Anything nonlinear stops the match; ``conv_epilogue`` may then fuse the conv
with that op instead.  The family claims the mean (``Precedence.CLAIMS_AN_OP``), so it takes a conv
before the plain chain of ``conv_epilogue`` would: the algebraic rewrite removes the conv output
altogether.  It keeps a walker of its own: its steps must commute with the mean, and its reduction
may be spelled in several steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import Conv, GlobalReduce, Pointwise
from ..match.conv_walk import FUSED_DTYPES
from ..match.engine import Candidate, ConvAnchoredPattern, MatchContext, fake_of, register_pattern
from ..match.rewrite import dtype_name, region_result, rewrite_conv_region
from ..ops.chain import ChainStep, PointwiseKind
from ..report import Match, NearMiss, ReasonKind

AFFINE_KINDS = (PointwiseKind.MUL, PointwiseKind.ADD, PointwiseKind.SUB, PointwiseKind.RSUB, PointwiseKind.DIV)
_LOOKAHEAD = 8


@dataclass
class MeanRegion:
    conv: Conv
    affine: list[ChainStep] = field(default_factory=list)
    operands: list[fx.Node] = field(default_factory=list)
    nodes: list[fx.Node] = field(default_factory=list)
    spellings: list[str] = field(default_factory=list)


@register_pattern
class ConvGlobalMeanPattern(ConvAnchoredPattern):
    name = "conv_global_mean"
    description = "conv/conv-transpose (1-3d) → per-channel affine ops → mean over all spatial dims (computed algebraically)"

    def match_conv(self, ctx: MatchContext, conv: Conv) -> Optional[Union[Candidate, NearMiss]]:
        anchor = conv.node
        y = fake_of(anchor)
        if not isinstance(y, torch.Tensor) or y.dim() != conv.spec.spatial_dims + 2:
            return None
        region = MeanRegion(conv, nodes=[anchor])

        def miss(at: fx.Node, kind: ReasonKind, msg: str, certain: bool = False) -> Optional[NearMiss]:
            # Report only where a reduction was reached or is in sight: other convs are simply not ours.
            if certain or self._reduction_ahead(ctx, at):
                return ctx.near_miss(self.name, anchor, at, kind, msg)
            return None

        if y.dtype not in FUSED_DTYPES:
            return miss(anchor, ReasonKind.UNSUPPORTED_DTYPE, f"conv output dtype {y.dtype}")
        current = anchor
        # 1. per-channel affine ops
        while True:
            user, why = ctx.sole_user(current)
            if user is None:
                return miss(current, ReasonKind.SHARED_INTERMEDIATE, why)
            op = ctx.op(user)
            if not isinstance(op, Pointwise):
                break
            seen = op.with_flowing(current)
            if isinstance(seen, str) or seen[0] not in AFFINE_KINDS:
                label = op.kind.name.lower() if isinstance(seen, str) else seen[0].name.lower()
                return miss(user, ReasonKind.UNSUPPORTED_OP,
                            f"`{user.name}` ({label}) before the mean is not a per-channel affine op (mul/add/sub/div)")
            kind, values = seen
            trial = list(region.operands)
            operands = []
            for value in values:
                if isinstance(value, fx.Node) and value in region.nodes:  # ``y0 + y0`` of a one-element y0
                    return miss(user, ReasonKind.UNSUPPORTED_OPERAND,
                                f"`{user.name}` reads the region's own value `{value.name}` as an operand; the steps "
                                "before the mean take numbers and per-channel tensors")
                got = ctx.classify_operand(value, y, trial)
                if isinstance(got, str):
                    return miss(user, ReasonKind.UNSUPPORTED_OPERAND, got)
                operands.append(got)
            out = fake_of(user)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(y.shape):
                return miss(user, ReasonKind.UNSUPPORTED_OPERAND, f"`{user.name}` changes the shape")
            region.operands[:] = trial
            region.affine.append(ChainStep(kind, tuple(operands)))
            region.nodes.append(user)
            current = user

        # 2. reductions that together cover every spatial dim (and nothing else)
        rank = y.dim()
        dims_left = list(range(rank))  # original dim of each current dim
        spatial = set(range(2, rank))
        reduced: set[int] = set()
        sum_count: Optional[int] = 1  # elements reduced by sums (must be divided away)
        summed = False
        partial = "the reductions cover dims {} of the conv output, not every spatial dim " + str(sorted(spatial))
        while reduced != spatial:
            user, why = ctx.sole_user(current)
            if user is None:
                if not reduced:
                    return None
                if [u.op for u in current.users] == ["output"]:
                    return miss(current, ReasonKind.DIMENSION_MISMATCH, partial.format(sorted(reduced)), certain=True)
                return miss(current, ReasonKind.SHARED_INTERMEDIATE, why, certain=True)
            op = ctx.op(user)
            if not isinstance(op, GlobalReduce) or op.input is not current:
                if reduced:
                    return miss(user, ReasonKind.DIMENSION_MISMATCH, partial.format(sorted(reduced)), certain=True)
                return None
            if op.dims is None:
                return miss(user, ReasonKind.DIMENSION_MISMATCH, "a reduction over all dims (batch and channels too)", certain=True)
            cur_rank = len(dims_left)
            try:
                these = {dims_left[d % cur_rank] for d in op.dims}
            except IndexError:
                return miss(user, ReasonKind.DIMENSION_MISMATCH, f"dims {op.dims} out of range", certain=True)
            if not these <= spatial or these & reduced:
                return miss(user, ReasonKind.DIMENSION_MISMATCH,
                            f"`{user.name}` reduces dims {sorted(these)} of the conv output; only spatial dims {sorted(spatial)} can be",
                            certain=True)
            if op.kind == "sum":
                summed = True
                for d in these:
                    size = y.shape[d]
                    sum_count = sum_count * int(size) if sum_count is not None and _is_static(size) else None
            reduced |= these
            if not op.keepdim:
                dims_left = [d for d in dims_left if d not in these]
            region.nodes.append(user)
            region.spellings.append(op.kind)
            current = user

        # 3. the division that turns sums into a mean
        if summed:
            user, _ = ctx.sole_user(current)
            op = ctx.op(user) if user is not None else None
            factor = _scale_factor(op, current)
            if sum_count is None:
                return miss(current, ReasonKind.UNSUPPORTED_ARGUMENT,
                            "a sum over dims of dynamic size: cannot prove it is divided by their count", certain=True)
            if factor is None or not math.isclose(factor, 1.0 / sum_count, rel_tol=1e-9):
                return miss(user or current, ReasonKind.UNSUPPORTED_OP,
                            f"a sum over spatial dims fuses only when divided by the number of summed elements ({sum_count})",
                            certain=True)
            region.nodes.append(user)
            current = user

        final = fake_of(current)
        if not isinstance(final, torch.Tensor):
            return miss(current, ReasonKind.MISSING_METADATA, f"no metadata for `{current.name}`")
        return Candidate(self.name, anchor, region.nodes, region, _summary(conv, region), [])

    @staticmethod
    def _reduction_ahead(ctx: MatchContext, node: fx.Node) -> bool:
        """Whether a reduction over some dims (not a whole-tensor ``sum()`` such as a loss) follows
        within a few single-user steps: only then is a stop worth reporting as a near miss."""
        def is_reduction(n: fx.Node) -> bool:
            op = ctx.op(n)
            return isinstance(op, GlobalReduce) and op.dims is not None

        current = node
        for _ in range(_LOOKAHEAD):
            if is_reduction(current):
                return True
            users = [u for u in current.users if u.op != "output"]
            if len(users) != 1:
                return any(is_reduction(u) for u in users)
            current = users[0]
        return False

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_global_mean as op_module

        region: MeanRegion = candidate.payload
        conv = region.conv
        conv_fake, final = fake_of(conv.node), region_result(ctx, candidate.nodes[-1])
        rank = conv_fake.dim()
        keepdim = final.dim() == rank
        config = op_module.ConvGlobalMeanConfig(
            conv=conv.spec,
            affine=tuple(region.affine),
            keepdim=keepdim,
            out_dtype=dtype_name(final.dtype) if final.dtype != conv_fake.dtype else None,
            strict=ctx.strict,
        ).to_json()

        def unsqueeze(graph: fx.Graph, out: fx.Node) -> fx.Node:
            for _ in range(final.dim() - 2 if not keepdim else 0):  # a partial keepdim: x.mean(2, keepdim=True).mean(3)
                out = graph.call_method("unsqueeze", (out, -1))
            return out

        return rewrite_conv_region(
            ctx, candidate, conv, region.operands, op_module.conv_global_mean, config, "fusion::conv_global_mean_fwd",
            op_module.kernel_path(config, conv_fake.dtype, conv_fake.device.type), finish=unsqueeze,
        )


def _is_static(size: object) -> bool:
    return isinstance(size, int) or (isinstance(size, torch.SymInt) and size.node.expr.is_number)


def _scale_factor(op: object, flowing: fx.Node) -> Optional[float]:
    """The constant factor of ``flowing / n`` or ``flowing * f``, or None."""
    if not isinstance(op, Pointwise):
        return None
    seen = op.with_flowing(flowing)
    if isinstance(seen, str):
        return None
    kind, values = seen
    if len(values) != 1 or not isinstance(values[0], (int, float)) or isinstance(values[0], bool):
        return None
    if kind is PointwiseKind.DIV and values[0] != 0:
        return 1.0 / float(values[0])
    if kind is PointwiseKind.MUL:
        return float(values[0])
    return None


def _summary(conv: Conv, region: MeanRegion) -> str:
    d = conv.spec.spatial_dims
    parts = [f"conv{'_transpose' if conv.spec.transposed else ''}{d}d"]
    parts += [s.kind.name.lower() for s in region.affine]
    parts.append("global_mean" if region.spellings == ["mean"] else f"global_mean({'+'.join(region.spellings)})")
    return " -> ".join(parts)

