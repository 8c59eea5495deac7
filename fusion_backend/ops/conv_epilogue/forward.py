"""The Triton forward of ``fusion::conv_epilogue``: which implementation a call gets (``conv_impl``:
the fused implicit-GEMM conv, or the library conv then the epilogue kernel, and its channels-last
variant), the measured choice among them (``impl_choice``), and the per-signature call plans that
run it (``plan_for``, kept in ``PLANS`` under ``call_signature``; ``forward`` and ``settled`` are
the declaration's Triton forward and settled-plan lookup).
"""

import copy
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ... import environment, impl_choice
from ...errors import UnsupportedInputError
from ...impl_choice import results_agree
from ...ir.specs import ConvSpec
from ...kernels.host import BoundedCache, tensor_key
from ...kernels.weight_fold import fold_plan
from .. import conv_precision
from ..chain import ChainValue, PointwiseKind, TensorRef
from ..chain_lowering import KernelChains, affine_rows, family_activation, kernel_steps, tensor_sources
from ..config import ConvEpilogueConfig
from ..conv_io import (
    DECISIONS,
    channels_last_format,
    conv_output_shape,
    empty_placeholder,
    output_memory_format,
    planned_relayout,
    pooled_output_shape,
    relayout,
    run_conv,
)
from ..library_conv import channels_last_problem, conv_alone_plan, nominal_format
from .reference import allocate_forward_outputs, cast_inputs, conv_compute_dtype, input_norm_affine
from .reference import forward as reference_forward

logger = logging.getLogger("fusion_backend")

#: The environment switches this op reads (``fusion_backend.environment`` says what they do).
CPU_KERNELS_ENV = environment.CPU_KERNELS
CONV_IMPL_ENV = environment.CONV_IMPL
DEFAULT_CONV_IMPL = environment.DEFAULT_CONV_IMPL


def epilogue_kernels() -> ModuleType:
    # Imported lazily: TRITON_INTERPRET is read when @triton.jit runs, i.e. at this import.
    from ...kernels import epilogue

    return epilogue


def conv_impl(x: Tensor, weight: Tensor, cfg: ConvEpilogueConfig, save: bool) -> tuple[str, str | None]:
    """Which conv the Triton forward runs: ``("triton", None)`` for the fused implicit-GEMM kernel
    (``forward_kernels``: ``kernels.conv_dense`` or ``kernels.conv_fused``), ``("library", why)``
    for aten/cuDNN + the epilogue kernel.

    ``FUSION_CONV_IMPL`` (read at call time; ``auto`` by default): ``library`` always takes the
    library conv; ``auto`` answers ``triton`` on CUDA whenever one of the fused kernels serves the
    case (``conv_dense``, else ``conv_fused.unsupported_reason`` is None) and could win
    (``general_kernel_never_wins``), ``plan_for`` then measures which of the candidates is fastest,
    and the library conv on CPU (the interpreter is slow; tests force the fused kernel there);
    ``triton`` always takes the fused
    kernel and raises ``UnsupportedInputError`` (handled by the failure policy: strict raises, else
    warn and run the reference) when it cannot serve the case.
    """
    mode = environment.conv_impl()
    if mode == "library":
        return "library", f"{CONV_IMPL_ENV}=library"
    if mode == "auto" and x.device.type != "cuda":
        return "library", f"{CONV_IMPL_ENV}=auto uses the fused conv on CUDA only"
    key = ("conv_impl", tensor_key(x), tensor_key(weight), cfg, save, mode)
    return DECISIONS.get(key, lambda: _fused_conv_answer(x, weight, cfg, save, mode))


def _fused_conv_answer(x: Tensor, weight: Tensor, cfg: ConvEpilogueConfig, save: bool,
                       mode: str) -> tuple[str, str | None]:  # fmt: skip
    """``conv_impl``'s answer for ``auto``/``triton`` (see there)."""
    from ...kernels import conv_fused

    if forward_kernels(x, weight, cfg) is not conv_fused:
        return "triton", None
    pooled = None
    if cfg.pool is not None:
        pooled = pooled_output_shape(conv_output_shape(x, weight, cfg.conv), cfg.pool)[2:]
    why = conv_fused.unsupported_reason(
        x,
        weight,
        cfg.conv,
        cfg.pool,
        pooled,
        save,
        conv_compute_dtype(cfg, x),
    )
    if why is None and mode == "auto":
        why = general_kernel_never_wins(x, weight, cfg)
    if why is None:
        return "triton", None
    if mode == "triton":
        raise UnsupportedInputError(f"{CONV_IMPL_ENV}=triton but the fused conv kernel cannot run: {why}")
    return "library", why


def general_kernel_never_wins(x: Tensor, weight: Tensor, cfg: ConvEpilogueConfig) -> str | None:
    """Why ``auto`` leaves the general fused kernel (``kernels.conv_fused``) out of its candidates
    although it serves the case, or None where it is timed: the cases where it lost to the library
    conv in every bench row.  ``FUSION_CONV_IMPL=triton`` still runs it there.

    NOTE: measured on the H100 (``python -m fusion_backend bench --log --suite convnets``, fp32 and
    bf16, infer and train; the ``impl choice`` lines): on a direct (not transposed) conv it lost to
    the best library path by 2.4-14x on its first tile in every row (Conv2d 128->256 k3 s2,
    depthwise Conv2d 144 k3, Conv2d 256 k3 + MaxPool2d, Conv3d 32->64 k3 + MaxPool3d); on a 2-d
    transposed conv without a pool off its phase-aligned path (ConvTranspose2d 256->128 and 64->3 k4
    s2) by 1.2-7.6x, or its results were not close enough to be a candidate.  Its first batch of
    compiles took 2-6.5 s of those rows' first calls.  It wins on transposed convs with a fused pool (the ConvTranspose3d pipeline) and on
    phase-aligned ones (ConvTranspose2d/3d k2 s2); plain stride-1 convs go to ``kernels.conv_dense``.
    """
    from ...kernels.conv_fused.plan import launch_plan

    if not cfg.conv.transposed:
        return "a direct conv off the dense kernel's cases: the general fused kernel never beat the library conv there"
    if x.dim() == 4 and cfg.pool is None and not launch_plan(x, weight, cfg.conv, None, None).phase_aligned:
        return ("a 2-d transposed conv with overlapping taps and no pool: the general fused kernel never beat "
                "the library conv there")  # fmt: skip
    return None


