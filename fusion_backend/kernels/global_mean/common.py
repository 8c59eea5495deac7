"""What the ``conv_global_mean`` kernels' launchers share: the launch plan of one kernel (``Launch``, built once
per shape), the default warp count and how the kernels address a conv weight (``WeightLayout``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..launch import FastLaunch

NUM_WARPS = 4


@dataclass(frozen=True)
class WeightLayout:
    """How the kernels address a conv weight: element ``(ci, co, t)`` at
    ``co*s_co + ci*s_ci - (ci // cin_g)*off_g + t*s_t`` with ``t`` the row-major flattened tap."""

    tensor: torch.Tensor
    s_co: int
    s_ci: int
    s_t: int
    off_g: int
    cin_g: int
    cout_g: int
    taps: int

    @staticmethod
    def of(weight: torch.Tensor, transposed: bool, groups: int) -> WeightLayout | None:
        """``None`` when the kernel dims cannot be addressed by one flat tap stride."""
        dims = [(sz, st) for sz, st in zip(weight.shape[2:], weight.stride()[2:], strict=True) if sz != 1]
        if any(dims[i][1] != dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1)):
            return None
        s_t = dims[-1][1] if dims else 1
        taps = math.prod(weight.shape[2:])
        s0, s1 = weight.stride(0), weight.stride(1)
        if transposed:  # (C_in, C_out/g, *k)
            cin_g, cout_g = weight.shape[0] // groups, weight.shape[1]
            return WeightLayout(weight, s1, s0, s_t, cout_g * s1, cin_g, cout_g, taps)
        cout_g, cin_g = weight.shape[0] // groups, weight.shape[1]  # (C_out, C_in/g, *k)
        return WeightLayout(weight, s0, s1, s_t, cin_g * s1, cin_g, cout_g, taps)


@dataclass(frozen=True, eq=False)
class Launch:
    """The shape-dependent half of one launch (kernel, grid, integer arguments, constexprs), built once
    per shape by the ``_plan_*`` functions below.

    NOTE: at the ``seeds`` suite's sizes a training step is host-bound (``python tools/profile_step.py
    demos/seeds/convt2d_global_mean_bias_logsumexp.py --mode train`` shows the GPU time against the
    host time per step): recomputing tiles, splits and grids on every call cost more host time than
    the kernels' GPU time, so the launchers look these up in a plan cache (``plan_cache.cached_plans``)
    keyed by shapes and strides and only bind tensors per call.
    """

    kernel: Any
    grid: tuple[int, ...]
    ints: tuple[int, ...] = ()
    consts: dict[str, Any] = field(default_factory=dict)
    #: set_sums_partial only: the partial buffer's shape, its (n, c, split, j) strides and split count
    buffer_shape: tuple[int, ...] = ()
    buffer_strides: tuple[int, int, int, int] = (0, 0, 0, 0)
    nsplit: int = 1

    @functools.cached_property
    def launch(self) -> FastLaunch:
        """``kernel[grid](*args, **consts)`` through :class:`FastLaunch` (built on first use, after
        the plan builder's last edit of ``consts``)."""
        return FastLaunch(self.kernel, self.grid, self.consts)
