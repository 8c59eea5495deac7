"""The library conv (``aten.convolution``: cuDNN) and its backward for the families that run it and then
their own kernels (``conv_channel_reduce``, ``conv_group_norm``, ``conv_batch_norm``,
``conv_layer_norm``): on channels-last tensors, whatever x's layout, where cuDNN has channels-last
kernels (2-d and 3-d convs in fp16 / bf16 / fp32: :func:`channels_last_conv`).

Forward (:func:`conv_forward`, for the families whose kernels read a channels-last conv output at
full speed: ``conv_channel_reduce`` reads all channels of a position, ``conv_batch_norm`` tiles 64
channels, ``conv_layer_norm`` packs consecutive channels' rows into a tile; ``conv_group_norm``'s
groups of a few channels would read it in short runs):

* ``conv_forward(x, weight, spec, channels_last)``: the conv output without bias; with
  ``channels_last`` and :func:`channels_last_conv`, x and the weight are relaid into channels-last
  (``kernels.relayout``, one pass each; on fake, meta and CPU tensors torch's ``contiguous``) and cuDNN
  writes a channels-last output.  Real and fake calls give the same layout, so an op's fake may
  call it as its implementations do.
* ``conv_alone(x, weight, spec)`` / ``conv_alone_plan``: the conv without bias of a call that saves
  nothing (:class:`ConvAlone`): aten's, or the conv family's plain forward where it measured faster;
  ``conv_forward(..., alone=True)`` runs its channels-last conv so; the Triton paths take it (``conv_epilogue``'s
  library plans, the forwards of ``conv_group_norm``, ``conv_channel_reduce``, ``conv_layer_norm``), never
  a reference, which stays eager's ops (a failed kernel's fallback must not run the family again).
* ``nominal_format(x, weight, spec)``: the memory format aten's conv gives for x and the weight as
  they are: what the op's result takes, so that the caller sees eager's layout whatever the conv
  ran in.

Backward (:class:`ConvBackwardPlan`, one per call signature, from :func:`conv_backward_plan`):

* ``plan.new_grad_y(device)``: an empty conv-output gradient of the conv output's shape and dtype,
  channels-last for 2-d and 3-d convs in fp16 / bf16 / fp32, else in the saved conv output's memory
  format (``conv_io.output_memory_format``).  The family's kernel writes it through
  its strides, whatever they are.
* ``plan(grad_y, x, weight, need_x, need_w, need_b) -> (grad_x, grad_w, grad_b)``: None where not
  needed; ``grad_x`` in x's own layout (``torch.empty_like(x)`` strides) and the conv's dtype, the
  others as ``aten.convolution_backward`` gives them (the ops' ``backward_outputs`` gives every
  gradient its input's dtype and strides).  With a channels-last plan, x and the weight are relaid
  into channels-last for the call and the input gradient relaid back, each in one pass of
  ``kernels.relayout`` (a tensor whose spatial dims do not flatten, e.g. a slice, takes torch's copy).

WHY channels-last: cuDNN's NCHW kernels on Hopper are its slow ones, and its NCHW backward converts x
and the gradient to channels-last itself, once for the data gradient and again for the weight
gradient.  Relaying x in (and in the backward the input gradient back) costs a pass at memory speed
each, less than what the channels-last kernels save on the shapes measured (NOTE at
:func:`channels_last_conv`).  ``conv_epilogue`` measures the same choice per shape (its
``LibraryBackward``), as its NCHW path reads a saved state in the caller's layout; here the family's
kernel reads the conv output and writes its gradient in whichever layout it is given at no extra
cost, so the rule needs no timing.

Precision: cuDNN picks a TF32 or a full-fp32 kernel per layout, and on channels-last copies it may pick
TF32 kernels for convs that eager's NCHW call runs in full fp32 (``ops/conv_precision.py`` says what
that cost).  So every channels-last call of both directions runs with cuDNN's TF32 off where
eager's conv (backward: each gradient) of x and the weight as the caller gave them runs in full fp32
(``ops/conv_precision.py``); a call in the caller's own layouts is eager's call and needs nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from .. import environment
from ..ir.specs import ConvSpec
from ..kernels.host import BoundedCache, kernels_unavailable, tensor_key
from . import conv_precision
from .conv_io import (
    channels_last_format,
    conv_output_shape,
    in_format,
    output_memory_format,
    planned_relayout,
    run_conv,
)

#: Conv dtypes whose channels-last backward cuDNN runs with its channels-last kernels (float64 runs
#: NCHW whatever the layout).
CHANNELS_LAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# NOTE: measured on the H100 (torch 2.11, cuDNN 9.19; ``python tools/conv_layout_timing.py``: the aten
# ops alone, ms, NCHW / channels-last, fp32 with TF32 | bf16).  Forward, x relaid by torch's copy and
# then the channels-last conv (``kernels.relayout`` moves x at memory speed, 2-3x faster than that copy
# in bf16): Conv2d 64->64 k3 p1 on 32x64x128x128 0.379 / 0.325 | 0.236 / 0.246; ConvTranspose2d 64->32
# k4 s2 p1 on 16x64x64x64 0.115 / 0.094 | 0.065 / 0.054; Conv2d 64->64 k3 p1 on 32x64x64x64 0.121 /
# 0.096 | 0.072 / 0.072; Conv2d 64->128 k3 on 64x64x128x128 1.072 / 0.838 | 0.646 / 0.543.  Backward
# (``aten.convolution_backward``): 0.988 / 0.592 | 0.475 / 0.219; 0.331 / 0.298 | 0.134 / 0.098;
# 0.284 / 0.179 | 0.141 / 0.076; 2.962 / 1.853 | 1.344 / 0.709; depthwise Conv2d 144 k3 p1 on
# 32x144x56x56 0.502 / 0.256 fp32 (wall time of the call inside a training step, ``python
# tools/conv_backward_host.py demos/convnets/conv2d_depthwise_144_k3_relu6.py``).  Relaying x in (and
# the input gradient back) cost 0.01-0.18 ms for these inputs, less than the difference in every row.
def channels_last_conv(x: Tensor) -> bool:
    """Whether a conv on ``x`` (and its backward) runs on channels-last tensors (see the module
    docstring): 2-d and 3-d convs in fp16 / bf16 / fp32."""
    return channels_last_problem(x.dim(), x.dtype) is None


def channels_last_problem(ndim: int, dtype: torch.dtype) -> str | None:
    """Why cuDNN has no channels-last kernels for a conv of an ``ndim``-dim x in ``dtype``, or None."""
    if ndim not in (4, 5):
        return f"a {ndim - 2}-d conv (cuDNN has channels-last kernels for 2-d and 3-d convs only)"
    if dtype not in CHANNELS_LAST_DTYPES:
        return f"{dtype} (cuDNN runs it in NCHW whatever the layout)"
    return None


@dataclass
class _ForwardPlan:
    """``conv_forward``'s per-signature work on CUDA: the relayouts of x and the weight into
    channels-last (None: used as they are) and whether cuDNN may use TF32 (``conv_precision``)."""

    x_relayout: object | None
    weight_relayout: object | None
    tf32: bool
    #: the conv alone of the calls that save nothing (``ConvAlone``), made at the first such call (the
    #: plan is kept per ``environment.plan_switches``, which its choice follows)
    alone: ConvAlone | None = None


_FORWARD_PLANS = BoundedCache(256)
_NOMINAL_FORMATS = BoundedCache(256)


def conv_forward(x: Tensor, weight: Tensor, spec: ConvSpec, channels_last: bool, alone: bool = False) -> Tensor:
    """The conv output without bias; channels-last where ``channels_last`` and
    :func:`channels_last_conv` (see the module docstring), then with cuDNN's TF32 off where eager's
    conv of x and the weight as given runs in full fp32 (``conv_precision``: on channels-last copies
    cuDNN may pick a TF32 kernel where eager's layout got a full-fp32 one).  With ``alone`` (a Triton
    path's call that saves nothing) the channels-last conv runs as :class:`ConvAlone` chooses."""
    if not (channels_last and channels_last_conv(x)):
        return run_conv(x, weight, None, spec)  # eager's own call: eager's kernel and precision
    fmt = channels_last_format(x.dim())
    plan = None
    if x.device.type != "cuda" or is_fake(x):  # fakes, meta and CPU tensors: torch's copy
        tf32 = conv_precision.forward_tf32(x, weight, spec).tf32
        x_in, weight_in = x.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt)
    else:
        key = (tensor_key(x), tensor_key(weight), *conv_precision.plan_key(x, spec), *environment.plan_switches())
        plan = _FORWARD_PLANS.peek(key)
        if plan is None:
            answer = conv_precision.forward_tf32(x, weight, spec)
            plan = _ForwardPlan(_relayout_into(x, fmt), _relayout_into(weight, fmt), answer.tf32)
            if answer.settled:
                _FORWARD_PLANS.put(key, plan)
        tf32 = plan.tf32
        x_in = x if plan.x_relayout is None else plan.x_relayout(x)
        weight_in = weight if plan.weight_relayout is None else plan.weight_relayout(weight)
    with conv_precision.cudnn_tf32(tf32):
        if not alone:
            y0 = run_conv(x_in, weight_in, None, spec)
        elif plan is None:  # fakes, meta and CPU tensors
            y0 = conv_alone(x_in, weight_in, spec)
        else:
            if plan.alone is None:
                plan.alone = conv_alone_plan(x_in, weight_in, spec)
            y0 = plan.alone(x_in, weight_in)
    # The conv gives channels-last for channels-last inputs, but a fake conv need not say so (a
    # 3-d conv's fake on CPU gave NCHW where the real one gave channels-last): one layout for both.
    return in_format(y0, fmt)


