"""``ConvBatchNormConfig``: the static part of a ``fusion::conv_batch_norm`` call (conv parameters, eps,
the running statistics' momentum, where the norm's weight and bias sit among the operands, the chain
after the norm, dtypes, strict, the pool that may end the region) and its JSON codec.
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
class ConvBatchNormConfig:
    """Everything static about one ``conv -> batch norm (batch statistics) -> post-chain`` region.

    * ``eps``: added to each channel's biased batch variance before the reciprocal square root.
    * ``momentum``: the running statistics' update factor ``m`` (``running = (1 - m) * running + m *
      batch``, the variance unbiased); used only when the call is given running statistics.
    * ``weight`` / ``bias``: indices into the op's ``operands`` of the norm's per-channel scale and
      shift (C values each, any float dtype), or ``None`` (``affine=False``).
    * ``running_stats``: whether the graph's call passes the running statistics (the last two entries
      of its operand list: ``op.split_operands``).
    * ``post``: steps applied after the norm (``ops/chain.py``); ``TensorRef`` operands index the
      same ``operands`` list (numbers, one-element or per-channel tensors); ``ChainValue(i)`` is the
      chain's own value before its step ``i``.
    * ``norm_dtype``: dtype name of the norm's result in eager, ``None`` = the conv's.  The post-chain
      runs in it.
    * ``out_dtype``: dtype name of the region's result, ``None`` = the conv's.
    * ``strict``: a kernel failure raises ``KernelError`` instead of falling back to the reference.
    * ``pool``: a max or avg pool of the conv's spatial dims over the post-chain's result (the
      region's result is then the pooled value), or ``None``.
    """

    conv: ConvSpec
    eps: float = 1e-5
    momentum: float = 0.1
    weight: int | None = None
    bias: int | None = None
    running_stats: bool = False
    post: tuple[ChainStep, ...] = ()
    norm_dtype: str | None = None
    out_dtype: str | None = None
    strict: bool = False
    pool: PoolSpec | None = None

    def __post_init__(self) -> None:
        check_norm_affine(self)
        if not isinstance(self.momentum, (int, float)) or isinstance(self.momentum, bool):
            raise ValueError(f"momentum must be a number, got {self.momentum!r}")
        check_kernel_chains(post=self.post)
        check_dtype_names(self, "norm_dtype", "out_dtype")
        if self.pool is not None and len(self.pool.kernel_size) != self.conv.spatial_dims:
            raise ValueError(f"the pool {self.pool} does not have the conv's {self.conv.spatial_dims} spatial dims")

    @property
    def pre(self) -> tuple[ChainStep, ...]:
        """The chain before the norm: none (the norm reads the conv output); the shared chain helpers
        (``conv_channel_reduce``'s operand gradients) read a ``pre`` and a ``post`` chain."""
        return ()

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal configs give equal strings."""
        d: dict[str, Any] = {
            "conv": self.conv.to_dict(),
            "eps": self.eps,
            "momentum": self.momentum,
            "weight": self.weight,
            "bias": self.bias,
            "running_stats": self.running_stats,
            "post": chain_to_list(self.post),
            "norm_dtype": self.norm_dtype,
            "out_dtype": self.out_dtype,
            "strict": self.strict,
            "pool": None if self.pool is None else self.pool.to_dict(),
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> ConvBatchNormConfig:
        """Parse ``to_json``'s output (cached: the op implementations parse on every call)."""
        return _parse_config(text)


@functools.lru_cache(maxsize=256)
def _parse_config(text: str) -> ConvBatchNormConfig:
    d = json.loads(text)
    return ConvBatchNormConfig(
        conv=ConvSpec.from_dict(d["conv"]),
        eps=float(d.get("eps", 1e-5)),
        momentum=float(d.get("momentum", 0.1)),
        weight=d.get("weight"),
        bias=d.get("bias"),
        running_stats=bool(d.get("running_stats", False)),
        post=chain_from_list(d.get("post", [])),
        norm_dtype=d.get("norm_dtype"),
        out_dtype=d.get("out_dtype"),
        strict=bool(d.get("strict", False)),
        pool=None if d.get("pool") is None else PoolSpec.from_dict(d["pool"]),
    )
