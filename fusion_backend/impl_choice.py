"""Pick the fastest of several implementations of one op call by timing them once per key.

WHY: the fused implicit-GEMM conv kernel beats cuDNN + the epilogue kernel on some shapes and loses on
others (NOTE at ``choose``), so ``auto`` must not guess.  The first call with a new key times every candidate's GPU
work (CUDA events around back-to-back calls queued behind a GPU spin, after one warm-up call that also
compiles/autotunes it; ``gpu_ms_per_call``) and remembers the winner: in memory for the process and in a JSON
file for later processes, so the measurement is paid once per shape per machine.

Contract of ``choose``:
  * ``key``: a string that fixes everything the timing depends on (op config, shapes, strides,
    dtypes, TF32 flag); the device name and the torch/triton versions are added here.
  * ``candidates``: name -> zero-argument callable running that implementation (its results are
    discarded).  Candidates must be interchangeable: they pass the same parity tests.
  * ``default``: returned without timing when measuring is off (``FUSION_CONV_AUTOTUNE=0``, for
    deterministic compile times), during CUDA-graph capture, inside ``kernels.launch.compile_ahead``,
    or when a candidate raises.  Inside ``kernels.launch.compile_in_background`` every candidate
    and probe runs first (their kernels compile in the background), and nothing is remembered.
  * ``probes``: for candidates that autotune on their first call, name -> the same candidate on the
    one tile its autotuner would time first.  The probe is timed after the unprobed candidates; a
    candidate whose probe is more than ``SCREEN`` times slower than the best of them is dropped
    untuned, so its autotuner never benchmarks its tiles (Triton's ``do_bench`` of each).
Before timing, the kernels of every unprobed candidate and every probe compile at once
(``kernels.launch.compile_ahead``), and so do a probed candidate's tiles once its probe passed, or with
the others where the compiles run in worker processes, rather than one after another as each is timed.
Timings are not run-to-run stable to the microsecond; a candidate must beat the default by
``MIN_GAIN`` to be picked, so near-ties keep the default (the library path).

Answers are kept in the one measurement cache (``fusion_backend.measurements``: in memory and in
``$FUSION_CACHE_DIR/measurements.json``, default ``~/.cache/fusion_backend``), as ``{"kind": "impl",
"choice": name}`` under ``measurements.key("impl", {"op": key})``; an unreadable or unwritable file only
costs a re-measurement, never an error.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from . import environment, gpu_timing, measurements
from .kernels import launch
from .kernels.host import BoundedCache

log = logging.getLogger("fusion_backend.impl_choice")

CACHE_DIR_ENV = environment.CACHE_DIR
MEASURE_ENV = environment.CONV_AUTOTUNE
#: A candidate must be this much faster than the default to replace it.
MIN_GAIN = 1.03
#: A probed candidate is tuned only if its probe is at most this many times the best unprobed time.
#: The probe runs the autotuner's first tile, which the tuned kernel beats by at most the spread
#: between its few tiles; 1.5x leaves room for that (``kernels/conv_dense.py``'s tiles: the first
#: within 20 % of the best in every case of its sweep) while dropping what loses by far, as
#: the fused conv's 2.06 ms against the library's 0.42 ms on Conv3d 32->64 k3 + leaky + max_pool3d
#: (fp32, 2x32x64^3, H100; ``python tools/first_call.py demos/convnets/conv3d_32_64_k3_leaky_maxpool.py --log``).
SCREEN = 1.5
#: Timing rounds per candidate, the target length of one round, and the most calls in a round.
_ROUNDS = 3
_ROUND_MS = 5.0
_MAX_CALLS = 50

#: Settled answers by the callers' cheap ``fast_key`` (tuples of shapes, strides, dtypes, config):
#: building the string key costs tens of microseconds, on the op's hot path.
_fast = BoundedCache(512)


def measuring_now() -> bool:
    """Whether a measured choice (this module's, or a launcher's tile: ``kernels/conv/tiles.py``) may
    be timed here and now: measuring is on (``MEASURE_ENV``), no ``kernels.launch.compile_ahead`` is
    running (its launches only compile: a time would mean nothing) and no CUDA graph is being
    captured (timing synchronizes)."""
    return (
        environment.measuring()
        and not launch.compiling_ahead()
        and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    )


def _full_key(key: str) -> str:
    """``key``'s key in the one measurement cache (``fusion_backend.measurements``)."""
    return measurements.key("impl", {"op": key})


