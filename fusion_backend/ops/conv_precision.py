"""Which precision eager's conv runs an fp32 conv in (TF32 or full fp32), per call signature, and the
fused ops' convs made to follow it.

WHY: with TF32 allowed (``torch.backends.cudnn.allow_tf32``, True by default) cuDNN still picks a
full-fp32 kernel for some convs: it chooses per shape, layout and alignment, and e.g. runs narrow convs
(3 input channels) in NCHW in full fp32 on the H100 and H200.  The fused ops run their convs elsewhere:
the norm and channel-reduction families on channels-last copies (``ops/library_conv.py``), where cuDNN
picks its TF32 kernels, and ``conv_epilogue`` in its own Triton kernels, whose dots run TF32 when
told to, and TF32 where eager's conv was full fp32 moved results far from eager's (NOTE at
``forward_tf32``).  A fused op must not be less exact than eager's conv: a shape threshold would only guess cuDNN's heuristics, so the question is put to cuDNN itself, once per
signature.

Contract:

* ``forward_tf32(x, weight, spec, dtype)`` -> ``Answer(tf32, settled)``: ``tf32`` is True where the
  fused op's forward conv of ``x`` and ``weight`` (in ``dtype``, the dtype eager's conv runs in) may
  use TF32, i.e. where eager's conv of those tensors, as the caller passed them, does.
  ``backward_tf32(...)`` -> ``BackwardAnswer(grad_input, grad_weight, settled)``: the same for the
  two gradients of eager's conv backward (cuDNN picks their kernels separately).
* Only an fp32 conv of real CUDA tensors with TF32 allowed is probed.  Otherwise nothing runs and the
  answer is the flag itself (bf16 / fp16: the flag does not matter; TF32 off: False; CPU and fake
  tensors: no cuDNN, and the Triton interpreter computes "ieee" dots whatever it is told).
* A probe never runs while a CUDA graph is being captured: the answer is then the one kept for the
  signature, or, if none is kept, full fp32 (the exact choice, never less exact than eager), with
  ``settled`` False so that a caller that keeps a plan does not keep this one (a call outside capture
  probes).  The decision's compile-time run of a region, and CUDA-graph trees' warm-up calls, come
  before any capture, so the probe runs there.
* ``cudnn_tf32(allowed)``: a context manager inside which cuDNN's TF32 is off unless ``allowed``
  (never turned on: a user who turned TF32 off keeps it off).  The library conv calls of the fused
  ops run inside it; ``conv_backward`` runs ``aten.convolution_backward`` with each gradient under
  its own answer (two calls where they differ).
* Answers are kept for the process in ``_ANSWERS`` (the one cache of this fact), by the tensors'
  shapes, strides, dtypes, devices and data alignment, the conv's hyper-parameters and cuDNN's
  ``benchmark`` / ``deterministic`` / ``enabled`` flags (all of which can change its choice).
  ``fusion_backend.testing.forget_call_plans`` empties it.

How a probe tells (``_probe_forward`` / ``_probe_backward``): eager's conv runs twice on synthetic
tensors with the caller's shapes, strides and alignment (cuDNN's choice depends on those and on the
flags, never on the values), once under the current flags and once with cuDNN's TF32 off.  The data
is made so that TF32 shows unmistakably and nothing else does: x (and the conv-output gradient) hold
``±(1 + 2**-12)`` with random signs, the weight holds 1.  TF32 keeps 10 mantissa bits, so it turns
every ``1 + 2**-12`` into 1 (rounded to nearest or truncated alike): each product loses ``2**-12`` of
itself (``2**-11`` in the weight gradient, a product of two such values), and the TF32 result is the
fp32 one divided by ``1 + 2**-12``, ``2.4e-4`` away norm-wise.  In fp32 every product is (nearly)
exact and the partial sums are integer multiples of it which, with random signs, stay about the
square root of the number of terms in magnitude: exact in fp32 over millions of terms, so two fp32
kernels agree to a few units in the last place, and a Winograd or FFT kernel's transforms within about
1e-6.  A result more than ``2**-13`` (1.2e-4) away norm-wise from the TF32-off one is TF32.  Unlike
the op's real inputs, these can neither hide TF32 (all-zero or integer-valued data, a zero-initialised
weight) nor fake it (cancellation).  The synthetic tensors cost one allocation of x's size and two
conv outputs, once per signature.  NOTE: ``python -m pytest tests/e2e/test_fp32_precision_gpu.py``
(CUDA) checks the fused ops against float64 with eager's own error as the yardstick, on the convs
cuDNN runs in full fp32 with TF32 allowed.

Threads: the flag is process-wide; a conv another thread runs while a probe or a library call has
TF32 off runs in full fp32 (more exact, never less).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ..ir.specs import ConvSpec
from ..kernels.host import BoundedCache, tensor_key
from .conv_io import run_conv, run_conv_backward

logger = logging.getLogger("fusion_backend")

#: The probe's lossy value: TF32 (10 mantissa bits) turns it into 1.0, fp32 keeps it.
_LOSSY = 1.0 + 2.0**-12
#: A probe result further than this from the TF32-off one (norm-wise, relative) shows TF32: half of
#: the smallest TF32 signature (``2**-12`` relative per product), 100x or more above what two fp32
#: kernels (Winograd and FFT ones included) differ by on the probe's data.
_TF32_SIGNATURE = 2.0**-13
#: Data addresses are matched modulo this many bytes: PyTorch tells cuDNN each tensor's alignment (up
#: to 16 or 32 bytes), which its kernel choice may depend on.  Fresh tensors are 512-byte aligned by
#: the CUDA caching allocator (64 on CPU), so only views with an offset differ.
_ALIGNMENT = 64


class Answer(NamedTuple):
    """The forward conv's answer (see the module docstring)."""

    tf32: bool
    settled: bool


