"""The plain-torch reference of ``fusion::attention``: eager's own ``scaled_dot_product_attention``
forward, and its gradients through autograd on the inputs (nothing else is kept between the
directions).  It runs on the CPU, in float64 and wherever the Triton path does not serve a call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def forward(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """Eager's attention, contiguous (the op's output layout)."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale).contiguous()


def backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``, each contiguous in its input's dtype."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, scale=scale)
        grads = torch.autograd.grad(out, leaves, grad_out)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]
