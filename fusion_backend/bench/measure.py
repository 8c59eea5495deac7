"""Timing and memory instruments: CUDA implementations behind small protocols that tests replace.

The runner never calls ``torch.cuda`` timing or memory functions itself; it asks an :class:`Instruments`
bundle.  On a GPU that bundle is :func:`cuda_instruments`; tests pass fakes returning fixed numbers,
which is how report writing and the correctness gate are tested on CPU without inventing timings.

Timing (:class:`CudaEventTimer`), after the caller's first (compiling, checked) call, of all the steps
of a case (one per backend) together:

1. ``warmup`` untimed repetitions of every step (caches, allocator, cuDNN heuristics, lazy backward
   compilation);
2. unless ``reps`` is fixed, 3 timed repetitions estimate each step's time, and one count for all is
   chosen so the measurement takes about ``target_ms / rounds`` per step (:meth:`MeasureConfig.choose_reps`;
   the runner measures every case ``rounds`` times), like ``triton.testing.do_bench`` does;
3. the repetitions are interleaved: each repetition runs every step once, in the runner's order, each
   bracketed by its own pair of CUDA events; per step the median is reported with its spread.  A step's
   ``reset`` (e.g. setting gradients to ``None``) runs before its start event, untimed;
4. Python's garbage collector is off for all of it, after one collection (``_garbage_collector_paused``).

WHY interleave repetition by repetition: a host-bound step's time follows the host's state (other
processes, clocks, page cache), which drifts within seconds; interleaved, every backend samples the
same stretch of time (measured: ``CudaEventTimer``; ``pick_contenders`` says how the verdict deals
with what interleaving does not cancel).

The *cold* variant zeroes a buffer twice the size of L2 before each repetition, outside the events, so
every repetition starts with nothing of its working set in L2, as in a real network where the previous
layer evicted it.  The *warm* variant runs the step once untimed right before each timed repetition, so
that L2 holds what the step's own previous run left, not the previous backend's data.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..frame_room import call_with_frame_room
from .config import MeasureConfig
from .roofline import DeviceRates


@dataclass(frozen=True)
class TimingStats:
    """Summary of one measurement's per-repetition times, in milliseconds."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    max_ms: float
    mean_ms: float
    reps: int
    #: each round's median, in the order the rounds ran (one entry for a single measurement): how far
    #: apart the windows of one step were, next to the same rounds of the row's other backends
    round_medians_ms: tuple[float, ...] = ()
    #: the median host time of a repetition (from before its start event was recorded to after its
    #: end event was, no synchronisation inside) in the round the other fields come from, or ``None``
    #: where the timer does not read it.  Close to ``median_ms``, the step is host-bound: its GPU
    #: waited for Python and the launches, and the reading measures the host as much as the code
    host_median_ms: float | None = None

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float], host_ms: Sequence[float] = ()) -> TimingStats:
        """Summarise at least one sample.

        >>> TimingStats.from_samples([3.0, 1.0, 2.0]).median_ms
        2.0
        """
        if not samples_ms:
            raise ValueError("TimingStats needs at least one sample")
        xs = sorted(float(x) for x in samples_ms)
        if len(xs) >= 2:
            q = statistics.quantiles(xs, n=5, method="inclusive")
            p20, p80 = q[0], q[3]
        else:
            p20 = p80 = xs[0]
        median = statistics.median(xs)
        host = statistics.median(host_ms) if host_ms else None
        return cls(median, p20, p80, xs[0], xs[-1], statistics.fmean(xs), len(xs), (median,), host)

    @classmethod
    def of_rounds(cls, rounds: Sequence[TimingStats]) -> TimingStats:
        """One summary of the same step measured in several rounds: the quietest round's median, p20
        and p80 (the round with the lowest median), the extremes over all rounds, the mean over all
        repetitions.

        WHY the quietest round, not the median of the rounds: what disturbs a measurement on a GPU
        machine (other processes on the host, clock changes, a page-cache flush) only ever adds time,
        in windows of seconds.  On the H100 host a host-bound step (0.2-1.8 ms) measured up to 2x
        slower in one window than in the next, so the median of three rounds still compared a quiet
        window of one backend with a disturbed one of another (Inductor against fusion running
        Inductor's own code read 0.64x; timed back to back the same two functions were 0.99x).  Each
        backend's best window is the fair comparison.

        >>> a, b, c = (TimingStats.from_samples(s) for s in ([1.0, 2.0], [5.0, 6.0], [2.0, 3.0]))
        >>> TimingStats.of_rounds([a, b, c]).median_ms, TimingStats.of_rounds([a, b, c]).reps
        (1.5, 6)
        >>> TimingStats.of_rounds([a, b, c]).round_medians_ms
        (1.5, 5.5, 2.5)
        """
        if not rounds:
            raise ValueError("TimingStats.of_rounds needs at least one round")
        reps = sum(r.reps for r in rounds)
        quiet = min(rounds, key=lambda r: r.median_ms)
        return cls(quiet.median_ms, quiet.p20_ms, quiet.p80_ms, min(r.min_ms for r in rounds),
                   max(r.max_ms for r in rounds), sum(r.mean_ms * r.reps for r in rounds) / reps, reps,
                   tuple(r.median_ms for r in rounds), quiet.host_median_ms)