def _is_choice(entry: measurements.Entry) -> bool:
    return entry.get("kind") == "impl" and isinstance(entry.get("choice"), str)


def gpu_ms_per_call(fn: Callable[[], object]) -> float:
    """GPU milliseconds per call of ``fn`` (after a warm-up call that compiles and autotunes): the
    best of ``_ROUNDS`` rounds of ``n`` back-to-back calls between two events, ``n`` chosen so that
    a round lasts about ``_ROUND_MS``.

    Each round first queues a GPU spin (``torch.cuda._sleep``) long enough for the host to enqueue
    all of the round's calls behind it, so the events see the calls' GPU work back to back however
    slow the host is; a round whose enqueueing outlasted its spin is repeated with a longer spin.

    WHY GPU time, not wall time: the wall time of host-bound calls moves with the host (the H100
    host's speed varied 2x between calls), and the answer flipped with it (the ConvT3d pipeline's
    bf16 forward: fused kernel in one run, the library conv, 4x the GPU time, in the next).  Both
    candidates' host paths are a few launches whose cost the op keeps low separately; which kernels
    run is what the choice decides.  A candidate that synchronizes inside (its enqueueing can never
    run ahead) is charged its wall time after the retries.
    """
    fn()  # warm-up: compiles and autotunes
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    start.record()
    fn()
    end.record()
    host_ms = (time.perf_counter() - began) * 1e3
    end.synchronize()
    calls = max(1, min(_MAX_CALLS, math.ceil(_ROUND_MS / max(start.elapsed_time(end), 1e-3))))
    best, fallback, rounds = math.inf, math.inf, 0
    for _ in range(4 * _ROUNDS):
        cover_ms = 2.0 * host_ms * calls + 0.5
        per_call, enqueue_ms = gpu_timing.queued_ms(fn, calls, cover_ms)
        if enqueue_ms >= cover_ms:  # the GPU may have waited on the host: a longer spin next time
            host_ms = max(host_ms, enqueue_ms / calls)
            fallback = min(fallback, per_call)
            continue
        best = min(best, per_call)
        rounds += 1
        if rounds == _ROUNDS:
            break
    return best if rounds else fallback


