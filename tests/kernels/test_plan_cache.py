"""The launchers' base (``kernels/plan_cache.py``): plans kept per key, pointer contracts checked with
a one-line error before any launch, and the reduction kinds' named groups (``kernels/reduction_kind.py``)."""

import pytest
import torch
import triton
import triton.language as tl

from fusion_backend.kernels import plan_cache
from fusion_backend.kernels.chain_math import NUM_PARAM_ROWS
from fusion_backend.kernels.channel_reduce import channel_reduce_forward
from fusion_backend.kernels.plan_cache import ContractError, PlanCache, cached_plans, flat_strides, plan_key
from fusion_backend.kernels.reduction_kind import (
    ReductionKind,
    backward_reads_y,
    is_extremum,
    is_full_size,
    is_kind,
    keeps_winner_index,
    splits_ties,
    sums_exponentials,
    sums_values,
    takes_minimum,
)


def test_plan_is_built_once_per_key_and_again_for_another_layout():
    cache = PlanCache(limit=8)
    built = []

    def plan_for(t: torch.Tensor, flag: bool) -> object:
        return cache.plan((t, flag), lambda: built.append((t.shape, t.stride(), flag)) or len(built))

    x = torch.zeros(2, 3, 4)
    assert plan_for(x, True) == plan_for(torch.ones(2, 3, 4), True) == 1  # same layout: a hit
    assert plan_for(x.transpose(1, 2).contiguous().transpose(1, 2), True) == 2  # other strides: a miss
    assert plan_for(x.half(), True) == 3  # other dtype: a miss
    assert plan_for(x, False) == 4  # another non-tensor part: a miss
    assert len(built) == 4 and len(cache) == 4


def test_plan_key_keys_tensors_by_layout_and_keeps_other_parts():
    x = torch.zeros(2, 3)
    assert plan_key(x, None, (1, 2), "max") == (((2, 3), (3, 1), torch.float32, x.device), None, (1, 2), "max")


def test_cache_keeps_at_most_its_limit_and_a_failed_build_caches_nothing():
    cache = PlanCache(limit=2)
    for k in range(3):
        cache.plan((k,), lambda k=k: k)
    assert cache.peek(plan_key(0)) is None and cache.values() == [1, 2]

    def broken() -> None:
        raise ContractError("x must be contiguous")

    with pytest.raises(ContractError):
        cache.plan(("bad",), broken)
    assert cache.peek(plan_key("bad")) is None


def test_cached_plans_is_forgotten_with_every_other_plan():
    calls = []

    @cached_plans
    def plan(shape: tuple[int, ...]) -> int:
        calls.append(shape)
        return len(calls)

    assert plan((1, 2)) == plan((1, 2)) == 1
    plan_cache.forget_call_plans()
    assert plan((1, 2)) == 2
    plan.cache_clear()
    assert plan((1, 2)) == 3


def test_spatial_dims_that_do_not_flatten_give_a_one_line_contract_error():
    y = torch.zeros(2, 3, 8, 8)
    assert flat_strides("y", y) == (192, 64, 1)
    assert flat_strides("y", y.to(memory_format=torch.channels_last)) == (192, 1, 3)
    with pytest.raises(ContractError, match=r"^y's spatial dims must flatten to one stride, got strides") as err:
        flat_strides("y", y[:, :, :, :4])
    assert "\n" not in str(err.value)


def _reduce_args(device: str, channels: int = 4) -> dict:
    y = torch.randn(2, channels, 3, 5, device=device)
    params = torch.zeros(NUM_PARAM_ROWS, channels, device=device)
    post_params = torch.zeros(NUM_PARAM_ROWS, 1, device=device)
    out = torch.empty(2, 3, 5, device=device)
    return dict(y=y, has_bias=False, pre=(), post=(), kind="max", params=params, post_params=post_params, out=out)


#: One broken argument of a valid ``channel_reduce_forward`` call (built on the kernels' device) and
#: the start of the error it must raise.
BROKEN = {
    "transposed P": (lambda d: {"params": torch.zeros(4, NUM_PARAM_ROWS, device=d).t()},
                     r"^P must be contiguous fp32 with 4 columns"),
    "fp16 Q": (lambda d: {"post_params": torch.zeros(NUM_PARAM_ROWS, 1, dtype=torch.float16, device=d)},
               r"^Q must be contiguous fp32 with 1 columns"),
    "strided y": (lambda d: {"y": torch.randn(2, 4, 3, 10, device=d)[..., :5]}, r"^y's spatial dims must flatten"),
    "out elsewhere": (lambda d: {"out": torch.empty(2, 3, 5, device="meta")},
                      r"^out must be on .* with the other tensors of the launch"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_launcher_raises_the_contract_violation_before_any_kernel_runs(case, kernel_device):
    broken, message = BROKEN[case]
    args = {**_reduce_args(kernel_device), **broken(kernel_device)}
    with pytest.raises(ContractError, match=message) as err:
        channel_reduce_forward(**args)
    assert "\n" not in str(err.value)
    args = _reduce_args(kernel_device)
    channel_reduce_forward(**args)  # the valid call still plans and runs
    torch.testing.assert_close(args["out"], args["y"].amax(1))


def test_reduction_kind_groups():
    members = {
        is_extremum: {"MIN", "MAX", "AMIN", "AMAX"},
        keeps_winner_index: {"MIN", "MAX"},
        splits_ties: {"AMIN", "AMAX"},
        takes_minimum: {"MIN", "AMIN"},
        sums_values: {"SUM", "MEAN"},
        sums_exponentials: {"LOGSUMEXP", "SOFTMAX", "LOG_SOFTMAX"},
        is_full_size: {"SOFTMAX", "LOG_SOFTMAX"},
    }
    for predicate, names in members.items():
        assert {k.name for k in ReductionKind if predicate(k)} == names, predicate
        assert all(predicate(int(k)) == predicate(k) for k in ReductionKind)  # the kernels pass the value
    assert all(is_kind(k, k.name) and not is_kind(k, "SUM" if k != ReductionKind.SUM else "MEAN") for k in ReductionKind)
    assert {k.name for k in ReductionKind if backward_reads_y(k, has_pre_chain=False)} == {
        "AMIN", "AMAX", "LOGSUMEXP", "SOFTMAX", "LOG_SOFTMAX"}  # fmt: skip
    assert {k.name for k in ReductionKind if backward_reads_y(k, has_pre_chain=True)} == {
        "AMIN", "AMAX", "SUM", "MEAN", "LOGSUMEXP", "SOFTMAX", "LOG_SOFTMAX"}  # fmt: skip
    assert ReductionKind.named("log_softmax") is ReductionKind.LOG_SOFTMAX
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        ReductionKind.named("median")


@triton.jit
def _kind_probe_kernel(out_ptr, KIND: tl.constexpr):
    if takes_minimum(KIND):
        tl.store(out_ptr, -1.0)
    elif is_kind(KIND, "SUM"):
        tl.store(out_ptr, 5.0)
    else:
        tl.store(out_ptr, 0.0)


@pytest.mark.parametrize("kind, expected", [(ReductionKind.AMIN, -1.0), (ReductionKind.SUM, 5.0), (ReductionKind.MAX, 0.0)])
def test_reduction_kind_values_are_kernel_constexprs(kind, expected, kernel_device):
    out = torch.full((1,), 7.0, device=kernel_device)
    _kind_probe_kernel[(1,)](out, KIND=kind)
    _kind_probe_kernel[(1,)](out, KIND=int(kind))
    assert out.item() == expected
