"""Pattern family ``batch_norm_conv``: batch norm with batch statistics (training mode) → activation → conv.

Anchor: a direct ``Conv`` (1-3 spatial dims, any hyper-parameters, bias or not) whose input is
``act(batch_norm(x))`` or ``batch_norm(x)``: a ``BatchNorm`` canonical op with batch statistics
(``F.batch_norm(..., training=True)``, what Dynamo records for ``nn.BatchNorm{1,2,3}d`` in train mode),
affine or not, with or without running statistics, momentum a number, then at most one relu,
leaky_relu (a constant slope), gelu or silu (in place or not).  The previous layer's output ``x`` is the
region's input: ResNet's and EfficientNet's ``conv -> bn -> relu -> conv`` is this region after the
first conv.  The fused op (``ops/batch_norm_conv/``) computes the statistics, and the conv applies the
norm and the activation as it loads x: the activation is never written, and the backward recomputes
it from x.  ``nn.BatchNorm``'s ``num_batches_tracked += 1`` stays outside the region, as in
``conv_batch_norm``.

Precedence: its own tier, first (``Precedence.TAKES_ITS_INPUT``): the norm it takes is also the end of
the previous conv's ``conv_batch_norm`` region; where that family took it first, this region would be
no candidate at all, and where this one loses its measurement the other is an alternate the decision
still weighs (``engine.Regions.alternates``).

Near misses (only where a conv reads a training batch norm, through the activation or not): the
norm's or the activation's value read elsewhere, ``nn.SyncBatchNorm``, a batch norm module call, a
momentum that is not a number, a weight, bias or running statistic that is not one value per channel,
x in another dtype than the conv (autocast's fp32 norm before a bf16 conv: the op runs the norm in the
conv's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import BatchNorm, Conv, Pointwise
from ..match.chain_walk import operand_index
from ..match.conv_walk import batch_norm_problem, conv_label, is_sync_batch_norm, prologue_activation
from ..match.engine import Candidate, ConvAnchoredPattern, MatchContext, Precedence, fake_of, register_pattern
from ..match.rewrite import rewrite_conv_region
from ..ops.chain import ChainStep
from ..report import Match, NearMiss, ReasonKind


@dataclass(frozen=True)
class BatchNormConvRegion:
    """A matched region: the conv, the norm, the activation between them (its node and chain step; None
    for a conv reading the norm directly)."""

    conv: Conv
    norm: BatchNorm
    act: Optional[tuple[fx.Node, ChainStep]]


@register_pattern
class BatchNormConvPattern(ConvAnchoredPattern):
    name = "batch_norm_conv"
    precedence = Precedence.TAKES_ITS_INPUT
    # NOTE: opt-in (``patterns=[..., "batch_norm_conv"]``, ``"all"`` or ``FUSION_PATTERNS``) until its op
    # wins a region: with every region fused, ResNet-50's bf16 training step under CUDA graphs ran 0.95x
    # Inductor (H200, code of ee43d42; ``FUSION_DECIDE=fuse FUSION_PATTERNS=batch_norm_conv python -m fusion_backend bench
    # --log --dtype bf16 --mode train --backends eager,inductor,fusion --no-memory --no-cold --no-chart
    # --compile-mode reduce-overhead --suite demos/realnets/resnet50.py``), each pass at the faster of its
    # two implementations (the log's impl-choice lines; docs/perf/RESULTS.md, ``batch_norm_conv``).  By
    # default a measured decision would keep none of its regions and spend a measurement on one per process.
    opt_in = True
    description = ("batch norm with batch statistics (training mode) → optional relu/leaky_relu/gelu/silu → conv "
                   "(1-3d), the norm and activation applied as the conv loads its input")

    def match_conv(self, ctx: MatchContext, conv: Conv) -> Optional[Union[Candidate, NearMiss]]:
        node = conv.input
        if conv.spec.transposed or not isinstance(node, fx.Node):
            return None
        act = None
        op = ctx.op(node)
        if isinstance(op, Pointwise):
            step = prologue_activation(op)
            if step is None:
                return None
            act, node = (node, step), op.args[0]
            op = ctx.op(node)
        if not (isinstance(op, BatchNorm) and op.training):
            return None
        region = BatchNormConvRegion(conv, op, act)
        why = self._refusal(ctx, region)
        if why is not None:
            at, reason, message = why
            return ctx.near_miss(self.name, conv.node, at, reason, message)
        nodes = [op.node, *([act[0]] if act else []), conv.node]
        labels = ["batch_norm(train)", *([act[1].kind.name.lower()] if act else []), conv_label(conv)]
        return Candidate(self.name, conv.node, nodes, region, " -> ".join(labels))

    def _refusal(self, ctx: MatchContext, region: BatchNormConvRegion) -> Optional[tuple[fx.Node, ReasonKind, str]]:
        """``(node, reason, message)`` where the region cannot be fused, else None."""
        norm, conv = region.norm, region.conv
        reader = conv.node if region.act is None else region.act[0]
        for value, user in ((norm.node, reader), *(((region.act[0], conv.node),) if region.act else ())):
            if list(value.users) != [user]:
                return value, ReasonKind.SHARED_INTERMEDIATE, ctx.sole_user(value)[1]
        if is_sync_batch_norm(norm.node):
            return norm.node, ReasonKind.UNSUPPORTED_OP, (f"`{norm.node.name}` is a SyncBatchNorm: its statistics "
                                                          "span every process, which one process's fused op cannot "
                                                          "compute")  # fmt: skip
        x, y = fake_of(norm.input), fake_of(conv.node)
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            return norm.node, ReasonKind.MISSING_METADATA, "the batch norm's input or the conv's output has no fake value"
        if not isinstance(x.shape[1], int):
            return norm.node, ReasonKind.UNSUPPORTED_ARGUMENT, "the batch norm's channel count is dynamic"
        problem = batch_norm_problem(norm, x.shape[1])
        if problem is not None:
            return (norm.node, *problem)
        if (norm.running_mean is None) != (norm.running_var is None):
            return norm.node, ReasonKind.UNSUPPORTED_OPERAND, "the batch norm has one running statistic without the other"
        if x.dtype != y.dtype:
            return norm.node, ReasonKind.UNSUPPORTED_DTYPE, (
                f"the batch norm reads {x.dtype} and the conv runs in {y.dtype} (autocast): the fused op runs the "
                "norm in the conv's dtype")  # fmt: skip
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return norm.node, ReasonKind.UNSUPPORTED_DTYPE, f"the batch norm's input is {x.dtype}"
        return None

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import batch_norm_conv as op_module

        region: BatchNormConvRegion = candidate.payload
        conv, norm = region.conv, region.norm
        conv_fake = fake_of(conv.node)
        operands: list[Any] = []
        weight, bias = operand_index(norm.weight, operands), operand_index(norm.bias, operands)
        running = norm.running_mean is not None
        config = op_module.BatchNormConvConfig(
            conv=conv.spec,
            eps=float(norm.eps),
            momentum=float(norm.momentum),
            weight=weight,
            bias=bias,
            running_stats=running,
            act=() if region.act is None else (region.act[1],),
            strict=ctx.strict,
        ).to_json()
        operands += [norm.running_mean, norm.running_var] if running else []
        return rewrite_conv_region(
            ctx, candidate, conv, operands, op_module.batch_norm_conv, config, "fusion::batch_norm_conv_fwd",
            op_module.kernel_path(config, conv_fake.dtype, conv_fake.device.type), x=norm.input,
        )  # fmt: skip
