"""direct implementations of the fused ops: what a graph calls when it runs without AOTAutograd and Inductor.

WHY: a graph that holds nothing but fused ops (plus casts and views) gains nothing from AOTAutograd
and Inductor: there is nothing left for Inductor to fuse.  Yet it still pays their per-call host time:
AOTAutograd's runtime wrappers around the forward and the backward, Inductor's compiled-module call,
and the dispatcher crossings of the custom ops, and small steps are host-bound (NOTE at
``register_direct``).  So the backend runs such a graph as plain FX
code (see ``fusion_backend/runtime/direct.py``), where each fused call goes to its direct implementation: a
``torch.autograd.Function`` whose forward and backward call the op's undecorated implementations (the
same functions the custom ops and their autograd-free ops wrap), with no dispatcher layer in between.

Contract of :func:`register_direct`: ``fused`` is the public callable the rewriter puts into graphs
(e.g. ``conv_epilogue``); ``direct`` takes the same arguments and returns the same result, computed
by the same kernels, with the same gradients for every differentiable input.  A direct implementation need not
support double backward (the custom ops do not either).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: fused callable (what graphs call) -> its direct implementation
_DIRECT: dict[Callable[..., Any], Callable[..., Any]] = {}


# NOTE: measured on the H100: the training step of the ConvT3d pipeline (``convt3d_leaky_mul_leaky_maxpool``,
# 16x16x16x32x32) is host-bound, GPU work 0.93 ms, step 2.07 ms (``python tools/profile_step.py`` shows both).
def register_direct(fused: Callable[..., Any], direct: Callable[..., Any]) -> None:
    """Make ``direct`` the direct implementation of ``fused`` (see the module docstring for the contract)."""
    _DIRECT[fused] = direct


def profiled(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: while a profiler records, each call shows in its trace as a ``record_function``
    range named ``name`` (the custom op's name: a direct implementation runs no dispatcher op that a profiler
    could show); otherwise the call costs one flag check more."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not torch.autograd.profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return call

    return wrap


def direct_impl(fused: Any) -> Callable[..., Any] | None:
    """The direct implementation of ``fused``, or ``None`` when it has none (or is not hashable)."""
    try:
        return _DIRECT.get(fused)
    except TypeError:
        return None


def records_backward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     operands: Sequence[torch.Tensor]) -> bool:
    """Whether a fused conv op called on these inputs now must record its backward: grad mode is on
    and some input requires grad (else a direct implementation runs the forward alone and saves nothing)."""
    return torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        or any(t.requires_grad for t in operands)
    )
