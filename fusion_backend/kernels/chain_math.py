"""The pointwise chain and pool arithmetic every conv-epilogue kernel shares (``epilogue``, ``conv_fused``,
``conv_dense``): op codes, the operand-matrix layout, the ``@triton.jit`` step functions with torch
semantics, PyTorch's avg-pool divisor, and the launch constexprs of a chain.

* The chain is up to ``MAX_SLOTS`` op-code slots (``OP0..OP7: tl.constexpr``, 0 = empty slot), using
  the stable codes of ``fusion_backend.ops.chain.PointwiseKind`` (kept as plain integers here).
* Every operand value lives in one small fp32 matrix ``P`` of shape ``(NUM_PARAM_ROWS, C)``: row
  ``BIAS_ROW`` holds the bias, rows ``1 + 2*k`` and ``2 + 2*k`` the first and second operand of slot
  ``k``, each expanded over the ``C`` output channels (``load_operands`` reads them).
* A slot may read an earlier chain value as its first operand instead of its operand row (a DAG
  epilogue such as ``y * sigmoid(y)``): its code then carries the source (``SOURCE_STRIDE``), and
  ``chain_slot_inputs`` / ``chain_backward`` route the value and its gradient.
* All arithmetic is fp32 whatever the storage dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch
import triton
import triton.language as tl

from ..ir.specs import PoolSpec

#: Number of op-code slots of the kernel templates (== chain.MAX_CHAIN_LENGTH).
MAX_SLOTS = 8
#: Row of ``P`` holding the conv bias.
BIAS_ROW = 0
#: Rows of ``P``: the bias, then two operand rows per slot.
NUM_PARAM_ROWS = 1 + 2 * MAX_SLOTS
#: Rows of the backward partial-sum buffer: one per slot (its first operand), then the bias.
NUM_GRAD_ROWS = MAX_SLOTS + 1
#: An op code past this stride names where its slot's first operand comes from: ``code // SOURCE_STRIDE - 1``
#: is the slot whose input (an earlier chain value) it reads instead of its operand row; ``code %
#: SOURCE_STRIDE`` is the op (mirrors ``ops.chain.SOURCE_STRIDE``; the jit functions spell it 32).
SOURCE_STRIDE = 32
#: Largest pool window the kernels unroll; larger windows go to the reference implementation.
#: NOTE: windows are fully unrolled (``tl.static_range``) together with the chain, so compile time
#: and code size grow with the window volume; 64 covers 4x4x4 / 8x8 windows.
MAX_WINDOW_VOLUME = 64

# Op codes, mirrored from PointwiseKind.code (tests/kernels/test_epilogue_kernels.py checks they agree).
_RELU, _LEAKY_RELU, _GELU, _GELU_TANH, _SILU, _SIGMOID, _TANH, _HARDSWISH, _MISH = range(1, 10)
_CLAMP, _CLAMP_MIN, _CLAMP_MAX, _MUL, _ADD, _SUB, _RSUB, _DIV, _RDIV, _HARDTANH, _MINIMUM, _MAXIMUM = range(10, 22)
OP_CODES = {
    "relu": _RELU, "leaky_relu": _LEAKY_RELU, "gelu": _GELU, "gelu_tanh": _GELU_TANH,
    "silu": _SILU, "sigmoid": _SIGMOID, "tanh": _TANH, "hardswish": _HARDSWISH, "mish": _MISH,
    "clamp": _CLAMP, "clamp_min": _CLAMP_MIN, "clamp_max": _CLAMP_MAX, "mul": _MUL, "add": _ADD,
    "sub": _SUB, "rsub": _RSUB, "div": _DIV, "rdiv": _RDIV, "hardtanh": _HARDTANH, "minimum": _MINIMUM,
    "maximum": _MAXIMUM,
}  # fmt: skip
#: The op codes whose first operand gets a gradient (``step_backward``'s ``d/da``): the arithmetic ops,
#: minimum / maximum and the bound of clamp_min / clamp_max.
OPERAND_GRAD_CODES = frozenset({_CLAMP_MIN, _CLAMP_MAX, _MUL, _ADD, _SUB, _RSUB, _DIV, _RDIV, _MINIMUM, _MAXIMUM})

#: An operand value as the launchers take it: a Python number, or a tensor of numel 1 (broadcast over
#: channels) or numel C (one value per channel, in channel order; any shape, any float dtype).
OperandValue = Union[float, torch.Tensor]
#: One chain step for the launchers: ``(op code, operand values)``.
KernelStep = tuple[int, Sequence[OperandValue]]


# --------------------------------------------------------------------------------------------------
# Pointwise math (fp32)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # NOTE: no tanh in tl/tl.math on every supported Triton, and libdevice is off limits; the exp
    # form 1 - 2/(e^2x + 1) loses relative precision near 0, so a Taylor polynomial (error < 1e-9
    # for |x| < 0.3) takes over there.  Max relative error is a few 1e-7 overall.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    # tanh(x) / x = 1 - x^2/3 + 2x^4/15 - 17x^6/315 + 62x^8/2835 - 1382x^10/155925 + O(x^12)
    poly = -0.008863235529902197
    poly = 0.021869488536155203 + x2 * poly
    poly = -0.05396825396825397 + x2 * poly
    poly = 0.13333333333333333 + x2 * poly
    poly = -0.3333333333333333 + x2 * poly
    poly = 1.0 + x2 * poly
    return tl.where(ax < 0.3, x * poly, tl.where(x < 0.0, -big, big))


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _softplus(x):
    # log1p(exp(x)) without overflow: max(x, 0) + log1p(exp(-|x|)); log1p(t) = log(u) * t / (u - 1)
    # with u = 1 + t is exact to a few ulp (Goldberg), and falls back to t when u rounds to 1.
    t = tl.exp(-tl.abs(x))
    u = 1.0 + t
    lp = tl.where(u == 1.0, t, tl.log(u) * (t / (u - 1.0)))
    return tl.maximum(x, 0.0) + lp


@triton.jit
def load_operands(p_ptr, SLOT: tl.constexpr, c, C, cmask, OP: tl.constexpr):
    """Operand rows of slot ``SLOT`` at channels ``c`` (0.0 where the op takes no such operand).

    Masked-off channels read 1.0, so that divisions in lanes that are discarded stay finite.
    """
    a = 0.0
    b = 0.0
    if OP == 2:  # leaky_relu(slope)
        a = tl.load(p_ptr + (1 + 2 * SLOT) * C + c, mask=cmask, other=1.0)
    if OP >= 10:  # clamps, arithmetic, minimum and maximum take a first operand
        a = tl.load(p_ptr + (1 + 2 * SLOT) * C + c, mask=cmask, other=1.0)
    if OP == 10:  # clamp(lo, hi)
        b = tl.load(p_ptr + (2 + 2 * SLOT) * C + c, mask=cmask, other=1.0)
    if OP == 19:  # hardtanh(lo, hi)
        b = tl.load(p_ptr + (2 + 2 * SLOT) * C + c, mask=cmask, other=1.0)
    return a, b


@triton.jit
def load_chain_operands(p_ptr, c, C, cmask,
                        OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
                        OP4: tl.constexpr, OP5: tl.constexpr, OP6: tl.constexpr, OP7: tl.constexpr):  # fmt: skip
    """Every slot's operands at channels ``c``: ``(a0, b0, ..., a7, b7)`` as ``load_operands`` reads them."""
    a0, b0 = load_operands(p_ptr, 0, c, C, cmask, OP0)
    a1, b1 = load_operands(p_ptr, 1, c, C, cmask, OP1)
    a2, b2 = load_operands(p_ptr, 2, c, C, cmask, OP2)
    a3, b3 = load_operands(p_ptr, 3, c, C, cmask, OP3)
    a4, b4 = load_operands(p_ptr, 4, c, C, cmask, OP4)
    a5, b5 = load_operands(p_ptr, 5, c, C, cmask, OP5)
    a6, b6 = load_operands(p_ptr, 6, c, C, cmask, OP6)
    a7, b7 = load_operands(p_ptr, 7, c, C, cmask, OP7)
    return a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7


