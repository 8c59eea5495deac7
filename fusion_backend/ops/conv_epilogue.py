"""The fused op ``conv -> pointwise chain -> optional pool``, forward and backward.

Public entry point (what the graph rewriter calls)::

    conv_epilogue(x, weight, bias, operands, config) -> Tensor

with eager semantics: ``y = aten.convolution(x, weight, bias, *conv params)``, then every
``ChainStep`` of the config in order (``chain.apply_step``; ``Const`` operands are numbers,
``TensorRef(i)`` is ``operands[i]``: 0-d, per-channel ``(C,1,..,1)`` / ``(1,C,1,..,1)``, or any
shape with one element and at most ``y.ndim`` dims), then the optional max/avg pool, and finally a
cast to ``config.out_dtype`` (None = the conv's dtype).  The conv runs in ``config.compute_dtype``
(None = x's dtype): ``x``, ``weight`` and ``bias`` stored in another dtype are cast to it first, as
autocast would (the Triton kernels cast as they load; gradients come back in each input's dtype);
operands may be fp32 under a bf16/fp16 conv.  1d/2d/3d, transposed or not, any conv
hyper-parameters, chains of 0..MAX_CHAIN_LENGTH steps.

Two custom ops carry the work (``torch.library.custom_op``, opaque to Inductor, with fakes):

* ``fusion::conv_epilogue_fwd(x, weight, bias, operands, config, save_for_backward)
  -> (out, saved_a, saved_b)``.  Saved state, with ``C``/spatial of the conv output ``y0``
  (the conv output WITHOUT bias; every backward adds the bias back itself):

  =================  ====================================  =====================================
  case               saved_a                               saved_b
  =================  ====================================  =====================================
  max pool           winner index in its window, pooled    y0 at the winner, pooled shape,
                     shape, row-major over (kd, kh, kw),   conv dtype
                     int8 (window <= 127 taps) else int32
  avg pool / none    y0, full size, conv dtype             empty
  no save            empty                                 empty
  =================  ====================================  =====================================

  "empty" is ``torch.empty(0, dtype=x.dtype)``.  The chain's full-size intermediates are never
  saved: with a max pool the backward needs only 1/window of the elements.
  ``out`` and the pooled saved tensors use the memory format that ``output_memory_format`` picks
  from ``y0`` (channels-last when ``y0`` is channels-last and not also contiguous); so does
  ``saved_a = y0``.
* ``fusion::conv_epilogue_bwd(grad_out, x, weight, bias, operands, saved_a, saved_b, config,
  output_mask) -> [grad_x, grad_weight, grad_bias, *grad_operands]``; entries whose mask is False
  are empty placeholders (mapped to None by the autograd glue).

Implementations:

* Triton (CUDA, fp32/fp16/bf16), two interchangeable paths chosen by ``FUSION_CONV_IMPL``
  (``conv_impl``; both write the same saved state and pass the same parity tests).  By default
  (``auto``) the first call of a shape times both (and the library path's channels-last variant)
  on the GPU and keeps the fastest, per direction (``impl_choice``; cached on disk; the library
  path when measuring is off or on CPU):

  - library: the conv through aten/cuDNN WITHOUT bias, then one Triton kernel adds
    the bias, applies the chain and the pool and writes only ``out`` and the saved state
    (``kernels.epilogue``).  Backward: one Triton kernel writes the full-size conv-output gradient
    plus fixed-order per-channel partial sums of the operand and bias gradients (bitwise
    reproducible), then ``aten.convolution_backward``.  Each direction has a channels-last
    variant among ``auto``'s measured candidates for 2-d/3-d convs of NCHW-style tensors: the
    conv (or conv backward) runs on channels-last copies, where cuDNN's fast Hopper kernels are,
    and the epilogue kernels transpose between the layouts in their tiles
    (``_ChannelsLastLibraryForward``, ``_LibraryBackward(channels_last=True)``).
  - fused (``triton``, or ``auto`` where measured faster): one implicit-GEMM Triton kernel computes
    the conv and applies bias, chain and pool in registers (``kernels.conv_dense`` for the plain
    stride-1 1d/2d convs it serves, e.g. Conv2d 64->64 k3; ``kernels.conv_fused`` otherwise); the
    backward differentiates the chain at the max-pool winners only and hands the compact gradient to
    Triton conv-backward kernels that expand it on the fly (``kernels.conv_shift_bwd`` for a
    transposed conv whose pool stride is its stride, e.g. ConvTranspose3d k3 s2 + MaxPool3d(2);
    ``kernels.conv_fused_bwd`` otherwise), so no full-size gradient exists.
* Reference (CPU, float64, anything the kernels don't cover): plain torch; the backward applies
  torch's own derivative formulas to the chain recomputed from the saved state.  ``FUSION_CPU_KERNELS=triton`` (read at call time) runs the Triton path on CPU
  tensors instead, which is only meaningful under ``TRITON_INTERPRET=1`` (CPU CI).

Failure policy: when a Triton launch or compile fails, ``config.strict`` raises ``KernelError``;
otherwise a warning is logged (``logging.getLogger("fusion_backend")``) and issued
(``warnings.warn``) once per config and direction, and the reference runs.  ``kernel_path`` tells
which implementation a config/dtype/device gets, for the backend's report.
"""

import copy
import functools
import logging
import math
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import environment
from ..errors import KernelError, UnsupportedInputError
from ..ir.shapes import conv_output_length, pool_output_length
from ..kernels.host import BoundedCache, cpu_kernels_unavailable, tensor_key
from . import impl_choice
from .chain import MAX_CHAIN_LENGTH, ChainStep, Const, PointwiseKind, TensorRef, apply_step
from .config import ConvEpilogueConfig, ConvSpec, PoolSpec
from .direct_twins import profiled, records_backward, register_direct
from .runtime_twins import register_twin

logger = logging.getLogger("fusion_backend")

#: The environment switches this op reads (``fusion_backend.environment`` says what they do).
CPU_KERNELS_ENV = environment.CPU_KERNELS
CONV_IMPL_ENV = environment.CONV_IMPL
DEFAULT_CONV_IMPL = environment.DEFAULT_CONV_IMPL
_CUDA_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# NOTE: Triton's interpreter has no bf16 (numpy has no such type).
_INTERPRETER_KERNEL_DTYPES = (torch.float32, torch.float16)
#: Largest window whose winner index is saved as int8.
_INT8_WINDOW_LIMIT = 127

_warned: set[tuple[str, str]] = set()


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def conv_epilogue(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], config: str
) -> Tensor:
    """``pool(chain(conv(x, weight, bias))).to(out_dtype)`` as one fused op (see module docstring).

    Backward state is computed only when autograd will need it: under AOTAutograd the grad mode
    seen at trace time is the runtime one, so inference graphs never save anything.
    """
    save = records_backward(x, weight, bias, operands)
    out, _, _ = torch.ops.fusion.conv_epilogue_fwd(x, weight, bias, list(operands), config, save)
    return out


def kernel_path(config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """``("triton", None)`` when the Triton kernels serve this case, else ``("reference", why)``.

    Operand shapes are not known here: a non-per-channel operand tensor still falls back at run
    time (with a warning, or ``UnsupportedInputError`` under ``strict``).
    """
    cfg = ConvEpilogueConfig.from_json(config)
    if device_type == "cuda":
        if dtype not in _CUDA_KERNEL_DTYPES:
            return "reference", f"no Triton kernel for {dtype} (kernels cover float32, float16, bfloat16)"
    elif device_type == "cpu":
        why = cpu_kernels_unavailable()
        if why is not None:
            return "reference", why
        if dtype not in _INTERPRETER_KERNEL_DTYPES:
            return "reference", f"the Triton interpreter has no {dtype} kernels (float32, float16 only)"
    else:
        return "reference", f"no Triton kernels for device type {device_type!r}"
    if len(cfg.chain) > MAX_CHAIN_LENGTH:
        return "reference", f"chain of {len(cfg.chain)} steps exceeds the kernel's {MAX_CHAIN_LENGTH} slots"
    try:
        kernels = _kernels()
    except ImportError as e:  # pragma: no cover - triton is a dependency
        return "reference", f"Triton is not importable: {e}"
    if cfg.pool is not None and cfg.pool.window_volume > kernels.MAX_WINDOW_VOLUME:
        return "reference", (
            f"pool window of {cfg.pool.window_volume} taps exceeds the kernel's unroll limit "
            f"{kernels.MAX_WINDOW_VOLUME}"
        )
    return "triton", None


def conv_epilogue_eager(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], config: str
) -> Tensor:
    """The eager composite the fused op stands for (differentiable by autograd; tests' oracle).

    Operands in non-differentiable positions (leaky_relu slope, clamp bounds) are detached, as in
    the fused op.
    """
    cfg = ConvEpilogueConfig.from_json(config)
    dtype = _compute_dtype(cfg, x)
    x, weight, bias = _cast_inputs(x, weight, bias, dtype)
    v = apply_chain(_conv(x, weight, bias, cfg.conv), cfg.chain, operands)
    if cfg.pool is not None:
        v = _pool(v, cfg.pool)
    return v.to(_out_dtype(cfg, dtype))


def output_memory_format(y: Tensor) -> torch.memory_format:
    """Memory format of the op's outputs, picked from the conv output ``y`` (real or fake).

    channels_last / channels_last_3d when ``y`` is in it and not also contiguous, else contiguous.
    Shared by the fake and the real implementations so that their strides agree exactly.
    """
    if y.dim() == 4 and y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous():
        return torch.channels_last
    if y.dim() == 5 and y.is_contiguous(memory_format=torch.channels_last_3d) and not y.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def apply_chain(y: Tensor, chain: Sequence[ChainStep], operands: Sequence[Tensor]) -> Tensor:
    """Apply ``chain`` to ``y`` with eager semantics; non-differentiable operands are detached."""
    for step in chain:
        values: list[Union[Tensor, float]] = []
        for j, operand in enumerate(step.operands):
            if isinstance(operand, Const):
                values.append(operand.value)
            else:
                t = operands[operand.index]
                values.append(t if j in step.kind.differentiable_operands else t.detach())
        y = apply_step(step.kind, y, values)
    return y


# --------------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------------


