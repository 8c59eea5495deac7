"""Time the conv family's kernels (``fusion_backend/kernels/conv/``) against cuDNN on every distinct conv
of real networks, plain and with the hooks that replace the passes around a conv.

    python tools/bench_conv.py --list                        # the distinct convs, no timing (CPU too)
    python tools/bench_conv.py --out /tmp/conv-bench         # all of them, bf16, three passes
    python tools/bench_conv.py demos/realnets/resnet50.py --passes fprop --max-shapes 4 --out DIR
    python tools/bench_conv.py --shard 1/3 --out DIR --append   # a third of the shapes, merged into DIR
    python tools/bench_conv.py --docs-out                    # write docs/perf/h200/conv-kernels/

Shapes (``conv_shapes``): each model file given (default :data:`DEFAULT_MODELS`: ResNet-50,
EfficientNet-B0, the SD VAE decoder, R3D-18 and the ``seeds`` suite) is built as the benchmark builds it
and run once with a hook on every conv module; the distinct ``(x, weight, stride, padding, dilation,
groups, bias)`` problems at the files' batch sizes are the rows.  A model whose library is missing is
skipped with one line; transposed convs are listed, not timed.

Per shape, dtype (``--dtype``, default bf16) and pass (``--passes``): one interleaved measurement of

* ``kernel``: the family's launcher (``conv_fprop`` / ``conv_dgrad`` / ``conv_wgrad``) without hooks;
* ``cudnn``: ``torch.ops.aten.convolution`` / ``convolution_backward`` for the same pass, same
  channels-last tensors and dtype (fp32: TF32 as ``torch.backends.cudnn.allow_tf32`` says, for both);
* ``hooked``: the launcher with the pass's hooks (``conv_bench_report.HOOKS``): fprop reads
  ``relu(x * scale + shift)`` (a folded BatchNorm) and writes the per-channel sums of its output
  (``--fprop-hooks stats``: the sums alone, against the conv and the statistics pass; ``bn-relu``:
  the prologue alone, against the prologue pass and the conv: the two costs of the hooked forward
  apart; ``gn-silu``: a GroupNorm + SiLU prologue alone, against Inductor's pass and the conv); dgrad
  multiplies by relu' of the forward's normalised input and writes the BatchNorm-backward sums; wgrad
  recomputes the forward's prologue while loading ``x``;
* ``unfused``: what Inductor runs instead of the hooks: cuDNN and, compiled with ``torch.compile(...,
  backend="inductor")`` once per shape, the passes they replace: fprop: the scale/shift/relu pass before
  the conv and the statistics reduction after it; dgrad: relu' and the two sums after cuDNN's dgrad;
  wgrad: the pass materialising the normalised input before cuDNN's wgrad.

Timing (:class:`GpuTimer`): GPU time per call, each step's calls queued behind a GPU spin so that the
host's launch cost (tens of microseconds of Python and dispatch per call, more than many of these
convs take on the GPU at batch 64) stays out of it, as under CUDA graphs; L2 warm.  The four steps
interleaved, ``--rounds`` rounds; each step's time is the median of its rounds.
Before timing, every step runs once (compiles) and its result is checked against cuDNN's (plain) or
the unfused path's (hooked): the worst relative error over its outputs within the dtype's
:data:`TOLERANCE`, else the row is a MISMATCH; that first call's tile choice (``tiles.recording_choices``)
is the row's ``tile`` and ``tile_ms``.  Output: a table on stdout; with ``--out DIR``,
``DIR/bench.json`` and ``DIR/bench.md`` (``conv_bench_report``); ``--append`` merges into an
existing ``bench.json`` (a sharded run).  ``--profile``: each row also lists the kernels of its two steps
and their microseconds per call (``torch.profiler``; where a pass's time goes: its kernel, the split sum,
a relayout, a statistics combine).  Needs CUDA except with ``--list``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import statistics
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from conv_bench_report import (  # noqa: E402
    HOOKS,
    PASSES,
    Row,
    merge_rows,
    read_rows,
    rows_table,
    summary_table,
    write_reports,
)
from conv_shapes import Collection, ConvShape, collect  # noqa: E402

from fusion_backend.bench.measure import TimedStep, Timer  # noqa: E402
from fusion_backend.bench.suite import SuiteError  # noqa: E402
from fusion_backend.kernels.conv.tiles import TileChoice, recording_choices  # noqa: E402

DEFAULT_MODELS = (
    "demos/realnets/resnet50.py",
    "demos/realnets/efficientnet_b0.py",
    "demos/realnets/sd_vae_decoder.py",
    "demos/realnets/r3d_18.py",
    "demos/seeds",
)
DOCS_OUT = ROOT / "docs/perf/h200/conv-kernels"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Worst relative error a result may have against the reference (fp32: TF32 on both sides).
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 5e-3}
STEPS = ("kernel", "cudnn", "hooked", "unfused")


# --------------------------------------------------------------------------------------------------
# Model files and shapes
# --------------------------------------------------------------------------------------------------


def model_files(entries: Sequence[str]) -> list[Path]:
    """The ``.py`` model files of ``entries`` (files, or folders: their ``*.py`` not starting with ``_``),
    relative entries resolved against the repository; ``SuiteError`` for one that does not exist."""
    files: list[Path] = []
    for entry in entries:
        path = Path(entry)
        if not path.exists() and not path.is_absolute():
            path = ROOT / entry
        if path.is_dir():
            files += sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
        elif path.is_file():
            files.append(path)
        else:
            raise SuiteError(f"model file or folder {entry} does not exist")
    return list(dict.fromkeys(files))


def select(collection: Collection, patterns: str | None, shard: tuple[int, int] | None,
           max_shapes: int | None) -> list[ConvShape]:  # fmt: skip
    """The shapes to time, in order of first appearance: those matching any comma-separated pattern
    (against the shape's label and its models' names; glob with ``*?[``, else substring), then shard
    ``k`` of ``n`` (every n-th shape from the k-th: shards take similar mixes), then the first
    ``max_shapes``."""
    shapes = list(collection.shapes)
    if patterns:
        pats = [p.strip() for p in patterns.split(",") if p.strip()]

        def hit(text: str, pat: str) -> bool:
            return fnmatch.fnmatch(text, pat) if any(c in pat for c in "*?[") else pat in text

        shapes = [s for s in shapes if any(hit(t, p) for p in pats for t in [s.label(), *collection.shapes[s]])]
    if shard is not None:
        k, n = shard
        shapes = shapes[k - 1 :: n]
    return shapes[:max_shapes] if max_shapes else shapes


def listing(collection: Collection, shapes: Sequence[ConvShape]) -> str:
    """``--list``'s text: one line per shape (its label, GMACs, the models with their counts), then the
    skipped models, the notes and the transposed convs."""
    lines = [f"{len(shapes)} distinct convs"]
    for s in shapes:
        counts = {m: collection.shapes[s].count(m) for m in collection.models_of(s)}
        where = ", ".join(f"{m} x{c}" if c > 1 else m for m, c in counts.items())
        lines.append(f"  {s.label():60s} {s.macs / 1e9:8.2f} GMAC  {where}")
    lines += [f"skipped {m}: {why}" for m, why in collection.skipped]
    lines += [f"note {m}: {note}" for m, note in collection.notes]
    lines += [f"transposed (not timed) {m}: {t}" for m, t in collection.transposed]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Cases: what one (shape, dtype, pass) runs
# --------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One (shape, dtype, pass): its ``steps`` (names of :data:`STEPS` -> a callable returning its
    result) and its ``checks`` (``"plain"`` / ``"hooked"`` -> a callable of the steps' results returning
    the worst relative error).  A step or check may be missing (a pass without hooks)."""

    shape: ConvShape
    models: list[str]
    dtype: str
    op: str
    steps: dict[str, Callable[[], Any]]
    checks: dict[str, Callable[[dict[str, Any]], float]] = field(default_factory=dict)
    #: what the hooked row fuses (``HOOKS[op]``, or the forward's :data:`FPROP_HOOKS` entry)
    hooks: str = ""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error ``|out - ref| / |ref|`` in float64 (0 for two zero tensors)."""
    d = (out.double() - ref.double()).norm().item()
    r = ref.double().norm().item()
    return d / r if r else (0.0 if d == 0 else float("inf"))


def sums_err(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """Error of per-channel sums against the reference's, relative to the sums of magnitudes ``scale``
    (a sum near zero by cancellation has no relative error of its own)."""
    return ((out.double() - ref.double()).abs().max() / scale.double().abs().max().clamp_min(1e-30)).item()


def _channel_dims(t: torch.Tensor) -> list[int]:
    return [0, *range(2, t.dim())]


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (like.dim() - 2)))


def norm_relu(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``relu(x * scale + shift)`` in fp32, rounded to x's dtype: the prologue as a separate pass."""
    return torch.relu(x.float() * _per_channel(scale, x) + _per_channel(shift, x)).to(x.dtype)


def group_norm_silu(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``silu((x * scale[n, g] + shift[n, g]) * weight + bias)`` in fp32, rounded to x's dtype: a
    GroupNorm's normalisation (per (sample, group) ``scale`` and ``shift`` of shape ``(N, G)``), its affine
    and SiLU as a separate pass (the family's reference of the prologue, ``reference.apply_prologue``)."""
    from fusion_backend.kernels.conv import GroupAffine
    from fusion_backend.kernels.conv.reference import apply_prologue

    v = apply_prologue(x.float(), GroupAffine(scale, shift, weight, bias), torch.float32)
    return torch.nn.functional.silu(v).to(x.dtype)


def channel_sums(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``Σ y`` and ``Σ y²`` in fp32: the statistics pass after a conv."""
    y32 = y.float()
    dims = _channel_dims(y)
    return y32.sum(dims), (y32 * y32).sum(dims)


def relu_bn_backward(grad_a: torch.Tensor, x_prev: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                     mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``grad_z = grad_a * relu'(x_prev * scale + shift)`` in grad_a's dtype and the BatchNorm-backward
    sums ``Σ grad_z`` and ``Σ grad_z · x̂`` (``x̂ = (x_prev - mean) * rstd``): the passes after a dgrad."""
    x32 = x_prev.float()
    z = x32 * _per_channel(scale, x_prev) + _per_channel(shift, x_prev)
    grad_z = torch.where(z > 0, grad_a.float(), 0.0).to(grad_a.dtype)
    g32 = grad_z.float()
    xhat = (x32 - _per_channel(mean, x_prev)) * _per_channel(rstd, x_prev)
    dims = _channel_dims(grad_a)
    return grad_z, g32.sum(dims), (g32 * xhat).sum(dims)


def _inductor(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by Inductor for the shapes it first sees (a fresh compile per shape)."""
    return torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True)


def _allow_many_recompiles() -> None:
    """Every shape recompiles the same three functions: lift Dynamo's recompile limits (past them it
    would silently run them eagerly)."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1 << 20)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    from fusion_backend.kernels.conv.fprop import to_channels_last

    return to_channels_last(t)


@dataclass
class _Inputs:
    """The tensors and arguments one shape's cases share: random (seed 0), channels-last ``x``,
    ``weight``, ``bias``, the output gradient ``dy``; a folded BatchNorm (``scale``, ``shift``) and the
    statistics it normalised with (``mean``, ``rstd``); a GroupNorm's per-(sample, group) ``g_scale`` and
    ``g_shift`` (32 groups where the channels divide, else one) with its affine (``scale``, ``shift``
    again); the launchers' keyword arguments ``geo``, aten's positional ``conv_args``, and the
    Inductor-compiled prologue passes."""

    shape: ConvShape
    x: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor | None
    dy: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor
    mean: torch.Tensor
    rstd: torch.Tensor
    geo: dict[str, Any]
    conv_args: tuple[Any, ...]
    prologue_pass: Callable[..., torch.Tensor]
    g_scale: torch.Tensor
    g_shift: torch.Tensor
    group_prologue_pass: Callable[..., torch.Tensor]

    @classmethod
    def make(cls, shape: ConvShape, dtype: torch.dtype, device: torch.device) -> _Inputs:
        gen = torch.Generator(device="cpu").manual_seed(0)

        def rand(*size: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
            return (torch.randn(size, generator=gen) * scale + shift).to(device)

        c_in, c_out = shape.x_shape[1], shape.w_shape[0]
        groups = 32 if c_in % 32 == 0 else 1
        return cls(
            shape=shape,
            x=_channels_last(rand(*shape.x_shape).to(dtype)),
            w=_channels_last(rand(*shape.w_shape, scale=math.prod(shape.w_shape[1:]) ** -0.5).to(dtype)),
            b=rand(c_out).to(dtype) if shape.bias else None,
            dy=_channels_last(rand(*shape.out_shape).to(dtype)),
            scale=rand(c_in, scale=0.1, shift=1.0), shift=rand(c_in, scale=0.1),
            mean=rand(c_in, scale=0.1), rstd=rand(c_in, scale=0.1, shift=1.0),
            geo=dict(stride=shape.stride, padding=shape.padding, dilation=shape.dilation, groups=shape.groups),
            conv_args=(list(shape.stride), list(shape.padding), list(shape.dilation), False, [0] * shape.dims,
                       shape.groups),
            prologue_pass=_inductor(norm_relu),
            g_scale=rand(shape.x_shape[0], groups, scale=0.1, shift=1.0),
            g_shift=rand(shape.x_shape[0], groups, scale=0.1), group_prologue_pass=_inductor(group_norm_silu),
        )  # fmt: skip

    def prologue(self) -> Any:
        from fusion_backend.kernels.conv import ChannelAffine

        return ChannelAffine(self.scale, self.shift)

    def fprop_prologue(self, kind: str) -> tuple[Any, str, Callable[[], torch.Tensor]]:
        """The forward's prologue of ``kind`` (``bn-relu``: a folded BatchNorm and ReLU; ``gn-silu``: a
        GroupNorm with its affine and SiLU): ``(prologue, act_in, the pass it replaces on x)``."""
        from fusion_backend.kernels.conv import GroupAffine

        if kind == "gn-silu":
            return (GroupAffine(self.g_scale, self.g_shift, self.scale, self.shift), "silu",
                    lambda: self.group_prologue_pass(self.x, self.g_scale, self.g_shift, self.scale, self.shift))
        return self.prologue(), "relu", lambda: self.prologue_pass(self.x, self.scale, self.shift)

    def cudnn_dgrad(self) -> torch.Tensor:
        return torch.ops.aten.convolution_backward(self.dy, self.x, self.w, None, *self.conv_args,
                                                   [True, False, False])[0]  # fmt: skip

    def cudnn_wgrad(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = self.shape
        bias_sizes = [s.w_shape[0]] if s.bias else None
        out = torch.ops.aten.convolution_backward(self.dy, x, self.w, bias_sizes, *self.conv_args, [False, True, s.bias])
        return out[1], out[2]


Steps = dict[str, Callable[[], Any]]
Checks = dict[str, Callable[[dict[str, Any]], float]]


#: The forward's hooked row under ``--fprop-hooks``: the BatchNorm + ReLU prologue and the next
#: BatchNorm's statistics (the default), the statistics alone (what ``fusion::conv_batch_norm``'s forward
#: takes from the family, ``ops/conv_batch_norm/statistics.py``), the prologue alone, or a GroupNorm +
#: SiLU prologue alone (the SD VAE decoder's residual blocks): its ``hooks`` label and the parts (the
#: prologue's kind, "" for none; statistics) it fuses.
FPROP_HOOKS = {
    "bn-relu-stats": (HOOKS["fprop"], "bn-relu", True),
    "stats": ("epilogue stats", "", True),
    "bn-relu": ("prologue bn+relu", "bn-relu", False),
    "gn-silu": ("prologue gn+silu", "gn-silu", False),
}
STATS_HOOKS = FPROP_HOOKS["stats"][0]


def fprop_case(t: _Inputs, hooked: bool, tile: Any = None, prologue_part: str = "bn-relu",
               stats_part: bool = True) -> tuple[Steps, Checks]:  # fmt: skip
    """The forward: plain against ``aten.convolution``; hooked (the prologue of kind ``prologue_part``,
    :meth:`_Inputs.fprop_prologue`, and the epilogue statistics) against the prologue pass, the conv and
    the statistics pass; with ``prologue_part`` "" the statistics alone against the conv and the
    statistics pass, without ``stats_part`` the prologue alone against the prologue pass and the conv.
    ``tile``: the kernel's (None: its tuned choice), as for every case builder."""
    from fusion_backend.kernels.conv import conv_fprop

    aten = torch.ops.aten
    steps: Steps = {"kernel": lambda: conv_fprop(t.x, t.w, t.b, tile=tile, **t.geo)[0],
                    "cudnn": lambda: aten.convolution(t.x, t.w, t.b, *t.conv_args)}  # fmt: skip
    checks: Checks = {"plain": lambda r: rel_err(r["kernel"], r["cudnn"])}
    if not hooked:
        return steps, checks
    stats_pass = _inductor(channel_sums)
    prologue, act_in, prologue_pass = t.fprop_prologue(prologue_part) if prologue_part else (None, None, None)

    def unfused() -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        x = prologue_pass() if prologue_pass else t.x
        y = aten.convolution(x, t.w, t.b, *t.conv_args)
        return y, stats_pass(y) if stats_part else None

    def check(r: dict[str, Any]) -> float:
        (y, st), (y_ref, sums) = r["hooked"], r["unfused"]
        if sums is None:
            return rel_err(y, y_ref)
        s_ref, sq_ref = sums
        magnitude = y_ref.float().abs().sum(_channel_dims(y_ref))
        return max(rel_err(y, y_ref), sums_err(st.sum, s_ref, magnitude), rel_err(st.sum_sq(), sq_ref))

    steps["hooked"] = lambda: conv_fprop(t.x, t.w, t.b, prologue=prologue, act_in=act_in, stats=stats_part, tile=tile,
                                         **t.geo)  # fmt: skip
    steps["unfused"] = unfused
    checks["hooked"] = check
    return steps, checks


def dgrad_case(t: _Inputs, hooked: bool, tile: Any = None) -> tuple[Steps, Checks]:
    """The input gradient: plain against cuDNN's; hooked (relu' of the forward's normalised input and the
    BatchNorm-backward sums) against cuDNN's and the relu'/sums pass."""
    from fusion_backend.kernels.conv import NormStats, conv_dgrad

    size = t.shape.x_shape
    steps: Steps = {"kernel": lambda: conv_dgrad(t.dy, t.w, size, tile=tile, **t.geo)[0], "cudnn": t.cudnn_dgrad}
    checks: Checks = {"plain": lambda r: rel_err(r["kernel"], r["cudnn"])}
    if not hooked:
        return steps, checks
    bwd_pass = _inductor(relu_bn_backward)
    prologue, norm_stats = t.prologue(), NormStats(t.mean, t.rstd)

    def check(r: dict[str, Any]) -> float:
        (gz, sums), (gz_ref, s_ref, sx_ref) = r["hooked"], r["unfused"]
        g = gz_ref.float().abs()
        dims = _channel_dims(g)
        xhat = ((t.x.float() - _per_channel(t.mean, t.x)) * _per_channel(t.rstd, t.x)).abs()
        return max(rel_err(gz, gz_ref), sums_err(sums.sum_dz, s_ref, g.sum(dims)),
                   sums_err(sums.sum_dz_xhat, sx_ref, (g * xhat).sum(dims)))  # fmt: skip

    steps["hooked"] = lambda: conv_dgrad(t.dy, t.w, size, x_prev=t.x, prologue=prologue, act_in="relu",
                                         norm_stats=norm_stats, tile=tile, **t.geo)  # fmt: skip
    steps["unfused"] = lambda: bwd_pass(t.cudnn_dgrad(), t.x, t.scale, t.shift, t.mean, t.rstd)
    checks["hooked"] = check
    return steps, checks


def _grads_err(out: Sequence[Any], ref: Sequence[Any]) -> float:
    return max(rel_err(o, r) for o, r in zip(out, ref, strict=True) if r is not None)


def wgrad_case(t: _Inputs, hooked: bool, tile: Any = None) -> tuple[Steps, Checks]:
    """The weight (and bias) gradient: plain against cuDNN's; hooked (the prologue recomputed on load)
    against the pass materialising the normalised input and cuDNN's wgrad on it."""
    from fusion_backend.kernels.conv import conv_wgrad

    bias = t.shape.bias
    steps: Steps = {"kernel": lambda: conv_wgrad(t.dy, t.x, t.w, bias_grad=bias, tile=tile, **t.geo),
                    "cudnn": lambda: t.cudnn_wgrad(t.x)}  # fmt: skip
    checks: Checks = {"plain": lambda r: _grads_err(r["kernel"], r["cudnn"])}
    if not hooked:
        return steps, checks
    prologue = t.prologue()
    steps["hooked"] = lambda: conv_wgrad(t.dy, t.x, t.w, prologue=prologue, act_in="relu", bias_grad=bias, tile=tile,
                                         **t.geo)  # fmt: skip
    steps["unfused"] = lambda: t.cudnn_wgrad(t.prologue_pass(t.x, t.scale, t.shift))
    checks["hooked"] = lambda r: _grads_err(r["hooked"], r["unfused"])
    return steps, checks


CASE_BUILDERS = {"fprop": fprop_case, "dgrad": dgrad_case, "wgrad": wgrad_case}


def build_cases(shape: ConvShape, models: list[str], dtype: str, passes: Sequence[str], hooked: bool,
                device: torch.device, fprop_hooks: str = "bn-relu-stats") -> list[Case]:  # fmt: skip
    """The cases of one shape and dtype, one per pass of ``passes`` (module docstring), on ``device``,
    sharing one set of inputs; ``fprop_hooks``: what the forward's hooked row fuses (a key of
    :data:`FPROP_HOOKS`, ``--fprop-hooks``)."""
    unknown = [p for p in passes if p not in CASE_BUILDERS]
    if unknown:
        raise ValueError(f"unknown pass {', '.join(unknown)}; choose from {', '.join(PASSES)}")
    inputs = _Inputs.make(shape, DTYPES[dtype], device)
    cases = []
    for op in passes:
        label, *built = pass_case(inputs, op, hooked, fprop_hooks=fprop_hooks)
        cases.append(Case(shape, models, dtype, op, *built, hooks=label))
    return cases


def pass_case(t: _Inputs, op: str, hooked: bool, tile: Any = None,
              fprop_hooks: str = "bn-relu-stats") -> tuple[str, Steps, Checks]:  # fmt: skip
    """Pass ``op``'s hooked row's label, steps and checks on inputs ``t`` (:data:`CASE_BUILDERS`; the
    forward's hooks ``fprop_hooks``, a key of :data:`FPROP_HOOKS`); ``tile``: the kernel's (None: its
    tuned choice)."""
    if op == "fprop":
        label, with_prologue, with_stats = FPROP_HOOKS[fprop_hooks]
        return label, *fprop_case(t, hooked, tile, prologue_part=with_prologue, stats_part=with_stats)
    return HOOKS[op], *CASE_BUILDERS[op](t, hooked, tile)


# --------------------------------------------------------------------------------------------------
# Measuring a case
# --------------------------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def kernel_times(fn: Callable[[], Any], calls: int = 5) -> dict[str, float]:
    """Each GPU kernel's microseconds per call of ``fn`` over ``calls`` calls (``torch.profiler``, after
    the timing has compiled and warmed it), slowest first; kernel names cut at 80 characters."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:80]
            total[name] = total.get(name, 0.0) + event.device_time / calls
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def measure_case(case: Case, timer: Timer, rounds: int, verbose: bool = False,
                 profiler: Callable[[Callable[[], Any]], dict[str, float]] | None = None) -> list[Row]:  # fmt: skip
    """Run every step of ``case`` once (compiling), check the results, time the steps that ran with
    ``timer`` (interleaved, ``rounds`` rounds, each step's median of round medians) and return its
    plain row and, where it has hooks, its hooked row; ``profiler`` (``--profile``: :func:`kernel_times`)
    also lists each step's kernels."""
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    chosen: dict[str, TileChoice] = {}
    for name, fn in case.steps.items():
        try:
            with recording_choices() as choices:
                results[name] = fn()
            mine = [c for c in choices if c.pass_name == case.op]
            if mine:  # the pass's own kernel's (a step may ask for other passes' tiles too)
                chosen[name] = mine[-1]
        except Exception as exc:  # one failing step must not stop the table
            errors[name] = _one_line(exc)
            if verbose:
                traceback.print_exc()
    checked: dict[str, float | str] = {}
    for which, check in case.checks.items():
        pair = ("kernel", "cudnn") if which == "plain" else ("hooked", "unfused")
        if all(p in results for p in pair):
            try:
                checked[which] = check(results)
            except Exception as exc:
                checked[which] = f"check failed: {_one_line(exc)}"
    results.clear()  # the outputs are not kept alive while timing
    names = [n for n in case.steps if n not in errors]
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        steps = [TimedStep(n, case.steps[n]) for n in names if n not in errors]
        for step, stats in zip(steps, timer.time(steps, cold=False), strict=True):
            if isinstance(stats, Exception):
                errors[step.name] = _one_line(stats)
            else:
                samples[step.name].append(stats.median_ms)
    ms = {n: statistics.median(v) for n, v in samples.items() if v and n not in errors}
    kernels: dict[str, dict[str, float]] = {}
    for name in ms if profiler is not None else ():
        try:
            kernels[name] = profiler(case.steps[name])
        except Exception as exc:  # noqa: BLE001 - the profile is an extra: the row keeps its times
            kernels[name] = {f"profile failed: {_one_line(exc)}": math.nan}
    tol = TOLERANCE[case.dtype]
    rows = []
    for which, kernel, hooks in (("plain", "kernel", "none"), ("hooked", "hooked", case.hooks or HOOKS[case.op])):
        if kernel not in case.steps:
            continue
        other = "cudnn" if which == "plain" else "unfused"
        err = checked.get(which)
        failures = [f"{n}: {errors[n]}" for n in (kernel, other, "cudnn") if n in errors]
        if isinstance(err, str):
            failures.append(err)
        rel = err if isinstance(err, float) else None
        rows.append(Row(
            op=case.op, shape=case.shape.label(), params=case.shape.params(), models=case.models,
            dtype=case.dtype, hooks=hooks, ms=ms.get(kernel), cudnn_ms=ms.get("cudnn"),
            unfused_ms=ms.get("unfused") if which == "hooked" else None,
            ok=None if rel is None else bool(rel <= tol), rel_err=rel, tolerance=tol,
            error="; ".join(dict.fromkeys(failures)) or None,
            round_medians_ms={n: samples[n] for n in (kernel, other) if n in samples},
            tile=chosen[kernel].tile.label() if kernel in chosen else None,
            tile_ms=dict(zip((t.label() for t in chosen[kernel].tiles), chosen[kernel].ms, strict=False))
            if kernel in chosen else {},
            kernels={n: kernels[n] for n in (kernel, other) if n in kernels},
        ))  # fmt: skip
    return rows


@dataclass
class _GpuStats:
    median_ms: float


class GpuTimer:
    """A ``Timer`` of GPU time per call (``impl_choice.gpu_ms_per_call``: the best of a few rounds of
    back-to-back calls queued behind a GPU spin, so the host's speed is not measured)."""

    def time(self, steps: Sequence[Any], cold: bool = False) -> list[Any]:
        from fusion_backend.impl_choice import gpu_ms_per_call

        out: list[Any] = []
        for step in steps:
            try:
                out.append(_GpuStats(gpu_ms_per_call(step.run)))
            except Exception as exc:  # noqa: BLE001 - reported per step
                out.append(exc)
        return out


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes K/N (e.g. 1/3), got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _choices(name: str, allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise argparse.ArgumentTypeError(f"{name} takes a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(values))

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="model files or folders (default: the realnets and seeds above)")
    parser.add_argument("--list", action="store_true", help="print the distinct convs and exit (no timing)")
    parser.add_argument("--dtype", type=_choices("--dtype", tuple(DTYPES)), default=["bf16"], help="bf16,fp16,fp32")
    parser.add_argument("--passes", type=_choices("--passes", PASSES), default=list(PASSES), help="fprop,dgrad,wgrad")
    parser.add_argument("--filter", default=None, help="comma-separated patterns on shape labels and model names")
    parser.add_argument("--max-shapes", type=_positive, default=None, help="time at most this many shapes")
    parser.add_argument("--shard", type=_shard, default=None, help="K/N: every N-th shape from the K-th")
    parser.add_argument("--no-hooks", action="store_true", help="time the plain passes only")
    parser.add_argument("--fprop-hooks", choices=tuple(FPROP_HOOKS), default="bn-relu-stats",
                        help="the forward's hooked row: the BatchNorm + ReLU prologue and the statistics "
                             "(default), the statistics alone (conv_batch_norm's forward), or the prologue alone")
    parser.add_argument("--rounds", type=_positive, default=3, help="interleaved rounds per case (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="write bench.json and bench.md into this folder")
    parser.add_argument("--docs-out", action="store_true", help=f"write them into {DOCS_OUT.relative_to(ROOT)}/")
    parser.add_argument("--append", action="store_true", help="merge into the folder's existing bench.json")
    parser.add_argument("--profile", action="store_true",
                        help="also list each step's GPU kernels and their microseconds per call (torch.profiler)")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failing steps")
    args = parser.parse_args(argv)
    if args.out is not None and args.docs_out:
        parser.error("--out and --docs-out name two folders; give one")
    if args.docs_out:
        args.out = DOCS_OUT
    if args.append and args.out is None:
        parser.error("--append needs --out DIR or --docs-out")
    return args


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device: torch.device, argv: Sequence[str]) -> dict[str, Any]:
    """``fusion_backend.bench.env.collect_environment`` with this tool's command, and the commit read by
    ``git`` where the checkout's ``.git`` is not a folder (a worktree)."""
    from fusion_backend.bench.env import collect_environment

    env = collect_environment(device, list(argv), command_prefix="python tools/bench_conv.py")
    env["git_commit"] = env.get("git_commit") or _commit()
    return env


def main(argv: Sequence[str] | None = None, timer: Timer | None = None) -> int:
    """The CLI; ``timer`` replaces the CUDA timer (tests)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        collection = collect(model_files(args.models or DEFAULT_MODELS))
    except SuiteError as exc:
        print(f"bench_conv.py: error: {exc}", file=sys.stderr)
        return 2
    shapes = select(collection, args.filter, args.shard, args.max_shapes)
    if args.list:
        print(listing(collection, shapes))
        return 0
    if timer is None and not torch.cuda.is_available():
        print("bench_conv.py: no CUDA device: nothing to time (--list works without one)", file=sys.stderr)
        return 1
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    timer = timer or GpuTimer()
    _allow_many_recompiles()
    notes = [f"skipped {m}: {why}" for m, why in collection.skipped]
    notes += [f"{m}: {note}" for m, note in collection.notes]
    notes += [f"transposed conv of {m}, not timed: {t}" for m, t in dict.fromkeys(collection.transposed)]
    print(f"{len(shapes)} shapes x {len(args.dtype)} dtypes x {len(args.passes)} passes", flush=True)
    rows: list[Row] = []
    for i, shape in enumerate(shapes, 1):
        for dtype in args.dtype:
            try:
                cases = build_cases(shape, collection.models_of(shape), dtype, args.passes, not args.no_hooks, device,
                                    args.fprop_hooks)  # fmt: skip
            except Exception as exc:  # the shape's inputs could not be built (memory): go on
                print(f"[{i}/{len(shapes)}] {shape.label()} {dtype}: {_one_line(exc)}", flush=True)
                continue
            for case in cases:
                new = measure_case(case, timer, args.rounds, args.verbose, kernel_times if args.profile else None)
                rows += new
                for r in new:
                    status = r.error or ("ok" if r.ok else "MISMATCH" if r.ok is False else "-")
                    print(f"[{i}/{len(shapes)}] {r.op} {dtype} {r.shape} [{r.hooks}] ms {r.ms} cudnn {r.cudnn_ms} "
                          f"unfused {r.unfused_ms} {status}", flush=True)  # fmt: skip
                    for step, times in r.kernels.items():
                        print(f"    {step}: " + "; ".join(f"{us:.1f} us {name}" for name, us in times.items()))
            del cases
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.out is not None:
        existing = args.out / "bench.json"
        if args.append and existing.is_file():
            old = json.loads(existing.read_text())
            rows = merge_rows(read_rows(existing), rows)
            notes = list(dict.fromkeys([*old.get("notes", []), *notes]))
        js, md = write_reports(rows, environment(device, argv), args.out, notes)
        print(f"wrote {js} and {md}")
    print(summary_table(rows))
    print(rows_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
