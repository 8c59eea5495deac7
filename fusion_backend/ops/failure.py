"""The policy every fused op follows when its Triton kernel cannot serve a call.

The op then runs its plain-torch reference, so the user's model still computes eager's result: with
``strict=False`` (the default) the first failure of each kind is logged and warned about once
(``RuntimeWarning``: a model that silently lost its fast path should be noticed, not spam the log);
with ``strict=True`` (tests, ``fusion_backend.testing``) it raises instead: an
``UnsupportedInputError`` as it is, anything else as a ``KernelError`` that names what failed.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Hashable

from ..errors import KernelError, UnsupportedInputError

logger = logging.getLogger("fusion_backend.ops")

#: The keys already warned about in this process.
_warned: set[Hashable] = set()


def warn_once(key: Hashable, message: str) -> None:
    """Log and warn ``message`` (a ``RuntimeWarning``) the first time ``key`` is seen in this
    process; later calls with the same key say nothing."""
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def kernel_failed(what: str, error: Exception, strict: bool, key: Hashable) -> None:
    """``what`` (a sentence naming the op, its direction, configuration and inputs) failed with
    ``error``.  Under ``strict`` raise; else warn once per ``key`` and return: the caller runs the
    reference."""
    if strict:
        if isinstance(error, UnsupportedInputError):
            raise error
        raise KernelError(f"{what}. Unset strict to fall back to the plain-torch reference.") from error
    warn_once(key, f"{what}. Falling back to the plain-torch reference (warned once per config).")
