"""One declaration per fused op: every face of the op built from it.

A family declares its op once (``FusedOpDeclaration``: the config type, the names of the saved state,
the shape function, the plain-torch reference and the Triton path of both directions, the input
checks, the description) and ``declare`` builds:

- the forward custom op ``fusion::NAME_fwd(x, weight, bias, operands, config, save_for_backward) ->
  (out, *state)`` with its fake (the shape function: exact shapes, dtypes and strides); ``state`` is
  what the backward reads, non-differentiable, placeholders where nothing needs saving;
- the backward custom op ``fusion::NAME_bwd(grad_out, x, weight, bias, operands, *state, config,
  output_mask) -> [grad_x, grad_weight, grad_bias, *grad_operands]`` with its fake (each requested
  gradient in its input's dtype and ``empty_like`` strides, an empty placeholder elsewhere).  An op
  whose backward never reads x (``keeps_x=False``: the global mean's) takes ``x_size, x_stride,
  x_dtype`` in x's place, so that x is not kept alive between the directions;
- the forward's autograd formula (it calls the backward custom op, so that AOTAutograd records it);
- both autograd-free ops (``ops/autograd_free.py``);
- the direct ``autograd.Function`` and the direct implementation of the public entry point
  (``ops/direct_impls.py``), for graphs run without AOTAutograd;
- ``kernel_path``, the report's answer to which implementation a config gets.

Every call follows one policy (``ops/failure.py``): the Triton path where it serves the call, else the
reference; a Triton failure raises under the config's ``strict``, else warns once and runs the
reference, which later calls of the same signature (shapes, strides, dtypes, devices) then take at once.
A call that its own tensors keep off the Triton path (``call_problem``, which the report's
``kernel_path`` cannot see) warns once, and raises under ``strict`` on CUDA.  A call with a batch of 0
computes nothing: the forward returns the shape function's empty result (its state zeros), the backward
zero gradients, as eager's ops do on an empty batch.  The config travels as JSON (``ops/config.py``'s
``JsonConfig``).

What every family shares (a family's docstrings say only what differs):

- a family is a package: ``__init__`` (semantics, declaration, entry point), ``config``,
  ``triton_path``, ``reference``;
- implementations: Triton (CUDA fp32/fp16/bf16; CPU under ``FUSION_CPU_KERNELS=triton`` with
  ``TRITON_INTERPRET=1``), where the conv families run the library conv without bias
  (``library_conv.conv_forward``: channels-last for 2-d and 3-d convs) and then their kernels, whose
  backward writes the conv output's gradient (chains and norm differentiated in registers, operand
  gradients as fixed-order partial sums) for the library conv backward (``library_conv``) to give
  the gradients of x, the weight and the bias (``triton_path``'s docstring says which kernels, and
  what each direction writes); the plain-torch
  reference (``reference.py``: CPU, float64 and anything the kernels do not cover; eager's own ops
  forward, torch's derivative formulas on the saved state backward, the chains' through
  ``chain_reference``'s tape), which writes the same outputs and state as the kernels and is the
  tests' definition of the op;
- the public entry point ``NAME(x, weight, bias, operands, config)``: ``x`` ``(N, C_in, *spatial)``,
  1-3 spatial dims, floating (the conv's dtype), any layout; ``weight`` the conv weight, ``(C_out,
  C_in/groups, *k)`` or, transposed, ``(C_in, C_out/groups, *k)``; ``bias`` ``(C_out,)`` or None;
  ``operands`` the tensors the config's ``TensorRef`` operands (and a norm's weight and bias indices)
  refer to; ``config`` the family config's ``to_json()``.  The result's dtype is ``out_dtype``
  (default the conv's); it is differentiable in x, weight, bias and every operand, and state for the
  backward is kept only when autograd will need it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..kernels.host import kernels_unavailable
from .autograd_free import register_autograd_free
from .conv_io import backward_outputs, empty_placeholder, fake_backward_outputs
from .direct_impls import profiled, records_backward, register_direct
from .failure import check_backward_call, op_kernel_failed, triton_or_reference, triton_serves, warn_once


class XMeta(NamedTuple):
    """What the backward of an op that does not keep x knows of it: its ``shape``, the ``stride`` of
    its gradient, its ``dtype``, and the ``device`` (the output gradient's)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _none(*_args: Any) -> None:
    return None


def _zeros_like(t: Any, like: Tensor) -> Tensor:
    """Zeros with ``t``'s shape, dtype and strides (``t`` a tensor, or an ``XMeta`` on ``like``'s device)."""
    if isinstance(t, XMeta):
        return like.new_empty_strided(t.shape, t.stride, dtype=t.dtype).zero_()
    return torch.zeros_like(t)


def _signature(direction: str, config: str, tensors: Sequence[Any]) -> tuple[Any, ...]:
    """What makes two calls of an op the same case for its kernels: the direction, the config, and each
    tensor's (or ``XMeta``'s) shape, strides, dtype and device."""
    return (direction, config, *(None if t is None else
                                 (tuple(t.shape), tuple(t.stride if isinstance(t, XMeta) else t.stride()), t.dtype,
                                  t.device) for t in tensors))  # fmt: skip


@dataclass(frozen=True)
class FusedOpDeclaration:
    """Everything about a fused op that is not wiring.  Callables take the parsed config ``cfg``.

    * ``name``: the op's name; the custom ops are ``fusion::{name}_fwd`` / ``fusion::{name}_bwd``.
    * ``config``: the config type (a ``JsonConfig`` dataclass with a ``strict`` field).
    * ``state``: the names of the saved-state outputs, in order (the backward op's argument names).
    * ``outputs(x, weight, bias, operands, cfg, save)``: empty ``(out, *state)`` with the exact shapes,
      dtypes and strides of the real op (real or fake tensors); the fake is this.
    * ``reference_forward`` / ``triton_forward`` ``(x, weight, bias, operands, cfg, save) -> (out, *state)``;
      ``reference_backward`` / ``triton_backward`` ``(grad_out, x, weight, bias, operands, *state, cfg,
      mask) -> [grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is off).  The
      reference runs any dtype, float64 included, on any device.
    * ``check_inputs(x, weight, operands, cfg)``: one-line ``UnsupportedInputError`` for inputs that do
      not fit the config.
    * ``describe(cfg)``: the config in a few words, for messages.
    * ``kernel_problem(cfg)``: why the Triton path cannot serve any call of this config (None: it
      may); ``call_problem(cfg, x, weight)`` the same for one call's tensors.  Unserved dtypes and
      devices (``kernels.host.kernels_unavailable``) are checked for every op.
    * ``compute_dtype(cfg, x)``: the dtype the kernels run in (default x's).
    * ``casts_weight``: the op casts its weight and bias to ``compute_dtype`` before its conv (what
      autocast did), so a graph may hand them over cast already (``match/batch_glue.py``).
    * ``keeps_x``: whether the backward reads x; False saves ``XMeta`` instead, with
      ``grad_input_strides(x)`` the strides of x's gradient.
    * ``settled_forward(config, save, x, weight, bias, operands)`` / ``settled_backward(config,
      grad_out, x, weight, bias, operands, *state, mask)``: a call plan settled for this signature
      (None: none yet) that runs straight, the checks and the choice made when it was settled (the
      host time of small calls; ``conv_epilogue``'s plans).
    """

    name: str
    config: type
    state: tuple[str, ...]
    outputs: Callable[..., tuple[Tensor, ...]]
    reference_forward: Callable[..., tuple[Tensor, ...]]
    triton_forward: Callable[..., tuple[Tensor, ...]]
    reference_backward: Callable[..., list[Tensor | None]]
    triton_backward: Callable[..., list[Tensor | None]]
    check_inputs: Callable[..., None]
    describe: Callable[[Any], str]
    kernel_problem: Callable[[Any], str | None] = _none
    call_problem: Callable[..., str | None] = _none
    compute_dtype: Callable[[Any, Tensor], torch.dtype] = lambda cfg, x: x.dtype
    casts_weight: bool = False
    keeps_x: bool = True
    grad_input_strides: Callable[[Tensor], tuple[int, ...]] | None = None
    settled_forward: Callable[..., Any] | None = None
    settled_backward: Callable[..., Any] | None = None


def _schemas(d: FusedOpDeclaration) -> tuple[str, str]:
    state = ", ".join(f"Tensor {s}" for s in d.state)
    outputs = ", ".join(["Tensor"] * (1 + len(d.state)))
    fwd = f"(Tensor x, Tensor weight, Tensor? bias, Tensor[] operands, str config, bool save_for_backward) -> ({outputs})"
    x = "Tensor x, " if d.keeps_x else ""
    x_meta = "" if d.keeps_x else "SymInt[] x_size, SymInt[] x_stride, ScalarType x_dtype, "
    bwd = (f"(Tensor grad_out, {x}Tensor weight, Tensor? bias, Tensor[] operands, {state}, {x_meta}str config, "
           "bool[] output_mask) -> Tensor[]")  # fmt: skip
    return fwd, bwd


class FusedOp:
    """A declared fused op (``declare``): its custom ops ``fwd`` / ``bwd``, their implementations
    ``forward_impl`` / ``backward_impl`` (the custom ops' functions: what the autograd-free ops and the
    direct implementation call), ``kernel_path``, ``__call__`` (the public entry's body) and ``entry``
    (registers the public entry point's direct implementation)."""

    def __init__(self, d: FusedOpDeclaration) -> None:
        self.d = d
        self.name = d.name
        fwd_schema, bwd_schema = _schemas(d)
        self.fwd = torch.library.custom_op(f"fusion::{d.name}_fwd", self.forward_impl, mutates_args=(),
                                           schema=fwd_schema)  # fmt: skip
        self.fwd.register_fake(self._forward_fake)
        self.bwd = torch.library.custom_op(f"fusion::{d.name}_bwd", self.backward_impl, mutates_args=(),
                                           schema=bwd_schema)  # fmt: skip
        self.bwd.register_fake(self._backward_fake)
        self.fwd.register_autograd(self._autograd_backward, setup_context=self._setup_context)
        register_autograd_free(self.fwd, self.forward_impl, self._forward_fake)
        register_autograd_free(self.bwd, self.backward_impl, self._backward_fake)
        self._cuda_paths: dict[tuple[str, torch.dtype], tuple[str, str | None]] = {}
        #: Signatures (``_signature``) whose Triton path failed: later calls take the reference at once.
        self._reference_only: set[tuple[Any, ...]] = set()

    # -- which path a call takes, and the failure policy ---------------------------------------

    def kernel_path(self, config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
        """``("triton", None)`` when the Triton kernels serve this config, dtype and device type, else
        ``("reference", why)``; a call's own tensors may still send it to the reference (``call_problem``).
        Cached on CUDA (no environment switch to read; asked on every call)."""
        if device_type == "cuda" and (config, dtype) in self._cuda_paths:
            return self._cuda_paths[(config, dtype)]
        cfg = self.d.config.from_json(config)
        why = kernels_unavailable(dtype, device_type) or self.d.kernel_problem(cfg)
        answer = ("reference", why) if why is not None else ("triton", None)
        if device_type == "cuda":
            self._cuda_paths[(config, dtype)] = answer
        return answer

    def _serves(self, config: str, cfg: Any, x: Any, weight: Tensor, device: torch.device) -> bool:
        dtype = x.dtype if isinstance(x, XMeta) else self.d.compute_dtype(cfg, x)
        why = self.kernel_path(config, dtype, device.type)[1]
        if why is None and (why := self.d.call_problem(cfg, x, weight)) is not None and not (
                cfg.strict and device.type == "cuda"):  # the report cannot tell: say it once
            warn_once((self.name, "call", why), f"fusion::{self.name} runs the plain-torch reference: {why}")
        return triton_serves(self.name, why, cfg.strict, device.type)

    def _failed(self, direction: str, config: str, cfg: Any, tensors: Sequence[Any], error: Exception) -> None:
        """The Triton path of a call failed: raise under ``strict``; else warn (once per config) and remember
        the call's signature, whose later calls take the reference at once (``_failed_before``).  ``tensors``:
        the call's tensors, forward ``(x, weight, bias, *operands)``, backward ``(grad_out, x, ...)``."""
        x, weight = (tensors[0], tensors[1]) if direction == "forward" else (tensors[1], tensors[2])
        op_kernel_failed(self.name, direction, self.d.describe(cfg), config, x, weight, error, cfg.strict)
        self._reference_only.add(_signature(direction, config, tensors))

    def _failed_before(self, direction: str, config: str, tensors: Sequence[Any]) -> bool:
        """Whether the Triton path already failed on a call of this signature (callers ask only once one
        has failed: the common call builds no signature)."""
        return _signature(direction, config, tensors) in self._reference_only

    # -- the custom ops' implementations and fakes ----------------------------------------------

    def forward_impl(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: list[Tensor], config: str,
                     save_for_backward: bool) -> tuple[Tensor, ...]:  # fmt: skip
        """``(out, *state)``: a settled plan's, else the Triton path's where it serves the call, else
        (or when a kernel fails, per the failure policy) the reference's."""
        d, op = self.d, "forward"
        if x.shape[0] == 0:  # nothing to compute: the shape function's empty result, zero state
            cfg = d.config.from_json(config)
            d.check_inputs(x, weight, operands, cfg)
            out, *state = d.outputs(x, weight, bias, operands, cfg, save_for_backward)
            return (out, *(t.zero_() for t in state))
        if self._reference_only and self._failed_before(op, config, (x, weight, bias, *operands)):
            cfg = d.config.from_json(config)
            d.check_inputs(x, weight, operands, cfg)
            return d.reference_forward(x, weight, bias, operands, cfg, save_for_backward)
        plan = None if d.settled_forward is None else d.settled_forward(config, save_for_backward, x, weight, bias,
                                                                          operands)  # fmt: skip
        if plan is not None:
            try:
                return plan(x, weight, bias, operands)
            except Exception as e:  # any kernel failure takes the documented policy
                cfg = d.config.from_json(config)
                self._failed(op, config, cfg, (x, weight, bias, *operands), e)
                return d.reference_forward(x, weight, bias, operands, cfg, save_for_backward)
        cfg = d.config.from_json(config)
        d.check_inputs(x, weight, operands, cfg)
        args = (x, weight, bias, operands, cfg, save_for_backward)
        return triton_or_reference(self._serves(config, cfg, x, weight, x.device), lambda: d.triton_forward(*args),
                                   lambda: d.reference_forward(*args),
                                   lambda e: self._failed(op, config, cfg, (x, weight, bias, *operands), e))  # fmt: skip

    def _forward_fake(self, x, weight, bias, operands, config, save_for_backward):
        return self.d.outputs(x, weight, bias, operands, self.d.config.from_json(config), save_for_backward)

    def _split_backward_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``(grad_out, x, weight, bias, operands, state, config, mask)`` from the backward op's
        arguments; ``x`` an ``XMeta`` for an op that does not keep it."""
        k = len(self.d.state)
        if self.d.keeps_x:
            grad_out, x, weight, bias, operands, *rest = args
        else:
            grad_out, weight, bias, operands, *rest = args
            size, stride, dtype = rest[k:k + 3]
            x, rest = XMeta(tuple(size), tuple(stride), dtype, grad_out.device), rest[:k] + rest[k + 3:]
        return grad_out, x, weight, bias, operands, tuple(rest[:k]), rest[k], rest[k + 1]

    def backward_impl(self, *args: Any) -> list[Tensor]:
        """``[grad_x, grad_weight, grad_bias, *grad_operands]``; entries whose mask is False are empty
        placeholders; the others have their input's shape, dtype and ``empty_like`` strides (x's
        gradient, for an op that does not keep x, the strides its backward was given)."""
        d, op = self.d, "backward"
        if d.keeps_x:  # unpacked here, not by ``_split_backward_args``: a settled call makes no other call
            grad_out, x, weight, bias, operands, *state, config, mask = args
        else:
            grad_out, x, weight, bias, operands, state, config, mask = self._split_backward_args(args)
        if grad_out.shape[0] == 0:  # an empty batch: every gradient is zero
            check_backward_call(self.name, mask, len(operands), state)
            grads = [_zeros_like(t, grad_out) if wanted and t is not None else None
                     for t, wanted in zip([x, weight, bias, *operands], mask, strict=True)]  # fmt: skip
            return self._backward_outputs(grads, grad_out, x, weight, bias, operands, mask)
        if self._reference_only and self._failed_before(op, config, (grad_out, x, weight, bias, *operands, *state)):
            check_backward_call(self.name, mask, len(operands), state)
            grads = d.reference_backward(grad_out, x, weight, bias, operands, *state, d.config.from_json(config), mask)
            return self._backward_outputs(grads, grad_out, x, weight, bias, operands, mask)
        plan = None if d.settled_backward is None else d.settled_backward(config, grad_out, x, weight, bias, operands,
                                                                            *state, mask)  # fmt: skip
        cfg, grads = None, None
        if plan is not None:
            try:
                grads = plan(grad_out, x, weight, bias, operands, *state)
            except Exception as e:  # any kernel failure takes the documented policy
                cfg = d.config.from_json(config)
                self._failed(op, config, cfg, (grad_out, x, weight, bias, *operands, *state), e)
        if grads is None:
            cfg = cfg or d.config.from_json(config)
            if plan is None:
                check_backward_call(self.name, mask, len(operands), state)
            args = (grad_out, x, weight, bias, operands, *state, cfg, mask)
            serves = plan is None and self._serves(config, cfg, x, weight, grad_out.device)
            grads = triton_or_reference(
                serves, lambda: d.triton_backward(*args), lambda: d.reference_backward(*args),
                lambda e: self._failed(op, config, cfg, (grad_out, x, weight, bias, *operands, *state), e))
        return self._backward_outputs(grads, grad_out, x, weight, bias, operands, mask)

    def _backward_outputs(self, grads: Sequence[Tensor | None], grad_out: Tensor, x: Any, weight: Tensor,
                          bias: Tensor | None, operands: Sequence[Tensor], mask: Sequence[bool]) -> list[Tensor]:  # fmt: skip
        if self.d.keeps_x:
            return backward_outputs(grads, [x, weight, bias, *operands], mask, x)
        grad_x = grads[0] if mask[0] and grads[0] is not None else empty_placeholder(grad_out)
        return [grad_x, *backward_outputs(grads[1:], [weight, bias, *operands], mask[1:], grad_out)]

    def _backward_fake(self, *args: Any) -> list[Tensor]:
        grad_out, x, weight, bias, operands, _, _, mask = self._split_backward_args(args)
        if self.d.keeps_x:
            return fake_backward_outputs([x, weight, bias, *operands], mask, x)
        grad_x = grad_out.new_empty_strided(x.shape, x.stride, dtype=x.dtype) if mask[0] else empty_placeholder(grad_out)
        return [grad_x, *fake_backward_outputs([weight, bias, *operands], mask[1:], grad_out)]

    # -- autograd: the formula of the forward custom op, and the direct autograd.Function --------

    def _kept_x(self, x: Tensor) -> tuple[Any, ...]:
        """What the backward op gets for x: x itself, or its size, gradient strides and dtype."""
        if self.d.keeps_x:
            return ()
        return (list(x.shape), list(self.d.grad_input_strides(x)), x.dtype)

    def _setup_context(self, ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        x, weight, bias, operands, config, save_for_backward = inputs
        state = output[1:]
        ctx.mark_non_differentiable(*state)
        ctx.config, ctx.num_operands, ctx.saved = config, len(operands), save_for_backward
        ctx.x_meta = self._kept_x(x)
        ctx.save_for_backward(*((x,) if self.d.keeps_x else ()), weight, bias, *operands, *state)

    def _autograd_backward(self, ctx: Any, grad_out: Tensor, *_unused: Tensor) -> tuple[Any, ...]:
        if not ctx.saved:
            raise RuntimeError(f"fusion::{self.name}_fwd ran with save_for_backward=False but a gradient was requested; "
                               f"call {self.name}(), which saves state whenever autograd needs it")  # fmt: skip
        saved = ctx.saved_tensors
        x, saved = (saved[:1], saved[1:]) if self.d.keeps_x else ((), saved)
        weight, bias, *rest = saved
        operands, state = rest[: ctx.num_operands], rest[ctx.num_operands :]
        needs = ctx.needs_input_grad  # (x, weight, bias, [operands...], config, save_for_backward)
        mask = [bool(needs[0]), bool(needs[1]), bias is not None and bool(needs[2])] + [bool(m) for m in needs[3]]
        grads = self.bwd(grad_out, *x, weight, bias, list(operands), *state, *ctx.x_meta, ctx.config, mask)
        picked = [g if wanted else None for g, wanted in zip(grads, mask, strict=True)]
        return picked[0], picked[1], picked[2], picked[3:], None, None

    def direct_function(self, outputs: int = 1) -> type[torch.autograd.Function]:
        """An ``autograd.Function`` computing the forward through ``forward_impl`` and its gradient
        through ``backward_impl`` (no dispatcher layers), called as ``apply(config, x, weight, bias,
        *operands)``: ``operands`` spread into separate arguments because autograd tracks only tensors
        passed one by one.  It returns ``out``, or with ``outputs=2`` ``(out, state[-1])`` (the last
        state tensor, non-differentiable: what a caller outside autograd needs, such as batch statistics)."""
        op = self

        def forward(ctx: Any, config: str, x: Tensor, weight: Tensor, bias: Tensor | None, *operands: Tensor) -> Any:
            out, *state = op.forward_impl(x, weight, bias, list(operands), config, True)
            ctx.save_for_backward(*((x,) if op.d.keeps_x else ()), weight, bias, *operands)
            ctx.state = tuple(state)  # intermediates: attributes, as autograd advises
            ctx.config, ctx.x_meta = config, (() if op.d.keeps_x else op._kept_x(x))
            if outputs == 1:
                return out
            ctx.mark_non_differentiable(state[-1])
            return out, state[-1]

        @torch.autograd.function.once_differentiable
        @profiled(f"fusion::{self.name}_bwd")
        def backward(ctx: Any, grad_out: Tensor, *_unused: Tensor) -> tuple[Any, ...]:
            saved = ctx.saved_tensors
            x, saved = (saved[:1], saved[1:]) if op.d.keeps_x else ((), saved)
            weight, bias, *operands = saved
            needs = ctx.needs_input_grad  # (config, x, weight, bias, *operands)
            mask = [bool(needs[1]), bool(needs[2]), bias is not None and bool(needs[3])] + [bool(m) for m in needs[4:]]
            grads = op.backward_impl(grad_out, *x, weight, bias, operands, *ctx.state, *ctx.x_meta, ctx.config, mask)
            return (None, *(g if wanted else None for g, wanted in zip(grads, mask, strict=True)))

        # built with type() so that autograd's node (named at class creation) reads Direct_{name}Backward
        return type(f"Direct_{self.name}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward), "__module__": __name__})

    # -- the public entry point -----------------------------------------------------------------

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 config: str) -> Tensor:  # fmt: skip
        """The op's result through the forward custom op, saving state only when autograd will need it
        (under AOTAutograd the grad mode seen at trace time is the runtime one: inference graphs never
        save anything)."""
        save = records_backward(x, weight, bias, operands)
        return getattr(torch.ops.fusion, f"{self.name}_fwd")(x, weight, bias, list(operands), config, save)[0]

    def entry(self, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """Decorator of the public entry point ``fn(x, weight, bias, operands, config)`` whose body is
        ``self(...)``: registers its direct implementation (``forward_impl`` without saving, or the
        direct ``autograd.Function`` where autograd needs the backward) and returns ``fn``."""
        direct_function = self.direct_function()

        @profiled(f"fusion::{self.name}_fwd")
        def direct(x, weight, bias, operands, config):
            if records_backward(x, weight, bias, operands):
                return direct_function.apply(config, x, weight, bias, *operands)
            return self.forward_impl(x, weight, bias, list(operands), config, False)[0]

        functools.update_wrapper(direct, fn)
        register_direct(fn, direct)
        _ENTRIES[fn] = self
        return fn


#: public entry point -> its declared op (``FusedOp.entry``)
_ENTRIES: dict[Callable[..., Tensor], FusedOp] = {}


def declared_op(target: Any) -> FusedOp | None:
    """The declared fused op whose public entry point ``target`` is (a graph node's target), or None."""
    try:
        return _ENTRIES.get(target)
    except TypeError:  # an unhashable target
        return None


def family_declaration(name: str, config: type, state: tuple[str, ...], semantics: Any, reference: Any, triton: Any,
                       **options: Any) -> FusedOpDeclaration:  # fmt: skip
    """The declaration of a family laid out as every family is: ``reference`` and ``triton`` are modules with
    ``forward`` and ``backward``, ``semantics`` one with ``check_inputs``, ``describe`` and, unless
    ``outputs`` is among ``options``, ``conv_outputs(x, weight, cfg, save)`` whose ``[1:]`` is the shape
    function.  ``options``: the declaration's other fields."""
    if "outputs" not in options:
        conv_outputs = semantics.conv_outputs
        options["outputs"] = lambda x, weight, bias, operands, cfg, save: conv_outputs(x, weight, cfg, save)[1:]
    return FusedOpDeclaration(
        name=name, config=config, state=state, reference_forward=reference.forward, triton_forward=triton.forward,
        reference_backward=reference.backward, triton_backward=triton.backward, check_inputs=semantics.check_inputs,
        describe=semantics.describe, **options)  # fmt: skip


def family_names(name: str) -> list[str]:
    """The public names every family module exports: the entry point, its custom ops and ``kernel_path``."""
    return [name, f"{name}_bwd", f"{name}_fwd", "kernel_path"]


def declare(declaration: FusedOpDeclaration) -> FusedOp:
    """Define the custom ops of ``declaration`` with every face described in the module docstring."""
    return FusedOp(declaration)
