"""The conv alone of the fused ops' library paths (``ops/library_conv.py``'s ``ConvAlone``): aten's conv,
or the conv family's plain forward where ``FUSION_CONV_IMPL=family`` forces it or, under ``auto``, it
measured faster for the call's signature.  A call that saves nothing takes it in ``conv_epilogue``'s
library plans (``LibraryForward``, and through it the input-norm library plan) and in
``conv_group_norm``'s forward.

On CPU the family runs under the interpreter (``FUSION_CPU_KERNELS=triton``, fp16: the interpreter
has no bf16) and the measured choice with a fake timer.  Results against float64, eager's own error
the yardstick.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend import environment
from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops import library_conv
from fusion_backend.ops.chain import ChainStep, PointwiseKind
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.testing import assert_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter has no bf16

def _spec(stride, padding, dilation=None, groups=1, transposed=False) -> ConvSpec:
    dims = len(stride)
    return ConvSpec(transposed, tuple(stride), tuple(padding), tuple(dilation or (1,) * dims), (0,) * dims, groups)


#: name -> (x shape, weight shape, ConvSpec)
CASES = {
    "2d-k3-p1": ((2, 16, 9, 7), (24, 16, 3, 3), _spec((1, 1), (1, 1))),
    "2d-s2-dilated-groups": ((2, 8, 11, 10), (12, 4, 3, 3), _spec((2, 2), (2, 1), (2, 1), groups=2)),
    "3d-k3": ((1, 8, 5, 6, 4), (8, 8, 3, 3, 3), _spec((1, 1, 1), (1, 0, 1))),
}


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)


def _inputs(case: str) -> tuple[torch.Tensor, torch.Tensor, ConvSpec]:
    x_shape, w_shape, spec = CASES[case]
    x = _channels_last(torch.randn(x_shape, device=DEVICE) + 0.5)
    w = _channels_last(torch.randn(w_shape, device=DEVICE) / (w_shape[1] * 9) ** 0.5)
    return x.to(DTYPE), w.to(DTYPE), spec


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_family_stands_in_for_aten_where_forced_within_eager_s_error(monkeypatch, family_launches, case):
    """Where aten lays the output out NCHW (a 3-d fp16 conv on CPUs without native fp16 convs, whose
    layout then depends on the machine) the family cannot stand in, and does not."""
    monkeypatch.setenv(environment.CONV_IMPL, "family")
    x, w, spec = _inputs(case)
    plan = library_conv.conv_alone_plan(x, w, spec)
    out = plan(x, w)
    eager = library_conv.run_conv(x, w, None, spec)
    exact = library_conv.run_conv(x.double(), w.double(), None, spec)
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    serves = eager.is_contiguous(memory_format=fmt)  # (a 2-d conv's always; a 3-d one's by the machine)
    assert (library_conv.family_conv_problem(x, w, spec) is None) == serves
    assert plan.choice == ("family" if serves else "library") and len(family_launches) == int(serves)
    assert out.dtype == eager.dtype and out.shape == eager.shape and out.stride() == eager.stride()
    assert _rel(out, exact) <= 2 * _rel(eager, exact) + 1e-3
    assert torch.equal(library_conv.conv_alone(x, w, spec), out)  # the kept plan, the same bits


def test_aten_where_the_family_cannot_stand_in(monkeypatch, family_launches):
    """fp32, a transposed conv, an NCHW x (aten's output not channels-last), a 1-d conv: aten's conv,
    whatever the switch says, and nothing launched."""
    monkeypatch.setenv(environment.CONV_IMPL, "family")
    x, w, spec = _inputs("2d-k3-p1")
    assert "float32" in library_conv.family_conv_problem(x.float(), w.float(), spec)
    t_spec = _spec((1, 1), (1, 1), transposed=True)
    assert library_conv.family_conv_problem(x, w.transpose(0, 1).contiguous(), t_spec) == "a transposed conv"
    assert library_conv.family_conv_problem(x.contiguous(), w.contiguous(), spec) == "aten's output is not channels-last"
    spec1 = _spec((1,), (1,))
    assert library_conv.family_conv_problem(x[:, :, 0], w[:, :, 0], spec1) == "a 1-d conv"
    plan = library_conv.conv_alone_plan(x.contiguous(), w.contiguous(), spec)
    out = plan(x.contiguous(), w.contiguous())
    assert plan.choice == "library" and not family_launches
    assert torch.equal(out, library_conv.run_conv(x.contiguous(), w.contiguous(), None, spec))


@pytest.fixture
def measured(monkeypatch, family_launches, fake_impl_timer):
    """``auto`` measuring as on CUDA, with a fake timer (``fake_impl_timer``'s ``(times, timed)``)."""
    monkeypatch.setattr(library_conv, "_measures_conv_alone", lambda x: True)
    return fake_impl_timer


@pytest.mark.parametrize("faster", ["family", "library"])
def test_auto_takes_the_conv_that_measured_faster_once_per_signature(measured, family_launches, faster):
    times, timed = measured
    times.update({"family": 1.0, "library": 1.0, faster: 0.5})
    x, w, spec = _inputs("2d-k3-p1")
    plan = library_conv.conv_alone_plan(x, w, spec)
    out = plan(x, w)
    assert timed == [["library", "family"]] and plan.choice == faster
    plan(x, w)
    assert len(timed) == 1, "settled: not timed again"
    exact = library_conv.run_conv(x.double(), w.double(), None, spec)
    assert _rel(out, exact) <= 2 * _rel(library_conv.run_conv(x, w, None, spec), exact) + 1e-3


def test_auto_keeps_aten_s_conv_within_the_gain_margin_and_off_cuda(measured, monkeypatch):
    times, timed = measured
    times.update({"family": 0.99, "library": 1.0})  # within impl_choice.MIN_GAIN: the default stays
    x, w, spec = _inputs("2d-k3-p1")
    assert library_conv.conv_alone_plan(x, w, spec)(x, w) is not None
    assert library_conv.conv_alone_plan(x, w, spec).choice == "library"
    monkeypatch.setattr(library_conv, "_measures_conv_alone", lambda x: False)  # a CPU tensor under auto
    x2, w2, _ = _inputs("2d-k3-p1")
    x2 = x2[:1]
    plan = library_conv.conv_alone_plan(x2, w2, spec)
    plan(x2, w2)
    assert plan.choice == "library" and len(timed) == 1


def _chain_cfg(spec: ConvSpec) -> ConvEpilogueConfig:
    return ConvEpilogueConfig(conv=spec, chain=(ChainStep(PointwiseKind.RELU, ()),))


@pytest.mark.parametrize("save", [False, True], ids=["infer", "train"])
def test_the_library_forward_runs_its_conv_as_chosen_in_calls_that_save_nothing(monkeypatch, family_launches, save):
    """``conv_epilogue``'s library plan: conv (the family's where forced, in a call that saves nothing),
    then the epilogue kernel's bias and relu; a call that saves keeps aten's conv."""
    monkeypatch.setenv(environment.CONV_IMPL, "family")
    x, w, spec = _inputs("2d-k3-p1")
    b = torch.randn(w.shape[0], device=DEVICE).to(DTYPE)
    cfg = _chain_cfg(spec)
    plan = ce.forward.LibraryForward(x, w, b, [], cfg, save)
    out = plan(x, w, b, [])[0]
    assert len(family_launches) == (0 if save else 1)
    exact = torch.relu(F.conv2d(x.double(), w.double(), b.double(), padding=1))
    eager = torch.relu(F.conv2d(x, w, b, padding=1))
    assert out.stride() == eager.stride()
    assert _rel(out, exact) <= 2 * _rel(eager, exact) + 1e-3


class ConvNormAct(nn.Module):
    """``silu(group_norm(conv(x)))``: a VAE resnet block's middle."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return F.silu(self.norm(self.conv(x)))


def test_conv_group_norm_s_inference_forward_runs_the_chosen_conv(monkeypatch, family_launches):
    monkeypatch.setenv(environment.CONV_IMPL, "family")
    model = ConvNormAct().eval().to(DEVICE).to(memory_format=torch.channels_last).requires_grad_(False)
    x = (torch.randn(2, 8, 9, 7, device=DEVICE) * 2 + 1).to(memory_format=torch.channels_last)
    assert_fused(model, [x], expect={"conv_group_norm": 1}, train=False, dtype=DTYPE)
    assert len(family_launches) == 1 and "prologue" not in family_launches[0]  # the plain forward


class ConvLogSoftmax(nn.Module):
    """``log_softmax(conv(x))`` over the channels: a ``conv_channel_reduce`` region, whose conv is
    ``library_conv.conv_forward``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 12, 3, padding=1)

    def forward(self, x):
        return F.log_softmax(self.conv(x), dim=1)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_the_channels_last_library_conv_runs_the_chosen_conv_in_calls_that_save_nothing(monkeypatch, family_launches,
                                                                                       train):  # fmt: skip
    """``conv_forward(..., alone=True)`` (``conv_channel_reduce``'s forward here): the family's conv where
    forced; a training call, which saves, keeps aten's.  Output (and gradients) against eager."""
    monkeypatch.setenv(environment.CONV_IMPL, "family")
    model = ConvLogSoftmax().to(DEVICE).to(memory_format=torch.channels_last)
    if not train:
        model = model.eval().requires_grad_(False)
    x = torch.randn(2, 8, 9, 7, device=DEVICE).to(memory_format=torch.channels_last)
    assert_fused(model, [x], expect={"conv_channel_reduce": 1}, train=train, dtype=DTYPE)
    assert len(family_launches) == (0 if train else 1)


@pytest.mark.usefixtures("family_launches")
def test_a_failed_kernel_s_fallback_runs_eager_s_conv_not_the_family_again(monkeypatch):
    """The reference, which a failed kernel falls back to, is eager's ops: its conv is aten's, never the
    conv alone's choice (the failure may be the family's own)."""
    import fusion_backend.kernels.group_norm as group_norm_kernels
    from fusion_backend.ops import conv_group_norm as gn

    monkeypatch.setenv(environment.CONV_IMPL, "family")

    def failing(*args, **kwargs):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(group_norm_kernels, "group_norm_launch", failing)
    family_runs = []
    family = library_conv.ConvAlone._family
    monkeypatch.setattr(library_conv.ConvAlone, "_family", lambda self, *a: family_runs.append(1) or family(self, *a))
    x, w, spec = _inputs("2d-k3-p1")
    config = gn.ConvGroupNormConfig(conv=spec, groups=4).to_json()
    with pytest.warns(RuntimeWarning, match="a kernel failed"), torch.no_grad():
        out = gn.conv_group_norm(x, w, None, [], config)
    want = F.group_norm(F.conv2d(x.double(), w.double(), padding=1), 4)
    assert len(family_runs) == 1, "the Triton path's conv once; the fallback's conv is aten's"
    assert _rel(out, want) <= 2 * _rel(F.group_norm(F.conv2d(x, w, padding=1).float(), 4), want) + 1e-3
