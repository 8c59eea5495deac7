"""``ConvChannelReduceConfig``: the static part of a ``fusion::conv_channel_reduce`` call (conv
parameters, the chains before and after the reduction, the reduction, keepdim, output dtype, strict)
and its JSON codec.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from ...ir.specs import ConvSpec
from ..chain import ChainStep
from ..config import chain_from_list, chain_to_list, check_dtype_names, check_kernel_chains

#: The reductions over the channels, by the name the config carries.  ``min`` / ``max`` are
#: ``torch.min(y, 1)[0]`` (the values of the (values, indices) pair); softmax and log_softmax keep
#: every element.
REDUCTIONS = ("min", "max", "amin", "amax", "sum", "mean", "logsumexp", "softmax", "log_softmax")
#: The reductions whose result has y's shape.
FULL_SIZE = frozenset({"softmax", "log_softmax"})


@dataclass(frozen=True)
class ConvChannelReduceConfig:
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

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal configs give equal strings."""
        d: dict[str, Any] = {
            "conv": self.conv.to_dict(),
            "reduction": self.reduction,
            "keepdim": self.keepdim,
            "pre": chain_to_list(self.pre),
            "post": chain_to_list(self.post),
            "out_dtype": self.out_dtype,
            "strict": self.strict,
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> ConvChannelReduceConfig:
        """Parse ``to_json``'s output (cached: the op implementations parse on every call)."""
        return _parse_config(text)


@functools.lru_cache(maxsize=256)
def _parse_config(text: str) -> ConvChannelReduceConfig:
    d = json.loads(text)
    return ConvChannelReduceConfig(
        conv=ConvSpec.from_dict(d["conv"]),
        reduction=d["reduction"],
        keepdim=bool(d.get("keepdim", False)),
        pre=chain_from_list(d.get("pre", [])),
        post=chain_from_list(d.get("post", [])),
        out_dtype=d.get("out_dtype"),
        strict=bool(d.get("strict", False)),
    )
