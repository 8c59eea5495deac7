"""The Triton path of ``fusion::conv_channel_reduce`` (the frame every family's: ``ops/declare.py``).

Forward: ONE kernel (``kernels/channel_reduce.py``) adds the bias, applies the pre-chain, reduces over
the channels, applies the post-chain and writes the result and the saved state.  Backward: ONE kernel
(``kernels/channel_reduce.py``) from the output gradient and the saved state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..chain_lowering import KernelChains, operand_grads, wanted_slots
from ..library_conv import conv_backward_plan, conv_forward
from .config import ConvChannelReduceConfig, conv_outputs, needs_y


def _chains(cfg: ConvChannelReduceConfig, bias: Tensor | None, operands: Sequence[Tensor], ndim: int, channels: int,
            device: torch.device) -> KernelChains:  # fmt: skip
    """The chains; the post-chain's operands over C channels for softmax / log_softmax, over one value
    after a reduction."""
    return KernelChains(cfg.pre, cfg.post, bias, operands, ndim, channels, device,
                        post_columns=channels if cfg.full_size else 1)  # fmt: skip


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
            cfg: ConvChannelReduceConfig, save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_index, saved_stats)`` as ``config.conv_outputs`` lays them out."""
    from ...kernels.channel_reduce import channel_reduce_forward

    alone = None if save else conv_forward(x, weight, cfg.conv, channels_last=True, alone=True)
    y0, out, saved_y, index, stats = conv_outputs(x, weight, cfg, save, alone)
    chains = _chains(cfg, bias, operands, y0.dim(), y0.shape[1], y0.device)
    channel_reduce_forward(
        y0, bias is not None, chains.pre, chains.post, cfg.reduction, chains.params, chains.post_params, out,
        index if save and cfg.reduction in ("min", "max") else None, stats if save else None,
    )  # fmt: skip
    return out, saved_y, index, stats


def backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             saved_y: Tensor, saved_index: Tensor, saved_stats: Tensor, cfg: ConvChannelReduceConfig,
             mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False)."""
    from ...kernels.channel_reduce import channel_reduce_backward

    conv_backward = conv_backward_plan(x, weight, cfg.conv, saved_y if needs_y(cfg) else x)
    grad_y = conv_backward.new_grad_y(x.device)
    shape = grad_y.shape
    chains = _chains(cfg, bias, operands, len(shape), shape[1], x.device)
    operand_mask = list(mask[3:])
    pre_sums, post_sums = channel_reduce_backward(
        grad_out, saved_y if needs_y(cfg) else None, saved_index if cfg.reduction in ("min", "max") else None,
        saved_stats, bias is not None, chains.pre, chains.post, cfg.reduction, chains.params, chains.post_params,
        grad_y, wanted_slots(cfg.pre, operand_mask), wanted_slots(cfg.post, operand_mask),
    )  # fmt: skip
    grad_x, grad_w, grad_b = conv_backward(grad_y, x, weight, mask[0], mask[1], bool(mask[2]))
    grads = operand_grads(operands, operand_mask, [(cfg.pre, pre_sums), (cfg.post, post_sums)])
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
