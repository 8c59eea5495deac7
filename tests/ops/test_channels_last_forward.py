"""The library forward's channels-last variant (``ops/conv_epilogue/forward.ChannelsLastLibraryForward``):
x cast and relaid into channels-last in one copy, the weight relaid per call, the conv on
channels-last tensors (cuDNN's fast kernels on Hopper), then the epilogue kernel reading the
channels-last conv output and writing the outputs (and the saved state) in the fake's layouts
through a transposing tile.

The variant is one of ``auto``'s measured forward candidates on CUDA; here its plan is called
directly, so the CPU run (interpreter) checks the same values the GPU run does.  Where both plans
are given the same conv values (``same_conv``: the conv computed in one layout and handed back in
the layout its inputs ask for), everything after the conv is the same math and the outputs must be
bitwise equal to ``LibraryForward``'s; with the real conv they are checked against the reference.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from conv_cases import GELU, LEAKY, MUL0, conv_spec

from fusion_backend import impl_choice
from fusion_backend.ir.specs import PoolSpec
from fusion_backend.kernels import epilogue as kernels
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops import conv_io
from fusion_backend.ops.chain import PointwiseKind
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.testing import compare

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


#: name -> (conv spec, chain, pool, x shape, weight shape, has bias, multiplier shape)
CASES = {
    # the op of demos/seeds/conv2d_mul_leaky_gelu.py at a small, odd size
    "conv2d-mul-leaky-gelu": (conv_spec(2), (MUL0, LEAKY, GELU), None, (2, 5, 7, 9), (6, 5, 3, 3), True, (6, 1, 1)),
    "conv2d-no-bias-groups": (
        conv_spec(2, padding=2, dilation=2, groups=2), (LEAKY,), None, (2, 4, 8, 7), (6, 2, 3, 3), False, None,
    ),
    "conv2d-s2-max-pool": (
        conv_spec(2, stride=2), (LEAKY, MUL0), PoolSpec("max", (2, 2), (2, 2), (0, 0)), (2, 3, 11, 10), (4, 3, 3, 3),
        True, (4, 1, 1),
    ),
    # partial windows at the border (padding, ceil_mode) and padding left out of the divisor
    "conv2d-avg-pool-partial": (
        conv_spec(2), (MUL0,), PoolSpec("avg", (3, 3), (2, 2), (1, 1), ceil_mode=True, count_include_pad=False),
        (1, 4, 9, 7), (5, 4, 3, 3), True, (5, 1, 1),
    ),
    "conv3d": (conv_spec(3), (MUL0, GELU), None, (1, 3, 4, 5, 3), (4, 3, 3, 3, 3), True, (4, 1, 1, 1)),
    "convT2d-s2": (
        conv_spec(2, stride=2, transposed=True, output_padding=1), (LEAKY, MUL0), None, (2, 3, 5, 4), (3, 4, 3, 3),
        True, (4, 1, 1),
    ),
    # the op of demos/seeds/convt3d_leaky_mul_leaky_maxpool.py
    "convT3d-leaky-mul-leaky-max-pool": (
        conv_spec(3, stride=2, transposed=True, output_padding=1), (LEAKY, MUL0, LEAKY),
        PoolSpec("max", (2, 2, 2), (2, 2, 2), (0, 0, 0)), (2, 3, 3, 4, 3), (3, 4, 3, 3, 3), False, (4, 1, 1, 1),
    ),
}


@pytest.fixture
def interpreted(monkeypatch, exact_fp32, fresh_plans):
    """The Triton path (on CPU tensors under the interpreter), with empty plan caches."""
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path on CPU tensors needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")


@pytest.fixture
def same_conv(monkeypatch, interpreted):
    """Both plans get the same conv values: the conv is computed on contiguous copies and handed back
    channels-last where its input is channels-last (as cuDNN lays it out), so every difference left
    between the plans is in what they do after the conv."""
    real = ce.forward.run_conv

    def conv(x, weight, bias, spec):
        y = real(x.contiguous(), weight.contiguous(), bias, spec)
        fmt = conv_io.channels_last_format(x.dim())
        return y.contiguous(memory_format=fmt) if x.is_contiguous(memory_format=fmt) else y

    monkeypatch.setattr(ce.forward, "run_conv", conv)


def _inputs(case: str, compute_dtype: str | None = None, dtype: torch.dtype = torch.float32):
    """``(x, weight, bias, operands, cfg)`` of ``case``; the multiplier has a negative entry."""
    spec, chain, pool, x_shape, w_shape, has_bias, m_shape = CASES[case]
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    x = torch.randn(x_shape, generator=g).to(DEVICE, dtype)
    w = (torch.randn(w_shape, generator=g) * 0.3).to(DEVICE, dtype)
    channels = w_shape[1] * spec.groups if spec.transposed else w_shape[0]
    b = torch.randn(channels, generator=g).to(DEVICE, dtype) if has_bias else None
    ops = []
    if m_shape is not None:
        m = torch.randn(m_shape, generator=g)
        m.view(-1)[0] = -abs(m.view(-1)[0]) - 0.5  # a negative multiplier flips max-pool winners
        ops.append(m.to(DEVICE))
    cfg = ConvEpilogueConfig(conv=spec, chain=chain, pool=pool, compute_dtype=compute_dtype, strict=True)
    return x, w, b, ops, cfg


def _both(x, w, b, ops, cfg, save):
    """The outputs of ``LibraryForward`` and of ``ChannelsLastLibraryForward`` (and the latter plan)."""
    library = ce.forward.LibraryForward(x, w, b, ops, cfg, save)(x, w, b, ops)
    plan = ce.forward.ChannelsLastLibraryForward(x, w, b, ops, cfg, save)
    return library, plan(x, w, b, ops), plan


#: Bitwise under the interpreter.  On a GPU the transposing tile and the same-layout tile may contract
#: the chain's multiply-adds differently (1 ulp seen on the H100), and cuDNN's channels-last and NCHW
#: kernels sum in different orders: within a few ulp there.
_TOLERANCE = dict(rtol=1e-5, atol=1e-6) if torch.cuda.is_available() else dict(rtol=0, atol=0)


def _assert_identical(got, want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype), f"output {i}: layout"
        tol = _TOLERANCE if g.is_floating_point() else dict(rtol=0, atol=0)
        torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m, i=i: f"output {i}: {m}", **tol)


@pytest.mark.parametrize("save", [False, True], ids=["no-save", "save"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_channels_last_forward_equals_library_forward_bitwise(case, save, same_conv):
    """Outputs and saved state equal the library path's bitwise, in the same layouts (the fake's);
    the conv really ran on channels-last inputs and the plan launched for a channels-last y0."""
    x, w, b, ops, cfg = _inputs(case)
    library, got, plan = _both(x, w, b, ops, cfg, save)
    _assert_identical(got, library)
    fmt = conv_io.channels_last_format(x.dim())
    assert list(plan.launches) == [torch.empty(plan.y0_layout[0], device="meta", memory_format=fmt).stride()]


@pytest.mark.parametrize("case", ["conv2d-mul-leaky-gelu", "conv2d-avg-pool-partial", "conv3d",
                                  "convT3d-leaky-mul-leaky-max-pool"])
def test_channels_last_forward_matches_the_reference(case, interpreted):
    """With the real conv on channels-last tensors: the reference's values within fp32 tolerance,
    the reference's layouts, and its max-pool winners."""
    x, w, b, ops, cfg = _inputs(case)
    got = ce.forward.ChannelsLastLibraryForward(x, w, b, ops, cfg, True)(x, w, b, ops)
    want = ce.reference.forward(x, w, b, ops, cfg, True)
    for i, (g, r) in enumerate(zip(got, want, strict=True)):
        assert (g.shape, g.stride(), g.dtype) == (r.shape, r.stride(), r.dtype), f"output {i}"
        if r.is_floating_point():
            problem = compare(f"output {i}", g, r, tol=1e-5)
            assert problem is None, problem
        else:
            assert torch.equal(g, r), f"output {i}: max-pool winners differ"


