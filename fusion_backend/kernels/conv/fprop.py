"""The conv family's forward (fprop): one Triton implicit-GEMM kernel with the load and store hooks,
and its host launcher :func:`conv_fprop`.

``out = epilogue(conv(act_in(prologue(x)), weight))`` for a 1d/2d/3d convolution with any stride,
padding, dilation and groups, in one launch (plus the weight prearrangement, and the relayout of an
``x`` that is not channels-last).

GEMM mapping (every rank lifted to 3d with leading size-1 spatial dims):

* ``M`` = ``N * OD * OH * OW`` output positions, row-major over ``(n, od, oh, ow)``, which is exactly
  the order of a channels-last output: the output is the row-major ``[M, C_out]`` matrix.
* ``N_gemm`` = the group's ``C_out / groups`` output channels; ``K`` = ``C_in / groups * KD * KH *
  KW``, taps outer and channels inner (``tiles`` explains the tap-major and flat K walks).
* Grid ``(M tiles, N tiles, groups)``: program ``(pid_m, pid_n, g)`` owns ``BLOCK_M`` positions and
  ``BLOCK_N`` channels of group ``g``.  It decomposes its rows into ``(n, od, oh, ow)`` once, then runs
  ONE K loop of ``[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]`` ``tl.dot``s into an fp32 accumulator
  (software-pipelined by Triton over ``num_stages``), then the epilogue.
* The weight is read as ``[groups, COUT_PAD, K_ROW]`` in the compute dtype, ``K_ROW`` the K axis of
  one output channel ((tap, channel) order, padded with zeros to a multiple of ``BLOCK_K``; tap-major
  pads each tap's channels), ``COUT_PAD`` the group's channels padded to ``BLOCK_N``: every B tile is
  one unmasked, K-contiguous load.  A channels-last weight whose channels the tile does not pad is
  that matrix already and is read in place; any other is prearranged once per call
  (:func:`prearrange_weight`).
* The A tile is a gather (per-row addresses, a mask per tap), never a box: NOTE: a box load (one
  tensor copy of the input block under a ``BOX_H x BOX_W`` block of the output, the dgrad's and
  wgrad's ``box_w`` tiles) reshaped to ``[BLOCK_M, BLOCK_K]`` reaches the dot from registers: Triton
  (3.6 and 3.9) reads the copied block into registers (LDSM) and issues ``wgmma`` with A from them,
  where the gather's cp.async tile feeds ``wgmma`` from shared memory.  Timed as a candidate on the
  H200 it lost to the gather on all six ResNet-50 rows it was offered in (three shapes, plain and with the
  BatchNorm + ReLU prologue: 0.046 against 0.061 ms on the 3x3 of 64 channels at 56 x 56, 0.037
  against 0.094 at 14 x 14; ``CONVK_SWEEP=0 bash tools/gpu_session.sh convk``, the report's tile
  timings), so the forward has no box path.
* On sm_90 (fp16/bf16, a 1x1 kernel, no padding, one group) the forward may instead run
  its Gluon kernel, ``tma_fprop`` (a ``TileConfig`` with ``tma``), whose tiles join the timed choice
  (``tiles.candidates``).
* One input channel per group (depthwise, any channel multiplier, or a single-channel input): no GEMM
  (its K would be the taps alone) but a direct tile over ``BLOCK_N`` output channels of any groups
  (:func:`_depthwise_tile`), grid ``(M tiles, C_out tiles, 1)``, with the same hooks.

Hooks (``hooks``; device code in ``prologue`` and ``epilogue``): the A tile applies the prologue and
the input activation, then zeroes the padded taps (the conv pads the activated tensor); the store
applies the scale and the bias, the pointwise chain, the output activation, the residual (before or
after that activation) and writes the per-channel partial statistics of the stored values (per M
tile; for GroupNorm's statistics, ``stats_groups``, the M tiles do not cross samples: ``_tile_rows``).

Numerics: fp16/bf16 operands with fp32 accumulation, output in the input dtype; fp32 operands dot
in TF32 (each operand rounded to nearest first, ``kernels.tf32``) iff ``torch.backends.cudnn.
allow_tf32`` (or the caller's ``allow_tf32``) and not under the interpreter, else in full fp32
("ieee").  The prologue runs in fp32 and its result is rounded once to the compute dtype; the
epilogue runs in fp32 and rounds once, at the store.  NaN/inf in ``x`` reach exactly the outputs
whose windows read them (padded taps are zeros chosen by a mask, not products).  No atomics: results
and statistics are deterministic.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ..chain_math import MAX_SLOTS, SOURCE_STRIDE, KernelStep, op_codes
from ..epilogue import OperandMatrix, tensor_rows
from ..host import INTERPRETER, cdiv, element_extent, lift3, multiprocessors
from ..launch import FastLaunch
from ..plan_cache import ContractError, PlanCache, plan_key
from ..tf32 import dot_precision, round_tf32
from . import halo, hooks, tma_fprop
from .boxes import box_grid, box_positions
from .epilogue import store_tile
from .hooks import ActivationLike, Prologue
from .prologue import load_a_tile, load_depthwise_tile, window_rows
from .stats import BatchNormForm, ChannelStats, GroupStats, PartialsReduction, empty_group_stats, empty_stats
from .tiles import TileConfig, cached_plan, candidates, compiling_only, tuned_tile

_INT32_LIMIT = 2**31 - 1
#: Tensors that span more elements than this get int64 offsets (``BIG``); a module constant so that
#: the tests can take that path on small tensors.
_BIG_INDEX_THRESHOLD = _INT32_LIMIT
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Triton's interpreter has no bf16 (numpy has no such type).
_INTERPRETER_DTYPES = (torch.float32, torch.float16)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


@triton.jit
def conv_fprop_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, res_ptr, out_ptr, conv_ptr, part_ptr, q_ptr, p0_ptr, p1_ptr, p2_ptr,
    p3_ptr, slope_in, slope_out,
    M, D, H, W, OD, OH, OW, C_IN, C_OUT, C_OUT_G, M_TILES, SAMPLE_ROWS, SAMPLE_TILES,
    x_sn, x_sd, x_sh, x_sw,
    C_IN_G: tl.constexpr, CIN_PAD: tl.constexpr, K_ROW: tl.constexpr, COUT_PAD: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr,
    SAVE_CONV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, CHAIN: tl.constexpr,
    ACT_OUT: tl.constexpr, RESIDUAL: tl.constexpr,
    STATS: tl.constexpr, PER_SAMPLE: tl.constexpr, PRECISION: tl.constexpr, BIG: tl.constexpr,
    FLAT_K: tl.constexpr, DEPTHWISE: tl.constexpr, ONE_SAMPLE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile of group ``program_id(2)`` (module docstring); with
    ``DEPTHWISE`` (one input channel per group) ``BLOCK_N`` output channels of any groups, computed
    directly (:func:`_depthwise_tile`).

    Pointers (element offsets):
      x_ptr    input (N, C_IN, D, H, W), fp32/fp16/bf16, channel stride 1: element ``(n, c, d, h, w)`` at
               ``n * x_sn + d * x_sd + h * x_sh + w * x_sw + c``.
      w_ptr    the prearranged weight (groups, COUT_PAD, K_ROW), the compute dtype, contiguous, zero
               padded (``prearrange_weight``), or the weight itself where its channels-last memory is that
               matrix; ``DEPTHWISE``: (C_OUT, taps) rows, contiguous.
      scale_ptr, bias_ptr, res_ptr, out_ptr, conv_ptr, part_ptr, q_ptr: ``epilogue.store_tile``'s (out:
               (M, C_OUT) row-major).
      p0..p3   the prologue's vectors (``prologue.normalise``).
    Unused pointers receive any tensor and are never dereferenced.
    Runtime: ``slope_in`` / ``slope_out`` the leaky slopes; ``M = N * OD * OH * OW``; ``C_OUT_G`` the
    group's output channels; ``M_TILES`` the grid's first dim; with ``PER_SAMPLE`` (GroupNorm's
    statistics: no tile crosses a sample) ``SAMPLE_TILES`` tiles per sample of ``SAMPLE_ROWS`` rows
    (:func:`_tile_rows`), else both unused.  Constexprs: ``C_IN_G`` input channels
    per group, ``CIN_PAD`` (tap-major) those rounded up to ``BLOCK_K``, ``K_ROW`` one output channel's
    K extent in ``w``; kernel size ``K*``, stride ``S*``, padding ``P*``, dilation ``D*`` per dim;
    the hooks' codes (``hooks``); ``PRECISION`` the dot's input precision; ``BIG`` int64 offsets;
    ``ONE_SAMPLE``: no tile crosses a sample (one sample, whole tiles per sample, or ``PER_SAMPLE``), so a
    per-sample prologue reads its vectors once per K step (``prologue.normalise``).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    K_ITERS: tl.constexpr = K_ROW // BLOCK_K  # tap-major: taps x CIN_PAD // BLOCK_K channel blocks
    compute = w_ptr.dtype.element_ty
    m, m_ok = _tile_rows(pid_m, M, SAMPLE_ROWS, SAMPLE_TILES, PER_SAMPLE, BLOCK_M)
    if DEPTHWISE:
        c, c_ok, acc = _depthwise_tile(
            x_ptr, w_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, m, m_ok, pid_n, M, D, H, W, OD, OH, OW, C_IN,
            C_OUT, C_OUT_G, x_sn, x_sd, x_sh, x_sw, KD, KH, KW, SD, SH, SW, PD, PH, PW, DD, DH, DW, PROLOGUE,
            G_NORM, NORM_AFFINE, ACT_IN, BIG, BLOCK_M, BLOCK_N)  # fmt: skip
        store_tile(acc, m, m_ok, c, c_ok, pid_m, out_ptr, conv_ptr, scale_ptr, bias_ptr, res_ptr, part_ptr, q_ptr,
                   slope_out, C_OUT, M_TILES, SAVE_CONV, HAS_SCALE, HAS_BIAS, CHAIN, ACT_OUT, RESIDUAL, STATS,
                   BIG)  # fmt: skip
        return

    PADDED: tl.constexpr = (PD > 0) or (PH > 0) or (PW > 0)
    co = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past M read the last row's window (``load_a_tile`` loads them unmasked); never stored
    n, od, oh, ow, id0, ih0, iw0, row_base = window_rows(tl.minimum(m, M - 1), OD, OH, OW, SD, SH, SW, PD, PH, PW,
                                                         x_sn, x_sd, x_sh, x_sw, BIG)  # fmt: skip
    row_base += g * C_IN_G
    if ONE_SAMPLE:  # the tile's sample: its first row's
        if PER_SAMPLE:
            n = pid_m // SAMPLE_TILES
        else:
            n = tl.minimum(pid_m * BLOCK_M, M - 1) // (OD * OH * OW)

    w_cols = w_ptr + g * (COUT_PAD * K_ROW) + co[None, :] * K_ROW  # [1, BLOCK_N]; padded rows: no mask
    kb = tl.arange(0, BLOCK_K)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kk in range(0, K_ITERS):
        a = load_a_tile(x_ptr, kk, row_base, n, id0, ih0, iw0, m_ok, g, D, H, W, x_sd, x_sh, x_sw,
                        p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN,
                        C_IN_G, CIN_PAD, KD, KH, KW, DD, DH, DW, PROLOGUE, G_NORM, NORM_AFFINE, ACT_IN,
                        FLAT_K, PADDED, False, compute, BLOCK_K, ONE_SAMPLE)  # fmt: skip
        b = tl.load(w_cols + (kk * BLOCK_K + kb)[:, None])
        acc = tl.dot(round_tf32(a, PRECISION), round_tf32(b, PRECISION), acc, input_precision=PRECISION)

    store_tile(acc, m, m_ok, g * C_OUT_G + co, co < C_OUT_G, pid_m, out_ptr, conv_ptr, scale_ptr, bias_ptr, res_ptr,
               part_ptr, q_ptr, slope_out, C_OUT, M_TILES, SAVE_CONV, HAS_SCALE, HAS_BIAS, CHAIN, ACT_OUT, RESIDUAL,
               STATS, BIG)  # fmt: skip


@triton.jit
def _tile_rows(pid_m, M, SAMPLE_ROWS, SAMPLE_TILES, PER_SAMPLE: tl.constexpr, BLOCK_M: tl.constexpr):
    """The output rows of M tile ``pid_m`` and which of them are real: ``BLOCK_M`` consecutive rows of
    the ``M``; with ``PER_SAMPLE``, tile ``t`` of sample ``i = pid_m // SAMPLE_TILES`` (``t = pid_m %
    SAMPLE_TILES``), rows ``[t * BLOCK_M, (t + 1) * BLOCK_M)`` of the sample's ``SAMPLE_ROWS``, so that
    a tile's statistics are one sample's (GroupNorm's).  Rows past the end are not real (their
    addresses stay inside the output: a caller clamps them to ``M - 1`` before it reads)."""
    r = tl.arange(0, BLOCK_M)
    if PER_SAMPLE:
        within = (pid_m % SAMPLE_TILES) * BLOCK_M + r
        return (pid_m // SAMPLE_TILES) * SAMPLE_ROWS + within, within < SAMPLE_ROWS
    m = pid_m * BLOCK_M + r
    return m, m < M


@triton.jit
def _depthwise_tile(x_ptr, w_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, m, m_ok, pid_n, M, D, H, W, OD, OH, OW,
                    C_IN, C_OUT, MULT, x_sn, x_sd, x_sh, x_sw,
                    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                    PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                    DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                    PROLOGUE: tl.constexpr, G_NORM: tl.constexpr, NORM_AFFINE: tl.constexpr, ACT_IN: tl.constexpr,
                    BIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The fp32 ``[BLOCK_M, BLOCK_N]`` accumulator of a conv with one input channel per group (depthwise,
    channel multiplier ``MULT``): output channel ``c`` reads input channel ``c // MULT``; per tap, one
    load of the rows' ``BLOCK_N`` input channels (contiguous, channels-last) through the prologue, times
    the channels' weights ``w[c * taps + tap]``, accumulated in fp32 (no dot: K is just the taps), for
    the rows ``m`` (``m_ok`` the real ones; :func:`_tile_rows`).  The input is rounded to the weight's
    dtype before the product, as the GEMM form's operand is.  Returns ``(c, c_ok, acc)`` for the
    epilogue."""
    TAPS: tl.constexpr = KD * KH * KW
    n, od, oh, ow, id0, ih0, iw0, row_base = window_rows(tl.minimum(m, M - 1), OD, OH, OW, SD, SH, SW, PD, PH, PW,
                                                         x_sn, x_sd, x_sh, x_sw, BIG)  # fmt: skip
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = c < C_OUT
    ci = c // MULT
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # NOTE: a loop, not unrolled: unrolled (tl.static_range) the taps' loads were all in flight at once
    # and the hooked tile spilled 612 registers at 64 x 128, 28 at 32 x 128; as a loop 121 registers,
    # no spill (sm_90: ``python tools/compile_check.py conv_family --cases depthwise-bf16-hooked``)
    for tap in range(0, TAPS):
        a = load_depthwise_tile(x_ptr, tap, row_base, n, id0, ih0, iw0, m_ok, ci, c_ok, D, H, W, x_sd, x_sh, x_sw,
                                p0_ptr, p1_ptr, p2_ptr, p3_ptr, slope_in, C_IN, KH, KW, DD, DH, DW, PROLOGUE,
                                G_NORM, NORM_AFFINE, ACT_IN, w_ptr.dtype.element_ty)  # fmt: skip
        wv = tl.load(w_ptr + c * TAPS + tap, mask=c_ok, other=0.0).to(tl.float32)
        acc += a.to(tl.float32) * wv[None, :]
    return c, c_ok, acc


