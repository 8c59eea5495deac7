"""The Triton backward of ``fusion::conv_epilogue``: the library backward (epilogue-gradient kernel, then
``aten.convolution_backward``; channels-last variant), the Triton backward (the chain differentiated
at the max-pool winners only, expanded inside Triton conv-backward kernels), the measured choice
among them, and the per-signature call plans (``plan_for``, kept in ``PLANS``).
"""

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ... import environment
from ...ir.specs import PoolSpec
from ...kernels.host import BoundedCache, tensor_key
from .. import conv_io, conv_precision
from ..chain_lowering import kernel_steps, operand_grad_recipe, sum_operand_grads, wanted_slots
from ..config import ConvEpilogueConfig
from ..library_conv import channels_last_problem
from .forward import (
    PlannedOperands,
    call_signature,
    choice_key,
    epilogue_kernels,
    logger,
    measured_plan,
)
from .reference import backward as reference_backward
from .reference import cast_inputs, conv_compute_dtype

#: Settled per-signature backward call plans, keyed by ``forward.call_signature`` plus the output
#: mask and the grad / saved-state layouts (``settled``).
PLANS = BoundedCache(256)


def settled(config: str, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
            saved_y0: Tensor, saved_winner: Tensor, mask: Sequence[bool]) -> Any:  # fmt: skip
    """The declaration's ``settled_backward``: the plan settled for this call's signature, or None."""
    return PLANS.peek((
        (config, True, tensor_key(x), tensor_key(weight), tensor_key(bias), tuple(map(tensor_key, operands)),
         torch.backends.cudnn.allow_tf32, *environment.plan_switches()),
        tuple(mask), tensor_key(grad_out), tensor_key(saved_y0), tensor_key(saved_winner),
    ))  # fmt: skip


def backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             saved_y0: Tensor, saved_winner: Tensor, cfg: ConvEpilogueConfig,
             mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """The declaration's Triton backward for a call without a settled plan: ``plan_for``, kept when
    settled (as ``forward.forward`` keeps its plans), then run."""
    plan, is_settled = plan_for(grad_out, x, weight, bias, operands, saved_y0, saved_winner, cfg, mask)
    if is_settled:
        key = (call_signature(cfg.to_json(), True, x, weight, bias, operands), tuple(mask), tensor_key(grad_out),
               tensor_key(saved_y0), tensor_key(saved_winner))  # fmt: skip
        PLANS.put(key, plan)
    return plan(grad_out, x, weight, bias, operands, saved_y0, saved_winner)


def plan_for(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
    saved_y0: Tensor, saved_winner: Tensor, cfg: ConvEpilogueConfig, mask: Sequence[bool],
) -> tuple[Any, bool]:  # fmt: skip
    """``(plan, settled)`` as ``forward.plan_for``: the Triton backward (``TritonBackward``) or the
    library one (``LibraryBackward``), as ``FUSION_CONV_IMPL`` says; under ``auto`` the fastest of
    ``backward_candidates`` (the library one in the tensors' layout or in channels-last, the
    Triton one), measured once per shape (``impl_choice``; the library path when measuring is
    off; the library path under ``family``, whose forward serves only calls without a backward).
    Cases the Triton backward cannot serve (an avg pool) take the library one under ``triton``.
    ``plan(grad_out, x, weight, bias, operands, saved_y0, saved_winner)``."""

    if cfg.family_only:
        return ReferenceBackward(cfg, mask), True
    args = (grad_out, x, weight, bias, operands, saved_y0, saved_winner)
    mode = environment.conv_impl()
    if mode in ("library", "family") or (mode == "auto" and x.device.type != "cuda"):
        plan = LibraryBackward(*args, cfg, mask)  # auto on CPU: the interpreter is slow (tests force "triton")
        return plan, plan.settled
    if mode != "auto":
        why = triton_backward_unsupported(x, weight, saved_y0, saved_winner, cfg)
        if why is not None:
            logger.debug("conv_epilogue backward: library path (%s)", why)
            plan = LibraryBackward(*args, cfg, mask)
        else:
            plan = TritonBackward(*args, cfg, mask)
        return plan, plan.settled
    fast_key = ("backward", tensor_key(x), tensor_key(weight), bias is None, cfg, tuple(mask),
                tensor_key(grad_out), torch.backends.cudnn.allow_tf32)  # fmt: skip
    return measured_plan(backward_candidates(*args, cfg, mask), args,
                         lambda: choice_key(x, weight, bias, cfg, True) + f"|backward-v2 {tuple(mask)} {grad_out.stride()}",
                         fast_key)  # fmt: skip


