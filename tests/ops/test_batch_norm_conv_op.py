"""The ``batch_norm_conv`` fused op: config, output and every gradient (x, the conv weight and bias, the
norm's weight and bias) against float64, the running statistics, each pass's two implementations
(``FUSION_CONV_IMPL=family`` / ``library``), 1-3d, strides, dilation, groups, depthwise, every
activation, affine or not, NCHW and channels-last, fp16, NaN, an empty batch, bad input and the
failure policy.

The oracle is the literal eager composite (``F.batch_norm(training=True)``, the activation, the conv)
in float64; the op may be off from it by ``max(tol, 2 x eager's own error)``
(``fusion_backend.testing.compare``).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.errors import KernelError, UnsupportedInputError
from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops.batch_norm_conv import BatchNormConvConfig, batch_norm_conv, kernel_path
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind
from fusion_backend.testing import compare

K = PointwiseKind
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.usefixtures("exact_fp32"),
]

ACTS = {"none": (), "relu": (ChainStep(K.RELU),), "leaky": (ChainStep(K.LEAKY_RELU, (Const(0.2),)),),
        "gelu": (ChainStep(K.GELU),), "silu": (ChainStep(K.SILU),)}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One region: the conv's geometry, the activation, the norm's affine, the conv bias, the layout."""

    c_in: int
    c_out: int
    size: tuple[int, ...]
    k: int = 3
    stride: int = 1
    padding: int = 1
    dilation: int = 1
    groups: int = 1
    act: str = "relu"
    affine: bool = True
    bias: bool = False
    channels_last: bool = True

    @property
    def spec(self) -> ConvSpec:
        d = len(self.size)
        return ConvSpec(False, (self.stride,) * d, (self.padding,) * d, (self.dilation,) * d, (0,) * d, self.groups)

    def config(self, **kw) -> BatchNormConvConfig:
        return BatchNormConvConfig(self.spec, eps=1e-3, momentum=0.3, weight=0 if self.affine else None,
                                   bias=1 if self.affine else None, act=ACTS[self.act], **kw)  # fmt: skip


CASES = {
    "2d_3x3_relu_channels_last": Case(6, 8, (5, 6)),
    "2d_1x1_leaky_bias_nchw": Case(8, 12, (4, 5), k=1, padding=0, act="leaky", bias=True, channels_last=False),
    "2d_3x3_s2_groups_silu_no_affine": Case(8, 6, (7, 6), stride=2, groups=2, act="silu", affine=False),
    "2d_depthwise_gelu": Case(8, 8, (5, 5), groups=8, act="gelu", bias=True),
    "1d_k5_dilated_no_activation": Case(4, 6, (13,), k=5, padding=4, dilation=2, act="none"),
    "3d_3x3x3_relu": Case(4, 4, (3, 4, 4), bias=True),
}
#: The cases the interpreted kernels run on CPU (each pass of each, both implementations: seconds apiece).
INTERPRETED = ("2d_3x3_relu_channels_last", "2d_1x1_leaky_bias_nchw", "2d_3x3_s2_groups_silu_no_affine",
               "1d_k5_dilated_no_activation")  # fmt: skip


def tensors(case: Case, seed: int, device, dtype=torch.float64, batch: int = 2) -> list[torch.Tensor]:
    """x (far from zero mean: the mean matters), w, b (or None), gamma, beta (or neither)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, case.c_in, *case.size), generator=gen, dtype=torch.float64) * 2.0 + 0.7
    w = torch.randn((case.c_out, case.c_in // case.groups, *(case.k,) * len(case.size)), generator=gen,
                    dtype=torch.float64) * 0.3  # fmt: skip
    b = torch.randn(case.c_out, generator=gen, dtype=torch.float64) if case.bias else None
    affine = [torch.rand(case.c_in, generator=gen, dtype=torch.float64) + 0.5,
              torch.randn(case.c_in, generator=gen, dtype=torch.float64)] if case.affine else []  # fmt: skip
    out = [None if t is None else t.to(device=device, dtype=dtype) for t in (x, w, b, *affine)]
    if case.channels_last and len(case.size) in (2, 3):
        out[0] = out[0].contiguous(memory_format=torch.channels_last if len(case.size) == 2 else torch.channels_last_3d)
    return out


def eager(x, w, b, affine, cfg: BatchNormConvConfig, running=(None, None)):
    """The composite the op stands for, with torch's own ops."""
    gamma, beta = (affine[0], affine[1]) if affine else (None, None)
    z = F.batch_norm(x, running[0], running[1], gamma, beta, True, cfg.momentum, cfg.eps)
    for step in cfg.act:
        z = F.leaky_relu(z, step.operands[0].value) if step.kind is K.LEAKY_RELU else getattr(F, step.kind.name.lower())(z)
    s = cfg.conv
    return torch.ops.aten.convolution(z, w, b, list(s.stride), list(s.padding), list(s.dilation), False,
                                      list(s.output_padding), s.groups)  # fmt: skip


