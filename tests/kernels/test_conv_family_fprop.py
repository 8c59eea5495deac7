"""The conv family's forward (``kernels/conv``) against float64, with eager's own error as the yardstick.

Without CUDA the kernel runs on CPU under Triton's interpreter (``conftest``), so every shape is
small, and odd on purpose: channel counts that fill no block (3, 5, 7), spatial sizes that fill no
tile, tiles forced small so that a call spans several M and N tiles.  Each result is checked by
``testing.compare`` against ``reference.conv_fprop_reference`` run in float64 (the truth), allowed
``max(floor, 2 x eager's error)``, eager being the same reference run in the input dtype (a rounding
after every op); NaN/inf positions must equal eager's exactly.  On CUDA the same tests run on the GPU,
fp32 with TF32 off; ``test_fp32_on_cuda_follows_cudnns_own_precision`` checks the TF32 path.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from conv_prologues import PROLOGUES, conv_prologue, prologue_ids
from conv_tma_cases import TMA_1X1_SHAPES, TMA_ROW_TILES, TMA_STRIDED_1X1_SHAPES, requires_sm90

from fusion_backend.kernels.chain_math import OP_CODES as OP
from fusion_backend.kernels.conv import (
    Activation,
    BatchNormForm,
    ChannelAffine,
    GroupAffine,
    SampleChannelScale,
    TileConfig,
    conv_fprop,
    fprop,
    halo,
    pick_tile,
)
from fusion_backend.kernels.conv.boxes import box_positions
from fusion_backend.kernels.conv.reference import conv_fprop_reference
from fusion_backend.kernels.conv.tiles import candidates, halo_box_width
from fusion_backend.kernels.plan_cache import ContractError
from fusion_backend.testing import compare, stable_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
              pytest.mark.usefixtures("exact_fp32_heuristic_tiles")]

#: The least error bound, relative to the output's norm, whatever eager's own error: about 4 and 1
#: roundings of the dtype (on these shapes eager's own error is 4e-8 to 2e-7 in fp32, 2e-4 to 3e-4 in
#: fp16 on CPU; the kernel's is at most about the same).
FLOOR = {torch.float32: 5e-7, torch.float16: 5e-4, torch.bfloat16: 4e-3}
#: A tile of 16 x 16 x 16: a call spans several M and N tiles and K steps even on tiny shapes.
SMALL = TileConfig(16, 16, 16, num_warps=1, num_stages=1)
SMALL_FLAT = TileConfig(16, 16, 16, num_warps=1, num_stages=1, flat_k=True)


def _randn(*shape, g, dtype=torch.float32, scale=1.0):  # noqa: ANN001, ANN002
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, bias=None, **kw):  # noqa: ANN001, ANN003
    """Run ``conv_fprop`` and compare it (and its statistics) with the float64 reference, eager's
    error as the yardstick; returns ``(out, stats)``."""
    out, stats = conv_fprop(x, weight, bias, **kw)
    kw.pop("tile", None)
    eager, eager_stats = conv_fprop_reference(x, weight, bias, **kw)
    truth, truth_stats = conv_fprop_reference(x, weight, bias, dtype=torch.float64, **kw)
    assert out.shape == truth.shape, f"{name}: shape {tuple(out.shape)} != {tuple(truth.shape)}"
    assert out.dtype == x.dtype and out.stride(1) == 1 and out.movedim(1, -1).is_contiguous(), f"{name}: layout"
    why = compare(name, out, eager, FLOOR[x.dtype], reference=truth)
    assert why is None, why
    if kw.get("stats"):
        assert stats.count == truth_stats.count
        # The reduction itself: the float64 sums of the stored output and of its squared deviations
        # from the channel's mean, up to the fp32 rounding of the tiles' partials (a tile's fp32 sum
        # of up to 128 terms: a relative 128 * 2**-24 of their magnitudes).
        mine = out.double().transpose(0, 1).reshape(out.shape[1], -1)
        deviations = mine - mine.mean(1, keepdim=True)
        for what, got, terms in (("sum", stats.sum, mine), ("m2", stats.m2, deviations * deviations)):
            slack = 128 * 2**-24 * terms.abs().sum(1)
            assert ((got - terms.sum(1)).abs() <= slack).all(), f"{name}: {what} is not the sum of the output"
        # And against the truth, eager's statistics as the yardstick.
        for what in ("sum", "m2"):
            why = compare(f"{name} stats {what}", getattr(stats, what), getattr(eager_stats, what), FLOOR[x.dtype],
                          reference=getattr(truth_stats, what))  # fmt: skip
            assert why is None, why
    return out, stats


# --------------------------------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------------------------------

# name, x shape, weight shape, conv kwargs, tile
GEOMETRY = [
    ("conv1d-pad1", (2, 5, 11), (7, 5, 3), dict(padding=1), None),
    ("conv1d-stride2-dil2-pad2", (2, 3, 13), (4, 3, 3), dict(stride=2, padding=2, dilation=2), SMALL_FLAT),
    ("conv2d-cin3-odd", (2, 3, 7, 9), (5, 3, 3, 3), dict(padding=1), SMALL_FLAT),
    ("conv2d-stride2-odd-size-uses-right-pad", (1, 4, 7, 7), (6, 4, 3, 3), dict(stride=2, padding=1), None),
    ("conv2d-stride2-even-size-no-right-pad", (1, 4, 8, 6), (6, 4, 3, 3), dict(stride=2, padding=1), SMALL_FLAT),
    ("conv2d-dil2", (1, 3, 9, 8), (4, 3, 3, 3), dict(padding=2, dilation=2), None),
    ("conv2d-kernel3x5-pad1x2-stride2x1", (2, 5, 6, 9), (3, 5, 3, 5), dict(padding=(1, 2), stride=(2, 1)), None),
    ("conv2d-tap-major-cin20-partial-block", (2, 20, 5, 4), (24, 20, 3, 3), dict(padding=1), SMALL),
    ("conv2d-1x1-tap-major", (2, 16, 5, 5), (9, 16, 1, 1), {}, SMALL),
    ("groups2", (2, 6, 5, 6), (4, 3, 3, 3), dict(padding=1, groups=2), None),
    ("groups2-tap-major-cout5-per-group", (1, 32, 4, 5), (10, 16, 3, 3), dict(padding=1, groups=2), SMALL),
    ("depthwise", (2, 7, 6, 5), (7, 1, 3, 3), dict(padding=1, groups=7), None),
    ("depthwise-multiplier2-stride2", (1, 5, 7, 6), (10, 1, 3, 3), dict(padding=1, stride=2, groups=5), SMALL_FLAT),
    ("conv3d-pad1-stride121", (1, 3, 5, 6, 4), (5, 3, 3, 3, 3), dict(padding=1, stride=(1, 2, 1)), SMALL_FLAT),
    ("conv3d-tap-major-stride2-dil112", (1, 16, 5, 4, 7), (6, 16, 3, 2, 3), dict(padding=(1, 0, 2), stride=2,
                                                                                 dilation=(1, 1, 2)), SMALL),
]  # fmt: skip


@pytest.mark.parametrize("case", GEOMETRY, ids=[c[0] for c in GEOMETRY])
def test_geometry_matches_float64_fp32(case):
    name, xs, ws, conv, tile = case
    g = torch.Generator().manual_seed(stable_seed(name))
    x = _channels_last(_randn(*xs, g=g))
    w, b = _randn(*ws, g=g, scale=0.3), _randn(ws[0], g=g)
    _check(name, x, w, b, tile=tile, **conv)


@pytest.mark.parametrize("name", ["conv2d-cin3-odd", "conv2d-tap-major-cin20-partial-block", "depthwise",
                                  "conv3d-pad1-stride121"])  # fmt: skip
def test_half_inputs_accumulate_in_fp32_and_store_half(name):
    _, xs, ws, conv, tile = next(c for c in GEOMETRY if c[0] == name)
    g = torch.Generator().manual_seed(stable_seed(name) + 1)
    x = _channels_last(_randn(*xs, g=g, dtype=torch.float16))
    w, b = _randn(*ws, g=g, scale=0.3, dtype=torch.float16), _randn(ws[0], g=g)  # an fp32 bias is allowed
    out, _ = _check(name, x, w, b, tile=tile, **conv)
    assert out.dtype == torch.float16


@requires_cuda
def test_bf16_on_cuda():
    g = torch.Generator().manual_seed(3)
    x = _channels_last(_randn(2, 16, 9, 9, g=g, dtype=torch.bfloat16))
    w = _randn(24, 16, 3, 3, g=g, scale=0.3, dtype=torch.bfloat16)
    _check("bf16", x, w, None, padding=1, act_out="relu", stats=True)


@requires_cuda
@pytest.mark.parametrize("cin", [3, 64], ids=["cin3", "cin64"])
def test_fp32_on_cuda_follows_cudnns_own_precision(cin, monkeypatch):
    """With TF32 allowed, the kernel told what cuDNN itself does for the conv
    (``ops.conv_precision.forward_tf32``: full fp32 for some narrow convs) is within the floor or 2x
    eager's error against float64, eager being cuDNN's conv under the same flags."""
    from fusion_backend.ir.specs import ConvSpec
    from fusion_backend.ops.conv_precision import forward_tf32

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    g = torch.Generator().manual_seed(11 + cin)
    x = _channels_last(_randn(4, cin, 20, 20, g=g))
    w = _randn(32, cin, 3, 3, g=g, scale=(9 * cin) ** -0.5)
    spec = ConvSpec(False, (1, 1), (1, 1), (1, 1), (0, 0), 1)
    out, _ = conv_fprop(x, w, padding=1, allow_tf32=forward_tf32(x, w, spec).tf32)
    eager = F.conv2d(x, w, padding=1)
    truth = F.conv2d(x.double(), w.double(), padding=1)
    why = compare(f"fp32 cin{cin}", out, eager, FLOOR[torch.float32], reference=truth)
    assert why is None, why


def test_tiles_change_nothing_but_the_sum_order():
    """The heuristic's tile and forced small tiles (both K walks) give the same result within fp32
    rounding: the mapping does not depend on the tile."""
    g = torch.Generator().manual_seed(5)
    x = _channels_last(_randn(2, 16, 6, 7, g=g))
    w = _randn(20, 16, 3, 3, g=g, scale=0.3)
    outs = [conv_fprop(x, w, padding=1, stride=(1, 2), tile=t)[0] for t in (None, SMALL, SMALL_FLAT)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------------


#: Every prologue kind, and a channel affine without an activation.
FPROP_PROLOGUES = [PROLOGUES[0], ("channel_affine", None), *PROLOGUES[1:]]


@pytest.mark.parametrize("tile", [None, "small"])
@pytest.mark.parametrize("kind,act", FPROP_PROLOGUES, ids=prologue_ids(FPROP_PROLOGUES))
def test_prologue_pads_the_activated_tensor(kind, act, tile):
    """``conv(act(norm(x)))`` with zero padding of ``act(norm(x))``: padded taps contribute exactly 0
    after the hook, which the shifts (and the GroupNorm bias) would break if the mask came first."""
    g = torch.Generator().manual_seed(stable_seed((kind, str(act), tile)))
    cin = 20 if tile == "small" else 6
    x = _channels_last(_randn(2, cin, 5, 6, g=g))
    w, b = _randn(7, cin, 3, 3, g=g, scale=0.3), _randn(7, g=g)
    prologue = conv_prologue(kind, 2, cin, g, DEVICE)
    conv = dict(padding=(1, 2), stride=(2, 1), prologue=prologue, act_in=act)
    out, _ = _check(f"{kind} {act}", x, w, b, tile=SMALL if tile == "small" else None, **conv)
    if kind != "gate":  # the mask before the hook would differ by far more than the tolerance
        masked_first = F.conv2d(F.pad(x.double(), (2, 2, 1, 1)), w.double(), b.double(), stride=(2, 1))
        hooked = conv_fprop_reference(x, w, b, dtype=torch.float64, **conv)[0]
        assert (hooked - masked_first).abs().max() > 0.1  # (the reference itself is the pad-after rule)
        assert (out.double() - masked_first).abs().max() > 0.1


#: Unpadded convs (every window inside the input: the loads and the prologue take no pad mask) whose
#: rows fill no M tile: tap-major with a channel tail (20 channels, K blocks of 16), tap-major with
#: none (16: the unmasked load), the flat K walk; stride 1 and 2 (ResNet's 1x1 downsample).
UNPADDED = [
    ("1x1-tap-major-channel-tail", 20, (1, 1), 1, SMALL),
    ("1x1-tap-major-whole-blocks", 16, (1, 1), 1, SMALL),
    ("1x1-stride2-whole-blocks", 16, (1, 1), 2, SMALL),
    ("3x2-flat", 6, (3, 2), 1, SMALL_FLAT),
    ("3x3-stride2-heuristic-tile", 6, (3, 3), 2, None),
]


@pytest.mark.parametrize("kind,act", FPROP_PROLOGUES, ids=prologue_ids(FPROP_PROLOGUES))
@pytest.mark.parametrize("name,cin,kernel,stride,tile", UNPADDED, ids=[c[0] for c in UNPADDED])
def test_an_unpadded_conv_hooks_every_lane_and_its_statistics_leave_out_the_rows_past_the_output(
        name, cin, kernel, stride, tile, kind, act):  # fmt: skip
    """Without padding the A tile is loaded without the pad mask and the rows past the output read the
    last row's window: the result, its statistics and the output's last rows must not show either."""
    g = torch.Generator().manual_seed(stable_seed(("unpadded", name, kind, str(act))))
    x = _channels_last(_randn(3, cin, 7, 5, g=g))  # M = 3 x 7 x 5 (or 3 x 4 x 3): no multiple of 16
    w, b = _randn(9, cin, *kernel, g=g, scale=0.3), _randn(9, g=g)
    prologue = conv_prologue(kind, 3, cin, g, DEVICE)
    _check(f"unpadded {name} {kind} {act}", x, w, b, stride=stride, prologue=prologue, act_in=act, act_out="relu",
           stats=True, tile=tile)


#: Convs whose M tiles (16 rows) each lie in one sample: one sample with a padded 3x3 and a stride 2;
#: whole tiles per sample (a 4 x 8 plane); per-sample tiles (GroupNorm's statistics) over a 5 x 7 plane,
#: the last tile of each sample partial; and, for contrast, tiles that cross samples (5 x 7, no statistics).
ONE_SAMPLE = [
    ("one-sample-padded", (1, 20, 9, 7), dict(padding=1), 0, True),
    ("one-sample-stride2", (1, 20, 9, 7), dict(padding=1, stride=2), 0, True),
    ("whole-tiles-per-sample", (3, 20, 4, 8), dict(padding=1), 0, True),
    ("per-sample-tiles", (3, 20, 5, 7), dict(padding=1), 2, True),
    ("tiles-cross-samples", (3, 20, 5, 7), dict(padding=1), 0, False),
]


@pytest.mark.parametrize("kind,act", PROLOGUES[1:], ids=prologue_ids(PROLOGUES[1:]))
@pytest.mark.parametrize("name,xs,conv,groups,one", ONE_SAMPLE, ids=[c[0] for c in ONE_SAMPLE])
def test_a_per_sample_prologue_reads_its_vectors_once_per_tile_where_tiles_hold_one_sample(name, xs, conv, groups,
                                                                                            one, kind, act):  # fmt: skip
    """A group affine's or a gate's vectors read once per K step (``fprop.one_sample_tiles``) where every
    tile lies in one sample, else per element: against float64 with eager's error as the yardstick, the
    padded taps zero after the hook, and each sample's own vectors (drawn apart per sample)."""
    g = torch.Generator().manual_seed(stable_seed(("one sample", name, kind)))
    x = _channels_last(_randn(*xs, g=g))
    w, b = _randn(12, xs[1], 3, 3, g=g, scale=0.3), _randn(12, g=g)
    prologue = conv_prologue(kind, xs[0], xs[1], g, DEVICE)
    geo = fprop._check_call(x, w, None, None, None, conv.get("stride", 1), conv["padding"], 1, 1)
    assert fprop.one_sample_tiles(prologue, geo, SMALL.block_m, groups > 0) == one
    assert not fprop.one_sample_tiles(conv_prologue("channel_affine", xs[0], xs[1], g, DEVICE), geo, 16, True)
    stats = dict(stats_groups=groups) if groups else {}
    _check(f"{name} {kind}", x, w, b, prologue=prologue, act_in=act, tile=SMALL, **stats, **conv)


