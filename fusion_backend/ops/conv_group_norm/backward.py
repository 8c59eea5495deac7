"""The Triton backward of ``fusion::conv_group_norm``: ``kernels/group_norm.py``'s backward (one
launch, or two where large groups are split into chunks) writes the conv output's gradient from the
output gradient, the saved conv output and the group statistics (the post-chain, the norm and the
pre-chain differentiated in registers; behind a pool, each position's gradient gathered from the
pooled gradient where the kernels read it, a max pool's only at the saved winners) plus fixed-order
partial sums of the norm's weight and bias gradients and of the chains' operand gradients; then the
library conv backward (``ops/library_conv.py``: aten / cuDNN, on
channels-last tensors for 2-d and 3-d convs) gives the gradients
of x, the weight and the bias.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..conv_channel_reduce.backward import operand_grads, wanted_slots
from ..library_conv import conv_backward_plan
from .config import ConvGroupNormConfig
from .forward import KernelChains


def backward_triton(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                    saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor, cfg: ConvGroupNormConfig,
                    mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False).  With a
    pool ``grad_out`` is the pooled result's gradient; the kernels gather each position's share (a max
    pool's at its winners, ``saved_winner``) where they read it."""
    from ...kernels.group_norm import group_norm_backward

    conv_backward = conv_backward_plan(x, weight, cfg.conv, saved_y)
    grad_y = conv_backward.new_grad_y(x.device)
    chains = KernelChains.build(cfg, bias, operands, saved_y.dim(), saved_y.shape[1], x.device)
    operand_mask = list(mask[3:])
    affine_wanted = tuple(index is not None and bool(operand_mask[index]) for index in (cfg.weight, cfg.bias))
    pre_sums, post_sums, affine_sums = group_norm_backward(
        grad_out, saved_y, saved_stats, bias is not None, chains.pre, chains.post, cfg.groups, chains.params,
        chains.post_params, chains.affine, grad_y, wanted_slots(cfg.pre, operand_mask),
        wanted_slots(cfg.post, operand_mask), affine_wanted, pool=cfg.pool,
        winner=saved_winner if saved_winner.numel() else None,
    )  # fmt: skip
    grad_x, grad_w, grad_b = conv_backward(grad_y, x, weight, mask[0], mask[1], bool(mask[2]))
    grads = operand_grads(cfg, operands, operand_mask, pre_sums, post_sums)
    for index, total in zip((cfg.weight, cfg.bias), affine_sums, strict=True):
        if total is not None:
            t = operands[index]
            g = total.reshape(t.shape).to(t.dtype)
            grads[index] = g if grads[index] is None else grads[index] + g
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
