"""Pattern family ``attention``: ``F.scaled_dot_product_attention`` with heads wider than torch's flash
kernel takes, as ``fusion::attention`` (``ops/attention``: library matmuls with fp32 scores around a
softmax kernel).

Matched: a call without a mask, dropout, causality or grouped heads, on fp16 / bf16 (autocast's casts
of fp32 inputs included: they move into the graph before the op), ``q``, ``k``, ``v`` of one rank with
the same leading dims, and a head dim past ``FLASH_MAX_HEAD_DIM``.  Everything else is a near miss that
says why.  The region is the call alone; like every region it is kept only where it measures faster
than Inductor's code (which runs eager's attention kernels).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Union

import torch
import torch.fx as fx

from ..ir.fakes import size_hint
from ..match.engine import Candidate, MatchContext, Pattern, Precedence, fake_of, register_pattern
from ..match.rewrite import cast_if_needed, splice_fused_call
from ..ops.attention import ATTENTION, OP, AttentionConfig, kernel_path
from ..report import Match, NearMiss, ReasonKind, source_lines_of

#: The widest head torch's flash attention kernel takes (fp16 / bf16, CUDA): up to it eager's attention
#: is already a fused kernel at the matmul rate, past it eager falls back to the memory-efficient kernel.
FLASH_MAX_HEAD_DIM = 256

_SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention,)
_ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _arguments(node: fx.Node) -> dict[str, Any]:
    args = dict(_DEFAULTS)
    args.update(zip(_ARG_NAMES, node.args, strict=False))
    args.update(node.kwargs)
    return args


@register_pattern
class AttentionPattern(Pattern):
    name = OP
    precedence = Precedence.CHAIN_ONLY  # (it claims no conv: the tier orders nothing here)
    description = "scaled_dot_product_attention with a head dim past flash attention's 256 (fp32 scores between two matmuls)"

    def find(self, ctx: MatchContext) -> Iterator[Union[Candidate, NearMiss]]:
        for node in list(ctx.gm.graph.nodes):
            if node.op == "call_function" and node.target in _SDPA_TARGETS:
                yield self._match(ctx, node)

    def _match(self, ctx: MatchContext, node: fx.Node) -> Union[Candidate, NearMiss]:
        def miss(reason: ReasonKind, message: str) -> NearMiss:
            return ctx.near_miss(self.name, node, node, reason, message)

        args = _arguments(node)
        for name, unsupported in (("attn_mask", args["attn_mask"] is not None), ("dropout_p", args["dropout_p"] != 0.0),
                                  ("is_causal", args["is_causal"] is not False),
                                  ("enable_gqa", args["enable_gqa"] is not False)):  # fmt: skip
            if unsupported:
                return miss(ReasonKind.UNSUPPORTED_ARGUMENT, f"attention with {name}={args[name]!r}: the fused op takes "
                                                             "none (no mask, no dropout, not causal, no grouped heads)")
        q, k, v = (args[name] for name in ("query", "key", "value"))
        fakes = [fake_of(t) if isinstance(t, fx.Node) else None for t in (q, k, v)]
        out = fake_of(node)
        if not all(isinstance(t, torch.Tensor) for t in (*fakes, out)):
            return miss(ReasonKind.MISSING_METADATA, "no shape metadata for the attention's inputs or result")
        fq, fk, fv = fakes
        if out.dtype not in (torch.float16, torch.bfloat16):
            return miss(ReasonKind.UNSUPPORTED_DTYPE, f"attention in {out.dtype}: the fused op's scores matmul would "
                                                      "run at that dtype's rate (fp16 and bf16 only)")
        if fq.dim() < 3 or not (fq.dim() == fk.dim() == fv.dim()) or not (fq.shape[:-2] == fk.shape[:-2] == fv.shape[:-2]):
            return miss(ReasonKind.DIMENSION_MISMATCH, f"q {list(fq.shape)}, k {list(fk.shape)}, v {list(fv.shape)}: "
                                                       "the fused op needs one rank of at least 3 and the same "
                                                       "leading dims (no broadcasting)")  # fmt: skip
        # a symbolic head dim is judged by its example value, unguarded: the rule says where the op should
        # win (the decision measures it), and the op is right for every size
        head = size_hint(fq.shape[-1])
        if head is None:
            return miss(ReasonKind.MISSING_METADATA, "a dynamic head dim without a size hint")
        if head <= FLASH_MAX_HEAD_DIM:
            return miss(ReasonKind.UNSUPPORTED_ARGUMENT, f"head dim {head}: torch's flash attention kernel takes "
                                                         f"heads up to {FLASH_MAX_HEAD_DIM}")
        if any(size_hint(t.numel()) == 0 for t in (fq, fk, fv)):
            return miss(ReasonKind.EMPTY_TENSOR, "an empty attention input")
        scale = args["scale"]  # (None: eager's 1 / sqrt(E), resolved at run time)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            return miss(ReasonKind.UNSUPPORTED_ARGUMENT, f"a scale computed in the graph ({scale!r}): the fused op's "
                                                         "config holds a number")  # fmt: skip
        return Candidate(self.name, node, [node], (q, k, v, None if scale is None else float(scale)),
                         f"attention(head dim {head})")  # fmt: skip

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        q, k, v, scale = candidate.payload
        node = candidate.anchor
        out = fake_of(node)
        config = AttentionConfig(scale=scale, strict=ctx.strict).to_json()

        def build(graph: fx.Graph) -> fx.Node:
            inputs = [cast_if_needed(graph, ctx.resolve(t), out.dtype) for t in (q, k, v)]
            return graph.call_function(ATTENTION, (*inputs, config))

        splice_fused_call(ctx, candidate.nodes, build)
        path, why = kernel_path(out.dtype, out.device.type)
        return Match(pattern=self.name, nodes=(node.name,), source_lines=source_lines_of([node]),
                     fused_op=f"fusion::{OP}", config=config, kernel=path if why is None else f"{path}: {why}",
                     summary=candidate.summary)  # fmt: skip
