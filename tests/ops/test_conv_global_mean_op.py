"""The ``conv_global_mean`` fused op: config, custom-op contract, gradients, dispatch, the seeds suite's
global-mean pipeline on GPU.

The oracle is the literal eager composite ``mean(affine(conv(x, W, b)))`` in float64 (summation order
differs from the op's, so fp32 results are compared to fp64 within 1e-5 relative).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.errors import KernelError, UnsupportedInputError
from fusion_backend.ir.specs import ConvSpec
from fusion_backend.kernels import host
from fusion_backend.ops import conv_global_mean as cgm
from fusion_backend.ops import failure
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef, apply_step
from fusion_backend.ops.conv_global_mean import (
    ConvGlobalMeanConfig,
    conv_global_mean,
    conv_global_mean_bwd,
    conv_global_mean_fwd,
    kernel_path,
)

K = PointwiseKind
CUDA = torch.cuda.is_available()


def spec2d(transposed: bool = True, groups: int = 1) -> ConvSpec:
    """A 2-d conv with every hyper-parameter non-trivial somewhere."""
    if transposed:
        return ConvSpec(True, (2, 1), (1, 0), (1, 2), (1, 0), groups)
    return ConvSpec(False, (2, 1), (1, 2), (1, 2), (0, 0), groups)


def eager(
    spec: ConvSpec,
    affine: tuple[ChainStep, ...],
    keepdim: bool,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    operands: list[torch.Tensor],
) -> torch.Tensor:
    """The literal composite the op replaces: conv, each affine step with torch semantics, mean."""
    nd = spec.spatial_dims
    if spec.transposed:
        conv = getattr(F, f"conv_transpose{nd}d")
        y = conv(x, w, b, spec.stride, spec.padding, spec.output_padding, spec.groups, spec.dilation)
    else:
        y = getattr(F, f"conv{nd}d")(x, w, b, spec.stride, spec.padding, spec.dilation, spec.groups)
    for step in affine:
        (op,) = step.operands
        y = apply_step(step.kind, y, [op.value if isinstance(op, Const) else operands[op.index]])
    return y.mean(dim=tuple(range(2, 2 + nd)), keepdim=keepdim)


def make_inputs(
    spec: ConvSpec,
    c_in: int,
    c_out: int,
    size: tuple[int, ...],
    kernel: tuple[int, ...],
    dtype=torch.float64,
    seed: int = 0,
):
    gen = torch.Generator().manual_seed(seed)
    g = spec.groups
    wshape = (c_in, c_out // g, *kernel) if spec.transposed else (c_out, c_in // g, *kernel)
    x = torch.randn((2, c_in, *size), generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(wshape, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn((c_out,), generator=gen, dtype=torch.float64).to(dtype)
    return x, w, b


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "") -> None:
    """``rtol`` relative to each element and, for near-zero elements, to the tensor's largest magnitude."""
    actual = actual.detach().to(device="cpu", dtype=torch.float64)
    expected = expected.detach().to(device="cpu", dtype=torch.float64)
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


