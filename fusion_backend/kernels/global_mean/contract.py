"""The small kernels of ``conv_global_mean``: the contraction of the tap sums with the weight plus the
folded affine chain (forward, ``contract_forward``), and every parameter gradient from the saved sums
(backward, ``params_backward``).  Chain steps carry ``PointwiseKind`` op codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ..host import cdiv, next_pow2
from ..plan_cache import cached_plans
from .common import NUM_WARPS, Launch, WeightLayout

# ``KINDS`` entries are the op codes of ``chain_math.OP_CODES`` (``PointwiseKind.code``): mul 13, add 14,
# sub 15, rsub 16, div 17 (the jitted code compares them as literals).
# Where the backward kernel puts a step operand's gradient (``OUT_MODE`` entries).
GRAD_NONE, GRAD_DIRECT, GRAD_SCRATCH = 0, 1, 2


@triton.jit
def _operand(co, co_ok, ops, op_strides, TENSOR: tl.constexpr, CONSTS: tl.constexpr, i: tl.constexpr):
    """Value of step ``i``'s operand per channel ``co``, fp64: a tensor element or a constant."""
    if TENSOR[i]:
        v = tl.load(ops[i] + co.to(tl.int64) * op_strides[i], mask=co_ok, other=1.0).to(tl.float64)
    else:
        v = tl.full(co.shape, CONSTS[i], tl.float64)
    return v


@triton.jit
def _apply(u, v, KIND: tl.constexpr):
    if KIND == 13:  # mul
        r = u * v
    elif KIND == 14:  # add
        r = u + v
    elif KIND == 15:  # sub
        r = u - v
    elif KIND == 16:  # rsub
        r = v - u
    else:
        r = u / v
    return r


@triton.jit
def _group_channels(gi, cb, COUT_G, BLOCK_CO: tl.constexpr):
    """Output-channel block ``cb`` of group ``gi`` (``COUT_G`` channels per group): ``(col, co_ok, co)``
    with ``col`` the ``[BLOCK_CO]`` in-group indices, ``co_ok = col < COUT_G`` and ``co = gi*COUT_G + col``
    the channels."""
    col = cb * BLOCK_CO + tl.arange(0, BLOCK_CO)
    co_ok = col < COUT_G
    co = gi * COUT_G + col
    return col, co_ok, co


