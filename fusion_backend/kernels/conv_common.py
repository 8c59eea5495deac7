"""What the conv kernel packages (``conv_fused``, ``conv_dense``, ``conv_fused_bwd``, ``conv_phase_aligned_bwd``)
share: device helpers for a program's tile and the shift geometry of transposed convs, and host
helpers for their launch plans (the forward launchers' arguments and cached plans, autotuned launches,
weight prearrangement launches, the backward launchers' dtype and layout checks).

Device helpers are ``@triton.jit`` functions: Triton inlines them, so a kernel compiles exactly as if
their bodies stood at the call.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from .. import environment
from ..ir.specs import ConvSpec, PoolSpec
from .chain_math import KernelStep
from .epilogue import build_params
from .launch import FastLaunch, launch
from .plan_cache import PlanCache, plan_key

# --------------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def peel_coords(flat, W, H, D):
    """The coordinates of the flat index ``flat`` in a row-major ``(A, D, H, W)`` grid (``A``
    unbounded), peeled off innermost first: ``(w, h, d, a)`` with ``w = flat % W``, then one ``//``
    and one ``%`` per dim outwards.  Integer scalars or tensors of one shape; ``W``, ``H``, ``D``
    runtime values or constexprs.  Innermost first, the order they are computed: unpacked into
    names that a later loop carries, they keep that order among its loop-carried values."""
    w = flat % W
    rest = flat // W
    h = rest % H
    rest = rest // H
    d = rest % D
    return w, h, d, rest // D


@triton.jit
def row_channel_tile(pid_m, pid_n, M_TOTAL, C_G, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tile ``(pid_m, pid_n)`` of a grid of ``(cdiv(M_TOTAL, BLOCK_M), groups * cdiv(C_G, BLOCK_C))``
    programs: ``(m, m_ok, grp, cb)``, its ``BLOCK_M`` flat rows (``[BLOCK_M]`` int32), which of them
    are ``< M_TOTAL``, its group and its block of ``BLOCK_C`` channels among the group's ``C_G``."""
    n_blocks = tl.cdiv(C_G, BLOCK_C)
    grp = pid_n // n_blocks
    cb = pid_n % n_blocks
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return m, m < M_TOTAL, grp, cb


@triton.jit
def live_tap(num, DIL: tl.constexpr, T: tl.constexpr):
    """Along one dim of a conv with dilation ``DIL`` and ``T`` taps: the tap ``t`` with
    ``t * DIL == num`` and whether it exists (``0 <= t < T``).  The phase decomposition of a
    transposed conv asks it with ``num = kp - UP + P - S * j``: the tap linking window offset ``kp``
    (units of origin ``UP``) to input shift ``j`` (stride ``S``, padding ``P``).  ``num``: an integer
    scalar or tensor; the existence is a boolean of its shape."""
    t = num // DIL
    return t, (num >= 0) & (num % DIL == 0) & (t < T)


# --------------------------------------------------------------------------------------------------
# Forward launchers (conv_fused, conv_dense)
# --------------------------------------------------------------------------------------------------


class ForwardArgs(NamedTuple):
    """The arguments of a fused conv forward (``conv_fused_forward``, ``conv_dense_forward``) and of its
    ``forward_launch``, in their order.

    x: (N, C_in, *spatial) with 1 to 3 spatial dims, fp32/fp16/bf16, any strides.
    weight: conv ``(C_out, C_in/groups, *k)`` or transposed ``(C_in, C_out/groups, *k)``, fp32/fp16/bf16,
      any strides.
    bias: None or C_out values (any float dtype), rounded to the compute dtype and added in fp32 to
      the conv output (after it is rounded to the compute dtype) before the chain.
    steps: the chain, as for ``epilogue.epilogue_forward`` (up to MAX_SLOTS steps).
    conv: the conv hyper-parameters.  pool: None or the pool over the chain's result.
    out: preallocated result (N, C_out, *pooled or conv-output spatial), any float dtype and strides.
    saved_y0, saved_winner: None (nothing saved), or the backward state, in ``epilogue_forward``'s
      format: ``saved_y0`` the conv output without bias in the compute dtype: with a max pool its
      value at each window's winner (out's shape and strides), else all of it ((N, C_out,
      *conv-output spatial), any strides); ``saved_winner`` with a max pool the winner's index in its
      window (int8/int32, out's shape and strides), else None.
    allow_tf32: fp32 operands use TF32 tensor cores (the op layer passes whether eager's conv of the
      same tensors runs TF32, ``ops/conv_precision.forward_tf32``); ignored under the interpreter.
    compute_dtype: the conv's dtype (None: x's): x and weight are cast to it as they are loaded
      (exactly ``conv(x.to(compute_dtype), weight.to(compute_dtype))``: autocast's casts without a
      pass of their own), and the conv output is rounded to it, as it is stored in the library path.
      The saved conv output has this dtype.
    """

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    steps: Sequence[KernelStep]
    conv: ConvSpec
    pool: PoolSpec | None
    out: torch.Tensor
    saved_y0: torch.Tensor | None = None
    saved_winner: torch.Tensor | None = None
    allow_tf32: bool = False
    compute_dtype: torch.dtype | None = None

    def plan_key(self) -> tuple:
        """What a launch plan of these arguments depends on, but for the launcher module's own
        switches: shapes, strides, dtypes, devices, the geometry, the steps' op codes and operand
        counts, bias or not, precision, compute dtype, and whether launches may be timed."""
        return plan_key(
            self.x, self.weight, self.bias is None,
            tuple((int(code), len(values)) for code, values in self.steps), self.conv, self.pool,
            self.out, self.saved_y0, self.saved_winner, bool(self.allow_tf32),
            self.compute_dtype, environment.measuring(),
        )  # fmt: skip