def _conv_epilogue_fwd_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    operands: list[Tensor],
    config: str,
    save_for_backward: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Forward of the fused op: ``(out, saved_a, saved_b)`` (see the module docstring).

    A call whose signature (``_signature``) has a settled plan runs it straight; the first call of
    a signature checks the inputs, picks the path (``_forward_plan``) and keeps the plan.
    """
    key = _signature(config, save_for_backward, x, weight, bias, operands)
    plan = _FORWARD_PLANS.peek(key)
    if plan is None:
        cfg = ConvEpilogueConfig.from_json(config)
        _check_inputs(x, weight, operands, cfg)
        if not _use_triton(config, cfg, x):
            return _reference_forward(x, weight, bias, operands, cfg, save_for_backward)
        try:
            plan, settled = _forward_plan(x, weight, bias, operands, cfg, save_for_backward)
        except Exception as e:  # any kernel failure takes the documented policy
            _on_kernel_failure("forward", config, cfg, x, weight, e)
            return _reference_forward(x, weight, bias, operands, cfg, save_for_backward)
        if settled:
            _FORWARD_PLANS.put(key, plan)
    try:
        return plan(x, weight, bias, operands)
    except Exception as e:  # any kernel failure takes the documented policy
        cfg = ConvEpilogueConfig.from_json(config)
        _on_kernel_failure("forward", config, cfg, x, weight, e)
        return _reference_forward(x, weight, bias, operands, cfg, save_for_backward)


conv_epilogue_fwd = torch.library.custom_op("fusion::conv_epilogue_fwd", mutates_args=())(_conv_epilogue_fwd_impl)


@conv_epilogue_fwd.register_fake
def _conv_epilogue_fwd_fake(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    operands: list[Tensor],
    config: str,
    save_for_backward: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    cfg = ConvEpilogueConfig.from_json(config)
    dtype = _compute_dtype(cfg, x)
    y0 = _conv(x.to(dtype), weight.to(dtype), None, cfg.conv)
    out_shape = y0.shape if cfg.pool is None else _pool(y0, cfg.pool).shape
    return _allocate_forward_outputs(x, y0, out_shape, cfg, save_for_backward)


def _conv_epilogue_bwd_impl(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    operands: list[Tensor],
    saved_a: Tensor,
    saved_b: Tensor,
    config: str,
    output_mask: list[bool],
) -> list[Tensor]:
    """Backward of the fused op: ``[grad_x, grad_weight, grad_bias, *grad_operands]``.

    ``output_mask`` has ``3 + len(operands)`` entries; unrequested grads are empty placeholders.
    Each requested grad has its input's shape, dtype and ``empty_like`` strides.  Plans are kept
    per signature as in the forward (``_backward_plan``).
    """
    key = (
        _signature(config, True, x, weight, bias, operands), tuple(output_mask), tensor_key(grad_out),
        tensor_key(saved_a), tensor_key(saved_b),
    )  # fmt: skip
    plan = _BACKWARD_PLANS.peek(key)
    cfg = None
    if plan is None:
        cfg = ConvEpilogueConfig.from_json(config)
        if len(output_mask) != 3 + len(operands):
            raise ValueError(f"output_mask needs {3 + len(operands)} entries, got {len(output_mask)}")
        if saved_a.dim() == 1:  # the (0,)-shaped placeholder: saved state is always (N, C, ...)
            raise RuntimeError(
                "fusion::conv_epilogue_bwd: the forward ran with save_for_backward=False; call "
                "conv_epilogue() (which saves state when autograd needs it) instead of the raw op"
            )
        if _use_triton(config, cfg, x):
            try:
                plan, settled = _backward_plan(grad_out, x, weight, bias, operands, saved_a, saved_b, cfg, output_mask)
            except Exception as e:  # any kernel failure takes the documented policy
                _on_kernel_failure("backward", config, cfg, x, weight, e)
            else:
                if settled:
                    _BACKWARD_PLANS.put(key, plan)
    grads = None
    if plan is not None:
        try:
            grads = plan(grad_out, x, weight, bias, operands, saved_a, saved_b)
        except Exception as e:  # any kernel failure takes the documented policy
            cfg = cfg or ConvEpilogueConfig.from_json(config)
            _on_kernel_failure("backward", config, cfg, x, weight, e)
    if grads is None:
        cfg = cfg or ConvEpilogueConfig.from_json(config)
        grads = _reference_backward(grad_out, x, weight, bias, operands, saved_a, saved_b, cfg, output_mask)
    inputs = [x, weight, bias, *operands]
    return [
        _like(g, ref) if wanted and ref is not None and g is not None else _placeholder(x)
        for g, ref, wanted in zip(grads, inputs, output_mask, strict=True)
    ]


conv_epilogue_bwd = torch.library.custom_op("fusion::conv_epilogue_bwd", mutates_args=())(_conv_epilogue_bwd_impl)


@conv_epilogue_bwd.register_fake
def _conv_epilogue_bwd_fake(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    operands: list[Tensor],
    saved_a: Tensor,
    saved_b: Tensor,
    config: str,
    output_mask: list[bool],
) -> list[Tensor]:
    inputs = [x, weight, bias, *operands]
    return [
        torch.empty_like(ref) if wanted and ref is not None else _placeholder(x)
        for ref, wanted in zip(inputs, output_mask, strict=True)
    ]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    x, weight, bias, operands, config, save_for_backward = inputs
    _, saved_a, saved_b = output
    ctx.config = config
    ctx.num_operands = len(operands)
    ctx.saved = save_for_backward
    ctx.save_for_backward(x, weight, bias, *operands, saved_a, saved_b)


def _backward(ctx: Any, grad_out: Tensor, _grad_saved_a: Tensor, _grad_saved_b: Tensor) -> tuple[Any, ...]:
    if not ctx.saved:
        raise RuntimeError(
            "fusion::conv_epilogue_fwd ran with save_for_backward=False but a gradient was requested; "
            "call conv_epilogue(), which saves state whenever autograd needs it"
        )
    x, weight, bias, *rest = ctx.saved_tensors
    operands = rest[: ctx.num_operands]
    saved_a, saved_b = rest[ctx.num_operands :]
    needs = ctx.needs_input_grad  # (x, weight, bias, [operands...], config, save_for_backward)
    mask = [bool(needs[0]), bool(needs[1]), bias is not None and bool(needs[2])]
    mask += [bool(m) for m in needs[3]]
    grads = torch.ops.fusion.conv_epilogue_bwd(
        grad_out, x, weight, bias, list(operands), saved_a, saved_b, ctx.config, mask
    )
    out = [g if wanted else None for g, wanted in zip(grads, mask, strict=True)]
    return out[0], out[1], out[2], out[3:], None, None


conv_epilogue_fwd.register_autograd(_backward, setup_context=_setup_context)
register_twin(conv_epilogue_fwd, _conv_epilogue_fwd_impl, _conv_epilogue_fwd_fake)
register_twin(conv_epilogue_bwd, _conv_epilogue_bwd_impl, _conv_epilogue_bwd_fake)


class _DirectConvEpilogue(torch.autograd.Function):
    """``conv_epilogue`` for graphs the backend runs without AOTAutograd (``ops/direct_twins.py``).

    The same two implementations as the custom ops, called straight: the forward saves the same
    state, the backward gets the same output mask.  ``operands`` are spread into separate arguments
    because autograd tracks only tensors passed one by one.
    """

    @staticmethod
    def forward(ctx: Any, config: str, x: Tensor, weight: Tensor, bias: Tensor | None, *operands: Tensor) -> Tensor:
        out, saved_a, saved_b = _conv_epilogue_fwd_impl(x, weight, bias, list(operands), config, True)
        ctx.config = config
        ctx.save_for_backward(x, weight, bias, *operands)
        # Intermediates (neither inputs nor outputs) are kept as attributes, as autograd advises for
        # state that double backward never needs.
        ctx.state = (saved_a, saved_b)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @profiled("fusion::conv_epilogue_bwd")
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        x, weight, bias, *operands = ctx.saved_tensors
        saved_a, saved_b = ctx.state
        needs = ctx.needs_input_grad  # (config, x, weight, bias, *operands)
        mask = [bool(needs[1]), bool(needs[2]), bias is not None and bool(needs[3])]
        mask += [bool(m) for m in needs[4:]]
        grads = _conv_epilogue_bwd_impl(grad_out, x, weight, bias, operands, saved_a, saved_b, ctx.config, mask)
        return (None, *(g if wanted else None for g, wanted in zip(grads, mask, strict=True)))


@profiled("fusion::conv_epilogue_fwd")
def _conv_epilogue_direct(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], config: str
) -> Tensor:
    """``conv_epilogue`` without the custom-op layers (the direct twin; same contract)."""
    if records_backward(x, weight, bias, operands):
        return _DirectConvEpilogue.apply(config, x, weight, bias, *operands)
    return _conv_epilogue_fwd_impl(x, weight, bias, list(operands), config, False)[0]


register_direct(conv_epilogue, _conv_epilogue_direct)


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------


def _kernels() -> ModuleType:
    # Imported lazily: TRITON_INTERPRET is read when @triton.jit runs, i.e. at this import.
    from ..kernels import epilogue

    return epilogue


def _use_triton(config: str, cfg: ConvEpilogueConfig, x: Tensor) -> bool:
    path, why = kernel_path(config, _compute_dtype(cfg, x), x.device.type)
    if path == "triton":
        return True
    if cfg.strict and x.device.type == "cuda":
        raise UnsupportedInputError(f"fusion::conv_epilogue has no Triton kernel here: {why}")
    return False


def _on_kernel_failure(
    direction: str, config: str, cfg: ConvEpilogueConfig, x: Tensor, weight: Tensor, error: Exception
) -> None:
    """Under ``strict`` raise (``UnsupportedInputError`` as is, anything else as ``KernelError``),
    else warn once per (direction, config)."""
    what = (
        f"fusion::conv_epilogue {direction} Triton kernel failed for chain [{_describe_chain(cfg)}], "
        f"pool {_describe_pool(cfg.pool)}, x {tuple(x.shape)} weight {tuple(weight.shape)} "
        f"{x.dtype} on {x.device}: {type(error).__name__}: {error}"
    )
    if cfg.strict:
        if isinstance(error, UnsupportedInputError):
            raise error
        raise KernelError(f"{what}. Unset strict to fall back to the plain-torch reference.") from error
    key = (direction, config)
    if key not in _warned:
        _warned.add(key)
        message = f"{what}. Falling back to the plain-torch reference (warned once per config)."
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _describe_chain(cfg: ConvEpilogueConfig) -> str:
    parts = []
    for step in cfg.chain:
        args = ", ".join(
            f"{o.value:g}" if isinstance(o, Const) else f"operands[{o.index}]" for o in step.operands
        )
        parts.append(f"{step.kind.name.lower()}({args})")
    return ", ".join(parts)


def _describe_pool(pool: PoolSpec | None) -> str:
    if pool is None:
        return "none"
    return f"{pool.kind}(k={pool.kernel_size}, s={pool.stride}, p={pool.padding}, ceil={pool.ceil_mode})"


def _check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig) -> None:
    _out_dtype(cfg, _compute_dtype(cfg, x))  # both dtype names are valid
    dims = cfg.conv.spatial_dims
    if x.dim() != dims + 2 or weight.dim() != dims + 2:
        raise UnsupportedInputError(
            f"fusion::conv_epilogue: a {dims}d conv needs x and weight with {dims + 2} dims, got "
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if cfg.pool is not None and len(cfg.pool.kernel_size) != dims:
        raise UnsupportedInputError(
            f"fusion::conv_epilogue: pool {cfg.pool} does not have {dims} spatial dims"
        )
    for step in cfg.chain:
        for operand in step.operands:
            if not isinstance(operand, Const) and not 0 <= operand.index < len(operands):
                raise UnsupportedInputError(
                    f"fusion::conv_epilogue: chain references operands[{operand.index}] but "
                    f"{len(operands)} operand tensors were given"
                )


def _dtype_named(name: str, field: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UnsupportedInputError(f"fusion::conv_epilogue: {field} {name!r} is not a torch floating dtype")
    return dtype


def _out_dtype(cfg: ConvEpilogueConfig, conv_dtype: torch.dtype) -> torch.dtype:
    """The result's dtype: ``config.out_dtype``, else the conv's (compute) dtype."""
    return conv_dtype if cfg.out_dtype is None else _dtype_named(cfg.out_dtype, "out_dtype")


def _compute_dtype(cfg: ConvEpilogueConfig, x: Tensor) -> torch.dtype:
    """The dtype the conv runs in: ``config.compute_dtype``, else x's."""
    return x.dtype if cfg.compute_dtype is None else _dtype_named(cfg.compute_dtype, "compute_dtype")