def forward_kernels(x: Tensor, weight: Tensor, cfg: ConvEpilogueConfig) -> ModuleType:
    """The fused forward's kernel module: ``kernels.conv_dense`` where it serves the case (a plain
    stride-1 1d/2d conv without a pool: one shift per tap over flattened planes, 2.3x faster than
    ``conv_fused`` on Conv2d 64->64 k3 over 64x64x256x256), else the general ``kernels.conv_fused``.
    Both take the same launch arguments and write the same outputs and saved state; cached per
    shapes, strides and dtypes."""
    from ...kernels import conv_dense, conv_fused

    def answer() -> ModuleType:
        pool = cfg.pool
        dense = conv_dense.unsupported_reason(x, weight, cfg.conv, pool) is None
        return conv_dense if dense else conv_fused

    return DECISIONS.get(("forward_kernels", tensor_key(x), tensor_key(weight), cfg), answer)


def _library_conv_meta(x: Tensor, weight: Tensor, spec: ConvSpec, dtype: torch.dtype) -> Tensor:
    """A meta tensor with the shape, strides and dtype (the compute dtype) the library conv (and the
    op's fake) would give y0: the layout of ``library_conv.nominal_format``, on x and the weight as
    stored, not cast (the backend and its memory format depend on the layouts and on float64-or-not,
    cuDNN's rule, not on fp32 vs bf16/fp16; only a weight whose dtype differs from x's, never under
    autocast, is cast).  Cached per shapes, strides, dtypes and devices (asked on every call)."""

    def meta() -> Tensor:
        fmt = nominal_format(x, weight if weight.dtype == x.dtype else weight.to(x.dtype), spec)
        return torch.empty(conv_output_shape(x, weight, spec), dtype=dtype, device="meta", memory_format=fmt)

    return DECISIONS.get(("conv_meta", tensor_key(x), tensor_key(weight), spec, dtype), meta)


class FusedForward:
    """The fused conv kernel's forward for one call signature: the output layouts, the operand
    matrix layout and the kernel's launch plan are worked out once; a call allocates the outputs,
    builds ``P`` and launches (``(x, weight, bias, operands) -> (out, saved_y0, saved_winner)``, tensors
    laid out like the constructor's).  Same outputs and formats as the library path, so the
    backward is shared.

    WHY a plan object: the ConvT3d pipeline's step (16x16x16x32x32) waits on the host; the per-call
    checks, decisions and cache lookups this skips cost more than the launches (146 us per forward on
    the H100 host before).

    Precision: the kernel's fp32 dots use TF32 only where eager's conv of x and the weight does
    (``conv_precision.forward_tf32``; cuDNN runs some fp32 convs in full fp32 with TF32 allowed).
    ``settled``: False for a plan made during a CUDA-graph capture without that answer (full fp32).
    """

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvEpilogueConfig, save: bool) -> None:  # fmt: skip
        dtype = conv_compute_dtype(cfg, x)
        precision = conv_precision.forward_tf32(x, weight, cfg.conv, dtype)
        self.settled = precision.settled
        y0, steps, outputs = _forward_layouts(x, weight, operands, cfg, save, dtype)
        self.layouts = [(tuple(t.shape), t.stride(), t.dtype) for t in outputs]
        self.save_y0 = save
        self.save_winner = save and cfg.pool is not None and cfg.pool.kind == "max"
        out, saved_y0, saved_winner = outputs
        self.launch = forward_kernels(x, weight, cfg).forward_launch(
            x, weight, bias, steps, cfg.conv, cfg.pool,
            out, saved_y0 if self.save_y0 else None, saved_winner if self.save_winner else None,
            allow_tf32=precision.tf32, compute_dtype=dtype,
        )  # fmt: skip
        self.params = PlannedOperands(cfg, steps, bias, y0.shape[1], x.device)

    def probe(self) -> "FusedForward":
        """This plan on the tile its autotuner would time first, without tuning (one compile): what
        ``impl_choice`` times to screen the fused kernel before tuning it."""
        probe = copy.copy(self)
        probe.launch = None if self.launch is None else self.launch.probe()
        return probe

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        device = x.device
        out, saved_y0, saved_winner = (
            torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in self.layouts
        )
        if self.launch is not None:
            self.launch.run(x, weight, *self.params(bias, operands), out, saved_y0 if self.save_y0 else None,
                            saved_winner if self.save_winner else None)  # fmt: skip
        return out, saved_y0, saved_winner


def _forward_layouts(
    x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig, save: bool, dtype: torch.dtype,
) -> tuple[Tensor, list, tuple[Tensor, Tensor, Tensor]]:  # fmt: skip
    """What both forward plans work out first, on meta tensors (no memory): the conv output ``y0`` in
    the compute ``dtype`` and the outputs' memory format (``output_memory_format`` of the fake's
    conv layout, as ``in_format`` lays it out), the kernels' chain steps, and ``(out, saved_y0,
    saved_winner)`` as ``allocate_forward_outputs`` gives them."""
    y0 = _library_conv_meta(x, weight, cfg.conv, dtype)
    y0 = torch.empty(y0.shape, dtype=dtype, device="meta", memory_format=output_memory_format(y0))
    steps = epilogue_steps(cfg, operands, y0.dim(), y0.shape[1])
    return y0, steps, allocate_forward_outputs(torch.empty(0, dtype=x.dtype, device="meta"), y0, cfg, save)


def epilogue_steps(cfg: ConvEpilogueConfig, operands: Sequence[Tensor], y_ndim: int, channels: int) -> list:
    """The chain as the epilogue kernels take it (``kernel_steps``), the residual's add an empty step
    (the kernel adds the residual there: ``kernels.epilogue.residual_split``)."""
    if cfg.residual is None:
        return kernel_steps(cfg.chain, operands, y_ndim, channels)
    at = residual_slot(cfg)
    return [*kernel_steps(cfg.chain[:at], operands, y_ndim, channels), (0, []),
            *kernel_steps(cfg.chain[at + 1:], operands, y_ndim, channels)]


def residual_slot(cfg: ConvEpilogueConfig) -> int:
    """The index of the chain step that adds the residual."""
    return next(i for i, step in enumerate(cfg.chain) if TensorRef(cfg.residual) in step.operands)


