"""Softmax over the rows of fp32 attention scores, forward and backward, one program per row.

The scores ``s`` are ``q @ k^T`` accumulated in fp32 (``ops/attention``: a library matmul writes them);
these kernels apply the attention's ``scale`` and the softmax, and write what the next matmuls read in
the inputs' dtype, so no fp32 probability tensor and no separate cast pass exist:

* forward: ``p[r, j] = exp(s[r, j] * scale - lse[r])`` with ``lse[r] = logsumexp_j(s[r, j] * scale)``
  (fp32), rounded to ``p``'s dtype (what flash attention also rounds before its ``p @ v``);
* backward, from the scores recomputed and ``dp = grad_out @ v^T`` (fp32): ``p`` as the forward wrote
  it, and ``ds[r, j] = p[r, j] * (dp[r, j] - D[r]) * scale`` with ``D[r] = sum_j p[r, j] * dp[r, j]``
  (fp32, ``p`` unrounded), rounded to ``ds``'s dtype (the scores' gradient, the scale folded in).  The
  row's ``lse`` is recomputed, not kept: nothing but the inputs lives between the directions.

Each program walks its row in ``BLOCK`` slices twice (a running max and sums per lane, then the
writes); the second walk reads the row from L2 (a row of 4096 fp32 scores is 16 KB).  A row of ``-inf`` scores
gives NaN, as eager's softmax does; a NaN score makes its row NaN.

Contract (checked by ``SoftmaxRowsPlan``, ``ContractError`` otherwise): ``s`` (and ``dp``) contiguous
fp32 of ``R`` rows of ``S >= 1`` (any shape ``(..., S)`` holding ``R * S`` values: a batched matmul's
``(n, L, S)`` result as it is); ``p`` / ``ds`` come back in ``s``'s shape, contiguous, in the plan's
dtype (fp16, bf16 or fp32) on the scores' device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host import next_pow2
from .launch import FastLaunch
from .plan_cache import ContractError, PlanCache

#: scores per slice of a row: at most 4096 (16 per thread with 8 warps), fewer for short rows
MAX_BLOCK = 4096


@triton.jit
def _row_stats(s_ptr, dp_ptr, base, S, scale, HAS_DP: tl.constexpr, BLOCK: tl.constexpr):
    """``(lse, D)`` of one row: ``lse = logsumexp_j(s[base + j] * scale)`` over ``j < S`` and, with
    ``HAS_DP``, ``D = sum_j softmax_j * dp[base + j]`` (else 0).  Per lane a running max ``m`` and the
    sums ``total`` of ``exp(x - m)`` and ``d`` of ``exp(x - m) * dp``, rescaled as ``m`` grows; lanes that
    saw only ``-inf`` (or nothing) add nothing; NaN where a score is NaN (counted apart: the max may
    drop a NaN)."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    d = tl.zeros([BLOCK], tl.float32)
    nans = tl.zeros([BLOCK], tl.int32)
    for start in range(0, S, BLOCK):
        idx = start + offs
        inside = idx < S
        x = tl.load(s_ptr + base + idx, mask=inside, other=float("-inf")) * scale
        nans += (x != x).to(tl.int32)
        m_new = tl.maximum(m, x)
        shift = tl.where(m_new != float("-inf"), m_new, 0.0)  # (a lane of -inf alone: exp(-inf - 0) adds 0)
        alpha = tl.exp(m - shift)
        e = tl.exp(x - shift)
        total = total * alpha + e
        if HAS_DP:
            d = d * alpha + e * tl.load(dp_ptr + base + idx, mask=inside, other=0.0)
        m = m_new
    row_max = tl.max(m, axis=0)
    weight = tl.exp(m - tl.where(row_max != float("-inf"), row_max, 0.0))
    total = tl.sum(total * weight, axis=0)
    lse = tl.where(tl.sum(nans, axis=0) > 0, float("nan"), row_max + tl.log(total))
    return lse, tl.sum(d * weight, axis=0) / total


@triton.jit
def _softmax_rows_kernel(s_ptr, dp_ptr, p_ptr, ds_ptr, S, scale, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: its statistics (``_row_stats``), then a second walk storing ``p`` and, with
    ``BACKWARD``, ``ds = p * (dp - D) * scale`` (without it ``dp_ptr`` and ``ds_ptr`` are not read)."""
    row = tl.program_id(0).to(tl.int64)
    base = row * S
    lse, d = _row_stats(s_ptr, dp_ptr, base, S, scale, BACKWARD, BLOCK)
    offs = tl.arange(0, BLOCK)
    for start in range(0, S, BLOCK):
        idx = start + offs
        inside = idx < S
        x = tl.load(s_ptr + base + idx, mask=inside, other=0.0)
        p = tl.exp(x * scale - lse)
        tl.store(p_ptr + base + idx, p.to(p_ptr.dtype.element_ty), mask=inside)
        if BACKWARD:
            dp = tl.load(dp_ptr + base + idx, mask=inside, other=0.0)
            tl.store(ds_ptr + base + idx, (p * (dp - d) * scale).to(ds_ptr.dtype.element_ty), mask=inside)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ContractError(f"softmax rows: {message}")


class SoftmaxRowsPlan:
    """The launches for one ``(R, S)``, dtype and device (module docstring): ``forward(s, scale) -> p``
    and ``backward(s, dp, scale) -> (p, ds)``."""

    def __init__(self, rows: int, length: int, out_dtype: torch.dtype, device: torch.device) -> None:
        _require(rows >= 1 and length >= 1, f"needs at least one row of at least one score, got ({rows}, {length})")
        _require(out_dtype in (torch.float16, torch.bfloat16, torch.float32), f"no {out_dtype} output")
        self.rows, self.length, self.out_dtype, self.device = rows, length, out_dtype, device
        block = min(MAX_BLOCK, next_pow2(length))
        meta = dict(BLOCK=block, num_warps=8 if block >= 2048 else 4)
        self.fwd = FastLaunch(_softmax_rows_kernel, (rows,), dict(meta, BACKWARD=False))
        self.bwd = FastLaunch(_softmax_rows_kernel, (rows,), dict(meta, BACKWARD=True))

    def _check(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
        _require(t.numel() == self.rows * self.length and t.shape[-1] == self.length and t.dtype == dtype
                 and t.is_contiguous() and t.device == self.device,
                 f"{name} must be a contiguous {dtype} of {self.rows} rows of {self.length} on {self.device}, got "
                 f"{t.dtype} {list(t.shape)} on {t.device}")  # fmt: skip

    def forward(self, s: torch.Tensor, scale: float) -> torch.Tensor:
        self._check("s", s, torch.float32)
        p = torch.empty_like(s, dtype=self.out_dtype)
        self.fwd(s, s, p, p, self.length, float(scale))  # (no dp, no ds: BACKWARD False reads neither)
        return p

    def backward(self, s: torch.Tensor, dp: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        self._check("s", s, torch.float32)
        self._check("dp", dp, torch.float32)
        p = torch.empty_like(s, dtype=self.out_dtype)
        ds = torch.empty_like(s, dtype=self.out_dtype)
        self.bwd(s, dp, p, ds, self.length, float(scale))
        return p, ds


_PLANS = PlanCache()


def softmax_rows_plan(rows: int, length: int, out_dtype: torch.dtype, device: torch.device) -> SoftmaxRowsPlan:
    """The plan cached for this problem (``ContractError`` for one the kernels cannot take)."""
    return _PLANS.get((rows, length, out_dtype, device), lambda: SoftmaxRowsPlan(rows, length, out_dtype, device))
