"""Fused op ``conv_channel_reduce``: a convolution, a pointwise chain, ONE reduction over the
channels (dim 1), a pointwise chain after it.

``conv_channel_reduce(x, weight, bias, operands, config)`` has eager semantics::

    y = conv(x, weight, bias)                 # aten.convolution, 1-3d, transposed or not
    v = pre(y)                                # ChainSteps (ops/chain.py), DAG chains included
    r = reduce(v, dim=1[, keepdim])           # min / max (values), amin, amax, sum, mean, logsumexp,
                                              # softmax, log_softmax (full size)
    out = post(r).to(out_dtype)

Saved state ``(saved_y, saved_index, saved_stats)`` (``config.conv_outputs``): what the backward needs
and nothing it can recompute: the conv output only where the reduction or the pre-chain's derivative
reads it (never for min / max), the winning channel (int16) and the pre-chain's input there for min /
max, and fp32 per-position statistics (the reduced value; the number of ties for amin / amax; the
column max and exp-sum for softmax / log_softmax).  Everything else as every family's
(``ops/declare.py``); the Triton path takes at most 1024 channels, the reference any number.

Semantics reproduced on purpose: ``torch.min/max(dim)`` send the gradient to the one index torch
returns (the first; a NaN wins), ``amin/amax`` split it evenly among ties (NaN columns get NaN
gradients, as torch's formula), logsumexp of an all ``-inf`` column is ``-inf``, softmax of a column
with an infinite max or a NaN is NaN throughout.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..conv_io import conv_channels
from ..declare import declare, family_declaration, family_names
from . import config, reference, triton_path
from .config import FULL_SIZE, MAX_CHANNELS, OP, REDUCTIONS, ConvChannelReduceConfig


def _channel_problem(cfg: ConvChannelReduceConfig, x: Tensor, weight: Tensor) -> str | None:
    """The kernels hold every channel of a position tile in registers: at most ``MAX_CHANNELS``."""
    channels = conv_channels(weight, cfg.conv)
    return f"{channels} channels exceed the kernels' {MAX_CHANNELS}" if channels > MAX_CHANNELS else None


CONV_CHANNEL_REDUCE = declare(family_declaration(
    OP, ConvChannelReduceConfig, ("saved_y", "saved_index", "saved_stats"), config, reference, triton_path,
    call_problem=_channel_problem))
conv_channel_reduce_fwd, conv_channel_reduce_bwd = CONV_CHANNEL_REDUCE.fwd, CONV_CHANNEL_REDUCE.bwd
kernel_path = CONV_CHANNEL_REDUCE.kernel_path


@CONV_CHANNEL_REDUCE.entry
def conv_channel_reduce(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                        config: str) -> Tensor:  # fmt: skip
    """``post(reduce_over_dim_1(pre(conv(x, weight, bias)))).to(out_dtype)`` as one fused op.

    Arguments and result as every entry point's (``ops/declare.py``), and:

    * result: softmax / log_softmax: the conv output's shape, in its memory format; else
      ``(N, *spatial)`` or with keepdim ``(N, 1, *spatial)``, contiguous.
    """
    return CONV_CHANNEL_REDUCE(x, weight, bias, operands, config)


__all__ = ["CONV_CHANNEL_REDUCE", "FULL_SIZE", "REDUCTIONS", "ConvChannelReduceConfig", *family_names(OP)]