@triton.jit
def step_forward(v, a, b, OP: tl.constexpr):
    """One chain step with torch semantics (NaN propagates wherever torch propagates it)."""
    if OP == 1:  # relu: one NaN-propagating max (``max.NaN``), not a compare and a select
        v = tl.maximum(v, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif OP == 2:  # leaky_relu
        v = tl.where(v > 0.0, v, v * a)
    elif OP == 3:  # gelu (exact erf)
        v = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    elif OP == 4:  # gelu tanh approximation
        inner = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        v = 0.5 * v * (1.0 + _tanh(inner))
    elif OP == 5:  # silu
        v = v * _sigmoid(v)
    elif OP == 6:  # sigmoid
        v = _sigmoid(v)
    elif OP == 7:  # tanh
        v = _tanh(v)
    elif OP == 8:  # hardswish: x * min(max(x + 3, 0), 6) / 6, NaN-propagating like torch
        r = v + 3.0
        r = tl.where(r < 0.0, 0.0, r)
        r = tl.where(r > 6.0, 6.0, r)
        v = v * r / 6.0
    elif OP == 9:  # mish
        v = v * _tanh(_softplus(v))
    elif OP == 10 or OP == 19:  # clamp / hardtanh: min(max(v, lo), hi)
        v = tl.where(v < a, a, v)
        v = tl.where(v > b, b, v)
    elif OP == 11:  # clamp_min
        v = tl.where(v < a, a, v)
    elif OP == 12:  # clamp_max
        v = tl.where(v > a, a, v)
    elif OP == 13:
        v = v * a
    elif OP == 14:
        v = v + a
    elif OP == 15:
        v = v - a
    elif OP == 16:
        v = a - v
    elif OP == 17:
        v = v / a
    elif OP == 18:
        v = a / v
    elif OP == 20:  # minimum: NaN from either side propagates
        v = tl.where((v < a) | (v != v), v, a)
    elif OP == 21:  # maximum
        v = tl.where((v > a) | (v != v), v, a)
    return v


@triton.jit
def step_backward(g, v, a, b, OP: tl.constexpr):
    """Gradients of one step at input ``v`` given the output gradient ``g``: ``(d/dv, d/da)``.

    Derivatives follow torch's backward formulas (relu: 0 at 0; leaky_relu: slope at 0; clamp:
    inclusive bounds; hardtanh: strict bounds, NaN passes).  ``d/da`` is only meaningful for the
    arithmetic ops, minimum / maximum and the bound of clamp_min / clamp_max; it is 0.0 for the others.
    """
    gv = g
    ga = 0.0
    if OP == 1:  # threshold_backward on the result: passes where result > 0 (and for NaN)
        gv = tl.where(v <= 0.0, 0.0, g)
    elif OP == 2:
        gv = tl.where(v > 0.0, g, g * a)
    elif OP == 3:
        cdf = 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476))
        pdf = tl.exp(-0.5 * v * v) * 0.3989422804014327
        gv = g * (cdf + v * pdf)
    elif OP == 4:
        x_sq = v * v
        inner = 0.7978845608028654 * (v + 0.044715 * x_sq * v)
        th = _tanh(inner)
        left_d = 0.5 * (1.0 + th)
        right_d = 0.5 * v * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x_sq)
        gv = g * (left_d + right_d)
    elif OP == 5:
        s = _sigmoid(v)
        gv = g * (s * (1.0 + v * (1.0 - s)))
    elif OP == 6:
        s = _sigmoid(v)
        gv = g * (1.0 - s) * s
    elif OP == 7:
        t = _tanh(v)
        gv = g * (1.0 - t * t)
    elif OP == 8:
        gv = tl.where(v <= -3.0, 0.0, tl.where(v < 3.0, g * (v / 3.0 + 0.5), g))  # open interval, as torch
    elif OP == 9:
        s = _sigmoid(v)
        tsp = _tanh(_softplus(v))
        gv = g * (tsp + v * s * (1.0 - tsp * tsp))
    elif OP == 10:
        gv = tl.where((v >= a) & (v <= b), g, 0.0)
    elif OP == 11:  # the bound's gradient where it was taken (NaN: neither side, as torch)
        gv = tl.where(v >= a, g, 0.0)
        ga = tl.where(v < a, g, 0.0)
    elif OP == 12:
        gv = tl.where(v <= a, g, 0.0)
        ga = tl.where(v > a, g, 0.0)
    elif OP == 13:
        gv = g * a
        ga = g * v
    elif OP == 14:
        ga = g
    elif OP == 15:
        ga = -g
    elif OP == 16:
        gv = -g
        ga = g
    elif OP == 17:
        gv = g / a
        ga = -g * v / (a * a)
    elif OP == 18:
        gv = -g * a / (v * v)
        ga = g / v
    elif OP == 19:
        gv = tl.where(((v > a) & (v < b)) | (v != v), g, 0.0)
    elif OP == 20:  # minimum: half each at a tie, 0 to the side not taken (NaN: both get g)
        half = tl.where(v == a, 0.5 * g, g)
        gv = tl.where(v > a, 0.0, half)
        ga = tl.where(v < a, 0.0, half)
    elif OP == 21:  # maximum
        half = tl.where(v == a, 0.5 * g, g)
        gv = tl.where(v < a, 0.0, half)
        ga = tl.where(v > a, 0.0, half)
    return gv, ga


