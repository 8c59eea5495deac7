"""A residual branch in ``fusion::conv_epilogue``: ``act(bn(conv(x)) + identity)``, the tail of every
ResNet block, and ``(conv(x) + r) / s``, the VAE's.

The chain's ``add`` may read one tensor of the conv output's full shape (``ConvEpilogueConfig.residual``).
Without gradients the conv family's forward adds it in its store, before the store's activation
(``FUSION_CONV_IMPL=family`` forces it; on CPU under the interpreter, ``FUSION_CPU_KERNELS=triton``);
the pattern keeps the add only where that can serve (a direct 2-d or 3-d conv, no gradient, at most
one store activation after it).  The op's library path adds it in the epilogue kernel's one pass after
the library conv (``LibraryForward``, the chain split at the residual's slot:
``kernels.epilogue.residual_split``), and runs plain torch on the device where that kernel cannot
(``ReferenceForward``) and in the backward (``ReferenceBackward``); the residual's gradient is then the
chain's gradient at its add.  Every case is checked against float64 with eager's own error as the yardstick
(``assert_fused``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.chain import ChainStep, ChainValue, Const, PointwiseKind, TensorRef
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.testing import assert_fused, dry_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class ResidualTail(nn.Module):
    """``act(bn(conv(x)) + x)``: a ResNet block's last conv, its BatchNorm and the identity branch."""

    def __init__(self, channels: int, act: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)
        self.act = act

    def forward(self, x):
        out = self.bn(self.conv(x))
        out += x  # as torchvision's Bottleneck spells it
        return self.act(out)


