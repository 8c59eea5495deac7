"""How long the project's kernels take to compile one after another, on threads and on processes.

    python tools/compile_parallel.py MODES JOB:CASE[,JOB:CASE...]
    python tools/compile_parallel.py serial,16,proc16 conv_fused:convt3d-fp32-save,conv_fused_bwd:conv2d-fp32

MODES: ``serial``; ``N`` (a pool of N threads); ``procN`` (N forked processes).  The kernels are the
launches ``tools/compile_check.py``'s job cases record (every tile of a tiled kernel), each compiled
once per mode for sm_90a into a fresh Triton cache folder; the last line of each mode gives its wall
time, the sum of the compiles' own times and the longest.  Threads show how much of a compile holds
the GIL (``kernels/compile_pool.py`` says why the backend compiles in worker processes).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("FUSION_CONV_AUTOTUNE", "0")

import compile_check  # noqa: E402
import kernel_compile  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SPECS: list[kernel_compile.Specialisation] = []


def specialisations(job_cases: list[str]) -> list[kernel_compile.Specialisation]:
    """Each distinct specialisation the job cases launch (a tiled kernel: each of its tiles)."""
    found: dict[str, kernel_compile.Specialisation] = {}
    for job_case in job_cases:
        job_name, case = job_case.split(":")
        job = compile_check.JOBS[job_name]
        with kernel_compile.recording() as launches:
            job.cases[case]()
        tiled = {t.kernel: t for t in job.tiled}
        for launch in launches:
            tiles = tiled[launch.name].tiles(launch) if launch.name in tiled else None
            for variant in [launch.with_tile(t) for t in tiles] if tiles else [launch]:
                spec = kernel_compile.specialise(variant)
                found.setdefault(spec.key(), spec)
    return list(found.values())


def compile_one(index: int) -> float:
    spec = SPECS[index]
    began = time.perf_counter()
    triton.compile(ASTSource(spec.kernel, spec.signature, spec.constexprs, spec.attrs), target=kernel_compile.TARGET,
                   options=spec.options.__dict__)  # fmt: skip
    return time.perf_counter() - began


def main() -> int:
    modes, job_cases = sys.argv[1].split(","), sys.argv[2].split(",")
    SPECS.extend(specialisations(job_cases))
    print(f"{len(SPECS)} specialisations", flush=True)
    for mode in modes:
        folder = tempfile.mkdtemp(prefix="compile_parallel_")
        os.environ["TRITON_CACHE_DIR"] = folder  # forked processes read it too
        knobs.cache.dir = folder
        began = time.perf_counter()
        indices = range(len(SPECS))
        if mode == "serial":
            seconds = [compile_one(i) for i in indices]
        elif mode.startswith("proc"):
            with ProcessPoolExecutor(int(mode[4:]), mp_context=multiprocessing.get_context("fork")) as pool:
                seconds = list(pool.map(compile_one, indices))
        else:
            with ThreadPoolExecutor(int(mode)) as pool:
                seconds = list(pool.map(compile_one, indices))
        print(f"{mode}: wall {time.perf_counter() - began:.2f} s, compiles {sum(seconds):.2f} s in all, "
              f"longest {max(seconds):.2f} s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
