"""``ConvBatchNormConfig``: the static part of a ``fusion::conv_batch_norm`` call (conv parameters, eps,
the running statistics' momentum, where the norm's weight and bias sit among the operands, the chain
after the norm, dtypes, strict, the pool that may end the region).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...ir.specs import PoolSpec
from ..batch_statistics import STATS_ROWS, values_per_channel
from ..chain import ChainStep
from ..chain_lowering import check_affine_operands, check_operand_refs
from ..config import (
    TrainingBatchNormConfig,
    check_momentum,
    check_norm_config,
    describe_affine,
    describe_chain,
    describe_pool,
)
from ..conv_io import (
    allocate_result,
    check_conv_inputs,
    conv_channels,
    conv_output_shape,
    dtype_named,
    empty_placeholder,
    in_format,
    output_memory_format,
    stats_dtype,
)
from ..library_conv import conv_forward, nominal_format

OP = "conv_batch_norm"


@dataclass(frozen=True)
class ConvBatchNormConfig(TrainingBatchNormConfig):
    """Everything static about one ``conv -> batch norm (batch statistics) -> post-chain`` region: the
    training BatchNorm's fields (``ops/config.py``'s ``TrainingBatchNormConfig``: the conv, eps, momentum,
    the affine operands, the running statistics, split off by ``op.split_operands``), then ``post``,
    ``norm_dtype``, ``out_dtype``, ``strict``, ``pool``: as every norm family's (``ops/config.py``); no
    pre-chain.
    """

    post: tuple[ChainStep, ...] = ()
    norm_dtype: str | None = None
    out_dtype: str | None = None
    strict: bool = False
    pool: PoolSpec | None = None

    def __post_init__(self) -> None:
        # the norm's fields with every norm family's checks (``check_norm_config``), not super()'s twice
        check_momentum(self.momentum)
        check_norm_config(self, post=self.post)

    @property
    def pre(self) -> tuple[ChainStep, ...]:
        """The chain before the norm: none (the norm reads the conv output plus bias), so that the
        lowering reads a ``pre`` and a ``post`` chain of every norm family alike."""
        return ()


def conv_outputs(x: Tensor, weight: Tensor, cfg: ConvBatchNormConfig, save: bool,
                 computed: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y0, out, saved_y, saved_winner, stats)``:
    ``y0`` the conv output without bias (``library_conv.conv_forward``'s), then the shape function's outputs
    (``ops/declare.py``; ``saved_y`` as ``conv_io`` says, absent entries ``empty_placeholder(x)``).
    ``computed``: ``(y0, stats)`` the caller computed (``statistics.conv_and_statistics``), laid out as
    these would be, returned in their places.

    * ``out`` and ``saved_winner``: ``conv_io.allocate_result``'s, ``out`` in
      ``library_conv.nominal_format`` (eager's layout), dtype ``out_dtype``.
    * ``stats``: ``stats_dtype`` ``(STATS_ROWS, C)`` contiguous, of the conv output plus bias per channel,
      the rows ``batch_statistics.STATS_ROWS`` names: the batch mean, ``1 / sqrt(var + eps)`` (``var``
      biased), the unbiased variance (what the running variance is updated with), the folded scale and
      shift, gamma and beta (the affine rows the kernels read, forward and backward).
    """
    if computed is None:
        y0 = conv_forward(x, weight, cfg.conv, channels_last=True)
        stats = torch.empty([STATS_ROWS, y0.shape[1]], dtype=stats_dtype(y0.dtype), device=x.device)
    else:
        y0, stats = computed
    out_format = nominal_format(x, weight, cfg.conv)
    out, winner = allocate_result(x, y0, cfg.pool, dtype_named(OP, cfg.out_dtype, y0.dtype), save, out_format)
    return y0, out, (in_format(y0, output_memory_format(y0)) if save else empty_placeholder(x)), winner, stats


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvBatchNormConfig) -> None:
    check_conv_inputs(OP, x, weight, cfg.conv)
    check_affine_operands(OP, operands, cfg.weight, cfg.bias, conv_channels(weight, cfg.conv), "one per channel")
    check_operand_refs(OP, {"post-chain": cfg.post}, operands)
    values_per_channel(conv_output_shape(x, weight, cfg.conv))


def describe(cfg: ConvBatchNormConfig) -> str:
    """``batch_norm(eps=1e-05, momentum=0.1, weight, bias) -> post [relu]`` for messages."""
    return (f"batch_norm(eps={cfg.eps:g}, momentum={cfg.momentum:g}{describe_affine(cfg)}) -> post "
            f"[{describe_chain(cfg.post)}]{describe_pool(cfg.pool)}")
