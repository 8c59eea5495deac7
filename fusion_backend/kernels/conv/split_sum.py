"""Sums of fp32 partials over one axis (their splits or tiles), in float64, in a fixed order: what the conv
family's kernels leave per split or per M tile (the weight gradient's split-K partials and its bias's,
the input gradient's BatchNorm-backward sums) becomes one result, the same bits on every run (no atomic
touches a value).

A launch covers ``total`` elements, each the sum of its ``split`` slots, a fixed stride apart:
a program owns ``block`` elements and reads ``slots`` of their slots per step (:func:`split_sum_blocks`),
each step's ``[slots, block]`` loads reduced as a tree in float64, the steps in split order.
:func:`sum_slots` is that loop, for kernels that store the sums their own way (``wgrad``'s weight
layout); :func:`sum_dim` sums a contiguous tensor over one dim into float64, each step in a program of
its own where the slots need several, the steps' sums summed by the last of them to finish (``arrival``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import arrival
from ..arrival import last_to_arrive
from ..host import cdiv, next_pow2
from ..launch import FastLaunch
from ..plan_cache import PlanCache
from .prologue import _tap_coords

#: About this many loads per step of a program (``[slots, block]``); at least this many programs (two per
#: SM of a 132-SM GPU) where the elements are enough for them (:func:`split_sum_blocks`).
_STEP_LOADS = 4096
_PROGRAMS = 264


def split_sum_blocks(total: int, split: int) -> tuple[int, int]:
    """``(block, slots)`` for ``total`` elements summed over ``split`` slots: ``block`` elements per
    program (a power of two in 16..1024, small enough that the launch has :data:`_PROGRAMS` programs
    where ``total`` allows) and up to ``slots`` slots read per step (a power of two, no more than
    ``split`` needs, about :data:`_STEP_LOADS` loads per step).
    NOTE: a few elements over many slots is a few programs each walking its slots in a loop of
    dependent steps, whatever each step holds: ResNet-50's 64 -> 64 1x1 weight gradient at 56 x 56
    (4,096 elements, 262 slots) took 16.1 us in 32 programs of 9 steps, more than its weight-gradient
    kernel's 12.3 us, and 4.4 us in 256 programs of 2 (H200, bf16; ``python tools/bench_conv.py
    demos/realnets/resnet50.py --passes wgrad --profile --filter '*64x64x56x56 -> 64 k1x1*'``).  Index
    arithmetic is per element and per thread: 4,096 elements on 4 warps took 214 registers, 1,024 took
    48 with one slot per step and 72 with four (the sm_90a compile of Triton 3.6)."""
    block = max(16, min(1024, 1 << (max(1, total // _PROGRAMS).bit_length() - 1)))  # a power of two
    return block, min(next_pow2(split), max(1, _STEP_LOADS // block))


@triton.jit
def sum_slots(part_ptr, base, in_range, SPLIT, SLOT_STRIDE, SPLIT_BLOCK: tl.constexpr, CACHE: tl.constexpr):
    """float64 sums over ``SPLIT`` slots of the elements whose first slot is at ``part_ptr + base`` (int64
    ``[BLOCK]``, ``in_range`` their mask), slot ``s`` at ``base + s * SLOT_STRIDE``: ``SPLIT_BLOCK`` slots
    per step as a tree, the steps in order.  ``CACHE``: the loads' cache modifier, ``""`` or ``".cg"`` for
    slots other programs of the launch stored (``arrival``).  NOTE: passed by every caller: Triton 3.6 fails
    to compile a call that leaves a string constexpr to its default ("'str' object has no attribute
    'type'"; ``tests/kernels/test_split_sum.py`` on the H200)."""
    slots = tl.arange(0, SPLIT_BLOCK).to(tl.int64)
    acc = tl.zeros(base.shape, tl.float64)
    for s0 in range(0, SPLIT, SPLIT_BLOCK):
        s = s0 + slots
        v = tl.load(part_ptr + s[:, None] * SLOT_STRIDE + base[None, :],
                    mask=(s < SPLIT)[:, None] & in_range[None, :], other=0.0, cache_modifier=CACHE)  # fmt: skip
        acc += tl.sum(v.to(tl.float64), axis=0)
    return acc


@triton.jit
def sum_dim_kernel(part_ptr, out_ptr, step_ptr, count_ptr, SPLIT, TOTAL, INNER, CHUNK, BLOCK: tl.constexpr,
                   SPLIT_BLOCK: tl.constexpr, CHUNKED: tl.constexpr, CHUNK_BLOCK: tl.constexpr):  # fmt: skip
    """``out[o, i] = Σ_s part[o, s, i]`` in float64 (``part`` contiguous ``(TOTAL / INNER, SPLIT, INNER)``,
    fp32 or float64), ``BLOCK`` of the ``TOTAL`` outputs per program, in one launch.  With ``CHUNKED``
    program ``(p, j)`` sums chunk ``j`` of the slots (``CHUNK`` slots, the grid's second dim) into
    ``step_ptr[j, e]`` (float64 ``(chunks, TOTAL)``) and the last of its block's programs to arrive
    (``arrival.last_to_arrive`` on ``count_ptr[p]``, int32 zeros) sums the chunks in their order,
    ``CHUNK_BLOCK`` per step (module docstring)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    chunk = tl.program_id(1)
    in_range = e < TOTAL
    first = chunk.to(tl.int64) * CHUNK
    base = (e // INNER) * SPLIT * INNER + e % INNER + first * INNER
    acc = sum_slots(part_ptr, base, in_range, tl.minimum(SPLIT - first, CHUNK), INNER, SPLIT_BLOCK, "")
    if CHUNKED:
        chunks = tl.num_programs(1)
        tl.store(step_ptr + chunk.to(tl.int64) * TOTAL + e, acc, mask=in_range)
        if last_to_arrive(count_ptr + tl.program_id(0), chunks):
            total = sum_slots(step_ptr, e, in_range, chunks, TOTAL, CHUNK_BLOCK, ".cg")
            tl.store(out_ptr + e, total, mask=in_range)
    else:
        tl.store(out_ptr + e, acc, mask=in_range)


#: :func:`sum_dim`'s launches, per ``(split, total, inner)``: the launch, its programs along the
#: elements, its chunks of slots
_LAUNCHES = PlanCache()


def sum_dim(partials: torch.Tensor, dim: int) -> torch.Tensor:
    """float64 sums of contiguous fp32 ``partials`` over ``dim``: its shape without ``dim``, the same bits
    on every run for one shape, in one launch.  Where the slots take more than one step of a program, each
    step's slots are summed in a program of its own (a chunk), and the last chunk of an element block to
    finish sums the chunks in order (``arrival``: the slot loop's steps are dependent, so a few programs
    walking many steps are mostly waiting).
    NOTE: the input gradient's BatchNorm sums of ResNet-50's 1x1 convs at 56 x 56 (1,568 tiles; 64 and 256
    channels) took 11.9 and 32.6 us in one program walking seven steps, 4.8 and 7.0 with a program per step
    and a second launch summing the steps (H200; the command in ``stats.reduce_grad_partials``' NOTE); the
    steps summed by the last of them instead: the hooked input gradient of the 3x3 of 64 channels at 56 x 56
    0.0707 -> 0.0691 ms (``docs/perf/RESULTS.md``, "The statistics' reduction and BatchNorm's form in one
    launch")."""
    shape = list(partials.shape)
    split = shape.pop(dim)
    inner = math.prod(shape[dim:])
    total = math.prod(shape)
    out = torch.empty(shape, dtype=torch.float64, device=partials.device)
    if total == 0 or split == 0:
        return out.zero_()

    def build() -> tuple[FastLaunch, int, int]:
        block, slots = split_sum_blocks(total, split)
        chunks = cdiv(split, slots)
        chunk_block = min(next_pow2(chunks), max(1, _STEP_LOADS // block))
        launch = FastLaunch(sum_dim_kernel, (cdiv(total, block), chunks),
                            dict(BLOCK=block, SPLIT_BLOCK=slots, CHUNKED=chunks > 1, CHUNK_BLOCK=chunk_block,
                                 num_warps=8),
                            fixed=(split, total, inner, slots))  # fmt: skip
        return launch, cdiv(total, block), chunks

    launch, blocks, chunks = _LAUNCHES.plan((split, total, inner), build)  # FastLaunch keys the device
    if chunks == 1:
        launch(partials, out, out, out)
        return out
    steps = torch.empty((chunks, total), dtype=torch.float64, device=partials.device)
    launch(partials, out, steps, arrival.counters(partials.device, blocks))
    return out


@triton.jit
def weight_grad_offsets(g, co, k, C_OUT_G, w_so, w_si, w_sd, w_sh, w_sw, C_IN_G, CIN_PAD: tl.constexpr,
                        KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, FLAT_K: tl.constexpr):  # fmt: skip
    """Where element ``(co, k)`` of group ``g``'s ``[COUT_PAD, K_ROW]`` weight-gradient partial matrix lives
    in the gradient, and whether it is real (not a padded channel or K entry): ``(offsets, mask)`` of
    ``co``'s and ``k``'s broadcast shape.  K is ``wgrad``'s order, taps outer and the group's ``C_IN_G``
    channels inner, padded to ``CIN_PAD`` per tap (or, ``FLAT_K``, not padded); ``w_s*`` the gradient's
    strides over (output channel, input channel, kd, kh, kw).  The split sum and a single split's
    programs (``DIRECT``) store through it."""
    if FLAT_K:
        tap = k // C_IN_G
        ci = k % C_IN_G
        real = k < KD * KH * KW * C_IN_G
    else:
        tap = k // CIN_PAD
        ci = k % CIN_PAD
        real = ci < C_IN_G
    kd, kh, kw = _tap_coords(tap, KH, KW)
    dst = (g * C_OUT_G + co) * w_so + ci * w_si + kd * w_sd + kh * w_sh + kw * w_sw
    return dst, real & (co < C_OUT_G)
