"""The conv family's backward (``kernels/conv``: ``conv_wgrad``, ``conv_dgrad``) against float64, with
eager's own error as the yardstick.

As the forward's tests: tiny, odd shapes under Triton's interpreter, tiles forced small so that a call
spans several tiles and K steps; each gradient is checked by ``testing.compare`` against
``reference.conv_{w,d}grad_reference`` in float64 (the truth), allowed ``max(floor, 2 x eager's
error)``, eager being the same reference in the input dtype (torch's own convolution backward).
"""

from __future__ import annotations

import pytest
import torch

from fusion_backend.kernels.conv import (
    Activation,
    ChannelAffine,
    GroupAffine,
    SampleChannelScale,
    TileConfig,
    conv_wgrad,
    wgrad,
)
from fusion_backend.kernels.conv.reference import conv_fprop_reference, conv_wgrad_reference
from fusion_backend.testing import compare, stable_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

#: The least error bound relative to the result's norm (as the forward's tests).
FLOOR = {torch.float32: 5e-7, torch.float16: 5e-4, torch.bfloat16: 4e-3}
#: The bias gradient is a plain sum of M terms of either sign (|Σ| far below Σ|terms|) that eager sums
#: pairwise; ours adds fp32 tile sums per split: a few roundings of Σ|terms| more, relative to a small
#: result (about 7e-7 seen on these shapes).
BIAS_FLOOR = {torch.float32: 2e-6, torch.float16: 5e-4}
SMALL = TileConfig(16, 16, 16, num_warps=1, num_stages=1)
SMALL_FLAT = TileConfig(16, 16, 16, num_warps=1, num_stages=1, flat_k=True)


def _randn(*shape, g, dtype=torch.float32, scale=1.0):  # noqa: ANN001, ANN002
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def _out_shape(xs, ws, conv) -> tuple[int, ...]:  # noqa: ANN001
    y = conv_fprop_reference(torch.zeros(xs, device="meta"), torch.zeros(ws, device="meta"), **conv)[0]
    return tuple(y.shape)


def _compare(name: str, got: torch.Tensor, eager: torch.Tensor, truth: torch.Tensor, floor: float | None = None) -> None:
    why = compare(name, got, eager, floor or FLOOR[got.dtype], reference=truth)
    assert why is None, why


def _check_wgrad(name: str, grad_y, x, w, **kw):  # noqa: ANN001, ANN003
    """``conv_wgrad`` against the float64 reference (eager's error as the yardstick)."""
    gw, gb = conv_wgrad(grad_y, x, w, **kw)
    for k in ("tile", "split"):
        kw.pop(k, None)
    eager_w, eager_b = conv_wgrad_reference(grad_y, x, w, **kw)
    truth_w, truth_b = conv_wgrad_reference(grad_y, x, w, dtype=torch.float64, **kw)
    assert gw.shape == w.shape and gw.dtype == w.dtype and gw.stride() == w.stride(), f"{name}: layout"
    _compare(f"{name} grad_w", gw, eager_w, truth_w)
    if kw.get("bias_grad"):
        _compare(f"{name} grad_bias", gb, eager_b, truth_b, BIAS_FLOOR[gb.dtype])
    return gw, gb


# name, x shape, weight shape, conv kwargs, tile
GEOMETRY = [
    ("conv1d-pad1", (2, 5, 11), (7, 5, 3), dict(padding=1), None),
    ("conv1d-stride2-dil2-pad2", (2, 3, 13), (4, 3, 3), dict(stride=2, padding=2, dilation=2), SMALL_FLAT),
    ("conv2d-stride2-input7-tail", (2, 4, 7, 7), (6, 4, 3, 3), dict(stride=2, padding=1), None),
    ("conv2d-stride2-no-pad-drops-last-row", (1, 3, 8, 7), (5, 3, 3, 3), dict(stride=2), SMALL_FLAT),
    ("conv2d-dil2", (1, 3, 9, 8), (4, 3, 3, 3), dict(padding=2, dilation=2), None),
    ("conv2d-tap-major-cin20-cout24", (2, 20, 5, 4), (24, 20, 3, 3), dict(padding=1), SMALL),
    ("groups2", (2, 6, 5, 6), (4, 3, 3, 3), dict(padding=1, groups=2), None),
    ("groups2-tap-major", (1, 32, 4, 5), (10, 16, 3, 3), dict(padding=1, groups=2, stride=(2, 1)), SMALL),
    ("depthwise-stride2", (2, 7, 6, 5), (7, 1, 3, 3), dict(padding=1, groups=7, stride=2), None),
    ("conv3d-pad1-stride121", (1, 3, 5, 6, 4), (5, 3, 3, 3, 3), dict(padding=1, stride=(1, 2, 1)), SMALL_FLAT),
]  # fmt: skip


