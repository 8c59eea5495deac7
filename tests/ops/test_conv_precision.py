"""``ops/conv_precision.py``: whether eager's conv runs TF32 or full fp32, asked of cuDNN once per call
signature, and the fused ops' convs following the answer.

There is no cuDNN on CPU: the probe is pointed at CPU tensors (``_probes_device``) and its conv is
replaced by a fake cuDNN that rounds its operands to TF32 when TF32 is allowed (a TF32 kernel) or
ignores the flag (a full-fp32 kernel).  The fused ops' wiring is checked by patching the probe's
answer and watching ``torch.backends.cudnn.allow_tf32`` inside their conv calls, and the precision
their Triton kernels are planned with.  The GPU end-to-end check is
``tests/e2e/test_fp32_precision_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
from conv_cases import GELU, LEAKY, MUL0, conv_spec
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from fusion_backend.ir.specs import ConvSpec
from fusion_backend.kernels import conv_dense, conv_fused_bwd, host
from fusion_backend.kernels.tf32 import backward_dot_precision
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops import conv_precision, library_conv
from fusion_backend.ops.chain import ChainStep, PointwiseKind
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.ops.conv_batch_norm import ConvBatchNormConfig, conv_batch_norm
from fusion_backend.ops.conv_channel_reduce import ConvChannelReduceConfig, conv_channel_reduce
from fusion_backend.ops.conv_io import run_conv, run_conv_backward
from fusion_backend.testing import stable_seed

CONV2D = conv_spec(2)
CONVT2D = conv_spec(2, stride=2, transposed=True, output_padding=1)
STRIDED = ConvSpec(False, (1, 2), (1, 0), (1, 1), (0, 0), 1)

#: The Triton paths on CPU tensors (the fused ops' kernels, the epilogue kernels) need the interpreter.
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.fixture
def tf32_allowed(fresh_plans):
    """TF32 allowed (the default), every kept answer and plan forgotten before and after."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved


@pytest.fixture
def probed(monkeypatch, tf32_allowed):
    """The probe runs on CPU tensors, as it does on CUDA ones; returns the list of probes run."""
    monkeypatch.setattr(conv_precision, "_probes_device", lambda x: x.device.type == "cpu" and not is_fake(x))
    runs = []
    for name in ("_probe_forward", "_probe_backward"):
        real = getattr(conv_precision, name)
        monkeypatch.setattr(conv_precision, name, lambda *a, _real=real, _name=name: runs.append(_name) or _real(*a))
    return runs


def answering(monkeypatch, forward: bool, backward: tuple[bool, bool]) -> list[str]:
    """The probe points at CPU tensors and answers as given (whether eager's conv uses TF32: forward,
    (input gradient, weight gradient)); returns the list of probes run."""
    monkeypatch.setattr(conv_precision, "_probes_device", lambda x: x.device.type == "cpu" and not is_fake(x))
    runs = []
    monkeypatch.setattr(conv_precision, "_probe_forward", lambda *a: runs.append("forward") or forward)
    monkeypatch.setattr(conv_precision, "_probe_backward", lambda *a: runs.append("backward") or backward)
    return runs