class PlannedOperands:
    """``(bias, operands) -> (P, bias)`` for one call signature: the kernels' operand matrix ``P``
    (``OperandMatrix``; per tensor row, in ``tensor_rows`` order, its index into ``operands``) and
    the bias as the kernels read it through its own pointer (its C values, contiguous; None without).

    The bias stays out of ``P`` (``kernels.epilogue``'s module docstring says why): a chain without
    tensor operands gets the cached constant ``P`` and nothing is built per call."""

    def __init__(self, cfg: ConvEpilogueConfig, steps: Sequence[Any], bias: Tensor | None, channels: int,
                 device: torch.device) -> None:  # fmt: skip
        self.matrix = epilogue_kernels().OperandMatrix(steps, None, channels, device)
        #: (a residual is read through its own pointer, not as a row of ``P``)
        self.sources = tuple(i for i in tensor_sources(cfg.chain) if i != cfg.residual)
        #: the signature's bias is not one contiguous run of C values (a view): copied per call
        self.copy_bias = bias is not None and not (bias.dim() == 1 and bias.is_contiguous())

    def __call__(self, bias: Tensor | None, operands: Sequence[Tensor]) -> tuple[Tensor, Tensor | None]:
        if self.copy_bias:
            bias = bias.reshape(-1).contiguous()
        return self.matrix.build([operands[i] for i in self.sources]), bias


def _fused_conv_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
    save: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """One Triton kernel for conv + bias + chain + pool (``FusedForward``, unplanned)."""
    return FusedForward(x, weight, bias, operands, cfg, save)(x, weight, bias, operands)


#: Settled per-signature forward call plans, keyed by ``call_signature``.
PLANS = BoundedCache(256)


def call_signature(config: str, save: bool, x: Tensor, weight: Tensor, bias: Tensor | None,
                   operands: Sequence[Tensor]) -> tuple:  # fmt: skip
    """Everything a call's path and plan depend on: the config, the tensors' shapes, strides, dtypes
    and devices, the TF32 flag and the environment switches (read per call: tests change them)."""
    return (
        config, save, tensor_key(x), tensor_key(weight), tensor_key(bias), tuple(map(tensor_key, operands)),
        torch.backends.cudnn.allow_tf32, *environment.plan_switches(),
    )  # fmt: skip


def settled(config: str, save: bool, x: Tensor, weight: Tensor, bias: Tensor | None,
            operands: Sequence[Tensor]) -> Any:  # fmt: skip
    """The declaration's ``settled_forward``: the plan settled for this call's signature, or None.
    ``call_signature`` written out: this runs on every call, one Python call before the plan's."""
    return PLANS.peek((
        config, save, tensor_key(x), tensor_key(weight), tensor_key(bias), tuple(map(tensor_key, operands)),
        torch.backends.cudnn.allow_tf32, *environment.plan_switches(),
    ))  # fmt: skip


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The declaration's Triton forward for a call without a settled plan: picks the plan
    (``plan_for``), keeps it when settled (under the canonical config string, the one the rewriter
    puts into graphs) and runs it."""
    plan, is_settled = plan_for(x, weight, bias, operands, cfg, save)
    if is_settled:
        PLANS.put(call_signature(cfg.to_json(), save, x, weight, bias, operands), plan)
    return plan(x, weight, bias, operands)


def plan_for(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
    save: bool,
) -> tuple[Any, bool]:  # fmt: skip
    """``(plan, settled)``: the fused conv kernel's plan (``FusedForward``) or the library conv +
    epilogue kernel (``LibraryForward``), as ``conv_impl`` says, or the conv family's
    (``FamilyForward``) under ``FUSION_CONV_IMPL=family``; under ``FUSION_CONV_IMPL=auto``
    the fastest of ``forward_candidates`` (the fused kernel where it serves the case, the library
    conv in x's layout and in channels-last), measured once per shape (``impl_choice``; the
    library path in x's layout when measuring is off, and without measuring where only the library
    conv serves and the timer has no CUDA device: ``_times_library_layouts``).  ``settled``: the
    same signature always gets this answer (not while the choice is unmeasured), so the caller may
    keep the plan (nor while the plan's precision is unsettled: ``FusedForward``'s)."""
    mode = environment.conv_impl()
    if cfg.family_only:
        return _family_or_reference_plan(x, weight, bias, operands, cfg, save, mode)
    if mode == "family":
        return _forced_family(x, weight, bias, operands, cfg, save)
    impl = conv_impl(x, weight, cfg, save)[0]
    if mode != "auto" or (impl == "library" and not _times_library_layouts(x)):
        plan = (FusedForward if impl == "triton" else LibraryForward)(x, weight, bias, operands, cfg, save)
        return plan, plan.settled
    args = (x, weight, bias, operands)
    plans = forward_candidates(*args, cfg, save, fused=impl == "triton")
    probes = {"triton": functools.partial(plans["triton"].probe(), *args)} if "triton" in plans else None
    return _measured_forward(plans, args, cfg, save, probes)


def _forced_family(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                   cfg: ConvEpilogueConfig, save: bool) -> tuple[Any, bool]:  # fmt: skip
    """``FUSION_CONV_IMPL=family``: the family's forward, or one clear error where it cannot serve the call."""
    why = family_forward_unsupported(x, weight, operands, cfg, save)
    if why is not None:
        raise UnsupportedInputError(f"{CONV_IMPL_ENV}=family but the conv family's forward cannot run: {why}")
    plan = FamilyForward(x, weight, bias, operands, cfg, save)
    return plan, plan.settled


def _measured_forward(plans: dict[str, Any], args: tuple, cfg: ConvEpilogueConfig, save: bool,
                      probes: dict[str, Any] | None = None) -> tuple[Any, bool]:  # fmt: skip
    """``measured_plan`` with the forward's keys (``args``: ``(x, weight, bias, operands)``)."""
    x, weight, bias, _ = args
    fast_key = ("forward", tensor_key(x), tensor_key(weight), bias is None, cfg, save,
                torch.backends.cudnn.allow_tf32)  # fmt: skip
    return measured_plan(plans, args, lambda: choice_key(x, weight, bias, cfg, save) + "|forward-v6", fast_key, probes)


class ReferenceForward:
    """``reference.forward`` on the call's device as a plan: the baseline of a region with an input gate
    or an input norm (which the library and fused conv kernels do not apply), and of a residual the
    epilogue kernel cannot add (``_residual_library_or_reference``): ``ConvEpilogueConfig.family_only``."""

    settled = True

    def __init__(self, cfg: ConvEpilogueConfig, save: bool) -> None:
        self.cfg, self.save = cfg, save

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor]) -> Any:
        return reference_forward(x, weight, bias, operands, self.cfg, self.save)


