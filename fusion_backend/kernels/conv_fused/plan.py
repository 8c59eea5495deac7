"""Host side of the fused conv forward (``kernels/conv_fused``): conv geometry and the output-size
arithmetic's use, which cases are served, the per-call plan, the tiles and their autotuning, the
PHASE_ALIGNED weight matrix and the launch plans."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton

from ... import environment
from ...ir.shapes import conv_output_length
from ...ir.specs import ConvSpec, PoolSpec
from ..chain_math import MAX_WINDOW_VOLUME, op_constexprs
from ..conv_common import AutotunedLaunch, ForwardArgs, WeightMatrixLaunch, cached_forward_launch, run_forward
from ..host import INTERPRETER, best_first, cdiv, lift_5d, next_pow2, tile_bench
from ..plan_cache import PlanCache
from ..relayout import PlannedRelayout
from ..tf32 import compute_code, dot_precision
from .device import conv_fused_fwd_kernel, phase_aligned_weight_kernel

#: Largest number of (window offset, tap) pairs the kernel unrolls (compile time and code size grow
#: with it).  The ConvT3d pipeline: 27 effective pairs (8 phases x 1..8 taps); a 3x3x3 conv under a
#: 2x2x2 pool: 216.
MAX_UNROLLED_TAPS = 256
_INT32_LIMIT = 2**31 - 1
#: Tensors with more elements than this get int64 index math (BIG); a module constant so that tests
#: can exercise that path on small tensors.
_BIG_INDEX_THRESHOLD = _INT32_LIMIT
_INTERPRET = INTERPRETER  # kernels/host.py: whether Triton's interpreter is on
#: Environment variable: "0" launches one heuristic tile instead of autotuning (CUDA).
AUTOTUNE_ENV = environment.CONV_AUTOTUNE
#: Problems below this many multiply-adds (live taps only) take the heuristic tile: autotuning
#: compiles every config once per shape key, not worth it for small convs (and GPU tests).
_AUTOTUNE_MIN_MACS = 2**28
#: Most input-shift slots (distinct shifts rounded up to a power of 2) of the phase-aligned path: its
#: X tile is ``[BLOCK_M, slots * PHASE_ALIGNED_BLOCK_K]`` (the ConvT3d pipeline: 8 slots, K = 128).
_PHASE_ALIGNED_MAX_SLOTS = 8
#: The phase-aligned path's channel block (every tile of ``_PHASE_ALIGNED_TILES``): inputs with at most this
#: many channels per group (the ConvT3d pipeline: 16) load their X tile once for all window offsets.
PHASE_ALIGNED_BLOCK_K = 16


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the launch needs that is derived from shapes and geometry (all lifted to 3d)."""

    conv_out: tuple[int, int, int]  # OD, OH, OW
    units: tuple[int, int, int]  # UD, UH, UW
    window: tuple[int, int, int]  # KD, KH, KW (window offsets per unit)
    unit_stride: tuple[int, int, int]
    unit_origin: tuple[int, int, int]
    static_phase: tuple[bool, bool, bool]
    unrolled: int  # (window offset, tap) pairs the kernel unrolls
    phase_aligned: bool  # the kernel's phase-aligned path (static phase along every dim, few input shifts)
    shifts: tuple[tuple[int, int], ...]  # per dim (lowest input shift, number of shifts) for PHASE_ALIGNED
    shift_slots: int  # PHASE_ALIGNED: the number of distinct input shifts rounded up to a power of 2


