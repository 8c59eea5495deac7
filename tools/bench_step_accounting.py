"""Where a benchmark step's host time goes: the benchmark as ``python -m fusion_backend bench`` runs it,
with every call of every timed step accounted on the calling thread.  Needs CUDA.

Per backend (step), over the benchmark's interleaved rounds and, before them, over ``--in-a-row`` calls
of the same step one after another: host wall time, user and kernel CPU time, voluntary and
involuntary context switches, and minor and major page faults, each per call
(``getrusage(RUSAGE_THREAD)`` around the call).  After the run, per Inductor-compiled module the
process loaded, how many of its Triton kernels launch through Inductor's static CUDA launcher and how
many through Triton's own, and the reasons Inductor logged for not launching one statically.  Accounts are
kept by backend name over the whole run: give the benchmark one workload, dtype and mode for one row's.

WHY: two callables that run the same compiled code can read different host times in one process
(``docs/perf/RESULTS.md``, realnets section): the kernel time of minor page faults taken inside
Inductor's generated code was the difference in the interleaved rounds (none in a row, where measured), and their count changed
with the launcher Inductor's kernels use.  This tool reads those counts where a benchmark row looks
host-bound.

Usage (repository root; every option after ``--`` goes to the benchmark)::

    python tools/bench_step_accounting.py --in-a-row 30 -- --suite demos/realnets/resnet50.py \\
        --dtype bf16 --mode infer --backends eager,inductor,fusion,inductor:default --no-memory --no-cold
"""

from __future__ import annotations

import argparse
import collections
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

    def add(self, wall_s: float, before: Any, after: Any) -> None:
        """Add one call: its wall time and the thread's ``getrusage`` before and after it."""
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
                f" {self.major_faults / n:5.2f} major")  # fmt: skip


@dataclass
class Accounts:
    """The accounts by step name and phase ("rounds": the benchmark's interleaved rounds; "in a row")."""

    by_step: dict[tuple[str, str], Account] = field(default_factory=dict)

    def accounted(self, step: TimedStep, phase: str) -> TimedStep:
        """``step`` whose ``run`` adds each call to the account of ``(step.name, phase)``."""
        account = self.by_step.setdefault((step.name, phase), Account())
        run = step.run

        def counted() -> object:
            before, began = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
            out = run()
            account.add(time.perf_counter() - began, before, resource.getrusage(resource.RUSAGE_THREAD))
            return out

        return dataclasses.replace(step, run=counted)

    def table(self) -> str:
        return "\n".join(account.line(f"{name} ({phase})") for (name, phase), account in self.by_step.items())


def in_a_row(steps: Sequence[TimedStep], calls: int, accounts: Accounts, synchronize: Callable[[], None]) -> None:
    """Call each step ``calls`` times in a row (after its ``reset``), accounted as phase "in a row"."""
    for step in steps:
        counted = accounts.accounted(step, "in a row")
        synchronize()
        for _ in range(calls):
            if step.reset is not None:
                step.reset()
            counted.run()
        synchronize()


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

    accounts = Accounts()
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
    try:
        code = bench_main(bench_args)
    finally:
        measure.CudaEventTimer.time = time_steps  # type: ignore[method-assign]
        logger.removeHandler(bypassed)
    print("\n== host accounting per call (this thread)")
    print(accounts.table())
    print("\n== Triton kernels by launcher, per Inductor module")
    print("\n".join(launcher_census()) or "(none)")
    for reason, count in bypassed.reasons.most_common(8):
        print(f"{count:4d}x {reason}")
    return code


if __name__ == "__main__":
    sys.exit(main())
