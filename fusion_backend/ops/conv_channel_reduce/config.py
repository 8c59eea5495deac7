"""``ConvChannelReduceConfig``: the static part of a ``fusion::conv_channel_reduce`` call (conv
parameters, the chains before and after the reduction, the reduction, keepdim, output dtype, strict).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...ir.specs import ConvSpec
from ..chain import ChainStep
from ..chain_lowering import check_operand_refs
from ..config import JsonConfig, check_dtype_names, check_kernel_chains, describe_chain
from ..conv_io import (
    check_conv_inputs,
    dtype_named,
    empty_placeholder,
    in_format,
    output_memory_format,
    stats_dtype,
)
from ..library_conv import conv_forward, nominal_format

OP = "conv_channel_reduce"

#: The reductions over the channels, by the name the config carries.  ``min`` / ``max`` are
#: ``torch.min(y, 1)[0]`` (the values of the (values, indices) pair); softmax and log_softmax keep
#: every element.
REDUCTIONS = ("min", "max", "amin", "amax", "sum", "mean", "logsumexp", "softmax", "log_softmax")
#: The reductions whose result has y's shape.
FULL_SIZE = frozenset({"softmax", "log_softmax"})


@dataclass(frozen=True)
class ConvChannelReduceConfig(JsonConfig):
    """Everything static about one ``conv -> pre-chain -> reduction over dim 1 -> post-chain`` region.

    * ``pre``: steps applied to the conv output (bias included) before the reduction; operands are
      ``Const``, ``TensorRef`` (numel-1 or per-channel ``(C,1,..,1)`` / ``(1,C,1,..,1)`` tensors) or
      ``ChainValue`` (an earlier value of this chain).
    * ``reduction``: one of ``REDUCTIONS``, over dim 1; ``keepdim`` as the user wrote it (always True
      for softmax / log_softmax, whose result has the conv output's shape).
    * ``post``: steps applied to the reduction's result; ``TensorRef`` operands index the same
      ``operands`` list as ``pre``'s and must hold one value, or for softmax / log_softmax one value
      or one per channel; ``ChainValue(i)`` is this chain's own value before its step ``i``.
    * ``out_dtype``: dtype name of the region's result (``None`` = the conv's dtype).
    * ``strict``: a kernel failure raises ``KernelError`` instead of falling back to the reference.

    Nothing here depends on tensor sizes: one config string serves every input shape.
    """

    conv: ConvSpec
    reduction: str
    keepdim: bool = False
    pre: tuple[ChainStep, ...] = ()
    post: tuple[ChainStep, ...] = ()
    out_dtype: str | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction {self.reduction!r} is not one of {', '.join(REDUCTIONS)}")
        if self.reduction in FULL_SIZE and not self.keepdim:
            raise ValueError(f"{self.reduction} keeps every dim: keepdim must be True")
        check_kernel_chains(pre=self.pre, post=self.post)
        check_dtype_names(self, "out_dtype")

    @property
    def full_size(self) -> bool:
        """Whether the result has the conv output's shape (softmax / log_softmax)."""
        return self.reduction in FULL_SIZE


#: Most channels the Triton kernels reduce over (``kernels.channel_reduce.MAX_CHANNELS``; the pattern
#: leaves wider convs as a near miss, and a direct call with more runs the reference).
MAX_CHANNELS = 1024


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvChannelReduceConfig) -> None:
    check_conv_inputs(OP, x, weight, cfg.conv)
    check_operand_refs(OP, {"pre-chain": cfg.pre, "post-chain": cfg.post}, operands)


def describe(cfg: ConvChannelReduceConfig) -> str:
    """``pre [relu] -> amax(dim=1, keepdim) -> post [tanh]`` for messages."""
    keep = ", keepdim" if cfg.keepdim and not cfg.full_size else ""
    return f"pre [{describe_chain(cfg.pre)}] -> {cfg.reduction}(dim=1{keep}) -> post [{describe_chain(cfg.post)}]"


def needs_y(cfg: ConvChannelReduceConfig) -> bool:
    """Whether the backward reads the conv output: every reduction but min / max (those keep the
    winner's value), and sum / mean only through a pre-chain."""
    if cfg.reduction in ("min", "max"):
        return False
    return cfg.reduction not in ("sum", "mean") or len(cfg.pre) > 0


def index_dtype(channels: int) -> torch.dtype:
    """The winner index's dtype: int16 while the channels fit, else int32."""
    return torch.int16 if channels <= torch.iinfo(torch.int16).max else torch.int32


def reduced_shape(y_shape: Sequence[int], cfg: ConvChannelReduceConfig) -> list[int]:
    """The result's shape for a conv output of ``y_shape``."""
    if cfg.full_size:
        return list(y_shape)
    return [y_shape[0], *([1] if cfg.keepdim else []), *y_shape[2:]]


def conv_outputs(x: Tensor, weight: Tensor, cfg: ConvChannelReduceConfig, save: bool,
                 y0: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y0, out, saved_y, saved_index, saved_stats)``:
    ``y0`` the conv output without bias (``library_conv.conv_forward``'s, or the one given: the Triton path's
    conv alone in a call that saves nothing), then the shape function's outputs
    (``ops/declare.py``; ``saved_y`` as ``conv_io`` says, absent entries ``empty_placeholder(x)``).

    * ``out``: softmax / log_softmax: y's shape in ``library_conv.nominal_format`` (eager's layout);
      else ``(N, [1,] *spatial)`` contiguous; dtype ``out_dtype`` (the conv's by default).
    * ``saved_y`` (``conv_io``'s docstring) only where ``needs_y``.
    * ``saved_index`` (with ``save``, min / max): the winning channel, ``(N, *spatial)`` contiguous,
      ``index_dtype(C)``.
    * ``saved_stats`` (with ``save``): ``stats_dtype`` ``(2, N, *spatial)`` contiguous
      (``kernels/channel_reduce.py``'s table).
    """
    if y0 is None:
        y0 = conv_forward(x, weight, cfg.conv, channels_last=True)
    shape = reduced_shape(y0.shape, cfg)
    dtype = dtype_named(OP, cfg.out_dtype, y0.dtype)
    if cfg.full_size:
        out = torch.empty(shape, dtype=dtype, device=x.device, memory_format=nominal_format(x, weight, cfg.conv))
    else:
        out = torch.empty(shape, dtype=dtype, device=x.device)
    placeholder = empty_placeholder(x)
    if not save:
        return y0, out, placeholder, empty_placeholder(x), empty_placeholder(x)
    n, channels, spatial = y0.shape[0], y0.shape[1], list(y0.shape[2:])
    saved_y = in_format(y0, output_memory_format(y0)) if needs_y(cfg) else placeholder
    index = (torch.empty([n, *spatial], dtype=index_dtype(channels), device=x.device)
             if cfg.reduction in ("min", "max") else empty_placeholder(x))  # fmt: skip
    stats = torch.empty([2, n, *spatial], dtype=stats_dtype(y0.dtype), device=x.device)
    return y0, out, saved_y, index, stats
