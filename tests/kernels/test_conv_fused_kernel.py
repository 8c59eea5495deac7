"""The fused implicit-GEMM conv forward (``kernels/conv_fused/``) against the library-conv path.

Parity is checked through the fused op ``fusion::conv_epilogue_fwd`` with ``FUSION_CONV_IMPL=triton``
(the fused kernel) vs ``FUSION_CONV_IMPL=library`` (aten conv + the epilogue kernel), both on the
Triton path (``FUSION_CPU_KERNELS=triton``, the interpreter without CUDA).  Inputs are small
multiples of powers of two, so both convs are exact in fp32 and fp16: the output and the saved state
(max-pool winner index + its conv value, or the full conv output) must then agree *bitwise*, ties
(a zero multiplier) and NaN included.  The float64 eager composite checks the values themselves, and
an end-to-end ``torch.compile(backend="fusion")`` run checks every gradient with the fused forward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fusion_backend import environment
from fusion_backend.errors import UnsupportedInputError
from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.kernels import conv_fused
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef
from fusion_backend.ops.config import ConvEpilogueConfig

# fp32 parity is checked at ~1e-5: TF32 off (on CUDA both the fused kernels and cuDNN follow the flag).
pytestmark = pytest.mark.usefixtures("exact_fp32")


@pytest.fixture(autouse=True)
def _conv_fused_only(monkeypatch, fresh_plans):
    """The op's fused forward takes ``conv_fused`` for every case here, the plain stride-1 convs the
    dense kernel would serve included (its wiring: ``tests/ops/test_dense_forward_wiring.py``); no
    plan or launch kept by another test is reused."""
    monkeypatch.setattr(ce.forward, "forward_kernels", lambda x, weight, cfg: conv_fused)

PK = PointwiseKind
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
#: The kernels' device: CUDA when there is one, else CPU tensors under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _ieee_fp32(exact_fp32):
    """TF32 off: the grid-valued inputs below make every conv exact only in full fp32."""

LEAKY = ChainStep(PK.LEAKY_RELU, (Const(0.2),))
MUL = ChainStep(PK.MUL, (TensorRef(0),))
LEAKY_MUL_LEAKY = (LEAKY, MUL, LEAKY)
MUL_LEAKY_GELU = (MUL, ChainStep(PK.LEAKY_RELU, (Const(0.01),)), ChainStep(PK.GELU))


def _spec(nd, transposed=False, stride=1, padding=0, dilation=1, output_padding=0, groups=1) -> ConvSpec:
    t = lambda v: tuple(v) if isinstance(v, tuple) else (v,) * nd  # noqa: E731
    return ConvSpec(transposed, t(stride), t(padding), t(dilation), t(output_padding), groups)


def _pool(kind, nd, k=2, s=None, p=0, **kw) -> PoolSpec:
    t = lambda v: tuple(v) if isinstance(v, tuple) else (v,) * nd  # noqa: E731
    return PoolSpec(kind, t(k), t(s if s is not None else k), t(p), **kw)


# name, x shape, weight shape, spec, chain, pool, options (bias / nan / zero multiplier / channels_last)
CASES = [
    ("conv1d-s2p1-nopool", (2, 4, 11), (6, 4, 3), _spec(1, stride=2, padding=1), MUL_LEAKY_GELU, None, {}),
    ("conv1d-s3-dil2-groups-max-ceil", (2, 4, 17), (6, 2, 3), _spec(1, stride=3, dilation=2, groups=2),
     LEAKY_MUL_LEAKY, _pool("max", 1, 3, 2, 1, ceil_mode=True), {"bias": False, "zero_mul": True}),
    ("convT1d-s3p1op2-nopool", (2, 5, 6), (5, 3, 4), _spec(1, True, stride=3, padding=1, output_padding=2),
     MUL_LEAKY_GELU, None, {"nan": True}),
    ("conv2d-dil-groups-avg-ceil", (2, 4, 9, 8), (6, 2, 3, 3),
     _spec(2, stride=(1, 2), padding=(1, 0), dilation=(2, 1), groups=2),
     (ChainStep(PK.ADD, (TensorRef(0),)), ChainStep(PK.SILU)),
     _pool("avg", 2, 3, 2, 1, ceil_mode=True, count_include_pad=False), {}),
    ("convT2d-s2-maxpool-phases", (2, 4, 5, 6), (4, 3, 3, 3), _spec(2, True, stride=2, padding=1, output_padding=1),
     LEAKY_MUL_LEAKY, _pool("max", 2, 2), {"nan": True, "zero_mul": True}),
    ("convT2d-groups-maxpool-masked-phases", (1, 4, 4, 5), (4, 3, 3, 2),
     _spec(2, True, stride=(2, 3), padding=(1, 0), output_padding=(1, 2), groups=2),
     LEAKY_MUL_LEAKY, _pool("max", 2, 3, 1, 1), {"bias": False}),
    ("convT2d-mixed-static-and-masked-phases", (1, 3, 4, 4), (3, 4, 3, 3),
     _spec(2, True, stride=(2, 3), padding=(1, 1), output_padding=(1, 0)),
     LEAKY_MUL_LEAKY, _pool("max", 2, 2, (2, 1), 0), {"zero_mul": True}),
    ("conv2d-cin3-odd-channels-last", (2, 3, 7, 9), (5, 3, 3, 3), _spec(2, padding=1), MUL_LEAKY_GELU, None,
     {"channels_last": True}),
    ("conv3d-max-ceil-partial", (1, 3, 5, 6, 5), (4, 3, 2, 3, 3), _spec(3, padding=(0, 1, 1)),
     LEAKY_MUL_LEAKY, _pool("max", 3, 2, 2, 0, ceil_mode=True), {"zero_mul": True}),
    ("convT3d-s2-maxpool", (2, 4, 3, 4, 4), (4, 6, 3, 3, 3), _spec(3, True, stride=2, padding=1, output_padding=1),
     LEAKY_MUL_LEAKY, _pool("max", 3, 2), {"nan": True, "zero_mul": True}),
    ("convT3d-s2-maxpool-channels-last", (1, 4, 3, 3, 4), (4, 6, 3, 3, 3),
     _spec(3, True, stride=2, padding=1, output_padding=1), LEAKY_MUL_LEAKY, _pool("max", 3, 2),
     {"channels_last": True}),
    ("convT3d-s122-avgpool-padded", (1, 3, 2, 3, 3), (3, 4, 2, 3, 3), _spec(3, True, stride=(1, 2, 2)),
     MUL_LEAKY_GELU, _pool("avg", 3, 2, 2, 1), {}),
    # phase-aligned path (one dense (shift, channel) dot per window offset): odd sizes, partial pool windows and a partial M tile
    ("convT3d-s2-maxpool-odd-ceil-partial", (1, 3, 3, 5, 3), (3, 5, 3, 3, 3), _spec(3, True, stride=2, padding=1),
     LEAKY_MUL_LEAKY, _pool("max", 3, 2, ceil_mode=True), {"nan": True, "zero_mul": True}),
    ("convT3d-s2-maxpool-2-channel-blocks-groups", (1, 80, 2, 3, 2), (80, 3, 3, 3, 3),
     _spec(3, True, stride=2, padding=1, output_padding=1, groups=2), LEAKY_MUL_LEAKY, _pool("max", 3, 2), {}),
    # several M tiles, some holding inf/NaN (the live-pairs-only variant) and some not (shared X tile)
    ("convT3d-s2-maxpool-nonfinite-tiles", (2, 4, 5, 6, 6), (4, 6, 3, 3, 3),
     _spec(3, True, stride=2, padding=1, output_padding=1), LEAKY_MUL_LEAKY, _pool("max", 3, 2),
     {"nan": True, "inf": True}),
    # PHASE_ALIGNED with a padded pool (windows cut at every border: no FULL_WINDOWS, offset 0 is not every
    # row's first valid offset) and inf/NaN in some M tiles: both variants with the per-row first offset
    ("convT3d-s2-maxpool-padded-pool-nonfinite-tiles", (2, 4, 5, 6, 6), (4, 6, 3, 3, 3),
     _spec(3, True, stride=2, padding=1, output_padding=1), LEAKY_MUL_LEAKY, _pool("max", 3, 2, 2, 1),
     {"nan": True, "inf": True, "zero_mul": True}),
    # the prearranged weight matrix of the phase-aligned path (and its masked variant, NaN in x): a weight
    # with permuted strides
    ("convT3d-s2-maxpool-strided-weight", (2, 4, 3, 4, 4), (4, 6, 3, 3, 3),
     _spec(3, True, stride=2, padding=1, output_padding=1), LEAKY_MUL_LEAKY, _pool("max", 3, 2),
     {"w_strided": True, "nan": True}),
    ("convT2d-dil2-phase-without-taps-channels-last", (2, 3, 4, 5), (3, 4, 3, 3),
     _spec(2, True, stride=2, padding=2, dilation=2, output_padding=1), LEAKY_MUL_LEAKY, _pool("max", 2, 2),
     {"channels_last": True, "zero_mul": True}),
]  # fmt: skip
FP16_CASES = {
    "conv1d-s2p1-nopool",
    "convT2d-s2-maxpool-phases",
    "conv2d-dil-groups-avg-ceil",
    "convT3d-s2-maxpool",
    "convT3d-s2-maxpool-odd-ceil-partial",
    "convT3d-s2-maxpool-nonfinite-tiles",  # (its padded-pool variant runs in fp32 only: the same fp16 loads)
    "convT2d-dil2-phase-without-taps-channels-last",
}


def _grid_values(shape, g, scale):
    """Random multiples of ``scale`` in [-2 scale, 2 scale]: conv sums stay exact in fp16/fp32."""
    return torch.randint(-2, 3, shape, generator=g).double() * scale


def _inputs(xs, ws, spec, opts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    c_out = ws[1] * spec.groups if spec.transposed else ws[0]
    x = _grid_values(xs, g, 0.25)
    if opts.get("nan"):
        x.view(-1)[x.numel() // 3] = float("nan")
    if opts.get("inf"):
        x.view(-1)[x.numel() // 2] = float("inf")
        x.view(-1)[x.numel() * 4 // 5] = float("-inf")
    w = _grid_values(ws, g, 0.125)
    b = _grid_values((c_out,), g, 0.5) if opts.get("bias", True) else None
    m = torch.randn((c_out,) + (1,) * (len(xs) - 2), generator=g, dtype=torch.float64)
    if opts.get("zero_mul"):
        m[::2] = 0.0  # every window ties on those channels: the first valid offset must win
    x, w, m = x.to(DEVICE, dtype), w.to(DEVICE, dtype), m.to(DEVICE, dtype)
    b = None if b is None else b.to(DEVICE, dtype)
    if opts.get("w_strided"):  # same values, dims 0 and 1 swapped in memory
        w = w.transpose(0, 1).contiguous().transpose(0, 1)
    if opts.get("channels_last"):
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        x = x.contiguous(memory_format=fmt)
    return x, w, b, [m]


def _config(spec, chain, pool, strict: bool = True) -> str:
    """Strict: a kernel that cannot run raises.  The float64 references use ``strict=False``: float64
    has no Triton kernel on CUDA, and strict mode rightly refuses it there."""
    return ConvEpilogueConfig(conv=spec, chain=tuple(chain), pool=pool, strict=strict).to_json()


def _run(monkeypatch, impl, x, w, b, ops, config, save=True):
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setenv(ce.CONV_IMPL_ENV, impl)
    return torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config, save)


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert got.stride() == want.stride(), f"{what}: strides {got.stride()} vs {want.stride()}"
    assert torch.equal(got.isnan(), want.isnan()) if got.is_floating_point() else True, (
        f"{what}: NaN positions"
    )
    keep = ~got.isnan() if got.is_floating_point() else torch.ones_like(got, dtype=torch.bool)
    if got.is_floating_point():
        infinite = want.isinf()
        assert torch.equal(got.isinf(), infinite), f"{what}: inf positions"
        assert torch.equal(got[infinite], want[infinite]), f"{what}: inf signs"
        keep &= ~infinite
    diff = (got[keep].double() - want[keep].double()).abs()
    assert diff.numel() == 0 or diff.max().item() == 0.0, f"{what}: max |diff| {diff.max().item()}"


@pytest.mark.parametrize(
    "case,dtype",
    [(c, torch.float32) for c in CASES] + [(c, torch.float16) for c in CASES if c[0] in FP16_CASES],
    ids=lambda v: v[0] if isinstance(v, tuple) else str(v).split(".")[-1],
)
def test_fused_conv_matches_library_path_bitwise_with_saved_state(monkeypatch, case, dtype):
    name, xs, ws, spec, chain, pool, opts = case
    x, w, b, ops = _inputs(xs, ws, spec, opts, dtype)
    config = _config(spec, chain, pool)
    got = _run(monkeypatch, "triton", x, w, b, ops, config)
    want = _run(monkeypatch, "library", x, w, b, ops, config)
    for what, g_, w_ in zip(("out", "saved_y0", "saved_winner"), got, want, strict=True):
        _assert_same(g_, w_, f"{name} {what}")
    # The values themselves: float64 eager composite (NaN positions included).
    ref, _, _ = _run(monkeypatch, "library", x.double(), w.double(), None if b is None else b.double(),
                     [o.double() for o in ops], _config(spec, chain, pool, strict=False))  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    keep = ~ref.isnan()
    assert torch.equal(got[0].isnan(), ref.isnan())
    assert torch.allclose(got[0][keep].double(), ref[keep], rtol=tol, atol=tol)


def _case(name: str):
    return next(c for c in CASES if c[0] == name)


@pytest.mark.parametrize(
    "name",
    [
        "convT1d-s3p1op2-nopool",
        "convT3d-s2-maxpool",
        "conv2d-cin3-odd-channels-last",
        "convT3d-s2-maxpool-odd-ceil-partial",
    ],
)
def test_int64_index_path_matches(monkeypatch, name):
    monkeypatch.setattr(conv_fused.plan, "_BIG_INDEX_THRESHOLD", 0)  # BIG=True on small tensors
    monkeypatch.setattr(ce.forward, "PLANS", type(ce.forward.PLANS)(256))  # no plan kept with BIG=False
    name, xs, ws, spec, chain, pool, opts = _case(name)
    x, w, b, ops = _inputs(xs, ws, spec, opts, torch.float32)
    config = _config(spec, chain, pool)
    got = _run(monkeypatch, "triton", x, w, b, ops, config)
    assert any(launch.constexprs["BIG"] for launch in conv_fused.plan._LAUNCHES._values.values()), "BIG not taken"
    want = _run(monkeypatch, "library", x, w, b, ops, config)
    for what, g_, w_ in zip(("out", "saved_y0", "saved_winner"), got, want, strict=True):
        _assert_same(g_, w_, f"{name} {what}")


def test_static_phase_transposed_convs_take_the_phase_aligned_path():
    """The ConvT3d pipeline's geometry (stride 2, padding 1, output padding 1, max pool 2) takes the
    phase-aligned path: 27 (phase, tap) pairs over 2 shifts per dim (8 slots); masked phases (pool stride
    not a multiple of the conv stride) and plain convs do not."""
    convt3d = ConvSpec(True, (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
    x, w = torch.zeros(1, 4, 4, 4, 4), torch.zeros(4, 6, 3, 3, 3)
    plan = conv_fused.plan.launch_plan(x, w, convt3d, PoolSpec("max", (2, 2, 2), (2, 2, 2), (0, 0, 0)), [4, 4, 4])
    assert plan.phase_aligned and plan.unrolled == 27 and plan.shifts == ((0, 2), (0, 2), (0, 2))
    assert plan.shift_slots == 8
    masked = PoolSpec("max", (3, 3, 3), (1, 1, 1), (1, 1, 1))
    assert not conv_fused.plan.launch_plan(x, w, convt3d, masked, [8, 8, 8]).phase_aligned
    plain = ConvSpec(False, (1, 1, 1), (0, 0, 0), (1, 1, 1), (0, 0, 0), 1)
    assert not conv_fused.plan.launch_plan(x, torch.zeros(6, 4, 3, 3, 3), plain, None, None).phase_aligned


def test_full_windows_only_where_every_window_offset_is_in_range():
    """FULL_WINDOWS (offset 0 peeled, no row masks in the max pool) holds for the ConvT3d pipeline's
    even conv output, not for a padded or ceil-mode pool (the cases above run both)."""
    convt3d = ConvSpec(True, (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
    x, w = torch.zeros(1, 4, 4, 4, 4), torch.zeros(4, 6, 3, 3, 3)
    pool = PoolSpec("max", (2, 2, 2), (2, 2, 2), (0, 0, 0))
    assert conv_fused.plan.full_windows(conv_fused.plan.launch_plan(x, w, convt3d, pool, [4, 4, 4]))
    padded = PoolSpec("max", (2, 2, 2), (2, 2, 2), (1, 1, 1))
    assert not conv_fused.plan.full_windows(conv_fused.plan.launch_plan(x, w, convt3d, padded, [5, 5, 5]))
    no_op = ConvSpec(True, (2, 2, 2), (1, 1, 1), (1, 1, 1), (0, 0, 0), 1)  # odd output 7
    assert not conv_fused.plan.full_windows(conv_fused.plan.launch_plan(x, w, no_op, pool, [4, 4, 4]))  # ceil mode


@pytest.mark.parametrize("pool_padding", [0, 1])
def test_all_minus_inf_windows_keep_the_first_valid_offset(monkeypatch, pool_padding):
    """Every conv output -inf (x = -inf, positive weights): no later offset beats the first, so the
    saved winner is each window's first valid offset (offset 0 without pool padding: FULL_WINDOWS;
    later ones at padded borders: the per-row first-offset flag)."""
    name, xs, ws, spec, chain, _, _ = _case("convT3d-s2-maxpool")
    x = torch.full(xs, float("-inf"), device=DEVICE)
    w = torch.rand(ws, generator=torch.Generator().manual_seed(1)).to(DEVICE) + 0.5
    b, m = torch.zeros(ws[1], device=DEVICE), torch.ones(ws[1], 1, 1, 1, device=DEVICE)
    config = _config(spec, chain, _pool("max", 3, 2, 2, pool_padding))
    got = _run(monkeypatch, "triton", x, w, b, [m], config)
    want = _run(monkeypatch, "library", x, w, b, [m], config)
    for what, g_, w_ in zip(("out", "saved_y0", "saved_winner"), got, want, strict=True):
        _assert_same(g_, w_, f"{name} pool padding {pool_padding} {what}")
    assert torch.isneginf(got[0]).all()


def test_inference_saves_nothing_and_matches(monkeypatch):
    name, xs, ws, spec, chain, pool, opts = _case("convT3d-s2-maxpool")
    x, w, b, ops = _inputs(xs, ws, spec, opts, torch.float32)
    config = _config(spec, chain, pool)
    out, sa, sb = _run(monkeypatch, "triton", x, w, b, ops, config, save=False)
    want = _run(monkeypatch, "library", x, w, b, ops, config, save=False)
    assert sa.numel() == 0 and sb.numel() == 0
    _assert_same(out, want[0], "out")


def test_random_values_match_float64_eager(monkeypatch):
    """Non-grid values (rounding everywhere), odd sizes and partial tiles; fp32 at 1e-5."""
    for xs, ws, spec, pool in (
        ((3, 5, 13, 7), (7, 5, 2, 3), _spec(2, stride=(2, 1), padding=(1, 1)), _pool("avg", 2, 2, 1, 0)),
        (
            (2, 5, 4, 5),
            (5, 9, 3, 3),
            _spec(2, True, stride=2, padding=1, output_padding=1),
            _pool("max", 2, 2),
        ),
    ):
        g = torch.Generator().manual_seed(3)
        x, w = torch.randn(xs, generator=g), torch.randn(ws, generator=g) * 0.3
        c_out = ws[1] if spec.transposed else ws[0]
        b, m = torch.randn(c_out, generator=g), torch.randn(c_out, 1, 1, generator=g)
        x, w, b, m = (t.to(DEVICE) for t in (x, w, b, m))
        config = _config(spec, MUL_LEAKY_GELU, pool)
        out, _, _ = _run(monkeypatch, "triton", x, w, b, [m], config)
        ref64 = _config(spec, MUL_LEAKY_GELU, pool, strict=False)
        ref, _, _ = _run(monkeypatch, "library", x.double(), w.double(), b.double(), [m.double()], ref64)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_unsupported_reason_names_the_limits():
    geo = ConvSpec(False, (1, 1), (0, 0), (1, 1), (0, 0), 1)
    x, w = torch.zeros(1, 2, 9, 9), torch.zeros(2, 2, 3, 3)
    assert conv_fused.unsupported_reason(x, w, geo, None) is None
    assert "float64" in conv_fused.unsupported_reason(x.double(), w.double(), geo, None)
    big = PoolSpec("max", (9, 9), (1, 1), (0, 0))
    assert "unroll limit" in conv_fused.unsupported_reason(x, w, geo, big, [1, 1])
    gappy = PoolSpec("avg", (2, 2), (3, 3), (0, 0))  # stride > kernel: uncovered elements
    assert "no pool window" in conv_fused.unsupported_reason(x, w, geo, gappy, [3, 3], save=True)
    assert conv_fused.unsupported_reason(x, w, geo, gappy, [3, 3], save=False) is None


def test_forced_triton_on_an_unsupported_case_raises_under_strict(monkeypatch):
    spec = _spec(2)
    x, w = torch.randn(1, 2, 12, 12, device=DEVICE), torch.randn(2, 2, 3, 3, device=DEVICE)
    config = _config(spec, (), _pool("avg", 2, 2, 3, 0))
    with pytest.raises(UnsupportedInputError, match="FUSION_CONV_IMPL=triton"):
        _run(monkeypatch, "triton", x, w, None, [], config)
    # auto keeps the library conv where the fused kernel cannot serve the case.
    monkeypatch.setenv(ce.CONV_IMPL_ENV, "auto")
    assert ce.forward.conv_impl(x, w, ConvEpilogueConfig.from_json(config), True)[0] == "library"


@pytest.mark.parametrize(
    "name, x_shape, w_shape, spec, pool, timed",
    [
        ("conv2d-s2", (2, 8, 9, 9), (16, 8, 3, 3), _spec(2, stride=2, padding=1), None, False),
        ("conv2d-depthwise", (2, 8, 9, 9), (8, 1, 3, 3), _spec(2, padding=1, groups=8), None, False),
        ("conv2d-maxpool", (2, 8, 10, 10), (8, 8, 3, 3), _spec(2, padding=1), _pool("max", 2), False),
        ("conv3d-maxpool", (1, 4, 6, 6, 6), (8, 4, 3, 3, 3), _spec(3, padding=1), _pool("max", 3), False),
        ("convT2d-k4s2-overlapping", (2, 8, 6, 6), (8, 4, 4, 4), _spec(2, True, 2, 1), None, False),
        ("convT2d-k2s2-phase-aligned", (2, 8, 6, 6), (8, 4, 2, 2), _spec(2, True, 2), None, True),
        ("convT2d-k4s2-maxpool", (2, 8, 6, 6), (8, 4, 4, 4), _spec(2, True, 2, 1), _pool("max", 2), True),
        ("convT3d-k3s2-maxpool", (1, 4, 5, 5, 5), (4, 8, 3, 3, 3), _spec(3, True, 2, 1), _pool("max", 3), True),
        ("convT1d-k4s2", (2, 8, 9), (8, 4, 4), _spec(1, True, 2, 1), None, True),
    ],
)
def test_auto_times_the_general_fused_kernel_only_where_it_has_won(monkeypatch, name, x_shape, w_shape, spec, pool,
                                                                   timed):  # fmt: skip
    """``auto`` leaves the general kernel out of the timing where it lost to the library conv in every
    bench row (direct convs off the dense kernel's cases, 2-d transposed convs with overlapping taps
    and no pool); ``FUSION_CONV_IMPL=triton`` still runs it there."""
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    cfg = ConvEpilogueConfig.from_json(_config(spec, (), pool))
    assert ce.forward.forward_kernels(x, w, cfg) is conv_fused, name  # the cases are the general kernel's
    why = ce.forward.general_kernel_never_wins(x, w, cfg)
    assert (why is None) == timed, why
    assert ce.forward._fused_conv_answer(x, w, cfg, True, "auto") == (("triton", None) if timed else ("library", why))
    assert ce.forward._fused_conv_answer(x, w, cfg, True, "triton") == ("triton", None)


class _ConvT3dPipeline(nn.Module):
    def __init__(self, transposed: bool):
        super().__init__()
        conv = (
            nn.ConvTranspose3d(4, 6, 3, stride=2, padding=1, output_padding=1)
            if transposed
            else nn.Conv3d(4, 6, 3)
        )
        self.conv = conv
        self.multiplier = nn.Parameter(torch.randn(6, 1, 1, 1))
        self.leaky = nn.LeakyReLU(0.2)
        self.pool = nn.MaxPool3d(2)

    def forward(self, x):
        return self.pool(self.leaky(self.leaky(self.conv(x)) * self.multiplier))


def test_compiled_model_with_forced_fused_conv_matches_eager_gradients(monkeypatch):
    from fusion_backend.testing import assert_fused

    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setenv(ce.CONV_IMPL_ENV, "triton")
    calls = []
    real = conv_fused.forward_launch

    class Recording:  # the op's plan launches through the launch plan's ``run``
        def __init__(self, launch):
            self.launch = launch

        def run(self, *args):
            calls.append(1)
            self.launch.run(*args)

    monkeypatch.setattr(conv_fused, "forward_launch", lambda *a, **k: Recording(real(*a, **k)))
    monkeypatch.setattr(ce.forward, "PLANS", type(ce.forward.PLANS)(256))  # no plan kept by another test
    torch.manual_seed(0)
    model = _ConvT3dPipeline(True).to(DEVICE)
    assert_fused(model, [torch.randn(2, 4, 3, 4, 4, device=DEVICE)], expect={"conv_epilogue": 1}, train=True)
    assert calls, "the fused conv kernel did not run"


@pytest.mark.gpu
@requires_cuda
def test_auto_default_measures_both_paths_and_matches_eager_in_training(monkeypatch, tmp_path):
    """The default ``auto`` with measuring on (the suite turns it off): the first call of each
    direction times both paths (real CUDA-event timer), and whatever it keeps trains like eager
    (TF32 on, as PyTorch's default; the fused forward rounds its operands as cuDNN does)."""
    from fusion_backend import impl_choice

    monkeypatch.delenv(ce.CONV_IMPL_ENV, raising=False)
    monkeypatch.setenv(impl_choice.MEASURE_ENV, "1")
    monkeypatch.setenv(impl_choice.CACHE_DIR_ENV, str(tmp_path))
    impl_choice.forget_in_memory()
    timed = []
    real_timer = impl_choice.gpu_ms_per_call
    monkeypatch.setattr(impl_choice, "gpu_ms_per_call", lambda fn: timed.append(1) or real_timer(fn))
    torch.manual_seed(0)
    model = _ConvT3dPipeline(True).cuda()
    x = torch.rand(4, 4, 8, 16, 16, device="cuda")
    compiled = torch.compile(model, backend="fusion")
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [compiled(xs[0]), model(xs[1])]
    g = torch.randn_like(outs[1])
    grads = [torch.autograd.grad(o, [xi, *model.parameters()], g) for o, xi in zip(outs, xs, strict=True)]
    # each direction times the library path, and the others unless their results disagree with it
    # (``_results_agree``: e.g. where cuDNN runs such a narrow conv in full fp32, not TF32): the
    # forward's fused path; the backward's Triton one and its channels-last library variant
    assert 2 <= len(timed) <= 6, timed
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-3, atol=2e-3)
    for got, want in zip(*grads, strict=True):
        rel = ((got - want).double().norm() / want.double().norm()).item()
        assert rel < 2e-3, rel


