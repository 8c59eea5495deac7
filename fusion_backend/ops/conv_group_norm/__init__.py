"""Fused op ``conv_group_norm``: a convolution, a pointwise chain, a group norm (an instance norm is
one channel per group), a pointwise chain after it, optionally a max or avg pool.

``conv_group_norm(x, weight, bias, operands, config)`` has eager semantics::

    y = conv(x, weight, bias)                 # aten.convolution, 1-3d, transposed or not
    v = pre(y)                                # ChainSteps (ops/chain.py), DAG chains included
    z = group_norm(v, groups, gamma, beta, eps)   # batch statistics per (sample, group)
    out = pool(post(z)).to(out_dtype)         # pool: config.pool, if any (1-3d max / avg)

Saved state ``(saved_y, saved_winner, saved_stats)`` (``config.conv_outputs``): the conv output without
bias, behind a max pool each window's winner (int8), and each (sample, group)'s mean and
``1 / sqrt(var + eps)`` (fp32 ``(2, N, G)``), nothing else full-size.  Everything else as every
family's (``ops/declare.py``); the reference runs ``aten.native_group_norm`` and its backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..chain_lowering import pool_unroll_problem
from ..declare import declare, family_declaration, family_names
from . import config, reference, triton_path
from .config import OP, ConvGroupNormConfig

CONV_GROUP_NORM = declare(family_declaration(
    OP, ConvGroupNormConfig, ("saved_y", "saved_winner", "saved_stats"), config, reference, triton_path,
    kernel_problem=lambda cfg: pool_unroll_problem(cfg.pool), settled_forward=triton_path.settled,
    settled_backward=triton_path.settled_backward))
conv_group_norm_fwd, conv_group_norm_bwd, kernel_path = CONV_GROUP_NORM.fwd, CONV_GROUP_NORM.bwd, CONV_GROUP_NORM.kernel_path


@CONV_GROUP_NORM.entry
def conv_group_norm(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                    config: str) -> Tensor:  # fmt: skip
    """``pool(post(group_norm(pre(conv(x, weight, bias))) * gamma + beta)).to(out_dtype)`` as one fused op
    (the pool only with ``config.pool``).

    Arguments and result as every entry point's (``ops/declare.py``), and:

    * ``operands``: the norm's weight (gamma) and bias (beta) at ``config.weight`` / ``config.bias``
      (C values each), and the chains' tensors.
    * result: the conv output's shape (with ``config.pool``, the pooled shape), in its memory format.
    """
    return CONV_GROUP_NORM(x, weight, bias, operands, config)


__all__ = ["CONV_GROUP_NORM", "ConvGroupNormConfig", *family_names(OP)]