@dataclass(frozen=True)
class MemoryStats:
    """Device memory of one step, in bytes.

    ``baseline_bytes`` is allocated before the step (weights, inputs, anything resident); ``peak_bytes``
    the allocator's maximum during the step (absolute); ``held_bytes`` what the forward left allocated
    for the backward (saved activations plus the outputs), i.e. allocated after the forward minus
    baseline.  ``resident_bytes`` is what the backend keeps allocated *between* steps beyond the model
    and its inputs (set by the runner; caches or constants a compiler keeps), counted into
    ``total_peak_bytes`` so a backend cannot look lean by holding memory outside its step.  (CUDA-graph
    pools do not show up in these statistics at all; the runner measures no memory for such backends.)
    """

    baseline_bytes: int
    peak_bytes: int
    held_bytes: int
    resident_bytes: int = 0

    @property
    def step_peak_bytes(self) -> int:
        """Peak above baseline: the memory the step itself allocates."""
        return self.peak_bytes - self.baseline_bytes

    @property
    def total_peak_bytes(self) -> int:
        """Step peak plus what the backend keeps resident: the memory this backend needs beyond the model
        and inputs, the number to compare across backends."""
        return self.step_peak_bytes + self.resident_bytes

    def json_extras(self) -> dict[str, int]:
        """Derived values written to the JSON report next to the fields."""
        return {"step_peak_bytes": self.step_peak_bytes, "total_peak_bytes": self.total_peak_bytes}


@dataclass(frozen=True)
class TimedStep:
    """One step as a :class:`Timer` takes it: ``run`` is timed; ``reset`` (e.g. setting gradients to
    ``None``) runs untimed before every repetition; ``name`` labels it (fakes, errors)."""

    name: str
    run: Callable[[], object]
    reset: Callable[[], None] | None = None


class Timer(Protocol):
    """Times repetitions of steps, interleaved repetition by repetition."""

    def time(self, steps: Sequence[TimedStep], *, cold: bool = False) -> list[TimingStats | Exception]:
        """Per step, in order: the median and spread of its time, or the exception it raised (that step
        is then left out of the rest of the measurement, the others go on).  ``cold`` flushes L2
        before every repetition (untimed)."""
        ...


class MemoryProbe(Protocol):
    """Measures the memory of one step split into forward and backward."""

    def measure(self, forward: Callable[[], Any], backward: Callable[[Any], None] | None = None, *,
                before: Callable[[], None] | None = None) -> MemoryStats:
        """Run ``before()``, then ``out = forward()``, then ``backward(out)`` (if given), and report memory."""
        ...

    def allocated(self, *, drop_workspaces: bool = False) -> int:
        """Bytes allocated on the device now; ``drop_workspaces`` first frees cached library workspaces
        (only safe while no CUDA graph is alive: the runner asks for it before an item compiles)."""
        ...


