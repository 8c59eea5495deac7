"""The Triton forward of ``fusion::conv_group_norm``: the library conv (cuDNN, through
``conv_epilogue``'s ``run_conv``) without bias, then ``kernels/group_norm.py``'s forward (one
launch, or two where large groups are split into chunks) that adds the bias, applies the pre-chain,
normalises each (sample, group), scales and shifts per channel, applies the post-chain and writes the
result and the group statistics; where the region ends in a max or avg pool, the statistics pass runs
alone and ``kernels/norm_pool.py`` normalises, pools and writes only the pooled result.  Also the chains and operand matrices as both directions' kernels
take them (``KernelChains``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...kernels.chain_math import KernelStep
from ..conv_channel_reduce.common import chain_kernel_steps
from ..conv_epilogue.common import run_conv
from .common import affine_rows, allocate_forward_outputs
from .config import ConvGroupNormConfig


@dataclass
class KernelChains:
    """The pre- and post-chain as the launchers take them, their operand matrices ``P`` (bias row +
    pre-chain operands) and ``Q`` (post-chain operands), both over the C channels, and the norm's
    scale and shift rows ``A`` (``common.affine_rows``)."""

    pre: list[KernelStep]
    post: list[KernelStep]
    params: Tensor
    post_params: Tensor
    affine: Tensor

    @staticmethod
    def build(cfg: ConvGroupNormConfig, bias: Tensor | None, operands: Sequence[Tensor], ndim: int, channels: int,
              device) -> KernelChains:  # fmt: skip
        from ...kernels.epilogue import build_params  # lazily: TRITON_INTERPRET is read at import

        pre = chain_kernel_steps(cfg, cfg.pre, operands, ndim, channels)
        post = chain_kernel_steps(cfg, cfg.post, operands, ndim, channels)
        return KernelChains(pre, post, build_params(pre, bias, channels, device), build_params(post, None, channels, device),
                            affine_rows(operands, cfg, channels, device))  # fmt: skip


def forward_triton(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                   cfg: ConvGroupNormConfig, save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_winner, saved_stats)`` as ``common.allocate_forward_outputs`` lays them
    out.  With a pool the statistics pass runs alone (``group_norm_stats``) and the normalise pass is
    ``kernels/norm_pool.py``'s, which writes only the pooled result (and, saving for a max pool's
    backward, each window's winner)."""
    from ...kernels.group_norm import group_norm_forward

    y0 = run_conv(x, weight, None, cfg.conv)
    out, saved_y, winner, stats = allocate_forward_outputs(x, y0, cfg, save)
    chains = KernelChains.build(cfg, bias, operands, y0.dim(), y0.shape[1], y0.device)
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