def test_config_json_round_trips_canonically() -> None:
    cfg = ConvGlobalMeanConfig(
        spec2d(),
        (
            ChainStep(K.MUL, (TensorRef(0),)),
            ChainStep(K.RSUB, (Const(0.5),)),
            ChainStep(K.DIV, (TensorRef(1),)),
        ),
        keepdim=True,
        out_dtype="float32",
        strict=True,
    )
    text = cfg.to_json()
    assert " " not in text
    again = ConvGlobalMeanConfig.from_json(text)
    assert again == cfg and again.to_json() == text
    assert ConvGlobalMeanConfig.from_json(text) is again, "from_json is cached"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"affine": (ChainStep(K.RELU, ()),)}, "not per-channel affine"),
        ({"affine": (ChainStep(K.RDIV, (Const(1.0),)),)}, "not per-channel affine"),
        ({"out_dtype": "float99"}, "not a torch dtype"),
    ],
)
def test_config_rejects_non_affine_steps_and_bad_dtypes(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ConvGlobalMeanConfig(spec2d(), **kwargs)


def test_config_rejects_output_padding_on_regular_conv() -> None:
    with pytest.raises(ValueError, match="output_padding"):
        ConvGlobalMeanConfig(ConvSpec(False, (1,), (0,), (1,), (1,), 1))


# ------------------------------------------------------------------------------------------------
# Values and gradients against the eager composite (torch reference path, float64)
# ------------------------------------------------------------------------------------------------

AFFINES = {
    "none": ((), []),
    "scalar_const": ((ChainStep(K.MUL, (Const(-1.5),)), ChainStep(K.ADD, (Const(0.25),))), []),
    "zero_d": ((ChainStep(K.MUL, (TensorRef(0),)), ChainStep(K.SUB, (TensorRef(0),))), [()]),
    "per_channel": (
        (ChainStep(K.ADD, (TensorRef(0),)), ChainStep(K.MUL, (TensorRef(1),))),
        [("C", 1, 1), (1, "C", 1, 1)],
    ),
    "rsub_div": (
        (
            ChainStep(K.RSUB, (TensorRef(0),)),
            ChainStep(K.DIV, (TensorRef(1),)),
            ChainStep(K.DIV, (Const(3.0),)),
        ),
        [(1, 1, 1), ("C", 1, 1)],
    ),
    "shared_operand": (
        (ChainStep(K.MUL, (TensorRef(0),)), ChainStep(K.RSUB, (TensorRef(0),))),
        [("C", 1, 1)],
    ),
}


def make_operands(shapes, c_out: int, dtype=torch.float64, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        concrete = tuple(c_out if s == "C" else s for s in shape)
        # Away from zero: some operands divide.
        out.append((torch.rand(concrete, generator=gen, dtype=torch.float64) + 0.5).to(dtype))
    return out


@pytest.mark.parametrize("keepdim", [False, True], ids=["flat", "keepdim"])
@pytest.mark.parametrize("affine_name", sorted(AFFINES))
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_output_and_all_gradients_match_eager_float64(
    transposed: bool, affine_name: str, keepdim: bool
) -> None:
    spec = spec2d(transposed, groups=2)
    affine, shapes = AFFINES[affine_name]
    x, w, b = make_inputs(spec, 4, 6, (5, 7), (3, 2))
    operands = make_operands(shapes, 6)
    leaves = [t.requires_grad_() for t in (x, w, b, *operands)]
    config = ConvGlobalMeanConfig(spec, affine, keepdim=keepdim).to_json()

    got = conv_global_mean(x, w, b, operands, config)
    expected = eager(spec, affine, keepdim, x, w, b, operands)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)

    grad = torch.randn_like(expected)
    got_grads = torch.autograd.grad(got, leaves, grad)
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    names = ["x", "weight", "bias", *[f"operand{i}" for i in range(len(operands))]]
    for name, g, e in zip(names, got_grads, expected_grads, strict=True):
        assert g.shape == e.shape, name
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("nd", [1, 3])
def test_gradcheck_float64(nd: int) -> None:
    spec = (
        ConvSpec(True, (2,) * nd, (1,) * nd, (1,) * nd, (1,) * nd, 1)
        if nd == 1
        else ConvSpec(False, (2, 1, 1), (1, 0, 1), (1, 1, 2), (0, 0, 0), 1)
    )
    size = (5,) if nd == 1 else (3, 4, 5)
    x, w, b = make_inputs(spec, 2, 2, size, (3,) * nd)
    per_channel = torch.rand((2,) + (1,) * nd, dtype=torch.float64) + 0.5
    scalar = torch.rand((), dtype=torch.float64) + 0.5
    affine = (ChainStep(K.DIV, (TensorRef(0),)), ChainStep(K.RSUB, (TensorRef(1),)))
    config = ConvGlobalMeanConfig(spec, affine, keepdim=nd == 1).to_json()
    inputs = tuple(t.requires_grad_() for t in (x, w, b, per_channel, scalar))
    assert torch.autograd.gradcheck(lambda x, w, b, p, s: conv_global_mean(x, w, b, [p, s], config), inputs)


def test_no_bias_and_input_without_grad_skip_those_gradients() -> None:
    spec = spec2d(False)
    x, w, _ = make_inputs(spec, 3, 4, (6, 6), (2, 3))
    w.requires_grad_()
    config = ConvGlobalMeanConfig(spec).to_json()
    out = conv_global_mean(x, w, None, [], config)
    (gw,) = torch.autograd.grad(out.sum(), [w])
    (ew,) = torch.autograd.grad(eager(spec, (), False, x, w, None, []).sum(), [w])
    torch.testing.assert_close(gw, ew, rtol=1e-12, atol=1e-12)


def test_out_dtype_and_low_precision_inputs_on_reference_path() -> None:
    spec = spec2d(True)
    x, w, b = make_inputs(spec, 2, 3, (4, 5), (3, 3))
    config = ConvGlobalMeanConfig(spec, out_dtype="float32").to_json()
    expected = eager(spec, (), False, x, w, b, [])
    for dtype in (torch.bfloat16, torch.float16):
        got = conv_global_mean(x.to(dtype), w.to(dtype), b.to(dtype), [], config)
        assert got.dtype == torch.float32
        assert_close_scaled(got, expected, 2e-2, str(dtype))


def test_channels_last_input_matches_contiguous() -> None:
    spec = spec2d(False)
    x, w, b = make_inputs(spec, 3, 4, (6, 7), (3, 2))
    config = ConvGlobalMeanConfig(spec).to_json()
    xl = x.to(memory_format=torch.channels_last).requires_grad_()
    xc = x.clone().requires_grad_()
    out_l, out_c = conv_global_mean(xl, w, b, [], config), conv_global_mean(xc, w, b, [], config)
    torch.testing.assert_close(out_l, out_c, rtol=1e-13, atol=1e-13)
    gl, gc = torch.autograd.grad(out_l.sum(), xl)[0], torch.autograd.grad(out_c.sum(), xc)[0]
    torch.testing.assert_close(gl, gc, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(
    "shape",
    [(6,), (1, 6, 2, 1), (6, 2, 1)],
    ids=["flat", "wrong_rank_channel", "not_per_channel"],
)
def test_rejects_operands_that_are_not_per_channel(shape) -> None:
    spec = spec2d(False)
    x, w, b = make_inputs(spec, 2, 6, (5, 5), (2, 2))
    config = ConvGlobalMeanConfig(spec, (ChainStep(K.MUL, (TensorRef(0),)),)).to_json()
    with pytest.raises(UnsupportedInputError, match="per-channel"):
        conv_global_mean(x, w, b, [torch.ones(shape, dtype=torch.float64)], config)


def test_rejects_mismatched_weight() -> None:
    spec = spec2d(False)
    x, w, b = make_inputs(spec, 2, 4, (5, 5), (2, 2))
    with pytest.raises(UnsupportedInputError, match="does not match weight"):
        conv_global_mean(x[:, :1], w, b, [], ConvGlobalMeanConfig(spec).to_json())


# ------------------------------------------------------------------------------------------------
# Custom-op contract
# ------------------------------------------------------------------------------------------------


def test_opcheck_forward_and_backward_ops() -> None:
    spec = spec2d(True, groups=2)
    affine, shapes = AFFINES["per_channel"]
    x, w, b = make_inputs(spec, 4, 6, (4, 5), (3, 2))
    operands = make_operands(shapes, 6)
    config = ConvGlobalMeanConfig(spec, affine, keepdim=True).to_json()
    leaves = [t.requires_grad_() for t in (x, w, b, *operands)]
    torch.library.opcheck(conv_global_mean_fwd, (x, w, b, operands, config, True))
    detached = [t.detach() for t in (x, w, b, *operands)]
    torch.library.opcheck(conv_global_mean_fwd, (*detached[:3], detached[3:], config, False))  # no autograd: no save
    for keepdim in (False, True):
        plain = ConvGlobalMeanConfig(spec, keepdim=keepdim).to_json()
        torch.library.opcheck(conv_global_mean_fwd, (x, w, None, [], plain, True))

    _, tap_sums, conv_mean = conv_global_mean_fwd(
        *[t.detach() for t in leaves[:3]], [t.detach() for t in operands], config, True
    )
    assert tap_sums.shape == (2, 4, 3, 2) and conv_mean.shape == (2, 6)
    grad = torch.randn(2, 6, 1, 1, dtype=torch.float64)
    args = (
        grad,
        w.detach(),
        b.detach(),
        [t.detach() for t in operands],
        tap_sums,
        conv_mean,
        list(x.shape),
        list(x.stride()),
        x.dtype,
        config,
    )
    torch.library.opcheck(conv_global_mean_bwd, (*args, [True] * 5))  # every gradient
    torch.library.opcheck(conv_global_mean_bwd, (*args, [False, True, True, True, True]))  # no grad_x
    torch.library.opcheck(conv_global_mean_bwd, (*args, [True, False, False, True, False]))  # some of each


def test_compiles_with_dynamic_shapes_without_recompiling() -> None:
    spec = spec2d(True)
    affine, shapes = AFFINES["per_channel"]
    _, w, b = make_inputs(spec, 3, 4, (4, 5), (3, 2))
    operands = make_operands(shapes, 4)
    config = ConvGlobalMeanConfig(spec, affine, keepdim=True).to_json()

    def fn(x, w, b, p0, p1):
        return torch.logsumexp(conv_global_mean(x, w, b, [p0, p1], config), dim=1).sum()

    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, dynamic=True, fullgraph=True)
    for size in [(5, 7), (9, 11), (13, 6)]:
        x = torch.randn(2, 3, *size, dtype=torch.float64, requires_grad=True)
        got = compiled(x, w, b, *operands)
        (gx,) = torch.autograd.grad(got, [x])
        expected_fn = torch.logsumexp(eager(spec, affine, True, x, w, b, operands), dim=1).sum()
        (ex,) = torch.autograd.grad(expected_fn, [x])
        torch.testing.assert_close(got, expected_fn, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx, ex, rtol=1e-12, atol=1e-12)
    assert counter.frame_count == 1


# ------------------------------------------------------------------------------------------------
# Dispatch: kernel path, interpreter runs, failures
# ------------------------------------------------------------------------------------------------


def test_kernel_path_reports_why(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ConvGlobalMeanConfig(spec2d()).to_json()
    assert kernel_path(config, torch.float32, "cuda") == ("triton", None)
    assert kernel_path(config, torch.bfloat16, "cuda") == ("triton", None)
    path, why = kernel_path(config, torch.float64, "cuda")
    assert path == "reference" and "float64" in why
    monkeypatch.delenv(cgm.CPU_KERNELS_ENV, raising=False)
    path, why = kernel_path(config, torch.float32, "cpu")
    assert path == "reference" and cgm.CPU_KERNELS_ENV in why
    monkeypatch.setenv(cgm.CPU_KERNELS_ENV, "triton")
    monkeypatch.setattr(host, "INTERPRETER", True)  # as under TRITON_INTERPRET=1, on any machine
    assert kernel_path(config, torch.float16, "cpu") == ("triton", None)
    path, why = kernel_path(config, torch.bfloat16, "cpu")
    assert path == "reference" and "interpreter" in why


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_triton_path_forward_and_backward(
    dtype, channels_last, monkeypatch: pytest.MonkeyPatch, kernel_device: str
) -> None:
    monkeypatch.setenv(cgm.CPU_KERNELS_ENV, "triton")
    spec = spec2d(True, groups=2)
    affine, shapes = AFFINES["rsub_div"]
    x, w, b = make_inputs(spec, 4, 6, (6, 9), (3, 2))
    operands = make_operands(shapes, 6)
    config = ConvGlobalMeanConfig(spec, affine, keepdim=True, strict=True).to_json()
    leaves64 = [t.requires_grad_() for t in (x, w, b, *operands)]
    expected = eager(spec, affine, True, x, w, b, operands)
    # seeded: the global generator's state depends on which tests ran before (pytest-xdist orders them
    # differently), and an fp16 gradient's error depends on how much its sum cancels
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7), dtype=expected.dtype)
    expected_grads = torch.autograd.grad(expected, leaves64, grad)

    xd = x.detach().to(kernel_device, dtype)
    if channels_last:
        xd = xd.to(memory_format=torch.channels_last)
    leaves = [xd.requires_grad_()] + [
        t.detach().to(kernel_device, dtype).requires_grad_() for t in (w, b, *operands)
    ]
    import fusion_backend.kernels.global_mean as kernels

    launched: list[str] = []
    for name in LAUNCHERS:
        original = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, _f=original, _n=name, **k: launched.append(_n) or _f(*a, **k)
        )
    got = conv_global_mean(leaves[0], leaves[1], leaves[2], leaves[3:], config)
    assert got.dtype == dtype and got.device.type == kernel_device
    got_grads = torch.autograd.grad(got, leaves, grad.to(kernel_device, dtype))
    assert launched == list(LAUNCHERS), "forward and backward each take exactly two kernel launches"
    rtol = 1e-5 if dtype == torch.float32 else 5e-3
    assert_close_scaled(got, expected, rtol, "out")
    for name, g, e in zip(["x", "weight", "bias", "op0", "op1"], got_grads, expected_grads, strict=True):
        assert g.dtype == dtype and g.shape == e.shape
        assert_close_scaled(g, e, rtol, name)