def nominal_format(x: Tensor, weight: Tensor, spec: ConvSpec) -> torch.memory_format:
    """The memory format aten's conv gives for ``x`` and ``weight`` as they are (see the module
    docstring): the conv run on fakes of them, as an op's fake runs it (a conv on meta tensors does
    not pick the backend's layout: channels-last x gave an NCHW output), once per signature."""
    if x.device.type == "meta" or is_fake(x):
        return output_memory_format(run_conv(x, weight, None, spec))

    def on_fakes() -> torch.memory_format:
        mode = FakeTensorMode()
        fake_x, fake_weight = mode.from_tensor(x), mode.from_tensor(weight)
        with mode:
            return output_memory_format(run_conv(fake_x, fake_weight, None, spec))

    return _NOMINAL_FORMATS.get((tensor_key(x), tensor_key(weight), spec), on_fakes)


def _relayout_into(t: Tensor, fmt: torch.memory_format) -> object | None:
    """A planned relayout of ``t`` into ``fmt`` (None: ``t`` has that layout already)."""
    like = torch.empty(t.shape, dtype=t.dtype, device="meta", memory_format=fmt)
    return None if t.stride() == like.stride() else planned_relayout(t, like)


class ConvAlone:
    """The conv without bias for one call signature that saves nothing: aten's conv (cuDNN), or the conv
    family's plain forward (``kernels.conv.fprop_plan``) where it serves the call (:func:`family_conv_problem`)
    and ``FUSION_CONV_IMPL`` asks for it (``family``) or, under ``auto`` on CUDA, it measured faster for
    this signature (``impl_choice``, against aten's results; the answer kept on disk per machine).
    ``library`` and ``triton`` keep aten's conv.  Both write the output in aten's layout for these
    tensors (the family candidate only where that is channels-last dense), in x's dtype.

    ``plan(x, weight)`` runs it on tensors of the signature (x and the weight in the conv's dtype).

    WHY: cuDNN's conv is far from the family's on some shapes (ResNet-50's 7x7 stem on three input
    channels: NOTE at :func:`conv_alone_plan`) and ahead of it or level on most, so the measurement decides.
    Calls that save for a backward keep aten's conv: timing a candidate adds its compile and tile
    tuning to a region's measurement, and a training region's first call is held to its budget
    (``ops/conv_batch_norm/statistics.py`` says what that cost)."""

    def __init__(self, x: Tensor, weight: Tensor, spec: ConvSpec) -> None:
        self.spec = spec
        self.family_why = family_conv_problem(x, weight, spec)
        #: the chosen runner once settled (None: ask again at the next call)
        self.run = None
        #: which one it is: "library" or "family" (None: not settled)
        self.choice: str | None = None
        self._family_call = None
        self._fast_key = ("conv_alone", tensor_key(x), tensor_key(weight), spec)

    def _library(self, x: Tensor, weight: Tensor) -> Tensor:
        return run_conv(x, weight, None, self.spec)

    def _family(self, x: Tensor, weight: Tensor) -> Tensor:
        call = self._family_call
        if call is None:
            from ..kernels import conv as conv_family  # lazily: TRITON_INTERPRET is read at its import

            spec = self.spec
            call = conv_family.fprop_plan(x, weight, None, stride=spec.stride, padding=spec.padding,
                                          dilation=spec.dilation, groups=spec.groups)  # fmt: skip
            self._family_call = call if call.final else None
        return call(x, weight, None, None, (), None, None)[0]

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor:
        if self.run is not None:
            return self.run(x, weight)
        choice, settled = self._choose(x, weight)
        run = self._family if choice == "family" else self._library
        if settled:
            self.run, self.choice = run, choice
        return run(x, weight)

    def _choose(self, x: Tensor, weight: Tensor) -> tuple[str, bool]:
        """``(choice, settled)`` for this call (the class docstring's rule)."""
        mode = environment.conv_impl()
        if self.family_why is not None or mode in ("library", "triton"):
            return "library", True
        if mode == "family":
            return "family", True
        if not _measures_conv_alone(x):
            return "library", True
        from .. import impl_choice

        def key() -> str:
            return (f"conv_alone|{self.spec}|x {tuple(x.shape)} {x.stride()} {x.dtype}|w {tuple(weight.shape)} "
                    f"{weight.stride()}")  # fmt: skip

        choice = impl_choice.choose(
            key, {"library": functools.partial(self._library, x, weight), "family": functools.partial(self._family, x, weight)},
            default="library", agree=lambda got, want: impl_choice.results_agree((got,), (want,)),
            fast_key=self._fast_key)  # fmt: skip
        return choice, impl_choice.is_final(self._fast_key)