def _family_or_reference_plan(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                              cfg: ConvEpilogueConfig, save: bool, mode: str) -> tuple[Any, bool]:  # fmt: skip
    """``plan_for`` of a ``family_only`` region: its baseline (``_residual_library_or_reference``), the
    conv family's forward (which adds the residual in its store and applies the gate or the input norm
    as it loads), for an input norm ``InputNormLibraryForward``, and for a residual after a folded eval
    BatchNorm then ReLU cuDNN's fused conv + add + ReLU (``CudnnFusedForward``), each where it serves
    the call; under ``auto`` the fastest, measured (without a CUDA timer: the family's where it serves,
    else the input norm's library plan)."""
    if mode == "family":
        return _forced_family(x, weight, bias, operands, cfg, save)
    plans: dict[str, Any] = {"library": _residual_library_or_reference(x, weight, bias, operands, cfg, save)}
    if mode == "auto" and family_forward_unsupported(x, weight, operands, cfg, save) is None:
        plans["family"] = FamilyForward(x, weight, bias, operands, cfg, save)
    if mode == "auto" and input_norm_library_unsupported(x, weight, operands, cfg, save) is None:
        plans["norm-library"] = InputNormLibraryForward(x, weight, bias, operands, cfg, save)
    if mode == "auto" and x.device.type == "cuda" and cudnn_fused_unsupported(x, weight, operands, cfg, save) is None:
        plans["cudnn-fused"] = CudnnFusedForward(x, weight, bias, operands, cfg, save)
    if len(plans) == 1 or _times_library_layouts(x):
        return _measured_forward(plans, (x, weight, bias, operands), cfg, save)
    plan = plans.get("family", plans.get("norm-library"))
    return plan, plan.settled


def _residual_library_or_reference(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                                   cfg: ConvEpilogueConfig, save: bool) -> Any:  # fmt: skip
    """A ``family_only`` region's baseline plan: for a residual (no gate, no input norm), the library
    path with the residual added by the epilogue kernel in its one pass (``LibraryForward``), where the
    kernel serves the chain (``kernels.epilogue.residual_split``: no step after the add reads a value
    from before it; per-channel or one-value operands); else ``ReferenceForward``."""
    if cfg.residual is None or cfg.gate is not None or cfg.norm_in is not None:
        return ReferenceForward(cfg, save)
    try:
        return LibraryForward(x, weight, bias, operands, cfg, save)
    except (UnsupportedInputError, ValueError) as exc:
        logger.debug("conv_epilogue forward: the residual's library plan cannot serve the call (%s)", exc)
        return ReferenceForward(cfg, save)


def input_norm_library_unsupported(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
                                   save: bool) -> str | None:  # fmt: skip
    """Why ``InputNormLibraryForward`` cannot serve a call, or None: it serves a region with an input
    norm (no residual), a call that saves nothing (the region's backward starts from x: plain torch's),
    and an fp32 / fp16 / bf16 x dense in its memory format (the normalised tensor then has x's strides,
    so its conv lays the outputs out as the region's fake does)."""
    if cfg.norm_in is None or cfg.residual is not None:
        return "no input norm, or a residual"
    if save:
        return "a call that saves state for a backward"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dim() < 3:
        return f"x is {x.dtype} with {x.dim()} dims"
    dense = torch.empty(x.shape, device="meta", memory_format=output_memory_format(x)).stride()
    return None if x.stride() == dense else f"x's strides {x.stride()} are not a dense layout's"


class InputNormLibraryForward:
    """A region whose conv reads ``act(group_norm(x))`` (``cfg.norm_in``), for a call that saves nothing
    (``input_norm_library_unsupported``): the norm and its activation by ``kernels.group_norm`` in fp32,
    written once in the conv's dtype and x's layout (rounded once, as eager rounds autocast's fp32
    norm for its conv), then the rest of the region on that tensor as the library path runs it
    (``LibraryForward``: aten's conv, then the epilogue kernel adding the bias and the chain; a
    bias-free conv alone is the conv's own output).

    WHY: the conv family's forward, which applies the norm as it loads, lost every such region of the
    SD VAE decoder to Inductor (0.21-0.55x on the H200, bf16 inference), and the plain-torch reference
    runs aten's GroupNorm; Inductor's own GroupNorm statistics of its 1x256x512x512 input took 541 us
    where ``kernels.group_norm``'s channels-last kernels take 138 us with the normalise pass
    (``docs/perf/RESULTS.md``, "GroupNorm on channels-last tensors").  ``auto`` measures it against
    the other two per call signature; the region's decision against Inductor's code as every region's.
    """

    settled = True

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvEpilogueConfig, save: bool) -> None:  # fmt: skip
        self.cfg, self.dtype = cfg, conv_compute_dtype(cfg, x)
        #: the region without its input norm: what the library plan runs on the normalised tensor
        #: (a bias-free conv alone: the conv's own output, ``LibraryForward.conv_alone``)
        self.conv_cfg = dataclasses.replace(cfg, norm_in=None, norm_in_affine=None, act_in=())
        #: the library plan, made on the first call (from the normalised tensor)
        self.conv: LibraryForward | None = None

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        from ...kernels.group_norm import group_norm_forward

        cfg, channels = self.cfg, x.shape[1]
        affine = cfg.norm_in_affine
        chains = KernelChains((), cfg.act_in, None, operands, x.dim(), channels, x.device, affine=affine_rows(
            operands, affine, None if affine is None else affine + 1, channels, x.device))  # fmt: skip
        normed = torch.empty_like(x, dtype=self.dtype)  # x's strides (dense: ``input_norm_library_unsupported``)
        group_norm_forward(x, False, chains.pre, chains.post, cfg.norm_in, cfg.norm_in_eps, chains.params,
                           chains.post_params, chains.affine, normed)  # fmt: skip
        if self.conv is None:
            self.conv = LibraryForward(normed, weight, bias, operands, self.conv_cfg, False)
        out = self.conv(normed, weight, bias, operands)[0]
        return out, empty_placeholder(x), empty_placeholder(x)  # the op's x's placeholders: nothing saved


def residual_parts(cfg: ConvEpilogueConfig) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A residual region's chain as ``(the steps before its add, the steps after it)``."""
    at = residual_slot(cfg)
    return cfg.chain[:at], cfg.chain[at + 1:]


def _family_act_out(tail: Sequence[Any]) -> Any:
    """The family store's ``act_out`` (an ``Activation``, None for none) for the steps after a
    residual, or a str saying why they do not fit it (``chain_lowering.family_activation``)."""
    from ...kernels.conv.hooks import Activation

    if not tail:
        return None
    act = family_activation(tail[0]) if len(tail) == 1 else None
    if act is None:
        return "after the residual add the family applies one relu, leaky_relu, gelu or silu"
    return Activation(*act)