@pytest.mark.parametrize("case", ["conv2d-mul-leaky-gelu", "convT3d-leaky-mul-leaky-max-pool"])
def test_absorbed_cast_to_half_is_folded_into_the_relayout(case, same_conv):
    """fp32 tensors with ``compute_dtype=float16`` (autocast's casts absorbed): x is cast while it
    is relaid, the weight likewise; the results are the library path's bitwise, in fp16."""
    x, w, b, ops, cfg = _inputs(case, compute_dtype="float16")
    library, got, _ = _both(x, w, b, ops, cfg, True)
    assert got[0].dtype == torch.float16
    _assert_identical(got, library)


def test_half_tensors(same_conv):
    """fp16 x, weight and bias (no cast): bitwise the library path's, and close to the reference."""
    x, w, b, ops, cfg = _inputs("conv2d-s2-max-pool", dtype=torch.float16)
    library, got, _ = _both(x, w, b, ops, cfg, True)
    _assert_identical(got, library)
    problem = compare("out", got[0], ce.reference.forward(x, w, b, ops, cfg, False)[0], tol=2e-3)
    assert problem is None, problem


def test_sliced_input(same_conv):
    """x a slice of a wider tensor (its spatial dims do not flatten: the relayout takes torch's copy)."""
    x, w, b, ops, cfg = _inputs("conv2d-mul-leaky-gelu")
    wide = torch.randn(2, 5, 7, 12, device=DEVICE)
    x = wide[..., 2:11]
    assert not x.is_contiguous()
    library, got, _ = _both(x, w, b, ops, cfg, True)
    _assert_identical(got, library)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("case", ["conv2d-mul-leaky-gelu", "conv2d-s2-max-pool"])
