"""The plain-torch reference of ``fusion::conv_group_norm`` (CPU, float64, anything the kernels do not
cover, and the tests' definition of the op): ``forward`` runs eager's ops and writes the same output
and saved state as the kernels; ``backward`` applies torch's derivative formulas (the chains' with
``chain_reference``'s tape, the norm's with ``aten.native_group_norm_backward``) to the values
recomputed from the saved conv output and statistics; a pool after the chain is eager's pool
(``chain_reference``'s helpers for both).

NOTE: the norm runs as ``aten.native_group_norm`` on the pre-chain's result cast to the statistics'
dtype (fp32; fp64 for an fp64 conv), which is what eager's group norm computes in for every dtype it
takes; an instance norm is the group norm with one channel per group (the same statistics).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..chain_reference import (
    add_grads,
    apply_chain,
    chain_backward,
    chain_with_tape,
    pool_input_grad,
    pool_saving_winners,
)
from ..conv_io import channel_view, dtype_named, run_conv, run_conv_backward, stats_dtype
from .config import OP, ConvGroupNormConfig, norm_dtype, outputs


def _affine(operands: Sequence[Tensor], index: int | None, dtype: torch.dtype) -> Tensor | None:
    return None if index is None else operands[index].detach().reshape(-1).to(dtype)


def _sizes(v: Tensor) -> tuple[int, int, int]:
    return v.shape[0], v.shape[1], math.prod(v.shape[2:])


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvGroupNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager's ops on the conv output (the bias added after a bias-free conv, as the kernels do); a
    max pool's winners from ``return_indices``, as the kernels save them (``window_winners``)."""
    y0 = run_conv(x, weight, None, cfg.conv)
    out, saved_y, winner, stats = outputs(x, y0, cfg, save)
    yb = y0 if bias is None else y0 + channel_view(bias.to(y0.dtype), y0.dim())
    v = apply_chain(yb, cfg.pre, operands)
    sdt = stats_dtype(y0.dtype)
    n, c, hw = _sizes(v)
    z, mean, rstd = torch.ops.aten.native_group_norm(
        v.to(sdt).contiguous(), _affine(operands, cfg.weight, sdt), _affine(operands, cfg.bias, sdt), n, c, hw,
        cfg.groups, cfg.eps,
    )  # fmt: skip
    result = apply_chain(z.to(norm_dtype(cfg, y0.dtype)), cfg.post, operands)
    out.copy_(pool_saving_winners(result, cfg.pool, winner).to(dtype_named(OP, cfg.out_dtype, y0.dtype)))
    if save:
        stats[0].copy_(mean.reshape(n, cfg.groups))
        stats[1].copy_(rstd.reshape(n, cfg.groups))
    return out, saved_y, winner, stats


def normalized(v: Tensor, stats: Tensor, groups: int) -> Tensor:
    """``(v - mean) * rstd`` per (sample, group), in ``stats``' dtype (``v``: the pre-chain's result)."""
    n = v.shape[0]
    grouped = v.to(stats.dtype).reshape(n, groups, -1)
    return ((grouped - stats[0].unsqueeze(-1)) * stats[1].unsqueeze(-1)).reshape(v.shape)


def backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], saved_y: Tensor,
    saved_winner: Tensor, saved_stats: Tensor, cfg: ConvGroupNormConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False).  Behind a
    pool the gradient of the post-chain's full-size result comes from ``pool_input_grad`` (a max
    pool's summed into each window's saved winner)."""
    operand_mask = list(mask[3:])
    sdt = saved_stats.dtype
    yb = saved_y if bias is None else saved_y + channel_view(bias.to(saved_y.dtype), saved_y.dim())
    v, pre_tape = chain_with_tape(yb, cfg.pre, operands)
    gamma, beta = _affine(operands, cfg.weight, sdt), _affine(operands, cfg.bias, sdt)
    z = normalized(v, saved_stats, cfg.groups)
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
    n, c, hw = _sizes(v)
    want_w = cfg.weight is not None and operand_mask[cfg.weight]
    want_b = cfg.bias is not None and operand_mask[cfg.bias]
    grad_v, grad_gamma, grad_beta = torch.ops.aten.native_group_norm_backward(
        grad_z.to(sdt).contiguous(), v.to(sdt).contiguous(), saved_stats[0].contiguous(),
        saved_stats[1].contiguous(), gamma, n, c, hw, cfg.groups, [True, want_w, want_b],
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