def cached_forward_launch(args: ForwardArgs, plans: PlanCache, prepare: Callable[[ForwardArgs], Any],
                          *switches: Any) -> Any:  # fmt: skip
    """``prepare(args)`` (a forward launcher's checked launch plan), kept in ``plans`` under
    ``args.plan_key()`` and the module ``switches`` the plan also depends on; None when ``out`` is
    empty (nothing to launch; ``prepare`` still checks the arguments, raising as it does)."""
    if args.out.numel() == 0:
        prepare(args)
        return None
    return plans.get((*args.plan_key(), *switches), lambda: prepare(args))


def run_forward(plan: Any, args: ForwardArgs) -> None:
    """One fused conv forward: ``plan`` (``cached_forward_launch``'s result for ``args``; None:
    nothing to launch) launched for ``args``' tensors, with its steps' operand matrix and the bias."""
    if plan is not None:
        params = build_params(args.steps, None, plan.cout, args.x.device)
        bias = None if args.bias is None else args.bias.reshape(-1).contiguous()
        plan.run(args.x, args.weight, params, bias, args.out, args.saved_y0, args.saved_winner)


# --------------------------------------------------------------------------------------------------
# Launch plans
# --------------------------------------------------------------------------------------------------


class AutotunedLaunch:
    """One launch plan of an autotuned kernel: ``raw`` with the plan's ``constexprs`` and trailing
    integer arguments ``fixed`` (shapes and strides), launched through :class:`FastLaunch` once its
    tile is known (``tile``, a tile's constexprs and launch options: at once; None: the tile
    ``tuned``, the autotuner over ``raw``, picks on the first call).  Subclasses (or the instance)
    provide ``grid(meta)``: the grid for a tile's constexprs.  ``first_tile``: the tile the autotuner
    times first, which ``probe`` binds."""

    grid: Callable[[dict], tuple[int, ...]]

    def __init__(self, tuned: Any, raw: Any, constexprs: dict, fixed: tuple, tile: dict | None,
                 first_tile: dict | None = None) -> None:  # fmt: skip
        self.tuned, self.raw, self.constexprs, self.fixed = tuned, raw, constexprs, fixed
        self.first_tile = first_tile
        self.fast = None if tile is None else self._bind(tile)

    def _bind(self, meta: dict) -> FastLaunch:
        return FastLaunch(self.raw, self.grid(meta), {**self.constexprs, **meta}, fixed=self.fixed)

    def probe(self) -> AutotunedLaunch:
        """This plan bound to the tile the autotuner times first: one compile instead of up to
        ``MAX_TUNED_CONFIGS``, to screen the path before tuning it (``impl_choice.choose``'s
        ``probes``; the tuned plan then finds that tile compiled)."""
        probe = copy.copy(self)
        probe.fast = self._bind(self.first_tile)
        return probe

    def __call__(self, *args: Any) -> None:
        """Launch with the runtime arguments before ``fixed`` (the tensors)."""
        if self.fast is not None:
            self.fast(*args)
            return
        launched = launch(self.tuned, self.grid, *args, *self.fixed, **self.constexprs)
        best = getattr(self.tuned, "best_config", None)  # the tile of this call's key
        if launched and best is not None:
            self.fast = self._bind(best.all_kwargs())


class WeightMatrixLaunch:
    """A plan's weight prearrangement: ``(weight) -> matrix``, a new ``shape`` / ``dtype`` tensor on
    the weight's device written by one launch of ``kernel(weight, matrix, *ints, **constexprs)``
    over ``grid``."""

    def __init__(self, kernel: Any, grid: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype,
                 ints: tuple[int, ...], constexprs: dict) -> None:  # fmt: skip
        self.shape, self.dtype = shape, dtype
        self.launch = FastLaunch(kernel, grid, constexprs, fixed=ints)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        matrix = torch.empty(self.shape, dtype=self.dtype, device=weight.device)
        self.launch(weight, matrix)
        return matrix


# --------------------------------------------------------------------------------------------------
# Backward launchers (conv_fused_bwd, conv_phase_aligned_bwd)
# --------------------------------------------------------------------------------------------------

#: The dtypes the backward kernels read and write.
BACKWARD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def channels_inner(t: torch.Tensor) -> bool:
    """True when channels are ``t``'s memory-contiguous axis (channels-last; ``t`` is (N, C, *spatial)),
    so tiles put them last."""
    return t.stride(1) == 1 and t.shape[1] > 1 and math.prod(t.shape[2:]) > 1


def raise_unsupported(package: str, reason: str | None) -> None:
    """Raise ``UnsupportedInputError`` naming the kernel ``package`` when ``reason`` (a launcher's
    ``unsupported_reason``) is not None."""
    if reason is not None:
        from ..errors import UnsupportedInputError

        raise UnsupportedInputError(f"{package}: {reason} (check unsupported_reason() first)")
