"""autograd-free ops (``ops/autograd_free.py``): compiled graphs call every fused op through its autograd-free op,
which computes exactly what the op does, and a post-grad pass the user configured still runs."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops import conv_global_mean as cgm
from fusion_backend.ops.autograd_free import autograd_free_of

FUSED_OPS = {
    "conv_global_mean_fwd": cgm.conv_global_mean_fwd,
    "conv_global_mean_bwd": cgm.conv_global_mean_bwd,
    "conv_epilogue_fwd": ce.conv_epilogue_fwd,
    "conv_epilogue_bwd": ce.conv_epilogue_bwd,
}


class MeanHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.ConvTranspose2d(3, 5, 3, stride=2)
        self.bias = nn.Parameter(torch.randn(5, 1, 1))

    def forward(self, x):
        y = self.conv(x).mean((2, 3), keepdim=True) + self.bias
        return torch.logsumexp(y, dim=1).sum() * 10.0


class EpilogueHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.m = nn.Parameter(torch.randn(4, 1, 1))

    def forward(self, x):
        return F.max_pool2d(F.leaky_relu(self.conv(x) * self.m, 0.1), 2)


def test_every_fused_op_has_an_autograd_free_op_with_the_same_schema():
    for name, op in FUSED_OPS.items():
        free_op = autograd_free_of(op._opoverload)
        assert free_op is not None, name
        assert free_op._schema.name == f"fusion::{name}_noautograd"
        signature = str(op._opoverload._schema).split("(", 1)[1]
        assert str(free_op._schema) == f"fusion::{name}_noautograd({signature}"


def test_the_autograd_free_op_returns_what_the_op_returns():
    torch.manual_seed(1)
    x, w, b = torch.rand(2, 3, 6, 7), torch.randn(3, 5, 3, 3), torch.randn(5)
    spec = ConvSpec(transposed=True, stride=(2, 2), padding=(1, 0), dilation=(1, 1), output_padding=(1, 0), groups=1)
    config = cgm.ConvGlobalMeanConfig(conv=spec).to_json()
    expected = cgm.conv_global_mean_fwd(x, w, b, [], config, False)
    got = autograd_free_of(cgm.conv_global_mean_fwd._opoverload)(x, w, b, [], config, False)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def _compiled_code(model, x, options=None):
    fn = torch.compile(model, backend="fusion", options=options or {})

    def step():
        out = fn(x)
        out.sum().backward()
        return out

    return run_and_get_code(step)


def test_compiled_forward_and_backward_call_the_autograd_free_ops_and_match_eager():
    for model, x, names in (
        (MeanHead(), torch.rand(2, 3, 5, 4), ("conv_global_mean_fwd", "conv_global_mean_bwd")),
        (EpilogueHead(), torch.rand(2, 3, 9, 8), ("conv_epilogue_fwd", "conv_epilogue_bwd")),
    ):
        torch._dynamo.reset()
        x_c = x.clone().requires_grad_(True)
        # direct=False: these graphs hold only the fused op, which would otherwise skip Inductor
        out, codes = _compiled_code(model, x_c, {"direct": False})
        code = "\n".join(codes)
        for name in names:
            assert f"torch.ops.fusion.{name}_noautograd.default(" in code, name
            assert f"torch.ops.fusion.{name}.default(" not in code, name
        compiled_grads = [x_c.grad, *(p.grad for p in model.parameters())]
        model.zero_grad()
        x_e = x.clone().requires_grad_(True)
        expected = model(x_e)
        expected.sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        for got, want in zip(compiled_grads, [x_e.grad, *(p.grad for p in model.parameters())], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class CountingPass(CustomGraphPass):
    def __init__(self):
        self.graphs = 0

    def __call__(self, graph):
        self.graphs += 1

    def uuid(self):
        return b"counting-pass"


def test_a_post_grad_pass_the_user_configured_still_runs():
    # a cache hit would skip every post-grad pass (correctly: the cached graph already had them).
    # NOTE: config.patch, not monkeypatch.setattr: undoing a setattr on torch 2.13's config module
    # left enable_autograd_cache hidden, and every later compile in the process failed.
    torch._dynamo.reset()
    user_pass = CountingPass()
    x = torch.rand(2, 3, 5, 4, requires_grad=True)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _, codes = _compiled_code(MeanHead(), x, {"post_grad_custom_post_pass": user_pass})
    assert user_pass.graphs == 2  # forward and backward graph
    assert "conv_global_mean_fwd_noautograd" in "\n".join(codes)


@pytest.mark.heavy
def test_the_swap_pass_has_one_cache_key_whatever_ops_a_process_has_imported(fresh_process_checks):
    """Inductor's caches key on the pass's ``uuid``: a second process that never imported a fused op
    (every region left to Inductor, decisions read from the cache) must find what the first stored
    (that process: the suite's second fresh one, ``tests/fresh_process_checks.py``, ``swap_pass``,
    which imports ``ops.autograd_free`` before anything else)."""
    from fusion_backend.ops.autograd_free import SwapInAutogradFreeOps

    here = SwapInAutogradFreeOps().uuid()
    fresh = fresh_process_checks["second"]["results"].get("swap_pass", {})
    assert "error" not in fresh and "uuid" in fresh, (fresh, fresh_process_checks["second"]["stderr"][-3000:])
    assert fresh["registered"] == 0  # that process registered no autograd-free op
    assert fresh["uuid"] == here.hex()
    assert SwapInAutogradFreeOps(CountingPass()).uuid() != here


def test_the_swap_pass_cache_key_changes_with_the_fused_ops_source(monkeypatch):
    """Inductor's compiled code asserts the strides a fused op's fake gave: a new version of the ops
    (a fake with another layout) must not reload code compiled against the old one."""
    from fusion_backend.ops import autograd_free

    here = autograd_free.SwapInAutogradFreeOps().uuid()
    monkeypatch.setattr(autograd_free, "ops_source_digest", lambda: b"another version of the ops")
    assert autograd_free.SwapInAutogradFreeOps().uuid() != here


def test_a_graph_with_nothing_fused_compiles_as_backend_inductor_does():
    """Without a fused op the graph gets no autograd-free pass: the same Inductor config, so the same
    code and the cache entries ``backend="inductor"`` stored (a first call that costs no more)."""
    import copy

    from torch._dynamo.utils import counters

    model, x = EpilogueHead(), torch.rand(2, 3, 9, 8)
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=True):
        torch._dynamo.reset()
        torch.compile(copy.deepcopy(model), backend="inductor")(x)
        torch._dynamo.reset()
        hits = counters["inductor"]["fxgraph_cache_hit"]
        out = torch.compile(model, backend="fusion", options={"decide": "inductor"})(x)
        assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1
    torch.testing.assert_close(out, model(x))
