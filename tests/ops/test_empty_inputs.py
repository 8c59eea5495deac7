"""Empty inputs reach a fused op only at run time (the matcher leaves a region whose example is empty to
Inductor): a graph rewritten on a batch of 2 and then called with a batch of 0.  Every family's op then
launches no kernel and gives the module's own eager result (an empty output, zero gradients, running
statistics unchanged), on the reference and on the Triton path, strict or not, without a warning.  (A
batch norm in eval mode folds into the conv epilogue.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from fusion_backend.match.engine import registered_patterns, run_patterns

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


class ChannelLogSumExp(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)

    def forward(self, x):
        return torch.logsumexp(self.conv(x), dim=1)


class GlobalMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.ConvTranspose2d(2, 4, 3, stride=2)

    def forward(self, x):
        return self.conv(x).mean((2, 3)) + 1.0


MODELS = {
    "conv_epilogue": (lambda: nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.1), nn.MaxPool3d(2)),
                      (2, 2, 4, 4, 4)),
    "conv_group_norm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.SiLU()), (2, 2, 8, 8)),
    "conv_batch_norm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), (2, 2, 8, 8)),
    "conv_layer_norm": (lambda: nn.Sequential(nn.Conv2d(2, 6, 3), nn.LayerNorm(6)), (2, 2, 8, 8)),
    "conv_global_mean": (GlobalMean, (2, 2, 8, 8)),
    "conv_channel_reduce": (ChannelLogSumExp, (2, 2, 8, 8)),
}


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


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_an_empty_batch_launches_nothing_and_gives_eagers_result(family, train, strict, kernels, kernel_device,
                                                                 fresh_plans):  # fmt: skip
    make, shape = MODELS[family]
    torch.manual_seed(0)
    model = make().to(kernel_device).train(train)
    x = torch.randn(*shape, device=kernel_device)
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
