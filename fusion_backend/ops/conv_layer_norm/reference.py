"""The plain-torch reference of ``fusion::conv_layer_norm`` (CPU, float64, anything the kernels do
not cover, and the tests' definition of the op): ``forward`` runs eager's ops and writes the same
output and saved state as the kernels; ``backward`` applies torch's derivative formulas (the chains'
with ``chain_reference``'s tape, the norm's with ``aten.native_layer_norm_backward``) to the
values recomputed from the saved conv output and statistics.

NOTE: the norm runs as ``aten.native_layer_norm`` on the pre-chain's result cast to the statistics'
dtype (fp32; fp64 for an fp64 conv), which is what eager's layer norm computes in for every dtype it
takes; its result is then cast to the norm's dtype as eager's is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..chain_reference import add_grads, apply_chain, chain_backward, chain_with_tape
from ..conv_io import channel_view, dtype_named, run_conv_backward, stats_dtype
from ..library_conv import conv_forward
from .config import OP, ConvLayerNormConfig, norm_dtype, outputs


def _affine(operands: Sequence[Tensor], index: int | None, cfg: ConvLayerNormConfig, dtype: torch.dtype) -> Tensor | None:
    return None if index is None else operands[index].detach().reshape(cfg.normalized_shape).to(dtype)


def _stat_shape(v: Tensor, cfg: ConvLayerNormConfig) -> list[int]:
    """The shape ``native_layer_norm`` gives its mean and rstd: the leading dims, then ones."""
    return [*v.shape[: v.dim() - cfg.normalized_dims], *([1] * cfg.normalized_dims)]


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvLayerNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager's ops on the conv output (the bias added after a bias-free conv, as the kernels do)."""
    y0 = conv_forward(x, weight, cfg.conv, channels_last=True)
    out, saved_y, stats = outputs(x, y0, cfg, save)
    yb = y0 if bias is None else y0 + channel_view(bias.to(y0.dtype), y0.dim())
    v = apply_chain(yb, cfg.pre, operands)
    sdt = stats_dtype(y0.dtype)
    z, mean, rstd = torch.ops.aten.native_layer_norm(
        v.to(sdt), list(cfg.normalized_shape), _affine(operands, cfg.weight, cfg, sdt),
        _affine(operands, cfg.bias, cfg, sdt), cfg.eps,
    )  # fmt: skip
    result = apply_chain(z.to(norm_dtype(cfg, y0.dtype)), cfg.post, operands)
    out.copy_(result.to(dtype_named(OP, cfg.out_dtype, y0.dtype)))
    if save:
        stats[0].copy_(mean.reshape(-1))
        stats[1].copy_(rstd.reshape(-1))
    return out, saved_y, stats


def backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], saved_y: Tensor,
    saved_stats: Tensor, cfg: ConvLayerNormConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False)."""
    operand_mask = list(mask[3:])
    sdt = saved_stats.dtype
    yb = saved_y if bias is None else saved_y + channel_view(bias.to(saved_y.dtype), saved_y.dim())
    v, pre_tape = chain_with_tape(yb, cfg.pre, operands)
    gamma, beta = _affine(operands, cfg.weight, cfg, sdt), _affine(operands, cfg.bias, cfg, sdt)
    mean = saved_stats[0].reshape(_stat_shape(v, cfg))
    rstd = saved_stats[1].reshape(_stat_shape(v, cfg))
    vs = v.to(sdt)
    z = (vs - mean) * rstd
    if gamma is not None:
        z = z * gamma
    if beta is not None:
        z = z + beta
    z = z.to(norm_dtype(cfg, saved_y.dtype))
    out, post_tape = chain_with_tape(z, cfg.post, operands)
    grad_z, post_grads = chain_backward(post_tape, grad_out.to(out.dtype), operands, operand_mask)
    want_w = cfg.weight is not None and operand_mask[cfg.weight]
    want_b = cfg.bias is not None and operand_mask[cfg.bias]
    grad_v, grad_gamma, grad_beta = torch.ops.aten.native_layer_norm_backward(
        grad_z.to(sdt).contiguous(), vs.contiguous(), list(cfg.normalized_shape), mean.contiguous(),
        rstd.contiguous(), gamma, beta, [True, want_w, want_b],
    )  # fmt: skip
    grad_y, pre_grads = chain_backward(pre_tape, grad_v.to(yb.dtype), operands, operand_mask)
    grad_x, grad_w, grad_b = run_conv_backward(grad_y.to(x.dtype).contiguous(), x, weight, cfg.conv, mask[0],
                                               mask[1], bool(mask[2]))  # fmt: skip
    grads = [add_grads(a, b) for a, b in zip(pre_grads, post_grads, strict=True)]
    for index, g in ((cfg.weight, grad_gamma if want_w else None), (cfg.bias, grad_beta if want_b else None)):
        if g is not None:
            t = operands[index]
            grads[index] = add_grads(grads[index], g.reshape(t.shape).to(t.dtype))
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]