#: The kernel launchers one forward + backward call goes through, in order (one Triton launch each).
LAUNCHERS = ("set_sums_partial", "contract_forward", "params_backward", "grad_broadcast")


def _count_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import fusion_backend.kernels.global_mean as kernels

    launched: list[str] = []
    for name in LAUNCHERS:
        original = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, _f=original, _n=name, **k: launched.append(_n) or _f(*a, **k)
        )
    return launched


def _kernel_parity(
    spec: ConvSpec,
    affine: tuple[ChainStep, ...],
    shapes: list,
    c_in: int,
    c_out: int,
    size: tuple[int, ...],
    kernel: tuple[int, ...],
    kernel_device: str,
    memory_format: torch.memory_format = torch.contiguous_format,
    bias: bool = True,
    keepdim: bool = False,
) -> list[torch.Tensor]:
    """Triton path (fp32) vs the fp64 eager composite: output and every gradient at 1e-5; returns the
    gradients (x's first)."""
    x, w, b = make_inputs(spec, c_in, c_out, size, kernel)
    b = b if bias else None
    operands = make_operands(shapes, c_out)
    leaves64 = [t.requires_grad_() for t in (x, w, *([b] if bias else []), *operands)]
    expected = eager(spec, affine, keepdim, x, w, b, operands)
    grad = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, leaves64, grad)
    xd = x.detach().to(kernel_device, torch.float32).contiguous(memory_format=memory_format).requires_grad_()
    rest = [t.detach().to(kernel_device, torch.float32).requires_grad_() for t in leaves64[1:]]
    wd, bd = rest[0], (rest[1] if bias else None)
    ops = rest[2:] if bias else rest[1:]
    config = ConvGlobalMeanConfig(spec, affine, keepdim=keepdim, strict=True).to_json()
    got = conv_global_mean(xd, wd, bd, ops, config)
    got_grads = torch.autograd.grad(got, [xd, *rest], grad.to(kernel_device, torch.float32))
    assert_close_scaled(got, expected, 1e-5, "out")
    for i, (g, e) in enumerate(zip(got_grads, expected_grads, strict=True)):
        assert g.shape == e.shape and g.dtype == torch.float32
        assert_close_scaled(g, e, 1e-5, f"grad {i}")
    return list(got_grads)


