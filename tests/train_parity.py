"""Training steps of a model compiled with the fusion backend against an eager copy, everything
compared: what the norm families' end-to-end tests run."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fusion_backend.report import collect_reports


def train_steps(model: torch.nn.Module, shapes: Sequence[Sequence[int]], device: str = "cpu",
                options: Mapping[str, Any] | None = None, grad_atol: Mapping[str, float] | None = None,
                **compile_kwargs: Any) -> tuple[Any, torch.nn.Module, list]:  # fmt: skip
    """One training step per input shape of ``shapes``, of ``model`` compiled with the fusion backend
    (``decide="fuse"``, ``strict``, then ``options``; ``torch.compile``'s ``compile_kwargs``) and of an
    eager copy, from ``torch.manual_seed(0)``: the outputs, every parameter's gradient (``atol`` 1e-5, or
    ``grad_atol``'s by parameter name) and every buffer compared.  Returns ``(compiled, eager, reports)``,
    the reports of the compiles."""
    torch.manual_seed(0)
    model = model.to(device)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()  # a fresh compile under these options (Dynamo would reuse one of this code)
    compiled = torch.compile(model, backend="fusion", options={"decide": "fuse", "strict": True, **(options or {})},
                             **compile_kwargs)  # fmt: skip
    with collect_reports() as reports:
        for shape in shapes:
            x = torch.randn(shape, device=device)
            out, want = compiled(x), eager(x)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            g = torch.randn_like(want)
            out.backward(g)
            want.backward(g)
            for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
                atol = (grad_atol or {}).get(name, 1e-5)
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=atol, msg=name)
            for (name, b), c in zip(model.named_buffers(), eager.buffers(), strict=True):
                torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)
    return compiled, eager, reports
