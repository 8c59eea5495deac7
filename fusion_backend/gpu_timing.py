"""Device time of host-bound calls: queue them behind a GPU spin so that they run back to back.

Used by the two measured choices: which of a fused op's paths runs (``impl_choice.py``) and
whether a region is fused at all (``runtime/region_timing.py``).  The spin (``torch.cuda._sleep``)
keeps the device busy while the host enqueues the calls, so the events around them see the calls'
device work without the host's gaps, however slow the host is.  If the host took longer than the
spin to enqueue them, the device may have waited on it: the caller sees that (``enqueue_ms >=
cover_ms``) and decides what to do (retry with a longer spin, or take the number as an upper bound).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from .frame_room import call_with_frame_room


@functools.cache
def spin_cycles_per_ms(device: int) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond on CUDA device ``device`` (measured once)."""
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000)  # loads the kernel
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        return 2_000_000 / max(start.elapsed_time(end), 1e-3)


def queued_ms(fn: Callable[[], object], calls: int, cover_ms: float) -> tuple[float, float]:
    """``(device ms per call, host enqueue ms)`` of ``calls`` back-to-back calls of ``fn`` on the
    current CUDA device, queued behind a spin of ``cover_ms`` (called with room on the frame stack:
    ``frame_room.py``)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed() -> float:
        torch.cuda._sleep(int(cover_ms * spin_cycles_per_ms(torch.cuda.current_device())))
        began = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        return (time.perf_counter() - began) * 1e3

    enqueue_ms = call_with_frame_room(timed)
    end.synchronize()
    return start.elapsed_time(end) / calls, enqueue_ms