def test_nan_and_inf_in_x(case, same_conv):
    """NaN and inf in x reach the same outputs in the same places (a NaN wins its max-pool window)."""
    x, w, b, ops, cfg = _inputs(case)
    x[0, 0, 2, 3] = float("nan")
    x[1, 1, 4, 4] = float("inf")
    x[1, 2, 0, 1] = float("-inf")
    library, got, _ = _both(x, w, b, ops, cfg, True)
    assert got[0].isnan().any() and not got[0].isnan().all()
    _assert_identical(got, library)


def test_a_conv_output_in_another_layout_gets_its_own_launch(monkeypatch, interpreted):
    """Should the conv hand y0 back contiguous (a backend without channels-last kernels for the
    case), the plan launches the epilogue for that layout, with the same results."""
    x, w, b, ops, cfg = _inputs("conv2d-mul-leaky-gelu")
    real = ce.forward.run_conv
    monkeypatch.setattr(ce.forward, "run_conv", lambda *args: real(*args).contiguous())
    library, got, plan = _both(x, w, b, ops, cfg, True)
    _assert_identical(got, library)
    assert len(plan.launches) == 2


# --- the epilogue kernel reading a channels-last y0 ----------------------------------------------


def _kernel_inputs(dtype: torch.dtype, spatial: tuple[int, ...] = (9, 11)):
    g = torch.Generator().manual_seed(5)
    shape = (3, 70, *spatial)  # 70 channels: three channel blocks of 32, one partial
    fmt = torch.channels_last if len(spatial) == 2 else torch.channels_last_3d
    y = torch.randn(shape, generator=g).to(DEVICE, dtype).contiguous(memory_format=fmt)
    bias = torch.randn(70, generator=g).to(DEVICE, dtype)
    mult = torch.randn(70, 1, *([1] * len(spatial)), generator=g).to(DEVICE)
    mult[::3] = -mult[::3].abs()  # negative multipliers
    steps = [(PointwiseKind.MUL.code, [mult]), (PointwiseKind.LEAKY_RELU.code, [0.01])]
    # the chain in fp32, with the bias rounded to y's dtype first (as the kernel adds it)
    v = (y.float() + bias.float().view(1, -1, *([1] * len(spatial)))) * mult.float().view(1, -1, *([1] * len(spatial)))
    return y, bias, steps, F.leaky_relu(v, 0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_epilogue_kernel_reads_channels_last_and_writes_nchw_bitwise(dtype, interpreted):
    """No pool: ``out`` (NCHW) and the saved copy of y (NCHW) equal the torch reference bitwise,
    through the transposing tile."""
    y, bias, steps, v = _kernel_inputs(dtype)
    out = torch.empty(y.shape, dtype=dtype, device=DEVICE)
    y_copy = torch.empty(y.shape, dtype=dtype, device=DEVICE)
    launch = kernels.ForwardLaunch(y, bias, steps, None, out, y_copy=y_copy)
    assert (launch.launch.constexprs["BLOCK_C"], launch.launch.constexprs["BLOCK_S"]) == (32, 32)
    kernels.epilogue_forward(y, bias, steps, None, out, y_copy=y_copy)
    assert out.is_contiguous() and y_copy.is_contiguous()
    assert torch.equal(out, v.to(dtype))
    assert torch.equal(y_copy, y)


@pytest.mark.parametrize("spatial", [(9, 11), (3, 5, 6)], ids=["2d", "3d"])
def test_epilogue_kernel_pools_a_channels_last_y_into_nchw(spatial, interpreted):
    """With a pool the kernel reads y through its strides: a max pool (winners included) and an avg
    pool with partial windows give bitwise what the launch reading an NCHW copy of y gives; the max
    pool equals torch's bitwise, the avg pool within rounding."""
    y, bias, steps, v = _kernel_inputs(torch.float32, spatial)
    d = len(spatial)
    for pool in (
        PoolSpec("max", (2,) * d, (2,) * d, (0,) * d),
        PoolSpec("avg", (3,) * d, (2,) * d, (1,) * d, count_include_pad=False),
    ):
        pooled = F.max_pool2d if d == 2 else F.max_pool3d
        if pool.kind == "avg":
            pooled = functools.partial(F.avg_pool2d if d == 2 else F.avg_pool3d, count_include_pad=False)
        want = pooled(v, pool.kernel_size, pool.stride, pool.padding)
        results = []
        for y_in in (y, y.contiguous()):
            out = torch.empty(want.shape, device=DEVICE)
            saved = [torch.empty(want.shape, dtype=dt, device=DEVICE) for dt in (torch.int8, torch.float32)]
            saved = saved if pool.kind == "max" else [None, None]
            kernels.epilogue_forward(y_in, bias, steps, pool, out, *saved)
            results.append((out, *saved))
        (out_cl, *saved_cl), (out_nchw, *saved_nchw) = results
        assert torch.equal(out_cl, out_nchw), pool.kind
        for a, b in zip(saved_cl, saved_nchw, strict=True):
            assert a is None or torch.equal(a, b), pool.kind
        if pool.kind == "max":
            assert torch.equal(out_cl, want)
        else:
            torch.testing.assert_close(out_cl, want, rtol=1e-6, atol=1e-6)


# --- which calls get the candidate, and the measured choice -------------------------------------


def test_which_calls_get_a_channels_last_candidate():
    """2-d and 3-d convs of an x that is not channels-last, with or without saved state; not 1-d
    convs (no cuDNN channels-last kernels), not a channels-last x or weight (the library conv is
    channels-last there already), not float64."""
    why = ce.forward.channels_last_forward_unsupported
    cfg2 = ConvEpilogueConfig(conv=conv_spec(2), chain=(LEAKY,))
    x4, w4 = torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3)
    assert why(x4, w4, cfg2) is None
    assert why(x4[..., 1:4], w4, cfg2) is None  # a slice
    assert why(torch.randn(2, 3, 4, 4, 4), torch.randn(4, 3, 3, 3, 3), ConvEpilogueConfig(conv=conv_spec(3))) is None
    assert "1-d" in why(torch.randn(2, 3, 5), torch.randn(4, 3, 3), ConvEpilogueConfig(conv=conv_spec(1)))
    assert "float64" in why(x4.double(), w4.double(), cfg2)
    assert "float64" in why(x4, w4, ConvEpilogueConfig(conv=conv_spec(2), compute_dtype="float64"))
    assert "already" in why(x4.to(memory_format=torch.channels_last), w4, cfg2)
    assert "already" in why(x4, w4.to(memory_format=torch.channels_last), cfg2)


