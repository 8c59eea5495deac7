"""``fusion::attention`` (``ops/attention``) against float64 with eager's own error as the yardstick:
the output and the gradients of q, k and v, on its Triton path (the matmuls and the row-softmax
kernels; on CPU under the interpreter, ``FUSION_CPU_KERNELS=triton``) and its reference; strided
inputs, unequal lengths and value widths, 3-d inputs, row chunks, an empty batch; the failure policy
and the one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.errors import KernelError
from fusion_backend.ops import attention as att
from fusion_backend.ops.attention import AttentionConfig, attention, triton_path

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
LOW_DTYPES = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def _inputs(shapes, dtype, seed, transposed=False):
    torch.manual_seed(seed)
    ts = [torch.randn(s, device=DEVICE, dtype=dtype) * 1.5 for s in shapes]
    if transposed:  # (B, L, H, E) storage seen as (B, H, L, E): how attention layers hand heads over
        ts = [t.transpose(-3, -2).contiguous().transpose(-3, -2) for t in ts]
    return ts


def _check_against_float64(q, k, v, scale, factor=2.0):
    """The op's output and gradients within ``factor`` x eager's error of float64 (or 1e-6)."""
    cfg = AttentionConfig(scale=scale, strict=True).to_json()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    got = attention(*leaves, cfg)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, leaves, grad)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*exact, scale=scale)
    want_grads = torch.autograd.grad(want, exact, grad.double())
    eager_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager = F.scaled_dot_product_attention(*eager_leaves, scale=scale)
    eager_grads = torch.autograd.grad(eager, eager_leaves, grad)
    assert got.shape == want.shape and got.dtype == q.dtype and got.is_contiguous()
    for name, a, e, w in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (eager, *eager_grads), (want, *want_grads), strict=False):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        if w.norm() == 0:  # (one key: the softmax is constant, q's gradient exactly zero)
            assert a.abs().max() <= 1e-6, name
            continue
        err, eager_err = _rel(a, w), _rel(e, w)
        assert err <= max(factor * eager_err, 1e-6), (name, err, eager_err)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_DTYPES], ids=str)
@pytest.mark.parametrize("case", ["heads-strided", "unequal-lengths", "3d", "one-key"])
def test_the_triton_path_is_within_eager_s_error_of_float64(triton_on_cpu, dtype, case):
    shapes, transposed = {
        "heads-strided": (((2, 3, 7, 40), (2, 3, 7, 40), (2, 3, 7, 40)), True),
        "unequal-lengths": (((2, 2, 5, 24), (2, 2, 11, 24), (2, 2, 11, 9)), False),
        "3d": (((3, 6, 16), (3, 13, 16), (3, 13, 16)), False),
        "one-key": (((2, 4, 8), (2, 1, 8), (2, 1, 8)), False),
    }[case]
    q, k, v = _inputs(shapes, dtype, seed=len(case), transposed=transposed)
    _check_against_float64(q, k, v, scale=shapes[0][-1] ** -0.5 * 1.3)


def test_no_scale_is_eager_s_default(triton_on_cpu):
    """``scale=None``: ``1 / sqrt(E)`` of the call's head dim, as eager's default."""
    q, k, v = _inputs(((2, 5, 24), (2, 6, 24), (2, 6, 24)), torch.float16, seed=8)
    torch.testing.assert_close(attention(q, k, v, AttentionConfig(strict=True).to_json()),
                               attention(q, k, v, AttentionConfig(scale=24 ** -0.5, strict=True).to_json()),
                               rtol=0, atol=0)  # fmt: skip
    _check_against_float64(q, k, v, scale=None)


def test_rows_in_chunks_give_the_same_result(triton_on_cpu, monkeypatch):
    """Scores past ``SCORE_BYTES`` go by chunks of query rows (the weights' gradients summed in fp32):
    the result is the single chunk's within rounding, and within eager's error of float64."""
    q, k, v = _inputs(((2, 3, 9, 16), (2, 3, 10, 16), (2, 3, 10, 16)), torch.float16, seed=5)
    cfg = AttentionConfig(scale=0.25, strict=True).to_json()
    whole = attention(q, k, v, cfg)
    monkeypatch.setattr(triton_path, "SCORE_BYTES", 2 * 3 * 10 * 4 * 2)  # two rows a chunk
    assert len(triton_path._chunks(6, 9, 10)) == 5
    torch.testing.assert_close(attention(q, k, v, cfg), whole, rtol=0, atol=0)
    _check_against_float64(q, k, v, scale=0.25)


def test_the_reference_serves_where_the_kernels_do_not(monkeypatch):
    """Without the CPU kernels switch (or in float64) the op is eager's attention."""
    monkeypatch.delenv("FUSION_CPU_KERNELS", raising=False)
    q, k, v = _inputs(((2, 5, 8), (2, 6, 8), (2, 6, 8)), torch.float64, seed=6)
    got = attention(q, k, v, AttentionConfig(scale=0.5).to_json())
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, scale=0.5))


def test_an_empty_batch_computes_nothing(triton_on_cpu):
    q, k, v = (torch.randn(0, 2, 5, 8, device=DEVICE, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, AttentionConfig(scale=0.5, strict=True).to_json())
    assert out.shape == (0, 2, 5, 8)
    out.sum().backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (q, k, v))


def test_a_failing_kernel_raises_under_strict_and_falls_back_to_eager_s_result_otherwise(triton_on_cpu, monkeypatch):
    def broken(*_args):
        raise RuntimeError("boom")

    monkeypatch.setattr(triton_path, "forward", broken)
    monkeypatch.setattr(att, "_REFERENCE_ONLY", set())
    q, k, v = _inputs(((1, 4, 8), (1, 4, 8), (1, 4, 8)), torch.float16, seed=7)
    with pytest.raises(KernelError, match=r"fusion::attention forward Triton path failed .* RuntimeError: boom"):
        attention(q, k, v, AttentionConfig(scale=0.5, strict=True).to_json())
    with pytest.warns(RuntimeWarning, match="Falling back to the plain-torch reference"):
        got = attention(q, k, v, AttentionConfig(scale=0.5).to_json())
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, scale=0.5))
    assert att._REFERENCE_ONLY, "the failed signature is not remembered"


def test_bad_inputs_are_one_clear_error():
    cfg = AttentionConfig(scale=0.5).to_json()
    with pytest.raises(ValueError, match=r"fusion::attention: q \[2, 4, 8\], k \[2, 4, 6\] and v \[2, 4, 8\] do not pair"):
        attention(torch.randn(2, 4, 8), torch.randn(2, 4, 6), torch.randn(2, 4, 8), cfg)
    with pytest.raises(ValueError, match="need one floating dtype, got torch.float32, torch.float16"):
        attention(torch.randn(2, 4, 8), torch.randn(2, 4, 8).half(), torch.randn(2, 4, 8), cfg)
