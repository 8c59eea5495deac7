"""The conv family's forward for pointwise convs on sm_90, written in Gluon: a 1x1 (1x1x1, width-1)
conv with stride 1, no padding and one group is the GEMM ``out[M, C_out] = a(x)[M, C_in] @ W[C_in,
C_out]`` over the channels-last rows of ``x``, and this kernel runs it with the same hooks and the
same store as :func:`fprop.conv_fprop_kernel`: a :class:`tiles.TileConfig` with ``tma``, which
the forward's timed tile choice weighs against the gather kernel's tiles (``tiles.candidates``).

WHY a kernel of its own: Triton's ``tl.dot`` form fixes the layouts, and two of them cost the hooked
forward most of its time.  (1) A prologue on the A tile (``relu(x * scale + shift)``) takes the tile
from shared memory into a blocked layout and back before ``wgmma`` reads it, beside the gather's
per-row address arithmetic: the hooked 3x3 issues 587 SASS instructions per K step against the plain
kernel's 231.  (2) The statistics' sums over a tile's rows run in the accumulator's layout, where a
column's rows are spread over 8 lanes and every warp: shuffles and a shared-memory exchange per sum,
per tile.  Gluon states its layouts:

* both operands arrive by TMA (one 2-d box each, no address arithmetic) in a ring of stages, each
  with its mbarrier; the kernel is persistent (a program per SM's worth of tiles) and walks its
  (tile, K step) pairs in one loop, so the next tile's first boxes load during this tile's store;
* with a prologue, each thread loads its part of the A tile straight into ``wgmma``'s register
  operand layout (``DotOperandLayout``), applies the prologue there (fp32, one rounding to the compute
  dtype, as :func:`prologue.load_a_tile`; the channel affine's vectors are loaded before the stage's
  wait) and issues ``wgmma`` with A from registers; without one, ``wgmma`` reads A from shared memory;
  one ``wgmma`` group stays in flight while the next step's prologue runs;
* the store converts the accumulator to a layout whose lanes run along the channels and whose
  threads each hold ``BLOCK_M / num_warps`` rows of their columns, and calls the family's own
  :func:`epilogue.store_tile` there: the bias, scale, chain, activations, residual, saved conv and the
  statistics' partials are the gather kernel's formulas, and the statistics' sums over the rows run in
  registers, then across warps.

NOTE: the statistics, not the prologue, were the hooked forward's cost on 1x1 convs.  H200, bf16,
batch 64 (GPU ms per call; ``conv_fprop`` plain, with BatchNorm + ReLU on load, with the output's
statistics, with both), 64 -> 256 channels at 56 x 56: gather 0.049 / 0.058 / 0.133 / 0.145, this
kernel 0.044 / 0.053 / 0.083 / 0.093; 128 -> 512 at 28 x 28: gather 0.032 / 0.036 / 0.079 / 0.086,
this kernel 0.037 / 0.042 / 0.060 / 0.068.  Where ``C_in`` is 256 or more its K loop trails the
gather kernel's (512 -> 128 at 28 x 28: 0.027 against 0.022 plain), and the timed choice keeps the
gather there.  The launch's host cost is about twice the gather's (0.099 against 0.050 ms per plain
call, 0.109 against 0.081 hooked): two tensor descriptors built and encoded per call.

Contract (:func:`supports` says whether a call qualifies): fp16 or bf16 (TMA boxes of 16-bit
elements; fp32 keeps the gather kernel and its TF32 rounding), ``C_in`` a multiple of 8 (TMA strides
are multiples of 16 bytes); the prologue a channel affine, a group affine or a gate, any input
activation; every store hook but GroupNorm's per-sample statistics (tiles here cross samples).  An
``x`` or weight that is not the dense, 16-byte aligned matrix the boxes read (a slice, a view at an odd
offset) is copied to one first.  K tails (``C_in`` not a multiple of ``BLOCK_K``): the boxes read zeros
past ``C_in`` in both operands and the prologue's vectors are masked to 0 there, so those lanes add
``act(0) * 0 = 0``.  Rows past ``M`` are computed from zeros and never stored or counted.

Gluon is Triton's experimental explicit-layout language (``triton.experimental.gluon``); the kernel
compiles with Triton 3.6 and 3.9, whose TMA load and CTA barrier differ in name (``_tma_load``,
``_thread_barrier``).  It has no interpreter: on CPU this path is compiled
(``tools/compile_check.py conv_family --cases resnet_1x1-bf16-hooked-tma``) but never run, and
:func:`supports` is False there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..host import INTERPRETER
from ..launch import FastLaunch

try:  # Gluon is experimental: a Triton without it (or with another API) keeps the gather kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    #: Triton 3.9 names the TMA load ``async_load``; 3.6 ``async_copy_global_to_shared``
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    #: and a CTA-wide barrier ``barrier`` (3.9) or ``thread_barrier`` (3.6)
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    GLUON = False

from .epilogue import store_tile
from .prologue import activation, normalise
from .tiles import tma_programs_per_sm

#: Element sizes the TMA boxes take here (16-bit operands).
_DTYPES = (torch.float16, torch.bfloat16)


if GLUON:

    @gluon.jit
    def _a_operand(a_smem, scale, shift, k0, n, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                   a_layout: gl.constexpr, PROLOGUE: gl.constexpr, G_NORM: gl.constexpr,
                   NORM_AFFINE: gl.constexpr, ACT_IN: gl.constexpr, EVEN_K: gl.constexpr):  # fmt: skip
        """The A tile of the K step at channel ``k0`` in ``wgmma``'s register layout, through the
        prologue (``prologue.normalise``, then ``act_in``, in fp32; one rounding to the compute dtype).
        ``scale``, ``shift``: a channel affine's vectors for the step (:func:`_channel_vectors`, loaded
        before the step's wait); ``n``: the tile rows' samples (``[BLOCK_M]``, the group affine's and the
        gate's index)."""
        a = a_smem.load(a_layout)
        v = a.to(gl.float32)
        if PROLOGUE == 1:
            v = v * scale[None, :] + shift[None, :]
        elif PROLOGUE != 0:
            BLOCK_K: gl.constexpr = a.shape[1]
            c = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_layout))
            c_ok = _channels_ok(c, C_IN, EVEN_K, BLOCK_K, gl.SliceLayout(0, a_layout))
            v = normalise(v, n, c, c_ok[None, :], c_ok, p0_ptr, p1_ptr, p2_ptr, p3_ptr, C_IN, PROLOGUE, G_NORM,
                          NORM_AFFINE, MASK_PAD=False)  # fmt: skip
        v = activation(v, ACT_IN, slope_in)
        return v.to(a.dtype)

    @gluon.jit
    def _channels_ok(c, C_IN, EVEN_K: gl.constexpr, BLOCK_K: gl.constexpr, layout: gl.constexpr):
        if EVEN_K:  # a constant mask: the vectors' loads compile unmasked (and vectorised)
            return gl.full([BLOCK_K], 1, gl.int1, layout=layout)
        return c < C_IN

    @gluon.jit
    def _channel_vectors(k0, p0_ptr, p1_ptr, C_IN, a_layout: gl.constexpr, PROLOGUE: gl.constexpr,
                         EVEN_K: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """A channel affine's scale and shift for the K step at channel ``k0`` (0 past ``C_IN``), in the
        A operand's column layout; zeros for the other prologues (unused)."""
        layout: gl.constexpr = gl.SliceLayout(0, a_layout)
        c = k0 + gl.arange(0, BLOCK_K, layout=layout)
        if PROLOGUE == 1:
            c_ok = _channels_ok(c, C_IN, EVEN_K, BLOCK_K, layout)
            return gl.load(p0_ptr + c, mask=c_ok, other=0.0), gl.load(p1_ptr + c, mask=c_ok, other=0.0)
        zero = gl.zeros([BLOCK_K], gl.float32, layout=layout)
        return zero, zero

    @gluon.jit
    def _load_step(a_desc, b_desc, a_smem, b_smem, ready, step, pid, programs, k_steps, n_tiles,
                   STAGES: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """Issue the TMA loads of this program's ``step``-th (tile, K step) pair into its ring stage."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        tile = pid + (step // k_steps) * programs
        k0 = (step % k_steps) * BLOCK_K
        stage = step % STAGES
        mbarrier.expect(ready.index(stage), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        _tma_load(a_desc, [(tile // n_tiles) * BLOCK_M, k0], ready.index(stage), a_smem.index(stage))
        _tma_load(b_desc, [(tile % n_tiles) * BLOCK_N, k0], ready.index(stage), b_smem.index(stage))

    @gluon.jit
    def tma_fprop_kernel(
        a_desc, b_desc, scale_ptr, bias_ptr, res_ptr, out_ptr, conv_ptr, part_ptr, q_ptr, p0_ptr, p1_ptr, p2_ptr,
        p3_ptr, slope_in, slope_out, M, C_IN, C_OUT, M_TILES, SAMPLE_ROWS,
        PROLOGUE: gl.constexpr, G_NORM: gl.constexpr, NORM_AFFINE: gl.constexpr, ACT_IN: gl.constexpr,
        SAVE_CONV: gl.constexpr, HAS_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, CHAIN: gl.constexpr,
        ACT_OUT: gl.constexpr, RESIDUAL: gl.constexpr, STATS: gl.constexpr, BIG: gl.constexpr,
        EVEN_K: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """The ``[BLOCK_M, BLOCK_N]`` tiles ``pid, pid + programs, ...`` of ``out[M, C_OUT]`` (module
        docstring), tile ``t`` being M tile ``t // N_TILES`` and N tile ``t % N_TILES`` (programs running
        together share their A rows in L2).  One walk over the program's (tile, K step) pairs keeps
        ``STAGES - 1`` loads in flight across tiles: the next tile's first boxes arrive during this
        tile's store.

        a_desc  TMA descriptor of x as the row-major ``[M, C_IN]`` matrix, box ``[BLOCK_M, BLOCK_K]``.
        b_desc  TMA descriptor of the weight as the row-major ``[C_OUT, C_IN]`` matrix, box
                ``[BLOCK_N, BLOCK_K]`` (read transposed by ``wgmma``).
        The other pointers and the hooks' constexprs are :func:`fprop.conv_fprop_kernel`'s (the
        store's are :func:`epilogue.store_tile`'s); ``SAMPLE_ROWS``: output positions per sample (the
        rows' samples, for a group affine or a gate).  ``EVEN_K``: ``BLOCK_K`` divides ``C_IN``."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        # warps stacked along M (16 rows each per wgmma), the rest side by side along N
        WARPS_M: gl.constexpr = min(num_warps, BLOCK_M // 16)
        WARPS_N: gl.constexpr = num_warps // WARPS_M
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, BLOCK_N // WARPS_N, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        # The store's layout: a warp's lanes side by side along the channels (a row of the tile per
        # store instruction, contiguous), each thread down BLOCK_M / num_warps rows of its columns, so
        # that the statistics' sums over the rows run in registers and then across warps alone (in the
        # accumulator's layout each sum also crossed 8 lanes by shuffles).
        LANES_N: gl.constexpr = min(32, BLOCK_N)
        VEC: gl.constexpr = BLOCK_N // LANES_N
        ROWS_PT: gl.constexpr = max(1, BLOCK_M // (num_warps * (32 // LANES_N)))
        out_layout: gl.constexpr = gl.BlockedLayout([ROWS_PT, VEC], [32 // LANES_N, LANES_N], [num_warps, 1], [1, 0])
        HOOKED: gl.constexpr = PROLOGUE != 0 or ACT_IN != 0

        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        n_tiles = gl.cdiv(C_OUT, BLOCK_N)
        k_steps = gl.cdiv(C_IN, BLOCK_K)
        steps = gl.cdiv(M_TILES * n_tiles - pid, programs) * k_steps

        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(STAGES - 1):
            if i < steps:
                _load_step(a_desc, b_desc, a_smem, b_smem, ready, i, pid, programs, k_steps, n_tiles, STAGES, BLOCK_N)

        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for step in range(steps):
            ki = step % k_steps
            tile = pid + (step // k_steps) * programs
            pid_m = tile // n_tiles
            s = step % STAGES
            b = b_smem.index(s).permute((1, 0))
            if HOOKED:
                # the vectors' loads go out before the wait, their latency under the box's
                scale, shift = _channel_vectors(ki * BLOCK_K, p0_ptr, p1_ptr, C_IN, a_layout, PROLOGUE, EVEN_K, BLOCK_K)
                rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_layout))
                mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                a = _a_operand(a_smem.index(s), scale, shift, ki * BLOCK_K, gl.minimum(rows, M - 1) // SAMPLE_ROWS,
                               p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN, a_layout, PROLOGUE, G_NORM,
                               NORM_AFFINE, ACT_IN, EVEN_K)  # fmt: skip
                acc = warpgroup_mma(a, b, acc, use_acc=ki > 0, is_async=True)
            else:
                mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                acc = warpgroup_mma(a_smem.index(s), b, acc, use_acc=ki > 0, is_async=True)
            # one group in flight: the previous step's MMA has finished, its stage takes the step
            # STAGES - 1 ahead (every warp read that stage's A before its MMA was issued)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            _thread_barrier()
            if step + STAGES - 1 < steps:
                _load_step(a_desc, b_desc, a_smem, b_smem, ready, step + STAGES - 1, pid, programs, k_steps, n_tiles,
                           STAGES, BLOCK_N)  # fmt: skip
            if ki == k_steps - 1:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                out = gl.convert_layout(acc, out_layout)
                m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
                c = (tile % n_tiles) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
                store_tile(out, m, m < M, c, c < C_OUT, pid_m, out_ptr, conv_ptr, scale_ptr, bias_ptr, res_ptr,
                           part_ptr, q_ptr, slope_out, C_OUT, M_TILES, SAVE_CONV, HAS_SCALE, HAS_BIAS, CHAIN, ACT_OUT,
                           RESIDUAL, STATS, BIG)  # fmt: skip
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))


def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _multiprocessors(device: torch.device) -> int:
    """The device's SM count; an H100's 132 for a CPU device (``tools/compile_check.py`` records the
    launches of CPU tensors)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def supports(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
             groups: int, stats_groups: int) -> bool:  # fmt: skip
    """Whether a forward call can run here (module docstring's contract; the hooks' kinds all can, but
    GroupNorm's per-sample statistics, ``stats_groups``).  Any layout qualifies: a call whose ``x`` or
    weight is not the dense, 16-byte aligned matrix the boxes read is copied to one first
    (:func:`_rows`), which the timed tile choice weighs."""
    return (GLUON and not INTERPRETER and _is_sm90(x.device) and x.dtype in _DTYPES and weight.dtype == x.dtype
            and groups == 1 and stats_groups == 0 and math.prod(weight.shape[2:]) == 1
            and all(s == 1 for s in stride) and all(p == 0 for p in padding) and x.shape[1] % 8 == 0)  # fmt: skip


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the dense, 16-byte aligned row-major matrix TMA reads: a view where it is one, else a copy."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (N, C, *spatial) as the row-major ``[M, C]`` matrix of its channels-last rows."""
    return _matrix(x.movedim(1, -1)).reshape(-1, x.shape[1])


def _weight_rows(weight: torch.Tensor) -> torch.Tensor:
    """A 1x1 weight (C_out, C_in, 1, ...) as the row-major ``[C_out, C_in]`` matrix."""
    return _matrix(weight.reshape(weight.shape[0], weight.shape[1]))


def _shared_layout(block: list[int], dtype: torch.dtype) -> Any:
    """The swizzled shared-memory layout of a ``block`` box of ``dtype`` (TMA's and wgmma's)."""
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


class TmaLaunch:
    """The launch of :func:`tma_fprop_kernel` for one forward plan that :func:`supports` accepted
    (``fprop._Plan`` with a ``tma`` tile), called as the gather kernel's launch is: ``(x, weight,
    scale, bias, res, out, conv, part, q, p0, p1, p2, p3, slope_in, slope_out)``.  ``constexprs``: the
    hooks' (``PROLOGUE`` .. ``BIG`` of the gather kernel's, without ``PER_SAMPLE``).

    Persistent: as many programs as fit the device's SMs at once (by shared memory and registers),
    at most one per tile."""

    def __init__(self, tile: Any, m: int, c_in: int, c_out: int, m_tiles: int, sample_rows: int,
                 constexprs: dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        self.tile = tile
        # no more stages than K steps (shared memory is programs per SM), but 2: the ring refills the
        # stage whose MMA the wait before it retired
        stages = max(2, min(tile.num_stages, -(-c_in // tile.block_k)))
        constexprs = dict(constexprs, EVEN_K=c_in % tile.block_k == 0, BLOCK_N=tile.block_n, STAGES=stages,
                          num_warps=tile.num_warps)  # fmt: skip
        tiles = m_tiles * -(-c_out // tile.block_n)
        programs = min(tiles, tma_programs_per_sm(tile, stages) * _multiprocessors(device))
        self.launch = FastLaunch(tma_fprop_kernel, (programs,), constexprs,
                                 fixed=(m, c_in, c_out, m_tiles, sample_rows))  # fmt: skip
        self.a_block, self.b_block = [tile.block_m, tile.block_k], [tile.block_n, tile.block_k]
        self.a_layout, self.b_layout = _shared_layout(self.a_block, dtype), _shared_layout(self.b_block, dtype)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, *pointers: Any) -> None:
        rows, w = _rows(x), _weight_rows(weight)
        a_desc = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), self.a_block, self.a_layout)
        b_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), self.b_block, self.b_layout)
        self.launch(a_desc, b_desc, *pointers)
