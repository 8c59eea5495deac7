"""The conv-epilogue Triton kernels, called through their launchers on ``kernel_device`` tensors.

Every case compares against a float64 oracle built from ``chain.apply_step`` and ``F.*_pool*d``
with autograd: the forward output, the max-pool winners (index within the window, and y at the
winner), the full-size gradient of the conv output, and the per-channel operand and bias gradients.
Under ``TRITON_INTERPRET=1`` (no CUDA) the same kernels run on CPU tensors, so shapes are tiny.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.ir.specs import PoolSpec
from fusion_backend.kernels import chain_math
from fusion_backend.kernels import epilogue as K
from fusion_backend.ops.chain import SOURCE_STRIDE, PointwiseKind, apply_step

PK = PointwiseKind


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error (NaNs must sit at the same positions)."""
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN positions differ"
    keep = ~torch.isnan(want)
    return ((got[keep] - want[keep]).norm() / want[keep].norm().clamp_min(1e-30)).item()


@dataclass
class Case:
    """One launcher-level problem: y (N, C, *spatial), a chain, an optional pool."""

    shape: tuple[int, ...]
    steps: list[tuple[PointwiseKind, list]] = field(default_factory=list)  # operands: float | "t" | tensor
    pool: PoolSpec | None = None
    ceil_mode: bool = False
    bias: bool = True
    channels_last: bool = False
    dtype: torch.dtype = torch.float32
    seed: int = 0


def _pool_ref(v: torch.Tensor, case: Case, return_indices: bool = False):
    pool = case.pool
    d = v.dim() - 2
    if pool.kind == "max":
        fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[d - 1]
        return fn(v, pool.kernel_size, pool.stride, pool.padding, ceil_mode=case.ceil_mode,
                  return_indices=return_indices)  # fmt: skip
    if d == 1:
        out = F.avg_pool2d(v.unsqueeze(-2), (1, *pool.kernel_size), (1, *pool.stride), (0, *pool.padding),
                           case.ceil_mode, pool.count_include_pad, pool.divisor_override)  # fmt: skip
        return out.squeeze(-2)
    fn = F.avg_pool2d if d == 2 else F.avg_pool3d
    return fn(v, pool.kernel_size, pool.stride, pool.padding, case.ceil_mode, pool.count_include_pad,
              pool.divisor_override)  # fmt: skip


