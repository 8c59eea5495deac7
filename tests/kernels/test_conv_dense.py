"""The dense stride-1 conv forward (``kernels/conv_dense.py``) against a float64 torch reference.

Without CUDA the kernels run under Triton's interpreter (``conftest``), so shapes are small; the
shapes are odd on purpose (partial tiles, tiles that cross image rows, channel counts that are not
multiples of the blocks).  Reference: ``conv{1,2}d`` in float64 of the operands rounded to the compute
dtype, the conv output and the bias rounded to the compute dtype (the kernel's storage rule), then the
chain in float64.  Outputs are poisoned with NaN before each run, and NaN/inf positions must match
exactly, so an unwritten element or a NaN/inf leaking across an image row (the kernel walks H and W
as one flattened axis) fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion_backend import environment
from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.kernels import conv_dense
from fusion_backend.kernels.chain_math import OP_CODES
from fusion_backend.kernels.epilogue import build_params
from fusion_backend.testing import stable_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MUL, LEAKY, GELU, ADD, RELU = (OP_CODES[k] for k in ("mul", "leaky_relu", "gelu", "add", "relu"))


def _geometry(nd: int, padding) -> ConvSpec:  # noqa: ANN001
    pad = tuple(padding) if isinstance(padding, tuple) else (padding,) * nd
    return ConvSpec(False, (1,) * nd, pad, (1,) * nd, (0,) * nd, 1)


def _chain(kind: str, cout: int, g: torch.Generator):
    """``(steps for the kernel, float64 reference function)``.  ``mul_leaky_gelu``: per-channel
    multiplier with negative values -> leaky_relu(0.01) -> gelu; ``scalar``: + a one-element tensor
    -> * a Python number -> relu -> leaky_relu(0.2)."""
    if kind == "mul_leaky_gelu":
        m = torch.randn(cout, 1, 1, generator=g)
        m[0] = -abs(m[0]) - 0.5

        def ref(v):
            v = v * m.double().view(1, -1, *([1] * (v.dim() - 2)))
            return F.gelu(torch.where(v > 0, v, v * 0.01))

        return [(MUL, [m.to(DEVICE)]), (LEAKY, [0.01]), (GELU, [])], ref
    s = torch.randn(1, generator=g)

    def ref(v):
        v = torch.relu((v + s.double()) * -1.5)
        return torch.where(v > 0, v, v * 0.2)

    return [(ADD, [s.to(DEVICE)]), (MUL, [-1.5]), (RELU, []), (LEAKY, [0.2])], ref


def _reference(x, w, b, chain_ref, padding, compute):  # noqa: ANN001
    """(out, conv output without bias), float64 on the CPU, as the kernel defines them."""
    xr, wr = x.cpu().to(compute).double(), w.cpu().to(compute).double()
    conv = F.conv1d if x.dim() == 3 else F.conv2d
    y = conv(xr, wr, None, padding=padding).to(compute).double()
    v = y if b is None else y + b.cpu().to(compute).double().view(1, -1, *([1] * (y.dim() - 2)))
    return chain_ref(v), y


def _check(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    got = got.cpu().double()
    assert got.shape == want.shape, what
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN positions differ"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), f"{what}: inf positions/signs"
    keep = want.isfinite()
    scale = want[keep].abs().max().item() if keep.any() else 1.0
    err = (got[keep] - want[keep]).abs() - tol * want[keep].abs()
    assert err.numel() == 0 or err.max().item() <= tol * scale, f"{what}: max |diff| {err.max().item()}"


def _run(x, w, b, steps, geo, out_like, save, compute=None, out_format=None):  # noqa: ANN001
    out = torch.full(
        out_like, float("nan"), device=DEVICE, dtype=x.dtype if compute is None else torch.float32
    )
    if out_format is not None:
        out = out.contiguous(memory_format=out_format)
    saved = None
    if save:
        saved = torch.full(out_like, float("nan"), device=DEVICE, dtype=compute or x.dtype)
    conv_dense.conv_dense_forward(x, w, b, steps, geo, None, out, saved, compute_dtype=compute)
    return out, saved


# name, x shape, weight shape, padding, options
CASES = [
    ("pad0-odd-sizes-partial-tiles", (2, 5, 9, 13), (7, 5, 3, 3), 0, {}),
    ("pad1-rows-crossing-tiles", (2, 5, 7, 10), (6, 5, 3, 3), 1, {"chain": "scalar"}),
    ("pad2-wider-than-same-relayout", (1, 3, 6, 11), (4, 3, 3, 3), 2, {"bias": False}),
    ("asym-pad-kw5-one-tap-per-step", (2, 4, 7, 9), (3, 4, 3, 5), (1, 2), {}),
    ("kw2-even-kernel", (1, 3, 6, 9), (5, 3, 2, 2), (1, 0), {"chain": "scalar"}),
    ("cout70-two-channel-blocks-cin20", (1, 20, 4, 7), (70, 20, 3, 3), 1, {}),
    ("conv1d", (3, 4, 19), (5, 4, 3), 1, {}),
    ("conv1d-kw7", (2, 3, 17), (4, 3, 7), 3, {"bias": False}),
    ("channels-last-x-and-out", (2, 6, 5, 7), (5, 6, 3, 3), 1, {"channels_last": True}),
    ("sliced-x-along-w-strided-weight", (2, 4, 6, 9), (5, 4, 3, 3), 1, {"slice_w": True, "w_strided": True}),
    ("transposed-hw-view-relayout", (1, 3, 5, 8), (4, 3, 3, 3), 1, {"hw_transposed": True}),
]  # fmt: skip


def _inputs(xs, ws, opts, dtype, g):  # noqa: ANN001
    if opts.get("slice_w"):  # x is a window of a wider tensor whose other columns hold NaN
        full = torch.randn(*xs[:-1], xs[-1] + 3, generator=g)
        full[..., 0] = float("nan")
        full[..., -2:] = float("inf")
        x = full.to(DEVICE, dtype)[..., 1 : 1 + xs[-1]]
    elif opts.get("hw_transposed"):
        x = torch.randn(*xs[:2], xs[3], xs[2], generator=g).to(DEVICE, dtype).transpose(2, 3)
    else:
        x = torch.randn(xs, generator=g).to(DEVICE, dtype)
    if opts.get("channels_last"):
        x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(ws, generator=g) * 0.3).to(DEVICE, dtype)
    if opts.get("w_strided"):  # same values, (C_out, C_in) swapped in memory
        w = w.transpose(0, 1).contiguous().transpose(0, 1)
    b = torch.randn(ws[0], generator=g).to(DEVICE) if opts.get("bias", True) else None
    return x, w, b


@pytest.mark.parametrize("save", [False, True], ids=["infer", "save"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dense_conv_matches_float64_reference_fp32(case, save):
    name, xs, ws, padding, opts = case
    g = torch.Generator().manual_seed(stable_seed(name) % 1000 + save)
    x, w, b = _inputs(xs, ws, opts, torch.float32, g)
    steps, chain_ref = _chain(opts.get("chain", "mul_leaky_gelu"), ws[0], g)
    geo = _geometry(len(xs) - 2, padding)
    want, want_y = _reference(x, w, b, chain_ref, padding, torch.float32)
    fmt = torch.channels_last if opts.get("channels_last") else None
    out, saved = _run(x, w, b, steps, geo, want.shape, save, out_format=fmt)
    assert out.is_contiguous(memory_format=fmt or torch.contiguous_format)
    _check(out, want, 1e-5, f"{name} out")
    if save:
        _check(saved, want_y, 1e-5, f"{name} saved conv output")


@pytest.mark.parametrize(
    "name,x_dtype,compute",
    [
        ("pad1-rows-crossing-tiles", torch.float16, None),
        ("pad0-odd-sizes-partial-tiles", torch.float16, None),
        ("pad1-rows-crossing-tiles", torch.float32, torch.float16),
        ("asym-pad-kw5-one-tap-per-step", torch.float32, torch.float16),
    ],
)
def test_half_operands_match_reference_of_rounded_operands(name, x_dtype, compute):
    """fp16 x, and fp32 x/weight with ``compute_dtype=float16`` (the autocast case: the kernel
    rounds the operands as it loads them); the saved conv output is in the compute dtype."""
    _, xs, ws, padding, opts = next(c for c in CASES if c[0] == name)
    g = torch.Generator().manual_seed(7)
    x, w, b = _inputs(xs, ws, opts, x_dtype, g)
    steps, chain_ref = _chain("mul_leaky_gelu", ws[0], g)
    want, want_y = _reference(x, w, b, chain_ref, padding, compute or x_dtype)
    out, saved = _run(x, w, b, steps, _geometry(len(xs) - 2, padding), want.shape, True, compute=compute)
    assert saved.dtype == (compute or x_dtype)
    tol = 2e-3 if out.dtype == torch.float16 else 1e-5  # fp32 out: only the accumulation order differs
    _check(out, want, tol, f"{name} out")
    _check(saved, want_y, 1e-3, f"{name} saved conv output")


@pytest.mark.parametrize("padding", [0, 1])
def test_nan_and_inf_reach_exactly_the_outputs_whose_windows_hold_them(padding):
    """Non-finite inputs in the first and last columns and rows: the flattened walk must not carry
    them into the neighbouring row's outputs (the padded-column terms are dropped, not multiplied)."""
    g = torch.Generator().manual_seed(11 + padding)
    x = torch.randn(2, 3, 7, 9, generator=g)
    x[0, 1, 2, 8] = float("nan")  # last column
    x[0, 2, 4, 0] = float("inf")  # first column
    x[1, 0, 0, 4] = float("-inf")  # first row
    x[1, 1, 6, 8] = float("nan")  # last element of the plane
    w = torch.rand(4, 3, 3, 3, generator=g) + 0.1  # positive: an inf keeps its sign through the conv
    b = torch.randn(4, generator=g)
    steps = [(MUL, [torch.tensor(0.5).to(DEVICE)]), (LEAKY, [0.01])]

    def chain_ref(v):
        v = v * 0.5
        return torch.where(v > 0, v, v * 0.01)

    x, w, b = x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)
    want, want_y = _reference(x, w, b, chain_ref, padding, torch.float32)
    assert want.isnan().any() and want.isinf().any()
    out, saved = _run(x, w, b, steps, _geometry(2, padding), want.shape, True)
    _check(out, want, 1e-5, "out")
    _check(saved, want_y, 1e-5, "saved conv output")