class BackwardAnswer(NamedTuple):
    """The conv backward's answer, per gradient (see the module docstring)."""

    grad_input: bool
    grad_weight: bool
    settled: bool


#: Probed answers: ``("forward", *signature) -> bool`` and ``("backward", *signature) -> (bool, bool)``.
_ANSWERS = BoundedCache(512)


# NOTE: measured on the H200 (torch 2.11, fp32, TF32 allowed, training, ``decide="fuse"``): run in TF32
# where eager's conv was full fp32, Conv2d(3, C, k) followed by a min, softmax or logsumexp over the
# channels, or by a BatchNorm in training mode, landed 30-3000x further from float64 than eager (argmin /
# argmax winners moved), and a Conv2d 64->64 k3 -> x m -> leaky -> gelu under ``dynamic=True`` 2.1e-4
# off eager where Inductor (which calls eager's cuDNN conv) matched it.
def forward_tf32(x: Tensor, weight: Tensor, spec: ConvSpec, dtype: torch.dtype | None = None) -> Answer:
    """Whether the fused op's forward conv of ``x`` and ``weight`` may use TF32: as eager's conv of
    them does (``dtype``: the dtype that conv runs in, x's when None).  See the module docstring."""
    allowed = bool(torch.backends.cudnn.allow_tf32)
    if not _needs_probe(x, x.dtype if dtype is None else dtype, allowed):
        return Answer(allowed, True)
    key = ("forward", *_signature(x, weight, spec))
    known = _ANSWERS.peek(key)
    if known is not None:
        return Answer(known, True)
    if _capturing():
        return Answer(False, False)
    tf32 = _probe_or_exact(_probe_forward, x, weight, spec, False)
    _ANSWERS.put(key, tf32)
    return Answer(tf32, True)


def backward_tf32(x: Tensor, weight: Tensor, spec: ConvSpec, dtype: torch.dtype | None = None) -> BackwardAnswer:
    """Whether the fused op's input gradient and weight gradient of the conv of ``x`` and ``weight``
    may use TF32: as eager's conv backward computes each (``dtype`` as ``forward_tf32``'s)."""
    allowed = bool(torch.backends.cudnn.allow_tf32)
    if not _needs_probe(x, x.dtype if dtype is None else dtype, allowed):
        return BackwardAnswer(allowed, allowed, True)
    key = ("backward", *_signature(x, weight, spec))
    known = _ANSWERS.peek(key)
    if known is not None:
        return BackwardAnswer(*known, True)
    if _capturing():
        return BackwardAnswer(False, False, False)
    answer = _probe_or_exact(_probe_backward, x, weight, spec, (False, False))
    _ANSWERS.put(key, answer)
    return BackwardAnswer(*answer, True)


def plan_key(x: Tensor, spec: ConvSpec) -> tuple:
    """What a kept call plan holding an answer of this module must be keyed by besides its tensors'
    ``tensor_key``: nothing for a conv that is not fp32 (no probe, no cost added), else the conv and
    the TF32 flag (a plan made with TF32 off holds "full fp32", not an answer).  cuDNN's benchmark
    and deterministic flags are left out: such a plan keeps the answer of the flags it was made under."""
    return (spec, bool(torch.backends.cudnn.allow_tf32)) if x.dtype == torch.float32 else ()


class cudnn_tf32:  # noqa: N801 - used as a context manager, like torch.backends.cudnn.flags
    """``with cudnn_tf32(allowed):`` cuDNN's TF32 is off inside unless ``allowed``; it is never turned
    on.  A class rather than a generator: it runs around every library conv call of a signature whose
    eager conv is full fp32 (host time is what small steps wait on)."""

    __slots__ = ("allowed", "_restore")

    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed
        self._restore = False

    def __enter__(self) -> None:
        self._restore = not self.allowed and torch.backends.cudnn.allow_tf32
        if self._restore:
            torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc: object) -> None:
        if self._restore:
            torch.backends.cudnn.allow_tf32 = True