@pytest.mark.parametrize(
    "layout, split, tiles",
    [
        ("contiguous", 6, {}),  # all splits in one tile, one K chunk
        ("contiguous", 6, {"_CONTRACT_CHUNK": 16, "_CONTRACT_BLOCK_S": 2}),  # split loop, 2 K chunks
        ("channels_last", 20, {}),  # 20 > 16 splits: split loop
    ],
)
def test_contraction_sums_every_split_and_chunk_deterministically(
    layout: str, split: int, tiles: dict, monkeypatch: pytest.MonkeyPatch, kernel_device: str
) -> None:
    """The forward tail reduces many per-split partials over several K chunks: the same result as the
    fp64 composite, and bitwise the same on a second run (fixed-order sums, no atomics).  Small tiles
    force splits and chunks the test sizes would not otherwise get."""
    import fusion_backend.kernels.global_mean as kernels

    for name, value in {"_TILE_ELEMENTS": 32, "_MAX_BLOCK_W": 8, "_CL_TILE_ELEMENTS": 16, **tiles}.items():
        module = kernels.contract if name.startswith("_CONTRACT") else kernels.passes
        monkeypatch.setattr(module, name, value)
    original = kernels.set_sums_partial
    nsplits: list[int] = []

    def forced(*args, **kwargs):
        result = original(*args, **kwargs, split=split)
        nsplits.append(result[2])
        return result

    monkeypatch.setattr(kernels, "set_sums_partial", forced)
    spec = spec2d(True, groups=2)
    affine, shapes = AFFINES["rsub_div"]
    x, w, b = make_inputs(spec, 8, 6, (21, 13), (3, 2))
    operands = make_operands(shapes, 6)
    cfg = ConvGlobalMeanConfig(spec, affine, keepdim=False)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    xd = x.to(kernel_device, torch.float32).contiguous(memory_format=fmt)
    args = [t.to(kernel_device, torch.float32) for t in (w, b)]
    ops = [t.to(kernel_device, torch.float32) for t in operands]
    geo = cgm.config.geometry_for(spec, tuple(x.shape[2:]), tuple(w.shape[2:]), xd.device)
    assert geo.set_counts != (1, 1, 1), "the test needs several index sets (a tapset gather)"
    first = cgm.triton_path.forward(xd, *args, ops, cfg, True)
    second = cgm.triton_path.forward(xd, *args, ops, cfg, True)
    assert nsplits == [split, split], f"expected {split} splits of the pass over x, got {nsplits}"
    for name, a, c in zip(("out", "tap_sums", "mean"), first, second, strict=True):
        assert torch.equal(a, c), f"{name} differs between two identical runs"
    expected = cgm.reference.forward(x, w, b, operands, cfg, True)
    for name, got, exp in zip(("out", "tap_sums", "mean"), first, expected, strict=True):
        assert_close_scaled(got, exp, 1e-5, name)


