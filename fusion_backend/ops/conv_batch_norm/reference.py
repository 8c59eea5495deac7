"""The plain-torch reference of ``fusion::conv_batch_norm`` (what every reference is: ``ops/declare.py``):
``aten.native_batch_norm`` in training mode and its backward, on the values recomputed from the saved
conv output and statistics; a pool after the chain is eager's pool, its gradient ``chain_reference``'s.

NOTE: the norm runs on the conv output cast to the statistics' dtype (fp32; fp64 for an fp64 conv),
the dtype eager's batch norm accumulates in for every input dtype it takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..batch_statistics import fill_folded_rows, values_per_channel
from ..chain_reference import norm_affine, norm_backward, norm_forward
from ..conv_io import channel_view
from .config import OP, ConvBatchNormConfig, conv_outputs


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvBatchNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager's ops on the conv output (``chain_reference.norm_forward``); a max pool's winners from
    ``return_indices``, as the kernels save them (``window_winners``).

    NOTE: ``native_batch_norm`` runs with running statistics of zeros and momentum 1, so that they
    come back as eager's own batch mean and unbiased variance (the update's operands)."""
    y0, out, saved_y, winner, stats = conv_outputs(x, weight, cfg, save)
    values_per_channel(y0.shape)
    batch_mean, batch_var = (torch.zeros(y0.shape[1], dtype=stats.dtype, device=y0.device) for _ in range(2))

    def norm(v: Tensor, gamma: Tensor | None, beta: Tensor | None) -> tuple[Tensor, ...]:
        return torch.ops.aten.native_batch_norm(v, gamma, beta, batch_mean, batch_var, True, 1.0, cfg.eps)

    norm_forward(OP, y0, bias, operands, cfg, out, stats, norm, winner)  # rows 0-1: mean, rstd
    stats[2].copy_(batch_var)
    fill_folded_rows(stats, *norm_affine(operands, cfg, stats.dtype))
    return out, saved_y, winner, stats


def backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], saved_y: Tensor,
    saved_winner: Tensor, saved_stats: Tensor, cfg: ConvBatchNormConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    """``chain_reference.norm_backward`` with ``aten.native_batch_norm_backward``."""

    def normalized(v: Tensor) -> Tensor:
        return (v.to(saved_stats.dtype) - channel_view(saved_stats[0], v.dim())) * channel_view(saved_stats[1], v.dim())

    def norm_grads(grad_z: Tensor, v: Tensor, want: list[bool], gamma: Tensor | None,
                   beta: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
        return torch.ops.aten.native_batch_norm_backward(grad_z, v, gamma, None, None, saved_stats[0], saved_stats[1],
                                                         True, cfg.eps, want)  # fmt: skip

    return norm_backward(OP, grad_out, x, weight, bias, operands, saved_y, saved_stats, cfg, mask, normalized,
                         norm_grads, saved_winner)  # fmt: skip