@triton.jit
def _slot_operand(a, OP: tl.constexpr, values):
    """A slot's first operand: ``a`` (its operand row), or for a code past ``SOURCE_STRIDE`` the chain's
    value before slot ``OP // SOURCE_STRIDE - 1`` (``values``: the inputs of the slots up to this one)."""
    if OP >= 32:
        a = values[OP // 32 - 1]
    return a


@triton.jit
def chain_slot_inputs(v, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
                      OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
                      OP4: tl.constexpr, OP5: tl.constexpr, OP6: tl.constexpr, OP7: tl.constexpr):  # fmt: skip
    """The chain applied to ``v``: the input of every slot and every slot's first operand,
    ``(v0, ..., v7, a0, ..., a7)`` with ``v0 = v`` (a backward walks back through them).  A slot whose
    code reads an earlier chain value gets it as its first operand (``_slot_operand``)."""
    a0 = _slot_operand(a0, OP0, (v,))
    v1 = step_forward(v, a0, b0, OP0 % 32)
    a1 = _slot_operand(a1, OP1, (v, v1))
    v2 = step_forward(v1, a1, b1, OP1 % 32)
    a2 = _slot_operand(a2, OP2, (v, v1, v2))
    v3 = step_forward(v2, a2, b2, OP2 % 32)
    a3 = _slot_operand(a3, OP3, (v, v1, v2, v3))
    v4 = step_forward(v3, a3, b3, OP3 % 32)
    a4 = _slot_operand(a4, OP4, (v, v1, v2, v3, v4))
    v5 = step_forward(v4, a4, b4, OP4 % 32)
    a5 = _slot_operand(a5, OP5, (v, v1, v2, v3, v4, v5))
    v6 = step_forward(v5, a5, b5, OP5 % 32)
    a6 = _slot_operand(a6, OP6, (v, v1, v2, v3, v4, v5, v6))
    v7 = step_forward(v6, a6, b6, OP6 % 32)
    a7 = _slot_operand(a7, OP7, (v, v1, v2, v3, v4, v5, v6, v7))
    return v, v1, v2, v3, v4, v5, v6, v7, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _slot_backward(g, K: tl.constexpr, v, a, b, gas, OP: tl.constexpr, OPS: tl.constexpr):
    """Slot ``K``'s step (code ``OP``) walked back from ``g``, the gradient of its result: ``(d/d its
    input, d/d its first operand)``.  The input's gradient includes the first-operand gradients of the
    slots that read this input again (its own, and of the later slots in ``gas``, every slot's ``d/da``
    with the later ones computed); ``OPS``: every slot's code."""
    g, ga = step_backward(g, v, a, b, OP % 32)
    if OP // 32 == K + 1:
        g = g + ga
    for m in tl.static_range(K + 1, len(OPS)):
        if OPS[m] // 32 == K + 1:
            g = g + gas[m]
    return g, ga


@triton.jit
def chain_backward(g, v0, v1, v2, v3, v4, v5, v6, v7, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6,
                   a7, b7, OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
                   OP4: tl.constexpr, OP5: tl.constexpr, OP6: tl.constexpr, OP7: tl.constexpr):  # fmt: skip
    """Walk the chain back from the gradient ``g`` of its result, given the slot inputs and first
    operands of ``chain_slot_inputs``: ``(d/dv0, d/da0, ..., d/da7)``.  Where a slot's first operand is an
    earlier chain value, its gradient joins that value's (autograd sums the gradients of a value read
    twice); that slot's ``d/da`` is no operand row's gradient."""
    OPS = (OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7)
    ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    g, ga7 = _slot_backward(g, 7, v7, a7, b7, (ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7), OP7, OPS)
    g, ga6 = _slot_backward(g, 6, v6, a6, b6, (ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7), OP6, OPS)
    g, ga5 = _slot_backward(g, 5, v5, a5, b5, (ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7), OP5, OPS)
    g, ga4 = _slot_backward(g, 4, v4, a4, b4, (ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7), OP4, OPS)
    g, ga3 = _slot_backward(g, 3, v3, a3, b3, (ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7), OP3, OPS)
    g, ga2 = _slot_backward(g, 2, v2, a2, b2, (ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7), OP2, OPS)
    g, ga1 = _slot_backward(g, 1, v1, a1, b1, (ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7), OP1, OPS)
    g, ga0 = _slot_backward(g, 0, v0, a0, b0, (ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7), OP0, OPS)
    return g, ga0, ga1, ga2, ga3, ga4, ga5, ga6, ga7


@triton.jit
def chain_forward(v, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
               OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
               OP4: tl.constexpr, OP5: tl.constexpr, OP6: tl.constexpr, OP7: tl.constexpr):  # fmt: skip
    """The whole chain applied to ``v``."""
    _, _, _, _, _, _, _, v7, _, _, _, _, _, _, _, a7 = chain_slot_inputs(
        v, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7, OP0, OP1, OP2, OP3, OP4, OP5, OP6, OP7)  # fmt: skip
    return step_forward(v7, a7, b7, OP7 % 32)


@triton.jit
def apply_chain_at(x, p_ptr, c, C, cmask, OPS: tl.constexpr):
    """The chain with op codes ``OPS`` (a tuple of ``MAX_SLOTS`` codes) applied to ``x``, its operands
    read from the matrix ``p_ptr`` (``(NUM_PARAM_ROWS, C)`` fp32) at channels ``c`` (``c``'s shape
    broadcasts against ``x``'s; lanes outside ``cmask`` read ``load_operands``' fill)."""
    a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7 = load_chain_operands(
        p_ptr, c, C, cmask, OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])  # fmt: skip
    return chain_forward(x, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
                         OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])  # fmt: skip


