"""Host side of the phase-aligned backward (``kernels/conv_phase_aligned_bwd``): which cases it serves, the tiles and
their autotuning, the geometry and the host-built tables, and the launch plans."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton

from ... import environment
from ..conv_common import BACKWARD_DTYPES, AutotunedLaunch, channels_inner, raise_unsupported
from ..conv_fused_bwd.plan import (
    Grad,
    PooledGrad,
    conv_arguments_reason,
    conv_bias_grad,
    conv_output_spatial,
    device_reason,
    pooled_spatial,
)
from ..host import (
    INTERPRETER,
    best_first,
    cdiv,
    element_extent,
    lift3,
    lift_5d,
    next_pow2,
    persistent_device_copies,
    tile_bench,
)
from ..launch import FastLaunch
from ..plan_cache import PlanCache
from ..tf32 import backward_dot_precision, compute_code
from .device import (
    MAX_WINDOW_VOLUME,
    TABLE_HEADER,
    phase_aligned_dgrad_kernel,
    phase_aligned_wgrad_finish_kernel,
    phase_aligned_wgrad_kernel,
)

#: Most distinct input shifts (rounded up to a power of 2): the weight-grad X tile is
#: ``[slots * BLOCK_CI, BLOCK_M]`` and its accumulator ``slots * BLOCK_CI`` rows.
MAX_PHASE_ALIGNED_SLOTS = 8
#: Offsets of every tensor (and of its masked neighbours) stay int32: tensors may span at most
#: half the int32 range (room for the masked out-of-range offsets of shifted loads).
_INDEX_LIMIT = 2**30


# --------------------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------------------

#: Input-grad tiles (BLOCK_M, BLOCK_CI, BLOCK_CO, KPB, num_warps, num_stages), best first for the
#: ConvT3d pipeline (the heuristic takes the first that fits).  KPB = 1 skips every dead (offset,
#: shift) pair (there: 27 of 64 blocks run) and measured fastest; KPB 4 was 5-8x slower (H200,
#: Triton 3.6).
#: NOTE: registers for the ConvT3d pipeline on the H200 (Triton 3.6, the compiled kernel's n_regs):
#: 96-168, no spills; Triton 3.9's ptxas numbers (``tools/compile_check.py conv_phase_aligned_bwd``) run lower.
DGRAD_TILES = (
    (128, 16, 32, 1, 4, 2), (64, 16, 32, 1, 4, 2), (128, 16, 32, 1, 8, 1), (128, 16, 32, 1, 8, 2),
    (128, 16, 32, 2, 8, 2), (128, 32, 32, 1, 4, 2), (128, 64, 32, 1, 8, 2),
)  # fmt: skip
#: Weight-grad tiles (BLOCK_M, BLOCK_CI, BLOCK_CO, KPB, num_warps, num_stages), best first for the
#: ConvT3d pipeline; the accumulator is ``[BLOCK_CO * KPB, KS * BLOCK_CI]`` (there: KS = 8, 128
#: columns).
#: NOTE: BLOCK_CO * KPB >= 64 keeps wgmma (32 rows fell back to mma.sync).  On the H200 (Triton 3.6)
#: these run 0.42-0.63 ms for the ConvT3d pipeline at 220-250 registers without spills; the 4-warp
#: tiles of 32 x 32/16 channel rows were as fast but spilled (42-50 bytes), BLOCK_M 64 at 4 warps
#: spilled ~100 bytes, and every 2-stage tile was slower than its 1-stage counterpart.
WGRAD_TILES = (
    (16, 16, 32, 2, 4, 1), (16, 16, 16, 4, 4, 1), (32, 16, 32, 4, 8, 1), (64, 16, 32, 2, 8, 1),
    (16, 16, 32, 4, 8, 1),
)  # fmt: skip
#: Weight-grad programs launched per SM (the unit rows are split to reach about this many).
_WGRAD_PROGRAMS_PER_SM = 2
#: The finish kernel's tile.
_FINISH_BLOCK = 32


def _tile_config(tile: tuple[int, ...]) -> triton.Config:
    bm, bci, bco, kpb, warps, stages = tile
    return triton.Config(
        dict(BLOCK_M=bm, BLOCK_CI=bci, BLOCK_CO=bco, KPB=kpb), num_warps=warps, num_stages=stages
    )


def fit_tiles(tiles: Sequence[tuple[int, ...]], ci_g: int, co_g: int, kpn: int) -> list[tuple[int, ...]]:
    """``tiles`` clamped to the problem (masked lanes cost full MMA work), duplicates dropped, order kept.

    Every block stays a power of 2 with the channel blocks >= 16, so each dot keeps K >= 16."""
    ci_max, co_max, kp_max = max(16, next_pow2(ci_g)), max(16, next_pow2(co_g)), next_pow2(kpn)
    clamped = [
        (bm, min(bci, ci_max), min(bco, co_max), min(kpb, kp_max), w, st)
        for bm, bci, bco, kpb, w, st in tiles
    ]
    return list(dict.fromkeys(clamped))


def _pruner(tiles: Sequence[tuple[int, ...]]):
    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        kpn = kwargs["KD"] * kwargs["KH"] * kwargs["KW"]
        return best_first([_tile_config(t) for t in fit_tiles(tiles, int(named_args["CI_G"]), int(named_args["CO_G"]), kpn)])

    return prune


_dgrad_tuned = triton.autotune(
    configs=[_tile_config(t) for t in DGRAD_TILES],
    key=["M_TOTAL", "CI_G", "CO_G", "KD", "KH", "KW", "STRIDE", "TAPS", "G_CL", "X_CL", "CDT", "PREC"],
    prune_configs_by={"early_config_prune": _pruner(DGRAD_TILES)},
    do_bench=tile_bench,
    cache_results=True,  # the best tile per key is kept in Triton's cache dir across processes
)(phase_aligned_dgrad_kernel)
_wgrad_tuned = triton.autotune(
    configs=[_tile_config(t) for t in WGRAD_TILES],
    key=["M_TOTAL", "CI_G", "CO_G", "ROWS_PER_SPLIT", "KD", "KH", "KW", "KS", "X_CL", "G_CL", "CDT", "PREC"],
    prune_configs_by={"early_config_prune": _pruner(WGRAD_TILES)},
    do_bench=tile_bench,
    cache_results=True,
)(phase_aligned_wgrad_kernel)


def heuristic_tile(kind: str, ci_g: int, co_g: int, kpn: int) -> tuple[int, ...]:
    """The tile used under the interpreter (small: numpy cost grows with tile size), with
    ``FUSION_CONV_AUTOTUNE=0``, and for problems too small to be worth a tile search."""
    if INTERPRETER:  # NOTE: per-op overhead dominates there: few, large programs run fastest
        return fit_tiles([(64, 16, 16, 4 if kind == "dgrad" else 8, 4, 1)], ci_g, co_g, kpn)[0]
    return fit_tiles(DGRAD_TILES if kind == "dgrad" else WGRAD_TILES, ci_g, co_g, kpn)[0]


def _use_autotune(macs: int) -> bool:
    return not INTERPRETER and environment.measuring() and macs >= 2**28


# --------------------------------------------------------------------------------------------------
# Host side: geometry, tables, checks, launchers
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Geometry:
    """Everything the launchers derive from the arguments (spatial tuples lifted to 3 dims)."""

    dims: int
    in_size: tuple[int, int, int]
    conv_out: tuple[int, int, int]
    units: tuple[int, int, int]  # pooled sizes
    taps: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int]
    dilation: tuple[int, int, int]
    window: tuple[int, int, int]  # pool kernel
    pool_padding: tuple[int, int, int]
    shifts: tuple[
        tuple[int, int], ...
    ]  # per dim (lowest shift LO, number of shifts NS); (0, 0): no live pair
    groups: int
    ci_g: int
    co_g: int

    @property
    def n_shifts(self) -> int:
        return math.prod(ns for _, ns in self.shifts)

    @property
    def window_volume(self) -> int:
        return math.prod(self.window)

    @property
    def windows_inside(self) -> bool:
        """Every pool window lies inside the conv output (no pool padding, no partial window)."""
        return all(
            up == 0 and (u - 1) * s + k <= o
            for up, u, s, k, o in zip(
                self.pool_padding, self.units, self.stride, self.window, self.conv_out, strict=True
            )
        )






def _live_shifts(kp_n: int, up: int, p: int, s: int, dl: int, taps: int) -> list[int]:
    """Input shift of every live (window offset, tap) pair along one dim."""
    return [
        (kp - up + p - t * dl) // s
        for kp in range(kp_n)
        for t in range(taps)
        if (kp - up + p - t * dl) % s == 0
    ]


def _geometry(grad: PooledGrad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
              padding: Sequence[int], dilation: Sequence[int], output_padding: Sequence[int],
              groups: int) -> _Geometry:  # fmt: skip
    dims = x.dim() - 2
    kernel = list(weight.shape[2:])
    out = conv_output_spatial(x.shape[2:], kernel, stride, padding, dilation, True, output_padding)
    k, _, p, _ = grad.geometry(dims)
    s3, p3, d3, t3 = lift3(stride, 1), lift3(padding, 0), lift3(dilation, 1), lift3(kernel, 1)
    shifts = []
    for j in range(3):
        live = _live_shifts(k[j], p[j], p3[j], s3[j], d3[j], t3[j])
        shifts.append((min(live), max(live) - min(live) + 1) if live else (0, 0))
    return _Geometry(
        dims, lift3(x.shape[2:], 1), lift3(out, 1), lift3(grad.g_win.shape[2:], 1), t3, s3, p3, d3,
        tuple(k), tuple(p), tuple(shifts), int(groups), x.shape[1] // groups, weight.shape[1],
    )  # fmt: skip


def unsupported_reason(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    compute_dtype: torch.dtype | None = None,
) -> str | None:  # fmt: skip
    """None when ``convolution_backward`` handles these arguments, else why not (never raises).

    Arguments as for ``convolution_backward``.  Taken: a transposed conv and a ``PooledGrad`` with
    pool dilation 1 and pool stride == conv stride on every dim, at most ``MAX_PHASE_ALIGNED_SLOTS`` input
    shifts (rounded up to a power of 2) and ``MAX_WINDOW_VOLUME`` window offsets, fp32/fp16/bf16
    (fp32/fp16 under the interpreter), every tensor within half the int32 offset range.
    """
    try:
        return _reason(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups,
                       compute_dtype or x.dtype)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - a malformed argument is a reason, not a crash
        return f"arguments not understood: {type(err).__name__}: {err}"


def _reason(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups, compute_dtype) -> str | None:  # noqa: ANN001
    if not isinstance(grad, PooledGrad):
        return "the gradient is not a PooledGrad (dense gradients: use conv_fused_bwd)"
    if not transposed:
        return "not a transposed conv (the shift decomposition is for conv-transpose phases)"
    reason = conv_arguments_reason(x, weight, stride, padding, dilation, output_padding, groups)
    if reason is not None:
        return reason
    dims = x.dim() - 2
    if any(dtype not in BACKWARD_DTYPES for dtype in (x.dtype, weight.dtype, compute_dtype)):
        return f"x, weight and compute dtype must be in {BACKWARD_DTYPES}, got {x.dtype}, {weight.dtype}, {compute_dtype}"
    if grad.g_win.dtype not in BACKWARD_DTYPES:
        return f"g_win must be fp32/fp16/bf16, got {grad.g_win.dtype}"
    if INTERPRETER and torch.bfloat16 in (x.dtype, weight.dtype, compute_dtype, grad.g_win.dtype):
        return "Triton's interpreter has no bf16"
    if grad.winner.dtype not in (torch.int8, torch.int32):
        return f"winner must be int8 or int32, got {grad.winner.dtype}"
    reason = device_reason((x, weight, grad.g_win, grad.winner))
    if reason is not None:
        return reason
    c_in = x.shape[1]
    if weight.shape[0] != c_in or c_in % groups:
        return f"conv-transpose weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}, groups={groups}"
    if any(op >= max(s, d) for op, s, d in zip(output_padding, stride, dilation, strict=True)):
        return f"output_padding {tuple(output_padding)} must be smaller than stride or dilation"
    out = conv_output_spatial(x.shape[2:], weight.shape[2:], stride, padding, dilation, True, output_padding)
    if min(out) < 1:
        return f"empty conv output {out}"
    if grad.winner.shape != grad.g_win.shape:
        return f"winner {tuple(grad.winner.shape)} and g_win {tuple(grad.g_win.shape)} differ in shape"
    geom = [
        grad.kernel_size,
        grad.stride or grad.kernel_size,
        grad.padding or (0,) * dims,
        grad.dilation or (1,) * dims,
    ]
    if any(len(v) != dims for v in geom):
        return f"pool geometry {grad} does not have {dims} spatial dims"
    k, s, p, d = geom
    if min(k) < 1 or min(s) < 1 or min(p) < 0:
        return f"invalid pool geometry {grad}"
    if any(dd != 1 for dd in d):
        return f"pool dilation {tuple(d)}: only 1 (windows must be dense runs of conv phases)"
    if tuple(s) != tuple(stride):
        return (
            f"pool stride {tuple(s)} differs from the conv stride {tuple(stride)}: the shifts are not static"
        )
    c_out = weight.shape[1] * groups
    pooled = pooled_spatial(out, k, s, p, d, grad.ceil_mode)
    if list(grad.g_win.shape) != [x.shape[0], c_out, *pooled]:
        return (
            f"pooled gradient has shape {tuple(grad.g_win.shape)}, but max-pooling the conv output "
            f"{[x.shape[0], c_out, *out]} with {grad} gives {[x.shape[0], c_out, *pooled]}"
        )
    if math.prod(k) > MAX_WINDOW_VOLUME:
        return f"pool window of {math.prod(k)} offsets exceeds {MAX_WINDOW_VOLUME}"
    geo = _geometry(grad, x, weight, stride, padding, dilation, output_padding, groups)
    if next_pow2(geo.n_shifts) > MAX_PHASE_ALIGNED_SLOTS:
        return f"{geo.n_shifts} distinct input shifts (per dim {[ns for _, ns in geo.shifts]}) exceed {MAX_PHASE_ALIGNED_SLOTS} slots"
    for name, t in (("x", x), ("weight", weight), ("g_win", grad.g_win), ("winner", grad.winner)):
        if element_extent(t) >= _INDEX_LIMIT:
            return f"{name} spans {element_extent(t)} elements: beyond the int32 offsets these kernels use (< {_INDEX_LIMIT})"
    if groups * cdiv(geo.ci_g, 16) * max(1, cdiv(geo.co_g, 16)) * math.prod(k) >= 2**16:
        return f"grid range: groups x channel blocks x window offsets ({groups} groups) must stay below 2**16"
    return None


def _check(grad: Grad, x: torch.Tensor, weight: torch.Tensor, *conv_args, compute_dtype: torch.dtype) -> None:
    raise_unsupported("conv_phase_aligned_bwd", unsupported_reason(grad, x, weight, *conv_args, compute_dtype=compute_dtype))


def _ci_innermost(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (C_in, C_out/g, *k) stored with C_in innermost (a copy unless it already is).

    WHY: the input-grad B tile is ``[(offset, co) rows, BLOCK_CI]``; with ci contiguous a warp reads
    whole rows.  The weight is tiny next to the activations.
    """
    if weight.stride(0) == 1 or weight.shape[0] == 1:
        return weight
    return weight.movedim(0, -1).contiguous().movedim(-1, 0)


