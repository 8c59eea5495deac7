"""Host time of a network's fused calls in default mode, layer by layer.

Compiles the model with Inductor alone and with every region fused (``fusion-fused``) and prints, for
each, the wall time per step (``--steps`` back-to-back steps ended by a synchronization) and the host's enqueue
time per step (a step whose host time exceeds its GPU time runs at the host's speed); then, for each
fused call site of one step, the host microseconds per call through the autograd-free custom op that
Inductor's code calls (``ops/autograd_free.py``), through its implementation (``forward_impl``: the
settled plan's lookup and the plan) and of the settled plan alone, grouped by plan kind.  The layers'
differences are what the dispatcher and the lookup cost; the plan's time, its casts, checks and launch.

With ``--ops N`` it also lists, for each compiled model, the N operators and runtime calls with the most
host time per step (``torch.profiler``'s self CPU time over five steps: the fused op's own Python is its
``fusion::..._noautograd`` row, the tensors it allocates ``aten::empty``/``empty_strided``; the profiler
adds its own cost to every row, so compare rows, not totals with the times above).

Usage (repository root, needs CUDA; ``--batch 2`` makes the GPU work ~0, so the step time is the host's)::

    python tools/fused_call_host.py demos/realnets/resnet50.py --dtype bf16 [--batch 2] [--ops 25]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import _step_fn, time_calls  # noqa: E402

from fusion_backend.bench.backends import resolve_backend  # noqa: E402
from fusion_backend.bench.suite import load_workload  # noqa: E402
from fusion_backend.frame_room import call_with_frame_room  # noqa: E402


def _best(fn, calls: int, reps: int) -> tuple[float, float]:
    """``(enqueue ms, wall ms)`` per call of ``fn`` (``profile_step.time_calls``), the best of ``reps``
    runs of ``calls`` back-to-back calls, the loop with room on the frame stack (``frame_room``)."""
    sync = torch.cuda.synchronize
    runs = call_with_frame_room(lambda: [time_calls(fn, calls, sync) for _ in range(reps)])
    return min(r[0] for r in runs), min(r[1] for r in runs)


def per_call_us(fn, calls: int = 300, reps: int = 5) -> float:
    """Host microseconds per call of ``fn`` (back to back, no synchronization inside)."""
    return _best(fn, calls, reps)[0] * 1e3


def step_times(step, steps: int) -> tuple[float, float]:
    """``(wall ms, host enqueue ms)`` per step over ``steps`` back-to-back steps, the best of five runs
    (with room on the frame stack, as the benchmark's rounds)."""
    enqueue, wall = _best(step, steps, 5)
    return wall, enqueue


def print_host_ops(step, top: int, steps: int = 5) -> None:
    """The ``top`` operators by self CPU time per step over ``steps`` profiled steps (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call_with_frame_room(lambda: [step() for _ in range(steps)])
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for e in events[:top]:
        print(f"    {e.self_cpu_time_total / steps:9.1f} us/step  {e.count / steps:6.1f} calls/step  {e.key[:90]}")


def _compiled(backend: str, model, inputs, dtype: str):
    """The model compiled with ``backend``, its step, its first call's seconds and its generated code."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn = resolve_backend(backend).compile(model)
    step = _step_fn(fn, model, inputs, False, dtype)
    began = time.perf_counter()
    _, code = run_and_get_code(step)
    return step, time.perf_counter() - began, "\n".join(code)


def _call_sites(step) -> list[tuple]:
    """The fused calls of one step: ``(config, x, weight, bias, operands, plan)`` each."""
    from fusion_backend.ops import conv_epilogue as ce

    declaration, calls = ce.CONV_EPILOGUE.d, []
    settled = declaration.settled_forward

    def recording(config, save, x, weight, bias, operands):
        plan = settled(config, save, x, weight, bias, operands)
        calls.append((config, x, weight, bias, list(operands), plan))
        return plan

    object.__setattr__(declaration, "settled_forward", recording)
    try:
        step()
    finally:
        object.__setattr__(declaration, "settled_forward", settled)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--batch", type=int, default=0, help="cut the inputs to this batch (0: the file's)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--ops", type=int, default=0, help="also list this many operators by host time per step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fused_call_host.py needs CUDA")
    workload = load_workload(args.model)
    model, inputs = workload.build(seed=0)
    if args.batch:
        inputs = [x[: args.batch].clone() if isinstance(x, torch.Tensor) else x for x in inputs]  # clone keeps the layout
    model = workload.set_mode(model.cuda(), "infer")
    inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs]
    print(f"{workload.name} {args.dtype} inference, inputs {[tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)]}")
    rows = {}
    with torch.no_grad():
        for name, backend in (("inductor", "inductor"), ("every region fused", "fusion-fused")):
            step, first_s, code = _compiled(backend, model, inputs, args.dtype)
            wall, host = step_times(step, args.steps)
            rows[name] = wall
            print(f"{name:20s} wall {wall:7.3f} ms/step  host enqueue {host:7.3f} ms/step  first call {first_s:5.1f} s  "
                  f"fused calls per step: {code.count('_noautograd.default(')}", flush=True)
            if args.ops:
                print_host_ops(step, args.ops)
        sites = _call_sites(step)
        print(f"Inductor / every region fused: {rows['inductor'] / rows['every region fused']:.2f}x")
        from fusion_backend.ops import conv_epilogue as ce

        op = torch.ops.fusion.conv_epilogue_fwd_noautograd.default
        kinds: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
        for config, x, weight, bias, operands, plan in sites:
            tensors = (x, weight, bias, operands)
            kinds[type(plan).__name__].append((
                per_call_us(lambda t=tensors, c=config: op(*t, c, False)),
                per_call_us(lambda t=tensors, c=config: ce.CONV_EPILOGUE.forward_impl(*t, c, False)),
                per_call_us(lambda t=tensors, p=plan: p(*t))))
        for kind, times in kinds.items():
            op_us, impl_us, plan_us = (statistics.median(t[i] for t in times) for i in range(3))
            print(f"{kind:24s} {len(times):3d} calls, median host us per call: custom op "
                  f"{op_us:6.1f}, forward_impl {impl_us:6.1f}, plan {plan_us:6.1f}")


if __name__ == "__main__":
    main()