def backward_candidates(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
    saved_y0: Tensor, saved_winner: Tensor, cfg: ConvEpilogueConfig, mask: Sequence[bool],
) -> dict[str, Any]:  # fmt: skip
    """The backward plans that can serve this call, by name: always ``library``; ``triton``
    (``TritonBackward``) where it serves the case; ``library-channels-last`` where x and the
    saved state are not channels-last already and cuDNN has channels-last kernels."""
    args = (grad_out, x, weight, bias, operands, saved_y0, saved_winner)
    plans: dict[str, Any] = {"library": LibraryBackward(*args, cfg, mask)}
    why = triton_backward_never_wins(cfg) or triton_backward_unsupported(x, weight, saved_y0, saved_winner, cfg)
    if why is None:
        plans["triton"] = TritonBackward(*args, cfg, mask)
    else:
        logger.debug("conv_epilogue backward: no Triton backward (%s)", why)
    why = channels_last_backward_unsupported(x, saved_y0)
    if why is None:
        plans["library-channels-last"] = LibraryBackward(*args, cfg, mask, channels_last=True)
    else:
        logger.debug("conv_epilogue backward: no channels-last library backward (%s)", why)
    return plans


class _ChainGradient:
    """What both backward plans share: the epilogue-gradient kernel's launch
    (``kernels.epilogue.BackwardLaunch``, worked out once with the operand matrix layout and the
    operand-gradient recipe, ``chain_lowering.operand_grad_recipe``), which writes the chain's gradient
    laid out as ``grad_y`` and the per-channel operand and bias sums."""

    def _plan_chain_gradient(self, grad_out: Tensor, y0: Tensor | None, winner: Tensor | None,
                             winner_y: Tensor | None, bias: Tensor | None, operands: Sequence[Tensor],
                             cfg: ConvEpilogueConfig, pool: PoolSpec | None, grad_y: Tensor,
                             mask: Sequence[bool]) -> None:  # fmt: skip
        self.g_layout = (tuple(grad_y.shape), grad_y.stride(), grad_y.dtype)
        steps = kernel_steps(cfg.chain, operands, grad_y.dim(), grad_y.shape[1])
        self.want_bias = bool(mask[2]) and bias is not None
        self.epilogue = epilogue_kernels().BackwardLaunch(grad_out, y0, winner, winner_y, bias, steps, pool, grad_y,
                                                          wanted_slots(cfg.chain, mask[3:]), self.want_bias)  # fmt: skip
        self.params = PlannedOperands(cfg, steps, bias, grad_y.shape[1], grad_out.device)
        self.operand_recipe = operand_grad_recipe([cfg.chain], operands, mask[3:])

    def _chain_gradient(self, grad_out: Tensor, y0: Tensor | None, winner: Tensor | None, winner_y: Tensor | None,
                        bias: Tensor | None,
                        operands: Sequence[Tensor]) -> tuple[Tensor, list[Tensor | None], Tensor | None]:  # fmt: skip
        """``(grad_y, operand gradients, bias gradient sum)`` from one launch of the kernel."""
        shape, stride, dtype = self.g_layout
        grad_y = torch.empty_strided(shape, stride, dtype=dtype, device=grad_out.device)
        slot_grads, grad_bias = self.epilogue(grad_out, y0, winner, winner_y, *self.params(bias, operands), grad_y)
        return grad_y, sum_operand_grads(self.operand_recipe, [slot_grads]), grad_bias


class ReferenceBackward:
    """``reference.backward`` on the call's device as a plan: a region with a residual (whose gradient,
    the chain's at its add, is full-size: no epilogue kernel writes one) or an input gate."""

    def __init__(self, cfg: ConvEpilogueConfig, mask: Sequence[bool]) -> None:
        self.cfg, self.mask = cfg, tuple(mask)

    def __call__(self, *args: Any) -> list[Tensor | None]:  # (grad_out, x, weight, bias, operands, saved state)
        return reference_backward(*args, self.cfg, self.mask)


