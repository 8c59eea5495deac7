"""``BatchNormConvConfig``: the static part of a ``fusion::batch_norm_conv`` call (the conv's parameters,
the norm's eps and momentum, where its weight and bias sit among the operands, whether the running
statistics are passed, the activation between the norm and the conv), and what the declaration takes
from it besides the two paths: the shape function, the input checks, the description.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ..batch_statistics import STATS_ROWS, values_per_channel
from ..chain import ChainStep
from ..chain_lowering import check_affine_operands, family_activation
from ..config import TrainingBatchNormConfig, describe_affine
from ..conv_io import check_conv_inputs, conv_output_shape, stats_dtype
from ..library_conv import nominal_format

OP = "batch_norm_conv"


@dataclass(frozen=True)
class BatchNormConvConfig(TrainingBatchNormConfig):
    """Everything static about one ``batch norm (batch statistics) -> activation -> conv`` region: the
    training BatchNorm's fields (``ops/config.py``'s ``TrainingBatchNormConfig``; ``conv`` a direct conv,
    not transposed; ``weight`` and ``bias`` C_in values each; the running statistics split off by
    ``split_operands``), then

    * ``act``: the activation between the norm and the conv: none, or one ``relu``, ``leaky_relu`` of
      a constant slope, ``gelu`` or ``silu`` step (what the conv family's prologue applies).
    * ``strict``: a kernel failure raises instead of falling back to the reference.
    """

    act: tuple[ChainStep, ...] = ()
    strict: bool = False

    def __post_init__(self) -> None:
        if self.conv.transposed:
            raise ValueError("the conv of a batch_norm_conv region is a direct conv, not a transposed one")
        super().__post_init__()
        if len(self.act) > 1 or any(family_activation(s) is None for s in self.act):
            raise ValueError("act holds at most one of gelu, leaky_relu (a constant slope), relu, silu "
                             "(what the conv family's prologue applies)")  # fmt: skip

    # the norm families' shared lowering (``chain_lowering.norm_chains``) reads a pre- and a post-chain
    @property
    def pre(self) -> tuple[ChainStep, ...]:
        return ()

    @property
    def post(self) -> tuple[ChainStep, ...]:
        return self.act


def split_operands(operands: Sequence[Tensor], cfg: BatchNormConvConfig) -> tuple[list[Tensor], Tensor | None, Tensor | None]:
    """``(the norm's affine operands, running_mean, running_var)`` from the operand list a rewritten graph
    passes: with ``cfg.running_stats`` the running statistics are its last two entries (one list keeps
    the graph call's shape ``(x, weight, bias, operands, config)`` every family shares).  The forward
    and backward ops take the affine operands alone: autograd must not save tensors the running
    update then changes in place."""
    if not cfg.running_stats:
        return list(operands), None, None
    if len(operands) < 2:
        raise UnsupportedInputError(f"fusion::{OP}: the config says the running statistics are the last two "
                                    f"operands, but {len(operands)} were given")  # fmt: skip
    return list(operands[:-2]), operands[-2], operands[-1]


def outputs(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: BatchNormConvConfig,
            save: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Empty ``(out, saved_stats)`` as both paths write them:

    * ``out``: the conv output, x's dtype, in the memory format eager's conv gives for x and the
      weight (``library_conv.nominal_format``).
    * ``saved_stats``: ``stats_dtype`` ``(7, C_in)`` contiguous, always (the running update reads it):
      row 0 the batch mean, row 1 ``rstd = 1 / sqrt(var + eps)`` (var biased), row 2 the unbiased
      variance, rows 3-4 the norm folded with its affine, ``scale = gamma * rstd`` and ``shift = beta -
      mean * scale`` (what the conv applies as it loads x, and its backward recomputes), rows 5-6
      gamma and beta (1 and 0 without them; the affine rows the norm's backward kernels read:
      ``kernels.batch_norm.batch_norm_stats`` writes all seven in its one combine launch)."""
    shape = conv_output_shape(x, weight, cfg.conv)
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=nominal_format(x, weight, cfg.conv))
    stats = torch.empty((STATS_ROWS, x.shape[1]), dtype=stats_dtype(x.dtype), device=x.device)
    return out, stats


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: BatchNormConvConfig) -> None:
    check_conv_inputs(OP, x, weight, cfg.conv)
    channels = x.shape[1]
    check_affine_operands(OP, operands, cfg.weight, cfg.bias, channels, "one per input channel")
    if weight.shape[1] * cfg.conv.groups != channels:
        raise UnsupportedInputError(f"fusion::{OP}: the conv weight {tuple(weight.shape)} with {cfg.conv.groups} "
                                    f"group(s) does not take x's {channels} channels")  # fmt: skip
    if weight.dtype != x.dtype:
        raise UnsupportedInputError(f"fusion::{OP}: the conv weight's dtype {weight.dtype} is not x's {x.dtype}")
    values_per_channel(x.shape)


def describe(cfg: BatchNormConvConfig) -> str:
    """``batch_norm(eps=1e-05, momentum=0.1, weight, bias) -> relu -> conv`` for messages."""
    act = "".join(f" -> {s.kind.name.lower()}" for s in cfg.act)
    return f"batch_norm(eps={cfg.eps:g}, momentum={cfg.momentum:g}{describe_affine(cfg)}){act} -> conv"

