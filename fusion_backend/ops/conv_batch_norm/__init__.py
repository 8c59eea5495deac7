"""Fused op ``conv_batch_norm``: a convolution, a batch norm with batch statistics (training mode), a
pointwise chain after it, optionally a max or avg pool.

``conv_batch_norm(x, weight, bias, operands, config)`` has eager semantics::

    y = conv(x, weight, bias)                 # aten.convolution, 1-3d, transposed or not
    z = batch_norm(y, running_mean, running_var, gamma, beta, training=True, momentum, eps)
    out = pool(post(z)).to(out_dtype)         # pool: config.pool, if any (1-3d max / avg)

with the running statistics (when the norm tracks them: the last two operands) updated in place as
eager updates them.

Saved state ``(saved_y, saved_winner, saved_stats)`` (``config.conv_outputs``): the conv output
without bias and, behind a max pool, each window's winner (int8), both only with
``save_for_backward``, and fp32 ``(STATS_ROWS, C)`` statistics (``ops/batch_statistics.py``: each
channel's mean, ``1 / sqrt(var + eps)``, unbiased variance, folded scale and shift, gamma and beta;
always: the running update reads them), nothing else full-size.  Everything
else as every family's (``ops/declare.py``); the reference runs ``aten.native_batch_norm`` and its
backward.

The running statistics' update is an op of its own, ``fusion::batch_norm_running_update``
(``ops/batch_statistics.py`` says why).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ..batch_statistics import batch_norm_running_update, running_update
from ..chain_lowering import pool_unroll_problem
from ..declare import declare, family_declaration, family_names
from ..direct_impls import profiled, records_backward, register_direct
from . import config, reference, triton_path
from .config import OP, ConvBatchNormConfig

CONV_BATCH_NORM = declare(family_declaration(
    OP, ConvBatchNormConfig, ("saved_y", "saved_winner", "saved_stats"), config, reference, triton_path,
    kernel_problem=lambda cfg: pool_unroll_problem(cfg.pool)))
conv_batch_norm_fwd, conv_batch_norm_bwd, kernel_path = CONV_BATCH_NORM.fwd, CONV_BATCH_NORM.bwd, CONV_BATCH_NORM.kernel_path


def split_operands(operands: Sequence[Tensor], config: str) -> tuple[list[Tensor], Tensor | None, Tensor | None]:
    """``(chain and affine operands, running_mean, running_var)`` from the operand list a rewritten
    graph passes: with ``config.running_stats`` the running statistics are its last two entries (one
    list keeps the graph call's shape ``(x, weight, bias, operands, config)`` every family shares)."""
    if not ConvBatchNormConfig.from_json(config).running_stats:
        return list(operands), None, None
    if len(operands) < 2:
        raise UnsupportedInputError(f"fusion::conv_batch_norm: the config says the running statistics are the last "
                                    f"two operands, but {len(operands)} were given")  # fmt: skip
    return list(operands[:-2]), operands[-2], operands[-1]


def conv_batch_norm(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                    config: str) -> Tensor:  # fmt: skip
    """``pool(post(batch_norm(conv(x, weight, bias), training=True) * gamma + beta)).to(out_dtype)`` as
    one fused op (the pool only with ``config.pool``), updating the running statistics as eager's
    batch norm does (an empty batch leaves them unchanged).

    Arguments and result as every entry point's (``ops/declare.py``), and:

    * ``operands``: the norm's weight (gamma) and bias (beta) at ``config.weight`` / ``config.bias`` (C
      values each), the chain's tensors, then, with ``config.running_stats``, ``running_mean`` and
      ``running_var`` (C values each, updated in place with ``config.momentum``).
    * result: the conv output's shape (with ``config.pool``, the pooled shape), in its memory format.
    """
    ops, running_mean, running_var = split_operands(operands, config)
    save = records_backward(x, weight, bias, ops)
    out, _, _, stats = torch.ops.fusion.conv_batch_norm_fwd(x, weight, bias, ops, config, save)
    if running_mean is not None and out.numel() > 0:  # an empty batch leaves them as they are, as in eager
        momentum = ConvBatchNormConfig.from_json(config).momentum
        torch.ops.fusion.batch_norm_running_update(running_mean, running_var, stats, momentum)
    return out


_DirectConvBatchNorm = CONV_BATCH_NORM.direct_function(outputs=2)


@profiled("fusion::conv_batch_norm_fwd")
def _conv_batch_norm_direct(x, weight, bias, operands, config):
    """``conv_batch_norm`` without the custom-op layers (the direct implementation; same contract)."""
    ops, running_mean, running_var = split_operands(operands, config)
    if records_backward(x, weight, bias, ops):
        out, stats = _DirectConvBatchNorm.apply(config, x, weight, bias, *ops)
    else:
        out, _, _, stats = CONV_BATCH_NORM.forward_impl(x, weight, bias, ops, config, False)
    if running_mean is not None and out.numel() > 0:
        with torch.no_grad():
            running_update(running_mean, running_var, stats, ConvBatchNormConfig.from_json(config).momentum)
    return out


register_direct(conv_batch_norm, _conv_batch_norm_direct)


__all__ = ["CONV_BATCH_NORM", "ConvBatchNormConfig", "batch_norm_running_update", "split_operands", *family_names(OP)]
