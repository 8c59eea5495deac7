"""The last program to arrive: a two-stage reduction in one launch.

A reduction whose parts are made by many programs (each a span of tiles or slots) and then combined
needs every part stored before the combination reads them.  As two launches, the second adds the gap
between two launches for a few hundred bytes of work, once per call (1.6-1.9 us on the H200:
``docs/perf/RESULTS.md``, "The statistics' reduction and BatchNorm's form in one launch").  Here each
program, once its part is stored, counts its arrival on a counter it shares with the programs whose
parts are combined together, and the one that arrives last (:func:`last_to_arrive`) combines them,
reading them in their fixed order: the result is the same bits whichever program that is (no atomics
touch the values).

Contract of :func:`counters`: int32 zeros in global memory, kept per device and stream.  A launch's
last program sets its group's counter back to 0, so every launch finds them zero and none pays a
memset; launches on one stream never overlap (no programmatic dependent launch), so a stream's
launches share one set; a launch on another stream (two streams running one model at once) gets a set
of its own.

Where a set is made.  A set outlives the call that made it, so it must not come from a CUDA graph's
private memory pool: ``torch.compile(mode="reduce-overhead")`` runs a graph's first calls with the
thread's allocations routed to its pool and then checks that every live block there is one of the
graph's outputs (a set made there failed that check: "Detected 1 tensor(s) in the cudagraph pool not
tracked as outputs").  So a set is made by a short-lived thread of its own (the routing is per thread),
on a stream of its own that the maker waits for.  While the current stream is being captured (where that
thread could not allocate) the set is made in place, inside the capture: its replays zero it again
before the kernels that use it, and the capture stream's later graphs find it zero as every launch
leaves it.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

#: counters per ``(device, stream)``; each set at least this many, grown to the largest asked for
_MIN_SLOTS = 1024
_SETS: dict[tuple[str, int | None, int], torch.Tensor] = {}
#: sets replaced by larger ones, never freed: made on a stream of their own, their memory would return to
#: that stream's cache while kernels queued on the launch streams may still count on them
_RETIRED: list[torch.Tensor] = []


def counters(device: torch.device, slots: int) -> torch.Tensor:
    """int32 zeros, at least ``slots`` of them, for launches on ``device``'s current stream (module
    docstring); a launch uses slots ``[0, slots)`` and leaves them zero."""
    # Keyed by plain values, the device built only on a miss: this runs on every launch's host path.
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        key = ("cuda", index, torch._C._cuda_getCurrentRawStream(index))
    else:
        key = (device.type, device.index, 0)
    have = _SETS.get(key)
    if have is None or have.numel() < slots:
        if have is not None:
            _RETIRED.append(have)
        have = _zeros(max(slots, _MIN_SLOTS), torch.device(key[0], key[1]))
        _SETS[key] = have
    return have


def _zeros(count: int, device: torch.device) -> torch.Tensor:
    """int32 zeros on ``device`` that no CUDA graph's memory pool holds (module docstring)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    made: list[torch.Tensor] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                made.append(torch.zeros(count, dtype=torch.int32, device=device))
            stream.synchronize()
        except BaseException as e:  # re-raised by the caller's thread
            failed.append(e)

    maker = threading.Thread(target=make, name="fusion-arrival-counters")
    maker.start()
    maker.join()
    if failed:
        raise failed[0]
    return made[0]


@triton.jit
def last_to_arrive(counter_ptr, programs):
    """Whether the calling program is the last of ``programs`` to arrive at ``counter_ptr`` (int32,
    shared by them and zero at the launch's start); every global store the others made before they
    arrived is then visible to its loads (read them with ``cache_modifier=".cg"``: not through L1).  The
    last one sets the counter back to 0.  Call once per program, after its stores."""
    tl.debug_barrier()  # every thread's stores issued before the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == programs - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last

