"""The conv family's backward (``kernels/conv``: ``conv_wgrad``, ``conv_dgrad``) against float64, with
eager's own error as the yardstick.

As the forward's tests: tiny, odd shapes under Triton's interpreter, tiles forced small so that a call
spans several tiles and K steps; each gradient is checked by ``testing.compare`` against
``reference.conv_{w,d}grad_reference`` in float64 (the truth), allowed ``max(floor, 2 x eager's
error)``, eager being the same reference in the input dtype (torch's own convolution backward).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conv_prologues import PROLOGUES, conv_prologue, prologue_ids
from conv_tma_cases import TMA_1X1_SHAPES, TMA_ROW_TILES, TMA_STRIDED_1X1_SHAPES, requires_sm90

from fusion_backend.kernels.conv import (
    Activation,
    ChannelAffine,
    NormStats,
    TileConfig,
    conv_dgrad,
    conv_fprop,
    conv_wgrad,
    dgrad,
    split_sum,
    wgrad,
)
from fusion_backend.kernels.conv.reference import (
    conv_dgrad_reference,
    conv_fprop_reference,
    conv_wgrad_reference,
)
from fusion_backend.kernels.plan_cache import ContractError
from fusion_backend.testing import compare, stable_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
              pytest.mark.usefixtures("exact_fp32_heuristic_tiles")]

#: The least error bound relative to the result's norm (as the forward's tests).
FLOOR = {torch.float32: 5e-7, torch.float16: 5e-4, torch.bfloat16: 4e-3}
#: The bias gradient is a plain sum of M terms of either sign (|Σ| far below Σ|terms|) that eager sums
#: pairwise; ours adds fp32 tile sums per split: a few roundings of Σ|terms| more, relative to a small
#: result (about 7e-7 seen on these shapes).
BIAS_FLOOR = {torch.float32: 2e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}
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
    assert gw.shape == w.shape and gw.dtype == w.dtype and gw.stride() == torch.empty_like(w).stride(), f"{name}: layout"
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


def _check_wgrad_prologue(name: str, kind: str, act, xs, ws, conv, tile: TileConfig, split: int) -> None:  # noqa: ANN001
    """``conv_wgrad`` of ``conv(act(prologue(x)))`` with the prologue of ``kind`` recomputed on load:
    against the float64 reference (``_check_wgrad``) and against autograd through the forward reference."""
    g = torch.Generator().manual_seed(stable_seed((name, kind, str(act), repr(tile))))
    x = _channels_last(_randn(*xs, g=g))
    w = _randn(*ws, g=g, scale=0.3)
    prologue = conv_prologue(kind, xs[0], xs[1], g, DEVICE)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    gw, _ = _check_wgrad(f"{name} {kind}", gy, x, w, prologue=prologue, act_in=act, tile=tile, split=split, **conv)
    w64 = w.double().requires_grad_(True)
    y = conv_fprop_reference(x, w64, prologue=prologue, act_in=act, dtype=torch.float64, **conv)[0]
    (auto,) = torch.autograd.grad(y, w64, gy.double())
    torch.testing.assert_close(gw.double(), auto, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,act", PROLOGUES, ids=prologue_ids(PROLOGUES))
def test_wgrad_recomputes_each_prologue_on_load(kind, act):
    """The gradient of ``conv(act(norm(x)))``'s weight from the pre-norm ``x``: the hooked input is
    rebuilt while loading (padded taps 0 after the hook)."""
    _check_wgrad_prologue("wgrad", kind, act, (2, 6, 5, 6), (7, 6, 3, 3), dict(padding=(1, 2), stride=(2, 1)),
                          SMALL_FLAT, 3)  # fmt: skip


@pytest.mark.parametrize("tile", [SMALL, SMALL_FLAT], ids=["tap-major", "flat"])
@pytest.mark.parametrize("kind,act", PROLOGUES, ids=prologue_ids(PROLOGUES))
def test_wgrad_of_an_unpadded_conv_recomputes_the_prologue_and_rows_past_the_output_add_nothing(kind, act, tile):
    """Without padding the loads take no pad mask and the rows past the output (M = 3 x 6 x 5 fills no
    tile) read the last row's window: their grad_y rows are 0, so they must add exactly nothing."""
    _check_wgrad_prologue("wgrad-unpadded", kind, act, (3, 16, 7, 5), (9, 16, 2, 1), dict(stride=1), tile, 2)


@pytest.mark.parametrize("tile", [SMALL, SMALL_FLAT], ids=["tap-major", "flat"])
def test_wgrad_rows_past_the_output_add_nothing_even_beside_an_infinite_input(tile):
    """The rows past M (105 of a 16-row tile) address the last row's window: read as it is, times
    their zero grad_y, an infinite input there would turn eager's +-inf into NaN."""
    g = torch.Generator().manual_seed(stable_seed(("wgrad-inf-tail", tile.flat_k)))
    x = _channels_last(_randn(3, 16, 7, 5, g=g))
    x[-1, :4, -1, -1] = float("inf")  # the last output position's input (a 1x1 conv: M - 1)
    w = _randn(9, 16, 1, 1, g=g, scale=0.3)
    gy = _channels_last(_randn(3, 9, 7, 5, g=g))
    gw, _ = _check_wgrad("inf beside the tail", gy, x, w, tile=tile, split=2)
    assert gw[:, :4].isinf().all() and gw[:, 4:].isfinite().all()


def one_plan_kernel(ws: tuple[int, ...]) -> tuple[int, int, int]:
    """A weight shape's kernel size lifted to 3 dims, as a plan's geometry holds it."""
    return (*([1] * (5 - len(ws))), *ws[2:])


#: Several taps per program: tap-major tiles over kernels whose taps 2 or 3 divide, with channel blocks per
#: tap (cin 20 in blocks of 16: two per tap, the second a tail), groups, strides, 1-d and 3-d.
MULTI_TAP = [
    ("conv2d-3x3-cin20-two-blocks-per-tap", (2, 20, 5, 4), (24, 20, 3, 3), dict(padding=1), 3),
    ("conv2d-3x2-stride2", (2, 16, 7, 6), (8, 16, 3, 2), dict(stride=2, padding=1), 2),
    ("conv1d-k3-dil2", (2, 16, 13), (8, 16, 3), dict(padding=2, dilation=2), 3),
    ("conv3d-3x3x3", (1, 16, 4, 5, 4), (8, 16, 3, 3, 3), dict(padding=1), 3),
    ("groups2-k3x1", (1, 32, 6, 5), (10, 16, 3, 1), dict(padding=(1, 0), groups=2), 3),
]  # fmt: skip


@pytest.mark.parametrize("case", MULTI_TAP, ids=[c[0] for c in MULTI_TAP])
def test_wgrad_with_several_taps_per_program_matches_float64(case):
    """Each grad_y tile read once for 2 or 3 taps: the same partials as one tap per program (each
    accumulator sums the same products in the same order), so the result is bit for bit the one-tap one's."""
    name, xs, ws, conv, taps = case
    g = torch.Generator().manual_seed(stable_seed(("wgrad-taps", name)))
    x = _channels_last(_randn(*xs, g=g))
    w = _randn(*ws, g=g, scale=0.3)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    several = dataclasses.replace(SMALL, taps_per_program=taps)
    got = _check_wgrad(f"{taps} taps {name}", gy, x, w, tile=several, split=2, bias_grad=True, **conv)
    one = conv_wgrad(gy, x, w, tile=SMALL, split=2, bias_grad=True, **conv)
    assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])
    plans = wgrad._PLANS.values()  # (another test may have built the one-tap plan first: found by tile)
    several_plan = next(p for p in reversed(plans) if p.tile == several and p.geo.kernel == one_plan_kernel(ws))
    one_plan = next(p for p in reversed(plans) if p.tile == SMALL and p.geo == several_plan.geo)
    assert several_plan.launch.grid[0] * taps == one_plan.launch.grid[0]


