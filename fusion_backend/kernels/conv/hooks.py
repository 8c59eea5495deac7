"""Descriptions of the conv family's load and store hooks, and their contract checks (host side).

A hook is what the conv applies to the data it moves, in registers, so that the normalisation and
activation around a conv never make a pass of their own over memory:

* the *prologue* runs on every element of ``x`` the conv loads, before the dot: one of
  :class:`ChannelAffine` (a BatchNorm folded to ``x * scale[c] + shift[c]``), :class:`GroupAffine`
  (a GroupNorm: ``(x * scale[n, g] + shift[n, g]) * weight[c] + bias[c]``), :class:`SampleChannelScale`
  (a squeeze-and-excitation gate ``x * gate[n, c]``), then the input activation;
* the *epilogue* runs on every output the conv stores: the bias, the output activation, the
  residual (before or after that activation) and the per-channel statistics.

The kernels see hooks only as constexpr codes and pointers; these classes are what a caller writes
and what the launcher checks (one-line :class:`ContractError` before any launch) and keys its plans
by (``plan_parts``: the kind, never the values).

Prologue tensors are fp32 and contiguous (they are tiny: one value per channel, or per sample and
channel / group); the caller folds a norm's statistics (and, for BatchNorm, its affine) into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from ..chain_math import OP_CODES
from ..plan_cache import ContractError

#: ``PROLOGUE`` constexpr codes.
PROLOGUE_NONE, PROLOGUE_CHANNEL_AFFINE, PROLOGUE_GROUP_AFFINE, PROLOGUE_SAMPLE_CHANNEL_SCALE = range(4)
#: ``RESIDUAL`` constexpr codes: none, added before the output activation, added after it.
RESIDUAL_NONE, RESIDUAL_BEFORE_ACT, RESIDUAL_AFTER_ACT = range(3)

#: The activations of the catalogue, by name -> ``ACT_IN`` / ``ACT_OUT`` constexpr code.  The codes are
#: ``chain_math``'s op codes, so the device side is ``chain_math.step_forward`` (torch semantics).
#: Every one maps 0 to 0 (``prologue.load_a_tile`` relies on it).
ACTIVATIONS = {name: OP_CODES[name] for name in ("relu", "leaky_relu", "gelu", "silu")}
ACT_NONE = 0


@dataclass(frozen=True)
class Activation:
    """An activation of the catalogue: ``relu``, ``leaky_relu`` (``slope``: its negative slope, torch's
    default 0.01), ``gelu`` (the exact erf form) or ``silu``."""

    kind: str
    slope: float = 0.01

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ContractError(f"activation {self.kind!r} is not one of {sorted(ACTIVATIONS)}")

    @property
    def code(self) -> int:
        return ACTIVATIONS[self.kind]


#: What ``act_in`` / ``act_out`` accept: None, an activation's name, or an :class:`Activation`.
ActivationLike = Union[None, str, Activation]


def as_activation(act: ActivationLike, name: str) -> Activation | None:
    """``act`` as an :class:`Activation` (None stays None); ``name`` names the argument in errors."""
    if act is None or isinstance(act, Activation):
        return act
    if isinstance(act, str):
        if act not in ACTIVATIONS:
            raise ContractError(f"{name}={act!r} is not one of {sorted(ACTIVATIONS)}")
        return Activation(act)
    raise ContractError(f"{name} must be None, an activation name or an Activation, got {type(act).__name__}")


def activation_args(act: Activation | None) -> tuple[int, float]:
    """``(constexpr code, runtime slope)`` of an optional activation (0 and 0.0 for none)."""
    return (ACT_NONE, 0.0) if act is None else (act.code, float(act.slope))


@dataclass(frozen=True)
class ChannelAffine:
    """``x' = x * scale[c] + shift[c]``: a BatchNorm (eval statistics or the batch's own, folded with
    its affine).  ``scale``, ``shift``: fp32 contiguous ``(C_in,)``."""

    scale: torch.Tensor
    shift: torch.Tensor

    code = PROLOGUE_CHANNEL_AFFINE


@dataclass(frozen=True)
class GroupAffine:
    """``x' = (x * scale[n, g] + shift[n, g]) * weight[c] + bias[c]`` with ``g = c // (C_in // G)``: a
    GroupNorm with ``G`` groups (``scale = rstd``, ``shift = -mean * rstd`` per sample and group), and
    its per-channel affine (``weight``, ``bias``: None for a norm without affine; both or neither).
    ``scale``, ``shift``: fp32 contiguous ``(N, G)``; ``weight``, ``bias``: fp32 contiguous ``(C_in,)``.
    ``G`` divides ``C_in``; it is independent of the conv's own ``groups``."""

    scale: torch.Tensor
    shift: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    code = PROLOGUE_GROUP_AFFINE

    @property
    def groups(self) -> int:
        return self.scale.shape[-1]