def run_case(case: Case, device, dtype=torch.float32, seed: int = 0) -> None:
    """The op against float64 (output, every gradient, the running statistics), eager in ``dtype`` the
    yardstick."""
    cfg = case.config(running_stats=True)
    want64 = tensors(case, seed, device)
    # the norm's parameters and statistics in fp32 where eager takes them so (CUDA: autocast's mix)
    norm_dtype = torch.float32 if device == "cuda" else dtype
    dtypes = [dtype, dtype, dtype, norm_dtype, norm_dtype]
    got_in = [None if t is None else t.to(d).requires_grad_() for t, d in zip(want64, dtypes, strict=False)]
    eager_in = [None if t is None else t.to(d).requires_grad_() for t, d in zip(want64, dtypes, strict=False)]
    ref_in = [None if t is None else t.clone().requires_grad_() for t in want64]
    running = {k: [torch.zeros(case.c_in, device=device, dtype=norm_dtype),
                   torch.ones(case.c_in, device=device, dtype=norm_dtype)] for k in ("got", "eager", "ref")}  # fmt: skip
    running["ref"] = [t.double() for t in running["ref"]]
    x, w, b, *affine = got_in
    out = batch_norm_conv(x, w, b, [*affine, *running["got"]], cfg.to_json())
    want = eager(eager_in[0], eager_in[1], eager_in[2], eager_in[3:], cfg, running["eager"])
    ref = eager(ref_in[0], ref_in[1], ref_in[2], ref_in[3:], cfg, running["ref"])
    assert out.stride() == want.stride()
    problems = [compare("output", out, want, reference=ref)]
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(device)
    for outputs, grad in ((out, g.to(dtype)), (want, g.to(dtype)), (ref, g)):
        outputs.backward(grad)
    names = ["x", "weight", "bias", "gamma", "beta"]
    for name, got, eag, r in zip(names, got_in, eager_in, ref_in, strict=False):
        if got is not None:
            problems.append(compare(f"grad of {name}", got.grad, eag.grad, reference=r.grad))
    for name, got, eag, r in zip(("running_mean", "running_var"), running["got"], running["eager"], running["ref"],
                                 strict=True):  # fmt: skip
        problems.append(compare(name, got, eag, reference=r))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


def test_the_config_refuses_what_the_op_does_not_compute() -> None:
    spec = CASES["2d_3x3_relu_channels_last"].spec
    with pytest.raises(ValueError, match="not a transposed one"):
        BatchNormConvConfig(dataclasses.replace(spec, transposed=True))
    with pytest.raises(ValueError, match="act holds at most one"):
        BatchNormConvConfig(spec, act=(ChainStep(K.RELU), ChainStep(K.SILU)))
    with pytest.raises(ValueError, match="act holds at most one"):
        BatchNormConvConfig(spec, act=(ChainStep(K.TANH),))
    with pytest.raises(ValueError, match="momentum must be a number"):
        BatchNormConvConfig(spec, momentum=True)
    with pytest.raises(ValueError, match="weight must be an operand index"):
        BatchNormConvConfig(spec, weight=-1)
    cfg = CASES["2d_3x3_relu_channels_last"].config(running_stats=True)
    assert BatchNormConvConfig.from_json(cfg.to_json()) == cfg
    assert kernel_path(cfg.to_json(), torch.float32, "cuda") == ("triton", None)
    assert kernel_path(cfg.to_json(), torch.float64, "cuda")[0] == "reference"


# ------------------------------------------------------------------------------------------------
# Against float64
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_the_reference_matches_float64(name, monkeypatch) -> None:
    monkeypatch.setenv("FUSION_CPU_KERNELS", "reference")
    run_case(CASES[name], "cpu")


