"""Host time per call of what a fused step launches, on CUDA at tiny shapes (GPU work ~0).

A step is host-bound when the Python that enqueues its kernels takes longer than the kernels run:
then every benchmark (each repetition starts on an idle GPU) pays the host time.  This prints, in
microseconds of host time per call (``--calls`` calls back to back, no synchronization inside):

* a trivial Triton kernel launch and ``torch.empty`` (the floors any launcher pays);
* each ``conv_global_mean`` launcher alone, the fused op's forward / backward (through the custom
  op and through the undecorated function), and its autograd step;
* compiled steps of the ``seeds-small`` suite's models with ``fusion`` and with ``inductor``;
* a cProfile of the op's direct forward and backward (top functions by own time).

Usage (repository root, needs CUDA)::

    python tools/host_overhead.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_conv_global_mean import build_cases  # noqa: E402
from profile_step import _step_fn, time_calls  # noqa: E402

from fusion_backend.bench.backends import resolve_backend  # noqa: E402
from fusion_backend.bench.suite import load_workload  # noqa: E402
from fusion_backend.kernels.launch import FastLaunch  # noqa: E402


@triton.jit
def _noop_kernel(ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs < n)


def host_us(fn: Callable[[], object], calls: int) -> float:
    return time_calls(fn, calls, torch.cuda.synchronize, warmup=10)[0] * 1e3


def compiled_steps(path: str, backend: str, calls: int) -> None:
    workload = load_workload(path)
    for mode in ("infer", "train"):
        model, inputs = workload.build(seed=0)
        train = mode == "train"
        model = workload.set_mode(model.cuda(), mode)
        inputs = [x.cuda().requires_grad_(train) if isinstance(x, torch.Tensor) else x for x in inputs]
        torch._dynamo.reset()
        fn = resolve_backend(backend).compile(model)
        step = _step_fn(fn, model, inputs, train, "fp32")
        with torch.enable_grad() if train else torch.no_grad():
            print(f"  {workload.name:14s} {mode:5s} {backend:9s} {host_us(step, calls):9.1f} us/step")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("host_overhead.py needs CUDA")
    calls = 300
    buf = torch.empty(1024, device="cuda")
    print(f"host us per call ({calls} calls, no sync inside), {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"  {'trivial triton launch':44s} {host_us(lambda: _noop_kernel[(1,)](buf, 1024, BLOCK=1024), calls):9.1f}")
    fast_noop = FastLaunch(_noop_kernel, (1,), {"BLOCK": 1024})
    print(f"  {'trivial triton launch, FastLaunch':44s} {host_us(lambda: fast_noop(buf, 1024), calls):9.1f}")
    print(f"  {'torch.empty':44s} {host_us(lambda: torch.empty(1024, device='cuda'), calls):9.1f}")
    from fusion_backend.ops import conv_global_mean as cgm

    _, per_kernel, per_op = build_cases(torch.float32, False, 2, (8, 8))
    with torch.no_grad():
        for name, fn in per_kernel.items():
            print(f"  {name:44s} {host_us(fn, calls):9.1f}")
        forward, backward = per_op["op forward"], per_op["op backward"]
        print(f"  {'op forward (no grad)':44s} {host_us(forward, calls):9.1f}")
        print(f"  {'op backward (no grad)':44s} {host_us(backward, calls):9.1f}")
        # the same calls with the custom-op layers (dispatcher, autograd key, alias checks) bypassed
        ops = cgm.conv_global_mean_fwd, cgm.conv_global_mean_bwd
        cgm.conv_global_mean_fwd, cgm.conv_global_mean_bwd = (op._init_fn for op in ops)
        try:
            print(f"  {'op forward, undecorated function':44s} {host_us(forward, calls):9.1f}")
            print(f"  {'op backward, undecorated function':44s} {host_us(backward, calls):9.1f}")
        finally:
            cgm.conv_global_mean_fwd, cgm.conv_global_mean_bwd = ops
    print(f"  {'op forward + backward (autograd)':44s} {host_us(per_op['op forward + backward (autograd)'], calls):9.1f}")
    del cgm
    for name in ("convt2d_global_mean_bias_logsumexp_small", "conv2d_mul_leaky_gelu_small"):
        path = f"demos/seeds/{name}.py"
        for backend in ("inductor", "fusion"):
            try:
                compiled_steps(path, backend, calls)
            except Exception:
                traceback.print_exc(limit=-8)
    for name in ("op forward", "op backward"):
        prof = cProfile.Profile()
        with torch.no_grad():
            prof.enable()
            for _ in range(calls):
                per_op[name]()
            prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        print(f"\n== cProfile {name}, {calls} calls")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