@triton.jit
def _contract_fwd_kernel(
    r_ptr, rs_n, rs_c, rs_s, rs_j, NSPLIT, tapset_ptr,
    w_ptr, s_co, s_ci, s_t, off_g, bias_ptr, bias_stride, ops, op_strides,
    out_ptr, mean_ptr, taps_ptr,
    C_IN, C_OUT, CIN_G, COUT_G, T, P,
    KINDS: tl.constexpr, TENSOR: tl.constexpr, CONSTS: tl.constexpr, NS: tl.constexpr, NS_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, ONE_CHUNK: tl.constexpr,
    BLOCK_CO: tl.constexpr,
):  # fmt: skip
    """Forward tail in one launch: tap sums, the contraction with W, bias, mean scale, affine chain.

    Grid: ``(N, groups, cdiv(COUT_G, BLOCK_CO))``; program ``(n, g, cb)`` produces output channels
    ``g*COUT_G + [cb*BLOCK_CO, ...)`` of batch element ``n``.  The reduction index ``k = ci_local*T + t``
    (``K = CIN_G*T`` of them) is walked in ``[BLOCK_K]`` chunks whose loads do not depend on the
    previous chunk: per chunk one ``[BLOCK_K, BLOCK_CO]`` weight tile and one ``[BLOCK_K, BLOCK_S]``
    tile of split partials (``ONE_CHUNK``: ``NSPLIT <= BLOCK_S``, else a loop over split chunks).

    Pointer contract:
      * ``r_ptr``: fp32 partial set sums; element ``(n, c, split, j)`` at
        ``n*rs_n + c*rs_c + split*rs_s + j*rs_j``, ``split < NSPLIT`` (summed here, fp64).
      * ``tapset_ptr``: int32 ``(T,)``, the product-set index of every flattened tap.
      * ``w_ptr``/``s_*``/``off_g``: the weight, as in ``_tap_coef``.
      * ``bias_ptr``: ``(C_OUT,)`` with stride ``bias_stride`` (unused without ``HAS_BIAS``).
      * ``ops``/``op_strides``: one pointer per affine step (a dummy for constant steps); element
        ``co`` of a tensor operand at ``co*op_strides[i]`` (stride 0 for a one-element operand).
      * ``out_ptr``: contiguous ``(N, C_OUT)`` in the output dtype; ``mean_ptr``: contiguous fp64
        ``(N, C_OUT)`` conv mean before the chain; ``taps_ptr``: contiguous fp64 ``(N, C_IN, T)`` tap
        sums (written by the ``cb == 0`` programs).
    Accumulation: fp64 (the contraction cancels; it is tiny).  Determinism: every sum has a fixed
    order for a given launch configuration (``tl.sum`` trees over constexpr shapes, chunks in order);
    no atomics.
    """
    n = tl.program_id(0)
    gi = tl.program_id(1)
    cb = tl.program_id(2)
    _, co_ok, co = _group_channels(gi, cb, COUT_G, BLOCK_CO)

    # NOTE: everything the epilogue reads that does not depend on the contraction (bias, step
    # operands) is loaded before the loop, so its memory latency overlaps the loop's instead of
    # adding a round trip after it.
    bias = tl.zeros([BLOCK_CO], dtype=tl.float64)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + co * bias_stride, mask=co_ok, other=0.0).to(tl.float64)
    slot = tl.arange(0, NS_PAD)
    # -0.0 fill: x + (-0.0) == x for every x (signed zeros included), so the row extraction below
    # returns each operand bitwise
    opv = tl.full([NS_PAD, BLOCK_CO], -0.0, tl.float64)
    for i in tl.static_range(NS):
        opv = tl.where(slot[:, None] == i, _operand(co, co_ok, ops, op_strides, TENSOR, CONSTS, i)[None, :], opv)

    K = CIN_G * T
    kv = tl.arange(0, BLOCK_K)
    sv = tl.arange(0, BLOCK_S)
    n64 = n.to(tl.int64)
    acc = tl.zeros([BLOCK_K, BLOCK_CO], dtype=tl.float64)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kv
        k_ok = k < K
        cil = k // T
        t = k - cil * T
        ci = gi * CIN_G + cil
        w_off = co.to(tl.int64)[None, :] * s_co + (ci.to(tl.int64) * s_ci - gi * off_g + t * s_t)[:, None]
        w = tl.load(w_ptr + w_off, mask=k_ok[:, None] & co_ok[None, :], other=0.0)
        j = tl.load(tapset_ptr + t, mask=k_ok, other=0)
        r_row = r_ptr + n64 * rs_n + ci.to(tl.int64) * rs_c + j.to(tl.int64) * rs_j  # [BLOCK_K] pointers
        if ONE_CHUNK:
            part = tl.load(r_row[:, None] + sv[None, :] * rs_s, mask=k_ok[:, None] & (sv < NSPLIT)[None, :], other=0.0)
            s = tl.sum(part.to(tl.float64), axis=1)
        else:
            s = tl.zeros([BLOCK_K], dtype=tl.float64)
            for s0 in range(0, NSPLIT, BLOCK_S):
                sp = s0 + sv
                part = tl.load(r_row[:, None] + sp[None, :] * rs_s, mask=k_ok[:, None] & (sp < NSPLIT)[None, :], other=0.0)
                s += tl.sum(part.to(tl.float64), axis=1)
        tl.store(taps_ptr + (n64 * C_IN + gi * CIN_G) * T + k, s, mask=k_ok & ((k * 0 + cb) == 0))
        acc += s[:, None] * w.to(tl.float64)
    mean = tl.sum(acc, axis=0) / P + bias
    tl.store(mean_ptr + n64 * C_OUT + co, mean, mask=co_ok)
    v = mean
    for i in tl.static_range(NS):
        v = _apply(v, tl.sum(tl.where(slot[:, None] == i, opv, -0.0), axis=0), KINDS[i])
    tl.store(out_ptr + n64 * C_OUT + co, v.to(tl.float32).to(out_ptr.dtype.element_ty), mask=co_ok)


