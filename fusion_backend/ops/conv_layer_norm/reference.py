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

from ..chain_reference import norm_affine, norm_backward, norm_forward
from .config import OP, ConvLayerNormConfig, conv_outputs


def _stat_shape(v: Tensor, cfg: ConvLayerNormConfig) -> list[int]:
    """The shape ``native_layer_norm`` gives its mean and rstd: the leading dims, then ones."""
    return [*v.shape[: v.dim() - cfg.normalized_dims], *([1] * cfg.normalized_dims)]


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvLayerNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager's ops on the conv output (``chain_reference.norm_forward``)."""
    y0, out, saved_y, stats = conv_outputs(x, weight, cfg, save)

    def norm(v: Tensor) -> tuple[Tensor, ...]:
        gamma, beta = norm_affine(operands, cfg, v.dtype, cfg.normalized_shape)
        return torch.ops.aten.native_layer_norm(v, list(cfg.normalized_shape), gamma, beta, cfg.eps)

    mean, rstd = norm_forward(OP, y0, bias, operands, cfg, out, norm)
    if save:
        stats[0].copy_(mean.reshape(-1))
        stats[1].copy_(rstd.reshape(-1))
    return out, saved_y, stats


def backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], saved_y: Tensor,
    saved_stats: Tensor, cfg: ConvLayerNormConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    """``chain_reference.norm_backward`` with ``aten.native_layer_norm_backward``."""
    sdt = saved_stats.dtype
    gamma, beta = norm_affine(operands, cfg, sdt, cfg.normalized_shape)

    def normalize(v: Tensor) -> Tensor:
        shape = _stat_shape(v, cfg)
        z = (v.to(sdt) - saved_stats[0].reshape(shape)) * saved_stats[1].reshape(shape)
        z = z if gamma is None else z * gamma
        return z if beta is None else z + beta

    def norm_grads(grad_z: Tensor, v: Tensor, want: list[bool]) -> tuple[Tensor, Tensor | None, Tensor | None]:
        shape = _stat_shape(v, cfg)
        return torch.ops.aten.native_layer_norm_backward(
            grad_z.to(sdt).contiguous(), v.to(sdt).contiguous(), list(cfg.normalized_shape),
            saved_stats[0].reshape(shape).contiguous(), saved_stats[1].reshape(shape).contiguous(), gamma, beta, want,
        )  # fmt: skip

    return norm_backward(OP, grad_out, x, weight, bias, operands, saved_y, cfg, mask, normalize, norm_grads)  # fmt: skip