def test_int64_index_path_matches(monkeypatch):
    monkeypatch.setattr(conv_dense, "_BIG_INDEX_THRESHOLD", 0)  # BIG on small tensors (part of the plan key)
    name, xs, ws, padding, opts = next(c for c in CASES if c[0] == "pad1-rows-crossing-tiles")
    g = torch.Generator().manual_seed(5)
    x, w, b = _inputs(xs, ws, opts, torch.float32, g)
    steps, chain_ref = _chain("mul_leaky_gelu", ws[0], g)
    geo = _geometry(2, padding)
    want, want_y = _reference(x, w, b, chain_ref, padding, torch.float32)
    out, saved = _run(x, w, b, steps, geo, want.shape, True)
    launch = conv_dense.forward_launch(x, w, b, steps, geo, None, out, saved)
    assert launch.constexprs["BIG"]
    _check(out, want, 1e-5, "out")
    _check(saved, want_y, 1e-5, "saved")


def test_launch_plan_contract_and_cache():
    """``forward_launch`` has ``conv_fused.forward_launch``'s contract: a cached plan with ``cout``,
    ``transposed`` and ``run(x, weight, params, bias, out, saved_y0, saved_winner)``; None for an empty output."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 5, 6, generator=g).to(DEVICE)
    w = torch.randn(4, 3, 3, 3, generator=g).to(DEVICE)
    geo = _geometry(2, 1)
    steps = [(RELU, [])]
    out = torch.full((1, 4, 5, 6), float("nan"), device=DEVICE)
    plan = conv_dense.forward_launch(x, w, None, steps, geo, None, out)
    assert plan.cout == 4 and plan.transposed is False
    assert conv_dense.forward_launch(x, w, None, steps, geo, None, out) is plan
    plan.run(x, w, build_params(steps, None, 4, x.device), None, out, None, None)
    torch.testing.assert_close(out.cpu(), torch.relu(F.conv2d(x, w, padding=1)).cpu(), rtol=1e-5, atol=1e-5)
    empty = torch.empty(0, 4, 5, 6, device=DEVICE)
    assert conv_dense.forward_launch(x[:0], w, None, steps, geo, None, empty) is None
    with pytest.raises(ValueError, match="out must have shape"):
        conv_dense.forward_launch(x, w, None, steps, geo, None, out[..., :5])


def test_unsupported_reason_names_each_limit():
    x, w = torch.zeros(1, 4, 8, 8), torch.zeros(4, 4, 3, 3)
    ok = _geometry(2, 1)
    assert conv_dense.unsupported_reason(x, w, ok, None) is None
    assert conv_dense.unsupported_reason(x[:, :, 0], w[:, :, 0], _geometry(1, 0), None) is None

    def geo(**kw):
        base = dict(
            transposed=False, stride=(1, 1), padding=(0, 0), dilation=(1, 1), output_padding=(0, 0), groups=1
        )
        return ConvSpec(**{**base, **kw})

    assert "stride" in conv_dense.unsupported_reason(x, w, geo(stride=(2, 2)), None)
    assert "groups" in conv_dense.unsupported_reason(x, torch.zeros(4, 2, 3, 3), geo(groups=2), None)
    assert "dilation" in conv_dense.unsupported_reason(x, w, geo(dilation=(2, 1)), None)
    assert "transposed" in conv_dense.unsupported_reason(x, w, geo(transposed=True), None)
    pool = PoolSpec("max", (2, 2), (2, 2), (0, 0))
    assert "pool" in conv_dense.unsupported_reason(x, w, ok, pool, True)
    x3, w3 = torch.zeros(1, 4, 4, 4, 4), torch.zeros(4, 4, 3, 3, 3)
    assert "1d/2d" in conv_dense.unsupported_reason(
        x3, w3, ConvSpec(False, (1,) * 3, (0,) * 3, (1,) * 3, (0,) * 3, 1), None
    )
    assert "float64" in conv_dense.unsupported_reason(x.double(), w.double(), ok, None)
    assert "empty conv output" in conv_dense.unsupported_reason(
        torch.zeros(1, 4, 2, 2), w, _geometry(2, 0), None
    )
    with pytest.raises(ValueError, match="stride"):
        conv_dense.forward_launch(x, w, None, [], geo(stride=(2, 2)), None, torch.empty(1, 4, 3, 3))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "x_dtype,compute,tf32",
    [(torch.float32, None, True), (torch.bfloat16, None, False), (torch.float32, torch.bfloat16, False)],
)
def test_gpu_tensor_core_paths_match_reference(x_dtype, compute, tf32):
    """TF32 and bf16 (not interpretable): a mid-size Conv2d 64->64 k3 like the seeds suite's,
    norm-wise relative error."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 64, 40, 72, generator=g).to(DEVICE, x_dtype)
    w = (torch.randn(64, 64, 3, 3, generator=g) * 0.05).to(DEVICE, x_dtype)
    b = torch.randn(64, generator=g).to(DEVICE)
    steps, chain_ref = _chain("mul_leaky_gelu", 64, g)
    ctype = compute or x_dtype
    want, want_y = _reference(
        x.float(), w.float(), b, chain_ref, 1, ctype if ctype != torch.float32 else torch.float32
    )
    out = torch.full(want.shape, float("nan"), device=DEVICE)
    saved = torch.full(want.shape, float("nan"), device=DEVICE, dtype=ctype)
    conv_dense.conv_dense_forward(
        x, w, b, steps, _geometry(2, 1), None, out, saved, allow_tf32=tf32, compute_dtype=compute
    )
    rel = ((out.double().cpu() - want).norm() / want.norm()).item()
    assert rel < (2e-3 if tf32 else 1e-2 if ctype == torch.bfloat16 else 1e-5), rel
    rel_y = ((saved.double().cpu() - want_y).norm() / want_y.norm()).item()
    assert rel_y < (2e-3 if tf32 else 1e-2), rel_y