def to_tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` (fp32) rounded to the nearest TF32 value (10 mantissa bits), as cuDNN's TF32 kernels do."""
    return ((t.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


def tf32_cudnn_conv(x, weight, bias, spec):
    """A cuDNN that runs a TF32 kernel whenever TF32 is allowed."""
    if torch.backends.cudnn.allow_tf32:
        x, weight = to_tf32(x), to_tf32(weight)
    return run_conv(x, weight, bias, spec)


def reordered_fp32_conv(x, weight, bias, spec):
    """A cuDNN whose kernel with TF32 allowed is another full-fp32 one: sums in another order (here
    in float64, rounded once), never bitwise equal to the TF32-off kernel's."""
    if torch.backends.cudnn.allow_tf32:
        return run_conv(x.double(), weight.double(), None if bias is None else bias.double(), spec).float()
    return run_conv(x, weight, bias, spec)


def inputs(spec: ConvSpec, c_in: int = 3, c_out: int = 8, size=(7, 6), dtype=torch.float32):
    gen = torch.Generator().manual_seed(stable_seed((spec, c_in, c_out, size)))
    x = torch.randn((2, c_in, *size), generator=gen).to(dtype)
    shape = (c_in, c_out // spec.groups, 3, 3) if spec.transposed else (c_out, c_in // spec.groups, 3, 3)
    return x, (torch.randn(shape, generator=gen) * 0.3).to(dtype)


# ------------------------------------------------------------------------------------------------
# The probe
# ------------------------------------------------------------------------------------------------


def test_the_probe_s_data_shows_tf32_and_keeps_the_caller_s_layout_and_alignment(tf32_allowed) -> None:
    """TF32 turns the lossy value into 1 exactly; the synthetic tensors have the caller's shape,
    strides and data address modulo the alignment cuDNN's choice can depend on."""
    assert to_tf32(torch.tensor([conv_precision._LOSSY, -conv_precision._LOSSY])).tolist() == [1.0, -1.0]
    assert torch.tensor(conv_precision._LOSSY).item() != 1.0
    storage = torch.empty(2 * 3 * 5 * 4 + 3)
    x = storage[3:].view(2, 5, 4, 3).permute(0, 3, 1, 2)  # channels-last, 12 bytes past an aligned address
    gen = torch.Generator().manual_seed(0)
    xs = conv_precision._synthetic(x, gen)
    assert (xs.shape, xs.stride()) == (x.shape, x.stride())
    assert xs.data_ptr() % conv_precision._ALIGNMENT == x.data_ptr() % conv_precision._ALIGNMENT
    assert set(xs.abs().unique().tolist()) == {conv_precision._LOSSY}
    assert (xs > 0).any() and (xs < 0).any()
    assert conv_precision._synthetic(x, None).eq(1).all()


@pytest.mark.parametrize("spec", [CONV2D, CONVT2D, STRIDED], ids=["conv2d", "convT2d-s2", "strided"])
def test_a_tf32_kernel_is_seen(spec, probed, monkeypatch) -> None:
    monkeypatch.setattr(conv_precision, "run_conv", tf32_cudnn_conv)
    x, w = inputs(spec)
    assert conv_precision.forward_tf32(x, w, spec) == (True, True)
    assert probed == ["_probe_forward"]
    assert torch.backends.cudnn.allow_tf32, "the probe left TF32 off"


@pytest.mark.parametrize("conv", [run_conv, reordered_fp32_conv], ids=["same-kernel", "other-fp32-kernel"])
def test_a_full_fp32_kernel_is_seen(conv, probed, monkeypatch) -> None:
    """Bitwise equal results, or another fp32 kernel's summation order: full fp32 either way."""
    monkeypatch.setattr(conv_precision, "run_conv", conv)
    x, w = inputs(CONV2D, c_in=64, size=(5, 5))
    assert conv_precision.forward_tf32(x, w, CONV2D) == (False, True)


def test_a_zero_weight_cannot_hide_tf32(probed, monkeypatch) -> None:
    """The probe's own data decides, not the op's: a zero-initialised weight (on which a TF32 and a
    full-fp32 conv agree exactly) still shows the TF32 kernel."""
    monkeypatch.setattr(conv_precision, "run_conv", tf32_cudnn_conv)
    x, _ = inputs(CONV2D)
    assert conv_precision.forward_tf32(x, torch.zeros(8, 3, 3, 3), CONV2D).tf32


def _backward_with(dgrad_tf32: bool, wgrad_tf32: bool):
    """A cuDNN backward whose input-gradient and weight-gradient kernels run TF32 (when allowed) as given."""

    def conv_backward(grad_y, x, weight, spec, need_x, need_w, need_b=False):
        def rounded(on: bool, *ts):
            return [to_tf32(t) if on and torch.backends.cudnn.allow_tf32 else t for t in ts]

        gy, w = rounded(dgrad_tf32, grad_y, weight)
        grad_x = run_conv_backward(gy, x, w, spec, need_x, False)[0]
        gy, xx = rounded(wgrad_tf32, grad_y, x)
        grad_w = run_conv_backward(gy, xx, weight, spec, False, need_w)[1]
        return grad_x, grad_w, None

    return conv_backward


@pytest.mark.parametrize("dgrad, wgrad", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("spec", [CONV2D, CONVT2D], ids=["conv2d", "convT2d-s2"])
def test_each_gradient_s_precision_is_seen(spec, dgrad, wgrad, probed, monkeypatch) -> None:
    monkeypatch.setattr(conv_precision, "run_conv_backward", _backward_with(dgrad, wgrad))
    x, w = inputs(spec)
    assert conv_precision.backward_tf32(x, w, spec) == (dgrad, wgrad, True)
    assert probed == ["_probe_backward"]


def test_answers_are_kept_per_signature(probed, monkeypatch) -> None:
    """One probe per signature: shapes, strides, data alignment, the conv and cuDNN's flags."""
    monkeypatch.setattr(conv_precision, "run_conv", tf32_cudnn_conv)
    x, w = inputs(CONV2D)
    for _ in range(3):
        assert conv_precision.forward_tf32(x, w, CONV2D).tf32
    assert len(probed) == 1
    conv_precision.forward_tf32(x.clone(), w.clone(), CONV2D)  # other tensors, same signature
    assert len(probed) == 1
    conv_precision.forward_tf32(x.contiguous(memory_format=torch.channels_last), w, CONV2D)
    assert len(probed) == 2
    conv_precision.forward_tf32(x, w, STRIDED)
    assert len(probed) == 3
    shifted = torch.empty(x.numel() + 1)[1:].view(x.shape).copy_(x)  # 4 bytes off the usual alignment
    conv_precision.forward_tf32(shifted, w, CONV2D)
    assert len(probed) == 4
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    conv_precision.forward_tf32(x, w, CONV2D)
    assert len(probed) == 5


def test_no_probe_for_half_types_tf32_off_or_tensors_without_cudnn(probed, monkeypatch) -> None:
    """bf16 / fp16 convs have nothing to ask (the answer is the flag), nor has an fp32 conv with TF32
    off (full fp32); fake tensors and tensors of a device without cuDNN neither."""
    x, w = inputs(CONV2D)
    for dtype in (torch.bfloat16, torch.float16):
        assert conv_precision.forward_tf32(x.to(dtype), w.to(dtype), CONV2D) == (True, True)
        assert conv_precision.backward_tf32(x.to(dtype), w.to(dtype), CONV2D) == (True, True, True)
    assert conv_precision.forward_tf32(x, w, CONV2D, torch.bfloat16) == (True, True)  # autocast's compute dtype
    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        assert conv_precision.forward_tf32(fx, fw, CONV2D) == (True, True)
    for dtype in (torch.bfloat16, torch.float16):  # through the families' library conv too
        xh, wh = x.to(dtype), w.to(dtype)
        library_conv.conv_forward(xh, wh, CONV2D, channels_last=True)
        library_conv.conv_backward_plan(xh, wh, CONV2D, xh)
        assert conv_precision.plan_key(xh, CONV2D) == ()  # nothing added to the plans' keys
    torch.backends.cudnn.allow_tf32 = False
    assert conv_precision.forward_tf32(x, w, CONV2D) == (False, True)
    assert conv_precision.backward_tf32(x, w, CONV2D) == (False, False, True)
    library_conv.conv_forward(x, w, CONV2D, channels_last=True)
    library_conv.conv_backward_plan(x, w, CONV2D, x)
    assert probed == []
    monkeypatch.undo()  # the real device check: a CPU tensor has no cuDNN
    torch.backends.cudnn.allow_tf32 = True
    assert conv_precision.forward_tf32(x, w, CONV2D) == (True, True)


def test_no_probe_during_a_cuda_graph_capture(probed, monkeypatch) -> None:
    """While capturing: the kept answer, else full fp32, unsettled (so that no plan keeps it)."""
    monkeypatch.setattr(conv_precision, "run_conv", tf32_cudnn_conv)
    monkeypatch.setattr(conv_precision, "run_conv_backward", _backward_with(True, True))
    monkeypatch.setattr(conv_precision, "_capturing", lambda: True)
    x, w = inputs(CONV2D)
    assert conv_precision.forward_tf32(x, w, CONV2D) == (False, False)
    assert conv_precision.backward_tf32(x, w, CONV2D) == (False, False, False)
    assert probed == []
    monkeypatch.setattr(conv_precision, "_capturing", lambda: False)
    assert conv_precision.forward_tf32(x, w, CONV2D) == (True, True)
    assert conv_precision.backward_tf32(x, w, CONV2D) == (True, True, True)
    monkeypatch.setattr(conv_precision, "_capturing", lambda: True)
    assert conv_precision.forward_tf32(x, w, CONV2D) == (True, True)
    assert conv_precision.backward_tf32(x, w, CONV2D) == (True, True, True)
    assert probed == ["_probe_forward", "_probe_backward"]


def test_a_failing_probe_answers_full_fp32(probed, monkeypatch) -> None:
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("no memory for the probe")

    monkeypatch.setattr(conv_precision, "run_conv", out_of_memory)
    monkeypatch.setattr(conv_precision, "run_conv_backward", out_of_memory)
    x, w = inputs(CONV2D)
    assert conv_precision.forward_tf32(x, w, CONV2D) == (False, True)
    assert conv_precision.backward_tf32(x, w, CONV2D) == (False, False, True)
    assert torch.backends.cudnn.allow_tf32


def test_the_context_only_ever_turns_tf32_off(tf32_allowed) -> None:
    with conv_precision.cudnn_tf32(False):
        assert not torch.backends.cudnn.allow_tf32
        with conv_precision.cudnn_tf32(True):
            assert not torch.backends.cudnn.allow_tf32
    assert torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    with conv_precision.cudnn_tf32(True):
        assert not torch.backends.cudnn.allow_tf32
    assert not torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    with pytest.raises(RuntimeError), conv_precision.cudnn_tf32(False):
        raise RuntimeError("a failing conv")
    assert torch.backends.cudnn.allow_tf32


def test_kernel_backward_precision_follows_the_answer_not_only_the_flag(tf32_allowed, monkeypatch) -> None:
    monkeypatch.setattr(host, "INTERPRETER", False)  # as on a GPU (the interpreter always computes "ieee")
    assert backward_dot_precision(torch.float32, False) == "ieee"
    assert backward_dot_precision(torch.float32, True) == "tf32"
    assert backward_dot_precision(torch.float32) == "tf32"  # no answer: the cuDNN flag
    assert backward_dot_precision(torch.bfloat16, True) == "ieee"
    torch.backends.cudnn.allow_tf32 = False
    assert backward_dot_precision(torch.float32) == "ieee"


# ------------------------------------------------------------------------------------------------
# The library conv of the norm and channel-reduction families
# ------------------------------------------------------------------------------------------------


def watching(monkeypatch, module, name: str) -> list:
    """``module.name`` (a conv call) recording ``torch.backends.cudnn.allow_tf32`` at each call on real
    tensors (``library_conv.nominal_format`` runs the conv on fakes for its layout)."""
    seen = []
    real = getattr(module, name)

    def watched(*args):
        if not any(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
            seen.append(bool(torch.backends.cudnn.allow_tf32))
        return real(*args)

    monkeypatch.setattr(module, name, watched)
    return seen


@pytest.mark.parametrize("eager_tf32", [False, True], ids=["eager-full-fp32", "eager-tf32"])
def test_the_library_forward_follows_eager_s_precision(eager_tf32, monkeypatch, tf32_allowed) -> None:
    """The channels-last conv runs with TF32 off exactly where eager's conv runs full fp32; the flag is
    the user's again afterwards, and the answer is asked once per signature."""
    runs = answering(monkeypatch, eager_tf32, (eager_tf32, eager_tf32))
    seen = watching(monkeypatch, library_conv, "run_conv")
    x, w = inputs(CONV2D)
    want = run_conv(x, w, None, CONV2D)
    for _ in range(2):
        got = library_conv.conv_forward(x, w, CONV2D, channels_last=True)
        torch.testing.assert_close(got, want)
    assert seen == [eager_tf32, eager_tf32] and runs == ["forward"]
    assert torch.backends.cudnn.allow_tf32


def test_the_library_forward_asks_nothing_in_eager_s_own_layout(monkeypatch, tf32_allowed) -> None:
    """A conv left in the caller's layout is eager's own call: eager's precision, no probe."""
    runs = answering(monkeypatch, False, (False, False))
    seen = watching(monkeypatch, library_conv, "run_conv")
    x, w = inputs(CONV2D)
    library_conv.conv_forward(x, w, CONV2D, channels_last=False)
    assert seen == [True] and runs == []


@interpreted  # the channels-last relayout is a Triton kernel, here on CPU tensors
@pytest.mark.parametrize("answer", [(False, False), (True, False), (False, True), (True, True)])
def test_the_library_backward_follows_eager_s_precision_per_gradient(answer, monkeypatch, tf32_allowed) -> None:
    """Each gradient with TF32 off where eager's computes it in full fp32: one call where both
    gradients share an answer, two where they do not; gradients unchanged."""
    runs = answering(monkeypatch, True, answer)
    calls = []
    real = conv_precision.run_conv_backward

    def watched(grad_y, x, weight, spec, need_x, need_w, need_b=False):
        calls.append((need_x, need_w, bool(torch.backends.cudnn.allow_tf32)))
        return real(grad_y, x, weight, spec, need_x, need_w, need_b)

    monkeypatch.setattr(conv_precision, "run_conv_backward", watched)
    x, w = inputs(CONV2D)
    y = run_conv(x, w, None, CONV2D)
    plan = library_conv.conv_backward_plan(x, w, CONV2D, y)
    grad_y = plan.new_grad_y(x.device).copy_(torch.randn_like(y))
    got = plan(grad_y, x, w, True, True, True)
    want = run_conv_backward(grad_y, x, w, CONV2D, True, True, True)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)
    expected = [(True, True, answer[0])] if answer[0] == answer[1] else [(True, False, answer[0]), (False, True, answer[1])]
    assert calls == expected and runs == ["backward"]
    calls.clear()
    plan(grad_y, x, w, False, True, False)  # only the weight gradient: its own answer
    assert calls == [(False, True, answer[1])]
    assert torch.backends.cudnn.allow_tf32


def test_plans_made_during_a_capture_without_an_answer_are_not_kept(monkeypatch, tf32_allowed) -> None:
    """Planned during a capture: full fp32 and not kept, so that the next call outside one probes."""
    runs = answering(monkeypatch, True, (True, True))
    monkeypatch.setattr(conv_precision, "_capturing", lambda: True)
    seen = watching(monkeypatch, library_conv, "run_conv")
    x, w = inputs(CONV2D)
    library_conv.conv_forward(x, w, CONV2D, channels_last=True)
    plan = library_conv.conv_backward_plan(x, w, CONV2D, x)
    assert (plan.tf32, plan.settled) == ((False, False), False) and seen == [False] and runs == []
    monkeypatch.setattr(conv_precision, "_capturing", lambda: False)
    library_conv.conv_forward(x, w, CONV2D, channels_last=True)
    plan = library_conv.conv_backward_plan(x, w, CONV2D, x)
    assert (plan.tf32, plan.settled) == ((True, True), True) and seen == [False, True]
    assert runs == ["forward", "backward"]


def _fused_op_case(family: str):
    """``(fn, tensors)``: a Conv2d(3, 8, 3) family op (config json bound) and its fp32 inputs."""
    x, w = inputs(CONV2D)
    b = torch.randn(8, generator=torch.Generator().manual_seed(5))
    if family == "conv_channel_reduce":
        cfg = ConvChannelReduceConfig(CONV2D, "min", post=(ChainStep(PointwiseKind.TANH),), strict=True)
        return lambda x, w, b: conv_channel_reduce(x, w, b, [], cfg.to_json()), (x, w, b)
    cfg = ConvBatchNormConfig(CONV2D, eps=1e-5, weight=0, bias=1, post=(ChainStep(PointwiseKind.RELU),), strict=True)
    gamma, beta = torch.rand(8) + 0.5, torch.randn(8)
    return lambda x, w, b: conv_batch_norm(x, w, b, [gamma, beta], cfg.to_json()), (x, w, b)


@interpreted
@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("family", ["conv_channel_reduce", "conv_batch_norm"])
@pytest.mark.parametrize("eager_tf32", [False, True], ids=["eager-full-fp32", "eager-tf32"])
def test_the_fused_ops_library_convs_follow_eager_s_precision(family, kernels, eager_tf32, monkeypatch,
                                                              tf32_allowed) -> None:  # fmt: skip
    """Through the ops (their plain-torch reference and their Triton path under the interpreter):
    every channels-last library conv, forward and backward, runs with TF32 off where eager's conv
    runs full fp32, and as before where it runs TF32."""
    if kernels == "triton":
        monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    answering(monkeypatch, eager_tf32, (eager_tf32, eager_tf32))
    forward = watching(monkeypatch, library_conv, "run_conv")
    backward = watching(monkeypatch, conv_precision, "run_conv_backward")
    fn, tensors = _fused_op_case(family)
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert forward and set(forward) == {eager_tf32}
    if kernels == "triton":  # the reference's backward runs eager's conv backward in the caller's layouts
        assert backward and set(backward) == {eager_tf32}
    assert torch.backends.cudnn.allow_tf32


# ------------------------------------------------------------------------------------------------
# conv_epilogue: its Triton kernels and its channels-last library paths
# ------------------------------------------------------------------------------------------------


def _epilogue_case(pool=None):
    x, w = inputs(CONV2D, c_in=3, c_out=6, size=(6, 7))
    gen = torch.Generator().manual_seed(9)
    b, m = torch.randn(6, generator=gen), torch.randn(6, 1, 1, generator=gen)
    cfg = ConvEpilogueConfig(conv=CONV2D, chain=(MUL0, LEAKY, GELU), pool=pool, strict=True)
    return x, w, b, [m], cfg


@interpreted
@pytest.mark.parametrize("eager_tf32", [False, True], ids=["eager-full-fp32", "eager-tf32"])
def test_the_fused_conv_kernel_is_planned_with_eager_s_precision(eager_tf32, monkeypatch, tf32_allowed) -> None:
    """``conv_dense`` (the dynamic-shape Conv2d + chain's fused kernel) gets ``allow_tf32`` from the
    probe, not from the flag alone."""
    answering(monkeypatch, eager_tf32, (eager_tf32, eager_tf32))
    told = []
    real = conv_dense.forward_launch
    monkeypatch.setattr(conv_dense, "forward_launch", lambda *a, **k: told.append(k["allow_tf32"]) or real(*a, **k))
    x, w, b, ops, cfg = _epilogue_case()
    assert ce.forward.forward_kernels(x, w, cfg) is conv_dense
    plan = ce.forward.FusedForward(x, w, b, ops, cfg, True)
    assert told == [eager_tf32] and plan.settled


@interpreted
@pytest.mark.parametrize("answer", [(False, False), (True, False), (False, True)])
def test_the_triton_conv_backward_is_planned_with_eager_s_precision(answer, monkeypatch, tf32_allowed) -> None:
    answering(monkeypatch, True, answer)
    told = []
    real = conv_fused_bwd.backward_plan
    monkeypatch.setattr(conv_fused_bwd, "backward_plan", lambda *a, **k: told.append(k["allow_tf32"]) or real(*a, **k))
    x, w, b, ops, cfg = _epilogue_case()
    out, saved_y0, saved_winner = ce.reference.forward(x, w, b, ops, cfg, True)
    plan = ce.backward.TritonBackward(torch.randn_like(out), x, w, b, ops, saved_y0, saved_winner, cfg,
                                      [True, True, True, True])  # fmt: skip
    assert told == [answer] and plan.settled


@interpreted
def test_the_channels_last_library_paths_follow_eager_s_precision(monkeypatch, tf32_allowed) -> None:
    """``ChannelsLastLibraryForward``'s conv and the channels-last ``LibraryBackward``'s conv
    backward run with TF32 off where eager's run full fp32; the library paths in the caller's own
    layouts are eager's calls and ask nothing."""
    runs = answering(monkeypatch, False, (False, True))
    forward = watching(monkeypatch, ce.forward, "run_conv")
    calls = []
    real = conv_precision.run_conv_backward

    def watched(grad_y, x, weight, spec, need_x, need_w, need_b=False):
        calls.append((need_x, need_w, bool(torch.backends.cudnn.allow_tf32)))
        return real(grad_y, x, weight, spec, need_x, need_w, need_b)

    monkeypatch.setattr(conv_precision, "run_conv_backward", watched)
    x, w, b, ops, cfg = _epilogue_case()
    ce.forward.LibraryForward(x, w, b, ops, cfg, True)(x, w, b, ops)
    assert forward == [True] and runs == []
    out, saved_y0, saved_winner = ce.forward.ChannelsLastLibraryForward(x, w, b, ops, cfg, True)(x, w, b, ops)
    assert forward == [True, False] and runs == ["forward"]
    grad_out = torch.randn_like(out)
    mask = [True, True, True, True]
    ce.backward.LibraryBackward(grad_out, x, w, b, ops, saved_y0, saved_winner, cfg, mask)(
        grad_out, x, w, b, ops, saved_y0, saved_winner)  # fmt: skip
    assert calls == [(True, True, True)] and runs == ["forward"]
    calls.clear()
    plan = ce.backward.LibraryBackward(grad_out, x, w, b, ops, saved_y0, saved_winner, cfg, mask, channels_last=True)
    plan(grad_out, x, w, b, ops, saved_y0, saved_winner)
    assert calls == [(True, False, False), (False, True, True)] and runs == ["forward", "backward"]