def _cast_inputs(x: Tensor, weight: Tensor, bias: Tensor | None,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """``x``, ``weight`` and ``bias`` in the compute dtype (the same tensors where they already are):
    what the library and reference paths run on; the Triton conv kernels cast as they load instead."""
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _conv(x: Tensor, weight: Tensor, bias: Tensor | None, spec: ConvSpec) -> Tensor:
    return torch.ops.aten.convolution(
        x, weight, bias, list(spec.stride), list(spec.padding), list(spec.dilation), spec.transposed,
        list(spec.output_padding), spec.groups,
    )  # fmt: skip


def _pool_stride(pool: PoolSpec) -> tuple[int, ...]:
    # PyTorch's pools take stride=None/() to mean "= kernel_size".
    return tuple(pool.stride) if pool.stride else tuple(pool.kernel_size)


def _pool(v: Tensor, pool: PoolSpec, return_indices: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """The PoolSpec's F.max_pool{d}d / F.avg_pool{d}d on ``v`` (real or fake)."""
    dims = v.dim() - 2
    k, s, p = list(pool.kernel_size), list(_pool_stride(pool)), list(pool.padding)
    if pool.kind == "max":
        fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[dims - 1]
        return fn(v, k, s, p, 1, ceil_mode=pool.ceil_mode, return_indices=return_indices)
    if dims == 1:
        # avg_pool1d has no divisor_override: the 2d pool over a (1, L) plane is the same pool.
        out = F.avg_pool2d(
            v.unsqueeze(-2), [1, k[0]], [1, s[0]], [0, p[0]], pool.ceil_mode, pool.count_include_pad,
            pool.divisor_override,
        )  # fmt: skip
        return out.squeeze(-2)
    fn = F.avg_pool2d if dims == 2 else F.avg_pool3d
    return fn(v, k, s, p, pool.ceil_mode, pool.count_include_pad, pool.divisor_override)


def _pooled_shape(y_shape: Sequence[int], pool: PoolSpec) -> list[int]:
    stride = _pool_stride(pool)
    return list(y_shape[:2]) + [
        pool_output_length(size, k, s, p, ceil_mode=pool.ceil_mode)
        for size, k, s, p in zip(y_shape[2:], pool.kernel_size, stride, pool.padding, strict=True)
    ]


def _conv_output_shape(x: Tensor, weight: Tensor, spec: ConvSpec) -> list[int]:
    """Shape of ``aten.convolution``'s output (real sizes only; fakes use the op itself)."""
    spatial = []
    for i, size in enumerate(x.shape[2:]):
        spatial.append(conv_output_length(size, weight.shape[2 + i], spec.stride[i], spec.padding[i], spec.dilation[i],
                                          spec.transposed, spec.output_padding[i]))
    channels = weight.shape[1] * spec.groups if spec.transposed else weight.shape[0]
    return [x.shape[0], channels, *spatial]


def _winner_dtype(pool: PoolSpec) -> torch.dtype:
    return torch.int8 if pool.window_volume <= _INT8_WINDOW_LIMIT else torch.int32


def _placeholder(x: Tensor) -> Tensor:
    return torch.empty(0, dtype=x.dtype, device=x.device)


def _allocate_forward_outputs(
    x: Tensor, y0: Tensor, out_shape: Sequence[int], cfg: ConvEpilogueConfig, save: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Empty ``(out, saved_a, saved_b)`` with the exact shapes, dtypes and strides of the real op
    (``x``: the op's input as given, for the device and the placeholders' dtype; ``y0``: the conv
    output in the compute dtype)."""
    fmt = output_memory_format(y0)
    out = torch.empty(out_shape, dtype=_out_dtype(cfg, y0.dtype), device=x.device, memory_format=fmt)
    if not save:
        return out, _placeholder(x), _placeholder(x)
    if cfg.pool is not None and cfg.pool.kind == "max":
        win = torch.empty(out_shape, dtype=_winner_dtype(cfg.pool), device=x.device, memory_format=fmt)
        win_y = torch.empty(out_shape, dtype=y0.dtype, device=x.device, memory_format=fmt)
        return out, win, win_y
    return out, torch.empty(y0.shape, dtype=y0.dtype, device=x.device, memory_format=fmt), _placeholder(x)


def _in_format(t: Tensor, fmt: torch.memory_format) -> Tensor:
    """``t`` itself when it already has the strides ``torch.empty(..., memory_format=fmt)`` gives,
    else a copy that does (size-1 dims included: Inductor compares strides exactly)."""
    expected = torch.empty(t.shape, dtype=t.dtype, device="meta", memory_format=fmt).stride()
    if t.stride() == expected:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=fmt).copy_(t)


def _like(g: Tensor, ref: Tensor) -> Tensor:
    """``g`` (ref's shape) with the dtype and strides of ``torch.empty_like(ref)``."""
    expected = _DECISIONS.get(("like", tensor_key(ref)), lambda: torch.empty_like(ref, device="meta").stride())
    if g.dtype == ref.dtype and g.stride() == expected:
        return g
    return torch.empty_like(ref).copy_(g)


def _channel_view(t: Tensor, ndim: int) -> Tensor:
    return t.reshape([1, -1] + [1] * (ndim - 2))


def _is_per_channel(t: Tensor, y_ndim: int, channels: int) -> bool:
    """True when ``t`` broadcasts against (N, C, ...) as one value, or one value per channel."""
    if t.dim() > y_ndim:
        return False
    if t.numel() == 1:
        return True
    offset = y_ndim - t.dim()
    return all(size == (channels if i + offset == 1 else 1) for i, size in enumerate(t.shape))


def _pool_geometry(pool: PoolSpec) -> Any:  # the kernels' PoolGeometry (module imported lazily)
    return _kernels().PoolGeometry(
        kind=pool.kind, kernel_size=tuple(pool.kernel_size), stride=_pool_stride(pool),
        padding=tuple(pool.padding), count_include_pad=pool.count_include_pad,
        divisor_override=pool.divisor_override,
    )  # fmt: skip


def _kernel_steps(cfg: ConvEpilogueConfig, operands: Sequence[Tensor], y_ndim: int, channels: int) -> list:
    """The chain as the launchers take it: ``(op code, [float | per-channel tensor])`` per step."""
    steps = []
    for step in cfg.chain:
        values: list[Union[float, Tensor]] = []
        for operand in step.operands:
            if isinstance(operand, Const):
                values.append(operand.value)
                continue
            t = operands[operand.index]
            if not _is_per_channel(t, y_ndim, channels):
                raise UnsupportedInputError(
                    f"operands[{operand.index}] of shape {tuple(t.shape)} is neither a scalar nor per-channel "
                    f"for a conv output with {channels} channels and {y_ndim} dims"
                )
            values.append(t)
        steps.append((step.kind.code, values))
    return steps


# --------------------------------------------------------------------------------------------------
# Triton path
# --------------------------------------------------------------------------------------------------


def _conv_impl_mode() -> str:
    # ``auto`` is the default: the faster path per shape, measured once (``impl_choice``).  On the
    # H100 the fused forward wins on the ConvT3d pipeline of the ``seeds`` suite (0.25 vs 0.73 ms
    # fp32) and cuDNN on its Conv2d 64->64 pipeline.
    mode = environment.conv_impl()
    if mode not in environment.CONV_IMPLS:
        raise UnsupportedInputError(f"{CONV_IMPL_ENV}={mode!r}: expected auto, triton or library")
    return mode


def conv_impl(x: Tensor, weight: Tensor, cfg: ConvEpilogueConfig, save: bool) -> tuple[str, str | None]:
    """Which conv the Triton forward runs: ``("triton", None)`` for the fused implicit-GEMM kernel
    (``_forward_kernels``: ``kernels.conv_dense`` or ``kernels.conv_fused``), ``("library", why)``
    for aten/cuDNN + the epilogue kernel.

    ``FUSION_CONV_IMPL`` (read at call time; ``auto`` by default): ``library`` always takes the
    library conv; ``auto`` answers ``triton`` on CUDA whenever one of the fused kernels serves the
    case (``conv_dense``, else ``conv_fused.unsupported_reason`` is None; ``_forward_plan`` then
    measures which of the candidates is fastest) and the library conv on CPU (the interpreter is slow;
    tests force the fused kernel there); ``triton`` always takes the fused
    kernel and raises ``UnsupportedInputError`` (handled by the failure policy: strict raises, else
    warn and run the reference) when it cannot serve the case.
    """
    mode = _conv_impl_mode()
    if mode == "library":
        return "library", f"{CONV_IMPL_ENV}=library"
    if mode == "auto" and x.device.type != "cuda":
        return "library", f"{CONV_IMPL_ENV}=auto uses the fused conv on CUDA only"
    key = ("conv_impl", tensor_key(x), tensor_key(weight), cfg, save, mode)
    return _DECISIONS.get(key, lambda: _fused_conv_answer(x, weight, cfg, save, mode))


#: Per-call decisions that depend only on shapes, strides, dtypes, devices and the config, cached:
#: the op makes them on every call and host time is what small steps wait on.
_DECISIONS = BoundedCache(512)


def _fused_conv_answer(x: Tensor, weight: Tensor, cfg: ConvEpilogueConfig, save: bool,
                       mode: str) -> tuple[str, str | None]:  # fmt: skip
    """``conv_impl``'s answer for ``auto``/``triton`` (see there)."""
    from ..kernels import conv_fused

    if _forward_kernels(x, weight, cfg) is not conv_fused:
        return "triton", None
    pooled = None
    if cfg.pool is not None:
        pooled = _pooled_shape(_conv_output_shape(x, weight, cfg.conv), cfg.pool)[2:]
    why = conv_fused.unsupported_reason(
        x,
        weight,
        _conv_geometry(cfg.conv),
        None if cfg.pool is None else _pool_geometry(cfg.pool),
        pooled,
        save,
        _compute_dtype(cfg, x),
    )
    if why is None:
        return "triton", None
    if mode == "triton":
        raise UnsupportedInputError(f"{CONV_IMPL_ENV}=triton but the fused conv kernel cannot run: {why}")
    return "library", why


def _forward_kernels(x: Tensor, weight: Tensor, cfg: ConvEpilogueConfig) -> ModuleType:
    """The fused forward's kernel module: ``kernels.conv_dense`` where it serves the case (a plain
    stride-1 1d/2d conv without a pool: one shift per tap over flattened planes, 2.3x faster than
    ``conv_fused`` on Conv2d 64->64 k3 over 64x64x256x256), else the general ``kernels.conv_fused``.
    Both take the same launch arguments and write the same outputs and saved state; cached per
    shapes, strides and dtypes."""
    from ..kernels import conv_dense, conv_fused

    def answer() -> ModuleType:
        pool = None if cfg.pool is None else _pool_geometry(cfg.pool)
        dense = conv_dense.unsupported_reason(x, weight, _conv_geometry(cfg.conv), pool) is None
        return conv_dense if dense else conv_fused

    return _DECISIONS.get(("forward_kernels", tensor_key(x), tensor_key(weight), cfg), answer)


def _conv_geometry(spec: ConvSpec) -> Any:  # conv_fused.ConvGeometry (module imported lazily)
    from ..kernels import conv_fused

    return conv_fused.ConvGeometry(
        transposed=spec.transposed, stride=tuple(spec.stride), padding=tuple(spec.padding),
        dilation=tuple(spec.dilation), output_padding=tuple(spec.output_padding), groups=spec.groups,
    )  # fmt: skip


def _library_conv_meta(x: Tensor, weight: Tensor, spec: ConvSpec, dtype: torch.dtype) -> Tensor:
    """A meta tensor with the shape, strides and dtype (the compute dtype) the library conv (and the
    op's fake) would give y0.

    Mirrors FakeTensor's conv rule (``_select_conv_backend`` + ``_conv_determine_backend_memory_format``)
    without running the conv; cached per shapes, strides, dtypes and devices (asked on every call).
    """
    return _DECISIONS.get(("conv_meta", tensor_key(x), tensor_key(weight), spec, dtype),
                          lambda: _library_conv_meta_uncached(x, weight, spec, dtype))  # fmt: skip


def _library_conv_meta_uncached(x: Tensor, weight: Tensor, spec: ConvSpec, dtype: torch.dtype) -> Tensor:
    shape = _conv_output_shape(x, weight, spec)
    fmt = torch.contiguous_format
    if x.dim() in (4, 5):
        # NOTE: x and weight as stored, not cast: the backend and its memory format depend on the
        # layouts and on float64-or-not (cuDNN's rule), not on fp32 vs bf16/fp16; only a weight
        # whose dtype differs from x's (never under autocast) is cast, once per signature.
        weight = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        backend = torch._C._select_conv_backend(
            x, weight, bias=None, stride=list(spec.stride), padding=list(spec.padding),
            dilation=list(spec.dilation), transposed=spec.transposed,
            output_padding=list(spec.output_padding), groups=spec.groups, bias_sizes=None,
        )  # fmt: skip
        fmt = torch._C._conv_determine_backend_memory_format(x, weight, backend)
    return torch.empty(shape, dtype=dtype, device="meta", memory_format=fmt)


class _FusedForward:
    """The fused conv kernel's forward for one call signature: the output layouts, the operand
    matrix layout and the kernel's launch plan are worked out once; a call allocates the outputs,
    builds ``P`` and launches (``(x, weight, bias, operands) -> (out, saved_a, saved_b)``, tensors
    laid out like the constructor's).  Same outputs and formats as the library path, so the
    backward is shared.

    WHY a plan object: the ConvT3d pipeline's step (16x16x16x32x32) waits on the host; the per-call
    checks, decisions and cache lookups this skips cost more than the launches (146 us per forward on
    the H100 host before).
    """

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvEpilogueConfig, save: bool) -> None:  # fmt: skip
        dtype = _compute_dtype(cfg, x)
        y0, steps, outputs = _forward_layouts(x, weight, operands, cfg, save, dtype)
        self.layouts = [(tuple(t.shape), t.stride(), t.dtype) for t in outputs]
        self.save_a = save
        self.save_b = save and cfg.pool is not None and cfg.pool.kind == "max"
        out, saved_a, saved_b = outputs
        self.launch = _forward_kernels(x, weight, cfg).forward_launch(
            x, weight, bias, steps, _conv_geometry(cfg.conv), None if cfg.pool is None else _pool_geometry(cfg.pool),
            out, saved_a if self.save_a else None, saved_b if self.save_b else None,
            allow_tf32=bool(torch.backends.cudnn.allow_tf32), compute_dtype=dtype,
        )  # fmt: skip
        self.params = _PlannedOperands(cfg, steps, bias, y0.shape[1], x.device)

    def probe(self) -> "_FusedForward":
        """This plan on the tile its autotuner would time first, without tuning (one compile): what
        ``impl_choice`` times to screen the fused kernel before tuning it."""
        probe = copy.copy(self)
        probe.launch = None if self.launch is None else self.launch.probe()
        return probe

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        device = x.device
        out, saved_a, saved_b = (
            torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in self.layouts
        )
        if self.launch is not None:
            self.launch.run(x, weight, self.params(bias, operands), out, saved_a if self.save_a else None,
                            saved_b if self.save_b else None)  # fmt: skip
        return out, saved_a, saved_b


def _forward_layouts(
    x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig, save: bool, dtype: torch.dtype,
) -> tuple[Tensor, list, tuple[Tensor, Tensor, Tensor]]:  # fmt: skip
    """What both forward plans work out first, on meta tensors (no memory): the conv output ``y0`` in
    the compute ``dtype`` and the outputs' memory format (``output_memory_format`` of the fake's
    conv layout, as ``_in_format`` lays it out), the kernels' chain steps, and ``(out, saved_a,
    saved_b)`` as ``_allocate_forward_outputs`` gives them."""
    y0 = _library_conv_meta(x, weight, cfg.conv, dtype)
    y0 = torch.empty(y0.shape, dtype=dtype, device="meta", memory_format=output_memory_format(y0))
    steps = _kernel_steps(cfg, operands, y0.dim(), y0.shape[1])
    out_shape = list(y0.shape) if cfg.pool is None else _pooled_shape(y0.shape, cfg.pool)
    like_x = torch.empty(0, dtype=x.dtype, device="meta")
    return y0, steps, _allocate_forward_outputs(like_x, y0, out_shape, cfg, save)


class _PlannedOperands:
    """``(bias, operands) -> P`` for one call signature: the kernels' ``OperandMatrix`` layout and,
    per tensor row (``tensor_rows`` order: the bias first, then each slot's tensor operands), its
    index into ``(bias, *operands)``."""

    def __init__(self, cfg: ConvEpilogueConfig, steps: Sequence[Any], bias: Tensor | None, channels: int,
                 device: torch.device) -> None:  # fmt: skip
        self.matrix = _kernels().OperandMatrix(steps, bias, channels, device)
        sources = [0] if bias is not None else []
        for step in cfg.chain:
            sources += [1 + operand.index for operand in step.operands if not isinstance(operand, Const)]
        self.sources = tuple(sources)

    def __call__(self, bias: Tensor | None, operands: Sequence[Tensor]) -> Tensor:
        inputs = (bias, *operands)
        return self.matrix.build([inputs[i] for i in self.sources])


def _fused_conv_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
    save: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """One Triton kernel for conv + bias + chain + pool (``_FusedForward``, unplanned)."""
    return _FusedForward(x, weight, bias, operands, cfg, save)(x, weight, bias, operands)


#: Settled per-signature call plans (``_signature``) of the forward and of the backward (whose key
#: adds the output mask and the grad/saved-state layouts).
_FORWARD_PLANS = BoundedCache(256)
_BACKWARD_PLANS = BoundedCache(256)


def _signature(config: str, save: bool, x: Tensor, weight: Tensor, bias: Tensor | None,
               operands: Sequence[Tensor]) -> tuple:  # fmt: skip
    """Everything a call's path and plan depend on: the config, the tensors' shapes, strides, dtypes
    and devices, the TF32 flag and the environment switches (read per call: tests change them)."""
    return (
        config, save, tensor_key(x), tensor_key(weight), tensor_key(bias), tuple(map(tensor_key, operands)),
        torch.backends.cudnn.allow_tf32, *environment.plan_switches(),
    )  # fmt: skip


def _forward_plan(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
    save: bool,
) -> tuple[Any, bool]:  # fmt: skip
    """``(plan, settled)``: the fused conv kernel's plan (``_FusedForward``) or the library conv +
    epilogue kernel (``_LibraryForward``), as ``conv_impl`` says; under ``FUSION_CONV_IMPL=auto``
    the fastest of ``_forward_candidates`` (the fused kernel where it serves the case, the library
    conv in x's layout and in channels-last), measured once per shape (``impl_choice``; the
    library path in x's layout when measuring is off, and without measuring where only the library
    conv serves and the timer has no CUDA device: ``_times_library_layouts``).  ``settled``: the
    same signature always gets this answer (not while the choice is unmeasured), so the caller may
    keep the plan."""
    mode = _conv_impl_mode()
    impl = conv_impl(x, weight, cfg, save)[0]
    if mode != "auto" or (impl == "library" and not _times_library_layouts(x)):
        if impl == "triton":
            return _FusedForward(x, weight, bias, operands, cfg, save), True
        return _LibraryForward(x, weight, bias, operands, cfg, save), True
    plans = _forward_candidates(x, weight, bias, operands, cfg, save, fused=impl == "triton")
    if len(plans) == 1:
        return plans["library"], True
    fast_key = ("forward", tensor_key(x), tensor_key(weight), bias is None, cfg, save,
                torch.backends.cudnn.allow_tf32)  # fmt: skip
    probes = {"triton": functools.partial(plans["triton"].probe(), x, weight, bias, operands)} if "triton" in plans else {}
    impl = impl_choice.choose(
        # (v2: the channels-last library variant joined the candidates; older answers are re-measured)
        lambda: _choice_key(x, weight, bias, cfg, save) + "|forward-v2",
        {name: functools.partial(plan, x, weight, bias, operands) for name, plan in plans.items()},
        default="library",
        agree=_results_agree,
        fast_key=fast_key,
        probes=probes,
    )
    return plans[impl], impl_choice.is_final(fast_key)


def _times_library_layouts(x: Tensor) -> bool:
    """Whether ``auto`` measures the library forward's layouts against each other where the fused
    conv kernel is no candidate: on CUDA only (``impl_choice`` times with CUDA events; on CPU the
    interpreter is slow, and tests force a path or replace this answer)."""
    return x.device.type == "cuda"


def _forward_candidates(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
    save: bool, fused: bool,
) -> dict[str, Any]:  # fmt: skip
    """The forward plans that can serve this call, by name: ``triton`` (``_FusedForward``) when
    ``fused``; always ``library``; ``library-channels-last`` (``_ChannelsLastLibraryForward``) for
    2-d and 3-d convs of an x that is not channels-last (``_channels_last_forward_unsupported``)."""
    args = (x, weight, bias, operands, cfg, save)
    plans: dict[str, Any] = {}
    if fused:
        plans["triton"] = _FusedForward(*args)
    plans["library"] = _LibraryForward(*args)
    why = _channels_last_forward_unsupported(x, weight, cfg)
    if why is None:
        plans["library-channels-last"] = _ChannelsLastLibraryForward(*args)
    else:
        logger.debug("conv_epilogue forward: no channels-last library forward (%s)", why)
    return plans


#: Largest norm-wise relative difference between the fused and the library path's floating results
#: for ``auto`` to consider the fused one, by the results' dtype.  Measured on the H100: both in TF32
#: (the ConvT3d pipeline) they differ by 1e-6..1e-5; a TF32 kernel against cuDNN's full-fp32 kernel
#: for a 3-channel conv (``conv2d_mul_leaky_gelu_small``) by 2.7e-4 in the output and 1e-2 in the
#: gradients (leaky-ReLU kinks flip).
_AGREEMENT = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def _results_agree(result: Any, reference: Any) -> str | None:
    """``impl_choice``'s ``agree`` for the op's paths: None when every floating tensor of ``result``
    is within ``_AGREEMENT`` of ``reference``'s (integer tensors, the max-pool winners, may differ
    at ties), else which one is not."""
    for i, (got, want) in enumerate(zip(result, reference, strict=True)):
        if got is None or want is None or not want.is_floating_point() or want.numel() == 0:
            continue
        # fp32 (no copy for fp32 results: a saved conv output can be 1 GB), fp32-accumulated norms
        a, b = got.float(), want.float()
        finite = b.isfinite()
        if not torch.equal(a.isfinite(), finite):
            return f"result {i}: non-finite values in other places"
        zero = torch.zeros((), dtype=torch.float32, device=b.device)
        diff = torch.where(finite, a - b, zero).norm().item()
        norm = max(torch.where(finite, b, zero).norm().item(), 1e-30)
        if diff > _AGREEMENT.get(want.dtype, 1e-4) * norm:
            return f"result {i}: relative difference {diff / norm:.1e} from the library path"
    return None


def _choice_key(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: ConvEpilogueConfig, save: bool) -> str:
    """Everything the fused-vs-library timing depends on (the chain's op codes included)."""
    return (
        f"conv_epilogue|{cfg.to_json()}|x {tuple(x.shape)} {x.stride()} {x.dtype}|w {tuple(weight.shape)} "
        f"{weight.stride()}|bias {bias is not None}|save {save}|tf32 {torch.backends.cudnn.allow_tf32}"
    )


class _LibraryForward:
    """The library path's forward for one call signature (see ``_FusedForward``): aten's conv
    without bias, then one Triton kernel for bias + chain + pool (+ max-pool winners).  The conv
    output's layout (``_library_conv_meta``, the fake's rule), the outputs' layouts, the operand
    matrix layout and the epilogue kernel's launch (``kernels.epilogue.ForwardLaunch``) are worked
    out once; a call casts, convolves, allocates and launches.

    WHY a plan object: on small convs (Conv2d 3->16 k3 on 128 x 3 x 32 x 32) the step is host time,
    and the per-call checks, key building and Triton's generic launch were most of it.

    ``_ChannelsLastLibraryForward`` is the same plan with the conv in channels-last: it sets
    ``conv_format`` and overrides ``_conv_output``; everything after the conv is shared here.
    """

    #: the memory format x and the weight are relaid into for the conv (None: as they are given)
    conv_format: torch.memory_format | None = None

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvEpilogueConfig, save: bool) -> None:  # fmt: skip
        self.spec = cfg.conv
        self.dtype = _compute_dtype(cfg, x)
        y0, steps, outputs = _forward_layouts(x, weight, operands, cfg, save, self.dtype)
        if self.conv_format is not None:  # a channels-last conv writes a channels-last y0
            y0 = torch.empty(y0.shape, dtype=self.dtype, device="meta", memory_format=self.conv_format)
        #: the conv output's shape and strides: in the outputs' memory format (as ``_in_format``
        #: gives), or channels-last for a channels-last conv (as cuDNN writes it)
        self.y0_layout = (tuple(y0.shape), y0.stride())
        self.layouts = [(tuple(t.shape), t.stride(), t.dtype) for t in outputs]
        self.max_save = save and cfg.pool is not None and cfg.pool.kind == "max"
        #: the conv output is the saved state (no pool / avg pool) ...
        self.save_y0 = save and not self.max_save
        #: ... and y0 itself is it (the conv ran in the saved state's layout: nothing to allocate)
        self.saved_is_y0 = self.save_y0 and self.conv_format is None
        #: ... else the epilogue kernel writes it, relaid into the saved layout, in its pass (no
        #: pool), or ``kernels.relayout`` copies it (avg pool: the kernel writes only pooled values)
        self.kernel_saves_y0 = self.save_y0 and not self.saved_is_y0 and cfg.pool is None
        self.relays_y0 = self.save_y0 and not self.saved_is_y0 and cfg.pool is not None
        #: what ``_plan_launch`` needs besides y0: meta tensors and op codes only (a kept plan holds
        #: no tensor of a call)
        bias_meta = None if bias is None else torch.empty(bias.shape, dtype=bias.dtype, device="meta")
        pool = None if cfg.pool is None else _pool_geometry(cfg.pool)
        self._launch_args = (bias_meta, [(code, ()) for code, _ in steps], pool, outputs)
        #: the epilogue kernel's launches by y0's strides (one, unless the conv surprises us)
        self.launches = {y0.stride(): self._plan_launch(y0)}
        self.params = _PlannedOperands(cfg, steps, bias, y0.shape[1], x.device)

    def _plan_launch(self, y0: Tensor) -> Any:  # kernels.epilogue.ForwardLaunch
        """The epilogue kernel's launch for a conv output laid out like ``y0`` (real or meta)."""
        bias_meta, codes, pool, (out, saved_a, saved_b) = self._launch_args
        return _kernels().ForwardLaunch(
            y0, bias_meta, codes, pool, out, saved_a if self.max_save else None,
            saved_b if self.max_save else None, y_copy=saved_a if self.kernel_saves_y0 else None,
        )  # fmt: skip

    def _conv_output(self, x: Tensor, weight: Tensor) -> Tensor:
        """y0: the conv of x and weight cast to the compute dtype, in ``y0_layout``."""
        xc, wc, _ = _cast_inputs(x, weight, None, self.dtype)
        y0 = _conv(xc, wc, None, self.spec)
        shape, stride = self.y0_layout
        if y0.stride() != stride:
            y0 = torch.empty_strided(shape, stride, dtype=y0.dtype, device=y0.device).copy_(y0)
        return y0

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        y0 = self._conv_output(x, weight)
        launch = self.launches.get(y0.stride())
        if launch is None:  # a layout the plan did not expect (``_ChannelsLastLibraryForward`` only)
            launch = self.launches[y0.stride()] = self._plan_launch(y0)
        out, saved_a, saved_b = (
            y0 if i == 1 and self.saved_is_y0 else torch.empty_strided(shape, stride, dtype=dtype, device=x.device)
            for i, (shape, stride, dtype) in enumerate(self.layouts)
        )  # (the saved conv output is y0 itself where it can be: nothing allocated for it)
        params = self.params(bias, operands)
        if self.max_save:
            launch(y0, params, out, saved_a, saved_b)
        elif self.kernel_saves_y0:
            launch(y0, params, out, y_copy=saved_a)
        else:
            if self.relays_y0:
                _relayout(y0, saved_a)
            launch(y0, params, out)
        return out, saved_a, saved_b


class _ChannelsLastLibraryForward(_LibraryForward):
    """``_LibraryForward`` with the conv on channels-last tensors whatever x's layout, for 2-d and
    3-d convs of an x that is not channels-last (``_channels_last_forward_unsupported``).

    Per call: x is cast to the compute dtype and relaid into channels-last in one copy, and so is
    the weight where it is not channels-last in the compute dtype already (``kernels.relayout``;
    torch's copy where a tensor's spatial dims do not flatten, e.g. a slice).  The weight's copy is
    made on every call and never kept: weights change in training (an optimizer updates them in
    place), and a kept device tensor made during a CUDA-graph capture breaks the graph.  cuDNN then
    picks its channels-last kernels and writes y0 channels-last; the epilogue kernel reads y0
    through its own strides and writes ``out`` (and the saved state) in exactly the layouts of the
    op's fake (``_forward_layouts``: NCHW-contiguous for an NCHW x), through a transposing tile
    where the layouts differ (``kernels.epilogue.ForwardLaunch``).

    Saved state (``save``), in the fake's layouts as the library path writes it: a max pool's
    winners and their y0 come from the kernel as always; without a pool the kernel also writes y0
    relaid into the saved layout in the same pass; with an avg pool ``kernels.relayout`` copies y0
    into it.  Should the conv give y0 in another layout than channels-last (a backend without
    channels-last kernels for the case), the plan adds an epilogue launch for that layout.

    WHY: Inductor runs cuDNN's channels-last conv kernels, the fast ones on Hopper, while an NCHW
    conv runs slower ones (Conv2d 64->64 k3 on 64x64x256x256 alone on the H100: 1.37 / 0.66 ms fp32
    / bf16 channels-last against 2.96 / 1.65 NCHW).  Whether the relayouts of x and of the weight
    plus the transposing epilogue cost less than that difference depends on the shape:
    ``_forward_plan`` measures it per shape.
    """

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvEpilogueConfig, save: bool) -> None:  # fmt: skip
        self.conv_format = _channels_last_format(x.dim())
        super().__init__(x, weight, bias, operands, cfg, save)
        #: the weight is used as given (already channels-last in the compute dtype)
        self.weight_ready = weight.dtype == self.dtype and weight.is_contiguous(memory_format=self.conv_format)

    def _conv_output(self, x: Tensor, weight: Tensor) -> Tensor:
        """y0 from the channels-last conv, in the layout the conv gives (channels-last as planned)."""
        fmt = self.conv_format
        xc = _relayout(x, torch.empty(x.shape, dtype=self.dtype, device=x.device, memory_format=fmt))
        if not self.weight_ready:
            weight = _relayout(weight, torch.empty(weight.shape, dtype=self.dtype, device=weight.device,
                                                   memory_format=fmt))  # fmt: skip
        return _conv(xc, weight, None, self.spec)


def _channels_last_forward_unsupported(x: Tensor, weight: Tensor, cfg: ConvEpilogueConfig) -> str | None:
    """Why the library forward has no channels-last variant worth measuring here, or None."""
    if x.dim() not in (4, 5):
        return f"a {x.dim() - 2}-d conv (cuDNN has channels-last kernels for 2-d and 3-d convs only)"
    dtype = _compute_dtype(cfg, x)
    if dtype == torch.float64:
        return "float64 (cuDNN runs it in NCHW whatever the layout)"
    if x.is_contiguous(memory_format=_channels_last_format(x.dim())):
        return "x is channels-last already"
    if output_memory_format(_library_conv_meta(x, weight, cfg.conv, dtype)) != torch.contiguous_format:
        return "the library conv runs channels-last already (e.g. a channels-last weight)"
    return None


def _backward_plan(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
    saved_a: Tensor, saved_b: Tensor, cfg: ConvEpilogueConfig, mask: Sequence[bool],
) -> tuple[Any, bool]:  # fmt: skip
    """``(plan, settled)`` as ``_forward_plan``: the compact backward (``_CompactBackward``) or the
    library one (``_LibraryBackward``), as ``FUSION_CONV_IMPL`` says; under ``auto`` the fastest of
    ``_backward_candidates`` (the library one in the tensors' layout or in channels-last, the
    compact one), measured once per shape (``impl_choice``; the library path when measuring is
    off).  Cases the compact backward cannot serve (an avg pool) take the library one under
    ``triton``.  ``plan(grad_out, x, weight, bias, operands, saved_a, saved_b)``."""

    args = (grad_out, x, weight, bias, operands, saved_a, saved_b)
    mode = _conv_impl_mode()
    if mode == "library" or (mode == "auto" and x.device.type != "cuda"):
        return _LibraryBackward(*args, cfg, mask), True  # auto on CPU: the interpreter is slow (tests force "triton")
    if mode != "auto":
        why = _compact_backward_unsupported(x, weight, saved_a, saved_b, cfg)
        if why is not None:
            logger.debug("conv_epilogue backward: library path (%s)", why)
            return _LibraryBackward(*args, cfg, mask), True
        return _CompactBackward(*args, cfg, mask), True
    plans = _backward_candidates(*args, cfg, mask)
    if len(plans) == 1:
        return plans["library"], True
    fast_key = ("backward", tensor_key(x), tensor_key(weight), bias is None, cfg, tuple(mask),
                tensor_key(grad_out), torch.backends.cudnn.allow_tf32)  # fmt: skip
    impl = impl_choice.choose(
        # (v2: the channels-last library variant joined the candidates; older answers are re-measured)
        lambda: _choice_key(x, weight, bias, cfg, True) + f"|backward-v2 {tuple(mask)} {grad_out.stride()}",
        {name: functools.partial(plan, *args) for name, plan in plans.items()},
        default="library",
        agree=_results_agree,
        fast_key=fast_key,
    )
    return plans[impl], impl_choice.is_final(fast_key)


def _backward_candidates(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
    saved_a: Tensor, saved_b: Tensor, cfg: ConvEpilogueConfig, mask: Sequence[bool],
) -> dict[str, Any]:  # fmt: skip
    """The backward plans that can serve this call, by name: always ``library``; ``compact``
    (``_CompactBackward``) where it serves the case; ``library-channels-last`` where x and the
    saved state are not channels-last already and cuDNN has channels-last kernels."""
    args = (grad_out, x, weight, bias, operands, saved_a, saved_b)
    plans: dict[str, Any] = {"library": _LibraryBackward(*args, cfg, mask)}
    why = _compact_backward_never_wins(cfg) or _compact_backward_unsupported(x, weight, saved_a, saved_b, cfg)
    if why is None:
        plans["compact"] = _CompactBackward(*args, cfg, mask)
    else:
        logger.debug("conv_epilogue backward: no compact backward (%s)", why)
    why = _channels_last_backward_unsupported(x, saved_a)
    if why is None:
        plans["library-channels-last"] = _LibraryBackward(*args, cfg, mask, channels_last=True)
    else:
        logger.debug("conv_epilogue backward: no channels-last library backward (%s)", why)
    return plans


def _slot_wanted(cfg: ConvEpilogueConfig, operand_mask: Sequence[bool]) -> list[bool]:
    """Per chain slot: whether the gradient of its (tensor) operand is wanted."""
    return [
        step.kind.differentiable_operands == (0,)
        and not isinstance(step.operands[0], Const)
        and operand_mask[step.operands[0].index]
        for step in cfg.chain
    ]


def _operand_grad_recipe(
    cfg: ConvEpilogueConfig, operands: Sequence[Tensor], operand_mask: Sequence[bool],
    slot_has_sum: Sequence[bool],
) -> list[tuple[list[int], bool, torch.Size, torch.dtype] | None]:  # fmt: skip
    """Per operand, None (not wanted) or ``(slots whose sums add up to its gradient, is one value,
    shape, dtype)``; ``slot_has_sum[k]``: slot k's gradient sum is computed (its step has a tensor
    first operand)."""
    recipe: list[tuple[list[int], bool, torch.Size, torch.dtype] | None] = []
    for i, t in enumerate(operands):
        if not operand_mask[i]:
            recipe.append(None)
            continue
        slots = [k for k, step in enumerate(cfg.chain) if slot_has_sum[k] and step.operands[0] == TensorRef(i)]
        recipe.append((slots, t.numel() == 1, t.shape, t.dtype))
    return recipe


def _sum_operand_grads(
    recipe: Sequence[tuple[list[int], bool, torch.Size, torch.dtype] | None],
    slot_grads: Sequence[Tensor | None], channels: int, device: torch.device,
) -> list[Tensor | None]:  # fmt: skip
    """The operand gradients of ``_operand_grad_recipe`` from the slots' fp32 (C,) sums."""
    grads: list[Tensor | None] = []
    for entry in recipe:
        if entry is None:
            grads.append(None)
            continue
        slots, one_value, shape, dtype = entry
        if not slots:  # feeds only operands without a gradient (e.g. a clamp bound)
            grads.append(torch.zeros(shape, dtype=dtype, device=device))
            continue
        total = slot_grads[slots[0]]
        for k in slots[1:]:
            total = total + slot_grads[k]
        total = total.sum() if one_value else total
        grads.append(total.reshape(shape).to(dtype))
    return grads


class _LibraryBackward:
    """The library path's backward for one call signature (see ``_CompactBackward`` for the plan
    contract): one Triton kernel writes the full-size conv-output gradient and the per-channel
    operand/bias sums (``kernels.epilogue.BackwardLaunch``, worked out once with the operand matrix
    layout and the operand-gradient recipe), then ``aten.convolution_backward`` for x and weight (on
    x and weight cast to the compute dtype; ``_like`` casts the gradients back).

    ``channels_last``: the conv backward runs on channels-last tensors whatever the layout of x and
    the saved state: the epilogue kernel writes the conv-output gradient channels-last (transposing
    in its tile), x is cast and relaid in one copy and the input gradient relaid back
    (``kernels.relayout``, at memory speed: torch's strided copy runs at a fifth of it).
    WHY: cuDNN's NCHW backward converts x and the conv-output gradient to channels-last itself, once
    for the dgrad and again for the wgrad (Conv2d 64->64 k3 on 64x64x256x256, H100: 7.30 ms fp32 /
    3.34 ms bf16 against 4.22 / 1.30 for its channels-last kernels alone); ``_backward_plan``
    measures whether the variant wins per shape.
    """

    def __init__(self, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor], saved_a: Tensor, saved_b: Tensor, cfg: ConvEpilogueConfig,
                 mask: Sequence[bool], channels_last: bool = False) -> None:  # fmt: skip
        kernels = _kernels()
        self.spec, self.mask = cfg.conv, tuple(mask)
        self.dtype = _compute_dtype(cfg, x)
        self.is_max = cfg.pool is not None and cfg.pool.kind == "max"
        #: the memory format x is relaid into for the conv backward (None: as it is)
        self.x_format = _channels_last_format(x.dim()) if channels_last else None
        if self.is_max or channels_last:
            y_shape = _conv_output_shape(x, weight, cfg.conv)
            fmt = self.x_format if channels_last else output_memory_format(saved_a)
            grad_y = torch.empty(y_shape, dtype=saved_b.dtype if self.is_max else saved_a.dtype, device="meta",
                                 memory_format=fmt)  # fmt: skip
        else:
            grad_y = torch.empty_strided(saved_a.shape, saved_a.stride(), dtype=saved_a.dtype, device="meta")
        self.g_layout = (tuple(grad_y.shape), grad_y.stride(), grad_y.dtype)
        channels = grad_y.shape[1]
        steps = _kernel_steps(cfg, operands, grad_y.dim(), channels)
        slots = _slot_wanted(cfg, mask[3:])
        self.want_bias = bool(mask[2]) and bias is not None
        self.epilogue = kernels.BackwardLaunch(
            grad_out, None if self.is_max else saved_a, saved_a if self.is_max else None,
            saved_b if self.is_max else None, bias, steps, None if cfg.pool is None else _pool_geometry(cfg.pool),
            grad_y, slots, self.want_bias,
        )  # fmt: skip
        self.params = _PlannedOperands(cfg, steps, bias, channels, x.device)
        self.operand_recipe = _operand_grad_recipe(cfg, operands, mask[3:], slots)

    def __call__(self, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor], saved_a: Tensor, saved_b: Tensor) -> list[Tensor | None]:  # fmt: skip
        shape, stride, dtype = self.g_layout
        grad_y = torch.empty_strided(shape, stride, dtype=dtype, device=grad_out.device)
        if self.is_max:
            y0, winner, winner_y = None, saved_a, saved_b
        else:
            y0, winner, winner_y = saved_a, None, None
        slot_grads, grad_bias = self.epilogue(grad_out, y0, winner, winner_y, self.params(bias, operands), grad_y)
        grad_operands = _sum_operand_grads(self.operand_recipe, slot_grads, shape[1], grad_y.device)
        x_in = x
        if self.x_format is not None:  # one copy casts and relays
            x = _relayout(x, torch.empty(x.shape, dtype=self.dtype, device=x.device, memory_format=self.x_format))
        x, weight, _ = _cast_inputs(x, weight, None, self.dtype)  # grads: ``_like`` casts back
        grad_x, grad_w, _ = _conv_backward(grad_y, x, weight, self.spec, self.mask[0], self.mask[1])
        if self.x_format is not None and grad_x is not None:  # back to x's layout and dtype (``_like``'s)
            grad_x = _relayout(grad_x, torch.empty_like(x_in))
        return [grad_x, grad_w, grad_bias.to(bias.dtype) if self.want_bias else None, *grad_operands]


