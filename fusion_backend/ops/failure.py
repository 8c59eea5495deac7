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
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from torch import Tensor

from ..errors import KernelError, UnsupportedInputError

logger = logging.getLogger("fusion_backend.ops")

T = TypeVar("T")

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
    warn_once(key, f"{what}. Falling back to the plain-torch reference, for this call and every later call of the "
                   "same shapes, strides and dtypes (warned once per config).")


def triton_serves(op: str, why_not: str | None, strict: bool, device_type: str) -> bool:
    """Whether a call of ``fusion::{op}`` runs its Triton kernels: ``why_not`` is ``None`` when they
    serve the case, else why they do not.  Under ``strict`` on CUDA such a case raises
    ``UnsupportedInputError`` instead of running the reference (on the CPU the reference is the
    expected path)."""
    if why_not is None:
        return True
    if strict and device_type == "cuda":
        raise UnsupportedInputError(f"fusion::{op} has no Triton kernel here: {why_not}")
    return False


def op_kernel_failed(op: str, direction: str, described: str, config: str, x: Any, weight: Tensor,
                     error: Exception, strict: bool) -> None:  # fmt: skip
    """``kernel_failed`` for the ``direction`` ("forward", "backward") Triton path of ``fusion::{op}``:
    the message names the custom op (``fusion::{op}_fwd`` / ``_bwd``), the op's configuration
    (``described``) and the call's inputs (``x``: a tensor, or anything with its ``shape``, ``dtype``
    and ``device``); the warning is given once per (op, direction, config)."""
    custom_op = f"fusion::{op}_{'fwd' if direction == 'forward' else 'bwd'}"
    what = (f"fusion::{op} {direction} Triton kernel failed in {custom_op} for {described}, x {tuple(x.shape)} "
            f"weight {tuple(weight.shape)} {x.dtype} on {x.device}: {type(error).__name__}: {error}")
    kernel_failed(what, error, strict, (op, direction, config))


def triton_or_reference(serves: bool, triton: Callable[[], T], reference: Callable[[], T],
                        on_failure: Callable[[Exception], None]) -> T:  # fmt: skip
    """One direction of a fused op under the policy: ``triton()`` where the Triton path ``serves``
    the call; when it raises, ``on_failure(error)`` (the op's ``op_kernel_failed``: raise under
    ``strict``, else warn once) and then ``reference()``; ``reference()`` where it does not serve."""
    if serves:
        try:
            return triton()
        except Exception as e:  # any kernel failure takes the documented policy
            on_failure(e)
    return reference()


def check_backward_call(op: str, output_mask: Sequence[bool], num_operands: int, state: Sequence[Tensor]) -> None:
    """One-line errors for a backward op called outside its autograd formula: an ``output_mask`` of
    the wrong length, or the state of a forward that ran with ``save_for_backward=False`` (every state
    tensor an empty ``(0,)`` placeholder)."""
    if len(output_mask) != 3 + num_operands:
        raise ValueError(f"output_mask needs {3 + num_operands} entries, got {len(output_mask)}")
    if all(t.dim() == 1 and t.numel() == 0 for t in state):
        raise RuntimeError(f"fusion::{op}_bwd: the forward ran with save_for_backward=False; call {op}() (which "
                           "saves state when autograd needs it) instead of the raw op")  # fmt: skip
