"""Pattern family ``conv_epilogue``: conv / conv-transpose → [batch norm, eval] → pointwise chain → optional pool.

Anchor: any ``Conv`` (1-3 spatial dims, transposed or not, any hyper-parameters, bias or not) whose
output is batched and floating point.  From there the chain grows one user at a time while

* the next op is the current value's only user, or, of several users, the only fusible one whose
  inputs the chain already holds (the others must join the chain later: ``y + torch.tanh(y)``);
* that op is a supported pointwise op (``ops/chain.py``) whose other operands are numbers, 0-d or
  one-element tensors, per-channel tensors, or a value the chain computed before (a DAG epilogue: the
  first operand of an arithmetic op, ``minimum`` / ``maximum`` or a clamp bound, ``ChainValue``); an
  ``add`` may read one tensor of the conv output's full shape and dtype (a residual branch, ResNet's
  ``relu(bn(conv(x)) + identity)``; no pool then), kept where the conv family's store can add it
  (``chain_limit``); an operand computed from the conv output outside the chain stops it;
* the chain is shorter than ``MAX_CHAIN_LENGTH``.

A conv that reads ``source * gate``, the gate one value per sample and input channel (a
squeeze-and-excitation gate), or ``act(group_norm(source))`` (the VAE's and UNet's norm -> SiLU -> conv;
``act`` none or one relu, leaky_relu, gelu or silu), takes that product or that norm and activation
into the region, without gradients, where the conv family's forward can apply it as it loads
(``input_prologue``); a group norm another family claimed (``conv_group_norm``'s conv -> norm) stays
there.  A nearest upsample the conv folds into a transposed conv (every conv walk takes it in:
``match/conv_walk.input_upsample``) is such a prologue too, with or without gradients: a region may
hold the upsample and the conv alone.

The region then ends at the last value of the longest prefix whose earlier values are read only
inside it (a value read outside, such as a graph output, can only be the region's result).

A batch norm with running statistics (eval mode) joins the chain as a per-channel ``mul`` and
``add``, their operands computed from its statistics when the region is rewritten
(``ops/bn_fold.py``); one with batch statistics (training mode) stops it.
A max or avg pool with the conv's number of spatial dims may end the region.  A region needs at least
one pointwise op or a pool.  Every stop is recorded as a ``NearMiss`` with its reason; an op another
family claims is named as that family's, in its words (``Pattern.claim``).

The family is the conv walk with no centre (``match/conv_walk.py``): the walk grows the chain, this
module folds the batch norm into it and builds the fused op's config.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import BatchNorm, GroupNorm, ParamRef, Pointwise
from ..match.chain_walk import ChainPart, full_size_operand
from ..match.conv_walk import (
    ConvRegion,
    ConvWalkPattern,
    Folded,
    InputGate,
    InputNorm,
    InputPrologue,
    InputUpsample,
    Refusal,
    claimed_elsewhere,
    prologue_activation,
)
from ..match.engine import Candidate, MatchContext, fake_of, register_pattern
from ..match.rewrite import (
    Deferred,
    dtype_if_changed,
    dtype_name,
    materialize,
    region_result,
    rewrite_conv_region,
    written_by_inductor,
)
from ..ops.chain import MAX_CHAIN_LENGTH, ChainStep, PointwiseKind, TensorRef
from ..ops.chain_lowering import family_activation
from ..ops.config import ConvEpilogueConfig
from ..report import Match, ReasonKind


@register_pattern
class ConvEpiloguePattern(ConvWalkPattern):
    name = "conv_epilogue"
    description = ("conv/conv-transpose (1-3d) → chain of pointwise ops with scalar, per-channel or earlier "
                   "chain values as operands, and eval-mode batch norms (folded into per-channel scale and shift) "
                   "→ optional max/avg pool")
    folds = (BatchNorm,)
    trailing_pool = True
    residual = True

    def fold(self, ctx: MatchContext, op: Any, flowing: fx.Node, part: ChainPart, y: torch.Tensor) -> Union[Folded, Refusal]:
        """An eval-mode batch norm as a per-channel ``mul`` and ``add`` (``ops/bn_fold.py``)."""
        bn: BatchNorm = op
        if bn.training:
            claim = claimed_elsewhere(bn.node, bn, y.dim(), self.name) or "a batch norm with batch statistics (training mode) is not fused"
            return Refusal(ReasonKind.UNSUPPORTED_OP, f"{claim}; in eval mode it is folded")
        why = _unfoldable(bn, flowing, y)
        if why is not None:
            return Refusal(ReasonKind.UNSUPPORTED_OP, why)
        if len(part.steps) + 2 > MAX_CHAIN_LENGTH:
            return Refusal(ReasonKind.CHAIN_TOO_LONG, f"the fused chain holds at most {MAX_CHAIN_LENGTH} ops (a batch norm takes two)")
        n = len(part.operands)
        steps = (ChainStep(PointwiseKind.MUL, (TensorRef(n),)), ChainStep(PointwiseKind.ADD, (TensorRef(n + 1),)))
        return Folded(steps, tuple(_folded_operands(bn, y.dim() - 2)), "batch_norm (folded)")

    def input_prologue(self, ctx: MatchContext, conv: Any) -> Optional[InputPrologue]:
        """What the conv family's forward can apply to the conv's input as it loads it, for a direct 2-d
        or 3-d conv with no gradient flowing: a gate (``_input_gate``) or a group norm and its
        activation (``_input_norm``), its nodes read only inside the region and claimed by no other."""
        node = conv.input
        if (not isinstance(node, fx.Node) or conv.spec.transposed or conv.spec.spatial_dims == 1
                or getattr(fake_of(conv.node), "requires_grad", True)):
            return None
        prologue = self._input_gate(ctx, node) or self._input_norm(ctx, node, conv)
        if prologue is None or any(n in ctx.claimed for n in prologue.nodes):
            return None
        return prologue

    def _input_gate(self, ctx: MatchContext, node: fx.Node) -> Optional[InputGate]:
        """The squeeze-and-excitation gate of a conv that reads ``node = source * gate`` (``gate`` one
        value per sample and input channel, as EfficientNet's projection conv reads its block's gated
        features): the product read by the conv alone, the same dtype throughout, no gradient."""
        op = ctx.op(node)
        if not isinstance(op, Pointwise) or op.kind is not PointwiseKind.MUL or op.inplace or len(node.users) != 1 \
                or len(op.args) != 2:
            return None
        product = fake_of(node)
        fakes = [fake_of(a) if isinstance(a, fx.Node) else None for a in op.args]
        if not isinstance(product, torch.Tensor) or not all(isinstance(f, torch.Tensor) for f in fakes):
            return None
        if any(f.requires_grad or f.dtype != product.dtype for f in (*fakes, product)):
            return None
        gate_shape = (*product.shape[:2], *(1,) * (product.dim() - 2))
        for source, gate, fs, fg in ((op.args[0], op.args[1], *fakes), (op.args[1], op.args[0], *fakes[::-1])):
            if tuple(fs.shape) == tuple(product.shape) and tuple(fg.shape) == gate_shape and product.numel() > 0:
                return InputGate(node, source, gate)
        return None

    def _input_norm(self, ctx: MatchContext, node: fx.Node, conv: Any) -> Optional[InputNorm]:
        """The group norm (and the activation after it) a conv reads as ``node``: the norm's input full
        size and in the conv's dtype (the family loads x in it: elsewhere the op would run plain torch,
        which never beats Inductor's code), its weight and bias both one value per channel or both
        absent, each node read by the next alone (no gradient flows: ``input_prologue`` checks the conv's
        output)."""
        act = None
        op = ctx.op(node)
        if isinstance(op, Pointwise) and len(node.users) == 1 and op.args and isinstance(op.args[0], fx.Node):
            step = prologue_activation(op)
            if step is None:
                return None
            act, node = (node, step), op.args[0]
            op = ctx.op(node)
        if not isinstance(op, GroupNorm) or op.running_stats or len(node.users) != 1 or not isinstance(op.eps, float):
            return None
        x = fake_of(op.input) if isinstance(op.input, fx.Node) else None
        if not isinstance(x, torch.Tensor) or x.numel() == 0 or x.dtype != fake_of(conv.node).dtype:
            return None
        if x.shape[1] % (op.groups or x.shape[1]) or (op.weight is None) != (op.bias is None):
            return None  # a weight without a bias (or the reverse): the family's prologue takes both or neither
        for value in (op.weight, op.bias):  # (parameters may require grad: under no_grad none flows)
            fake = fake_of(value) if isinstance(value, fx.Node) else None
            if value is not None and not isinstance(value, ParamRef) and (
                    not isinstance(fake, torch.Tensor) or fake.numel() != x.shape[1]):
                return None
        return InputNorm(op, act)

    def chain_limit(self, ctx: MatchContext, conv: Any, part: ChainPart, y: torch.Tensor) -> Optional[tuple[int, Refusal]]:
        """A residual add stays in the region only where the conv family's forward can add it in its
        store: a direct 2-d or 3-d conv, no gradient flowing (no kernel writes the residual's full-size
        gradient), and after it at most one relu, leaky_relu (a constant slope), gelu or silu; else
        the region ends before it (or after that activation).  Elsewhere the op's best is the library
        conv and one epilogue pass, Inductor's own passes, and with gradients plain torch's backward:
        measuring it would only cost warm-up."""
        at = full_size_operand(ctx, part.operands, y)
        if at is None:
            return None
        add = next(i for i, step in enumerate(part.steps) if TensorRef(at) in step.operands)
        node = next(n for n in part.step_nodes if part.operands[at] in n.all_input_nodes)
        grads = any(getattr(fake_of(n), "requires_grad", False) for n in (conv.node, *part.operands)
                    if isinstance(n, fx.Node))
        if conv.spec.transposed or conv.spec.spatial_dims == 1:
            return add, Refusal(ReasonKind.UNSUPPORTED_OPERAND, "a residual add after a transposed or 1-d conv is not "
                                "fused (the conv family's forward, which adds it in its store, serves direct 2-d and "
                                "3-d convs)", node)
        if grads:
            return add, Refusal(ReasonKind.UNSUPPORTED_OPERAND, "a residual add with gradients flowing is not fused (no "
                                "kernel writes the residual's full-size gradient yet)", node)
        tail = part.steps[add + 1:add + 2]
        keep = add + 1 + (1 if tail and family_activation(tail[0]) is not None else 0)
        return keep, Refusal(ReasonKind.UNSUPPORTED_OP, "after a residual add the region holds at most one relu, "
                             "leaky_relu (a constant slope), gelu or silu (what the conv family's store applies)", node)

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        from ..ops import conv_epilogue as op_module

        region: ConvRegion = candidate.payload
        conv = region.conv
        conv_fake, out_fake = fake_of(conv.node), region_result(ctx, candidate.nodes[-1])
        # WHY absorb autocast's casts only before a max pool or where no gradient flows: the op then
        # takes the fp32 input, weight and bias and its kernels cast them as they load them (no cast
        # kernels around it; the Triton backward reads x as it is).  With a gradient and no max pool
        # the backward may run the library conv backward, which needs x in the conv's dtype: the
        # graph's cast, done once and saved, is cheaper there than casting again in the backward
        # (Conv2d 64->64 k3 on 64x64x256x256, bf16 train: +0.55 ms, H100).  Without a gradient (the
        # graph was traced under no_grad, or nothing in it requires grad; Dynamo guards on grad mode)
        # nothing is saved, so a cast pass of its own is pure cost; but where Inductor's code writes x
        # the graph's cast costs nothing (its kernel stores the narrow copy), and the op's own cast
        # would be a pass: there the cast stays in the graph, unless a gate or an input norm must see
        # x as it is.  NOTE: with every region fused, the SD VAE decoder's ops cast their inputs in
        # 42 copy kernels, 0.34 ms of a 6.9 ms step (H200, bf16 inference; ``python
        # tools/profile_step.py demos/realnets/sd_vae_decoder.py --backends fusion-fused --mode infer
        # --dtype bf16``).
        prologue = region.prologue
        raw_x = prologue is not None and not isinstance(prologue, InputUpsample)
        x_source = prologue.source if prologue is not None else conv.input
        absorb = ((region.pool is not None and region.pool.spec.kind == "max")
                  or (not conv_fake.requires_grad and (raw_x or not written_by_inductor(ctx, x_source))))
        out_dtype = dtype_if_changed(out_fake, conv_fake)
        config = ConvEpilogueConfig(
            conv=conv.spec,
            chain=tuple(region.post.steps),
            pool=region.pool.spec if region.pool else None,
            out_dtype=out_dtype,
            strict=ctx.strict,
            compute_dtype=dtype_name(conv_fake.dtype) if absorb else None,
            residual=full_size_operand(ctx, region.post.operands, conv_fake),
            **_prologue_fields(region.prologue, len(region.post.operands)),
        ).to_json()
        operands = [*region.post.operands, *_prologue_operands(prologue)]
        return rewrite_conv_region(
            ctx, candidate, conv, operands, op_module.conv_epilogue, config, "fusion::conv_epilogue_fwd",
            op_module.kernel_path(config, conv_fake.dtype, conv_fake.device.type), cast_inputs=not absorb,
            # (a folded upsample's conv reads its source already, which ``in_conv_layout`` then relays
            # as the conv's own input where eager's conv would have)
            x=prologue.source if prologue and not isinstance(prologue, InputUpsample) else None,
            # a region whose result is the conv's output (an input prologue alone) adds the conv's bias
            # in the graph, where Inductor adds it in the next op's kernel (``bias_added_in_graph``)
            bias_in_graph=not region.post.steps and region.pool is None and out_dtype is None,
        )


def _prologue_fields(prologue: Optional[InputPrologue], first: int) -> dict[str, Any]:
    """The config fields of the region's input prologue, its operands numbered from ``first``."""
    if isinstance(prologue, InputGate):
        return {"gate": first}
    if isinstance(prologue, InputNorm):
        norm = prologue.norm
        return {"norm_in": norm.groups or fake_of(norm.input).shape[1], "norm_in_eps": norm.eps,
                "norm_in_affine": None if norm.weight is None else first,
                "act_in": () if prologue.act is None else (prologue.act[1],)}
    return {}