@triton.jit
def chain_grad_at(g, x, p_ptr, c, C, cmask, OPS: tl.constexpr):
    """The chain with op codes ``OPS`` (operands as ``apply_chain_at`` reads them) walked back from
    ``g`` at input ``x``: ``(d/dx, d/da0, ..., d/da7)``."""
    a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7 = load_chain_operands(
        p_ptr, c, C, cmask, OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])  # fmt: skip
    v0, v1, v2, v3, v4, v5, v6, v7, a0, a1, a2, a3, a4, a5, a6, a7 = chain_slot_inputs(
        x, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7,
        OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])  # fmt: skip
    return chain_backward(g, v0, v1, v2, v3, v4, v5, v6, v7, a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5,
                          a6, b6, a7, b7, OPS[0], OPS[1], OPS[2], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7])  # fmt: skip


@triton.jit
def avg_divisor(od, oh, ow, D, H, W,
                 KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                 SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                 PD: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                 COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR: tl.constexpr):  # fmt: skip
    """PyTorch's avg-pool divisor of window ``(od, oh, ow)`` (fp32)."""
    d0 = od * SD - PD
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    d1 = tl.minimum(d0 + KD, D + PD)
    h1 = tl.minimum(h0 + KH, H + PH)
    w1 = tl.minimum(w0 + KW, W + PW)
    if COUNT_INCLUDE_PAD:
        count = (d1 - d0) * (h1 - h0) * (w1 - w0)
    else:
        count = (
            (tl.minimum(d1, D) - tl.maximum(d0, 0))
            * (tl.minimum(h1, H) - tl.maximum(h0, 0))
            * (tl.minimum(w1, W) - tl.maximum(w0, 0))
        )
    div = tl.maximum(count, 1).to(tl.float32)  # >= 1 for every real window; lanes out of range
    if DIVISOR != 0:
        div = tl.zeros_like(div) + DIVISOR
    return div


