"""Fused op ``batch_norm_conv``: a batch norm with batch statistics (training mode), an activation, and
the conv that reads them, applied by the conv as it loads its input.

``batch_norm_conv(x, weight, bias, operands, config)`` has eager semantics::

    z = batch_norm(x, running_mean, running_var, gamma, beta, training=True, momentum, eps)
    out = conv(act(z), weight, bias)          # aten.convolution, 1-3d, direct (not transposed)

with the running statistics (when the norm tracks them: the last two operands) updated in place as
eager updates them.  ``x`` is the norm's input (the previous layer's output: ResNet's and
EfficientNet's ``conv -> bn -> relu -> conv``), in the conv's dtype; ``weight`` in x's dtype.

Why: a conv network's step spends more time in its normalisation and activation passes than in its
convs (``docs/perf/RESULTS.md``).  Here the conv family's forward normalises and activates x as it
loads it, so the activation is never written nor read again, and its backward recomputes it from x
(which the graph keeps anyway) instead of saving it; the input gradient's kernel produces the norm's
backward sums as it stores (``triton_path``, which also says when cuDNN's passes run instead).

Saved state ``(saved_stats,)``: fp32 ``(7, C_in)`` (``config.outputs``: mean, rstd, unbiased variance,
the folded scale and shift, gamma and beta), nothing full-size.  Everything else as every family's
(``ops/declare.py``); the reference runs ``aten.native_batch_norm`` and eager's conv.  The running
statistics' update is ``fusion::batch_norm_running_update`` (``ops/batch_statistics.py`` says why it is
an op of its own).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..batch_statistics import batch_norm_running_update, running_update
from ..declare import FusedOpDeclaration, declare, family_names
from ..direct_impls import profiled, records_backward, register_direct
from . import config, reference, triton_path
from .config import OP, BatchNormConvConfig, split_operands

BATCH_NORM_CONV = declare(FusedOpDeclaration(
    name=OP, config=BatchNormConvConfig, state=("saved_stats",), outputs=config.outputs,
    reference_forward=reference.forward, triton_forward=triton_path.forward, reference_backward=reference.backward,
    triton_backward=triton_path.backward, check_inputs=config.check_inputs, describe=config.describe))
batch_norm_conv_fwd, batch_norm_conv_bwd, kernel_path = BATCH_NORM_CONV.fwd, BATCH_NORM_CONV.bwd, BATCH_NORM_CONV.kernel_path


def batch_norm_conv(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                    config: str) -> Tensor:  # fmt: skip
    """``conv(act(batch_norm(x, training=True) * gamma + beta), weight, bias)`` as one fused op, updating
    the running statistics as eager's batch norm does.

    Arguments and result as every entry point's (``ops/declare.py``), and:

    * ``x``: the norm's input ``(N, C_in, *spatial)``, 1-3 spatial dims, the conv's dtype.
    * ``operands``: the norm's weight (gamma) and bias (beta) at ``config.weight`` / ``config.bias``
      (C_in values each), then, with ``config.running_stats``, ``running_mean`` and ``running_var``
      (C_in values each, updated in place with ``config.momentum``; the forward and backward ops
      take the operands before them: ``config.split_operands``).
    * result: the conv output, x's dtype, in eager's conv's memory format.
    """
    cfg = BatchNormConvConfig.from_json(config)
    affine, running_mean, running_var = split_operands(operands, cfg)
    save = records_backward(x, weight, bias, affine)
    out, stats = torch.ops.fusion.batch_norm_conv_fwd(x, weight, bias, affine, config, save)
    if running_mean is not None and x.numel() > 0:  # an empty batch leaves them as they are, as in eager
        torch.ops.fusion.batch_norm_running_update(running_mean, running_var, stats, cfg.momentum)
    return out


_DirectBatchNormConv = BATCH_NORM_CONV.direct_function(outputs=2)


@profiled("fusion::batch_norm_conv_fwd")
def _batch_norm_conv_direct(x, weight, bias, operands, config):
    """``batch_norm_conv`` without the custom-op layers (the direct implementation; same contract)."""
    cfg = BatchNormConvConfig.from_json(config)
    affine, running_mean, running_var = split_operands(operands, cfg)
    if records_backward(x, weight, bias, affine):
        out, stats = _DirectBatchNormConv.apply(config, x, weight, bias, *affine)
    else:
        out, stats = BATCH_NORM_CONV.forward_impl(x, weight, bias, affine, config, False)
    if running_mean is not None and x.numel() > 0:
        with torch.no_grad():
            running_update(running_mean, running_var, stats, cfg.momentum)
    return out


register_direct(batch_norm_conv, _batch_norm_conv_direct)

__all__ = ["BATCH_NORM_CONV", "BatchNormConvConfig", "batch_norm_running_update", *family_names(OP)]
