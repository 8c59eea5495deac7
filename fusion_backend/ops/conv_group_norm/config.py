"""``ConvGroupNormConfig``: the static part of a ``fusion::conv_group_norm`` call (conv parameters,
the chain before the norm, the number of groups, eps, where the norm's weight and bias sit among the
operands, the chain after the norm, dtypes, strict, the pool that may end the region) and its JSON codec.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from ...ir.specs import ConvSpec, PoolSpec
from ..chain import ChainStep
from ..config import chain_from_list, chain_to_list, check_dtype_names, check_kernel_chains, check_norm_affine


@dataclass(frozen=True)
class ConvGroupNormConfig:
    """Everything static about one ``conv -> pre-chain -> group norm -> post-chain`` region.

    * ``groups``: the norm's number of groups; an instance norm is ``groups == C`` (one channel per
      group).  The conv's output channels must be divisible by it (checked at run time).
    * ``eps``: added to the biased variance of each group before the reciprocal square root.
    * ``weight`` / ``bias``: indices into the op's ``operands`` of the norm's per-channel scale and
      shift (C values each, any float dtype), or ``None`` (``affine=False``).
    * ``pre`` / ``post``: steps applied before / after the norm (``ops/chain.py``); ``TensorRef``
      operands index the same ``operands`` list (numbers, one-element or per-channel tensors);
      ``ChainValue(i)`` is the chain's own value before its step ``i``.
    * ``norm_dtype``: dtype name the norm's result has in eager (autocast runs group_norm in fp32 on a
      bf16 conv output), ``None`` = the conv's.  The post-chain runs in it.
    * ``out_dtype``: dtype name of the region's result, ``None`` = the conv's.
    * ``strict``: a kernel failure raises ``KernelError`` instead of falling back to the reference.
    * ``pool``: a max or avg pool of the conv's spatial dims over the post-chain's result (the
      region's result is then the pooled value), or ``None``.

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
        check_norm_affine(self)
        check_kernel_chains(pre=self.pre, post=self.post)
        check_dtype_names(self, "norm_dtype", "out_dtype")
        if self.pool is not None and len(self.pool.kernel_size) != self.conv.spatial_dims:
            raise ValueError(f"the pool {self.pool} does not have the conv's {self.conv.spatial_dims} spatial dims")

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal configs give equal strings."""
        d: dict[str, Any] = {
            "conv": self.conv.to_dict(),
            "groups": self.groups,
            "eps": self.eps,
            "weight": self.weight,
            "bias": self.bias,
            "pre": chain_to_list(self.pre),
            "post": chain_to_list(self.post),
            "norm_dtype": self.norm_dtype,
            "out_dtype": self.out_dtype,
            "strict": self.strict,
            "pool": None if self.pool is None else self.pool.to_dict(),
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> ConvGroupNormConfig:
        """Parse ``to_json``'s output (cached: the op implementations parse on every call)."""
        return _parse_config(text)


@functools.lru_cache(maxsize=256)
def _parse_config(text: str) -> ConvGroupNormConfig:
    d = json.loads(text)
    return ConvGroupNormConfig(
        conv=ConvSpec.from_dict(d["conv"]),
        groups=int(d["groups"]),
        eps=float(d.get("eps", 1e-5)),
        weight=d.get("weight"),
        bias=d.get("bias"),
        pre=chain_from_list(d.get("pre", [])),
        post=chain_from_list(d.get("post", [])),
        norm_dtype=d.get("norm_dtype"),
        out_dtype=d.get("out_dtype"),
        strict=bool(d.get("strict", False)),
        pool=None if d.get("pool") is None else PoolSpec.from_dict(d["pool"]),
    )
