"""A group norm and its activation on the conv's input in ``fusion::conv_epilogue``:
``conv(silu(group_norm(x)))``, how the VAE's and UNet's residual blocks open.

Without gradients the region takes the norm and the activation in (``ConvEpilogueConfig.norm_in``,
``act_in``): the op computes x's statistics per sample and group (one fp32 reduction pass), and the
conv family's forward normalises and activates x as it loads it (its ``GroupAffine`` prologue), so
the normalised activation is never written (``FUSION_CONV_IMPL=family`` forces the family; on CPU
under the interpreter, ``FUSION_CPU_KERNELS=triton``).  A group norm another family claimed (the
previous conv's ``conv_group_norm``) stays there; the region with it is an alternate the decision
takes where that family's region loses (``tests/e2e/test_decision.py``).  The op itself also takes the norm with gradients,
running plain torch on the device (aten's group norm and its backward).  Checked against float64 with
eager's own error as the yardstick.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from fusion_backend.errors import UnsupportedInputError
from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.testing import assert_fused, dry_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class NormActConv(nn.Module):
    """``conv(act(group_norm(x)))``: a diffusers ResnetBlock's opening (``norm1 -> silu -> conv1``)."""

    def __init__(self, channels: int, norm_groups: int, out: int, act: nn.Module, affine: bool = True,
                 dims: int = 2, **conv: int) -> None:  # fmt: skip
        super().__init__()
        self.norm = nn.GroupNorm(norm_groups, channels, affine=affine)
        self.act = act
        self.conv = (nn.Conv2d if dims == 2 else nn.Conv3d)(channels, out, 3, **conv)
        if affine:
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 1.5)
                self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.conv(self.act(self.norm(x)))


def _eval(model: nn.Module) -> nn.Module:
    fmt = torch.channels_last_3d if isinstance(model.conv, nn.Conv3d) else torch.channels_last
    return model.eval().to(DEVICE).to(memory_format=fmt)  # parameters requiring grad, as a user's model


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_resnet_block_s_norm_silu_conv_runs_on_the_family_forward_with_the_norm_in_its_prologue(family_forward, dtype):
    torch.manual_seed(31)
    model = _eval(NormActConv(8, 4, 6, nn.SiLU(), padding=1)).requires_grad_(False)  # (assert_fused runs grad mode)
    x = _channels_last(torch.randn(2, 8, 7, 5, device=DEVICE) * 3 + 2)  # a mean far from 0: the norm matters
    reports = assert_fused(model, [x], expect={"conv_epilogue": 1}, train=False, dtype=dtype)
    (match,) = [m for r in reports for m in r.matches]
    assert match.summary == "group_norm(4) -> silu -> conv2d"
    cfg = ConvEpilogueConfig.from_json(match.config)
    assert (cfg.norm_in, cfg.norm_in_affine, [s.kind for s in cfg.act_in]) == (4, 0, [PointwiseKind.SILU])
    (launch,) = family_forward
    prologue = launch["prologue"]
    assert type(prologue).__name__ == "GroupAffine" and tuple(prologue.scale.shape) == (2, 4)
    assert launch["act_in"].kind == "silu"


@pytest.mark.parametrize("case", ["instance-no-affine-leaky", "gelu-strided-grouped", "no-act-dilated", "conv3d-relu"])
def test_the_input_norm_is_within_eager_s_error_of_float64_on_its_variants(family_forward, case):
    """Instance norm without affine, one group per 4 channels, no activation, a Conv3d; strided, grouped
    and dilated convs on odd sizes: the compiled model against float64, eager's error the yardstick."""
    torch.manual_seed(32)
    make = {
        "instance-no-affine-leaky": lambda: NormActConv(6, 6, 4, nn.LeakyReLU(0.2), affine=False, padding=1),
        "gelu-strided-grouped": lambda: NormActConv(8, 2, 6, nn.GELU(), stride=2, groups=2, padding=1),
        "no-act-dilated": lambda: NormActConv(8, 4, 5, nn.Identity(), dilation=2, padding=2),
        "conv3d-relu": lambda: NormActConv(4, 2, 3, nn.ReLU(), dims=3, padding=1),
    }[case]
    model = _eval(make())
    shape = (2, model.norm.num_channels, *((5, 6, 4) if case == "conv3d-relu" else (9, 7)))
    x = _channels_last(torch.randn(shape, device=DEVICE) * 2 - 1)
    compiled = torch.compile(model, backend="fusion", options={"decide": "fuse", "strict": True})
    with torch.no_grad():  # inference as users run it: the parameters require grad, none flows
        got, eager = compiled(x), model(x)
        want = model.double()(x.double())
    assert family_forward and family_forward[0]["prologue"] is not None, "the family's prologue did not run"
    err, eager_err = (got.double() - want).norm() / want.norm(), (eager.double() - want).norm() / want.norm()
    assert err <= max(4 * eager_err, 1e-6), (err, eager_err)