@pytest.mark.parametrize(
    "affine_name", ["none", "scalar_const", "zero_d", "per_channel", "rsub_div", "shared_operand"]
)
def test_triton_path_folds_every_affine_chain(affine_name: str, monkeypatch, kernel_device: str) -> None:
    """Constant, 0-d, per-channel and shared operands: the chain runs inside the two small kernels."""
    monkeypatch.setenv(cgm.CPU_KERNELS_ENV, "triton")
    launched = _count_launches(monkeypatch)
    affine, shapes = AFFINES[affine_name]
    _kernel_parity(spec2d(True, groups=2), affine, shapes, 4, 6, (5, 7), (3, 2), kernel_device, keepdim=True)
    assert launched == list(LAUNCHERS)


@pytest.mark.parametrize(
    "spec, size, kernel",
    [
        (ConvSpec(False, (2,), (1,), (2,), (0,), 1), (11,), (3,)),
        (ConvSpec(True, (2, 1, 1), (1, 0, 1), (1, 1, 2), (1, 0, 0), 2), (3, 4, 5), (2, 3, 2)),
        (ConvSpec(False, (1, 1), (1, 1), (1, 1), (0, 0), 1), (6, 5), (3, 3)),
    ],
    ids=["conv1d", "convT3d_groups", "conv2d_same"],
)
def test_triton_path_1d_3d_groups_no_bias(spec, size, kernel, monkeypatch, kernel_device: str) -> None:
    monkeypatch.setenv(cgm.CPU_KERNELS_ENV, "triton")
    affine, shapes = AFFINES["per_channel"]
    shapes = [(s[0], *([1] * len(size))) if s[0] == "C" else (1, "C", *([1] * len(size))) for s in shapes]
    _kernel_parity(spec, affine, shapes, 4, 6, size, kernel, kernel_device, bias=False)


