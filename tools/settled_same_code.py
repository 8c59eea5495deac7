"""Does a settled graph with nothing fused run as fast as Inductor's?  One process, three compiles.

Compiles one benchmark model file three ways on CUDA: by a backend that calls ``compile_fx`` itself (the
callable Inductor would return), by ``backend="fusion"`` (then ``fusion_backend.settle()``), and by
``backend="inductor"``; then times each in interleaved rounds of back-to-back calls ended by a
synchronisation, also calling the settled fusion graph's callable directly (without Dynamo or the
deferred-graph wrapper), and prints each one's median wall and enqueue time per call, then a cProfile of
20 calls of fusion's and Inductor's steps.  Inference only (``torch.no_grad()``), eval mode.

Usage (repository root, needs CUDA)::

    python tools/settled_same_code.py demos/realnets/resnet50.py --dtype bf16
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fusion_backend  # noqa: E402
from fusion_backend.bench.suite import load_workload  # noqa: E402
from fusion_backend.runtime import deferred  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    from torch._inductor.compile_fx import compile_fx

    base, inputs = load_workload(args.model).build(0)
    base = base.cuda().eval()
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs]
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=args.dtype == "bf16")
    captured: dict[str, tuple] = {}

    def own_compile(gm, example_inputs):
        fn = compile_fx(gm, example_inputs)
        captured["fn"] = (fn, list(example_inputs))
        return fn

    graphs = []
    real_init = deferred.DeferredGraph.__init__

    def keep(self, *a, **kw):
        real_init(self, *a, **kw)
        graphs.append((self, list(kw.get("inputs") or [])))

    deferred.DeferredGraph.__init__ = keep
    models = {"compile_fx": torch.compile(copy.deepcopy(base), backend=own_compile),
              "fusion": torch.compile(copy.deepcopy(base), backend="fusion"),
              "inductor": torch.compile(copy.deepcopy(base), backend="inductor")}

    def call(fn):
        with torch.no_grad(), autocast:
            return fn(*inputs)

    for name, model in models.items():
        began = time.perf_counter()
        call(model)
        torch.cuda.synchronize()
        print(f"{name}: first call {time.perf_counter() - began:.1f} s", flush=True)
    fusion_backend.settle()
    steps = {name: (lambda m=model: call(m)) for name, model in models.items()}
    if len(graphs) == 1:
        graph, example = graphs[0]

        def settled_directly():
            with torch.no_grad(), autocast:
                return graph._current(*example)

        steps["fusion, settled callable directly"] = settled_directly
    for step in steps.values():
        for _ in range(5):
            step()
    torch.cuda.synchronize()
    wall: dict[str, list[float]] = {name: [] for name in steps}
    enqueue: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            torch.cuda.synchronize()
            began = time.perf_counter()
            for _ in range(args.calls):
                step()
            queued = time.perf_counter()
            torch.cuda.synchronize()
            wall[name].append((time.perf_counter() - began) * 1e3 / args.calls)
            enqueue[name].append((queued - began) * 1e3 / args.calls)
    for name in steps:
        print(f"{name:36s} wall {statistics.median(wall[name]):.3f} ms   enqueue {statistics.median(enqueue[name]):.3f} ms")
    for name in ("inductor", "fusion"):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            steps[name]()
        torch.cuda.synchronize()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
        print(f"--- {name}\n{text.getvalue()}")


if __name__ == "__main__":
    main()
