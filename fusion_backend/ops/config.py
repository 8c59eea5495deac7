"""Static configuration of the fused ops, serialised into the op call as a string, and its codec.

``torch.library.custom_op`` schemas carry tensors and a few scalar types, not arbitrary objects, so the
configuration of a fused region (conv hyper-parameters, the pointwise chains, the pool...) travels as
one canonical JSON string.  It must not contain anything shape-dependent: the same string serves every
input shape (dynamic shapes), and everything size-dependent is read off the tensors at run time.

Every family's config is a frozen dataclass deriving from ``JsonConfig``, which is the one codec:
``to_json()`` writes every field (sorted keys, no spaces: equal configs give equal strings) and
``from_json()`` parses it back, cached because the op implementations parse the string on every call.
A field's JSON form follows its annotation (``_CODECS``); a config with a field of another type fails
at class definition.  ``ConvEpilogueConfig`` (the epilogue family's) lives here because the patterns
build it too; the checks at the end are the ones the families' ``__post_init__`` share.

The fields the norm families' configs share mean the same in each:

* ``pre`` / ``post``: steps applied before / after the norm (``ops/chain.py``); ``TensorRef``
  operands index the op's ``operands`` list (numbers, one-element or per-channel tensors);
  ``ChainValue(i)`` is the chain's own value before its step ``i``.
* ``weight`` / ``bias``: indices into ``operands`` of the norm's scale and shift (any float dtype),
  or ``None`` (no affine, or no bias).
* ``norm_dtype``: dtype name the norm's result has in eager (autocast runs the norm in fp32 on a
  bf16 conv output), ``None`` = the conv's.  The post-chain runs in it.
* ``out_dtype``: dtype name of the region's result, ``None`` = the conv's.
* ``strict``: a kernel failure raises ``KernelError`` instead of falling back to the reference.
* ``pool``: a max or avg pool of the conv's spatial dims over the post-chain's result (the
  region's result is then the pooled value), or ``None``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
from .chain_lowering import family_activation


def _same(value: Any) -> Any:
    return value


def _optional(decode: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else decode(value)


def _encode_spec(value: Any) -> Any:
    return None if value is None else value.to_dict()


#: Per field annotation: ``(to JSON, from JSON)``.
_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "ConvSpec": (_encode_spec, ConvSpec.from_dict),
    "PoolSpec | None": (_encode_spec, _optional(PoolSpec.from_dict)),
    "tuple[ChainStep, ...]": (lambda chain: chain_to_list(chain), lambda items: chain_from_list(items)),
    "tuple[int, ...]": (list, lambda items: tuple(int(v) for v in items)),
    "float": (_same, float),
    "float | None": (_same, _optional(float)),
    "int": (_same, int),
    "bool": (_same, bool),
    "str": (_same, str),
    "int | None": (_same, _same),
    "str | None": (_same, _same),
}


class JsonConfig:
    """The JSON codec of a fused op's config (a frozen dataclass deriving from it; see the module
    docstring).  A key missing from the JSON takes the field's default."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, annotation in inspect.get_annotations(cls).items():
            if str(annotation) not in _CODECS:
                raise TypeError(f"{cls.__name__}.{name}: no JSON codec for {annotation!r} (ops/config.py's _CODECS)")

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal configs give equal strings."""
        d = {f.name: _CODECS[str(f.type)][0](getattr(self, f.name)) for f in dataclasses.fields(self)}
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Any:
        """Parse ``to_json``'s output (cached)."""
        return _parse(cls, text)


@functools.lru_cache(maxsize=1024)
def _parse(cls: type, text: str) -> Any:
    d = json.loads(text)
    return cls(**{f.name: _CODECS[str(f.type)][1](d[f.name]) for f in dataclasses.fields(cls) if f.name in d})


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


