"""The plain-torch reference of ``fusion::conv_batch_norm`` (CPU, float64, anything the kernels do not
cover, and the tests' definition of the op): ``forward`` runs eager's ops (``aten.native_batch_norm``
in training mode) and writes the same output and saved
state as the kernels; ``backward`` applies ``aten.native_batch_norm_backward`` and the chain's
derivative (``chain_reference``'s tape) to the values recomputed from the saved conv output and
statistics; a pool after the chain is eager's pool, its gradient ``chain_reference``'s.

NOTE: the norm runs on the conv output cast to the statistics' dtype (fp32; fp64 for an fp64 conv),
the dtype eager's batch norm accumulates in for every input dtype it takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..chain_reference import (
    apply_chain,
    chain_backward,
    chain_with_tape,
    pool_input_grad,
    pool_saving_winners,
)
from ..conv_io import channel_view, dtype_named, run_conv_backward
from ..library_conv import conv_forward, nominal_format
from .config import OP, ConvBatchNormConfig, norm_dtype, outputs, values_per_channel


def _affine(operands: Sequence[Tensor], index: int | None, dtype: torch.dtype) -> Tensor | None:
    return None if index is None else operands[index].detach().reshape(-1).to(dtype)


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvBatchNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager's ops on the conv output (the bias added after a bias-free conv, as the kernels do); a
    max pool's winners from ``return_indices``, as the kernels save them (``window_winners``).

    NOTE: ``native_batch_norm`` runs with running statistics of zeros and momentum 1, so that they
    come back as eager's own batch mean and unbiased variance (the update's operands)."""
    y0 = conv_forward(x, weight, cfg.conv, channels_last=True)
    values_per_channel(y0.shape)
    out, saved_y, winner, stats = outputs(x, y0, cfg, save, nominal_format(x, weight, cfg.conv))
    yb = y0 if bias is None else y0 + channel_view(bias.to(y0.dtype), y0.dim())
    sdt = stats.dtype
    batch_mean, batch_var = (torch.zeros(y0.shape[1], dtype=sdt, device=y0.device) for _ in range(2))
    z, mean, rstd = torch.ops.aten.native_batch_norm(
        yb.to(sdt), _affine(operands, cfg.weight, sdt), _affine(operands, cfg.bias, sdt), batch_mean, batch_var, True,
        1.0, cfg.eps,
    )  # fmt: skip
    result = apply_chain(z.to(norm_dtype(cfg, y0.dtype)), cfg.post, operands)
    out.copy_(pool_saving_winners(result, cfg.pool, winner).to(dtype_named(OP, cfg.out_dtype, y0.dtype)))
    stats[0].copy_(mean)
    stats[1].copy_(rstd)
    stats[2].copy_(batch_var)
    return out, saved_y, winner, stats


def backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], saved_y: Tensor,
    saved_winner: Tensor, saved_stats: Tensor, cfg: ConvBatchNormConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False).  Behind a
    pool the gradient of the chain's full-size result comes from ``pool_input_grad`` (a max pool's
    summed into each window's saved winner)."""
    operand_mask = list(mask[3:])
    sdt = saved_stats.dtype
    yb = saved_y if bias is None else saved_y + channel_view(bias.to(saved_y.dtype), saved_y.dim())
    v = yb.to(sdt)
    gamma, beta = _affine(operands, cfg.weight, sdt), _affine(operands, cfg.bias, sdt)
    mean, rstd = channel_view(saved_stats[0], v.dim()), channel_view(saved_stats[1], v.dim())
    z = (v - mean) * rstd
    if gamma is not None:
        z = z * channel_view(gamma, z.dim())
    if beta is not None:
        z = z + channel_view(beta, z.dim())
    z = z.to(norm_dtype(cfg, saved_y.dtype))
    out, post_tape = chain_with_tape(z, cfg.post, operands)
    grad = grad_out.to(out.dtype)
    if cfg.pool is not None:
        grad = pool_input_grad(grad, out, saved_winner, cfg.pool)
    grad_z, post_grads = chain_backward(post_tape, grad, operands, operand_mask)
    want_w = cfg.weight is not None and operand_mask[cfg.weight]
    want_b = cfg.bias is not None and operand_mask[cfg.bias]
    grad_v, grad_gamma, grad_beta = torch.ops.aten.native_batch_norm_backward(
        grad_z.to(sdt), v, gamma, None, None, saved_stats[0], saved_stats[1], True, cfg.eps, [True, want_w, want_b],
    )  # fmt: skip
    grad_x, grad_w, grad_b = run_conv_backward(grad_v.to(x.dtype).contiguous(), x, weight, cfg.conv, mask[0],
                                               mask[1], bool(mask[2]))  # fmt: skip
    grads = list(post_grads)
    for index, g in ((cfg.weight, grad_gamma if want_w else None), (cfg.bias, grad_beta if want_b else None)):
        if g is not None:
            t = operands[index]
            g = g.reshape(t.shape).to(t.dtype)
            grads[index] = g if grads[index] is None else grads[index] + g
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