def _window_index(flat: torch.Tensor, spatial: list[int], pool: PoolSpec) -> torch.Tensor:
    """torch's flat in-plane max-pool indices -> row-major index within each window."""
    win = torch.zeros_like(flat)
    dims = len(spatial)
    for j in range(dims):
        coord = (flat // math.prod(spatial[j + 1 :])) % spatial[j]
        shape = [1] * (dims + 2)
        shape[2 + j] = flat.shape[2 + j]
        origin = (torch.arange(flat.shape[2 + j]) * pool.stride[j] - pool.padding[j]).reshape(shape)
        win += (coord - origin) * math.prod(pool.kernel_size[j + 1 :])
    return win


def _materialise(case: Case, device: str):
    """Random inputs: y, bias, kernel steps (with per-channel operand tensors), grad_out."""
    g = torch.Generator().manual_seed(case.seed)
    c = case.shape[1]
    y = torch.randn(case.shape, generator=g)
    bias = torch.randn(c, generator=g) if case.bias else None
    steps = []
    for kind, values in case.steps:
        vals = []
        for v in values:
            if isinstance(v, str):  # "t": a fresh per-channel tensor, kept away from 0 (div/rdiv)
                t = torch.randn(c, generator=g)
                vals.append(t.sign() * (t.abs() + 0.5))
            else:
                vals.append(v)
        steps.append((kind, vals))
    return y, bias, steps, g


def _oracle(y, bias, steps, case: Case, grad_out_gen):
    """float64 forward (+ winners) and gradients by autograd."""
    nd = y.dim()
    y64 = y.double().requires_grad_()
    ops64 = []
    v = y64 if bias is None else y64 + bias.double().reshape(1, -1, *[1] * (nd - 2))
    for kind, vals in steps:
        args = []
        for j, val in enumerate(vals):
            if isinstance(val, torch.Tensor):
                t = val.double().reshape(-1, *[1] * (nd - 2)) if val.dim() else val.double()
                if j in kind.differentiable_operands:
                    t = t.detach().requires_grad_()
                    ops64.append(t)
                args.append(t)
            else:
                args.append(val)
        v = apply_step(kind, v, args)
    idx = None
    if case.pool is not None:
        if case.pool.kind == "max":
            v, idx = _pool_ref(v, case, return_indices=True)
        else:
            v = _pool_ref(v, case)
    grad_out = torch.randn(v.shape, generator=grad_out_gen)
    grads = torch.autograd.grad(v, [y64, *ops64], grad_out.double())
    return v.detach(), idx, grad_out, grads[0], list(grads[1:])


def run_case(case: Case, device: str, rtol: float | None = None) -> dict:
    y, bias, steps, g = _materialise(case, device)
    if case.dtype != torch.float32:
        y = y.to(case.dtype)  # the oracle sees the rounded values too
    want, idx, grad_out, want_gy, want_gops = _oracle(y, bias, steps, case, g)
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(y.dim()) if case.channels_last else None
    y_dev = y.to(device)
    if fmt is not None:
        y_dev = y_dev.contiguous(memory_format=fmt)
    kernel_steps = [
        (kind.code, [v.to(device) if isinstance(v, torch.Tensor) else v for v in vals])
        for kind, vals in steps
    ]
    b_dev = None if bias is None else bias.to(device)
    out = torch.empty(
        want.shape, dtype=case.dtype, device=device, memory_format=fmt or torch.contiguous_format
    )
    winner = winner_y = None
    if case.pool is not None and case.pool.kind == "max":
        wdtype = torch.int8 if case.pool.window_volume <= 127 else torch.int32
        winner = torch.empty(
            out.shape, dtype=wdtype, device=device, memory_format=fmt or torch.contiguous_format
        )
        winner_y = torch.empty_like(out, dtype=y.dtype)
    K.epilogue_forward(y_dev, b_dev, kernel_steps, case.pool, out, winner, winner_y)

    tol = rtol if rtol is not None else (1e-5 if case.dtype == torch.float32 else 2e-3)
    assert rel_err(out, want) <= tol
    if winner is not None:
        spatial = list(y.shape[2:])
        expect = _window_index(idx, spatial, case.pool)
        assert torch.equal(winner.cpu().long(), expect), "winner index differs from PyTorch's max-pool choice"
        expect_y = y.reshape(*y.shape[:2], -1).gather(2, idx.reshape(*idx.shape[:2], -1)).reshape(idx.shape)
        assert torch.equal(winner_y.cpu(), expect_y)

    grad_y = torch.empty_like(y_dev)
    slots = [bool(kind.differentiable_operands) and isinstance(vals[0], torch.Tensor) for kind, vals in steps]
    slot_grads, bias_grad = K.epilogue_backward(
        grad_out.to(device, case.dtype), None if winner is not None else y_dev, winner, winner_y, b_dev,
        kernel_steps, case.pool, grad_y, slots, bias is not None,
    )  # fmt: skip
    assert rel_err(grad_y, want_gy) <= tol
    got_gops = [gr for gr, s in zip(slot_grads, slots, strict=True) if s]
    for got, exp in zip(got_gops, want_gops, strict=True):
        # per-channel sums; a scalar operand's gradient is their total
        assert (
            rel_err(got if exp.numel() > 1 else got.sum(), exp.reshape(-1) if exp.numel() > 1 else exp)
            <= tol * 5
        )
    if bias is not None:
        assert rel_err(bias_grad, want_gy.sum([d for d in range(want_gy.dim()) if d != 1])) <= tol * 5
    return dict(out=out, grad_y=grad_y, slot_grads=slot_grads, bias_grad=bias_grad, winner=winner)


# --- every pointwise kind ------------------------------------------------------------------------

_KIND_OPERANDS = {
    PK.LEAKY_RELU: [0.1],
    PK.CLAMP: [-0.5, 0.7],
    PK.CLAMP_MIN: [-0.3],
    PK.CLAMP_MAX: [0.4],
    PK.HARDTANH: [-0.6, 0.5],
}


@pytest.mark.parametrize("kind", list(PointwiseKind), ids=lambda k: k.name.lower())
def test_every_pointwise_kind_matches_torch_forward_and_backward(kind, kernel_device):
    operands = _KIND_OPERANDS.get(kind, ["t"] * kind.arity)
    # rdiv divides by the flowing value: keep it away from 0 with a sigmoid in front
    chain = [(PK.SIGMOID, []), (kind, operands)] if kind is PK.RDIV else [(kind, operands)]
    run_case(Case((2, 3, 5, 7), chain), kernel_device)


def _kink_inputs(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).reshape(1, 1, 1, -1)


@pytest.mark.parametrize(
    "kind, operands, points, expected_grad",
    [
        (PK.RELU, [], [0.0, -0.0, 1.0, -1.0], [0.0, 0.0, 1.0, 0.0]),
        (PK.LEAKY_RELU, [0.25], [0.0, 1.0, -1.0], [0.25, 1.0, 0.25]),
        (PK.CLAMP, [-1.0, 1.0], [-1.0, 1.0, 2.0, 0.5], [1.0, 1.0, 0.0, 1.0]),  # inclusive bounds
        (PK.HARDTANH, [-1.0, 1.0], [-1.0, 1.0, 2.0, 0.5], [0.0, 0.0, 0.0, 1.0]),  # strict bounds
        (PK.CLAMP_MIN, [0.5], [0.5, 0.4, 0.6], [1.0, 0.0, 1.0]),
        (PK.CLAMP_MAX, [0.5], [0.5, 0.4, 0.6], [1.0, 1.0, 0.0]),
        (PK.MINIMUM, [0.5], [0.5, 0.4, 0.6], [0.5, 1.0, 0.0]),  # a tie splits the gradient
        (PK.MAXIMUM, [0.5], [0.5, 0.4, 0.6], [0.5, 0.0, 1.0]),
        (PK.HARDSWISH, [], [-3.0, 3.0, -4.0, 4.0, 0.0, 1.5], [0.0, 1.0, 0.0, 1.0, 0.5, 1.0]),  # open interval
    ],
)
def test_gradients_at_kinks_follow_torch(kind, operands, points, expected_grad, kernel_device):
    y = _kink_inputs(points).to(kernel_device)
    steps = [(kind.code, operands)]
    out = torch.empty_like(y)
    K.epilogue_forward(y, None, steps, None, out)
    want = apply_step(kind, y.double().cpu(), operands)
    assert torch.equal(out.cpu().double(), want)
    grad_y = torch.empty_like(y)
    K.epilogue_backward(torch.ones_like(y), y, None, None, None, steps, None, grad_y)
    ref = y.double().cpu().requires_grad_()
    (torch_grad,) = torch.autograd.grad(apply_step(kind, ref, operands).sum(), ref)
    assert grad_y.cpu().reshape(-1).tolist() == expected_grad == torch_grad.reshape(-1).tolist()


def test_nan_propagates_through_every_kind_like_torch(kernel_device):
    y = torch.tensor([float("nan"), 1.0, -1.0]).reshape(1, 1, 1, 3).to(kernel_device)
    for kind in PointwiseKind:
        operands = _KIND_OPERANDS.get(kind, [0.7] * kind.arity)
        out = torch.empty_like(y)
        K.epilogue_forward(y, None, [(kind.code, operands)], None, out)
        want = apply_step(kind, y.cpu().double(), operands)
        assert torch.isnan(out[0, 0, 0, 0]).item() == torch.isnan(want[0, 0, 0, 0]).item(), kind


# --- chains, operands, layouts, dtypes -------------------------------------------------------------

LONG_CHAIN = [
    (PK.MUL, ["t"]), (PK.LEAKY_RELU, [0.2]), (PK.ADD, ["t"]), (PK.GELU, []), (PK.SUB, ["t"]),
    (PK.TANH, []), (PK.DIV, ["t"]), (PK.RSUB, ["t"]),
]  # fmt: skip


def test_a_full_eight_step_chain_with_a_pool(kernel_device):
    run_case(Case((2, 3, 6, 5), LONG_CHAIN, PoolSpec("max", (3, 2), (2, 1), (1, 0))), kernel_device)


def test_a_six_step_chain_of_transcendental_ops(kernel_device):
    chain = [(PK.SILU, []), (PK.MUL, ["t"]), (PK.MISH, []), (PK.GELU_TANH, []), (PK.SIGMOID, []),
             (PK.HARDSWISH, [])]  # fmt: skip
    run_case(Case((2, 4, 9), chain), kernel_device)


def test_scalar_and_tensor_operands_in_non_differentiable_positions(kernel_device):
    slope = torch.tensor(0.3)
    lo, hi = torch.tensor(-0.4), torch.full((3,), 0.6)
    run_case(Case((2, 3, 4, 4), [(PK.LEAKY_RELU, [slope]), (PK.CLAMP, [lo, hi]), (PK.MUL, [torch.tensor(-1.5)])]),
             kernel_device)  # fmt: skip


@pytest.mark.parametrize("pool", [None, PoolSpec("max", (2, 2), (2, 2), (0, 0))], ids=["no-pool", "max-pool"])
def test_tensor_clamp_bounds_get_their_gradient(pool, kernel_device):
    """A per-channel clamp_min bound and a clamp_max bound (tensors) receive the gradient where they
    were taken, next to an arithmetic operand; the oracle is autograd in float64."""
    chain = [(PK.MUL, ["t"]), (PK.CLAMP_MIN, ["t"]), (PK.CLAMP_MAX, ["t"])]
    run_case(Case((2, 3, 6, 5), chain, pool), kernel_device)


def test_empty_chain_without_bias_copies(kernel_device):
    run_case(Case((2, 3, 4, 5), [], bias=False), kernel_device)


@pytest.mark.parametrize("shape", [(2, 5, 4, 6), (1, 3, 3, 4, 5)], ids=["2d", "3d"])
@pytest.mark.parametrize("pool", [None, "max", "avg"])
def test_channels_last_tensors_are_read_and_written_in_place(shape, pool, kernel_device):
    nd = len(shape) - 2
    geometry = None if pool is None else PoolSpec(pool, (2,) * nd, (2,) * nd, (1,) * nd)
    run_case(
        Case(shape, [(PK.MUL, ["t"]), (PK.LEAKY_RELU, [0.2])], geometry, channels_last=True), kernel_device
    )


@pytest.mark.parametrize("pool", [None, "max", "avg"])
def test_fp16_storage_with_fp32_math(pool, kernel_device):
    geometry = None if pool is None else PoolSpec(pool, (2, 2), (2, 2), (0, 0))
    run_case(
        Case((2, 3, 6, 6), [(PK.MUL, ["t"]), (PK.GELU, [])], geometry, dtype=torch.float16), kernel_device
    )


# --- pools ---------------------------------------------------------------------------------------

POOLS = [
    # (spatial shape, pool, ceil_mode)
    ((9,), PoolSpec("max", (3,), (2,), (1,)), False),
    ((9,), PoolSpec("avg", (3,), (2,), (1,), count_include_pad=False), True),
    ((7, 6), PoolSpec("max", (2, 2), (2, 2), (0, 0)), False),
    ((7, 6), PoolSpec("max", (3, 3), (2, 2), (1, 1)), True),  # overlapping, padding, ceil
    ((7, 5), PoolSpec("max", (3, 2), (1, 2), (0, 1)), True),  # stride < kernel in one dim
    ((7, 6), PoolSpec("avg", (3, 3), (2, 2), (1, 1)), True),  # partial windows, include pad
    ((7, 6), PoolSpec("avg", (3, 3), (2, 2), (1, 1), count_include_pad=False), True),
    ((7, 6), PoolSpec("avg", (2, 3), (2, 2), (1, 1), divisor_override=5), False),
    ((5, 5), PoolSpec("max", (2, 2), (3, 3), (0, 0)), False),  # stride > kernel: gaps
    ((5, 4, 5), PoolSpec("max", (2, 2, 2), (2, 2, 2), (0, 0, 0)), True),
    ((5, 4, 5), PoolSpec("max", (3, 3, 3), (2, 2, 2), (1, 1, 1)), False),
    ((5, 4, 5), PoolSpec("avg", (3, 2, 3), (2, 1, 2), (1, 0, 1), count_include_pad=False), True),
]


@pytest.mark.parametrize(
    "spatial, pool, ceil_mode", POOLS, ids=[f"{len(s)}d-{p.kind}-{i}" for i, (s, p, _) in enumerate(POOLS)]
)
def test_pools_match_torch_including_partial_and_overlapping_windows(spatial, pool, ceil_mode, kernel_device):
    chain = [(PK.MUL, ["t"]), (PK.LEAKY_RELU, [0.1]), (PK.ADD, ["t"])]
    run_case(Case((2, 3, *spatial), chain, pool, ceil_mode=ceil_mode), kernel_device)


def test_negative_multipliers_flip_the_max_pool_winner(kernel_device):
    case = Case(
        (2, 4, 6, 6),
        [(PK.MUL, [torch.tensor([-1.0, 2.0, -0.5, 1.0])])],
        PoolSpec("max", (2, 2), (2, 2), (0, 0)),
    )
    run_case(case, kernel_device)


@pytest.mark.parametrize("padding", [0, 1])
def test_tied_windows_pick_the_first_valid_element(padding, kernel_device):
    # A zero multiplier makes every value of channel 1 equal: the first valid tap wins, as in torch
    # (with padding, the first valid tap of a border window is not tap 0).
    m = torch.tensor([1.0, 0.0, -2.0])
    pool = PoolSpec("max", (3, 3), (2, 2), (padding, padding))
    res = run_case(Case((1, 3, 7, 7), [(PK.MUL, [m]), (PK.GELU, [])], pool, bias=False), kernel_device)
    assert res["winner"][0, 1, 1, 1].item() == 0
    if padding:
        assert res["winner"][0, 1, 0, 0].item() == 4  # (kh, kw) = (1, 1)


def test_nan_wins_and_a_later_nan_replaces_an_earlier_one(kernel_device):
    y = torch.randn(1, 2, 4, 4)
    y[0, 0, 0, 1] = float("nan")  # window (0, 0): NaN at tap 1
    y[0, 0, 1, 0] = float("nan")  # ... and a later NaN at tap 2: it wins
    y[0, 1, 3, 3] = float("nan")
    steps = [(PK.LEAKY_RELU.code, [0.2]), (PK.MUL.code, [torch.tensor([1.0, -1.0])])]
    y_dev = y.to(kernel_device)
    pool = PoolSpec("max", (2, 2), (2, 2), (0, 0))
    out = torch.empty(1, 2, 2, 2, device=kernel_device)
    winner = torch.empty(out.shape, dtype=torch.int8, device=kernel_device)
    winner_y = torch.empty_like(out)
    K.epilogue_forward(y_dev, None, steps, pool, out, winner, winner_y)
    v = F.leaky_relu(y, 0.2) * torch.tensor([1.0, -1.0]).reshape(1, 2, 1, 1)
    want, idx = F.max_pool2d(v, 2, return_indices=True)
    assert torch.equal(torch.isnan(out.cpu()), torch.isnan(want))
    assert torch.equal(winner.cpu().long(), _window_index(idx, [4, 4], pool))
    assert winner[0, 0, 0, 0].item() == 2
    grad_y = torch.empty_like(y_dev)
    K.epilogue_backward(torch.ones_like(out), None, winner, winner_y, None, steps, pool, grad_y)
    ref = y.clone().requires_grad_()
    F.max_pool2d(F.leaky_relu(ref, 0.2) * torch.tensor([1.0, -1.0]).reshape(1, 2, 1, 1), 2).sum().backward()
    assert torch.equal(torch.isnan(grad_y.cpu()), torch.isnan(ref.grad))
    assert torch.allclose(grad_y.cpu().nan_to_num(), ref.grad.nan_to_num())


# --- strides, determinism, contracts ---------------------------------------------------------------


def test_expanded_grad_out_with_zero_strides(kernel_device):
    y = torch.randn(2, 3, 4, 5, device=kernel_device)
    m = torch.randn(3, device=kernel_device)
    steps = [(PK.MUL.code, [m]), (PK.SILU.code, [])]
    grad_out = torch.ones((), device=kernel_device).expand(2, 3, 4, 5)
    grad_y = torch.empty_like(y)
    (gm, _), _ = K.epilogue_backward(grad_out, y, None, None, None, steps, None, grad_y, [True, False])
    ref_y = y.cpu().double().requires_grad_()
    ref_m = m.cpu().double().requires_grad_()
    F.silu(ref_y * ref_m.reshape(1, 3, 1, 1)).sum().backward()
    assert rel_err(grad_y, ref_y.grad) < 1e-5 and rel_err(gm, ref_m.grad) < 1e-5


def test_backward_sums_are_bitwise_reproducible(kernel_device):
    y = torch.randn(3, 4, 9, 10, device=kernel_device)
    m, b = torch.randn(4, device=kernel_device), torch.randn(4, device=kernel_device)
    steps = [(PK.MUL.code, [m]), (PK.GELU.code, [])]
    grad_out = torch.randn_like(y)
    runs = []
    for _ in range(2):
        grad_y = torch.empty_like(y)
        (gm, _), gb = K.epilogue_backward(
            grad_out, y, None, None, b, steps, None, grad_y, [True, False], True
        )
        runs.append((grad_y, gm, gb))
    for a, b_ in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b_)


