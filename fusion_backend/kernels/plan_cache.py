"""Launch plans: the host work of a kernel launcher done once per call signature, and the pointer
contracts a plan checks before any kernel sees a tensor.

Why: at the ``seeds`` suite's sizes a training step waits on the host, so every launcher splits its
work in two.  The *plan* (the checks, tiles, grid, integer arguments and ``FastLaunch`` objects) is
built on the first call of a signature and kept in a :class:`PlanCache`; later calls only bind
tensors.  A plan depends on everything its builder read, so its key (:func:`plan_key`) holds each
tensor's shape, strides, dtype and device (:func:`tensor_key`) and every other argument the builder
reads (op codes, pool, flags).

Pointer contracts.  The kernels index memory from the strides and sizes the plan computed, and trust
its assumptions about the tensors (contiguous fp32 operand rows, spatial dims that flatten to one
stride, int8/int32 winners, one device).  A plan checks them when it is built and raises
:class:`ContractError`, a ``ValueError`` whose one-line message names the tensor and what it breaks,
before anything launches: a broken contract never reaches Triton (whose error would be a stack trace
from the kernel's compile, or wrong memory read).  Because the key holds every tensor's layout, a
call that finds a cached plan satisfies the contracts that plan was checked against: the checks cost
nothing per call.  The data pointer's alignment is not part of the key: ``FastLaunch`` specializes
on it per call, as Triton does, and no kernel assumes more than the dtype's alignment.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import torch

P = TypeVar("P")

#: Plans one :class:`PlanCache` keeps by default (a model needs a few per launcher; the bound only
#: guards against a key that varies per call).
PLANS_PER_LAUNCHER = 256


class ContractError(ValueError):
    """A tensor breaks the pointer contract of a kernel: the message (one line) names the tensor and
    the assumption it breaks, and says what it got."""


# --------------------------------------------------------------------------------------------------
# The cache and its key
# --------------------------------------------------------------------------------------------------


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a per-shape cache of a launch or decision keys a tensor by: shape, strides, dtype,
    device (None for an absent tensor)."""
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device)


def plan_key(*parts: Any) -> tuple:
    """The key of a plan built from ``parts``: each tensor (or None in a tensor's place) by
    :func:`tensor_key`, every other part as it is (it must be hashable: op codes, pools, flags,
    numbers; a chain's steps go in as ``chain_math.step_codes``)."""
    return tuple([tensor_key(p) if isinstance(p, torch.Tensor) else p for p in parts])


class PlanCache:
    """``key -> value`` computed once per key, at most ``limit`` entries (the oldest goes first).

    For the per-signature host decisions of the kernel launchers and the op calls (launch plans,
    layout decisions, measured choices): the keys are shapes and strides, so a model needs few.  A
    ``compute`` that raises caches nothing, so a contract violation raises again at the next call.
    """

    def __init__(self, limit: int = PLANS_PER_LAUNCHER) -> None:
        self.limit = limit
        self._values: dict[Hashable, Any] = {}
        _EVERY_CACHE.add(self)

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        try:
            return self._values[key]
        except KeyError:
            pass
        value = compute()
        self.put(key, value)
        return value

    def plan(self, parts: Iterable[Any], build: Callable[[], P]) -> P:
        """The plan kept under ``plan_key(*parts)``, built by ``build()`` on a miss."""
        return self.get(plan_key(*parts), build)

    def peek(self, key: Hashable) -> Any:
        """The value kept for ``key``, or None."""
        return self._values.get(key)

    def put(self, key: Hashable, value: Any) -> None:
        if key not in self._values and len(self._values) >= self.limit:
            del self._values[next(iter(self._values))]
        self._values[key] = value

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)

    def values(self) -> list[Any]:
        """The kept values, oldest first."""
        return list(self._values.values())


def cached_plans(build: Callable[..., P]) -> Callable[..., P]:
    """``build`` (a plan builder taking hashable positional arguments: shapes, strides, devices,
    constexpr tuples) with its plans kept in a :class:`PlanCache` keyed by those arguments; the
    cache is ``.plans`` and ``.cache_clear()`` empties it, as for ``functools.lru_cache``."""
    plans = PlanCache()

    @functools.wraps(build)
    def planned(*args: Any) -> P:
        return plans.plan(args, lambda: build(*args))

    planned.plans = plans  # type: ignore[attr-defined]
    planned.cache_clear = plans.clear  # type: ignore[attr-defined]
    return planned