# --------------------------------------------------------------------------------------------------
# Host: geometry, contracts, plan
# --------------------------------------------------------------------------------------------------


def _per_dim(name: str, value: int | Sequence[int], dims: int) -> tuple[int, ...]:
    """A conv hyper-parameter as one int per spatial dim (an int applies to every dim)."""
    if isinstance(value, int):
        return (value,) * dims
    values = tuple(value)
    if len(values) != dims or not all(isinstance(v, int) for v in values):
        raise ContractError(f"{name} must be an int or {dims} ints, got {value!r}")
    return values


def output_size(size: Sequence[int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                dilation: Sequence[int]) -> tuple[int, ...]:  # fmt: skip
    """The output's spatial sizes, as ``torch.nn.functional.conv{1,2,3}d``'s."""
    return tuple((i + 2 * p - d * (k - 1) - 1) // s + 1
                 for i, k, s, p, d in zip(size, kernel, stride, padding, dilation, strict=True))  # fmt: skip


def channels_last(t: torch.Tensor) -> bool:
    """Whether ``t`` (N, C, *spatial) has channel stride 1 (or a single channel): the layout the
    kernel reads, whatever its other strides (a sliced channels-last tensor qualifies)."""
    return t.shape[1] <= 1 or t.stride(1) == 1


def to_channels_last(t: torch.Tensor) -> torch.Tensor:
    """A channels-last dense copy of ``t`` (any rank)."""
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def dense_channels_last(t: torch.Tensor) -> bool:
    """Whether element ``(m, c)`` of ``t`` (N, C, *spatial) seen as the row-major ``[M, C]`` matrix
    lies at ``m * C + c``: its strides are a channels-last dense tensor's in every dim of size > 1
    (the stride of a size-1 dim addresses nothing; torch sets it either way)."""
    want = empty_channels_last(t.shape, t.dtype, torch.device("meta")).stride()
    return all(size <= 1 or st == w for size, st, w in zip(t.shape, t.stride(), want, strict=True))


def empty_channels_last(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised (N, C, *spatial) tensor, channels-last dense (the ``[M, C]`` matrix)."""
    n, c, *spatial = shape
    return torch.empty((n, *spatial, c), dtype=dtype, device=device).movedim(-1, 1)


@dataclass(frozen=True)
class _Geometry:
    """A checked call's sizes, lifted to 3 spatial dims."""

    n: int
    c_in: int
    c_out: int
    groups: int
    size: tuple[int, int, int]
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int]
    dilation: tuple[int, int, int]
    out_size: tuple[int, int, int]
    out_shape: tuple[int, ...]  # the logical output shape, of x's rank

    @property
    def c_in_g(self) -> int:
        return self.c_in // self.groups

    @property
    def c_out_g(self) -> int:
        return self.c_out // self.groups

    @property
    def taps(self) -> int:
        return math.prod(self.kernel)

    @property
    def m(self) -> int:
        return self.n * math.prod(self.out_size)


def _check_call(x: Any, weight: Any, scale: Any, bias: Any, residual: Any, stride: Any, padding: Any, dilation: Any,
                groups: Any, saved: Any = None) -> _Geometry:  # fmt: skip
    """Every contract of the tensors and hyper-parameters but the hooks'; :class:`ContractError`
    (one line) on the first broken one."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ContractError("x and weight must be tensors")
    if not 3 <= x.dim() <= 5:
        raise ContractError(f"x must be (N, C, *spatial) with 1 to 3 spatial dims, got shape {tuple(x.shape)}")
    if weight.dim() != x.dim():
        raise ContractError(f"weight must have x's rank {x.dim()}, got shape {tuple(weight.shape)}")
    device = x.device
    if device.type == "cpu" and not INTERPRETER:
        raise ContractError("x is on cpu: the Triton kernels run on CUDA tensors (on CPU only under TRITON_INTERPRET=1)")
    if device.type not in ("cuda", "cpu"):
        raise ContractError(f"x is on {device}: the Triton kernels run on CUDA tensors")
    dtypes = _INTERPRETER_DTYPES if device.type == "cpu" else _CUDA_DTYPES
    if x.dtype not in dtypes:
        raise ContractError(f"x must be {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}, got {x.dtype}")
    for name, t in (("weight", weight), ("scale", scale), ("bias", bias), ("residual", residual), ("saved", saved)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.device != device):
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ContractError(f"{name} must be a tensor on {device} with x, got {where}")
    if weight.dtype != x.dtype:
        raise ContractError(f"weight dtype {weight.dtype} must match x's {x.dtype}")
    if not isinstance(groups, int) or groups < 1:
        raise ContractError(f"groups must be a positive int, got {groups!r}")
    dims = x.dim() - 2
    n, c_in, c_out = x.shape[0], x.shape[1], weight.shape[0]
    if c_in % groups or c_out % groups:
        raise ContractError(f"groups={groups} must divide C_in={c_in} and C_out={c_out}")
    if weight.shape[1] != c_in // groups:
        raise ContractError(f"weight {tuple(weight.shape)} must have C_in/groups={c_in // groups} input channels")
    kernel = tuple(weight.shape[2:])
    if min(kernel) < 1:
        raise ContractError(f"weight {tuple(weight.shape)} has an empty kernel")
    stride_, padding_, dilation_ = (_per_dim(k, v, dims) for k, v in
                                    (("stride", stride), ("padding", padding), ("dilation", dilation)))  # fmt: skip
    if min(stride_) < 1 or min(dilation_) < 1 or min(padding_) < 0:
        raise ContractError(f"stride {stride_} and dilation {dilation_} must be >= 1, padding {padding_} >= 0")
    out_size = output_size(x.shape[2:], kernel, stride_, padding_, dilation_)
    if min(out_size) < 1 or min(x.shape[2:]) < 1:
        raise ContractError(f"x spatial {tuple(x.shape[2:])} is smaller than the dilated kernel "
                            f"{tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation_, strict=True))} with padding "
                            f"{padding_}: empty output")  # fmt: skip
    out_shape = (n, c_out, *out_size)
    for name, t in (("scale", scale), ("bias", bias)):
        if t is not None and (tuple(t.shape) != (c_out,) or t.dtype not in (x.dtype, torch.float32)
                              or t.stride() != (1,)):  # fmt: skip
            raise ContractError(f"{name} must be ({c_out},) {x.dtype} or float32, contiguous, got {tuple(t.shape)} "
                                f"{t.dtype} strides {t.stride()}")  # fmt: skip
    if residual is not None:
        if tuple(residual.shape) != out_shape or residual.dtype != x.dtype:
            raise ContractError(f"residual must be {out_shape} {x.dtype} like the output, got "
                                f"{tuple(residual.shape)} {residual.dtype}")  # fmt: skip
        if not dense_channels_last(residual):
            want = empty_channels_last(out_shape, x.dtype, torch.device("meta")).stride()
            raise ContractError(f"residual must be channels-last dense (strides {want}) like the output, "
                                f"got strides {residual.stride()}")  # fmt: skip
    if saved is not None and (tuple(saved.shape) != out_shape or saved.dtype not in dtypes
                              or not dense_channels_last(saved)):  # fmt: skip
        raise ContractError(f"saved must be {out_shape}, channels-last dense like the output, of a float dtype "
                            f"the kernels take, got {tuple(saved.shape)} {saved.dtype} strides {saved.stride()}")
    m = n * math.prod(out_size)
    if m > _INT32_LIMIT:
        raise ContractError(f"{m} output positions exceed the kernel's int32 row index")
    return _Geometry(n, c_in, c_out, groups, lift3(x.shape[2:], 1), lift3(kernel, 1), lift3(stride_, 1),
                     lift3(padding_, 0), lift3(dilation_, 1), lift3(out_size, 1), out_shape)  # fmt: skip


def one_sample_tiles(prologue: Any, geo: _Geometry, block_m: int, per_sample_tiles: bool) -> bool:
    """Whether a per-sample prologue (a group affine, a gate) may read its vectors once per tile: every
    ``block_m``-row tile of the output's rows lies in one sample (``per_sample_tiles``: the tiles are cut
    per sample; one sample; or whole tiles per sample).  False for every other prologue (nothing to
    gain, one compile less)."""
    if not isinstance(prologue, (hooks.GroupAffine, hooks.SampleChannelScale)):
        return False
    return per_sample_tiles or geo.n == 1 or math.prod(geo.out_size) % block_m == 0


def prearrange_weight(weight: torch.Tensor, groups: int, tile: TileConfig, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (C_out, C_in/groups, *k) as the kernel reads it: ``(groups, COUT_PAD, K_ROW)`` in
    ``dtype``, contiguous, zeros in the padding.  Row ``co`` of group ``g`` holds output channel ``g *
    C_out/groups + co`` over K in (kd, kh, kw, ci) order (ci contiguous): tap-major, each tap's channels
    padded to ``CIN_PAD`` (a multiple of ``block_k``); flat, the whole K padded to a multiple of
    ``block_k``.  ``COUT_PAD``: C_out/groups rounded up to ``block_n``."""
    c_out, cin_g = weight.shape[0], weight.shape[1]
    cout_g = c_out // groups
    taps = math.prod(weight.shape[2:])
    cout_pad = cdiv(cout_g, tile.block_n) * tile.block_n
    w = weight.reshape(groups, cout_g, cin_g, taps).transpose(2, 3)  # (g, co, tap, ci)
    if tile.flat_k:
        k = taps * cin_g
        buf = torch.zeros((groups, cout_pad, cdiv(k, tile.block_k) * tile.block_k), dtype=dtype, device=weight.device)
        buf[:, :cout_g, :k] = w.reshape(groups, cout_g, k)
        return buf
    cin_pad = cdiv(cin_g, tile.block_k) * tile.block_k
    buf = torch.zeros((groups, cout_pad, taps, cin_pad), dtype=dtype, device=weight.device)
    buf[:, :cout_g, :, :cin_g] = w
    return buf.view(groups, cout_pad, taps * cin_pad)