class LibraryBackward(_ChainGradient):
    """The library path's backward for one call signature (see ``TritonBackward`` for the plan
    contract): one Triton kernel writes the full-size conv-output gradient and the per-channel
    operand/bias sums (``_ChainGradient``), then ``aten.convolution_backward`` for x and weight (on
    x and weight cast to the compute dtype; ``strided_like`` casts the gradients back).

    ``channels_last``: the conv backward runs on channels-last tensors whatever the layout of x and
    the saved state: the epilogue kernel writes the conv-output gradient channels-last (transposing
    in its tile), x is cast and relaid in one copy and the input gradient relaid back
    (``kernels.relayout``, at memory speed: torch's strided copy runs at a fifth of it).
    WHY: cuDNN's NCHW backward converts x and the conv-output gradient to channels-last itself, once
    for the dgrad and again for the wgrad (Conv2d 64->64 k3 on 64x64x256x256, H100: 7.30 ms fp32 /
    3.34 ms bf16 against 4.22 / 1.30 for its channels-last kernels alone); ``plan_for``
    measures whether the variant wins per shape.  Its conv backward computes each gradient with cuDNN's
    TF32 off where eager's conv backward computes it in full fp32 (``conv_precision.backward_tf32``);
    in the tensors' own layouts the call is eager's, with eager's kernels and precision.
    ``settled``: False for a channels-last plan made during a CUDA-graph capture without that answer.
    """

    def __init__(self, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor], saved_y0: Tensor, saved_winner: Tensor, cfg: ConvEpilogueConfig,
                 mask: Sequence[bool], channels_last: bool = False) -> None:  # fmt: skip
        self.spec, self.mask = cfg.conv, tuple(mask)
        self.dtype = conv_compute_dtype(cfg, x)
        self.is_max = cfg.pool is not None and cfg.pool.kind == "max"
        #: the memory format x is relaid into for the conv backward (None: as it is)
        self.x_format = conv_io.channels_last_format(x.dim()) if channels_last else None
        if self.is_max or channels_last:
            y_shape = conv_io.conv_output_shape(x, weight, cfg.conv)
            fmt = self.x_format if channels_last else conv_io.output_memory_format(saved_y0)
            grad_y = torch.empty(y_shape, dtype=saved_y0.dtype, device="meta", memory_format=fmt)
        else:
            grad_y = torch.empty_strided(saved_y0.shape, saved_y0.stride(), dtype=saved_y0.dtype, device="meta")
        self._plan_chain_gradient(grad_out, *self._saved(saved_y0, saved_winner), bias, operands, cfg, cfg.pool, grad_y,
                                  mask)  # fmt: skip
        #: whether the input and weight gradients may use TF32, and whether the plan may be kept
        self.tf32, self.settled = (True, True), True
        if self.x_format is not None:
            #: x cast and relaid for the conv backward in one copy; the input gradient, which the
            #: channels-last conv backward gives in x's relaid layout, relaid back into x's own
            relaid = torch.empty(x.shape, dtype=self.dtype, device="meta", memory_format=self.x_format)
            self.x_relayout = conv_io.planned_relayout(x, relaid)
            self.grad_x_relayout = conv_io.planned_relayout(relaid, torch.empty_like(x, device="meta"))
            precision = conv_precision.backward_tf32(x, weight, cfg.conv, self.dtype)
            self.tf32, self.settled = (precision.grad_input, precision.grad_weight), precision.settled

    def __call__(self, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor], saved_y0: Tensor, saved_winner: Tensor) -> list[Tensor | None]:  # fmt: skip
        grad_y, grad_operands, grad_bias = self._chain_gradient(grad_out, *self._saved(saved_y0, saved_winner), bias,
                                                                operands)  # fmt: skip
        if self.x_format is not None:  # one copy casts and relays
            x = self.x_relayout(x)
        x, weight, _ = cast_inputs(x, weight, None, self.dtype)  # grads: ``strided_like`` casts back
        grad_x, grad_w, _ = conv_precision.conv_backward(grad_y, x, weight, self.spec, self.mask[0], self.mask[1],
                                                          False, self.tf32)  # fmt: skip
        if self.x_format is not None and grad_x is not None:  # back to x's layout and dtype (``strided_like``'s)
            grad_x = self.grad_x_relayout(grad_x)
        return [grad_x, grad_w, grad_bias.to(bias.dtype) if self.want_bias else None, *grad_operands]

    def _saved(self, saved_y0: Tensor, saved_winner: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The kernel's ``(y0, winner, winner_y)`` from the saved state: behind a max pool the winners
        and y0 at them, else the full-size y0."""
        return (None, saved_winner, saved_y0) if self.is_max else (saved_y0, None, None)


def channels_last_backward_unsupported(x: Tensor, saved_y0: Tensor) -> str | None:
    """Why the library backward has no channels-last variant worth measuring here, or None."""
    if (why := channels_last_problem(x.dim(), x.dtype)) is not None:
        return why
    channels_last = x.is_contiguous(memory_format=conv_io.channels_last_format(x.dim()))
    if conv_io.output_memory_format(saved_y0) != torch.contiguous_format or channels_last:
        return "the tensors are channels-last already"
    return None


def triton_backward_never_wins(cfg: ConvEpilogueConfig) -> str | None:
    """Why ``auto`` does not time the Triton backward here (None: it may win).

    NOTE: measured on the H100 (``python -m fusion_backend bench --suite seeds`` and six ``convnets``
    files, with ``logging.getLogger("fusion_backend.impl_choice")`` at INFO): the Triton backward
    beat cuDNN's only behind a transposed conv followed by a max pool (ConvTranspose3d k3 s2 +
    max_pool3d: 0.56 vs 1.66 ms fp32, 0.46 vs 0.79 ms bf16).  Everywhere else it lost: Conv3d 32->64
    + max_pool3d 19.4 vs 1.7 ms, Conv2d 64->64 at 256x256 12.4 vs 3.3 ms, Conv1d 80->256 0.66 vs
    0.21 ms, ConvTranspose2d 256->128 without a pool 0.96 vs 0.14 ms, a Conv2d at batch 1 0.96 vs
    0.14 ms (one tiny Conv2d won by 11%, in a region Inductor kept anyway), while its kernels cost
    about 10 s of a first call to compile and tune.  ``FUSION_CONV_IMPL=triton`` still runs it
    wherever it serves the case."""
    if cfg.conv.transposed and cfg.pool is not None and cfg.pool.kind == "max":
        return None
    return ("the Triton backward wins only behind a transposed conv with a max pool (measured), so auto "
            "does not time it here")


def triton_backward_unsupported(
    x: Tensor, weight: Tensor, saved_y0: Tensor, saved_winner: Tensor, cfg: ConvEpilogueConfig
) -> str | None:
    """None when ``TritonBackward`` serves the case, else why not."""
    if cfg.pool is not None and cfg.pool.kind != "max":
        return "an avg pool's conv-output gradient needs the full-size chain derivative (library backward)"
    if x.device.type != "cuda" and not environment.cpu_kernels_triton():
        return "the Triton backward runs on CUDA (or the interpreter)"
    from ...kernels import conv_fused_bwd

    spec = cfg.conv
    grad = saved_y0 if cfg.pool is None else _pooled_grad(saved_y0, saved_winner, cfg.pool)
    return conv_fused_bwd.unsupported_reason(
        grad, x, weight, spec.stride, spec.padding, spec.dilation, spec.transposed, spec.output_padding,
        spec.groups,
    )  # fmt: skip


def _pooled_grad(g_win: Tensor, winner: Tensor, pool: PoolSpec) -> Any:  # conv_fused_bwd.PooledGrad
    from ...kernels import conv_fused_bwd

    return conv_fused_bwd.PooledGrad(
        g_win, winner, tuple(pool.kernel_size), pool.stride, tuple(pool.padding), ceil_mode=pool.ceil_mode
    )


class TritonBackward(_ChainGradient):
    """The conv backward never materializes the full-size gradient behind a max pool.

    The chain is differentiated at the winners only (the epilogue backward kernel without a pool,
    on the pooled-size saved state): ``g_win = grad_out * chain'(y0_winner)``, with the operand and
    bias sums in the same pass; then ``_triton_kernels`` (phase-aligned or general) compute grad x and
    weight with loaders that expand ``(g_win, winner)`` on the fly.  Without a pool the dense
    conv-output gradient is written as in the library path and the same Triton conv backward
    consumes it.  The conv-backward kernels' fp32 dots use TF32 only for the gradients eager's conv
    backward computes in TF32 (``conv_precision.backward_tf32``); ``settled`` as ``LibraryBackward``'s.

    A plan for one call signature (see ``FusedForward``): built from a call's arguments, called
    as ``(grad_out, x, weight, bias, operands, saved_y0, saved_winner) -> [gx, gw, gb, *g_operands]``
    (None where the mask is off) with tensors laid out like them.
    """

    def __init__(self, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor], saved_y0: Tensor, saved_winner: Tensor, cfg: ConvEpilogueConfig,
                 mask: Sequence[bool]) -> None:  # fmt: skip
        self.pool = cfg.pool  # not None: a max pool (``triton_backward_unsupported``)
        # the gradient at the winners (or the dense conv-output gradient) is laid out like saved_y0
        self._plan_chain_gradient(grad_out, saved_y0, None, None, bias, operands, cfg, None, saved_y0, mask)
        self.bias_dtype = None if bias is None else bias.dtype
        grad = _pooled_grad(saved_y0, saved_winner, self.pool) if self.pool is not None else saved_y0
        spec = cfg.conv
        conv_args = (grad, x, weight, spec.stride, spec.padding, spec.dilation, spec.transposed, spec.output_padding,
                     spec.groups)  # fmt: skip
        from ...kernels import conv_phase_aligned_bwd

        dtype = conv_compute_dtype(cfg, x)
        precision = conv_precision.backward_tf32(x, weight, spec, dtype)
        self.settled = precision.settled
        tf32 = (precision.grad_input, precision.grad_weight)
        kernels_module = _triton_kernels(conv_args, cfg, dtype)
        #: None, or the compute dtype x and weight are cast to before the general conv-backward
        #: kernels (``conv_fused_bwd`` computes in x's dtype; ``conv_phase_aligned_bwd`` casts as it loads)
        self.cast_to = None
        if kernels_module is conv_phase_aligned_bwd:
            self.conv_backward = kernels_module.backward_plan(*conv_args, [mask[0], mask[1]], dtype, allow_tf32=tf32)
        else:
            if (x.dtype, weight.dtype) != (dtype, dtype):
                self.cast_to = dtype
                conv_args = (grad, x.to(dtype), weight.to(dtype), *conv_args[3:])
            self.conv_backward = kernels_module.backward_plan(*conv_args, [mask[0], mask[1]], allow_tf32=tf32)

    def __call__(self, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor], saved_y0: Tensor, saved_winner: Tensor) -> list[Tensor | None]:  # fmt: skip
        g, grad_operands, grad_bias = self._chain_gradient(grad_out, saved_y0, None, None, bias, operands)
        grad = _pooled_grad(g, saved_winner, self.pool) if self.pool is not None else g
        if self.cast_to is not None:  # the results' dtype is then cast back by ``strided_like``
            x, weight = x.to(self.cast_to), weight.to(self.cast_to)
        grad_x, grad_w = self.conv_backward(grad, x, weight)
        return [grad_x, grad_w, None if grad_bias is None else grad_bias.to(self.bias_dtype), *grad_operands]


def _triton_kernels(conv_args: tuple, cfg: ConvEpilogueConfig, dtype: torch.dtype) -> ModuleType:
    """The conv-backward kernels of the Triton backward: ``kernels.conv_phase_aligned_bwd`` (dense GEMMs
    over (shift, window offset), for a transposed conv under a max pool whose stride is the conv's)
    where it serves the case, else the general ``kernels.conv_fused_bwd``.  Both take the same
    arguments (``conv_args``) and give the same results (``conv_phase_aligned_bwd`` also takes the compute
    ``dtype`` and casts as it loads); the answer is cached per shapes."""
    from ...kernels import conv_fused_bwd, conv_phase_aligned_bwd

    grad, x, weight = conv_args[:3]
    if not isinstance(grad, conv_fused_bwd.PooledGrad):
        return conv_fused_bwd
    key = ("triton_kernels", tensor_key(grad.g_win), tensor_key(grad.winner), tensor_key(x), tensor_key(weight), cfg)
    why = conv_io.DECISIONS.get(key, lambda: conv_phase_aligned_bwd.unsupported_reason(*conv_args, compute_dtype=dtype))
    return conv_fused_bwd if why is not None else conv_phase_aligned_bwd
