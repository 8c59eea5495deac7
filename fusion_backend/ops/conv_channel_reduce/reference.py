"""The plain-torch reference of ``fusion::conv_channel_reduce`` (what every reference is:
``ops/declare.py``); the backward recomputes the chains from the saved state.

NOTE: the chains are differentiated with ``chain_reference``'s tape (torch's backward formulas, not
``torch.autograd``: custom-op implementations run below the autograd dispatch key, see there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..chain_reference import add_grads, apply_chain, chain_backward, chain_with_tape, with_bias
from ..conv_io import (
    conv_channels,
    conv_output_shape,
    dtype_named,
    in_format,
    output_memory_format,
    run_conv_backward,
)
from .config import OP, ConvChannelReduceConfig, conv_outputs, needs_y


def post_operands(operands: Sequence[Tensor], cfg: ConvChannelReduceConfig) -> list[Tensor]:
    """The operands as the post-chain reads them: after a reduction (no channel dim) a one-element
    tensor is a 0-d value, so that it broadcasts against ``(N, *spatial)``."""
    if cfg.full_size:
        return list(operands)
    return [t.reshape(()) if t.numel() == 1 else t for t in operands]


def _safe(m: Tensor) -> Tensor:
    return torch.where(m.abs() == float("inf"), torch.zeros_like(m), m)


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvChannelReduceConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager's ops on the conv output (the bias added after a bias-free conv, as the kernels do)."""
    y0, out, saved_y, index, stats = conv_outputs(x, weight, cfg, save)
    yb = with_bias(y0, bias)
    v = apply_chain(yb, cfg.pre, operands)
    kind, keep = cfg.reduction, cfg.keepdim
    if kind in ("min", "max"):
        r, idx = (torch.min if kind == "min" else torch.max)(v, 1)
        if save:
            index.copy_(idx)
            stats[1].copy_(yb.gather(1, idx.unsqueeze(1)).squeeze(1))
    elif kind in ("amin", "amax"):
        r = (torch.amin if kind == "amin" else torch.amax)(v, 1)
        if save:
            stats[1].copy_((v == r.unsqueeze(1)).sum(1))
    elif kind == "sum":
        r = v.sum(1)
    elif kind == "mean":
        r = v.mean(1)
    elif kind == "logsumexp":
        r = torch.logsumexp(v, 1)
    else:
        r = torch.softmax(v, 1) if kind == "softmax" else torch.log_softmax(v, 1)
        if save:
            m = torch.where(v.isnan(), float("-inf"), v).amax(1)
            stats[0].copy_(m)
            stats[1].copy_(torch.exp(v - _safe(m).unsqueeze(1)).sum(1))
    if save and not cfg.full_size:
        stats[0].copy_(r)
    if keep and not cfg.full_size:
        r = r.unsqueeze(1)
    result = apply_chain(r, cfg.post, post_operands(operands, cfg)).to(dtype_named(OP, cfg.out_dtype, y0.dtype))
    out.copy_(in_format(result, output_memory_format(y0)) if cfg.full_size else result)
    return out, saved_y, index, stats


def backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], saved_y: Tensor,
    saved_index: Tensor, saved_stats: Tensor, cfg: ConvChannelReduceConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    dtype = x.dtype
    kind = cfg.reduction
    operand_mask = list(mask[3:])
    # 1. the post-chain, from the reduction's result (recomputed for softmax / log_softmax)
    v = yb = None
    if needs_y(cfg):
        yb = with_bias(saved_y, bias)
        v = apply_chain(yb, cfg.pre, operands)
    if cfg.full_size:
        r = torch.softmax(v, 1) if kind == "softmax" else torch.log_softmax(v, 1)
    else:
        r = saved_stats[0].to(dtype)
        if cfg.keepdim:
            r = r.unsqueeze(1)
    post_ops = post_operands(operands, cfg)
    out, tape = chain_with_tape(r, cfg.post, post_ops)
    grad_r, post_grads = chain_backward(tape, grad_out.to(out.dtype), post_ops, operand_mask)
    post_grads = [None if g is None else g.reshape(t.shape) for g, t in zip(post_grads, operands, strict=True)]
    if not cfg.full_size and cfg.keepdim:
        grad_r = grad_r.squeeze(1)

    # 2. the reduction (torch's derivative formulas), 3. the pre-chain
    if kind in ("min", "max"):
        grad_y, pre_grads = _winner_backward(grad_r, saved_index, saved_stats[1].to(dtype), operands, cfg,
                                             operand_mask, conv_channels(weight, cfg.conv))  # fmt: skip
    else:
        if kind in ("amin", "amax"):
            hit = v == saved_stats[0].to(dtype).unsqueeze(1)
            grad_v = (grad_r.unsqueeze(1) / hit.sum(1, keepdim=True)) * hit
        elif kind == "sum":
            grad_v = grad_r.unsqueeze(1).expand(conv_output_shape(x, weight, cfg.conv))
        elif kind == "mean":
            shape = conv_output_shape(x, weight, cfg.conv)
            grad_v = (grad_r.unsqueeze(1) / shape[1]).expand(shape)
        elif kind == "logsumexp":
            grad_v = grad_r.unsqueeze(1) * torch.exp(v - saved_stats[0].to(dtype).unsqueeze(1))
        elif kind == "softmax":
            grad_v = torch._softmax_backward_data(grad_r, r, 1, r.dtype)
        else:
            grad_v = torch._log_softmax_backward_data(grad_r, r, 1, r.dtype)
        if yb is None:  # sum / mean without a pre-chain: the pre-chain is the identity
            grad_y, pre_grads = grad_v, [None] * len(operands)
        else:
            _, pre_tape = chain_with_tape(yb, cfg.pre, operands)
            grad_y, pre_grads = chain_backward(pre_tape, grad_v.to(yb.dtype), operands, operand_mask)
    grad_x, grad_w, grad_b = run_conv_backward(grad_y.to(dtype).contiguous(), x, weight, cfg.conv, mask[0], mask[1],
                                               bool(mask[2]))  # fmt: skip
    grad_operands = [add_grads(a, b) for a, b in zip(pre_grads, post_grads, strict=True)]
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grad_operands]


def _winner_backward(grad_r: Tensor, index: Tensor, y_win: Tensor, operands: Sequence[Tensor],
                     cfg: ConvChannelReduceConfig, operand_mask: Sequence[bool],
                     channels: int) -> tuple[Tensor, list[Tensor | None]]:  # fmt: skip
    """min / max: the pre-chain differentiated at the winners only (``y_win``: y + bias there, each
    per-channel operand read at the winning channel), the result scattered to the winning channels
    (torch's ``value_selecting_reduction_backward``); per-channel operand gradients gathered back."""
    idx = index.to(torch.int64).unsqueeze(1)  # (N, 1, *spatial): a channel dim of one, the winner's
    per_channel = [t.numel() == channels and channels != 1 for t in operands]
    gathered = [t.reshape(-1)[idx] if spread else t for t, spread in zip(operands, per_channel, strict=True)]
    _, tape = chain_with_tape(y_win.unsqueeze(1), cfg.pre, gathered)
    grad_w, grads = chain_backward(tape, grad_r.unsqueeze(1).to(y_win.dtype), gathered, operand_mask)
    shape = [idx.shape[0], channels, *idx.shape[2:]]
    grad_y = torch.zeros(shape, dtype=grad_w.dtype, device=grad_w.device)
    grad_y.scatter_(1, idx, grad_w)
    out: list[Tensor | None] = []
    for g, t, spread in zip(grads, operands, per_channel, strict=True):
        if g is None or not spread:
            out.append(g)
            continue
        summed = torch.zeros(channels, dtype=torch.float64, device=g.device).index_add_(
            0, idx.flatten(), g.flatten().to(torch.float64))
        out.append(summed.to(t.dtype).reshape(t.shape))
    return grad_y, out

