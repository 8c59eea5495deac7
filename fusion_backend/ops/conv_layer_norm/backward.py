"""The Triton backward of ``fusion::conv_layer_norm``: ``kernels/layer_norm.py``'s backward (one
launch for rows packed in tiles, two for rows walked in chunks) writes the conv output's gradient
from the output gradient, the saved conv output and the row statistics (the post-chain, the norm and
the pre-chain differentiated in registers) plus fixed-order partial sums of the norm's elementwise
weight and bias gradients and of the chains' per-channel operand gradients; then the library conv
backward (``ops/library_conv.py``: aten / cuDNN, on
channels-last tensors for 2-d and 3-d convs) gives the gradients of x, the
weight and the bias.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..conv_channel_reduce.backward import operand_grads, wanted_slots
from ..library_conv import conv_backward_plan
from .common import kernel_chains
from .config import ConvLayerNormConfig


def backward_triton(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                    saved_y: Tensor, saved_stats: Tensor, cfg: ConvLayerNormConfig,
                    mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False)."""
    from ...kernels.layer_norm import layer_norm_backward

    conv_backward = conv_backward_plan(x, weight, cfg.conv, saved_y)
    grad_y = conv_backward.new_grad_y(x.device)
    chains = kernel_chains(cfg, bias, operands, saved_y.dim(), saved_y.shape[1], x.device)
    operand_mask = list(mask[3:])
    affine_wanted = tuple(index is not None and bool(operand_mask[index]) for index in (cfg.weight, cfg.bias))
    pre_sums, post_sums, affine_sums = layer_norm_backward(
        grad_out, saved_y, saved_stats, cfg.normalized_dims, bias is not None, chains.pre, chains.post, chains.params,
        chains.post_params, chains.affine, grad_y, wanted_slots(cfg.pre, operand_mask),
        wanted_slots(cfg.post, operand_mask), affine_wanted,
    )  # fmt: skip
    grad_x, grad_w, grad_b = conv_backward(grad_y, x, weight, mask[0], mask[1], bool(mask[2]))
    grads = operand_grads(cfg, operands, operand_mask, pre_sums, post_sums)
    for index, total in zip((cfg.weight, cfg.bias), affine_sums, strict=True):
        if total is not None:
            t = operands[index]
            g = total.reshape(t.shape).to(t.dtype)
            grads[index] = g if grads[index] is None else grads[index] + g
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