@triton.jit
def _params_bwd_kernel(
    go_ptr, go_sn, go_sc, mean_ptr, taps_ptr, ops, op_strides, gops, gop_strides,
    gw_ptr, gw_s_co, gw_s_ci, gw_s_t, gw_off_g, gbias_ptr, gbias_stride, coef_ptr, scratch_ptr,
    N, C_IN, C_OUT, CIN_G, COUT_G, T, P,
    KINDS: tl.constexpr, TENSOR: tl.constexpr, CONSTS: tl.constexpr, OUT_MODE: tl.constexpr,
    NS: tl.constexpr, NS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_OPS: tl.constexpr,
    BLOCK_CI: tl.constexpr, BLOCK_CO: tl.constexpr,
):  # fmt: skip
    """Backward tail in one launch: grad_weight, grad_bias, operand gradients and ``G`` for grad_x.

    With ``A[co]`` the chain's scale (d out / d mean) and ``G[n, co] = g[n, co] * A[co] / P``:
    ``dW(ci, co, t) = sum_n G[n, co] * S[n, ci, t]``, ``dbias[co] = sum_n g*A``, and each step's
    operand gradient by reverse mode through the chain (values recomputed from the saved mean).

    Grid: ``(groups, cdiv(COUT_G, BLOCK_CO), cdiv(CIN_G, BLOCK_CI) * T)``; program ``(g, cb, k)``
    writes the ``[BLOCK_CI, BLOCK_CO]`` tile of tap ``k % T`` of grad_weight; the ``k == 0`` programs
    also write the per-channel results.  Sums over n run in order in each program: deterministic.

    Pointer contract:
      * ``go_ptr``: grad of the output, element ``(n, co)`` at ``n*go_sn + co*go_sc`` (any dtype).
      * ``mean_ptr``: fp64 ``(N, C_OUT)``; ``taps_ptr``: fp64 ``(N, C_IN, T)`` (the forward's outputs).
      * ``ops``/``op_strides``: as in ``_contract_fwd_kernel``.
      * ``gops``/``gop_strides``: per step, where ``OUT_MODE[i] == GRAD_DIRECT`` puts its operand's
        gradient (element ``co`` at ``co*gop_strides[i]``, the operand's dtype).  ``GRAD_SCRATCH`` steps
        write their per-channel fp64 partials (summed over n) to row ``i`` of ``scratch_ptr``
        (``(NS, C_OUT)`` contiguous) for the host to combine.
      * ``gw_ptr``: grad_weight in the weight's dtype, addressed like ``w_ptr`` in ``_tap_coef``.
      * ``gbias_ptr``: ``(C_OUT,)`` with stride ``gbias_stride``; ``coef_ptr``: contiguous fp32
        ``(N, C_OUT)`` receiving ``G``.
    """
    gi = tl.program_id(0)
    cb = tl.program_id(1)
    k = tl.program_id(2)
    col, co_ok, co = _group_channels(gi, cb, COUT_G, BLOCK_CO)

    a = tl.full([BLOCK_CO], 1.0, tl.float64)
    for i in tl.static_range(NS):
        if KINDS[i] == 13:  # mul
            a = a * _operand(co, co_ok, ops, op_strides, TENSOR, CONSTS, i)
        elif KINDS[i] == 17:  # div
            a = a / _operand(co, co_ok, ops, op_strides, TENSOR, CONSTS, i)
        elif KINDS[i] == 16:  # rsub
            a = -a
    scale = a / P

    # grad_weight tile
    cib = k // T
    t = k - cib * T
    cil = cib * BLOCK_CI + tl.arange(0, BLOCK_CI)
    ci_ok = cil < CIN_G
    ci = gi * CIN_G + cil
    acc = tl.zeros([BLOCK_CI, BLOCK_CO], dtype=tl.float64)
    for n in range(N):
        gv = tl.load(go_ptr + n * go_sn + co * go_sc, mask=co_ok, other=0.0).to(tl.float64) * scale
        s = tl.load(taps_ptr + (n * C_IN + ci.to(tl.int64)) * T + t, mask=ci_ok, other=0.0)
        acc += s[:, None] * gv[None, :]
    gw_off = co.to(tl.int64)[None, :] * gw_s_co + (ci.to(tl.int64) * gw_s_ci - gi * gw_off_g)[:, None] + t * gw_s_t
    tl.store(gw_ptr + gw_off, acc.to(tl.float32).to(gw_ptr.dtype.element_ty), mask=ci_ok[:, None] & co_ok[None, :])

    # per-channel results (only the k == 0 programs store them)
    first = co_ok & ((col * 0 + k) == 0)
    slot = tl.arange(0, NS_PAD)
    gbias = tl.zeros([BLOCK_CO], dtype=tl.float64)
    opacc = tl.zeros([NS_PAD, BLOCK_CO], dtype=tl.float64)
    for n in range(N):
        g = tl.load(go_ptr + n * go_sn + co * go_sc, mask=co_ok, other=0.0).to(tl.float64)
        tl.store(coef_ptr + n * C_OUT + co, (g * scale).to(tl.float32), mask=first)
        gbias += g * a
        if NEED_OPS:
            # forward values before each step, then reverse mode through the chain
            us = tl.zeros([NS_PAD, BLOCK_CO], dtype=tl.float64)
            u = tl.load(mean_ptr + n * C_OUT + co, mask=co_ok, other=0.0)
            for i in tl.static_range(NS):
                us = tl.where(slot[:, None] == i, u[None, :], us)
                u = _apply(u, _operand(co, co_ok, ops, op_strides, TENSOR, CONSTS, i), KINDS[i])
            d = g
            # reverse order; the loop variable itself stays a constexpr (a plain assignment such as
            # ``j = NS - 1 - ii`` would turn it into a tensor, which cannot index the KINDS tuple)
            for j in tl.static_range(NS - 1, -1, -1):
                v = _operand(co, co_ok, ops, op_strides, TENSOR, CONSTS, j)
                ui = tl.sum(tl.where(slot[:, None] == j, us, 0.0), axis=0)
                if KINDS[j] == 13:  # mul
                    gvi = d * ui
                    d = d * v
                elif KINDS[j] == 17:  # div
                    gvi = -d * ui / (v * v)
                    d = d / v
                elif KINDS[j] == 14:  # add
                    gvi = d
                elif KINDS[j] == 15:  # sub
                    gvi = -d
                else:
                    gvi = d
                    d = -d
                opacc += tl.where(slot[:, None] == j, gvi[None, :], 0.0)
    if HAS_BIAS:
        tl.store(gbias_ptr + co * gbias_stride, gbias.to(tl.float32).to(gbias_ptr.dtype.element_ty), mask=first)
    if NEED_OPS:
        for i in tl.static_range(NS):
            row = tl.sum(tl.where(slot[:, None] == i, opacc, 0.0), axis=0)
            if OUT_MODE[i] == 1:
                tl.store(gops[i] + co * gop_strides[i], row.to(tl.float32).to(gops[i].dtype.element_ty), mask=first)
            elif OUT_MODE[i] == 2:
                tl.store(scratch_ptr + i * C_OUT + co, row, mask=first)