#: Every :class:`PlanCache` of the process, for :func:`forget_call_plans`.
_EVERY_CACHE: weakref.WeakSet[PlanCache] = weakref.WeakSet()


def forget_call_plans() -> None:
    """Empty every per-signature cache of the fused ops (call plans, launches, layout decisions,
    measured implementation choices): the next call of each signature plans, compiles and measures
    again, as a first call does.  Compiled Triton kernels and the region decisions' disk cache stay."""
    for cache in list(_EVERY_CACHE):
        cache.clear()


# --------------------------------------------------------------------------------------------------
# Pointer contracts
# --------------------------------------------------------------------------------------------------


def spatial_flat_strides(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(sn, sc, ss)`` of ``t`` (N, C, *spatial) seen as (N, C, S): its spatial dims walked as one
    axis of stride ``ss`` (size-1 dims ignored; 1 when every spatial dim has size 1), or None when
    they do not flatten (a slice, a permutation other than contiguous / channels-last)."""
    inner, ss = 1, None
    for size, stride in reversed(list(zip(t.shape[2:], t.stride()[2:], strict=True))):
        if size == 1:
            continue
        if ss is not None and stride != inner:
            return None
        if ss is None:
            ss = stride
        inner = stride * size
    return t.stride(0), t.stride(1), 1 if ss is None else ss


def flat_strides(name: str, t: torch.Tensor) -> tuple[int, int, int]:
    """:func:`spatial_flat_strides` of ``t``; :class:`ContractError` when its spatial dims do not
    flatten to one stride."""
    flat = spatial_flat_strides(t)
    if flat is None:
        raise ContractError(f"{name}'s spatial dims must flatten to one stride, got strides {t.stride()}")
    return flat


def require_rows(name: str, t: torch.Tensor, columns: int, rows: int | None = None) -> None:
    """``t`` is a contiguous fp32 matrix of ``columns`` columns (and ``rows`` rows where given): an
    operand matrix (``P``, ``Q``), affine rows or statistics, which kernels index as ``row * columns
    + column``."""
    if t.dtype != torch.float32 or not t.is_contiguous() or t.shape[-1] != columns or (rows and t.shape[0] != rows):
        raise ContractError(f"{name} must be contiguous fp32 with {columns} columns, got {tuple(t.shape)} {t.dtype}")


def require_contiguous_fp32(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    """``t`` is a contiguous fp32 tensor of exactly ``shape`` (a buffer the kernels index flat)."""
    if tuple(t.shape) != tuple(shape) or t.dtype != torch.float32 or not t.is_contiguous():
        raise ContractError(f"{name} must be contiguous fp32 {tuple(shape)}, got {tuple(t.shape)} {t.dtype}"
                            f"{'' if t.is_contiguous() else ' non-contiguous'}")  # fmt: skip


def require_dtype(name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
    """``t``'s dtype is one of ``dtypes`` (what the kernel's pointer is read or written as)."""
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ContractError(f"{name} must be {names}, got {t.dtype}")


def require_channel_vector(what: str, t: torch.Tensor | None, channels: int, device: torch.device,
                           widest: int = 64) -> None:
    """``t`` (None: absent) is ``channels`` contiguous floats of at most ``widest`` bits on ``device``: a
    per-channel vector a kernel reads flat.  ``what`` begins the one-line error (``"<op>: <name> must
    hold <channels> ..."``), which then says what was given."""
    if t is None:
        return
    if (t.numel() != channels or not t.is_contiguous() or not t.is_floating_point() or t.element_size() * 8 > widest
            or t.device != device):  # fmt: skip
        bits = f" of at most {widest} bits" if widest < 64 else ""
        raise ContractError(f"{what} as contiguous floats{bits} on {device}; got shape {tuple(t.shape)}, strides "
                            f"{t.stride()}, {t.dtype}, {t.device}")


def require_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    """Every given tensor lives on ``device`` (one kernel launch reads them all)."""
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ContractError(f"{name} must be on {device} with the other tensors of the launch, got {t.device}")