def _relayout(src: Tensor, dst: Tensor) -> Tensor:
    """``dst.copy_(src)``, through ``kernels.relayout`` where it serves the layouts (any whose
    spatial dims flatten; torch's copy otherwise)."""
    from ..kernels.relayout import relayout_or_copy  # lazily: TRITON_INTERPRET is read at import

    return relayout_or_copy(src, dst)


def _channels_last_format(ndim: int) -> torch.memory_format:
    return torch.channels_last if ndim == 4 else torch.channels_last_3d


def _channels_last_backward_unsupported(x: Tensor, saved_a: Tensor) -> str | None:
    """Why the library backward has no channels-last variant worth measuring here, or None."""
    if x.dim() not in (4, 5):
        return f"a {x.dim() - 2}-d conv (cuDNN has channels-last kernels for 2-d and 3-d convs only)"
    if x.dtype == torch.float64:
        return "float64 (cuDNN runs it in NCHW whatever the layout)"
    if output_memory_format(saved_a) != torch.contiguous_format or x.is_contiguous(memory_format=_channels_last_format(x.dim())):
        return "the tensors are channels-last already"
    return None


def _compact_backward_never_wins(cfg: ConvEpilogueConfig) -> str | None:
    """Why ``auto`` does not time the compact backward here (None: it may win).

    NOTE: measured on the H100 (``python -m fusion_backend bench --suite seeds`` and six ``convnets``
    files, with ``logging.getLogger("fusion_backend.impl_choice")`` at INFO): the compact backward
    beat cuDNN's only behind a transposed conv followed by a max pool (ConvTranspose3d k3 s2 +
    max_pool3d: 0.56 vs 1.66 ms fp32, 0.46 vs 0.79 ms bf16).  Everywhere else it lost: Conv3d 32->64
    + max_pool3d 19.4 vs 1.7 ms, Conv2d 64->64 at 256x256 12.4 vs 3.3 ms, Conv1d 80->256 0.66 vs
    0.21 ms, ConvTranspose2d 256->128 without a pool 0.96 vs 0.14 ms, a Conv2d at batch 1 0.96 vs
    0.14 ms (one tiny Conv2d won by 11%, in a region Inductor kept anyway), while its kernels cost
    about 10 s of a first call to compile and tune.  ``FUSION_CONV_IMPL=triton`` still runs it
    wherever it serves the case."""
    if cfg.conv.transposed and cfg.pool is not None and cfg.pool.kind == "max":
        return None
    return ("the compact backward wins only behind a transposed conv with a max pool (measured), so auto "
            "does not time it here")