def test_params_matrix_layout():
    m = torch.arange(3.0)
    params = K.build_params([(PK.LEAKY_RELU.code, [0.5]), (PK.CLAMP.code, [torch.tensor(-1.0), m])],
                            torch.ones(3), 3, torch.device("cpu"))  # fmt: skip
    assert params.shape == (K.NUM_PARAM_ROWS, 3) and params.dtype == torch.float32
    assert params[K.BIAS_ROW].tolist() == [1.0, 1.0, 1.0]
    assert params[1].tolist() == [0.5] * 3  # slot 0, first operand
    assert params[3].tolist() == [-1.0] * 3 and params[4].tolist() == [0.0, 1.0, 2.0]  # slot 1
    with pytest.raises(ValueError, match="1 or 3 elements"):
        K.build_params([(PK.MUL.code, [torch.ones(2)])], None, 3, torch.device("cpu"))


def test_kernel_op_codes_mirror_the_catalogue():
    assert chain_math.OP_CODES == {kind.name.lower(): kind.code for kind in PointwiseKind}
    assert chain_math.OPERAND_GRAD_CODES == {kind.code for kind in PointwiseKind if kind.differentiable_operands}
    assert chain_math.SOURCE_STRIDE == SOURCE_STRIDE == 32  # the jit functions spell it 32
    assert max(kind.code for kind in PointwiseKind) < SOURCE_STRIDE
    assert K.MAX_SLOTS == 8


