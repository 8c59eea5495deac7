"""The algebraic global mean of a convolution is exact: index sets, formula and Triton kernels.

``conv_global_mean`` never produces the conv output; it sums x over per-tap index sets (arithmetic
progressions for a regular strided conv, ranges for a transposed conv).  These tests pin that down
against brute force: the 1-d sets against enumeration of the conv's index map, the whole formula
against ``F.conv*`` + ``mean`` in float64 over many random configurations (1-d/2-d/3-d, regular and
transposed, stride/padding/dilation/output_padding/groups, odd sizes), and the Triton kernels
(interpreter on CPU, fp32) against the torch reference on a subset.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops import conv_global_mean as cgm
from fusion_backend.ops.conv_global_mean import ConvGlobalMeanConfig, conv_global_mean, dim_sets


@dataclass(frozen=True)
class Case:
    """One random convolution problem (sizes included)."""

    nd: int
    transposed: bool
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]
    groups: int
    c_in: int
    c_out: int
    size: tuple[int, ...]

    @property
    def spec(self) -> ConvSpec:
        return ConvSpec(
            self.transposed, self.stride, self.padding, self.dilation, self.output_padding, self.groups
        )

    def weight_shape(self) -> tuple[int, ...]:
        if self.transposed:
            return (self.c_in, self.c_out // self.groups, *self.kernel)
        return (self.c_out, self.c_in // self.groups, *self.kernel)

    def conv(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if self.transposed:
            fn = getattr(F, f"conv_transpose{self.nd}d")
            return fn(x, w, b, self.stride, self.padding, self.output_padding, self.groups, self.dilation)
        return getattr(F, f"conv{self.nd}d")(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def valid(self) -> bool:
        """Whether torch accepts the problem (non-empty output, output_padding rule)."""
        for L, k, s, p, d, op in zip(
            self.size, self.kernel, self.stride, self.padding, self.dilation, self.output_padding, strict=True
        ):
            if self.transposed:
                if op >= max(s, d) or (L - 1) * s - 2 * p + d * (k - 1) + op + 1 <= 0:
                    return False
            elif (L + 2 * p - d * (k - 1) - 1) // s + 1 <= 0:
                return False
        return True


def random_case(rng: random.Random, nd: int, transposed: bool) -> Case:
    """A random valid problem; output_padding < max(stride, dilation) as torch requires."""
    while True:
        stride = tuple(rng.randint(1, 3) for _ in range(nd))
        dilation = tuple(rng.randint(1, 2) for _ in range(nd))
        groups = rng.randint(1, 2)
        case = Case(
            nd=nd,
            transposed=transposed,
            kernel=tuple(rng.randint(1, 4) for _ in range(nd)),
            stride=stride,
            padding=tuple(rng.randint(0, 2) for _ in range(nd)),
            dilation=dilation,
            output_padding=tuple(rng.randint(0, max(s, d) - 1) for s, d in zip(stride, dilation, strict=True))
            if transposed
            else (0,) * nd,
            groups=groups,
            c_in=groups * rng.randint(1, 2),
            c_out=groups * rng.randint(1, 2),
            size=tuple(rng.randint(1, 9 if nd < 3 else 6) for _ in range(nd)),
        )
        if case.valid():
            return case


def case_tensors(
    case: Case, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((2, case.c_in, *case.size), generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(case.weight_shape(), generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn((case.c_out,), generator=gen, dtype=torch.float64).to(dtype)
    return x, w, b


def brute_force_sets(transposed: bool, L: int, k: int, s: int, p: int, d: int, op: int) -> list[set[int]]:
    """For each tap, the input indices connected to an in-bounds output, by enumerating the index map."""
    if transposed:
        out_len = (L - 1) * s - 2 * p + d * (k - 1) + op + 1
        return [{i for i in range(L) if 0 <= i * s - p + t * d < out_len} for t in range(k)]
    out_len = (L + 2 * p - d * (k - 1) - 1) // s + 1
    return [{o * s - p + t * d for o in range(out_len)} & set(range(L)) for t in range(k)]


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_dim_sets_match_enumerated_index_map(transposed: bool) -> None:
    checked = 0
    for L in range(1, 10):
        for k in range(1, 5):
            for s in range(1, 4):
                for p in range(0, 3):
                    for d in range(1, 3):
                        for op in range(0, max(s, d)) if transposed else (0,):
                            expected = brute_force_sets(transposed, L, k, s, p, d, op)
                            out_len = (
                                (L - 1) * s - 2 * p + d * (k - 1) + op + 1
                                if transposed
                                else (L + 2 * p - d * (k - 1) - 1) // s + 1
                            )
                            if out_len <= 0:
                                continue
                            ds = dim_sets(transposed, L, k, s, p, d, op)
                            assert ds.out_length == out_len
                            got = [set(ds.members(ds.tap_to_set[t])) for t in range(k)]
                            assert got == expected, (transposed, L, k, s, p, d, op)
                            assert len(set(ds.sets)) == len(ds.sets), "sets must be deduplicated"
                            checked += 1
    assert checked > 500


def test_strided_conv_sets_are_progressions_not_ranges() -> None:
    # Conv1d k=3, s=2, p=1 on L=6: tap 0 reads x[-1], x[1], x[3] -> {1, 3}; tap 1 -> {0, 2, 4}.
    ds = dim_sets(False, 6, 3, 2, 1, 1, 0)
    assert [list(ds.members(ds.tap_to_set[t])) for t in range(3)] == [[1, 3], [0, 2, 4], [1, 3, 5]]
    # ConvTranspose1d with stride 2: every tap sees a contiguous range.
    dt = dim_sets(True, 4, 3, 2, 1, 1, 1)
    assert [list(dt.members(dt.tap_to_set[t])) for t in range(3)] == [[1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]


def test_transposed_zero_padding_stride_one_has_one_set_per_dim() -> None:
    # The global-mean pipeline's ConvTranspose2d(k=3): every tap sees the whole input, so the kernel
    # reduces each plane to a single sum (the "Σ x @ Σ_taps W" special case).
    ds = dim_sets(True, 512, 3, 1, 0, 1, 0)
    assert ds.sets == ((0, 511),) and ds.tap_to_set == (0, 0, 0)


def test_dim_sets_rejects_empty_output() -> None:
    from fusion_backend.errors import UnsupportedInputError

    with pytest.raises(UnsupportedInputError, match="output length"):
        dim_sets(False, 2, 5, 1, 0, 1, 0)


CASES_PER_GROUP = 40


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_reference_formula_matches_conv_then_mean_float64(nd: int, transposed: bool) -> None:
    rng = random.Random(1000 * nd + transposed)
    for i in range(CASES_PER_GROUP):
        case = random_case(rng, nd, transposed)
        x, w, b = case_tensors(case, torch.float64, seed=i)
        expected = case.conv(x, w, b).mean(dim=tuple(range(2, 2 + nd)))
        config = ConvGlobalMeanConfig(case.spec).to_json()
        got = conv_global_mean(x, w, b, [], config)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=lambda m, c=case: f"{c}\n{m}")


TRITON_CASES = 4


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_triton_kernels_match_reference_fp32(nd: int, transposed: bool, kernel_device: str) -> None:
    """Both kernels against the torch reference on the same geometry, and the whole forward vs fp64."""
    from fusion_backend.kernels.global_mean import set_broadcast, set_sums

    rng = random.Random(77 + 10 * nd + transposed)
    for i in range(TRITON_CASES):
        case = random_case(rng, nd, transposed)
        x, w, b = case_tensors(case, torch.float64, seed=100 + i)
        geo = cgm.config.geometry_for(case.spec, case.size, case.kernel, torch.device(kernel_device))
        assert geo.bits is not None
        x32 = x.to(device=kernel_device, dtype=torch.float32)
        # x (N, C, *size) -> x5 (N, C, D, H, W), sums over sets (reference in float64).
        masks = [m.to(torch.float64).cpu() for m in geo.masks]
        x5 = cgm.config.as_5d(x)
        expected = torch.einsum("ncdhw,ad,bh,ew->ncabe", x5, *masks).reshape(2, case.c_in, -1)
        got = set_sums(cgm.config.as_5d(x32), geo.bits, geo.set_counts, split=1 + i % 3)
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-5)

        q = torch.randn(expected.shape, dtype=torch.float64)
        expected_grad = torch.einsum(
            "ncabe,ad,bh,ew->ncdhw", q.reshape(2, case.c_in, *geo.set_counts), *masks
        )
        out = torch.empty(x5.shape, dtype=torch.float32, device=kernel_device)
        set_broadcast(q.to(kernel_device), geo.bits, geo.set_counts, out, split=1 + i % 2)
        torch.testing.assert_close(out.double().cpu(), expected_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shape", [(1, 2, 1, 1, 300), (1, 1, 3, 37, 5), (2, 1, 1, 40, 260)], ids=["wide", "deep", "both"]
)
def test_triton_set_sums_tiles_rows_and_columns(shape: tuple[int, ...], kernel_device: str) -> None:
    """Planes larger than one tile in either direction, with random bit tables and row splits."""
    from fusion_backend.kernels.global_mean import set_broadcast, set_sums

    gen = torch.Generator().manual_seed(3)
    counts = (2, 3, 4)
    bits = tuple(
        torch.randint(0, 2**j, (size,), generator=gen, dtype=torch.int32).to(kernel_device)
        for size, j in zip(shape[2:], counts, strict=True)
    )
    masks = [
        ((b.cpu()[None, :] >> torch.arange(j)[:, None]) & 1).double()
        for b, j in zip(bits, counts, strict=True)
    ]
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    expected = torch.einsum("ncdhw,ad,bh,ew->ncabe", x, *masks).reshape(shape[0], shape[1], -1)
    for split in (1, 4):
        got = set_sums(x.float().to(kernel_device), bits, counts, split=split)
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-4)
    q = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    expected_grad = torch.einsum("ncabe,ad,bh,ew->ncdhw", q.reshape(shape[0], shape[1], *counts), *masks)
    out = torch.empty(shape, dtype=torch.float32, device=kernel_device)
    set_broadcast(q.to(kernel_device), bits, counts, out, split=3)
    torch.testing.assert_close(out.double().cpu(), expected_grad, rtol=1e-5, atol=1e-5)


def test_triton_forward_via_op_matches_conv_float64(
    monkeypatch: pytest.MonkeyPatch, kernel_device: str
) -> None:
    """End to end through the op with the Triton launchers (``FUSION_CPU_KERNELS=triton`` on CPU)."""
    monkeypatch.setenv(cgm.CPU_KERNELS_ENV, "triton")
    rng = random.Random(5)
    for i, (nd, transposed) in enumerate(
        [(1, False), (2, True), (3, False), (2, False), (3, True), (1, True)]
    ):
        case = random_case(rng, nd, transposed)
        x, w, b = case_tensors(case, torch.float64, seed=200 + i)
        expected = case.conv(x, w, b).mean(dim=tuple(range(2, 2 + nd)))
        config = ConvGlobalMeanConfig(case.spec, strict=True).to_json()
        assert cgm.kernel_path(config, torch.float32, kernel_device)[0] == "triton"
        dev = [t.to(kernel_device, torch.float32) for t in (x, w, b)]
        got = conv_global_mean(*dev, [], config)
        scale = expected.abs().max().item()
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-5 * scale)
