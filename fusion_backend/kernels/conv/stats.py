"""Statistics of a conv's output, as the epilogue produces them for the next normalization: per
channel for a BatchNorm (:class:`ChannelStats`), per sample and group of channels for a GroupNorm
(:class:`GroupStats`, from a launch whose tiles do not cross samples).

The kernel writes one row of partials per M tile (``epilogue.store_tile``), each channel's: a shift
``k`` (the tile's mean as fp32 rounds it), the sum of the values less ``k``, and the sum of their
squared deviations from their mean.  :class:`PartialsReduction` combines the tiles as Chan et al.'s
parallel variance does, in float64, in one launch (:func:`combine_partials_kernel`) that walks them in a
fixed order: the result is the same bits on every run (no atomics anywhere).  WHY the shift: where a channel's mean dwarfs its spread (a
conv with a large bias), an fp32 tile sum rounds at ``2**-24`` of the sum, and so would an fp32 mean;
the tile's mean as ``k`` plus the small, nearly exact sum of ``y - k`` keeps it.  And WHY not sums of
squares: ``E[y^2] - E[y]^2`` from fp32 partials leaves the rounding of ``mean^2`` as an error of the
variance itself, where eager's BatchNorm (Welford) has none.  NOTE: on the case of
``tests/kernels/test_conv_family_fprop.py -k dwarfs`` (a bias of 3000 over a spread of about 1, fp32,
16-row tiles) the variance was 4-22% off with fp32 sums and sums of squares per tile, 2e-6-3e-5 off
with tile sums and deviations without the shift, and is 4e-10-2.5e-8 off with it (fp32 ``Tensor.var``
of the same output: 3e-9-3e-8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import arrival
from ..arrival import last_to_arrive
from ..host import cdiv, next_pow2
from ..launch import FastLaunch
from ..plan_cache import ContractError, PlanCache
from .split_sum import sum_dim


@dataclass(frozen=True)
class ChannelStats:
    """``sum`` and ``m2``: float64 ``(C_out,)`` sums over the ``count`` output positions (``N * OD * OH
    * OW``) of each channel's stored values and of their squared deviations from the channel's mean."""

    sum: torch.Tensor
    m2: torch.Tensor
    count: int
    #: fp32 ``(3, C_out)``, :meth:`batch_norm_form` of the sums made by the reduction that made them
    #: where its caller asked for it (``BatchNormForm``), else None
    form: torch.Tensor | None = None

    def mean(self) -> torch.Tensor:
        """float64 ``(C_out,)`` mean (NaN for an empty output)."""
        return self.sum / self.count if self.count else torch.full_like(self.sum, float("nan"))

    def var(self, unbiased: bool = False) -> torch.Tensor:
        """float64 ``(C_out,)`` variance, biased (BatchNorm normalises with it) or unbiased (its
        running estimate); NaN where the count does not define it."""
        if self.count - int(unbiased) <= 0:
            return torch.full_like(self.m2, float("nan"))
        return self.m2 / (self.count - int(unbiased))

    def batch_norm_form(self, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        """The statistics as BatchNorm's kernels take them (``kernels.batch_norm.batch_norm_stats``'s
        form), of the values plus ``bias`` (None or ``(C_out,)`` contiguous, any float dtype): fp32 ``(3,
        C_out)``, row 0 the mean, row 1 ``1 / sqrt(var + eps)`` (biased ``var``), row 2 the unbiased
        variance; one launch.  Needs more than one value per channel."""
        c = self.sum.shape[0]
        out = torch.empty((3, c), dtype=torch.float32, device=self.sum.device)
        has_bias = bias is not None
        launch = _FORM_LAUNCHES.plan((c, has_bias), lambda: FastLaunch(
            _batch_norm_form_kernel, (triton.cdiv(c, _BLOCK_C),), dict(HAS_BIAS=has_bias, BLOCK_C=_BLOCK_C)))
        launch(self.sum, self.m2, bias if has_bias else self.sum, out, c, int(self.count), float(eps))
        return out

    def sum_sq(self) -> torch.Tensor:
        """float64 ``(C_out,)`` sums of the squared values (``m2 + sum^2 / count``), for comparisons
        with a pass that sums squares."""
        return self.m2 + (self.sum * self.sum / self.count if self.count else 0.0)


@dataclass(frozen=True)
class GroupStats(ChannelStats):
    """GroupNorm's statistics of a conv's output, as :class:`ChannelStats` (its methods too) with
    ``sum`` and ``m2`` float64 ``(N, G)`` over the ``count`` values (``C_out / G`` channels times ``OD *
    OH * OW`` positions) of each sample's group of channels; GroupNorm normalises with the biased
    ``var()``."""


# NOTE: the ~13 float64 torch ops that combined the partials before cost 0.07-0.13 ms of GPU time per
# forward on ResNet-50's convs (the statistics-hooked forward 3.7x the plain one); one launch over
# channel blocks alone still cost 0.05-0.26 ms (4 programs on a 64-channel output walking 1,568-6,272
# tiles, a float64 division per value): 1.84x.  Hence the split over tiles and one reciprocal per tile
# (``CONVK_STATS=1 CONVK_TESTS=0 CONVK_BENCH=0 CONVK_SWEEP=0 bash tools/gpu_session.sh convk``).
_BLOCK_C = 16  # channels per program (BatchNorm's statistics) or per step over a group's channels
#: tiles per step, and per span (a program along the tiles).  NOTE: a program walking two steps over the
#: TMA forward's 264 program lanes took 9.4 us against 8.3 for spans combined by a second launch (H200,
#: ResNet-50's 64 -> 64 1x1 at 56 x 56 with its statistics, ``python tools/bench_conv.py
#: demos/realnets/resnet50.py --passes fprop --profile --filter '*64x64x56x56 -> 64 k1x1*'``), and
#: spilled on sm_90.  And on 4 warps 256 x 16 spilled 8
#: registers, on 8 none (sm_90: ``python tools/compile_check.py conv_family --cases
#: resnet_3x3-bf16-hooked --kernels combine``)
_MAX_BLOCK_T = 256
# NOTE: the reduction is latency, not work: spans of 16 to 256 tiles took 9.3-10.3 us on 1,568 tiles of 64
# channels as two launches, and one launch over 25 tiles 4.2 (H200, ``PartialsReduction`` timed alone by
# ``impl_choice.gpu_ms_per_call``).  The spans combined by the last program to arrive (``arrival``) instead
# of a second launch: the same 8.6 us of kernel time, the gap between the launches gone (the 3x3 of 64
# channels at 56 x 56 with its statistics 0.0669 -> 0.0653 ms, the 1x1 of 256 -> 64 0.0469 -> 0.0450), and
# BatchNorm's form written by that launch instead of one of its own (``conv_fprop`` + ``batch_norm_form``
# 48.0 -> 45.8 us on the 1x1; ``docs/perf/RESULTS.md``, "The statistics' reduction and BatchNorm's form in
# one launch").  Combining in the forward kernel itself (the program completing a group of tiles combines
# it, the one completing the last group the groups) was slower on every row: its float64 registers cost
# every tile's occupancy (the 3x3 0.0669 -> 0.0821 ms, the 7x7 stem 0.233 -> 0.460; ``python
# tools/bench_conv.py demos/realnets/resnet50.py --passes fprop --fprop-hooks stats --shard 1/2``).


@triton.jit
def combine_partials_kernel(part_ptr, sum_ptr, m2_ptr, rows_ptr, span_ptr, span_rows_ptr, count_ptr, bias_ptr,
                            form_ptr, eps, M_TILES, C, TILES, ROWS, CG, GROUPS, PER_GROUP: tl.constexpr,
                            SPANS: tl.constexpr, ROWS_GIVEN: tl.constexpr, RAW_SQUARES: tl.constexpr,
                            FORM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """Combine per-tile partials into float64 sums and sums of squared deviations, in one launch.

    ``part_ptr``: ``(3, M_TILES, C)`` contiguous fp32 (the store's): per tile and channel a shift ``k``,
    the sum of the values less ``k``, their sum of squared deviations from their mean.  Tile ``t`` (of
    ``M_TILES``, or of a sample's run of ``TILES``) holds ``min(BLOCK_M, ROWS - t * BLOCK_M)`` values per
    channel, or with ``ROWS_GIVEN`` ``rows_ptr[t]`` (float64 ``(M_TILES,)``; a "tile" that is a program's
    sum over several tiles, as the TMA forward's: the programs hold unequal counts).  ``RAW_SQUARES``: row
    2 holds the sum of the squared values less ``k`` instead, turned into their squared deviations here,
    in float64 (``Σe^2 - (Σe)^2 / n``: partials of a program's many tiles, whose shift is near but not
    at their mean).

    * ``PER_GROUP`` False (BatchNorm): program ``(p, s)`` owns channels ``[p * BLOCK_C, (p + 1) *
      BLOCK_C)`` over tiles ``[s * TILES, (s + 1) * TILES)`` (``ROWS`` the output positions) and writes
      ``sum_ptr[c]`` and ``m2_ptr[c]`` (float64 ``(C,)``).  With ``SPANS`` (more than one program along
      tiles) it stores its span's partials, float64 ``(3, programs along tiles, C)`` at ``span_ptr``
      (mean, 0, M2; the span's rows at ``span_rows_ptr[s]`` with ``ROWS_GIVEN``), and the last program of
      its channels to arrive (``arrival.last_to_arrive`` on ``count_ptr[p]``, int32 zeros) combines the
      spans in their order and writes the sums.  With ``FORM`` the program writing the sums also writes
      BatchNorm's form of them, fp32 ``(3, C)`` at ``form_ptr`` (:func:`_form_rows`, plus ``bias_ptr``
      with ``HAS_BIAS``).
    * ``PER_GROUP`` True (GroupNorm): program ``p = i * GROUPS + g`` owns sample ``i``'s ``TILES`` tiles
      (``ROWS`` its positions) and the ``CG`` channels of group ``g`` and writes ``sum_ptr[p]``,
      ``m2_ptr[p]`` (float64 ``(N, GROUPS)``).

    Each step loads ``BLOCK_T`` tiles of ``BLOCK_C`` channels (:func:`_moments`) and merges them into
    the running sums (Chan et al.): a fixed order, so the result is the same bits every run.
    """
    pid = tl.program_id(0)
    lane_c = tl.arange(0, BLOCK_C)
    if PER_GROUP:
        tile0 = (pid // GROUPS) * TILES  # the sample's first tile; tile indices below are the sample's
        c0 = (pid % GROUPS) * CG
        n_run = tl.sum(tl.zeros([BLOCK_C], tl.float64), axis=0)  # a float64 scalar: the group's count, sum, M2
        s_run = n_run
        m_run = n_run
        for cb in range(0, CG, BLOCK_C):
            c_ok = cb + lane_c < CG
            n_c, s_c, m_c = _moments(part_ptr, rows_ptr, tile0, 0, TILES, c0 + cb + lane_c, c_ok, M_TILES, C, ROWS,
                                     BLOCK_M, ROWS_GIVEN, RAW_SQUARES, BLOCK_T, BLOCK_C, "")  # fmt: skip
            # the chunk's channels (each over the same tiles) into the group's running values
            n_g = tl.sum(n_c, axis=0)
            s_g = tl.sum(s_c, axis=0)
            dev_c = tl.where(c_ok, s_c / tl.maximum(n_c, 1.0) - s_g / tl.maximum(n_g, 1.0), 0.0)
            m_g = tl.sum(m_c, axis=0) + tl.sum(n_c * dev_c * dev_c, axis=0)
            n_run, s_run, m_run = _merge(n_run, s_run, m_run, n_g, s_g, m_g)
        tl.store(sum_ptr + pid, s_run)
        tl.store(m2_ptr + pid, m_run)
    else:
        split = tl.program_id(1)
        c = pid * BLOCK_C + lane_c
        c_ok = c < C
        t_first = split * TILES
        n_c, s_c, m_c = _moments(part_ptr, rows_ptr, 0, t_first, tl.minimum(t_first + TILES, M_TILES), c, c_ok,
                                 M_TILES, C, ROWS, BLOCK_M, ROWS_GIVEN, RAW_SQUARES, BLOCK_T, BLOCK_C, "")  # fmt: skip
        if SPANS:
            spans = tl.num_programs(1)
            tl.store(span_ptr + split * C + c, s_c / tl.maximum(n_c, 1.0), mask=c_ok)
            tl.store(span_ptr + (spans + split) * C + c, tl.zeros([BLOCK_C], tl.float64), mask=c_ok)
            tl.store(span_ptr + (2 * spans + split) * C + c, m_c, mask=c_ok)
            if last_to_arrive(count_ptr + pid, spans):
                span_cap = (TILES * BLOCK_M).to(tl.float64)  # a span's rows, the last's fewer
                n_a, s_a, m_a = _moments(span_ptr, span_rows_ptr, 0, 0, spans, c, c_ok, spans, C, ROWS, span_cap,
                                         ROWS_GIVEN, False, BLOCK_S, BLOCK_C, ".cg")  # fmt: skip
                _store_sums(sum_ptr, m2_ptr, form_ptr, bias_ptr, c, c_ok, s_a, m_a, C, ROWS, eps, FORM, HAS_BIAS)
        else:
            _store_sums(sum_ptr, m2_ptr, form_ptr, bias_ptr, c, c_ok, s_c, m_c, C, ROWS, eps, FORM, HAS_BIAS)


@triton.jit
def _moments(part_ptr, rows_ptr, tile0, t_first, t_end, c, c_ok, T_STRIDE, C, ROWS, TILE_CAP, ROWS_GIVEN: tl.constexpr,
             RAW_SQUARES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
    """float64 ``(count, sum, M2)`` ``[BLOCK_C]`` of channels ``c`` over tiles ``[t_first, t_end)`` of the
    partials ``(3, T_STRIDE, C)`` at ``part_ptr`` (tile ``t`` at row ``tile0 + t``; shift, shifted sum,
    squared deviations, or squares with ``RAW_SQUARES``), ``BLOCK_T`` tiles per step.  Tile ``t`` holds
    ``rows_ptr[tile0 + t]`` values with ``ROWS_GIVEN``, else ``min(TILE_CAP, ROWS - t * TILE_CAP)``.
    ``CACHE``: the loads' cache modifier (``".cg"`` for partials other programs of the launch stored)."""
    zero = tl.zeros([BLOCK_C], tl.float64)
    n_c = zero
    s_c = zero
    m_c = zero
    lane_t = tl.arange(0, BLOCK_T)
    for tb in range(t_first, t_end, BLOCK_T):
        t = tb + lane_t
        t_ok = t < t_end
        if ROWS_GIVEN:
            rows = tl.load(rows_ptr + tile0 + t, mask=t_ok, other=0.0)
        else:
            rows = tl.where(t_ok, tl.minimum(ROWS - t.to(tl.float64) * TILE_CAP, TILE_CAP), 0.0)
        inv_rows = 1.0 / tl.maximum(rows, 1.0)  # one division per tile, not per value
        ok = t_ok[:, None] & c_ok[None, :]
        r = tl.where(ok, rows[:, None], 0.0)
        offs = (tile0 + t).to(tl.int64)[:, None] * C + c[None, :]  # 3 * T_STRIDE * C may pass 2**31
        k = tl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=CACHE).to(tl.float64)
        e = tl.load(part_ptr + T_STRIDE * C + offs, mask=ok, other=0.0, cache_modifier=CACHE).to(tl.float64)
        q = tl.load(part_ptr + 2 * T_STRIDE * C + offs, mask=ok, other=0.0, cache_modifier=CACHE).to(tl.float64)
        if RAW_SQUARES:
            q = tl.where(ok, q - e * e * inv_rows[:, None], 0.0)
        n_b = tl.sum(r, axis=0)
        s_b = tl.sum(r * k + e, axis=0)
        mean_b = s_b / tl.maximum(n_b, 1.0)
        dev = tl.where(ok, k + e * inv_rows[:, None] - mean_b[None, :], 0.0)
        m_b = tl.sum(q, axis=0) + tl.sum(r * dev * dev, axis=0)
        n_c, s_c, m_c = _merge(n_c, s_c, m_c, n_b, s_b, m_b)
    return n_c, s_c, m_c


@triton.jit
def _store_sums(sum_ptr, m2_ptr, form_ptr, bias_ptr, c, c_ok, total, m2, C, COUNT, eps, FORM: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """Store channels ``c``'s float64 sums and M2, and with ``FORM`` their BatchNorm form (:func:`_form_rows`)."""
    tl.store(sum_ptr + c, total, mask=c_ok)
    tl.store(m2_ptr + c, m2, mask=c_ok)
    if FORM:
        _form_rows(form_ptr, bias_ptr, c, c_ok, total, m2, C, COUNT, eps, HAS_BIAS)


@triton.jit
def _form_rows(out_ptr, bias_ptr, c, c_ok, total, m2, C, COUNT, eps, HAS_BIAS: tl.constexpr):
    """BatchNorm's form of float64 sums and M2 over ``COUNT`` values, fp32 rows of ``(3, C)`` at ``out_ptr``:
    the mean (plus ``bias_ptr[c]`` with ``HAS_BIAS``), ``1 / sqrt(M2 / COUNT + eps)``, ``M2 / (COUNT - 1)``."""
    n = tl.zeros_like(total) + COUNT  # float64, exact for any count (an int argument, or one specialized)
    mean = total / n
    if HAS_BIAS:
        mean += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float64)
    tl.store(out_ptr + c, mean.to(tl.float32), mask=c_ok)
    tl.store(out_ptr + C + c, (1.0 / tl.sqrt(m2 / n + eps)).to(tl.float32), mask=c_ok)
    tl.store(out_ptr + 2 * C + c, (m2 / (n - 1.0)).to(tl.float32), mask=c_ok)


@triton.jit
def _merge(n_a, s_a, m_a, n_b, s_b, m_b):
    """Two sets' counts, sums and M2 (float64, any shape) as one: ``M2 = M2_a + M2_b + (mean_b -
    mean_a)^2 n_a n_b / (n_a + n_b)`` (Chan et al.); an empty set adds nothing."""
    n = n_a + n_b
    delta = s_b / tl.maximum(n_b, 1.0) - s_a / tl.maximum(n_a, 1.0)
    both = (n_a > 0) & (n_b > 0)
    m = m_a + m_b + tl.where(both, delta * delta * (n_a * n_b / tl.maximum(n, 1.0)), 0.0)
    return n, s_a + s_b, m


@triton.jit
def _batch_norm_form_kernel(sum_ptr, m2_ptr, bias_ptr, out_ptr, C, COUNT, eps, HAS_BIAS: tl.constexpr,
                            BLOCK_C: tl.constexpr):  # fmt: skip
    """``ChannelStats.batch_norm_form``: from float64 ``sum`` and ``m2`` ``(C,)`` over ``COUNT`` values,
    fp32 ``(3, C)`` (:func:`_form_rows`)."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    total = tl.load(sum_ptr + c, mask=ok, other=0.0)
    m2 = tl.load(m2_ptr + c, mask=ok, other=0.0)
    _form_rows(out_ptr, bias_ptr, c, ok, total, m2, C, COUNT, eps, HAS_BIAS)


#: ``ChannelStats.batch_norm_form``'s launches, per channel count and bias
_FORM_LAUNCHES = PlanCache()


@dataclass(frozen=True)
class BatchNormForm:
    """Asks a statistics reduction for BatchNorm's form of its sums too, in the same launch
    (``ChannelStats.form``): of the values plus ``bias`` (None or ``(C,)`` contiguous, any float dtype, on
    the values' device), with ``eps``."""

    bias: torch.Tensor | None
    eps: float


class PartialsReduction:
    """One forward plan's reduction of its store's partials (fp32 ``(3, m_tiles, c_out)``) to its
    statistics (:func:`combine_partials_kernel`), in one launch: per channel over ``count`` output
    positions in ``m_tiles`` tiles of ``block_m`` rows (``groups`` 0), spans of up to ``_MAX_BLOCK_T``
    tiles per program, the last program of a channel block to finish its span combining the spans
    (``arrival``); or, with ``groups`` > 0, per sample and group over ``samples`` samples of ``count``
    positions each, ``m_tiles / samples`` tiles per sample (the launch's tiles do not cross samples).
    ``tile_rows``: each tile's number of output positions where they are not ``block_m`` but the last (a
    forward whose programs sum several tiles, ``tma_fprop``); ``raw_squares``: the partials' row 2 holds
    sums of squares about the shift (:func:`combine_partials_kernel`).  A call on channel statistics may
    ask for their ``BatchNormForm`` too (``ChannelStats.form``: no launch of its own)."""

    def __init__(self, m_tiles: int, c_out: int, block_m: int, count: int, device: torch.device,
                 groups: int = 0, samples: int = 1, tile_rows: Sequence[int] | None = None,
                 raw_squares: bool = False) -> None:  # fmt: skip
        self.c_out, self.count, self.groups, self.samples, self.device = c_out, count, groups, samples, device
        given = tile_rows is not None
        #: programs along the tiles (channel statistics), each a span of ``_MAX_BLOCK_T`` tiles
        self.spans = cdiv(m_tiles, _MAX_BLOCK_T) if not groups and m_tiles > _MAX_BLOCK_T else 1
        #: float64 rows per tile and per span (``ROWS_GIVEN``), else None
        self.tile_rows = self.span_rows = None
        if given:
            rows = [float(r) for r in tile_rows]
            self.tile_rows = torch.tensor(rows, dtype=torch.float64, device=device)
            spans = [sum(rows[i:i + _MAX_BLOCK_T]) for i in range(0, len(rows), _MAX_BLOCK_T)]
            self.span_rows = torch.tensor(spans, dtype=torch.float64, device=device)
        self.c_blocks = cdiv(c_out, _BLOCK_C)
        if groups:
            tiles, grid = m_tiles // samples, (samples * groups, 1)
        else:
            tiles, grid = (_MAX_BLOCK_T if self.spans > 1 else m_tiles), (self.c_blocks, self.spans)
        # NOTE: per group on 8 warps (steps of 32 tiles) spilled 4 bytes on sm_90, on 4 none (``python
        # tools/compile_check.py conv_family --cases resnet_3x3-bf16-hooked --kernels combine``)
        self._constexprs = dict(
            PER_GROUP=groups > 0, SPANS=self.spans > 1, ROWS_GIVEN=given, RAW_SQUARES=raw_squares, BLOCK_M=block_m,
            BLOCK_T=min(_MAX_BLOCK_T, next_pow2(max(tiles, 1))), BLOCK_S=min(_MAX_BLOCK_T, next_pow2(self.spans)),
            BLOCK_C=_BLOCK_C, num_warps=4 if groups else 8)  # fmt: skip
        self._grid = grid
        self._fixed = (m_tiles, c_out, tiles, count, *((c_out // groups, groups) if groups else (0, 1)))
        #: the launches by ``(form, has_bias)``
        self._launches: dict[tuple[bool, bool], FastLaunch] = {}

    def _launch(self, form: bool, has_bias: bool) -> FastLaunch:
        launch = self._launches.get((form, has_bias))
        if launch is None:
            launch = FastLaunch(combine_partials_kernel, self._grid, dict(self._constexprs, FORM=form,
                                                                          HAS_BIAS=has_bias), fixed=self._fixed)
            self._launches[(form, has_bias)] = launch
        return launch

    def __call__(self, partials: torch.Tensor, form: BatchNormForm | None = None) -> ChannelStats | GroupStats:
        if form is not None and self.groups:
            raise ContractError("a BatchNorm form is made of channel statistics, not of a group norm's")
        shape = (self.samples, self.groups) if self.groups else (self.c_out,)
        total = torch.empty(shape, dtype=torch.float64, device=self.device)
        m2 = torch.empty(shape, dtype=torch.float64, device=self.device)
        rows = self.tile_rows if self.tile_rows is not None else total  # unused without ROWS_GIVEN
        spans = span_rows = counts = total  # unused in one span
        if self.spans > 1:
            spans = torch.empty((3, self.spans, self.c_out), dtype=torch.float64, device=self.device)
            span_rows = self.span_rows if self.span_rows is not None else total
            counts = arrival.counters(self.device, self.c_blocks)
        out = bias = None
        if form is not None:
            out = torch.empty((3, self.c_out), dtype=torch.float32, device=self.device)
            bias = form.bias
        self._launch(form is not None, bias is not None)(partials, total, m2, rows, spans, span_rows, counts,
                                                         total if bias is None else bias, total if out is None else out,
                                                         0.0 if form is None else float(form.eps))  # fmt: skip
        if self.groups:
            return GroupStats(total, m2, self.count * (self.c_out // self.groups))
        return ChannelStats(total, m2, self.count, out)


def empty_group_stats(groups: int, count: int, device: torch.device) -> GroupStats:
    """The statistics of an empty batch (no sample): ``(0, groups)`` sums."""
    zeros = torch.zeros(0, groups, dtype=torch.float64, device=device)
    return GroupStats(zeros, zeros.clone(), count)


def empty_stats(c_out: int, device: torch.device) -> ChannelStats:
    """The statistics of an empty output (no position): zero sums, count 0."""
    zeros = torch.zeros(c_out, dtype=torch.float64, device=device)
    return ChannelStats(zeros, zeros.clone(), 0)


@dataclass(frozen=True)
class BatchNormGradSums:
    """The two per-channel sums a BatchNorm backward needs from the gradient of its output ``grad_z``
    (as ``dgrad``'s epilogue produces them): ``sum_dz = Σ grad_z`` (the gradient of its shift ``β``)
    and ``sum_dz_xhat = Σ grad_z · x̂`` (that of its scale ``γ``), float64 ``(C,)`` over the ``count``
    positions ``N * D * H * W``.  With them the input gradient is
    ``γ · rstd · (grad_z - sum_dz / count - x̂ · sum_dz_xhat / count)`` (batch statistics)."""

    sum_dz: torch.Tensor
    sum_dz_xhat: torch.Tensor
    count: int


def reduce_grad_partials(partials: torch.Tensor, count: int) -> BatchNormGradSums:
    """The sums from the dgrad epilogue's partials, fp32 ``(2, M_TILES, C)`` contiguous (row 0 the tiles'
    ``Σ grad_z``, row 1 their ``Σ grad_z · x̂``), in float64 over the tiles in one fixed-shape reduction
    (bitwise reproducible, as :class:`PartialsReduction`): ``split_sum.sum_dim`` over the tiles.
    NOTE: ``partials.sum(dim=1, dtype=torch.float64)`` (a float64 copy of the partials, then torch's
    reduction) took 13.8 us on ResNet-50's 64 -> 64 1x1 at 56 x 56 (1,568 tiles of 64 channels) and 19.9
    on its 256 -> 64 (256 channels), about as long as the input gradient's own plain kernel (15.0 us on
    the first); ``sum_dim`` takes 4.8 and 7.0 (H200, bf16, ``python tools/bench_conv.py
    demos/realnets/resnet50.py --passes dgrad --profile --filter '*64x64x56x56 -> 64 k1x1*,*64x256x56x56
    -> 64 k1x1*'``)."""
    total = sum_dim(partials, 1)
    return BatchNormGradSums(total[0], total[1], count)


def empty_grad_sums(c: int, device: torch.device) -> BatchNormGradSums:
    """The sums of an empty input (no position): zeros, count 0."""
    zeros = torch.zeros(c, dtype=torch.float64, device=device)
    return BatchNormGradSums(zeros, zeros.clone(), 0)
