"""``fusion_backend.explain``: what the backend does to a model, without writing a backend.

>>> import torch, fusion_backend
>>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
>>> result = fusion_backend.explain(model, torch.randn(2, 3, 10, 10), options={"decide": "fuse"})
>>> result.counts()      # on CPU the default ``decide="measure"`` would leave the region to Inductor
{'conv_epilogue': 1}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .report import GraphReport, collect_reports
from .runtime.deferred import settled_reports


@dataclass(frozen=True)
class ExplainResult:
    """The reports of every graph compiled for one call, and that call's output."""

    reports: tuple[GraphReport, ...]
    output: Any

    def counts(self) -> dict[str, int]:
        """Fused regions per pattern, over all graphs."""
        total: dict[str, int] = {}
        for r in self.reports:
            for k, v in r.counts().items():
                total[k] = total.get(k, 0) + v
        return total

    @property
    def near_misses(self):
        return tuple(n for r in self.reports for n in r.near_misses)

    @property
    def fallbacks(self):
        return tuple(f for r in self.reports for f in r.fallbacks)

    def __str__(self) -> str:
        if not self.reports:
            return "fusion: no graph was compiled (was the model already compiled with these inputs?)"
        return "\n".join(str(r) for r in self.reports)


def explain(model: Any, *inputs: Any, **compile_kwargs: Any) -> ExplainResult:
    """Compile ``model`` with ``backend="fusion"`` (plus ``compile_kwargs``), run it once on
    ``inputs``, and return the reports of every graph compiled for that call.  Decisions the call
    left pending (``runtime/deferred.py``) are settled first: the reports say what was decided.

    Dynamo's caches are reset first, so a model compiled earlier is explained afresh.
    """
    compile_kwargs.setdefault("backend", "fusion")
    torch._dynamo.reset()
    compiled = torch.compile(model, **compile_kwargs)
    with collect_reports() as reports:
        output = compiled(*inputs)
    return ExplainResult(tuple(settled_reports(reports)), output)