@pytest.mark.parametrize("kind,act", PROLOGUES, ids=prologue_ids(PROLOGUES))
def test_wgrad_with_several_taps_per_program_recomputes_each_prologue(kind, act):
    _check_wgrad_prologue("wgrad-taps", kind, act, (2, 16, 5, 6), (8, 16, 3, 3), dict(padding=(1, 2)),
                          dataclasses.replace(SMALL, taps_per_program=3), 2)  # fmt: skip


def test_the_timed_choice_offers_the_halo_to_depthwise_weight_gradients_alone(monkeypatch):
    """A hooked weight gradient's timed candidates: the depthwise conv's direct tile with its halo next; a
    dense conv's several-taps tiles without it (``wgrad``'s NOTE: it measured slower there)."""
    from fusion_backend.kernels.conv import wgrad as wgrad_module

    offered = {}

    def record(pass_name, key, tiles, factory, device):
        offered[key[0] if isinstance(key, tuple) else key] = tiles
        return tiles[0]

    monkeypatch.setattr(wgrad_module, "tuned_tile", record)
    g = torch.Generator().manual_seed(5)
    for name, (c_in, groups) in {"dense": (16, 1), "depthwise": (16, 16)}.items():
        offered.clear()
        x = _channels_last(_randn(3, c_in, 5, 11, g=g))  # a size no other test takes: its plan is new
        w = _randn(16, c_in // groups, 3, 3, g=g, scale=0.3)
        gy = _channels_last(_randn(3, 16, 5, 11, g=g))
        hooks = dict(prologue=conv_prologue("channel_affine", 3, c_in, g, DEVICE), act_in="relu")
        conv_wgrad(gy, x, w, padding=1, groups=groups, **hooks)
        (tiles,) = offered.values()
        halos = [t for t in tiles if t.halo]
        if name == "dense":
            assert not halos and any(t.taps_per_program > 1 for t in tiles), tiles
        else:
            assert len(halos) == 1 and tiles[1] == halos[0], tiles


@pytest.mark.parametrize("kind,act", PROLOGUES, ids=prologue_ids(PROLOGUES))
@pytest.mark.parametrize("xs,ws,conv", [
    ((2, 20, 5, 7), (20, 1, 3, 3), dict(padding=1, groups=20)),
    ((2, 6, 7, 5), (6, 1, 5, 5), dict(padding=2, groups=6)),
], ids=["depthwise-3x3", "depthwise-5x5"])  # fmt: skip
def test_depthwise_wgrad_with_a_halo_reads_every_tap_from_one_window(xs, ws, conv, kind, act):
    """The depthwise weight gradient with the halo (every tap of a channel block in one program, from one
    window per M step) against float64 and autograd, every prologue kind; the per-tap programs' gradient
    up to rounding (the same products in the same order, but on the GPU the compiler contracts their
    multiply-adds differently) and bit for bit run to run."""
    tile = dataclasses.replace(SMALL, halo=True)
    _check_wgrad_prologue("wgrad-dw-halo", kind, act, xs, ws, conv, tile, 2)
    g = torch.Generator().manual_seed(stable_seed(("dw-halo-bits", kind, str(act), ws)))
    x = _channels_last(_randn(*xs, g=g))
    w = _randn(*ws, g=g, scale=0.3)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    hooks = dict(prologue=conv_prologue(kind, xs[0], xs[1], g, DEVICE), act_in=act)
    per_tap = conv_wgrad(gy, x, w, tile=SMALL, split=2, bias_grad=True, **hooks, **conv)
    window = conv_wgrad(gy, x, w, tile=tile, split=2, bias_grad=True, **hooks, **conv)
    again = conv_wgrad(gy, x, w, tile=tile, split=2, bias_grad=True, **hooks, **conv)
    torch.testing.assert_close(window, per_tap, rtol=1e-5, atol=1e-5)
    assert torch.equal(window[0], again[0]) and torch.equal(window[1], again[1])


@pytest.mark.parametrize("why,xs,ws,conv", [
    ("not depthwise", (1, 16, 6, 6), (8, 16, 3, 3), dict(padding=1)),
    ("a strided conv", (1, 16, 6, 6), (16, 1, 3, 3), dict(padding=1, stride=2, groups=16)),
    ("another size", (1, 16, 6, 6), (16, 1, 3, 3), dict(groups=16)),
    ("a 3-d conv", (1, 16, 3, 4, 4), (16, 1, 3, 3, 3), dict(padding=1, groups=16)),
], ids=lambda c: c if isinstance(c, str) else None)  # fmt: skip
def test_a_halo_weight_gradient_the_call_cannot_take_is_refused_in_one_line(why, xs, ws, conv):
    g = torch.Generator().manual_seed(0)
    x = _channels_last(_randn(*xs, g=g))
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    tile = dataclasses.replace(SMALL, halo=True)
    with pytest.raises(ContractError, match=why) as info:
        conv_wgrad(gy, x, _randn(*ws, g=g), tile=tile, **conv)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("conv,taps,words", [
    (dict(ws=(8, 16, 2, 2)), 3, "4 taps it divides"),
    (dict(ws=(8, 3, 3, 3)), 3, "1 with a flat K walk"),  # 3 channels: a flat K walk
], ids=["taps-not-divisible", "flat-walk"])  # fmt: skip
def test_several_taps_per_program_where_they_cannot_apply_is_refused_in_one_line(conv, taps, words):
    g = torch.Generator().manual_seed(0)
    ws = conv["ws"]
    x = _channels_last(_randn(1, ws[1], 5, 5, g=g))
    gy = _channels_last(_randn(*_out_shape(x.shape, ws, {}), g=g))
    tile = dataclasses.replace(SMALL, taps_per_program=taps, flat_k=ws[1] < 16)
    with pytest.raises(ContractError, match=words) as info:
        conv_wgrad(gy, x, _randn(*ws, g=g), tile=tile)
    assert "\n" not in str(info.value)
    with pytest.raises(ContractError, match="weight gradient's"):
        conv_dgrad(gy, _randn(*ws, g=g), x.shape, tile=dataclasses.replace(SMALL, taps_per_program=2))


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


@pytest.mark.parametrize("taps", [1, 3])
@pytest.mark.parametrize("weight_layout", ["channels_last", "sliced"])
def test_one_split_writes_the_weight_gradient_from_its_accumulators(taps, weight_layout):
    """With one split the programs round their accumulators into the gradient themselves (no partials, no
    sum launch), at the strides ``empty_like(weight)`` gives (channels-last here; contiguous for a sliced,
    non-dense weight): one rounding from three splits' result, the same bits on a rerun; three splits
    within eager's error of float64 through the sum launch."""
    g = torch.Generator().manual_seed(stable_seed(("wgrad-direct", taps, weight_layout)))
    xs, ws, conv = (2, 20, 12, 10), (24, 10, 3, 3), dict(padding=1, groups=2)
    x = _channels_last(_randn(*xs, g=g))
    w = _channels_last(_randn(*ws, g=g)) if weight_layout == "channels_last" else _randn(24, 10, 3, 5, g=g)[..., 1:4]
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    tile = dataclasses.replace(SMALL, taps_per_program=taps)
    three, bias3 = _check_wgrad(f"3 splits, {taps} taps", gy, x, w, tile=tile, split=3, bias_grad=True, **conv)
    one, bias1 = conv_wgrad(gy, x, w, tile=tile, split=1, bias_grad=True, **conv)
    plan = wgrad._PLANS.values()[-1]
    assert plan.split == 1 and plan.direct and one.stride() == torch.empty_like(w).stride()
    again = conv_wgrad(gy, x, w, tile=tile, split=1, bias_grad=True, **conv)
    assert torch.equal(one, again[0]) and torch.equal(bias1, again[1])
    torch.testing.assert_close(one, three, rtol=1e-5, atol=1e-6 * three.abs().max().item())
    torch.testing.assert_close(bias1, bias3, rtol=1e-5, atol=1e-6 * bias3.abs().max().item())


def test_wgrad_sums_more_splits_than_one_step_of_the_split_sum_reads(monkeypatch):  # noqa: ANN001
    """40 splits summed 4 slots per step in 10 steps (one program per 1,024 elements, forced here by
    asking the split sum for a single program: ``split_sum.split_sum_blocks``); the result matches float64
    and one split's, bit for bit across runs."""
    monkeypatch.setattr(split_sum, "_PROGRAMS", 1)
    assert split_sum.split_sum_blocks(2304, 40) == (1024, 4)
    g = torch.Generator().manual_seed(57)
    xs, ws, conv = (2, 8, 16, 20), (12, 8, 3, 3), dict(padding=1)
    x = _channels_last(_randn(*xs, g=g))
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    w = _randn(*ws, g=g)
    first, bias = _check_wgrad("40 splits", gy, x, w, bias_grad=True, tile=SMALL, split=40, **conv)
    plan = wgrad._PLANS.values()[-1]
    assert plan.split == 40 and plan.sum_splits.constexprs["SPLIT_BLOCK"] == 4
    again = conv_wgrad(gy, x, w, bias_grad=True, tile=SMALL, split=40, **conv)
    assert torch.equal(first, again[0]) and torch.equal(bias, again[1])
    one = conv_wgrad(gy, x, w, bias_grad=True, tile=SMALL, split=1, **conv)
    # One split sums its 640 products in another order than forty: fp32 rounding apart, scaled to the largest
    # entry (a 1e-5 absolute bound failed on an H200 at 1.1e-5, entries up to about 80).
    torch.testing.assert_close(one[0], first, rtol=1e-5, atol=1e-6 * first.abs().max().item())


@pytest.mark.parametrize("m_tiles,per_split", [(3136, 1), (3136, 4), (784, 16), (49, 64), (49, 512), (0, 3)])
def test_wgrad_split_aims_at_the_tiles_programs_per_sm(m_tiles, per_split):  # noqa: ANN001
    """``pick_split``: about ``programs_per_sm`` programs per SM (132 SMs for a CPU device), one program per
    SM about half the splits of two, never a split of fewer than 4 M tiles, at least one."""
    cpu = torch.device("cpu")
    two, one = (wgrad.pick_split(m_tiles, per_split, TileConfig(programs_per_sm=n), cpu) for n in (2, 1))
    for split, per_sm in ((two, 2), (one, 1)):
        assert split == max(1, min(-(-132 * per_sm // per_split), m_tiles // 4))
    assert one <= two <= 2 * one


def test_only_the_weight_gradient_takes_a_programs_per_sm():
    """A split's programs per SM is the weight gradient's option: other passes refuse it in one line,
    and out of 1..4 it is refused everywhere."""
    TileConfig(programs_per_sm=1).check_for("wgrad")
    for pass_name in ("fprop", "dgrad"):
        for tile in (TileConfig(programs_per_sm=1), TileConfig(one_split=True)):
            with pytest.raises(ContractError, match="programs per SM"):
                tile.check_for(pass_name)
    with pytest.raises(ContractError, match="programs_per_sm must be 1 to 4"):
        TileConfig(programs_per_sm=0).check_for("wgrad")


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


# --------------------------------------------------------------------------------------------------
# dgrad
# --------------------------------------------------------------------------------------------------


def _check_dgrad(name: str, grad_y, w, input_size, **kw):  # noqa: ANN001, ANN003
    """``conv_dgrad`` against the float64 reference (eager's error as the yardstick); returns
    ``(grad, sums)``."""
    grad, sums = conv_dgrad(grad_y, w, input_size, **kw)
    kw.pop("tile", None)
    eager, eager_sums = conv_dgrad_reference(grad_y, w, input_size, **kw)
    truth, truth_sums = conv_dgrad_reference(grad_y, w, input_size, dtype=torch.float64, **kw)
    assert grad.dtype == grad_y.dtype and grad.stride(1) == 1 and grad.movedim(1, -1).is_contiguous(), f"{name}: layout"
    _compare(f"{name} grad", grad, eager, truth)
    if kw.get("norm_stats") is not None:
        assert sums.count == truth_sums.count
        for what in ("sum_dz", "sum_dz_xhat"):
            _compare(f"{name} {what}", getattr(sums, what), getattr(eager_sums, what), getattr(truth_sums, what),
                     BIAS_FLOOR[grad.dtype])  # fmt: skip
    return grad, sums


@pytest.mark.parametrize("case", GEOMETRY, ids=[c[0] for c in GEOMETRY])
def test_dgrad_geometry_matches_float64_fp32(case):
    """Every stride (the tails a stride leaves: inputs no window reached get 0), padding, dilation,
    groups, depthwise, 1d-3d, both K walks."""
    name, xs, ws, conv, tile = case
    g = torch.Generator().manual_seed(stable_seed(("dgrad", name)))
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    _check_dgrad(name, gy, _randn(*ws, g=g), xs, tile=tile, **conv)


@pytest.mark.parametrize("name", ["conv2d-stride2-input7-tail", "groups2-tap-major", "conv3d-pad1-stride121"])
def test_dgrad_half_accumulates_in_fp32(name):
    _, xs, ws, conv, tile = next(c for c in GEOMETRY if c[0] == name)
    g = torch.Generator().manual_seed(stable_seed(("dgrad-half", name)))
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g, dtype=torch.float16))
    grad, _ = _check_dgrad(name, gy, _randn(*ws, g=g, dtype=torch.float16), xs, tile=tile, **conv)
    assert grad.dtype == torch.float16


# name, x shape, weight shape, conv kwargs: strided, dilation 1, 16+ output channels per group (tap-major)
PHASED = [
    ("3x3-s2-p1-odd", (2, 16, 7, 9), (16, 16, 3, 3), dict(stride=2, padding=1)),
    ("1x1-s2-odd-rows-get-zero", (2, 16, 7, 6), (32, 16, 1, 1), dict(stride=2)),
    ("2x2-s3-kernel-below-stride", (1, 16, 8, 10), (16, 16, 2, 2), dict(stride=3)),
    ("5x3-s(3,2)-p(2,1)", (1, 16, 11, 8), (16, 16, 5, 3), dict(stride=(3, 2), padding=(2, 1))),
    ("conv1d-k4-s2-p1", (2, 16, 13), (16, 16, 4), dict(stride=2, padding=1)),
    ("conv3d-s(2,1,2)-groups2", (1, 32, 5, 4, 5), (32, 16, 3, 3, 3), dict(stride=(2, 1, 2), padding=1, groups=2)),
    ("7x7-s2-p3-stem-like", (1, 16, 12, 11), (16, 16, 7, 7), dict(stride=2, padding=3)),
]  # fmt: skip


@pytest.mark.parametrize("case", PHASED, ids=[c[0] for c in PHASED])
def test_dgrad_strided_runs_phase_by_phase_over_the_taps_that_land(case):
    """A strided tap-major dgrad walks one phase (residue class of the input position mod the stride)
    per program over only its taps, kernels smaller than the stride included (phases no tap reaches
    store zeros); the result and the BatchNorm-backward sums (a partial row per program of every
    phase) match float64."""
    name, xs, ws, conv = case
    g = torch.Generator().manual_seed(stable_seed(("phased", name)))
    x = _channels_last(_randn(*xs, g=g, scale=2.0) + 1.0)
    stats, prologue, _, _ = _bn(x, g)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    w = _randn(*ws, g=g)
    _check_dgrad(name, gy, w, xs, tile=SMALL, **conv)
    assert dgrad._PLANS.values()[-1].phased
    _check_dgrad(f"{name} hooked", gy, w, xs, x_prev=x, prologue=prologue, act_in="relu", norm_stats=stats,
                 tile=SMALL, **conv)  # fmt: skip
    dilated = dict(conv, dilation=2, padding=2)
    if min(s for s in xs[2:]) > 8 and len(xs) == 4:  # dilation keeps the masked gather
        _check_dgrad(f"{name} dilated", _channels_last(_randn(*_out_shape(xs, ws, dilated), g=g)), w, xs,
                     tile=SMALL, **dilated)  # fmt: skip
        assert not dgrad._PLANS.values()[-1].phased


@pytest.mark.parametrize("stride", [1, 2])
def test_dgrad_reads_a_channels_last_weight_in_place_where_the_tile_pads_nothing(stride):
    """No per-call copy of the weight where its channels fill the tile; otherwise (NCHW weight, channels
    the tile pads) it is prearranged; same results, phased or not."""
    g = torch.Generator().manual_seed(stable_seed(("dgrad-weight", stride)))
    xs, ws, conv = (2, 32, 7, 6), (32, 16, 3, 3), dict(stride=stride, padding=1, groups=2)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    w = _randn(*ws, g=g)
    for weight, tile, in_place in ((_channels_last(w), SMALL, True), (w, SMALL, False),
                                   (_channels_last(w), TileConfig(16, 32, 16, 1, 1), False)):  # fmt: skip
        _check_dgrad(f"weight s{stride} {in_place}", gy, weight, xs, tile=tile, **conv)
        assert dgrad._PLANS.values()[-1].weight_in_place is in_place


# name, x shape, weight shape, conv kwargs: one input channel per group (the direct depthwise path)
ONE_INPUT_CHANNEL_PER_GROUP = [
    ("depthwise-s2-p1-odd", (2, 24, 7, 9), (24, 1, 3, 3), dict(stride=2, padding=1, groups=24)),
    ("depthwise-x2-dilation2", (1, 8, 9, 8), (16, 1, 3, 3), dict(padding=2, dilation=2, groups=8)),
    ("single-input-channel", (2, 1, 6, 7), (12, 1, 5, 5), dict(padding=2, stride=(1, 2))),
    ("depthwise-conv1d-k5-s3", (2, 20, 13), (20, 1, 5), dict(padding=2, stride=3, groups=20)),
    ("depthwise-conv3d", (1, 16, 4, 5, 4), (16, 1, 3, 3, 3), dict(padding=1, groups=16)),
]  # fmt: skip


@pytest.mark.parametrize("case", ONE_INPUT_CHANNEL_PER_GROUP, ids=lambda c: c[0])
def test_dgrad_with_one_input_channel_per_group_runs_the_direct_tile(case):
    """Depthwise (any multiplier, stride, dilation, 1d-3d) and single-channel-input dgrads gather their
    output channels directly, plain and with relu' and the BatchNorm-backward sums, against float64."""
    name, xs, ws, conv = case
    g = torch.Generator().manual_seed(stable_seed(("dw-dgrad", name)))
    x = _channels_last(_randn(*xs, g=g, scale=2.0) + 1.0)
    stats, prologue, _, _ = _bn(x, g)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    w = _randn(*ws, g=g)
    _check_dgrad(name, gy, w, xs, **conv)
    assert dgrad._PLANS.values()[-1].depthwise
    _check_dgrad(f"{name} hooked", gy, w, xs, x_prev=x, prologue=prologue, act_in="relu", norm_stats=stats,
                 tile=TileConfig(16, 16, 16, 1, 1), **conv)  # fmt: skip


@pytest.mark.parametrize("case", ONE_INPUT_CHANNEL_PER_GROUP, ids=lambda c: c[0])
def test_wgrad_with_one_input_channel_per_group_sums_directly(case):
    """Depthwise and single-channel-input weight gradients sum per (channel, tap) directly, the prologue
    recomputed on load, over several splits (bitwise the same run to run), with the bias gradient,
    against float64."""
    name, xs, ws, conv = case
    g = torch.Generator().manual_seed(stable_seed(("dw-wgrad", name)))
    x = _channels_last(_randn(*xs, g=g, scale=2.0) + 1.0)
    _, prologue, _, _ = _bn(x, g)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    w = _channels_last(_randn(*ws, g=g))
    _check_wgrad(name, gy, x, w, bias_grad=True, **conv)
    assert wgrad._PLANS.values()[-1].depthwise
    tile = TileConfig(16, 16, 16, 1, 1)
    gw, gb = _check_wgrad(f"{name} hooked", gy, x, w, prologue=prologue, act_in="relu", bias_grad=True, tile=tile,
                          split=3, **conv)  # fmt: skip
    again, again_b = conv_wgrad(gy, x, w, prologue=prologue, act_in="relu", bias_grad=True, tile=tile, split=3,
                                **conv)  # fmt: skip
    assert torch.equal(gw, again) and torch.equal(gb, again_b)


def test_dgrad_is_a_transposed_convs_forward():
    """``conv_transpose2d(y, w, stride 2, padding 1, output_padding 1)`` is the dgrad of ``y`` with the
    output padding carried by ``input_size``."""
    g = torch.Generator().manual_seed(61)
    y = _channels_last(_randn(2, 6, 4, 3, g=g))
    w = _randn(6, 4, 3, 3, g=g)
    got, _ = conv_dgrad(y, w, (2, 4, 8, 6), stride=2, padding=1)
    want = F.conv_transpose2d(y.double(), w.double(), stride=2, padding=1, output_padding=1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


ACTIVATIONS = ["relu", Activation("leaky_relu", 0.3), "gelu", "silu"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: getattr(a, "kind", a))
def test_dgrad_applies_each_activations_derivative_at_the_recomputed_prologue(act, dtype):
    """``grad_z = grad_a * act'(x_prev * scale + shift)``; x_prev is built so that z is exactly 0 at
    some positions (torch's tie conventions: relu'(0) = 0, leaky'(0) = slope)."""
    g = torch.Generator().manual_seed(stable_seed(("dgrad-act", str(act), str(dtype))))
    xs, ws, conv = (2, 6, 5, 7), (5, 6, 3, 3), dict(padding=1, stride=(2, 1))
    scale = torch.tensor([1.0, 2.0, 0.5, 4.0, 1.0, 0.25], device=DEVICE)
    shift = torch.tensor([-1.0, 2.0, 0.0, -4.0, 0.5, 0.25], device=DEVICE)
    x = _randn(*xs, g=g).to(dtype)
    tie = (-shift / scale).to(dtype).view(1, 6, 1, 1).expand(2, 6, 5, 7)
    x = _channels_last(torch.where(torch.rand(xs, generator=g).to(DEVICE) < 0.3, tie, x))
    prologue = ChannelAffine(scale, shift)
    assert ((x.float() * scale.view(1, 6, 1, 1) + shift.view(1, 6, 1, 1)) == 0).sum() > 50
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g, dtype=dtype))
    w = _randn(*ws, g=g, dtype=dtype)
    _check_dgrad(f"act' {act}", gy, w, xs, x_prev=x, prologue=prologue, act_in=act, tile=SMALL_FLAT, **conv)


@pytest.mark.parametrize("kind,act", PROLOGUES[1:], ids=prologue_ids(PROLOGUES[1:]))
def test_dgrad_recomputes_group_and_gate_prologues(kind, act):
    g = torch.Generator().manual_seed(stable_seed(("dgrad-prologue", kind)))
    xs, ws, conv = (2, 6, 5, 6), (7, 6, 3, 3), dict(padding=1)
    x = _channels_last(_randn(*xs, g=g))
    prologue = conv_prologue(kind, 2, 6, g, DEVICE)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    _check_dgrad(kind, gy, _randn(*ws, g=g), xs, x_prev=x, prologue=prologue, act_in=act, **conv)


def _bn(x: torch.Tensor, g: torch.Generator):
    """Batch statistics of x (float64 from x's values) and a BatchNorm affine folded into a prologue."""
    c = x.shape[1]
    flat = x.double().transpose(0, 1).reshape(c, -1)
    mean, var = flat.mean(1), flat.var(1, unbiased=False)
    rstd = (var + 1e-5).rsqrt()
    gamma, beta = _randn(c, g=g) + 1.0, _randn(c, g=g)
    scale = gamma.double() * rstd
    folded = ChannelAffine(scale.float(), (beta.double() - mean * scale).float())
    return NormStats(mean.float(), rstd.float()), folded, gamma, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dgrad_batch_norm_sums_match_float64_and_repeat_bitwise(dtype):
    """Σ grad_z and Σ grad_z · x̂ over several M tiles (the last partial), two N tiles and two groups."""
    g = torch.Generator().manual_seed(stable_seed(("sums", str(dtype))))
    xs, ws, conv = (3, 36, 5, 4), (8, 18, 3, 3), dict(padding=1, groups=2)
    x = _channels_last(_randn(*xs, g=g, scale=2.0).to(dtype) + 1.0)
    stats, prologue, _, _ = _bn(x, g)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g, dtype=dtype))
    w = _randn(*ws, g=g, dtype=dtype)
    kw = dict(x_prev=x, prologue=prologue, act_in="relu", norm_stats=stats, tile=SMALL, **conv)
    grad, sums = _check_dgrad("bn sums", gy, w, xs, **kw)
    assert sums.count == 3 * 5 * 4 and sums.sum_dz.dtype == torch.float64
    again, sums2 = conv_dgrad(gy, w, xs, **kw)
    assert torch.equal(grad, again)
    assert torch.equal(sums.sum_dz, sums2.sum_dz) and torch.equal(sums.sum_dz_xhat, sums2.sum_dz_xhat)
    # the sums are those of the stored grad_z
    flat = grad.double().transpose(0, 1).reshape(36, -1)
    torch.testing.assert_close(sums.sum_dz, flat.sum(1), rtol=1e-5, atol=1e-5 * flat.abs().sum(1).max().item())