def _compact_backward_unsupported(
    x: Tensor, weight: Tensor, saved_a: Tensor, saved_b: Tensor, cfg: ConvEpilogueConfig
) -> str | None:
    """None when ``_compact_backward`` serves the case, else why not."""
    if cfg.pool is not None and cfg.pool.kind != "max":
        return "an avg pool's conv-output gradient needs the full-size chain derivative (library backward)"
    if x.device.type != "cuda" and not environment.cpu_kernels_triton():
        return "the compact backward runs on CUDA (or the interpreter)"
    from ..kernels import conv_fused_bwd

    spec = cfg.conv
    grad = saved_a if cfg.pool is None else _pooled_grad(saved_b, saved_a, cfg.pool)
    return conv_fused_bwd.unsupported_reason(
        grad, x, weight, spec.stride, spec.padding, spec.dilation, spec.transposed, spec.output_padding,
        spec.groups,
    )  # fmt: skip


def _pooled_grad(g_win: Tensor, winner: Tensor, pool: PoolSpec) -> Any:  # conv_fused_bwd.PooledGrad
    from ..kernels import conv_fused_bwd

    return conv_fused_bwd.PooledGrad(
        g_win, winner, tuple(pool.kernel_size), _pool_stride(pool), tuple(pool.padding), ceil_mode=pool.ceil_mode
    )


