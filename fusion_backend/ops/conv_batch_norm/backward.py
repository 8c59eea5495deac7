"""The Triton backward of ``fusion::conv_batch_norm``: two kernels (``kernels/batch_norm.py``) write the
conv output's gradient from the output gradient, the saved conv output and the per-channel
statistics (the post-chain and the norm differentiated in registers; the per-channel sums the norm's
gradient needs combined in a fixed order between them), which also give the norm's weight and bias
gradients and the chain's operand gradients (behind a pool, each position's gradient gathered from
the pooled gradient inside both kernels: a max pool's only at the saved winners); then the library
conv backward (``ops/library_conv.py``: aten / cuDNN, on
channels-last tensors for 2-d and 3-d convs) gives the gradients of x, the
weight and the bias.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..conv_channel_reduce.backward import operand_grads, wanted_slots
from ..library_conv import conv_backward_plan
from .config import ConvBatchNormConfig
from .forward import KernelChain


def backward_triton(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                    saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor, cfg: ConvBatchNormConfig,
                    mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False).  With a
    pool ``grad_out`` is the pooled result's gradient; the kernels gather each position's share (a max
    pool's at its winners, ``saved_winner``) where they read it."""
    from ...kernels.batch_norm import batch_norm_backward

    conv_backward = conv_backward_plan(x, weight, cfg.conv, saved_y)
    grad_y = conv_backward.new_grad_y(x.device)
    chain = KernelChain.build(cfg, bias, operands, saved_y.dim(), saved_y.shape[1], x.device)
    operand_mask = list(mask[3:])
    dgamma, dbeta, post_sums = batch_norm_backward(
        grad_out, saved_y, chain.bias, chain.post, chain.post_params, chain.affine, saved_stats[:2], grad_y,
        wanted_slots(cfg.post, operand_mask), cfg.pool, saved_winner if saved_winner.numel() else None,
    )  # fmt: skip
    grad_x, grad_w, grad_b = conv_backward(grad_y, x, weight, mask[0], mask[1], bool(mask[2]))
    grads = operand_grads(cfg, operands, operand_mask, [], post_sums)
    for index, total in ((cfg.weight, dgamma), (cfg.bias, dbeta)):
        if index is not None and operand_mask[index]:
            t = operands[index]
            g = total.reshape(t.shape).to(t.dtype)
            grads[index] = g if grads[index] is None else grads[index] + g
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
