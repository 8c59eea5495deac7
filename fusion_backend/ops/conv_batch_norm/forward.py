"""The Triton forward of ``fusion::conv_batch_norm``: the library conv (cuDNN, through
``library_conv.conv_forward``: channels-last for 2-d and 3-d convs) without bias, then the
statistics kernel (per channel and chunk), their fixed-order combine, and the kernel that adds the bias, normalises, scales and shifts per
channel, applies the post-chain and writes the result (``kernels/batch_norm.py``); the running
statistics' update is a separate op (``op.py``).  Where the region ends in a max or avg pool, the
normalise pass is ``kernels/norm_pool.py``'s, which writes only the pooled result (and the max pool's
winners when the backward will need them).  Also the chain and operand rows as both
directions' kernels take them (``KernelChain``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from ...kernels.chain_math import KernelStep
from ..conv_channel_reduce.common import chain_kernel_steps
from ..library_conv import conv_forward, nominal_format
from .common import affine_rows, allocate_forward_outputs
from .config import ConvBatchNormConfig


@dataclass
class KernelChain:
    """The post-chain as the launchers take it, its operand matrix ``Q`` over the C channels, the
    norm's scale and shift rows ``A`` (``conv_group_norm.common.affine_rows``) and the conv bias as
    the kernels read it (C values, contiguous, or None)."""

    post: list[KernelStep]
    post_params: Tensor
    affine: Tensor
    bias: Tensor | None

    @staticmethod
    def build(cfg: ConvBatchNormConfig, bias: Tensor | None, operands: Sequence[Tensor], ndim: int, channels: int,
              device) -> KernelChain:  # fmt: skip
        from ...kernels.epilogue import build_params  # lazily: TRITON_INTERPRET is read at import

        post = chain_kernel_steps(cfg, cfg.post, operands, ndim, channels)
        flat_bias = None if bias is None else bias.reshape(-1).contiguous()
        return KernelChain(post, build_params(post, None, channels, device), affine_rows(operands, cfg, channels, device),
                           flat_bias)  # fmt: skip


def forward_triton(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvBatchNormConfig,
                   save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_winner, stats)`` as ``common.allocate_forward_outputs`` lays them out.
    With a pool the normalise pass is ``kernels/norm_pool.py``'s, which writes only the pooled result
    (and, saving for a max pool's backward, each window's winner)."""
    from ...kernels.batch_norm import batch_norm_apply, batch_norm_stats

    y0 = conv_forward(x, weight, cfg.conv, channels_last=True)
    out, saved_y, winner, stats = allocate_forward_outputs(x, y0, cfg, save, nominal_format(x, weight, cfg.conv))
    chain = KernelChain.build(cfg, bias, operands, y0.dim(), y0.shape[1], y0.device)
    batch_norm_stats(y0, chain.bias, cfg.eps, stats)  # mean, rstd, unbiased variance
    norm_stats = stats[:2]
    if cfg.pool is None:
        batch_norm_apply(y0, chain.bias, chain.post, chain.post_params, chain.affine, norm_stats, out)
    else:
        from ...kernels.epilogue import build_params
        from ...kernels.norm_pool import norm_pool_forward

        params = build_params([], bias, y0.shape[1], y0.device)  # the bias in its row, no pre-chain
        norm_pool_forward(y0, bias is not None, [], chain.post, params, chain.post_params, chain.affine, norm_stats,
                          cfg.pool, out, winner if winner.numel() else None)  # fmt: skip
    return out, saved_y, winner, stats
