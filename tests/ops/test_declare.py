"""``ops/declare.py``: the autograd formula and the direct ``autograd.Function`` that every declared
fused op gets, exercised through conv_group_norm
(CPU reference): the direct implementation gives the custom ops' output and gradients, a gradient
asked of a forward that saved nothing is a clear error, and a direct op returning its state keeps
that state out of autograd.
"""

from __future__ import annotations

import pytest
import torch

from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops.conv_group_norm import CONV_GROUP_NORM, ConvGroupNormConfig, conv_group_norm
from fusion_backend.ops.direct_impls import direct_impl

CONV2D = ConvSpec(False, (1, 1), (1, 1), (1, 1), (0, 0), 1)


def _inputs(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 5, 6, generator=gen)
    w = torch.randn(4, 3, 3, 3, generator=gen) * 0.5
    b = torch.randn(4, generator=gen)
    gamma, beta = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    return [t.requires_grad_() for t in (x, w, b, gamma, beta)]


CONFIG = ConvGroupNormConfig(CONV2D, 2, 1e-5, 0, 1).to_json()


def test_the_direct_implementation_gives_the_custom_ops_output_and_every_gradient() -> None:
    via_ops, direct = _inputs(), _inputs()
    out = conv_group_norm(*via_ops[:3], via_ops[3:], CONFIG)
    out_direct = direct_impl(conv_group_norm)(*direct[:3], direct[3:], CONFIG)
    assert type(out_direct.grad_fn).__name__ == "Direct_conv_group_normBackward"
    torch.testing.assert_close(out_direct, out, rtol=0, atol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, via_ops, g), torch.autograd.grad(out_direct, direct, g), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_a_gradient_of_a_forward_that_saved_nothing_names_the_entry_point() -> None:
    x, w, b, gamma, beta = _inputs()
    out = torch.ops.fusion.conv_group_norm_fwd(x, w, b, [gamma, beta], CONFIG, False)[0]
    with pytest.raises(RuntimeError, match=r"conv_group_norm_fwd ran with save_for_backward=False.*call conv_group_norm\(\)"):
        out.sum().backward()


def test_a_direct_function_returning_its_state_keeps_it_out_of_autograd() -> None:
    Direct = CONV_GROUP_NORM.direct_function(outputs=2)
    x, w, b, gamma, beta = _inputs()
    out, stats = Direct.apply(CONFIG, x, w, b, gamma, beta)
    assert not stats.requires_grad and out.requires_grad
    assert tuple(stats.shape) == (2, 2, 2)  # the (2, N, groups) mean and rstd
    (gx,) = torch.autograd.grad(out.sum(), [x])
    assert gx.shape == x.shape


def test_a_signature_whose_kernel_failed_takes_the_reference_from_then_on(monkeypatch, kernel_device) -> None:
    """A Triton failure warns once and runs the reference; later calls of that signature skip the kernel
    (no second failure to pay for), a call of another signature tries it again."""
    import dataclasses

    import fusion_backend.ops.failure as failure

    attempts = []

    def broken(direction):
        def run(*args):
            attempts.append((direction, tuple(args[0 if direction == "forward" else 1].shape)))
            raise RuntimeError(f"{direction} kernel exploded")
        return run

    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")  # (on the CPU: the Triton path under the interpreter)
    monkeypatch.setattr(failure, "_warned", set())
    op = CONV_GROUP_NORM
    monkeypatch.setattr(op, "d", dataclasses.replace(op.d, triton_forward=broken("forward"),
                                                     triton_backward=broken("backward"), settled_forward=None,
                                                     settled_backward=None))  # fmt: skip
    monkeypatch.setattr(op, "_reference_only", set())
    monkeypatch.setattr(op, "_cuda_paths", {})

    def step(x_shape):
        _, w, b, gamma, beta = (t.detach().to(kernel_device).requires_grad_() for t in _inputs())
        x = torch.randn(x_shape, generator=torch.Generator().manual_seed(1)).to(kernel_device).requires_grad_()
        out = conv_group_norm(x, w, b, [gamma, beta], CONFIG)
        out.sum().backward()
        return out.detach(), x.grad

    with pytest.warns(RuntimeWarning) as warned:
        fallen_back = step((2, 3, 5, 6))
    messages = [str(w.message) for w in warned]
    assert any("forward Triton kernel failed" in m and "forward kernel exploded" in m for m in messages), messages
    assert any("backward Triton kernel failed" in m and "backward kernel exploded" in m for m in messages), messages
    assert attempts == [("forward", (2, 3, 5, 6)), ("backward", (2, 3, 5, 6))]
    step((2, 3, 5, 6))
    assert len(attempts) == 2  # the same signature: straight to the reference
    step((1, 3, 5, 7))  # another signature tries the kernels again
    assert attempts[2:] == [("forward", (1, 3, 5, 7)), ("backward", (1, 3, 5, 7))]
    monkeypatch.setattr(op, "d", dataclasses.replace(op.d, kernel_problem=lambda cfg: "the reference, for comparison"))
    monkeypatch.setattr(op, "_cuda_paths", {})
    for got, want in zip(fallen_back, step((2, 3, 5, 6)), strict=True):  # the reference's result
        torch.testing.assert_close(got, want, rtol=0, atol=0)