def family_conv_problem(x: Tensor, weight: Tensor, spec: ConvSpec) -> str | None:
    """Why the conv family's plain forward cannot stand in for aten's conv of ``x`` and ``weight``, or
    None: it serves direct 2-d and 3-d convs of fp16 / bf16 tensors (one dtype) where the Triton kernels
    run (``kernels.host.kernels_unavailable``: CUDA, or CPU under the interpreter) whose output aten lays
    out channels-last dense, as the family writes it."""
    if spec.transposed:
        return "a transposed conv"
    if x.dim() not in (4, 5):
        return f"a {x.dim() - 2}-d conv"
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return f"a {x.dtype} conv of a {weight.dtype} weight (the family's plain forward stands in for fp16 / bf16 convs)"
    if (why := kernels_unavailable(x.dtype, x.device.type)) is not None:
        return why
    if nominal_format(x, weight, spec) != channels_last_format(x.dim()):
        return "aten's output is not channels-last"
    return None


def _measures_conv_alone(x: Tensor) -> bool:
    """Whether ``auto`` times the family's forward against aten's conv for ``x``: on CUDA only
    (``impl_choice`` times with CUDA events; tests replace this answer)."""
    return x.device.type == "cuda"


_CONV_ALONE = BoundedCache(256)


# NOTE: cuDNN's conv against the family's plain forward as this choice timed them (bf16, channels-last, GPU
# ms per call, H200, cuDNN 9.19; ``python -m fusion_backend bench --log --suite demos/realnets/resnet50.py
# --dtype bf16 --mode infer --backends inductor,fusion-decide-all --compile-mode reduce-overhead``, the
# ``impl choice conv_alone`` lines, and the same for ``sd_vae_decoder.py``): ResNet-50's 7x7 stride-2 stem
# on 64 x 3 x 224 x 224 0.452 against 0.165 (the family's) and its 1x1 stride-2 1024 -> 2048 0.028 against
# 0.026; the SD VAE decoder's 128 -> 3 output conv on 512 x 512 0.099 against 0.086; its other 3x3s cuDNN's
# (0.78-0.88x the family's time), and ResNet-50's other 27 convs cuDNN's or level.
def conv_alone_plan(x: Tensor, weight: Tensor, spec: ConvSpec) -> ConvAlone:
    """The :class:`ConvAlone` of this signature (x and the weight in the conv's dtype), kept per
    signature and the environment's switches (``environment.plan_switches``)."""
    key = (tensor_key(x), tensor_key(weight), spec, *environment.plan_switches())
    return _CONV_ALONE.get(key, lambda: ConvAlone(x, weight, spec))


