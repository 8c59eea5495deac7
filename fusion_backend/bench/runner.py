"""Orchestration: every workload x dtype x mode x backend, correctness gate first, then measurements.

Per workload the model is built once with a fixed seed and moved to the device; every backend (and
the eager reference) gets a ``copy.deepcopy`` of it, so all see the same weights and none sees
another's gradients.  Per workload x dtype x mode:

1. **Reference**: eager runs the step once (under ``FlopCounterMode``, which also yields the flops of
   the roofline); its outputs and gradients are kept.
2. **Per backend**: compile, then the *first* call is both the compile-time measurement and the
   correctness check against the reference (outputs, and in train mode the gradient of every floating
   input and every parameter; rules in :mod:`fusion_backend.bench.correctness`, whose float64 run is
   made lazily, once per case, only if a tensor needs it).  A mismatch makes the item ``FAIL`` and an
   exception ``ERROR``; either way the item is never timed, so a wrong backend can never show up as a
   speedup.
3. Only items that pass have their memory measured (right after their check, before the next
   backend compiles) and are timed (warm, then cold L2).  Timing is interleaved: every backend of the
   case stays compiled, and ``MeasureConfig.rounds`` rounds each time all backends together, one
   repetition of each in turn (``measure.CudaEventTimer``), the order rotating from round to round;
   an item's time is the median of its quietest round (``TimingStats.of_rounds``).  WHY: the host of a GPU machine drifts by tens of percent over
   seconds, and host-bound rows timed one backend after the other compared windows, not backends
   (measured: ``Runner._time_interleaved``).  Until every item's two quietest
   rounds agree (``MeasureConfig.agreement``) and the verdict's paired round ratios lie on one side
   of its tie (``_decided``), the case gets more rounds (at most ``extra_rounds``): one quiet round
   alone may be luck, a row whose rounds were all disturbed for one backend has not been measured
   yet, and neither has one whose paired ratios straddle the tie.

The step: ``infer`` is the forward under ``torch.no_grad()``; ``train`` is forward plus
``torch.autograd.backward(outputs, grad_outputs)`` with *fixed random* upstream gradients (a plain
``out.sum()`` feeds all-ones, which hides backward bugs such as a transposed index, and adds a loss
kernel to the timed region); gradients are set to ``None`` before every repetition (untimed), so each
step allocates fresh ones as ``zero_grad(set_to_none=True)`` training does.  ``bf16`` autocasts the
forward; the backward runs outside autocast as in a training loop.

Rows: a workload runs the config's dtypes x modes kept to those its model file declares
(``Workload.rows``).  A workload that runs no row is *skipped*, with a reason, in ``BenchReport.skipped``
and a ``"skipped"`` progress event: where a package its file ``REQUIRES`` is not installed or the run asks
for none of its declared rows (``Workload.skip_reason``, known before building), or where building it
raises ``ImportError`` (``suite.import_skip_reason``).  A skip is no failure: it leaves no item.

Inputs keep the memory format ``get_inputs()`` gave them (a channels-last input stays channels-last on
the device and in every private copy), so a model file chooses the layout a backend is timed on.

CUDA graphs (a backend whose :attr:`BenchBackend.cudagraphs` is set, e.g. ``mode="reduce-overhead"``):
every call of the compiled step, the checked first call, warm-up, timed and memory repetitions alike,
is preceded by ``torch.compiler.cudagraph_mark_step_begin()`` (in :meth:`_Step.reset`, which the timer
runs untimed before each repetition).  Without it, CUDA-graph trees may replay a graph whose outputs
the previous training step still holds, and the step fails with "accessing tensor output of CUDAGraphs
that has been overwritten by a subsequent run".

Nothing here prints: progress goes to an optional callback, diagnostics to
``logging.getLogger("fusion_backend.bench")``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as _dt
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..report import collect_reports
from ..runtime import compile_estimate
from ..runtime.deferred import any_pending, settled_reports
from .backends import BenchBackend, pick_contenders
from .config import PRECISIONS, BenchConfig, Precision
from .correctness import Fp64Reference, check_against_reference, fp64_reference
from .env import collect_environment, conv_tf32_enabled
from .errors import BenchError
from .measure import Instruments, MemoryStats, TimedStep, TimingStats
from .results import BenchReport, CaseResult, ItemResult, Status
from .roofline import DeviceRates, FlopCount, Roofline, compute_unit, count_traffic, roofline
from .suite import Workload, import_skip_reason
from .verdict import TIE_RATIO

log = logging.getLogger("fusion_backend.bench")

#: Longest error message kept in a result (compiler errors can be pages long; the log has the rest).
MAX_ERROR_CHARS = 4000


@dataclass(frozen=True)
class ProgressEvent:
    """Sent to the progress callback when an item starts compiling (``phase="start"``), before each of
    its timed measurements (``"timing"``) and when it is finished (``"done"``).  Items of one case are
    timed in interleaved rounds, so a case's items start one after the other and finish together.
    A workload that runs no row sends one ``"skipped"`` event, with ``reason`` set and ``dtype``,
    ``mode`` and ``backend`` empty.

    ``index`` counts items from 1 to ``total``; ``result`` is set on ``"done"``.
    """

    index: int
    total: int
    workload: str
    dtype: str
    mode: str
    backend: str
    phase: str
    result: ItemResult | None = None
    reason: str = ""


ProgressFn = Callable[[ProgressEvent], None]


class _Reference:
    """Eager's result of one case: what every backend is checked against, and the case's roofline.

    ``fp64()`` runs the step in float64 the first time a check needs it (rule 2 of the gate) and keeps
    the result for the case's other backends.
    """

    def __init__(self, outputs: Any, grads: dict[str, torch.Tensor | None],
                 grad_outputs: tuple[torch.Tensor, ...], roofline: Roofline | None,
                 make_fp64: Callable[[], Fp64Reference]) -> None:
        self.outputs, self.grads, self.grad_outputs, self.roofline = outputs, grads, grad_outputs, roofline
        self._make_fp64 = make_fp64
        self._fp64: Fp64Reference | None = None

    def fp64(self) -> Fp64Reference:
        if self._fp64 is None:
            self._fp64 = self._make_fp64()
        return self._fp64


def _settled_step(step: _Step, reports: list[Any], tools: Any) -> tuple[Any, list[Any], float]:
    """After a first call that left decisions pending (the fusion backend's ``defer``): settle them
    (wait for the background compiles, measure, recompile) and run the step once more on the settled
    code, which the check and the timing then see.  Returns that step's outputs, the reports that now
    stand (``deferred.settled_reports``) and the seconds from settling to the end of that step."""
    began = tools.clock()
    standing = settled_reports(reports)
    step.reset()
    out = step.run()
    tools.synchronize()
    return out, standing, tools.clock() - began


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` on ``device`` in its own memory format (a channels-last input stays channels-last)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, memory_format=torch.preserve_format)
    return value


def _fresh_inputs(base: Sequence[Any], train: bool) -> list[Any]:
    """Private copies of the inputs, in their own memory format; floating ones require grad in train mode."""
    out = []
    for v in base:
        if isinstance(v, torch.Tensor):
            v = v.detach().clone(memory_format=torch.preserve_format)
            if train and v.is_floating_point():
                v.requires_grad_(True)
        out.append(v)
    return out


def _differentiable(outputs: Any) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves(outputs)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]


def _named_grads(module: torch.nn.Module, inputs: Sequence[Any]) -> dict[str, torch.Tensor | None]:
    """Gradients of every input that requires grad and every parameter that does, by stable names."""
    grads: dict[str, torch.Tensor | None] = {}
    for i, v in enumerate(inputs):
        if isinstance(v, torch.Tensor) and v.requires_grad:
            grads[f"inputs[{i}]"] = v.grad
    for name, p in module.named_parameters():
        if p.requires_grad:
            grads[f"param {name}"] = p.grad
    return grads


def _detach(outputs: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, outputs)


@contextlib.contextmanager
def _precision(device: torch.device, precision: Precision) -> Iterator[None]:
    dtype = precision.autocast_dtype()
    if dtype is None:
        yield
    else:
        with torch.autocast(device_type=device.type, dtype=dtype):
            yield


class _Step:
    """The step of one item: forward / backward / untimed reset, closed over its module and inputs."""

    def __init__(self, fn: Callable[..., Any], module: torch.nn.Module, inputs: list[Any], *,
                 device: torch.device, precision: Precision, train: bool,
                 grad_outputs: Sequence[torch.Tensor] = (), mark_cudagraph_steps: bool = False) -> None:
        self.fn, self.module, self.inputs = fn, module, inputs
        self.device, self.precision, self.train = device, precision, train
        self.grad_outputs = tuple(grad_outputs)
        self.mark = mark_cudagraph_steps

    def forward(self) -> Any:
        grad_mode = torch.enable_grad() if self.train else torch.no_grad()
        with grad_mode, _precision(self.device, self.precision):
            return self.fn(*self.inputs)

    def backward(self, outputs: Any) -> None:
        tensors = _differentiable(outputs)
        if len(tensors) != len(self.grad_outputs):
            raise BenchError(f"the forward returned {len(tensors)} differentiable output(s), the reference "
                             f"{len(self.grad_outputs)}")
        torch.autograd.backward(tensors, self.grad_outputs)

    def run(self) -> Any:
        out = self.forward()
        if self.train:
            self.backward(out)
        return out

    def reset(self) -> None:
        """Untimed, before every call: gradients to ``None``; a new CUDA-graph step if the backend
        replays CUDA graphs."""
        if self.train:
            for p in self.module.parameters():
                p.grad = None
            for v in self.inputs:
                if isinstance(v, torch.Tensor):
                    v.grad = None
        if self.mark:
            # CUDA-graph trees (mode="reduce-overhead" or "max-autotune") learn here that the previous
            # step's outputs are dead and its graphs may be replayed over them.
            torch.compiler.cudagraph_mark_step_begin()


def _graph_breaks() -> int | None:
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["graph_break"].values()))
    except Exception:  # private API drift: the count is a nicety
        return None


def _from_caches(before: tuple[int, int], after: tuple[int, int]) -> bool | None:
    """``ItemResult.from_inductor_caches`` from the counts before and after the first call."""
    return None if after == before else compile_estimate.served_by_caches(before, after)


def _clear_dynamo() -> None:
    torch._dynamo.reset()
    try:
        from torch._dynamo.utils import counters

        counters.clear()
    except Exception:  # pragma: no cover
        pass


class Runner:
    """Runs a benchmark matrix; see the module docstring.  One instance per run.

    ``instruments`` may be ``None`` only with ``config.check_only``.  ``rates`` ``None`` skips the
    roofline (e.g. check-only, or tests that do not care).  ``stop_requested``: asked after every
    item; where it answers true the run stops as on Ctrl-C (``KeyboardInterrupt``), the unfinished case
    left out of the report.  It backs up an interrupt raised by a signal handler, which Python drops
    where the handler happens to run inside a finalizer (a ``__del__`` or a weakref callback).
    """

    def __init__(self, config: BenchConfig, backends: Sequence[BenchBackend], *, device: torch.device,
                 instruments: Instruments | None = None, rates: DeviceRates | None = None,
                 progress: ProgressFn | None = None, stop_requested: Callable[[], bool] = lambda: False) -> None:
        if instruments is None and not config.check_only:
            raise BenchError("measuring needs instruments (timer, memory probe); pass cuda_instruments(...)")
        if [b.name for b in backends] != list(config.backends):
            raise BenchError(f"backends {[b.name for b in backends]} do not match config.backends "
                             f"{list(config.backends)}")
        self.config = config
        self.backends = list(backends)
        self.device = device
        self.instruments = instruments or Instruments(timer=_NoTimer(), memory=_NoMemory())
        self.rates = rates
        self.progress = progress
        self.stop_requested = stop_requested
        #: Whether fp32 convolutions may run in TF32 here: picks the gate's fp32 tolerance and the
        #: roofline's compute unit.  Read once: the flag is global state that a model file could change.
        self.conv_tf32 = device.type == "cuda" and conv_tf32_enabled()
        self._index = 0
        self._total = 0
        #: Whether a backend of the current case recorded CUDA graphs (which keep using the library
        #: workspaces they captured, so those must not be freed before the next item's reading).
        self._graphs_alive = False

    # -- public -----------------------------------------------------------------------------------------

    def run(self, workloads: Sequence[Workload], environment: dict[str, Any] | None = None) -> BenchReport:
        """Run every item of every workload and return the report (never raises for a backend's fault)."""
        cfg = self.config
        started = _dt.datetime.now(_dt.timezone.utc)
        t0 = time.perf_counter()
        self._index = 0
        reasons = {w.name: w.skip_reason(cfg.dtypes, cfg.modes) for w in workloads}
        self._total = sum(len(w.rows(cfg.dtypes, cfg.modes)) for w in workloads if not reasons[w.name]) * len(
            self.backends)
        cases: list[CaseResult] = []
        skipped: dict[str, str] = {}
        complete = True
        try:
            for workload in workloads:
                if reasons[workload.name]:
                    self._skip(workload.name, reasons[workload.name], skipped)
                else:
                    self._run_workload(workload, cases, skipped)
        except KeyboardInterrupt:
            complete = False  # keep what finished: a long run interrupted still leaves a report
        if any(b.uses_dynamo for b in self.backends):
            _clear_dynamo()
        finished = _dt.datetime.now(_dt.timezone.utc)
        return BenchReport(
            config=cfg,
            environment=dict(environment) if environment is not None else collect_environment(self.device),
            rates=self.rates,
            workloads={w.name: str(w.path) for w in workloads},
            cases=tuple(cases),
            started=started.isoformat(timespec="seconds"),
            finished=finished.isoformat(timespec="seconds"),
            wall_s=time.perf_counter() - t0,
            complete=complete,
            skipped=skipped,
        )

    # -- per workload / case -----------------------------------------------------------------------------

    def _run_workload(self, workload: Workload, cases: list[CaseResult], skipped: dict[str, str]) -> None:
        """Append the workload's cases to ``cases`` as each finishes, or its skip reason to ``skipped``
        where building it raises ``ImportError``."""
        cfg = self.config
        rows = workload.rows(cfg.dtypes, cfg.modes)
        try:
            model, inputs = workload.build(cfg.seed)
            model = model.to(self.device)
            inputs = [_to_device(v, self.device) for v in inputs]
        except ImportError as exc:
            log.debug("building %s needs what is not installed", workload.name, exc_info=True)
            self._total -= len(rows) * len(self.backends)
            self._skip(workload.name, import_skip_reason(exc), skipped)
            return
        except Exception as exc:
            log.debug("building %s failed", workload.name, exc_info=True)
            msg = f"building the model failed: {_describe(exc)}"
            cases.extend(self._failed_case(workload.name, d, m, msg) for d, m in rows)
            return
        try:
            for dtype, mode in rows:
                workload.set_mode(model, mode)
                cases.append(self._run_case(workload.name, model, inputs, dtype, mode))
                self.instruments.release()
        finally:
            del model, inputs
            self.instruments.release()

    def _skip(self, workload: str, reason: str, skipped: dict[str, str]) -> None:
        skipped[workload] = reason
        if self.progress is not None:
            self.progress(ProgressEvent(self._index, self._total, workload, dtype="", mode="", backend="",
                                        phase="skipped", reason=reason))

    def _failed_case(self, workload: str, dtype: str, mode: str, message: str) -> CaseResult:
        items = []
        for backend in self.backends:
            self._emit(workload, dtype, mode, backend.name, "start")
            item = ItemResult(workload, dtype, mode, backend.name, Status.ERROR, error=message)
            self._emit(workload, dtype, mode, backend.name, "done", item)
            items.append(item)
        return CaseResult(workload, dtype, mode, roofline=None, items=tuple(items), error=message)

    def _reference(self, model: torch.nn.Module, base_inputs: Sequence[Any], precision: Precision,
                   train: bool) -> _Reference:
        module = copy.deepcopy(model)
        inputs = _fresh_inputs(base_inputs, train)
        step = _Step(module, module, inputs, device=self.device, precision=precision, train=train)
        grad_outputs: tuple[torch.Tensor, ...] = ()
        with FlopCount() as flops:
            out = step.forward()
            if train:
                diff = _differentiable(out)
                if not diff:
                    raise BenchError("train mode needs a floating-point output that requires grad; the "
                                     "model's outputs have none")
                gen = torch.Generator().manual_seed(self.config.seed + 2)
                grad_outputs = tuple(
                    torch.randn(t.shape, generator=gen, dtype=torch.float32).to(self.device, t.dtype)
                    for t in diff
                )
                torch.autograd.backward(diff, grad_outputs)
        self.instruments.synchronize()
        grads = {k: None if g is None else g.detach() for k, g in _named_grads(module, inputs).items()}
        line = None
        if self.rates is not None:
            traffic = count_traffic(inputs, list(module.parameters()), pytree.tree_leaves(out),
                                    grad_outputs=grad_outputs, grads=list(grads.values()))
            line = roofline(traffic, flops.total, self.rates, compute_unit(precision.name, self.conv_tf32))
        outputs = _detach(out)
        del module, inputs, out

        def make_fp64() -> Fp64Reference:
            return self._fp64_reference(model, base_inputs, train, grad_outputs, outputs, grads,
                                        precision.fp64_multiplier)

        return _Reference(outputs, grads, grad_outputs, line, make_fp64)

    def _fp64_reference(self, model: torch.nn.Module, base_inputs: Sequence[Any], train: bool,
                        grad_outputs: Sequence[torch.Tensor], eager_out: Any,
                        eager_grads: dict[str, torch.Tensor | None], multiplier: float) -> Fp64Reference:
        """The step in float64 without autocast: the exact answer rule 2 measures errors against."""
        try:
            module = copy.deepcopy(model).double()
            inputs = [v.detach().double().requires_grad_(train)
                      if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                      for v in _fresh_inputs(base_inputs, False)]
            step = _Step(module, module, inputs, device=self.device, precision=PRECISIONS["fp32"],
                         train=train, grad_outputs=[g.double() for g in grad_outputs])
            out = step.run()
            grads = {k: None if g is None else g.detach() for k, g in _named_grads(module, inputs).items()}
            return fp64_reference(_detach(out), grads, eager_out, eager_grads, multiplier)
        except Exception as exc:
            log.debug("float64 reference failed", exc_info=True)
            return Fp64Reference(tensors={}, eager_errors={}, multiplier=multiplier, error=_describe(exc))

    def _run_case(self, workload: str, model: torch.nn.Module, inputs: Sequence[Any], dtype: str,
                  mode: str) -> CaseResult:
        precision = PRECISIONS[dtype]
        train = mode == "train"
        try:
            ref = self._reference(model, inputs, precision, train)
        except Exception as exc:
            log.debug("eager reference of %s/%s/%s failed", workload, dtype, mode, exc_info=True)
            return self._failed_case(workload, dtype, mode, f"the eager reference failed: {_describe(exc)}")
        finished: dict[str, ItemResult] = {}
        live: list[_Live] = []
        dynamo = any(b.uses_dynamo for b in self.backends)
        if dynamo:
            _clear_dynamo()
        self._graphs_alive = False
        try:
            for backend in self.backends:
                self._emit(workload, dtype, mode, backend.name, "start")
                prepared = self._prepare_item(workload, model, inputs, dtype, mode, backend, ref)
                self.instruments.release()
                self._stop_if_requested()
                if isinstance(prepared, ItemResult):
                    finished[backend.name] = prepared
                    self._emit(workload, dtype, mode, backend.name, "done", prepared)
                else:
                    live.append(prepared)
            timed = self._time_interleaved(live)
            self._stop_if_requested()
            for entry, item in zip(live, timed, strict=True):
                finished[item.backend] = item
                self._emit(workload, dtype, mode, item.backend, "done", item, index=entry.index)
        finally:
            del live
            if dynamo:
                # Drops this case's compiled code and CUDA graphs now, not when the next case compiles.
                _clear_dynamo()
        items = tuple(finished[b.name] for b in self.backends)
        return CaseResult(workload, dtype, mode, roofline=ref.roofline, items=items)

    def _stop_if_requested(self) -> None:
        if self.stop_requested():
            raise KeyboardInterrupt("stop requested")

    # -- per item ------------------------------------------------------------------------------------------

    def _prepare_item(self, workload: str, model: torch.nn.Module, base_inputs: Sequence[Any], dtype: str,
                      mode: str, backend: BenchBackend, ref: _Reference) -> _Live | ItemResult:
        """Compile, check and measure the memory of one backend's step: the step, ready to be timed,
        or the item's final result (failed, or check-only)."""
        cfg = self.config
        # The item's numbers so far; ``_finished`` gives it its final status.
        result = ItemResult(workload, dtype, mode, backend.name, Status.OK)
        module = copy.deepcopy(model)
        inputs = _fresh_inputs(base_inputs, mode == "train")
        precision = PRECISIONS[dtype]
        train = mode == "train"
        tools = self.instruments
        # 1. compile + first call, which is also the correctness check.
        try:
            tools.synchronize()
            measuring_memory = cfg.memory and not cfg.check_only
            item_start = tools.memory.allocated(drop_workspaces=not self._graphs_alive) if measuring_memory else 0
            breaks_before = _graph_breaks() if backend.uses_dynamo else None
            caches_before = compile_estimate.inductor_cache_counts()
            start = tools.clock()
            fn = backend.compile(module)
            step = _Step(fn, module, inputs, device=self.device, precision=precision, train=train,
                         grad_outputs=ref.grad_outputs, mark_cudagraph_steps=backend.cudagraphs)
            step.reset()
            with collect_reports() as reports:  # the fusion backend's decisions, for the item's notes
                out = step.run()
            tools.synchronize()
            result = dataclasses.replace(result, compile_s=tools.clock() - start,
                                         from_inductor_caches=_from_caches(
                                             caches_before, compile_estimate.inductor_cache_counts()))
            if any_pending(reports):
                out, reports, settle_s = _settled_step(step, reports, tools)
                result = dataclasses.replace(result, settle_s=settle_s)
            self._graphs_alive = self._graphs_alive or backend.cudagraphs
            result = _with_notes(result, *(f"{d.pattern} {d.summary}: {d}" for r in reports for d in r.decisions))
            if reports:  # the fusion backend compiled (other backends publish no report)
                result = dataclasses.replace(result, fused_regions=sum(len(r.matches) for r in reports))
            if backend.uses_dynamo:
                after = _graph_breaks()
                breaks = None if after is None or breaks_before is None else after - breaks_before
                result = dataclasses.replace(result, graph_breaks=breaks)
            before_check = tools.memory.allocated() if measuring_memory else 0
            check = check_against_reference(out, ref.outputs, cfg.tolerance(dtype, self.conv_tf32),
                                             actual_grads=_named_grads(module, inputs),
                                             expected_grads=ref.grads,
                                             fp64=ref.fp64 if cfg.fp64_check else None)
            if measuring_memory:
                # A float64 reference made during this check stays for the case: not this backend's.
                item_start += tools.memory.allocated() - before_check
            del out
        except Exception as exc:
            log.debug("%s/%s/%s/%s: first call failed", workload, dtype, mode, backend.name, exc_info=True)
            return _finished(result, Status.ERROR, f"compile or first call failed: {_describe(exc)}")
        result = dataclasses.replace(result, check=check)
        if not check.ok:
            return _finished(result, Status.FAIL, f"differs from eager: {check.summary()}")
        if cfg.check_only:
            return _finished(result, Status.OK)
        # 2. memory, only for results that matched eager, before another backend allocates anything.
        try:
            if cfg.memory and backend.cudagraphs:
                result = _with_notes(result, "memory not measured: CUDA graphs keep the step's tensors in a "
                                             "private pool that the allocator statistics do not count")
            elif cfg.memory:
                memory = tools.memory.measure(step.forward, step.backward if train else None,
                                              before=step.reset)
                memory = dataclasses.replace(memory, resident_bytes=memory.baseline_bytes - item_start)
                result = dataclasses.replace(result, memory=memory)
        except Exception as exc:
            log.debug("%s/%s/%s/%s: measuring memory failed", workload, dtype, mode, backend.name, exc_info=True)
            return _finished(result, Status.ERROR, f"measuring failed: {_describe(exc)}")
        return _Live(backend.name, self._index, result, step)

    # NOTE: the same eager step measured 0.17 ms and 0.27 ms in two runs; ``python -m fusion_backend bench
    # --suite families --no-memory`` on the H100, three rounds, put fusion at 0.81x Inductor on
    # convt2d_64_32_k4_s2_groupnorm_silu bf16 infer, where both ran Inductor's same kernels (76 us of GPU
    # time per step, by the profiler); in one process that compiled step measured 0.17 ms and then
    # 0.73 ms per call in two consecutive windows.  Hence interleaved rounds and more of them until
    # they agree (module docstring, step 3).
    def _time_interleaved(self, live: list[_Live]) -> list[ItemResult]:
        """Time every live item in rounds (module docstring, step 3); the items' results."""
        cfg = self.config
        kinds = (False, True) if cfg.measure.cold else (False,)
        for r in range(cfg.measure.rounds + cfg.measure.extra_rounds if live else 0):
            if r >= cfg.measure.rounds and self._measured(live):
                break
            order = live[r % len(live):] + live[:r % len(live)]
            for cold in kinds:
                order = [item for item in order if not item.error]
                for item in order:
                    self._emit(item.result.workload, item.result.dtype, item.result.mode, item.backend, "timing",
                               index=item.index)
                timed = self.instruments.timer.time(
                    [TimedStep(item.backend, item.step.run, item.step.reset) for item in order], cold=cold)
                for item, stats in zip(order, timed, strict=True):
                    if isinstance(stats, Exception):
                        log.debug("%s: measuring failed", item.backend, exc_info=stats)
                        item.error = item.error or f"measuring failed: {_describe(stats)}"
                    else:
                        (item.cold_rounds if cold else item.warm_rounds).append(stats)
        results = []
        for item in live:
            if item.error:
                results.append(_finished(item.result, Status.ERROR, item.error))
                continue
            cold = TimingStats.of_rounds(item.cold_rounds) if item.cold_rounds else None
            timed = dataclasses.replace(item.result, warm=TimingStats.of_rounds(item.warm_rounds), cold=cold)
            results.append(_finished(timed, Status.OK))
        return results

    def _measured(self, live: list[_Live]) -> bool:
        """Whether a case's rounds so far suffice: every item's two quietest rounds agree, and the
        verdict's paired round ratios have decided on which side of the tie the row lies."""
        if not all(item.error or _settled(item.warm_rounds, self.config.measure.agreement) for item in live):
            return False
        by_name = {item.backend: item for item in live if not item.error}
        subject, baseline = (by_name.get(name) for name in pick_contenders([b.name for b in self.backends]))
        if subject is None or baseline is None:
            return True
        return _decided([b.median_ms / s.median_ms for s, b in zip(subject.warm_rounds, baseline.warm_rounds,
                                                                  strict=True)])

    def _emit(self, workload: str, dtype: str, mode: str, backend: str, phase: str,
              result: ItemResult | None = None, index: int | None = None) -> None:
        if phase == "start":
            self._index += 1
        if self.progress is not None:
            self.progress(ProgressEvent(self._index if index is None else index, self._total, workload, dtype,
                                        mode, backend, phase, result))


@dataclass
class _Live:
    """A compiled, checked item waiting to be timed, and its round-by-round timings."""

    backend: str
    index: int
    """The item's place in the run (progress events)."""
    result: ItemResult
    """The item's numbers before timing (status not final yet)."""
    step: _Step
    warm_rounds: list[TimingStats] = dataclasses.field(default_factory=list)
    cold_rounds: list[TimingStats] = dataclasses.field(default_factory=list)
    error: str = ""


def _with_notes(result: ItemResult, *notes: str) -> ItemResult:
    return dataclasses.replace(result, notes=result.notes + notes)


def _finished(result: ItemResult, status: Status, error: str = "") -> ItemResult:
    """``result`` with its final status: timings and memory only for an item that ended OK."""
    ok = status is Status.OK
    return dataclasses.replace(result, status=status, error=error, warm=result.warm if ok else None,
                               cold=result.cold if ok else None, memory=result.memory if ok else None)


class _NoTimer:
    def time(self, step: Callable[[], object], *, before_each: Callable[[], None] | None = None,
             cold: bool = False) -> TimingStats:
        raise BenchError("no timer: this run is check-only")


class _NoMemory:
    def measure(self, forward: Callable[[], Any], backward: Callable[[Any], None] | None = None, *,
                before: Callable[[], None] | None = None) -> MemoryStats:
        raise BenchError("no memory probe: this run is check-only")

    def allocated(self, *, drop_workspaces: bool = False) -> int:
        return 0


def run_benchmark(workloads: Sequence[Workload], config: BenchConfig, backends: Sequence[BenchBackend], *,
                  device: torch.device | str, instruments: Instruments | None = None,
                  rates: DeviceRates | None = None, progress: ProgressFn | None = None,
                  environment: dict[str, Any] | None = None) -> BenchReport:
    """Convenience wrapper: ``Runner(config, backends, ...).run(workloads, environment)``."""
    runner = Runner(config, backends, device=torch.device(device), instruments=instruments, rates=rates,
                    progress=progress)
    return runner.run(workloads, environment)


def _settled(rounds: list[TimingStats], agreement: float) -> bool:
    """Whether an item's two quietest rounds agree within ``agreement`` (relative to the quieter)."""
    if len(rounds) < 2:
        return False
    first, second = sorted(r.median_ms for r in rounds)[:2]
    return second <= first * (1 + agreement)


def _decided(ratios: list[float], tie: float = TIE_RATIO) -> bool:
    """Whether a row's paired round ratios (Inductor's round median over fusion's) put it on one side
    of the verdict's tie: the tie lies outside the middle half of the ratios.

    WHY: the row's ratio is the median of these (``results.CaseResult.speedup``), and six of them
    on a host-bound row can straddle the tie by ten percent either way; a median that falls on
    either side of the tie by chance decides nothing, so such a row gets more rounds (at most
    ``MeasureConfig.extra_rounds``), whichever side its median is on.  A row whose ratios sit
    together, below the tie or above it, is decided.  NOTE: the H100's convnets rows where fusion
    ran Inductor's own code read 0.96-1.01x (``conv2d_depthwise_144_k3_relu6`` fp32 train: six
    paired ratios 0.80-1.24, median 0.964, middle half 0.905-1.066); recomputed from the
    ``round_medians_ms`` of the 142 rows of ``docs/perf/h100/*/bench.json`` before this rule, 27
    straddled the tie after six rounds, 26 of which took more rounds anyway, so the rule costs
    little time.
    """
    if len(ratios) < 2:
        return False
    first_quartile, _, third_quartile = statistics.quantiles(ratios, n=4)
    return not first_quartile < tie < third_quartile