def _output_channels_innermost(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``weight`` with the same shape, stored with the output-channel dim innermost (stride 1).

    WHY: every weight tile is ``[K rows, BLOCK_N output channels]``; with the output channel
    contiguous a warp reads whole rows (coalesced, vectorised).  In PyTorch's layouts it is strided
    by C_in/groups x taps (conv) or taps (transposed): 27 lines per warp load on the ConvT3d pipeline.
    The copy is one small kernel (the weight is tiny next to the activations).
    """
    co_dim = 1 if transposed else 0
    if weight.stride(co_dim) == 1 or weight.shape[co_dim] == 1:
        return weight
    return weight.movedim(co_dim, -1).contiguous().movedim(-1, co_dim)


def _pad3(values: Sequence[int], fill: int) -> list[int]:
    return [fill] * (3 - len(values)) + list(values)


def conv_output_size(x: torch.Tensor, weight: torch.Tensor, conv: ConvSpec) -> list[int]:
    """Spatial sizes of ``aten.convolution(x, weight, ...)``'s output (not lifted)."""
    sizes = []
    for j, size in enumerate(x.shape[2:]):
        sizes.append(conv_output_length(size, weight.shape[2 + j], conv.stride[j], conv.padding[j], conv.dilation[j],
                                        conv.transposed, conv.output_padding[j]))
    return sizes


def launch_plan(x: torch.Tensor, weight: torch.Tensor, conv: ConvSpec, pool: PoolSpec | None,
          pooled_sizes: Sequence[int] | None) -> LaunchPlan:  # fmt: skip
    dims = x.dim() - 2
    conv_out = _pad3(conv_output_size(x, weight, conv), 1)
    taps = _pad3(weight.shape[2:], 1)
    stride, padding, dilation = _pad3(conv.stride, 1), _pad3(conv.padding, 0), _pad3(conv.dilation, 1)
    if pool is not None:
        units = _pad3(pooled_sizes, 1)
        window, ustride, uorigin = _pad3(pool.kernel_size, 1), _pad3(pool.stride, 1), _pad3(pool.padding, 0)
    elif conv.transposed:
        units = [-(-o // s) for o, s in zip(conv_out, stride, strict=True)]
        window, ustride, uorigin = list(stride), list(stride), [0, 0, 0]
    else:
        units, window, ustride, uorigin = list(conv_out), [1, 1, 1], [1, 1, 1], [0, 0, 0]
    static = [conv.transposed and us % s == 0 for us, s in zip(ustride, stride, strict=True)]
    unrolled = 1
    shifts = []
    for j in range(3):
        if static[j]:
            # Input shift of every live (window offset, tap) pair: i = u * (US // S) + shift.
            live = [
                (kp - uorigin[j] + padding[j] - t * dilation[j]) // stride[j]
                for kp in range(window[j]) for t in range(taps[j])
                if (kp - uorigin[j] + padding[j] - t * dilation[j]) % stride[j] == 0
            ]  # fmt: skip
            unrolled *= len(live)
            shifts.append((min(live), max(live) - min(live) + 1) if live else (0, 0))
        else:
            unrolled *= window[j] * taps[j]
            shifts.append((0, 0))
    slots = next_pow2(math.prod(n for _, n in shifts)) if all(static) else 0
    phase_aligned = all(static) and 0 < slots <= _PHASE_ALIGNED_MAX_SLOTS
    del dims
    return LaunchPlan(tuple(conv_out), tuple(units), tuple(window), tuple(ustride), tuple(uorigin),
                 tuple(static), unrolled, phase_aligned, tuple(shifts), slots)  # fmt: skip


def full_windows(plan: LaunchPlan) -> bool:
    """Whether every window offset of every unit lies in the conv output (``o = u * US - UP + kp`` in
    ``[0, O)`` for all ``u < U``, ``kp < K``): the ConvT3d pipeline's MaxPool(2) over an even conv
    output."""
    return all(
        up == 0 and (u - 1) * us + k <= o
        for o, u, k, us, up in zip(plan.conv_out, plan.units, plan.window, plan.unit_stride, plan.unit_origin,
                                   strict=True)
    )  # fmt: skip


def unsupported_reason(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv: ConvSpec,
    pool: PoolSpec | None,
    pooled_sizes: Sequence[int] | None = None,
    save: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> str | None:
    """Why ``conv_fused_forward`` cannot serve this case, or None when it can.

    ``pooled_sizes``: the pool's output spatial sizes (required with a pool: ceil_mode is not part
    of ``PoolSpec``).  ``save``: whether the backward state will be written (an avg pool or no
    pool then stores the full conv output, which needs every element covered by some window).
    ``compute_dtype``: the conv's dtype (None: x's), see ``conv_fused_forward``.
    """
    kernel_dtypes = (
        (torch.float32, torch.float16) if _INTERPRET else (torch.float32, torch.float16, torch.bfloat16)
    )
    compute_dtype = compute_dtype or x.dtype
    if any(dtype not in kernel_dtypes for dtype in (x.dtype, weight.dtype, compute_dtype)):
        return (f"x/weight/compute dtypes {x.dtype}/{weight.dtype}/{compute_dtype}: the fused conv covers "
                f"{kernel_dtypes}")  # fmt: skip
    if not 3 <= x.dim() <= 5 or weight.dim() != x.dim():
        return f"x {tuple(x.shape)} / weight {tuple(weight.shape)}: only 1d/2d/3d convolutions"
    if pool is not None and pooled_sizes is None:
        return "pooled_sizes is required with a pool"
    if pool is not None and pool.window_volume > MAX_WINDOW_VOLUME:
        return f"pool window of {pool.window_volume} taps exceeds the unroll limit {MAX_WINDOW_VOLUME}"
    plan = launch_plan(x, weight, conv, pool, pooled_sizes)
    if math.prod(plan.window) > MAX_WINDOW_VOLUME:
        return f"{math.prod(plan.window)} phases/window offsets exceed the unroll limit {MAX_WINDOW_VOLUME}"
    if plan.unrolled > MAX_UNROLLED_TAPS:
        return f"{plan.unrolled} (window offset, tap) pairs exceed the unroll limit {MAX_UNROLLED_TAPS}"
    if min(plan.conv_out) <= 0:
        return f"empty conv output {plan.conv_out}"
    groups = conv.groups
    if groups > 65535:
        return f"{groups} groups exceed the grid's second dimension"
    if pool is not None and save and pool.kind == "avg":
        for o, u, k, s, p in zip(
            plan.conv_out, plan.units, plan.window, plan.unit_stride, plan.unit_origin, strict=True
        ):
            if s > k or (u - 1) * s - p + k < o:
                return "avg pool with saved state: some conv-output elements lie in no pool window"
    n = x.shape[0]
    if n * math.prod(plan.units) > _INT32_LIMIT:
        return f"{n * math.prod(plan.units)} tile units exceed int32"
    cout = weight.shape[1] * groups if conv.transposed else weight.shape[0]
    per_sample = max(x[0].numel(), cout * math.prod(plan.conv_out))
    if per_sample > _INT32_LIMIT:
        return f"one sample spans {per_sample} elements (> 2**31 - 1): not handled"
    return None


#: Tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the general paths.
_GENERAL_TILES = (
    # narrow problems (C_in 16, C_out 32; taps unrolled, so stages matter little)
    (128, 32, 16, 4, 2), (64, 32, 16, 4, 2), (256, 32, 16, 8, 2), (64, 32, 16, 2, 2), (128, 16, 16, 4, 2),
    # wide problems (Conv2d 64->64 k3: C_in = C_out = 64, one pipelined K loop of 9 taps x channel
    # blocks)
    (128, 64, 32, 4, 3), (128, 64, 32, 8, 4), (64, 64, 32, 4, 4), (256, 64, 32, 8, 3),
    (128, 64, 64, 8, 3), (128, 128, 32, 8, 3), (64, 128, 32, 4, 3),
)  # fmt: skip
#: Tiles of the phase-aligned path (the ConvT3d pipeline), all with BLOCK_K = PHASE_ALIGNED_BLOCK_K.  NOTE: one
#: accumulator lives at a time; the X tile (ConvT3d pipeline fp32 at BLOCK_M 128: 64 KB) stays in
#: shared memory for all window offsets.  With one channel block, two stages let Triton prefetch the
#: next offset's slice of the prearranged weight matrix (``cp.async`` into a double buffer; ConvT3d
#: pipeline fp32 M128 N32 8 warps: 205 registers, 96 KB shared, no spills); with several blocks they
#: pipeline the K loop.
_PHASE_ALIGNED_TILES = (
    (64, 32, 16, 4, 1), (128, 32, 16, 4, 1), (128, 32, 16, 8, 1), (256, 32, 16, 8, 1),
    (64, 64, 16, 4, 1), (128, 64, 16, 8, 1), (128, 16, 16, 4, 1),
    (64, 32, 16, 4, 2), (128, 32, 16, 8, 2), (128, 64, 16, 8, 2),
)  # fmt: skip


def _tile(cfg: triton.Config) -> tuple[int, int, int, int, int]:
    kw = cfg.kwargs
    return kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], cfg.num_warps, cfg.num_stages


def _configs() -> list[triton.Config]:
    """Autotuning space on CUDA: both paths' tiles (``_prune`` keeps the path's own, per shape)."""
    configs = []
    for bm, bn, bk, warps, stages in dict.fromkeys(_GENERAL_TILES + _PHASE_ALIGNED_TILES):
        configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps,
                                     num_stages=stages))  # fmt: skip
    return configs


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Keep the tiles of the launched path (``PHASE_ALIGNED`` or not); drop tiles much wider than the
    problem (masked lanes cost full MMA work)."""
    phase_aligned = kwargs.get("PHASE_ALIGNED", False)
    tiles = set(_PHASE_ALIGNED_TILES if phase_aligned else _GENERAL_TILES)
    configs = [c for c in configs if _tile(c) in tiles] or configs
    if phase_aligned and not kwargs["ONE_CBLOCK"]:  # several channel blocks: a K loop, which needs two stages
        configs = [c for c in configs if c.num_stages > 1] or configs
    if phase_aligned and kwargs["ONE_CBLOCK"] and kwargs.get("CDT", 0) == 0:
        # fp32 shared X tile at 32+ rows per warp (4 warps, BLOCK_M >= 128): ptxas spills (the ConvT3d
        # pipeline, sm_90: 8-932 bytes; tools/compile_check.py conv_fused --tiles M,N,K,4,S shows it); M256
        # with 8 warps does not.
        configs = [c for c in configs if not (c.num_warps == 4 and c.kwargs["BLOCK_M"] >= 128)] or configs
    bn_max = max(16, next_pow2(int(named_args["COUT_G"])))
    bk_max = PHASE_ALIGNED_BLOCK_K if phase_aligned else max(16, next_pow2(int(named_args["CIN_G"])))
    kept = [c for c in configs if c.kwargs["BLOCK_N"] <= bn_max and c.kwargs["BLOCK_K"] <= bk_max]
    kept = kept or [min(configs, key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]
    # the heuristic tile first, then the others in list order
    h = _heuristic_config(int(named_args["CIN_G"]), int(named_args["COUT_G"]), int(named_args["M_TOTAL"]), phase_aligned)
    preferred = (h["BLOCK_M"], h["BLOCK_N"], h["BLOCK_K"], h.get("num_warps"), h.get("num_stages"))
    return best_first(sorted(kept, key=lambda c: _tile(c) != preferred))


_conv_fused_fwd_tuned = triton.autotune(
    configs=_configs(),
    # the path constexprs are in the key: two geometries with equal sizes must not share a tile
    key=["CIN_G", "COUT_G", "M_TOTAL", "C_OUT", "TRANSPOSED", "FLAT_K", "PHASE_ALIGNED", "KS", "KD", "KH", "KW", "CDT"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=tile_bench,
    cache_results=True,  # the best tile per key is kept in Triton's cache dir across processes
)(conv_fused_fwd_kernel)


def _heuristic_config(cin_g: int, cout_g: int, m_total: int, phase_aligned: bool = False) -> dict[str, int]:
    """One tile for the interpreter (small blocks: numpy cost grows with tile size) or when
    ``FUSION_CONV_AUTOTUNE=0``."""
    block_n = min(max(16, next_pow2(cout_g)), 64)
    block_k = PHASE_ALIGNED_BLOCK_K if phase_aligned else min(max(16, next_pow2(cin_g)), 32)
    if _INTERPRET:
        block_m = min(max(16, next_pow2(m_total)), 64)
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    if phase_aligned:  # see _PHASE_ALIGNED_TILES
        return dict(BLOCK_M=128, BLOCK_N=min(block_n, 32), BLOCK_K=block_k, num_warps=8, num_stages=2)
    return dict(
        BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4 if block_n <= 32 else 8, num_stages=3
    )


class _Launch(AutotunedLaunch):
    """One launch plan of ``conv_fused_fwd_kernel``: an ``AutotunedLaunch`` (the heuristic tile
    bound at once, or the autotuner's pick on the first call; ``first_tile``: ``_prune``'s first)
    with the weight it reads."""

    def __init__(self, ints: tuple[int, ...], constexprs: dict, m_total: int, groups: int, cout_g: int,
                 cout: int, cfg: dict | None, weight_matrix: WeightMatrixLaunch | None,
                 first_tile: dict) -> None:  # fmt: skip
        self.cout = cout
        self.transposed = bool(constexprs["TRANSPOSED"])
        self.m_total, self.groups, self.cout_g = m_total, groups, cout_g
        #: None: the kernel reads the weight with its output channels innermost (``_output_channels_innermost``).
        self.weight_matrix = weight_matrix
        #: that copy of the weight, planned on the first call that needs one (``_relaid_weight``)
        self._weight_relayout: PlannedRelayout | None = None
        super().__init__(_conv_fused_fwd_tuned, conv_fused_fwd_kernel, constexprs, ints, cfg, first_tile)

    def grid(self, meta: dict) -> tuple[int, int]:
        return (cdiv(self.m_total, meta["BLOCK_M"]), self.groups * cdiv(self.cout_g, meta["BLOCK_N"]))

    def run(self, x: torch.Tensor, weight: torch.Tensor, params: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor, saved_y0: torch.Tensor | None, saved_winner: torch.Tensor | None) -> None:  # fmt: skip
        """Launch for tensors like the ones this plan was made for (``conv_fused_forward``'s
        arguments; ``params``: ``build_params`` of its steps; ``bias``: None or its C values, contiguous)."""
        if self.weight_matrix is not None:
            w, wm = weight, self.weight_matrix(weight)
        else:
            w = wm = self._relaid_weight(weight)
        self(x, w, wm, params, params if bias is None else bias, out, saved_y0 if saved_y0 is not None else out,
             saved_winner if saved_winner is not None else out)  # fmt: skip


    def _relaid_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``_output_channels_innermost(weight)``, copied by a ``PlannedRelayout`` made on the first
        copy (the plan's weight layout is fixed; a movedim + contiguous + movedim per call cost three
        torch calls of host time)."""
        co_dim = 1 if self.transposed else 0
        if weight.stride(co_dim) == 1 or weight.shape[co_dim] == 1:
            return weight
        if self._weight_relayout is None:
            meta = torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype, device="meta")
            relaid = _output_channels_innermost(meta, self.transposed)
            self._weight_relayout = PlannedRelayout(weight, tuple(relaid.shape), relaid.stride(), relaid.dtype)
        return self._weight_relayout(weight)


