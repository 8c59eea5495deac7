"""``fusion::attention``: scaled dot-product attention with the scores in fp32, for head dims past
what torch's flash kernel takes.

``attention(q, k, v, config)`` has eager semantics::

    out = F.scaled_dot_product_attention(q, k, v, scale=config.scale)   # no mask, no dropout, not causal

``q`` ``(*B, L, E)``, ``k`` ``(*B, S, E)``, ``v`` ``(*B, S, Ev)`` with the same leading dims ``*B`` (batch
and heads), one floating dtype, any strides; ``out`` ``(*B, L, Ev)`` contiguous in that dtype,
differentiable in q, k and v.  Nothing but the inputs is kept for the backward (the scores are
recomputed).

WHY: eager's attention on CUDA takes the flash kernel for head dims up to 256; past that (the
single-head, 512-wide attention of the Stable Diffusion VAE's mid-block) it falls back to the
memory-efficient kernel, which is far off the chip's matmul rate there, and its backward further.  Two
library matmuls around a softmax over fp32 scores (``triton_path``) are faster where the scores fit in
memory by chunks of rows, and round what flash rounds: the probabilities, once, before ``p @ v``.
NOTE: H200, bf16, the VAE decoder's region (one head of 512 over 4096 positions) as the decision
measured it, GPU time per call: forward 0.110 against eager's 0.333 ms, forward and backward 0.349
against 5.912 ms (``python -m fusion_backend bench --log --suite demos/realnets/sd_vae_decoder.py
--dtype bf16 --mode infer --backends inductor,fusion-decide-all --no-memory --no-cold --no-chart
--compile-mode reduce-overhead``, and ``--mode train``).  The price is host time (the region's 0.27 against
0.07 ms per call: in the default mode the decision leaves it to Inductor) and memory: the fp32 scores of a chunk (``SCORE_BYTES``), twice in
the backward, where eager's kernels hold a few rows.

Implementations (``ops/failure.py``'s policy): the Triton path on CUDA (fp32, fp16, bf16) and on the
CPU under ``FUSION_CPU_KERNELS=triton`` with the interpreter; else, or where a kernel fails, the
reference (``reference.py``), eager's own op.  A call that fails on the Triton path takes the reference
for its signature from then on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...kernels.host import kernels_unavailable
from ..autograd_free import register_autograd_free
from ..failure import kernel_failed, triton_or_reference, triton_serves
from . import reference, triton_path
from .config import AttentionConfig

OP = "attention"

#: Signatures (direction, shapes, strides, dtype, device) whose Triton path failed: the reference from then on.
_REFERENCE_ONLY: set[tuple[Any, ...]] = set()


def _signature(direction: str, tensors: tuple[Tensor, ...]) -> tuple[Any, ...]:
    return (direction, *((tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors))


def _run(direction: str, tensors: tuple[Tensor, ...], cfg: AttentionConfig, triton: Any, ref: Any) -> Any:
    """One direction under the failure policy: ``triton(*tensors, scale)`` where the Triton path serves
    the call and has not failed on its signature, else ``ref(*tensors, scale)``."""
    q, k, v = tensors[-3:]
    why = triton_path.unsupported(q, k, v)
    serves = triton_serves(OP, why, cfg.strict, q.device.type) and not (
        _REFERENCE_ONLY and _signature(direction, tensors) in _REFERENCE_ONLY)

    def failed(error: Exception) -> None:
        what = (f"fusion::{OP} {direction} Triton path failed for q {list(q.shape)} k {list(k.shape)} v "
                f"{list(v.shape)} {q.dtype} on {q.device}: {type(error).__name__}: {error}")
        kernel_failed(what, error, cfg.strict, (OP, direction))
        _REFERENCE_ONLY.add(_signature(direction, tensors))

    return triton_or_reference(serves, lambda: triton(*tensors, cfg.scale), lambda: ref(*tensors, cfg.scale), failed)


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    """One-line errors for inputs eager's attention would also refuse."""
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"fusion::{OP}: q, k and v need one rank of at least 2, got {q.dim()}, {k.dim()} and {v.dim()}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(f"fusion::{OP}: q {list(q.shape)}, k {list(k.shape)} and v {list(v.shape)} do not pair "
                         "((*B, L, E), (*B, S, E), (*B, S, Ev))")  # fmt: skip
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"fusion::{OP}: q, k and v need one floating dtype, got {q.dtype}, {k.dtype} and {v.dtype}")


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, config: str) -> Tensor:
    _check(q, k, v)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return reference.forward(q, k, v, AttentionConfig.from_json(config).scale)
    return _run("forward", (q, k, v), AttentionConfig.from_json(config), triton_path.forward, reference.forward)


def _forward_fake(q: Tensor, k: Tensor, v: Tensor, config: str) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _backward_impl(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, config: str) -> list[Tensor]:
    _check(q, k, v)
    cfg = AttentionConfig.from_json(config)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:  # nothing reached the output: zero gradients
        return [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    return list(_run("backward", (grad_out, q, k, v), cfg, triton_path.backward, reference.backward))


def _backward_fake(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, config: str) -> list[Tensor]:
    return [t.new_empty(t.shape) for t in (q, k, v)]


attention_op = torch.library.custom_op(f"fusion::{OP}", _forward_impl, mutates_args=(),
                                       schema="(Tensor q, Tensor k, Tensor v, str config) -> Tensor")  # fmt: skip
attention_op.register_fake(_forward_fake)
attention_bwd_op = torch.library.custom_op(f"fusion::{OP}_bwd", _backward_impl, mutates_args=(),
                                           schema="(Tensor grad_out, Tensor q, Tensor k, Tensor v, str config) -> Tensor[]")  # fmt: skip
attention_bwd_op.register_fake(_backward_fake)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    q, k, v, config = inputs
    ctx.save_for_backward(q, k, v)
    ctx.config = config


def _autograd_backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
    q, k, v = ctx.saved_tensors
    dq, dk, dv = attention_bwd_op(grad_out, q, k, v, ctx.config)
    return dq, dk, dv, None


attention_op.register_autograd(_autograd_backward, setup_context=_setup_context)
register_autograd_free(attention_op, _forward_impl, _forward_fake)
register_autograd_free(attention_bwd_op, _backward_impl, _backward_fake)

#: what the rewriter puts into graphs: the custom op's overload (AOTAutograd's cache can vouch for it)
ATTENTION = attention_op._opoverload


def attention(q: Tensor, k: Tensor, v: Tensor, config: str) -> Tensor:
    """The public entry point (module docstring)."""
    return attention_op(q, k, v, config)


def kernel_path(dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """``("triton", None)`` when the Triton path serves this dtype on this device type, else
    ``("reference", why)`` (a call's own shapes may still send it to the reference)."""
    why = kernels_unavailable(dtype, device_type)
    return ("reference", why) if why is not None else ("triton", None)


__all__ = ["ATTENTION", "OP", "AttentionConfig", "attention", "kernel_path"]