class _Plan:
    """One launch plan: everything :func:`conv_fprop` derives from a call's signature (shapes,
    strides, dtypes, hook kinds, tile, precision), built once (``_PLANS``); ``run`` binds tensors."""

    def __init__(self, geo: _Geometry, x: torch.Tensor, weight: torch.Tensor, prologue: Prologue | None, act_in: int,
                 act_out: int, has_scale: bool, has_bias: bool, chain: Sequence[KernelStep], residual_mode: int,
                 stats: bool, tile: TileConfig, precision: str, save_conv: bool = False,
                 stats_groups: int = 0) -> None:  # fmt: skip
        self.geo, self.tile, self.stats, self.save_conv = geo, tile, stats or stats_groups > 0, save_conv
        #: GroupNorm's statistics (groups of output channels per sample): tiles that do not cross samples
        self.stats_groups = stats_groups
        self.sample_rows = math.prod(geo.out_size)
        #: the output's strides (channels-last dense), so that a call allocates it in one op
        self.out_stride = empty_channels_last(geo.out_shape, x.dtype, torch.device("meta")).stride()
        #: the chain's operand matrix, assembled per call from its tensor operands (None: no chain)
        self.chain = OperandMatrix(chain, None, geo.c_out, x.device) if chain else None
        self.dtype, self.device = x.dtype, x.device
        #: x is copied to channels-last dense first (its channel stride is not 1)
        self.relayout = not channels_last(x)
        x_sizes = (geo.n, geo.c_in, *geo.size)
        xs = empty_channels_last(x_sizes, x.dtype, torch.device("meta")) if self.relayout else x
        strides = list(xs.stride()[2:])
        x_strides = [xs.stride(0), *([0] * (3 - len(strides))), *strides]  # (sn, sd, sh, sw)
        big = max(element_extent(xs), geo.m * geo.c_out) > _BIG_INDEX_THRESHOLD
        cin_pad = cdiv(geo.c_in_g, tile.block_k) * tile.block_k
        k_row = cdiv(geo.taps * geo.c_in_g, tile.block_k) * tile.block_k if tile.flat_k else geo.taps * cin_pad
        cout_pad = cdiv(geo.c_out_g, tile.block_n) * tile.block_n
        #: the weight is read as it is, not prearranged per call: a channels-last dense weight is the
        #: ``(groups, COUT_PAD, K_ROW)`` matrix already where the tile needs no padding
        self.weight_in_place = (dense_channels_last(weight) and not tile.flat_k and cin_pad == geo.c_in_g
                                and cout_pad == geo.c_out_g)  # fmt: skip
        self.sample_tiles = cdiv(self.sample_rows, tile.block_m)
        self.m_tiles = geo.n * self.sample_tiles if stats_groups else cdiv(geo.m, tile.block_m)
        if tile.box_w:  # the halo kernel's box tiles (``halo`` module docstring), of one sample's plane each
            self.m_tiles = box_grid(geo.size, geo.n, tile, "")[1]
        #: the statistics' positions per partials row where they are not ``block_m`` but the last
        #: (the TMA forward's program lanes, the halo's boxes), else None
        tile_rows = None
        if tile.box_w and self.stats:  # the halo's box tiles: boxes past the plane's edge hold fewer
            tile_rows = box_positions(geo.size, geo.n, tile)
        #: the TMA forward's strided boxes (a 1x1 conv's stride past 1), else None
        strided = None
        if tile.tma:
            if not tma_fprop.supports(x, weight, geo.stride, geo.padding, geo.groups, stats_groups):
                raise ContractError(f"tile {tile.label()}: this call is not one the TMA forward takes "
                                    "(tma_fprop.supports)")
            self.weight_in_place = True  # a 1x1 weight is the [C_out, C_in] matrix its box reads, any layout
            if geo.stride != (1, 1, 1):
                strided = tma_fprop.StridedRows.of(geo.n, geo.c_in, geo.size, geo.out_size, geo.stride,
                                                   tile.block_m)  # fmt: skip
                self.m_tiles = strided.m_tiles
        #: the TMA forward sums a BatchNorm's statistics per program (``tma_fprop.grid_programs``)
        self.program_stats = tile.tma and self.stats and not stats_groups
        #: the TMA forward's store rounds before its layout exchange (no fp32 arithmetic before the rounding)
        rounded = tma_fprop.round_first(False, act_in, save_conv or has_scale or has_bias or bool(chain)
                                        or act_out != 0 or residual_mode != 0)  # fmt: skip
        #: the TMA forward's persistent grid
        programs = (tma_fprop.grid_programs(tile, geo.c_in, geo.c_out, self.m_tiles, x.device, self.program_stats,
                                            tma_fprop.exchange_bytes(rounded)) if tile.tma else 0)  # fmt: skip
        #: rows of the store's partials: one per M tile, or per program lane
        self.partial_rows = self.m_tiles
        if self.program_stats and self.m_tiles:
            rows = (strided.tile_rows() if strided else
                    [min(tile.block_m, geo.m - t * tile.block_m) for t in range(self.m_tiles)])  # fmt: skip
            self.partial_rows = programs // cdiv(geo.c_out, tile.block_n)
            tile_rows = tma_fprop.lane_rows(rows, self.partial_rows)
        #: the launch that turns the store's partials into the statistics (None: no statistics)
        self.reduce = None
        if self.stats and self.m_tiles:
            per_sample = stats_groups > 0
            self.reduce = PartialsReduction(self.partial_rows, geo.c_out, tile.block_m,
                                            self.sample_rows if per_sample else geo.m, x.device,
                                            groups=stats_groups, samples=geo.n if per_sample else 1,
                                            tile_rows=tile_rows, raw_squares=self.program_stats)  # fmt: skip
        #: one input channel per group: the direct depthwise tile (``_depthwise_tile``), over all channels
        self.depthwise = geo.c_in_g == 1
        if self.depthwise:
            self.weight_in_place = False
            grid = (self.m_tiles, cdiv(geo.c_out, tile.block_n), 1)
        else:
            grid = (self.m_tiles, cout_pad // tile.block_n, geo.groups)
        g_norm, norm_affine = 1, False
        if isinstance(prologue, hooks.GroupAffine):
            g_norm, norm_affine = prologue.groups, prologue.weight is not None
        constexprs = dict(
            C_IN_G=geo.c_in_g, CIN_PAD=cin_pad, K_ROW=k_row, COUT_PAD=cout_pad,
            KD=geo.kernel[0], KH=geo.kernel[1], KW=geo.kernel[2],
            SD=geo.stride[0], SH=geo.stride[1], SW=geo.stride[2],
            PD=geo.padding[0], PH=geo.padding[1], PW=geo.padding[2],
            DD=geo.dilation[0], DH=geo.dilation[1], DW=geo.dilation[2],
            PROLOGUE=hooks.prologue_code(prologue), G_NORM=g_norm, NORM_AFFINE=norm_affine, ACT_IN=act_in,
            SAVE_CONV=save_conv, HAS_SCALE=has_scale, HAS_BIAS=has_bias, CHAIN=op_codes(chain), ACT_OUT=act_out,
            RESIDUAL=residual_mode, STATS=self.stats, PER_SAMPLE=stats_groups > 0,
            PRECISION=precision, BIG=big, FLAT_K=tile.flat_k, DEPTHWISE=self.depthwise,
            ONE_SAMPLE=one_sample_tiles(prologue, geo, tile.block_m, stats_groups > 0),
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )  # fmt: skip
        # 0 where unused: Triton specializes an int argument on its value (1, multiples of 16), and a
        # plan without per-sample tiles should not compile apart for its sample's size
        per_sample = (self.sample_rows, self.sample_tiles) if stats_groups else (0, 0)
        fixed = (geo.m, *geo.size, *geo.out_size, geo.c_in, geo.c_out, geo.c_out_g, self.m_tiles, *per_sample,
                 *x_strides)  # fmt: skip
        #: the halo kernel's scratch: one slot per program of its persistent grid (elements; 0: none)
        self.scratch_elems = 0
        if tile.halo:
            why = halo.applies(geo, not self.relayout and dense_channels_last(x), stats_groups > 0)
            if why is not None:
                raise ContractError(f"tile {tile.label()}: the halo kernel does not take {why}")
            rows = halo.halo_rows(tile.block_m, geo.size[2], geo.kernel[1:], geo.dilation[1:], tile.box_w)
            chunk = halo.halo_chunk(rows, tile.block_m, tile.block_n if self.depthwise else tile.block_k)
            cap = cdiv(rows, chunk) * chunk
            n_tiles = cdiv(geo.c_out, tile.block_n) if self.depthwise else cout_pad // tile.block_n
            tiles = (1 if self.depthwise else geo.groups) * self.m_tiles * n_tiles
            programs = max(1, min(tiles, halo.PROGRAMS_PER_SM * multiprocessors(x.device)))
            self.scratch_elems = programs * cap * (tile.block_n if self.depthwise else tile.block_k)
            keep = ("C_IN_G", "CIN_PAD", "K_ROW", "COUT_PAD", "KH", "KW", "PH", "PW", "DH", "DW", "PROLOGUE", "G_NORM",
                    "NORM_AFFINE", "ACT_IN", "SAVE_CONV", "HAS_SCALE", "HAS_BIAS", "CHAIN", "ACT_OUT", "RESIDUAL",
                    "STATS", "PRECISION", "BIG", "DEPTHWISE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps",
                    "num_stages")  # fmt: skip
            # the halo's windows cross samples: one sample's vectors only where x holds one
            halo_constexprs = dict({k: constexprs[k] for k in keep}, HALO_CAP=cap, HALO_CHUNK=chunk,
                                   ONE_SAMPLE=constexprs["ONE_SAMPLE"] and geo.n == 1, BOX_W=tile.box_w)  # fmt: skip
            halo_fixed = (geo.m, geo.size[1], geo.size[2], geo.c_in, geo.c_out, geo.c_out_g, self.m_tiles, n_tiles,
                          tiles, rows)  # fmt: skip
            self.launch = FastLaunch(halo.conv_fprop_halo_kernel, (programs,), halo_constexprs, fixed=halo_fixed)
        elif tile.tma:
            hook_codes = {k: constexprs[k] for k in ("PROLOGUE", "G_NORM", "NORM_AFFINE", "ACT_IN", "SAVE_CONV",
                                                     "HAS_SCALE", "HAS_BIAS", "CHAIN", "ACT_OUT", "RESIDUAL",
                                                     "STATS", "BIG")}  # fmt: skip
            self.launch = tma_fprop.TmaLaunch(tile, geo, self.m_tiles, programs, hook_codes, self.program_stats,
                                              x.dtype, rounded, strided=strided)  # fmt: skip
        else:
            self.launch = FastLaunch(conv_fprop_kernel, grid, constexprs, fixed=fixed)

    def run(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
            chain: Sequence[KernelStep], residual: torch.Tensor | None, prologue: Prologue | None,
            slopes: tuple[float, float], saved: torch.Tensor | None = None, bn_form: BatchNormForm | None = None,
            ) -> tuple[torch.Tensor, ChannelStats | GroupStats | None]:  # fmt: skip
        geo = self.geo
        if self.save_conv and saved is None:
            raise ContractError("this plan writes the conv's raw result: pass saved")
        if bn_form is not None:
            _check_bn_form(bn_form, self.stats and not self.stats_groups, geo.c_out, self.device)
        if geo.m == 0:  # N == 0: nothing to launch
            out = empty_channels_last(geo.out_shape, self.dtype, self.device)
            return out, self._empty_stats(bn_form)
        if self.relayout:
            x = to_channels_last(x)
        if self.depthwise:  # (C_out, taps) rows, as the weight of one input channel per group is laid out
            w = weight.reshape(geo.c_out, geo.taps).contiguous()
        elif self.weight_in_place:
            w = weight
        else:
            w = prearrange_weight(weight, geo.groups, self.tile, self.dtype)
        out = torch.empty_strided(geo.out_shape, self.out_stride, dtype=self.dtype, device=self.device)
        partials = None
        if self.stats:
            partials = torch.empty((3, self.partial_rows, geo.c_out), dtype=torch.float32, device=self.device)
        p = [out if t is None else t for t in hooks.prologue_tensors(prologue)]
        q = out if self.chain is None else self.chain.build(tensor_rows(chain, None))
        scratch = (torch.empty(self.scratch_elems, dtype=w.dtype, device=self.device),) if self.scratch_elems else ()
        self.launch(x, w, out if scale is None else scale, out if bias is None else bias,
                    out if residual is None else residual, out, saved if self.save_conv else out,
                    out if partials is None else partials, q, *p, *slopes, *scratch)  # fmt: skip
        if partials is None:
            return out, None
        return out, self.reduce(partials, bn_form)

    def _empty_stats(self, bn_form: BatchNormForm | None) -> ChannelStats | GroupStats | None:
        if not self.stats:
            return None
        if self.stats_groups:
            return empty_group_stats(self.stats_groups, self.sample_rows * self.geo.c_out // self.stats_groups,
                                     self.device)  # fmt: skip
        stats = empty_stats(self.geo.c_out, self.device)
        if bn_form is None:
            return stats
        # the form of no values: every row undefined (the mean, and with it rstd and the variance)
        return dataclasses.replace(stats, form=torch.full((3, self.geo.c_out), math.nan, device=self.device))


def _check_bn_form(bn_form: Any, channel_stats: bool, c_out: int, device: torch.device) -> None:
    """``bn_form``'s contract (``conv_fprop``), one line per broken part."""
    if not isinstance(bn_form, BatchNormForm):
        raise ContractError(f"bn_form must be a stats.BatchNormForm or None, got {type(bn_form).__name__}")
    if not channel_stats:
        raise ContractError("bn_form needs the output's channel statistics (stats=True, stats_groups=0)")
    bias = bn_form.bias
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.is_floating_point() and bias.dim() == 1
                                 and bias.numel() == c_out and bias.is_contiguous() and bias.device == device):
        raise ContractError(f"bn_form.bias must be None or {c_out} contiguous float values on {device}")


