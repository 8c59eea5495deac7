"""The last program to arrive (``kernels/arrival.py``): exactly one program of each group finds itself
last, after every other program's stores, and leaves the group's counter zero for the next launch."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fusion_backend.kernels import arrival
from fusion_backend.kernels.arrival import last_to_arrive

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@triton.jit
def _sum_parts_kernel(x_ptr, part_ptr, out_ptr, last_ptr, count_ptr, N, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    """Group ``g = program_id(0)``'s programs ``program_id(1)`` each sum a block of row ``g`` of ``x`` into
    ``part``; the last to arrive sums the parts in order into ``out[g]`` and counts itself in ``last[g]``."""
    g = tl.program_id(0)
    j = tl.program_id(1)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + g * N + offs, mask=offs < N, other=0.0)
    tl.store(part_ptr + g * PARTS + j, tl.sum(v, axis=0))
    if last_to_arrive(count_ptr + g, tl.num_programs(1)):
        p = tl.arange(0, PARTS)
        parts = tl.load(part_ptr + g * PARTS + p, mask=p < tl.num_programs(1), other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + g, tl.sum(parts, axis=0))
        tl.atomic_add(last_ptr + g, 1)


@pytest.mark.parametrize("groups,parts", [(1, 2), (3, 7), (5, 64)])
def test_one_last_program_per_group_sees_every_part_and_leaves_the_counter_zero(groups: int, parts: int) -> None:
    n, block = parts * 32 - 5, 32
    x = torch.randn(groups, n, device=DEVICE)
    counts = arrival.counters(torch.device(DEVICE), groups)
    for _ in range(3):  # launch after launch on the counters the last left
        part = torch.full((groups, triton.next_power_of_2(parts)), float("nan"), device=DEVICE)
        out = torch.empty(groups, device=DEVICE)
        last = torch.zeros(groups, dtype=torch.int32, device=DEVICE)
        _sum_parts_kernel[(groups, parts)](x, part, out, last, counts, n, BLOCK=block,
                                           PARTS=triton.next_power_of_2(parts))  # fmt: skip
        assert last.tolist() == [1] * groups
        torch.testing.assert_close(out, x.sum(1), rtol=1e-5, atol=1e-4)
        assert not counts[:groups].any()


def test_counters_are_kept_per_device_and_stream_and_grow_to_what_is_asked() -> None:
    device = torch.device(DEVICE)
    small = arrival.counters(device, 3)
    assert small.dtype == torch.int32 and small.numel() >= 3 and not small.any()
    assert arrival.counters(device, 3) is small  # the same set for the same stream
    big = arrival.counters(device, small.numel() + 1)
    assert big.numel() > small.numel() and not big.any()
    assert any(t is small for t in arrival._RETIRED)  # replaced, never freed: queued launches may count on it
    if DEVICE == "cuda":
        with torch.cuda.stream(torch.cuda.Stream()):
            assert arrival.counters(device, 3).data_ptr() != big.data_ptr()  # another stream, another set


@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA graph's memory pool")
def test_a_set_made_while_the_thread_allocates_from_a_graph_pool_is_not_in_that_pool() -> None:
    """What ``torch.compile(mode="reduce-overhead")`` does around a graph's first calls: the thread's
    allocations go to the graph's pool, and afterwards every live block there must be an output."""
    index = torch.cuda.current_device()
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(torch.cuda.Stream()):  # a stream without a set yet
        torch._C._cuda_beginAllocateCurrentThreadToPool(index, pool)
        try:
            made = arrival.counters(torch.device("cuda", index), 5)
            routed = torch.empty(64, device="cuda")  # an ordinary allocation: in the pool
        finally:
            torch._C._cuda_endAllocateToPool(index, pool)
    assert made.numel() >= 5 and not made.any()
    assert torch._C._cuda_checkPoolLiveAllocations(index, pool, {routed.untyped_storage().data_ptr()})
    del routed
    torch._C._cuda_releasePool(index, pool)
