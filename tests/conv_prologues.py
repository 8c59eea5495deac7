"""The conv family's prologue hooks as its kernel tests draw them: one builder per kind, the kinds the
tests parametrize over, and their test ids."""

from __future__ import annotations

import torch

from fusion_backend.kernels.conv import Activation, ChannelAffine, GroupAffine, SampleChannelScale

#: ``(kind, act_in)``: every prologue kind with an activation of the catalogue (``conv_prologue``'s kinds).
PROLOGUES = [
    ("channel_affine", "relu"),
    ("group_affine", "silu"),
    ("group_affine-no-affine", "gelu"),
    ("gate", Activation("leaky_relu", 0.2)),
]


def prologue_ids(cases: list) -> list[str]:
    """Test ids of ``(kind, act_in)`` cases: ``kind-activation``."""
    return [f"{k}-{getattr(a, 'kind', a)}" for k, a in cases]


def conv_prologue(kind: str, n: int, c: int, g: torch.Generator, device: str | torch.device):
    """A prologue of ``kind`` for ``n`` samples of ``c`` channels on ``device`` (fp32 vectors drawn from
    ``g``): ``channel_affine`` with shifts far from 0 (a padded tap that saw the shift would show);
    ``group_affine`` over groups of 2 channels (a group's channels share a tile's columns or not) with its
    per-channel affine, ``group_affine-no-affine`` without it; ``gate``, per (sample, channel)."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, torch.float32)

    if kind == "channel_affine":
        return ChannelAffine(randn(c).abs() + 0.5, randn(c) + 2.0)
    if kind in ("group_affine", "group_affine-no-affine"):
        weight, bias = (randn(c), randn(c) + 1.0) if kind == "group_affine" else (None, None)
        return GroupAffine(randn(n, c // 2).abs() + 0.5, randn(n, c // 2) - 1.5, weight, bias)
    if kind == "gate":
        return SampleChannelScale(torch.sigmoid(randn(n, c)) + 0.5)
    raise ValueError(f"no prologue kind {kind!r}")