def test_with_gradients_flowing_the_norm_stays_outside_the_region():
    torch.manual_seed(33)
    found = dry_run(NormActConv(8, 4, 6, nn.SiLU(), padding=1), [torch.randn(2, 8, 5, 5)], patterns=["conv_epilogue"])
    assert not any(summary.startswith("group_norm") for _, summary, _ in found.regions)


def test_a_norm_the_previous_conv_s_conv_group_norm_claims_stays_there():
    """``conv1 -> group_norm -> silu -> conv2``: ``conv_group_norm`` takes the norm with conv1 (it comes
    first); conv2's region opens at conv2."""
    torch.manual_seed(34)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 6, 3, padding=1),
                          nn.ReLU()).eval().requires_grad_(False)
    found = dry_run(model, [torch.randn(2, 4, 6, 6)], patterns=["conv_group_norm", "conv_epilogue"])
    summaries = sorted(summary for _, summary, _ in found.regions)
    assert summaries == ["conv2d -> group_norm(4) -> silu", "conv2d -> relu"], summaries


def _spec(**kw) -> ConvSpec:
    return ConvSpec(transposed=False, stride=kw.get("stride", (1, 1)), padding=(1, 1), dilation=(1, 1),
                    output_padding=(0, 0), groups=kw.get("groups", 1))


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_the_op_s_gradients_through_the_input_norm_are_autograd_s_through_the_composite(monkeypatch, exact_fp32,
                                                                                       fresh_plans, affine):
    """The op with an input norm and gradients (its Triton-path plans run plain torch on the device):
    x's, the weight's, the bias's, the chain operand's and the norm's weight and bias gradients, in
    float64, against autograd through the eager composite."""
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    torch.manual_seed(35)
    cfg = ConvEpilogueConfig(conv=_spec(stride=(2, 1), groups=2), chain=(ChainStep(PointwiseKind.MUL, (TensorRef(0),)),),
                             norm_in=2, norm_in_eps=1e-5, norm_in_affine=1 if affine else None,
                             act_in=(ChainStep(PointwiseKind.LEAKY_RELU, (Const(0.1),)),))
    x, w, b = (torch.randn(s, device=DEVICE, dtype=torch.float64) for s in ((2, 4, 7, 6), (6, 2, 3, 3), (6,)))
    m = torch.randn(6, 1, 1, device=DEVICE, dtype=torch.float64)
    affine_ops = [torch.rand(4, device=DEVICE, dtype=torch.float64) + 0.5, torch.randn(4, device=DEVICE,
                                                                                        dtype=torch.float64)]
    operands = [m, *(affine_ops if affine else [])]
    leaves = [t.requires_grad_() for t in (x, w, b, *operands)]
    got = ce.conv_epilogue(x, w, b, operands, cfg.to_json())
    want = ce.conv_epilogue_eager(x, w, b, operands, cfg.to_json())
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(got)
    for a, e in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad), strict=True):
        torch.testing.assert_close(a, e)


def test_the_family_says_why_it_cannot_normalise_x_of_another_dtype_than_the_conv_s():
    cfg = ConvEpilogueConfig(conv=_spec(), norm_in=2, compute_dtype="float16")
    x, w = _channels_last(torch.randn(2, 4, 5, 5)), torch.randn(6, 4, 3, 3)
    why = ce.forward.family_forward_unsupported(x, w, [], cfg, False)
    assert why is not None and "an input norm on x in torch.float32, not the conv's torch.float16" in why


def test_bad_input_norms_are_one_clear_error():
    x, w = torch.randn(2, 6, 5, 5), torch.randn(4, 6, 3, 3)
    with pytest.raises(UnsupportedInputError, match="the input group norm's 4 groups do not divide x's 6 channels"):
        ce.conv_epilogue(x, w, None, [], ConvEpilogueConfig(conv=_spec(), norm_in=4).to_json())
    with pytest.raises(UnsupportedInputError, match=r"operands\[1\] must hold one value per input channel \(6\)"):
        ce.conv_epilogue(x, w, None, [torch.ones(6), torch.ones(5)],
                         ConvEpilogueConfig(conv=_spec(), norm_in=3, norm_in_affine=0).to_json())
    with pytest.raises(ValueError, match="need norm_in"):
        ConvEpilogueConfig(conv=_spec(), act_in=(ChainStep(PointwiseKind.SILU),))
    with pytest.raises(ValueError, match="without a gate"):
        ConvEpilogueConfig(conv=_spec(), norm_in=2, gate=0)
    with pytest.raises(ValueError, match="act_in holds at most one of"):
        ConvEpilogueConfig(conv=_spec(), norm_in=2, act_in=(ChainStep(PointwiseKind.SIGMOID),))
    with pytest.raises(ValueError, match="no chain step reads them"):
        ConvEpilogueConfig(conv=_spec(), norm_in=2, norm_in_affine=0, chain=(ChainStep(PointwiseKind.MUL, (TensorRef(1),)),))


