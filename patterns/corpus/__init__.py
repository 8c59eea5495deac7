"""Example models for each pattern family: what must match (and as which region), and near misses
with the reason the report gives.  They run as golden tests (``tests/match/test_corpus.py``, find
phase only) and are the documentation's example set: each case is a small model in the shape real
networks use.

A case is a :class:`CorpusCase`; each family's module (``conv_epilogue.py``, ``conv_global_mean.py``)
lists its cases in ``CASES``.  A new family adds its own module here and to :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CorpusCase:
    """``build()`` returns ``(model, inputs)`` (CPU, small, float32 unless the family takes other dtypes only); ``regions``: the summaries of
    the regions that must match, in graph order (``"conv2d -> relu -> max_pool2d"``); ``near_misses``:
    ``(pattern, reason, words)`` of every near miss the report must give, ``reason`` a ``ReasonKind``
    value and ``words`` a phrase of its message.  Both lists are complete: anything else is a change."""

    name: str
    build: Callable[[], tuple[torch.nn.Module, list[torch.Tensor]]]
    regions: tuple[str, ...] = ()
    near_misses: tuple[tuple[str, str, str], ...] = ()


def x_of(*shape: int) -> list[torch.Tensor]:
    """A case's inputs: one seeded standard-normal tensor of ``shape``."""
    torch.manual_seed(0)
    return [torch.randn(*shape)]


class Then(torch.nn.Module):
    """``conv`` followed by ``after``, a function of its output (a one-line example model)."""

    def __init__(self, conv: torch.nn.Module, after: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.conv, self.after = conv, after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(self.conv(x))


#: Family name -> the module holding its ``CASES``.
FAMILIES = ("conv_epilogue", "conv_global_mean", "conv_channel_reduce", "conv_group_norm", "conv_batch_norm",
            "conv_layer_norm", "batch_norm_conv", "attention")


def cases(family: str) -> list[CorpusCase]:
    """The corpus of ``family`` (one of :data:`FAMILIES`)."""
    import importlib

    if family not in FAMILIES:
        raise ValueError(f"no corpus for {family!r}; families with one: {', '.join(FAMILIES)}")
    return list(importlib.import_module(f"{__name__}.{family}").CASES)
