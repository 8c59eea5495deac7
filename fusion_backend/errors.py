"""Exception types of the fusion backend.

Every error the backend raises on purpose is a ``FusionError`` (or a subclass), with a message that
names the problem and what to do about it.  ``UnknownOptionError`` is also a ``ValueError`` so that
``except ValueError`` written against the documented contract keeps working.
"""

from __future__ import annotations


class FusionError(RuntimeError):
    """Base class of every error raised on purpose by ``fusion_backend``."""


class ConfigurationError(FusionError, ValueError):
    """Something the user configured is wrong: an option, a pattern name or an environment switch.
    Its message is one line naming the setting, the bad value and what is accepted.  Raised during
    ``torch.compile``'s first call, it reaches the caller as itself, not wrapped in Dynamo's
    ``BackendCompilerFailed`` (``backend.fusion`` sees to that)."""


class UnknownOptionError(ConfigurationError):
    """An option key passed to ``torch.compile(..., options=...)`` is neither ours nor Inductor's."""


class InvalidOptionError(ConfigurationError):
    """An option of ours has a value of the wrong type or outside its allowed set (an unknown pattern
    name included)."""


class UnknownPatternError(InvalidOptionError):
    """A pattern family's name that no registered family has (the ``patterns`` options, the test
    helpers, the explain command)."""


class InvalidEnvironmentError(ConfigurationError):
    """A ``FUSION_*`` environment variable holds a value outside its accepted set
    (``fusion_backend.environment``)."""


class RewriteError(FusionError):
    """A matched region could not be rewritten or compiled (raised only with ``strict=True``)."""


class KernelError(FusionError):
    """A fused kernel could not run on its inputs (raised only with ``strict=True``)."""


class UnsupportedInputError(FusionError):
    """A fused op received inputs it has no kernel for (dtype, device or layout); see the message."""