@pytest.mark.parametrize("save", [False, True], ids=["no-save", "save"])
def test_forward_candidates(save, interpreted):
    x, w, b, ops, cfg = _inputs("conv2d-mul-leaky-gelu")
    names = lambda xx, fused: sorted(ce.forward.forward_candidates(xx, w, b, ops, cfg, save, fused))  # noqa: E731
    assert names(x, False) == ["library", "library-channels-last"]
    assert names(x, True) == ["library", "library-channels-last", "triton"]
    # a channels-last output: the conv family's forward serves the call, saving or not
    assert names(x.contiguous(memory_format=torch.channels_last), False) == ["family", "library"]


@pytest.fixture
def measured(interpreted, fake_impl_timer):
    """``auto`` with measuring on and a fake timer (``fake_impl_timer``'s ``(times, timed)``)."""
    return fake_impl_timer


def test_auto_times_three_candidates_where_the_fused_conv_serves(monkeypatch, measured):
    times, timed = measured
    monkeypatch.setattr(ce.forward, "conv_impl", lambda *a: ("triton", None))  # as on CUDA
    times.update({"triton": 1.4, "library": 2.0, "library-channels-last": 1.0})  # probe within SCREEN: tuned
    x, w, b, ops, cfg = _inputs("conv2d-mul-leaky-gelu")
    plan, settled = ce.forward.plan_for(x, w, b, ops, cfg, False)
    assert timed[0] == ["library", "library-channels-last", "triton (probe)", "triton"]
    assert isinstance(plan, ce.forward.ChannelsLastLibraryForward) and settled


