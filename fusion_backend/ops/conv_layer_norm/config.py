"""``ConvLayerNormConfig``: the static part of a ``fusion::conv_layer_norm`` call (conv parameters,
the chain before the norm, the normalized shape, eps, where the norm's weight and bias sit among the
operands, the chain after the norm, dtypes, strict) and its JSON codec.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

from ...ir.specs import ConvSpec
from ..chain import ChainStep
from ..config import chain_from_list, chain_to_list, check_dtype_names, check_kernel_chains, check_norm_affine


@dataclass(frozen=True)
class ConvLayerNormConfig:
    """Everything static about one ``conv -> pre-chain -> layer norm -> post-chain`` region.

    * ``normalized_shape``: the trailing dims of the conv output the norm normalizes over, 1 to
      ``spatial_dims + 1`` of them (the channels and every spatial dim at most; never the batch).  The
      conv output's trailing sizes must equal it (checked at run time).
    * ``eps``: added to the biased variance of each row before the reciprocal square root.
    * ``weight`` / ``bias``: indices into the op's ``operands`` of the norm's elementwise scale and
      shift (``prod(normalized_shape)`` values each, any float dtype, in the normalized shape's
      row-major order), or ``None`` (``elementwise_affine=False``, or ``bias=False``).
    * ``pre`` / ``post``: steps applied before / after the norm (``ops/chain.py``); ``TensorRef``
      operands index the same ``operands`` list (numbers, one-element or per-channel tensors);
      ``ChainValue(i)`` is the chain's own value before its step ``i``.
    * ``norm_dtype``: dtype name the norm's result has in eager (autocast runs layer_norm in fp32 on a
      bf16 conv output), ``None`` = the conv's.  The post-chain runs in it.
    * ``out_dtype``: dtype name of the region's result, ``None`` = the conv's.
    * ``strict``: a kernel failure raises ``KernelError`` instead of falling back to the reference.
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
        check_norm_affine(self)
        check_kernel_chains(pre=self.pre, post=self.post)
        check_dtype_names(self, "norm_dtype", "out_dtype")

    @property
    def normalized_dims(self) -> int:
        """How many trailing dims of the conv output a row covers."""
        return len(self.normalized_shape)

    @property
    def elements(self) -> int:
        """Values per row: ``prod(normalized_shape)``, the size of the norm's weight and bias."""
        return math.prod(self.normalized_shape)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal configs give equal strings."""
        d: dict[str, Any] = {
            "conv": self.conv.to_dict(),
            "normalized_shape": list(self.normalized_shape),
            "eps": self.eps,
            "weight": self.weight,
            "bias": self.bias,
            "pre": chain_to_list(self.pre),
            "post": chain_to_list(self.post),
            "norm_dtype": self.norm_dtype,
            "out_dtype": self.out_dtype,
            "strict": self.strict,
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> ConvLayerNormConfig:
        """Parse ``to_json``'s output (cached: the op implementations parse on every call)."""
        return _parse_config(text)


@functools.lru_cache(maxsize=256)
def _parse_config(text: str) -> ConvLayerNormConfig:
    d = json.loads(text)
    return ConvLayerNormConfig(
        conv=ConvSpec.from_dict(d["conv"]),
        normalized_shape=tuple(int(s) for s in d["normalized_shape"]),
        eps=float(d.get("eps", 1e-5)),
        weight=d.get("weight"),
        bias=d.get("bias"),
        pre=chain_from_list(d.get("pre", [])),
        post=chain_from_list(d.get("post", [])),
        norm_dtype=d.get("norm_dtype"),
        out_dtype=d.get("out_dtype"),
        strict=bool(d.get("strict", False)),
    )