def test_dgrad_sums_without_activation_read_nchw_x_prev_and_sliced_grad_y():
    """Sums alone (no act: grad_z = grad_a), an NCHW x_prev and a sliced grad_y."""
    g = torch.Generator().manual_seed(67)
    xs, ws = (2, 5, 7, 6), (6, 5, 3, 3)
    x = _randn(*xs, g=g)  # NCHW: relaid once
    stats, _, _, _ = _bn(x, g)
    parent = _channels_last(_randn(3, 9, 6, 7, g=g))
    parent[0], parent[:, 0], parent[:, :, 0] = float("nan"), float("nan"), float("nan")
    gy = parent[1:, 2:8, 1:5, 3:6]  # (2, 6, 4, 3): stride 2, padding 1 over 7 x 6
    grad, sums = _check_dgrad("sums only", gy, _randn(*ws, g=g), xs, stride=2, padding=1, x_prev=x, norm_stats=stats)
    assert grad.isfinite().all()
    plan = dgrad._PLANS.values()[-1]
    assert plan.relayout_xp and not plan.relayout_dy


def test_dgrad_int64_offsets_give_the_same_result(monkeypatch):
    g = torch.Generator().manual_seed(73)
    xs, ws, conv = (2, 6, 7, 5), (5, 6, 3, 3), dict(padding=1, stride=2)
    x = _channels_last(_randn(*xs, g=g))
    stats, prologue, _, _ = _bn(x, g)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    w = _randn(*ws, g=g)
    kw = dict(x_prev=x, prologue=prologue, act_in="silu", norm_stats=stats, tile=SMALL_FLAT, **conv)
    small = conv_dgrad(gy, w, xs, **kw)
    monkeypatch.setattr(dgrad, "_BIG_INDEX_THRESHOLD", 0)
    dgrad._PLANS.clear()
    big = conv_dgrad(gy, w, xs, **kw)
    assert dgrad._PLANS.values()[-1].launch.constexprs["BIG"]
    assert torch.equal(small[0], big[0]) and torch.equal(small[1].sum_dz_xhat, big[1].sum_dz_xhat)