#: Launch plans by ``plan_key`` of a call's signature.
_PLANS = PlanCache()


def conv_fprop(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    prologue: Prologue | None = None,
    act_in: ActivationLike = None,
    scale: torch.Tensor | None = None,
    chain: Sequence[KernelStep] = (),
    act_out: ActivationLike = None,
    residual: torch.Tensor | None = None,
    residual_after_act: bool = False,
    stats: bool = False,
    stats_groups: int = 0,
    saved: torch.Tensor | None = None,
    tile: TileConfig | None = None,
    allow_tf32: bool | None = None,
    bn_form: BatchNormForm | None = None,
) -> tuple[torch.Tensor, ChannelStats | GroupStats | None]:
    """``out = act_out(chain(conv(act_in(prologue(x)), weight) * scale + bias) [+ residual]) [+ residual]``
    and, with ``stats``, the next normalization's statistics of ``out``, in one kernel launch.

    x         (N, C_in, *spatial), 1 to 3 spatial dims, fp32/fp16/bf16 (no bf16 under the interpreter),
              on CUDA (on CPU under ``TRITON_INTERPRET=1``).  Channels-last strides (channel stride 1;
              any other strides, e.g. a slice) are read in place; any other layout (NCHW) is copied
              once to channels-last first (one extra pass over ``x``).
    weight    (C_out, C_in/groups, *k), x's dtype, any strides: read in place where it is channels-last
              dense and the tile divides its channels per group, else prearranged per call.
    scale     None or (C_out,), x's dtype or fp32, contiguous: multiplies the conv's fp32 result before
              the bias (a folded eval BatchNorm: ``scale`` its scale, ``bias`` its shift; no operand
              matrix to build per call, unlike the same steps in ``chain``).
    bias      None or (C_out,), x's dtype or fp32, contiguous.
    stride, padding, dilation: an int or one int per spatial dim (symmetric padding, as ``F.conv*d``).
    groups    divides C_in and C_out; one input channel per group (depthwise, any channel multiplier,
              or a single-channel input) runs a direct tile of its own, not the GEMM.
    prologue  None, ``hooks.ChannelAffine``, ``hooks.GroupAffine`` or ``hooks.SampleChannelScale``:
              applied to every loaded element of ``x``, then ``act_in``; padded taps are 0 after both.
    act_in, act_out: None, "relu", "leaky_relu" (slope 0.01), "gelu" (erf), "silu", or ``hooks.Activation``.
    chain     up to ``chain_math.MAX_SLOTS`` pointwise steps ``(op code, operands)`` (``chain_math.KernelStep``)
              applied after the bias: e.g. a folded eval BatchNorm ``[(MUL, [scale]), (ADD, [shift])]`` or
              a per-channel multiplier and activations; an operand is a number or a tensor of 1 or
              C_out values on x's device.
    residual  None or a tensor of the output's shape and dtype, channels-last dense; added before
              ``act_out`` (ResNet) or, with ``residual_after_act``, after it.
    stats     also return ``stats.ChannelStats`` of the stored output (BatchNorm's: per channel over the
              batch; deterministic; ``epilogue``).
    stats_groups: G > 0 instead returns ``stats.GroupStats`` (GroupNorm's: per sample and group of
              ``C_out / G`` consecutive channels; G divides C_out); its tiles then do not cross samples.
    saved     None or a tensor of the output's shape, channels-last dense, fp32/fp16/bf16: also written,
              with the conv's raw result rounded to its dtype (before scale, bias, chain and residual),
              which a training forward keeps for its backward.
    tile      a ``TileConfig`` (None: ``tiles.tuned_tile``'s: timed on CUDA once per signature).
    allow_tf32: fp32 dots in TF32 (never under the interpreter); None: ``torch.backends.cudnn.allow_tf32``,
              eager's rule for a conv.  A caller that knows eager's conv of these tensors runs in full
              fp32 anyway (cuDNN does for 3 input channels) passes False.

    bn_form   None or a ``stats.BatchNormForm`` (with ``stats``): the statistics' ``form`` is then their
              ``batch_norm_form(bn_form.bias, bn_form.eps)``, made by the launch that combines them.

    Returns ``(out, stats or None)``: out (N, C_out, *out_spatial) as ``F.conv*d`` shapes it, x's dtype,
    channels-last dense.  N == 0 returns an empty output (and zero statistics) without a launch.
    Raises ``plan_cache.ContractError`` (a ``ValueError``, one line) for any broken contract before
    anything launches.
    """
    plan = fprop_plan(x, weight, bias, stride=stride, padding=padding, dilation=dilation, groups=groups,
                      prologue=prologue, act_in=act_in, scale=scale, chain=chain, act_out=act_out, residual=residual,
                      residual_after_act=residual_after_act, stats=stats, stats_groups=stats_groups, saved=saved,
                      tile=tile, allow_tf32=allow_tf32)  # fmt: skip
    return plan(x, weight, scale, bias, chain, residual, prologue, saved, bn_form)


