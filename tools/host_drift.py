"""Does the machine's host speed drift while the same compiled step runs?  Window by window, on CUDA.

Compiles a benchmark model file with each backend in turn (one process, ``torch._dynamo.reset()``
between them), runs the first call and ``fusion_backend.settle()``, then times ``--windows`` windows of
``--steps`` steps each: per window the median host time of a step (``perf_counter`` around the call), the
median CUDA-event time of a step, and ``nvidia-smi``'s SM clock, power, temperature and active
clock-event reasons.  A host-bound step whose host time changes from window to window while the GPU's
clock stays put is timed on a host whose speed drifts: a benchmark row of such a step reads the host.

Usage (repository root, needs CUDA)::

    python tools/host_drift.py demos/realnets/resnet50.py --backends inductor,fusion --dtype bf16
    taskset -c 5 python tools/host_drift.py demos/realnets/resnet50.py --backends inductor   # pinned
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import _step_fn  # noqa: E402

import fusion_backend  # noqa: E402
from fusion_backend.bench.backends import resolve_backend  # noqa: E402
from fusion_backend.bench.suite import load_workload  # noqa: E402

SMI_FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def gpu_state() -> str:
    """``nvidia-smi``'s SM clock, power, temperature and clock-event reasons, or why not."""
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=5).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi: {exc}"


def windows(step, count: int, steps: int, label: str, started: float) -> None:
    for _ in range(count):
        host, events = [], []
        for _ in range(steps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            begin.record()
            step()
            end.record()
            host.append((time.perf_counter() - t) * 1e3)
            events.append((begin, end))
        torch.cuda.synchronize()
        gpu = statistics.median(b.elapsed_time(e) for b, e in events)
        print(f"{label} t={time.perf_counter() - started:6.1f}s host {statistics.median(host):.2f} ms "
              f"events {gpu:.2f} ms | {gpu_state()}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--backends", default="inductor,fusion")
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--windows", type=int, default=25)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_drift.py needs CUDA")
    workload = load_workload(args.file)
    train = args.mode == "train"
    for backend in args.backends.split(","):
        model, inputs = workload.build(seed=0)
        model = workload.set_mode(model.cuda(), args.mode)
        inputs = [x.cuda().requires_grad_(train and x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                  for x in inputs]  # fmt: skip
        torch._dynamo.reset()
        started = time.perf_counter()
        step = _step_fn(resolve_backend(backend).compile(model), model, inputs, train, args.dtype)
        with torch.enable_grad() if train else torch.no_grad():
            step()
            torch.cuda.synchronize()
            print(f"{backend}: first call {time.perf_counter() - started:.1f} s", flush=True)
            fusion_backend.settle()
            windows(step, args.windows, args.steps, backend, started)


if __name__ == "__main__":
    main()