def test_forward_then_full_backward_chain_matches_autograd_of_float64():
    """The chain the fused op will run: ``y = conv(relu(bn(x_prev)))`` by ``conv_fprop`` with the BatchNorm
    folded into the prologue; then ``conv_dgrad`` (relu' and the sums), the BatchNorm backward from the
    sums, and ``conv_wgrad`` (the prologue recomputed) give every gradient of autograd in float64."""
    g = torch.Generator().manual_seed(71)
    xs, ws, conv = (2, 6, 7, 5), (8, 6, 3, 3), dict(padding=1, stride=2)
    x_prev = _channels_last(_randn(*xs, g=g, scale=1.5) + 0.5)
    w, b = _randn(*ws, g=g, scale=0.4), _randn(8, g=g)
    stats, prologue, gamma, beta = _bn(x_prev, g)
    y, _ = conv_fprop(x_prev, w, b, prologue=prologue, act_in="relu", **conv)
    gy = _channels_last(_randn(*y.shape, g=g))

    grad_z, sums = conv_dgrad(gy, w, xs, x_prev=x_prev, prologue=prologue, act_in="relu", norm_stats=stats, **conv)
    grad_w, grad_b = conv_wgrad(gy, x_prev, w, prologue=prologue, act_in="relu", bias_grad=True, **conv)
    view = (1, 6, 1, 1)
    xhat = (x_prev.double() - stats.mean.double().view(view)) * stats.rstd.double().view(view)
    grad_gamma, grad_beta = sums.sum_dz_xhat, sums.sum_dz
    grad_x = (gamma.double() * stats.rstd.double()).view(view) * (
        grad_z.double() - (sums.sum_dz / sums.count).view(view) - xhat * (sums.sum_dz_xhat / sums.count).view(view))

    def model(dtype: torch.dtype):  # noqa: ANN202
        leaves = [t.to(dtype).requires_grad_(True) for t in (x_prev, gamma, beta, w, b)]
        xp, ga, be, ww, bb = leaves
        a = torch.relu(F.batch_norm(xp, None, None, ga, be, training=True, eps=1e-5))
        out = F.conv2d(a, ww, bb, **conv)
        return torch.autograd.grad(out, leaves, gy.to(dtype))

    truth, eager = model(torch.float64), model(torch.float32)
    mine = (grad_x, grad_gamma, grad_beta, grad_w, grad_b)
    for what, got, e, t in zip(("x_prev", "gamma", "beta", "weight", "bias"), mine, eager, truth, strict=True):
        _compare(f"chain grad {what}", got.double(), e.double(), t, 4 * BIAS_FLOOR[torch.float32])


