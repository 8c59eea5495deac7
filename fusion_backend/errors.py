"""Exception types of the fusion backend.

Every error the backend raises on purpose is a ``FusionError`` (or a subclass), with a message that
names the problem and what to do about it.  ``UnknownOptionError`` is also a ``ValueError`` so that
``except ValueError`` written against the documented contract keeps working.
"""

from __future__ import annotations


class FusionError(RuntimeError):
    """Base class of every error raised on purpose by ``fusion_backend``."""


class UnknownOptionError(FusionError, ValueError):
    """An option key passed to ``torch.compile(..., options=...)`` is neither ours nor Inductor's."""


class InvalidOptionError(FusionError, ValueError):
    """An option of ours has a value of the wrong type or outside its allowed set."""


class RewriteError(FusionError):
    """A matched region could not be rewritten or compiled (raised only with ``strict=True``)."""


class KernelError(FusionError):
    """A fused kernel could not run on its inputs (raised only with ``strict=True``)."""


class UnsupportedInputError(FusionError):
    """A fused op received inputs it has no kernel for (dtype, device or layout); see the message."""
