"""Host (Python) time of a compiled step, function by function: is the GPU waiting on us?

Compiles each benchmark model file with ``backend`` on CUDA, warms up, then runs ``--steps`` steps
under ``cProfile`` with autograd's worker threads off (``set_multithreading_enabled(False)``), so the
backward's Python (our custom ops' backward) runs in the profiled thread too.  Prints the host wall
time per step, the GPU time per step is in ``tools/profile_step.py``.  A host time per step above the
GPU's means the GPU idles between launches; a single function with a large ``tottime`` that is a CUDA
sync (``synchronize``, ``item``, ``cpu``, a pageable copy) serializes host and device.

Usage (repository root, needs CUDA)::

    python tools/host_profile.py demos/seeds/convt2d_global_mean_bias_logsumexp.py demos/seeds/conv2d_mul_leaky_gelu_small.py --mode train
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import _step_fn, time_calls  # noqa: E402

from fusion_backend.bench.backends import resolve_backend  # noqa: E402
from fusion_backend.bench.suite import load_workload  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _shrink(x: object) -> object:
    """``x`` cut to batch 2 and spatial size <= 32 (the host path is the same; the GPU work ~0)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        return x
    index = (slice(0, 2), slice(None), *[slice(0, 32)] * (x.dim() - 2))
    return x[index].contiguous()


def profile_one(path: str, backend_name: str, mode: str, steps: int, top: int, device: str,
                small: bool, dtype: str = "fp32") -> None:
    workload = load_workload(path)
    model, inputs = workload.build(seed=0)
    if small:
        inputs = [_shrink(x) for x in inputs]
    train = mode == "train"
    model = workload.set_mode(model.to(device), mode)
    inputs = [x.to(device).requires_grad_(train and x.is_floating_point()) if isinstance(x, torch.Tensor) else x
              for x in inputs]
    torch._dynamo.reset()
    fn = resolve_backend(backend_name).compile(model)
    step = _step_fn(fn, model, inputs, train, dtype, device)
    grad_mode = torch.enable_grad() if train else torch.no_grad()
    sync = functools.partial(_sync, device)
    with grad_mode:  # the default: CUDA backward nodes run on autograd's device thread
        threaded_ms, _ = time_calls(step, steps, sync)
    with grad_mode, torch.autograd.set_multithreading_enabled(False):
        host_ms, wall_ms = time_calls(step, steps, sync)
        # the forward alone (in train mode its graph is dropped unused)
        def forward() -> object:
            with torch.autocast(device, torch.bfloat16, enabled=dtype == "bf16"):
                return fn(*inputs)

        forward_ms, _ = time_calls(forward, steps, sync, warmup=0)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        _sync(device)
        prof.disable()
    print(f"\n== {workload.name} {mode} {dtype} {backend_name}: host enqueue {host_ms:.3f} ms/step, "
          f"wall with final sync {wall_ms:.3f} ms/step, forward alone {forward_ms:.3f} ms; "
          f"with autograd's device threads (default) {threaded_ms:.3f} ms/step")
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(r"fusion_backend|triton/runtime|_library|custom_op", top)
    text = buf.getvalue()
    print("\n".join(line for line in text.splitlines() if line.strip() and "Ordered by" not in line
                    and "function calls" not in line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--backend", default="fusion", help="comma-separated backends")
    parser.add_argument("--mode", default="infer,train")
    parser.add_argument("--dtype", default="fp32", help="comma-separated: fp32 and/or bf16 (autocast)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", default="cuda", help="cpu: the reference path's host time (no kernels)")
    parser.add_argument("--small", action="store_true",
                        help="shrink inputs to batch 2, spatial <= 32: the GPU work ~0, so enqueue time = host cost")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("host_profile.py needs CUDA")
    for path in args.files:
        for mode in args.mode.split(","):
            try:
                for backend in args.backend.split(","):
                    for dtype in args.dtype.split(","):
                        profile_one(path, backend, mode, args.steps, args.top, args.device, args.small, dtype)
            except Exception as exc:
                print(f"\n== {path} {mode}: FAILED {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