@functools.cache  # never evicts: recorded CUDA graphs keep the tables' addresses
def _dgrad_table(geo: _Geometry, device: torch.device) -> torch.Tensor:
    """int32 live-block table of the input-grad kernel, for every power-of-2 ``KPB`` at once (the
    autotuner compares tiles of different KPB with one table argument).

    Layout: ``TABLE_HEADER`` entries, ``(first entry, entry count)`` at ``2*KPB``; then the shift
    entries ``(jd, jh, jw, first, count)`` of every KPB (5 ints each, shifts holding a live pair);
    then the block lists: ``count`` first offsets (multiples of KPB) at table index ``first``, one
    per block of KPB window offsets holding at least one live (offset, shift) pair.
    """
    kpn = geo.window_volume
    per_dim = []
    for j in range(3):
        (lo, ns), kp_n = geo.shifts[j], geo.window[j]
        up, p, s, dl, taps = geo.pool_padding[j], geo.padding[j], geo.stride[j], geo.dilation[j], geo.taps[j]
        per_dim.append({
            (sh, kp) for sh in range(lo, lo + ns) for kp in range(kp_n)
            if (num := kp - up + p - s * sh) >= 0 and num % dl == 0 and num // dl < taps
        })  # fmt: skip
    kh, kw = geo.window[1], geo.window[2]

    def live(shift: tuple[int, int, int], kp: int) -> bool:
        return ((shift[0], kp // (kh * kw)) in per_dim[0] and (shift[1], kp // kw % kh) in per_dim[1]
                and (shift[2], kp % kw) in per_dim[2])  # fmt: skip

    shifts = [(a, b, c) for a in range(geo.shifts[0][0], sum(geo.shifts[0]))
              for b in range(geo.shifts[1][0], sum(geo.shifts[1])) for c in range(geo.shifts[2][0], sum(geo.shifts[2]))]  # fmt: skip
    header = [0] * TABLE_HEADER.value
    entries: list[list[int]] = []  # (jd, jh, jw, index into blocks, count)
    blocks: list[int] = []
    kpb = 1
    while kpb <= next_pow2(kpn):
        header[2 * kpb] = len(entries)
        for sh in shifts:
            firsts = [
                kp0
                for kp0 in range(0, kpn, kpb)
                if any(live(sh, kp) for kp in range(kp0, min(kp0 + kpb, kpn)))
            ]
            if firsts:
                entries.append([*sh, len(blocks), len(firsts)])
                blocks += firsts
        header[2 * kpb + 1] = len(entries) - header[2 * kpb]
        kpb *= 2
    base = TABLE_HEADER.value + 5 * len(entries)
    flat = header + [v for e in entries for v in (*e[:3], base + e[3], e[4])] + blocks
    return persistent_device_copies([torch.tensor(flat, dtype=torch.int32)], device)[0]


@functools.cache  # never evicts: recorded CUDA graphs keep the tables' addresses
def _finish_table(geo: _Geometry, device: torch.device) -> torch.Tensor:
    """int32 (taps, MAXP, 2): per tap (row-major), its live (flat shift, flat offset) pairs, -1 padded."""
    nsh, nsw = geo.shifts[1][1], geo.shifts[2][1]
    kh, kw = geo.window[1], geo.window[2]
    pairs = []
    for t in [(a, b, c) for a in range(geo.taps[0]) for b in range(geo.taps[1]) for c in range(geo.taps[2])]:
        row = []
        for kp in [(a, b, c) for a in range(geo.window[0]) for b in range(kh) for c in range(kw)]:
            rel = []
            for j in range(3):
                num = kp[j] - geo.pool_padding[j] + geo.padding[j] - t[j] * geo.dilation[j]
                if num % geo.stride[j]:
                    break
                rel.append(num // geo.stride[j] - geo.shifts[j][0])
            else:
                row.append(((rel[0] * nsh + rel[1]) * nsw + rel[2], (kp[0] * kh + kp[1]) * kw + kp[2]))
        pairs.append(row)
    maxp = max(1, max(len(r) for r in pairs))
    table = torch.full((len(pairs), maxp, 2), -1, dtype=torch.int32)
    for t, row in enumerate(pairs):
        if row:
            table[t, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return persistent_device_copies([table], device)[0]


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _tile_meta(tile: tuple[int, ...]) -> dict:
    bm, bci, bco, kpb, warps, stages = tile
    return dict(BLOCK_M=bm, BLOCK_CI=bci, BLOCK_CO=bco, KPB=kpb, num_warps=warps, num_stages=stages)


class _KernelLaunch(AutotunedLaunch):
    """One kernel launch of a backward plan: an ``AutotunedLaunch`` of ``raw`` over ``grid(meta)``
    with ``tile`` (a ``DGRAD_TILES`` / ``WGRAD_TILES`` entry) through ``FastLaunch``, or, with
    ``tile`` None, the autotuned kernel on the first call and its pick through ``FastLaunch`` after.

    WHY: Triton's generic launch costs 20-90 us of host time per call on the GPU hosts, and a
    training step of the ConvT3d pipeline at 16x16x16x32x32 waits on the host (H100: 0.93 ms of GPU
    work in a 2.07 ms step).
    NOTE: ``python tools/profile_step.py demos/seeds/convt3d_leaky_mul_leaky_maxpool.py --mode train``
    shows both times."""

    def __init__(self, tuned, raw, tile: tuple[int, ...] | None, grid, constexprs: dict, fixed: tuple = ()) -> None:  # noqa: ANN001
        self.grid = grid
        super().__init__(tuned, raw, constexprs, fixed, None if tile is None else _tile_meta(tile))


def _prepare_input_grad(grad: PooledGrad, x: torch.Tensor, weight: torch.Tensor, geo: _Geometry,
                        compute_dtype: torch.dtype, allow_tf32: bool | None):  # noqa: ANN202  # fmt: skip
    """``(grad, x, weight) -> dx`` for tensors with these shapes, strides and dtypes (a plan)."""
    if x.numel() == 0:
        return lambda grad, x, weight: torch.empty_like(x)
    if geo.n_shifts == 0 or grad.g_win.numel() == 0:
        return lambda grad, x, weight: torch.empty_like(x).zero_()
    g, v = grad.g_win, grad.winner
    w = _ci_innermost(weight)  # the launched weight's strides (a copy only here, on a plan miss)
    dx = torch.empty_like(x, device="meta")
    m_total = x.shape[0] * math.prod(geo.in_size)
    kpn = geo.window_volume
    macs = m_total * geo.ci_g * geo.co_g * kpn * geo.n_shifts
    tile = None if _use_autotune(macs) else heuristic_tile("dgrad", geo.ci_g, geo.co_g, kpn)
    table = _dgrad_table(geo, x.device)

    def grid(meta):
        return (cdiv(m_total, meta["BLOCK_M"]), geo.groups * cdiv(geo.ci_g, meta["BLOCK_CI"]))

    ints = (
        m_total, geo.ci_g, geo.co_g, *geo.in_size, *geo.conv_out, *geo.units,
        *lift_5d(dx)[1], *lift_5d(g)[1], *lift_5d(v)[1], w.stride(0), w.stride(1), *lift3(w.stride()[2:], 0),
    )  # fmt: skip
    launch = _KernelLaunch(_dgrad_tuned, phase_aligned_dgrad_kernel, tile, grid, dict(
        TAPS=geo.taps, STRIDE=geo.stride, PAD=geo.padding, DIL=geo.dilation, UORIGIN=geo.pool_padding,
        KD=geo.window[0], KH=geo.window[1], KW=geo.window[2],
        G_CL=channels_inner(g), X_CL=channels_inner(dx), WIN_INSIDE=geo.windows_inside,
        V_SAME=g.stride() == v.stride(), CDT=compute_code(compute_dtype),
        PREC=backward_dot_precision(compute_dtype, allow_tf32),
    ), fixed=ints)  # fmt: skip

    def run(grad: PooledGrad, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        launch(grad.g_win, grad.winner, _ci_innermost(weight), table, out)
        return out

    return run


def _prepare_weight_grad(grad: PooledGrad, x: torch.Tensor, weight: torch.Tensor, geo: _Geometry,
                         compute_dtype: torch.dtype, allow_tf32: bool | None):  # noqa: ANN202  # fmt: skip
    """``(grad, x, weight) -> dw`` for tensors with these shapes, strides and dtypes (a plan)."""
    if weight.numel() == 0:
        return lambda grad, x, weight: torch.empty_like(weight)
    n = x.shape[0]
    m_total = n * math.prod(geo.units)
    if geo.n_shifts == 0 or m_total == 0:
        return lambda grad, x, weight: torch.empty_like(weight).zero_()
    dw = torch.empty_like(weight, device="meta")
    g, v = grad.g_win, grad.winner
    kpn = geo.window_volume
    ns = geo.n_shifts
    slots = next_pow2(ns)
    macs = m_total * slots * geo.ci_g * kpn * geo.co_g
    tile = None if _use_autotune(macs) else heuristic_tile("wgrad", geo.ci_g, geo.co_g, kpn)
    # Splits of the unit rows: about two waves of programs, each reducing >= MIN_ROWS rows.  The
    # split count depends on the shape only (the partials buffer is sized before tuning).
    ref = tile or fit_tiles(WGRAD_TILES, geo.ci_g, geo.co_g, kpn)[0]
    tiles_est = geo.groups * cdiv(geo.ci_g, ref[1]) * cdiv(geo.co_g, ref[2]) * cdiv(kpn, ref[3])
    min_rows, align = (32, 16) if INTERPRETER else (2048, 256)
    splits = max(
        1, min(cdiv(_WGRAD_PROGRAMS_PER_SM * _sm_count(x.device), tiles_est), cdiv(m_total, min_rows))
    )
    rows_per_split = cdiv(cdiv(m_total, splits), align) * align
    splits = cdiv(m_total, rows_per_split)
    part_split = geo.groups * ns * geo.ci_g * kpn * geo.co_g
    if splits * part_split >= 2**31:
        splits = 1
        rows_per_split = m_total
    part_numel = splits * part_split
    # CARRY: BLOCK_M is a power of 2, what holds for the largest candidate holds for every one.
    # LINE_DIV: the largest power of 2 dividing the pooled width and the split length (a tile's
    # BLOCK_M divides both iff it divides LINE_DIV: the kernel decides per tile).
    max_bm = max(t[0] for t in ([tile] if tile else fit_tiles(WGRAD_TILES, geo.ci_g, geo.co_g, kpn)))
    constexprs = dict(
        SD=geo.stride[0], SH=geo.stride[1], SW=geo.stride[2],
        UPD=geo.pool_padding[0], UPH=geo.pool_padding[1], UPW=geo.pool_padding[2],
        KD=geo.window[0], KH=geo.window[1], KW=geo.window[2],
        LOD=geo.shifts[0][0], LOH=geo.shifts[1][0], LOW=geo.shifts[2][0],
        NSD=geo.shifts[0][1], NSH=geo.shifts[1][1], NSW=geo.shifts[2][1], KS=slots,
        X_CL=channels_inner(x), G_CL=channels_inner(g), WIN_INSIDE=geo.windows_inside,
        V_SAME=g.stride() == v.stride(), CARRY=max_bm <= geo.units[2],
        LINE_DIV=math.gcd(geo.units[2], rows_per_split) & -math.gcd(geo.units[2], rows_per_split),
        CDT=compute_code(compute_dtype), PREC=backward_dot_precision(compute_dtype, allow_tf32),
    )  # fmt: skip

    def grid(meta):
        tiles = (geo.groups * cdiv(geo.ci_g, meta["BLOCK_CI"]) * cdiv(geo.co_g, meta["BLOCK_CO"])
                 * cdiv(kpn, meta["KPB"]))  # fmt: skip
        return (splits, tiles)

    ints = (
        m_total, geo.ci_g, geo.co_g, rows_per_split, part_split, *geo.in_size, *geo.conv_out, *geo.units,
        *lift_5d(x)[1], *lift_5d(g)[1], *lift_5d(v)[1],
    )  # fmt: skip
    partials = _KernelLaunch(_wgrad_tuned, phase_aligned_wgrad_kernel, tile, grid, constexprs, fixed=ints)
    table = _finish_table(geo, x.device)
    fb = _FINISH_BLOCK if not INTERPRETER else 16
    finish_grid = (math.prod(geo.taps), geo.groups * cdiv(geo.ci_g, fb) * cdiv(geo.co_g, fb))
    finish_ints = (splits, geo.ci_g, geo.co_g, table.shape[1], part_split, dw.stride(0), dw.stride(1),
                   *lift3(dw.stride()[2:], 0))  # fmt: skip
    finish = FastLaunch(phase_aligned_wgrad_finish_kernel, finish_grid,
                        dict(TH=geo.taps[1], TW=geo.taps[2], NS=ns, KPN=kpn, BLOCK_A=fb, BLOCK_B=fb),
                        fixed=finish_ints)  # fmt: skip

    def run(grad: PooledGrad, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        part = torch.empty(part_numel, dtype=torch.float32, device=x.device)
        out = torch.empty_like(weight)
        partials(x, grad.g_win, grad.winner, part)
        finish(part, table, out)
        return out

    return run


def convolution_backward(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    output_mask: Sequence[bool] = (True, True, True), compute_dtype: torch.dtype | None = None,
    allow_tf32: tuple[bool, bool] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Drop-in for ``conv_fused_bwd.convolution_backward`` on the cases ``unsupported_reason`` accepts.

    Args:
      grad: ``PooledGrad`` (g_win any float dtype, winner int8/int32; any strides).
      x: (N, C_in, *spatial) conv-transpose input, 1 to 3 spatial dims, fp32/fp16/bf16, any strides.
      weight: (C_in, C_out/groups, *k), fp32/fp16/bf16, any strides.
      stride, padding, dilation, transposed, output_padding, groups: as ``aten.convolution``.
      output_mask: which of (grad_x, grad_w, grad_b) to compute.
      compute_dtype: the dtype the forward conv ran in (None: x's); x, weight and the gradient are
        cast to it as they are loaded (the backward of ``conv(x.to(dtype), weight.to(dtype))`` under
        autocast, without a cast pass over x), and the fp32 sums are written in x's / weight's dtype.
      allow_tf32: whether the input gradient's and the weight gradient's fp32 dots may use TF32
        (``kernels.tf32.backward_dot_precision``; None: the cuDNN flag).
    Returns ``(grad_x, grad_w, grad_b)``, None where ``output_mask`` is False: grad_x like
    ``empty_like(x)``, grad_w like ``empty_like(weight)``, grad_b (C_out,) in weight's dtype.
    Raises ``UnsupportedInputError`` when ``unsupported_reason(...)`` is not None.
    """
    conv_args = (tuple(stride), tuple(padding), tuple(dilation), bool(transposed), tuple(output_padding), int(groups))
    parts = (
        grad.g_win if isinstance(grad, PooledGrad) else None, None if not isinstance(grad, PooledGrad)
        else (grad.winner, grad.kernel_size, grad.stride, grad.padding, grad.dilation, grad.ceil_mode),
        x, weight, conv_args, tuple(bool(m) for m in output_mask[:2]),
        compute_dtype, *_precisions(compute_dtype or x.dtype, allow_tf32), environment.measuring(),
    )  # fmt: skip
    run = _PLANS.plan(parts, lambda: backward_plan(grad, x, weight, *conv_args, output_mask[:2], compute_dtype,
                                                allow_tf32))  # fmt: skip
    gx, gw = run(grad, x, weight)
    gb = conv_bias_grad(grad).to(weight.dtype) if output_mask[2] else None
    return gx, gw, gb


def backward_plan(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    output_mask: Sequence[bool] = (True, True), compute_dtype: torch.dtype | None = None,
    allow_tf32: tuple[bool, bool] | None = None,
) -> Callable[[Grad, torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]]:
    """``(grad, x, weight) -> (grad_x, grad_w)`` for tensors laid out like these (a per-signature
    call plan keeps it): ``convolution_backward`` without the bias, the per-call checks and the
    cache lookup (``convolution_backward`` keeps these per shape).  Raises ``UnsupportedInputError``
    as ``convolution_backward`` does."""
    conv_args = (tuple(stride), tuple(padding), tuple(dilation), bool(transposed), tuple(output_padding), int(groups))
    input_grad, weight_grad = _plan(grad, x, weight, conv_args, output_mask, compute_dtype or x.dtype, allow_tf32)

    def run(grad: Grad, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (None if input_grad is None else input_grad(grad, x, weight),
                None if weight_grad is None else weight_grad(grad, x, weight))  # fmt: skip

    return run


#: ``convolution_backward``'s plans by shapes, strides, dtypes, geometry and mask: the checks,
#: the geometry and the launch arguments are worked out once (host time is what the ConvT3d
#: pipeline's training step waits on).
_PLANS = PlanCache()


def _precisions(dtype: torch.dtype, allow_tf32: tuple[bool, bool] | None) -> tuple[str, str]:
    """The input and weight gradients' dot precisions (``kernels.tf32.backward_dot_precision``)."""
    tf32_x, tf32_w = (None, None) if allow_tf32 is None else allow_tf32
    return backward_dot_precision(dtype, tf32_x), backward_dot_precision(dtype, tf32_w)


def _plan(grad: Grad, x: torch.Tensor, weight: torch.Tensor, conv_args: tuple, output_mask: Sequence[bool],
          compute_dtype: torch.dtype, allow_tf32: tuple[bool, bool] | None):  # noqa: ANN202  # fmt: skip
    """``(input_grad, weight_grad)`` runners for these arguments (None where the mask is off);
    raises ``UnsupportedInputError`` when ``unsupported_reason`` names a reason."""
    _check(grad, x, weight, *conv_args, compute_dtype=compute_dtype)
    stride, padding, dilation, _, output_padding, groups = conv_args
    geo = _geometry(grad, x, weight, stride, padding, dilation, output_padding, groups)
    tf32_x, tf32_w = (None, None) if allow_tf32 is None else allow_tf32
    input_grad = _prepare_input_grad(grad, x, weight, geo, compute_dtype, tf32_x) if output_mask[0] else None
    weight_grad = _prepare_weight_grad(grad, x, weight, geo, compute_dtype, tf32_w) if output_mask[1] else None
    return input_grad, weight_grad