def phase_aligned_weight_matrix(weight: torch.Tensor, plan: LaunchPlan, conv: ConvSpec, precision: str,
                                dtype: torch.dtype) -> WeightMatrixLaunch:  # fmt: skip
    """The launch that writes the phase-aligned path's prearranged weight matrix of a transposed conv.

    Matrix: ``(groups, KD * KH * KW, COUT_G, KS * PHASE_ALIGNED_BLOCK_K)``, ``dtype`` (the compute dtype:
    an fp32 weight under autocast is cast here, for free), contiguous.  Row ``(s, c)`` of window offset ``kk`` holds ``w[group's input channel c, co, tap]``
    for the tap that carries input shift ``s`` to offset ``kk``, and 0 for a dead (offset, shift)
    pair, a padding shift slot or ``c >= CIN_G``; fp32 values are rounded to TF32 with
    ``precision == "tf32"`` (``kernels.tf32``).
    K (the row) innermost: fp32 (TF32) wgmma wants B K-major in shared memory, so an output-channel-
    innermost matrix was stored there element by element (16 STS.32 per thread and offset on the
    ConvT3d pipeline, fp32 M128 N32 w8); K-contiguous rows give 4 LDG.128 + 4 STS.128.
    WHY: the main kernel's per-offset weight tile is then one contiguous, unmasked load that feeds
    the dot directly (no per-row tap arithmetic, no rounding per program, and Triton can pipeline
    it); one small launch per call replaces the weight relayout copy it made before.
    """
    groups = conv.groups
    cin_g, cout_g = weight.shape[0] // groups, weight.shape[1]
    offsets = math.prod(plan.window)
    rows = plan.shift_slots * PHASE_ALIGNED_BLOCK_K
    block_n = min(max(16, next_pow2(cout_g)), 64)
    taps = _pad3(weight.shape[2:], 1)
    stride, padding, dilation = _pad3(conv.stride, 1), _pad3(conv.padding, 0), _pad3(conv.dilation, 1)
    w_str = weight.stride()
    constexprs = dict(
        TAPS=tuple(taps), STRIDE=tuple(stride), PAD=tuple(padding), DIL=tuple(dilation), WINDOW=plan.window,
        UORIGIN=plan.unit_origin, LO=tuple(lo for lo, _ in plan.shifts), NS=tuple(ns for _, ns in plan.shifts),
        KS=plan.shift_slots, PRECISION=precision, BLOCK_K=PHASE_ALIGNED_BLOCK_K, BLOCK_N=block_n,
    )  # fmt: skip
    ints = (cin_g, cout_g, w_str[0], w_str[1], *_pad3(w_str[2:], 0))
    grid = (offsets, groups * cdiv(cout_g, block_n))
    return WeightMatrixLaunch(phase_aligned_weight_kernel, grid, (groups, offsets, cout_g, rows), dtype, ints,
                              constexprs)  # fmt: skip