# --------------------------------------------------------------------------------------------------
# wgrad
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GEOMETRY, ids=[c[0] for c in GEOMETRY])
def test_wgrad_geometry_matches_float64_fp32(case):
    name, xs, ws, conv, tile = case
    g = torch.Generator().manual_seed(stable_seed(("wgrad", name)))
    x = _channels_last(_randn(*xs, g=g))
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    _check_wgrad(name, gy, x, _randn(*ws, g=g), bias_grad=True, tile=tile, split=2, **conv)


@pytest.mark.parametrize("name", ["conv2d-stride2-input7-tail", "groups2-tap-major", "conv3d-pad1-stride121"])
def test_wgrad_half_accumulates_in_fp32(name):
    _, xs, ws, conv, tile = next(c for c in GEOMETRY if c[0] == name)
    g = torch.Generator().manual_seed(stable_seed(("wgrad-half", name)))
    x = _channels_last(_randn(*xs, g=g, dtype=torch.float16))
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g, dtype=torch.float16))
    gw, gb = _check_wgrad(name, gy, x, _randn(*ws, g=g, dtype=torch.float16), bias_grad=True, tile=tile, **conv)
    assert gw.dtype == gb.dtype == torch.float16


def _prologue(kind: str, n: int, c: int, g: torch.Generator, affine: bool = True):
    if kind == "channel_affine":  # shifts far from 0: a padded tap that saw the shift would show
        return ChannelAffine(_randn(c, g=g).abs() + 0.5, _randn(c, g=g) + 2.0)
    if kind == "group_affine":
        weight, bias = (_randn(c, g=g), _randn(c, g=g) + 1.0) if affine else (None, None)
        return GroupAffine(_randn(n, c // 2, g=g).abs() + 0.5, _randn(n, c // 2, g=g) - 1.5, weight, bias)
    return SampleChannelScale(torch.sigmoid(_randn(n, c, g=g)) + 0.5)


PROLOGUES = [
    ("channel_affine", "relu"),
    ("group_affine", "silu"),
    ("group_affine-no-affine", "gelu"),
    ("gate", Activation("leaky_relu", 0.2)),
]


@pytest.mark.parametrize("kind,act", PROLOGUES, ids=[f"{k}-{getattr(a, 'kind', a)}" for k, a in PROLOGUES])
def test_wgrad_recomputes_each_prologue_on_load(kind, act):
    """The gradient of ``conv(act(norm(x)))``'s weight from the pre-norm ``x``: the hooked input is
    rebuilt while loading (padded taps 0 after the hook), compared to autograd through the forward
    reference."""
    g = torch.Generator().manual_seed(stable_seed(("wgrad", kind, str(act))))
    xs, ws, conv = (2, 6, 5, 6), (7, 6, 3, 3), dict(padding=(1, 2), stride=(2, 1))
    x = _channels_last(_randn(*xs, g=g))
    w = _randn(*ws, g=g, scale=0.3)
    prologue = _prologue(kind.split("-")[0], 2, 6, g, affine=not kind.endswith("no-affine"))
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    gw, _ = _check_wgrad(kind, gy, x, w, prologue=prologue, act_in=act, tile=SMALL_FLAT, split=3, **conv)
    # the same as autograd through the forward reference
    w64 = w.double().requires_grad_(True)
    y = conv_fprop_reference(x, w64, prologue=prologue, act_in=act, dtype=torch.float64, **conv)[0]
    (auto,) = torch.autograd.grad(y, w64, gy.double())
    torch.testing.assert_close(gw.double(), auto, rtol=1e-5, atol=1e-5)


def test_wgrad_is_bit_identical_across_runs_and_splits_only_reorder():
    g = torch.Generator().manual_seed(51)
    xs, ws, conv = (3, 8, 7, 6), (12, 8, 3, 3), dict(padding=1)
    x = _channels_last(_randn(*xs, g=g))
    w = _randn(*ws, g=g)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    kw = dict(bias_grad=True, tile=SMALL_FLAT, prologue=ChannelAffine(_randn(8, g=g), _randn(8, g=g)), act_in="relu",
              **conv)
    first = conv_wgrad(gy, x, w, split=4, **kw)
    assert wgrad._PLANS.values()[-1].split == 4
    again = conv_wgrad(gy, x, w, split=4, **kw)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    one = conv_wgrad(gy, x, w, split=1, **kw)
    torch.testing.assert_close(one[0], first[0], rtol=1e-5, atol=1e-5)


def test_wgrad_reads_sliced_and_nchw_grad_y():
    """A window of a larger channels-last gradient (channel stride 1, the parent's other strides) is read
    in place; an NCHW gradient is relaid once; both give the contiguous one's result."""
    g = torch.Generator().manual_seed(53)
    x = _channels_last(_randn(2, 5, 7, 6, g=g))
    w = _randn(6, 5, 3, 3, g=g)
    parent = _channels_last(_randn(3, 9, 6, 7, g=g))
    parent[0], parent[:, 0], parent[:, :, 0] = float("nan"), float("nan"), float("nan")
    gy = parent[1:, 2:8, 1:5, 3:6]  # (2, 6, 4, 3): stride 2, padding 1 over 7 x 6
    assert gy.stride(1) == 1 and not gy.is_contiguous(memory_format=torch.channels_last)
    sliced = _check_wgrad("sliced grad_y", gy, x, w, stride=2, padding=1, bias_grad=True)
    assert not wgrad._PLANS.values()[-1].relayout_dy
    nchw = conv_wgrad(gy.contiguous(), x, w, stride=2, padding=1, bias_grad=True)
    assert wgrad._PLANS.values()[-1].relayout_dy
    dense = conv_wgrad(_channels_last(gy), x, w, stride=2, padding=1, bias_grad=True)
    for a, b in zip(sliced + nchw, dense + dense, strict=True):
        assert torch.equal(a, b)


def test_wgrad_gives_grad_w_in_the_weights_layout():
    g = torch.Generator().manual_seed(57)
    x = _channels_last(_randn(1, 4, 5, 5, g=g))
    w = _channels_last(_randn(6, 4, 3, 3, g=g))  # a channels-last weight keeps its strides
    gy = _channels_last(_randn(1, 6, 5, 5, g=g))
    _check_wgrad("channels-last weight", gy, x, w, padding=1)


def test_wgrad_int64_offsets_give_the_same_result(monkeypatch):
    g = torch.Generator().manual_seed(59)
    x = _channels_last(_randn(2, 16, 5, 6, g=g))
    w = _randn(6, 16, 3, 3, g=g)
    gy = _channels_last(_randn(2, 6, 5, 6, g=g))
    small = conv_wgrad(gy, x, w, padding=1, bias_grad=True, tile=SMALL, split=2)
    monkeypatch.setattr(wgrad, "_BIG_INDEX_THRESHOLD", 0)
    wgrad._PLANS.clear()
    big = conv_wgrad(gy, x, w, padding=1, bias_grad=True, tile=SMALL, split=2)
    assert wgrad._PLANS.values()[-1].launch.constexprs["BIG"]
    assert torch.equal(small[0], big[0]) and torch.equal(small[1], big[1])