def repetition_order(steps: int, n: int, consecutive: int = 1) -> Iterator[tuple[int, int]]:
    """``(repetition, step index)`` pairs in the order a timer runs ``n`` repetitions of ``steps``
    steps: blocks of ``consecutive`` repetitions of one step, the steps in turn, block after block.

    >>> list(repetition_order(2, 3))
    [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    >>> list(repetition_order(2, 3, consecutive=2))
    [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]
    """
    for first in range(0, n, consecutive):
        for i in range(steps):
            for rep in range(first, min(first + consecutive, n)):
                yield rep, i


def _no_op() -> None:
    return None


def _reset_and_run(step: TimedStep) -> None:
    if step.reset is not None:
        step.reset()
    step.run()


@dataclass(frozen=True)
class Instruments:
    """Everything device-specific the runner needs.

    ``clock`` (seconds) and ``synchronize`` time the first, compiling call; ``release`` frees cached
    memory between items so one item's leftovers do not count in the next one's peak.
    """

    timer: Timer
    memory: MemoryProbe
    clock: Callable[[], float] = time.perf_counter
    synchronize: Callable[[], None] = _no_op
    release: Callable[[], None] = field(default=gc.collect)


def l2_cache_bytes(device: torch.device) -> int | None:
    """L2 size of a CUDA device from its properties, or ``None`` if this torch does not report it."""
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
    return int(size) if size else None


# NOTE: timed one backend after the other, two copies of the same compiled Inductor code measured
# 0.91-1.25x apart in one run (``docs/perf/RESULTS.md``, noise section); interleaved, the same rows
# measured 1.01-1.11x apart, the copy compiled first the slower in every row (``python -m fusion_backend
# bench --suite <the noise run's workloads> --backends eager,inductor,inductor:default,fusion,fusion-unfused
# --no-memory --no-cold`` on the H100).  Whole networks whose step is host-bound strayed further (ResNet-50
# bf16 inference on one H200: 0.66-1.13x with the same code in both columns) until the rounds ran with room
# on the interpreter's frame stack (``time``; ``fusion_backend/frame_room.py``; ``docs/perf/RESULTS.md``,
# realnets section).
class CudaEventTimer:
    """:class:`Timer` with CUDA events on the current stream of ``device`` (see the module docstring)."""

    #: Flush buffer size when the device does not report its L2 size (larger than any current L2).
    FALLBACK_FLUSH_BYTES = 256 * 1024 * 1024

    def __init__(self, device: torch.device, config: MeasureConfig) -> None:
        self.device = device
        self.config = config
        self._flush: torch.Tensor | None = None

    @property
    def flush_bytes(self) -> int:
        """Bytes written between cold repetitions: twice L2."""
        l2 = l2_cache_bytes(self.device)
        return 2 * l2 if l2 else self.FALLBACK_FLUSH_BYTES

    def _flush_buffer(self) -> torch.Tensor:
        if self._flush is None:
            self._flush = torch.empty(self.flush_bytes // 4, dtype=torch.int32, device=self.device)
        return self._flush

    def _run(self, steps: Sequence[TimedStep], failed: list[Exception | None], cold: bool,
             n: int) -> tuple[list[list[float]], list[list[float]]]:
        """``n`` timed repetitions of every step that has not failed, interleaved in the order of
        :func:`repetition_order` (blocks of ``config.consecutive`` repetitions of one step).  Warm,
        each timed run follows an untimed run of the same step, so that it finds L2 as its own
        previous run left it (not as the step before it, another backend's, did); cold, the flush
        replaces that run.  Returns per step the event times and the host times (ms) of its
        repetitions."""
        flush = self._flush_buffer() if cold else None
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(n)] for _ in steps]  # fmt: skip
        host: list[list[float]] = [[] for _ in steps]
        for rep, i in repetition_order(len(steps), n, self.config.consecutive):
            step = steps[i]
            if failed[i] is not None:
                continue
            try:
                if flush is None:
                    _reset_and_run(step)
                if step.reset is not None:
                    step.reset()
                if flush is not None:
                    flush.zero_()
                start, end = events[i][rep]
                began = time.perf_counter()
                start.record()
                step.run()
                end.record()
                host[i].append((time.perf_counter() - began) * 1e3)
            except Exception as exc:  # this backend's step broke: the others are still measured
                failed[i] = exc
        torch.cuda.synchronize(self.device)
        return ([[] if failed[i] is not None else [s.elapsed_time(e) for s, e in events[i]] for i in range(len(steps))],
                host)

    def time(self, steps: Sequence[TimedStep], *, cold: bool = False) -> list[TimingStats | Exception]:
        # every repetition runs in one frame-stack chunk: no step pays for the interpreter's chunks
        return call_with_frame_room(lambda: self._time(steps, cold))

    def _time(self, steps: Sequence[TimedStep], cold: bool) -> list[TimingStats | Exception]:
        failed: list[Exception | None] = [None] * len(steps)
        with torch.cuda.device(self.device), _garbage_collector_paused():
            for _ in range(self.config.warmup):
                for i, step in enumerate(steps):
                    if failed[i] is None:
                        try:
                            _reset_and_run(step)
                        except Exception as exc:
                            failed[i] = exc
            torch.cuda.synchronize(self.device)
            if self.config.reps is not None:
                n = self.config.reps
            else:
                estimates, _ = self._run(steps, failed, cold, 3)
                # One count for all: the slowest step's share of the round's time bounds everyone's
                # (warm, each timed run costs two runs).
                cost = 1 if cold else 2
                n = min((self.config.choose_reps(cost * statistics.median(e)) for e in estimates if e), default=1)
            samples, host = self._run(steps, failed, cold, n)
        return [failed[i] if failed[i] is not None else TimingStats.from_samples(samples[i], host[i])
                for i in range(len(steps))]  # type: ignore[misc]

    def release(self) -> None:
        """Drop the flush buffer."""
        self._flush = None