@pytest.mark.parametrize("pool", [None, "max"])
def test_strided_views_as_inputs(pool, kernel_device):
    # A view whose spatial dims do not flatten: read through per-dim strides with a pool, copied
    # into out's layout without one.
    base = torch.randn(2, 3, 6, 10, device=kernel_device)
    y = base[:, :, 1:, ::2]
    m = torch.randn(3, device=kernel_device)
    steps = [(PK.MUL.code, [m]), (PK.RELU.code, [])]
    v = torch.relu(y.cpu().double() * m.cpu().double().reshape(1, 3, 1, 1))
    geometry = None if pool is None else PoolSpec("max", (2, 2), (2, 2), (0, 0))
    want = v if pool is None else F.max_pool2d(v, 2)
    out = torch.empty(want.shape, device=kernel_device)
    winner = None if pool is None else torch.empty(want.shape, dtype=torch.int8, device=kernel_device)
    winner_y = None if pool is None else torch.empty_like(out)
    K.epilogue_forward(y, None, steps, geometry, out, winner, winner_y)
    assert rel_err(out, want) < 1e-6


@pytest.mark.heavy
def test_the_epilogue_kernels_compile_for_sm90_without_spills(sm90_compile_check) -> None:
    """The interpreter runs code the GPU compiler refuses (a tuple element passed on as a constexpr
    argument compiled as a runtime value): the epilogue kernels with a chain that reads earlier values
    again are compiled for sm_90 here, without a GPU (``tools/compile_check.py epilogue``, in the
    suite's one compile-check process: ``conftest.SM90_COMPILE_CASES``)."""
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends/nvidia/bin").exists():
        pytest.skip("this Triton has no bundled NVIDIA tools")
    out = sm90_compile_check("epilogue")
    assert "_epilogue_bwd_kernel" in out and "epilogue: all kernels compiled without spills" in out, out