def measured_plan(plans: dict[str, Any], args: tuple, key: Callable[[], str], fast_key: tuple,
                  probes: dict[str, Any] | None = None) -> tuple[Any, bool]:  # fmt: skip
    """``(plan, settled)`` of either direction's ``plan_for`` under ``auto``: the library plan where it
    is the only candidate, else the fastest of ``plans`` (each called with ``args``), measured once
    per shape against the library plan's results (``impl_choice``, ``results_agree``; ``key`` and
    ``fast_key`` as ``impl_choice.choose`` takes them; a key's version, e.g. the forward's "v3",
    changes where candidates join, so that answers measured without them are measured again)."""
    if len(plans) == 1:
        return plans["library"], plans["library"].settled
    impl = impl_choice.choose(key, {name: functools.partial(plan, *args) for name, plan in plans.items()},
                              default="library", agree=results_agree, fast_key=fast_key, probes=probes)  # fmt: skip
    return plans[impl], impl_choice.is_final(fast_key) and plans[impl].settled


def _times_library_layouts(x: Tensor) -> bool:
    """Whether ``auto`` measures the library forward's layouts against each other where the fused
    conv kernel is no candidate: on CUDA only (``impl_choice`` times with CUDA events; on CPU the
    interpreter is slow, and tests force a path or replace this answer)."""
    return x.device.type == "cuda"


def forward_candidates(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
    save: bool, fused: bool,
) -> dict[str, Any]:  # fmt: skip
    """The forward plans that can serve this call, by name: ``triton`` (``FusedForward``) when
    ``fused``; always ``library``; ``family`` (``FamilyForward``) where the conv family's forward
    serves the call (``family_forward_unsupported``); ``library-channels-last``
    (``ChannelsLastLibraryForward``) for 2-d and 3-d convs of an x that is not channels-last
    (``channels_last_forward_unsupported``); ``cudnn-fused`` (``CudnnFusedForward``) for CUDA inference
    calls of conv, a folded eval BatchNorm, (a residual add,) relu (``cudnn_fused_unsupported``)."""
    args = (x, weight, bias, operands, cfg, save)
    plans: dict[str, Any] = {}
    if fused:
        plans["triton"] = FusedForward(*args)
    plans["library"] = LibraryForward(*args)
    why = family_forward_unsupported(x, weight, operands, cfg, save)
    if why is None:
        plans["family"] = FamilyForward(*args)
    else:
        logger.debug("conv_epilogue forward: no conv-family forward (%s)", why)
    why = channels_last_forward_unsupported(x, weight, cfg)
    if why is None:
        plans["library-channels-last"] = ChannelsLastLibraryForward(*args)
    else:
        logger.debug("conv_epilogue forward: no channels-last library forward (%s)", why)
    why = "no cuDNN" if x.device.type != "cuda" else cudnn_fused_unsupported(x, weight, operands, cfg, save)
    if why is None:
        plans["cudnn-fused"] = CudnnFusedForward(*args)
    else:
        logger.debug("conv_epilogue forward: no cuDNN fused conv + relu (%s)", why)
    return plans


def choice_key(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: ConvEpilogueConfig, save: bool) -> str:
    """Everything the fused-vs-library timing depends on (the chain's op codes included)."""
    return (
        f"conv_epilogue|{cfg.to_json()}|x {tuple(x.shape)} {x.stride()} {x.dtype}|w {tuple(weight.shape)} "
        f"{weight.stride()}|bias {bias is not None}|save {save}|tf32 {torch.backends.cudnn.allow_tf32}"
    )


