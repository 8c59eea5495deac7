"""The Triton forward of ``fusion::conv_layer_norm``: the library conv (cuDNN, through
``library_conv.conv_forward``: channels-last for 2-d and 3-d convs) without bias, then
``kernels/layer_norm.py``'s forward (one launch, or two where long rows are split into chunks) that
adds the bias, applies the pre-chain, normalises
each row, scales and shifts elementwise, applies the post-chain and writes the result (contiguous,
as eager's layer norm) and the row statistics.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..library_conv import conv_forward
from .common import allocate_forward_outputs, kernel_chains
from .config import ConvLayerNormConfig


def forward_triton(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                   cfg: ConvLayerNormConfig, save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_stats)`` as ``common.allocate_forward_outputs`` lays them out."""
    from ...kernels.layer_norm import layer_norm_forward

    y0 = conv_forward(x, weight, cfg.conv, channels_last=True)
    out, saved_y, stats = allocate_forward_outputs(x, y0, cfg, save)
    chains = kernel_chains(cfg, bias, operands, y0.dim(), y0.shape[1], y0.device)
    layer_norm_forward(y0, cfg.normalized_dims, bias is not None, chains.pre, chains.post, cfg.eps, chains.params,
                       chains.post_params, chains.affine, out, stats if save else None)  # fmt: skip
    return out, saved_y, stats
