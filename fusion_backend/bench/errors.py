"""Exception types of the benchmark harness.

They derive from :class:`fusion_backend.errors.FusionError` so that ``except FusionError`` catches every
error the project raises on purpose, and from ``ValueError`` where the cause is a bad argument, so the
CLI can turn them into a one-line message and exit status 2 instead of a traceback.
"""

from __future__ import annotations

from ..errors import FusionError


class BenchError(FusionError):
    """Base class of every error raised on purpose by ``fusion_backend.bench``."""


class SuiteError(BenchError, ValueError):
    """A suite name, model file or folder cannot be turned into workloads; the message says why."""


class BackendSpecError(BenchError, ValueError):
    """A ``--backends`` entry names no known benchmark backend nor any ``torch.compile`` backend."""


class ConfigError(BenchError, ValueError):
    """A run option (dtype, mode, tolerance, repetition count) is outside its allowed set."""
