"""``ConvLayerNormConfig``: the static part of a ``fusion::conv_layer_norm`` call (conv parameters, the
chain before the norm, the normalized shape, eps, where the norm's weight and bias sit among the
operands, the chain after the norm, dtypes, strict).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ...ir.specs import ConvSpec
from ..chain import ChainStep
from ..chain_lowering import check_affine_operands, check_operand_refs
from ..config import JsonConfig, check_norm_config, describe_affine, describe_chain
from ..conv_io import (
    check_conv_inputs,
    conv_output_shape,
    dtype_named,
    empty_placeholder,
    in_format,
    output_memory_format,
    stats_dtype,
)
from ..library_conv import conv_forward

OP = "conv_layer_norm"


@dataclass(frozen=True)
class ConvLayerNormConfig(JsonConfig):
    """Everything static about one ``conv -> pre-chain -> layer norm -> post-chain`` region.

    * ``normalized_shape``: the trailing dims of the conv output the norm normalizes over, 1 to
      ``spatial_dims + 1`` of them (the channels and every spatial dim at most; never the batch).  The
      conv output's trailing sizes must equal it (checked at run time).
    * ``eps``: added to the biased variance of each row before the reciprocal square root.
    * ``weight`` / ``bias``: elementwise, ``prod(normalized_shape)`` values each in the normalized
      shape's row-major order.
    * ``pre``, ``post``, ``norm_dtype``, ``out_dtype``, ``strict``: as every norm family's
      (``ops/config.py``); no pool.
    """

    conv: ConvSpec
    normalized_shape: tuple[int, ...]
    eps: float = 1e-5
    weight: int | None = None
    bias: int | None = None
    pre: tuple[ChainStep, ...] = ()
    post: tuple[ChainStep, ...] = ()
    norm_dtype: str | None = None
    out_dtype: str | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        shape = self.normalized_shape
        if (not isinstance(shape, tuple) or not 1 <= len(shape) <= self.conv.spatial_dims + 1
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):  # fmt: skip
            raise ValueError(f"normalized_shape must be 1 to {self.conv.spatial_dims + 1} positive ints (trailing dims "
                             f"of a {self.conv.spatial_dims}d conv output, not the batch), got {shape!r}")  # fmt: skip
        check_norm_config(self, pre=self.pre, post=self.post)

    @property
    def pool(self) -> None:
        """No pool ends the region (the norm families' shared reference reads every one's ``pool``)."""
        return None

    @property
    def normalized_dims(self) -> int:
        """How many trailing dims of the conv output a row covers."""
        return len(self.normalized_shape)

    @property
    def elements(self) -> int:
        """Values per row: ``prod(normalized_shape)``, the size of the norm's weight and bias."""
        return math.prod(self.normalized_shape)


def rows(y_shape: Sequence[int], cfg: ConvLayerNormConfig) -> int:
    """How many rows (normalized slices) a conv output of ``y_shape`` holds (sizes may be symbolic)."""
    return math.prod(y_shape[: len(y_shape) - cfg.normalized_dims])


def conv_outputs(x: Tensor, weight: Tensor, cfg: ConvLayerNormConfig, save: bool,
                 y0: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y0, out, saved_y, saved_stats)``:
    ``y0`` the conv output without bias (``library_conv.conv_forward``'s, or the one given: the Triton path's
    conv alone in a call that saves nothing), then the shape function's outputs
    (``ops/declare.py``; ``saved_y`` as ``conv_io`` says, absent entries ``empty_placeholder(x)``).

    * ``out``: y0's shape, contiguous (what eager's layer norm returns whatever its input's layout),
      dtype ``out_dtype`` (default the conv's).
    * ``saved_stats`` (with ``save``): ``stats_dtype`` ``(2, M)`` contiguous, ``M`` the rows in
      ``native_layer_norm``'s order (the dims before the normalized ones, row-major): row 0 each
      row's mean, row 1 its ``1 / sqrt(var + eps)`` (of the pre-chain's result, bias included).
    """
    if y0 is None:
        y0 = conv_forward(x, weight, cfg.conv, channels_last=True)
    out = torch.empty(y0.shape, dtype=dtype_named(OP, cfg.out_dtype, y0.dtype), device=x.device)
    if not save:
        return y0, out, empty_placeholder(x), empty_placeholder(x)
    stats = torch.empty([2, rows(y0.shape, cfg)], dtype=stats_dtype(y0.dtype), device=x.device)
    return y0, out, in_format(y0, output_memory_format(y0)), stats


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvLayerNormConfig) -> None:
    check_conv_inputs(OP, x, weight, cfg.conv)
    y_shape = conv_output_shape(x, weight, cfg.conv)
    trailing = tuple(y_shape[len(y_shape) - cfg.normalized_dims:])
    if trailing != cfg.normalized_shape:
        raise UnsupportedInputError(f"fusion::{OP}: the conv output {tuple(y_shape)} does not end in the normalized "
                                    f"shape {cfg.normalized_shape}")  # fmt: skip
    check_affine_operands(OP, operands, cfg.weight, cfg.bias, cfg.elements, f"the normalized shape {cfg.normalized_shape}")
    check_operand_refs(OP, {"pre-chain": cfg.pre, "post-chain": cfg.post}, operands)


def describe(cfg: ConvLayerNormConfig) -> str:
    """``pre [relu] -> layer_norm((64,), eps=1e-05, weight, bias) -> post [gelu, mul]`` for messages."""
    return (f"pre [{describe_chain(cfg.pre)}] -> layer_norm({tuple(cfg.normalized_shape)}, eps={cfg.eps:g}"
            f"{describe_affine(cfg)}) -> post [{describe_chain(cfg.post)}]")
