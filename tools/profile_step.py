"""Where a compiled step spends its time: one table of CUDA kernels per (workload, backend, mode).

For each benchmark model file and backend, builds the model on CUDA, compiles it, warms up, then
records ``--steps`` steps under ``torch.profiler`` and prints

* the GPU time per step (sum of kernel times) and the host wall time per step (CUDA-synchronized),
  whose difference is launch / Python overhead the GPU waits on;
* the kernels, largest total first, with calls per step and mean time.

A step is what the benchmark times, on the code the backend settles on (``fusion_backend.settle``
after a first step, as the benchmark does before it times): forward, and in ``train`` mode a backward
with fixed random upstream gradients, parameter grads reset to ``None`` between steps.  A backend
name may carry a compile mode, as the benchmark's (``fusion-decide-all:reduce-overhead``).

Usage (repository root, needs CUDA)::

    python tools/profile_step.py demos/seeds/convt2d_global_mean_bias_logsumexp.py --backends inductor,fusion --mode train
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusion_backend import settle  # noqa: E402
from fusion_backend.bench.backends import resolve_backend  # noqa: E402
from fusion_backend.bench.suite import load_workload  # noqa: E402


def time_calls(fn, calls: int, sync, warmup: int = 3) -> tuple[float, float]:
    """``(enqueue ms, wall ms)`` per call of ``fn`` over ``calls`` calls after ``warmup`` untimed ones:
    enqueue is the host time with no synchronization inside the loop, wall adds a final ``sync()``."""
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueue = time.perf_counter() - start
    sync()
    wall = time.perf_counter() - start
    return enqueue * 1e3 / calls, wall * 1e3 / calls


def _step_fn(fn, model, inputs, train: bool, dtype: str, device: str = "cuda"):
    outs_holder = {}

    def step():
        for p in model.parameters():
            p.grad = None
        for x in inputs:
            if isinstance(x, torch.Tensor):
                x.grad = None
        ctx = (torch.autocast(device, torch.bfloat16) if dtype == "bf16"
               else torch.autocast(device, enabled=False))
        with ctx:
            out = fn(*inputs)
        if train:
            tensors = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
            if "grads" not in outs_holder:
                gen = torch.Generator(device=device).manual_seed(1)
                outs_holder["grads"] = [torch.randn(t.shape, device=device, dtype=t.dtype, generator=gen)
                                        for t in tensors]
            torch.autograd.backward(tensors, outs_holder["grads"])
        return out

    return step


def profile_one(path: str, backend_name: str, mode: str, dtype: str, steps: int, top: int) -> None:
    workload = load_workload(path)
    model, inputs = workload.build(seed=0)
    train = mode == "train"
    model = workload.set_mode(model.cuda(), mode)
    inputs = [x.cuda().requires_grad_(train and x.is_floating_point()) if isinstance(x, torch.Tensor) else x
              for x in inputs]
    torch._dynamo.reset()
    backend = resolve_backend(backend_name)
    fn = backend.compile(model)
    step = _step_fn(fn, model, inputs, train, dtype)
    with torch.no_grad() if not train else torch.enable_grad():
        step()
        settle()  # decisions the fusion backend deferred past the first call: profile the settled code
        _, wall_ms = time_calls(step, steps, torch.cuda.synchronize)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    kernels = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total, calls = kernels.get(evt.name, (0.0, 0))
            kernels[evt.name] = (total + evt.device_time, calls + 1)
    gpu_ms = sum(t for t, _ in kernels.values()) / 1e3 / steps
    print(f"\n== {workload.name} {dtype} {mode} {backend_name}: GPU {gpu_ms:.3f} ms/step, "
          f"host wall {wall_ms:.3f} ms/step")
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    for name, (total_us, calls) in rows:
        per_step = total_us / 1e3 / steps
        print(f"  {per_step:8.3f} ms  {calls / steps:4.1f}x  {per_step / max(gpu_ms, 1e-9):5.1%}  {name[:110]}")
    _print_host_side(prof, steps)


def _print_host_side(prof, steps: int) -> None:
    """CUDA runtime/driver calls per step (a synchronizing call or an allocation explains a host wall
    above the kernels' time) and the longest gaps in which the GPU ran no kernel."""
    api: dict[str, tuple[float, int]] = {}
    spans = []
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((evt.time_range.start, evt.time_range.end, evt.name))
        elif evt.name.startswith(("cuda", "cu")) and not evt.name.startswith("cudaLaunchKernel"):
            total, calls = api.get(evt.name, (0.0, 0))
            api[evt.name] = (total + evt.cpu_time_total, calls + 1)
    print("  host-side CUDA API calls (excluding kernel launches), per step:")
    for name, (total_us, calls) in sorted(api.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"    {total_us / steps:8.1f} us  {calls / steps:5.1f}x  {name}")
    spans.sort()
    gaps = [(b[0] - a[1], a[2], b[2]) for a, b in zip(spans, spans[1:], strict=False) if b[0] > a[1]]
    print("  longest GPU idle gaps (us, kernel before -> kernel after):")
    for gap, before, after in sorted(gaps, reverse=True)[:6]:
        print(f"    {gap:8.1f}  {before[:50]} -> {after[:50]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--backends", default="inductor,fusion")
    parser.add_argument("--mode", default="infer,train")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs CUDA")
    for path in args.files:
        for dtype in args.dtype.split(","):
            for mode in args.mode.split(","):
                for backend in args.backends.split(","):
                    try:
                        profile_one(path, backend, mode, dtype, args.steps, args.top)
                    except Exception as exc:  # one failing case must not hide the others
                        print(f"\n== {path} {dtype} {mode} {backend}: FAILED {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