def conv_backward(grad_y: Tensor, x: Tensor, weight: Tensor, spec: ConvSpec, need_x: bool, need_w: bool,
                  need_b: bool, tf32: tuple[bool, bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """``run_conv_backward`` with the input gradient under ``cudnn_tf32(tf32[0])`` and the weight
    gradient under ``cudnn_tf32(tf32[1])``: one call where the wanted gradients share an answer, two
    where they do not (cuDNN computes them in separate kernels either way)."""
    if need_x and need_w and tf32[0] != tf32[1]:
        with cudnn_tf32(tf32[0]):
            grad_x, _, grad_b = run_conv_backward(grad_y, x, weight, spec, True, False, need_b)
        with cudnn_tf32(tf32[1]):
            _, grad_w, _ = run_conv_backward(grad_y, x, weight, spec, False, True, False)
        return grad_x, grad_w, grad_b
    allowed = (tf32[0] or not need_x) and (tf32[1] or not need_w)
    with cudnn_tf32(allowed):
        return run_conv_backward(grad_y, x, weight, spec, need_x, need_w, need_b)


def _needs_probe(x: Tensor, dtype: torch.dtype, allowed: bool) -> bool:
    return allowed and dtype == torch.float32 and _probes_device(x)


def _probes_device(x: Tensor) -> bool:
    """Whether ``x``'s convs run in cuDNN, whose choice a probe can ask: real CUDA tensors."""
    return x.device.type == "cuda" and not is_fake(x)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _signature(x: Tensor, weight: Tensor, spec: ConvSpec) -> tuple:
    cudnn = torch.backends.cudnn
    return (
        tensor_key(x), x.data_ptr() % _ALIGNMENT, tensor_key(weight), weight.data_ptr() % _ALIGNMENT, spec,
        bool(cudnn.benchmark), bool(cudnn.deterministic), bool(cudnn.enabled),
    )  # fmt: skip


def _probe_or_exact(probe: Callable[[Tensor, Tensor, ConvSpec], Any], x: Tensor, weight: Tensor, spec: ConvSpec,
                    exact: Any) -> Any:  # fmt: skip
    """``probe(x, weight, spec)`` run as eager's conv runs (no autograd, no autocast, on x's device),
    or ``exact`` (full fp32, never less exact than eager) where it fails, e.g. out of memory."""
    device = torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()
    try:
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False), device:
            return probe(x, weight, spec)
    except Exception as e:  # noqa: BLE001 - the exact answer is always safe
        logger.info("conv precision probe failed (%s: %s); the fused op's conv runs in full fp32", type(e).__name__, e)
        return exact


def _probe_forward(x: Tensor, weight: Tensor, spec: ConvSpec) -> bool:
    """Whether eager's conv of tensors laid out as ``x`` and ``weight`` runs TF32 (module docstring)."""
    generator = torch.Generator(device=x.device).manual_seed(0)
    xs, ws = _synthetic(x, generator), _synthetic(weight, None)
    fast = run_conv(xs, ws, None, spec)
    with cudnn_tf32(False):
        exact = run_conv(xs, ws, None, spec)
    return _shows_tf32(fast, exact)


def _probe_backward(x: Tensor, weight: Tensor, spec: ConvSpec) -> tuple[bool, bool]:
    """Whether eager's conv backward runs the input gradient and the weight gradient in TF32, with
    the conv-output gradient in the layout eager's conv gives its output (module docstring)."""
    generator = torch.Generator(device=x.device).manual_seed(0)
    xs, ws = _synthetic(x, generator), _synthetic(weight, None)
    with cudnn_tf32(False):
        grad_y = _synthetic(run_conv(xs, ws, None, spec), generator)
    fast = run_conv_backward(grad_y, xs, ws, spec, True, True)
    with cudnn_tf32(False):
        exact = run_conv_backward(grad_y, xs, ws, spec, True, True)
    return _shows_tf32(fast[0], exact[0]), _shows_tf32(fast[1], exact[1])


def _synthetic(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """An fp32 tensor with ``like``'s shape, strides, device and data address modulo ``_ALIGNMENT``,
    holding ``±_LOSSY`` with random signs (from ``generator``: the user's random state is not
    touched), or 1 where ``generator`` is None."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(like.shape, like.stride(), strict=True))
    span = span if like.numel() else 0
    pad = _ALIGNMENT // 4
    base = torch.empty(span + pad, dtype=torch.float32, device=like.device)
    if generator is None:
        base.fill_(1.0)
    else:
        base.bernoulli_(0.5, generator=generator).mul_(2 * _LOSSY).sub_(_LOSSY)
    shift = ((like.data_ptr() - base.data_ptr()) % _ALIGNMENT) // 4
    return base.as_strided(like.shape, like.stride(), shift)


def _shows_tf32(fast: Tensor, exact: Tensor) -> bool:
    """Whether ``fast`` is off ``exact`` by TF32's signature (norm-wise, relative)."""
    reference = torch.linalg.vector_norm(exact.float()).item()
    return reference > 0 and torch.linalg.vector_norm((fast - exact).float()).item() > _TF32_SIGNATURE * reference