class SpelledOut(nn.Module):
    """The same opening spelled with functionals: ``F.group_norm`` with the module's own parameters and
    the SiLU written ``h * torch.sigmoid(h)`` (an idiom the frontend folds into one SiLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.randn(8))
        self.conv = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        h = torch.nn.functional.group_norm(x, 2, self.gamma, self.beta, eps=1e-6)
        return self.conv(h * torch.sigmoid(h))


def test_the_functional_spelling_matches_the_same_region():
    found = dry_run(SpelledOut().eval().requires_grad_(False), [torch.randn(2, 8, 5, 5)], patterns=["conv_epilogue"])
    assert [summary for _, summary, _ in found.regions] == ["group_norm(2) -> silu -> conv2d"]


def test_a_norm_of_x_in_another_dtype_than_the_conv_s_stays_outside_the_region():
    """Under autocast a graph input in fp32 normalised before a bf16 conv: the family would have to round
    x before the norm, so the region opens at the conv."""
    model = NormActConv(8, 4, 6, nn.SiLU(), padding=1).eval().requires_grad_(False)

    def under_autocast(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    found = dry_run(under_autocast, [torch.randn(2, 8, 5, 5)], patterns=["conv_epilogue"])
    assert not any(summary.startswith("group_norm") for _, summary, _ in found.regions), found.regions


# ------------------------------------------------------------------------------------------------
# The library plan: the norm kernels, then the library conv (``InputNormLibraryForward``)
# ------------------------------------------------------------------------------------------------

#: name -> (channels, groups, out channels, act_in, a chain after the conv, affine, x's memory format,
#: the conv's compute dtype: x stays fp32, as autocast hands a norm's input to a half-precision conv)
LIBRARY_CASES = {
    "silu, channels-last": (8, 4, 6, (ChainStep(PointwiseKind.SILU),), (), True, torch.channels_last, None),
    "instance norm, leaky, contiguous": (6, 6, 4, (ChainStep(PointwiseKind.LEAKY_RELU, (Const(0.2),)),), (), False,
                                         torch.contiguous_format, None),
    "silu, a contiguous x before a channels-last weight": (8, 4, 6, (ChainStep(PointwiseKind.SILU),), (), True,
                                                           "contiguous x", None),
    "no act, a relu after the conv": (8, 2, 5, (), (ChainStep(PointwiseKind.RELU),), True, torch.channels_last, None),
    "gelu, fp16 conv of an fp32 x": (8, 4, 6, (ChainStep(PointwiseKind.GELU),), (), True, torch.channels_last,
                                     "float16"),
}


@pytest.mark.parametrize("case", list(LIBRARY_CASES))
def test_the_input_norm_s_library_plan_is_within_eager_s_error_of_float64(case, exact_fp32):
    """The plan's output against the region's float64 composite (norm, activation, the cast to the conv's
    dtype, conv, bias, chain), eager's own error the yardstick; on CPU the norm kernels run under the interpreter."""
    channels, groups, out, act, chain, affine, fmt, compute = LIBRARY_CASES[case]
    torch.manual_seed(33)
    x = (torch.randn(2, channels, 9, 7, device=DEVICE) * 2 + 1).to(
        memory_format=torch.contiguous_format if fmt == "contiguous x" else fmt)
    w = torch.randn(out, channels, 3, 3, device=DEVICE).to(
        memory_format=torch.channels_last if fmt == "contiguous x" else fmt) * 0.2
    b = torch.randn(out, device=DEVICE)
    ops = [torch.rand(channels, device=DEVICE) + 0.5, torch.randn(channels, device=DEVICE)] if affine else []
    cfg = ConvEpilogueConfig(conv=_spec(), chain=chain, norm_in=groups, norm_in_eps=1e-5,
                             norm_in_affine=0 if affine else None, act_in=act, compute_dtype=compute)  # fmt: skip
    assert ce.forward.input_norm_library_unsupported(x, w, ops, cfg, False) is None
    plan = ce.forward.InputNormLibraryForward(x, w, b, ops, cfg, False)
    outputs = plan(x, w, b, ops)
    assert not plan.conv.conv_alone  # (the bias: the epilogue kernel adds it)
    eager_outputs = ce.reference.forward(x, w, b, ops, cfg, False)
    assert [(t.shape, t.dtype) for t in outputs[1:]] == [(t.shape, t.dtype) for t in eager_outputs[1:]]
    got, eager = outputs[0], eager_outputs[0]
    exact, _, _ = ce.reference.forward(x.double(), w.double(), b.double(), [o.double() for o in ops],
                                       dataclasses.replace(cfg, compute_dtype=None), False)  # fmt: skip
    assert got.shape == eager.shape and got.stride() == eager.stride() and got.dtype == eager.dtype
    err, eager_err = ((t.double() - exact).norm() / exact.norm() for t in (got, eager))
    assert err <= max(4 * eager_err, 1e-6), (err, eager_err)
    again, _, _ = plan(x, w, b, ops)  # the kept library plan
    assert torch.equal(again, got)


