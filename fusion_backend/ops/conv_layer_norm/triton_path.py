"""The Triton path of ``fusion::conv_layer_norm`` (the frame every family's: ``ops/declare.py``).

Forward: ``kernels/layer_norm.py``'s forward (one launch, or two where long rows are split into
chunks) adds the bias, applies the pre-chain, normalises each row, scales and shifts elementwise,
applies the post-chain and writes the result (contiguous, as eager's layer norm) and the row
statistics.  Backward: ``kernels/layer_norm.py``'s backward (one launch for rows packed in tiles, two
for rows walked in chunks) from the output gradient, the saved conv output and the row statistics,
with the norm's elementwise weight and bias gradients as partial sums too.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..chain_lowering import norm_chains, norm_operand_grads, wanted_slots
from ..library_conv import conv_backward_plan, conv_forward
from .config import ConvLayerNormConfig, conv_outputs


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvLayerNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_stats)`` as ``config.conv_outputs`` lays them out."""
    from ...kernels.layer_norm import layer_norm_forward

    alone = None if save else conv_forward(x, weight, cfg.conv, channels_last=True, alone=True)
    y0, out, saved_y, stats = conv_outputs(x, weight, cfg, save, alone)
    chains = norm_chains(cfg, bias, operands, y0.dim(), y0.shape[1], y0.device, cfg.elements)
    layer_norm_forward(y0, cfg.normalized_dims, bias is not None, chains.pre, chains.post, cfg.eps, chains.params,
                       chains.post_params, chains.affine, out, stats if save else None)  # fmt: skip
    return out, saved_y, stats


def backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             saved_y: Tensor, saved_stats: Tensor, cfg: ConvLayerNormConfig,
             mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False)."""
    from ...kernels.layer_norm import layer_norm_backward

    conv_backward = conv_backward_plan(x, weight, cfg.conv, saved_y)
    grad_y = conv_backward.new_grad_y(x.device)
    chains = norm_chains(cfg, bias, operands, saved_y.dim(), saved_y.shape[1], x.device, cfg.elements)
    operand_mask = list(mask[3:])
    affine_wanted = tuple(index is not None and bool(operand_mask[index]) for index in (cfg.weight, cfg.bias))
    pre_sums, post_sums, affine_sums = layer_norm_backward(
        grad_out, saved_y, saved_stats, cfg.normalized_dims, bias is not None, chains.pre, chains.post, chains.params,
        chains.post_params, chains.affine, grad_y, wanted_slots(cfg.pre, operand_mask),
        wanted_slots(cfg.post, operand_mask), affine_wanted,
    )  # fmt: skip
    grad_x, grad_w, grad_b = conv_backward(grad_y, x, weight, mask[0], mask[1], bool(mask[2]))
    grads = norm_operand_grads(operands, operand_mask, cfg, [(cfg.pre, pre_sums), (cfg.post, post_sums)], affine_sums)
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
