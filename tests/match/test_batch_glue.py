"""``match/batch_glue``: a rewritten inference graph's eval batch norm scale-and-shift calls become one
batched call (``bn_fold.BATCHED``), each region reading a slice of its results: the same outputs as
eager against float64's yardstick, on the CPU reference and on the Triton kernels (interpreter or
CUDA), through Inductor and run directly; calls that cannot share one (another eps, other dtypes, gamma
on one only) group apart; where the statistics require grad with grad mode on, nothing is batched and
every gradient matches eager's."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn

from fusion_backend.match.batch_glue import batch_scale_and_shift
from fusion_backend.ops import bn_fold
from fusion_backend.testing import assert_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _block(c_in: int, c_out: int, k: int, **bn) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False), nn.BatchNorm2d(c_out, **bn),
                         nn.ReLU())


class Blocks(nn.Module):
    """Four conv -> eval BN -> ReLU blocks: two share everything, one has another eps, one no affine; then
    a cumulative sum, so that the graph runs through Inductor (``tail=True``), or nothing: fused ops alone."""

    def __init__(self, tail: bool = True) -> None:
        super().__init__()
        self.tail = tail
        self.a, self.b = _block(3, 8, 3), _block(8, 6, 1)
        self.c, self.d = _block(6, 6, 3, eps=1e-3), _block(6, 5, 3, affine=False)
        gen = torch.Generator().manual_seed(5)
        for bn in (m[1] for m in (self.a, self.b, self.c, self.d)):
            with torch.no_grad():
                bn.running_mean.copy_(torch.randn(bn.num_features, generator=gen))
                bn.running_var.copy_(torch.rand(bn.num_features, generator=gen) + 0.5)
                if bn.affine:
                    bn.weight.copy_(torch.randn(bn.num_features, generator=gen))
                    bn.bias.copy_(torch.randn(bn.num_features, generator=gen))

    def forward(self, x):
        y = self.c(self.b(self.a(x)))
        y = self.d(y)
        return torch.cumsum(y, 1) if self.tail else y


def _batched_calls(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is bn_fold.BATCHED]


@pytest.fixture
def batched(monkeypatch):
    """How many calls each rewrite's pass replaced."""
    from fusion_backend.match import engine

    counts = []
    monkeypatch.setattr(engine, "batch_scale_and_shift", lambda gm: counts.append(batch_scale_and_shift(gm)))
    return counts


@pytest.mark.parametrize("tail", [True, False], ids=["inductor", "direct"])
def test_an_inference_graph_s_batch_norms_share_one_scale_and_shift_call(kernels, batched, tail):
    model = Blocks(tail).eval().to(DEVICE)
    x = torch.randn(2, 3, 7, 9, device=DEVICE)
    with torch.no_grad():
        (report,) = assert_fused(model, [x], expect={"conv_epilogue": 4}, train=False)
    assert report.runner == ("inductor" if tail else "direct")
    assert batched == [2]  # a and b share one call; c (another eps) and d (no affine) have theirs


def test_the_pass_groups_what_can_share_a_call_and_slices_each_region_s_values():
    """Straight on a graph: the two batch norms with eps 1e-5 and affine share a call, the others stay
    apart (one each: nothing to share); each region reads ``narrow`` + ``view`` of the results."""
    graph = torch.fx.Graph()
    stats = {}
    for name, c, affine in (("a", 8, True), ("b", 6, True), ("c", 6, True), ("d", 5, False)):
        nodes = []
        for part in ("mean", "var", "gamma", "beta"):
            if part in ("gamma", "beta") and not affine:
                nodes.append(None)
                continue
            node = graph.placeholder(f"{name}_{part}")
            node.meta["example_value"] = torch.ones(c)
            nodes.append(node)
        stats[name] = nodes
    outputs = []
    for name, nodes in stats.items():
        call = graph.call_function(bn_fold.scale_and_shift, (*nodes, 1e-3 if name == "c" else 1e-5, 2))
        outputs += [graph.call_function(operator.getitem, (call, i)) for i in (0, 1)]
    graph.output(tuple(outputs))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert batch_scale_and_shift(gm) == 2
    gm.graph.lint()
    (batched,) = _batched_calls(gm)
    assert [n.name for n in batched.args[1]] == ["a_var", "b_var"] and batched.args[4] == 1e-5
    assert sum(1 for n in gm.graph.nodes if n.target is bn_fold.scale_and_shift) == 2  # c and d, alone
    gm.recompile()
    g = torch.Generator().manual_seed(1)
    values = {n.name: (torch.rand(n.meta["example_value"].numel(), generator=g) + 0.5)
              for n in gm.graph.nodes if n.op == "placeholder"}  # fmt: skip
    got = gm(*values.values())
    want = []
    for name in stats:
        args = [values.get(f"{name}_{p}") for p in ("mean", "var", "gamma", "beta")]
        want += bn_fold.scale_and_shift(*args, 1e-3 if name == "c" else 1e-5, 2)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_statistics_that_require_grad_in_grad_mode_are_not_batched_and_gradients_match(kernels, batched):
    """Fine-tuning with frozen statistics: gamma and beta require grad, so each region keeps its own
    differentiable call, and every gradient (input, conv weights, gamma, beta) is eager's."""
    model = Blocks().eval().to(DEVICE)
    assert_fused(model, [torch.randn(2, 3, 7, 9, device=DEVICE)], expect={"conv_epilogue": 4}, train=True)
    assert batched == [0]


def test_statistics_another_node_reads_keep_their_own_call():
    """A running variance that another node reads too (which could write it between the calls) keeps its
    call where it is; the two others still share one."""
    graph = torch.fx.Graph()
    calls = []
    for name in "abc":
        nodes = []
        for part in ("mean", "var"):
            node = graph.placeholder(f"{name}_{part}")
            node.meta["example_value"] = torch.ones(4)
            nodes.append(node)
        calls.append(graph.call_function(bn_fold.scale_and_shift, (*nodes, None, None, 1e-5, 1)))
    other = graph.call_method("add_", (calls[2].args[1], 1.0))  # c's variance, written in place
    graph.output((*(graph.call_function(operator.getitem, (c, 0)) for c in calls), other))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert batch_scale_and_shift(gm) == 2
    gm.graph.lint()
    (batched,) = _batched_calls(gm)
    assert [n.name for n in batched.args[1]] == ["a_var", "b_var"]
    assert [n.args[1].name for n in gm.graph.nodes if n.target is bn_fold.scale_and_shift] == ["c_var"]


def test_frozen_batch_norms_in_a_training_graph_share_one_call_and_gradients_match(kernels, batched):
    """Training with frozen batch norms (statistics and affine parameters not requiring grad, as
    detection backbones freeze them): the calls share one, and the gradients of the input and the
    conv weights are eager's."""
    model = Blocks().eval().to(DEVICE)
    for bn in (m[1] for m in (model.a, model.b, model.c, model.d)):
        bn.requires_grad_(False)
    x = torch.randn(2, 3, 7, 9, device=DEVICE, requires_grad=True)
    assert_fused(model, [x], expect={"conv_epilogue": 4}, train=True)
    assert batched == [2]