class _CompactBackward:
    """The conv backward never materializes the full-size gradient behind a max pool.

    The chain is differentiated at the winners only (the epilogue backward kernel without a pool,
    on the pooled-size saved state): ``g_win = grad_out * chain'(y0_winner)``, with the operand and
    bias sums in the same pass; then ``_compact_kernels`` (shift or general) compute grad x and
    weight with loaders that expand ``(g_win, winner)`` on the fly.  Without a pool the dense
    conv-output gradient is written as in the library path and the same Triton conv backward
    consumes it.

    A plan for one call signature (see ``_FusedForward``): built from a call's arguments, called
    as ``(grad_out, x, weight, bias, operands, saved_a, saved_b) -> [gx, gw, gb, *g_operands]``
    (None where the mask is off) with tensors laid out like them.
    """

    def __init__(self, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor], saved_a: Tensor, saved_b: Tensor, cfg: ConvEpilogueConfig,
                 mask: Sequence[bool]) -> None:  # fmt: skip
        kernels = _kernels()
        self.pool = cfg.pool  # not None: a max pool (``_compact_backward_unsupported``)
        y_src = saved_b if self.pool is not None else saved_a
        #: the gradient at the winners (or the dense conv-output gradient) is laid out like y_src
        self.g_layout = (tuple(y_src.shape), y_src.stride(), y_src.dtype)
        channels = y_src.shape[1]
        steps = _kernel_steps(cfg, operands, y_src.dim(), channels)
        slots = _slot_wanted(cfg, mask[3:])
        self.want_bias = bool(mask[2]) and bias is not None
        self.epilogue = kernels.BackwardLaunch(grad_out, y_src, None, None, bias, steps, None, y_src, slots,
                                               self.want_bias)  # fmt: skip
        self.params = _PlannedOperands(cfg, steps, bias, channels, x.device)
        self.operand_recipe = _operand_grad_recipe(cfg, operands, mask[3:], slots)
        self.bias_dtype = None if bias is None else bias.dtype
        grad = _pooled_grad(y_src, saved_a, self.pool) if self.pool is not None else y_src
        spec = cfg.conv
        conv_args = (grad, x, weight, spec.stride, spec.padding, spec.dilation, spec.transposed, spec.output_padding,
                     spec.groups)  # fmt: skip
        from ..kernels import conv_shift_bwd

        dtype = _compute_dtype(cfg, x)
        kernels_module = _compact_kernels(conv_args, cfg, dtype)
        #: None, or the compute dtype x and weight are cast to before the general conv-backward
        #: kernels (``conv_fused_bwd`` computes in x's dtype; ``conv_shift_bwd`` casts as it loads)
        self.cast_to = None
        if kernels_module is conv_shift_bwd:
            self.conv_backward = kernels_module.backward_plan(*conv_args, [mask[0], mask[1]], dtype)
        else:
            if (x.dtype, weight.dtype) != (dtype, dtype):
                self.cast_to = dtype
                conv_args = (grad, x.to(dtype), weight.to(dtype), *conv_args[3:])
            self.conv_backward = kernels_module.backward_plan(*conv_args, [mask[0], mask[1]])

    def __call__(self, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor], saved_a: Tensor, saved_b: Tensor) -> list[Tensor | None]:  # fmt: skip
        y_src = saved_b if self.pool is not None else saved_a
        shape, stride, dtype = self.g_layout
        g = torch.empty_strided(shape, stride, dtype=dtype, device=y_src.device)
        slot_grads, grad_bias = self.epilogue(grad_out, y_src, None, None, self.params(bias, operands), g)
        grad = _pooled_grad(g, saved_a, self.pool) if self.pool is not None else g
        if self.cast_to is not None:  # the results' dtype is then cast back by ``_like``
            x, weight = x.to(self.cast_to), weight.to(self.cast_to)
        grad_x, grad_w = self.conv_backward(grad, x, weight)
        grad_operands = _sum_operand_grads(self.operand_recipe, slot_grads, shape[1], g.device)
        return [grad_x, grad_w, None if grad_bias is None else grad_bias.to(self.bias_dtype), *grad_operands]


