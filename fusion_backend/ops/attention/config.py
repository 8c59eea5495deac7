"""``AttentionConfig``: what is static about one attention region."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import JsonConfig


@dataclass(frozen=True)
class AttentionConfig(JsonConfig):
    """* ``scale``: the factor of the scores ``q @ k^T`` before the softmax (SDPA's ``scale``, resolved:
      ``1 / sqrt(E)`` where the call left it out);
    * ``strict``: a kernel failure raises ``KernelError`` instead of falling back to the reference."""

    scale: float
    strict: bool = False