@dataclass(frozen=True)
class ChainArgs:
    """The affine chain as kernel arguments: per step an op code (``PointwiseKind.code``), whether the
    operand is a tensor, the constant (for constant steps), the operand tensor (a dummy for
    constants) and its per-channel stride (0 for a one-element tensor).  Empty chains are padded to
    one dummy entry."""

    kinds: tuple[int, ...]
    tensor: tuple[bool, ...]
    consts: tuple[float, ...]
    ops: tuple[torch.Tensor, ...]
    strides: tuple[int, ...]

    @property
    def steps(self) -> int:
        return sum(1 for k in self.kinds if k)

    def static(self, steps: int) -> tuple[Any, ...]:
        """The constexpr half (kinds, tensor flags, constants) and the real step count: a cache key."""
        return (self.kinds, self.tensor, self.consts, steps)

    def padded(self, dummy: torch.Tensor) -> ChainArgs:
        if self.kinds:
            return self
        return ChainArgs((0,), (False,), (0.0,), (dummy,), (0,))


def _block_co(cout_g: int) -> int:
    return min(next_pow2(cout_g), 32)


def _block_ci(cin_g: int) -> int:
    return min(next_pow2(cin_g), 32)


# NOTE: the contraction kernel is latency-bound (ConvTranspose2d 64->128 k3 on 16x64x512x512: 1.2 M
# fp64 multiply-adds, ~0.3 MB of weights): what matters is the number of programs and the number of
# dependent memory round trips per program.  16 output channels per program gives that conv (N=16,
# C_out=128) 128 programs on 132 SMs (the old grid had 64, each walking 2 ci blocks x 9 taps one after
# another: 18 dependent iterations).  A 4096-element chunk over 8 warps (16 elements per thread, 128
# registers, no spills: tools/compile_check.py global_mean) walks K = C_in*T = 576 in 3 chunks whose
# loads do not depend on each other.  Up to 16 split partials are summed as one tile (that conv
# contiguous: 1 split; channels_last: 33 splits, 3 tiles per chunk).
_CONTRACT_CHUNK = 4096