def test_empty_batch_returns_without_launch(monkeypatch):
    def no_launch(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("launched for an empty batch")

    monkeypatch.setattr(dgrad.FastLaunch, "__call__", no_launch)
    monkeypatch.setattr(wgrad.FastLaunch, "__call__", no_launch)
    x = _channels_last(torch.zeros(0, 5, 7, 6, device=DEVICE))
    w = torch.randn(4, 5, 3, 3, device=DEVICE)
    gy = _channels_last(torch.zeros(0, 4, 4, 3, device=DEVICE))
    stats = NormStats(torch.zeros(5, device=DEVICE), torch.ones(5, device=DEVICE))
    grad, sums = conv_dgrad(gy, w, x.shape, stride=2, padding=1, x_prev=x, act_in="relu", norm_stats=stats)
    assert grad.shape == x.shape and grad.stride(1) == 1 and sums.count == 0 and not sums.sum_dz.any()
    gw, gb = conv_wgrad(gy, x, w, stride=2, padding=1, bias_grad=True)
    assert gw.shape == w.shape and not gw.any() and gb.shape == (4,) and not gb.any()


# --------------------------------------------------------------------------------------------------
# Contract errors: one line, before any launch
# --------------------------------------------------------------------------------------------------


def _bad_calls():
    x = _channels_last(torch.randn(2, 4, 6, 6)).to(DEVICE)
    w = torch.randn(6, 4, 3, 3).to(DEVICE)
    gy = _channels_last(torch.randn(2, 6, 4, 4)).to(DEVICE)
    ones4 = torch.ones(4, device=DEVICE)
    return [
        ("grad_y must be (2, 6, 6, 6)", lambda: conv_wgrad(gy, x, w, padding=1)),
        ("grad_y must be (2, 6, 4, 4) torch.float32", lambda: conv_wgrad(gy.half(), x, w)),
        ("weight dtype", lambda: conv_wgrad(gy, x, w.half())),
        ("split must be a positive int", lambda: conv_wgrad(gy, x, w, split=0)),
        ("prologue scale must be contiguous fp32 (4,)", lambda: conv_wgrad(gy, x, w, prologue=ChannelAffine(ones4[:3], ones4))),
        ("act_in='tanh' is not one of", lambda: conv_wgrad(gy, x, w, act_in="tanh")),
        ("grad_y and weight must be tensors", lambda: conv_dgrad(gy, None, x.shape)),
        ("input_size must be a sequence", lambda: conv_dgrad(gy, w, 5)),
        ("input_size must have grad_y's rank", lambda: conv_dgrad(gy, w, (2, 4, 6))),
        ("grad_y must be (2, 6, 3, 3)", lambda: conv_dgrad(gy, w, (2, 4, 5, 5))),
        ("need x_prev", lambda: conv_dgrad(gy, w, x.shape, act_in="relu")),
        ("x_prev must be (2, 4, 6, 6) torch.float32", lambda: conv_dgrad(gy, w, x.shape, x_prev=x[:1], act_in="relu")),
        ("norm_stats rstd must be contiguous fp32 (4,)",
         lambda: conv_dgrad(gy, w, x.shape, x_prev=x, norm_stats=NormStats(ones4, ones4.half()))),
        ("norm_stats must be None or NormStats", lambda: conv_dgrad(gy, w, x.shape, x_prev=x, norm_stats=(ones4, ones4))),
        ("tile must be a TileConfig", lambda: conv_dgrad(gy, w, x.shape, tile={"block_m": 64})),
    ]  # fmt: skip


@pytest.mark.parametrize("match,call", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_inputs_raise_one_line_contract_errors_before_launch(match, call, monkeypatch):
    def no_launch(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("launched despite a broken contract")

    monkeypatch.setattr(dgrad.FastLaunch, "__call__", no_launch)
    with pytest.raises(ContractError, match=match.replace("(", r"\(").replace(")", r"\)")) as info:
        call()
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------------
# wgrad with box loads
# --------------------------------------------------------------------------------------------------

#: Boxes of 4 x 4 output positions: several per plane, and planes that no box divides.
SMALL_BOX = TileConfig(16, 16, 16, num_warps=1, num_stages=1, box_w=4)

BOX_GEOMETRY = [
    ("conv2d-3x3-pad1-channel-tail", (2, 20, 7, 9), (12, 20, 3, 3), dict(padding=1)),
    ("conv2d-1x1-whole-boxes", (2, 16, 8, 8), (24, 16, 1, 1), {}),
    ("conv2d-3x2-unpadded", (1, 16, 7, 6), (8, 16, 3, 2), {}),
    ("conv1d-pad2", (2, 16, 13), (8, 16, 5), dict(padding=2)),
    ("conv3d-pad1", (1, 16, 4, 5, 6), (8, 16, 3, 3, 3), dict(padding=1)),
    ("groups2-channel-tail-per-group", (2, 8, 5, 6), (8, 4, 3, 3), dict(padding=1, groups=2)),
]


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("case", BOX_GEOMETRY, ids=[c[0] for c in BOX_GEOMETRY])
def test_wgrad_with_box_loads_matches_float64(case, split):
    name, xs, ws, conv = case
    g = torch.Generator().manual_seed(stable_seed(("wgrad-box", name)))
    x = _channels_last(_randn(*xs, g=g))
    w = _randn(*ws, g=g, scale=0.3)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    _check_wgrad(f"box {name}", gy, x, w, tile=SMALL_BOX, split=split, bias_grad=True, **conv)


@pytest.mark.parametrize("kind,act", PROLOGUES, ids=prologue_ids(PROLOGUES))
def test_wgrad_with_box_loads_recomputes_each_prologue(kind, act):
    _check_wgrad_prologue("wgrad-box", kind, act, (2, 16, 5, 6), (8, 16, 3, 3), dict(padding=(1, 2)), SMALL_BOX, 2)


def test_wgrad_boxes_past_the_planes_edge_add_nothing_even_beside_an_infinite_input():
    """A 3x3 unpadded conv's 5 x 4 output in 4 x 4 boxes: the positions past its edge read the
    input's last rows (here an infinite element) with a zero grad_y: the taps only they reach with it
    must stay finite, as eager's are, not NaN."""
    g = torch.Generator().manual_seed(stable_seed("wgrad-box-inf"))
    x = _channels_last(_randn(1, 16, 7, 6, g=g))
    x[0, :4, -1, -1] = float("inf")
    w = _randn(8, 16, 3, 3, g=g, scale=0.3)
    gy = _channels_last(_randn(1, 8, 5, 4, g=g))
    gw, _ = _check_wgrad("box inf beside the edge", gy, x, w, tile=SMALL_BOX, split=1)
    assert gw[:, :4, 2, 2].isinf().all() and gw[:, :4, :2].isfinite().all()  # only the last tap reads it


def test_wgrad_box_loads_read_a_sliced_or_unaligned_input_and_an_nchw_one():
    """A tensor copy needs a 16-byte aligned base: a slice that starts off it is copied first
    (``boxes.box_descriptor``); an NCHW input is relaid out channels-last first."""
    g = torch.Generator().manual_seed(stable_seed("wgrad-box-layouts"))
    w = _randn(8, 20, 3, 3, g=g, dtype=torch.float16, scale=0.3)
    wide = _channels_last(_randn(2, 24, 7, 9, g=g, dtype=torch.float16))
    gy = _channels_last(_randn(2, 8, 7, 9, g=g, dtype=torch.float16))
    _check_wgrad("box sliced channels, unaligned", gy, wide[:, 4:], w, tile=SMALL_BOX, split=1, padding=1)
    gy8 = _channels_last(_randn(2, 8, 7, 8, g=g, dtype=torch.float16))
    _check_wgrad("box sliced columns", gy8, wide[:, 4:, :, 1:9], w, tile=SMALL_BOX, split=1, padding=1)
    w24 = _randn(8, 24, 3, 3, g=g, dtype=torch.float16, scale=0.3)
    _check_wgrad("box nchw", gy, _randn(2, 24, 7, 9, g=g, dtype=torch.float16), w24, tile=SMALL_BOX, split=1,
                 padding=1)


def test_a_wgrad_box_tile_where_a_box_cannot_load_is_refused_in_one_line():
    g = torch.Generator().manual_seed(0)
    x = _channels_last(_randn(1, 16, 7, 7, g=g))
    gy = _channels_last(_randn(1, 4, 3, 3, g=g))
    with pytest.raises(ContractError, match="stride and dilation 1"):
        conv_wgrad(gy, x, _randn(4, 16, 3, 3, g=g), tile=SMALL_BOX, stride=2)
    gy5 = _channels_last(_randn(1, 5, 5, 5, g=g))  # 5 fp32 output channels: a 20-byte grad_y pixel
    with pytest.raises(ContractError, match="16-byte strides, grad_y has"):
        conv_wgrad(gy5, x, _randn(5, 16, 3, 3, g=g), tile=SMALL_BOX)


# --------------------------------------------------------------------------------------------------
# dgrad with box loads
# --------------------------------------------------------------------------------------------------

DGRAD_BOX_GEOMETRY = [
    ("conv2d-3x3-pad1-channel-tail", (2, 12, 7, 9), (20, 12, 3, 3), dict(padding=1)),
    ("conv2d-3x5-pad1x2", (1, 16, 6, 5), (8, 16, 3, 5), dict(padding=(1, 2))),
    ("conv2d-1x1", (2, 24, 5, 7), (16, 24, 1, 1), {}),
    ("conv2d-3x3-unpadded", (1, 8, 7, 6), (16, 8, 3, 3), {}),
    ("conv1d-pad2", (2, 8, 13), (16, 8, 5), dict(padding=2)),
    ("conv3d-pad1", (1, 8, 4, 5, 6), (16, 8, 3, 3, 3), dict(padding=1)),
    ("groups2-16-outputs-per-group", (1, 8, 5, 6), (32, 4, 3, 3), dict(padding=1, groups=2)),
]


@pytest.mark.parametrize("case", DGRAD_BOX_GEOMETRY, ids=[c[0] for c in DGRAD_BOX_GEOMETRY])
def test_dgrad_with_box_loads_matches_float64(case):
    name, xs, ws, conv = case
    g = torch.Generator().manual_seed(stable_seed(("dgrad-box", name)))
    w = _randn(*ws, g=g, scale=0.3)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    _check_dgrad(f"box {name}", gy, w, xs, tile=SMALL_BOX, **conv)


def test_dgrad_with_box_loads_applies_the_backward_hooks():
    """relu' of the recomputed prologue and the BatchNorm-backward sums over boxes that hang over the
    plane's edge (7 x 9 in 4 x 4 boxes): their rows past it neither stored nor summed."""
    g = torch.Generator().manual_seed(stable_seed("dgrad-box-hooks"))
    xs, ws, conv = (2, 12, 7, 9), (16, 12, 3, 3), dict(padding=1)
    x = _channels_last(_randn(*xs, g=g, scale=2.0) + 1.0)
    stats, prologue, _, _ = _bn(x, g)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g))
    w = _randn(*ws, g=g, scale=0.3)
    kw = dict(x_prev=x, prologue=prologue, act_in="relu", norm_stats=stats, **conv)
    boxed, sums = _check_dgrad("box hooked", gy, w, xs, tile=SMALL_BOX, **kw)
    gathered, sums_gathered = conv_dgrad(gy, w, xs, tile=SMALL, **kw)
    torch.testing.assert_close(boxed, gathered)
    assert sums.count == sums_gathered.count == 2 * 7 * 9


def test_a_dgrad_box_tile_where_a_box_cannot_load_is_refused_in_one_line():
    g = torch.Generator().manual_seed(0)
    gy = _channels_last(_randn(1, 16, 3, 3, g=g))
    with pytest.raises(ContractError, match="stride and dilation 1"):
        conv_dgrad(gy, _randn(16, 8, 3, 3, g=g), (1, 8, 7, 7), tile=SMALL_BOX, stride=2)
    gy2 = _channels_last(_randn(1, 24, 5, 5, g=g))  # 12 output channels per group: no whole K block of 16
    with pytest.raises(ContractError, match="output channels per group must fill"):
        conv_dgrad(gy2, _randn(24, 4, 3, 3, g=g), (1, 8, 5, 5), tile=SMALL_BOX, padding=1, groups=2)


def test_a_box_tile_whose_groups_do_not_start_on_16_bytes_is_refused_in_one_line():
    g = torch.Generator().manual_seed(0)
    x = _channels_last(_randn(2, 8, 9, 1, g=g, dtype=torch.float16))  # groups of 4 fp16 channels: 8 bytes
    gy = _channels_last(_randn(2, 16, 9, 1, g=g, dtype=torch.float16))
    with pytest.raises(ContractError, match="x's groups of 4 2-byte channels"):
        conv_wgrad(gy, x, _randn(16, 4, 1, 1, g=g, dtype=torch.float16), tile=SMALL_BOX, groups=2)


# --------------------------------------------------------------------------------------------------
# The TMA input gradient (``tma_fprop``'s kernel with ``GRAD``: a 1x1 conv's GEMM with the channels
# exchanged; Gluon, sm_90 only)
# --------------------------------------------------------------------------------------------------


def _tma_grad_case(shape, c_out, dtype, g):  # noqa: ANN001, ANN202
    """x_prev (channels-last, BatchNorm-like spread), its batch statistics and folded affine, grad_y and a
    1x1 weight of ``c_out`` output channels."""
    x = _channels_last(_randn(*shape, g=g, scale=1.5).to(dtype) + 0.5)
    stats, folded, _, _ = _bn(x, g)
    ws = (c_out, shape[1], *([1] * (len(shape) - 2)))
    gy = _channels_last(_randn(shape[0], c_out, *shape[2:], g=g, dtype=dtype))
    return x, stats, folded, gy, _randn(*ws, g=g, scale=c_out ** -0.5, dtype=dtype)


def _check_tma_dgrad(name, gy, w, x, stats, folded, kind, act, g, tile, **conv):  # noqa: ANN001, ANN003, ANN202
    """``conv_dgrad`` on the TMA kernel with ``tile`` against float64 (``_check_dgrad``): plain where
    ``kind`` is None, else act' of the recomputed prologue (``kind``: the folded BatchNorm or one of
    ``conv_prologue``'s) and the BatchNorm-backward sums; the same bits on a second call.  Returns
    ``(grad, sums)``."""
    kw = dict(tile=tile, **conv)
    if kind is not None:
        prologue = folded if kind == "batch_norm" else conv_prologue(kind, x.shape[0], x.shape[1], g, DEVICE)
        kw.update(x_prev=x, prologue=prologue, act_in=act, norm_stats=stats)
    grad, sums = _check_dgrad(name, gy, w, x.shape, **kw)
    assert dgrad._PLANS.values()[-1].tma is not None
    again, sums2 = conv_dgrad(gy, w, x.shape, **kw)
    assert torch.equal(grad, again)
    if sums is not None:
        assert torch.equal(sums.sum_dz, sums2.sum_dz) and torch.equal(sums.sum_dz_xhat, sums2.sum_dz_xhat)
    return grad, sums


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind,act", [("batch_norm", "relu"), *PROLOGUES[1:], (None, None)],
                         ids=prologue_ids([("batch_norm", "relu"), *PROLOGUES[1:], (None, None)]))