@dataclass(frozen=True)
class FpropCall:
    """A :func:`conv_fprop` plan bound to its signature's activation slopes: ``call(x, weight, scale,
    bias, chain, residual, prologue, saved)`` launches it on a call of that signature (tensors of the same
    shapes, strides, dtypes and devices; chain operands of the same sizes).  ``final``: False where it
    was made while launches only compile (``tiles.cached_plan``: its tile untimed), so that a caller
    keeping it asks :func:`fprop_plan` again at its next call."""

    plan: _Plan
    slopes: tuple[float, float]
    final: bool

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                 chain: Sequence[KernelStep], residual: torch.Tensor | None, prologue: Prologue | None,
                 saved: torch.Tensor | None = None, bn_form: BatchNormForm | None = None,
                 ) -> tuple[torch.Tensor, ChannelStats | GroupStats | None]:  # fmt: skip
        return self.plan.run(x, weight, scale, bias, chain, residual, prologue, self.slopes, saved, bn_form)


def fprop_plan(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    prologue: Prologue | None = None,
    act_in: ActivationLike = None,
    scale: torch.Tensor | None = None,
    chain: Sequence[KernelStep] = (),
    act_out: ActivationLike = None,
    residual: torch.Tensor | None = None,
    residual_after_act: bool = False,
    stats: bool = False,
    stats_groups: int = 0,
    saved: torch.Tensor | None = None,
    tile: TileConfig | None = None,
    allow_tf32: bool | None = None,
) -> FpropCall:
    """The launch plan :func:`conv_fprop` runs for these arguments' signature (the same arguments, the
    same contracts, checked here once), as an :class:`FpropCall` that a caller whose calls share one
    signature may keep and call with each call's tensors, without building the plan key again."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ContractError("x and weight must be tensors")
    if tile is not None and not isinstance(tile, TileConfig):
        raise ContractError(f"tile must be a TileConfig or None, got {type(tile).__name__}")
    a_in = hooks.as_activation(act_in, "act_in")
    a_out = hooks.as_activation(act_out, "act_out")
    code_in, slope_in = hooks.activation_args(a_in)
    code_out, slope_out = hooks.activation_args(a_out)
    residual_mode = hooks.RESIDUAL_NONE if residual is None else (
        hooks.RESIDUAL_AFTER_ACT if residual_after_act else hooks.RESIDUAL_BEFORE_ACT)  # fmt: skip
    precision_flag = bool(torch.backends.cudnn.allow_tf32 if allow_tf32 is None else allow_tf32)
    key = plan_key(x, weight, scale, bias, residual, saved, *hooks.prologue_tensors(prologue), hooks.plan_parts(prologue),
                   _hashable(stride), _hashable(padding), _hashable(dilation), groups, code_in, code_out,
                   _chain_key(chain), residual_mode, bool(stats), stats_groups, tile, precision_flag)  # fmt: skip

    def build() -> _Plan:
        geo = _check_call(x, weight, scale, bias, residual, stride, padding, dilation, groups, saved)
        if not isinstance(stats_groups, int) or isinstance(stats_groups, bool) or stats_groups < 0:
            raise ContractError(f"stats_groups must be an int >= 0, got {stats_groups!r}")
        if stats_groups and geo.c_out % stats_groups:
            raise ContractError(f"stats_groups={stats_groups} must divide the {geo.c_out} output channels")
        hooks.check_prologue(prologue, geo.n, geo.c_in, x.device)
        _check_chain(chain, geo.c_out, x.device)
        precision = dot_precision(x.dtype, precision_flag, INTERPRETER)

        def plan_with(t: TileConfig) -> _Plan:
            t.check_for("fprop")
            return _Plan(geo, x, weight, prologue, code_in, code_out, scale is not None, bias is not None, chain,
                         residual_mode, bool(stats), t, precision, saved is not None, stats_groups)  # fmt: skip

        if tile is not None:
            return plan_with(tile)
        with_halo = ((prologue is not None or code_in != 0) and geo.taps > 1
                     and halo.applies(geo, not channels_last(x) or dense_channels_last(x), stats_groups > 0) is None)
        tiles = candidates("fprop", geo.c_in_g, geo.c_out_g, geo.taps, geo.m, x.dtype,
                           geo.c_out if geo.c_in_g == 1 else None,  # the direct depthwise path (``_Plan.depthwise``)
                           tma=tma_fprop.supports(x, weight, geo.stride, geo.padding, geo.groups, stats_groups),
                           plain=prologue is None and code_in == 0 and not stats, halo=with_halo,
                           # NOTE: with statistics the flat halo.  Box tiles take them (``boxes.box_positions``)
                           # but were no faster: ResNet-50's hooked 3x3s with statistics, H200 bf16, best flat /
                           # best box ms 0.0936 / 0.0887, 0.0637 / 0.0692, 0.0513 / 0.0511, 0.0588 / 0.0622
                           # (``bash tools/gpu_session.sh halo``: ``sweep_conv_tiles.py --hooked --halo --box``)
                           halo_window=(geo.size[1:], geo.kernel[1:], geo.dilation[1:]) if with_halo and not stats
                           else None)  # fmt: skip
        return plan_with(tuned_tile("fprop", key, tiles, lambda t: functools.partial(
            plan_with(t).run, x, weight, scale, bias, chain, residual, prologue, (slope_in, slope_out), saved),
            x.device))  # fmt: skip

    return FpropCall(cached_plan(_PLANS, key, build), (slope_in, slope_out), not compiling_only())


def _chain_key(chain: Sequence[KernelStep]) -> tuple:
    """What a plan depends on in ``chain``: the op codes and the constant operands (a plan's operand
    matrix bakes them in); a tensor operand by its size (its values are bound per call)."""
    try:
        return tuple((int(code), tuple(("tensor", v.numel()) if isinstance(v, torch.Tensor) else float(v)
                                       for v in operands)) for code, operands in chain)  # fmt: skip
    except (TypeError, ValueError):
        raise ContractError(f"chain must be a sequence of (op code, operands) steps, got {chain!r}") from None


def _check_chain(chain: Sequence[KernelStep], c_out: int, device: torch.device) -> None:
    """Raise :class:`ContractError` unless ``chain`` fits the template: at most ``MAX_SLOTS`` steps of
    known op codes, each reading the flowing value (no step reading an earlier chain value, which the
    family does not take yet), each operand a number or a tensor of 1 or ``c_out`` values on ``device``."""
    if len(chain) > MAX_SLOTS:
        raise ContractError(f"chain: at most {MAX_SLOTS} steps fit the kernel, got {len(chain)}")
    try:
        codes = op_codes(chain)
    except ValueError as exc:
        raise ContractError(f"chain: {exc}") from None
    if any(code >= SOURCE_STRIDE for code in codes):
        raise ContractError("chain: a step whose operand is an earlier chain value is not supported here")
    for slot, (_, operands) in enumerate(chain):
        for value in operands:
            if isinstance(value, torch.Tensor) and (value.numel() not in (1, c_out) or value.device != device):
                raise ContractError(f"chain step {slot}: a tensor operand must hold 1 or C_out={c_out} values on "
                                    f"{device}, got {tuple(value.shape)} on {value.device}")  # fmt: skip


def _hashable(value: Any) -> Any:
    """A hyper-parameter as a plan-key part (lists become tuples)."""
    return tuple(value) if isinstance(value, (list, tuple)) else value
