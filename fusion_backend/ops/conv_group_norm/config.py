"""``ConvGroupNormConfig``, the static part of a ``fusion::conv_group_norm`` call (conv parameters, the
chain before the norm, the number of groups, eps, where the norm's weight and bias sit among the
operands, the chain after the norm, dtypes, strict, the pool that may end the region).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ...ir.specs import ConvSpec, PoolSpec
from ..chain import ChainStep
from ..chain_lowering import check_affine_operands, check_operand_refs
from ..config import JsonConfig, check_norm_config, describe_affine, describe_chain, describe_pool
from ..conv_io import (
    allocate_result,
    check_conv_inputs,
    conv_channels,
    dtype_named,
    empty_placeholder,
    in_format,
    output_memory_format,
    run_conv,
    stats_dtype,
)

OP = "conv_group_norm"


@dataclass(frozen=True)
class ConvGroupNormConfig(JsonConfig):
    """Everything static about one ``conv -> pre-chain -> group norm -> post-chain`` region.

    * ``groups``: the norm's number of groups; an instance norm is ``groups == C`` (one channel per
      group).  The conv's output channels must be divisible by it (checked at run time).
    * ``eps``: added to the biased variance of each group before the reciprocal square root.
    * ``weight`` / ``bias``: C values each (one per channel).
    * ``pre``, ``post``, ``norm_dtype``, ``out_dtype``, ``strict``, ``pool``: as every norm family's
      (``ops/config.py``).

    Nothing here depends on tensor sizes but ``groups``, which the conv's weight fixes.
    """

    conv: ConvSpec
    groups: int
    eps: float = 1e-5
    weight: int | None = None
    bias: int | None = None
    pre: tuple[ChainStep, ...] = ()
    post: tuple[ChainStep, ...] = ()
    norm_dtype: str | None = None
    out_dtype: str | None = None
    strict: bool = False
    pool: PoolSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"groups must be a positive int, got {self.groups!r}")
        check_norm_config(self, pre=self.pre, post=self.post)


def conv_outputs(x: Tensor, weight: Tensor, cfg: ConvGroupNormConfig, save: bool,
                 y0: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y0, out, saved_y, saved_winner, saved_stats)``:
    ``y0`` the conv output without bias (``conv_io.run_conv``'s, or the one given: the Triton path's
    conv alone, ``library_conv.conv_alone``, in the same layout), then the shape function's outputs
    (``ops/declare.py``; ``saved_y`` as ``conv_io`` says, absent entries ``empty_placeholder(x)``).

    * ``out`` and ``saved_winner``: ``conv_io.allocate_result``'s (the pooled shape with a pool, dtype
      ``out_dtype``; the winners only with ``save`` and a max pool).
    * ``saved_stats`` (with ``save``): ``stats_dtype`` ``(2, N, groups)`` contiguous: row 0 each
      group's mean, row 1 its ``1 / sqrt(var + eps)`` (of the pre-chain's result, bias included).
    """
    if y0 is None:
        y0 = run_conv(x, weight, None, cfg.conv)
    out, winner = allocate_result(x, y0, cfg.pool, dtype_named(OP, cfg.out_dtype, y0.dtype), save)
    if not save:
        return y0, out, empty_placeholder(x), winner, empty_placeholder(x)
    stats = torch.empty([2, y0.shape[0], cfg.groups], dtype=stats_dtype(y0.dtype), device=x.device)
    return y0, out, in_format(y0, output_memory_format(y0)), winner, stats


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvGroupNormConfig) -> None:
    check_conv_inputs(OP, x, weight, cfg.conv)
    channels = conv_channels(weight, cfg.conv)
    if channels % cfg.groups != 0:
        raise UnsupportedInputError(f"fusion::{OP}: {channels} conv output channels do not split into {cfg.groups} groups")
    check_affine_operands(OP, operands, cfg.weight, cfg.bias, channels, "one per channel")
    check_operand_refs(OP, {"pre-chain": cfg.pre, "post-chain": cfg.post}, operands)


def describe(cfg: ConvGroupNormConfig) -> str:
    """``pre [relu] -> group_norm(8 groups, eps=1e-05, weight, bias) -> post [silu]`` for messages."""
    return (f"pre [{describe_chain(cfg.pre)}] -> group_norm({cfg.groups} groups, eps={cfg.eps:g}{describe_affine(cfg)}) "
            f"-> post [{describe_chain(cfg.post)}]{describe_pool(cfg.pool)}")