class LibraryForward:
    """The library path's forward for one call signature (see ``FusedForward``): aten's conv
    without bias, then one Triton kernel for bias + chain (+ a residual) + pool (+ max-pool
    winners).  The conv output's layout (``_library_conv_meta``, the fake's rule), the outputs'
    layouts, the operand matrix layout and the epilogue kernel's launch
    (``kernels.epilogue.ForwardLaunch``) are worked out once; a call casts, convolves, allocates and
    launches.

    WHY a plan object: on small convs (Conv2d 3->16 k3 on 128 x 3 x 32 x 32) the step is host time,
    and the per-call checks, key building and Triton's generic launch were most of it.

    ``ChannelsLastLibraryForward`` is the same plan with the conv in channels-last: it sets
    ``conv_format`` and overrides ``_conv_output``; everything after the conv is shared here.
    """

    #: the memory format x and the weight are relaid into for the conv (None: as they are given)
    conv_format: torch.memory_format | None = None
    #: whether the same signature always gets this plan: the conv in x's own layout is eager's call,
    #: with eager's kernel and precision (``ChannelsLastLibraryForward`` answers for its own)
    settled: bool = True

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvEpilogueConfig, save: bool) -> None:  # fmt: skip
        self.spec = cfg.conv
        self.dtype = conv_compute_dtype(cfg, x)
        y0, steps, outputs = _forward_layouts(x, weight, operands, cfg, save, self.dtype)
        if self.conv_format is not None:  # a channels-last conv writes a channels-last y0
            y0 = torch.empty(y0.shape, dtype=self.dtype, device="meta", memory_format=self.conv_format)
        #: the conv output's shape and strides: in the outputs' memory format (as ``in_format``
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
        pool = cfg.pool
        #: the residual's operand index (None: none), read by the epilogue kernel at its chain slot
        self.residual = cfg.residual
        residual = None
        if cfg.residual is not None:
            r = operands[cfg.residual]
            residual = (torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta"), residual_slot(cfg))
        self._launch_args = (bias_meta, [(code, ()) for code, _ in steps], pool, outputs, residual)
        #: the epilogue kernel's launches by y0's strides (one, unless the conv surprises us)
        self.launches = {y0.stride(): self._plan_launch(y0)}
        self.params = PlannedOperands(cfg, steps, bias, y0.shape[1], x.device)
        #: a region that is the conv alone, without a bias, in the conv's dtype, saving nothing (an
        #: upsample or an input norm folded into a bias-free conv): the conv's own output, no pass after
        #: it.  NOTE: with a bias the epilogue kernel adds it: aten's conv adds it in a broadcast add of
        #: its own after cuDNN's, which does not vectorise on channels-last outputs (0.021 ms on a
        #: 1x512x128x128 bf16 output, where the epilogue kernel streams at about 4 TB/s; H200,
        #: ``python tools/profile_step.py`` on an upsample -> Conv2d(512, 512, 3) model, fusion-fused).
        self.conv_alone = (bias is None and not save and not cfg.chain and cfg.pool is None
                           and self.conv_format is None and outputs[0].dtype == self.dtype)  # fmt: skip
        #: a call that saves nothing runs its conv as ``library_conv.ConvAlone`` chooses (aten's, or the
        #: conv family's plain forward where it measured faster), planned at the first call (None: aten's)
        self.measures_conv = not save
        self.conv_plan = None

    def _plan_launch(self, y0: Tensor) -> Any:  # kernels.epilogue.ForwardLaunch
        """The epilogue kernel's launch for a conv output laid out like ``y0`` (real or meta)."""
        bias_meta, codes, pool, (out, saved_y0, saved_winner), residual = self._launch_args
        return epilogue_kernels().ForwardLaunch(
            y0, bias_meta, codes, pool, out, saved_winner if self.max_save else None,
            saved_y0 if self.max_save else None, y_copy=saved_y0 if self.kernel_saves_y0 else None,
            **({} if residual is None else dict(residual=residual[0], residual_at=residual[1])),
        )  # fmt: skip

    def _conv_output(self, x: Tensor, weight: Tensor) -> Tensor:
        """y0: the conv of x and weight cast to the compute dtype, in ``y0_layout``."""
        xc, wc, _ = cast_inputs(x, weight, None, self.dtype)
        y0 = self._conv(xc, wc)
        shape, stride = self.y0_layout
        if y0.stride() != stride:
            y0 = torch.empty_strided(shape, stride, dtype=y0.dtype, device=y0.device).copy_(y0)
        return y0

    def _conv(self, xc: Tensor, wc: Tensor) -> Tensor:
        """The conv of x and the weight in the compute dtype, without bias, in its library layout."""
        if not self.measures_conv:
            return run_conv(xc, wc, None, self.spec)
        if self.conv_plan is None:
            self.conv_plan = conv_alone_plan(xc, wc, self.spec)
        return self.conv_plan(xc, wc)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        if self.conv_alone:
            return self._conv_alone(x, weight)
        y0 = self._conv_output(x, weight)
        launch = self.launches.get(y0.stride())
        if launch is None:  # a layout the plan did not expect (``ChannelsLastLibraryForward`` only)
            launch = self.launches[y0.stride()] = self._plan_launch(y0)
        out, saved_y0, saved_winner = (
            y0 if i == 1 and self.saved_is_y0 else torch.empty_strided(shape, stride, dtype=dtype, device=x.device)
            for i, (shape, stride, dtype) in enumerate(self.layouts)
        )  # (the saved conv output is y0 itself where it can be: nothing allocated for it)
        params, bias = self.params(bias, operands)
        residual = None if self.residual is None else operands[self.residual]
        if self.max_save:
            launch(y0, params, bias, out, saved_winner, saved_y0)
        elif self.kernel_saves_y0:
            launch(y0, params, bias, out, y_copy=saved_y0, residual=residual)
        else:
            if self.relays_y0:
                relayout(y0, saved_y0)
            launch(y0, params, bias, out, residual=residual)
        return out, saved_y0, saved_winner

    def _conv_alone(self, x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The outputs of a region that is a bias-free conv alone: aten's conv, in the fake's layout."""
        xc, wc, _ = cast_inputs(x, weight, None, self.dtype)
        out = self._conv(xc, wc)
        (shape, stride, _), *placeholders = self.layouts
        if out.stride() != stride:
            out = torch.empty_strided(shape, stride, dtype=out.dtype, device=out.device).copy_(out)
        return out, *(torch.empty_strided(*layout[:2], dtype=layout[2], device=x.device) for layout in placeholders)


class ChannelsLastLibraryForward(LibraryForward):
    """``LibraryForward`` with the conv on channels-last tensors whatever x's layout, for 2-d and
    3-d convs of an x that is not channels-last (``channels_last_forward_unsupported``).

    Precision: the conv runs with cuDNN's TF32 off where eager's conv of x and the weight as given runs
    in full fp32 (``conv_precision.forward_tf32``): on channels-last copies cuDNN may pick a TF32
    kernel where eager's layout got a full-fp32 one.

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
    ``plan_for`` measures it per shape.
    """

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvEpilogueConfig, save: bool) -> None:  # fmt: skip
        self.conv_format = channels_last_format(x.dim())
        super().__init__(x, weight, bias, operands, cfg, save)
        precision = conv_precision.forward_tf32(x, weight, cfg.conv, self.dtype)
        self.tf32, self.settled = precision.tf32, precision.settled
        fmt = self.conv_format
        self.x_relayout = planned_relayout(x, torch.empty(x.shape, dtype=self.dtype, device="meta", memory_format=fmt))
        #: None: the weight is used as given (already channels-last in the compute dtype)
        self.weight_relayout = (
            None if weight.dtype == self.dtype and weight.is_contiguous(memory_format=fmt)
            else planned_relayout(weight, torch.empty(weight.shape, dtype=self.dtype, device="meta", memory_format=fmt))
        )  # fmt: skip

    def _conv_output(self, x: Tensor, weight: Tensor) -> Tensor:
        """y0 from the channels-last conv, in the layout the conv gives (channels-last as planned)."""
        if self.weight_relayout is not None:
            weight = self.weight_relayout(weight)
        with conv_precision.cudnn_tf32(self.tf32):
            return run_conv(self.x_relayout(x), weight, None, self.spec)


def _per_channel_operand(steps: Sequence[Any], kind: PointwiseKind, operands: Sequence[Tensor],
                         channels: int) -> int | None:  # fmt: skip
    """The operand index of ``steps``' first step where it is ``kind`` of one per-channel tensor
    (``channels`` values, more than one: a folded eval BatchNorm's scale or shift), else None."""
    if not steps or steps[0].kind != kind or not isinstance(steps[0].operands[0], TensorRef):
        return None
    index = steps[0].operands[0].index
    return index if operands[index].numel() == channels > 1 else None


def _fold_sources(steps: Sequence[Any], operands: Sequence[Tensor], channels: int) -> tuple[int | None, int | None, int]:
    """``(scale, shift, taken)``: the operand indices of ``steps``' leading per-channel ``mul`` and ``add``
    (a folded eval BatchNorm; None where absent) and how many steps they are."""
    scale = _per_channel_operand(steps, PointwiseKind.MUL, operands, channels)
    taken = 0 if scale is None else 1
    shift = _per_channel_operand(steps[taken:], PointwiseKind.ADD, operands, channels)
    return scale, shift, taken + (shift is not None)


def cudnn_fused_unsupported(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
                            save: bool) -> str | None:  # fmt: skip
    """Why cuDNN's fused conv + bias + ReLU (``CudnnFusedForward``) cannot serve this call, or None: an
    inference call (nothing saved) of a direct 2-d or 3-d conv whose chain is a per-channel ``mul`` and
    ``add`` (a folded eval BatchNorm; either or both may be absent), then ``relu``, or with a residual:
    those, the residual's ``add``, then ``relu``; no pool, gate or input norm; the output in the conv's
    dtype (fp32, fp16 or bf16)."""
    if save:
        return "a call that saves for the backward"
    if cfg.conv.transposed or cfg.pool is not None or cfg.gate is not None or cfg.norm_in is not None:
        return "a transposed conv, a pool, a gate or an input norm"
    if x.dim() not in (4, 5):
        return "a 1-d conv"
    dtype = conv_compute_dtype(cfg, x)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"a {dtype} conv"
    if _forward_layouts(x, weight, operands, cfg, save, dtype)[2][0].dtype != dtype:
        return "an output dtype other than the conv's"
    head, tail = (cfg.chain, ()) if cfg.residual is None else residual_parts(cfg)
    if cfg.residual is None:
        head, tail = head[:-1], head[-1:]
    taken = _fold_sources(head, operands, weight.shape[0])[2]
    if taken != len(head) or [step.kind for step in tail] != [PointwiseKind.RELU]:
        return "a chain other than a per-channel scale and shift, (a residual add,) then relu"
    return None


class CudnnFusedForward:
    """cuDNN's fused conv + bias + ReLU for one inference call signature (``cudnn_fused_unsupported``): the
    chain's per-channel scale folded into the weight (``w * scale``, per output channel, in fp32, rounded
    once to the conv's dtype) and its shift with the bias into the conv's bias (``bias * scale + shift``),
    then one ``torch.cudnn_convolution_relu`` (or ``cudnn_convolution_add_relu`` with the residual): the conv
    output is never written unfused.  The fold is one kernel per call (``kernels/weight_fold.py``).  On
    CPU (no cuDNN) the same arithmetic in torch ops (the tests' path).

    Precision: the folded weight is rounded once more than eager's (which rounds the norm's output
    instead); the conv's own precision is cuDNN's, as eager's (TF32 where ``allow_tf32`` says)."""

    #: the same signature always gets this plan
    settled: bool = True

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvEpilogueConfig, save: bool) -> None:  # fmt: skip
        self.dtype = conv_compute_dtype(cfg, x)
        head = cfg.chain if cfg.residual is None else residual_parts(cfg)[0]
        self.scale, self.shift, _ = _fold_sources(head, operands, weight.shape[0])
        self.residual = cfg.residual
        spec = cfg.conv
        self.spec, self.args = spec, (list(spec.stride), list(spec.padding), list(spec.dilation), spec.groups)
        out = _forward_layouts(x, weight, operands, cfg, save, self.dtype)[2][0]
        #: the output's (shape, strides), as the op's fake lays it out
        self.out_layout = (tuple(out.shape), out.stride())
        fmt = channels_last_format(x.dim())
        #: cuDNN's channels-last conv wants both operands so: a channels-last x's weight is copied so per call
        self.weight_format = fmt if (x.is_contiguous(memory_format=fmt)
                                     and not weight.is_contiguous(memory_format=fmt)) else None  # fmt: skip
        folded = weight if self.weight_format is None else weight.contiguous(memory_format=fmt)
        self.fold = fold_plan(folded, *self._fold_operands(operands), bias, self.dtype)

    def _fold_operands(self, operands: Sequence[Tensor]) -> tuple[Tensor | None, Tensor | None]:
        return (None if self.scale is None else operands[self.scale],
                None if self.shift is None else operands[self.shift])  # fmt: skip

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        xc = x if x.dtype == self.dtype else x.to(self.dtype)
        if self.weight_format is not None:
            weight = weight.contiguous(memory_format=self.weight_format)
        w, b = self.fold(weight, *self._fold_operands(operands), bias)
        residual = None if self.residual is None else operands[self.residual].to(self.dtype)
        if x.device.type == "cuda":
            if residual is None:
                out = torch.cudnn_convolution_relu(xc, w, b, *self.args)
            else:
                out = torch.cudnn_convolution_add_relu(xc, w, residual, 1.0, b, *self.args)
        else:
            y = run_conv(xc, w, b, self.spec)
            out = torch.relu(y if residual is None else y + residual)
        shape, stride = self.out_layout
        if out.stride() != stride:
            out = torch.empty_strided(shape, stride, dtype=out.dtype, device=out.device).copy_(out)
        return out, empty_placeholder(x), empty_placeholder(x)  # inference: nothing saved, no pool


def channels_last_forward_unsupported(x: Tensor, weight: Tensor, cfg: ConvEpilogueConfig) -> str | None:
    """Why the library forward has no channels-last variant worth measuring here, or None."""
    dtype = conv_compute_dtype(cfg, x)
    if (why := channels_last_problem(x.dim(), dtype)) is not None:
        return why
    if x.is_contiguous(memory_format=channels_last_format(x.dim())):
        return "x is channels-last already"
    if output_memory_format(_library_conv_meta(x, weight, cfg.conv, dtype)) != torch.contiguous_format:
        return "the library conv runs channels-last already (e.g. a channels-last weight)"
    return None


def family_forward_unsupported(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
                               save: bool) -> str | None:  # fmt: skip
    """Why the conv family's forward (``FamilyForward``) cannot serve this call, or None.

    It serves a direct conv whose bias and chain end the region (no pool), whose chain steps read
    only constants and per-channel or one-value operands (no earlier chain value), with the output
    (and the saved conv output of a call that saves) in the conv's dtype and laid out as the family
    writes it (channels-last dense: a channels-last x).  Cached per signature."""

    def answer() -> str | None:
        from ...kernels.chain_math import MAX_SLOTS

        if cfg.conv.transposed:
            return "a transposed conv"
        if cfg.pool is not None:
            return "a pool after the chain"
        if len(cfg.chain) > MAX_SLOTS:
            return f"a chain of {len(cfg.chain)} steps (the family's epilogue takes {MAX_SLOTS})"
        if any(isinstance(o, ChainValue) for step in cfg.chain for o in step.operands):
            return "a chain step reads an earlier chain value"
        if save and cfg.family_only:
            return ("a residual, a gate or an input norm in a call that saves for the backward (the region's "
                    "backward is the reference's)")
        if cfg.residual is not None:
            act = _family_act_out(residual_parts(cfg)[1])
            if isinstance(act, str):
                return act
        dtype = conv_compute_dtype(cfg, x)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"a {dtype} conv (the family computes in fp32, fp16 or bf16)"
        if cfg.norm_in is not None and x.dtype != dtype:
            return (f"an input norm on x in {x.dtype}, not the conv's {dtype} (the family loads x in the conv's "
                    "dtype; rounding it before the norm would lose what the norm subtracts)")
        out = _forward_layouts(x, weight, operands, cfg, save, dtype)[2][0]
        if out.dtype != dtype:
            return f"the output's dtype {out.dtype} is not the conv's {dtype}"
        if out.dim() not in (4, 5):
            return "a 1-d conv (the family writes 2-d and 3-d channels-last outputs)"
        if not out.is_contiguous(memory_format=channels_last_format(out.dim())):  # size-1 dims' strides aside
            return "the output is not channels-last (the family writes channels-last outputs)"
        return None

    key = ("family_forward", tensor_key(x), tensor_key(weight), tuple(map(tensor_key, operands)), cfg, save)
    return DECISIONS.get(key, answer)


class FamilyForward:
    """The conv kernel family's forward for one call signature (``kernels.conv.conv_fprop``): the conv,
    the bias and the chain in one kernel writing ``out`` channels-last (and the saved conv output in
    a call that saves), for the calls ``family_forward_unsupported`` lets through.  A call casts as
    the library path does, lowers the chain (``kernel_steps``) and launches the signature's plan,
    kept from the first call (``fprop_plan``; its tile timed once: ``kernels.conv.tiles``).

    A chain that opens with a per-channel ``mul`` (and then ``add``) on a conv without a bias, as a
    folded eval BatchNorm does, hands those operands to the kernel's ``scale`` and ``bias`` (same
    arithmetic, in fp32: ``acc * scale + shift``): no operand matrix is built per call.  Precision:
    fp32 dots in TF32 only where eager's conv of x and the weight is (``conv_precision``); the chain
    runs on the fp32 accumulator and rounds once, at the store."""

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvEpilogueConfig, save: bool) -> None:  # fmt: skip
        self.dtype = conv_compute_dtype(cfg, x)
        precision = conv_precision.forward_tf32(x, weight, cfg.conv, self.dtype)
        self.tf32, self.settled = precision.tf32, precision.settled
        self.ndim, self.channels = x.dim(), weight.shape[0]  # the output's (a direct conv)
        steps, tail = (list(cfg.chain), ()) if cfg.residual is None else map(list, residual_parts(cfg))
        #: the store's activation after the residual add (``act_out``), and the residual's operand index
        self.act_out, self.residual = (None if cfg.residual is None else _family_act_out(tail)), cfg.residual
        self.gate = cfg.gate  #: the operand the prologue multiplies x by, per sample and channel
        #: the input norm's group count and eps (its affine: ``reference.input_norm_affine``) and activation
        self.cfg, self.norm_in, self.norm_eps = cfg, cfg.norm_in, cfg.norm_in_eps
        from ...kernels.conv.hooks import Activation

        self.act_in = None if not cfg.act_in else Activation(*family_activation(cfg.act_in[0]))
        #: the statistics pass's (unused) operand matrix: no bias or pre-chain before the input norm
        self.no_params = None if cfg.norm_in is None else torch.zeros((2, x.shape[1]), device=x.device)
        #: the operands the kernel reads as its per-channel scale and bias (None: not so)
        self.scale_source = self.shift_source = None
        if bias is None and self._leading(steps, PointwiseKind.MUL, operands):
            self.scale_source = steps.pop(0).operands[0].index
            if self._leading(steps, PointwiseKind.ADD, operands):
                self.shift_source = steps.pop(0).operands[0].index
        self.chain = tuple(steps)
        y0 = _forward_layouts(x, weight, operands, cfg, save, self.dtype)[2][1] if save else None
        #: the saved conv output's (shape, strides) in a call that saves (as the library path lays it out)
        self.saved = None if y0 is None else (tuple(y0.shape), y0.stride())
        #: the family's launch for this signature (``fprop_plan``), kept from the first call on
        self.launch = None
        spec = cfg.conv
        self.conv_args = dict(stride=spec.stride, padding=spec.padding, dilation=spec.dilation, groups=spec.groups)

    def _leading(self, steps: Sequence[Any], kind: PointwiseKind, operands: Sequence[Tensor]) -> bool:
        """Whether ``steps`` opens with ``kind`` of one per-channel tensor (fp32 or the compute dtype)."""
        index = _per_channel_operand(steps, kind, operands, self.channels)
        return index is not None and operands[index].dtype in (torch.float32, self.dtype)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        xc, wc, bc = cast_inputs(x, weight, bias, self.dtype)
        scale = None if self.scale_source is None else operands[self.scale_source].reshape(-1).contiguous()
        if self.shift_source is not None:
            bc = operands[self.shift_source].reshape(-1).contiguous()
        steps = kernel_steps(self.chain, operands, self.ndim, self.channels)
        saved = None if self.saved is None else torch.empty_strided(*self.saved, dtype=self.dtype, device=x.device)
        residual = prologue = None
        if self.residual is not None:  # the output's dtype and channels-last layout (a copy where not so)
            residual = operands[self.residual].to(self.dtype).contiguous(memory_format=channels_last_format(self.ndim))
        if self.gate is not None:  # fp32 (N, C_in), as the prologue reads it
            from ...kernels.conv.hooks import SampleChannelScale

            gate = operands[self.gate]
            prologue = SampleChannelScale(gate.reshape(gate.shape[0], gate.shape[1]).float().contiguous())
        elif self.norm_in is not None:
            prologue = self._input_norm(xc, operands)
        launch = self.launch
        if launch is None:
            from ...kernels.conv import fprop_plan  # lazily: TRITON_INTERPRET is read at import

            launch = fprop_plan(xc, wc, bc, scale=scale, chain=steps, saved=saved, allow_tf32=self.tf32,
                                act_out=self.act_out, residual=residual, prologue=prologue, act_in=self.act_in,
                                **self.conv_args)
            self.launch = launch if launch.final else None
        out, _ = launch(xc, wc, scale, bc, steps, residual, prologue, saved)
        return out, empty_placeholder(x) if saved is None else saved, empty_placeholder(x)  # no pool: no winners

    def _input_norm(self, x: Tensor, operands: Sequence[Tensor]) -> Any:
        """The input group norm as the prologue's ``GroupAffine``: x's statistics per sample and group
        (``kernels.group_norm.group_norm_stats``, fp32, a fixed-order reduction), as ``scale = rstd``
        and ``shift = -mean * rstd``, with the norm's affine in fp32."""
        from ...kernels.conv.hooks import GroupAffine
        from ...kernels.group_norm import group_norm_stats

        stats = torch.empty((2, x.shape[0], self.norm_in), dtype=torch.float32, device=x.device)
        group_norm_stats(x, False, (), self.norm_in, self.norm_eps, self.no_params, stats)
        shift = stats[0].mul(stats[1]).neg_()
        weight, bias = (None if t is None else t.reshape(-1).contiguous() for t in input_norm_affine(operands, self.cfg))
        return GroupAffine(stats[1], shift, weight, bias)
