"""The ``attention`` family end to end: which ``scaled_dot_product_attention`` calls it takes (heads
wider than flash attention's 256, fp16 / bf16, no mask, dropout, causality or grouped heads) and why
it leaves the others (near misses), autocast's casts moved before the op, and the compiled model
against float64 (forward and every gradient) with eager's error as the yardstick; on the GPU at the
Stable Diffusion VAE's mid-block shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.testing import assert_fused, dry_run

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


class SelfAttention(nn.Module):
    """A diffusers-style attention block: one projection each for q, k, v, heads split by a view and a
    transpose, ``F.scaled_dot_product_attention``, the heads merged and projected back, a residual."""

    def __init__(self, channels: int, heads: int = 1, **sdpa) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(channels, channels) for _ in range(4))
        self.heads, self.sdpa = heads, sdpa

    def forward(self, x):
        batch, length, channels = x.shape
        q, k, v = (proj(x).view(batch, length, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, **self.sdpa)
        return self.out(o.transpose(1, 2).reshape(batch, length, channels)) + x


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")


def _regions(model, x):
    return dry_run(model.eval().requires_grad_(False), [x], patterns=["attention"])


def test_a_head_wider_than_flash_attention_s_is_one_region():
    found = _regions(SelfAttention(2 * 272, heads=2).half(), torch.randn(2, 9, 2 * 272).half())
    assert [summary for _, summary, _ in found.regions] == ["attention(head dim 272)"]


@pytest.mark.parametrize("case,message", [
    ("narrow-head", "head dim 64: torch's flash attention kernel takes heads up to 256"),
    ("causal", "attention with is_causal=True: the fused op takes none"),
    ("dropout", "attention with dropout_p=0.1"),
    ("fp32", "attention in torch.float32"),
])  # fmt: skip
def test_what_the_family_leaves_says_why(case, message):
    model, x = {
        "narrow-head": (SelfAttention(128, heads=2), torch.randn(2, 9, 128).half()),
        "causal": (SelfAttention(320, is_causal=True), torch.randn(2, 9, 320).half()),
        "dropout": (SelfAttention(320, dropout_p=0.1), torch.randn(2, 9, 320).half()),
        "fp32": (SelfAttention(320), torch.randn(2, 9, 320)),
    }[case]
    found = _regions(model.to(x.dtype), x)
    assert not found.regions
    (miss,) = found.near_misses
    assert message in miss.message, miss.message


def test_a_mask_is_left_to_eager_s_kernel():
    class Masked(SelfAttention):
        def forward(self, x):
            q = self.q(x).unsqueeze(1)
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    found = _regions(Masked(320).half(), torch.randn(2, 9, 320).half())
    assert not found.regions and "attn_mask" in found.near_misses[0].message


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_the_compiled_block_is_within_eager_s_error_of_float64(triton_on_cpu, train):
    """Forward and, training, the gradients of the input and of every projection's parameters, the
    fused op on its Triton path (the interpreter on CPU: fp16)."""
    torch.manual_seed(3)
    model = SelfAttention(2 * 264, heads=2).to(DEVICE)
    x = torch.randn(2, 11, 2 * 264, device=DEVICE)
    assert_fused(model, [x], expect={"attention": 1}, train=train, dtype=torch.float16)


def test_autocast_s_casts_move_before_the_op(triton_on_cpu, tmp_path):
    """Under autocast an attention over fp32 tensors computes in the autocast dtype: the graph casts
    q, k and v to it before the op (autocast does not see the op), and the result is eager's under
    autocast, within its error of float64."""
    torch.manual_seed(4)
    x = torch.randn(2, 3, 9, 288, device=DEVICE)

    def block(t):
        with torch.autocast(DEVICE, dtype=torch.float16):
            return F.scaled_dot_product_attention(t, t * 0.5, t.flip(-2)) * 2

    compiled = torch.compile(block, backend="fusion", options={"decide": "fuse", "strict": True, "dump_dir": str(tmp_path)})
    got, want = compiled(x), block(x)
    exact = F.scaled_dot_product_attention(x.double(), x.double() * 0.5, x.double().flip(-2)) * 2
    err, eager_err = ((got.double() - exact).norm() / exact.norm()), ((want.double() - exact).norm() / exact.norm())
    assert got.dtype == want.dtype == torch.float16 and err <= 2 * eager_err, (err, eager_err)
    (after,) = tmp_path.glob("**/after.py")
    code = after.read_text()
    assert "scaled_dot_product_attention" not in code and "fusion.attention.default(" in code, code
    assert code.count("torch.float16)") == 3, code


def test_dynamic_shapes_run_one_graph_within_eager_s_error(triton_on_cpu, tmp_path):
    """``dynamic=True``: every size symbolic, the head dim judged by its hint and the default scale
    computed at run time; other lengths then run the same graph, each within eager's error."""
    from torch._dynamo.utils import counters

    def block(q, k, v):
        return F.scaled_dot_product_attention(q, k, v) * 2

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="fusion", dynamic=True,
                             options={"decide": "fuse", "strict": True, "dump_dir": str(tmp_path)})  # fmt: skip
    for seed, (length, keys) in enumerate(((5, 7), (9, 4), (3, 3))):
        torch.manual_seed(seed)
        q, k, v = (torch.randn(2, 1, n, 288, device=DEVICE).half() for n in (length, keys, keys))
        got, eager = compiled(q, k, v), block(q, k, v)
        exact = block(q.double(), k.double(), v.double())
        err, eager_err = ((got.double() - exact).norm() / exact.norm()), ((eager.double() - exact).norm() / exact.norm())
        assert err <= 2 * eager_err, (length, keys, err, eager_err)
    assert counters["stats"]["unique_graphs"] == 1
    (after,) = tmp_path.glob("**/after.py")
    assert "fusion.attention.default(" in after.read_text()
    assert '"scale":null' in after.read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_vae_mid_block_s_attention_is_within_eager_s_error_of_float64_on_gpu(dtype):
    """One head of 512 over 4096 positions (the SD VAE decoder's at a 512 x 512 image), forward and
    the gradients of q, k and v, the fused op against eager, both measured against float64."""
    from fusion_backend.ops.attention import AttentionConfig, attention

    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 4096, 1, 512, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3))
    cfg = AttentionConfig(scale=512 ** -0.5, strict=True).to_json()
    grad = torch.randn(1, 1, 4096, 512, device="cuda", dtype=dtype)
    results = {}
    for name, fn in (("fused", lambda *t: attention(*t, cfg)), ("eager", F.scaled_dot_product_attention)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        results[name] = (out, *torch.autograd.grad(out, leaves, grad))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*exact)
    want = (out, *torch.autograd.grad(out, exact, grad.double()))
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        err = ((results["fused"][i].double() - want[i]).norm() / want[i].norm()).item()
        eager_err = ((results["eager"][i].double() - want[i]).norm() / want[i].norm()).item()
        assert err <= 2 * eager_err, (name, err, eager_err)
