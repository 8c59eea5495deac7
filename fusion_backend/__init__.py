"""fusion: a ``torch.compile`` backend that fuses convolution pipelines into Triton kernels.

    torch.compile(model, backend="fusion")                       # no import needed
    torch.compile(model, backend="fusion", options={"strict": True, "dump_dir": "dumps"})
    fusion_backend.explain(model, x)                             # what was fused, and why not

See the README for the supported patterns and options.

The public names below are imported lazily (PEP 562): ``import fusion_backend`` (and the pytest
plugin, which pytest loads before any conftest) must not import Dynamo, and through it Triton, because
Triton decides once, at import, whether its own helpers run under the interpreter
(``TRITON_INTERPRET=1``, set by the test suite on machines without CUDA).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "fusion": "backend",
    "explain": "explainer",
    "ExplainResult": "explainer",
    "collect_reports": "report",
    "settle": "runtime.deferred",
    "GraphReport": "report",
    "Match": "report",
    "NearMiss": "report",
    "ReasonKind": "report",
    "Pattern": "match.engine",
    "register_pattern": "match.engine",
    "registered_patterns": "match.engine",
    "FusionError": "errors",
    "UnknownOptionError": "errors",
    "InvalidOptionError": "errors",
    "ConfigurationError": "errors",
    "UnknownPatternError": "errors",
    "InvalidEnvironmentError": "errors",
    "RewriteError": "errors",
    "KernelError": "errors",
    "UnsupportedInputError": "errors",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fusion_backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
