"""On CUDA, fp32 with TF32 allowed (cuDNN's default): forced fusion is never much further from float64
than eager.  cuDNN runs some fp32 convs in full fp32 although TF32 is allowed (narrow convs, 3 input
channels, in the caller's NCHW layout); a fused op that ran them in TF32 (on channels-last copies, or
in its own Triton kernels) landed 30-3000x further from float64 than eager and moved argmin / argmax
winners.  The fused ops follow the precision eager's conv uses (``ops/conv_precision.py``).

Each case: the output and every gradient (input and parameters) of one training step, compiled with
``decide="fuse"``, against the model run in float64 on the same inputs; the fused error may be at most
``BOUND`` times eager's own error plus ``FLOOR`` (norm-wise, relative).  ``conv_epilogue``'s cases run
with its path measured (``FUSION_CONV_IMPL=auto`` with timing on: the suite's conftest turns timing
off, which leaves every call on the library path in the caller's layout, eager's own conv) and with
its Triton conv kernels forced (``triton``: ``kernels/conv_dense.py`` forward, the Triton conv
backward).  Skipped without a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend import impl_choice
from fusion_backend.report import collect_reports
from fusion_backend.testing import compare, float64_reference, relative_error, run_and_backward, stable_seed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: The fused error may be at most this many times eager's (both against float64) ...
BOUND = 4.0
#: ... plus this (relative): two full-fp32 results summed in different orders are a few 1e-7 apart.
FLOOR = 1e-6


@pytest.fixture
def tf32_allowed():
    """TF32 allowed for cuDNN's convs (torch's default), the matmul flag as torch leaves it."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cudnn.allow_tf32 = saved


class ConvMinTanh(nn.Module):
    def __init__(self, channels: int = 16):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3)

    def forward(self, x):
        return torch.tanh(torch.min(self.conv(x), 1).values)


class ConvSoftmax(nn.Module):
    def __init__(self, channels: int = 16):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3)

    def forward(self, x):
        return torch.softmax(self.conv(x), dim=1)


class ConvLogsumexp(nn.Module):
    def __init__(self, channels: int = 16):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3)

    def forward(self, x):
        return torch.logsumexp(self.conv(x), dim=1)


class ConvBatchNormRelu(nn.Module):
    def __init__(self, channels: int = 16):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(self.norm(self.conv(x)))


class ConvMulLeakyGelu(nn.Module):
    """The ``conv2d_mul_leaky_gelu`` seeds at small sizes: Conv2d k3 -> x m -> leaky -> gelu."""

    def __init__(self, c_in: int = 64, c_out: int = 64):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3)
        self.multiplier = nn.Parameter(torch.randn(c_out, 1, 1))

    def forward(self, x):
        return F.gelu(F.leaky_relu(self.conv(x) * self.multiplier))


def _step_is_within_bound(model: nn.Module, x: torch.Tensor, expect: dict[str, int] | None, compiled) -> None:
    """One training step of ``compiled`` (``model`` compiled) against eager and float64 on ``x``;
    ``expect``: the rewrites of the graph this step compiles (None: it compiles none)."""
    model.zero_grad(set_to_none=True)
    eager_model = copy.deepcopy(model)

    def fresh():
        return [x.detach().clone().requires_grad_(True)]

    want, want_grads = run_and_backward(eager_model, fresh(), True, eager_model)
    ref, ref_grads = float64_reference(eager_model, fresh(), True)
    with collect_reports() as reports:
        got, got_grads = run_and_backward(compiled, fresh(), True, model)
    counts: dict[str, int] = {}
    for report in reports:
        for name, n in report.counts().items():
            counts[name] = counts.get(name, 0) + n
    problems = [] if counts == (expect or {}) else [f"rewrites: expected {expect}, got {counts}"]
    pairs = [("output", got, want, ref)] + [
        (f"grad of {name}", got_grads[name], w, ref_grads[name]) for name, w in want_grads.items()
    ]  # fmt: skip
    for name, g, w, r in pairs:
        assert g is not None and w is not None, f"{name}: missing"
        eager_error = relative_error(w, r)
        problem = compare(name, g, w, tol=BOUND * eager_error + FLOOR, reference=r)
        if problem is not None:
            problems.append(f"{problem}\n    (eager's own error {eager_error:.3g}, fused {relative_error(g, r):.3g})")
    assert not problems, "\n".join(problems)


CASES = {
    "conv3-min-tanh": (ConvMinTanh, (4, 3, 16, 16), {"conv_channel_reduce": 1}),
    "conv3-softmax": (ConvSoftmax, (4, 3, 16, 16), {"conv_channel_reduce": 1}),
    "conv3-logsumexp": (ConvLogsumexp, (4, 3, 16, 16), {"conv_channel_reduce": 1}),
    "conv3-batch-norm-relu": (ConvBatchNormRelu, (4, 3, 16, 16), {"conv_batch_norm": 1}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forced_fusion_is_as_exact_as_eager_with_tf32_allowed(case, tf32_allowed) -> None:
    build, shape, expect = CASES[case]
    torch.manual_seed(stable_seed(case))
    model = build().cuda()
    x = torch.randn(shape, device="cuda")
    compiled = torch.compile(model, backend="fusion", options={"decide": "fuse", "strict": True})
    _step_is_within_bound(model, x, expect, compiled)


@pytest.fixture(params=["auto", "triton"])
def conv_impl(request, monkeypatch, tmp_path, fresh_plans):
    """``conv_epilogue``'s path: measured per shape (timing on, answers in an empty cache folder), or
    its Triton conv kernels forced."""
    monkeypatch.setenv("FUSION_CONV_IMPL", request.param)
    monkeypatch.setenv("FUSION_CONV_AUTOTUNE", "1" if request.param == "auto" else "0")
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    impl_choice.forget_in_memory()
    yield request.param
    impl_choice.forget_in_memory()


def test_conv_epilogue_on_a_narrow_conv_is_as_exact_as_eager_with_tf32_allowed(conv_impl, tf32_allowed) -> None:
    """The small ``conv2d_mul_leaky_gelu`` seed's Conv2d(3, 16, 3), which cuDNN runs in full fp32."""
    torch.manual_seed(stable_seed("conv2d 3 16 mul leaky gelu"))
    model = ConvMulLeakyGelu(3, 16).cuda()
    compiled = torch.compile(model, backend="fusion", options={"decide": "fuse", "strict": True})
    _step_is_within_bound(model, torch.rand(8, 3, 32, 32, device="cuda"), {"conv_epilogue": 1}, compiled)


def test_dynamic_conv_epilogue_is_as_exact_as_eager_with_tf32_allowed(conv_impl, tf32_allowed) -> None:
    """``dynamic=True``: one graph with symbolic sizes serves every shape; each shape's step is
    checked (the first compiles, the others reuse the graph)."""
    torch.manual_seed(stable_seed("dynamic conv2d 64 mul leaky gelu"))
    model = ConvMulLeakyGelu().cuda()
    compiled = torch.compile(model, backend="fusion", dynamic=True, options={"decide": "fuse", "strict": True})
    for i, shape in enumerate(((2, 64, 10, 12), (3, 64, 14, 9))):
        x = torch.rand(shape, device="cuda")  # the seed's inputs: uniform in [0, 1)
        _step_is_within_bound(model, x, None if i else {"conv_epilogue": 1}, compiled)
