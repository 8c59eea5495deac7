"""Host-side helpers shared by the kernel launchers: plain-int arithmetic, persistent device tables.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function``s in recent Triton: called
from host code they unwrap their arguments through Triton's machinery, a few microseconds each.
The launchers call them several times per launch, and at the ``seeds`` suite's sizes host time is
what a training step waits on (``docs/perf/RESULTS.md``, *Kernel design measurements*), so the launchers use these plain-int versions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import environment

# Re-exported where the op layer imports them from (the same objects as ``plan_cache``'s).
from .plan_cache import PlanCache as BoundedCache  # noqa: F401
from .plan_cache import forget_call_plans as forget_call_plans
from .plan_cache import tensor_key as tensor_key

#: Whether Triton's interpreter was on when the kernels were defined (``TRITON_INTERPRET`` is read
#: as ``@triton.jit`` decorates a kernel, and this module is imported before any kernel module).  The
#: one place the kernel modules learn it from (their ``_INTERPRET``).
INTERPRETER = environment.triton_interpreter()


def cpu_kernels_unavailable() -> str | None:
    """Why the Triton kernels cannot run on CPU tensors (``None`` when they can): they run there
    only under Triton's interpreter, asked for with ``FUSION_CPU_KERNELS=triton``."""
    cpu_kernels_env = environment.CPU_KERNELS
    if not environment.cpu_kernels_triton():
        return (f"ran the CPU reference; set {cpu_kernels_env}=triton and TRITON_INTERPRET=1 to run the Triton "
                "kernels under the interpreter")
    if not INTERPRETER:
        return (f"ran the CPU reference: {cpu_kernels_env}=triton needs TRITON_INTERPRET=1 in the environment "
                "before the process starts (Triton kernels run on CPU tensors only under its interpreter)")
    return None


#: The dtypes the fused ops' Triton kernels compute in on CUDA, and under the interpreter on CPU.
#: NOTE: Triton's interpreter has no bf16 (numpy has no such type).
CUDA_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_KERNEL_DTYPES = (torch.float32, torch.float16)


def kernels_unavailable(dtype: torch.dtype, device_type: str) -> str | None:
    """Why no Triton kernel runs on ``device_type`` tensors of ``dtype`` (``None`` when one can):
    what every fused op checks before its own limits."""
    if device_type == "cuda":
        if dtype not in CUDA_KERNEL_DTYPES:
            return f"no Triton kernel for {dtype} (kernels cover float32, float16, bfloat16)"
        return None
    if device_type == "cpu":
        why = cpu_kernels_unavailable()
        if why is None and dtype not in INTERPRETER_KERNEL_DTYPES:
            why = f"the Triton interpreter has no {dtype} kernels (float32, float16 only)"
        return why
    return f"no Triton kernels for device type {device_type!r}"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def multiprocessors(device: torch.device) -> int:
    """The device's SM count; an H100's 132 for a CPU device (``tools/compile_check.py`` records the
    launches of CPU tensors, and the CPU tests plan launches as on that GPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


#: The most tiles one autotuned kernel times on its first call with a new key.  Every tile compiles
#: before it is timed (0.3-1 s each on the H100 host), and a first call that sweeps ten tiles per
#: kernel made the first compile 3-9x Inductor's; each kernel's tiles are listed best first (its
#: ``NOTE``s say where that order was measured), so the first few are the ones worth timing.
MAX_TUNED_CONFIGS = 3


def best_first(configs: list, limit: int = MAX_TUNED_CONFIGS) -> list:
    """The first ``limit`` of ``configs`` (a pruner's last step; see ``MAX_TUNED_CONFIGS``)."""
    return configs[:limit]


#: Milliseconds of warm-up and of timed repetitions per tile when Triton's autotuner times the tiles
#: of a new key (``tile_bench``).  Triton's default, 25 + 100 ms, made timing the ``best_first``
#: tiles of one kernel about 0.4 s of a first call once they compile at once; 20 ms is still 10 to
#: 2000 calls of the package's tuned kernels (0.01-2 ms each on the H100), whose median ranks them.
TILE_BENCH_MS = (5, 20)


def tile_bench(kernel_call: Callable[[], object], quantiles: Sequence[float] | None = None) -> Any:
    """The ``do_bench`` every ``triton.autotune`` of the package passes (see ``TILE_BENCH_MS``), its loop
    run with room on the frame stack (``frame_room.py``)."""
    from triton.testing import do_bench

    from ..frame_room import call_with_frame_room

    warmup, rep = TILE_BENCH_MS
    return call_with_frame_room(lambda: do_bench(kernel_call, warmup=warmup, rep=rep, quantiles=quantiles))


def persistent_device_copies(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copies of small host tensors on ``device`` for a cache that keeps them for the process.

    NOTE: on CUDA the copies are allocated and made on a side stream, synchronized before returning.
    Under CUDA-graph trees (``torch.compile(mode="reduce-overhead")``) the warm-up and recording
    calls allocate from the graph's private memory pool, but only on the current stream; a cached
    tensor left in that pool is a live allocation the graph does not track ("Detected N tensor(s) in
    the cudagraph pool not tracked as outputs").  A side stream's allocations come from the ordinary
    pool.  The caches holding these copies never evict (a recorded graph keeps their addresses), so
    the block is never reused by another stream.
    """
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        copies = [t.to(device) for t in tensors]
    side.synchronize()
    return copies


def lift_5d(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Sizes and element strides of ``t`` (N, C, *spatial with 1..3 dims) as (N, C, D, H, W): a 1-d or
    2-d tensor gets leading spatial dims of size 1 and stride 0, so one kernel serves every rank."""
    if not 3 <= t.dim() <= 5:
        raise ValueError(f"expected a (N, C, *spatial) tensor with 1 to 3 spatial dims, got shape {tuple(t.shape)}")
    pad = 5 - t.dim()
    sizes = [t.shape[0], t.shape[1]] + [1] * pad + list(t.shape[2:])
    strides = [t.stride(0), t.stride(1)] + [0] * pad + list(t.stride()[2:])
    return sizes, strides


def lift3(values: Sequence[int], fill: int) -> tuple[int, int, int]:
    """Per-spatial-dim ``values`` (1 to 3 of them) lifted to 3 dims with ``fill`` in front."""
    return tuple([fill] * (3 - len(values)) + [int(v) for v in values])  # type: ignore[return-value]


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive slots (non-overlapping and dense: any
    permutation of the dims, size-1 dims' strides aside)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def element_extent(t: torch.Tensor) -> int:
    """One past the largest element offset ``t`` addresses (0 when empty)."""
    if t.numel() == 0:
        return 0
    return sum((size - 1) * abs(st) for size, st in zip(t.shape, t.stride(), strict=True)) + 1
