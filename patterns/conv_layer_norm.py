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

A conv walk centred on the norm (``match/conv_walk.py``): it takes a conv before the plain chain of
``conv_epilogue`` would, which would leave the norm to Inductor.

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
from typing import Any, Optional

import torch
import torch.fx as fx

from ..frontend.canonical import CanonicalOp, LayerNorm, ParamRef
from ..frontend.normalize import target_name
from ..match.chain_walk import operand_index
from ..match.conv_walk import (
    NOT_MATCHED,
    Centre,
    CentreSite,
    ConvRegion,
    ConvWalkPattern,
    Refusal,
    claim_wording,
)
from ..match.engine import Candidate, MatchContext, fake_of, register_pattern
from ..match.rewrite import dtype_if_changed, region_result, rewrite_conv_region
from ..report import Match, ReasonKind

#: Names of a conv output's dims after the batch, by spatial rank (for summaries).
_DIM_NAMES = {1: ("C", "L"), 2: ("C", "H", "W"), 3: ("C", "D", "H", "W")}


@dataclass(frozen=True)
class LayerNormFacts:
    """What the config needs from the norm: its normalized shape and its weight's and bias's indices
    among the region's operands (None: not affine)."""

    normalized_shape: tuple[int, ...]
    weight: Optional[int]
    bias: Optional[int]


def _refusal(site: CentreSite) -> Optional[Refusal]:
    norm: LayerNorm = site.op
    name, y = site.node.name, site.y
    if norm.input is not site.flowing:
        return Refusal(ReasonKind.UNSUPPORTED_OPERAND, f"`{name}` does not normalise the chain's value")
    shape = norm.normalized_shape
    if shape is None:
        return Refusal(ReasonKind.DIMENSION_MISMATCH,
                       f"`{name}`'s normalized shape is not known at compile time (traced sizes, as under "
                       "dynamic shapes); the fused op takes it as constants")  # fmt: skip
    if len(shape) >= y.dim():
        return Refusal(ReasonKind.DIMENSION_MISMATCH,
                       f"`{name}` normalizes over {len(shape)} dims of a {y.dim()}-d conv output, the batch dim "
                       "included; the fused op normalizes over the channels and spatial dims at most")  # fmt: skip
    trailing = y.shape[y.dim() - len(shape):]
    if not all(_static(d) for d in trailing):
        return Refusal(ReasonKind.DIMENSION_MISMATCH,
                       f"the conv output's normalized dims {list(trailing)} are dynamic; the fused op takes them as "
                       "constants")  # fmt: skip
    if tuple(int(d) for d in trailing) != shape:
        return NOT_MATCHED  # torch rejects it: nothing to report
    if norm.eps is None:
        return Refusal(ReasonKind.UNSUPPORTED_ARGUMENT,
                       f"`{name}`'s eps is a traced value (dynamic=True lifts a module's float attributes to "
                       "graph inputs); the fused op takes it as a constant")  # fmt: skip
    for what in ("weight", "bias"):
        why = _elementwise_problem(getattr(norm, what), shape)
        if why is not None:
            return Refusal(ReasonKind.UNSUPPORTED_OPERAND, f"the norm's {what} {why}")
    return None


def _facts(site: CentreSite) -> LayerNormFacts:
    norm: LayerNorm = site.op
    return LayerNormFacts(norm.normalized_shape, operand_index(norm.weight, site.operands),
                          operand_index(norm.bias, site.operands))  # fmt: skip


def _label(region: ConvRegion) -> str:
    shape = region.facts.normalized_shape
    names = _DIM_NAMES[region.conv.spec.spatial_dims][-len(shape):]
    return f"layer_norm[{', '.join(names)}]"


LAYER_NORM = Centre(LayerNorm, "the layer norm", _label, _refusal, _facts)


@register_pattern
class ConvLayerNormPattern(ConvWalkPattern):
    name = "conv_layer_norm"
    description = ("conv/conv-transpose (1-3d) → pointwise chain → layer norm over trailing dims of the conv output "
                   "→ pointwise chain")
    centre = LAYER_NORM

    def claim(self, node: fx.Node, op: CanonicalOp, rank: int) -> Optional[str]:
        if target_name(node) != "layer_norm":
            return None
        return claim_wording("normalizes by statistics of the conv output (LayerNorm):", self.name)

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_layer_norm as op_module

        region: ConvRegion = candidate.payload
        conv, norm, facts = region.conv, region.centre, region.facts
        conv_fake = fake_of(conv.node)
        config = op_module.ConvLayerNormConfig(
            conv=conv.spec,
            normalized_shape=facts.normalized_shape,
            eps=norm.eps,
            weight=facts.weight,
            bias=facts.bias,
            pre=tuple(region.pre.steps),
            post=tuple(region.post.steps),
            norm_dtype=dtype_if_changed(fake_of(norm.node), conv_fake),
            out_dtype=dtype_if_changed(region_result(ctx, candidate.nodes[-1]), conv_fake),
            strict=ctx.strict,
        ).to_json()
        return rewrite_conv_region(
            ctx, candidate, conv, region.post.operands, op_module.conv_layer_norm, config, "fusion::conv_layer_norm_fwd",
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