@pytest.mark.parametrize("impl", ["family", "library"])
@pytest.mark.parametrize("name", INTERPRETED)
def test_the_kernels_match_float64(name, impl, kernels, kernel_device, monkeypatch) -> None:
    """Each implementation of the three passes, forced for all of them (``FUSION_CONV_IMPL``)."""
    if kernels == "reference":
        pytest.skip("the reference's own test")
    monkeypatch.setenv("FUSION_CONV_IMPL", impl)
    ran = spy_launchers(monkeypatch)
    run_case(CASES[name], kernel_device)
    family = ["batch_norm_stats", "conv_fprop", "conv_dgrad", "batch_norm_input_grad", "conv_wgrad"]
    library = ["batch_norm_stats", "batch_norm_apply", "batch_norm_backward", "batch_norm_apply"]
    assert ran == (family if impl == "family" else library)


def spy_launchers(monkeypatch) -> list[str]:
    """The names of the kernel launchers the op's Triton path calls, in call order."""
    import fusion_backend.kernels.batch_norm as bn
    import fusion_backend.kernels.conv as conv

    ran: list[str] = []

    def spy(name: str, fn):
        def call(*args, **kwargs):
            ran.append(name)
            return fn(*args, **kwargs)

        return call

    for module, name in ((bn, "batch_norm_stats"), (bn, "batch_norm_apply"), (bn, "batch_norm_backward"),
                         (bn, "batch_norm_input_grad"), (conv, "conv_fprop"), (conv, "conv_dgrad"),
                         (conv, "conv_wgrad")):  # fmt: skip
        monkeypatch.setattr(module, name, spy(name, getattr(module, name)))
    return ran


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", ["family", "library"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_kernels_match_float64_on_the_gpu(name, impl, dtype, monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("FUSION_CONV_IMPL", impl)
    case = CASES[name]
    run_case(dataclasses.replace(case, c_in=case.c_in * 8, c_out=case.c_out * 8,
                                 groups=case.groups * (8 if case.groups == case.c_in else 1),
                                 size=tuple(s * 4 for s in case.size)), "cuda", dtype)  # fmt: skip


def test_fp16_through_the_interpreted_kernels(kernels, kernel_device, monkeypatch) -> None:
    if kernels == "reference":
        pytest.skip("fp16 of the kernels")
    monkeypatch.setenv("FUSION_CONV_IMPL", "family")
    run_case(CASES["2d_3x3_relu_channels_last"], kernel_device, torch.float16, seed=3)


def test_running_statistics_follow_eager_over_steps(kernels, kernel_device, monkeypatch) -> None:
    monkeypatch.setenv("FUSION_CONV_IMPL", "family")
    case = CASES["2d_1x1_leaky_bias_nchw"]
    cfg = case.config(running_stats=True)
    ours = [torch.zeros(case.c_in, device=kernel_device), torch.ones(case.c_in, device=kernel_device)]
    theirs = [t.clone() for t in ours]
    for seed in range(3):
        x, w, b, *affine = tensors(case, seed, kernel_device, torch.float32)
        torch.testing.assert_close(batch_norm_conv(x, w, b, [*affine, *ours], cfg.to_json()),
                                   eager(x, w, b, affine, cfg, theirs), rtol=1e-5, atol=1e-5)  # fmt: skip
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Edge cases
# ------------------------------------------------------------------------------------------------


def test_nan_in_one_channel_reaches_the_outputs_as_in_eager(kernels, kernel_device, monkeypatch) -> None:
    monkeypatch.setenv("FUSION_CONV_IMPL", "family")
    case = CASES["2d_3x3_relu_channels_last"]
    cfg = case.config()
    x, w, b, *affine = tensors(case, 5, kernel_device, torch.float32)
    x[0, 2, 1, 1] = float("nan")
    out, want = batch_norm_conv(x, w, b, affine, cfg.to_json()), eager(x, w, b, affine, cfg)
    assert torch.equal(out.isnan(), want.isnan()) and out.isnan().any()