@dataclass(frozen=True)
class SampleChannelScale:
    """``x' = x * gate[n, c]``: a squeeze-and-excitation gate.  ``gate``: fp32 contiguous ``(N, C_in)``."""

    gate: torch.Tensor

    code = PROLOGUE_SAMPLE_CHANNEL_SCALE


Prologue = Union[ChannelAffine, GroupAffine, SampleChannelScale]


@dataclass(frozen=True)
class NormStats:
    """The statistics a BatchNorm normalised its input with, for its backward: ``mean`` and ``rstd``
    (``1 / sqrt(var + eps)``), fp32 contiguous ``(C,)``.  ``dgrad``'s epilogue forms ``x̂ = (x_prev -
    mean[c]) * rstd[c]`` from them for the sum ``Σ grad_z · x̂`` (``stats.BatchNormGradSums``)."""

    mean: torch.Tensor
    rstd: torch.Tensor


def prologue_code(prologue: Prologue | None) -> int:
    """The ``PROLOGUE`` constexpr of a prologue (``PROLOGUE_NONE`` for None)."""
    if prologue is None:
        return PROLOGUE_NONE
    if not isinstance(prologue, (ChannelAffine, GroupAffine, SampleChannelScale)):
        raise ContractError(
            f"prologue must be None, ChannelAffine, GroupAffine or SampleChannelScale, got {type(prologue).__name__}"
        )
    return prologue.code


def prologue_tensors(prologue: Prologue | None) -> tuple[torch.Tensor | None, ...]:
    """The four tensors the kernel's prologue pointers read, in its order ``(p0, p1, p2, p3)``:
    channel affine ``(scale, shift, -, -)``, group affine ``(scale, shift, weight, bias)``, gate
    ``(gate, -, -, -)``; None where nothing is read."""
    if isinstance(prologue, ChannelAffine):
        return prologue.scale, prologue.shift, None, None
    if isinstance(prologue, GroupAffine):
        return prologue.scale, prologue.shift, prologue.weight, prologue.bias
    if isinstance(prologue, SampleChannelScale):
        return prologue.gate, None, None, None
    return None, None, None, None


def _require_fp32(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ContractError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.device != device:
        raise ContractError(f"{name} must be on {device} with x, got {t.device}")
    if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
        layout = "" if t.is_contiguous() else " non-contiguous"
        raise ContractError(f"{name} must be contiguous fp32 {shape}, got {tuple(t.shape)} {t.dtype}{layout}")


def check_prologue(prologue: Prologue | None, n: int, c_in: int, device: torch.device) -> None:
    """Raise :class:`ContractError` unless ``prologue``'s tensors fit an input of ``n`` samples and
    ``c_in`` channels on ``device``."""
    prologue_code(prologue)
    if isinstance(prologue, ChannelAffine):
        _require_fp32("prologue scale", prologue.scale, (c_in,), device)
        _require_fp32("prologue shift", prologue.shift, (c_in,), device)
    elif isinstance(prologue, GroupAffine):
        if prologue.scale.dim() != 2 or prologue.groups < 1 or c_in % prologue.groups:
            raise ContractError(f"group prologue scale must be (N, G) with G dividing C_in={c_in}, "
                                f"got {tuple(prologue.scale.shape)}")  # fmt: skip
        shape = (n, prologue.groups)
        _require_fp32("group prologue scale", prologue.scale, shape, device)
        _require_fp32("group prologue shift", prologue.shift, shape, device)
        if (prologue.weight is None) != (prologue.bias is None):
            raise ContractError("group prologue weight and bias must both be given or both be None")
        if prologue.weight is not None:
            _require_fp32("group prologue weight", prologue.weight, (c_in,), device)
            _require_fp32("group prologue bias", prologue.bias, (c_in,), device)
    elif isinstance(prologue, SampleChannelScale):
        _require_fp32("prologue gate", prologue.gate, (n, c_in), device)


def check_norm_stats(norm_stats: NormStats | None, c: int, device: torch.device) -> None:
    """Raise :class:`ContractError` unless ``norm_stats`` is None or a :class:`NormStats` whose
    vectors fit ``c`` channels on ``device``."""
    if norm_stats is None:
        return
    if not isinstance(norm_stats, NormStats):
        raise ContractError(f"norm_stats must be None or NormStats, got {type(norm_stats).__name__}")
    _require_fp32("norm_stats mean", norm_stats.mean, (c,), device)
    _require_fp32("norm_stats rstd", norm_stats.rstd, (c,), device)


def plan_parts(prologue: Prologue | None) -> tuple:
    """What a launch plan depends on in a prologue: its kind, the group count and whether the group
    affine has its per-channel affine (the tensors' layouts are fixed by ``check_prologue``)."""
    if isinstance(prologue, GroupAffine):
        if not isinstance(prologue.scale, torch.Tensor) or prologue.scale.dim() != 2:
            raise ContractError(f"group prologue scale must be an (N, G) tensor, got {prologue.scale!r:.60}")
        return (prologue.code, prologue.groups, prologue.weight is not None)
    return (prologue_code(prologue),)