# --------------------------------------------------------------------------------------------------
# Pool windows (every pooling kernel: ``epilogue``, ``norm_pool``, the norms' backward kernels)
#
# Tensors are seen as (N, C, D, H, W), 1d/2d lifted with leading size-1 spatial dims; the pool is the
# constexpr tuple ``POOL_GEOM`` (``pool_geometry``) and the constexpr ``POOL`` (``pool_code``: 0 none,
# 1 max, 2 avg).  A max pool's winner is its row-major tap index within the window (``kd * KH * KW +
# kh * KW + kw``).
# --------------------------------------------------------------------------------------------------


@triton.jit
def spatial_coords(s, H, W):
    """The spatial position ``(d, h, w)`` of flat position ``s`` over spatial sizes ``(*, H, W)``
    (row-major)."""
    w = s % W
    t = s // W
    h = t % H
    return t // H, h, w


@triton.jit
def add_spatial_offset(offset, d, h, w, s_d, s_h, s_w):
    """``offset`` (int64) plus the element offset of spatial position ``(d, h, w)`` under strides
    ``(s_d, s_h, s_w)``, computed in int64."""
    return offset + d.to(tl.int64) * s_d + h.to(tl.int64) * s_h + w.to(tl.int64) * s_w


@triton.jit
def pool_divisor(od, oh, ow, D, H, W, POOL_GEOM: tl.constexpr):
    """PyTorch's avg-pool divisor (fp32, ``avg_divisor``) of window ``(od, oh, ow)`` over an input of
    spatial sizes ``(D, H, W)``; ``POOL_GEOM``: ``(window, stride, padding)``, each per (d, h, w), then
    ``count_include_pad`` and the divisor override (0: none)."""
    KD: tl.constexpr = POOL_GEOM[0][0]
    KH: tl.constexpr = POOL_GEOM[0][1]
    KW: tl.constexpr = POOL_GEOM[0][2]
    SD: tl.constexpr = POOL_GEOM[1][0]
    SH: tl.constexpr = POOL_GEOM[1][1]
    SW: tl.constexpr = POOL_GEOM[1][2]
    PD: tl.constexpr = POOL_GEOM[2][0]
    PH: tl.constexpr = POOL_GEOM[2][1]
    PW: tl.constexpr = POOL_GEOM[2][2]
    COUNT_INCLUDE_PAD: tl.constexpr = POOL_GEOM[3]
    DIVISOR: tl.constexpr = POOL_GEOM[4]
    return avg_divisor(od, oh, ow, D, H, W, KD, KH, KW, SD, SH, SW, PD, PH, PW, COUNT_INCLUDE_PAD, DIVISOR)