@pytest.mark.parametrize("name,shape,c_out", TMA_1X1_SHAPES, ids=[c[0] for c in TMA_1X1_SHAPES])
def test_tma_dgrad_1x1_matches_float64_with_its_sums(name, shape, c_out, kind, act, dtype):
    """Every tile of :data:`TMA_ROW_TILES` (the failure names it) against float64: act' of each
    recomputed prologue, the BatchNorm-backward sums (per program lane), the same bits on a second
    call; without hooks the plain input gradient."""
    for tile in TMA_ROW_TILES:
        g = torch.Generator().manual_seed(stable_seed(("tma-dgrad", name, str(kind), str(act), tile.label())))
        x, stats, folded, gy, w = _tma_grad_case(shape, c_out, dtype, g)
        grad, sums = _check_tma_dgrad(f"tma dgrad {name} {kind} {act} {tile.label()}", gy, w, x, stats, folded,
                                      kind, act, g, tile)  # fmt: skip
        if sums is not None:
            flat = grad.double().transpose(0, 1).reshape(shape[1], -1)
            torch.testing.assert_close(sums.sum_dz, flat.sum(1), rtol=1e-5,
                                       atol=1e-5 * flat.abs().sum(1).max().item())  # fmt: skip


@requires_sm90
@pytest.mark.parametrize("kind,act", [("batch_norm", "relu"), PROLOGUES[1], (None, None)],
                         ids=prologue_ids([("batch_norm", "relu"), PROLOGUES[1], (None, None)]))