@contextlib.contextmanager
def _garbage_collector_paused() -> Iterator[None]:
    """Collect now, then keep Python's cyclic garbage collector off until the block ends (as
    ``timeit`` does).

    WHY: a collection runs when enough objects were allocated since the last one, which in an
    interleaved measurement falls at a fixed place of the repetition cycle: every repetition, the
    same backend's timed run can absorb the pause, round after round.  NOTE: part 1 of the convnets
    suite on the H100 (``CONVNETS_PART=1 bash tools/gpu_session.sh convnets``, 24 rows), three runs
    with the collector on and two with it off: on the rows where fusion ran Inductor's code, its
    ratio to the second Inductor copy strayed from 1 by 1.1-1.2% on average (at most 4.3-6.8%) with
    the collector on, by 0.6-0.7% (at most 2.5-2.8%) with it off; the two Inductor copies by
    3.4-4.8% (at most 23-34%) and 2.6-3.2% (at most 13-21%).  The steps' objects are freed by
    reference counting; a timing call holds at most ``max_reps`` repetitions of garbage cycles.
    """
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _drop_library_workspaces() -> None:
    """Free cuBLAS's cached workspaces (PyTorch allocates them through the caching allocator).

    NOTE: measured on H100 with ``mode="max-autotune"``: capturing a CUDA graph frees the 32 MiB cuBLAS
    workspace that earlier matmuls left allocated, so a reading taken before the capture and one after
    it differed by -32 MiB and the backend's resident memory came out negative.  So the reading taken
    before an item compiles drops them first.  Only safe while no CUDA graph that may still be
    replayed is alive (a graph keeps using the workspace it captured), which is why
    :meth:`CudaMemoryProbe.allocated` drops them only when asked, at the start of an item, after
    Dynamo's reset.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class CudaMemoryProbe:
    """:class:`MemoryProbe` reading the caching allocator's statistics of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def measure(self, forward: Callable[[], Any], backward: Callable[[Any], None] | None = None, *,
                before: Callable[[], None] | None = None) -> MemoryStats:
        if before is not None:
            before()
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        out = forward()
        torch.cuda.synchronize(self.device)
        after_forward = torch.cuda.memory_allocated(self.device)
        if backward is not None:
            backward(out)
            torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del out
        return MemoryStats(baseline_bytes=baseline, peak_bytes=peak, held_bytes=after_forward - baseline)

    def allocated(self, *, drop_workspaces: bool = False) -> int:
        torch.cuda.synchronize(self.device)
        if drop_workspaces:
            _drop_library_workspaces()
        return torch.cuda.memory_allocated(self.device)


