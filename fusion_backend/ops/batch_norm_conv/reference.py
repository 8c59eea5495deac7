"""The plain-torch reference of ``fusion::batch_norm_conv`` (what every reference is: ``ops/declare.py``):
``aten.native_batch_norm`` in training mode, the activation, eager's conv; backward with torch's
formulas on the values recomputed from x and the saved statistics.

NOTE: the norm runs on x cast to the statistics' dtype (fp32; fp64 for fp64 x), what eager's batch
norm accumulates in for every input dtype it takes, and its result is rounded to x's dtype before the
activation, as eager's norm returns it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..batch_statistics import fill_folded_rows
from ..chain_reference import apply_chain, chain_backward, chain_with_tape, norm_affine
from ..conv_io import channel_view, run_conv, run_conv_backward
from .config import BatchNormConvConfig, outputs


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: BatchNormConvConfig,
            save: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out, saved_stats)`` (``config.outputs``).  ``native_batch_norm`` runs with running statistics
    of zeros and momentum 1, so that they come back as eager's own batch mean and unbiased variance."""
    out, stats = outputs(x, weight, bias, operands, cfg, save)
    sdt = stats.dtype
    gamma, beta = norm_affine(operands, cfg, sdt)
    batch_mean, batch_var = (torch.zeros(x.shape[1], dtype=sdt, device=x.device) for _ in range(2))
    z, mean, rstd = torch.ops.aten.native_batch_norm(x.to(sdt), gamma, beta, batch_mean, batch_var, True, 1.0, cfg.eps)
    a = apply_chain(z.to(x.dtype), cfg.act, operands)
    out.copy_(run_conv(a, weight, bias, cfg.conv))
    for row, value in zip(stats, (mean, rstd, batch_var), strict=False):
        row.copy_(value)
    fill_folded_rows(stats, gamma, beta)
    return out, stats


def normalized_input(x: Tensor, operands: Sequence[Tensor], stats: Tensor, cfg: BatchNormConvConfig) -> Tensor:
    """The norm's result ``(x - mean) * rstd * gamma + beta`` from the saved statistics, in x's dtype
    (what the activation then the conv read)."""
    sdt = stats.dtype
    gamma, beta = norm_affine(operands, cfg, sdt)
    z = (x.to(sdt) - channel_view(stats[0], x.dim())) * channel_view(stats[1], x.dim())
    z = z if gamma is None else z * channel_view(gamma, x.dim())
    z = z if beta is None else z + channel_view(beta, x.dim())
    return z.to(x.dtype)


def backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             saved_stats: Tensor, cfg: BatchNormConvConfig, mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False; the running
    statistics get none): the conv's from ``aten.convolution_backward`` on the recomputed activation,
    the activation's with the tape, the norm's from ``aten.native_batch_norm_backward``."""
    operand_mask = list(mask[3:])
    wanted = [index is not None and bool(operand_mask[index]) for index in (cfg.weight, cfg.bias)]
    need_a = bool(mask[0]) or any(wanted)
    a, tape = chain_with_tape(normalized_input(x, operands, saved_stats, cfg), cfg.act, operands)
    grad_a, grad_w, grad_b = run_conv_backward(grad_out.to(a.dtype).contiguous(), a, weight, cfg.conv, need_a,
                                               bool(mask[1]), bool(mask[2]))  # fmt: skip
    grads: list[Tensor | None] = [None] * len(operands)
    grad_x = None
    if need_a:
        grad_z, _ = chain_backward(tape, grad_a, operands, [False] * len(operands))
        sdt = saved_stats.dtype
        gamma, _ = norm_affine(operands, cfg, sdt)
        grad_x, *affine_grads = torch.ops.aten.native_batch_norm_backward(
            grad_z.to(sdt), x.to(sdt), gamma, None, None, saved_stats[0], saved_stats[1], True, cfg.eps,
            [bool(mask[0]), *wanted])  # fmt: skip
        grad_x = None if grad_x is None else grad_x.to(x.dtype)
        for index, g, want in zip((cfg.weight, cfg.bias), affine_grads, wanted, strict=True):
            if want:
                grads[index] = g.reshape(operands[index].shape).to(operands[index].dtype)
    return [grad_x if mask[0] else None, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