def conv_alone(x: Tensor, weight: Tensor, spec: ConvSpec) -> Tensor:
    """The conv of ``x`` and ``weight`` without bias for a call that saves nothing, as :class:`ConvAlone`
    runs it; on fake and meta tensors aten's (the same layout)."""
    if x.device.type == "meta" or is_fake(x):
        return run_conv(x, weight, None, spec)
    return conv_alone_plan(x, weight, spec)(x, weight)


@dataclass
class ConvBackwardPlan:
    """``aten.convolution_backward`` for one call signature (see the module docstring), each gradient
    with cuDNN's TF32 off where eager's conv backward computes it in full fp32 (``conv_precision``).
    Keeps no tensor: a plan outlives the calls, and a tensor made during a CUDA-graph capture would
    live in the graph's pool."""

    spec: ConvSpec
    #: shape, strides and dtype of the conv output's gradient the family's kernel writes
    grad_y_layout: tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
    #: x relaid into channels-last in one copy (None: x is used as it is)
    x_relayout: object | None
    #: the weight relaid into channels-last (None: used as it is)
    weight_relayout: object | None
    #: the input gradient, channels-last from the conv backward, relaid into x's layout (None: kept)
    grad_x_relayout: object | None
    #: whether the input gradient and the weight gradient may use TF32 (``conv_precision.backward_tf32``)
    tf32: tuple[bool, bool] = (True, True)
    #: whether the same signature always gets this plan (False: planned during a CUDA-graph capture
    #: without a precision answer; not kept)
    settled: bool = True

    def new_grad_y(self, device: torch.device) -> Tensor:
        shape, stride, dtype = self.grad_y_layout
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    def __call__(self, grad_y: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_w: bool,
                 need_b: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
        if not (need_x or need_w or need_b):
            return None, None, None
        if self.x_relayout is not None:
            x = self.x_relayout(x)
        if self.weight_relayout is not None:
            weight = self.weight_relayout(weight)
        grad_x, grad_w, grad_b = conv_precision.conv_backward(grad_y, x, weight, self.spec, need_x, need_w, need_b,
                                                               self.tf32)  # fmt: skip
        if grad_x is not None and self.grad_x_relayout is not None:
            grad_x = self.grad_x_relayout(grad_x)
        return grad_x, grad_w, grad_b


_PLANS = BoundedCache(256)


def conv_backward_plan(x: Tensor, weight: Tensor, spec: ConvSpec, layout_of: Tensor) -> ConvBackwardPlan:
    """The cached plan for a conv of ``x`` and ``weight`` (its output: ``conv_output_shape``, x's
    dtype).  ``layout_of``: the tensor whose memory format an NCHW-kept gradient takes (the saved conv
    output, or x where the forward saved none)."""
    key = (tensor_key(x), tensor_key(weight), output_memory_format(layout_of), spec, *conv_precision.plan_key(x, spec))
    plan = _PLANS.peek(key)
    if plan is None:
        plan = _plan(x, weight, spec, layout_of)
        if plan.settled:
            _PLANS.put(key, plan)
    return plan


def _plan(x: Tensor, weight: Tensor, spec: ConvSpec, layout_of: Tensor) -> ConvBackwardPlan:
    shape = conv_output_shape(x, weight, spec)
    if not channels_last_conv(x):  # eager's layouts (a 1-d conv, float64): eager's kernels and precision
        grad_y = torch.empty(shape, dtype=x.dtype, device="meta", memory_format=output_memory_format(layout_of))
        return ConvBackwardPlan(spec, (tuple(grad_y.shape), grad_y.stride(), grad_y.dtype), None, None, None)
    fmt = channels_last_format(x.dim())
    grad_y = torch.empty(shape, dtype=x.dtype, device="meta", memory_format=fmt)
    x_relayout = _relayout_into(x, fmt)
    x_cl = torch.empty(x.shape, dtype=x.dtype, device="meta", memory_format=fmt)
    precision = conv_precision.backward_tf32(x, weight, spec)
    return ConvBackwardPlan(
        spec,
        (tuple(grad_y.shape), grad_y.stride(), grad_y.dtype),
        x_relayout,
        _relayout_into(weight, fmt),
        None if x_relayout is None else planned_relayout(x_cl, torch.empty_like(x, device="meta")),
        (precision.grad_input, precision.grad_weight),
        precision.settled,
    )  # fmt: skip
