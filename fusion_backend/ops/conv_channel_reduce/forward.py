"""The Triton forward of ``fusion::conv_channel_reduce``: the library conv (cuDNN, through
``library_conv.conv_forward``: channels-last for 2-d and 3-d convs) without bias, then ONE kernel (``kernels/channel_reduce.py``) that
adds the bias, applies the pre-chain, reduces over the channels, applies the post-chain and writes
the result and the saved state.  Also the chains and operand matrices as both directions' kernels
take them (``KernelChains``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from ...kernels.chain_math import KernelStep
from ..library_conv import conv_forward, nominal_format
from .common import allocate_forward_outputs, chain_kernel_steps
from .config import ConvChannelReduceConfig


@dataclass
class KernelChains:
    """The pre- and post-chain as the launchers take them, and their operand matrices: ``P``
    (bias row + pre-chain operands over the C channels) and ``Q`` (post-chain operands over C
    channels for softmax / log_softmax, over one value after a reduction)."""

    pre: list[KernelStep]
    post: list[KernelStep]
    params: Tensor
    post_params: Tensor

    @staticmethod
    def build(cfg: ConvChannelReduceConfig, bias: Tensor | None, operands: Sequence[Tensor], ndim: int,
              channels: int, device) -> KernelChains:  # fmt: skip
        from ...kernels.epilogue import build_params  # lazily: TRITON_INTERPRET is read at import

        columns = channels if cfg.full_size else 1
        pre = chain_kernel_steps(cfg, cfg.pre, operands, ndim, channels)
        post = chain_kernel_steps(cfg, cfg.post, operands, ndim, columns)
        return KernelChains(pre, post, build_params(pre, bias, channels, device),
                            build_params(post, None, columns, device))  # fmt: skip


def forward_triton(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                   cfg: ConvChannelReduceConfig, save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_index, saved_stats)`` as ``common.allocate_forward_outputs`` lays them out."""
    from ...kernels.channel_reduce import channel_reduce_forward

    y0 = conv_forward(x, weight, cfg.conv, channels_last=True)
    out, saved_y, index, stats = allocate_forward_outputs(x, y0, cfg, save, nominal_format(x, weight, cfg.conv))
    chains = KernelChains.build(cfg, bias, operands, y0.dim(), y0.shape[1], y0.device)
    channel_reduce_forward(
        y0, bias is not None, chains.pre, chains.post, cfg.reduction, chains.params, chains.post_params, out,
        index if save and cfg.reduction in ("min", "max") else None, stats if save else None,
    )  # fmt: skip
    return out, saved_y, index, stats