def _compact_kernels(conv_args: tuple, cfg: ConvEpilogueConfig, dtype: torch.dtype) -> ModuleType:
    """The conv-backward kernels of the compact backward: ``kernels.conv_shift_bwd`` (dense GEMMs
    over (shift, window offset), for a transposed conv under a max pool whose stride is the conv's)
    where it serves the case, else the general ``kernels.conv_fused_bwd``.  Both take the same
    arguments (``conv_args``) and give the same results (``conv_shift_bwd`` also takes the compute
    ``dtype`` and casts as it loads); the answer is cached per shapes."""
    from ..kernels import conv_fused_bwd, conv_shift_bwd

    grad, x, weight = conv_args[:3]
    if not isinstance(grad, conv_fused_bwd.PooledGrad):
        return conv_fused_bwd
    key = ("compact_kernels", tensor_key(grad.g_win), tensor_key(grad.winner), tensor_key(x), tensor_key(weight), cfg)
    why = _DECISIONS.get(key, lambda: conv_shift_bwd.unsupported_reason(*conv_args, compute_dtype=dtype))
    return conv_fused_bwd if why is not None else conv_shift_bwd


def _conv_backward(
    grad_y: Tensor, x: Tensor, weight: Tensor, spec: ConvSpec, need_x: bool, need_w: bool, need_b: bool = False
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``aten.convolution_backward``: grad x, weight and (``need_b``) bias, None where not needed."""
    if not (need_x or need_w or need_b):
        return None, None, None
    channels = weight.shape[1] * spec.groups if spec.transposed else weight.shape[0]
    grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
        grad_y, x, weight, [channels] if need_b else None, list(spec.stride), list(spec.padding),
        list(spec.dilation), spec.transposed, list(spec.output_padding), spec.groups, [need_x, need_w, need_b],
    )  # fmt: skip
    return grad_x, grad_w, grad_b if need_b else None


# --------------------------------------------------------------------------------------------------
# Reference path (plain torch)
# --------------------------------------------------------------------------------------------------


def _window_strides(sizes: Sequence[int]) -> list[int]:
    """Row-major strides of a box of ``sizes``."""
    return [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]


def _window_origins(pooled_shape: Sequence[int], pool: PoolSpec, device: torch.device) -> list[Tensor]:
    """Per spatial dim, the (broadcastable) input coordinate where each pooled window starts."""
    dims = len(pooled_shape) - 2
    origins = []
    for j, (size, s, p) in enumerate(zip(pooled_shape[2:], _pool_stride(pool), pool.padding, strict=True)):
        shape = [1] * (dims + 2)
        shape[2 + j] = size
        origins.append((torch.arange(size, device=device) * s - p).reshape(shape))
    return origins


def _reference_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
    save: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager ops (the bias added after a bias-free conv, as the kernels do); max-pool winners from
    ``return_indices``, converted to row-major indices within each window."""
    dtype = _compute_dtype(cfg, x)
    xc, weight, bias = _cast_inputs(x, weight, bias, dtype)
    y0 = _conv(xc, weight, None, cfg.conv)
    fmt = output_memory_format(y0)
    y = y0 if bias is None else y0 + _channel_view(bias, y0.dim())
    v = apply_chain(y, cfg.chain, operands)
    saved_a, saved_b = _placeholder(x), _placeholder(x)
    pool = cfg.pool
    if pool is not None and pool.kind == "max" and save:
        v, flat = _pool(v, pool, return_indices=True)
        # Flat in-plane index -> row-major index within the window.
        spatial = list(y0.shape[2:])
        win = torch.zeros_like(flat)
        for j, (origin, stride, k_stride) in enumerate(
            zip(_window_origins(flat.shape, pool, flat.device), _window_strides(spatial),
                _window_strides(pool.kernel_size), strict=True)
        ):  # fmt: skip
            coord = (flat // stride) % spatial[j]
            win = win + (coord - origin) * k_stride
        saved_a = _in_format(win.to(_winner_dtype(pool)), fmt)
        gathered = y0.reshape(y0.shape[0], y0.shape[1], -1).gather(
            2, flat.reshape(flat.shape[0], flat.shape[1], -1)
        )
        saved_b = _in_format(gathered.reshape(flat.shape), fmt)
    else:
        if pool is not None:
            v = _pool(v, pool)
        if save:
            saved_a = _in_format(y0, fmt)
    out = _in_format(v.to(_out_dtype(cfg, dtype)), fmt)
    if out.data_ptr() == y0.data_ptr():  # empty chain, no bias, no pool: outputs must not alias
        out = torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=fmt).copy_(out)
    return out, saved_a, saved_b


def _reference_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
    saved_a: Tensor, saved_b: Tensor, cfg: ConvEpilogueConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    """The chain recomputed on the saved state and differentiated step by step, then
    ``convolution_backward``.

    With a max pool the chain is recomputed on the winners only (pooled shape) and the resulting
    gradient is scattered (accumulating: windows may overlap) to the full-size conv output.

    NOTE: the chain is differentiated with torch's own backward formulas (``_step_vjp``), not with
    ``torch.autograd``: custom-op implementations run below the autograd dispatch key, where
    ``enable_grad()`` records nothing, and functorch transforms there clash with dispatch modes
    (opcheck's schema check, flop counters).
    """
    pool = cfg.pool
    is_max = pool is not None and pool.kind == "max"
    x, weight, bias_c = _cast_inputs(x, weight, bias, _compute_dtype(cfg, x))  # grads: ``_like`` casts back
    y_src = saved_b if is_max else saved_a
    y = y_src if bias_c is None else y_src + _channel_view(bias_c, y_src.dim())
    v, tape = _chain_with_tape(y, cfg.chain, operands)
    grad_v = grad_out.to(v.dtype)
    if pool is not None and not is_max:
        grad_v = _avg_pool_backward(grad_v, v, pool)
    grad_y, grad_operands = _chain_backward(tape, grad_v, operands, mask[3:])
    if is_max:
        grad_y = _scatter_to_windows(grad_y, saved_a, _conv_output_shape(x, weight, cfg.conv), pool)
    # The bias gradient comes from the same aten call as eager's: on these heavily cancelling sums
    # any other summation order differs from eager by ~1e-4 (from float64 by as much), this one by 0.
    grad_x, grad_w, grad_bias = _conv_backward(
        grad_y.to(x.dtype), x, weight, cfg.conv, mask[0], mask[1], bool(mask[2])
    )
    return [grad_x, grad_w, None if grad_bias is None else grad_bias.to(bias.dtype), *grad_operands]


_Tape = list[tuple[ChainStep, Tensor, list[Union[Tensor, float]]]]


def _chain_with_tape(
    y: Tensor, chain: Sequence[ChainStep], operands: Sequence[Tensor]
) -> tuple[Tensor, _Tape]:
    """``apply_chain`` that also records each step's input and operand values."""
    tape: _Tape = []
    for step in chain:
        values = [o.value if isinstance(o, Const) else operands[o.index].detach() for o in step.operands]
        tape.append((step, y, values))
        y = apply_step(step.kind, y, values)
    return y, tape


def _chain_backward(
    tape: _Tape, grad: Tensor, operands: Sequence[Tensor], operand_mask: Sequence[bool]
) -> tuple[Tensor, list[Tensor | None]]:
    """Walk ``tape`` backwards: the gradient of the chain's input and of the masked operands."""
    grad_operands: list[Tensor | None] = [
        torch.zeros_like(t) if m else None for t, m in zip(operands, operand_mask, strict=True)
    ]
    for step, v, values in reversed(tape):
        grad_v, grad_a = _step_vjp(step.kind, v, values, grad)
        operand = step.operands[0] if step.operands else None
        if grad_a is not None and isinstance(operand, TensorRef) and operand_mask[operand.index]:
            t = operands[operand.index]
            reduced = grad_a.sum() if t.dim() == 0 else grad_a.sum_to_size(t.shape)
            grad_operands[operand.index] = grad_operands[operand.index] + reduced.to(t.dtype)
        grad = grad_v.to(v.dtype)  # as autograd does across a type-promoting op
    return grad, grad_operands


def _step_vjp(
    kind: PointwiseKind, v: Tensor, values: Sequence[Union[Tensor, float]], g: Tensor
) -> tuple[Tensor, Tensor | None]:
    """``(d/dv, d/d first operand)`` of one step at input ``v``, with torch's backward formulas.

    The operand gradient is full-size (not reduced); it is None for non-arithmetic kinds.
    """
    aten = torch.ops.aten
    a = values[0] if values else None
    if kind is PointwiseKind.RELU:
        return aten.threshold_backward(g, torch.relu(v), 0), None
    if kind is PointwiseKind.LEAKY_RELU:
        return torch.where(v > 0, g, g * a), None
    if kind is PointwiseKind.GELU:
        return aten.gelu_backward(g, v), None
    if kind is PointwiseKind.GELU_TANH:
        return aten.gelu_backward(g, v, approximate="tanh"), None
    if kind is PointwiseKind.SILU:
        return aten.silu_backward(g, v), None
    if kind is PointwiseKind.SIGMOID:
        return aten.sigmoid_backward(g, torch.sigmoid(v)), None
    if kind is PointwiseKind.TANH:
        return aten.tanh_backward(g, torch.tanh(v)), None
    if kind is PointwiseKind.HARDSWISH:
        return aten.hardswish_backward(g, v), None
    if kind is PointwiseKind.MISH:
        return aten.mish_backward(g, v), None
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    if kind is PointwiseKind.CLAMP:
        return torch.where((v >= a) & (v <= values[1]), g, zero), None
    if kind is PointwiseKind.CLAMP_MIN:
        return torch.where(v >= a, g, zero), None
    if kind is PointwiseKind.CLAMP_MAX:
        return torch.where(v <= a, g, zero), None
    if kind is PointwiseKind.HARDTANH:
        return torch.where(((v > a) & (v < values[1])) | torch.isnan(v), g, zero), None
    if kind is PointwiseKind.MUL:
        return g * a, g * v
    if kind is PointwiseKind.ADD:
        return g, g
    if kind is PointwiseKind.SUB:
        return g, -g
    if kind is PointwiseKind.RSUB:
        return -g, g
    if kind is PointwiseKind.DIV:
        return g / a, -g * v / (a * a)
    if kind is PointwiseKind.RDIV:
        if not isinstance(a, Tensor):  # float / tensor is reciprocal(v) * a in torch
            r = torch.reciprocal(v)
            return -(g * a) * (r * r), None
        return -g * a / (v * v), g / v
    raise AssertionError(f"unhandled pointwise kind {kind}")


def _avg_pool_backward(grad: Tensor, v: Tensor, pool: PoolSpec) -> Tensor:
    """Gradient of ``_pool(v, pool)`` (an avg pool) w.r.t. ``v``."""
    k, s, p = list(pool.kernel_size), list(_pool_stride(pool)), list(pool.padding)
    args = (pool.ceil_mode, pool.count_include_pad, pool.divisor_override)
    if v.dim() == 3:  # pooled as a (1, L) plane, see _pool
        return torch.ops.aten.avg_pool2d_backward(
            grad.unsqueeze(-2), v.unsqueeze(-2), [1, k[0]], [1, s[0]], [0, p[0]], *args
        ).squeeze(-2)
    fn = torch.ops.aten.avg_pool2d_backward if v.dim() == 4 else torch.ops.aten.avg_pool3d_backward
    return fn(grad, v, k, s, p, *args)


def _scatter_to_windows(grad_w: Tensor, winner: Tensor, y_shape: Sequence[int], pool: PoolSpec) -> Tensor:
    """Full-size (N, C, *spatial) gradient from per-window gradients at the winners (summing)."""
    spatial = list(y_shape[2:])
    rem = winner.to(torch.int64)
    flat = torch.zeros_like(rem)
    for j, (origin, k_stride, plane_stride) in enumerate(
        zip(_window_origins(winner.shape, pool, winner.device), _window_strides(pool.kernel_size),
            _window_strides(spatial), strict=True)
    ):  # fmt: skip
        k = (rem // k_stride) % pool.kernel_size[j]
        flat = flat + (origin + k) * plane_stride
    n, c = y_shape[:2]
    full = torch.zeros(n, c, math.prod(spatial), dtype=grad_w.dtype, device=grad_w.device)
    full.scatter_add_(2, flat.reshape(n, c, -1), grad_w.reshape(n, c, -1))
    return full.reshape(y_shape)