# NOTE: measured on the H100: the fused conv won on some shapes and lost on others (on the ``seeds``
# suite's ConvT3d and Conv2d pipelines the library conv won); a tile's ``do_bench`` took about 0.1 s,
# and compiling the candidates one after another as each was timed was most of a cold first call.
def choose(
    key: str | Callable[[], str],
    candidates: Mapping[str, Callable[[], object]],
    default: str,
    timer: Callable[[Callable[[], object]], float] | None = None,
    agree: Callable[[object, object], str | None] | None = None,
    fast_key: Hashable | None = None,
    probes: Mapping[str, Callable[[], object]] | None = None,
) -> str:
    """The name of the fastest candidate for ``key`` (see the module docstring); ``timer`` (ms per
    call of a candidate; ``gpu_ms_per_call`` when None) is replaceable for tests.

    ``key`` may be a callable building the string, called only when no answer is settled under
    ``fast_key`` yet: once an answer is remembered (measured, or read from the file), it is also
    kept under ``fast_key`` (which must determine the string key) and returned from there.  An
    unsettled answer (measuring off, CUDA-graph capture, a failing candidate) is not kept.

    ``agree(result, default_result)``: None when a candidate's result may stand in for the
    default's, else why not.  A candidate that disagrees is never picked (and the choice is
    remembered like any other): speed must not change the numbers beyond the candidates' own
    summation order (e.g. a TF32 kernel against a library conv that runs in full fp32)."""
    if default not in candidates:
        raise ValueError(f"default {default!r} is not among the candidates {sorted(candidates)}")
    probes = dict(probes or {})
    if default in probes or not set(probes) <= set(candidates):
        raise ValueError(f"probes {sorted(probes)} must name candidates other than the default {default!r}")
    if fast_key is not None and (settled := _fast.peek(fast_key)) is not None:
        return settled
    if launch.compiling_every_candidate():
        _run_every_candidate([*candidates.values(), *probes.values()])
        return default
    if not measuring_now():
        return default
    if callable(key):
        key = key()
    full_key = _full_key(key)
    cached = measurements.lookup(full_key, environment.cache_dir(), _is_choice)
    if cached is not None and cached["choice"] in candidates:
        measurements.remember(full_key, cached)  # an answer read from the file: kept for the process too
        return _settle(cached["choice"], fast_key)
    # with the real timer, kernels compile at once before they are timed: the unprobed candidates' and
    # the probes' first (with a probed candidate's other tiles where compiles run in worker processes),
    # a probed candidate's other tiles once its probe passed
    compile_ahead = launch.compile_ahead if timer is None else (lambda calls, speculative=(): False)
    compile_ahead([fn for name, fn in candidates.items() if name not in probes] + list(probes.values()),
                  [candidates[name] for name in probes])
    timer = timer or gpu_ms_per_call
    screened: dict[str, float] = {}
    try:
        if agree is not None:
            reference = candidates[default]()
            for name, fn in list(candidates.items()):
                why = None if name == default else agree(probes.get(name, fn)(), reference)
                if why is not None:
                    log.info("impl choice %s: %s not considered (%s)", key, name, why)
                    candidates = {n: f for n, f in candidates.items() if n != name}
        times = {name: timer(fn) for name, fn in candidates.items() if name not in probes}
        for name, probe in probes.items():
            if name not in candidates:
                continue
            probe_ms = timer(probe)
            if probe_ms > SCREEN * min(times.values()):
                screened[name] = probe_ms
                continue
            compile_ahead([candidates[name]])
            times[name] = timer(candidates[name])
    except Exception as e:  # a failing candidate is the caller's business when it runs it for real
        log.info("impl choice for %s not measured (%s: %s); using %s", key, type(e).__name__, e, default)
        return default
    best = min(times, key=times.__getitem__)
    if times[best] * MIN_GAIN > times[default]:
        best = default
    log.info("impl choice %s: %s (%s)", key, best, ", ".join(
        [f"{n} {t:.3f} ms" for n, t in times.items()]
        + [f"{n} {t:.3f} ms on its first tile, not tuned" for n, t in screened.items()]))
    measurements.store(full_key, {"kind": "impl", "choice": best, "what": key}, environment.cache_dir())
    return _settle(best, fast_key)


def _run_every_candidate(calls: list[Callable[[], object]]) -> None:
    """Inside ``launch.compile_in_background``: run each candidate once (its launches only submit
    their compiles), so that a later ``choose`` finds every candidate's kernels compiled; a candidate
    that raises is skipped (it raises again when it runs for real)."""
    for call in calls:
        try:
            call()
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.debug("compile in background: a candidate raised %s: %s", type(err).__name__, err)


def forget_in_memory() -> None:
    """Drop the answers kept in this process (the file stays): the next ``choose`` of each key reads
    the file or measures, as a new process would."""
    _fast.clear()
    measurements.forget_in_memory()


def is_final(fast_key: Hashable) -> bool:
    """Whether ``choose`` will give the same answer for ``fast_key`` from now on (while the
    ``MEASURE_ENV`` switch stays as it is): an answer is kept under it (measured, or read from the
    file), or measuring is off (the default is then always the answer).  False while unmeasured
    (CUDA-graph capture, a failing candidate)."""
    return _fast.peek(fast_key) is not None or not environment.measuring()


def _settle(name: str, fast_key: Hashable | None) -> str:
    """``name``, also kept under ``fast_key`` (the full key's answer is in ``measurements``)."""
    if fast_key is not None:
        _fast.put(fast_key, name)
    return name


#: Largest norm-wise relative difference between the fused and the library path's floating results
#: for ``auto`` to consider the fused one, by the results' dtype.  Measured on the H100: both in TF32
#: (the ConvT3d pipeline) they differ by 1e-6..1e-5; a TF32 kernel against cuDNN's full-fp32 kernel
#: for a 3-channel conv (``conv2d_mul_leaky_gelu_small``) by 2.7e-4 in the output and 1e-2 in the
#: gradients (leaky-ReLU kinks flip).  Every path follows eager's precision (``conv_precision``);
#: this screen checks that a candidate computes the same thing as the library path.
_AGREEMENT = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def results_agree(result: Any, reference: Any) -> str | None:
    """``choose``'s ``agree`` for paths that return tuples of tensors (a fused op's outputs): None when every floating tensor of ``result``
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
