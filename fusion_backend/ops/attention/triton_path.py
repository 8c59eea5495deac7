"""The Triton path of ``fusion::attention``: library matmuls around the row-softmax kernels.

Per chunk of query rows (all of them unless the fp32 scores would pass ``SCORE_BYTES``):

* forward: ``s = q @ k^T`` accumulated and written in fp32 (a batched matmul), ``p = softmax(s *
  scale)`` in the inputs' dtype (``kernels/softmax_rows.py``), ``out = p @ v``;
* backward: ``s`` again and ``dp = grad_out @ v^T`` (fp32), ``(p, ds)`` from the backward kernel, then
  ``dq = ds @ k``, ``dk = ds^T @ q`` and ``dv = p^T @ grad_out``; over several chunks ``dk`` and ``dv``
  sum in fp32 and are rounded once.

The matmuls take the inputs' dtype and accumulate in fp32, as eager's attention kernels do; fp32
inputs multiply in fp32 (TF32 where ``torch.backends.cuda.matmul.allow_tf32`` allows it).  Inputs:
``q`` ``(*B, L, E)``, ``k`` ``(*B, S, E)``, ``v`` ``(*B, S, Ev)`` with the same leading dims ``*B``,
any strides; every result is contiguous.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...kernels.host import kernels_unavailable
from ...kernels.softmax_rows import softmax_rows_plan

#: the most bytes one chunk's fp32 scores take (the backward holds two such tensors, ``s`` and ``dp``)
SCORE_BYTES = 256 << 20


def unsupported(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why the Triton path does not serve these inputs (``None`` when it does); the op has checked
    that they pair (``_check``) and are not empty."""
    why = kernels_unavailable(q.dtype, q.device.type)
    if why is None and q.dim() < 3:
        why = f"q, k and v of rank {q.dim()}: the Triton path takes a rank of at least 3"
    return why


def _bmm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (batched) accumulated and returned in fp32."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())  # (the CPU has no low-precision bmm into fp32)


def _resolved(scale: float | None, q: Tensor) -> float:
    """The scores' factor: ``scale``, or eager's default ``1 / sqrt(E)`` where it is ``None``."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _chunks(batch: int, rows: int, length: int) -> list[tuple[int, int]]:
    per = max(1, SCORE_BYTES // max(1, batch * length * 4))
    return [(r, min(rows, r + per)) for r in range(0, rows, per)]


def _flat(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, Tensor, Tensor, Tensor]:
    n = math.prod(q.shape[:-2])
    return n, q.reshape(n, *q.shape[-2:]), k.reshape(n, *k.shape[-2:]), v.reshape(n, *v.shape[-2:])


def forward(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    n, q3, k3, v3 = _flat(q, k, v)
    scale = _resolved(scale, q)
    rows, length = q3.shape[1], k3.shape[1]
    kt = k3.transpose(1, 2)
    chunks = _chunks(n, rows, length)
    if len(chunks) == 1:  # (the common case, in the fewest host ops: the op's host time is a region's cost)
        p = softmax_rows_plan(n * rows, length, q.dtype, q.device).forward(_bmm_fp32(q3, kt), scale)
        return torch.bmm(p, v3).view(*q.shape[:-1], v.shape[-1])
    out = torch.empty((n, rows, v3.shape[2]), dtype=q.dtype, device=q.device)
    for r0, r1 in chunks:
        p = softmax_rows_plan(n * (r1 - r0), length, q.dtype, q.device).forward(_bmm_fp32(q3[:, r0:r1], kt), scale)
        out[:, r0:r1] = torch.bmm(p, v3)
    return out.view(*q.shape[:-1], v.shape[-1])


def backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    n, q3, k3, v3 = _flat(q, k, v)
    scale = _resolved(scale, q)
    g3 = grad_out.reshape(n, *grad_out.shape[-2:]).to(q.dtype)
    rows, length = q3.shape[1], k3.shape[1]
    kt, vt = k3.transpose(1, 2), v3.transpose(1, 2)
    chunks = _chunks(n, rows, length)
    if len(chunks) == 1:
        plan = softmax_rows_plan(n * rows, length, q.dtype, q.device)
        p, ds = plan.backward(_bmm_fp32(q3, kt), _bmm_fp32(g3, vt), scale)
        dq, dk, dv = torch.bmm(ds, k3), torch.bmm(ds.transpose(1, 2), q3), torch.bmm(p.transpose(1, 2), g3)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
    dq = torch.empty_like(q3, memory_format=torch.contiguous_format)
    dk = dv = None
    for r0, r1 in chunks:
        q_c, g_c = q3[:, r0:r1], g3[:, r0:r1]
        plan = softmax_rows_plan(n * (r1 - r0), length, q.dtype, q.device)
        p, ds = plan.backward(_bmm_fp32(q_c, kt), _bmm_fp32(g_c, vt), scale)
        dq[:, r0:r1] = torch.bmm(ds, k3)
        dk_part, dv_part = _bmm_fp32(ds.transpose(1, 2), q_c), _bmm_fp32(p.transpose(1, 2), g_c)
        dk = dk_part if dk is None else dk.add_(dk_part)
        dv = dv_part if dv is None else dv.add_(dv_part)
    assert dk is not None and dv is not None
    return dq.view(q.shape), dk.to(k.dtype).view(k.shape), dv.to(v.dtype).view(v.shape)