def cuda_instruments(device: torch.device, config: MeasureConfig) -> Instruments:
    """The real instruments for a CUDA ``device``."""
    timer = CudaEventTimer(device, config)
    if config.cold:
        timer._flush_buffer()  # allocated up front, so it sits in every baseline, not in one item's numbers

    def synchronize() -> None:
        torch.cuda.synchronize(device)

    def release() -> None:
        gc.collect()
        torch.cuda.empty_cache()

    return Instruments(timer=timer, memory=CudaMemoryProbe(device), clock=time.perf_counter,
                       synchronize=synchronize, release=release)


@contextlib.contextmanager
def matmul_tf32(enabled: bool) -> Iterator[None]:
    """Temporarily allow (or forbid) TF32 in fp32 matmuls, restoring the previous setting.

    PyTorch >= 2.9 refuses to *read* the legacy ``allow_tf32`` flag once the new ``fp32_precision``
    API was used (and vice versa), so the flag is saved and restored through whichever API reads.
    """
    matmul = torch.backends.cuda.matmul
    try:
        previous = matmul.allow_tf32
    except RuntimeError:
        previous_precision = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = previous_precision
        return
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = previous


def _timed_alone(timer: Timer, name: str, fn: Callable[[], object]) -> TimingStats:
    (result,) = timer.time([TimedStep(name, fn)])
    if isinstance(result, Exception):
        raise result
    return result


def _spin(fn: Callable[[], object], seconds: float, device: torch.device) -> None:
    """Run ``fn`` for about ``seconds`` so the GPU leaves its idle clocks before anything is measured."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            fn()
        torch.cuda.synchronize(device)


def measure_device_rates(device: torch.device, timer: Timer, *, copy_bytes: int = 1 << 30,
                         matmul_n: int = 8192, spin_s: float = 0.5) -> DeviceRates:
    """Measure copy bandwidth and matmul rates of ``device`` once per run (about three seconds on an H100).

    Bandwidth: a device-to-device copy of ``copy_bytes`` (read + written: ``2 * copy_bytes`` per copy),
    large enough that L2 plays no part.  Matmul: ``matmul_n``-cubed products in bf16, fp32 with TF32 and
    strict fp32, ``2 * n**3`` flops each.  Both are what a kernel can reach in practice, a fairer floor
    than the data-sheet peaks.  Rates use the *fastest* repetition (a ceiling, not a typical value),
    after ``spin_s`` of matmuls: on an H100 an idle-clocked start measured bf16 at 720 TFLOP/s where a
    warm one reached 790.
    """
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    _spin(copy, spin_s / 2, device)
    t = _timed_alone(timer, "copy", copy)
    copy_rate = 2 * copy_bytes / (t.min_ms * 1e-3)
    src = dst = torch.empty(0)  # free the copy buffers before the matmuls
    flops = 2 * matmul_n**3
    rates: dict[str, float] = {}
    for unit, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                              ("fp32", torch.float32, False)):
        a = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
        b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
        out = torch.empty(matmul_n, matmul_n, device=device, dtype=dtype)
        with matmul_tf32(tf32):
            def mm(a: torch.Tensor = a, b: torch.Tensor = b, out: torch.Tensor = out) -> None:
                torch.mm(a, b, out=out)

            if unit == "bf16":
                _spin(mm, spin_s, device)
            t = _timed_alone(timer, unit + " matmul", mm)
        rates[unit] = flops / (t.min_ms * 1e-3)
        del a, b, out
    gc.collect()
    torch.cuda.empty_cache()
    return DeviceRates(copy_bytes_per_s=copy_rate, matmul_flops=rates, copy_bytes=copy_bytes,
                       matmul_n=matmul_n)
