"""Time to steady state (first call + settle) of a compiled model with cold and with warm disk caches, per backend.

The benchmark's ``compile_s`` is measured in one process where eager and Inductor compiled the same
workload just before, so its caches are partly warm.  This tool measures what a user sees:

* **cold**: a fresh process with empty Inductor, Triton and fusion cache folders;
* **warm**: a second fresh process on the caches the cold one left (a re-run of the same script); the
  median of ``--warm-runs`` such processes, alternating between the backends.

Each measurement is its own process (``--child``): the model file is loaded as the benchmark loads it,
built on CUDA, compiled with the backend, and its first step (forward; ``--mode train`` adds the
backward) is timed from the ``torch.compile`` call to the end of its GPU work, compilation included.  Process start-up and
imports are not counted.  ``--log`` prints the children's ``fusion_backend.runtime.decision`` and
``fusion_backend.impl_choice`` and ``fusion_backend.launch`` INFO lines, each with the milliseconds since the
child started (``torch.compile`` is its own line): what each first call compiled and timed, and when.  ``--profile N``
prints the N entries of each warm first call's ``cProfile`` with the most cumulative time, among the backend's, Triton's,
Dynamo's and Inductor's functions: where a first call that logs nothing spends its time (the cold runs are not
profiled: the profiler's overhead would skew the decisions they measure and cache for the warm runs).  Where the fusion backend
deferred decisions past the first call, the child settles them (``fusion_backend.settle()``) and the settle counts:
what is compared is the time to steady state, first call + settle.  Each child's time is printed as
it is measured (a run cut short keeps what it measured); the last lines compare every backend with Inductor
against the budgets ``--cold-budget`` (3x; whole networks are held to 1.25x) and ``--warm-budget`` (1.2x).
``--compile-mode`` passes ``torch.compile``'s mode (``reduce-overhead``: CUDA graphs).

Usage (repository root; ``--device cpu`` measures CPU compiles, where fused regions stay with Inductor
unless ``FUSION_DECIDE=fuse``)::

    python tools/first_call.py demos/convnets/conv3d_32_64_k3_leaky_maxpool.py --mode infer --dtype fp32
    python tools/first_call.py demos/realnets/wav2vec2_base.py --dtype bf16 --compile-mode reduce-overhead \
        --cold-budget 1.25 --warm-runs 0
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

#: The cache folders each backend's children get their own of.  ``TRITON_CACHE_DIR`` is left unset, as a
#: user's is (where Triton files kernels then follows what the process set up, Inductor's folder or
#: Triton's default), and ``HOME`` is the backend's folder, so that Triton's default is fresh too.
CACHE_ENVS = ("TORCHINDUCTOR_CACHE_DIR", "FUSION_CACHE_DIR", "HOME")


#: The functions ``--profile`` ranks: the backend's, Triton's runtime and compiler, Inductor's compile
#: and its caches (module imports left out: a first call imports most of Dynamo and Inductor).
PROFILED = (r"fusion_backend|triton/(runtime|compiler|backends)|torch/_inductor/(compile_fx|codecache|async_compile)"
            r"|torch/_functorch/_aot_autograd/(autograd_cache|runtime_wrappers)|torch/_dynamo/(output_graph|convert_frame)")


def child(path: str, backend: str, mode: str, dtype: str, log: bool, device: str, profile: int = 0,
          warm_process: bool = False, compile_mode: str | None = None) -> None:
    """Build, compile and run one first step, then settle what the backend deferred; print
    ``{"first_call_s": ..., "settle_s": ...}`` as the last line (and,
    with ``profile``, that many ``cProfile`` entries to stderr, each line starting ``    profile``).
    ``warm_process``: first run the step through Dynamo's ``eager`` backend and compile a small
    unrelated function with Inductor, then reset Dynamo: the process is warm (imports, CUDA context,
    Inductor's worker processes, Triton's source hash) as the benchmark's is at a backend's first
    call, and no backend has this graph in its in-process caches; not counted."""
    import cProfile
    import io
    import logging
    import pstats

    import torch

    if log:
        logging.basicConfig(level=logging.WARNING, format="    %(relativeCreated)7.0f ms %(name)s: %(message)s")
        for name in ("fusion_backend.decision", "fusion_backend.impl_choice", "fusion_backend.launch",
                     "fusion_backend.first_call"):
            logging.getLogger(name).setLevel(logging.INFO)

    from fusion_backend.bench.suite import load_workload

    workload = load_workload(path)
    model, inputs = workload.build(seed=0)
    model = workload.set_mode(model.to(device), mode)
    inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    train = mode == "train"
    if train:
        inputs = [t.requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                  for t in inputs]
    if warm_process:
        with torch.set_grad_enabled(train), torch.autocast(device, torch.bfloat16, enabled=dtype == "bf16"):
            _step(copy.deepcopy(model), "eager", inputs, train)
        torch.compile(lambda t: torch.nn.functional.gelu(t) * 2, backend="inductor")(torch.randn(5, 7, device=device))
        torch._dynamo.reset()
    sync()
    # from torch.compile on, as the benchmark's compile_s: torch.compile(backend="inductor") imports
    # Inductor's compile_fx there (about 1 s), which the fusion backend imports at its first call
    began = time.perf_counter()
    if log:
        logging.getLogger("fusion_backend.first_call").warning("torch.compile")
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    from fusion_backend.report import collect_reports

    with torch.set_grad_enabled(train), torch.autocast(device, torch.bfloat16, enabled=dtype == "bf16"), \
            collect_reports() as reports:
        _step(model, backend, inputs, train, compile_mode)
    sync()
    first_call_s = time.perf_counter() - began
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
        stats.print_stats(PROFILED, r"^(?!.*\(<module>\)).*$", profile)
        rows = [line for line in text.getvalue().splitlines() if line.strip()]
        start = next((i for i, line in enumerate(rows) if line.lstrip().startswith("ncalls")), 0)
        print("\n".join(f"    profile {line}" for line in rows[start:]), file=sys.stderr)
    for report in reports:  # where the backend's own share of the first call went
        stages = ", ".join(f"{k} {v:.2f} s" for k, v in report.stage_seconds.items())
        print(f"    {report.graph_name}: {stages}", file=sys.stderr)
    from fusion_backend.runtime.deferred import any_pending, settle

    settle_s = 0.0
    if any_pending(reports):  # fusion deferred decisions: when they settle
        settle_began = time.perf_counter()
        settle()
        sync()
        settle_s = time.perf_counter() - settle_began
        print(f"    graphs settled {settle_s:.2f} s after the first call", file=sys.stderr)
    print(json.dumps({"first_call_s": first_call_s, "settle_s": settle_s}))


def _step(model: Any, backend: str, inputs: list, train: bool, compile_mode: str | None = None) -> None:
    """Compile ``model`` with ``backend`` (and ``compile_mode``, e.g. ``reduce-overhead``) and run one
    step (forward; with ``train``, the backward of its outputs' sums)."""
    import logging

    import torch

    stamp = logging.getLogger("fusion_backend.first_call")
    out = torch.compile(model, backend=backend, mode=compile_mode)(*inputs)
    stamp.info("forward returned")
    if train:
        outs = out if isinstance(out, (tuple, list)) else [out]
        torch.autograd.backward([o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad])
        stamp.info("backward returned")


def measure(path: str, backend: str, mode: str, dtype: str, caches: str, timeout: float, log: bool,
            device: str, profile: int = 0, warm_process: bool = False,
            compile_mode: str | None = None) -> tuple[float, float]:
    """One child process's first call and settle (seconds) with the cache folders under ``caches``."""
    env = dict(os.environ, **{name: os.path.join(caches, name.lower()) for name in CACHE_ENVS})
    env.pop("TRITON_CACHE_DIR", None)
    cmd = [sys.executable, __file__, path, "--child", "--backends", backend, "--mode", mode, "--dtype", dtype]
    cmd += ["--device", device, "--profile", str(profile)] + (["--log"] if log else [])
    cmd += ["--warm-process"] if warm_process else []
    cmd += ["--compile-mode", compile_mode] if compile_mode else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if profile:
        print(f"  {backend}: the first call's {profile} functions with the most cumulative time")
    for line in proc.stderr.splitlines():
        if (log and line.startswith("    ") and " fusion_backend" in line) or line.startswith(("    profile ", "    graph_", "    graphs settled")):
            print(line)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{backend} {mode} {dtype}: the child process failed ({tail})")
    result = json.loads(lines[-1])
    return float(result["first_call_s"]), float(result["settle_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model file in the benchmark layout")
    parser.add_argument("--backends", default="inductor,fusion", help="comma-separated (default: inductor,fusion)")
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile-mode", default=None, help="torch.compile's mode, e.g. reduce-overhead")
    parser.add_argument("--cold-budget", type=float, default=3.0,
                        help="cold time to steady state / Inductor's (default: 3; whole networks: 1.25)")
    parser.add_argument("--warm-budget", type=float, default=1.2, help="warm time to steady state / Inductor's (default: 1.2)")
    parser.add_argument("--warm-runs", type=int, default=3,
                        help="warm first calls per backend, alternating (default: 3; 0: cold runs only)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    parser.add_argument("--log", action="store_true", help="print what the backend's first calls timed")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print each warm first call's N costliest functions (cProfile, cumulative)")
    parser.add_argument("--warm-process", action="store_true",
                        help="time each first call in a process that compiled and ran the step with Inductor "
                             "just before, as the benchmark's compile_s is")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if args.child:
        child(args.model, backends[0], args.mode, args.dtype, args.log, args.device, args.profile, args.warm_process,
              args.compile_mode)
        return 0
    # Line by line even into a pipe or a file: a time limit's SIGTERM ends the process without flushing.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    times: dict[str, tuple[float, float | None]] = {}
    with contextlib.ExitStack() as stack:
        caches = {b: stack.enter_context(tempfile.TemporaryDirectory(prefix=f"first_call_{b}_")) for b in backends}

        def run(backend: str, which: str, profile: int = args.profile) -> float:
            """One child's time to steady state (first call + settle), printed at once: a run cut
            short by a time limit still says what it measured."""
            first, settle = measure(args.model, backend, args.mode, args.dtype, caches[backend], args.timeout,
                                    args.log, args.device, profile, args.warm_process, args.compile_mode)
            print(f"  {backend} {which}: {first + settle:.2f} s (first call {first:.2f} s + settle {settle:.2f} s)")
            return first + settle

        cold = {b: run(b, "cold", 0) for b in backends}
        # The warm runs alternate between the backends: a warm first call is mostly cache reads and
        # imports, whose time follows the host's state (NOTE: Inductor's own warm first call of the
        # Conv2d 64->64 training step measured 7.7 to 12.6 s in separate runs on the H100 host).
        warm_runs: dict[str, list[float]] = {b: [] for b in backends}
        for i in range(args.warm_runs):
            for b in backends:
                warm_runs[b].append(run(b, f"warm {i + 1}"))
    what = f"{os.path.basename(args.model)} {args.mode} {args.dtype}" + (f" {args.compile_mode}" if args.compile_mode else "")
    for backend in backends:
        warm = statistics.median(warm_runs[backend]) if warm_runs[backend] else None
        times[backend] = cold[backend], warm
        runs = ", ".join(f"{t:.2f}" for t in warm_runs[backend])
        print(f"{what} {backend}: to steady state cold {cold[backend]:.2f} s"
              + (f", warm {warm:.2f} s (median of {runs})" if warm is not None else ""), flush=True)
    ok = True
    if "inductor" in times:
        base_cold, base_warm = times["inductor"]
        for backend, (cold_s, warm_s) in times.items():
            if backend == "inductor":
                continue
            within = cold_s <= args.cold_budget * base_cold
            line = f"{backend} / inductor: cold {cold_s / base_cold:.2f}x (budget {args.cold_budget}x)"
            if warm_s is not None and base_warm is not None:
                within &= warm_s <= args.warm_budget * base_warm
                line += f", warm {warm_s / base_warm:.2f}x (budget {args.warm_budget}x)"
            ok &= within
            print(f"{line}: {'within' if within else 'OVER'}")
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
