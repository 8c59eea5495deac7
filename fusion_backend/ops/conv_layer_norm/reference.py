"""The plain-torch reference of ``fusion::conv_layer_norm`` (what every reference is: ``ops/declare.py``):
the norm's derivative is ``aten.native_layer_norm_backward``, on the values recomputed from the saved
conv output and statistics.

NOTE: the norm runs as ``aten.native_layer_norm`` on the pre-chain's result cast to the statistics'
dtype (fp32; fp64 for an fp64 conv), which is what eager's layer norm computes in for every dtype it
takes; its result is then cast to the norm's dtype as eager's is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..chain_reference import norm_backward, norm_forward
from .config import OP, ConvLayerNormConfig, conv_outputs


def _stat_shape(v: Tensor, cfg: ConvLayerNormConfig) -> list[int]:
    """The shape ``native_layer_norm`` gives its mean and rstd: the leading dims, then ones."""
    return [*v.shape[: v.dim() - cfg.normalized_dims], *([1] * cfg.normalized_dims)]


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvLayerNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager's ops on the conv output (``chain_reference.norm_forward``)."""
    y0, out, saved_y, stats = conv_outputs(x, weight, cfg, save)

    def norm(v: Tensor, gamma: Tensor | None, beta: Tensor | None) -> tuple[Tensor, ...]:
        return torch.ops.aten.native_layer_norm(v, list(cfg.normalized_shape), gamma, beta, cfg.eps)

    norm_forward(OP, y0, bias, operands, cfg, out, stats, norm, affine_shape=cfg.normalized_shape)
    return out, saved_y, stats


def backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], saved_y: Tensor,
    saved_stats: Tensor, cfg: ConvLayerNormConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    """``chain_reference.norm_backward`` with ``aten.native_layer_norm_backward``."""

    def stat(v: Tensor, row: int) -> Tensor:
        return saved_stats[row].reshape(_stat_shape(v, cfg))

    def norm_grads(grad_z: Tensor, v: Tensor, want: list[bool], gamma: Tensor | None,
                   beta: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
        return torch.ops.aten.native_layer_norm_backward(grad_z.contiguous(), v.contiguous(), list(cfg.normalized_shape),
                                                         stat(v, 0).contiguous(), stat(v, 1).contiguous(), gamma, beta,
                                                         want)  # fmt: skip

    return norm_backward(OP, grad_out, x, weight, bias, operands, saved_y, saved_stats, cfg, mask,
                         lambda v: (v.to(saved_stats.dtype) - stat(v, 0)) * stat(v, 1), norm_grads,
                         affine_shape=cfg.normalized_shape)  # fmt: skip
