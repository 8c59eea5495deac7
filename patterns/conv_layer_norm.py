"""Pattern family ``conv_layer_norm``: conv / conv-transpose → pointwise chain → layer norm over
trailing dims of the conv output → pointwise chain.

Anchor: any ``Conv`` (1-3 spatial dims, transposed or not, any hyper-parameters) whose output is
batched and floating point, followed, through an optional pointwise chain (``ops/chain.py``'s
catalogue with per-channel, one-element or number operands, DAG chains included, as
``conv_epilogue`` grows them), by a ``LayerNorm`` canonical op (``nn.LayerNorm``, ``F.layer_norm``,
``torch.layer_norm``; with or without its elementwise weight and bias) whose normalized shape is 1 to
``spatial_dims + 1`` trailing dims of the conv output: only W (``nn.LayerNorm(C)`` applied to an (N,
C, D, H, W) output whose W is C), (H, W), ..., or (C, *spatial).  A pointwise chain may follow the
norm (per-channel operands included).  The fused op (``ops/conv_layer_norm/``) runs the conv once and
everything after it in Triton kernels, forward and backward.

Priority 165: above ``conv_epilogue`` (100), which would otherwise take the conv and the chain before
the norm and leave the norm to Inductor; between ``conv_group_norm`` (170) and ``conv_batch_norm``
(160), the other norm families, and above ``conv_channel_reduce`` (150): a region of each of those
ends at its own norm or reduction and this one at a layer norm, so two of them never share a conv
and the order between them only fixes which near miss a conv gets; below ``conv_global_mean`` (200),
whose algebraic route never writes the conv output.

Near misses (only where a layer norm reads the chain within a few pointwise steps): a normalized
shape that is not known at compile time (traced sizes under ``dynamic=True``) or whose conv-output
dims are dynamic, one that covers the batch dim too, a traced eps, a dynamic channel count, a norm weight or bias
that is not a tensor of the normalized shape, a norm whose input is read outside the region, an
unsupported dtype, and the chains' own reasons (a chain operand that is not per-channel, e.g. a
positional table of the normalized shape, ends the chain there).  A normalized shape that is not the
conv output's trailing sizes is not matched (torch rejects it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import Conv, LayerNorm, ParamRef
from ..match.chain_walk import ChainPart, grow_chain_after, grow_chain_before, op_ahead, operand_index
from ..match.engine import Candidate, ConvAnchoredPattern, MatchContext, fake_of, register_pattern
from ..match.rewrite import Deferred, dtype_name, materialize, rewrite_conv_region
from ..report import Match, NearMiss, ReasonKind

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Names of a conv output's dims after the batch, by spatial rank (for summaries).
_DIM_NAMES = {1: ("C", "L"), 2: ("C", "H", "W"), 3: ("C", "D", "H", "W")}


@dataclass
class LayerNormRegion:
    conv: Conv
    pre: ChainPart
    norm: LayerNorm
    normalized_shape: tuple[int, ...]
    weight: Optional[int]
    bias: Optional[int]
    post: ChainPart


@register_pattern
class ConvLayerNormPattern(ConvAnchoredPattern):
    name = "conv_layer_norm"
    priority = 165
    description = ("conv/conv-transpose (1-3d) → pointwise chain → layer norm over trailing dims of the conv output "
                   "→ pointwise chain")

    def match_conv(self, ctx: MatchContext, conv: Conv) -> Optional[Union[Candidate, NearMiss]]:
        anchor = conv.node
        y = fake_of(anchor)
        if not isinstance(y, torch.Tensor) or y.dim() != conv.spec.spatial_dims + 2:
            return None
        if not op_ahead(ctx, anchor, LayerNorm):
            return None  # no layer norm in sight: not this family's conv

        def miss(at: fx.Node, kind: ReasonKind, msg: str) -> NearMiss:
            return ctx.near_miss(self.name, anchor, at, kind, msg)

        if y.dtype not in FUSED_DTYPES:
            return miss(anchor, ReasonKind.UNSUPPORTED_DTYPE, f"conv output dtype {y.dtype} is not a floating type the fused op supports")
        if not _static(y.shape[1]):
            return miss(anchor, ReasonKind.DIMENSION_MISMATCH, f"the conv has a dynamic number of channels ({y.shape[1]})")

        # 1. the chain before the norm
        before = grow_chain_before(ctx, self.name, anchor, y, FUSED_DTYPES, LayerNorm, "the layer norm")
        if isinstance(before, NearMiss):
            return before
        pre, user = before.part, before.stop

        # 2. the norm
        norm: LayerNorm = ctx.op(user)
        if norm.input is not before.last:
            return miss(user, ReasonKind.UNSUPPORTED_OPERAND, f"`{user.name}` does not normalise the chain's value")
        shape = norm.normalized_shape
        if shape is None:
            return miss(user, ReasonKind.DIMENSION_MISMATCH,
                        f"`{user.name}`'s normalized shape is not known at compile time (traced sizes, as under "
                        "dynamic shapes); the fused op takes it as constants")  # fmt: skip
        if len(shape) >= y.dim():
            return miss(user, ReasonKind.DIMENSION_MISMATCH,
                        f"`{user.name}` normalizes over {len(shape)} dims of a {y.dim()}-d conv output, the batch dim "
                        "included; the fused op normalizes over the channels and spatial dims at most")  # fmt: skip
        trailing = y.shape[y.dim() - len(shape):]
        if not all(_static(d) for d in trailing):
            return miss(user, ReasonKind.DIMENSION_MISMATCH,
                        f"the conv output's normalized dims {list(trailing)} are dynamic; the fused op takes them as "
                        "constants")  # fmt: skip
        if tuple(int(d) for d in trailing) != shape:
            return None  # torch rejects it: nothing to report
        if norm.eps is None:
            return miss(user, ReasonKind.UNSUPPORTED_ARGUMENT,
                        f"`{user.name}`'s eps is a traced value (dynamic=True lifts a module's float attributes to "
                        "graph inputs); the fused op takes it as a constant")  # fmt: skip
        for name in ("weight", "bias"):
            why = _elementwise_problem(getattr(norm, name), shape)
            if why is not None:
                return miss(user, ReasonKind.UNSUPPORTED_OPERAND, f"the norm's {name} {why}")
        if not before.values.closed(pre, user):
            read_outside = next(n for n in [anchor, *pre.step_nodes] if any(u not in {anchor, *pre.step_nodes, user} for u in n.users))
            return miss(read_outside, ReasonKind.SHARED_INTERMEDIATE, before.values.outside_users(read_outside))
        normed = fake_of(user)
        if not isinstance(normed, torch.Tensor):
            return miss(user, ReasonKind.MISSING_METADATA, f"no metadata for `{user.name}`")
        if normed.dtype not in FUSED_DTYPES:
            return miss(user, ReasonKind.UNSUPPORTED_DTYPE, f"`{user.name}` yields {normed.dtype}")
        post = ChainPart(pre.operands)
        weight = operand_index(norm.weight, post.operands)
        bias = operand_index(norm.bias, post.operands)

        # 3. the chain after it
        notes = grow_chain_after(ctx, self.name, anchor, user, post, y, FUSED_DTYPES, "the layer norm")

        region = LayerNormRegion(conv, pre, norm, shape, weight, bias, post)
        nodes = [anchor, *pre.step_nodes, user, *post.step_nodes]
        return Candidate(self.name, anchor, nodes, region, _summary(region), notes)

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_layer_norm as op_module

        region: LayerNormRegion = candidate.payload
        conv = region.conv
        conv_fake, normed, final = fake_of(conv.node), fake_of(region.norm.node), fake_of(candidate.nodes[-1])
        config = op_module.ConvLayerNormConfig(
            conv=conv.spec,
            normalized_shape=region.normalized_shape,
            eps=region.norm.eps,
            weight=region.weight,
            bias=region.bias,
            pre=tuple(region.pre.steps),
            post=tuple(region.post.steps),
            norm_dtype=dtype_name(normed.dtype) if normed.dtype != conv_fake.dtype else None,
            out_dtype=dtype_name(final.dtype) if final.dtype != conv_fake.dtype else None,
            strict=ctx.strict,
        ).to_json()
        operands = [Deferred(lambda graph, ref=v: materialize(graph, ref)) if isinstance(v, ParamRef) else v
                    for v in region.post.operands]  # fmt: skip
        return rewrite_conv_region(
            ctx, candidate, conv, operands, op_module.conv_layer_norm, config, "fusion::conv_layer_norm_fwd",
            op_module.kernel_path(config, conv_fake.dtype, conv_fake.device.type),
        )  # fmt: skip


def _static(size: Any) -> bool:
    """Whether a size is a number at compile time (an int, or a symbolic int that is one)."""
    return not isinstance(size, torch.SymInt) or size.node.expr.is_number


def _elementwise_problem(value: Any, shape: tuple[int, ...]) -> Optional[str]:
    """Why a layer norm's weight or bias ``value`` cannot be read as one floating-point value per
    element of the normalized ``shape``, or None (``None`` and parameters of the module are fine)."""
    if value is None or isinstance(value, ParamRef):
        return None
    if not isinstance(value, fx.Node):
        return f"{value!r} is not a tensor"
    fake = fake_of(value)
    if not isinstance(fake, torch.Tensor) or tuple(fake.shape) != shape:
        found = list(fake.shape) if isinstance(fake, torch.Tensor) else "unknown"
        return f"`{value.name}` has shape {found}, not the normalized shape {list(shape)}"
    if not fake.is_floating_point():
        return f"`{value.name}` is {fake.dtype}, not floating point"
    return None


def _summary(region: LayerNormRegion) -> str:
    spec = region.conv.spec
    names = _DIM_NAMES[spec.spatial_dims][-len(region.normalized_shape):]
    parts = [f"conv{'_transpose' if spec.transposed else ''}{spec.spatial_dims}d", *region.pre.labels,
             f"layer_norm[{', '.join(names)}]", *region.post.labels]  # fmt: skip
    return " -> ".join(parts)