# --- GPU: the seeds suite's sizes -------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("workload", ["convt3d", "conv2d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_size_convt3d_and_conv2d_through_the_fused_conv_match_library_path(monkeypatch, workload, dtype):
    torch.manual_seed(0)
    if workload == "convt3d":  # ConvTranspose3d 16->32 on 16x16x16x32x32, then MaxPool3d(2)
        spec, chain, pool = (
            _spec(3, True, stride=2, padding=1, output_padding=1),
            LEAKY_MUL_LEAKY,
            _pool("max", 3, 2),
        )
        x, w = torch.rand(16, 16, 16, 32, 32), torch.randn(16, 32, 3, 3, 3) * 0.1
        c_out = 32
    else:
        spec, chain, pool = _spec(2), MUL_LEAKY_GELU, None  # Conv2d 64->64 on 64x64x256x256
        x, w = torch.rand(64, 64, 256, 256), torch.randn(64, 64, 3, 3) * 0.05
        c_out = 64
    b, m = torch.randn(c_out), torch.randn((c_out,) + (1,) * (x.dim() - 2))
    x, w, b, m = (t.cuda().to(dtype) for t in (x, w, b, m))
    config = _config(spec, chain, pool)
    monkeypatch.setenv(ce.CONV_IMPL_ENV, "triton")
    got = torch.ops.fusion.conv_epilogue_fwd(x, w, b, [m], config, True)
    monkeypatch.setenv(ce.CONV_IMPL_ENV, "library")
    want = torch.ops.fusion.conv_epilogue_fwd(x, w, b, [m], config, True)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3  # TF32 on both sides (cudnn.allow_tf32 default)
    for g_, w_ in zip(got, want, strict=True):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype and g_.stride() == w_.stride()
    rel = ((got[0].double() - want[0].double()).norm() / want[0].double().norm()).item()
    assert rel < tol
    if workload == "convt3d":  # winners may differ only at near-ties: > 99% agree, and their values agree
        agree = (got[2] == want[2]).double().mean().item()  # the saved winner index
        assert agree > 0.99
        same = got[2] == want[2]
        assert torch.allclose(got[1][same].double(), want[1][same].double(), rtol=tol, atol=tol)
    else:
        rel_y = ((got[1].double() - want[1].double()).norm() / want[1].double().norm()).item()
        assert rel_y < tol


