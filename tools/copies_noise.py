"""The bench's noise floor: identical compiled copies of one model, timed the way the bench times a row.

Compiles ``--copies`` copies of a benchmark model file with the same backend (default Inductor), each
a ``copy.deepcopy`` of the model, then times them together as the bench times a row's backends
(``bench.measure.CudaEventTimer``: repetition by repetition, the order rotating from round to round)
for ``--rounds`` rounds.  Prints each copy's median over the rounds and the paired ratio of the last
copy's round median over its own, per round and the median over the rounds.  The copies run the
same code, so every ratio away from 1 is the measurement's own noise: how many paired rounds a row
needs before its ratio can be read against the bench's 0.97 tie line.

Usage (repository root, needs CUDA; an empty cache folder per run keeps the copies' compiles alike)::

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python tools/copies_noise.py demos/convnets/conv2d_64_k3_relu.py --mode train
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import _step_fn  # noqa: E402

import fusion_backend  # noqa: E402
from fusion_backend.bench.config import MeasureConfig  # noqa: E402
from fusion_backend.bench.measure import CudaEventTimer, TimedStep  # noqa: E402
from fusion_backend.bench.suite import load_workload  # noqa: E402


def make_step(model: torch.nn.Module, inputs: list[torch.Tensor], backend: Any, train: bool, dtype: str):
    """A compiled copy of ``model`` and its zero-argument step: ``profile_step``'s (forward, plus the
    backward in training), the forward under ``torch.no_grad()`` in inference as the bench runs it."""
    mine = copy.deepcopy(model)
    step = _step_fn(torch.compile(mine, backend=backend), mine, inputs, train, dtype)
    if train:
        return step

    def infer() -> None:
        with torch.no_grad():
            step()

    return infer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("copies_noise.py needs CUDA")
    backend = args.backend
    if backend == "fusion":  # the callable: without the installed entry point the name is unknown to Dynamo
        from fusion_backend import fusion as backend
    train = args.mode == "train"
    workload = load_workload(args.file)
    model, inputs = workload.build(seed=0)
    model = workload.set_mode(model.cuda(), args.mode)
    inputs = [x.cuda().requires_grad_(train and x.is_floating_point()) for x in inputs]
    steps = []
    for i in range(args.copies):
        step = make_step(model, inputs, backend, train, args.dtype)
        began = time.perf_counter()
        step()
        torch.cuda.synchronize()
        print(f"copy {i}: compiled and ran once in {time.perf_counter() - began:.1f} s", flush=True)
        fusion_backend.settle()  # decisions the fusion backend deferred past the first call: time the settled code
        steps.append(step)
    timer = CudaEventTimer(torch.device("cuda"), MeasureConfig(cold=False, rounds=args.rounds))
    medians: list[list[float]] = [[] for _ in steps]
    order = list(range(len(steps)))
    for r in range(args.rounds):
        rotated = order[r % len(order):] + order[:r % len(order)]
        for i, stats in zip(rotated, timer.time([TimedStep(str(i), steps[i]) for i in rotated]), strict=True):
            if isinstance(stats, Exception):
                raise stats
            medians[i].append(stats.median_ms)
    last = medians[-1]
    print(f"{Path(args.file).stem} {args.mode} {args.dtype} {args.backend}, {args.rounds} rounds")
    for i, mine in enumerate(medians):
        ratios = [b / a for a, b in zip(mine, last, strict=True)]
        print(f"  copy {i}: median {statistics.median(mine):.4f} ms; last copy / this: median {statistics.median(ratios):.3f}, "
              f"rounds {' '.join(f'{x:.3f}' for x in ratios)}")


if __name__ == "__main__":
    main()