@triton.jit
def pool_accumulate(best, win, acc, v, ok, tap, POOL: tl.constexpr):
    """One tap of a window scan: ``(best, win, acc, take)`` after tap ``tap`` (its row-major index in
    the window) with value ``v``, valid where ``ok``.  Max pool (POOL 1): PyTorch's rule: the first
    valid tap wins initially (``win < 0``: none yet), a later one replaces the winner only when
    ``v > best`` or ``v`` is NaN, so ties go to the first maximum in window order and padding never
    wins; ``take`` says where this tap became the winner.  Avg pool (POOL 2): ``acc`` sums the valid
    taps (``best`` and ``win`` unchanged)."""
    take = ok & ((v > best) | (v != v) | (win < 0))
    if POOL == 1:
        best = tl.where(take, v, best)
        win = tl.where(take, tap, win)
    else:
        acc += tl.where(ok, v, 0.0)
    return best, win, acc, take


@triton.jit
def pool_gather(gout_ptr, win_ptr, win_y_ptr, g_nc, w_nc, d, h, w, mask, y, won, D, H, W, OD, OH, OW,
                g_sd, g_sh, g_sw, w_sd, w_sh, w_sw,
                POOL: tl.constexpr, POOL_GEOM: tl.constexpr, WIN_Y: tl.constexpr):  # fmt: skip
    """The gradient at the pool's input position ``(d, h, w)`` (where ``mask``), gathered from the
    windows that contain it (no scatter, no atomics): ``(g, y, won)``.

    Candidate windows along each dim: ``o = (i + P) // S - j`` for ``j < ceil(K / S)``, valid when
    ``0 <= o < O`` and the tap ``k = i + P - o * S`` is ``< K`` (``i + P >= 0``: no negative floor).
    Max pool (POOL 1): the gradient of every window this position won (``win_ptr``'s winner index ==
    its tap), summed (overlapping windows); ``won`` or-ed with where it won one; with ``WIN_Y``, ``y``
    replaced by the window's saved value at its winner (``win_y_ptr``).  Avg pool (POOL 2): every
    window's gradient over its ``pool_divisor``.  ``y`` and ``won`` come back unchanged otherwise.

    Offsets: ``gout_ptr + g_nc + spatial offset`` under ``g_s*`` (the pooled gradient, any float
    dtype) and ``win_ptr`` / ``win_y_ptr + w_nc + ...`` under ``w_s*`` (int8 / int32 winners and, with
    WIN_Y, the values at them); ``g_nc`` / ``w_nc``: the (sample, channel) offsets, int64,
    broadcasting against ``mask``.  ``(D, H, W)`` the input's spatial sizes, ``(OD, OH, OW)`` the
    pooled ones.
    """
    WINDOW: tl.constexpr = POOL_GEOM[0]
    STRIDE: tl.constexpr = POOL_GEOM[1]
    PAD: tl.constexpr = POOL_GEOM[2]
    g = tl.zeros_like(y)
    NJD: tl.constexpr = (WINDOW[0] + STRIDE[0] - 1) // STRIDE[0]
    NJH: tl.constexpr = (WINDOW[1] + STRIDE[1] - 1) // STRIDE[1]
    NJW: tl.constexpr = (WINDOW[2] + STRIDE[2] - 1) // STRIDE[2]
    for jd in tl.static_range(NJD):
        od = (d + PAD[0]) // STRIDE[0] - jd
        kd = d + PAD[0] - od * STRIDE[0]
        ok_d = (od >= 0) & (od < OD) & (kd < WINDOW[0])
        for jh in tl.static_range(NJH):
            oh = (h + PAD[1]) // STRIDE[1] - jh
            kh = h + PAD[1] - oh * STRIDE[1]
            ok_h = ok_d & (oh >= 0) & (oh < OH) & (kh < WINDOW[1])
            for jw in tl.static_range(NJW):
                ow = (w + PAD[2]) // STRIDE[2] - jw
                kw = w + PAD[2] - ow * STRIDE[2]
                ok = mask & ok_h & (ow >= 0) & (ow < OW) & (kw < WINDOW[2])
                g_off = add_spatial_offset(g_nc, od, oh, ow, g_sd, g_sh, g_sw)
                if POOL == 1:
                    w_off = add_spatial_offset(w_nc, od, oh, ow, w_sd, w_sh, w_sw)
                    widx = tl.load(win_ptr + w_off, mask=ok, other=-1).to(tl.int32)
                    hit = ok & (widx == kd * (WINDOW[1] * WINDOW[2]) + kh * WINDOW[2] + kw)
                    g += tl.load(gout_ptr + g_off, mask=hit, other=0.0).to(tl.float32)
                    if WIN_Y:
                        y = tl.where(hit, tl.load(win_y_ptr + w_off, mask=hit, other=0.0).to(tl.float32), y)
                    won = won | hit
                else:
                    div = pool_divisor(od, oh, ow, D, H, W, POOL_GEOM)
                    go = tl.load(gout_ptr + g_off, mask=ok, other=0.0).to(tl.float32)
                    g += tl.where(ok, go / div, 0.0)  # windows out of range have div 0
    return g, y, won