@pytest.mark.parametrize("name,shape,c_out,stride", TMA_STRIDED_1X1_SHAPES, ids=[c[0] for c in TMA_STRIDED_1X1_SHAPES])
def test_tma_dgrad_strided_1x1_matches_float64_with_its_sums(name, shape, c_out, stride, kind, act):
    """A strided 1x1's input gradient on the TMA kernel (results at the stride, zeros between through the
    same store: act' of the recomputed prologue and the BatchNorm-backward sums over every input position)
    on every tile of :data:`TMA_ROW_TILES` in bf16 and the first in fp16, against float64; the same bits on
    a second call."""
    for dtype, tiles in ((torch.bfloat16, TMA_ROW_TILES), (torch.float16, TMA_ROW_TILES[:1])):
        for tile in tiles:
            g = torch.Generator().manual_seed(stable_seed(("tma-dgrad-strided", name, str(kind), str(dtype),
                                                           tile.label())))  # fmt: skip
            x, stats, folded, _, w = _tma_grad_case(shape, c_out, dtype, g)
            gy = _channels_last(_randn(*_out_shape(shape, w.shape, dict(stride=stride)), g=g, dtype=dtype))
            _check_tma_dgrad(f"tma dgrad strided {name} {kind} {dtype} {tile.label()}", gy, w, x, stats, folded, kind,
                             act, g, tile, stride=stride)  # fmt: skip