@pytest.mark.parametrize("impl", ["family", "library"])
@pytest.mark.parametrize("view", ["channels_last_w_slice", "channels_last_c_slice", "nchw_h_slice"])
def test_sliced_inputs_match_float64(view, impl, kernels, kernel_device, monkeypatch) -> None:
    """x a view whose spatial dims do not flatten (the norm's kernels then read a dense copy), or a
    channel slice the kernels read in place: output and every gradient against float64."""
    monkeypatch.setenv("FUSION_CONV_IMPL", impl)
    case = CASES["2d_3x3_relu_channels_last"]
    cfg = case.config()
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(2, case.c_in + 2, 7, 9, generator=gen, dtype=torch.float64) * 2 + 0.5
    base = base.to(kernel_device)
    if view != "nchw_h_slice":
        base = base.contiguous(memory_format=torch.channels_last)
    cut = {"channels_last_w_slice": lambda t: t[:, :case.c_in, :, 1:], "channels_last_c_slice": lambda t: t[:, 1:1 + case.c_in],
           "nchw_h_slice": lambda t: t[:, 2:, 1:]}[view]  # fmt: skip
    _, w, _, *affine = tensors(case, 11, kernel_device)
    runs = {}
    for name, dtype in (("got", torch.float32), ("eager", torch.float32), ("ref", torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (base, w, *affine)]
        x = cut(leaves[0])
        if name == "got":
            out = batch_norm_conv(x, leaves[1], None, leaves[2:], cfg.to_json())
        else:
            out = eager(x, leaves[1], None, leaves[2:], cfg)
        out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1], device=kernel_device, dtype=dtype))
        runs[name] = (out, [t.grad for t in leaves])
    problems = [compare("output", runs["got"][0], runs["eager"][0], reference=runs["ref"][0])]
    for i, name in enumerate(["x", "weight", "gamma", "beta"]):
        problems.append(compare(f"grad of {name}", runs["got"][1][i], runs["eager"][1][i], reference=runs["ref"][1][i]))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


def test_an_empty_batch_gives_an_empty_output_zero_gradients_and_unchanged_statistics(kernels, kernel_device) -> None:
    case = CASES["2d_3x3_relu_channels_last"]
    cfg = case.config(running_stats=True)
    x, w, b, *affine = tensors(case, 0, kernel_device, torch.float32, batch=0)
    for t in (x, w, *affine):
        t.requires_grad_()
    running = [torch.full((case.c_in,), 0.5, device=kernel_device), torch.full((case.c_in,), 2.0, device=kernel_device)]
    out = batch_norm_conv(x, w, b, [*affine, *running], cfg.to_json())
    assert out.shape == (0, case.c_out, *case.size)
    out.sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in (w, *affine))
    assert bool((running[0] == 0.5).all()) and bool((running[1] == 2.0).all())


def test_bad_input_gives_one_line_errors() -> None:
    case = CASES["2d_3x3_relu_channels_last"]
    cfg = case.config()
    x, w, b, *affine = tensors(case, 0, "cpu", torch.float32)
    with pytest.raises(UnsupportedInputError, match="norm's weight must hold 6 floating values"):
        batch_norm_conv(x, w, b, [affine[0][:3], affine[1]], cfg.to_json())
    with pytest.raises(UnsupportedInputError, match="conv weight's dtype torch.float64 is not x's torch.float32"):
        batch_norm_conv(x, w.double(), b, affine, cfg.to_json())
    with pytest.raises(UnsupportedInputError, match="does not take x's 6 channels"):
        batch_norm_conv(x, w[:, :3], b, affine, cfg.to_json())
    with pytest.raises(UnsupportedInputError, match="the running statistics are the last two"):
        batch_norm_conv(x, w, b, [], case.config(running_stats=True).to_json())
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        batch_norm_conv(x[:1, :, :1, :1], w, b, affine, cfg.to_json())


def test_a_kernel_failure_falls_back_to_the_reference_or_raises_under_strict(kernel_device, failing_kernels) -> None:
    from fusion_backend.kernels import batch_norm as kernels_module

    failing_kernels(kernels_module, "batch_norm_stats")
    case = CASES["2d_1x1_leaky_bias_nchw"]
    cfg = case.config(running_stats=True)
    x, w, b, *affine = tensors(case, 2, kernel_device, torch.float32)
    running = [torch.zeros(case.c_in, device=kernel_device), torch.ones(case.c_in, device=kernel_device)]
    theirs = [t.clone() for t in running]
    x.requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = batch_norm_conv(x, w, b, [*affine, *running], cfg.to_json())
        out.sum().backward()
    assert any("Falling back to the plain-torch reference" in str(c.message) for c in caught)
    torch.testing.assert_close(out, eager(x, w, b, affine, cfg, theirs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(running, theirs)  # updated once
    with pytest.raises(KernelError, match="simulated launch failure"):
        batch_norm_conv(x, w, b, affine, case.config(strict=True).to_json())