def test_auto_does_not_tune_a_fused_conv_whose_first_tile_is_far_behind(monkeypatch, measured):
    times, timed = measured
    monkeypatch.setattr(ce.forward, "conv_impl", lambda *a: ("triton", None))  # as on CUDA
    times.update({"triton (probe)": 10.0, "triton": 0.5, "library": 2.0, "library-channels-last": 3.0})
    x, w, b, ops, cfg = _inputs("conv2d-mul-leaky-gelu")
    plan, settled = ce.forward.plan_for(x, w, b, ops, cfg, False)
    assert timed[0] == ["library", "library-channels-last", "triton (probe)"], "screened: never tuned"
    assert type(plan) is ce.forward.LibraryForward and settled


def test_auto_times_both_library_layouts_where_only_the_library_conv_serves(monkeypatch, measured):
    times, timed = measured
    monkeypatch.setattr(ce.forward, "conv_impl", lambda *a: ("library", "the fused conv cannot serve it"))
    monkeypatch.setattr(ce.forward, "_times_library_layouts", lambda x: True)  # as on CUDA
    times.update({"library": 1.0, "library-channels-last": 2.0})
    x, w, b, ops, cfg = _inputs("conv2d-s2-max-pool")
    plan, settled = ce.forward.plan_for(x, w, b, ops, cfg, True)
    assert sorted(timed[0]) == ["library", "library-channels-last"]
    assert type(plan) is ce.forward.LibraryForward and settled
    # a channels-last x has one candidate: nothing to time
    x_cl = x.contiguous(memory_format=torch.channels_last)
    plan, settled = ce.forward.plan_for(x_cl, w, b, ops, cfg, True)
    assert len(timed) == 1 and type(plan) is ce.forward.LibraryForward and settled


def test_library_path_without_timing_when_measuring_is_off_or_on_cpu(monkeypatch, measured):
    """Measuring off: the library path in x's layout, untimed.  On CPU under ``auto`` (nothing
    patched) the library conv serves and nothing is timed either, so CPU tests keep their paths."""
    times, timed = measured
    x, w, b, ops, cfg = _inputs("conv2d-mul-leaky-gelu")
    if DEVICE == "cpu":
        plan, settled = ce.forward.plan_for(x, w, b, ops, cfg, False)
        assert type(plan) is ce.forward.LibraryForward and settled and not timed
    monkeypatch.setenv(impl_choice.MEASURE_ENV, "0")
    monkeypatch.setattr(ce.forward, "conv_impl", lambda *a: ("library", "the fused conv cannot serve it"))
    monkeypatch.setattr(ce.forward, "_times_library_layouts", lambda x: True)
    plan, settled = ce.forward.plan_for(x, w, b, ops, cfg, False)
    assert type(plan) is ce.forward.LibraryForward and settled
    assert all(not names for names in timed)


def test_through_the_op_in_training_and_inference(monkeypatch, interpreted):
    """The op with its forward forced to the channels-last plan: inference output in eager's
    layout; in training the library backward reads its saved state and gives eager's gradients."""
    monkeypatch.setenv(ce.CONV_IMPL_ENV, "library")
    built = []

    def forward_plan(x, weight, bias, operands, cfg, save):
        built.append(ce.forward.ChannelsLastLibraryForward(x, weight, bias, operands, cfg, save))
        return built[-1], True

    monkeypatch.setattr(ce.forward, "plan_for", forward_plan)
    x, w, b, ops, cfg = _inputs("conv2d-avg-pool-partial")
    config = cfg.to_json()
    leaves = [t.requires_grad_(True) for t in (x, w, b, *ops)]
    with torch.no_grad():
        out = ce.conv_epilogue(x, w, b, ops, config)
    want = ce.conv_epilogue_eager(x, w, b, ops, config)
    assert out.stride() == want.stride()
    assert compare("out", out, want.detach(), tol=1e-5) is None
    out = ce.conv_epilogue(x, w, b, ops, config)
    assert len(built) == 2, "the forced plan was not used"
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    ref = torch.autograd.grad(want, leaves, grad)
    for name, g, r in zip("x weight bias multiplier".split(), got, ref, strict=True):
        problem = compare(name, g, r, tol=1e-5)
        assert problem is None, problem