@requires_sm90
def test_tma_dgrad_strided_zeros_take_act_prime_of_their_input():
    """Where no output reads an input position its gradient is 0 * act'(z), as eager's: NaN where SiLU's
    derivative of an infinite z is NaN, 0 where ReLU's and leaky ReLU's are (``tma_fprop.zeros_read_x``:
    those zeros do not read x_prev); with the statistics of that x_prev, the sums are NaN as eager's."""
    g = torch.Generator().manual_seed(97)
    x, _, _, _, w = _tma_grad_case((2, 32, 6, 6), 24, torch.bfloat16, g)
    x[0, :, 1, 3] = float("inf")  # an odd row: no output of the stride-2 conv reads it
    stats = _bn(x, g)[0]  # x's own statistics: non-finite
    gy = _channels_last(_randn(2, 24, 3, 3, g=g, dtype=torch.bfloat16))
    for act in ("silu", "relu", Activation("leaky_relu", 0.1)):
        kw = dict(stride=2, x_prev=x, prologue=None, act_in=act)
        grad, _ = conv_dgrad(gy, w, x.shape, tile=TMA_ROW_TILES[0], **kw)
        eager, _ = conv_dgrad_reference(gy, w, x.shape, **kw)
        assert torch.equal(grad.isnan(), eager.isnan()), act
        assert grad.isnan().any() == (act == "silu"), act
        _, sums = conv_dgrad(gy, w, x.shape, tile=TMA_ROW_TILES[0], norm_stats=stats, **kw)
        _, eager_sums = conv_dgrad_reference(gy, w, x.shape, norm_stats=stats, **kw)
        for what in ("sum_dz", "sum_dz_xhat"):
            got, want = getattr(sums, what), getattr(eager_sums, what)
            assert torch.equal(got.isfinite(), want.isfinite()), (act, what)


def test_strided_input_gradients_zeros_read_x_prev_only_where_act_prime_can_be_nan():
    """``tma_fprop.zeros_read_x``: the zeros of a strided input gradient go through act' (reading x_prev)
    for GELU and SiLU alone; without an activation, with ReLU and leaky ReLU, 0 times the derivative is 0
    at every input (torch's backward formulas select, ``chain_math.step_backward``)."""
    from fusion_backend.kernels.chain_math import OP_CODES
    from fusion_backend.kernels.conv.tma_fprop import zeros_read_x

    assert [zeros_read_x(a) for a in (0, OP_CODES["relu"], OP_CODES["leaky_relu"])] == [False] * 3
    assert zeros_read_x(OP_CODES["silu"]) and zeros_read_x(OP_CODES["gelu"])


@requires_sm90
def test_tma_dgrad_sums_alone_and_any_layout():
    """The sums without an activation (grad_z = grad_a), a sliced grad_y, an NCHW x_prev and weight:
    each copied to the dense rows the kernel reads."""
    g = torch.Generator().manual_seed(83)
    dtype = torch.bfloat16
    x, stats, _, _, w = _tma_grad_case((2, 48, 7, 6), 40, dtype, g)
    parent = _channels_last(_randn(3, 56, 8, 7, g=g, dtype=dtype))
    parent[:, :8] = float("nan")  # outside the window
    gy = parent[1:, 8:48, 1:8, :6]
    tile = TMA_ROW_TILES[1]
    for name, xp, wi in (("sliced", x, w), ("nchw", x.contiguous(), _channels_last(w))):
        grad, _ = _check_dgrad(f"tma dgrad {name}", gy, wi, x.shape, x_prev=xp, norm_stats=stats, tile=tile)
        assert grad.isfinite().all(), name


@requires_sm90
def test_tma_dgrad_nan_and_inf_reach_only_their_rows():
    g = torch.Generator().manual_seed(89)
    x, stats, folded, gy, w = _tma_grad_case((2, 64, 5, 9), 24, torch.bfloat16, g)
    gy[0, 3, 2, 4] = float("nan")
    gy[1, 20, 0, 0] = float("inf")
    grad, _ = _check_dgrad("tma dgrad nan inf", gy, w, x.shape, tile=TMA_ROW_TILES[0])
    bad = ~grad.isfinite().all(1)
    assert bad.sum() == 2 and bad[0, 2, 4] and bad[1, 0, 0]


def test_tma_tiles_join_the_input_gradients_candidates():
    """A 1x1 input gradient the TMA kernel takes times the gather heuristic's tile and the TMA tiles, its
    channels exchanged (K the output's): a plain one 256 channels wide the 128 x 256 tile on 8 warps first,
    then 128 x 128 on 4 (two programs per SM); a hooked one 128 rows on 8 warps (the hooked store spilled
    on 4 at 128 x 64), then 64 rows on 4 (``tiles.tma_tiles``' NOTE)."""
    from fusion_backend.kernels.conv.tiles import candidates

    plain = candidates("dgrad", 64, 256, 1, 200704, torch.bfloat16, tma=True, plain=True)
    hooked = candidates("dgrad", 64, 256, 1, 200704, torch.bfloat16, epilogue_hooks=True, tma=True)
    assert not plain[0].tma and all(t.tma for t in plain[1:]) and len(plain) == 3
    wide = [(t.block_m, t.block_n, t.num_warps, t.num_stages) for t in plain[1:]]
    assert wide == [(128, 256, 8, 3), (128, 128, 4, 2)]
    assert [(t.block_m, t.block_n, t.num_warps) for t in hooked[1:]] == [(128, 128, 8), (64, 128, 4)]
    assert all(t.block_k == 64 for t in plain[1:] + hooked[1:])
    for t in plain[1:] + hooked[1:]:
        t.check_for("dgrad")


@pytest.mark.parametrize("why,conv,ws", [
    ("a 3x3 conv", dict(padding=1), (8, 16, 3, 3)),
    ("a padded 1x1", dict(padding=1), (8, 16, 1, 1)),
    ("grouped", dict(groups=2), (8, 8, 1, 1)),
    ("12 output channels", {}, (12, 16, 1, 1)),
], ids=lambda c: c if isinstance(c, str) else None)  # fmt: skip
def test_a_tma_tile_the_input_gradient_cannot_take_is_refused_in_one_line(why, conv, ws):
    """On CPU (no Gluon run) and for any conv the kernel does not take, a TMA tile asked for by name is
    a one-line contract error, not a silent gather."""
    g = torch.Generator().manual_seed(0)
    xs = (2, 16, 6, 6)
    gy = _channels_last(_randn(*_out_shape(xs, ws, conv), g=g, dtype=torch.float16))
    with pytest.raises(ContractError, match="TMA") as info:
        conv_dgrad(gy, _randn(*ws, g=g, dtype=torch.float16), xs, tile=TileConfig(64, 64, 64, 4, 2, tma=True),
                   **conv)  # fmt: skip
    assert "\n" not in str(info.value)
