"""The Triton path of ``fusion::conv_group_norm`` (the frame every family's: ``ops/declare.py``; the
conv here is eager's, ``run_conv``).

Forward: ``kernels/group_norm.py``'s forward (one launch, or two where large groups are split into
chunks) adds the bias, applies the pre-chain, normalises each (sample, group), scales and shifts per
channel, applies the post-chain and writes the result and the group statistics; where the region ends
in a max or avg pool, the statistics pass runs alone and ``kernels/norm_pool.py`` normalises, pools
and writes only the pooled result (and, saving for a max pool's backward, each window's winner).

Backward: ``kernels/group_norm.py``'s backward from the output gradient, the saved conv output and the
group statistics (behind a pool each position's gradient gathered from the pooled one, a max pool's
only at the saved winners), with the norm's weight and bias gradients as partial sums too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..chain_lowering import norm_chains, norm_operand_grads, wanted_slots
from ..library_conv import conv_backward_plan
from .config import ConvGroupNormConfig, conv_outputs


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvGroupNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_winner, saved_stats)`` as ``config.conv_outputs`` lays them out."""
    from ...kernels.group_norm import group_norm_forward

    y0, out, saved_y, winner, stats = conv_outputs(x, weight, cfg, save)
    chains = norm_chains(cfg, bias, operands, y0.dim(), y0.shape[1], y0.device)
    if cfg.pool is None:
        group_norm_forward(y0, bias is not None, chains.pre, chains.post, cfg.groups, cfg.eps, chains.params,
                           chains.post_params, chains.affine, out, stats if save else None)  # fmt: skip
        return out, saved_y, winner, stats
    from ...kernels.group_norm import group_norm_stats
    from ...kernels.norm_pool import norm_pool_forward

    group_stats = stats if save else torch.empty((2, y0.shape[0], cfg.groups), dtype=torch.float32, device=y0.device)
    group_norm_stats(y0, bias is not None, chains.pre, cfg.groups, cfg.eps, chains.params, group_stats)
    norm_pool_forward(y0, bias is not None, chains.pre, chains.post, chains.params, chains.post_params, chains.affine,
                      group_stats, cfg.pool, out, winner if winner.numel() else None)  # fmt: skip
    return out, saved_y, winner, stats


def backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor, cfg: ConvGroupNormConfig,
             mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False).  With a
    pool ``grad_out`` is the pooled result's gradient."""
    from ...kernels.group_norm import group_norm_backward

    conv_backward = conv_backward_plan(x, weight, cfg.conv, saved_y)
    grad_y = conv_backward.new_grad_y(x.device)
    chains = norm_chains(cfg, bias, operands, saved_y.dim(), saved_y.shape[1], x.device)
    operand_mask = list(mask[3:])
    affine_wanted = tuple(index is not None and bool(operand_mask[index]) for index in (cfg.weight, cfg.bias))
    pre_sums, post_sums, affine_sums = group_norm_backward(
        grad_out, saved_y, saved_stats, bias is not None, chains.pre, chains.post, cfg.groups, chains.params,
        chains.post_params, chains.affine, grad_y, wanted_slots(cfg.pre, operand_mask),
        wanted_slots(cfg.post, operand_mask), affine_wanted, pool=cfg.pool,
        winner=saved_winner if saved_winner.numel() else None,
    )  # fmt: skip
    grad_x, grad_w, grad_b = conv_backward(grad_y, x, weight, mask[0], mask[1], bool(mask[2]))
    grads = norm_operand_grads(operands, operand_mask, cfg, [(cfg.pre, pre_sums), (cfg.post, post_sums)], affine_sums)
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