_KNOWN_CODES = frozenset(OP_CODES.values())


def op_constexprs(steps: Sequence[KernelStep]) -> dict[str, int]:
    """The chain as the kernels' per-slot constexprs ``OP0 .. OP{MAX_SLOTS-1}`` (0 = empty slot);
    ValueError for an unknown op code."""
    codes = [int(code) for code, _ in steps] + [0] * (MAX_SLOTS - len(steps))
    for code in codes:
        if code != 0 and (code % SOURCE_STRIDE not in _KNOWN_CODES or code // SOURCE_STRIDE > MAX_SLOTS):
            raise ValueError(f"unknown op code {code}")
    return {f"OP{k}": code for k, code in enumerate(codes)}


def op_codes(steps: Sequence[KernelStep]) -> tuple[int, ...]:
    """The kernels' chain constexpr (``OPS`` / ``PRE`` / ``POST``): one op code per slot, padded with
    0 to ``MAX_SLOTS``; ValueError for an unknown op code."""
    return tuple(op_constexprs(steps).values())


def step_codes(steps: Sequence[KernelStep]) -> tuple[int, ...]:
    """The steps' op codes, unpadded: what a launch plan of the chain depends on (its key part;
    the operand values are bound per call)."""
    return tuple([int(code) for code, _ in steps])


def pool_geometry(pool: PoolSpec | None, spatial_dims: int) -> tuple:
    """The kernels' ``POOL_GEOM`` constexpr: ``(window, stride, padding, count_include_pad, divisor)``,
    the first three lifted to 3 spatial dims (kernel 1, stride 1, no padding on the added dims), the
    divisor override 0 where there is none; the identity pool without a pool.  ValueError for a
    window the kernels do not unroll (above ``MAX_WINDOW_VOLUME`` taps)."""
    if pool is None:
        return ((1, 1, 1), (1, 1, 1), (0, 0, 0), True, 0)
    if pool.window_volume > MAX_WINDOW_VOLUME:
        raise ValueError(f"pool windows above {MAX_WINDOW_VOLUME} taps are not unrolled, got {pool}")
    if not (len(pool.kernel_size) == len(pool.stride) == len(pool.padding) == spatial_dims):
        raise ValueError(f"pool geometry {pool} does not have {spatial_dims} spatial dims")
    pad = 3 - spatial_dims
    window = (1,) * pad + tuple(int(v) for v in pool.kernel_size)
    stride = (1,) * pad + tuple(int(v) for v in pool.stride)
    padding = (0,) * pad + tuple(int(v) for v in pool.padding)
    return window, stride, padding, bool(pool.count_include_pad), int(pool.divisor_override or 0)


def pool_code(pool: PoolSpec | None) -> int:
    """The kernels' ``POOL`` constexpr: 0 none, 1 max, 2 avg."""
    return 0 if pool is None else (1 if pool.kind == "max" else 2)
