"""``AttentionConfig``: what is static about one attention region."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import JsonConfig


@dataclass(frozen=True)
class AttentionConfig(JsonConfig):
    """* ``scale``: the factor of the scores ``q @ k^T`` before the softmax (SDPA's ``scale``); ``None``:
      eager's default, ``1 / sqrt(E)`` of the call's head dim ``E``;
    * ``strict``: a kernel failure raises ``KernelError`` instead of falling back to the reference."""

    scale: float | None = None
    strict: bool = False