def test_the_probe_runs_the_autotuner_s_first_tile_and_gives_the_plan_s_results(monkeypatch):
    """``FusedForward.probe``: the same plan on the tile the autotuner times first (``impl_choice``
    times it to screen the fused kernel before tuning it), with the tuned plan's results."""
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setattr(conv_fused.plan, "_AUTOTUNE_MIN_MACS", 0)
    monkeypatch.setenv(environment.CONV_AUTOTUNE, "1")  # the suite turns tuning off  # tuned even at this size (on CUDA)
    torch.manual_seed(0)
    spec = _spec(3, transposed=True, stride=2)
    cfg = ConvEpilogueConfig(conv=spec, chain=LEAKY_MUL_LEAKY, pool=_pool("max", 3), strict=True)
    x = torch.randn(2, 4, 3, 4, 4, device=DEVICE)
    w, b, m = torch.randn(4, 6, 3, 3, 3, device=DEVICE), torch.randn(6, device=DEVICE), torch.randn(6, 1, 1, 1, device=DEVICE)
    plan = ce.forward.FusedForward(x, w, b, [m], cfg, True)
    probe = plan.probe()
    assert probe.launch is not plan.launch and probe.launch.fast is not None
    if torch.cuda.is_available():
        first = conv_fused.plan._prune(conv_fused.plan._configs(), {"CIN_G": 4, "COUT_G": 6, "M_TOTAL": plan.launch.m_total},
                                  **plan.launch.constexprs)[0]
        assert probe.launch.first_tile == dict(first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)
    for got, want in zip(probe(x, w, b, [m]), plan(x, w, b, [m]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