#: Launch plans by ``_launch_key``.
_LAUNCHES = PlanCache()


def _prepare(args: ForwardArgs) -> _Launch:
    """Validate a call (its compute dtype resolved) and derive its launch (everything but the
    tensors' data); see ``conv_fused_forward``.  Depends only on ``args.plan_key()`` and the module
    switches ``forward_launch`` keys the plan by."""
    x, weight, bias, steps, conv, pool, out, saved_y0, saved_winner, allow_tf32, compute_dtype = args
    is_max = pool is not None and pool.kind == "max"
    save = saved_y0 is not None
    if is_max and save != (saved_winner is not None):
        raise ValueError("a max pool saves both saved_y0 (the value at the winner) and saved_winner, or neither")
    if not is_max and saved_winner is not None:
        raise ValueError("saved_winner is only written with a max pool")
    pooled_sizes = list(out.shape[2:]) if pool is not None else None
    why = unsupported_reason(x, weight, conv, pool, pooled_sizes, save, compute_dtype)
    if why is not None:
        raise ValueError(f"conv_fused_forward cannot run this case: {why}")
    plan = launch_plan(x, weight, conv, pool, pooled_sizes)
    dims = x.dim() - 2
    n, groups = x.shape[0], conv.groups
    cin_g = x.shape[1] // groups
    cout_g = weight.shape[1] if conv.transposed else weight.shape[0] // groups
    cout = cout_g * groups
    conv_out_shape = [n, cout, *plan.conv_out[3 - dims :]]
    expected_out = conv_out_shape if pool is None else [n, cout, *pooled_sizes]
    if list(out.shape) != expected_out:
        raise ValueError(f"out must have shape {expected_out}, got {tuple(out.shape)}")
    if is_max and save:
        for name, t in (("saved_y0", saved_y0), ("saved_winner", saved_winner)):
            if t.shape != out.shape or t.stride() != out.stride():
                raise ValueError(f"{name} must have out's shape and strides {tuple(out.shape)}/{out.stride()}, "
                                 f"got {tuple(t.shape)}/{t.stride()}")  # fmt: skip
        if saved_winner.dtype not in (torch.int8, torch.int32):
            raise ValueError(f"the winner index must be int8 or int32, got {saved_winner.dtype}")
    elif save and list(saved_y0.shape) != conv_out_shape:
        raise ValueError(
            f"saved_y0 must have the conv output's shape {conv_out_shape}, got {tuple(saved_y0.shape)}"
        )
    x_strides = lift_5d(x)[1]
    o_strides = lift_5d(out)[1]
    y_strides = lift_5d(saved_y0)[1] if save and not is_max else [0] * 5
    precision = dot_precision(compute_dtype, allow_tf32, _INTERPRET)
    one_cblock = cin_g <= PHASE_ALIGNED_BLOCK_K
    # PHASE_ALIGNED with one channel block reads the prearranged matrix; its masked variant (tiles with
    # inf/NaN only) reads the weight as it is.  Every other path reads the relaid weight.
    weight_matrix = None
    if plan.phase_aligned and one_cblock:
        weight_matrix = phase_aligned_weight_matrix(weight, plan, conv, precision, compute_dtype)
        w_str = list(weight.stride())
    else:  # the strides of the weight as launched (a copy only on this cache miss; exact for any layout)
        w_str = list(_output_channels_innermost(weight, conv.transposed).stride())
    w_sci, w_sco = (w_str[0], w_str[1]) if conv.transposed else (w_str[1], w_str[0])
    w_taps = _pad3(w_str[2:], 0)
    m_total = n * math.prod(plan.units)
    big = any(t.numel() > _BIG_INDEX_THRESHOLD for t in (x, out, saved_y0, saved_winner) if t is not None)
    if pool is None:
        pool_args = dict(COUNT_INCLUDE_PAD=True, DIVISOR=0)
    else:
        pool_args = dict(
            COUNT_INCLUDE_PAD=bool(pool.count_include_pad), DIVISOR=int(pool.divisor_override or 0)
        )
    taps = _pad3(weight.shape[2:], 1)
    stride, padding, dilation = _pad3(conv.stride, 1), _pad3(conv.padding, 0), _pad3(conv.dilation, 1)
    ints = (
        cout, cin_g, cout_g, m_total,
        *_pad3(x.shape[2:], 1), *plan.conv_out, *plan.units,
        *x_strides, w_sci, w_sco, *w_taps, *o_strides, *y_strides,
    )  # fmt: skip
    constexprs = dict(
        **op_constexprs(steps), HAS_BIAS=bias is not None,
        POOL=0 if pool is None else (1 if is_max else 2), SAVE=save, TRANSPOSED=bool(conv.transposed),
        TD=taps[0], TH=taps[1], TW=taps[2], SD=stride[0], SH=stride[1], SW=stride[2],
        PD=padding[0], PH=padding[1], PW=padding[2], DD=dilation[0], DH=dilation[1], DW=dilation[2],
        KD=plan.window[0], KH=plan.window[1], KW=plan.window[2],
        USD=plan.unit_stride[0], USH=plan.unit_stride[1], USW=plan.unit_stride[2],
        UPD=plan.unit_origin[0], UPH=plan.unit_origin[1], UPW=plan.unit_origin[2],
        STATIC_D=plan.static_phase[0], STATIC_H=plan.static_phase[1], STATIC_W=plan.static_phase[2],
        **pool_args, CDT=compute_code(compute_dtype), PRECISION=precision, BIG=big, FLAT_K=not any(plan.static_phase), PHASE_ALIGNED=plan.phase_aligned,
        ONE_CBLOCK=one_cblock, KS=max(plan.shift_slots, 1), FULL_WINDOWS=full_windows(plan),
        LOD=plan.shifts[0][0], LOH=plan.shifts[1][0], LOW=plan.shifts[2][0],
        NSD=plan.shifts[0][1], NSH=plan.shifts[1][1], NSW=plan.shifts[2][1],
    )  # fmt: skip
    macs = m_total * cout_g * cin_g * plan.unrolled
    tuned = not (_INTERPRET or not environment.measuring() or macs < _AUTOTUNE_MIN_MACS)
    if tuned:
        first = _prune(_configs(), {"CIN_G": cin_g, "COUT_G": cout_g, "M_TOTAL": m_total}, **constexprs)[0]
        first_tile = dict(first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)
    else:
        first_tile = _heuristic_config(cin_g, cout_g, m_total, plan.phase_aligned)
    return _Launch(ints, constexprs, m_total, groups, cout_g, cout, None if tuned else first_tile, weight_matrix,
                   first_tile)