_CONTRACT_BLOCK_CO = 16


_CONTRACT_BLOCK_S = 16


_CONTRACT_WARPS = 8


@dataclass(frozen=True)
class ContractTiles:
    """Tile of ``_contract_fwd_kernel``: output channels per program, reduction chunk, split chunk."""

    block_co: int
    block_k: int
    block_s: int


def contract_tiles(k: int, cout_g: int, nsplit: int) -> ContractTiles:
    """Tiles for a reduction of length ``k = C_in/groups * taps`` over ``nsplit`` split partials."""
    block_co = min(next_pow2(cout_g), _CONTRACT_BLOCK_CO)
    block_s = min(next_pow2(nsplit), _CONTRACT_BLOCK_S)
    block_k = max(16, min(next_pow2(k), _CONTRACT_CHUNK // max(block_co, block_s)))
    return ContractTiles(block_co, block_k, block_s)


@cached_plans
def _plan_contract(
    n: int, groups: int, cout_g: int, k: int, nsplit: int, chain_static: tuple[Any, ...], has_bias: bool
) -> Launch:
    kinds, tensor, consts, steps = chain_static
    tiles = contract_tiles(k, cout_g, nsplit)
    return Launch(
        _contract_fwd_kernel, (n, groups, cdiv(cout_g, tiles.block_co)),
        consts=dict(KINDS=kinds, TENSOR=tensor, CONSTS=consts, NS=steps, NS_PAD=next_pow2(max(steps, 1)),
                    HAS_BIAS=has_bias, BLOCK_K=tiles.block_k, BLOCK_S=tiles.block_s,
                    ONE_CHUNK=nsplit <= tiles.block_s, BLOCK_CO=tiles.block_co, num_warps=_CONTRACT_WARPS),
    )  # fmt: skip


def contract_forward(
    partial: tuple[torch.Tensor, tuple[int, int, int, int], int],
    tapset: torch.Tensor,
    weight: WeightLayout,
    bias: torch.Tensor | None,
    chain: ChainArgs,
    n_outputs: int,
    out: torch.Tensor,
    mean: torch.Tensor,
    taps: torch.Tensor,
) -> None:
    """Launch ``_contract_fwd_kernel``: fills ``out`` ((N, C_out) contiguous, any float dtype), ``mean``
    (fp64 (N, C_out)) and ``taps`` (fp64 (N, C_in, T)) from ``set_sums_partial``'s result."""
    r, (rs_n, rs_c, rs_s, rs_j), nsplit = partial
    n, c_in, t = taps.shape
    c_out = mean.shape[1]
    if t != weight.taps or tapset.numel() != t or not (out.is_contiguous() and mean.is_contiguous() and taps.is_contiguous()):
        raise ValueError(
            f"contract_forward: taps {tuple(taps.shape)} / tapset {tuple(tapset.shape)} / weight taps "
            f"{weight.taps} disagree, or an output is not contiguous"
        )
    ch = chain.padded(mean)
    plan = _plan_contract(n, c_in // weight.cin_g, weight.cout_g, weight.cin_g * t, nsplit, ch.static(chain.steps),
                          bias is not None)  # fmt: skip
    plan.launch(
        r, rs_n, rs_c, rs_s, rs_j, nsplit, tapset,
        weight.tensor, weight.s_co, weight.s_ci, weight.s_t, weight.off_g,
        bias if bias is not None else mean, bias.stride(0) if bias is not None else 0,
        ch.ops, ch.strides, out, mean, taps,
        c_in, c_out, weight.cin_g, weight.cout_g, t, n_outputs
    )  # fmt: skip


@cached_plans
def _plan_params(
    groups: int, cout_g: int, cin_g: int, t: int, chain_static: tuple[Any, ...], modes: tuple[int, ...],
    has_bias: bool,
) -> Launch:
    kinds, tensor, consts, steps = chain_static
    block_co, block_ci = _block_co(cout_g), _block_ci(cin_g)
    return Launch(
        _params_bwd_kernel, (groups, cdiv(cout_g, block_co), cdiv(cin_g, block_ci) * t),
        consts=dict(KINDS=kinds, TENSOR=tensor, CONSTS=consts, OUT_MODE=modes, NS=steps,
                    NS_PAD=next_pow2(max(steps, 1)), HAS_BIAS=has_bias,
                    NEED_OPS=any(m != GRAD_NONE for m in modes), BLOCK_CI=block_ci, BLOCK_CO=block_co,
                    num_warps=NUM_WARPS),
    )  # fmt: skip


def params_backward(
    grad_out: torch.Tensor,
    mean: torch.Tensor,
    taps: torch.Tensor,
    chain: ChainArgs,
    grad_targets: tuple[tuple[int, torch.Tensor, int], ...],
    grad_weight: WeightLayout,
    grad_bias: torch.Tensor | None,
    n_outputs: int,
    coef: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """Launch ``_params_bwd_kernel``.

    ``grad_out`` is viewed as ``(N, C_out)`` through its first two strides; ``grad_targets[i]`` is
    ``(mode, tensor, stride)`` for step ``i`` (``GRAD_NONE``/``GRAD_DIRECT``/``GRAD_SCRATCH``);
    ``grad_weight`` is the destination weight-shaped buffer; ``coef`` receives ``G`` (fp32 (N, C_out));
    ``scratch`` is fp64 ``(max(steps, 1), C_out)`` for ``GRAD_SCRATCH`` steps.
    """
    n, c_in, t = taps.shape
    c_out = mean.shape[1]
    ch = chain.padded(mean)
    modes = tuple(m for m, _, _ in grad_targets) or (GRAD_NONE,)
    gops = tuple(g for _, g, _ in grad_targets) or (scratch,)
    gstrides = tuple(s for _, _, s in grad_targets) or (0,)
    plan = _plan_params(c_in // grad_weight.cin_g, grad_weight.cout_g, grad_weight.cin_g, t, ch.static(chain.steps),
                        modes, grad_bias is not None)  # fmt: skip
    plan.launch(
        grad_out, grad_out.stride(0), grad_out.stride(1), mean, taps, ch.ops, ch.strides, gops, gstrides,
        grad_weight.tensor, grad_weight.s_co, grad_weight.s_ci, grad_weight.s_t, grad_weight.off_g,
        grad_bias if grad_bias is not None else coef, grad_bias.stride(0) if grad_bias is not None else 0,
        coef, scratch, n, c_in, c_out, grad_weight.cin_g, grad_weight.cout_g, t, n_outputs
    )  # fmt: skip
