"""Where a benchmark step's host time goes: the benchmark as ``python -m fusion_backend bench`` runs it,
with every call of every timed step accounted on the calling thread.  Needs CUDA.

Per backend (step), over the benchmark's interleaved rounds and, before them, over ``--in-a-row`` calls
of the same step one after another: host wall time, user and kernel CPU time, voluntary and
involuntary context switches, and minor and major page faults, each per call
(``getrusage(RUSAGE_THREAD)`` around the call).  After the run, per Inductor-compiled module the
process loaded, how many of its Triton kernels launch through Inductor's static CUDA launcher and how
many through Triton's own, and the reasons Inductor logged for not launching one statically.  Accounts are
kept by backend name over the whole run: give the benchmark one workload, dtype and mode for one row's.

WHY: two callables that run the same compiled code read different host times in one process where one
of them took minor page faults in every call and the other did not (``docs/perf/RESULTS.md``, realnets
section): CPython's frame-stack chunks, mapped and unmapped on every call that reached past a chunk's
end (``fusion_backend/frame_room.py``, which the benchmark's loops now run under).  This tool reads
those counts, and with ``--fault-sites`` where they happen, where a benchmark row looks host-bound.

Usage (repository root; every option after ``--`` goes to the benchmark)::

    python tools/bench_step_accounting.py --in-a-row 30 -- --suite demos/realnets/resnet50.py \\
        --dtype bf16 --mode infer --backends eager,inductor,fusion,inductor:default --no-memory --no-cold
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusion_backend.bench.measure import TimedStep  # noqa: E402
from fusion_backend.frame_room import call_with_frame_room  # noqa: E402


@dataclass
class Account:
    """Totals over ``calls`` calls of one step (seconds, counts)."""

    calls: int = 0
    wall_s: float = 0.0
    user_s: float = 0.0
    system_s: float = 0.0
    voluntary_switches: int = 0
    involuntary_switches: int = 0
    minor_faults: int = 0
    major_faults: int = 0
    #: minor faults taken inside Triton kernel launches (``CachingAutotuner.run``), calls that took any, the most in one
    launch_faults: int = 0
    faulting_calls: int = 0
    most_faults: int = 0

    def add(self, wall_s: float, before: Any, after: Any, launch_faults: int = 0) -> None:
        """Add one call: its wall time, the thread's ``getrusage`` before and after it, and the minor
        faults its Triton launches took."""
        faults = after.ru_minflt - before.ru_minflt
        self.launch_faults += launch_faults
        self.faulting_calls += faults > 0
        self.most_faults = max(self.most_faults, faults)
        self.calls += 1
        self.wall_s += wall_s
        self.user_s += after.ru_utime - before.ru_utime
        self.system_s += after.ru_stime - before.ru_stime
        self.voluntary_switches += after.ru_nvcsw - before.ru_nvcsw
        self.involuntary_switches += after.ru_nivcsw - before.ru_nivcsw
        self.minor_faults += after.ru_minflt - before.ru_minflt
        self.major_faults += after.ru_majflt - before.ru_majflt

    def line(self, name: str) -> str:
        """Per-call averages, one line."""
        n = max(self.calls, 1)
        return (f"{name:32s} {self.calls:5d} calls  wall {1e3 * self.wall_s / n:7.3f}  user {1e3 * self.user_s / n:7.3f}"
                f"  kernel {1e3 * self.system_s / n:6.3f} ms/call  switches {self.voluntary_switches / n:5.2f} + "
                f"{self.involuntary_switches / n:5.2f}  faults {self.minor_faults / n:7.2f} minor"
                f" {self.major_faults / n:5.2f} major, {self.launch_faults / n:7.2f} in Triton launches;"
                f" {self.faulting_calls} calls took any, at most {self.most_faults}")  # fmt: skip


@dataclass
class Accounts:
    """The accounts by step name and phase ("rounds": the benchmark's interleaved rounds; "in a row")."""

    by_step: dict[tuple[str, str], Account] = field(default_factory=dict)
    #: with ``--fault-sites``: per ``(step, phase)``, where its calls' user-space faults happened
    sites: dict[tuple[str, str], Any] | None = None

    def accounted(self, step: TimedStep, phase: str) -> TimedStep:
        """``step`` whose ``run`` adds each call to the account of ``(step.name, phase)``."""
        account = self.by_step.setdefault((step.name, phase), Account())
        run = step.run
        sites = None
        if self.sites is not None:
            from fault_sites import FaultSites

            sites = self.sites.setdefault((step.name, phase), FaultSites())

        def counted() -> object:
            in_launches = _launch_faults[0]
            with sites if sites is not None else contextlib.nullcontext():
                before, began = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
                out = run()
                account.add(time.perf_counter() - began, before, resource.getrusage(resource.RUSAGE_THREAD),
                            _launch_faults[0] - in_launches)
            return out

        return dataclasses.replace(step, run=counted)

    def table(self) -> str:
        return "\n".join(account.line(f"{name} ({phase})") for (name, phase), account in self.by_step.items())


#: minor faults taken inside Triton kernel launches so far (``count_launch_faults``)
_launch_faults = [0]
#: the same by kernel name, and the launches counted by kernel name
_faults_by_kernel: collections.Counter[str] = collections.Counter()
_launches_by_kernel: collections.Counter[str] = collections.Counter()


def count_launch_faults() -> Callable[[], None]:
    """Count the minor faults each Inductor Triton kernel launch takes into ``_launch_faults``; returns the undo."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    run = CachingAutotuner.run

    def counted_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        try:
            return run(self, *args, **kwargs)
        finally:
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
            _launch_faults[0] += faults
            name = getattr(self.fn, "__name__", "?")
            _faults_by_kernel[name] += faults
            _launches_by_kernel[name] += 1

    CachingAutotuner.run = counted_run  # type: ignore[method-assign]

    def undo() -> None:
        CachingAutotuner.run = run  # type: ignore[method-assign]

    return undo


def in_a_row(steps: Sequence[TimedStep], calls: int, accounts: Accounts, synchronize: Callable[[], None]) -> None:
    """Call each step ``calls`` times in a row (after its ``reset``), accounted as phase "in a row"."""
    for step in steps:
        counted = accounts.accounted(step, "in a row")

        def row(step: TimedStep = step, counted: TimedStep = counted) -> None:
            synchronize()
            for _ in range(calls):
                if step.reset is not None:
                    step.reset()
                counted.run()
            synchronize()

        call_with_frame_room(row)  # as the rounds run (fusion_backend/frame_room.py)


class _Bypassed(logging.Handler):
    """Counts Inductor's "Bypassing StaticallyLaunchedCudaKernel due to ..." reasons."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Bypassing" in message:
            self.reasons[message[:200]] += 1


def launcher_census() -> list[str]:
    """Per Inductor-compiled module loaded in this process: its Triton kernels by launcher (``static``:
    Inductor's static CUDA launcher; ``triton``: Triton's own; ``none``: not launched yet)."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    loaded = PyCodeCache.modules
    lines = []
    for module in loaded.values() if isinstance(loaded, dict) else loaded:  # a dict in some torch versions
        kinds: collections.Counter[str] = collections.Counter()
        for value in vars(module).values():
            if isinstance(value, CachingAutotuner):
                launchers = value.launchers
                kinds["none" if not launchers else "static" if getattr(launchers[0], "_is_static", False)
                      else "triton"] += 1  # fmt: skip
        if kinds:
            lines.append(f"{os.path.basename(getattr(module, '__file__', '?'))}: {dict(kinds)}")
    return lines


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-a-row", type=int, default=30, metavar="N",
                        help="calls of each step one after another before the rounds (0: none)")
    parser.add_argument("--fault-sites", action="store_true",
                        help="sample where each step's user-space faults happen (tools/fault_sites.py; Linux, "
                             "perf_event_paranoid <= 2); reading /proc/self/maps after every call slows the rounds")
    args = parser.parse_args(ours)
    if args.in_a_row < 0:
        parser.error(f"--in-a-row takes a count >= 0, got {args.in_a_row}")
    return args, bench_args


def main(argv: Sequence[str] | None = None) -> int:
    args, bench_args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_step_accounting: needs CUDA (the benchmark's rounds are timed on the GPU)", file=sys.stderr)
        return 2
    from fusion_backend.bench import measure
    from fusion_backend.bench.cli import main as bench_main

    accounts = Accounts(sites={} if args.fault_sites else None)
    bypassed = _Bypassed()
    logger = logging.getLogger("torch._inductor.runtime.triton_heuristics")
    logger.setLevel(logging.INFO)
    logger.addHandler(bypassed)
    logger.propagate = False
    timed_before: set[str] = set()
    time_steps = measure.CudaEventTimer.time

    def time_accounted(timer: Any, steps: Sequence[TimedStep], *, cold: bool = False) -> Any:
        fresh = [s for s in steps if s.name not in timed_before]
        if args.in_a_row and fresh:  # once per step, before its first rounds
            in_a_row(fresh, args.in_a_row, accounts, lambda: torch.cuda.synchronize(timer.device))
            timed_before.update(s.name for s in fresh)
        return time_steps(timer, [accounts.accounted(s, "rounds") for s in steps], cold=cold)

    measure.CudaEventTimer.time = time_accounted  # type: ignore[method-assign]
    undo_launch_count = count_launch_faults()
    try:
        code = bench_main(bench_args)
    finally:
        measure.CudaEventTimer.time = time_steps  # type: ignore[method-assign]
        undo_launch_count()
        logger.removeHandler(bypassed)
    print("\n== host accounting per call (this thread)")
    print(accounts.table())
    for (name, phase), sites in (accounts.sites or {}).items():
        print(f"\n== where the user-space faults of {name} ({phase}) happened\n{sites.table()}")
    print("\n== Triton kernels whose launches took minor faults (faults / launches)")
    for name, faults in _faults_by_kernel.most_common(12):
        if faults:
            print(f"{faults:8d} / {_launches_by_kernel[name]:6d}  {name}")
    print("\n== Triton kernels by launcher, per Inductor module")
    print("\n".join(launcher_census()) or "(none)")
    for reason, count in bypassed.reasons.most_common(8):
        print(f"{count:4d}x {reason}")
    return code


if __name__ == "__main__":
    sys.exit(main())
