"""The Triton backward of ``fusion::conv_channel_reduce``: ONE kernel (``kernels/channel_reduce.py``)
writes the conv output's gradient from the output gradient and the saved state (the post-chain,
the reduction and the pre-chain differentiated in registers) plus fixed-order partial sums of the
chains' operand gradients; then the library conv backward (``ops/library_conv.py``: aten / cuDNN, on
channels-last tensors for 2-d and 3-d convs) gives the gradients of x, the weight and the bias.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..chain import ChainStep, TensorRef
from ..library_conv import conv_backward_plan
from .common import needs_y
from .config import ConvChannelReduceConfig
from .forward import KernelChains


def wanted_slots(chain: Sequence[ChainStep], operand_mask: Sequence[bool]) -> list[bool]:
    """Per slot: whether the gradient of its (tensor) first operand is wanted."""
    return [
        step.kind.differentiable_operands == (0,) and isinstance(step.operands[0], TensorRef)
        and bool(operand_mask[step.operands[0].index])
        for step in chain
    ]  # fmt: skip


def operand_grads(cfg: ConvChannelReduceConfig, operands: Sequence[Tensor], operand_mask: Sequence[bool],
                   pre_sums: Sequence[Tensor | None], post_sums: Sequence[Tensor | None]) -> list[Tensor | None]:  # fmt: skip
    """Each wanted operand's gradient: the sums of the slots that read it (a one-value operand takes
    the total over the channels), in its shape and dtype."""
    grads: list[Tensor | None] = []
    for i, t in enumerate(operands):
        if not operand_mask[i]:
            grads.append(None)
            continue
        total = torch.zeros((), dtype=torch.float32, device=t.device)
        for chain, sums in ((cfg.pre, pre_sums), (cfg.post, post_sums)):
            for step, s in zip(chain, sums, strict=True):
                if s is not None and step.operands[0] == TensorRef(i):
                    total = total + (s.sum() if t.numel() == 1 else s)
        grads.append(total.reshape(t.shape).to(t.dtype) if total.numel() == t.numel() else total.expand(t.shape).to(t.dtype))
    return grads


def backward_triton(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                    saved_y: Tensor, saved_index: Tensor, saved_stats: Tensor, cfg: ConvChannelReduceConfig,
                    mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False)."""
    from ...kernels.channel_reduce import channel_reduce_backward

    conv_backward = conv_backward_plan(x, weight, cfg.conv, saved_y if needs_y(cfg) else x)
    grad_y = conv_backward.new_grad_y(x.device)
    shape = grad_y.shape
    chains = KernelChains.build(cfg, bias, operands, len(shape), shape[1], x.device)
    operand_mask = list(mask[3:])
    pre_sums, post_sums = channel_reduce_backward(
        grad_out, saved_y if needs_y(cfg) else None, saved_index if cfg.reduction in ("min", "max") else None,
        saved_stats, bias is not None, chains.pre, chains.post, cfg.reduction, chains.params, chains.post_params,
        grad_y, wanted_slots(cfg.pre, operand_mask), wanted_slots(cfg.post, operand_mask),
    )  # fmt: skip
    grad_x, grad_w, grad_b = conv_backward(grad_y, x, weight, mask[0], mask[1], bool(mask[2]))
    grads = operand_grads(cfg, operands, operand_mask, pre_sums, post_sums)
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
