"""A batch of 0.  At compile time the region is left to Inductor's code with an ``empty_tensor`` near
miss, and the result is eager's (an empty tensor of the right shape), whatever the family and even with
``decide="fuse"``.  At run time (a graph rewritten on a batch of 2, then called with a batch of 0) every
family's op launches no kernel and gives the module's own eager result: an empty output, zero gradients,
running statistics unchanged, on the reference and on the Triton path, strict or not, without a warning.
(A batch norm in eval mode folds into the conv epilogue.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from fusion_backend.match.engine import registered_patterns, run_patterns
from fusion_backend.report import ReasonKind, collect_reports


class ChannelLogSumExp(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)

    def forward(self, x):
        return torch.logsumexp(self.conv(x), dim=1)


MODELS = {
    "conv_epilogue": (lambda: nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.1), nn.MaxPool3d(2)),
                      (0, 2, 4, 4, 4)),
    "conv_group_norm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.SiLU()), (0, 2, 8, 8)),
    "conv_batch_norm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), (0, 2, 8, 8)),
    "conv_layer_norm": (lambda: nn.Sequential(nn.Conv2d(2, 6, 3), nn.LayerNorm(6)), (0, 2, 8, 8)),
    "conv_global_mean": (lambda: nn.Sequential(nn.ConvTranspose2d(2, 4, 3), nn.AdaptiveAvgPool2d(1)), (0, 2, 8, 8)),
    "conv_channel_reduce": (ChannelLogSumExp, (0, 2, 8, 8)),
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_an_empty_batch_runs_inductors_code_and_gives_eagers_result(family):
    make, shape = MODELS[family]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(*shape)
    torch._dynamo.reset()
    with torch.no_grad(), collect_reports() as reports:
        out = torch.compile(model, backend="fusion", options={"decide": "fuse", "strict": True})(x)
        want = model(x)
    torch._dynamo.reset()
    assert out.shape == want.shape and out.numel() == 0
    assert not any(r.matches for r in reports)
    misses = [m for r in reports for m in r.near_misses if m.reason is ReasonKind.EMPTY_TENSOR]
    assert any(m.pattern == family for m in misses), [(m.pattern, m.reason.value) for r in reports for m in r.near_misses]
    assert running_stats_unchanged(model)


def running_stats_unchanged(model: nn.Module) -> bool:
    """Eager leaves a batch norm's running statistics as they were on an empty batch."""
    return all(torch.equal(m.running_mean, torch.zeros_like(m.running_mean))
               and torch.equal(m.running_var, torch.ones_like(m.running_var))
               for m in model.modules() if isinstance(m, nn.BatchNorm2d))


def rewritten_graph(model: nn.Module, x: torch.Tensor, strict: bool) -> tuple[torch.fx.GraphModule, list, list[str]]:
    """``(graph, example inputs, fused patterns)``: Dynamo's graph of ``model(x)`` with every region fused."""
    captured = {}

    def backend(gm, example_inputs):
        result = run_patterns(gm, registered_patterns(), strict=strict)
        captured.update(gm=gm, inputs=list(example_inputs), fused=[m.pattern for m in result.matches])
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x)
    return captured["gm"], captured["inputs"], captured["fused"]


def run_graph(gm, inputs, differentiable, train):
    """``(output, {position: gradient} of the ``differentiable`` positions, the inputs as the call left them)``."""
    leaves = [t.detach().clone().requires_grad_(train and i in differentiable) for i, t in enumerate(inputs)]
    out = gm(*leaves)
    out = out[0] if isinstance(out, (tuple, list)) else out
    if train:
        out.sum().backward()
    return out.detach(), {i: t.grad for i, t in enumerate(leaves) if t.requires_grad}, leaves


def run_eager(model, x, graph_inputs, train):
    """The same for the module itself (``graph_inputs``: the graph's inputs, ``x`` among them, the
    module's parameters and buffers the others), its gradients placed at the graph inputs they belong to."""
    leaf = x.detach().clone().requires_grad_(train)
    out = model(leaf)
    if train:
        out.sum().backward()
    by_identity = {id(p): p.grad for p in model.parameters()} | {id(x): leaf.grad}
    return out.detach(), {i: by_identity[id(t)] for i, t in enumerate(graph_inputs) if id(t) in by_identity}


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_an_empty_batch_launches_nothing_and_gives_eagers_result(family, train, strict, kernels, kernel_device,
                                                                 fresh_plans):  # fmt: skip
    make, shape = MODELS[family]
    torch.manual_seed(0)
    model = make().to(kernel_device).train(train)
    x = torch.randn(2, *shape[1:], device=kernel_device)
    gm, inputs, fused = rewritten_graph(model, x, strict)
    assert family in fused or (family == "conv_batch_norm" and not train and fused == ["conv_epilogue"]), fused
    empty = x[:0]
    graph_inputs = [empty if t is x else t for t in inputs]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty call is no failure: nothing to warn about
        warnings.filterwarnings("ignore", module="triton.runtime.interpreter")
        differentiable = {i for i, t in enumerate(graph_inputs) if t is empty or isinstance(t, nn.Parameter)}
        out, grads, after = run_graph(gm, graph_inputs, differentiable, train)
    want_out, want_grads = run_eager(model, empty, graph_inputs, train)
    assert out.shape == want_out.shape and out.dtype == want_out.dtype and out.numel() == 0
    if train:
        assert set(grads) == set(want_grads), (sorted(grads), sorted(want_grads))
        for i, g in grads.items():
            torch.testing.assert_close(g, want_grads[i], rtol=0, atol=0)
    for a, t in zip(after, graph_inputs, strict=True):  # the running statistics: left alone by an empty batch, in both
        if any(t is b for b in model.buffers()):
            torch.testing.assert_close(a, t, rtol=0, atol=0)