class ScaledResidual(nn.Module):
    """``(r + conv(x)) / 2``: the diffusers ResnetBlock's output, the residual first."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x, r):
        return (r + self.conv(x)) / 2.0


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("act", ["relu", "silu"])
def test_a_resnet_block_tail_runs_on_the_family_forward_with_the_residual_in_its_store(family_forward, act, dtype):
    torch.manual_seed(11)
    model = ResidualTail(8, nn.ReLU() if act == "relu" else nn.SiLU()).eval().requires_grad_(False).to(DEVICE)
    model = model.to(memory_format=torch.channels_last)
    x = _channels_last(torch.randn(2, 8, 7, 5, device=DEVICE))
    reports = assert_fused(model, [x], expect={"conv_epilogue": 1}, train=False, dtype=dtype)
    (match,) = [m for r in reports for m in r.matches]
    assert ConvEpilogueConfig.from_json(match.config).residual is not None
    assert family_forward, "the family's forward did not run"
    for call in family_forward:  # the folded BatchNorm as scale and bias, the residual and the activation in the store
        assert call["residual"] is not None and call["act_out"].kind == act and call["scale"] is not None
        assert len(call["chain"]) == 0


def test_with_gradients_flowing_the_region_ends_before_the_residual_add_and_says_why():
    """No kernel writes a residual's full-size gradient yet, and plain torch never beats Inductor's
    code for the same ops: in training the region is the conv and its folded BatchNorm (the op's
    gradients with a residual are checked on the op itself, below)."""
    torch.manual_seed(12)
    model = ResidualTail(8, nn.ReLU())
    model.bn.eval()  # frozen: it folds, and its weight and bias still get gradients
    summaries, misses = _region(model, torch.randn(2, 8, 6, 6, requires_grad=True), grad=True)
    assert summaries == ["conv2d -> batch_norm (folded)"]
    assert any("gradients flowing" in n.message for n in misses)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_the_op_s_residual_gradient_is_the_chain_s_gradient_at_its_add(monkeypatch, exact_fp32, fresh_plans, dtype):
    """The op itself takes a residual with gradients (its Triton-path plans run plain torch on the
    device): every input's gradient, the residual's included, against autograd through the eager
    composite."""
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    torch.manual_seed(14)
    cfg = ConvEpilogueConfig(conv=_conv(), chain=(ChainStep(PointwiseKind.MUL, (TensorRef(0),)),
                                                  ChainStep(PointwiseKind.ADD, (TensorRef(1),)),
                                                  ChainStep(PointwiseKind.LEAKY_RELU, (Const(0.1),)),
                                                  ChainStep(PointwiseKind.DIV, (Const(2.0),))), residual=1)
    x, w, b = (torch.randn(s, device=DEVICE, dtype=dtype) for s in ((2, 4, 5, 6), (5, 4, 3, 3), (5,)))
    m, r = torch.randn(5, 1, 1, device=DEVICE, dtype=dtype), torch.randn(2, 5, 5, 6, device=DEVICE, dtype=dtype)
    leaves = [t.requires_grad_() for t in (x, w, b, m, r)]
    grad = torch.randn(2, 5, 5, 6, device=DEVICE, dtype=dtype)
    got = ce.conv_epilogue(x, w, b, [m, r], cfg.to_json())
    want = ce.conv_epilogue_eager(x, w, b, [m, r], cfg.to_json())
    torch.testing.assert_close(got, want)
    for g, e in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad), strict=True):
        torch.testing.assert_close(g, e)


def test_a_residual_read_first_with_a_division_after_it_ends_the_region_after_the_add(family_forward):
    """The VAE's ``(r + conv(x)) / s`` without gradients: the region is the conv and the residual add,
    which the family's store adds; the division, which its store does not apply, is Inductor's."""
    torch.manual_seed(13)
    model = ScaledResidual(6).eval().requires_grad_(False).to(DEVICE).to(memory_format=torch.channels_last)
    x, r = (_channels_last(torch.randn(2, 6, 5, 5, device=DEVICE)) for _ in range(2))
    reports = assert_fused(model, [x, r], expect={"conv_epilogue": 1}, train=False)
    (match,) = [m for rep in reports for m in rep.matches]
    assert ConvEpilogueConfig.from_json(match.config).residual is not None and match.summary.endswith("add")
    assert any("what the conv family's store applies" in n.message for rep in reports for n in rep.near_misses)
    assert family_forward and family_forward[0]["residual"] is not None and family_forward[0]["act_out"] is None


def _region(model, *inputs, grad=False):
    """``(summaries of the regions, near misses)`` the match finds (``dry_run``: nothing compiled)."""
    with torch.set_grad_enabled(grad):
        found = dry_run(model, inputs, patterns=["conv_epilogue"])
    return [summary for _, summary, _ in found.regions], list(found.near_misses)


def test_a_pool_after_the_residual_ends_the_region_before_it_and_says_why():
    class ThenPool(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return F.max_pool2d(F.relu(self.conv(x) + x), 2)

    summaries, misses = _region(ThenPool(), torch.randn(1, 4, 6, 6))
    assert summaries == ["conv2d -> add -> relu"]
    assert any("a pool after a residual add" in n.message for n in misses)


def test_a_second_full_size_operand_ends_the_chain_before_it():
    class TwoBranches(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x, a, b):
            return torch.tanh(torch.relu(self.conv(x) + a) + b)

    summaries, misses = _region(TwoBranches(), *(torch.randn(1, 4, 5, 5) for _ in range(3)))
    assert summaries == ["conv2d -> add -> relu"]
    assert any("one full-size operand" in n.message for n in misses)


def _conv() -> ConvSpec:
    return ConvSpec(transposed=False, stride=(1, 1), padding=(1, 1), dilation=(1, 1), output_padding=(0, 0), groups=1)


def test_the_config_holds_one_residual_read_by_one_add_and_no_pool():
    add_r = ChainStep(PointwiseKind.ADD, (TensorRef(0),))
    ConvEpilogueConfig(conv=_conv(), chain=(add_r, ChainStep(PointwiseKind.RELU)), residual=0)
    with pytest.raises(ValueError, match="exactly one add"):
        ConvEpilogueConfig(conv=_conv(), chain=(ChainStep(PointwiseKind.MUL, (TensorRef(0),)),), residual=0)
    with pytest.raises(ValueError, match="exactly one add"):
        ConvEpilogueConfig(conv=_conv(), chain=(add_r, add_r), residual=0)
    with pytest.raises(ValueError, match="no pool"):
        ConvEpilogueConfig(conv=_conv(), chain=(add_r,), residual=0,
                           pool=PoolSpec(kind="max", kernel_size=(2, 2), stride=(2, 2), padding=(0, 0)))
    cfg = ConvEpilogueConfig(conv=_conv(), chain=(add_r,), residual=0)
    assert ConvEpilogueConfig.from_json(cfg.to_json()) == cfg


def test_the_family_forward_says_why_it_cannot_add_a_residual():
    x = _channels_last(torch.randn(2, 4, 6, 6))
    w, r = torch.randn(4, 4, 3, 3), _channels_last(torch.randn(2, 4, 6, 6))
    add_r = ChainStep(PointwiseKind.ADD, (TensorRef(0),))

    def why(*tail, save=False):
        cfg = ConvEpilogueConfig(conv=_conv(), chain=(add_r, *tail), residual=0)
        return ce.forward.family_forward_unsupported(x, w, [r], cfg, save)

    assert why() is None and why(ChainStep(PointwiseKind.LEAKY_RELU, (Const(0.2),))) is None
    assert "saves for the backward" in why(save=True)
    assert "one relu, leaky_relu, gelu or silu" in why(ChainStep(PointwiseKind.TANH))
    assert "one relu, leaky_relu, gelu or silu" in why(ChainStep(PointwiseKind.RELU), ChainStep(PointwiseKind.RELU))


def test_after_a_1d_or_transposed_conv_the_region_ends_before_the_residual_add():
    """The conv family's forward serves direct 2-d and 3-d convs: elsewhere the op would run plain torch."""
    class Tail(nn.Module):
        def __init__(self, conv):
            super().__init__()
            self.conv = conv

        def forward(self, x, r):
            return F.relu(self.conv(x) * 2.0 + r)

    for conv, x, r in ((nn.Conv1d(4, 4, 3, padding=1), torch.randn(2, 4, 7), torch.randn(2, 4, 7)),
                       (nn.ConvTranspose2d(4, 4, 3, padding=1), torch.randn(1, 4, 5, 5), torch.randn(1, 4, 5, 5))):
        summaries, misses = _region(Tail(conv), x, r)
        assert len(summaries) == 1 and summaries[0].endswith("d -> mul")
        assert any("transposed or 1-d conv" in n.message for n in misses)


