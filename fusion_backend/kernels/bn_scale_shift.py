"""Eval-mode BatchNorm's per-channel scale and shift from its running statistics, in one kernel.

The arithmetic is ``ops/bn_fold.py``'s (the definition, and the reference this kernel is tested
against), per channel ``c`` in fp32:

    scale[c] = gamma[c] * rsqrt(running_var[c] + eps)          (gamma = 1 when absent)
    shift[c] = beta[c] - running_mean[c] * scale[c]           (beta = 0 when absent)

WHY a kernel: a graph that runs without Inductor (``runtime/direct.py``) would launch the torch ops of
that formula one by one, about eight tiny kernels in a half-precision model (a cast per tensor, the
add, the rsqrt, the products), where Inductor makes one kernel of them.  A region's decision times the
region on its own, where it runs directly, so the glue must cost there what it costs inside a
network: one launch.

Contract (checked by :class:`ScaleShiftPlan`, ``ContractError`` otherwise): ``running_mean``,
``running_var`` and the optional ``gamma`` and ``beta`` hold ``C >= 1`` values each, contiguous,
floating point of at most 32 bits, on one device; ``scale`` and ``shift`` come back as contiguous fp32
``(C,)`` tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host import cdiv
from .launch import FastLaunch
from .plan_cache import PlanCache, plan_key, require_channel_vector

#: channels per program (a few per thread: the kernel is a handful of loads and stores)
BLOCK = 512


@triton.jit
def _scale_shift_kernel(mean_ptr, var_ptr, gamma_ptr, beta_ptr, scale_ptr, shift_ptr, channels, eps,
                        HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < channels
    var = tl.load(var_ptr + offs, mask=inside, other=1.0).to(tl.float32)
    scale = tl.math.rsqrt(var + eps)
    if HAS_GAMMA:
        scale = scale * tl.load(gamma_ptr + offs, mask=inside, other=1.0).to(tl.float32)
    mean = tl.load(mean_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    shift = -(mean * scale)
    if HAS_BETA:
        shift = tl.load(beta_ptr + offs, mask=inside, other=0.0).to(tl.float32) + shift
    tl.store(scale_ptr + offs, scale, mask=inside)
    tl.store(shift_ptr + offs, shift, mask=inside)


class ScaleShiftPlan:
    """The launch for one signature (module docstring): checks the contract once, then
    ``plan(running_mean, running_var, gamma, beta) -> (scale, shift)`` launches one kernel."""

    def __init__(self, running_mean: torch.Tensor, running_var: torch.Tensor, gamma: torch.Tensor | None,
                 beta: torch.Tensor | None, eps: float) -> None:  # fmt: skip
        channels = running_var.numel()
        for name, t in (("running_mean", running_mean), ("running_var", running_var), ("gamma", gamma),
                        ("beta", beta)):  # fmt: skip
            require_channel_vector(f"batch norm scale and shift: {name} must hold {max(channels, 1)} channel values",
                                   t, max(channels, 1), running_var.device, widest=32)
        self.channels = channels
        self.launch = FastLaunch(_scale_shift_kernel, (cdiv(channels, BLOCK),), dict(
            HAS_GAMMA=gamma is not None, HAS_BETA=beta is not None, BLOCK=BLOCK, num_warps=4,
        ), fixed=(channels, float(eps)))  # fmt: skip

    def __call__(self, running_mean: torch.Tensor, running_var: torch.Tensor, gamma: torch.Tensor | None,
                 beta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        scale = torch.empty(self.channels, dtype=torch.float32, device=running_var.device)
        shift = torch.empty(self.channels, dtype=torch.float32, device=running_var.device)
        # an absent gamma or beta: any pointer (never read: its constexpr flag is off)
        self.launch(running_mean, running_var, running_var if gamma is None else gamma,
                    running_var if beta is None else beta, scale, shift)
        return scale, shift


_PLANS = PlanCache()


def scale_and_shift(running_mean: torch.Tensor, running_var: torch.Tensor, gamma: torch.Tensor | None,
                    beta: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fp32 ``(C,)`` scale and shift (module docstring) through the plan cached for this signature;
    ``ContractError`` (one line) for tensors the kernel cannot take."""
    plan = _PLANS.get(plan_key(running_mean, running_var, gamma, beta, float(eps)),
                      lambda: ScaleShiftPlan(running_mean, running_var, gamma, beta, eps))
    return plan(running_mean, running_var, gamma, beta)
