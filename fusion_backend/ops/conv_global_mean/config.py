"""``ConvGlobalMeanConfig``: the static part of a ``fusion::conv_global_mean`` call (conv parameters,
per-channel affine steps, keepdim, output dtype, strict) and its JSON codec.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch

from ...ir.specs import ConvSpec
from ..chain import ChainStep, PointwiseKind
from ..config import chain_from_list, chain_to_list

#: The pointwise kinds that are affine per channel and may therefore be folded into the mean.
AFFINE_KINDS = frozenset(
    {PointwiseKind.MUL, PointwiseKind.ADD, PointwiseKind.SUB, PointwiseKind.RSUB, PointwiseKind.DIV}
)


@dataclass(frozen=True)
class ConvGlobalMeanConfig:
    """Everything static about one ``conv -> per-channel affine steps -> mean over space`` region.

    * ``conv``: the convolution's hyper-parameters (``ConvSpec``; its tuples fix the spatial rank).
    * ``affine``: steps of kind mul/add/sub/rsub/div applied, in order, to the conv output (bias
      included); operands are ``Const`` or ``TensorRef`` into the op's ``operands`` list, each a 0-d,
      numel-1 or per-channel ``(C_out, 1, .., 1)`` / ``(1, C_out, 1, .., 1)`` tensor.
    * ``keepdim``: output ``(N, C_out, 1, ..., 1)`` instead of ``(N, C_out)``.
    * ``out_dtype``: dtype name of the result (``None`` = the conv's dtype, i.e. x's).
    * ``strict``: a kernel failure raises ``KernelError`` instead of warning and using the reference.

    Nothing here depends on tensor sizes, so one config string serves every input shape.
    """

    conv: ConvSpec
    affine: tuple[ChainStep, ...] = ()
    keepdim: bool = False
    out_dtype: str | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        c = self.conv
        nd = c.spatial_dims
        if not 1 <= nd <= 3:
            raise ValueError(f"conv must have 1..3 spatial dims, got stride {c.stride}")
        for name in ("padding", "dilation", "output_padding"):
            if len(getattr(c, name)) != nd:
                raise ValueError(
                    f"conv.{name} {getattr(c, name)} must have {nd} entries like stride {c.stride}"
                )
        if c.groups < 1 or min(c.stride) < 1 or min(c.dilation) < 1 or min(c.padding) < 0:
            raise ValueError(f"invalid conv hyper-parameters: {c}")
        if not c.transposed and any(c.output_padding):
            raise ValueError(f"output_padding {c.output_padding} is only valid for a transposed conv")
        for step in self.affine:
            if step.kind not in AFFINE_KINDS:
                raise ValueError(
                    f"affine step {step.kind.name.lower()} is not per-channel affine; allowed: "
                    f"{sorted(k.name.lower() for k in AFFINE_KINDS)}"
                )
        if self.out_dtype is not None and not isinstance(getattr(torch, self.out_dtype, None), torch.dtype):
            raise ValueError(f"out_dtype {self.out_dtype!r} is not a torch dtype name")

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal configs give equal strings."""
        d: dict[str, Any] = {
            "conv": self.conv.to_dict(),
            "affine": chain_to_list(self.affine),
            "keepdim": self.keepdim,
            "out_dtype": self.out_dtype,
            "strict": self.strict,
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> ConvGlobalMeanConfig:
        """Parse ``to_json``'s output (cached: the op implementations parse on every call)."""
        return _parse_config(text)


@functools.lru_cache(maxsize=256)
def _parse_config(text: str) -> ConvGlobalMeanConfig:
    d = json.loads(text)
    conv = ConvSpec.from_dict(d["conv"])
    affine = chain_from_list(d.get("affine", []))
    return ConvGlobalMeanConfig(
        conv=conv,
        affine=affine,
        keepdim=bool(d.get("keepdim", False)),
        out_dtype=d.get("out_dtype"),
        strict=bool(d.get("strict", False)),
    )