@pytest.mark.parametrize("layout", ["channels_last", "contiguous", "sliced"])
@pytest.mark.parametrize("conv", [dict(stride=2, padding=1), dict(groups=2, dilation=2, padding=2)],
                         ids=["s2", "g2-d2"])
def test_the_family_adds_a_residual_of_any_layout_on_strided_grouped_and_dilated_convs(family_forward, conv, layout):
    """The residual the op is given in any layout is read as the store reads it (channels-last dense,
    copied where it is not), on odd sizes; against the eager composite in float64."""
    torch.manual_seed(15)
    spec = ConvSpec(transposed=False, stride=(conv.get("stride", 1),) * 2, padding=(conv["padding"],) * 2,
                    dilation=(conv.get("dilation", 1),) * 2, output_padding=(0, 0), groups=conv.get("groups", 1))
    cfg = ConvEpilogueConfig(conv=spec, chain=(ChainStep(PointwiseKind.MUL, (TensorRef(0),)),
                                               ChainStep(PointwiseKind.ADD, (TensorRef(1),)),
                                               ChainStep(PointwiseKind.GELU)), residual=1)
    x = _channels_last(torch.randn(2, 6, 9, 7, device=DEVICE))
    w = torch.randn(8, 6 // spec.groups, 3, 3, device=DEVICE).to(memory_format=torch.channels_last)
    m = torch.rand(8, 1, 1, device=DEVICE) + 0.5
    shape = ce.reference.outputs(x, w, None, [m], ConvEpilogueConfig(conv=spec), False)[0].shape
    r = torch.randn(*shape[:-1], 2 * shape[-1], device=DEVICE)
    r = {"channels_last": _channels_last(r[..., : shape[-1]].contiguous()), "contiguous": r[..., : shape[-1]].contiguous(),
         "sliced": r[..., ::2]}[layout]
    got = ce.conv_epilogue(x, w, None, [m, r], cfg.to_json())
    want = ce.conv_epilogue_eager(*(t.double() for t in (x, w)), None, [m.double(), r.double()], cfg.to_json())
    eager = ce.conv_epilogue_eager(x, w, None, [m, r], cfg.to_json())
    assert family_forward, "the family's forward did not run"
    err, eager_err = (got.double() - want).norm() / want.norm(), (eager.double() - want).norm() / want.norm()
    assert err <= max(4 * eager_err, 1e-6), (err, eager_err)


def test_where_two_convs_outputs_meet_at_an_add_one_region_takes_it_and_the_other_ends_before_it():
    """A ResNet block with a downsample branch: ``relu(bn3(conv3(h)) + bn_d(conv_d(x)))``.  The first
    conv's region takes the add (the other branch as its residual); the downsample conv keeps its own
    region, ending before the add, instead of losing it to the claim."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv3, self.bn3 = nn.Conv2d(4, 8, 1, bias=False), nn.BatchNorm2d(8)
            self.down, self.bn_d = nn.Conv2d(4, 8, 1, stride=1, bias=False), nn.BatchNorm2d(8)

        def forward(self, x):
            out = self.bn3(self.conv3(torch.relu(x)))
            out += self.bn_d(self.down(x))
            return torch.relu(out)

    summaries, misses = _region(Block().eval(), torch.randn(2, 4, 5, 5))
    assert sorted(summaries) == ["conv2d -> batch_norm (folded)", "conv2d -> batch_norm (folded) -> add -> relu"]
    assert any(n.reason.value == "claimed" and "already part of another fused region" in n.message for n in misses)


def _tail_config(*after: ChainStep) -> ConvEpilogueConfig:
    """``after(leaky_relu(conv(x) * m + r, 0.1))``, the residual ``operands[1]``."""
    return ConvEpilogueConfig(conv=_conv(), chain=(ChainStep(PointwiseKind.MUL, (TensorRef(0),)),
                                                   ChainStep(PointwiseKind.ADD, (TensorRef(1),)),
                                                   ChainStep(PointwiseKind.LEAKY_RELU, (Const(0.1),)), *after),
                              residual=1)  # fmt: skip


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("r_dtype", [torch.float32, torch.float16], ids=["r-fp32", "r-fp16"])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous", "sliced"])
def test_the_library_path_adds_the_residual_in_its_epilogue_pass(monkeypatch, exact_fp32, fresh_plans, layout,
                                                                   r_dtype, train):  # fmt: skip
    """The library conv, then one epilogue pass: bias, the steps before the add, the residual (any
    layout and float dtype), the steps after it; against float64 with eager's error as the yardstick,
    and every gradient (the backward is the reference's, on the library forward's saved conv output)."""
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setenv("FUSION_CONV_IMPL", "library")
    monkeypatch.setattr(ce.forward.ReferenceForward, "__call__", lambda *a: pytest.fail("ran the reference"))
    torch.manual_seed(16)
    cfg = _tail_config(ChainStep(PointwiseKind.DIV, (Const(2.0),)))
    x = _channels_last(torch.randn(2, 4, 7, 5, device=DEVICE))
    w, b = torch.randn(6, 4, 3, 3, device=DEVICE), torch.randn(6, device=DEVICE)
    m = torch.rand(6, 1, 1, device=DEVICE) + 0.5
    r = torch.randn(2, 6, 7, 10, device=DEVICE)
    r = {"channels_last": _channels_last(r[..., :5].contiguous()), "contiguous": r[..., :5].contiguous(),
         "sliced": r[..., ::2]}[layout].to(r_dtype)  # fmt: skip
    leaves = [t.detach().requires_grad_(train) for t in (x, w, b, m, r)]
    got = ce.conv_epilogue(*leaves[:3], leaves[3:], cfg.to_json())
    doubles = [t.detach().double().requires_grad_(train) for t in leaves]
    want = ce.conv_epilogue_eager(*doubles[:3], doubles[3:], cfg.to_json())
    eager = ce.conv_epilogue_eager(*leaves[:3], leaves[3:], cfg.to_json())
    assert got.dtype == eager.dtype == torch.float32

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(got, want) <= max(4 * rel(eager, want), 1e-6), (rel(got, want), rel(eager, want))
    if train:
        g = torch.randn_like(want)
        grads = torch.autograd.grad(got, leaves, g.float())
        wants = torch.autograd.grad(want, doubles, g)
        eagers = torch.autograd.grad(eager, leaves, g.float())
        for name, gg, ww, ee in zip("x w b m r".split(), grads, wants, eagers, strict=True):
            assert rel(gg, ww) <= max(4 * rel(ee, ww), 1e-6), (name, rel(gg, ww), rel(ee, ww))


def test_a_step_after_the_residual_reading_a_value_from_before_it_runs_the_reference(monkeypatch, fresh_plans):
    """The epilogue kernel's tail starts from the sum: a later step that reads the conv output itself
    (``ChainValue(0)``) is the reference's, with the same results."""
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setenv("FUSION_CONV_IMPL", "library")
    torch.manual_seed(17)
    cfg = _tail_config(ChainStep(PointwiseKind.MUL, (ChainValue(0),)))
    x, w = torch.randn(1, 4, 5, 5, device=DEVICE), torch.randn(6, 4, 3, 3, device=DEVICE)
    ops = [torch.rand(6, 1, 1, device=DEVICE) + 0.5, torch.randn(1, 6, 5, 5, device=DEVICE)]
    plan, _ = ce.forward.plan_for(x, w, None, ops, cfg, False)
    assert isinstance(plan, ce.forward.ReferenceForward)
    torch.testing.assert_close(ce.conv_epilogue(x, w, None, ops, cfg.to_json()),
                               ce.conv_epilogue_eager(x, w, None, ops, cfg.to_json()))  # fmt: skip
    with pytest.raises(ValueError, match="reads the chain value before slot 0"):
        ce.forward.epilogue_kernels().residual_split((13, 0, 5 + 32 * 1), 1)
