"""A folded upsample's transposed-conv weight in one kernel.

The arithmetic is ``ops/upsample_fold.py``'s (the definition, and the reference this kernel is tested
against): for a conv weight ``W`` ``(C_out, C_in/g, *k)`` and an upsample by ``s`` per spatial dim,

    K[g*C_in/g + ci, c, *j] = sum over r < s (per dim) of W[g*C_out/g + c, ci, *(k - 1 - j + r)]

(taps outside ``[0, k)`` are zeros), summed in fp32 and written once in the output's dtype.

WHY a kernel: a graph that runs without Inductor (``runtime/direct.py``) would launch the torch ops of
the fold one by one (a cast, a flip, per dim a padding and the sums, the transposed copy: about ten
launches), where Inductor makes one kernel of them.  A region's decision times the region on its own,
where it runs directly, so the glue must cost there what it costs inside a network: one launch.

Contract (``FoldPlan`` checks it once per signature, ``ContractError`` otherwise): ``weight`` 3-d to
5-d, floating point of at most 32 bits, any strides; the result ``(C_in, C_out/g, *(s + k - 1))`` in
the dtype asked for (fp32, fp16 or bf16), in the memory format asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .host import cdiv
from .launch import FastLaunch
from .plan_cache import ContractError, PlanCache, plan_key

#: folded taps per program (the kernel is a few gathers per tap)
BLOCK = 1024


@triton.jit
def _fold_kernel(w_ptr, k_ptr, total, c_out_group, c_in_group, k1, k2, k3, l1, l2, l3,
                 ws0, ws1, ws2, ws3, ws4, ks0, ks1, ks2, ks3, ks4,
                 S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Folded tap ``offs`` (in the logical order of K's dims) = the sum of the ``S1*S2*S3`` flipped
    weight taps that land on it; a missing spatial dim has size 1, scale 1 and stride 0."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < total
    j3 = offs % l3
    rest = offs // l3
    j2 = rest % l2
    rest = rest // l2
    j1 = rest % l1
    rest = rest // l1
    c = rest % c_out_group
    ci_t = rest // c_out_group
    co = (ci_t // c_in_group) * c_out_group + c
    base = w_ptr + co * ws0 + (ci_t % c_in_group) * ws1
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r1 in tl.static_range(S1):
        u1 = j1 - r1
        for r2 in tl.static_range(S2):
            u2 = j2 - r2
            for r3 in tl.static_range(S3):
                u3 = j3 - r3
                valid = inside & (u1 >= 0) & (u1 < k1) & (u2 >= 0) & (u2 < k2) & (u3 >= 0) & (u3 < k3)
                tap = (k1 - 1 - u1) * ws2 + (k2 - 1 - u2) * ws3 + (k3 - 1 - u3) * ws4
                acc += tl.load(base + tap, mask=valid, other=0.0).to(tl.float32)
    out = k_ptr + ci_t * ks0 + c * ks1 + j1 * ks2 + j2 * ks3 + j3 * ks4
    tl.store(out, acc.to(k_ptr.dtype.element_ty), mask=inside)


def _three(values: Sequence[int], fill: int) -> list[int]:
    return [*values, *(fill,) * (3 - len(values))]


class FoldPlan:
    """The launch for one signature (module docstring): ``plan(weight) -> K``, one kernel."""

    def __init__(self, weight: torch.Tensor, scale: Sequence[int], groups: int, dtype: torch.dtype,
                 memory_format: torch.memory_format) -> None:  # fmt: skip
        dims = weight.dim() - 2
        floats = (torch.float16, torch.bfloat16, torch.float32)
        if not 1 <= dims <= 3 or weight.dtype not in floats or dtype not in floats:
            raise ContractError(f"upsample fold: a 3-d to 5-d weight of at most 32 bits, got {tuple(weight.shape)} "
                                f"{weight.dtype}, folded into {dtype}")  # fmt: skip
        if len(scale) != dims or weight.shape[0] % groups:
            raise ContractError(f"upsample fold: scale {tuple(scale)} and groups {groups} do not fit a weight of "
                                f"shape {tuple(weight.shape)}")  # fmt: skip
        c_out, c_in_group, *kernel = weight.shape
        folded = [k + s - 1 for k, s in zip(kernel, scale, strict=True)]
        self.shape, self.dtype = (c_in_group * groups, c_out // groups, *folded), dtype
        self.memory_format = memory_format
        self.total = c_out * c_in_group * math.prod(folded)
        probe = torch.empty(self.shape, device="meta", memory_format=self.memory_format)
        self.launch = FastLaunch(_fold_kernel, (cdiv(self.total, BLOCK),), dict(
            S1=_three(scale, 1)[0], S2=_three(scale, 1)[1], S3=_three(scale, 1)[2], BLOCK=BLOCK, num_warps=4,
        ), fixed=(self.total, c_out // groups, c_in_group, *_three(kernel, 1), *_three(folded, 1),
                  *weight.stride()[:2], *_three(weight.stride()[2:], 0),
                  *probe.stride()[:2], *_three(probe.stride()[2:], 0)))  # fmt: skip

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device=weight.device, memory_format=self.memory_format)
        if self.total:
            self.launch(weight, out)
        return out


_PLANS = PlanCache()


def fold_weight(weight: torch.Tensor, scale: Sequence[int], groups: int, dtype: torch.dtype,
                memory_format: torch.memory_format) -> torch.Tensor:  # fmt: skip
    """The folded transposed-conv weight (module docstring) in ``dtype`` and ``memory_format``, through
    the plan cached for this signature; ``ContractError`` (one line) for a weight the kernel cannot take."""
    plan = _PLANS.get(plan_key(weight, tuple(scale), groups, dtype, memory_format),
                      lambda: FoldPlan(weight, scale, groups, dtype, memory_format))  # fmt: skip
    return plan(weight)