@dataclass(frozen=True)
class ConvEpilogueConfig(JsonConfig):
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
    * ``residual``: index of the one operand of the conv output's full shape (a residual branch, as
      ResNet's ``relu(bn(conv(x)) + identity)``), read by exactly one ``add`` step of ``chain``;
      ``None``: every operand is a number, one element or one value per channel.  A region with a
      residual has no pool.
    * ``gate``: index of an operand of one value per sample and input channel ``(N, C_in, 1, ...)``
      that multiplies ``x`` before the conv (a squeeze-and-excitation gate); no chain step reads it.
    * ``norm_in``: the group count ``G`` of a group norm applied to ``x`` before the conv (the VAE's
      and UNet's ``conv(silu(group_norm(x)))``; ``G = C_in`` for an instance norm), with
      ``norm_in_eps``; ``norm_in_affine``: index of its per-channel weight, its bias the next operand
      (``None``: no affine); ``act_in``: the activation after it (none, or one ``relu``,
      ``leaky_relu`` of a constant slope, ``gelu`` or ``silu`` step).  The norm and the activation
      run in fp32 on x as given, and their result is cast to the conv's dtype (as autocast's fp32
      group norm then its conv do).  No chain step reads the affine operands; not with ``gate``.
    """

    conv: ConvSpec
    chain: tuple[ChainStep, ...] = ()
    pool: PoolSpec | None = None
    out_dtype: str | None = None
    strict: bool = False
    compute_dtype: str | None = None
    residual: int | None = None
    gate: int | None = None
    norm_in: int | None = None
    norm_in_eps: float = 1e-5
    norm_in_affine: int | None = None
    act_in: tuple[ChainStep, ...] = ()

    def __post_init__(self) -> None:
        check_chain(self.chain)
        self._check_input_prologue()
        if self.gate is not None and any(TensorRef(self.gate) in s.operands for s in self.chain):
            raise ValueError(f"the gate operands[{self.gate}] multiplies x; no chain step reads it")
        if self.residual is not None:
            readers = [s for s in self.chain if TensorRef(self.residual) in s.operands]
            if len(readers) != 1 or readers[0].kind is not PointwiseKind.ADD:
                raise ValueError(f"the residual operands[{self.residual}] must be read by exactly one add step")
            if self.pool is not None:
                raise ValueError("a region with a residual has no pool")

    def __hash__(self) -> int:
        # Cached: configs key the op's per-call host caches, and hashing the nested fields costs
        # ~10 us per call (measured with cProfile).  Equal configs still hash equal.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.conv, self.chain, self.pool, self.out_dtype, self.strict, self.compute_dtype,
                           self.residual, self.gate, self.norm_in, self.norm_in_eps, self.norm_in_affine, self.act_in))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def family_only(self) -> bool:
        """Whether the region holds a part only the conv family's forward applies (a residual add in
        its store, a gate or an input norm as it loads x): its baseline is the plain-torch reference."""
        return self.residual is not None or self.gate is not None or self.norm_in is not None

    def _check_input_prologue(self) -> None:
        if self.norm_in is None:
            if self.norm_in_affine is not None or self.act_in:
                raise ValueError("norm_in_affine and act_in need norm_in (an input group norm)")
            return
        if self.norm_in < 1 or self.gate is not None:
            raise ValueError(f"norm_in must be a group count >= 1 and comes without a gate, got {self.norm_in}")
        if len(self.act_in) > 1 or any(family_activation(s) is None for s in self.act_in):
            raise ValueError("act_in holds at most one of gelu, leaky_relu (a constant slope), relu, silu "
                             "(what the conv family's prologue applies)")
        if self.norm_in_affine is not None:
            affine = (TensorRef(self.norm_in_affine), TensorRef(self.norm_in_affine + 1))
            if any(ref in s.operands for s in self.chain for ref in affine):
                raise ValueError(f"the input norm's operands[{self.norm_in_affine}:+2] scale x; no chain step reads them")



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


def check_norm_fields(config: Any) -> None:
    """A norm's own fields: ``eps`` (non-negative) and the ``weight`` / ``bias`` operand indices (None or a
    non-negative int)."""
    if not config.eps >= 0.0:
        raise ValueError(f"eps must be a non-negative number, got {config.eps!r}")
    for name in ("weight", "bias"):
        index = getattr(config, name)
        if index is not None and (not isinstance(index, int) or index < 0):
            raise ValueError(f"{name} must be an operand index or None, got {index!r}")


def check_momentum(momentum: Any) -> None:
    """A training BatchNorm's running-statistics factor: a number (not a bool)."""
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise ValueError(f"momentum must be a number, got {momentum!r}")


@dataclass(frozen=True)
class TrainingBatchNormConfig(JsonConfig):
    """The fields every region holding a training BatchNorm (batch statistics) beside a conv declares,
    first in its config (``conv_batch_norm``'s, ``batch_norm_conv``'s), checked by
    :meth:`__post_init__` (:func:`check_norm_fields`, :func:`check_momentum`):

    * ``conv``: the conv's parameters.
    * ``eps``: added to each channel's biased batch variance before the reciprocal square root.
    * ``momentum``: the running statistics' update factor ``m`` (``running = (1 - m) * running + m *
      batch``, the variance unbiased); used only with ``running_stats``.
    * ``weight`` / ``bias``: the operand indices of the norm's weight and bias (one value per channel
      each; None: not affine).
    * ``running_stats``: whether the graph's call passes the running statistics (the last two entries
      of its operand list: each op's ``split_operands``).
    """

    conv: ConvSpec
    eps: float = 1e-5
    momentum: float = 0.1
    weight: int | None = None
    bias: int | None = None
    running_stats: bool = False

    def __post_init__(self) -> None:
        check_norm_fields(self)
        check_momentum(self.momentum)


def check_norm_config(config: Any, **chains: tuple[ChainStep, ...]) -> None:
    """The fields the norm families' configs share (the module docstring): the norm's own
    (:func:`check_norm_fields`), the named chains (``check_kernel_chains``), the dtype names and a pool
    of the conv's spatial dims."""
    check_norm_fields(config)
    check_kernel_chains(**chains)
    check_dtype_names(config, "norm_dtype", "out_dtype")
    if config.pool is not None and len(config.pool.kernel_size) != config.conv.spatial_dims:
        raise ValueError(f"the pool {config.pool} does not have the conv's {config.conv.spatial_dims} spatial dims")


# ------------------------------------------------------------------------------------------------
# The configs in a few words, for messages (each family's ``describe``)
# ------------------------------------------------------------------------------------------------


def describe_chain(steps: tuple[ChainStep, ...]) -> str:
    """``relu, mul`` for messages."""
    return ", ".join(s.kind.name.lower() for s in steps)


def describe_affine(cfg: Any) -> str:
    """``, weight, bias`` for a norm with both (for messages)."""
    return "".join([", weight" if cfg.weight is not None else "", ", bias" if cfg.bias is not None else ""])


def describe_pool(pool: PoolSpec | None) -> str:
    """`` -> max_pool(k=(3, 3), s=(2, 2), p=(1, 1), ceil_mode=False)`` for messages ('' without a pool)."""
    if pool is None:
        return ""
    return f" -> {pool.kind}_pool(k={pool.kernel_size}, s={pool.stride}, p={pool.padding}, ceil_mode={pool.ceil_mode})"
