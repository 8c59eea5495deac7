"""Static configuration of the fused ops, serialised into the op call as a string.

``torch.library.custom_op`` schemas carry tensors and a few scalar types, not arbitrary objects, so the
configuration of a fused region (conv hyper-parameters, the pointwise chain, the pool) travels as one
canonical JSON string.  It must not contain anything shape-dependent: the same string serves every
input shape (dynamic shapes), and everything size-dependent is read off the tensors at run time.

``ConvEpilogueConfig.to_json()`` / ``from_json()`` round-trip exactly; ``from_json`` is cached because
the op implementations parse the string on every call.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..ir.specs import ConvSpec, PoolSpec
from .chain import (
    MAX_CHAIN_LENGTH,
    ChainStep,
    ChainValue,
    Const,
    Operand,
    PointwiseKind,
    TensorRef,
    check_chain,
)


@dataclass(frozen=True)
class ConvEpilogueConfig:
    """Everything static about one ``conv -> chain -> optional pool`` region.

    * ``chain`` runs on the conv output; when the op receives a bias, the implementation adds it
      first (the bias is not a step of ``chain``).
    * ``out_dtype``: dtype name of the region's result as eager produces it (type promotion with
      fp32 operands under autocast makes it differ from the conv's dtype); ``None`` = conv dtype.
    * ``compute_dtype``: dtype name the conv runs in; ``x``, ``weight`` and ``bias`` stored in another
      dtype are cast to it by the op (autocast: the op receives the fp32 tensors and its kernels cast
      them as they load them, instead of three cast kernels before it and three after its backward);
      gradients come back in each input's own dtype.  ``None`` = x's dtype.
    * ``strict``: a kernel failure raises ``KernelError`` instead of falling back to the reference.
    """

    conv: ConvSpec
    chain: tuple[ChainStep, ...] = ()
    pool: Optional[PoolSpec] = None
    out_dtype: Optional[str] = None
    strict: bool = False
    compute_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        check_chain(self.chain)

    def __hash__(self) -> int:
        # Cached: configs key the op's per-call host caches, and hashing the nested fields costs
        # ~10 us per call (measured with cProfile).  Equal configs still hash equal.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.conv, self.chain, self.pool, self.out_dtype, self.strict, self.compute_dtype))
            object.__setattr__(self, "_hash", cached)
        return cached

    def to_json(self) -> str:
        return json.dumps(_config_to_dict(self), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> ConvEpilogueConfig:
        return _parse_conv_epilogue(text)


def _operand_to_dict(op: Operand) -> dict[str, Any]:
    if isinstance(op, Const):
        return {"const": op.value}
    if isinstance(op, ChainValue):
        return {"chain_value": op.position}
    return {"tensor": op.index}


def _operand_from_dict(d: dict[str, Any]) -> Operand:
    if "const" in d:
        return Const(float(d["const"]))
    if "chain_value" in d:
        return ChainValue(int(d["chain_value"]))
    return TensorRef(int(d["tensor"]))


def chain_to_list(steps: tuple[ChainStep, ...]) -> list[dict[str, Any]]:
    """JSON-ready form of a chain of ``ChainStep``s."""
    return [{"kind": s.kind.name.lower(), "operands": [_operand_to_dict(o) for o in s.operands]} for s in steps]


def chain_from_list(items: list[dict[str, Any]]) -> tuple[ChainStep, ...]:
    """Inverse of ``chain_to_list``."""
    return tuple(
        ChainStep(PointwiseKind.from_name(s["kind"]), tuple(_operand_from_dict(o) for o in s["operands"])) for s in items
    )


def _config_to_dict(cfg: ConvEpilogueConfig) -> dict[str, Any]:
    return {
        "conv": cfg.conv.to_dict(),
        "chain": chain_to_list(cfg.chain),
        "pool": None if cfg.pool is None else cfg.pool.to_dict(),
        "out_dtype": cfg.out_dtype,
        "strict": cfg.strict,
        "compute_dtype": cfg.compute_dtype,
    }


@functools.lru_cache(maxsize=256)
def _parse_conv_epilogue(text: str) -> ConvEpilogueConfig:
    d = json.loads(text)
    pool = d.get("pool")
    return ConvEpilogueConfig(conv=ConvSpec.from_dict(d["conv"]), chain=chain_from_list(d["chain"]),
                              pool=None if pool is None else PoolSpec.from_dict(pool), out_dtype=d.get("out_dtype"),
                              strict=bool(d.get("strict", False)), compute_dtype=d.get("compute_dtype"))  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Checks the families' configs share (each config's ``__post_init__`` calls the ones it needs)
# ------------------------------------------------------------------------------------------------


def check_kernel_chains(**chains: tuple[ChainStep, ...]) -> None:
    """Each named chain (``pre=...``, ``post=...``) fits the kernels' operand slots and holds valid
    steps (``check_chain``); ``ValueError`` naming the chain otherwise."""
    for name, chain in chains.items():
        if len(chain) > MAX_CHAIN_LENGTH:
            raise ValueError(f"the {name}-chain has {len(chain)} steps; at most {MAX_CHAIN_LENGTH} fit the kernels")
        check_chain(chain)


def check_dtype_names(config: Any, *fields: str) -> None:
    """Each named field of ``config`` is None or the name of a torch dtype."""
    for name in fields:
        value = getattr(config, name)
        if value is not None and not isinstance(getattr(torch, value, None), torch.dtype):
            raise ValueError(f"{name} {value!r} is not a torch dtype name")


def check_norm_affine(config: Any) -> None:
    """A norm config's ``eps`` (non-negative) and its ``weight`` / ``bias`` operand indices (None or
    a non-negative int)."""
    if not config.eps >= 0.0:
        raise ValueError(f"eps must be a non-negative number, got {config.eps!r}")
    for name in ("weight", "bias"):
        index = getattr(config, name)
        if index is not None and (not isinstance(index, int) or index < 0):
            raise ValueError(f"{name} must be an operand index or None, got {index!r}")