def conv_fused_forward(*args: Any, **kwargs: Any) -> None:
    """Write ``out = pool(chain(conv(x, weight) + bias))`` (and the backward state) in one launch.

    Arguments: ``ForwardArgs`` (x, weight, bias, steps, conv, pool, out, saved_y0=None,
    saved_winner=None, allow_tf32=False, compute_dtype=None).
    Raises ValueError when ``unsupported_reason`` names a reason or the tensors disagree.
    """
    args = ForwardArgs(*args, **kwargs)
    run_forward(forward_launch(*args), args)


def forward_launch(*args: Any, **kwargs: Any) -> _Launch | None:
    """The checked launch plan of ``conv_fused_forward`` for these arguments (``ForwardArgs``; cached
    per shapes, strides, dtypes, geometry, op codes and precision), or None when ``out`` is empty
    (nothing to launch; the arguments are still checked).  Its ``run(x, weight, params, out,
    saved_y0, saved_winner)`` launches for tensors laid out like these: a caller that keeps it (a
    per-signature call plan) skips the cache lookup.  Raises ValueError as ``conv_fused_forward``
    does."""
    args = ForwardArgs(*args, **kwargs)
    args = args._replace(compute_dtype=args.compute_dtype or args.x.dtype)
    return cached_forward_launch(args, _LAUNCHES, _prepare, _BIG_INDEX_THRESHOLD)