def test_the_probe_binds_the_first_fitting_tile_and_matches_the_plan(monkeypatch):
    """``_Launch.probe`` (what the op's plan screens with): the tile ``_fitting`` puts first when the
    plan autotunes (on CUDA), the heuristic one otherwise; same results as the plan."""
    monkeypatch.setattr(conv_dense, "_AUTOTUNE_MIN_MACS", 0)
    monkeypatch.setenv(environment.CONV_AUTOTUNE, "1")  # the suite turns tuning off
    monkeypatch.setattr(conv_dense, "_LAUNCHES", type(conv_dense._LAUNCHES)(256))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 16, 9, 10, generator=g).to(DEVICE)
    w = torch.randn(8, 16, 3, 3, generator=g).to(DEVICE)
    steps, geo = [(RELU, [])], _geometry(2, 1)
    out, probed = (torch.full((2, 8, 9, 10), float("nan"), device=DEVICE) for _ in range(2))
    plan = conv_dense.forward_launch(x, w, None, steps, geo, None, out)
    probe = plan.probe()
    assert probe is not plan and probe.fast is not None
    if torch.cuda.is_available():
        first = conv_dense._fitting(conv_dense._configs(), plan.constexprs["BLOCK_N"], plan.constexprs["KWG"],
                                    plan.constexprs["CIN_PAD"], plan.constexprs["ALIGN"], 4, 4)[0]
        assert probe.first_tile == dict(first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)
    params = build_params(steps, None, 8, x.device)
    plan.run(x, w, params, None, out, None, None)
    probe.run(x, w, params, None, probed, None, None)
    torch.testing.assert_close(probed.cpu(), out.cpu(), rtol=1e-5, atol=1e-5)