def test_auto_offers_the_input_norm_s_library_plan_for_calls_that_save_nothing(monkeypatch):
    """Under ``auto`` the plan joins the measured candidates of a region with an input norm; a call that
    saves for a backward, or a region without the norm, does not get it (each says why)."""
    from fusion_backend import environment

    offered = []
    monkeypatch.setattr(ce.forward, "_times_library_layouts", lambda x: True)
    monkeypatch.setattr(ce.forward, "_measured_forward", lambda plans, *a, **k: (offered.append(set(plans)),
                                                                                 (plans["library"], True))[1])  # fmt: skip
    monkeypatch.setenv(environment.CONV_IMPL, "auto")
    x, w = _channels_last(torch.randn(2, 8, 5, 5)), torch.randn(6, 8, 3, 3)
    cfg = ConvEpilogueConfig(conv=_spec(), norm_in=4, act_in=(ChainStep(PointwiseKind.SILU),))
    for save in (False, True):
        ce.forward.plan_for(x, w, None, [], cfg, save)
    assert "norm-library" in offered[0] and "norm-library" not in offered[1]
    assert ce.forward.input_norm_library_unsupported(x, w, [], cfg, True) == "a call that saves state for a backward"
    no_norm = ConvEpilogueConfig(conv=_spec(), residual=0, chain=(ChainStep(PointwiseKind.ADD, (TensorRef(0),)),))
    assert ce.forward.input_norm_library_unsupported(x, w, [], no_norm, False) == "no input norm, or a residual"
    why = ce.forward.input_norm_library_unsupported(x[..., ::2], w, [], cfg, False)
    assert why is not None and "not a dense layout's" in why


class NormActConvRelu(NormActConv):
    def forward(self, x):
        return torch.relu(super().forward(x))


@pytest.mark.parametrize("chain", [False, True], ids=["conv-output", "chain-after"])
def test_a_region_whose_result_is_the_conv_output_adds_the_bias_in_the_graph(chain, tmp_path):
    """Where the region's result is the conv's output the op gets no bias and the graph adds it (where
    Inductor folds it into the next op's kernel); a region with a chain after the conv keeps the bias in
    the op.  Either way the result is within eager's error of float64."""
    torch.manual_seed(36)
    model = _eval((NormActConvRelu if chain else NormActConv)(8, 4, 6, nn.SiLU(), padding=1))
    with torch.no_grad():
        model.conv.bias.uniform_(2, 3)  # a bias far from 0: a lost or doubled bias shows
    x = _channels_last(torch.randn(2, 8, 7, 5) * 3 + 2).to(DEVICE)
    compiled = torch.compile(model, backend="fusion", options={"decide": "fuse", "strict": True, "dump_dir": str(tmp_path)})
    with torch.no_grad():
        got, eager = compiled(x), model(x)
        want = model.double()(x.double())
    err, eager_err = (got.double() - want).norm() / want.norm(), (eager.double() - want).norm() / want.norm()
    assert err <= max(4 * eager_err, 1e-6), (err, eager_err)
    (after,) = tmp_path.glob("**/after.py")
    code = after.read_text()
    call = next(line for line in code.splitlines() if "conv_epilogue(" in line)
    bias_name = "l_self_modules_conv_parameters_bias_"
    if chain:
        assert f"weight_, {bias_name}, [" in call and "view(-1, 1, 1)" not in code, code
    else:
        assert "weight_, None, [" in call, code
        assert f"view = {bias_name}.view(-1, 1, 1)" in code and "add = conv_epilogue + view" in code, code