ACTIVATIONS = ["relu", Activation("leaky_relu", 0.3), "gelu", "silu"]


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: getattr(a, "kind", a))
def test_each_activation_in_and_out(act):
    g = torch.Generator().manual_seed(stable_seed(str(act)))
    x = _channels_last(_randn(2, 5, 6, 5, g=g))
    w, b = _randn(6, 5, 3, 3, g=g, scale=0.4), _randn(6, g=g)
    _check(f"act_out {act}", x, w, b, padding=1, act_out=act)
    _check(f"act_in {act}", x, w, b, padding=1, act_in=act, act_out=act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("after", [False, True], ids=["before-act", "after-act"])
def test_residual_before_or_after_the_output_activation(after, dtype):
    g = torch.Generator().manual_seed(17 + after)
    x = _channels_last(_randn(2, 6, 5, 7, g=g, dtype=dtype))
    w, b = _randn(8, 6, 3, 3, g=g, scale=0.3, dtype=dtype), _randn(8, g=g, dtype=dtype)
    r = _channels_last(_randn(2, 8, 5, 7, g=g, dtype=dtype))
    out, _ = _check(f"residual after={after}", x, w, b, padding=1, act_out="relu", residual=r,
                    residual_after_act=after, tile=SMALL_FLAT)  # fmt: skip
    assert bool((out < 0).any()) == after  # relu last: nothing negative; relu before the add: some


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chain_after_the_bias_as_a_per_channel_multiplier_and_activations(dtype):
    """conv -> + bias -> x per-channel multiplier -> leaky_relu -> gelu (a seeds pipeline's epilogue) in
    the store, against float64; and a folded eval BatchNorm (x scale + shift) before a residual and relu,
    with the statistics of the stored result."""
    g = torch.Generator().manual_seed(stable_seed(("chain", str(dtype))))
    x = _channels_last(_randn(2, 12, 7, 6, g=g, dtype=dtype))
    w, b = _randn(10, 12, 3, 3, g=g, scale=0.2, dtype=dtype), _randn(10, g=g)
    m = _randn(10, g=g)
    chain = [(OP["mul"], [m]), (OP["leaky_relu"], [0.2]), (OP["gelu"], [])]
    _check("multiplier-leaky-gelu", x, w, b, padding=1, chain=chain, tile=SMALL)
    scale, shift = _randn(10, g=g) * 0.5 + 1.0, _randn(10, g=g)
    residual = _channels_last(_randn(2, 10, 7, 6, g=g, dtype=dtype))
    _check("folded-bn-residual-relu", x, w, None, padding=1, chain=[(OP["mul"], [scale]), (OP["add"], [shift])],
           residual=residual, act_out="relu", stats=True)  # fmt: skip
    # the same BatchNorm through the kernel's own scale and bias vectors, a chain after them
    _check("scale-shift-relu-gelu", x, w, shift, padding=1, scale=scale, chain=[(OP["relu"], []), (OP["gelu"], [])],
           tile=SMALL)  # fmt: skip
    _check("scale-shift-stride2-depthwise", x, _randn(12, 1, 3, 3, g=g, dtype=dtype), shift.new_ones(12) * 0.5,
           stride=2, groups=12, scale=_randn(12, g=g).to(dtype), act_out="relu")  # fmt: skip


def test_chain_constants_key_the_plan_and_tensor_operands_are_bound_per_call():
    """A constant operand is baked into the plan (another value: another plan); a tensor operand's values
    are read at every call; a one-value tensor broadcasts over the channels."""
    g = torch.Generator().manual_seed(59)
    x = _channels_last(_randn(1, 4, 5, 5, g=g))
    w = _randn(6, 4, 3, 3, g=g)
    conv_fprop(x, w, chain=[(OP["clamp"], [-0.5, 0.5])])
    count = len(fprop._PLANS)
    _check("clamp", x, w, None, chain=[(OP["clamp"], [-0.25, 0.75])])
    assert len(fprop._PLANS) == count + 1
    for value in (2.0, -3.0):
        m = torch.full((1,), value, device=DEVICE)
        out, _ = _check(f"x {value}", x, w, None, chain=[(OP["mul"], [m]), (OP["add"], [0.5])])
    assert len(fprop._PLANS) == count + 2
    torch.testing.assert_close(out, F.conv2d(x, w) * -3.0 + 0.5, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [
    ("depthwise-bn-relu-prologue", (2, 24, 7, 6), (24, 1, 3, 3), dict(padding=1, groups=24)),
    ("depthwise-x2-stride2-dilation2", (1, 8, 9, 8), (16, 1, 3, 3), dict(padding=2, stride=2, dilation=2, groups=8)),
    ("single-input-channel-groups1", (2, 1, 6, 7), (12, 1, 5, 5), dict(padding=2)),
    ("depthwise-conv1d-k5", (2, 20, 11), (20, 1, 5), dict(padding=2, groups=20)),
    ("depthwise-conv3d", (1, 16, 4, 5, 4), (16, 1, 3, 3, 3), dict(padding=1, groups=16)),
], ids=lambda c: c[0] if isinstance(c, tuple) else None)  # fmt: skip
def test_one_input_channel_per_group_runs_the_direct_tile_with_every_hook(case, dtype):
    """Depthwise convs (any multiplier, stride, dilation, 1d-3d) and a single-channel input run the direct
    depthwise tile, not the GEMM; with a BatchNorm prologue and relu on load, a chain, a residual and
    the statistics, against float64."""
    name, xs, ws, conv = case
    g = torch.Generator().manual_seed(stable_seed(("dw", name, str(dtype))))
    x = _channels_last(_randn(*xs, g=g, dtype=dtype))
    w, b = _randn(*ws, g=g, scale=0.3, dtype=dtype), _randn(ws[0], g=g)
    out, _ = _check(name, x, w, b, **conv)
    assert fprop._PLANS.values()[-1].depthwise
    c = xs[1]
    prologue = ChannelAffine(_randn(c, g=g) * 0.2 + 1.0, _randn(c, g=g))
    residual = _channels_last(torch.randn(out.shape, generator=g).to(DEVICE, dtype))
    _check(f"{name} hooked", x, w, b, prologue=prologue, act_in="relu", chain=[(OP["mul"], [_randn(ws[0], g=g)])],
           residual=residual, act_out="silu", stats=True, tile=TileConfig(16, 16, 16, 1, 1), **conv)  # fmt: skip


def test_residual_layout_is_judged_by_the_dims_that_have_extent():
    """An (N, C, 1, W) output: a residual whose size-1 dim has another stride is still channels-last
    dense (as torch's ``is_contiguous`` judges it), and is accepted; its values land where they belong."""
    g = torch.Generator().manual_seed(19)
    x = _channels_last(_randn(2, 5, 3, 6, g=g))
    w = _randn(6, 5, 3, 3, g=g, scale=0.3)
    base = _channels_last(_randn(2, 6, 1, 4, g=g))
    r = base.as_strided(base.shape, (base.stride(0), 1, 7, 6))
    assert r.stride() != base.stride() and r.is_contiguous(memory_format=torch.channels_last)
    _check("residual (2, 6, 1, 4)", x, w, None, residual=r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_statistics_of_the_stored_output_match_float64_and_repeat_bitwise(dtype):
    """Per-channel sums over several M tiles (the last one partial), two N tiles and two groups."""
    g = torch.Generator().manual_seed(23)
    x = _channels_last(_randn(3, 8, 5, 7, g=g, dtype=dtype))
    w, b = _randn(36, 4, 3, 3, g=g, scale=0.3, dtype=dtype), _randn(36, g=g, dtype=dtype) + 1.0
    kw = dict(padding=1, groups=2, act_out="silu", stats=True, tile=SMALL_FLAT)
    out, stats = _check("stats", x, w, b, **kw)
    assert stats.count == 3 * 5 * 7 and stats.sum.dtype == torch.float64
    again, stats2 = conv_fprop(x, w, b, **kw)
    assert torch.equal(out, again)
    assert torch.equal(stats.sum, stats2.sum) and torch.equal(stats.m2, stats2.m2)
    flat = out.double().transpose(0, 1).reshape(36, -1)
    torch.testing.assert_close(stats.mean(), flat.mean(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.var(), flat.var(1, unbiased=False), rtol=1e-5, atol=0)
    torch.testing.assert_close(stats.var(unbiased=True), flat.var(1, unbiased=True), rtol=1e-5, atol=0)
    shift = _randn(36, g=g)
    _, with_form = conv_fprop(x, w, b, **kw, bn_form=BatchNormForm(shift, 1e-3))  # BatchNorm's form, same launch
    assert torch.equal(with_form.sum, stats.sum) and torch.equal(with_form.form, stats.batch_norm_form(shift, 1e-3))


# name, x shape, weight shape, conv kwargs, stats groups, tile: samples whose rows fill no tile (the
# 5 x 3 plane of 15 rows against 16-row tiles), several tiles per sample, conv groups across stats groups,
# depthwise, 1-d and 3-d
GROUP_STATS = [
    ("2d-15-rows", (3, 4, 5, 3), (12, 4, 3, 3), dict(padding=1), 4, SMALL_FLAT),
    ("2d-several-tiles", (2, 6, 9, 7), (8, 3, 3, 3), dict(padding=1, groups=2), 2, SMALL),
    ("2d-one-group", (2, 5, 6, 6), (6, 5, 3, 3), dict(stride=2, padding=1), 1, SMALL_FLAT),
    ("depthwise", (2, 6, 7, 5), (6, 1, 3, 3), dict(padding=1, groups=6), 3, None),
    ("1d", (3, 4, 21), (6, 4, 3), dict(padding=1), 3, SMALL_FLAT),
    ("3d", (2, 3, 3, 4, 5), (4, 3, 3, 3, 3), dict(padding=1), 2, SMALL_FLAT),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name,xs,ws,conv,groups,tile", GROUP_STATS, ids=[c[0] for c in GROUP_STATS])
def test_group_statistics_per_sample_and_group_match_float64(name, xs, ws, conv, groups, tile, dtype):
    """GroupNorm's statistics of the stored output (per sample and group of consecutive channels)
    against float64, eager's as the yardstick; the output itself is the same bits as without them on
    the GPU (only which rows a program computes changes: no tile crosses a sample)."""
    g = torch.Generator().manual_seed(stable_seed(("group stats", name, str(dtype))))
    x = _channels_last(_randn(*xs, g=g, dtype=dtype))
    w, b = _randn(*ws, g=g, scale=0.3, dtype=dtype), _randn(ws[0], g=g, dtype=dtype) + 2.0
    kw = dict(act_out="silu", tile=tile, **conv)
    out, stats = conv_fprop(x, w, b, stats_groups=groups, **kw)
    plain, _ = conv_fprop(x, w, b, **kw)
    if DEVICE == "cuda":
        assert torch.equal(out, plain), name
    else:  # the interpreter's dot is numpy's matmul, whose rounding of a row can follow its place in the
        # tile: within two units in the last place of the largest value (a wrong row is off by its size)
        ulp = torch.finfo(dtype).eps * plain.abs().max().item()
        torch.testing.assert_close(out, plain, rtol=0.0, atol=2 * ulp, msg=name)
    kw.pop("tile")
    _, eager = conv_fprop_reference(x, w, b, stats_groups=groups, **kw)
    _, truth = conv_fprop_reference(x, w, b, stats_groups=groups, dtype=torch.float64, **kw)
    assert stats.sum.shape == (xs[0], groups) and stats.count == truth.count == ws[0] // groups * out[0, 0].numel()
    for what in ("sum", "m2"):
        why = compare(f"{name} group stats {what}", getattr(stats, what), getattr(eager, what), FLOOR[dtype],
                      reference=getattr(truth, what))  # fmt: skip
        assert why is None, why
    # and of the very values stored: up to the fp32 rounding of the tiles' partials
    _, exact = conv_fprop_reference(out.double(), torch.eye(ws[0], dtype=torch.float64, device=DEVICE).view(
        ws[0], ws[0], *(1,) * (x.dim() - 2)), stats_groups=groups)  # fmt: skip
    torch.testing.assert_close(stats.mean(), exact.mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.var(), exact.var(), rtol=1e-5, atol=1e-7)
    again, stats2 = conv_fprop(x, w, b, stats_groups=groups, tile=tile, act_out="silu", **conv)
    assert torch.equal(stats.sum, stats2.sum) and torch.equal(stats.m2, stats2.m2)  # bitwise, run to run


def test_group_statistics_keep_the_variance_of_a_group_whose_mean_dwarfs_its_spread():
    g = torch.Generator().manual_seed(9)
    x = _channels_last(_randn(3, 6, 9, 11, g=g))
    w, b = _randn(8, 6, 3, 3, g=g, scale=0.2), torch.full((8,), 3000.0, device=DEVICE) + 0.1 * _randn(8, g=g)
    out, stats = conv_fprop(x, w, b, padding=1, stats_groups=2, tile=SMALL_FLAT)
    grouped = out.double().reshape(3, 2, -1)
    want = grouped.var(2, unbiased=False)
    eager = out.reshape(3, 2, -1).var(2, unbiased=False).double()  # fp32, as eager's GroupNorm
    mine_err, eager_err = (stats.var() - want).abs(), (eager - want).abs()
    assert (mine_err <= 4 * eager_err + 1e-6 * want).all(), (mine_err / want, eager_err / want)


def test_group_statistics_of_an_empty_batch():
    x = _channels_last(torch.zeros(0, 5, 6, 7, device=DEVICE))
    out, stats = conv_fprop(x, torch.zeros(4, 5, 3, 3, device=DEVICE), padding=1, stats_groups=2)
    assert out.shape == (0, 4, 6, 7) and stats.sum.shape == (0, 2) and stats.count == 2 * 42


def test_statistics_keep_the_variance_of_a_channel_whose_mean_dwarfs_its_spread():
    """A bias of 3000 over outputs of spread about 1 (fp32): sums of squares in fp32 partials lose the
    variance (each tile's sum of y^2 rounds at 2**-24 of 9e6 per term, the spread itself), and fp32
    tile sums lose some (2**-24 of the sum); the tiles' shifted sums and deviations keep it, as eager's
    Welford BatchNorm does."""
    g = torch.Generator().manual_seed(5)
    x = _channels_last(_randn(4, 6, 9, 11, g=g))
    w, b = _randn(5, 6, 3, 3, g=g, scale=0.2), torch.full((5,), 3000.0, device=DEVICE) + _randn(5, g=g)
    out, stats = conv_fprop(x, w, b, padding=1, stats=True, tile=SMALL_FLAT)
    flat = out.double().transpose(0, 1).reshape(5, -1)
    want = flat.var(1, unbiased=False)
    eager = out.transpose(0, 1).reshape(5, -1).var(1, unbiased=False).double()  # fp32, as eager's BatchNorm
    mine_err, eager_err = (stats.var() - want).abs(), (eager - want).abs()
    assert (mine_err <= 4 * eager_err + 1e-6 * want).all(), (mine_err / want, eager_err / want)
    assert (mine_err <= 1e-6 * want).all() and (want > 0.5).all()
    torch.testing.assert_close(stats.var(unbiased=True), flat.var(1, unbiased=True), rtol=0,
                               atol=1e-6 * flat.square().mean().item())


def test_statistics_of_constant_channels_are_exactly_zero_spread_and_of_one_row_tiles_exact():
    """A channel whose every value is the same (a zero weight, a bias fp32 does not hold exactly) has a
    variance of exactly 0, not a rounding residue; and a last tile of one row (M = 16 k + 1) adds that
    row with no spread of its own."""
    g = torch.Generator().manual_seed(67)
    x = _channels_last(_randn(1, 4, 17, 1, g=g))  # M = 17: a 16-row tile and a one-row tile
    w = _randn(3, 4, 1, 1, g=g)
    w[1] = 0.0
    b = torch.tensor([0.5, 3000.1, -7.0], device=DEVICE)
    out, stats = conv_fprop(x, w, b, stats=True, tile=SMALL)
    flat = out.double().transpose(0, 1).reshape(3, -1)
    assert stats.m2[1].item() == 0.0 and stats.mean()[1].item() == torch.tensor(3000.1).item()
    torch.testing.assert_close(stats.var(), flat.var(1, unbiased=False), rtol=1e-6, atol=0)
    torch.testing.assert_close(stats.mean(), flat.mean(1), rtol=0, atol=2**-22 * flat.abs().max().item())  # fp32 sums


# --------------------------------------------------------------------------------------------------
# Layouts, empty batch, non-finite values
# --------------------------------------------------------------------------------------------------


def test_nchw_input_is_relaid_and_gives_the_same_result():
    g = torch.Generator().manual_seed(29)
    x = _randn(2, 5, 6, 7, g=g)  # contiguous NCHW: channel stride 42
    w = _randn(4, 5, 3, 3, g=g, scale=0.3)
    out, _ = _check("nchw", x, w, None, padding=1)
    assert torch.equal(out, conv_fprop(_channels_last(x), w, padding=1)[0])
    x1 = _randn(2, 3, 9, g=g)  # conv1d, NCL
    _check("ncl", x1, _randn(4, 3, 3, g=g), None, padding=1)


def test_sliced_channels_last_input_is_read_in_place():
    """A window of a larger channels-last tensor (spatial and channel slices: channel stride 1, other
    strides of the parent) whose outside holds NaN: nothing outside the window may be read."""
    g = torch.Generator().manual_seed(31)
    parent = _channels_last(_randn(3, 9, 8, 10, g=g))
    parent[:, :, 0] = float("nan")
    parent[:, :, :, -1] = float("nan")
    parent[:, 0] = float("nan")
    parent[:, -2:] = float("nan")
    x = parent[1:, 1:7, 1:7, 2:9]
    assert x.stride(1) == 1 and not x.is_contiguous(memory_format=torch.channels_last)
    w, b = _randn(5, 6, 3, 3, g=g, scale=0.3), _randn(5, g=g)
    out, _ = _check("sliced", x, w, b, padding=1, prologue=ChannelAffine(_randn(6, g=g), _randn(6, g=g)))
    assert out.isfinite().all()
    plan = fprop._PLANS.values()[-1]
    assert not plan.relayout


def test_empty_batch_returns_empty_output_without_launch(monkeypatch):
    def no_launch(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("launched for an empty batch")

    monkeypatch.setattr(fprop.FastLaunch, "__call__", no_launch)
    x = _channels_last(torch.zeros(0, 5, 6, 7, device=DEVICE))
    w = torch.zeros(4, 5, 3, 3, device=DEVICE)
    out, stats = conv_fprop(x, w, padding=1, stride=2, stats=True)
    assert out.shape == (0, 4, 3, 4) and out.stride(1) == 1
    assert stats.count == 0 and stats.sum.shape == (4,) and not stats.sum.any()
    _, stats = conv_fprop(x, w, padding=1, stride=2, stats=True, bn_form=BatchNormForm(None, 1e-5))
    assert stats.form.shape == (3, 4) and stats.form.isnan().all()  # the mean of nothing, and all from it
    with pytest.raises(ContractError, match="weight dtype"):  # an empty batch is still checked
        conv_fprop(x, w.half())


@pytest.mark.parametrize("with_prologue", [False, True])
def test_nan_reaches_exactly_the_outputs_whose_taps_read_it(with_prologue):
    """NaN/inf at borders and corners, stride 2 and padding: the outputs whose windows cover them,
    and only those, are non-finite (as eager's), also through a prologue whose shift is non-zero."""
    g = torch.Generator().manual_seed(37 + with_prologue)
    x = _randn(2, 4, 7, 8, g=g)
    x[0, 1, 0, 0] = float("nan")
    x[0, 2, 6, 7] = float("inf")
    x[1, 0, 3, 0] = float("-inf")
    x[1, 3, 2, 5] = float("nan")
    x = _channels_last(x)
    w = _randn(5, 4, 3, 3, g=g).abs() + 0.1  # positive: an inf keeps its sign
    prologue = ChannelAffine(torch.ones(4, device=DEVICE), torch.full((4,), 0.5, device=DEVICE)) if with_prologue else None
    out, _ = _check("nan", x, w, None, padding=1, stride=(2, 1), prologue=prologue)
    assert out.isnan().any() and out.isinf().any() and out.isfinite().any()


def test_int64_offsets_give_the_same_result(monkeypatch):
    monkeypatch.setattr(fprop, "_BIG_INDEX_THRESHOLD", 0)
    g = torch.Generator().manual_seed(41)
    x = _channels_last(_randn(2, 16, 5, 6, g=g))
    w = _randn(6, 16, 3, 3, g=g, scale=0.3)
    r = _channels_last(_randn(2, 6, 5, 6, g=g))
    _check("big", x, w, None, padding=1, residual=r, stats=True, tile=SMALL)
    assert fprop._PLANS.values()[-1].launch.constexprs["BIG"]


# --------------------------------------------------------------------------------------------------
# Plans, precision, tiles
# --------------------------------------------------------------------------------------------------


def test_plan_is_cached_per_signature():
    g = torch.Generator().manual_seed(43)
    x = _channels_last(_randn(1, 3, 5, 5, g=g))
    w = _randn(4, 3, 3, 3, g=g)
    conv_fprop(x, w, padding=1, act_out="relu")
    count = len(fprop._PLANS)
    conv_fprop(x, w, padding=1, act_out="relu")
    conv_fprop(x, w, padding=1, act_out=Activation("relu"))
    assert len(fprop._PLANS) == count
    conv_fprop(x, w, padding=1, act_out=Activation("leaky_relu", 0.5))  # another code: another plan
    assert len(fprop._PLANS) == count + 1
    conv_fprop(x, w, padding=1, act_out=Activation("leaky_relu", 0.25))  # the slope is a runtime argument
    assert len(fprop._PLANS) == count + 1


@pytest.mark.parametrize("groups", [1, 2])
def test_a_channels_last_weight_whose_channels_fill_the_tile_is_read_in_place(groups):
    """No per-call copy of the weight where its memory is the kernel's matrix already; any other
    weight (NCHW, channels the tile pads) is prearranged, with the same result."""
    g = torch.Generator().manual_seed(53)
    x = _channels_last(_randn(2, 32, 5, 6, g=g))
    w = _randn(32, 32 // groups, 3, 3, g=g, scale=0.2)
    for weight, tile, in_place in ((_channels_last(w), SMALL, True), (w, SMALL, False),
                                   (_channels_last(w), TileConfig(16, 32, 32, 1, 1), groups == 1)):  # fmt: skip
        out, _ = _check(f"weight-g{groups}-{in_place}", x, weight, None, padding=1, groups=groups, tile=tile)
        assert fprop._PLANS.values()[-1].weight_in_place is in_place


def test_fp32_dot_precision_follows_cudnn_allow_tf32(monkeypatch):
    g = torch.Generator().manual_seed(47)
    x = _channels_last(_randn(1, 3, 5, 5, g=g))
    w = _randn(4, 3, 3, 3, g=g)
    for allow in (True, False):
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", allow)
        conv_fprop(x, w, padding=1)
        want = "tf32" if allow and not fprop.INTERPRETER else "ieee"
        assert fprop._PLANS.values()[-1].launch.constexprs["PRECISION"] == want
        conv_fprop(x, w, padding=1, allow_tf32=False)  # the caller's answer overrides the flag
        assert fprop._PLANS.values()[-1].launch.constexprs["PRECISION"] == "ieee"


@pytest.mark.parametrize("cin_g,cout_g,taps,m,dtype", [
    (3, 64, 49, 802816, torch.float16), (1, 1, 9, 1000, torch.float32), (64, 64, 9, 200704, torch.bfloat16),
    (20, 24, 9, 40, torch.float32), (256, 512, 1, 3136, torch.float16), (48, 7, 27, 5, torch.float32),
])  # fmt: skip
def test_pick_tile_gives_valid_tiles(cin_g, cout_g, taps, m, dtype):
    tile = pick_tile(cin_g, cout_g, taps, m, dtype)
    tile.check()
    assert tile.flat_k == (cin_g < 16)
    if not tile.flat_k:
        assert tile.block_k <= cin_g and (cin_g % 16 != 0 or cin_g % tile.block_k == 0)
    assert tile.block_m <= max(16, 2 * m)


# --------------------------------------------------------------------------------------------------
# Contract errors: one line, before any launch
# --------------------------------------------------------------------------------------------------


def _bad_calls():
    x = _channels_last(torch.randn(2, 4, 6, 6)).to(DEVICE)
    w = torch.randn(6, 4, 3, 3).to(DEVICE)
    cl = _channels_last(torch.randn(2, 6, 6, 6)).to(DEVICE)
    ones4 = torch.ones(4, device=DEVICE)
    return [
        ("weight dtype", lambda: conv_fprop(x, w.half())),
        ("x must be", lambda: conv_fprop(x.double(), w.double())),
        ("x is on meta", lambda: conv_fprop(x.to("meta"), w.to("meta"))),
        ("weight must be a tensor on", lambda: conv_fprop(x, w.to("meta"))),
        ("input channels", lambda: conv_fprop(x, torch.randn(6, 3, 3, 3, device=DEVICE))),
        ("groups=3 must divide", lambda: conv_fprop(x, w[:, :1], groups=3)),
        ("weight must have x's rank", lambda: conv_fprop(x, w[..., 0])),
        ("stride must be an int or 2 ints", lambda: conv_fprop(x, w, stride=(1, 1, 1))),
        ("must be >= 1", lambda: conv_fprop(x, w, stride=0)),
        ("empty output", lambda: conv_fprop(x, torch.randn(6, 4, 7, 7, device=DEVICE))),
        ("stats_groups=4 must divide the 6 output channels", lambda: conv_fprop(x, w, stats_groups=4)),
        ("stats_groups must be an int >= 0, got -1", lambda: conv_fprop(x, w, stats_groups=-1)),
        ("stats_groups must be an int >= 0, got True", lambda: conv_fprop(x, w, stats_groups=True)),
        ("bias must be", lambda: conv_fprop(x, w, torch.ones(5, device=DEVICE))),
        ("scale must be .* contiguous", lambda: conv_fprop(x, w, scale=torch.ones(8, device=DEVICE)[::2])),
        ("residual must be channels-last dense", lambda: conv_fprop(x, w, padding=1, residual=cl.contiguous())),
        ("residual must be", lambda: conv_fprop(x, w, residual=cl)),
        ("prologue scale must be contiguous fp32 (4,)", lambda: conv_fprop(x, w, prologue=ChannelAffine(ones4[:3], ones4))),
        ("prologue shift must be contiguous fp32", lambda: conv_fprop(x, w, prologue=ChannelAffine(ones4, ones4.half()))),
        ("G dividing C_in=4", lambda: conv_fprop(x, w, prologue=GroupAffine(torch.ones(2, 3, device=DEVICE),
                                                                           torch.ones(2, 3, device=DEVICE)))),
        ("both be given", lambda: conv_fprop(x, w, prologue=GroupAffine(torch.ones(2, 2, device=DEVICE),
                                                                       torch.ones(2, 2, device=DEVICE), ones4))),
        ("prologue gate must be contiguous fp32 (2, 4)",
         lambda: conv_fprop(x, w, prologue=SampleChannelScale(torch.ones(4, 2, device=DEVICE).t()))),
        ("prologue must be None", lambda: conv_fprop(x, w, prologue="bn")),
        ("act_in='tanh' is not one of", lambda: conv_fprop(x, w, act_in="tanh")),
        ("tile block_k must be a power of two", lambda: conv_fprop(x, w, tile=TileConfig(block_k=24))),
        ("tile must be a TileConfig", lambda: conv_fprop(x, w, tile={"block_m": 64})),
        ("group prologue scale must be an", lambda: conv_fprop(x, w, prologue=GroupAffine([1.0], [1.0]))),
        ("at most 8 steps", lambda: conv_fprop(x, w, chain=[(OP["relu"], [])] * 9)),
        ("unknown op code 30", lambda: conv_fprop(x, w, chain=[(30, [])])),
        ("earlier chain value", lambda: conv_fprop(x, w, chain=[(OP["mul"] + 32, [])])),
        ("1 or C_out=6 values", lambda: conv_fprop(x, w, chain=[(OP["mul"], [ones4])])),
        ("sequence of (op code, operands)", lambda: conv_fprop(x, w, chain=["relu"])),
        ("bn_form needs the output's channel statistics (stats=True, stats_groups=0)",
         lambda: conv_fprop(x, w, bn_form=BatchNormForm(None, 1e-5))),
        ("bn_form needs the output's channel statistics",
         lambda: conv_fprop(x, w, stats_groups=2, bn_form=BatchNormForm(None, 1e-5))),
        ("bn_form must be a stats.BatchNormForm or None, got tuple",
         lambda: conv_fprop(x, w, stats=True, bn_form=(None, 1e-5))),
        ("bn_form.bias must be None or 6 contiguous float values on",
         lambda: conv_fprop(x, w, stats=True, bn_form=BatchNormForm(torch.ones(12, device=DEVICE)[::2], 1e-5))),
    ]  # fmt: skip


@pytest.mark.parametrize("match,call", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_inputs_raise_one_line_contract_errors_before_launch(match, call, monkeypatch):
    def no_launch(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("launched despite a broken contract")

    monkeypatch.setattr(fprop.FastLaunch, "__call__", no_launch)
    with pytest.raises(ContractError, match=match.replace("(", r"\(").replace(")", r"\)")) as info:
        call()
    assert "\n" not in str(info.value)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's limit")
def test_bf16_is_refused_under_the_interpreter():
    x = torch.zeros(1, 4, 5, 5, dtype=torch.bfloat16)
    with pytest.raises(ContractError, match="x must be float32 or float16, got torch.bfloat16"):
        conv_fprop(x, torch.zeros(4, 4, 3, 3, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [
    ("gemm-tap-major", (2, 20, 5, 6), (24, 20, 3, 3), dict(padding=1), SMALL),
    ("gemm-flat-stride2", (1, 3, 7, 9), (5, 3, 3, 3), dict(padding=1, stride=2), SMALL_FLAT),
    ("depthwise", (2, 7, 6, 5), (7, 1, 3, 3), dict(padding=1, groups=7), None),
], ids=lambda c: c[0] if isinstance(c, tuple) else None)  # fmt: skip
def test_saved_is_the_raw_conv_result_and_leaves_the_output_as_it_was(case, dtype):
    """``saved`` receives the conv of the (prologue'd, activated) input before the scale, the bias, the
    chain, the residual and the output activation, rounded to its own dtype (x's, or fp32), against
    float64; the output and its statistics are bitwise those of the same call without it."""
    name, xs, ws, conv, tile = case
    g = torch.Generator().manual_seed(stable_seed(("saved", name, str(dtype))))
    x = _channels_last(_randn(*xs, g=g, dtype=dtype))
    w, b = _randn(*ws, g=g, scale=0.3, dtype=dtype), _randn(ws[0], g=g)
    prologue = ChannelAffine(_randn(xs[1], g=g) * 0.2 + 1.0, _randn(xs[1], g=g))
    hooks = dict(prologue=prologue, act_in="relu", scale=_randn(ws[0], g=g), chain=[(OP["leaky_relu"], [0.1])],
                 act_out="silu", stats=True, tile=tile, **conv)  # fmt: skip
    hooks["residual"] = _channels_last(torch.randn(conv_fprop(x, w, b, **hooks)[0].shape, generator=g)).to(DEVICE, dtype)
    plain, plain_stats = conv_fprop(x, w, b, **hooks)
    for saved_dtype in (dtype, torch.float32):
        saved = _channels_last(torch.full(plain.shape, float("nan"), device=DEVICE, dtype=saved_dtype))
        out, stats = conv_fprop(x, w, b, saved=saved, **hooks)
        assert torch.equal(out, plain) and torch.equal(stats.sum, plain_stats.sum)
        raw = dict(prologue=prologue, act_in="relu", **conv)
        eager = conv_fprop_reference(x, w, None, **raw)[0].to(saved_dtype)
        truth = conv_fprop_reference(x, w, None, dtype=torch.float64, **raw)[0]
        why = compare(f"{name} saved {saved_dtype}", saved, eager, FLOOR[saved_dtype], reference=truth)
        assert why is None, why


def test_saved_contracts():
    """A saved tensor of another shape, layout or dtype is refused before any launch; a plan made to
    write it refuses a call without it."""
    x = _channels_last(torch.randn(1, 4, 6, 6)).to(DEVICE)
    w = torch.randn(6, 4, 3, 3, device=DEVICE)
    out = _channels_last(torch.empty(1, 6, 4, 4, device=DEVICE))
    for bad in (out[:, :5], out.contiguous(), out.double()):
        with pytest.raises(ContractError, match="saved must be"):
            conv_fprop(x, w, saved=bad)
    plan = fprop.fprop_plan(x, w, saved=out)
    with pytest.raises(ContractError, match="pass saved"):
        plan(x, w, None, None, (), None, None)


def test_a_box_tile_is_refused_by_the_forward_in_one_line():
    """The forward loads no boxes of the plane, with either kernel (``fprop`` module docstring: a box
    reached the gather kernel's dot through registers and lost; ``tma_fprop``'s: box tiles lost to the
    gather); a box tile asked for by name is a contract error, not a silent gather."""
    g = torch.Generator().manual_seed(0)
    x = _channels_last(_randn(1, 16, 7, 7, g=g))
    for tile in (TileConfig(16, 16, 16, num_warps=1, num_stages=1, box_w=4), TileConfig(64, 16, 16, 4, 2, box_w=8,
                                                                                        tma=True)):  # fmt: skip
        with pytest.raises(ContractError, match="not as boxes") as info:
            conv_fprop(x, _randn(4, 16, 3, 3, g=g), tile=tile, padding=1)
        assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------------
# The TMA forward (Gluon: TMA boxes, the prologue in wgmma's register layout; sm_90 only)
# --------------------------------------------------------------------------------------------------


def _one_by_one_case(shape, c_out, dtype, g):  # noqa: ANN001, ANN202
    x = _channels_last(_randn(*shape, g=g, dtype=dtype))
    w = _randn(c_out, shape[1], *([1] * (len(shape) - 2)), g=g, scale=shape[1] ** -0.5, dtype=dtype)
    return x, w, _randn(c_out, g=g)


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind,act", [*FPROP_PROLOGUES, (None, None)],
                         ids=prologue_ids([*FPROP_PROLOGUES, (None, None)]))
@pytest.mark.parametrize("name,shape,c_out", TMA_1X1_SHAPES, ids=[c[0] for c in TMA_1X1_SHAPES])
def test_tma_forward_1x1_matches_float64_with_its_statistics(name, shape, c_out, kind, act, dtype):
    """Every tile of :data:`TMA_ROW_TILES` (the failure names it) against float64, with the hooks and
    the statistics, and the same bits on a second call."""
    for tile in TMA_ROW_TILES:
        g = torch.Generator().manual_seed(stable_seed(("tma-1x1", name, str(kind), str(act), tile.label())))
        x, w, b = _one_by_one_case(shape, c_out, dtype, g)
        prologue = None if kind is None else conv_prologue(kind, shape[0], shape[1], g, DEVICE)
        hooks = dict(prologue=prologue, act_in=act, act_out="relu", stats=True, tile=tile)
        out, stats = _check(f"tma 1x1 {name} {kind} {act} {tile.label()}", x, w, b, **hooks)
        again, stats2 = conv_fprop(x, w, b, **hooks)
        assert torch.equal(out, again) and torch.equal(stats.sum, stats2.sum) and torch.equal(stats.m2, stats2.m2)


@requires_sm90
@pytest.mark.parametrize("stride", [1, 2], ids=["rows", "strided"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tma_forward_takes_every_epilogue_hook(dtype, stride):
    """The store is the gather kernel's (``epilogue.store_tile``): scale, bias, chain, output
    activation, residual, the saved raw conv, against float64; row tiles and strided boxes (whose
    rows are the store's output positions too)."""
    g = torch.Generator().manual_seed(stable_seed(("tma-epilogue", str(dtype), stride)))
    x, w, b = _one_by_one_case((2, 48, 7 * stride, 11 * stride), 40, dtype, g)
    prologue = ChannelAffine(_randn(48, g=g) * 0.2 + 1.0, _randn(48, g=g))
    residual = _channels_last(_randn(2, 40, 7, 11, g=g, dtype=dtype))
    hooks = dict(prologue=prologue, act_in="silu", scale=_randn(40, g=g), chain=[(OP["leaky_relu"], [0.1])],
                 act_out="gelu", residual=residual, stats=True, tile=TMA_ROW_TILES[0], stride=stride)  # fmt: skip
    out, _ = _check("tma every hook", x, w, b, **hooks)
    saved = _channels_last(torch.full(out.shape, float("nan"), device=DEVICE, dtype=torch.float32))
    out2, _ = conv_fprop(x, w, b, saved=saved, **hooks)
    assert torch.equal(out, out2)
    raw = dict(prologue=prologue, act_in="silu", stride=stride)
    why = compare("tma saved", saved, conv_fprop_reference(x, w, None, **raw)[0].float(), FLOOR[torch.float32],
                  reference=conv_fprop_reference(x, w, None, dtype=torch.float64, **raw)[0])  # fmt: skip
    assert why is None, why


@requires_sm90
def test_tma_forward_reads_any_layout_and_alignment():
    """A sliced channels-last input, one whose storage starts off 16 bytes, an NCHW one, and a sliced
    weight: each is copied to the dense, aligned matrix TMA reads, and the result is right."""
    g = torch.Generator().manual_seed(41)
    dtype = torch.bfloat16
    parent = _channels_last(_randn(3, 80, 9, 10, g=g, dtype=dtype))
    parent[:, :8] = float("nan")  # outside the window
    x = parent[:, 8:72, 1:8, 2:9]
    w_parent = _randn(40, 96, 1, 1, g=g, scale=0.125, dtype=dtype)
    tile = TMA_ROW_TILES[1]
    prologue = ChannelAffine(_randn(64, g=g).abs() + 0.5, _randn(64, g=g))
    shifted = torch.empty(x.numel() + 1, dtype=dtype, device=DEVICE)[1:].view(3, 7, 7, 64).permute(0, 3, 1, 2)
    shifted.copy_(x)  # channels-last dense, its storage 2 bytes past an allocation's start
    for name, xi, wi in (("sliced", x, w_parent[:, :64]), ("offset", shifted, w_parent[:, 8:72]),
                         ("nchw", x.contiguous(), w_parent[:, :64].contiguous())):
        out, _ = _check(f"tma {name}", xi, wi, None, prologue=prologue, act_in="relu", stats=True, tile=tile)
        assert out.isfinite().all(), name


@requires_sm90
def test_tma_forward_nan_and_inf_reach_only_their_rows():
    g = torch.Generator().manual_seed(43)
    x, w, b = _one_by_one_case((2, 64, 5, 9), 24, torch.bfloat16, g)
    x[0, 3, 2, 4] = float("nan")
    x[1, 60, 0, 0] = float("inf")
    out, _ = _check("tma nan inf", x, w, b, tile=TMA_ROW_TILES[0])
    bad = ~out.isfinite().all(1)
    assert bad.sum() == 2 and bad[0, 2, 4] and bad[1, 0, 0]


@requires_sm90
def test_tma_strided_forward_reads_only_the_rows_at_the_stride():
    """Strided boxes: a NaN where the stride reads reaches its output row alone, and one where it does
    not (an odd row or column at stride 2, the odd tail of an odd height) reaches nothing, with the
    statistics finite where no real position holds a NaN."""
    g = torch.Generator().manual_seed(47)
    x, w, b = _one_by_one_case((2, 64, 9, 10), 24, torch.bfloat16, g)
    x[0, 3, 1, 4] = float("nan")  # an odd row
    x[1, 5, 2, 7] = float("inf")  # an odd column
    out, stats = _check("tma strided unread nan", x, w, b, stride=2, stats=True, tile=TMA_ROW_TILES[2])
    assert out.isfinite().all() and stats.sum.isfinite().all() and stats.m2.isfinite().all()
    x[1, 60, 4, 6] = float("nan")  # read: output (2, 3)
    out, _ = _check("tma strided read nan", x, w, b, stride=2, tile=TMA_ROW_TILES[2])
    bad = ~out.isfinite().all(1)
    assert bad.sum() == 1 and bad[1, 2, 3]


def test_tma_tiles_join_the_forward_candidates_where_the_kernel_applies():
    """A 1x1 problem the TMA forward takes times the gather heuristic's tile (what runs untimed) and the
    TMA forward's tiles; other problems never see one."""
    tiles = candidates("fprop", 64, 256, 1, 200704, torch.bfloat16, tma=True)
    assert not tiles[0].tma and all(t.tma for t in tiles[1:]) and len(tiles) == 3
    assert not any(t.tma for t in candidates("fprop", 256, 64, 1, 200704, torch.bfloat16))


@pytest.mark.parametrize("c_in,c_out,m", [(64, 256, 200704), (512, 128, 50176), (24, 40, 189), (2048, 512, 40)])
def test_tma_grid_and_statistics_lanes_cover_every_tile_once(c_in, c_out, m):
    """The TMA forward's launch geometry (CPU: host arithmetic only): each tile of ``tma_tiles`` fits the
    SM's registers and shared memory as many times as ``tma_programs_per_sm`` says, its ring holds 2 to
    the tile's stages but no more than the K steps, the persistent grid with per-program statistics is
    a multiple of the N tiles (each program's tiles share their channels) within the device's capacity,
    and the lanes' row counts (``lane_rows``) partition the output rows, lane ``j`` taking M tiles ``j,
    j + lanes, ...``."""
    from fusion_backend.kernels.conv.tiles import TMA_REGISTERS, tma_programs_per_sm, tma_tiles
    from fusion_backend.kernels.conv.tma_fprop import grid_programs, lane_rows, ring_stages

    tiles = dict.fromkeys([*tma_tiles(c_in, c_out, m), *tma_tiles(c_in, c_out, m, wide=True)])
    for tile, store_bytes in itertools.product(tiles, (2, 4)):  # the store's exchange: 16-bit or fp32
        tile.check_for("fprop")
        stages = ring_stages(tile, c_in, store_bytes)
        assert 2 <= stages <= max(2, min(tile.num_stages, -(-c_in // tile.block_k)))
        per_sm = tma_programs_per_sm(tile, stages, store_bytes)
        shared = (stages * (tile.block_m + tile.block_n) * tile.block_k * 2
                  + tile.block_m * tile.block_n * store_bytes)  # fmt: skip
        assert per_sm * shared <= 226 * 1024 and per_sm * TMA_REGISTERS * 32 * tile.num_warps <= 65536
        m_tiles, n_tiles = -(-m // tile.block_m), -(-c_out // tile.block_n)
        programs = grid_programs(tile, c_in, c_out, m_tiles, torch.device("cpu"), True, store_bytes)
        lanes = programs // n_tiles
        assert programs % n_tiles == 0 and 1 <= lanes <= m_tiles and programs <= max(n_tiles, per_sm * 132)
        plain = grid_programs(tile, c_in, c_out, m_tiles, torch.device("cpu"), False, store_bytes)
        assert plain == min(m_tiles * n_tiles, per_sm * 132)
        rows = [min(tile.block_m, m - t * tile.block_m) for t in range(m_tiles)]
        per_lane = lane_rows(rows, lanes)
        assert len(per_lane) == lanes and sum(per_lane) == m
        assert per_lane[0] == sum(rows[0::lanes]) and per_lane[-1] == sum(rows[lanes - 1::lanes])


def test_tma_store_rounds_first_only_without_fp32_arithmetic_and_reads_x_prev_early_on_one_k_step():
    """The TMA kernel's host rules (CPU): the forward's store rounds before its layout exchange unless it
    computes in fp32 first (a bias, chain, activation, residual, scale or saved conv), the input
    gradient's unless it applies act'; the exchange then takes 2 bytes per element, else 4; the input
    gradient reads x_prev before the step's wait exactly where its GEMM takes one K step."""
    from fusion_backend.kernels.conv.tma_fprop import early_x_read, exchange_bytes, round_first

    assert round_first(False, 1) and not round_first(False, 0, store_arithmetic=True)
    assert round_first(True, 0) and not round_first(True, 1)
    assert (exchange_bytes(True), exchange_bytes(False)) == (2, 4)
    assert early_x_read(64, 64) and early_x_read(40, 64) and not early_x_read(72, 64)


@pytest.mark.parametrize("why,conv,tile", [
    ("a 3x3 conv", dict(padding=1), TileConfig(64, 64, 64, 4, 2, tma=True)),
    ("a padded 1x1", dict(padding=1), TileConfig(64, 64, 64, 4, 2, tma=True)),
    ("a grouped 1x1", dict(groups=2), TileConfig(64, 64, 64, 4, 2, tma=True)),
    ("a tile of 32 rows", {}, TileConfig(32, 64, 64, 4, 2, tma=True)),
    ("a tile of 512 rows", {}, TileConfig(512, 64, 64, 8, 2, tma=True)),
], ids=lambda c: c if isinstance(c, str) else None)  # fmt: skip
def test_a_tma_tile_the_call_cannot_take_is_refused_in_one_line(why, conv, tile):
    """On CPU (no Gluon run) and for any conv the kernel does not take, a TMA tile asked for by
    name is a one-line contract error, not a silent gather."""
    g = torch.Generator().manual_seed(0)
    x = _channels_last(_randn(2, 16, 6, 6, g=g, dtype=torch.float16))
    k = 3 if "3x3" in why else 1
    with pytest.raises(ContractError, match="TMA") as info:
        conv_fprop(x, _randn(8, 16 // conv.get("groups", 1), k, k, g=g, dtype=torch.float16), tile=tile, **conv)
    assert "\n" not in str(info.value)


def test_tma_forward_operand_matrices_and_their_kept_descriptors():
    """What the TMA forward's descriptors span (the host side only, on any device): x's channels-last
    rows and a 1x1 weight in any layout as ``[C_out, C_in]``, each element where the kernel's
    coordinates look for it, and copies where the memory is not dense and aligned.  The launch keeps a
    view's descriptor by data pointer and builds a copy's anew, and keeps no tensor alive."""
    import gc
    import weakref

    from fusion_backend.kernels.conv.tma_fprop import (
        GLUON,
        _shared_layout,
        input_rows,
        kept_descriptor,
        weight_matrix,
    )

    g = torch.Generator().manual_seed(61)
    x = _channels_last(torch.randn(2, 24, 5, 7, generator=g).to(DEVICE))
    rows = input_rows(x)
    assert rows.shape == (70, 24) and torch.equal(rows[12], x[0, :, 1, 5])
    assert rows.data_ptr() == x.data_ptr()  # a view of channels-last memory
    sliced = x[:, 4:20]  # channel stride 1, rows 24 apart: copied to dense rows
    dense = input_rows(sliced)
    assert dense.is_contiguous() and torch.equal(dense, sliced.permute(0, 2, 3, 1).reshape(70, 16))
    w1 = torch.randn(16, 24, 1, 1, generator=g).to(DEVICE)
    for source in (w1, _channels_last(w1), w1.transpose(0, 1).contiguous().transpose(0, 1)):
        assert torch.equal(weight_matrix(source), w1[:, :, 0, 0])
    if not GLUON:
        return
    x16 = x.to(torch.float16)
    block = [64, 16]
    layout = _shared_layout(block, torch.float16)
    kept = {}
    first, copy = kept_descriptor(kept, x16, input_rows, block, layout)
    again, _ = kept_descriptor(kept, x16, input_rows, block, layout)
    assert copy is None and again is first and list(kept) == [x16.data_ptr()]
    assert (first.shape, first.strides) == ([70, 24], [24, 1])
    sliced16 = x16[:, 4:20]
    d1, c1 = kept_descriptor(kept, sliced16, input_rows, block, layout)
    d2, c2 = kept_descriptor(kept, sliced16, input_rows, block, layout)
    assert c1 is not None and d1.base.data_ptr() == c1.data_ptr() and d2 is not d1 and len(kept) == 1
    probe = weakref.ref(x16)
    del x16, sliced16, first, again
    gc.collect()
    assert probe() is None  # the kept descriptor holds the pointer, not the tensor


@pytest.mark.parametrize("shape,stride,merged", [
    ((3, 16, 14, 12), (2, 2), (1, 1, 21)),  # the height twice the output's: rows run on across samples
    ((2, 8, 9, 11), (2, 2), (1, 2, 5)),  # an odd height: a sample's rows end its plane
    ((2, 8, 10, 9), (3, 2), (1, 2, 4)),  # two strides, a width no power of two divides
    ((3, 8, 50), (2,), (1, 1, 3)),  # 1-d: one row per sample
    ((2, 8, 4, 6, 7), (2, 2, 2), (1, 4, 3)),  # 3-d: samples and depths merged, heights apart
    ((2, 8, 5, 6, 7), (2, 3, 2), (2, 3, 2)),  # 3-d, nothing merges
    ((1, 8, 1, 9), (2, 2), (1, 1, 1)),  # a plane of one row
], ids=["2d-even", "2d-odd", "2d-3x2", "1d", "3d", "3d-apart", "one-row"])
@pytest.mark.parametrize("block_m", [64, 128])
def test_tma_strided_boxes_cover_each_output_once_from_its_input_row(shape, stride, merged, block_m):
    """The strided forward's host side (any device): :class:`StridedRows`' view of x's channels-last
    memory holds, in output order, x's rows at the stride; its dims merge where x's strides allow; and
    the boxes, walked as the kernel walks them (``_box_origin``, ``_tile_rows``), cover every output
    position once, each box's real positions its ``tile_rows`` entry."""
    from fusion_backend.kernels.conv.fprop import output_size
    from fusion_backend.kernels.conv.tma_fprop import StridedRows

    g = torch.Generator().manual_seed(stable_seed(("strided-rows", str(shape), str(stride))))
    x = _channels_last(torch.randn(*shape, generator=g))
    spatial = len(shape) - 2
    out = output_size(shape[2:], (1,) * spatial, stride, (0,) * spatial, (1,) * spatial)
    lift = lambda t, fill: (fill,) * (3 - len(t)) + tuple(t)  # noqa: E731
    n, c = shape[:2]
    rows = StridedRows.of(n, c, lift(shape[2:], 1), lift(out, 1), lift(stride, 1), block_m)
    assert rows.dims == merged and rows.box_h * rows.box_w == block_m
    at_stride = x[(slice(None), slice(None), *(slice(None, None, s) for s in stride))]
    want = at_stride.movedim(1, -1).reshape(-1, c)
    view = rows.view(x.movedim(1, -1))
    assert view.data_ptr() == x.data_ptr() and torch.equal(view.reshape(-1, c), want)
    r_all, w_all = rows.dims[2], rows.out_w
    col_boxes, row_boxes = -(-w_all // rows.box_w), -(-r_all // rows.box_h)
    seen = []
    for t, count in enumerate(rows.tile_rows()):
        p, r0 = t // (col_boxes * row_boxes), ((t // col_boxes) % row_boxes) * rows.box_h
        w0 = (t % col_boxes) * rows.box_w
        real = [(p * r_all + r0 + i // rows.box_w) * w_all + w0 + i % rows.box_w for i in range(block_m)
                if r0 + i // rows.box_w < r_all and w0 + i % rows.box_w < w_all]  # fmt: skip
        assert len(real) == count
        seen += real
    assert len(rows.tile_rows()) == rows.m_tiles and sorted(seen) == list(range(n * math.prod(out)))


@requires_sm90
@pytest.mark.parametrize("kind,act", [FPROP_PROLOGUES[0], (None, None)], ids=prologue_ids([FPROP_PROLOGUES[0],
                                                                                          (None, None)]))
@pytest.mark.parametrize("name,shape,c_out,stride", TMA_STRIDED_1X1_SHAPES, ids=[c[0] for c in TMA_STRIDED_1X1_SHAPES])
def test_tma_forward_strided_1x1_matches_float64_with_its_statistics(name, shape, c_out, stride, kind, act):
    """The strided boxes (``tma_fprop.StridedRows``) on every tile of :data:`TMA_ROW_TILES` against
    float64, bf16 with the hooks and the statistics (which count each box's real positions alone), and
    fp16 plain on the first tile; the same bits on a second call."""
    for dtype, tiles in ((torch.bfloat16, TMA_ROW_TILES), (torch.float16, TMA_ROW_TILES[:1])):
        for tile in tiles:
            g = torch.Generator().manual_seed(stable_seed(("tma-strided", name, str(kind), str(dtype), tile.label())))
            x, w, b = _one_by_one_case(shape, c_out, dtype, g)
            prologue = None if kind is None else conv_prologue(kind, shape[0], shape[1], g, DEVICE)
            hooks = dict(prologue=prologue, act_in=act, act_out="relu", stats=True, tile=tile, stride=stride)
            out, stats = _check(f"tma strided {name} {kind} {dtype} {tile.label()}", x, w, b, **hooks)
            again, stats2 = conv_fprop(x, w, b, **hooks)
            assert torch.equal(out, again) and torch.equal(stats.sum, stats2.sum) and torch.equal(stats.m2, stats2.m2)


@requires_sm90
def test_tma_forward_of_an_empty_batch():
    x = _channels_last(torch.empty(0, 16, 5, 6, device=DEVICE, dtype=torch.bfloat16))
    w = torch.randn(24, 16, 1, 1, device=DEVICE, dtype=torch.bfloat16)
    out, stats = conv_fprop(x, w, stats=True, tile=TMA_ROW_TILES[0])
    assert out.shape == (0, 24, 5, 6) and stats.count == 0 and (stats.sum == 0).all()


# --------------------------------------------------------------------------------------------------
# The halo forward (``kernels/conv/halo.py``): each tile's input window normalised once per channel block
# --------------------------------------------------------------------------------------------------

#: The halo kernel's tile: 16 x 16 x 16, so that a call spans several M and N tiles, channel blocks and
#: programs of its persistent grid even on tiny shapes.
SMALL_HALO = TileConfig(16, 16, 16, num_warps=1, num_stages=1, halo=True)

# name, x shape, weight shape, conv kwargs: 'same' stride-1 convs (the halo kernel's), rows that fill no
# tile across samples, a channel tail (20 channels, blocks of 16), 5x5, dilation 2, an asymmetric kernel,
# 1-d, groups
HALO_GEOMETRY = [
    ("3x3-channel-tail", (2, 20, 5, 7), (24, 20, 3, 3), dict(padding=1)),
    ("5x5-pad2", (2, 6, 6, 5), (7, 6, 5, 5), dict(padding=2)),
    ("3x3-dil2", (1, 6, 7, 9), (6, 6, 3, 3), dict(padding=2, dilation=2)),
    ("1x3-pad0x1", (2, 4, 3, 11), (5, 4, 1, 3), dict(padding=(0, 1))),
    ("conv1d-k3", (3, 6, 13), (5, 6, 3), dict(padding=1)),
    ("groups2-cout5-per-group", (2, 32, 4, 5), (10, 16, 3, 3), dict(padding=1, groups=2)),
    ("depthwise-3x3", (2, 20, 5, 6), (20, 1, 3, 3), dict(padding=1, groups=20)),
    ("depthwise-5x5", (2, 6, 7, 5), (6, 1, 5, 5), dict(padding=2, groups=6)),
]  # fmt: skip


@pytest.mark.parametrize("kind,act", FPROP_PROLOGUES, ids=prologue_ids(FPROP_PROLOGUES))
@pytest.mark.parametrize("name,xs,ws,conv", HALO_GEOMETRY, ids=[c[0] for c in HALO_GEOMETRY])
def test_halo_forward_matches_float64_with_every_prologue(name, xs, ws, conv, kind, act):
    """The halo kernel against float64, eager's error as the yardstick: every prologue kind and its
    activation (the padded taps zero after the hook), the bias and the output's statistics."""
    g = torch.Generator().manual_seed(stable_seed((name, kind, str(act))))
    x = _channels_last(_randn(*xs, g=g))
    w, b = _randn(*ws, g=g, scale=0.3), _randn(ws[0], g=g)
    prologue = conv_prologue(kind, xs[0], xs[1], g, DEVICE)
    _check(f"halo {name} {kind}", x, w, b, prologue=prologue, act_in=act, stats=True, tile=SMALL_HALO, **conv)


#: The halo's box tiles: 4 x 4, 2 x 8 and 1 x 16 boxes of 16 output positions (1 warp).
HALO_BOXES = [TileConfig(16, 16, 16, num_warps=1, num_stages=1, halo=True, box_w=w) for w in (4, 8, 16)]


@pytest.mark.parametrize("kind,act", [*FPROP_PROLOGUES[:1], *FPROP_PROLOGUES[2:]],
                         ids=prologue_ids([*FPROP_PROLOGUES[:1], *FPROP_PROLOGUES[2:]]))
@pytest.mark.parametrize("name,xs,ws,conv", HALO_GEOMETRY, ids=[c[0] for c in HALO_GEOMETRY])
def test_halo_box_tiles_match_float64_with_every_prologue(name, xs, ws, conv, kind, act):
    """The halo kernel's box tiles against float64, eager's error as the yardstick: boxes over planes they
    do not tile (their positions past the edge computed and not stored), windows reaching past the plane
    on every side (the padding's zeros written after the prologue), every prologue kind (per-sample
    vectors read per box), the bias and an output activation, and the output's per-channel statistics
    (each box counting its real positions); each box shape on a different case."""
    g = torch.Generator().manual_seed(stable_seed(("halo box", name, kind, str(act))))
    x = _channels_last(_randn(*xs, g=g))
    w, b = _randn(*ws, g=g, scale=0.3), _randn(ws[0], g=g)
    prologue = conv_prologue(kind, xs[0], xs[1], g, DEVICE)
    tile = HALO_BOXES[stable_seed((name, kind)) % len(HALO_BOXES)]
    _check(f"halo box {tile.box_w} {name} {kind}", x, w, b, prologue=prologue, act_in=act, act_out="silu",
           stats=True, tile=tile, **conv)  # fmt: skip


def test_halo_box_tiles_equal_the_flat_halo_with_their_statistics():
    """A box tile computes what the flat halo does (the same products in the same order per output: the
    bits on the GPU, fp32 rounding of the dot apart under the interpreter), twice the same bits, and its
    statistics too, over boxes that hang over the plane's bottom and right edges (9 x 11 in boxes of 4 x
    4: each box's count its real positions, ``boxes.box_positions``); the forward's candidates offer the
    box halo first."""
    g = torch.Generator().manual_seed(43)
    x = _channels_last(_randn(2, 20, 9, 11, g=g))
    w, b = _randn(18, 20, 3, 3, g=g, scale=0.3), _randn(18, g=g)
    prologue = conv_prologue("group_affine", 2, 20, g, DEVICE)
    kw = dict(padding=1, prologue=prologue, act_in="silu", stats=True)
    boxed, boxed_stats = _check("halo box vs flat", x, w, b, tile=HALO_BOXES[0], **kw)
    flat, flat_stats = conv_fprop(x, w, b, tile=SMALL_HALO, **kw)
    torch.testing.assert_close(boxed, flat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(boxed_stats.mean(), flat_stats.mean(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(boxed_stats.var(), flat_stats.var(), rtol=1e-4, atol=1e-5)
    again, again_stats = conv_fprop(x, w, b, tile=HALO_BOXES[0], **kw)
    assert torch.equal(boxed, again) and torch.equal(boxed_stats.sum, again_stats.sum)
    positions = box_positions((1, 9, 11), 2, HALO_BOXES[0])
    assert positions[:3] == [16, 16, 12] and positions[-1] == 3 and sum(positions) == 2 * 9 * 11
    offered = candidates("fprop", 64, 64, 9, 2 * 56 * 56, torch.bfloat16, halo=True,
                         halo_window=((56, 56), (3, 3), (1, 1)))  # fmt: skip
    assert all(t.halo and t.box_w and t.block_m % t.box_w == 0 for t in offered[1:])
    # the halo's wide tile and its short one (``tiles.halo_tiles``); flat without the window's geometry
    assert (offered[1].block_m, offered[1].num_warps, offered[2].block_m, offered[2].num_warps) == (128, 8, 64, 4)
    with_stats = candidates("fprop", 64, 64, 9, 2 * 56 * 56, torch.bfloat16, halo=True)
    assert all(t.halo and not t.box_w for t in with_stats[1:])
    # the box whose windows hold the fewest positions: 8 x 8 of 64 over a 512-wide plane (10 x 10 each),
    # not the widest that tiles it (1 x 64: 3 x 66)
    assert halo_box_width((512, 512), 64, (3, 3), (1, 1)) == 8
    assert halo_box_width((1, 50), 64, (1, 3), (1, 1)) == 64  # a 1-d conv: one row


@pytest.mark.parametrize(("width", "step"), [(9, 32), (17, 64)])
def test_halo_forward_writes_its_window_in_steps_the_last_one_partial(width, step):
    """A tile of 64 rows writes its halo (64 + 2 * width + 2 rows of the plane) in steps of
    ``halo.halo_chunk`` rows, the last one partial: of 32 rows on a 9-wide plane (82 rows; steps of 64
    would pad them to 128), of 64 on a 17-wide one (100 rows, padded to 128 either way)."""
    assert halo.halo_chunk(64 + 2 * width + 2, 64, 16) == step
    assert halo.halo_chunk(64 + 2 * width + 2, 64, 128) == 32  # 64 rows of 128 channels: too wide a step
    g = torch.Generator().manual_seed(41)
    x = _channels_last(_randn(2, 24, 7, width, g=g))
    w, b = _randn(20, 24, 3, 3, g=g, scale=0.3), _randn(20, g=g)
    prologue = conv_prologue("channel_affine", 2, 24, g, DEVICE)
    _check("halo chunks", x, w, b, padding=1, prologue=prologue, act_in="relu", stats=True,
           tile=TileConfig(64, 16, 16, num_warps=4, num_stages=1, halo=True))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_halo_forward_equals_the_gather_kernel_up_to_the_sum_order_and_repeats_bitwise(dtype):
    """The halo kernel computes what the gather kernel does (the same products, summed channel block by
    channel block across the taps instead of tap by tap), with the epilogue's chain and a residual, and
    twice the same bits."""
    g = torch.Generator().manual_seed(31)
    x = _channels_last(_randn(2, 20, 6, 5, g=g, dtype=dtype))
    w, b = _randn(18, 20, 3, 3, g=g, scale=0.3, dtype=dtype), _randn(18, g=g, dtype=dtype)
    res = _channels_last(_randn(2, 18, 6, 5, g=g, dtype=dtype))
    prologue = conv_prologue("channel_affine", 2, 20, g, DEVICE)
    kw = dict(padding=1, prologue=prologue, act_in="relu", act_out="silu", residual=res, stats=True)
    halo, halo_stats = _check("halo chain", x, w, b, tile=SMALL_HALO, **kw)
    gather, _ = conv_fprop(x, w, b, tile=SMALL, **kw)
    torch.testing.assert_close(halo, gather, rtol=FLOOR[dtype] * 8, atol=FLOOR[dtype] * 8)
    again, again_stats = conv_fprop(x, w, b, tile=SMALL_HALO, **kw)
    assert torch.equal(halo, again) and torch.equal(halo_stats.sum, again_stats.sum)


def test_halo_forward_keeps_nan_to_the_outputs_whose_taps_read_it():
    """A NaN in x reaches exactly the outputs whose 3x3 windows hold it, not the halo's other rows (a
    neighbouring sample, a wrapped column)."""
    g = torch.Generator().manual_seed(37)
    x = _channels_last(_randn(2, 4, 5, 6, g=g))
    x[0, 1, 4, 5] = float("nan")  # the last element of sample 0: its halo runs on into sample 1
    w = _randn(3, 4, 3, 3, g=g, scale=0.3)
    out, _ = conv_fprop(x, w, None, padding=1, prologue=conv_prologue("channel_affine", 2, 4, g, DEVICE),
                        act_in="relu", tile=SMALL_HALO)  # fmt: skip
    expected = torch.zeros(2, 5, 6, dtype=torch.bool)
    expected[0, 3:5, 4:6] = True
    assert torch.equal(out.isnan().any(1).cpu(), expected)


@pytest.mark.parametrize("why,xs,ws,conv", [
    ("a strided conv", (1, 4, 6, 6), (3, 4, 3, 3), dict(padding=1, stride=2)),
    ("another size", (1, 4, 6, 6), (3, 4, 3, 3), {}),
    ("a 3-d conv", (1, 4, 3, 4, 4), (3, 4, 3, 3, 3), dict(padding=1)),
    ("a channel multiplier", (1, 4, 6, 6), (8, 1, 3, 3), dict(padding=1, groups=4)),
], ids=lambda c: c if isinstance(c, str) else None)  # fmt: skip
def test_a_halo_tile_the_call_cannot_take_is_refused_in_one_line(why, xs, ws, conv):
    """The halo kernel takes 'same' stride-1 1-d and 2-d convs with channels to gather: any other call
    asking for it by name is a one-line contract error naming why."""
    g = torch.Generator().manual_seed(0)
    x = _channels_last(_randn(*xs, g=g))
    with pytest.raises(ContractError, match="halo") as info:
        conv_fprop(x, _randn(*ws, g=g), tile=SMALL_HALO, **conv)
    assert "\n" not in str(info.value)
