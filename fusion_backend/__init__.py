"""fusion: a ``torch.compile`` backend that fuses convolution pipelines into Triton kernels.

    torch.compile(model, backend="fusion")                       # no import needed
    torch.compile(model, backend="fusion", options={"strict": True, "dump_dir": "dumps"})
    fusion_backend.explain(model, x)                             # what was fused, and why not

See the README for the supported patterns and options.
"""

from .backend import fusion
from .engine import Pattern, register_pattern, registered_patterns
from .errors import (
    FusionError,
    InvalidOptionError,
    KernelError,
    RewriteError,
    UnknownOptionError,
    UnsupportedInputError,
)
from .explain import ExplainResult, explain
from .report import GraphReport, Match, NearMiss, ReasonKind, collect_reports

__all__ = [
    "fusion",
    "explain",
    "ExplainResult",
    "collect_reports",
    "GraphReport",
    "Match",
    "NearMiss",
    "ReasonKind",
    "Pattern",
    "register_pattern",
    "registered_patterns",
    "FusionError",
    "UnknownOptionError",
    "InvalidOptionError",
    "RewriteError",
    "KernelError",
    "UnsupportedInputError",
]

__version__ = "0.1.0"