@pytest.mark.parametrize("nd", [2, 3])
def test_channels_last_input_reads_in_place_and_grad_x_keeps_its_layout(
    nd: int, monkeypatch: pytest.MonkeyPatch, kernel_device: str
) -> None:
    """channels_last x takes the channels-innermost kernels (no copy of x) and grad_x comes back in
    x's memory format, with the strides eager autograd gives."""
    import fusion_backend.kernels.global_mean as kernels

    monkeypatch.setenv(cgm.CPU_KERNELS_ENV, "triton")
    fmt = torch.channels_last if nd == 2 else torch.channels_last_3d
    spec = spec2d(True, groups=2) if nd == 2 else ConvSpec(False, (1, 2, 1), (1, 0, 1), (1, 1, 1), (0, 0, 0), 2)
    size, kernel = ((6, 9), (3, 2)) if nd == 2 else ((3, 5, 4), (2, 3, 2))
    seen: list[bool] = []
    original = kernels.passes.channels_innermost_meta
    monkeypatch.setattr(kernels.passes, "channels_innermost_meta", lambda *a: seen.append(original(*a)) or seen[-1])
    kernels.passes.plan_set_sums.cache_clear()  # launch plans are cached per shape: make both passes plan anew
    kernels.passes.plan_broadcast.cache_clear()
    affine, shapes = AFFINES["rsub_div"]
    shapes = [tuple(1 if s == 1 else s for s in shape[:1]) + (1,) * nd if shape[0] == "C" else (1,) * (nd + 1)
              for shape in shapes]
    grads = _kernel_parity(spec, affine, shapes, 4, 6, size, kernel, kernel_device, memory_format=fmt)
    assert seen == [True, True], "both passes over x-sized data use the channels-innermost kernels"
    grad_x = grads[0]
    assert grad_x.is_contiguous(memory_format=fmt) and not grad_x.is_contiguous()
    x, w, b = make_inputs(spec, 4, 6, size, kernel, dtype=torch.float32)
    x = x.contiguous(memory_format=fmt).requires_grad_()
    eager_grad = torch.autograd.grad(eager(spec, (), False, x, w, b, []).sum(), x)[0]
    assert grad_x.stride() == eager_grad.stride() == x.stride()


def test_kernel_failure_raises_when_strict_else_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import fusion_backend.kernels.global_mean as kernels

    def broken(*args, **kwargs):
        raise RuntimeError("simulated launch failure")

    monkeypatch.setenv(cgm.CPU_KERNELS_ENV, "triton")
    monkeypatch.setattr(host, "INTERPRETER", True)  # the CPU routing only: the launch itself is replaced
    monkeypatch.setattr(kernels, "set_sums_partial", broken)
    monkeypatch.setattr(failure, "_warned", set())
    spec = spec2d(False)
    x, w, b = make_inputs(spec, 2, 3, (5, 6), (2, 2), dtype=torch.float32)

    strict = ConvGlobalMeanConfig(spec, strict=True).to_json()
    with pytest.raises(
        KernelError, match=r"conv_global_mean_fwd.*\(2, 2, 5, 6\).*float32.*simulated launch failure"
    ):
        conv_global_mean(x, w, b, [], strict)

    lenient = ConvGlobalMeanConfig(spec).to_json()
    with pytest.warns(RuntimeWarning, match="Falling back to the plain-torch reference"):
        got = conv_global_mean(x, w, b, [], lenient)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        conv_global_mean(x, w, b, [], lenient)
    assert_close_scaled(got, eager(spec, (), False, x.double(), w.double(), b.double(), []), 1e-5)


