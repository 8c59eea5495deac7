"""The plain-torch reference of ``fusion::conv_group_norm`` (what every reference is: ``ops/declare.py``):
the norm's derivative is ``aten.native_group_norm_backward``, on the values recomputed from the saved
conv output and statistics; a pool after the chain is eager's pool (``chain_reference``'s helpers).

NOTE: the norm runs as ``aten.native_group_norm`` on the pre-chain's result cast to the statistics'
dtype (fp32; fp64 for an fp64 conv), which is what eager's group norm computes in for every dtype it
takes; an instance norm is the group norm with one channel per group (the same statistics).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..chain_reference import norm_backward, norm_forward
from .config import OP, ConvGroupNormConfig, conv_outputs


def _sizes(v: Tensor) -> tuple[int, int, int]:
    return v.shape[0], v.shape[1], math.prod(v.shape[2:])


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvGroupNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager's ops on the conv output (``chain_reference.norm_forward``); a max pool's winners from
    ``return_indices``, as the kernels save them (``window_winners``)."""
    y0, out, saved_y, winner, stats = conv_outputs(x, weight, cfg, save)

    def norm(v: Tensor, gamma: Tensor | None, beta: Tensor | None) -> tuple[Tensor, ...]:
        return torch.ops.aten.native_group_norm(v.contiguous(), gamma, beta, *_sizes(v), cfg.groups, cfg.eps)

    norm_forward(OP, y0, bias, operands, cfg, out, stats, norm, winner)
    return out, saved_y, winner, stats


def normalized(v: Tensor, stats: Tensor, groups: int) -> Tensor:
    """``(v - mean) * rstd`` per (sample, group), in ``stats``' dtype (``v``: the pre-chain's result)."""
    grouped = v.to(stats.dtype).unflatten(1, (groups, -1)).flatten(2)  # (a batch of 0 has no -1 to infer)
    return ((grouped - stats[0].unsqueeze(-1)) * stats[1].unsqueeze(-1)).reshape(v.shape)


def backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], saved_y: Tensor,
    saved_winner: Tensor, saved_stats: Tensor, cfg: ConvGroupNormConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    """``chain_reference.norm_backward`` with ``aten.native_group_norm_backward``."""

    def norm_grads(grad_z: Tensor, v: Tensor, want: list[bool], gamma: Tensor | None,
                   beta: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
        return torch.ops.aten.native_group_norm_backward(grad_z.contiguous(), v.contiguous(), saved_stats[0].contiguous(),
                                                         saved_stats[1].contiguous(), gamma, *_sizes(v), cfg.groups,
                                                         want)  # fmt: skip

    return norm_backward(OP, grad_out, x, weight, bias, operands, saved_y, saved_stats, cfg, mask,
                         lambda v: normalized(v, saved_stats, cfg.groups), norm_grads, saved_winner)  # fmt: skip