def _prologue_operands(prologue: Optional[InputPrologue]) -> list[Any]:
    """The fused op's operands the input prologue reads, after the chain's (``_prologue_fields``)."""
    if isinstance(prologue, InputGate):
        return [prologue.gate]
    if isinstance(prologue, InputNorm) and prologue.norm.weight is not None:
        return [prologue.norm.weight, prologue.norm.bias]
    return []


def _unfoldable(bn: BatchNorm, flowing: fx.Node, y: torch.Tensor) -> Optional[str]:
    """Why the eval-mode batch norm ``bn``, reading the chain's ``flowing`` value, cannot be folded
    into the chain, or None."""
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


def _folded_operands(bn: BatchNorm, spatial_dims: int) -> list[Deferred]:
    """Batch norm's per-channel scale and shift (``ops/bn_fold.py``), made when the region is rewritten."""
    from ..ops import bn_fold

    made: dict[fx.Graph, fx.Node] = {}

    def both(graph: fx.Graph, stats: tuple) -> fx.Node:  # one call makes both operands, once per rewritten graph
        if graph not in made:
            values = (materialize(graph, v) for v in stats)
            made[graph] = graph.call_function(bn_fold.scale_and_shift, (*values, bn.eps, spatial_dims))
        return made[graph]

    stats = (bn.running_mean, bn.running_var, bn.weight, bn.bias)
    return [Deferred(lambda graph, inputs, i=i: graph.call_function(operator.getitem, (both(graph, inputs), i)), stats)
            for i in (0, 1)]