def test_too_many_index_sets_use_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 1-d kernel of width 40 with padding 20 gives 40 distinct index sets: more than an int32 table.
    monkeypatch.setenv(cgm.CPU_KERNELS_ENV, "triton")
    monkeypatch.setattr(host, "INTERPRETER", True)  # the table is refused before any kernel runs
    monkeypatch.setattr(failure, "_warned", set())
    spec = ConvSpec(False, (1,), (20,), (1,), (0,), 1)
    x, w, b = make_inputs(spec, 1, 2, (45,), (40,), dtype=torch.float32)
    config = ConvGlobalMeanConfig(spec, strict=True).to_json()
    with pytest.warns(RuntimeWarning, match="distinct tap index sets"):
        got = conv_global_mean(x, w, b, [], config)
    assert_close_scaled(got, eager(spec, (), False, x.double(), w.double(), b.double(), []), 1e-5)


# ------------------------------------------------------------------------------------------------
# GPU: the seeds suite's global-mean pipeline at full size, and its small variant
# ------------------------------------------------------------------------------------------------


class GlobalMeanPipeline(torch.nn.Module):
    """ConvTranspose2d -> mean(2,3, keepdim) -> +bias -> logsumexp(1, keepdim) -> sum(2,3) -> *10."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = torch.nn.ConvTranspose2d(c_in, c_out, 3)
        self.bias = torch.nn.Parameter(torch.randn(c_out, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = torch.mean(x, dim=(2, 3), keepdim=True)
        x = x + self.bias
        x = torch.logsumexp(x, dim=1, keepdim=True)
        x = torch.sum(x, dim=(2, 3))
        return x * 10.0

    def fused(self, x: torch.Tensor, out_dtype: str | None = None) -> torch.Tensor:
        """The same function through the fused op (the +bias folded as an affine step)."""
        spec = ConvSpec(True, (1, 1), (0, 0), (1, 1), (0, 0), 1)
        config = ConvGlobalMeanConfig(
            spec, (ChainStep(K.ADD, (TensorRef(0),)),), keepdim=True, out_dtype=out_dtype
        )
        y = conv_global_mean(x, self.conv.weight, self.conv.bias, [self.bias], config.to_json())
        return torch.sum(torch.logsumexp(y, dim=1, keepdim=True), dim=(2, 3)) * 10.0


def _global_mean_pipeline_parity(c_in: int, c_out: int, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = GlobalMeanPipeline(c_in, c_out).cuda()
    x = torch.rand(shape, device="cuda")
    params = [model.conv.weight, model.conv.bias, model.bias]

    # fp64 eager oracle on the GPU.
    ref_model = GlobalMeanPipeline(c_in, c_out).cuda().double()
    ref_model.load_state_dict(model.state_dict())
    x64 = x.double().requires_grad_()
    ref = ref_model(x64)
    grad = torch.randn_like(ref)
    ref_params = [ref_model.conv.weight, ref_model.conv.bias, ref_model.bias]
    ref_grads = torch.autograd.grad(ref, [x64, *ref_params], grad)
    del x64
    torch.cuda.empty_cache()
    names = ["out", "x", "conv.weight", "conv.bias", "bias"]

    # fp32 through the Triton path: 1e-5 relative.
    x32 = x.clone().requires_grad_()
    out = model.fused(x32)
    grads = torch.autograd.grad(out, [x32, *params], grad.float())
    for name, g, e in zip(names, [out, *grads], [ref, *ref_grads], strict=True):
        assert_close_scaled(g, e, 1e-5, f"fp32 {name}")
    del x32, grads

    # bf16 (x, conv weight and bias in bf16, the folded bias in fp32 as under autocast): 1e-2.
    xb = x.bfloat16().requires_grad_()
    wb = model.conv.weight.detach().bfloat16().requires_grad_()
    bb = model.conv.bias.detach().bfloat16().requires_grad_()
    spec = ConvSpec(True, (1, 1), (0, 0), (1, 1), (0, 0), 1)
    config = ConvGlobalMeanConfig(
        spec, (ChainStep(K.ADD, (TensorRef(0),)),), keepdim=True, out_dtype="float32"
    )
    y = conv_global_mean(xb, wb, bb, [model.bias], config.to_json())
    assert y.dtype == torch.float32
    out_b = torch.sum(torch.logsumexp(y, dim=1, keepdim=True), dim=(2, 3)) * 10.0
    grads_b = torch.autograd.grad(out_b, [xb, wb, bb, model.bias], grad.float())
    for name, g, e in zip(names, [out_b, *grads_b], [ref, *ref_grads], strict=True):
        assert_close_scaled(g, e, 1e-2, f"bf16 {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_global_mean_pipeline_small_matches_eager_on_gpu() -> None:
    _global_mean_pipeline_parity(3, 16, (128, 3, 32, 32))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_global_mean_pipeline_full_size_matches_eager_on_gpu() -> None:
    _global_mean_pipeline_parity(64, 128, (16, 64, 512, 512))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_kernels_are_deterministic_and_fp16_close() -> None:
    spec = ConvSpec(False, (2, 2), (1, 1), (1, 1), (0, 0), 1)
    x, w, b = make_inputs(spec, 8, 16, (67, 45), (3, 3), dtype=torch.float32)
    x, w, b = x.cuda().requires_grad_(), w.cuda(), b.cuda()
    config = ConvGlobalMeanConfig(spec, strict=True).to_json()
    first = conv_global_mean(x, w, b, [], config)
    g1 = torch.autograd.grad(first.sum(), [x])[0]
    second = conv_global_mean(x, w, b, [], config)
    g2 = torch.autograd.grad(second.sum(), [x])[0]
    assert torch.equal(first, second) and torch.equal(g1, g2)
    expected = eager(spec, (), False, x.double(), w.double(), b.double(), [])
    assert_close_scaled(first, expected, 1e-5, "fp32")
    half = conv_global_mean(x.half(), w.half(), b.half(), [], config)
    assert_close_scaled(half, expected, 5e-3, "fp16")


@pytest.mark.heavy
@pytest.mark.xdist_group("gpu_full_size")  # on a GPU it runs the full-size pipeline: with the other full-size tests
def test_every_cuda_kernel_compiles_for_sm90_without_spills(sm90_compile_check) -> None:
    """The kernels are on the global-mean pipeline's default path: one that runs under the interpreter
    but fails to compile for the GPU would silently fall back to the torch reference.  Compiles each
    of them for sm_90 (ConvTranspose2d 64->128 on 16x64x512x512, and the padded grouped Conv2d) with
    ``tools/compile_check.py global_mean`` on three of its six cases, which take each dtype, each layout
    and the padded branch at least once (in the suite's one compile-check process:
    ``conftest.SM90_COMPILE_CASES``).  NOTE: 12 of the job's 21 specialisations, 19.6 s against 28.2
    s for all six cases on the 2-core CPU box (``time python tools/compile_check.py global_mean [--cases
    ...]``, cold Triton cache)."""
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell").exists():
        pytest.skip("Triton's bundled ptxas-blackwell is missing")
    out = sm90_compile_check("global_mean")
    assert "_contract_fwd_kernel" in out and "global_mean: all kernels compiled without spills" in out, out


def test_the_backward_keeps_no_reference_to_x() -> None:
    """Declared ``keeps_x=False``: autograd saves x's size, strides and dtype, never x itself, on the
    custom-op path and on the direct one, and grad_x still comes back in x's layout."""
    from fusion_backend.ops.direct_impls import direct_impl

    spec = spec2d(True)
    x, w, b = make_inputs(spec, 2, 3, (5, 6), (3, 2))
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    w.requires_grad_()
    config = ConvGlobalMeanConfig(spec).to_json()
    for fn in (conv_global_mean, direct_impl(conv_global_mean)):
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor, seen: list[torch.Tensor] = saved) -> torch.Tensor:
            seen.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x, w, b, [], config)
        assert saved and all(t.data_ptr() != x.data_ptr() for t in saved)
        gx, gw = torch.autograd.grad(out.sum(), [x, w])
        assert gx.stride() == x.stride() and gw.shape == w.shape


def test_a_call_the_kernels_cannot_serve_raises_under_strict_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels cannot serve a call's shapes (more index sets than a table holds), the call
    runs the reference with a warning, except under strict on CUDA: it raises, as every declared op does."""
    spec = ConvSpec(False, (1,), (20,), (1,), (0,), 1)
    x, w, _ = make_inputs(spec, 1, 2, (45,), (40,), dtype=torch.float32)
    monkeypatch.setattr(failure, "_warned", set())
    for strict in (True, False):
        config = ConvGlobalMeanConfig(spec, strict=strict).to_json()
        cfg = ConvGlobalMeanConfig.from_json(config)
        cuda = torch.device("cuda")  # only the device type is read: no CUDA tensor is made
        if strict:
            with pytest.raises(UnsupportedInputError, match="distinct tap index sets"):
                cgm.CONV_GLOBAL_MEAN._serves(config, cfg, x, w, cuda)
        else:
            with pytest.warns(RuntimeWarning, match="distinct tap index sets"):
                assert not cgm.CONV_GLOBAL_MEAN._serves(config, cfg, x, w, cuda)
